//! Slots: cross-process counting semaphores, one class per runtime or kind
//! of heavy work (`pull`, `load/podman`).
//!
//! A class with limit N and reserve R is N + R lock files:
//!
//! ```text
//! ROOT/locks/slots/ENC/0.lock … (N-1).lock          normal slots
//! ROOT/locks/slots/ENC/high-0.lock … high-(R-1).lock  reserved for --priority high
//! ```
//!
//! (ENC is the class name with `/` → `%`, as for images.) Normal work takes
//! any free normal slot, so at most N run at once; high-priority work takes a
//! reserved slot first, else a normal one, so the total is at most N + R and
//! a small urgent request never waits behind a wall of big transfers (the
//! BuildKit design). Limit 0 means unlimited: no lock at all.
//!
//! Invariants:
//! - A slot is an exclusive flock, so the kernel frees it when its holder
//!   dies: no token is ever lost (unlike a make jobserver's pipe).
//! - Slots come first in the lock order (slots → images → global).
//! - The configuration lives in the metadata and is read by each acquirer,
//!   and re-read by each waiter when `slots set`/`slots rm` touches the
//!   class's `changed` file, and every [`RECHECK`] where another host may
//!   change it unannounced (30 s otherwise): a raised limit
//!   (or 0) lets waiters in, a lowered one binds them, a removed class ends
//!   their wait. Lowering a limit never disturbs current holders (they keep
//!   their higher-numbered files), and their slots count against the new
//!   limit until they end.
//! - Waiting for "any of N" needs no thread per file (a pids limit must not
//!   make a wait fail): the waiter keeps the N descriptors open, watches the
//!   class directory with inotify — the last close of a lock file's
//!   descriptor is both the release of its lock and an `IN_CLOSE_WRITE`
//!   event (`IN_CLOSE_NOWRITE` for a read-only holder such as flock(1)) —
//!   and tries the files again when woken. Where closes cannot be
//!   seen (another host on NFS; no inotify) it polls: every 250 ms on
//!   remote filesystems, 50 ms locally.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::ctx::Ctx;
use crate::error::{Busy, Error};
use crate::kernel::KernelView;
use crate::lock::{self, FileSet, Guard, Mode, Probe, Waker, Woke};
use crate::meta::{LockKind, Record, Role, SlotClass, Tx};
use crate::status::{self, Party};
use crate::store::Store;

/// The largest limit (each waiter keeps every slot file open while it waits).
pub const MAX_LIMIT: u32 = 256;
/// The largest reserve for high-priority work.
pub const MAX_RESERVE: u32 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Priority {
    #[default]
    Normal,
    High,
}

/// Checks a class name: lowercase letters, digits, `.`, `_`, `-`, in
/// components separated by single `/`, at most 64 bytes.
pub fn validate_class(class: &str) -> Result<(), Error> {
    let bad = |why: &str| Err(Error::Usage(format!("invalid slot class {class:?}: {why}")));
    if class.is_empty() {
        return bad("the name is empty");
    }
    if class.len() > 64 {
        return bad("longer than 64 bytes");
    }
    for comp in class.split('/') {
        if comp.is_empty() {
            return bad("empty component (leading, trailing or double '/')");
        }
        if !comp.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit()) {
            return bad("each component must start with a lowercase letter or digit");
        }
        if let Some(c) = comp.chars().find(|c| {
            !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-'))
        }) {
            return bad(&format!(
                "{c:?} is not allowed (use lowercase letters, digits, '.', '_', '-', '/')"
            ));
        }
    }
    Ok(())
}

/// `ROOT/locks/slots/ENC`.
pub fn class_dir(ctx: &Ctx, class: &str) -> PathBuf {
    ctx.root.slot_locks().join(class.replace('/', "%"))
}

/// The files an acquirer of `priority` may take, in the order it tries them.
fn candidates(dir: &Path, class: &SlotClass, priority: Priority) -> Vec<PathBuf> {
    let normal = (0..class.limit).map(|i| dir.join(format!("{i}.lock")));
    let high = (0..class.reserve_high).map(|i| dir.join(format!("high-{i}.lock")));
    match priority {
        Priority::Normal => normal.collect(),
        Priority::High => high.chain(normal).collect(),
    }
}

/// A held slot. Dropping it releases the slot (closing the descriptor).
#[must_use = "the slot is released when the guard is dropped"]
#[derive(Debug)]
pub struct SlotGuard {
    guard: Guard,
    class: String,
    /// The waiter record made while waiting, to drop when recording the hold.
    pub(crate) waiter: Option<i64>,
    /// The holder record, once made.
    record: Option<i64>,
}

