//! Taking a slot of a class: try every file the priority may take, else wait for any of them in
//! this thread (`slots.rs` has the layout and the rules of limits and reserves).
//!
//! - A normal acquirer tries `0.lock` first and reads the class record in the same go: uncontended,
//!   a slot costs one lock and one read.
//! - A slot taken is kept only if the class record read after the take still allows it: a
//!   `slots set` that lowered the limit in between is obeyed.
//! - Waiting needs no thread per file: the waiter keeps the files open and sleeps on inotify (the
//!   last close of a lock file is its release).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::error::{Busy, Error};
use crate::holders::Look;
use crate::lock::{self, FileSet, Guard, Mode, Waker, Woke};
use crate::root::Root;
use crate::slot_limits::{self, Class, Kind, Limits};
use crate::slots::{CHANGED, Priority, candidates, lookup, validate_class};
use crate::store::Store;

/// A held slot. Dropping it releases the slot (closing the descriptor).
#[must_use = "the slot is released when the guard is dropped"]
#[derive(Debug)]
pub struct SlotGuard {
    pub(crate) guard: Guard,
    /// The leases directory and the slot file's name there, once the lease lists this slot.
    listed: Option<(PathBuf, String)>,
}

impl SlotGuard {
    fn new(guard: Guard) -> SlotGuard {
        SlotGuard {
            guard,
            listed: None,
        }
    }

    /// What our lease is to say of the slot; taken out of the lease when the slot goes.
    pub(crate) fn listing(&mut self, root: &Root, command: &str) -> crate::lease::Holding {
        let rel = root.locks_rel(self.guard.path());
        self.listed = Some((root.leases(), rel.clone()));
        crate::lease::Holding::now(Mode::Exclusive, rel, false, command)
    }

    /// The slot's class, as its directory names it.
    pub fn class(&self) -> String {
        let dir = self.guard.path().parent().and_then(Path::file_name);
        dir.map_or_else(String::new, |d| d.to_string_lossy().replace('%', "/"))
    }

    /// Whether the slot was lost while held (the connection to the server dropped, where it may):
    /// `Some(cause)`. Another may have taken it meanwhile, the class over its limit.
    pub fn lost(&self, root: &Root) -> Option<String> {
        // Asked of the locks directory, whose filesystem is known: a class's costs a statfs.
        if crate::lock::unlinks_allowed(&root.locks().join("slots")) {
            return None;
        }
        self.guard.lost()
    }

    /// What to warn of a slot found [lost](SlotGuard::lost) at the end of the command it covered.
    pub fn lost_warning(&self, why: &str) -> String {
        let class = self.class();
        format!(
            "warning: lost its slot of class '{class}' while the command ran ({why}): slot class '{class}' may have gone over its limit meanwhile"
        )
    }

    /// Releases the slot.
    pub fn release(self) {
        drop(self);
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some((leases, rel)) = &self.listed {
            crate::lease::forget(leases, rel);
        }
    }
}

/// Takes a slot of `class`, listing it in our lease (in an unlimited class too: it counts against a
/// limit set later). `Ok(None)` only where a waiter was let in without one (an enclosing holder's).
///
/// ```no_run
/// use stowage::{Root, Store, acquire::slot, slots::Priority};
///
/// let mut store = Store::new(Root::at("/var/tmp/me.stowage"));
/// // At most `limit` pulls at once across every process using this root.
/// if let Some(held) = slot::acquire(&mut store, "pull", Priority::Normal, None, "my-puller")? {
///     // ... pull ...
///     held.release();
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
    let _ = crate::lease::mine(&store.root().leases());
    let mut slot = take(store, class, priority, deadline, false, command, &[])?;
    if let Some(s) = slot.as_mut() {
        crate::lease::note(&store.root().leases(), s.listing(store.root(), command));
    }
    Ok(slot)
}

