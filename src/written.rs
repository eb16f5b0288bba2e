//! Writes without the database: a writer that finds its image's lock free
//! and a ready token in it rewrites an existing image without a
//! transaction; what it did reaches the database at the next transaction,
//! whoever makes it, which *folds* it in first.
//!
//! The writer (`Session::begin` and `Session::finish`):
//! 1. takes the image's lock exclusively without waiting, and reads a
//!    ready token in the writers' format (`record::WRITERS_SINCE_SCHEMA`:
//!    proof that every binary using the store folds) and no store-wide
//!    hint;
//! 2. makes the image's *marker* `locks/leases/ENC.dirty` (an empty file,
//!    made through the leases directory's descriptor its lease holds);
//! 3. replaces the token with a record `state=writing`, synced — after the
//!    marker, so that no `writing` record is ever without one;
//! 4. runs the command; then, still holding the lock (re-asserted) and the
//!    tree measured, writes `state=ready` with the size and the time, or
//!    `state=incomplete`, synced, and lets the lock go. The marker stays.
//!
//! Anything unusual at the end (the lock lost, the tree gone) takes the
//! database's way, whose first transaction folds the marker like any.
//!
//! Invariants:
//! - **While a marker exists, its image's record is the truth about the
//!   image**; otherwise the database is. Every transaction begins, under
//!   the global lock, by listing the markers ([`markers`], [`fold`]); for
//!   each whose image lock it can hold (tried shared, never awaited) it
//!   reads the record and sets the row: `ready` with the record's size, last use and no base, only for
//!   a valid ready record of this database and images directory on a row
//!   that is ready (or missing); `incomplete` for anything else — a
//!   `writing` record (its writer is gone: we could lock), `incomplete`,
//!   empty, torn, foreign. Readiness may be lost, never claimed. A ready
//!   token beside a row left not ready is taken away (holding the image's
//!   lock shared and the global lock excludes every writer of tokens).
//! - **A marker goes only after its row is committed**, and while the
//!   image's lock is still held by the folder: no writer can start
//!   between the record read and the marker's unlink, and a crash between
//!   the commit and the unlink only folds the same record again. One
//!   exception: a write of the database's way that folded a record to
//!   `ready` on a ready row takes its marker away with the record, before
//!   its start commits — the row says ready without the fold too, and an
//!   empty lock file beside a marker would say the image is not (should
//!   that start not commit).
//! - A marker whose lock another process holds exclusively is a write in
//!   progress: left alone, and shown as `writing` (`Store::being_written`).
//!   One whose lock a guard of this very process holds exclusively (not a
//!   descriptor inherited from an enclosing command) is left to that
//!   holder, which folds the record it reads under its lock in its start
//!   ([`fold_found`]; a write takes its token away only after that) and
//!   takes the marker away once that transaction has committed
//!   ([`unmark`]), as a write of its own finished the database's way does.
//! - A marker whose image has a lock file this process cannot open (another
//!   user's, not writable for it) is left too: only a missing lock file
//!   means that the record went with the image.
//! - **Whoever holds an image folds the record it reads under its lock**,
//!   listed or not: a listing may miss a fresh marker (NFS caches
//!   directory listings); a record read under a lock is read from the
//!   server.
//!
//! **New images** (schema 10, `record::NEW_ALONE_SINCE_SCHEMA`). A write
//! of an image that has no lock file, without `--from`, goes the same way:
//! 1. it makes the lock file itself (`O_EXCL`, then `flock`, then the
//!    unlink rule's two stats: `acquire::image::try_new`) — proof that no
//!    lock file was there, so no image whose row one stands for;
//! 2. it reads the global lock file's statement (`records_db::statement`:
//!    the database's identity and images directory, in the format only
//!    schema-10 binaries write — proof that no older binary can make
//!    transactions here) and the database header's identity, which must
//!    agree (a lost or replaced database sends the write its way);
//! 3. it takes `locks/store.lock` shared and keeps it to the end: no
//!    store-wide command starts beside a tree that has no row for it to
//!    wait for, and one that holds the store sends the write its way;
//! 4. it makes the tree (`mkdirat` through a descriptor of the images
//!    directory; one that exists — a tree without a row, a row the lock
//!    file did not show — sends the write the database's way), then the
//!    marker and the `writing` record, and goes on as above.
//!
//! Such an image has no row until a transaction folds its record: ready
//! (vouched for by this database) or incomplete. So every path that judges
//! an image by its row also asks its lock file: adoption leaves alone a
//! tree whose lock is held or carries a writer's record
//! ([`new_write_of`]); a failed request unlinks no lock file that carries
//! one (`remove::release_unclaimed`); `rm` and `gc` fold what they hold
//! before anything else; a read waits for such an image instead of calling
//! it missing; a write the database's way folds it in a transaction of its
//! own before its start takes the record away (`session::fold_new_images`);
//! a rebuild of a damaged database salvages it from its record
//! ([`salvage_new`]). A record no database vouches for (another identity:
//! the database was renewed or replaced since) folds to `incomplete`, never
//! lost: kept, header-checked, until a transaction commits the row.
//!
//! Markers are listed and unlinked through a descriptor of `locks/leases`
//! opened with `openat2(RESOLVE_NO_SYMLINKS)` (where the kernel lacks it,
//! from the root's descriptor, no component followed if a link), and made
//! through the one the
//! writer's lease holds (opened refusing a link): a link planted in the
//! store cannot steer either out of it. On NFS the marker's creation is synchronous at the server, so it
//! is there before the `writing` record.

