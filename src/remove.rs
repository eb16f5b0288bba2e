//! Removing images, crash-safely, and finishing removals a crash cut short.
//!
//! Under the image's exclusive lock a removal:
//! 1. records `deleting` (synced): from here nobody reads it;
//! 2. renames the tree into `ROOT/trash/`, one atomic step (on another filesystem than the root,
//!    deletes it in place, still under the lock);
//! 3. empties the lock file and unlinks it (where lock files may be);
//! 4. deletes the tree from the trash, outside every lock.
//!
//! - A crash after 1 leaves `deleting` under a free lock, finished by `gc`, `doctor --repair` or
//!   the next writer; after 3, a leftover in the trash. No half-deleted tree is ever `ready`.
//! - A removal that fails before its tree moved is undone, and says why.
//! - Nothing outside the images directory is deleted (descriptors: [`crate::dir`]).

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};

use crate::acquire::image::Held;
use crate::clock;
use crate::debug;
use crate::dir::Dir;
use crate::disk_usage;
use crate::ident::STOWAGE;
use crate::image_record::{self, Record, State};
use crate::lock::Mode;
use crate::name::ImageName;
use crate::root::{Root, in_use_by_a_store};

/// What one removal freed.
#[derive(Debug, Clone)]
pub struct Removed {
    pub name: String,
    pub state: State,
    /// None if the tree could not be measured.
    pub bytes: Option<u64>,
    /// Why the image's tree was left in the trash; `gc` deletes it once the cause is fixed.
    pub left_in_trash: Option<String>,
    /// Why its emptied lock file (which names no image) could not be unlinked.
    pub lock_file_left: Option<String>,
    /// Its record named another images directory than the store's: the tree there is left.
    pub tree_left: Option<String>,
}

/// How taking one tree out of the images directory went.
enum Taken {
    Trashed(OsString),
    /// There was no tree: nothing was freed.
    Gone,
    Deleted,
    /// Nothing moved: the removal can be undone.
    Refused(anyhow::Error),
    /// Deleted in place only in part.
    Partial(anyhow::Error),
}

/// Removes an image whose exclusive lock `held` the caller holds; `size`: if known.
pub fn remove_held(root: &Root, mut held: Held, size: Option<u64>) -> Result<Removed> {
    let config = (held.seen.damaged).then(|| crate::images_dir::config(root));
    let unknown = config
        .transpose()?
        .map(|c| image_record::Record::unknown(held.name.as_str(), c.images, clock::now_ms()));
    // A damaged record is an image of unknown state: removed on request.
    let Some(before) = held.seen.record.clone().or(unknown) else {
        // The file (perhaps made by the very lock taken) names nothing. One a shell's `>` emptied
        // stays: it is the evidence `doctor` names the cause by.
        if crate::images_dir::record_erased(root, &held.name) != Some(true) {
            let _ = root.unlink_lock(held.guard);
            root.unlink_gate(&held.name);
        }
        return Err(crate::Error::NoSuchImage(vec![held.name.as_str().to_owned()]).into());
    };
    let state = before.state_seen(false);
    if let Some(theirs) = crate::images_dir::named_elsewhere(root, &before)? {
        return drop_record_only(root, held, state, theirs);
    }
    let (images, tree) = images_dir_of(root, &held.name, &before)?;
    let trash = root.open_trash()?;
    let mut bytes = size.or_else(|| disk_usage::freed_by_deleting(&tree).ok());
    // 1. The record says so first, durably.
    let mut deleting = before.clone();
    deleting.state = State::Deleting;
    deleting.changed = clock::now_ms();
    write_record(root, &mut held, &deleting)
        .with_context(|| format!("cannot write the record of image '{}'", held.name))?;
    debug::pause("rm-marked");
    // 2. The tree leaves the images directory, the lock asked first where it may be lost: another
    // host that took it meanwhile may have finished this removal and written a new tree there.
    still_ours(&held)?;
    let taken = take_out(root, &images, &trash, &tree, &held.name);
    if matches!(taken, Taken::Gone) {
        bytes = Some(0);
    }
    let moved = after_take_out(root, &mut held, &before, taken)?;
    debug::pause("rm-moved");
    still_ours(&held)?;
    // 3. The record and its lock file go.
    let (name, lock_file_left) = drop_the_record(root, held)?;
    // 4. Outside every lock; what could not be deleted is left for gc, and said.
    let left_in_trash = match moved {
        Some(t) => {
            crate::signals::check()?;
            remove_trash_entry(&trash, &t).err().map(|e| {
                format!(
                    "image '{name}' was removed, but its tree is left in the trash ('{STOWAGE} gc' deletes it once it can): {}: {e}",
                    root.trash().join(&t).display()
                )
            })
        }
        None => None,
    };
    Ok(Removed {
        name: name.as_str().to_owned(),
        state,
        bytes,
        left_in_trash,
        lock_file_left,
        tree_left: None,
    })
}

