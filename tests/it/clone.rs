//! `exec --write IMAGE --from BASE`: the copy of a base a writer starts
//! from — faithful (modes, owners, links, holes, attributes, trees deeper than
//! PATH_MAX), shared extents where the filesystem can, the base locked only
//! for the copy, and a copy killed, stopped or followed by a command that
//! cannot start is never ready.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
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

fn sh(script: &str) -> std::process::Output {
    let out = Command::new("sh").args(["-c", script]).output().unwrap();
    assert!(out.status.success(), "{script}: {}", show(&out));
    out
}

#[test]
fn a_clone_on_tmpfs_keeps_holes() {
    let Some(t) = Mount::tmpfs("size=64m,mode=0755") else {
        return;
    };
    let env = t.env();
    env.build(
        "base",
        "cd \"$STOWAGE_IMAGE_DIR\" && truncate -s 3G sparse && \
         dd if=/dev/urandom of=sparse bs=1M count=1 seek=1024 conv=notrunc status=none",
    );
    let out = env.run(["exec", "--write", "copy", "--from", "base", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let a = fs::metadata(env.root.join("img/base/sparse")).unwrap();
    let b = fs::metadata(env.root.join("img/copy/sparse")).unwrap();
    assert_eq!(b.len(), 3 << 30);
    assert!(
        b.blocks() * 512 <= 2 << 20,
        "the copy of a 3 GiB file with 1 MiB of data allocates {} bytes",
        b.blocks() * 512
    );
    assert_eq!(a.blocks(), b.blocks());
    let same = sh(&format!(
        "cmp '{}' '{}' && echo same",
        env.root.join("img/base/sparse").display(),
        env.root.join("img/copy/sparse").display()
    ));
    assert!(String::from_utf8_lossy(&same.stdout).contains("same"));
    let img = env.image("copy").unwrap();
    assert!(img["size_bytes"].as_u64().unwrap() < 4 << 20, "{img}");
}

#[test]
fn a_clone_keeps_capabilities_acls_and_user_attributes() {
    for tool in [
        "setfattr", "getfattr", "setcap", "getcap", "setfacl", "getfacl",
    ] {
        if !have(tool) {
            eprintln!("skipping: {tool} not found");
            return;
        }
    }
    let env = Env::new();
    env.make_image("base");
    let dir = env.root.join("img/base");
    fs::write(dir.join("ping"), b"#!/bin/sh\n").unwrap();
    fs::create_dir(dir.join("shared")).unwrap();
    let d = dir.display();
    let tried = Command::new("sh")
        .args([
            "-c",
            &format!(
                "setfattr -n user.origin -v base '{d}/file' && \
                 setfattr -n user.dir -v yes '{d}/shared' && \
                 setcap cap_net_raw+ep '{d}/ping' && \
                 setfacl -m u:nobody:r '{d}/file' && \
                 setfacl -d -m g:nogroup:rx '{d}/shared'"
            ),
        ])
        .output()
        .unwrap();
    if !tried.status.success() {
        eprintln!(
            "skipping: this filesystem does not take these attributes: {}",
            stderr(&tried)
        );
        return;
    }
    let out = env.ok(["exec", "--write", "copy", "--from", "base", "--", "true"]);
    assert!(
        !stderr(&out).contains("not kept"),
        "everything can be kept here: {}",
        stderr(&out)
    );
    let c = env.root.join("img/copy");
    let c = c.display();
    let got = |script: String| String::from_utf8_lossy(&sh(&script).stdout).into_owned();
    assert!(
        got(format!("getfattr --only-values -n user.origin '{c}/file'")).contains("base"),
        "user.* attribute lost"
    );
    assert!(got(format!("getfattr --only-values -n user.dir '{c}/shared'")).contains("yes"));
    assert!(
        got(format!("getcap '{c}/ping'")).contains("cap_net_raw"),
        "file capability lost"
    );
    assert!(
        got(format!("getfacl -p '{c}/file'")).contains("user:nobody:r--"),
        "access ACL lost"
    );
    assert!(
        got(format!("getfacl -p '{c}/shared'")).contains("default:group:nogroup:r-x"),
        "default ACL lost"
    );
    // Modes are what the base has (an ACL did not widen them).
    for f in ["file", "ping", "shared"] {
        assert_eq!(
            fs::metadata(env.root.join("img/base").join(f))
                .unwrap()
                .mode(),
            fs::metadata(env.root.join("img/copy").join(f))
                .unwrap()
                .mode(),
            "{f}"
        );
    }
}

#[test]
fn a_clone_says_which_attributes_the_target_refused() {
    if !is_root() || !have("setpriv") || !have("setcap") {
        eprintln!("skipping: needs root, setpriv and setcap (to clone as another user)");
        return;
    }
    let env = Env::new();
    // The store belongs to nobody, who cannot give a file capabilities.
    fs::set_permissions(env.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    fs::create_dir(&env.root).unwrap();
    std::os::unix::fs::chown(&env.root, Some(65534), Some(65534)).unwrap();
    let as_nobody = |args: &[&str]| {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
            .arg(bin())
            .arg("--root")
            .arg(&env.root)
            .args(args)
            .env_remove("STOWAGE_ROOT")
            .env("USER", "nobody");
        output(c)
    };
    let out = as_nobody(&[
        "exec",
        "--write",
        "base",
        "--",
        "sh",
        "-c",
        "echo x > \"$STOWAGE_IMAGE_DIR/ping\"",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let ping = env.root.join("img/base/ping");
    let set = Command::new("setcap")
        .arg("cap_net_raw+ep")
        .arg(&ping)
        .output()
        .unwrap();
    if !set.status.success() {
        eprintln!("skipping: setcap refused here: {}", stderr(&set));
        return;
    }
    let out = as_nobody(&[
        "-v", "exec", "--write", "copy", "--from", "base", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let err = stderr(&out);
    let line: Vec<&str> = err.lines().filter(|l| l.contains("not kept")).collect();
    assert!(
        line.iter().any(|l| l.contains("security.capability")
            && l.contains("image 'copy'")
            && l.contains("Operation not permitted")),
        "{err}"
    );
    assert!(
        line.iter().any(|l| l.contains("copy/ping")),
        "-v names the file: {err}"
    );
    assert_eq!(
        fs::read(env.root.join("img/copy/ping")).unwrap(),
        b"x\n",
        "the file itself is copied"
    );
}

/// Makes `depth` nested directories of 200-byte names under `top` (deeper
/// than PATH_MAX) with a file of 64 KiB at the bottom, by descriptor.
fn deep_tree(top: &Path, depth: usize) {
    use std::ffi::CString;
    let name = CString::new("d".repeat(200)).unwrap();
    let top = CString::new(top.as_os_str().as_encoded_bytes()).unwrap();
    unsafe {
        let mut fd = libc::open(top.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY);
        assert!(fd >= 0);
        for _ in 0..depth {
            assert_eq!(libc::mkdirat(fd, name.as_ptr(), 0o755), 0);
            let next = libc::openat(fd, name.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY);
            assert!(next >= 0);
            libc::close(fd);
            fd = next;
        }
        let f = libc::openat(
            fd,
            c"bottom".as_ptr(),
            libc::O_WRONLY | libc::O_CREAT,
            0o644,
        );
        assert!(f >= 0);
        let data = vec![7u8; 65536];
        assert_eq!(libc::write(f, data.as_ptr().cast(), data.len()), 65536);
        libc::close(f);
        libc::close(fd);
    }
}

#[test]
fn trees_deeper_than_path_max_are_cloned_and_measured() {
    let env = Env::new();
    env.make_image("base");
    deep_tree(&env.root.join("img/base"), 30);
    // Its size is measured when first asked for.
    let img = env.image("base").unwrap();
    assert!(
        img["size_bytes"].as_u64().is_some_and(|s| s >= 65536),
        "{img}"
    );
    let out = env.run(["exec", "--write", "copy", "--from", "base", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let found = sh(&format!(
        "find '{}' -name bottom -size 64k | wc -l",
        env.root.join("img/copy").display()
    ));
    assert_eq!(String::from_utf8_lossy(&found.stdout).trim(), "1");
    let img = env.image("copy").unwrap();
    assert!(
        img["size_bytes"].as_u64().is_some_and(|s| s >= 65536),
        "{img}"
    );
    // gc's budget counts it: with room for one image, one goes.
    let out = env.ok(["gc", "--max-size", "100K", "--dry-run", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        report["size_before"].as_u64().unwrap() >= 2 * 65536,
        "{report}"
    );
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
fn rewriting_without_from_forgets_the_base() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--write", "app", "--from", "base", "--", "true"]);
    assert_eq!(env.image("app").unwrap()["base"], "base");
    env.ok(["exec", "--write", "app", "--", "true"]);
    assert!(env.image("app").unwrap()["base"].is_null());
    // A rewrite that reads one image records it as the base again.
    env.ok(["exec", "--write", "app", "--from", "base", "--", "true"]);
    assert_eq!(env.image("app").unwrap()["base"], "base");
}

#[test]
fn from_releases_the_base_once_copied_unless_also_read() {
    let env = Env::new();
    env.make_image("base");
    let hold = |extra: &[&str], started: &str| {
        let mut locks = vec!["--write", "app", "--from", "base"];
        locks.extend(extra);
        env.hold(&locks, started)
    };
    let bg = hold(&[], "started1");
    // The command runs: the base is free for a writer (a pull, an rm).
    let out = env.run(["exec", "--write", "base", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let entry = env.lock_entry("base");
    assert!(
        entry
            .as_ref()
            .is_none_or(|e| e["holders"].as_array().unwrap().is_empty()),
        "no holder is recorded for the released base: {entry:?}"
    );
    env.release("release");
    assert_eq!(bg.finish().status.code(), Some(0));
    assert_eq!(env.image("app").unwrap()["base"], "base");

    // With --read BASE as well, it stays read-locked while the command runs.
    fs::remove_file(env.sentinel("release")).unwrap();
    let bg = hold(&["--read", "base"], "started2");
    let out = env.run(["exec", "--write", "base", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    env.release("release");
    assert_eq!(bg.finish().status.code(), Some(0));
}

// --- a copy cut short -------------------------------------------------------

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
fn sigterm_stops_a_from_copy_promptly() {
    let env = Env::new();
    // A base of many small files: its copy takes far longer than a signal
    // needs to be seen.
    let files = 4000;
    let script = format!(
        "cd \"$STOWAGE_IMAGE_DIR\" && for d in $(seq 1 40); do mkdir d$d; for f in $(seq 1 {}); do echo $d$f > d$d/f$f; done; done",
        files / 40
    );
    env.build("base", &script);
    let (bg, pause) = env.paused(
        ["exec", "--write", "copy", "--from", "base", "--", "true"],
        "clone-copying",
    );
    bg.signal(libc::SIGTERM);
    fs::remove_file(&pause).unwrap();
    let t0 = std::time::Instant::now();
    let out = bg.finish();
    let took = t0.elapsed();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    let copied = walkdir_files(&env.root.join("img/copy")).len();
    eprintln!("stopped after copying {copied} of {files} files, {took:?} after SIGTERM");
    assert!(
        copied < files / 2,
        "the copy ran on after SIGTERM: {copied} of {files} files"
    );
    assert_eq!(env.state("copy").as_deref(), Some("incomplete"));
    assert!(flock_free(&env.lock_file("copy")));
    assert!(flock_free(&env.lock_file("base")));
}

/// A `--from` refused before its copy began (the base's tree missing), or
/// stopped by a signal then, changed nothing: the start is undone as any
/// other, an image rewritten keeps its state, tree and base, a new one
/// leaves nothing. Before, each was `incomplete` for gc to delete.
#[test]
fn a_copy_refused_or_stopped_before_it_began_changes_nothing() {
    let env = Env::new();
    env.build("base", "echo BASE > \"$STOWAGE_IMAGE_DIR/content\"");
    env.build("app", "echo APP > \"$STOWAGE_IMAGE_DIR/content\"");
    let content = env.root.join("img/app/content");
    let unchanged = |how: &str| {
        assert_eq!(env.state("app").as_deref(), Some("ready"), "{how}");
        assert_eq!(
            env.image("app").unwrap()["base"],
            serde_json::Value::Null,
            "{how}"
        );
        assert_eq!(fs::read_to_string(&content).unwrap(), "APP\n", "{how}");
        assert_eq!(env.state("new"), None, "{how}");
        assert!(!env.root.join("img/new").exists(), "{how}");
        assert!(!env.lock_file("new").exists(), "{how}");
    };
    for (sig, code) in [(libc::SIGTERM, 143), (libc::SIGINT, 130)] {
        for image in ["app", "new"] {
            let args = ["exec", "--write", image, "--from", "base", "--", "true"];
            let (bg, pause) = env.paused(args, "exec-started");
            bg.signal(sig);
            fs::remove_file(&pause).unwrap();
            let out = bg.finish();
            assert_eq!(out.status.code(), Some(code), "{image}: {}", show(&out));
            unchanged(&format!("{image} after signal {sig}"));
        }
    }
    fs::rename(env.root.join("img/base"), env.sentinel("base-tree")).unwrap();
    for image in ["app", "new"] {
        let out = env.run(["exec", "--write", image, "--from", "base", "--", "true"]);
        assert_eq!(out.status.code(), Some(1), "{}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains("image 'base': its tree") && err.contains("is missing"),
            "{err}"
        );
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        unchanged(image);
    }
}

/// The same at real timing: SIGTERM arrives as the exec opens the base's
/// lock file (injected there by strace), a moment before the copy would
/// begin. Pending signals are looked at only every few milliseconds during
/// a walk; the look before the copy must not be one skipped, or the image
/// is emptied and left incomplete.
#[test]
fn a_signal_as_the_locks_are_taken_undoes_a_copy_that_never_began() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.build("base", "echo BASE > \"$STOWAGE_IMAGE_DIR/content\"");
    env.build("app", "echo APP > \"$STOWAGE_IMAGE_DIR/content\"");
    let lock = env.lock_file("base");
    let faults = [
        "-P".to_owned(),
        lock.display().to_string(),
        "--inject=openat,openat2:signal=SIGTERM:when=1".to_owned(),
    ];
    let args = ["exec", "--write", "app", "--from", "base", "--", "true"];
    for _ in 0..3 {
        let out = output(under_strace(&env, &faults, &args));
        assert_eq!(out.status.code(), Some(143), "{}", show(&out));
        assert_eq!(env.state("app").as_deref(), Some("ready"), "{}", show(&out));
        let content = fs::read_to_string(env.root.join("img/app/content")).unwrap();
        assert_eq!(content, "APP\n");
    }
}

/// A base's tree we may not open (another user's, mode 700) is refused
/// before the image written is emptied, naming the base.
#[test]
fn a_base_tree_one_may_not_open_is_refused_before_the_copy() {
    if !root_or_skip("a base tree another user owns") {
        return;
    }
    let env = unprivileged_env();
    unprivileged_build(&env, "base", "echo BASE > \"$STOWAGE_IMAGE_DIR/content\"");
    unprivileged_build(&env, "app", "echo APP > \"$STOWAGE_IMAGE_DIR/content\"");
    let tree = env.images_dir().join("base");
    chown(&tree, 0, 0);
    fs::set_permissions(&tree, fs::Permissions::from_mode(0o700)).unwrap();
    let out = unprivileged(
        &env,
        &["exec", "--write", "app", "--from", "base", "--", "true"],
    );
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("image 'base': cannot open"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let content = fs::read_to_string(env.images_dir().join("app/content")).unwrap();
    assert_eq!(content, "APP\n");
    let out = unprivileged(&env, &["images", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let app = rows.as_array().unwrap().iter().find(|r| r["name"] == "app");
    assert_eq!(app.unwrap()["state"], "ready", "{}", show(&out));
}

/// An image whose top its owner left read-only (mode 555) is rebuilt from a
/// base by that owner: emptied with owner write lent to its top, as `rm`
/// moves it. Another user's such image cannot be emptied: the copy fails
/// before deleting anything, naming the directory's owner, and the image is
/// left as it was (ready, its tree and base), not incomplete for gc to delete.
#[test]
fn a_read_only_image_top_is_rebuilt_by_its_owner_and_left_as_it_was_by_others() {
    if !root_or_skip("an image top another user owns") {
        return;
    }
    let env = unprivileged_env();
    unprivileged_build(&env, "base", "echo BASE > \"$STOWAGE_IMAGE_DIR/content\"");
    for image in ["mine", "theirs"] {
        let script = "cd \"$STOWAGE_IMAGE_DIR\" && echo OLD > content && chmod 555 .";
        unprivileged_build(&env, image, script);
    }
    let theirs = env.images_dir().join("theirs");
    for p in [theirs.join("content"), theirs.clone()] {
        chown(&p, 0, 0);
    }
    let rebuild = |image: &str| {
        unprivileged(
            &env,
            &["exec", "--write", image, "--from", "base", "--", "true"],
        )
    };
    // The row of `image`, as the store's owner lists it.
    let row = |image: &str| {
        let out = unprivileged(&env, &["images", "--json"]);
        let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let row = rows.as_array().unwrap().iter().find(|r| r["name"] == image);
        row.cloned().unwrap_or_default()
    };
    let out = rebuild("mine");
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let mine = env.images_dir().join("mine");
    assert_eq!(fs::read_to_string(mine.join("content")).unwrap(), "BASE\n");
    assert_eq!(row("mine")["base"], "base");
    let out = rebuild("theirs");
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("theirs") && err.contains("uid 0's"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert_eq!(fs::read_to_string(theirs.join("content")).unwrap(), "OLD\n");
    let mode = fs::metadata(&theirs).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o555);
    assert_eq!(row("theirs")["state"], "ready");
    assert_eq!(row("theirs")["base"], serde_json::Value::Null);
    let out = unprivileged(&env, &["gc"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(row("theirs")["state"], "ready", "{}", show(&out));
}

/// Where a copy reads lengths from the data (a filesystem not known local:
/// the hidden hook makes tmpfs look like NFS), files of every shape copy
/// whole: empty, one byte, a sparse one ending in a hole.
#[test]
fn a_copy_that_reads_lengths_from_the_data_copies_every_file_whole() {
    let env = Env::new();
    env.build(
        "base",
        "cd \"$STOWAGE_IMAGE_DIR\" && : > empty && printf x > one && head -c 5000 /dev/urandom > some && printf abc > sparse && truncate -s 1M sparse",
    );
    let mut c = env.cmd(["exec", "--write", "app", "--from", "base", "--", "true"]);
    c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    for f in ["empty", "one", "some", "sparse"] {
        let (a, b) = (
            env.root.join("img/base").join(f),
            env.root.join("img/app").join(f),
        );
        assert_eq!(fs::read(&a).unwrap(), fs::read(&b).unwrap(), "{f}");
    }
}

#[test]
fn a_clone_whose_command_cannot_start_is_incomplete_not_restored() {
    // The copy changed the image before the command failed to start: its
    // old state must not come back with the base's content in it.
    let env = Env::new();
    env.build("base", "echo BASE > \"$STOWAGE_IMAGE_DIR/content\"");
    env.build("app", "echo APP > \"$STOWAGE_IMAGE_DIR/content\"");
    for image in ["app", "fresh"] {
        let out = env.run_with_vanishing_command(&["exec", "--write", image, "--from", "base"]);
        assert_eq!(out.status.code(), Some(1), "{}", show(&out));
        assert_eq!(env.state(image).as_deref(), Some("incomplete"), "{image}");
    }
    assert_eq!(
        env.run(["doctor"]).status.code(),
        Some(0),
        "no tree without a row"
    );
}

/// A write with `--from` killed (with its command) once its command had
/// deleted the tree: the next write of the name makes a tree of its own,
/// and that is the image — ready, with no base, kept by gc.
#[test]
fn a_rewrite_after_a_killed_copy_whose_command_deleted_its_tree_is_the_image() {
    let env = Env::new();
    env.make_image("base");
    let started = env.sentinel("started");
    let writer = env.spawn([
        "exec",
        "--write",
        "app",
        "--from",
        "base",
        "--",
        "sh",
        "-c",
        &format!(
            "rm -rf \"$STOWAGE_IMAGE_DIR\"; touch '{}'; sleep 60",
            started.display()
        ),
    ]);
    wait_for_file(&started);
    writer.kill_all();
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    env.build("app", "echo new > \"$STOWAGE_IMAGE_DIR/file\"");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    let row = env.image("app").unwrap();
    assert!(row["base"].is_null(), "{row}");
    assert_eq!(env.read_in_image("app", "file"), "new\n");
    env.ok(["gc"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["doctor"]);
}

/// The modes of every entry under `top`, by path relative to it (as root,
/// which may look anywhere).
fn modes(top: &Path) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> = walkdir(top)
        .iter()
        .map(|p| {
            let m = fs::symlink_metadata(p).unwrap();
            (
                p.strip_prefix(top).unwrap().display().to_string(),
                m.mode() & 0o7777,
            )
        })
        .collect();
    out.sort();
    out
}

/// An unprivileged user copies a base of its own holding files it may not
/// read (mode 000, as `/etc/shadow` in every RHEL-family image) and
/// directories it may not read or search: the copy is whole, with the same
/// modes, and the base's modes are as they were. A file that is not the
/// user's to read stops the copy with a line naming it and its owner.
#[test]
fn an_unprivileged_copy_takes_what_its_owner_may_not_read() {
    if !root_or_skip("running as an unprivileged user") {
        return;
    }
    let env = unprivileged_env();
    unprivileged_build(
        &env,
        "base",
        "set -e; cd \"$STOWAGE_IMAGE_DIR\"; mkdir -p etc locked search; \
         echo secret > etc/shadow; chmod 000 etc/shadow; chmod 500 etc; \
         echo inside > locked/f; chmod 000 locked; \
         echo found > search/g; chmod 100 search",
    );
    let base = env.images_dir().join("base");
    let before = modes(&base);
    let out = unprivileged(
        &env,
        &["exec", "--write", "app", "--from", "base", "--", "true"],
    );
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let app = env.images_dir().join("app");
    assert_eq!(modes(&base), before, "the base's modes changed");
    assert_eq!(modes(&app), before, "the copy's modes differ");
    for (f, text) in [
        ("etc/shadow", "secret\n"),
        ("locked/f", "inside\n"),
        ("search/g", "found\n"),
    ] {
        assert_eq!(fs::read_to_string(app.join(f)).unwrap(), text, "{f}");
    }
    // Another user's unreadable file: named, with its owner.
    fs::write(base.join("etc/root-only"), "x").unwrap();
    fs::set_permissions(
        base.join("etc/root-only"),
        fs::Permissions::from_mode(0o000),
    )
    .unwrap();
    let out = unprivileged(
        &env,
        &["exec", "--write", "app2", "--from", "base", "--", "true"],
    );
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("etc/root-only") && err.contains("belongs to uid 0"),
        "{err}"
    );
    assert_eq!(modes(&base).len(), before.len() + 1);
}

/// `stowage ARGS…` as uid 65534 in the background (`pause`: a debug pause
/// point, with the file the process makes there); None unless root.
fn unprivileged_bg(env: &Env, args: &[&str], pause: Option<(&str, &Path)>) -> Option<Bg> {
    let mut c = as_nobody()?;
    c.arg(bin()).arg("--root").arg(&env.root).args(args);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    if let Some((point, file)) = pause {
        c.env(
            stowage::env::DEBUG_PAUSE,
            format!("{point}:{}", file.display()),
        );
    }
    Some(Bg::from_command(c))
}

/// A base of uid 65534 with a directory and files of its own it may not
/// read (mode 000; one with an access ACL, where the filesystem takes
/// one): its modes.
fn base_with_000_entries(env: &Env) -> Vec<(String, u32)> {
    unprivileged_build(
        env,
        "base",
        "set -e; cd \"$STOWAGE_IMAGE_DIR\"; mkdir -p etc a; \
         echo secret > etc/shadow; chmod 000 etc/shadow; \
         echo x > etc/acl; (setfacl -m u:0:r etc/acl 2>/dev/null || true); \
         chmod 000 etc/acl; echo inside > a/f; chmod 000 a",
    );
    modes(&env.images_dir().join("base"))
}

/// Two copies of one base by its owner, one of them while the other has
/// its directory of mode 000 lent (paused after copying the file inside):
/// the second waits for the loan to end, both copy mode 000, and the base
/// keeps its modes.
#[test]
fn copies_of_a_base_with_entries_lent_to_its_owner_run_at_once_faithfully() {
    if !root_or_skip("running as an unprivileged user") {
        return;
    }
    let env = unprivileged_env();
    let before = base_with_000_entries(&env);
    let pause = env.tmp.path().join("c1-paused");
    let args = |t: &'static str| ["exec", "--write", t, "--from", "base", "--", "true"];
    let Some(c1) = unprivileged_bg(&env, &args("c1"), Some(("clone-copying", &pause))) else {
        return;
    };
    wait_for_file(&pause);
    let mut c2 = unprivileged_bg(&env, &args("c2"), None).unwrap();
    let lend = env.root.join("locks/images/base.lend");
    wait_until("the second copy ends or waits for the loan", || {
        !c2.is_running() || flock_waited_on(&lend)
    });
    fs::remove_file(&pause).unwrap();
    for (c, bg) in [("c1", c1), ("c2", c2)] {
        let out = bg.finish();
        assert_eq!(code(&out), Some(0), "{c}: {}", show(&out));
        assert_eq!(modes(&env.images_dir().join(c)), before, "{c}'s modes");
    }
    assert_eq!(
        modes(&env.images_dir().join("base")),
        before,
        "the base's modes"
    );
}

/// A rebuild from a base by its owner that must lend itself owner access, with `--no-wait` (or a
/// `--wait` that runs out) while another copy of the base holds its lend lock: it gives up before
/// the image is emptied (exit 75, the command not run), and the image keeps its files and state.
/// Before, the lend lock was first asked for exclusively mid-copy: the image was emptied, left
/// `incomplete`, and the exec still said the command was skipped (75, or 0 with
/// `--conflict-exit-code 0`).
#[test]
fn a_rebuild_that_gives_up_on_the_lend_lock_leaves_the_image_as_it_was() {
    if !root_or_skip("running as an unprivileged user") {
        return;
    }
    let env = unprivileged_env();
    base_with_000_entries(&env);
    unprivileged_build(&env, "app", "echo precious > \"$STOWAGE_IMAGE_DIR/keep\"");
    let pause = env.tmp.path().join("c1-paused");
    let c1 = ["exec", "--write", "c1", "--from", "base", "--", "true"];
    let Some(c1) = unprivileged_bg(&env, &c1, Some(("clone-emptied", &pause))) else {
        return;
    };
    wait_for_file(&pause);
    let app = env.images_dir().join("app");
    for wait in [&["--no-wait"][..], &["--wait", "0.2"]] {
        let mut args = vec!["exec"];
        args.extend(wait);
        args.extend(["--write", "app", "--from", "base", "--", "true"]);
        let out = unprivileged(&env, &args);
        assert_eq!(code(&out), Some(75), "{wait:?}: {}", show(&out));
        assert!(stderr(&out).contains("lend lock"), "{}", show(&out));
        assert_eq!(fs::read_to_string(app.join("keep")).unwrap(), "precious\n");
        let images = stdout(&unprivileged(&env, &["images"]));
        let app_line = images
            .lines()
            .find(|l| l.starts_with("app "))
            .unwrap_or_default();
        assert!(app_line.contains("ready"), "{wait:?}: {images}");
    }
    fs::remove_file(&pause).unwrap();
    let out = c1.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// A copy by the base's owner of a file of its own it may not read, setgid for a group it is not
/// in (mode 2010, group 1): refused, naming the file and why, and the base's file keeps its
/// setgid bit. Before, the loan of the owner's read bit (a chmod by a non-member of the file's
/// group) cleared the setgid bit, and the mode given back lacked it for good.
#[test]
fn a_copy_never_lends_itself_a_file_whose_setgid_bit_a_loan_would_clear() {
    if !root_or_skip("running as an unprivileged user") {
        return;
    }
    let env = unprivileged_env();
    unprivileged_build(&env, "base", "echo x > \"$STOWAGE_IMAGE_DIR/f\"");
    let f = env.images_dir().join("base/f");
    std::os::unix::fs::chown(&f, None, Some(1)).unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o2010)).unwrap();
    let out = unprivileged(
        &env,
        &["exec", "--write", "c", "--from", "base", "--", "true"],
    );
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("base/f") && err.contains("setgid"), "{err}");
    assert_eq!(fs::metadata(&f).unwrap().mode() & 0o7777, 0o2010);
}

/// A copy by the base's owner SIGKILLed while it has an entry of mode 000
/// lent: `doctor` says so, and `doctor --repair`, `gc`, a write of the base
/// or the next copy of it puts the mode back (the next copy first, so it
/// copies it as it was).
#[test]
fn a_loan_left_by_a_killed_copy_is_taken_back_by_the_next_user() {
    if !root_or_skip("running as an unprivileged user") {
        return;
    }
    let env = unprivileged_env();
    let before = base_with_000_entries(&env);
    let base = env.images_dir().join("base");
    let args = |t: &'static str| ["exec", "--write", t, "--from", "base", "--", "true"];
    let kill_lending = |t: &'static str| {
        let pause = env.tmp.path().join(format!("{t}-paused"));
        let k = unprivileged_bg(&env, &args(t), Some(("clone-copying", &pause))).unwrap();
        wait_for_file(&pause);
        k.kill_all();
        assert_ne!(modes(&base), before, "nothing was lent");
    };
    kill_lending("k1");
    let out = unprivileged(&env, &["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stdout(&out).contains("killed copy lent"), "{}", show(&out));
    let out = unprivileged(&env, &["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(modes(&base), before, "after doctor --repair");
    kill_lending("k2");
    let out = unprivileged(&env, &["gc"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stdout(&out).contains("restored the modes"),
        "{}",
        show(&out)
    );
    assert_eq!(modes(&base), before, "after gc");
    kill_lending("k3");
    let out = unprivileged(&env, &["exec", "--write", "base", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(modes(&base), before, "after a write of the base");
    kill_lending("k4");
    let out = unprivileged(&env, &args("next"));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(modes(&base), before, "after the next copy");
    assert_eq!(
        modes(&env.images_dir().join("next")),
        before,
        "the copy's modes"
    );
}

/// A hard-linked file whose first name is in a directory of mode 000 (the
/// owner's, copied by the owner): its other name, met after that
/// directory's copy got its mode, is a link all the same.
#[test]
fn an_unprivileged_copy_links_names_of_a_file_first_met_in_a_000_directory() {
    if !root_or_skip("running as an unprivileged user") {
        return;
    }
    let env = unprivileged_env();
    // Several, so that readdir meets some before `z`.
    unprivileged_build(
        &env,
        "base",
        "set -e; cd \"$STOWAGE_IMAGE_DIR\"; mkdir z; for i in 1 2 3 4 5 6 7 8; do \
         mkdir a$i; echo s > a$i/f; ln a$i/f z/g$i; chmod 000 a$i; done",
    );
    let before = modes(&env.images_dir().join("base"));
    let out = unprivileged(
        &env,
        &["exec", "--write", "app", "--from", "base", "--", "true"],
    );
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let app = env.images_dir().join("app");
    assert_eq!(modes(&app), before);
    for i in 1..=8 {
        let g = fs::metadata(app.join(format!("z/g{i}"))).unwrap();
        let f = fs::metadata(app.join(format!("a{i}/f"))).unwrap();
        assert_eq!((g.ino(), g.nlink()), (f.ino(), 2), "a{i}/f and z/g{i}");
    }
}

/// A copy that runs out of file descriptors (it keeps two per level of the
/// 16 deepest it is in) says which file it stopped at and what to do, and
/// the image is not ready.
#[test]
fn a_copy_out_of_file_descriptors_says_what_to_do() {
    use std::os::unix::process::CommandExt;
    let env = Env::new();
    env.build(
        "base",
        "cd \"$STOWAGE_IMAGE_DIR\"; mkdir -p a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p/q/r/s/t; echo x > a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p/q/r/s/t/f",
    );
    let mut c = env.cmd(["exec", "--write", "app", "--from", "base", "--", "true"]);
    // SAFETY: only setrlimit(2) runs between fork and exec.
    unsafe {
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 24,
                rlim_max: 24,
            };
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            Ok(())
        });
    }
    let out = output(c);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("img/base/a/b") && err.contains("ulimit -n") && err.lines().count() == 1,
        "{err}"
    );
    assert_ne!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(
        env.read_in_image("base", "a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p/q/r/s/t/f"),
        "x\n"
    );
}

/// A look at a directory of the base that fails (EIO from a dying disk,
/// ESTALE on NFS) is a failed copy, never taken for a mount point inside
/// the base: that left the subtree out, empty, and the image `ready`.
/// Each `statx` of the copy fails in turn (strace's fault injection).
#[test]
fn a_failed_look_at_a_directory_of_the_base_is_no_mount_point() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.build(
        "base",
        "mkdir -p \"$STOWAGE_IMAGE_DIR/d/e\"; echo data > \"$STOWAGE_IMAGE_DIR/d/e/f\"",
    );
    for n in 1..=12 {
        let name = format!("new{n}");
        let faults = [
            "-e".into(),
            "trace=statx".into(),
            format!("--inject=statx:error=EIO:when={n}"),
        ];
        let args = ["exec", "--write", &name, "--from", "base", "--", "true"];
        let out = output(under_strace(&env, &faults, &args));
        let copied = env.root.join("img").join(&name).join("d/e/f").exists();
        if code(&out) == Some(0) {
            assert!(
                copied,
                "statx {n} failed, yet exit 0 without d/e/f: {}",
                show(&out)
            );
            assert_eq!(env.state(&name).as_deref(), Some("ready"));
        } else {
            assert_ne!(
                env.state(&name).as_deref(),
                Some("ready"),
                "statx {n}: {}",
                show(&out)
            );
            assert!(
                !stderr(&out).contains("mount point"),
                "statx {n}: {}",
                show(&out)
            );
        }
    }
}

/// Without `statx` (a kernel before 4.11, a sandbox that forbids it: ENOSYS
/// or EPERM) there are no mount ids, and copies, removals and the measure
/// go on by device numbers: they failed, leaving the copy incomplete and
/// the removal in the trash.
#[test]
fn without_statx_a_copy_a_removal_and_gc_work() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.build(
        "base",
        "mkdir -p \"$STOWAGE_IMAGE_DIR/d\"; echo data > \"$STOWAGE_IMAGE_DIR/d/f\"",
    );
    for errno in ["ENOSYS", "EPERM"] {
        let faults = [
            "-e".into(),
            "trace=statx".into(),
            format!("--inject=statx:error={errno}"),
        ];
        let run = |args: &[&str]| output(under_strace(&env, &faults, args));
        let out = run(&["exec", "--write", "copy", "--from", "base", "--", "true"]);
        assert_eq!(code(&out), Some(0), "{errno}: {}", show(&out));
        assert!(env.root.join("img/copy/d/f").exists(), "{errno}");
        let out = run(&["rm", "copy"]);
        assert_eq!(code(&out), Some(0), "{errno}: {}", show(&out));
        let out = run(&["gc"]);
        assert_eq!(code(&out), Some(0), "{errno}: {}", show(&out));
        assert_eq!(
            fs::read_dir(env.root.join("trash")).unwrap().count(),
            0,
            "{errno}"
        );
    }
}

/// A base's top-level `.git` that links it to a git worktree (a file
/// `gitdir: …`) is not copied: the copy would claim the base's worktree.
/// A `.git` directory, one below the top, and other `.git*` files are.
#[test]
fn a_copy_leaves_out_only_the_bases_worktree_link() {
    let env = Env::new();
    let script = "cd \"$STOWAGE_IMAGE_DIR\" && printf 'gitdir: /cache/worktrees/base\\n' > .git \
                  && mkdir -p sub && printf 'gitdir: ../x\\n' > sub/.git && echo '*.o' > .gitignore";
    env.ok(["exec", "--write", "base", "--", "sh", "-c", script]);
    env.ok(["exec", "--write", "app", "--from", "base", "--", "true"]);
    let app = env.root.join("img/app");
    assert!(!app.join(".git").exists());
    assert!(app.join("sub/.git").is_file() && app.join(".gitignore").is_file());
    let script = "mkdir \"$STOWAGE_IMAGE_DIR/.git\"";
    env.ok(["exec", "--write", "repo", "--", "sh", "-c", script]);
    env.ok(["exec", "--write", "repo2", "--from", "repo", "--", "true"]);
    assert!(env.root.join("img/repo2/.git").is_dir());
}

/// A rebuild from a base that fails in the image's tree after giving a read-only directory there
/// owner access (to empty it) has changed the tree: the image is not left `ready` with its modes
/// changed. It was, counted as a start that changed nothing (only deletions were counted).
#[test]
fn a_rebuild_that_lent_a_directory_owner_access_has_changed_the_image() {
    if !root_or_skip("chattr +i") || !tool_or_skip("chattr", "e2fsprogs") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let script = "cd \"$STOWAGE_IMAGE_DIR\" && mkdir -p proc/sys && echo 1 > proc/sys/imm \
                  && chmod 555 proc/sys proc";
    env.build("x", script);
    let imm = env.root.join("img/x/proc/sys/imm");
    if !immutable(&imm, true) {
        eprintln!("skipping: chattr +i is not supported here");
        return;
    }
    let out = env.run(["exec", "--write", "x", "--from", "base", "--", "true"]);
    assert!(immutable(&imm, false));
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let mode = |p: &str| fs::metadata(env.root.join(p)).unwrap().permissions().mode() & 0o7777;
    let state = env.state("x");
    let modes = (mode("img/x/proc"), mode("img/x/proc/sys"));
    assert!(
        state.as_deref() != Some("ready") || modes == (0o555, 0o555),
        "{state:?} with modes {:o} {:o}",
        modes.0,
        modes.1
    );
}

/// Runs `c` with at most `n` open files (soft and hard limit).
fn with_open_files(c: &mut Command, n: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only setrlimit(2) runs between fork and exec.
    unsafe {
        c.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: n,
                rlim_max: n,
            };
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            Ok(())
        });
    }
}

/// A copy holds a bounded number of descriptors at any depth (far levels
/// are reopened through `..`), as the walks that measure and remove trees
/// do: a base 600 levels deep is copied, measured and removed with 256 open
/// files allowed. Before, the copy held two per level and stopped at depth
/// ~120, and the measure one per level.
#[test]
fn a_deep_base_is_copied_and_measured_with_few_open_files() {
    let env = Env::new();
    env.make_image("base");
    deep_tree(&env.root.join("img/base"), 600);
    let limited = |args: &[&str]| {
        let mut c = env.cmd(args);
        with_open_files(&mut c, 256);
        output(c)
    };
    let out = limited(&["exec", "--write", "copy", "--from", "base", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let found = sh(&format!(
        "find '{}' -name bottom -size 64k | wc -l",
        env.root.join("img/copy").display()
    ));
    assert_eq!(String::from_utf8_lossy(&found.stdout).trim(), "1");
    let out = limited(&["images", "--json"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let images: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let sizes: Vec<u64> = images
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["size_bytes"].as_u64().unwrap_or(0))
        .collect();
    assert!(
        sizes.len() == 2 && sizes.iter().all(|&s| s >= 65536),
        "{images}"
    );
    let out = limited(&["rm", "copy"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// Makes `dirs` nested directories of 250-byte names under `top` (by
/// descriptor: deeper than PATH_MAX) and, at the bottom, `files` files with
/// two names each (`fJ`, `gJ`). Three inodes also have names far apart:
/// `f0` as `top-f0` at the top, `f1` as `side/f1`, `a-top` at both ends.
fn deep_links(top: &Path, dirs: usize, files: usize) {
    use std::ffi::{CStr, CString};
    let name = CString::new("h".repeat(250)).unwrap();
    let top_c = CString::new(top.as_os_str().as_encoded_bytes()).unwrap();
    unsafe {
        let topfd = libc::open(top_c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY);
        assert!(topfd >= 0);
        let made = libc::openat(
            topfd,
            c"a-top".as_ptr(),
            libc::O_WRONLY | libc::O_CREAT,
            0o644,
        );
        assert!(made >= 0);
        libc::close(made);
        assert_eq!(libc::mkdirat(topfd, c"side".as_ptr(), 0o755), 0);
        let mut fd = libc::dup(topfd);
        for _ in 0..dirs {
            assert_eq!(libc::mkdirat(fd, name.as_ptr(), 0o755), 0);
            let next = libc::openat(fd, name.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY);
            assert!(next >= 0);
            libc::close(fd);
            fd = next;
        }
        for j in 0..files {
            let f = CString::new(format!("f{j}")).unwrap();
            let g = CString::new(format!("g{j}")).unwrap();
            let made = libc::openat(fd, f.as_ptr(), libc::O_WRONLY | libc::O_CREAT, 0o644);
            assert!(made >= 0);
            libc::close(made);
            assert_eq!(libc::linkat(fd, f.as_ptr(), fd, g.as_ptr(), 0), 0);
        }
        let link = |from: i32, a: &CStr, to: i32, b: &CStr| {
            assert_eq!(libc::linkat(from, a.as_ptr(), to, b.as_ptr(), 0), 0);
        };
        link(fd, c"f0", topfd, c"top-f0");
        link(fd, c"f1", topfd, c"side/f1");
        link(topfd, c"a-top", fd, c"a-top");
        libc::close(fd);
        libc::close(topfd);
    }
}

/// The memory a copy takes for hard links does not grow with their depth:
/// before, each linked inode kept the whole path of its first name (1500
/// files 200 levels of 250-byte names deep took ~85 MB more). Links across
/// directories, up and down the tree, stay links.
#[test]
fn hard_links_deep_in_a_base_cost_no_memory_per_level() {
    let env = Env::new();
    env.make_image("base");
    deep_links(&env.root.join("img/base"), 200, 1500);
    let c = env.cmd(["exec", "--write", "copy", "--from", "base", "--", "true"]);
    let (out, peak_kib) = output_and_peak(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    eprintln!("peak {peak_kib} KiB");
    assert!(
        peak_kib < 40 << 10,
        "the copy took {peak_kib} KiB at its peak"
    );
    // Paths this deep are past PATH_MAX: find(1) names each name's inode.
    let found = sh(&format!(
        "cd '{}' && find . \\( -name 'f[017]' -o -name 'g7' -o -name top-f0 -o -name a-top \\) -printf '%f %i\\n' | sort",
        env.root.join("img/copy").display()
    ));
    let found = String::from_utf8_lossy(&found.stdout).into_owned();
    let ino = |n: &str| -> Vec<&str> {
        let lines = found.lines().filter(|l| l.split(' ').next() == Some(n));
        lines.map(|l| l.split(' ').nth(1).unwrap()).collect()
    };
    let a = ino("a-top");
    assert!(a.len() == 2 && a[0] == a[1], "{found}");
    assert_eq!(ino("f0"), ino("top-f0"), "{found}");
    assert_eq!(ino("f7"), ino("g7"), "{found}");
    let f1 = ino("f1");
    assert!(f1.len() == 2 && f1[0] == f1[1], "{found}");
}

/// A termination signal during the copy of one large file is acted on
/// within a chunk of its data, not once the whole file is copied (locks
/// held all the while). The pause comes after the file's first chunk.
#[test]
fn sigterm_during_a_large_file_stops_its_copy() {
    let env = Env::new();
    let full: u64 = 256 << 20;
    env.build(
        "base",
        "head -c 256M /dev/zero > \"$STOWAGE_IMAGE_DIR/big\"",
    );
    let (bg, pause) = env.paused(
        ["exec", "--write", "copy", "--from", "base", "--", "true"],
        "clone-data",
    );
    bg.signal(libc::SIGTERM);
    fs::remove_file(&pause).unwrap();
    let out = bg.finish();
    assert_eq!(code(&out), Some(143), "{}", show(&out));
    let copied = fs::metadata(env.root.join("img/copy/big")).unwrap().len();
    assert!(
        copied < full,
        "the copy ran on after SIGTERM: {copied} of {full} bytes"
    );
    assert_eq!(env.state("copy").as_deref(), Some("incomplete"));
    assert!(flock_free(&env.lock_file("base")));
}

/// A copy's ACLs are its base's: a default ACL on the images directory
/// (which every new file in it inherits) gives the copy none the base
/// lacks, and no wider modes.
#[test]
fn a_clone_gains_no_acl_from_the_images_directory() {
    if !have("setfacl") || !have("getfacl") {
        eprintln!("skipping: setfacl/getfacl not found");
        return;
    }
    let env = Env::new();
    env.build(
        "plain",
        "cd \"$STOWAGE_IMAGE_DIR\"; mkdir d; echo a > d/f; mkfifo d/p; chmod 700 d; chmod 600 d/f",
    );
    let img = env.root.join("img");
    let set = Command::new("setfacl")
        .args(["-d", "-m", "u:1234:rwx"])
        .arg(&img)
        .output()
        .unwrap();
    if !set.status.success() {
        eprintln!("skipping: no ACLs here: {}", stderr(&set));
        return;
    }
    env.ok(["exec", "--write", "copy", "--from", "plain", "--", "true"]);
    for f in ["", "d", "d/f", "d/p"] {
        let acl = sh(&format!(
            "getfacl -cp '{}'",
            img.join("copy").join(f).display()
        ));
        let acl = String::from_utf8_lossy(&acl.stdout).into_owned();
        assert!(!acl.contains("1234"), "copy/{f} gained an ACL:\n{acl}");
        let mode = |i: &str| fs::symlink_metadata(img.join(i).join(f)).unwrap().mode();
        assert_eq!(mode("plain"), mode("copy"), "{f}");
    }
}

/// A copy by its owner of a base whose directories, 100 deep, keep even
/// the owner out (000) holds a bounded number of descriptors: a lent level
/// far above the ones open keeps its loan by its journal line only, and a
/// hard link is linked through the copy's finished 000 directories holding
/// the nearest one open. Before, every lent level kept a descriptor, and a
/// link one per directory on its way.
#[test]
fn a_deep_base_lent_at_every_level_is_copied_with_few_open_files() {
    let env = unprivileged_env();
    let Some(mut c) = as_nobody() else { return };
    unprivileged_build(
        &env,
        "base",
        "set -e; cd \"$STOWAGE_IMAGE_DIR\"; mkdir zz; p=.; \
         for i in $(seq 100); do p=$p/d; mkdir $p; done; \
         echo s > $p/f; ln $p/f zz/g; echo t > a-top; ln a-top $p/t; \
         while [ $p != . ]; do chmod 000 $p; p=${p%/d}; done",
    );
    let base = env.images_dir().join("base");
    let before = modes(&base);
    c.arg(bin()).arg("--root").arg(&env.root);
    c.args(["exec", "--write", "app", "--from", "base", "--", "true"]);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    c.stdin(std::process::Stdio::null());
    with_open_files(&mut c, 96);
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let app = env.images_dir().join("app");
    assert_eq!(modes(&app), before);
    assert_eq!(modes(&base), before);
    let bottom = app.join("d/".repeat(100));
    let ino = |p: std::path::PathBuf| fs::metadata(p).unwrap().ino();
    assert_eq!(ino(app.join("zz/g")), ino(bottom.join("f")));
    assert_eq!(ino(app.join("a-top")), ino(bottom.join("t")));
    let lend = env.root.join("locks/images/base.lend");
    assert_eq!(fs::metadata(lend).map_or(0, |m| m.len()), 0);
}

/// A lend file any member of a group store may write is taken only for what a loan can be: a line
/// naming a path out of the base (`..`), or a mode a loan never gives (setuid, write bits), is
/// passed over by whoever restores loans (gc here), and a huge file is read only so far. A forged
/// line made gc set a file outside the store setuid and world-writable; a sparse terabyte aborted
/// it (memory).
#[test]
fn a_forged_lend_file_changes_nothing_outside_what_a_loan_lent() {
    use std::os::unix::fs::MetadataExt;
    let env = Env::new();
    env.build("base", "echo x > \"$STOWAGE_IMAGE_DIR/f\"");
    let victim = env.tmp.path().join("victim");
    fs::write(&victim, "secret").unwrap();
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o600)).unwrap();
    let f = env.root.join("img/base/f");
    let hex = |s: &str| s.bytes().map(|b| format!("{b:02x}")).collect::<String>();
    let line = |p: &Path, rel: &str, was: u32| {
        let m = fs::metadata(p).unwrap();
        let lent = m.mode() & 0o7777;
        format!("{was:o} {lent:o} {} {} {}\n", m.dev(), m.ino(), hex(rel))
    };
    let lend = env.root.join("locks/images/base.lend");
    let journal = line(&victim, "../../../victim", 0o4777) + &line(&f, "f", 0o4644);
    fs::write(&lend, journal).unwrap();
    env.ok(["gc"]);
    let mode = |p: &Path| fs::metadata(p).unwrap().mode() & 0o7777;
    assert_eq!(mode(&victim), 0o600);
    assert_eq!(mode(&f), 0o644);
    let huge = fs::OpenOptions::new().write(true).open(&lend).unwrap();
    huge.set_len(1 << 40).unwrap();
    drop(huge);
    let out = env.run(["gc"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.ok(["exec", "--write", "base", "--", "true"]);
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// What a test watches of a file: owner, group, mode, times and extended
/// attributes (every namespace this process may read).
fn watched(p: &Path) -> (u32, u32, u32, i64, i64, String) {
    let m = fs::metadata(p).unwrap();
    let xattrs = sh(&format!("getfattr -d -m - '{}' 2>&1", p.display())).stdout;
    let xattrs = String::from_utf8_lossy(&xattrs).into_owned();
    (m.uid(), m.gid(), m.mode(), m.mtime(), m.atime(), xattrs)
}

/// While a copy sets the attributes of a FIFO, device node or symlink it has
/// just made (paused between), the name is swapped for a link to a file
/// outside the store: a symlink (for the FIFO or device) or a hard link (for
/// the symlink), as a member who could write in the copy would. Whether root or the base's
/// unprivileged owner copies, the copy fails with one line naming the
/// entry, and the file outside keeps its owner, mode, times and attributes.
#[test]
fn an_entry_swapped_mid_copy_leaves_a_file_outside_as_it_was() {
    if !root_or_skip("acting as the member who swaps the entry") || !have("setfattr") {
        return;
    }
    for (kind, root_copies) in [
        ("device", true),
        ("fifo", true),
        ("link", true),
        ("fifo", false),
        ("link", false),
    ] {
        let case = format!(
            "{kind}, copied by {}",
            if root_copies { "root" } else { "uid 65534" }
        );
        let env = if root_copies {
            Env::new()
        } else {
            unprivileged_env()
        };
        let make = match kind {
            "fifo" => "mkfifo e; chmod 4777 e",
            "device" => "mknod e c 1 3; chmod 4777 e",
            _ => "ln -s nowhere e",
        };
        // A trusted.* attribute only root may set, and copy.
        let trusted = if root_copies {
            "setfattr -h -n trusted.base -v b e;"
        } else {
            ""
        };
        let script = format!(
            "set -e; cd \"$STOWAGE_IMAGE_DIR\"; {make}; {trusted} touch -h -d '2001-02-03 04:05:06' e"
        );
        let victim = env.tmp.path().join("victim");
        fs::write(&victim, "secret").unwrap();
        fs::set_permissions(&victim, fs::Permissions::from_mode(0o600)).unwrap();
        let args = ["exec", "--write", "cp", "--from", "base", "--", "true"];
        let (bg, pause) = if root_copies {
            env.build("base", &script);
            chown(&victim, 4321, 4321);
            sh(&format!(
                "setfattr -n trusted.mine -v v '{}'",
                victim.display()
            ));
            env.paused(args, "clone-made")
        } else {
            unprivileged_build(&env, "base", &script);
            chown(&victim, 65534, 65534);
            let pause = env.tmp.path().join("made-paused");
            let bg = unprivileged_bg(&env, &args, Some(("clone-made", &pause))).unwrap();
            wait_for_file(&pause);
            (bg, pause)
        };
        let before = watched(&victim);
        let entry = env.images_dir().join("cp/e");
        fs::remove_file(&entry).unwrap();
        match kind {
            "fifo" | "device" => std::os::unix::fs::symlink(&victim, &entry).unwrap(),
            _ => fs::hard_link(&victim, &entry).unwrap(),
        }
        fs::remove_file(&pause).unwrap();
        let out = bg.finish();
        assert_eq!(watched(&victim), before, "{case}: the file outside changed");
        assert_eq!(code(&out), Some(1), "{case}: {}", show(&out));
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "{case}: {err}");
        assert!(
            err.contains("cp/e") && err.contains("replaced"),
            "{case}: {err}"
        );
        if root_copies {
            assert_eq!(env.state("cp").as_deref(), Some("incomplete"), "{case}");
        }
    }
}

/// Rebuilding an image from a base whose lend file cannot be locked (a
/// FIFO planted there) is refused before anything of the image is deleted:
/// its files, state and base are as they were. Before, the image was
/// emptied first and left `incomplete`.
#[test]
fn a_rebuild_refused_by_the_bases_lend_file_leaves_the_image_as_it_was() {
    let env = Env::new();
    env.build("base", "echo b > \"$STOWAGE_IMAGE_DIR/b\"");
    env.build("app", "echo precious > \"$STOWAGE_IMAGE_DIR/p\"");
    let lend = env.root.join("locks/images/base.lend");
    let _ = fs::remove_file(&lend);
    Plant::Fifo.at(&lend, env.tmp.path());
    let out = env.run(["exec", "--write", "app", "--from", "base", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", show(&out));
    assert!(stderr(&out).contains("FIFO"), "{}", show(&out));
    assert_eq!(env.read_in_image("app", "p"), "precious\n");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert!(env.image("app").unwrap()["base"].is_null());
}

/// The name of each level of [`deep_000_tree`]: 250 bytes.
fn deep_name() -> String {
    "n".repeat(250)
}

/// Makes under `top` a chain of 100 directories named [`deep_name`] (a path
/// past PATH_MAX, so by descriptor) holding a file `f`, all `uid`'s, the
/// directories mode 000.
fn deep_000_tree(top: &Path, uid: u32) {
    use nix::fcntl::{OFlag, open, openat};
    use nix::sys::stat::{Mode, fchmod, mkdirat};
    let dir = OFlag::O_RDONLY | OFlag::O_DIRECTORY;
    let mut levels = vec![open(top, dir, Mode::empty()).unwrap()];
    let owner = |fd: &std::os::fd::OwnedFd| {
        let id = Some(nix::unistd::Uid::from_raw(uid));
        nix::unistd::fchown(fd, id, Some(nix::unistd::Gid::from_raw(uid))).unwrap()
    };
    for _ in 0..100 {
        let up = levels.last().unwrap();
        mkdirat(up, deep_name().as_str(), Mode::from_bits_truncate(0o755)).unwrap();
        let sub = openat(up, deep_name().as_str(), dir, Mode::empty()).unwrap();
        owner(&sub);
        levels.push(sub);
    }
    let create = OFlag::O_WRONLY | OFlag::O_CREAT;
    let f = openat(
        levels.last().unwrap(),
        "f",
        create,
        Mode::from_bits_truncate(0o644),
    )
    .unwrap();
    owner(&f);
    for level in &levels[1..] {
        fchmod(level, Mode::empty()).unwrap();
    }
}

/// The modes of the levels of [`deep_000_tree`] under `top`, top first.
fn deep_modes(top: &Path) -> Vec<u32> {
    use nix::fcntl::{AtFlags, OFlag, open, openat};
    use nix::sys::stat::{Mode, fstatat};
    let dir = OFlag::O_RDONLY | OFlag::O_DIRECTORY;
    let mut here = open(top, dir, Mode::empty()).unwrap();
    let mut modes = Vec::new();
    for _ in 0..100 {
        let st = fstatat(&here, deep_name().as_str(), AtFlags::AT_SYMLINK_NOFOLLOW).unwrap();
        modes.push(st.st_mode & 0o7777);
        here = openat(&here, deep_name().as_str(), dir, Mode::empty()).unwrap();
    }
    modes
}

/// A copy by its owner killed while every level of a base 100 deep, each
/// named by 250 bytes and of mode 000, is lent: its journal holds over
/// 2 MiB (each line names its path from the top), and doctor --repair
/// reads it whole: every level gets its mode back. Before, the journal was
/// read to 1 MiB and emptied: 35 levels kept the lent mode, and doctor
/// said nothing more of it.
#[test]
fn a_journal_of_loans_over_a_mebibyte_is_restored_whole() {
    if !root_or_skip("running as an unprivileged user") {
        return;
    }
    let env = unprivileged_env();
    unprivileged_build(&env, "base", "true");
    let base = env.images_dir().join("base");
    deep_000_tree(&base, 65534);
    assert_eq!(deep_modes(&base), vec![0; 100]);
    let pause = env.tmp.path().join("k-paused");
    let args = ["exec", "--write", "k", "--from", "base", "--", "true"];
    let k = unprivileged_bg(&env, &args, Some(("clone-copying", &pause))).unwrap();
    wait_for_file(&pause);
    k.kill_all();
    assert_eq!(deep_modes(&base), vec![0o500; 100], "all lent");
    let out = unprivileged(&env, &["doctor", "--repair"]);
    assert!(
        stdout(&out).contains("restored the modes"),
        "{}",
        show(&out)
    );
    assert_eq!(deep_modes(&base), vec![0; 100]);
    let out = unprivileged(&env, &["doctor"]);
    assert!(!stdout(&out).contains("loans"), "{}", show(&out));
}

/// The lend lock of a base held by another (here a member's `flock`, as a copy lending holds it):
/// a copy from it with `--no-wait` or `--wait S` gives up as for any lock, exit 75 (or
/// `--conflict-exit-code`) and one line naming the base's lend lock, its command not run. Such a
/// copy waited as long as the holder held it.
#[test]
fn a_copy_waits_for_the_bases_lend_lock_no_longer_than_asked() {
    let env = Env::new();
    env.build("base", "echo x > \"$STOWAGE_IMAGE_DIR/f\"");
    let lend = env.root.join("locks/images/base.lend");
    let mut c = Command::new("flock");
    c.arg("-x").arg(&lend).args(env.hold_cmd("held", "release"));
    let holder = Bg::from_command(c);
    wait_for_file(&env.sentinel("held"));
    let ran = env.tmp.path().join("ran");
    let touch = format!("touch '{}'", ran.display());
    for (when, exit) in [
        (vec!["--no-wait"], 75),
        (vec!["--wait", "0.3"], 75),
        (vec!["--no-wait", "--conflict-exit-code", "42"], 42),
    ] {
        let mut args = vec!["exec"];
        args.extend(when.iter().copied());
        args.extend(["--write", "c", "--from", "base", "--", "sh", "-c", &touch]);
        let out = env.run(&args);
        assert_eq!(code(&out), Some(exit), "{when:?}: {}", show(&out));
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "{when:?}: {err}");
        assert!(err.contains("lend lock") && err.contains("base"), "{err}");
        assert!(!ran.exists(), "{when:?}: the command ran");
    }
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
    env.ok(["exec", "--write", "c", "--from", "base", "--", "true"]);
}
