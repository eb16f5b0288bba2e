//! Judging holder and waiter records against the kernel — and cleaning:
//! [`prune`] deletes the stale records of a lock as it lists who holds and
//! awaits it, [`sweep`] does so for every record and marks the images of
//! dead writers `incomplete`.
//!
//! The kernel is the truth; records are information. A holder record is
//! kept only while its lock is really held in the recorded mode (and, where
//! the lock table shows pids, held by the recorded process or by a child
//! that outlived it). A waiter record is kept only while its process may be
//! alive and the lock it awaits is held. A lock held by a process stowage did
//! not start (flock(1) in a script) still shows as held, with its pid where
//! the lock table has one. Everything here runs inside a metadata
//! transaction, so stale records are deleted as they are found.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{DirEntryExt, MetadataExt};
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::ctx::Ctx;
use crate::holders::{Party, unrecorded};
use crate::ident::{self, Liveness};
use crate::kernel::{Entry, KernelView, LeaseSeen, LockView};
use crate::lock::{Mode, Probe};
use crate::meta::{ImageState, LockKind, Record, Role, SlotClass, Tx};
use crate::name::ImageName;
use crate::root::Root;

/// One lock's state, holders and waiters.
#[derive(Debug, Clone)]
pub struct LockReport {
    pub kind: LockKind,
    pub name: String,
    pub state: Probe,
    pub holders: Vec<Party>,
    pub waiters: Vec<Party>,
    /// For image locks: the image's state, when it has a row.
    pub image_state: Option<ImageState>,
    /// For slot classes: limit, reserve for high priority, slots in use.
    pub slot: Option<(u32, u32, u32)>,
}

/// The kernel's view of the locks under `dir`, checked against the global
/// lock the transaction holds, judging leases in the root's leases
/// directory.
pub fn kernel_view(tx: &Tx, ctx: &Ctx, dir: &Path) -> KernelView {
    let held = Some(tx.global_identity());
    // The leases are listed and read before the lock table
    // (KernelView::read_leases_first): a holder the table shows is then
    // named by its lease even if it ended just after.
    let early = KernelView::leases_only(&ctx.root.leases()).read_leases_first();
    // Every lock file is on the root's filesystem, found when it was
    // checked: no statfs of its own.
    let kv = match ctx.root.filesystem() {
        Some(fs) => KernelView::verified_on(fs.local, held),
        None => KernelView::verified(dir, held),
    };
    kv.with_leases_from(early)
}