/// The record and lock file of image `held` go, unlisted from our lease first (its next taker is
/// named); why its emptied lock file is left, if it is.
fn drop_the_record(root: &Root, held: Held) -> Result<(ImageName, Option<String>)> {
    let name = held.name.clone();
    crate::lease::forget(&root.leases(), &Root::image_lock_rel(&name));
    let left = root
        .drop_record(&name, held.guard)
        .with_context(|| format!("cannot remove the record of image '{name}'"))?
        .map(|why| format!("image '{name}' was removed, but its emptied lock file is left (it names no image; '{STOWAGE} doctor --repair' removes it once it can): {why}"));
    Ok((name, left))
}

/// Removes the record of an image `held` whose record names images directory `theirs`, not the
/// store's: nothing there is ours to delete, so its tree, if any, stays where it is.
fn drop_record_only(root: &Root, held: Held, state: State, theirs: PathBuf) -> Result<Removed> {
    let (name, lock_file_left) = drop_the_record(root, held)?;
    let theirs = theirs.display();
    Ok(Removed {
        name: name.as_str().to_owned(),
        state,
        bytes: Some(0),
        left_in_trash: None,
        lock_file_left,
        tree_left: Some(format!(
            "the record of image '{name}' named images directory {theirs}, not the store's: its tree there, if any, is left as it is"
        )),
    })
}

/// The images directory `record` names, opened and confirmed, and the path of `name`'s tree in it;
/// refused where it is not the one recorded (unmounted, another mounted there): no tree is gone.
fn images_dir_of(root: &Root, name: &ImageName, record: &Record) -> Result<(Dir, PathBuf)> {
    let images_dir = crate::images_dir::of_record(root, record)?;
    let opened = root.open_images_dir(&images_dir);
    let images = crate::images_dir::confirmed(root, &images_dir, opened)
        .with_context(|| format!("cannot remove image '{name}'"))?;
    let tree = images_dir.join(name.encoded());
    Ok((images, tree))
}

/// Once the tree was taken out: the trash entry to delete, if any. If it could not be, the record
/// is put back as it was or `incomplete` (removed in part).
fn after_take_out(
    root: &Root,
    held: &mut Held,
    before: &image_record::Record,
    taken: Taken,
) -> Result<Option<OsString>> {
    let (put_back, e, what) = match taken {
        Taken::Trashed(t) => return Ok(Some(t)),
        Taken::Deleted | Taken::Gone => return Ok(None),
        Taken::Refused(e) => {
            let (name, state) = (&held.name, before.state_seen(false).as_str());
            let what = format!("nothing of image '{name}' was removed; it is {state} again");
            (before.clone(), e, what)
        }
        Taken::Partial(e) => {
            let mut broken = before.clone();
            broken.state = State::Incomplete;
            broken.outcome = Some("removal failed half-way".into());
            let name = &held.name;
            let what = format!(
                "image '{name}' was deleted only in part and is now incomplete ('{STOWAGE} gc' removes it once the cause is fixed)"
            );
            (broken, e, what)
        }
    };
    let _ = write_record(root, held, &put_back);
    Err(e.context(what))
}

/// Writes the record of the image `held`, on a full filesystem from the space kept for it.
fn write_record(root: &Root, held: &mut Held, record: &Record) -> std::io::Result<()> {
    image_record::write_reserved(held.guard.file(), &mut held.seen, record, &root.reserve())
}

