//! One `exec`'s locks, from acquisition to the recorded outcome (docs/design.md, "The protocols").
//!
//! 1. A slot, then image locks in ascending ENC order (shared to read, exclusive to write), each
//!    with its record, read in the same go.
//! 2. A lock file with the store-wide hint, or a new image, asks `store.lock` (`store_wide.rs`):
//!    someone else's hold makes us let go of everything, wait for it, and start over.
//! 3. A read needs `ready`. A write records `writing`, a new image `creating` then makes its tree;
//!    each synced before the command starts.
//! 4. After the command each written record says `ready` (exit 0, lock still ours) or `incomplete`,
//!    synced; then the locks go.
//!
//! - No catalog, no global lock: a read writes nothing but its last use (a hint, at most every few
//!   minutes).
//! - A failed request leaves nothing: lock files it made without a record go; a start that never
//!   ran its command puts each record back.
//! - A crash leaves `creating`/`writing` under free locks: incomplete.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};

use crate::acquire::image::{Held, Want};
use crate::acquire::slot::SlotGuard;
use crate::clock;
use crate::dir::Dir;
use crate::error::Error;
use crate::ident::STOWAGE;
use crate::image_record::{self, ImagesDir, Record, State};
use crate::lock::Mode;
use crate::name::ImageName;
use crate::root::Root;
use crate::store::Store;
use crate::store_wide::Probe;

/// What an exec asks for.
#[derive(Debug, Default)]
pub struct Request {
    pub reads: Vec<ImageName>,
    pub writes: Vec<ImageName>,
    /// Images locked exclusively only to read: must be ready; state kept, last use recorded.
    pub exclusive_reads: Vec<ImageName>,
    /// Recorded as the lineage of the (single) written image.
    pub base: Option<ImageName>,
    /// When to give up waiting; `None` waits forever.
    pub deadline: Option<Instant>,
    /// Fail at once if any lock is busy.
    pub no_wait: bool,
    /// A slot to take first: class and priority.
    pub slot: Option<(String, crate::slots::Priority)>,
    /// The command line, as leases list it.
    pub command: String,
}

impl Request {
    /// The images read, shared or exclusively: they must exist, which is asked before any wait.
    fn to_read(&self) -> Vec<ImageName> {
        self.reads
            .iter()
            .chain(&self.exclusive_reads)
            .cloned()
            .collect()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Success,
    /// Why it is no success (`exit 2`, `signal 15`, `copy failed`, …).
    Failure(String),
}

/// In rank order: a name both read and written is taken in the higher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Role {
    Read,
    ReadExclusive,
    Write,
}

impl Role {
    fn mode(self) -> Mode {
        match self {
            Role::Read => Mode::Shared,
            Role::ReadExclusive | Role::Write => Mode::Exclusive,
        }
    }
}

struct Image {
    held: Held,
    role: Role,
    /// For writes: the prior record (put back if the command never starts); `None` for a new image.
    before: Option<Record>,
    /// For writes: the record as this session wrote it.
    record: Option<Record>,
    /// This session made the image's tree.
    made_tree: bool,
    /// For writes: the images directory the tree was found or made in, checked for it.
    images_dir: Option<PathBuf>,
    /// That directory, opened then: a tree made in it and left empty is removed from it.
    images: Option<Dir>,
    /// Its lock was found lost at the command's end: nothing more is written through it.
    lost: bool,
}

impl Image {
    fn writes(&self) -> bool {
        self.role == Role::Write
    }

    fn rel(&self) -> String {
        Root::image_lock_rel(&self.held.name)
    }

    fn state(&self) -> Option<State> {
        self.held.seen.record.as_ref().map(|r| r.state)
    }

    /// What our lease says of this image's lock, held for `command`.
    fn holding(&self, command: &str) -> crate::lease::Holding {
        let mut h = crate::lease::Holding::now(self.held.guard.mode(), self.rel(), false, command);
        h.reading = self.role == Role::ReadExclusive;
        h
    }

    /// Records a read's use: an exclusive read's always, a shared one's once in a while, and only
    /// into a file of its own (a reader's may have other names). The lock file's last write, told
    /// by the same `fstat`, tells a use recorded by a clock ahead from this clock behind.
    /// Under an enclosing exclusive read nothing is written: its holder records the use, at its
    /// finish, after ours.
    fn record_use(&mut self, now: clock::Millis) {
        if self.lost || self.held.under {
            return;
        }
        let (seen, guard) = (&mut self.held.seen, &self.held.guard);
        let written = match self.role {
            Role::Read if image_record::last_use_stale(seen, now) => guard.one_name_written(),
            // Asked only where the recorded use is ahead of this clock (one host's is wrong).
            Role::ReadExclusive if image_record::recorded_ahead(seen, now) => {
                Some(crate::planted::check_dated(guard.path(), guard.file()).unwrap_or(None))
            }
            Role::ReadExclusive => Some(None),
            _ => None,
        };
        if let Some(written) = written {
            let _ = image_record::record_use(guard.file(), seen, now, written);
        }
    }
}

/// The locks held for one command.
#[must_use = "finish() records the outcome; dropping releases the locks and leaves written images incomplete"]
pub struct Session {
    slot: Option<SlotGuard>,
    images: Vec<Image>,
    images_dir: PathBuf,
    root: Root,
    /// Trees of removals this session finished, in the trash: deleted once every lock is let go.
    trashed: Vec<std::ffi::OsString>,
}

impl Session {
    /// Acquires every lock the request names and records the start.
    pub fn begin(store: &mut Store, req: &Request) -> Result<Session> {
        let wanted = wanted(req);
        if !wanted.is_empty() || req.slot.is_some() {
            // The lease, before any lock: it names us to lock-status.
            let _ = crate::lease::mine(&store.root().leases());
        } else {
            // Nothing to lock: the command is still told where images go.
            store.root().create_layout()?;
        }
        crate::acquire::queue(queued(req, &wanted));
        let mut migrations = 0;
        loop {
            crate::signals::check()?;
            match Self::attempt(store, req, &wanted)? {
                Attempt::Started(s) => return Ok(*s),
                Attempt::StoreWide => {
                    crate::store_wide::wait_free(store, req.deadline, req.no_wait, &req.command)?
                }
                // One migration, or one by another process, settles it.
                Attempt::Legacy if migrations < 2 => {
                    migrations += 1;
                    crate::migrate::run(store, req.deadline)?
                }
                Attempt::Legacy => anyhow::bail!(
                    "the store at {} is still one to migrate after its migration: run '{STOWAGE} doctor'",
                    store.root().dir().display()
                ),
            }
        }
    }

