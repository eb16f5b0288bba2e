//! Image lifecycle: clone from a base, rm, gc, doctor — and crashes in
//! the middle of each.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::Path;
use std::process::Command;

use crate::common::*;

/// A base image with the awkward things a root filesystem has.
fn make_rich_base(env: &Env, outside: &Path) {
    let script = format!(
        "set -e; cd \"$STOWAGE_IMAGE_DIR\"; mkdir -p bin etc/private empty; \
         printf 'tool' > bin/tool; chmod 4755 bin/tool; ln bin/tool bin/tool-again; \
         printf 'secret' > etc/private/key; chmod 0640 etc/private/key; chmod 0750 etc/private; \
         ln -s '{}' escape; ln -s ../bin/tool etc/tool-link; mkfifo pipe; \
         touch -d '2020-01-02 03:04:05' etc/private/key",
        outside.display()
    );
    env.build("base", &script);
}

#[test]
fn a_clone_is_a_faithful_copy_sharing_no_inode() {
    let env = Env::new();
    let outside = env.tmp.path().join("outside.txt");
    fs::write(&outside, "outside").unwrap();
    make_rich_base(&env, &outside);
    env.ok(["exec", "--write", "app", "--from", "base", "--", "true"]);

    let base = env.root.join("img/base");
    let app = env.root.join("img/app");
    let mut count = 0;
    for entry in walkdir(&base) {
        let rel = entry.strip_prefix(&base).unwrap();
        let (a, b) = (
            fs::symlink_metadata(&entry).unwrap(),
            fs::symlink_metadata(app.join(rel)).unwrap(),
        );
        assert_eq!(a.file_type(), b.file_type(), "{rel:?}");
        assert_eq!(a.mode(), b.mode(), "{rel:?} mode");
        assert_eq!(a.uid(), b.uid(), "{rel:?} owner");
        if !a.file_type().is_symlink() {
            assert_eq!(a.mtime(), b.mtime(), "{rel:?} mtime");
        }
        if a.is_file() {
            assert_eq!(
                fs::read(&entry).unwrap(),
                fs::read(app.join(rel)).unwrap(),
                "{rel:?}"
            );
            assert_ne!(a.ino(), b.ino(), "{rel:?} shares an inode with the base");
        }
        if a.file_type().is_symlink() {
            assert_eq!(
                fs::read_link(&entry).unwrap(),
                fs::read_link(app.join(rel)).unwrap()
            );
        }
        count += 1;
    }
    assert!(count >= 9, "walked {count} entries");
    let t1 = fs::metadata(app.join("bin/tool")).unwrap();
    let t2 = fs::metadata(app.join("bin/tool-again")).unwrap();
    assert_eq!(
        t1.ino(),
        t2.ino(),
        "hard links stay hard links within the copy"
    );
    assert_eq!(t1.mode() & 0o7777, 0o4755);
    assert_eq!(
        fs::read_to_string(&outside).unwrap(),
        "outside",
        "a symlink out is copied, not followed"
    );
    assert_eq!(
        env.image("app").unwrap()["base"],
        "base",
        "lineage recorded"
    );
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn a_clone_keeps_device_nodes_and_ownership_as_root() {
    if !root_or_skip("creating device nodes and giving files away") {
        return;
    }
    let env = Env::new();
    env.build(
        "base",
        "cd \"$STOWAGE_IMAGE_DIR\" && mkdir dev && mknod dev/null c 1 3 && chmod 666 dev/null \
         && echo x > owned && chown 1234:5678 owned",
    );
    env.ok(["exec", "--write", "copy", "--from", "base", "--", "true"]);
    let node = fs::symlink_metadata(env.root.join("img/copy/dev/null")).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(
        &node.file_type()
    ));
    assert_eq!(node.rdev(), fs::metadata("/dev/null").unwrap().rdev());
    let owned = fs::metadata(env.root.join("img/copy/owned")).unwrap();
    assert_eq!((owned.uid(), owned.gid()), (1234, 5678));
}

