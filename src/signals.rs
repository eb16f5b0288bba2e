//! Termination signals during `exec`.
//!
//! - The signals [`taken`] (INT, TERM, HUP, QUIT, USR1, USR2, ALRM, real-time; and SIGCHLD) are
//!   blocked in every thread and taken with sigwaitinfo(2): no system call is interrupted by them.
//!   Ignored ones stay ignored (`nohup`).
//! - Before the command starts, a signal cancels the lock waits (exit 128+N, nothing left behind).
//!   The signal thread starts with the first wait; without one the waits watch a signalfd.
//! - While the command runs, signals are forwarded, but for a terminal's (SI_KERNEL) that reached a
//!   command in our process group too (not a hangup to a session leader alone). One that ends a
//!   stopped command is followed by SIGCONT: it acts on nothing else.
//! - Long work outside the command (a `--from` copy, measuring) asks [`check`] between steps: a
//!   pending signal stops it, exit 128+N.
//! - Hand-over: Waiting → Running(pid) under a mutex while spawning (a signal is seen before the
//!   spawn or forwarded after it); Running → Done after the child exited but before it is reaped,
//!   so no signal hits a recycled pid.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::thread::JoinHandleExt;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering::Relaxed};
use std::sync::{Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::{Pid, getpgid, getpgrp, getpid, getsid};

use crate::error::{locked, retrying};
use crate::spawn::Start;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Interrupted(i32),
    /// Signals go to the command, or to its keeper, tagged with whether the terminal sent them.
    Running(Start, libc::pid_t),
    Done,
}

struct Shared {
    state: Mutex<State>,
    /// The termination signals we take.
    set: SigSet,
    /// The thread taking termination signals during waits, if one runs; else they watch a
    /// signalfd, made once. A thread is tried again at each wait.
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Set while the thread is told to end (by [`lock::wake_signal`](crate::lock::wake_signal)).
    ending: AtomicBool,
    descriptor: Once,
}

static SHARED: OnceLock<Shared> = OnceLock::new();

/// The handle `exec` uses; the state is process-wide (the lock waits start the signal thread).
pub struct Forwarder {
    shared: &'static Shared,
}

/// The signals we take: every one whose default action would end us and that is sent to stop or
/// steer the command (INT, TERM, HUP, QUIT; USR1, USR2, ALRM; the real-time ones but the lock
/// waits' own), minus those our parent made us ignore (`nohup`, a background job): a blocked
/// signal is never discarded, so taking an ignored one would act on it. Faults (SEGV, BUS, …) and
/// resource limits (XCPU, XFSZ) are our own, and stay as they are.
pub fn taken() -> SigSet {
    use Signal::{SIGALRM, SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
    let named = [SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM].map(|s| s as i32);
    let real_time =
        (libc::SIGRTMIN()..=libc::SIGRTMAX()).filter(|&s| s != crate::lock::wake_signal());
    // SAFETY: sigaddset on a local set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in named
            .into_iter()
            .chain(real_time)
            .filter(|&s| !crate::spawn::ignored(s))
        {
            libc::sigaddset(&mut set, s);
        }
        SigSet::from_sigset_t_unchecked(set)
    }
}

/// Whether `sig` asks the command to end (INT, TERM, HUP, QUIT), not only to take note (USR1, a
/// real-time signal): only these count against its outcome or end work after it.
pub fn ends_the_command(sig: i32) -> bool {
    matches!(
        sig,
        libc::SIGINT | libc::SIGTERM | libc::SIGHUP | libc::SIGQUIT
    )
}

/// Runs `f` with `sig` blocked in this thread (as it was before, after).
pub fn with_blocked<T>(sig: libc::c_int, f: impl FnOnce() -> T) -> T {
    // SAFETY: sigset manipulation on local sets; the mask changed is this thread's own.
    let before = unsafe {
        let (mut one, mut before): (libc::sigset_t, libc::sigset_t) = std::mem::zeroed();
        libc::sigemptyset(&mut one);
        libc::sigaddset(&mut one, sig);
        libc::pthread_sigmask(libc::SIG_BLOCK, &one, &mut before);
        before
    };
    let out = f();
    // SAFETY: restores the mask read above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut()) };
    out
}

/// A termination signal that came while no command ran (before or after it): long work stops.
static CANCELLED: AtomicI32 = AtomicI32::new(0);

/// The last termination signal passed on to a running command (or its keeper): an exec whose
/// command's end is unknown (keeper gone) exits 128+N.
static PASSED_ON: AtomicI32 = AtomicI32::new(0);

pub fn passed_on() -> Option<i32> {
    signal_in(&PASSED_ON)
}

