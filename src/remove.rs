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
//! A removal that fails before its tree moved (the rename refused: an
//! immutable tree, permissions in a shared root, a busy mount) is undone:
//! the image gets its previous state back and the error says why. Images of
//! the same batch whose trees did move are finished.
//!
//! Nothing outside the images directory is ever deleted: the trash, the
//! images directory and the lock directories are opened as descriptors that
//! refuse a symlink in their place, trees move with `renameat` relative to
//! them (a symlink moves as a link) and are deleted with the descriptor
//! walk of [`crate::dir`], which never follows a link or leaves its
//! filesystem.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};

use crate::clock;
use crate::ctx::Ctx;
use crate::debug;
use crate::dir::Dir;
use crate::disk_usage;
use crate::lock::{self, Guard, Mode};
use crate::meta::{ImageRow, ImageState};
use crate::name::ImageName;
use crate::root::Root;
use crate::store::Store;

/// What one removal freed.
#[derive(Debug, Clone)]
pub struct Removed {
    pub name: String,
    pub state: ImageState,
    pub bytes: u64,
    /// The image is gone, but its tree could not be deleted from the
    /// trash (why); `gc` deletes it once the cause is fixed.
    pub left_in_trash: Option<String>,
}

/// How taking one tree out of the images directory went.
enum Taken {
    /// Moved to the trash under this name.
    Trashed(OsString),
    /// There was no tree: nothing was freed.
    Gone,
    /// Deleted in place.
    Deleted,
    /// Nothing moved: the removal can be undone.
    Refused(anyhow::Error),
    /// Deleted in place only in part: the tree is damaged.
    Partial(anyhow::Error),
}

