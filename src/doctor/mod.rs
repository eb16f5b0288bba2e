//! `stowage doctor`: is this store safe to use, and is it consistent?
//!
//! - Checks, in order: the filesystem and whether flock(2) excludes there; shared mounts whose
//!   locks are local only; the catalog; every record against its tree; leftovers.
//! - Without `--repair` nothing changes; with it, only what is safe is fixed, on positive evidence;
//!   an unusable catalog is set aside (never deleted) and made anew from the records.
//! - An image whose state cannot be known (a damaged record) is reported, never removed.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::adopt::{self, Adopt};
use crate::census::Entry;
use crate::clock;
use crate::config::Config;
use crate::ctx::Ctx;
use crate::dir::Dir;
use crate::filesystem;
use crate::gc::Taken;
use crate::image_record::{ADOPTED, Record, State};
use crate::lock::{self, Mode};
use crate::name::ImageName;
use crate::remove;
use crate::root::Root;
use crate::store::Store;

mod configuration;
mod files;

use crate::ident::{Hint, STOWAGE};
use Verdict::{Info, Problem, Repaired};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Ok,
    /// Worth knowing, not a fault.
    Info,
    Problem,
    Repaired,
}

#[derive(Debug, Serialize)]
pub struct Check {
    pub check: &'static str,
    pub status: Verdict,
    pub detail: String,
}

/// Also `doctor --json`, field for field.
#[derive(Debug, Serialize)]
pub struct Report {
    pub root: String,
    pub filesystem: String,
    /// False when flock does not work (or is unsafe) here: exit 69.
    pub locking: bool,
    pub healthy: bool,
    pub checks: Vec<Check>,
    /// Whether a problem found is one `--repair` puts right: only then is the user sent to it.
    #[serde(skip)]
    pub repairable: bool,
    /// Parts of a group store whose modes a repair could not fix, judged again once the later
    /// checks ran (one planted was set aside, or rewritten, since): (path in the root, why).
    #[serde(skip)]
    unfixed_parts: Vec<(String, String)>,
}

impl Report {
    /// Marks what is said next as a problem a repair puts right.
    fn by_repair(&mut self) -> &mut Report {
        self.repairable = true;
        self
    }

    fn add(&mut self, check: &'static str, status: Verdict, detail: impl Into<String>) {
        self.checks.push(Check {
            check,
            status,
            detail: detail.into(),
        });
    }

    fn catalog(&mut self, status: Verdict, detail: String) -> Verdict {
        self.add("catalog", status, detail);
        status
    }

    /// "found `what`" with verdict `found`; or, `fixed` by a repair, "`fixed` `what`".
    fn swept(&mut self, check: &'static str, fixed: Option<&str>, found: Verdict, what: String) {
        let (status, verb) = fixed.map_or((found, "found"), |verb| (Repaired, verb));
        self.add(check, status, format!("{verb} {what}"));
    }

    /// One line about `names`, which `say` words given their [`list`]; none without a name.
    fn naming<T: std::fmt::Display>(
        &mut self,
        check: &'static str,
        status: Verdict,
        names: &[T],
        say: impl FnOnce(String) -> String,
    ) {
        if !names.is_empty() {
            self.add(check, status, say(list(names)));
        }
    }
}

/// `doctor --hold-probe SECONDS`: holds the probe lock `doctor` on another host looks for, naming
/// the holder in it: the real test of locks across hosts where mount options cannot tell.
pub fn hold_probe(store: &Store, secs: std::time::Duration) -> Result<()> {
    let root = store.root();
    root.create_layout()?;
    let path = root.locks().join("probe.lock");
    let ctx = store.ctx();
    let Some(guard) = lock::acquire_no_wait(&path, lock::Mode::Exclusive, lock::IfMissing::Create)
        .map_err(|e| crate::lock::error("the probe lock", &path, e))?
    else {
        let what = format!("the probe lock {}", path.display());
        let holder = probe_holder(&probe_text(&path).unwrap_or_default());
        let holders = format!("held by another probe: {holder}");
        return Err(crate::error::Busy::now(what, holders).into());
    };
    let since = clock::rfc3339(clock::now_ms()).unwrap_or_else(|| "?".into());
    let (host, pid, shown) = (&ctx.me.host, ctx.me.pid, path.display());
    guard
        .set_contents(format!("{host}\t{pid}\t{since}\n").as_bytes())
        .with_context(|| format!("cannot write {shown}"))?;
    let secs_f = secs.as_secs_f64();
    ctx.say(&format!("holding the probe lock {shown} on host {host} for {secs_f:.0} s: run '{STOWAGE} doctor' on another host sharing this root now"));
    std::thread::sleep(secs);
    Ok(())
}

/// What the probe file says, read only from a regular file (a FIFO planted there and held would
/// block a plain read for good), never through a link on the way.
fn probe_text(path: &Path) -> Option<String> {
    let file = crate::planted::open(path, libc::O_RDONLY, 0).ok()?;
    crate::planted::check(path, &file).ok()?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(file, 4096), &mut text).ok()?;
    Some(text)
}

fn probe_holder(text: &str) -> String {
    match text.trim().split('\t').collect::<Vec<_>>().as_slice() {
        [host, pid, since] => format!("host {host}, pid {pid}, since {since}"),
        _ => "an unknown holder".into(),
    }
}

/// Reports a probe lock held by `doctor --hold-probe`, here or elsewhere.
fn probe_check(ctx: &Ctx, report: &mut Report) {
    let path = ctx.root.locks().join("probe.lock");
    // Tried, never only asked: what the check proves is that a lock taken there excludes one here.
    let Ok(lock::Probe::Exclusive) = lock::probe(&path) else {
        return;
    };
    let text = probe_text(&path).unwrap_or_default();
    let who = probe_holder(&text);
    if text.split('\t').next() == Some(ctx.me.host.as_str()) {
        report.add("probe", Info, format!("the probe lock is held on this host ({who}); run '{STOWAGE} doctor' on another host to test locks across hosts"));
    } else {
        report.add("probe", Verdict::Ok, format!("the probe lock held on another host ({who}) is seen held here: locks taken there exclude processes here"));
    }
}