    fn attempt(store: &Store, req: &Request, wanted: &[(ImageName, Role)]) -> Result<Attempt> {
        let root = store.root().clone();
        let to_read = req.to_read();
        // The slot first, in the lock order.
        let mut slot = match &req.slot {
            Some((class, prio)) => crate::acquire::slot::take(
                store,
                class,
                *prio,
                req.deadline,
                req.no_wait,
                &req.command,
                &to_read,
            )?,
            None => None,
        };
        let listed_slot = slot.as_mut().map(|s| s.listing(&root, &req.command));
        let images = match take_images(store, req, wanted, &to_read, listed_slot)? {
            Ok(images) => images,
            Err(again) => return Ok(again),
        };
        let mut session = Session {
            slot,
            images,
            images_dir: root.default_images_dir(),
            root: root.clone(),
            trashed: Vec::new(),
        };
        // Listed in one write, before the records (slow if a crash-cut removal is finished first).
        // One under an enclosing command's lock holds none: listed by that command alone.
        let images = (session.images.iter())
            .filter(|i| !i.held.under)
            .map(|i| i.holding(&req.command));
        let slot = session
            .slot
            .as_mut()
            .map(|s| s.listing(&root, &req.command));
        crate::lease::note_all(&root.leases(), images.chain(slot).collect());
        // A store another process is migrating (records half converted) is migrated or waited for.
        let chosen = session
            .start_writes(store, req)
            .and_then(|()| session.choose_images_dir());
        match chosen {
            Ok(dir) => session.images_dir = dir,
            Err(e) => {
                let _ = session.abandon();
                let legacy = e.downcast_ref::<crate::catalog::NeedsMigration>().is_some();
                return if legacy { Ok(Attempt::Legacy) } else { Err(e) };
            }
        }
        Ok(Attempt::Started(Box::new(session)))
    }

    /// Writes the `writing` and `creating` records, and makes new trees.
    fn start_writes(&mut self, store: &Store, req: &Request) -> Result<()> {
        let now = clock::now_ms();
        let lease = crate::lease::mine(&self.root.leases()).ok();
        let base = req.base.as_ref().map(|b| b.as_str().to_owned());
        for img in self.images.iter_mut() {
            if img.role != Role::Write {
                img.record_use(now);
                // It may change the tree: its record is numbered anew (same contents), so a size
                // kept for the tree before is not taken for it after, and a reader whose lock was
                // lost meanwhile (where locks may be lost) finds it changed.
                if img.role == Role::ReadExclusive
                    && let Some(r) = img.held.seen.record.clone()
                {
                    write_record(store, &mut img.held, &r)?;
                }
                continue;
            }
            crate::debug::pause("write-locked");
            if img.state() == Some(State::Deleting) {
                self.trashed.extend(finish_removal(&self.root, img)?);
            }
            let existing = match (&img.held.seen.record, img.held.seen.damaged) {
                (Some(r), _) => Some(r.clone()),
                // State unknown: written like an existing image, put back as unknown if unrun.
                (None, true) => Some(Record::unknown(
                    img.held.name.as_str(),
                    crate::images_dir::config(&self.root)?.images,
                    now,
                )),
                (None, false) => None,
            };
            match existing {
                Some(r) => {
                    let mut w = r.clone();
                    (w.state, w.changed, w.writer, w.outcome, w.base) =
                        (State::Writing, now, lease.clone(), None, base.clone());
                    write_record(store, &mut img.held, &w)?;
                    img.before = Some(r.clone());
                    img.record = Some(w);
                    // No tree (a failed first write's went; a store-wide command deleted a
                    // ready one, its stowage killed before it forgot it): made anew.
                    (img.made_tree, img.images_dir, img.images) =
                        make_missing_tree(&self.root, &img.held)?;
                    take_back_loans(&self.root, &img.held, img.images.as_ref());
                }
                None => start_new(store, img, base.clone(), lease.clone(), now)?,
            }
            crate::debug::pause("exec-started");
        }
        Ok(())
    }

    /// The images directory its images' records name (all one), else the store's. Each is asked
    /// once: a write's was checked as its tree was found or made.
    fn choose_images_dir(&self) -> Result<PathBuf> {
        let mut known: Vec<(&ImagesDir, PathBuf)> = Vec::new();
        for i in &self.images {
            let Some(r) = i.record.as_ref().or(i.held.seen.record.as_ref()) else {
                continue;
            };
            let asked = known.iter().find(|(k, _)| **k == r.images);
            let dir = match (&i.images_dir, asked) {
                (Some(d), _) | (None, Some((_, d))) => d.clone(),
                (None, None) => crate::images_dir::for_command(&self.root, r)?,
            };
            known.push((&r.images, dir));
        }
        let mut dirs = known.into_iter().map(|(_, d)| d);
        match dirs.next() {
            Some(d) if dirs.all(|o| o == d) => Ok(d),
            Some(d) => anyhow::bail!(
                "the images of this request are in different images directories ({} and others): run '{STOWAGE} doctor'",
                d.display()
            ),
            None => crate::images_dir::checked(&self.root, &crate::images_dir::config(&self.root)?),
        }
    }

    pub fn images_dir(&self) -> &Path {
        &self.images_dir
    }

    pub fn image_dir(&self, name: &ImageName) -> PathBuf {
        self.images_dir.join(name.encoded())
    }

    /// Images written (not exclusive reads), in lock order.
    pub fn writes(&self) -> impl Iterator<Item = &ImageName> {
        self.images
            .iter()
            .filter(|i| i.writes())
            .map(|i| &i.held.name)
    }

    /// Lets spawned children inherit the lock descriptors (like flock(1)), and the lease with them.
    pub fn set_inheritable(&self, inherit: bool) -> io::Result<()> {
        crate::lease::set_inheritable(inherit)?;
        if let Some(s) = &self.slot {
            s.guard.set_inheritable(inherit)?;
        }
        self.images
            .iter()
            .try_for_each(|i| i.held.guard.set_inheritable(inherit))
    }

