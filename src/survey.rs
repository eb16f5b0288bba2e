//! Every image as `images`, `gc` and `doctor` show it: its record, with what the catalog keeps of
//! it (last use, size).
//!
//! - The catalog is refreshed from the records (rows added, changed, dropped for gone images)
//!   whenever every image is looked at.
//! - Sizes are measured off the write's path, here: trees with no size known for the current
//!   record, under a shared lock tried without waiting (one being written is left unmeasured).
//! - A catalog that cannot be written (read-only user, full filesystem, an outside program holding
//!   it, a global lock stuck for seconds) is done without, one line saying why.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::catalog::Row;
use crate::census::{Entry, take};
use crate::clock;
use crate::dir::Dir;
use crate::image_record::{self, ImagesDir, Record, State};
use crate::lock::IfMissing;
use crate::name::ImageName;
use crate::root::Root;

/// An image as `images`, `gc` and `doctor` see it: its record plus the catalog's last use and size.
#[derive(Debug, Clone)]
pub struct Image {
    pub entry: Entry,
    pub record: image_record::Record,
    pub state: State,
    pub last_used: clock::Millis,
    /// The tree's size, measured for the record as it is now.
    pub size: Option<u64>,
}

impl Image {
    pub fn name(&self) -> &str {
        &self.record.name
    }
}

/// A damaged record's stand-in in listings, named by its lock file or, where that name was cut and
/// hashed, by the tree it was cut from.
fn unknown_record(root: &Root, entry: &Entry) -> Option<image_record::Record> {
    // Listed even while the configuration cannot be had (lost: commands that need it say so).
    let images = crate::images_dir::config(root).map_or(ImagesDir::Default, |c| c.images);
    let name = match Root::image_of_lock_file(&entry.file) {
        Some(name) => name,
        None => tree_hashed_as(root, &images, &entry.file)?,
    };
    // Its times are not known either: its last use is the lock file's, if that says one.
    Some(Record::unknown(name.as_str(), images, clock::UNKNOWN))
}

/// The image whose tree in `images` has the cut and hashed lock file name `file`, if one alone
/// does (a hash may collide: two trees are no name).
fn tree_hashed_as(root: &Root, images: &ImagesDir, file: &str) -> Option<ImageName> {
    let dir = root.open_images_dir(&images.path_in(root.dir())).ok()?;
    let mut named = dir.listing().ok()?.into_iter().filter_map(|e| {
        let name = ImageName::from_encoded(e.name.to_str()?).ok()?;
        (crate::root::lock_file_name(name.encoded()) == file).then_some(name)
    });
    let first = named.next();
    named.next().is_none().then_some(first).flatten()
}

/// Trees in the images directory no record names, and entries that are no image trees (name, why).
#[derive(Default)]
pub struct Orphans {
    pub trees: Vec<(ImageName, PathBuf)>,
    pub skipped: Vec<(String, String)>,
}