#[test]
fn from_rules() {
    let env = Env::new();
    env.make_image("base");
    let cases: [(&[&str], i32); 5] = [
        (
            &["exec", "--write", "a", "--from", "nosuch", "--", "true"],
            66,
        ),
        (
            &[
                "exec", "--write", "a", "--write", "b", "--from", "base", "--", "true",
            ],
            64,
        ),
        (&["exec", "--read", "x", "--from", "base", "--", "true"], 64),
        (
            &["exec", "--write", "base", "--from", "base", "--", "true"],
            64,
        ),
        (
            &["exec", "--write", "a", "--from", "bad name", "--", "true"],
            64,
        ),
    ];
    for (args, code) in cases {
        let out = env.run(args);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {}", show(&out));
    }
    assert_eq!(env.state("a"), None);
    // Rebuilding an existing image from a base replaces its content.
    env.build("a", "touch \"$STOWAGE_IMAGE_DIR/stale\"");
    env.ok(["exec", "--write", "a", "--from", "base", "--", "true"]);
    assert!(!env.root.join("img/a/stale").exists());
    assert!(env.root.join("img/a/file").exists());
}

#[test]
fn a_clone_killed_midway_is_never_ready() {
    let env = Env::new();
    env.build(
        "base",
        "for i in 1 2 3 4 5; do echo $i > \"$STOWAGE_IMAGE_DIR/f$i\"; done",
    );
    let (bg, _) = env.paused(
        ["exec", "--write", "app", "--from", "base", "--", "true"],
        "clone-copying",
    );
    bg.kill_all();
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    let out = env.run(["exec", "--read", "app", "--", "true"]);
    assert_eq!(out.status.code(), Some(66));
    // Rewriting it from the base completes it.
    env.ok(["exec", "--write", "app", "--from", "base", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(fs::read_dir(env.root.join("img/app")).unwrap().count(), 5);
}

#[test]
fn reflink_clone_costs_no_space_on_btrfs() {
    let Some(mnt) = Mount::btrfs_loop("400M") else {
        return;
    };
    let root = mnt.dir.join("root");
    let run = |args: &[&str]| {
        let mut c = Command::new(bin());
        c.arg("--root").arg(&root).args(args);
        let out = output(c);
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    };
    run(&[
        "exec",
        "--write",
        "big",
        "--",
        "sh",
        "-c",
        "head -c 104857600 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
    ]);
    let before = mnt.used();
    run(&["exec", "--write", "copy", "--from", "big", "--", "true"]);
    let grew = mnt.used().saturating_sub(before);
    assert!(grew < 8 << 20, "a 100 MiB clone used {grew} bytes");
    assert_eq!(
        fs::read(root.join("img/big/blob")).unwrap(),
        fs::read(root.join("img/copy/blob")).unwrap()
    );
}

#[test]
fn rm_removes_everything_of_the_image_and_nothing_else() {
    let env = Env::new();
    let outside = env.tmp.path().join("precious");
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("data"), "keep me").unwrap();
    let script = format!(
        "ln -s '{o}' \"$STOWAGE_IMAGE_DIR/dir-link\"; ln -s '{o}/data' \"$STOWAGE_IMAGE_DIR/file-link\"; \
         mkdir \"$STOWAGE_IMAGE_DIR/sub\"; ln -s '{o}' \"$STOWAGE_IMAGE_DIR/sub/deeper\"",
        o = outside.display()
    );
    env.build("app", &script);
    env.make_image("other");
    env.ok(["rm", "app"]);
    assert_eq!(env.state("app"), None);
    assert!(!env.root.join("img/app").exists());
    assert!(!env.lock_file("app").exists(), "the lock file goes too");
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
    assert_eq!(fs::read_to_string(outside.join("data")).unwrap(), "keep me");
    assert_eq!(env.state("other").as_deref(), Some("ready"));
}

#[test]
fn rm_of_an_image_dir_swapped_for_a_symlink_removes_only_the_link() {
    let env = Env::new();
    env.make_image("app");
    let outside = env.tmp.path().join("elsewhere");
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("data"), "keep me").unwrap();
    let tree = env.root.join("img/app");
    fs::remove_dir_all(&tree).unwrap();
    symlink(&outside, &tree).unwrap();
    env.ok(["rm", "app"]);
    assert_eq!(fs::read_to_string(outside.join("data")).unwrap(), "keep me");
    assert!(fs::symlink_metadata(&tree).is_err());
    // Writing through such a link is refused too.
    symlink(&outside, &tree).unwrap();
    let out = env.run(["exec", "--write", "app", "--", "true"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("symlink"), "{}", stderr(&out));
}

#[test]
fn rm_of_a_locked_image_gives_75_and_keeps_it() {
    let env = Env::new();
    env.make_image("app");
    env.make_image("free");
    let reader = env.hold(&["--read", "app"], "started");
    let out = env.run(["rm", "--no-wait", "free", "app"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let out = env.run(["rm", "--wait", "0.3", "app"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(
        env.state("free").as_deref(),
        Some("ready"),
        "all or nothing"
    );
    assert!(env.root.join("img/app/file").exists());
    // Without a bound, rm waits for the reader and then removes.
    let rm = env.spawn(["rm", "app"]);
    env.wait_for_waiter("app");
    assert!(
        env.root.join("img/app/file").exists(),
        "nothing removed while read"
    );
    env.release("release");
    assert_eq!(reader.finish().status.code(), Some(0));
    assert_eq!(rm.finish().status.code(), Some(0));
    assert_eq!(env.state("app"), None);
    let out = env.run(["rm", "app", "free"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert_eq!(
        env.state("free").as_deref(),
        Some("ready"),
        "nothing removed when one is missing"
    );
}

#[test]
fn sigkill_during_rm_is_finished_by_repair() {
    for point in ["rm-marked", "rm-moved"] {
        let env = Env::new();
        env.make_image("doomed");
        env.make_image("keeper");
        let (bg, _) = env.paused(["rm", "doomed"], point);
        bg.kill_all();
        // Half-removed, and never looking ready.
        assert_ne!(env.state("doomed").as_deref(), Some("ready"), "{point}");
        let out = env.run(["doctor"]);
        assert_eq!(out.status.code(), Some(1), "{point}: {}", show(&out));
        let out = env.run(["doctor", "--repair"]);
        assert_eq!(out.status.code(), Some(0), "{point}: {}", show(&out));
        assert_eq!(env.state("doomed"), None, "{point}");
        assert!(!env.root.join("img/doomed").exists(), "{point}");
        assert!(!env.lock_file("doomed").exists(), "{point}");
        assert_eq!(
            fs::read_dir(env.root.join("trash")).unwrap().count(),
            0,
            "{point}"
        );
        assert_eq!(env.state("keeper").as_deref(), Some("ready"), "{point}");
        assert_eq!(env.run(["doctor"]).status.code(), Some(0), "{point}");
    }
}

#[test]
fn gc_finishes_an_interrupted_removal() {
    let env = Env::new();
    env.make_image("doomed");
    let (bg, _) = env.paused(["rm", "doomed"], "rm-moved");
    bg.kill_all();
    env.ok(["gc"]);
    assert_eq!(env.state("doomed"), None);
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
}

/// gc lists an image as `deleting` while its remover is merely slow; the
/// remover then finishes. gc must not take the finished removal for a crash:
/// no error, and no lock file left for an image that no longer exists.
#[test]
fn gc_does_not_redo_a_removal_that_finished_after_it_looked() {
    let env = Env::new();
    env.make_image("doomed");
    let (rm, rm_paused) = env.paused(["rm", "doomed"], "rm-marked");
    assert_eq!(env.state("doomed").as_deref(), Some("deleting"));

    let (gc, gc_paused) = env.paused(["gc"], "interrupted-listed");

    // The remover goes on and finishes while gc holds its stale list.
    fs::remove_file(&rm_paused).unwrap();
    let out = rm.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("doomed"), None);

    fs::remove_file(&gc_paused).unwrap();
    let out = gc.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        !env.lock_file("doomed").exists(),
        "no lock file for a removed image"
    );
    env.ok(["doctor"]);
}

/// An image gc chose is removed by someone else before gc locks it: gc
/// skips it and leaves no lock file behind for the image that is gone.
#[test]
fn gc_skips_an_image_removed_after_it_chose_it() {
    let env = Env::new();
    let out = env.run(["exec", "--write", "broken", "--", "false"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(env.state("broken").as_deref(), Some("incomplete"));

    let (gc, paused) = env.paused(["gc", "--json"], "gc-listed");
    env.ok(["rm", "broken"]);
    assert!(!env.lock_file("broken").exists());

    fs::remove_file(&paused).unwrap();
    let out = gc.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(removed(&report), Vec::<String>::new(), "{report}");
    assert!(
        !env.lock_file("broken").exists(),
        "no lock file for a removed image"
    );
    env.ok(["doctor"]);
}

/// Two removals of an image that has no lock file yet (adopted, never
/// locked): the loser says the image does not exist and leaves no lock file
/// behind.
#[test]
fn the_losing_rm_of_a_race_leaves_no_lock_file() {
    let env = Env::new();
    env.make_image("x");
    fs::remove_file(env.lock_file("x")).unwrap();
    let (slow, paused) = env.paused(["rm", "x"], "image-required");
    env.ok(["rm", "x"]);
    fs::remove_file(&paused).unwrap();
    let out = slow.finish();
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains("'x' does not exist"),
        "{}",
        show(&out)
    );
    assert!(
        !env.lock_file("x").exists(),
        "no lock file for a removed image"
    );
    env.ok(["doctor"]);
}

/// Four 1 MiB images used in the order a, b, c, d (a least recently), with
/// the clock faked instead of sleeping.
fn lru_store() -> Env {
    let env = Env::new();
    for (i, name) in ["a", "b", "c", "d"].iter().enumerate() {
        let mut c = env.cmd([
            "exec",
            "--write",
            name,
            "--",
            "sh",
            "-c",
            "head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
        ]);
        c.env("STOWAGE_NOW", format!("2026-01-0{}T00:00:00Z", i + 1));
        assert_eq!(output(c).status.code(), Some(0));
    }
    env
}

fn gc_json(env: &Env, args: &[&str], now: &str) -> serde_json::Value {
    let mut c = env.cmd(["gc", "--json"]);
    c.args(args).env("STOWAGE_NOW", now);
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn removed(report: &serde_json::Value) -> Vec<String> {
    report["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn gc_dry_run_changes_nothing() {
    let env = lru_store();
    env.run(["exec", "--write", "broken", "--", "false"]);
    let listing = env.images_json();
    let files = tree(&env.root);
    let db = fs::read(env.root.join("stowage.db")).unwrap();
    let report = gc_json(
        &env,
        &["--dry-run", "--max-size", "2M", "--unused-for", "1d"],
        "2026-01-04T12:00:00Z",
    );
    assert_eq!(report["dry_run"], true);
    assert_eq!(removed(&report), ["broken", "a", "b", "c"]);
    assert_eq!(tree(&env.root), files, "no file touched");
    assert_eq!(
        fs::read(env.root.join("stowage.db")).unwrap(),
        db,
        "no metadata changed"
    );
    assert_eq!(env.images_json(), listing);
}

#[test]
fn gc_removes_least_recently_used_until_the_budget_fits() {
    let env = lru_store();
    let report = gc_json(&env, &["--max-size", "2.5M"], "2026-02-01T00:00:00Z");
    assert_eq!(removed(&report), ["a", "b"], "oldest first");
    assert!(report["size_after"].as_u64().unwrap() <= 5 << 19);
    assert_eq!(
        report["bytes_freed"].as_u64().unwrap(),
        report["size_before"].as_u64().unwrap() - report["size_after"].as_u64().unwrap()
    );
    assert!(report["removed"][0]["size_bytes"].as_u64().unwrap() >= 1 << 20);
    assert_eq!(env.state("c").as_deref(), Some("ready"));
    assert_eq!(env.state("a"), None);
    assert!(!env.root.join("img/a").exists());
}

#[test]
fn gc_never_touches_a_locked_image_even_the_oldest() {
    let env = lru_store();
    // The reader's use of 'a' is dated before the others', so 'a' stays
    // the least recently used.
    let reader = env.hold_with(&["--read", "a"], "started", |c| {
        c.env("STOWAGE_NOW", "2026-01-01T00:00:00Z");
    });
    let report = gc_json(&env, &["--max-size", "2.5M"], "2026-02-01T00:00:00Z");
    assert_eq!(
        removed(&report),
        ["b", "c"],
        "a is in use; the next oldest go instead"
    );
    assert_eq!(report["busy"], serde_json::json!(["a"]));
    assert!(
        report["size_after"].as_u64().unwrap() <= 5 << 19,
        "budget met: {report}"
    );
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    env.release("release");
    reader.finish();
}

#[test]
fn gc_removes_incomplete_and_unused_images() {
    let env = lru_store();
    env.run(["exec", "--write", "broken", "--", "false"]);
    // A writer that died: found and removed too.
    let bg = env.hold(&["--write", "dead"], "started");
    bg.kill_all();
    // "Now" is Jan 10: a..d were last used Jan 1..4.
    let report = gc_json(&env, &["--unused-for", "7d"], "2026-01-10T00:00:00Z");
    let gone = removed(&report);
    assert!(
        gone.contains(&"broken".to_owned()) && gone.contains(&"dead".to_owned()),
        "{report}"
    );
    assert!(
        gone.contains(&"a".to_owned()) && gone.contains(&"b".to_owned()),
        "{report}"
    );
    assert!(
        !gone.contains(&"c".to_owned()) && !gone.contains(&"d".to_owned()),
        "{report}"
    );
    let reasons: Vec<&str> = report["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["reason"].as_str().unwrap())
        .collect();
    assert!(
        reasons.contains(&"incomplete") && reasons.contains(&"unused"),
        "{report}"
    );
}

#[test]
fn gc_bad_arguments_exit_64() {
    let env = Env::new();
    for args in [
        vec!["gc", "--max-size", "lots"],
        vec!["gc", "--max-size", "-1G"],
        vec!["gc", "--unused-for", "soon"],
        vec!["gc", "--unused-for", "-3d"],
    ] {
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", show(&out));
    }
}

#[test]
fn a_damaged_database_is_reported_and_rebuilt_without_losing_an_image() {
    let env = Env::new();
    let storage = env.tmp.path().join("storage/img");
    fs::create_dir_all(&storage).unwrap();
    env.ok(["init", "--images-dir", storage.to_str().unwrap()]);
    env.make_image("alpine:3.17");
    env.make_image("app");
    env.run(["exec", "--write", "broken", "--", "false"]);
    fs::write(env.root.join("stowage.db"), vec![0x5a; 8192]).unwrap();

    for args in [
        vec!["images"],
        vec!["exec", "--read", "app", "--", "true"],
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
    // Nothing could be salvaged, so nothing says which tree is complete
    // ('broken' looks like any other): every image is kept, incomplete,
    // until a writer makes it ready again.
    for name in ["alpine:3.17", "app", "broken"] {
        assert_eq!(env.state(name).as_deref(), Some("incomplete"), "{name}");
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
fn a_write_whose_command_deletes_the_image_removes_it() {
    // How a builder's own delete runs under stowage:
    // stowage exec --write IMG -- ch-image delete IMG
    let env = Env::new();
    env.make_image("app");
    env.build("app", "rm -rf \"$STOWAGE_IMAGE_DIR\"");
    assert_eq!(env.state("app"), None);
    assert!(!env.lock_file("app").exists());
    assert_eq!(env.run(["doctor"]).status.code(), Some(0));
}

#[test]
fn a_listing_into_a_closed_pipe_ends_quietly() {
    let env = Env::new();
    // More rows than a pipe buffer holds, so the writer does hit EPIPE.
    for i in 0..3000 {
        fs::create_dir_all(env.root.join(format!("img/image-number-{i:05}"))).unwrap();
    }
    env.ok(["init"]);
    let out = output({
        let mut c = Command::new("sh");
        c.arg("-c").arg(format!(
            "'{}' --root '{}' images | head -1",
            bin(),
            env.root.display()
        ));
        c
    });
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}

#[test]
fn a_clone_whose_command_cannot_start_is_incomplete_not_restored() {
    // The copy changed the image before the command failed to start: its
    // old state must not come back with the base's content in it.
    let env = Env::new();
    env.build("base", "echo BASE > \"$STOWAGE_IMAGE_DIR/content\"");
    env.build("app", "echo APP > \"$STOWAGE_IMAGE_DIR/content\"");
    for image in ["app", "fresh"] {
        let out = env.run([
            "exec",
            "--write",
            image,
            "--from",
            "base",
            "--",
            "/nonexistent/builder",
        ]);
        assert_eq!(out.status.code(), Some(1), "{}", show(&out));
        assert_eq!(env.state(image).as_deref(), Some("incomplete"), "{image}");
    }
    assert_eq!(
        env.run(["doctor"]).status.code(),
        Some(0),
        "no tree without a row"
    );
}

#[test]
fn an_unused_for_longer_than_history_removes_nothing() {
    let env = lru_store();
    let report = gc_json(
        &env,
        &["--unused-for", "1000000000y", "--dry-run"],
        "2026-02-01T00:00:00Z",
    );
    assert!(removed(&report).is_empty(), "{report}");
}
