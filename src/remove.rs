//! Removing images, crash-safely, and finishing removals that a crash
//! interrupted.
//!
//! With the image's exclusive lock held, a removal:
//! 1. marks the image `deleting` (one transaction for a batch);
//! 2. renames its tree into `ROOT/trash/` — one atomic step that takes it out
//!    of the images directory (when the images directory is on another
//!    filesystem, the tree is instead deleted in place, still under the lock);
//! 3. drops the row (one transaction);
//! 4. unlinks the lock file, under its exclusive lock (the unlink rule);
//! 5. deletes the tree from the trash, outside every lock.
//!
//! A crash after 1 leaves a `deleting` row whose lock is free, after 3 a
//! lock file without a row, during 5 a leftover in the trash; `gc` and
//! `doctor --repair` finish each ([`finish_interrupted`]). At no point does a
//! half-deleted tree sit in the images directory under a `ready` row.
//!
//! Nothing outside the images directory is ever deleted: a rename moves a
//! symlink, not its target, and trees are deleted with `remove_dir_all`,
//! which never follows symlinks (it works with `openat`/`unlinkat`
//! relative to directory descriptors opened without following links).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};

use crate::clock;
use crate::debug;
use crate::lock::{self, Guard, Mode};
use crate::meta::{ImageRow, ImageState};
use crate::name::ImageName;
use crate::store::{Ctx, Store};
use crate::usage;

/// What one removal freed.
#[derive(Debug, Clone)]
pub struct Removed {
    pub name: String,
    pub state: ImageState,
    pub bytes: u64,
}

/// Removes images whose exclusive locks the caller holds. All must exist:
/// if one has no row, nothing is removed (exit 66 for `rm`).
pub fn remove_locked(store: &mut Store, held: Vec<(ImageName, Guard)>) -> Result<Vec<Removed>> {
    if held.is_empty() {
        return Ok(Vec::new());
    }
    // The trash must be usable before anything is marked (a symlink planted
    // in its place is refused here, not half-way through).
    crate::root::make_dir(&store.root().trash())?;
    // 1. Mark.
    let marked = store.with_tx_locked(None, |tx, ctx| {
        let mut rows = Vec::with_capacity(held.len());
        for (i, (name, _)) in held.iter().enumerate() {
            match tx.image(name.as_str())? {
                Some(r) => rows.push(r),
                None => return Ok(Err(i)),
            }
        }
        for (name, _) in &held {
            tx.set_state(name.as_str(), ImageState::Deleting)?;
        }
        Ok(Ok((tx.images_dir(&ctx.root)?, rows)))
    })?;
    let (images_dir, rows) = match marked {
        Ok(marked) => marked,
        Err(i) => {
            // Removed by someone else since the caller locked it: its lock
            // file (perhaps created by that very lock) names nothing now.
            let (name, guard) = held.into_iter().nth(i).expect("index of a held image");
            let _ = guard.unlink();
            return Err(crate::Error::NoSuchImage(name.as_str().to_owned()).into());
        }
    };
    debug::pause("rm-marked");

    // 2. Take the trees out of the images directory.
    let mut out = Vec::with_capacity(held.len());
    let mut trashed = Vec::new();
    for ((name, _), row) in held.iter().zip(&rows) {
        let tree = images_dir.join(name.encoded());
        let bytes = row
            .size_bytes
            .unwrap_or_else(|| usage::disk_usage(&tree).unwrap_or(0));
        if let Some(t) = to_trash(store.ctx(), &tree, name)? {
            trashed.push(t);
        }
        out.push(Removed {
            name: name.as_str().to_owned(),
            state: row.state,
            bytes,
        });
    }
    debug::pause("rm-moved");

    // 3. Drop the rows; 4. the lock files.
    store.with_tx_locked(None, |tx, _| {
        for (name, _) in &held {
            tx.delete_image(name.as_str())?;
        }
        Ok(())
    })?;
    for (name, guard) in held {
        guard
            .unlink()
            .with_context(|| format!("cannot remove the lock file of image '{name}'"))?;
        // The gate too, under its own exclusive lock; if a reader is just
        // passing it, the file stays (a few bytes, reused if the name is).
        if let Ok(Some(gate)) =
            lock::try_lock(&store.root().image_gate(&name), Mode::Exclusive, false)
        {
            let _ = gate.unlink();
        }
    }
    // 5. Outside every lock.
    for t in trashed {
        remove_tree(&t)?;
    }
    Ok(out)
}

/// Moves an image tree into the trash. Returns the trash path, or None if
/// there was no tree or it was deleted in place (images directory on another
/// filesystem than the root).
fn to_trash(ctx: &Ctx, tree: &Path, name: &ImageName) -> Result<Option<PathBuf>> {
    match fs::symlink_metadata(tree) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot inspect {}", tree.display())),
        Ok(_) => {}
    }
    crate::root::make_dir(&ctx.root.trash())?;
    let dest = ctx.root.trash().join(trash_name(ctx, name.encoded()));
    match fs::rename(tree, &dest) {
        Ok(()) => Ok(Some(dest)),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            remove_tree(tree)?;
            Ok(None)
        }
        Err(e) => {
            Err(e).with_context(|| format!("cannot move {} to {}", tree.display(), dest.display()))
        }
    }
}

