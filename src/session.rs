//! One `exec`: its image locks, from acquisition to the recorded outcome.
//!
//! The protocol, in lock order:
//! 1. Image locks in ascending ENC order — shared for reads, exclusive for
//!    writes — each tried first without blocking. If one is busy, a short
//!    transaction records us as a waiter and reads who holds it; then we wait
//!    for it holding no global lock. That transaction also checks that every
//!    image to read exists: a request that can only fail says so (66)
//!    before it waits.
//! 2. One transaction (the *start*): images checked (reads must be `ready`),
//!    new images inserted `creating` with their empty directory made, existing
//!    ones marked `writing`, holders recorded (not plain readers: their
//!    lease lists them, and a read changes nothing in the metadata unless
//!    its image's last use is stale), our waiter records dropped.
//! 3. The command runs. 4. One transaction (the *finish*): written images
//!    become `ready` (exit 0, and each write lock still ours: see
//!    `Guard::verify`) or `incomplete`, last-use times and sizes are
//!    recorded, holder records dropped (none at all for plain reads: no
//!    transaction). 5. Locks are released by closing.
//!
//! Invariants:
//! - **No wait for oneself.** A process whose enclosing command holds a
//!   lock (`nested::enclosing_hold`) is part of that hold: a reader passes
//!   the gate, and a wait that could only end with the process itself (a
//!   write nested in any hold of the image, a read nested in a write)
//!   fails at once.
//! - **A failed request leaves nothing.** Whatever way acquisition fails,
//!   the waiter records made for it go, and the lock files and gates of
//!   images that still have no row are unlinked (we hold them).
//!
//! Without the database (`begin_fast`): a plain read whose images carry
//! fresh ready tokens (record.rs), a write of existing images whose locks
//! are free and carry ready tokens, and a write of new images whose lock
//! files it makes itself (written.rs: marker, `writing` record, command,
//! `ready`/`incomplete` record), skip 2 and 4; the next transaction,
//! whoever makes it, folds a write's record into its row (a new image's:
//! into a new row).
//!
//! A crash anywhere leaves either no trace (before 2), or records and
//! `creating`/`writing` states whose locks are free — which the next process
//! that looks finds stale and marks `incomplete` (see `crate::judge::sweep`).

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::acquire::image::{Need, Want, acquire_image, record};
use crate::clock;
use crate::ctx::Ctx;
use crate::disk_usage;
use crate::error::Error;
use crate::lock::{Guard, Mode};
use crate::meta::{ImageRow, ImageState, Role, Tx};
use crate::name::ImageName;
use crate::remove::unlink_image_lock;
use crate::store::{NeedsMigration, Store};

/// What an exec asks for.
#[derive(Debug, Default)]
pub struct Request {
    pub reads: Vec<ImageName>,
    pub writes: Vec<ImageName>,
    /// Images locked exclusively but only read: they must be ready, their
    /// state stays, their last use is recorded (a builder that rewrites a
    /// base's metadata in place, see docs/charliecloud.md).
    pub exclusive_reads: Vec<ImageName>,
    /// Base recorded as the lineage of the (single) written image.
    pub base: Option<ImageName>,
    /// When to give up waiting; `None` waits forever.
    pub deadline: Option<Instant>,
    /// Fail at once if any lock is busy.
    pub no_wait: bool,
    /// A slot to take first: class and priority.
    pub slot: Option<(String, crate::slots::Priority)>,
    /// The command line, as recorded for lock-status.
    pub command: String,
}

struct Held {
    name: ImageName,
    mode: Mode,
    guard: Guard,
    /// For writes: the state before this session (None: created by it).
    prev: Option<ImageState>,
    /// An exclusive read: the image is not written (its state stays).
    keep: bool,
    /// For writes: this session made the image's directory (it had none).
    made_dir: bool,
    /// The holder record: none for a plain read, whose holder is named by
    /// its lease (a read writes no metadata unless its image's last use is
    /// older than [`LAST_USE_RESOLUTION`]).
    record: Option<i64>,
    /// A write that took no transaction (written.rs): what its lock file
    /// held before (put back if the command never runs) and its record.
    fast: Option<FastWrite>,
}

struct FastWrite {
    before: Vec<u8>,
    record: crate::record::Token,
    /// A new image (written.rs, new images): its tree made by this write
    /// in [`start_fast_writes`], its record `fresh`.
    new: bool,
    /// Its lock file made by this write too (not one that was there,
    /// saying nothing): gone again if the command never runs.
    made_lock: bool,
}

impl Held {
    /// Written by the command: its state follows the outcome.
    fn writes(&self) -> bool {
        self.mode == Mode::Exclusive && !self.keep
    }

    /// After a failed command: the directory this session made for the
    /// write goes if the command left it empty (rmdir: only an empty one),
    /// under the write lock — unless a process of the command's tree that
    /// outlived it still holds that lock ([`open_elsewhere`]), and may
    /// still write there.
    fn remove_made_tree_if_empty(&self, root: &crate::root::Root, images_dir: &Path) {
        if self.made_dir && !open_elsewhere(&self.guard) {
            crate::remove::remove_empty_image_dir(root, images_dir, &self.name);
        }
    }

    /// The lock file, as records and leases name it.
    fn lockfile(&self) -> String {
        crate::root::Root::image_lock_rel(&self.name)
    }
}

pub use crate::record::LAST_USE_RESOLUTION;

/// Image locks held for one command.
#[must_use = "finish() records the outcome; dropping releases the locks and leaves images to be found incomplete"]
pub struct Session {
    slot: Option<crate::acquire::slot::SlotGuard>,
    held: Vec<Held>,
    images_dir: PathBuf,
    /// The image locks as the lease lists them; taken out of it when the
    /// session ends, however it ends (a library caller may drop it).
    listed: Listed,
    started: Instant,
    /// `locks/store.lock`, shared, while this session writes a new image
    /// without the database: no store-wide command can start beside it
    /// (its tree has no row for such a command to wait for).
    store_shared: Option<Guard>,
}

/// How the command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure,
}

