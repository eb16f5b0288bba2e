//! Lock acquisition: nested commands, the writer gate, waits that could
//! become cycles, slots under a changing configuration, store-wide
//! operations against every lock an older release may hold, and the checks
//! that stand in for NFS behaviour that cannot be reproduced here.

use std::path::PathBuf;

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
