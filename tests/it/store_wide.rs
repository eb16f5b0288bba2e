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
    // (Counted on the files themselves: other tests' waits show in
    // /proc/locks too.)
    wait_until("both later users wait for the store", || {
        flock_waiters_on(&store_lock(&env)) >= 2
            && flock_waited_on(&env.root.join("locks/images/a.lock"))
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
fn image_users_and_removals_do_not_wait_past_their_bound() {
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
    for bound in [&["--no-wait"][..], &["--wait", "0.2"]] {
        let out = env.run(["rm", "a"].iter().chain(bound));
        assert_eq!(out.status.code(), Some(75), "{bound:?}: {}", show(&out));
        assert!(
            stderr(&out).contains("store-wide command"),
            "{}",
            show(&out)
        );
        assert_eq!(env.state("a").as_deref(), Some("ready"));
    }
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

/// A hold waiting for one image's user stops new users of every image, not
/// only of those it has reached: images `a` and `b` are both in use, the
/// hold waits for the first it lists, the other's user ends, and a new user
/// of that other image then waits for the hold instead of running first.
/// Before, the hint was set on each lock file only when the hold's turn
/// came to it, so the late user ran at once and the hold waited for it.
#[test]
fn a_waiting_hold_stops_new_users_of_images_it_has_not_reached() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    let user_a = env.hold_until(&["--read", "a"], "a-user", "a-go");
    let user_b = env.hold_until(&["--read", "b"], "b-user", "b-go");
    let wide = store_wide_hold(&env, "wide", "wide-go");
    wait_until("the hold waits for 'a' or 'b'", || {
        flock_waited_on(&env.lock_file("a")) || flock_waited_on(&env.lock_file("b"))
    });
    // The image the hold waits for stays in use; the other one's user ends.
    let (waited, other, other_user) = if flock_waited_on(&env.lock_file("a")) {
        ("a", "b", user_b)
    } else {
        ("b", "a", user_a)
    };
    env.release(&format!("{other}-go"));
    assert_eq!(code(&other_user.finish()), Some(0));
    let mut late = env.spawn([
        "exec",
        "--read",
        other,
        "--",
        "sh",
        "-c",
        &format!("test -e '{}'", env.sentinel("wide").display()),
    ]);
    wait_until("the late user waits for the store or has run", || {
        flock_waited_on(&store_lock(&env)) || !late.is_running()
    });
    assert!(
        flock_waited_on(&store_lock(&env)),
        "a new user of '{other}' did not wait for the hold waiting for '{waited}'"
    );
    env.release(&format!("{waited}-go"));
    wait_for_file(&env.sentinel("wide"));
    env.release("wide-go");
    assert_eq!(code(&wide.finish()), Some(0));
    let out = late.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stderr(&out).contains("waiting for the store-wide command to finish"),
        "{}",
        show(&out)
    );
}

/// A hold killed once it has hinted every lock file, before it waits for
/// any (or while it waits): nothing stays held; every image is read and
/// written at once, without waiting.
#[test]
fn a_hold_killed_after_hinting_every_image_blocks_nobody() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    let (hold, _go) = env.paused(["exec", "--store-wide", "--", "true"], "store-wide-hinted");
    hold.kill_all();
    let user = env.hold(&["--read", "a"], "a-user");
    let waiting = store_wide_hold(&env, "wide", "never");
    wait_until("the second hold waits for 'a'", || {
        flock_waited_on(&env.lock_file("a"))
    });
    waiting.kill_all();
    for image in ["a", "b"] {
        env.ok(["exec", "--no-wait", "--read", image, "--", "true"]);
    }
    env.release("release");
    assert_eq!(code(&user.finish()), Some(0));
    for image in ["a", "b"] {
        env.ok(["exec", "--no-wait", "--write", image, "--", "true"]);
    }
    env.ok(["doctor"]);
}

