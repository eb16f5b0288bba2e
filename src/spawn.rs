//! Starting the command with posix_spawn(3).
//!
//! - The command starts with no signal blocked (we block the termination signals for our signal
//!   thread) and SIGPIPE at its default (Rust ignores it).
//! - std's `Command` could do that only in a `pre_exec` hook, which forces a full fork(2);
//!   posix_spawn clones vfork-style.
//! - `--no-inherit` starts our keeper this way (`keeper.rs`); it starts the command with std.

use std::ffi::{CString, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;

use nix::spawn::{
    PosixSpawnAttr, PosixSpawnFileActions, PosixSpawnFlags, posix_spawn, posix_spawnp,
};
use nix::sys::signal::{SigSet, Signal};
use nix::unistd::Pid;

/// Whether our parent made us ignore `sig`: a disposition exec keeps, so the command inherits it
/// (no handler of ours may replace it).
pub fn ignored(sig: libc::c_int) -> bool {
    // SAFETY: queries the disposition only (no new action).
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The user's command: no signal blocked, SIGPIPE at its default.
    Command,
    /// Our own keeper ([`crate::keeper`]): our signal mask kept (it takes them itself), in a process
    /// group of its own (a `kill -9 -PGID` of ours leaves it to clean up).
    Keeper,
}

/// Spawns `argv` with exactly `env`; returns its pid. `path` is the program (`None`: `argv[0]`,
/// searched in PATH). Descriptors without close-on-exec are inherited.
pub fn spawn(
    path: Option<&std::ffi::CStr>,
    argv: &[OsString],
    env: &[(OsString, OsString)],
    how: Start,
) -> io::Result<libc::pid_t> {
    prepare(path, argv, env, how)?.launch()
}

/// A command ready to start: its strings and attributes made beforehand, so that starting it is
/// one call (a terminal's signal between the last look for one and the start reaches us alone:
/// the longer that gap, the likelier a Ctrl-C the command never gets).
pub struct Prepared {
    path: Option<CString>,
    args: Vec<CString>,
    vars: Vec<CString>,
    attr: PosixSpawnAttr,
    how: Start,
}

/// Makes what [`spawn`] starts `argv` with.
pub fn prepare(
    path: Option<&std::ffi::CStr>,
    argv: &[OsString],
    env: &[(OsString, OsString)],
    how: Start,
) -> io::Result<Prepared> {
    let args: Vec<CString> = argv
        .iter()
        .map(|a| c_string(a.as_bytes().to_vec()))
        .collect::<io::Result<_>>()?;
    let vars: Vec<CString> = env
        .iter()
        .map(|(k, v)| c_string([k.as_bytes(), b"=", v.as_bytes()].concat()))
        .collect::<io::Result<_>>()?;
    let mut attr = PosixSpawnAttr::init()?;
    attr.set_sigdefault(&[Signal::SIGPIPE, Signal::SIGCHLD].into_iter().collect())?;
    let flags = match how {
        Start::Command => {
            attr.set_sigmask(&SigSet::empty())?;
            PosixSpawnFlags::POSIX_SPAWN_SETSIGMASK
        }
        Start::Keeper => {
            attr.set_pgroup(Pid::from_raw(0))?;
            PosixSpawnFlags::POSIX_SPAWN_SETPGROUP
        }
    };
    attr.set_flags(flags | PosixSpawnFlags::POSIX_SPAWN_SETSIGDEF)?;
    Ok(Prepared {
        path: path.map(CString::from),
        args,
        vars,
        attr,
        how,
    })
}

impl Prepared {
    /// Starts it; returns its pid.
    pub fn launch(&self) -> io::Result<libc::pid_t> {
        let none = PosixSpawnFileActions::init()?;
        let (attr, args, vars) = (&self.attr, &self.args, &self.vars);
        // They take the same arguments; only posix_spawnp searches PATH.
        let pid = match &self.path {
            Some(p) => posix_spawn(p.as_c_str(), &none, attr, args, vars),
            None => posix_spawnp(&args[0], &none, attr, args, vars),
        };
        let pid = match pid {
            // A file without "#!" is a shell script, as execvp(3) has it (and so flock(1), and our
            // keeper's start): a POSIX shell runs one it cannot exec. Only posix_spawn does not.
            Err(nix::errno::Errno::ENOEXEC) if self.how == Start::Command => {
                let sh = [c"/bin/sh", c"-c", c"exec \"$0\" \"$@\""].map(CString::from);
                let args: Vec<CString> = sh.into_iter().chain(args.iter().cloned()).collect();
                posix_spawn(args[0].as_c_str(), &none, attr, &args, vars)?
            }
            pid => pid?,
        };
        Ok(pid.as_raw())
    }
}

fn c_string(bytes: Vec<u8>) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_with_the_given_environment_and_reports_a_missing_program() {
        let argv = ["sh", "-c", "exit $CODE"].map(OsString::from);
        let env = [("CODE", "7"), ("PATH", "/usr/bin:/bin")].map(|(k, v)| (k.into(), v.into()));
        let pid = spawn(None, &argv, &env, Start::Command).unwrap();
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(libc::WEXITSTATUS(status), 7);
        let argv = [OsString::from("/nonexistent/program")];
        let missing = spawn(None, &argv, &env, Start::Command).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
    }
}
