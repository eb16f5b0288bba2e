//! Store-wide holds: `exec --store-wide`, `init`'s switch of the images directory and the migration
//! run while nobody else holds or can take an image lock (docs/design.md, "Store-wide holds").
//!
//! - The holder takes `store.lock` exclusively, holding nothing else; then, until a listing finds
//!   no lock file new: sets the hint on every file listed, then takes each lock exclusively, sets
//!   the hint again under it, lets it go.
//! - An image user that finds the hint asks `store.lock`: held, it lets go of everything, waits for
//!   it shared holding nothing, and starts over. A new image's writer always asks, after taking its
//!   own lock.
//! - A cleared hint costs fairness, never exclusion: the hold sets it again under the exclusive
//!   lock. A dead holder's hints are cleared by the next holder of each image.
//! - Nested calls go ahead: the hold's own command, and a command of an image user the hold waits
//!   for (waiting would be a cycle).

use std::collections::HashSet;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::error::{Busy, Error};
use crate::holders::LockKind;
use crate::ident::STOWAGE;
use crate::image_record;
use crate::lease::Holding;
use crate::lock::{self, Guard, Mode, Wait, Waited};
use crate::nested::HeldAs;
use crate::root::Root;
use crate::store::Store;

/// What `store.lock` says to an image user that must ask it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// No store-wide hold: go ahead (and clear a hint).
    Free,
    /// A hold we are part of (its command, or an awaited image user's): go ahead, leave the hint.
    Inside,
    /// Someone else's hold: let go of everything and wait for it.
    Held,
}

/// Asks `store.lock` without waiting, holding the image locks the answer is for.
pub fn probe(root: &Root) -> Result<Probe> {
    let path = root.store_wide_lock();
    let file = match lock::open_existing_read(&path) {
        Ok(Some(f)) => f,
        Ok(None) => return Ok(Probe::Free),
        // No hold stands on a planted file (taking one refuses it).
        Err(e) if crate::planted::find(&e).is_some() => return Ok(Probe::Free),
        Err(e) => return Err(lock::error("the store-wide lock", &path, e)),
    };
    if lock::no_writer_now(&file).map_err(|e| lock::error("the store-wide lock", &path, e))?
        || crate::planted::check(&path, &file).is_err_and(|e| crate::planted::find(&e).is_some())
    {
        return Ok(Probe::Free);
    }
    // Inside a store-wide hold, or inside an image user's command (which a hold waits for; not a
    // slot holder's).
    let ours =
        |h: &Holding| h.lockfile == Root::STORE_WIDE_LOCK_REL || h.lockfile.starts_with("images/");
    let inside = crate::nested::enclosing(root).holds.iter().any(ours)
        || crate::nested::ancestor_holds(root).iter().any(ours);
    Ok(if inside { Probe::Inside } else { Probe::Held })
}

/// Whether another's store-wide hold stands over an image whose lock (held) said `seen`: then the
/// image may not change now.
pub fn blocks(root: &Root, seen: &crate::image_record::Seen) -> bool {
    seen.store_wide && !matches!(probe(root), Ok(Probe::Free | Probe::Inside))
}

/// Waits until no store-wide hold stands: `store.lock` taken shared and let go.
pub fn wait_free(
    store: &Store,
    deadline: Option<Instant>,
    no_wait: bool,
    command: &str,
) -> Result<()> {
    let path = store.root().store_wide_lock();
    let refuse = no_wait.then(|| "the store (a store-wide command runs)".to_owned());
    let what = "the store-wide command to finish".to_owned();
    let awaited = store_lock_holding(Mode::Shared, true, command);
    wait_in_turn(
        store,
        what,
        refuse,
        deadline,
        awaited,
        |wait| match lock::acquire(&path, Mode::Shared, lock::IfMissing::Fail, wait) {
            Ok(w) => Ok(w.map(Some)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Waited::Acquired(None)),
            Err(e) => Err(lock::error("the store-wide lock", &path, e)),
        },
    )
    .map(drop)
}

/// A store-wide hold: `store.lock` held exclusively, every image lock hinted and free.
#[must_use = "the hold ends when released"]
pub struct Hold {
    guard: Guard,
}

