//! `stowage exec`: the command's exit status passed through, the image
//! state a write's outcome records (also when the tree cannot be judged), the
//! command's environment and inherited descriptors, starts that fail and leave
//! nothing behind, and exec's command line.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use crate::common::*;

#[test]
fn passes_the_child_status_through() {
    let env = Env::new();
    assert_eq!(env.run_sh("a", "exit 7").status.code(), Some(7));
    assert_eq!(
        env.run(["exec", "--write", "a", "--", "true"])
            .status
            .code(),
        Some(0)
    );
    assert_eq!(env.run(["exec", "--", "false"]).status.code(), Some(1));
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
fn write_outcome_sets_the_image_state() {
    let env = Env::new();
    env.ok(["exec", "--write", "good", "--", "true"]);
    assert_eq!(env.state("good").as_deref(), Some("ready"));
    env.run(["exec", "--write", "bad", "--", "false"]);
    assert_eq!(env.state("bad").as_deref(), Some("incomplete"));
    // Rewriting an incomplete image successfully makes it ready again.
    env.ok(["exec", "--write", "bad", "--", "true"]);
    assert_eq!(env.state("bad").as_deref(), Some("ready"));
    // A failed rewrite of a ready image makes it incomplete.
    env.run(["exec", "--write", "good", "--", "false"]);
    assert_eq!(env.state("good").as_deref(), Some("incomplete"));
}

#[test]
fn read_of_missing_or_unready_image_exits_66_and_creates_nothing() {
    let env = Env::new();
    env.make_image("base");
    let before = tree(&env.root);
    let out = env.run([
        "exec",
        "--read",
        "nosuch",
        "--",
        "touch",
        env.sentinel("ran").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(stderr(&out).contains("'nosuch'"), "{}", stderr(&out));
    assert_eq!(
        tree(&env.root),
        before,
        "a read of a missing image leaves no trace"
    );
    env.run(["exec", "--write", "broken", "--", "false"]);
    let out = env.run([
        "exec",
        "--read",
        "broken",
        "--",
        "touch",
        env.sentinel("ran").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(stderr(&out).contains("incomplete"), "{}", stderr(&out));
    assert!(!env.sentinel("ran").exists());
}

#[test]
fn a_write_whose_command_deletes_the_image_removes_it() {
    // How a builder's own delete runs under stowage:
    // stowage exec --write IMG -- ch-image delete IMG
    let env = Env::new();
    env.make_image("app");
    env.build("app", "rm -rf \"$STOWAGE_IMAGE_DIR\"");
    assert_eq!(env.state("app"), None);
    assert!(!env.lock_file("app").exists());
    assert_eq!(env.run(["doctor"]).status.code(), Some(0));
}

#[test]
fn a_write_whose_images_directory_vanished_keeps_its_row() {
    let env = Env::new();
    env.make_image("base");
    // The images directory goes away under the command (unmounted, say):
    // the tree is not found, which is no sign the command deleted it.
    let out = env.run_sh("app", "echo x > \"$STOWAGE_IMAGE_DIR/f\" && mv \"$STOWAGE_IMAGES_DIR\" \"$STOWAGE_IMAGES_DIR.away\"");
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(stderr(&out).contains("incomplete"), "{}", show(&out));
    fs::rename(env.root.join("img.away"), env.root.join("img")).unwrap();
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    // A command that really deletes its image still removes the row.
    env.build("base", "rm -r \"$STOWAGE_IMAGE_DIR\"");
    assert_eq!(env.state("base"), None);
}

#[test]
fn a_tree_that_cannot_be_looked_at_is_not_taken_for_deleted() {
    // The command makes the images directory unsearchable, so finish's
    // lstat of the tree fails with EACCES — an error that, like EIO or
    // ESTALE, says nothing about whether the tree is there. Root would not
    // notice the mode: run as nobody.
    let Some(mut c) = as_nobody() else { return };
    let env = Env::new();
    let base = env.tmp.path().join("nobody");
    fs::create_dir(&base).unwrap();
    chown(&base, 65534, 65534);
    fs::set_permissions(env.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let root = base.join("root");
    let stowage = |c: &mut Command, args: &[&str]| {
        c.arg(bin()).arg("--root").arg(&root).args(args);
    };
    stowage(
        &mut c,
        &[
            "exec",
            "--write",
            "app",
            "--",
            "sh",
            "-c",
            "echo x > \"$STOWAGE_IMAGE_DIR/f\" && chmod 0 \"$STOWAGE_IMAGES_DIR\"",
        ],
    );
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    fs::set_permissions(root.join("img"), fs::Permissions::from_mode(0o755)).unwrap();
    let mut c = as_nobody().unwrap();
    stowage(&mut c, &["images", "--json"]);
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let images: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let app = images
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "app")
        .unwrap_or_else(|| panic!("the successful build's row was dropped: {images}"));
    assert_eq!(app["state"], "ready");
}

#[test]
fn an_image_directory_that_cannot_be_inspected_is_not_taken_for_deleted() {
    let env = Env::new();
    env.make_image("app");
    // The command leaves the images directory unreadable as a directory
    // (ENOTDIR for the image's path, not ENOENT).
    let out = env.run_sh(
        "app",
        "mv \"$STOWAGE_IMAGES_DIR\" \"$STOWAGE_IMAGES_DIR.aside\" && touch \"$STOWAGE_IMAGES_DIR\"",
    );
    // The build succeeded and its lock was ours throughout: an error that
    // says nothing about the tree keeps the row (the EACCES case, as an
    // unprivileged user, is a_tree_that_cannot_be_looked_at_is_not_taken_for_deleted).
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let img = env.root.join("img");
    fs::remove_file(&img).unwrap();
    fs::rename(env.root.join("img.aside"), &img).unwrap();
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

// --- the command's environment ----------------------------------------------

#[test]
fn environment_and_new_image_directory() {
    let env = Env::new();
    let report = env.sentinel("env");
    let script = format!(
        "{{ echo \"root=$STOWAGE_ROOT\"; echo \"images=$STOWAGE_IMAGES_DIR\"; echo \"image=${{STOWAGE_IMAGE_DIR-unset}}\"; \
         ls -A \"$STOWAGE_IMAGE_DIR\" | wc -l; [ -d \"$STOWAGE_IMAGE_DIR\" ] && echo isdir; }} > '{}'",
        report.display()
    );
    env.build("team/app:v1", &script);
    let text = fs::read_to_string(&report).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], format!("root={}", env.root.display()));
    assert_eq!(
        lines[1],
        format!("images={}", env.root.join("img").display())
    );
    assert_eq!(
        lines[2],
        format!("image={}", env.root.join("img/team%app+v1").display())
    );
    assert_eq!(
        lines[3].trim(),
        "0",
        "a new image's directory exists and is empty when CMD starts"
    );
    assert_eq!(lines[4], "isdir");

    // With two writes there is no single image directory.
    env.run([
        "exec", "--write", "x", "--write", "y", "--", "sh", "-c", &script,
    ]);
    let text = fs::read_to_string(&report).unwrap();
    assert!(text.contains("image=unset"), "{text}");
}

#[test]
fn the_command_gets_each_stowage_variable_once_from_this_exec() {
    let env = Env::new();
    env.make_image("a");
    let other = env.tmp.path().join("callers-store");
    // The caller works in another store. No shell in between: a shell
    // would tidy duplicate entries away, a C, Rust or Go program reads the
    // first.
    let with_callers_env = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env("STOWAGE_ROOT", &other)
            .env("STOWAGE_IMAGE_DIR", "/stale/x")
            .env("STOWAGE_IMAGES_DIR", "/stale");
        output(c)
    };
    let out = with_callers_env(&["exec", "--write", "w", "--", "env"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let values = |text: &str, k: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix(&format!("{k}=")))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(
        values(&text, "STOWAGE_ROOT"),
        [env.root.display().to_string()]
    );
    assert_eq!(
        values(&text, "STOWAGE_IMAGES_DIR"),
        [env.root.join("img").display().to_string()]
    );
    assert_eq!(
        values(&text, "STOWAGE_IMAGE_DIR"),
        [env.root.join("img/w").display().to_string()]
    );

    // A nested exec works in this exec's store.
    let out = with_callers_env(&[
        "exec",
        "--write",
        "w",
        "--",
        bin(),
        "exec",
        "--read",
        "a",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(!other.exists(), "the caller's store was created");

    // Two writes: no single image directory, and none left from the caller.
    let out = with_callers_env(&["exec", "--write", "x", "--write", "y", "--", "env"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(values(&text, "STOWAGE_IMAGE_DIR").is_empty(), "{text}");
    assert_eq!(values(&text, "STOWAGE_ROOT").len(), 1, "{text}");
}

#[test]
fn command_inherits_image_locks_but_nothing_else() {
    let env = Env::new();
    env.make_image("base");
    let fds = env.sentinel("fds");
    let list = format!("ls -l /proc/$$/fd > '{}'", fds.display());
    env.ok([
        "exec", "--read", "base", "--write", "new", "--", "sh", "-c", &list,
    ]);
    let text = fs::read_to_string(&fds).unwrap();
    assert!(text.contains("locks/images/base.lock"), "{text}");
    assert!(text.contains("locks/images/new.lock"), "{text}");
    assert!(
        !text.contains("global.lock"),
        "the global lock is never inherited: {text}"
    );
    assert!(
        !text.contains("stowage.db"),
        "the database is never inherited: {text}"
    );

    env.ok([
        "exec",
        "--no-inherit",
        "--read",
        "base",
        "--",
        "sh",
        "-c",
        &list,
    ]);
    let text = fs::read_to_string(&fds).unwrap();
    assert!(
        !text.contains(".lock"),
        "--no-inherit keeps locks in stowage: {text}"
    );
}

// --- starts that fail -------------------------------------------------------

#[test]
fn a_command_that_cannot_start_leaves_nothing() {
    let env = Env::new();
    env.make_image("base");
    let out = env.run([
        "exec",
        "--read",
        "base",
        "--write",
        "new",
        "--",
        "/nonexistent/builder",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("/nonexistent/builder"),
        "{}",
        stderr(&out)
    );
    assert_eq!(env.state("new"), None);
    assert!(!env.root.join("img/new").exists());
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

#[test]
fn a_start_that_fails_leaves_no_directory_and_no_lock_file() {
    let env = Env::new();
    env.ok(["init"]);
    // 'b' cannot be written (its directory is a symlink): 'a', created in
    // the same transaction, must not stay behind without a row.
    std::os::unix::fs::symlink("/tmp", env.root.join("img/b")).unwrap();
    let out = env.run(["exec", "--write", "a", "--write", "b", "--", "true"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(!env.root.join("img/a").exists());
    let out = env.ok(["init"]);
    assert!(!stderr(&out).contains("adopted"), "{}", stderr(&out));
    assert_eq!(env.state("a"), None);
    // A refused read leaves no lock file for the image it would have made.
    env.run(["exec", "--write", "broken", "--", "false"]);
    let out = env.run(["exec", "--write", "app2", "--from", "broken", "--", "true"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(!env.lock_file("app2").exists());
    assert!(!env.root.join("img/app2").exists());
}

/// Reads (shared or exclusive) of images that do not exist beside one that
/// is busy fail at once, before any wait, naming every missing image on one
/// line.
#[test]
fn reads_of_missing_images_beside_a_busy_one_name_them_all_at_once() {
    let env = Env::new();
    env.make_image("a");
    let writer = env.hold(&["--write", "a"], "started");
    let args = [
        "exec", "--read", "a", "--read", "typo1", "--read", "typo0", "--", "true",
    ];
    let out = env.run(args);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("images 'typo1', 'typo0' do not exist"),
        "{err}"
    );
    let exclusive = [
        "exec",
        "--read",
        "a",
        "--read-exclusive",
        "zz",
        "--",
        "true",
    ];
    let mut no_wait = exclusive.to_vec();
    no_wait.insert(1, "--no-wait");
    let out = env.run(&no_wait);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    // Without a bound a wait for 'a' would last as long as its writer.
    let mut exec = env.spawn(exclusive);
    let waits = |env: &Env| {
        env.lock_entry("a")
            .is_some_and(|e| e["waiters"] != serde_json::json!([]))
    };
    wait_until("exec ends or waits for 'a'", || {
        !exec.is_running() || waits(&env)
    });
    let ended = !exec.is_running();
    env.release("release");
    assert_eq!(writer.finish().status.code(), Some(0));
    let out = exec.finish();
    assert!(ended, "exec waited for 'a': {}", show(&out));
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains("image 'zz' does not exist"),
        "{}",
        show(&out)
    );
}

#[test]
fn a_start_that_fails_leaves_no_lock_file() {
    let env = Env::new();
    env.ok(["init"]);
    let out = env.run(["exec", "--write", "new", "--", "/nonexistent/command"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(!env.lock_file("new").exists());
    // A read of a missing image next to a new write.
    let out = env.run(["exec", "--write", "new", "--read", "zzz", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    assert!(!env.lock_file("new").exists());
    assert_eq!(tree(&env.root.join("locks/images")), Vec::<String>::new());
    env.ok(["doctor"]);
}

#[test]
fn starts_that_fail_leave_no_lock_file_or_gate() {
    let env = Env::new();
    // A start that fails: the command cannot be run.
    let out = env.run(["exec", "--write", "new", "--", "/nonexistent/cmd"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(!env.lock_file("new").exists());
    // A request that times out after it created a lock file for a new
    // image earlier in the lock order.
    let zzz = env.hold(&["--write", "zzz"], "zzz");
    let out = env.run([
        "exec", "--write", "aaa", "--write", "zzz", "--wait", "0.5", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(!env.lock_file("aaa").exists());
    env.release("release");
    assert_eq!(zzz.finish().status.code(), Some(0));
    // A writer that waited (making the gate), then found the image gone
    // (its holder's command deleted it) and could not start its command.
    let mut args = vec!["exec".to_owned(), "--write".into(), "n".into(), "--".into()];
    let mut hold = env.hold_cmd("n", "release-n");
    hold[2] = format!("{}; rm -rf \"$STOWAGE_IMAGE_DIR\"", hold[2]);
    args.extend(hold);
    let holder = env.spawn(&args);
    wait_for_file(&env.sentinel("n"));
    // Runnable when asked for, gone by the time the lock is had.
    let cmd = env.scratch.join("builder");
    fs::write(&cmd, "#!/bin/sh\n").unwrap();
    fs::set_permissions(&cmd, fs::Permissions::from_mode(0o755)).unwrap();
    let w = env.spawn(["exec", "--write", "n", "--", cmd.to_str().unwrap()]);
    env.wait_for_waiter("n");
    fs::remove_file(&cmd).unwrap();
    env.release("release-n");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert_eq!(w.finish().status.code(), Some(1));
    assert!(env.image("n").is_none());
    assert!(!env.lock_file("n").exists());
    assert!(!gate_file(&env, "n").exists());
}

/// A start that runs out of file descriptors, wherever it does (taking a
/// lock, reading store.conf, opening the images directory), says so on one
/// line and unlinks the lock file it made for its new image, even with no
/// descriptor left to open its directory by then.
#[test]
fn a_start_out_of_file_descriptors_leaves_no_lock_file() {
    use std::os::unix::process::CommandExt;
    let env = Env::new();
    env.make_image("base");
    let mut refused = 0;
    for limit in 4..=16u64 {
        for (how, short) in [("--read", "r"), ("--from", "f")] {
            let name = format!("new{limit}{short}");
            let mut c = env.cmd(["exec", "--write", &name, how, "base", "--", "true"]);
            // SAFETY: only setrlimit(2) runs between fork and exec.
            unsafe {
                c.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: limit,
                        rlim_max: limit,
                    };
                    libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
                    Ok(())
                });
            }
            let out = output(c);
            if code(&out) == Some(0) {
                continue;
            }
            refused += 1;
            let err = stderr(&out);
            assert_eq!(code(&out), Some(1), "limit {limit}: {}", show(&out));
            assert!(
                err.contains("Too many open files") && err.lines().count() == 1,
                "limit {limit}: {err}"
            );
            assert!(!env.lock_file(&name).exists(), "limit {limit}: {err}");
            assert_eq!(env.state(&name), None, "limit {limit}");
        }
    }
    assert!(refused > 2, "every start got the descriptors it needed");
    let out = env.ok(["doctor"]);
    assert!(!stdout(&out).contains("name no image"), "{}", show(&out));
}

// --- the command line -------------------------------------------------------

/// `stowage` without a subcommand is a usage error like any other: one
/// line on stderr, exit 64 (it printed the whole help there); `--help`
/// still prints the help on stdout, exit 0.
#[test]
fn a_missing_subcommand_is_one_usage_line() {
    let env = Env::new();
    for args in [&[][..], &["-q"], &["-v"]] {
        let mut c = Command::new(bin());
        c.args(args).env_remove("STOWAGE_ROOT");
        let out = output(c);
        assert_eq!(code(&out), Some(64), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: {}",
            show(&out)
        );
        assert!(
            err.contains("missing subcommand; see 'stowage --help'"),
            "{}",
            show(&out)
        );
        assert!(out.stdout.is_empty(), "{}", show(&out));
    }
    let out = env.ok(["--help"]);
    assert!(stdout(&out).lines().count() > 10, "{}", show(&out));
    assert!(stderr(&out).is_empty(), "{}", show(&out));
    assert!(!env.root.exists());
}

#[test]
fn bad_arguments_exit_64() {
    let env = Env::new();
    for args in [
        vec!["exec", "--wait", "-1", "--", "true"],
        vec!["exec", "--wait", "nan", "--", "true"],
        vec!["exec", "--wait", "inf", "--", "true"],
        vec!["exec", "--wait", "1e300", "--", "true"],
        vec!["exec", "--wait", "soon", "--", "true"],
        vec!["exec", "--wait", "1", "--no-wait", "--", "true"],
        vec!["exec", "--read", "a", "--write", "a", "--", "true"],
        vec!["exec", "--write", "a"],
        vec!["exec", "--conflict-exit-code", "256", "--", "true"],
        vec!["frobnicate"],
        vec!["exec", "--wirte", "a", "--", "true"],
        vec!["exec", "--write", "a", "true"],
    ] {
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", show(&out));
        assert_eq!(
            stderr(&out).trim_end().lines().count(),
            1,
            "{args:?}: one line: {}",
            stderr(&out)
        );
    }
    assert!(!env.root.exists());
}

#[test]
fn a_command_without_the_double_dash_is_explained() {
    let env = Env::new();
    let out = env.run([
        "exec", "--write", "app", "ch-image", "build", "-t", "app", ".",
    ]);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("put the command after '--'"), "{err}");
    assert!(
        err.contains("exec --write app -- ch-image build -t app ."),
        "{err}"
    );
    assert!(err.contains("usage: stowage exec"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(!env.root.exists(), "nothing created");
}

/// `--wait` with its value forgotten takes the `--` as its value; clap then
/// blames the command, which was after `--`. The line names the option.
#[test]
fn a_value_forgotten_before_the_double_dash_is_named() {
    let env = Env::new();
    for (args, flag) in [
        (
            &["exec", "--write", "app", "--wait", "--", "sleep", "1"][..],
            "--wait",
        ),
        (
            &["exec", "--write", "app", "--read", "--", "true"][..],
            "--read",
        ),
    ] {
        let out = env.run(args);
        assert_eq!(out.status.code(), Some(64), "{}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&format!("{flag} is missing its value")),
            "{args:?}: {err}"
        );
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    assert!(!env.root.exists(), "nothing created");
}

/// `stowage --write app exec …`: an option of exec before `exec` is shown
/// where it goes, never as help for a subcommand named after its value.
#[test]
fn an_exec_option_before_exec_is_shown_after_it() {
    let env = Env::new();
    for (args, fixed) in [
        (
            &["--write", "app", "exec", "--", "true"][..],
            "exec --write app -- true",
        ),
        (
            &["--wait=3", "exec", "--write", "a", "--", "true"][..],
            "exec --wait=3 --write a -- true",
        ),
    ] {
        let out = env.run(args);
        assert_eq!(out.status.code(), Some(64), "{}", show(&out));
        let err = stderr(&out);
        assert!(err.contains(fixed), "{args:?}: {err}");
        assert!(err.contains("'stowage exec --help'"), "{args:?}: {err}");
        assert!(!err.contains("stowage app"), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    assert!(!env.root.exists(), "nothing created");
}

/// The `--` goes before the command's first word as exec parses it, not
/// before the first word that happens to match it (an image named like
/// the command).
#[test]
fn the_double_dash_fix_starts_at_the_commands_first_word() {
    let env = Env::new();
    let out = env.run(["exec", "--write", "make", "make", "all"]);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("exec --write make -- make all"), "{err}");
    assert!(!err.contains("--write -- make"), "{err}");
    assert!(!env.root.exists(), "nothing created");
}

#[test]
fn typos_get_a_suggestion() {
    let env = Env::new();
    for (args, want) in [
        (&["exec", "--wirte", "app", "--", "true"][..], "'--write'"),
        (&["image"][..], "'images'"),
        (&["lock-status", "--wath", "1"][..], "'--watch'"),
        // Of several near words, the nearest ('ls' is near too).
        (&["lockstatus"][..], "'lock-status'"),
        (&["lock_status"][..], "'lock-status'"),
    ] {
        let out = env.run(args);
        assert_eq!(out.status.code(), Some(64), "{}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&format!("did you mean {want}")),
            "{args:?}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // A newline in the word it quotes is shown as one, not as a space
    // (which would name another word).
    for args in [&["bo\ngus"][..], &["\n"], &["images", "--bo\ngus"]] {
        let out = env.run(args);
        assert_eq!(out.status.code(), Some(64), "{}", show(&out));
        let err = stderr(&out);
        let word = format!("'{}'", args.last().unwrap().replace('\n', r"\n"));
        assert!(err.contains(&word) && !err.contains("Usage"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

#[test]
fn times_take_units() {
    let env = Env::new();
    let out = env.run(["exec", "--write", "app", "--wait", "10s", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let out = env.run(["exec", "--write", "app", "--wait", "1.5", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    // A busy lock and a wait in milliseconds: 75 after the wait.
    let holder = env.hold(&["--write", "app"], "started");
    let out = env.run(["exec", "--write", "app", "--wait", "200ms", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    env.release("release");
    holder.finish();
    let out = env.run(["rm", "app", "--wait", "1m"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let out = env.run(["exec", "--write", "x", "--wait", "10 parsecs", "--", "true"]);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(stderr(&out).contains("--wait"), "{}", show(&out));
}

/// A number, size or time that starts with '-' is that option's value, refused by the option's
/// own rule (which quotes it whole), never "unexpected argument '-5'" with the unit cut off.
#[test]
fn a_negative_number_size_or_time_is_refused_by_its_options_own_rule() {
    let env = Env::new();
    env.ok(["init"]);
    for (args, says) in [
        (&["gc", "--max-size", "-5G"][..], "--max-size '-5G'"),
        (&["gc", "--unused-for", "-1d"], "--unused-for '-1d'"),
        (
            &["exec", "--conflict-exit-code", "-1", "--", "true"],
            "'-1' for '--conflict-exit-code",
        ),
        (&["exec", "--wait", "-1s", "--", "true"], "--wait '-1s'"),
        (&["rm", "--wait", "-1", "x"], "--wait '-1'"),
        (&["slots", "set", "pull", "-1"], "LIMIT '-1'"),
        (
            &["slots", "set", "pull", "1", "--reserve-high", "-1"],
            "--reserve-high '-1'",
        ),
        (&["lock-status", "--why", "-1"], "--why '-1'"),
        (&["lock-status", "--watch", "-1m"], "--watch '-1m'"),
        (&["doctor", "--hold-probe", "-1"], "--hold-probe '-1'"),
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(64), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    }
    // An option's name is still an option where a number goes.
    env.ok(["slots", "set", "pull", "-v", "2"]);
}

/// Every time option reads one grammar (a number, a unit of ms, s, m, h, d or w), says it in its
/// help and its refusal alike; a unit spelled out is the same unit.
#[test]
fn every_time_option_reads_one_grammar_and_says_it_alike() {
    let env = Env::new();
    for wait in ["1hour", "1w", "10seconds", "2mins", "0.5d", "3 hrs"] {
        let out = env.run(["exec", "--write", "a", "--wait", wait, "--", "true"]);
        assert_eq!(code(&out), Some(0), "{wait}: {}", show(&out));
    }
    for unused in ["3hours", "2weeks", "30minutes", "0"] {
        env.ok(["gc", "--unused-for", unused, "--dry-run"]);
    }
    let units = "a unit of ms, s, m, h, d, w";
    for (args, option) in [
        (&["exec", "--wait", "1x", "--", "true"][..], "exec"),
        (&["rm", "--wait", "1x", "a"], "rm"),
        (&["lock-status", "--watch", "1x"], "lock-status"),
        (&["doctor", "--hold-probe", "1x"], "doctor"),
        (&["gc", "--unused-for", "1x"], "gc"),
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(64), "{args:?}: {}", show(&out));
        assert!(
            stderr(&out).contains(&format!("'1x': not a time (a number and {units}")),
            "{args:?}: {}",
            show(&out)
        );
        let help = stdout(&env.ok([option, "--help"]));
        assert!(help.contains(units), "{option}: {help}");
    }
    // Months and years have no one length (and M is a minute to some): refused, not guessed.
    // Each told what its own unit is.
    for (args, says) in [
        (
            &["gc", "--unused-for", "1M"][..],
            "'1M': M reads as a minute or a month",
        ),
        (
            &["gc", "--unused-for", "6months"],
            "'6months': months and years",
        ),
        (
            &["exec", "--wait", "1y", "--", "true"],
            "'1y': months and years",
        ),
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(64), "{args:?}: {}", show(&out));
        assert!(stderr(&out).contains(says), "{}", show(&out));
    }
}

/// An empty value (`--root "$UNSET"`) is called empty, not "none was supplied", for every
/// argument clap would misname so: paths, choices, positions.
#[test]
fn an_empty_value_is_called_empty_not_missing() {
    let env = Env::new();
    for (args, says) in [
        (
            &["--root", "", "images"][..],
            "--root: the DIR given is empty (is a variable unset?)",
        ),
        (&["--root=", "images"], "--root: the DIR given is empty"),
        (
            &["init", "--images-dir", ""],
            "--images-dir: the DIR given is empty",
        ),
        (
            &["init", "--images-dir="],
            "--images-dir: the DIR given is empty",
        ),
        (
            &["exec", "--slot", "x", "--priority", "", "--", "true"],
            "--priority: the PRIORITY given is empty",
        ),
        (&["completions", ""], "the SHELL given is empty"),
    ] {
        let mut c = Command::new(bin());
        c.args(args).env("STOWAGE_ROOT", &env.root);
        let out = output(c);
        assert_eq!(code(&out), Some(64), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("none was supplied"), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    }
    // A value truly missing is still said so.
    let out = env.run(["--root"]);
    assert!(stderr(&out).contains("none was supplied"), "{}", show(&out));
    assert!(!env.root.exists(), "nothing created");
}

/// A new image whose writer failed before putting anything in its tree
/// leaves no directory behind (builders that list the images directory,
/// like `ch-image list`, trip over empty ones): the row stays, incomplete,
/// as the contract says. A tree a failed writer did write stays for
/// inspection, and an existing image's directory is never removed. The
/// image without a tree is an ordinary incomplete image for every command.
#[test]
fn a_failed_new_image_leaves_no_empty_directory() {
    let env = Env::new();
    let img = env.root.join("img");
    let out = env.run(["exec", "--write", "empty", "--", "false"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(env.state("empty").as_deref(), Some("incomplete"));
    assert!(!img.join("empty").exists(), "{:?}", tree(&img));
    assert_eq!(env.image("empty").unwrap()["size_bytes"], 0);
    // What a failed writer wrote stays.
    let out = env.run_sh("kept", "echo x > \"$STOWAGE_IMAGE_DIR/f\"; exit 3");
    assert_eq!(out.status.code(), Some(3), "{}", show(&out));
    assert!(img.join("kept/f").exists());
    // An existing image's (empty) directory is not this write's to remove.
    env.build("old", "true");
    env.run(["exec", "--write", "old", "--", "false"]);
    assert_eq!(env.state("old").as_deref(), Some("incomplete"));
    assert!(img.join("old").is_dir());
    // Reading it says it is not ready; doctor finds nothing wrong.
    let out = env.run(["exec", "--read", "empty", "--", "true"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    let out = env.run(["doctor"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    // Writing it again makes its directory anew.
    env.build(
        "empty",
        "test -d \"$STOWAGE_IMAGE_DIR\" && touch \"$STOWAGE_IMAGE_DIR/g\"",
    );
    assert_eq!(env.state("empty").as_deref(), Some("ready"));
    assert!(img.join("empty/g").exists());
    // rm and gc remove such images like any other.
    env.run(["exec", "--write", "gone1", "--", "false"]);
    env.run(["exec", "--write", "gone2", "--", "false"]);
    env.ok(["rm", "gone1"]);
    env.ok(["gc"]);
    assert_eq!(env.state("gone1"), None);
    assert_eq!(env.state("gone2"), None);
    assert!(!img.join("gone2").exists());
}

/// A read of an image used in the last five minutes writes nothing to the
/// metadata (its holder is named by its lease, its last use is fresh
/// enough): the database file is not touched. A read of an image last used
/// longer ago records the use.
#[test]
fn a_read_writes_no_metadata_while_last_use_is_fresh() {
    let env = Env::new();
    env.make_image("base");
    let db = env.root.join("stowage.db");
    let last_used = || env.image("base").unwrap()["last_used"].clone();
    let used = last_used();
    let before = fs::read(&db).unwrap();
    let lock = env.root.join("locks/images/base.lock");
    let lock_before = fs::read(&lock).unwrap();
    env.ok(["exec", "--read", "base", "--", "true"]);
    env.ok(["exec", "--read", "base", "--", "true"]);
    assert!(fs::read(&db).unwrap() == before, "the catalog changed");
    assert!(
        fs::read(&lock).unwrap() == lock_before,
        "the lock file changed"
    );
    assert_eq!(last_used(), used);
    // Ten minutes on, a read records the use.
    let mut c = env.cmd(["exec", "--read", "base", "--", "true"]);
    let later = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    c.env("STOWAGE_NOW", later.to_string());
    assert_eq!(output(c).status.code(), Some(0));
    assert_ne!(last_used(), used, "a stale last use is recorded");
}

/// The empty directory of a new image whose writer failed goes at the
/// finish — but not while a process of the failed command's tree that
/// inherited the write lock (a background job) still works in it: what it
/// writes there afterwards must not be lost with an unlinked directory.
#[test]
fn a_failed_writers_surviving_child_keeps_the_new_image_directory() {
    let env = Env::new();
    let go = env.sentinel("go");
    let done = env.sentinel("done");
    // The command enters the fresh (empty) directory, leaves a background
    // job there that holds the inherited write lock, and fails at once.
    let script = format!(
        "cd \"$STOWAGE_IMAGE_DIR\" || exit 9; \
         ( i=0; while [ ! -e '{g}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done; \
           echo late > written-late; touch '{d}' ) >/dev/null 2>&1 & exit 1",
        g = go.display(),
        d = done.display()
    );
    let out = env.run(["exec", "--write", "app", "--", "sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    std::fs::write(&go, "").unwrap();
    wait_for_file(&done);
    assert!(
        env.root.join("img/app/written-late").is_file(),
        "the surviving writer's file is in the image directory: {:?}",
        tree(&env.root.join("img"))
    );
    // Without a survivor, the empty directory still goes (the test can
    // fail the other way).
    let out = env.run(["exec", "--write", "other", "--", "false"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(!env.root.join("img/other").exists());
    let out = env.run(["exec", "--no-inherit", "--write", "third", "--", "false"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(!env.root.join("img/third").exists());
}

/// A writer that waited for another writer of the image, then found its
/// command cannot start: the image is as the first writer left it, ready.
#[test]
fn a_waiting_writer_whose_command_cannot_start_leaves_the_image_ready() {
    let env = Env::new();
    env.make_image("base");
    let first = env.hold(&["--write", "base"], "started");
    // Runnable when asked for, gone by the time the lock is had.
    let cmd = env.scratch.join("builder");
    fs::write(&cmd, "#!/bin/sh\n").unwrap();
    fs::set_permissions(&cmd, fs::Permissions::from_mode(0o755)).unwrap();
    let waiter = env.spawn(["exec", "--write", "base", "--", cmd.to_str().unwrap()]);
    env.wait_for_waiter("base");
    fs::remove_file(&cmd).unwrap();
    env.release("release");
    assert_eq!(code(&first.finish()), Some(0));
    let out = waiter.finish();
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stderr(&out).contains("cannot run"),
        "its command never ran: {}",
        show(&out)
    );
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "base", "--", "true"]);
}

/// A command that cannot start is said in the user's words, one line: a
/// directory given as the command is "a directory" (it was "Permission
/// denied"), and no "(os error N)" trails the cause. So is the written
/// image's own directory; a new image's is not there when the command is
/// looked for, before anything is made. An empty name is a usage error.
#[test]
fn a_command_that_cannot_start_is_said_plainly() {
    let env = Env::new();
    env.make_image("old");
    let dir = env.tmp.path().to_str().unwrap().to_owned();
    let own = env.root.join("img/app").to_str().unwrap().to_owned();
    let out = env.run([
        "exec",
        "--write",
        "old",
        "--",
        env.root.join("img/old").to_str().unwrap(),
    ]);
    assert!(stderr(&out).contains("it is a directory"), "{}", show(&out));
    assert_eq!(env.state("old").as_deref(), Some("ready"));
    for (cmd, says) in [
        (dir.as_str(), "it is a directory"),
        (own.as_str(), "No such file or directory"),
        ("./no-such-builder", "No such file or directory"),
    ] {
        let out = env.run(["exec", "--write", "app", "--", cmd]);
        assert_eq!(code(&out), Some(1), "{cmd}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&format!("cannot run '{cmd}': {says}")),
            "{}",
            show(&out)
        );
        assert!(!err.contains("os error"), "{}", show(&out));
        assert_eq!(err.trim_end().lines().count(), 1, "{}", show(&out));
    }
    assert!(env.image("app").is_none());
    // An empty name is a mistake in the call, not a file denied ("Permission denied": the search
    // found each PATH directory itself).
    let out = env.run(["exec", "--write", "app", "--", ""]);
    assert_eq!(code(&out), Some(64), "{}", show(&out));
    assert!(
        stderr(&out).contains("cannot run '': the command's name is empty"),
        "{}",
        show(&out)
    );
    assert!(env.image("app").is_none());
    // Whatever the words hold, one line and no escape reaching the terminal
    // (a command given without '--' was printed raw, over three lines).
    let out = env.run(["exec", "--write", "app", "x\x1b[31m\ny"]);
    assert_eq!(code(&out), Some(64), "{}", show(&out));
    assert_eq!(stderr(&out).trim_end().lines().count(), 1, "{}", show(&out));
    assert!(!stderr(&out).contains('\x1b'), "{}", show(&out));
}

/// An executable file without "#!" runs as a shell script, as execvp(3)
/// and so flock(1) run it, with or without `--no-inherit` (posix_spawn alone
/// refused it: "Exec format error"), by path and found in PATH.
#[test]
fn an_executable_script_without_an_interpreter_line_runs_in_the_shell() {
    let env = Env::new();
    let bin = env.tmp.path().join("bin");
    fs::create_dir(&bin).unwrap();
    let script = bin.join("plain-script");
    fs::write(&script, "echo \"$@\" > \"$STOWAGE_IMAGE_DIR/said\"\n").unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let by_path = script.to_str().unwrap();
    for (n, (how, cmd)) in [
        ("", by_path),
        ("", "plain-script"),
        ("--no-inherit", by_path),
    ]
    .into_iter()
    .enumerate()
    {
        let img = format!("app{n}");
        let mut args = vec!["exec", "--write", &img];
        args.extend([how].into_iter().filter(|h| !h.is_empty()));
        args.extend(["--", cmd, "one", "two"]);
        let mut c = env.cmd(&args);
        c.env("PATH", &path);
        let out = output(c);
        assert_eq!(code(&out), Some(0), "{how} {cmd}: {}", show(&out));
        assert_eq!(env.read_in_image(&img, "said"), "one two\n");
    }
}

/// Something in a new image's place is refused with advice that works:
/// `doctor --repair` adopts a directory with contents, never a symlink or a
/// file, so only the directory's refusal offers it.
#[test]
fn a_new_image_refused_for_what_is_in_its_place_is_told_what_repair_does() {
    let env = Env::new();
    env.ok(["init"]);
    let img = env.root.join("img");
    std::os::unix::fs::symlink(env.tmp.path(), img.join("linked")).unwrap();
    fs::write(img.join("file"), "x").unwrap();
    fs::create_dir(img.join("full")).unwrap();
    fs::write(img.join("full/data"), "x").unwrap();
    for (name, adopted) in [("linked", false), ("file", false), ("full", true)] {
        let out = env.run(["exec", "--write", name, "--", "true"]);
        assert_eq!(code(&out), Some(1), "{name}: {}", show(&out));
        let err = stderr(&out);
        assert!(err.contains("refusing to build into it ("), "{err}");
        assert!(err.contains("remove it"), "{err}");
        assert_eq!(err.contains("adopts it"), adopted, "{name}: {err}");
        // Only a directory may be an image whose record was erased.
        assert_eq!(
            err.contains("likely erased its record"),
            adopted,
            "{name}: {err}"
        );
    }
    env.ok(["doctor", "--repair"]);
    assert!(env.image("full").is_some(), "the directory was adopted");
    assert!(env.image("linked").is_none() && env.image("file").is_none());
}

/// A request that writes an existing image and a new one whose place in
/// the images directory is taken by a file: it fails before its command,
/// and the existing image is as its last write left it, ready.
#[test]
fn a_request_refused_on_a_new_image_leaves_the_other_images_it_writes_ready() {
    let env = Env::new();
    env.make_image("a");
    env.build("a", "echo again > \"$STOWAGE_IMAGE_DIR/file\"");
    fs::write(env.root.join("img/new"), "not a directory").unwrap();
    let ran = env.sentinel("ran");
    let out = env.run([
        "exec",
        "--write",
        "a",
        "--write",
        "new",
        "--",
        "touch",
        ran.to_str().unwrap(),
    ]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("not a directory"), "{}", show(&out));
    assert!(!ran.exists());
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("a", "file"), "again\n");
    assert_eq!(env.state("new"), None);
    assert_eq!(
        fs::read_to_string(env.root.join("img/new")).unwrap(),
        "not a directory"
    );
}

/// A read of an image that is not ready says why, from its record: its
/// writer's outcome, or that its readiness is unknown and how to mark it
/// ready (before: "not ready (state: incomplete)" alone).
#[test]
fn a_read_of_an_image_not_ready_says_why() {
    let env = Env::new();
    let out = env.run(["exec", "--write", "failed", "--", "false"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    fs::create_dir_all(env.root.join("img/found")).unwrap();
    env.ok(["doctor", "--repair"]);
    let unknown = format!(
        "readiness unknown: 'stowage --root {} exec --write found -- true' marks it ready",
        env.root.display()
    );
    for (name, why) in [
        ("failed", "incomplete, its writer's outcome: exit 1"),
        ("found", unknown.as_str()),
    ] {
        let out = env.run(["exec", "--read", name, "--", "true"]);
        assert_eq!(code(&out), Some(66), "{}", show(&out));
        assert!(stderr(&out).contains(why), "{name}: {}", show(&out));
    }
}

/// A hint naming a stowage command names the root as it was given: run as
/// shown, the command acts on this store, not on the default one. Before,
/// "'stowage exec --write found -- true' marks it ready" and "'stowage
/// doctor --repair' sets it aside" left `--root` out.
#[test]
fn a_hint_names_the_root_it_was_given() {
    let env = Env::new();
    env.make_image("app");
    fs::create_dir_all(env.root.join("img/found")).unwrap();
    env.ok(["doctor", "--repair"]);
    let out = env.run(["exec", "--read", "found", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    let err = stderr(&out);
    let hint = (err.split('\'').find(|s| s.starts_with("stowage "))).unwrap_or_default();
    let root = env.root.display().to_string();
    assert!(
        hint.starts_with("stowage --root ") && hint.contains(&root),
        "{err}"
    );
    // Run as shown, with no STOWAGE_ROOT to fall back on.
    let bin_dir = std::path::Path::new(bin()).parent().unwrap();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap());
    let ran = Command::new("sh")
        .args(["-c", hint])
        .env("PATH", &path)
        .env_remove("STOWAGE_ROOT")
        .status()
        .unwrap();
    assert!(ran.success(), "{hint}");
    assert_eq!(env.state("found").as_deref(), Some("ready"));
    // A planted lock file: the refusal's fix names the root too.
    fs::remove_file(env.lock_file("app")).unwrap();
    fs::create_dir(env.lock_file("app")).unwrap();
    let out = env.run(["exec", "--read", "app", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    let fix = format!("'stowage --root {root} doctor --repair' sets it aside");
    assert!(stderr(&out).contains(&fix), "{}", show(&out));
    // A root that starts with '-' is named as `--root=…`: after a blank it reads as an option
    // (run as printed, `--root -r` was a usage error).
    let dir = env.tmp.path();
    let at = |args: &[&str]| {
        let mut c = Command::new(bin());
        c.args(args).current_dir(dir).env_remove("STOWAGE_ROOT");
        output(c)
    };
    assert_eq!(
        code(&at(&["--root=-r", "exec", "--write", "a", "--", "true"])),
        Some(0)
    );
    fs::remove_file(dir.join("-r/locks/images/a.lock")).unwrap();
    fs::create_dir(dir.join("-r/locks/images/a.lock")).unwrap();
    let out = at(&["--root=-r", "exec", "--read", "a", "--", "true"]);
    let err = stderr(&out);
    let hint = (err.split('\'').find(|s| s.starts_with("stowage "))).unwrap_or_default();
    assert!(hint.starts_with("stowage --root=-r "), "{err}");
    let ran = Command::new("sh")
        .args(["-c", hint])
        .env("PATH", &path)
        .current_dir(dir)
        .env_remove("STOWAGE_ROOT")
        .status()
        .unwrap();
    assert!(ran.success(), "{hint}");
}

/// A command that cannot be started (a typo, a directory, a file without
/// execute permission) is found so before the session begins: with
/// `--from` no copy of the base is left behind as an incomplete image, as
/// none is without it.
#[test]
fn a_command_that_cannot_start_leaves_no_copy_of_the_base() {
    let env = Env::new();
    env.make_image("hello");
    let plain = env.scratch.join("notes.txt");
    fs::write(&plain, "not a program\n").unwrap();
    let dir = env.scratch.to_str().unwrap().to_owned();
    for (cmd, says) in [
        ("./typo-script", "No such file or directory"),
        ("no-such-builder-in-path", "No such file or directory"),
        (dir.as_str(), "it is a directory"),
        (plain.to_str().unwrap(), "Permission denied"),
    ] {
        let out = env.run(["exec", "--write", "ff1", "--from", "hello", "--", cmd]);
        assert_eq!(code(&out), Some(1), "{cmd}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&format!("cannot run '{cmd}': {says}")),
            "{}",
            show(&out)
        );
        assert!(env.image("ff1").is_none(), "{cmd}: {:?}", env.image("ff1"));
        assert!(!env.root.join("img/ff1").exists(), "{cmd}");
    }
    assert_eq!(env.state("hello").as_deref(), Some("ready"));
}

/// A request that cannot succeed on a root that does not exist yet creates
/// nothing there (a base that cannot be there, said as the root missing; a
/// command that cannot start); a valid first write still makes the store.
#[test]
fn an_exec_that_cannot_succeed_on_a_new_root_creates_nothing() {
    let env = Env::new();
    for (args, exit) in [
        (
            &["exec", "--write", "a", "--from", "nosuch", "--", "true"][..],
            66,
        ),
        (
            &["exec", "--write", "a", "--read", "nosuch", "--", "true"],
            66,
        ),
        (&["exec", "--write", "a", "--", "./typo"], 1),
        (&["exec", "--store-wide", "--", "./typo"], 1),
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(exit), "{args:?}: {}", show(&out));
        assert!(!env.root.exists(), "{args:?} made {:?}", tree(&env.root));
        // A base that cannot be there is said as a read alone says it: the root is missing (it
        // was "image 'nosuch' does not exist", sending the user to pull a base they have).
        if exit == 66 {
            let root = format!("root {} does not exist", env.root.display());
            assert!(stderr(&out).contains(&root), "{args:?}: {}", show(&out));
        }
    }
    env.ok(["exec", "--write", "a", "--", "true"]);
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}

/// `-q` silences progress and waiting chatter on stderr, never a report on
/// stdout nor the line saying a command was skipped: with
/// `--conflict-exit-code 0` a busy lock skips the command, and stderr alone
/// says so, `-q` or not; `gc` and `doctor` print their reports.
#[test]
fn quiet_never_hides_a_skip_or_a_report() {
    let env = Env::new();
    env.make_image("hello");
    env.run(["exec", "--write", "failed", "--", "false"]);
    let holder = env.hold(&["--write", "hello"], "held");
    let out = env.run([
        "-q",
        "exec",
        "--read",
        "hello",
        "--no-wait",
        "--conflict-exit-code",
        "0",
        "--",
        "echo",
        "RAN",
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(!stdout(&out).contains("RAN"), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("'hello'") && err.contains("busy"),
        "{}",
        show(&out)
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{}", show(&out));
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
    let out = env.ok(["-q", "gc", "--dry-run"]);
    assert!(
        stdout(&out).contains("would remove 'failed'"),
        "{}",
        show(&out)
    );
    let out = env.run(["-q", "doctor"]);
    assert!(stdout(&out).contains("incomplete"), "{}", show(&out));
}
