//! Schema migration is a store-wide operation: it waits until no image
//! lock or slot is held, so a process of an older release that holds one
//! finishes against the schema it knows.

use std::fs;
use std::process::Stdio;

use crate::common::*;

const OLD: (&str, &str) = ("STOWAGE_DEBUG_SCHEMA_LIMIT", "1");

/// PRAGMA user_version, read from the database header (offset 60).
fn schema_version(env: &Env) -> u32 {
    let bytes = fs::read(env.root.join("stowage.db")).unwrap();
    u32::from_be_bytes(bytes[60..64].try_into().unwrap())
}

/// The schema this build writes.
fn latest() -> u32 {
    stowage::meta::schema_version() as u32
}

#[test]
fn migration_waits_for_image_lock_holders() {
    let env = Env::new();
    let mut c = env.cmd(["exec", "--write", "base", "--", "true"]);
    c.env(OLD.0, OLD.1);
    assert_eq!(output(c).status.code(), Some(0));
    assert_eq!(schema_version(&env), 1);

    // An older stowage holds an image lock...
    let old = env.hold_with(&["--read", "base"], "started", |c| {
        c.env(OLD.0, OLD.1);
    });

    // ...so a newer one must wait before migrating, even for another image.
    let log = fs::File::create(env.sentinel("new.log")).unwrap();
    let mut c = env.cmd([
        "exec",
        "--write",
        "fresh",
        "--",
        "touch",
        env.sentinel("ran").to_str().unwrap(),
    ]);
    c.stderr(Stdio::from(log));
    let mut new = Bg::from_command_keep_stderr(c);
    wait_until("the newer stowage says it waits", || {
        fs::read_to_string(env.sentinel("new.log"))
            .unwrap_or_default()
            .contains("before upgrading the metadata schema")
    });
    assert!(new.is_running());
    assert!(!env.sentinel("ran").exists());
    assert_eq!(
        schema_version(&env),
        1,
        "no migration while an image lock is held"
    );
    let said = fs::read_to_string(env.sentinel("new.log")).unwrap();
    assert!(
        said.contains("image 'base'"),
        "names what it waits for: {said}"
    );

    // The old holder finishes against the old schema, then the migration runs.
    env.release("release");
    let out = old.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(new.finish().status.code(), Some(0));
    assert!(env.sentinel("ran").exists());
    assert_eq!(
        schema_version(&env),
        latest(),
        "migrated to the latest schema"
    );
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.state("fresh").as_deref(), Some("ready"));

    // The older release now refuses the newer schema instead of damaging it.
    let mut c = env.cmd(["images"]);
    c.env(OLD.0, OLD.1);
    let out = output(c);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("newer than this stowage"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn rm_as_the_first_command_after_an_upgrade_migrates_first() {
    // rm takes its image locks itself; migrating while holding them would
    // wait for itself forever.
    let env = Env::new();
    let mut c = env.cmd(["exec", "--write", "old", "--", "true"]);
    c.env(OLD.0, OLD.1);
    assert_eq!(output(c).status.code(), Some(0));
    env.ok(["rm", "old"]);
    assert_eq!(schema_version(&env), latest());
    assert_eq!(env.state("old"), None);
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