/// Finishes a removal a crash cut short (its `deleting` record found under its exclusive lock):
/// the tree leaves, the record goes. Bytes freed if deleted in place (the trash counts its own).
pub fn finish_held(root: &Root, held: Held) -> Result<u64> {
    let Some(record) = held.seen.record.as_ref() else {
        return Ok(0);
    };
    let images_dir = crate::images_dir::of_record(root, record)?;
    let trash = root.open_trash()?;
    let opened = root.open_images_dir(&images_dir);
    let Ok(images) = crate::images_dir::confirmed(root, &images_dir, opened) else {
        let (name, shown) = (&held.name, images_dir.display());
        anyhow::bail!(
            "cannot finish the removal of image '{name}': images directory {shown} is not usable (is it mounted?)"
        );
    };
    let tree = images_dir.join(held.name.encoded());
    // Measured before it goes: only the move tells whether here or the trash frees it.
    let bytes = disk_usage::freed_by_deleting(&tree).unwrap_or(0);
    still_ours(&held)?;
    let freed = match take_out(root, &images, &trash, &tree, &held.name) {
        Taken::Refused(e) | Taken::Partial(e) => return Err(e),
        Taken::Deleted => bytes,
        Taken::Trashed(_) | Taken::Gone => 0,
    };
    still_ours(&held)?;
    let lock_file = disk_usage::blocks_of(held.guard.file());
    let left = root.drop_record(&held.name, held.guard)?;
    Ok(freed + lock_file * u64::from(left.is_none()))
}

/// Before a removal's tree and then its record go: its lock, where it may be lost, must still be
/// ours, else another may have finished the removal and written the name anew; all is left as is.
fn still_ours(held: &Held) -> Result<()> {
    match held.guard.lost() {
        None => Ok(()),
        Some(why) => anyhow::bail!(
            "lost the lock on image '{}' while removing it ({why}): its record is left as another host may have written it",
            held.name
        ),
    }
}

/// [`take_out`] for a removal finished before its name is written anew: the trash entry to delete
/// ([`delete_trashed`]), if the tree went there; an error if it stayed.
pub fn take_out_tree(
    root: &Root,
    images: &Dir,
    trash: &Dir,
    tree: &Path,
    name: &ImageName,
) -> Result<Option<OsString>> {
    match take_out(root, images, trash, tree, name) {
        Taken::Trashed(entry) => Ok(Some(entry)),
        Taken::Gone | Taken::Deleted => Ok(None),
        Taken::Refused(e) | Taken::Partial(e) => Err(e),
    }
}

/// Deletes trash entry `entry` a finished removal left, outside every lock; what cannot be is left
/// for gc, which deletes it once our lease is gone.
pub fn delete_trashed(root: &Root, entry: &OsStr) {
    if crate::signals::cancelled().is_none()
        && let Ok(trash) = root.open_trash()
    {
        let _ = remove_trash_entry(&trash, entry);
    }
}

/// Takes an image tree out of the images directory: into the trash, or deleted in place (EXDEV).
fn take_out(root: &Root, images: &Dir, trash: &Dir, tree: &Path, name: &ImageName) -> Taken {
    let enc = name.encoded();
    match (images.stat_at(enc)).with_context(|| format!("cannot inspect {}", tree.display())) {
        Ok(None) => return Taken::Gone,
        Err(e) => return Taken::Refused(e),
        Ok(Some(_)) => {}
    }
    // Never a store's images directory or root, whatever put it here: kept whole where it is.
    if let Some(what) = images.sub(enc).ok().and_then(|d| in_use_by_a_store(&d)) {
        let shown = tree.display();
        return Taken::Refused(anyhow::anyhow!("{shown} is {what}, not an image tree"));
    }
    let dest = trash_entry_name(root, enc);
    match images.move_dir_to(enc, trash, &dest) {
        Ok(()) => Taken::Trashed(dest.into()),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            // Deleted in place: what would stop the deletion part-way is found first.
            let top = images
                .sub(enc)
                .with_context(|| format!("cannot open {}", tree.display()));
            if let Err(e) = top.and_then(|top| deletable(&top, tree, "delete")) {
                return Taken::Refused(e);
            }
            let mut removed = 0;
            let r = images.remove_entry(enc, &mut removed, &in_use_by_a_store);
            match r.with_context(|| format!("cannot delete {}", tree.display())) {
                Ok(()) => Taken::Deleted,
                Err(e) if removed == 0 => Taken::Refused(e),
                Err(e) => Taken::Partial(e),
            }
        }
        // A name a client cached (another host moved the tree away): the server says it is gone.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && trash_there(trash) => Taken::Gone,
        Err(e) => {
            use crate::dir::{DELETE_IN, MOVE};
            let e = crate::dir::explain_refusal(
                e,
                &[
                    (trash, None, DELETE_IN, "the trash"),
                    (images, None, DELETE_IN, "the images directory"),
                    (images, Some(enc.as_ref()), MOVE, "the directory"),
                ],
            );
            let (from, to) = (tree.display(), root.trash());
            let to = to.display();
            Taken::Refused(anyhow::Error::new(e).context(format!("cannot move {from} to {to}")))
        }
    }
}

