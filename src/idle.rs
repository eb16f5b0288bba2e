//! `lock-status` when nothing is held: its answer without the global lock
//! or the database.
//!
//! With the default selection (no image named, no `--all`) and nobody
//! holding or awaiting any of the store's locks but, perhaps, the global
//! lock itself, the database's view (`lock_status::gather`) shows the
//! global lock and every slot class, free, with its limit and reserve — and
//! nothing else: image rows, the store-wide hold and removed classes are
//! shown only while someone holds or awaits them. This look decides that
//! from what needs no database, and builds those rows; on any doubt it
//! answers `None` and the database's way is taken.
//!
//! Invariants:
//! - **Nothing is held or awaited**, by the kernel's word, decided per
//!   filesystem (the root's, found when it was checked; every lock file of
//!   the root is on it):
//!   - On a local filesystem whose lock-table device numbers are stat's
//!     (`filesystem::Filesystem::table_device_is_stat_device`; btrfs and
//!     overlayfs are not), the table must show no lock of any kind (flock,
//!     POSIX, OFD, lease) on the root's device but flocks on the global
//!     lock and locks on files that are not the store's: a lease, image
//!     lock, gate, slot, the store-wide lock or SQLite's locks on the
//!     database would show there. Whether a locked inode is the store's is
//!     asked only when the filesystem has locks besides the global lock's:
//!     by listing the root and its locks tree (their entries' inodes; on
//!     these filesystems a listing's inode is stat's), so a lock of another
//!     program elsewhere on the filesystem costs those listings, not the
//!     database's way. Looked at
//!     from the initial pid namespace, the table shows every lock of the
//!     host, so that is all. From another one it hides locks taken outside
//!     it, and the database's view then counts on the leases: the leases
//!     directory must hold no lease at all (a dead one is cleaned by the
//!     database's way, which this look does not do), and the global lock is
//!     probed where the table calls it free, as the database's view does.
//!   - Elsewhere with a local filesystem (btrfs, overlayfs, …), doubt.
//!   - On NFS and other shared filesystems there is no table: the leases
//!     directory must hold no lease, the global lock is probed, and so is
//!     every slot file (the database's view counts a slot held by a process
//!     on another host that wrote no lease): one held is doubt.
//! - **The class list is the `locks/slots` directory.** From schema 7
//!   every configured class has its directory there (made inside the
//!   transaction that creates the class, and by the migration for older
//!   ones), and the database's view shows exactly the configured classes
//!   while nothing is held; so the database's schema, read from its header,
//!   must be this binary's and at least 7.
//! - **A class's limits are its `0.lock` record** (`slot_record.rs`),
//!   which must be valid, of that class, settled, and of the database whose
//!   identity the header states (read once: the same check as a ready
//!   token's). Every change of a class takes its records away before it
//!   commits, so a valid record says what the database says, or said a
//!   moment ago; the records of all files of a class are written together,
//!   so one of them says what all say. A class without such a record (an
//!   unlimited one from before its `0.lock` carried one, a record not yet
//!   rewritten after a change, an unsettled one, a directory that is no
//!   class) is doubt.
//! - Nothing here writes: stale records, dead leases and the images of
//!   dead writers are left to the next look that takes the database's way
//!   (`images`, `gc`, an exec, a lock-status while something is held).

use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::ctx::Ctx;
use crate::holders::{global_holders, outsider};
use crate::judge::{LockReport, settle};
use crate::kernel::LockView;
use crate::lock::Probe;
use crate::meta::LockKind;
use crate::record::DbId;

/// The rows of `lock-status` with the default selection, if nothing is
/// held or awaited (see the module doc); `None`: take the database's way.
pub fn look(ctx: &Ctx) -> Option<Vec<LockReport>> {
    let root = &ctx.root;
    let fs = root.filesystem()?;
    let dev = root.dev()?;
    let global_path = root.global_lock();
    let (global, probe_slots) = if fs.table_device_is_stat_device() {
        let table = crate::kernel::read_table_and_all().ok()?;
        let ours: Vec<(u64, u64)> = table
            .flocks
            .keys()
            .chain(&table.others)
            .filter(|k| k.0 == dev)
            .copied()
            .collect();
        // Only the global lock's own identity is looked up, and only when
        // something on the filesystem is locked at all.
        let global_key = match ours.is_empty() {
            true => None,
            false => {
                let m = std::fs::symlink_metadata(&global_path).ok()?;
                Some((m.dev(), m.ino()))
            }
        };
        if global_key.is_some_and(|k| table.others.contains(&k)) {
            return None;
        }
        // Locks on other files of the filesystem: whose? Doubt if any is
        // on a file of the root or its locks tree (listed, for their
        // inodes, only then).
        let others: Vec<u64> = ours
            .iter()
            .filter(|k| Some(**k) != global_key)
            .map(|k| k.1)
            .collect();
        if !others.is_empty() {
            // A stowage process at work holds its lease: one listing of
            // the leases says so, where the store's listing below reads an
            // entry per image (100,000 of them cost tens of ms).
            if !no_lease(ctx) {
                return None;
            }
            let inodes = store_inodes(root.dir(), &root.locks())?;
            if others.iter().any(|i| inodes.contains(i)) {
                return None;
            }
        }
        let mut view = global_key
            .and_then(|k| table.flocks.get(&k))
            .map(|es| crate::kernel::view_of(es))
            .unwrap_or_else(|| LockView {
                state: Some(Probe::Free),
                ..LockView::default()
            });
        if !in_initial_pid_namespace() {
            if !no_lease(ctx) {
                return None;
            }
            // The table hides a holder outside our namespace: a probe has
            // the last word on "held", as in the database's view.
            if !view.is_held()
                && let Ok(p @ (Probe::Shared | Probe::Exclusive)) = crate::lock::probe(&global_path)
            {
                view.state = Some(p);
            }
        }
        (view, false)
    } else if fs.local {
        return None;
    } else {
        if !no_lease(ctx) {
            return None;
        }
        // As the database's view: a probe that fails says free.
        let state = crate::lock::probe(&global_path).ok();
        (
            LockView {
                state,
                ..LockView::default()
            },
            true,
        )
    };
    // Only now the database's header: when something is held, the way
    // through the database is taken without this read.
    let (db, schema) = DbId::with_schema(&root.db())?;
    if schema != crate::meta::schema_version() || schema < crate::slots::CLASS_DIRS_SCHEMA {
        return None;
    }
    let db = db?;
    let mut rows = vec![LockReport {
        kind: LockKind::Global,
        name: "global".into(),
        state: settle(global.state),
        holders: global_holders(ctx, &global),
        waiters: global.waiters.iter().map(|e| outsider(ctx, e)).collect(),
        image_state: None,
        slot: None,
    }];
    rows.extend(classes(&root.slot_locks(), db, probe_slots)?);
    Some(rows)
}