pub fn run(store: &mut Store, repair: bool) -> Result<Report> {
    let root = store.root().clone();
    root.require_store()?;
    // Named as lock-status names it: by the mount table's kind ("glusterfs", not statfs's "fuse").
    let fs_info = fs::metadata(root.dir())
        .ok()
        .and_then(|m| filesystem::lock_reach_of_device(m.dev()))
        .and_then(|(_, _, fs)| fs)
        .or_else(|| root.filesystem_now());
    let mut report = Report {
        root: root.dir().display().to_string(),
        filesystem: fs_info.as_ref().map_or("unknown", |f| &f.name).to_owned(),
        locking: true,
        healthy: true,
        checks: Vec::new(),
        repairable: false,
        unfixed_parts: Vec::new(),
    };
    if let Some(f) = &fs_info {
        let polls = crate::filesystem::filesystem(root.dir()).is_ok_and(|f| lock::polls(&f));
        let kind = if f.local {
            "local: the kernel's lock table shows every holder"
        } else if polls {
            "shared or unknown: lock-status probes locks; on FUSE, waits try again without blocking every 2-50 ms"
        } else {
            "shared or unknown: lock-status probes locks, and waits re-issue blocked requests every 250 ms"
        };
        report.add("filesystem", Info, format!("{} ({kind})", f.name));
    }
    let complete = checks(store, &root, repair, &mut report)?;
    parts_left_unfixed(&root, &mut report);
    report.healthy = complete && !report.checks.iter().any(|c| c.status == Problem);
    Ok(report)
}

/// Every check after the filesystem's, in order; `false` where one stops the look.
fn checks(store: &mut Store, root: &Root, repair: bool, report: &mut Report) -> Result<bool> {
    if !layout(root, repair, report)? {
        return Ok(false);
    }
    // A group store's parts, before any write: a member who cannot write learns which stops them.
    modes(root, repair, report);
    if !flock_works(root, report) {
        return Ok(false);
    }
    mount_reach(root, report);
    probe_check(store.ctx(), report);
    if !report.locking {
        return Ok(false);
    }
    files::check(root, repair, store.ctx().shared(), report);
    let configured = configuration::check(root, repair, report)?;
    // A catalog that cannot be put right (set aside where the file may not be renamed) is said,
    // and every other check still runs: the catalog is derived, the records say what matters.
    let status = catalog(store, repair, report)
        .unwrap_or_else(|e| report.catalog(Problem, format!("{e:#}; {FROM_RECORDS}")));
    // A store still to migrate (a repair could not: its older catalog is held) has records only in
    // part: nothing more to judge until it is.
    if crate::migrate::is_legacy(root) {
        let detail = "not checked until the store is migrated (any command but lock-status and a plain doctor migrates it)";
        report.add("records", Info, detail);
        return Ok(false);
    }
    files::class_records(root, report);
    records(store, repair, report)?;
    if configured {
        trees(store, repair, report)?;
    }
    leftovers(store, repair, report)?;
    // The catalog made to say what the records say now.
    if status != Problem
        && let Err(e) = crate::survey::survey(store, false)
    {
        report.add("catalog", Problem, format!("cannot refresh it: {e:#}"));
    }
    Ok(true)
}

/// Does flock exclude here at all (two opens of one file must conflict)? `false` also when this
/// user may not make the test file: nothing else can be checked.
fn flock_works(root: &Root, report: &mut Report) -> bool {
    // Private to this process: two doctors at once must not test against each other's lock.
    let probe = format!(".doctor.{:016x}.lock", crate::ident::nonce());
    let probe = root.locks().join(probe);
    // No room for a file (no inode left): tried on the reserve, which only its size is ever for.
    let tried = match lock::opens_conflict(&probe) {
        Err(e) if crate::space::is_full_io(&e) => {
            lock::opens_conflict(&root.reserve()).map_err(|_| e)
        }
        tried => tried,
    };
    match tried {
        Ok(true) => {
            let detail = "two opens of one file exclude each other";
            report.add("flock", Verdict::Ok, detail);
        }
        Ok(false) => {
            report.locking = false;
            report.add("flock", Problem, "two opens of one file do NOT exclude each other: flock is a no-op on this filesystem");
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let locks = root.locks();
            let (owner, locks) = (fs::metadata(&locks), locks.display());
            let owner = match owner {
                Ok(m) => {
                    let (uid, gid, mode) = (m.uid(), m.gid(), m.mode() & 0o7777);
                    format!("{locks} is owned by uid {uid}, group {gid}, mode {mode:o}")
                }
                Err(e) => format!("{locks}: {e}"),
            };
            let advice = match crate::sharing::is_group_store(root.dir()) {
                Some((gid, _)) if !crate::ident::in_group(gid) => {
                    let label = crate::sharing::group_label(gid);
                    &format!(
                        "you are not in the store's group {label}: ask its owner to add you to it"
                    )
                }
                Some(_) => {
                    &format!("its owner's '{STOWAGE} doctor --repair' makes it group-writable")
                }
                None => &format!("the store's owner can share it: '{STOWAGE} init --group GROUP'"),
            };
            let doc = crate::error::GROUP_STORE_DOC;
            report.add("access", Problem, format!("cannot create a file in {locks}: {e}: you may not write this store ({owner}); {advice} ({doc})"));
            return false;
        }
        Err(e) if crate::space::is_full_io(&e) => {
            let locks = root.locks();
            let (locks, gc) = (locks.display(), format!("'{STOWAGE} gc' frees space"));
            let detail = format!("not tested: cannot create a file in {locks}: {e} ({gc})");
            report.add("flock", Info, detail);
        }
        Err(e) => {
            report.locking = false;
            let advice = if crate::error::flock_unsupported(&e) {
                " — is this NFS mounted with 'nolock', or a filesystem without flock? mount it with locking, or put the root elsewhere"
            } else {
                ""
            };
            let detail = format!("cannot lock {}: {e}{advice}", probe.display());
            report.add("flock", Problem, detail);
        }
    }
    if let (Ok(locks), Some(name)) = (root.open_sub(Root::LOCKS_REL), probe.file_name()) {
        let _ = locks.unlink(name);
    }
    true
}

/// Shared filesystems mounted so that locks stay on each host.
fn mount_reach(root: &Root, report: &mut Report) {
    let (reach, mount, _) = filesystem::lock_reach_with(root.dir());
    match reach {
        filesystem::Reach::NodeLocal { why, advice } => {
            report.locking = false;
            let at = mount
                .as_ref()
                .map_or_else(String::new, |m| format!("{}: ", m.mount_point.display()));
            report.add("mount", Problem, format!("{at}{why}, so builds and metadata updates on different hosts do not exclude each other; {advice}"));
        }
        filesystem::Reach::Unknown { why } => report.add("mount", Info, format!("{why}; to check, run '{STOWAGE} doctor --hold-probe 60' on one host and '{STOWAGE} doctor' on another within the minute")),
        filesystem::Reach::ClusterWide => {
            if let Some(m) = mount.or_else(|| filesystem::mount_of(root.dir())) {
                let (at, fstype, source) = (m.mount_point.display(), &m.fstype, &m.source);
                report.add("mount", Verdict::Ok, format!("{at} ({fstype}) on {source}"));
            }
        }
    }
}