use std::ffi::OsString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use anyhow::Result;

use crate::ctx::Ctx;
use crate::lock::{self, Mode};
use crate::meta::{ImageRow, ImageState, Tx};
use crate::name::ImageName;
use crate::record::{State, Token};
use crate::root::Root;

/// The markers' directory, under the root: the leases directory, whose
/// descriptor every writer holds already (its lease's), so that a marker
/// costs one `mknodat` through it and never follows a link planted in the
/// store. Markers are told from leases by their suffix.
const MARKERS_REL: &str = "locks/leases";
const SUFFIX: &str = ".dirty";

/// The marker's file name for `name`: `ENC.dirty`. `None` for a name too
/// long for that (such images are written the database's way).
fn marker_name(name: &ImageName) -> Option<String> {
    let m = format!("{}{SUFFIX}", name.encoded());
    (m.len() <= 255).then_some(m)
}

/// The image a marker's file name stands for.
fn marked_image(file: &std::ffi::OsStr) -> Option<ImageName> {
    let enc = file.to_str()?.strip_suffix(SUFFIX)?;
    ImageName::from_encoded(enc).ok()
}

/// Opens `path` refusing a symbolic link in any component (`openat2` with
/// `RESOLVE_NO_SYMLINKS`); the root's own path is canonical (`Root`).
fn open_no_symlinks(path: &Path, flags: libc::c_int, mode: u32) -> io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    #[repr(C)]
    struct OpenHow {
        flags: u64,
        mode: u64,
        resolve: u64,
    }
    const RESOLVE_NO_SYMLINKS: u64 = 0x04;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: u64::from(mode),
        resolve: RESOLVE_NO_SYMLINKS,
    };
    // SAFETY: a valid C string and a live open_how of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            libc::AT_FDCWD,
            c.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned to us and owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// Makes the marker of `name` (step 2 of the module doc), through the
/// leases directory's descriptor this process's lease holds; one that is
/// there already is kept. Fails (the write goes the database's way) for a
/// process without a lease there or a name too long for a marker.
pub fn mark(root: &Root, name: &ImageName) -> io::Result<()> {
    let marker =
        marker_name(name).ok_or_else(|| io::Error::from_raw_os_error(libc::ENAMETOOLONG))?;
    let c =
        std::ffi::CString::new(marker).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    crate::lease::with_pinned_dir(&root.leases(), |fd| {
        // SAFETY: a valid C string and a directory descriptor the lease keeps open.
        match unsafe { libc::mknodat(fd, c.as_ptr(), libc::S_IFREG | 0o666, 0) } {
            0 => Ok(()),
            _ => match io::Error::last_os_error() {
                e if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
                e => Err(e),
            },
        }
    })
    .unwrap_or_else(|| Err(io::Error::from_raw_os_error(libc::ENOENT)))
}

/// Takes away the marker of an image whose record this process folded, or
/// whose write it finished the database's way, once that transaction has
/// committed, holding the image's lock (shared or exclusively: no writer
/// can start meanwhile).
pub fn unmark(root: &Root, name: &ImageName) {
    if let (Ok(Some(dir)), Some(marker)) = (open_dirty(root), marker_name(name)) {
        let _ = dir.unlink(marker);
    }
}