/// The signal `seen` holds, if any (0: none).
fn signal_in(seen: &AtomicI32) -> Option<i32> {
    Some(seen.load(Relaxed)).filter(|&sig| sig != 0)
}

/// When [`check`] last looked for a pending signal.
static LAST_LOOK: Mutex<Option<Instant>> = Mutex::new(None);

/// The cancellation check for long work (copy, measure, delete), between steps: once a termination
/// signal came, `Err(Interrupted(sig))`. Only an `exec` routes signals here; others die at once.
/// Cheap per file of a walk: pending signals are looked at every few ms at most.
pub fn check() -> Result<(), crate::error::Error> {
    cancelled().map_or(Ok(()), |sig| Err(crate::error::Error::Interrupted(sig)))
}

/// [`check`], looking at pending signals now however recently it looked: before a step that
/// cannot be undone.
pub fn check_now() -> Result<(), crate::error::Error> {
    *locked(&LAST_LOOK) = None;
    check()
}

/// The signal [`check`] reports, if any.
pub fn cancelled() -> Option<i32> {
    SHARED.get()?;
    if let Some(sig) = signal_in(&CANCELLED).or_else(crate::lock::interrupted) {
        return Some(sig);
    }
    let mut last = locked(&LAST_LOOK);
    if last.is_some_and(|t| t.elapsed() < Duration::from_millis(5)) {
        return None;
    }
    *last = Some(Instant::now());
    drop(last);
    // Without the signal thread, a signal stays pending until taken here.
    take_pending();
    signal_in(&CANCELLED).or_else(crate::lock::interrupted)
}

/// Whether a signal we take is pending, for sleeps without the signal thread (the test pause hook).
pub fn termination_pending() -> bool {
    // SAFETY: sigpending fills a local set; sigismember reads two sets.
    SHARED.get().is_some_and(|shared| unsafe {
        let mut pending: libc::sigset_t = std::mem::zeroed();
        libc::sigpending(&mut pending);
        (1..=libc::SIGRTMAX()).any(|s| {
            libc::sigismember(&pending, s) == 1 && libc::sigismember(shared.set.as_ref(), s) == 1
        })
    })
}

impl Forwarder {
    /// Blocks the signals. Call before any other thread exists, so every thread inherits the mask.
    pub fn install() -> io::Result<Forwarder> {
        // An ignored SIGCHLD (inherited) makes the kernel reap the command, losing its exit status.
        // SAFETY: restores the default action; no handler is involved.
        unsafe { nix::sys::signal::signal(Signal::SIGCHLD, nix::sys::signal::SigHandler::SigDfl) }
            .map_err(io::Error::from)?;
        let set = taken();
        let mut blocked = set;
        blocked.add(Signal::SIGCHLD);
        blocked.thread_block().map_err(io::Error::from)?;
        // The lock waits' own signal, which is not taken: harmless whenever it comes.
        crate::lock::disarm_wake_signal();
        let shared = SHARED.get_or_init(|| Shared {
            state: Mutex::new(State::Waiting),
            set,
            thread: Mutex::new(None),
            ending: AtomicBool::new(false),
            descriptor: Once::new(),
        });
        crate::lock::before_waiting(start_thread);
        Ok(Forwarder { shared })
    }

