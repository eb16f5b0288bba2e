//! `stowage doctor`: is this store safe to use, and is it consistent?
//!
//! Checks, in order: the filesystem and whether flock(2) really excludes
//! there (two opens of one file must conflict); NFS mounts whose locks are
//! local only (cross-host exclusion silently off); the database (integrity,
//! schema, journal mode); records whose locks say otherwise; rows without
//! trees and trees without rows; incomplete images; removals a crash
//! interrupted, trash, stray lock files.
//!
//! Without `--repair` nothing changes (judgements run in transactions that
//! are rolled back). With it, what is safe is fixed: stale records dropped,
//! dead writers' images marked incomplete, interrupted removals finished,
//! orphan trees adopted, rows of vanished trees dropped, trash emptied, the
//! schema migrated — and a damaged database is moved aside (never deleted)
//! and rebuilt from the images directory, so no image is lost.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::adopt::{self, Adopt, Mount};
use crate::clock;
use crate::ctx::Ctx;
use crate::filesystem;
use crate::lock;
use crate::meta::{self, ImageState, Tx};
use crate::name::ImageName;
use crate::remove;
use crate::store::Store;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    /// Worth knowing, not a fault.
    Info,
    Problem,
    Repaired,
}

impl Verdict {
    /// As `doctor --json` names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Info => "info",
            Verdict::Problem => "problem",
            Verdict::Repaired => "repaired",
        }
    }
}

#[derive(Debug)]
pub struct Check {
    pub check: &'static str,
    pub status: Verdict,
    pub detail: String,
}

#[derive(Debug)]
pub struct Report {
    pub root: String,
    pub filesystem: String,
    /// False when flock does not work (or is unsafe) here: exit 69.
    pub locking: bool,
    pub healthy: bool,
    pub checks: Vec<Check>,
}

impl Report {
    fn add(&mut self, check: &'static str, status: Verdict, detail: impl Into<String>) {
        self.checks.push(Check {
            check,
            status,
            detail: detail.into(),
        });
    }
}

/// The two-host probe's lock file: `ROOT/locks/probe.lock`.
fn probe_file(root: &crate::root::Root) -> PathBuf {
    root.locks().join("probe.lock")
}

/// `doctor --hold-probe SECONDS`: holds the probe lock that `doctor` on
/// another host looks for, and says who holds it in the file. When that
/// doctor sees it held, locks taken on this host exclude processes there —
/// the real test where mount options cannot tell (Lustre's default, a
/// client configuration out of reach).
pub fn hold_probe(store: &Store, secs: std::time::Duration) -> Result<()> {
    let root = store.root();
    root.create_layout()?;
    let path = probe_file(root);
    let ctx = store.ctx();
    let Some(guard) = lock::acquire_no_wait(&path, lock::Mode::Exclusive, lock::IfMissing::Create)
        .map_err(|e| crate::lock::error("the probe lock", &path, e))?
    else {
        return Err(crate::Error::Busy(crate::error::Busy {
            what: format!("the probe lock {}", path.display()),
            holders: format!("held by another probe: {}", probe_holder(&path)),
            waited: std::time::Duration::ZERO,
        })
        .into());
    };
    let since = clock::now_ms();
    guard
        .set_contents(
            format!(
                "{}\t{}\t{}\n",
                ctx.me.host,
                ctx.me.pid,
                clock::rfc3339(since).unwrap_or_else(|| "?".into())
            )
            .as_bytes(),
        )
        .with_context(|| format!("cannot write {}", path.display()))?;
    ctx.say(&format!(
        "holding the probe lock {} on host {} for {:.0} s: run 'stowage doctor' on another host sharing this root now",
        path.display(),
        ctx.me.host,
        secs.as_secs_f64()
    ));
    std::thread::sleep(secs);
    drop(guard);
    Ok(())
}

/// Who the probe file says holds it.
fn probe_holder(path: &Path) -> String {
    match fs::read_to_string(path) {
        Ok(text) => {
            let f: Vec<&str> = text.trim().split('\t').collect();
            match f.as_slice() {
                [host, pid, since] => format!("host {host}, pid {pid}, since {since}"),
                _ => "an unknown holder".into(),
            }
        }
        Err(_) => "an unknown holder".into(),
    }
}

