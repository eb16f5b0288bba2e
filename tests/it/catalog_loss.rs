//! The catalog (`stowage.db`) is derived from the images' records: deleted,
//! emptied, damaged or replaced — at rest or while writes are in flight —
//! no image changes state, loses its base, or becomes something gc
//! deletes. And a copy of a store, or a store seen at another path, writes
//! its new images into its own images directory.

use std::ffi::OsStr;
use std::fs;

use crate::common::*;

/// A store with ready images (one with a base), a failed one, and the
/// catalog made (listed once).
fn store_with_images() -> Env {
    let env = Env::new();
    env.make_image("base");
    env.build("app", "echo app > \"$STOWAGE_IMAGE_DIR/file\"");
    env.ok([
        "exec",
        "--read",
        "base",
        "--write",
        "child",
        "--",
        "sh",
        "-c",
        "touch \"$STOWAGE_IMAGE_DIR/file\"",
    ]);
    let out = env.run([
        "exec",
        "--write",
        "failed",
        "--",
        "sh",
        "-c",
        "touch \"$STOWAGE_IMAGE_DIR/part\"; exit 2",
    ]);
    assert_eq!(code(&out), Some(2), "{}", show(&out));
    env.ok(["images"]);
    env
}

/// What every image is, as `images --json` says: name, state, base.
fn states(env: &Env) -> Vec<(String, String, Option<String>)> {
    env.images_json()
        .iter()
        .map(|i| {
            (
                i["name"].as_str().unwrap().to_owned(),
                i["state"].as_str().unwrap().to_owned(),
                i["base"].as_str().map(str::to_owned),
            )
        })
        .collect()
}

fn expected() -> Vec<(String, String, Option<String>)> {
    [
        ("app", "ready", None),
        ("base", "ready", None),
        ("child", "ready", Some("base")),
        ("failed", "incomplete", None),
    ]
    .into_iter()
    .map(|(n, s, b)| (n.into(), s.into(), b.map(String::from)))
    .collect()
}

/// After the catalog was lost one way or another: every image as it was,
/// readable, and gc collects the failed one alone.
fn nothing_changed(env: &Env, how: &str) {
    assert_eq!(states(env), expected(), "{how}: images changed");
    env.ok(["exec", "--read", "base", "--read", "child", "--", "true"]);
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{how}: {}", show(&out));
    assert_eq!(states(env), expected(), "{how}: a repair changed images");
    env.ok(["gc"]);
    let left: Vec<String> = states(env).into_iter().map(|(n, _, _)| n).collect();
    assert_eq!(left, ["app", "base", "child"], "{how}: gc");
    for n in ["app", "base", "child"] {
        assert!(
            env.root.join("img").join(n).join("file").exists(),
            "{how}: {n}'s tree"
        );
    }
}

#[test]
fn noise_over_the_catalogs_header_changes_no_image() {
    let env = store_with_images();
    let db = env.root.join("stowage.db");
    let mut bytes = fs::read(&db).unwrap();
    let n = bytes.len().min(8192);
    bytes[..n].fill(0x5a);
    fs::write(&db, bytes).unwrap();
    // A read needs no catalog at all.
    env.ok(["exec", "--read", "app", "--", "true"]);
    nothing_changed(&env, "noise over the header");
    let aside = fs::read_dir(&env.root)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("stowage.db.damaged-")
        })
        .count();
    assert_eq!(aside, 1, "the damaged file is set aside, not deleted");
}

#[test]
fn a_deleted_catalog_changes_no_image() {
    let env = store_with_images();
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    // Right after the delete: listed, and readable.
    assert_eq!(states(&env), expected());
    env.ok(["exec", "--read", "base", "--", "true"]);
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    nothing_changed(&env, "deleted");
}

#[test]
fn an_emptied_catalog_changes_no_image() {
    let env = store_with_images();
    fs::write(env.root.join("stowage.db"), b"").unwrap();
    nothing_changed(&env, "emptied");
}

/// An emptied catalog that cannot be written (immutable here; read-only
/// elsewhere) is not reported "intact": `doctor`, with or without
/// `--repair`, says it may not be written (exit 1). No image changes.
#[test]
fn an_emptied_catalog_that_cannot_be_made_anew_is_a_problem_not_intact() {
    if !root_or_skip("chattr +i") || !tool_or_skip("chattr", "e2fsprogs") {
        return;
    }
    let env = store_with_images();
    let db = env.root.join("stowage.db");
    fs::write(&db, "").unwrap();
    if !immutable(&db, true) {
        eprintln!("skipping: chattr +i is not supported here");
        return;
    }
    let looked = env.run(["doctor"]);
    let repaired = env.run(["doctor", "--repair"]);
    assert!(immutable(&db, false));
    for out in [&looked, &repaired] {
        assert_eq!(code(out), Some(1), "{}", show(out));
        let said = stdout(out);
        let named = format!("{} may not be written", db.display());
        assert!(said.contains(&named), "{}", show(out));
        assert!(!said.contains("intact"), "{}", show(out));
    }
    nothing_changed(&env, "an immutable emptied catalog");
}

