//! The keeper: runs the command for `exec --no-inherit`, so that no process of its tree outlives
//! the locks (docs/design.md, "Inheritance and `--no-inherit`"; docs/reliability.md,
//! "`--no-inherit`: descendants outliving the locks").
//!
//! - PR_SET_PDEATHSIG and signal forwarding reach one process only, so stowage re-executes itself
//!   as the keeper: single-threaded, holding the lock descriptors (the command does not), a child
//!   subreaper, leading its own group (a `kill -9 -PGID` of stowage's leaves it); the command stays
//!   in stowage's group.
//! - Its status is reported only once every process of the tree has exited.
//! - A forwarded termination signal goes to the command, once it is gone to the rest of the tree;
//!   what is left [`GRACE`] later is killed.
//! - stowage's death (even SIGKILL) ends a pipe: the keeper kills and reaps the tree, then exits.
//!   The keeper's death kills the command (PDEATHSIG); stowage, a subreaper too, kills the rest.
//! - Not covered: both killed by SIGKILL at once (`pkill -9 stowage`) leave the tree to init.
//! - Status pipe (keeper → stowage), 8-byte messages: `b"S\0\0\0" + errno` once the command started
//!   (0) or failed to, then `b"X\0\0\0" + wait status` once the tree is gone.

use std::ffi::{OsStr, OsString};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, SigmaskHow};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::{getpgrp, getpid, getppid, getsid, pipe2};

use crate::error::{cvt, retrying};
use crate::lock::set_cloexec;
use crate::spawn::{self, Start};

/// The hidden first argument that makes stowage a keeper.
pub const ARG: &str = "__keeper";

/// How long processes left in the tree after a termination signal have before they are killed.
const GRACE: Duration = Duration::from_secs(5);

const STARTED: u32 = u32::from_le_bytes(*b"S\0\0\0");
const EXITED: u32 = u32::from_le_bytes(*b"X\0\0\0");

/// A running keeper, seen from stowage.
pub struct Keeper {
    pub pid: libc::pid_t,
    status: std::fs::File,
    /// Held open for our whole life: its end tells the keeper we are gone.
    _alive: OwnedFd,
}

/// Makes this process a child subreaper: orphans of its descendants become its children, to end.
pub fn become_subreaper() -> io::Result<()> {
    Ok(nix::sys::prctl::set_child_subreaper(true)?)
}

