//! Files, removal, the root and repair: nothing is deleted outside the root
//! whatever links are planted, a removal that fails is undone, repair never
//! makes an unknown tree ready nor forgets images because their directory
//! looks unmounted, and commands that only read create nothing.

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

/// Replaces `ROOT/NAME` (a directory) with a symlink to `target`.
fn plant(env: &Env, name: &str, target: &Path) {
    let p = env.root.join(name);
    let aside = env
        .tmp
        .path()
        .join(format!("aside-{}", name.replace('/', "-")));
    fs::rename(&p, &aside).unwrap();
    symlink(target, &p).unwrap();
}

#[test]
fn gc_and_doctor_delete_nothing_through_a_symlinked_trash() {
    let env = Env::new();
    env.make_image("a");
    let v = victim(&env);
    plant(&env, "trash", &v);

    let out = env.run(["gc"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("trash is a symlink"),
        "{}",
        show(&out)
    );
    assert_intact(&v);

    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("symlink"),
        "{}",
        show(&out)
    );
    assert_intact(&v);

    // Repair replaces the link (only the link) with a directory.
    let out = env.run(["doctor", "--repair"]);
    assert_intact(&v);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        fs::symlink_metadata(env.root.join("trash"))
            .unwrap()
            .is_dir()
    );
    env.ok(["rm", "a"]);
    assert_intact(&v);
}

#[test]
fn nothing_is_deleted_through_a_symlinked_images_directory() {
    let env = Env::new();
    env.make_image("a");
    let out = env.run(["exec", "--write", "c", "--", "false"]);
    assert_eq!(code(&out), Some(1));
    // The victim holds directories named like the images.
    let v = victim(&env);
    for n in ["a", "c"] {
        fs::create_dir(v.join(n)).unwrap();
        fs::write(v.join(n).join("keep"), "precious").unwrap();
    }
    plant(&env, "img", &v);

    for args in [
        &["gc"][..],
        &["rm", "a"],
        &["rm", "c"],
        &["doctor", "--repair"],
    ] {
        let out = env.run(args);
        assert_ne!(code(&out), Some(0), "{args:?}: {}", show(&out));
        assert_intact(&v);
        for n in ["a", "c"] {
            assert_eq!(
                fs::read_to_string(v.join(n).join("keep")).unwrap(),
                "precious",
                "{args:?} deleted through the link"
            );
        }
    }
    // Nothing was marked for good: the images are as they were.
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    assert_eq!(env.state("c").as_deref(), Some("incomplete"));
}

#[test]
fn nothing_is_deleted_through_a_symlinked_lock_directory() {
    let env = Env::new();
    env.make_image("a");
    let v = victim(&env);
    // A file named like the lock of an image that does not exist.
    fs::write(v.join("zz.lock"), "precious").unwrap();
    plant(&env, "locks/images", &v);
    for args in [&["gc"][..], &["doctor", "--repair"]] {
        let out = env.run(args);
        assert_ne!(code(&out), Some(0), "{args:?}: {}", show(&out));
        assert_eq!(
            fs::read_to_string(v.join("zz.lock")).unwrap(),
            "precious",
            "{args:?} unlinked a file outside the root"
        );
        assert_intact(&v);
    }
}

#[test]
fn links_inside_the_trash_are_unlinked_not_followed() {
    let env = Env::new();
    env.make_image("a");
    let v = victim(&env);
    let trash = env.root.join("trash");
    symlink(&v, trash.join("entry-link")).unwrap();
    fs::create_dir_all(trash.join("entry-dir/deeper")).unwrap();
    symlink(&v, trash.join("entry-dir/deeper/link")).unwrap();
    symlink(v.join("keep"), trash.join("entry-dir/file-link")).unwrap();
    let out = env.ok(["gc", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["trash_entries"], 2, "{report}");
    assert_eq!(fs::read_dir(&trash).unwrap().count(), 0);
    assert_intact(&v);
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}

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

/// `/var/tmp/NAME.stowage` for a made-up user NAME, removed at the end.
struct DefaultRoot {
    user: String,
    dir: PathBuf,
}

impl DefaultRoot {
    fn new(tag: &str) -> DefaultRoot {
        let user = format!("stowage-it-{tag}-{}", std::process::id());
        let dir = PathBuf::from(format!("/var/tmp/{user}.stowage"));
        let _ = fs::remove_dir_all(&dir);
        DefaultRoot { user, dir }
    }

    /// stowage without --root or STOWAGE_ROOT, as USER.
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin());
        c.args(args)
            .env("USER", &self.user)
            .env_remove("STOWAGE_ROOT")
            .env_remove("STOWAGE_NOW");
        c
    }
}

