//! The record's crash table (docs/design.md, "Crashes"): a process killed
//! (SIGKILL) at each step of a write, a new image, an rm or a hold of the
//! whole store leaves each image's record saying either its state before,
//! or `incomplete` with the evidence — never `ready` over a tree that was
//! being changed. A record torn in the middle of its write is the previous
//! one; one whose state cannot be read at all is kept and reported.

use std::fs;
use std::os::unix::fs::FileExt;

use crate::common::*;
use stowage::image_record::{self, SLOT, State};

/// Writes `name`, ready, with one file.
fn ready(env: &Env, name: &str) {
    let out = env.build(name, "echo v1 > \"$STOWAGE_IMAGE_DIR/file\"");
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

fn seen(env: &Env, name: &str) -> image_record::Seen {
    let file = fs::File::open(env.lock_file(name)).unwrap();
    image_record::read(&file).unwrap()
}

/// The slot (0 or 1) holding the record with the higher sequence number.
fn newest_slot(env: &Env, name: &str) -> u64 {
    let bytes = fs::read(env.lock_file(name)).unwrap();
    let seq = |i: usize| {
        image_record::Seen::parse(&bytes[i * SLOT..(i + 1) * SLOT])
            .record
            .map(|r| r.seq)
    };
    match (seq(0), seq(1)) {
        (Some(a), Some(b)) if b > a => 1,
        (_, None) | (Some(_), Some(_)) => 0,
        (None, Some(_)) => 1,
    }
}

/// Garbage over the middle of slot `slot`: a write torn by a crash.
fn tear(env: &Env, name: &str, slot: u64) {
    let f = fs::OpenOptions::new()
        .write(true)
        .open(env.lock_file(name))
        .unwrap();
    f.write_all_at(&[0x5a; 700], slot * SLOT as u64 + 40)
        .unwrap();
}

fn kill_at(env: &Env, args: &[&str], point: &str) {
    let (bg, _) = env.paused(args.iter().copied(), point);
    bg.kill_all();
}

fn assert_reads_refused(env: &Env, name: &str) {
    let out = env.run(["exec", "--read", name, "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
}

#[test]
fn a_writer_killed_before_its_record_changes_leaves_the_image_ready() {
    let env = Env::new();
    ready(&env, "app");
    kill_at(
        &env,
        &["exec", "--write", "app", "--", "true"],
        "write-locked",
    );
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("app", "file"), "v1\n");
}

#[test]
fn a_writer_killed_once_its_record_says_writing_leaves_the_image_incomplete() {
    for point in ["exec-started", "exec-before-spawn", "write-finishing"] {
        let env = Env::new();
        ready(&env, "app");
        kill_at(&env, &["exec", "--write", "app", "--", "true"], point);
        assert_eq!(env.state("app").as_deref(), Some("incomplete"), "{point}");
        assert_reads_refused(&env, "app");
        let r = seen(&env, "app").record.unwrap();
        assert_eq!(r.state, State::Writing, "{point}: the record as written");
        assert!(r.writer.is_some(), "{point}: names the writer that died");
    }
}

#[test]
fn a_writer_killed_in_its_command_leaves_the_image_incomplete_and_gc_removes_it() {
    let env = Env::new();
    ready(&env, "app");
    env.kill_a_writer_in_its_command("app");
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    assert_reads_refused(&env, "app");
    let out = env.ok(["gc"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("removed 'app'"));
    assert_eq!(env.state("app"), None);
    assert!(!env.images_dir().join("app").exists());
}

#[test]
fn a_new_image_killed_before_its_tree_exists_is_incomplete_and_its_name_reusable() {
    let env = Env::new();
    env.ok(["init"]);
    kill_at(
        &env,
        &["exec", "--write", "app", "--", "true"],
        "new-recorded",
    );
    assert!(!env.images_dir().join("app").exists());
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    ready(&env, "app");
    assert_eq!(env.read_in_image("app", "file"), "v1\n");
}

#[test]
fn a_new_image_killed_with_its_tree_made_is_incomplete_and_gc_removes_it() {
    let env = Env::new();
    env.ok(["init"]);
    kill_at(
        &env,
        &["exec", "--write", "app", "--", "true"],
        "exec-started",
    );
    assert!(env.images_dir().join("app").exists());
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    env.ok(["gc"]);
    assert_eq!(env.state("app"), None);
    assert!(!env.images_dir().join("app").exists());
    assert!(!env.lock_file("app").exists(), "its lock file goes too");
}

#[test]
fn a_command_that_never_starts_puts_the_record_back() {
    let env = Env::new();
    ready(&env, "app");
    let before = seen(&env, "app").record.unwrap();
    let out = env.run(["exec", "--write", "app", "--", "/nonexistent/builder"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    let after = seen(&env, "app").record.unwrap();
    assert_eq!(after.state, State::Ready);
    assert_eq!(
        (after.created, after.changed, &after.outcome),
        (before.created, before.changed, &before.outcome)
    );
    let out = env.run(["exec", "--write", "new", "--", "/nonexistent/builder"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("new"), None, "a new image that never ran is gone");
    assert!(!env.images_dir().join("new").exists());
    assert!(!env.lock_file("new").exists());
}

#[test]
fn a_write_torn_as_it_began_leaves_the_image_as_it_was() {
    let env = Env::new();
    ready(&env, "base");
    // The `writing` record went to the slot not holding `ready`; torn.
    let older = 1 - newest_slot(&env, "base");
    tear(&env, "base", older);
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("base", "file"), "v1\n");
}

#[test]
fn a_write_torn_as_it_ended_leaves_the_state_unknown_and_the_image_kept() {
    let env = Env::new();
    ready(&env, "app");
    env.build("app", "echo v2 > \"$STOWAGE_IMAGE_DIR/file\"");
    // The last record (`ready`) torn: beside it, `writing` by a writer now
    // gone. Was the build complete? Not known: kept, never collected.
    tear(&env, "app", newest_slot(&env, "app"));
    assert!(seen(&env, "app").damaged);
    assert_reads_refused(&env, "app");
    let out = env.ok(["gc"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("kept 'app': its state is not known"),
        "{said}"
    );
    assert!(env.images_dir().join("app/file").exists());
}

#[test]
fn an_image_whose_record_cannot_be_read_is_kept_reported_and_settled_on_request() {
    let env = Env::new();
    for name in ["app", "other"] {
        ready(&env, name);
        tear(&env, name, 0);
        tear(&env, name, 1);
        assert!(seen(&env, name).damaged);
        assert_reads_refused(&env, name);
    }
    assert_eq!(env.state("app").as_deref(), Some("incomplete"), "listed");
    let out = env.ok(["gc", "--unused-for", "0s"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("kept 'app': its state is not known"),
        "{said}"
    );
    assert!(env.images_dir().join("app/file").exists());
    let out = env.run(["doctor"]);
    assert_ne!(code(&out), Some(0));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("app"),
        "doctor names it: {}",
        show(&out)
    );
    // What the messages advise works: a write settles it (the tree kept),
    // and so does rm.
    env.ok(["exec", "--write", "app", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("app", "file"), "v1\n");
    env.ok(["rm", "other"]);
    assert_eq!(env.state("other"), None);
    assert!(!env.images_dir().join("other").exists());
}

#[test]
fn an_rm_killed_midway_is_finished_by_the_next_rm_or_gc() {
    for (point, finisher) in [
        ("rm-marked", "rm"),
        ("rm-moved", "rm"),
        ("rm-marked", "gc"),
        ("rm-moved", "gc"),
    ] {
        let env = Env::new();
        ready(&env, "app");
        kill_at(&env, &["rm", "app"], point);
        assert_eq!(env.state("app").as_deref(), Some("deleting"), "{point}");
        assert_reads_refused(&env, "app");
        let out = match finisher {
            "rm" => env.run(["rm", "app"]),
            _ => env.run(["gc"]),
        };
        assert_eq!(code(&out), Some(0), "{point} {finisher}: {}", show(&out));
        assert_eq!(env.state("app"), None, "{point} {finisher}");
        if point == "rm-moved" {
            // The tree the killed rm moved is the trash's: gc empties it.
            env.ok(["gc"]);
        }
        assert!(!env.images_dir().join("app").exists(), "{point} {finisher}");
        let trash: Vec<_> = fs::read_dir(env.root.join("trash")).unwrap().collect();
        assert!(trash.is_empty(), "{point} {finisher}: trash emptied");
    }
}

/// A removal killed once it marked the image is finished by the next write
/// of the name, and its tree deleted once the write lets go, as rm deletes
/// it; meanwhile the tree is the writer's, no leftover of the trash (before:
/// it stayed in the trash, doctor exited 1 until a gc deleted it).
#[test]
fn an_rm_killed_midway_is_finished_by_the_next_write_which_deletes_its_tree() {
    let env = Env::new();
    ready(&env, "app");
    kill_at(&env, &["rm", "app"], "rm-marked");
    assert_eq!(env.state("app").as_deref(), Some("deleting"));
    let args = [
        "exec",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        "! test -e \"$STOWAGE_IMAGE_DIR/file\"",
    ];
    let (write, pause) = env.paused(args, "exec-started");
    let trash = || fs::read_dir(env.root.join("trash")).unwrap().count();
    assert_eq!(trash(), 1, "the old tree is in the trash");
    let out = env.ok(["doctor"]);
    assert!(
        stdout(&out).contains("1 being deleted by running removals"),
        "{}",
        show(&out)
    );
    fs::remove_file(&pause).unwrap();
    let out = write.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(trash(), 0, "the old tree is deleted");
    env.ok(["doctor"]);
}

#[test]
fn a_waiting_writer_killed_leaves_no_hint_that_holds_readers_back() {
    let env = Env::new();
    ready(&env, "app");
    let reader = env.hold_until(&["--read", "app"], "r-started", "r-release");
    let writer = env.spawn(["exec", "--write", "app", "--", "true"]);
    env.wait_for_waiter("app");
    assert!(seen(&env, "app").writer_waits, "the writer says it waits");
    writer.kill_all();
    // A new reader is not held back by a writer that no longer waits.
    let out = env.run(["exec", "--read", "app", "--no-wait", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.release("r-release");
    assert_eq!(code(&reader.finish()), Some(0));
    env.build("app", "true");
    assert!(!seen(&env, "app").writer_waits, "the hint is cleared");
}

#[test]
fn a_store_wide_holder_killed_leaves_no_hint_that_holds_anyone_back() {
    let env = Env::new();
    ready(&env, "app");
    let started = env.sentinel("sw-started");
    let holder = env.spawn([
        "exec",
        "--store-wide",
        "--",
        "sh",
        "-c",
        &format!("touch '{}'; sleep 60", started.display()),
    ]);
    wait_for_file(&started);
    assert!(
        seen(&env, "app").store_wide,
        "the hold says so in each record"
    );
    holder.kill_all();
    let out = env.run(["exec", "--read", "app", "--no-wait", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.build("app", "true");
    assert!(!seen(&env, "app").store_wide, "the hint is cleared");
}

#[test]
fn a_torn_slot_class_record_keeps_the_class() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2", "--reserve-high", "1"]);
    env.ok(["slots", "set", "pull", "3", "--reserve-high", "1"]);
    let zero = env.root.join("locks/slots/pull/0.lock");
    let bytes = fs::read(&zero).unwrap();
    // Tear whichever copy holds the limit 3: the class keeps the limit 2.
    let at = bytes
        .windows(8)
        .position(|w| w == b"limit=3\n")
        .expect("the class record says its limit");
    let f = fs::OpenOptions::new().write(true).open(&zero).unwrap();
    f.write_all_at(&[0x5a; 16], at as u64).unwrap();
    let out = env.ok(["slots", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let pull = v
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "pull")
        .cloned()
        .unwrap_or_else(|| panic!("pull kept: {v}"));
    assert_eq!(pull["limit"], 2, "{v}");
}

/// A record forged with an escape sequence in its base (a group member
/// may write lock files) drives nobody's terminal: `images` shows it
/// escaped, one row a line.
#[test]
fn a_forged_base_is_shown_escaped() {
    let env = Env::new();
    ready(&env, "base");
    let out = env.run(["exec", "--write", "app", "--from", "base", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(env.lock_file("app"))
        .unwrap();
    let mut seen = image_record::read(&file).unwrap();
    let mut forged = seen.record.clone().unwrap();
    forged.base = Some("\x1b[2J\rbase".into());
    image_record::write(&file, &mut seen, &forged).unwrap();
    let out = env.run(["images"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("\\x1b[2J\\rbase"), "{said}");
    assert!(!said.contains('\x1b') && !said.contains('\r'), "{said:?}");
}

/// A write over a record that cannot be read (another image's copied in,
/// or a torn slot beside a valid one) numbers its own above every slot
/// that decodes: its check before the outcome then finds its record the
/// latest, and the write ends `ready`, as the refusal's advice says. The
/// stale slot was taken for another writer's later record: "lost the
/// write lock", exit 1, every time.
#[test]
fn a_write_over_a_record_that_cannot_be_read_ends_ready() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    for _ in 0..3 {
        env.build("b", "true");
    }
    fs::copy(env.lock_file("b"), env.lock_file("a")).unwrap();
    // The record is named whose it is, where the cause is to be found.
    let out = env.run(["exec", "--read", "a", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    assert!(stderr(&out).contains("is image 'b''s"), "{}", show(&out));
    let out = env.run(["doctor"]);
    assert!(stdout(&out).contains("(image 'b''s)"), "{}", show(&out));
    let out = env.run(["exec", "--write", "a", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    assert_eq!(env.state("b").as_deref(), Some("ready"));
}