/// Judges the records of one lock against the kernel's view, deletes the
/// stale ones, and adds holders and waiters the kernel knows of but no
/// record names.
pub fn prune(
    tx: &Tx,
    ctx: &Ctx,
    kv: &KernelView,
    view: &LockView,
    records: &[Record],
    lockfile: &str,
) -> Result<(Vec<Party>, Vec<Party>)> {
    // Holders and waiters with no record (readers) that their leases list.
    let leased = kv.leased(lockfile);
    // A table's "free" is not trusted for deciding records are stale, nor
    // over a live lease that says it holds the lock (the table of a pid
    // namespace hides locks taken outside it).
    let confirmed;
    let (view, table) = if view.unconfirmed_free.is_some()
        && (!records.is_empty() || leased.iter().any(|(_, _, h)| !h.awaits))
    {
        confirmed = view.confirmed();
        let table = confirmed.unconfirmed_free.is_some();
        (&confirmed, table)
    } else {
        (view, kv.has_table())
    };
    let mut holders = Vec::new();
    let mut waiters = Vec::new();
    let mut claimed = vec![false; view.holders.len()];
    let mut claimed_waits = vec![false; view.waiters.len()];
    // Holder records whose lease is dead, judged once every live one has
    // claimed its lock-table entry.
    let mut orphans = Vec::new();
    for rec in records {
        let valid = match rec.lease.as_deref().map(|l| kv.lease(l)) {
            // The owner is gone. A holder may still be its command, which
            // closed the inherited lease but kept the lock (closefrom):
            // see `orphan_holder_valid`.
            Some(LeaseSeen::Dead) if rec.role == Role::Holder && table => {
                orphans.push(rec);
                continue;
            }
            // The owner is gone, and so is every command that inherited its
            // locks: whatever the pids say, the record is stale.
            Some(LeaseSeen::Dead) => false,
            Some(LeaseSeen::Alive { taker }) => match rec.role {
                Role::Holder => leased_holder_valid(rec, taker, table, view, &mut claimed),
                Role::Waiter => {
                    if let Some(Some(p)) = taker
                        && let Some(i) = view
                            .waiters
                            .iter()
                            .enumerate()
                            .position(|(i, e)| !claimed_waits[i] && e.pid == Some(p))
                    {
                        claimed_waits[i] = true;
                    }
                    view.is_held()
                }
            },
            // A record of an older release: judged by pid, as it was.
            None => {
                let live = ident::liveness(
                    &ctx.me,
                    &rec.host,
                    rec.boot_id.as_deref(),
                    rec.pid,
                    rec.pid_start,
                );
                match rec.role {
                    Role::Holder => holder_valid(rec, live, table, view, &mut claimed),
                    Role::Waiter => {
                        if let Some(i) = view.waiters.iter().position(|e| e.pid == Some(rec.pid)) {
                            claimed_waits[i] = true;
                        }
                        live != Liveness::Dead && view.is_held()
                    }
                }
            }
        };
        if !valid {
            tx.delete_record(rec.id)?;
            continue;
        }
        let party = Party::recorded(rec);
        match rec.role {
            Role::Holder => holders.push(party),
            Role::Waiter => waiters.push(party),
        }
    }
    for rec in orphans {
        if !orphan_holder_valid(ctx, rec, view, &mut claimed) {
            tx.delete_record(rec.id)?;
            continue;
        }
        holders.push(Party::recorded(rec));
    }
    for (e, _) in view.holders.iter().zip(&claimed).filter(|(_, c)| !**c) {
        let party = unrecorded(ctx, kv, e, lockfile);
        // Unknown to the look: the table was read before the leases were
        // listed, and a stowage process that held the lock then may have
        // released it and retired its lease since. Shown only if a fresh
        // read of the table still has it holding the lock.
        if let (false, Some(pid), true) = (party.stowage, e.pid, table)
            && !kv.still_held_by(&ctx.root.locks().join(lockfile), pid, e.mode)
        {
            continue;
        }
        // Not a live lease's: a reader whose command closed the lease it
        // inherited (closefrom) may still be named by its dead lease, like
        // a writer by its record (`orphan_holder_valid`).
        let party = match (party.stowage, e.pid) {
            (false, Some(pid)) if table => kv
                .dead_leased(lockfile)
                .into_iter()
                .find(|(_, id, h)| id.pid == Some(pid) && h.mode == e.mode)
                .map(|(name, id, h)| Party::leased(name, id, &h))
                .unwrap_or(party),
            _ => party,
        };
        holders.push(party);
    }
    for (e, _) in view
        .waiters
        .iter()
        .zip(&claimed_waits)
        .filter(|(_, c)| !**c)
    {
        waiters.push(unrecorded(ctx, kv, e, lockfile));
    }
    // Holders and waiters their leases name, where neither a record nor
    // the table did: a reader on another host (no table on NFS) or in a pid
    // namespace ours does not see. A lease whose owner the table shows is
    // left to the table: its entries were claimed above, or say the lease
    // lists a lock no longer held.
    let named: std::collections::HashSet<String> = holders
        .iter()
        .chain(&waiters)
        .filter_map(|p| p.lease.clone())
        .collect();
    for (name, id, h) in leased {
        let shown_by_table = matches!(
            kv.lease(&name),
            LeaseSeen::Alive {
                taker: Some(Some(_))
            }
        );
        if named.contains(&name) || (shown_by_table && table) {
            continue;
        }
        let party = Party::leased(name, id, &h);
        if h.awaits {
            if view.is_held() {
                waiters.push(party);
            }
        } else if held_in(view, h.mode) {
            holders.push(party);
        }
    }
    // No record and no lock table: someone holds it, we cannot say who.
    if holders.is_empty() && view.is_held() {
        holders.push(Party {
            pid: None,
            host: None,
            user: None,
            mode: if view.state == Some(Probe::Exclusive) {
                Mode::Exclusive
            } else {
                Mode::Shared
            },
            command: None,
            since: None,
            stowage: false,
            lease: None,
        });
    }
    Ok((holders, waiters))
}

