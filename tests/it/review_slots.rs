//! Slot records under attack: a change of a class that dies or fails
//! between its commit and its records, and entries planted under slot
//! names in a class directory. The limit the database holds is the one
//! that binds, whatever was left in the slot files.

use std::fs;
use std::process::Command;

use crate::common::*;

/// `exec --slot CLASS --no-wait -- true`: exit 0 if a slot was free, 75 if
/// the class was full.
fn try_slot(env: &Env, class: &str) -> std::process::Output {
    env.run(["exec", "--slot", class, "--no-wait", "--", "true"])
}

/// One slot held, and the limit (1) reached: the next acquirer is refused.
fn assert_limit_one_binds(env: &Env) {
    let holder = env.hold(&["--slot", "pull"], "held");
    let out = try_slot(env, "pull");
    assert_eq!(
        code(&out),
        Some(75),
        "a second holder beside the one limit 1 allows: {}",
        show(&out)
    );
    env.release("release");
    let out = holder.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

fn limit_of(env: &Env, class: &str) -> u64 {
    let out = env.ok(["slots", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == class)
        .map(|c| c["limit"].as_u64().unwrap())
        .unwrap()
}

/// `slots set` killed once its change has committed, before the records
/// that follow it are written: the slot files must not go on saying the
/// old, higher limit (every acquirer would take a slot on it, for good).
/// strace's fault injection kills it at its second flock(2), the global
/// lock of the transaction that writes the records.
#[test]
fn a_set_killed_after_its_commit_leaves_no_old_limit_standing() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.ok(["slots", "set", "pull", "4"]);
    let mut c = Command::new("strace");
    c.args([
        "-f",
        "-qq",
        "-o",
        "/dev/null",
        "-e",
        "trace=flock",
        "-e",
        "inject=flock:signal=SIGKILL:when=2",
    ])
    .arg(bin())
    .arg("--root")
    .arg(&env.root)
    .args(["slots", "set", "pull", "1"]);
    let out = output(c);
    assert!(
        !out.status.success(),
        "slots set was not killed: {}",
        show(&out)
    );
    assert_eq!(limit_of(&env, "pull"), 1, "the change itself committed");
    assert_limit_one_binds(&env);
}

/// A link and a directory planted under slot names beyond the limit (a
/// group member can write the class directory): a lowered limit is still
/// the one every acquirer goes by.
#[test]
fn entries_planted_under_slot_names_leave_no_old_limit_standing() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "4"]);
    let dir = env.root.join("locks/slots/pull");
    let elsewhere = env.scratch.join("elsewhere");
    std::fs::write(&elsewhere, "keep").unwrap();
    std::os::unix::fs::symlink(&elsewhere, dir.join("9.lock")).unwrap();
    std::fs::create_dir(dir.join("8.lock")).unwrap();
    env.ok(["slots", "set", "pull", "1"]);
    assert_limit_one_binds(&env);
    assert_eq!(std::fs::read_to_string(&elsewhere).unwrap(), "keep");
}

/// A link planted under a slot name beyond the limit is nobody's slot: a
/// waiter counting the slots held beyond the limit must not fail on it
/// once a slot is free.
#[test]
fn a_link_under_a_slot_name_does_not_fail_the_waiters() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "1"]);
    let elsewhere = env.scratch.join("elsewhere");
    std::fs::write(&elsewhere, "keep").unwrap();
    std::os::unix::fs::symlink(&elsewhere, env.root.join("locks/slots/pull/5.lock")).unwrap();
    let holder = env.hold(&["--slot", "pull"], "held");
    let waiter = env.spawn(["exec", "--slot", "pull", "--", "true"]);
    env.wait_for_slot_waiters("pull", 1);
    env.release("release");
    let out = holder.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = waiter.finish();
    assert_eq!(
        code(&out),
        Some(0),
        "the waiter gets the slot: {}",
        show(&out)
    );
    assert_eq!(std::fs::read_to_string(&elsewhere).unwrap(), "keep");
}

