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
    output(stranger(args))
}

/// The command [`as_stranger`] runs, for a caller to add to its environment.
fn stranger(args: &[&str]) -> Command {
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
    c
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

/// Where a command's standard output goes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stdout {
    /// Not open at all (the process makes it /dev/null).
    Closed,
    /// Every write fails: no space left.
    Full,
    /// A pipe whose reader has gone away.
    Gone,
}

/// Runs `stowage --root ROOT ARGS…` with its standard output so.
fn with_stdout(env: &Env, args: &[&str], stdout: Stdout) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let mut c = env.cmd(args);
    c.stderr(Stdio::piped()).process_group(0);
    match stdout {
        Stdout::Closed => {
            // SAFETY: only close(2) runs between fork and exec.
            unsafe {
                c.pre_exec(|| {
                    libc::close(1);
                    Ok(())
                });
            }
        }
        Stdout::Full => {
            c.stdout(
                fs::OpenOptions::new()
                    .write(true)
                    .open("/dev/full")
                    .unwrap(),
            );
        }
        Stdout::Gone => {
            let (reader, writer) = nix::unistd::pipe().unwrap();
            drop(reader);
            c.stdout(Stdio::from(writer));
        }
    }
    wait_output(c.spawn().unwrap(), PATIENCE)
}

/// Every command, with its standard output closed, on /dev/full, or into a
/// pipe nobody reads: it ends with its own exit code (0 when it had
/// nothing to say there), or, when what it had to say could not be
/// written, with one line saying so and exit 1 — or, its reader gone (`|
/// head`), quietly with 141, as SIGPIPE would have it — never a panic, a
/// backtrace or a death by signal.
#[test]
fn every_command_ends_with_one_line_when_its_output_cannot_be_written() {
    for stdout in [Stdout::Closed, Stdout::Full, Stdout::Gone] {
        let env = Env::new();
        env.make_image("base");
        env.make_image("old");
        env.ok(["slots", "set", "gone", "1"]);
        for args in [
            &["init"][..],
            &["exec", "--read", "base", "--", "true"],
            &["exec", "--write", "new", "--", "true"],
            &["images"],
            &["images", "--json"],
            &["lock-status"],
            &["lock-status", "--json"],
            &["slots"],
            &["slots", "--json"],
            &["slots", "set", "pull", "2"],
            &["slots", "rm", "gone"],
            &["rm", "old"],
            &["gc"],
            &["gc", "--json"],
            &["doctor"],
            &["doctor", "--json"],
            &["doctor", "--repair"],
            &["completions", "bash"],
            &["--version"],
            &["--help"],
        ] {
            let out = with_stdout(&env, args, stdout);
            let err = stderr(&out);
            let case = format!("{stdout:?} {args:?}");
            assert_eq!(out.status.signal(), None, "{case}: {}", show(&out));
            let said = if stdout == Stdout::Gone { 141 } else { 1 };
            assert!(
                code(&out) == Some(0) || code(&out) == Some(said),
                "{case}: {}",
                show(&out)
            );
            assert!(err.trim_end().lines().count() <= 1, "{case}: {err}");
            match code(&out) {
                Some(1) => assert!(err.contains("standard output"), "{case}: {err}"),
                Some(141) => assert_eq!(err, "", "{case}"),
                _ => {}
            }
        }
        assert_eq!(env.state("base").as_deref(), Some("ready"));
        assert_eq!(env.state("new").as_deref(), Some("ready"));
    }
}

/// A report with standard output closed is lost, not written: each command
/// that has one to give says so in one line and exits 1 (as on /dev/full),
/// and `lock-status --watch` ends at once instead of drawing into nothing.
/// `exec` has no report: its command gets /dev/null, as ever.
#[test]
fn a_report_with_its_standard_output_closed_is_an_error() {
    let env = Env::new();
    env.make_image("base");
    for args in [
        &["lock-status"][..],
        &["lock-status", "--json"],
        &["lock-status", "--watch", "0.1"],
        &["lock-status", "--watch", "0.1", "--json"],
        &["lock-status", "--why", "base"],
        &["images"],
        &["images", "--json"],
        &["slots"],
        &["gc", "--json"],
        &["doctor"],
        &["--version"],
    ] {
        let out = with_stdout(&env, args, Stdout::Closed);
        let err = stderr(&out);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains("standard output"), "{args:?}: {err}");
    }
    let out = with_stdout(
        &env,
        &["exec", "--read", "base", "--", "true"],
        Stdout::Closed,
    );
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// A uid the password file does not know, whose `USER` is a name the file
/// gives another uid (root's): its holds are named by its number, never
/// by that other user's name.
#[test]
fn a_holder_without_a_password_entry_is_not_named_by_another_users_name() {
    if !root_or_skip("running as a uid without a password entry") {
        return;
    }
    let env = Env::new();
    fs::create_dir_all(&env.root).unwrap();
    chown(env.tmp.path(), STRANGER, STRANGER);
    chown(&env.root, STRANGER, STRANGER);
    let root = env.root.to_str().unwrap();
    let look = format!("{} --root {root} lock-status --json", bin());
    let mut c = stranger(&[
        "--root", root, "exec", "--write", "app", "--", "sh", "-c", &look,
    ]);
    c.env("USER", "root");
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains(&format!("\"user\": \"{STRANGER}\"")),
        "{said}"
    );
    assert!(!said.contains("\"user\": \"root\""), "{said}");
}