impl Hold {
    /// Takes the hold for `command`, waiting as `deadline` allows.
    pub fn take(
        store: &Store,
        command: &str,
        deadline: Option<Instant>,
        no_wait: bool,
    ) -> Result<Hold> {
        let busy = |why: &str| Err(Busy::now("the store-wide lock".into(), why.into()).into());
        let enclosing = crate::nested::enclosing(store.root());
        if enclosing.hold(Root::STORE_WIDE_LOCK_REL).map(HeldAs::mode) == Some(Mode::Exclusive) {
            return busy(
                "held by an enclosing command of this process (a 'stowage exec --store-wide' that runs it); a store-wide command cannot run inside another",
            );
        }
        // Inside an image user's command, a hold already waiting (for that user) would wait for us.
        let under_image = enclosing
            .holds
            .iter()
            .any(|h| h.lockfile.starts_with("images/"));
        // A later release's store, or image, is refused before its users are waited for and its
        // lock files hinted: the hold would stop every user of that release's store for nothing.
        store.root().refuse_newer()?;
        crate::catalog::refuse_newer(store.root())?;
        let root = store.root();
        if root.holds_store()
            && let Some(newer) = crate::census::newer(root, &crate::census::take(root)?)
        {
            return Err(newer.into());
        }
        loop {
            let hold = match Hold::take_raw(store, command, deadline, no_wait || under_image) {
                Err(e)
                    if under_image && matches!(crate::error::typed(&e), Some(Error::Busy(_))) =>
                {
                    return busy(
                        "held by another store-wide command, which waits for the exec this process runs in: waiting would never end",
                    );
                }
                other => other?,
            };
            if let Err(e) = hold.quiesce(store, deadline, no_wait) {
                hold.abandon(store);
                return Err(e);
            }
            // `store.lock` lost through the scan's waits (the connection to the server was): the
            // hold, which has not begun, starts over. Asked through a fresh descriptor
            // (`Guard::lost`): a try through ours would be granted the dropped lock anew.
            let Some(why) = hold.lost() else {
                return Ok(hold);
            };
            let said =
                format!("the store-wide lock was lost while waiting ({why}): taking it again");
            store.ctx().detail(&said);
            hold.release(store);
        }
    }