/// Reports a probe lock held by `doctor --hold-probe`, here or elsewhere.
fn probe_check(ctx: &Ctx, report: &mut Report) {
    let path = probe_file(&ctx.root);
    let Ok(lock::Probe::Exclusive) = lock::probe(&path) else {
        return;
    };
    let text = fs::read_to_string(&path).unwrap_or_default();
    let host = text.split('\t').next().unwrap_or("");
    let who = probe_holder(&path);
    if host == ctx.me.host {
        report.add(
            "probe",
            Verdict::Info,
            format!("the probe lock is held on this host ({who}); run 'stowage doctor' on another host to test locks across hosts"),
        );
    } else {
        report.add(
            "probe",
            Verdict::Ok,
            format!("the probe lock held on another host ({who}) is seen held here: locks taken there exclude processes here"),
        );
    }
}

/// The file that remembers a non-default images directory outside the
/// database, so a rebuild of a damaged database still finds the images.
pub fn images_dir_note(root: &crate::root::Root) -> PathBuf {
    root.dir().join("images-dir")
}

/// Records the images directory beside the database (atomically).
pub fn write_images_dir_note(root: &crate::root::Root, dir: &Path) -> Result<()> {
    let note = images_dir_note(root);
    let tmp = note.with_extension("tmp");
    // Never through a link planted at the temporary name: it goes first,
    // and the file is created anew without following one.
    let _ = fs::remove_file(&tmp);
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        writeln!(f, "{}", dir.display())
            .with_context(|| format!("cannot write {}", tmp.display()))?;
    }
    fs::rename(&tmp, &note).with_context(|| format!("cannot write {}", note.display()))
}

pub fn run(store: &mut Store, repair: bool) -> Result<Report> {
    let root = store.root().clone();
    if !repair && !root.exists() {
        return Err(crate::Error::NoRoot(root.dir().to_owned()).into());
    }
    let fs_info = filesystem::filesystem(root.dir()).ok();
    let mut report = Report {
        root: root.dir().display().to_string(),
        filesystem: fs_info
            .as_ref()
            .map_or_else(|| "unknown".into(), |f| f.name.clone()),
        locking: true,
        healthy: true,
        checks: Vec::new(),
    };
    if let Some(f) = &fs_info {
        let kind = if f.local {
            "local: the kernel's lock table shows every holder"
        } else {
            "shared or unknown: lock-status probes locks, and waits re-issue blocked requests every 250 ms"
        };
        report.add("filesystem", Verdict::Info, format!("{} ({kind})", f.name));
    }

    // The layout: a symlink planted in place of one of the root's
    // directories is reported, never followed.
    if !layout(&root, repair, &mut report)? {
        report.healthy = false;
        return Ok(report);
    }

    // Does flock exclude here at all?
    // Private to this process: two doctors at once must not test against
    // each other's lock.
    let probe = root
        .locks()
        .join(format!(".doctor.{}.lock", std::process::id()));
    match lock::opens_conflict(&probe) {
        Ok(true) => report.add(
            "flock",
            Verdict::Ok,
            "two opens of one file exclude each other",
        ),
        Ok(false) => {
            report.locking = false;
            report.add(
                "flock",
                Verdict::Problem,
                "two opens of one file do NOT exclude each other: flock is a no-op on this filesystem",
            );
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            // Not a locking fault: this user may not write the store.
            report.add(
                "access",
                Verdict::Problem,
                format!(
                    "cannot create a file in {}: {e} — you may not write this store ({}); stowage needs to write its lock files and database to check or use it (ask its owner, or share it with a group: see docs/design.md)",
                    root.locks().display(),
                    owner_phrase(root.dir())
                ),
            );
            report.healthy = false;
            return Ok(report);
        }
        Err(e) => {
            report.locking = false;
            let advice = if crate::error::flock_unsupported(&e) {
                " — is this NFS mounted with 'nolock', or a filesystem without flock? mount it with locking, or put the root elsewhere"
            } else {
                ""
            };
            report.add(
                "flock",
                Verdict::Problem,
                format!("cannot lock {}: {e}{advice}", probe.display()),
            );
        }
    }
    if let (Ok(locks), Some(name)) = (
        root.open_sub(crate::root::Root::LOCKS_REL),
        probe.file_name(),
    ) {
        let _ = locks.unlink(name);
    }

    // Shared filesystems mounted so that locks stay on each host.
    let (reach, mount) = filesystem::lock_reach(root.dir());
    match reach {
        filesystem::Reach::NodeLocal { why, advice } => {
            report.locking = false;
            let at = mount
                .as_ref()
                .map_or_else(String::new, |m| format!("{}: ", m.mount_point.display()));
            report.add(
                "mount",
                Verdict::Problem,
                format!("{at}{why}, so builds and metadata updates on different hosts do not exclude each other; {advice}"),
            );
        }
        filesystem::Reach::Unknown { why } => report.add(
            "mount",
            Verdict::Info,
            format!(
                "{why}; to check, run 'stowage doctor --hold-probe 60' on one host and 'stowage doctor' on another within the minute"
            ),
        ),
        filesystem::Reach::ClusterWide => {
            if let Some(m) = mount.or_else(|| filesystem::mount_of(root.dir())) {
                report.add(
                    "mount",
                    Verdict::Ok,
                    format!("{} ({}) on {}", m.mount_point.display(), m.fstype, m.source),
                );
            }
        }
    }
    probe_check(store.ctx(), &mut report);
    if !report.locking {
        report.healthy = false;
        return Ok(report);
    }

    // The database: its consistency is checked only if it is usable.
    let (status, detail) = database(store, repair)?;
    report.add("database", status, detail);
    if status != Verdict::Problem {
        consistency(store, repair, &mut report)?;
    }
    report.healthy = !report.checks.iter().any(|c| c.status == Verdict::Problem);
    Ok(report)
}

