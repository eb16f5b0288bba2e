//! The ready token in an image's lock file (src/record.rs) against the
//! database it is derived from: a read never runs its command on an image
//! that is not ready per the database, never in another images directory
//! than the root's, and a read still counts as a use for
//! `gc --unused-for`.
//!
//! Each test makes, with real processes, a situation in which the token
//! and the database disagree, and checks what the database says wins.
//! Two more guard what keeping tokens costs elsewhere: removing an image
//! on a full copy-on-write filesystem, and a repair that now takes the
//! store-wide lock.

use std::fs;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::common::*;

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `stowage --root ROOT ARGS…` for a root that is not the one of `Env`.
fn at_root(root: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new(bin());
    c.arg("--root").arg(root).args(args);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    c.stdin(std::process::Stdio::null());
    c
}

/// Overwrites the database with bytes SQLite cannot read.
fn damage_db(env: &Env) {
    fs::write(env.root.join("stowage.db"), vec![0x5a; 8192]).unwrap();
}

// --- the images directory ---------------------------------------------------

/// A root moved (or seen at another path: another host's mount point, a
/// container's bind mount) keeps its images in ROOT/img, where ROOT is the
/// root as this process names it. A token names the images directory as
/// the process that wrote it saw it.
#[test]
fn a_read_in_a_moved_root_runs_in_that_roots_images_directory() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    let moved = env.tmp.path().join("moved");
    fs::rename(&env.root, &moved).unwrap();
    let out = output(at_root(
        &moved,
        &[
            "exec",
            "--read",
            "base",
            "--",
            "sh",
            "-c",
            "echo \"$STOWAGE_IMAGES_DIR\"; cat \"$STOWAGE_IMAGES_DIR/base/file\"",
        ],
    ));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().next(),
        Some(moved.join("img").to_str().unwrap()),
        "{}",
        show(&out)
    );
}

/// The same root seen at another path by another mount namespace (a
/// container that bind-mounts the store, a host that mounts it elsewhere),
/// where the writer's path does not exist.
#[test]
fn a_read_through_another_mount_point_of_the_root_finds_its_images() {
    if !root_or_skip("a bind mount in a new mount namespace")
        || !tool_or_skip("unshare", "util-linux")
    {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    let parent = env.root.parent().unwrap().to_path_buf();
    // Outside the directory the tmpfs hides: only the bind mount at ctr
    // shows the store.
    let ctr_dir = tempfile::Builder::new()
        .prefix("stowage-it-ctr.")
        .tempdir()
        .unwrap();
    let ctr = ctr_dir.path().to_path_buf();
    let script = format!(
        "mount --bind '{p}' '{c}' && mount -t tmpfs none '{p}' && \
         exec '{bin}' --root '{c}/root' exec --read base -- \
         sh -c 'echo \"$STOWAGE_IMAGES_DIR\"; cat \"$STOWAGE_IMAGES_DIR/base/file\"'",
        p = parent.display(),
        c = ctr.display(),
        bin = bin()
    );
    let mut c = Command::new("unshare");
    c.args(["-m", "sh", "-c", &script])
        .env_remove("STOWAGE_ROOT")
        .env_remove("STOWAGE_NOW");
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().next(),
        Some(ctr.join("root/img").to_str().unwrap()),
        "{}",
        show(&out)
    );
}

// --- last use ----------------------------------------------------------------

/// A read is a use: `gc --unused-for 10m` must not take an image read a
/// moment ago. Its last recorded use comes from a host whose clock is an
/// hour behind (STOWAGE_NOW), while the token's freshness is the lock
/// file's modification time — another clock. Before tokens, the read found
/// the recorded use stale and recorded it again.
#[test]
fn an_image_read_a_moment_ago_is_not_collected_as_unused() {
    let env = Env::new();
    let mut c = env.cmd([
        "exec",
        "--write",
        "base",
        "--",
        "sh",
        "-c",
        "echo content > \"$STOWAGE_IMAGE_DIR/file\"",
    ]);
    c.env("STOWAGE_NOW", (now_secs() - 3600).to_string());
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    // Read now, on a host with the right time.
    env.ok(["exec", "--read", "base", "--", "true"]);
    let out = env.ok(["gc", "--unused-for", "10m"]);
    assert_eq!(
        env.state("base").as_deref(),
        Some("ready"),
        "an image read just now was collected as unused: {}",
        show(&out)
    );
}

// --- the database the token came from --------------------------------------

