//! Adversarial tests of a new image written without the database over a
//! name whose lock file says nothing (docs/design.md, "New images without
//! the database"): a write that made its tree itself (`fresh`) is the
//! image, whatever row the name had — and nothing that judged that row
//! before the write may undo it after.

use std::fs;
use std::path::PathBuf;

use crate::common::*;

fn gdb_cmds(env: &Env, name: &str, text: &str) -> PathBuf {
    let cmds = env.sentinel(name);
    fs::write(&cmds, text).unwrap();
    cmds
}

/// gdb commands: stop at `first` (a function), say so by creating `at`,
/// wait until `go` is created, then run on.
fn stop_at(env: &Env, name: &str, first: &str) -> (PathBuf, PathBuf, PathBuf) {
    let at = env.sentinel(&format!("{name}.at"));
    let go = env.sentinel(&format!("{name}.go"));
    let cmds = gdb_cmds(
        env,
        &format!("{name}.gdb"),
        &format!(
            "set pagination off\n\
             break {first}\n\
             run\n\
             shell touch '{at}'\n\
             shell while [ ! -e '{go}' ]; do sleep 0.01; done\n\
             delete\n\
             continue\n",
            at = at.display(),
            go = go.display(),
        ),
    );
    (cmds, at, go)
}

#[test]
fn a_repair_that_found_the_tree_missing_keeps_the_one_a_write_made_since() {
    // A ready image whose lock file says nothing (a repair took the tokens
    // away) and whose tree was deleted by hand: `doctor --repair` drops
    // rows of missing trees. A write of the name without the database,
    // stopped once its checks are done (before its tree), holds
    // `store.lock` shared: the repair waits for it rather than judge the
    // tree in between, and the image is that write's, ready.
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    env.make_image("app");
    // Folded: its row is there.
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    // Its token taken away (as on a store whose lock files a removal or
    // an older layout left empty), its tree deleted by hand.
    fs::write(env.lock_file("app"), "").unwrap();
    fs::remove_dir_all(env.images_dir().join("app")).unwrap();
    let (wcmds, w_at, w_go) = stop_at(&env, "writer", "stowage::session::start_fast_writes");
    let writer = Bg::from_command(stowage_under_gdb(
        &env,
        &wcmds,
        [
            "exec",
            "--write",
            "app",
            "--",
            "sh",
            "-c",
            "echo new > \"$STOWAGE_IMAGE_DIR/file\"",
        ],
    ));
    wait_for_file(&w_at);
    let doctor = env.spawn(["doctor", "--repair"]);
    let store_lock = env.root.join("locks/store.lock");
    wait_until("the repair waits for the writer", || {
        flock_waited_on(&store_lock)
    });
    fs::write(&w_go, "").unwrap();
    let out = writer.finish();
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("Breakpoint 1, stowage::session::start_fast_writes"),
        "the write went without the database: {}",
        show(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("exited normally"),
        "the write ended well: {}",
        show(&out)
    );
    let out = doctor.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(
        env.state("app").as_deref(),
        Some("ready"),
        "the write that ended well is the image: {}",
        show(&out)
    );
    assert_eq!(env.read_in_image("app", "file"), "new\n");
    env.ok(["doctor"]);
}

#[test]
fn a_write_over_an_incomplete_image_while_gc_looks_is_kept_ready() {
    // A failed write the database's way leaves an incomplete image without
    // a tree and a lock file that says nothing. gc lists it to collect;
    // before gc takes its lock, a write of the name without the database
    // makes its tree and ends well: gc's look under the lock finds it
    // ready and leaves it.
    let env = Env::new();
    env.make_image("base");
    let out = env.run([
        "exec",
        "--write",
        "app",
        "--from",
        "base",
        "--",
        "sh",
        "-c",
        "rm -rf \"$STOWAGE_IMAGE_DIR\"/*; exit 3",
    ]);
    assert_eq!(code(&out), Some(3), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    assert!(!env.images_dir().join("app").exists(), "no tree left");
    let (gc, file) = env.paused(["gc"], "gc-listed");
    env.build("app", "echo new > \"$STOWAGE_IMAGE_DIR/file\"");
    assert!(env.marker("app").exists(), "written without the database");
    fs::remove_file(&file).unwrap();
    let out = gc.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(
        fs::read_to_string(env.images_dir().join("app/file")).unwrap(),
        "new\n"
    );
    env.ok(["doctor"]);
}

#[test]
fn a_write_after_a_killed_copy_whose_command_deleted_its_tree_is_the_image() {
    // A write with --from killed once its start committed (`creating`, the
    // lock file emptied) and its command deleted the tree: the name's next
    // write makes a tree of its own without the database, and that is the
    // image — ready, with no base.
    let env = Env::new();
    env.make_image("base");
    let started = env.sentinel("started");
    let writer = env.spawn([
        "exec",
        "--write",
        "app",
        "--from",
        "base",
        "--",
        "sh",
        "-c",
        &format!(
            "rm -rf \"$STOWAGE_IMAGE_DIR\"; touch '{}'; sleep 60",
            started.display()
        ),
    ]);
    wait_for_file(&started);
    writer.kill_all();
    env.build("app", "echo new > \"$STOWAGE_IMAGE_DIR/file\"");
    assert!(env.marker("app").exists(), "written without the database");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    let row = env.image("app").unwrap();
    assert!(row["base"].is_null(), "{row}");
    env.ok(["gc"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["doctor"]);
}

#[test]
fn a_rewrite_of_a_new_image_does_not_say_it_made_the_tree() {
    // A new image's outcome says `fresh=1` (its write made the tree) and
    // stays as its token once folded. A rewrite of it without the database
    // starts from that token: its own records must not claim the tree it
    // found as one it made (the fold makes a `fresh` outcome the image
    // over a row in any state).
    let env = Env::new();
    env.make_image("base");
    env.build("app", "echo 1 > \"$STOWAGE_IMAGE_DIR/file\"");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert!(
        fs::read_to_string(env.lock_file("app"))
            .unwrap()
            .contains("fresh=1\n"),
        "a new image's outcome says fresh"
    );
    env.build("app", "echo 2 > \"$STOWAGE_IMAGE_DIR/file\"");
    assert!(env.marker("app").exists(), "rewritten without the database");
    let text = String::from_utf8_lossy(&fs::read(env.lock_file("app")).unwrap()).into_owned();
    assert!(text.contains("state=ready\n"), "{text}");
    assert!(!text.contains("fresh=1"), "{text}");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}