impl Session {
    /// Acquires every lock the request names and records the start.
    pub fn begin(store: &mut Store, req: &Request) -> Result<Session> {
        let started = Instant::now();
        let mut wanted: Vec<(ImageName, Mode)> = req
            .reads
            .iter()
            .map(|n| (n.clone(), Mode::Shared))
            .chain(req.writes.iter().map(|n| (n.clone(), Mode::Exclusive)))
            .chain(
                req.exclusive_reads
                    .iter()
                    .map(|n| (n.clone(), Mode::Exclusive)),
            )
            .collect();
        // The lock order: ascending ENC. A name both read and written is
        // taken once, exclusively (sorted after its shared twin, kept last).
        wanted.sort();
        wanted.dedup_by(|later, earlier| {
            if later.0 == earlier.0 {
                earlier.1 = earlier.1.max(later.1);
                true
            } else {
                false
            }
        });
        if !wanted.is_empty() || req.slot.is_some() {
            // The lease, before any lock and outside the global lock, so
            // that records cost nothing more under it. A failure here (a
            // root not made yet) is met again, and reported, when the first
            // record is written.
            let _ = crate::lease::mine(&store.root().leases());
        }
        if let Some(s) = Session::begin_fast(store, req, &wanted, started) {
            return Ok(s);
        }
        loop {
            // Slots first in the lock order. No image lock is held yet, so a
            // migration found while reading the class is done on the spot.
            let mut slot = match &req.slot {
                Some((class, prio)) => crate::acquire::slot::acquire_unrecorded(
                    store,
                    class,
                    *prio,
                    req.deadline,
                    req.no_wait,
                    &req.command,
                    &req.reads,
                )?,
                None => None,
            };
            let mut held = Vec::with_capacity(wanted.len());
            let mut waits = Vec::new();
            let mut migrate = false;
            let mut store_held = None;
            for (name, mode) in &wanted {
                let keep = req.exclusive_reads.contains(name);
                let want = Want {
                    mode: *mode,
                    need: if *mode == Mode::Exclusive && !keep {
                        Need::Create
                    } else {
                        Need::Ready
                    },
                    deadline: req.deadline,
                    no_wait: req.no_wait,
                    command: &req.command,
                    must_exist: &req.reads,
                };
                match acquire_image(store, name, &want) {
                    Ok((guard, waiter)) => {
                        held.push(Held {
                            name: name.clone(),
                            mode: *mode,
                            guard,
                            prev: None,
                            keep,
                            made_dir: false,
                            record: None,
                            fast: None,
                        });
                        waits.extend(waiter);
                    }
                    Err(e) if e.downcast_ref::<NeedsMigration>().is_some() => {
                        migrate = true;
                        break;
                    }
                    Err(e) => {
                        give_up(store, held, &waits, slot, Some(name));
                        return Err(e);
                    }
                }
            }
            if !migrate {
                match start(store, &mut held, slot.as_mut(), &waits, req) {
                    Ok(images_dir) => {
                        // The lease lists what we hold: how lock-status names
                        // a reader, which has no record, where the kernel
                        // cannot say who holds its lock.
                        if let Some(s) = slot.as_mut() {
                            s.announce(store.root(), &req.command);
                        }
                        let listed = Listed::new(store, &held, &req.command);
                        return Ok(Session {
                            slot,
                            held,
                            images_dir,
                            started,
                            listed,
                            store_shared: None,
                        });
                    }
                    Err(e) if e.downcast_ref::<NeedsMigration>().is_some() => {}
                    Err(e) => match e.downcast::<crate::store_wide::StoreHeld>() {
                        Ok(sw) => store_held = Some(sw),
                        Err(e) => {
                            give_up(store, held, &waits, slot, None);
                            return Err(e);
                        }
                    },
                }
            }
            // Never migrate while holding image locks: the migration waits
            // for every image lock to be free, ours included.
            drop(held);
            drop(slot);
            match store_held {
                // Holding nothing, wait for the store-wide command.
                Some(h) => crate::store_wide::wait_until_free(
                    store,
                    &h,
                    req.deadline,
                    req.no_wait,
                    &req.command,
                )?,
                None => store.migrate(req.deadline)?,
            }
        }
    }

    /// A request without the database: reads whose images all carry a
    /// fresh `ready` token in their lock files (record.rs), and writes of
    /// existing images whose locks are free and carry a ready token of a
    /// store whose binaries fold writers' records (written.rs) — no global
    /// lock, no database, no metadata written. `None`: the slow way
    /// decides (and writes the tokens for next time).
    fn begin_fast(
        store: &Store,
        req: &Request,
        wanted: &[(ImageName, Mode)],
        started: Instant,
    ) -> Option<Session> {
        let writes_ok = req.base.is_none()
            && req.exclusive_reads.is_empty()
            && crate::meta::schema_version() >= crate::record::WRITERS_SINCE_SCHEMA;
        if wanted.is_empty() || (!writes_ok && wanted.iter().any(|w| w.1 != Mode::Shared)) {
            return None;
        }
        let db = std::cell::OnceCell::new();
        // What a new image's write needs to know without the database: the
        // identity and images directory the global lock file states, in the
        // format only binaries at schema 10 write (records_db.rs).
        let new_ok = crate::meta::schema_version() >= crate::record::NEW_ALONE_SINCE_SCHEMA;
        let statement = std::cell::OnceCell::new();
        let mut store_shared = None;
        // Slots first in the lock order; on its slot files' records, or
        // the slow way takes it (slot_record.rs).
        let mut slot = match &req.slot {
            None => None,
            Some((class, prio)) => {
                match crate::acquire::slot::try_fast(store.root(), class, *prio, &db) {
                    crate::acquire::slot::Fast::Got(g) => {
                        Some(crate::acquire::slot::SlotGuard::new(g, class))
                    }
                    crate::acquire::slot::Fast::Unlimited => None,
                    _ => return None,
                }
            }
        };
        let mut held = Vec::with_capacity(wanted.len());
        let mut images_dir: Option<PathBuf> = None;
        let mut store_hinted = false;
        for (name, mode) in wanted {
            let (guard, dir, hinted, fast) = match mode {
                Mode::Shared => {
                    let (g, dir, hinted) =
                        crate::acquire::image::try_ready(store.root(), name, &db)?;
                    (g, dir, hinted, None)
                }
                Mode::Exclusive => {
                    match crate::acquire::image::try_write(store.root(), name, &db) {
                        Some((g, record, before)) => {
                            let dir = record
                                .images_dir
                                .clone()
                                .unwrap_or_else(|| store.root().default_images_dir());
                            // The token read may be a new image's outcome
                            // (`fresh`): this write makes no tree, and its
                            // records must not say it did.
                            let record = crate::record::Token {
                                fresh: false,
                                ..record
                            };
                            let fast = FastWrite {
                                before,
                                record,
                                new: false,
                                made_lock: false,
                            };
                            (g, dir, false, Some(fast))
                        }
                        // No ready token: perhaps no image at all, or none
                        // whose tree is there (the lock file says nothing;
                        // the tree made at the start must not exist).
                        None if new_ok => {
                            let (g, dir, fast) = try_new_write(
                                store.root(),
                                name,
                                &db,
                                &statement,
                                &mut store_shared,
                            )?;
                            (g, dir, false, Some(fast))
                        }
                        None => return None,
                    }
                }
            };
            if images_dir.as_ref().is_some_and(|d| *d != dir) {
                return None;
            }
            store_hinted |= hinted;
            images_dir = Some(dir);
            held.push(Held {
                name: name.clone(),
                mode: *mode,
                guard,
                prev: None,
                keep: false,
                made_dir: false,
                record: None,
                fast,
            });
        }
        // A store-wide operation holds locks/store.lock exclusively and
        // sets the store-wide hint on every image lock file before it
        // checks that every image lock is free, until it ends (record.rs).
        // Read after our image locks were taken: no hint, and any such
        // operation that checks later finds them held and waits for us.
        // A hint: asked of store.lock — held (or unknown), the slow way
        // waits for it, or passes it for a command that runs inside it;
        // free, the hint is stale and cleared while we hold store.lock.
        // The tokens are read again first, under store.lock: the operation
        // may have been granted before our locks (none were held then),
        // run, and taken tokens away as it ended — after we read them.
        // (A write seeing the hint went the slow way already.)
        if store_hinted {
            if held.iter().any(|h| h.fast.is_some()) {
                return None;
            }
            let guard = crate::store_wide::try_shared(store.root())?;
            let db = std::cell::OnceCell::new();
            for h in &held {
                let seen = crate::record::read(&h.guard, store.root(), &h.name, &db);
                if seen.ready.as_ref() != images_dir.as_ref() {
                    return None;
                }
            }
            for h in &held {
                let _ = crate::record::set_hint(
                    h.guard.file(),
                    crate::record::Hint::StoreWide,
                    false,
                    true,
                );
            }
            drop(guard);
        }
        if !start_fast_writes(store.root(), &mut held, images_dir.as_deref()?) {
            return None;
        }
        if let Some(s) = slot.as_mut() {
            s.announce(store.root(), &req.command);
        }
        let listed = Listed::new(store, &held, &req.command);
        Some(Session {
            slot,
            held,
            images_dir: images_dir?,
            started,
            listed,
            store_shared,
        })
    }

