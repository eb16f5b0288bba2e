//! Garbage collection: make room without ever touching an image in use.
//!
//! In order, gc removes:
//! 1. leftovers of interrupted removals (records left `deleting`, the trash);
//! 2. incomplete images whose record says their writer failed or died;
//! 3. with `--unused-for D`, ready images not used for D;
//! 4. with `--max-size S`, least recently used images until the images fit S.
//!
//! - **Only on positive evidence.** An image whose state is not known (a damaged record, a tree
//!   adopted without one) is kept and reported.
//! - Every image is removed under its exclusive lock, taken without waiting (a busy image is
//!   skipped, however old), its record read again under it: a reason that stopped holding keeps it.
//!   One a waiting command's lease lists as one it will take is in use too.
//! - Sizes are allocated blocks, hard links once; `--max-size` is the space the images take (each
//!   shared extent and linked inode once); an image whose removal would free nothing is not
//!   removed for the budget. What a removal frees is what `df` gets back: once anything goes,
//!   every image is measured afresh, so blocks another image, or a name outside, keeps are not
//!   counted.
//! - `--dry-run` changes nothing and takes no lock of an image (of a crashed removal, a moment's):
//!   the same decisions, from locks looked at.
//! - One gc removes at a time (`locks/gc.lock`, waited for holding nothing): two at once would each
//!   remove down to the budget, counting the other's victims as staying. An image another process
//!   removed since the survey, or is removing (its record says `deleting`), counts as gone.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Result;
use serde::Serialize;

use crate::acquire::image::Held;
use crate::census::Entry;
use crate::clock::{self, Millis};
use crate::ctx::Ctx;
use crate::disk_usage::{self, Shares};
use crate::image_record::State;
use crate::lease::{Holding, Named};
use crate::lock::{self, Mode};
use crate::name::ImageName;
use crate::remove;
use crate::store::Store;
use crate::survey::Image;

/// What to remove beyond incomplete images.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub max_size: Option<u64>,
    pub unused_for: Option<Duration>,
    pub dry_run: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reason {
    Incomplete,
    /// Not used for longer than `--unused-for`.
    Unused,
    /// Least recently used while the images exceed `--max-size`.
    OverBudget,
}

