//! Who holds and awaits which lock: records judged against the kernel.
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
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use crate::clock::{self, Millis};
use crate::ctx::Ctx;
use crate::ident::{self, Liveness};
use crate::kernel::{Entry, KernelView, LeaseSeen, LockView};
use crate::lock::{Mode, Probe};
use crate::meta::{ImageState, LockKind, Record, Role, Tx};
use crate::name::ImageName;

/// A holder or waiter, from a record or straight from the kernel.
#[derive(Debug, Clone)]
pub struct Party {
    pub pid: Option<u32>,
    pub host: Option<String>,
    pub user: Option<String>,
    pub mode: Mode,
    pub command: Option<String>,
    pub since: Option<Millis>,
    /// False for a process stowage did not start.
    pub stowage: bool,
    /// The lease that proves the party alive (`lease.rs`); None for an
    /// outsider or a record of an older release.
    pub lease: Option<String>,
}

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

/// Judges the records of one lock against the kernel's view, deletes the
/// stale ones, and adds holders and waiters the kernel knows of but no
/// record names.
pub fn judge(
    tx: &Tx,
    ctx: &Ctx,
    kv: &KernelView,
    view: &LockView,
    records: &[Record],
) -> Result<(Vec<Party>, Vec<Party>)> {
    // A table's "free" is not trusted for deciding records are stale.
    let confirmed;
    let (view, table) = if view.unconfirmed_free.is_some() && !records.is_empty() {
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
        let party = Party {
            pid: Some(rec.pid),
            host: Some(rec.host.clone()),
            user: Some(rec.user.clone()),
            mode: rec.mode,
            command: Some(rec.command.clone()),
            since: Some(rec.since),
            stowage: true,
            lease: rec.lease.clone(),
        };
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
        holders.push(Party {
            pid: Some(rec.pid),
            host: Some(rec.host.clone()),
            user: Some(rec.user.clone()),
            mode: rec.mode,
            command: Some(rec.command.clone()),
            since: Some(rec.since),
            stowage: true,
            lease: rec.lease.clone(),
        });
    }
    for (e, _) in view.holders.iter().zip(&claimed).filter(|(_, c)| !**c) {
        holders.push(unrecorded(ctx, kv, e));
    }
    for (e, _) in view
        .waiters
        .iter()
        .zip(&claimed_waits)
        .filter(|(_, c)| !**c)
    {
        waiters.push(unrecorded(ctx, kv, e));
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
    matches!(
        (view.state, rec.mode),
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

/// A lock-table entry no record claims: a stowage process that has not
/// recorded itself (it took the lock a moment ago, or awaits it with
/// `--no-wait`), known by the lease it took, else a process stowage did not
/// start.
fn unrecorded(ctx: &Ctx, kv: &KernelView, e: &Entry) -> Party {
    let leased = e.pid.and_then(|p| kv.lease_taken_by(p)).and_then(|name| {
        let id = crate::lease::identity(&ctx.root.locks(), &name)?;
        Some(Party {
            pid: id.pid,
            host: Some(id.host),
            user: Some(id.user),
            mode: e.mode,
            command: Some(id.command),
            since: id.since,
            stowage: true,
            lease: Some(name),
        })
    });
    leased.unwrap_or_else(|| outsider(ctx, e))
}

fn outsider(ctx: &Ctx, e: &Entry) -> Party {
    Party {
        pid: e.pid,
        host: Some(ctx.me.host.clone()),
        user: e.pid.and_then(ident::process_user),
        mode: e.mode,
        command: e.pid.and_then(ident::command_line),
        since: None,
        stowage: false,
        lease: None,
    }
}

/// "held (read) by pid 4121 on node07 (ch-image build -t app .) since 12:03:04"
pub fn phrase(holders: &[Party]) -> String {
    match holders.first() {
        Some(first) => phrase_as(&format!("held ({}) by ", first.mode.verb()), holders),
        None => phrase_as("", holders),
    }
}

/// "in use by pid 4121 on node07 (ch-image pull alpine) since 12:03:04"
pub fn phrase_slots(holders: &[Party]) -> String {
    phrase_as("in use by ", holders)
}

fn phrase_as(lead: &str, holders: &[Party]) -> String {
    if holders.is_empty() {
        return "no holder is known (it may have just been released)".into();
    }
    let mut s = lead.to_owned();
    let shown: Vec<String> = holders.iter().take(3).map(describe).collect();
    s.push_str(&shown.join("; "));
    if holders.len() > 3 {
        s.push_str(&format!("; and {} more", holders.len() - 3));
    }
    s
}

fn describe(p: &Party) -> String {
    let mut s = match p.pid {
        Some(pid) => format!("pid {pid}"),
        None => "a process".into(),
    };
    if let Some(h) = &p.host {
        s.push_str(&format!(" on {}", ident::printable(h)));
    }
    if let Some(c) = &p.command {
        s.push_str(&format!(" ({})", truncate(&ident::printable(c), 80)));
    }
    if let Some(t) = p.since {
        s.push_str(&format!(" since {}", clock::local_short(t)));
    }
    if !p.stowage {
        s.push_str(if p.pid.is_some() {
            ", not started by stowage"
        } else {
            " that stowage cannot identify (outside stowage, or on another host)"
        });
    }
    s
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let cut: String = s.chars().take(max - 1).collect();
        format!("{cut}…")
    }
}

/// Who holds a lock, from the kernel alone (no records): for messages
/// where the database may be unusable, such as waiting to rebuild it.
pub fn kernel_holders_phrase(ctx: &Ctx, path: &Path) -> String {
    let view = KernelView::new(&ctx.root.locks())
        .view(path)
        .unwrap_or_default();
    let holders: Vec<Party> = view.holders.iter().map(|e| outsider(ctx, e)).collect();
    if holders.is_empty() {
        "held by a process stowage cannot identify (on another host?)".into()
    } else {
        phrase(&holders).replace(", not started by stowage", "")
    }
}

/// Who holds the global lock, for the rare message about waiting for it.
/// Read without the global lock, so from the kernel only.
pub fn global_holder_phrase(ctx: &Ctx) -> String {
    let path = ctx.root.global_lock();
    let kv = KernelView::new(&ctx.root.locks());
    let view = kv.view(&path).unwrap_or_default();
    let holders = global_holders(ctx, &view);
    if holders.is_empty() {
        "held by a process stowage cannot identify (on another host, or stopped)".into()
    } else {
        phrase(&holders)
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
    let mut reports = BTreeMap::new();
    for (name, records) in images {
        let path = ctx.root.locks().join(&records[0].lockfile);
        let view = kv.view(&path)?;
        let (holders, waiters) = judge(tx, ctx, kv, &view, &records)?;
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
    for rec in orphans {
        if rec.kind == LockKind::Slot {
            if !removed.contains(&rec.name) {
                removed.push(rec.name.clone());
            }
            continue;
        }
        let view = kv.view(&ctx.root.locks().join(&rec.lockfile))?;
        judge(tx, ctx, kv, &view, std::slice::from_ref(&rec))?;
    }
    let mut slots = Vec::new();
    for name in removed {
        let gone = crate::meta::SlotClass {
            name: name.clone(),
            limit: 0,
            reserve_high: 0,
        };
        let r = crate::slots::class_report(tx, ctx, kv, &gone)?;
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
        let r = crate::slots::class_report(tx, ctx, kv, class)?;
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
    // free: that image is incomplete. The lock cannot be taken between this
    // check and the update, because taking it and marking the image both
    // need the global lock, which we hold.
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

fn settle(p: Option<Probe>) -> Probe {
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
        let fname = entry.file_name();
        let Some(enc) = fname.to_str().and_then(|f| f.strip_suffix(".lock")) else {
            continue;
        };
        if let Ok(name) = ImageName::from_encoded(enc) {
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

#[derive(Debug, Serialize)]
pub struct StatusJson {
    pub root: String,
    pub filesystem: String,
    pub locks: Vec<LockJson>,
}

#[derive(Debug, Serialize)]
pub struct LockJson {
    pub kind: &'static str,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_state: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserve_high: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_use: Option<u32>,
    pub state: &'static str,
    pub holders: Vec<PartyJson>,
    pub waiters: Vec<PartyJson>,
}

#[derive(Debug, Serialize)]
pub struct PartyJson {
    pub pid: Option<u32>,
    pub host: Option<String>,
    pub user: Option<String>,
    pub mode: &'static str,
    pub command: Option<String>,
    pub since: Option<String>,
    /// False for a lock taken outside stowage.
    pub stowage: bool,
    /// The file name of the party's lease under `ROOT/locks/leases`, which
    /// proves it alive; null for an outsider.
    pub lease: Option<String>,
}

impl From<&Party> for PartyJson {
    fn from(p: &Party) -> Self {
        PartyJson {
            pid: p.pid,
            host: p.host.clone(),
            user: p.user.clone(),
            mode: p.mode.as_str(),
            command: p.command.clone(),
            since: p.since.and_then(clock::rfc3339),
            stowage: p.stowage,
            lease: p.lease.clone(),
        }
    }
}

pub fn state_str(p: Probe) -> &'static str {
    match p {
        Probe::Missing | Probe::Free => "free",
        Probe::Shared => "shared",
        Probe::Exclusive => "exclusive",
    }
}

impl LockReport {
    fn image(
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

    pub fn to_json(&self) -> LockJson {
        LockJson {
            kind: self.kind.as_str(),
            name: self.name.clone(),
            image_state: self.image_state.map(ImageState::as_str),
            limit: self.slot.map(|s| s.0),
            reserve_high: self.slot.map(|s| s.1),
            in_use: self.slot.map(|s| s.2),
            state: state_str(self.state),
            holders: self.holders.iter().map(PartyJson::from).collect(),
            waiters: self.waiters.iter().map(PartyJson::from).collect(),
        }
    }
}

/// Which image locks lock-status shows.
#[derive(Debug, Default)]
pub struct Selection {
    /// Named images (shown whatever their state).
    pub names: Vec<ImageName>,
    /// Every image.
    pub all: bool,
}

/// Gathers everything lock-status shows: the global lock, then image locks.
pub fn gather(
    store: &mut crate::store::Store,
    sel: &Selection,
) -> Result<(String, Vec<LockReport>)> {
    let root = store.root().clone();
    // The global lock is looked at before we take it ourselves.
    let kv_global = KernelView::new(&root.locks());
    let global = global_report(store.ctx(), &kv_global, &root.global_lock());
    let fs_name =
        crate::filesystem::filesystem(root.dir()).map_or_else(|_| "unknown".into(), |f| f.name);

    let images = store.read_tx(|tx, ctx| {
        let kv = tx.kernel_view(&ctx.root.locks());
        let (mut reports, slots) = sweep(tx, ctx, &kv)?;
        crate::lease::clean(&ctx.root.locks());
        for (name, view) in kernel_locked_images(ctx, &kv)? {
            if reports.contains_key(&name) {
                continue;
            }
            let (holders, waiters) = judge(tx, ctx, &kv, &view, &[])?;
            if holders.is_empty() && waiters.is_empty() {
                continue;
            }
            reports.insert(
                name.clone(),
                LockReport::image(name, &view, holders, waiters),
            );
        }
        // With --all every row is read once, here, for the names and the
        // states below; otherwise the few shown are looked up one by one.
        let states: Option<HashMap<String, ImageState>> = if sel.all {
            Some(
                tx.images()?
                    .into_iter()
                    .map(|r| (r.name, r.state))
                    .collect(),
            )
        } else {
            None
        };
        let extra: Vec<String> = if let Some(states) = &states {
            states.keys().cloned().collect()
        } else {
            sel.names.iter().map(|n| n.as_str().to_owned()).collect()
        };
        for name in extra {
            if reports.contains_key(&name) {
                continue;
            }
            let Ok(n) = ImageName::parse(&name) else {
                continue;
            };
            // An image asked for by name gets a table's "free" confirmed
            // (a probe); --all trusts the table, as probing every image
            // would take every lock in turn.
            let view = kv.view(&ctx.root.image_lock(&n))?;
            let view = if sel.all { view } else { view.confirmed() };
            let (holders, waiters) = judge(tx, ctx, &kv, &view, &[])?;
            reports.insert(
                name.clone(),
                LockReport::image(name, &view, holders, waiters),
            );
        }
        // Without --all or names, only held or awaited locks are shown.
        let named: std::collections::HashSet<&str> =
            sel.names.iter().map(ImageName::as_str).collect();
        let mut out = Vec::new();
        for (name, mut r) in reports {
            let shown = sel.all
                || named.contains(name.as_str())
                || r.state != Probe::Free
                || !r.waiters.is_empty();
            if !shown || (!named.is_empty() && !named.contains(name.as_str()) && !sel.all) {
                continue;
            }
            r.image_state = match &states {
                Some(states) => states.get(&name).copied(),
                None => tx.image(&name)?.map(|row| row.state),
            };
            out.push(r);
        }
        out.extend(store_wide_report(tx, ctx, &kv)?);
        out.extend(slots);
        Ok(out)
    })?;
    let mut locks = vec![global];
    locks.extend(images);
    Ok((fs_name, locks))
}

/// A store-wide hold (`exec --store-wide`), while held or awaited: a
/// `global` entry named `store`, its holder the recorded command, its
/// waiters the processes queued for it (from the kernel).
fn store_wide_report(tx: &Tx, ctx: &Ctx, kv: &KernelView) -> Result<Option<LockReport>> {
    let path = ctx.root.locks().join("store.lock");
    let view = kv.view(&path)?;
    let records = tx.records_for(LockKind::Global, "store")?;
    if !view.is_held() && records.is_empty() {
        return Ok(None);
    }
    let (holders, waiters) = judge(tx, ctx, kv, &view, &records)?;
    Ok(Some(LockReport {
        kind: LockKind::Global,
        name: "store".into(),
        state: settle(view.state),
        holders,
        waiters,
        image_state: None,
        slot: None,
    }))
}

fn global_report(ctx: &Ctx, kv: &KernelView, path: &Path) -> LockReport {
    let mut view = kv.view(path).unwrap_or_default();
    // The table may not cover this filesystem (it is not verified here, as
    // we hold no lock yet): a probe has the last word on "held".
    if !view.is_held()
        && let Ok(p @ (Probe::Shared | Probe::Exclusive)) = crate::lock::probe(path)
    {
        view.state = Some(p);
    }
    let holders = global_holders(ctx, &view);
    LockReport {
        kind: LockKind::Global,
        name: "global".into(),
        state: settle(view.state),
        holders,
        waiters: view.waiters.iter().map(|e| outsider(ctx, e)).collect(),
        image_state: None,
        slot: None,
    }
}

/// The global lock's holders, from the kernel's table: there are no records
/// of it. They are almost always stowage itself, in a short transaction.
fn global_holders(ctx: &Ctx, view: &LockView) -> Vec<Party> {
    view.holders
        .iter()
        .map(|e| Party {
            stowage: e.pid.is_some_and(ident::runs_stowage),
            ..outsider(ctx, e)
        })
        .collect()
}

/// Which images are in use (their lock held), for `stowage images`.
pub fn in_use(tx: &Tx, ctx: &Ctx, kv: &KernelView) -> Result<HashMap<String, bool>> {
    let mut out: HashMap<String, bool> = HashMap::new();
    let swept = sweep(tx, ctx, kv)?.0;
    crate::lease::clean(&ctx.root.locks());
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