    /// The images directory, for the command's environment.
    pub fn images_dir(&self) -> &Path {
        &self.images_dir
    }

    /// The directory of an image.
    pub fn image_dir(&self, name: &ImageName) -> PathBuf {
        self.images_dir.join(name.encoded())
    }

    /// Whether this session's writes took no transaction (written.rs).
    pub fn writes_without_database(&self) -> bool {
        self.held.iter().any(|h| h.fast.is_some())
    }

    /// Images held exclusively, in lock order.
    pub fn writes(&self) -> impl Iterator<Item = &ImageName> {
        self.held.iter().filter(|h| h.writes()).map(|h| &h.name)
    }

    /// Lets spawned children inherit the lock descriptors (like flock(1)),
    /// so the locks live as long as any process that may still write.
    pub fn set_inheritable(&self, inherit: bool) -> io::Result<()> {
        // The lease goes where the locks go (lease.rs).
        crate::lease::set_inheritable(inherit)?;
        if let Some(s) = &self.slot {
            s.set_inheritable(inherit)?;
        }
        if let Some(g) = &self.store_shared {
            g.set_inheritable(inherit)?;
        }
        self.held
            .iter()
            .try_for_each(|h| h.guard.set_inheritable(inherit))
    }

    /// The descriptors of every lock held (slot included), for a process
    /// that must hold them on our behalf (the `--no-inherit` keeper).
    pub fn lock_fds(&self) -> Vec<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.slot
            .iter()
            .map(|s| s.raw_fd())
            .chain(self.held.iter().map(|h| h.guard.as_raw_fd()))
            .chain(self.store_shared.iter().map(|g| g.as_raw_fd()))
            .chain(crate::lease::raw_fds())
            .collect()
    }

    /// Makes the written image a copy of `base` (emptying it first if it had
    /// content: it is being rebuilt from the base).
    pub fn clone_into(&self, store: &Store, base: &ImageName, target: &ImageName) -> Result<()> {
        use std::io::IsTerminal;
        let src = self.image_dir(base);
        let dst = self.image_dir(target);
        if !std::fs::symlink_metadata(&src).is_ok_and(|m| m.is_dir()) {
            anyhow::bail!(
                "image '{base}': {} is not a directory; cannot copy it",
                src.display()
            );
        }
        crate::remove::empty_image_dir(store.root(), self.images_dir(), target)?;
        crate::debug::pause("clone-emptied");
        let t0 = std::time::Instant::now();
        let show = std::io::stderr().is_terminal() && !store.ctx().quiet;
        let mut bar = crate::clone::Bar::new(format!("copying '{base}' to '{target}'"), show);
        // Both ends from one descriptor of the images directory, never a path
        // resolved again: a link swapped in above them cannot move the copy.
        let images = store.root().open_images_dir(self.images_dir())?;
        let open = |name: &ImageName, path: &std::path::Path| {
            images
                .sub(name.encoded())
                .with_context(|| format!("cannot open {}", path.display()))
        };
        let (s, d) = (open(base, &src)?, open(target, &dst)?);
        let done = crate::clone::copy_tree_at(s, &src, d, &dst, &mut bar)
            .with_context(|| format!("cannot copy image '{base}' to '{target}'"))?;
        store.ctx().detail(&format!(
            "copied '{base}' to '{target}': {} files, {} ({} reflinked) in {:.2} s",
            done.files,
            crate::disk_usage::human(done.bytes),
            done.reflinked,
            t0.elapsed().as_secs_f64()
        ));
        for m in &done.mounts_left_out {
            store.ctx().say(&format!(
                "image '{target}': {m} is a mount point in '{base}'; copied as an empty directory (a mounted filesystem is not part of the image)"
            ));
        }
        if done.skipped_special > 0 {
            store.ctx().say(&format!(
                "image '{target}': {} device node(s) of '{base}' not copied (creating them needs privilege)",
                done.skipped_special
            ));
        }
        if let Some(lost) = done.xattrs_summary() {
            store.ctx().say(&format!(
                "image '{target}': extended attributes of '{base}' the filesystem refused, not kept: {lost}{}",
                if store.ctx().verbose { "" } else { " (-v lists the files)" }
            ));
            for d in &done.xattr_details {
                store.ctx().detail(&format!("  not kept: {d}"));
            }
        }
        Ok(())
    }

    /// Releases the read lock on `name` before the session ends (a `--from`
    /// base once copied), dropping its holder record first, so that the
    /// record never claims a lock we no longer hold. Does nothing for an
    /// image not held shared.
    pub fn release_read(&mut self, store: &mut Store, name: &ImageName) -> Result<()> {
        let Some(i) = self
            .held
            .iter()
            .position(|h| h.name == *name && h.mode == Mode::Shared)
        else {
            return Ok(());
        };
        if let Some(id) = self.held[i].record {
            let (tx, _) = store.begin_cleanup()?;
            tx.delete_record(id)?;
            tx.commit()?;
        }
        let h = self.held.remove(i);
        self.listed.forget(&h.lockfile());
        Ok(())
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Records the outcome and releases the locks.
    ///
    /// A written image is `ready` only if the command succeeded *and* each
    /// write lock is still ours (see [`Guard::verify`]: an NFS lock lost
    /// while the command ran means another host may have written the image
    /// too): otherwise it is `incomplete`, and a lost lock is an error.
    pub fn finish(self, store: &mut Store, outcome: Outcome) -> Result<()> {
        // Writes that took no transaction end without one where nothing
        // unusual happened; otherwise the database's way below, whose
        // transaction folds their records first (written.rs).
        match self.finish_fast(store.root(), outcome) {
            None => Ok(()),
            Some(this) => this.finish_recorded(store, outcome),
        }
    }

    /// Step 4 of `crate::written` for a request that took no transaction:
    /// each write lock still ours, each tree there and measured, its
    /// record says `ready` (with size and time) or `incomplete`, synced;
    /// then the locks go. `Some(self)`: a session with no such write, or
    /// one where something was not as expected (a lock lost, a tree gone),
    /// for the database's way.
    fn finish_fast(self, root: &crate::root::Root, outcome: Outcome) -> Option<Session> {
        if !self.held.iter().any(|h| h.fast.is_some()) {
            return Some(self);
        }
        let mut sizes = Vec::new();
        for h in self.held.iter().filter(|h| h.fast.is_some()) {
            if h.guard.still_held().is_err() {
                return Some(self);
            }
            match disk_usage::disk_usage_if_there(&self.images_dir.join(h.name.encoded())) {
                Ok(Some(size)) => sizes.push(size),
                _ => return Some(self),
            }
        }
        crate::debug::pause("fast-write-measured");
        let now = clock::now_ms();
        let state = match outcome {
            Outcome::Success => crate::record::State::Ready,
            Outcome::Failure => crate::record::State::Incomplete,
        };
        for (h, size) in self.held.iter().filter(|h| h.fast.is_some()).zip(sizes) {
            let f = h.fast.as_ref().expect("filtered");
            let record = crate::record::Token {
                state,
                used: now,
                size: Some(size),
                ..f.record.clone()
            };
            if crate::record::write_record(h.guard.file(), &record).is_err() {
                return Some(self);
            }
        }
        // A tree this write made and a failed command left empty goes, as
        // the database's way has it (the record says incomplete).
        if outcome == Outcome::Failure {
            for h in self.held.iter().filter(|h| h.fast.is_some()) {
                h.remove_made_tree_if_empty(root, &self.images_dir);
            }
        }
        None
    }

    /// [`Session::finish`] through the database.
    fn finish_recorded(self, store: &mut Store, outcome: Outcome) -> Result<()> {
        // Sizes are measured before the transaction, under our own write
        // locks: walking a tree is far too slow to do under the global lock.
        // A written image whose directory is gone was deleted by the command
        // (`ch-image delete` under a write lock): it goes from the records.
        let mut trouble: Vec<String> = Vec::new();
        let written: Vec<(Option<u64>, bool, bool)> = self
            .held
            .iter()
            .map(|h| {
                if !h.writes() {
                    return (None, false, true);
                }
                let dir = self.images_dir.join(h.name.encoded());
                let trusted = match h.guard.verify() {
                    Ok(()) => true,
                    Err(e) => {
                        trouble.push(format!(
                            "lost the write lock on image '{}' ({}) while the command ran: {e} — another host may have taken it (an NFS lease expired?); the image is marked incomplete",
                            h.name,
                            h.guard.path().display()
                        ));
                        false
                    }
                };
                // Only "no such file" means deleted: an I/O error (EIO,
                // ESTALE on NFS, EACCES) says nothing about the tree.
                match std::fs::symlink_metadata(&dir) {
                    Err(e) if e.kind() == io::ErrorKind::NotFound => (None, true, trusted),
                    Err(_) => (None, false, trusted),
                    // A directory made for this write and left empty by a
                    // failed command is removed below: it takes nothing.
                    Ok(_) if h.made_dir && outcome == Outcome::Failure && empty_dir(&dir) => {
                        (Some(0), false, trusted)
                    }
                    Ok(_) => (disk_usage::disk_usage(&dir).ok(), false, trusted),
                }
            })
            .collect();
        // A build that filled the filesystem is recorded in the space kept
        // in reserve (space.rs).
        let held = &self.held;
        let images_dir = &self.images_dir;
        let ids: Vec<i64> = self.record_ids().collect();
        drop(self.listed);
        // Plain reads have nothing to record: no transaction at all.
        let nothing = ids.is_empty() && held.iter().all(|h| h.mode == Mode::Shared);
        // The images the transaction leaves ready get their tokens once it
        // has committed, still under the global lock (so that no
        // transaction that forgets an image — a store-wide command's end —
        // comes between), and only while no store-wide hold stands: a token
        // written beside one would carry no hint of it (record.rs).
        store.retry_full(|store| {
            if nothing {
                return Ok(());
            }
            let (tx, ctx) = store.begin_cleanup()?;
            let now = clock::now_ms();
            let db = match crate::store_wide::check(&tx, ctx) {
                Ok(false) => crate::record::DbId::from_id(tx.identity()?),
                _ => None,
            };
            // A new image written without the database has no row yet:
            // its `writing` record, folded, makes one (incomplete), which
            // what follows then sets like any.
            for h in held
                .iter()
                .filter(|h| h.fast.as_ref().is_some_and(|f| f.new))
            {
                crate::written::fold_held(&tx, ctx, &h.name, h.guard.file())?;
            }
            let mut tokens: Vec<(usize, crate::record::Token)> = Vec::new();
            for (i, (h, (size, gone, trusted))) in held.iter().zip(&written).enumerate() {
                let doubt = match gone {
                    true => crate::adopt::unmounted(&tx, &ctx.root, images_dir)?,
                    false => None,
                };
                if *gone && *trusted && doubt.is_none() {
                    tx.delete_image(h.name.as_str())?;
                    ctx.detail(&format!("image '{}' was deleted by the command", h.name));
                    continue;
                }
                if let Some(doubt) = doubt {
                    // Not seen, so not ready; but not forgotten either.
                    ctx.say(&format!("image '{}' is incomplete: {doubt}", h.name));
                    tx.set_state(h.name.as_str(), ImageState::Incomplete)?;
                    continue;
                }
                // A read's last use was recorded when it began; updating it
                // again would cost a page write per image for no decision gc
                // makes (an image in use is never collected).
                if h.keep {
                    // Used until now: gc's "unused for" counts from here.
                    tx.touch(h.name.as_str(), now)?;
                } else if h.mode == Mode::Exclusive {
                    tx.touch(h.name.as_str(), now)?;
                    let state = match outcome {
                        Outcome::Success if *trusted => ImageState::Ready,
                        _ => ImageState::Incomplete,
                    };
                    tx.set_state(h.name.as_str(), state)?;
                    tx.set_size(h.name.as_str(), *size)?;
                    ctx.detail(&format!("image '{}' is {state}", h.name));
                } else {
                    continue;
                }
                // A token only for a row that is there and ready now: a
                // store-wide command's end may have dropped it meanwhile.
                if let Some(db) = db
                    && tx
                        .image(h.name.as_str())?
                        .is_some_and(|r| r.state == ImageState::Ready)
                {
                    let t = crate::record::Token::new(&ctx.root, &h.name, images_dir, db, now);
                    tokens.push((i, t));
                }
            }
            for id in &ids {
                tx.delete_record(*id)?;
            }
            // Writes that took no transaction (written.rs) end here: the
            // row this transaction commits is the truth, so their `writing`
            // records go, durably, before any token (a holder's fold would
            // take one for a dead writer's, whether a token comes or not),
            // and then, once it has committed, their markers — under our
            // locks, and only where the lock is still ours: one lost keeps
            // both, which fold to the `incomplete` recorded. The records go
            // before the commit: a crash after it would leave a `writing`
            // record to fold into a new row for an image the command
            // deleted (this transaction deletes its row); gone before, the
            // marker folds to what a `writing` record would have (not
            // ready), or to nothing for an image without a row.
            let cleared: Vec<&ImageName> = held
                .iter()
                .zip(&written)
                .filter(|(h, (_, _, trusted))| h.fast.is_some() && *trusted)
                .filter(|(h, _)| crate::record::invalidate(h.guard.file()).is_ok())
                .map(|(h, _)| &h.name)
                .collect();
            let global = tx.commit_keeping_global()?;
            for name in cleared {
                crate::written::unmark(&ctx.root, name);
            }
            for (i, t) in &tokens {
                crate::record::write_ready(&held[*i].guard, t);
            }
            drop(global);
            Ok(())
        })?;
        // The lock files of deleted images go too, under our exclusive locks
        // (the unlink rule), with their gates. A directory this session made
        // for a write that failed before putting anything in it goes as
        // well (the row stays, incomplete): an empty tree is nothing to
        // inspect, and a builder that lists the images directory (ch-image
        // list) would trip over it. Only an empty directory is removed
        // (rmdir), still under the write lock; what a writer left is kept.
        for (h, (_, gone, trusted)) in self.held.into_iter().zip(written) {
            if gone && trusted {
                unlink_image_lock(store.root(), &h.name, h.guard);
            } else if trusted && outcome == Outcome::Failure {
                h.remove_made_tree_if_empty(store.root(), images_dir);
            }
        }
        drop(self.slot);
        if trouble.is_empty() {
            Ok(())
        } else {
            bail!("{}", trouble.join("; "))
        }
    }

    /// Every record this session made: its image holders and its slot's.
    fn record_ids(&self) -> impl Iterator<Item = i64> + '_ {
        self.held.iter().filter_map(|h| h.record)
    }

    /// Undoes the start when the command never ran (it could not be
    /// started, or a signal came first): images this session created are
    /// removed again (their directories are still empty), and images it
    /// marked `writing` get their previous state back.
    pub fn abandon(self, store: &mut Store) -> Result<()> {
        // Writes that took no transaction: their lock files get back what
        // they said before (a failure leaves the `writing` record, which
        // folds to incomplete: never ready for a tree we cannot vouch for).
        if self.held.iter().any(|h| h.fast.is_some()) {
            for h in &self.held {
                match &h.fast {
                    // A new image: nothing of it is left (its tree is still
                    // empty), the record first — killed after it, the
                    // marker folds to nothing.
                    Some(f) if f.new && crate::record::invalidate(h.guard.file()).is_ok() => {
                        crate::remove::remove_empty_image_dir(
                            store.root(),
                            &self.images_dir,
                            &h.name,
                        );
                        crate::written::unmark(store.root(), &h.name);
                        if f.made_lock {
                            let _ = crate::remove::unlink_held_lock(store.root(), &h.guard);
                        }
                    }
                    // A new image's record that could not be taken away
                    // stays: its marker folds it (`writing`: incomplete).
                    Some(f) if f.new => {}
                    Some(f) => {
                        let _ = crate::record::put_back(h.guard.file(), &f.before);
                    }
                    None => {}
                }
            }
            return Ok(());
        }
        let ids: Vec<i64> = self.record_ids().collect();
        drop(self.listed);
        let (tx, ctx) = store.begin_cleanup()?;
        for h in self.held.iter().filter(|h| h.writes()) {
            match h.prev {
                None => {
                    tx.delete_image(h.name.as_str())?;
                    // Only an empty directory goes: if something appeared in
                    // it after all, keep it for the user to inspect.
                    crate::remove::remove_empty_image_dir(&ctx.root, &self.images_dir, &h.name);
                }
                Some(prev) => tx.set_state(h.name.as_str(), prev)?,
            }
        }
        for id in ids {
            tx.delete_record(id)?;
        }
        tx.commit()?;
        // Images this session created are gone again: so are their lock
        // files and gates (under our exclusive locks, as the unlink rule
        // requires), or doctor would find lock files without images.
        for h in self.held {
            if h.writes() && h.prev.is_none() {
                unlink_image_lock(store.root(), &h.name, h.guard);
            }
        }
        Ok(())
    }
}

