//! Reads and slot holders that write no metadata (their leases name them),
//! attacked with real processes: what gc may conclude from a last use that
//! a read no longer records every time.

use crate::common::*;

/// `stowage ARGS…` with the clock fixed at `now` (RFC 3339).
fn at(env: &Env, now: &str, args: &[&str]) -> std::process::Output {
    let mut c = env.cmd(args);
    c.env("STOWAGE_NOW", now);
    output(c)
}

fn ok_at(env: &Env, now: &str, args: &[&str]) -> std::process::Output {
    let out = at(env, now, args);
    assert_eq!(out.status.code(), Some(0), "stowage failed: {}", show(&out));
    out
}

/// A read within a few minutes of the recorded last use records nothing
/// (its image's last use is fresh enough): gc --unused-for shorter than
/// that must still not take the image for unused, since it was used a
/// moment ago.
#[test]
fn gc_unused_for_keeps_an_image_read_since_its_recorded_last_use() {
    let env = Env::new();
    ok_at(
        &env,
        "2026-01-01T00:00:00Z",
        &["exec", "--write", "base", "--", "true"],
    );
    // Read four minutes later: the recorded last use (00:00) is fresh
    // enough, so the read writes nothing.
    ok_at(
        &env,
        "2026-01-01T00:04:00Z",
        &["exec", "--read", "base", "--", "true"],
    );
    // One minute after that read, the image has not been unused for two.
    let out = ok_at(&env, "2026-01-01T00:05:00Z", &["gc", "--unused-for", "2m"]);
    assert!(
        env.root.join("img/base").is_dir(),
        "gc removed an image read a minute ago as unused for 2m: {}",
        show(&out)
    );
    let images = String::from_utf8_lossy(&ok_at(&env, "2026-01-01T00:05:00Z", &["images"]).stdout)
        .into_owned();
    assert!(images.contains("base"), "{images}");
    // Really unused for long: it goes (the test can fail).
    let out = ok_at(&env, "2026-01-01T01:00:00Z", &["gc", "--unused-for", "2m"]);
    assert!(
        !env.root.join("img/base").exists(),
        "an image unused for an hour is removed: {}",
        show(&out)
    );
}

/// A reader writes no record; its lease names it. A command that closes
/// every descriptor it inherited but its image lock (closefrom) leaves the
/// lease to stowage alone: once stowage is SIGKILLed the lease is dead
/// while the command still holds the image. The reader must still be named
/// (as the holder record of a writer is, see `leases::`), on every look,
/// and its dead lease go once the lock is released.
#[test]
fn a_reader_whose_command_closes_its_lease_stays_named_after_stowage_dies() {
    let env = Env::new();
    env.make_image("app");
    let started = env.sentinel("started");
    let release = env.sentinel("release");
    let script = format!(
        "for fd in /proc/$$/fd/*; do case $(readlink \"$fd\") in */locks/leases/*) eval \"exec ${{fd##*/}}>&-\";; esac; done; \
         touch '{s}'; i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
        s = started.display(),
        r = release.display()
    );
    let mut bg = env.spawn([
        "exec",
        "--read",
        "app",
        "--",
        "bash",
        "-c",
        &script,
        "closes-its-lease",
    ]);
    wait_for_file(&started);
    let stowage = bg.pid();
    bg.signal(libc::SIGKILL);
    let _ = bg.child.as_mut().unwrap().wait();
    assert!(!flock_free(&env.lock_file("app")), "the command holds it");
    // Every look names it (a look must not clean away what names it).
    for look in 0..3 {
        let entry = env.lock_entry("app").unwrap();
        let holders = entry["holders"].as_array().unwrap();
        assert_eq!(holders.len(), 1, "look {look}: {entry:#}");
        assert_eq!(
            holders[0]["stowage"], true,
            "look {look}: not an outsider: {entry:#}"
        );
        assert_eq!(holders[0]["pid"], stowage, "look {look}: {entry:#}");
        assert!(
            holders[0]["command"]
                .as_str()
                .is_some_and(|c| c.contains("closes-its-lease")),
            "look {look}: the reader's command: {entry:#}"
        );
        assert_eq!(entry["state"], "shared", "{entry:#}");
        env.ok(["images"]);
    }
    env.release("release");
    wait_until("the command released the image lock", || {
        flock_free(&env.lock_file("app"))
    });
    let entry = env.lock_entry("app").unwrap();
    assert!(entry["holders"].as_array().unwrap().is_empty(), "{entry:#}");
    // The dead lease explains nothing now: it goes.
    env.ok(["lock-status"]);
    let left: Vec<_> = std::fs::read_dir(env.root.join("locks/leases"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "dead leases left: {left:?}");
    bg.kill_all();
}

/// The empty directory of a new image whose writer failed goes at the
/// finish — but not while a process of the failed command's tree that
/// inherited the write lock (a background job) still works in it: what it
/// writes there afterwards must not be lost with an unlinked directory.
#[test]
fn a_failed_writers_surviving_child_keeps_the_new_image_directory() {
    let env = Env::new();
    let go = env.sentinel("go");
    let done = env.sentinel("done");
    // The command enters the fresh (empty) directory, leaves a background
    // job there that holds the inherited write lock, and fails at once.
    let script = format!(
        "cd \"$STOWAGE_IMAGE_DIR\" || exit 9; \
         ( i=0; while [ ! -e '{g}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done; \
           echo late > written-late; touch '{d}' ) >/dev/null 2>&1 & exit 1",
        g = go.display(),
        d = done.display()
    );
    let out = env.run(["exec", "--write", "app", "--", "sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    std::fs::write(&go, "").unwrap();
    wait_for_file(&done);
    assert!(
        env.root.join("img/app/written-late").is_file(),
        "the surviving writer's file is in the image directory: {:?}",
        tree(&env.root.join("img"))
    );
    // Without a survivor, the empty directory still goes (the test can
    // fail the other way).
    let out = env.run(["exec", "--write", "other", "--", "false"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(!env.root.join("img/other").exists());
    let out = env.run(["exec", "--no-inherit", "--write", "third", "--", "false"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(!env.root.join("img/third").exists());
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