/// Whether the marker of `name` stands (a regular file; nothing, or
/// nothing that can be told, is no marker).
fn marked(root: &Root, name: &ImageName) -> bool {
    let (Ok(Some(dir)), Some(marker)) = (open_dirty(root), marker_name(name)) else {
        return false;
    };
    dir.stat_at(marker)
        .ok()
        .flatten()
        .is_some_and(|e| e.mode & libc::S_IFMT == libc::S_IFREG)
}

/// The markers' directory, if there is one.
///
/// No directory there — missing, or a link or file planted in its place —
/// holds no marker: one is made only through a lease's descriptor of a
/// real directory. (Markers made before such a swap are not listed; the
/// records they stand for are still folded by whoever locks the image.)
///
/// Opened in one call where the kernel has `openat2`; where it has not
/// (before Linux 5.6) or a seccomp profile refuses it, component by
/// component from the root's own descriptor, none followed if a link.
fn open_dirty(root: &Root) -> io::Result<Option<crate::dir::Dir>> {
    let path = root.dir().join(MARKERS_REL);
    let none = |e: &io::Error| {
        e.kind() == io::ErrorKind::NotFound
            || matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR))
    };
    let opened = match open_no_symlinks(&path, libc::O_RDONLY | libc::O_DIRECTORY, 0) {
        Ok(fd) => Ok(crate::dir::Dir::from_fd(fd)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => root
            .open()
            .map_err(|e| io::Error::other(format!("{e:#}")))
            .and_then(|d| d.sub("locks"))
            .and_then(|d| d.sub("leases")),
        Err(e) => Err(e),
    };
    match opened {
        Ok(d) => Ok(Some(d)),
        Err(e) if none(&e) => Ok(None),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("cannot list {}: {e}", path.display()),
        )),
    }
}

/// The markers found under the global lock, before any transaction: those
/// whose image lock is held now (by us, or tried and got), to fold, and
/// those a writer holds, left alone.
#[derive(Default)]
pub struct Markers {
    dir: Option<crate::dir::Dir>,
    /// Markers to fold: name, image, the lock taken for the fold (none: no
    /// lock file, nothing to fold).
    todo: Vec<(OsString, ImageName, Option<lock::Guard>)>,
    /// Images a writer holds now.
    pub busy: Vec<String>,
    /// Markers were left for another batch ([`FOLD_BATCH`]).
    pub more: bool,
}

/// How many markers one transaction folds at most: each holds its image's
/// lock, a descriptor, until the commit (a process may have only 1,024),
/// and the global lock is held through the batch. A backlog — many writes
/// without the database and no transaction between them — is folded in
/// batches, the global lock let go between them.
pub const FOLD_BATCH: usize = 64;

impl Markers {
    /// Whether a transaction has anything to fold.
    pub fn any(&self) -> bool {
        !self.todo.is_empty()
    }

    /// Unlinks the markers folded, under the image locks still held: call
    /// once the transaction that folded them has committed.
    ///
    /// Returns whether every one went (a marker that cannot be unlinked —
    /// an immutable directory — is folded again by the next transaction;
    /// the caller must not take it for progress through a backlog).
    pub fn unlink_folded(self) -> bool {
        let Some(dir) = self.dir else { return true };
        let mut all = true;
        for (marker, _, guard) in self.todo {
            all &= dir.unlink(&marker).is_ok();
            // Only now may a writer start on the image again.
            drop(guard);
        }
        all
    }
}

