//! A wait you can follow: on a terminal the line is rewritten in place
//! (time waited, place in the queue, the holder's command and how long it
//! has held the lock) and cleared when the wait ends; in a log the first
//! line is followed by plain lines at most every interval; `-q` says
//! nothing.

use std::fs;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use crate::common::*;

/// Starts `stowage exec --write app -- echo done` with stdout and stderr
/// into `log`, in the background, adding a line every 100 ms.
fn waiter_into(env: &Env, log: &std::path::Path) -> Bg {
    let mut c = env.cmd(["exec", "--write", "app", "--", "echo", "done"]);
    let file = fs::File::create(log).unwrap();
    c.stdout(file.try_clone().unwrap())
        .stderr(file)
        .env(stowage::env::DEBUG_WAIT_LINE_MS, "100");
    spawned(c)
}

/// Starts `c` in its own process group, with the output it was given.
fn spawned(mut c: Command) -> Bg {
    c.process_group(0).stdin(Stdio::null());
    Bg {
        child: Some(c.spawn().expect("spawn")),
    }
}

#[test]
fn a_wait_in_a_log_adds_plain_lines_with_queue_and_holder() {
    let env = Env::new();
    let holder = env.hold(&["--write", "app"], "started");
    let log = env.sentinel("log");
    let waiter = waiter_into(&env, &log);
    wait_until("a line after the first", || {
        fs::read_to_string(&log).is_ok_and(|t| t.contains("still waiting"))
    });
    let pid = holder.pid();
    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert_eq!(waiter.finish().status.code(), Some(0));
    let text = fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("stowage: waiting for write lock on image 'app': held (write) by pid"),
        "the first line as ever: {text}"
    );
    let later: Vec<&&str> = lines
        .iter()
        .filter(|l| l.contains("still waiting"))
        .collect();
    assert!(!later.is_empty(), "{text}");
    for l in &later {
        assert!(l.contains("(1st of 1 in queue)"), "place in the queue: {l}");
        assert!(
            l.contains(&format!("held by pid {pid} (")),
            "the holder: {l}"
        );
        assert!(l.contains("(sh -c "), "the holder's command: {l}");
        assert!(l.contains(" for "), "how long it has held it: {l}");
        assert!(
            !l.contains('\r') && !l.contains('\x1b'),
            "plain text: {l:?}"
        );
    }
    assert_eq!(lines.last(), Some(&"done"), "{text}");
}

#[test]
fn a_wait_on_a_terminal_is_rewritten_in_place_and_cleared() {
    if !tool_or_skip("script", "util-linux") {
        return;
    }
    let env = Env::new();
    let holder = env.hold(&["--write", "app"], "started");
    // A terminal wide enough for the whole line (it is cut to the width).
    let (waiter, log) = on_a_terminal(
        &env,
        &format!(
            "stty cols 250; exec '{}' --root '{}' exec --write app -- echo done",
            bin(),
            env.root.display()
        ),
    );
    wait_until("the line rewritten with the time waited", || {
        fs::read_to_string(&log).is_ok_and(|t| t.contains("\rstowage: waiting 1s for"))
    });
    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert_eq!(waiter.finish().status.code(), Some(0));
    let text = fs::read_to_string(&log).unwrap();
    assert!(text.contains("(1st of 1 in queue)"), "{text:?}");
    assert!(text.contains("held by pid"), "{text:?}");
    let before_done = text.split("done").next().unwrap();
    assert!(
        before_done.ends_with("\r\x1b[K"),
        "the line is cleared before the command's output: {text:?}"
    );
    assert!(
        !before_done.contains('\n'),
        "nothing but the one line while waiting: {text:?}"
    );
}

#[test]
fn a_quiet_wait_says_nothing_even_on_a_terminal() {
    if !tool_or_skip("script", "util-linux") {
        return;
    }
    let env = Env::new();
    let holder = env.hold(&["--write", "app"], "started");
    let (waiter, log) = on_a_terminal(
        &env,
        &format!(
            "'{}' --root '{}' -q exec --write app -- echo done",
            bin(),
            env.root.display()
        ),
    );
    env.wait_for_waiter("app");
    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert_eq!(waiter.finish().status.code(), Some(0));
    assert_eq!(fs::read_to_string(&log).unwrap(), "done\r\n");
}

/// Runs the shell line `line` on a terminal of its own (script(1)); what
/// the terminal showed goes to the returned file.
fn on_a_terminal(env: &Env, line: &str) -> (Bg, std::path::PathBuf) {
    let log = env.sentinel("tty");
    let mut c = Command::new("script");
    c.args(["-qec", line, "/dev/null"])
        .stdin(Stdio::null())
        .stdout(fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .env_remove("STOWAGE_ROOT");
    (spawned(c), log)
}

/// Holds `locks` with a command, pauses `args` at `point` (reached once its first try found the
/// lock busy), lets the holder go, then the waiter: it must take the lock without a wait line.
fn freed_while_looking(env: &Env, locks: &[&str], args: &[&str], point: &str) {
    let (started, release) = (
        format!("started.{}", args[1]),
        format!("release.{}", args[1]),
    );
    let holder = env.hold_until(locks, &started, &release);
    let (waiter, go_on) = env.paused(args, point);
    env.release(&release);
    assert_eq!(holder.finish().status.code(), Some(0));
    fs::remove_file(go_on).unwrap();
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        !stderr(&out).contains("waiting for"),
        "a lock free by the time we would say so is taken, not announced: {}",
        show(&out)
    );
}

#[test]
fn a_lock_freed_while_the_waiter_looks_for_its_holder_is_taken_without_a_line() {
    let env = Env::new();
    env.make_image("base");
    let read = ["exec", "--read", "base", "--", "true"];
    freed_while_looking(&env, &["--write", "base"], &read, "image-busy");
    let write = ["exec", "--write", "base", "--", "true"];
    freed_while_looking(&env, &["--read", "base"], &write, "image-busy");
    env.ok(["slots", "set", "pull", "1"]);
    let slot = ["exec", "--slot", "pull", "--", "true"];
    freed_while_looking(&env, &["--slot", "pull"], &slot, "slot-busy");
    let store_wide = ["exec", "--store-wide", "--", "true"];
    freed_while_looking(&env, &["--read", "base"], &store_wide, "store-wide-busy");
}