impl SlotGuard {
    pub fn class(&self) -> &str {
        &self.class
    }

    /// The slot file held, e.g. `ROOT/locks/slots/pull/2.lock`.
    pub fn slot_file(&self) -> &Path {
        self.guard.path()
    }

    pub(crate) fn set_inheritable(&self, inherit: bool) -> io::Result<()> {
        self.guard.set_inheritable(inherit)
    }

    pub(crate) fn raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.guard)
    }

    /// The holder record for this slot (inserted by the caller's transaction).
    pub(crate) fn holder_record(&self, ctx: &Ctx, command: &str) -> Record {
        record(
            ctx,
            &self.class,
            lockfile_rel(ctx, self.guard.path()),
            Role::Holder,
            command,
        )
    }

    pub(crate) fn set_record(&mut self, id: i64) {
        self.record = Some(id);
    }

    pub(crate) fn record_id(&self) -> Option<i64> {
        self.record
    }

    /// Releases the slot and deletes its holder record.
    pub fn release(self, store: &mut Store) -> Result<()> {
        if let Some(id) = self.record {
            store.with_tx(None, |tx, _| tx.delete_record(id))?;
        }
        drop(self.guard);
        Ok(())
    }
}

fn lockfile_rel(ctx: &Ctx, path: &Path) -> String {
    path.strip_prefix(ctx.root.locks())
        .unwrap_or(path)
        .display()
        .to_string()
}

fn record(ctx: &Ctx, class: &str, lockfile: String, role: Role, command: &str) -> Record {
    Record::ours(
        &ctx.me,
        LockKind::Slot,
        class,
        lockfile,
        role,
        Mode::Exclusive,
        command,
    )
}

/// Takes a slot of `class`, recording the holder. `Ok(None)` when the class
/// is unlimited (nothing to take).
///
/// ```no_run
/// use stowage::{Root, Store, slots::{self, Priority}};
///
/// let mut store = Store::new(Root::at("/var/tmp/me.stowage"));
/// // At most `limit` pulls at once across every process using this root.
/// if let Some(slot) = slots::acquire(&mut store, "pull", Priority::Normal, None, "my-puller")? {
///     // ... pull ...
///     slot.release(&mut store)?;
/// }
/// # Ok::<(), anyhow::Error>(())
/// ```
pub fn acquire(
    store: &mut Store,
    class: &str,
    priority: Priority,
    deadline: Option<Instant>,
    command: &str,
) -> Result<Option<SlotGuard>> {
    let Some(mut slot) = acquire_unrecorded(store, class, priority, deadline, false, command, &[])?
    else {
        return Ok(None);
    };
    let id = store.with_tx(deadline, |tx, ctx| {
        if let Some(w) = slot.waiter {
            tx.delete_record(w)?;
        }
        tx.insert_record(&slot.holder_record(ctx, command))
    })?;
    slot.waiter = None;
    slot.set_record(id);
    Ok(Some(slot))
}

