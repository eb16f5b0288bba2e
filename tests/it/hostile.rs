//! A hostile or broken environment: links planted in the store's layout
//! (lock files, the trash, the database, the images and lock directories, the
//! reserve), roots others control or that do not exist, read-only and full
//! filesystems, the database or global lock held by stuck outside programs,
//! stores shared by a group. Each gets a clear error and the documented exit
//! code, and nothing is written or deleted through a planted link.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::*;

// --- planted links ----------------------------------------------------------

/// A decoy outside the root that a planted link points at.
fn decoy(env: &Env) -> std::path::PathBuf {
    let d = env.tmp.path().join("decoy");
    fs::write(&d, "precious").unwrap();
    d
}

fn assert_untouched(p: &std::path::Path) {
    assert_eq!(
        fs::read_to_string(p).unwrap(),
        "precious",
        "{} was written through a link",
        p.display()
    );
}

#[test]
fn a_symlink_planted_at_a_lock_file_path() {
    let env = Env::new();
    env.make_image("a");
    let target = decoy(&env);
    symlink(&target, env.lock_file("b")).unwrap();
    let out = env.run(["exec", "--write", "b", "--", "true"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("symlink"), "{}", stderr(&out));
    assert_untouched(&target);
    // Everything else keeps working, store-wide operations included.
    env.ok(["exec", "--read", "a", "--", "true"]);
    env.ok(["exec", "--store-wide", "--", "true"]);
    assert_eq!(env.state("b"), None);
    // doctor names the link; a repair sets it aside, following nothing.
    let out = env.run(["doctor"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("b.lock is a symlink"),
        "{}",
        show(&out)
    );
    env.ok(["doctor", "--repair"]);
    env.ok(["doctor"]);
    assert_untouched(&target);
}

#[test]
fn a_symlink_planted_at_the_trash() {
    let env = Env::new();
    env.make_image("a");
    let elsewhere = env.tmp.path().join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    fs::write(elsewhere.join("keep"), "precious").unwrap();
    fs::remove_dir(env.root.join("trash")).unwrap();
    symlink(&elsewhere, env.root.join("trash")).unwrap();
    let out = env.run(["rm", "a"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("trash") && stderr(&out).contains("symlink"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        env.state("a").as_deref(),
        Some("ready"),
        "nothing was marked"
    );
    assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 1);
    assert_untouched(&elsewhere.join("keep"));
}

#[test]
fn a_symlink_planted_at_the_database_path() {
    let env = Env::new();
    env.make_image("a");
    let _ = fs::remove_file(env.root.join("stowage.db"));
    let target = env.tmp.path().join("not-a-db");
    symlink(&target, env.root.join("stowage.db")).unwrap();
    // The catalog is derived: images are listed from their records, and
    // the link is named, never followed.
    let out = env.run(["images"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ready"),
        "{}",
        show(&out)
    );
    assert!(stderr(&out).contains("symlink"), "{}", stderr(&out));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
    assert!(!target.exists(), "nothing created through the link");
    env.ok(["doctor", "--repair"]);
    assert!(!target.exists(), "nothing created through the link");
    env.ok(["doctor"]);
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}

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

/// A symlink planted for `locks` (or `locks/images`) by someone who can
/// write the root: no command makes or writes a file through it — not a
/// lock file, not the global lock, not the leases directory — and each
/// that needs it refuses, naming the link and the fix.
#[test]
fn nothing_is_made_through_a_symlinked_locks_directory() {
    nothing_made_through_links(|_| {});
}

/// The same on a kernel without `openat2` (before 5.6, or a seccomp
/// profile that refuses it), where each path is opened through its
/// parent's descriptor, checked to be where the path says.
#[cfg(target_arch = "x86_64")]
#[test]
fn nothing_is_made_through_a_symlinked_locks_directory_without_openat2() {
    nothing_made_through_links(|c| without_openat2(c, libc::ENOSYS as u32));
}

fn nothing_made_through_links(tweak: impl Fn(&mut Command)) {
    for planted in ["locks", "locks/images"] {
        let env = Env::new();
        env.make_image("base");
        env.ok(["slots", "set", "pull", "1"]);
        let v = victim(&env);
        plant(&env, planted, &v);
        let link = env.root.join(planted);
        for args in [
            &["exec", "--read", "base", "--", "true"][..],
            &["exec", "--write", "new", "--", "true"],
            &["rm", "base"],
            &["images"],
            &["gc"],
            &["lock-status"],
            &["slots"],
            &["slots", "set", "pull", "2"],
        ] {
            let mut c = env.cmd(args);
            tweak(&mut c);
            let out = output(c);
            let err = stderr(&out);
            // What needs the directory refuses, naming the link (a listing
            // goes on from what it can, saying so); what does not, works.
            assert!(
                code(&out) == Some(0)
                    || err.contains(&format!("{} is a symlink", link.display()))
                        && err.trim_end().lines().count() == 1,
                "{planted} {args:?}: {}",
                show(&out)
            );
            assert_eq!(
                walkdir(&v).len(),
                3,
                "{planted} {args:?} made something outside the root: {:?}",
                walkdir(&v)
            );
            assert_intact(&v);
        }
    }
}

#[test]
fn nothing_is_deleted_through_a_symlinked_lock_directory() {
    let env = Env::new();
    env.make_image("a");
    let v = victim(&env);
    // A file named like the lock of an image that does not exist.
    fs::write(v.join("zz.lock"), "precious").unwrap();
    plant(&env, "locks/images", &v);
    // gc refuses; a repair sets the link aside (following nothing) and
    // makes the directory anew.
    for (args, ends) in [(&["gc"][..], 1), (&["doctor", "--repair"], 0)] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(ends), "{args:?}: {}", show(&out));
        assert_eq!(
            fs::read_to_string(v.join("zz.lock")).unwrap(),
            "precious",
            "{args:?} unlinked a file outside the root"
        );
        assert_intact(&v);
    }
    assert!(env.root.join("locks/images").is_dir());
}

/// `locks/images` (or all of `locks`) moved elsewhere with the store's
/// records and linked back: a plain doctor says how many records the link
/// leads to; the repair that sets the link aside adopts no tree, nor does a
/// later repair or `init`, while the records are set aside (the repair
/// adopted every tree as `incomplete` at once: ready images unreadable,
/// `app`'s base lost; `init` then adopted them `ready`). Put back, every
/// image is as it was.
#[test]
fn records_behind_a_symlinked_lock_directory_are_never_adopted_over() {
    for planted in ["locks/images", "locks"] {
        let env = Env::new();
        env.make_image("base");
        env.ok(["exec", "--write", "app", "--from", "base", "--", "true"]);
        let (link, real) = (env.root.join(planted), env.tmp.path().join("real"));
        fs::rename(&link, &real).unwrap();
        symlink(&real, &link).unwrap();
        let out = env.run(["doctor"]);
        assert_eq!(code(&out), Some(1), "{planted}: {}", show(&out));
        let leads = "it leads to 2 image record(s)";
        assert!(stdout(&out).contains(leads), "{planted}: {}", show(&out));
        for (args, ends) in [
            (&["doctor", "--repair"][..], 1),
            (&["doctor", "--repair"], 1),
            (&["init"], 0),
        ] {
            let out = env.run(args);
            assert_eq!(code(&out), Some(ends), "{planted} {args:?}: {}", show(&out));
            let said = format!("{}{}", stdout(&out), stderr(&out));
            assert!(said.contains("set aside in"), "{planted} {args:?}: {said}");
            assert_eq!(env.state("base"), None, "{planted} {args:?}: adopted");
        }
        // Put back as the report says: the directory the link led to in place.
        fs::remove_dir_all(&link).unwrap();
        fs::rename(&real, &link).unwrap();
        let parent = link.parent().unwrap();
        let prefix = format!("{}.planted-", link.file_name().unwrap().to_str().unwrap());
        for e in fs::read_dir(parent).unwrap().flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                fs::remove_file(e.path()).unwrap();
            }
        }
        env.ok(["doctor"]);
        assert_eq!(env.state("base").as_deref(), Some("ready"), "{planted}");
        let app = env.image("app").unwrap();
        assert_eq!(app["state"], "ready", "{planted}: {app}");
        assert_eq!(app["base"], "base", "{planted}: {app}");
    }
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
fn a_symlink_or_fifo_planted_at_the_reserve_is_never_written_through() {
    let env = Env::new();
    env.make_image("app");
    let reserve = env.root.join("reserve");
    assert!(reserve.exists(), "the layout has a reserve");
    let outside = env.tmp.path().join("precious");
    fs::write(&outside, "keep me").unwrap();
    fs::remove_file(&reserve).unwrap();
    std::os::unix::fs::symlink(&outside, &reserve).unwrap();
    env.ok(["gc"]);
    env.ok(["rm", "app"]);
    env.make_image("app");
    assert_eq!(fs::read_to_string(&outside).unwrap(), "keep me");
    fs::remove_file(&reserve).unwrap();
    let c = std::ffi::CString::new(reserve.as_os_str().as_encoded_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    // Bounded by the harness: a blocking open would hang these.
    env.ok(["gc"]);
    env.ok(["exec", "--write", "app", "--", "true"]);
}

// --- the root ---------------------------------------------------------------

#[test]
fn a_root_anyone_could_control_is_refused() {
    let env = Env::new();
    fs::create_dir(&env.root).unwrap();
    fs::set_permissions(&env.root, fs::Permissions::from_mode(0o777)).unwrap();
    let out = env.run(["exec", "--write", "a", "--", "true"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("writable by everyone"),
        "{}",
        stderr(&out)
    );
    assert_eq!(fs::read_dir(&env.root).unwrap().count(), 0);
    // A symlinked root planted by someone else (in /var/tmp anyone can).
    if is_root() {
        let env = Env::new();
        let theirs = env.tmp.path().join("theirs");
        fs::create_dir(&theirs).unwrap();
        symlink(&theirs, &env.root).unwrap();
        unsafe {
            let c = std::ffi::CString::new(env.root.as_os_str().as_encoded_bytes()).unwrap();
            assert_eq!(libc::lchown(c.as_ptr(), 65534, 65534), 0);
            let t = std::ffi::CString::new(theirs.as_os_str().as_encoded_bytes()).unwrap();
            assert_eq!(libc::chown(t.as_ptr(), 65534, 65534), 0);
        }
        let out = env.run(["images"]);
        assert_eq!(out.status.code(), Some(1), "{}", show(&out));
        assert!(stderr(&out).contains("uid 65534"), "{}", stderr(&out));
        assert_eq!(fs::read_dir(&theirs).unwrap().count(), 0);
    } else {
        eprintln!("skipping the foreign-owner part: needs root to chown");
    }
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

/// Someone else's default root is one the user cannot remove (/var/tmp is sticky): the refusal
/// says what they can do instead, and when `$USER` is not who runs (`su` keeps it), that.
#[test]
fn a_default_root_of_someone_elses_is_refused_with_what_the_user_can_do() {
    if !root_or_skip("making a root owned by someone else") {
        return;
    }
    let d = DefaultRoot::new("others");
    fs::create_dir(&d.dir).unwrap();
    chown(&d.dir, 65534, 65534);
    let out = output(d.cmd(&["images"]));
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("give a root of your own with --root DIR or STOWAGE_ROOT"),
        "{err}"
    );
    assert!(
        err.contains("or ask ") && err.contains("uid 65534") && err.contains("to remove it"),
        "{err}"
    );
    assert!(!err.contains("; remove it"), "{err}");
    // Named by a $USER that is another account's, the root is that account's.
    let passwd = fs::read_to_string("/etc/passwd").unwrap_or_default();
    let Some((name, uid)) = ["daemon", "bin", "sys"].iter().find_map(|n| {
        let l = passwd.lines().find(|l| l.starts_with(&format!("{n}:")))?;
        Some((n.to_string(), l.split(':').nth(2)?.parse::<u32>().ok()?))
    }) else {
        eprintln!("skipping the $USER case: no daemon, bin or sys account here");
        return;
    };
    let dir = PathBuf::from(format!("/var/tmp/{name}.stowage"));
    if dir.exists() {
        eprintln!("skipping the $USER case: {} exists", dir.display());
        return;
    }
    fs::create_dir(&dir).unwrap();
    chown(&dir, uid, uid);
    let mut c = Command::new(bin());
    c.arg("images")
        .env("USER", &name)
        .env_remove("STOWAGE_ROOT");
    let out = output(c);
    let _ = fs::remove_dir(&dir);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains(&format!("it is named by $USER ({name}), who you are not")),
        "{err}"
    );
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
    assert!(d.dir.join("locks/images/a.lock").exists());
}

#[test]
fn a_missing_root_parent_is_not_created() {
    let env = Env::new();
    let root = env.tmp.path().join("no/such/parent/root");
    let mut c = Command::new(bin());
    c.arg("--root")
        .arg(&root)
        .args(["exec", "--write", "a", "--", "true"]);
    let out = output(c);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("parent directory does not exist"),
        "{}",
        stderr(&out)
    );
    assert!(!env.tmp.path().join("no").exists());
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
        &["rm", "a"],
        // A read names the missing root, not a missing image.
        &["exec", "--read", "a", "--", "true"],
    ] {
        let out = env.run(args);
        assert_missing_root_refused(&env, args, &out);
        assert!(out.stdout.is_empty(), "{args:?}: {}", show(&out));
    }
    // doctor reports it as the problem it is (exit 1, doctor's contract):
    // doctor::doctor_of_a_root_that_does_not_exist_says_so_and_creates_nothing.
    env.ok(["slots", "set", "pull", "2"]);
    assert!(env.root.join("locks/slots/pull/0.lock").exists());
}

