//! `stowage gc`: least recently used images removed until a budget fits,
//! incomplete and unused ones, never a locked one; removals others
//! interrupted are finished; the bytes freed are counted as the filesystem
//! counts them (shared extents once); the trash is emptied without following
//! links.

use std::fs;
use std::os::unix::fs::symlink;
use std::process::Command;
use std::time::Duration;

use crate::common::*;

/// Four 1 MiB images used in the order a, b, c, d (a least recently), with
/// the clock faked instead of sleeping.
fn lru_store() -> Env {
    let env = Env::new();
    for (i, name) in ["a", "b", "c", "d"].iter().enumerate() {
        let mut c = env.cmd([
            "exec",
            "--write",
            name,
            "--",
            "sh",
            "-c",
            "head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
        ]);
        let when = format!("2026-01-0{}T00:00:00Z", i + 1);
        c.env("STOWAGE_NOW", &when);
        assert_eq!(output(c).status.code(), Some(0));
        env.date_lock_file(name, &when);
    }
    env
}

fn gc_json(env: &Env, args: &[&str], now: &str) -> serde_json::Value {
    let mut c = env.cmd(["gc", "--json"]);
    c.args(args).env("STOWAGE_NOW", now);
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn removed(report: &serde_json::Value) -> Vec<String> {
    report["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn gc_dry_run_changes_nothing() {
    let env = lru_store();
    env.run(["exec", "--write", "broken", "--", "false"]);
    let listing = env.images_json();
    let files = tree(&env.root);
    let db = fs::read(env.root.join("stowage.db")).unwrap();
    let report = gc_json(
        &env,
        &["--dry-run", "--max-size", "2M", "--unused-for", "1d"],
        "2026-01-04T12:00:00Z",
    );
    assert_eq!(report["dry_run"], true);
    assert_eq!(removed(&report), ["broken", "a", "b", "c"]);
    assert_eq!(tree(&env.root), files, "no file touched");
    assert_eq!(
        fs::read(env.root.join("stowage.db")).unwrap(),
        db,
        "no metadata changed"
    );
    assert_eq!(env.images_json(), listing);
}

#[test]
fn gc_removes_least_recently_used_until_the_budget_fits() {
    let env = lru_store();
    // What `df` gets back: the images' blocks, and their lock files'.
    let locks: u64 = ["a", "b"].map(|n| lock_file_blocks(&env, n)).iter().sum();
    let report = gc_json(&env, &["--max-size", "2.5M"], "2026-02-01T00:00:00Z");
    assert_eq!(removed(&report), ["a", "b"], "oldest first");
    assert!(report["size_after"].as_u64().unwrap() <= 5 << 19);
    assert_eq!(
        report["bytes_freed"].as_u64().unwrap(),
        report["size_before"].as_u64().unwrap() - report["size_after"].as_u64().unwrap() + locks
    );
    assert!(report["removed"][0]["size_bytes"].as_u64().unwrap() >= 1 << 20);
    assert_eq!(env.state("c").as_deref(), Some("ready"));
    assert_eq!(env.state("a"), None);
    assert!(!env.root.join("img/a").exists());
}

/// A build that hard-linked a file of the image it read: two images name one
/// inode. Sizes measured image by image count it twice; the budget counts it
/// once, so a store that fits loses nothing, and one that does not is told
/// what each removal really frees.
#[test]
fn a_file_hard_linked_into_two_images_counts_once_against_the_budget() {
    let env = Env::new();
    env.build(
        "a",
        "head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/big\"",
    );
    let out = env.ok([
        "exec",
        "--read",
        "a",
        "--write",
        "b",
        "--",
        "sh",
        "-c",
        "ln \"$STOWAGE_IMAGES_DIR/a/big\" \"$STOWAGE_IMAGE_DIR/big\"",
    ]);
    assert!(env.root.join("img/b/big").exists(), "{}", show(&out));
    // Each image measured alone is over 1 MiB; together they take about 1 MiB.
    env.images_json();
    let report = gc_json(&env, &["--max-size", "1536K"], "2026-02-01T00:00:00Z");
    assert!(removed(&report).is_empty(), "{report}");
    assert!(
        report["size_before"].as_u64().unwrap() < 1536 << 10,
        "{report}"
    );
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    assert_eq!(env.state("b").as_deref(), Some("ready"));
    let report = gc_json(&env, &["--max-size", "512K"], "2026-02-01T00:00:00Z");
    assert_eq!(removed(&report), ["a", "b"], "{report}");
    let freed = report["bytes_freed"].as_u64().unwrap();
    assert!(freed < 1536 << 10, "the shared file freed twice: {report}");
}

/// A file a build hard-linked into its image from outside the store stays
/// allocated when the image goes: gc does not count it in what the images
/// take, nor as freed, whatever the reason of the removal, and `rm` does
/// not either. gc removed such an image for a 1 MiB budget, saying it
/// freed 4 MiB, and df got back a few KiB.
#[test]
fn a_file_hard_linked_from_outside_the_store_is_not_counted_as_freed() {
    let env = Env::new();
    let outside = env.scratch.join("outside");
    fs::write(&outside, vec![7u8; 4 << 20]).unwrap();
    let ln = format!(
        "ln '{}' \"$STOWAGE_IMAGE_DIR/big\" && head -c 65536 /dev/urandom > \"$STOWAGE_IMAGE_DIR/own\"",
        outside.display()
    );
    env.build("a", &ln);
    env.images_json();
    let report = gc_json(&env, &["--max-size", "1M"], "2026-02-01T00:00:00Z");
    assert!(removed(&report).is_empty(), "{report}");
    assert!(report["size_before"].as_u64().unwrap() < MIB, "{report}");
    // Unused, it goes: what it frees is its own file.
    let later = (std::time::SystemTime::now() + Duration::from_secs(30 * 86400))
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let report = gc_json(&env, &["--unused-for", "7d"], &later.to_string());
    assert_eq!(removed(&report), ["a"], "{report}");
    assert!(report["bytes_freed"].as_u64().unwrap() < MIB, "{report}");
    // And so does rm.
    env.build("b", &ln);
    let out = env.ok(["rm", "b"]);
    assert!(
        stderr(&out).contains("removed 'b' (ready, "),
        "{}",
        show(&out)
    );
    assert!(stderr(&out).contains(" KiB)"), "{}", show(&out));
    assert_eq!(fs::read(&outside).unwrap().len(), 4 << 20);
}

#[test]
fn gc_never_touches_a_locked_image_even_the_oldest() {
    let env = lru_store();
    // The reader's use of 'a' is dated before the others', so 'a' stays
    // the least recently used.
    let reader = env.hold_with(&["--read", "a"], "started", |c| {
        c.env("STOWAGE_NOW", "2026-01-01T00:00:00Z");
    });
    let report = gc_json(&env, &["--max-size", "2.5M"], "2026-02-01T00:00:00Z");
    assert_eq!(
        removed(&report),
        ["b", "c"],
        "a is in use; the next oldest go instead"
    );
    assert_eq!(report["busy"], serde_json::json!(["a"]));
    assert!(
        report["size_after"].as_u64().unwrap() <= 5 << 19,
        "budget met: {report}"
    );
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    env.release("release");
    reader.finish();
}

#[test]
fn gc_reports_images_held_for_writing_or_creating_as_kept_in_use() {
    let env = lru_store();
    let writer = env.hold_until(&["--write", "a"], "writing", "release");
    let creator = env.hold_until(&["--write", "new"], "creating", "release");
    let report = gc_json(&env, &["--max-size", "0"], "2026-02-01T00:00:00Z");
    assert_eq!(removed(&report), ["b", "c", "d"], "{report}");
    // Why the budget still does not fit: the images gc may not touch are said.
    let busy = report["busy"].as_array().unwrap();
    for name in ["a", "new"] {
        assert!(busy.contains(&serde_json::json!(name)), "{name}: {report}");
    }
    let text = stdout(&env.ok(["gc", "--dry-run", "--max-size", "0"]));
    assert!(text.contains("kept 'a': in use"), "{text}");
    assert!(text.contains("kept 'new': in use"), "{text}");
    env.release("release");
    writer.finish();
    creator.finish();
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}

#[test]
fn gc_removes_incomplete_and_unused_images() {
    let env = lru_store();
    env.run(["exec", "--write", "broken", "--", "false"]);
    // A writer that died: found and removed too.
    let bg = env.hold(&["--write", "dead"], "started");
    bg.kill_all();
    // "Now" is Jan 10: a..d were last used Jan 1..4.
    let report = gc_json(&env, &["--unused-for", "7d"], "2026-01-10T00:00:00Z");
    let gone = removed(&report);
    assert!(
        gone.contains(&"broken".to_owned()) && gone.contains(&"dead".to_owned()),
        "{report}"
    );
    assert!(
        gone.contains(&"a".to_owned()) && gone.contains(&"b".to_owned()),
        "{report}"
    );
    assert!(
        !gone.contains(&"c".to_owned()) && !gone.contains(&"d".to_owned()),
        "{report}"
    );
    let reasons: Vec<&str> = report["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["reason"].as_str().unwrap())
        .collect();
    assert!(
        reasons.contains(&"incomplete") && reasons.contains(&"unused"),
        "{report}"
    );
    // In words, the reason says why ("(incomplete, 0 B): incomplete" said nothing).
    env.run(["exec", "--write", "failed", "--", "false"]);
    let out = env.ok(["gc", "--dry-run"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("would remove 'failed' (incomplete, 0 B): its writer failed or died"),
        "{text}"
    );
    // -q silences stderr's progress, never the report on stdout (as doctor's).
    let out = env.ok(["-q", "gc"]);
    assert!(
        stdout(&out).contains("removed 'failed'") && out.stderr.is_empty(),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("failed"), None);
}

#[test]
fn an_unused_for_longer_than_history_removes_nothing() {
    let env = lru_store();
    let report = gc_json(
        &env,
        &["--unused-for", "3650d", "--dry-run"],
        "2026-02-01T00:00:00Z",
    );
    assert!(removed(&report).is_empty(), "{report}");
}

/// One size grammar: a unit of K M G T P E (powers of 1024) in any case,
/// with `B` or `iB` optional after it, or `B` for bytes, counted exactly;
/// `iB` alone is no unit, and a size past 64 bits is refused (64).
#[test]
fn max_size_takes_units_in_any_case_and_exact_byte_counts() {
    let env = Env::new();
    env.make_image("kept");
    for size in [
        "5b",
        "5kb",
        "5KiB",
        "5 m",
        "1.5T",
        "2e",
        "18446744073709551615B",
    ] {
        let out = env.run(["gc", "--dry-run", "--json", "--max-size", size]);
        assert_eq!(code(&out), Some(0), "{size}: {}", show(&out));
    }
    for (size, why) in [
        ("5iB", "not a size"),
        ("5kbb", "not a size"),
        ("18446744073709551616B", "too large"),
        ("16E", "too large"),
    ] {
        let out = env.run(["gc", "--max-size", size]);
        assert_eq!(code(&out), Some(64), "{size}: {}", show(&out));
        assert!(stderr(&out).contains(why), "{size}: {}", show(&out));
    }
    assert_eq!(env.state("kept").as_deref(), Some("ready"));
}

#[test]
fn gc_bad_arguments_exit_64() {
    let env = Env::new();
    for args in [
        vec!["gc", "--max-size", "lots"],
        vec!["gc", "--max-size", "-1G"],
        vec!["gc", "--unused-for", "soon"],
        vec!["gc", "--unused-for", "-3d"],
        vec!["gc", "--max-size", "1.5"],
    ] {
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", show(&out));
    }
    // A size without its unit is not taken for bytes: a forgotten G would
    // empty the store (it was a budget of 20 bytes).
    env.make_image("kept");
    let out = env.run(["gc", "--max-size", "20"]);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(
        stderr(&out).contains("give a unit (e.g. 20G"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("kept").as_deref(), Some("ready"));
}

/// `--unused-for 500ms` was taken as 0 seconds (every unused image); `7` is no number of days.
/// What gc cannot count, or a number without a unit, is refused, and nothing is removed.
#[test]
fn an_unused_for_below_a_second_or_without_a_unit_is_refused_not_rounded() {
    let env = Env::new();
    env.make_image("kept");
    for (value, says) in [
        ("500ms", "'500ms': not a whole number of seconds"),
        ("1.5s", "'1.5s': not a whole number of seconds"),
        ("7", "'7': give a unit (e.g. 7d for days"),
    ] {
        let out = env.run(["gc", "--unused-for", value, "--json"]);
        assert_eq!(code(&out), Some(64), "{value}: {}", show(&out));
        assert!(stderr(&out).contains(says), "{value}: {}", show(&out));
        assert!(out.stdout.is_empty(), "{value}: {}", show(&out));
    }
    assert_eq!(env.state("kept").as_deref(), Some("ready"));
    // Whole seconds in any unit are counted exactly.
    let out = env.ok(["gc", "--unused-for", "1.5m", "--dry-run", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["unused_for_seconds"], 90, "{report}");
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

/// On btrfs, linked files count once and as shared: a file with two names
/// in a base cloned by `--from` (reflinked, its copy two names too), whose
/// blocks are extents both images share; and a file a build hard-linked
/// into a second image. A budget the images fit removes nothing (the base
/// went when linked files were counted whole), and `images` says each
/// image shares all it has (it said 0 shared, 0 exclusive for the link).
#[test]
fn linked_files_count_once_and_as_shared_on_btrfs() {
    let Some(mnt) = Mount::btrfs_loop("600M") else {
        return;
    };
    let env = mnt.env();
    env.build(
        "base",
        "head -c 67108864 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\" && \
         ln \"$STOWAGE_IMAGE_DIR/blob\" \"$STOWAGE_IMAGE_DIR/again\"",
    );
    env.ok(["exec", "--write", "c1", "--from", "base", "--", "true"]);
    // And a file no clone shares, hard-linked by a build into a second image.
    env.build(
        "solo",
        "head -c 16777216 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
    );
    let ln = "ln \"$STOWAGE_IMAGES_DIR/solo/blob\" \"$STOWAGE_IMAGE_DIR/blob\"";
    env.ok([
        "exec", "--read", "solo", "--write", "l1", "--", "sh", "-c", ln,
    ]);
    let report = gc_json(&env, &["--max-size", "100M"], "2026-02-01T00:00:00Z");
    assert!(
        removed(&report).is_empty(),
        "gc removed images that fit: {report}"
    );
    let taken = report["size_before"].as_u64().unwrap();
    assert!((80 * MIB..96 * MIB).contains(&taken), "{report}");
    // Each shares all it has, and frees nothing alone.
    for img in env.images_json() {
        let (size, shared) = (img["size_bytes"].as_u64(), img["shared_bytes"].as_u64());
        assert!(shared.unwrap() + MIB > size.unwrap(), "{img}");
        assert!(img["exclusive_bytes"].as_u64().unwrap() < MIB, "{img}");
    }
}

/// On btrfs, a clone that rewrote its whole file a moment ago shares
/// nothing with its base, though its data is not yet written back: gc's
/// budget and `images` read extent maps after it is. Read before, btrfs
/// mapped the rewrite to the base's extents: the two images "fit" a 60 MiB
/// budget until the next sync, and the clone's `exclusive_bytes` was 0.
#[test]
fn a_rewrite_not_yet_written_back_shares_nothing_on_btrfs() {
    let Some(mnt) = Mount::btrfs_loop("400M") else {
        return;
    };
    let env = mnt.env();
    env.build(
        "base",
        "head -c 41943040 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
    );
    mnt.used();
    let rewrite = "head -c 41943040 /dev/urandom | dd of=\"$STOWAGE_IMAGE_DIR/blob\" bs=1M conv=notrunc 2>/dev/null";
    let clone = |name| {
        env.ok([
            "exec", "--write", name, "--from", "base", "--", "sh", "-c", rewrite,
        ])
    };
    clone("c1");
    let report = gc_json(
        &env,
        &["--max-size", "60M", "--dry-run"],
        "2026-02-01T00:00:00Z",
    );
    assert!(
        report["size_before"].as_u64().unwrap() >= 78 * MIB,
        "{report}"
    );
    assert_eq!(removed(&report), ["base"], "{report}");
    clone("c2");
    let images = env.images_json();
    let row = |name: &str| images.iter().find(|i| i["name"] == name).unwrap();
    assert!(
        row("c2")["exclusive_bytes"].as_u64().unwrap() >= 39 * MIB,
        "{images:?}"
    );
    assert!(
        row("base")["shared_bytes"].as_u64().unwrap() < MIB,
        "{images:?}"
    );
}

/// On btrfs, what gc says it freed removing reflinked clones is what df
/// gets back, whatever the reason: an incomplete clone frees almost
/// nothing (gc said 60 MiB), and a base with its clone, unused, one copy
/// (gc said two). Only the budget counted shared extents before.
#[test]
fn incomplete_and_unused_clones_free_what_df_gets_back_on_btrfs() {
    let Some(mnt) = Mount::btrfs_loop("400M") else {
        return;
    };
    let env = mnt.env();
    env.build(
        "big",
        "head -c 62914560 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
    );
    env.ok(["exec", "--write", "clone-ok", "--from", "big", "--", "true"]);
    let out = env.run([
        "exec",
        "--write",
        "clone-failed",
        "--from",
        "big",
        "--",
        "false",
    ]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let freed = |args: &[&str], now: &str, gone: &[&str]| {
        let before = mnt.used();
        let report = gc_json(&env, args, now);
        let got_back = before.saturating_sub(mnt.used());
        assert_eq!(removed(&report), gone, "{report}");
        let freed = report["bytes_freed"].as_u64().unwrap();
        assert!(
            freed.abs_diff(got_back) < 4 * MIB,
            "gc says it freed {freed}, df got back {got_back}: {report}"
        );
        freed
    };
    assert!(freed(&[], "2026-02-01T00:00:00Z", &["clone-failed"]) < MIB);
    let later = (std::time::SystemTime::now() + Duration::from_secs(30 * 86400))
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        .to_string();
    let both = freed(&["--unused-for", "7d"], &later, &["big", "clone-ok"]);
    assert!(both >= 59 * MIB, "{both}");
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

/// A dry run takes no image's lock: while it judges an image, a command that does not wait takes
/// it, and a real gc removes it.
#[test]
fn a_dry_run_takes_no_image_lock() {
    let env = Env::new();
    env.make_image("old");
    let (dry, pause) = env.paused(["gc", "--dry-run", "--max-size", "0"], "gc-judged");
    env.ok(["exec", "--no-wait", "--read", "old", "--", "true"]);
    let out = env.ok(["gc", "--max-size", "0", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["removed"][0]["name"], "old", "{}", show(&out));
    fs::remove_file(pause).unwrap();
    let out = dry.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(stdout(&out).contains("old"), "{}", show(&out));
}

/// Where nothing was measured together, gc's figure adds up the sizes recorded image by image, a
/// file linked into two images counted in each, and says it is at most that; measured together,
/// each file counts once. It said "images would use 8.0 MiB" of 4 MiB, as if measured.
#[test]
fn sizes_added_up_as_recorded_are_said_to_be_at_most_that() {
    let env = Env::new();
    env.build(
        "base",
        "head -c 4194304 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
    );
    let link = "ln \"$STOWAGE_IMAGES_DIR/base/blob\" \"$STOWAGE_IMAGE_DIR/blob\"";
    env.ok([
        "exec", "--read", "base", "--write", "app", "--", "sh", "-c", link,
    ]);
    env.ok(["images"]);
    let gc = |args: &[&str]| {
        let out = env.ok(["gc", "--dry-run"].iter().chain(args));
        let text = stdout(&env.ok(["gc", "--dry-run"].iter().chain(args).chain(&["--json"])));
        let report: serde_json::Value = serde_json::from_str(&text).unwrap();
        (stdout(&out), report)
    };
    const MIB: u64 = 1 << 20;
    // Where extents may be shared, every image is measured together whatever the options.
    let (text, report) = gc(&[]);
    if report["sizes_as_recorded"] == true {
        assert!(
            report["size_before"].as_u64().unwrap() >= 8 * MIB,
            "{report}"
        );
        assert!(text.contains("images would use at most 8."), "{text}");
    } else {
        assert!(
            report["size_before"].as_u64().unwrap() < 5 * MIB,
            "{report}"
        );
    }
    let (text, report) = gc(&["--max-size", "5M"]);
    assert_eq!(report["sizes_as_recorded"], false, "{report}");
    assert!(
        report["size_before"].as_u64().unwrap() < 5 * MIB,
        "{report}"
    );
    assert!(!text.contains("at most"), "{text}");
}

/// An image a command waiting for its slot, or for an image before it in the lock order, will
/// take is in use: gc keeps it however long unused, and the command runs on it. gc removed it and
/// the command, let in, exited 66.
#[test]
fn an_image_a_waiting_command_will_take_is_kept() {
    let env = Env::new();
    env.ok(["slots", "set", "build", "1"]);
    env.make_image_used_long_ago("zbase");
    env.make_image_used_long_ago("yold");
    let slot = env.hold_until(&["--slot", "build"], "slot", "slot-go");
    let image = env.hold_until(&["--write", "abusy"], "image", "image-go");
    let by_slot = env.spawn(["exec", "--slot", "build", "--read", "zbase", "--", "true"]);
    let by_image = env.spawn(["exec", "--write", "abusy", "--read", "yold", "--", "true"]);
    env.wait_for_slot_waiters("build", 1);
    env.wait_for_waiter("abusy");
    let out = env.ok(["gc", "--unused-for", "1d", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["removed"], serde_json::json!([]), "{report}");
    env.release("slot-go");
    env.release("image-go");
    for bg in [slot, image, by_slot, by_image] {
        let out = bg.finish();
        assert_eq!(code(&out), Some(0), "{}", show(&out));
    }
}

/// On a local filesystem a dry run asks the kernel's lock table whether each image is held: it
/// flocks no image's lock file even for a moment (its try of each, let go at once, made a real gc
/// beside it keep an image as in use and remove a later one instead).
#[test]
fn a_dry_run_flocks_no_image_lock_file_locally() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    for name in ["a", "b", "c"] {
        env.make_image(name);
    }
    env.ok(["images"]);
    let log = env.sentinel("strace");
    let mut c = Command::new("strace");
    c.args(["-f", "-y", "-qq", "-e", "trace=flock", "-o"]);
    c.arg(&log).arg(bin());
    c.args(["--root", env.root.to_str().unwrap()]);
    c.args(["gc", "--dry-run", "--max-size", "0"]);
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(stdout(&out).contains("would remove 'c'"), "{}", show(&out));
    let traced = fs::read_to_string(&log).unwrap();
    let images = format!("{}/", env.root.join("locks/images").display());
    let flocked: Vec<&str> = traced.lines().filter(|l| l.contains(&images)).collect();
    assert!(flocked.is_empty(), "{flocked:#?}");
}

// --- interrupted removals ---------------------------------------------------

#[test]
fn gc_finishes_an_interrupted_removal() {
    let env = Env::new();
    env.make_image("doomed");
    let (bg, _) = env.paused(["rm", "doomed"], "rm-moved");
    bg.kill_all();
    env.ok(["gc"]);
    assert_eq!(env.state("doomed"), None);
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
}

/// Leftovers in the trash named in any bytes (another member of a group store may put one there)
/// are deleted by gc and `doctor --repair`: a name cut at a byte inside a character made both panic
/// (exit 101) before anything was removed, every run after too.
#[test]
fn trash_leftovers_with_names_in_any_bytes_are_deleted() {
    use std::os::unix::ffi::OsStrExt;
    let env = Env::new();
    env.make_image("a");
    let trash = env.root.join("trash");
    fs::create_dir_all(&trash).unwrap();
    let accented = "a\u{e9}".repeat(40);
    let names: [&[u8]; 3] = [accented.as_bytes(), b"b\xff", &[0xff; 200]];
    for args in [["gc"].as_slice(), ["doctor", "--repair"].as_slice()] {
        for name in names {
            fs::create_dir(trash.join(std::ffi::OsStr::from_bytes(name))).unwrap();
        }
        let out = env.run(args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
        assert_eq!(fs::read_dir(&trash).unwrap().count(), 0, "{args:?}");
    }
}

/// A tree left in the trash (a file in it immutable) is named, each gc, by the path it has then,
/// and keeps its image's name however often gc takes it over: the line named the entry's name
/// before gc renamed it, and each takeover put a new stamp before the old one, cutting the image's
/// name off after about five. The line names the immutable file and how to clear it.
#[test]
fn a_tree_left_in_the_trash_keeps_its_name_and_is_named_where_it_is() {
    if !root_or_skip("chattr +i") || !tool_or_skip("chattr", "e2fsprogs") {
        return;
    }
    let env = Env::new();
    env.build("stuck", "echo x > \"$STOWAGE_IMAGE_DIR/f\"");
    let file = env.root.join("img/stuck/f");
    if !immutable(&file, true) {
        eprintln!("skipping: chattr +i is not supported here");
        return;
    }
    let out = env.run(["rm", "stuck"]);
    let trash = env.root.join("trash");
    let entries = || -> Vec<String> {
        let names = fs::read_dir(&trash)
            .unwrap()
            .map(|e| e.unwrap().file_name());
        names.map(|n| n.to_string_lossy().into_owned()).collect()
    };
    let mut left = Vec::new();
    for _ in 0..7 {
        let out = env.run(["gc", "--json"]);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        left.push((report["failed"].to_string(), entries()));
    }
    let entry = trash.join(entries().first().cloned().unwrap_or_default());
    assert!(immutable(&entry.join("f"), false), "{}", show(&out));
    env.ok(["gc"]);
    assert!(entries().is_empty());
    for (failed, now) in left {
        assert_eq!(now.len(), 1, "{now:?}");
        assert!(now[0].ends_with(".stuck"), "{now:?}");
        let named = trash.join(&now[0]).display().to_string();
        assert!(failed.contains(&named), "{failed} does not name {named}");
        assert!(
            failed.contains("\\\"f\\\" in it") && failed.contains("chattr -i"),
            "{failed}"
        );
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
        for dry in [true, false] {
            let mut c = env.cmd(["gc", "--json"]);
            c.args(dry.then_some("--dry-run"));
            let out = output(c);
            assert_eq!(code(&out), Some(0), "{}", show(&out));
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let freed = report["bytes_freed"].as_u64().unwrap();
            assert!(
                (1 << 20..2 << 20).contains(&freed),
                "{point}, dry run {dry}: freed {freed}: {}",
                show(&out)
            );
        }
        assert!(env.images_json().is_empty(), "{point}");
        assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
    }
}

/// A filesystem out of inodes (a build made files until none was left) still lets gc run and free
/// them: the locks gc needs are made with the layout, not first when needed (gc failed: no inode
/// to make its lock in).
#[test]
fn gc_runs_on_a_filesystem_out_of_inodes() {
    let Some(mnt) = Mount::tmpfs("size=16m,nr_inodes=300") else {
        return;
    };
    let env = mnt.env();
    env.make_image("a");
    let fill = "i=0; while (echo >\"$STOWAGE_IMAGE_DIR/f$i\") 2>/dev/null; do i=$((i+1)); done";
    env.build("fill", fill);
    // What the build's end gave back (its lease, the catalog's journal) is taken too.
    let img = env.root.join("img/fill");
    let more = (0..).take_while(|i| fs::write(img.join(format!("g{i}")), "g").is_ok());
    assert!(more.count() < 100);
    let probe = mnt.dir.join("probe");
    assert!(fs::write(&probe, "").is_err(), "inodes are left");
    let out = env.run(["gc", "--max-size", "0"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(env.images_json().is_empty(), "{}", show(&out));
    fs::write(&probe, "").unwrap();
}

/// What gc says it freed finishing removals a crash cut short is what `df` gets back, their lock
/// files included (it left them out), and its dry run says the same.
#[test]
fn the_bytes_freed_finishing_killed_removals_are_what_df_gets_back() {
    let Some(mnt) = Mount::tmpfs("size=64m") else {
        return;
    };
    let env = mnt.env();
    for (name, point) in [("marked", "rm-marked"), ("moved", "rm-moved")] {
        env.build(
            name,
            "head -c 65536 /dev/urandom > \"$STOWAGE_IMAGE_DIR/data\"",
        );
        let (bg, _pause) = env.paused(["rm", name], point);
        bg.kill_all();
    }
    env.ok(["images"]);
    let before = mnt.used();
    let freed = |dry: bool| {
        let mut c = env.cmd(["gc", "--json"]);
        c.args(dry.then_some("--dry-run"));
        let out = output(c);
        assert_eq!(code(&out), Some(0), "{}", show(&out));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        report["bytes_freed"].as_u64().unwrap()
    };
    let (would, freed) = (freed(true), freed(false));
    let got_back = before.saturating_sub(mnt.used());
    assert_eq!(
        freed, got_back,
        "gc says it freed {freed}, df got back {got_back}"
    );
    assert_eq!(would, freed, "the dry run said {would}");
}

/// A removal killed once marked, finished by gc where the images directory
/// is on another filesystem than the root: its tree is deleted in place,
/// never passing through the trash, and its bytes count as freed all the
/// same. gc said it freed 0 B.
#[test]
fn gc_counts_the_bytes_of_a_killed_removal_it_deletes_in_place() {
    let env = Env::new();
    let Some(_tmpfs) = env.init_on_tmpfs() else {
        return;
    };
    env.build(
        "big",
        "head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/data\"",
    );
    let (bg, _pause) = env.paused(["rm", "big"], "rm-marked");
    bg.kill_all();
    let tree = env.tmp.path().join("images/big");
    assert!(tree.is_dir());
    let out = env.ok(["gc", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["interrupted_removals"], serde_json::json!(["big"]));
    let freed = report["bytes_freed"].as_u64().unwrap();
    assert!((1 << 20..2 << 20).contains(&freed), "{report}");
    assert!(!tree.exists(), "{report}");
}

/// An interrupted removal gc could not finish is not reported as finished:
/// it stays `deleting`, and the failure names it. gc listed it among the
/// removals it finished ("removed 'doomed' (an interrupted removal)").
#[test]
fn gc_reports_an_interrupted_removal_it_could_not_finish_as_failed_only() {
    let env = Env::new();
    env.make_image("doomed");
    let (rm, _pause) = env.paused(["rm", "doomed"], "rm-marked");
    rm.kill_all();
    // The images directory turned into a symlink: no tree is taken out through it.
    let img = env.root.join("img");
    fs::rename(&img, env.root.join("img.real")).unwrap();
    symlink("img.real", &img).unwrap();

    let out = env.run(["gc", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["interrupted_removals"],
        serde_json::json!([]),
        "{report}"
    );
    assert!(
        report["failed"].to_string().contains("'doomed'"),
        "{report}"
    );
    let out = env.run(["gc"]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("removed"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("doomed").as_deref(), Some("deleting"));
}

/// gc lists an image as `deleting` while its remover is merely slow; the
/// remover then finishes. gc must not take the finished removal for a crash:
/// no error, and no lock file left for an image that no longer exists.
#[test]
fn gc_does_not_redo_a_removal_that_finished_after_it_looked() {
    let env = Env::new();
    env.make_image("doomed");
    let (rm, rm_paused) = env.paused(["rm", "doomed"], "rm-marked");
    assert_eq!(env.state("doomed").as_deref(), Some("deleting"));

    let (gc, gc_paused) = env.paused(["gc"], "interrupted-listed");

    // The remover goes on and finishes while gc holds its stale list.
    fs::remove_file(&rm_paused).unwrap();
    let out = rm.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("doomed"), None);

    fs::remove_file(&gc_paused).unwrap();
    let out = gc.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        !env.lock_file("doomed").exists(),
        "no lock file for a removed image"
    );
    env.ok(["doctor"]);
}

/// An image gc chose is removed by someone else before gc locks it: gc
/// skips it and leaves no lock file behind for the image that is gone.
#[test]
fn gc_skips_an_image_removed_after_it_chose_it() {
    let env = Env::new();
    let out = env.run(["exec", "--write", "broken", "--", "false"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(env.state("broken").as_deref(), Some("incomplete"));

    let (gc, paused) = env.paused(["gc", "--json"], "gc-listed");
    env.ok(["rm", "broken"]);
    assert!(!env.lock_file("broken").exists());

    fs::remove_file(&paused).unwrap();
    let out = gc.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(removed(&report), Vec::<String>::new(), "{report}");
    assert!(
        !env.lock_file("broken").exists(),
        "no lock file for a removed image"
    );
    env.ok(["doctor"]);
}

/// What image `name`'s lock file takes on the filesystem.
fn lock_file_blocks(env: &Env, name: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(env.lock_file(name)).unwrap().blocks() * 512
}

/// The gc lock's entry in lock-status, if it shows one.
fn gc_lock_entry(env: &Env) -> Option<serde_json::Value> {
    let st = env.status_json(Vec::<&str>::new());
    let locks = st["locks"].as_array().unwrap();
    locks.iter().find(|l| l["name"] == "gc").cloned()
}

/// Two gc at once (the same hourly job on two nodes): one removes while the
/// other waits for it, shown in lock-status and told on stderr, then finds
/// the store fits. Before, each removed down to the budget, counting the
/// other's victims as staying: the store emptied.
#[test]
fn two_gcs_at_once_remove_only_down_to_the_budget() {
    let env = lru_store();
    let (first, go) = env.paused(["gc", "--json", "--max-size", "2.5M"], "gc-listed");
    let second = env.spawn(["gc", "--json", "--max-size", "2.5M"]);
    wait_until("the second gc waits for the first, or ends", || {
        !alive(second.pid())
            || gc_lock_entry(&env).is_some_and(|e| e["waiters"] != serde_json::json!([]))
    });
    let entry = gc_lock_entry(&env).expect("the gc lock is shown while a gc waits for it");
    assert_eq!(entry["holders"][0]["pid"], first.pid(), "{entry}");
    assert_eq!(entry["waiters"][0]["pid"], second.pid(), "{entry}");

    fs::remove_file(&go).unwrap();
    let pid = first.pid();
    let (one, two) = (first.finish(), second.finish());
    assert_eq!(code(&one), Some(0), "{}", show(&one));
    assert_eq!(code(&two), Some(0), "{}", show(&two));
    let said = stderr(&two);
    let wait = format!("waiting for the gc lock (another gc removes images): held by pid {pid}");
    assert!(said.contains(&wait), "{said}");
    let reports: Vec<serde_json::Value> = [&one, &two]
        .map(|o| serde_json::from_slice(&o.stdout).unwrap())
        .into();
    assert_eq!(removed(&reports[0]), ["a", "b"], "{}", reports[0]);
    assert_eq!(removed(&reports[1]), Vec::<String>::new(), "{}", reports[1]);
    assert_eq!(env.state("c").as_deref(), Some("ready"));
    assert_eq!(env.state("d").as_deref(), Some("ready"));
    assert!(gc_lock_entry(&env).is_none());
}

/// A gc granted the gc lock lists it as awaited until it rewrites its
/// lease: paused there, lock-status lists it once, as the gc lock's holder,
/// never also as its waiter. Before, it was listed both ways.
#[test]
fn a_gc_granted_the_gc_lock_is_listed_once_as_its_holder() {
    let env = lru_store();
    let (first, go) = env.paused(["gc", "--json", "--max-size", "2.5M"], "gc-listed");
    let granted = env.sentinel("paused.lock-granted");
    let mut c = env.cmd(["gc", "--json", "--max-size", "2.5M"]);
    c.env(
        stowage::env::DEBUG_PAUSE,
        format!("lock-granted:{}", granted.display()),
    );
    let second = Bg::from_command(c);
    let pid = second.pid();
    env.wait_for_waiting_pid(pid, "second gc");
    fs::remove_file(&go).unwrap();
    assert_eq!(code(&first.finish()), Some(0));
    wait_for_file(&granted);
    let entry = gc_lock_entry(&env).expect("the gc lock is shown while a gc holds it");
    fs::remove_file(&granted).unwrap();
    assert_eq!(code(&second.finish()), Some(0));
    let listed = |what: &str| {
        let parties = entry[what].as_array().unwrap();
        parties.iter().filter(|p| p["pid"] == pid).count()
    };
    assert_eq!((listed("holders"), listed("waiters")), (1, 0), "{entry}");
}

/// An image another process began to remove after gc's survey (its record
/// says `deleting`, its lock held when gc comes to it) counts as gone: gc removes only what is
/// still over the budget. Before, gc counted it as staying and removed the
/// next image too.
#[test]
fn an_image_being_removed_by_another_counts_as_gone_against_the_budget() {
    let env = lru_store();
    let (gc, gc_go) = env.paused(["gc", "--json", "--max-size", "2.5M"], "gc-listed");
    let (rm, rm_go) = env.paused(["rm", "a"], "rm-marked");
    fs::remove_file(&gc_go).unwrap();
    let out = gc.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(removed(&report), ["b"], "{report}");
    fs::remove_file(&rm_go).unwrap();
    assert_eq!(code(&rm.finish()), Some(0));
    assert_eq!(env.state("c").as_deref(), Some("ready"));
    assert_eq!(env.state("a"), None);
}

/// What gc says it freed is what `df` gets back: the removed images' lock
/// files count too. Before, 12 KiB a lock file on tmpfs went unsaid.
#[test]
fn bytes_freed_counts_the_lock_files_that_go() {
    let env = lru_store();
    let locks = lock_file_blocks(&env, "a") + lock_file_blocks(&env, "b");
    assert!(locks > 0, "a lock file takes blocks here");
    let dry = gc_json(
        &env,
        &["--dry-run", "--max-size", "2.5M"],
        "2026-02-01T00:00:00Z",
    );
    let report = gc_json(&env, &["--max-size", "2.5M"], "2026-02-01T00:00:00Z");
    assert_eq!(removed(&report), ["a", "b"]);
    let trees: u64 = (report["removed"].as_array().unwrap().iter())
        .map(|r| r["size_bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(
        report["bytes_freed"].as_u64().unwrap(),
        trees + locks,
        "{report}"
    );
    assert_eq!(dry["bytes_freed"], report["bytes_freed"], "{dry}");
}

/// The size `images --json` shows for image `name`.
fn shown_size(env: &Env, name: &str) -> u64 {
    let rows = env.images_json();
    let row = rows.iter().find(|r| r["name"] == name).unwrap();
    row["size_bytes"].as_u64().unwrap()
}

/// A tree an exclusive read or a store-wide command grew keeps its record,
/// yet its size is measured anew: `images` shows it, and gc's budget counts
/// it. Before, the size kept for the record stood: 1 MiB shown for 11, and
/// a budget of 12 MiB "met" by 19 MiB of images.
#[test]
fn a_tree_grown_by_an_exclusive_read_or_a_store_wide_command_is_measured_anew() {
    let env = lru_store();
    assert!(shown_size(&env, "a") < 2 << 20, "sizes kept");
    let grow = |image: &str, mib: u32| {
        format!("head -c {mib}M /dev/zero >> \"$STOWAGE_IMAGES_DIR/{image}/blob\"")
    };
    env.ok([
        "exec",
        "--read-exclusive",
        "a",
        "--",
        "sh",
        "-c",
        &grow("a", 10),
    ]);
    assert!(shown_size(&env, "a") >= 11 << 20, "{:?}", env.images_json());
    env.ok(["exec", "--store-wide", "--", "sh", "-c", &grow("b", 5)]);
    assert!(shown_size(&env, "b") >= 6 << 20, "{:?}", env.images_json());
    // a, read last, is the most recently used: 11 MiB of it fit, with nothing else.
    let report = gc_json(&env, &["--max-size", "12M"], "2026-02-01T00:00:00Z");
    assert_eq!(removed(&report), ["b", "c", "d"], "{report}");
}

/// `stowage ARGS…` with the clock fixed at `now` (RFC 3339).
fn at(env: &Env, now: &str, args: &[&str]) -> std::process::Output {
    let mut c = env.cmd(args);
    c.env("STOWAGE_NOW", now);
    output(c)
}

fn ok_at(env: &Env, now: &str, args: &[&str]) -> std::process::Output {
    let out = at(env, now, args);
    assert_eq!(out.status.code(), Some(0), "stowage failed: {}", show(&out));
    out
}

/// A read within a few minutes of the recorded last use records nothing
/// (its image's last use is fresh enough): gc --unused-for shorter than
/// that must still not take the image for unused, since it was used a
/// moment ago.
#[test]
fn gc_unused_for_keeps_an_image_read_since_its_recorded_last_use() {
    let env = Env::new();
    ok_at(
        &env,
        "2026-01-01T00:00:00Z",
        &["exec", "--write", "base", "--", "true"],
    );
    env.date_lock_file("base", "2026-01-01T00:00:00Z");
    // Read four minutes later: the recorded last use (00:00) is fresh
    // enough, so the read writes nothing.
    ok_at(
        &env,
        "2026-01-01T00:04:00Z",
        &["exec", "--read", "base", "--", "true"],
    );
    // One minute after that read, the image has not been unused for two.
    let out = ok_at(&env, "2026-01-01T00:05:00Z", &["gc", "--unused-for", "2m"]);
    assert!(
        env.root.join("img/base").is_dir(),
        "gc removed an image read a minute ago as unused for 2m: {}",
        show(&out)
    );
    let images = String::from_utf8_lossy(&ok_at(&env, "2026-01-01T00:05:00Z", &["images"]).stdout)
        .into_owned();
    assert!(images.contains("base"), "{images}");
    // Really unused for long: it goes (the test can fail).
    let out = ok_at(&env, "2026-01-01T01:00:00Z", &["gc", "--unused-for", "2m"]);
    assert!(
        !env.root.join("img/base").exists(),
        "an image unused for an hour is removed: {}",
        show(&out)
    );
}

/// An image that failed its first write (its command deleted the tree and
/// failed) is listed by gc to collect; before gc takes its lock, a write of
/// the name makes its tree and ends well: gc's look under the lock finds
/// it ready and leaves it.
#[test]
fn a_write_over_an_incomplete_image_while_gc_looks_is_kept_ready() {
    let env = Env::new();
    env.make_image("base");
    let out = env.run([
        "exec",
        "--write",
        "app",
        "--from",
        "base",
        "--",
        "sh",
        "-c",
        "rm -rf \"$STOWAGE_IMAGE_DIR\"/*; exit 3",
    ]);
    assert_eq!(code(&out), Some(3), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    let (gc, go) = env.paused(["gc"], "gc-listed");
    env.build("app", "echo new > \"$STOWAGE_IMAGE_DIR/file\"");
    fs::remove_file(&go).unwrap();
    let out = gc.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"), "{}", show(&out));
    assert_eq!(
        fs::read_to_string(env.root.join("img/app/file")).unwrap(),
        "new\n"
    );
    env.ok(["doctor"]);
}

/// Seconds since the epoch, `ago` seconds back.
fn secs_ago(ago: u64) -> String {
    (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - ago)
        .to_string()
}

/// A read is a use, whatever came before it: an image written by a host
/// whose clock is an hour behind, then named by a request that failed,
/// then read now, is not collected as unused for ten minutes.
#[test]
fn an_image_read_a_moment_ago_is_not_collected_as_unused() {
    let env = Env::new();
    let mut c = env.cmd(["exec", "--write", "base", "--", "true"]);
    c.env("STOWAGE_NOW", secs_ago(3600));
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    // A request that reads it and then fails before its command.
    fs::write(env.root.join("img/zbad"), "not a directory").unwrap();
    let out = env.run(["exec", "--read", "base", "--write", "zbad", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    env.ok(["exec", "--read", "base", "--", "true"]);
    let out = env.ok(["gc", "--unused-for", "10m"]);
    assert_eq!(
        env.state("base").as_deref(),
        Some("ready"),
        "an image read just now was collected as unused: {}",
        show(&out)
    );
}

/// A write is a use: an image last used long ago, then rewritten, is not
/// collected as unused.
#[test]
fn an_image_rewritten_a_moment_ago_is_not_collected_as_unused() {
    let env = Env::new();
    env.make_image("base");
    env.make_image_used_long_ago("old");
    env.ok(["exec", "--write", "old", "--", "true"]);
    let out = env.ok(["gc", "--unused-for", "30d"]);
    assert_eq!(env.state("old").as_deref(), Some("ready"), "{}", show(&out));
}

/// A read ten minutes after the recorded last use (past the resolution at
/// which reads record it) is recorded: `images` shows it, and gc
/// --unused-for five minutes, a minute later, keeps the image.
#[test]
fn a_read_past_the_last_use_resolution_is_recorded_as_a_use() {
    let env = Env::new();
    ok_at(
        &env,
        "2026-01-01T00:00:00Z",
        &["exec", "--write", "base", "--", "true"],
    );
    let before = env.image("base").unwrap()["last_used"].clone();
    ok_at(
        &env,
        "2026-01-01T00:10:00Z",
        &["exec", "--read", "base", "--", "true"],
    );
    let after = env.image("base").unwrap()["last_used"].clone();
    assert_ne!(before, after, "the read's use was not recorded");
    let out = ok_at(&env, "2026-01-01T00:11:00Z", &["gc", "--unused-for", "5m"]);
    assert_eq!(
        env.state("base").as_deref(),
        Some("ready"),
        "{}",
        show(&out)
    );
}

/// A reader whose clock is behind (another host's, or a test's
/// `STOWAGE_NOW`) never makes an image look older than its last use: gc
/// keeps an image read yesterday, whatever a slow clock said since.
#[test]
fn a_reader_with_a_slow_clock_does_not_make_an_image_look_unused() {
    let env = Env::new();
    let at = |when: &str, args: &[&str]| {
        let mut c = env.cmd(args);
        c.env("STOWAGE_NOW", when);
        let out = output(c);
        assert_eq!(code(&out), Some(0), "{}", show(&out));
    };
    // Each write of the lock file dated as the filesystem would date it.
    at(
        "2026-01-01T00:00:00Z",
        &["exec", "--write", "daily", "--", "true"],
    );
    env.date_lock_file("daily", "2026-01-01T00:00:00Z");
    at(
        "2026-01-20T00:00:00Z",
        &["exec", "--read", "daily", "--", "true"],
    );
    env.date_lock_file("daily", "2026-01-20T00:00:00Z");
    // On Jan 20 too, by a host whose clock says Dec 20: it writes nothing.
    at(
        "2025-12-20T00:00:00Z",
        &["exec", "--read", "daily", "--", "true"],
    );
    let listed = env.ok_at("2026-01-21T00:00:00Z", &["images", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed[0]["last_used"], "2026-01-20T00:00:00Z", "{listed}");
    let mut c = env.cmd(["gc", "--unused-for", "7d"]);
    c.env("STOWAGE_NOW", "2026-01-21T00:00:00Z");
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(
        env.state("daily").as_deref(),
        Some("ready"),
        "{}",
        show(&out)
    );
}

/// A read is a use until its end: an image a long build read is not
/// unused since the build began, for a gc right after it. (The resolution
/// of last use, five minutes, is shortened to 300 ms here.)
#[test]
fn an_image_read_for_long_is_used_until_the_read_ends() {
    let env = Env::new();
    env.make_image("base");
    let resolution = (stowage::env::DEBUG_USE_RESOLUTION_MS, "300");
    let mut read = env.cmd(["exec", "--read", "base", "--", "sleep", "3"]);
    read.env(resolution.0, resolution.1);
    assert_eq!(code(&output(read)), Some(0));
    let mut gc = env.cmd(["gc", "--unused-for", "1s"]);
    gc.env(resolution.0, resolution.1);
    let out = output(gc);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(
        env.state("base").as_deref(),
        Some("ready"),
        "{}",
        show(&out)
    );
    // Unused for longer than that since, it goes.
    std::thread::sleep(Duration::from_millis(1500));
    let mut gc = env.cmd(["gc", "--unused-for", "1s"]);
    gc.env(resolution.0, resolution.1);
    assert!(stdout(&output(gc)).contains("removed 'base'"));
}

/// A removal whose tree cannot be deleted (a file in it immutable) leaves
/// the tree in the trash: the image is gone, but its bytes are not freed,
/// and gc does not count them as freed until it deletes them.
#[test]
fn a_tree_left_in_the_trash_is_not_counted_as_freed() {
    if !root_or_skip("chattr +i") || !tool_or_skip("chattr", "e2fsprogs") {
        return;
    }
    let env = Env::new();
    let out = env.run_sh(
        "z",
        "head -c 200000 /dev/urandom > \"$STOWAGE_IMAGE_DIR/data\"; exit 1",
    );
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let stuck = env.root.join("img/z/data");
    if !immutable(&stuck, true) {
        eprintln!("skipping: chattr +i is not supported here");
        return;
    }
    let out = env.run(["gc", "--json"]);
    let trash: Vec<_> = fs::read_dir(env.root.join("trash"))
        .unwrap()
        .flatten()
        .collect();
    for entry in &trash {
        immutable(&entry.path().join("data"), false);
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["removed"][0]["name"], "z", "{report}");
    assert!(report["removed"][0]["size_bytes"].as_u64().unwrap() >= 200_000);
    assert_eq!(trash.len(), 1, "{report}");
    assert!(
        report["bytes_freed"].as_u64().unwrap() < 200_000,
        "{report}"
    );
    // Deletable again: the next gc deletes it and counts it.
    let report: serde_json::Value =
        serde_json::from_slice(&env.ok(["gc", "--json"]).stdout).unwrap();
    assert!(
        report["bytes_freed"].as_u64().unwrap() >= 200_000,
        "{report}"
    );
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
}

/// Epoch seconds `days` days after `from` (epoch seconds), as `STOWAGE_NOW` reads them.
fn day(from: u64, days: i64) -> String {
    (from as i64 + days * 86_400).to_string()
}

/// RFC 3339 UTC (as stowage writes it) of epoch seconds `secs`.
fn rfc3339(secs: &str) -> String {
    let mut c = std::process::Command::new("date");
    c.args(["-u", "-d", &format!("@{secs}"), "+%Y-%m-%dT%H:%M:%SZ"]);
    let out = c.output().unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Day 0 (500 days ago): `old` and `hot` written, and `old` read by a host
/// whose clock is three years ahead. Each lock file is dated as the
/// filesystem dates its writes.
fn read_once_by_a_clock_ahead() -> (Env, u64) {
    let env = Env::new();
    let d0: u64 = secs_ago(500 * 86_400).parse().unwrap();
    for name in ["old", "hot"] {
        let blob = "head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"";
        let write = ["exec", "--write", name, "--", "sh", "-c", blob];
        env.ok_at_dated(&day(d0, 0), &write, name);
    }
    let ahead = day(d0, 3 * 365);
    env.ok_at_dated(&ahead, &["exec", "--read", "old", "--", "true"], "old");
    env.date_lock_file("old", &day(d0, 0));
    (env, d0)
}

/// A read by a host whose clock is years ahead does not keep its image as
/// used until that time, nor hide later uses: a read by a right clock records
/// its own time over it, gc --unused-for keeps the image while that read is
/// recent and takes it once unused since.
#[test]
fn a_read_by_a_clock_years_ahead_is_replaced_by_a_later_read_by_a_right_one() {
    let (env, d0) = read_once_by_a_clock_ahead();
    let read_old = ["exec", "--read", "old", "--", "true"];
    env.ok_at_dated(&day(d0, 100), &read_old, "old");
    let out = env.ok_at(&day(d0, 120), &["gc", "--unused-for", "50d"]);
    assert_eq!(env.state("old").as_deref(), Some("ready"), "{}", show(&out));
    assert_eq!(env.state("hot"), None, "{}", show(&out));
    let out = env.ok_at(&day(d0, 401), &["gc", "--unused-for", "200d"]);
    assert_eq!(env.state("old"), None, "{}", show(&out));
}

/// An image read once by a host whose clock is years ahead, and never since,
/// is as old as its lock file's last write says (within the resolution):
/// listed so, and the first to go for the budget, before one read yesterday.
#[test]
fn a_read_by_a_clock_years_ahead_does_not_make_its_image_the_most_recently_used() {
    let (env, d0) = read_once_by_a_clock_ahead();
    env.ok_at_dated(
        &day(d0, 400),
        &["exec", "--read", "hot", "--", "true"],
        "hot",
    );
    let listed = env.ok_at(&day(d0, 401), &["images", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let old = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "old");
    let used = old
        .and_then(|i| i["last_used"].as_str())
        .unwrap_or_default();
    // Within the resolution (5 min) of day 0, not three years ahead.
    let (from, to) = (rfc3339(&day(d0, 0)), rfc3339(&(d0 + 300).to_string()));
    assert!(
        from.as_str() <= used && used <= to.as_str(),
        "{from}..{to}: {listed}"
    );
    let report = gc_json(&env, &["--max-size", "1536K"], &day(d0, 401));
    assert_eq!(removed(&report), ["old"], "{report}");
    assert_eq!(env.state("hot").as_deref(), Some("ready"), "{report}");
}

/// A read whose stowage was SIGKILLed goes on in its command, which
/// inherited the lock: nobody records when that use ended but the look that
/// finds its lease dead and unlinks it, which records its own now. gc,
/// looking right after the command ended, keeps the image it read.
#[test]
fn a_read_whose_stowage_was_killed_is_used_until_its_dead_lease_is_cleaned() {
    let env = Env::new();
    ok_at(
        &env,
        "2026-01-01T00:00:00Z",
        &["exec", "--write", "base", "--", "true"],
    );
    let mut read = env.hold_with(&["--read", "base"], "started", |c| {
        c.env("STOWAGE_NOW", "2026-01-01T00:01:00Z");
    });
    read.signal(libc::SIGKILL);
    let _ = read.child.as_mut().unwrap().wait();
    assert!(!flock_free(&env.lock_file("base")), "the command reads on");
    env.release("release");
    wait_until("the command ended", || flock_free(&env.lock_file("base")));
    let out = ok_at(&env, "2026-01-01T02:00:00Z", &["gc", "--unused-for", "1h"]);
    assert!(
        env.root.join("img/base").is_dir(),
        "gc removed an image read until a moment ago: {}",
        show(&out)
    );
    // Its use was recorded then: unused an hour after that, it goes.
    let out = ok_at(&env, "2026-01-01T03:10:00Z", &["gc", "--unused-for", "1h"]);
    assert!(!env.root.join("img/base").exists(), "{}", show(&out));
}

/// An image kept in use that qualifies for two reasons (unused, and over
/// the budget) is said kept once: here every image, a store-wide command
/// holding the store.
#[test]
fn an_image_in_use_that_qualifies_twice_is_said_kept_once() {
    let env = Env::new();
    let fill = "echo content > \"$STOWAGE_IMAGE_DIR/f\"";
    ok_at(
        &env,
        "2026-01-01T00:00:00Z",
        &["exec", "--write", "a", "--", "sh", "-c", fill],
    );
    let read = env.hold(&["--store-wide"], "started");
    let args = ["gc", "--unused-for", "1h", "--max-size", "0"];
    let out = ok_at(&env, "2026-02-01T00:00:00Z", &args);
    let said = stdout(&out);
    assert_eq!(said.matches("kept 'a': in use").count(), 1, "{said}");
    let report = gc_json(
        &env,
        &["--unused-for", "1h", "--max-size", "0"],
        "2026-02-01T00:00:00Z",
    );
    assert_eq!(report["busy"], serde_json::json!(["a"]), "{report:#}");
    env.release("release");
    let _ = read.finish();
    assert!(env.root.join("img/a").is_dir());
}

/// A tree whose lock file is missing, or replaced by a directory or FIFO,
/// has no state anyone can know: gc keeps it, reports it, and counts it
/// against the budget (the images directory must fit, not only what has
/// records); `images` lists it.
#[test]
fn trees_whose_lock_files_are_missing_or_replaced_are_kept_reported_and_counted() {
    let env = Env::new();
    let fill = "head -c 100000 /dev/urandom > \"$STOWAGE_IMAGE_DIR/f\"";
    for name in ["ok", "x1", "x2", "x3"] {
        env.build(name, fill);
    }
    let locks = env.root.join("locks/images");
    fs::remove_file(locks.join("x1.lock")).unwrap();
    fs::remove_file(locks.join("x2.lock")).unwrap();
    fs::create_dir(locks.join("x2.lock")).unwrap();
    fs::remove_file(locks.join("x3.lock")).unwrap();
    let fifo = std::process::Command::new("mkfifo")
        .arg(locks.join("x3.lock"))
        .status();
    assert!(fifo.unwrap().success());
    let report = gc_json(
        &env,
        &["--unused-for", "1s", "--max-size", "150K"],
        "2031-01-01T00:00:00Z",
    );
    assert_eq!(removed(&report), ["ok"], "{report:#}");
    let unknown = report["unknown"].as_array().unwrap();
    for name in ["x1", "x2", "x3"] {
        assert!(
            env.root.join("img").join(name).is_dir(),
            "{name}: {report:#}"
        );
        let said = unknown
            .iter()
            .any(|u| u.as_str().unwrap().starts_with(&format!("{name}: ")));
        assert!(said, "{name} not reported: {report:#}");
    }
    // Three trees of about 100 KiB each still take the images directory past 150 KiB.
    assert!(
        report["size_after"].as_u64().unwrap() >= 300_000,
        "{report:#}"
    );
}

/// Another filesystem mounted inside the images directory is no tree of
/// the store's: gc neither counts it in the budget (it could never free it)
/// nor removes the store's images to make room for it.
#[test]
fn a_filesystem_mounted_in_the_images_directory_is_not_counted() {
    if !root_or_skip("mounting a tmpfs") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    let mnt = env.root.join("img/mnt");
    fs::create_dir(&mnt).unwrap();
    let Some(_m) = Mount::tmpfs_at(&mnt, "4m") else {
        return;
    };
    fs::write(mnt.join("blob"), vec![7u8; 2 << 20]).unwrap();
    // And a directory of the same filesystem bind-mounted there: the same device, another mount.
    let (outside, bound) = (env.tmp.path().join("outside"), env.root.join("img/bound"));
    fs::create_dir(&outside).unwrap();
    fs::create_dir(&bound).unwrap();
    fs::write(outside.join("blob"), vec![7u8; 2 << 20]).unwrap();
    let o = ["--bind", outside.to_str().unwrap()];
    let Some(_b) = Mount::at(&o, &bound) else {
        return;
    };
    let report = gc_json(&env, &["--max-size", "1M"], "2031-01-01T00:00:00Z");
    assert!(removed(&report).is_empty(), "{report:#}");
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    assert!(mnt.join("blob").exists() && outside.join("blob").exists());
    env.ok(["doctor", "--repair"]);
    assert_eq!((env.state("mnt"), env.state("bound")), (None, None));
}

/// A btrfs subvolume in the images directory (a builder may make each
/// image one) has a device number of its own but is on the same mount: a
/// tree like any other, counted by gc and adopted by a repair.
#[test]
fn a_btrfs_subvolume_in_the_images_directory_is_a_tree() {
    let Some(m) = Mount::btrfs_loop("300M") else {
        return;
    };
    let env = m.env();
    env.make_image("a");
    let sub = env.root.join("img/sub");
    let made = std::process::Command::new("btrfs")
        .args(["-q", "subvolume", "create"])
        .arg(&sub)
        .status();
    assert!(made.unwrap().success());
    let report = gc_json(&env, &["--max-size", "1G"], "2031-01-01T00:00:00Z");
    let unknown = report["unknown"].as_array().unwrap();
    assert!(
        unknown
            .iter()
            .any(|u| u.as_str().unwrap().starts_with("sub: ")),
        "{report:#}"
    );
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("sub").as_deref(), Some("incomplete"));
}

/// A store's `trash` that another store uses as its images directory (an
/// older release let `init` take it) is not emptied: neither gc, rm nor a
/// repair deletes or moves anything there.
#[test]
fn a_trash_another_store_uses_as_its_images_directory_is_left_alone() {
    let env = Env::new();
    env.make_image("mine");
    let other = Env::new();
    let ext = other.scratch.join("img");
    fs::create_dir(&ext).unwrap();
    other.ok(["init", "--images-dir", ext.to_str().unwrap()]);
    other.build("precious", "echo keep > \"$STOWAGE_IMAGE_DIR/data\"");
    // The other store's images directory put where this store's trash was, as it is (claim too).
    fs::remove_dir(env.root.join("trash")).unwrap();
    fs::rename(&ext, env.root.join("trash")).unwrap();
    for args in [&["gc"][..], &["rm", "mine"], &["doctor", "--repair"]] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        let said = format!("images directory of the store at {}", other.root.display());
        assert!(show(&out).contains(&said), "{args:?}: {}", show(&out));
    }
    let data = env.root.join("trash/precious/data");
    assert_eq!(fs::read_to_string(data).unwrap(), "keep\n");
    assert!(env.root.join("img/mine").is_dir());
}

/// A leftover in the trash is taken over (renamed to the taker's lease)
/// before it is deleted: a repair beside the gc that took it leaves it to
/// that gc, which alone counts it (before: both deleted it, and both counted
/// its bytes as freed).
#[test]
fn a_trash_leftover_is_deleted_and_counted_once() {
    let env = Env::new();
    env.build(
        "big",
        "head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/data\"",
    );
    let (rm, _) = env.paused(["rm", "big"], "rm-moved");
    rm.kill_all();
    let (gc, pause) = env.paused(["gc", "--json"], "trash-taken");
    let out = env.ok(["doctor", "--repair"]);
    let said = stdout(&out);
    assert!(said.contains("being deleted by running removals"), "{said}");
    assert!(!said.contains("deleted 1 left"), "{said}");
    fs::remove_file(&pause).unwrap();
    let out = gc.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let freed = report["bytes_freed"].as_u64().unwrap();
    assert!((1 << 20..2 << 20).contains(&freed), "freed {freed}");
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
}

/// A filesystem mounted on the trash stops every removal, and gc says so in
/// one line naming the image it did not remove: it said the trash's refusal
/// twice (once for the trash, once for the removal) and never named the
/// image.
#[test]
fn gc_says_a_trash_it_may_not_use_once_naming_the_image_left() {
    if !root_or_skip("mounting a tmpfs") {
        return;
    }
    let env = Env::new();
    let out = env.run(["exec", "--write", "inc", "--", "false"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let Some(_m) = Mount::tmpfs_at(&env.root.join("trash"), "1m") else {
        return;
    };
    let out = env.run(["gc"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = stderr(&out);
    assert_eq!(said.lines().count(), 1, "{said}");
    assert!(said.contains("image 'inc' not removed"), "{said}");
    assert!(said.contains("another filesystem mounted there"), "{said}");
    assert_eq!(env.state("inc").as_deref(), Some("incomplete"));
}

/// An interrupted removal gc cannot finish is said naming its image: the
/// line named only the directory a move was refused for.
#[test]
fn gc_names_the_image_whose_interrupted_removal_it_cannot_finish() {
    let env = Env::new();
    env.make_image("app");
    let (bg, _go) = env.paused(["rm", "app"], "rm-marked");
    bg.kill_all();
    let tree = env.root.join("img/app");
    if !immutable(&tree, true) {
        eprintln!("skipping: cannot make a file immutable here");
        return;
    }
    let out = env.run(["gc"]);
    immutable(&tree, false);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = stderr(&out);
    assert!(
        said.contains("cannot finish the removal of 'app'"),
        "{said}"
    );
    env.ok(["gc"]);
    assert!(env.image("app").is_none());
}

/// A btrfs subvolume a build made inside its image (a device of its own on
/// the same mount) is part of the tree: measured, copied, emptied by a
/// rebuild and removed with the image. Told apart from a mount by device,
/// it was a mount point to all of them: 0 B, left out of copies, a rebuild
/// refused, a removal stuck in the trash.
#[test]
fn a_btrfs_subvolume_inside_an_image_is_part_of_its_tree() {
    let Some(m) = Mount::btrfs_loop("300M") else {
        return;
    };
    let env = m.env();
    env.make_image("base");
    let made = "btrfs -q subvolume create \"$STOWAGE_IMAGE_DIR/sub\" && head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/sub/data\"";
    env.build("app", made);
    let size = env.image("app").unwrap()["size_bytes"]
        .as_u64()
        .unwrap_or(0);
    assert!(size >= 1 << 20, "measured {size} B");
    env.ok(["exec", "--write", "copy", "--from", "app", "--", "true"]);
    assert!(
        env.root.join("img/copy/sub/data").is_file(),
        "left out of the copy"
    );
    env.ok(["exec", "--write", "app", "--from", "base", "--", "true"]);
    assert!(
        !env.root.join("img/app/sub").exists(),
        "the rebuild kept it"
    );
    env.build("app", made);
    env.ok(["rm", "app"]);
    env.ok(["gc"]);
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
}

/// A read-only btrfs subvolume in an image (a build's `snapshot -r`, which
/// needs no root) is found by the check before a rebuild deletes anything:
/// the rebuild refuses, naming it and the cure, and the image keeps all it
/// held. It was let through as part of the tree, and the emptying failed on
/// it half-way, leaving the image incomplete.
#[test]
fn a_read_only_subvolume_stops_a_rebuild_before_anything_is_deleted() {
    let Some(m) = Mount::btrfs_loop("300M") else {
        return;
    };
    let env = m.env();
    env.make_image("base");
    env.build(
        "ro",
        "cd \"$STOWAGE_IMAGE_DIR\" && echo a > a_first && btrfs -q subvolume create sub && echo x > sub/data && btrfs -q subvolume snapshot -r sub snap && echo z > zlast",
    );
    let out = env.run(["exec", "--write", "ro", "--from", "base", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("is read-only"), "{}", show(&out));
    assert!(
        stderr(&out).contains("nothing was deleted"),
        "{}",
        show(&out)
    );
    for kept in ["a_first", "sub/data", "snap/data", "zlast"] {
        assert!(
            env.root.join("img/ro").join(kept).exists(),
            "{kept} deleted"
        );
    }
    assert_eq!(env.state("ro").as_deref(), Some("ready"));
}
