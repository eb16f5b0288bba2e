//! A store made by the last release before image records (catalog schema
//! 10) migrates on first use without losing an image, its state or its
//! base: every image's record is written from what that release held true.
//!
//! The stores are tests/fixtures/schema10-*.tar, made by that release's
//! binary with scripts/make-migration-fixtures; a test that also needs the
//! binary itself runs when `STOWAGE_OLD_BIN` names it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::common::*;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn untar(tar: &Path, into: &Path) {
    let st = Command::new("tar")
        .arg("-C")
        .arg(into)
        .arg("-xf")
        .arg(tar)
        .status()
        .unwrap();
    assert!(st.success(), "untar {}", tar.display());
}

/// An Env whose root is the schema-10 store of the fixture, moved to the
/// test's own directory (as a store copied with `cp -a` would be).
fn old_store() -> Env {
    let env = Env::new();
    untar(&fixture("schema10-store.tar"), env.tmp.path());
    fs::rename(env.tmp.path().join("store"), &env.root).unwrap();
    env
}

fn catalog_version(env: &Env) -> u32 {
    let bytes = fs::read(env.root.join("stowage.db")).unwrap();
    u32::from_be_bytes(bytes[60..64].try_into().unwrap())
}

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

fn st(name: &str, state: &str, base: Option<&str>) -> (String, String, Option<String>) {
    (name.into(), state.into(), base.map(Into::into))
}

/// What the older release held true of each image of the fixture.
fn expected() -> Vec<(String, String, Option<String>)> {
    vec![
        st("app", "ready", Some("base")),
        st("base", "ready", None),
        // rm died once the row said deleting: the deletion is finished by
        // rm or gc, never undone.
        st("doomed", "deleting", None),
        st("failed", "incomplete", None),
        // Rewritten without the database; its record said ready.
        st("folded", "ready", None),
        // Its writer died in its command: the record said writing.
        st("newborn", "incomplete", None),
        st("rewritten", "incomplete", None),
        // Made without the database: a record, no row.
        st("rowless", "ready", None),
    ]
}

fn assert_migrated(env: &Env) {
    assert_eq!(catalog_version(env), 11, "the catalog is at schema 11");
    let locks = env.root.join("locks/images");
    for f in fs::read_dir(&locks).unwrap() {
        let f = f.unwrap().path();
        let text = fs::read(&f).unwrap();
        let has = |what: &[u8]| text.windows(what.len()).any(|w| w == what);
        assert!(
            has(b"stowage-record 1\n") && !has(b"stowage-image "),
            "{} holds a record of this release, and no token the older release takes",
            f.display()
        );
    }
    let markers: Vec<_> = fs::read_dir(env.root.join("locks/leases"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".dirty"))
        .collect();
    assert!(markers.is_empty(), "no marker is left: {markers:?}");
    assert!(env.root.join("store.conf").exists());
    let global = fs::read(env.root.join("locks/global.lock")).unwrap();
    assert!(global.is_empty(), "the older release's statement is gone");
}

