//! Ready tokens (src/record.rs): a plain read of a ready image learns that
//! it is ready from the image's lock file, without the global lock or the
//! database; every way an image stops being ready takes the token away
//! first, so a read never goes ahead on what the database no longer says.

use std::fs;
use std::process::Command;

use crate::common::*;

/// The global lock held by an outside program for as long as the test
/// needs: whatever needs the metadata waits.

#[test]
fn a_read_of_a_ready_image_needs_neither_the_global_lock_nor_the_database() {
    let env = Env::new();
    env.make_image("base");
    env.make_image("other");
    let global = hold_global(&env);
    for args in [
        vec!["exec", "--read", "base", "--wait", "0.3", "--", "true"],
        vec![
            "exec",
            "--read",
            "base",
            "--read",
            "other",
            "--no-wait",
            "--",
            "true",
        ],
    ] {
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", show(&out));
    }
    // The command still finds its image where the database says it is.
    let out = env.run([
        "exec",
        "--read",
        "base",
        "--wait",
        "0.3",
        "--",
        "sh",
        "-c",
        "cat \"$STOWAGE_IMAGES_DIR/base/file\"",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "content\n");
    // A clone still needs the metadata (its lineage): it waits for the
    // global lock.
    let out = env.run([
        "exec", "--write", "new", "--from", "base", "--wait", "0.3", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    global.kill_all();
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

#[test]
fn a_read_with_a_damaged_token_asks_the_database_and_writes_it_again() {
    let env = Env::new();
    env.make_image("base");
    let lock = env.lock_file("base");
    // Garbage where the token was (one byte changed: its CRC fails).
    let mut bytes = fs::read(&lock).unwrap();
    assert!(bytes.starts_with(b"stowage-image 4\n"), "{bytes:?}");
    bytes[20] ^= 1;
    fs::write(&lock, &bytes).unwrap();
    {
        let global = hold_global(&env);
        let out = env.run(["exec", "--read", "base", "--wait", "0.3", "--", "true"]);
        assert_eq!(
            out.status.code(),
            Some(75),
            "a bad token is not trusted: {}",
            show(&out)
        );
        global.kill_all();
    }
    env.ok(["exec", "--read", "base", "--", "true"]);
    // That read wrote the token again: the next one needs no metadata.
    let global = hold_global(&env);
    env.ok(["exec", "--read", "base", "--wait", "0.3", "--", "true"]);
    global.kill_all();
}

#[test]
fn a_token_older_than_the_last_use_resolution_sends_the_read_to_the_database() {
    let env = Env::new();
    env.make_image("base");
    // Ten minutes later (a clock ahead of the one that wrote the token):
    // the use the token carries is older than the resolution.
    let later = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600)
        .to_string();
    let read_later = |wait: &str| {
        let mut c = env.cmd(["exec", "--read", "base", "--wait", wait, "--", "true"]);
        c.env("STOWAGE_NOW", &later);
        output(c)
    };
    let before = env.image("base").unwrap()["last_used"].clone();
    {
        let global = hold_global(&env);
        let out = read_later("0.3");
        assert_eq!(out.status.code(), Some(75), "{}", show(&out));
        global.kill_all();
    }
    let out = read_later("10");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    // The read recorded its use: gc must not take a read image for unused.
    let after = env.image("base").unwrap()["last_used"].clone();
    assert_ne!(before, after, "last use recorded");
    // And wrote a token with it: ten minutes later, the next read is fast.
    let global = hold_global(&env);
    let out = read_later("0.3");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    global.kill_all();
}

#[test]
fn a_writer_killed_during_its_command_leaves_no_ready_token() {
    let env = Env::new();
    env.make_image("base");
    // Stowage and its command die together (a host crash, kill -9 of the
    // job): nothing records the outcome.
    env.kill_a_writer_in_its_command("base");
    let out = env.run(["exec", "--read", "base", "--", "true"]);
    assert_eq!(
        out.status.code(),
        Some(66),
        "a half-written image is not ready: {}",
        show(&out)
    );
    assert_eq!(env.state("base").as_deref(), Some("incomplete"));
}

#[test]
fn a_failed_write_leaves_no_ready_token() {
    let env = Env::new();
    env.make_image("base");
    let out = env.run_sh("base", "echo half > \"$STOWAGE_IMAGE_DIR/file\"; exit 3");
    assert_eq!(out.status.code(), Some(3), "{}", show(&out));
    let out = env.run(["exec", "--read", "base", "--", "true"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    // Written again, it is read again.
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
}

/// Runs stowage as if its root were on NFS: lock files are kept, never
/// unlinked, so their tokens must be taken away another way.
fn on_nfs(env: &Env, args: &[&str]) -> std::process::Output {
    let mut c = env.cmd(args);
    c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
    output(c)
}

#[test]
fn a_removed_image_whose_lock_file_is_kept_is_not_read() {
    let env = Env::new();
    for name in ["gone", "collected"] {
        assert_eq!(
            on_nfs(&env, &["exec", "--write", name, "--", "true"])
                .status
                .code(),
            Some(0)
        );
    }
    assert_eq!(on_nfs(&env, &["rm", "gone"]).status.code(), Some(0));
    // gc removes an incomplete image the same way.
    let failed = on_nfs(&env, &["exec", "--write", "collected", "--", "false"]);
    assert_eq!(failed.status.code(), Some(1));
    assert_eq!(on_nfs(&env, &["gc"]).status.code(), Some(0));
    for name in ["gone", "collected"] {
        assert!(
            env.lock_file(name).exists(),
            "{name}: the lock file is kept"
        );
        let out = on_nfs(&env, &["exec", "--read", name, "--", "true"]);
        assert_eq!(out.status.code(), Some(66), "{name}: {}", show(&out));
        assert_eq!(env.state(name), None);
    }
}

#[test]
fn a_row_doctor_drops_takes_its_token_with_it() {
    let env = Env::new();
    assert_eq!(
        on_nfs(&env, &["exec", "--write", "lost", "--", "true"])
            .status
            .code(),
        Some(0)
    );
    fs::remove_dir(env.root.join("img/lost")).unwrap();
    env.make_image("kept"); // the images directory is not empty: not unmounted
    let out = on_nfs(&env, &["doctor", "--repair"]);
    assert!(out.status.code().is_some(), "{}", show(&out));
    assert_eq!(env.state("lost"), None, "{}", show(&out));
    let out = on_nfs(&env, &["exec", "--read", "lost", "--", "true"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
}

#[test]
fn an_image_a_store_wide_command_deletes_is_not_read() {
    let env = Env::new();
    for name in ["cache", "kept"] {
        assert_eq!(
            on_nfs(&env, &["exec", "--write", name, "--", "true"])
                .status
                .code(),
            Some(0)
        );
    }
    let out = on_nfs(
        &env,
        &[
            "exec",
            "--store-wide",
            "--",
            "sh",
            "-c",
            "rm -r \"$STOWAGE_IMAGES_DIR/cache\"",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("cache"), None);
    let out = on_nfs(&env, &["exec", "--read", "cache", "--", "true"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert_eq!(
        on_nfs(&env, &["exec", "--read", "kept", "--", "true"])
            .status
            .code(),
        Some(0)
    );
}

/// `exec --store-wide` whose command runs until sentinel `hold-release`;
/// returns once it runs.
fn store_wide(env: &Env) -> Bg {
    let mut args: Vec<String> = vec!["exec".into(), "--store-wide".into(), "--".into()];
    args.extend(env.hold_cmd("hold-started", "hold-release"));
    let hold = env.spawn(&args);
    wait_for_file(&env.sentinel("hold-started"));
    hold
}

#[test]
fn a_read_does_not_start_while_a_store_wide_command_runs() {
    let env = Env::new();
    env.make_image("base");
    let hold = store_wide(&env);
    let out = env.run(["exec", "--read", "base", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(stderr(&out).contains("store-wide"), "{}", show(&out));
    env.release("hold-release");
    assert_eq!(hold.finish().status.code(), Some(0));
    env.ok(["exec", "--read", "base", "--no-wait", "--", "true"]);
}

#[test]
fn a_rebuilt_database_vouches_for_no_token() {
    let env = Env::new();
    env.make_image("app");
    // Nothing of the database is left to salvage: the rebuild adopts the
    // tree it finds without knowing how its writer ended.
    fs::write(env.root.join("stowage.db"), vec![0x5a; 8192]).unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert!(out.status.code().is_some(), "{}", show(&out));
    let state = env.state("app");
    assert_ne!(state.as_deref(), Some("ready"), "{}", show(&out));
    let out = env.run(["exec", "--read", "app", "--", "true"]);
    assert_eq!(
        out.status.code(),
        Some(66),
        "the database says {state:?}; the read must agree: {}",
        show(&out)
    );
}

/// The calls one command makes on the store's files, counted the way the
/// contract counts server round trips (scripts/roundtrips-count.py), under
/// strace. `None` (with the reason printed) where strace cannot run.
fn round_trips(env: &Env, args: &[&str]) -> Option<u64> {
    let log = env.scratch.join("strace.log");
    let mut c = Command::new("strace");
    c.args(["-f", "-y", "-o"]).arg(&log).arg(bin());
    c.arg("--root").arg(&env.root).args(args);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    let out = output(c);
    if out.status.code() != Some(0) {
        eprintln!("skipping: strace cannot trace here: {}", show(&out));
        return None;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/roundtrips-count.py");
    let counted = Command::new("python3")
        .arg(script)
        .arg(&env.root)
        .arg(&log)
        .output()
        .unwrap();
    assert!(counted.status.success(), "{}", show(&counted));
    let v: serde_json::Value = serde_json::from_slice(&counted.stdout).unwrap();
    v["total"].as_u64()
}

#[test]
fn commands_cost_no_more_round_trips_than_measured() {
    if !tool_or_skip("strace", "strace") || !tool_or_skip("python3", "python3") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    // Empty, as scripts/roundtrips makes its images: the measure of a
    // write stats each file of the tree.
    env.ok(["exec", "--write", "other", "--", "true"]);
    // Warm, as scripts/roundtrips does: a read's first use of the store's
    // files creates what later ones reuse.
    env.ok(["exec", "--read", "base", "--", "true"]);
    // Deterministic on a quiet store: each bound is what one run counts
    // (docs/performance.md; it was 60 and 67 before reads left the
    // database, 21 before records spoke for their database alone), so a
    // change that adds a call to the read path shows up. The contract's
    // bound for a read is 12.
    let Some(read) = round_trips(&env, &["exec", "--read", "base", "--", "true"]) else {
        return;
    };
    eprintln!("exec --read: {read} counted calls");
    assert!(read <= 12, "exec --read: {read} calls");
    let two = round_trips(
        &env,
        &["exec", "--read", "base", "--read", "other", "--", "true"],
    );
    assert!(two.unwrap() <= 17, "two reads: {two:?} calls");
    // A slot taken on its file's record adds 5 (it was 68: a transaction;
    // 7 with the stats of the unlink race); the bound is 6.
    env.ok(["slots", "set", "pull", "2"]);
    env.ok(["exec", "--slot", "pull", "--read", "base", "--", "true"]);
    let slot = round_trips(
        &env,
        &["exec", "--slot", "pull", "--read", "base", "--", "true"],
    );
    assert!(slot.unwrap() <= read + 5, "slot + read: {slot:?} calls");
    // A write of an existing image takes no transaction (written.rs): 23,
    // the contract's bound is 30.
    env.ok(["exec", "--write", "base", "--", "true"]);
    env.ok(["images"]);
    let write = round_trips(&env, &["exec", "--write", "other", "--", "true"]).unwrap();
    eprintln!("exec --write (existing): {write} counted calls");
    // An empty tree, as scripts/roundtrips writes (each file of a tree
    // adds its lstat to the measure).
    assert!(
        write <= 23,
        "exec --write of an existing image: {write} calls"
    );
    // The next transaction folds that write in: one more of its own.
    let fold = round_trips(&env, &["images"]).unwrap();
    eprintln!("images, folding a write: {fold} counted calls");
    // A new image takes no transaction either (written.rs, new images):
    // 35 (34, and the failed open of store.lock's gate: nobody waits for
    // store.lock), the bound is 40.
    let new = round_trips(&env, &["exec", "--write", "new", "--", "true"]).unwrap();
    eprintln!("exec --write (new): {new} counted calls");
    assert!(new <= 35, "exec --write of a new image: {new} calls");
    // `images` uses the database (docs/performance.md has scripts/
    // roundtrips' figures; this store, three images (one of a file) and a
    // slot class, counts a few more): what it costs must not creep up.
    // Its first run folds the new image in.
    env.ok(["images"]);
    let images = round_trips(&env, &["images"]).unwrap();
    eprintln!("images: {images} counted calls");
    // 52, and 4 more (a listing of the image locks) while another program,
    // another test, holds a lock on the same filesystem.
    assert!(images <= 56, "images: {images} calls (measured 56)");
}

#[test]
fn lock_status_with_nothing_held_costs_ten_round_trips() {
    if !tool_or_skip("strace", "strace")
        || !tool_or_skip("python3", "python3")
        || !root_or_skip("mounting a tmpfs")
    {
        return;
    }
    // The root on a filesystem of its own: other programs' locks on the
    // root's filesystem cost lock-status listings of the store (idle.rs),
    // and the tests running beside this one take locks on theirs.
    let env = Env::new();
    fs::create_dir_all(&env.root).unwrap();
    let Some(_m) = Mount::at(
        &["-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs"],
        &env.root,
    ) else {
        eprintln!("skipping: cannot mount a tmpfs here");
        return;
    };
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    env.ok(["slots", "set", "pull", "2"]);
    env.ok(["exec", "--slot", "pull", "--read", "base", "--", "true"]);
    // As scripts/roundtrips counts it (docs/performance.md; 62 when it
    // took the database's way): the root's statx, the database header's
    // open, read and close, the listing of locks/slots (open, two
    // getdents), and the open, read and close of pull/0.lock's record.
    let n = round_trips(&env, &["lock-status"]).unwrap();
    eprintln!("lock-status (nothing held): {n} counted calls");
    assert!(n <= 10, "lock-status (nothing held): {n} calls");
}

/// The hint bytes of an image's lock file (record.rs): whether a writer
/// may wait at its gate, and whether a store-wide operation may hold the
/// store. A file that never had one reads as neither.
fn hints(env: &Env, image: &str) -> (bool, bool) {
    let bytes = fs::read(env.lock_file(image)).unwrap();
    let at = |i: usize| bytes.get(stowage::record::HINTS_AT + i) == Some(&b'1');
    (at(0), at(1))
}

#[test]
fn a_waiting_writer_makes_new_readers_queue_and_its_hint_goes_when_it_is_in() {
    let env = Env::new();
    env.make_image("base");
    let reader = env.hold(&["--read", "base"], "reader-started");
    let writer = env.spawn(["exec", "--write", "base", "--", "true"]);
    env.wait_for_waiter("base");
    wait_until("the writer's hint", || hints(&env, "base").0);
    // A new reader queues behind the waiting writer instead of going in
    // beside the reader already inside.
    let out = env.run(["exec", "--read", "base", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(stderr(&out).contains("a writer waits"), "{}", show(&out));
    reader.kill_all();
    assert_eq!(writer.finish().status.code(), Some(0));
    assert_eq!(
        hints(&env, "base"),
        (false, false),
        "cleared once the writer was in"
    );
    env.ok(["exec", "--read", "base", "--no-wait", "--", "true"]);
}

#[test]
fn hints_left_by_killed_writers_and_holds_are_cleared_by_the_next_read() {
    let env = Env::new();
    env.make_image("base");
    // A writer killed while it waits leaves its hint.
    let reader = env.hold(&["--read", "base"], "reader-started");
    let writer = env.spawn(["exec", "--write", "base", "--", "true"]);
    wait_until("the writer's hint", || hints(&env, "base").0);
    writer.kill_all();
    reader.kill_all();
    // A store-wide command killed while it runs leaves its hint.
    store_wide(&env).kill_all();
    assert_eq!(hints(&env, "base"), (true, true));
    // Stale: the next read goes in, and takes both away.
    env.ok(["exec", "--read", "base", "--no-wait", "--", "true"]);
    assert_eq!(hints(&env, "base"), (false, false));
    let global = hold_global(&env);
    env.ok(["exec", "--read", "base", "--no-wait", "--", "true"]);
    global.kill_all();
}

#[test]
fn a_read_does_not_start_while_the_database_is_rebuilt() {
    let env = Env::new();
    env.make_image("base");
    fs::write(env.root.join("stowage.db"), vec![0x5a; 8192]).unwrap();
    // The rebuild has made sure no image lock is held, and not yet taken
    // the tokens away: a read now must not go in on its token.
    let (rebuild, pause) = env.paused(["doctor", "--repair"], "rebuild-images-free");
    let out = env.run(["exec", "--read", "base", "--no-wait", "--", "true"]);
    assert_ne!(out.status.code(), Some(0), "{}", show(&out));
    fs::remove_file(&pause).unwrap();
    let out = rebuild.finish();
    assert!(out.status.code().is_some(), "{}", show(&out));
    assert_eq!(hints(&env, "base"), (false, false));
}

#[test]
fn a_read_does_not_run_on_an_image_a_store_wide_command_deleted_while_it_looked() {
    // A store-wide command is granted while no image lock is held, then a
    // read takes its image's lock and reads a valid token and the hint;
    // before the read asks store.lock, the command deletes the image's
    // tree and ends, taking the token away. The read must not go on with
    // the token it read before.
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("keep"); // an images directory with a tree is mounted
    env.make_image("a");
    let go = env.sentinel("go");
    let hold_started = env.sentinel("hold-started");
    let hold = env.spawn([
        "exec",
        "--store-wide",
        "--",
        "sh",
        "-c",
        &format!(
            "touch '{}'; i=0; while [ ! -e '{}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; \
             rm -rf \"$STOWAGE_IMAGES_DIR/a\"",
            hold_started.display(),
            go.display()
        ),
    ]);
    wait_for_file(&hold_started);
    let at_try = env.sentinel("at-try");
    let cmds = env.sentinel("gdb-cmds");
    fs::write(
        &cmds,
        format!(
            "set pagination off\n\
             break stowage::store_wide::try_shared\n\
             run\n\
             shell touch '{at}'; touch '{go}'; i=0; while [ -e '{started}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n\
             continue\n",
            at = at_try.display(),
            go = go.display(),
            started = hold_started.display()
        ),
    )
    .unwrap();
    // The hold's sentinel goes once its command has deleted the tree and
    // stowage has ended the hold: the reader then goes on.
    let watcher = std::thread::spawn({
        let hold_started = hold_started.clone();
        move || {
            let out = hold.finish();
            let _ = fs::remove_file(&hold_started);
            out
        }
    });
    let c = stowage_under_gdb(
        &env,
        &cmds,
        [
            "exec",
            "--read",
            "a",
            "--",
            "sh",
            "-c",
            "test -d \"$STOWAGE_IMAGES_DIR/a\" || exit 9",
        ],
    );
    let out = output(c);
    let hold_out = watcher.join().unwrap();
    assert_eq!(hold_out.status.code(), Some(0), "{}", show(&hold_out));
    assert!(
        at_try.exists(),
        "the read never asked store.lock: {}",
        show(&out)
    );
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &stderr(&out);
    // gdb says exit codes in octal: 66 is 0102 (the command's 9, 011).
    assert!(
        said.contains("image 'a' does not exist") && said.contains("exited with code 0102"),
        "the read must find the image gone (66), not run on it: {}",
        show(&out)
    );
}