    /// Spawns the command (or its keeper) unless a signal came first (`Ok(Err(sig))`). The signal
    /// thread ends first: a signal after it stays pending, seen here or forwarded by [`wait`].
    ///
    /// [`wait`]: Forwarder::wait
    pub fn spawn(
        &self,
        mut spawn: impl FnMut() -> io::Result<(Start, libc::pid_t)>,
    ) -> io::Result<Result<libc::pid_t, i32>> {
        let ended = end_thread(self.shared);
        let mut st = locked(&self.shared.state);
        // A thread's task is freed a moment after it is joined: under a pids limit, a spawn then
        // fails with EAGAIN until it is.
        let mut retries = if ended { SPAWN_RETRIES } else { 0 };
        loop {
            if let State::Interrupted(sig) = *st {
                return Ok(Err(sig));
            }
            // Without the thread, a signal since install is still pending.
            if let Some((sig, _)) = take(&self.shared.set, false) {
                *st = State::Interrupted(sig);
                return Ok(Err(sig));
            }
            match spawn() {
                Ok((how, pid)) => {
                    *st = State::Running(how, pid);
                    return Ok(Ok(pid));
                }
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && retries > 0 => {
                    retries -= 1;
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits for the command, forwarding termination signals to it until just before it is reaped.
    pub fn wait(&self, pid: libc::pid_t) -> io::Result<ExitStatus> {
        use std::os::unix::process::ExitStatusExt;
        let mut watch = self.shared.set;
        watch.add(Signal::SIGCHLD);
        while !exited(pid)? {
            // Still running: take the next signal. SIGCHLD: it may have ended; a termination signal
            // is forwarded (taken first by the signal thread if it runs; SIGCHLD still comes here).
            if let Some((sig, code)) = take(&watch, true)
                && sig != libc::SIGCHLD
            {
                forward(&self.shared.state, sig, code);
            }
        }
        *locked(&self.shared.state) = State::Done;
        let mut status = 0;
        // SAFETY: waitpid on our own child, status written to a local.
        retrying(|| unsafe { libc::waitpid(pid, &mut status, 0) })?;
        Ok(ExitStatus::from_raw(status))
    }
}

/// Whether our child `pid` has exited, without reaping it. libc's waitid: nix's fails (EINVAL) on a
/// death by a real-time signal.
fn exited(pid: libc::pid_t) -> io::Result<bool> {
    let flags = libc::WEXITED | libc::WNOWAIT | libc::WNOHANG;
    // SAFETY: waitid fills `info`, which we own.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    retrying(|| unsafe {
        info = std::mem::zeroed();
        libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, flags)
    })?;
    // WNOHANG with nothing to report leaves si_pid 0.
    // SAFETY: waitid filled `info` for a child event, so si_pid is the valid field.
    Ok(unsafe { info.si_pid() } == pid)
}

/// Whether a signal the terminal sent (SI_KERNEL) certainly reached the command too: it signals its
/// foreground group (the command's if in ours), but a hangup goes to the session leader alone.
fn terminal_reached_command(
    sig: i32,
    code: i32,
    command_pgid: Option<libc::pid_t>,
    our_pgid: libc::pid_t,
    we_lead_session: bool,
) -> bool {
    code == libc::SI_KERNEL
        && !(sig == libc::SIGHUP && we_lead_session)
        && command_pgid == Some(our_pgid)
}

/// Passes `sig` (with si_code `code`) on to our unreaped child `pid`, unless the terminal sent it
/// and it reached the command too ([`terminal_reached_command`]).
pub fn pass_on(pid: libc::pid_t, sig: i32, code: i32, our_pgid: libc::pid_t, we_lead: bool) {
    // 0: a group outside our pid namespace.
    let group = getpgid(Some(Pid::from_raw(pid))).ok().map(Pid::as_raw);
    if !terminal_reached_command(sig, code, group.filter(|&g| g > 0), our_pgid, we_lead) {
        end_or_note(pid, sig);
    }
}

/// Sends `sig` to `pid`; one that asks a stopped process to end is followed by SIGCONT: it acts
/// on no signal but SIGKILL until continued, and would keep its locks. Only a stopped one: a
/// running command may handle SIGCONT itself (a shell's `trap … CONT`), and a stray one there can
/// cancel its handling of the first.
pub fn end_or_note(pid: libc::pid_t, sig: i32) {
    // SAFETY: plain kill(2) of a process of ours (an unreaped child, or one of the keeper's tree).
    unsafe { libc::kill(pid, sig) };
    // A `/proc` of another pid namespace cannot tell: continued, lest it keep its locks.
    let stopped = || {
        !crate::ident::proc_is_ours()
            || crate::ident::stat_fields(pid).is_some_and(|f| f.trim_start().starts_with('T'))
    };
    if ends_the_command(sig) && stopped() {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
    }
}

/// The value a keeper finds in a signal we queue to it: 1 if the terminal sent the signal to us.
pub const FROM_TERMINAL: usize = 1;

/// Takes one signal of `set` (waiting if `block`): the signal and its si_code.
fn take(set: &SigSet, block: bool) -> Option<(i32, i32)> {
    // SAFETY: sigtimedwait/sigwaitinfo fill `info`, which we own; `set` is blocked in this thread.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let now = nix::sys::time::TimeSpec::new(0, 0);
    let sig = match block {
        true => unsafe { libc::sigwaitinfo(set.as_ref(), &mut info) },
        // SAFETY: see above: `set` and `info` are valid, `now` a live timespec.
        false => unsafe { libc::sigtimedwait(set.as_ref(), &mut info, now.as_ref()) },
    };
    (sig > 0).then_some((sig, info.si_code))
}

/// What a termination signal means in the current state.
fn forward(state: &Mutex<State>, sig: i32, code: i32) {
    let mut st = locked(state);
    match *st {
        State::Waiting => {
            *st = State::Interrupted(sig);
            CANCELLED.store(sig, Relaxed);
            crate::lock::interrupt_waits(sig);
        }
        State::Running(how, pid) => {
            if ends_the_command(sig) {
                PASSED_ON.store(sig, Relaxed);
            }
            if how == Start::Command {
                let (ours, leader) = (getpgrp().as_raw(), getsid(None) == Ok(getpid()));
                return pass_on(pid, sig, code, ours, leader);
            }
            let tag = if code == libc::SI_KERNEL {
                FROM_TERMINAL
            } else {
                0
            };
            let value = libc::sigval {
                sival_ptr: tag as *mut libc::c_void,
            };
            // SAFETY: sigqueue(3) to our unreaped child; the value is a tag, never dereferenced.
            unsafe { libc::sigqueue(pid, sig, value) };
        }
        // The command is gone: only a termination signal ends what is left to do.
        State::Done if ends_the_command(sig) => CANCELLED.store(sig, Relaxed),
        State::Done | State::Interrupted(_) => {}
    }
}

/// How often a spawn failing with EAGAIN is tried again after the signal thread ended (2 ms apart).
const SPAWN_RETRIES: u32 = 50;

/// Starts the thread that takes termination signals when a lock wait begins, if none runs yet;
/// `false` if none could be had (a pids limit), and the wait must poll the signalfd instead: a wait
/// sleeping in a helper thread would hear no signal. A later wait tries again (pids freed).
fn start_thread() -> bool {
    let Some(shared) = SHARED.get() else {
        return true;
    };
    let mut running = locked(&shared.thread);
    if running.is_none() {
        // Born with the wake signal blocked (masks are inherited): one sent at once waits for it.
        *running = with_blocked(crate::lock::wake_signal(), || {
            std::thread::Builder::new()
                .name("stowage-signals".into())
                .stack_size(64 * 1024)
                .spawn(move || take_signals(shared))
                .ok()
        });
    }
    // A descriptor made before stays registered once a thread runs: either takes a signal.
    if running.is_none() {
        shared.descriptor.call_once(|| {
            let flags = SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK;
            if let Ok(fd) = SignalFd::with_flags(&shared.set, flags) {
                crate::lock::watch_signals_while_waiting(fd.as_raw_fd(), take_pending);
                std::mem::forget(fd); // kept for good
            }
        });
    }
    running.is_some()
}

/// The signal thread's loop, until [`end_thread`] sends it the wake signal, which it alone blocks
/// (from birth) and takes: sent before it sleeps, the signal waits for it, so no ending is missed.
fn take_signals(shared: &Shared) {
    let wake = crate::lock::wake_signal();
    let mut watch = *shared.set.as_ref();
    // SAFETY: a valid signal number added to a local set.
    unsafe { libc::sigaddset(&mut watch, wake) };
    // SAFETY: `watch` is an initialized sigset_t.
    let watch = unsafe { SigSet::from_sigset_t_unchecked(watch) };
    loop {
        match take(&watch, true) {
            Some((sig, _)) if sig == wake && shared.ending.load(Relaxed) => return,
            // A stray wake signal (the thread is not told to end) is nothing.
            Some((sig, _)) if sig == wake => {}
            Some((sig, code)) => forward(&shared.state, sig, code),
            None => {}
        }
    }
}

/// Ends the signal thread, if one runs, once it has acted on what it took; whether one ran.
fn end_thread(shared: &Shared) -> bool {
    let mut running = locked(&shared.thread);
    let Some(thread) = running.take() else {
        return false;
    };
    shared.ending.store(true, Relaxed);
    // SAFETY: the thread is not yet joined, so its pthread_t is valid.
    unsafe { libc::pthread_kill(thread.as_pthread_t(), crate::lock::wake_signal()) };
    let _ = thread.join();
    shared.ending.store(false, Relaxed);
    true
}

/// Takes a pending termination signal, if any, and acts on it (where no signal thread takes it).
fn take_pending() {
    let Some(shared) = SHARED.get() else { return };
    if let Some((sig, code)) = take(&shared.set, false) {
        forward(&shared.state, sig, code);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminal_signal_is_held_back_only_when_the_command_got_it_too() {
        let (int, hup, k, user) = (libc::SIGINT, libc::SIGHUP, libc::SI_KERNEL, libc::SI_USER);
        // Ctrl-C, command in our (foreground) group: it got it.
        assert!(terminal_reached_command(int, k, Some(10), 10, false));
        assert!(terminal_reached_command(int, k, Some(10), 10, true));
        // Command in its own group (GNU timeout): forward.
        assert!(!terminal_reached_command(int, k, Some(11), 10, false));
        // Group unknown: forward rather than lose it.
        assert!(!terminal_reached_command(int, k, None, 10, false));
        // Hangup to the session leader alone: forward.
        assert!(!terminal_reached_command(hup, k, Some(10), 10, true));
        // Hangup of a session leader that exited, to our group: it got it.
        assert!(terminal_reached_command(hup, k, Some(10), 10, false));
        // Sent by a process: always forward.
        assert!(!terminal_reached_command(int, user, Some(10), 10, false));
    }
}
