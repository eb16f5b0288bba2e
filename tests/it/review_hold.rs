//! Adversarial checks of the holds around `locks/store.lock`: a repair
//! (`doctor --repair`) that waits for new images' writers, `init
//! --images-dir` that tries it, and nested calls that ask whether they run
//! inside a store-wide hold (`lock::inherited_exclusive`).

use crate::common::*;

/// `sh -c` text that touches `started`, waits (bounded) for `go`, then runs
/// `stowage ARGS` and prints its exit status as `tag=N`.
fn then_stowage(env: &Env, started: &str, go: &str, args: &str, tag: &str) -> String {
    format!(
        "touch '{s}'; i=0; while [ ! -e '{g}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done; \
         '{b}' --root '{r}' {args}; echo \"{tag}=$?\"",
        s = env.sentinel(started).display(),
        g = env.sentinel(go).display(),
        b = bin(),
        r = env.root.display(),
    )
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A repair in the command of an exec that holds an image lock (`locks`)
/// while a new image's writer (which holds store.lock shared) waits, in
/// its command, for that image lock (`nested`): the repair must not wait
/// for the writer, who waits for the repair's exec, who waits for the
/// repair.
fn repair_inside_an_image_user(locks: &[&str], nested: &[&str]) {
    let env = Env::new();
    env.make_image("x");
    let mut args = vec!["exec"];
    args.extend(locks);
    let script = then_stowage(&env, "user", "go", "doctor --repair", "repair");
    args.extend(["--", "sh", "-c", &script]);
    let mut user = env.spawn(args);
    wait_for_file(&env.sentinel("user"));
    let nested = nested.join(" ");
    let writer = env.spawn([
        "exec",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        &format!(
            "touch \"$STOWAGE_IMAGE_DIR/file\"; '{}' --root '{}' exec {nested} -- true",
            bin(),
            env.root.display()
        ),
    ]);
    wait_until("the new image's writer runs", || env.marker("app").exists());
    env.wait_for_waiter("x");
    std::fs::write(env.sentinel("go"), "").unwrap();
    let store_lock = env.root.join("locks/store.lock");
    wait_until("the repair ends or waits for store.lock", || {
        !user.is_running() || flock_waited_on(&store_lock)
    });
    assert!(
        !flock_waited_on(&store_lock),
        "the repair waits for the new image's writer, which waits for the repair's exec: a deadlock"
    );
    let out = user.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(stdout(&out).contains("repair=75"), "{}", show(&out));
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn a_repair_inside_a_reader_does_not_wait_for_a_new_images_writer_waiting_for_it() {
    repair_inside_an_image_user(&["--read", "x"], &["--write", "x"]);
}

#[test]
fn a_repair_inside_a_writer_does_not_wait_for_a_new_images_writer_waiting_for_it() {
    repair_inside_an_image_user(&["--write", "x"], &["--read", "x"]);
}

#[test]
fn a_repair_inside_a_no_inherit_writer_does_not_wait_for_a_new_images_writer_waiting_for_it() {
    repair_inside_an_image_user(&["--no-inherit", "--write", "x"], &["--read", "x"]);
}

/// A descriptor of store.lock that holds no lock (a script opened it) does
/// not make its process part of a store-wide hold someone else runs: the
/// kernel, which lists every flock in /proc/self/fdinfo, lists none of its.
#[test]
fn an_unlocked_descriptor_of_store_lock_is_no_store_wide_hold() {
    let env = Env::new();
    env.make_image("base");
    let hold = env.hold(&["--store-wide"], "held");
    let store_lock = env.root.join("locks/store.lock");
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
                    store_lock.display(),
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

/// A repair waiting for a new image's writer is not starved by new images
/// written meanwhile: flock(2) grants a shared lock beside a waiting
/// exclusive request, so a writer that came after the repair would hold
/// store.lock past the first one's end, and so on for good. While the
/// repair waits, a new image goes the database's way, which the repair
/// does not wait for.
#[test]
fn a_repair_waiting_for_new_images_writers_is_not_starved_by_new_ones() {
    let env = Env::new();
    env.make_image("base");
    let first = env.hold_until(&["--write", "one"], "one", "release-one");
    assert!(env.marker("one").exists(), "written without the database");
    let repair = env.spawn(["doctor", "--repair"]);
    let store_lock = env.root.join("locks/store.lock");
    wait_until("the repair waits for the first writer", || {
        flock_waited_on(&store_lock)
    });
    let second = env.hold_until(&["--write", "two"], "two", "release-two");
    assert!(
        !env.marker("two").exists(),
        "a new image written while a repair waits goes the database's way"
    );
    env.release("release-one");
    let out = first.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    // The second writer still runs: the repair does not wait for it.
    let out = repair.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.release("release-two");
    let out = second.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("one").as_deref(), Some("ready"));
    assert_eq!(env.state("two").as_deref(), Some("ready"));
    env.ok(["doctor"]);
}

/// The same for a store-wide command waiting for store.lock: a new image
/// started meanwhile goes the database's way, and the hold, once it has
/// the store, waits for that one writer and refuses any later start.
#[test]
fn a_store_wide_command_waiting_for_new_images_writers_is_not_starved_by_new_ones() {
    let env = Env::new();
    env.make_image("base");
    let first = env.hold_until(&["--write", "one"], "one", "release-one");
    assert!(env.marker("one").exists(), "written without the database");
    let hold = env.spawn(["exec", "--store-wide", "--", "true"]);
    let store_lock = env.root.join("locks/store.lock");
    wait_until("the store-wide command waits for the first writer", || {
        flock_waited_on(&store_lock)
    });
    let second = env.hold_until(&["--write", "two"], "two", "release-two");
    assert!(
        !env.marker("two").exists(),
        "a new image written while a store-wide command waits goes the database's way"
    );
    env.release("release-one");
    let out = first.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    // Now the hold has the store and waits for the second writer's image
    // lock; a third new image is refused while it waits.
    wait_until("the store-wide command holds the store", || {
        env.status_json(["--all"])["locks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| {
                l["kind"] == "global"
                    && l["name"] == "store"
                    && l["holders"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|h| h["mode"] == "exclusive")
            })
    });
    let third = env.run(["exec", "--write", "three", "--no-wait", "--", "true"]);
    assert_eq!(code(&third), Some(75), "{}", show(&third));
    env.release("release-two");
    let out = second.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = hold.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("two").as_deref(), Some("ready"));
    assert_eq!(env.state("three"), None);
}