fn trash_name(ctx: &Ctx, enc: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let short: String = enc.chars().take(100).collect();
    format!(
        "{}.{}.{}.{short}",
        clock::now_ms(),
        ctx.me.pid,
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// Deletes a tree without following any symlink in it; a symlink or file at
/// `path` itself is unlinked, not followed. Tolerates a concurrent deleter.
pub fn remove_tree(path: &Path) -> Result<()> {
    for _ in 0..3 {
        let r = match fs::symlink_metadata(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => Err(e),
            Ok(m) if m.is_dir() => {
                make_writable(path);
                fs::remove_dir_all(path)
            }
            Ok(_) => fs::remove_file(path),
        };
        match r {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot delete {}", path.display())),
        }
    }
    Ok(())
}

/// Gives the owner write access to every directory in the tree (without
/// following symlinks), so read-only directories inside an image can be
/// emptied — as root this does not matter, as anyone else it does.
fn make_writable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for e in walkdir::WalkDir::new(path)
        .follow_links(false)
        .into_iter()
        .flatten()
    {
        if e.file_type().is_dir()
            && let Ok(m) = e.metadata()
            && m.permissions().mode() & 0o700 != 0o700
        {
            let _ = fs::set_permissions(
                e.path(),
                fs::Permissions::from_mode(m.permissions().mode() | 0o700),
            );
        }
    }
}

/// What [`finish_interrupted`] found and did.
#[derive(Debug, Default)]
pub struct Leftovers {
    /// Images left `deleting` by a crashed removal (their lock is free).
    pub removals: Vec<String>,
    /// Entries in the trash.
    pub trash: Vec<PathBuf>,
    /// Lock files of images that have no row, not held by anyone.
    pub lock_files: Vec<PathBuf>,
}

impl Leftovers {
    pub fn is_empty(&self) -> bool {
        self.removals.is_empty() && self.trash.is_empty() && self.lock_files.is_empty()
    }
}

/// Reads `name`'s row again under an exclusive lock of it (its lock file,
/// or its gate): a decision made from an earlier list must be re-checked,
/// because the image may have been removed, created or rebuilt in between.
/// If it is gone, the file — which our try may have just recreated — names
/// nothing, and with `tidy` it is unlinked (we hold it: the unlink rule).
pub(crate) fn recheck(
    store: &mut Store,
    name: &ImageName,
    guard: Guard,
    tidy: bool,
) -> Result<Option<(Guard, ImageRow)>> {
    match store.with_tx_locked(None, |tx, _| tx.image(name.as_str()))? {
        Some(row) => Ok(Some((guard, row))),
        None => {
            if tidy {
                guard.unlink()?;
            }
            Ok(None)
        }
    }
}

/// Finds removals a crash interrupted and, with `fix`, finishes them: a
/// `deleting` image whose lock is free is removed; trash is emptied; lock
/// files of images without rows are unlinked (under their exclusive lock).
pub fn finish_interrupted(store: &mut Store, fix: bool) -> Result<Leftovers> {
    let mut found = Leftovers::default();
    let (deleting, names) = store.with_tx(None, |tx, _| {
        let rows = tx.images()?;
        let deleting: Vec<String> = rows
            .iter()
            .filter(|r| r.state == ImageState::Deleting)
            .map(|r| r.name.clone())
            .collect();
        let names: std::collections::HashSet<String> = rows.into_iter().map(|r| r.name).collect();
        Ok((deleting, names))
    })?;
    debug::pause("interrupted-listed");
    for name in deleting {
        let Ok(n) = ImageName::parse(&name) else {
            continue;
        };
        // A live remover holds the lock; only a free lock means a crash.
        // (A missing lock file is free too; it is created only to fix.)
        match lock::try_lock(&store.root().image_lock(&n), Mode::Exclusive, fix) {
            Ok(Some(guard)) => {
                // The remover we took for crashed may just have been slow.
                if let Some((guard, row)) = recheck(store, &n, guard, fix)?
                    && row.state == ImageState::Deleting
                {
                    found.removals.push(name);
                    if fix {
                        remove_locked(store, vec![(n, guard)])?;
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => found.removals.push(name),
            _ => {}
        }
    }
    if let Ok(entries) = fs::read_dir(store.root().trash()) {
        for e in entries.flatten() {
            found.trash.push(e.path());
            if fix {
                remove_tree(&e.path())?;
            }
        }
    }
    // On a filesystem not known to be local, lock files are kept on
    // purpose (see lock::Guard::unlink): they are no leftovers.
    let locks = store.root().image_locks();
    let kept = !lock::unlinks_allowed(&locks.join("x.lock"));
    if !kept && let Ok(entries) = fs::read_dir(&locks) {
        for e in entries.flatten() {
            let fname = e.file_name();
            let Some(enc) = fname
                .to_str()
                .and_then(|f| f.strip_suffix(".lock").or_else(|| f.strip_suffix(".gate")))
            else {
                continue;
            };
            let Ok(n) = ImageName::from_encoded(enc) else {
                continue;
            };
            if names.contains(n.as_str()) {
                continue;
            }
            // An exec creating this image holds the lock until its start
            // transaction made the row: only a free lock file is a leftover.
            // The image may have been created since we listed the rows.
            if let Ok(Some(guard)) = lock::try_lock(&e.path(), Mode::Exclusive, false)
                && recheck(store, &n, guard, fix)?.is_none()
            {
                found.lock_files.push(e.path());
            }
        }
    }
    Ok(found)
}