/// A damaged database rebuilt by an older stowage (which knows nothing of
/// tokens, so clears none): the rebuilt rows say 'incomplete' (nothing
/// could be salvaged), the lock file still says ready. The first
/// transaction of a current stowage finds the store's records speaking for
/// another database and takes them away (records_db.rs); reads ask the new
/// one from then on. (Before it, a read trusts its token: no binary that
/// keeps tokens has changed a tree since — documented in docs/design.md,
/// "The records' database", with the one way around it, an older release
/// rebuilding a damaged database and then writing.)
#[test]
fn after_an_older_stowage_rebuilt_the_database_the_next_transaction_takes_the_tokens_away() {
    let env = Env::new();
    env.make_image("keep");
    // Written the database's way (a clone), so that its lock file holds a
    // token derived from the database, not a writer's record (which a
    // rebuild of this release salvages: written::salvage_new).
    env.ok(["exec", "--write", "base", "--from", "keep", "--", "true"]);
    env.ok(["exec", "--read", "base", "--", "true"]);
    damage_db(&env);
    let mut c = env.cmd(["doctor", "--repair"]);
    c.env(stowage::env::DEBUG_SCHEMA_LIMIT, "4");
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    // What the database says now (read by an older binary, as the rebuilt
    // schema is the older one): incomplete.
    let mut c = env.cmd(["images", "--json"]);
    c.env(stowage::env::DEBUG_SCHEMA_LIMIT, "4");
    let out = output(c);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("incomplete"),
        "{}",
        show(&out)
    );
    env.ok(["images"]);
    env.assert_read_refused(
        "base",
        "a read ran on an image the database calls incomplete",
    );
}

/// The database lost (deleted): the image does not exist for the one made
/// anew, whatever the lock file says, from that database's first
/// transaction on (records_db.rs).
#[test]
fn after_the_database_is_lost_a_read_of_an_image_it_does_not_know_fails() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    env.ok(["exec", "--write", "other", "--", "true"]);
    env.assert_read_refused("base", "a read ran on an image the database does not have");
}

// --- a store-wide command's deletions ----------------------------------------

