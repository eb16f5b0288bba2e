//! Processes, signals and nested calls under attack: commands that call
//! stowage again inside a store-wide hold or while one waits (with and
//! without --no-inherit), a wait that can start no thread (pids limit), a
//! command tree cut short by a signal, an exec whose stderr is gone.

use crate::common::*;

/// `stowage --root ROOT exec ARGS…` as a command line for an outer exec.
fn inner(env: &Env, args: &[&str]) -> Vec<String> {
    let mut v = vec![
        bin().to_owned(),
        "--root".into(),
        env.root.to_str().unwrap().to_owned(),
    ];
    v.extend(args.iter().map(|a| a.to_string()));
    v
}

#[test]
fn a_no_inherit_store_wide_command_may_call_stowage_itself() {
    let env = Env::new();
    env.make_image("a");
    // The keeper keeps the store's lease, not the command: the nested
    // exec is still inside the hold (its ancestor holds it) and must go
    // ahead rather than wait for the hold that waits for it.
    let mut args: Vec<String> = ["exec", "--no-inherit", "--store-wide", "--"]
        .map(String::from)
        .to_vec();
    args.extend(inner(
        &env,
        &[
            "exec", "--wait", "20", "--read", "a", "--write", "c", "--", "true",
        ],
    ));
    let out = env.run(&args);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("c").as_deref(), Some("ready"));

    // A removal inside it is inside the hold too.
    let mut args: Vec<String> = ["exec", "--no-inherit", "--store-wide", "--"]
        .map(String::from)
        .to_vec();
    args.extend(inner(&env, &["rm", "--wait", "20", "c"]));
    let out = env.run(&args);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("c"), None);
}

#[test]
fn a_store_wide_command_inside_another_fails_at_once() {
    for no_inherit in [false, true] {
        let env = Env::new();
        let mut args: Vec<String> = vec!["exec".into()];
        if no_inherit {
            args.push("--no-inherit".into());
        }
        args.extend(["--store-wide".into(), "--".into()]);
        args.extend(inner(
            &env,
            &["exec", "--wait", "20", "--store-wide", "--", "true"],
        ));
        let out = env.run(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(75), "{}", show(&out));
        assert!(
            err.contains("enclosing command") && !err.contains("waiting for the store-wide"),
            "no-inherit {no_inherit}: should fail at once naming the enclosing hold: {err}"
        );
    }
}

/// `exec ARGS -- sh -c 'touch STARTED; sleep 600'` in the background: a
/// holder that stays until the test ends (killed with its group on drop).
fn long_holder(env: &Env, locks: &[&str], started: &str) -> Bg {
    let mut args: Vec<String> = vec!["exec".into()];
    args.extend(locks.iter().map(|s| s.to_string()));
    args.extend([
        "--".into(),
        "sh".into(),
        "-c".into(),
        format!(
            "touch '{}'; exec sleep 600",
            env.sentinel(started).display()
        ),
    ]);
    let bg = env.spawn(&args);
    wait_for_file(&env.sentinel(started));
    bg
}

#[test]
fn sigterm_ends_a_wait_that_could_start_no_thread() {
    let env = Env::new();
    env.make_image("a");
    env.ok(["slots", "set", "one", "1"]);
    let _image = long_holder(&env, &["--write", "a"], "image-held");
    let _slot = long_holder(&env, &["--slot", "one"], "slot-held");
    for (what, args) in [
        ("image", ["exec", "--read", "a", "--", "true"]),
        ("slot", ["exec", "--slot", "one", "--", "true"]),
    ] {
        // A job's cgroup with no task to spare: the waiter is alone in it,
        // so it cannot start the thread that watches for signals.
        let Some(cg) = PidsCgroup::new(1) else {
            return;
        };
        let mut c = env.cmd(args);
        cg.enter(&mut c);
        let mut waiter = Bg::from_command(c);
        wait_until(&format!("the {what} waiter is recorded"), || {
            let out = env.ok(["lock-status", "--json"]);
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            v["locks"].as_array().unwrap().iter().any(|l| {
                l["waiters"]
                    .as_array()
                    .is_some_and(|w| w.iter().any(|w| w["pid"] == waiter.pid()))
            })
        });
        waiter.signal(libc::SIGTERM);
        // The holder never lets go: only the signal can end the wait.
        wait_until(&format!("the {what} waiter ends on SIGTERM"), || {
            !waiter.is_running()
        });
        let out = waiter.finish();
        assert_eq!(out.status.code(), Some(143), "{what}: {}", show(&out));
        drop(cg);
    }
}

#[test]
fn a_tree_cut_short_by_sigterm_is_no_success() {
    let env = Env::new();
    let started = env.sentinel("bg-started");
    let shell = env.sentinel("shell-pid");
    // The command succeeds at once; its background job would go on
    // writing the image.
    let script = format!(
        "echo $$ > '{p}'; (touch '{s}'; sleep 600; echo late > \"$STOWAGE_IMAGE_DIR/late\") & exit 0",
        p = shell.display(),
        s = started.display()
    );
    let bg = env.spawn([
        "exec",
        "--no-inherit",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    wait_for_file(&started);
    wait_until("the command itself has exited", || {
        let pid = std::fs::read_to_string(&shell).unwrap_or_default();
        !pid.trim().is_empty() && !std::path::Path::new(&format!("/proc/{}", pid.trim())).exists()
    });
    // Only the background job is left: SIGTERM ends it before its work is
    // done.
    bg.signal(libc::SIGTERM);
    let out = bg.finish();
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGTERM),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
}

#[test]
fn an_exec_whose_stderr_is_gone_still_exits_with_its_code() {
    let env = Env::new();
    env.make_image("a");
    // stderr is a pipe nobody reads any more (a log reader that died):
    // the error line cannot be written, the exit code must still be right.
    let mut fds = [0; 2];
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    unsafe { libc::close(fds[0]) };
    let stderr_gone = || {
        use std::os::fd::FromRawFd;
        // SAFETY: a duplicate of our pipe's write end, owned by the Stdio.
        std::process::Stdio::from(unsafe { std::fs::File::from_raw_fd(libc::dup(fds[1])) })
    };
    for (args, code) in [
        (vec!["exec", "--read", "missing", "--", "true"], 66),
        (vec!["exec", "--write", "-bad", "--", "true"], 64),
        (vec!["exec", "--read", "a", "--", "/nonexistent/program"], 1),
    ] {
        let mut c = env.cmd(&args);
        c.stdout(std::process::Stdio::null()).stderr(stderr_gone());
        let status = c.status().unwrap();
        assert_eq!(status.code(), Some(code), "{args:?}");
    }
    unsafe { libc::close(fds[1]) };
}

#[test]
fn a_nested_exec_under_no_inherit_is_not_held_back_by_a_hold_that_waits_for_its_parent() {
    let env = Env::new();
    // The outer exec keeps its locks from the command (--no-inherit): the
    // nested call holds no descriptor, yet its parent's lock on 'a' is what
    // the store-wide hold waits for.
    crate::store_wide::nested_exec_goes_ahead_of_a_hold_waiting_for_its_parent(
        &env,
        &["--no-inherit"],
    );
}
