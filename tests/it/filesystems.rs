//! Where the images live: an images directory on another filesystem
//! (emptied in place), unmounted, or replaced by another filesystem of the
//! same type; mounts left inside image trees, which no copy or removal
//! crosses; and the checks that stand in for network and cluster filesystems
//! (NFS, Lustre, BeeGFS) whose behaviour cannot be reproduced here.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

// --- the images directory ---------------------------------------------------

#[test]
fn an_images_directory_on_another_filesystem_is_emptied_in_place_safely() {
    if !root_or_skip("mounting a tmpfs") {
        return;
    }
    let env = Env::new();
    let ext = env.tmp.path().join("ext");
    fs::create_dir(&ext).unwrap();
    let Some(_guard) = Mount::tmpfs_at(&ext, "4m") else {
        return;
    };
    let img = ext.join("img");
    env.ok(["init", "--images-dir", img.to_str().unwrap()]);
    let v = victim(&env);
    env.build("a", &format!(
            "mkdir -p \"$STOWAGE_IMAGE_DIR/d/e\" && echo x > \"$STOWAGE_IMAGE_DIR/d/e/f\" && ln -s '{}' \"$STOWAGE_IMAGE_DIR/d/link\"",
            v.display()
        ));
    // The trash is on the root's filesystem: the tree cannot be renamed
    // there, and is deleted where it is, under the lock.
    env.ok(["rm", "a"]);
    assert!(!img.join("a").exists());
    assert_eq!(env.state("a"), None);
    assert_intact(&v);
    env.ok(["doctor"]);
}

#[test]
fn an_empty_images_directory_keeps_its_rows() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    // As if its filesystem were not mounted for a moment.
    let img = env.root.join("img");
    let away = env.tmp.path().join("img.away");
    fs::rename(&img, &away).unwrap();
    fs::create_dir(&img).unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("mounted?"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    assert_eq!(env.state("b").as_deref(), Some("ready"));
    // Mounted again: everything is there.
    fs::remove_dir(&img).unwrap();
    fs::rename(&away, &img).unwrap();
    env.ok(["doctor"]);
    env.ok(["exec", "--read", "a", "--read", "b", "--", "true"]);
}

