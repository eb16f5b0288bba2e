//! Who holds and awaits a lock, and how to say it (docs/design.md, "Leases and holders").
//!
//! - The kernel is the truth about locks; leases (`lease.rs`) name the holders. A [`Look`] reads
//!   the leases once, then the lock table (local filesystems), and judges every lock by both.
//! - A holder is listed once, wherever it runs: a lease's owner is found in the table by the lease
//!   file's own entry; a lease line the table shows no entry for names nobody. Across pid
//!   namespaces and hosts the lease alone names it.
//! - A pid is never enough: it is a lease owner's only while its process started when the owner
//!   did, and a dead owner's only while no other process holds the lock through its own descriptor.
//! - A lock held by a process stowage did not start shows as held: by pid and command where the
//!   table has them, else as unidentified.

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::clock::{self, Millis};
use crate::ctx::Ctx;
use crate::ident;
use crate::ident::STOWAGE;
use crate::image_record::State;
use crate::kernel::{Entry, Table};
use crate::lease::{Holding, Identity};
use crate::lock::{Mode, Probe};

/// What kind of lock a report is about; its name is its variant's, lowercase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LockKind {
    Global,
    Image,
    Slot,
}

/// A holder or waiter; as JSON, every field but `reading`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Party {
    pub pid: Option<u32>,
    pub host: Option<String>,
    pub user: Option<String>,
    pub mode: Mode,
    pub command: Option<String>,
    #[serde(serialize_with = "time_json")]
    pub since: Option<Millis>,
    /// Whether stowage started the process; None where nothing tells (another host, pid namespace).
    pub stowage: Option<bool>,
    /// The file name of the lease that names the party; None for outsiders.
    pub lease: Option<String>,
    /// An exclusive lock taken only to read (`--read-exclusive`).
    #[serde(skip)]
    pub reading: bool,
    /// A process that kept a lock the exec that took it no longer holds (its command's child):
    /// as JSON `"kept": true`, only then.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub kept: bool,
    /// Where `pid` names the process: JSON says it, since a container shares the host name.
    #[serde(serialize_with = "pid_space_json")]
    pub pid_space: PidSpace,
}

/// A time as JSON says it: RFC 3339, null if none.
fn time_json<S: serde::Serializer>(t: &Option<Millis>, s: S) -> Result<S::Ok, S::Error> {
    t.and_then(clock::rfc3339).serialize(s)
}

/// Where a party's pid names the process it stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PidSpace {
    /// This pid namespace (a table pid, or a lease's of it), whatever host name: signals reach it.
    Here,
    /// Another pid namespace of this host (a container's, or the host's from one): signals miss it.
    OtherNamespace,
    /// The holder's own host's.
    ItsHost,
    /// No pid is known.
    #[default]
    Unknown,
}

fn pid_space_json<S: serde::Serializer>(p: &PidSpace, s: S) -> Result<S::Ok, S::Error> {
    let word = match p {
        PidSpace::Here => Some("here"),
        PidSpace::OtherNamespace => Some("another-namespace"),
        PidSpace::ItsHost => Some("its-host"),
        PidSpace::Unknown => None,
    };
    word.serialize(s)
}

impl Party {
    /// The party a lease names for one of the locks it lists.
    fn leased(name: &str, id: &Identity, h: &Holding) -> Party {
        Party {
            pid: id.pid,
            host: Some(id.host.clone()),
            user: Some(id.user.clone()),
            command: Some(h.command.clone()),
            since: Some(h.since),
            stowage: Some(true),
            lease: Some(name.to_owned()),
            reading: h.reading,
            pid_space: PidSpace::ItsHost,
            ..Party::unknown(h.mode)
        }
    }

    /// A process the lock table shows, that no lease names.
    fn outsider(ctx: &Ctx, e: &Entry) -> Party {
        Party {
            stowage: Some(false),
            pid: e.pid,
            host: Some(ctx.me.host.clone()),
            user: e.pid.and_then(ident::process_user),
            command: e.pid.and_then(ident::command_line),
            pid_space: e.pid.map_or(PidSpace::Unknown, |_| PidSpace::Here),
            ..Party::unknown(e.mode)
        }
    }

    /// A holder nothing names (another host's flock(1), or one a pid namespace hides).
    pub fn unknown(mode: Mode) -> Party {
        Party {
            mode,
            ..Party::default()
        }
    }
}

/// One lock's state, holders and waiters.
#[derive(Debug, Clone)]
pub struct LockReport {
    pub kind: LockKind,
    pub name: String,
    pub state: Probe,
    pub holders: Vec<Party>,
    pub waiters: Vec<Party>,
    /// Waiting commands that take the lock once they have what they wait for (a slot, an image).
    pub queued: Vec<Party>,
    /// For image locks: the image's state, from its record.
    pub image_state: Option<State>,
    /// For image locks: why the image's state is not known (its record cannot be read), if so.
    pub image_unknown: Option<String>,
    /// For slot classes: limit, reserve for high priority, slots in use.
    pub slot: Option<(u32, u32, u32)>,
}

/// Files by the lock table's key (device, inode), each with the pid that took its flock.
type FileKeys = Vec<crate::kernel::Taken>;

/// A lease's name and what it says.
type Leased = (String, Identity);

/// The leases' lines on one lock: lease name, owner, line.
type Listing<'a> = Vec<(&'a String, &'a Identity, &'a Holding)>;

/// One look at who holds what: the leases, read first, then the lock table (where locks are local).
pub struct Look<'c> {
    ctx: &'c Ctx,
    leases_dir: PathBuf,
    said: Vec<Leased>,
    alive: RefCell<HashMap<String, bool>>,
    table: Option<Table>,
    /// The kernel's device number of the store's filesystem.
    kdev: Option<u64>,
    /// Leases made since the listing, read once for a table entry none of `said` explains.
    later: OnceCell<Vec<Leased>>,
    /// The table read again (once), to confirm an unexplained holder stayed.
    fresh: OnceCell<Option<Table>>,
    /// Per pid, the files it flocks through its own descriptors (read once; None: unreadable).
    fd_locks: RefCell<HashMap<u32, Option<FileKeys>>>,
    /// Per live lease owner's table pid, the inodes of its lease and listed locks (once per look).
    owned: OnceCell<HashSet<(u32, u64)>>,
    /// How long this look has waited for holders to list their locks.
    waited: Cell<std::time::Duration>,
    /// When its waits for a listing end at the latest (a wait's deadline), if ever.
    end: Option<std::time::Instant>,
    /// While set ([`Look::deferring`]), a held lock no lease lists is read once, not waited for.
    deferring: Cell<bool>,
}