#[test]
fn an_old_store_keeps_every_image_its_state_and_its_base() {
    let env = old_store();
    assert_eq!(catalog_version(&env), 10);
    assert_eq!(states(&env), expected());
    assert_migrated(&env);
    assert_eq!(env.read_in_image("folded", "v"), "two\n");
    assert_eq!(env.read_in_image("app", "app"), "app\n");
    assert_eq!(env.read_in_image("app", "os-release"), "base\n");
    assert_eq!(env.read_in_image("rowless", "r"), "r\n");
    let out = env.run(["exec", "--read", "rewritten", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    // Its images directory is claimed as a new store's is.
    let img = std::ffi::CString::new(env.root.join("img").to_str().unwrap()).unwrap();
    let mut buf = [0u8; 1024];
    // SAFETY: NUL-terminated path and name, a buffer of the length given.
    let n = unsafe {
        libc::getxattr(
            img.as_ptr(),
            c"user.stowage.store".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    assert!(n > 0, "{}", std::io::Error::last_os_error());
    let claim = String::from_utf8_lossy(&buf[..n as usize]).into_owned();
    assert!(
        claim.contains(&format!("path={}\n", env.root.display())),
        "{claim}"
    );
}

/// A lock file in the older release's format whose token cannot be taken
/// (torn: its check fails; or another image's, copied in) is migrated from
/// the catalog's row, and its prefix disabled all the same: it was left,
/// and every read of the image was refused as damaged (66) while `images`
/// listed it ready.
#[test]
fn an_old_token_that_cannot_be_taken_is_disabled_beside_its_record() {
    let env = old_store();
    let lock = env.root.join("locks/images/base.lock");
    let torn = fs::read_to_string(&lock)
        .unwrap()
        .replace("used=1700000000000", "used=1700000000001");
    fs::write(&lock, torn).unwrap();
    fs::copy(
        env.root.join("locks/images/app.lock"),
        env.root.join("locks/images/folded.lock"),
    )
    .unwrap();
    env.ok(["images"]);
    let out = env.run(["exec", "--read", "base", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    // folded's own token is gone: its row alone says what it was, and the
    // refusal says that state, not damage.
    let out = env.run(["exec", "--read", "folded", "--", "true"]);
    let state = env.state("folded").unwrap();
    assert!(!stderr(&out).contains("damaged"), "{state}: {}", show(&out));
    assert!(
        state == "ready" || stderr(&out).contains(&format!("state: {state}")),
        "{}",
        show(&out)
    );
}

#[test]
fn an_old_store_keeps_its_slot_classes() {
    let env = old_store();
    let out = env.ok(["slots", "--json"]);
    let classes: Value = serde_json::from_slice(&out.stdout).unwrap();
    let find = |name: &str| {
        classes
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("class {name} kept: {classes}"))
    };
    assert_eq!(find("pull")["limit"], 3);
    assert_eq!(find("pull")["reserve_high"], 1);
    assert_eq!(find("load/podman")["limit"], 2);
    assert_migrated(&env);
    let out = env.run(["exec", "--slot", "pull", "--write", "x", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

#[test]
fn a_write_as_the_first_command_migrates_then_writes() {
    let env = old_store();
    let out = env.run([
        "exec",
        "--write",
        "folded",
        "--",
        "sh",
        "-c",
        "echo three > \"$STOWAGE_IMAGE_DIR/v\"",
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_migrated(&env);
    assert_eq!(env.read_in_image("folded", "v"), "three\n");
    assert_eq!(states(&env), expected());
}

#[test]
fn gc_after_migration_removes_only_what_the_older_release_called_failed() {
    let env = old_store();
    let out = env.run(["gc"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let left: Vec<String> = states(&env).into_iter().map(|s| s.0).collect();
    assert_eq!(left, ["app", "base", "folded", "rowless"], "{}", show(&out));
    for gone in ["doomed", "failed", "newborn", "rewritten"] {
        assert!(!env.root.join("img").join(gone).exists(), "{gone}'s tree");
    }
}

/// The fixture with an images directory outside the root: the older
/// release recorded absolute paths, so the store is put back where it was
/// made (one test at a time holds that place).
#[test]
fn an_old_store_with_an_external_images_directory_keeps_it() {
    let place = Path::new("/tmp/stowage-fixture");
    let guard = fs::File::create("/tmp/stowage-fixture.lock").unwrap();
    // Not a store's lock: only this test's copies take it.
    #[allow(clippy::disallowed_methods)]
    fs2::FileExt::lock_exclusive(&guard).unwrap();
    let _ = fs::remove_dir_all(place);
    fs::create_dir(place).unwrap();
    untar(&fixture("schema10-external.tar"), place);
    // The directory is the one recorded, as it would be in place: its
    // identity is this machine's.
    let images = place.join("ext-images");
    let id = stowage::dir::Dir::open(&images)
        .unwrap()
        .identity()
        .unwrap();
    let conn = rusqlite::Connection::open(place.join("ext/stowage.db")).unwrap();
    conn.execute(
        "UPDATE config SET value = ?1 WHERE key = 'images_dir_identity'",
        [&id],
    )
    .unwrap();
    drop(conn);
    // A copy made before either migrates.
    let early = place.join("early-copy");
    cp_a(&place.join("ext"), &early);
    let mut env = Env::new();
    env.root = place.join("ext");

    assert_eq!(states(&env), expected());
    assert_migrated(&env);
    let conf = fs::read_to_string(env.root.join("store.conf")).unwrap();
    assert!(
        conf.contains(&format!("images={}\n", images.display())),
        "{conf}"
    );
    assert_eq!(env.read_in_image("app", "os-release"), "base\n");
    env.build("new", "echo n > \"$STOWAGE_IMAGE_DIR/n\"");
    assert!(images.join("new/n").exists(), "a new image goes there too");
    assert!(!env.root.join("img/new").exists());

    // The migrated store claims its directory as `init` would: a copy of it is refused there.
    let copy = place.join("copy");
    cp_a(&env.root, &copy);
    let mut other = Env::new();
    other.root = copy;
    for args in [
        &["exec", "--no-wait", "--write", "app", "--", "true"][..],
        &["rm", "base"],
    ] {
        let out = other.run(args);
        assert_ne!(code(&out), Some(0), "{args:?}: {}", show(&out));
        assert!(
            stderr(&out).contains("belongs to the store at"),
            "{args:?}: {}",
            show(&out)
        );
    }
    // The copy made before migration migrates too, but the directory is claimed: refused there.
    other.root = early;
    other.run(["images"]);
    for args in [
        &["exec", "--no-wait", "--write", "app", "--", "true"][..],
        &["rm", "base"],
        &["gc"],
    ] {
        let out = other.run(args);
        assert_ne!(code(&out), Some(0), "early copy {args:?}: {}", show(&out));
    }
    assert_eq!(env.read_in_image("app", "os-release"), "base\n");
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert!(images.join("base").is_dir());
    let _ = fs::remove_dir_all(place);
}

/// A process of the older release holding an image: the migration waits
/// for it, and the older release refuses the store once it is migrated.
#[test]
fn migration_waits_for_holders_of_the_older_release() {
    let Ok(old) = std::env::var("STOWAGE_OLD_BIN") else {
        eprintln!("skipped: STOWAGE_OLD_BIN does not name a binary of the release before records");
        return;
    };
    let env = old_store();
    let started = env.sentinel("started");
    let release = env.sentinel("release");
    let mut c = Command::new(&old);
    c.arg("--root").arg(&env.root).args([
        "exec",
        "--read",
        "base",
        "--",
        "sh",
        "-c",
        &format!(
            "touch {}; while [ ! -e {} ]; do sleep 0.05; done",
            started.display(),
            release.display()
        ),
    ]);
    let holder = Bg::from_command(c);
    wait_for_file(&started);
    let mut new = env.spawn(["exec", "--write", "other", "--", "true"]);
    wait_until("the migration waits", || {
        fs::read(env.root.join("stowage.db")).unwrap()[60..64] == [0, 0, 0, 10] && new.is_running()
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(new.is_running(), "waits for the older release's reader");
    assert_eq!(catalog_version(&env), 10);
    fs::write(&release, "").unwrap();
    assert_eq!(code(&holder.finish()), Some(0));
    let out = new.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_migrated(&env);
    let out = Command::new(&old)
        .arg("--root")
        .arg(&env.root)
        .args(["exec", "--read", "base", "--", "true"])
        .output()
        .unwrap();
    assert_ne!(code(&out), Some(0), "the older release refuses the store");
}

/// A migration that gives up waiting for an image's holder says how long
/// it waited and who holds the image, as every other wait does.
#[test]
fn a_migration_that_gives_up_names_the_holder() {
    let env = old_store();
    let then = "i=0; while [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done";
    let holder = flock_holder(&env.lock_file("base"), &env.sentinel("held"), then);
    let out = env.run(["exec", "--write", "other", "--wait", "1", "--", "true"]);
    holder.kill_all();
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    let err = stderr(&out);
    let line = err.lines().last().unwrap_or_default();
    assert!(
        line.contains("gave up after")
            && line.contains("(needed free to migrate the store): held")
            && line.contains("flock"),
        "{}",
        show(&out)
    );
    assert_eq!(catalog_version(&env), 10, "nothing migrated");
}

/// A store of this release whose `store.conf` is lost and whose catalog
/// is replaced by another store's of the release before records: that
/// catalog is not this store's (the global lock file names no identity
/// of it, and the images have records), so nothing is migrated from it.
/// An image whose record is damaged stays unknown and unreadable, the
/// other store's images do not appear, and a repair and gc remove nothing.
#[test]
fn another_stores_older_catalog_with_the_configuration_lost_migrates_nothing() {
    let env = Env::new();
    for name in ["base", "app", "failed"] {
        env.make_image(name);
    }
    for name in ["app", "failed"] {
        fs::write(env.lock_file(name), vec![0x5a; 8192]).unwrap();
    }
    env.assert_read_refused("app", "a damaged record");
    let other = tempfile::tempdir().unwrap();
    untar(&fixture("schema10-store.tar"), other.path());
    fs::remove_file(env.root.join("store.conf")).unwrap();
    fs::copy(
        other.path().join("store/stowage.db"),
        env.root.join("stowage.db"),
    )
    .unwrap();
    env.ok(["images"]);
    env.assert_read_refused("app", "a damaged record, after the catalog");
    // The lost configuration is written anew from this store's claim (the damaged records stay a
    // problem to report), then gc runs.
    let out = env.run(["doctor", "--repair"]);
    assert!(stdout(&out).contains("cannot be read"), "{}", show(&out));
    env.ok(["gc"]);
    let names: Vec<String> = states(&env).into_iter().map(|s| s.0).collect();
    assert_eq!(names, ["app", "base", "failed"]);
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    env.assert_read_refused("app", "a damaged record, after gc");
    assert!(env.root.join("img/app/file").exists());
    assert!(env.root.join("img/failed/file").exists());
}

/// This release states nothing in the global lock file, so an older
/// release's catalog put in a store of this release whose configuration was
/// lost is never taken for the store's own — not in a store with no images
/// (the catalog naming an images directory elsewhere, and an image there
/// its writer failed), nor in one whose only image's record is damaged.
#[test]
fn an_older_catalog_the_global_lock_file_does_not_name_migrates_nothing() {
    let other = tempfile::tempdir().unwrap();
    untar(&fixture("schema10-store.tar"), other.path());
    let db = other.path().join("store/stowage.db");

    let env = Env::new();
    env.ok(["init"]);
    let victim = env.tmp.path().join("victim");
    fs::create_dir_all(victim.join("thesis")).unwrap();
    fs::write(victim.join("thesis/chapter"), "precious").unwrap();
    let planted = env.tmp.path().join("planted.db");
    fs::copy(&db, &planted).unwrap();
    let conn = rusqlite::Connection::open(&planted).unwrap();
    conn.execute(
        "INSERT OR REPLACE INTO config (key, value) VALUES ('images_dir', ?1)",
        [victim.to_str().unwrap()],
    )
    .unwrap();
    conn.execute(
        "INSERT INTO images (name, state, created_ms, last_used_ms) VALUES ('thesis', 'incomplete', 0, 0)",
        [],
    )
    .unwrap();
    drop(conn);
    fs::remove_file(env.root.join("store.conf")).unwrap();
    fs::copy(&planted, env.root.join("stowage.db")).unwrap();
    env.ok(["gc"]);
    env.run(["doctor", "--repair"]);
    env.ok(["gc"]);
    assert!(
        victim.join("thesis/chapter").exists(),
        "deleted outside the store"
    );
    assert!(states(&env).is_empty(), "{:?}", states(&env));

    let env = Env::new();
    env.make_image("app");
    fs::write(env.lock_file("app"), vec![0x5a; 8192]).unwrap();
    fs::remove_file(env.root.join("store.conf")).unwrap();
    fs::copy(&db, env.root.join("stowage.db")).unwrap();
    env.ok(["images"]);
    env.assert_read_refused("app", "a damaged record, after the catalog");
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
}

/// A migration killed while it converts an image whose state only its
/// lock file's token tells (a ready image the older release's catalog has
/// no row for): the next command's pass reads the token again, and the
/// image stays ready.
#[test]
fn a_migration_killed_mid_conversion_loses_no_images_state() {
    let env = old_store();
    let (bg, _) = env.paused(["images"], "migrate-converting-rowless");
    bg.kill_all();
    assert_eq!(states(&env), expected());
    assert_migrated(&env);
}

/// An Env whose root is the schema-10 store with an external images
/// directory, both moved to the test's own directory (the catalog pointed
/// at the directory there); and that directory.
fn old_external_store() -> (Env, PathBuf) {
    let mut env = Env::new();
    untar(&fixture("schema10-external.tar"), env.tmp.path());
    let images = env.tmp.path().join("ext-images");
    let id = stowage::dir::Dir::open(&images)
        .unwrap()
        .identity()
        .unwrap();
    env.root = env.tmp.path().join("ext");
    let conn = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    for (key, value) in [
        ("images_dir", images.to_str().unwrap()),
        ("images_dir_identity", &id),
    ] {
        conn.execute("UPDATE config SET value = ?1 WHERE key = ?2", [value, key])
            .unwrap();
    }
    fs::write(env.root.join("images-dir"), images.to_str().unwrap()).unwrap();
    (env, images)
}

/// A migration killed after it claimed the external images directory but
/// before its configuration was in place: the next use migrates again,
/// under another id, and the claim that names this very root is the
/// store's (it refused its own directory for good).
#[test]
fn a_migration_killed_between_its_claim_and_its_configuration_keeps_the_directory() {
    let (env, images) = old_external_store();
    let (bg, _) = env.paused(["images"], "migrate-claimed");
    bg.kill_all();
    assert!(!env.root.join("store.conf").exists());
    assert_eq!(states(&env), expected());
    env.build("new", "echo n > \"$STOWAGE_IMAGE_DIR/n\"");
    assert!(
        images.join("new/n").exists(),
        "{}",
        show(&env.run(["doctor"]))
    );
    env.ok(["rm", "base"]);
}

/// A copy taken of a store whose migration was killed (after its external
/// claims, before its configuration) is a store of its own: it migrates
/// and is used, its `img` never taken for the original's.
#[test]
fn a_copy_of_a_store_whose_migration_was_killed_migrates_on_its_own() {
    let env = old_store();
    let (bg, _) = env.paused(["images"], "migrate-claimed");
    bg.kill_all();
    let mut copy = Env::new();
    copy.root = env.tmp.path().join("copy");
    cp_a(&env.root, &copy.root);
    assert_eq!(states(&copy), expected());
    copy.build("new", "echo n > \"$STOWAGE_IMAGE_DIR/n\"");
    copy.ok(["rm", "base"]);
    assert_eq!(states(&env), expected());
}

/// A migration killed midway, then `doctor --repair` while an outside
/// program holds the catalog: whether the catalog is an older release's
/// cannot be told, so no configuration is written (one written then made
/// the catalog "already past it" and every image not yet converted lost
/// its state); the next use finishes the migration.
#[test]
fn a_repair_beside_a_busy_catalog_leaves_a_migration_to_finish() {
    if !tool_or_skip("python3", "python3") {
        return;
    }
    let env = old_store();
    let (bg, _) = env.paused(["images"], "migrate-converting-newborn");
    bg.kill_all();
    let holder = hold_catalog(&env);
    let mut c = env.cmd(["doctor", "--repair"]);
    c.env("STOWAGE_DEBUG_DB_BUSY_MS", "300");
    let out = output(c);
    holder.kill_all();
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(!env.root.join("store.conf").exists(), "{}", show(&out));
    assert_eq!(states(&env), expected());
}

/// `rm` while another process migrates the store (the image's record
/// converted already) waits for the migration, then removes the image
/// (it failed: "the store must be migrated first").
#[test]
fn rm_during_a_migration_waits_for_it() {
    let env = old_store();
    let (bg, go) = env.paused(["images"], "migrate-converting-rowless");
    let rm = env.spawn(["rm", "app"]);
    std::thread::sleep(std::time::Duration::from_millis(300));
    fs::remove_file(go).unwrap();
    let out = rm.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(code(&bg.finish()), Some(0));
    let mut left = expected();
    left.retain(|(n, _, _)| n != "app");
    assert_eq!(states(&env), left);
}

/// A plain `doctor` on a store still to migrate reports it and judges no
/// record (it stopped at "the store must be migrated first").
#[test]
fn a_plain_doctor_on_a_store_to_migrate_reports_it() {
    let env = old_store();
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = stdout(&out);
    assert!(
        said.contains("schema version 10") && said.contains("not checked until"),
        "{}",
        show(&out)
    );
    assert!(stderr(&out).is_empty(), "{}", show(&out));
    assert_eq!(catalog_version(&env), 10, "a plain doctor migrates nothing");
}

/// A reader that comes while another process migrates a store with an
/// external images directory (its own image's record converted, the
/// configuration not written yet) waits for the migration, then reads.
#[test]
fn a_reader_during_a_migration_waits_for_it() {
    let (env, _) = old_external_store();
    let (bg, go) = env.paused(["images"], "migrate-converting-base");
    let reader = env.spawn(["exec", "--read", "app", "--", "true"]);
    std::thread::sleep(std::time::Duration::from_millis(300));
    fs::remove_file(go).unwrap();
    let out = reader.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(code(&bg.finish()), Some(0));
    assert_eq!(states(&env), expected());
}

/// A store of the release before records whose catalog a crash left in the
/// middle of a transaction (its journal left: what a migration SIGKILLed in
/// its first transaction, or that release killed mid-transaction, leaves).
/// The journal is rolled back, the store migrated: every image keeps its
/// state and base (the store was taken for one of this release before).
#[test]
fn an_old_store_with_a_transaction_cut_short_migrates_whole() {
    let env = old_store();
    let script = r#"
import os, sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("PRAGMA cache_size=1")
c.execute("BEGIN IMMEDIATE")
c.execute("CREATE TABLE pad(x)")
for i in range(200):
    c.execute("INSERT INTO pad VALUES (?)", (os.urandom(900),))
os._exit(0)
"#;
    let Ok(out) = Command::new("python3")
        .args(["-c", script])
        .arg(env.root.join("stowage.db"))
        .output()
    else {
        eprintln!("skipped: python3 is not available");
        return;
    };
    assert!(out.status.success(), "{}", show(&out));
    assert!(env.root.join("stowage.db-journal").exists());
    assert_eq!(states(&env), expected());
    assert_migrated(&env);
}

/// The fixture on a 2 MiB tmpfs filled to leave 0 to 47 pages free: wherever
/// the full filesystem stops the migration, no image has lost its state once
/// space is freed (the older release's token is never overwritten before the
/// record beside it is written).
#[test]
fn a_migration_stopped_by_a_full_filesystem_loses_no_images_state() {
    let Some(m) = Mount::tmpfs("size=2m") else {
        return;
    };
    let mut env = Env::new();
    env.root = m.dir.join("store");
    let mut stopped = 0;
    for pages in 0..48u64 {
        let _ = fs::remove_dir_all(&env.root);
        untar(&fixture("schema10-store.tar"), &m.dir);
        let fill = m.dir.join("fill");
        let f = fs::File::create(&fill).unwrap();
        let st = nix::sys::statvfs::statvfs(&m.dir).unwrap();
        let free = st.blocks_available() * st.fragment_size();
        let len = free.saturating_sub(pages * 4096) as i64;
        nix::fcntl::fallocate(&f, nix::fcntl::FallocateFlags::empty(), 0, len).unwrap();
        let out = env.run(["images"]);
        drop(f);
        fs::remove_file(&fill).unwrap();
        stopped += usize::from(code(&out) != Some(0));
        assert_eq!(
            states(&env),
            expected(),
            "stopped with {pages} pages free: {}",
            show(&out)
        );
    }
    assert!(stopped > 0, "the filesystem stopped some migration");
}

/// A migration that gave up lets the older release back in: what it
/// changes then (here its rows, as its transactions do: a rewrite of
/// `base` failed, `failed` rebuilt) is what the pass that finishes the
/// migration derives from, not the records the one that gave up wrote.
#[test]
fn a_resumed_migration_takes_what_the_older_release_changed_meanwhile() {
    let env = old_store();
    let then = "i=0; while [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done";
    let holder = flock_holder(&env.lock_file("folded"), &env.sentinel("held"), then);
    let out = env.run(["exec", "--write", "other", "--wait", "1", "--", "true"]);
    holder.kill_all();
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    let base = fs::read(env.lock_file("base")).unwrap();
    assert!(
        base.windows(16).any(|w| w == b"stowage-record 1"),
        "the pass that gave up wrote base's record"
    );
    let db = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    db.execute_batch(
        "UPDATE images SET state = 'incomplete' WHERE name = 'base';
         UPDATE images SET state = 'ready' WHERE name = 'failed';",
    )
    .unwrap();
    drop(db);
    let mut want = expected();
    want[1] = st("base", "incomplete", None);
    want[3] = st("failed", "ready", None);
    assert_eq!(states(&env), want);
    assert_migrated(&env);
}

/// Images the older release kept without a row (its token said ready) keep
/// the last use their token recorded, and a creation no later: gc finds
/// them as unused as the others.
#[test]
fn an_old_store_keeps_its_images_last_use() {
    let env = old_store();
    for i in env.images_json() {
        if i["state"] == "ready" {
            assert_eq!(i["last_used"], "2023-11-14T22:13:20Z", "{i}");
            assert_eq!(i["created"], "2023-11-14T22:13:20Z", "{i}");
        }
    }
    let out = env.ok(["gc", "--unused-for", "30d", "--dry-run"]);
    let said = String::from_utf8_lossy(&out.stdout);
    for name in ["app", "base", "folded", "rowless"] {
        assert!(said.contains(&format!("would remove '{name}'")), "{said}");
    }
}

/// A store still to migrate, on a read-only mount: every command that
/// would read its images says it cannot be migrated there (69), rather
/// than listing tokens as damaged records.
#[test]
fn a_store_to_migrate_on_a_read_only_root_says_so() {
    let Some(m) = Mount::tmpfs("size=4m") else {
        return;
    };
    let mut env = Env::new();
    env.root = m.dir.join("store");
    untar(&fixture("schema10-store.tar"), &m.dir);
    let ro = Command::new("mount")
        .args(["-o", "remount,ro"])
        .arg(&m.dir)
        .status()
        .unwrap();
    assert!(ro.success());
    for args in [
        vec!["images"],
        vec!["gc", "--dry-run"],
        vec!["slots"],
        vec!["exec", "--read", "app", "--", "true"],
    ] {
        let out = env.run(&args);
        assert_eq!(code(&out), Some(69), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(err.contains("read-only"), "{args:?}: {err}");
        assert!(
            !err.contains("damaged") && !err.contains("cannot be read"),
            "{err}"
        );
    }
}

/// What a migration with the older catalog lost can know: each image's
/// state from its lock file's token (a tree with none, `doomed` whose
/// deletion only the catalog said, is adopted), no base (that release kept
/// bases only in its catalog).
fn expected_from_tokens() -> Vec<(String, String, Option<String>)> {
    let mut want = expected();
    for s in want.iter_mut() {
        s.2 = None;
    }
    want[2] = st("doomed", "incomplete", None);
    want
}

/// Deterministic noise of `len` bytes written over `file` at `at`.
fn noise_over(file: &Path, at: u64, len: usize) {
    use std::os::unix::fs::FileExt;
    let mut x: u32 = 0x9e37_79b9;
    let bytes: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    let f = fs::OpenOptions::new().write(true).open(file).unwrap();
    f.write_all_at(&bytes, at).unwrap();
}

/// A store of the release before records whose catalog is deleted,
/// emptied, damaged in its header (its schema version raised above this
/// release's among it) or replaced by another store's: every
/// image keeps the state its token says (they were all listed incomplete,
/// and a read of a ready image refused as a damaged record), the line
/// says the bases are not known, and the store is migrated whole.
#[test]
fn an_old_store_whose_catalog_is_lost_takes_each_images_state_from_its_token() {
    let other = Env::new();
    other.make_image("stranger");
    other.ok(["images"]);
    for loss in ["deleted", "emptied", "header", "version", "another store's"] {
        let env = old_store();
        let db = env.root.join("stowage.db");
        match loss {
            "deleted" => fs::remove_file(&db).unwrap(),
            "emptied" => fs::write(&db, "").unwrap(),
            "header" => noise_over(&db, 0, 14),
            "version" => {
                use std::os::unix::fs::FileExt as _;
                let f = fs::OpenOptions::new().write(true).open(&db).unwrap();
                f.write_all_at(&12u32.to_be_bytes(), 60).unwrap();
            }
            _ => {
                fs::copy(other.root.join("stowage.db"), &db).unwrap();
            }
        }
        let out = env.run(["exec", "--read", "base", "--", "true"]);
        assert_eq!(code(&out), Some(0), "{loss}: {}", show(&out));
        let said = stderr(&out);
        assert!(said.contains("bases not known"), "{loss}: {said}");
        assert!(!said.contains("damaged record"), "{loss}: {said}");
        assert_eq!(states(&env), expected_from_tokens(), "{loss}");
        assert_migrated(&env);
        env.ok(["exec", "--read", "rowless", "--", "true"]);
        let out = env.run(["doctor", "--repair"]);
        assert_eq!(code(&out), Some(0), "{loss}: {}", show(&out));
    }
    // A command that locks nothing, first, made a fresh configuration: the store was taken for
    // migrated, its tokens never read.
    let env = old_store();
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    env.ok(["exec", "--", "true"]);
    assert_eq!(states(&env), expected_from_tokens());
    // A repair as the first command migrates it so too (it reported 7 unreadable records).
    let env = old_store();
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(states(&env), expected_from_tokens());
    assert_pull_limit_kept(&env, "repair");
}

/// The old store's slot class `pull` (limit 3) survived its migration.
fn assert_pull_limit_kept(env: &Env, when: &str) {
    let out = env.ok(["slots", "--json"]);
    let classes: Value = serde_json::from_slice(&out.stdout).unwrap();
    let pull = classes
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "pull");
    let limit = pull.map(|c| c["limit"].clone());
    assert_eq!(limit, Some(3.into()), "{when}: {classes}");
}

/// A migration killed midway, then its catalog deleted: the next command
/// resumes from the tokens of the images not converted yet (never read as
/// damaged records), and the records already written keep what the rows
/// said (bases, a deletion).
#[test]
fn a_migration_killed_then_its_catalog_lost_resumes_from_the_tokens() {
    let env = old_store();
    let (bg, _) = env.paused(["images"], "migrate-converting-rowless");
    bg.kill_all();
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    let out = env.run(["exec", "--read", "rowless", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(states(&env), expected());
    assert_migrated(&env);
}

/// A catalog deleted while a migration converts (having read its rows):
/// the migration finishes from what it read, without a bare SQLite error
/// ("attempt to write a readonly database").
#[test]
fn a_catalog_deleted_during_its_migration_lets_it_finish() {
    let env = old_store();
    let (bg, go) = env.paused(["images"], "migrate-converting-base");
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    fs::remove_file(go).unwrap();
    let out = bg.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(states(&env), expected());
    assert_migrated(&env);
}

/// Noise over the older catalog past its first page (its `config` table):
/// the migration names the catalog in every line (it said only "database
/// disk image is malformed" and failed), sets it aside, and loses no
/// image's state.
#[test]
fn an_old_catalog_damaged_past_its_header_is_named_and_set_aside() {
    let env = old_store();
    let db = env.root.join("stowage.db");
    noise_over(&db, 4096, 400);
    let out = env.run(["images"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let err = stderr(&out);
    for line in err.lines() {
        assert!(line.contains(&env.root.display().to_string()), "{err}");
    }
    assert!(err.contains("set aside"), "{err}");
    let got: Vec<(String, String)> = states(&env).into_iter().map(|s| (s.0, s.1)).collect();
    let rows: Vec<(String, String)> = expected().into_iter().map(|s| (s.0, s.1)).collect();
    let tokens: Vec<(String, String)> = expected_from_tokens()
        .into_iter()
        .map(|s| (s.0, s.1))
        .collect();
    assert!(got == rows || got == tokens, "{got:?}");
    assert_migrated(&env);
}

/// The older catalog held by an outside program (`BEGIN EXCLUSIVE`): a
/// command that needs the store migrated waits a bounded time, then fails
/// with 75 naming the catalog and its holder (it failed with 1, "database
/// is locked", and `images` waited a minute and more); a listing goes on
/// from the tokens, saying so. Once let go, the store migrates.
#[test]
fn an_old_catalog_held_by_another_program_is_waited_for_boundedly() {
    if !tool_or_skip("python3", "python3") {
        return;
    }
    let env = old_store();
    let holder = hold_catalog(&env);
    let db = env.root.join("stowage.db").display().to_string();
    for args in [
        &["exec", "--read", "base", "--", "true"][..],
        &["exec", "--write", "zz", "--", "true"],
        &["gc"],
        &["gc", "--dry-run"],
        &["init"],
    ] {
        let mut c = env.cmd(args);
        c.env("STOWAGE_DEBUG_DB_BUSY_MS", "300");
        let out = output(c);
        assert_eq!(code(&out), Some(75), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&db) && err.contains("held by"),
            "{args:?}: {err}"
        );
    }
    for args in [&["doctor"][..], &["doctor", "--repair"]] {
        let mut c = env.cmd(args);
        c.env("STOWAGE_DEBUG_DB_BUSY_MS", "300");
        let out = output(c);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        let said = stdout(&out);
        assert!(
            said.contains(&db) && said.contains("held by"),
            "{args:?}: {said}"
        );
        assert!(!said.contains("cannot be read"), "{args:?}: {said}");
    }
    let mut c = env.cmd(["images", "--json"]);
    c.env("STOWAGE_DEBUG_DB_BUSY_MS", "300");
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stderr(&out).contains("listed from the older release's lock files"),
        "{}",
        show(&out)
    );
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let base = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "base");
    assert_eq!(
        base.map(|b| b["state"].clone()),
        Some("ready".into()),
        "{listed}"
    );
    holder.kill_all();
    assert_eq!(states(&env), expected());
    assert_migrated(&env);
}

/// The schema-10 store with its catalog deleted and the global lock file's
/// statement emptied: only the tokens in its lock files say it is one to
/// migrate.
fn old_store_known_by_its_tokens_alone() -> Env {
    let env = old_store();
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    fs::write(env.root.join("locks/global.lock"), "").unwrap();
    env
}

/// A store known as one to migrate by its tokens alone, whose migration
/// finds `folded` locked by another program, waits, and starts another
/// pass: that pass still takes the store for one to migrate (it took the
/// records the first pass wrote for this release's, wrote `store.conf` and
/// left `folded` and `rowless`, ready in their tokens, damaged records).
#[test]
fn a_migration_from_the_tokens_alone_that_waits_for_a_lock_converts_every_image() {
    let env = old_store_known_by_its_tokens_alone();
    let release = env.sentinel("flock-release");
    let holder = flock_holder(
        &env.lock_file("folded"),
        &env.sentinel("flock-held"),
        &format!(
            "i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
            r = release.display()
        ),
    );
    let migration = env.spawn(["images"]);
    wait_until("the migration waits for folded", || {
        flock_waited_on(&env.lock_file("folded"))
    });
    fs::write(&release, "").unwrap();
    let out = holder.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = migration.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(states(&env), expected_from_tokens());
    assert_migrated(&env);
    env.ok(["exec", "--read", "rowless", "--", "true"]);
    env.ok(["exec", "--read", "folded", "--", "true"]);
}

/// A store known as one to migrate by its tokens alone, its migration
/// killed midway (records written for some images, their tokens disabled)
/// or once every record was written but before `store.conf`: the next
/// command resumes it, and every image takes its token's state (`rowless`
/// was left a damaged record, its state unknown, and `store.conf` written
/// from nothing).
#[test]
fn a_migration_from_the_tokens_alone_killed_midway_is_resumed_to_the_end() {
    for point in ["migrate-converting-folded", "migrate-claimed"] {
        let env = old_store_known_by_its_tokens_alone();
        let (bg, _) = env.paused(["images"], point);
        bg.kill_all();
        assert!(!env.root.join("store.conf").exists(), "{point}");
        let out = env.run(["exec", "--read", "rowless", "--", "true"]);
        assert_eq!(code(&out), Some(0), "{point}: {}", show(&out));
        assert_eq!(states(&env), expected_from_tokens(), "{point}");
        assert_migrated(&env);
        assert_pull_limit_kept(&env, point);
    }
}

/// A store of this release whose `store.conf` is lost, with a token of the
/// release before records put in a lock file of its own: the records of
/// its use say it is no store to migrate, so nothing is migrated over them
/// (only a migration's records, beside that release's bytes, are not).
#[test]
fn a_token_put_in_a_store_of_this_release_makes_no_migration() {
    let env = Env::new();
    for name in ["base", "app"] {
        env.make_image(name);
    }
    let fx = tempfile::tempdir().unwrap();
    untar(&fixture("schema10-store.tar"), fx.path());
    fs::copy(
        fx.path().join("store/locks/images/folded.lock"),
        env.lock_file("folded"),
    )
    .unwrap();
    fs::remove_file(env.root.join("store.conf")).unwrap();
    let out = env.ok(["images"]);
    assert!(!stderr(&out).contains("migrating"), "{}", show(&out));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    let token = fs::read(env.lock_file("folded")).unwrap();
    assert!(
        token.starts_with(b"stowage-image "),
        "the token is left as it was"
    );
}

/// An image the older release knew neither a row nor a last use for gets
/// its tree's time as creation only: that time says when the tree was made
/// (unpacked, copied), never when it was used, so the migration counts it
/// used now, as an adoption does, and `gc --unused-for` keeps it.
#[test]
fn an_old_image_without_a_known_last_use_counts_as_used_at_its_migration() {
    let env = old_store();
    let lock = env.root.join("locks/images/rowless.lock");
    let bytes = fs::read(&lock).unwrap();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    let text = String::from_utf8(bytes[..end].to_vec()).unwrap();
    let body: String = text[..text.find("\ncrc=").unwrap() + 1]
        .lines()
        .filter(|l| !l.starts_with("used="))
        .map(|l| format!("{l}\n"))
        .collect();
    let token = format!("{body}crc={:08x}\n", token_crc(body.as_bytes()));
    let mut rewritten = bytes.clone();
    rewritten[..end].fill(0);
    rewritten[..token.len()].copy_from_slice(token.as_bytes());
    fs::write(&lock, rewritten).unwrap();
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    let tree = env.root.join("img/rowless");
    let aged = Command::new("touch")
        .args(["-d", "60 days ago"])
        .arg(&tree)
        .status();
    assert!(aged.unwrap().success());
    let out = env.ok(["gc", "--unused-for", "30d"]);
    assert_eq!(
        env.state("rowless").as_deref(),
        Some("ready"),
        "{}",
        show(&out)
    );
    assert!(env.root.join("img/rowless").is_dir(), "{}", show(&out));
}

/// What is planted where a migration reads a file of the older release's:
/// a FIFO (its open waited for a writer for good), or a symlink to
/// `/dev/zero` (read whole into memory, without end).
const PLANTS: [Plant; 2] = [Plant::Fifo, Plant::Symlink];

/// The most memory a command may hold at once here (KiB resident): reading
/// `/dev/zero` whole took 2 GiB, a bounded read a few KiB.
const PEAK_KIB: u64 = 128 << 10;

/// `args` run on `env` (the catalog's busy wait shortened), with at most
/// 1 GiB of address space, so that a read without end stops there
/// instead of filling the machine; failing if it held more than
/// [`PEAK_KIB`] at once.
fn run_capped(env: &Env, args: &[&str]) -> Output {
    let mut c = env.cmd(args);
    c.env("STOWAGE_DEBUG_DB_BUSY_MS", "300");
    // SAFETY: only setrlimit(2) between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 1 << 30,
                rlim_max: 1 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (out, peak) = output_and_peak(c);
    assert!(peak < PEAK_KIB, "{args:?} held {peak} KiB: {}", show(&out));
    out
}

/// A store to migrate with its catalog lost, and a FIFO or a symlink to
/// `/dev/zero` as the slot file of a class: the migration, which reads
/// the older release's slot files for their classes, refuses it without
/// waiting and finishes (it hung under the store-wide hold, every other
/// command waiting behind it, or read `/dev/zero` until memory ran out).
#[test]
fn a_planted_slot_file_neither_hangs_a_migration_nor_is_read_whole() {
    for plant in PLANTS {
        let env = old_store();
        fs::remove_file(env.root.join("stowage.db")).unwrap();
        let class = env.root.join("locks/slots/planted");
        fs::create_dir(&class).unwrap();
        plant.at(&class.join("0.lock"), Path::new("/dev/zero"));
        let out = run_capped(&env, &["images"]);
        assert_eq!(code(&out), Some(0), "{}: {}", plant.word(), show(&out));
        assert!(stderr(&out).contains("migrating"), "{}", show(&out));
        assert_eq!(states(&env), expected_from_tokens(), "{}", plant.word());
        assert_pull_limit_kept(&env, plant.word());
        let out = run_capped(&env, &["exec", "--write", "new", "--", "true"]);
        assert_eq!(code(&out), Some(0), "{}: {}", plant.word(), show(&out));
    }
}

/// The older catalog held by an outside program, and a FIFO or a symlink
/// to `/dev/zero` among the image lock files: the listing from the lock
/// files leaves it out without waiting on it or reading it whole (it hung
/// after saying "listed from the older release's lock files").
#[test]
fn a_listing_from_the_lock_files_neither_hangs_on_a_planted_one_nor_reads_it_whole() {
    if !tool_or_skip("python3", "python3") {
        return;
    }
    for plant in PLANTS {
        let env = old_store();
        let holder = hold_catalog(&env);
        plant.at(&env.lock_file("zz"), Path::new("/dev/zero"));
        let out = run_capped(&env, &["images", "--json"]);
        holder.kill_all();
        assert_eq!(code(&out), Some(0), "{}: {}", plant.word(), show(&out));
        assert!(
            stderr(&out).contains("listed from the older release's lock files"),
            "{}",
            show(&out)
        );
        let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
        let state = |name: &str| {
            let rows = listed.as_array().unwrap().iter();
            rows.filter(|i| i["name"] == name)
                .map(|i| i["state"].clone())
                .next()
        };
        assert_eq!(state("base"), Some("ready".into()), "{listed}");
        assert_eq!(state("zz"), None, "{listed}");
    }
}

/// An older store whose catalog is lost migrates from its lock files,
/// reading its slot classes from the slot files: each one claiming
/// terabytes or more (sparse, its record first) is read for what a slot
/// file holds, not whole (which never ended, or could not be allocated and
/// lost the class). Every class is kept.
#[test]
fn an_old_stores_slot_files_of_any_length_keep_their_class() {
    let env = old_store();
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    for file in ["0.lock", "1.lock", "2.lock", "high-0.lock"] {
        let path = env.root.join("locks/slots/pull").join(file);
        let long = fs::OpenOptions::new().write(true).open(path).unwrap();
        let len = [4u64 << 60, 15 << 40, 1 << 40];
        assert!(len.into_iter().any(|n| long.set_len(n).is_ok()));
    }
    let out = env.ok(["slots", "--json"]);
    let classes: Value = serde_json::from_slice(&out.stdout).unwrap();
    let pull = classes
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "pull");
    assert_eq!(
        pull.map(|c| c["limit"].clone()),
        Some(3.into()),
        "{classes}"
    );
}

/// The older release's catalog and its statement in the global lock file
/// put back from a copy taken before the migration (the configuration lost,
/// as a restore of those files leaves it) make no second migration once an
/// image has a record of this release's own use: no record is rewritten from
/// the stale rows, so an image rebuilt since stays ready and gc keeps it; the
/// catalog is set aside and made anew (before: `failed` went back to
/// "incomplete, its writer failed or died", and gc removed it).
#[test]
fn older_metadata_put_back_after_the_migration_changes_no_image() {
    let env = old_store();
    let backup = env.tmp.path().join("backup");
    fs::create_dir(&backup).unwrap();
    for f in ["stowage.db", "locks/global.lock"] {
        fs::copy(env.root.join(f), backup.join(f.replace("locks/", ""))).unwrap();
    }
    env.ok(["images"]);
    env.ok(["exec", "--write", "failed", "--", "true"]);
    let before = states(&env);
    assert!(before.contains(&st("failed", "ready", None)), "{before:?}");
    for f in ["stowage.db", "locks/global.lock"] {
        fs::copy(backup.join(f.replace("locks/", "")), env.root.join(f)).unwrap();
    }
    fs::remove_file(env.root.join("store.conf")).unwrap();
    let out = env.run(["doctor"]);
    assert!(
        stdout(&out).contains("in a store already past it"),
        "{}",
        show(&out)
    );
    let out = env.ok(["images"]);
    assert!(!stderr(&out).contains("migrating"), "{}", show(&out));
    assert_eq!(states(&env), before);
    env.ok(["doctor", "--repair"]);
    env.ok(["gc"]);
    let ready: Vec<_> = before.into_iter().filter(|s| s.1 == "ready").collect();
    assert_eq!(
        states(&env),
        ready,
        "gc removed what failed before, and no more"
    );
}

/// Makes the catalog at `db` what a later release's would be: schema
/// version `v` and a schema of its own (a table this release does not make)
/// beside the `images` table with `name` and `state` every release's has.
fn later_release_catalog(db: &Path, v: i64) {
    let conn = rusqlite::Connection::open(db).unwrap();
    let sql = format!(
        "CREATE TABLE IF NOT EXISTS images (name TEXT PRIMARY KEY, state TEXT) WITHOUT ROWID;
         CREATE TABLE later (x); PRAGMA user_version = {v};"
    );
    conn.execute_batch(&sql).unwrap();
}

/// Makes every record in an image lock file's `bytes` what a later release
/// writes: format 2, its CRC whole (a format line damaged is no later one).
fn later_release_record(bytes: &mut [u8]) {
    for slot in [0, 4096] {
        let area = &mut bytes[slot..slot + 4096];
        if !area.starts_with(b"stowage-record 1\n") {
            continue;
        }
        let end = area.iter().position(|&b| b == 0).unwrap_or(area.len());
        let text = String::from_utf8(area[..end].to_vec()).unwrap();
        let body = text[..text.find("\ncrc=").unwrap() + 1].replacen("record 1", "record 2", 1);
        let record = format!("{body}crc={:08x}\n", token_crc(body.as_bytes()));
        area[..record.len()].copy_from_slice(record.as_bytes());
    }
}

/// Asserts `stowage ARGS…` refuses a later release's store in one line
/// naming the way out (exit 1), and says nothing of damage.
fn assert_refused_as_newer(env: &Env, args: &[&str], what: &str) {
    let out = env.run(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {}", show(&out));
    assert!(
        err.contains("was made by a newer stowage") && err.contains(what),
        "{args:?}: {}",
        show(&out)
    );
    assert!(err.contains("upgrade stowage"), "{args:?}: {}", show(&out));
    assert_eq!(err.lines().count(), 1, "{args:?}: {}", show(&out));
    assert!(!err.contains("damaged"), "{args:?}: {}", show(&out));
}

/// Asserts `doctor` (and `doctor --repair`) report a later release's store
/// as a problem whose fix is an upgrade, and repair nothing of it.
fn assert_doctor_leaves_newer(env: &Env) {
    for args in [&["doctor"][..], &["doctor", "--repair"]] {
        let out = env.run(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", show(&out));
        let text = stdout(&out);
        assert!(text.contains("upgrade stowage"), "{args:?}: {}", show(&out));
        assert!(!text.contains("repaired"), "{args:?}: {}", show(&out));
    }
}

/// A store whose configuration a later release wrote (a later format) is
/// that release's: every command that reads the configuration refuses it,
/// and doctor never sets it aside or writes it back in this format.
#[test]
fn a_configuration_of_a_newer_format_is_refused_never_repaired() {
    let env = Env::new();
    env.make_image("base");
    let conf = env.root.join("store.conf");
    let text = fs::read_to_string(&conf).unwrap();
    let newer = text.replacen("stowage-store 1\n", "stowage-store 2\n", 1) + "future=yes\n";
    fs::write(&conf, &newer).unwrap();
    for args in [
        &["images"][..],
        &["lock-status"],
        &["gc"],
        &["rm", "base"],
        &["slots", "set", "pull", "2"],
        &["init"],
        &["exec", "--write", "new", "--", "true"],
    ] {
        assert_refused_as_newer(&env, args, "store.conf format 2");
    }
    assert_doctor_leaves_newer(&env);
    assert_eq!(fs::read_to_string(&conf).unwrap(), newer);
}

/// A catalog at a schema above this release's is a later release's: it is
/// refused, never set aside and made anew at this release's schema.
#[test]
fn a_catalog_of_a_newer_schema_is_refused_never_set_aside() {
    let env = Env::new();
    env.make_image("base");
    let db = env.root.join("stowage.db");
    later_release_catalog(&db, 99);
    assert_refused_as_newer(&env, &["images"], "schema version 99");
    assert_doctor_leaves_newer(&env);
    let conn = rusqlite::Connection::open(&db).unwrap();
    let v: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(v, 99);
    let names: Vec<String> = fs::read_dir(&env.root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.contains("damaged")), "{names:?}");
}

/// A later release's catalog in WAL mode is left byte for byte as it is by
/// doctor, plain or repairing: whether it is that release's is decided
/// before anything would switch it back to the rollback journal.
#[test]
fn a_later_releases_catalog_in_wal_mode_is_not_switched_by_doctor() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["images"]);
    let db = env.root.join("stowage.db");
    later_release_catalog(&db, 12);
    let conn = rusqlite::Connection::open(&db).unwrap();
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    drop(conn);
    let before = fs::read(&db).unwrap();
    // The file format bytes: 2 and 2 in WAL mode, 1 and 1 in the rollback journal's.
    assert_eq!(before[18..20], [2, 2]);
    assert_doctor_leaves_newer(&env);
    let after = fs::read(&db).unwrap();
    assert!(
        after == before,
        "changed: bytes 18..20 now {:?}",
        &after[18..20]
    );
    assert_refused_as_newer(&env, &["images"], "schema version 12");
}

/// An image whose record a later release wrote (`stowage-record 2`) is
/// refused to read and to write, never rewritten in this release's format.
#[test]
fn a_record_of_a_newer_format_is_refused_never_rewritten() {
    let env = Env::new();
    env.make_image("base");
    let lock = env.lock_file("base");
    let mut bytes = fs::read(&lock).unwrap();
    assert!(bytes.starts_with(b"stowage-record 1\n"));
    later_release_record(&mut bytes);
    fs::write(&lock, &bytes).unwrap();
    for args in [
        &["exec", "--read", "base", "--", "true"][..],
        &["exec", "--write", "base", "--", "true"],
        &["rm", "base"],
    ] {
        assert_refused_as_newer(&env, args, "the record of image 'base', format 2");
    }
    assert_eq!(fs::read(&lock).unwrap()[..4096], bytes[..4096]);
    assert!(env.images_dir().join("base").is_dir());
    let out = env.run(["doctor"]);
    assert!(stdout(&out).contains("upgrade stowage"), "{}", show(&out));
}

/// A record whose format line was damaged into a higher number (its CRC
/// no longer holds) is damage, not a later release's record: its image is
/// kept with its state unknown, never refused as a newer stowage's.
#[test]
fn a_record_damaged_in_its_format_line_is_damage_not_a_later_release() {
    let env = Env::new();
    env.make_image("base");
    env.make_image("other");
    let lock = env.lock_file("base");
    let mut bytes = fs::read(&lock).unwrap();
    for slot in [0, 4096] {
        if bytes[slot..].starts_with(b"stowage-record 1\n") {
            bytes[slot + 15] = b'7';
        }
    }
    fs::write(&lock, &bytes).unwrap();
    for args in [&["images"][..], &["gc", "--dry-run"], &["doctor"]] {
        let out = env.run(args);
        let text = format!("{}{}", stdout(&out), stderr(&out));
        assert!(!text.contains("newer"), "{args:?}: {}", show(&out));
        assert!(!text.contains("later format"), "{args:?}: {}", show(&out));
    }
    let out = env.ok(["gc", "--dry-run"]);
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(
        text.contains("kept 'base'") && text.contains("cannot be read"),
        "{}",
        show(&out)
    );
    let json = env.images_json();
    let base = json.iter().find(|i| i["name"] == "base").unwrap();
    assert!(base["newer_format"].is_null(), "{json:?}");
    let out = env.run(["exec", "--read", "base", "--", "true"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(!stderr(&out).contains("newer"), "{}", show(&out));
    env.ok(["exec", "--write", "base", "--", "true"]);
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// `images` and `gc` say of an image whose record a later release wrote
/// what exec says: a newer stowage's, its state not known here — never
/// `incomplete`, which says its writer failed, nor "cannot be read".
#[test]
fn an_image_a_newer_stowage_recorded_is_listed_and_kept_as_such() {
    let env = Env::new();
    env.make_image("base");
    env.make_image("other");
    let lock = env.lock_file("base");
    let mut bytes = fs::read(&lock).unwrap();
    later_release_record(&mut bytes);
    fs::write(&lock, &bytes).unwrap();
    let out = env.ok(["images"]);
    let row = stdout(&out)
        .lines()
        .find(|l| l.starts_with("base "))
        .map(str::to_owned)
        .unwrap_or_default();
    assert!(row.contains(" newer "), "{}", show(&out));
    assert!(!row.contains("incomplete"), "{}", show(&out));
    assert!(
        stderr(&out).contains("image 'base' was written by a newer stowage"),
        "{}",
        show(&out)
    );
    let json = env.images_json();
    let base = json.iter().find(|i| i["name"] == "base").unwrap();
    assert!(base["state"].is_null(), "{json:?}");
    assert_eq!(base["newer_format"], 2, "{json:?}");
    let other = json.iter().find(|i| i["name"] == "other").unwrap();
    assert_eq!(other["state"], "ready", "{json:?}");
    for args in [&["gc", "--dry-run"][..], &["gc", "--max-size", "0"]] {
        let out = env.ok(args);
        let text = format!("{}{}", stdout(&out), stderr(&out));
        assert!(
            text.contains("kept 'base'")
                && text.contains("its record is of a later format (2): a newer stowage's image"),
            "{args:?}: {}",
            show(&out)
        );
        assert!(!text.contains("cannot be read"), "{args:?}: {}", show(&out));
    }
    assert_eq!(fs::read(&lock).unwrap()[..8192], bytes[..8192]);
    assert!(env.images_dir().join("base").is_dir());
}

/// Every file under the root and what it holds: a refused command must
/// change none of it.
fn store_snapshot(env: &Env) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = walkdir_files(&env.root)
        .into_iter()
        .map(|p| {
            let rel = p.strip_prefix(&env.root).unwrap().display().to_string();
            (rel, fs::read(&p).unwrap_or_default())
        })
        .collect();
    files.sort();
    files
}

/// Asserts each command line (run as on NFS, where lock files stay) is
/// refused as a later release's store with `what`, and changes no file.
fn assert_refused_untouched(env: &Env, commands: &[&[&str]], what: &str) {
    for args in commands {
        let before = store_snapshot(env);
        let out = env
            .cmd(*args)
            .env("STOWAGE_DEBUG_FILESYSTEM", "nfs")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains("was made by a newer stowage") && err.contains(what),
            "{args:?}: {}",
            show(&out)
        );
        let names = |s: &[(String, Vec<u8>)]| s.iter().map(|f| f.0.clone()).collect::<Vec<_>>();
        let after = store_snapshot(env);
        assert_eq!(
            names(&after),
            names(&before),
            "{args:?} made or removed files"
        );
        assert!(after == before, "{args:?} wrote into the store");
    }
}

/// A store of a later release is refused by every command before it takes,
/// waits for, creates or writes anything: the store-wide hold is not taken
/// (no user is waited for, no lock file hinted), no lock file is made for a
/// new image, gc takes no lock, and a catalog of a later schema keeps every
/// command but exec off, `rm` included.
#[test]
fn a_newer_store_is_refused_before_anything_is_taken_or_written() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    env.ok(["slots", "set", "p", "1"]);
    let every: &[&[&str]] = &[
        &["exec", "--store-wide", "--", "true"],
        &["exec", "--store-wide", "--no-wait", "--", "true"],
        &["exec", "--write", "fresh", "--", "true"],
        &["exec", "--write", "fresh", "--from", "a", "--", "true"],
        &["exec", "--slot", "p", "--write", "fresh", "--", "true"],
        &["rm", "a"],
        &["gc"],
        &["gc", "--dry-run"],
        &["images"],
        &["lock-status"],
        &["slots"],
        &["slots", "set", "p", "2"],
        &["slots", "rm", "p"],
        &["init"],
    ];
    // A user of image a: a store-wide command would wait for it.
    let reader = env.hold(&["--read", "a"], "reading");
    let conf = env.root.join("store.conf");
    let text = fs::read_to_string(&conf).unwrap();
    fs::write(
        &conf,
        text.replacen("stowage-store 1\n", "stowage-store 2\n", 1),
    )
    .unwrap();
    assert_refused_untouched(&env, every, "store.conf format 2");
    fs::write(&conf, &text).unwrap();

    let db = env.root.join("stowage.db");
    let before = fs::read(&db).ok();
    later_release_catalog(&db, 12);
    let schema = "schema version 12";
    let but_exec: Vec<&[&str]> = every.iter().copied().filter(|a| a[0] != "exec").collect();
    assert_refused_untouched(&env, &but_exec, schema);
    // exec reads no catalog, but a store-wide hold is refused by it too.
    assert_refused_untouched(&env, &every[..2], schema);
    match before {
        Some(bytes) => fs::write(&db, bytes).unwrap(),
        None => fs::remove_file(&db).unwrap(),
    }

    // A record of a later format (b's, not in use): a store-wide hold would hint it.
    let lock = env.lock_file("b");
    let mut bytes = fs::read(&lock).unwrap();
    later_release_record(&mut bytes);
    fs::write(&lock, &bytes).unwrap();
    assert_refused_untouched(&env, &every[..2], "the record of image 'b', format 2");
    env.release("release");
    assert!(reader.finish().status.success());
}

/// The store id `store.conf` names.
fn store_id(env: &Env) -> String {
    let conf = fs::read_to_string(env.root.join("store.conf")).unwrap();
    let id = conf.lines().find_map(|l| l.strip_prefix("id="));
    id.unwrap().to_owned()
}

/// A migrated store that loses `store.conf` is a store of this release that
/// lost it, not one to migrate again: commands that need it refuse, naming
/// the repair, and `doctor --repair` writes it with the store's own id (its
/// claim on `img` keeps it), never a new one.
#[test]
fn a_migrated_store_that_lost_its_configuration_is_repaired_not_migrated_again() {
    let env = old_store();
    env.ok(["images"]);
    let (id, before) = (store_id(&env), states(&env));
    fs::remove_file(env.root.join("store.conf")).unwrap();
    let conf = env.root.join("store.conf");
    let out = env.ok(["images"]);
    assert!(!stderr(&out).contains("migrating"), "{}", show(&out));
    assert!(!conf.exists(), "images wrote a configuration");
    for args in [&["exec", "--write", "new", "--", "true"][..], &["gc"]] {
        let out = env.run(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(err.contains("store.conf is missing"), "{args:?}: {err}");
        assert!(err.contains("doctor --repair'"), "{args:?}: {err}");
        assert!(!err.contains("migrating"), "{args:?}: {err}");
        assert!(!conf.exists(), "{args:?} wrote a configuration");
    }
    let out = env.ok(["doctor", "--repair"]);
    assert!(stdout(&out).contains("written anew"), "{}", show(&out));
    assert_eq!(store_id(&env), id, "the store keeps its id");
    // The repair finishes the removal the old store left interrupted.
    let kept: Vec<_> = before.into_iter().filter(|i| i.0 != "doomed").collect();
    assert_eq!(states(&env), kept, "no image changed");
    env.ok(["exec", "--write", "new", "--", "true"]);
}

/// The same with an external images directory: the migration's claim on
/// it (not on `img`) says the store is past its migration, and keeps its id.
#[test]
fn a_migrated_external_store_that_lost_its_configuration_is_repaired_not_migrated_again() {
    let (env, _images) = old_external_store();
    env.ok(["images"]);
    let (id, before) = (store_id(&env), states(&env));
    let conf = env.root.join("store.conf");
    fs::remove_file(&conf).unwrap();
    let out = env.ok(["images"]);
    assert!(!stderr(&out).contains("migrating"), "{}", show(&out));
    assert!(!conf.exists(), "images wrote a configuration");
    let out = env.run(["exec", "--write", "new", "--", "true"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("doctor --repair'"), "{}", show(&out));
    assert!(!conf.exists(), "exec wrote a configuration");
    env.ok(["doctor", "--repair"]);
    assert_eq!(store_id(&env), id, "the store keeps its id");
    // The repair finishes the removal the old store left interrupted.
    let kept: Vec<_> = before.into_iter().filter(|i| i.0 != "doomed").collect();
    assert_eq!(states(&env), kept, "no image changed");
    env.ok(["exec", "--write", "new", "--", "true"]);
}