/// An intact catalog whose journal cannot be made (the root immutable,
/// an image written since so the catalog is stale) is no healthy catalog:
/// `doctor`, with or without `--repair`, reports it (exit 1, `healthy`
/// false); it said "intact" and exit 0 while its own stderr said the
/// catalog could not be used.
#[test]
fn a_catalog_whose_journal_cannot_be_made_is_a_problem_not_intact() {
    if !root_or_skip("chattr +i") || !tool_or_skip("chattr", "e2fsprogs") {
        return;
    }
    let env = store_with_images();
    if !immutable(&env.root, true) {
        eprintln!("skipping: chattr +i is not supported here");
        return;
    }
    let wrote = env.run(["exec", "--write", "later", "--", "true"]);
    let looked = env.run(["doctor"]);
    let repaired = env.run(["doctor", "--repair", "--json"]);
    assert!(immutable(&env.root, false));
    assert_eq!(code(&wrote), Some(0), "{}", show(&wrote));
    for out in [&looked, &repaired] {
        assert_eq!(code(out), Some(1), "{}", show(out));
        let said = stdout(out);
        let named = format!("{} may not be written", env.root.display());
        assert!(said.contains(&named), "{}", show(out));
        assert!(!said.contains("intact"), "{}", show(out));
    }
    let report: serde_json::Value = serde_json::from_slice(&repaired.stdout).unwrap();
    assert_eq!(report["healthy"], false, "{report}");
}