impl Keeper {
    /// Starts a keeper that runs `argv` with `env`; `lock_fds` must be inheritable during this call.
    /// Returns once the command started (or the keeper ended silently), or with the error that kept
    /// it from starting (the keeper reaped).
    pub fn spawn(
        argv: &[OsString],
        env: &[(OsString, OsString)],
        lock_fds: &[RawFd],
        umask: Option<u32>,
    ) -> io::Result<Keeper> {
        let (status_rd, status_wr) = pipe2(OFlag::O_CLOEXEC)?;
        let (alive_rd, alive_wr) = pipe2(OFlag::O_CLOEXEC)?;
        set_cloexec(status_wr.as_raw_fd(), false)?;
        set_cloexec(alive_rd.as_raw_fd(), false)?;
        let fds: Vec<String> = lock_fds.iter().map(RawFd::to_string).collect();
        let fds = fds.join(",");
        let mut args: Vec<OsString> = vec![
            "stowage".into(),
            ARG.into(),
            status_wr.as_raw_fd().to_string().into(),
            alive_rd.as_raw_fd().to_string().into(),
            getpgrp().to_string().into(),
            umask.map_or("-".to_owned(), |m| m.to_string()).into(),
            (if fds.is_empty() { "-" } else { &fds }).into(),
            "--".into(),
        ];
        args.extend(argv.iter().cloned());
        let exe = c"/proc/self/exe";
        // The keeper starts with our mask, so the signals we take come to it in order, and with the
        // lock waits' own signal blocked too: a program just started has no handler for it.
        let wake = crate::lock::wake_signal();
        // Under the limit on open files we were given: the keeper raises it for itself, and the
        // command gets it.
        let spawned = crate::signals::with_blocked(wake, || {
            crate::dir::with_given_open_files(&[], || {
                spawn::spawn(Some(exe), &args, env, Start::Keeper)
            })
        });
        let pid = spawned.map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot start stowage's keeper process (/proc/self/exe): {e}"),
            )
        })?;
        drop(status_wr);
        drop(alive_rd);
        let mut keeper = Keeper {
            pid,
            status: std::fs::File::from(status_rd),
            _alive: alive_wr,
        };
        match keeper.message() {
            Some((STARTED, errno)) if errno != 0 => {
                let mut st = 0;
                // SAFETY: waitpid on our own child, the keeper.
                let _ = retrying(|| unsafe { libc::waitpid(pid, &mut st, 0) });
                Err(io::Error::from_raw_os_error(errno))
            }
            // Started, or ended silently: taken as started, so the wait finds the keeper gone and
            // kills what is left of the tree (ours: we are a subreaper).
            _ => Ok(keeper),
        }
    }

    fn message(&mut self) -> Option<(u32, i32)> {
        let mut buf = [0u8; 8];
        self.status.read_exact(&mut buf).ok()?;
        let tag = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes"));
        let value = i32::from_le_bytes(buf[4..].try_into().expect("4 bytes"));
        Some((tag, value))
    }

    /// After the keeper exited: the command's wait status; if the keeper died without reporting it,
    /// what is left of the tree (ours: we are a subreaper) is killed, and the outcome is an error.
    pub fn outcome(mut self, keeper: std::process::ExitStatus) -> io::Result<i32> {
        if let Some((EXITED, status)) = self.message() {
            return Ok(status);
        }
        kill_tree();
        Err(io::Error::other(format!(
            "its keeper process (pid {}) ended without reporting the command's status ({keeper}); \
             the command's processes were killed",
            self.pid
        )))
    }
}

/// Every live descendant of this process, through /proc (parents before children).
fn descendants() -> Vec<libc::pid_t> {
    let me = getpid().as_raw();
    let Ok(procs) = crate::ident::numbered::<libc::pid_t>("/proc") else {
        return Vec::new();
    };
    // After the state, the parent's pid.
    let ppid = |stat: String| stat.split_whitespace().nth(1)?.parse().ok();
    let parent_of: Vec<(libc::pid_t, libc::pid_t)> = procs
        .filter_map(|(pid, _)| Some((pid, ppid(crate::ident::stat_fields(pid)?)?)))
        .collect();
    let mut out = vec![me];
    let mut i = 0;
    while let Some(&p) = out.get(i) {
        out.extend(parent_of.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    out.split_off(1)
}

fn signal_tree(sig: i32) {
    for p in descendants() {
        crate::signals::end_or_note(p, sig);
    }
}

/// Kills and reaps every descendant until none is left (one forked meanwhile is orphaned to us).
fn kill_tree() {
    loop {
        signal_tree(libc::SIGKILL);
        let mut st = 0;
        // SAFETY: waitpid on any child; status written to a local.
        let r = unsafe { libc::waitpid(-1, &mut st, 0) };
        if r < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return; // ECHILD: nothing left
        }
    }
}

/// Reaps every child that has exited; returns whether any child is left.
fn reap_exited(command: libc::pid_t, status: &mut Option<i32>) -> bool {
    loop {
        let mut st = 0;
        // SAFETY: waitpid on any child; status written to a local.
        match retrying(|| unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) }) {
            Ok(0) => return true,
            Ok(r) if r == command => *status = Some(st),
            Ok(_) => {}
            Err(_) => return false,
        }
    }
}

/// The keeper's `main`: `args` follow [`ARG`]. What matters is on the status pipe. Never writes to
/// the terminal: in a background group a write may stop it (TOSTOP).
pub fn main(args: &[OsString]) -> u8 {
    u8::from(run(args).is_err())
}

/// One number of the keeper's command line.
fn number<T: std::str::FromStr>(a: impl AsRef<OsStr>) -> io::Result<T> {
    let n = a.as_ref().to_str().and_then(|s| s.parse().ok());
    n.ok_or_else(|| io::ErrorKind::InvalidInput.into())
}

