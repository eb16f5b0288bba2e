//! stowage in the environments batch jobs and containers give: no `USER`,
//! a uid the password file does not know (cron, `env -i`, an arbitrary
//! container uid, a directory-service user), a standard output that
//! cannot be written (closed, `/dev/full`, a pipe nobody reads). Every
//! command ends with its contract's exit code and at most one line on
//! stderr — never a crash, a panic or a backtrace.

use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

use crate::common::*;

/// A uid that /etc/passwd does not name, as the commands see it.
const STRANGER: u32 = 54_321;

/// `stowage ARGS…` as `STRANGER`, with an empty environment.
fn as_stranger(args: &[&str]) -> std::process::Output {
    let mut c = Command::new("setpriv");
    c.args([
        &format!("--reuid={STRANGER}"),
        &format!("--regid={STRANGER}"),
        "--clear-groups",
        bin(),
    ])
    .args(args)
    .env_clear()
    .current_dir("/")
    .stdin(Stdio::null());
    output(c)
}

/// Without `USER`, as a uid with no entry in /etc/passwd: the user's name
/// is read from the file, never asked of the C library (whose NSS modules
/// crash a static binary), and falls back to the uid.
#[test]
fn a_uid_without_a_password_entry_and_no_user_runs_every_command() {
    if !root_or_skip("running as a uid without a password entry") {
        return;
    }
    let passwd = fs::read_to_string("/etc/passwd").unwrap_or_default();
    assert!(
        !passwd
            .lines()
            .any(|l| l.split(':').nth(2) == Some(&STRANGER.to_string())),
        "uid {STRANGER} has an entry here"
    );
    let env = Env::new();
    fs::create_dir_all(&env.root).unwrap();
    chown(env.tmp.path(), STRANGER, STRANGER);
    chown(&env.root, STRANGER, STRANGER);
    let root = env.root.to_str().unwrap();
    for args in [
        &["--root", root, "exec", "--write", "app", "--", "true"][..],
        &["--root", root, "exec", "--read", "app", "--", "true"],
        &["--root", root, "lock-status"],
        &["--root", root, "images"],
        &["--root", root, "doctor"],
        &["--root", root, "gc"],
    ] {
        let out = as_stranger(args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    // The default root is named by the uid.
    let out = as_stranger(&["lock-status"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains(&format!("/var/tmp/{STRANGER}.stowage")),
        "{}",
        show(&out)
    );
    assert_eq!(out.status.signal(), None);
}