impl Reason {
    /// Why, in words: "removed 'a' (incomplete, 4 KiB): its writer failed or died".
    pub fn describe(self) -> &'static str {
        match self {
            Reason::Incomplete => "its writer failed or died",
            Reason::Unused => "unused",
            Reason::OverBudget => "least recently used, over budget",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Collected {
    pub name: String,
    pub state: &'static str,
    pub size_bytes: u64,
    pub reason: Reason,
    /// Its tree is left in the trash: nothing freed yet.
    #[serde(skip)]
    pub left_in_trash: bool,
}

/// Also `gc --json`, field for field.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub dry_run: bool,
    pub removed: Vec<Collected>,
    /// Images that qualified but were in use (locked, or listed by a waiting command as one it
    /// will take), and so kept.
    pub busy: Vec<String>,
    /// Those of `busy` kept only for a waiting command (lock-status shows it as queued).
    pub queued: Vec<String>,
    pub bytes_freed: u64,
    pub size_before: u64,
    pub size_after: u64,
    pub max_size: Option<u64>,
    pub unused_for_seconds: Option<u64>,
    /// Interrupted removals finished and trash entries deleted.
    pub interrupted_removals: Vec<String>,
    pub trash_entries: usize,
    /// Removals that failed (the images keep their state), one line each.
    pub failed: Vec<String>,
    /// Kept because their state is unknown (damaged record, tree adopted without one, tree whose
    /// lock file is missing or holds no record): `name: why`.
    pub unknown: Vec<String>,
    /// Removed images whose emptied lock file could not be unlinked, one line each.
    pub lock_files_left: Vec<String>,
    /// Images whose modes lent by a killed copy were restored.
    pub loans_restored: Vec<String>,
    /// Images whose lent modes a restore was refused (another user's loans: that user or root
    /// must act), `name: why`.
    pub loans_left: Vec<String>,
    /// Whether the images were measured: not where their directory could not be judged, and
    /// then `size_before` and `size_after` say nothing.
    pub measured: bool,
    /// The sizes are those recorded, image by image, added up (nothing went, no budget was
    /// exceeded): a file linked into several images counts in each, so they are at most that.
    pub sizes_as_recorded: bool,
}

impl Report {
    /// Says `name` kept in use once, however many reasons it qualified for.
    fn kept_busy(&mut self, name: &str) {
        if !self.busy.iter().any(|n| n == name) {
            self.busy.push(name.to_owned());
        }
    }
}

pub fn run(store: &mut Store, policy: &Policy) -> Result<Report> {
    // gc locks images: its lease names it to lock-status meanwhile.
    let _alone = match policy.dry_run {
        true => None,
        false => {
            let _ = crate::lease::introduce(&store.root().leases());
            let alone = take_gc_lock(store)?;
            crate::migrate::if_needed(store, None)?;
            Some(alone)
        }
    };
    let mut report = Report {
        dry_run: policy.dry_run,
        max_size: policy.max_size,
        unused_for_seconds: policy.unused_for.map(|d| d.as_secs()),
        ..Report::default()
    };
    finish_interrupted(store, policy.dry_run, &mut report)?;
    let mut rows = crate::survey::survey(store, true)?;
    let config = crate::images_dir::config(store.root())?;
    let images_dir = config.images.path_in(store.root().dir());
    if let Some(why) = crate::images_dir::not_usable(store.root(), &images_dir) {
        report.failed.push(format!("no image removed: {why}"));
        return Ok(report);
    }
    // Kept and reported, but counted: they take room in the images directory.
    let unlisted = crate::survey::unlisted(store.root(), &rows);
    rows.retain(|i| i.state != State::Deleting);
    let elsewhere = take_elsewhere(store.root(), &config, &mut rows);
    let cutoff = cutoff(policy);
    // An image that goes for a reason of its own counts what its removal frees (module doc).
    let going = rows
        .iter()
        .any(|r| qualifies(r, Reason::Incomplete, cutoff) || qualifies(r, Reason::Unused, cutoff));
    let shares = (policy.max_size.is_some() || going) && disk_usage::can_share(&images_dir);
    let mut budget = Budget::new(store, &rows, &unlisted, shares, going)?;
    budget.tell(&mut report);
    report.unknown = unknown(&rows, &unlisted);
    report.unknown.extend(elsewhere);
    crate::debug::pause("gc-listed");
    rows.sort_by(oldest_first);
    for reason in [Reason::Incomplete, Reason::Unused] {
        let (these, rest): (Vec<Image>, Vec<Image>) =
            rows.into_iter().partition(|r| qualifies(r, reason, cutoff));
        rows = rest;
        for r in these {
            crate::signals::check()?;
            if !collect(store, &r, reason, cutoff, &mut budget, &mut report)? {
                rows.push(r);
            }
        }
        rows.sort_by(oldest_first);
    }
    if let Some(max) = policy.max_size {
        // Sizes measured apart count a file linked into two images twice: where not every image was
        // measured together, each left is now, each inode once, before any goes for the budget.
        if budget.total > max && !shares && !going {
            let gone = report.size_before.saturating_sub(budget.total);
            budget = Budget::new(store, &rows, &unlisted, shares, true)?;
            report.size_before = budget.total + gone;
            report.sizes_as_recorded = false;
        }
        over_budget(store, rows, max, cutoff, &mut budget, &mut report)?;
    }
    report.size_after = budget.total;
    if !policy.dry_run {
        crate::space::refill(&store.root().reserve());
    }
    let freed = report.removed.iter().filter(|r| !r.left_in_trash);
    report.bytes_freed += freed.map(|r| r.size_bytes).sum::<u64>();
    Ok(report)
}

/// Removes ready images, least recently used first, until the budget fits; an image held for
/// writing or creating is never one, yet said as kept in use where the budget still does not fit.
fn over_budget(
    store: &mut Store,
    mut rows: Vec<Image>,
    max: u64,
    cutoff: Option<Millis>,
    budget: &mut Budget,
    report: &mut Report,
) -> Result<()> {
    let held: Vec<String> = (rows.iter())
        .filter(|r| matches!(r.state, State::Writing | State::Creating))
        .map(|r| r.name().to_owned())
        .collect();
    // Least recently used first, passing over one whose removal would free nothing now.
    rows.retain(|r| r.state == State::Ready);
    while budget.total > max && !rows.is_empty() {
        crate::signals::check()?;
        let i = rows.iter().position(|r| budget.frees(r) > 0).unwrap_or(0);
        let (r, reason) = (rows.remove(i), Reason::OverBudget);
        collect(store, &r, reason, cutoff, budget, report)?;
    }
    if budget.total > max {
        held.iter().for_each(|n| report.kept_busy(n));
    }
    Ok(())
}

/// `locks/gc.lock`, waited for (holding nothing) while another gc removes, named in our lease.
fn take_gc_lock(store: &Store) -> Result<lock::Guard> {
    let root = store.root();
    let path = root.gc_lock();
    let err = |e| lock::error("the gc lock", &path, e);
    let hold = |awaits| {
        let rel = crate::root::Root::GC_LOCK_REL.to_owned();
        crate::lease::Holding::now(Mode::Exclusive, rel, awaits, "stowage gc")
    };
    let create = lock::IfMissing::Create;
    let guard = match lock::acquire_no_wait(&path, Mode::Exclusive, create).map_err(err)? {
        Some(g) => g,
        None => {
            let what = "the gc lock (another gc removes images)".to_owned();
            crate::store_wide::wait_in_turn(store, what, None, None, hold(true), |wait| {
                lock::acquire(&path, Mode::Exclusive, create, wait).map_err(err)
            })?
        }
    };
    crate::lease::note(&root.leases(), hold(false));
    Ok(guard)
}

/// Takes out of `rows` the images whose records name another images directory than the store's
/// (nothing there is ours to remove): kept, and said.
fn take_elsewhere(
    root: &crate::root::Root,
    config: &crate::config::Config,
    rows: &mut Vec<Image>,
) -> Vec<String> {
    let (elsewhere, ours) = std::mem::take(rows)
        .into_iter()
        .partition(|r: &Image| r.record.images != config.images);
    *rows = ours;
    let said = |r: &Image| {
        let theirs = r.record.images.path_in(root.dir());
        let theirs = theirs.display();
        format!(
            "{}: its record names images directory {theirs}, not the store's",
            r.name()
        )
    };
    elsewhere.iter().map(said).collect()
}

/// The images whose state cannot be known, kept and said: a record that cannot be read, a tree
/// adopted without one, a tree no record names.
fn unknown(rows: &[Image], unlisted: &[crate::survey::Unlisted]) -> Vec<String> {
    let recorded = rows
        .iter()
        .filter(|r| r.state == State::Incomplete && r.record.readiness_unknown())
        .map(|r| match (r.entry.seen.newer, r.entry.seen.damaged) {
            (Some(format), _) => format!(
                "{}: its record is of a later format ({format}): a newer stowage's image",
                r.name()
            ),
            (None, true) if r.entry.planted => {
                format!("{}: its lock file is no regular file", r.name())
            }
            (None, true) => format!("{}: its record cannot be read", r.name()),
            (None, false) => format!("{}: its tree was adopted without a record", r.name()),
        });
    let unrecorded = unlisted.iter().map(|u| format!("{}: {}", u.name, u.why));
    recorded.chain(unrecorded).collect()
}

/// What the images take, and what removing one frees: its own blocks and unshared extents.
struct Budget {
    cost: HashMap<String, Cost>,
    footprint: disk_usage::Footprint,
    total: u64,
    /// Every image measured together, each inode and shared extent once (else sizes as recorded).
    together: bool,
}

impl Budget {
    /// What each unlisted tree (never removed, it counts all the same) and image takes, measured
    /// where not known (always, for a tree), where extents may be shared, or `fresh`.
    fn new(
        store: &Store,
        rows: &[Image],
        unlisted: &[crate::survey::Unlisted],
        shares: bool,
        fresh: bool,
    ) -> Result<Budget> {
        let mut cost = HashMap::new();
        let unlisted = unlisted
            .iter()
            .map(|u| (u.name.as_str(), u.tree.clone(), None));
        let rows = rows.iter().map(|r| {
            let tree = crate::images_dir::tree_of(store.root(), &r.record);
            (r.name(), tree, r.size)
        });
        for (name, tree, size) in unlisted.chain(rows) {
            crate::signals::check()?;
            let measured =
                (fresh || shares || size.is_none()).then(|| disk_usage::measure(&tree, shares));
            let kept = size.unwrap_or(0);
            let (own, shares) = match measured.and_then(Result::ok) {
                // Seen in part (a directory we may not read): a size kept whole says more.
                Some(m) if m.partial => (m.own().max(kept), m.shares),
                Some(m) => (m.own(), m.shares),
                None => (kept, Shares::default()),
            };
            cost.insert(name.to_owned(), Cost { own, shares });
        }
        let footprint = disk_usage::Footprint::new(cost.values().map(|c| &c.shares));
        let total = cost.values().map(|c| c.own).sum::<u64>() + footprint.bytes();
        Ok(Budget {
            cost,
            footprint,
            total,
            together: fresh || shares,
        })
    }