/// Takes a slot; the caller lists it in its lease. `must_exist` is checked before any wait.
pub(crate) fn take(
    store: &Store,
    class: &str,
    priority: Priority,
    deadline: Option<Instant>,
    no_wait: bool,
    command: &str,
    must_exist: &[crate::name::ImageName],
) -> Result<Option<SlotGuard>> {
    validate_class(class)?;
    let root = store.root();
    let dir = root.slot_class_dir(class);
    let slots = match try_now(root, class, priority, &dir) {
        Ok(Ok(got)) => return Ok(got),
        Ok(Err(busy)) => busy,
        // A file at `locks` where no store is: said as no store.
        Err(e) => return Err(root.foreign_locks().unwrap_or(e)),
    };
    let limits = slots.limits;
    crate::debug::pause("slot-busy");
    // All busy; if our enclosing command holds one, we work under it (a wait could be for us).
    let class_rel = root.locks_rel(&dir);
    let of_class = |e: &crate::nested::Enclosing| {
        e.holds
            .iter()
            .any(|h| h.lockfile.starts_with(&format!("{class_rel}/")))
    };
    let enclosing = crate::nested::enclosing(root);
    let under_enclosing = || {
        store.ctx().detail(&format!(
            "an enclosing command holds a slot of class '{class}'; working under it"
        ));
        Ok(None)
    };
    if of_class(&enclosing) {
        return under_enclosing();
    }
    // An enclosing exec that had not announced its lease: looked for again while we wait.
    let ours_now = || enclosing.unannounced && of_class(&crate::nested::enclosing_now(root));
    crate::acquire::image::require_all(root, must_exist)?;
    let word = match priority {
        Priority::Normal => "normal",
        Priority::High => "high-priority",
    };
    let what = format!(
        "a {word} slot of class '{class}' (limit {}, {} reserved for high priority)",
        limits.limit, limits.reserve
    );
    let until = crate::holders::looked_for_until(deadline, no_wait);
    let now = || {
        let look = Look::until(store.ctx(), until);
        let r = crate::slots::report_of(&look, root, class, Some(limits), priority);
        crate::holders::phrase_as("all in use by ", &r.holders)
    };
    let holders = now();
    // A slot freed while we looked (see `image::wait_taking`): one more try before saying we wait.
    if let Ok(got) = try_now(root, class, priority, &dir)? {
        return Ok(got);
    }
    if let Some(why) = refused(no_wait, &enclosing, &holders) {
        return Err(Busy::now(what, why).into());
    }
    let reread: crate::wait_line::Reread = {
        let (root, class) = (root.clone(), class.to_owned());
        Box::new(move |look| crate::slots::report(look, &root, &class, Some(limits)))
    };
    let line = crate::wait_line::announce(store.ctx(), &what, &holders, Some(reread));
    let awaited = crate::lease::Holding::now(Mode::Exclusive, class_rel.clone(), true, command);
    let got = super::wait_for(store, awaited, &[], what, now, || {
        wait_for_slot(store, class, priority, &dir, slots, deadline, &ours_now)
    });
    drop(line);
    match got? {
        Some(g) => Ok(Some(SlotGuard::new(g))),
        None if ours_now() => under_enclosing(),
        None => Ok(None),
    }
}

/// Why a wait for a full class is refused, if it is: none was asked for (`--no-wait`), or an
/// enclosing command holds an image. Slots come before images: the slot's holder may be waiting
/// for that image, a cycle nobody would end.
fn refused(no_wait: bool, enclosing: &crate::nested::Enclosing, holders: &str) -> Option<String> {
    if no_wait {
        return Some(holders.to_owned());
    }
    let image = enclosing.holds.iter().find_map(|h| {
        let enc = h.lockfile.strip_prefix("images/")?.strip_suffix(".lock")?;
        crate::name::ImageName::from_encoded(enc).ok()
    })?;
    Some(format!(
        "{holders}; not waited for: an enclosing command holds image '{image}'"
    ))
}

