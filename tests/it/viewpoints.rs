//! What holds from one viewpoint holds from the others: nested calls and
//! holders are judged by leases, inherited descriptors and the
//! environment, never by a pid or a device number alone — so on btrfs
//! (whose lock table shows other device numbers than `stat`), in a child
//! pid namespace (whose lock table hides the holders outside it), and
//! with flock(1) holders, nothing waits for itself and nothing held is
//! shown free.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::*;

/// `exec --no-inherit --write X -- stowage exec --read X` fails at once
/// (the image is being written, by the enclosing command), and a nested
/// reader under a `--no-inherit` reader passes a writer queued behind it:
/// on btrfs as on tmpfs.
#[test]
fn nested_calls_under_no_inherit_never_wait_for_themselves_on_btrfs() {
    let Some(mnt) = Mount::btrfs_loop("300M") else {
        return;
    };
    nested_calls_never_wait_for_themselves(&mnt.env());
}

/// The same on overlayfs, a container's root filesystem, whose lock table
/// entries name other device numbers than `stat` shows.
#[test]
fn nested_calls_under_no_inherit_never_wait_for_themselves_on_overlayfs() {
    let Some(mnt) = Mount::overlay() else {
        return;
    };
    nested_calls_never_wait_for_themselves(&mnt.env());
}