/// "owned by uid U, group G, mode M" of a directory, for permission
/// messages.
fn owner_phrase(dir: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    match fs::metadata(dir) {
        Ok(m) => format!(
            "{} is owned by uid {}, group {}, mode {:o}",
            dir.display(),
            m.uid(),
            m.gid(),
            m.mode() & 0o7777
        ),
        Err(e) => format!("{}: {e}", dir.display()),
    }
}

/// Checks that the root's own directories are directories, creating the
/// missing ones. A symlink in place of the trash is replaced when
/// repairing (only the link goes; nothing is followed); one in place of
/// anything else is reported with advice, as it may have been made on
/// purpose. Returns whether the locks directories are usable.
fn layout(root: &crate::root::Root, repair: bool, report: &mut Report) -> Result<bool> {
    root.create_layout_reporting(|name, bad| {
        let path = root.dir().join(name);
        let target = fs::read_link(&path)
            .map(|t| format!(" (to {})", t.display()))
            .unwrap_or_default();
        if name == "trash" && repair {
            let fixed = root.replace_with_dir(name);
            report.add(
                "layout",
                if fixed.is_ok() {
                    Verdict::Repaired
                } else {
                    Verdict::Problem
                },
                match fixed {
                    Ok(()) => format!(
                        "{} was {bad}{target}; nothing in it was touched — replaced with an empty directory",
                        path.display()
                    ),
                    Err(e) => format!("{} is {bad}{target}: {e:#}", path.display()),
                },
            );
            return;
        }
        let advice = match name {
            "img" => " — stowage never deletes through it; to keep images elsewhere use 'stowage init --images-dir DIR' on a new root",
            "trash" => " — nothing in it is touched; 'stowage doctor --repair' replaces it with a directory",
            _ => " — stowage will not use it; remove it (with no stowage running) and run any command to recreate it",
        };
        report.add(
            "layout",
            Verdict::Problem,
            format!("{} is {bad}{target}{advice}", path.display()),
        );
    })
}