#[test]
fn another_programs_database_as_the_catalog_changes_no_image() {
    let env = store_with_images();
    let db = env.root.join("stowage.db");
    fs::remove_file(&db).unwrap();
    let conn = rusqlite::Connection::open(&db).unwrap();
    conn.execute_batch(
        "CREATE TABLE images (name TEXT, state TEXT); INSERT INTO images VALUES ('app', 'deleting');
         CREATE TABLE notes (x); PRAGMA user_version = 3;",
    )
    .unwrap();
    drop(conn);
    let out = env.run(["images"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "one line says what was done: {err}");
    assert!(err.len() < 400, "not a schema dump: {err}");
    nothing_changed(&env, "foreign");
}

/// A repair while an image is being written: the write ends as it would
/// have, and nothing later takes it for failed.
#[test]
fn a_repair_during_writes_changes_no_image() {
    let env = store_with_images();
    let new = env.hold_until(&["--write", "new"], "new-writing", "release-new");
    let old = env.hold_until(&["--write", "app"], "app-writing", "release-app");
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    env.ok(["doctor", "--repair"]);
    env.release("release-new");
    env.release("release-app");
    assert_eq!(code(&new.finish()), Some(0));
    assert_eq!(code(&old.finish()), Some(0));
    env.ok(["doctor"]);
    env.ok(["gc"]);
    assert_eq!(env.state("new").as_deref(), Some("ready"));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// A copy of a store (`cp -a`) is a store of its own: its new images go into
/// its own images directory, never the original's.
#[test]
fn a_copy_of_a_store_writes_new_images_in_its_own_directory() {
    let env = store_with_images();
    let copy = env.tmp.path().join("copy");
    let out = std::process::Command::new("cp")
        .arg("-a")
        .arg(&env.root)
        .arg(&copy)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let mut c = std::process::Command::new(bin());
    c.arg("--root").arg(&copy).args([
        "exec",
        "--write",
        "fresh",
        "--",
        "sh",
        "-c",
        "echo \"$STOWAGE_IMAGE_DIR\"; touch \"$STOWAGE_IMAGE_DIR/f\"",
    ]);
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(copy.join("img/fresh/f").exists(), "{}", show(&out));
    assert!(
        !env.root.join("img/fresh").exists(),
        "written into the original: {}",
        show(&out)
    );
    let mut c = std::process::Command::new(bin());
    c.arg("--root")
        .arg(&copy)
        .args(["exec", "--read", "fresh", "--read", "base", "--", "true"]);
    assert_eq!(code(&output(c)), Some(0));
    assert_eq!(env.state("fresh"), None, "the original knows nothing of it");
}

/// A store seen at another path (a container's bind mount): each process
/// makes new images inside the store as it names it — the container's
/// view never sends the host's writes elsewhere, nor the other way round.
#[test]
fn a_store_seen_at_another_path_writes_new_images_inside_it() {
    if !root_or_skip("a mount namespace with a bind mount") {
        return;
    }
    let env = store_with_images();
    let elsewhere = tempfile::Builder::new()
        .prefix("stowage-seen.")
        .tempdir()
        .unwrap();
    let seen = elsewhere.path().join("store");
    fs::create_dir(&seen).unwrap();
    // Inside: the store at SEEN, and the host's path to it hidden.
    let script = format!(
        "mount --bind '{root}' '{seen}' && mount -t tmpfs none '{host}' && exec '{bin}' --root '{seen}' exec --read base --write made -- sh -c 'touch \"$STOWAGE_IMAGE_DIR/f\"; echo \"$STOWAGE_IMAGE_DIR\"'",
        root = env.root.display(),
        seen = seen.display(),
        host = env.tmp.path().display(),
        bin = bin()
    );
    let mut c = std::process::Command::new("unshare");
    c.args(["--mount", "--propagation", "private", "sh", "-c", &script]);
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .starts_with(seen.to_str().unwrap()),
        "told its tree as it sees the store: {}",
        show(&out)
    );
    assert!(env.root.join("img/made/f").exists(), "{}", show(&out));
    assert_eq!(env.state("made").as_deref(), Some("ready"));

    // Back on the host, where the container's path names another
    // directory: a new image still goes into the store.
    fs::create_dir_all(seen.join("img")).unwrap();
    env.build("hostnew", "touch \"$STOWAGE_IMAGE_DIR/f\"");
    assert!(env.root.join("img/hostnew/f").exists());
    assert!(
        fs::read_dir(seen.join("img")).unwrap().next().is_none(),
        "nothing written at the container's path"
    );
}

/// A catalog of a release before records put in place of a migrated
/// store's: no migration runs again, so nothing it says — an images
/// directory elsewhere, rows for images that never were, other states —
/// reaches a record, the configuration, or a tree.
#[test]
fn an_older_releases_catalog_put_in_place_changes_no_image() {
    let env = store_with_images();
    let conf = fs::read_to_string(env.root.join("store.conf")).unwrap();
    let victim = env.tmp.path().join("victim");
    fs::create_dir_all(victim.join("app")).unwrap();
    fs::write(victim.join("app/thesis"), "precious").unwrap();
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    let conn = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    conn.execute_batch(&format!(
        "PRAGMA user_version = 10;
         CREATE TABLE images (name TEXT PRIMARY KEY, state TEXT NOT NULL, base TEXT,
             created_ms INTEGER NOT NULL, last_used_ms INTEGER NOT NULL, size_bytes INTEGER);
         CREATE TABLE records (id INTEGER PRIMARY KEY, kind TEXT, name TEXT);
         CREATE TABLE config (key TEXT PRIMARY KEY, value TEXT NOT NULL);
         INSERT INTO images VALUES ('ghost', 'ready', NULL, 0, 0, 1),
             ('app', 'deleting', NULL, 0, 0, 1), ('base', 'incomplete', NULL, 0, 0, 1);
         INSERT INTO config VALUES ('images_dir', '{}');",
        victim.display()
    ))
    .unwrap();
    drop(conn);
    assert_eq!(states(&env), expected());
    // gc removes what it removes without a catalog too: the failed build.
    let kept: Vec<_> = expected().into_iter().filter(|s| s.0 != "failed").collect();
    for _ in 0..2 {
        env.ok(["gc"]);
        env.ok(["doctor", "--repair"]);
        assert_eq!(states(&env), kept);
    }
    assert_eq!(
        fs::read_to_string(env.root.join("store.conf")).unwrap(),
        conf
    );
    assert_eq!(
        fs::read_to_string(victim.join("app/thesis")).unwrap(),
        "precious"
    );
    env.assert_read_refused("ghost", "does not exist");
    assert_eq!(env.read_in_image("app", "file"), "app\n");
    env.build("new", "true");
    assert!(env.root.join("img/new").is_dir());
}

/// A page inside the catalog damaged (its header intact, so SQLite opens
/// it): the table of images cannot be read, and nothing changes for it.
#[test]
fn a_damaged_page_inside_the_catalog_changes_no_image() {
    if !tool_or_skip("sqlite3", "sqlite3") {
        return;
    }
    let env = store_with_images();
    damage_the_images_page(&env);
    nothing_changed(&env, "a damaged page");
}

/// Noise over the page of the catalog's table of images (its header intact).
fn damage_the_images_page(env: &Env) {
    let db = env.root.join("stowage.db");
    let out = std::process::Command::new("sqlite3")
        .arg(&db)
        .arg("SELECT rootpage FROM sqlite_master WHERE name = 'images'; PRAGMA page_size;")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut n = said.lines().map(|l| l.trim().parse::<u64>().unwrap());
    let (page, size) = (n.next().unwrap(), n.next().unwrap());
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new().write(true).open(&db).unwrap();
        f.write_all_at(&vec![0x5a; size as usize], (page - 1) * size)
            .unwrap();
    }
}

/// The same damage, which opening the file does not meet: `doctor` says
/// what SQLite's check found on one line, and the first listing sets the
/// file aside and makes it anew, in one line naming it; the next says
/// nothing.
#[test]
fn a_damaged_page_inside_the_catalog_is_set_aside_by_the_first_listing() {
    if !tool_or_skip("sqlite3", "sqlite3") {
        return;
    }
    let env = store_with_images();
    damage_the_images_page(&env);
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let line = stdout(&out);
    let line = line.lines().find(|l| l.contains("is damaged")).unwrap();
    assert!(!line.contains("\\n") && !line.contains("***"), "{line}");
    let out = env.run(["images"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let err = stderr(&out);
    let db = env.root.join("stowage.db");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("catalog {} could not be used", db.display())),
        "{err}"
    );
    assert!(err.contains("set aside as"), "{err}");
    assert_eq!(set_aside(&env).len(), 1);
    let out = env.run(["images"]);
    assert_eq!(stderr(&out), "", "{}", show(&out));
    assert_eq!(states(&env), expected());
    env.ok(["doctor"]);
}

