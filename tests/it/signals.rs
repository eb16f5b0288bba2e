//! Signals and crashes: signals forwarded to the command or ending a wait,
//! SIGKILL of stowage, its command or a waiter at the worst moments (no lock
//! stays held, no image is lost or left looking ready), the whole command
//! tree under `--no-inherit`, signals from a terminal in every arrangement of
//! groups and sessions, and real-time signals.

use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::common::*;

// --- signals to stowage -----------------------------------------------------

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

/// A signal while waiting ends the wait: 128+N, the command never run,
/// nothing left behind. USR1 too, as every signal that would end stowage
/// by default (it killed stowage outright).
#[test]
fn signal_while_waiting_exits_without_running_the_command() {
    for (sig, name) in [(libc::SIGINT, "SIGINT"), (libc::SIGUSR1, "SIGUSR1")] {
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
        waiter.signal(sig);
        let out = waiter.finish();
        assert_eq!(out.status.code(), Some(128 + sig), "{}", show(&out));
        // The signal by its name ("signal 2" was all it said).
        let said = format!("interrupted by {name} before the command started");
        assert!(stderr(&out).contains(&said), "{}", show(&out));
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
        env.wait_for_waiting_pid(waiter.pid(), what);
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

/// Under a pids limit that admits stowage and its command alone (and a
/// keeper with `--no-inherit`), the command still starts after a wait: the
/// thread that took signals while waiting has ended by then.
#[test]
fn a_command_starts_after_a_wait_under_a_pids_limit_with_no_task_to_spare() {
    let env = Env::new();
    env.make_image("a");
    env.ok(["slots", "set", "one", "1"]);
    for (what, locks, tasks) in [
        ("write", &["--write", "a"][..], 2),
        ("slot", &["--slot", "one"][..], 2),
        ("no-inherit", &["--no-inherit", "--read", "a"][..], 3),
    ] {
        let Some(cg) = PidsCgroup::new(tasks) else {
            return;
        };
        let held = if what == "slot" { "--slot" } else { "--write" };
        let (started, let_go) = (format!("held-{what}"), format!("let-go-{what}"));
        let holder = env.hold_until(&[held, locks[locks.len() - 1]], &started, &let_go);
        let ran = env.sentinel(&format!("ran-{what}"));
        let mut args = vec!["-q", "exec"];
        args.extend(locks);
        args.extend(["--", "touch", ran.to_str().unwrap()]);
        let mut c = env.cmd(args);
        cg.enter(&mut c);
        let waiter = Bg::from_command(c);
        env.wait_for_waiting_pid(waiter.pid(), what);
        env.release(&let_go);
        assert_eq!(holder.finish().status.code(), Some(0));
        let out = waiter.finish();
        assert_eq!(out.status.code(), Some(0), "{what}: {}", show(&out));
        assert!(ran.exists(), "{what}: the command did not run");
        drop(cg);
    }
}

/// The waiters of `image`'s lock, by pid.
fn waits_on(env: &Env, image: &str, pid: u32) -> bool {
    env.lock_entry(image).is_some_and(|e| {
        e["waiters"]
            .as_array()
            .is_some_and(|w| w.iter().any(|w| w["pid"] == pid))
    })
}

/// A process that could start no thread at its first wait (a pids limit) but can at a later one:
/// the later wait, sleeping in a helper thread, must still end on SIGTERM.
#[test]
fn sigterm_ends_a_later_wait_once_threads_can_be_had() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    let first = env.hold_until(&["--write", "a"], "a-held", "let-a-go");
    let _second = long_holder(&env, &["--write", "b"], "b-held");
    let Some(cg) = PidsCgroup::new(1) else {
        return;
    };
    let mut c = env.cmd(["exec", "--read", "a", "--read", "b", "--", "true"]);
    cg.enter(&mut c);
    let mut waiter = Bg::from_command(c);
    wait_until("the waiter waits for a", || {
        waits_on(&env, "a", waiter.pid())
    });
    cg.set_max(64);
    env.release("let-a-go");
    assert_eq!(first.finish().status.code(), Some(0));
    wait_until("the waiter waits for b", || {
        waits_on(&env, "b", waiter.pid())
    });
    waiter.signal(libc::SIGTERM);
    // The holder of b never lets go: only the signal can end the wait.
    wait_until("the waiter ends on SIGTERM", || !waiter.is_running());
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    drop(cg);
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

/// The `--no-inherit` keeper is stowage started anew, which has no handler
/// for the lock waits' own signal in its first moments: it starts with that
/// signal blocked (one sent then killed it, and the command with it).
#[test]
fn the_keeper_starts_with_the_lock_waits_own_signal_blocked() {
    let env = Env::new();
    let release = env.sentinel("release");
    let locks = ["--write", "app", "--no-inherit"];
    let bg = env.start_sh(&locks, |started| {
        let (started, release) = (started.display(), release.display());
        format!("touch '{started}'; while [ ! -e '{release}' ]; do sleep 0.01; done")
    });
    let pid = bg.pid();
    let children = fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap();
    let keeper = children.split_whitespace().next().expect("a keeper");
    let status = fs::read_to_string(format!("/proc/{keeper}/status")).unwrap();
    let blocked = status
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .unwrap();
    let mask = u64::from_str_radix(blocked.trim(), 16).unwrap();
    fs::write(&release, "").unwrap();
    let out = bg.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let wake = libc::SIGRTMIN() + 5;
    assert_eq!(
        mask >> (wake - 1) & 1,
        1,
        "keeper {keeper}: SigBlk {blocked}"
    );
}

/// A caller that ignores the lock waits' own signal passes that on to the
/// command, in both modes, as it does any ignored signal: giving the signal
/// a handler at the start had set it back to its default for the command.
#[test]
fn the_lock_waits_own_signal_ignored_by_the_caller_stays_ignored() {
    let env = Env::new();
    let wake = libc::SIGRTMIN() + 5;
    for inherit in [true, false] {
        let mut args = vec!["exec", "--write", "app"];
        if !inherit {
            args.push("--no-inherit");
        }
        args.extend(["--", "grep", "SigIgn", "/proc/self/status"]);
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!("trap '' {wake}; exec \"$0\" \"$@\""))
            .arg(bin())
            .arg("--root")
            .arg(&env.root)
            .args(&args);
        let out = output(c);
        assert_eq!(code(&out), Some(0), "{}", show(&out));
        let text = String::from_utf8_lossy(&out.stdout);
        let mask = text.split_whitespace().nth(1).unwrap_or("0");
        let ignored = u64::from_str_radix(mask, 16).unwrap() >> (wake - 1) & 1 == 1;
        assert!(ignored, "inherit {inherit}: {text}");
    }
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
fn a_command_killed_by_a_real_time_signal_gives_128_plus_n() {
    let env = Env::new();
    for inherit in [true, false] {
        let mut args = vec!["exec", "--write", "app"];
        if !inherit {
            args.push("--no-inherit");
        }
        args.extend(["--", "sh", "-c", "kill -50 $$"]);
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(178), "{}", show(&out));
        assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    }
}

/// Python: notes each signal of argv[3:] in argv[1] as it comes, once
/// ready touches argv[2], and ends once it has them all.
const HANDLER: &str = r#"import signal, sys, time
wanted = [int(n) for n in sys.argv[3:]]
seen = []
def note(n, _):
    seen.append(n)
    open(sys.argv[1], 'a').write(f'{n}\n')
for n in wanted:
    signal.signal(n, note)
open(sys.argv[2], 'w').close()
while len(seen) < len(wanted):
    time.sleep(0.01)
"#;

/// A signal sent to stop or steer the command (USR1, USR2, a real-time
/// one) goes through stowage to it, in both modes: one that would end
/// stowage by default left the command running without it, holding the
/// image's lock, and a build that went on to succeed was recorded
/// incomplete.
#[test]
fn signals_a_command_handles_reach_it_through_stowage() {
    if !tool_or_skip("python3", "python3") {
        return;
    }
    let env = Env::new();
    let (usr1, usr2, rt) = (libc::SIGUSR1, libc::SIGUSR2, libc::SIGRTMIN() + 1);
    let script = env.scratch.join("handler.py");
    fs::write(&script, HANDLER).unwrap();
    for inherit in [true, false] {
        let got = env.scratch.join(format!("got-{inherit}"));
        let _ = fs::remove_file(env.sentinel("started"));
        let mut locks = vec!["--write", "app"];
        if !inherit {
            locks.push("--no-inherit");
        }
        let bg = env.start_sh(&locks, |started| {
            let (got, started) = (got.display(), started.display());
            let script = script.display();
            format!("exec python3 '{script}' '{got}' '{started}' {usr1} {usr2} {rt}")
        });
        for (i, sig) in [usr1, usr2, rt].into_iter().enumerate() {
            bg.signal(sig);
            wait_until(&format!("signal {sig} reached the command"), || {
                fs::read_to_string(&got).is_ok_and(|t| t.lines().count() > i)
            });
        }
        let out = bg.finish();
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
        let text = fs::read_to_string(&got).unwrap();
        assert_eq!(text, format!("{usr1}\n{usr2}\n{rt}\n"), "each once");
        assert_eq!(env.state("app").as_deref(), Some("ready"));
    }
}

/// Under `--no-inherit`, such a signal that comes once the command has
/// exited goes to what it left running, and is no reason to end that or
/// to call the write failed: a termination signal would be.
#[test]
fn a_signal_only_to_take_note_does_not_cut_short_what_a_command_left_running() {
    if !tool_or_skip("python3", "python3") {
        return;
    }
    let env = Env::new();
    let script = env.scratch.join("handler.py");
    fs::write(&script, HANDLER).unwrap();
    let got = env.scratch.join("got");
    let locks = ["--write", "app", "--no-inherit"];
    let bg = env.start_sh(&locks, |started| {
        let (script, got, started) = (script.display(), got.display(), started.display());
        format!(
            "python3 '{script}' '{got}' '{started}' {} & exit 0",
            libc::SIGUSR1
        )
    });
    bg.signal(libc::SIGUSR1);
    let out = bg.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(
        fs::read_to_string(&got).unwrap(),
        format!("{}\n", libc::SIGUSR1)
    );
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// The one real-time signal stowage's lock waits use to wake a waiting
/// thread is not taken, and harms nothing whenever it comes: it ended
/// stowage, leaving its command running without it.
#[test]
fn the_lock_waits_own_signal_leaves_an_exec_unharmed() {
    let env = Env::new();
    for inherit in [true, false] {
        let _ = fs::remove_file(env.sentinel("started"));
        let release = env.sentinel("release");
        let mut locks = vec!["--write", "app"];
        if !inherit {
            locks.push("--no-inherit");
        }
        let bg = env.start_sh(&locks, |started| {
            let (started, release) = (started.display(), release.display());
            format!("touch '{started}'; while [ ! -e '{release}' ]; do sleep 0.01; done")
        });
        bg.signal(libc::SIGRTMIN() + 5);
        std::thread::sleep(std::time::Duration::from_millis(100));
        fs::write(&release, "").unwrap();
        let out = bg.finish();
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
        assert_eq!(env.state("app").as_deref(), Some("ready"));
        fs::remove_file(&release).unwrap();
    }
}

// --- SIGKILL at the worst moments -------------------------------------------

#[test]
fn sigkill_of_stowage_and_command_mid_write() {
    let env = Env::new();
    env.make_image("base");
    let bg = env.hold(&["--read", "base", "--write", "app"], "started");
    assert!(!flock_free(&env.lock_file("app")));
    bg.kill_all();

    assert!(
        flock_free(&env.lock_file("app")),
        "the kernel released the lock"
    );
    assert!(flock_free(&env.lock_file("base")));
    // The next process that looks finds the dead writer.
    let entry = env.lock_entry("app").unwrap();
    assert_eq!(entry["state"], "free", "{entry}");
    assert!(
        entry["holders"].as_array().unwrap().is_empty(),
        "no holder shown: {entry}"
    );
    assert_eq!(entry["image_state"], "incomplete", "{entry}");
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    assert_eq!(
        env.state("base").as_deref(),
        Some("ready"),
        "the base is untouched"
    );
    // Nothing stale remains for the base either.
    let base = env.lock_entry("base").unwrap();
    assert!(base["holders"].as_array().unwrap().is_empty(), "{base}");
    // And the image can be written again.
    env.ok(["exec", "--write", "app", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn a_reader_finds_a_dead_writer() {
    let env = Env::new();
    let bg = env.hold(&["--write", "app"], "started");
    bg.kill_all();
    let out = env.run(["exec", "--read", "app", "--", "true"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(stderr(&out).contains("incomplete"), "{}", stderr(&out));
    // Every look says so, from the record under the free lock.
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
}

/// A write of `name` whose command writes half a file, killed (SIGKILL,
/// with anything it started) at a step of its protocol by `kill`; then a
/// read is let in only if the image is `expect` ready, every look says
/// `expect` (`None`: no image), and the name can be written and read again.
fn killed_at_a_step(env: &Env, name: &str, kill: impl FnOnce(&[&str]), expect: Option<&str>) {
    let script = "echo half > \"$STOWAGE_IMAGE_DIR/file\"";
    kill(&["exec", "--write", name, "--", "sh", "-c", script]);
    assert!(flock_free(&env.lock_file(name)) || !env.lock_file(name).exists());
    let out = env.run(["exec", "--read", name, "--", "true"]);
    let want = if expect == Some("ready") { 0 } else { 66 };
    assert_eq!(code(&out), Some(want), "{}", show(&out));
    assert_eq!(env.state(name).as_deref(), expect);
    env.make_image(name);
    env.ok(["exec", "--read", name, "--", "true"]);
    assert_eq!(env.state(name).as_deref(), Some("ready"));
}

/// SIGKILLs stowage (and its group) where it pauses at `point`.
fn kill_at_pause<'a>(env: &'a Env, point: &'a str) -> impl FnOnce(&[&str]) + 'a {
    move |args: &[&str]| {
        let (bg, _) = env.paused(args, point);
        bg.kill_all();
    }
}

/// SIGKILLs stowage, run under gdb, where it enters function `at`.
fn kill_at_function<'a>(env: &'a Env, at: &'a str) -> impl FnOnce(&[&str]) + 'a {
    move |args: &[&str]| {
        killed_at_function(env, at, false, args);
    }
}

#[test]
fn a_writer_killed_before_its_record_leaves_the_image_as_it_was() {
    // Its lock taken, nothing written yet.
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let at = "stowage::session::Session::start_writes";
    killed_at_a_step(&env, "base", kill_at_function(&env, at), Some("ready"));
}

#[test]
fn a_writer_killed_before_its_command_leaves_the_image_incomplete() {
    // Its `writing` record is down: readiness is lost, never claimed.
    let env = Env::new();
    env.make_image("base");
    let kill = kill_at_pause(&env, "exec-before-spawn");
    killed_at_a_step(&env, "base", kill, Some("incomplete"));
}

#[test]
fn a_writer_killed_after_its_command_before_its_outcome_leaves_it_incomplete() {
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let at = "stowage::session::finish_write";
    killed_at_a_step(&env, "base", kill_at_function(&env, at), Some("incomplete"));
}

#[test]
fn a_new_images_writer_killed_before_its_record_leaves_no_image() {
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let at = "stowage::session::Session::start_writes";
    killed_at_a_step(&env, "app", kill_at_function(&env, at), None);
    env.ok(["doctor"]);
}

#[test]
fn a_new_images_writer_killed_after_making_its_tree_leaves_it_incomplete() {
    let env = Env::new();
    env.make_image("base");
    let kill = kill_at_pause(&env, "exec-started");
    killed_at_a_step(&env, "app", kill, Some("incomplete"));
    env.ok(["doctor"]);
}

#[test]
fn a_new_images_writer_killed_before_its_command_leaves_it_incomplete() {
    let env = Env::new();
    env.make_image("base");
    let kill = kill_at_pause(&env, "exec-before-spawn");
    killed_at_a_step(&env, "app", kill, Some("incomplete"));
    env.ok(["doctor"]);
}

#[test]
fn a_new_images_writer_killed_after_its_command_leaves_it_incomplete() {
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let at = "stowage::session::finish_write";
    killed_at_a_step(&env, "app", kill_at_function(&env, at), Some("incomplete"));
    env.ok(["doctor"]);
}

#[test]
fn a_writer_whose_command_deleted_the_image_killed_once_that_is_recorded_leaves_no_image() {
    // The command deleted the tree (`ch-image delete` under a write lock);
    // stowage has cleared the record and dies before letting the lock go:
    // the image is gone, not brought back as incomplete or ready.
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("keep");
    env.make_image("app");
    let args = [
        "exec",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        "rm -rf \"$STOWAGE_IMAGE_DIR\"",
    ];
    killed_at_function(&env, "stowage::image_record::clear", true, &args);
    assert!(!env.root.join("img/app").exists());
    assert_eq!(env.state("app"), None, "deleted by its command");
    let out = env.run(["exec", "--read", "app", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    assert_eq!(env.state("keep").as_deref(), Some("ready"));
    env.ok(["doctor"]);
}

#[test]
fn a_new_image_whose_command_never_starts_leaves_nothing() {
    let env = Env::new();
    env.make_image("base");
    let (writer, _) = env.paused(
        ["exec", "--write", "app", "--", "true"],
        "exec-before-spawn",
    );
    writer.signal(libc::SIGTERM);
    let out = writer.finish();
    assert_eq!(code(&out), Some(143), "{}", show(&out));
    assert!(!env.root.join("img/app").exists(), "its empty tree went");
    assert!(!env.lock_file("app").exists(), "its lock file went");
    assert_eq!(env.state("app"), None);
    env.ok(["doctor"]);
}

/// A writer killed while it waits behind a reader, and a store-wide
/// command killed while it runs, leave hints in the image's lock file
/// (a writer waits; the store may be held): stale once they are gone, so
/// the next reader goes in at once, even with the global lock held.
#[test]
fn hints_left_by_a_killed_waiting_writer_and_store_wide_command_hold_back_no_reader() {
    let env = Env::new();
    env.make_image("base");
    let reader = env.hold_until(&["--read", "base"], "reader-started", "reader-release");
    let writer = env.spawn(["exec", "--write", "base", "--", "true"]);
    env.wait_for_waiter("base");
    writer.kill_all();
    reader.kill_all();
    let hold = env.hold_until(&["--store-wide"], "hold-started", "hold-release");
    hold.kill_all();
    let hints = fs::read(env.lock_file("base")).unwrap();
    let at = stowage::image_record::HINTS_AT;
    assert!(
        hints.len() > at + 1
            && hints[at] != 0
            && hints[at] != b'-'
            && hints[at + 1] != 0
            && hints[at + 1] != b'-',
        "both hints were left: {:?}",
        hints.get(at..at + 2)
    );
    let global = hold_global(&env);
    env.ok(["exec", "--read", "base", "--no-wait", "--", "true"]);
    global.kill_all();
    env.ok(["exec", "--write", "base", "--no-wait", "--", "true"]);
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

#[test]
fn sigkill_of_stowage_alone_leaves_the_command_holding_the_lock() {
    let env = Env::new();
    let mut bg = env.hold(&["--write", "app"], "started");
    let stowage_pid = bg.pid();
    let children = fs::read_to_string(format!("/proc/{stowage_pid}/task/{stowage_pid}/children"));
    let command: u64 = children.unwrap().trim().parse().unwrap();
    bg.signal(libc::SIGKILL);
    wait_until("stowage is dead", || !bg.is_running());

    // The command still runs and still holds the inherited lock.
    assert!(
        !flock_free(&env.lock_file("app")),
        "the command must keep the lock"
    );
    let out = env.run(["exec", "--read", "app", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let entry = env.lock_entry("app").unwrap();
    assert_eq!(entry["state"], "exclusive", "{entry}");
    let holders = entry["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{entry}");
    // Named by its lease, by the pid of the command that holds it, never
    // the dead stowage's (no signal to it reaches the command, and it may
    // be another process's by now).
    assert_eq!(
        holders[0]["pid"], command,
        "the record still stands for the holder (stowage was {stowage_pid}): {entry}"
    );
    assert_eq!(holders[0]["stowage"], true, "{entry}");
    assert!(
        holders[0]["command"].as_str().unwrap().starts_with("sh -c"),
        "{entry}"
    );
    assert_eq!(env.state("app").as_deref(), Some("creating"));

    // When the command ends, the lock is free and the image incomplete
    // (nobody recorded a success).
    env.release("release");
    wait_until("the command released the lock", || {
        flock_free(&env.lock_file("app"))
    });
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    let entry = env.lock_entry("app").unwrap();
    assert!(entry["holders"].as_array().unwrap().is_empty(), "{entry}");
}

#[test]
fn with_no_inherit_the_command_dies_with_stowage() {
    let env = Env::new();
    let pidfile = env.sentinel("pid");
    let script = format!("echo $$ > '{}'; exec sleep 600", pidfile.display());
    let mut bg = env.spawn([
        "exec",
        "--no-inherit",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    wait_until("the command runs", || {
        fs::read_to_string(&pidfile).is_ok_and(|s| s.ends_with('\n'))
    });
    let command: i32 = fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    bg.signal(libc::SIGKILL);
    wait_until("stowage is dead", || !bg.is_running());
    // The command dies with it (PR_SET_PDEATHSIG), so nothing writes
    // without a lock. (Zombies count as dead: they hold nothing.)
    wait_until("the command is gone", || !alive(command as u32));
    // The keeper that held the locks ends after the command's tree, so the
    // lock goes a moment later.
    wait_until("the lock is free", || flock_free(&env.lock_file("app")));
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
}

#[test]
fn sigkill_of_a_waiter_leaves_no_waiter_record() {
    let env = Env::new();
    let holder = env.hold(&["--write", "app"], "started");
    let waiter = env.spawn(["exec", "--read", "app", "--", "true"]);
    env.wait_for_waiter("app");
    waiter.kill_all();
    let entry = env.lock_entry("app").unwrap();
    assert!(
        entry["waiters"].as_array().unwrap().is_empty(),
        "dead waiter dropped: {entry}"
    );
    assert_eq!(entry["holders"].as_array().unwrap().len(), 1);
    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
}

// --- --no-inherit: the whole tree of the command is gone before the locks go ---

/// A command (for `sh -c`) that appends a line to FILE every 10 ms, in the
/// background of a shell that waits for it, after touching STARTED. Bounded:
/// it ends by itself after about a minute, should a test fail. Its output
/// goes nowhere, so the test's pipes do not wait for it.
fn background_writer(file: &Path, started: &Path) -> String {
    format!(
        "( i=0; while [ $i -lt 6000 ]; do echo x >> '{f}'; sleep 0.01; i=$((i+1)); done ) </dev/null >/dev/null 2>&1 & touch '{s}'; wait",
        f = file.display(),
        s = started.display()
    )
}

/// Starts `stowage exec FLAGS… --write app -- sh -c SCRIPT` in the
/// background, where SCRIPT is `script(LOG, STARTED)`: LOG is a file in the
/// image for the command's writer, STARTED a sentinel the script touches
/// once that writer runs. Returns once STARTED exists, with LOG's path.
fn exec_writing(
    env: &Env,
    flags: &[&str],
    script: impl FnOnce(&Path, &Path) -> String,
) -> (Bg, PathBuf) {
    let img_file = env.root.join("img/app/log");
    let started = env.sentinel("started");
    let script = script(&img_file, &started);
    let mut args = vec!["exec"];
    args.extend(flags);
    args.extend(["--write", "app", "--", "sh", "-c", &script]);
    let bg = env.spawn(args);
    wait_for_file(&started);
    (bg, img_file)
}

/// Whether anything still appends to `file`: two looks 300 ms apart (the
/// writer appends every 10 ms, so a live one is seen).
fn still_written(file: &Path) -> bool {
    let a = lines(file);
    std::thread::sleep(std::time::Duration::from_millis(300));
    lines(file) != a
}

#[test]
fn sigkill_of_stowage_with_no_inherit_leaves_no_writer_behind() {
    let env = Env::new();
    let (bg, img_file) = exec_writing(&env, &["--no-inherit"], background_writer);
    wait_until("the background job writes", || lines(&img_file) > 2);
    // stowage alone, not its group (the command is in that group).
    bg.signal(libc::SIGKILL);
    // A second writer gets the image once the locks are free: by then
    // nothing of the first command's tree may write any more.
    let out = env.run([
        "exec",
        "--write",
        "app",
        "--wait",
        "30",
        "--",
        "sh",
        "-c",
        &format!(
            "a=$(wc -l < '{f}'); sleep 0.3; b=$(wc -l < '{f}'); [ \"$a\" = \"$b\" ] || {{ echo \"still written: $a then $b\" >&2; exit 9; }}",
            f = img_file.display()
        ),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(!still_written(&img_file));
    drop(bg);
}

#[test]
fn sigterm_of_stowage_with_no_inherit_ends_the_background_job_too() {
    let env = Env::new();
    let (bg, img_file) = exec_writing(&env, &["--no-inherit"], background_writer);
    wait_until("the background job writes", || lines(&img_file) > 2);
    bg.signal(libc::SIGTERM);
    let out = bg.finish();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    // stowage has exited, so its locks are free: nothing may write now.
    assert!(
        !still_written(&img_file),
        "the background job outlived the locks"
    );
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    assert!(flock_free(&env.lock_file("app")));
}

#[test]
fn no_inherit_holds_the_locks_until_the_whole_tree_has_exited() {
    let env = Env::new();
    let late = env.root.join("img/app/late");
    // The shell exits at once; its background job writes half a second on.
    // Its output goes nowhere: the test's pipes must not wait for it.
    let script = format!(
        "( sleep 0.5; echo done > '{}' ) </dev/null >/dev/null 2>&1 &",
        late.display()
    );
    let out = env.run([
        "exec",
        "--no-inherit",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(
        fs::read_to_string(&late).unwrap_or_default(),
        "done\n",
        "exec returned (and released the image) before the background job ended"
    );
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn a_killed_keeper_takes_the_command_tree_with_it() {
    let env = Env::new();
    let (bg, img_file) = exec_writing(&env, &["--no-inherit"], background_writer);
    let keeper = keeper_of(&bg);
    unsafe { libc::kill(keeper as i32, libc::SIGKILL) };
    let out = bg.finish();
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("keeper"), "{}", show(&out));
    assert!(
        !still_written(&img_file),
        "the background job outlived the locks: {}\n{}",
        show(&out),
        writers_of(&img_file)
    );
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
}

/// Who is left of a command tree writing `file`: each process whose
/// command line names it, with its parent, state and group (for a
/// failure's message).
fn writers_of(file: &Path) -> String {
    processes_mentioning(&file.to_string_lossy())
        .into_iter()
        .map(|p| {
            let stat = fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            format!(
                "{p}: {}",
                stat.split(' ').take(8).collect::<Vec<_>>().join(" ")
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The keeper killed after it started the command and before it said so:
/// stowage cannot know whether the command ran, so it ends the tree as for
/// any killed keeper, and the image it was rewriting is not left ready.
#[test]
fn a_keeper_killed_before_it_reports_the_start_takes_the_tree_with_it() {
    let env = Env::new();
    env.make_image("app");
    let img_file = env.root.join("img/app/log");
    let started = env.sentinel("started");
    let script = background_writer(&img_file, &started);
    let (bg, pause) = env.paused(
        [
            "exec",
            "--no-inherit",
            "--write",
            "app",
            "--",
            "sh",
            "-c",
            &script,
        ],
        "keeper-started",
    );
    wait_for_file(&started);
    let keeper = paused_pid(&pause);
    unsafe { libc::kill(keeper, libc::SIGKILL) };
    let out = bg.finish();
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        !still_written(&img_file),
        "the background job outlived the locks: {}\n{}",
        show(&out),
        writers_of(&img_file)
    );
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
}

#[test]
fn by_default_descendants_keep_the_inherited_locks() {
    let env = Env::new();
    let (bg, img_file) = exec_writing(&env, &[], background_writer);
    bg.signal(libc::SIGKILL);
    let out = env.run(["exec", "--write", "app", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    drop(bg);
    // Stop the writer (its group) so the temporary directory can go.
    let marker = img_file.to_string_lossy().into_owned();
    for p in processes_mentioning(&marker) {
        unsafe { libc::kill(p as i32, libc::SIGKILL) };
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
fn a_daemonised_descendant_is_still_part_of_the_tree() {
    let env = Env::new();
    // The command double-forks a writer into a session of its own and
    // exits at once, as a daemon does.
    let daemon = env.sentinel("daemon.sh");
    let (mut bg, img_file) = exec_writing(&env, &["--no-inherit"], |log, started| {
        fs::write(&daemon, background_writer(log, started)).unwrap();
        format!(
            "setsid sh '{}' </dev/null >/dev/null 2>&1 &",
            daemon.display()
        )
    });
    wait_until("the daemon writes", || lines(&img_file) > 2);
    // The command has exited, but its daemon writes: the image stays held.
    assert!(bg.is_running(), "stowage returned while the daemon writes");
    let out = env.run(["exec", "--write", "app", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    bg.signal(libc::SIGKILL);
    let out = env.run(["exec", "--write", "app", "--wait", "30", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(!still_written(&img_file), "the daemon outlived the locks");
}

#[test]
fn a_kill_of_stowages_whole_group_still_ends_a_daemonised_descendant() {
    let env = Env::new();
    let daemon = env.sentinel("daemon.sh");
    let (bg, img_file) = exec_writing(&env, &["--no-inherit"], |log, started| {
        fs::write(&daemon, background_writer(log, started)).unwrap();
        format!(
            "setsid sh '{}' </dev/null >/dev/null 2>&1 & wait",
            daemon.display()
        )
    });
    wait_until("the daemon writes", || lines(&img_file) > 2);
    // `kill -9 -PGID`: stowage and the command's shell die together; the
    // daemon left the group, the keeper leads its own.
    bg.signal_group(libc::SIGKILL);
    let out = env.run(["exec", "--write", "app", "--wait", "30", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(!still_written(&img_file), "the daemon outlived the locks");
}

#[test]
fn a_leftover_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let env = Env::new();
    let (bg, img_file) = exec_writing(&env, &["--no-inherit"], |log, started| {
        format!(
            "( trap '' TERM; i=0; while [ $i -lt 6000 ]; do echo x >> '{f}'; sleep 0.01; i=$((i+1)); done ) </dev/null >/dev/null 2>&1 & touch '{s}'; wait",
            f = log.display(),
            s = started.display()
        )
    });
    wait_until("the background job writes", || lines(&img_file) > 2);
    bg.signal(libc::SIGTERM);
    let t0 = std::time::Instant::now();
    let out = bg.finish();
    eprintln!("stowage ended {:?} after SIGTERM", t0.elapsed());
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    assert!(!still_written(&img_file), "the job outlived the locks");
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
}

/// A command stopped (SIGSTOP, SIGTTOU, a suspended batch job) acts on no
/// termination signal until continued: one sent to stowage, the pid
/// lock-status shows, is followed by SIGCONT, so it ends and lets the image
/// go, in both modes; and a waiter's `--why` names the stopped command, not
/// stowage, which runs. Before, the command held the image for good and the
/// advice was "waits for nothing stowage can see".
#[test]
fn a_termination_signal_ends_a_stopped_command_and_why_names_it() {
    for mode in [&[][..], &["--no-inherit"][..]] {
        let env = Env::new();
        env.make_image("app");
        let pid_file = env.sentinel("command.pid");
        let mut locks = mode.to_vec();
        locks.extend(["--write", "app"]);
        let bg = env.start_sh(&locks, |started| {
            format!(
                "echo $$ > '{p}'; touch '{s}'; kill -STOP $$; touch '{p}.continued'",
                p = pid_file.display(),
                s = started.display()
            )
        });
        wait_until("the command is stopped", || {
            let pid = fs::read_to_string(&pid_file).unwrap_or_default();
            pid.trim().parse().is_ok_and(|p| proc_state(p) == Some('T'))
        });
        let command: u32 = fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let reader = env.spawn(["exec", "--read", "app", "--", "true"]);
        env.wait_for_waiter("app");
        let out = env.ok(["lock-status", "--why", &reader.pid().to_string()]);
        let why = stdout(&out);
        let advice = format!(
            "runs a stopped command (pid {command}): continue it (kill -CONT {command}), or end it: kill {}",
            bg.pid()
        );
        assert!(why.contains(&advice), "{mode:?}: {why}");

        bg.signal(libc::SIGTERM);
        let out = bg.finish();
        assert_eq!(code(&out), Some(143), "{mode:?}: {}", show(&out));
        assert!(!env.sentinel("command.pid.continued").exists(), "{mode:?}");
        assert_eq!(code(&reader.finish()), Some(66), "{mode:?}");
        assert_eq!(env.state("app").as_deref(), Some("incomplete"));
        assert!(flock_free(&env.lock_file("app")));
    }
}

/// A running command gets the termination signal forwarded, and no
/// SIGCONT after it: one that handles SIGCONT itself (a shell's `trap …
/// CONT`) would run that handler, and bash may then lose the pending TERM's
/// trap and exit 0, its image recorded ready. Before, every forwarded
/// termination signal was followed by SIGCONT.
#[test]
fn a_running_command_gets_no_sigcont_after_a_forwarded_signal() {
    for mode in [&[][..], &["--no-inherit"][..]] {
        let env = Env::new();
        let log = env.sentinel("signals");
        let mut locks = mode.to_vec();
        locks.extend(["--write", "app"]);
        let bg = env.start_sh(&locks, |started| {
            format!(
                // A moment after its TERM trap, for a SIGCONT sent with it to come too.
                "trap 'echo CONT >> {l}' CONT; trap 'echo TERM >> {l}; touch {l}.seen' TERM; touch '{s}'; while [ ! -e {l}.seen ]; do sleep 0.01; done; sleep 0.2; exit 3",
                l = log.display(),
                s = started.display()
            )
        });
        bg.signal(libc::SIGTERM);
        let out = bg.finish();
        assert_eq!(code(&out), Some(3), "{mode:?}: {}", show(&out));
        assert_eq!(fs::read_to_string(&log).unwrap(), "TERM\n", "{mode:?}");
        assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    }
}

/// In a pid namespace without a `/proc` of its own (`unshare --pid --fork`), `/proc` numbers the
/// host's processes: a stopped command cannot be seen as one there, so a termination signal is
/// followed by SIGCONT all the same, and the command ends, in both modes. Before, the host's pid
/// of the same number was asked, never stopped: the command kept its lock for good.
#[test]
fn a_stopped_command_ends_on_a_termination_signal_in_a_pid_namespace_without_its_own_proc() {
    if !root_or_skip("a pid namespace (unshare --pid)") || !tool_or_skip("unshare", "util-linux") {
        return;
    }
    for mode in [&[][..], &["--no-inherit"][..]] {
        let env = Env::new();
        env.make_image("app");
        let marker = env.sentinel("stopped-here");
        let script = format!("kill -STOP $$; touch '{}'", marker.display());
        let mut c = Command::new("unshare");
        c.args(["--pid", "--fork", bin(), "--root"]).arg(&env.root);
        c.arg("exec")
            .args(mode)
            .args(["--write", "app", "--", "sh", "-c", &script]);
        let bg = Bg::from_command(c);
        let stopped = || {
            let mine = processes_mentioning(&marker.display().to_string());
            mine.into_iter().find(|&p| proc_state(p) == Some('T'))
        };
        wait_until("the command is stopped", || stopped().is_some());
        let holder = env.lock_entry("app").unwrap()["holders"][0]["pid"]
            .as_u64()
            .unwrap();
        unsafe { libc::kill(holder as i32, libc::SIGTERM) };
        let out = bg.finish();
        assert_eq!(code(&out), Some(143), "{mode:?}: {}", show(&out));
        assert!(!marker.exists(), "{mode:?}: the command went on");
        assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    }
}

// --- signals from a terminal ------------------------------------------------

/// A pseudo-terminal whose slave is the controlling terminal of a new
/// session led by the process started on it.
struct Pty {
    master: OwnedFd,
    slave: PathBuf,
}

impl Pty {
    fn new() -> Pty {
        unsafe {
            let m = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
            assert!(m >= 0, "posix_openpt");
            assert_eq!(libc::grantpt(m), 0);
            assert_eq!(libc::unlockpt(m), 0);
            let mut buf = [0 as libc::c_char; 128];
            assert_eq!(libc::ptsname_r(m, buf.as_mut_ptr(), buf.len()), 0);
            let slave = std::ffi::CStr::from_ptr(buf.as_ptr())
                .to_string_lossy()
                .into_owned();
            Pty {
                master: OwnedFd::from_raw_fd(m),
                slave: PathBuf::from(slave),
            }
        }
    }

    /// Starts `c` as the leader of a new session whose controlling terminal
    /// is this pty, on its stdin/stdout/stderr.
    fn start(&self, mut c: Command) -> std::process::Child {
        let slave = std::ffi::CString::new(self.slave.to_str().unwrap()).unwrap();
        c.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        unsafe {
            c.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let fd = libc::open(slave.as_ptr(), libc::O_RDWR);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::ioctl(fd, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                for target in 0..3 {
                    libc::dup2(fd, target);
                }
                Ok(())
            });
        }
        c.spawn().expect("start on the pty")
    }

    /// Types on the terminal.
    fn type_bytes(&self, bytes: &[u8]) {
        let n = unsafe {
            libc::write(
                self.master.as_raw_fd(),
                bytes.as_ptr() as *const libc::c_void,
                bytes.len(),
            )
        };
        assert_eq!(n, bytes.len() as isize);
    }
}

/// A command that touches STARTED, then sleeps in the foreground for a
/// while (bounded) — longer than any test waits for a signal to act.
fn sleeper(started: &Path) -> String {
    format!("touch '{}'; sleep 20", started.display())
}

/// Starts `stowage exec --write app [--no-inherit] -- PREFIX… sh -c
/// SLEEPER` with `pty` as its controlling terminal, and returns once the
/// sleeper runs.
fn exec_on_terminal(
    env: &Env,
    pty: &Pty,
    no_inherit: bool,
    prefix: &[&str],
) -> std::process::Child {
    let started = env.sentinel("started");
    let mut c = env.cmd(["exec", "--write", "app"]);
    if no_inherit {
        c.arg("--no-inherit");
    }
    c.arg("--")
        .args(prefix)
        .args(["sh", "-c", &sleeper(&started)]);
    let child = pty.start(c);
    wait_for_file(&started);
    child
}

#[test]
fn ctrl_c_reaches_a_command_in_its_own_process_group() {
    for no_inherit in [false, true] {
        let env = Env::new();
        let pty = Pty::new();
        // GNU timeout moves itself into a process group of its own: the
        // terminal's Ctrl-C reaches stowage's group only.
        let child = exec_on_terminal(&env, &pty, no_inherit, &["timeout", "60"]);
        pty.type_bytes(b"\x03");
        let out = wait_output(child, PATIENCE);
        assert_eq!(
            out.status.code(),
            Some(130),
            "no_inherit={no_inherit}: {}",
            show(&out)
        );
        assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    }
}

#[test]
fn closing_the_terminal_of_a_session_leading_stowage_ends_the_command() {
    for no_inherit in [false, true] {
        let env = Env::new();
        let pty = Pty::new();
        let child = exec_on_terminal(&env, &pty, no_inherit, &[]);
        // The hangup goes to the session leader — stowage — alone.
        let Pty { master, .. } = pty;
        drop(master);
        let out = wait_output(child, PATIENCE);
        assert_eq!(
            out.status.code(),
            Some(129),
            "no_inherit={no_inherit}: {}",
            show(&out)
        );
        assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    }
}

#[test]
fn ctrl_c_reaches_a_command_in_our_group_once() {
    let env = Env::new();
    let started = env.sentinel("started");
    let log = env.sentinel("ints");
    let pty = Pty::new();
    // The command counts the SIGINTs it gets, then ends by itself.
    let script = format!(
        "trap 'echo INT >> \"{log}\"' INT; touch '{s}'; i=0; while [ $i -lt 100 ]; do sleep 0.01; i=$((i+1)); done",
        log = log.display(),
        s = started.display()
    );
    let c = env.cmd(["exec", "--write", "app", "--", "sh", "-c", &script]);
    let child = pty.start(c);
    wait_for_file(&started);
    pty.type_bytes(b"\x03");
    let out = wait_output(child, PATIENCE);
    // The terminal signalled the whole group; stowage did not add a second.
    assert_eq!(
        fs::read_to_string(&log).unwrap_or_default(),
        "INT\n",
        "{}",
        show(&out)
    );
}

/// A command waiting for a catalog an outside program keeps in WAL mode
/// ends on SIGTERM at once, as the shell expects (143), and does not say
/// it gave up waiting, which it did not.
#[test]
fn a_signal_ends_a_wait_for_a_catalog_an_outside_program_keeps_in_wal() {
    let env = Env::new();
    env.make_image("a");
    env.ok(["images"]);
    let db = env.root.join("stowage.db");
    let conn = rusqlite::Connection::open(&db).unwrap();
    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let _: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
        .unwrap();
    let db = fs::canonicalize(&db).unwrap();
    for args in [&["images"][..], &["gc"]] {
        let mut c = env.cmd(args);
        c.env(stowage::env::DEBUG_DB_BUSY_MS, "120000");
        let mut bg = Bg::from_command(c);
        let pid = bg.pid();
        wait_until("stowage opens the catalog or ends", || {
            !bg.is_running()
                || fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
                    fds.flatten()
                        .any(|fd| fs::read_link(fd.path()).is_ok_and(|t| t == db))
                })
        });
        bg.signal(libc::SIGTERM);
        let out = bg.finish();
        // Ended by the signal, or exiting 143 once it has cleaned up: the
        // shell reports both as 143.
        use std::os::unix::process::ExitStatusExt;
        assert!(
            out.status.signal() == Some(libc::SIGTERM) || code(&out) == Some(143),
            "{args:?}: {}",
            show(&out)
        );
        assert!(
            !stderr(&out).contains("gave up"),
            "{args:?}: {}",
            show(&out)
        );
    }
    drop(conn);
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}

/// A termination signal passed on to the command's keeper, and then the
/// keeper killed before it reports how the command ended (the command
/// ignores the signal): the exec was asked to stop and its tree is gone,
/// so it exits 128+N, as any exec a signal cut short — not 1, as for a
/// keeper that died by itself — and the image is not left ready.
#[test]
fn a_keeper_killed_after_a_termination_signal_exits_128_plus_n() {
    let env = Env::new();
    env.make_image("app");
    let out = keeper_killed_after_sigterm(&env, &["--write", "app"]);
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGTERM),
        "{}",
        show(&out)
    );
    assert!(stderr(&out).contains("keeper"), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
}

/// `exec --no-inherit LOCKS -- CMD` with a CMD that ignores SIGTERM:
/// SIGTERM to stowage, a moment for it to reach the keeper, then the
/// keeper killed (before its 5 s grace ends); how stowage ended.
fn keeper_killed_after_sigterm(env: &Env, locks: &[&str]) -> std::process::Output {
    let started = env.sentinel("started");
    let _ = fs::remove_file(&started);
    let script = format!("trap '' TERM; touch '{}'; sleep 60", started.display());
    let mut args = vec!["exec", "--no-inherit"];
    args.extend(locks);
    args.extend(["--", "sh", "-c", &script]);
    let bg = env.spawn(&args);
    wait_for_file(&started);
    let keeper = keeper_of(&bg);
    bg.signal(libc::SIGTERM);
    std::thread::sleep(std::time::Duration::from_millis(300));
    unsafe { libc::kill(keeper as i32, libc::SIGKILL) };
    bg.finish()
}

/// The same for a store-wide exec, and for a termination signal that came
/// while the keeper was starting (taken only once the keeper was gone).
#[test]
fn a_keeper_killed_after_a_termination_signal_exits_128_plus_n_however_it_came() {
    let env = Env::new();
    env.make_image("app");
    let out = keeper_killed_after_sigterm(&env, &["--store-wide"]);
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGTERM),
        "store-wide: {}",
        show(&out)
    );
    // The signal while the keeper starts (paused before it reports).
    let (bg, pause) = env.paused(
        ["exec", "--no-inherit", "--read", "app", "--", "sleep", "30"],
        "keeper-started",
    );
    let keeper = paused_pid(&pause);
    bg.signal(libc::SIGTERM);
    std::thread::sleep(std::time::Duration::from_millis(200));
    unsafe { libc::kill(keeper, libc::SIGKILL) };
    let out = bg.finish();
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGTERM),
        "starting: {}",
        show(&out)
    );
}

/// The `--no-inherit` keeper of the stowage process `bg` (its child).
fn keeper_of(bg: &Bg) -> u32 {
    processes_mentioning("__keeper")
        .into_iter()
        .find(|p| {
            fs::read_to_string(format!("/proc/{p}/stat"))
                .is_ok_and(|s| s.split(' ').nth(3) == Some(&bg.pid().to_string()))
        })
        .expect("the keeper runs")
}

/// The pid a pause point writes into the file it made (made first, written
/// a moment later: waited for).
fn paused_pid(pause: &std::path::Path) -> i32 {
    let mut pid = 0;
    wait_until("the paused process's pid", || {
        pid = fs::read_to_string(pause)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        pid > 0
    });
    pid
}

/// On FUSE a wait tries again and again without blocking (no blocked
/// request to interrupt): SIGTERM and SIGINT still end it at once, with
/// 128+N, for an image lock (as writer, and as reader queued behind one)
/// and for a store-wide hold.
#[test]
fn a_signal_ends_a_polled_wait_on_fuse() {
    let env = Env::new();
    env.make_image("a");
    let _image = long_holder(&env, &["--write", "a"], "image-held");
    let store_wide = ["exec", "--store-wide", "--", "true"];
    for (sig, args) in [
        (libc::SIGTERM, &["exec", "--write", "a", "--", "true"][..]),
        (libc::SIGINT, &["exec", "--read", "a", "--", "true"]),
        (libc::SIGTERM, &store_wide),
    ] {
        let mut c = env.cmd(args);
        c.env(stowage::env::DEBUG_FILESYSTEM, "fuse");
        let mut waiter = Bg::from_command(c);
        wait_until("the waiter waits", || {
            waits_on(&env, "a", waiter.pid()) || {
                let out = env.ok(["lock-status", "--json"]);
                String::from_utf8_lossy(&out.stdout).contains(&format!("\"pid\": {}", waiter.pid()))
            }
        });
        waiter.signal(sig);
        // The holder never lets go: only the signal can end the wait.
        wait_until("the waiter ends on the signal", || !waiter.is_running());
        let out = waiter.finish();
        assert_eq!(
            out.status.code(),
            Some(128 + sig),
            "{args:?}: {}",
            show(&out)
        );
    }
}
