//! `exec --store-wide`: a command that runs while no image lock is held or
//! granted — waited for by new image users, bounded waits and refused
//! removals, a killed holder that blocks nobody, images it deleted forgotten,
//! and calls of stowage nested inside it or inside a command it waits for.

use std::fs;

use crate::common::*;

fn store_lock(env: &Env) -> std::path::PathBuf {
    env.root.join("locks/store.lock")
}

/// `exec --store-wide -- sh -c 'touch STARTED; wait for RELEASE'`.
fn store_wide_hold(env: &Env, started: &str, release: &str) -> Bg {
    let mut args: Vec<String> = vec!["exec".into(), "--store-wide".into(), "--".into()];
    args.extend(env.hold_cmd(started, release));
    env.spawn(&args)
}

#[test]
fn a_store_wide_command_waits_for_image_users_and_new_ones_wait_for_it() {
    let env = Env::new();
    env.make_image("a");
    let reader = env.hold(&["--read", "a"], "reader");
    let wide = store_wide_hold(&env, "wide", "wide-go");
    // It waits for the reader, holding nothing a reader or writer needs...
    wait_until("the store-wide command waits for 'a'", || {
        flock_waited_on(&env.lock_file("a"))
    });
    assert!(!env.sentinel("wide").exists());
    // ...and from now on no new image user starts: not a reader of a
    // ready image, not a writer of a new one.
    let later_reader = env.spawn([
        "exec",
        "--read",
        "a",
        "--",
        "sh",
        "-c",
        &format!("test -e '{}'", env.sentinel("wide").display()),
    ]);
    let later_writer = env.spawn([
        "exec",
        "--write",
        "b",
        "--",
        "sh",
        "-c",
        &format!("test -e '{}'", env.sentinel("wide").display()),
    ]);
    // Three blocked requests: the store-wide command's for 'a', and the
    // later reader's and writer's for the store.
    wait_until("both later users wait for the store", || {
        let waiting = fs::read_to_string("/proc/locks")
            .unwrap()
            .lines()
            .filter(|l| l.contains("->"))
            .count();
        waiting >= 3 && flock_waited_on(&store_lock(&env))
    });
    assert!(!env.root.join("img/b").exists());
    // lock-status shows the hold, its command and who queues for it.
    let status = env.status_json::<[&str; 0], &str>([]);
    let store = status["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "global" && l["name"] == "store")
        .cloned()
        .unwrap_or_else(|| panic!("no store-wide entry: {status}"));
    assert_eq!(store["state"], "exclusive", "{store}");
    assert!(
        store["holders"][0]["command"]
            .as_str()
            .unwrap()
            .starts_with("sh -c"),
        "{store}"
    );
    assert_eq!(store["waiters"].as_array().unwrap().len(), 2, "{store}");

    env.release("release");
    assert_eq!(reader.finish().status.code(), Some(0));
    wait_for_file(&env.sentinel("wide"));
    env.release("wide-go");
    assert_eq!(wide.finish().status.code(), Some(0));
    // The later users ran after the store-wide command had started (their
    // command checks that it did), and said what they waited for.
    for bg in [later_reader, later_writer] {
        let out = bg.finish();
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
        assert!(
            stderr(&out).contains("waiting for the store-wide command to finish"),
            "{}",
            show(&out)
        );
    }
    assert_eq!(env.state("b").as_deref(), Some("ready"));
}

#[test]
fn image_users_do_not_wait_past_their_bound_and_removals_are_refused() {
    let env = Env::new();
    env.make_image("a");
    let wide = store_wide_hold(&env, "wide", "wide-go");
    wait_for_file(&env.sentinel("wide"));
    let out = env.run(["exec", "--no-wait", "--read", "a", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(
        stderr(&out).contains("a store-wide command runs"),
        "{}",
        show(&out)
    );
    let out = env.run(["exec", "--wait", "0.2", "--write", "new", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let out = env.run([
        "exec",
        "--conflict-exit-code",
        "9",
        "--no-wait",
        "--read",
        "a",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(9), "{}", show(&out));
    assert!(!env.root.join("img/new").exists());
    assert!(!env.lock_file("new").exists());
    assert!(env.image("new").is_none());
    let out = env.run(["rm", "a"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    // gc keeps what it may not remove now, as it keeps an image in use:
    // not a failure.
    let out = env.run(["gc", "--max-size", "0"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("kept 'a': in use"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    // A second store-wide command waits for the first.
    let out = env.run(["exec", "--wait", "0.2", "--store-wide", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    env.release("wide-go");
    assert_eq!(wide.finish().status.code(), Some(0));
    env.ok(["exec", "--no-wait", "--read", "a", "--", "true"]);
    env.ok(["rm", "a"]);
    env.ok(["doctor"]);
}

#[test]
fn a_killed_store_wide_holder_blocks_nobody() {
    let env = Env::new();
    env.make_image("a");
    let wide = store_wide_hold(&env, "wide", "never");
    wait_for_file(&env.sentinel("wide"));
    wide.kill_all();
    // Its record stands, but its lease is free: stale.
    env.ok(["exec", "--no-wait", "--read", "a", "--", "true"]);
    env.ok(["exec", "--no-wait", "--write", "b", "--", "true"]);
    // A clone takes a transaction, which drops the stale record.
    env.ok([
        "exec",
        "--no-wait",
        "--write",
        "c",
        "--from",
        "a",
        "--",
        "true",
    ]);
    let out = env.ok(["doctor"]);
    assert!(out.status.success(), "{}", show(&out));
}

/// Images whose trees a store-wide command removed are forgotten when it
/// ends — unless the images directory looks unmounted (empty while images
/// are recorded), which says nothing about the trees.
#[test]
fn images_a_store_wide_command_deleted_are_forgotten() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    let img = env.root.join("img");
    let out = env.ok([
        "exec",
        "--store-wide",
        "--",
        "rm",
        "-rf",
        img.join("a").to_str().unwrap(),
    ]);
    assert!(
        stderr(&out).contains("image 'a' was deleted by the store-wide command"),
        "{}",
        show(&out)
    );
    assert!(env.image("a").is_none());
    assert!(!env.lock_file("a").exists());
    assert_eq!(env.state("b").as_deref(), Some("ready"));
    // Everything gone at once looks like an unmounted directory: kept.
    let out = env.ok([
        "exec",
        "--store-wide",
        "--",
        "rm",
        "-rf",
        img.join("b").to_str().unwrap(),
    ]);
    assert!(stderr(&out).contains("is it mounted?"), "{}", show(&out));
    assert!(env.image("b").is_some());
    env.ok(["exec", "--write", "c", "--", "true"]);
}

// --- nested calls -----------------------------------------------------------

#[test]
fn a_store_wide_command_may_call_stowage_itself() {
    let env = Env::new();
    env.make_image("a");
    // The command (a wrapper script) runs stowage again: it is inside the
    // hold and goes ahead instead of waiting for itself.
    let out = env.run([
        "exec",
        "--wait",
        "20",
        "--store-wide",
        "--",
        bin(),
        "--root",
        env.root.to_str().unwrap(),
        "exec",
        "--wait",
        "20",
        "--read",
        "a",
        "--write",
        "c",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("c").as_deref(), Some("ready"));
}

/// `stowage --root ROOT exec ARGS…` as a command line for an outer exec.
fn inner(env: &Env, args: &[&str]) -> Vec<String> {
    let mut v = vec![
        bin().to_owned(),
        "--root".into(),
        env.root.to_str().unwrap().to_owned(),
    ];
    v.extend(args.iter().map(|a| a.to_string()));
    v
}

#[test]
fn a_no_inherit_store_wide_command_may_call_stowage_itself() {
    let env = Env::new();
    env.make_image("a");
    // The keeper keeps the store's lease, not the command: the nested
    // exec is still inside the hold (its ancestor holds it) and must go
    // ahead rather than wait for the hold that waits for it.
    let mut args: Vec<String> = ["exec", "--no-inherit", "--store-wide", "--"]
        .map(String::from)
        .to_vec();
    args.extend(inner(
        &env,
        &[
            "exec", "--wait", "20", "--read", "a", "--write", "c", "--", "true",
        ],
    ));
    let out = env.run(&args);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("c").as_deref(), Some("ready"));

    // A removal inside it is inside the hold too.
    let mut args: Vec<String> = ["exec", "--no-inherit", "--store-wide", "--"]
        .map(String::from)
        .to_vec();
    args.extend(inner(&env, &["rm", "--wait", "20", "c"]));
    let out = env.run(&args);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("c"), None);
}

#[test]
fn a_store_wide_command_inside_another_fails_at_once() {
    for no_inherit in [false, true] {
        let env = Env::new();
        let mut args: Vec<String> = vec!["exec".into()];
        if no_inherit {
            args.push("--no-inherit".into());
        }
        args.extend(["--store-wide".into(), "--".into()]);
        args.extend(inner(
            &env,
            &["exec", "--wait", "20", "--store-wide", "--", "true"],
        ));
        let out = env.run(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(75), "{}", show(&out));
        assert!(
            err.contains("enclosing command") && !err.contains("waiting for the store-wide"),
            "no-inherit {no_inherit}: should fail at once naming the enclosing hold: {err}"
        );
    }
}

/// The scenario of the nested-call tests, for an outer exec with `flags`:
/// it writes image `a`, and its command, once a store-wide hold waits for
/// `a`, calls stowage again to read `b`. That nested call must go ahead
/// (waiting for the hold would wait for itself), the outer exec succeed,
/// and the hold start and succeed once it is done.
fn nested_exec_goes_ahead_of_a_hold_waiting_for_its_parent(env: &Env, flags: &[&str]) {
    env.make_image("a");
    env.make_image("b");
    let nested = format!(
        "touch '{started}'; while [ ! -e '{go}' ]; do sleep 0.01; done; \
         '{bin}' --root '{root}' exec --wait 20 --read b -- true",
        started = env.sentinel("outer").display(),
        go = env.sentinel("go").display(),
        bin = bin(),
        root = env.root.display()
    );
    let mut args = vec!["exec"];
    args.extend(flags);
    args.extend(["--write", "a", "--", "sh", "-c", &nested]);
    let outer = env.spawn(args);
    wait_for_file(&env.sentinel("outer"));
    let wide = store_wide_hold(env, "wide", "wide-go");
    wait_until("the store-wide command waits for 'a'", || {
        flock_waited_on(&env.lock_file("a"))
    });
    env.release("go");
    let out = outer.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    wait_for_file(&env.sentinel("wide"));
    env.release("wide-go");
    assert_eq!(wide.finish().status.code(), Some(0));
}

/// A command holding an image lock calls stowage again while a store-wide
/// command waits for that lock: the nested call goes ahead (waiting for the
/// hold would wait for itself), and the hold starts once the outer command
/// is done.
#[test]
fn a_nested_exec_is_not_held_back_by_a_hold_that_waits_for_its_parent() {
    let env = Env::new();
    nested_exec_goes_ahead_of_a_hold_waiting_for_its_parent(&env, &[]);
    // An unrelated exec with locks of its own still waits for the hold.
    let wide = store_wide_hold(&env, "wide2", "wide2-go");
    wait_for_file(&env.sentinel("wide2"));
    let out = env.run(["exec", "--no-wait", "--read", "a", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    env.release("wide2-go");
    assert_eq!(wide.finish().status.code(), Some(0));
}

#[test]
fn a_nested_exec_under_no_inherit_is_not_held_back_by_a_hold_that_waits_for_its_parent() {
    let env = Env::new();
    // The outer exec keeps its locks from the command (--no-inherit): the
    // nested call holds no descriptor, yet its parent's lock on 'a' is what
    // the store-wide hold waits for.
    nested_exec_goes_ahead_of_a_hold_waiting_for_its_parent(&env, &["--no-inherit"]);
}

/// `exec --store-wide` called by the command of an image user, while
/// another store-wide command holds the store and waits for that very
/// image: waiting for the store would never end (the other hold waits for
/// our enclosing exec, which waits for us). It fails at once (75), the
/// enclosing build goes on and ends, and then the other hold runs.
#[test]
fn a_store_wide_call_inside_an_image_users_command_fails_at_once() {
    let env = Env::new();
    env.make_image("a");
    let (go, code) = (env.sentinel("go"), env.sentinel("code"));
    let script = format!(
        "touch '{started}'; while [ ! -e '{go}' ]; do sleep 0.01; done; \
         '{bin}' --root '{root}' exec --store-wide -- true; echo $? > '{code}'",
        started = env.sentinel("user").display(),
        go = go.display(),
        bin = bin(),
        root = env.root.display(),
        code = code.display(),
    );
    let user = env.spawn(["exec", "--read", "a", "--", "sh", "-c", &script]);
    wait_for_file(&env.sentinel("user"));
    let wide = store_wide_hold(&env, "wide", "wide-go");
    wait_until("the other hold waits for 'a'", || {
        flock_waited_on(&env.lock_file("a"))
    });
    fs::write(&go, "").unwrap();
    let out = user.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(fs::read_to_string(&code).unwrap().trim(), "75");
    wait_for_file(&env.sentinel("wide"));
    env.release("wide-go");
    assert_eq!(wide.finish().status.code(), Some(0));
}

/// An exec called by the command of an exec that holds only a slot, while
/// a store-wide command waits for that slot: it goes ahead, as under an
/// image user (the hold waits for our enclosing exec, so waiting for the
/// hold would never end), and the hold runs once the slot is free.
#[test]
fn an_exec_inside_a_slot_holders_command_passes_a_hold_waiting_for_the_slot() {
    let env = Env::new();
    env.make_image("a");
    env.ok(["slots", "set", "pull", "1"]);
    let (go, code) = (env.sentinel("go"), env.sentinel("code"));
    let script = format!(
        "touch '{started}'; while [ ! -e '{go}' ]; do sleep 0.01; done; \
         '{bin}' --root '{root}' exec --read a -- true; echo $? > '{code}'",
        started = env.sentinel("user").display(),
        go = go.display(),
        bin = bin(),
        root = env.root.display(),
        code = code.display(),
    );
    let user = env.spawn(["exec", "--slot", "pull", "--", "sh", "-c", &script]);
    wait_for_file(&env.sentinel("user"));
    let wide = store_wide_hold(&env, "wide", "wide-go");
    wait_until("the hold waits for the slot", || {
        flock_waited_on(&env.root.join("locks/slots/pull/0.lock"))
    });
    fs::write(&go, "").unwrap();
    let out = user.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(fs::read_to_string(&code).unwrap().trim(), "0");
    wait_for_file(&env.sentinel("wide"));
    env.release("wide-go");
    assert_eq!(wide.finish().status.code(), Some(0));
}

/// A failed first build leaves an incomplete row and no directory. A
/// store-wide command that deletes nothing must not take that missing tree
/// for its own deletion: the failure stays listed, and nothing is said
/// about a deletion that did not happen.
#[test]
fn a_store_wide_command_keeps_a_failed_build_without_a_tree() {
    let env = Env::new();
    env.make_image("kept");
    // Another tree stays, so the images directory never looks unmounted.
    env.make_image("stays");
    let out = env.run(["exec", "--write", "failed", "--", "false"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(!env.root.join("img/failed").exists());
    assert_eq!(env.state("failed").as_deref(), Some("incomplete"));
    let out = env.ok(["exec", "--store-wide", "--", "true"]);
    assert!(
        !stderr(&out).contains("'failed' was deleted"),
        "{}",
        show(&out)
    );
    assert_eq!(
        env.state("failed").as_deref(),
        Some("incomplete"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("kept").as_deref(), Some("ready"));
    // A tree the store-wide command does delete is still forgotten.
    let out = env.ok([
        "exec",
        "--store-wide",
        "--",
        "sh",
        "-c",
        "rm -rf \"$STOWAGE_IMAGES_DIR/kept\"",
    ]);
    assert!(
        stderr(&out).contains("'kept' was deleted"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("kept"), None);
    assert_eq!(env.state("stays").as_deref(), Some("ready"));
    assert_eq!(env.state("failed").as_deref(), Some("incomplete"));
}

#[test]
fn gc_leaves_an_interrupted_removal_to_after_a_store_wide_command() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    // A removal killed after marking: gc finishes such removals.
    let (rm, _pause) = env.paused(["rm", "a"], "rm-marked");
    rm.kill_all();
    assert_eq!(env.state("a").as_deref(), Some("deleting"));
    let wide = store_wide_hold(&env, "wide", "wide-go");
    wait_for_file(&env.sentinel("wide"));
    // Refused before anything moved: not a failure, done later.
    let out = env.run(["gc"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("a").as_deref(), Some("deleting"));
    env.release("wide-go");
    assert_eq!(wide.finish().status.code(), Some(0));
    env.ok(["gc"]);
    assert_eq!(env.state("a"), None);
}

#[test]
fn gc_finds_an_image_a_store_wide_command_forgot_under_its_lock_gone_not_failed() {
    // gc takes an image's lock during a store-wide command (it only tries
    // locks), rechecks it, and is about to remove it when the command ends
    // having deleted that image's tree: its end forgets the row without
    // the image's lock. gc then finds nothing to remove — not a failure.
    let env = Env::new();
    env.make_image("a");
    // Another tree, so that the images directory does not look unmounted
    // once 'a' is gone (an empty one says nothing about the trees).
    env.make_image("b");
    let dir = env.root.join("img/a");
    let mut args: Vec<String> = vec!["exec".into(), "--store-wide".into(), "--".into()];
    let script = format!(
        "touch '{}'; while [ ! -e '{}' ]; do sleep 0.01; done; rm -rf '{}'",
        env.sentinel("wide").display(),
        env.sentinel("wide-go").display(),
        dir.display()
    );
    args.extend(["sh".into(), "-c".into(), script]);
    let wide = env.spawn(&args);
    wait_for_file(&env.sentinel("wide"));
    let (gc, pause) = env.paused(
        ["gc", "--unused-for", "0s", "--max-size", "0"],
        "gc-rechecked",
    );
    fs::write(env.sentinel("wide-go"), "").unwrap();
    let out = wide.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("a"), None, "the store-wide command forgot it");
    // Let it go on, here and at the next image it pauses for.
    let mut gc = gc;
    wait_until("gc ends", || {
        let _ = fs::remove_file(&pause);
        !gc.is_running()
    });
    let out = gc.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}