/// A reader inside a store-wide command whose command deleted the image's
/// tree: the reader's start saw the row ready and commits; before it writes
/// the token (held there by a debugger, as a preempted process would be:
/// stopped once its start transaction has committed),
/// the store-wide command ends and forgets the deleted image, invalidating
/// the token without the image's lock (the reader holds it, so the lock file
/// also stays). Then the reader writes the token: a lock file that says
/// ready for an image without a row or a tree.
#[test]
fn a_reader_inside_a_store_wide_command_cannot_revive_an_image_it_deleted() {
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    // Not the only image: an empty images directory looks unmounted, and
    // then nothing is forgotten.
    env.make_image("keep");
    env.make_image("base");
    // An old token: the reader records the use and writes a new one.
    let status = Command::new("touch")
        .args(["-d", "10 minutes ago"])
        .arg(env.lock_file("base"))
        .status()
        .unwrap();
    assert!(status.success());
    let paused = env.sentinel("reader-paused");
    let done = env.sentinel("reader-done");
    let gdb_cmds = env.sentinel("gdb-cmds");
    // Once its start has committed and let the global lock go (the
    // session is being handed to the command): say so, then wait until
    // the store-wide exec (the first pid of STOWAGE_EXEC_PIDS) has gone.
    fs::write(
        &gdb_cmds,
        format!(
            "set pagination off\n\
             break stowage::session::Session::set_inheritable\n\
             run\n\
             delete\n\
             finish\n\
             shell touch '{paused}'; i=0; while kill -0 ${{STOWAGE_EXEC_PIDS%%:*}} 2>/dev/null && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n\
             continue\n",
            paused = paused.display()
        ),
    )
    .unwrap();
    let script = format!(
        "rm -rf \"$STOWAGE_IMAGES_DIR/base\"; \
         (gdb -q -batch -x '{cmds}' --args '{bin}' --root '{root}' exec --read base -- true \
           >'{log}' 2>&1 </dev/null; touch '{done}') >/dev/null 2>&1 </dev/null & \
         i=0; while [ ! -e '{paused}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; [ -e '{paused}' ]",
        cmds = gdb_cmds.display(),
        bin = bin(),
        root = env.root.display(),
        log = env.sentinel("gdb.log").display(),
        done = done.display(),
        paused = paused.display()
    );
    let out = env.run(["exec", "--store-wide", "--", "sh", "-c", &script]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    wait_for_file(&done);
    let log = fs::read_to_string(env.sentinel("gdb.log")).unwrap_or_default();
    assert!(
        log.contains("Value returned"),
        "the reader never committed its start: {log}\n{}",
        show(&out)
    );
    assert_eq!(
        env.state("base"),
        None,
        "the store-wide command forgot 'base'"
    );
    env.assert_read_refused("base", "a read ran on an image that has no row and no tree");
}

// --- a full filesystem ---------------------------------------------------------

/// On a copy-on-write filesystem (btrfs), rewriting even a few bytes of a
/// file needs free space. A build filled the filesystem: `rm` of a ready
/// image (one read before, so its lock file holds a token) must still free
/// space, without any file touched by hand — as it did before the token,
/// whose invalidation now comes first and fails with ENOSPC.
#[test]
fn rm_of_a_read_image_frees_a_full_copy_on_write_filesystem() {
    let Some(m) = Mount::btrfs_loop("256M") else {
        return;
    };
    let env = m.env();
    env.build(
        "old",
        "head -c 20000000 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
    );
    env.ok(["exec", "--read", "old", "--", "true"]);
    // The build writes until the filesystem is full (and fails).
    let out = env.run([
        "exec",
        "--write",
        "big",
        "--",
        "sh",
        "-c",
        "head -c 1000000000 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"; \
         i=0; while echo x > \"$STOWAGE_IMAGE_DIR/s$i\"; do i=$((i+1)); done 2>/dev/null; exit 1",
    ]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    // Whatever the build left free (btrfs keeps some back for metadata)
    // goes too: big files, then small ones.
    let fill = format!(
        "head -c 1000000000 /dev/zero > '{d}/filler' 2>/dev/null; \
         i=0; while echo y > '{d}/fill.'$i; do i=$((i+1)); done 2>/dev/null; sync; \
         ! echo z > '{d}/probe' 2>/dev/null",
        d = m.dir.display()
    );
    let full = Command::new("sh").args(["-c", &fill]).status().unwrap();
    assert!(full.success(), "the filesystem is not full");
    let out = env.run(["rm", "old"]);
    assert_eq!(
        code(&out),
        Some(0),
        "rm cannot free a full filesystem: {}",
        show(&out)
    );
    assert!(env.image("old").is_none());
}

// --- the rebuild's store-wide lock ---------------------------------------------

/// `doctor --repair` rebuilding a damaged database inside a store-wide
/// command that keeps its hold in a keeper (`--no-inherit`) and runs the
/// repair with a clean environment (`env -i`, as sudo or a sanitizing
/// wrapper does): nothing tells the repair that the hold is its enclosing
/// command's, and since the rebuild now waits for the store-wide lock,
/// it waits for the command that waits for it. Before, the rebuild needed
/// only free image locks, and went ahead.
#[test]
fn a_rebuild_inside_a_store_wide_command_with_a_clean_environment_does_not_hang() {
    let env = Env::new();
    env.make_image("keep");
    let script = format!(
        "printf 'ZZZZZZZZ%.0s' $(seq 1024) > '{db}'; \
         timeout 20 env -i '{bin}' --root '{root}' doctor --repair >/dev/null; echo \"repair $?\"",
        db = env.root.join("stowage.db").display(),
        bin = bin(),
        root = env.root.display()
    );
    let out = env.run([
        "exec",
        "--store-wide",
        "--no-inherit",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("repair 0"),
        "the repair waited for the store-wide command that runs it: {}",
        show(&out)
    );
}

/// The same without a debugger: an exclusive read (`--read-exclusive`,
/// which records its use and writes the token when it *finishes*) started
/// in the background by a store-wide command that deleted the image's
/// tree, still running when the store-wide command ends. The hold forgets
/// the image (row gone, token invalidated, lock file kept: the reader holds
/// it); then the exclusive read finishes, its update of the missing row
/// changes nothing, and it writes a fresh ready token.
#[test]
fn an_exclusive_read_outliving_a_store_wide_command_cannot_revive_an_image_it_deleted() {
    let env = Env::new();
    env.make_image("keep");
    env.make_image("base");
    let started = env.sentinel("rx-started");
    let done = env.sentinel("rx-done");
    let release = env.sentinel("rx-release");
    let script = format!(
        "rm -rf \"$STOWAGE_IMAGES_DIR/base\"; \
         ('{bin}' --root '{root}' exec --read-exclusive base -- sh -c \
            \"touch '{started}'; i=0; while [ ! -e '{release}' ] && [ \\$i -lt 1200 ]; do sleep 0.05; i=\\$((i+1)); done\" \
          ; touch '{done}') >/dev/null 2>&1 </dev/null & \
         i=0; while [ ! -e '{started}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; [ -e '{started}' ]",
        bin = bin(),
        root = env.root.display(),
        started = started.display(),
        release = release.display(),
        done = done.display()
    );
    let out = env.run(["exec", "--store-wide", "--", "sh", "-c", &script]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(
        env.state("base"),
        None,
        "the store-wide command forgot 'base'"
    );
    fs::write(&release, "").unwrap();
    wait_for_file(&done);
    env.assert_read_refused("base", "a read ran on an image that has no row and no tree");
}
