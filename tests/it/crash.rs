//! SIGKILL at the worst moments: no lock stays held, no image is lost or
//! left looking ready.

use std::fs;

use crate::common::*;

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
    // The reader's refusal kept what it learned: the state is recorded and
    // the dead writer's record is gone (read straight from the database,
    // since any stowage command that looks would also fix it).
    let conn = stowage::meta::open(&env.root.join("stowage.db")).unwrap();
    let state: String = conn
        .query_row("SELECT state FROM images WHERE name = 'app'", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(state, "incomplete");
    let records: i64 = conn
        .query_row("SELECT count(*) FROM records", [], |r| r.get(0))
        .unwrap();
    assert_eq!(records, 0);
}

#[test]
fn sigkill_of_stowage_alone_leaves_the_command_holding_the_lock() {
    let env = Env::new();
    let mut bg = env.hold(&["--write", "app"], "started");
    let stowage_pid = bg.pid();
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
    assert_eq!(
        holders[0]["pid"], stowage_pid,
        "the record still stands for the holder: {entry}"
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