/// A fresh trash entry name for the tree `enc`: `LEASE+MS.SEQ.NAME`, our lease first (made now if
/// not yet), so that while it is alive nobody else takes the entry for a leftover; `MS.NONCE.SEQ.NAME`
/// where no lease can be made (then it is a leftover to anyone, as a crashed removal's).
fn trash_entry_name(root: &Root, enc: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let (now, seq) = (clock::now_ms(), SEQ.fetch_add(1, Ordering::Relaxed));
    // 80 bytes keep the whole within NAME_MAX beside a lease's name; cut where a character ends (a
    // leftover planted in the trash, taken over, may name anything).
    let cut = (0..=enc.len().min(80))
        .rev()
        .find(|&i| enc.is_char_boundary(i));
    let short = &enc[..cut.unwrap_or(0)];
    match crate::lease::introduce(&root.leases()) {
        Ok(lease) => format!("{lease}{OWNER_END}{now}.{seq}.{short}"),
        Err(_) => format!("{now}.{:016x}.{seq}.{short}", crate::ident::nonce()),
    }
}

/// Ends a trash entry's owner part: lease names never hold it, so the first one does (an encoded
/// image name may: `a:b` is `a+b`; the older naming's owner part then names no lease).
const OWNER_END: char = '+';

/// The encoded image name a trash entry was named after (as [`trash_entry_name`] made it): taken
/// over again and again, an entry keeps it, never a longer name cut short.
fn removed_as(entry: &str) -> &str {
    let digits = |s: &str, hex: bool| {
        let ok = |c: char| {
            if hex {
                c.is_ascii_hexdigit()
            } else {
                c.is_ascii_digit()
            }
        };
        !s.is_empty() && s.chars().all(ok)
    };
    let (rest, made) = match entry.split_once(OWNER_END) {
        Some((lease, rest)) if lease.ends_with(".lease") => (rest, vec![false, false]),
        _ => (entry, vec![false, true, false]),
    };
    let mut parts = rest.splitn(made.len() + 1, '.');
    let stamped = made
        .iter()
        .all(|&hex| parts.next().is_some_and(|p| digits(p, hex)));
    match (stamped, parts.next()) {
        (true, Some(enc)) => enc,
        _ => rest,
    }
}

/// Whether trash entry `entry` is being deleted by another live remover (named first in it); ours
/// (a removal we finished) are ours to delete.
fn removal_underway(root: &Root, entry: &OsStr) -> bool {
    let owner = entry.to_str().and_then(|e| e.split_once(OWNER_END));
    owner.is_some_and(|(lease, _)| {
        !crate::lease::is_mine(lease) && crate::lease::alive(&root.leases(), lease).unwrap_or(false)
    })
}

/// Whether the trash opened as `trash` is still there: a rename into it found nothing to move.
fn trash_there(trash: &Dir) -> bool {
    crate::dir::fstat(trash).is_ok_and(|st| st.st_nlink > 0)
}

/// Empties an image's directory in `images` (the images directory `images_dir`, opened) without
/// following links in it (`exec --from` rebuilding from base). `removed` counts what was deleted:
/// a failure before anything went leaves the image as it was.
pub fn empty_image_dir(
    images: &Dir,
    images_dir: &Path,
    name: &ImageName,
    removed: &mut u64,
) -> Result<()> {
    let shown = images_dir.join(name.encoded());
    let shown = shown.display();
    // The check walk refuses a mount below the top; the top itself is asked here, before anything
    // (its mode too) is changed.
    let top = (images.sub(name.encoded())).with_context(|| format!("cannot open {shown}"))?;
    if top
        .is_mount_root()
        .with_context(|| format!("cannot look at {shown}"))?
    {
        anyhow::bail!(
            "cannot empty {shown}: it is a mount point; unmount it first (nothing is deleted across a mount)"
        );
    }
    // Empty already (a new image): nothing to look at or lend.
    if top.names().is_ok_and(|n| n.is_empty()) {
        return Ok(());
    }
    // What cannot be deleted is found before anything is: a refusal then leaves the image as it
    // was (its state and base too) instead of emptied in part. Root too: a mount below the top.
    deletable(&top, &images_dir.join(name.encoded()), "empty")?;
    crate::debug::pause("tree-checked");
    // A top its owner left without owner access (an image's `/` of mode 555) is lent it while
    // emptied, as for a removal's move; its mode is given back whatever happens.
    let lent = images.lend_owner(name.encoded(), 0o700);
    let emptied = empty_top(&top, images_dir, name, removed);
    if let Some(lent) = lent {
        lent.give_back();
    }
    emptied
}