    /// Says what the images take before anything goes, and how it was counted.
    fn tell(&self, report: &mut Report) {
        (report.size_before, report.measured) = (self.total, true);
        report.sizes_as_recorded = !self.together;
    }

    fn frees(&self, r: &Image) -> u64 {
        self.cost
            .get(r.name())
            .map_or(0, |c| c.own + self.footprint.unique(&c.shares))
    }

    fn removed(&mut self, r: &Image, bytes: u64) {
        self.total = self.total.saturating_sub(bytes);
        if let Some(c) = self.cost.get(r.name()) {
            self.footprint.release(&c.shares);
        }
    }
}

/// The last use before which an image is unused for `--unused-for D`: a read records its use only
/// when the recorded one is older than the resolution, so D plus the resolution. Saturating.
fn cutoff(policy: &Policy) -> Option<Millis> {
    let resolution = crate::image_record::last_use_resolution().as_millis() as Millis;
    policy.unused_for.map(|d| {
        let ms = Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX);
        clock::now_ms()
            .saturating_sub(ms)
            .saturating_sub(resolution)
    })
}

/// Whether an image qualifies for removal for `reason`, by what its record says: an incomplete one
/// only if its writer failed or died (an adopted tree of unknown readiness is no evidence).
fn qualifies(r: &Image, reason: Reason, cutoff: Option<Millis>) -> bool {
    match reason {
        Reason::Incomplete => r.state == State::Incomplete && !r.record.readiness_unknown(),
        Reason::Unused => r.state == State::Ready && cutoff.is_some_and(|c| r.last_used < c),
        Reason::OverBudget => r.state == State::Ready,
    }
}

