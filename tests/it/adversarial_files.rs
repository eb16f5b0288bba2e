//! Files, removal, repair and sizes under attack: mounts at the top of a
//! tree being deleted, another filesystem of the same type mounted as the
//! images directory, and commands that should change nothing.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

#[test]
fn rebuilding_from_a_base_never_empties_a_mount_at_the_top_of_the_image() {
    if !root_or_skip("bind mounts") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    env.build("app", "mkdir \"$STOWAGE_IMAGE_DIR/mnt\"");
    // A build bind-mounted a directory into its tree, directly under the
    // image directory, and died before unmounting it.
    let v = victim(&env);
    let Some(_m) = Mount::at(
        &["--bind", v.to_str().unwrap()],
        &env.root.join("img/app/mnt"),
    ) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    let out = env.run(["exec", "--write", "app", "--from", "base", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("mount point"), "{}", show(&out));
    assert_intact(&v);
}

#[test]
fn removing_in_place_never_empties_an_image_directory_that_is_a_mount() {
    let env = Env::new();
    // The images directory on another filesystem: trees are deleted in
    // place. The image's own directory is a bind mount of a victim.
    let Some(tmpfs) = env.init_on_tmpfs() else {
        return;
    };
    let images = tmpfs.dir.clone();
    env.make_image("app");
    let v = victim(&env);
    let Some(_m) = Mount::at(&["--bind", v.to_str().unwrap()], &images.join("app")) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    let out = env.run(["rm", "app"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("mount point"), "{}", show(&out));
    assert_intact(&v);
    // Nothing went, so nothing was damaged: the image is ready again.
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// A fresh ext4 filesystem in a file under `dir`, for loop mounts.
fn ext4_file(dir: &Path, name: &str) -> Option<PathBuf> {
    let f = dir.join(name);
    fs::File::create(&f).unwrap().set_len(16 << 20).unwrap();
    Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&f)
        .status()
        .is_ok_and(|s| s.success())
        .then_some(f)
}

#[test]
fn another_filesystem_of_the_same_type_mounted_as_the_images_directory_loses_no_row() {
    if !root_or_skip("loop mounts") {
        return;
    }
    let env = Env::new();
    let (Some(a), Some(b)) = (
        ext4_file(env.tmp.path(), "a.ext4"),
        ext4_file(env.tmp.path(), "b.ext4"),
    ) else {
        eprintln!("skipping: no mkfs.ext4 here");
        return;
    };
    let images = env.tmp.path().join("images");
    fs::create_dir(&images).unwrap();
    let opts = |f: &Path| vec!["-o".to_owned(), "loop".to_owned(), f.display().to_string()];
    let mount = |f: &Path| {
        let o = opts(f);
        Mount::at(&o.iter().map(String::as_str).collect::<Vec<_>>(), &images)
    };
    let Some(m) = mount(&a) else {
        eprintln!("skipping: cannot loop-mount here");
        return;
    };
    env.ok(["init", "--images-dir", images.to_str().unwrap()]);
    env.make_image("base");
    // The wrong disk is mounted there: a filesystem of the same type, whose
    // root directory has the same inode number as every ext4's.
    drop(m);
    let Some(m) = mount(&b) else {
        eprintln!("skipping: cannot loop-mount here");
        return;
    };
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("not the directory recorded"),
        "{}",
        show(&out)
    );
    drop(m);
    // The right one back: the image is there, ready, as it was.
    let Some(_m) = mount(&a) else {
        eprintln!("skipping: cannot loop-mount here");
        return;
    };
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(
        env.state("base").as_deref(),
        Some("ready"),
        "{}",
        show(&out)
    );
}

#[test]
fn gc_on_a_missing_root_says_so_and_creates_nothing() {
    let env = Env::new();
    for args in [
        &["gc", "--dry-run"][..],
        &["gc"],
        &["gc", "--max-size", "1G"],
    ] {
        let out = env.run(args);
        assert_missing_root_refused(&env, args, &out);
    }
}

#[test]
fn a_symlink_swapped_in_for_the_images_directory_before_a_clone_gets_nothing() {
    let env = Env::new();
    env.make_image("base");
    env.make_image("app");
    // A directory outside the root with entries named like the images.
    let v = env.tmp.path().join("victim");
    fs::create_dir_all(v.join("app")).unwrap();
    fs::create_dir_all(v.join("base")).unwrap();
    fs::write(v.join("base/planted"), "x").unwrap();
    fs::write(v.join("app/keep"), "precious").unwrap();
    let (bg, pause) = env.paused(
        ["exec", "--write", "app", "--from", "base", "--", "true"],
        "clone-emptied",
    );
    // Someone who can write the root swaps `img` for a link while the
    // rebuild is between emptying the image and copying into it.
    let img = env.root.join("img");
    fs::rename(&img, env.tmp.path().join("img-aside")).unwrap();
    std::os::unix::fs::symlink(&v, &img).unwrap();
    fs::remove_file(&pause).unwrap();
    let out = bg.finish();
    let names: Vec<_> = fs::read_dir(v.join("app"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["keep"], "copied outside the root: {}", show(&out));
    assert_eq!(fs::read_to_string(v.join("app/keep")).unwrap(), "precious");
    assert_ne!(code(&out), Some(0), "{}", show(&out));
}

#[test]
fn the_lost_and_found_of_an_images_filesystem_is_no_image() {
    if !root_or_skip("loop mounts") {
        return;
    }
    let env = Env::new();
    let Some(a) = ext4_file(env.tmp.path(), "a.ext4") else {
        eprintln!("skipping: no mkfs.ext4 here");
        return;
    };
    let images = env.tmp.path().join("images");
    fs::create_dir(&images).unwrap();
    let Some(_m) = Mount::at(&["-o", "loop", a.to_str().unwrap()], &images) else {
        eprintln!("skipping: cannot loop-mount here");
        return;
    };
    assert!(images.join("lost+found").is_dir());
    env.ok(["init", "--images-dir", images.to_str().unwrap()]);
    env.make_image("app");
    let out = env.ok(["doctor", "--repair"]);
    let names: Vec<String> = env
        .images_json()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["app"], "{}", show(&out));
    env.ok(["gc", "--max-size", "0"]);
    assert!(env.images_json().is_empty());
    assert!(images.join("lost+found").is_dir(), "gc deleted lost+found");
}

#[test]
fn the_loser_of_two_removals_of_one_image_leaves_no_lock_file() {
    let env = Env::new();
    env.make_image("a");
    let reader = env.hold(&["--read", "a"], "reading");
    let first = env.spawn(["rm", "a"]);
    env.wait_for_waiter("a");
    let second = env.spawn(["rm", "a"]);
    env.wait_for_waiters("a", 2);
    env.release("release");
    assert!(reader.finish().status.success());
    let outs = [first.finish(), second.finish()];
    let mut codes: Vec<_> = outs.iter().map(code).collect();
    codes.sort();
    assert_eq!(
        codes,
        [Some(0), Some(66)],
        "{}\n{}",
        show(&outs[0]),
        show(&outs[1])
    );
    let left: Vec<_> = fs::read_dir(env.root.join("locks/images"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

#[test]
fn a_reader_queued_behind_a_removal_leaves_no_lock_file() {
    let env = Env::new();
    env.make_image("a");
    let reader = env.hold(&["--read", "a"], "reading");
    let rm = env.spawn(["rm", "a"]);
    env.wait_for_waiter("a");
    // A second reader queues behind the removal (a writer waits ahead).
    let late = env.spawn(["exec", "--read", "a", "--", "true"]);
    env.wait_for_waiters("a", 2);
    env.release("release");
    assert!(reader.finish().status.success());
    let out = rm.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = late.finish();
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    let left: Vec<_> = fs::read_dir(env.root.join("locks/images"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// `chattr +i` on `path`; false where the filesystem cannot.
fn immutable(path: &Path, on: bool) -> bool {
    Command::new("chattr")
        .arg(if on { "+i" } else { "-i" })
        .arg(path)
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn one_tree_that_cannot_leave_the_trash_keeps_neither_the_others_nor_the_report() {
    if !root_or_skip("chattr +i") {
        return;
    }
    let env = Env::new();
    for name in ["a", "b"] {
        env.build(
            name,
            "mkdir \"$STOWAGE_IMAGE_DIR/d\" && echo x > \"$STOWAGE_IMAGE_DIR/d/f\"",
        );
    }
    let stuck = env.root.join("img/a/d/f");
    if !immutable(&stuck, true) {
        eprintln!("skipping: no chattr +i on this filesystem");
        return;
    }
    let out = env.run(["rm", "a", "b"]);
    let trash = env.root.join("trash");
    let left: Vec<PathBuf> = fs::read_dir(&trash)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    for l in &left {
        immutable(&l.join("d/f"), false);
    }
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("removed 'a'") && err.contains("removed 'b'"),
        "{}",
        show(&out)
    );
    assert!(err.contains("image 'a' was removed, but"), "{}", show(&out));
    assert!(env.images_json().is_empty());
    // Only a's tree stays behind, for the next gc.
    assert_eq!(left.len(), 1, "{left:?}: {}", show(&out));
    assert!(left[0].to_string_lossy().ends_with(".a"), "{left:?}");
    env.ok(["gc"]);
    assert_eq!(fs::read_dir(&trash).unwrap().count(), 0);
}

#[test]
fn nothing_is_removed_while_the_images_directory_is_unmounted() {
    let env = Env::new();
    let Some(m) = env.init_on_tmpfs() else {
        return;
    };
    let images = m.dir.clone();
    for name in ["a", "b", "c"] {
        env.make_image(name);
    }
    // Move the filesystem away (as an unmount would, keeping its trees)
    // and leave the empty mount point.
    let aside = env.tmp.path().join("aside");
    fs::create_dir(&aside).unwrap();
    let moved = Command::new("mount")
        .arg("--move")
        .arg(&images)
        .arg(&aside)
        .status()
        .is_ok_and(|s| s.success());
    assert!(moved);
    std::mem::forget(m);
    let _m = Mount::adopt(&aside);
    for args in [
        &["gc", "--max-size", "0"][..],
        &["gc", "--max-size", "0", "--dry-run"],
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        assert!(stderr(&out).contains("mounted"), "{args:?}: {}", show(&out));
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("remove 'a'"),
            "{}",
            show(&out)
        );
    }
    let out = env.run(["rm", "a"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("mounted"), "{}", show(&out));
    for name in ["a", "b", "c"] {
        assert_eq!(env.state(name).as_deref(), Some("ready"), "{name}");
        assert!(aside.join(name).join("file").exists());
    }
}

#[test]
fn gc_counts_the_bytes_it_frees_when_it_finishes_a_killed_removal() {
    for point in ["rm-marked", "rm-moved"] {
        let env = Env::new();
        env.build(
            "big",
            "head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/data\"",
        );
        let (bg, _pause) = env.paused(["rm", "big"], point);
        bg.kill_all();
        let out = env.ok(["gc", "--json"]);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let freed = report["bytes_freed"].as_u64().unwrap();
        assert!(
            (1 << 20..2 << 20).contains(&freed),
            "{point}: freed {freed}: {}",
            show(&out)
        );
        assert!(env.images_json().is_empty(), "{point}");
        assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
    }
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
    assert_eq!(
        env.state("app").as_deref(),
        Some("incomplete"),
        "{}",
        show(&out)
    );
    let out = env.build("x", "echo \"$STOWAGE_IMAGES_DIR\"");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        storage.to_str().unwrap()
    );
}

#[test]
fn a_directory_without_permissions_in_ones_own_image_is_deleted() {
    let env = unprivileged_env();
    // A build that left a directory nobody may read or search.
    unprivileged_build(
        &env,
        "a",
        "mkdir -p \"$STOWAGE_IMAGE_DIR/d/e\" && echo x > \"$STOWAGE_IMAGE_DIR/d/e/f\" && chmod 000 \"$STOWAGE_IMAGE_DIR/d/e\" && chmod 500 \"$STOWAGE_IMAGE_DIR/d\"",
    );
    let out = unprivileged(&env, &["rm", "a"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
    // The same for a rebuild from a base, which empties the image first.
    for args in [
        &["exec", "--write", "base", "--", "true"][..],
        &[
            "exec",
            "--write",
            "b",
            "--",
            "sh",
            "-c",
            "mkdir \"$STOWAGE_IMAGE_DIR/e\" && chmod 000 \"$STOWAGE_IMAGE_DIR/e\"",
        ],
        &["exec", "--write", "b", "--from", "base", "--", "true"],
    ] {
        let out = unprivileged(&env, args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
}

#[test]
fn the_root_seen_through_a_bind_mount_or_a_symlink_is_no_images_directory() {
    let env = Env::new();
    env.ok(["init"]);
    let t = env.tmp.path();
    // A symlink among the parents: the same directories under other names.
    std::os::unix::fs::symlink(t, t.join("alias")).unwrap();
    let via_link = t.join("alias/root");
    let inside = t.join("alias/root/locks");
    let mut tries = vec![via_link, inside, t.join("alias")];
    // A bind mount of the root.
    let bind = t.join("bind");
    fs::create_dir(&bind).unwrap();
    let _m = if is_root() {
        Mount::at(&["--bind", env.root.to_str().unwrap()], &bind)
    } else {
        None
    };
    if _m.is_some() {
        tries.push(bind.clone());
    }
    for dir in &tries {
        let out = env.run(["init", "--images-dir", dir.to_str().unwrap()]);
        assert_eq!(code(&out), Some(1), "{dir:?}: {}", show(&out));
        assert!(stderr(&out).contains("root"), "{dir:?}: {}", show(&out));
        assert!(env.images_json().is_empty(), "{dir:?}: {}", show(&out));
    }
    for d in ["locks", "img", "trash"] {
        assert!(env.root.join(d).is_dir());
    }
    // The default images directory named explicitly is still fine.
    env.ok([
        "init",
        "--images-dir",
        env.root.join("img").to_str().unwrap(),
    ]);
}

#[test]
fn an_image_with_a_directory_one_may_not_read_still_has_a_size() {
    let env = unprivileged_env();
    unprivileged_build(
        &env,
        "a",
        "head -c 300000 /dev/urandom > \"$STOWAGE_IMAGE_DIR/data\" && mkdir \"$STOWAGE_IMAGE_DIR/locked\" && chmod 000 \"$STOWAGE_IMAGE_DIR/locked\"",
    );
    let out = unprivileged(&env, &["images", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let size = rows[0]["size_bytes"].as_u64();
    assert!(size.is_some_and(|s| s >= 300_000), "{}", show(&out));
    // So gc's budget sees it.
    let out = unprivileged(&env, &["gc", "--max-size", "100K", "--dry-run", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["removed"].as_array().map(Vec::len),
        Some(1),
        "{}",
        show(&out)
    );
}

#[test]
fn a_copy_from_a_base_leaves_out_a_filesystem_mounted_inside_it() {
    if !root_or_skip("mounts") {
        return;
    }
    let env = Env::new();
    env.build(
        "base",
        "mkdir \"$STOWAGE_IMAGE_DIR/mnt\" && echo own > \"$STOWAGE_IMAGE_DIR/own\"",
    );
    // A build left a filesystem mounted in the base's tree.
    let Some(_t) = Mount::tmpfs_at(&env.root.join("img/base/mnt"), "1m") else {
        return;
    };
    fs::write(env.root.join("img/base/mnt/big"), "mounted").unwrap();
    let out = env.ok(["exec", "--write", "app", "--from", "base", "--", "true"]);
    let app = env.root.join("img/app");
    assert_eq!(fs::read_to_string(app.join("own")).unwrap(), "own\n");
    assert!(app.join("mnt").is_dir());
    assert_eq!(
        fs::read_dir(app.join("mnt")).unwrap().count(),
        0,
        "{}",
        show(&out)
    );
    assert!(stderr(&out).contains("mount point"), "{}", show(&out));
}