/// Runs the keeper for what [`Keeper::spawn`] put on its command line (`-`: none).
fn run(args: &[OsString]) -> io::Result<()> {
    let invalid = || io::Error::from(io::ErrorKind::InvalidInput);
    let [status_fd, alive_fd, group, umask, lock_fds, sep, argv @ ..] = args else {
        return Err(invalid());
    };
    if sep != "--" || argv.is_empty() {
        return Err(invalid());
    }
    let (status_fd, alive_fd): (RawFd, RawFd) = (number(status_fd)?, number(alive_fd)?);
    // stowage's process group, which the command joins.
    let group: libc::pid_t = number(group)?;
    let umask = (umask != "-").then(|| number(umask)).transpose()?;
    let lock_fds: Vec<RawFd> = match lock_fds.to_str() {
        Some("-") => Vec::new(),
        Some(list) => list.split(',').map(number).collect::<io::Result<_>>()?,
        None => return Err(invalid()),
    };
    // SAFETY: the descriptors were passed to us by stowage and are ours.
    let mut status = unsafe { std::fs::File::from_raw_fd(status_fd) };
    let alive = unsafe { OwnedFd::from_raw_fd(alive_fd) };
    for fd in [status_fd, alive_fd].iter().chain(&lock_fds) {
        set_cloexec(*fd, true)?;
    }
    let (stowage, leader) = (getppid().as_raw(), getsid(None) == Ok(getppid()));
    become_subreaper()?;
    // The signals stowage takes (and passes on here) and SIGCHLD, which arrive blocked (its mask).
    let mut set = crate::signals::taken();
    set.add(nix::sys::signal::Signal::SIGCHLD);
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_BLOCK, Some(&set), None);
    // stowage's lock waits' own signal is not taken: harmless here too (a handler, not an
    // ignored disposition, which the command would inherit).
    crate::lock::disarm_wake_signal();
    let signals = SignalFd::with_flags(&set, SfdFlags::SFD_CLOEXEC)?;
    let mut cmd = command(argv, group, umask);
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            send(&mut status, STARTED, e.raw_os_error().unwrap_or(libc::EIO));
            return Ok(());
        }
    };
    let command = child.id() as libc::pid_t;
    drop(child); // waited for by pid below
    crate::debug::pause("keeper-started");
    send(&mut status, STARTED, 0);
    let mut tree = Tree {
        command,
        stowage,
        group,
        leader,
        ..Tree::default()
    };
    tree.watch(&mut status, &signals, &alive)
}

/// The command, in stowage's process group, mask reset, umask set, dying with the keeper.
fn command(argv: &[OsString], group: libc::pid_t, umask: Option<u32>) -> std::process::Command {
    let me = unsafe { libc::getpid() };
    // The limit on open files our own start was given, as the command's (ours is raised).
    let given = crate::dir::given_open_files().map(|(soft, hard)| libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    });
    let mut cmd = std::process::Command::new(&argv[0]);
    cmd.args(&argv[1..]).process_group(group);
    // SAFETY: only async-signal-safe calls between fork and exec (and this process has one thread).
    unsafe {
        cmd.pre_exec(move || {
            // No signal blocked: the command must not inherit our mask (most programs keep it).
            let none = SigSet::empty();
            nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(&none), None)?;
            if let Some(mask) = umask {
                libc::umask(mask as libc::mode_t);
            }
            if let Some(limit) = &given {
                libc::setrlimit(libc::RLIMIT_NOFILE, limit);
            }
            // If the keeper is killed, so is the command; stowage inherits the rest of the tree.
            cvt(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL))?;
            if libc::getppid() != me {
                libc::_exit(128 + libc::SIGKILL);
            }
            Ok(())
        });
    }
    cmd
}

fn send(status: &mut std::fs::File, tag: u32, value: i32) {
    // If stowage is gone, nobody reads it: that is seen by the watch.
    let _ = status.write_all(&[tag.to_le_bytes(), value.to_le_bytes()].concat());
}