/// In a group store, reports each part of the layout a group member cannot use (mode or group);
/// with `repair` fixes those ours to change (sharing.rs), saying what is left to whom.
fn modes(root: &Root, repair: bool, report: &mut Report) {
    use crate::sharing;
    let Some((gid, mode)) = sharing::is_group_store(root.dir()) else {
        return;
    };
    let doc = crate::error::GROUP_STORE_DOC;
    let label = sharing::group_label(gid);
    let wrong = sharing::check(root, gid);
    if wrong.is_empty() {
        let mode = mode & 0o7777;
        let detail =
            format!("group store (group {label}, mode {mode:o}): every part is group-writable");
        report.add("sharing", Verdict::Ok, detail);
        return;
    }
    if !repair {
        let (n, parts) = (wrong.len(), sharing::list(&wrong, 4));
        report.by_repair().add("sharing", Problem, format!("group store (group {label}), but {n} part(s) its members cannot use: {parts} ({doc})"));
        return;
    }
    let done = sharing::repair(root, gid, wrong);
    if !done.fixed.is_empty() {
        let parts = sharing::list(&done.fixed, 4);
        report.add("sharing", Repaired, format!("gave group {label} and group write (directories: setgid, no default ACL; no ACL entry giving a user less) to {parts}"));
    }
    if !done.not_ours.is_empty() {
        let parts = sharing::list(&done.not_ours, 4);
        let detail = format!("not ours to fix, left to their owners or root: {parts} ({doc})");
        report.add("sharing", Problem, detail);
    }
    for (w, e) in &done.failed {
        let detail = format!("cannot fix {}: {e}", w.describe());
        report.unfixed_parts.push((w.rel.clone(), detail));
    }
}

/// Says the parts the group-modes repair could not fix that are wrong still, once every other
/// check ran: a FIFO or a hard link planted at a part's place was set aside since, and the part
/// made anew, by the files and configuration checks.
fn parts_left_unfixed(root: &Root, report: &mut Report) {
    let Some((gid, _)) = crate::sharing::is_group_store(root.dir()) else {
        return;
    };
    if report.unfixed_parts.is_empty() {
        return;
    }
    let wrong = crate::sharing::check(root, gid);
    for (rel, detail) in std::mem::take(&mut report.unfixed_parts) {
        if wrong.iter().any(|w| w.rel == rel) {
            report.add("sharing", Problem, detail);
        }
    }
}

/// The root's own directories, missing ones made; with `repair` what is planted in one's place set
/// aside, but a symlink for `img` (its user's, perhaps) only reported. Whether `locks` is usable.
fn layout(root: &Root, repair: bool, report: &mut Report) -> Result<bool> {
    root.create_layout_reporting(|name, bad| {
        let path = root.dir().join(name);
        let shown = path.display();
        let target = fs::read_link(&path)
            .map(|t| format!(" (to {})", t.display()))
            .unwrap_or_default();
        let users_own = name == "img" && bad.starts_with("a symlink");
        // Records it leads to (a directory of them moved elsewhere, linked back): set aside with it.
        let records = root.records_in_place_of(name);
        let kept = match records {
            0 => String::new(),
            n => format!("; it leads to {n} image record(s): {}", held_back_advice(&path)),
        };
        if repair && !users_own {
            let fixed = root.replace_with_dir(name);
            match &fixed {
                Ok(aside) => {
                    let aside = aside.display();
                    report.add("layout", Repaired, format!("{shown} was {bad}{target}: set aside as {aside}, nothing in it touched; an empty directory made in its place{kept}"));
                }
                Err(e) => report.add("layout", Problem, format!("{shown} is {bad}{target}: {e:#}")),
            }
            return fixed.is_ok();
        }
        let advice = if users_own {
            format!(" — {}", crate::planted::IMG_LINK)
        } else {
            report.by_repair();
            format!(" — stowage will not use it; '{STOWAGE} doctor --repair' sets it aside (renamed, never deleted) and makes the directory anew{kept}")
        };
        report.add("layout", Problem, format!("{shown} is {bad}{target}{advice}"));
        false
    })
}

/// What becomes of trees whose records a repair sets aside with layout directory `place`, and how
/// they are used again.
fn held_back_advice(place: &Path) -> String {
    let place = place.display();
    format!(
        "no tree is adopted while they are set aside (adopted, each image would lose its state and base); to use them, move the directory it leads to to {place}, in place of the empty one a repair makes there"
    )
}

/// What goes on without a catalog that cannot be used, and how it is put right.
const FROM_RECORDS: &str = "images are still used and listed, from their records";
const DERIVED: Hint = Hint(
    "it is derived from the records: 'stowage doctor --repair' sets it aside and makes it anew, and no image is lost",
);

/// The catalog's check; with `repair` one that cannot be used is set aside and made anew.
fn catalog(store: &mut Store, repair: bool, report: &mut Report) -> Result<Verdict> {
    use crate::catalog::{Found, Legacy};
    if let Some(status) = planted_catalog(store, repair, report)? {
        return Ok(status);
    }
    // SQLite opens a file it may not write read-only, and only a write fails.
    if files::catalog_modes(store.root(), repair, store.ctx().shared(), report) {
        return Ok(Problem);
    }
    let db = store.root().db();
    let shown = db.display();
    // A store of a release before records whose catalog is lost: its tokens are to migrate, not
    // records to judge (nor a catalog to make, which would say nothing of them).
    let legacy = match crate::migrate::is_legacy(store.root()) {
        true => crate::catalog::legacy_state(store.root()),
        false => Ok(None),
    };
    // Held by another program (asked once, bounded): whether it is to migrate cannot be told.
    if let Err(e) = &legacy
        && matches!(crate::error::typed(e), Some(crate::Error::Busy(_)))
    {
        return Ok(report.catalog(
            Problem,
            format!("{e:#}; nothing is migrated until it lets go"),
        ));
    }
    if let Ok(Some(Legacy::Lost(why))) = legacy {
        if !repair {
            return Ok(report.catalog(Problem, format!("{shown} lost ({why}) in a store of a release before image records: any command migrates it from its lock files (bases not known)")));
        }
        crate::migrate::run(store, None)?;
        let detail = format!("{shown} lost ({why}): the store migrated from its lock files");
        return Ok(report.catalog(Repaired, detail));
    }
    let found = match crate::catalog::again_on_io(|| {
        crate::catalog::inspect_file(&db, store.root())
    }) {
        Ok(f) => f,
        Err(e) if crate::catalog::is_busy(&e) => {
            return Ok(report.catalog(Problem, format!("{shown} is locked by a program outside stowage (an sqlite3 shell?); {FROM_RECORDS}")));
        }
        Err(e) if e.downcast_ref::<crate::catalog::StuckInWal>().is_some() => {
            return stuck_in_wal(store, repair, &e, report);
        }
        Err(e) if crate::catalog::is_damage(&e, &db) => Found::Replaced(format!("{e:#}")),
        // A check that cannot run says nothing of the catalog, and changes nothing.
        Err(e) => return Ok(report.catalog(Problem, format!("{shown}: cannot check it: {e:#}"))),
    };
    Ok(match found {
        Found::Legacy(v) if repair => {
            crate::migrate::run(store, None)?;
            report.catalog(Repaired, format!("{shown}: migrated from schema version {v}"))
        }
        Found::Legacy(v) => {
            report.catalog(Problem, format!("{shown}: schema version {v}, made by a release before image records; any command migrates it"))
        }
        Found::Replaced(why) if !repair => {
            report.by_repair().catalog(Problem, format!("{shown} cannot be used ({why}); {DERIVED}"))
        }
        Found::Replaced(why) => {
            let before = crate::store::file_id(&db);
            store.with_catalog(None, |_, _| Ok(()))?;
            // Found usable at the look under the global lock (what failed passed): nothing was set
            // aside, and the catalog is checked as it is now.
            if crate::store::file_id(&db) == before {
                return intact(store, repair, report);
            }
            report.catalog(Repaired, format!("{shown} could not be used ({why}): set aside and made anew from the records"))
        }
        // Never set aside or rebuilt: a rebuild at our schema would downgrade the store.
        Found::Newer(v) => report.catalog(Problem, format!("{shown}: schema version {v}, above this stowage's: the store was made by a newer stowage; upgrade stowage")),
        Found::New => empty_catalog(store, repair, report)?,
        Found::Current => intact(store, repair, report)?,
    })
}