    /// The descriptors of every lock held and of the lease, for the `--no-inherit` keeper.
    pub fn lock_fds(&self) -> Vec<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.slot
            .iter()
            .map(|s| s.guard.as_raw_fd())
            .chain(self.images.iter().map(|i| i.held.guard.as_raw_fd()))
            .chain(crate::lease::raw_fds())
            .collect()
    }

    /// The images directory and `base`'s tree in it, opened to copy from before anything of the
    /// copy is done: a directory of its own that we may open, else why not.
    pub fn open_base(&self, store: &Store, base: &ImageName) -> Result<(Dir, Dir)> {
        let (root, dir) = (store.root(), &self.images_dir);
        let images = crate::images_dir::confirmed(root, dir, root.open_images_dir(dir))?;
        let src = self.images_dir.join(base.encoded());
        let shown = src.display();
        match images.sub(base.encoded()) {
            Ok(tree) => Ok((images, tree)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                anyhow::bail!("image '{base}': its tree {shown} is missing; cannot copy it")
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
                anyhow::bail!("image '{base}': {shown} is not a directory; cannot copy it")
            }
            Err(e) => {
                Err(e).with_context(|| format!("image '{base}': cannot open {shown} to copy it"))
            }
        }
    }

    /// Makes the written image `target` a copy of `base`, emptied first. Both ends are opened from
    /// one descriptor of the images directory: a link swapped in above them cannot move the copy.
    /// On failure, `changed` says whether anything of `target`'s tree changed first. The base's
    /// lend lock is waited for as `req` waits for locks.
    pub fn clone_into(
        &self,
        store: &Store,
        req: &Request,
        (images, s): (Dir, Dir),
        base: &ImageName,
        target: &ImageName,
        changed: &mut bool,
    ) -> Result<()> {
        use std::io::IsTerminal;
        let images_dir = &self.images_dir;
        let src = images_dir.join(base.encoded());
        let dst = images_dir.join(target.encoded());
        let cannot = || format!("cannot copy image '{base}' to '{target}'");
        // A base that is a mount point is no tree of the images directory (it may even hold it).
        if s.is_mount_root().with_context(cannot)? {
            anyhow::bail!(
                "{}: {} is a mount point; a copy takes nothing across a mount (unmount it first)",
                cannot(),
                src.display()
            );
        }
        let mut loans = lend_lock(store, req, base, &s, &src).with_context(cannot)?;
        let ctx = store.ctx();
        may_make_ours(&images, target, &dst).with_context(cannot)?;
        let mut removed = 0;
        let emptied = crate::remove::empty_image_dir(&images, images_dir, target, &mut removed);
        *changed = removed > 0;
        emptied.with_context(cannot)?;
        crate::debug::pause("clone-emptied");
        // The directory opened before is still the one at its path (the builder gets that path).
        let now = store
            .root()
            .open_images_dir(images_dir)
            .with_context(cannot)?;
        let id = |d: &Dir| crate::dir::fstat(d).map(|st| (st.st_dev, st.st_ino));
        if id(&now)? != id(&images)? {
            anyhow::bail!(
                "{}: {} was replaced during the copy",
                cannot(),
                images_dir.display()
            );
        }
        let t0 = Instant::now();
        let show = std::io::stderr().is_terminal() && !ctx.quiet;
        let mut bar = crate::clone::Bar::new(format!("copying '{base}' to '{target}'"), show);
        make_ours(&images, target, &dst, changed).with_context(cannot)?;
        let d = (images.sub(target.encoded()))
            .with_context(|| format!("cannot open {}", dst.display()))
            .with_context(cannot)?;
        // Asked of the directory opened, written through this descriptor only: a mount made at the
        // path since it was emptied gets nothing.
        if d.is_mount_root().with_context(cannot)? {
            anyhow::bail!(
                "{}: {} is a mount point; unmount it first",
                cannot(),
                dst.display()
            );
        }
        let done = crate::clone::copy_tree_at((s, &src), (d, &dst), &mut loans, &mut bar, changed);
        drop(loans);
        let done = done.with_context(cannot)?;
        say_copied(ctx, (base, target), &done, t0);
        Ok(())
    }

    /// Releases the read lock on `name` early (a `--from` base once copied), if held shared.
    pub fn release_read(&mut self, name: &ImageName) {
        if let Some(i) = self
            .images
            .iter()
            .position(|i| i.held.name == *name && i.role == Role::Read)
        {
            let img = self.images.remove(i);
            crate::lease::forget(&self.root.leases(), &img.rel());
        }
    }

    /// The images read (or `only` that one) that are not as they were read, named, where their
    /// lock may have been lost meanwhile: another host may have written one (a read each).
    pub fn reads_changed(&self, only: Option<&ImageName>) -> Option<String> {
        let changed: Vec<String> = (self.images.iter())
            .filter(|i| !i.writes() && only.is_none_or(|n| *n == i.held.name))
            .filter(|i| i.held.guard.may_be_lost())
            .filter(|i| {
                !image_record::holds_latest(i.held.guard.file(), &i.held.seen, false)
                    .unwrap_or(false)
            })
            .map(|i| format!("'{}'", i.held.name))
            .collect();
        let plural = if changed.len() > 1 { "s" } else { "" };
        (!changed.is_empty()).then(|| format!("image{plural} {}", changed.join(", ")))
    }

    /// The exclusive reads whose lock was lost while the command ran, where it may be (a request
    /// each), as an error to report: readers may have come in, the tree changed under them. Each
    /// is marked: its use is not recorded, nor its record numbered anew (the lock is not ours).
    pub fn exclusive_reads_lost(&mut self) -> Option<String> {
        let mut lost = Vec::new();
        for img in (self.images.iter_mut()).filter(|i| i.role == Role::ReadExclusive) {
            if let Some(why) = img.held.guard.lost() {
                img.lost = true;
                lost.push(format!("'{}' ({why})", img.held.name));
            }
        }
        let plural = if lost.len() > 1 { "s" } else { "" };
        (!lost.is_empty()).then(|| {
            format!(
                "lost the exclusive read lock on image{plural} {} while the command ran: other commands may have used it meanwhile",
                lost.join(", ")
            )
        })
    }

    /// Records the outcome and releases the locks; a write lock lost meanwhile (NFS) is an error.
    pub fn finish(mut self, store: &mut Store, outcome: Outcome) -> Result<()> {
        let now = clock::now_ms();
        let mut lost = Vec::new();
        let mut failed = None;
        for img in self.images.iter_mut() {
            // A read that outlasted the resolution is a use until its end: a gc right after a long
            // build must not take its base for unused since the build began.
            img.record_use(now);
            if !img.writes() {
                continue;
            }
            crate::debug::pause("write-finishing");
            if let Err(why) = still_ours(img, now) {
                lost.push(why);
                continue;
            }
            match finish_write(&self.root, &self.images_dir, img, &outcome, now) {
                Ok(note) => note.into_iter().for_each(|n| store.ctx().say(&n)),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        // Nothing is recorded on a slot's strength: a lost one is told, the command's status kept.
        if let Some(s) = &self.slot
            && let Some(why) = s.lost(&self.root)
        {
            store.ctx().warn(&s.lost_warning(&why));
        }
        self.release();
        if !lost.is_empty() {
            anyhow::bail!("{}; the image is not ready", lost.join("; "));
        }
        failed.map_or(Ok(()), Err)
    }

    /// Undoes the start of a command that never ran: records put back, new trees and files gone.
    pub fn abandon(mut self) -> Result<()> {
        let mut out = Ok(());
        // A written image has a record once its start is recorded.
        for img in self.images.iter_mut().filter(|i| i.record.is_some()) {
            if img.made_tree
                && let Some(images) = &img.images
            {
                let _ = images.rmdir(img.held.name.encoded());
            }
            let done = match img.before.clone() {
                Some(before) => image_record::write_reserved(
                    img.held.guard.file(),
                    &mut img.held.seen,
                    &before,
                    &self.root.reserve(),
                ),
                None => image_record::clear(img.held.guard.file())
                    .map(|()| img.held.seen = Default::default()),
            };
            // A later failure's error is the one told.
            out = done
                .with_context(|| format!("cannot put back the record of image '{}'", img.held.name))
                .and(out);
        }
        self.release();
        out
    }

    /// Lets every lock go, with the lock files this session made that carry no record.
    fn release(&mut self) {
        let rels: Vec<_> = self.images.iter().map(Image::rel).collect();
        let held = self.images.drain(..).map(|i| i.held).collect();
        crate::remove::release_unclaimed(&self.root, held, &[]);
        self.slot = None;
        crate::lease::forget_all(&self.root.leases(), rels);
        for entry in self.trashed.drain(..) {
            crate::remove::delete_trashed(&self.root, &entry);
        }
    }
}

enum Attempt {
    Started(Box<Session>),
    /// Someone else's store-wide hold: wait for it, then start over.
    StoreWide,
    /// The store is from a release before records: migrate, start over.
    Legacy,
}

/// The images taken, or what to do before an attempt starts over.
type Taken = Result<Result<Vec<Image>, Attempt>>;

/// Every image lock, in lock order, with its record, then what the records say of the attempt: a
/// store to migrate, another's store-wide hold to wait for, reads that cannot be. All but going on
/// lets every lock go; `Ok(Err(_))`: again.
fn take_images(
    store: &Store,
    req: &Request,
    wanted: &[(ImageName, Role)],
    to_read: &[ImageName],
    slot: Option<crate::lease::Holding>,
) -> Taken {
    let root = store.root();
    let mut images: Vec<Image> = Vec::with_capacity(wanted.len());
    let mut waited_for = Vec::new();
    // What a wait lists beside its await: the slot and the images taken.
    let mut held: Vec<crate::lease::Holding> = slot.into_iter().collect();
    for (name, role) in wanted {
        let want = Want {
            mode: role.mode(),
            create: *role == Role::Write,
            reading: *role == Role::ReadExclusive,
            deadline: req.deadline,
            no_wait: req.no_wait,
            command: &req.command,
            must_exist: to_read,
            held: &held,
        };
        waited_for.push(name.clone());
        let image = match crate::acquire::image::take(store, name, &want) {
            Ok(taken) => Image {
                held: taken,
                role: *role,
                before: None,
                record: None,
                made_tree: false,
                images_dir: None,
                images: None,
                lost: false,
            },
            Err(e) => return give_up_on(root, images, &waited_for, e),
        };
        if !image.held.under {
            held.push(image.holding(&req.command));
        }
        images.push(image);
    }
    if images.iter().any(|i| i.held.seen.legacy) {
        if crate::migrate::is_legacy(root) {
            give_up(root, images, &[]);
            return Ok(Err(Attempt::Legacy));
        }
        // An older release's bytes in a store past it were put there: the state is not known.
        for i in images.iter_mut().filter(|i| i.held.seen.legacy) {
            (i.held.seen.legacy, i.held.seen.damaged) = (false, true);
        }
    }
    if let Some(e) = newer_record(root, &images) {
        return give_up_on(root, images, &[], e.into());
    }
    let gone = match settle_store_wide(root, &mut images) {
        Ok((Probe::Held, _)) => {
            give_up(root, images, &[]);
            return Ok(Err(Attempt::StoreWide));
        }
        Ok((_, gone)) => gone,
        Err(e) => return give_up_on(root, images, &[], e),
    };
    if let Err(e) = check_reads(root, &images, &gone) {
        return give_up_on(root, images, &[], e);
    }
    Ok(Ok(images))
}

/// What the lease lists of the images `wanted` while the command waits, before it takes them.
fn queued(req: &Request, wanted: &[(ImageName, Role)]) -> Vec<crate::lease::Holding> {
    let queued = wanted.iter().map(|(name, role)| {
        let rel = Root::image_lock_rel(name);
        let mut h = crate::lease::Holding::now(role.mode(), rel, true, &req.command);
        (h.reading, h.queued) = (*role == Role::ReadExclusive, true);
        h
    });
    queued.collect()
}

/// Images to lock, in lock order (ascending ENC); one read and written is taken once, exclusively.
fn wanted(req: &Request) -> Vec<(ImageName, Role)> {
    let mut wanted: Vec<(ImageName, Role)> = [
        (&req.reads, Role::Read),
        (&req.exclusive_reads, Role::ReadExclusive),
        (&req.writes, Role::Write),
    ]
    .into_iter()
    .flat_map(|(names, role)| names.iter().map(move |n| (n.clone(), role)))
    .collect();
    wanted.sort_by(|a, b| a.0.encoded().cmp(b.0.encoded()).then(a.1.cmp(&b.1)));
    wanted.dedup_by(|later, earlier| {
        let same = later.0 == earlier.0;
        if same {
            earlier.1 = earlier.1.max(later.1);
        }
        same
    });
    wanted
}

/// Asks `store.lock` when an image we hold has the store-wide hint, or is new (so cannot have one).
/// - Free: a gone hold's hints go — but a ready image whose tree is missing (that hold's command
///   deleted it while another held it) is returned as gone, keeping its hint for the next user.
/// - Inside a hold: a new image's lock file gets the hint, so users outside ask `store.lock` too.
fn settle_store_wide(root: &Root, images: &mut [Image]) -> Result<(Probe, Vec<ImageName>)> {
    let hinted = images.iter().any(|i| i.held.seen.store_wide);
    let new = images
        .iter()
        .any(|i| i.writes() && matches!(i.state(), None | Some(State::Deleting)));
    if !hinted && !new {
        return Ok((Probe::Free, Vec::new()));
    }
    let p = crate::store_wide::probe(root)?;
    let mut gone = Vec::new();
    match p {
        Probe::Free if hinted => {
            let mut clear = Vec::new();
            for i in images.iter().filter(|i| i.held.seen.store_wide) {
                let tree_missing = i.held.seen.record.as_ref().is_some_and(|r| {
                    r.state == State::Ready
                        && crate::images_dir::for_command(root, r).is_ok_and(|d| {
                            crate::images_dir::nothing_at(root, &d, i.held.name.encoded())
                        })
                });
                match tree_missing {
                    true => gone.push(i.held.name.clone()),
                    // Not through a reader's file with other names.
                    false if !i.held.under && i.held.guard.has_one_name() => {
                        clear.push(i.held.guard.file())
                    }
                    false => {}
                }
            }
            crate::store_wide::clear_hints(clear);
        }
        Probe::Inside if new => {
            for i in images
                .iter_mut()
                .filter(|i| i.writes() && i.held.seen.record.is_none())
            {
                if image_record::set_store_wide(i.held.guard.file(), true).is_ok() {
                    i.held.seen.store_wide = true;
                }
            }
        }
        _ => {}
    }
    Ok((p, gone))
}

/// A later release's record among the images: that release's store, neither read nor written here.
fn newer_record(root: &Root, images: &[Image]) -> Option<Error> {
    images
        .iter()
        .find_map(|i| crate::acquire::image::newer(root, &i.held))
}

/// Reads need `ready` (a write in flight whose lock we share was a dead writer's: incomplete).
fn check_reads(root: &Root, images: &[Image], gone: &[ImageName]) -> Result<()> {
    for img in images.iter().filter(|i| !i.writes()) {
        let name = img.held.name.as_str().to_owned();
        let path = root.image_lock(&img.held.name);
        let record = img.held.seen.record.as_ref();
        let error = match record.map(|r| r.state_seen(false)) {
            _ if gone.contains(&img.held.name) => Error::NoSuchImage(vec![name]),
            _ if img.held.seen.damaged => {
                let holds = img.held.seen.foreign.clone();
                Error::DamagedRecord { name, path, holds }
            }
            None | Some(State::Deleting) => Error::NoSuchImage(vec![name]),
            Some(State::Ready) => continue,
            Some(_) => Error::NotReady {
                state: record.map(not_ready_why).unwrap_or_default(),
                name,
            },
        };
        return Err(error.into());
    }
    Ok(())
}

/// What a reader is told of an image whose record `r` is not ready: its state, and why.
fn not_ready_why(r: &Record) -> String {
    let name = &r.name;
    match (r.state, r.outcome.as_deref()) {
        _ if r.readiness_unknown() => format!(
            "incomplete, readiness unknown: '{STOWAGE} exec --write {name} -- true' marks it ready"
        ),
        (State::Incomplete, Some(how)) => format!("incomplete, its writer's outcome: {how}"),
        // A write in flight under no exclusive lock: its writer is gone.
        (s, _) if s.in_flight() => "incomplete, its writer died".into(),
        (s, _) => s.as_str().into(),
    }
}

/// Writes a record, using the reserve if the filesystem is full.
fn write_record(store: &Store, held: &mut Held, r: &Record) -> Result<()> {
    let path = held.guard.path().display().to_string();
    let reserve = store.root().reserve();
    image_record::write_reserved(held.guard.file(), &mut held.seen, r, &reserve)
        .with_context(|| format!("cannot write the record of image '{}' in {path}", r.name))
}

/// A new image: its record says `creating` (synced), then its empty tree is made.
fn start_new(
    store: &Store,
    img: &mut Image,
    base: Option<String>,
    lease: Option<String>,
    now: clock::Millis,
) -> Result<()> {
    let root = store.root();
    let config = crate::images_dir::config(root)?;
    let dir = crate::images_dir::checked(root, &config)?;
    let name = img.held.name.clone();
    crate::debug::pause("images-dir-checked");
    let images = crate::images_dir::confirmed_as(
        root,
        &config,
        &dir,
        root.anchor_images_dir(&dir, config.identity.is_none()),
    )
    .with_context(|| format!("cannot create image '{name}'"))?;
    let mut r = Record::new(name.as_str(), config.images.clone(), now);
    (r.base, r.writer) = (base, lease);
    write_record(store, &mut img.held, &r)?;
    img.record = Some(r);
    crate::debug::pause("new-recorded");
    img.made_tree = make_new_tree(&images, &dir, &name)?;
    (img.images_dir, img.images) = (Some(dir), Some(images));
    Ok(())
}

/// Makes `name`'s tree in `images` (the images directory `dir`): `false` if something is there.
fn make_tree(images: &crate::dir::Dir, dir: &Path, name: &ImageName) -> Result<bool> {
    match images.mkdir(name.encoded(), 0o777) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => {
            Err(e).with_context(|| format!("cannot create {}", dir.join(name.encoded()).display()))
        }
    }
}