/// Takes a slot without recording the holder: `exec` records it in its
/// start transaction, saving a round trip.
///
/// A waiter follows the configuration: it re-reads the class when `slots
/// set`/`slots rm` says it changed (a close of the class's `changed` file,
/// seen through inotify), and every [`RECHECK`] where changes made on
/// another host cannot be seen (every 30 s otherwise). A raised limit or 0
/// (unlimited) lets it in at once; a lowered one binds it; a removed class
/// ends its wait (exit 64).
pub(crate) fn acquire_unrecorded(
    store: &mut Store,
    class: &str,
    priority: Priority,
    deadline: Option<Instant>,
    no_wait: bool,
    command: &str,
    must_exist: &[crate::name::ImageName],
) -> Result<Option<SlotGuard>> {
    validate_class(class)?;
    let config = store.with_tx(deadline, |tx, _| lookup(tx, class))?;
    if config.limit == 0 {
        return Ok(None);
    }
    let dir = class_dir(store.ctx(), class);
    let label = format!("a {} slot of class '{class}'", priority_word(priority));
    let err = |e| lock::error(&label, &dir, e);
    let slot = |guard| SlotGuard {
        guard,
        class: class.to_owned(),
        waiter: None,
        record: None,
    };
    let mut slots = Slots::new(&dir, &config, priority)?;
    if let Some(guard) = slots.try_take().map_err(err)? {
        return Ok(Some(slot(guard)));
    }

    // All busy. If one of them is held by our enclosing command (an exec
    // with this slot runs us), we work under its slot: waiting for another
    // could wait for ourselves (limit 1), and the enclosing command's slot
    // already counts this work.
    if slots
        .every_file()
        .any(|f| crate::nested::enclosing_hold(f).is_some())
    {
        store.ctx().detail(&format!(
            "an enclosing command holds a slot of class '{class}'; working under it"
        ));
        return Ok(None);
    }

    // Record ourselves as a waiter and say who holds the slots.
    let (waiter, holders) = store.with_tx(deadline, |tx, ctx| {
        let kv = tx.kernel_view(&dir);
        let report = class_report(tx, ctx, &kv, &config)?;
        crate::session::require_all(tx, must_exist)?;
        let id = if no_wait {
            None
        } else {
            let rel = lockfile_rel(ctx, &dir);
            Some(tx.insert_record(&record(ctx, class, rel, Role::Waiter, command))?)
        };
        Ok((id, status::phrase_slots(&report.holders)))
    })?;
    let what = format!(
        "{label} (limit {}, {} reserved for high priority)",
        config.limit, config.reserve_high
    );
    if no_wait {
        return Err(Error::Busy(Busy {
            what,
            holders,
            waited: Duration::ZERO,
        })
        .into());
    }
    store
        .ctx()
        .say(&format!("waiting for {what}: all {holders}"));
    let t0 = Instant::now();
    match wait_for_slot(store, class, priority, &dir, config, slots, deadline) {
        Ok(Got::Slot(guard)) => Ok(Some(SlotGuard {
            waiter,
            ..slot(guard)
        })),
        Ok(got) => {
            if let Some(id) = waiter {
                store.forget_record(id);
            }
            match got {
                Got::Unlimited => Ok(None),
                _ => Err(Error::Busy(Busy {
                    what,
                    holders,
                    waited: t0.elapsed(),
                })
                .into()),
            }
        }
        Err(e) => {
            if let Some(id) = waiter {
                store.forget_record(id);
            }
            Err(e)
        }
    }
}

/// The file whose close tells waiters that the class's configuration
/// changed: `ROOT/locks/slots/ENC/changed`.
const CHANGED: &str = "changed";

/// How often a waiting acquirer re-reads its class's configuration even
/// without being told, where another host may change it unseen (a shared
/// filesystem, or no inotify).
pub const RECHECK: Duration = Duration::from_secs(2);

/// The same on a local filesystem watched with inotify, where every change
/// is announced (only an older release's `slots set` is not): a safety net
/// that costs one transaction per waiter twice a minute.
const RECHECK_LOCAL: Duration = Duration::from_secs(30);

/// How often a waiter retries when closes cannot wake it: the local promise
/// is a freed slot taken within 100 ms.
const POLL: Duration = Duration::from_millis(50);

/// Tells waiters of `class` on this host to re-read its configuration
/// (others re-read it every [`RECHECK`]). Best effort.
pub fn notify_change(ctx: &Ctx, class: &str) {
    // Through descriptors, never a symlink planted in the path: a group
    // member could otherwise make us create `changed` elsewhere.
    let rel = format!("locks/slots/{}", class.replace('/', "%"));
    if let Ok(dir) = ctx.root.open_sub(&rel) {
        let _ = dir.touch_closed(CHANGED);
    }
}

enum Got {
    Slot(Guard),
    /// The class became unlimited: no slot is needed.
    Unlimited,
    TimedOut,
}