impl Drop for DefaultRoot {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn the_default_root_must_be_the_users_own() {
    if !root_or_skip("making a root owned by someone else") {
        return;
    }
    // Created by someone else before the user's first use, group-writable
    // for a group the user is in: fine for an explicit --root, not as the
    // default root, which anyone could have made.
    let d = DefaultRoot::new("theirs");
    fs::create_dir(&d.dir).unwrap();
    chown(&d.dir, 65534, 0);
    fs::set_permissions(&d.dir, fs::Permissions::from_mode(0o775)).unwrap();
    let out = output(d.cmd(&["exec", "--write", "a", "--", "true"]));
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("default root") && stderr(&out).contains("uid 65534"),
        "{}",
        show(&out)
    );
    assert_eq!(stderr(&out).lines().count(), 1, "{}", show(&out));
    assert_eq!(fs::read_dir(&d.dir).unwrap().count(), 0, "nothing created");
    // The same directory named explicitly is a group-shared store.
    let mut c = Command::new(bin());
    c.arg("--root")
        .arg(&d.dir)
        .args(["exec", "--write", "a", "--", "true"]);
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));

    // A user whose default root root made for them.
    let Some(mut c) = as_nobody() else { return };
    let d = DefaultRoot::new("rootmade");
    fs::create_dir(&d.dir).unwrap();
    c.arg(bin())
        .args(["images"])
        .env("USER", &d.user)
        .env_remove("STOWAGE_ROOT");
    let out = output(c);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("default root") && stderr(&out).contains("uid 0"),
        "{}",
        show(&out)
    );
    assert_eq!(fs::read_dir(&d.dir).unwrap().count(), 0, "nothing created");
    // And one the user made is used as before.
    let d = DefaultRoot::new("own");
    let out = output(d.cmd(&["exec", "--write", "a", "--", "true"]));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(d.dir.join("stowage.db").exists());
}

/// Makes `path` immutable (chattr +i) for the life of the guard, if the
/// filesystem supports it.
struct Immutable(PathBuf);