/// A root that names a directory holding no store (a project, a builder's
/// storage: a mistyped root) is never made one, except by `init`, asked:
/// a look says so (66) and creates nothing, empty directory or not; a
/// write makes a store only in an empty one, else says so (66).
#[test]
fn a_directory_that_holds_no_store_is_not_made_one_unasked() {
    let env = Env::new();
    let empty = env.tmp.path().join("empty");
    let project = env.tmp.path().join("project");
    fs::create_dir(&empty).unwrap();
    fs::create_dir_all(project.join("img/icons")).unwrap();
    fs::write(project.join("index.html"), "hi").unwrap();
    // A file named `locks` is anyone's: no sign of a store, and never set aside to make one.
    let notes = env.tmp.path().join("notes");
    fs::create_dir(&notes).unwrap();
    fs::write(notes.join("locks"), "my notes").unwrap();
    // Other files beside it, one of which a listing gives first.
    for f in ["README", "a", "b", "c", "d", "e", "f", "g"] {
        fs::write(notes.join(f), "").unwrap();
    }
    let looks: [&[&str]; 11] = [
        &["images"],
        &["images", "--json"],
        &["lock-status"],
        &["lock-status", "--why", "a"],
        &["slots"],
        &["doctor"],
        &["doctor", "--repair"],
        &["gc", "--dry-run"],
        &["gc"],
        &["rm", "a"],
        &["exec", "--read", "a", "--", "true"],
    ];
    let writes: [&[&str]; 3] = [
        &["exec", "--write", "a", "--", "true"],
        &["exec", "--", "true"],
        &["slots", "set", "pull", "1"],
    ];
    for dir in [&empty, &project, &notes] {
        let before = tree(dir);
        let in_project = dir != &empty;
        for args in looks.iter().chain(writes.iter().filter(|_| in_project)) {
            let mut c = Command::new(bin());
            c.arg("--root").arg(dir).args(args.iter());
            let out = output(c);
            let doctor = args[0] == "doctor";
            assert_eq!(
                code(&out),
                Some(if doctor { 1 } else { 66 }),
                "{args:?}: {}",
                show(&out)
            );
            let err = stderr(&out);
            let said = err.contains("holds no store") || err.contains("image 'a' does not exist");
            assert!(said && err.lines().count() == 1, "{args:?}: {err}");
            // Where init would refuse, it is not the way out said.
            assert!(dir != &notes || !err.contains("makes it one"), "{err}");
            assert_eq!(tree(dir), before, "{args:?} in {}", dir.display());
        }
    }
    // The empty one is made a store by a write, the other by init.
    let mut c = Command::new(bin());
    c.arg("--root")
        .arg(&empty)
        .args(["exec", "--write", "a", "--", "true"]);
    assert_eq!(code(&output(c)), Some(0));
    let mut c = Command::new(bin());
    c.arg("--root").arg(&project).arg("init");
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(project.join("locks").is_dir() && project.join("index.html").exists());
    let mut c = Command::new(bin());
    c.arg("--root").arg(&notes).arg("init");
    let out = output(c);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("no store's"), "{}", show(&out));
    assert!(!notes.join("img").exists() && notes.join("locks").is_file());
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

