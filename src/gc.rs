//! Garbage collection: make room without ever touching an image in use.
//!
//! In order, gc removes:
//! 1. leftovers of interrupted removals (rows left `deleting`, the trash);
//! 2. incomplete images, whose writer is gone (a writer that died leaves its
//!    image `creating`/`writing` with a free lock; gc first marks those);
//! 3. with `--unused-for D`, ready images not used for D;
//! 4. with `--max-size S`, least recently used images until the images fit S.
//!
//! Invariants: every image is removed under its exclusive lock, taken
//! without waiting — a busy image is skipped, however old. After the lock is
//! taken the image's row is read again, so a reason that stopped holding
//! (the image was just rebuilt or used) keeps it. Sizes are allocated
//! blocks, hard links counted once, symlinks never followed; `--max-size`
//! is the space the images take on the filesystem — on one that shares
//! extents (reflink clones), each shared extent once — and an image whose
//! removal would free nothing is not removed for the budget. A size gc
//! measures is recorded only if the row is unchanged since it was read (a
//! writer that finished meanwhile recorded its own). `--dry-run`
//! changes nothing: the same decisions, every lock released at once, every
//! transaction rolled back.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Result;

use crate::clock::{self, Millis};
use crate::disk_usage;
use crate::lock::{self, Mode};
use crate::meta::{ImageRow, ImageState};
use crate::name::ImageName;
use crate::remove::{self, Leftovers};
use crate::store::Store;

/// What to remove beyond incomplete images.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub max_size: Option<u64>,
    pub unused_for: Option<Duration>,
    pub dry_run: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Its writer failed or died.
    Incomplete,
    /// Not used for longer than `--unused-for`.
    Unused,
    /// Least recently used while the images exceed `--max-size`.
    OverBudget,
}