/// A holder record whose lease lives stands while its lock is held in the
/// recorded mode. Where the lock table shows the lease's taker (the owner
/// runs in our pid namespace or below it), the table must also show that
/// same process holding this lock — the entry is then claimed, so the
/// holder is not listed a second time as an outsider. Where it does not
/// (no table on NFS; an owner in an outer or sibling pid namespace, whose
/// locks this namespace's table hides), the lock's state is all there is.
fn leased_holder_valid(
    rec: &Record,
    taker: Option<Option<u32>>,
    table: bool,
    view: &LockView,
    claimed: &mut [bool],
) -> bool {
    let compatible = held_as_recorded(view, rec);
    if !compatible {
        return false;
    }
    let Some(pid) = taker.filter(|_| table) else {
        return true;
    };
    // Some kernels show no pid for either entry: held is enough.
    claim(view, claimed, |e| e.mode == rec.mode && e.pid == pid) || pid.is_none()
}

/// A holder record whose lease is dead stands only while the lock table
/// shows the lock still held, in the recorded mode, under the recorded pid:
/// the table keeps showing a gone taker's pid while a command that inherited
/// the lock descriptor (and closed the lease's) holds it. Only for a record
/// of this host and boot, whose pid is one of this kernel's, and only for an
/// entry no record with a live lease claimed; a pid namespace that does not
/// show the gone taker (a container looking) drops the record, as it cannot
/// tell.
fn orphan_holder_valid(ctx: &Ctx, rec: &Record, view: &LockView, claimed: &mut [bool]) -> bool {
    let same_boot = match (rec.boot_id.as_deref(), ctx.me.boot_id.as_deref()) {
        (Some(theirs), Some(ours)) => theirs == ours,
        _ => false,
    };
    let compatible = held_as_recorded(view, rec);
    if rec.host != ctx.me.host || !same_boot || !compatible {
        return false;
    }
    claim(view, claimed, |e| {
        e.mode == rec.mode && e.pid == Some(rec.pid)
    })
}

fn holder_valid(
    rec: &Record,
    live: Liveness,
    table: bool,
    view: &LockView,
    claimed: &mut [bool],
) -> bool {
    let compatible = held_as_recorded(view, rec);
    if !compatible {
        return false;
    }
    if !table || live == Liveness::Unknown {
        // Held in the recorded mode is all that can be checked.
        return true;
    }
    claim(view, claimed, |e| {
        e.mode == rec.mode
            && match e.pid {
                // The pid that took the lock: alive, or gone while a child
                // kept the inherited descriptor (the initial pid namespace
                // keeps showing a gone taker's pid).
                Some(p) => p == rec.pid,
                // A child pid namespace shows no pid for a gone taker.
                None => live == Liveness::Dead,
            }
    })
}

/// Whether the lock is held in the mode the record says.
fn held_as_recorded(view: &LockView, rec: &Record) -> bool {
    held_in(view, rec.mode)
}

/// Whether the lock is held in `mode`.
fn held_in(view: &LockView, mode: Mode) -> bool {
    matches!(
        (view.state, mode),
        (Some(Probe::Exclusive), Mode::Exclusive) | (Some(Probe::Shared), Mode::Shared)
    )
}