/// A root given as a symlink is the same whichever way it is written:
/// `link/`, `link/.` and `link//` name the link itself (its owner checked,
/// then resolved once), never a path that leads to it again and is then
/// refused as a symlink planted in the layout. An images directory given
/// so is refused as the symlink it is, as without the slash.
#[test]
fn a_symlink_root_written_with_a_trailing_slash_is_the_symlink() {
    let env = Env::new();
    env.make_image("a");
    let link = env.tmp.path().join("link");
    symlink(&env.root, &link).unwrap();
    let link = link.to_str().unwrap();
    for spelled in [format!("{link}/"), format!("{link}/."), format!("{link}//")] {
        for args in [
            &["exec", "--read", "a", "--", "true"][..],
            &["exec", "--write", "a", "--", "true"],
            &["gc"],
            &["doctor"],
            &["doctor", "--repair"],
        ] {
            let by_flag = stowage_at(Path::new(&spelled), args);
            let mut c = Command::new(bin());
            c.args(args)
                .env("STOWAGE_ROOT", &spelled)
                .stdin(std::process::Stdio::null());
            for out in [by_flag, output(c)] {
                assert_eq!(code(&out), Some(0), "{spelled} {args:?}: {}", show(&out));
                assert!(!stdout(&out).contains("PROBLEM"), "{}", show(&out));
            }
        }
    }
    assert!(fs::symlink_metadata(link).unwrap().is_symlink());
    let real = env.tmp.path().join("real-img");
    fs::create_dir(&real).unwrap();
    let img_link = env.tmp.path().join("img-link");
    symlink(&real, &img_link).unwrap();
    let other = env.tmp.path().join("other");
    let via = format!("{}/", img_link.display());
    let out = stowage_at(&other, &["init", "--images-dir", &via]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("is a symlink"), "{}", show(&out));
    let conf = fs::read_to_string(other.join("store.conf")).unwrap_or_default();
    assert!(!conf.contains("img-link"), "{conf}");
}

/// A root's path may hold any byte but `/` and NUL: a newline, an escape
/// sequence, a carriage return, a byte that is not UTF-8. Each root works
/// like any other (its images directory claimed, doctor content), and
/// every line printed shows the path escaped.
#[test]
fn a_root_whose_path_holds_a_newline_or_an_escape_works() {
    use std::os::unix::ffi::OsStrExt;
    let odd: [(&[u8], &str); 4] = [
        (b"q\nx", "q\\nx"),
        (b"q\x1b[2Jx", "q\\x1b[2Jx"),
        (b"q\rx", "q\\rx"),
        (b"q\xffx", "q\u{fffd}x"),
    ];
    for (name, shown) in odd {
        let mut env = Env::new();
        env.root = env.tmp.path().join(std::ffi::OsStr::from_bytes(name));
        env.ok(["init"]);
        env.ok(["init"]);
        env.make_image("a");
        env.ok(["exec", "--read", "a", "--write", "b", "--", "true"]);
        for args in [&["doctor"][..], &["lock-status", "--all"]] {
            let out = env.ok(args);
            let text = stdout(&out);
            let first = text.lines().next().unwrap_or_default();
            assert!(first.contains(shown), "{shown} {args:?}: {text}");
            assert!(!text.contains("not marked"), "{shown}: {text}");
            let raw = |c: char| c.is_control() && c != '\n';
            assert!(!text.chars().any(raw), "{shown} {args:?}: {text:?}");
        }
    }
}

/// An images directory's path is written in every image's record, one line
/// of text: one with a newline, or that is not UTF-8, is refused as a usage
/// error before anything is made.
#[test]
fn an_images_directory_whose_path_cannot_be_recorded_is_refused() {
    use std::os::unix::ffi::OsStrExt;
    for (name, why) in [(&b"i\nx"[..], "holds a newline"), (b"i\xffx", "not UTF-8")] {
        let env = Env::new();
        let dir = env.tmp.path().join(std::ffi::OsStr::from_bytes(name));
        let out = env.run(["init".as_ref(), "--images-dir".as_ref(), dir.as_os_str()]);
        assert_eq!(code(&out), Some(64), "{}", show(&out));
        assert_eq!(stderr(&out).lines().count(), 1, "{}", show(&out));
        assert!(stderr(&out).contains(why), "{}", show(&out));
        assert!(!env.root.exists() && !dir.exists(), "{}", show(&out));
    }
}

#[test]
fn a_store_shared_by_a_group_is_usable_by_its_members() {
    if !root_or_skip("acting as another user") {
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("skipping: setpriv (util-linux) not found");
        return;
    }
    let env = Env::new();
    // An administrator sets the store up for group 100 ("users").
    fs::create_dir(&env.root).unwrap();
    let c = std::ffi::CString::new(env.root.as_os_str().as_encoded_bytes()).unwrap();
    unsafe { assert_eq!(libc::chown(c.as_ptr(), 0, 100), 0) };
    fs::set_permissions(&env.root, fs::Permissions::from_mode(0o2775)).unwrap();
    fs::set_permissions(env.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    // A member with a strict umask creates the first image...
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg("umask 077; exec \"$0\" --root \"$1\" exec --write base -- sh -c 'umask; touch \"$STOWAGE_IMAGE_DIR/f\"'")
        .arg(bin())
        .arg(&env.root);
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0077",
        "the command keeps the caller's umask"
    );
    assert_eq!(
        output({
            let mut c = Command::new(bin());
            c.arg("--root").arg(&env.root).arg("images");
            c
        })
        .status
        .code(),
        Some(0)
    );
    for p in [
        env.lock_file("base"),
        env.root.join("stowage.db"),
        env.root.join("store.conf"),
    ] {
        let m = fs::metadata(&p).unwrap();
        assert_eq!(
            m.mode() & 0o060,
            0o060,
            "{} is group read-write",
            p.display()
        );
        assert_eq!(m.gid(), 100, "{} belongs to the group", p.display());
    }
    let locks = fs::metadata(env.root.join("locks/images")).unwrap();
    assert_eq!(
        locks.mode() & 0o2070,
        0o2070,
        "directories are setgid and group-writable"
    );
    // ...and another member, another uid, can lock and record.
    let mut c = Command::new("setpriv");
    c.args(["--reuid=65534", "--regid=100", "--clear-groups", "--"])
        .arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(["exec", "--read", "base", "--write", "derived", "--", "true"])
        .env("USER", "nobody");
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("derived").as_deref(), Some("ready"));
}

// --- read-only and full filesystems -----------------------------------------

fn stowage_at(root: &std::path::Path, args: &[&str]) -> std::process::Output {
    let mut c = Command::new(bin());
    c.arg("--root").arg(root).args(args);
    output(c)
}

#[test]
fn a_read_only_root_exits_69() {
    let Some(fs_) = Mount::tmpfs("size=8m") else {
        return;
    };
    let root = fs_.dir.join("root");
    assert_eq!(
        stowage_at(&root, &["exec", "--write", "a", "--", "true"])
            .status
            .code(),
        Some(0)
    );
    let remount = Command::new("mount")
        .args(["-o", "remount,ro"])
        .arg(&fs_.dir)
        .status()
        .unwrap();
    assert!(remount.success());
    for args in [
        vec!["exec", "--read", "a", "--", "true"],
        vec!["exec", "--write", "b", "--", "true"],
    ] {
        let out = stowage_at(&root, &args);
        assert_eq!(out.status.code(), Some(69), "{args:?}: {}", show(&out));
        assert!(stderr(&out).contains("read-only"), "{}", stderr(&out));
        assert_eq!(stderr(&out).trim_end().lines().count(), 1);
    }
}

