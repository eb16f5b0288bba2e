//! Image locks: bounded and unbounded waits and what they say, waiter
//! records, the writer gate and fairness between readers and writers, mutual
//! exclusion and real read concurrency proven with many processes, exclusive
//! reads, calls of stowage nested inside a command that holds locks, and the
//! lock files and gates a wait leaves behind.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;

// --- waiting ----------------------------------------------------------------

/// The time this process's first thread asked to sleep, as strace logged
/// it at `log` (every thread's sleeps; the first line is the exec).
fn main_thread_slept(log: &Path) -> Duration {
    let text = fs::read_to_string(log).unwrap();
    let main = text
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned();
    let field = |line: &str, key: &str| -> u64 {
        let at = line.find(key).map_or(line.len(), |i| i + key.len());
        let digits: String = line[at..]
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        digits.parse().unwrap_or(0)
    };
    text.lines()
        .filter(|l| l.split_whitespace().next() == Some(&main) && l.contains("nanosleep("))
        .map(|l| Duration::new(field(l, "tv_sec="), field(l, "tv_nsec=") as u32))
        .sum()
}

/// A lock held by a process no lease names (flock(1) here; a holder on
/// another host whose lease is not listed yet): where no lock table names
/// holders (a shared filesystem), `--no-wait` sleeps not at all and `--wait
/// 0.1` no longer than its 0.1 s, whoever holds it. Before, each look for
/// the holder's name slept some 150 ms for its lease to be listed: before
/// a wait began and again as it gave up (`--no-wait` took 200 ms).
#[test]
fn a_wait_for_a_holder_no_lease_names_ends_at_its_bound() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.make_image("app");
    let holder = flock_holder(
        &env.lock_file("app"),
        &env.sentinel("held"),
        &format!(
            "while [ ! -e '{}' ]; do sleep 0.05; done",
            env.sentinel("go").display()
        ),
    );
    for (args, bound) in [
        (&["--no-wait"][..], Duration::ZERO),
        (&["--wait", "0.1"], Duration::from_millis(100)),
    ] {
        let log = env.sentinel("strace");
        let mut c = Command::new("strace");
        c.args([
            "-f",
            "-qq",
            "-e",
            "trace=execve,nanosleep,clock_nanosleep",
            "-o",
        ]);
        c.arg(&log).arg(bin()).arg("--root").arg(&env.root);
        c.args(["exec", "--read", "app"])
            .args(args)
            .args(["--", "true"]);
        c.env_remove("STOWAGE_ROOT")
            .env(stowage::env::DEBUG_FILESYSTEM, "nfs");
        let out = output(c);
        assert_eq!(code(&out), Some(75), "{args:?}: {}", show(&out));
        let slept = main_thread_slept(&log);
        assert!(slept <= bound, "{args:?}: slept {slept:?}: {}", show(&out));
    }
    fs::write(env.sentinel("go"), "").unwrap();
    assert_eq!(code(&holder.finish()), Some(0));
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

/// A command not run because a lock was busy is said to be skipped, in the
/// one line on stderr, whatever the exit code: with `--conflict-exit-code 0`
/// (and `-q`) a log read afterwards must tell the skip from a run. Before,
/// the line said only that the lock was busy.
#[test]
fn a_command_skipped_for_a_busy_lock_is_said_to_be_skipped_whatever_the_exit_code() {
    let env = Env::new();
    env.make_image("app");
    let holder = env.hold(&["--write", "app"], "started");
    let ran = env.sentinel("ran");
    let touch = ["--", "touch", ran.to_str().unwrap()];
    let cases: [(&[&str], &[&str], i32); 4] = [
        (
            &[],
            &["--write", "app", "--no-wait", "--conflict-exit-code", "0"],
            0,
        ),
        (
            &["-q"],
            &[
                "--read",
                "app",
                "--wait",
                "0.2",
                "--conflict-exit-code",
                "0",
            ],
            0,
        ),
        (&[], &["--read", "app", "--no-wait"], 75),
        (
            &[],
            &["--store-wide", "--no-wait", "--conflict-exit-code", "0"],
            0,
        ),
    ];
    for (global, args, want) in cases {
        let all: Vec<&str> = global
            .iter()
            .chain(&["exec"])
            .chain(args)
            .chain(&touch)
            .copied()
            .collect();
        let out = env.run(&all);
        assert_eq!(code(&out), Some(want), "{all:?}: {}", show(&out));
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "{all:?}: {}", show(&out));
        assert!(
            err.contains("busy") || err.contains("gave up"),
            "{all:?}: {err}"
        );
        assert!(
            err.trim_end().ends_with("; 'touch' not run"),
            "{all:?}: {err}"
        );
        assert!(!ran.exists(), "{all:?}");
    }
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
}