/// Removes images whose exclusive locks the caller holds. All must exist:
/// if one has no row, nothing is removed (exit 66 for `rm`). If a tree
/// cannot be taken out of the images directory, that image and the ones
/// after it get their previous states back and the error is returned; the
/// ones before it are removed.
pub fn remove_locked(store: &mut Store, held: Vec<(ImageName, Guard)>) -> Result<Vec<Removed>> {
    if held.is_empty() {
        return Ok(Vec::new());
    }
    // The trash and the images directory must be usable before anything is
    // marked (a symlink planted in their place is refused here, not
    // half-way through).
    let trash = store.root().open_or_make_sub("trash")?;
    // What a writer without the database left in a lock file we hold is
    // the truth about its image (written.rs): folded first — a new image
    // has no row before it — and only then are the tokens taken away.
    let (images_dir, doubt, folded) = store.with_tx_holding_locks(None, |tx, ctx| {
        let mut folded = Vec::new();
        for (name, guard) in &held {
            if crate::written::fold_held(tx, ctx, name, guard.file())? {
                folded.push(name.clone());
            }
        }
        let dir = tx.images_dir(&ctx.root)?;
        let doubt = crate::adopt::unmounted(tx, &ctx.root, &dir)?;
        Ok((dir, doubt, folded))
    })?;
    for name in &folded {
        crate::written::unmark(store.root(), name);
    }
    // A tree missing from an images directory that is not the one recorded
    // (unmounted) is not gone: dropping its row would orphan it.
    if let Some(why) = doubt {
        anyhow::bail!("cannot remove images: {why}");
    }
    let images = store.root().open_images_dir(&images_dir).with_context(|| {
        format!(
            "cannot remove images: images directory {} is not usable (is it mounted?)",
            images_dir.display()
        )
    })?;
    // 1. Mark — the ready tokens first, durably (record.rs): from the
    // mark on, no read may find the image ready without the database.
    for (name, guard) in &held {
        crate::record::invalidate(guard.file())
            .with_context(|| format!("cannot write the lock file of image '{name}'"))?;
    }
    let marked = store.with_tx_holding_locks(None, |tx, ctx| {
        crate::store_wide::check_busy(tx, ctx)?;
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
        Ok(Ok(rows))
    })?;
    let rows = match marked {
        Ok(rows) => rows,
        Err(i) => {
            // Removed by someone else since the caller locked it: its lock
            // file (perhaps created by that very lock) names nothing now.
            // So is its gate, which a removal that waited for the lock
            // (the loser of two `rm` of one image) held and let go.
            let (name, guard) = held.into_iter().nth(i).expect("index of a held image");
            let _ = unlink_lock(store.root(), guard);
            unlink_gate(store.root(), &name);
            return Err(crate::Error::NoSuchImage(name.as_str().to_owned()).into());
        }
    };
    debug::pause("rm-marked");

    // 2. Take the trees out of the images directory, until one refuses.
    let mut out = Vec::with_capacity(held.len());
    let mut trashed = Vec::new();
    let mut failed = None;
    for (i, ((name, _), row)) in held.iter().zip(&rows).enumerate() {
        let tree = images_dir.join(name.encoded());
        let mut bytes = row
            .size_bytes
            .unwrap_or_else(|| disk_usage::disk_usage(&tree).unwrap_or(0));
        match take_out(store.ctx(), &images, &trash, &tree, name) {
            Taken::Trashed(t) => trashed.push((out.len(), t)),
            Taken::Deleted => {}
            // A row without a tree (a removal that crashed after the move
            // leaves its tree in the trash, counted there): nothing freed.
            Taken::Gone => bytes = 0,
            Taken::Refused(e) => {
                failed = Some((i, e, false));
                break;
            }
            Taken::Partial(e) => {
                failed = Some((i, e, true));
                break;
            }
        }
        out.push(Removed {
            name: name.as_str().to_owned(),
            state: row.state,
            bytes,
            left_in_trash: None,
        });
    }
    debug::pause("rm-moved");

    // 3. Drop the rows of the trees that went; undo the rest.
    let done = failed.as_ref().map_or(held.len(), |(i, _, _)| *i);
    store.with_tx_holding_locks(None, |tx, _| {
        for (name, _) in &held[..done] {
            tx.delete_image(name.as_str())?;
        }
        for (k, ((name, _), row)) in held.iter().zip(&rows).enumerate().skip(done) {
            // A tree half deleted in place is not what it was: incomplete.
            let damaged = failed.as_ref().is_some_and(|(i, _, p)| *p && *i == k);
            let state = if damaged {
                ImageState::Incomplete
            } else {
                row.state
            };
            tx.set_state(name.as_str(), state)?;
        }
        Ok(())
    })?;
    // 4. The lock files of removed images, under their exclusive locks.
    for (name, guard) in held.into_iter().take(done) {
        unlink_lock(store.root(), guard)
            .with_context(|| format!("cannot remove the lock file of image '{name}'"))?;
        unlink_gate(store.root(), &name);
    }
    // 5. Outside every lock. One tree that cannot be deleted (an immutable
    // file) stops neither the others nor the report of what was removed.
    for (k, t) in trashed {
        crate::signals::check()?;
        let mut n = 0;
        if let Err(e) = trash.remove_entry(&t, &mut n) {
            out[k].left_in_trash = Some(format!(
                "image '{}' was removed, but its tree could not be deleted from the trash ('stowage gc' deletes it once the cause is fixed): cannot delete {}: {e}",
                out[k].name,
                store.root().trash().join(&t).display()
            ));
        }
    }
    if let Some((i, e, partial)) = failed {
        let name = &rows[i].name;
        let undone = if partial {
            format!(
                "image '{name}' was deleted only in part and is now incomplete ('stowage gc' removes it once the cause is fixed)"
            )
        } else {
            format!(
                "nothing of image '{name}' was removed; it is {} again",
                rows[i].state
            )
        };
        return Err(e.context(undone));
    }
    Ok(out)
}

/// Takes an image tree out of the images directory: moves it into the
/// trash, or deletes it in place when the images directory is on another
/// filesystem than the root.
fn take_out(ctx: &Ctx, images: &Dir, trash: &Dir, tree: &Path, name: &ImageName) -> Taken {
    let enc = name.encoded();
    match images.stat_at(enc) {
        Ok(None) => return Taken::Gone,
        Ok(Some(_)) => {}
        Err(e) => {
            return Taken::Refused(
                anyhow::Error::new(e).context(format!("cannot inspect {}", tree.display())),
            );
        }
    }
    let dest = trash_name(ctx, enc);
    match images.rename_to(enc, trash, &dest) {
        Ok(()) => Taken::Trashed(dest.into()),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            let mut removed = 0;
            match images.remove_entry(enc, &mut removed) {
                Ok(()) => Taken::Deleted,
                Err(e) => {
                    let e =
                        anyhow::Error::new(e).context(format!("cannot delete {}", tree.display()));
                    if removed == 0 {
                        Taken::Refused(e)
                    } else {
                        Taken::Partial(e)
                    }
                }
            }
        }
        Err(e) => Taken::Refused(anyhow::Error::new(e).context(format!(
            "cannot move {} to {}",
            tree.display(),
            ctx.root.trash().display()
        ))),
    }
}

