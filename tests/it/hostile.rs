//! A hostile or broken environment: planted symlinks, roots others
//! control, read-only and full filesystems, locks held by stuck programs,
//! stores shared by a group. Each gets a clear error and the documented exit
//! code, and nothing is written or deleted through a planted link.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;

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
    env.ok(["doctor"]);
    assert_eq!(env.state("b"), None);
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
    env.ok(["init"]);
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    let target = env.tmp.path().join("not-a-db");
    symlink(&target, env.root.join("stowage.db")).unwrap();
    let out = env.run(["images"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("symlink"), "{}", stderr(&out));
    assert!(!target.exists(), "nothing created through the link");
}

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

#[test]
fn a_database_locked_by_an_outside_program_gives_75() {
    let env = Env::new();
    env.make_image("a");
    let script = format!(
        "import sqlite3, time, pathlib\n\
         c = sqlite3.connect('{db}', isolation_level=None)\n\
         c.execute('BEGIN EXCLUSIVE')\n\
         pathlib.Path('{started}').touch()\n\
         time.sleep(30)\n",
        db = env.root.join("stowage.db").display(),
        started = env.sentinel("started").display()
    );
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipping: python3 is not available");
        return;
    }
    let mut c = Command::new("python3");
    c.args(["-c", &script]);
    let holder = Bg::from_command(c);
    wait_for_file(&env.sentinel("started"));
    let mut c = env.cmd(["images"]);
    c.env("STOWAGE_DEBUG_DB_BUSY_MS", "300");
    let out = output(c);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(stderr(&out).contains("outside stowage"), "{}", stderr(&out));
    holder.kill_all();
    env.ok(["images"]);
}

#[test]
fn a_stuck_global_lock_holder_bounds_a_bounded_exec() {
    let env = Env::new();
    env.make_image("a");
    let started = env.sentinel("started");
    let stuck = flock_holder(&env.root.join("locks/global.lock"), &started, "sleep 60");
    let t0 = Instant::now();
    let out = env.run(["exec", "--read", "a", "--wait", "0.3", "--", "true"]);
    let took = t0.elapsed();
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("waiting for the global metadata lock"),
        "says it waits: {err}"
    );
    assert!(err.contains("flock"), "names the holder: {err}");
    assert!(took >= Duration::from_secs(2), "waited only {took:?}");
    stuck.kill_all();
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
    for p in [env.lock_file("base"), env.root.join("stowage.db")] {
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

#[test]
fn a_database_switched_to_wal_by_an_outside_program_is_switched_back() {
    // WAL needs shared memory that NFS cannot share: never keep it.
    let env = Env::new();
    env.make_image("a");
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
    env.ok(["exec", "--read", "a", "--", "true"]);
    let header = fs::read(&db).unwrap();
    assert_eq!(
        (header[18], header[19]),
        (1, 1),
        "back to a rollback journal"
    );
    assert!(!env.root.join("stowage.db-wal").exists());
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}
