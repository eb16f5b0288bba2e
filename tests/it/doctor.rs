//! `stowage doctor` and `doctor --repair`: what they report (the
//! filesystem, flock, rows, trees, leftovers, holds probed from other hosts),
//! a damaged database rebuilt without losing an image (also when the rebuild
//! is killed, and under a process that had it open), and a user who may not
//! write the store told so.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use crate::common::*;

#[test]
fn doctor_finds_and_repairs_inconsistencies() {
    let env = Env::new();
    env.make_image("ok");
    env.make_image("vanished");
    fs::remove_dir_all(env.root.join("img/vanished")).unwrap();
    fs::create_dir_all(env.root.join("img/stray+1/bin")).unwrap();
    fs::write(env.root.join("img/stray+1/bin/x"), "x").unwrap();
    fs::create_dir_all(env.root.join("trash/leftover/deep")).unwrap();
    let out = env.run(["doctor", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["healthy"], false);
    assert_eq!(report["locking"], true);
    let problems: Vec<&str> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "problem")
        .map(|c| c["check"].as_str().unwrap())
        .collect();
    assert_eq!(problems, ["rows", "trees", "leftovers"], "{report}");
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("vanished"), None);
    // Whether a tree found without its row is complete is not known.
    assert_eq!(env.state("stray:1").as_deref(), Some("incomplete"));
    assert_eq!(env.state("ok").as_deref(), Some("ready"));
    assert!(!env.root.join("trash/leftover").exists());
    env.ok(["doctor"]);
}

#[test]
fn doctor_reports_the_filesystem_and_flock() {
    let env = Env::new();
    // (On a root that does not exist doctor says so: make one.)
    env.ok(["init"]);
    let out = env.ok(["doctor", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["filesystem"].as_str().is_some_and(|f| !f.is_empty()));
    let flock = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "flock")
        .unwrap();
    assert_eq!(flock["status"], "ok");
    assert_eq!(report["healthy"], true);
    assert!(
        fs::read_dir(env.root.join("locks")).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains("doctor")),
        "its probe file is gone"
    );
    let _ = PermissionsExt::mode(&fs::metadata(&env.root).unwrap().permissions());
}

#[test]
fn doctor_by_a_user_who_may_not_write_the_store_says_so() {
    let Some(mut c) = as_nobody() else { return };
    let env = Env::new();
    env.make_image("a");
    fs::set_permissions(env.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    c.arg(bin()).arg("--root").arg(&env.root).arg("doctor");
    let out = output(c);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("may not write this store"),
        "{}",
        show(&out)
    );
    assert!(!stdout.contains("--repair"), "{}", show(&out));
    let mut c = as_nobody().unwrap();
    c.arg(bin()).arg("--root").arg(&env.root).arg("images");
    let out = output(c);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("may not write this store"),
        "{}",
        show(&out)
    );
    assert_eq!(stderr(&out).lines().count(), 1, "{}", show(&out));
}

