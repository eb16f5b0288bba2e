//! Starting the command with posix_spawn(3).
//!
//! - The command starts with no signal blocked (we block the termination signals for our signal
//!   thread) and SIGPIPE at its default (Rust ignores it).
//! - std's `Command` could do that only in a `pre_exec` hook, which forces a full fork(2);
//!   posix_spawn takes the mask and dispositions as attributes and clones vfork-style, without
//!   copying our page tables.
//! - `--no-inherit` starts our keeper this way (`keeper.rs`), which, single-threaded, starts the
//!   command with std.

use std::ffi::{CString, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;

use nix::sys::signal::{SigSet, Signal};

/// How a process is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The user's command: no signal blocked, SIGPIPE at its default.
    Command,
    /// Our own keeper ([`crate::keeper`]): it keeps our signal mask, so the termination signals
    /// stay blocked until it takes them itself, and leads a process group of its own, so a signal
    /// to our group (a `kill -9 -PGID`) leaves it to clean up after the command.
    Keeper,
}

/// Spawns `argv` with exactly `env` as its environment; returns its pid. `path` is the program
/// (`None`: `argv[0]`, searched in PATH). Descriptors without close-on-exec are inherited, as with
/// exec(2).
pub fn spawn(
    path: Option<&std::ffi::CStr>,
    argv: &[OsString],
    env: &[(OsString, OsString)],
    how: Start,
) -> io::Result<libc::pid_t> {
    let args: Vec<CString> = argv
        .iter()
        .map(|a| c_string(a.as_bytes().to_vec()))
        .collect::<io::Result<_>>()?;
    let vars: Vec<CString> = env
        .iter()
        .map(|(k, v)| c_string([k.as_bytes(), b"=", v.as_bytes()].concat()))
        .collect::<io::Result<_>>()?;
    let argp = null_terminated(&args);
    let envp = null_terminated(&vars);

    // SAFETY: the attribute object is initialised before use and destroyed after; every pointer
    // passed lives until posix_spawnp returns.
    unsafe {
        let mut attr: libc::posix_spawnattr_t = std::mem::zeroed();
        check(libc::posix_spawnattr_init(&mut attr))?;
        let result = set_attributes(&mut attr, how).and_then(|()| {
            let mut pid: libc::pid_t = 0;
            // They take the same arguments; only posix_spawnp searches PATH.
            let spawn = match path {
                Some(_) => libc::posix_spawn as unsafe extern "C" fn(_, _, _, _, _, _) -> _,
                None => libc::posix_spawnp,
            };
            let file = path.map_or_else(|| args[0].as_ptr(), |p| p.as_ptr());
            let no_file_actions = std::ptr::null();
            let (argp, envp) = (argp.as_ptr(), envp.as_ptr());
            check(spawn(&mut pid, file, no_file_actions, &attr, argp, envp))?;
            Ok(pid)
        });
        libc::posix_spawnattr_destroy(&mut attr);
        result
    }
}

fn c_string(bytes: Vec<u8>) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// The array of pointers that exec(2) takes: each string, then NULL. The strings must outlive it.
fn null_terminated(strings: &[CString]) -> Vec<*mut libc::c_char> {
    let mut pointers: Vec<*mut libc::c_char> =
        strings.iter().map(|s| s.as_ptr() as *mut _).collect();
    pointers.push(std::ptr::null_mut());
    pointers
}

/// SIGPIPE and SIGCHLD at their defaults; for the command no signal blocked, for the keeper our
/// mask kept and a process group of its own.
///
/// # Safety
/// `attr` must have been initialised by posix_spawnattr_init.
unsafe fn set_attributes(attr: &mut libc::posix_spawnattr_t, how: Start) -> io::Result<()> {
    // SAFETY: sigset ops on local sets; attribute calls on an object the caller initialised.
    unsafe {
        let default: SigSet = [Signal::SIGPIPE, Signal::SIGCHLD].into_iter().collect();
        check(libc::posix_spawnattr_setsigdefault(attr, default.as_ref()))?;
        let flags = match how {
            Start::Command => {
                check(libc::posix_spawnattr_setsigmask(
                    attr,
                    SigSet::empty().as_ref(),
                ))?;
                libc::POSIX_SPAWN_SETSIGMASK | libc::POSIX_SPAWN_SETSIGDEF
            }
            Start::Keeper => {
                check(libc::posix_spawnattr_setpgroup(attr, 0))?;
                libc::POSIX_SPAWN_SETPGROUP | libc::POSIX_SPAWN_SETSIGDEF
            }
        };
        check(libc::posix_spawnattr_setflags(attr, flags as libc::c_short))
    }
}

fn check(rc: libc::c_int) -> io::Result<()> {
    (rc == 0)
        .then_some(())
        .ok_or_else(|| io::Error::from_raw_os_error(rc))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_with_the_given_environment_and_reports_a_missing_program() {
        let argv: Vec<OsString> = ["sh", "-c", "exit $CODE"]
            .iter()
            .map(OsString::from)
            .collect();
        let env = vec![
            (OsString::from("CODE"), OsString::from("7")),
            (OsString::from("PATH"), OsString::from("/usr/bin:/bin")),
        ];
        let pid = spawn(None, &argv, &env, Start::Command).unwrap();
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(libc::WEXITSTATUS(status), 7);
        let argv = [OsString::from("/nonexistent/program")];
        let missing = spawn(None, &argv, &env, Start::Command).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
    }
}
