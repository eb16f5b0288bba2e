//! Slots: cross-process counting semaphores, one class per runtime or kind
//! of heavy work (`pull`, `load/podman`).
//!
//! A class with limit N and reserve R is N + R lock files:
//!
//! ```text
//! ROOT/locks/slots/ENC/0.lock … (N-1).lock          normal slots
//! ROOT/locks/slots/ENC/high-0.lock … high-(R-1).lock  reserved for --priority high
//! ```
//!
//! (ENC is the class name with `/` → `%`, as for images.) Normal work takes
//! any free normal slot, so at most N run at once; high-priority work takes a
//! reserved slot first, else a normal one, so the total is at most N + R and
//! a small urgent request never waits behind a wall of big transfers (the
//! BuildKit design). Limit 0 means unlimited: no slot is taken (the class's
//! directory holds one file, `0.lock`, that carries its record).
//!
//! Invariants:
//! - A slot is an exclusive flock, so the kernel frees it when its holder
//!   dies: no token is ever lost (unlike a make jobserver's pipe).
//! - Slots come first in the lock order (slots → images → global).
//! - From schema 7 ([`CLASS_DIRS_SCHEMA`]) every configured class has its
//!   directory, made before the class is committed: `lock-status` lists
//!   the classes by their directories when nothing is held (idle.rs).
//! - The configuration lives in the metadata, and a copy of it in every
//!   slot file of the class (`slot_record.rs`), kept by whoever changes it
//!   under the global lock: an acquirer reads the copy in the file it
//!   locks and takes its slot without a transaction when the copy is
//!   valid; otherwise it reads the metadata. Each waiter re-reads it when
//!   `slots set`/`slots rm` touches the class's `changed` file, and every
//!   `acquire::slot::RECHECK` where another host may change it unannounced
//!   (30 s otherwise): a raised limit (or 0) lets waiters in, a lowered one
//!   binds them, a removed class ends their wait. Lowering a limit never disturbs current holders (they keep
//!   their higher-numbered files), and their slots count against the new
//!   limit until they end.
//! - Waiting for "any of N" needs no thread per file (a pids limit must not
//!   make a wait fail): the waiter keeps the N descriptors open, watches the
//!   class directory with inotify — the last close of a lock file's
//!   descriptor is both the release of its lock and an `IN_CLOSE_WRITE`
//!   event (`IN_CLOSE_NOWRITE` for a read-only holder such as flock(1)) —
//!   and tries the files again when woken. Where closes cannot be
//!   seen (another host on NFS; no inotify) it polls: every 250 ms on
//!   remote filesystems, 50 ms locally.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::ctx::Ctx;
use crate::error::Error;
use crate::lock::{self, Mode};
use crate::meta::{SlotClass, Tx};
use crate::store::Store;

pub use crate::slot_record::{CLASS_DIRS_SCHEMA, make_class_dir};

/// The largest limit (each waiter keeps every slot file open while it waits).
pub const MAX_LIMIT: u32 = 256;
/// The largest reserve for high-priority work.
pub const MAX_RESERVE: u32 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Priority {
    #[default]
    Normal,
    High,
}

/// Checks a class name: lowercase letters, digits, `.`, `_`, `-`, in
/// components separated by single `/`, at most 64 bytes.
pub fn validate_class(class: &str) -> Result<(), Error> {
    let bad = |why: &str| Err(Error::Usage(format!("invalid slot class {class:?}: {why}")));
    if class.is_empty() {
        return bad("the name is empty");
    }
    if class.len() > 64 {
        return bad("longer than 64 bytes");
    }
    for comp in class.split('/') {
        if comp.is_empty() {
            return bad("empty component (leading, trailing or double '/')");
        }
        if !comp.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit()) {
            return bad("each component must start with a lowercase letter or digit");
        }
        if let Some(c) = comp.chars().find(|c| {
            !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-'))
        }) {
            return bad(&format!(
                "{c:?} is not allowed (use lowercase letters, digits, '.', '_', '-', '/')"
            ));
        }
    }
    Ok(())
}