impl<'c> Look<'c> {
    /// Reads leases, then (locally) the lock table: a holder it shows made its lease first: listed.
    pub fn new(ctx: &'c Ctx) -> Look<'c> {
        let root = &ctx.root;
        let leases_dir = root.leases();
        let said = read_leases(&leases_dir, |_| true);
        let local = root.filesystem_now().filter(|f| f.local);
        let kdev = local.and_then(|_| crate::kernel::device_of(&root.locks()));
        let table = kdev.and_then(|_| crate::kernel::read_table().ok());
        Look {
            ctx,
            leases_dir,
            said,
            alive: RefCell::new(HashMap::new()),
            table,
            kdev,
            later: OnceCell::new(),
            fresh: OnceCell::new(),
            fd_locks: RefCell::new(HashMap::new()),
            owned: OnceCell::new(),
            waited: Cell::new(std::time::Duration::ZERO),
            end: None,
            deferring: Cell::new(false),
        }
    }

    /// A look whose waits for holders to list their locks end by `end` (`None`: as any look's): a
    /// holder not named by then is unknown. For what a wait says as it starts or gives up: a bounded
    /// wait never ends past its deadline, `--no-wait` (`end` now) not later at all.
    pub fn until(ctx: &'c Ctx, end: Option<std::time::Instant>) -> Look<'c> {
        Look {
            end,
            ..Look::new(ctx)
        }
    }

    /// Whether this look may still wait for holders to list their locks.
    fn may_pause(&self) -> bool {
        self.waited.get() < WAIT_BUDGET && self.end.is_none_or(|e| std::time::Instant::now() < e)
    }

    /// Where no table names holders (returned): a lock held that no lease lists yet shows one
    /// holder without a lease, not waited for, to look at again after [`Look::wait_for_listing`].
    pub fn deferring(&self, on: bool) -> bool {
        self.deferring.set(on && self.table.is_none());
        self.deferring.get()
    }

    /// The one wait for holders to list the locks seen while deferring.
    pub fn wait_for_listing(&self) {
        self.pause(LIST_GRACE);
    }

    /// Whether anyone holds the lock at `path`: queried without taking it where the filesystem
    /// answers for every host (no other host's look then sees us holding it), else by a try-lock.
    fn probe(&self, path: &Path) -> Probe {
        crate::lock::look(path, self.ctx.root.lock_queries()).unwrap_or(Probe::Free)
    }

    /// Sleeps about `d`, counted in the budget, never past the look's end; jittered, so two hosts'
    /// looks that each saw the other's probe do not probe again in step.
    fn pause(&self, d: std::time::Duration) {
        let d = d + d.mul_f64((ident::nonce() % 1024) as f64 / 2048.0);
        let left = |e: std::time::Instant| e.saturating_duration_since(std::time::Instant::now());
        let d = self.end.map_or(d, |e| d.min(left(e)));
        self.waited.set(self.waited.get() + d);
        std::thread::sleep(d);
    }

    /// Whether lease `name` has a live owner (one probe a look; if it fails, alive: nothing goes).
    fn alive(&self, name: &str) -> bool {
        let mut alive = self.alive.borrow_mut();
        *alive
            .entry(name.to_owned())
            .or_insert_with(|| crate::lease::alive(&self.leases_dir, name).unwrap_or(true))
    }

    pub fn leases(&self) -> &[Leased] {
        &self.said
    }

    /// Every lock file (relative to `locks/`) a live lease lists, as often as listed.
    pub fn leased_lockfiles(&self) -> impl Iterator<Item = &str> {
        // Without a table, a dead lease (kept while a lock it lists is held) is all that tells of a
        // lock held by a command whose stowage died: listed, its holder unknown.
        self.said
            .iter()
            .filter(|(n, id)| !id.holdings.is_empty() && (self.table.is_none() || self.alive(n)))
            .flat_map(|(_, id)| id.holdings.iter().chain(&id.queued))
            .map(|h| h.lockfile.as_str())
    }

    /// Inodes on the store's filesystem the table shows flocked (held or awaited) that no live
    /// lease's owner explains: locks taken outside stowage (flock(1)). None without a table.
    pub fn unexplained(&self) -> Option<Vec<u64>> {
        let (table, kdev) = (self.table.as_ref()?, self.kdev?);
        let leases: Vec<u64> = self
            .said
            .iter()
            .filter_map(|(_, id)| id.file.map(|f| f.1))
            .collect();
        Some(
            table
                .iter()
                .filter(|((d, ino), es)| {
                    *d == kdev
                        && !leases.contains(ino)
                        && es.iter().any(|e| !self.explained(e, *ino))
                })
                .map(|((_, ino), _)| *ino)
                .collect(),
        )
    }

    fn taker(&self, id: &Identity) -> Option<u32> {
        taker_in(self.table.as_ref()?, self.kdev?, id)
    }

    /// The live lease whose owner the table shows as `e`'s pid (still the process at that pid):
    /// among those listed, else those made since, else in a fresh table still showing `e`.
    fn lease_of_pid(&self, path: &Path, e: &Entry) -> Option<Leased> {
        let (pid, table, kdev) = (e.pid?, self.table.as_ref()?, self.kdev?);
        let owner = |table: &Table, leases: &[Leased]| {
            let owns = |(n, id): &&Leased| {
                taker_in(table, kdev, id) == Some(pid)
                    && id.owner_is(pid) != Some(false)
                    && self.alive(n)
            };
            leases.iter().find(owns).cloned()
        };
        let either =
            |table: &Table| owner(table, &self.said).or_else(|| owner(table, self.later()));
        if let found @ Some(_) = either(table) {
            return found;
        }
        // The table is read per CPU list: a holder may show on its image's lock, not its lease's; a
        // fresh read still showing the entry names its lease's taker (else the pid may be reused).
        if !self.still_there(path, e) {
            return None;
        }
        either(self.fresh.get()?.as_ref()?)
    }

    /// Whether the table shows lease `id`'s owner but none of its entries in `entries` in the mode
    /// the held line `h` lists: the line outlived its lock (a removal gone on, a process ending).
    fn outlived(&self, id: &Identity, h: &Holding, entries: Option<&[Entry]>) -> bool {
        let (Some(es), Some(taker)) = (entries, self.taker(id)) else {
            return false;
        };
        !h.awaits
            && !es
                .iter()
                .any(|e| !e.blocked && e.mode == h.mode && e.pid == Some(taker))
    }

    /// The live leases waiting for the lock (or slot class) `rel`, as they listed it.
    pub fn awaiting(&self, rel: &str) -> Vec<Party> {
        self.parties(&self.said, |_, h| h.awaits && h.lockfile == rel)
    }

    /// The live waiters that list lock `rel` as one to take once their wait ends.
    fn queued(&self, rel: &str) -> Vec<Party> {
        let live = self.said.iter().filter(|(n, _)| self.alive(n));
        let lines = live.flat_map(|(n, id)| {
            let mine = id.queued.iter().filter(|h| h.lockfile == rel);
            mine.map(move |h| self.party(n, id, h))
        });
        lines.collect()
    }

    /// The parties of every line of the live leases in `leases` that `pick` accepts.
    fn parties(&self, leases: &[Leased], pick: impl Fn(&Identity, &Holding) -> bool) -> Vec<Party> {
        let lines = leases
            .iter()
            .filter(|(n, _)| self.alive(n))
            .flat_map(|(n, id)| {
                let picked = id.holdings.iter().filter(|h| pick(id, h));
                picked.map(move |h| self.party(n, id, h))
            });
        lines.collect()
    }

    /// Whether a fresh read of the table (once per look) still shows `e` on the file at `path`.
    fn still_there(&self, path: &Path, e: &Entry) -> bool {
        let Some(key) = self.key_of(path) else {
            return true;
        };
        let table = self.fresh.get_or_init(|| crate::kernel::read_table().ok());
        table
            .as_ref()
            .is_none_or(|t| t.get(&key).is_some_and(|es| es.contains(e)))
    }

    fn key_of(&self, path: &Path) -> Option<(u64, u64)> {
        Some((self.kdev?, std::fs::symlink_metadata(path).ok()?.ino()))
    }

    /// Unlinks gone owners' leases, but keeps a dead one that may still name a holder (a command
    /// that closed its inherited lease, its stowage gone): while a lock it lists is held by its
    /// owner's pid, or (no table) held at all. Each read a lease that goes lists is recorded as a
    /// use first ([`Look::record_reads_ended`]). Returns how many went.
    pub fn clean_leases(&self) -> usize {
        let locks = self.ctx.root.locks();
        let listed_live: HashSet<(&str, Mode)> = self
            .said
            .iter()
            .filter(|(n, id)| !id.holdings.is_empty() && self.alive(n))
            .flat_map(|(_, id)| id.holdings.iter())
            .filter(|h| !h.awaits)
            .map(|h| (h.lockfile.as_str(), h.mode))
            .collect();
        let mut keep = |name: &str| {
            // Made since the listing: judged by the next look.
            let Some((_, id)) = self.said.iter().find(|(n, _)| n == name) else {
                return true;
            };
            let pid = id.pid.filter(|_| id.pid_is_ours());
            id.holdings.iter().filter(|h| !h.awaits).any(|h| {
                let path = locks.join(&h.lockfile);
                let table = self
                    .entries(&path)
                    .filter(|_| crate::kernel::shows_every_holder());
                match (pid, table) {
                    // Held under its owner's pid (a shared lock's entries of one pid are one).
                    (Some(pid), Some(es)) => es
                        .iter()
                        .any(|e| !e.blocked && e.mode == h.mode && e.pid == Some(pid)),
                    // Its pid means nothing here: a holder no live lease explains.
                    (None, Some(es)) => {
                        let ino = std::fs::symlink_metadata(&path).map_or(0, |m| m.ino());
                        es.iter()
                            .any(|e| !e.blocked && e.mode == h.mode && !self.explained(e, ino))
                    }
                    // No table can tell: held, and listed by no live lease.
                    (_, None) => {
                        !listed_live.contains(&(h.lockfile.as_str(), h.mode))
                            && self.probe(&path) == held_as(h.mode)
                    }
                }
            })
        };
        let mut ending = |name: &str| {
            if let Some((_, id)) = self.said.iter().find(|(n, _)| n == name) {
                self.record_reads_ended(id);
            }
        };
        crate::lease::clean_keeping(&self.leases_dir, &mut keep, &mut ending)
    }

    /// Records a use, now, of each image lease `id` lists as read. Its owner died, and its reads
    /// may have gone on in the command that inherited the locks, whose end nobody recorded: this
    /// look's now is an upper bound, the side gc must err on. Under a shared lock only tried (an
    /// image held exclusively is being written or removed, which says its own), never the global.
    fn record_reads_ended(&self, id: &Identity) {
        let locks = self.ctx.root.locks();
        let now = clock::now_ms();
        let reads = id.holdings.iter().filter(|h| {
            !h.awaits && (h.mode == Mode::Shared || h.reading) && h.lockfile.starts_with("images/")
        });
        for h in reads {
            let path = locks.join(&h.lockfile);
            let read = |f: &std::fs::File| (crate::image_record::read(f).ok(), false);
            let missing = crate::lock::IfMissing::Fail;
            let Ok(Some((guard, Some(mut seen)))) =
                crate::lock::acquire_no_wait_with(&path, Mode::Shared, missing, read)
            else {
                continue;
            };
            // Only into the image's own file: the record there names the image the line names.
            let named = seen
                .record
                .as_ref()
                .and_then(|r| crate::name::ImageName::parse(&r.name).ok());
            let ours = named.is_some_and(|n| crate::root::Root::image_lock_rel(&n) == h.lockfile);
            if ours && let Some(written) = guard.one_name_written() {
                let _ = crate::image_record::record_use(guard.file(), &mut seen, now, written);
            }
        }
    }

    /// Whether the table entry `e` on the file `ino` is a live lease owner's: its pid took a live
    /// lease that lists the lock, and is still its owner.
    fn explained(&self, e: &Entry, ino: u64) -> bool {
        let Some(pid) = e.pid else { return false };
        let owned = self.owned.get_or_init(|| {
            let locks = self.ctx.root.locks();
            let mut set = HashSet::new();
            for (n, id) in &self.said {
                let Some(t) = self.taker(id) else { continue };
                if id.owner_is(t) == Some(false) || !self.alive(n) {
                    continue;
                }
                set.extend(id.file.map(|f| (t, f.1)));
                for h in &id.holdings {
                    if let Ok(m) = std::fs::symlink_metadata(locks.join(&h.lockfile)) {
                        set.insert((t, m.ino()));
                    }
                }
            }
            set
        });
        owned.contains(&(pid, ino))
    }

    /// Whether the process at `pid` holds the file `key` (device, inode) locked through its own
    /// descriptor (not one inherited from a dead taker of that pid): `Some(false)` also if no
    /// process has the pid, `None` if that cannot be told (another user's process, no table). Each
    /// pid's fds are read once per look.
    fn pid_holds(&self, pid: u32, key: (u64, u64)) -> Option<bool> {
        self.fd_flocks(pid, |held| held.iter().any(|(k, _)| *k == key))
    }

    /// Whether local process `pid` holds the file `key` through the very lock `taker` took, not one
    /// of its own: it inherited the descriptor (a nested exec, its enclosing exec gone).
    fn inherits_from(&self, pid: u32, key: (u64, u64), taker: u32) -> bool {
        pid != taker && self.fd_flocks(pid, |held| held.contains(&(key, Some(taker)))) == Some(true)
    }

    /// `f` of what local process `pid` flocks through its own fds, read once per look.
    fn fd_flocks<T>(&self, pid: u32, f: impl FnOnce(&FileKeys) -> T) -> Option<T> {
        let mut cache = self.fd_locks.borrow_mut();
        let held = cache
            .entry(pid)
            .or_insert_with(|| crate::kernel::locks_through_own_fds(pid));
        held.as_ref().map(f)
    }

    fn entries(&self, path: &Path) -> Option<Vec<Entry>> {
        let (table, key) = (self.table.as_ref()?, self.key_of(path)?);
        Some(table.get(&key).cloned().unwrap_or_default())
    }

    pub fn report(&self, kind: LockKind, name: &str, path: &Path) -> LockReport {
        let (rel, entries) = (self.ctx.root.locks_rel(path), self.entries(path));
        let listing: Listing = self
            .said
            .iter()
            .flat_map(|(n, id)| {
                id.holdings
                    .iter()
                    .filter(|h| h.lockfile == rel)
                    .map(move |h| (n, id, h))
            })
            .collect();
        let mut state = self.state(path, entries.as_deref(), &listing);
        let mut claimed = vec![false; entries.as_ref().map_or(0, Vec::len)];
        let (mut holders, mut waiters) =
            self.leased(path, &listing, entries.as_deref(), state, &mut claimed);
        let mut vanished = false;
        for (e, _) in entries.iter().flatten().zip(claimed).filter(|(_, c)| !c) {
            let parties = self.unclaimed(&listing, path, &rel, e);
            vanished |= parties.is_empty() && !e.blocked;
            match e.blocked {
                true => waiters.extend(parties),
                false => holders.extend(parties),
            }
        }
        // A holder the table showed is gone since: the lock may be free.
        if holders.is_empty() && vanished {
            state = self.probe(path);
        }
        if holders.is_empty() && state != Probe::Free && state != Probe::Missing {
            (state, holders) = self.held_by_whom(path, &rel, state, entries.as_deref());
        }
        listed_once(&holders, &mut waiters);
        // A queued lock its waiter has since taken or awaits is listed once, as that.
        let mut queued = self.queued(&rel);
        let lease_of = |p: &Party| holders.iter().chain(&waiters).any(|o| o.lease == p.lease);
        queued.retain(|p| !lease_of(p));
        LockReport {
            kind,
            name: name.to_owned(),
            state: settle(state),
            holders,
            waiters,
            queued,
            image_state: None,
            image_unknown: None,
            slot: None,
        }
    }

    /// The lock's state: the table's, probed where it may hide a holder (another pid namespace).
    fn state(&self, path: &Path, entries: Option<&[Entry]>, listing: &Listing) -> Probe {
        let live_hold = listing.iter().any(|(n, _, h)| !h.awaits && self.alive(n));
        match entries.map(state_of) {
            Some(s) if s != Probe::Free || (!live_hold && crate::kernel::shows_every_holder()) => s,
            _ => self.probe(path),
        }
    }

    /// The holders and waiters live leases name, each claiming its own table entry (listed once).
    fn leased(
        &self,
        path: &Path,
        listing: &Listing,
        entries: Option<&[Entry]>,
        state: Probe,
        claimed: &mut [bool],
    ) -> (Vec<Party>, Vec<Party>) {
        let (mut holders, mut waiters) = (Vec::new(), Vec::new());
        for (n, id, h) in listing {
            if !self.alive(n) {
                continue;
            }
            let taker = self.taker(id);
            let fits = |e: &Entry| e.mode == h.mode && e.blocked == h.awaits && e.pid == taker;
            if let (Some(es), Some(_)) = (entries, taker)
                && let Some(i) = (0..es.len()).find(|&i| !claimed[i] && fits(&es[i]))
            {
                claimed[i] = true;
            }
            if self.outlived(id, h, entries) {
                continue;
            }
            let party = self.party(n, id, h);
            // Its owner gone, a command that inherited the lease with the lock keeps both alive.
            if let Some(e) = (entries.zip(taker))
                .filter(|_| party.pid.is_none() && !h.awaits && state == held_as(h.mode))
                .and_then(|(es, t)| es.iter().find(|e| !e.blocked && e.pid == Some(t)))
            {
                let kept = self.kept_from(path, n, h, e);
                if !kept.is_empty() {
                    holders.extend(kept);
                    continue;
                }
            }
            match h.awaits {
                // On a free lock too: a writer stopped there (^Z, SIGSTOP) keeps the gate.
                true => waiters.push(party),
                false if state == held_as(h.mode) => holders.push(party),
                _ => {}
            }
        }
        (holders, waiters)
    }

    /// The party a live lease names for one of its locks, with the pid that reaches it here: its
    /// lease's taker in the table, else the lease's pid; none if reused since.
    fn party(&self, n: &str, id: &Identity, h: &Holding) -> Party {
        let taker = self.taker(id);
        let mut party = Party::leased(n, id, h);
        party.pid = match taker {
            Some(t) => Some(t).filter(|&t| id.owner_is(t) != Some(false)),
            None if id.pid_is_ours() => id.pid.filter(|&p| id.owner_is(p) != Some(false)),
            None => id.pid,
        };
        party.pid_space = if party.pid.is_none() {
            PidSpace::Unknown
        } else if taker.is_some() || id.pid_is_ours() {
            PidSpace::Here
        } else if id.this_boot() {
            PidSpace::OtherNamespace
        } else {
            PidSpace::ItsHost
        };
        party
    }

    /// The parties of a table entry no live lease claimed (several: the children that kept a lock
    /// their ended exec took); none if gone since the table was read.
    fn unclaimed(&self, listing: &Listing, path: &Path, rel: &str, e: &Entry) -> Vec<Party> {
        // Whether the entry's pid holds the lock itself (a waiter, blocked on it, is that process).
        let holds = match e.pid {
            Some(pid) if !e.blocked => self.key_of(path).and_then(|k| self.pid_holds(pid, k)),
            Some(_) => Some(true),
            None => None,
        };
        // Its stowage gone, a command closed the lease it inherited: the dead lease says what for.
        let gone = e.pid.filter(|_| holds == Some(false));
        let dead = gone.and_then(|pid| {
            listing.iter().find(|(n, id, h)| {
                !h.awaits
                    && h.mode == e.mode
                    && id.pid == Some(pid)
                    && id.pid_is_ours()
                    && !self.alive(n)
            })
        });
        if let Some((n, id, h)) = dead {
            let kept = self.kept_from(path, n, h, e);
            if !kept.is_empty() {
                return kept;
            }
            return vec![Party {
                pid: None,
                ..Party::leased(n, id, h)
            }];
        }
        // A stowage process holding the lock before its lease lists it: its lease's taker, unless
        // its pid is known not to hold it (reused since); if unknown, only one listing it.
        let fits = |id: &Identity| match holds {
            Some(h) => h,
            None => id.holdings.iter().any(|h| h.lockfile == rel),
        };
        match self.lease_of_pid(path, e) {
            Some((n, id)) if fits(&id) => {
                // Granted, it may list the lock (a slot: its class) as awaited still: for what.
                let line = id.holdings.iter().find(|h| {
                    h.lockfile == rel
                        || rel
                            .strip_prefix(&h.lockfile)
                            .is_some_and(|r| r.starts_with('/'))
                });
                let command = line.map_or(&id.command, |l| &l.command);
                let mut h = Holding::now(e.mode, rel.to_owned(), e.blocked, command);
                h.reading = line.is_some_and(|l| l.reading);
                vec![Party {
                    since: id.since,
                    pid: e.pid,
                    pid_space: PidSpace::Here,
                    ..Party::leased(&n, &id, &h)
                }]
            }
            None if !self.still_there(path, e) => Vec::new(),
            None if e.blocked || gone.is_none() => vec![Party::outsider(self.ctx, e)],
            // At that pid a live stowage process neither holds nor lists the lock: pid reused. Or
            // its pid is no longer the holder's (dead, its lock kept by an inheritor; or reused):
            // the processes whose fds hold it, where they can be found.
            _ => {
                let kept = self.kept_by(path, e);
                if !kept.is_empty() {
                    return kept;
                }
                vec![Party {
                    host: Some(self.ctx.me.host.clone()),
                    ..Party::unknown(e.mode)
                }]
            }
        }
    }

    /// The processes whose own descriptors hold the lock at `path` that the exec of lease `n` took
    /// (its line `h`; the table's entry `e`), its owner gone: its command, or what that left, where
    /// /proc tells; for what and since when the lease says.
    fn kept_from(&self, path: &Path, n: &str, h: &Holding, e: &Entry) -> Vec<Party> {
        let kept = self.kept_by(path, e).into_iter().map(|p| Party {
            kept: true,
            stowage: Some(true),
            // A nested exec that kept it is named by its own lease (what it waits for says so).
            lease: p.lease.clone().or_else(|| Some(n.to_owned())),
            since: Some(h.since),
            reading: h.reading,
            ..p
        });
        kept.collect()
    }

    /// The local processes whose own fds hold the lock at `path`, where the table's entry
    /// `e` names one that no longer does: children of an exec that ended, which kept its lock.
    fn kept_by(&self, path: &Path, e: &Entry) -> Vec<Party> {
        let Some(key) = self.key_of(path).filter(|_| ident::proc_is_ours()) else {
            return Vec::new();
        };
        // Every process's fds are read once per look, however many are kept.
        let holds = |p: &u32| self.pid_holds(*p, key) == Some(true);
        let pids = crate::ident::numbered::<u32>("/proc").into_iter().flatten();
        let pids = pids.map(|(p, _)| p).filter(holds);
        let pids: Vec<(u32, bool)> = pids.filter_map(|p| Some((p, is_stowage(p)?))).collect();
        // A stowage process holding the very lock `e`'s pid took inherited it (a nested exec whose
        // enclosing exec ended): its lease never lists it, so it is named here, as a command is.
        let nested = |p: u32| e.pid.is_some_and(|t| self.inherits_from(p, key, t));
        let (stowage, others): (Vec<u32>, Vec<u32>) = (
            pids.iter()
                .filter(|(p, s)| *s && !nested(*p))
                .map(|(p, _)| *p)
                .collect(),
            pids.iter()
                .filter(|(p, s)| !*s || nested(*p))
                .map(|(p, _)| *p)
                .collect(),
        );
        // A stowage process with no live lease may be one about to make it: none named. One with a
        // lease is named by it (its listing of this lock may come a moment later).
        if !stowage.iter().all(|&p| self.has_lease(p)) {
            return Vec::new();
        }
        // One below a stowage holder shares its descriptor: that exec's command, or its child.
        // Alive after its ancestors were read, it had them (a command's short-lived child may
        // have exited meanwhile, its ancestors unread: a holder no more).
        // So one below another that kept it: the command named, not each of its children.
        let kept = (others.iter().copied())
            .filter(|&p| !ancestors(p).any(|a| stowage.contains(&a) || others.contains(&a)))
            .filter(|&p| !exiting(p));
        // Read while it exits (its memory gone before its descriptors: a host's crash), a process
        // shows no environment, so no lease: a holder no more, not one outside stowage.
        let party = |pid| {
            let nested = pids.contains(&(pid, true));
            let kept = nested || started_by_an_ended_exec(&self.leases_dir, pid);
            let party = Party {
                kept,
                stowage: Some(nested),
                lease: nested.then(|| self.lease_owned_by(pid)).flatten(),
                ..Party::outsider(
                    self.ctx,
                    &Entry {
                        pid: Some(pid),
                        ..*e
                    },
                )
            };
            (kept || !exiting(pid)).then_some(party)
        };
        kept.filter_map(party).collect()
    }

    /// Leases made since the look read them, read once when first asked.
    fn later(&self) -> &[Leased] {
        self.later.get_or_init(|| {
            read_leases(&self.leases_dir, |n| !self.said.iter().any(|(s, _)| s == n))
        })
    }

    /// Whether local process `pid` owns a live lease (read with the look, or made since).
    fn has_lease(&self, pid: u32) -> bool {
        self.lease_owned_by(pid).is_some()
    }

    /// The live lease local process `pid` owns (read with the look, or made since), if any.
    fn lease_owned_by(&self, pid: u32) -> Option<String> {
        let owns = |(n, id): &&Leased| {
            (self.taker(id) == Some(pid) || id.pid == Some(pid) && id.pid_is_ours())
                && self.alive(n)
        };
        let found = self.said.iter().chain(self.later()).find(owns);
        found.map(|(n, _)| n.clone())
    }

    /// Held, and no lease read before said so: the leases are read again, a few times a moment
    /// apart without a table (a holder lists its lock just after taking it, or
    /// `lease::announce_after` into its exec), probing the lock each time (another host's look
    /// probing it is gone a moment later). Else an unknown holder.
    fn held_by_whom(
        &self,
        path: &Path,
        rel: &str,
        mut state: Probe,
        entries: Option<&[Entry]>,
    ) -> (Probe, Vec<Party>) {
        let mut holders = Vec::new();
        // Sleeps stop at WAIT_BUDGET in all, or many locks held outside stowage on a shared
        // filesystem would each cost them; past it, one read each.
        let tries = if self.deferring.get() { 1 } else { 5 };
        for attempt in 0..tries {
            if attempt > 0 {
                if !self.may_pause() {
                    break;
                }
                self.pause(std::time::Duration::from_millis(10 << (attempt - 1)));
                state = settle(self.probe(path));
                if state == Probe::Free {
                    return (state, holders);
                }
            }
            // The live leases listing the lock as held so now (read afresh).
            let (all, mode) = (read_leases(&self.leases_dir, |_| true), held_mode(state));
            holders = self.parties(&all, |id, h| {
                !h.awaits && h.lockfile == rel && h.mode == mode && !self.outlived(id, h, entries)
            });
            if !holders.is_empty() || self.table.is_some() {
                break;
            }
        }
        if holders.is_empty() {
            holders.push(Party::unknown(held_mode(state)));
        }
        (state, holders)
    }

    /// The global lock's report, from the table alone: no lease lists it (held for a transaction).
    pub fn global_report(&self) -> LockReport {
        let path = self.ctx.root.global_lock();
        let entries = self.entries(&path);
        let mut state = entries.as_deref().map_or(Probe::Free, state_of);
        if state == Probe::Free {
            state = settle(self.probe(&path));
        }
        // Without a table, held is all a probe tells: held a moment later too, or it was
        // another host's look probing it (a transaction takes milliseconds, a probe less).
        for pause in [10, 20, 40].map(std::time::Duration::from_millis) {
            if entries.is_some() || state == Probe::Free || !self.may_pause() {
                break;
            }
            self.pause(pause);
            state = settle(self.probe(&path));
        }
        let party = |e: &Entry| Party {
            stowage: Some(e.pid.is_some_and(ident::runs_stowage)),
            ..Party::outsider(self.ctx, e)
        };
        let es = entries.unwrap_or_default();
        let mut holders: Vec<Party> = es.iter().filter(|e| !e.blocked).map(party).collect();
        if holders.is_empty() && state != Probe::Free {
            holders.push(Party::unknown(held_mode(state)));
        }
        LockReport {
            kind: LockKind::Global,
            name: "global".into(),
            state: settle(state),
            holders,
            waiters: es.iter().filter(|e| e.blocked).map(party).collect(),
            queued: Vec::new(),
            image_state: None,
            image_unknown: None,
            slot: None,
        }
    }
}

/// Takes out of `waiters` every party a lease names that holds the lock too: one that was granted
/// the lock still lists it as awaited until it rewrites its lease, and the table (or its taker
/// found there later) shows it holding. A stowage process never holds and awaits one lock at once.
pub fn listed_once(holders: &[Party], waiters: &mut Vec<Party>) {
    let holds = |w: &Party| w.lease.is_some() && holders.iter().any(|h| h.lease == w.lease);
    waiters.retain(|w| !holds(w));
}

/// What each lease in `dir` that `wanted` names says (those that can be read).
fn read_leases(dir: &Path, wanted: impl Fn(&str) -> bool) -> Vec<Leased> {
    let names = crate::lease::listing(dir).into_iter().filter(|n| wanted(n));
    let read = |n: String| crate::lease::identity(dir, &n).map(|id| (n, id));
    names.filter_map(read).collect()
}

/// The most a look sleeps in all for other hosts' holders to list locks seen held (150 ms a lock:
/// 10, 20, 40, 80; a lease announced late comes 30 ms into its command).
const WAIT_BUDGET: std::time::Duration = std::time::Duration::from_millis(600);

/// How long a deferring look waits for holders to list locks: what one lock's rereads add up to.
const LIST_GRACE: std::time::Duration = std::time::Duration::from_millis(150);

fn settle(p: Probe) -> Probe {
    match p {
        Probe::Missing => Probe::Free,
        p => p,
    }
}

fn state_of(entries: &[Entry]) -> Probe {
    let held = entries.iter().filter(|e| !e.blocked).map(|e| e.mode).max();
    held.map_or(Probe::Free, held_as)
}

fn held_mode(state: Probe) -> Mode {
    match state {
        Probe::Exclusive => Mode::Exclusive,
        _ => Mode::Shared,
    }
}

fn held_as(mode: Mode) -> Probe {
    match mode {
        Mode::Exclusive => Probe::Exclusive,
        Mode::Shared => Probe::Shared,
    }
}

/// "held (read) by pid 4121 on node07 (ch-image build -t app .) since 12:03:04"; an exclusive lock
/// taken only to read (`--read-exclusive`) is no write.
fn phrase(holders: &[Party]) -> String {
    let lead = holders
        .first()
        .map_or(String::new(), |p| match (p.mode, p.reading) {
            (Mode::Exclusive, true) => "held (exclusive read) by ".into(),
            (mode, _) => format!("held ({}) by ", mode.verb()),
        });
    phrase_as(&lead, holders)
}

/// `lead` and the first holder ("all in use by pid 4121 on node07 (ch-image pull alpine) since
/// 12:03:04"), and how many more: a message is one line, and `lock-status` lists them all.
pub fn phrase_as(lead: &str, holders: &[Party]) -> String {
    let Some(first) = holders.first() else {
        return "no holder is known (it may have just been released)".into();
    };
    let mut s = format!("{lead}{}", describe(first));
    let more = holders.len() - 1;
    if more > 0 {
        s.push_str(&format!("; and {more} more (see '{STOWAGE} lock-status')"));
    }
    s
}

/// Whether process `pid` was started by a stowage exec that has ended (its environment names the
/// exec's lease, and no lease it names is alive): a lock it holds that no lease lists was kept
/// from that exec. Else it took the lock outside stowage (a script's `flock 9`, or its own flock
/// inside a running exec).
fn started_by_an_ended_exec(leases: &Path, pid: u32) -> bool {
    let var = format!("{}=", crate::env::EXEC_LEASES);
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let named = env
        .split(|b| *b == 0)
        .find_map(|v| v.strip_prefix(var.as_bytes()));
    let names = String::from_utf8_lossy(named.unwrap_or_default()).into_owned();
    let names: Vec<&str> = names.split(':').filter(|n| !n.is_empty()).collect();
    !names.is_empty()
        && !names
            .iter()
            .any(|n| crate::lease::alive(leases, n).unwrap_or(true))
}

/// Whether local process `pid` is gone, a zombie, or exiting (`PF_EXITING` in its flags): its
/// memory, and so its environment and command line, may be gone while its descriptors still hold.
fn exiting(pid: u32) -> bool {
    const PF_EXITING: u64 = 0x4;
    let Some(fields) = ident::stat_fields(pid) else {
        return true;
    };
    // From the state on: state, ppid, pgrp, session, tty, tpgid, flags.
    let flags = fields
        .split_whitespace()
        .nth(6)
        .and_then(|f| f.parse::<u64>().ok());
    fields.trim_start().starts_with('Z') || flags.is_some_and(|f| f & PF_EXITING != 0)
}

/// The processes above local process `pid`: its parent, its parent's, … (to pid 1, at most 64).
fn ancestors(pid: u32) -> impl Iterator<Item = u32> {
    let parent = |&p: &u32| {
        let ppid: u32 = ident::stat_fields(p)?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        (ppid > 1).then_some(ppid)
    };
    std::iter::successors(Some(pid), parent).skip(1).take(64)
}

/// Whether local process `pid` runs this very program (unknown: taken as one, so never named an
/// outsider); `None` if it has exited since (a holder no more: a command's short-lived child).
fn is_stowage(pid: u32) -> Option<bool> {
    // An older binary replaced since (an upgrade) reads "PATH (deleted)".
    let exe = |p: &str| {
        let link = std::fs::read_link(format!("/proc/{p}/exe"))?.into_os_string();
        let link = link.to_string_lossy().into_owned();
        Ok::<_, std::io::Error>(link.trim_end_matches(" (deleted)").to_owned())
    };
    match (exe(&pid.to_string()), exe("self")) {
        (Ok(theirs), Ok(ours)) => Some(theirs == ours),
        // Gone, or a zombie (its descriptors closed): no exe.
        (Err(e), _) if e.kind() == std::io::ErrorKind::NotFound => None,
        _ => Some(true),
    }
}

fn describe(p: &Party) -> String {
    let mut s = pid_on(p, "a process", None, true) + &command_cut(p, 80);
    if let Some(t) = p.since {
        s.push_str(&format!(" since {}", clock::local_short(t)));
    }
    match stopped(p) {
        Some(Stopped::BySignal) => s.push_str(", stopped"),
        Some(Stopped::ByTracer) => s.push_str(", stopped by its tracer (a debugger)"),
        None => {}
    }
    if unverifiable(p) {
        s.push_str(", or the command it ran if that exec has ended (not seen from here)");
    }
    match p.stowage {
        _ if p.kept => s.push_str(", which kept it after the exec that took it ended"),
        Some(true) => {}
        Some(false) if p.pid.is_some() => s.push_str(", not started by stowage"),
        _ => s.push_str(" that stowage cannot identify (outside stowage, or on another host)"),
    }
    s
}

/// Whether `p` is an exec named by the pid its lease gives, in another pid namespace of this host:
/// neither the table nor /proc shows that pid here, so that exec may have ended while the command
/// it ran keeps its locks (and its lease, which then still probes alive).
pub fn unverifiable(p: &Party) -> bool {
    p.pid_space == PidSpace::OtherNamespace && p.stowage == Some(true) && !p.kept
}

/// "pid 4121 on node07": the pid, else `nobody`; the host unless `here`; with `ns`, whether the pid
/// is another namespace's.
pub fn pid_on(p: &Party, nobody: &str, here: Option<&str>, ns: bool) -> String {
    let mut s = p
        .pid
        .map_or_else(|| nobody.to_owned(), |pid| format!("pid {pid}"));
    if let Some(h) = p.host.as_deref() {
        // Another machine of our name (a cloned VM): its pid is not one of ours to signal.
        let namesake = p.pid_space == PidSpace::ItsHost && h == ident::Me::current().host;
        if namesake {
            s.push_str(&format!(" on another host named {}", ident::printable(h)));
        } else if Some(h) != here {
            s.push_str(&format!(" on {}", ident::printable(h)));
        }
    }
    if ns && p.pid_space == PidSpace::OtherNamespace {
        s.push_str(" (in another pid namespace)");
    }
    s
}

/// " (make all)": the party's command, cut to `width` characters; none at 0.
pub fn command_cut(p: &Party, width: usize) -> String {
    let command = p.command.as_deref().filter(|_| width > 0);
    command.map_or_else(String::new, |c| {
        format!(" ({})", ident::shortened(&ident::printable(c), width))
    })
}

/// Until when what a wait says looks for the holder's name ([`Look::until`]): the wait's
/// `deadline`, or now for a request that does not wait.
pub fn looked_for_until(
    deadline: Option<std::time::Instant>,
    no_wait: bool,
) -> Option<std::time::Instant> {
    match no_wait {
        true => Some(std::time::Instant::now()),
        false => deadline,
    }
}

/// Who holds the lock at `path`, ourselves left out (a wait line said after our take); with
/// `writer_ahead`, and which writers wait at its gate ahead of new readers. Looked for until `end`
/// at the latest ([`Look::until`]).
pub fn holders_phrase(
    ctx: &Ctx,
    kind: LockKind,
    path: &Path,
    writer_ahead: bool,
    end: Option<std::time::Instant>,
) -> String {
    let r = Look::until(ctx, end).report(kind, &ctx.root.locks_rel(path), path);
    let me = |p: &Party| p.pid == Some(std::process::id()) && p.pid_space == PidSpace::Here;
    let holders: Vec<Party> = r.holders.into_iter().filter(|p| !me(p)).collect();
    // Read and write are an image's: the store's and gc's locks are only held.
    let held = match kind {
        LockKind::Global => phrase_as("held by ", &holders),
        _ => phrase(&holders),
    };
    if !writer_ahead {
        return held;
    }
    let writers: Vec<Party> = (r.waiters.into_iter())
        .filter(|p| p.mode == Mode::Exclusive && !me(p))
        .collect();
    match writers.is_empty() {
        true => held + "; and a writer waits ahead of new readers",
        false => held + &phrase_as("; and a writer waits ahead of new readers: ", &writers),
    }
}

/// How a stopped process goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// By a signal (`^Z`, SIGSTOP): `kill -CONT` continues it.
    BySignal,
    /// By its tracer (a debugger): only the tracer lets it go on.
    ByTracer,
}

/// Whether local process `p` is stopped, and how.
pub fn stopped(p: &Party) -> Option<Stopped> {
    let pid = p
        .pid
        .filter(|_| p.pid_space == PidSpace::Here && ident::proc_is_ours())?;
    state_stopped(&ident::stat_fields(pid)?)
}

/// How a process whose `/proc/PID/stat` from its state on is `fields` is stopped, if it is.
fn state_stopped(fields: &str) -> Option<Stopped> {
    match fields.trim_start().as_bytes().first()? {
        b'T' => Some(Stopped::BySignal),
        b't' => Some(Stopped::ByTracer),
        _ => None,
    }
}

/// A stopped process under a local stowage exec `p`, nearest first: its pid, how it is stopped,
/// and whether it is the exec's command (its child, or its `--no-inherit` keeper's), which a
/// termination signal to `p` ends. A stopped process keeps the exec going (or, kept, its locks)
/// however long, and its pid is not the one shown. One pass over `/proc`: asked only for the end
/// of a wait chain.
pub fn stopped_below(p: &Party) -> Option<(u32, Stopped, bool)> {
    let here = p.pid_space == PidSpace::Here && p.stowage == Some(true);
    let pid = p.pid.filter(|_| here && ident::proc_is_ours())?;
    let procs: Vec<(u32, u32, String)> = ident::numbered::<u32>("/proc")
        .ok()?
        .filter_map(|(child, _)| {
            let fields = ident::stat_fields(child)?;
            let parent = fields.split_whitespace().nth(1)?.parse().ok()?;
            Some((child, parent, fields))
        })
        .collect();
    let children = |of: u32| procs.iter().filter(move |(_, parent, _)| *parent == of);
    let keepers: Vec<u32> = (children(pid).map(|(c, _, _)| *c))
        .filter(|&c| ident::runs_stowage(c))
        .collect();
    let is_command = |parent: u32| parent == pid || keepers.contains(&parent);
    // Breadth first, so the nearest is found first; bounded, as a tree may change meanwhile.
    let mut level = vec![pid];
    for _ in 0..64 {
        let below: Vec<&(u32, u32, String)> = level.iter().flat_map(|&q| children(q)).collect();
        if let Some((c, parent, how)) =
            (below.iter()).find_map(|(c, parent, f)| Some((*c, *parent, state_stopped(f)?)))
        {
            return Some((c, how, is_command(parent) && !keepers.contains(&c)));
        }
        level = below.iter().map(|(c, _, _)| *c).collect();
        if level.is_empty() {
            break;
        }
    }
    None
}

/// Who holds the global lock, for the rare message about waiting for it, looked for until `end`.
pub fn global_holder_phrase(ctx: &Ctx, end: Option<std::time::Instant>) -> String {
    let r = Look::until(ctx, end).global_report();
    if r.holders.iter().all(|p| p.pid.is_none()) {
        "held by a process stowage cannot identify (on another host, or stopped)".into()
    } else {
        phrase(&r.holders)
    }
}

/// The pid holding lease `id` exclusively in `table` (device `kdev`, as it numbers it): its owner.
fn taker_in(table: &Table, kdev: u64, id: &Identity) -> Option<u32> {
    let (_, ino) = id.file?;
    table
        .get(&(kdev, ino))?
        .iter()
        .find(|e| !e.blocked && e.mode == Mode::Exclusive)
        .and_then(|e| e.pid)
}
