//! Lock acquisition: nested commands, the writer gate, waits that could
//! become cycles, slots under a changing configuration, store-wide
//! operations against every lock an older release may hold, and the checks
//! that stand in for NFS behaviour that cannot be reproduced here.

use std::fs;
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
    c.env(stowage::env::DEBUG_SCHEMA_LIMIT, "2");
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let cmd = format!(
        "env -u {lim} '{bin}' --root '{root}' exec --read base -- true",
        lim = stowage::env::DEBUG_SCHEMA_LIMIT,
        bin = bin(),
        root = env.root.display()
    );
    let mut c = env.cmd(["exec", "--read", "base", "--", "sh", "-c", &cmd]);
    c.env(stowage::env::DEBUG_SCHEMA_LIMIT, "2");
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
        c.env(stowage::env::DEBUG_SCHEMA_LIMIT, "2");
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

#[test]
fn a_raised_or_lifted_slot_limit_lets_queued_waiters_in() {
    let env = Env::new();
    env.ok(["slots", "set", "one", "1"]);
    let mut holder = env.hold_until(&["--slot", "one"], "held", "release");
    let first = env.spawn(["exec", "--slot", "one", "--", "true"]);
    env.wait_for_slot_waiters("one", 1);
    env.ok(["slots", "set", "one", "2"]);
    let out = first.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        holder.is_running(),
        "the raised limit let the waiter in, not the holder's end"
    );

    let second = env.hold_until(&["--slot", "one"], "second", "release");
    let third = env.spawn(["exec", "--slot", "one", "--", "true"]);
    env.wait_for_slot_waiters("one", 1);
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
    let a = env.hold_until(&["--slot", "two"], "a", "release-a");
    let b = env.hold_until(&["--slot", "two"], "b", "release-b");
    let waiter = env.spawn([
        "exec",
        "--slot",
        "two",
        "--",
        "touch",
        env.sentinel("waiter-ran").to_str().unwrap(),
    ]);
    env.wait_for_slot_waiters("two", 1);
    env.ok(["slots", "set", "two", "1"]);
    env.release("release-a");
    assert_eq!(a.finish().status.code(), Some(0));
    // One slot is still in use (b keeps it), and the limit is 1 now: the
    // waiter must stay out however often it is woken. Watch it a while.
    for _ in 0..20 {
        let e = env.slot_entry("two").unwrap();
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
    let holder = env.hold_until(&["--slot", "one"], "held", "release");
    let waiter = env.spawn(["exec", "--slot", "one", "--", "true"]);
    env.wait_for_slot_waiters("one", 1);
    env.ok(["slots", "rm", "one"]);
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(
        stderr(&out).contains("removed while waiting"),
        "{}",
        show(&out)
    );
    let e = env
        .slot_entry("one")
        .expect("the removed class is shown while held");
    assert_eq!(e["holders"].as_array().unwrap().len(), 1, "{e}");
    let text = String::from_utf8_lossy(&env.ok(["lock-status"]).stdout).into_owned();
    assert!(text.contains("one (removed)"), "{text}");
    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert!(env.slot_entry("one").is_none());
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
        .map(|i| env.hold_until(&["--slot", "eight"], &format!("h{i}"), "release"))
        .collect();
    let waiter = Bg::from_command(cg.wrap(&format!(
        "'{bin}' --root '{root}' exec --slot eight -- touch '{ran}'",
        bin = bin(),
        root = env.root.display(),
        ran = env.sentinel("ran").display()
    )));
    env.wait_for_slot_waiters("eight", 1);
    env.release("release");
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(env.sentinel("ran").exists());
    for h in holders {
        assert_eq!(h.finish().status.code(), Some(0));
    }
}

/// A mountinfo that puts the test's directory on a filesystem of `fstype`
/// mounted with `options` (read through the hidden hook, with the
/// filesystem type faked the same way).
fn fake_mount(env: &Env, cmd: &mut Command, fstype: &str, options: &str) {
    let dir = fs::canonicalize(env.tmp.path()).unwrap();
    let info = env.sentinel("mountinfo");
    fs::write(
        &info,
        format!(
            "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n\
             101 22 0:60 / {} rw,relatime - {fstype} srv:/export {options}\n",
            dir.display()
        ),
    )
    .unwrap();
    cmd.env(stowage::env::DEBUG_FILESYSTEM, fstype)
        .env(stowage::env::DEBUG_MOUNTINFO, &info);
}

