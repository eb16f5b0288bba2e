//! Lock acquisition: nested commands, the writer gate, waits that could
//! become cycles, slots under a changing configuration, store-wide
//! operations against every lock an older release may hold, and the checks
//! that stand in for NFS behaviour that cannot be reproduced here.

use std::fs;
use std::path::PathBuf;
use std::process::Command;

use crate::common::*;

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

fn gate_file(env: &Env, enc: &str) -> PathBuf {
    env.root.join("locks/images").join(format!("{enc}.gate"))
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

#[test]
fn nested_slot_of_a_full_class_works_under_the_enclosing_slot() {
    let env = Env::new();
    env.ok(["slots", "set", "one", "1"]);
    let out = nested(&env, &["--slot", "one"], "--slot one");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}

#[test]
fn nested_migration_fails_instead_of_waiting_for_its_enclosing_command() {
    let env = Env::new();
    // An older release (two migrations) makes the store and reads from it;
    // inside, the current release finds the schema behind and must migrate,
    // which needs every image lock free — the enclosing one included.
    let mut c = env.cmd([
        "exec",
        "--write",
        "base",
        "--",
        "sh",
        "-c",
        "echo x > \"$STOWAGE_IMAGE_DIR/f\"",
    ]);
    c.env(stowage::meta::SCHEMA_LIMIT_ENV, "2");
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let cmd = format!(
        "env -u {lim} '{bin}' --root '{root}' exec --read base -- true",
        lim = stowage::meta::SCHEMA_LIMIT_ENV,
        bin = bin(),
        root = env.root.display()
    );
    let mut c = env.cmd(["exec", "--read", "base", "--", "sh", "-c", &cmd]);
    c.env(stowage::meta::SCHEMA_LIMIT_ENV, "2");
    let out = output(c);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(stderr(&out).contains("enclosing command"), "{}", show(&out));
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

#[test]
fn lock_status_of_an_image_that_does_not_exist_says_so() {
    let env = Env::new();
    env.make_image("base");
    let out = env.run(["lock-status", "nosuch", "base"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains("image 'nosuch' does not exist"),
        "{}",
        show(&out)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("base") && !text.contains("nosuch"), "{text}");
    env.ok(["lock-status", "base"]);
}

/// Waiter records in the database, read directly (not through stowage,
/// which would judge and drop stale ones before showing them).
fn waiter_rows(env: &Env) -> Option<String> {
    let out = Command::new("sqlite3")
        .arg(env.root.join("stowage.db"))
        .arg("SELECT kind, name FROM records WHERE role = 'waiter'")
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn a_request_that_times_out_on_a_later_lock_leaves_no_waiter_record() {
    let env = Env::new();
    if waiter_rows(&env).is_none() && Command::new("sqlite3").arg("-version").output().is_err() {
        eprintln!("skipped: no sqlite3 to read the records with");
        return;
    }
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
    assert_eq!(
        waiter_rows(&env).as_deref(),
        Some(""),
        "waiter records left"
    );
    env.release("release");
    for bg in [a, b] {
        assert_eq!(bg.finish().status.code(), Some(0));
    }
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
    let w = env.spawn(["exec", "--write", "n", "--", "/nonexistent/cmd"]);
    env.wait_for_waiter("n");
    env.release("release-n");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert_eq!(w.finish().status.code(), Some(1));
    assert!(env.image("n").is_none());
    assert!(!env.lock_file("n").exists());
    assert!(!gate_file(&env, "n").exists());
}

#[test]
fn a_process_with_an_open_connection_survives_a_database_rebuild() {
    let env = Env::new();
    env.make_image("base");
    // No lock file: the reader looks the image up first (a transaction,
    // which opens its connection) and stops there.
    fs::remove_file(env.lock_file("base")).unwrap();
    let (reader, go) = env.paused(["exec", "--read", "base", "--", "true"], "image-required");
    fs::write(env.root.join("stowage.db"), vec![0x5a; 8192]).unwrap();
    env.ok(["doctor", "--repair"]);
    // Whatever readiness the rebuild gave it, make it ready again.
    env.make_image("base");
    fs::remove_file(go).unwrap();
    let out = reader.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}

#[test]
fn migration_waits_for_an_older_release_holding_only_a_slot() {
    let env = Env::new();
    let old = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env(stowage::meta::SCHEMA_LIMIT_ENV, "2");
        c
    };
    assert_eq!(
        output(old(&["slots", "set", "one", "1"])).status.code(),
        Some(0)
    );
    // The older release holds a slot and no image lock.
    let mut args = vec!["exec", "--slot", "one", "--"];
    let hold = env.hold_cmd("started", "release");
    args.extend(hold.iter().map(String::as_str));
    let holder = Bg::from_command(old(&args));
    wait_for_file(&env.sentinel("started"));
    // The newer one must migrate, and so must wait for that slot.
    let log = env.sentinel("new.log");
    let mut c = env.cmd(["images"]);
    c.stderr(std::process::Stdio::from(fs::File::create(&log).unwrap()));
    let mut new = Bg::from_command_keep_stderr(c);
    wait_until(
        "the newer release waits for the slot, or has migrated",
        || !new.is_running() || fs::read_to_string(&log).unwrap().contains("waiting for"),
    );
    assert!(
        fs::read_to_string(&log)
            .unwrap()
            .contains("slot 0 of class 'one'"),
        "{}",
        fs::read_to_string(&log).unwrap()
    );
    env.release("release");
    let out = holder.finish();
    assert_eq!(out.status.code(), Some(0), "older holder: {}", show(&out));
    assert_eq!(new.finish().status.code(), Some(0));
}

/// The lock-status entry of a slot class, if shown.
fn slot_entry(env: &Env, class: &str) -> Option<serde_json::Value> {
    let st = env.status_json(Vec::<&str>::new());
    st["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "slot" && l["name"] == class)
        .cloned()
}

fn wait_for_slot_waiters(env: &Env, class: &str, n: usize) {
    wait_until(&format!("{n} waiter(s) on slot class '{class}'"), || {
        slot_entry(env, class).is_some_and(|e| e["waiters"].as_array().unwrap().len() >= n)
    });
}

/// `exec --slot CLASS -- <hold until sentinel RELEASE>` in the background,
/// returning once it holds its slot.
fn slot_holder(env: &Env, class: &str, started: &str, release: &str) -> Bg {
    let mut args = vec![
        "exec".to_owned(),
        "--slot".into(),
        class.into(),
        "--".into(),
    ];
    args.extend(env.hold_cmd(started, release));
    let bg = env.spawn(&args);
    wait_for_file(&env.sentinel(started));
    bg
}

#[test]
fn a_raised_or_lifted_slot_limit_lets_queued_waiters_in() {
    let env = Env::new();
    env.ok(["slots", "set", "one", "1"]);
    let mut holder = slot_holder(&env, "one", "held", "release");
    let first = env.spawn(["exec", "--slot", "one", "--", "true"]);
    wait_for_slot_waiters(&env, "one", 1);
    env.ok(["slots", "set", "one", "2"]);
    let out = first.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        holder.is_running(),
        "the raised limit let the waiter in, not the holder's end"
    );

    let second = slot_holder(&env, "one", "second", "release");
    let third = env.spawn(["exec", "--slot", "one", "--", "true"]);
    wait_for_slot_waiters(&env, "one", 1);
    env.ok(["slots", "set", "one", "0"]);
    let out = third.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(holder.is_running());
    env.release("release");
    for bg in [holder, second] {
        assert_eq!(bg.finish().status.code(), Some(0));
    }
}

#[test]
fn a_lowered_slot_limit_binds_queued_waiters() {
    let env = Env::new();
    env.ok(["slots", "set", "two", "2"]);
    let a = slot_holder(&env, "two", "a", "release-a");
    let b = slot_holder(&env, "two", "b", "release-b");
    let waiter = env.spawn([
        "exec",
        "--slot",
        "two",
        "--",
        "touch",
        env.sentinel("waiter-ran").to_str().unwrap(),
    ]);
    wait_for_slot_waiters(&env, "two", 1);
    env.ok(["slots", "set", "two", "1"]);
    env.release("release-a");
    assert_eq!(a.finish().status.code(), Some(0));
    // One slot is still in use (b keeps it), and the limit is 1 now: the
    // waiter must stay out however often it is woken. Watch it a while.
    for _ in 0..20 {
        let e = slot_entry(&env, "two").unwrap();
        assert_eq!(e["in_use"], 1, "{e}");
        assert!(
            !env.sentinel("waiter-ran").exists(),
            "the lowered limit did not bind the waiter"
        );
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    env.release("release-b");
    assert_eq!(b.finish().status.code(), Some(0));
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(env.sentinel("waiter-ran").exists());
}

#[test]
fn a_removed_class_shows_its_holders_until_they_end_and_ends_its_waits() {
    let env = Env::new();
    env.ok(["slots", "set", "one", "1"]);
    let holder = slot_holder(&env, "one", "held", "release");
    let waiter = env.spawn(["exec", "--slot", "one", "--", "true"]);
    wait_for_slot_waiters(&env, "one", 1);
    env.ok(["slots", "rm", "one"]);
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(
        stderr(&out).contains("removed while waiting"),
        "{}",
        show(&out)
    );
    let e = slot_entry(&env, "one").expect("the removed class is shown while held");
    assert_eq!(e["holders"].as_array().unwrap().len(), 1, "{e}");
    let text = String::from_utf8_lossy(&env.ok(["lock-status"]).stdout).into_owned();
    assert!(text.contains("one (removed)"), "{text}");
    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert!(slot_entry(&env, "one").is_none());
}

/// A pids cgroup (v1) of this test, removed when dropped. `None` (the test
/// is skipped, saying why) where one cannot be made: not root, no pids
/// controller mounted.
struct PidsCgroup(PathBuf);

impl PidsCgroup {
    fn new(max: u32) -> Option<PidsCgroup> {
        let base = std::path::Path::new("/sys/fs/cgroup/pids");
        let dir = base.join(format!(
            "stowage-it-{}-{}",
            std::process::id(),
            fastrand::u32(..)
        ));
        if let Err(e) = fs::create_dir(&dir) {
            eprintln!(
                "skipped: cannot make a pids cgroup under {}: {e}",
                base.display()
            );
            return None;
        }
        fs::write(dir.join("pids.max"), max.to_string()).ok()?;
        Some(PidsCgroup(dir))
    }

    /// `sh -c` that moves itself into the cgroup, then runs `cmd`.
    fn wrap(&self, cmd: &str) -> Command {
        let mut c = Command::new("sh");
        c.args([
            "-c",
            &format!(
                "echo $$ > '{}/cgroup.procs' && exec {cmd}",
                self.0.display()
            ),
        ]);
        c
    }
}

impl Drop for PidsCgroup {
    fn drop(&mut self) {
        let _ = fs::remove_dir(&self.0);
    }
}

#[test]
fn a_slot_waiter_under_a_pids_limit_still_waits_and_gets_in() {
    let env = Env::new();
    // Four tasks: stowage, its signal thread, the command, and one spare.
    // A helper thread per slot file (eight here) cannot start.
    let Some(cg) = PidsCgroup::new(4) else {
        return;
    };
    env.ok(["slots", "set", "eight", "8"]);
    let holders: Vec<Bg> = (0..8)
        .map(|i| slot_holder(&env, "eight", &format!("h{i}"), "release"))
        .collect();
    let waiter = Bg::from_command(cg.wrap(&format!(
        "'{bin}' --root '{root}' exec --slot eight -- touch '{ran}'",
        bin = bin(),
        root = env.root.display(),
        ran = env.sentinel("ran").display()
    )));
    wait_for_slot_waiters(&env, "eight", 1);
    env.release("release");
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(env.sentinel("ran").exists());
    for h in holders {
        assert_eq!(h.finish().status.code(), Some(0));
    }
}