impl Immutable {
    fn set(path: &Path) -> Option<Immutable> {
        let ok = Command::new("chattr")
            .arg("+i")
            .arg(path)
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
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
        let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
    }
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
        let out = env.run(["exec", "--write", n, "--", "false"]);
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
fn a_tree_that_cannot_be_looked_at_is_not_taken_for_deleted() {
    // The command makes the images directory unsearchable, so finish's
    // lstat of the tree fails with EACCES — an error that, like EIO or
    // ESTALE, says nothing about whether the tree is there. Root would not
    // notice the mode: run as nobody.
    let Some(mut c) = as_nobody() else { return };
    let env = Env::new();
    let base = env.tmp.path().join("nobody");
    fs::create_dir(&base).unwrap();
    chown(&base, 65534, 65534);
    fs::set_permissions(env.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let root = base.join("root");
    let stowage = |c: &mut Command, args: &[&str]| {
        c.arg(bin()).arg("--root").arg(&root).args(args);
    };
    stowage(
        &mut c,
        &[
            "exec",
            "--write",
            "app",
            "--",
            "sh",
            "-c",
            "echo x > \"$STOWAGE_IMAGE_DIR/f\" && chmod 0 \"$STOWAGE_IMAGES_DIR\"",
        ],
    );
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    fs::set_permissions(root.join("img"), fs::Permissions::from_mode(0o755)).unwrap();
    let mut c = as_nobody().unwrap();
    stowage(&mut c, &["images", "--json"]);
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let images: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let app = images
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "app")
        .unwrap_or_else(|| panic!("the successful build's row was dropped: {images}"));
    assert_eq!(app["state"], "ready");
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
        String::from_utf8_lossy(&out.stdout).contains("is empty while images are recorded"),
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

#[test]
fn reading_commands_on_a_missing_root_say_so_and_create_nothing() {
    let env = Env::new();
    for args in [
        &["images"][..],
        &["lock-status"],
        &["lock-status", "--json"],
        &["slots"],
        &["slots", "rm", "pull"],
        &["doctor"],
        &["rm", "a"],
    ] {
        let out = env.run(args);
        assert_missing_root_refused(&env, args, &out);
        assert!(out.stdout.is_empty(), "{args:?}: {}", show(&out));
    }
    env.ok(["slots", "set", "pull", "2"]);
    assert!(env.root.join("stowage.db").exists());
}

#[test]
fn a_failed_init_leaves_no_root() {
    let env = Env::new();
    let out = env.run(["init", "--images-dir", "/nonexistent-stowage-it/img"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("parent"), "{}", show(&out));
    assert!(!env.root.exists());
}

#[test]
fn a_start_that_fails_leaves_no_lock_file() {
    let env = Env::new();
    env.ok(["init"]);
    let out = env.run(["exec", "--write", "new", "--", "/nonexistent/command"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(!env.lock_file("new").exists());
    // A read of a missing image next to a new write.
    let out = env.run(["exec", "--write", "new", "--read", "zzz", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    assert!(!env.lock_file("new").exists());
    assert_eq!(tree(&env.root.join("locks/images")), Vec::<String>::new());
    env.ok(["doctor"]);
}

#[test]
fn an_interrupted_or_timed_out_wait_leaves_no_lock_file_or_gate() {
    let env = Env::new();
    env.make_image("busy");
    let holder = env.hold(&["--write", "busy"], "held");
    // "aaa" is locked (and its file created) before the wait for "busy".
    let waiter = env.spawn(["exec", "--write", "aaa", "--write", "busy", "--", "true"]);
    env.wait_for_waiter("busy");
    waiter.signal(libc::SIGTERM);
    let out = waiter.finish();
    assert_eq!(code(&out), Some(128 + libc::SIGTERM), "{}", show(&out));
    assert!(!env.lock_file("aaa").exists(), "{}", show(&out));
    let out = env.run([
        "exec", "--write", "aaa", "--write", "busy", "--wait", "0.2", "--", "true",
    ]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert!(!env.lock_file("aaa").exists(), "{}", show(&out));
    env.release("release");
    holder.finish();

    // An image that does not exist, its lock held outside stowage: the
    // gate the waiting writer made goes with it.
    let lock = env.lock_file("ghost");
    let started = env.sentinel("flock-started");
    let outside = flock_holder(
        &lock,
        &started,
        &format!(
            "i=0; while [ ! -e '{}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
            env.sentinel("flock-release").display()
        ),
    );
    let out = env.run(["exec", "--write", "ghost", "--wait", "0.2", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    let gate = env.root.join("locks/images/ghost.gate");
    assert!(!gate.exists(), "the gate was left behind");
    env.release("flock-release");
    outside.finish();
}

#[test]
fn your_own_symlink_as_the_root_of_an_existing_store_works() {
    let env = Env::new();
    env.make_image("a");
    let link = env.tmp.path().join("link");
    symlink(&env.root, &link).unwrap();
    let mut c = Command::new(bin());
    c.arg("--root").arg(&link).args(["images", "--json"]);
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"a\""));
    // A root below a symlinked directory, new and then existing.
    let real = env.tmp.path().join("real");
    fs::create_dir(&real).unwrap();
    let via = env.tmp.path().join("via");
    symlink(&real, &via).unwrap();
    for args in [&["exec", "--write", "b", "--", "true"][..], &["images"]] {
        let mut c = Command::new(bin());
        c.arg("--root").arg(via.join("r")).args(args);
        let out = output(c);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    assert!(real.join("r/img/b").is_dir());
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

#[test]
fn a_write_whose_images_directory_vanished_keeps_its_row() {
    let env = Env::new();
    env.make_image("base");
    // The images directory goes away under the command (unmounted, say):
    // the tree is not found, which is no sign the command deleted it.
    let out = env.run_sh("app", "echo x > \"$STOWAGE_IMAGE_DIR/f\" && mv \"$STOWAGE_IMAGES_DIR\" \"$STOWAGE_IMAGES_DIR.away\"");
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(stderr(&out).contains("incomplete"), "{}", show(&out));
    fs::rename(env.root.join("img.away"), env.root.join("img")).unwrap();
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    // A command that really deletes its image still removes the row.
    env.build("base", "rm -r \"$STOWAGE_IMAGE_DIR\"");
    assert_eq!(env.state("base"), None);
}

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