/// Makes the tree of an existing image that has none (a failed first write's went): whether made,
/// and the images directory checked for it, as a path and opened. One that is not a directory of
/// its own (one `lstat`): a symlink or file swapped in, or a missing one where the images directory
/// is not the recorded one, misdirects writes, and is refused.
fn make_missing_tree(root: &Root, held: &Held) -> Result<(bool, Option<PathBuf>, Option<Dir>)> {
    let Some(r) = held.seen.record.as_ref() else {
        return Ok((false, None, None));
    };
    let dir = crate::images_dir::for_command(root, r)?;
    let tree = dir.join(held.name.encoded());
    let cannot = |why: String| anyhow::anyhow!("cannot write image '{}': {why}", held.name);
    let images = root.open_images_dir(&dir).map_err(|e| {
        cannot(crate::images_dir::unmounted(root, &dir).unwrap_or_else(|| format!("{e:#}")))
    })?;
    let what = match images.stat_at(held.name.encoded()) {
        Ok(Some(e)) if e.is_symlink() => "a symlink",
        Ok(Some(e)) if !e.is_dir() => "not a directory",
        // The tree there or not, the directory must be the store's: another mounted in its place
        // would have the command write (or a copy empty) a tree of its own.
        Ok(None) => {
            crate::images_dir::of_record(root, r)?;
            let confirmed = crate::images_dir::confirmed(root, &dir, Ok(images));
            let images = confirmed.map_err(|e| cannot(format!("{e:#}")))?;
            let made = make_tree(&images, &dir, &held.name)?;
            return Ok((made, Some(dir), Some(images)));
        }
        // (An external one was checked by its claim finding it, `for_command`.)
        _ if dir == root.default_images_dir() => {
            let confirmed = crate::images_dir::confirmed(root, &dir, Ok(images));
            let images = confirmed.map_err(|e| cannot(format!("{e:#}")))?;
            return Ok((false, Some(dir), Some(images)));
        }
        _ => return Ok((false, Some(dir), Some(images))),
    };
    anyhow::bail!(
        "image '{}': its tree {} is {what}: refusing to write through it (remove it with '{STOWAGE} rm {}')",
        held.name,
        tree.display(),
        held.name
    )
}

