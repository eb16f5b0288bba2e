//! Defects found by trying to break this round's changes with real
//! processes: an outside program that keeps a WAL database open.

use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;

/// An outside program's connection to the database in WAL mode, left open
/// and idle (an sqlite3 shell at its prompt after a query).
fn outside_wal_connection(env: &Env) -> rusqlite::Connection {
    let conn = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let _: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
        .unwrap();
    conn
}

/// Whether process `pid` has the file `path` open.
fn has_open(pid: u32, path: &std::path::Path) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.flatten()
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == path))
        })
        .unwrap_or(false)
}

/// Starts `c` (stowage, output captured, in its own process group) and
/// returns once it has the root's database open, or has ended.
fn spawn_until_db_open(env: &Env, mut c: std::process::Command) -> std::process::Child {
    let db = std::fs::canonicalize(env.root.join("stowage.db")).unwrap();
    c.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = c.spawn().unwrap();
    let pid = child.id();
    wait_until("stowage opens the database or ends", || {
        has_open(pid, &db) || child.try_wait().unwrap().is_some()
    });
    child
}

/// SQLite leaves WAL without its busy handler: the switch failed at once
/// while an outside program had the database open, and stowage said it had
/// "gave up after 10.0 s" waiting. A program that closes the database
/// while stowage waits must cost a moment, not a failed command.
#[test]
fn an_outside_program_closing_a_wal_database_in_time_fails_nothing() {
    let env = Env::new();
    env.ok(["init"]);
    let conn = outside_wal_connection(&env);
    let mut c = env.cmd(["images"]);
    c.env("STOWAGE_DEBUG_DB_BUSY_MS", "60000");
    // Once stowage has the database open, the outside program leaves.
    let child = spawn_until_db_open(&env, c);
    drop(conn);
    let out = wait_output(child, Duration::from_secs(60));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let mode: String = rusqlite::Connection::open(env.root.join("stowage.db"))
        .unwrap()
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "delete");
}

/// With the outside program staying, the failure says how long stowage
/// waited: that long must really have passed (it failed at once before).
#[test]
fn a_wal_database_held_open_is_waited_for_as_long_as_said() {
    let env = Env::new();
    env.ok(["init"]);
    let conn = outside_wal_connection(&env);
    let mut c = env.cmd(["images"]);
    c.env("STOWAGE_DEBUG_DB_BUSY_MS", "400");
    let t0 = Instant::now();
    let out = output(c);
    let took = t0.elapsed();
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert!(
        stderr(&out).contains("gave up after 0.4 s") && took >= Duration::from_millis(400),
        "said it waited 0.4 s, took {took:?}: {}",
        show(&out)
    );
    drop(conn);
}

/// A signal to an exec waiting to leave WAL ends the wait at once and is
/// what it reports (not "gave up after …", which it had not).
#[test]
fn a_signal_ends_the_wait_to_leave_wal_and_is_reported() {
    let env = Env::new();
    env.make_image("base");
    let conn = outside_wal_connection(&env);
    let ran = env.sentinel("ran");
    // A clone records its lineage: a transaction (a new image without a
    // base takes none: written.rs).
    let mut c = env.cmd(["exec", "--write", "app", "--from", "base", "--", "touch"]);
    c.arg(&ran).env("STOWAGE_DEBUG_DB_BUSY_MS", "120000");
    let child = spawn_until_db_open(&env, c);
    let pid = child.id();
    // SAFETY: a plain kill of our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let out = wait_output(child, Duration::from_secs(60));
    drop(conn);
    assert_eq!(code(&out), Some(128 + libc::SIGTERM), "{}", show(&out));
    assert!(stderr(&out).contains("signal"), "{}", show(&out));
    assert!(!ran.exists(), "the command ran: {}", show(&out));
}

/// A waiter whose class directory was removed by hand (the class still
/// configured) found its slot file missing on every turn and looked again
/// at once, forever: a spinning process that never took the slot freed
/// since. It must make the directory again and take the slot.
#[test]
fn a_waiter_whose_class_directory_was_removed_takes_the_freed_slot() {
    let env = Env::new();
    env.ok(["init"]);
    env.ok(["slots", "set", "c", "1"]);
    let started = env.sentinel("started");
    let done = env.sentinel("done");
    let holder = Bg::from_command({
        let mut c = env.cmd(["exec", "--slot", "c", "--", "sh", "-c"]);
        c.arg(format!(
            "touch '{}'; i=0; while [ ! -e '{}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done",
            started.display(),
            done.display()
        ));
        c
    });
    wait_for_file(&started);
    let ran = env.sentinel("ran");
    let mut c = env.cmd(["exec", "-q", "--slot", "c", "--", "touch"]);
    c.arg(&ran)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let waiter = c.spawn().unwrap();
    let class_dir = env.root.join("locks/slots/c");
    wait_until("the waiter waits on the slot file", || {
        flock_waited_on(&class_dir.join("0.lock")) || waiter_has_waiter_record(&env)
    });
    std::fs::remove_dir_all(&class_dir).unwrap();
    env.release("done");
    let out = holder.finish();
    assert!(out.status.success(), "{}", show(&out));
    let out = wait_output(waiter, Duration::from_secs(100));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(ran.exists());
}

fn waiter_has_waiter_record(env: &Env) -> bool {
    env.run(["lock-status", "--all"])
        .stdout
        .windows(7)
        .any(|w| w == b"waiting")
}
