//! Server round trips: the calls one command makes on the store's files
//! that an NFS client sends to the server, counted the way the contract
//! counts them (`scripts/roundtrips-count.py`) under strace. The bounds
//! are the contract's (and docs/performance.md's targets): a change that
//! adds calls to the exec path shows up here.

use std::fs;
use std::process::Command;

use crate::common::*;

/// The counted calls of `stowage ARGS…` on `env`'s root; `None` (with the
/// reason printed) where strace cannot trace here.
fn round_trips(env: &Env, args: &[&str]) -> Option<u64> {
    let log = traced(env, None, args)?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/roundtrips-count.py");
    let counted = Command::new("python3")
        .arg(script)
        .arg(&env.root)
        .arg(&log)
        .output()
        .unwrap();
    assert!(counted.status.success(), "{}", show(&counted));
    let v: serde_json::Value = serde_json::from_slice(&counted.stdout).unwrap();
    let n = v["total"].as_u64().unwrap();
    eprintln!("{args:?}: {n} counted calls {}", v["by_category"]);
    Some(n)
}

#[test]
fn execs_cost_no_more_round_trips_than_the_contract_allows() {
    if !tool_or_skip("strace", "strace") || !tool_or_skip("python3", "python3") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--write", "other", "--", "true"]);
    // Warm, as scripts/roundtrips is: a read's first use of the store
    // makes what later ones reuse.
    env.ok(["exec", "--read", "base", "--", "true"]);
    let Some(read) = round_trips(&env, &["exec", "--read", "base", "--", "true"]) else {
        return;
    };
    assert!(read <= 12, "exec --read: {read} calls (contract: 12)");
    env.ok(["slots", "set", "pull", "2"]);
    env.ok(["exec", "--slot", "pull", "--read", "base", "--", "true"]);
    let slot = round_trips(
        &env,
        &["exec", "--slot", "pull", "--read", "base", "--", "true"],
    )
    .unwrap();
    assert!(
        slot <= read + 6,
        "a slot and a read: {slot} calls (target: read + 6)"
    );
    let write = round_trips(&env, &["exec", "--write", "other", "--", "true"]).unwrap();
    assert!(
        write <= 30,
        "exec --write of an existing image: {write} calls (contract: 30)"
    );
    let new = round_trips(&env, &["exec", "--write", "new", "--", "true"]).unwrap();
    assert!(
        new <= 30,
        "exec --write of a new image: {new} calls (contract: 30)"
    );
    // Whatever the size of the image's tree: 2,000 files cost what an
    // empty tree does.
    env.build(
        "other",
        "mkdir \"$STOWAGE_IMAGE_DIR/t\"; cd \"$STOWAGE_IMAGE_DIR/t\"; i=0; while [ $i -lt 2000 ]; do : > f$i; i=$((i+1)); done",
    );
    let big = round_trips(&env, &["exec", "--write", "other", "--", "true"]).unwrap();
    assert!(
        big <= write,
        "a write of a tree of 2,000 files: {big} calls, of an empty one: {write}"
    );
}