/// A store-wide command that makes the images directory anew (as `ch-image
/// reset` does) while another program holds the global lock for longer
/// than any bound: the new directory is recorded once the lock is free, and
/// the images it deleted are said and forgotten. Before, the record was
/// given up after 10 s, silently, exit 0, the deleted image left `ready`.
#[test]
fn a_remade_images_directory_is_recorded_once_the_global_lock_is_free() {
    let env = Env::new();
    env.make_image("a");
    let (img, started) = (env.root.join("img"), env.sentinel("global-held"));
    let global = env.root.join("locks/global.lock");
    let script = format!(
        "rm -rf '{img}' && mkdir '{img}' && setsid flock '{global}' sh -c 'touch {started}; sleep 11' </dev/null >/dev/null 2>&1 & \
         while [ ! -e '{started}' ]; do sleep 0.01; done",
        img = img.display(),
        global = global.display(),
        started = started.display()
    );
    let out = env.ok(["exec", "--store-wide", "--", "sh", "-c", &script]);
    let said = "image 'a' was deleted by the store-wide command";
    assert!(stderr(&out).contains(said), "{}", show(&out));
    assert!(env.image("a").is_none());
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

/// A store-wide command does not wait for slot holders (a slot guards no
/// image): it runs beside one, and an exec called by the slot holder's
/// command waits for it like any other, then goes ahead.
#[test]
fn a_store_wide_command_runs_beside_a_slot_holder_whose_nested_exec_waits_for_it() {
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
    wait_for_file(&env.sentinel("wide"));
    fs::write(&go, "").unwrap();
    wait_until("the nested exec waits for the store-wide command", || {
        flock_waited_on(&store_lock(&env))
    });
    assert!(!code.exists());
    env.release("wide-go");
    assert_eq!(wide.finish().status.code(), Some(0));
    let out = user.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(fs::read_to_string(&code).unwrap().trim(), "0");
}

/// A store-wide command deleted the trees of ready images, and its stowage
/// was killed before it forgot them: their records still say `ready`. The
/// next write of such a name, plain or `--from`, makes the tree anew and
/// succeeds; before, the builder got a directory that did not exist (or
/// the copy could not open it) and the image was left incomplete.
#[test]
fn a_write_of_an_image_whose_tree_a_killed_store_wide_command_deleted_makes_it_anew() {
    let env = Env::new();
    for name in ["base", "x", "y"] {
        env.make_image(name);
    }
    let out = env.run([
        "exec",
        "--store-wide",
        "--",
        "sh",
        "-c",
        "rm -rf \"$STOWAGE_IMAGES_DIR/x\" \"$STOWAGE_IMAGES_DIR/y\"; kill -9 $PPID",
    ]);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGKILL), "{}", show(&out));
    // Not asked through a listing, which would forget them.
    for name in ["x", "y"] {
        let record = String::from_utf8_lossy(&fs::read(env.lock_file(name)).unwrap()).into_owned();
        assert!(record.contains("state=ready"), "{name}: {record:?}");
        assert!(!env.root.join("img").join(name).exists(), "{name}");
    }
    env.build("x", "echo new > \"$STOWAGE_IMAGE_DIR/f\"");
    env.ok(["exec", "--write", "y", "--from", "base", "--", "true"]);
    for (name, file, text) in [("x", "f", "new\n"), ("y", "file", "content\n")] {
        assert_eq!(env.state(name).as_deref(), Some("ready"), "{name}");
        let got = fs::read_to_string(env.root.join("img").join(name).join(file)).unwrap();
        assert_eq!(got, text, "{name}");
    }
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

/// A removal without a bound waits for a store-wide command, as an image
/// user does, and removes once it ends; it was refused at once (75).
#[test]
fn a_removal_waits_for_a_store_wide_command_and_then_removes() {
    let env = Env::new();
    env.make_image("a");
    let wide = store_wide_hold(&env, "wide", "wide-go");
    wait_for_file(&env.sentinel("wide"));
    let rm = env.spawn(["rm", "a"]);
    wait_until("the removal waits for the store-wide command", || {
        flock_waited_on(&store_lock(&env))
    });
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    env.release("wide-go");
    assert_eq!(wide.finish().status.code(), Some(0));
    let out = rm.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        stderr(&out).contains("waiting for the store-wide command to finish"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("a"), None);
}