/// A slot if one is free now (`Ok(Ok(_))`), else the class's files to wait on, with the limits they
/// were chosen by.
fn try_now(
    root: &Root,
    class: &str,
    priority: Priority,
    dir: &Path,
) -> Result<Result<Option<SlotGuard>, Slots>> {
    if priority == Priority::Normal
        && let Some(first) = try_first(root, class)?
    {
        return Ok(Ok(first));
    }
    // Two tries; a record changed again after them is left to the wait.
    for tries in 1.. {
        let limits = lookup(root, class)?;
        if limits.limit == 0 && tries <= 2 {
            match take_unlimited(root, class, dir) {
                Ok(Some(g)) => return Ok(Ok(Some(SlotGuard::new(g)))),
                Ok(None) => continue,
                Err(e) => return Err(lock::error(&format!("a slot of class '{class}'"), dir, e)),
            }
        }
        let mut slots = Slots::new(dir, &limits, priority);
        if tries > 2 {
            return Ok(Err(slots));
        }
        match slots.try_take(root, class)? {
            Took::Slot(g) => {
                // The record is settled once the files beyond a lowered limit are free (global
                // lock tried).
                if !limits.settled()
                    && let Ok(Some(_global)) = lock::acquire_no_wait(
                        &root.global_lock(),
                        Mode::Exclusive,
                        lock::IfMissing::Fail,
                    )
                    && let Ok(Some(f)) = lock::open_existing(&dir.join(Kind::Normal(0).file_name()))
                    && slot_limits::read(&f, class).ok() == Some(Class::Limits(limits))
                {
                    crate::slots::settle(root, class, &f, limits);
                }
                return Ok(Ok(Some(SlotGuard::new(g))));
            }
            Took::Changed => {}
            Took::Busy => return Ok(Err(slots)),
        }
    }
    unreachable!("the tries end")
}

/// A normal acquirer's first try: `0.lock`, whose class record, read under the lock, allows the
/// slot (unlimited too) and proves the file at its path. `Some` if that decides.
fn try_first(root: &Root, class: &str) -> Result<Option<Option<SlotGuard>>> {
    let path = root.slot_class_dir(class).join(Kind::Normal(0).file_name());
    let got = lock::acquire_no_wait_with(&path, Mode::Exclusive, lock::IfMissing::Fail, |f| {
        let c = slot_limits::read(f, class).unwrap_or(Class::Damaged);
        (c, matches!(c, Class::Limits(_)))
    });
    match got {
        Ok(Some((g, Class::Limits(l)))) if l.settled() => Ok(Some(Some(SlotGuard::new(g)))),
        // Busy, unsettled, no record, or no such file: the general way says what is wrong.
        Ok(_) => Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => Ok(None),
        Err(e) => Err(lock::error(&format!("a slot of class '{class}'"), &path, e)),
    }
}

/// A slot file of an unlimited class, taken without waiting: the first free one, made if need be,
/// so a limit set later counts its holder. `None` if the class has a limit now (read after the take,
/// as `slots set` lists the files after writing it).
fn take_unlimited(root: &Root, class: &str, dir: &Path) -> std::io::Result<Option<Guard>> {
    for i in 0.. {
        let path = dir.join(Kind::Normal(i).file_name());
        let g = match lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Create) {
            Ok(Some(g)) => g,
            Ok(None) => continue,
            // A plant under a slot's name is no slot (doctor reports it).
            Err(e) if crate::planted::find(&e).is_some() => continue,
            Err(e) => return Err(e),
        };
        let unlimited =
            matches!(crate::slots::read_class(root, class), Ok(Class::Limits(l)) if l.limit == 0);
        return Ok(unlimited.then_some(g));
    }
    unreachable!("a free file is found")
}

/// How often a waiting acquirer re-reads its class untold, where another host may change it unseen.
const RECHECK: Duration = Duration::from_secs(2);
/// The same on a local filesystem watched with inotify.
const RECHECK_LOCAL: Duration = Duration::from_secs(30);
/// Retry interval when closes cannot wake a waiter: locally a freed slot is taken within 100 ms.
/// So too while a slot is held outside stowage (flock(1)), which may let go by `flock -u`: no close.
const POLL: Duration = Duration::from_millis(50);
/// How often such a waiter looks again (leases only) whether an outsider still holds a slot.
const OUTSIDER_LOOK: Duration = Duration::from_secs(1);
/// After a close wakes a waiter whose try then finds the slot held, it tries again after 1 ms,
/// doubling to this (`after_close`): the kernel tells of a file's last close before it releases
/// the file's flock, and a try in between would sleep through the release (1 wake in 100 seen).
const SETTLE_LAST: Duration = Duration::from_millis(128);