/// Restores what a killed copy left lent on the tree (`loan.rs`) before anyone writes it: a
/// writer's own chmod to a lent mode would be undone by a later restore.
fn take_back_loans(root: &Root, held: &Held, images: Option<&Dir>) {
    use crate::lock::{IfMissing, Mode};
    let path = root.image_lend(&held.name);
    // The lend file first: where no copy lent (none, or an empty one), the tree is not opened (each
    // open a server request).
    let Ok(Some(lend)) = crate::lock::acquire_no_wait(&path, Mode::Exclusive, IfMissing::Fail)
    else {
        return;
    };
    if lend.file().metadata().is_ok_and(|m| m.len() > 0)
        && let Some(tree) = images.and_then(|d| d.sub(held.name.encoded()).ok())
    {
        let _ = crate::loan::restore(lend.file(), &path, &tree);
    }
}

/// Makes a new image's tree, or takes the empty one of ours a write cut short left: whether made.
/// A directory the server says is gone (another host removed it a moment ago; this host's client
/// still has its name cached) is missing: made once more, freshly asked.
fn make_new_tree(images: &crate::dir::Dir, dir: &Path, name: &ImageName) -> Result<bool> {
    if make_tree(images, dir, name)? {
        return Ok(true);
    }
    match refuse_planted(images, dir, name) {
        Err(e) if removed_meanwhile(&e) => {}
        other => return other.map(|()| false),
    }
    if make_tree(images, dir, name)? {
        return Ok(true);
    }
    refuse_planted(images, dir, name)
        .map(|()| false)
        .map_err(|e| match removed_meanwhile(&e) {
            true => anyhow::anyhow!(
                "image '{name}' is new, but {} was removed a moment ago and this host's filesystem client still names it: try again",
                dir.join(name.encoded()).display()
            ),
            false => e,
        })
}