/// The trees in `images` (at `dir`) whose names `recorded` lacks. `stores_judged`: the caller has
/// just refused a directory holding a store in use, so none is asked again.
pub fn orphans(
    images: &Dir,
    dir: &Path,
    recorded: &HashSet<String>,
    stores_judged: bool,
) -> Result<Orphans> {
    let mut out = Orphans::default();
    let why = || format!("cannot list images directory {}", dir.display());
    let mut entries = images.names().with_context(why)?;
    let (here, mount_points) = (std::cell::OnceCell::new(), std::cell::OnceCell::new());
    // Not `lost+found` where it is a mount's root.
    if entries.iter().any(|n| n == LOST_FOUND) && images.is_mount_root().with_context(why)? {
        entries.retain(|n| n != LOST_FOUND);
    }
    for raw in entries {
        let shown = || raw.to_string_lossy().into_owned();
        // A recorded image's entry costs no stat: a listing of every image must not.
        let name = raw.to_str().map(ImageName::from_encoded);
        if matches!(&name, Some(Ok(n)) if recorded.contains(n.as_str())) {
            continue;
        }
        // A mount point is not stat-ed: its server may not answer (the mount id below tells the
        // mounts the table names otherwise, as the store's path may not be the table's).
        if mount_points
            .get_or_init(|| crate::dir::mount_points_in(dir))
            .contains(&raw)
        {
            out.skipped.push((shown(), MOUNT_POINT.into()));
            continue;
        }
        let Ok(Some(e)) = images.stat_at(&raw) else {
            continue;
        };
        // No tree, yet it keeps a new image of its name from being made: said, left to its owner.
        if !e.is_dir() && matches!(name, Some(Ok(_))) {
            let kind = crate::planted::kind_of_mode(e.mode).unwrap_or("a file");
            let why = format!(
                "it is {kind}, not a directory: a new image of that name is refused until it is removed"
            );
            out.skipped.push((shown(), why));
            continue;
        }
        if !e.is_dir() {
            continue;
        }
        // Another filesystem mounted there holds no tree of ours: asked by mount id, as bind mounts
        // keep the device and a btrfs subvolume has its own on the same mount.
        let mount = || images.mount_id().ok().flatten();
        let (dev, mnt) = here.get_or_init(|| (images.stat().map_or(e.dev, |d| d.dev), mount()));
        let mounted = match (mnt, images.mount_id_at(&raw)) {
            (Some(m), Ok(Some(sub))) => sub != *m,
            _ => e.dev != *dev,
        };
        if mounted {
            out.skipped.push((shown(), MOUNT_POINT.into()));
            continue;
        }
        let Some(enc) = raw.to_str() else {
            out.skipped
                .push((shown(), "the name is not valid UTF-8".into()));
            continue;
        };
        let in_use = || {
            let sub = (!stores_judged).then(|| images.sub(&raw).ok()).flatten();
            sub.and_then(|d| crate::root::in_use_by_a_store(&d))
        };
        match ImageName::from_encoded(enc) {
            // Adopted, a store's root or images directory would be one `rm` from deletion.
            Ok(_) if let Some(what) = in_use() => {
                out.skipped.push((enc.to_owned(), format!("it is {what}")))
            }
            Ok(name) => out.trees.push((name, dir.join(&raw))),
            Err(e) => out.skipped.push((enc.to_owned(), e.rule.to_string())),
        }
    }
    Ok(out)
}

/// Whether the lock file at `path` holds a record now, readable or not: a damaged one is its
/// image's, never to be adopted over (read without its lock, as the census reads).
pub fn has_record(path: &Path) -> bool {
    match crate::lock::open_existing_read(path) {
        Ok(None) => false,
        Ok(Some(f)) => image_record::read(&f).map_or(true, |s| !s.unrecorded()),
        // One that cannot be opened or read (no permission, an I/O error) may hold one; something
        // planted in its place holds none.
        Err(e) => crate::planted::find(&e).is_none(),
    }
}

/// Why an entry of the images directory that something is mounted on is no tree.
const MOUNT_POINT: &str = "it is another filesystem's mount point";

/// The filesystem's own directory at a mount's root: never an image.
const LOST_FOUND: &str = "lost+found";

/// Why the directory `encoded` in `images` is never adopted, named as an image though it is: the
/// filesystem's `lost+found` at a mount's root, or a store's root or images directory.
pub fn never_adopted(images: &Dir, encoded: &str) -> Option<String> {
    if encoded == LOST_FOUND && images.is_mount_root().unwrap_or(true) {
        return Some("the filesystem's lost+found".into());
    }
    let sub = images.sub(encoded).ok()?;
    crate::root::in_use_by_a_store(&sub).map(|what| format!("it is {what}"))
}

/// A tree in the images directory that no listed image is (its lock file missing, or holding no
/// record: a directory, FIFO or symlink in its place, an empty file): its state cannot be known.
pub struct Unlisted {
    pub name: ImageName,
    pub tree: PathBuf,
    /// Why no record says its state, for a report: "its lock file is missing".
    pub why: &'static str,
}

/// The trees in the images directory that none of `images` is (one made since has a record), each
/// with why. Nothing where the directory cannot be listed (said elsewhere).
pub fn unlisted(root: &Root, images: &[Image]) -> Vec<Unlisted> {
    let Ok(config) = crate::images_dir::config(root) else {
        return Vec::new();
    };
    let dir = config.images.path_in(root.dir());
    let Ok(opened) = root.open_images_dir(&dir) else {
        return Vec::new();
    };
    let named: HashSet<String> = images.iter().map(|i| i.name().to_owned()).collect();
    // A store's root or images directory among the trees is no image (`doctor` says so).
    let Ok(found) = orphans(&opened, &dir, &named, false) else {
        return Vec::new();
    };
    // What is mounted over it, or another store's, holds no tree of ours (asked if one is found).
    if found.trees.is_empty() || crate::images_dir::not_usable(root, &dir).is_some() {
        return Vec::new();
    }
    let unlisted = found.trees.into_iter().filter_map(|(name, tree)| {
        let lock = root.image_lock(&name);
        let why = match std::fs::symlink_metadata(&lock) {
            _ if has_record(&lock) => return None,
            Err(_) => "its lock file is missing",
            Ok(m) if !m.is_file() => "its lock file is no regular file",
            Ok(_) => "its lock file holds no record",
        };
        Some(Unlisted { name, tree, why })
    });
    let mut unlisted: Vec<Unlisted> = unlisted.collect();
    unlisted.sort_by(|a, b| a.name.as_str().cmp(b.name.as_str()));
    unlisted
}