/// Waits for a slot in the calling thread: no helper thread per slot file
/// (a pids limit must not make a wait fail). Closes in the class directory
/// wake it (see [`lock::Waker`]); where they cannot (no inotify, or another
/// host's close on NFS) it polls.
fn wait_for_slot(
    store: &mut Store,
    class: &str,
    priority: Priority,
    dir: &Path,
    mut config: SlotClass,
    mut slots: Slots,
    deadline: Option<Instant>,
) -> Result<Got> {
    lock::starting_to_wait();
    let label = format!("a {} slot of class '{class}'", priority_word(priority));
    let err = |e| lock::error(&label, dir, e);
    // Watch first, then try: a slot freed in between is not missed.
    let waker = Waker::watch(dir, Some(CHANGED));
    let local = crate::filesystem::filesystem(dir).is_ok_and(|f| f.local);
    let poll = match (local, waker.watching()) {
        (true, true) => None,
        (true, false) => Some(POLL),
        (false, _) => Some(lock::REMOTE_REARM),
    };
    let every = if poll.is_none() {
        RECHECK_LOCAL
    } else {
        RECHECK
    };
    let mut recheck_at = Instant::now() + every;
    let mut recheck = false;
    loop {
        if recheck {
            recheck = false;
            recheck_at = Instant::now() + every;
            let now = store.with_tx(deadline, |tx, _| tx.slot_class(class))?;
            let Some(now) = now else {
                return Err(Error::Usage(format!(
                    "slot class '{class}' was removed while waiting for it"
                ))
                .into());
            };
            if now.limit == 0 {
                store
                    .ctx()
                    .detail(&format!("slot class '{class}' is unlimited now"));
                return Ok(Got::Unlimited);
            }
            if (now.limit, now.reserve_high) != (config.limit, config.reserve_high) {
                store.ctx().detail(&format!(
                    "slot class '{class}' changed: limit {}, {} reserved for high priority",
                    now.limit, now.reserve_high
                ));
                slots = Slots::new(dir, &now, priority)?;
                config = now;
            }
        }
        match slots.try_take() {
            Ok(Some(guard)) => return Ok(Got::Slot(guard)),
            Ok(None) => {}
            // A file went with its class (`slots rm`): look again.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                recheck = true;
                continue;
            }
            Err(e) => return Err(err(e)),
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Ok(Got::TimedOut);
        }
        let mut until = recheck_at;
        if let Some(d) = deadline {
            until = until.min(d);
        }
        if let Some(p) = poll {
            until = until.min(now + p);
        }
        match waker.sleep(Some(until)).map_err(err)? {
            Woke::Interrupted(sig) => return Err(Error::Interrupted(sig).into()),
            Woke::Changed { named: true } => recheck = true,
            Woke::Changed { named: false } => {}
            Woke::Timeout => recheck = Instant::now() >= recheck_at,
        }
    }
}

/// The slot files one acquirer may take under one configuration, and the
/// files of slots above it (left by a lowered limit while held).
struct Slots {
    candidates: FileSet,
    /// How many of `candidates` (the first ones) are reserved slots.
    high: usize,
    limit: usize,
    reserve: usize,
    /// Normal and reserved slot files beyond the configuration.
    beyond: FileSet,
    beyond_high: FileSet,
}

impl Slots {
    fn new(dir: &Path, config: &SlotClass, priority: Priority) -> Result<Slots> {
        let files = candidates(dir, config, priority);
        let high = match priority {
            Priority::High => config.reserve_high as usize,
            Priority::Normal => 0,
        };
        // The listing also makes the directory on first use.
        let present: Vec<String> = match std::fs::read_dir(dir) {
            Ok(entries) => entries
                .flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                crate::root::make_dir(dir)?;
                Vec::new()
            }
            Err(e) => {
                return Err(anyhow::Error::new(e)
                    .context(format!("cannot list slot files in {}", dir.display())));
            }
        };
        let index = |name: &str, prefix: &str| -> Option<u32> {
            name.strip_suffix(".lock")?
                .strip_prefix(prefix)?
                .parse::<u32>()
                .ok()
        };
        let beyond: Vec<PathBuf> = present
            .iter()
            .filter(|n| index(n, "").is_some_and(|i| i >= config.limit))
            .map(|n| dir.join(n))
            .collect();
        let beyond_high: Vec<PathBuf> = present
            .iter()
            .filter(|n| index(n, "high-").is_some_and(|i| i >= config.reserve_high))
            .map(|n| dir.join(n))
            .collect();
        Ok(Slots {
            candidates: FileSet::new(files, Mode::Exclusive),
            high,
            limit: config.limit as usize,
            reserve: config.reserve_high as usize,
            beyond: FileSet::new(beyond, Mode::Exclusive),
            beyond_high: FileSet::new(beyond_high, Mode::Exclusive),
        })
    }

    fn every_file(&self) -> impl Iterator<Item = &PathBuf> {
        self.candidates
            .paths()
            .iter()
            .chain(self.beyond.paths())
            .chain(self.beyond_high.paths())
    }

    /// One pass of tries. A slot is kept only if, with it, the slots of its
    /// kind in use stay within the configuration: after a lowered limit,
    /// holders above it keep their slots and count against it.
    fn try_take(&mut self) -> std::io::Result<Option<Guard>> {
        let Some((i, guard)) = self.candidates.try_any()? else {
            return Ok(None);
        };
        let is_high = i < self.high;
        let (beyond, bound) = if is_high {
            (&mut self.beyond_high, self.reserve)
        } else {
            (&mut self.beyond, self.limit)
        };
        if beyond.paths().is_empty() {
            return Ok(Some(guard));
        }
        let mut in_use = beyond.held_count(|_| true)? + 1;
        // The other slots of the same kind among our candidates.
        let high = self.high;
        in_use += self
            .candidates
            .held_count(|j| j != i && (j < high) == is_high)?;
        if in_use > bound {
            self.candidates.put_back(i, guard);
            return Ok(None);
        }
        Ok(Some(guard))
    }
}