/// A copy of the catalog taken before `X` existed, restored over the file
/// (cp(1) truncates and writes in place) once `X` was made and rewritten,
/// then repaired as docs/storage.md says a restore must be: the catalog is
/// no authority on any image, so none changes — `X` stays ready and
/// readable with what its last write made.
#[test]
fn an_older_copy_of_the_catalog_restored_in_place_changes_no_image() {
    let env = Env::new();
    env.make_image("keep");
    let db = env.root.join("stowage.db");
    let copy = env.scratch.join("stowage.db.copy");
    env.ok(["images"]);
    fs::copy(&db, &copy).unwrap();
    env.build("X", "echo v1 > \"$STOWAGE_IMAGE_DIR/f\"");
    env.build("X", "echo v2 > \"$STOWAGE_IMAGE_DIR/f\"");
    env.ok(["images"]);
    fs::write(&db, fs::read(&copy).unwrap()).unwrap();
    assert_eq!(
        env.state("X").as_deref(),
        Some("ready"),
        "listed from its record"
    );
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("X").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("X", "f"), "v2\n");
    env.ok(["exec", "--read", "keep", "--", "true"]);
    env.ok(["doctor"]);
}

/// The same restore and repair while a write of `X` holds it, stopped
/// before its command: the write that then never starts (SIGTERM) gives
/// `X` back as it was, ready; and one that runs ends ready.
#[test]
fn a_write_across_a_restored_catalog_and_a_repair_ends_as_it_would_have() {
    let env = Env::new();
    env.make_image("keep");
    let db = env.root.join("stowage.db");
    let copy = env.scratch.join("stowage.db.copy");
    env.ok(["images"]);
    fs::copy(&db, &copy).unwrap();
    env.build("X", "echo v1 > \"$STOWAGE_IMAGE_DIR/f\"");
    env.ok(["images"]);
    let restore_and_repair = || {
        fs::write(&db, fs::read(&copy).unwrap()).unwrap();
        let out = env.run(["doctor", "--repair"]);
        assert_eq!(code(&out), Some(0), "{}", show(&out));
    };
    // Never started.
    let (writer, paused) = env.paused(["exec", "--write", "X", "--", "true"], "exec-before-spawn");
    restore_and_repair();
    writer.signal(libc::SIGTERM);
    let out = writer.finish();
    fs::remove_file(&paused).unwrap();
    assert_eq!(code(&out), Some(143), "{}", show(&out));
    assert_eq!(env.state("X").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("X", "f"), "v1\n");
    // Run to the end.
    let (writer, go) = env.paused(
        [
            "exec",
            "--write",
            "X",
            "--",
            "sh",
            "-c",
            "echo v2 > \"$STOWAGE_IMAGE_DIR/f\"",
        ],
        "exec-before-spawn",
    );
    restore_and_repair();
    fs::remove_file(&go).unwrap();
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.ok(["images"]);
    assert_eq!(env.state("X").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("X", "f"), "v2\n");
    env.ok(["doctor"]);
}