/// Lists the markers and takes the image locks a fold needs (see the
/// module doc). Call holding the global lock, before the transaction; no
/// leases directory: nothing.
pub fn markers(root: &Root) -> Result<Markers> {
    let mut out = Markers::default();
    let Some(dir) = open_dirty(root)? else {
        return Ok(out);
    };
    for marker in dir.names()? {
        if out.todo.len() == FOLD_BATCH {
            // Each marker to fold holds its image's lock (a descriptor)
            // until the commit: a backlog goes in batches.
            out.more = true;
            break;
        }
        let Some(name) = marked_image(&marker) else {
            // A lease, or nothing this release makes: nothing to fold.
            continue;
        };
        let path = root.image_lock(&name);
        let Some(file) = crate::record::open_lock_file(&path)? else {
            if std::fs::symlink_metadata(&path).is_ok() {
                // Something is there that we cannot open (another user's
                // lock file, not writable for us): its record stays the
                // truth, for whoever can hold the image to fold. Left.
                continue;
            }
            // No lock file: the image was removed under its lock since
            // (the unlink rule), its record with it.
            out.todo.push((marker, name, None));
            continue;
        };
        let st = file.metadata()?;
        if lock::held_exclusively_here(st.dev(), st.ino()) {
            // Ours: the caller folds the record it read under its lock
            // (before taking any token away: `fold_found`), and a write
            // of ours ends by taking its own marker away.
            continue;
        }
        match lock::acquire_no_wait(&path, Mode::Shared, lock::IfMissing::Fail) {
            Ok(Some(g)) => out.todo.push((marker, name, Some(g))),
            // A writer is at work: its record is not final.
            Ok(None) => out.busy.push(name.as_str().to_owned()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                out.todo.push((marker, name, None));
            }
            Err(e) => return Err(e.into()),
        }
    }
    out.dir = Some(dir);
    Ok(out)
}

/// Folds the records of `m`'s markers into the rows, in `tx`.
pub fn fold(tx: &Tx, ctx: &Ctx, m: &Markers) -> Result<()> {
    let images_dir = tx.images_dir(&ctx.root)?;
    let db = crate::record::DbId::from_id(tx.identity()?);
    for (_, name, guard) in &m.todo {
        let Some(file) = guard.as_ref().map(|g| g.file()) else {
            continue;
        };
        let found = crate::record::found(file)?;
        fold_one(tx, ctx, name, &found, &images_dir, db, file)?;
    }
    Ok(())
}

/// Whether the tree of `name`, which has no row, is a new image written
/// without the database: its lock held by someone (a writer at work), or
/// its lock file carrying a writer's record (the next transaction that
/// holds it, or lists its marker, folds it into a row). Adoption leaves
/// such a tree alone; a tree whose lock file is missing, free and empty,
/// or not readable is no such write's.
///
/// A new image's writer holds its lock from before its tree exists until
/// its record says how the write ended: a tree seen in a listing is
/// either held, or recorded, or left by a writer killed before its
/// `writing` record (an empty tree nobody vouches for: adopted
/// `incomplete`, as a tree a crash left the database's way is).
///
/// A writer's record counts only while its marker stands or while it
/// names the database there now: folded, a record stays in the lock file,
/// and once that database is lost or replaced, the tree is an orphan to
/// adopt like any other (skipped, it would be in no listing, and no
/// check would see it).
pub fn new_write_of(tx: &Tx, root: &Root, name: &ImageName) -> bool {
    // Read-only: another user's lock file (not writable for us) is probed
    // all the same.
    let Ok(file) = crate::record::open_read_only(&root.image_lock(name)) else {
        return false;
    };
    match lock::try_shared_open(&file) {
        Ok(true) => crate::record::found(&file).is_ok_and(|f| {
            is_writers(&f)
                && (f
                    .record
                    .as_ref()
                    .is_some_and(|t| tx.identity().is_ok_and(|id| t.db.0 == id))
                    || marked(root, name))
        }),
        // Held (or a lock we cannot tell about): a writer may be at work.
        _ => true,
    }
}