/// On a shared filesystem an exec whose command ends before its lease is
/// due makes none: a read costs its lock file's open, lock, read and close,
/// the mount's checks and its record read again at the end, where a lock
/// may be lost (9), not the lease's create, lock, synced write, unlink and
/// closes on top (14 before).
#[test]
fn a_short_exec_on_a_shared_filesystem_makes_no_lease_request() {
    if !tool_or_skip("strace", "strace") || !tool_or_skip("python3", "python3") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let shared = |c: &mut Command| {
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs")
            .env(stowage::env::DEBUG_ANNOUNCE_MS, "600000");
    };
    let args = ["exec", "--read", "base", "--", "true"];
    let mut warm = env.cmd(args);
    shared(&mut warm);
    assert_eq!(code(&output(warm)), Some(0));
    let Some(log) = traced_with(&env, None, &args, shared) else {
        return;
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/roundtrips-count.py");
    let counted = Command::new("python3")
        .arg(script)
        .arg(&env.root)
        .arg(&log)
        .arg("--list")
        .output()
        .unwrap();
    assert!(counted.status.success(), "{}", show(&counted));
    let v: serde_json::Value = serde_json::from_slice(&counted.stdout).unwrap();
    let n = v["total"].as_u64().unwrap();
    assert!(
        n <= 9,
        "exec --read on NFS: {n} calls: {}",
        stderr(&counted)
    );
    let listed = stderr(&counted);
    assert!(!listed.contains("leases"), "a lease was made: {listed}");
}

/// lock-status with nothing held: its cost is fixed (it reads store.conf
/// and the catalog's header, lists the leases, tries the global lock, asks
/// store.lock, reads each slot class), and stays within what
/// docs/performance.md says (45 counted calls on tmpfs).
#[test]
fn lock_status_with_nothing_held_costs_a_fixed_few_round_trips() {
    if !tool_or_skip("strace", "strace")
        || !tool_or_skip("python3", "python3")
        || !root_or_skip("mounting a tmpfs")
    {
        return;
    }
    // The root on a filesystem of its own: other programs' locks on the
    // root's filesystem cost lock-status listings of the store.
    let env = Env::new();
    fs::create_dir_all(&env.root).unwrap();
    let Some(_m) = Mount::tmpfs_at(&env.root, "16m") else {
        return;
    };
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    env.ok(["slots", "set", "pull", "2"]);
    env.ok(["exec", "--slot", "pull", "--read", "base", "--", "true"]);
    let Some(n) = round_trips(&env, &["lock-status"]) else {
        return;
    };
    assert!(
        n <= 45,
        "lock-status (nothing held): {n} calls (docs/performance.md: 45)"
    );
}

/// On a local filesystem nothing is written through (`O_DSYNC`: every hint
/// a synchronous write), not even by the first command on a root not made
/// yet, which judges the filesystem by the root's nearest existing parent.
#[test]
fn a_new_root_on_a_local_filesystem_writes_nothing_through() {
    let env = Env::new();
    assert!(!env.root.exists());
    let args = ["exec", "--write", "app", "--", "true"];
    let Some(log) = traced(&env, Some("trace=open,openat,openat2"), &args) else {
        return;
    };
    let trace = fs::read_to_string(&log).unwrap();
    let through: Vec<_> = trace.lines().filter(|l| l.contains("O_DSYNC")).collect();
    assert!(through.is_empty(), "{through:?}");
    assert!(trace.contains("app.lock"), "{trace}");
}

/// Traces `stowage ARGS…` on `env`'s root (every call, or those of the
/// strace filter `what`, paths and 4 KiB of each string shown) and returns
/// the log; `None` (the reason printed) where strace cannot trace here.
fn traced(env: &Env, what: Option<&str>, args: &[&str]) -> Option<std::path::PathBuf> {
    traced_with(env, what, args, |_| {})
}

/// [`traced`], with `tweak` applied to the command first.
fn traced_with(
    env: &Env,
    what: Option<&str>,
    args: &[&str],
    tweak: impl FnOnce(&mut Command),
) -> Option<std::path::PathBuf> {
    let log = env.scratch.join("strace.log");
    let mut c = Command::new("strace");
    c.args(["-f", "-y", "-s", "4096"]);
    if let Some(w) = what {
        c.args(["-e", w]);
    }
    c.arg("-o").arg(&log).arg(bin());
    c.arg("--root").arg(&env.root).args(args);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    tweak(&mut c);
    let out = output(c);
    if code(&out) != Some(0) {
        eprintln!("skipping: strace cannot trace here: {}", show(&out));
        return None;
    }
    Some(log)
}

/// An exec lists every lock it holds in its lease in one write: each write
/// of a lease is a request to the server on a shared filesystem, and a
/// synced one (`O_DSYNC`), and a build reading a base into a new image
/// through a slot holds three locks.
#[test]
fn an_exec_lists_all_its_locks_in_its_lease_in_one_write() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["slots", "set", "pull", "2"]);
    let build = [
        "exec", "--slot", "pull", "--read", "base", "--write", "app", "--", "true",
    ];
    let Some(log) = traced(&env, Some("trace=pwrite64,write"), &build) else {
        return;
    };
    let trace = fs::read_to_string(&log).unwrap();
    let lease_writes: Vec<_> = trace.lines().filter(|l| l.contains(".lease>")).collect();
    assert_eq!(lease_writes.len(), 1, "{lease_writes:#?}");
    for lock in ["images/base.lock", "images/app.lock", "slots/pull/"] {
        assert!(
            lease_writes[0].contains(lock),
            "{lock} not listed: {}",
            lease_writes[0]
        );
    }
}