/// Marks the first unclaimed lock-table entry that `fits` as this record's;
/// false if there is none. Each entry stands for one holder, so it is
/// claimed once.
fn claim(view: &LockView, claimed: &mut [bool], fits: impl Fn(&Entry) -> bool) -> bool {
    match view
        .holders
        .iter()
        .enumerate()
        .position(|(i, e)| !claimed[i] && fits(e))
    {
        Some(i) => {
            claimed[i] = true;
            true
        }
        None => false,
    }
}

/// Judges every record and every image a writer was working on: deletes
/// stale records, marks images whose writer is gone `incomplete`. Returns
/// the reports of the image locks that have records, and of every slot class.
pub fn sweep(
    tx: &Tx,
    ctx: &Ctx,
    kv: &KernelView,
) -> Result<(BTreeMap<String, LockReport>, Vec<LockReport>)> {
    let mut images: BTreeMap<String, Vec<Record>> = BTreeMap::new();
    let mut orphans = Vec::new();
    let classes = tx.slot_classes()?;
    for rec in tx.all_records()? {
        match rec.kind {
            LockKind::Image => images.entry(rec.name.clone()).or_default().push(rec),
            LockKind::Slot if classes.iter().any(|c| c.name == rec.name) => {}
            _ => orphans.push(rec),
        }
    }
    // Images whose locks live leases list: readers hold them without a
    // record.
    for lockfile in kv.leased_lockfiles() {
        if let Some(name) = Root::image_of_lock_rel(&lockfile) {
            images.entry(name.as_str().to_owned()).or_default();
        }
    }
    let mut reports = BTreeMap::new();
    for (name, records) in images {
        let Ok(image) = ImageName::parse(&name) else {
            continue;
        };
        let lockfile = Root::image_lock_rel(&image);
        let view = kv.view(&ctx.root.locks().join(&lockfile))?;
        let (holders, waiters) = prune(tx, ctx, kv, &view, &records, &lockfile)?;
        // The table's "free" is not the state to show either: inside a pid
        // namespace the table hides every lock taken outside it.
        let view = if view.unconfirmed_free.is_some() && !holders.is_empty() {
            view.confirmed()
        } else {
            view
        };
        reports.insert(
            name.clone(),
            LockReport::image(name, &view, holders, waiters),
        );
    }
    // Records of kinds nobody records any more stand only while their lock
    // file is held. Those of removed slot classes are judged like any
    // class's, and the class is shown while they stand: its holders run on
    // after `slots rm`, and its waiters until they notice.
    let mut removed: Vec<String> = Vec::new();
    // Slot holders of a class no longer configured, named by their leases
    // (a slot holder writes no record).
    for lockfile in kv.leased_lockfiles() {
        let Some(class) = Root::slot_class_of_lock_rel(&lockfile) else {
            continue;
        };
        if !classes.iter().any(|c| c.name == class) && !removed.contains(&class) {
            removed.push(class);
        }
    }
    for rec in orphans {
        if rec.kind == LockKind::Slot {
            if !removed.contains(&rec.name) {
                removed.push(rec.name.clone());
            }
            continue;
        }
        let view = kv.view(&ctx.root.locks().join(&rec.lockfile))?;
        prune(
            tx,
            ctx,
            kv,
            &view,
            std::slice::from_ref(&rec),
            &rec.lockfile,
        )?;
    }
    let mut slots = Vec::new();
    for name in removed {
        let gone = crate::meta::SlotClass {
            name: name.clone(),
            limit: 0,
            reserve_high: 0,
        };
        let r = crate::judge::class_report(tx, ctx, kv, &gone)?;
        if r.holders.is_empty() && r.waiters.is_empty() {
            continue;
        }
        slots.push(LockReport {
            kind: LockKind::Slot,
            name,
            state: if r.in_use > 0 {
                Probe::Shared
            } else {
                Probe::Free
            },
            holders: r.holders,
            waiters: r.waiters,
            image_state: None,
            // No configuration: no limit to show (lock-status says "removed").
            slot: None,
        });
    }
    for class in &classes {
        let r = crate::judge::class_report(tx, ctx, kv, class)?;
        slots.push(LockReport {
            kind: LockKind::Slot,
            name: class.name.clone(),
            state: if r.in_use > 0 {
                Probe::Shared
            } else {
                Probe::Free
            },
            holders: r.holders,
            waiters: r.waiters,
            image_state: None,
            slot: Some((class.limit, class.reserve_high, r.in_use)),
        });
    }
    // A writer that died leaves its image creating/writing with the lock
    // free: that image is incomplete. No writer of the database's way can
    // take the lock and mark the image between this check and the update
    // (both need the global lock, which we hold); a write without it can
    // take the lock (one whose tree had gone: written.rs, new images), and
    // its record, folded later, then says what the image is, over this.
    for row in tx.images_in_states(&[ImageState::Creating, ImageState::Writing])? {
        let Ok(name) = ImageName::parse(&row.name) else {
            continue;
        };
        let view = kv.view(&ctx.root.image_lock(&name))?.confirmed();
        if !matches!(view.state, Some(Probe::Exclusive)) {
            tx.set_state(&row.name, ImageState::Incomplete)?;
            ctx.detail(&format!(
                "image '{}': its writer is gone; marked incomplete",
                row.name
            ));
        }
    }
    Ok((reports, slots))
}