/// For a rebuild of a damaged database: a row, `ready`, for each image
/// written without the database as a new image whose record says it
/// ended well and that the damaged database could not fold — it has no
/// row to salvage. Its record is the truth about it (no later change of
/// the image leaves one: any takes it away or writes over it), of this
/// store's own lock file, for a tree that is there in the images
/// directory the rows describe. Call with every image lock free and the
/// store held (no writer at work), before adoption, which would call such
/// a tree incomplete. Returns how many.
pub fn salvage_new(tx: &Tx, root: &Root, images_dir: &Path) -> Result<usize> {
    let locks = root.image_locks();
    let entries = match std::fs::read_dir(&locks) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e.into()),
    };
    let mut n = 0;
    for e in entries.flatten() {
        let Some(name) = e.file_name().to_str().and_then(Root::image_of_lock_file) else {
            continue;
        };
        let Ok(Some(file)) = crate::record::open_lock_file(&e.path()) else {
            continue;
        };
        let Ok(found) = crate::record::found(&file) else {
            continue;
        };
        let Some(t) = found.record.as_ref().filter(|t| {
            is_writers(&found)
                && t.state == State::Ready
                && t.image == name.as_str()
                && t.images_dir
                    .clone()
                    .unwrap_or_else(|| root.default_images_dir())
                    == images_dir
        }) else {
            continue;
        };
        let tree_there =
            std::fs::symlink_metadata(images_dir.join(name.encoded())).is_ok_and(|m| m.is_dir());
        if !tree_there {
            continue;
        }
        match tx.image(name.as_str())? {
            None => {}
            // A tree the write made itself, over a row of a tree gone.
            Some(r) if t.fresh && r.state != ImageState::Ready => {}
            Some(_) => continue,
        }
        set_ready(tx, &name, t)?;
        n += 1;
    }
    Ok(n)
}

/// Sets the row of `name` from a writer's ready record `t` (made if there
/// is none): ready, with its size and time, and no base (a write without
/// the database has no `--from`).
fn set_ready(tx: &Tx, name: &ImageName, t: &Token) -> Result<()> {
    if tx.image(name.as_str())?.is_none() {
        return tx.insert_image(&ImageRow {
            name: name.as_str().to_owned(),
            state: ImageState::Ready,
            base: None,
            created: t.used,
            last_used: t.used,
            size_bytes: t.size,
        });
    }
    tx.set_state(name.as_str(), ImageState::Ready)?;
    tx.touch(name.as_str(), t.used)?;
    tx.set_size(name.as_str(), t.size)?;
    tx.set_base(name.as_str(), None)
}

/// Whether the lock file `file` carries a writer's record ([`is_writers`]):
/// the truth about its image until folded, which no cleanup may take for
/// a leftover.
pub fn carries_writers_record(file: &std::fs::File) -> bool {
    crate::record::found(file).is_ok_and(|f| is_writers(&f))
}

/// Whether a record read from a lock file is a writer's (a `writing` or
/// `incomplete` record, or a `ready` one with the size a writer measured)
/// rather than a token or nothing.
pub fn is_writers(found: &crate::record::Found) -> bool {
    found.writers_format
        && found
            .record
            .as_ref()
            .is_some_and(|t| t.state != State::Ready || t.size.is_some())
}

/// Folds the record `found` of an image whose lock the caller holds
/// (shared or exclusively), if it is a writer's. A listing of the markers
/// may miss a fresh one (an NFS client caches directory listings); the
/// record read under one's own lock cannot. Folding a record again is
/// harmless: a writer's record stays only while it describes the image's
/// last change (any later one takes it away or writes a token over it).
///
/// Returns whether it folded one: then the caller, once its transaction
/// has committed and still holding the lock, takes the marker away
/// ([`unmark`]) — left, it would be folded again later from whatever the
/// lock file says then (nothing, after a write that took the token away).
pub fn fold_found(
    tx: &Tx,
    ctx: &Ctx,
    name: &ImageName,
    found: &crate::record::Found,
    file: &std::fs::File,
) -> Result<bool> {
    if !is_writers(found) {
        return Ok(false);
    }
    let images_dir = tx.images_dir(&ctx.root)?;
    let db = crate::record::DbId::from_id(tx.identity()?);
    fold_one(tx, ctx, name, found, &images_dir, db, file)?;
    Ok(true)
}

/// [`fold_found`] on the record read now through `file`.
pub fn fold_held(tx: &Tx, ctx: &Ctx, name: &ImageName, file: &std::fs::File) -> Result<bool> {
    fold_found(tx, ctx, name, &crate::record::found(file)?, file)
}

