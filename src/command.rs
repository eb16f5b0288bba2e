//! The command an exec runs: its environment, how it gets the locks, its umask, its exit code.
//!
//! - The lock descriptors are inheritable only for the moment of the spawn (no other thread spawns
//!   meanwhile). With `--no-inherit` a keeper holds them instead (`keeper.rs`).
//! - Termination signals are routed to the command (or its keeper) from the moment it exists
//!   (`signals.rs`); a signal before that stops the start.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;

use crate::error;
use crate::keeper::Keeper;
use crate::signals::Forwarder;
use crate::spawn::{self, Start};

/// Starts the command, inheriting the lock descriptors like flock(1), or with `no_inherit` under a
/// keeper holding `lock_fds` (module doc). A termination signal first is the error.
pub fn start(
    signals: &Forwarder,
    command: &[OsString],
    env: &[(OsString, OsString)],
    umask: Option<u32>,
    no_inherit: bool,
    lock_fds: &[std::os::fd::RawFd],
    set_inheritable: &dyn Fn(bool) -> std::io::Result<()>,
) -> anyhow::Result<(libc::pid_t, Option<Keeper>)> {
    let mut keeper: Option<Keeper> = None;
    // Made (and the descriptors and umask set) before the last look for a signal, so that the
    // start follows it at once.
    let prepared = (!no_inherit)
        .then(|| spawn::prepare(None, command, env, Start::Command))
        .transpose()
        .map_err(|e| not_run(e.into(), &command[0].to_string_lossy()))?;
    set_inheritable(true)?;
    // posix_spawn cannot set a child's umask: ours meanwhile (no other thread makes files).
    use nix::sys::stat::{Mode, umask as set};
    let ours =
        (umask.filter(|_| !no_inherit)).map(|m| set(Mode::from_bits_retain(m as libc::mode_t)));
    let started = signals.spawn(|| match &prepared {
        Some(prepared) => crate::dir::with_given_open_files(lock_fds, || prepared.launch())
            .map(|pid| (Start::Command, pid)),
        None => crate::keeper::become_subreaper().and_then(|()| {
            let k = Keeper::spawn(command, env, lock_fds, umask)?;
            Ok((Start::Keeper, keeper.insert(k).pid))
        }),
    });
    if let Some(m) = ours {
        set(m);
    }
    if no_inherit || !matches!(started, Ok(Ok(_))) {
        set_inheritable(false)?;
    }
    match started {
        Ok(Ok(pid)) => Ok((pid, keeper)),
        Ok(Err(sig)) => Err(error::Error::Interrupted(sig).into()),
        Err(e) => Err(not_run(e.into(), &command[0].to_string_lossy())),
    }
}

/// Whether `program` can be started, found as the start finds it: a path (with a `/`) to an
/// executable regular file, or a name that is one in a directory of `PATH`. Asked before anything
/// is locked, copied or made, so a command that cannot run leaves nothing behind; the start says
/// so again if it changed meanwhile.
pub fn check_runnable(program: &std::ffi::OsStr) -> anyhow::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    if program.is_empty() {
        // Else the search would find each PATH directory itself and say "Permission denied".
        return Err(
            error::Error::Usage("cannot run '': the command's name is empty".into()).into(),
        );
    }
    let what = program.to_string_lossy();
    let fail = |errno| not_run(std::io::Error::from_raw_os_error(errno).into(), &what);
    if program.as_bytes().contains(&b'/') {
        return runnable(std::path::Path::new(program)).map_err(fail);
    }
    // posix_spawnp's search: our PATH, else the C library's default; an empty entry is ".".
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
    let mut denied = false;
    for dir in path.as_bytes().split(|&b| b == b':') {
        let dir = std::path::Path::new(std::ffi::OsStr::from_bytes(dir));
        let dir = if dir.as_os_str().is_empty() {
            std::path::Path::new(".")
        } else {
            dir
        };
        match runnable(&dir.join(program)) {
            Ok(()) => return Ok(()),
            Err(libc::EACCES) => denied = true,
            Err(_) => {}
        }
    }
    Err(fail(if denied { libc::EACCES } else { libc::ENOENT }))
}