    /// Takes `store.lock` exclusively without the scan (for the migration), waiting as allowed
    /// (holding nothing).
    pub fn take_raw(
        store: &Store,
        command: &str,
        deadline: Option<Instant>,
        no_wait: bool,
    ) -> Result<Hold> {
        store.root().create_layout()?;
        let leases = store.root().leases();
        let _ = crate::lease::mine(&leases);
        let path = store.root().store_wide_lock();
        let err = |e| lock::error("the store-wide lock", &path, e);
        let now = lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Create);
        let guard = match now.map_err(err)? {
            Some(g) => g,
            None => {
                let what = "the store-wide lock".to_owned();
                let refuse = no_wait.then(|| what.clone());
                let awaited = store_lock_holding(Mode::Exclusive, true, command);
                wait_in_turn(store, what, refuse, deadline, awaited, |wait| {
                    lock::acquire(&path, Mode::Exclusive, lock::IfMissing::Create, wait)
                        .map_err(err)
                })?
            }
        };
        crate::lease::note(&leases, store_lock_holding(Mode::Exclusive, false, command));
        Ok(Hold { guard })
    }

    /// Hints every image lock file listed, then waits for each to be free; relists until a pass
    /// finds none new.
    fn quiesce(&self, store: &Store, deadline: Option<Instant>, no_wait: bool) -> Result<()> {
        let root = store.root();
        let mut done = HashSet::new();
        loop {
            let mut fresh = lock_file_names(root)?;
            fresh.retain(|n| !done.contains(n));
            if fresh.is_empty() {
                return Ok(());
            }
            // All hinted before any is waited for: a file hinted only once its turn came would let
            // new users of its image start meanwhile, and the hold would then wait for them too.
            for name in &fresh {
                crate::signals::check()?;
                hint(store, name)?;
            }
            crate::debug::pause("store-wide-hinted");
            for name in fresh {
                crate::signals::check()?;
                pass(store, &name, deadline, no_wait)?;
                done.insert(name);
            }
        }
    }

    /// The descriptor of `store.lock`, for the `--no-inherit` keeper.
    pub fn lock_fds(&self) -> Vec<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        std::iter::once(self.guard.as_raw_fd())
            .chain(crate::lease::raw_fds())
            .collect()
    }

    pub fn set_inheritable(&self, inherit: bool) -> std::io::Result<()> {
        crate::lease::set_inheritable(inherit)?;
        self.guard.set_inheritable(inherit)
    }

    /// After the command: drops the records of ready images whose trees it deleted; their names.
    /// `images_before`: the images directory before it ran, opened, if the one recorded; one the
    /// command made anew is recorded, and what it no longer holds was deleted, empty or not.
    pub fn forget_deleted(
        &self,
        store: &Store,
        images_before: Option<&crate::dir::Dir>,
    ) -> Vec<String> {
        let global = || store.global(None);
        let accepted =
            images_before.map(|b| crate::images_dir::accept_remade(store.root(), b, global));
        let remade = match accepted {
            Some(Ok(remade)) => remade,
            // Said, and nothing taken for deleted on its strength: the next look asks again.
            Some(Err(e)) => {
                store
                    .ctx()
                    .say(&format!("{e:#}; '{STOWAGE} init' records it"));
                return Vec::new();
            }
            None => false,
        };
        let entries = crate::census::take(store.root()).unwrap_or_default();
        forget_missing(store, entries, remade, |_| true)
    }
    /// Whether the hold was lost (`store.lock` dropped with the connection to the server, where it
    /// may be): `Some(cause)`. Image users may have come in meanwhile: nothing is done on its strength.
    pub fn lost(&self) -> Option<String> {
        self.guard.lost()
    }

    /// Ends a lost hold as a dead holder's ends: its hints stay (each image's next user clears its
    /// own, and takes a ready image whose tree is missing for gone), nothing is forgotten.
    pub fn end_lost(self, store: &Store) {
        drop(self.guard);
        crate::lease::forget(&store.root().leases(), Root::STORE_WIDE_LOCK_REL);
    }

    /// Ends the hold. If a process the command left still holds the inherited `store.lock`, the hold
    /// lasts until it ends (hints stay). Otherwise, with `store.lock` retaken, hints go from every
    /// lock file nobody holds (a held one's next holder clears it), then `store.lock`.
    pub fn release(self, store: &Store) {
        let root = store.root();
        let path = self.guard.path().to_owned();
        drop(self.guard);
        let Ok(Some(guard)) = lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Fail)
        else {
            crate::lease::forget(&root.leases(), Root::STORE_WIDE_LOCK_REL);
            return;
        };
        clear_free_hints(root);
        crate::lease::forget(&root.leases(), Root::STORE_WIDE_LOCK_REL);
        // Unlinked where allowed: until the next hold, a writer's ask is one failed open.
        let _ = root.unlink_lock(guard);
    }

    /// Ends a hold that never ran its command: its hints go from every lock file nobody holds while
    /// `store.lock` is still ours (the users waiting for it take it the moment it is let go, and a
    /// hint left then reads as a tree the command may have deleted), then as [`Hold::release`].
    fn abandon(self, store: &Store) {
        if self.lost().is_none() {
            clear_free_hints(store.root());
        }
        self.release(store);
    }
}

/// Takes the hint off every image lock file nobody holds (a held one's next holder clears it).
fn clear_free_hints(root: &Root) {
    for name in lock_file_names(root).unwrap_or_default() {
        let path = root.image_locks().join(&name);
        if let Ok(Some(g)) = lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Fail) {
            let _ = image_record::set_store_wide(g.file(), false);
        }
    }
}

/// What an ended hold could not forget (trees its command deleted while another held the image,
/// hints kept): forgotten by the next look at every image with no hold standing.
pub fn forget_left(store: &Store, entries: &[crate::census::Entry]) -> Vec<String> {
    let hinted: Vec<crate::census::Entry> = entries
        .iter()
        .filter(|e| e.seen.store_wide)
        .cloned()
        .collect();
    if hinted.is_empty() || probe(store.root()).ok() != Some(Probe::Free) {
        return Vec::new();
    }
    forget_missing(store, hinted, false, |seen| {
        seen.store_wide && probe(store.root()).ok() == Some(Probe::Free)
    })
}