/// A catalog in WAL mode that could not be switched back here (`e` says why); `repair` sets it
/// aside with its journal and WAL files, under the global lock, and makes it anew.
fn stuck_in_wal(
    store: &mut Store,
    repair: bool,
    e: &anyhow::Error,
    report: &mut Report,
) -> Result<Verdict> {
    let db = store.root().db();
    if !repair {
        return Ok(report
            .by_repair()
            .catalog(Problem, format!("{e:#}; {FROM_RECORDS}")));
    }
    let why = e
        .downcast_ref::<crate::catalog::StuckInWal>()
        .map_or_else(|| format!("{e:#}"), |s| s.why.clone());
    let aside = {
        let _global = store.global(None)?;
        store.close_catalog();
        // Switched back meanwhile (by a host that can): the catalog is kept.
        let wal = crate::catalog::in_wal(&db);
        wal.then(|| crate::store::set_aside(store.root(), "wal"))
            .transpose()?
    };
    store.with_catalog(None, |_, _| Ok(()))?;
    let shown = db.display();
    let detail = match aside {
        Some(aside) => format!(
            "{shown} was stuck in WAL mode ({why}): set aside as {} with its WAL files and made anew from the records",
            aside.display()
        ),
        None => format!("{shown} was stuck in WAL mode ({why}), and was switched back meanwhile"),
    };
    Ok(report.catalog(Repaired, detail))
}

/// A catalog with no schema yet (emptied, or made and never written): the next command fills it
/// from the records; `repair` makes it now, and one it cannot make is a problem.
fn empty_catalog(store: &mut Store, repair: bool, report: &mut Report) -> Result<Verdict> {
    let db = store.root().db();
    let shown = db.display();
    // One that may not be written was reported by `files::catalog_modes`.
    if !repair {
        let detail = format!("{shown}: empty; the next command fills it from the records");
        return Ok(report.catalog(Verdict::Ok, detail));
    }
    let made = store
        .with_catalog(None, |_, _| Ok(()))
        .and_then(|()| crate::catalog::inspect_file(&db, store.root()));
    let why = match made {
        Ok(crate::catalog::Found::Current) => return intact(store, repair, report),
        Ok(_) => "could not be made anew".to_owned(),
        Err(e) => format!("could not be made anew ({e:#})"),
    };
    Ok(report.catalog(
        Problem,
        format!("{shown} is empty and {why}; {FROM_RECORDS}"),
    ))
}

/// A catalog file (itself, journal, WAL) that is no regular file of its own; `repair` sets it aside.
fn planted_catalog(
    store: &mut Store,
    repair: bool,
    report: &mut Report,
) -> Result<Option<Verdict>> {
    for (path, what) in crate::catalog::files(&store.root().db()) {
        let Err(e) = crate::catalog::check_plain_file(&path, what) else {
            continue;
        };
        // A regular file of its own that may not be opened is the modes' to judge, and to give back.
        let plain = fs::symlink_metadata(&path).ok();
        if plain.is_some_and(|m| crate::planted::kind_of(m.mode(), m.nlink()).is_none()) {
            continue;
        }
        // Only a file found to be something else is set aside, not one that could not be looked at.
        let set_aside = e.downcast_ref::<crate::catalog::CatalogError>().is_some();
        if !repair || !set_aside {
            report.repairable |= set_aside;
            return Ok(Some(report.catalog(Problem, format!("{e:#}"))));
        }
        let _global = store.global(None)?;
        store.close_catalog();
        let aside = crate::store::set_aside_file(store.root(), &path, "planted")?;
        let (shown, aside) = (path.display(), aside.display());
        return Ok(Some(report.catalog(Repaired, format!("{shown} was no regular file of its own: set aside as {aside}; the catalog is made anew from the records"))));
    }
    Ok(None)
}

/// SQLite's own check of a current catalog; with `repair` a damaged one is set aside, made anew.
fn intact(store: &mut Store, repair: bool, report: &mut Report) -> Result<Verdict> {
    let db = store.root().db();
    let shown = db.display();
    crate::debug::pause("doctor-catalog-check");
    let checked = crate::catalog::again_on_io(|| {
        Ok(crate::catalog::quick_check(&crate::catalog::open(&db)?)?)
    });
    // Only SQLite saying the file is damaged is damage (not busy, an I/O error, a stale handle).
    let check = match checked {
        // Its answer is lines, the first a heading ("*** in database main ***"): one line here.
        Ok(check) => check
            .lines()
            .filter(|l| !l.starts_with("***"))
            .collect::<Vec<_>>()
            .join("; "),
        Err(e) if crate::catalog::is_damage(&e, &db) => format!("{e:#}"),
        Err(e) => {
            // SQLite names no file it could not open: what was put in one's place since, if any.
            let why = crate::catalog::check_files(&db).err().unwrap_or(e);
            return Ok(report.catalog(Problem, format!("{shown}: cannot check it: {why:#}")));
        }
    };
    if check == "ok" {
        // Intact but not writable (its journal cannot be made, an immutable root): every command
        // does without it, so it is no healthy catalog.
        if let Some(why) = crate::catalog::unwritable(&db) {
            let then = "commands go on from the images' records without it";
            return Ok(report.catalog(Problem, format!("{shown} cannot be written: {why}; {then}")));
        }
        let detail = format!("{shown}: intact, schema version {}", crate::catalog::SCHEMA);
        return Ok(report.catalog(Verdict::Ok, detail));
    }
    if !repair {
        return Ok(report
            .by_repair()
            .catalog(Problem, format!("{shown} is damaged ({check}); {DERIVED}")));
    }
    store.close_catalog();
    let aside = crate::store::set_aside(store.root(), "damaged")?;
    store.with_catalog(None, |_, _| Ok(()))?;
    let aside = aside.display();
    let detail = format!(
        "{shown} was damaged ({check}): set aside as {aside} and made anew from the records"
    );
    Ok(report.catalog(Repaired, detail))
}