/// Waits for a slot of `class` in `dir`, starting from `slots` (a class turned unlimited gives one at
/// once); `None` if `under_enclosing` (asked at each recheck) says an enclosing exec holds one.
/// Descriptors lost with the connection to the server are dropped, and the wait goes on afresh.
fn wait_for_slot(
    store: &Store,
    class: &str,
    priority: Priority,
    dir: &Path,
    mut slots: Slots,
    deadline: Option<Instant>,
    under_enclosing: &dyn Fn() -> bool,
) -> Result<lock::Waited<Option<Guard>>> {
    lock::starting_to_wait();
    let failed = |e| lock::error(&format!("a slot of class '{class}'"), dir, e);
    crate::debug::pause("slot-watching");
    let waker = Waker::watch(dir, Some(CHANGED));
    let poll = polling(dir, &waker);
    let every = poll.map_or(RECHECK_LOCAL, |_| RECHECK);
    let mut recheck_at = Instant::now() + every;
    let mut recheck = true; // a change since the tries, before the watch, told nobody
    let mut after_close: Option<Duration> = None;
    let mut reconnect = lock::Reconnect::default();
    let mut outsider = Outsider {
        watched: poll.is_none(),
        due: false,
        holds: false,
        next: Instant::now(),
    };
    loop {
        // Only how soon to try again rests on it: a look that failed (a dropped connection) is none.
        let _ = outsider.look(&mut slots, store.root(), recheck);
        if recheck {
            recheck_at = Instant::now() + every;
        }
        match slot_pass(store, class, dir, &mut slots, &mut recheck, under_enclosing) {
            Ok(Some(done)) => return Ok(done),
            Ok(None) => {}
            Err(e) if lock::disconnected_in(&e) => {
                slots = Slots::new(dir, &slots.limits, priority);
                recheck = true;
                match reconnect.pause(e, deadline)? {
                    Some(end) => return Ok(end),
                    None => continue,
                }
            }
            Err(e) => return Err(e),
        }
        if recheck {
            continue;
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Ok(lock::Waited::TimedOut);
        }
        let poll = if outsider.holds { Some(POLL) } else { poll };
        let polled = poll.map_or(recheck_at, |p| recheck_at.min(now + p));
        let polled = after_close.map_or(polled, |s| polled.min(now + s));
        let until = deadline.map_or(polled, |d| polled.min(d));
        match waker.sleep(Some(until)).map_err(failed)? {
            Woke::Interrupted(sig) => return Ok(lock::Waited::Interrupted(sig)),
            Woke::Changed { named } => {
                recheck |= named;
                after_close = Some(Duration::from_millis(1));
            }
            Woke::Timeout => {
                recheck = Instant::now() >= recheck_at;
                // Tries after a close ended busy: an outsider may have taken the slot.
                outsider.due |= after_close.is_some_and(|s| s * 2 > SETTLE_LAST);
                after_close = after_close.map(|s| s * 2).filter(|s| *s <= SETTLE_LAST);
            }
        }
    }
}

/// One pass of a slot wait: the class reread if `recheck`, then one try of its files. `Some`: the
/// wait is over; `None` with `recheck` set: look again at once.
fn slot_pass(
    store: &Store,
    class: &str,
    dir: &Path,
    slots: &mut Slots,
    recheck: &mut bool,
    under_enclosing: &dyn Fn() -> bool,
) -> Result<Option<lock::Waited<Option<Guard>>>> {
    if std::mem::take(recheck) {
        if under_enclosing() {
            return Ok(Some(lock::Waited::Acquired(None)));
        }
        match reread_class(store, class, &slots.limits)? {
            // Turned unlimited: a file of its own all the same, so that a limit set later counts it.
            None => match take_unlimited(store.root(), class, dir) {
                Ok(Some(g)) => return Ok(Some(lock::Waited::Acquired(Some(g)))),
                Ok(None) => *recheck = true,
                Err(e) => return Err(lock::error(&format!("a slot of class '{class}'"), dir, e)),
            },
            Some(now) if now != slots.limits => *slots = Slots::new(dir, &now, slots.priority),
            Some(_) => {}
        }
    }
    match slots.try_take(store.root(), class) {
        Ok(Took::Slot(g)) => return Ok(Some(lock::Waited::Acquired(Some(g)))),
        Ok(Took::Changed) => *recheck = true,
        Ok(Took::Busy) => {}
        // A file went with its class (`slots rm`): look again.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            *recheck = true;
            std::thread::sleep(POLL);
        }
        Err(e) => return Err(lock::error(&format!("a slot of class '{class}'"), dir, e)),
    }
    Ok(None)
}