pub(crate) fn settle(p: Option<Probe>) -> Probe {
    match p {
        Some(Probe::Missing) | None => Probe::Free,
        Some(p) => p,
    }
}

/// Image locks the kernel says are held or awaited, by image name, for
/// locks taken outside stowage (no record). Needs the lock table.
pub fn kernel_locked_images(ctx: &Ctx, kv: &KernelView) -> Result<Vec<(String, LockView)>> {
    let dir = ctx.root.image_locks();
    let Ok(meta) = std::fs::metadata(&dir) else {
        return Ok(Vec::new());
    };
    // Listing the directory costs O(images): only when some held lock is
    // not one already seen (ours, a recorded holder's, a slot).
    let Some(inodes) = kv.unexplained_inodes(meta.dev()) else {
        return Ok(Vec::new());
    };
    if inodes.is_empty() {
        return Ok(Vec::new());
    }
    let wanted: std::collections::HashSet<u64> = inodes.into_iter().collect();
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir)?.flatten() {
        if !wanted.contains(&entry.ino()) {
            continue;
        }
        if let Some(name) = entry
            .file_name()
            .to_str()
            .and_then(crate::root::Root::image_of_lock_file)
        {
            out.push((
                name.as_str().to_owned(),
                kv.view_inode(meta.dev(), entry.ino()),
            ));
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// lock-status

impl LockReport {
    pub(crate) fn image(
        name: String,
        view: &LockView,
        holders: Vec<Party>,
        waiters: Vec<Party>,
    ) -> LockReport {
        LockReport {
            kind: LockKind::Image,
            name,
            state: settle(view.state),
            holders,
            waiters,
            image_state: None,
            slot: None,
        }
    }
}

/// Which images are in use (their lock held), for `stowage images`.
/// Unlinks the leases of owners that are gone ([`crate::lease::clean`]),
/// but keeps a dead lease that still names a holder: its owner's pid is one
/// of this kernel's ([`crate::lease::Identity::pid_is_ours`]) and the lock
/// table shows a lock it lists as held still held, in that mode, under that
/// pid — a command that closed the inherited lease keeps the lock after
/// stowage died, and a reader has no record to name it but this lease (see
/// [`prune`]). Without a lock table nothing is kept. Under the global lock,
/// with the look's view `kv` (made by [`kernel_view`]): the leases are those
/// its one listing found, cleaned through the descriptor it listed them by.
pub fn clean_leases(ctx: &Ctx, kv: &KernelView) -> usize {
    let leases = ctx.root.leases();
    let locks = ctx.root.locks();
    kv.lease_listing(|l| {
        let Some(dir) = &l.dir else {
            return 0;
        };
        crate::lease::clean_listed(dir, &l.names, &mut |name| {
            let Some(id) = crate::lease::identity(&leases, name) else {
                return false;
            };
            let Some(pid) = id.pid else {
                return false;
            };
            if !id.holdings.iter().any(|h| !h.awaits) || !id.pid_is_ours() {
                return false;
            }
            id.holdings
                .iter()
                .filter(|h| !h.awaits)
                .any(|h| kv.held_by(&locks.join(&h.lockfile), h.mode, pid))
        })
    })
}

pub fn in_use(tx: &Tx, ctx: &Ctx, kv: &KernelView) -> Result<HashMap<String, bool>> {
    let mut out: HashMap<String, bool> = HashMap::new();
    let swept = sweep(tx, ctx, kv)?.0;
    clean_leases(ctx, kv);
    for (name, r) in swept {
        out.insert(name, r.state != Probe::Free);
    }
    for (name, view) in kernel_locked_images(ctx, kv)? {
        if view.is_held() {
            out.insert(name, true);
        }
    }
    Ok(out)
}

/// A slot class as lock-status shows it.
#[derive(Debug, Clone)]
pub struct ClassReport {
    pub class: SlotClass,
    pub in_use: u32,
    pub holders: Vec<Party>,
    pub waiters: Vec<Party>,
}

/// Judges a class's records against the kernel (deleting stale ones) and
/// counts the slots in use: every slot file present, including ones above a
/// lowered limit that a holder still has.
pub fn class_report(tx: &Tx, ctx: &Ctx, kv: &KernelView, class: &SlotClass) -> Result<ClassReport> {
    let dir = ctx.root.slot_class_dir(&class.name);
    let records = tx.records_for(LockKind::Slot, &class.name)?;
    // Listed through one descriptor (no opendir's second one and stat).
    let mut files: Vec<PathBuf> = match crate::dir::Dir::open(&dir).and_then(|d| d.names()) {
        Ok(names) => names
            .into_iter()
            .map(|n| dir.join(n))
            .filter(|p| p.extension().is_some_and(|x| x == "lock"))
            .collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    let mut in_use = 0;
    let mut holders = Vec::new();
    let mut held_any = false;
    for file in &files {
        let rel = ctx.root.locks_rel(file);
        let mine: Vec<Record> = records
            .iter()
            .filter(|r| r.role == Role::Holder && r.lockfile == rel)
            .cloned()
            .collect();
        let view = kv.view(file)?;
        // A recorded slot the table calls free is probed: inside a pid
        // namespace the table hides slots taken outside it.
        let held = if view.unconfirmed_free.is_some()
            && (!mine.is_empty() || kv.leased(&rel).iter().any(|(_, _, h)| !h.awaits))
        {
            view.confirmed().is_held()
        } else {
            view.is_held()
        };
        if held {
            in_use += 1;
            held_any = true;
        }
        let (h, _) = prune(tx, ctx, kv, &view, &mine, &rel)?;
        holders.extend(h);
    }
    // Holder records whose slot file no longer exists are stale.
    for r in records.iter().filter(|r| r.role == Role::Holder) {
        if !files.iter().any(|f| ctx.root.locks_rel(f) == r.lockfile) {
            tx.delete_record(r.id)?;
        }
    }
    // A waiter waits for the class as a whole: it is stale once its process
    // is gone, or once no slot of the class is held at all.
    let class_view = crate::kernel::LockView {
        state: Some(if held_any { Probe::Shared } else { Probe::Free }),
        ..Default::default()
    };
    let waiting: Vec<Record> = records
        .iter()
        .filter(|r| r.role == Role::Waiter)
        .cloned()
        .collect();
    let class_rel = ctx.root.locks_rel(&dir);
    let (_, waiters) = prune(tx, ctx, kv, &class_view, &waiting, &class_rel)?;
    Ok(ClassReport {
        class: class.clone(),
        in_use,
        holders,
        waiters,
    })
}
