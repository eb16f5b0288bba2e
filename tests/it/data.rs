//! Image contents, sizes, gc's budget, clocks, printed records and a full
//! filesystem: what a store holds and what it says about it.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

/// Sets a time column of an image's row directly, as another host's clock
/// (or an older release) may have written it.
fn set_stored_time(env: &Env, image: &str, column: &str, ms: i64) {
    let conn = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    let n = conn
        .execute(
            &format!("UPDATE images SET {column} = ?1 WHERE name = ?2"),
            rusqlite::params![ms, image],
        )
        .unwrap();
    assert_eq!(n, 1);
}

// --- clocks ---------------------------------------------------------------

#[test]
fn a_clock_in_milliseconds_or_bogus_is_refused_and_creates_nothing() {
    let env = Env::new();
    for bad in ["1795953784000", "bogus", "-3"] {
        let mut c = env.cmd(["exec", "--write", "app", "--", "true"]);
        c.env("STOWAGE_NOW", bad);
        let out = output(c);
        assert_eq!(out.status.code(), Some(64), "{bad}: {}", show(&out));
        let err = stderr(&out);
        assert!(err.contains("STOWAGE_NOW"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(!env.root.exists(), "{bad}: the store was created");
    }
    let mut c = env.cmd(["exec", "--write", "app", "--", "true"]);
    c.env("STOWAGE_NOW", "1795953784");
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}

#[test]
fn a_stored_time_past_year_9999_is_shown_as_unknown_not_a_panic() {
    let env = Env::new();
    env.make_image("app");
    set_stored_time(&env, "app", "created_ms", i64::MAX);
    set_stored_time(&env, "app", "last_used_ms", 1_795_953_784_000_000);
    let img = env.image("app").unwrap();
    assert!(img["created"].is_null(), "{img}");
    assert!(img["last_used"].is_null(), "{img}");
    let out = env.ok(["images"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("unknown"));
    env.status_json(["--all"]);
    env.ok(["lock-status", "--all"]);
    env.ok(["gc", "--unused-for", "1d", "--dry-run"]);
    // A holder whose record says it started after year 9999.
    let _h = env.hold(&["--read", "app"], "started");
    let conn = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    conn.execute("UPDATE records SET since_ms = ?1", [i64::MAX])
        .unwrap();
    let st = env.status_json(["app"]);
    let entry = st["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "app")
        .unwrap()
        .clone();
    assert!(entry["holders"][0]["since"].is_null(), "{entry}");
    env.ok(["lock-status"]);
    env.release("release");
}

// --- printed records ------------------------------------------------------

#[test]
fn control_characters_of_a_recorded_command_are_escaped_when_printed() {
    let env = Env::new();
    env.make_image("app");
    // The holder's command carries a screen-clearing escape and a newline
    // that would forge a second table row.
    let evil = "\u{1b}[2J\u{1b}]0;pwned\u{7}\nglobal  global  free  forged";
    let mut args: Vec<String> = ["exec", "--write", "app", "--"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(env.hold_cmd("started", "release"));
    args.push(evil.into());
    let _h = env.spawn(&args);
    wait_for_file(&env.sentinel("started"));

    let out = env.ok(["lock-status"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        !text.contains('\u{1b}') && !text.contains('\u{7}'),
        "{text:?}"
    );
    assert!(!text.contains("\nglobal  global  free  forged"), "{text}");
    assert!(text.contains(r"\x1b[2J"), "{text}");

    let out = env.run(["exec", "--read", "app", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let err = stderr(&out);
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");

    // JSON keeps the exact command (its encoder escapes it).
    let st = env.status_json(["app"]);
    let raw = serde_json::to_string(&st).unwrap();
    assert!(raw.contains(r"\u001b[2J"), "{raw}");
    env.release("release");
}

// --- what a clone keeps ---------------------------------------------------

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
    // Forget the size recorded when it was built, so it is measured again.
    let conn = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    conn.execute("UPDATE images SET size_bytes = NULL", [])
        .unwrap();
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
fn gc_budget_counts_reflinked_extents_once() {
    let Some(mnt) = Mount::btrfs_loop("600M") else {
        return;
    };
    let env = mnt.env();
    env.build(
        "base",
        "head -c 104857600 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
    );
    let before = mnt.used();
    for c in ["c1", "c2", "c3"] {
        env.ok(["exec", "--write", c, "--from", "base", "--", "true"]);
    }
    let grew = mnt.used().saturating_sub(before);
    assert!(grew < 16 * MIB, "three clones used {grew} bytes of disk");

    // images: every image shares its 100 MiB; removing one alone frees
    // almost nothing.
    for img in env.images_json() {
        let size = img["size_bytes"].as_u64().unwrap();
        let shared = img["shared_bytes"].as_u64().unwrap();
        let own = img["exclusive_bytes"].as_u64().unwrap();
        assert!(size >= 100 * MIB, "{img}");
        assert!(shared >= 99 * MIB, "{img}");
        assert!(own < MIB, "{img}");
    }
    let table = String::from_utf8_lossy(&env.ok(["images"]).stdout).into_owned();
    assert!(table.contains("on the filesystem"), "{table}");

    // The images take about one copy: a budget of 150 MiB holds them all.
    let out = env.ok(["gc", "--max-size", "150M", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let taken = report["size_before"].as_u64().unwrap();
    assert!(
        (100 * MIB..116 * MIB).contains(&taken),
        "images take {taken} bytes by gc's count: {report}"
    );
    assert!(
        report["removed"].as_array().unwrap().is_empty(),
        "gc removed images that fit: {report}"
    );
    assert_eq!(env.images_json().len(), 4);

    // A budget they do not fit: what gc says it freed is what df gets back.
    let before = mnt.used();
    let out = env.ok(["gc", "--max-size", "50M", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let freed = report["bytes_freed"].as_u64().unwrap();
    let got_back = before.saturating_sub(mnt.used());
    assert!(
        freed.abs_diff(got_back) < 16 * MIB,
        "gc says it freed {freed}, df got back {got_back}: {report}"
    );
    assert!(
        report["size_after"].as_u64().unwrap() <= 50 * MIB,
        "{report}"
    );
}

/// How both measuring races end: IMAGE has recorded its real size (at
/// least 1 MiB); the measurer paused at `go_on` with the older, smaller
/// measurement goes on, must succeed, and must leave the real size as it
/// was.
fn late_measurement_keeps_the_real_size(env: &Env, image: &str, late: Bg, go_on: PathBuf) {
    let real = env.image(image).unwrap()["size_bytes"].as_u64().unwrap();
    assert!(real >= MIB);
    fs::remove_file(go_on).unwrap();
    let out = late.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.image(image).unwrap()["size_bytes"].as_u64(), Some(real));
}

#[test]
fn gc_does_not_overwrite_a_finished_writers_size() {
    let env = Env::new();
    // A writer at work on a new image (its size unknown until it ends).
    let writer = env.start_sh(&["--write", "new"], |started| {
        format!(
            "touch '{s}'; i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done; \
             head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
            s = started.display(),
            r = env.sentinel("release").display()
        )
    });
    // gc measures the image while it is still empty, and stops there.
    let (gc, go_on) = env.paused(["gc"], "gc-measured");
    // The writer finishes and records its real size.
    env.release("release");
    let out = writer.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    // gc goes on: its stale measurement must not replace the real size.
    late_measurement_keeps_the_real_size(&env, "new", gc, go_on);
}

#[test]
fn images_does_not_overwrite_a_rewriters_size() {
    let env = Env::new();
    env.make_image("app");
    let conn = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    conn.execute("UPDATE images SET size_bytes = NULL", [])
        .unwrap();
    // `images` measures the small image, and stops before recording it.
    let (lister, go_on) = env.paused(["images", "--json"], "images-measured");
    env.build(
        "app",
        "head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
    );
    late_measurement_keeps_the_real_size(&env, "app", lister, go_on);
}

#[test]
fn an_incomplete_image_has_a_size() {
    let env = Env::new();
    let writer = env.start_sh(&["--write", "half"], |started| {
        format!(
            "head -c 262144 /dev/urandom > \"$STOWAGE_IMAGE_DIR/part\"; touch '{}'; sleep 60",
            started.display()
        )
    });
    writer.kill_all();
    let img = env.image("half").unwrap();
    assert_eq!(img["state"], "incomplete", "{img}");
    assert!(
        img["size_bytes"].as_u64().is_some_and(|s| s >= 262_144),
        "{img}"
    );
    let table = String::from_utf8_lossy(&env.ok(["images"]).stdout).into_owned();
    let row = table.lines().find(|l| l.starts_with("half")).unwrap();
    assert!(!row.contains(" ? "), "{row}");
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

// --- a full filesystem -------------------------------------------------------

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
    let before = fs::read(env.root.join("stowage.db")).unwrap();
    assert_eq!(env.state("killed").as_deref(), Some("incomplete"));
    env.status_json(["--all"]);
    env.ok(["lock-status"]);
    env.ok(["gc", "--dry-run"]);
    // doctor reports (the stale record it could not drop is a problem
    // until --repair can run), it does not fail.
    let out = env.run(["doctor"]);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("intact") && stderr(&out).is_empty(),
        "{}",
        show(&out)
    );
    assert!(fs::read(env.root.join("stowage.db")).unwrap() == before);
    fs::remove_file(&filler).unwrap();
    env.ok(["gc"]);
    assert!(env.image("killed").is_none());
    assert!(
        env.root.join("reserve").exists(),
        "gc recreates the reserve"
    );
}

// --- lock-status snapshots -------------------------------------------------

#[test]
fn lock_status_never_shows_a_lock_held_two_ways_at_once() {
    let env = Env::new();
    env.make_image("app");
    // Many short transactions: the global lock changes hands constantly.
    let stop = env.sentinel("stop");
    let churn: Vec<Bg> = (0..3)
        .map(|_| {
            let script = format!(
                "i=0; while [ ! -e '{s}' ] && [ $i -lt 3000 ]; do '{b}' --root '{r}' exec --read app -- true; i=$((i+1)); done",
                s = stop.display(),
                b = bin(),
                r = env.root.display()
            );
            let mut c = Command::new("sh");
            c.args(["-c", &script]);
            Bg::from_command(c)
        })
        .collect();
    let mut held_twice = Vec::new();
    for _ in 0..300 {
        let st = env.status_json(["app"]);
        for l in st["locks"].as_array().unwrap() {
            let holders = l["holders"].as_array().unwrap();
            let exclusive = holders.iter().filter(|h| h["mode"] == "exclusive").count();
            if exclusive > 1 || (exclusive == 1 && holders.len() > 1) {
                held_twice.push(l.clone());
            }
        }
    }
    fs::write(&stop, "").unwrap();
    for c in churn {
        let out = c.finish();
        assert!(out.status.success(), "{}", show(&out));
    }
    assert!(held_twice.is_empty(), "{held_twice:#?}");
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