/// Sets the row of `name` from its record (the module doc's table).
fn fold_one(
    tx: &Tx,
    ctx: &Ctx,
    name: &ImageName,
    found: &crate::record::Found,
    images_dir: &Path,
    db: Option<crate::record::DbId>,
    file: &std::fs::File,
) -> Result<()> {
    let row = tx.image(name.as_str())?;
    let of_this_tree = |t: &Token| {
        t.state == State::Ready
            && t.image == name.as_str()
            && t.images_dir
                .clone()
                .unwrap_or_else(|| ctx.root.default_images_dir())
                == images_dir
    };
    let vouches = |t: &Token| of_this_tree(t) && Some(t.db) == db;
    match (&found.record, &row) {
        // A ready record needs no identity to keep a ready row ready: the
        // identity is what stops a token from counting for a read without
        // the database (a repair renews it), and a writer may have started
        // under the one a repair renewed while it ran — then finished (its
        // outcome, sized) or put back the token it found (never started).
        (Some(t), Some(r)) if r.state == ImageState::Ready && of_this_tree(t) => {
            // A token without a size is no writer's record: the write
            // never started (or the database's way wrote it), and the
            // row already says what it does.
            if t.size.is_some() {
                tx.touch(name.as_str(), t.used)?;
                tx.set_size(name.as_str(), t.size)?;
                tx.set_base(name.as_str(), None)?;
                ctx.detail(&format!("image '{name}': its last write is recorded"));
            }
            return Ok(());
        }
        // A write that made the image's tree itself (no tree was there:
        // `fresh`) over a row that describes a tree gone since — an
        // incomplete image whose failed writer left no tree, a removal
        // a crash interrupted after its tree left, a tree deleted by
        // hand: its outcome is the image's, when this database vouches
        // for it (a removal's `deleting` row included: its tree is in the
        // trash, and what `gc` finishes goes by the row, folded first).
        (Some(t), Some(_)) if t.fresh && t.size.is_some() && vouches(t) => {
            set_ready(tx, name, t)?;
            ctx.detail(&format!("image '{name}': its new tree is recorded"));
            return Ok(());
        }
        (Some(t), None) if vouches(t) => return set_ready(tx, name, t),
        _ => {}
    }
    // Not ready: the row says so, and no token says otherwise.
    let ready_record = found.record.as_ref().filter(|t| t.state == State::Ready);
    let writer = found
        .record
        .as_ref()
        .is_some_and(|t| t.image == name.as_str() && t.state != State::Ready);
    // An outcome, sized, that the fold above could not vouch for (another
    // identity, another images directory) is the truth while the marker
    // stands. Without it (folded long since), the database is: a record
    // of another identity is then one a lost or replaced database left,
    // and an incomplete row made of it would be gc's to delete — a tree
    // its write finished; adoption judges that tree as any other.
    let unvouched_outcome = found
        .record
        .as_ref()
        .is_some_and(|t| t.image == name.as_str() && t.size.is_some())
        && marked(&ctx.root, name);
    match row {
        Some(r) if r.state == ImageState::Ready || r.state.being_written() => {
            if ready_record.is_some() {
                crate::record::invalidate(file)?;
            }
            tx.set_state(name.as_str(), ImageState::Incomplete)?;
            // Detail only: the writer's own exec reported a failed
            // command, and whoever needs the image says it is not ready.
            ctx.detail(&format!(
                "image '{name}' is incomplete: {}",
                match &found.record {
                    Some(t) if writer && t.state == State::Incomplete => "its last write failed",
                    Some(_) if writer => "its writer did not finish",
                    _ => "its last write left no record of finishing",
                }
            ));
        }
        // A writer's record, or a writer's outcome this database cannot
        // vouch for (another identity: the database was renewed, rebuilt
        // or replaced since the write) beside its marker: the tree is
        // there, its readiness unknown — incomplete, as adoption would
        // have it, never lost.
        None if writer || unvouched_outcome => {
            // Kept, in the format a reader checks against the database's
            // header (which names another identity, or none): should this
            // transaction not commit (a full filesystem), the record is
            // still there to fold again — it is the only trace of the
            // write. Taken away, it would be lost with the commit.
            match ready_record {
                Some(t) if of_this_tree(t) => crate::record::demote(file, t)?,
                // Of another images directory: no tree of it is here.
                Some(_) => crate::record::invalidate(file)?,
                None => {}
            }
            tx.insert_image(&ImageRow {
                name: name.as_str().to_owned(),
                state: ImageState::Incomplete,
                base: None,
                created: found.record.as_ref().map_or(0, |t| t.used),
                last_used: found.record.as_ref().map_or(0, |t| t.used),
                size_bytes: None,
            })?;
        }
        _ => {
            if ready_record.is_some() {
                crate::record::invalidate(file)?;
            }
        }
    }
    Ok(())
}