#[test]
fn another_filesystem_on_the_images_directory_keeps_rows_and_adopts_nothing() {
    if !root_or_skip("mounting a tmpfs") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    env.ok(["doctor", "--repair"]);
    let img = env.root.join("img");
    let Some(guard) = Mount::tmpfs_at(&img, "1m") else {
        return;
    };
    fs::create_dir(img.join("stranger")).unwrap();
    fs::write(img.join("stranger/f"), "theirs").unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("not the directory recorded"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    assert_eq!(env.state("stranger"), None, "a foreign tree was adopted");
    // gc deletes nothing there either.
    assert_eq!(
        fs::read_to_string(img.join("stranger/f")).unwrap(),
        "theirs"
    );
    drop(guard);
    env.ok(["doctor"]);
    env.ok(["exec", "--read", "a", "--", "true"]);
}

/// Another filesystem mounted over the external images directory, holding
/// a tree named as an image and no claim: a read, a rewrite, a copy from
/// the image, `rm`, gc and a plain `init` are each refused before anything
/// runs (the path is the recorded one, the directory is not), so nothing
/// of it is read, written, deleted or adopted, and the image is there,
/// ready, once the right filesystem is back.
#[test]
fn another_filesystem_over_the_external_images_directory_is_never_read_written_or_removed() {
    let env = Env::new();
    let Some(right) = env.init_on_tmpfs() else {
        return;
    };
    env.make_image("app");
    let images = right.dir.clone();
    let Some(wrong) = Mount::tmpfs_at(&images, "1m") else {
        return;
    };
    fs::create_dir(images.join("app")).unwrap();
    fs::write(images.join("app/data"), "theirs\n").unwrap();
    let ran = env.sentinel("ran");
    let touch = ["touch", ran.to_str().unwrap()];
    let refused = |args: &[&str], out: &std::process::Output| {
        assert_eq!(code(out), Some(1), "{args:?}: {}", show(out));
        let err = stderr(out);
        assert!(
            err.contains("not the directory recorded"),
            "{args:?}: {}",
            show(out)
        );
        assert!(err.contains("init --images-dir"), "{args:?}: {}", show(out));
    };
    for args in [
        &["exec", "--read", "app", "--"][..],
        &["exec", "--write", "app", "--"],
        &["exec", "--write", "copy", "--from", "app", "--"],
    ] {
        refused(args, &env.run([args, &touch].concat()));
        assert!(!ran.exists(), "{args:?}: the command ran");
    }
    for args in [&["rm", "app"][..], &["gc", "--max-size", "0"], &["init"]] {
        let out = env.run(args);
        refused(args, &out);
        // Nothing measured there: no usage is claimed.
        assert!(!stdout(&out).contains("images now use"), "{}", show(&out));
    }
    let out = env.run(["gc", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["measured"], false, "{report}");
    assert_eq!(tree(&images), ["app", "app/data"]);
    assert_eq!(
        fs::read_to_string(images.join("app/data")).unwrap(),
        "theirs\n"
    );
    drop(wrong);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.state("copy"), None);
    assert_eq!(env.read_in_image("app", "file"), "content\n");
    env.ok(["exec", "--write", "new", "--", "true"]);
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
fn nothing_is_removed_while_the_images_directory_is_unmounted() {
    let env = Env::new();
    let Some(m) = env.init_on_tmpfs() else {
        return;
    };
    for name in ["a", "b", "c"] {
        env.make_image(name);
    }
    let (aside, _m) = unmount_aside(&env, m);
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

/// Moves the images filesystem `m` away, as an unmount would (keeping its
/// trees, now in the directory returned), leaving the empty mount point.
fn unmount_aside(env: &Env, m: Mount) -> (PathBuf, Mount) {
    let aside = env.tmp.path().join("aside");
    fs::create_dir(&aside).unwrap();
    let moved = Command::new("mount")
        .arg("--move")
        .arg(&m.dir)
        .arg(&aside)
        .status()
        .is_ok_and(|s| s.success());
    assert!(moved);
    std::mem::forget(m);
    let m = Mount::adopt(&aside);
    (aside, m)
}

/// A new image made while the images directory is unmounted would go into
/// the bare mount point, hidden once the filesystem is back, its record
/// then without a tree: it is refused before anything is recorded or made.
#[test]
fn no_new_image_is_made_while_the_images_directory_is_unmounted() {
    let env = Env::new();
    let Some(m) = env.init_on_tmpfs() else {
        return;
    };
    let images = m.dir.clone();
    env.make_image("a");
    let (aside, _m) = unmount_aside(&env, m);
    let ran = env.sentinel("ran");
    let touch = ["touch", ran.to_str().unwrap()];
    let out = env.run([&["exec", "--write", "new", "--"][..], &touch].concat());
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("mounted"), "{}", show(&out));
    assert!(!ran.exists(), "the command ran");
    assert_eq!(
        fs::read_dir(&images).unwrap().count(),
        0,
        "made in the mount point"
    );
    assert_eq!(env.state("new"), None, "{}", show(&out));
    assert!(!env.root.join("locks/images/new.lock").exists());
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    assert!(aside.join("a/file").exists());
}

/// The default images directory is no different: a disk mounted on
/// `ROOT/img` (accepted by `init --images-dir ROOT/img`) and then unmounted
/// leaves the bare mount point, where a new image would be hidden once the
/// disk is back (and a repair would then drop its record as a gone tree).
/// It is refused before anything is recorded or made, as is a rewrite and
/// a plain `init`; back again, nothing was lost and nothing is dropped.
#[test]
fn no_new_image_is_made_while_the_default_images_directory_is_unmounted() {
    if !root_or_skip("mounting a tmpfs") {
        return;
    }
    let env = Env::new();
    env.ok(["init"]);
    let img = env.images_dir();
    let Some(m) = Mount::tmpfs_at(&img, "4m") else {
        return;
    };
    env.ok(["init", "--images-dir", img.to_str().unwrap()]);
    env.make_image("base");
    let (aside, m) = unmount_aside(&env, m);
    let ran = env.sentinel("ran");
    let touch = ["touch", ran.to_str().unwrap()];
    for args in [
        &["exec", "--write", "new", "--"][..],
        &["exec", "--write", "base", "--"],
    ] {
        let out = env.run([args, &touch].concat());
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(err.contains("not the directory recorded"), "{}", show(&out));
        assert!(!ran.exists(), "{args:?}: the command ran");
    }
    let out = env.run(["init"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert_eq!(
        fs::read_dir(&img).unwrap().count(),
        0,
        "made in the mount point"
    );
    assert_eq!(env.state("new"), None);
    assert!(!env.lock_file("new").exists());
    // Mounted again: the image is there, ready, and a repair drops nothing.
    let back = Command::new("mount")
        .arg("--move")
        .arg(&aside)
        .arg(&img)
        .status();
    assert!(back.is_ok_and(|s| s.success()));
    std::mem::forget(m);
    let _m = Mount::adopt(&img);
    let out = env.ok(["doctor", "--repair"]);
    assert!(!stdout(&out).contains("dropped"), "{}", show(&out));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("base", "file"), "content\n");
    env.ok(["exec", "--write", "new", "--", "true"]);
}

/// A write of an image while its images directory is not the one
/// recorded (unmounted, leaving the empty mount point; or another
/// directory put in its place) would run the command where nobody looks
/// and leave the image incomplete once the directory is back: it is
/// refused before the command runs, the record as it was.
#[test]
fn a_write_while_the_images_directory_is_not_the_recorded_one_is_refused_before_it_starts() {
    let env = Env::new();
    env.make_image("base");
    let img = env.images_dir();
    let aside = env.tmp.path().join("img-aside");
    fs::rename(&img, &aside).unwrap();
    fs::create_dir(&img).unwrap();
    let ran = env.sentinel("ran");
    let out = env.run([
        "exec",
        "--write",
        "base",
        "--",
        "touch",
        ran.to_str().unwrap(),
    ]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("not the directory recorded"),
        "{}",
        show(&out)
    );
    assert!(!ran.exists(), "the command ran");
    fs::remove_dir(&img).unwrap();
    fs::rename(&aside, &img).unwrap();
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("base", "file"), "content\n");
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

// --- mounts inside image trees ----------------------------------------------

#[test]
fn a_mount_inside_an_image_stops_its_deletion() {
    if !root_or_skip("bind mounts") {
        return;
    }
    let env = Env::new();
    env.build("a", "mkdir \"$STOWAGE_IMAGE_DIR/mnt\"");
    // A build that bind-mounted a directory of the same filesystem into its
    // tree and died before unmounting it.
    let v = victim(&env);
    let mnt = env.root.join("img/a/mnt");
    let ok = Command::new("mount")
        .arg("--bind")
        .arg(&v)
        .arg(&mnt)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipping: cannot bind-mount here");
        return;
    }
    let out = env.run(["rm", "a"]);
    let trash = env.root.join("trash");
    let left: Vec<PathBuf> = fs::read_dir(&trash)
        .unwrap()
        .map(|e| e.unwrap().path().join("mnt"))
        .collect();
    for m in left.iter().chain([&mnt]) {
        let _ = Command::new("umount").arg(m).status();
    }
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("mount point"), "{}", show(&out));
    assert_intact(&v);
    // Unmounted, the leftover goes with the next gc.
    env.ok(["gc"]);
    assert_eq!(fs::read_dir(&trash).unwrap().count(), 0);
    assert_intact(&v);
}

/// A filesystem mounted on a tree without a record after a repair found
/// it, before it adopts it, is not adopted: it was, as an image of unknown
/// readiness (by `init`, as ready), though it is no tree of the store's.
#[test]
fn a_mount_made_on_a_tree_being_adopted_is_not_adopted() {
    if !root_or_skip("mounting a tmpfs") {
        return;
    }
    let env = Env::new();
    env.ok(["init"]);
    let tree = env.images_dir().join("orphan");
    fs::create_dir(&tree).unwrap();
    fs::write(tree.join("f"), "x").unwrap();
    let (bg, go) = env.paused(["doctor", "--repair"], "doctor-orphans-found");
    let m = Mount::tmpfs_at(&tree, "1m");
    fs::remove_file(&go).unwrap();
    let out = bg.finish();
    assert!(m.is_some(), "cannot mount a tmpfs here");
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stdout(&out).contains("mount point"), "{}", show(&out));
    assert!(env.image("orphan").is_none(), "a mount point was adopted");
    drop(m);
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("orphan").as_deref(), Some("incomplete"));
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

