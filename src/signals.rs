//! Termination signals during `exec`.
//!
//! SIGINT, SIGTERM, SIGHUP and SIGQUIT are blocked in every thread and taken
//! by one thread with sigwaitinfo(2), so no system call elsewhere is ever
//! interrupted by them. Signals the parent made us ignore stay ignored
//! (`nohup stowage exec …` survives a hangup, like its command). Before the command starts, such a signal interrupts
//! the lock waits (the exec then exits 128+N, leaving nothing behind). Once
//! the command runs, the signal is forwarded to it — unless the terminal
//! sent it (si_code SI_KERNEL): the terminal already signalled the whole
//! foreground process group, the command included, and a second copy would
//! make many programs treat one Ctrl-C as two.
//!
//! The handoff is race-free: the state moves Waiting → Running(pid) under a
//! mutex while spawning, so a signal is either seen before the spawn (and the
//! command never starts) or forwarded after it; and Running → Done happens
//! after the child exited but before it is reaped, so a late signal can
//! never hit a recycled pid.

use std::io;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};

use nix::sys::signal::{SigSet, Signal};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Interrupted(i32),
    Running(i32),
    Done,
}

pub struct Forwarder {
    state: Arc<Mutex<State>>,
}

/// The termination signals we take, minus those our parent made us ignore
/// (`nohup` ignores SIGHUP; a shell's background job ignores SIGINT and
/// SIGQUIT): a blocked signal is never discarded, so taking an ignored one
/// would act on it.
fn forwarded() -> SigSet {
    let mut set = SigSet::empty();
    for s in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGQUIT,
    ] {
        // SAFETY: queries the disposition only (no new action).
        let ignored = unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(s as libc::c_int, std::ptr::null(), &mut old) == 0
                && old.sa_sigaction == libc::SIG_IGN
        };
        if !ignored {
            set.add(s);
        }
    }
    set
}

/// Makes a spawned command start with no signal blocked: it must not
/// inherit the mask that routes termination signals to our signal thread
/// (shells reset it; most programs do not). Dispositions the parent chose
/// to ignore stay ignored, as with any exec. Async-signal-safe: meant for
/// `pre_exec`.
pub fn reset_mask_in_child() -> io::Result<()> {
    // SAFETY: sigprocmask with a local empty set is async-signal-safe.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        if libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

impl Forwarder {
    /// Blocks the signals and starts the thread that takes them. Call it
    /// before any other thread exists, so every thread inherits the mask.
    pub fn install() -> io::Result<Forwarder> {
        // An ignored SIGCHLD (inherited from whoever started us) makes the
        // kernel reap the command itself, and its exit status would be lost.
        // SAFETY: restores the default action; no handler is involved.
        unsafe { nix::sys::signal::signal(Signal::SIGCHLD, nix::sys::signal::SigHandler::SigDfl) }
            .map_err(io::Error::from)?;
        let set = forwarded();
        set.thread_block().map_err(io::Error::from)?;
        let state = Arc::new(Mutex::new(State::Waiting));
        let shared = Arc::clone(&state);
        std::thread::Builder::new()
            .name("stowage-signals".into())
            .stack_size(64 * 1024)
            .spawn(move || take_signals(set, &shared))?;
        Ok(Forwarder { state })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The signal that arrived before the command started, if any.
    pub fn interrupted(&self) -> Option<i32> {
        match *self.lock() {
            State::Interrupted(sig) => Some(sig),
            _ => None,
        }
    }

    /// Spawns the command (`spawn` returns its pid) unless a signal came
    /// first (`Ok(Err(sig))`).
    pub fn spawn(
        &self,
        spawn: impl FnOnce() -> io::Result<libc::pid_t>,
    ) -> io::Result<Result<libc::pid_t, i32>> {
        let mut st = self.lock();
        if let State::Interrupted(sig) = *st {
            return Ok(Err(sig));
        }
        let pid = spawn()?;
        *st = State::Running(pid);
        Ok(Ok(pid))
    }

    /// Waits for the command; stops forwarding before the child is reaped.
    pub fn wait(&self, pid: libc::pid_t) -> io::Result<ExitStatus> {
        use std::os::unix::process::ExitStatusExt;
        let p = nix::unistd::Pid::from_raw(pid);
        loop {
            use nix::sys::wait::{Id, WaitPidFlag, waitid};
            match waitid(Id::Pid(p), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {
                Ok(_) => break,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        *self.lock() = State::Done;
        let mut status = 0;
        loop {
            // SAFETY: waitpid on our own child, status written to a local.
            let r = unsafe { libc::waitpid(pid, &mut status, 0) };
            if r == pid {
                return Ok(ExitStatus::from_raw(status));
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
        }
    }
}

fn take_signals(set: SigSet, state: &Mutex<State>) {
    loop {
        // SAFETY: sigwaitinfo fills `info`, which we own; `set` is a valid
        // signal set of signals blocked in this thread.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let sig = unsafe { libc::sigwaitinfo(set.as_ref(), &mut info) };
        if sig < 0 {
            continue;
        }
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        match *st {
            State::Waiting => {
                *st = State::Interrupted(sig);
                crate::lock::interrupt_waits(sig);
            }
            State::Running(pid) => {
                if info.si_code != libc::SI_KERNEL {
                    // SAFETY: plain kill(2); pid is our unreaped child.
                    unsafe { libc::kill(pid, sig) };
                }
            }
            State::Interrupted(_) | State::Done => {}
        }
    }
}
