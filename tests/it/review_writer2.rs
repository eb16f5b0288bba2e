//! Second round of attacks on writes without the database
//! (src/written.rs): markers beside leases, crashes at the steps of a
//! write that finishes the database's way, names at the limits.

use std::fs;

use crate::common::*;

fn gdb_cmds(env: &Env, name: &str, text: &str) -> std::path::PathBuf {
    let cmds = env.sentinel(name);
    fs::write(&cmds, text).unwrap();
    cmds
}

#[test]
fn a_fast_write_whose_command_deleted_the_image_killed_after_its_commit_stays_deleted() {
    // The write began without the database; its command deleted the tree,
    // so it finishes the database's way, whose transaction deletes the
    // row. Killed right after that commit, before its `writing` record
    // goes, it must not leave that record to be folded into a new
    // (incomplete) row for an image that no longer exists.
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("app");
    env.ok(["exec", "--write", "app", "--", "true"]);
    assert!(env.marker("app").exists(), "written without the database");
    // Stopped at its commit, then at what follows it: the record's
    // clearing or the marker's removal, whichever comes first.
    let committed = env.sentinel("committed");
    let cmds = gdb_cmds(
        &env,
        "gdb-cmds",
        &format!(
            "set pagination off\n\
             break stowage::meta::Tx::commit_keeping_global\n\
             run\n\
             delete\n\
             break stowage::record::invalidate\n\
             break stowage::written::unmark\n\
             continue\n\
             shell touch '{}'\n\
             kill\n",
            committed.display()
        ),
    );
    let out = output(stowage_under_gdb(
        &env,
        &cmds,
        [
            "exec",
            "--write",
            "app",
            "--",
            "sh",
            "-c",
            "rm -rf \"$STOWAGE_IMAGE_DIR\"",
        ],
    ));
    assert!(
        committed.exists(),
        "killed after the commit: {}",
        show(&out)
    );
    assert!(!env.root.join("img/app").exists());
    assert_eq!(env.state("app"), None, "deleted by its command");
    assert!(!env.marker("app").exists());
}

#[test]
fn a_start_the_database_way_that_fails_after_folding_a_finished_write_leaves_it_ready() {
    // `a` was written without the database, successfully: its record says
    // ready, its marker stands. A request that also creates `new` goes the
    // database's way; its start folds `a`'s record, takes it away (the
    // write's token rule), then fails to create `new` and rolls back. Its
    // command never ran: `a` was last written successfully and must still
    // be ready — as it is when every write went the database's way.
    let env = Env::new();
    env.make_image("a");
    env.build("a", "echo again > \"$STOWAGE_IMAGE_DIR/file\"");
    assert!(env.marker("a").exists(), "written without the database");
    fs::write(env.root.join("img/new"), "not a directory").unwrap();
    let out = env.run(["exec", "--write", "a", "--write", "new", "--", "true"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("not a directory"), "{}", show(&out));
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "a", "--", "true"]);
}

#[test]
fn a_start_the_database_way_killed_before_its_commit_leaves_a_finished_write_ready() {
    // As above, but the start is killed between taking `a`'s record away
    // and its commit.
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    // Read long ago: a read of it asks the database, so the request below
    // goes the database's way.
    env.make_image_used_long_ago("old");
    env.make_image("a");
    env.build("a", "echo again > \"$STOWAGE_IMAGE_DIR/file\"");
    assert!(env.marker("a").exists(), "written without the database");
    let reached = env.sentinel("reached");
    let cmds = gdb_cmds(
        &env,
        "gdb-cmds",
        &format!(
            "set pagination off\n\
             break stowage::record::invalidate\n\
             run\n\
             delete\n\
             break stowage::meta::Tx::commit_keeping_global\n\
             continue\n\
             shell touch '{}'\n\
             kill\n",
            reached.display()
        ),
    );
    let out = output(stowage_under_gdb(
        &env,
        &cmds,
        ["exec", "--write", "a", "--read", "old", "--", "true"],
    ));
    assert!(reached.exists(), "killed before the commit: {}", show(&out));
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "a", "--", "true"]);
}

#[test]
fn a_repair_that_rebuilds_the_database_keeps_a_write_without_it_ready() {
    // `a` was last written without the database, successfully; its record
    // and marker wait for a fold that a damaged database cannot make. The
    // rebuild salvages the rows (both ready) and must not wipe the record
    // the marker stands for: then the fold would find an empty lock file
    // and call `a` incomplete, while `b`, last written the database's way,
    // stays ready.
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    env.build("a", "echo again > \"$STOWAGE_IMAGE_DIR/file\"");
    assert!(env.marker("a").exists(), "written without the database");
    // Damage an index's page (`records_by_lock`): the rows stay readable
    // for the salvage, the integrity check fails.
    let db = env.root.join("stowage.db");
    let page = {
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg(format!(
                "import sqlite3; c = sqlite3.connect('{}'); \
                 print(c.execute(\"select rootpage from sqlite_master where name = 'records_by_lock'\").fetchone()[0])",
                db.display()
            ))
            .output();
        match out {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse::<u64>()
                .unwrap(),
            _ => {
                eprintln!("skipping: python3 with sqlite3 is needed to find the page");
                return;
            }
        }
    };
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new().write(true).open(&db).unwrap();
        f.write_all_at(&[0x5a; 4096], (page - 1) * 4096).unwrap();
    }
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("was damaged"),
        "rebuilt: {}",
        show(&out)
    );
    assert_eq!(env.state("b").as_deref(), Some("ready"), "salvaged");
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    assert!(!env.marker("a").exists(), "folded");
    env.ok(["exec", "--read", "a", "--", "true"]);
}

#[test]
fn a_marker_whose_lock_file_cannot_be_opened_stays_for_whoever_can_hold_the_image() {
    // A dead writer's `writing` record and its marker; the lock file is
    // there but this process cannot open it for writing (another user's,
    // not group-writable; here immutable). The listing must not take
    // that for "no lock file" and unlink the marker unfolded: then the
    // database, which says ready, would be the truth again about a tree
    // half written.
    if !root_or_skip("chattr +i needs root") || !tool_or_skip("chattr", "e2fsprogs") {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    let (writer, _file) = env.paused(
        [
            "exec",
            "--write",
            "a",
            "--",
            "sh",
            "-c",
            "echo half > \"$STOWAGE_IMAGE_DIR/file\"",
        ],
        "exec-before-spawn",
    );
    writer.kill_all();
    assert!(env.marker("a").exists());
    let lock = env.lock_file("a");
    let chattr = |flag: &str| {
        std::process::Command::new("chattr")
            .arg(flag)
            .arg(&lock)
            .status()
            .is_ok_and(|s| s.success())
    };
    if !chattr("+i") {
        eprintln!("skipping: chattr +i is not supported here");
        return;
    }
    let out = env.run(["images"]);
    let kept = env.marker("a").exists();
    assert!(chattr("-i"));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(kept, "the marker went unfolded");
    // Openable again, the record is folded.
    assert_eq!(env.state("a").as_deref(), Some("incomplete"));
    assert!(!env.marker("a").exists());
}