/// A new image's write without the database, up to its start
/// (written.rs, new images): its lock (`acquire::image::try_new`), then
/// `store.lock` shared for the session (`store_shared`, taken once) — after
/// our image lock, so that a store-wide command that holds the store now
/// sends us its way and one that comes later waits for us; before the
/// statement is read, as a switch of the images directory (`init`) holds
/// it exclusively until it has stated the new one; and not while someone
/// waits to take it exclusively (a repair, a store-wide command), which
/// new images would starve — then the statement, and the database there
/// now, which must be the one it names (a lost or replaced one sends the
/// write the database's way, which makes its first transaction on it).
/// Returns the lock, the images directory and the write's record to be.
fn try_new_write(
    root: &crate::root::Root,
    name: &ImageName,
    db: &std::cell::OnceCell<Option<crate::record::DbId>>,
    statement: &std::cell::OnceCell<Option<(crate::record::DbId, PathBuf)>>,
    store_shared: &mut Option<Guard>,
) -> Option<(Guard, PathBuf, FastWrite)> {
    let (g, made_lock) = crate::acquire::image::try_new(root, name)?;
    if store_shared.is_none() {
        if !crate::store_wide::gate_open(root) {
            return None;
        }
        *store_shared = Some(crate::store_wide::try_shared(root)?);
    }
    let (stated, dir) = statement
        .get_or_init(|| crate::records_db::statement(root))
        .clone()?;
    let db = db
        .get_or_init(|| crate::record::DbId::of(&root.db()))
        .filter(|now| *now == stated)?;
    let record = crate::record::Token {
        fresh: true,
        ..crate::record::Token::new(root, name, &dir, db, 0)
    };
    let fast = FastWrite {
        before: Vec::new(),
        record,
        new: true,
        made_lock,
    };
    Some((g, dir, fast))
}