/// Unlinks the gate of an image that has no row, under the gate's own
/// exclusive lock; if a reader is just passing it, the file stays (a few
/// bytes, reused if the name is).
pub(crate) fn unlink_gate(root: &Root, name: &ImageName) {
    if let Ok(Some(gate)) = lock::acquire_no_wait(
        &root.image_gate(name),
        Mode::Exclusive,
        lock::IfMissing::Fail,
    ) {
        let _ = unlink_lock(root, gate);
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

/// Unlinks a lock file we hold exclusively (the unlink rule), through
/// descriptors of the lock directories: a symlink planted in place of
/// `locks/` or `locks/images/` is refused, and only the very file we
/// locked is unlinked, not whatever took its name since.
pub fn unlink_lock(root: &Root, guard: Guard) -> Result<()> {
    unlink_held_lock(root, &guard)
}

/// [`unlink_lock`] for a lock whose guard the caller keeps (it releases it
/// later; whoever locks the unlinked file meanwhile finds it unlinked and
/// retries, as the unlink rule has it).
pub fn unlink_held_lock(root: &Root, guard: &Guard) -> Result<()> {
    let path = guard.path().to_owned();
    // On a filesystem not known to be local the file is kept: another
    // host's cached lookup could still lead it to the unlinked file (see
    // lock::Guard::unlink).
    if !lock::unlinks_allowed(&path) {
        return Ok(());
    }
    let rel = path
        .strip_prefix(root.dir())
        .with_context(|| format!("lock file {} is not in the root", path.display()))?;
    let (Some(parent), Some(file)) = (rel.parent(), rel.file_name()) else {
        anyhow::bail!("lock file {} is not in the root", path.display());
    };
    let parent = parent
        .to_str()
        .with_context(|| format!("lock file {} has a name that is not UTF-8", path.display()))?;
    let dir = root.open_sub(parent)?;
    let (dev, ino) = guard.identity();
    // Emptied first, still holding it: a lock file whose contents vouch
    // for it (a token, a slot's record) is then never a ghost, which lets
    // a reader skip the stat of the unlink race (lock::acquire_no_wait_vouched).
    // One that cannot be emptied is kept.
    guard
        .file()
        .set_len(0)
        .with_context(|| format!("cannot empty {} before unlinking it", path.display()))?;
    dir.unlink_if(file, dev, ino)
        .with_context(|| format!("cannot unlink {}", path.display()))?;
    Ok(())
}

/// Removes an image's directory if it is empty (undoing a start), through
/// a descriptor of the images directory. Anything in it stays for the user
/// to inspect.
pub fn remove_empty_image_dir(root: &Root, images_dir: &Path, name: &ImageName) {
    if let Ok(images) = root.open_images_dir(images_dir) {
        let _ = images.rmdir(name.encoded());
    }
}

/// Empties an image's directory without following any link in it (`exec
/// --from` rebuilding an image from its base).
pub fn empty_image_dir(root: &Root, images_dir: &Path, name: &ImageName) -> Result<()> {
    let path = images_dir.join(name.encoded());
    let dir = root
        .open_images_dir(images_dir)?
        .sub(name.encoded())
        .with_context(|| format!("cannot open {}", path.display()))?;
    let mut n = 0;
    for entry in dir
        .names()
        .with_context(|| format!("cannot list {}", path.display()))?
    {
        crate::signals::check()?;
        dir.remove_entry(&entry, &mut n)
            .with_context(|| format!("cannot delete {}", path.join(&entry).display()))?;
    }
    Ok(())
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
    /// What could not be finished, one line each (the others were).
    pub failed: Vec<String>,
    /// Bytes the finished removals and the deleted trash gave back (the
    /// trash as it would, without `fix`).
    pub bytes: u64,
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
    let look = |tx: &crate::meta::Tx, ctx: &Ctx| {
        // Under our lock, its record is the truth if a writer left one
        // (written.rs): a decision from an earlier list must see it.
        let folded = crate::written::fold_held(tx, ctx, name, guard.file())?;
        Ok((folded, tx.image(name.as_str())?))
    };
    let (folded, looked) = match store.with_tx_holding_locks(None, look) {
        // Only looking (a dry run) on a full filesystem: the fold in
        // memory, rolled back (its marker stays for one that commits).
        Err(e) if !tidy && crate::space::is_full(&e) => (false, store.view_tx(look)?.1),
        other => other?,
    };
    if folded {
        crate::written::unmark(store.root(), name);
    }
    match looked {
        Some(row) => Ok(Some((guard, row))),
        None => {
            if tidy {
                unlink_lock(store.root(), guard)?;
            }
            Ok(None)
        }
    }
}

/// Finds removals a crash interrupted and, with `fix`, finishes them: a
/// `deleting` image whose lock is free is removed; trash is emptied; lock
/// files of images without rows are unlinked (under their exclusive lock).
/// A trash or lock directory that is not a real directory (a planted
/// symlink) is an error: nothing in it is touched. A removal or trash
/// entry that cannot be finished is reported in `failed` and the rest go
/// on: one immutable tree must not stop every later gc.
pub fn finish_interrupted(store: &mut Store, fix: bool) -> Result<Leftovers> {
    let mut found = Leftovers::default();
    // Only looking (a dry run): on a full filesystem too, where what a
    // transaction would fold first is folded in memory (`Store::read_tx`).
    let look = |tx: &crate::meta::Tx, _: &Ctx| {
        let rows = tx.images()?;
        let deleting: Vec<String> = rows
            .iter()
            .filter(|r| r.state == ImageState::Deleting)
            .map(|r| r.name.clone())
            .collect();
        let names: std::collections::HashSet<String> = rows.into_iter().map(|r| r.name).collect();
        Ok((deleting, names))
    };
    let (deleting, names) = match fix {
        true => store.with_tx(None, look)?,
        false => store.read_tx(look)?,
    };
    debug::pause("interrupted-listed");
    for name in deleting {
        let Ok(n) = ImageName::parse(&name) else {
            continue;
        };
        // A live remover holds the lock; only a free lock means a crash.
        // (A missing lock file is free too; it is created only to fix.)
        match lock::acquire_no_wait(
            &store.root().image_lock(&n),
            Mode::Exclusive,
            lock::IfMissing::create_if(fix),
        ) {
            Ok(Some(guard)) => {
                // The remover we took for crashed may just have been slow.
                if let Some((guard, row)) = recheck(store, &n, guard, fix)?
                    && row.state == ImageState::Deleting
                {
                    found.removals.push(name);
                    if fix {
                        match remove_locked(store, vec![(n, guard)]) {
                            Ok(done) => {
                                found.bytes += done.iter().map(|r| r.bytes).sum::<u64>();
                                found
                                    .failed
                                    .extend(done.into_iter().filter_map(|r| r.left_in_trash));
                            }
                            // Refused before anything moved: a store-wide
                            // command holds the store. Finished later, as a
                            // removal whose lock is held is.
                            Err(e)
                                if matches!(
                                    e.downcast_ref::<crate::Error>(),
                                    Some(crate::Error::Busy(_))
                                ) => {}
                            Err(e) => found.failed.push(format!("{e:#}")),
                        }
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => found.removals.push(name),
            _ => {}
        }
    }
    let root = store.root().clone();
    match root.open_sub("trash") {
        Ok(trash) => {
            for entry in trash
                .names()
                .with_context(|| format!("cannot list {}", root.trash().display()))?
            {
                let path = root.trash().join(&entry);
                let bytes = disk_usage::disk_usage(&path).unwrap_or(0);
                let mut n = 0;
                // What could not be deleted is reported as such, not as
                // a trash entry that was removed.
                if fix && let Err(e) = trash.remove_entry(&entry, &mut n) {
                    found
                        .failed
                        .push(format!("cannot delete {}: {e}", path.display()));
                    continue;
                }
                found.bytes += bytes;
                found.trash.push(path);
            }
        }
        // No trash yet: nothing was ever removed.
        Err(_) if root.trash().symlink_metadata().is_err() => {}
        Err(e) => return Err(e),
    }
    // On a filesystem not known to be local, lock files are kept on
    // purpose (see lock::Guard::unlink): they are no leftovers.
    let kept = !lock::unlinks_allowed(&root.image_locks().join("x.lock"));
    let locks = match root.open_sub(Root::IMAGE_LOCKS_REL) {
        _ if kept => Vec::new(),
        Ok(d) => d
            .names()
            .with_context(|| format!("cannot list {}", root.image_locks().display()))?,
        Err(_) if root.image_locks().symlink_metadata().is_err() => Vec::new(),
        Err(e) => return Err(e),
    };
    for fname in locks {
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
        let path = root.image_locks().join(&fname);
        // An exec creating this image holds the lock until its start
        // transaction made the row: only a free lock file is a leftover.
        // The image may have been created since we listed the rows.
        if let Ok(Some(guard)) =
            lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Fail)
        {
            // A writer's record (a new image written without the database,
            // not folded yet) is no leftover: a dry run leaves it to the
            // next fold rather than fold it (a write) to be sure.
            if !fix && crate::written::carries_writers_record(guard.file()) {
                continue;
            }
            if recheck(store, &n, guard, fix)?.is_none() {
                found.lock_files.push(path);
            }
        }
    }
    Ok(found)
}

/// After a start that did not happen (a later lock timed out, a signal, a
/// refusal, a command that could not run): the lock files and gates of
/// images that still have no row go again, so nothing is left behind for
/// an image that does not exist. `held` are exclusive locks we hold;
/// `waited_for` images whose lock or gate we may have created while
/// waiting (and no longer hold) — their files go only if nobody holds
/// them. Best effort: what is left is a harmless leftover that `gc` and
/// `doctor --repair` remove.
pub(crate) fn release_unclaimed(
    store: &mut Store,
    held: Vec<(ImageName, Guard)>,
    waited_for: &[ImageName],
) {
    if held.is_empty() && waited_for.is_empty() {
        return;
    }
    let root = store.root().clone();
    let Ok((tx, _)) = store.begin_give_up() else {
        return;
    };
    // No row, and no writer's record either: a write without the database
    // (written.rs) may have left one, the truth about a new image until
    // the next transaction folds it — such a file is no leftover.
    let rowless = |n: &ImageName, file: Option<&std::fs::File>| {
        matches!(tx.image(n.as_str()), Ok(None))
            && !file.is_some_and(crate::written::carries_writers_record)
    };
    let gate = |n: &ImageName| {
        lock::acquire_no_wait(&root.image_gate(n), Mode::Exclusive, lock::IfMissing::Fail)
    };
    let mut doomed = Vec::new();
    for (name, guard) in held {
        if rowless(&name, Some(guard.file())) {
            doomed.push(guard);
            if let Ok(Some(g)) = gate(&name) {
                doomed.push(g);
            }
        }
    }
    for name in waited_for.iter().filter(|n| rowless(n, None)) {
        if let Ok(Some(g)) = lock::acquire_no_wait(
            &root.image_lock(name),
            Mode::Exclusive,
            lock::IfMissing::Fail,
        ) && rowless(name, Some(g.file()))
        {
            doomed.push(g);
        }
        if let Ok(Some(g)) = gate(name) {
            doomed.push(g);
        }
    }
    // Under the global lock still: nobody can create a row meanwhile.
    for g in doomed {
        let _ = unlink_lock(&root, g);
    }
    drop(tx);
}

/// Unlinks an image's lock file (we hold it exclusively) and its gate
/// (if nobody is passing it right now).
pub(crate) fn unlink_image_lock(root: &Root, name: &ImageName, guard: Guard) {
    let _ = unlink_lock(root, guard);
    unlink_gate(root, name);
}