/// The database's verdict, upgrading or rebuilding it when repairing.
fn database(store: &mut Store, repair: bool) -> Result<(Verdict, String)> {
    let db = store.root().db();
    let db = db.display();
    let ours = meta::schema_version();
    Ok(match inspect_db(store)? {
        Health::Good { version } if version == ours || version == 0 => {
            if version == 0 {
                store.migrate(None)?;
            }
            (Verdict::Ok, format!("{db}: intact, schema version {ours}"))
        }
        Health::Good { version } if version < ours && repair => {
            store.migrate(None)?;
            (
                Verdict::Repaired,
                format!("{db}: schema upgraded from version {version} to {ours}"),
            )
        }
        Health::Good { version } if version < ours => (
            Verdict::Problem,
            format!(
                "{db}: schema version {version}, this stowage uses {ours} (any command upgrades it)"
            ),
        ),
        Health::Good { version } => (
            Verdict::Problem,
            format!(
                "{db}: schema version {version} is newer than this stowage ({ours}); use a newer stowage"
            ),
        ),
        Health::Damaged(why) if repair => {
            let r = rebuild(store)?;
            (
                Verdict::Repaired,
                format!(
                    "{db} was damaged ({why}); moved to {} and rebuilt from {}: {} images ({} with their recorded state){}",
                    r.moved_to.display(),
                    r.images_dir.display(),
                    r.images,
                    r.salvaged,
                    if r.slot_classes_lost {
                        "; slot classes could not be recovered: set them again with 'stowage slots set'"
                    } else {
                        ""
                    }
                ),
            )
        }
        Health::Damaged(why) => (
            Verdict::Problem,
            format!(
                "{db} is damaged ({why}); 'stowage doctor --repair' moves it aside and rebuilds it from the images directory (no image is lost)"
            ),
        ),
    })
}

enum Health {
    Good { version: i64 },
    Damaged(String),
}

/// Opens the database under the global lock and asks SQLite whether it is
/// intact. Never fails on a damaged file: that is a finding.
fn inspect_db(store: &mut Store) -> Result<Health> {
    let global = store.global()?;
    let db = store.root().db();
    store.close_db();
    let result = (|| -> rusqlite::Result<(String, i64)> {
        let conn = meta::open(&db).map_err(|_| rusqlite::Error::InvalidQuery)?;
        meta::quick_check(&conn)
    })();
    drop(global);
    Ok(match result {
        Ok((check, version)) if check == "ok" => Health::Good { version },
        Ok((check, _)) => Health::Damaged(check),
        Err(e) => Health::Damaged(e.to_string()),
    })
}

struct Rebuilt {
    moved_to: PathBuf,
    images_dir: PathBuf,
    images: usize,
    salvaged: usize,
    slot_classes_lost: bool,
}

/// Moves a damaged database aside and builds a new one from the images
/// directory, keeping whatever the damaged file still yields (states,
/// lineage, times, the images directory, slot classes). A store-wide
/// operation: it waits until no image lock is held.
fn rebuild(store: &mut Store) -> Result<Rebuilt> {
    // The store-wide lock and its hints first: reads of the fast path
    // (record.rs) take no global lock, so they are what keeps them out
    // while the rows are made again; then the ready tokens go, since the
    // rebuilt rows vouch for none of them (the next read of each image
    // writes its token again).
    // Inside a store-wide command's own command, the hold is ours already.
    if crate::store_wide::inside_hold(store.root()) {
        // The hints are set again (whoever holds store.lock above us may
        // not be a stowage hold that set them) and left for the holder,
        // or the next reader, to clear.
        crate::record::mark_store_wide(&store.root().image_locks(), true)
            .context("cannot mark the image lock files")?;
        return rebuild_marked(store);
    }
    let _store_wide = crate::store_wide::lock_store(store, None, false)?;
    // The store-wide hint tells reads of the fast path to ask store.lock;
    // cleared again, still holding it, however the rebuild ends.
    let locks = store.root().image_locks();
    let out = crate::record::mark_store_wide(&locks, true)
        .context("cannot mark the image lock files")
        .and_then(|()| rebuild_marked(store));
    let _ = crate::record::mark_store_wide(&locks, false);
    out
}