/// Finishes removals a crash cut short (records left `deleting`, lock free); empties the trash.
fn finish_interrupted(store: &mut Store, dry_run: bool, report: &mut Report) -> Result<()> {
    let root = store.root().clone();
    let entries = crate::census::take(&root)?;
    crate::debug::pause("interrupted-listed");
    let done = finish_removals(store.ctx(), &entries, true, !dry_run);
    // A busy one is finished by the next gc, said as any image in use.
    (report.interrupted_removals, report.busy, report.failed) =
        (done.finished, done.busy, done.failed);
    report.bytes_freed += done.bytes;
    let trash = remove::empty_trash(&root, !dry_run)?;
    report.trash_entries = trash.entries.len();
    report.bytes_freed += trash.bytes;
    report.failed.extend(trash.failed);
    let (restored, left) = restore_loans(&root, &entries, !dry_run);
    report.loans_restored = restored;
    // Said where a restore was tried and refused; one not tried (a dry run, a copy at work) is not.
    let refused = left
        .into_iter()
        .filter_map(|(n, why)| Some(format!("{n}: {}", why?)));
    report.loans_left = refused.collect();
    Ok(())
}

/// Images whose trees keep modes a killed copy lent (`loan.rs`), by name: those restored (with
/// `restore`, where no copy of the image runs and nobody writes it), and those left, each with why
/// where a restore was tried and refused (another user's loans: that user must act).
pub(crate) fn restore_loans(
    root: &crate::root::Root,
    entries: &[Entry],
    restore: bool,
) -> (Vec<String>, Vec<(String, Option<String>)>) {
    let (mut restored, mut left) = (Vec::new(), Vec::new());
    let lenders = crate::loan::lenders_beside(&root.image_locks());
    for e in entries {
        let Some(r) = e.seen.record.as_ref() else {
            continue;
        };
        let Ok(name) = ImageName::parse(&r.name) else {
            continue;
        };
        let lend = root.image_lend(&name);
        // A loan under way is its copy's (held exclusively). A journal the lend file does not
        // name counts too (any member may write it; an older release drops its uid lines).
        let live = || lock::probe(&lend).is_ok_and(|p| p == lock::Probe::Exclusive);
        let named = std::fs::metadata(&lend).is_ok_and(|m| m.len() > 0);
        if !(named || lenders.iter().any(|u| crate::loan::has_loans(&lend, *u))) || live() {
            continue;
        }
        let done = restore
            .then(|| {
                let read = (Mode::Shared, lock::IfMissing::Fail);
                let _read = lock::acquire_no_wait(&e.path, read.0, read.1).ok()??;
                // The tree where its record says (checked as a command's).
                let images = crate::images_dir::for_command(root, r).ok()?;
                let dir = root.open_images_dir(&images).ok()?;
                let tree = dir.sub(name.encoded()).ok()?;
                Some(crate::loan::restore_left(&lend, &tree))
            })
            .flatten();
        match done {
            Some(Ok(true)) => restored.push(name.to_string()),
            Some(Err(why)) => left.push((name.to_string(), Some(why.to_string()))),
            // Not tried: why a try would leave them too, where known, so none is promised.
            None if !restore => left.push((name.to_string(), crate::loan::left_why(&lend))),
            _ => left.push((name.to_string(), None)),
        }
    }
    (restored, left)
}

/// What became of the interrupted removals a repair (gc's, doctor's) took on.
#[derive(Default)]
pub(crate) struct Removals {
    pub finished: Vec<String>,
    /// Freed deleting trees in place (the trash counts its own); unfinished, what that would free.
    pub bytes: u64,
    pub busy: Vec<String>,
    /// Another process (its remover) is at it.
    pub underway: Vec<String>,
    /// One line each, naming the image.
    pub failed: Vec<String>,
}