/// Refuses, before anything is deleted, the tree `top` (at `at`) that deleting (`verb`) would stop
/// part-way: an entry [`refuses_deletion`], a mount below the top, a directory not looked inside.
fn deletable(top: &Dir, at: &Path, verb: &str) -> Result<()> {
    let at_ = at.display();
    let none = |e| anyhow::anyhow!("cannot {verb} {at_}: {e}; nothing was deleted");
    let walked = top.duplicate().map_err(none)?;
    let refuse = disk_usage::Unseen::Refuse;
    disk_usage::walk_dir(walked, at, refuse, &mut refuses_deletion).map_err(none)?;
    Ok(())
}

/// Refuses an entry of a tree to empty that we may not delete in, as known before deleting: a
/// directory another user's that keeps us from listing or changing it (only its owner or root can
/// empty it), or another user's entry in a sticky directory (`/tmp`'s 1777) not ours either, which
/// the kernel lets only the entry's or the directory's owner unlink. One of ours is lent owner
/// access by the emptying, so it is no refusal.
fn refuses_deletion(parent: &Dir, name: &std::ffi::CStr, st: &libc::stat) -> std::io::Result<()> {
    use nix::unistd::{AccessFlags, faccessat};
    let flags = nix::fcntl::AtFlags::AT_EACCESS | nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW;
    // A directory nobody may change, root neither: a read-only btrfs subvolume (a snapshot `-r`
    // a build made), or a read-only mount.
    if crate::dir::file_type(st) == libc::S_IFDIR
        && faccessat(parent, name, AccessFlags::W_OK, flags) == Err(nix::errno::Errno::EROFS)
    {
        return Err(std::io::Error::new(
            std::io::ErrorKind::ReadOnlyFilesystem,
            format!(
                "{} is read-only: a read-only btrfs subvolume ('btrfs property set -ts DIR ro false' makes it writable) or a read-only mount",
                name.to_string_lossy()
            ),
        ));
    }
    let me = nix::unistd::geteuid().as_raw();
    // Root is refused by no mode.
    if st.st_uid == me || me == 0 {
        return Ok(());
    }
    let up = crate::dir::fstat(parent)?;
    if up.st_mode & libc::S_ISVTX != 0 && up.st_uid != me {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} is uid {}'s in a sticky directory (mode {:04o}) of uid {}'s: only either user or root can delete it",
                name.to_string_lossy(),
                st.st_uid,
                up.st_mode & 0o7777,
                up.st_uid
            ),
        ));
    }
    if crate::dir::file_type(st) != libc::S_IFDIR {
        return Ok(());
    }
    let need = AccessFlags::R_OK | AccessFlags::W_OK | AccessFlags::X_OK;
    match faccessat(parent, name, need, flags) {
        Err(nix::errno::Errno::EACCES) => Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "a directory of uid {}'s (mode {:03o}): only that user or root can empty or move it",
                st.st_uid,
                st.st_mode & 0o7777
            ),
        )),
        _ => Ok(()),
    }
}

/// [`empty_image_dir`] of the top `dir` it checked (never opened again by name: a mount made on the
/// path since is not emptied), its mode as it is.
fn empty_top(dir: &Dir, images_dir: &Path, name: &ImageName, removed: &mut u64) -> Result<()> {
    let path = images_dir.join(name.encoded());
    // Asked of the top too: a root's parts (store.conf, locks) are no store on their own.
    let shown = path.display();
    if let Some(what) = in_use_by_a_store(dir) {
        anyhow::bail!("cannot empty {shown}: it is {what}; move it out first");
    }
    let names = dir.names();
    for entry in names.with_context(|| format!("cannot list {shown}"))? {
        crate::signals::check()?;
        dir.remove_entry(&entry, removed, &in_use_by_a_store)
            .with_context(|| format!("cannot delete {}", path.join(&entry).display()))?;
    }
    Ok(())
}