/// Steps 2 and 3 of `crate::written` for the writes of a request without
/// the database: the trees of new images made (each must not exist: one
/// that does is a tree without a row, or a row the lock file did not
/// show — the database's way decides), then every marker, then every
/// `writing` record, synced, before the command can touch a tree.
/// `false`: the slow way goes on from here (the records written are put
/// back, the trees made removed; a marker beside an untouched token folds
/// to what the row says already, beside an empty lock file to nothing).
fn start_fast_writes(root: &crate::root::Root, held: &mut [Held], images_dir: &Path) -> bool {
    if held.iter().any(|h| h.fast.as_ref().is_some_and(|f| f.new)) {
        // Through a descriptor of the images directory (refusing a link in
        // its place): a tree is made where the rows say, nowhere else.
        let Ok(images) = crate::dir::Dir::open_nofollow(images_dir) else {
            return false;
        };
        for i in 0..held.len() {
            if !held[i].fast.as_ref().is_some_and(|f| f.new) {
                continue;
            }
            if images.mkdir(held[i].name.encoded(), 0o777).is_err() {
                undo_new_trees(root, &held[..i], images_dir);
                return false;
            }
            held[i].made_dir = true;
        }
        crate::debug::pause("fast-new-made");
    }
    let writes: Vec<(&Held, &FastWrite)> = held
        .iter()
        .filter_map(|h| h.fast.as_ref().map(|f| (h, f)))
        .collect();
    if writes
        .iter()
        .any(|(h, _)| crate::written::mark(root, &h.name).is_err())
    {
        undo_new_trees(root, held, images_dir);
        return false;
    }
    crate::debug::pause("fast-write-marked");
    let now = clock::now_ms();
    for (i, (h, f)) in writes.iter().enumerate() {
        let record = crate::record::Token {
            state: crate::record::State::Writing,
            used: now,
            size: None,
            ..f.record.clone()
        };
        if crate::record::write_record(h.guard.file(), &record).is_err() {
            for (h, f) in &writes[..=i] {
                let _ = match f.new {
                    true => crate::record::invalidate(h.guard.file()),
                    false => crate::record::put_back(h.guard.file(), &f.before),
                };
            }
            undo_new_trees(root, held, images_dir);
            return false;
        }
    }
    true
}