/// Records a later release wrote: no damage, never rewritten here; the way out is that release.
fn newer_records(entries: &[Entry], report: &mut Report) {
    let newer: Vec<String> = (entries.iter())
        .filter(|e| e.seen.newer.is_some())
        .map(|e| e.path.display().to_string())
        .collect();
    report.naming("records", Problem, &newer, |files| {
        format!("the record in {files} was written by a newer stowage (a later format): the store was made by a newer stowage; upgrade stowage")
    });
}

/// Every record: damaged, interrupted removals, failed or dead writers, stale store-wide hints.
fn records(store: &mut Store, repair: bool, report: &mut Report) -> Result<()> {
    let root = store.root().clone();
    let entries = crate::census::take(&root)?;
    crate::debug::pause("doctor-listed");
    newer_records(&entries, report);
    // Something planted at a lock file is reported as such (files.rs), not as a damaged record.
    let damaged: Vec<&Entry> = (entries.iter())
        .filter(|e| e.seen.damaged && e.seen.newer.is_none() && !e.planted)
        .collect();
    // A record of another image's (copied over) is named: it is where to look for the cause.
    let files: Vec<_> = (damaged.iter())
        .map(|e| match &e.seen.foreign {
            Some(other) => format!("{} (image '{other}''s)", e.path.display()),
            None => e.path.display().to_string(),
        })
        .collect();
    // The image a file is for, where its name says (hashed names do not).
    let (name, them) = match damaged[..] {
        [one] => (
            Root::image_of_lock_file(&one.file).map(|n| n.to_string()),
            "its image's state is not known: it is kept",
        ),
        _ => (None, "their images' states are not known: they are kept"),
    };
    let name = name.unwrap_or_else(|| "NAME".into());
    report.naming("records", Problem, &files, |files| {
        format!("the record in {files} cannot be read, so {them}; '{STOWAGE} exec --write {name} -- true' marks one ready again, '{STOWAGE} rm {name}' removes it")
    });
    removals(store.ctx(), &entries, repair, report);
    let (restored, left) = crate::gc::restore_loans(&root, &entries, repair);
    report.naming("loans", Repaired, &restored, |names| {
        format!("restored the modes a killed copy of {names} left lent")
    });
    report.repairable |= !left.is_empty();
    let (refused, left): (Vec<_>, Vec<_>) = left.into_iter().partition(|(_, why)| why.is_some());
    let left: Vec<String> = left.into_iter().map(|(name, _)| name).collect();
    report.naming("loans", Problem, &left, |names| {
        format!("the trees of {names} keep modes a killed copy lent (its owner's read or search bits): the next copy of each, '{STOWAGE} gc' or '{STOWAGE} doctor --repair' restores them")
    });
    // Tried and refused: the reason names who must act instead (another user's loans).
    for (name, why) in refused {
        let why = why.unwrap_or_default();
        report.naming("loans", Problem, &[name], |name| {
            format!("the tree of {name} keeps modes a killed copy lent: {why}")
        });
    }
    // Incomplete images: those whose writer failed or died, and those adopted.
    let (adopted, failed): (Vec<&Record>, Vec<_>) = entries
        .iter()
        .filter(|e| e.state() == Some(State::Incomplete))
        .filter_map(|e| e.seen.record.as_ref())
        .partition(|r| r.outcome.as_deref() == Some(ADOPTED));
    let names = |rs: Vec<&Record>| -> Vec<String> { rs.iter().map(|r| r.name.clone()).collect() };
    report.naming("images", Info, &names(failed), |names| {
        format!("{names} incomplete: their writers failed or died; '{STOWAGE} gc' removes them")
    });
    report.naming("images", Info, &names(adopted), |names| {
        format!("{names} adopted without a record: whether complete is not known, so kept ('{STOWAGE} exec --write NAME -- true' marks one ready)")
    });
    hints(store, &entries, repair, report);
    Ok(())
}

/// Interrupted removals (records `deleting`): reported, or with `repair` finished under its lock.
fn removals(ctx: &Ctx, entries: &[Entry], repair: bool, report: &mut Report) {
    let done = crate::gc::finish_removals(ctx, entries, repair, true);
    for f in &done.failed {
        report.add("removals", Problem, f.clone());
    }
    report.naming("removals", Info, &done.underway, |names| {
        format!("removal of {names} is under way (a stowage process holds its lock)")
    });
    report.repairable |= !done.busy.is_empty();
    report.naming("removals", Problem, &done.busy, |names| match repair {
        false => format!("removal of {names} was interrupted; '{STOWAGE} gc' or '{STOWAGE} doctor --repair' finishes it"),
        true => format!("removal of {names} was interrupted, and its lock is held now: a later '{STOWAGE} gc' or '{STOWAGE} doctor --repair' finishes it"),
    });
    report.naming("removals", Repaired, &done.finished, |names| {
        format!("finished the interrupted removal of {names}")
    });
}

/// Store-wide hints a hold that is gone left behind.
fn hints(store: &Store, entries: &[Entry], repair: bool, report: &mut Report) {
    let hinted: Vec<&Entry> = entries.iter().filter(|e| e.seen.store_wide).collect();
    let free =
        || crate::store_wide::probe(store.root()).ok() == Some(crate::store_wide::Probe::Free);
    if hinted.is_empty() || !free() {
        return;
    }
    if !repair {
        report.add("hints", Info, format!("{} image lock file(s) carry the hint of a store-wide command that ended; the next user of each clears it", hinted.len()));
        return;
    }
    let mut cleared = 0;
    for e in hinted {
        // Asked again under each image's lock, as an image user asks: a hold that began since has
        // hinted this file already, or will hint it again once it gets the lock.
        if let Ok(Some(g)) = lock::acquire_no_wait(&e.path, Mode::Exclusive, lock::IfMissing::Fail)
            && free()
            && crate::image_record::set_store_wide(g.file(), false).is_ok()
        {
            cleared += 1;
            drop(g);
            crate::debug::pause("doctor-hint-cleared");
        }
    }
    let detail = format!("cleared the store-wide hint of {cleared} image lock file(s)");
    report.add("hints", Repaired, detail);
}