/// lock-status names a repair waiting for a new image's writer as a
/// stowage process with its command (its lease lists the wait: no record
/// does), not as a lock taken outside stowage.
#[test]
fn lock_status_names_a_waiting_repair() {
    let env = Env::new();
    env.make_image("base");
    let writer = env.hold(&["--write", "app"], "started");
    assert!(env.marker("app").exists(), "written without the database");
    let repair = env.spawn(["doctor", "--repair"]);
    let store_lock = env.root.join("locks/store.lock");
    wait_until("the repair waits for the writer", || {
        flock_waited_on(&store_lock)
    });
    let status = env.status_json(["--all"]);
    let store = status["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "global" && l["name"] == "store")
        .cloned()
        .expect("store.lock is shown");
    let waiters = store["waiters"].as_array().unwrap();
    assert_eq!(waiters.len(), 1, "{store}");
    assert_eq!(waiters[0]["pid"], repair.pid(), "{store}");
    assert_eq!(waiters[0]["stowage"], true, "{store}");
    assert!(
        waiters[0]["command"]
            .as_str()
            .is_some_and(|c| c.contains("doctor --repair")),
        "{store}"
    );
    // The waiting repair holds nothing that gc or rm needs.
    env.ok(["gc"]);
    env.ok(["rm", "--no-wait", "base"]);
    assert_eq!(env.state("base"), None);
    env.release("release");
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = repair.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// A repair waiting for a new image's writer ends on SIGTERM or SIGINT as
/// the shell expects (143, 130), and the gate it held while waiting keeps
/// no later new image from its way without the database.
#[test]
fn a_waiting_repair_ends_on_a_signal_and_leaves_the_gate_open() {
    use std::os::unix::process::ExitStatusExt;
    let env = Env::new();
    env.make_image("base");
    let writer = env.hold(&["--write", "app"], "started");
    assert!(env.marker("app").exists(), "written without the database");
    let store_lock = env.root.join("locks/store.lock");
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let repair = env.spawn(["doctor", "--repair"]);
        wait_until("the repair waits for the writer", || {
            flock_waited_on(&store_lock)
        });
        repair.signal(sig);
        let out = repair.finish();
        assert!(
            out.status.signal() == Some(sig) || code(&out) == Some(128 + sig),
            "signal {sig}: {}",
            show(&out)
        );
    }
    env.ok(["exec", "--write", "next", "--", "true"]);
    assert!(
        env.marker("next").exists(),
        "a new image after the repair went goes without the database"
    );
    env.release("release");
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.state("next").as_deref(), Some("ready"));
}

/// `init` without `--images-dir`, or naming the images directory already
/// in use, takes no store.lock: it runs while another program holds it
/// exclusively (and beside a new image's writer, which holds it shared).
#[test]
fn init_without_a_switch_takes_no_store_lock() {
    let env = Env::new();
    env.ok(["init"]);
    let images = env.images_dir();
    let store_lock = env.root.join("locks/store.lock");
    let holder = flock_holder(&store_lock, &env.sentinel("held"), "sleep 60");
    env.ok(["init"]);
    env.ok(["init", "--images-dir", images.to_str().unwrap()]);
    holder.kill_all();
    let writer = env.hold(&["--write", "app"], "started");
    assert!(env.marker("app").exists(), "written without the database");
    env.ok(["init"]);
    env.release("release");
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// A repair in the command of a new image's writer with `--no-inherit`,
/// run in another pid namespace: it inherits no descriptor and sees
/// neither the exec nor its keeper among its ancestors, yet the writer
/// whose store.lock it would wait for waits for it. It refuses (75).
#[test]
fn a_repair_in_another_pid_namespace_under_a_no_inherit_writer_does_not_wait_for_it() {
    if !root_or_skip("a pid namespace") || !have("unshare") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let mut writer = env.spawn([
        "exec",
        "--no-inherit",
        "--write",
        "app",
        "--",
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        "sh",
        "-c",
        &format!(
            "touch \"$STOWAGE_IMAGE_DIR/file\"; '{}' --root '{}' doctor --repair; echo \"repair=$?\"",
            bin(),
            env.root.display()
        ),
    ]);
    let store_lock = env.root.join("locks/store.lock");
    wait_until("the writer ends or the repair waits for store.lock", || {
        !writer.is_running() || flock_waited_on(&store_lock)
    });
    assert!(
        !flock_waited_on(&store_lock),
        "the repair waits for the writer that waits for it"
    );
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(stdout(&out).contains("repair=75"), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}
