//! Writes without the database (src/written.rs): a write of an existing
//! image takes no global lock and no transaction; its record in the lock
//! file, and its marker, carry the outcome until the next transaction
//! folds them in. Whatever step a writer dies at, no image looks ready
//! that is not.

use std::fs;

use crate::common::*;

fn lock_text(env: &Env, enc: &str) -> String {
    let bytes = fs::read(env.lock_file(enc)).unwrap();
    String::from_utf8_lossy(&bytes[..bytes.len().min(400)]).into_owned()
}

#[test]
fn a_write_of_an_existing_image_takes_no_global_lock_and_is_folded_in_later() {
    let env = Env::new();
    env.make_image("base");
    let before = env.image("base").unwrap();
    // Nobody can get the global lock: a write that needed a transaction
    // would wait for it (and fail after its grace period).
    let global = hold_global(&env);
    let out = env.run([
        "exec",
        "--write",
        "base",
        "--wait",
        "0.3",
        "--",
        "sh",
        "-c",
        "head -c 200000 /dev/zero > \"$STOWAGE_IMAGE_DIR/big\"",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(env.marker("base").exists(), "the write left its marker");
    assert!(lock_text(&env, "base").contains("state=ready"));
    // A read needs no transaction either.
    let out = env.run(["exec", "--read", "base", "--wait", "0.3", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    global.kill_all();
    // The next transaction records the write: its size and last use.
    let after = env.image("base").unwrap();
    assert_eq!(after["state"], "ready");
    assert!(
        after["size_bytes"].as_u64().unwrap() > before["size_bytes"].as_u64().unwrap() + 100_000,
        "{before} → {after}"
    );
    assert!(!env.marker("base").exists(), "folded, the marker goes");
}

#[test]
fn a_failed_write_without_the_database_leaves_the_image_incomplete() {
    let env = Env::new();
    env.make_image("base");
    let out = env.run_sh("base", "echo half > \"$STOWAGE_IMAGE_DIR/file\"; exit 3");
    assert_eq!(out.status.code(), Some(3), "{}", show(&out));
    assert!(env.marker("base").exists());
    // The fast read sees no ready token; the slow one folds the record.
    let out = env.run(["exec", "--read", "base", "--", "true"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert_eq!(env.state("base").as_deref(), Some("incomplete"));
    assert!(!env.marker("base").exists());
    // Written again (the database's way, no ready token), it is read again.
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
}

/// A writer SIGKILLed (with its command) at `point` leaves its image
/// `expect` once folded, and never lets a reader in on a tree that may be
/// half written.
fn killed_at(point: &str, expect: &str) {
    let env = Env::new();
    env.make_image("base");
    let (writer, _file) = env.paused(
        [
            "exec",
            "--write",
            "base",
            "--",
            "sh",
            "-c",
            "echo half > \"$STOWAGE_IMAGE_DIR/file\"",
        ],
        point,
    );
    writer.kill_all();
    let out = env.run(["exec", "--read", "base", "--", "true"]);
    let want = if expect == "ready" { 0 } else { 66 };
    assert_eq!(out.status.code(), Some(want), "{point}: {}", show(&out));
    assert_eq!(env.state("base").as_deref(), Some(expect), "{point}");
    assert!(!env.marker("base").exists(), "{point}: folded");
    // Whatever it was, the image can be written again, and then read.
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
}

#[test]
fn a_writer_killed_after_its_marker_leaves_the_image_as_it_was() {
    // Marker made, token untouched: nothing was written.
    killed_at("fast-write-marked", "ready");
}

#[test]
fn a_writer_killed_before_its_command_leaves_the_image_incomplete() {
    // The `writing` record is down: readiness is lost, never claimed.
    killed_at("exec-before-spawn", "incomplete");
}

#[test]
fn a_writer_killed_after_its_command_before_its_record_leaves_it_incomplete() {
    killed_at("fast-write-measured", "incomplete");
}

#[test]
fn a_writer_killed_during_its_command_is_found_by_gc() {
    let env = Env::new();
    env.make_image("base");
    env.kill_a_writer_in_its_command("base");
    let out = env.ok(["gc"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("base"),
        "gc removes the dead writer's image: {}",
        show(&out)
    );
    assert_eq!(env.state("base"), None);
    assert!(!env.marker("base").exists());
}

#[test]
fn an_image_being_written_shows_as_writing_and_is_not_folded() {
    let env = Env::new();
    env.make_image("base");
    let writer = env.hold(&["--write", "base"], "started");
    assert!(env.marker("base").exists());
    assert_eq!(env.state("base").as_deref(), Some("writing"));
    let entry = env.lock_entry("base").unwrap();
    assert_eq!(entry["image_state"], "writing", "{entry}");
    assert_eq!(entry["state"], "exclusive", "{entry}");
    // Looks fold nothing while the writer holds its lock; a read waits.
    assert!(env.marker("base").exists());
    let out = env.run(["exec", "--read", "base", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    env.release("release");
    assert_eq!(writer.finish().status.code(), Some(0));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

#[test]
fn a_stowage_inside_the_write_does_not_fold_it() {
    let env = Env::new();
    env.make_image("base");
    let seen = env.sentinel("seen");
    let script = format!(
        "echo new > \"$STOWAGE_IMAGE_DIR/file\"; '{bin}' --root '{root}' images --json > '{seen}'",
        bin = bin(),
        root = env.root.display(),
        seen = seen.display()
    );
    env.build("base", &script);
    let inner: serde_json::Value = serde_json::from_slice(&fs::read(&seen).unwrap()).unwrap();
    let row = inner
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "base")
        .unwrap()
        .clone();
    assert_eq!(row["state"], "writing", "{row}");
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "base", "--", "true"]);
}

#[test]
fn a_write_whose_command_deletes_the_image_goes_the_database_way() {
    let env = Env::new();
    env.make_image("base");
    env.build("base", "rm -rf \"$STOWAGE_IMAGE_DIR\"");
    assert_eq!(env.state("base"), None, "deleted by its command");
    assert!(!env.lock_file("base").exists());
    env.ok(["images"]);
    assert!(!env.marker("base").exists());
}

#[test]
fn a_write_that_never_starts_puts_the_token_back() {
    let env = Env::new();
    env.make_image("base");
    let (writer, _file) = env.paused(
        ["exec", "--write", "base", "--", "true"],
        "exec-before-spawn",
    );
    assert!(lock_text(&env, "base").contains("state=writing"));
    writer.signal(libc::SIGTERM);
    let out = writer.finish();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    assert!(lock_text(&env, "base").contains("state=ready"));
    // Readable at once, without the database, and still ready.
    let global = hold_global(&env);
    env.ok(["exec", "--read", "base", "--wait", "0.3", "--", "true"]);
    global.kill_all();
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

#[test]
fn removing_an_image_written_without_the_database_takes_its_marker() {
    let env = Env::new();
    env.make_image("base");
    env.make_image("base");
    assert!(env.marker("base").exists());
    env.ok(["rm", "base"]);
    assert_eq!(env.state("base"), None);
    assert!(!env.marker("base").exists());
    // And a new image of that name is made the database's way.
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
}

#[test]
fn writers_of_one_image_never_overlap_whichever_way_they_go() {
    let env = Env::new();
    env.make_image("base");
    let inside = env.sentinel("inside");
    let script = format!(
        "if [ -e '{i}' ]; then echo overlap >> '{i}.bad'; fi; touch '{i}'; sleep 0.05; rm -f '{i}'",
        i = inside.display()
    );
    let writers: Vec<Bg> = (0..6)
        .map(|_| env.spawn(["exec", "--write", "base", "--", "sh", "-c", &script]))
        .collect();
    for w in writers {
        let out = w.finish();
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    }
    assert!(
        !env.sentinel("inside.bad").exists(),
        "two writers ran at once"
    );
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "base", "--", "true"]);
}

#[test]
fn an_older_store_writes_the_database_way_until_it_is_upgraded() {
    let env = Env::new();
    // A store of the release before (schema 7): its tokens are of the
    // older format, which no writer takes as leave to skip the database.
    let mut c = env.cmd(["exec", "--write", "base", "--", "true"]);
    c.env("STOWAGE_DEBUG_SCHEMA_LIMIT", "7");
    assert_eq!(output(c).status.code(), Some(0));
    let mut c = env.cmd(["exec", "--read", "base", "--", "true"]);
    c.env("STOWAGE_DEBUG_SCHEMA_LIMIT", "7");
    assert_eq!(output(c).status.code(), Some(0));
    assert!(lock_text(&env, "base").starts_with("stowage-image 2"));
    env.ok(["exec", "--write", "base", "--", "true"]);
    assert!(!env.marker("base").exists(), "upgraded the database's way");
    env.ok(["exec", "--write", "base", "--", "true"]);
    assert!(env.marker("base").exists(), "then without it");
    // The older release is locked out of the upgraded store.
    let mut c = env.cmd(["images"]);
    c.env("STOWAGE_DEBUG_SCHEMA_LIMIT", "7");
    assert_ne!(output(c).status.code(), Some(0));
}

#[test]
fn a_writers_record_counts_for_whoever_holds_the_image_even_unlisted() {
    // An NFS client may list `locks/leases` from its cache and miss a fresh
    // marker: whoever locks the image reads its record and folds it anyway.
    let env = Env::new();
    env.make_image("base");
    let out = env.run_sh("base", "echo half > \"$STOWAGE_IMAGE_DIR/file\"; exit 3");
    assert_eq!(out.status.code(), Some(3), "{}", show(&out));
    fs::remove_file(env.marker("base")).unwrap();
    let out = env.run(["exec", "--read", "base", "--", "true"]);
    assert_eq!(
        out.status.code(),
        Some(66),
        "a failed write: {}",
        show(&out)
    );
    assert_eq!(env.state("base").as_deref(), Some("incomplete"));
}

#[test]
fn gc_sees_a_write_it_did_not_list_before_it_removes_an_image() {
    let env = Env::new();
    env.make_image("base");
    // Recorded as used long ago; then written (a use) without the
    // database, its marker missed by the listing.
    env.make_image_used_long_ago("old");
    env.ok(["exec", "--write", "old", "--", "true"]);
    fs::remove_file(env.marker("old")).unwrap();
    let out = env.ok(["gc", "--unused-for", "30d"]);
    assert_eq!(env.state("old").as_deref(), Some("ready"), "{}", show(&out));
}

#[test]
fn a_write_whose_lock_was_lost_finishes_the_database_way() {
    let env = Env::new();
    env.make_image("app");
    // The hidden hook fails the lock's check as a lost NFS lock does.
    let mut c = env.cmd(["exec", "--write", "app", "--", "true"]);
    c.env(stowage::env::DEBUG_LOST_LOCK, "app.lock");
    let out = output(c);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("lost the write lock on image 'app'"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    // Recorded by its own transaction; its lock lost, it leaves its record
    // and marker as they were, which fold to the same.
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    assert!(!env.marker("app").exists());
    // Written again (the database's way: no token vouches for it), it is
    // ready again; and the next write takes no transaction.
    env.ok(["exec", "--write", "app", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["exec", "--write", "app", "--", "true"]);
    assert!(env.marker("app").exists());
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn a_write_the_database_way_that_never_starts_leaves_an_unfolded_write_ready() {
    let env = Env::new();
    env.make_image("base");
    env.make_image("other");
    // Folded (a new image is written without the database).
    env.ok(["images"]);
    env.ok(["exec", "--write", "base", "--", "true"]);
    assert!(env.marker("base").exists(), "written without the database");
    // A read whose token is damaged sends the whole request the
    // database's way, with base's lock taken at once: its start folds
    // base's record, read before the write took it away.
    let lock = env.lock_file("other");
    let mut bytes = fs::read(&lock).unwrap();
    bytes[20] ^= 1;
    fs::write(&lock, &bytes).unwrap();
    let (writer, _file) = env.paused(
        ["exec", "--read", "other", "--write", "base", "--", "true"],
        "exec-before-spawn",
    );
    writer.signal(libc::SIGTERM);
    let out = writer.finish();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    // Stopped before its command, it gives the image back as it was.
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "base", "--", "true"]);
}

#[test]
fn a_link_planted_at_the_leases_directory_steers_no_marker_out_of_the_store() {
    let env = Env::new();
    env.make_image("base");
    let outside = env.tmp.path().join("elsewhere");
    fs::rename(env.root.join("locks/leases"), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, env.root.join("locks/leases")).unwrap();
    // No lease can be made there, so no write skips the database; every
    // command still works, and nothing appears outside the store.
    env.build("base", "echo again > \"$STOWAGE_IMAGE_DIR/file\"");
    env.ok(["exec", "--read", "base", "--", "true"]);
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 0);
}

#[test]
fn entries_in_the_leases_directory_that_are_no_markers_are_left_alone() {
    let env = Env::new();
    env.make_image("base");
    let leases = env.root.join("locks/leases");
    fs::write(leases.join("no%%image.dirty"), "").unwrap();
    fs::write(leases.join("notes.txt"), "keep").unwrap();
    fs::write(leases.join("ghost.dirty"), "").unwrap();
    env.ok(["images"]);
    env.ok(["exec", "--write", "base", "--", "true"]);
    env.ok(["images"]);
    assert!(leases.join("no%%image.dirty").exists());
    assert!(leases.join("notes.txt").exists());
    // A marker of an image that has no lock file stands for nothing.
    assert!(!leases.join("ghost.dirty").exists());
    assert_eq!(env.state("ghost"), None);
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// `count` images made, then each rewritten without the database (a file
/// added) with no transaction between: that many markers unfolded.
fn unfolded_rewrites(env: &Env, count: usize) -> Vec<String> {
    let names: Vec<String> = (0..count).map(|i| format!("img{i:03}")).collect();
    for n in &names {
        env.ok(["exec", "--write", n, "--", "true"]);
    }
    for n in &names {
        env.build(n, "echo again > \"$STOWAGE_IMAGE_DIR/again\"");
    }
    assert!(names.iter().all(|n| env.marker(n).exists()));
    names
}

#[test]
fn a_backlog_of_writes_is_folded_in_batches_within_a_small_descriptor_limit() {
    // Each marker folded holds its image's lock until the commit: 150 of
    // them at once would need 150 descriptors. Under a limit of 100 the
    // fold goes in batches (written::FOLD_BATCH) and every write lands.
    let env = Env::new();
    let names = unfolded_rewrites(&env, 150);
    let mut c = env.cmd(["images", "--json"]);
    // SAFETY: only setrlimit(2) between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 100,
                rlim_max: 100,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 150);
    assert!(
        rows.iter()
            .all(|r| r["state"] == "ready" && r["size_bytes"].as_u64().unwrap() > 0)
    );
    assert!(names.iter().all(|n| !env.marker(n).exists()), "all folded");
}

#[test]
fn markers_that_cannot_be_unlinked_do_not_keep_a_transaction_folding() {
    // An immutable leases directory: the fold of a backlog unlinks
    // nothing, which is no progress — one batch per transaction, never a
    // loop of them.
    let env = Env::new();
    let names = unfolded_rewrites(&env, 70);
    let leases = env.root.join("locks/leases");
    let chattr = |flag: &str| {
        std::process::Command::new("chattr")
            .arg(flag)
            .arg(&leases)
            .status()
            .is_ok_and(|s| s.success())
    };
    if !chattr("+i") {
        eprintln!("skipping: chattr +i is not possible here");
        return;
    }
    let out = env.run(["images"]);
    let again = env.run(["images", "--json"]);
    chattr("-i");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(again.status.code(), Some(0), "{}", show(&again));
    assert!(names.iter().all(|n| env.marker(n).exists()));
    env.ok(["images"]);
    assert!(names.iter().all(|n| !env.marker(n).exists()));
}