/// Takes (if `take`) and finishes (if `finish`) each interrupted removal `entries` show.
pub(crate) fn finish_removals(ctx: &Ctx, entries: &[Entry], take: bool, finish: bool) -> Removals {
    let mut out = Removals::default();
    for name in interrupted(entries) {
        let said = name.as_str().to_owned();
        // Not taken, a lock is asked as a busy one is: under way or not.
        let taken = take.then(|| take_to_repair(ctx, &name));
        match taken.unwrap_or(Taken::Busy) {
            Taken::Held(h) if deleting(&h.seen) => {
                let _named = named_hold(&ctx.root, &name, "stowage (finishing a removal)");
                let done = match finish {
                    true => remove::finish_held(&ctx.root, *h),
                    false => Ok(would_free(&ctx.root, &h)),
                };
                match done {
                    Ok(bytes) => {
                        out.bytes += bytes;
                        out.finished.push(said);
                    }
                    Err(e) => out
                        .failed
                        .push(format!("cannot finish the removal of '{name}': {e:#}")),
                }
            }
            // Busy: its remover may be at it, or it finished meanwhile.
            Taken::Busy => match underway(ctx, &name) {
                Some(true) => out.underway.push(said),
                Some(false) => out.busy.push(said),
                None => {}
            },
            Taken::Failed(e) => {
                let said = format!("cannot finish the removal of '{name}': {e}");
                out.failed.push(said);
            }
            // Finished or written anew since the census.
            Taken::Held(_) | Taken::Gone => {}
        }
    }
    out
}

/// What finishing the removal `held` would free: its tree deleted from the images directory (a
/// tree already in the trash counts with the trash), and its lock file.
fn would_free(root: &crate::root::Root, held: &Held) -> u64 {
    let Some(record) = held.seen.record.as_ref() else {
        return 0;
    };
    let tree = crate::images_dir::tree_of(root, record);
    let lock_file = disk_usage::blocks_of(held.guard.file());
    disk_usage::freed_by_deleting(&tree).unwrap_or(0) + lock_file
}

/// The images whose records `entries` show `deleting`: removals under way or interrupted.
fn interrupted(entries: &[Entry]) -> impl Iterator<Item = ImageName> + '_ {
    let marked = entries.iter().filter(|e| deleting(&e.seen));
    marked.filter_map(|e| ImageName::parse(e.name()?).ok())
}

fn deleting(seen: &crate::image_record::Seen) -> bool {
    matches!(&seen.record, Some(r) if r.state == State::Deleting)
}

/// Whether image `name`, whose lock at `path` is busy, is being removed: its record (read without
/// the lock, as a reader's look does) says `deleting`, or it is gone already.
fn being_removed(path: &std::path::Path, name: &ImageName) -> bool {
    record_says_deleting(path, name).unwrap_or(true)
}

/// Whether the record in image `name`'s lock file at `path`, read without its lock, says
/// `deleting` (`false` where it cannot be read); `None` if the file is gone.
fn record_says_deleting(path: &std::path::Path, name: &ImageName) -> Option<bool> {
    match lock::open_existing_read(path) {
        Ok(Some(f)) => {
            Some(crate::image_record::read_of(&f, name.as_str()).is_ok_and(|s| deleting(&s)))
        }
        Ok(None) => None,
        Err(_) => Some(false),
    }
}

/// What a repair (gc's, doctor's) finds when it takes an image's lock.
pub(crate) enum Taken {
    Held(Box<Held>),
    /// Its lock is held, or a store-wide command holds the store: left for later, and said.
    Busy,
    /// Gone since it was listed (its removal finished).
    Gone,
    /// Its lock file cannot be taken (permissions, a planted file): said, never taken for gone.
    Failed(std::io::Error),
}

/// Our lease naming our exclusive hold of `name`'s lock while a repair or gc judges it.
pub(crate) fn named_hold(root: &crate::root::Root, name: &ImageName, what: &str) -> Named {
    let rel = crate::root::Root::image_lock_rel(name);
    Named::new(
        &root.leases(),
        Holding::now(Mode::Exclusive, rel, false, what),
    )
}

/// [`take_exclusive`] of an existing lock file, for a repair.
pub(crate) fn take_to_repair(ctx: &Ctx, name: &ImageName) -> Taken {
    let root = &ctx.root;
    match take_exclusive(root, name, lock::IfMissing::Fail) {
        Ok(Some(h)) if crate::store_wide::blocks(root, &h.seen) => Taken::Busy,
        Ok(Some(h)) => Taken::Held(Box::new(h)),
        Ok(None) => Taken::Busy,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Taken::Gone,
        Err(e) => Taken::Failed(e),
    }
}