/// A filesystem with no inode left: doctor still tests flock (on the
/// reserve) and goes through every check; no "locking unusable" (69).
#[test]
fn doctor_on_a_filesystem_out_of_inodes_checks_everything() {
    let Some(fs_) = Mount::tmpfs("size=8m,nr_inodes=64") else {
        return;
    };
    let root = fs_.dir.join("root");
    let out = stowage_at(&root, &["exec", "--write", "a", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    for i in 0.. {
        if fs::File::create(fs_.dir.join(format!("f{i}"))).is_err() {
            break;
        }
    }
    let out = stowage_at(&root, &["doctor"]);
    assert_ne!(out.status.code(), Some(69), "{}", show(&out));
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(said.contains("catalog"), "{}", show(&out));
    // A repair cannot make the global lock's file (no inode): one line, not 69.
    let out = stowage_at(&root, &["doctor", "--repair"]);
    assert_ne!(out.status.code(), Some(69), "{}", show(&out));
}

/// A start refused for a disk too full for its record leaves no lock
/// file behind: emptied, the file is unlinked even without room for the
/// mark that it is gone.
#[test]
fn a_start_refused_by_a_full_disk_leaves_no_lock_file() {
    let Some(fs_) = Mount::tmpfs("size=2m") else {
        return;
    };
    let root = fs_.dir.join("root");
    let out = stowage_at(&root, &["exec", "--write", "a", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let fill = |name: &str| {
        let _ = Command::new("dd")
            .args(["if=/dev/zero", "bs=4k"])
            .arg(format!("of={}", fs_.dir.join(name).display()))
            .output();
    };
    fill("filler");
    fs::remove_file(root.join("reserve")).unwrap();
    fill("filler2");
    let out = stowage_at(&root, &["exec", "--write", "n", "--", "true"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(!root.join("locks/images/n.lock").exists(), "{}", show(&out));
    assert_eq!(
        stowage_at(&root, &["exec", "--read", "a", "--", "true"])
            .status
            .code(),
        Some(0)
    );
}

#[test]
fn a_full_filesystem_fails_cleanly_and_loses_nothing() {
    let Some(fs_) = Mount::tmpfs("size=2m") else {
        return;
    };
    let root = fs_.dir.join("root");
    let out = stowage_at(
        &root,
        &[
            "exec",
            "--write",
            "a",
            "--",
            "sh",
            "-c",
            "echo data > \"$STOWAGE_IMAGE_DIR/f\"",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    // Fill the filesystem.
    let filler = fs_.dir.join("filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=64k"])
        .arg(format!("of={}", filler.display()))
        .output();
    let out = stowage_at(
        &root,
        &[
            "exec",
            "--write",
            "b",
            "--",
            "sh",
            "-c",
            "head -c 100000 /dev/zero > \"$STOWAGE_IMAGE_DIR/f\"",
        ],
    );
    assert_ne!(out.status.code(), Some(0), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("space") || err.contains("full"),
        "names the cause: {err}"
    );
    // Even a read needs to record its start; it fails the same clear way.
    let out = stowage_at(&root, &["exec", "--read", "a", "--", "true"]);
    if out.status.code() != Some(0) {
        let err = stderr(&out);
        assert!(err.contains("stowage.db") && err.contains("space"), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
    fs::remove_file(&filler).unwrap();
    assert_eq!(
        stowage_at(&root, &["doctor", "--repair"]).status.code(),
        Some(0)
    );
    // Nothing was lost: 'a' is ready with its content.
    let out = stowage_at(
        &root,
        &[
            "exec",
            "--read",
            "a",
            "--",
            "cat",
            &root.join("img/a/f").display().to_string(),
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "data\n");
    let out = stowage_at(&root, &["exec", "--write", "b", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}

fn free_bytes(dir: &Path) -> u64 {
    let st = nix::sys::statvfs::statvfs(dir).unwrap();
    st.blocks_available() * st.fragment_size()
}

/// A store on an 8 MiB tmpfs of its own with a ready image `base`, and a
/// writer of image `killed` under way (sleeping a minute at most) for the
/// test to kill; `None`, with the reason printed, where no tmpfs can be
/// mounted.
fn small_store_with_a_writer() -> Option<(Mount, Env, Bg)> {
    let t = Mount::tmpfs("size=8m,mode=0755")?;
    let env = t.env();
    env.make_image("base");
    let writer = env.start_sh(&["--write", "killed"], |started| {
        format!("touch '{}'; exec sleep 60", started.display())
    });
    Some((t, env, writer))
}

#[test]
fn a_build_that_fills_the_filesystem_does_not_wedge_the_store() {
    // A writer at work, to be killed once the filesystem is full: whoever
    // looks next must record that it is gone.
    let Some((t, env, writer)) = small_store_with_a_writer() else {
        return;
    };
    // The build writes until the filesystem is full.
    let fill = [
        "exec",
        "--write",
        "big",
        "--",
        "sh",
        "-c",
        "dd if=/dev/zero of=\"$STOWAGE_IMAGE_DIR/blob\" bs=64k count=1000 status=none",
    ];
    let out = env.run(fill);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(free_bytes(&t.dir) < 64 << 10, "the filesystem is not full");
    let err = stderr(&out);
    assert!(
        err.contains("image 'big' is incomplete") && err.contains("full"),
        "{err}"
    );
    assert!(!err.contains("recording that failed"), "{err}");
    writer.kill_all();

    // Reading commands work on the full filesystem.
    assert_eq!(env.state("big").as_deref(), Some("incomplete"));
    assert_eq!(env.state("killed").as_deref(), Some("incomplete"));
    env.status_json(["--all"]);
    env.ok(["lock-status"]);
    env.ok(["slots"]);
    env.ok(["doctor"]);
    env.ok(["gc", "--dry-run"]);
    // So does running something that only reads an image.
    env.ok(["exec", "--read", "base", "--", "true"]);
    assert!(
        free_bytes(&t.dir) < 64 << 10,
        "the filesystem is still full"
    );

    // rm frees the space; everything works again, no file touched by hand.
    env.ok(["rm", "big"]);
    assert!(free_bytes(&t.dir) > 6 << 20);
    env.make_image("after");
    env.ok(["exec", "--read", "base", "--", "true"]);
    let out = env.ok(["doctor"]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("PROBLEM"),
        "{}",
        show(&out)
    );

    // The same again, freed by gc instead of rm.
    let fill2 = fill.map(|a| if a == "big" { "big2" } else { a });
    let out = env.run(fill2);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(env.state("big2").as_deref(), Some("incomplete"));
    env.ok(["gc"]);
    assert!(env.image("big2").is_none() && env.image("killed").is_none());
    assert!(free_bytes(&t.dir) > 6 << 20);
    env.make_image("after2");
}

#[test]
fn reading_commands_work_when_even_the_reserve_is_gone() {
    let Some((t, env, writer)) = small_store_with_a_writer() else {
        return;
    };
    writer.kill_all();
    // The filesystem full, and no reserve left to use.
    let _ = fs::remove_file(env.root.join("reserve"));
    let filler = t.dir.join("filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=4k", "status=none"])
        .arg(format!("of={}", filler.display()))
        .output();
    assert!(free_bytes(&t.dir) < 4096);
    // They show what they would record (the writer is gone) and write
    // nothing.
    assert_eq!(env.state("killed").as_deref(), Some("incomplete"));
    let before = fs::read(env.root.join("stowage.db")).ok();
    env.status_json(["--all"]);
    env.ok(["lock-status"]);
    env.ok(["gc", "--dry-run"]);
    // doctor reports (the stale record it could not drop is a problem
    // until --repair can run), it does not fail.
    let out = env.run(["doctor"]);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ok  catalog") && stderr(&out).is_empty(),
        "{}",
        show(&out)
    );
    assert!(fs::read(env.root.join("stowage.db")).ok() == before);
    fs::remove_file(&filler).unwrap();
    env.ok(["gc"]);
    assert!(env.image("killed").is_none());
    assert!(
        env.root.join("reserve").exists(),
        "gc recreates the reserve"
    );
}

/// The filesystem full and no reserve left: gc and rm still free space
/// (their removals need none), and `doctor --repair` does all it can,
/// reporting the one thing it cannot (a tree without a record needs a new
/// lock file) with what frees space — commands that work there — instead
/// of stopping at it; once space is freed, it finishes.
#[test]
fn removals_and_repair_work_on_a_full_filesystem_without_a_reserve() {
    let Some((t, env, writer)) = small_store_with_a_writer() else {
        return;
    };
    writer.kill_all();
    env.build(
        "big",
        "head -c 2000000 /dev/zero > \"$STOWAGE_IMAGE_DIR/blob\"",
    );
    env.make_image("old");
    fs::create_dir_all(env.images_dir().join("orphan")).unwrap();
    let _ = fs::remove_file(env.root.join("reserve"));
    let filler = t.dir.join("filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=1k", "status=none"])
        .arg(format!("of={}", filler.display()))
        .output();
    assert!(free_bytes(&t.dir) < 4096);
    let out = env.run(["doctor", "--repair"]);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        said.contains("cannot adopt") && said.contains("'orphan'") && said.contains(" gc'"),
        "{}",
        show(&out)
    );
    assert!(stderr(&out).is_empty(), "{}", show(&out));
    let out = env.run(["gc"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        env.image("killed").is_none(),
        "gc removed the dead writer's image"
    );
    env.ok(["rm", "old"]);
    env.ok(["rm", "big"]);
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("orphan").as_deref(), Some("incomplete"));
    assert_eq!(env.read_in_image("base", "file"), "content\n");
}

// --- outside programs -------------------------------------------------------

/// An outside program (an sqlite3 shell) holding the catalog's own lock:
/// images are still listed from their records, and a command that must
/// write the catalog says who holds it (75) rather than hang.
#[test]
fn a_catalog_locked_by_an_outside_program_stops_nothing_and_is_named() {
    if !tool_or_skip("python3", "python3") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    env.ok(["images"]);
    let holder = hold_catalog(&env);
    let mut c = env.cmd(["images"]);
    c.env("STOWAGE_DEBUG_DB_BUSY_MS", "300");
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ready"),
        "{}",
        show(&out)
    );
    assert!(stderr(&out).contains("outside stowage"), "{}", stderr(&out));
    env.ok(["exec", "--read", "a", "--", "true"]);
    holder.kill_all();
    env.ok(["images"]);
}

/// Images are read and written under their own locks: a stuck holder of
/// the global lock (a stopped process, flock(1) by hand) stops no exec,
/// and a command that needs it says whom it waits for.
#[test]
fn a_stuck_global_lock_holder_stops_no_exec() {
    let env = Env::new();
    env.make_image("a");
    let started = env.sentinel("started");
    let stuck = flock_holder(&env.root.join("locks/global.lock"), &started, "sleep 60");
    for args in [
        vec![
            "exec", "--write", "b", "--from", "a", "--wait", "0.3", "--", "true",
        ],
        vec![
            "exec", "--read", "a", "--write", "c", "--wait", "0.3", "--", "true",
        ],
        vec!["rm", "--no-wait", "c"],
    ] {
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", show(&out));
    }
    let setter = env.spawn(["slots", "set", "pull", "1"]);
    let global = env.root.join("locks/global.lock");
    wait_until("slots set waits for the global lock", || {
        flock_waited_on(&global)
    });
    // It says so once the wait has gone on (two seconds: it is normally
    // held for microseconds).
    std::thread::sleep(Duration::from_millis(2500));
    stuck.kill_all();
    let out = setter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("waiting for the global lock"),
        "says it waits: {err}"
    );
    assert!(err.contains("flock"), "names the holder: {err}");
}

/// A listing and gc need the catalog only for what it caches (sizes,
/// lineage for display): with the global lock held by a stuck process
/// (flock(1) by hand, a stopped stowage) they go on from the images'
/// records after a bounded wait, saying so in one line naming the lock
/// and its holder, and gc still removes what the records let it.
#[test]
fn images_and_gc_do_without_a_catalog_whose_lock_a_stuck_process_holds() {
    let env = Env::new();
    env.make_image("a");
    let failed = env.run_sh("failed", "exit 3");
    assert_eq!(code(&failed), Some(3), "{}", show(&failed));
    let started = env.sentinel("started");
    let stuck = flock_holder(&env.root.join("locks/global.lock"), &started, "sleep 120");
    for args in [&["images"][..], &["gc"]] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.trim_end().lines().count() == 1
                && err.contains("locks/global.lock")
                && err.contains("flock")
                && err.contains("without the catalog"),
            "{args:?}: {err}"
        );
    }
    assert!(
        !env.lock_file("failed").exists() && !env.images_dir().join("failed").exists(),
        "gc removed the failed image"
    );
    let out = env.run(["images"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("a "),
        "{}",
        show(&out)
    );
    stuck.kill_all();
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}

#[test]
fn a_database_switched_to_wal_by_an_outside_program_is_switched_back() {
    // WAL needs shared memory that NFS cannot share: never keep it.
    let env = Env::new();
    env.make_image("a");
    env.ok(["images"]);
    let db = env.root.join("stowage.db");
    let script = format!(
        "import sqlite3; c = sqlite3.connect('{}'); print(c.execute('PRAGMA journal_mode=WAL').fetchone()[0]); c.close()",
        db.display()
    );
    let Ok(out) = Command::new("python3").args(["-c", &script]).output() else {
        eprintln!("skipping: python3 is not available");
        return;
    };
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "wal");
    let header = fs::read(&db).unwrap();
    assert_eq!(
        (header[18], header[19]),
        (2, 2),
        "the outside program set WAL"
    );
    // Any command that uses the catalog.
    env.ok(["images"]);
    let header = fs::read(&db).unwrap();
    assert_eq!(
        (header[18], header[19]),
        (1, 1),
        "back to a rollback journal"
    );
    assert!(!env.root.join("stowage.db-wal").exists());
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}

/// `sqlite3 DB COMMANDS…`, an outside program, which must succeed.
fn outside_sqlite(db: &Path, commands: &[&str]) {
    let out = Command::new("sqlite3")
        .arg(db)
        .args(commands)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
}

/// strace's faults for a filesystem that maps no file into shared memory
/// (FUSE, as GlusterFS mounts: ENODEV), for the catalog's WAL index.
fn no_shared_memory(env: &Env) -> Vec<std::ffi::OsString> {
    let shm = env.root.join("stowage.db-shm");
    let args: [std::ffi::OsString; 5] = [
        "-P".into(),
        shm.into(),
        "-e".into(),
        "trace=mmap,pread64".into(),
        "--inject=mmap:error=ENODEV".into(),
    ];
    args.into()
}

/// A catalog an outside program switched to WAL where WAL's index cannot be
/// shared (a FUSE mount such as GlusterFS; here strace fails every mmap of
/// `stowage.db-shm` as FUSE does): every command failed on it ("disk I/O
/// error", code 5386), `doctor --repair` too, at every run. The first
/// command switches it back all the same, its rows kept, saying nothing.
#[test]
fn a_wal_catalog_whose_index_cannot_be_shared_is_switched_back() {
    if !tool_or_skip("strace", "strace") || !tool_or_skip("sqlite3", "sqlite3") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    env.ok(["images"]);
    outside_sqlite(&env.root.join("stowage.db"), &["PRAGMA journal_mode=WAL;"]);
    let out = output(under_strace(&env, &no_shared_memory(&env), &["images"]));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(stdout(&out).contains("a "), "{}", show(&out));
    assert_eq!(stderr(&out), "", "{}", show(&out));
    assert_eq!(journal_mode(&env), "delete");
    assert!(!env.root.join("stowage.db-wal").exists());
    let out = output(under_strace(&env, &no_shared_memory(&env), &["doctor"]));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(stdout(&out).contains("intact"), "{}", show(&out));
}

/// Such a catalog whose WAL (holding an outside program's writes) cannot be
/// read either (strace fails its reads): it cannot be switched back here.
/// Every command goes on from the records in one line naming the cause and
/// the fix; `doctor` says the same (exit 1); `doctor --repair` sets it
/// aside with its WAL and index, makes it anew (exit 0), and is done.
#[test]
fn a_wal_catalog_that_cannot_be_switched_back_is_set_aside_by_a_repair() {
    if !tool_or_skip("strace", "strace") || !tool_or_skip("sqlite3", "sqlite3") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    env.ok(["images"]);
    let db = env.root.join("stowage.db");
    let kept = ".filectrl persist_wal 1";
    let write = "CREATE TABLE outside (x); INSERT INTO outside VALUES (1);";
    outside_sqlite(&db, &[kept, "PRAGMA journal_mode=WAL;", write]);
    let mut faults = no_shared_memory(&env);
    let wal = env.root.join("stowage.db-wal");
    assert!(
        fs::metadata(&wal).unwrap().len() > 0,
        "the WAL holds the write"
    );
    faults.extend([
        "-P".into(),
        wal.clone().into(),
        "--inject=pread64:error=EIO".into(),
    ]);
    let run = |args: &[&str]| output(under_strace(&env, &faults, args));
    let out = run(&["images"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(stdout(&out).contains("a "), "{}", show(&out));
    let said = stderr(&out);
    assert_eq!(said.lines().count(), 1, "{}", show(&out));
    for part in [
        "cannot be switched back",
        "shared memory",
        "doctor --repair' sets it aside",
    ] {
        assert!(said.contains(part), "{part}: {}", show(&out));
    }
    let out = run(&["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stdout(&out).contains("cannot be switched back"),
        "{}",
        show(&out)
    );
    for _ in 0..2 {
        let out = run(&["doctor", "--repair"]);
        assert_eq!(code(&out), Some(0), "{}", show(&out));
    }
    let aside: Vec<String> = fs::read_dir(&env.root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".wal-"))
        .collect();
    for file in [
        "stowage.db.wal-",
        "stowage.db-wal.wal-",
        "stowage.db-shm.wal-",
    ] {
        assert_eq!(
            aside.iter().filter(|n| n.starts_with(file)).count(),
            1,
            "{aside:?}"
        );
    }
    assert!(!wal.exists() && !env.root.join("stowage.db-shm").exists());
    let out = run(&["doctor"]);
    assert!(stdout(&out).contains("intact"), "{}", show(&out));
    assert_eq!(journal_mode(&env), "delete");
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}

/// An outside program's connection to the catalog in WAL mode, left open
/// and idle (an sqlite3 shell at its prompt after a query).
fn outside_wal_connection(env: &Env) -> rusqlite::Connection {
    env.ok(["images"]);
    let conn = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let _: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
        .unwrap();
    conn
}

/// Whether process `pid` has the file `path` open.
fn has_open(pid: u32, path: &Path) -> bool {
    fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
        fds.flatten()
            .any(|fd| fs::read_link(fd.path()).is_ok_and(|t| t == path))
    })
}

/// The catalog's journal mode, as SQLite reads its header.
fn journal_mode(env: &Env) -> String {
    rusqlite::Connection::open(env.root.join("stowage.db"))
        .unwrap()
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap()
}

/// SQLite leaves WAL without its busy handler: a program that closes the
/// catalog while stowage waits to switch it back must cost a moment, not
/// a failed command, and the catalog ends in rollback mode.
#[test]
fn an_outside_program_closing_a_wal_catalog_in_time_fails_nothing() {
    let env = Env::new();
    env.make_image("a");
    let conn = outside_wal_connection(&env);
    let db = fs::canonicalize(env.root.join("stowage.db")).unwrap();
    let mut c = env.cmd(["images"]);
    c.env(stowage::env::DEBUG_DB_BUSY_MS, "60000");
    let mut bg = Bg::from_command(c);
    let pid = bg.pid();
    wait_until("stowage opens the catalog or ends", || {
        has_open(pid, &db) || !bg.is_running()
    });
    drop(conn);
    let out = bg.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("a "),
        "{}",
        show(&out)
    );
    assert_eq!(journal_mode(&env), "delete");
}

/// With the outside program staying, `images` still lists every image from
/// its record, and says it gave up on the catalog after as long as it
/// waited — which must really have passed.
#[test]
fn a_wal_catalog_held_open_is_waited_for_as_long_as_said_and_listed_around() {
    let env = Env::new();
    env.make_image("a");
    let conn = outside_wal_connection(&env);
    let mut c = env.cmd(["images", "--json"]);
    c.env(stowage::env::DEBUG_DB_BUSY_MS, "400");
    let t0 = std::time::Instant::now();
    let out = output(c);
    let took = t0.elapsed();
    drop(conn);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[0]["name"], "a", "{rows}");
    assert_eq!(rows[0]["state"], "ready", "{rows}");
    assert!(
        stderr(&out).contains("gave up after 0.4 s") && took >= Duration::from_millis(400),
        "said it waited 0.4 s, took {took:?}: {}",
        show(&out)
    );
}

/// An sqlite3 shell keeps a read transaction open in a catalog it put in
/// WAL mode: the catalog cannot leave WAL then, and no write needs it —
/// a copy from a base and a change of a slot class take effect, and the
/// next command after the reader has gone switches the catalog back.
#[test]
fn an_outside_reader_of_a_wal_catalog_stops_no_write() {
    if !tool_or_skip("sqlite3", "sqlite3") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    env.ok(["images"]);
    let db = env.root.join("stowage.db");
    let out = Command::new("sqlite3")
        .arg(&db)
        .arg("PRAGMA journal_mode=WAL;")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let reading = env.sentinel("reading");
    let reader = Bg::from_command({
        let mut c = Command::new("sh");
        c.arg("-c").arg(format!(
            "{{ printf 'BEGIN;\\nSELECT count(*) FROM images;\\n.shell touch %s\\n' '{reading}'; \
             i=0; while [ ! -e '{done}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; \
             echo 'COMMIT;'; }} | sqlite3 '{db}'",
            reading = reading.display(),
            done = env.sentinel("done").display(),
            db = db.display()
        ));
        c
    });
    wait_for_file(&reading);
    let short = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env(stowage::env::DEBUG_DB_BUSY_MS, "300");
        output(c)
    };
    let ran = env.sentinel("ran");
    let out = short(&[
        "exec",
        "--write",
        "app",
        "--from",
        "base",
        "--",
        "touch",
        ran.to_str().unwrap(),
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(ran.exists());
    let out = short(&["slots", "set", "pull", "2"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.release("done");
    let out = reader.finish();
    assert!(out.status.success(), "{}", show(&out));
    let app = env.image("app").expect("the copy is an image");
    assert_eq!(app["state"], "ready", "{app}");
    assert_eq!(app["base"], "base", "{app}");
    assert_eq!(
        env.slot_entry("pull").expect("the class is set")["limit"],
        2
    );
    assert_eq!(journal_mode(&env), "delete");
}

// --- planted entries in the slots' directories ---------------------------------

/// `exec --slot CLASS --no-wait -- true`: exit 0 if a slot was free, 75 if
/// the class was full.
fn try_slot(env: &Env, class: &str) -> std::process::Output {
    env.run(["exec", "--slot", class, "--no-wait", "--", "true"])
}

/// One slot held, and the limit (1) reached: the next acquirer is refused.
fn assert_limit_one_binds(env: &Env) {
    let holder = env.hold(&["--slot", "pull"], "held");
    let out = try_slot(env, "pull");
    assert_eq!(
        code(&out),
        Some(75),
        "a second holder beside the one limit 1 allows: {}",
        show(&out)
    );
    env.release("release");
    let out = holder.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// A link and a directory planted under slot names beyond the limit (a
/// group member can write the class directory): a lowered limit is still
/// the one every acquirer goes by, and the link's target is untouched.
#[test]
fn entries_planted_under_slot_names_leave_no_old_limit_standing() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "4"]);
    let dir = env.root.join("locks/slots/pull");
    let elsewhere = env.scratch.join("elsewhere");
    fs::write(&elsewhere, "keep").unwrap();
    symlink(&elsewhere, dir.join("9.lock")).unwrap();
    fs::create_dir(dir.join("8.lock")).unwrap();
    env.ok(["slots", "set", "pull", "1"]);
    assert_limit_one_binds(&env);
    assert_eq!(fs::read_to_string(&elsewhere).unwrap(), "keep");
}

/// A link planted under a slot name beyond the limit is nobody's slot: a
/// waiter gets the slot freed by the one holder.
#[test]
fn a_link_under_a_slot_name_does_not_fail_the_waiters() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "1"]);
    let elsewhere = env.scratch.join("elsewhere");
    fs::write(&elsewhere, "keep").unwrap();
    symlink(&elsewhere, env.root.join("locks/slots/pull/5.lock")).unwrap();
    let holder = env.hold(&["--slot", "pull"], "held");
    let waiter = env.spawn(["exec", "--slot", "pull", "--", "true"]);
    env.wait_for_slot_waiters("pull", 1);
    env.release("release");
    let out = holder.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = waiter.finish();
    assert_eq!(
        code(&out),
        Some(0),
        "the waiter gets the slot: {}",
        show(&out)
    );
    assert_eq!(fs::read_to_string(&elsewhere).unwrap(), "keep");
}