impl Reason {
    /// As `gc --json` names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Incomplete => "incomplete",
            Reason::Unused => "unused",
            Reason::OverBudget => "over-budget",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Reason::Incomplete => "incomplete",
            Reason::Unused => "unused",
            Reason::OverBudget => "least recently used, over budget",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Collected {
    pub name: String,
    pub state: &'static str,
    pub size_bytes: u64,
    pub reason: Reason,
}

#[derive(Debug, Default)]
pub struct Report {
    pub dry_run: bool,
    pub removed: Vec<Collected>,
    /// Images that qualified but were in use (locked), and so kept.
    pub busy: Vec<String>,
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
}

pub fn run(store: &mut Store, policy: &Policy) -> Result<Report> {
    // gc locks images without recording itself: its lease names it to
    // lock-status meanwhile (best effort; see lease.rs).
    if !policy.dry_run {
        let _ = crate::lease::mine(&store.root().leases());
    }
    let mut report = Report {
        dry_run: policy.dry_run,
        max_size: policy.max_size,
        unused_for_seconds: policy.unused_for.map(|d| d.as_secs()),
        ..Report::default()
    };

    // 1. Leftovers of interrupted removals.
    let left: Leftovers = remove::finish_interrupted(store, !policy.dry_run)?;
    report.interrupted_removals = left.removals;
    report.trash_entries = left.trash.len();
    report.failed = left.failed;
    report.bytes_freed = left.bytes;

    // Look at every image: dead writers become incomplete (in a dry run the
    // transaction is rolled back, so nothing changes).
    let sweep = |tx: &crate::meta::Tx, ctx: &crate::ctx::Ctx| {
        let kv = crate::judge::kernel_view(tx, ctx, &ctx.root.locks());
        crate::judge::sweep(tx, ctx, &kv)?;
        let dir = tx.images_dir(&ctx.root)?;
        let doubt = crate::adopt::unmounted(tx, &ctx.root, &dir)?;
        Ok((tx.images()?, dir, doubt, kv))
    };
    let looked = store.retry_full(|store| {
        let (tx, ctx) = store.begin(None)?;
        let (images, dir, doubt, kv) = sweep(&tx, ctx)?;
        if !policy.dry_run {
            // Leases of owners that died, under the global lock.
            crate::judge::clean_leases(ctx, &kv);
            tx.commit()?;
        }
        Ok((images, dir, doubt))
    });
    let (rows, images_dir, doubt) = match looked {
        // A dry run on a full filesystem, even the reserve used: it changes
        // nothing anyway, so it looks without a journal on disk.
        Err(e) if policy.dry_run && crate::space::is_full(&e) => {
            let (images, dir, doubt, _) = store.view_tx(sweep)?;
            (images, dir, doubt)
        }
        other => other?,
    };
    // Trees missing from an unmounted images directory are not gone:
    // removing their images would free nothing and orphan the trees.
    if let Some(why) = doubt {
        report.failed.push(format!("no image removed: {why}"));
        return Ok(report);
    }
    let mut rows: Vec<ImageRow> = rows
        .into_iter()
        .filter(|r| !policy.dry_run || !report.interrupted_removals.contains(&r.name))
        .collect();

    // What each image takes, and what removing it frees (see disk_usage.rs):
    // with a budget on a filesystem that shares extents, every image's
    // extent map is read, so the budget is the space the images really
    // take and a removal counts only what it frees.
    let shares = policy.max_size.is_some() && disk_usage::can_share(&images_dir);
    let mut cost: HashMap<String, Cost> = HashMap::new();
    let mut measured = Vec::new();
    for r in rows.iter_mut() {
        crate::signals::check()?;
        let Ok(n) = ImageName::parse(&r.name) else {
            continue;
        };
        let c = if shares || r.size_bytes.is_none() {
            let m = disk_usage::measure(&images_dir.join(n.encoded()), shares).ok();
            if r.size_bytes.is_none()
                && let Some(m) = &m
            {
                measured.push((r.clone(), m.allocated));
                r.size_bytes = Some(m.allocated);
            }
            match m {
                Some(m) => Cost {
                    own: m.allocated.saturating_sub(m.shared),
                    shared_ranges: m.shared_ranges,
                },
                // Unreadable: it counts what was recorded, if anything.
                None => Cost {
                    own: r.size_bytes.unwrap_or(0),
                    shared_ranges: Vec::new(),
                },
            }
        } else {
            Cost {
                own: r.size_bytes.unwrap_or(0),
                shared_ranges: Vec::new(),
            }
        };
        cost.insert(r.name.clone(), c);
    }
    crate::debug::pause("gc-measured");
    if !policy.dry_run && !measured.is_empty() {
        // A measurement is recorded only if the row is still what it was
        // when measured: a writer that finished meanwhile recorded its own.
        store.with_tx(None, |tx, _| {
            measured
                .iter()
                .filter(|(r, _)| !r.state.being_written())
                .try_for_each(|(r, s)| tx.set_size_if_unchanged(r, *s).map(|_| ()))
        })?;
    }
    let mut footprint =
        disk_usage::Footprint::new(cost.values().map(|c| c.shared_ranges.as_slice()));
    report.size_before = cost.values().map(|c| c.own).sum::<u64>() + footprint.bytes();
    let mut total = report.size_before;
    // What removing `r` would free now, and forgetting it once removed.
    let frees = |fp: &disk_usage::Footprint, r: &ImageRow| {
        cost.get(&r.name)
            .map_or(0, |c| c.own + fp.unique(&c.shared_ranges))
    };

    crate::debug::pause("gc-listed");
    // 2. Incomplete images, 3. unused ones, 4. least recently used — in
    // that order, each phase oldest first.
    let now = clock::now_ms();
    // Saturating: a duration longer than history (1000000000y) means "no
    // image is that old", not a wrapped-around cutoff in the future. A read
    // records its use only when the recorded last use is older than the
    // resolution (a read writes no metadata otherwise): an image used in the
    // last D may show a last use up to that much older, so only one whose
    // last use is older than D plus the resolution is surely unused for D.
    let resolution = crate::session::LAST_USE_RESOLUTION.as_millis() as Millis;
    let cutoff = policy.unused_for.map(|d| {
        let ms = Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX);
        now.saturating_sub(ms).saturating_sub(resolution)
    });
    rows.sort_by(oldest_first);
    for reason in [Reason::Incomplete, Reason::Unused] {
        let (these, rest): (Vec<ImageRow>, Vec<ImageRow>) =
            rows.into_iter().partition(|r| match reason {
                Reason::Incomplete => r.state == ImageState::Incomplete,
                _ => r.state == ImageState::Ready && cutoff.is_some_and(|c| r.last_used < c),
            });
        rows = rest;
        for r in these {
            crate::signals::check()?;
            let bytes = frees(&footprint, &r);
            if collect(store, &r, reason, bytes, policy.dry_run, &mut report)? {
                total = total.saturating_sub(bytes);
                forget(&mut footprint, &cost, &r);
            } else {
                rows.push(r);
            }
        }
        rows.sort_by(oldest_first);
    }
    if let Some(max) = policy.max_size {
        // Least recently used first, but passing over an image whose
        // removal would free nothing now (all its data shared with images
        // that stay) while a later one frees something; when none does,
        // the least recently used goes, which unshares the others.
        let mut left = rows;
        while total > max && !left.is_empty() {
            crate::signals::check()?;
            let i = left
                .iter()
                .position(|r| frees(&footprint, r) > 0)
                .unwrap_or(0);
            let r = left.remove(i);
            let bytes = frees(&footprint, &r);
            if collect(
                store,
                &r,
                Reason::OverBudget,
                bytes,
                policy.dry_run,
                &mut report,
            )? {
                total = total.saturating_sub(bytes);
                forget(&mut footprint, &cost, &r);
            }
        }
    }
    report.size_after = total;
    if !policy.dry_run {
        // Space was freed: the metadata's reserve gets what it lacks.
        crate::space::refill(&store.root().reserve());
    }
    report.bytes_freed += report.removed.iter().map(|r| r.size_bytes).sum::<u64>();
    Ok(report)
}