/// On a shared filesystem a new image's lock file is proven to be the file
/// at its path by what it says (nothing: no unlinker marked it gone), not
/// by opening its path again, a lookup at the server (its path is asked
/// once before, without making it); nor is its directory's filesystem
/// asked again (the root's checks know it).
#[test]
fn a_new_images_lock_file_is_not_looked_up_again_after_its_lock() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let new = ["exec", "--write", "new", "--", "true"];
    let Some(log) = traced_with(&env, Some("trace=%file"), &new, |c| {
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
    }) else {
        return;
    };
    let trace = fs::read_to_string(&log).unwrap();
    let by_path: Vec<_> = trace
        .lines()
        .filter(|l| l.contains("locks/images/new.lock\""))
        .collect();
    // Asked once without making it (a later release's store is refused before it is made), then
    // made and locked: never looked up by path after that.
    assert_eq!(by_path.len(), 2, "{by_path:#?}");
    assert!(by_path[0].contains("ENOENT"), "{by_path:#?}");
    assert!(by_path[1].contains("O_CREAT"), "{by_path:#?}");
    let statfs: Vec<_> = trace
        .lines()
        .filter(|l| l.contains("statfs(") && l.contains("/locks"))
        .collect();
    assert!(statfs.is_empty(), "{statfs:#?}");
}

/// An exec on a store whose images directory is outside the root reads
/// `store.conf` once, asks the directory's claim once (a new image twice:
/// by path, then on the descriptor its tree is made through) and the
/// root's identity once (one stat, one statfs): each is a request to the
/// server, and what one look found holds for the whole exec, which holds
/// the image's lock meanwhile.
#[test]
fn an_external_images_directory_is_asked_about_once_an_exec() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    let images = env.scratch.join("images");
    fs::create_dir(&images).unwrap();
    env.ok(["init", "--images-dir", images.to_str().unwrap()]);
    env.make_image("base");
    let root = fs::canonicalize(&env.root).unwrap();
    let root = root.to_str().unwrap();
    for (args, most_claims) in [
        (&["exec", "--write", "new", "--", "true"][..], 2),
        (&["exec", "--write", "base", "--", "true"], 1),
        (
            &["exec", "--read", "base", "--read", "new", "--", "true"],
            1,
        ),
    ] {
        let Some(log) = traced(&env, None, args) else {
            return;
        };
        let trace = fs::read_to_string(&log).unwrap();
        let calls = |what: &dyn Fn(&str) -> bool| trace.lines().filter(|l| what(l)).count();
        let config = calls(&|l| l.contains("open") && l.contains("store.conf\""));
        let claims = calls(&|l| l.contains("xattr(") && l.contains("user.stowage.store"));
        let root_statfs = calls(&|l| l.contains("statfs(") && l.contains(&format!("<{root}>")));
        eprintln!("{args:?}: store.conf {config}, claim {claims}, root statfs {root_statfs}");
        assert_eq!(config, 1, "{args:?} opened store.conf {config} times");
        assert!(
            claims <= most_claims,
            "{args:?} asked the claim {claims} times"
        );
        assert!(
            root_statfs <= 1,
            "{args:?} asked the root's filesystem {root_statfs} times"
        );
    }
}