/// Whether image `name`'s removal is under way: `Some(true)` while a stowage process holds its lock
/// exclusively, `Some(false)` if not, `None` once finished (no lock file, or no longer `deleting`).
fn underway(ctx: &Ctx, name: &ImageName) -> Option<bool> {
    let path = ctx.root.image_lock(name);
    // Asked, not tried, where queries see flocks: a try would be a holder to another host's look.
    let live = match lock::look(&path, ctx.root.lock_queries()) {
        Ok(lock::Probe::Missing) => return None,
        Ok(lock::Probe::Exclusive) => {
            crate::debug::pause("underway-probed");
            let kind = crate::holders::LockKind::Image;
            let r = crate::holders::Look::new(ctx).report(kind, name.as_str(), &path);
            // A live stowage process (a dead one's lease, no pid, explains an inheritor's hold).
            r.holders
                .iter()
                .any(|h| h.stowage == Some(true) && h.pid.is_some())
        }
        _ => false,
    };
    // Finished meanwhile: its lock file gone, or its record no longer `deleting`.
    (record_says_deleting(&path, name) == Some(true)).then_some(live)
}

/// An image's lock taken exclusively without waiting (`None`: busy), its record read under it.
pub(crate) fn take_exclusive(
    root: &crate::root::Root,
    name: &ImageName,
    missing: lock::IfMissing,
) -> std::io::Result<Option<Held>> {
    let path = root.image_lock(name);
    let read = |f: &std::fs::File| crate::image_record::read_proving(f, &path, name.as_str());
    let taken = lock::acquire_no_wait_with(&path, Mode::Exclusive, missing, read)?;
    Ok(taken.map(|(guard, seen)| Held {
        name: name.clone(),
        guard,
        seen,
        under: false,
    }))
}

/// What an image takes on the filesystem beyond what it shares.
struct Cost {
    own: u64,
    shares: Shares,
}

/// Least recently used first; by name among equals, so runs repeat.
fn oldest_first(a: &Image, b: &Image) -> std::cmp::Ordering {
    a.last_used
        .cmp(&b.last_used)
        .then_with(|| a.name().cmp(b.name()))
}

/// Removes one image if its lock is free and its reason still holds under it: whether removed.
fn collect(
    store: &mut Store,
    img: &Image,
    reason: Reason,
    cutoff: Option<Millis>,
    budget: &mut Budget,
    report: &mut Report,
) -> Result<bool> {
    let bytes = budget.frees(img);
    let Ok(name) = ImageName::parse(img.name()) else {
        return Ok(false);
    };
    let root = store.root().clone();
    let path = root.image_lock(&name);
    let Some((hold, now)) = take_for_collect(&root, &name, img, bytes, budget, report)? else {
        return Ok(false);
    };
    let _named = matches!(hold, Hold::Taken(_)).then(|| named_hold(&root, &name, "stowage gc"));
    // A store-wide command holds the store: kept, as an image in use is.
    if crate::store_wide::blocks(&root, hold.seen()) {
        report.kept_busy(img.name());
        return Ok(false);
    }
    // The record read under the lock is the truth (a write in flight is dead); last use as the
    // survey has it, bounded by when the lock file was written since. Not told why not: kept, as nothing shows it unused.
    let Ok(written) = crate::planted::check_dated(&path, hold.file()) else {
        return Ok(false);
    };
    let recorded = hold.seen().last_use.unwrap_or(now.changed).max(now.changed);
    let mut entry = img.entry.clone();
    entry.written = written;
    let current = Image {
        state: now.state_seen(false),
        last_used: crate::image_record::last_use(recorded, written),
        record: now,
        entry,
        ..img.clone()
    };
    if !qualifies(&current, reason, cutoff)
        || (reason == Reason::OverBudget && current.last_used != img.last_used)
    {
        return Ok(false);
    }
    crate::debug::pause("gc-judged");
    // Its lock file goes too, unless it must be left: `df` gets that back as well.
    let mut lock_bytes = disk_usage::blocks_of(hold.file());
    let mut left_in_trash = false;
    if let Hold::Taken(held) = hold {
        match remove_named(&root, held, &name, bytes, report) {
            Some((left, lock_file_gone)) => {
                left_in_trash = left;
                lock_bytes *= u64::from(lock_file_gone);
            }
            None => return Ok(false),
        }
    }
    report.bytes_freed += lock_bytes;
    report.removed.push(Collected {
        name: img.name().to_owned(),
        state: current.state.as_str(),
        size_bytes: bytes,
        reason,
        left_in_trash,
    });
    budget.removed(img, bytes);
    Ok(true)
}