/// Whether `e` is a listing of a directory the server no longer has (`ENOENT`, `ESTALE`).
fn removed_meanwhile(e: &anyhow::Error) -> bool {
    let errno = e
        .downcast_ref::<io::Error>()
        .and_then(io::Error::raw_os_error);
    matches!(errno, Some(libc::ENOENT | libc::ESTALE))
}

/// A new image's existing directory is used only if it is an empty one of ours (a write cut short
/// made it): anything else is refused, never handed to the builder; one that cannot be listed
/// because it is gone is that listing's error, for [`make_new_tree`] to make it anew.
fn refuse_planted(images: &crate::dir::Dir, dir: &Path, name: &ImageName) -> Result<()> {
    let path = dir.join(name.encoded());
    // Only a directory is a tree `doctor --repair` adopts, and not every one: advised only there
    // (asked only here, refusing: a new image's start pays nothing for it).
    let adopt = format!(", or '{STOWAGE} doctor --repair' adopts it");
    let adopt = adopt.as_str();
    let (what, adopt) = match images.stat_at(name.encoded())? {
        Some(e) if e.is_symlink() => ("a symlink".to_owned(), ""),
        Some(e) if !e.is_dir() => ("not a directory".to_owned(), ""),
        Some(e) if e.uid != nix::unistd::geteuid().as_raw() => {
            ("another user's directory".to_owned(), adopt)
        }
        Some(_) => match images.sub(name.encoded()).and_then(|d| d.names()) {
            // Empty, the filesystem's lost+found (or a store's directory) is still no tree of ours.
            Ok(n) if n.is_empty() => match crate::adopt::never_adopted(images, name.encoded()) {
                None => return Ok(()),
                Some(why) => (why, ""),
            },
            Ok(_) => ("a directory with contents".to_owned(), adopt),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESTALE)) => {
                return Err(e.into());
            }
            Err(e) => (format!("a directory that cannot be listed: {e}"), adopt),
        },
        None => return Ok(()),
    };
    let never = crate::adopt::never_adopted(images, name.encoded()).is_some();
    let adopt = if never { "" } else { adopt };
    // An image whose record a shell's `>` erased looks the same: removing it would lose it.
    let erased = match adopt.is_empty() {
        true => "",
        false => "if it was an image, a '>' on its lock file likely erased its record; else ",
    };
    anyhow::bail!(
        "image '{name}' is new, but {} exists ({what}): refusing to build into it ({erased}remove it{adopt})",
        path.display()
    )
}