/// What an image takes on the filesystem beyond what it shares.
struct Cost {
    /// Allocated bytes in no shared extent.
    own: u64,
    /// Physical ranges of its shared extents (empty where nothing is shared
    /// or extents were not read).
    shared_ranges: Vec<(u64, u64)>,
}

fn forget(fp: &mut disk_usage::Footprint, cost: &HashMap<String, Cost>, r: &ImageRow) {
    if let Some(c) = cost.get(&r.name) {
        fp.release(&c.shared_ranges);
    }
}

/// Least recently used first; by name among equals, so runs repeat.
fn oldest_first(a: &ImageRow, b: &ImageRow) -> std::cmp::Ordering {
    a.last_used
        .cmp(&b.last_used)
        .then_with(|| a.name.cmp(&b.name))
}

/// Removes one image if its lock is free and its reason still holds;
/// `bytes` is what its removal frees. Returns whether it was removed.
fn collect(
    store: &mut Store,
    row: &ImageRow,
    reason: Reason,
    bytes: u64,
    dry_run: bool,
    report: &mut Report,
) -> Result<bool> {
    let Ok(name) = ImageName::parse(&row.name) else {
        return Ok(false);
    };
    let path = store.root().image_lock(&name);
    // A dry run creates no lock file: a missing one is simply free.
    let guard =
        match lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::create_if(!dry_run)) {
            Ok(Some(g)) => Some(g),
            Ok(None) => {
                report.busy.push(row.name.clone());
                return Ok(false);
            }
            Err(e) if dry_run && e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                return Err(crate::lock::error(&format!("image '{name}'"), &path, e));
            }
        };
    // Under the lock, the image must still exist and its reason still hold.
    let (guard, current) = match guard {
        Some(g) => match remove::recheck(store, &name, g, !dry_run)? {
            Some((g, current)) => (Some(g), current),
            None => return Ok(false),
        },
        None => match store.with_tx_holding_locks(None, |tx, _| tx.image(name.as_str()))? {
            Some(current) => (None, current),
            None => return Ok(false),
        },
    };
    let still = match reason {
        // Holding the lock, a creating/writing image has lost its writer
        // (a dry run sees the mark it did not commit).
        Reason::Incomplete => {
            current.state == ImageState::Incomplete || current.state.being_written()
        }
        Reason::Unused => current.state == ImageState::Ready && current.last_used == row.last_used,
        Reason::OverBudget => current.last_used == row.last_used,
    };
    if !still {
        return Ok(false);
    }
    if let Some(g) = guard {
        if dry_run {
            drop(g);
        } else {
            crate::debug::pause("gc-rechecked");
            match remove::remove_locked(store, vec![(name.clone(), g)]) {
                // Removed; a tree left in the trash is said, and retried
                // by the next gc.
                Ok(done) => report
                    .failed
                    .extend(done.into_iter().filter_map(|r| r.left_in_trash)),
                // Refused before anything moved because a store-wide
                // command holds the store: busy, as an image in use is.
                Err(e)
                    if matches!(
                        e.downcast_ref::<crate::Error>(),
                        Some(crate::Error::Busy(_))
                    ) =>
                {
                    report.busy.push(row.name.clone());
                    return Ok(false);
                }
                // Gone since the recheck, though we hold its lock: a
                // store-wide command that deleted its tree forgot it as it
                // ended (it takes no image lock for that). Nothing to do.
                Err(e)
                    if matches!(
                        e.downcast_ref::<crate::Error>(),
                        Some(crate::Error::NoSuchImage(_))
                    ) =>
                {
                    return Ok(false);
                }
                // Undone (see remove.rs): say so, and go on with the others.
                Err(e) => {
                    report.failed.push(format!("{e:#}"));
                    return Ok(false);
                }
            }
        }
    }
    report.removed.push(Collected {
        name: row.name.clone(),
        state: row.state.as_str(),
        size_bytes: bytes,
        reason,
    });
    Ok(true)
}

/// Parses a size: `500M`, `20G`, `1.5T`, `4096` (bytes); K, M, G, T, P are
/// powers of 1024, with an optional `B` or `iB`.
pub fn parse_size(raw: &str) -> Option<u64> {
    let s = raw.trim();
    let digits = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(digits);
    let num: f64 = num.parse().ok()?;
    let unit = unit.trim();
    let unit = unit
        .strip_suffix("iB")
        .or_else(|| unit.strip_suffix('B'))
        .unwrap_or(unit);
    let mult: f64 = match unit.to_ascii_uppercase().as_str() {
        "" => 1.0,
        "K" => 1024.0,
        "M" => 1024f64.powi(2),
        "G" => 1024f64.powi(3),
        "T" => 1024f64.powi(4),
        "P" => 1024f64.powi(5),
        _ => return None,
    };
    let bytes = num * mult;
    (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("500M"), Some(500 << 20));
        assert_eq!(parse_size("20G"), Some(20 << 30));
        assert_eq!(parse_size("1.5K"), Some(1536));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("3 MB"), Some(3 << 20));
        assert_eq!(parse_size("0"), Some(0));
        for bad in ["", "-1G", "lots", "5X", "1e3", "nanG"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }
}