/// [`rebuild`], holding the store-wide lock with every image lock file
/// marked.
fn rebuild_marked(store: &mut Store) -> Result<Rebuilt> {
    let global = store.global_with_images_free("rebuilding the metadata database", None)?;
    crate::debug::pause("rebuild-images-free");
    // A writer's record stays (`crate::written::is_writers`): it is the
    // truth about its image while its marker stands, which the damaged
    // database could not fold, and the rebuilt rows' first transaction
    // folds it (a `ready` one keeps a salvaged ready row ready, anything
    // else makes it incomplete); emptied, it would fold to incomplete
    // whatever it said. It names the old database's identity, so no read
    // or write takes it for a token of the rebuilt one.
    crate::record::invalidate_all(&store.root().image_locks(), crate::written::is_writers)
        .context("cannot clear the image records of the lock files")?;
    store.close_db();
    let root = store.root().clone();
    let db = root.db();
    let salvage = meta::salvage(&db);
    let stamp = clock::rfc3339(clock::now_ms())
        .unwrap_or_else(|| "unknown-time".into())
        .replace(':', "");
    let mut moved_to = root.db_aside(&stamp, 0);
    // The new database is built beside the old one and renamed over it
    // only when complete: a rebuild killed at any point leaves either the
    // damaged database (the next repair starts again) or the rebuilt one,
    // never a missing one that the next command would recreate empty —
    // forgetting every image and the images directory.
    let (building, building_journal) = root.db_rebuilding();
    let _ = fs::remove_file(&building);
    let _ = fs::remove_file(&building_journal);

    let images_dir = salvage
        .config
        .get("images_dir")
        .map(PathBuf::from)
        .or_else(|| {
            fs::read_to_string(images_dir_note(&root))
                .ok()
                .map(|s| PathBuf::from(s.trim()))
        })
        .unwrap_or_else(|| root.default_images_dir());

    let mut conn = meta::open(&building)?;
    let tx = Tx::begin(&mut conn, global)?;
    tx.migrate()?;
    if images_dir != root.default_images_dir() {
        tx.set_config("images_dir", &images_dir.display().to_string())?;
    }
    let classes_lost = salvage.slot_classes.is_none();
    for c in salvage.slot_classes.unwrap_or_default() {
        // Every class has its directory (schema 7); its records, of the
        // old database, send acquirers to this one, which rewrites them.
        crate::slots::make_class_dir(&root, &c.name)?;
        tx.set_slot_class(&c)?;
    }
    if let Some(id) = salvage.config.get("images_dir_identity") {
        tx.set_config("images_dir_identity", id)?;
    }
    // Every salvaged row, whether its tree is there or not: a missing tree
    // is judged next by the consistency check, which keeps rows while the
    // images directory looks unmounted.
    for row in salvage.images.values() {
        tx.insert_image(row)?;
    }
    // New images written without the database since its last fold: their
    // records say what the damaged database could not.
    let salvaged = salvage.images.len()
        + crate::written::salvage_new(&tx, &root, &images_dir)
            .context("cannot read the image records of the lock files")?;
    // The other trees' readiness is unknown (see adopt.rs).
    let adopted = match adopt::mount(&tx, &root, &images_dir, false)? {
        Mount::Ours(d) | Mount::Empty(d) => {
            adopt::adopt(&tx, &root, &d, &images_dir, Adopt::Unknown, &HashMap::new())?
                .0
                .trees
                .len()
        }
        Mount::Missing(_) | Mount::Other { .. } => 0,
    };
    let images = salvaged + adopted;
    let global = tx.commit_keeping_global()?;
    drop(conn);
    // Set aside, never deleted: a second name for the damaged file, then
    // the rebuilt one takes its place in one step. Its journal goes aside
    // first, so SQLite never plays it back into the new file.
    for n in 1.. {
        match fs::hard_link(&db, &moved_to) {
            Ok(()) => break,
            // Set aside by a rebuild killed before it finished (or another
            // in the same second): that name is taken, try the next.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 100 => {
                moved_to = root.db_aside(&stamp, n);
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EPERM | libc::EOPNOTSUPP | libc::EMLINK)
                ) =>
            {
                // No hard links here: a moment without a database is the
                // price.
                fs::rename(&db, &moved_to)
                    .with_context(|| format!("cannot move {} aside", db.display()))?;
                break;
            }
            Err(e) => return Err(e).with_context(|| format!("cannot move {} aside", db.display())),
        }
    }
    crate::debug::pause("rebuild-moved-aside");
    let journal = root.db_journal();
    if journal.exists() {
        let mut aside = moved_to.clone().into_os_string();
        aside.push("-journal");
        let _ = fs::rename(&journal, aside);
    }
    fs::rename(&building, &db)
        .with_context(|| format!("cannot put the rebuilt {} in place", db.display()))?;
    drop(global);
    Ok(Rebuilt {
        moved_to,
        images_dir,
        images,
        salvaged,
        slot_classes_lost: classes_lost,
    })
}

