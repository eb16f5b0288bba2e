//! Slot records under attack: a change of a class that dies or fails
//! between its commit and its records, and entries planted under slot
//! names in a class directory. The limit the database holds is the one
//! that binds, whatever was left in the slot files.

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