/// A wait for several locks in turn gives up after the whole `--wait`
/// and says so: not the part of it the last lock took.
#[test]
fn a_wait_for_several_locks_says_it_gave_up_after_the_whole_wait() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    let on_a = env.hold_until(&["--write", "a"], "a-held", "a-go");
    let on_b = env.hold_until(&["--write", "b"], "b-held", "b-go");
    let reader = env.spawn([
        "exec", "--read", "a", "--read", "b", "--wait", "2", "--", "true",
    ]);
    env.wait_for_waiter("a");
    // Most of the wait goes to 'a'; what is left of it, to 'b'.
    std::thread::sleep(Duration::from_millis(1500));
    env.release("a-go");
    assert_eq!(code(&on_a.finish()), Some(0));
    let out = reader.finish();
    env.release("b-go");
    assert_eq!(code(&on_b.finish()), Some(0));
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    let said: f64 = stderr(&out)
        .split("gave up after ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|secs| secs.parse().ok())
        .unwrap_or_else(|| panic!("no time given: {}", show(&out)));
    assert!(said >= 1.5, "said {said} s of a 2 s wait: {}", show(&out));
    assert!(stderr(&out).contains("image 'b'"), "{}", show(&out));
}

/// A wait that gives up names who holds the lock then: the holder seen
/// when the wait began may be long gone (it named that one).
#[test]
fn a_wait_that_gives_up_names_the_holder_at_its_end() {
    let env = Env::new();
    env.make_image("app");
    let first = env.hold_until(&["--read", "app"], "first", "first-go");
    let second = env.hold_until(&["--read", "app"], "second", "second-go");
    let writer = env.spawn(["exec", "--write", "app", "--wait", "3", "--", "true"]);
    env.wait_for_waiter("app");
    let first_pid = first.pid();
    env.release("first-go");
    assert_eq!(code(&first.finish()), Some(0));
    let out = writer.finish();
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    let gave_up = stderr(&out)
        .lines()
        .find(|l| l.contains("gave up after"))
        .unwrap_or_default()
        .to_owned();
    assert!(
        gave_up.contains(&format!("pid {}", second.pid())),
        "{}",
        show(&out)
    );
    assert!(
        !gave_up.contains(&format!("pid {first_pid}")),
        "{}",
        show(&out)
    );
    env.release("second-go");
    assert_eq!(code(&second.finish()), Some(0));
}