/// The command's tree as the keeper watches it end.
#[derive(Default)]
struct Tree {
    command: libc::pid_t,
    /// stowage's pid: what it queued tagged [`crate::signals::FROM_TERMINAL`] the terminal sent.
    stowage: libc::pid_t,
    /// stowage's process group, and whether stowage leads its session: whether the terminal's
    /// signal reached the command too.
    group: libc::pid_t,
    leader: bool,
    /// The command's wait status, once reaped.
    exit: Option<i32>,
    /// The last termination signal received.
    terminating: Option<i32>,
    /// Leftovers were signalled after the command ended: no success.
    cut_short: bool,
    /// When what is left of the tree is killed.
    kill_at: Option<Instant>,
}

impl Tree {
    /// Waits until the whole tree has exited, forwarding signals, then reports on `status`; if
    /// stowage goes first, kills and reaps the tree.
    fn watch(
        &mut self,
        status: &mut std::fs::File,
        signals: &SignalFd,
        alive: &OwnedFd,
    ) -> io::Result<()> {
        loop {
            let left = reap_exited(self.command, &mut self.exit);
            if let Some(exit) = self.exit {
                if !left {
                    // A success whose leftovers had to be ended by a signal is a death by that
                    // signal (else SIGKILL), so no image is recorded ready.
                    let succeeded = libc::WIFEXITED(exit) && libc::WEXITSTATUS(exit) == 0;
                    let outcome = if self.cut_short && succeeded {
                        self.terminating.unwrap_or(libc::SIGKILL)
                    } else {
                        exit
                    };
                    send(status, EXITED, outcome);
                    return Ok(());
                }
                if self.end_leftovers() {
                    continue;
                }
            }
            let mut fds =
                [signals.as_fd(), alive.as_fd()].map(|fd| PollFd::new(fd, PollFlags::POLLIN));
            // Until the kill, rounded up; none without one.
            let timeout = self.kill_at.map_or(PollTimeout::NONE, |t| {
                let ms = t.saturating_duration_since(Instant::now()).as_millis() + 1;
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            });
            match poll(&mut fds, timeout) {
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
                Ok(_) => {}
            }
            if fds[1].revents() != Some(PollFlags::empty()) {
                // The pipe from stowage ended: only our locks outlive stowage. End the tree, then
                // exit, releasing them.
                kill_tree();
                return Ok(());
            }
            // A failed read is nothing to act on (the kernel reads whole records only).
            if fds[0]
                .revents()
                .is_some_and(|r| r.contains(PollFlags::POLLIN))
                && let Ok(Some(info)) = signals.read_signal()
            {
                self.on_signal(&info);
            }
        }
    }

    /// Once the command has ended: signals the leftovers with a termination signal received, kills
    /// them after [`GRACE`]. Returns whether the tree was just killed (to be reaped).
    fn end_leftovers(&mut self) -> bool {
        if let (Some(sig), None) = (self.terminating, self.kill_at) {
            signal_tree(sig);
            self.cut_short = true;
            self.kill_at = Some(Instant::now() + GRACE);
        }
        if self.kill_at.is_some_and(|t| Instant::now() >= t) {
            kill_tree();
            self.cut_short = true;
            return true;
        }
        false
    }

    /// A signal: to the command while it runs, else to every process left; a termination signal
    /// then ends what is left ([`GRACE`]), one only to take note (USR1) does not.
    fn on_signal(&mut self, info: &libc::signalfd_siginfo) {
        let sig = info.ssi_signo as i32;
        if sig == libc::SIGCHLD {
            return;
        }
        let ends = crate::signals::ends_the_command(sig);
        if ends {
            self.terminating = Some(sig);
        }
        if self.exit.is_some() {
            signal_tree(sig);
            if ends {
                self.cut_short = true;
                self.kill_at.get_or_insert(Instant::now() + GRACE);
            }
            return;
        }
        // stowage tags what the terminal sent it; decide as it would.
        let tagged = info.ssi_code == libc::SI_QUEUE
            && info.ssi_pid as libc::pid_t == self.stowage
            && info.ssi_ptr as usize == crate::signals::FROM_TERMINAL;
        let code = if tagged { libc::SI_KERNEL } else { 0 };
        crate::signals::pass_on(self.command, sig, code, self.group, self.leader);
    }
}