/// Removes the trees [`start_fast_writes`] made for new images in `held`
/// (still empty: no command ran), under their locks.
fn undo_new_trees(root: &crate::root::Root, held: &[Held], images_dir: &Path) {
    for h in held.iter().filter(|h| h.made_dir && h.fast.is_some()) {
        crate::remove::remove_empty_image_dir(root, images_dir, &h.name);
    }
}

/// A request that failed before its command could run (a lock busy past
/// the deadline, a signal, a refused start) leaves nothing behind: the
/// waiter records it made for locks it did get, and the lock files and
/// gates of images it would have created (those without a row), which it
/// holds exclusively. Best effort: what this misses is found stale later.
///
/// `waited_for` is the image whose wait failed: its lock file may have been
/// created by our open, for an image that has no row.
fn give_up(
    store: &mut Store,
    held: Vec<Held>,
    waits: &[i64],
    slot: Option<crate::acquire::slot::SlotGuard>,
    waited_for: Option<&ImageName>,
) {
    let slot_waiter = slot.as_ref().and_then(|s| s.waiter);
    let no_records = waits.is_empty() && slot_waiter.is_none();
    if !no_records && let Ok((tx, _)) = store.begin_give_up() {
        let r = (|| -> Result<()> {
            for id in waits.iter().chain(slot_waiter.as_ref()) {
                tx.delete_record(*id)?;
            }
            tx.commit()
        })();
        drop(r);
    }
    // A read lock taken after a wait may be on a lock file recreated for
    // an image removed meanwhile (a reader queued behind `rm`): it is let
    // go, and its files are looked at like those of the image waited for.
    let (held, read): (Vec<Held>, Vec<Held>) =
        held.into_iter().partition(|h| h.mode == Mode::Exclusive);
    let mut looked_at: Vec<ImageName> = read.into_iter().map(|h| h.name).collect();
    looked_at.extend(waited_for.cloned());
    crate::remove::release_unclaimed(store, unclaimed(held), &looked_at);
    drop(slot);
}

/// The exclusive locks of a start that did not happen, for
/// [`crate::remove::release_unclaimed`].
fn unclaimed(held: Vec<Held>) -> Vec<(ImageName, Guard)> {
    held.into_iter()
        .filter(|h| h.mode == Mode::Exclusive)
        .map(|h| (h.name, h.guard))
        .collect()
}