/// Finishes a removal a crash cut short, before the name is written anew: its tree goes to the
/// trash (named after our lease: nobody takes it for a leftover while we live), returned to be
/// deleted once every lock is let go, as `rm` deletes it.
fn finish_removal(root: &Root, img: &mut Image) -> Result<Option<std::ffi::OsString>> {
    let name = img.held.name.clone();
    let record = img.held.seen.record.clone().expect("a deleting record");
    let dir = crate::images_dir::of_record(root, &record)?;
    let trash = root.open_trash()?;
    let mut trashed = None;
    if let Ok(opened) = root.open_images_dir(&dir) {
        let images = crate::images_dir::confirmed(root, &dir, Ok(opened))?;
        let tree = dir.join(name.encoded());
        trashed = crate::remove::take_out_tree(root, &images, &trash, &tree, &name)
            .with_context(|| format!("cannot finish the removal of image '{name}'"))?;
    }
    image_record::clear(img.held.guard.file())?;
    img.held.seen = Default::default();
    Ok(trashed)
}

/// Whether the write lock is still ours, and was all along: a lock lost while free is taken again
/// by the check (a client reconnected without its locks, a partition healed), so the record tells
/// whether another acted meanwhile (one read). A record another changed is marked incomplete, the
/// lock being ours again: two writers' files may be mixed in the tree. One another holds now is
/// told so by the `F` hint, which its writer reads back at its end; we may not write its record.
fn still_ours(img: &mut Image, now: clock::Millis) -> Result<(), String> {
    let name = img.held.name.clone();
    let lost = |why: String| {
        format!(
            "lost the write lock on image '{name}' ({why}) while the command ran: another host may have taken it"
        )
    };
    if let Err(e) = img.held.guard.still_held() {
        tell_writer(img);
        // Its taker may have finished meanwhile: the lock is then ours again, its record ours to mark.
        img.held
            .guard
            .still_held()
            .map_err(|_| lost(e.to_string()))?;
    }
    let file = img.held.guard.file();
    let cannot = |e: std::io::Error| lost(format!("its record cannot be read: {e}"));
    if image_record::holds_latest(file, &img.held.seen, true).map_err(cannot)? {
        return Ok(());
    }
    let found = image_record::read_of(file, img.held.name.as_str()).map_err(cannot)?;
    let Some(mut r) = found.record.clone() else {
        return Err(lost("its record was emptied or replaced meanwhile".into()));
    };
    let said = if img.held.seen.record.as_ref() == Some(&r) {
        format!("image '{name}': a writer whose lock was lost wrote into its tree meanwhile")
    } else {
        lost(format!("its record was changed meanwhile, to {}", r.state))
    };
    if r.state != State::Deleting {
        (r.state, r.changed) = (State::Incomplete, now);
        r.outcome = Some("written while its writer's lock was lost".into());
        img.held.seen = found;
        let _ = image_record::write(file, &mut img.held.seen, &r);
    }
    let _ = image_record::set_foreign_write(file, None);
    Err(said)
}

/// Our write lock lost: tells the writer holding it now that our command wrote into its tree (`F`
/// naming its record, which it reads back at its end). Only a record in flight, the same before and
/// after a probe finds the lock held exclusively: its writer holds it (a reader is not told).
fn tell_writer(img: &Image) {
    let (file, path) = (img.held.guard.file(), img.held.guard.path());
    let in_flight = || {
        let seen = image_record::read(file).ok()?;
        seen.record
            .filter(|r| r.state.in_flight())
            .map(|r| r.fingerprint())
    };
    let Some(named) = in_flight() else { return };
    let held = crate::lock::probe(path).is_ok_and(|p| p == crate::lock::Probe::Exclusive);
    if held && in_flight() == Some(named) {
        let _ = image_record::set_foreign_write(file, Some(named));
    }
}

/// The end of one write: a tree the command deleted goes with its record, else the record says how
/// the command ended. Returns what to tell the user, if anything is unusual.
fn finish_write(
    root: &Root,
    images_dir: &Path,
    img: &mut Image,
    outcome: &Outcome,
    now: clock::Millis,
) -> Result<Option<String>> {
    let Some(mut r) = img.record.clone() else {
        return Ok(None);
    };
    let enc = img.held.name.encoded();
    let missing = crate::images_dir::nothing_at(root, images_dir, enc);
    let mut note = None;
    (r.state, r.outcome) = match outcome {
        Outcome::Success if missing => match crate::images_dir::unmounted(root, images_dir) {
            None => {
                // `ch-image delete` under a write lock: the image is gone.
                image_record::clear(img.held.guard.file())?;
                img.held.seen = Default::default();
                return Ok(None);
            }
            Some(why) => {
                note = Some(format!(
                    "image '{}' is incomplete: the command succeeded, but its tree is not found ({why})",
                    img.held.name
                ));
                (State::Incomplete, Some("its tree was not found".to_owned()))
            }
        },
        Outcome::Success => (State::Ready, Some("exit 0".to_owned())),
        Outcome::Failure(how) => (State::Incomplete, Some(how.clone())),
    };
    r.changed = now;
    let file = img.held.guard.file();
    image_record::write_reserved(file, &mut img.held.seen, &r, &root.reserve())
        .with_context(|| format!("cannot record the outcome of image '{}'", img.held.name))?;
    // No last-use hint: the record's `changed` is the write's use (the survey takes the later).
    if matches!(outcome, Outcome::Failure(_))
        && img.made_tree
        && img.before.is_none()
        && !open_elsewhere(&img.held.guard)
        && let Some(images) = &img.images
    {
        let _ = images.rmdir(enc);
    }
    Ok(note)
}

/// After a failed request: lock files it made that carry no record go.
fn give_up(root: &Root, images: Vec<Image>, waited_for: &[ImageName]) {
    crate::lease::forget_all(&root.leases(), images.iter().map(Image::rel));
    let held = images.into_iter().map(|i| i.held).collect();
    crate::remove::release_unclaimed(root, held, waited_for);
}

