//! The edges of the read fast path (ready tokens and hints in image lock
//! files, src/record.rs), with real processes: a read never runs its command on an image the
//! database now at the root does not call ready, never beside a store-wide
//! command (other than one nested in it), and nothing nested waits for
//! itself.
//!
//! Each test makes a situation in which the lock file and the database (or
//! the store-wide hold) disagree, and checks that what the database or the
//! hold says wins.

use std::fs;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::common::*;

/// `sh -c SCRIPT` run by `stowage exec --store-wide` (bounded by `output`).
fn store_wide_sh(env: &Env, extra: &[&str], script: &str) -> std::process::Output {
    let mut args = vec!["exec", "--store-wide"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    env.run(args)
}

// --- rows forgotten under a nested writer -----------------------------------

/// A writer started in the background by a store-wide command removes its
/// image's tree (a builder rebuilding from scratch) while the store-wide
/// command ends: the hold's end finds the tree missing and forgets the
/// image (row dropped, token invalidated without the image lock, which the
/// writer holds). The writer then makes its tree again and succeeds: its
/// finish sets `ready` on a row that no longer exists (nothing changes) and
/// still writes a fresh ready token after its commit. From then on a read
/// runs its command on an image the database does not have.
#[test]
fn a_write_outliving_a_store_wide_command_cannot_revive_an_image_it_forgot() {
    let env = Env::new();
    env.make_image("keep");
    env.make_image("base");
    let started = env.sentinel("w-started");
    let go = env.sentinel("w-go");
    let done = env.sentinel("w-done");
    let script = format!(
        "('{bin}' --root '{root}' exec --write base -- sh -c \
            \"rm -rf \\\"\\$STOWAGE_IMAGE_DIR\\\"; touch '{started}'; \
              i=0; while [ ! -e '{go}' ] && [ \\$i -lt 1200 ]; do sleep 0.05; i=\\$((i+1)); done; \
              mkdir \\\"\\$STOWAGE_IMAGE_DIR\\\"; echo new > \\\"\\$STOWAGE_IMAGE_DIR/file\\\"\" \
          ; touch '{done}') >/dev/null 2>&1 </dev/null & \
         i=0; while [ ! -e '{started}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; [ -e '{started}' ]",
        bin = bin(),
        root = env.root.display(),
        started = started.display(),
        go = go.display(),
        done = done.display()
    );
    let out = store_wide_sh(&env, &[], &script);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(
        env.state("base"),
        None,
        "the store-wide command's end forgot 'base': {}",
        show(&out)
    );
    fs::write(&go, "").unwrap();
    wait_for_file(&done);
    assert_eq!(env.state("base"), None, "the database still has no 'base'");
    let out = env.run(["exec", "--read", "base", "--", "true"]);
    assert_eq!(
        code(&out),
        Some(66),
        "a read ran on an image the database does not have: {}",
        show(&out)
    );
}

// --- lock files made inside a store-wide hold --------------------------------

/// A store-wide command makes a new image (a nested write: an import, a
/// build inside the hold). Its lock file is created after the hold's pass
/// that set the store-wide hint on every lock file, so it carries none; the
/// nested writer then writes a ready token into it. A read from outside,
/// while the store-wide command still runs, takes the fast path: its image
/// lock is free, the token is valid, no hint sends it to `store.lock` — and
/// it runs beside the store-wide command. A read of an older image waits,
/// as it must.
#[test]
fn a_read_of_an_image_made_inside_a_store_wide_command_waits_for_it() {
    let env = Env::new();
    env.make_image("keep");
    let started = env.sentinel("sw-started");
    let release = env.sentinel("sw-release");
    let script = format!(
        "'{bin}' --root '{root}' exec --write new -- true || exit 9; touch '{started}'; \
         i=0; while [ ! -e '{release}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done",
        bin = bin(),
        root = env.root.display(),
        started = started.display(),
        release = release.display()
    );
    let mut sw = env.cmd(["exec", "--store-wide", "--", "sh", "-c", &script]);
    sw.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let sw = Bg::from_command(sw);
    wait_for_file(&started);
    // Bounded: a read that honours the hold waits for it, and is given up.
    let out = env.run([
        "exec",
        "--read",
        "new",
        "--wait",
        "2",
        "--",
        "sh",
        "-c",
        &format!(
            "if [ -e '{}' ]; then echo after; else echo during; fi",
            release.display()
        ),
    ]);
    fs::write(&release, "").unwrap();
    let sw_out = sw.finish();
    assert_eq!(code(&sw_out), Some(0), "{}", show(&sw_out));
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("during"),
        "a read ran beside a store-wide command it is not part of: {}",
        show(&out)
    );
}

// --- which database a token speaks for ---------------------------------------