/// An acquirer that read the class (limit 2) from the database and, before
/// it tries the slot files, sees the limit lowered to 1 and a slot beyond
/// it come free, with the records already settled (nothing beyond the
/// limit held when they were written): it must not run in that slot,
/// beside a holder of the one slot the limit allows. gdb stops it between
/// the two (at `Slots::new`), as a slow machine or a waiter on another
/// host can.
#[test]
fn a_slot_taken_on_a_class_read_before_a_lowered_limit_is_let_go() {
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let h0 = env.hold_until(&["--slot", "pull"], "h0", "r0");
    let h1 = env.hold_until(&["--slot", "pull"], "h1", "r1");
    let one = env.root.join("locks/slots/pull/1.lock");
    let at = env.sentinel("at-slots-new");
    let ran = env.sentinel("ran");
    let cmds = env.sentinel("gdb-cmds");
    fs::write(
        &cmds,
        format!(
            "set pagination off\n\
             break stowage::acquire::slot::Slots::new\n\
             run\n\
             delete\n\
             shell touch '{at}'; touch '{r1}'; i=0; while ! flock -n -x '{one}' true && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; \
             '{bin}' --root '{root}' slots set pull 1\n\
             continue\n",
            at = at.display(),
            r1 = env.sentinel("r1").display(),
            one = one.display(),
            bin = bin(),
            root = env.root.display(),
        ),
    )
    .unwrap();
    let mut c = stowage_under_gdb(&env, &cmds, ["exec", "--slot", "pull", "--"]);
    c.args(env.hold_cmd("ran", "r2"));
    let gdb = Bg::from_command(c);
    wait_for_file(&at);
    let out = h1.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    // Either it runs (in the slot beyond the new limit) or it waits.
    wait_until("the acquirer runs or waits", || {
        ran.exists()
            || env
                .slot_entry("pull")
                .is_some_and(|e| !e["waiters"].as_array().unwrap().is_empty())
    });
    assert!(
        !ran.exists(),
        "a second holder runs beside the one limit 1 allows"
    );
    env.release("r0");
    let out = h0.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    wait_for_file(&ran);
    env.release("r2");
    let out = gdb.finish();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("exited normally"),
        "{}",
        show(&out)
    );
}

/// An sqlite3 shell put the database in WAL mode and keeps a read
/// transaction open in it. A write cannot leave WAL then; it must fail
/// before it changes anything — not commit, then fail leaving WAL and say
/// the change failed (an exec that never ran its command leaving an
/// `incomplete` image, a `slots set` reported failed that took effect).
#[test]
fn a_write_beside_an_outside_reader_of_a_wal_database_changes_nothing() {
    if !tool_or_skip("sqlite3", "sqlite3") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let db = env.root.join("stowage.db");
    let out = Command::new("sqlite3")
        .arg(&db)
        .arg("PRAGMA journal_mode=WAL;")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let reading = env.sentinel("reading");
    let done = env.sentinel("done");
    let reader = Bg::from_command({
        let mut c = Command::new("sh");
        c.arg("-c").arg(format!(
            "{{ printf 'BEGIN;\\nSELECT count(*) FROM images;\\n.shell touch %s\\n' '{reading}'; \
             i=0; while [ ! -e '{done}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; \
             echo 'COMMIT;'; }} | sqlite3 '{db}'",
            reading = reading.display(),
            done = done.display(),
            db = db.display()
        ));
        c
    });
    wait_for_file(&reading);
    let ran = env.sentinel("ran");
    // Leaving WAL is tried for as long as SQLite's busy wait: keep it short.
    let short = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env("STOWAGE_DEBUG_DB_BUSY_MS", "300");
        output(c)
    };
    // A write that records a lineage (a new image without a base takes
    // no transaction: written.rs).
    let out = short(&[
        "exec",
        "--write",
        "app",
        "--from",
        "base",
        "--",
        "touch",
        ran.to_str().unwrap(),
    ]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(!ran.exists(), "the command ran: {}", show(&out));
    let out = short(&["slots", "set", "pull", "2"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    env.release("done");
    let out = reader.finish();
    assert!(out.status.success(), "{}", show(&out));
    assert!(env.image("app").is_none(), "a failed exec left image 'app'");
    assert!(
        env.slot_entry("pull").is_none() && !env.ok(["slots"]).stdout.starts_with(b"CLASS"),
        "a failed slots set took effect: {}",
        String::from_utf8_lossy(&env.ok(["slots"]).stdout)
    );
    // With the reader gone, the next command leaves WAL and works.
    env.ok(["exec", "--write", "app", "--", "true"]);
    let mode = Command::new("sqlite3")
        .arg(&db)
        .arg("PRAGMA journal_mode;")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&mode.stdout).trim(), "delete");
}