/// A mount deeper below an image's top (a bind mount a build left at `sub/mnt`) stops a rebuild
/// from a base by root before anything is deleted: the image keeps its files and stays `ready`.
/// Before, the walk that checks the tree first passed over mounts (and root skipped it), so the
/// files beside it were deleted and the image left `incomplete`.
#[test]
fn a_mount_below_the_top_of_an_image_stops_its_rebuild_before_anything_is_deleted() {
    if !root_or_skip("bind mounts") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    env.build(
        "app",
        "cd \"$STOWAGE_IMAGE_DIR\" && echo 1 > a1 && echo 2 > a2 && mkdir -p sub/mnt",
    );
    let v = victim(&env);
    let app = env.root.join("img/app");
    let Some(_m) = Mount::at(&["--bind", v.to_str().unwrap()], &app.join("sub/mnt")) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    let out = env.run(["exec", "--write", "app", "--from", "base", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("sub/mnt")
            && err.contains("mount point")
            && err.contains("nothing was deleted"),
        "{err}"
    );
    assert_eq!(names_at(&app), ["a1", "a2", "sub"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_intact(&v);
}

/// Removing in place (the images directory on another filesystem than the root) an image with a
/// mount below its top deletes nothing: refused first, the removal undone, the image `ready`.
/// Before, the files beside the mount were deleted first.
#[test]
fn removing_in_place_deletes_nothing_of_an_image_with_a_mount_below_its_top() {
    let env = Env::new();
    let Some(tmpfs) = env.init_on_tmpfs() else {
        return;
    };
    env.build(
        "app",
        "cd \"$STOWAGE_IMAGE_DIR\" && echo 1 > a1 && echo 2 > a2 && mkdir -p sub/mnt",
    );
    let app = tmpfs.dir.join("app");
    let v = victim(&env);
    let Some(_m) = Mount::at(&["--bind", v.to_str().unwrap()], &app.join("sub/mnt")) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    let out = env.run(["rm", "app"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("mount point") && err.contains("nothing was deleted"),
        "{err}"
    );
    assert_eq!(names_at(&app), ["a1", "a2", "sub"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_intact(&v);
}

/// A mount at an image's own directory (a bind mount a build left at `img/app`, or a filesystem
/// of its own there) is never emptied by a rebuild from a base: the walk's check of mounts began
/// below the top, so the mounted directory, outside the store, was emptied and the copy written
/// into it. A base that is a mount point is refused too, before anything is emptied: a bind mount
/// of the images directory at its top made the copy copy itself until it ran out of descriptors.
#[test]
fn rebuilding_from_a_base_never_empties_a_mount_at_the_image_directory_itself() {
    if !root_or_skip("bind mounts") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    env.make_image("app");
    let v = victim(&env);
    let Some(m) = Mount::at(&["--bind", v.to_str().unwrap()], &env.root.join("img/app")) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    let out = env.run(["exec", "--write", "app", "--from", "base", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("is a mount point"), "{}", show(&out));
    assert_intact(&v);
    drop(m);
    env.make_image("mb");
    fs::write(env.root.join("img/app/kept"), "app's own").unwrap();
    let img = env.root.join("img");
    let Some(_m) = Mount::at(&["--bind", img.to_str().unwrap()], &img.join("mb")) else {
        return;
    };
    let out = env.run(["exec", "--write", "app", "--from", "mb", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("a copy takes nothing across a mount"),
        "{}",
        show(&out)
    );
    let kept = fs::read_to_string(env.root.join("img/app/kept")).unwrap();
    assert_eq!(kept, "app's own");
}

/// A mount made at the image's directory after the rebuild looked at it (the moment between the
/// look and the emptying, or between the emptying and the copy) is neither emptied nor written:
/// both opened the directory again by its name.
#[test]
fn a_mount_made_at_the_image_directory_during_a_rebuild_is_neither_emptied_nor_written() {
    if !root_or_skip("bind mounts") {
        return;
    }
    for point in ["tree-checked", "clone-emptied"] {
        let env = Env::new();
        env.make_image("base");
        env.build("app", "touch \"$STOWAGE_IMAGE_DIR/old\"");
        let v = victim(&env);
        let args = ["exec", "--write", "app", "--from", "base", "--", "true"];
        let (bg, go) = env.paused(args, point);
        let m = Mount::at(&["--bind", v.to_str().unwrap()], &env.root.join("img/app"));
        fs::remove_file(&go).unwrap();
        let out = bg.finish();
        drop(m);
        assert_eq!(code(&out), Some(1), "{point}: {}", show(&out));
        assert!(
            stderr(&out).contains("mount point"),
            "{point}: {}",
            show(&out)
        );
        assert_intact(&v);
        let written = "the mounted directory was written";
        assert_eq!(names_at(&v), ["keep", "sub"], "{point}: {written}");
    }
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

#[test]
fn a_bind_mount_of_the_same_filesystem_inside_a_base_is_neither_copied_nor_counted() {
    if !root_or_skip("bind mounts") {
        return;
    }
    let env = Env::new();
    env.build(
        "base",
        "mkdir \"$STOWAGE_IMAGE_DIR/mnt\" && echo own > \"$STOWAGE_IMAGE_DIR/own\"",
    );
    // A build bind-mounted a host directory of the store's own filesystem into its tree and
    // died before unmounting it: the device number is the tree's, only the mount differs.
    let v = victim(&env);
    fs::write(v.join("big"), vec![7u8; 4 << 20]).unwrap();
    let Some(_m) = Mount::at(
        &["--bind", v.to_str().unwrap()],
        &env.root.join("img/base/mnt"),
    ) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    let images = env.images_json();
    let size = images[0]["size_bytes"].as_u64().unwrap();
    assert!(size < 1 << 20, "the host's files were counted: {images:?}");
    let out = env.ok(["exec", "--write", "app", "--from", "base", "--", "true"]);
    let app = env.root.join("img/app");
    assert_eq!(fs::read_to_string(app.join("own")).unwrap(), "own\n");
    let copied = fs::read_dir(app.join("mnt")).unwrap().count();
    assert_eq!(copied, 0, "the host's files were copied: {}", show(&out));
    assert!(stderr(&out).contains("mount point"), "{}", show(&out));
    assert_intact(&v);
}

// --- network and cluster filesystems ----------------------------------------

/// A mountinfo that puts the test's directory on a filesystem of `fstype`
/// mounted with `options` (read through the hidden hook, with the
/// filesystem type faked the same way).
fn fake_mount(env: &Env, cmd: &mut Command, fstype: &str, options: &str) {
    let dir = fs::canonicalize(env.tmp.path()).unwrap();
    let info = env.sentinel("mountinfo");
    fs::write(
        &info,
        format!(
            "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n\
             101 22 0:60 / {} rw,relatime - {fstype} srv:/export {options}\n",
            dir.display()
        ),
    )
    .unwrap();
    cmd.env(stowage::env::DEBUG_FILESYSTEM, fstype)
        .env(stowage::env::DEBUG_MOUNTINFO, &info);
}

#[test]
fn node_local_locking_on_lustre_and_beegfs_is_refused() {
    let env = Env::new();
    // A store that exists, so that doctor has one to look at.
    env.ok(["init"]);
    let conf = env.sentinel("beegfs-client.conf");
    for (fstype, options, conf_text, refused) in [
        ("lustre", "rw,localflock", "", Some("localflock")),
        ("lustre", "rw,noflock", "", Some("noflock")),
        ("lustre", "rw,flock", "", None),
        (
            "beegfs",
            "rw,cfgFile=CONF",
            "tuneUseGlobalFileLocks = false\n",
            Some("tuneUseGlobalFileLocks"),
        ),
        (
            "beegfs",
            "rw,cfgFile=CONF",
            "sysMgmtdHost = m\n",
            Some("tuneUseGlobalFileLocks"),
        ),
        (
            "beegfs",
            "rw,cfgFile=CONF",
            "tuneUseGlobalFileLocks = true\n",
            None,
        ),
        (
            "nfs",
            "rw,vers=4.2,local_lock=flock",
            "",
            Some("local_lock=flock"),
        ),
    ] {
        fs::write(&conf, conf_text).unwrap();
        let options = options.replace("CONF", conf.to_str().unwrap());
        let case = format!("{fstype} {options} {conf_text:?}");
        let mut c = env.cmd(["exec", "--write", "app", "--", "true"]);
        fake_mount(&env, &mut c, fstype, &options);
        let out = output(c);
        let mut d = env.cmd(["doctor"]);
        fake_mount(&env, &mut d, fstype, &options);
        let doc = output(d);
        match refused {
            Some(word) => {
                assert_eq!(out.status.code(), Some(69), "{case}: {}", show(&out));
                assert!(stderr(&out).contains(word), "{case}: {}", show(&out));
                assert_eq!(
                    stderr(&out).trim_end().lines().count(),
                    1,
                    "{case}: {}",
                    show(&out)
                );
                assert_eq!(doc.status.code(), Some(69), "{case}: {}", show(&doc));
                assert!(
                    String::from_utf8_lossy(&doc.stdout).contains(word),
                    "{case}: {}",
                    show(&doc)
                );
            }
            None => {
                assert_eq!(out.status.code(), Some(0), "{case}: {}", show(&out));
                assert_ne!(doc.status.code(), Some(69), "{case}: {}", show(&doc));
            }
        }
    }
    // Lustre without either option cannot be judged: doctor says how to
    // check, and nothing is refused.
    let mut d = env.cmd(["doctor"]);
    fake_mount(&env, &mut d, "lustre", "rw,lazystatfs");
    let doc = output(d);
    assert_ne!(doc.status.code(), Some(69), "{}", show(&doc));
    assert!(
        String::from_utf8_lossy(&doc.stdout).contains("--hold-probe"),
        "{}",
        show(&doc)
    );
}

#[test]
fn on_a_shared_filesystem_lock_files_are_never_unlinked() {
    // The hidden hook makes the store look like NFS: a stat of a path may
    // then be stale (another host's unlink unseen), so no lock file is
    // ever unlinked, and the check after locking re-opens the path.
    let env = Env::new();
    let nfs = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
        output(c)
    };
    let out = nfs(&["exec", "--write", "app", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let out = nfs(&["rm", "app"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(env.lock_file("app").exists(), "kept after rm");
    let out = {
        use std::os::unix::fs::PermissionsExt;
        let cmd = env.scratch.join("vanishing-builder");
        fs::write(&cmd, "#!/bin/sh\n").unwrap();
        fs::set_permissions(&cmd, fs::Permissions::from_mode(0o755)).unwrap();
        let go = env.sentinel("paused.exec-before-spawn");
        let mut c = env.cmd(["exec", "--write", "new", "--", cmd.to_str().unwrap()]);
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
        c.env(
            stowage::env::DEBUG_PAUSE,
            format!("exec-before-spawn:{}", go.display()),
        );
        let bg = Bg::from_command(c);
        wait_for_file(&go);
        fs::remove_file(&cmd).unwrap();
        fs::remove_file(&go).unwrap();
        bg.finish()
    };
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(env.lock_file("new").exists(), "kept after a failed start");
    // Kept lock files are no leftovers there.
    let out = nfs(&["doctor"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    // The name comes back: the kept file is reused.
    let out = nfs(&["exec", "--write", "app", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));

    // A ghost made anyway — by a host that sees the store as local (the
    // NFS server itself) or an older release: a waiter blocked on the file
    // it unlinks retries on the new one, verified by re-opening the path.
    let (remover, go) = env.paused(["rm", "app"], "rm-moved");
    let mut c = env.cmd(["exec", "--write", "app", "--", "true"]);
    c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
    let waiter = Bg::from_command(c);
    env.wait_for_waiter("app");
    fs::remove_file(go).unwrap();
    assert_eq!(remover.finish().status.code(), Some(0));
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert!(flock_free(&env.lock_file("app")));
}

#[test]
fn a_write_lock_lost_while_the_command_ran_makes_the_image_incomplete() {
    // No NFS here: the hidden hook makes the check of app's lock fail as a
    // lost NFS lock does (the Linux client fails I/O on it with EIO).
    let env = Env::new();
    env.make_image("base");
    let mut c = env.cmd(["exec", "--read", "base", "--write", "app", "--", "true"]);
    c.env(stowage::env::DEBUG_LOST_LOCK, "app.lock");
    let out = output(c);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("lost the write lock on image 'app'"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    // Only written images are checked: base, read, is untouched.
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    // And an intact lock records ready as before.
    env.ok(["exec", "--write", "app", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// A lock lost while nobody held it is taken again by the check before the
/// outcome (GlusterFS reopens a file after a reconnect without its locks):
/// what another host did meanwhile shows in the record, and the writer
/// never records `ready` over it. Here the test plays the other host,
/// writing into the lock file as it would: a removal empties it; another
/// writer's outcome replaces the record.
#[test]
fn a_record_changed_while_the_write_lock_was_lost_is_never_made_ready() {
    let env = Env::new();
    env.make_image("app");
    let lock = env.lock_file("app");
    let ready = fs::read(&lock).unwrap();
    for (other, then) in [(ready.clone(), Some("incomplete")), (Vec::new(), None)] {
        let flag = env.sentinel("changed");
        let _ = fs::remove_file(&flag);
        let script = format!("while [ ! -e '{}' ]; do sleep 0.01; done", flag.display());
        let writer = env.spawn(["exec", "--write", "app", "--", "sh", "-c", &script]);
        wait_until("the write's record", || {
            env.state("app").as_deref() == Some("writing")
        });
        fs::write(&lock, &other).unwrap();
        fs::write(&flag, "").unwrap();
        let out = writer.finish();
        assert_eq!(code(&out), Some(1), "{}", show(&out));
        let err = stderr(&out);
        assert!(err.contains("lost the write lock on image 'app'"), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert_eq!(env.state("app").as_deref(), then, "{err}");
        if other.is_empty() {
            assert!(fs::read(&lock).unwrap().iter().all(|&b| b == 0));
        }
        fs::write(&lock, &ready).unwrap();
    }
}

/// Where a read lock may be lost while held (a shared filesystem: here the
/// hidden hook makes the store look like NFS), an image read must be as it
/// was read when the command ends, or when a copy from it ends: another
/// host may have written it meanwhile. The test plays that host, writing
/// a later record of the image into its lock file. The command's result is
/// then no use: exit 1, and what it wrote is incomplete.
#[test]
fn an_image_changed_while_read_under_a_lock_that_may_be_lost_fails_the_read() {
    let env = Env::new();
    env.make_image("base");
    let lock = env.lock_file("base");
    let before = fs::read(&lock).unwrap();
    env.ok(["exec", "--write", "base", "--", "true"]);
    let later = fs::read(&lock).unwrap();
    let nfs = |args: &[&str], point: &str| {
        let flag = env.sentinel(&format!("paused.{point}"));
        let mut c = env.cmd(args);
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
        c.env(
            stowage::env::DEBUG_PAUSE,
            format!("{point}:{}", flag.display()),
        );
        (Bg::from_command(c), flag)
    };
    let hold = ["sh", "-c", "sleep 0.5"];
    for (args, then, said) in [
        (
            vec!["--read", "base"],
            None,
            "changed while the command read it",
        ),
        (
            vec!["--read", "base", "--write", "app"],
            Some("incomplete"),
            "what it wrote is incomplete",
        ),
        (
            vec!["--write", "copy", "--from", "base"],
            Some("incomplete"),
            "changed while copied to 'copy'",
        ),
    ] {
        fs::write(&lock, &before).unwrap();
        let point = if args.contains(&"--from") {
            "clone-emptied"
        } else {
            "exec-before-spawn"
        };
        let mut all = vec!["exec"];
        all.extend(&args);
        all.push("--");
        all.extend(hold);
        let (bg, flag) = nfs(&all, point);
        wait_for_file(&flag);
        fs::write(&lock, &later).unwrap();
        fs::remove_file(&flag).unwrap();
        let out = bg.finish();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains("image 'base' ") && err.contains(said),
            "{args:?}: {err}"
        );
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        let written = args.iter().rfind(|a| ["app", "copy"].contains(a));
        assert_eq!(
            written.and_then(|w| env.state(w)).as_deref(),
            then,
            "{args:?}"
        );
    }
    // Unchanged, the same reads end as their commands do.
    fs::write(&lock, &later).unwrap();
    let mut c = env.cmd(["exec", "--write", "copy", "--from", "base", "--", "true"]);
    c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("copy").as_deref(), Some("ready"));
}

/// The hint a writer that lost its lock leaves (`F` and a record's
/// fingerprint at byte 8216) is for the writer whose record in flight it
/// names: a reader of that image, or an exclusive reader, never fails for
/// it, whatever record it names. Planted here by hand, on a store seen as
/// shared (where reads check their record at their end).
#[test]
fn a_lost_writers_hint_never_fails_a_read() {
    use std::os::unix::fs::FileExt;
    let env = Env::new();
    env.make_image("a");
    let lock = env.lock_file("a");
    let record = || {
        let file = fs::File::open(&lock).unwrap();
        let seen = stowage::image_record::read(&file).unwrap();
        seen.record.unwrap()
    };
    let shared = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
        output(c)
    };
    let names: [fn(&stowage::image_record::Record) -> u64; 3] =
        [|r| r.fingerprint(), |r| r.seq, |r| r.seq + 1];
    for name in names {
        let named = name(&record());
        let file = fs::OpenOptions::new().write(true).open(&lock).unwrap();
        file.write_all_at(format!("F{named:016x}").as_bytes(), 8216)
            .unwrap();
        for args in [
            &["exec", "--read", "a", "--", "true"][..],
            &["exec", "--read-exclusive", "a", "--", "true"],
        ] {
            let out = shared(args);
            assert_eq!(
                code(&out),
                Some(0),
                "F{named:016x}, {args:?}: {}",
                show(&out)
            );
        }
        assert_eq!(env.state("a").as_deref(), Some("ready"));
    }
}

/// The root's filesystem comes from the mount table by the root's device,
/// whatever mount point the table lists it at (a bind mount seen
/// elsewhere): NFS mounted so that locks stay on each client is refused
/// (69), for reads and writes alike. The root is put on a tmpfs of its
/// own, whose device is anonymous (major 0) as an NFS mount's is.
#[test]
fn nfs_without_server_locks_found_by_device_in_the_mount_table_is_refused() {
    use std::os::unix::fs::MetadataExt;
    if !root_or_skip("mounting a tmpfs") {
        return;
    }
    let env = Env::new();
    fs::create_dir(&env.root).unwrap();
    let Some(_mount) = Mount::tmpfs_at(&env.root, "16m") else {
        return;
    };
    env.make_image("X");
    let dev = fs::metadata(&env.root).unwrap().dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    assert_eq!(major, 0);
    let info = env.sentinel("mountinfo");
    for options in ["rw,vers=3,nolock", "rw,vers=4.2,local_lock=all"] {
        fs::write(
            &info,
            format!(
                "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n\
                 23 22 0:4 / /proc rw - proc proc rw\n\
                 101 22 {major}:{minor} / /elsewhere rw,relatime - nfs srv:/export {options}\n"
            ),
        )
        .unwrap();
        for args in [
            &["exec", "--read", "X", "--", "true"][..],
            &["exec", "--write", "X", "--", "true"][..],
        ] {
            let mut c = env.cmd(args);
            c.env(stowage::env::DEBUG_MOUNTINFO, &info);
            let out = output(c);
            assert_eq!(code(&out), Some(69), "{options} {args:?}: {}", show(&out));
            assert!(stderr(&out).contains("NFS"), "{}", show(&out));
        }
    }
    assert_eq!(env.state("X").as_deref(), Some("ready"));
}

/// The mount table is read only as far as the root's mount: on a host
/// with thousands of mounts, reading all of it costs milliseconds per
/// command. Shown without a clock: the table is a FIFO whose writer,
/// having written the root's mount, keeps it open until the command has
/// run — a reader of the whole table would wait for its end until the
/// writer gives up (bounded) and says so.
#[test]
fn the_mount_table_is_read_no_further_than_the_roots_mount() {
    use std::os::unix::fs::MetadataExt;
    if !root_or_skip("mounting a tmpfs") {
        return;
    }
    let env = Env::new();
    fs::create_dir(&env.root).unwrap();
    let Some(_mount) = Mount::tmpfs_at(&env.root, "16m") else {
        return;
    };
    env.make_image("X");
    let dev = fs::metadata(&env.root).unwrap().dev();
    let fifo = env.sentinel("mountinfo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let ran = env.sentinel("ran");
    let gave_up = env.sentinel("gave-up");
    let mut w = Command::new("sh");
    w.arg("-c").arg(format!(
        "exec 3>'{f}'; printf '101 22 {maj}:{min} / /elsewhere rw - tmpfs tmpfs rw\\n' >&3; \
         i=0; while [ ! -e '{r}' ] && [ $i -lt 2000 ]; do sleep 0.01; i=$((i+1)); done; \
         [ -e '{r}' ] || touch '{g}'",
        f = fifo.display(),
        maj = libc::major(dev),
        min = libc::minor(dev),
        r = ran.display(),
        g = gave_up.display()
    ));
    let writer = Bg::from_command(w);
    let mut c = env.cmd(["exec", "--read", "X", "--", "touch"]);
    c.arg(&ran).env(stowage::env::DEBUG_MOUNTINFO, &fifo);
    let out = output(c);
    let wrote = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(code(&wrote), Some(0), "{}", show(&wrote));
    assert!(
        !gave_up.exists(),
        "the mount table was read past the root's mount, to its end"
    );
}

/// On FUSE (GlusterFS), a wait never leaves a lock request blocked in the
/// kernel to be interrupted: it tries again and again without blocking.
/// GlusterFS 10's client wedged, the whole mount with it, when a host that
/// held a lock crashed while two processes of another host sat in
/// interrupted blocked requests. Elsewhere off this machine (NFS) a wait
/// still blocks.
#[test]
fn on_fuse_a_wait_never_blocks_in_a_lock_request() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    let lock = env.lock_file("a");
    let release = env.sentinel("release");
    let wait_for = format!(
        "while [ ! -e '{}' ]; do sleep 0.05; done",
        release.display()
    );
    for (fstype, blocks) in [("fuse", false), ("nfs", true)] {
        let _ = fs::remove_file(&release);
        let held = env.sentinel(&format!("held-{fstype}"));
        let holder = flock_holder(&lock, &held, &wait_for);
        let log = env.sentinel(&format!("flock-{fstype}.log"));
        let mut c = Command::new("strace");
        c.args(["-f", "-e", "trace=flock", "-o"])
            .arg(&log)
            .arg(bin())
            .arg("--root")
            .arg(&env.root)
            .args(["exec", "--write", "a", "--", "true"])
            .env(stowage::env::DEBUG_FILESYSTEM, fstype);
        let writer = Bg::from_command(c);
        wait_until("the writer waits", || {
            fs::read_to_string(&log).is_ok_and(|l| l.matches("LOCK_EX").count() >= 3)
        });
        fs::write(&release, "").unwrap();
        for out in [holder.finish(), writer.finish()] {
            assert_eq!(code(&out), Some(0), "{}", show(&out));
        }
        let log = fs::read_to_string(&log).unwrap();
        let blocked = log
            .lines()
            .any(|l| l.contains("flock(") && l.contains("LOCK_EX") && !l.contains("LOCK_NB"));
        assert_eq!(blocked, blocks, "{fstype}:\n{log}");
    }
}

/// A loop device attached to a file while it lives: it takes the lowest free
/// device number, as disks and LVM volumes take theirs as they come up.
struct Attached(String);

impl Drop for Attached {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// A store whose root and images directory are on one XFS, once its disk
/// comes up under another device number (at the next boot: XFS tells its
/// filesystem id from the device): the store is used as before, its images
/// read and new ones made, as it knows the filesystem by its UUID.
#[test]
fn a_store_on_xfs_is_used_as_before_once_its_disk_is_renumbered() {
    if !root_or_skip("loop mounts") || !tool_or_skip("mkfs.xfs", "xfsprogs") {
        return;
    }
    let mut env = Env::new();
    let (img, dir) = (env.tmp.path().join("x.xfs"), env.tmp.path().join("mnt"));
    let mount = || Mount::at(&["-o", "loop", img.to_str().unwrap()], &dir);
    let Some(m) = xfs_file(&img, &dir).then(mount).flatten() else {
        eprintln!("skipping: cannot make and mount an XFS loop device here");
        return;
    };
    env.root = dir.join("root");
    let images = dir.join("img");
    fs::create_dir(&images).unwrap();
    env.ok(["init", "--images-dir", images.to_str().unwrap()]);
    env.make_image("base");
    drop(m);
    let dummy = env.tmp.path().join("dummy");
    fs::File::create(&dummy).unwrap().set_len(1 << 20).unwrap();
    let out = Command::new("losetup")
        .args(["-f", "--show"])
        .arg(&dummy)
        .output()
        .unwrap();
    let _taken = Attached(String::from_utf8_lossy(&out.stdout).trim().to_owned());
    let _m = mount().expect("mounted again");
    env.ok(["exec", "--read", "base", "--", "true"]);
    env.ok(["exec", "--write", "new", "--", "true"]);
    env.ok(["doctor"]);
}

/// A fresh XFS in the file `img`, and a directory `dir` to mount it on.
fn xfs_file(img: &Path, dir: &Path) -> bool {
    fs::File::create(img).unwrap().set_len(300 << 20).unwrap();
    fs::create_dir(dir).unwrap();
    let made = Command::new("mkfs.xfs")
        .args(["-q", "-f"])
        .arg(img)
        .status();
    made.is_ok_and(|s| s.success())
}

/// A block-level copy of the XFS a store's root is on (a cloned disk, an
/// LVM snapshot), mounted beside it: the same UUID and inode numbers, on
/// another device. Its copy of the store may not write the external images
/// directory the store claims: its locks are not the store's.
#[test]
fn a_cloned_xfs_mounted_beside_its_original_is_a_copy_of_the_store() {
    if !root_or_skip("loop mounts") || !tool_or_skip("mkfs.xfs", "xfsprogs") {
        return;
    }
    let mut env = Env::new();
    let t = env.tmp.path().to_owned();
    let (img, dir) = (t.join("x.xfs"), t.join("mnt"));
    let Some(_m) = xfs_file(&img, &dir)
        .then(|| Mount::at(&["-o", "loop", img.to_str().unwrap()], &dir))
        .flatten()
    else {
        eprintln!("skipping: cannot make and mount an XFS loop device here");
        return;
    };
    env.root = dir.join("root");
    let images = t.join("img");
    fs::create_dir(&images).unwrap();
    env.ok(["init", "--images-dir", images.to_str().unwrap()]);
    env.make_image("base");
    // Copied frozen, as a snapshot is taken: the original stays on its device.
    let freeze = |how: &str| Command::new("fsfreeze").arg(how).arg(&dir).status();
    assert!(freeze("-f").is_ok_and(|s| s.success()), "fsfreeze");
    let copied = fs::copy(&img, t.join("clone.xfs"));
    assert!(freeze("-u").is_ok_and(|s| s.success()), "fsfreeze -u");
    copied.unwrap();
    let (clone, clone_dir) = (t.join("clone.xfs"), t.join("clone"));
    fs::create_dir(&clone_dir).unwrap();
    let o = ["-o", "loop,nouuid", clone.to_str().unwrap()];
    let _c = Mount::at(&o, &clone_dir).expect("the clone mounted");
    let mut copy = Env::new();
    copy.root = clone_dir.join("root");
    let out = copy.run(["exec", "--write", "base", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("a copy of the other"),
        "{}",
        show(&out)
    );
    // The original hidden by a later mount over its mount point is still mounted: still a copy.
    let hide = Mount::tmpfs_at(&dir, "1m").expect("a tmpfs over the original");
    let out = copy.run(["exec", "--write", "base", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    drop(hide);
    env.ok(["exec", "--write", "base", "--", "true"]);
}

/// An images directory on a filesystem that keeps no extended attributes
/// (ramfs here; NFSv3) can never carry the store's claim: it is judged by
/// its path only, never by what it holds. Images named as a system tree's
/// directories and a stray file there made a plain `init` refuse the store
/// and `doctor` skip every check of records against trees.
#[test]
fn an_images_directory_without_extended_attributes_is_judged_by_its_path_only() {
    if !root_or_skip("mounting a ramfs") {
        return;
    }
    let env = Env::new();
    let images = env.tmp.path().join("images");
    fs::create_dir(&images).unwrap();
    let Some(_m) = Mount::ramfs_at(&images) else {
        return;
    };
    env.ok(["init", "--images-dir", images.to_str().unwrap()]);
    for name in ["bin", "lib", "app"] {
        env.make_image(name);
    }
    fs::write(images.join("notes.txt"), "kept").unwrap();
    env.ok(["init"]);
    env.ok(["doctor"]);
    fs::remove_dir_all(images.join("app")).unwrap();
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stdout(&out).contains("'app'"), "{}", show(&out));
}

/// On an overlay filesystem a file reports the device of the layer that
/// holds it, not the directory's: an image there is measured by what its
/// files hold. Every file was taken for another mount and left out, so
/// images measured 0 B and `gc --max-size` never freed anything.
#[test]
fn an_image_on_an_overlay_filesystem_is_measured_with_its_files() {
    if !root_or_skip("mounting an overlay") {
        return;
    }
    let env = Env::new();
    let t = env.tmp.path();
    for d in ["lower", "upper-fs", "merged"] {
        fs::create_dir(t.join(d)).unwrap();
    }
    let Some(_up) = Mount::tmpfs_at(&t.join("upper-fs"), "16m") else {
        return;
    };
    for d in ["upper-fs/u", "upper-fs/w"] {
        fs::create_dir(t.join(d)).unwrap();
    }
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        t.join("lower").display(),
        t.join("upper-fs/u").display(),
        t.join("upper-fs/w").display()
    );
    let merged = t.join("merged");
    let Some(_m) = Mount::at(&["-t", "overlay", "overlay", "-o", &opts], &merged) else {
        eprintln!("skipping: cannot mount an overlay here");
        return;
    };
    let root = merged.join("root");
    let mut c = Command::new(bin());
    c.arg("--root").arg(&root).args([
        "exec",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        "head -c 1048576 /dev/zero > \"$STOWAGE_IMAGE_DIR/big\"",
    ]);
    assert_eq!(code(&output(c)), Some(0));
    let mut c = Command::new(bin());
    c.arg("--root").arg(&root).args(["images", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&output(c).stdout).unwrap();
    let size = listed[0]["size_bytes"].as_u64().unwrap_or(0);
    assert!(size >= 1 << 20, "measured {size} B: {listed}");
}