/// The start transaction. Returns the images directory and the ids of the
/// image holder records it made (the slot's id goes into its guard).
fn start(
    store: &mut Store,
    held: &mut [Held],
    slot: Option<&mut crate::acquire::slot::SlotGuard>,
    waits: &[i64],
    req: &Request,
) -> Result<PathBuf> {
    let (tx, ctx) = store.begin(req.deadline)?;
    // A new image a writer made without the database (written.rs) has no
    // row but the one its record folds into — and a write takes that
    // record away before its start commits. Should the start not commit
    // (a refusal, a crash), the record would be gone with the row: such
    // images are folded first, in a transaction of their own.
    let fresh = fold_new_images(&tx, ctx, held)?;
    let (tx, ctx) = match fresh.is_empty() {
        true => (tx, ctx),
        false => {
            tx.commit()?;
            for name in &fresh {
                crate::written::unmark(store.root(), name);
            }
            store.begin(req.deadline)?
        }
    };
    // A store-wide command runs: claim nothing (below), wait, start over
    // — unless we are inside it: then write no ready token (record.rs).
    let (inside_hold, store_held) = match crate::store_wide::check(&tx, ctx) {
        Ok(inside) => (inside, None),
        Err(e) => (false, Some(e)),
    };
    let images_dir = tx.images_dir(&ctx.root)?;
    let now = clock::now_ms();
    for id in waits
        .iter()
        .chain(slot.as_ref().and_then(|s| s.waiter.as_ref()))
    {
        tx.delete_record(*id)?;
    }

    // First what our locks prove, and whether every read can go ahead.
    let mut refusal = None;
    let mut rows = Vec::with_capacity(held.len());
    // Images whose writer's record this transaction folds: their markers
    // go once it has committed (we hold their locks).
    let mut folded: Vec<ImageName> = Vec::new();
    // Of those, the ones whose record said ready and whose row stays so.
    let mut folded_ready: Vec<bool> = Vec::with_capacity(held.len());
    for h in held.iter() {
        let name = h.name.as_str();
        // A writer that took no transaction may have left its record
        // (written.rs): the truth about the image until folded, and what
        // our locks prove we may fold — read before our writes take their
        // tokens away (below, after this).
        let found = crate::record::found(h.guard.file())?;
        let fold = crate::written::fold_found(&tx, ctx, &h.name, &found, h.guard.file())?;
        if fold {
            folded.push(h.name.clone());
        }
        folded_ready.push(
            fold && found
                .record
                .as_ref()
                .is_some_and(|t| t.state == crate::record::State::Ready)
                && tx
                    .image(name)?
                    .is_some_and(|r| r.state == ImageState::Ready),
        );
        // Holding the lock exclusively, nobody else holds it at all; holding
        // it shared, nobody holds it exclusively. Dropping the records that
        // say otherwise keeps SIGKILLed holders from piling up records.
        tx.delete_image_holders(name, (h.mode == Mode::Shared).then_some(Mode::Exclusive))?;
        let row = tx.image(name)?;
        if (h.mode == Mode::Shared || h.keep) && refusal.is_none() {
            match &row {
                None => refusal = Some(Error::NoSuchImage(name.to_owned())),
                Some(r) if r.state == ImageState::Ready => {}
                Some(r) => {
                    // No writer is at work (we hold the lock shared): one
                    // that left the image creating/writing is gone.
                    let state = if r.state.being_written() {
                        tx.set_state(name, ImageState::Incomplete)?;
                        ImageState::Incomplete
                    } else {
                        r.state
                    };
                    refusal = Some(Error::NotReady {
                        name: name.to_owned(),
                        state: state.as_str().to_owned(),
                    });
                }
            }
        }
        rows.push(row);
    }
    if refusal.is_some() || store_held.is_some() {
        // Keep what was learned (stale records, dead writers, our waiter
        // records gone), claim nothing — and leave nothing: the caller
        // unlinks the lock files of images this exec would have created
        // (see `give_up`).
        tx.commit()?;
        for name in &folded {
            crate::written::unmark(&ctx.root, name);
        }
        for (h, row) in held.iter().zip(&rows) {
            if h.writes() && row.is_none() {
                let _ = crate::remove::unlink_held_lock(&ctx.root, &h.guard);
            }
        }
        return Err(store_held.unwrap_or_else(|| refusal.expect("one of them").into()));
    }

    // A write makes its image's ready token say nothing, durably, before
    // the start marks its row (record.rs) — only now: the transaction
    // begun above first folded, from this very lock file, what a writer
    // that took no transaction left there (written.rs); emptied earlier,
    // the file would have said that write left no outcome.
    //
    // A record folded to `ready` that a write takes away here takes its
    // marker with it, before the commit: left, the marker beside an empty
    // lock file would fold to `incomplete` should this transaction not
    // commit (a claim that fails, a crash) — an image whose last write
    // succeeded and that nobody touched since. Without it the row says
    // what it said before the fold: ready. (A record folded to anything
    // else keeps its marker until the commit: not ready either way.)
    for (h, ready) in held.iter().zip(&folded_ready) {
        if !h.writes() {
            continue;
        }
        crate::record::invalidate(h.guard.file())
            .with_context(|| format!("cannot write the lock file of image '{}'", h.name))?;
        if *ready {
            crate::written::unmark(&ctx.root, &h.name);
            folded.retain(|n| n != &h.name);
        }
    }

    // Then claim: mark, create, record.
    // Directories made here are not part of the transaction: if it does not
    // commit, they go again (a directory without a row would later be
    // adopted).
    let mut made = Vec::new();
    let mut tokens = Vec::new();
    let resolution = LAST_USE_RESOLUTION.as_millis() as clock::Millis;
    // The database's identity as this transaction sees it (asked of
    // SQLite: a descriptor of our own on the file would, once closed, drop
    // SQLite's locks).
    let db = std::cell::OnceCell::from(crate::record::DbId::from_id(tx.identity()?));
    let claimed = (|| -> Result<Vec<Option<i64>>> {
        let mut records = Vec::with_capacity(held.len());
        for (i, (h, row)) in held.iter_mut().zip(rows).enumerate() {
            match h.mode {
                _ if h.keep => tx.touch(h.name.as_str(), now)?,
                Mode::Shared => {
                    // A plain read records nothing but a stale last use;
                    // its lease names it as a holder (see Holding). Where
                    // the image's ready token does not vouch for it here
                    // and now, the token is written, with the row's last
                    // use (recorded now if stale), so that the next read
                    // takes the fast path — once this has committed, and
                    // still under the global lock, so that no transaction
                    // that forgets the image can come between the row
                    // seen and the token written (record.rs).
                    let token = crate::record::read(&h.guard, &ctx.root, &h.name, &db)
                        .ready
                        .is_some();
                    let mut used = row.as_ref().map_or(now, |r| r.last_used);
                    if now - used >= resolution {
                        tx.touch(h.name.as_str(), now)?;
                        used = now;
                    }
                    if (!token || used == now)
                        && !inside_hold
                        && let Some(db) = db.get().copied().flatten()
                    {
                        tokens.push((
                            i,
                            crate::record::Token::new(&ctx.root, &h.name, &images_dir, db, used),
                        ));
                    }
                    records.push(None);
                    continue;
                }
                Mode::Exclusive => {
                    h.prev = row.as_ref().map(|r| r.state);
                    let before = made.len();
                    prepare_write(&tx, ctx, &images_dir, &h.name, row, req, now, &mut made)?;
                    h.made_dir = made.len() > before;
                }
            }
            records.push(Some(tx.insert_record(&record(
                ctx,
                &h.name,
                h.mode,
                Role::Holder,
                &req.command,
            ))?));
        }
        Ok(records)
    })();
    let committed = claimed.and_then(|records| {
        let global = tx.commit_keeping_global()?;
        for name in &folded {
            crate::written::unmark(&ctx.root, name);
        }
        for (i, t) in &tokens {
            crate::record::write_ready(&held[*i].guard, t);
        }
        drop(global);
        Ok(records)
    });
    let records = match committed {
        Ok(records) => records,
        Err(e) => {
            if let Ok(images) = ctx.root.open_images_dir(&images_dir) {
                for dir in made.iter().filter_map(|d| d.file_name()) {
                    let _ = images.rmdir(dir);
                }
            }
            return Err(e);
        }
    };
    if let Some(s) = slot {
        s.waiter = None;
    }
    for (h, id) in held.iter_mut().zip(records) {
        h.record = id;
    }
    Ok(images_dir)
}