/// A class directory replaced by a link to a directory outside the root:
/// changing or removing the class never writes, or empties, files there.
#[test]
fn a_linked_class_directory_never_has_files_outside_the_root_written() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let victim = env.scratch.join("victim");
    fs::create_dir(&victim).unwrap();
    fs::write(victim.join("x.lock"), "precious").unwrap();
    fs::write(victim.join("0.lock"), "precious").unwrap();
    let dir = env.root.join("locks/slots/pull");
    fs::remove_dir_all(&dir).unwrap();
    symlink(&victim, &dir).unwrap();
    for args in [
        &["slots", "set", "pull", "0"][..],
        &["slots", "set", "pull", "3"],
        &["exec", "--slot", "pull", "--", "true"],
        &["slots", "rm", "pull"],
    ] {
        let out = env.run(args);
        for f in ["x.lock", "0.lock"] {
            assert_eq!(
                fs::read_to_string(victim.join(f)).unwrap(),
                "precious",
                "{f} outside the root was written by {args:?}: {}",
                show(&out)
            );
        }
    }
}

/// `locks/slots` replaced by a link to a directory outside the root:
/// nothing is made there, by a change of a class or by an acquirer (which
/// refuses, naming the link).
#[test]
fn a_linked_slots_directory_never_has_anything_made_outside_the_root() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let victim = env.scratch.join("victim");
    fs::create_dir(&victim).unwrap();
    let slots = env.root.join("locks/slots");
    fs::rename(&slots, env.root.join("locks/slots.real")).unwrap();
    symlink(&victim, &slots).unwrap();
    let set = env.run(["slots", "set", "pull", "3"]);
    assert_ne!(code(&set), Some(0), "{}", show(&set));
    assert!(
        stderr(&set).contains("refusing to use it"),
        "{}",
        show(&set)
    );
    let out = env.run(["exec", "--slot", "pull", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(
        walkdir(&victim).len(),
        0,
        "made outside the root: {:?}\n{}",
        walkdir(&victim),
        show(&out)
    );
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("locks/slots is a symlink"),
        "{}",
        show(&out)
    );
}