/// [`give_up`]; an image missing from an unmigrated store is sought again once migrated.
fn give_up_on(root: &Root, images: Vec<Image>, waited: &[ImageName], e: anyhow::Error) -> Taken {
    give_up(root, images, waited);
    if matches!(crate::error::typed(&e), Some(Error::NoSuchImage(_)))
        && crate::migrate::is_legacy(root)
    {
        return Ok(Err(Attempt::Legacy));
    }
    Err(e)
}

/// Whether another process (the command's background job) shares our lock: it may write the tree.
fn open_elsewhere(guard: &crate::lock::Guard) -> bool {
    use std::os::fd::AsRawFd;
    let mine = guard.as_raw_fd();
    let me = std::process::id();
    let Ok(ours) = std::fs::read_link(format!("/proc/self/fd/{mine}")) else {
        return true;
    };
    let Ok(mut procs) = crate::ident::numbered::<u32>("/proc") else {
        return true;
    };
    procs.any(|(pid, p)| {
        pid != me
            && crate::ident::numbered::<i32>(p.path().join("fd")).is_ok_and(|mut fds| {
                fds.any(|(theirs, fd)| {
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
                    same == 0
                })
            })
    })
}

impl Drop for Session {
    /// Dropped without finish (a library caller, a panic): the locks go, written images read as
    /// incomplete (`writing` under free locks), and our lease lists them no more.
    fn drop(&mut self) {
        self.release();
    }
}

/// The lend lock of `base` (its top `s`, at `src`), held until its copy ends: no other copy of it
/// lends meanwhile, or lends alone. Taken before the image is emptied: a refusal (a lend file
/// planted, loans another user left) leaves it as it was. Waited for as `req` waits for locks;
/// where a wait may give up, taken exclusively now if the copy may lend, so that it gives up
/// before the image is emptied.
fn lend_lock(
    store: &Store,
    req: &Request,
    base: &ImageName,
    s: &Dir,
    src: &Path,
) -> Result<crate::loan::Loans> {
    let shown = (!store.ctx().quiet).then(|| format!("'{base}'"));
    // `--no-wait`: one try, as for the image locks.
    let deadline = if req.no_wait {
        Some(Instant::now())
    } else {
        req.deadline
    };
    let lend = store.root().image_lend(base);
    let mut loans = crate::loan::Loans::take(lend, s, shown, deadline)
        .with_context(|| format!("image '{base}'"))?;
    if deadline.is_some() && crate::clone::lends(s, src) {
        loans
            .exclusive()
            .with_context(|| format!("image '{base}'"))?;
    }
    Ok(loans)
}

/// Refuses, before anything is emptied, a top of another user's that [`make_ours`] could not
/// replace: the images directory must let us delete in it (write and search; if sticky, ours).
fn may_make_ours(images: &Dir, target: &ImageName, dst: &Path) -> Result<()> {
    use nix::unistd::{AccessFlags, faccessat};
    let me = nix::unistd::geteuid().as_raw();
    let Ok(Some(st)) = images.stat_at(target.encoded()) else {
        return Ok(());
    };
    if !st.is_dir() || st.uid == me || me == 0 {
        return Ok(());
    }
    let here = images.stat()?;
    let flags = nix::fcntl::AtFlags::AT_EACCESS;
    let writable = faccessat(images, ".", AccessFlags::W_OK | AccessFlags::X_OK, flags).is_ok();
    if writable && (here.mode & libc::S_ISVTX == 0 || here.uid == me) {
        return Ok(());
    }
    let (mode, owner) = (here.mode & 0o7777, here.uid);
    anyhow::bail!(
        "cannot make {} anew: it is uid {}'s, and its images directory (mode {mode:o}) lets only that user, uid {owner} or root replace it",
        dst.display(),
        st.uid
    )
}

/// Replaces the emptied tree of `target` by one of ours if another user made it (a group store): a
/// copy makes its top ours alone while it is made (`clone::copy_tree_at` checks it got one). Once
/// the tree is taken away, the image `changed`.
fn make_ours(images: &Dir, target: &ImageName, dst: &Path, changed: &mut bool) -> Result<()> {
    let me = nix::unistd::geteuid().as_raw();
    if let Ok(Some(st)) = images.stat_at(target.encoded())
        && st.is_dir()
        && st.uid != me
    {
        let cannot = || format!("cannot make {} anew", dst.display());
        images.rmdir(target.encoded()).with_context(cannot)?;
        *changed = true;
        (images.mkdir(target.encoded(), st.mode & 0o7777)).with_context(cannot)?;
    }
    Ok(())
}

/// What a copy of `base` to `target` (done since `t0`) did and left out, said.
fn say_copied(
    ctx: &crate::ctx::Ctx,
    (base, target): (&ImageName, &ImageName),
    done: &crate::clone::Copied,
    t0: Instant,
) {
    let (files, s) = (done.files, if done.files == 1 { "" } else { "s" });
    ctx.detail(&format!(
        "copied '{base}' to '{target}': {files} file{s}, {} ({} reflinked) in {:.2} s",
        crate::disk_usage::human(done.bytes),
        done.reflinked,
        t0.elapsed().as_secs_f64()
    ));
    for m in &done.mounts_left_out {
        ctx.say(&format!(
        "image '{target}': {m} is a mount point in '{base}'; copied as an empty directory (a mounted filesystem is not part of the image)"
        ));
    }
    if done.worktree_link_left_out {
        ctx.detail(&format!(
        "image '{target}': /.git of '{base}' not copied: it links '{base}' to a git worktree (a build cache's), which a copy must not claim"
        ));
    }
    if done.skipped_special > 0 {
        ctx.say(&format!(
        "image '{target}': {} device node(s) of '{base}' not copied (creating them needs privilege)",
        done.skipped_special
        ));
    }
    if let Some(lost) = done.xattrs_summary() {
        ctx.say(&format!(
        "image '{target}': extended attributes of '{base}' the filesystem refused, not kept: {lost}{}",
        if ctx.verbose { "" } else { " (-v lists the files)" }
        ));
        for d in &done.xattr_details {
            ctx.detail(&format!("  not kept: {d}"));
        }
    }
}