/// How often a waiter polls untold: never where inotify tells it of each local close.
fn polling(dir: &Path, waker: &Waker) -> Option<Duration> {
    let local = crate::filesystem::filesystem(dir).is_ok_and(|f| f.local);
    match (local, waker.watching()) {
        (true, true) => None,
        (true, false) => Some(POLL),
        (false, _) => Some(lock::REMOTE_REARM),
    }
}

/// Where closes wake a waiter: whether a process no lease names holds a slot it may take (looked
/// at on each recheck, when the tries after a close end busy, and every [`OUTSIDER_LOOK`] while
/// one does), so that it polls meanwhile.
struct Outsider {
    watched: bool,
    due: bool,
    holds: bool,
    next: Instant,
}

impl Outsider {
    fn look(&mut self, slots: &mut Slots, root: &Root, recheck: bool) -> std::io::Result<()> {
        self.due |= recheck || (self.holds && Instant::now() >= self.next);
        if self.watched && std::mem::take(&mut self.due) {
            self.next = Instant::now() + OUTSIDER_LOOK;
            self.holds = slots.held_outside(root)?;
        }
        Ok(())
    }
}

/// Rereads the class for a waiter: removed is an error (64), unlimited (`None`) lets it in.
fn reread_class(store: &Store, class: &str, limits: &Limits) -> Result<Option<Limits>> {
    let now = crate::slots::read_class(store.root(), class)?;
    // Emptied by an opener, not removed by `slots rm`: waited for under the limits read before.
    if now == Class::Emptied {
        let emptied = crate::slots::emptied(store.root(), class);
        store
            .ctx()
            .detail(&format!("{emptied}; waiting under the limits read before"));
        return Ok(Some(*limits));
    }
    let Class::Limits(now) = now else {
        return Err(Error::Usage(format!(
            "slot class '{class}' was removed while waiting for it"
        ))
        .into());
    };
    if now.limit == 0 {
        store
            .ctx()
            .detail(&format!("slot class '{class}' is unlimited now"));
        return Ok(None);
    }
    if now != *limits {
        store.ctx().detail(&format!(
            "slot class '{class}' changed: limit {}, {} reserved for high priority",
            now.limit, now.reserve
        ));
    }
    Ok(Some(now))
}

enum Took {
    Slot(Guard),
    Busy,
    /// The record no longer says the limits the take went by: read it again.
    Changed,
}

/// The slot files one acquirer may take under one reading of the limits, and the files beyond them
/// that holders of a higher limit may keep.
struct Slots {
    candidates: FileSet,
    /// How many of `candidates` (the first ones) are reserved slots.
    high: usize,
    priority: Priority,
    limits: Limits,
    beyond: FileSet,
    beyond_high: FileSet,
    /// Every reserved file that may be held (only while some lie beyond a lowered reserve): their
    /// holders beyond the reserve count against the limit.
    reserved: FileSet,
}

impl Slots {
    fn new(dir: &Path, limits: &Limits, priority: Priority) -> Slots {
        let high = match priority {
            Priority::High => limits.reserve as usize,
            Priority::Normal => 0,
        };
        let (beyond, beyond_high) = crate::slots::beyond(dir, limits);
        let reserved = match beyond_high.is_empty() {
            true => Vec::new(),
            false => (0..limits.high_files)
                .map(|i| dir.join(Kind::High(i).file_name()))
                .collect(),
        };
        Slots {
            candidates: FileSet::new(candidates(dir, limits, priority)),
            high,
            priority,
            limits: *limits,
            beyond: FileSet::new(beyond),
            beyond_high: FileSet::new(beyond_high),
            reserved: FileSet::new(reserved),
        }
    }