/// Whether the images directory is claimed for this store (`claim.rs`); `repair` claims it.
fn claim(root: &Root, config: &Config, images: &Dir, repair: bool, report: &mut Report) {
    let claim = crate::claim::read(images);
    let mine = crate::images_dir::my_claim(root, config).ok();
    // Another's claim is reported with the trees; ours under another id (a configuration made anew)
    // is put right by a repair, whatever root path it names (another mount of the same root).
    let ours = claim
        .as_ref()
        .is_some_and(|c| mine.as_ref().is_some_and(|m| c.same_store(m)));
    if let (Some(c), Some(m), true) = (&claim, &mine, ours && repair) {
        crate::images_dir::refresh_claim(images, c, m);
    }
    if claim.is_some() && (ours || !repair) {
        return;
    }
    let dir = config.images.path_in(root.dir());
    let shown = dir.display();
    if !repair {
        report.add("claim", Info, format!("{shown} is not marked as this store's images directory: another store's init would not be refused ('{STOWAGE} doctor --repair' marks it)"));
        return;
    }
    match crate::images_dir::claim(root, config, false, images) {
        Ok(true) => report.add("claim", Repaired, format!("marked {shown} as this store's images directory")),
        Ok(false) => report.add("claim", Info, format!("{shown}: its filesystem keeps no extended attributes, so it cannot be marked as this store's")),
        Err(e) => report.add("claim", Problem, format!("{e:#}")),
    }
}

/// In a group store, whether its images directory outside the root (`images`, at `dir`, confirmed
/// the store's) is its group's as its parts are; `repair` gives it what it lacks, if ours to change.
fn outside_images_dir(
    root: &Root,
    (images, dir): (&Dir, &Path),
    repair: bool,
    report: &mut Report,
) {
    use crate::sharing;
    let Some((gid, _)) = sharing::is_group_store(root.dir()) else {
        return;
    };
    let lacks = crate::dir::fstat(std::os::fd::AsFd::as_fd(images))
        .map(|st| sharing::images_dir_lacks(images, &st, gid))
        .with_context(|| format!("cannot inspect images directory {}", dir.display()));
    let (shown, label) = (dir.display(), sharing::group_label(gid));
    match lacks {
        Ok(None) => {}
        Err(e) => report.add("sharing", Problem, format!("{e:#}")),
        Ok(Some(lacks)) if !repair => report.by_repair().add("sharing", Problem, format!("images directory {shown} {lacks}: members cannot use what others make in it ('{STOWAGE} doctor --repair' by its owner or root gives it group {label})")),
        Ok(Some(_)) => match sharing::images_dir_to_group(images, dir, gid) {
            Ok(()) => report.add("sharing", Repaired, format!("gave images directory {shown} group {label} and group write (setgid, no default ACL)")),
            Err(e) => report.add("sharing", Problem, format!("{e:#}")),
        },
    }
}

/// Whether the external images directory `images` (at `dir`) is no images directory as `init`
/// judges one (by its path; unclaimed, by what it holds too): nothing there is claimed or adopted
/// then (store.conf may name it by a hand's edit or a copy; an adopted tree is one gc from
/// deletion). Reported.
fn no_images_dir(root: &Root, (images, dir): (&Dir, &Path), report: &mut Report) -> bool {
    if dir == root.default_images_dir() {
        return false;
    }
    let what = match crate::images_dir::claimable_unclaimed(images) {
        true => crate::system_dirs::not_for_images_kept(dir),
        false => crate::system_dirs::not_for_images(dir, false),
    };
    let Some(what) = what else {
        return false;
    };
    report.add("images", Problem, format!("images directory {} is {what}: nothing there is claimed or adopted; name the right one with '{STOWAGE} init --images-dir DIR'", dir.display()));
    true
}

/// Records vs trees: gone trees, trees without records, records naming another images directory.
fn trees(store: &mut Store, repair: bool, report: &mut Report) -> Result<()> {
    let root = store.root().clone();
    let mut config = crate::images_dir::config(&root)?;
    let dir = config.images.path_in(root.dir());
    if let Some(why) = crate::images_dir::not_usable(&root, &dir) {
        let detail = format!("{why}; no record is judged by its tree");
        report.add("images", Problem, detail);
        return Ok(());
    }
    // Made only by a repair, and only where no images directory is recorded yet.
    let unrecorded = repair && config.identity.is_none();
    let images =
        crate::images_dir::confirmed(&root, &dir, root.open_or_make_images_dir(&dir, unrecorded))?;
    let unfit = no_images_dir(&root, (&images, &dir), report);
    if !unfit {
        claim(&root, &config, &images, repair, report);
    }
    if dir != root.default_images_dir() {
        outside_images_dir(&root, (&images, &dir), repair, report);
    }
    let entries = crate::census::take(&root)?;
    crate::debug::pause("doctor-records-read");
    // Records whose trees are all there is of them: with none listed, the directory is in doubt.
    let stand = |e: &crate::census::Entry| {
        (e.seen.record.as_ref())
            .is_some_and(|r| stands_for_its_tree(r, r.state_seen(e.writer_alive)))
    };
    let listed = images.listing();
    let listed = listed.with_context(|| format!("cannot list images directory {}", dir.display()));
    // Each entry's type as the listing gives it: a tree that is no directory costs no stat.
    let listed: HashMap<_, _> = listed?.into_iter().map(|e| (e.name, e.kind)).collect();
    if listed.is_empty() && entries.iter().any(stand) {
        report.add("images", Problem, format!("images directory {} is empty while images are recorded: is it mounted? (if their trees are really gone, '{STOWAGE} rm' the images); no record is judged by its tree", dir.display()));
        return Ok(());
    }
    if repair {
        crate::images_dir::record_identity(&root, &mut config, false, || store.global(None))?;
    }
    let (mut named, mut foreign, mut gone) = (HashSet::new(), Vec::new(), Vec::new());
    let mut not_trees = Vec::new();
    for e in &entries {
        // A record that cannot be read is still the image's: reported under "records". An empty
        // lock file names nothing: its tree is an orphan.
        named.extend(e.image());
        let Some(r) = e.seen.record.as_ref() else {
            continue;
        };
        if r.images != config.images {
            foreign.push(r.name.clone());
            continue;
        }
        let Ok(n) = ImageName::parse(&r.name) else {
            continue;
        };
        // By the listing, asked now: a client's cached lookup may miss a tree made on another host.
        match listed.get(std::ffi::OsStr::new(n.encoded())) {
            None if stand(e) => gone.push(n),
            Some(&kind) if stand(e) && kind != libc::DT_DIR => not_trees.push((n, kind)),
            _ => {}
        }
    }
    no_directory(&images, &dir, &not_trees, report);
    if !foreign.is_empty() {
        report.add("images", Problem, format!("the records of {} name another images directory than the store's ({}): they are left alone; remove them with '{STOWAGE} rm'", list(&foreign), dir.display()));
    }
    missing_trees(store.ctx(), &gone, repair, report);
    let mut orphans = adopt::orphans(&images, &dir, &named, false)?;
    crate::debug::pause("doctor-orphans-found");
    // An image created since the records were read: its record came before its tree.
    orphans
        .trees
        .retain(|(n, _)| !adopt::has_record(&root.image_lock(n)));
    if unfit {
        return Ok(());
    }
    orphan_trees(store, &config, &orphans, dir.display(), repair, report)
}