/// A database restored in place from a copy taken before the image existed
/// (`cp backup stowage.db`, or sqlite3's `.restore`, which write into the
/// same file) is the same database at an earlier moment: its identity is
/// the copy's, so every token of the live database still matches. A
/// restore is to be followed by `doctor --repair` (docs/storage.md), which
/// gives the database a new identity: from then on a read asks it.
#[test]
fn after_the_database_is_restored_in_place_and_repaired_a_read_asks_it() {
    let env = Env::new();
    env.make_image("keep");
    let db = env.root.join("stowage.db");
    let backup = env.scratch.join("backup.db");
    fs::copy(&db, &backup).unwrap();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    // Folded into the rows (a new image is written without the database).
    env.ok(["images"]);
    // Restored the way cp(1) does it: truncated and written in place.
    fs::write(&db, fs::read(&backup).unwrap()).unwrap();
    assert_eq!(
        env.state("base"),
        None,
        "the restored database has no 'base'"
    );
    env.ok(["doctor", "--repair"]);
    let out = env.run(["exec", "--read", "base", "--", "true"]);
    assert_eq!(
        code(&out),
        Some(66),
        "a read ran on an image the restored database does not have: {}",
        show(&out)
    );
}

/// An ext4 with 128-byte inodes (made so by older mkfs, or upgraded from
/// ext3) keeps no birth time, like NFS: a database deleted and made anew
/// gets the freed inode back, and its identity is the old one's.
#[test]
fn on_a_filesystem_without_birth_times_a_database_made_anew_is_another_one() {
    if !root_or_skip("an ext4 loop device") || !tool_or_skip("mkfs.ext4", "e2fsprogs") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("fs.img");
    let dir = tmp.path().join("mnt");
    fs::create_dir(&dir).unwrap();
    let made = Command::new("truncate")
        .args(["-s", "64M"])
        .arg(&img)
        .status()
        .is_ok_and(|s| s.success())
        && Command::new("mkfs.ext4")
            .args(["-q", "-I", "128"])
            .arg(&img)
            .output()
            .is_ok_and(|o| o.status.success());
    let Some(mount) = made
        .then(|| Mount::at(&["-o", "loop", img.to_str().unwrap()], &dir))
        .flatten()
    else {
        eprintln!("skipping: cannot make and mount an ext4 loop device here");
        return;
    };
    let env = mount.env();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    fs::remove_file(env.root.join("stowage.db")).unwrap();
    env.ok(["images"]); // the next command makes the database anew
    assert_eq!(env.state("base"), None);
    let out = env.run(["exec", "--read", "base", "--", "true"]);
    drop(env);
    drop(mount);
    assert_eq!(
        code(&out),
        Some(66),
        "a read ran on an image the new database does not have: {}",
        show(&out)
    );
}

// --- nested calls that cannot see their enclosing command ---------------------

/// `exec --store-wide --no-inherit` keeps the hold in a keeper; a command
/// that scrubs its environment (`env -i`, sudo) then calls `stowage exec
/// --read`. The nested read cannot tell it runs inside the hold (no
/// inherited descriptor, no STOWAGE_EXEC_PIDS) and waits for the
/// store-wide command, which waits for it. The rebuild and a nested
/// store-wide command recognise such a hold through the lock table (an
/// ancestor holds store.lock exclusively); an exec's start does not.
#[test]
fn a_read_inside_a_store_wide_command_with_a_clean_environment_does_not_hang() {
    let env = Env::new();
    env.make_image("keep");
    env.make_image("base");
    let script = format!(
        "timeout 20 env -i '{bin}' --root '{root}' exec --read base -- true; echo \"read $?\"",
        bin = bin(),
        root = env.root.display()
    );
    let out = store_wide_sh(&env, &["--no-inherit"], &script);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("read 0"),
        "a read nested in a store-wide command waited for it: {}",
        show(&out)
    );
}