/// A database without an identity (made by an older release, or set back
/// by hand) on a full filesystem: writing the identity fails, and SQLite
/// rolls back the transaction it was written in. Every command must still
/// read the store and remove an image, as before identities were given
/// inside the transaction — not fail with "no transaction is active".
#[test]
fn a_database_without_identity_on_a_full_filesystem_is_still_read_and_emptied() {
    if !tool_or_skip("sqlite3", "sqlite3") {
        return;
    }
    let Some(fs_) = Mount::tmpfs("size=2m") else {
        return;
    };
    let env = fs_.env();
    env.make_image("a");
    env.make_image("b");
    let out = Command::new("sqlite3")
        .arg(env.root.join("stowage.db"))
        .arg("PRAGMA application_id=0;")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    // Fill the filesystem to the last byte.
    {
        use std::io::Write;
        let mut f = fs::File::create(fs_.dir.join("fill")).unwrap();
        let chunk = vec![0u8; 64 * 1024];
        while f.write_all(&chunk).is_ok() {}
        while f.write_all(&chunk[..512]).is_ok() {}
        while f.write_all(&chunk[..1]).is_ok() {}
    }
    let out = env.run(["images"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let listed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(listed.contains("a ") && listed.contains("b "), "{listed}");
    let out = env.run(["rm", "a"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(env.image("a").is_none(), "'a' is still there");
    assert!(env.image("b").is_some());
}

/// A class directory replaced by a link to a directory outside the root
/// (a member of the store's group can do that): changing or removing the
/// class must never write records into, or empty, files there.
#[test]
fn a_linked_class_directory_never_has_files_outside_the_root_written() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let victim = env.scratch.join("victim");
    fs::create_dir(&victim).unwrap();
    fs::write(victim.join("x.lock"), "precious").unwrap();
    fs::write(victim.join("0.lock"), "precious").unwrap();
    let dir = env.root.join("locks/slots/pull");
    fs::remove_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink(&victim, &dir).unwrap();
    for args in [
        &["slots", "set", "pull", "0"][..],
        &["slots", "set", "pull", "3"],
        &["slots", "rm", "pull"],
    ] {
        let out = env.run(args);
        for f in ["x.lock", "0.lock"] {
            assert_eq!(
                fs::read_to_string(victim.join(f)).unwrap(),
                "precious",
                "{f} outside the root was written by {args:?}: {}",
                show(&out)
            );
        }
    }
}

/// `locks/slots` replaced by a link to a directory outside the root: no
/// class directory and no slot file is made there, by a change of a class
/// or by an acquirer (which refuses, naming the link).
#[test]
fn a_linked_slots_directory_never_has_anything_made_outside_the_root() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let victim = env.scratch.join("victim");
    fs::create_dir(&victim).unwrap();
    let slots = env.root.join("locks/slots");
    fs::rename(&slots, env.root.join("locks/slots.real")).unwrap();
    std::os::unix::fs::symlink(&victim, &slots).unwrap();
    let set = env.run(["slots", "set", "pull", "3"]);
    let out = env.run(["exec", "--slot", "pull", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stderr(&out).contains("refusing to use it"),
        "{}",
        show(&out)
    );
    assert_eq!(
        walkdir(&victim).len(),
        0,
        "made outside the root: {:?}\n{}",
        walkdir(&victim),
        show(&set)
    );
}

/// `slots set pull 1` (from 2) stopped right after it found no slot beyond
/// the new limit held, before it writes the records settled: an acquirer
/// that comes then, while `0.lock` is held, must not take `1.lock` on the
/// records of the old limit — it would run beside the holder of `0.lock`
/// with the records about to say "settled", so nobody would count it.
#[test]
fn a_slot_is_not_taken_between_the_settled_question_and_the_records() {
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let h0 = env.hold_until(&["--slot", "pull"], "h0", "r0");
    let at = env.sentinel("asked");
    let go = env.sentinel("go");
    let cmds = env.sentinel("gdb-cmds");
    fs::write(
        &cmds,
        format!(
            "set pagination off\n\
             break stowage::slot_record::beyond_held\n\
             run\n\
             delete\n\
             finish\n\
             shell touch '{at}'; i=0; while [ ! -e '{go}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n\
             continue\n",
            at = at.display(),
            go = go.display(),
        ),
    )
    .unwrap();
    let set = Bg::from_command(stowage_under_gdb(
        &env,
        &cmds,
        ["slots", "set", "pull", "1"],
    ));
    wait_for_file(&at);
    let ran = env.sentinel("ran");
    let acquirer = env.spawn([
        "exec",
        "--slot",
        "pull",
        "--no-wait",
        "--",
        "touch",
        ran.to_str().unwrap(),
    ]);
    // It runs at once, or waits for the global lock the change holds.
    let global = env.root.join("locks/global.lock");
    wait_until("the acquirer runs or waits for the global lock", || {
        ran.exists() || flock_waited_on(&global)
    });
    assert!(
        !ran.exists(),
        "a second holder ran beside the one limit 1 allows"
    );
    fs::write(&go, "").unwrap();
    let out = set.finish();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("exited normally"),
        "{}",
        show(&out)
    );
    let out = acquirer.finish();
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    env.release("r0");
    let out = h0.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}
