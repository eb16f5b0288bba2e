//! Taking a slot of a class: try every file the priority may take, else
//! record a waiter and wait for any of them in this thread (see the module
//! doc of `slots.rs` for the layout and the rules of limits and reserves).

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::ctx::Ctx;
use crate::error::{Busy, Error};
use crate::judge::class_report;
use crate::lock::{self, FileSet, Guard, Mode, Waker, Woke};
use crate::meta::{LockKind, Record, Role, SlotClass};
use crate::slots::{CHANGED, Priority, candidates, lookup, validate_class};
use crate::store::Store;

/// A held slot. Dropping it releases the slot (closing the descriptor).
#[must_use = "the slot is released when the guard is dropped"]
#[derive(Debug)]
pub struct SlotGuard {
    guard: Guard,
    class: String,
    /// The waiter record made while waiting, to drop when the hold starts.
    pub(crate) waiter: Option<i64>,
    /// The leases directory and the slot file's name there, once the lease
    /// lists this slot (a slot holder writes no record: its lease names it,
    /// see [`SlotGuard::announce`]).
    listed: Option<(PathBuf, String)>,
}

impl SlotGuard {
    pub(crate) fn new(guard: Guard, class: &str) -> SlotGuard {
        SlotGuard {
            guard,
            class: class.to_owned(),
            waiter: None,
            listed: None,
        }
    }

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

    /// Lists the slot in this process's lease, for `command`: how
    /// lock-status and waiting messages name a slot holder (no record is
    /// written for it, so taking a slot changes nothing in the metadata).
    pub(crate) fn announce(&mut self, root: &crate::root::Root, command: &str) {
        let leases = root.leases();
        let rel = root.locks_rel(self.guard.path());
        crate::lease::note(
            &leases,
            crate::lease::Holding::now(Mode::Exclusive, rel.clone(), false, command),
        );
        self.listed = Some((leases, rel));
    }

    /// Releases the slot.
    pub fn release(self, _store: &mut Store) -> Result<()> {
        drop(self);
        Ok(())
    }
}

impl Drop for SlotGuard {
    /// The slot goes out of the lease as it is released (the descriptor
    /// closes right after).
    fn drop(&mut self) {
        if let Some((leases, rel)) = &self.listed {
            crate::lease::forget(leases, rel);
        }
    }
}