/// An acquirer of a class whose slots directory is a planted link refuses,
/// as `slots set` does, naming the link: not "unknown slot class", whose
/// advice (`slots set`) then fails.
#[test]
fn an_acquirer_refuses_a_linked_slots_directory_naming_it() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let victim = env.scratch.join("victim");
    fs::create_dir(&victim).unwrap();
    let slots = env.root.join("locks/slots");
    fs::rename(&slots, env.root.join("locks/slots.real")).unwrap();
    symlink(&victim, &slots).unwrap();
    let out = env.run(["exec", "--slot", "pull", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stderr(&out).contains("refusing to use it"),
        "{}",
        show(&out)
    );
}

/// A directory named like a lock file among the image lock files is no
/// image's: a store-wide command, which passes over every lock file, is
/// not stopped by it.
#[test]
fn a_stray_entry_among_the_lock_files_does_not_stop_store_wide_commands() {
    let env = Env::new();
    env.make_image("keep");
    fs::create_dir(env.root.join("locks/images/stray.lock")).unwrap();
    let out = env.run(["exec", "--store-wide", "--", "true"]);
    assert_eq!(
        code(&out),
        Some(0),
        "a directory named like a lock file stopped a store-wide command: {}",
        show(&out)
    );
    env.ok(["exec", "--read", "keep", "--", "true"]);
    assert!(env.root.join("locks/images/stray.lock").is_dir());
}