/// The files an acquirer of `priority` may take, in the order it tries them.
pub(crate) fn candidates(dir: &Path, class: &SlotClass, priority: Priority) -> Vec<PathBuf> {
    let normal = (0..class.limit).map(|i| dir.join(format!("{i}.lock")));
    let high = (0..class.reserve_high).map(|i| dir.join(format!("high-{i}.lock")));
    match priority {
        Priority::Normal => normal.collect(),
        Priority::High => high.chain(normal).collect(),
    }
}

/// The file whose close tells waiters that the class's configuration
/// changed: `ROOT/locks/slots/ENC/changed`.
pub(crate) const CHANGED: &str = "changed";

/// Tells waiters of `class` on this host to re-read its configuration
/// (others re-read it every [`crate::acquire::slot::RECHECK`]). Best effort.
pub fn notify_change(ctx: &Ctx, class: &str) {
    // Through descriptors, never a symlink planted in the path: a group
    // member could otherwise make us create `changed` elsewhere.
    let rel = crate::root::Root::slot_class_rel(class);
    if let Ok(dir) = ctx.root.open_sub(&rel) {
        let _ = dir.touch_closed(CHANGED);
    }
}

/// Writes the records of `class` into its slot files — its configuration
/// as `tx` reads it, or none when it is gone (slot_record.rs). The caller
/// is inside that transaction, under the global lock: after a change of
/// the class has committed, before a removal commits, or on finding a
/// record wanting. Best effort: a record not written only sends acquirers
/// to the database.
pub(crate) fn write_records(tx: &Tx, ctx: &Ctx, class: &str, config: Option<&SlotClass>) {
    let db = match config {
        Some(_) => tx.identity().ok().and_then(crate::record::DbId::from_id),
        None => None,
    };
    // A class gets its directory (an unlimited one too: its `0.lock`
    // carries its record); a removed one keeps what is left of it.
    let d = if db.is_some() && config.is_some() {
        make_class_dir(&ctx.root, class).ok()
    } else {
        class_dir(ctx, class).ok().flatten()
    };
    if let Some(d) = d {
        let _ = crate::slot_record::write_all(&d, config, db);
    }
}

/// The class's directory, opened from the root's descriptor without
/// following a link at any step (a planted one is an error); `None` if it
/// does not exist.
fn class_dir(ctx: &Ctx, class: &str) -> Result<Option<crate::dir::Dir>> {
    let rel = crate::root::Root::slot_class_rel(class);
    match std::fs::symlink_metadata(ctx.root.dir().join(&rel)) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        _ => ctx.root.open_sub(&rel).map(Some),
    }
}

/// Takes every record of `class` away (slot_record.rs), inside the
/// transaction that is about to change or remove the class, before it
/// commits. Not best effort: a record left would go on saying the old
/// configuration, valid and settled, to every acquirer — for good if the
/// change's process dies before the records that follow it are written —
/// so a record that cannot be taken away fails the change instead. Once
/// they are gone, whatever happens to the process, acquirers go to the
/// database, and the first one writes them anew.
pub(crate) fn take_records_away(ctx: &Ctx, class: &str) -> Result<()> {
    let dir = ctx.root.slot_class_dir(class);
    let Some(d) = class_dir(ctx, class)? else {
        return Ok(());
    };
    crate::slot_record::write_all(&d, None, None).map_err(|e| {
        anyhow::Error::new(e).context(format!(
            "cannot take the records of slot class '{class}' out of its slot files in {}",
            dir.display()
        ))
    })
}

