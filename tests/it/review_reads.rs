//! Reads without the database's header (src/records_db.rs, record.rs): a
//! ready token in the current format is trusted as it stands, so whatever
//! leaves one behind for a database that no longer vouches for it lets a
//! read in on an image the database calls not ready. Each test replaces
//! or repairs the database with real processes and reads through the
//! real binary. Also the root's filesystem judged from the mount table
//! (filesystem.rs, `lock_reach_of_device`).

use std::fs;

use crate::common::*;

/// A copy of the database taken before `X` existed, restored over the file
/// once `X` was written twice (the second time without a transaction: a
/// write of an existing image) and read: the restore's documented sequel,
/// `doctor --repair`, must stop `X`'s token from counting.
fn restore_before_x(env: &Env) -> std::path::PathBuf {
    env.make_image("keep");
    let copy = env.scratch.join("stowage.db.copy");
    fs::copy(env.root.join("stowage.db"), &copy).unwrap();
    env.build("X", "echo v1 > \"$STOWAGE_IMAGE_DIR/f\"");
    copy
}

#[test]
fn a_repair_takes_away_the_outcome_of_a_write_without_transaction() {
    let env = Env::new();
    let copy = restore_before_x(&env);
    // A write of an existing image: its outcome (a writer's record, sized)
    // stays in the lock file after a transaction folded it.
    env.build("X", "echo v2 > \"$STOWAGE_IMAGE_DIR/f\"");
    env.ok(["images"]);
    fs::copy(&copy, env.root.join("stowage.db")).unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.assert_read_refused(
        "X",
        "a read trusted the outcome of a write the repaired database does not vouch for",
    );
    env.ok(["exec", "--read", "keep", "--", "true"]);
}

#[test]
fn a_write_that_never_started_puts_back_no_token_a_repair_took_away() {
    let env = Env::new();
    let copy = restore_before_x(&env);
    env.ok(["exec", "--read", "X", "--", "true"]);
    fs::copy(&copy, env.root.join("stowage.db")).unwrap();
    // A write without a transaction holds `X` (its token read, its marker
    // made) while the repair runs: the repair cannot take the token away
    // from a lock held exclusively. The command cannot be started, so the
    // write puts back what the lock file said.
    let (writer, go) = env.paused(
        ["exec", "--write", "X", "--", "/nonexistent/command"],
        "fast-write-marked",
    );
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    fs::remove_file(&go).unwrap();
    let out = writer.finish();
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    env.assert_read_refused(
        "X",
        "a read trusted a token put back after the repair renewed the database",
    );
    env.ok(["exec", "--read", "keep", "--", "true"]);
}

/// A case records_db.rs documents as covered only from the next newer
/// transaction on: a release before schema 9 makes the database anew and
/// takes no token away (telling it at every read would cost the header
/// again). The first transaction of this release (here `images`, which
/// migrates the schema) does, and reads ask the database from then on.
#[test]
fn a_database_an_older_release_made_anew_is_read_around_only_until_a_newer_transaction() {
    let env = Env::new();
    env.make_image("X");
    env.ok(["exec", "--read", "X", "--", "true"]);
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    // An older release makes the database anew and adopts the tree it
    // finds without a row: incomplete (adopt.rs).
    let mut c = env.cmd(["doctor", "--repair"]);
    c.env(stowage::env::DEBUG_SCHEMA_LIMIT, "8");
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.ok(["images"]);
    env.assert_read_refused(
        "X",
        "a read trusted a token of the database that was deleted",
    );
}

/// The root's filesystem comes from the mount table now (by the root's
/// device), not from a statfs: NFS mounted so that locks stay on each
/// client is still refused, whatever the mount point the table gives. The
/// root is put on a tmpfs of its own, whose device is anonymous (major 0)
/// as an NFS mount's is.
#[test]
fn nfs_without_server_locks_found_by_device_in_the_mount_table_is_refused() {
    use std::os::unix::fs::MetadataExt;
    if !root_or_skip("mounting a tmpfs") {
        return;
    }
    let env = Env::new();
    fs::create_dir(&env.root).unwrap();
    let Some(_mount) = Mount::tmpfs_at(&env.root, "16m") else {
        return;
    };
    env.make_image("X");
    let dev = fs::metadata(&env.root).unwrap().dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    assert_eq!(major, 0);
    let info = env.sentinel("mountinfo");
    for options in ["rw,vers=3,nolock", "rw,vers=4.2,local_lock=all"] {
        // Listed at a mount point that does not contain the root (a bind
        // mount seen elsewhere), after other mounts: the device decides.
        fs::write(
            &info,
            format!(
                "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n\
                 23 22 0:4 / /proc rw - proc proc rw\n\
                 101 22 {major}:{minor} / /elsewhere rw,relatime - nfs srv:/export {options}\n"
            ),
        )
        .unwrap();
        for args in [
            &["exec", "--read", "X", "--", "true"][..],
            &["exec", "--write", "X", "--", "true"][..],
        ] {
            let mut c = env.cmd(args);
            c.env(stowage::env::DEBUG_MOUNTINFO, &info);
            let out = output(c);
            assert_eq!(code(&out), Some(69), "{options} {args:?}: {}", show(&out));
            assert!(stderr(&out).contains("NFS"), "{}", show(&out));
        }
    }
}

