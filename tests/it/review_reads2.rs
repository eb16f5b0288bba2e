//! Reads without the database's header, attacked again (src/records_db.rs,
//! record.rs, lock/mod.rs, lease.rs): whatever leaves a token in the
//! current format behind for a database that no longer vouches for it lets
//! a read in on an image that database does not call ready. Real processes
//! of the real binary against a real directory.

use std::fs;

use crate::common::*;

/// The first transaction on another database happens while an exclusive
/// reader of `base` runs (stowage's own `--read-exclusive`): its lock file
/// cannot be taken shared, and the walk of `records_db::for_this_database`
/// used to skip it, leaving the old database's token — in the format a
/// reader trusts without the header — beside a database that has no
/// `base` at all.
#[test]
fn a_token_held_by_an_exclusive_reader_across_a_change_of_database_stops_counting() {
    let (here, there) = base_read_here_and_another_store();
    let reader = here.hold(&["--read-exclusive", "base"], "started");
    here.put_database_of(&there);
    here.ok(["images"]);
    here.release("release");
    let held = reader.finish();
    assert_eq!(code(&held), Some(0), "{}", show(&held));
    here.assert_read_refused(
        "base",
        "a read trusted the token of a database no longer there",
    );
}

/// The same with the lock held by an outside program (flock(1) on the
/// lock file, which the design keeps working) during that transaction.
#[test]
fn a_token_held_by_flock_across_a_change_of_database_stops_counting() {
    let (here, there) = base_read_here_and_another_store();
    let holder = flock_holder(
        &here.lock_file("base"),
        &here.sentinel("flock-held"),
        &format!(
            "while [ ! -e '{}' ]; do sleep 0.01; done",
            here.sentinel("release").display()
        ),
    );
    here.put_database_of(&there);
    here.ok(["images"]);
    here.release("release");
    let _ = holder.finish();
    here.assert_read_refused(
        "base",
        "a read trusted the token of a database no longer there",
    );
}

/// A store shared by a group, where one user's lock file is not writable
/// for another (made under umask 022). The other user's transaction is
/// the first on a database put in place: its walk could not open that
/// file and passed over it, then stated the new identity — and the file's
/// owner went on reading through the old database's token, trusted
/// without the header, an image the database there does not have.
#[test]
fn a_token_another_user_cannot_write_is_not_passed_over_by_a_walk() {
    use std::os::unix::fs::PermissionsExt;
    if as_nobody().is_none() {
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("stowage-it.")
        .tempdir()
        .unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let mut here = Env::new();
    here.root = dir.path().join("root");
    here.make_image("base");
    here.ok(["exec", "--read", "base", "--", "true"]);
    let there = Env::new();
    there.make_image("other");
    // Group-shared (setgid directories, group-writable), but `base`'s lock
    // file as its maker's umask 022 left it.
    let group = |p: &std::path::Path| {
        std::os::unix::fs::chown(p, None, Some(65534)).unwrap();
        let mode = fs::symlink_metadata(p).unwrap().permissions().mode();
        let extra = if p.is_dir() { 0o2070 } else { 0o060 };
        fs::set_permissions(p, fs::Permissions::from_mode(mode | extra)).unwrap();
    };
    here.put_database_of(&there);
    for p in walkdir(&here.root) {
        group(&p);
    }
    group(&here.root);
    fs::set_permissions(here.lock_file("base"), fs::Permissions::from_mode(0o644)).unwrap();
    let theirs = || {
        let mut c = as_nobody().unwrap();
        c.arg(bin()).arg("--root").arg(&here.root).arg("images");
        c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
        output(c)
    };
    let first = theirs();
    let out = here.run(["exec", "--read", "base", "--", "true"]);
    // Either the other user's transaction is not the first on the new
    // database (it fails: nothing can change meanwhile), or what that
    // database says wins.
    assert!(
        code(&first) != Some(0) || code(&out) == Some(66),
        "a read trusted the token of a database no longer there after another user's transaction on it ({}): {}",
        show(&first),
        show(&out)
    );
    // The owner's first transaction takes it away; then the other user's
    // go through.
    here.ok(["images"]);
    let out = here.run(["exec", "--read", "base", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    let again = theirs();
    assert_eq!(code(&again), Some(0), "{}", show(&again));
}