/// An image as [`collect`] judges it: its lock held for the removal, or in a dry run only looked at
/// (a lock a dry run took would make a real gc, or a command that does not wait, find it busy).
enum Hold {
    Taken(Held),
    Looked(std::fs::File, crate::image_record::Seen),
}

impl Hold {
    fn file(&self) -> &std::fs::File {
        match self {
            Hold::Taken(held) => held.guard.file(),
            Hold::Looked(file, _) => file,
        }
    }

    fn seen(&self) -> &crate::image_record::Seen {
        match self {
            Hold::Taken(held) => &held.seen,
            Hold::Looked(_, seen) => seen,
        }
    }
}

/// Image `name`'s lock taken (looked at, in a dry run), its record read; `None` where it is busy
/// (said), or gone or going by another's hand since the survey (gone from the budget, not ours).
fn take_for_collect(
    root: &crate::root::Root,
    name: &ImageName,
    img: &Image,
    bytes: u64,
    budget: &mut Budget,
    report: &mut Report,
) -> Result<Option<(Hold, crate::image_record::Record)>> {
    let path = root.image_lock(name);
    let gone = |budget: &mut Budget| {
        budget.removed(img, bytes);
        Ok(None)
    };
    let taken = match report.dry_run {
        true => look_at(root, name),
        false => take_for_removal(root, name).map(|h| h.map(Hold::Taken)),
    };
    let hold = match taken {
        Ok(Some(h)) => h,
        Ok(None) if being_removed(&path, name) => return gone(budget),
        Ok(None) => {
            report.kept_busy(img.name());
            return Ok(None);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return gone(budget),
        Err(e) => return Err(lock::error(&format!("image '{name}'"), &path, e)),
    };
    // A command waiting for its slot or another lock will take it: in use, as a held one is.
    if crate::lease::awaited(&root.leases(), &crate::root::Root::image_lock_rel(name)) {
        report.kept_busy(img.name());
        report.queued.push(img.name().to_owned());
        return Ok(None);
    }
    match hold.seen().record.clone() {
        Some(now) => Ok(Some((hold, now))),
        None => gone(budget),
    }
}

/// [`take_exclusive`] for a removal, once more a moment later if busy: a look that cannot ask the
/// kernel (a dry run's, another host's) holds a lock for that moment.
fn take_for_removal(root: &crate::root::Root, name: &ImageName) -> std::io::Result<Option<Held>> {
    match take_exclusive(root, name, lock::IfMissing::Fail)? {
        Some(held) => Ok(Some(held)),
        None => {
            std::thread::sleep(Duration::from_millis(2));
            take_exclusive(root, name, lock::IfMissing::Fail)
        }
    }
}

/// A dry run's [`take_exclusive`]: whether the lock is held, asked without taking it (of the
/// kernel's lock table where it shows every holder, else a query, else a try let go at once), and
/// the record read beside it.
fn look_at(root: &crate::root::Root, name: &ImageName) -> std::io::Result<Option<Hold>> {
    let path = root.image_lock(name);
    let gone = || std::io::Error::from(std::io::ErrorKind::NotFound);
    let file = lock::open_existing_read(&path)?.ok_or_else(gone)?;
    let held = match kernel_shows_held(root, &file) {
        Some(held) => held,
        None => match lock::look(&path, root.lock_queries())? {
            lock::Probe::Missing => return Err(gone()),
            lock::Probe::Free => false,
            lock::Probe::Shared | lock::Probe::Exclusive => true,
        },
    };
    if held {
        return Ok(None);
    }
    let seen = crate::image_record::read_of(&file, name.as_str()).unwrap_or_default();
    Ok(Some(Hold::Looked(file, seen)))
}

/// Whether the kernel's lock table shows `file` locked; `None` where it cannot tell (a filesystem
/// not local, a pid namespace whose table leaves holders out).
fn kernel_shows_held(root: &crate::root::Root, file: &std::fs::File) -> Option<bool> {
    use std::os::unix::fs::MetadataExt;
    let local = root.filesystem_now().is_some_and(|f| f.local);
    if !local || !crate::kernel::shows_every_holder() {
        return None;
    }
    let dev = crate::kernel::device_of(&root.locks())?;
    let ino = file.metadata().ok()?.ino();
    let table = crate::kernel::read_table().ok()?;
    Some(
        table
            .get(&(dev, ino))
            .is_some_and(|es| es.iter().any(|e| !e.blocked)),
    )
}

/// Removes `name`, named by our lease while it goes (on another host nothing else names a
/// removal's holder): whether its tree is left in the trash, and whether its lock file went;
/// `None` if it failed (reported).
fn remove_named(
    root: &crate::root::Root,
    held: Held,
    name: &ImageName,
    bytes: u64,
    report: &mut Report,
) -> Option<(bool, bool)> {
    crate::debug::pause("gc-rechecked");
    let rel = crate::root::Root::image_lock_rel(name);
    let hold = crate::lease::Holding::now(Mode::Exclusive, rel.clone(), false, "stowage gc");
    crate::lease::note(&root.leases(), hold);
    let removed = remove::remove_held(root, held, Some(bytes));
    crate::lease::forget(&root.leases(), &rel);
    match removed {
        Ok(done) => {
            let left = done.left_in_trash.is_some();
            let lock_file_gone = done.lock_file_left.is_none();
            report.failed.extend(done.left_in_trash);
            report.lock_files_left.extend(done.lock_file_left);
            Some((left, lock_file_gone))
        }
        Err(e) => {
            report
                .failed
                .push(format!("image '{name}' not removed: {e:#}"));
            None
        }
    }
}

/// Why a size does not parse.
#[derive(Debug, PartialEq, Eq)]
pub enum BadSize {
    /// A number other than 0 without a unit: bytes need `B` (a forgotten `G` must not empty the
    /// store).
    NoUnit,
    /// More bytes than 64 bits count.
    TooLarge,
    /// Not a size.
    Invalid,
}

/// Parses a size: a number, blanks allowed, and a unit — `B` for bytes (a whole number), or K M G T
/// P E (powers of 1024) with `B` or `iB` optional after it — in any case (`4096B`, `5k`, `500MB`,
/// `2GiB`, `1.5T`); `0` needs none. Integer arithmetic: a byte count is exact, a fraction of a unit
/// is rounded down to whole bytes.
pub fn parse_size(raw: &str) -> Result<u64, BadSize> {
    let s = raw.trim();
    let end = (s.find(|c: char| !(c.is_ascii_digit() || c == '.'))).unwrap_or(s.len());
    let (number, unit) = s.split_at(end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if fraction.contains('.') || (whole.is_empty() && fraction.is_empty()) {
        return Err(BadSize::Invalid);
    }
    let zero = |digits: &str| digits.bytes().all(|b| b == b'0');
    let power = match unit.trim_start().to_ascii_uppercase().as_str() {
        "" if zero(whole) && zero(fraction) => return Ok(0),
        "" => return Err(BadSize::NoUnit),
        "B" if zero(fraction) => 0,
        "B" => return Err(BadSize::Invalid),
        u => match u.split_at_checked(1) {
            Some((first, "" | "B" | "IB")) if let Some(i) = "KMGTPE".find(first) => {
                10 * (i as u32 + 1)
            }
            _ => return Err(BadSize::Invalid),
        },
    };
    let unit = 1u128 << power;
    // Digits past the 19th are worth less than a byte of any unit.
    let fraction = &fraction[..fraction.len().min(19)];
    let tenths = 10u128.pow(fraction.len() as u32);
    // Digits only (checked above): a number that does not parse is too long.
    let number = |digits: &str| match digits {
        "" => Some(0),
        d => d.parse::<u128>().ok(),
    };
    let (Some(whole), Some(part)) = (number(whole), number(fraction)) else {
        return Err(BadSize::TooLarge);
    };
    let bytes = (whole.checked_mul(unit)).and_then(|b| b.checked_add(part * unit / tenths));
    bytes
        .and_then(|b| u64::try_from(b).ok())
        .ok_or(BadSize::TooLarge)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        let ok = |raw: &str, bytes: u64| assert_eq!(parse_size(raw), Ok(bytes), "{raw}");
        ok("4096B", 4096);
        ok("500M", 500 << 20);
        ok("20G", 20 << 30);
        ok("1.5K", 1536);
        ok("2GiB", 2 << 30);
        ok("3 MB", 3 << 20);
        ok("0", 0);
        ok("5b", 5);
        ok("5kb", 5 << 10);
        ok("5k", 5 << 10);
        ok("5KIB", 5 << 10);
        ok("1E", 1 << 60);
        ok(".5K", 512);
        ok("0.1K", 102);
        ok("18446744073709551615B", u64::MAX);
        ok("15.999999999999999999E", u64::MAX - 1);
        for bad in [
            "", "-1G", "lots", "5X", "1e3", "nanG", "1.5B", "5iB", "1..5G", ".", "5KBB",
        ] {
            assert_eq!(parse_size(bad), Err(BadSize::Invalid), "{bad}");
        }
        for bare in ["20", "1.5"] {
            assert_eq!(parse_size(bare), Err(BadSize::NoUnit), "{bare}");
        }
        for big in [
            "18446744073709551616B",
            "16E",
            "99999999999999999999999999999999999999999K",
        ] {
            assert_eq!(parse_size(big), Err(BadSize::TooLarge), "{big}");
        }
    }
}