/// Drops the records of ready images in `entries` whose trees are missing, each under its exclusive
/// lock (tried) if `still` holds of what it then says; none if the images directory looks unmounted
/// (unless `remade`: the command made it anew).
fn forget_missing(
    store: &Store,
    entries: Vec<crate::census::Entry>,
    remade: bool,
    still: impl Fn(&image_record::Seen) -> bool,
) -> Vec<String> {
    let root = store.root();
    let Ok(config) = crate::images_dir::config(root) else {
        return Vec::new();
    };
    let dir = config.images.path_in(root.dir());
    let missing_tree = |r: &image_record::Record| {
        r.state == crate::image_record::State::Ready
            && r.images == config.images
            && crate::name::ImageName::parse(&r.name)
                .is_ok_and(|n| crate::images_dir::nothing_at(root, &dir, n.encoded()))
    };
    let missing: Vec<crate::census::Entry> = entries
        .into_iter()
        .filter(|e| e.seen.record.as_ref().is_some_and(missing_tree))
        .collect();
    if missing.is_empty() {
        return Vec::new();
    }
    // A missing tree proves nothing where the directory is not the recorded one, or is empty while
    // images are recorded.
    // Through the root's descriptor: the root may have moved while the command ran.
    let empty = (root.open_images_dir(&dir).ok())
        .and_then(|d| d.names().ok())
        .is_some_and(|n| n.is_empty());
    let unusable = crate::images_dir::unmounted(root, &dir).or_else(|| {
        empty.then(|| {
            format!(
                "images directory {} is empty while images are recorded: is it mounted? (if their trees are really gone, '{STOWAGE} rm' the images)",
                dir.display()
            )
        })
    });
    if let Some(why) = unusable.filter(|_| !remade) {
        store
            .ctx()
            .say(&format!("not checking for deleted images: {why}"));
        return Vec::new();
    }
    let forget = |e: crate::census::Entry| {
        let name = crate::name::ImageName::parse(e.name()?).ok()?;
        let (g, seen) =
            lock::acquire_no_wait_with(&e.path, Mode::Exclusive, lock::IfMissing::Fail, |f| {
                image_record::read_proving(f, &e.path, name.as_str())
            })
            .ok()??;
        let gone = seen.record.as_ref().is_some_and(missing_tree) && still(&seen);
        (gone && root.drop_record(&name, g).is_ok()).then(|| name.as_str().to_owned())
    };
    missing.into_iter().filter_map(forget).collect()
}

/// Sets the hint on one lock file of the scan, unlocked: from now on its image's new users ask
/// `store.lock`. One gone meanwhile is nothing left to hold off.
fn hint(store: &Store, file: &str) -> Result<()> {
    let path = store.root().image_locks().join(file);
    let label = crate::root::lock_file_label(file);
    let err = |e| lock::error(&label, &path, e);
    if let Some(f) = lock::open_existing(&path).map_err(err)? {
        let _ = image_record::set_store_wide(&f, true);
    }
    Ok(())
}

/// One hinted lock file of the scan: take it (waiting if busy), hint again under the lock (a user
/// finding no hold may have cleared it), let go.
fn pass(store: &Store, file: &str, deadline: Option<Instant>, no_wait: bool) -> Result<()> {
    let root = store.root();
    let path = root.image_locks().join(file);
    let label = crate::root::lock_file_label(file);
    let err = |e| lock::error(&label, &path, e);
    let guard = match lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Fail) {
        Ok(Some(g)) => g,
        Ok(None) => match wait_for_image(store, &path, &label, deadline, no_wait) {
            Ok(g) => g,
            // Removed while we waited: nothing left to hold off.
            Err(e) if crate::root::is_missing(&e) => return Ok(()),
            Err(e) => return Err(e),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(err(e)),
    };
    image_record::set_store_wide(guard.file(), true).map_err(err)?;
    Ok(())
}