/// Every image, the catalog refreshed from the records; `measure` measures and keeps unknown sizes.
pub fn survey(store: &mut crate::store::Store, measure: bool) -> Result<Vec<Image>> {
    // A store to migrate is migrated first: its tokens are no damaged records.
    crate::migrate::if_needed(store, None)?;
    survey_from(store, measure, None)
}

/// [`survey`] for a listing: a store to migrate whose older catalog another program holds is
/// listed from what that release's lock files say, unmigrated, in one line saying so.
pub fn listing(store: &mut crate::store::Store) -> Result<Vec<Image>> {
    match crate::migrate::if_needed(store, None) {
        Err(e) if matches!(crate::error::typed(&e), Some(crate::Error::Busy(_))) => {
            let line =
                format!("{e:#} (listed from the older release's lock files, bases not known)");
            store.ctx().say(&line);
            let tokens = crate::migrate::records_from_tokens(store.root());
            survey_from(store, true, Some(tokens))
        }
        other => other.and_then(|()| survey_from(store, true, None)),
    }
}

/// [`survey`], with `tokens` (by lock file) standing for the records of a store to migrate.
fn survey_from(
    store: &mut crate::store::Store,
    measure: bool,
    tokens: Option<std::collections::BTreeMap<String, Record>>,
) -> Result<Vec<Image>> {
    // First: a dead lease's reads are recorded as uses as it goes, and then read with the records.
    crate::holders::Look::new(store.ctx()).clean_leases();
    let mut entries = take(store.root())?;
    if !crate::store_wide::forget_left(store, &entries).is_empty() {
        entries = take(store.root())?;
    }
    let mut images: Vec<Image> = entries
        .into_iter()
        .filter_map(|entry| image_of(store.root(), entry, tokens.as_ref()))
        .collect();
    // Tokens stand for records: the catalog, which they would refresh, is not asked.
    let refreshed = match tokens {
        Some(_) => Ok(None),
        None => refresh(store, &images).map(Some),
    };
    let rows = match refreshed {
        Ok(rows) => rows,
        // A store to migrate whose catalog cannot be had (a read-only root) is not surveyed from
        // tokens, which are no records: the migration says why it cannot run.
        Err(e)
            if e.downcast_ref::<crate::catalog::NeedsMigration>().is_some()
                || crate::migrate::is_legacy(store.root()) =>
        {
            crate::migrate::run(store, None)?;
            return survey_from(store, measure, None);
        }
        Err(e) if crate::error::is_newer(&e) => return Err(e),
        Err(e) => {
            // Derived: the records say all that matters, so the listing goes on, saying why sizes
            // and last uses may be missing (a full filesystem only with -v: it is said elsewhere).
            let line = format!("{e:#} (going on from the images' records, without the catalog)");
            if crate::space::is_full(&e) {
                store.ctx().detail(&line);
            } else {
                store.ctx().say(&line);
            }
            None
        }
    };
    for img in images.iter_mut() {
        // Only a row's size is used: its last use is a copy (or another store's, in a catalog put
        // in place of ours). A damaged record's stand-in is never measured.
        if let Some(row) = rows.as_ref().and_then(|rows| rows.get(img.name()))
            && img.entry.seen.record.is_some()
        {
            img.size = row.size_for(&img.record);
        }
    }
    if measure {
        let measured = measure_missing(store.root(), &mut images);
        crate::debug::pause("sizes-measured");
        // Kept only if the catalog could be had just now: a second wait for a global lock held by a
        // stuck process would undo the first.
        if rows.is_some() && !measured.is_empty() {
            let _ = store.with_catalog(None, |cat, _| {
                measured
                    .iter()
                    .try_for_each(|(name, record, size)| cat.set_size(name, record, *size))
            });
        }
    }
    Ok(images)
}