/// Whether `file` is a regular file we may execute: `Err(errno)` as exec would fail on it.
fn runnable(file: &std::path::Path) -> Result<(), i32> {
    let errno = |e: std::io::Error| e.raw_os_error().unwrap_or(libc::ENOENT);
    let meta = std::fs::metadata(file).map_err(errno)?;
    if !meta.is_file() {
        return Err(libc::EACCES);
    }
    let c = error::cstr(file.as_os_str()).map_err(errno)?;
    // SAFETY: a valid C string; only asks (the effective ids, as exec checks them).
    let r = unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::X_OK, libc::AT_EACCESS) };
    error::cvt(r).map(drop).map_err(errno)
}

/// Why command `what` did not start; a path to a directory says so ("Permission denied" does not).
fn not_run(e: anyhow::Error, what: &str) -> anyhow::Error {
    if what.contains('/') && std::path::Path::new(what).is_dir() {
        return anyhow::anyhow!("cannot run '{what}': it is a directory");
    }
    e.context(format!("cannot run '{what}'"))
}

/// Waits for the command (through its keeper's report for --no-inherit).
pub fn wait(
    signals: &Forwarder,
    pid: libc::pid_t,
    keeper: Option<Keeper>,
) -> std::io::Result<std::process::ExitStatus> {
    let status = signals.wait(pid)?;
    match keeper {
        Some(k) => k.outcome(status).map(std::process::ExitStatus::from_raw),
        None => Ok(status),
    }
}

/// The exit code of an exec: the command's, or 128+N for a death by signal N (real-time included).
pub fn exit_code(status: &std::process::ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => 128u8.saturating_add(sig as u8),
        (None, None) => error::code::FAILURE,
    }
}

/// How a command that did not succeed ended, as a record says it: `exit 2`, `signal 15`.
pub fn describe(status: &std::process::ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(sig)) => format!("signal {sig}"),
        (None, None) => "ended unknown".into(),
    }
}

/// The command's environment: ours, without the `STOWAGE_*` variables this exec sets or that
/// describe images (an outer exec's), then this exec's, once each (programs read the first).
pub fn environment(
    ours: impl Iterator<Item = (OsString, OsString)>,
    set: &[(&str, OsString)],
) -> Vec<(OsString, OsString)> {
    let replaced = |k: &OsString| {
        k.to_str().is_some_and(|k| {
            [crate::env::IMAGE_DIR, crate::env::IMAGES_DIR].contains(&k)
                || set.iter().any(|(name, _)| *name == k)
        })
    };
    ours.filter(|(k, _)| !replaced(k))
        .chain(set.iter().map(|(k, v)| (OsString::from(k), v.clone())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stowage_variable_once_and_ours() {
        let caller = [
            ("PATH", "/bin"),
            (crate::env::ROOT, "/caller"),
            (crate::env::IMAGE_DIR, "/caller/img/x"),
            (crate::env::IMAGES_DIR, "/caller/img"),
            ("STOWAGE_NOW", "kept"),
        ]
        .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        let env = environment(
            caller.into_iter(),
            &[
                (crate::env::ROOT, "/r".into()),
                (crate::env::IMAGES_DIR, "/r/img".into()),
            ],
        );
        let get = |k: &str| -> Vec<&OsString> {
            env.iter().filter(|(n, _)| n == k).map(|(_, v)| v).collect()
        };
        assert_eq!(get("STOWAGE_ROOT"), [&OsString::from("/r")]);
        assert_eq!(get("STOWAGE_IMAGES_DIR"), [&OsString::from("/r/img")]);
        assert!(get("STOWAGE_IMAGE_DIR").is_empty(), "no single image here");
        assert_eq!(get("STOWAGE_NOW"), [&OsString::from("kept")]);
        assert_eq!(get("PATH"), [&OsString::from("/bin")]);
    }
}