/// Trees without a record: reported, or with `repair` adopted one by one, each failure with why;
/// as `ready` where an `init` adopting them so was interrupted.
fn orphan_trees(
    store: &Store,
    config: &Config,
    orphans: &adopt::Orphans,
    shown: std::path::Display,
    repair: bool,
    report: &mut Report,
) -> Result<()> {
    for (entry, why) in &orphans.skipped {
        let detail = format!("{entry:?} in {shown} is no image ({why}); left alone");
        report.add("images", Info, detail);
    }
    if held_back(store.root(), orphans, &shown, report) {
        return Ok(());
    }
    let mut emptied = emptied_records(store.root(), orphans);
    let (how, state) = match config.adopting {
        true => (Adopt::AsReady, "ready"),
        false => (Adopt::Unknown, "incomplete"),
    };
    if !repair {
        say_emptied(report, &emptied);
        let orphaned: Vec<_> = orphans.trees.iter().map(|(n, _)| n).collect();
        let (have, them) = match orphaned.len() {
            1 => ("has", "it"),
            _ => ("have", "them"),
        };
        report.repairable |= !orphaned.is_empty();
        report.naming("images", Problem, &orphaned, |names| {
            format!("{names} in {shown} {have} no record; '{STOWAGE} doctor --repair' adopts {them} as {state}")
        });
        return Ok(());
    }
    let done = adopt::adopt(store.root(), config, orphans, how)?;
    // Only those adopted: a tree gone meanwhile (removed on another host) lost no record.
    emptied.retain(|n| done.names.contains(&n.to_string()));
    say_emptied(report, &emptied);
    if config.adopting {
        adopt::mark_adopting(store, false)?;
    }
    let n = done.names.len();
    report.naming("images", Repaired, &done.names, |names| {
        let why = match config.adopting {
            true => "an init adopting them so was interrupted",
            false => &format!("whether complete is not known, so they are kept ('{STOWAGE} exec --write NAME -- true' marks one ready)"),
        };
        format!("adopted {n} tree(s) without a record ({names}) as {state}: {why}")
    });
    for why in done.left {
        let detail = format!("cannot adopt the tree without a record {why}");
        report.add("images", Problem, detail);
    }
    Ok(())
}

/// Says the images whose record a shell's `>` likely erased, what that lost, and the cure.
fn say_emptied(report: &mut Report, emptied: &[ImageName]) {
    report.naming("images", Info, emptied, |names| {
        format!("the lock file of {names} holds no record while its tree is there: most likely a shell's '>' opened it (as in '9>FILE'; lock it with 'flock FILE CMD' or open it with '<>'), erasing the record, the image's only state; adopted, an image is incomplete and its base is lost: once its tree is known to be whole, '{STOWAGE} exec --write NAME -- true' marks it ready")
    });
}

/// Trees without a record whose lock file holds none either (hints aside, no unlinker's mark):
/// likely emptied by an opener (`images_dir::record_erased`). The catalog's row is no copy to
/// restore it from: a write that failed since may not be in it.
fn emptied_records(root: &Root, orphans: &adopt::Orphans) -> Vec<ImageName> {
    let erased = |n: &&ImageName| crate::images_dir::record_erased(root, n) == Some(true);
    orphans
        .trees
        .iter()
        .map(|(n, _)| n)
        .filter(erased)
        .cloned()
        .collect()
}

/// Whether trees without a record are held back from adoption: records a repair set aside with a
/// layout directory (a symlink in `locks`' or `locks/images`' place) may be theirs. Reported.
fn held_back(
    root: &Root,
    orphans: &adopt::Orphans,
    shown: &std::path::Display,
    report: &mut Report,
) -> bool {
    if orphans.trees.is_empty() {
        return false;
    }
    let aside = root.records_set_aside();
    let Some((at, to, n)) = aside.first() else {
        return false;
    };
    let to = to
        .as_ref()
        .map_or_else(String::new, |t| format!(", to {}", t.display()));
    let names: Vec<_> = orphans.trees.iter().map(|(n, _)| n).collect();
    // `locks.planted-*` holds the whole of `locks`; `locks/images.planted-*` the records alone.
    let whole = at
        .file_name()
        .is_some_and(|f| f.to_string_lossy().starts_with("locks."));
    let advice = held_back_advice(&if whole {
        root.locks()
    } else {
        root.image_locks()
    });
    let at = at.display();
    let have = if names.len() == 1 { "has" } else { "have" };
    report.naming("images", Problem, &names, |names| {
        format!("{names} in {shown} {have} no record, but {n} image record(s) are set aside in {at}{to}: {advice}; if they are not this store's, remove {at}")
    });
    true
}

/// Whether a record in `state` says no more than its tree, so that tree gone, the image is: a
/// ready one's or an adopted one's (kept forever if adopted from a client's stale lookup).
fn stands_for_its_tree(r: &Record, state: State) -> bool {
    state == State::Ready || (state == State::Incomplete && r.outcome.as_deref() == Some(ADOPTED))
}

/// Ready or adopted images whose tree in `images` (at `dir`) is no directory (a FIFO, a file, a
/// symlink put in its place): reported, never removed by a repair (what is there is not ours).
fn no_directory(images: &Dir, dir: &Path, found: &[(ImageName, u8)], report: &mut Report) {
    for (n, kind) in found {
        let enc = n.encoded();
        // `d_type` says `DT_UNKNOWN` where the filesystem does not tell: asked by a stat.
        let mode = match *kind {
            libc::DT_UNKNOWN => match images.stat_at(enc) {
                Ok(Some(st)) if !st.is_dir() => st.mode,
                _ => continue,
            },
            kind => u32::from(kind) << 12,
        };
        let what = crate::planted::kind_name(mode);
        let to = nix::fcntl::readlinkat(images, enc).map_or_else(
            |_| String::new(),
            |t| format!(" (to {})", Path::new(&t).display()),
        );
        let tree = dir.join(enc);
        report.add("images", Problem, format!("image '{n}' is recorded, but its tree {} is {what}{to}, not a directory: a read of it finds no image tree; it is left as it is (a repair deletes nothing it did not make): move it away and write the image anew, or '{STOWAGE} rm {n}'", tree.display()));
    }
}

