//! New images written without the database (src/written.rs, "New images"):
//! the write makes its image's lock file itself (`O_EXCL`), its tree, its
//! marker and its records, and takes no global lock; the next transaction
//! folds the record into a new row. Whatever step the writer dies at, and
//! whatever runs beside it (adoption, a removal, a failed request, a
//! store-wide command, a reader), no image is lost that its writer made
//! and none looks ready that is not.

use std::fs;

use crate::common::*;

/// A store whose global lock file states the images directory (any
/// transaction of this release writes it): the condition for a new
/// image's write without the database.
fn store() -> Env {
    let env = Env::new();
    env.make_image("base");
    env
}

fn lock_text(env: &Env, enc: &str) -> String {
    let bytes = fs::read(env.lock_file(enc)).unwrap();
    String::from_utf8_lossy(&bytes[..bytes.len().min(400)]).into_owned()
}

#[test]
fn a_new_image_takes_no_global_lock_and_is_folded_in_later() {
    let env = store();
    // Nobody can get the global lock: a write that needed a transaction
    // would wait for it (and fail after --wait).
    let global = hold_global(&env);
    let out = env.run([
        "exec",
        "--write",
        "app",
        "--wait",
        "0.3",
        "--",
        "sh",
        "-c",
        "head -c 100000 /dev/zero > \"$STOWAGE_IMAGE_DIR/big\"",
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(env.marker("app").exists(), "the write left its marker");
    assert!(lock_text(&env, "app").contains("state=ready"));
    // Read at once, without a transaction either.
    let out = env.run(["exec", "--read", "app", "--wait", "0.3", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    global.kill_all();
    // The next transaction makes its row: ready, sized, no base.
    let app = env.image("app").expect("folded into a row");
    assert_eq!(app["state"], "ready", "{app}");
    assert!(app["size_bytes"].as_u64().unwrap() >= 100_000, "{app}");
    assert!(app["base"].is_null(), "{app}");
    assert!(!env.marker("app").exists(), "folded, the marker goes");
    env.ok(["doctor"]);
}

#[test]
fn a_failed_new_image_is_incomplete_and_its_empty_tree_goes() {
    let env = store();
    let out = env.run(["exec", "--write", "app", "--", "false"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        !env.images_dir().join("app").exists(),
        "an empty tree of a failed write goes, as the database's way has it"
    );
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    // Written again, it is ready.
    env.make_image("app");
    env.ok(["exec", "--read", "app", "--", "true"]);
}

/// A new image's writer SIGKILLed (with its command) at `point` leaves
/// `expect` (a state, or none: no row) once the next command has looked,
/// lets no reader in unless ready, and the name can be written again.
fn killed_at(point: &str, expect: Option<&str>) {
    let env = store();
    let (writer, _file) = env.paused(
        [
            "exec",
            "--write",
            "app",
            "--",
            "sh",
            "-c",
            "echo half > \"$STOWAGE_IMAGE_DIR/file\"",
        ],
        point,
    );
    writer.kill_all();
    let out = env.run(["exec", "--read", "app", "--", "true"]);
    let want = if expect == Some("ready") { 0 } else { 66 };
    assert_eq!(code(&out), Some(want), "{point}: {}", show(&out));
    assert_eq!(env.state("app").as_deref(), expect, "{point}");
    assert!(!env.marker("app").exists(), "{point}: folded");
    env.make_image("app");
    env.ok(["exec", "--read", "app", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"), "{point}");
    env.ok(["doctor"]);
}

#[test]
fn a_new_images_writer_killed_after_making_its_tree_leaves_no_row() {
    // Lock file (empty) and an empty tree: the next write adopts the tree.
    killed_at("fast-new-made", None);
}

#[test]
fn a_new_images_writer_killed_after_its_marker_leaves_no_row() {
    killed_at("fast-write-marked", None);
}

#[test]
fn a_new_images_writer_killed_before_its_command_leaves_it_incomplete() {
    killed_at("exec-before-spawn", Some("incomplete"));
}

#[test]
fn a_new_images_writer_killed_after_its_command_leaves_it_incomplete() {
    killed_at("fast-write-measured", Some("incomplete"));
}

#[test]
fn a_new_image_being_written_is_listed_creating_and_left_alone_by_adoption() {
    let env = store();
    let writer = env.hold(&["--write", "app"], "started");
    assert!(env.marker("app").exists());
    assert_eq!(env.state("app").as_deref(), Some("creating"));
    // Its tree has no row yet: no adoption may take it (as incomplete).
    env.ok(["init"]);
    let out = env.ok(["doctor"]);
    assert!(!stderr(&out).contains("app"), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("creating"));
    let entry = env.lock_entry("app").expect("its lock is shown");
    assert_eq!(entry["state"], "exclusive", "{entry}");
    assert_eq!(entry["image_state"], "creating", "{entry}");
    env.release("release");
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "app", "--", "true"]);
}

#[test]
fn adoption_leaves_a_finished_new_image_to_its_fold() {
    // A listing may miss a marker (an NFS client caches directory
    // listings): the record in the lock file still makes the tree no
    // orphan, for whoever holds the image next to fold.
    let env = store();
    env.make_image_with_marker_missed("app");
    env.ok(["init"]);
    let out = env.ok(["doctor"]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("PROBLEM"),
        "{}",
        show(&out)
    );
    env.ok(["gc", "--dry-run"]);
    // Not adopted (as incomplete): the writer's record is the truth.
    env.ok(["exec", "--read", "app", "--", "true"]);
    env.ok(["exec", "--write", "app", "--from", "base", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn a_read_waits_for_a_new_image_being_written() {
    let env = store();
    let writer = env.hold(&["--write", "app"], "started");
    let reader = env.spawn(["exec", "--read", "app", "--wait", "30", "--", "true"]);
    env.wait_for_waiter("app");
    env.release("release");
    assert_eq!(code(&writer.finish()), Some(0));
    let out = reader.finish();
    assert_eq!(code(&out), Some(0), "the read waited: {}", show(&out));
}

#[test]
fn rm_removes_a_new_image_whose_marker_a_listing_missed() {
    let env = store();
    env.make_image_with_marker_missed("app");
    let out = env.ok(["rm", "app"]);
    assert!(stderr(&out).contains("removed 'app'"), "{}", show(&out));
    assert!(!env.images_dir().join("app").exists(), "its tree went");
    assert_eq!(env.state("app"), None);
    assert!(!env.lock_file("app").exists());
    env.ok(["doctor"]);
}

#[test]
fn a_failed_request_keeps_the_record_of_a_new_image() {
    // `app` was written without the database and not folded yet; a request
    // that takes its lock, then fails on another, must not take its lock
    // file for a leftover of an image without a row.
    let env = store();
    let global = hold_global(&env);
    env.ok(["exec", "--write", "app", "--wait", "0.3", "--", "true"]);
    global.kill_all();
    let reader = env.hold(&["--read", "base"], "started");
    let out = env.run([
        "exec",
        "--write",
        "app",
        "--write",
        "base",
        "--no-wait",
        "--",
        "true",
    ]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    env.release("release");
    reader.finish();
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "app", "--", "true"]);
}

#[test]
fn a_new_image_is_not_written_beside_a_store_wide_command() {
    let env = store();
    let hold = env.hold(&["--store-wide"], "started");
    // Its lock file is new: no hint of the hold in it. store.lock says.
    let out = env.run(["exec", "--write", "app", "--wait", "0.3", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert!(!env.images_dir().join("app").exists());
    env.release("release");
    assert_eq!(code(&hold.finish()), Some(0));
    // And a store-wide command waits for a new image's writer.
    let writer = env.hold_until(&["--write", "app"], "w-started", "w-release");
    let out = env.run(["exec", "--store-wide", "--wait", "0.3", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    env.release("w-release");
    assert_eq!(code(&writer.finish()), Some(0));
    env.ok(["exec", "--store-wide", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn a_new_image_in_a_store_not_stating_its_images_directory_goes_the_databases_way() {
    // A store last used by a release that states no images directory:
    // nothing proves that no such release makes transactions here.
    let env = store();
    let global = env.root.join("locks/global.lock");
    fs::write(&global, "").unwrap();
    let held = hold_global(&env);
    let out = env.run(["exec", "--write", "app", "--wait", "0.3", "--", "true"]);
    assert_eq!(
        code(&out),
        Some(75),
        "it waited for the global lock: {}",
        show(&out)
    );
    held.kill_all();
    env.ok(["exec", "--write", "app", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn a_new_image_whose_command_never_starts_leaves_nothing() {
    let env = store();
    let (writer, _file) = env.paused(
        ["exec", "--write", "app", "--", "true"],
        "exec-before-spawn",
    );
    writer.signal(libc::SIGTERM);
    let out = writer.finish();
    assert_eq!(code(&out), Some(143), "{}", show(&out));
    assert!(
        !env.images_dir().join("app").exists(),
        "its empty tree went"
    );
    assert!(!env.lock_file("app").exists(), "its lock file went");
    assert!(!env.marker("app").exists(), "its marker went");
    assert_eq!(env.state("app"), None);
    env.ok(["doctor"]);
}

#[test]
fn a_name_whose_lock_file_was_kept_is_written_anew_without_the_database() {
    // On NFS a removal keeps the image's lock file (emptied): the name's
    // next write is still a new image's, without the database.
    let env = store();
    env.make_image("app");
    env.ok(["rm", "app"]);
    fs::write(env.lock_file("app"), "").unwrap();
    env.build_without_database("app", "echo again > \"$STOWAGE_IMAGE_DIR/file\"");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "app", "--", "true"]);
    env.ok(["doctor"]);
}

#[test]
fn a_new_tree_over_an_interrupted_removal_is_the_image() {
    // A removal killed once the tree is in the trash leaves a `deleting`
    // row and an emptied lock file; a write of the name makes a tree of
    // its own: that is the image now, and gc must not finish the old
    // removal on it.
    let env = store();
    env.make_image("app");
    env.ok(["images"]);
    let (rm, _file) = env.paused(["rm", "app"], "rm-moved");
    rm.kill_all();
    assert_eq!(env.state("app").as_deref(), Some("deleting"));
    env.build_without_database("app", "echo new > \"$STOWAGE_IMAGE_DIR/file\"");
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

#[test]
fn a_new_image_after_init_images_dir_is_written_in_that_directory() {
    // init's own transaction began stating the default images directory;
    // the first new image, written without the database on what the
    // global lock file states, must be made in the one init chose.
    let env = Env::new();
    let images = env.tmp.path().join("elsewhere/img");
    fs::create_dir_all(&images).unwrap();
    env.ok(["init", "--images-dir", images.to_str().unwrap()]);
    env.build("app", "echo made > \"$STOWAGE_IMAGE_DIR/file\"");
    assert!(images.join("app/file").exists(), "not made where init said");
    assert!(!env.root.join("img/app").exists());
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "app", "--", "true"]);
}

#[test]
fn a_dry_run_leaves_a_new_image_whose_marker_a_listing_missed_to_its_fold() {
    // Only its record in the lock file says `app` exists. A gc that only
    // looks, and a doctor that does not repair, must not take that file
    // for a leftover, nor fold the record themselves: they write nothing.
    let env = store();
    env.make_image_with_marker_missed("app");
    // Everything else folded first (base's marker): what follows has
    // nothing of its own to record.
    env.ok(["images"]);
    let db = env.root.join("stowage.db");
    let before = fs::read(&db).unwrap();
    let record = lock_text(&env, "app");
    let out = env.ok(["gc", "--dry-run"]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("app"),
        "{}",
        show(&out)
    );
    assert!(fs::read(&db).unwrap() == before, "gc --dry-run wrote");
    env.run(["doctor"]);
    assert!(fs::read(&db).unwrap() == before, "doctor wrote");
    assert_eq!(
        lock_text(&env, "app"),
        record,
        "a dry run changed the record"
    );
    // Still read as written; a write the database's way (a clone's
    // lineage is recorded) folds it first.
    env.ok(["exec", "--read", "app", "--", "true"]);
    env.ok(["exec", "--write", "app", "--from", "base", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}