    /// Whether a file this acquirer may take is held by a process stowage did not start: no lease
    /// lists it as held. Asked through our own descriptors and the leases: no close in the class.
    fn held_outside(&mut self, root: &Root) -> std::io::Result<bool> {
        let leases = root.leases();
        let listed: std::collections::HashSet<String> = crate::lease::listing(&leases)
            .iter()
            .filter_map(|n| crate::lease::identity(&leases, n))
            .flat_map(|id| id.holdings.into_iter().filter(|h| !h.awaits))
            .map(|h| h.lockfile)
            .collect();
        let unlisted: Vec<bool> = (self.candidates.paths().iter())
            .map(|p| !listed.contains(&root.locks_rel(p)))
            .collect();
        Ok(self.candidates.held_count(|j| unlisted[j])? > 0)
    }

    /// Holders of reserved files beyond the reserve (a lowered one): they count as normal holders,
    /// so the total stays within limit + reserve.
    fn spilled(&mut self) -> std::io::Result<usize> {
        if self.reserved.paths().is_empty() {
            return Ok(0);
        }
        let held = self.reserved.held_count(|_| true)?;
        Ok(held.saturating_sub(self.limits.reserve as usize))
    }

    /// One pass of tries. A slot is kept only if the record read after the take still says these
    /// limits, and its kind's slots in use (beyond a lowered limit too) stay within them.
    fn try_take(&mut self, root: &Root, class: &str) -> std::io::Result<Took> {
        // Kinds filled by holders beyond a lowered limit are not tried (others would see the try).
        let spilled = self.spilled()?;
        let normal_full = (!self.beyond.paths().is_empty() || spilled > 0)
            && self.beyond.held_count(|_| true)? + spilled >= self.limits.limit as usize;
        let high_full = !self.beyond_high.paths().is_empty()
            && self.beyond_high.held_count(|_| true)? >= self.limits.reserve as usize;
        let high = self.high;
        let Some((i, guard)) = self
            .candidates
            .try_any_where(|j| if j < high { !high_full } else { !normal_full })?
        else {
            // A file replaced or planted since the class was read: the class is read again (its
            // record file planted refuses it), where a sleep would wait for a close that never comes.
            return Ok(match self.candidates.replaced() {
                true => Took::Changed,
                false => Took::Busy,
            });
        };
        let is_high = i < high;
        // A reserved slot taken while normal holders run beyond a lowered limit: what they take
        // past the limit is of the total, which stays within limit + reserve.
        let over = match is_high && !self.beyond.paths().is_empty() {
            true => (self.beyond.held_count(|_| true)?
                + self.candidates.held_count(|j| j >= high)?)
            .saturating_sub(self.limits.limit as usize),
            false => 0,
        };
        let (beyond, bound) = if is_high {
            (&mut self.beyond_high, self.limits.reserve as usize)
        } else {
            (&mut self.beyond, self.limits.limit as usize)
        };
        // Counted before the record is read: its read's close wakes this waiter, which would spin.
        let spilled = if is_high { 0 } else { spilled };
        let in_use = match beyond.paths().is_empty() && spilled == 0 && over == 0 {
            true => 0,
            false => {
                beyond.held_count(|_| true)?
                    + spilled
                    + over
                    + 1
                    + self
                        .candidates
                        .held_count(|j| j != i && (j < high) == is_high)?
            }
        };
        if in_use > bound {
            self.candidates.put_back(i, guard);
            return Ok(Took::Busy);
        }
        // An emptied record (slot_limits.rs) keeps the limits this waiter read.
        let now = crate::slots::read_class(root, class);
        if !matches!(now, Ok(Class::Limits(l)) if l == self.limits)
            && !matches!(now, Ok(Class::Emptied))
        {
            self.candidates.put_back(i, guard);
            return Ok(Took::Changed);
        }
        Ok(Took::Slot(guard))
    }
}