/// The mount table is read only as far as the root's mount: on a host
/// with thousands of mounts (containers, bind mounts), reading all of it
/// costs the kernel milliseconds per command. Shown without a clock: the
/// table is a FIFO whose writer, having written the root's mount, keeps it
/// open until the command has run — a reader of the whole table would wait
/// for its end until the writer gives up (bounded) and says so.
#[test]
fn the_mount_table_is_read_no_further_than_the_roots_mount() {
    use std::os::unix::fs::MetadataExt;
    if !root_or_skip("mounting a tmpfs") {
        return;
    }
    let env = Env::new();
    fs::create_dir(&env.root).unwrap();
    let Some(_mount) = Mount::tmpfs_at(&env.root, "16m") else {
        return;
    };
    env.make_image("X");
    let dev = fs::metadata(&env.root).unwrap().dev();
    let fifo = env.sentinel("mountinfo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let ran = env.sentinel("ran");
    let gave_up = env.sentinel("gave-up");
    let mut w = std::process::Command::new("sh");
    w.arg("-c").arg(format!(
        "exec 3>'{f}'; printf '101 22 {maj}:{min} / /elsewhere rw - tmpfs tmpfs rw\\n' >&3; \
         i=0; while [ ! -e '{r}' ] && [ $i -lt 2000 ]; do sleep 0.01; i=$((i+1)); done; \
         [ -e '{r}' ] || touch '{g}'",
        f = fifo.display(),
        maj = libc::major(dev),
        min = libc::minor(dev),
        r = ran.display(),
        g = gave_up.display()
    ));
    let writer = Bg::from_command(w);
    let mut c = env.cmd(["exec", "--read", "X", "--", "touch"]);
    c.arg(&ran).env(stowage::env::DEBUG_MOUNTINFO, &fifo);
    let out = output(c);
    let wrote = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(code(&wrote), Some(0), "{}", show(&wrote));
    assert!(
        !gave_up.exists(),
        "the mount table was read past the root's mount, to its end"
    );
}

/// A write without a transaction that holds its image while a repair
/// renews the database ends with its outcome naming the identity it
/// started under, which readers trust until the next transaction folds it
/// (the tree is the one the write just finished; the database calls it
/// incomplete) — documented as not covered: closing it would cost every
/// such write a read of the header at its end, and would still leave the
/// moment between that read and the lock's release. The fold makes the
/// database's word the reads' again.
#[test]
fn a_write_that_finished_across_a_repair_is_read_by_the_database_once_folded() {
    let env = Env::new();
    let copy = restore_before_x(&env);
    env.ok(["exec", "--read", "X", "--", "true"]);
    fs::copy(&copy, env.root.join("stowage.db")).unwrap();
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
        "fast-write-marked",
    );
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    fs::remove_file(&go).unwrap();
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.ok(["images"]);
    env.assert_read_refused(
        "X",
        "a read trusted the outcome of a write the repaired database calls incomplete",
    );
}

/// A lease nobody wrote is kept for a grace unless its maker is known
/// gone (lease.rs): its maker may be between its create and its lock, and
/// locks it without checking that it is still at its path. Its age must
/// not come from its mtime, which a client sets: an NFSv3 (or 4.0)
/// exclusive create stores its verifier there until the client's SETATTR,
/// inside the maker's open — set here with `touch -d` while the maker, in
/// another pid namespace (so its name cannot show it alive), is stopped
/// before its lock.
#[test]
fn a_lease_between_its_create_and_its_lock_is_not_judged_by_its_mtime() {
    use std::process::Command;
    if !root_or_skip("a pid namespace") || !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("X");
    let stopped = env.sentinel("stopped");
    let go = env.sentinel("go");
    let cmds = env.sentinel("gdb-cmds");
    fs::write(
        &cmds,
        format!(
            "set pagination off\ncatch syscall flock\nrun\n\
             shell touch '{s}'; i=0; while [ ! -e '{g}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done\n\
             delete\ncontinue\n",
            s = stopped.display(),
            g = go.display()
        ),
    )
    .unwrap();
    let mut c = Command::new("unshare");
    c.args([
        "--pid",
        "--fork",
        "--mount-proc",
        "gdb",
        "-q",
        "-batch",
        "-x",
    ])
    .arg(&cmds)
    .arg("--args")
    .arg(bin())
    .arg("--root")
    .arg(&env.root)
    .args(["exec", "--read", "X", "--"])
    .args(env.hold_cmd("started", "release"))
    .env_remove("STOWAGE_ROOT")
    .env_remove("STOWAGE_NOW");
    let maker = Bg::from_command(c);
    // Its first flock is its lease's: the file is made, not yet locked.
    wait_for_file(&stopped);
    let leases = env.root.join("locks/leases");
    let names: Vec<_> = fs::read_dir(&leases).unwrap().flatten().collect();
    assert_eq!(names.len(), 1, "{names:?}");
    let lease = names[0].path();
    assert_eq!(fs::metadata(&lease).unwrap().len(), 0);
    let out = Command::new("touch")
        .args(["-d", "2000-01-01"])
        .arg(&lease)
        .output()
        .unwrap();
    assert!(out.status.success());
    // A prober cleaning leases.
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let kept = lease.exists();
    fs::write(&go, "").unwrap();
    wait_for_file(&env.sentinel("started"));
    let status = env.ok(["lock-status"]);
    env.release("release");
    let out = maker.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        kept,
        "a prober unlinked the lease of a live maker about to lock it"
    );
    let status = String::from_utf8_lossy(&status.stdout).into_owned();
    assert!(!status.contains("outside stowage"), "{status}");
}