/// A lock held by many, each with a long command, is still said in one
/// short line: the first holder and how many more (`lock-status` lists
/// them all).
#[test]
fn a_busy_lock_with_many_holders_is_said_in_one_short_line() {
    let env = Env::new();
    env.make_image("base");
    let holders: Vec<Bg> = ["one", "two", "three"]
        .iter()
        .map(|s| env.hold(&["--read", "base"], s))
        .collect();
    let out = env.run(["exec", "--write", "base", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    let line = err
        .trim_end()
        .replace(&env.tmp.path().display().to_string(), "TMP");
    // The holder's command is shown up to 80 characters (this one is a
    // long shell line); the three holders in full took 400. The line ends
    // saying the command was not run, and names lock-status with the root.
    assert!(
        line.chars().count() <= 240,
        "{} chars: {line}",
        line.chars().count()
    );
    assert!(line.contains("held (read) by pid"), "{line}");
    assert!(line.contains("and 2 more"), "{line}");
    env.release("release");
    for h in holders {
        assert_eq!(h.finish().status.code(), Some(0));
    }
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
fn waiting_for_an_image_burns_no_cpu() {
    let env = Env::new();
    let holder = env.hold(&["--write", "app"], "started");
    let waiter = env.spawn(["exec", "--read", "app", "--wait", "600", "--", "true"]);
    env.wait_for_waiter("app");
    assert_waits_without_cpu(&waiter);
    env.release("release");
    holder.finish();
    assert_eq!(waiter.finish().status.code(), Some(0));
}

#[test]
fn a_missing_image_to_read_is_reported_before_any_wait() {
    let env = Env::new();
    let busy = env.hold(&["--write", "busy"], "busy");
    let out = env.run([
        "exec", "--read", "missing", "--write", "busy", "--wait", "20", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains("'missing' does not exist"),
        "{}",
        show(&out)
    );
    assert!(!stderr(&out).contains("waiting"), "{}", show(&out));
    // The same before a wait for a slot.
    env.ok(["slots", "set", "one", "1"]);
    let slot = env.hold(&["--slot", "one"], "slot");
    let out = env.run([
        "exec", "--slot", "one", "--read", "missing", "--wait", "20", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    env.release("release");
    for bg in [busy, slot] {
        let out = bg.finish();
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    }
    assert!(!env.lock_file("missing").exists());
}

/// A shell script that creates sentinel `started`, waits (bounded) for
/// sentinel `go`, then runs `stowage ARGS…` against the same root.
fn nested_script(env: &Env, started: &str, go: &str, args: &str) -> String {
    format!(
        "touch '{s}'; i=0; while [ ! -e '{g}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done; \
         '{bin}' --root '{root}' {args}",
        s = env.sentinel(started).display(),
        g = env.sentinel(go).display(),
        bin = bin(),
        root = env.root.display(),
    )
}

/// The writer gate must not turn a nested reader into a cycle: the outer
/// command reads `base` and runs `stowage exec --read base` again; a writer
/// queued in between holds the gate and waits for the outer reader, which
/// waits for its child. The inner reader is part of the outer hold and
/// passes the gate, as it would under flock(1).
fn nested_reader_passes_queued_writer(outer_flags: &[&str]) {
    let env = Env::new();
    env.make_image("base");
    let script = nested_script(&env, "outer", "go", "exec --read base -- true");
    let mut args: Vec<&str> = vec!["exec"];
    args.extend_from_slice(outer_flags);
    args.extend_from_slice(&["--read", "base", "--", "sh", "-c", &script]);
    let outer = env.spawn(&args);
    wait_for_file(&env.sentinel("outer"));
    let writer = env.spawn(["exec", "--write", "base", "--", "true"]);
    // Once the writer waits it holds the gate exclusively.
    let gate = gate_file(&env, "base");
    wait_until("the writer waits at the gate", || {
        gate.exists() && !flock_free(&gate)
    });
    env.release("go");
    let out = outer.finish();
    assert_eq!(out.status.code(), Some(0), "outer: {}", show(&out));
    let out = writer.finish();
    assert_eq!(out.status.code(), Some(0), "writer: {}", show(&out));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// Runs `stowage exec OUTER -- stowage exec INNER -- true` and returns the
/// outcome (bounded: a wait for itself fails the test instead of hanging).
fn nested(env: &Env, outer: &[&str], inner: &str) -> std::process::Output {
    let cmd = format!(
        "'{bin}' --root '{root}' exec {inner} -- true",
        bin = bin(),
        root = env.root.display()
    );
    let mut args: Vec<&str> = vec!["exec"];
    args.extend_from_slice(outer);
    args.extend_from_slice(&["--", "sh", "-c", &cmd]);
    env.run(&args)
}

#[test]
fn a_request_that_times_out_on_a_later_lock_leaves_no_waiter_record() {
    let env = Env::new();
    let mut args = vec!["exec".to_owned(), "--write".into(), "a".into(), "--".into()];
    args.extend(env.hold_cmd("a", "release-a"));
    let a = env.spawn(&args);
    wait_for_file(&env.sentinel("a"));
    let b = env.hold(&["--write", "b"], "b");
    let w = env.spawn([
        "exec", "--write", "a", "--write", "b", "--wait", "2", "--", "true",
    ]);
    env.wait_for_waiter("a");
    env.release("release-a");
    let out = w.finish();
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(
        waiter_lines(&env).is_empty(),
        "waiters left: {:?}",
        waiter_lines(&env)
    );
    let st = env.status_json(["a", "b"]);
    for l in st["locks"].as_array().unwrap() {
        assert!(l["waiters"].as_array().unwrap().is_empty(), "{st}");
    }
    env.release("release");
    for bg in [a, b] {
        assert_eq!(bg.finish().status.code(), Some(0));
    }
}

#[test]
fn an_interrupted_or_timed_out_wait_leaves_no_lock_file_or_gate() {
    let env = Env::new();
    env.make_image("busy");
    let holder = env.hold(&["--write", "busy"], "held");
    // "aaa" is locked (and its file created) before the wait for "busy".
    let waiter = env.spawn(["exec", "--write", "aaa", "--write", "busy", "--", "true"]);
    env.wait_for_waiter("busy");
    waiter.signal(libc::SIGTERM);
    let out = waiter.finish();
    assert_eq!(code(&out), Some(128 + libc::SIGTERM), "{}", show(&out));
    assert!(!env.lock_file("aaa").exists(), "{}", show(&out));
    let out = env.run([
        "exec", "--write", "aaa", "--write", "busy", "--wait", "0.2", "--", "true",
    ]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert!(!env.lock_file("aaa").exists(), "{}", show(&out));
    env.release("release");
    holder.finish();

    // An image that does not exist, its lock held outside stowage: the
    // gate the waiting writer made goes with it.
    let lock = env.lock_file("ghost");
    let started = env.sentinel("flock-started");
    let outside = flock_holder(
        &lock,
        &started,
        &format!(
            "i=0; while [ ! -e '{}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
            env.sentinel("flock-release").display()
        ),
    );
    let out = env.run(["exec", "--write", "ghost", "--wait", "0.2", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    let gate = env.root.join("locks/images/ghost.gate");
    assert!(!gate.exists(), "the gate was left behind");
    env.release("flock-release");
    outside.finish();
}

#[test]
fn a_parent_that_is_no_exec_is_waited_for_like_anyone() {
    // flock(1) -o holds the lock in the parent, not in the child: the
    // parent is no exec running us, and may well release it while we wait.
    let env = Env::new();
    env.make_image("base");
    env.ok(["slots", "set", "one", "1"]);
    let slot = env.root.join("locks/slots/one/0.lock");
    let run_under_flock = |file: &std::path::Path, args: &[&str]| {
        let mut c = Command::new("flock");
        c.args(["-o", "-x"])
            .arg(file)
            .arg(bin())
            .arg("--root")
            .arg(&env.root);
        c.args(args);
        c.env_remove(stowage::env::EXEC_LEASES);
        output(c)
    };
    fs::create_dir_all(slot.parent().unwrap()).unwrap();
    let out = run_under_flock(
        &slot,
        &["exec", "--slot", "one", "--wait", "0.3", "--", "true"],
    );
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let out = run_under_flock(
        &env.lock_file("base"),
        &["exec", "--read", "base", "--wait", "0.3", "--", "true"],
    );
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
}

// --- the writer gate and fairness -------------------------------------------

/// A reader loop: `exec --read base -- sleep HOLD` again and again until
/// the `done` sentinel exists (bounded).
fn reader_loop(env: &Env, hold: &str, tag: usize) -> Bg {
    let script = format!(
        "i=0; while [ ! -e '{done}' ] && [ $i -lt 40 ]; do \
         '{bin}' --root '{root}' -q exec --read base -- sh -c 'touch \"$0\"; sleep {hold}' '{started}' || exit 1; \
         i=$((i+1)); done; [ -e '{done}' ] || exit 9",
        done = env.sentinel("done").display(),
        bin = bin(),
        root = env.root.display(),
        started = env.sentinel(&format!("reading.{tag}")).display(),
    );
    let mut c = std::process::Command::new("sh");
    c.args(["-c", &script]);
    Bg::from_command(c)
}

#[test]
fn a_writer_gets_in_despite_a_stream_of_readers() {
    let env = Env::new();
    env.make_image("base");
    // Four reader loops, each holding the image for 1 s, staggered so that
    // the image is never free.
    let mut loops = Vec::new();
    for tag in 0..4 {
        loops.push(reader_loop(&env, "1", tag));
        wait_for_file(&env.sentinel(&format!("reading.{tag}")));
        std::thread::sleep(std::time::Duration::from_millis(250)); // the stagger
    }
    // The writer stops the loops when it gets in; without writer preference
    // it never would while they run, and the loops would end by their bound.
    let t0 = Instant::now();
    let writer = env.spawn([
        "exec",
        "--write",
        "base",
        "--",
        "sh",
        "-c",
        &format!(
            "echo new > \"$STOWAGE_IMAGE_DIR/file\"; touch '{}'",
            env.sentinel("done").display()
        ),
    ]);
    let out = writer.finish();
    let waited = t0.elapsed();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    eprintln!("the writer got in after {waited:?} behind 1 s readers");
    for l in loops {
        let out = l.finish();
        // 9: the loop ran out before the awaited process got in — starvation.
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    }
    assert_eq!(
        fs::read_to_string(env.root.join("img/base/file")).unwrap(),
        "new\n"
    );
}

#[test]
fn a_waiting_writer_shows_in_lock_status_and_holds_back_new_readers() {
    let env = Env::new();
    env.make_image("base");
    let reader = env.hold(&["--read", "base"], "started");
    let writer = env.spawn(["exec", "--write", "base", "--", "true"]);
    wait_until("the writer is recorded as waiting", || {
        env.lock_entry("base").is_some_and(|e| {
            e["waiters"]
                .as_array()
                .unwrap()
                .iter()
                .any(|w| w["mode"] == "exclusive")
        })
    });
    // It records itself, then takes the gate: wait for that too.
    let gate = env.root.join("locks/images/base.gate");
    wait_until("the writer holds the gate", || {
        gate.exists()
            && !std::process::Command::new("flock")
                .args(["-n", "-s"])
                .arg(&gate)
                .arg("true")
                .status()
                .unwrap()
                .success()
    });
    // A new reader may not overtake the waiting writer...
    let out = env.run(["exec", "--read", "base", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(
        stderr(&out).contains("write"),
        "says a writer is waiting: {}",
        stderr(&out)
    );
    // ...but flock(1) on the image lock itself still sees only a reader.
    env.release("release");
    assert_eq!(reader.finish().status.code(), Some(0));
    assert_eq!(writer.finish().status.code(), Some(0));
    env.ok(["exec", "--read", "base", "--no-wait", "--", "true"]);
}

#[test]
fn readers_get_in_between_a_stream_of_writers() {
    let env = Env::new();
    env.make_image("base");
    // Two writer loops keep the image busy; a reader must still get in.
    let script = |tag: usize| {
        format!(
            "i=0; while [ ! -e '{done}' ] && [ $i -lt 100 ]; do \
             '{bin}' --root '{root}' -q exec --write base -- sh -c 'touch \"$0\"; sleep 0.3' '{started}' || exit 1; \
             i=$((i+1)); done; [ -e '{done}' ] || exit 9",
            done = env.sentinel("done").display(),
            bin = bin(),
            root = env.root.display(),
            started = env.sentinel(&format!("writing.{tag}")).display(),
        )
    };
    let loops: Vec<Bg> = (0..2)
        .map(|tag| {
            let mut c = std::process::Command::new("sh");
            c.args(["-c", &script(tag)]);
            let bg = Bg::from_command(c);
            wait_for_file(&env.sentinel(&format!("writing.{tag}")));
            bg
        })
        .collect();
    let reader = env.spawn([
        "exec",
        "--read",
        "base",
        "--",
        "touch",
        env.sentinel("done").to_str().unwrap(),
    ]);
    assert_eq!(reader.finish().status.code(), Some(0));
    for l in loops {
        let out = l.finish();
        // 9: the loop ran out before the awaited process got in — starvation.
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    }
}

// --- mutual exclusion and concurrency ---------------------------------------

/// A critical section that detects overlap by itself: `mkdir` is atomic, so
/// a second process inside at the same time fails to create the directory
/// and records a violation.
fn critical_section(dir: &std::path::Path) -> String {
    format!(
        "if mkdir '{d}/cs' 2>/dev/null; then sleep 0.002; rmdir '{d}/cs'; echo ok >> '{d}/entries'; \
         else echo overlap >> '{d}/violations'; fi",
        d = dir.display()
    )
}

#[test]
fn writers_never_overlap() {
    const PROCS: usize = 16;
    const ROUNDS: usize = 25;
    let env = Env::new();
    let script = critical_section(&env.scratch);
    let workers: Vec<_> = (0..PROCS)
        .map(|_| {
            let loop_script = format!(
                "for i in $(seq {ROUNDS}); do '{bin}' --root '{root}' -q exec --write app -- sh -c \"$0\" || exit 1; done",
                bin = bin(),
                root = env.root.display()
            );
            let mut c = Command::new("sh");
            c.args(["-c", &loop_script, &script]);
            c
        })
        .map(Bg::from_command)
        .collect();
    for w in workers {
        let out = w.finish();
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    }
    assert_eq!(
        lines(&env.scratch.join("violations")),
        0,
        "two writers were inside at once"
    );
    assert_eq!(lines(&env.scratch.join("entries")), PROCS * ROUNDS);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// The overlap detector above can fail: without stowage, the same load
/// overlaps. (Otherwise the test above would prove nothing.)
#[test]
fn the_overlap_detector_detects_overlap() {
    let env = Env::new();
    let script = critical_section(&env.scratch).replace("sleep 0.002", "sleep 0.05");
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let mut c = Command::new("sh");
            c.args(["-c", "for i in $(seq 5); do sh -c \"$0\"; done", &script]);
            Bg::from_command(c)
        })
        .collect();
    for w in workers {
        w.finish();
    }
    assert!(
        lines(&env.scratch.join("violations")) > 0,
        "the detector never fired without locks"
    );
}

#[test]
fn readers_really_run_at_the_same_time() {
    const READERS: usize = 4;
    let env = Env::new();
    env.make_image("base");
    // Each reader announces itself, then waits (bounded) until all readers
    // are inside: that only completes if they hold the lock together.
    let readers: Vec<_> = (0..READERS)
        .map(|i| {
            let script = format!(
                "touch '{d}/in.{i}'; n=0; while [ $(ls '{d}' | grep -c '^in\\.') -lt {READERS} ]; do \
                 sleep 0.01; n=$((n+1)); [ $n -gt 3000 ] && exit 1; done; exit 0",
                d = env.scratch.display()
            );
            env.spawn(["exec", "--read", "base", "--no-wait", "--", "sh", "-c", &script])
        })
        .collect();
    for r in readers {
        let out = r.finish();
        assert_eq!(
            out.status.code(),
            Some(0),
            "reader did not see all others inside: {}",
            show(&out)
        );
    }
}

#[test]
fn random_multi_image_requests_all_finish() {
    const PROCS: usize = 6;
    const ROUNDS: usize = 12;
    const IMAGES: [&str; 5] = ["a", "b:1", "c/d", "e", "f.g"];
    let env = Env::new();
    for img in IMAGES {
        env.make_image(img);
    }
    let seed = fastrand::u64(..);
    eprintln!("seed {seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let d = env.scratch.display().to_string();
    let workers: Vec<_> = (0..PROCS)
        .map(|_| {
            // Each round: a random set of images, random modes, listed in a
            // random order. The command checks exclusion per image: a writer
            // marks its images, a reader checks no writer mark is present.
            let mut script = String::new();
            for _ in 0..ROUNDS {
                let mut picked: Vec<(&str, bool)> = Vec::new();
                for img in IMAGES {
                    if rng.bool() {
                        picked.push((img, rng.u8(..).is_multiple_of(3)));
                    }
                }
                if picked.is_empty() {
                    picked.push((IMAGES[rng.usize(..IMAGES.len())], true));
                }
                rng.shuffle(&mut picked);
                let mut args = String::new();
                let mut body = String::new();
                for (img, write) in &picked {
                    let tag = img.replace(['/', ':'], "_");
                    if *write {
                        args.push_str(&format!(" --write '{img}'"));
                        body.push_str(&format!(
                            "mkdir '{d}/w.{tag}' || echo 'overlap {img}' >> '{d}/violations'; "
                        ));
                    } else {
                        args.push_str(&format!(" --read '{img}'"));
                        body.push_str(&format!(
                            "[ -e '{d}/w.{tag}' ] && echo 'read during write {img}' >> '{d}/violations'; "
                        ));
                    }
                }
                body.push_str(&format!("sleep 0.0{}; ", rng.u8(0..3)));
                for (img, write) in &picked {
                    if *write {
                        body.push_str(&format!("rmdir '{d}/w.{}'; ", img.replace(['/', ':'], "_")));
                    }
                }
                body.push_str(&format!("echo done >> '{d}/done'"));
                script.push_str(&format!(
                    "'{bin}' --root '{root}' -q exec{args} -- sh -c \"{body}\" || exit 1\n",
                    bin = bin(),
                    root = env.root.display()
                ));
            }
            let mut c = Command::new("sh");
            c.args(["-c", &script]);
            Bg::from_command(c)
        })
        .collect();
    for w in workers {
        let out = w.finish();
        assert_eq!(out.status.code(), Some(0), "seed {seed}: {}", show(&out));
    }
    let violations = fs::read_to_string(env.scratch.join("violations")).unwrap_or_default();
    assert!(violations.is_empty(), "seed {seed}: {violations}");
    assert_eq!(
        lines(&env.scratch.join("done")),
        PROCS * ROUNDS,
        "seed {seed}"
    );
    for img in IMAGES {
        assert_eq!(env.state(img).as_deref(), Some("ready"), "{img}");
    }
}

// --- exclusive reads --------------------------------------------------------

#[test]
fn read_exclusive_excludes_others_and_keeps_the_state() {
    let env = Env::new();
    env.make_image("base");
    let holder = env.hold(&["--read-exclusive", "base", "--write", "app"], "held");
    let st = env.lock_entry("base").unwrap();
    assert_eq!(st["state"], "exclusive", "{st}");
    assert_eq!(st["image_state"], "ready", "{st}");
    let out = env.run(["exec", "--no-wait", "--read", "base", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let out = env.run([
        "exec",
        "--wait",
        "0.2",
        "--read-exclusive",
        "base",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(
        stderr(&out).contains("waiting for exclusive read lock on image 'base'"),
        "{}",
        show(&out)
    );
    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert_eq!(env.image("app").unwrap()["base"], "base");

    // A failed command leaves its exclusively read image ready, and records
    // the use (its lock file dated as a filesystem in 2031 would date it).
    let mut c = env.cmd(["exec", "--read-exclusive", "base", "--", "false"]);
    c.env("STOWAGE_NOW", "2031-01-01T00:00:00Z");
    assert_eq!(output(c).status.code(), Some(1));
    env.date_lock_file("base", "2031-01-01T00:00:00Z");
    let img = env.image("base").unwrap();
    assert_eq!(img["state"], "ready", "{img}");
    assert_eq!(img["last_used"], "2031-01-01T00:00:00Z", "{img}");
    // STOWAGE_IMAGE_DIR is for the written image only.
    let out = env.ok([
        "exec",
        "--read-exclusive",
        "base",
        "--",
        "sh",
        "-c",
        "test -z \"${STOWAGE_IMAGE_DIR-}\"",
    ]);
    assert!(out.status.success());
}

#[test]
fn read_exclusive_refuses_what_cannot_be_read() {
    let env = Env::new();
    env.make_image("base");
    let before = tree(&env.root);
    let out = env.run(["exec", "--read-exclusive", "missing", "--", "true"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert_eq!(tree(&env.root), before, "created something");
    env.run(["exec", "--write", "bad", "--", "false"]);
    let out = env.run(["exec", "--read-exclusive", "bad", "--", "true"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert_eq!(env.state("bad").as_deref(), Some("incomplete"));
    for args in [
        &["--read-exclusive", "base", "--read", "base"][..],
        &["--read-exclusive", "base", "--write", "base"][..],
        &["--read-exclusive", "base", "--from", "base", "--write", "x"][..],
        &["--store-wide", "--read", "base"][..],
    ] {
        let mut a = vec!["exec"];
        a.extend_from_slice(args);
        a.extend(["--", "true"]);
        let out = env.run(&a);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", show(&out));
    }
    assert!(env.image("x").is_none());
}

// --- nested calls -----------------------------------------------------------

#[test]
fn nested_reader_passes_a_writer_queued_behind_its_enclosing_reader() {
    nested_reader_passes_queued_writer(&[]);
}

#[test]
fn nested_reader_under_no_inherit_passes_a_queued_writer() {
    // The command does not inherit the descriptors: the kernel's lock table
    // names the enclosing stowage, an ancestor, as the holder.
    nested_reader_passes_queued_writer(&["--no-inherit"]);
}

#[test]
fn nested_writes_that_would_wait_for_themselves_fail_at_once() {
    let env = Env::new();
    env.make_image("base");
    // A write inside a write of the same image: the lock is ours already.
    let out = nested(&env, &["--write", "app"], "--write app");
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(stderr(&out).contains("enclosing command"), "{}", show(&out));
    // A write inside a read of the same image.
    let out = nested(&env, &["--read", "base"], "--write base");
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(stderr(&out).contains("enclosing command"), "{}", show(&out));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    // A read of the image being written: not ready, said at once.
    let out = nested(&env, &["--write", "new"], "--read new");
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(stderr(&out).contains("being written by an enclosing command"));
    // Reads inside reads, of course, just work.
    let out = nested(&env, &["--read", "base"], "--read base");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}

/// An exclusive read is no write: a read nested in one runs at once, under it (the image is
/// ready, no writer can come, and the enclosing command waits for it), as a read nested in a read
/// does; a write or an exclusive read nested in one is refused, told it is an exclusive read.
/// Alike where only the inherited descriptors tell (`env -i setsid -f`).
#[test]
fn a_read_nested_in_an_exclusive_read_runs_under_it_and_a_write_there_is_told_it_is_a_read() {
    let env = Env::new();
    env.make_image("base");
    let outer = ["--read-exclusive", "base"];
    let said = "held (exclusive read) by an enclosing command";
    let out = nested(&env, &outer, "--read base --wait 30");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    for inner in ["--write base", "--read-exclusive base"] {
        let out = nested(&env, &outer, &format!("{inner} --wait 30"));
        assert_eq!(out.status.code(), Some(75), "{inner}: {}", show(&out));
        assert!(stderr(&out).contains(said), "{inner}: {}", show(&out));
    }
    let (rc, err) = nested_detached(&env, &outer, "exec --read base --wait 30 -- true");
    assert_eq!(rc, "0", "{err}");
    let (rc, err) = nested_detached(&env, &outer, "rm --wait 30 base");
    assert_eq!(rc, "75", "{err}");
    assert!(err.contains(said), "{err}");
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

#[test]
fn nested_slot_of_a_full_class_works_under_the_enclosing_slot() {
    let env = Env::new();
    env.ok(["slots", "set", "one", "1"]);
    let out = nested(&env, &["--slot", "one"], "--slot one");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}

/// `stowage exec OUTER -- sh -c '…'` whose command starts `stowage INNER`
/// detached and with a cleared environment (`env -i setsid -f`): the
/// nested call has neither the enclosing exec's word in its environment nor
/// the exec among its ancestors, only the lock descriptors it inherited.
/// The command waits (bounded) for the nested call to end; returns its exit
/// status and what it said.
fn nested_detached(env: &Env, outer: &[&str], inner: &str) -> (String, String) {
    let (rc, err) = (env.sentinel("inner.rc"), env.sentinel("inner.err"));
    let _ = (fs::remove_file(&rc), fs::remove_file(&err));
    let detached = format!(
        "'{bin}' --root '{root}' {inner} 2>'{err}'; echo \\$? >'{rc}.tmp'; mv '{rc}.tmp' '{rc}'",
        bin = bin(),
        root = env.root.display(),
        err = err.display(),
        rc = rc.display(),
    );
    let cmd = format!(
        "env -i setsid -f sh -c \"{detached}\"; \
         i=0; while [ ! -e '{rc}' ] && [ $i -lt 4000 ]; do sleep 0.01; i=$((i+1)); done",
        rc = rc.display(),
    );
    let mut args: Vec<&str> = vec!["exec"];
    args.extend_from_slice(outer);
    args.extend_from_slice(&["--", "sh", "-c", &cmd]);
    env.run(&args);
    wait_for_file(&rc);
    let rc = fs::read_to_string(&rc).unwrap().trim().to_owned();
    (rc, fs::read_to_string(&err).unwrap_or_default())
}

#[test]
fn a_nested_call_with_only_the_inherited_locks_to_go_by_never_waits_for_them() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["slots", "set", "one", "1"]);
    // Each would wait 30 s for a lock its own process holds, then time out.
    let wait_for_self = [
        (
            &["--write", "app"][..],
            "exec --write app --wait 30 -- true",
        ),
        (
            &["--read", "base"][..],
            "exec --write base --wait 30 -- true",
        ),
        (
            &["--read", "base"][..],
            "exec --store-wide --wait 30 -- true",
        ),
        (&["--read", "base"][..], "rm --wait 30 base"),
    ];
    for (outer, inner) in wait_for_self {
        let (rc, err) = nested_detached(&env, outer, inner);
        assert_eq!(rc, "75", "{outer:?} then {inner}: {err}");
        assert!(err.contains("never end"), "{outer:?} then {inner}: {err}");
    }
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    // A slot of a full class works under the enclosing command's.
    let (rc, err) = nested_detached(
        &env,
        &["--slot", "one"],
        "exec --slot one --wait 30 -- true",
    );
    assert_eq!(rc, "0", "{err}");
}

/// The same in a root whose own directory is named `locks`: the link of an inherited lock file
/// then holds "/locks/" twice, overlapping (`…/locks/locks/images/…`), and the root's is the
/// second.
#[test]
fn a_nested_call_in_a_root_named_locks_knows_its_inherited_locks() {
    let mut env = Env::new();
    env.root = env.root.with_file_name("locks");
    env.make_image("base");
    let inner = "exec --write base --wait 10 -- true";
    let (rc, err) = nested_detached(&env, &["--read", "base"], inner);
    assert_eq!(rc, "75", "{err}");
    assert!(err.contains("never end"), "{err}");
}

/// A read of a new image while its writer creates it waits for the
/// writer, and then reads what it made.
#[test]
fn a_read_waits_for_a_new_image_being_written() {
    let env = Env::new();
    env.make_image("base");
    let writer = env.start_sh(&["--write", "app"], |started| {
        format!(
            "echo made > \"$STOWAGE_IMAGE_DIR/file\"; touch '{}'; \
             i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
            started.display(),
            r = env.sentinel("release").display()
        )
    });
    assert_eq!(env.state("app").as_deref(), Some("creating"));
    let reader = env.spawn([
        "exec",
        "--read",
        "app",
        "--",
        "sh",
        "-c",
        "cat \"$STOWAGE_IMAGES_DIR/app/file\"",
    ]);
    env.wait_for_waiter("app");
    env.release("release");
    assert_eq!(code(&writer.finish()), Some(0));
    let out = reader.finish();
    assert_eq!(code(&out), Some(0), "the read waited: {}", show(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "made\n");
}

/// A request that takes one image's lock, then is refused another's
/// (busy, `--no-wait`), leaves the first as it was: ready.
#[test]
fn a_request_refused_a_later_lock_leaves_the_earlier_images_as_they_were() {
    let env = Env::new();
    env.make_image("base");
    env.build("app", "echo made > \"$STOWAGE_IMAGE_DIR/file\"");
    let reader = env.hold(&["--read", "base"], "started");
    let out = env.run([
        "exec",
        "--write",
        "app",
        "--write",
        "base",
        "--no-wait",
        "--",
        "true",
    ]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    env.release("release");
    assert_eq!(code(&reader.finish()), Some(0));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("app", "file"), "made\n");
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// A new image's lock file that an unlinker (here `rm` of the image, which
/// does not exist yet) marks gone and unlinks between the writer's open
/// and its flock: the writer reads the mark, which proves nothing, finds
/// another file at the path — held by a second writer — and never runs
/// its command beside the second one's. The writer sees the store as on a
/// shared filesystem (where an empty file proves itself at its path), the
/// `rm` as local (a host that sees the store as local unlinks). The window
/// is made by delaying the writer's first flock (its image lock's: its
/// lease, announced late on a shared filesystem, is made after) under
/// strace.
#[test]
fn a_lock_file_unlinked_between_open_and_flock_is_never_written_through() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let ran = env.sentinel("first-ran");
    let mut c = Command::new("strace");
    c.args(["-f", "-o", "/dev/null", "-e", "trace=flock"])
        .args(["-e", "inject=flock:delay_enter=4000000:when=1"])
        .arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(["exec", "--write", "new", "--wait", "0.3", "--", "touch"])
        .arg(&ran)
        .env_remove("STOWAGE_ROOT")
        .env(stowage::env::DEBUG_FILESYSTEM, "nfs")
        .env(stowage::env::DEBUG_ANNOUNCE_MS, "600000");
    let first = Bg::from_command(c);
    let lock = env.lock_file("new");
    let until = Instant::now() + Duration::from_secs(30);
    while !lock.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = env.run(["rm", "new"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    assert!(!lock.exists(), "rm left the empty lock file");
    let second = env.hold(&["--write", "new"], "second-started");
    let out = first.finish();
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert!(
        !ran.exists(),
        "the first writer ran beside the second: {}",
        show(&out)
    );
    env.release("release");
    let out = second.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}