/// Takes away what a class removed while its slots were held left behind,
/// once nobody holds them: its slot files and `changed` (each unlinked
/// under its exclusive lock, as [`remove_class`] does) and then its
/// directory, if that leaves it empty — which `lock-status` would
/// otherwise find, with no class behind it, and answer through the
/// database every time (idle.rs). Only directories of no configured class.
/// Under the global lock, in the transaction that read the classes: no
/// class can be made anew meanwhile (making one needs the global lock).
/// Best effort; on a filesystem where lock files are not unlinked (NFS)
/// they stay.
pub(crate) fn clean_removed(tx: &Tx, ctx: &Ctx) -> Result<()> {
    let slots = ctx.root.slot_locks();
    let Ok(top) = crate::dir::Dir::open_nofollow(&slots) else {
        return Ok(());
    };
    let Ok(names) = top.names() else {
        return Ok(());
    };
    let configured: Vec<String> = tx.slot_classes()?.into_iter().map(|c| c.name).collect();
    for enc in names {
        let Some(enc) = enc.to_str() else { continue };
        let class = enc.replace('%', "/");
        if configured.contains(&class) || validate_class(&class).is_err() {
            continue;
        }
        // Opened without following a link: a planted one is left alone.
        let Ok(Some(d)) = class_dir(ctx, &class) else {
            continue;
        };
        let Ok(files) = d.names() else { continue };
        let dir = slots.join(enc);
        for f in files {
            let Some(f) = f.to_str() else { continue };
            if !(f.ends_with(".lock") || f == CHANGED) {
                continue;
            }
            if let Ok(Some(g)) =
                lock::acquire_no_wait(&dir.join(f), Mode::Exclusive, lock::IfMissing::Fail)
            {
                let _ = crate::remove::unlink_lock(&ctx.root, g);
            }
        }
        let _ = top.rmdir(enc);
    }
    Ok(())
}

/// The configuration of a class; an unknown class is a usage error that
/// lists the configured ones.
pub fn lookup(tx: &Tx, class: &str) -> Result<SlotClass> {
    if let Some(c) = tx.slot_class(class)? {
        return Ok(c);
    }
    let known: Vec<String> = tx.slot_classes()?.into_iter().map(|c| c.name).collect();
    let hint = if known.is_empty() {
        "no slot classes are configured; add one with 'stowage slots set CLASS LIMIT'".to_owned()
    } else {
        format!("configured classes: {}", known.join(", "))
    };
    Err(Error::Usage(format!("unknown slot class '{class}' ({hint})")).into())
}

/// Removes a class: its configuration, then every slot file nobody holds
/// (unlinked under its exclusive lock, as the unlink rule requires).
/// Returns how many slots were still held (their files stay until released).
pub fn remove_class(store: &mut Store, class: &str) -> Result<u32> {
    validate_class(class)?;
    store.with_tx(None, |tx, ctx| {
        lookup(tx, class)?;
        // Its records go first: no acquirer takes a slot on them once the
        // removal has committed.
        take_records_away(ctx, class)?;
        tx.delete_slot_class(class)?;
        Ok(())
    })?;
    // Its waiters stop waiting (they re-read the class and find it gone).
    notify_change(store.ctx(), class);
    // Unlinked under the global lock, as records are written: a `slots
    // set` that makes the class anew cannot write a record into a file
    // between its emptying and its unlink — a valid record in an unlinked
    // file would vouch for it to whoever locks it next (a ghost slot:
    // lock::acquire_no_wait_vouched).
    let dir = store.root().slot_class_dir(class);
    store.with_tx(None, |tx, ctx| {
        let mut busy = 0;
        // Made anew meanwhile: its files are its own again.
        if tx.slot_class(class)?.is_some() {
            return Ok(busy);
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                match lock::acquire_no_wait(&e.path(), Mode::Exclusive, lock::IfMissing::Fail) {
                    Ok(Some(g)) => crate::remove::unlink_lock(&ctx.root, g)?,
                    Ok(None) => busy += 1,
                    Err(_) => {}
                }
            }
        }
        let _ = std::fs::remove_dir(&dir);
        Ok(busy)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_names() {
        for ok in ["pull", "load/podman", "a.b_c-d", "0", "x/y/z"] {
            assert!(validate_class(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Pull",
            "/pull",
            "pull/",
            "a//b",
            "-x",
            "a b",
            "a%b",
            "a:b",
            &"x".repeat(65),
        ] {
            assert!(validate_class(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn high_priority_tries_the_reserve_first() {
        let class = SlotClass {
            name: "pull".into(),
            limit: 2,
            reserve_high: 1,
        };
        let d = Path::new("/r");
        let names = |p| {
            candidates(d, &class, p)
                .iter()
                .map(|f| f.file_name().unwrap().to_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(Priority::Normal), ["0.lock", "1.lock"]);
        assert_eq!(names(Priority::High), ["high-0.lock", "0.lock", "1.lock"]);
    }
}