/// Another store's catalog put in place while `base` is held — by an
/// exclusive reader of stowage's, and by flock(1) from outside — changes
/// nothing here: `base` stays ready and readable, and the other store's
/// image, which has no record here, is no image of this store.
#[test]
fn another_stores_catalog_put_in_place_while_an_image_is_held_changes_no_image() {
    let here = Env::new();
    here.make_image("base");
    here.ok(["exec", "--read", "base", "--", "true"]);
    let there = Env::new();
    there.make_image("other");
    there.ok(["slots", "set", "pull", "1"]);
    let reader = here.hold(&["--read-exclusive", "base"], "started");
    here.put_catalog_of(&there);
    here.ok(["images"]);
    here.release("release");
    let out = reader.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let names: Vec<String> = here
        .images_json()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["base"], "the other store's image is no image here");
    let holder = flock_holder(
        &here.lock_file("base"),
        &here.sentinel("flock-held"),
        &format!(
            "i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
            r = here.sentinel("flock-release").display()
        ),
    );
    here.put_catalog_of(&there);
    here.ok(["images"]);
    here.release("flock-release");
    let out = holder.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(here.state("base").as_deref(), Some("ready"));
    assert_eq!(here.read_in_image("base", "file"), "content\n");
    let out = here.run(["exec", "--read", "other", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    here.ok(["doctor"]);
}

/// Another store's catalog, whose class `pull` is limited to 1, put in
/// place of ours (`pull` limited to 2): a class's limits have their own
/// home, and two slots are still taken at once.
#[test]
fn another_stores_catalog_put_in_place_changes_no_slot_limit() {
    let here = Env::new();
    here.ok(["slots", "set", "pull", "2"]);
    here.ok(["exec", "--slot", "pull", "--", "true"]);
    let there = Env::new();
    there.ok(["slots", "set", "pull", "1"]);
    here.put_catalog_of(&there);
    here.ok(["images"]);
    let holder = here.hold(&["--slot", "pull"], "started");
    let out = here.run(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert_eq!(
        code(&out),
        Some(0),
        "a second slot of a class limited to 2: {}",
        show(&out)
    );
    let third = here.hold_until(&["--slot", "pull"], "third", "release-third");
    let out = here.run(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert_eq!(
        code(&out),
        Some(75),
        "a third slot of a class limited to 2: {}",
        show(&out)
    );
    here.release("release");
    here.release("release-third");
    assert_eq!(code(&holder.finish()), Some(0));
    assert_eq!(code(&third.finish()), Some(0));
}

/// A root moved elsewhere (or seen at another path: another host's mount
/// point) keeps its images in ROOT/img as this process names ROOT: a read
/// there is told that directory, and finds its image in it.
#[test]
fn a_read_in_a_moved_root_runs_in_that_roots_images_directory() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    let moved = env.tmp.path().join("moved");
    fs::rename(&env.root, &moved).unwrap();
    let mut c = std::process::Command::new(bin());
    c.arg("--root").arg(&moved).args([
        "exec",
        "--read",
        "base",
        "--",
        "sh",
        "-c",
        "echo \"$STOWAGE_IMAGES_DIR\"; cat \"$STOWAGE_IMAGES_DIR/base/file\"",
    ]);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = said.lines();
    assert_eq!(
        lines.next(),
        Some(moved.join("img").to_str().unwrap()),
        "{}",
        show(&out)
    );
    assert_eq!(lines.next(), Some("content"), "{}", show(&out));
}

/// Writes image `name` with `bytes` bytes in it, as if at `when`
/// (`STOWAGE_NOW`, which is also its last use).
fn build_sized(env: &Env, name: &str, bytes: usize, when: &str) {
    let script = format!("head -c {bytes} /dev/zero > \"$STOWAGE_IMAGE_DIR/data\"");
    let mut c = env.cmd(["exec", "--write", name, "--", "sh", "-c", &script]);
    c.env("STOWAGE_NOW", when);
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// Another store's catalog, which measured its images of the same names
/// at the same sequence numbers as ours, put in place of ours: its sizes
/// are another store's trees', and gc over a budget ours are far below
/// removes nothing.
#[test]
fn another_stores_catalog_put_in_place_makes_no_image_over_the_budget() {
    let (here, there) = (Env::new(), Env::new());
    for name in ["base", "app"] {
        build_sized(&here, name, 8 << 10, "2024-01-01T00:00:00Z");
        build_sized(&there, name, 3 << 20, "2024-01-01T00:00:00Z");
    }
    here.ok(["images"]);
    here.put_catalog_of(&there);
    here.ok(["gc", "--max-size", "1M"]);
    assert_eq!(here.state("base").as_deref(), Some("ready"));
    assert_eq!(here.state("app").as_deref(), Some("ready"));
}

/// A damaged record's stand-in says the same in every store, so a catalog
/// row can carry a size "for" it: gc never takes a size for an image whose
/// record cannot be read, and removes nothing else to make room for it.
#[test]
fn no_catalog_row_gives_a_damaged_image_a_size() {
    let env = Env::new();
    build_sized(&env, "app", 8 << 10, "2024-01-01T00:00:00Z");
    build_sized(&env, "damaged", 8 << 10, "2024-06-01T00:00:00Z");
    fs::write(env.lock_file("damaged"), vec![0x5a; 8192]).unwrap();
    env.ok(["images"]);
    let stand_in = stowage::image_record::Record::unknown(
        "damaged",
        stowage::image_record::ImagesDir::Default,
        0,
    );
    let conn = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    let changed = conn
        .execute(
            "UPDATE images SET size_bytes = ?1, size_record = ?2 WHERE name = 'damaged'",
            rusqlite::params![10i64 << 30, stand_in.fingerprint() as i64],
        )
        .unwrap();
    assert_eq!(changed, 1);
    drop(conn);
    env.ok(["gc", "--max-size", "1M"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// An image removed, then made anew under its name: its record starts at
/// the same sequence number, but the old tree's size (kept in the
/// catalog, which `rm` does not open) is not the new tree's.
#[test]
fn an_image_made_anew_after_rm_is_not_given_the_old_trees_size() {
    let env = Env::new();
    build_sized(&env, "app", 5 << 20, "2024-01-01T00:00:00Z");
    build_sized(&env, "small", 8 << 10, "2024-01-01T00:00:00Z");
    env.ok(["images"]);
    env.ok(["rm", "app"]);
    build_sized(&env, "app", 8 << 10, "2024-01-01T00:00:00Z");
    env.ok(["gc", "--max-size", "1M"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.state("small").as_deref(), Some("ready"));
}

/// Another store's catalog, whose images of our names were used in
/// another order, put in place of ours: the least recently used image is
/// still ours to say (the lock files'), and gc over the budget removes it,
/// not the one used last.
#[test]
fn another_stores_catalog_put_in_place_changes_no_images_last_use() {
    let (here, there) = (Env::new(), Env::new());
    build_sized(&here, "old", 64 << 10, "2024-01-01T00:00:00Z");
    build_sized(&here, "recent", 64 << 10, "2024-06-01T00:00:00Z");
    build_sized(&there, "recent", 64 << 10, "2024-01-01T00:00:00Z");
    build_sized(&there, "old", 64 << 10, "2024-12-01T00:00:00Z");
    here.ok(["images"]);
    here.put_catalog_of(&there);
    here.ok(["gc", "--max-size", "100K"]);
    assert_eq!(here.state("old"), None, "the least recently used goes");
    assert_eq!(here.state("recent").as_deref(), Some("ready"));
}

/// Names of the files set aside beside the catalog.
fn set_aside(env: &Env) -> Vec<String> {
    let names = fs::read_dir(&env.root).unwrap().flatten();
    let names = names.map(|e| e.file_name().to_string_lossy().into_owned());
    names.filter(|n| n.starts_with("stowage.db.")).collect()
}

/// A database of this schema version that is not this release's schema
/// (a look-alike table; ours with a trigger added) is no catalog: `doctor`
/// says so (exit 1), and the first listing sets it aside in one line naming
/// it. A trigger that rewrote every size to 1 B kept an image over the
/// budget from gc; once set aside, the sizes are measured again.
#[test]
fn our_schema_version_over_another_schema_is_set_aside_by_the_first_command() {
    let env = Env::new();
    build_sized(&env, "old", 3 << 20, "2024-01-01T00:00:00Z");
    build_sized(&env, "new", 8 << 10, "2024-06-01T00:00:00Z");
    env.ok(["images"]);
    let db = env.root.join("stowage.db");
    let conn = rusqlite::Connection::open(&db).unwrap();
    conn.execute_batch(
        "CREATE TRIGGER t AFTER UPDATE OF size_bytes ON images WHEN NEW.size_bytes > 1
         BEGIN UPDATE images SET size_bytes = 1 WHERE name = NEW.name; END;
         UPDATE images SET size_record = NULL;",
    )
    .unwrap();
    drop(conn);
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stdout(&out).contains("trigger t"), "{}", show(&out));
    let out = env.run(["gc", "--max-size", "1M"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("{} could not be used", db.display())),
        "{err}"
    );
    assert_eq!(set_aside(&env).len(), 1, "{err}");
    assert_eq!(env.state("old"), None, "gc went by the trigger's sizes");
    assert_eq!(env.state("new").as_deref(), Some("ready"));

    fs::remove_file(&db).unwrap();
    let conn = rusqlite::Connection::open(&db).unwrap();
    conn.execute_batch("CREATE TABLE images (size_seq); PRAGMA user_version = 11;")
        .unwrap();
    drop(conn);
    let out = env.run(["images"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(stderr(&out).contains("set aside as"), "{}", show(&out));
    assert_eq!(set_aside(&env).len(), 2);
    env.ok(["doctor"]);
    env.ok(["images"]);
}

/// A catalog or journal that may not be written (immutable here) is no
/// intact catalog: `doctor`, with or without `--repair`, names the file and
/// the cause (exit 1), and a listing's line names them too, where SQLite
/// names neither.
#[test]
fn an_unwritable_catalog_is_named_with_its_cause_not_intact() {
    if !root_or_skip("chattr +i") || !tool_or_skip("chattr", "e2fsprogs") {
        return;
    }
    for file in ["stowage.db", "stowage.db-journal"] {
        let env = Env::new();
        env.make_image("app");
        env.ok(["images"]);
        env.make_image("new");
        let path = env.root.join(file);
        if !path.exists() {
            fs::write(&path, "").unwrap();
        }
        if !immutable(&path, true) {
            eprintln!("skipping: chattr +i is not supported here");
            return;
        }
        let listed = env.run(["images"]);
        let looked = env.run(["doctor"]);
        let repaired = env.run(["doctor", "--repair"]);
        assert!(immutable(&path, false));
        let named = format!("{} may not be written", path.display());
        let err = stderr(&listed);
        assert!(err.contains(&named) && err.contains("immutable"), "{err}");
        for out in [&looked, &repaired] {
            assert_eq!(code(out), Some(1), "{}", show(out));
            assert!(stdout(out).contains(&named), "{}", show(out));
            assert!(!stdout(out).contains("intact"), "{}", show(out));
        }
        env.ok(["images"]);
        env.ok(["doctor"]);
    }
}

/// A catalog of ours its mode was taken from (`chmod 000`): the listing
/// says a repair gives it back its mode, and the repair does just that,
/// never setting it aside as something planted.
#[test]
fn a_catalog_whose_mode_was_taken_gets_it_back_from_a_repair() {
    use std::os::unix::fs::PermissionsExt;
    if as_nobody().is_none() {
        return;
    }
    let env = unprivileged_env();
    unprivileged_build(&env, "app", "true");
    let out = unprivileged(&env, &["images"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let db = env.root.join("stowage.db");
    fs::set_permissions(&db, fs::Permissions::from_mode(0o000)).unwrap();
    let out = unprivileged(&env, &["images"]);
    assert!(
        stderr(&out).contains(&format!(
            "'stowage --root {} doctor --repair' gives it back its mode",
            env.root.display()
        )),
        "{}",
        show(&out)
    );
    let out = unprivileged(&env, &["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stdout(&out).contains("was mode 000: now 600"),
        "{}",
        show(&out)
    );
    assert_eq!(set_aside(&env), Vec::<String>::new());
    let out = unprivileged(&env, &["images"]);
    assert_eq!(stderr(&out), "", "{}", show(&out));
}

/// In a group store the same repair is whole: the group's share of the
/// catalog, which its owner may not open while of mode 000, is given back
/// through a descriptor that needs no read, and doctor exits 0 (it said it
/// could not fix the file, then fixed it, and exited 1).
#[test]
fn a_group_stores_catalog_whose_mode_was_taken_is_repaired_whole() {
    use std::os::unix::fs::PermissionsExt;
    if as_nobody().is_none() {
        return;
    }
    let env = unprivileged_env();
    let out = unprivileged(&env, &["init", "--group", "65534"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    unprivileged_build(&env, "app", "true");
    assert_eq!(code(&unprivileged(&env, &["images"])), Some(0));
    let db = env.root.join("stowage.db");
    fs::set_permissions(&db, fs::Permissions::from_mode(0o000)).unwrap();
    let out = unprivileged(&env, &["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(!stdout(&out).contains("PROBLEM"), "{}", show(&out));
    assert_eq!(
        fs::metadata(&db).unwrap().permissions().mode() & 0o777,
        0o660
    );
    assert_eq!(code(&unprivileged(&env, &["doctor"])), Some(0));
}

/// A catalog that cannot be read (EIO from a dying disk, which SQLite
/// reports as damage) is an I/O error, never set aside as damaged: a copy
/// piled up at every command. Nor is a sound one after a read that failed
/// once. Reads fail by strace's fault injection.
#[test]
fn a_catalog_that_cannot_be_read_is_not_set_aside_as_damaged() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    env.ok(["images"]);
    let db = env.root.join("stowage.db");
    let copies = || {
        fs::read_dir(&env.root)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().contains(".damaged-"))
            .count()
    };
    for (n, lasting) in [(3, true), (4, true), (5, true), (3, false), (5, false)] {
        let when = if lasting {
            format!("{n}+")
        } else {
            n.to_string()
        };
        let mut faults = vec![
            "-P".into(),
            db.clone().into_os_string(),
            format!("--inject=pread64:error=EIO:when={when}").into(),
        ];
        if lasting {
            faults.push("--inject=read:error=EIO".into());
        }
        let out = output(under_strace(&env, &faults, &["images", "--json"]));
        assert_eq!(code(&out), Some(0), "{n} {lasting}: {}", show(&out));
        assert_eq!(copies(), 0, "EIO at read {when}: {}", show(&out));
        assert!(
            !lasting || stderr(&out).contains("cannot be read"),
            "{}",
            show(&out)
        );
    }
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}

/// A FIFO put at the catalog after its check, while SQLite opens it, is
/// named, not "unable to open database file": SQLite names nothing it
/// cannot open. (Its second open is held 1.5 s by strace; the FIFO goes in
/// meanwhile.) Nothing blocks.
#[test]
fn a_fifo_put_at_the_catalog_while_it_is_opened_is_named() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    env.ok(["images"]);
    let db = env.root.join("stowage.db");
    let delay = "--inject=openat:delay_enter=1500000:when=2";
    let c = under_strace(
        &env,
        &[OsStr::new("-P"), db.as_os_str(), OsStr::new(delay)],
        &["images"],
    );
    let images = Bg::from_command(c);
    std::thread::sleep(std::time::Duration::from_millis(700));
    fs::remove_file(&db).unwrap();
    nix::unistd::mkfifo(&db, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
    let out = images.finish();
    assert!(stderr(&out).contains("FIFO"), "{}", show(&out));
    assert!(!stderr(&out).contains("unable to open"), "{}", show(&out));
}

/// A sparse file of the longest length the filesystem takes (exabytes on
/// tmpfs), a hole from end to end: SQLite's file, no catalog.
fn plant_sparse(path: &std::path::Path) -> u64 {
    let f = fs::File::create(path).unwrap();
    [4u64 << 60, 15 << 40, 8 << 40, 1 << 40]
        .into_iter()
        .find(|&len| f.set_len(len).is_ok())
        .expect("a sparse file of a terabyte or more")
}

/// A catalog file claiming exabytes or terabytes (sparse: it costs no disk)
/// is set aside and made anew by the first command that uses it, and
/// `doctor` says what it is. Every command once read it whole, under the
/// global lock, to tell a failing disk from damage: for hours, while every
/// other catalog user waited, and on tmpfs, where SQLite counts the pages
/// of 4 EiB as none, `doctor --repair` called it empty and unmakeable.
#[test]
fn a_sparse_catalog_of_any_length_is_set_aside_at_once() {
    sparse_catalogs_set_aside(&Env::new());
    // 4 EiB, where SQLite counts no page at all, on a tmpfs (as root).
    let env = Env::new();
    fs::create_dir(&env.root).unwrap();
    if !root_or_skip("mounting a tmpfs") {
        return;
    }
    if let Some(_tmpfs) = Mount::tmpfs_at(&env.root, "64m") {
        sparse_catalogs_set_aside(&env);
    }
}

/// [`a_sparse_catalog_of_any_length_is_set_aside_at_once`] in `env`.
fn sparse_catalogs_set_aside(env: &Env) {
    env.make_image("a");
    env.ok(["images"]);
    let db = env.root.join("stowage.db");
    for args in [
        &["images"][..],
        &["gc", "--dry-run"],
        &["gc"],
        &["init"],
        &["doctor", "--repair"],
        &["doctor"],
    ] {
        fs::remove_file(&db).unwrap();
        let len = plant_sparse(&db);
        let out = env.run(args);
        let doctor = args == ["doctor"];
        assert_eq!(code(&out), Some(doctor as i32), "{args:?}: {}", show(&out));
        let said = format!("{}{}", stdout(&out), stderr(&out));
        assert!(!said.contains("empty"), "{args:?}: {}", show(&out));
        if doctor {
            assert!(said.contains("cannot be used"), "{}", show(&out));
            continue;
        }
        assert!(said.contains("set aside"), "{args:?}: {}", show(&out));
        assert!(
            fs::metadata(&db).unwrap().len() < len,
            "{args:?}: made anew"
        );
        assert_eq!(env.state("a").as_deref(), Some("ready"), "{args:?}");
    }
}

/// A catalog stuck in WAL mode (its WAL, holding rows not yet written
/// back, immutable) that a repair cannot set aside is said as a problem,
/// and the report is made all the same (before: the repair stopped with
/// one error line and no report).
#[test]
fn a_catalog_a_repair_cannot_set_aside_is_said_in_the_report() {
    if !root_or_skip("chattr +i")
        || !tool_or_skip("chattr", "e2fsprogs")
        || !tool_or_skip("python3", "python3")
    {
        return;
    }
    let env = store_with_images();
    let db = env.root.join("stowage.db");
    let script = "import sqlite3, os, sys\n\
                  c = sqlite3.connect(sys.argv[1], isolation_level=None)\n\
                  c.execute('PRAGMA journal_mode=WAL'); c.execute('PRAGMA wal_autocheckpoint=0')\n\
                  c.execute('CREATE TABLE IF NOT EXISTS t (x)'); c.execute('INSERT INTO t VALUES (1)')\n\
                  os._exit(0)\n";
    let made = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(&db)
        .status();
    assert!(made.is_ok_and(|s| s.success()));
    let wal = env.root.join("stowage.db-wal");
    if !immutable(&wal, true) {
        eprintln!("skipping: chattr +i is not supported here");
        return;
    }
    let out = env.run(["doctor", "--repair"]);
    assert!(immutable(&wal, false));
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stdout(&out).contains("PROBLEM  catalog"), "{}", show(&out));
    env.ok(["doctor", "--repair"]);
    env.ok(["exec", "--read", "app", "--", "true"]);
}

/// Puts `v` in the schema version field of the catalog's header (bytes
/// 60..64), as damage there would, leaving the rest as it is.
fn damage_schema_version(env: &Env, v: u32) {
    use std::os::unix::fs::FileExt as _;
    let db = fs::OpenOptions::new()
        .write(true)
        .open(env.root.join("stowage.db"))
        .unwrap();
    db.write_all_at(&v.to_be_bytes(), 60).unwrap();
}

/// Asserts each listing and removal goes on over a catalog made unusable
/// by `spoil` (run before each), taking it for none of a later release's.
fn goes_on_over(env: &Env, how: &str, spoil: impl Fn()) {
    for args in [
        &["images"][..],
        &["lock-status"],
        &["slots"],
        &["gc", "--dry-run"],
        &["init"],
    ] {
        spoil();
        let out = env.run(args);
        assert_eq!(code(&out), Some(0), "{how}: {args:?}: {}", show(&out));
        assert!(!stderr(&out).contains("newer"), "{how}: {}", show(&out));
    }
    spoil();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{how}: {}", show(&out));
    env.ok(["doctor"]);
    spoil();
    nothing_changed(env, how);
}

/// Four bytes of the catalog's header, its schema version, raised above
/// this release's over this release's schema: damage, not a later release's
/// catalog; set aside and made anew, never a store refused for good.
#[test]
fn a_catalog_damaged_in_its_schema_version_changes_no_image() {
    let env = store_with_images();
    let spoil = || {
        if env.root.join("stowage.db").exists() {
            damage_schema_version(&env, 12);
        }
    };
    goes_on_over(&env, "schema version damaged", spoil);
    let out = env.run(["rm", "app"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// Another program's database with a schema version above this release's
/// is not a later stowage's catalog: set aside and made anew.
#[test]
fn another_programs_database_of_a_high_version_changes_no_image() {
    let env = store_with_images();
    let db = env.root.join("stowage.db");
    let spoil = || {
        let _ = fs::remove_file(&db);
        let conn = rusqlite::Connection::open(&db).unwrap();
        (conn.execute_batch("CREATE TABLE notes (x); PRAGMA user_version = 20;")).unwrap();
    };
    goes_on_over(&env, "another program's, version 20", spoil);
}

/// Another program's database with a table named `images` (a common name)
/// but none of a stowage catalog's columns, at a schema version above this
/// release's: no later stowage's catalog either; set aside and made anew.
#[test]
fn another_programs_images_table_of_a_high_version_changes_no_image() {
    let env = store_with_images();
    let db = env.root.join("stowage.db");
    let spoil = || {
        let _ = fs::remove_file(&db);
        let conn = rusqlite::Connection::open(&db).unwrap();
        let sql =
            "CREATE TABLE images (id INTEGER PRIMARY KEY, path TEXT); PRAGMA user_version = 12;";
        conn.execute_batch(sql).unwrap();
    };
    goes_on_over(&env, "another program's images table, version 12", spoil);
    let out = env.run(["rm", "app"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}
