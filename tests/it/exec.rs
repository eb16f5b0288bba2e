//! `stowage exec`: exit codes, environment, states, waiting, signals.

use std::fs;
use std::time::{Duration, Instant};

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

#[test]
fn bounded_wait_gives_75_naming_the_holder() {
    let env = Env::new();
    env.make_image("app");
    let holder = env.hold(&["--write", "app"], "started");

    let t0 = Instant::now();
    let out = env.run([
        "exec",
        "--read",
        "app",
        "--wait",
        "0.5",
        "--",
        "touch",
        env.sentinel("ran").to_str().unwrap(),
    ]);
    let waited = t0.elapsed();
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(
        waited >= Duration::from_millis(450),
        "gave up too early: {waited:?}"
    );
    let err = stderr(&out);
    assert!(
        err.contains(&format!("pid {}", holder.pid())),
        "names the holder's pid: {err}"
    );
    assert!(err.contains("sh -c"), "names the holder's command: {err}");
    assert!(
        err.contains("waiting for read lock on image 'app'"),
        "{err}"
    );
    assert!(!env.sentinel("ran").exists());

    // --no-wait: no waiting at all.
    let out = env.run(["exec", "--read", "app", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(!stderr(&out).contains("waiting for"), "{}", stderr(&out));

    // --conflict-exit-code replaces 75.
    let out = env.run([
        "exec",
        "--write",
        "app",
        "--no-wait",
        "--conflict-exit-code",
        "3",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", show(&out));
    env.ok([
        "exec",
        "--read",
        "app",
        "--wait",
        "0",
        "--conflict-exit-code",
        "0",
        "--",
        "false",
    ]);

    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    // The timed-out waiters left no waiter records behind.
    let entry = env.lock_entry("app").unwrap();
    assert_eq!(entry["waiters"].as_array().unwrap().len(), 0, "{entry}");
}

#[test]
fn waiter_gets_the_lock_when_the_holder_finishes() {
    let env = Env::new();
    let holder = env.hold(&["--write", "app"], "started");
    let waiter = env.spawn([
        "exec",
        "--read",
        "app",
        "--",
        "touch",
        env.sentinel("read").to_str().unwrap(),
    ]);
    env.wait_for_waiter("app");
    assert!(
        !env.sentinel("read").exists(),
        "the reader must wait for the writer"
    );
    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(env.sentinel("read").exists());
}

#[test]
fn sigterm_is_forwarded_and_gives_143() {
    let env = Env::new();
    let bg = env.start_sh(&["--write", "app"], |started| {
        format!("touch '{}'; exec sleep 60", started.display())
    });
    bg.signal(libc::SIGTERM);
    let out = bg.finish();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    assert!(flock_free(&env.lock_file("app")));
}

#[test]
fn signal_while_waiting_exits_without_running_the_command() {
    let env = Env::new();
    let holder = env.hold(&["--write", "app"], "started");
    let ran = env.sentinel("ran");
    let waiter = env.spawn([
        "exec",
        "--write",
        "app",
        "--write",
        "other",
        "--",
        "touch",
        ran.to_str().unwrap(),
    ]);
    env.wait_for_waiter("app");
    waiter.signal(libc::SIGINT);
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(130), "{}", show(&out));
    assert!(!ran.exists());
    let entry = env.lock_entry("app").unwrap();
    assert!(entry["waiters"].as_array().unwrap().is_empty(), "{entry}");
    env.release("release");
    holder.finish();
    assert_eq!(
        env.state("other"),
        None,
        "an image never written is not left behind"
    );
}

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
fn waiting_for_an_image_burns_no_cpu() {
    let env = Env::new();
    let holder = env.hold(&["--write", "app"], "started");
    let waiter = env.spawn(["exec", "--read", "app", "--wait", "600", "--", "true"]);
    env.wait_for_waiter("app");
    let before = cpu_ticks(waiter.pid());
    std::thread::sleep(Duration::from_secs(2)); // the measurement window
    let used = cpu_ticks(waiter.pid()) - before;
    assert!(
        used <= 5,
        "a bounded waiter used {used} clock ticks of CPU in 2 s"
    );
    env.release("release");
    holder.finish();
    assert_eq!(waiter.finish().status.code(), Some(0));
}

#[test]
fn the_command_starts_with_no_signal_blocked() {
    let env = Env::new();
    let out = env.ok(["exec", "--", "grep", "SigBlk", "/proc/self/status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("0000000000000000"), "{text}");
}

#[test]
fn an_ignored_sighup_stays_ignored() {
    // nohup (SIGHUP ignored): a hangup must neither stop the wait nor the command.
    let env = Env::new();
    env.make_image("app");
    let holder = env.hold(&["--write", "app"], "started");
    let ran = env.sentinel("ran");
    let mut c = std::process::Command::new("nohup");
    c.arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(["exec", "--read", "app", "--", "touch"])
        .arg(&ran);
    let waiter = Bg::from_command(c);
    env.wait_for_waiter("app");
    waiter.signal(libc::SIGHUP);
    env.release("release");
    holder.finish();
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(ran.exists());
}

#[test]
fn an_ignored_sigchld_does_not_lose_the_outcome() {
    let env = Env::new();
    let mut c = std::process::Command::new("sh");
    c.arg("-c")
        .arg("trap '' CHLD; exec \"$0\" --root \"$1\" exec --write app -- sh -c 'exit 0'")
        .arg(bin())
        .arg(&env.root);
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn a_signal_before_the_command_starts_undoes_the_start() {
    // The start transaction has marked 'base' writing (and created 'fresh');
    // a SIGTERM then arrives while another process holds the global lock.
    // The undo must still happen: base ready again, fresh gone.
    let env = Env::new();
    env.make_image("base");
    let ran = env.sentinel("ran");
    let exec = ["exec", "--write", "base", "--write", "fresh", "--", "touch"];
    let (bg, _) = env.paused(
        exec.into_iter().chain([ran.to_str().unwrap()]),
        "exec-before-spawn",
    );
    let started = env.sentinel("global-held");
    let global = flock_holder(&env.root.join("locks/global.lock"), &started, "sleep 0.5");
    bg.signal(libc::SIGTERM);
    let out = bg.finish();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    global.finish();
    assert!(!env.sentinel("ran").exists());
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.state("fresh"), None);
    assert!(!env.root.join("img/fresh").exists());
    let entry = env.lock_entry("base").unwrap();
    assert!(entry["holders"].as_array().unwrap().is_empty(), "{entry}");
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
