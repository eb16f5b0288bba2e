//! `stowage rm`: an image's tree, row and lock file go and nothing else; a
//! locked image is waited for or kept; races between removals; a removal
//! killed midway is finished later; a tree that cannot be moved or emptied is
//! undone or left for gc; deep and unreadable trees are deleted.

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::common::*;

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

/// A tree that cannot be measured (here: its open by the measure fails
/// with EIO, as on a dying disk; a depth beyond the descriptors the process
/// may open no longer stops a measure) is still removed, and its size is
/// said unknown, not "0 B".
#[test]
fn a_removal_whose_tree_cannot_be_measured_says_its_size_is_unknown() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.build("deep", "mkdir -p \"$STOWAGE_IMAGE_DIR/a/b/c\"");
    // Only the measure opens the tree by its path (the removal goes by descriptors).
    let tree = env.root.join("img/deep");
    let faults = [
        "-P".into(),
        tree.display().to_string(),
        "-e".into(),
        "trace=openat".into(),
        "--inject=openat:error=EIO:when=1".into(),
    ];
    let out = output(under_strace(&env, &faults, &["rm", "deep"]));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stderr(&out).contains("removed 'deep' (ready, size unknown)"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("deep"), None);
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
}

/// A lock file that cannot be unlinked (its directory immutable here) once
/// its record is emptied names no image: the image is removed, its tree
/// deleted, and the leftover said. It was "cannot remove the lock file",
/// exit 1, with the image already gone and its tree left in the trash.
#[test]
fn a_removal_whose_lock_file_cannot_be_unlinked_still_removes_the_image() {
    if !root_or_skip("chattr +i") || !tool_or_skip("chattr", "e2fsprogs") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    let locks = env.root.join("locks/images");
    if !immutable(&locks, true) {
        eprintln!("skipping: chattr +i is not supported here");
        return;
    }
    let out = env.run(["rm", "a"]);
    let listed = env.images_json();
    assert!(immutable(&locks, false));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stderr(&out).contains("removed 'a' (ready"),
        "{}",
        show(&out)
    );
    assert!(
        stderr(&out).contains("was removed, but its emptied lock file is left"),
        "{}",
        show(&out)
    );
    assert!(listed.is_empty(), "{listed:?}");
    assert!(!env.root.join("img/a").exists());
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
    env.ok(["doctor", "--repair"]);
    assert!(!env.lock_file("a").exists());
    // gc the same: removed, and the leftover said.
    env.make_image("b");
    assert!(immutable(&locks, true));
    let out = env.run(["gc", "--max-size", "0", "--json"]);
    assert!(immutable(&locks, false));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["removed"][0]["name"], "b", "{report}");
    assert_eq!(report["lock_files_left"].as_array().unwrap().len(), 1);
    assert!(
        stderr(&out).contains("image 'b' was removed, but"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("b"), None);
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

/// Names that do not exist are found before any wait: an rm of an image in
/// use and of missing names exits 66 at once, naming every missing one on
/// one line, and waits for nothing and removes nothing (with or without a
/// bound on the wait).
#[test]
fn rm_names_every_missing_image_before_any_wait() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    let reader = env.hold(&["--read", "a"], "started");
    let out = env.run(["rm", "--no-wait", "a", "typo", "b", "zz"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    // Without a bound a wait for 'a' would last as long as its reader.
    let mut rm = env.spawn(["rm", "a", "typo", "b", "zz"]);
    let waits = |env: &Env| {
        env.lock_entry("a")
            .is_some_and(|e| e["waiters"] != serde_json::json!([]))
    };
    wait_until("rm ends or waits for 'a'", || {
        !rm.is_running() || waits(&env)
    });
    let ended = !rm.is_running();
    env.release("release");
    assert_eq!(reader.finish().status.code(), Some(0));
    let out = rm.finish();
    assert!(ended, "rm waited for 'a': {}", show(&out));
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("images 'typo', 'zz' do not exist"), "{err}");
    for name in ["a", "b"] {
        assert_eq!(env.state(name).as_deref(), Some("ready"), "{name} kept");
    }
}

/// An rm holds a lock per image: one of more images than the soft limit on
/// open files allows removes them all, the limit raised to the hard one.
#[test]
fn rm_of_more_images_than_the_soft_limit_on_open_files_removes_them_all() {
    let env = Env::new();
    let names: Vec<String> = (0..80).map(|i| format!("m{i}")).collect();
    for name in &names {
        env.ok(["exec", "--write", name, "--", "true"]);
    }
    let mut args = vec!["rm"];
    args.extend(names.iter().map(String::as_str));
    let out = output(with_soft_files_limit(&env, 40, &args));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.images_json(), Vec::<serde_json::Value>::new());
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

// --- races ------------------------------------------------------------------

/// A tree without a record (its lock file deleted by hand) is no image to
/// remove: rm says it does not exist, and leaves no lock file behind.
#[test]
fn rm_of_a_tree_without_a_record_says_it_does_not_exist_and_leaves_no_lock_file() {
    let env = Env::new();
    env.make_image("x");
    fs::remove_file(env.lock_file("x")).unwrap();
    let out = env.run(["rm", "x"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains("'x' does not exist"),
        "{}",
        show(&out)
    );
    assert!(!env.lock_file("x").exists(), "no lock file made for it");
    assert!(
        env.root.join("img/x/file").exists(),
        "the tree is left alone"
    );
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

// --- trees that resist ------------------------------------------------------

/// Builds a chain of `depth` directories named `d` under `top`, with a
/// file and a symlink to `link_to` at the bottom, using descriptors (the
/// path is longer than PATH_MAX).
fn deep_tree(top: &Path, depth: usize, link_to: &Path) {
    let c = |s: &[u8]| CString::new(s).unwrap();
    let t = c(top.as_os_str().as_bytes());
    let mut fd = unsafe { libc::open(t.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY) };
    assert!(fd >= 0);
    for _ in 0..depth {
        let d = c(b"d");
        assert_eq!(unsafe { libc::mkdirat(fd, d.as_ptr(), 0o755) }, 0);
        let next = unsafe { libc::openat(fd, d.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY) };
        assert!(next >= 0);
        unsafe { libc::close(fd) };
        fd = next;
    }
    let f = c(b"file");
    let ffd = unsafe { libc::openat(fd, f.as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o644) };
    assert!(ffd >= 0);
    unsafe { libc::close(ffd) };
    let l = c(link_to.as_os_str().as_bytes());
    let n = c(b"link");
    assert_eq!(unsafe { libc::symlinkat(l.as_ptr(), fd, n.as_ptr()) }, 0);
    unsafe { libc::close(fd) };
}

#[test]
fn a_tree_deeper_than_path_max_is_removed_with_few_descriptors() {
    let env = Env::new();
    env.make_image("deep");
    let v = victim(&env);
    // 2500 levels of "d/": 5000 bytes, beyond PATH_MAX (4096).
    deep_tree(&env.root.join("img/deep"), 2500, &v);
    // Few descriptors allowed: a walk holding one per level would fail.
    let mut c = env.cmd(["rm", "deep"]);
    unsafe {
        use std::os::unix::process::CommandExt;
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 256,
                rlim_max: 256,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("deep"), None);
    assert!(!env.root.join("img/deep").exists());
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
    assert_intact(&v);
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

/// An image whose top directory its owner may not write (a rootfs `/` of
/// mode 555 or 500) is removed by rm and by gc: moving a directory to
/// another parent needs write permission on it, lent for the move. A move
/// refused anyway (the trash not writable) puts its mode back.
#[test]
fn an_image_whose_top_directory_its_owner_may_not_write_is_removed() {
    use std::os::unix::fs::PermissionsExt;
    let env = unprivileged_env();
    let names = || {
        let out = unprivileged(&env, &["images", "--json"]);
        let images: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        images
            .iter()
            .map(|i| format!("{} {}", i["name"], i["state"]))
            .collect::<Vec<_>>()
    };
    for (name, mode) in [("a", "555"), ("b", "500"), ("c", "555")] {
        let script =
            format!("cd \"$STOWAGE_IMAGE_DIR\" && mkdir d && touch d/f f && chmod {mode} .");
        unprivileged_build(&env, name, &script);
    }
    let out = unprivileged(&env, &["rm", "a"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(names(), ["\"b\" \"ready\"", "\"c\" \"ready\""]);
    let trash = env.root.join("trash");
    fs::set_permissions(&trash, fs::Permissions::from_mode(0o555)).unwrap();
    let out = unprivileged(&env, &["rm", "c"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let mode = fs::symlink_metadata(env.images_dir().join("c"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o555, "the mode is put back");
    assert_eq!(names(), ["\"b\" \"ready\"", "\"c\" \"ready\""]);
    fs::set_permissions(&trash, fs::Permissions::from_mode(0o755)).unwrap();
    let out = unprivileged(&env, &["gc", "--max-size", "0"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(names(), Vec::<String>::new());
    assert_eq!(fs::read_dir(&trash).unwrap().count(), 0);
    assert_eq!(fs::read_dir(env.images_dir()).unwrap().count(), 0);
}

/// Makes `path` immutable (chattr +i) for the life of the guard, if the
/// filesystem supports it.
struct Immutable(PathBuf);

impl Immutable {
    fn set(path: &Path) -> Option<Immutable> {
        if !immutable(path, true) {
            eprintln!(
                "skipping: cannot make {} immutable (chattr +i needs root and ext4, btrfs or xfs)",
                path.display()
            );
            return None;
        }
        Some(Immutable(path.to_owned()))
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        immutable(&self.0, false);
    }
}

/// Removal never deletes another store, whatever put it in an images
/// directory (moved there by hand, or made before the outer directory was
/// taken): a tree that is a store's root or claimed images directory is
/// refused and stays as it was, and a claimed images directory deeper in a
/// tree is not deleted.
#[test]
fn removal_never_deletes_another_stores_root_or_images_directory() {
    let b = Env::new();
    let images = b.root.join("img");
    let inner = Env::new();
    inner.make_image("kept");
    b.make_image("plain");
    b.make_image("inner");
    fs::remove_dir_all(images.join("inner")).unwrap();
    fs::rename(&inner.root, images.join("inner")).unwrap();
    let a = Env::new();
    let a_img = a.scratch.join("img");
    fs::create_dir(&a_img).unwrap();
    a.ok(["init", "--images-dir", a_img.to_str().unwrap()]);
    a.make_image("also-kept");
    b.make_image("outer");
    fs::rename(&a_img, images.join("outer/img")).unwrap();
    // Not adopted where no record names it: a store's root among the trees.
    let moved = inner.scratch.join("store");
    inner.make_image("x");
    fs::rename(&inner.root, &moved).unwrap();
    fs::rename(&moved, images.join("loose")).unwrap();
    let out = b.ok(["doctor", "--repair"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("loose"),
        "{}",
        show(&out)
    );
    assert_eq!(b.state("loose"), None);
    // Nor emptied for a copy from a base over it.
    let out = b.run(["exec", "--write", "inner", "--from", "plain", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(images.join("inner/locks/images/kept.lock").exists());
    let out = b.run(["rm", "inner"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("is a store's root"), "{}", show(&out));
    assert!(images.join("inner/img/kept/file").exists());
    let out = b.run(["rm", "outer"]);
    assert!(
        stderr(&out).contains("is the images directory of the store at"),
        "{}",
        show(&out)
    );
    let trash: Vec<_> = fs::read_dir(b.root.join("trash")).unwrap().collect();
    assert_eq!(trash.len(), 1, "{}", show(&out));
    let kept = trash[0].as_ref().unwrap().path().join("img/also-kept/file");
    assert!(kept.exists(), "{}", show(&out));
    b.run(["gc"]);
    // Still in the trash, under the name of the gc that took it over.
    let trash: Vec<_> = fs::read_dir(b.root.join("trash")).unwrap().collect();
    assert_eq!(trash.len(), 1);
    let kept = trash[0].as_ref().unwrap().path().join("img/also-kept/file");
    assert!(kept.exists());
    assert!(images.join("inner/img/kept/file").exists());
}

/// A removal killed after it marked the image, finished by the next
/// writer of the name, keeps a store's root found as the tree as well.
#[test]
fn a_killed_removal_finished_by_a_writer_keeps_a_stores_root() {
    let b = Env::new();
    let inner = Env::new();
    inner.make_image("kept");
    b.make_image("plain");
    b.make_image("inner");
    let at = b.root.join("img/inner");
    fs::remove_dir_all(&at).unwrap();
    fs::rename(&inner.root, &at).unwrap();
    let (bg, _) = b.paused(["rm", "inner"], "rm-marked");
    bg.kill_all();
    let out = b.run(["exec", "--write", "inner", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(stderr(&out).contains("is a store's root"), "{}", show(&out));
    assert!(at.join("locks/images/kept.lock").exists());
    assert!(at.join("img/kept/file").exists());
}

/// A copy of a store, or of a claimed images directory, inside an image
/// (a backup, a clone of it) is the image's like any tree: removed, as a
/// tree whose top happens to hold `locks` and `store.conf` is.
#[test]
fn copies_of_a_store_inside_an_image_are_removed_with_it() {
    let a = Env::new();
    let a_img = a.scratch.join("img");
    fs::create_dir(&a_img).unwrap();
    a.ok(["init", "--images-dir", a_img.to_str().unwrap()]);
    a.make_image("x");
    let b = Env::new();
    let (src, store) = (a_img.to_str().unwrap(), a.root.to_str().unwrap());
    let copy = format!("cp -a {src} {store} \"$STOWAGE_IMAGE_DIR\"/");
    b.build("backup", &copy);
    b.build(
        "odd",
        "cd \"$STOWAGE_IMAGE_DIR\" && mkdir locks && : > store.conf",
    );
    b.ok(["exec", "--write", "clone", "--from", "backup", "--", "true"]);
    for name in ["backup", "odd", "clone"] {
        let out = b.run(["rm", name]);
        assert_eq!(code(&out), Some(0), "{name}: {}", show(&out));
    }
    assert_eq!(fs::read_dir(b.root.join("trash")).unwrap().count(), 0);
    a.ok(["exec", "--read", "x", "--", "true"]);
}

#[test]
fn a_removal_that_cannot_move_the_tree_is_undone() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    let Some(pin) = Immutable::set(&env.root.join("img/b")) else {
        return;
    };
    let out = env.run(["rm", "b"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("'b'") && err.contains("not permitted") && err.contains("ready again"),
        "{}",
        show(&out)
    );
    assert_eq!(err.lines().count(), 1, "{}", show(&out));
    // As it was: readable at once, not left 'deleting' for ever.
    assert_eq!(env.state("b").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "b", "--", "true"]);

    // In a batch, the images before the refusal go, the rest stay.
    let out = env.run(["rm", "a", "b"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert_eq!(env.state("a"), None);
    assert_eq!(env.state("b").as_deref(), Some("ready"));

    // gc: an incomplete image it cannot remove stays incomplete, and the
    // others are removed all the same.
    for n in ["c", "d"] {
        let out = env.run_sh(n, "echo part > \"$STOWAGE_IMAGE_DIR/f\"; false");
        assert_eq!(code(&out), Some(1));
    }
    let pin_c = Immutable::set(&env.root.join("img/c")).unwrap();
    let out = env.run(["gc"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("'c'"), "{}", show(&out));
    assert_eq!(env.state("c").as_deref(), Some("incomplete"));
    assert_eq!(env.state("d"), None, "{}", show(&out));

    drop((pin, pin_c));
    env.ok(["rm", "b", "c"]);
    env.ok(["doctor"]);
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

/// Runs stowage as if its root were on NFS: lock files are kept, never
/// unlinked, so a removed image's record must say it is gone another way.
fn on_nfs(env: &Env, args: &[&str]) -> std::process::Output {
    let mut c = env.cmd(args);
    c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
    output(c)
}

/// Images removed by rm and collected by gc on a shared filesystem keep
/// their lock files: they are still not read, nor listed.
#[test]
fn a_removed_image_whose_lock_file_is_kept_is_not_read() {
    let env = Env::new();
    for name in ["gone", "collected"] {
        let out = on_nfs(&env, &["exec", "--write", name, "--", "true"]);
        assert_eq!(code(&out), Some(0), "{}", show(&out));
    }
    assert_eq!(code(&on_nfs(&env, &["rm", "gone"])), Some(0));
    let failed = on_nfs(&env, &["exec", "--write", "collected", "--", "false"]);
    assert_eq!(code(&failed), Some(1), "{}", show(&failed));
    assert_eq!(code(&on_nfs(&env, &["gc"])), Some(0));
    for name in ["gone", "collected"] {
        assert!(
            env.lock_file(name).exists(),
            "{name}: the lock file is kept"
        );
        let out = on_nfs(&env, &["exec", "--read", name, "--", "true"]);
        assert_eq!(code(&out), Some(66), "{name}: {}", show(&out));
        assert_eq!(env.state(name), None);
    }
    // The name is written anew, as a new image.
    let out = on_nfs(&env, &["exec", "--write", "gone", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("gone").as_deref(), Some("ready"));
}

/// A name whose lock file was kept, emptied, by a removal (as on NFS) is
/// written anew as a new image, without the global lock.
#[test]
fn a_name_whose_emptied_lock_file_was_kept_is_written_anew() {
    let env = Env::new();
    env.make_image("base");
    env.make_image("app");
    env.ok(["rm", "app"]);
    fs::write(env.lock_file("app"), "").unwrap();
    env.build_without_global_lock("app", "echo again > \"$STOWAGE_IMAGE_DIR/file\"");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("app", "file"), "again\n");
    env.ok(["doctor"]);
}

/// A removal killed once the tree is in the trash leaves the image
/// `deleting`; a write of the name makes a tree of its own, which is the
/// image now: gc, finishing the old removal, must not take it.
#[test]
fn a_new_tree_over_an_interrupted_removal_is_the_image() {
    let env = Env::new();
    env.make_image("base");
    env.make_image("app");
    let (rm, _) = env.paused(["rm", "app"], "rm-moved");
    rm.kill_all();
    assert_eq!(env.state("app").as_deref(), Some("deleting"));
    let out = env.run(["exec", "--read", "app", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    env.build_without_global_lock("app", "echo new > \"$STOWAGE_IMAGE_DIR/file\"");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["gc"]);
    assert_eq!(
        env.state("app").as_deref(),
        Some("ready"),
        "gc kept the new tree"
    );
    assert_eq!(env.read_in_image("app", "file"), "new\n");
    env.ok(["doctor"]);
}

/// A directory bind-mounted on the trash's place (another store's images,
/// a user's files) is not the store's: gc, doctor --repair and rm delete
/// and move nothing there, and say so (before: gc emptied it, destroying
/// another store's ready image).
#[test]
fn a_filesystem_mounted_on_the_trash_is_never_emptied() {
    if !root_or_skip("a bind mount") {
        return;
    }
    let env = Env::new();
    env.make_image("app");
    let outside = env.tmp.path().join("outside");
    fs::create_dir_all(outside.join("sub")).unwrap();
    fs::write(outside.join("sub/precious"), "precious").unwrap();
    let trash = env.root.join("trash");
    let Some(mount) = Mount::at(&["--bind", outside.to_str().unwrap()], &trash) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    let runs = [
        env.run(["gc"]),
        env.run(["doctor", "--repair"]),
        env.run(["rm", "app"]),
    ];
    drop(mount);
    for out in &runs {
        assert_eq!(code(out), Some(1), "{}", show(out));
        let said = format!("{}{}", stdout(out), stderr(out));
        assert!(
            said.contains("another filesystem mounted there"),
            "{}",
            show(out)
        );
    }
    assert_eq!(
        fs::read_to_string(outside.join("sub/precious")).unwrap(),
        "precious"
    );
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "app", "--", "true"]);
}

/// A tree a live removal is deleting from the trash is its remover's: doctor
/// notes it and is healthy, and neither `doctor --repair` nor gc deletes it
/// beside the remover or counts it as freed (before: doctor called it a
/// problem, and both deleted it). Once the remover is killed, it is a
/// leftover, and gc deletes it.
#[test]
fn a_live_removals_trash_entry_is_left_to_it() {
    let env = Env::new();
    // A tag's ':' is a '+' in its encoded name, as in the entry's owner part.
    env.make_image("app:1.0");
    let (rm, pause) = env.paused(["rm", "app:1.0"], "rm-moved");
    let entries = || fs::read_dir(env.root.join("trash")).unwrap().count();
    assert_eq!(entries(), 1);
    let out = env.ok(["doctor"]);
    assert!(
        stdout(&out).contains("1 being deleted by running removals"),
        "{}",
        show(&out)
    );
    env.ok(["doctor", "--repair"]);
    let out = env.ok(["gc", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(report["bytes_freed"], 0, "{}", show(&out));
    assert_eq!(entries(), 1, "the remover's entry was left to it");
    fs::remove_file(&pause).unwrap();
    let out = rm.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(entries(), 0);

    env.make_image("app");
    let (rm, _) = env.paused(["rm", "app"], "rm-moved");
    rm.kill_all();
    let out = env.run(["doctor"]);
    assert!(stdout(&out).contains("1 left in"), "{}", show(&out));
    env.ok(["gc"]);
    assert_eq!(entries(), 0, "a dead remover's entry is a leftover");
}

/// An image whose record names another images directory than the store's:
/// nothing there is the store's to delete. gc (and its dry run alike) keeps
/// it and says why, exiting 0; `rm` — what doctor advises — drops its record
/// alone and leaves the tree there (before: rm and gc refused, exit 1, gc on
/// every run, while the dry run said it would remove it).
#[test]
fn a_record_naming_another_images_directory_is_dropped_by_rm_alone() {
    use stowage::image_record::{self, ImagesDir};
    let env = Env::new();
    env.make_image("keep");
    let out = env.run(["exec", "--write", "bad", "--", "false"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let elsewhere = env.tmp.path().join("elsewhere");
    fs::create_dir_all(elsewhere.join("bad")).unwrap();
    fs::write(elsewhere.join("bad/precious"), "precious").unwrap();
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(env.lock_file("bad"))
        .unwrap();
    let mut seen = image_record::read(&f).unwrap();
    let mut record = seen.record.clone().unwrap();
    record.images = ImagesDir::External(elsewhere.clone());
    image_record::write(&f, &mut seen, &record).unwrap();
    drop(f);
    for dry in [true, false] {
        let mut c = env.cmd(["gc", "--json"]);
        c.args(dry.then_some("--dry-run"));
        let out = output(c);
        assert_eq!(code(&out), Some(0), "dry run {dry}: {}", show(&out));
        assert!(
            stdout(&out).contains("its record names images directory"),
            "dry run {dry}: {}",
            show(&out)
        );
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["removed"], serde_json::json!([]), "dry run {dry}");
    }
    let out = env.run(["doctor"]);
    let rm = format!("'stowage --root {} rm'", env.root.display());
    assert!(stdout(&out).contains(&rm), "{}", show(&out));
    let out = env.ok(["rm", "bad"]);
    assert!(stderr(&out).contains("is left as it is"), "{}", show(&out));
    assert_eq!(env.state("bad"), None);
    assert_eq!(
        fs::read_to_string(elsewhere.join("bad/precious")).unwrap(),
        "precious"
    );
    assert_eq!(env.state("keep").as_deref(), Some("ready"));
    env.ok(["doctor"]);
}

/// Another directory mounted on the default images directory's place (or
/// the store's own unmounted, or another store's images bind-mounted there)
/// holds no tree of this store: rm, gc (also when the mount comes while it
/// runs) and a rebuild `--from` delete nothing there and drop no record; a
/// write of an image the directory there holds is refused too.
/// Before, each checked only an external images directory: rm and gc
/// deleted the other directory's same-named trees and dropped the records,
/// leaving the real trees without them.
#[test]
fn nothing_is_deleted_from_a_directory_mounted_on_the_images_directory() {
    if !root_or_skip("a bind mount") {
        return;
    }
    let env = Env::new();
    for name in ["app", "base", "old"] {
        env.make_image(name);
    }
    let outside = env.tmp.path().join("outside");
    for name in ["app", "base", "old"] {
        fs::create_dir_all(outside.join(name)).unwrap();
        fs::write(outside.join(name).join("precious"), name).unwrap();
    }
    let img = env.root.join("img");
    let bind = ["--bind", outside.to_str().unwrap()];
    let Some(mount) = Mount::at(&bind, &img) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    let runs = [
        env.run(["rm", "app"]),
        env.run(["gc", "--max-size", "0"]),
        env.run(["exec", "--write", "app", "--from", "base", "--", "true"]),
        env.run(["exec", "--write", "app", "--", "touch", "-c", "x"]),
    ];
    drop(mount);
    for out in &runs {
        assert_ne!(code(out), Some(0), "{}", show(out));
        let said = format!("{}{}", stdout(out), stderr(out));
        assert!(said.contains("not the directory recorded"), "{}", show(out));
    }
    // The mount made while gc runs, after it listed the images.
    let (gc, go) = env.paused(["gc", "--max-size", "0"], "gc-listed");
    let mount = Mount::at(&bind, &img).unwrap();
    fs::remove_file(&go).unwrap();
    let out = gc.finish();
    drop(mount);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    for name in ["app", "base", "old"] {
        let kept = fs::read_to_string(outside.join(name).join("precious"));
        assert_eq!(kept.ok().as_deref(), Some(name));
        assert_eq!(env.state(name).as_deref(), Some("ready"), "{name}");
        assert!(img.join(name).is_dir(), "{name}");
    }
}
