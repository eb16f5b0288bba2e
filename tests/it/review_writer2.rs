//! Second round of attacks on writes without the database
//! (src/written.rs): markers beside leases, crashes at the steps of a
//! write that finishes the database's way, names at the limits.

use std::fs;

use crate::common::*;

fn marker(env: &Env, enc: &str) -> std::path::PathBuf {
    env.root.join("locks/leases").join(format!("{enc}.dirty"))
}

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
    assert!(marker(&env, "app").exists(), "written without the database");
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
        ["exec", "--write", "app", "--", "sh", "-c", "rm -rf \"$STOWAGE_IMAGE_DIR\""],
    ));
    assert!(committed.exists(), "killed after the commit: {}", show(&out));
    assert!(!env.root.join("img/app").exists());
    assert_eq!(env.state("app"), None, "deleted by its command");
    assert!(!marker(&env, "app").exists());
}