fn nested_calls_never_wait_for_themselves(env: &Env) {
    env.make_image("x");
    let inner = format!(
        "'{}' --root '{}' exec --read x -- true",
        bin(),
        env.root.display()
    );
    let out = env.run([
        "exec",
        "--no-inherit",
        "--write",
        "x",
        "--",
        "sh",
        "-c",
        &format!("{inner}; echo inner=$?"),
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("inner=66"),
        "{}",
        show(&out)
    );

    // A writer queued behind the outer reader: the inner reader is part of
    // the outer hold, and must not queue behind the writer.
    let queued = env.sentinel("queued");
    let script = format!(
        "while [ ! -e '{q}' ]; do sleep 0.05; done; {inner}; echo inner=$?",
        q = queued.display()
    );
    let outer = env.spawn([
        "exec",
        "--no-inherit",
        "--read",
        "x",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    wait_until("the outer reader holds x", || {
        env.lock_entry("x").is_some_and(|e| e["state"] == "shared")
    });
    let writer = env.spawn(["exec", "--write", "x", "--", "true"]);
    env.wait_for_waiter("x");
    fs::write(&queued, "").unwrap();
    let out = outer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("inner=0"),
        "{}",
        show(&out)
    );
    assert_eq!(code(&writer.finish()), Some(0));
}

/// A flock(1) holder on btrfs is shown holding, by `lock-status IMG`,
/// `--all`, and `images` ("in use"), all alike.
#[test]
fn a_flock_holder_on_btrfs_is_shown_holding_everywhere() {
    let Some(mnt) = Mount::btrfs_loop("300M") else {
        return;
    };
    a_flock_holder_is_shown_holding_everywhere(&mnt.env());
}

/// The same on overlayfs.
#[test]
fn a_flock_holder_on_overlayfs_is_shown_holding_everywhere() {
    let Some(mnt) = Mount::overlay() else {
        return;
    };
    a_flock_holder_is_shown_holding_everywhere(&mnt.env());
}

fn a_flock_holder_is_shown_holding_everywhere(env: &Env) {
    env.make_image("x");
    let started = env.sentinel("started");
    let _holder = flock_holder(&env.lock_file("x"), &started, "sleep 60");
    wait_for_file(&started);
    assert_eq!(env.lock_entry("x").unwrap()["state"], "exclusive");
    let all = env.status_json(["--all"]);
    let x = all["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "x")
        .cloned()
        .unwrap();
    assert_eq!(x["state"], "exclusive", "{all}");
    assert_eq!(env.image("x").unwrap()["in_use"], true);
}

/// Nested `--read`, `--slot` and `--store-wide` calls made in a child pid
/// namespace (a container started by the build) never wait for the
/// enclosing command: its lease, named in the environment, says what it
/// holds, whatever pids the namespace shows.
#[test]
fn nested_calls_in_a_child_pid_namespace_never_wait_for_their_parent() {
    if !root_or_skip("a child pid namespace") {
        return;
    }
    let env = Env::new();
    env.make_image("x");
    env.ok(["slots", "set", "pull", "1"]);
    let root = env.root.display().to_string();
    for (outer, inner) in [
        (vec!["--read", "x"], "exec --read x -- true"),
        (vec!["--slot", "pull"], "exec --slot pull -- true"),
        (vec!["--store-wide"], "exec --read x -- true"),
        (vec!["--write", "x"], "exec --slot pull -- true"),
    ] {
        let script = format!(
            "unshare --pid --fork --mount-proc '{}' --root '{root}' {inner}; echo inner=$?",
            bin()
        );
        let mut args = vec!["exec"];
        args.extend(outer.iter().copied());
        args.extend(["--", "sh", "-c", &script]);
        let out = env.run(args);
        assert_eq!(code(&out), Some(0), "{outer:?}: {}", show(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("inner=0"),
            "{outer:?} / {inner}: {}",
            show(&out)
        );
    }
}

/// From a child pid namespace (a container), lock-status shows a
/// store-wide hold held with its holder, and a flock(1) holder's lock
/// held — never free.
#[test]
fn lock_status_in_a_child_pid_namespace_shows_what_is_held() {
    if !root_or_skip("a child pid namespace") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    let started = env.sentinel("flock-started");
    let flock = flock_holder(&env.lock_file("b"), &started, "sleep 60");
    wait_for_file(&started);
    let inside = |args: &[&str]| {
        let out = output({
            let mut c = Command::new("unshare");
            c.args(["--pid", "--fork", "--mount-proc", bin(), "--root"])
                .arg(&env.root)
                .args(["lock-status", "--json"])
                .args(args);
            c
        });
        assert_eq!(code(&out), Some(0), "{}", show(&out));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let st = inside(&["b"]);
    let b = st["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "b")
        .cloned();
    assert_eq!(
        b.unwrap()["state"],
        "exclusive",
        "flock(1)'s hold from inside: {st}"
    );
    flock.kill_all();
    let hold_started = env.sentinel("sw-started");
    let _hold = env.spawn([
        "exec",
        "--store-wide",
        "--",
        "sh",
        "-c",
        &format!("touch '{}'; sleep 60", hold_started.display()),
    ]);
    wait_for_file(&hold_started);
    let st = inside(&[]);
    let locks = st["locks"].as_array().unwrap();
    let store = locks
        .iter()
        .find(|l| l["kind"] == "global" && l["name"] != "global")
        .unwrap_or_else(|| panic!("the store lock is listed: {st}"));
    assert_eq!(store["state"], "exclusive", "{st}");
    assert_eq!(store["holders"].as_array().unwrap().len(), 1, "{st}");
}

/// `stowage --root COPY ARGS…`.
fn in_copy(copy: &Path, args: &[&str]) -> Output {
    let mut c = Command::new(bin());
    c.arg("--root").arg(copy).args(args);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    output(c)
}

/// `cp -a` of `env`'s root to a sibling directory `name`.
fn copy_of(env: &Env, name: &str) -> PathBuf {
    let copy = env.tmp.path().join(name);
    cp_a(&env.root, &copy);
    copy
}

/// A copy of a store whose images are in an external directory keeps
/// naming that directory, which the original claims: the copy may neither
/// read, write, create nor remove there (its locks are not the
/// original's), and says which store the directory serves.
#[test]
fn a_copy_of_a_store_never_uses_the_originals_images_directory() {
    use std::os::unix::ffi::OsStrExt;
    // The claim holds the original's path escaped: one long past any fixed buffer (each byte that
    // is not UTF-8 takes four), and one ending in a carriage return, are read back whole.
    let long = [0xffu8; 240];
    for name in [&b"root"[..], &long, b"root\r"] {
        let mut env = Env::new();
        let ext = env.tmp.path().join("ext-img");
        fs::create_dir(&ext).unwrap();
        env.root = env.tmp.path().join(std::ffi::OsStr::from_bytes(name));
        env.ok(["init", "--images-dir", ext.to_str().unwrap()]);
        env.make_image("old");
        let copy = copy_of(&env, "copy");
        let shown = env.root.to_string_lossy().replace('\r', "\\r");
        for args in [
            &["rm", "old"][..],
            &["exec", "--read", "old", "--", "true"],
            &["exec", "--write", "old", "--", "true"],
            &["exec", "--write", "new", "--", "true"],
        ] {
            let out = in_copy(&copy, args);
            assert_ne!(code(&out), Some(0), "{args:?}: {}", show(&out));
            let err = stderr(&out);
            assert!(
                err.contains(&shown) && err.lines().count() == 1,
                "{args:?}: {}",
                show(&out)
            );
        }
        assert!(ext.join("old").exists());
        assert!(!ext.join("new").exists());
        assert_eq!(env.state("old").as_deref(), Some("ready"));
        env.ok(["exec", "--read", "old", "--", "true"]);
    }
}

/// Two directories whose names differ only by a trailing carriage return
/// are two images directories: each store's configuration and records name
/// its own, and nothing of one store's lands in the other's.
#[test]
fn an_images_directory_ending_in_a_carriage_return_is_not_its_namesakes() {
    let (env, ext) = store_with_external_images();
    env.make_image("precious");
    let mut cr = ext.clone().into_os_string();
    cr.push("\r");
    let cr = PathBuf::from(cr);
    fs::create_dir(&cr).unwrap();
    let other = env.tmp.path().join("other");
    let init = ["init".as_ref(), "--images-dir".as_ref(), cr.as_os_str()];
    let out = in_copy(&other, &init.map(|a| a.to_str().unwrap()));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = in_copy(&other, &["exec", "--write", "x", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(cr.join("x").is_dir() && !ext.join("x").exists());
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.ok(["exec", "--read", "precious", "--", "true"]);
}

/// A copy of a store with its images in `ROOT/img` took its images along:
/// the claim that came with them is no other store's, and the copy is a
/// store like any other (gc, repair, init).
#[test]
fn a_copy_of_a_store_with_its_own_images_is_a_store_of_its_own() {
    let env = Env::new();
    env.make_image("old");
    let copy = copy_of(&env, "copy");
    for args in [
        &["gc"][..],
        &["doctor", "--repair"],
        &["init"],
        &["exec", "--write", "old", "--", "true"],
        &["rm", "old"],
    ] {
        let out = in_copy(&copy, args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    assert_eq!(env.state("old").as_deref(), Some("ready"));
}

/// A copy onto another filesystem can get the very inode number of the
/// original's root (the first directory of a fresh tmpfs): the whole
/// identity tells them apart, and a store-wide command in the copy gets
/// no images directory of the original's either.
#[test]
fn a_copy_onto_another_filesystem_is_told_apart_from_its_original() {
    let (Some(m1), Some(m2)) = (Mount::tmpfs("size=16m"), Mount::tmpfs("size=16m")) else {
        return;
    };
    let env = Env::new();
    let ext = env.tmp.path().join("ext-img");
    fs::create_dir(&ext).unwrap();
    let (root, copy) = (m1.dir.join("s"), m2.dir.join("s"));
    let run = |r: &Path, args: &[&str]| in_copy(r, args);
    let out = run(&root, &["init", "--images-dir", ext.to_str().unwrap()]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = run(&root, &["exec", "--write", "old", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    cp_a(&root, &copy);
    for args in [
        &["rm", "old"][..],
        &["exec", "--write", "old", "--", "true"],
        &["exec", "--store-wide", "--", "true"],
    ] {
        let out = run(&copy, args);
        assert_ne!(code(&out), Some(0), "{args:?}: {}", show(&out));
        assert!(
            stderr(&out).contains(&*root.to_string_lossy()),
            "{args:?}: {}",
            show(&out)
        );
    }
    assert!(ext.join("old").exists());
}

/// A root whose `img` another store claims as its external images
/// directory is no store of its own: one images directory, one store.
/// Nothing is made there, and the refusal names the other store.
#[test]
fn a_default_images_directory_another_store_claims_is_refused() {
    let env = Env::new();
    let other = env.tmp.path().join("other");
    fs::create_dir_all(other.join("img")).unwrap();
    env.ok(["init", "--images-dir", other.join("img").to_str().unwrap()]);
    env.make_image("base");
    for args in [&["exec", "--write", "mine", "--", "true"][..], &["init"]] {
        let out = in_copy(&other, args);
        assert_ne!(code(&out), Some(0), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&*env.root.to_string_lossy()) && err.lines().count() == 1,
            "{args:?}: {}",
            show(&out)
        );
        assert!(!other.join("store.conf").exists() && !other.join("locks").exists());
    }
    assert!(!other.join("img/mine").exists());
    assert!(other.join("img/base").exists());
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// Another store's `init --images-dir` on a root's own `img` is refused by
/// that root's layout, even with its configuration lost and its claim gone
/// (a store migrated by a release that claimed no default directory): else
/// the two stores shared the directory, and one's `rm` deleted the other's
/// ready image.
#[test]
fn a_roots_own_img_is_refused_to_another_store_by_its_layout() {
    let a = Env::new();
    a.make_image("base");
    fs::remove_file(a.root.join("store.conf")).unwrap();
    let img = a.root.join("img");
    let c = std::ffi::CString::new(img.to_str().unwrap()).unwrap();
    // SAFETY: NUL-terminated path and attribute name.
    let r = unsafe { libc::removexattr(c.as_ptr(), c"user.stowage.store".as_ptr()) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    let b = a.tmp.path().join("b");
    let out = in_copy(&b, &["init", "--images-dir", img.to_str().unwrap()]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains(&format!("belongs to the store at {}", a.root.display())),
        "{}",
        show(&out)
    );
    assert!(!b.join("store.conf").exists());
    assert!(img.join("base").is_dir());
}

/// A claim attribute that holds no claim this release reads (a later
/// release's, or damage) is neither overwritten nor taken for none: init
/// says what to do, in one line, and goes on once it is removed.
#[test]
fn an_unreadable_claim_is_named_and_left_alone() {
    let env = Env::new();
    env.ok(["init"]);
    let img = env.root.join("img");
    let c = std::ffi::CString::new(img.to_str().unwrap()).unwrap();
    let junk = b"stowage-claim 9\nwho=knows\n";
    // SAFETY: NUL-terminated path and name, a value of the length given.
    let r = unsafe {
        libc::setxattr(
            c.as_ptr(),
            c"user.stowage.store".as_ptr(),
            junk.as_ptr().cast(),
            junk.len(),
            0,
        )
    };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    fs::remove_file(env.root.join("store.conf")).unwrap();
    let out = env.run(["init"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", show(&out));
    assert!(stderr(&out).contains("setfattr -x"), "{}", show(&out));
    // SAFETY: NUL-terminated path and attribute name.
    let r = unsafe { libc::removexattr(c.as_ptr(), c"user.stowage.store".as_ptr()) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    env.ok(["init"]);
    env.make_image("a");
}

/// A claim whose root path holds a newline names that root whole, however
/// it was written (escaped, or raw by an older release): another store is
/// told to use that root, in a word that pastes back as its path, and
/// never that the store is gone.
#[test]
fn a_claim_names_a_root_with_a_newline_whole() {
    let mut env = Env::new();
    let ext = env.tmp.path().join("ext");
    fs::create_dir(&ext).unwrap();
    env.root = env.tmp.path().join("q\nx");
    env.ok(["init", "--images-dir", ext.to_str().unwrap()]);
    let c = std::ffi::CString::new(ext.to_str().unwrap()).unwrap();
    let escaped = claim_on(&ext);
    assert!(!escaped.is_empty());
    let raw = escaped.replace(r"q\nx", "q\nx");
    let word = format!("--root $'{}/q\\nx'", env.tmp.path().display());
    for claim in [&escaped, &raw] {
        // SAFETY: NUL-terminated path and name, a value of the length given.
        let r = unsafe {
            libc::setxattr(
                c.as_ptr(),
                c"user.stowage.store".as_ptr(),
                claim.as_ptr().cast(),
                claim.len(),
                0,
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        let other = env.tmp.path().join("other");
        let out = in_copy(&other, &["init", "--images-dir", ext.to_str().unwrap()]);
        assert_eq!(code(&out), Some(1), "{}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&word) && !err.contains("gone"),
            "{word}: {err}"
        );
        assert!(!other.join("store.conf").exists());
    }
    env.ok(["exec", "--write", "a", "--", "true"]);
}

/// A store moved away from its root (renamed on its filesystem: the root
/// is the same directory) keeps its external images directory.
#[test]
fn a_moved_store_keeps_its_images_directory() {
    let (env, ext) = store_with_external_images();
    env.make_image("old");
    let moved = env.tmp.path().join("moved");
    fs::rename(&env.root, &moved).unwrap();
    for args in [
        &["exec", "--read", "old", "--", "true"][..],
        &["exec", "--write", "old", "--", "true"],
        &["init", "--images-dir", ext.to_str().unwrap()],
        &["gc"],
        &["rm", "old"],
    ] {
        let out = in_copy(&moved, args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    assert!(!ext.join("old").exists());
    // Its repair has the directory's claim name where it is now: another store is told the truth.
    in_copy(&moved, &["doctor", "--repair"]);
    let other = env.tmp.path().join("other");
    let out = in_copy(&other, &["init", "--images-dir", ext.to_str().unwrap()]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = format!("belongs to the store at {}", moved.display());
    assert!(stderr(&out).contains(&said), "{}", show(&out));
}

/// A store moved on its filesystem while an image is written (the root is
/// the same directory, its images directory too) keeps the image: the end
/// of the write looks for the tree in the images directory it started in,
/// not at the path that led there, so a new image and a rewritten one both
/// end `ready`, with what their commands wrote, and nothing is amiss.
#[test]
fn a_store_moved_while_images_are_written_keeps_them_ready() {
    let env = Env::new();
    env.make_image("old");
    let (a, b) = (env.tmp.path().join("a"), env.tmp.path().join("b"));
    for (name, from, to) in [("new", &env.root, &a), ("old", &a, &b)] {
        let paused = env.sentinel(&format!("paused.{name}"));
        let mut c = Command::new(bin());
        c.arg("--root")
            .arg(from)
            .args(["exec", "--write", name, "--"]);
        c.args(["sh", "-c", "echo built > \"$STOWAGE_IMAGE_DIR/f\""]);
        c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
        let point = format!("write-finishing:{}", paused.display());
        c.env(stowage::env::DEBUG_PAUSE, point);
        let bg = Bg::from_command(c);
        wait_for_file(&paused);
        fs::rename(from, to).unwrap();
        fs::remove_file(&paused).unwrap();
        let out = bg.finish();
        assert_eq!(code(&out), Some(0), "{name}: {}", show(&out));
        assert_eq!(stderr(&out), "", "{name}: {}", show(&out));
        let read = ["exec", "--read", name, "--", "sh", "-c"];
        let out = in_copy(
            to,
            &[&read[..], &["cat \"$STOWAGE_IMAGES_DIR/$0/f\"", name]].concat(),
        );
        assert_eq!(code(&out), Some(0), "{name}: {}", show(&out));
        assert_eq!(stdout(&out), "built\n", "{name}: {}", show(&out));
    }
    let out = in_copy(&b, &["images", "--json"]);
    let images: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let states: Vec<(&str, &str)> = (images.as_array().unwrap().iter())
        .map(|i| (i["name"].as_str().unwrap(), i["state"].as_str().unwrap()))
        .collect();
    assert_eq!(
        states,
        [("new", "ready"), ("old", "ready")],
        "{}",
        show(&out)
    );
    let out = in_copy(&b, &["doctor"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// A copy of a store whose original is gone from its path cannot tell
/// whether the original was deleted or moved (and still uses the images
/// directory): it is refused, with how to free the directory, and works
/// once the claim is removed and its `init --images-dir` takes it.
#[test]
fn a_copy_whose_original_is_gone_is_refused_until_the_claim_is_freed() {
    let (env, ext) = store_with_external_images();
    env.make_image("old");
    let copy = copy_of(&env, "copy");
    fs::remove_dir_all(&env.root).unwrap();
    let out = in_copy(&copy, &["exec", "--read", "old", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(stderr(&out).contains("setfattr -x"), "{}", show(&out));
    let c = std::ffi::CString::new(ext.to_str().unwrap()).unwrap();
    // SAFETY: NUL-terminated path and attribute name.
    let r = unsafe { libc::removexattr(c.as_ptr(), c"user.stowage.store".as_ptr()) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    let out = in_copy(&copy, &["exec", "--read", "old", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(stderr(&out).contains("init --images-dir"), "{}", show(&out));
    for args in [
        &["init", "--images-dir", ext.to_str().unwrap()][..],
        &["exec", "--read", "old", "--", "true"],
        &["exec", "--write", "old", "--", "true"],
        &["gc"],
        &["rm", "old"],
    ] {
        let out = in_copy(&copy, args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    assert!(!ext.join("old").exists());
}

/// A copy of a store whose external images directory carries no claim (a
/// filesystem without extended attributes, a claim removed, a store never
/// claimed) is no less a copy: its root is not the one store.conf records.
/// It neither reads, writes nor removes there, and neither its repair nor
/// a plain init claims the directory, which would shut the original out;
/// only its `init --images-dir` naming the directory takes it.
#[test]
fn a_copy_never_uses_nor_claims_an_unclaimed_images_directory() {
    let (env, ext) = store_with_external_images();
    env.build("base", "echo v1 > \"$STOWAGE_IMAGE_DIR/f\"");
    env.make_image("app");
    let c = std::ffi::CString::new(ext.to_str().unwrap()).unwrap();
    // SAFETY: NUL-terminated path and attribute name.
    let r = unsafe { libc::removexattr(c.as_ptr(), c"user.stowage.store".as_ptr()) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    let copy = copy_of(&env, "copy");
    for args in [
        &["rm", "app"][..],
        &[
            "exec",
            "--write",
            "base",
            "--",
            "sh",
            "-c",
            "echo copy > \"$STOWAGE_IMAGE_DIR/f\"",
        ],
        &["exec", "--read", "base", "--", "true"],
        &["exec", "--write", "new", "--", "true"],
        &["gc"],
        &["doctor", "--repair"],
        &["init"],
    ] {
        let out = in_copy(&copy, args);
        assert_ne!(code(&out), Some(0), "{args:?}: {}", show(&out));
        assert!(
            stderr(&out).contains("init --images-dir") || args[0] == "doctor",
            "{args:?}: {}",
            show(&out)
        );
    }
    let out = in_copy(&copy, &["doctor", "--repair"]);
    let claimed = "as this store's images directory";
    assert!(!stdout(&out).contains(claimed), "{}", show(&out));
    assert!(ext.join("app").is_dir() && !ext.join("new").exists());
    assert_eq!(env.read_in_image("base", "f"), "v1\n");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    // The original is unchanged: it uses the directory, and its repair claims it.
    env.ok(["exec", "--write", "base", "--", "true"]);
    env.ok(["doctor", "--repair"]);
    assert!(claim_on(&ext).contains(&format!("path={}", env.root.display())));
}

/// A copy of a store, then the original moved away: the two must never
/// both use the one images directory. The moved original keeps it; the
/// copy, which cannot tell a moved original from a deleted one, neither
/// writes nor removes there while the original reads.
#[test]
fn a_copy_and_its_moved_original_never_share_an_images_directory() {
    let (env, ext) = store_with_external_images();
    env.make_image("base");
    let copy = copy_of(&env, "copy");
    let moved = env.tmp.path().join("moved");
    fs::rename(&env.root, &moved).unwrap();
    let out = in_copy(&moved, &["exec", "--read", "base", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    for args in [
        &["exec", "--no-wait", "--write", "base", "--", "true"][..],
        &["exec", "--write", "new", "--", "true"],
        &["rm", "base"],
        &["gc"],
    ] {
        let out = in_copy(&copy, args);
        assert_ne!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    assert!(ext.join("base/file").exists());
    assert!(!ext.join("new").exists());
    let out = in_copy(&moved, &["exec", "--read", "base", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// Another store's claim binds while there is no evidence against it: a
/// root this user cannot reach (a private home), or one whose parent was
/// renamed (its recorded path gone), still owns its images directory.
#[test]
fn a_claim_whose_root_cannot_be_seen_still_binds() {
    use std::os::unix::fs::PermissionsExt;
    let Some(_) = as_nobody() else { return };
    let env = Env::new();
    let shared = tempfile::tempdir().unwrap();
    fs::set_permissions(shared.path(), fs::Permissions::from_mode(0o1777)).unwrap();
    let ext = shared.path().join("D");
    fs::create_dir(&ext).unwrap();
    fs::set_permissions(&ext, fs::Permissions::from_mode(0o777)).unwrap();
    // The owner's root is private: nobody cannot look at it.
    let parent = env.tmp.path().join("p1");
    fs::create_dir(&parent).unwrap();
    let root = parent.join("A");
    let out = in_copy(&root, &["init", "--images-dir", ext.to_str().unwrap()]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = in_copy(&root, &["exec", "--write", "base", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let other = shared.path().join("B");
    let mut c = as_nobody().unwrap();
    c.arg(bin())
        .arg("--root")
        .arg(&other)
        .args(["init", "--images-dir", ext.to_str().unwrap()])
        .env("USER", "nobody")
        .env_remove("STOWAGE_ROOT");
    let out = output(c);
    assert_ne!(code(&out), Some(0), "unreachable root: {}", show(&out));
    // Its parent renamed: the claim's path is gone, the store is not.
    let moved = env.tmp.path().join("p2");
    fs::rename(&parent, &moved).unwrap();
    let third = env.tmp.path().join("C");
    let out = in_copy(&third, &["init", "--images-dir", ext.to_str().unwrap()]);
    assert_ne!(code(&out), Some(0), "renamed parent: {}", show(&out));
    let out = in_copy(&moved.join("A"), &["gc"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(ext.join("base").exists());
}

/// A copy's `img` is not the original's images directory, whatever claim
/// came along with it: the copy is a store even when its store.conf is
/// gone.
#[test]
fn a_copys_own_img_is_its_own_without_its_configuration() {
    let env = Env::new();
    env.make_image("base");
    let copy = copy_of(&env, "copy");
    fs::remove_file(copy.join("store.conf")).unwrap();
    for args in [&["init"][..], &["doctor", "--repair"], &["gc"]] {
        let out = in_copy(&copy, args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// A root moved away and a new directory made at its old path, or a
/// claiming store whose images directory is unmounted: neither is
/// evidence that the claim is gone, and a second store is refused.
#[test]
fn a_new_root_at_a_moved_stores_old_path_takes_nothing_over() {
    let (env, ext) = store_with_external_images();
    env.make_image("app");
    let moved = env.tmp.path().join("moved");
    fs::rename(&env.root, &moved).unwrap();
    fs::create_dir(&env.root).unwrap();
    let out = env.run(["init", "--images-dir", ext.to_str().unwrap()]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(stderr(&out).contains("setfattr -x"), "{}", show(&out));
    let out = in_copy(&moved, &["gc"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(ext.join("app").exists());
}

/// The claiming store's images directory unmounted: another store is
/// still refused it (the claim is judged by the identity the claiming
/// store recorded, not by what is mounted now).
#[test]
fn a_claim_binds_while_its_images_directory_is_unmounted() {
    if !root_or_skip("bind mounts") {
        return;
    }
    let env = Env::new();
    let data = env.tmp.path().join("data");
    let x = env.tmp.path().join("x");
    fs::create_dir(&data).unwrap();
    fs::create_dir(&x).unwrap();
    let Some(m) = Mount::at(&["--bind", data.to_str().unwrap()], &x) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    env.ok(["init", "--images-dir", x.to_str().unwrap()]);
    env.make_image("app");
    drop(m);
    let other = env.tmp.path().join("other");
    let out = in_copy(&other, &["init", "--images-dir", data.to_str().unwrap()]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(data.join("app").exists());
}

/// A store whose images directory is an external one, `ext-img` beside
/// its root.
fn store_with_external_images() -> (Env, PathBuf) {
    let env = Env::new();
    let ext = env.tmp.path().join("ext-img");
    fs::create_dir(&ext).unwrap();
    env.ok(["init", "--images-dir", ext.to_str().unwrap()]);
    (env, ext)
}

/// Where `/proc/self` cannot be resolved (a mount namespace entered
/// without its pid namespace, as some containers are), a copy of a store
/// is still refused the original's images directory, and the original
/// still makes new images there: the claim is read on the directory's
/// descriptor without `/proc`, and one that cannot be read refuses.
#[test]
fn without_proc_a_copy_still_never_uses_the_originals_images_directory() {
    if !root_or_skip("unmounting /proc in a mount namespace")
        || !tool_or_skip("unshare", "util-linux")
    {
        return;
    }
    let (env, ext) = store_with_external_images();
    env.make_image("old");
    let copy = copy_of(&env, "copy");
    let without_proc = |root: &Path, args: &[&str]| {
        let mut c = Command::new("unshare");
        c.args(["--mount", "--propagation", "private", "sh", "-c"]);
        c.arg("umount -l /proc && exec \"$0\" \"$@\"").arg(bin());
        c.arg("--root").arg(root).args(args);
        c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
        output(c)
    };
    for args in [
        &["exec", "--write", "new", "--", "true"][..],
        &["rm", "old"],
    ] {
        let out = without_proc(&copy, args);
        assert_ne!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    assert!(!ext.join("new").exists());
    assert!(ext.join("old").is_dir());
    let out = without_proc(&env.root, &["exec", "--write", "mine", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(ext.join("mine").is_dir());
    assert_eq!(env.state("mine").as_deref(), Some("ready"));
}

/// `sh -c SCRIPT` in a mount namespace of its own (a container's view of
/// the machine), with `$0` the stowage binary; `None`, saying why, where
/// this test cannot make one.
fn in_mount_namespace(script: &str) -> Option<Output> {
    if !root_or_skip("a mount namespace") || !tool_or_skip("unshare", "util-linux") {
        return None;
    }
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "private", "sh", "-c", script]);
    c.arg(bin())
        .env_remove("STOWAGE_ROOT")
        .env_remove("STOWAGE_NOW");
    Some(output(c))
}

/// A container that sees the store through a bind mount, and another
/// directory at the external images directory's path (its own tmpfs,
/// holding a tree named as an image): reads, rewrites, removes, creates
/// nothing there, and its `init` does not make that directory the store's,
/// so the host goes on using its own, image and all.
#[test]
fn a_container_with_another_directory_at_the_images_path_never_uses_it() {
    let env = Env::new();
    let Some(m) = env.init_on_tmpfs() else {
        return;
    };
    env.make_image("app");
    let (images, inside) = (m.dir.clone(), env.tmp.path().join("inside"));
    fs::create_dir(&inside).unwrap();
    let (i, r, v) = (images.display(), env.root.display(), inside.display());
    let script = format!(
        "mount --bind '{r}' '{v}' && mount -t tmpfs tmpfs '{i}' && mkdir '{i}/app' && echo theirs > '{i}/app/data' || exit 99
         s() {{ \"$0\" --root '{v}' \"$@\" 2>&1; echo \"rc=$?\"; }}
         s exec --read app -- cat '{i}/app/data'
         s exec --write app -- sh -c 'echo mine > \"$STOWAGE_IMAGE_DIR/data\"'
         s exec --write copy --from app -- true
         s rm app
         s init
         echo; cat '{i}/app/data'; ls '{i}'"
    );
    let Some(out) = in_mount_namespace(&script) else {
        return;
    };
    let said = stdout(&out);
    let (runs, after) = said
        .split_once("\n\n")
        .unwrap_or_else(|| panic!("{}", show(&out)));
    assert_eq!(runs.matches("rc=1").count(), 5, "{}", show(&out));
    assert_eq!(
        runs.matches("not the directory recorded").count(),
        5,
        "{}",
        show(&out)
    );
    assert_eq!(after, "theirs\napp\n", "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.state("copy"), None);
    assert_eq!(env.read_in_image("app", "file"), "content\n");
    env.ok(["exec", "--write", "new", "--", "true"]);
}

/// Through a read-only bind mount of the store (a container's `-v
/// STORE:/s:ro`), a write under way is shown under way: the lock files
/// that cannot be opened for writing there are asked read-only, and their
/// holders still seen.
#[test]
fn a_read_only_view_of_the_store_sees_a_write_under_way() {
    if !root_or_skip("a bind mount") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let ro = env.tmp.path().join("ro");
    fs::create_dir(&ro).unwrap();
    let Some(_m) = Mount::at(&["--bind", "-o", "ro", env.root.to_str().unwrap()], &ro) else {
        eprintln!("skipping: cannot make a read-only bind mount here");
        return;
    };
    let writers = [
        env.hold_until(&["--write", "app"], "app-started", "release"),
        env.hold_until(&["--write", "base"], "base-started", "release"),
    ];
    let view = |args: &[&str]| {
        let mut c = Command::new(bin());
        c.arg("--root")
            .arg(&ro)
            .args(args)
            .env_remove("STOWAGE_ROOT");
        output(c)
    };
    let listed: serde_json::Value =
        serde_json::from_slice(&view(&["images", "--json"]).stdout).expect("images --json");
    let state = |n: &str| {
        let found = listed.as_array().unwrap().iter().find(|i| i["name"] == n);
        found.map(|i| i["state"].as_str().unwrap().to_owned())
    };
    assert_eq!(state("app").as_deref(), Some("creating"), "{listed}");
    assert_eq!(state("base").as_deref(), Some("writing"), "{listed}");
    let out = view(&["lock-status", "app", "base"]);
    let said = stdout(&out);
    assert!(said.contains("exclusive (creating)"), "{}", show(&out));
    assert!(said.contains("exclusive (writing)"), "{}", show(&out));
    env.release("release");
    for w in writers {
        assert_eq!(code(&w.finish()), Some(0));
    }
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// The user.stowage.store claim on `dir`, as text.
fn claim_on(dir: &Path) -> String {
    let c = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    let mut buf = vec![0u8; 4096];
    // SAFETY: NUL-terminated path and name, a buffer of the length given.
    let n = unsafe {
        libc::getxattr(
            c.as_ptr(),
            c"user.stowage.store".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    assert!(n >= 0, "{}", std::io::Error::last_os_error());
    String::from_utf8_lossy(&buf[..n as usize]).into_owned()
}

/// The root seen at a second path (a bind mount) is the same root: its
/// claim on the external images directory is healthy from there too, so
/// neither `doctor --repair` nor `init` there rewrites it to name the
/// second path (views would each put it back to theirs, in turn).
#[test]
fn a_second_view_of_the_root_leaves_its_claim_as_it_is() {
    if !root_or_skip("a bind mount") {
        return;
    }
    let (env, ext) = store_with_external_images();
    let alt = env.tmp.path().join("alt");
    fs::create_dir(&alt).unwrap();
    let Some(_m) = Mount::at(&["--bind", env.root.to_str().unwrap()], &alt) else {
        eprintln!("skipping: cannot make a bind mount here");
        return;
    };
    let claim = claim_on(&ext);
    assert!(claim.contains(env.root.to_str().unwrap()), "{claim}");
    for args in [&["doctor", "--repair"][..], &["init"]] {
        let out = in_copy(&alt, args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
        assert!(!stdout(&out).contains("marked"), "{args:?}: {}", show(&out));
        assert_eq!(claim_on(&ext), claim, "{args:?}: {}", show(&out));
    }
    let out = env.ok(["doctor", "--repair"]);
    assert!(!stdout(&out).contains("repaired"), "{}", show(&out));
}

/// A container with its own filesystem over `ROOT/img`, holding an empty
/// tree under an image's name, lists the store before anyone measured the
/// image: no size is kept from what it sees, so the host's budget still
/// counts the image's real size (before: 0 B kept, and `gc --max-size`
/// freed nothing).
#[test]
fn a_size_seen_through_another_directory_at_the_images_path_is_not_kept() {
    let env = Env::new();
    env.ok([
        "exec",
        "--write",
        "big",
        "--",
        "sh",
        "-c",
        "head -c 3000000 /dev/urandom > \"$STOWAGE_IMAGE_DIR/f\"",
    ]);
    let (img, r) = (env.root.join("img"), env.root.display());
    let i = img.display();
    let script = format!(
        "mount -t tmpfs tmpfs '{i}' && mkdir '{i}/big' || exit 99
         \"$0\" --root '{r}' images --json"
    );
    let Some(out) = in_mount_namespace(&script) else {
        return;
    };
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let size = env.image("big").unwrap()["size_bytes"].as_u64();
    assert!(size >= Some(3_000_000), "{size:?}");
    let out = env.ok(["gc", "--max-size", "1M", "--dry-run"]);
    assert!(
        stdout(&out).contains("would remove 'big'"),
        "{}",
        show(&out)
    );
}

/// An images directory moved away (or unmounted, its mount point gone) is
/// not made anew by any command: plain doctor, doctor --repair, a new
/// image's write, init, rm and gc each refuse, and putting the directory
/// back finds the store as it was. Before, each made an empty `img` first,
/// which then stood in the way of the real one (`mv` put it inside).
#[test]
fn a_missing_images_directory_is_not_made_anew() {
    let env = Env::new();
    env.make_image("app");
    let (img, away) = (env.root.join("img"), env.root.join("img.away"));
    fs::rename(&img, &away).unwrap();
    for args in [
        &["doctor"][..],
        &["doctor", "--repair"],
        &["exec", "--write", "new", "--", "true"],
        &["init"],
        &["rm", "app"],
        &["gc", "--max-size", "0"],
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        assert!(!img.exists(), "{args:?} made {}", img.display());
    }
    fs::rename(&away, &img).unwrap();
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert!(env.image("new").is_none());
    env.ok(["exec", "--write", "new", "--", "true"]);
    env.ok(["rm", "app"]);
}

/// A copy of a store (`cp -a`) with the original's images directory mounted
/// on its `img` (the original still at its path, claiming it) removes,
/// empties and rewrites nothing there: rm, gc and a rebuild `--from` are
/// refused, naming the original; so is a write of an image another
/// directory mounted on `img` already holds. Before, the copy took the
/// original's directory for its own (a copied root passed as moved), and a
/// write of an existing image never asked whose directory it was in. A plain
/// `init` in the copy is refused too: it took the original's claim over
/// (as one that came along with the copy), after which all of the above
/// went ahead.
#[test]
fn a_copy_of_a_store_touches_nothing_of_the_originals_images_mounted_on_it() {
    if !root_or_skip("a bind mount") {
        return;
    }
    let env = Env::new();
    for name in ["x", "ok"] {
        env.make_image(name);
    }
    fs::write(env.root.join("img/x/f"), "data").unwrap();
    let copy = env.tmp.path().join("copy");
    cp_a(&env.root, &copy);
    let img = copy.join("img");
    let Some(mount) = Mount::at(&["--bind", env.root.join("img").to_str().unwrap()], &img) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    let run = |args: &[&str]| {
        let mut c = Command::new(bin());
        c.arg("--root").arg(&copy).args(args);
        output(c)
    };
    let runs = [
        run(&["init"]),
        run(&["rm", "x"]),
        run(&["gc", "--max-size", "0"]),
        run(&["exec", "--write", "x", "--from", "ok", "--", "true"]),
        run(&[
            "exec",
            "--write",
            "x",
            "--",
            "sh",
            "-c",
            "echo new > \"$STOWAGE_IMAGE_DIR/g\"",
        ]),
    ];
    drop(mount);
    for out in &runs {
        assert_ne!(code(out), Some(0), "{}", show(out));
        let said = format!("{}{}", stdout(out), stderr(out));
        assert!(said.contains("belongs to the store at"), "{}", show(out));
    }
    assert_eq!(
        fs::read_to_string(env.root.join("img/x/f")).unwrap(),
        "data"
    );
    assert!(!env.root.join("img/x/g").exists());
    for name in ["x", "ok"] {
        assert_eq!(env.state(name).as_deref(), Some("ready"), "{name}");
    }
    // The copy's own images directory, back in place, is its own.
    let out = run(&["exec", "--write", "x", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// A copy's first command records its own `img` as its images directory: the
/// directory it judged, not one opened again by name. The original's `img`
/// mounted on the copy's in between was recorded instead, and from then on
/// the copy removed the original's trees through it.
#[test]
fn a_copy_records_the_images_directory_it_judged_as_its_own() {
    if !root_or_skip("a bind mount") {
        return;
    }
    let env = Env::new();
    env.make_image("x");
    fs::write(env.root.join("img/x/f"), "data").unwrap();
    let copy = env.tmp.path().join("copy");
    cp_a(&env.root, &copy);
    let img = copy.join("img");
    let mut c = Command::new(bin());
    c.arg("--root").arg(&copy).args(["images"]);
    let go = env.scratch.join("paused.img-recording");
    c.env(
        stowage::env::DEBUG_PAUSE,
        format!("img-recording:{}", go.display()),
    );
    let bg = Bg::from_command(c);
    wait_for_file(&go);
    let original = env.root.join("img");
    let mount = Mount::at(&["--bind", original.to_str().unwrap()], &img);
    fs::remove_file(&go).unwrap();
    let out = bg.finish();
    drop(mount);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let Some(_m) = Mount::at(&["--bind", original.to_str().unwrap()], &img) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    let mut c = Command::new(bin());
    c.arg("--root").arg(&copy).args(["rm", "x"]);
    let out = output(c);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(fs::read_to_string(original.join("x/f")).unwrap(), "data");
    assert_eq!(env.state("x").as_deref(), Some("ready"));
}