/// Ready or adopted records whose trees are gone (deleted by hand): the image is gone.
fn missing_trees(ctx: &Ctx, gone: &[ImageName], repair: bool, report: &mut Report) {
    if !repair {
        let (have, them) = match gone.len() {
            1 => ("has a record", "it"),
            _ => ("have records", "their records"),
        };
        report.repairable |= !gone.is_empty();
        report.naming("images", Problem, gone, |names| {
            format!("{names} {have} but no tree; '{STOWAGE} doctor --repair' drops {them}")
        });
        return;
    }
    let root = &ctx.root;
    let (mut dropped, mut busy, mut read) = (Vec::new(), Vec::new(), Vec::new());
    for n in gone {
        let h = match crate::gc::take_to_repair(ctx, n) {
            Taken::Held(h) => h,
            // Held shared, it is read: no removal or write is changing it.
            Taken::Busy if being_read(root, n) => {
                read.push(n.as_str());
                continue;
            }
            Taken::Busy => {
                busy.push(n.as_str());
                continue;
            }
            Taken::Failed(err) => {
                let detail = format!("cannot drop the record of '{n}': {err}");
                report.add("images", Problem, detail);
                continue;
            }
            Taken::Gone => continue,
        };
        let _named = crate::gc::named_hold(root, n, "stowage doctor --repair");
        // Gone by the filesystem's own word (not a lookup a client answers from its caches).
        let still = h.seen.record.as_ref().is_some_and(|r| {
            stands_for_its_tree(r, r.state)
                && crate::images_dir::of_record(root, r).is_ok_and(|d| {
                    crate::images_dir::tree_there(root, &d, n.encoded()) == Some(false)
                })
        });
        if still && root.drop_record(n, h.guard).is_ok() {
            dropped.push(n.as_str().to_owned());
        }
    }
    report.naming("images", Repaired, &dropped, |names| {
        format!("dropped the records of {names}, whose trees are gone")
    });
    let are = if read.len() == 1 { "is" } else { "are" };
    report.naming("images", Problem, &read, |names| {
        format!("{names} had no tree when the records were read, yet {are} read now: a later '{STOWAGE} doctor --repair' drops the records")
    });
    // In use: a removal (on another host, say) or a write may be changing it; no verdict yet.
    let (had, are) = if busy.len() == 1 {
        ("had", "is")
    } else {
        ("had", "are")
    };
    report.naming("images", Info, &busy, |names| {
        format!("{names} {had} no tree when the records were read, and {are} in use now (a removal or a write under way?): judged again by the next '{STOWAGE} doctor'")
    });
}

/// Whether image `name`'s lock is held shared now (read, not written or removed).
fn being_read(root: &Root, name: &ImageName) -> bool {
    let path = root.image_lock(name);
    matches!(
        lock::look(&path, root.lock_queries()),
        Ok(lock::Probe::Shared)
    )
}

/// The trash, lock files that name no image, dead leases.
fn leftovers(store: &mut Store, repair: bool, report: &mut Report) -> Result<()> {
    let root = store.root().clone();
    // A trash that is no directory: reported with the layout.
    let trash = remove::empty_trash(&root, repair).unwrap_or_default();
    for f in &trash.failed {
        report.add("trash", Problem, f.clone());
    }
    if !trash.entries.is_empty() {
        let (n, size) = (trash.entries.len(), crate::disk_usage::human(trash.bytes));
        let what = format!("{n} left in {} ({size})", root.trash().display());
        report
            .by_repair()
            .swept("trash", repair.then_some("deleted"), Problem, what);
    }
    if trash.underway > 0 {
        let what = format!("{} being deleted by running removals", trash.underway);
        report.add("trash", Info, what);
    }
    // On a filesystem where lock files are never unlinked, empty ones are no leftovers.
    if lock::unlinks_allowed(&root.image_locks().join("x.lock")) {
        let empty: Vec<Entry> = crate::census::take(&root)?
            .into_iter()
            .filter(|e| e.seen.names_nothing())
            .collect();
        let removed = (empty.iter())
            .filter(|e| repair && root.unlink_if_empty(&e.path))
            .count();
        // Those left are in use, or on a disk too full to mark one gone: the next repair's.
        for (n, fixed) in [(removed, Some("removed")), (empty.len() - removed, None)] {
            if n > 0 {
                let what = format!("{n} lock file(s) that name no image");
                report.swept("locks", fixed, Info, what);
            }
        }
    }
    config_temps(&root, repair, report)?;
    if repair {
        let n = crate::holders::Look::new(store.ctx()).clean_leases();
        if n > 0 {
            let detail = format!("removed {n} lease(s) of processes that are gone");
            report.add("leases", Repaired, detail);
        }
    }
    Ok(())
}

/// Temporary files of a `store.conf` write cut short (`.store.conf.PID.RANDOM`): one lives for
/// milliseconds, so one with a ctime 10 minutes old (slack for a server's clock) is a leftover.
fn config_temps(root: &Root, repair: bool, report: &mut Report) -> Result<()> {
    let cannot = || format!("cannot list {}", root.dir().display());
    let dir = root.open()?.sub(".").with_context(cannot)?;
    let prefix = format!(".{}.", crate::config::FILE);
    let now = clock::now_ms() / 1000;
    let mut left = Vec::new();
    for c in dir.entries().with_context(cannot)? {
        let Some(n) = c.to_str().ok().filter(|n| n.starts_with(&prefix)) else {
            continue;
        };
        if dir
            .lstat_at(&c)
            .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_ctime + 600 < now)
        {
            left.push(n.to_owned());
        }
    }
    if left.is_empty() {
        return Ok(());
    }
    if repair {
        left.retain(|n| dir.unlink(n).is_ok());
    }
    let (n, at) = (left.len(), root.dir().display());
    let what = format!("{n} temporary file(s) of a configuration write cut short in {at}");
    report.swept("config", repair.then_some("removed"), Info, what);
    Ok(())
}

/// "'a', 'b' and 3 more"; every caller has a name at least.
fn list(names: impl IntoIterator<Item = impl std::fmt::Display>) -> String {
    let names: Vec<String> = names.into_iter().map(|n| format!("'{n}'")).collect();
    match names.len() {
        n if n > 5 => format!("{} and {} more", names[..5].join(", "), n - 5),
        _ => names.join(", "),
    }
}