/// Repairs beside a store-wide hold leave what they would change: an
/// interrupted removal and a record whose tree is gone. doctor's repair
/// took a descriptor number its start had listed (its own listing of
/// /proc/self/fd) for one inherited from an enclosing hold, and so took
/// itself for part of the hold: it finished the removal and dropped the
/// record under the hold, and `gc --dry-run` said it would.
#[test]
fn repairs_beside_a_store_wide_command_leave_what_it_may_change() {
    let env = Env::new();
    env.make_image("doomed");
    env.make_image("vanished");
    let (rm, _pause) = env.paused(["rm", "doomed"], "rm-marked");
    rm.kill_all();
    fs::remove_dir_all(env.root.join("img/vanished")).unwrap();
    let wide = store_wide_hold(&env, "wide", "wide-go");
    wait_for_file(&env.sentinel("wide"));

    let out = env.ok(["gc", "--dry-run", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["busy"], serde_json::json!(["doomed"]), "{report}");
    assert_eq!(
        report["interrupted_removals"],
        serde_json::json!([]),
        "{report}"
    );
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("removal of 'doomed' was interrupted"),
        "{}",
        show(&out)
    );
    assert!(!text.contains("repaired"), "{}", show(&out));
    assert_eq!(env.state("doomed").as_deref(), Some("deleting"));
    assert!(env.root.join("img/doomed").exists());
    assert_eq!(env.state("vanished").as_deref(), Some("ready"));

    env.release("wide-go");
    assert_eq!(wide.finish().status.code(), Some(0));
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

// --- who is part of a hold ------------------------------------------------------

/// A descriptor of store.lock that holds no lock (a script opened it) does
/// not make its process part of a store-wide hold someone else runs.
#[test]
fn an_unlocked_descriptor_of_store_lock_is_no_store_wide_hold() {
    let env = Env::new();
    env.make_image("base");
    let hold = store_wide_hold(&env, "held", "release");
    wait_for_file(&env.sentinel("held"));
    for args in [
        "exec --write x --no-wait -- true",
        "exec --read base --no-wait -- true",
    ] {
        let out = output({
            let mut c = std::process::Command::new("sh");
            c.args([
                "-c",
                &format!(
                    "exec 9<>'{}'; '{}' --root '{}' {args}",
                    store_lock(&env).display(),
                    bin(),
                    env.root.display()
                ),
            ]);
            c
        });
        assert_eq!(code(&out), Some(75), "{args}: {}", show(&out));
    }
    assert_eq!(
        env.state("x"),
        None,
        "no image made beside the store-wide command"
    );
    env.release("release");
    let out = hold.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

#[test]
fn a_store_wide_command_waits_for_a_new_images_writer() {
    let env = Env::new();
    env.make_image("base");
    let writer = env.hold_until(&["--write", "app"], "w-started", "w-release");
    assert_eq!(env.state("app").as_deref(), Some("creating"));
    let out = env.run(["exec", "--store-wide", "--wait", "0.3", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    env.release("w-release");
    assert_eq!(code(&writer.finish()), Some(0));
    env.ok(["exec", "--store-wide", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// A writer of a deep tree under a small descriptor limit finishes while
/// a store-wide command waits for it: its outcome is recorded without
/// walking the tree, and the image is ready.
#[test]
fn a_deep_tree_written_under_a_small_descriptor_limit_beside_a_waiting_hold_is_ready() {
    let env = Env::new();
    env.make_image("a");
    let started = env.sentinel("started");
    let release = env.sentinel("release");
    let script = format!(
        "ulimit -n 30; exec '{bin}' --root '{root}' exec --write a -- sh -c 'cd \"$STOWAGE_IMAGE_DIR\"; i=0; while [ $i -lt 60 ]; do mkdir d; cd d; i=$((i+1)); done; touch {s}; i=0; while [ ! -e {r} ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done'",
        bin = bin(),
        root = env.root.display(),
        s = started.display(),
        r = release.display()
    );
    let mut c = std::process::Command::new("sh");
    c.args(["-c", &script]);
    let writer = Bg::from_command(c);
    wait_for_file(&started);
    let hold = env.spawn(["exec", "--store-wide", "--", "true"]);
    wait_until("the store-wide command waits for 'a'", || {
        flock_waited_on(&env.lock_file("a"))
    });
    env.release("release");
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = hold.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "a", "--", "true"]);
}

/// On a shared filesystem lock files are kept (never unlinked): an image
/// a store-wide command deleted is forgotten all the same, and not read.
#[test]
fn an_image_a_store_wide_command_deletes_on_a_shared_filesystem_is_not_read() {
    let env = Env::new();
    let on_nfs = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
        output(c)
    };
    for name in ["cache", "kept"] {
        let out = on_nfs(&["exec", "--write", name, "--", "true"]);
        assert_eq!(code(&out), Some(0), "{}", show(&out));
    }
    let out = on_nfs(&[
        "exec",
        "--store-wide",
        "--",
        "sh",
        "-c",
        "rm -r \"$STOWAGE_IMAGES_DIR/cache\"",
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(env.lock_file("cache").exists(), "the lock file is kept");
    assert_eq!(env.state("cache"), None);
    let out = on_nfs(&["exec", "--read", "cache", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    let out = on_nfs(&["exec", "--read", "kept", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

// --- images a hold deleted, and processes that outlive it ------------------------

/// A read from outside, stopped (by gdb) once it holds its image's lock
/// and found the store-wide hint, before it asks store.lock; meanwhile the
/// store-wide command deletes the image's tree and ends. The read must
/// find the image gone (66), not run its command on a tree that is not
/// there.
#[test]
fn a_read_does_not_run_on_an_image_a_store_wide_command_deleted_while_it_looked() {
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("keep");
    env.make_image("a");
    let go = env.sentinel("go");
    let hold_started = env.sentinel("hold-started");
    let hold = env.spawn([
        "exec",
        "--store-wide",
        "--",
        "sh",
        "-c",
        &format!(
            "touch '{}'; i=0; while [ ! -e '{}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; \
             rm -rf \"$STOWAGE_IMAGES_DIR/a\"",
            hold_started.display(),
            go.display()
        ),
    ]);
    wait_for_file(&hold_started);
    let at_probe = env.sentinel("at-probe");
    let cmds = env.sentinel("gdb-cmds");
    fs::write(
        &cmds,
        format!(
            "set pagination off\n\
             break stowage::store_wide::probe\n\
             run\n\
             delete\n\
             shell touch '{at}'; touch '{go}'; i=0; while [ -e '{started}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n\
             continue\n",
            at = at_probe.display(),
            go = go.display(),
            started = hold_started.display()
        ),
    )
    .unwrap();
    // The hold's sentinel goes once its command has deleted the tree and
    // stowage has ended the hold: the reader then goes on.
    let watcher = std::thread::spawn({
        let hold_started = hold_started.clone();
        move || {
            let out = hold.finish();
            let _ = fs::remove_file(&hold_started);
            out
        }
    });
    let c = stowage_under_gdb(
        &env,
        &cmds,
        [
            "exec",
            "--read",
            "a",
            "--",
            "sh",
            "-c",
            "test -d \"$STOWAGE_IMAGES_DIR/a\" || exit 9",
        ],
    );
    let out = output(c);
    let hold_out = watcher.join().unwrap();
    assert_eq!(code(&hold_out), Some(0), "{}", show(&hold_out));
    assert!(
        at_probe.exists(),
        "the read never asked store.lock: {}",
        show(&out)
    );
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &stderr(&out);
    // gdb says exit codes in octal: 66 is 0102 (the command's 9, 011).
    assert!(
        said.contains("image 'a' does not exist") && said.contains("exited with code 0102"),
        "the read must find the image gone (66), not run on it: {}",
        show(&out)
    );
}

/// An exclusive read started in the background by a store-wide command
/// that deleted the image's tree, still running when the store-wide
/// command ends: the image is forgotten all the same, and not read.
#[test]
fn an_exclusive_read_outliving_a_store_wide_command_cannot_revive_an_image_it_deleted() {
    let env = Env::new();
    env.make_image("keep");
    env.make_image("base");
    let started = env.sentinel("rx-started");
    let done = env.sentinel("rx-done");
    let release = env.sentinel("rx-release");
    let script = format!(
        "rm -rf \"$STOWAGE_IMAGES_DIR/base\"; \
         ('{bin}' --root '{root}' exec --read-exclusive base -- sh -c \
            \"touch '{started}'; i=0; while [ ! -e '{release}' ] && [ \\$i -lt 1200 ]; do sleep 0.05; i=\\$((i+1)); done\" \
          ; touch '{done}') >/dev/null 2>&1 </dev/null & \
         i=0; while [ ! -e '{started}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; [ -e '{started}' ]",
        bin = bin(),
        root = env.root.display(),
        started = started.display(),
        release = release.display(),
        done = done.display()
    );
    let out = env.run(["exec", "--store-wide", "--", "sh", "-c", &script]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    fs::write(&release, "").unwrap();
    wait_for_file(&done);
    // The hold lasts while the subshell that touched `done` keeps its inherited descriptor.
    wait_until(
        "'base' forgotten: the store-wide command deleted it",
        || env.state("base").is_none(),
    );
    env.assert_read_refused("base", "a read ran on an image that has no tree");
}

/// A reader nested in a store-wide command, stopped (by gdb) just before
/// its command runs; meanwhile the store-wide command deletes the image's
/// tree and ends. The image is forgotten all the same, and not read.
#[test]
fn a_reader_inside_a_store_wide_command_cannot_revive_an_image_it_deleted() {
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("keep");
    env.make_image("base");
    let paused = env.sentinel("reader-paused");
    let hold_done = env.sentinel("hold-done");
    let done = env.sentinel("reader-done");
    let gdb_cmds = env.sentinel("gdb-cmds");
    fs::write(
        &gdb_cmds,
        format!(
            "set pagination off\n\
             break stowage::session::Session::set_inheritable\n\
             run\n\
             delete\n\
             shell touch '{paused}'; i=0; while [ ! -e '{hold_done}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n\
             continue\n",
            paused = paused.display(),
            hold_done = hold_done.display(),
        ),
    )
    .unwrap();
    let script = format!(
        "rm -rf \"$STOWAGE_IMAGES_DIR/base\"; \
         (gdb -q -batch -x '{cmds}' --args '{bin}' --root '{root}' exec --read base -- true \
           >'{log}' 2>&1 </dev/null; touch '{done}') >/dev/null 2>&1 </dev/null & \
         i=0; while [ ! -e '{paused}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; [ -e '{paused}' ]",
        cmds = gdb_cmds.display(),
        bin = bin(),
        root = env.root.display(),
        log = env.sentinel("gdb.log").display(),
        done = done.display(),
        paused = paused.display()
    );
    let out = env.run(["exec", "--store-wide", "--", "sh", "-c", &script]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    fs::write(&hold_done, "").unwrap();
    wait_for_file(&done);
    let log = fs::read_to_string(env.sentinel("gdb.log")).unwrap_or_default();
    assert!(
        log.contains("Breakpoint 1, "),
        "the reader never started: {log}"
    );
    assert_eq!(
        env.state("base"),
        None,
        "the store-wide command deleted 'base'"
    );
    env.assert_read_refused("base", "a read ran on an image that has no tree");
}

/// A writer started in the background by a store-wide command removes its
/// image's tree (a builder rebuilding from scratch) while the store-wide
/// command ends, then makes it again and exits 0: the write that ended
/// well is the image, ready with what it made.
#[test]
fn a_write_outliving_a_store_wide_command_that_deleted_its_tree_is_the_image() {
    let env = Env::new();
    env.make_image("keep");
    env.make_image("base");
    let started = env.sentinel("w-started");
    let go = env.sentinel("w-go");
    let done = env.sentinel("w-done");
    let script = format!(
        "('{bin}' --root '{root}' exec --write base -- sh -c \
            \"rm -rf \\\"\\$STOWAGE_IMAGE_DIR\\\"; touch '{started}'; \
              i=0; while [ ! -e '{go}' ] && [ \\$i -lt 1200 ]; do sleep 0.05; i=\\$((i+1)); done; \
              mkdir \\\"\\$STOWAGE_IMAGE_DIR\\\"; echo new > \\\"\\$STOWAGE_IMAGE_DIR/file\\\"\" \
          ; echo $? > '{done}') >/dev/null 2>&1 </dev/null & \
         i=0; while [ ! -e '{started}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; [ -e '{started}' ]",
        bin = bin(),
        root = env.root.display(),
        started = started.display(),
        go = go.display(),
        done = done.display()
    );
    let out = env.run(["exec", "--store-wide", "--", "sh", "-c", &script]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("base").as_deref(), Some("writing"));
    fs::write(&go, "").unwrap();
    // The shell makes the file before it writes the status into it.
    wait_until("the writer's status is written", || {
        fs::read_to_string(&done).is_ok_and(|t| t.ends_with('\n'))
    });
    assert_eq!(fs::read_to_string(&done).unwrap().trim(), "0");
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("base", "file"), "new\n");
    env.ok(["doctor"]);
}

/// A store-wide command makes a new image (an import inside the hold): a
/// read of it from outside, while the store-wide command still runs,
/// waits for the command (here: is refused, with `--no-wait`), as a read
/// of any other image does.
#[test]
fn a_read_of_an_image_made_inside_a_store_wide_command_waits_for_it() {
    let env = Env::new();
    env.make_image("keep");
    let started = env.sentinel("sw-started");
    let release = env.sentinel("sw-release");
    let script = format!(
        "'{bin}' --root '{root}' exec --write new -- true || exit 9; touch '{started}'; \
         i=0; while [ ! -e '{release}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done",
        bin = bin(),
        root = env.root.display(),
        started = started.display(),
        release = release.display()
    );
    let sw = env.spawn(["exec", "--store-wide", "--", "sh", "-c", &script]);
    wait_for_file(&started);
    let out = env.run([
        "exec",
        "--read",
        "new",
        "--no-wait",
        "--",
        "sh",
        "-c",
        &format!(
            "if [ -e '{}' ]; then echo after; else echo during; fi",
            release.display()
        ),
    ]);
    fs::write(&release, "").unwrap();
    let sw_out = sw.finish();
    assert_eq!(code(&sw_out), Some(0), "{}", show(&sw_out));
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("during"),
        "a read ran beside a store-wide command it is not part of: {}",
        show(&out)
    );
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    env.ok(["exec", "--read", "new", "--no-wait", "--", "true"]);
}

/// `exec --store-wide` (keeping its hold in a keeper with `--no-inherit`,
/// or not) whose command scrubs its environment (`env -i`, sudo) and then
/// reads an image: the nested read cannot learn from its environment that
/// it runs inside the hold, and must not wait for the store-wide command
/// that waits for it.
#[test]
fn a_read_inside_a_store_wide_command_with_a_clean_environment_does_not_hang() {
    let env = Env::new();
    env.make_image("keep");
    env.make_image("base");
    for keeper in [&["--no-inherit"][..], &[]] {
        let script = format!(
            "env -i '{bin}' --root '{root}' exec --read base -- true; echo \"read=$?\"",
            bin = bin(),
            root = env.root.display(),
        );
        let mut args = vec!["exec", "--store-wide"];
        args.extend(keeper);
        args.extend(["--", "sh", "-c", &script]);
        let out = env.run(args);
        assert_eq!(code(&out), Some(0), "{keeper:?}: {}", show(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("read=0"),
            "{keeper:?}: {}",
            show(&out)
        );
    }
}

/// The same for a repair of a damaged catalog: it rebuilds the catalog
/// from the records, and waits for no image lock or store-wide hold.
#[test]
fn a_rebuild_inside_a_store_wide_command_with_a_clean_environment_does_not_hang() {
    let env = Env::new();
    env.make_image("keep");
    env.make_image("base");
    let script = format!(
        "printf 'ZZZZZZZZ%.0s' $(seq 1024) > '{db}'; \
         env -i '{bin}' --root '{root}' doctor --repair >/dev/null; echo \"repair=$?\"",
        bin = bin(),
        root = env.root.display(),
        db = env.root.join("stowage.db").display(),
    );
    let out = env.run([
        "exec",
        "--store-wide",
        "--no-inherit",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("repair=0"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.state("keep").as_deref(), Some("ready"));
}

/// A store-wide command's background job inherits `store.lock`, as an
/// image lock is inherited: the hold lasts until it ends too, for
/// existing images and new ones alike.
#[test]
fn a_store_wide_commands_background_job_keeps_the_store_held() {
    let env = Env::new();
    env.make_image("a");
    let done = env.sentinel("bg-done");
    let out = env.run([
        "exec",
        "--store-wide",
        "--",
        "sh",
        "-c",
        &format!("(sleep 1; touch '{}') >/dev/null 2>&1 &", done.display()),
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    for (image, seen) in [("a", "a-saw"), ("brandnew", "new-saw")] {
        let saw = env.sentinel(seen);
        let out = env.run([
            "exec",
            "--write",
            image,
            "--",
            "sh",
            "-c",
            &format!("test -e '{}' && touch '{}'", done.display(), saw.display()),
        ]);
        assert_eq!(code(&out), Some(0), "{}", show(&out));
        assert!(
            saw.exists(),
            "{image}'s writer ran only after the job ended"
        );
    }
}

/// doctor --repair clears stale store-wide hints one image at a time, each
/// under the image's lock after asking `store.lock` again: a hold that
/// begins meanwhile keeps its hints, and a writer of an image still waits
/// for it.
#[test]
fn a_repair_clearing_stale_hints_leaves_a_new_holds_hints_alone() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    // A hold that died: its hints stand, store.lock free.
    let holder = env.spawn(["exec", "--store-wide", "--", "sleep", "60"]);
    wait_until("the hold hints b", || {
        fs::read(env.lock_file("b")).is_ok_and(|b| b.get(8193).is_some_and(|&h| h != 0))
    });
    holder.kill_all();
    let (doctor, go) = env.paused(["doctor", "--repair"], "doctor-hint-cleared");
    let started = env.sentinel("sw-started");
    let hold = env.spawn([
        "exec",
        "--store-wide",
        "--",
        "sh",
        "-c",
        &format!("touch '{}'; sleep 60", started.display()),
    ]);
    wait_for_file(&started);
    fs::remove_file(&go).unwrap();
    let _ = doctor.finish();
    for image in ["a", "b"] {
        let out = env.run(["exec", "--write", image, "--no-wait", "--", "true"]);
        assert_eq!(code(&out), Some(75), "{image}: {}", show(&out));
    }
    hold.kill_all();
}

/// A store-wide command that mounts a filesystem over the images directory
/// (another one, or another directory of the same one bound there) has not
/// deleted the trees it hides: they are kept (only a directory made anew
/// on the same filesystem, as `ch-image reset` makes it, is taken for the
/// images directory).
#[test]
fn a_filesystem_mounted_over_the_images_directory_by_a_store_wide_command_forgets_nothing() {
    if !root_or_skip("mounting") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    let img = env.root.join("img");
    let img = img.to_str().unwrap();
    let other = env.tmp.path().join("other");
    fs::create_dir(&other).unwrap();
    let other = other.to_str().unwrap();
    for mount in [&["-t", "tmpfs", "none"][..], &["--bind", other]] {
        let mut args = vec!["exec", "--store-wide", "--", "mount"];
        args.extend(mount);
        args.push(img);
        let out = env.run(&args);
        let unmounted = std::process::Command::new("umount")
            .arg(img)
            .status()
            .unwrap();
        assert!(unmounted.success());
        assert_eq!(code(&out), Some(0), "{}", show(&out));
        assert_eq!(
            env.state("a").as_deref(),
            Some("ready"),
            "{mount:?}: {}",
            show(&out)
        );
        env.ok(["exec", "--read", "a", "--", "true"]);
    }
}

/// A store-wide command that deletes the images directory and makes it
/// again (as `ch-image reset` does; on ext4 the new one often gets the old
/// one's inode number) has deleted the trees in it: their images are
/// forgotten. One that moves the directory away and makes another has
/// deleted nothing: every image is kept, and no new one is made in the
/// directory made in their place (hidden once they are moved back).
#[test]
fn an_images_directory_deleted_and_made_again_is_told_from_one_moved_away() {
    for (script, kept) in [
        (
            "rm -rf \"$STOWAGE_IMAGES_DIR\" && mkdir \"$STOWAGE_IMAGES_DIR\"",
            false,
        ),
        (
            "mv \"$STOWAGE_IMAGES_DIR\" \"$STOWAGE_IMAGES_DIR.old\" && mkdir \"$STOWAGE_IMAGES_DIR\"",
            true,
        ),
    ] {
        let env = Env::new();
        env.make_image("a");
        let out = env.ok(["exec", "--store-wide", "--", "sh", "-c", script]);
        let state = env.state("a");
        assert_eq!(state.is_some(), kept, "{script}: {state:?} {}", show(&out));
        if !kept {
            let read = env.run(["exec", "--read", "a", "--", "true"]);
            assert_eq!(code(&read), Some(66), "{}", show(&read));
        }
        // Beside trees moved away, a new one would be lost once they are back.
        let out = env.run(["exec", "--write", "b", "--", "true"]);
        let refused = stderr(&out).contains("not the directory recorded");
        assert_eq!(code(&out), Some(if kept { 1 } else { 0 }), "{}", show(&out));
        assert_eq!(refused, kept, "{script}: {}", show(&out));
    }
}

/// A store-wide command that gives up waiting (its command never run)
/// takes its hints off every image nobody holds before it lets go, even
/// with users waiting to take the store the moment it does: an image whose
/// tree is missing is still listed, not forgotten as one the command may
/// have deleted. Before, the users took the store first, every hint stayed,
/// and the next look forgot the image.
#[test]
fn a_hold_that_gives_up_leaves_no_hint_to_forget_an_image_by() {
    let env = Env::new();
    for name in ["a", "b", "gone"] {
        env.make_image(name);
    }
    fs::remove_dir_all(env.root.join("img/gone")).unwrap();
    let holder = env.hold(&["--read", "a"], "started");
    let hold = env.spawn(["exec", "--store-wide", "--wait", "1", "--", "true"]);
    wait_until("the store-wide command waits for 'a'", || {
        flock_waited_on(&env.lock_file("a"))
    });
    let readers: Vec<Bg> = (0..3)
        .map(|_| env.spawn(["exec", "--read", "b", "--", "true"]))
        .collect();
    let out = hold.finish();
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    for r in readers {
        assert_eq!(code(&r.finish()), Some(0));
    }
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
    env.ok(["images"]);
    assert!(env.image("gone").is_some(), "the image was forgotten");
}