/// The same class for image locks: `doctor --repair` of a damaged database
/// inside `exec --read base --no-inherit`, with a scrubbed environment,
/// waits for 'base' to be released by the exec that waits for it (with the
/// environment intact it fails at once, 75).
#[test]
fn a_rebuild_inside_a_reader_with_a_clean_environment_does_not_hang() {
    let env = Env::new();
    env.make_image("keep");
    env.make_image("base");
    let db = env.root.join("stowage.db");
    let script = format!(
        "printf 'ZZZZZZZZ%.0s' $(seq 1024) > '{db}'; \
         timeout 20 env -i '{bin}' --root '{root}' doctor --repair >/dev/null 2>&1; echo \"repair $?\"",
        db = db.display(),
        bin = bin(),
        root = env.root.display()
    );
    let out = env.run([
        "exec",
        "--read",
        "base",
        "--no-inherit",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("repair ") && !said.contains("repair 124"),
        "a repair nested in a reader waited for it: {}",
        show(&out)
    );
}

// --- the recorded last use ----------------------------------------------------

/// A slow-path read of an image whose recorded last use is stale records
/// the use (an UPDATE in its start transaction) and writes the token with
/// that new last use *inside* the transaction, before the commit. Killed
/// between the two (held there by a debugger, as a SIGKILL, an OOM kill or
/// a failing commit would leave it), the row keeps the old last use while
/// the token says "used now": reads of the next five minutes take the fast
/// path and record nothing, and `gc --unused-for` takes the image although
/// it was just read.
#[test]
fn a_read_killed_before_its_start_commits_leaves_no_token_fresher_than_the_row() {
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    let hour_ago = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 3600;
    let out = output({
        let mut c = env.cmd(["exec", "--write", "base", "--", "true"]);
        c.env("STOWAGE_NOW", hour_ago.to_string());
        c
    });
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let cmds = env.sentinel("gdb-cmds");
    fs::write(
        &cmds,
        "set pagination off\nset confirm off\n\
         break stowage::record::write_ready\nrun\nfinish\nkill\nquit\n",
    )
    .unwrap();
    let mut gdb = stowage_under_gdb(&env, &cmds, ["exec", "--read", "base", "--", "true"]);
    gdb.stdin(std::process::Stdio::null());
    let log = output(gdb);
    assert!(
        String::from_utf8_lossy(&log.stdout).contains("write_ready"),
        "the read never reached its token: {}",
        show(&log)
    );
    // A read now, which runs its command: a use within any window.
    env.ok(["exec", "--read", "base", "--", "true"]);
    let out = env.ok(["gc", "--unused-for", "10m"]);
    assert_eq!(
        env.state("base").as_deref(),
        Some("ready"),
        "gc --unused-for 10m took an image read a moment ago: {}",
        show(&out)
    );
}

/// The same without a debugger: a read whose start fails after its token
/// is written. `exec --read base --write zbad`, where zbad's place in the
/// images directory is a file: the start touches base's stale last use,
/// writes base's token with "used now", then refuses zbad and rolls back —
/// the touch goes, the token stays. The next read runs on the fast path,
/// recording nothing, and gc takes the image it just read.
#[test]
fn a_read_whose_start_fails_leaves_no_token_fresher_than_the_row() {
    let env = Env::new();
    let hour_ago = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 3600;
    let out = output({
        let mut c = env.cmd(["exec", "--write", "base", "--", "true"]);
        c.env("STOWAGE_NOW", hour_ago.to_string());
        c
    });
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    fs::write(env.root.join("img/zbad"), "not a directory").unwrap();
    let out = env.run(["exec", "--read", "base", "--write", "zbad", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    // A read now, which runs its command: a use within any window.
    env.ok(["exec", "--read", "base", "--", "true"]);
    let out = env.ok(["gc", "--unused-for", "10m"]);
    assert_eq!(
        env.state("base").as_deref(),
        Some("ready"),
        "gc --unused-for 10m took an image read a moment ago: {}",
        show(&out)
    );
}

// --- other token formats --------------------------------------------------------

/// What fe60ad7 (an earlier build on main, schema 5 too, so not locked out
/// of this store) wrote: the same format line, another layout. This build
/// cannot decode it, so a write here leaves it in place, and that build's
/// fast read of the image being written (or left incomplete) runs.
/// Likewise that build leaves this build's tokens alone.
const EARLIER_TOKEN: &str = "stowage-image 1\nstate=ready\nimages=/elsewhere/img\ncrc=6509d63c\n";

/// A write takes away whatever token the lock file holds — not only one in
/// the format this build reads — before its start marks the row: another
/// build on the same schema trusts its own.
#[test]
fn a_write_takes_away_a_token_of_another_format() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    let lock = env.lock_file("base");
    fs::write(&lock, EARLIER_TOKEN).unwrap();
    let out = env.ok([
        "exec",
        "--write",
        "base",
        "--",
        "sh",
        "-c",
        &format!("cat '{}'", lock.display()),
    ]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("state=ready"),
        "a token said ready while the image was being written: {}",
        show(&out)
    );
}

// --- the store-wide pass over the lock files --------------------------------------

/// The store-wide hint is set on every `*.lock` in locks/images, each opened
/// read-write. An entry there that is not a lock file stowage made — a
/// directory, a socket, an immutable file — fails the pass, and with it
/// every store-wide command and every rebuild of a damaged database, until
/// someone finds and removes it by hand. Such entries are meant to be left
/// alone (record.rs).
#[test]
fn a_stray_entry_among_the_lock_files_does_not_stop_store_wide_commands() {
    let env = Env::new();
    env.make_image("keep");
    fs::create_dir(env.root.join("locks/images/stray.lock")).unwrap();
    let out = env.run(["exec", "--store-wide", "--", "true"]);
    assert_eq!(
        code(&out),
        Some(0),
        "a directory named like a lock file stopped a store-wide command: {}",
        show(&out)
    );
}