#[test]
fn a_hold_probe_on_another_host_is_seen_by_doctor() {
    let env = Env::new();
    env.ok(["init"]);
    // Another "host": a new UTS and pid namespace (needs root).
    let ok = Command::new("unshare")
        .args(["--pid", "--fork", "--uts", "--mount-proc", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: cannot make a pid and UTS namespace (unshare needs root)");
        return;
    }
    let mut c = Command::new("unshare");
    c.args(["--pid", "--fork", "--uts", "--mount-proc", "sh", "-c"])
        .arg(format!(
            "hostname probe-host && exec '{bin}' --root '{root}' doctor --hold-probe 60",
            bin = bin(),
            root = env.root.display()
        ));
    let holder = Bg::from_command(c);
    let file = env.root.join("locks/probe.lock");
    wait_until("the probe is held", || {
        fs::read_to_string(&file).is_ok_and(|t| t.starts_with("probe-host")) && !flock_free(&file)
    });
    let out = env.run(["doctor"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("probe lock held on another host (host probe-host"),
        "{}",
        show(&out)
    );
    // The other host goes away: its lock goes with it.
    holder.kill_all();
    let out = env.run(["doctor"]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("probe"),
        "{}",
        show(&out)
    );
    // A probe on this host is told apart from one elsewhere.
    let here = env.spawn(["doctor", "--hold-probe", "60"]);
    wait_until("the probe is held here", || {
        fs::read_to_string(&file).is_ok_and(|t| !t.starts_with("probe-host")) && !flock_free(&file)
    });
    let out = env.run(["doctor"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("held on this host"),
        "{}",
        show(&out)
    );
    here.kill_all();
}

// --- a damaged database -----------------------------------------------------

#[test]
fn a_damaged_database_is_reported_and_rebuilt_without_losing_an_image() {
    let env = Env::new();
    let storage = env.tmp.path().join("storage/img");
    fs::create_dir_all(&storage).unwrap();
    env.ok(["init", "--images-dir", storage.to_str().unwrap()]);
    env.make_image("alpine:3.17");
    env.make_image("app");
    // A failed writer that left a tree (one that left none leaves only a
    // row, which a rebuild cannot know of).
    env.run_sh("broken", "echo part > \"$STOWAGE_IMAGE_DIR/f\"; false");
    fs::write(env.root.join("stowage.db"), vec![0x5a; 8192]).unwrap();

    // A write of an existing image too: it checks that its token is of the
    // database there (written.rs), and a damaged one has no identity.
    for args in [
        vec!["images"],
        vec!["exec", "--write", "app", "--", "true"],
        vec!["lock-status"],
    ] {
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains("stowage.db") && err.contains("doctor --repair"),
            "{args:?}: {err}"
        );
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
    assert!(
        storage.join("alpine+3.17/file").exists(),
        "images intact on disk"
    );
    // A read of an image that was ready still runs on its token: no tree
    // can have changed since the database broke (every change takes a
    // transaction), and the rebuild takes every token away (records_db.rs).
    env.ok(["exec", "--read", "app", "--", "true"]);
    let out = env.run(["doctor"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    env.ok(["doctor", "--repair"]);
    // The damaged file was moved aside, not deleted.
    let aside: Vec<_> = fs::read_dir(&env.root)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("stowage.db.damaged-")
        })
        .collect();
    assert_eq!(aside.len(), 1);
    // No row could be salvaged. The images written without the database
    // since its last transaction (new images: all three here) say how
    // their writes ended in their lock files, which the rebuild keeps:
    // those that ended well are ready, 'broken' is incomplete. A tree
    // nothing speaks for is kept, incomplete, until a writer makes it
    // ready again (`repair_adopts_a_failed_builds_tree_as_incomplete`).
    for (name, state) in [
        ("alpine:3.17", "ready"),
        ("app", "ready"),
        ("broken", "incomplete"),
    ] {
        assert_eq!(env.state(name).as_deref(), Some(state), "{name}");
    }
    env.ok(["exec", "--write", "alpine:3.17", "--", "true"]);
    env.ok(["exec", "--read", "alpine:3.17", "--", "true"]);
    let out = env.build("x", "echo \"$STOWAGE_IMAGES_DIR\"");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        storage.to_str().unwrap(),
        "images directory remembered"
    );
    assert_eq!(env.run(["doctor"]).status.code(), Some(0));
}

#[test]
fn repair_adopts_a_failed_builds_tree_as_incomplete() {
    let env = Env::new();
    env.make_image("good");
    let out = env.run_sh("bad", "echo partial > \"$STOWAGE_IMAGE_DIR/f\"; exit 1");
    assert_eq!(code(&out), Some(1));
    // The database is lost beyond salvage: nothing says which tree is
    // complete.
    fs::write(env.root.join("stowage.db"), vec![0x5a; 8192]).unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("bad").as_deref(), Some("incomplete"));
    assert_eq!(env.state("good").as_deref(), Some("incomplete"));
    let out = env.run(["exec", "--read", "bad", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    // A writer makes one ready again.
    env.ok(["exec", "--write", "good", "--", "true"]);
    env.ok(["exec", "--read", "good", "--", "true"]);
}

#[test]
fn a_rebuild_killed_after_the_damaged_database_was_set_aside_loses_no_image() {
    let env = Env::new();
    let storage = env.tmp.path().join("storage/img");
    fs::create_dir_all(&storage).unwrap();
    env.ok(["init", "--images-dir", storage.to_str().unwrap()]);
    env.make_image("app");
    fs::write(env.root.join("stowage.db"), vec![0x5a; 8192]).unwrap();
    let (bg, _pause) = env.paused(["doctor", "--repair"], "rebuild-moved-aside");
    bg.kill_all();
    // Whatever the kill left, the store is still the damaged one or the
    // rebuilt one: never a fresh, empty database that forgot the images
    // directory and every image.
    let out = env.run(["doctor", "--repair"]);
    assert!(storage.join("app/file").exists());
    // Its writer's record, kept through the killed rebuild, says it ended
    // well (it was written without the database, as a new image).
    assert_eq!(env.state("app").as_deref(), Some("ready"), "{}", show(&out));
    let out = env.build("x", "echo \"$STOWAGE_IMAGES_DIR\"");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        storage.to_str().unwrap()
    );
}

#[test]
fn a_process_with_an_open_connection_survives_a_database_rebuild() {
    let env = Env::new();
    env.make_image("base");
    // No lock file: the reader looks the image up first (a transaction,
    // which opens its connection) and stops there.
    fs::remove_file(env.lock_file("base")).unwrap();
    let (reader, go) = env.paused(["exec", "--read", "base", "--", "true"], "image-required");
    fs::write(env.root.join("stowage.db"), vec![0x5a; 8192]).unwrap();
    env.ok(["doctor", "--repair"]);
    // Whatever readiness the rebuild gave it, make it ready again.
    env.make_image("base");
    fs::remove_file(go).unwrap();
    let out = reader.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}
