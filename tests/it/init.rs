//! `stowage init`: the layout, adoption of existing image directories
//! (as ready only where stowage never managed them), an images directory that
//! stowage adds nothing of its own to and that may not be the root under
//! another name, and a failed init that leaves no root. The first uses of a
//! root, however many at once, make one configuration, never a record
//! without one.

use std::fs;
use std::path::Path;
use std::process::Command;

use crate::common::*;

#[test]
fn creates_the_layout_idempotently() {
    let env = Env::new();
    env.ok(["init"]);
    for d in ["locks/images", "locks/slots", "img", "trash"] {
        assert!(env.root.join(d).is_dir(), "{d}");
    }
    // The contract's layout: the catalog and the global lock too.
    for f in ["store.conf", "stowage.db", "locks/global.lock"] {
        assert!(env.root.join(f).is_file(), "{f}");
    }
    let before = tree(&env.root);
    env.ok(["init"]);
    assert_eq!(tree(&env.root), before);
}

#[test]
fn adopts_charliecloud_named_directories() {
    let env = Env::new();
    let img = env.root.join("img");
    fs::create_dir_all(img.join("alpine+3.17/bin")).unwrap();
    fs::write(img.join("alpine+3.17/bin/sh"), "x").unwrap();
    fs::create_dir_all(img.join("team%app+v1")).unwrap();
    fs::write(img.join("team%app+v1/file"), "x").unwrap();
    // init takes what is there as ready, empty or not, in a directory
    // stowage never managed (see init_adopts_as_ready_only_in_...).
    fs::create_dir_all(img.join("empty")).unwrap();
    fs::create_dir_all(img.join("bad name")).unwrap();
    fs::write(img.join("notes.txt"), "not an image").unwrap();

    let out = env.ok(["init"]);
    assert!(
        stderr(&out).contains("bad name"),
        "reports what it skipped: {}",
        stderr(&out)
    );
    let names: Vec<String> = env
        .images_json()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["alpine:3.17", "empty", "team/app:v1"]);
    assert_eq!(env.state("alpine:3.17").as_deref(), Some("ready"));
    assert_eq!(env.state("empty").as_deref(), Some("ready"));
    // Adopted images are usable at once, and sized on first listing.
    env.ok([
        "exec",
        "--read",
        "alpine:3.17",
        "--",
        "test",
        "-e",
        &img.join("alpine+3.17/bin/sh").display().to_string(),
    ]);
    assert!(
        env.image("alpine:3.17").unwrap()["size_bytes"]
            .as_u64()
            .unwrap()
            > 0
    );
    // Adoption again finds nothing new.
    env.ok(["init"]);
    assert_eq!(env.images_json().len(), 3);
}

#[test]
fn an_outside_images_directory_gets_nothing_of_stowages_own() {
    let env = Env::new();
    let storage = env.tmp.path().join("ch");
    let img = storage.join("img");
    fs::create_dir_all(img.join("alpine+3.17/bin")).unwrap();
    fs::write(storage.join("version"), "7\n").unwrap();
    let img_arg = img.display().to_string();
    let before_storage = fs::read_dir(&storage).unwrap().count();

    env.ok(["init", "--images-dir", &img_arg]);
    env.ok(["init", "--images-dir", &img_arg]);
    env.ok([
        "exec",
        "--read",
        "alpine:3.17",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        "touch \"$STOWAGE_IMAGE_DIR/built\"",
    ]);
    let out = env.build("x", "echo \"$STOWAGE_IMAGES_DIR\"");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), img_arg);

    let mut entries: Vec<String> = fs::read_dir(&img)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    entries.sort();
    assert_eq!(
        entries,
        ["alpine+3.17", "app", "x"],
        "only image trees in the images directory"
    );
    assert_eq!(
        fs::read_dir(&storage).unwrap().count(),
        before_storage,
        "nothing added beside it"
    );
    assert!(img.join("app/built").exists());
    assert!(!env.root.join("img/app").exists());

    // Switching a populated store to another images directory is refused.
    let other = env.tmp.path().join("other");
    let out = env.run(["init", "--images-dir", other.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("refusing"), "{}", stderr(&out));
}