fn priority_word(p: Priority) -> &'static str {
    match p {
        Priority::Normal => "normal",
        Priority::High => "high-priority",
    }
}

/// The configuration of a class; an unknown class is a usage error that
/// lists the configured ones.
pub fn lookup(tx: &Tx, class: &str) -> Result<SlotClass> {
    if let Some(c) = tx.slot_class(class)? {
        return Ok(c);
    }
    let known: Vec<String> = tx.slot_classes()?.into_iter().map(|c| c.name).collect();
    let hint = if known.is_empty() {
        "no slot classes are configured; add one with 'stowage slots set CLASS LIMIT'".to_owned()
    } else {
        format!("configured classes: {}", known.join(", "))
    };
    Err(Error::Usage(format!("unknown slot class '{class}' ({hint})")).into())
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
    let dir = class_dir(ctx, &class.name);
    let records = tx.records_for(LockKind::Slot, &class.name)?;
    let mut files: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "lock"))
            .collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    let mut in_use = 0;
    let mut holders = Vec::new();
    let mut held_any = false;
    for file in &files {
        let rel = lockfile_rel(ctx, file);
        let mine: Vec<Record> = records
            .iter()
            .filter(|r| r.role == Role::Holder && r.lockfile == rel)
            .cloned()
            .collect();
        let view = kv.view(file)?;
        // A recorded slot the table calls free is probed: inside a pid
        // namespace the table hides slots taken outside it.
        let held = if view.unconfirmed_free.is_some() && !mine.is_empty() {
            view.confirmed().is_held()
        } else {
            view.is_held()
        };
        if held {
            in_use += 1;
            held_any = true;
        }
        let (h, _) = status::judge(tx, ctx, kv, &view, &mine)?;
        holders.extend(h);
    }
    // Holder records whose slot file no longer exists are stale.
    for r in records.iter().filter(|r| r.role == Role::Holder) {
        if !files.iter().any(|f| lockfile_rel(ctx, f) == r.lockfile) {
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
    let (_, waiters) = status::judge(tx, ctx, kv, &class_view, &waiting)?;
    Ok(ClassReport {
        class: class.clone(),
        in_use,
        holders,
        waiters,
    })
}

/// Removes a class: its configuration, then every slot file nobody holds
/// (unlinked under its exclusive lock, as the unlink rule requires).
/// Returns how many slots were still held (their files stay until released).
pub fn remove_class(store: &mut Store, class: &str) -> Result<u32> {
    validate_class(class)?;
    store.with_tx(None, |tx, _| {
        lookup(tx, class)?;
        tx.delete_slot_class(class)?;
        Ok(())
    })?;
    // Its waiters stop waiting (they re-read the class and find it gone).
    notify_change(store.ctx(), class);
    let dir = class_dir(store.ctx(), class);
    let mut busy = 0;
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            match lock::acquire_no_wait(&e.path(), Mode::Exclusive, lock::IfMissing::Fail) {
                Ok(Some(g)) => crate::remove::unlink_lock(store.root(), g)?,
                Ok(None) => busy += 1,
                Err(_) => {}
            }
        }
    }
    let _ = std::fs::remove_dir(&dir);
    Ok(busy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_names() {
        for ok in ["pull", "load/podman", "a.b_c-d", "0", "x/y/z"] {
            assert!(validate_class(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Pull",
            "/pull",
            "pull/",
            "a//b",
            "-x",
            "a b",
            "a%b",
            "a:b",
            &"x".repeat(65),
        ] {
            assert!(validate_class(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn high_priority_tries_the_reserve_first() {
        let class = SlotClass {
            name: "pull".into(),
            limit: 2,
            reserve_high: 1,
        };
        let d = Path::new("/r");
        let names = |p| {
            candidates(d, &class, p)
                .iter()
                .map(|f| f.file_name().unwrap().to_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(Priority::Normal), ["0.lock", "1.lock"]);
        assert_eq!(names(Priority::High), ["high-0.lock", "0.lock", "1.lock"]);
    }
}