/// The image a lock file's entry is, from its record (or the old release's token that stands for
/// it, in a store to migrate); `None` where it names none.
fn image_of(
    root: &crate::root::Root,
    entry: crate::census::Entry,
    tokens: Option<&std::collections::BTreeMap<String, Record>>,
) -> Option<Image> {
    let token = tokens.and_then(|t| t.get(&entry.file));
    let record = match (&entry.seen.record, entry.seen.damaged) {
        _ if token.is_some() => token?.clone(),
        (Some(r), _) => r.clone(),
        (None, true) => unknown_record(root, &entry)?,
        (None, false) => return None,
    };
    let (state, changed) = (record.state_seen(entry.writer_alive), record.changed);
    let recorded = entry.seen.last_use.unwrap_or(changed).max(changed);
    let last_used = image_record::last_use(recorded, entry.written);
    Some(Image {
        entry,
        record,
        state,
        last_used,
        size: None,
    })
}

/// Makes the catalog say what the records say; returns its rows.
fn refresh(store: &mut crate::store::Store, images: &[Image]) -> Result<HashMap<String, Row>> {
    store.look_catalog(|cat, _| {
        let rows = cat.rows()?.into_iter().map(|r| (r.name.clone(), r));
        let mut rows: HashMap<String, Row> = rows.collect();
        let live: HashSet<&str> = images.iter().map(|i| i.name()).collect();
        for gone in rows.keys().filter(|n| !live.contains(n.as_str())) {
            cat.remove(gone)?;
        }
        rows.retain(|n, _| live.contains(n.as_str()));
        for img in images {
            let (rec, used) = (&img.record, img.last_used);
            let now = (img.state, &rec.base, rec.created, rec.seq);
            // Most rows say it already: no statement for them.
            let says = |r: &Row| (r.state, &r.base, r.created, r.seq) == now && r.last_used >= used;
            if rows.get(img.name()).is_some_and(says) {
                continue;
            }
            let row = Row {
                name: img.name().to_owned(),
                state: img.state,
                base: img.record.base.clone(),
                created: img.record.created,
                last_used: img.last_used,
                seq: img.record.seq,
                size: None,
                size_record: None,
            };
            cat.upsert(&row)?;
            // A kept size stays with the record it was measured for (`Row::size_for`).
            rows.entry(row.name.clone()).or_insert(row);
        }
        Ok(rows)
    })
}

/// Measures the trees whose size is not known for their record now, in the images directory
/// recorded only: what is mounted over it (a container's view), or another store's, holds none.
fn measure_missing(root: &Root, images: &mut [Image]) -> Vec<(String, Record, u64)> {
    let unknown =
        |img: &Image| img.size.is_none() && !img.state.in_flight() && img.state != State::Deleting;
    let mut out = Vec::new();
    // Whether the images directory may not be the one whose trees the records describe.
    let in_doubt = || {
        let dir = crate::images_dir::config(root).map(|c| c.images.path_in(root.dir()));
        dir.map_or(true, |d| crate::images_dir::not_usable(root, &d).is_some())
    };
    if !images.iter().any(unknown) || in_doubt() {
        return out;
    }
    for img in images.iter_mut() {
        if !unknown(img) {
            continue;
        }
        if crate::signals::check().is_err() {
            break;
        }
        let (path, shared) = (&img.entry.path, crate::lock::Mode::Shared);
        let Ok(Some(reading)) = crate::lock::acquire_no_wait(path, shared, IfMissing::Fail) else {
            continue;
        };
        // The tree measured is the one the record under our lock describes: the one surveyed, or
        // no size is kept (rewritten since: the next look measures it).
        let now = image_record::read(reading.file())
            .ok()
            .and_then(|s| s.record);
        if now.as_ref().map(Record::fingerprint) != Some(img.record.fingerprint()) {
            continue;
        }
        // Named by our lease while it measures (nothing else does on another host); unnamed first.
        let rel = format!("images/{}", img.entry.file);
        let what = "stowage (measuring the image's size)";
        let hold = crate::lease::Holding::now(shared, rel, false, what);
        let named = crate::lease::Named::new(&root.leases(), hold);
        crate::debug::pause("size-measuring");
        let tree = crate::images_dir::tree_of(root, &img.record);
        let measured = crate::disk_usage::measure(&tree, false);
        drop(named);
        drop(reading);
        // A failed writer's image may have no tree: it takes nothing.
        let (size, whole) = match measured {
            Ok(m) if m.there => (m.allocated, !m.partial),
            Ok(_) if img.state == State::Incomplete => (0, true),
            _ => continue,
        };
        img.size = Some(size);
        // Seen in part (a directory we may not read): shown, not kept, for one who may to measure.
        if whole {
            out.push((img.name().to_owned(), img.record.clone(), size));
        }
    }
    out
}