#[test]
fn an_images_directory_must_not_contain_the_root_nor_grow_missing_parents() {
    let env = Env::new();
    let before = tree(env.tmp.path());
    let out = env.run(["init", "--images-dir", env.tmp.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("contains the root"),
        "{}",
        stderr(&out)
    );
    let typo = env.tmp.path().join("typo/deep/img");
    let out = env.run(["init", "--images-dir", typo.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        !env.tmp.path().join("typo").exists(),
        "no missing parent created"
    );
    // `$CH_IMAGE_STORAGE/img` before the builder made its storage.
    assert!(
        stderr(&out).contains("use the builder first"),
        "{}",
        show(&out)
    );
    let after: Vec<String> = tree(env.tmp.path())
        .into_iter()
        .filter(|p| !p.starts_with("root"))
        .collect();
    let before: Vec<String> = before
        .into_iter()
        .filter(|p| !p.starts_with("root"))
        .collect();
    assert_eq!(after, before, "nothing created beside the root");
}

#[test]
fn init_adopts_as_ready_only_in_a_directory_stowage_never_managed() {
    let env = Env::new();
    fs::create_dir_all(env.root.join("img/before")).unwrap();
    fs::write(env.root.join("img/before/f"), "x").unwrap();
    env.ok(["init"]);
    assert_eq!(env.state("before").as_deref(), Some("ready"));
    // Stowage manages this directory now: a tree appearing without a row
    // may be anything (a failed build's leftovers).
    fs::create_dir_all(env.root.join("img/after")).unwrap();
    fs::write(env.root.join("img/after/f"), "x").unwrap();
    let out = env.ok(["init"]);
    assert!(stderr(&out).contains("incomplete"), "{}", show(&out));
    assert_eq!(env.state("after").as_deref(), Some("incomplete"));
}

/// An `init` killed while it adopts a builder's trees as ready (Ctrl-C, a
/// host crash) leaves lock files of its own: the next `init`, or `doctor
/// --repair`, finishes the adoption as it began, instead of taking those
/// files for a managed store's and the rest of the trees for leftovers.
#[test]
fn an_interrupted_adoption_is_finished_as_it_began() {
    for finisher in [&["init"][..], &["doctor", "--repair"]] {
        let env = Env::new();
        for t in ["a", "b", "c"] {
            fs::create_dir_all(env.root.join("img").join(t)).unwrap();
            fs::write(env.root.join("img").join(t).join("f"), "x").unwrap();
        }
        let (init, _go) = env.paused(["init"], "adopted-one");
        init.kill_all();
        let out = env.ok(finisher);
        for t in ["a", "b", "c"] {
            let state = env.state(t);
            assert_eq!(state.as_deref(), Some("ready"), "{t}: {}", show(&out));
        }
        // Finished, the store is managed: a tree appearing later is no builder's.
        fs::create_dir_all(env.root.join("img/later")).unwrap();
        env.ok(["init"]);
        assert_eq!(env.state("later").as_deref(), Some("incomplete"));
    }
}

/// An `init` that ends, even with a tree it could not adopt (its lock held
/// by another program), was not interrupted: it leaves no mark, so a tree
/// that appears later (a failed build's) is adopted `incomplete`, never
/// `ready`.
#[test]
fn an_adoption_that_ended_with_a_tree_left_leaves_no_mark() {
    let env = Env::new();
    for t in ["a", "b", "c"] {
        fs::create_dir_all(env.root.join("img").join(t)).unwrap();
    }
    let (mut init, go) = env.paused(["init"], "adopted-one");
    let left = ["a", "b", "c"]
        .into_iter()
        .find(|t| !env.lock_file(t).exists())
        .unwrap();
    let started = env.sentinel("flock.started");
    let holder = flock_holder(&env.lock_file(left), &started, "sleep 30");
    // It pauses after each tree it adopts: let it go each time.
    wait_until("init ends", || {
        let _ = fs::remove_file(&go);
        !init.is_running()
    });
    let out = init.finish();
    assert!(
        stderr(&out).contains(&format!("not adopting '{left}'")),
        "{}",
        show(&out)
    );
    holder.kill_all();
    fs::create_dir_all(env.root.join("img/stray")).unwrap();
    env.ok(["init"]);
    assert_eq!(env.state("stray").as_deref(), Some("incomplete"));
}

/// The mark of an adoption under way is cleared at its end however long
/// another program holds the global lock (the clear waits, as every wait
/// for it does). Before, it was given up after 10 s and left set, so a
/// later stray tree was adopted `ready`.
#[test]
fn an_adoption_clears_its_mark_after_a_long_hold_of_the_global_lock() {
    let env = Env::new();
    for t in ["a", "b"] {
        fs::create_dir_all(env.root.join("img").join(t)).unwrap();
    }
    let (mut init, go) = env.paused(["init"], "adopted-one");
    let started = env.sentinel("global.started");
    let holder = flock_holder(&env.root.join("locks/global.lock"), &started, "sleep 11");
    wait_until("init ends", || {
        let _ = fs::remove_file(&go);
        !init.is_running()
    });
    let out = init.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let _ = holder.finish();
    let conf = fs::read_to_string(env.root.join("store.conf")).unwrap();
    assert!(!conf.contains("adopting"), "{conf}");
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
fn a_failed_init_leaves_no_root() {
    let env = Env::new();
    let out = env.run(["init", "--images-dir", "/nonexistent-stowage-it/img"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("parent"), "{}", show(&out));
    assert!(!env.root.exists());
}

/// An images directory whose parent the user may not write: init makes
/// nothing (no layout whose `images=default` the next exec would fill) and
/// says the real cause, not a guess at a missing parent.
#[test]
fn an_images_directory_that_cannot_be_made_leaves_no_store() {
    let env = unprivileged_env();
    let parent = env.tmp.path().join("theirs");
    fs::create_dir(&parent).unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&parent, fs::Permissions::from_mode(0o555)).unwrap();
    let dir = parent.join("img");
    let out = unprivileged(&env, &["init", "--images-dir", dir.to_str().unwrap()]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("Permission denied"), "{}", show(&out));
    assert!(err.contains(parent.to_str().unwrap()), "{}", show(&out));
    assert!(!err.contains("does its parent exist"), "{}", show(&out));
    assert!(!env.root.exists(), "made {:?}", tree(&env.root));
    assert!(!dir.exists());
}

/// `init` without `--images-dir`, or naming the images directory already
/// in use, takes no store-wide lock: it runs while an outside program
/// holds store.lock, and beside a new image's writer.
#[test]
fn init_without_a_switch_takes_no_store_lock() {
    let env = Env::new();
    env.ok(["init"]);
    let images = env.images_dir();
    let holder = flock_holder(
        &env.root.join("locks/store.lock"),
        &env.sentinel("held"),
        "sleep 60",
    );
    env.ok(["init"]);
    env.ok(["init", "--images-dir", images.to_str().unwrap()]);
    holder.kill_all();
    let writer = env.hold(&["--write", "app"], "started");
    env.ok(["init"]);
    env.release("release");
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// One image is "1 image", and "remove it".
#[test]
fn a_switch_refused_for_one_image_says_one_image() {
    let env = Env::new();
    env.make_image("only");
    let other = env.tmp.path().join("elsewhere");
    let out = env.run(["init", "--images-dir", other.to_str().unwrap()]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("already keeps 1 image in") && err.contains("(remove it first)"),
        "{err}"
    );
    env.make_image("second");
    let out = env.run(["init", "--images-dir", other.to_str().unwrap()]);
    assert!(
        stderr(&out).contains("already keeps 2 images in"),
        "{}",
        show(&out)
    );
}

/// The images directory does not switch while a new image's writer runs
/// (its tree is in the directory the switch would leave behind): the
/// switch is refused as busy, and the image ends ready where it was made.
#[test]
fn the_images_directory_does_not_switch_beside_a_new_images_writer() {
    let env = Env::new();
    env.ok(["init"]);
    let writer = env.hold(&["--write", "app"], "started");
    let other = env.tmp.path().join("elsewhere");
    let out = env.run(["init", "--images-dir", other.to_str().unwrap()]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert!(stderr(&out).contains("busy"), "{}", show(&out));
    env.release("release");
    let w = writer.finish();
    assert_eq!(code(&w), Some(0), "{}", show(&w));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert!(env.root.join("img/app").is_dir());
    env.ok(["gc"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "app", "--", "true"]);
    env.ok(["doctor"]);
}

/// A new image being written is listed `creating`; its tree, which has
/// no finished record yet, is no orphan to adopt for `init` or `doctor`.
#[test]
fn a_new_image_being_written_is_listed_creating_and_left_alone_by_adoption() {
    let env = Env::new();
    env.make_image("base");
    let writer = env.hold(&["--write", "app"], "started");
    assert_eq!(env.state("app").as_deref(), Some("creating"));
    let out = env.ok(["init"]);
    assert!(!stderr(&out).contains("adopted"), "{}", show(&out));
    let out = env.ok(["doctor"]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("PROBLEM"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("app").as_deref(), Some("creating"));
    let entry = env.lock_entry("app").expect("its lock is shown");
    assert_eq!(entry["state"], "exclusive", "{entry}");
    assert_eq!(entry["image_state"], "creating", "{entry}");
    env.release("release");
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "app", "--", "true"]);
}

/// One images directory serves one store: a second root's `init` onto it
/// is refused, naming the first root — whether the first claimed it with
/// `--images-dir` or it is the first root's own `img/` — and nothing is
/// made for the second root.
#[test]
fn a_second_root_cannot_take_an_images_directory_another_store_serves() {
    let a = Env::new();
    let shared = a.scratch.join("ch/img");
    fs::create_dir_all(&shared).unwrap();
    a.ok(["init", "--images-dir", shared.to_str().unwrap()]);
    a.build("base", "echo a > \"$STOWAGE_IMAGE_DIR/f\"");
    let b = Env::new();
    let out = b.run(["init", "--images-dir", shared.to_str().unwrap()]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = stderr(&out);
    assert!(
        said.contains(a.root.to_str().unwrap()),
        "names the first root: {said}"
    );
    assert!(!b.root.exists(), "nothing made for the second root");

    let c = Env::new();
    c.make_image("x");
    let out = b.run(["init", "--images-dir", c.root.join("img").to_str().unwrap()]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains(c.root.to_str().unwrap()),
        "{}",
        show(&out)
    );
    assert_eq!(a.read_in_image("base", "f"), "a\n");
}

/// An images directory may not hold another store's, nor lie in one,
/// whichever was made first: the outer store would adopt the inner one's
/// images directory (or root) as an image, and `rm` or gc delete it; the
/// inner one's trees would be deleted with the outer image they lie in.
#[test]
fn an_images_directory_may_not_hold_or_lie_in_another_stores() {
    let a = Env::new();
    let shared = a.scratch.join("shared");
    let img = shared.join("img");
    fs::create_dir_all(&img).unwrap();
    a.ok(["init", "--images-dir", img.to_str().unwrap()]);
    a.build("base", "echo a > \"$STOWAGE_IMAGE_DIR/f\"");
    fs::create_dir(img.join("base/sub")).unwrap();
    let other = Env::new();
    other.make_image("x");
    fs::create_dir(other.root.join("img/x/sub")).unwrap();
    let b = Env::new();
    for (dir, says) in [
        (
            shared.clone(),
            "in it is the images directory of the store at",
        ),
        (other.scratch.clone(), ""),
        (img.join("base/sub"), "lies in images directory"),
        (
            other.root.join("img/x/sub"),
            "lies in 'img' of the store at",
        ),
    ] {
        if dir == other.scratch {
            // A store's root among the entries, not only a claimed directory.
            let moved = other.scratch.join("store");
            fs::rename(&other.root, &moved).unwrap();
            let out = b.run(["init", "--images-dir", dir.to_str().unwrap()]);
            fs::rename(&moved, &other.root).unwrap();
            assert_eq!(code(&out), Some(1), "{}", show(&out));
            assert!(stderr(&out).contains("is a store's root"), "{}", show(&out));
            continue;
        }
        let out = b.run(["init", "--images-dir", dir.to_str().unwrap()]);
        assert_eq!(code(&out), Some(1), "{}: {}", dir.display(), show(&out));
        assert!(stderr(&out).contains(says), "{}", show(&out));
        assert!(!b.root.exists(), "nothing made for the refused store");
    }
    assert_eq!(a.read_in_image("base", "f"), "a\n");
    other.ok(["exec", "--read", "x", "--", "true"]);
}

/// No part of another store's layout is an images directory or a root,
/// the part itself as well as what lies in it: that store's gc empties its
/// `trash`, and its own files (the catalog's journal, the configuration
/// written under a temporary name) are its to make and remove.
#[test]
fn no_part_of_another_stores_layout_is_an_images_directory_or_a_root() {
    let a = Env::new();
    a.make_image("x");
    let before = tree(&a.root);
    let b = Env::new();
    for part in [
        "trash",
        "locks/slots",
        "stowage.db-journal",
        ".store.conf.tmp",
    ] {
        let dir = a.root.join(part);
        let out = b.run(["init", "--images-dir", dir.to_str().unwrap()]);
        assert_eq!(code(&out), Some(1), "{part}: {}", show(&out));
        assert!(
            stderr(&out).contains("of the store at"),
            "{part}: {}",
            show(&out)
        );
        assert!(!b.root.exists(), "nothing made for the refused store");
        let mut c = Command::new(bin());
        c.arg("--root").arg(&dir).arg("init");
        let out = output(c);
        assert_eq!(code(&out), Some(1), "{part} as a root: {}", show(&out));
        assert!(
            stderr(&out).contains("of the store at"),
            "{part}: {}",
            show(&out)
        );
    }
    assert_eq!(tree(&a.root), before);
    a.ok(["gc"]);
    assert_eq!(a.state("x").as_deref(), Some("ready"));
    // The root's own `img`, named, is its images directory still.
    a.ok(["init", "--images-dir", a.root.join("img").to_str().unwrap()]);
}

/// What no store uses is no reason to refuse: a directory whose claim its
/// store no longer records (it moved to another images directory), and a
/// workspace that merely holds a `locks` directory beside an `img`.
#[test]
fn an_images_directory_beside_no_store_in_use_is_taken() {
    let a = Env::new();
    let (old, new) = (a.scratch.join("old"), a.scratch.join("new"));
    fs::create_dir(&old).unwrap();
    fs::create_dir(&new).unwrap();
    a.ok(["init", "--images-dir", old.to_str().unwrap()]);
    a.ok(["init", "--images-dir", new.to_str().unwrap()]);
    fs::create_dir(old.join("sub")).unwrap();
    let b = Env::new();
    b.ok(["init", "--images-dir", old.join("sub").to_str().unwrap()]);
    let ws = a.scratch.join("ci");
    fs::create_dir_all(ws.join("locks")).unwrap();
    fs::create_dir_all(ws.join("img/images")).unwrap();
    let c = Env::new();
    c.ok([
        "init",
        "--images-dir",
        ws.join("img/images").to_str().unwrap(),
    ]);
}

/// A copy of a store with an external images directory is another store
/// over the same directory: it removes nothing there.
#[test]
fn a_copy_of_a_store_removes_nothing_from_the_original_images_directory() {
    let a = Env::new();
    let shared = a.scratch.join("img");
    fs::create_dir(&shared).unwrap();
    a.ok(["init", "--images-dir", shared.to_str().unwrap()]);
    let out = a.run([
        "exec",
        "--write",
        "failed",
        "--",
        "sh",
        "-c",
        "touch \"$STOWAGE_IMAGE_DIR/f\"; exit 1",
    ]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let copy = a.tmp.path().join("copy");
    let st = std::process::Command::new("cp")
        .args(["-a", a.root.to_str().unwrap(), copy.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(st.success());
    let mut c = Env::new();
    c.root = copy;
    let out = c.run(["gc"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stderr(&out).contains("belongs to the store at"),
        "{}",
        show(&out)
    );
    assert!(
        shared.join("failed/f").exists(),
        "the original's tree is left alone"
    );
    // A plain init on the copy is refused too, and stays refused: it makes the copy no less a
    // copy, so neither a write nor an rm through it reaches the original's directory after.
    a.build("kept", "echo a > \"$STOWAGE_IMAGE_DIR/f\"");
    cp_a(&a.root, &c.root.with_extension("2"));
    c.root = c.root.with_extension("2");
    let out = c.run(["init"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    for args in [
        &["exec", "--write", "new", "--", "true"][..],
        &["rm", "kept"],
        &["init"],
    ] {
        let out = c.run(args);
        assert_ne!(code(&out), Some(0), "{args:?}: {}", show(&out));
        assert!(
            stderr(&out).contains("belongs to the store at"),
            "{}",
            show(&out)
        );
    }
    assert!(!shared.join("new").exists(), "nothing written there");
    assert_eq!(a.read_in_image("kept", "f"), "a\n");
}

/// Two inits racing for one new images directory: the first to claim it
/// gets it, before its configuration names it; the other's init is refused,
/// and so is every use of it after — also where the first was killed
/// between naming it and finishing (before: the directory was left
/// unclaimed, and the second store's init took it, adopting the first's
/// images, while the first went on writing there).
#[test]
fn two_inits_racing_for_one_images_directory_leave_it_to_one_store() {
    for killed in [false, true] {
        let a = Env::new();
        let shared = a.scratch.join("img");
        fs::create_dir(&shared).unwrap();
        let dir = shared.to_str().unwrap();
        let (first, go) = a.paused(["init", "--images-dir", dir], "init-switched");
        let first = match killed {
            true => {
                first.kill_all();
                a.ok(["exec", "--write", "from-a", "--", "true"]);
                None
            }
            false => Some(first),
        };
        let mut b = Env::new();
        b.root = a.tmp.path().join("b");
        let out = b.run(["init", "--images-dir", dir]);
        assert_eq!(code(&out), Some(1), "killed {killed}: {}", show(&out));
        assert!(
            stderr(&out).contains("belongs to the store at"),
            "killed {killed}: {}",
            show(&out)
        );
        if let Some(first) = first {
            fs::remove_file(go).unwrap();
            let out = first.finish();
            assert_eq!(code(&out), Some(0), "{}", show(&out));
            a.ok(["exec", "--write", "from-a", "--", "true"]);
        }
        assert!(shared.join("from-a").is_dir(), "killed {killed}");
        // Its refused init left it a store of its own images directory, if any.
        let _ = b.run(["exec", "--write", "from-b", "--", "true"]);
        assert!(!shared.join("from-b").exists(), "killed {killed}");
        a.ok(["doctor"]);
    }
}

/// Two inits racing for one images directory, the first held between its
/// claim and its configuration (its global lock held by another program):
/// its claim binds while its store-wide hold stands, so the second is
/// refused, and the first gets it (before: the second took the directory
/// over, both configurations named it, and the first was refused its own).
#[test]
fn an_init_between_its_claim_and_its_configuration_keeps_the_directory() {
    if !tool_or_skip("getfattr", "attr") {
        return;
    }
    let a = Env::new();
    a.ok(["init"]);
    let shared = a.scratch.join("img");
    fs::create_dir(&shared).unwrap();
    let dir = shared.to_str().unwrap();
    let claimed = || {
        Command::new("getfattr")
            .args(["--only-values", "-n", "user.stowage.store", dir])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let (started, release) = (a.sentinel("held"), a.sentinel("release"));
    let wait = format!(
        "while [ ! -e '{}' ]; do sleep 0.01; done",
        release.display()
    );
    let holder = flock_holder(&a.root.join("locks/global.lock"), &started, &wait);
    let first = a.spawn(["init", "--images-dir", dir]);
    wait_until("the first init claims the directory", claimed);
    let mut b = Env::new();
    b.root = a.tmp.path().join("b");
    let out = b.run(["init", "--images-dir", dir]);
    fs::write(&release, "").unwrap();
    holder.finish();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("belongs to the store at"),
        "{}",
        show(&out)
    );
    let out = first.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    a.ok(["exec", "--write", "from-a", "--", "true"]);
    assert!(shared.join("from-a").is_dir());
    let conf = fs::read_to_string(b.root.join("store.conf")).unwrap_or_default();
    assert!(!conf.contains(dir), "{conf}");
}

/// What is no images directory is refused before anything is made, with
/// what to do instead: a builder's storage directory (its images are in
/// its `img/`), `/`, a home directory, a directory that would be made at
/// the top of the filesystem (`"$UNSET/img"`), and one that holds files.
#[test]
fn init_refuses_what_is_no_images_directory() {
    let env = Env::new();
    let storage = env.scratch.join("storage");
    for d in ["img/alpine", "bucache", "dlcache", "ulcache"] {
        fs::create_dir_all(storage.join(d)).unwrap();
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let files = env.scratch.join("project");
    fs::create_dir(&files).unwrap();
    fs::write(files.join("Makefile"), "all:\n").unwrap();
    let top = format!("/stowage-test-{}", std::process::id());
    for (dir, says) in [
        (storage.to_str().unwrap(), "storage/img"),
        ("/", "contains the root"),
        (home.as_str(), "home directory"),
        (top.as_str(), "top of the filesystem"),
        (files.to_str().unwrap(), "holds files"),
    ] {
        let out = env.run(["init", "--images-dir", dir]);
        assert_eq!(code(&out), Some(1), "{dir}: {}", show(&out));
        assert!(stderr(&out).contains(says), "{dir}: {}", show(&out));
        assert!(!env.root.exists(), "{dir}: nothing made");
    }
    assert!(!std::path::Path::new(&top).exists());
    assert!(storage.join("bucache").is_dir());
    // Every refusal says what to give instead.
    let out = env.run(["init", "--images-dir", home.as_str()]);
    assert!(
        stderr(&out).contains("give a directory that holds image trees only"),
        "{}",
        show(&out)
    );
    env.ok([
        "init",
        "--images-dir",
        storage.join("img").to_str().unwrap(),
    ]);
    assert_eq!(env.state("alpine").as_deref(), Some("ready"));
}

/// A directory of the operating system, or a tree made like one, is no
/// images directory: its subdirectories (`/usr`'s `lib`, `share`, `bin`)
/// would be adopted as ready images, one `gc` away from deletion. `/usr`
/// and a tree holding `bin`, `lib` and `share` were adopted.
#[test]
fn init_refuses_the_systems_directories_and_trees_like_them() {
    let env = Env::new();
    let prefix = env.scratch.join("prefix");
    for d in ["bin", "lib", "share/doc"] {
        fs::create_dir_all(prefix.join(d)).unwrap();
    }
    // An existing directory at the top of the filesystem (/scratch holds its
    // users' directories, /nix a store), and paths that climb out with '..'
    // to a system directory not made yet: all three were taken.
    let top = std::path::PathBuf::from(format!("/stowage-test-top-{}", std::process::id()));
    fs::create_dir_all(top.join("alice")).unwrap();
    let climbs = format!("{}/../../usr/stowage-test-new", env.tmp.path().display());
    let prefix = prefix.to_str().unwrap();
    for (dir, says) in [
        (prefix, "a system tree (it holds bin, lib, share)"),
        ("/usr", "a directory of the operating system"),
        ("/usr/share", "a directory of the operating system"),
        ("/var/lib", "a directory of the operating system"),
        (
            top.to_str().unwrap(),
            "a directory at the top of the filesystem",
        ),
        (
            "/tmp/../usr/stowage-test-new",
            "a directory of the operating system",
        ),
        (climbs.as_str(), "a directory of the operating system"),
    ] {
        let out = env.run(["init", "--images-dir", dir]);
        assert_eq!(code(&out), Some(1), "{dir}: {}", show(&out));
        assert!(stderr(&out).contains(says), "{dir}: {}", show(&out));
        assert!(!env.root.exists(), "{dir}: nothing made");
    }
    fs::remove_dir_all(&top).unwrap();
    assert!(!std::path::Path::new("/usr/stowage-test-new").exists());
    // A directory below one that holds others' directories may be one, and
    // init of that store again is no new adoption: not judged again.
    let mine = env.scratch.join("srv-like/images");
    fs::create_dir_all(&mine).unwrap();
    env.ok(["init", "--images-dir", mine.to_str().unwrap()]);
    fs::write(mine.join("NOTES"), "no new images directory holds files").unwrap();
    env.ok(["init", "--images-dir", mine.to_str().unwrap()]);
    // A configuration that names a system directory (a group's members may
    // write it) is judged by its path all the same, with or without
    // --images-dir: it was taken as the store's own.
    let conf = env.root.join("store.conf");
    let text = fs::read_to_string(&conf).unwrap();
    let planted = text.replace(mine.to_str().unwrap(), "/usr/share");
    assert_ne!(planted, text);
    fs::write(&conf, planted).unwrap();
    for args in [&["init"][..], &["init", "--images-dir", "/usr/share"]] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        assert!(
            stderr(&out).contains("of the operating system"),
            "{}",
            show(&out)
        );
    }
}

/// A root is no place for a store where stowage's files would land among
/// others': the filesystem's root or a directory at its top, a home, the
/// system's, a Charliecloud storage directory (ch-image then refuses it),
/// or one whose `trash` holds others' files (gc would delete them). All
/// were made stores; the refusal changes nothing, and says what to give
/// instead.
#[test]
fn init_refuses_a_root_that_is_no_place_for_a_store() {
    let env = Env::new();
    let storage = env.scratch.join("storage");
    for d in ["img/alpine", "bucache", "dlcache"] {
        fs::create_dir_all(storage.join(d)).unwrap();
    }
    let home = env.scratch.join("home");
    fs::create_dir(&home).unwrap();
    let _slash = LayoutIn::new("/");
    let trash = env.scratch.join("project");
    fs::create_dir_all(trash.join("trash/notes")).unwrap();
    fs::write(trash.join("trash/notes/keep"), "mine").unwrap();
    let before = tree(&env.scratch);
    let _var = LayoutIn::new("/var");
    for (dir, says) in [
        ("/", "the root of the filesystem"),
        ("/var", "at the top of the filesystem"),
        (
            trash.to_str().unwrap(),
            "'trash' holds what stowage did not put there",
        ),
        ("/usr/local", "a directory of the operating system"),
        (home.to_str().unwrap(), "a home directory"),
        (storage.to_str().unwrap(), "--images-dir"),
    ] {
        let mut c = Command::new(bin());
        c.args(["--root", dir, "init"]).env("HOME", &home);
        let out = output(c);
        assert_eq!(code(&out), Some(1), "{dir}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(says) && err.contains("refusing"),
            "{dir}: {err}"
        );
        assert!(!std::path::Path::new(dir).join("store.conf").exists());
    }
    assert_eq!(tree(&env.scratch), before);
    assert!(!std::path::Path::new("/locks").exists() && !Path::new("/var/locks").exists());
    // What the refusal says to give instead works.
    let img = storage.join("img");
    let own = env.scratch.join("storage.stowage");
    let mut c = Command::new(bin());
    c.arg("--root")
        .arg(&own)
        .args(["init", "--images-dir"])
        .arg(&img);
    assert_eq!(code(&output(c)), Some(0));
    assert_eq!(fs::read_dir(&storage).unwrap().count(), 3);
}

/// A store is never made inside another's `img`, `trash` or `locks`, nor
/// in an images directory a store keeps: the other's gc removed it as a
/// trash entry, its init adopted it as an image. Refused before anything
/// is made, by init and by a first write alike.
#[test]
fn a_root_inside_another_store_is_refused() {
    let env = Env::new();
    env.make_image("x");
    let ext = env.scratch.join("ext");
    fs::create_dir(&ext).unwrap();
    let keeper = env.scratch.join("keeper");
    let mut c = Command::new(bin());
    c.arg("--root")
        .arg(&keeper)
        .args(["init", "--images-dir"])
        .arg(&ext);
    assert_eq!(code(&output(c)), Some(0));
    let before = (tree(&env.root), tree(&ext));
    for (inner, says) in [
        (env.root.join("trash/inner"), "'trash' of the store at"),
        (env.root.join("img/inner"), "'img' of the store at"),
        (env.root.join("img"), "'img' of the store at"),
        (env.root.join("locks/inner"), "'locks' of the store at"),
        (ext.join("inner"), "images directory"),
        (ext.clone(), "images directory"),
    ] {
        for args in [&["init"][..], &["exec", "--write", "y", "--", "true"]] {
            let mut c = Command::new(bin());
            c.arg("--root").arg(&inner).args(args);
            let out = output(c);
            assert_eq!(
                code(&out),
                Some(1),
                "{} {args:?}: {}",
                inner.display(),
                show(&out)
            );
            assert!(stderr(&out).contains(says), "{}", show(&out));
        }
    }
    assert_eq!((tree(&env.root), tree(&ext)), before);
    env.ok(["gc"]);
    assert_eq!(env.state("x").as_deref(), Some("ready"));
}

/// Removes, when dropped, the parts of a store a failing test made in
/// `dir` (which held none of them): a regression must not leave them in `/`.
struct LayoutIn(Vec<std::path::PathBuf>);

impl LayoutIn {
    fn new(dir: &str) -> LayoutIn {
        let parts = [
            "locks",
            "img",
            "trash",
            "reserve",
            "store.conf",
            "stowage.db",
        ];
        let dir = Path::new(dir);
        LayoutIn(
            parts
                .iter()
                .map(|p| dir.join(p))
                .filter(|p| !p.exists())
                .collect(),
        )
    }
}

impl Drop for LayoutIn {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = fs::remove_dir_all(p).or_else(|_| fs::remove_file(p));
        }
    }
}

/// A home directory given by its real path, where the one written down
/// goes through a link (`/home` is a link on many clusters), is a home
/// directory still: it was taken.
#[test]
fn init_refuses_a_home_directory_reached_through_a_link() {
    let env = Env::new();
    let real = env.scratch.join("real-homes/u");
    fs::create_dir_all(real.join("projects")).unwrap();
    let link = env.scratch.join("homes");
    std::os::unix::fs::symlink(env.scratch.join("real-homes"), &link).unwrap();
    let mut c = env.cmd(["init", "--images-dir", real.to_str().unwrap()]);
    c.env("HOME", link.join("u"));
    let out = output(c);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("a home directory"), "{}", show(&out));
    assert!(!env.root.exists());
}

/// The root's entries, each with its kind, mode and group: what a refused
/// init must leave as it found it.
fn entries_with_modes(dir: &Path) -> Vec<(String, u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let mut out: Vec<_> = std::iter::once(dir.to_owned())
        .chain(walkdir(dir))
        .map(|p| {
            let m = fs::symlink_metadata(&p).unwrap();
            (p.display().to_string(), m.mode(), m.gid())
        })
        .collect();
    out.sort();
    out
}

/// An entry of the layout that is not of its kind (a symlink where a
/// directory goes, a FIFO for store.conf, …) is refused by init before it
/// makes or changes anything: no other part of the layout is made, and
/// with `--group` the root's mode and group stay as they were (init used
/// to make the layout, and share the root, before the refusal).
#[test]
fn a_refused_init_makes_and_changes_nothing() {
    let env = Env::new();
    let dirs = ["img", "trash", "locks"];
    let files = ["store.conf", "reserve"];
    let mut cases = Vec::new();
    for rel in dirs {
        cases.extend([Plant::Fifo, Plant::Symlink, Plant::Empty].map(|p| (rel, p)));
    }
    for rel in files {
        cases.extend([Plant::Fifo, Plant::Symlink, Plant::Dir].map(|p| (rel, p)));
    }
    for (i, (rel, plant)) in cases.into_iter().enumerate() {
        for group in [false, true] {
            let root = env.tmp.path().join(format!("r{i}-{group}"));
            fs::create_dir(&root).unwrap();
            plant.at(&root.join(rel), env.tmp.path());
            let before = entries_with_modes(&root);
            let mut cmd = Command::new(bin());
            cmd.arg("--root").arg(&root).arg("init");
            if group {
                cmd.args(["--group", "daemon"]);
            }
            let out = output(cmd);
            assert_eq!(code(&out), Some(1), "{rel} {plant:?}: {}", show(&out));
            let err = stderr(&out);
            assert!(
                err.contains(&format!("{rel} is ")) && err.lines().count() == 1,
                "{rel} {plant:?}: {err}"
            );
            assert_eq!(
                entries_with_modes(&root),
                before,
                "{rel} {plant:?} --group {group}"
            );
        }
    }
}

/// A link swapped in for `locks` after init made it, before it made the
/// directories below, is refused without anything made where it points:
/// the layout's directories are made from the root's descriptor, never
/// through a path.
#[test]
fn a_link_swapped_in_for_a_layout_directory_gets_nothing_made_through_it() {
    let env = Env::new();
    fs::create_dir(&env.root).unwrap();
    let outside = env.tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let (init, go) = env.paused(["init"], "layout-locks-made");
    let locks = env.root.join("locks");
    fs::rename(&locks, env.root.join("locks.real")).unwrap();
    std::os::unix::fs::symlink(&outside, &locks).unwrap();
    fs::remove_file(&go).unwrap();
    let out = init.finish();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("locks is a symlink"),
        "{}",
        show(&out)
    );
    assert_eq!(
        tree(&outside),
        Vec::<String>::new(),
        "made outside the root"
    );
}

/// A root swapped for a link after its layout was begun gets nothing
/// made where the link points: not the reserve, not the layout.
#[test]
fn a_root_swapped_for_a_link_gets_nothing_made_through_it() {
    let env = Env::new();
    fs::create_dir(&env.root).unwrap();
    let elsewhere = env.tmp.path().join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    let (init, go) = env.paused(["init"], "layout-locks-made");
    fs::rename(&env.root, env.tmp.path().join("root.real")).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &env.root).unwrap();
    fs::remove_file(&go).unwrap();
    let _ = init.finish();
    assert_eq!(
        tree(&elsewhere),
        Vec::<String>::new(),
        "made through the link"
    );
}

/// Many first writes at once on a root that does not exist: one makes the
/// layout, others find it half made, yet every one writes its image (none
/// takes the configuration for lost), and all agree on one store id.
#[test]
fn first_writes_at_once_on_a_new_root_are_all_accepted() {
    let env = Env::new();
    for round in 0..12 {
        let root = env.tmp.path().join(format!("new{round}"));
        let children: Vec<_> = (0..6)
            .map(|i| {
                let mut c = Command::new(bin());
                c.arg("--root")
                    .arg(&root)
                    .args(["exec", "--write", &format!("img{i}"), "--", "true"])
                    .env_remove("STOWAGE_ROOT")
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped());
                c.spawn().unwrap()
            })
            .collect();
        for child in children {
            let out = wait_output(child, PATIENCE);
            assert_eq!(code(&out), Some(0), "round {round}: {}", show(&out));
        }
        let conf = fs::read_to_string(root.join("store.conf")).unwrap();
        let out = Command::new("getfattr")
            .args(["--only-values", "-n", "user.stowage.store"])
            .arg(root.join("img"))
            .output();
        if let Ok(out) = out
            && out.status.success()
        {
            let claim = String::from_utf8_lossy(&out.stdout).into_owned();
            let id = |t: &str| t.lines().find(|l| l.starts_with("id=")).map(str::to_owned);
            assert_eq!(id(&claim), id(&conf), "round {round}: {claim} / {conf}");
        }
    }
}

/// A configuration lost while an outside program holds the catalog
/// (which might be an older release's, to migrate first): the first write
/// is refused, naming both, and writes no record; once the catalog is free
/// the configuration is made and the write goes ahead. (It wrote its record
/// under a configuration never saved, and every command after refused the
/// store until a repair.)
#[test]
fn a_lost_configuration_beside_a_busy_catalog_writes_no_record() {
    if !tool_or_skip("python3", "python3") {
        return;
    }
    let env = Env::new();
    env.ok(["init"]);
    let conf = env.root.join("store.conf");
    fs::remove_file(&conf).unwrap();
    let holder = hold_catalog(&env);
    let mut c = env.cmd(["exec", "--write", "b", "--", "true"]);
    c.env("STOWAGE_DEBUG_DB_BUSY_MS", "300");
    let out = output(c);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("store.conf") && err.contains("stowage.db"),
        "{err}"
    );
    holder.kill_all();
    assert!(!conf.exists(), "{}", show(&out));
    assert!(env.state("b").is_none(), "no record written");
    env.ok(["exec", "--write", "b", "--", "true"]);
    assert!(conf.exists());
    env.ok(["doctor"]);
}

/// A configuration lost before any image was written (or after the last
/// was removed) is made anew by the next use, once: later commands find it,
/// and none takes the store for one whose configuration was lost.
#[test]
fn a_configuration_lost_while_no_image_has_a_record_is_made_once_anew() {
    let env = Env::new();
    env.make_image("a");
    env.ok(["rm", "a"]);
    let conf = env.root.join("store.conf");
    let id = |t: &str| t.lines().find(|l| l.starts_with("id=")).map(str::to_owned);
    let before = id(&fs::read_to_string(&conf).unwrap());
    fs::remove_file(&conf).unwrap();
    env.ok(["exec", "--write", "b", "--", "true"]);
    assert!(conf.exists(), "made anew by the first write");
    assert_eq!(
        id(&fs::read_to_string(&conf).unwrap()),
        before,
        "the id the claim carries"
    );
    env.ok(["exec", "--write", "c", "--", "true"]);
    env.ok(["rm", "b"]);
    env.ok(["gc"]);
    env.ok(["doctor"]);
}

/// Another directory at the external images directory's path (another
/// filesystem mounted there, or the path as a container or another host
/// sees it) is made the store's by `init --images-dir` naming it, never by
/// a plain `init`, whose refusal says that: the directory recorded is the
/// store's for every view, which one view cannot see is not elsewhere.
#[test]
fn only_init_naming_it_makes_another_directory_at_the_images_path_the_stores() {
    let env = Env::new();
    let Some(right) = env.init_on_tmpfs() else {
        return;
    };
    env.make_image("app");
    let images = right.dir.clone();
    let Some(other) = Mount::tmpfs_at(&images, "1m") else {
        return;
    };
    fs::create_dir(images.join("tools")).unwrap();
    let out = env.run(["init"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let named = format!("init --images-dir {}", images.display());
    assert!(stderr(&out).contains(&named), "{}", show(&out));
    assert_eq!(env.state("tools"), None, "adopted");
    assert_eq!(tree(&images), ["tools"]);
    drop(other);
    env.ok(["exec", "--write", "new", "--", "true"]);
    assert_eq!(env.read_in_image("app", "file"), "content\n");
    // Named, it is the store's from then on (and the one it replaced no more).
    let Some(_other) = Mount::tmpfs_at(&images, "1m") else {
        return;
    };
    env.ok(["init", "--images-dir", images.to_str().unwrap()]);
    env.ok(["exec", "--write", "there", "--", "true"]);
    assert!(images.join("there").is_dir());
}

/// An adopted tree's time says when it was made, not when it was last used
/// (an image unpacked from a tarball keeps the tarball's times): the images
/// `init` adopts, and those an interrupted adoption's finisher adopts, count
/// as used at their adoption, so the `gc --unused-for` the docs advise after
/// `init --images-dir` removes none of them.
#[test]
fn adopted_images_count_as_used_at_their_adoption_not_at_their_trees_time() {
    for finisher in [&[][..], &["init"][..], &["doctor", "--repair"]] {
        let env = Env::new();
        let img = env.tmp.path().join("images");
        for t in ["a", "b", "c"] {
            fs::create_dir_all(img.join(t)).unwrap();
            fs::write(img.join(t).join("f"), "x").unwrap();
            let aged = Command::new("touch")
                .args(["-d", "30 days ago"])
                .arg(img.join(t).join("f"))
                .arg(img.join(t))
                .status()
                .unwrap();
            assert!(aged.success());
        }
        let init = ["init", "--images-dir", img.to_str().unwrap()];
        if finisher.is_empty() {
            env.ok(init);
        } else {
            let (init, _go) = env.paused(init, "adopted-one");
            init.kill_all();
            env.ok(finisher);
        }
        let out = env.ok(["gc", "--unused-for", "7d"]);
        for t in ["a", "b", "c"] {
            assert!(
                img.join(t).is_dir(),
                "{finisher:?}: {t} removed: {}",
                show(&out)
            );
            assert_eq!(env.state(t).as_deref(), Some("ready"), "{finisher:?}: {t}");
        }
    }
}

/// A symlink in `ROOT/img`'s place may be its user's own: no command
/// sends the user to `doctor --repair`, which leaves it (before: `init`
/// did, and the repair changed nothing, so init said it again).
#[test]
fn a_symlink_in_the_images_directorys_place_is_refused_with_advice_that_works() {
    let env = Env::new();
    env.ok(["init"]);
    let elsewhere = env.tmp.path().join("elsewhere");
    fs::rename(env.root.join("img"), &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, env.root.join("img")).unwrap();
    for args in [&["init"][..], &["exec", "--write", "x", "--", "true"]] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(err.contains("init --images-dir"), "{err}");
        assert!(!err.contains("doctor --repair"), "{err}");
    }
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(elsewhere.is_dir());
    assert!(
        fs::symlink_metadata(env.root.join("img"))
            .unwrap()
            .is_symlink()
    );
}

/// Something planted where the layout keeps gc's lock (a FIFO, a symlink) is said by `init`, one
/// line naming it and the repair, never waited on: `init` said the root was ready, and the first gc
/// failed on it.
#[test]
fn init_names_something_planted_at_a_lock_of_the_layout() {
    let env = Env::new();
    env.ok(["init"]);
    let lock = env.root.join("locks/gc.lock");
    for plant in ["fifo", "symlink"] {
        fs::remove_file(&lock).unwrap();
        match plant {
            "fifo" => {
                nix::unistd::mkfifo(&lock, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap()
            }
            _ => std::os::unix::fs::symlink("/etc/passwd", &lock).unwrap(),
        }
        let out = env.run(["init"]);
        assert_eq!(code(&out), Some(1), "{plant}: {}", show(&out));
        let said = stderr(&out);
        assert!(
            said.contains("gc.lock") && said.contains("doctor --repair"),
            "{said}"
        );
        assert_eq!(said.lines().count(), 1, "{said}");
        env.ok(["doctor", "--repair"]);
        env.ok(["init"]);
    }
}

/// A root that holds no store, where `init` would refuse to make one (an
/// images directory of a store, a directory inside one), is not sent to
/// `init`: the line says why no store can be made there. Before, it said
/// "'stowage --root R/img init' makes it one", and that init was refused.
#[test]
fn a_root_init_would_refuse_is_not_sent_to_init() {
    let env = Env::new();
    env.make_image("app");
    let img = env.root.join("img");
    let inside = img.join("new");
    for (dir, said) in [(&img, "holds no store"), (&inside, "does not exist")] {
        let out = output({
            let mut c = Command::new(bin());
            c.arg("--root").arg(dir).arg("images");
            c
        });
        assert_eq!(code(&out), Some(66), "{}", show(&out));
        let err = stderr(&out);
        assert!(err.contains(said), "{err}");
        assert!(!err.contains(" init'"), "{err}");
        assert!(
            err.contains(&format!("of the store at {}", env.root.display())),
            "{err}"
        );
        // And init does refuse it.
        let mut c = Command::new(bin());
        c.arg("--root").arg(dir).arg("init");
        let out = output(c);
        assert_ne!(code(&out), Some(0), "{}", show(&out));
    }
    assert!(!inside.exists());
    // An empty directory anywhere else is still sent to init, which makes
    // a store there.
    let empty = env.tmp.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let mut c = Command::new(bin());
    c.arg("--root").arg(&empty).arg("images");
    let out = output(c);
    let init = format!("'stowage --root {} init' makes it one", empty.display());
    assert!(stderr(&out).contains(&init), "{}", show(&out));
}
