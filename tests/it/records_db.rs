//! The records' database (src/records_db.rs): a reader and a slot's
//! acquirer trust a record in the current format without reading the
//! database's header, because the first transaction on a database takes
//! away every token and slot record of another one. Each test puts another
//! database in place with real processes and checks that, from the next
//! transaction on, what that database says wins.

use std::fs;

use crate::common::*;

#[test]
fn another_stores_database_put_in_place_is_found_by_the_next_transaction() {
    let here = Env::new();
    here.make_image("base");
    here.ok(["exec", "--read", "base", "--", "true"]);
    let there = Env::new();
    there.make_image("other");
    here.put_database_of(&there);
    // Any transaction: it finds the lock files speaking for another
    // database and takes their tokens away.
    here.ok(["images"]);
    here.assert_read_refused(
        "base",
        "a read trusted the token of a database no longer there",
    );
}

#[test]
fn a_repair_takes_away_the_tokens_of_the_identity_it_renews() {
    let env = Env::new();
    env.make_image("keep");
    // A copy of the database from before `base` existed, restored over it
    // afterwards (same identity: nothing tells the copy apart but a
    // repair, which a restore must be followed by).
    let copy = env.scratch.join("stowage.db.copy");
    fs::copy(env.root.join("stowage.db"), &copy).unwrap();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    // Folded into the rows (a new image is written without the database).
    env.ok(["images"]);
    fs::copy(&copy, env.root.join("stowage.db")).unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.assert_read_refused(
        "base",
        "a read trusted a token the repaired database does not vouch for",
    );
    env.ok(["exec", "--read", "keep", "--", "true"]);
}

#[test]
fn slot_records_of_another_database_are_taken_away() {
    let here = Env::new();
    here.make_image("base");
    here.ok(["slots", "set", "pull", "2"]);
    // Records written (by the slow way's first acquirer).
    here.ok(["exec", "--slot", "pull", "--", "true"]);
    let there = Env::new();
    there.ok(["slots", "set", "pull", "1"]);
    here.put_database_of(&there);
    here.ok(["images"]);
    let holder = here.hold(&["--slot", "pull"], "started");
    let out = here.run(["exec", "--slot", "pull", "--wait", "0.3", "--", "true"]);
    here.release("release");
    let held = holder.finish();
    assert_eq!(code(&held), Some(0), "{}", show(&held));
    assert_eq!(
        code(&out),
        Some(75),
        "a second slot of a class limited to 1 by the database there: {}",
        show(&out)
    );
}

#[test]
fn the_store_records_which_database_its_records_speak_for() {
    let env = Env::new();
    env.make_image("base");
    let global = fs::read(env.root.join("locks/global.lock")).unwrap();
    let text = String::from_utf8_lossy(&global);
    assert!(text.starts_with("stowage-records 2\ndb="), "{text}");
    let images = format!("\nimages={}\n", env.images_dir().display());
    assert!(
        text.contains(&images),
        "states the images directory: {text}"
    );
    // The lock file stays a lock file: flock(1) on it works.
    let out = std::process::Command::new("flock")
        .arg("-n")
        .arg(env.root.join("locks/global.lock"))
        .arg("true")
        .output()
        .unwrap();
    assert!(out.status.success());
}