/// For a repair, which renews the database's identity: `locks/store.lock`
/// exclusively, waited for. A new image written without the database
/// holds it shared from before it reads the identity it records to its
/// end (session.rs), and that record, once the identity is renewed, names
/// one the fold no longer vouches for — an image its writer finished
/// would fold incomplete, gc's to delete. Held, no such write is under
/// way, and one that starts meanwhile goes the database's way. `None`
/// inside a store-wide hold, which keeps them out already.
fn hold_out_new_writes(store: &mut Store) -> Result<Option<crate::lock::Guard>> {
    use crate::lock::{self, IfMissing, Mode, Waited};
    if crate::store_wide::inside_hold(store.root()) {
        return Ok(None);
    }
    let p = store.root().store_wide_lock();
    let err = |e| lock::error("the store", &p, e);
    if let Some(g) = lock::acquire_no_wait(&p, Mode::Exclusive, IfMissing::Create).map_err(err)? {
        return Ok(Some(g));
    }
    let holders = crate::holders::kernel_holders_phrase(store.ctx(), &p);
    let busy = |holders: String, waited| {
        crate::Error::Busy(crate::error::Busy {
            what: "the store-wide lock".into(),
            holders,
            waited,
        })
    };
    // The command of a new image's writer runs us: it waits for us.
    if crate::nested::enclosing_hold(&p).is_some() {
        return Err(busy(
            "held by an enclosing command of this process (a 'stowage exec' writing a new image, which a repair waits for); waiting for it would never end".into(),
            std::time::Duration::ZERO,
        )
        .into());
    }
    // The command of an image or slot user runs us: a new image's writer
    // holding store.lock may be waiting, in its own command, for that very
    // image lock or slot, which is released only once we end.
    if crate::store_wide::inside_image_user(store.ctx()) {
        return Err(busy(
            format!("{holders}; this process runs in the command of a 'stowage exec' that holds image locks or a slot, which that holder may be waiting for: waiting could deadlock"),
            std::time::Duration::ZERO,
        )
        .into());
    }
    // The environment says an exec runs us, yet neither its locks nor it
    // are to be seen from here (`--no-inherit` seen from another pid
    // namespace): that exec may be the holder, waiting for us.
    if std::env::var_os(crate::env::EXEC_PIDS).is_some_and(|v| !v.is_empty()) {
        return Err(busy(
            format!("{holders}; this process runs in the command of a 'stowage exec' ({} says so), which may be that holder or hold what it waits for: waiting could deadlock", crate::env::EXEC_PIDS),
            std::time::Duration::ZERO,
        )
        .into());
    }
    crate::holders::announce_wait(store.ctx(), "the store-wide lock", &holders);
    let t0 = std::time::Instant::now();
    let mut wait = lock::Wait::on(&store.ctx().root.locks(), None);
    match crate::store_wide::acquire_exclusive_gated(store.root(), &mut wait).map_err(err)? {
        Waited::Acquired(g) => Ok(Some(g)),
        Waited::TimedOut => Err(busy(holders, t0.elapsed()).into()),
        Waited::Interrupted(sig) => Err(crate::Error::Interrupted(sig).into()),
    }
}