/// A link planted in the images directory's place (the real one moved
/// aside): a new image is not made through it, and the write fails.
#[test]
fn a_new_image_is_not_made_through_a_link_in_the_images_directorys_place() {
    let env = Env::new();
    env.make_image("base");
    let outside = env.tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let img = env.images_dir();
    fs::rename(&img, env.tmp.path().join("img.real")).unwrap();
    symlink(&outside, &img).unwrap();
    let out = env.run(["exec", "--write", "app", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(stderr(&out).contains("symlink"), "{}", show(&out));
    assert!(
        fs::read_dir(&outside).unwrap().next().is_none(),
        "a tree was made outside the images directory: {}",
        show(&out)
    );
    assert_eq!(env.state("app"), None);
}

// --- kernels and filesystems that refuse --------------------------------------

/// `cmd` run where `openat2` fails with `errno`, as on a kernel older than
/// 5.6 (ENOSYS) or under a container's seccomp profile (EPERM): a seccomp
/// filter installed in the child before it runs stowage.
#[cfg(target_arch = "x86_64")]
fn without_openat2(cmd: &mut Command, errno: u32) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only prctl(2) between fork and exec, on data the closure owns.
    unsafe {
        cmd.pre_exec(move || {
            let filter = [
                // A = seccomp_data.nr
                libc::sock_filter {
                    code: 0x20,
                    jt: 0,
                    jf: 0,
                    k: 0,
                },
                // if A == SYS_openat2 (437) fall through, else skip one
                libc::sock_filter {
                    code: 0x15,
                    jt: 0,
                    jf: 1,
                    k: 437,
                },
                // return SECCOMP_RET_ERRNO | errno
                libc::sock_filter {
                    code: 0x06,
                    jt: 0,
                    jf: 0,
                    k: 0x0005_0000 | errno,
                },
                // return SECCOMP_RET_ALLOW
                libc::sock_filter {
                    code: 0x06,
                    jt: 0,
                    jf: 0,
                    k: 0x7fff_0000,
                },
            ];
            let prog = libc::sock_fprog {
                len: filter.len() as u16,
                filter: filter.as_ptr() as *mut libc::sock_filter,
            };
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::prctl(libc::PR_SET_SECCOMP, 2, &prog as *const libc::sock_fprog) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Without openat2 (an old kernel, a seccomp profile), every command
/// still works: writes record their outcome, reads and listings see it.
#[cfg(target_arch = "x86_64")]
#[test]
fn a_kernel_without_openat2_still_runs_every_command() {
    for errno in [libc::ENOSYS, libc::EPERM] {
        let env = Env::new();
        env.make_image("a");
        let run = |args: &[&str]| {
            let mut c = env.cmd(args);
            without_openat2(&mut c, errno as u32);
            output(c)
        };
        let out = run(&[
            "exec",
            "--write",
            "b",
            "--",
            "sh",
            "-c",
            "echo x > \"$STOWAGE_IMAGE_DIR/f\"",
        ]);
        assert_eq!(code(&out), Some(0), "{errno}: {}", show(&out));
        let out = run(&["exec", "--read", "a", "--read", "b", "--", "true"]);
        assert_eq!(code(&out), Some(0), "{errno}: {}", show(&out));
        let out = run(&["exec", "--write", "a", "--", "false"]);
        assert_eq!(code(&out), Some(1), "{errno}: {}", show(&out));
        let out = run(&["images"]);
        assert_eq!(code(&out), Some(0), "{errno}: {}", show(&out));
        let listed = String::from_utf8_lossy(&out.stdout);
        assert!(
            listed
                .lines()
                .any(|l| l.starts_with("a ") && l.contains("incomplete")),
            "{errno}: the failed write is seen: {}",
            show(&out)
        );
        for args in [
            &["gc"][..],
            &["rm", "b"],
            &["doctor"],
            &["lock-status", "--all"],
        ] {
            let out = run(args);
            assert_eq!(code(&out), Some(0), "{errno} {args:?}: {}", show(&out));
        }
        assert_eq!(
            env.state("a"),
            None,
            "{errno}: gc collected the failed write"
        );
        assert_eq!(env.state("b"), None, "{errno}: removed");
    }
}

/// The catalog lost on a filesystem filled to the last byte: `images`
/// still lists every image (from the records), and `rm` still removes one.
#[test]
fn a_lost_catalog_on_a_full_filesystem_still_lists_and_removes() {
    let Some(fs_) = Mount::tmpfs("size=2m") else {
        return;
    };
    let env = fs_.env();
    env.make_image("a");
    env.make_image("b");
    env.ok(["images"]);
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    let _ = fs::remove_file(env.root.join("reserve"));
    {
        use std::io::Write;
        let mut f = fs::File::create(fs_.dir.join("fill")).unwrap();
        let chunk = vec![0u8; 64 * 1024];
        while f.write_all(&chunk).is_ok() {}
        while f.write_all(&chunk[..512]).is_ok() {}
        while f.write_all(&chunk[..1]).is_ok() {}
    }
    let out = env.run(["images"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let listed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(listed.contains("a ") && listed.contains("b "), "{listed}");
    let out = env.run(["rm", "a"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(env.image("a").is_none(), "'a' is still there");
    assert_eq!(env.state("b").as_deref(), Some("ready"));
}

/// On a copy-on-write filesystem (btrfs) rewriting even a few bytes of a
/// file needs free space. A build filled the filesystem: `rm` of a ready
/// image, read before, must still free space, with no file touched by
/// hand.
#[test]
fn rm_of_a_read_image_frees_a_full_copy_on_write_filesystem() {
    let Some(m) = Mount::btrfs_loop("256M") else {
        return;
    };
    let env = m.env();
    env.build(
        "old",
        "head -c 20000000 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
    );
    env.ok(["exec", "--read", "old", "--", "true"]);
    let out = env.run([
        "exec",
        "--write",
        "big",
        "--",
        "sh",
        "-c",
        "head -c 1000000000 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"; \
         i=0; while echo x > \"$STOWAGE_IMAGE_DIR/s$i\"; do i=$((i+1)); done 2>/dev/null; exit 1",
    ]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    // Whatever the build left free (btrfs keeps some back for metadata)
    // goes too: big files, then small ones.
    let fill = format!(
        "head -c 1000000000 /dev/zero > '{d}/filler' 2>/dev/null; \
         i=0; while echo y > '{d}/fill.'$i; do i=$((i+1)); done 2>/dev/null; sync; \
         ! echo z > '{d}/probe' 2>/dev/null",
        d = m.dir.display()
    );
    let full = Command::new("sh").args(["-c", &fill]).status().unwrap();
    assert!(full.success(), "the filesystem is not full");
    let out = env.run(["rm", "old"]);
    assert_eq!(
        code(&out),
        Some(0),
        "rm cannot free a full filesystem: {}",
        show(&out)
    );
    assert!(env.image("old").is_none());
}

/// An immutable lock file is named as such, by a read, a removal and doctor:
/// its mode allows the write, so "mode 644, not readable and writable by
/// you; 'stowage doctor --repair' gives it back its mode" sent the user to a
/// repair that cannot help.
#[test]
fn an_immutable_lock_file_is_said_to_be_immutable_not_of_the_wrong_mode() {
    if !root_or_skip("chattr +i") || !tool_or_skip("chattr", "e2fsprogs") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    let lock = env.lock_file("a");
    if !immutable(&lock, true) {
        eprintln!("skipping: chattr +i is not supported here");
        return;
    }
    let outs = [
        env.run(["exec", "--read", "a", "--", "true"]),
        env.run(["rm", "a"]),
        env.run(["doctor", "--repair"]),
    ];
    assert!(immutable(&lock, false));
    for out in &outs {
        assert_eq!(code(out), Some(1), "{}", show(out));
        let said = format!("{}{}", stdout(out), stderr(out));
        assert!(said.contains("immutable"), "{}", show(out));
        assert!(!said.contains("not readable and writable"), "{}", show(out));
        assert!(
            !said.contains("you may not read and write it"),
            "{}",
            show(out)
        );
    }
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}

/// A reader that must wait makes a gate in `locks/images`: with that
/// directory immutable it is refused naming the flag, not sent to
/// `init --group` (which root, owning the store, has no use for).
#[test]
fn an_immutable_lock_directory_is_said_to_be_immutable() {
    if !root_or_skip("chattr +i") || !tool_or_skip("chattr", "e2fsprogs") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    let writer = env.hold(&["--write", "a"], "writing");
    let locks = env.root.join("locks/images");
    if !immutable(&locks, true) {
        eprintln!("skipping: chattr +i is not supported here");
        env.release("release");
        writer.finish();
        return;
    }
    let out = env.run(["exec", "--read", "a", "--wait", "5", "--", "true"]);
    assert!(immutable(&locks, false));
    env.release("release");
    writer.finish();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("is immutable"), "{}", show(&out));
    assert!(!stderr(&out).contains("init --group"), "{}", show(&out));
}

/// A writer that died before its command, whose lock file this process
/// cannot write (immutable here; another user's elsewhere): its image is
/// still shown incomplete, never ready, and is once the file can be
/// written again.
#[test]
fn a_dead_writers_image_whose_lock_file_cannot_be_written_is_shown_incomplete() {
    if !root_or_skip("chattr +i") || !tool_or_skip("chattr", "e2fsprogs") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    let (writer, _) = env.paused(
        [
            "exec",
            "--write",
            "a",
            "--",
            "sh",
            "-c",
            "echo half > \"$STOWAGE_IMAGE_DIR/file\"",
        ],
        "exec-before-spawn",
    );
    writer.kill_all();
    let lock = env.lock_file("a");
    if !immutable(&lock, true) {
        eprintln!("skipping: chattr +i is not supported here");
        return;
    }
    let listed = env.run(["images", "--json"]);
    let read = env.run(["exec", "--read", "a", "--", "true"]);
    assert!(immutable(&lock, false));
    assert_eq!(code(&listed), Some(0), "{}", show(&listed));
    let rows: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(rows[0]["state"], "incomplete", "{rows}");
    assert_ne!(code(&read), Some(0), "{}", show(&read));
    assert_eq!(env.state("a").as_deref(), Some("incomplete"));
    let out = env.run(["exec", "--read", "a", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
}

/// An empty `STOWAGE_ROOT` is a wrapper's unset variable, as `--root ""`
/// is: refused (64), never taken for the default root (before: the
/// default root was used, and a write would have gone there).
#[test]
fn an_empty_stowage_root_is_refused_not_taken_for_the_default() {
    let user = format!("stowage-it-{}", std::process::id());
    let default = Path::new("/var/tmp").join(format!("{user}.stowage"));
    for args in [&["images"][..], &["exec", "--write", "a", "--", "true"]] {
        let mut c = Command::new(bin());
        c.args(args).env("STOWAGE_ROOT", "").env("USER", &user);
        let out = output(c);
        assert_eq!(code(&out), Some(64), "{args:?}: {}", show(&out));
        assert!(
            stderr(&out).contains("STOWAGE_ROOT is set but empty"),
            "{}",
            show(&out)
        );
        assert!(!default.exists(), "{args:?} made the default root");
    }
    // Only blanks, either way: refused, no directory of blanks made where it runs.
    let cwd = tempfile::tempdir().unwrap();
    for how in ["env", "flag"] {
        let mut c = Command::new(bin());
        c.current_dir(cwd.path()).env("USER", &user);
        match how {
            "env" => c.env("STOWAGE_ROOT", " \t"),
            _ => c.env_remove("STOWAGE_ROOT").args(["--root", " "]),
        };
        c.args(["exec", "--write", "a", "--", "true"]);
        let out = output(c);
        assert_eq!(code(&out), Some(64), "{how}: {}", show(&out));
        assert!(stderr(&out).contains("only blanks"), "{}", show(&out));
        assert_eq!(fs::read_dir(cwd.path()).unwrap().count(), 0, "{how}");
    }
}

/// A command a message suggests is one a shell runs as meant, whatever the
/// root's path holds: a space, a quote, a `$(…)` is quoted, never split or
/// run. Pasted into sh, the suggestion makes the store at that very path.
#[test]
fn a_suggested_command_quotes_the_root_it_names() {
    let env = Env::new();
    let marker = env.scratch.join("ran");
    for name in ["my store", "it's", "$(touch ran)"] {
        let root = env.scratch.join(name);
        let mut c = Command::new(bin());
        c.arg("--root").arg(&root).arg("images");
        let out = output(c);
        assert_eq!(code(&out), Some(66), "{}", show(&out));
        let err = stderr(&out);
        let start = err.find("('stowage ").expect("a suggestion") + 2;
        let end = err.rfind("' creates it)").expect("a suggestion");
        let suggested = &err[start..end];
        let script = format!("stowage() {{ \"$STOWAGE_BIN\" \"$@\"; }}; {suggested}");
        let ran = Command::new("sh")
            .args(["-c", &script])
            .env("STOWAGE_BIN", bin())
            .current_dir(&env.scratch)
            .output()
            .unwrap();
        assert_eq!(code(&ran), Some(0), "{suggested}: {}", show(&ran));
        assert!(root.join("store.conf").exists(), "{suggested}");
        assert!(!marker.exists(), "{suggested} ran a substitution");
    }
}
