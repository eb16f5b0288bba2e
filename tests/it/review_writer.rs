//! Attacks on writes without the database (src/written.rs): what a
//! writer's record and marker leave to whoever comes next, when that is a
//! writer of the database's way, a fold, or a hostile root.

use std::fs;

use crate::common::*;

fn marker(env: &Env, enc: &str) -> std::path::PathBuf {
    env.root.join("locks/dirty").join(enc)
}

#[test]
fn a_writer_that_waited_for_a_fast_write_and_never_ran_leaves_the_image_ready() {
    // The fast write is unfolded when the waiting writer gets the lock: its
    // start must fold the record it read before taking the token away, not
    // the emptied lock file (which says the write left no outcome).
    let env = Env::new();
    env.make_image("base");
    let fast = env.hold(&["--write", "base"], "started");
    assert!(
        marker(&env, "base").exists(),
        "the write took no transaction"
    );
    let waiter = env.spawn(["exec", "--write", "base", "--", "/nonexistent/cmd"]);
    env.wait_for_waiter("base");
    env.release("release");
    assert_eq!(fast.finish().status.code(), Some(0));
    let out = waiter.finish();
    assert!(
        stderr(&out).contains("cannot run"),
        "its command never ran: {}",
        show(&out)
    );
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "base", "--", "true"]);
}

#[test]
fn a_fast_write_that_succeeds_beside_a_repair_is_ready() {
    // `doctor --repair` renews the database's identity (tokens of a copy
    // restored over it stop counting) while the writer, which took no
    // transaction, runs: its record names the identity it started under.
    // The command exits 0, so the image is ready (spec: exec).
    let env = Env::new();
    env.make_image("base");
    let writer = env.hold(&["--write", "base"], "started");
    assert!(
        marker(&env, "base").exists(),
        "the write took no transaction"
    );
    env.ok(["doctor", "--repair"]);
    env.release("release");
    assert_eq!(writer.finish().status.code(), Some(0));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "base", "--", "true"]);
}