/// Records, rows and trees, leftovers.
fn consistency(store: &mut Store, repair: bool, report: &mut Report) -> Result<()> {
    // Held through the repair's commit (it renews the identity).
    let _new_writes_out = match repair {
        true => hold_out_new_writes(store)?,
        false => None,
    };
    let looked = store.retry_full(|store| {
        let (tx, ctx) = store.begin(None)?;
        let found = find_inconsistencies(&tx, ctx, repair)?;
        if repair {
            tx.commit()?;
        }
        Ok(found)
    });
    let found = match looked {
        // A full filesystem, even the reserve used: look without writing.
        Err(e) if !repair && crate::space::is_full(&e) => {
            store.view_tx(|tx, ctx| find_inconsistencies(tx, ctx, false))?
        }
        other => other?,
    };
    let fixed = if repair {
        Verdict::Repaired
    } else {
        Verdict::Problem
    };
    match found.stale_records {
        0 => report.add(
            "records",
            Verdict::Ok,
            "every holder and waiter record matches a lock",
        ),
        n => report.add(
            "records",
            fixed,
            format!(
                "{n} stale holder/waiter record(s){}",
                done(repair, "dropped")
            ),
        ),
    }
    if !found.dead_writers.is_empty() {
        report.add(
            "writers",
            fixed,
            format!(
                "writer gone for {}{}",
                list(&found.dead_writers),
                done(repair, "marked incomplete")
            ),
        );
    }
    if let Some(doubt) = &found.doubt {
        report.add(
            "images",
            Verdict::Problem,
            format!(
                "{doubt} — {} row(s) without a tree kept, no tree adopted",
                found.kept_rows
            ),
        );
    }
    match found.missing_trees.len() {
        0 if found.kept_rows > 0 => {}
        0 => report.add("rows", Verdict::Ok, "every image has its tree"),
        _ => report.add(
            "rows",
            fixed,
            format!(
                "no tree for {}{}",
                list(&found.missing_trees),
                done(repair, "rows dropped")
            ),
        ),
    }
    match found.orphan_trees.len() {
        0 if found.doubt.is_some() => {}
        0 => report.add(
            "trees",
            Verdict::Ok,
            "every tree in the images directory has a row",
        ),
        _ => report.add(
            "trees",
            fixed,
            format!(
                "no row for {}{}",
                list(&found.orphan_trees),
                done(repair, "adopted")
            ),
        ),
    }
    if !found.incomplete.is_empty() {
        report.add(
            "incomplete",
            Verdict::Info,
            format!(
                "{} (their writers failed; 'stowage gc' removes them)",
                list(&found.incomplete)
            ),
        );
    }
    let left = match remove::finish_interrupted(store, repair) {
        Ok(left) => left,
        // A trash or lock directory that is not one (reported above).
        Err(e) => {
            report.add("leftovers", Verdict::Problem, format!("not checked: {e:#}"));
            return Ok(());
        }
    };
    if left.is_empty() {
        report.add(
            "leftovers",
            Verdict::Ok,
            "no interrupted removal, empty trash",
        );
    } else {
        let mut parts = Vec::new();
        if !left.removals.is_empty() {
            parts.push(format!("interrupted removal of {}", list(&left.removals)));
        }
        if !left.trash.is_empty() {
            parts.push(format!(
                "{} trash entr{}",
                left.trash.len(),
                if left.trash.len() == 1 { "y" } else { "ies" }
            ));
        }
        if !left.failed.is_empty() {
            parts.push(format!("not finished: {}", left.failed.join("; ")));
        }
        if !left.lock_files.is_empty() {
            parts.push(format!(
                "{} lock file(s) of images that no longer exist",
                left.lock_files.len()
            ));
        }
        report.add(
            "leftovers",
            if left.failed.is_empty() {
                fixed
            } else {
                Verdict::Problem
            },
            format!("{}{}", parts.join("; "), done(repair, "cleaned up")),
        );
    }
    Ok(())
}

fn done(repair: bool, what: &str) -> String {
    if repair {
        format!(" — {what}")
    } else {
        String::new()
    }
}

fn list(names: &[String]) -> String {
    let shown: Vec<String> = names.iter().take(8).map(|n| format!("'{n}'")).collect();
    if names.len() > 8 {
        format!("{} and {} more", shown.join(", "), names.len() - 8)
    } else {
        shown.join(", ")
    }
}

#[derive(Default)]
struct Found {
    stale_records: usize,
    dead_writers: Vec<String>,
    missing_trees: Vec<String>,
    orphan_trees: Vec<String>,
    incomplete: Vec<String>,
    /// Why trees could not be judged (the images directory looks
    /// unmounted), and how many rows without a tree were kept for it.
    doubt: Option<String>,
    kept_rows: usize,
}