/// What [`empty_trash`] found and did.
#[derive(Debug, Default)]
pub struct Trash {
    pub entries: Vec<PathBuf>,
    pub bytes: u64,
    /// Entries their live removers are deleting now: no leftovers, left to them.
    pub underway: usize,
    /// What could not be deleted, one line each.
    pub failed: Vec<String>,
}

/// Deletes a trash entry, which another process may be deleting too: on a shared filesystem, what
/// the other deleted shows as a stale handle, not as missing; a second walk looks up afresh.
fn remove_trash_entry(trash: &Dir, entry: &OsStr) -> std::io::Result<()> {
    match trash.remove_entry(entry, &mut 0, &in_use_by_a_store) {
        Err(e) if e.raw_os_error() == Some(libc::ESTALE) => {
            trash.remove_entry(entry, &mut 0, &in_use_by_a_store)
        }
        done => done,
    }
}

/// A leftover trash entry renamed to a name of our lease's (one atomic step), so that nobody else
/// deletes it beside us; `None` if another took it first.
fn take_over(root: &Root, trash: &Dir, entry: &OsStr) -> std::io::Result<Option<OsString>> {
    let ours = OsString::from(trash_entry_name(root, removed_as(&entry.to_string_lossy())));
    match trash.rename_to(entry, trash, &ours) {
        Ok(()) => Ok(Some(ours)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Deletes what removals left in the trash (with `fix`; else only counts it).
pub fn empty_trash(root: &Root, fix: bool) -> Result<Trash> {
    let mut out = Trash::default();
    let trash = match root.open_sub("trash") {
        Ok(t) => t,
        Err(_) if root.trash().symlink_metadata().is_err() => return Ok(out),
        Err(e) => return Err(e),
    };
    if let Err(e) = root.check_trash(&trash) {
        out.failed.push(format!("{e:#}"));
        return Ok(out);
    }
    let names = trash.names();
    for entry in names.with_context(|| format!("cannot list {}", root.trash().display()))? {
        if removal_underway(root, &entry) {
            out.underway += 1;
            continue;
        }
        // Made ours first, so one process deletes and counts it (a repair beside gc).
        let entry = match fix.then(|| take_over(root, &trash, &entry)) {
            Some(Ok(Some(ours))) => {
                debug::pause("trash-taken");
                ours
            }
            Some(Ok(None)) => continue,
            Some(Err(e)) => {
                let path = root.trash().join(&entry);
                out.failed
                    .push(format!("cannot take {}: {e}", path.display()));
                continue;
            }
            None => entry,
        };
        // Named as it is now: a line naming the entry left behind names one that is there.
        let path = root.trash().join(&entry);
        let bytes = disk_usage::freed_by_deleting(&root.trash().join(&entry)).unwrap_or(0);
        if fix && let Err(e) = remove_trash_entry(&trash, &entry) {
            out.failed
                .push(format!("cannot delete {}: {e}", path.display()));
            continue;
        }
        out.bytes += bytes;
        out.entries.push(path);
    }
    Ok(out)
}

/// After a request that did not start: record-less lock files we hold exclusively go, and gates of
/// images we waited for if nobody holds them.
pub(crate) fn release_unclaimed(root: &Root, held: Vec<Held>, waited_for: &[ImageName]) {
    let mut shared = Vec::new();
    for h in held {
        // One a shell's `>` may have emptied stays, as evidence (see `remove_held`).
        if !h.seen.unrecorded() || crate::images_dir::record_erased(root, &h.name) == Some(true) {
            continue;
        }
        if h.guard.mode() == Mode::Exclusive {
            let _ = root.unlink_lock(h.guard);
            root.unlink_gate(&h.name);
        } else {
            // Let go first: only an exclusive holder may unlink it.
            drop(h.guard);
            shared.push(h.name);
        }
    }
    for name in shared.iter().chain(waited_for) {
        root.unlink_gate(name);
        root.unlink_if_empty(&root.image_lock(name));
    }
}