/// Folds, in `tx`, the records of the images `held` writes whose lock
/// files carry a writer's record of a new image (no row, or a `fresh`
/// record: a tree the write made, which no row describes yet): written
/// without the database, not folded yet. Returns their names (their
/// markers go once `tx` has committed).
fn fold_new_images(tx: &Tx, ctx: &Ctx, held: &[Held]) -> Result<Vec<ImageName>> {
    let mut fresh = Vec::new();
    for h in held.iter().filter(|h| h.writes()) {
        let found = crate::record::found(h.guard.file())?;
        let made_tree = found.record.as_ref().is_some_and(|t| t.fresh);
        if crate::written::is_writers(&found)
            && (made_tree || tx.image(h.name.as_str())?.is_none())
            && crate::written::fold_found(tx, ctx, &h.name, &found, h.guard.file())?
        {
            fresh.push(h.name.clone());
        }
    }
    Ok(fresh)
}

#[allow(clippy::too_many_arguments)] // one call site; the pieces are the start transaction's
fn prepare_write(
    tx: &Tx,
    ctx: &Ctx,
    images_dir: &Path,
    name: &ImageName,
    row: Option<ImageRow>,
    req: &Request,
    now: clock::Millis,
    made: &mut Vec<PathBuf>,
) -> Result<()> {
    let dir = images_dir.join(name.encoded());
    let exists = match std::fs::symlink_metadata(&dir) {
        Ok(m) if m.is_dir() => true,
        Ok(m) if m.file_type().is_symlink() => {
            bail!(
                "image '{name}': {} is a symlink; refusing to write through it",
                dir.display()
            )
        }
        Ok(_) => bail!(
            "image '{name}': {} exists and is not a directory",
            dir.display()
        ),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => return Err(e).with_context(|| format!("cannot inspect {}", dir.display())),
    };
    if !exists {
        if !images_dir.is_dir() {
            if *images_dir == ctx.root.default_images_dir() {
                crate::root::make_dir(images_dir)?;
            } else {
                bail!(
                    "images directory {} does not exist (is it mounted?)",
                    images_dir.display()
                );
            }
        }
        // Through a descriptor of the images directory, as a new image's
        // write without the database makes it (start_fast_writes): a link
        // planted in the directory's place is refused, not followed to
        // make a tree outside it.
        ctx.root
            .open_images_dir(images_dir)
            .and_then(|d| Ok(d.mkdir(name.encoded(), 0o777)?))
            .with_context(|| format!("cannot create image directory {}", dir.display()))?;
        made.push(dir.clone());
    }
    let base = req.base.as_ref().map(|b| b.as_str().to_owned());
    // An existing tree is being rewritten; a fresh directory, created.
    let state = if exists {
        ImageState::Writing
    } else {
        ImageState::Creating
    };
    match row {
        None => {
            if exists {
                ctx.detail(&format!(
                    "image '{name}': adopting the existing directory {}",
                    dir.display()
                ));
            }
            tx.insert_image(&ImageRow {
                name: name.as_str().to_owned(),
                state,
                base,
                created: now,
                last_used: now,
                size_bytes: None,
            })?;
        }
        Some(r) => {
            if r.state.being_written() {
                ctx.detail(&format!(
                    "image '{name}': its previous writer is gone; writing it anew"
                ));
            }
            tx.set_state(name.as_str(), state)?;
            tx.touch(name.as_str(), now)?;
            // The lineage is this write's: rewritten without a base, the
            // image no longer derives from the one an earlier --from named.
            tx.set_base(name.as_str(), base.as_deref())?;
        }
    }
    Ok(())
}

/// Whether a process other than this one holds the lock of `guard` through
/// the very open file description it locked: a process of the command's
/// tree that outlived it with the inherited write lock (a background job),
/// which may still write in the image's directory — so the directory stays.
/// Another process that merely has the lock file open (a writer waiting
/// for it, a probe) does not count: `kcmp` tells the two apart. Only a
/// failed new write with an empty directory asks (a walk of /proc); where
/// it cannot tell (no /proc, no kcmp), the answer is yes, the side on which
/// nothing is removed.
fn open_elsewhere(guard: &crate::lock::Guard) -> bool {
    use std::os::fd::AsRawFd;
    let mine = guard.as_raw_fd();
    let me = std::process::id();
    // Descriptors are matched by what their /proc link reads (no stat: an
    // unrelated descriptor on a hung NFS mount must not hang us), then
    // compared by kcmp.
    let Ok(ours) = std::fs::read_link(format!("/proc/self/fd/{mine}")) else {
        return true;
    };
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return true;
    };
    procs.flatten().any(|p| {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            return false;
        };
        if pid == me {
            return false;
        }
        std::fs::read_dir(p.path().join("fd")).is_ok_and(|fds| {
            fds.flatten().any(|fd| {
                let Some(theirs) = fd.file_name().to_str().and_then(|n| n.parse::<i32>().ok())
                else {
                    return false;
                };
                if std::fs::read_link(fd.path()).ok().as_ref() != Some(&ours) {
                    return false;
                }
                // SAFETY: kcmp only compares two processes' descriptors.
                let same = unsafe {
                    libc::syscall(
                        libc::SYS_kcmp,
                        me as libc::pid_t,
                        pid as libc::pid_t,
                        0, // KCMP_FILE
                        mine as libc::c_ulong,
                        theirs as libc::c_ulong,
                    )
                };
                same != 1 && same != 2 && same != 3
            })
        })
    })
}

/// Whether `dir` has no entries (an unreadable one counts as not empty).
fn empty_dir(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_none())
}

/// The image locks of a session, as its process's lease lists them (see
/// `lease::Holding`): listed when the session starts, and taken out when
/// it ends — dropped with it, so a session a library caller drops without
/// finishing leaves no hold line behind for locks it no longer holds.
struct Listed {
    leases: PathBuf,
    lockfiles: Vec<String>,
}

impl Listed {
    fn new(store: &Store, held: &[Held], command: &str) -> Listed {
        let leases = store.root().leases();
        for h in held {
            crate::lease::note(
                &leases,
                crate::lease::Holding::now(h.mode, h.lockfile(), false, command),
            );
        }
        Listed {
            leases,
            lockfiles: held.iter().map(Held::lockfile).collect(),
        }
    }

    /// One lock released before the others (`--from`'s base).
    fn forget(&mut self, lockfile: &str) {
        crate::lease::forget(&self.leases, lockfile);
        self.lockfiles.retain(|l| l != lockfile);
    }
}

impl Drop for Listed {
    fn drop(&mut self) {
        for l in &self.lockfiles {
            crate::lease::forget(&self.leases, l);
        }
    }
}