/// The inodes of the root's entries and of everything in its locks tree
/// (`locks/`, `images/`, `leases/`, `slots/`, each class's directory), from
/// their listings: every file stowage locks is one of them. `None` if a
/// directory cannot be listed or does not say an entry's type.
fn store_inodes(root: &Path, locks: &Path) -> Option<std::collections::HashSet<u64>> {
    let mut inodes = std::collections::HashSet::new();
    let list = |dir: &Path| -> Option<Vec<crate::dir::DirEntry>> {
        match crate::dir::Dir::open_nofollow(dir) {
            Ok(d) => d.listing().ok(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(Vec::new()),
            Err(_) => None,
        }
    };
    inodes.extend(list(root)?.iter().map(|e| e.ino));
    // The locks tree is three levels deep (locks/slots/CLASS/N.lock).
    let mut dirs = vec![(locks.to_owned(), 0)];
    while let Some((dir, depth)) = dirs.pop() {
        for e in list(&dir)? {
            inodes.insert(e.ino);
            match e.kind {
                libc::DT_DIR if depth < 3 => dirs.push((dir.join(&e.name), depth + 1)),
                libc::DT_UNKNOWN => return None,
                _ => {}
            }
        }
    }
    Some(inodes)
}

/// Whether the leases directory holds no lease (a missing one holds none).
fn no_lease(ctx: &Ctx) -> bool {
    let l = crate::lease::listing(&ctx.root.leases());
    l.names.is_empty()
        && (l.dir.is_some()
            || std::fs::symlink_metadata(ctx.root.leases())
                .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound))
}

/// Whether this process sees the initial pid namespace's lock table: its
/// /proc shows it in that namespace (`PROC_PID_INIT_INO`), so /proc/locks
/// hides no process of the host.
fn in_initial_pid_namespace() -> bool {
    std::fs::read_link("/proc/self/ns/pid").is_ok_and(|l| l.as_os_str() == "pid:[4026531836]")
}

/// Every slot class, free, from the `locks/slots` directory and each
/// class's `0.lock` record; with `probe`, every slot file is probed and one
/// held is doubt.
fn classes(slots: &Path, db: DbId, probe: bool) -> Option<Vec<LockReport>> {
    let names = match crate::dir::Dir::open(slots) {
        Ok(d) => d.names().ok()?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(_) => return None,
    };
    let mut classes = Vec::new();
    for enc in names {
        let enc = enc.into_string().ok()?;
        let class = enc.replace('%', "/");
        crate::slots::validate_class(&class).ok()?;
        classes.push((class, enc));
    }
    // The database's order (SQLite's BINARY collation: bytewise).
    classes.sort();
    let mut rows = Vec::new();
    for (class, enc) in classes {
        let dir = slots.join(&enc);
        let record = if probe {
            probed_record(&dir, &class)?
        } else {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open(dir.join("0.lock"))
                .ok()?;
            crate::slot_record::read_unchecked(&file, &class)?
        };
        let (limits, settled, id) = record;
        if !settled || id != db {
            return None;
        }
        rows.push(LockReport {
            kind: LockKind::Slot,
            name: class,
            state: Probe::Free,
            holders: Vec::new(),
            waiters: Vec::new(),
            image_state: None,
            slot: Some((limits.limit, limits.reserve, 0)),
        });
    }
    Some(rows)
}

/// Where there is no lock table: probes every slot file of the class (the
/// files the database's view counts: `*.lock` in its directory), and reads
/// the record of `0.lock` through the descriptor its probe opened. `None`
/// if one is held, or on any error.
fn probed_record(dir: &Path, class: &str) -> Option<(crate::slot_record::Limits, bool, DbId)> {
    let names = crate::dir::Dir::open(dir).ok()?.names().ok()?;
    let mut record = None;
    for name in names {
        let Some(name) = name.to_str().filter(|n| n.ends_with(".lock")) else {
            continue;
        };
        let Some(file) = crate::lock::open_existing(&dir.join(name)).ok()? else {
            continue;
        };
        if name == "0.lock" {
            record = crate::slot_record::read_unchecked(&file, class);
        }
        if crate::lock::probe_open(&file).ok()? != Probe::Free {
            return None;
        }
    }
    record
}