#[test]
fn node_local_locking_on_lustre_and_beegfs_is_refused() {
    let env = Env::new();
    // A store that exists, so that doctor has one to look at.
    env.ok(["init"]);
    let conf = env.sentinel("beegfs-client.conf");
    for (fstype, options, conf_text, refused) in [
        ("lustre", "rw,localflock", "", Some("localflock")),
        ("lustre", "rw,noflock", "", Some("noflock")),
        ("lustre", "rw,flock", "", None),
        (
            "beegfs",
            "rw,cfgFile=CONF",
            "tuneUseGlobalFileLocks = false\n",
            Some("tuneUseGlobalFileLocks"),
        ),
        (
            "beegfs",
            "rw,cfgFile=CONF",
            "sysMgmtdHost = m\n",
            Some("tuneUseGlobalFileLocks"),
        ),
        (
            "beegfs",
            "rw,cfgFile=CONF",
            "tuneUseGlobalFileLocks = true\n",
            None,
        ),
        (
            "nfs",
            "rw,vers=4.2,local_lock=flock",
            "",
            Some("local_lock=flock"),
        ),
    ] {
        fs::write(&conf, conf_text).unwrap();
        let options = options.replace("CONF", conf.to_str().unwrap());
        let case = format!("{fstype} {options} {conf_text:?}");
        let mut c = env.cmd(["exec", "--write", "app", "--", "true"]);
        fake_mount(&env, &mut c, fstype, &options);
        let out = output(c);
        let mut d = env.cmd(["doctor"]);
        fake_mount(&env, &mut d, fstype, &options);
        let doc = output(d);
        match refused {
            Some(word) => {
                assert_eq!(out.status.code(), Some(69), "{case}: {}", show(&out));
                assert!(stderr(&out).contains(word), "{case}: {}", show(&out));
                assert_eq!(
                    stderr(&out).trim_end().lines().count(),
                    1,
                    "{case}: {}",
                    show(&out)
                );
                assert_eq!(doc.status.code(), Some(69), "{case}: {}", show(&doc));
                assert!(
                    String::from_utf8_lossy(&doc.stdout).contains(word),
                    "{case}: {}",
                    show(&doc)
                );
            }
            None => {
                assert_eq!(out.status.code(), Some(0), "{case}: {}", show(&out));
                assert_ne!(doc.status.code(), Some(69), "{case}: {}", show(&doc));
            }
        }
    }
    // Lustre without either option cannot be judged: doctor says how to
    // check, and nothing is refused.
    let mut d = env.cmd(["doctor"]);
    fake_mount(&env, &mut d, "lustre", "rw,lazystatfs");
    let doc = output(d);
    assert_ne!(doc.status.code(), Some(69), "{}", show(&doc));
    assert!(
        String::from_utf8_lossy(&doc.stdout).contains("--hold-probe"),
        "{}",
        show(&doc)
    );
}

#[test]
fn a_hold_probe_on_another_host_is_seen_by_doctor() {
    let env = Env::new();
    env.ok(["init"]);
    // Another "host": a new UTS and pid namespace (needs root).
    let ok = Command::new("unshare")
        .args(["--pid", "--fork", "--uts", "--mount-proc", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: cannot make a pid and UTS namespace (unshare needs root)");
        return;
    }
    let mut c = Command::new("unshare");
    c.args(["--pid", "--fork", "--uts", "--mount-proc", "sh", "-c"])
        .arg(format!(
            "hostname probe-host && exec '{bin}' --root '{root}' doctor --hold-probe 60",
            bin = bin(),
            root = env.root.display()
        ))
        .env_remove("STOWAGE_HOSTNAME");
    let holder = Bg::from_command(c);
    let file = env.root.join("locks/probe.lock");
    wait_until("the probe is held", || {
        fs::read_to_string(&file).is_ok_and(|t| t.starts_with("probe-host")) && !flock_free(&file)
    });
    let out = env.run(["doctor"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("probe lock held on another host (host probe-host"),
        "{}",
        show(&out)
    );
    // The other host goes away: its lock goes with it.
    holder.kill_all();
    let out = env.run(["doctor"]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("probe"),
        "{}",
        show(&out)
    );
    // A probe on this host is told apart from one elsewhere.
    let here = env.spawn(["doctor", "--hold-probe", "60"]);
    wait_until("the probe is held here", || {
        fs::read_to_string(&file).is_ok_and(|t| !t.starts_with("probe-host")) && !flock_free(&file)
    });
    let out = env.run(["doctor"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("held on this host"),
        "{}",
        show(&out)
    );
    here.kill_all();
}

#[test]
fn a_write_lock_lost_while_the_command_ran_makes_the_image_incomplete() {
    // No NFS here: the hidden hook makes the check of app's lock fail as a
    // lost NFS lock does (the Linux client fails I/O on it with EIO).
    let env = Env::new();
    env.make_image("base");
    let mut c = env.cmd(["exec", "--read", "base", "--write", "app", "--", "true"]);
    c.env(stowage::env::DEBUG_LOST_LOCK, "app.lock");
    let out = output(c);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("lost the write lock on image 'app'"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    // Only written images are checked: base, read, is untouched.
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    // And an intact lock records ready as before.
    env.ok(["exec", "--write", "app", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
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
    // says nothing about the tree keeps the row (files.rs has the EACCES
    // case, as an unprivileged user).
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let img = env.root.join("img");
    fs::remove_file(&img).unwrap();
    fs::rename(env.root.join("img.aside"), &img).unwrap();
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn on_a_shared_filesystem_lock_files_are_never_unlinked() {
    // The hidden hook makes the store look like NFS: a stat of a path may
    // then be stale (another host's unlink unseen), so no lock file is
    // ever unlinked, and the check after locking re-opens the path.
    let env = Env::new();
    let nfs = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
        output(c)
    };
    let out = nfs(&["exec", "--write", "app", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let out = nfs(&["rm", "app"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(env.lock_file("app").exists(), "kept after rm");
    let out = nfs(&["exec", "--write", "new", "--", "/nonexistent/cmd"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(env.lock_file("new").exists(), "kept after a failed start");
    // Kept lock files are no leftovers there.
    let out = nfs(&["doctor"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    // The name comes back: the kept file is reused.
    let out = nfs(&["exec", "--write", "app", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));

    // A ghost made anyway — by a host that sees the store as local (the
    // NFS server itself) or an older release: a waiter blocked on the file
    // it unlinks retries on the new one, verified by re-opening the path.
    let (remover, go) = env.paused(["rm", "app"], "rm-moved");
    let mut c = env.cmd(["exec", "--write", "app", "--", "true"]);
    c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
    let waiter = Bg::from_command(c);
    env.wait_for_waiter("app");
    fs::remove_file(go).unwrap();
    assert_eq!(remover.finish().status.code(), Some(0));
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert!(flock_free(&env.lock_file("app")));
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
        c.env_remove(stowage::env::EXEC_PIDS);
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