/// Inside one transaction (committed only when repairing).
fn find_inconsistencies(tx: &Tx, ctx: &Ctx, repair: bool) -> Result<Found> {
    let mut found = Found::default();
    let before_records = tx.all_records()?.len();
    let writing: Vec<String> = tx
        .images_in_states(&[ImageState::Creating, ImageState::Writing])?
        .into_iter()
        .map(|r| r.name)
        .collect();
    let kv = crate::judge::kernel_view(tx, ctx, &ctx.root.locks());
    crate::judge::sweep(tx, ctx, &kv)?;
    found.stale_records = before_records - tx.all_records()?.len();
    if repair {
        crate::judge::clean_leases(ctx, &kv);
        // A database restored from a copy over the file keeps the copy's
        // identity, and with it the ready tokens of images it may no longer
        // call ready: a repair, which a restore must be followed by, makes
        // every token stop counting (record.rs). The next read of each
        // image asks the database and writes it again.
        tx.renew_identity()?;
        // The tokens of the identity renewed go now, in this transaction:
        // readers trust a token without the header (record.rs).
        crate::records_db::for_this_database(tx, &ctx.root)?;
    }
    let rows = tx.images()?;
    found.dead_writers = rows
        .iter()
        .filter(|r| writing.contains(&r.name) && r.state == ImageState::Incomplete)
        .map(|r| r.name.clone())
        .collect();

    let images_dir = tx.images_dir(&ctx.root)?;
    // Only a ready image must have a tree (an incomplete one may have none).
    let expects_trees = rows.iter().any(|r| r.state == ImageState::Ready);
    // A missing, empty or foreign images directory says nothing about the
    // trees: no row is dropped and no tree adopted by it (see adopt.rs).
    let mount = adopt::mount(tx, &ctx.root, &images_dir, expects_trees)?;
    found.doubt = mount.doubt(&images_dir);
    let images = match mount {
        Mount::Ours(d) | Mount::Empty(d) => Some(d),
        Mount::Missing(_) | Mount::Other { .. } => None,
    };
    for r in &rows {
        let Ok(n) = ImageName::parse(&r.name) else {
            continue;
        };
        let tree_there = || {
            images.as_ref().is_some_and(|d| {
                d.stat_at(n.encoded())
                    .ok()
                    .flatten()
                    .is_some_and(|e| e.is_dir())
            })
        };
        let present = tree_there();
        // An incomplete image may have no tree: its writer failed before
        // putting anything in the directory made for it, which then went
        // (Session::finish). Only a ready image must have one.
        if !present && r.state == ImageState::Ready {
            if found.doubt.is_some() {
                found.kept_rows += 1;
                continue;
            }
            // Only an image nobody holds can be forgotten (under the global
            // lock a try is allowed; a missing lock file is free).
            let (free, guard) = match lock::acquire_no_wait(
                &ctx.root.image_lock(&n),
                lock::Mode::Exclusive,
                lock::IfMissing::Fail,
            ) {
                Ok(g) => (g.is_some(), g),
                Err(e) => (e.kind() == std::io::ErrorKind::NotFound, None),
            };
            // Looked at again under the lock: a write without the database
            // (written.rs, new images) needs no global lock, and one that
            // makes its tree where none is — over a row whose tree is gone
            // — may have made it, run and ended between the look above and
            // the lock. Its record, folded by the next transaction, makes
            // the image ready; dropping the row and emptying the lock file
            // would leave its tree to adoption, incomplete.
            if free && !tree_there() {
                found.missing_trees.push(r.name.clone());
                if repair {
                    // The ready token goes first (record.rs), under the lock.
                    if let Some(g) = &guard {
                        crate::record::invalidate(g.file()).with_context(|| {
                            format!("cannot write the lock file of image '{}'", r.name)
                        })?;
                    }
                    tx.delete_image(&r.name)?;
                }
            }
        }
        if r.state == ImageState::Incomplete {
            found.incomplete.push(r.name.clone());
        }
    }
    let Some(images) = images.filter(|_| found.doubt.is_none()) else {
        return Ok(found);
    };
    // This is the directory the rows describe (recorded when repairing).
    adopt::record_identity(tx, &images)?;
    // Adopted in any case: without repair the transaction is rolled back.
    let (orphans, _) = adopt::adopt(
        tx,
        &ctx.root,
        &images,
        &images_dir,
        Adopt::Unknown,
        &HashMap::new(),
    )?;
    found.orphan_trees = orphans
        .trees
        .iter()
        .map(|(name, _)| name.as_str().to_owned())
        .collect();
    Ok(found)
}