fn record(ctx: &Ctx, class: &str, lockfile: String, role: Role, command: &str) -> Record {
    ctx.record(
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
/// use stowage::{Root, Store, acquire::slot, slots::Priority};
///
/// let mut store = Store::new(Root::at("/var/tmp/me.stowage"));
/// // At most `limit` pulls at once across every process using this root.
/// if let Some(held) = slot::acquire(&mut store, "pull", Priority::Normal, None, "my-puller")? {
///     // ... pull ...
///     held.release(&mut store)?;
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
    if let Some(w) = slot.waiter.take() {
        store.with_tx(deadline, |tx, _| tx.delete_record(w))?;
    }
    slot.announce(store.root(), command);
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
    let db = std::cell::OnceCell::new();
    let wanting = match try_fast(store.root(), class, priority, &db) {
        Fast::Got(guard) => return Ok(Some(SlotGuard::new(guard, class))),
        Fast::Unlimited => return Ok(None),
        Fast::Busy => false,
        Fast::Wanting => true,
    };
    let mut config = store.with_tx(deadline, |tx, ctx| {
        let config = lookup(tx, class)?;
        if wanting {
            crate::slots::write_records(tx, ctx, class, Some(&config));
        }
        Ok(config)
    })?;
    if config.limit == 0 {
        return Ok(None);
    }
    let dir = store.root().slot_class_dir(class);
    let label = format!("a {} slot of class '{class}'", priority_word(priority));
    let err = |e| lock::error(&label, &dir, e);
    let slot = |guard| SlotGuard {
        guard,
        class: class.to_owned(),
        waiter: None,
        listed: None,
    };
    let mut slots = Slots::new(store.root(), &dir, &config, priority)?;
    // A change may come between the read of the class and the take: the
    // file taken then says so (its record), and the class is read again.
    // Twice at most here; the wait below goes on the same way.
    for _ in 0..2 {
        let Some(guard) = slots.try_take().map_err(err)? else {
            break;
        };
        if agrees(&guard, &config, &store.root().db()) {
            return Ok(Some(slot(guard)));
        }
        drop(guard);
        config = reread(store, class, deadline)?;
        if config.limit == 0 {
            return Ok(None);
        }
        slots = Slots::new(store.root(), &dir, &config, priority)?;
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
        let kv = crate::judge::kernel_view(tx, ctx, &dir);
        let report = class_report(tx, ctx, &kv, &config)?;
        crate::acquire::image::require_all(tx, &ctx.root, must_exist)?;
        let id = if no_wait {
            None
        } else {
            let rel = ctx.root.locks_rel(&dir);
            Some(tx.insert_record(&record(ctx, class, rel, Role::Waiter, command))?)
        };
        Ok((id, crate::holders::phrase_slots(&report.holders)))
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
    crate::holders::announce_wait(store.ctx(), &what, &format!("all {holders}"));
    let t0 = Instant::now();
    match wait_for_slot(store, class, priority, &dir, config, slots, deadline) {
        Ok(Got::Slot(guard)) => {
            let mut held = slot(guard);
            held.waiter = waiter;
            Ok(Some(held))
        }
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

/// Whether a slot taken the database's way, under `config` as read from
/// the database, may be kept: not if the file's own record (settled or
/// not) states other limits. A change that committed after the read has
/// written them, and may have found no file beyond its limits held just
/// before this take — so this holder would count nowhere (slot_record.rs).
/// A file without a valid record of this database says nothing.
fn agrees(guard: &Guard, config: &SlotClass, db_path: &Path) -> bool {
    // The identity is looked up anew: a wait can outlast a `doctor
    // --repair` that renews it.
    let db = std::cell::OnceCell::new();
    crate::slot_record::read_any(guard.file(), &config.name, db_path, &db)
        .is_none_or(|l| l.limit == config.limit && l.reserve == config.reserve_high)
}

/// Reads the class again after a slot file disagreed with it, and writes
/// its records anew from what the database says (so that records left
/// wrong cannot make every take disagree). A removed class is a usage
/// error, as for a waiter.
fn reread(store: &mut Store, class: &str, deadline: Option<Instant>) -> Result<SlotClass> {
    let now = store.with_tx(deadline, |tx, ctx| {
        let now = tx.slot_class(class)?;
        crate::slots::write_records(tx, ctx, class, now.as_ref());
        Ok(now)
    })?;
    now.ok_or_else(|| {
        Error::Usage(format!(
            "slot class '{class}' was removed while waiting for it"
        ))
        .into()
    })
}

/// What taking a slot on the slot files' records came to.
pub(crate) enum Fast {
    /// A slot, kept on the record of the file it holds.
    Got(Guard),
    /// The class is unlimited: no slot is needed.
    Unlimited,
    /// Every slot the record allows is held: the database's way waits.
    Busy,
    /// No record to go by (none, damaged, another database's, unsettled,
    /// changing): the database's way, which writes them again.
    Wanting,
}

/// Takes a slot of `class` without the global lock or the database, on the
/// records its slot files carry (slot_record.rs): the record of `0.lock`
/// says which files to try (a normal acquirer takes `0.lock` itself when
/// free), and a slot is kept only on the record of the file it holds,
/// within the limits that record states and agreeing with the first.
/// Tried in the order of the database's way (reserved slots first for high
/// priority); a missing file or any error is `Wanting`, never an error:
/// the database's way says what is wrong. `db` keeps the database's
/// identity once looked up, for the images of the same request.
pub(crate) fn try_fast(
    root: &crate::root::Root,
    class: &str,
    priority: Priority,
    db: &std::cell::OnceCell<Option<crate::record::DbId>>,
) -> Fast {
    use crate::slot_record::{self, Kind};
    if validate_class(class).is_err() {
        return Fast::Wanting;
    }
    let dir = root.slot_class_dir(class);
    let db_path = root.db();
    // A slot file's valid record vouches that the file is still the one at
    // its path (lock::acquire_no_wait_vouched): no stat for the unlink race.
    let take = |kind: Kind| {
        lock::acquire_no_wait_vouched(
            &dir.join(kind.file_name()),
            Mode::Exclusive,
            lock::IfMissing::Fail,
            |f| {
                let limits = slot_record::read(f, class, &db_path, db);
                let vouched = limits.is_some();
                (limits, vouched)
            },
        )
    };
    let zero = match priority {
        Priority::Normal => match take(Kind::Normal(0)) {
            Ok(g) => g,
            Err(_) => return Fast::Wanting,
        },
        Priority::High => None,
    };
    let limits = match &zero {
        Some((_, limits)) => *limits,
        // Held, or not ours to try first: its record, read without its
        // lock, only says where to look; the file taken says the rest.
        None => match lock::open_existing(&dir.join(Kind::Normal(0).file_name())) {
            Ok(Some(f)) => slot_record::read(&f, class, &db_path, db),
            _ => None,
        },
    };
    let Some(limits) = limits else {
        return Fast::Wanting;
    };
    if limits.limit == 0 {
        return Fast::Unlimited;
    }
    if let Some((g, _)) = zero {
        return Fast::Got(g);
    }
    let order: Vec<Kind> = match priority {
        Priority::High => (0..limits.reserve)
            .map(Kind::High)
            .chain((0..limits.limit).map(Kind::Normal))
            .collect(),
        Priority::Normal => (1..limits.limit).map(Kind::Normal).collect(),
    };
    for kind in order {
        match take(kind) {
            Ok(Some((g, own))) => {
                return match own {
                    Some(own) if own == limits && kind.within(own) => Fast::Got(g),
                    _ => Fast::Wanting,
                };
            }
            Ok(None) => {}
            Err(_) => return Fast::Wanting,
        }
    }
    Fast::Busy
}

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
    // The file taken disagreed with the configuration: read it again and
    // write the records anew from the database.
    let mut disagreed = false;
    // Disagreements in a row with the database read just before: records
    // that cannot be written anew must not make the wait spin (one
    // transaction per turn); past a few, the database, read afresh each
    // time, is what counts.
    let mut in_a_row = 0u32;
    // A slot file was missing: rebuild the files to try after the recheck.
    let mut missing = false;
    loop {
        if recheck {
            recheck = false;
            recheck_at = Instant::now() + every;
            let rewrite = std::mem::take(&mut disagreed);
            let now = store.with_tx(deadline, |tx, ctx| {
                let now = tx.slot_class(class)?;
                if rewrite {
                    crate::slots::write_records(tx, ctx, class, now.as_ref());
                }
                Ok(now)
            })?;
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
            if std::mem::take(&mut missing)
                || (now.limit, now.reserve_high) != (config.limit, config.reserve_high)
            {
                store.ctx().detail(&format!(
                    "slot class '{class}' changed: limit {}, {} reserved for high priority",
                    now.limit, now.reserve_high
                ));
                slots = Slots::new(store.root(), dir, &now, priority)?;
                config = now;
            }
        }
        match slots.try_take() {
            Ok(Some(guard)) if in_a_row >= 3 || agrees(&guard, &config, &store.root().db()) => {
                return Ok(Got::Slot(guard));
            }
            Ok(Some(_)) => {
                in_a_row += 1;
                disagreed = true;
                recheck = true;
                continue;
            }
            Ok(None) => in_a_row = 0,
            // A file went with its class (`slots rm`): look again. If the
            // class is still there, its directory went (removed by hand):
            // make it and the files again, or every turn would find them
            // missing and the wait would spin.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                recheck = true;
                missing = true;
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
    fn new(
        root: &crate::root::Root,
        dir: &Path,
        config: &SlotClass,
        priority: Priority,
    ) -> Result<Slots> {
        let files = candidates(dir, config, priority);
        let high = match priority {
            Priority::High => config.reserve_high as usize,
            Priority::Normal => 0,
        };
        // The class directory is made (or checked) step by step from the
        // root without following a link: slot files are never created
        // through a link planted for it or for `locks/slots`. Only regular
        // files can be slots held beyond the configuration: a link or
        // directory planted under a slot's name is nobody's slot, and
        // counting it (opened without following links) would fail every
        // acquirer of the class.
        drop(crate::slots::make_class_dir(root, &config.name)?);
        let present: Vec<String> = match std::fs::read_dir(dir) {
            Ok(entries) => entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
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