/// Waits for a busy image lock of the scan, unless our enclosing command (waiting for us) holds it.
fn wait_for_image(
    store: &Store,
    path: &std::path::Path,
    label: &str,
    deadline: Option<Instant>,
    no_wait: bool,
) -> Result<Guard> {
    let root = store.root();
    let rel = root.locks_rel(path);
    let what = format!("{label} to be released before the store-wide command");
    let never_ends = |held| crate::acquire::never_ends(what.clone(), held);
    let enclosing = crate::nested::enclosing(root);
    if let Some(held) = enclosing.hold(&rel) {
        return Err(never_ends(held));
    }
    // An enclosing exec that had not announced its lease: looked for again while we wait.
    let ours_now = || crate::nested::enclosing_now(root).hold(&rel);
    let refuse = no_wait.then(|| what.clone());
    let awaited = Holding::now(Mode::Exclusive, rel.clone(), true, "store-wide");
    let err = |e| lock::error(label, path, e);
    let got = wait_in_turn(store, what.clone(), refuse, deadline, awaited, |wait| {
        if enclosing.unannounced {
            wait.give_up = Some(Box::new(|| ours_now().is_some()));
        }
        lock::acquire(path, Mode::Exclusive, lock::IfMissing::Fail, wait).map_err(err)
    });
    if got.is_err()
        && enclosing.unannounced
        && let Some(held) = ours_now()
    {
        return Err(never_ends(held));
    }
    got
}

/// Waits, by `attempt`, for the lock file `awaited` lists in our lease (`store.lock`, `gc.lock` or
/// an image's), announced as `what`; with `refuse` (what is busy) it fails at once instead.
pub(crate) fn wait_in_turn<'a, T>(
    store: &Store,
    what: String,
    refuse: Option<String>,
    deadline: Option<Instant>,
    awaited: Holding,
    mut attempt: impl FnMut(&mut Wait<'a>) -> Result<Waited<T>>,
) -> Result<T> {
    let root = store.root();
    let rel = awaited.lockfile.clone();
    let path = root.locks().join(&rel);
    let (kind, dir, name) = match rel.strip_prefix("images/") {
        Some(file) => (
            LockKind::Image,
            root.image_locks(),
            crate::root::lock_file_label(file),
        ),
        None => (
            LockKind::Global,
            root.locks(),
            rel.trim_end_matches(".lock").to_owned(),
        ),
    };
    crate::debug::pause("store-wide-busy");
    let until = crate::holders::looked_for_until(deadline, refuse.is_some());
    let now = || crate::holders::holders_phrase(store.ctx(), kind, &path, false, until);
    let holders = now();
    // Freed while we looked (see `image::wait_taking`): one more try before saying we wait.
    let mut once = Wait {
        deadline: Some(Instant::now()),
        ..Wait::default()
    };
    if let Waited::Acquired(got) = attempt(&mut once)? {
        return Ok(got);
    }
    if let Some(busy) = refuse {
        return Err(Busy::now(busy, holders).into());
    }
    let shown = path.clone();
    let report = move |look: &crate::holders::Look| look.report(kind, &name, &shown);
    let _line = crate::wait_line::announce(store.ctx(), &what, &holders, Some(Box::new(report)));
    let mut wait = Wait::on(&dir, deadline);
    crate::acquire::wait_for(store, awaited, &[], what, now, move || attempt(&mut wait))
}

/// `store.lock` as our lease names it: held, or awaited, in `mode`.
fn store_lock_holding(mode: Mode, awaits: bool, command: &str) -> Holding {
    Holding::now(mode, Root::STORE_WIDE_LOCK_REL.into(), awaits, command)
}

/// The image lock files (`*.lock`, regular) in `locks/images/`.
fn lock_file_names(root: &Root) -> Result<Vec<String>> {
    let Some(dir) = root.open_sub_if_there(Root::IMAGE_LOCKS_REL)? else {
        return Ok(Vec::new());
    };
    let listing = dir.listing();
    let listing =
        listing.with_context(|| format!("cannot list {}", root.image_locks().display()))?;
    Ok(crate::census::lock_file_names(listing))
}

/// Clears a dead hold's hints on images the caller holds, once `store.lock` was found free.
pub fn clear_hints<'a>(files: impl IntoIterator<Item = &'a std::fs::File>) {
    for f in files {
        let _ = image_record::set_store_wide(f, false);
    }
}
