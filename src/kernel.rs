//! What the kernel says about locks — the truth that records are judged by.
//!
//! On a local filesystem the kernel's lock table (`/proc/locks`) lists every
//! flock with the pid that took it, including blocked requests, and reading
//! it disturbs nobody. On NFS, Lustre and the like it lists only this
//! client's locks, so there a lock's state is found by probing it (briefly
//! trying it), which sees holders on every host but not who they are.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::lock::{self, Mode, Probe};

/// One entry of the kernel's lock table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// The process that took the lock. After it exits while a child keeps
    /// the inherited descriptor, the initial pid namespace still shows its
    /// pid, a child namespace shows none (None here).
    pub pid: Option<u32>,
    pub mode: Mode,
    /// A request waiting for the lock rather than holding it.
    pub blocked: bool,
}

/// A lock as the kernel sees it.
#[derive(Debug, Clone, Default)]
pub struct LockView {
    pub state: Option<Probe>,
    /// Holders with pids, where the lock table is available.
    pub holders: Vec<Entry>,
    /// Blocked requests, where the lock table is available.
    pub waiters: Vec<Entry>,
    /// Set when only the lock table says the lock is free. /proc/locks is
    /// read a page at a time, and entries that move while it is read can be
    /// missed, so "free" from the table must be confirmed (with
    /// [`LockView::confirmed`]) before anything is destroyed because of it.
    pub unconfirmed_free: Option<std::path::PathBuf>,
}

impl LockView {
    /// This view, with a table's "free" checked by probing the lock file.
    pub fn confirmed(&self) -> LockView {
        match &self.unconfirmed_free {
            Some(path) => match lock::probe(path) {
                Ok(p @ (Probe::Shared | Probe::Exclusive)) => LockView {
                    state: Some(p),
                    ..LockView::default()
                },
                _ => LockView {
                    unconfirmed_free: None,
                    ..self.clone()
                },
            },
            None => self.clone(),
        }
    }
}

impl LockView {
    pub fn is_held(&self) -> bool {
        matches!(self.state, Some(Probe::Shared | Probe::Exclusive))
    }
}

/// A snapshot of the kernel's view of one directory's locks.
pub struct KernelView {
    table: Option<HashMap<(u64, u64), Vec<Entry>>>,
    /// Locks already accounted for: the verifying lock and every file
    /// viewed, so that [`KernelView::unexplained_inodes`] lists only the rest.
    explained: std::cell::RefCell<std::collections::HashSet<(u64, u64)>>,
    /// The root's leases directory: set for views taken
    /// in a transaction, which judge records ([`KernelView::lease`]).
    leases_dir: Option<std::path::PathBuf>,
    /// Leases probed so far, by name: one probe per lease per look.
    leases: std::cell::RefCell<HashMap<String, LeaseSeen>>,
    /// Live leases by the pid that the table shows took them: made once per
    /// look, when a lock-table entry is claimed by no record.
    takers: std::cell::RefCell<Option<HashMap<u32, String>>>,
    /// What every lease file says (owner and holdings), read once per look.
    said: std::cell::RefCell<Option<Vec<(String, crate::lease::Identity)>>>,
    /// The leases directory, pinned by a descriptor that refused a symlink,
    /// and its lease file names: listed once per look, for reading them and
    /// for cleaning ([`KernelView::lease_listing`]).
    listing: std::cell::RefCell<Option<crate::lease::Listing>>,
    /// A later read of the table, made once per look when a holder no
    /// record or lease explains must be confirmed
    /// ([`KernelView::still_held_by`]).
    fresh: std::cell::RefCell<Option<Option<Table>>>,
}

/// A live lease that lists a lock: its name, what it says of its owner,
/// and how it holds or awaits the lock.
pub type Leased = (String, crate::lease::Identity, crate::lease::Holding);

/// A lease as one look sees it (see `lease.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseSeen {
    /// Its owner is gone: every record naming it is stale.
    Dead,
    /// Its owner (or a command that inherited it) lives. `taker`: the
    /// lease's entry in the lock table — the pid, as this pid namespace sees
    /// it, of the stowage process that took it and so also took the owner's
    /// image and slot locks. `None` when there is no table (NFS) or the
    /// table does not show the lease (an owner outside our pid namespace).
    Alive { taker: Option<Option<u32>> },
}

impl KernelView {
    /// Uses the lock table when `dir` is on a local filesystem and the table
    /// is readable; probes otherwise.
    pub fn new(dir: &Path) -> KernelView {
        Self::verified(dir, None)
    }

    /// Like [`KernelView::new`], but trusts the table only if it shows a
    /// lock this process holds on that filesystem (`held`: device and inode,
    /// e.g. of the global lock during a transaction). Device numbers in the
    /// table are the superblock's, which is not always what stat(2) reports
    /// (btrfs subvolumes): a table that does not match our own lock would
    /// make every held lock look free, so it is not used.
    pub fn verified(dir: &Path, held: Option<(u64, u64)>) -> KernelView {
        let local = crate::filesystem::filesystem(dir)
            .map(|f| f.local)
            .unwrap_or(false);
        Self::verified_on(local, held)
    }

    /// [`KernelView::verified`] for a directory whose filesystem is known
    /// already (`local`: the root's, found when it was checked): no statfs.
    pub fn verified_on(local: bool, held: Option<(u64, u64)>) -> KernelView {
        let mut table = if local { read_table().ok() } else { None };
        if let (Some(t), Some(id)) = (&table, held) {
            let me = std::process::id();
            let seen = t
                .get(&id)
                .is_some_and(|es| es.iter().any(|e| !e.blocked && e.pid == Some(me)));
            if !seen {
                table = None;
            }
        }
        let explained = std::cell::RefCell::new(held.into_iter().collect());
        KernelView {
            table,
            explained,
            leases_dir: None,
            leases: Default::default(),
            takers: Default::default(),
            said: Default::default(),
            listing: Default::default(),
            fresh: Default::default(),
        }
    }

    /// The live lease that the process the table shows as `pid` took: a
    /// stowage process that holds or awaits a lock it has not recorded (yet).
    /// Needs the table (local filesystems) and costs one `stat` per lease
    /// file, once per look; the table itself says which leases are held.
    pub fn lease_taken_by(&self, pid: u32) -> Option<String> {
        let table = self.table.as_ref()?;
        let leases = self.leases_dir.as_ref()?;
        let mut takers = self.takers.borrow_mut();
        let map = takers.get_or_insert_with(|| self.takers_in(leases, table));
        if let Some(name) = map.get(&pid) {
            return Some(name.clone());
        }
        // The table this pid was found in may be a later read than the one
        // the map was made from (a look reads it more than once), and the
        // leases were listed earlier still: a process that made its lease
        // and took its lock in between is no outsider. One more read of
        // the table, and of the leases directory, for the pids they do not
        // explain.
        let fresh = read_table().ok()?;
        let names = crate::lease::listing(leases).names;
        let more = self.takers_among(leases, &fresh, names);
        let found = more.get(&pid).cloned();
        map.extend(more);
        found
    }

    /// Whether the process the table showed as `pid` still holds the lock
    /// file at `path` in `mode`, by a fresh read of the table (one per look):
    /// a process unknown to the look — its lease, listed after the table
    /// was read, may be gone because it released its locks and ended — is
    /// shown as a holder only while it is one. Anything unsure says yes.
    pub fn still_held_by(&self, path: &Path, pid: u32, mode: Mode) -> bool {
        let Ok(m) = fs::symlink_metadata(path) else {
            return true;
        };
        let mut fresh = self.fresh.borrow_mut();
        if fresh.is_none() {
            *fresh = Some(read_table().ok());
        }
        match fresh.as_ref().and_then(|t| t.as_ref()) {
            Some(table) => table.get(&(m.dev(), m.ino())).is_some_and(|es| {
                es.iter()
                    .any(|e| !e.blocked && e.pid == Some(pid) && e.mode == mode)
            }),
            None => true,
        }
    }

    /// Which pid holds each lease in `leases` exclusively, per `table`:
    /// found by the device and inode each lease had when this look read
    /// it (before the table: [`KernelView::read_leases_first`]), so that a
    /// lease retired since still names the holder the table shows.
    fn takers_in(
        &self,
        leases: &Path,
        table: &HashMap<(u64, u64), Vec<Entry>>,
    ) -> HashMap<u32, String> {
        self.load_said();
        let mut map = HashMap::new();
        let mut unread = Vec::new();
        for name in self.lease_names() {
            let file = self
                .said
                .borrow()
                .iter()
                .flatten()
                .find(|(n, _)| *n == name)
                .and_then(|(_, id)| id.file);
            match file.and_then(|f| taker(table, f).map(|p| (f, p))) {
                Some((f, p)) => {
                    self.explained.borrow_mut().insert(f);
                    map.insert(p, name);
                }
                None if file.is_none() => unread.push(name),
                None => {}
            }
        }
        map.extend(self.takers_among(leases, table, unread));
        map
    }

    /// [`Self::takers_in`], among the lease files `names`.
    fn takers_among(
        &self,
        leases: &Path,
        table: &HashMap<(u64, u64), Vec<Entry>>,
        names: Vec<String>,
    ) -> HashMap<u32, String> {
        let mut map = HashMap::new();
        for name in names {
            let Ok(m) = fs::symlink_metadata(leases.join(&name)) else {
                continue;
            };
            if let Some(p) = taker(table, (m.dev(), m.ino())) {
                self.explained.borrow_mut().insert((m.dev(), m.ino()));
                map.insert(p, name);
            }
        }
        map
    }

    /// The leases listed and read before anything else of the look — above
    /// all before its lock table: every process the table then shows
    /// holding a lock made its lease before that lock, so this listing has
    /// it (unless it was made after the listing: then a listing of its own,
    /// [`KernelView::lease_taken_by`]), and one that ended between the
    /// table and its use here is still named by what its lease said.
    pub fn read_leases_first(self) -> KernelView {
        self.load_said();
        self
    }

    /// This view, judging leases in `leases` (the root's leases directory).
    pub fn with_leases(mut self, leases: &Path) -> KernelView {
        self.leases_dir = Some(leases.to_owned());
        self
    }

    /// This view, judging leases as `early` listed and read them: `early`
    /// a view of the leases alone ([`KernelView::leases_only`]), made and
    /// read ([`KernelView::read_leases_first`]) before this one's table.
    pub fn with_leases_from(mut self, early: KernelView) -> KernelView {
        self.leases_dir = early.leases_dir;
        self.listing = early.listing;
        self.said = early.said;
        self
    }

    /// A view of the leases in `leases` alone (no lock table): what
    /// [`KernelView::read_leases_first`] reads before a look's table.
    pub fn leases_only(leases: &Path) -> KernelView {
        KernelView::verified_on(false, None).with_leases(leases)
    }

    /// The live leases that list `lockfile` (relative to the locks
    /// directory) as held or awaited: how a holder that writes no record (a
    /// reader) is named where the lock table cannot name it (NFS, or an
    /// owner in a pid namespace this one does not see). Lease files are read
    /// once per look, and only the live ones count.
    pub fn leased(&self, lockfile: &str) -> Vec<Leased> {
        self.listing(lockfile, |name, _, _| {
            matches!(self.lease(name), LeaseSeen::Alive { .. })
        })
    }

    /// The dead leases that list `lockfile` as held, whose owner's pid is
    /// one of this kernel's as we see it ([`crate::lease::Identity::pid_is_ours`]):
    /// a reader (no record) whose command closed the inherited lease but
    /// kept the lock, after stowage died. The lock table shows the lock
    /// under the gone owner's pid; the lease still says for which command.
    /// Needs the table.
    pub fn dead_leased(&self, lockfile: &str) -> Vec<Leased> {
        if self.table.is_none() {
            return Vec::new();
        }
        self.listing(lockfile, |name, id, h| {
            !h.awaits && self.lease(name) == LeaseSeen::Dead && id.pid_is_ours()
        })
    }

    /// What the lease `name` says, as read in this look.
    pub fn said_by(&self, name: &str) -> Option<crate::lease::Identity> {
        self.load_said();
        let cached = self
            .said
            .borrow()
            .iter()
            .flatten()
            .find(|(n, _)| n == name)
            .map(|(_, id)| id.clone());
        match cached {
            // Read between its owner's lock and its write: read again.
            Some(id) if id.host.is_empty() => {
                let again = self
                    .leases_dir
                    .as_ref()
                    .and_then(|d| crate::lease::identity(d, name))
                    .filter(|a| !a.host.is_empty());
                return Some(again.unwrap_or(id));
            }
            Some(id) => return Some(id),
            None => {}
        }
        // A lease made after this look listed the leases, by a process the
        // look has since found holding a lock: read it now, or that
        // process would be taken for one stowage did not start.
        let id = crate::lease::identity(self.leases_dir.as_ref()?, name)?;
        if let Some(said) = self.said.borrow_mut().as_mut() {
            said.push((name.to_owned(), id.clone()));
        }
        Some(id)
    }

    /// The holdings of `lockfile` in the leases of this look that `wanted`
    /// keeps.
    fn listing(
        &self,
        lockfile: &str,
        wanted: impl Fn(&str, &crate::lease::Identity, &crate::lease::Holding) -> bool,
    ) -> Vec<Leased> {
        self.load_said();
        let said = self.said.borrow();
        let mut out = Vec::new();
        for (name, id) in said.iter().flatten() {
            for h in id.holdings.iter().filter(|h| h.lockfile == lockfile) {
                if wanted(name, id, h) {
                    out.push((name.clone(), id.clone(), h.clone()));
                }
            }
        }
        out
    }

    /// Whether the lock table shows the lock file at `path` held in `mode`
    /// by `pid` (false without a table).
    pub fn held_by(&self, path: &Path, mode: Mode, pid: u32) -> bool {
        let Some(table) = &self.table else {
            return false;
        };
        let Ok(m) = fs::symlink_metadata(path) else {
            return false;
        };
        table.get(&(m.dev(), m.ino())).is_some_and(|es| {
            es.iter()
                .any(|e| !e.blocked && e.mode == mode && e.pid == Some(pid))
        })
    }

    /// Every lock file that a live lease lists as held or awaited.
    pub fn leased_lockfiles(&self) -> Vec<String> {
        self.load_said();
        let said = self.said.borrow();
        let mut out: Vec<String> = Vec::new();
        for (name, id) in said.iter().flatten() {
            if id.holdings.is_empty() || !matches!(self.lease(name), LeaseSeen::Alive { .. }) {
                continue;
            }
            out.extend(id.holdings.iter().map(|h| h.lockfile.clone()));
        }
        out.sort();
        out.dedup();
        out
    }

    fn load_said(&self) {
        if self.said.borrow().is_some() {
            return;
        }
        let said = match &self.leases_dir {
            Some(dir) => self
                .lease_names()
                .into_iter()
                .filter_map(|n| crate::lease::identity(dir, &n).map(|id| (n, id)))
                .collect(),
            None => Vec::new(),
        };
        *self.said.borrow_mut() = Some(said);
    }

    /// The lease file names of this look's listing.
    fn lease_names(&self) -> Vec<String> {
        self.lease_listing(|l| l.names.clone())
    }

    /// This look's listing of the leases directory (made on first use, one
    /// listing per look): the names it read and the descriptor it read them
    /// through, which cleaning reuses.
    pub fn lease_listing<T>(&self, f: impl FnOnce(&crate::lease::Listing) -> T) -> T {
        let mut listing = self.listing.borrow_mut();
        let l = listing.get_or_insert_with(|| match &self.leases_dir {
            Some(dir) => crate::lease::listing(dir),
            None => crate::lease::Listing {
                dir: None,
                names: Vec::new(),
            },
        });
        f(l)
    }

    /// Judges a lease by name: probed once per look. A probe that fails
    /// (I/O error) counts as alive, the side on which nothing is dropped.
    pub fn lease(&self, name: &str) -> LeaseSeen {
        if let Some(seen) = self.leases.borrow().get(name) {
            return *seen;
        }
        let seen = match &self.leases_dir {
            None => LeaseSeen::Alive { taker: None },
            Some(leases) => match crate::lease::probe(leases, name) {
                Ok(crate::lease::Liveness::Dead) => LeaseSeen::Dead,
                Ok(crate::lease::Liveness::Alive { identity }) => {
                    self.explained.borrow_mut().insert(identity);
                    let taker = self.table.as_ref().and_then(|t| {
                        t.get(&identity)?
                            .iter()
                            .find(|e| !e.blocked && e.mode == Mode::Exclusive)
                            .map(|e| e.pid)
                    });
                    LeaseSeen::Alive { taker }
                }
                Err(_) => LeaseSeen::Alive { taker: None },
            },
        };
        self.leases.borrow_mut().insert(name.to_owned(), seen);
        seen
    }

    pub fn has_table(&self) -> bool {
        self.table.is_some()
    }

    pub fn view(&self, path: &Path) -> io::Result<LockView> {
        let Some(table) = &self.table else {
            return Ok(LockView {
                state: Some(lock::probe(path)?),
                ..LockView::default()
            });
        };
        let meta = match fs::symlink_metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(LockView {
                    state: Some(Probe::Missing),
                    ..LockView::default()
                });
            }
            Err(e) => return Err(e),
        };
        self.explained.borrow_mut().insert((meta.dev(), meta.ino()));
        let entries = table
            .get(&(meta.dev(), meta.ino()))
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let mut view = view_of(entries);
        if entries.is_empty() {
            view.unconfirmed_free = Some(path.to_owned());
        }
        Ok(view)
    }

    /// Inodes on device `dev` that someone holds or awaits a lock on and
    /// that no view so far accounted for: locks taken outside stowage. None
    /// without a lock table.
    pub fn unexplained_inodes(&self, dev: u64) -> Option<Vec<u64>> {
        let table = self.table.as_ref()?;
        let explained = self.explained.borrow();
        Some(
            table
                .keys()
                .filter(|k| k.0 == dev && !explained.contains(k))
                .map(|(_, i)| *i)
                .collect(),
        )
    }

    /// The view of an inode found by [`KernelView::unexplained_inodes`].
    pub fn view_inode(&self, dev: u64, ino: u64) -> LockView {
        let entries = self
            .table
            .as_ref()
            .and_then(|t| t.get(&(dev, ino)))
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        view_of(entries)
    }
}

pub(crate) fn view_of(entries: &[Entry]) -> LockView {
    let holders: Vec<Entry> = entries.iter().filter(|e| !e.blocked).copied().collect();
    let waiters: Vec<Entry> = entries.iter().filter(|e| e.blocked).copied().collect();
    let state = if holders.iter().any(|e| e.mode == Mode::Exclusive) {
        Probe::Exclusive
    } else if holders.is_empty() {
        Probe::Free
    } else {
        Probe::Shared
    };
    LockView {
        state: Some(state),
        holders,
        waiters,
        unconfirmed_free: None,
    }
}

/// Reads /proc/locks. The kernel produces it a page at a time, and entries
/// that move while it is read can be skipped or repeated. So it is read
/// until two reads agree (at most four times) and the reads are folded
/// ([`fold`]).
/// The flock table: the entries of each locked file, by device and inode.
pub(crate) type Table = HashMap<(u64, u64), Vec<Entry>>;

pub(crate) fn read_table() -> io::Result<Table> {
    Ok(fold(&read_texts()?))
}

/// The pid that holds the lock file `file` exclusively, per `table`.
fn taker(table: &HashMap<(u64, u64), Vec<Entry>>, file: (u64, u64)) -> Option<u32> {
    table.get(&file).and_then(|es| {
        es.iter()
            .find(|e| !e.blocked && e.mode == Mode::Exclusive)
            .and_then(|e| e.pid)
    })
}

/// The flock table (as `read_table` reads it) and, from the same reads, the device
/// and inode of every file with a lock of any kind — POSIX, OFD, file
/// leases, flocks — for a look that must know whether anything at all is
/// locked on a filesystem (`idle.rs`).
pub fn read_table_and_all() -> io::Result<LockTable> {
    let reads = read_texts()?;
    let mut others: std::collections::HashSet<(u64, u64)> = Default::default();
    for text in &reads {
        others.extend(
            parse_lines(text)
                .filter(|(_, e)| e.is_none())
                .map(|(key, _)| key),
        );
    }
    Ok(LockTable {
        flocks: fold(&reads),
        others,
    })
}

/// The lock table as [`read_table_and_all`] read it.
pub struct LockTable {
    /// The flocks, folded as `read_table` folds them.
    pub flocks: HashMap<(u64, u64), Vec<Entry>>,
    /// Files with a lock of another kind (POSIX, OFD, a file lease).
    pub others: std::collections::HashSet<(u64, u64)>,
}

fn read_texts() -> io::Result<Vec<String>> {
    let mut reads: Vec<String> = Vec::with_capacity(4);
    for _ in 0..4 {
        let text = fs::read_to_string("/proc/locks")?;
        let agree = reads.last().is_some_and(|p| *p == text);
        reads.push(text);
        if agree {
            break;
        }
    }
    Ok(reads)
}

/// Folds several reads of the lock table into one. Everything seen is kept,
/// so a lock held throughout is all but certain to be seen and one released
/// meanwhile may still show — the safe side, since only a "free" leads
/// anyone to drop records or mark images. But a lock's entries must be a
/// state the lock was really in: reads from different moments can show a
/// lock taken exclusively, in turn, by two processes (the global lock, held
/// for microseconds at a time) — two exclusive holders, or an exclusive and
/// shared ones, which no moment ever had. Such a lock gets its entries from
/// the latest read that shows it holding together (held either way).
fn fold(reads: &[String]) -> HashMap<(u64, u64), Vec<Entry>> {
    let parsed: Vec<HashMap<(u64, u64), Vec<Entry>>> =
        reads.iter().map(|t| parse_table(t)).collect();
    let mut table: HashMap<(u64, u64), Vec<Entry>> = HashMap::new();
    for one in &parsed {
        for (key, entries) in one {
            let all = table.entry(*key).or_default();
            for e in entries {
                if !all.contains(e) {
                    all.push(*e);
                }
            }
        }
    }
    for (key, entries) in table.iter_mut() {
        if consistent(entries) {
            continue;
        }
        let latest = parsed
            .iter()
            .rev()
            .filter_map(|one| one.get(key))
            .find(|es| consistent(es) && es.iter().any(|e| !e.blocked));
        *entries = match latest {
            Some(es) => es.clone(),
            // No single read holds together (a lock moved within a read):
            // one exclusive holder, and the waiters.
            None => {
                let holder = entries
                    .iter()
                    .rev()
                    .find(|e| !e.blocked && e.mode == Mode::Exclusive)
                    .copied();
                holder
                    .into_iter()
                    .chain(entries.iter().filter(|e| e.blocked).copied())
                    .collect()
            }
        };
    }
    table
}

/// Could one lock be held this way at one moment: one exclusive holder,
/// or any number of shared ones?
fn consistent(entries: &[Entry]) -> bool {
    let exclusive = entries
        .iter()
        .filter(|e| !e.blocked && e.mode == Mode::Exclusive)
        .count();
    let shared = entries
        .iter()
        .filter(|e| !e.blocked && e.mode == Mode::Shared)
        .count();
    exclusive == 0 || (exclusive == 1 && shared == 0)
}

/// Parses /proc/locks, keeping flock(2) entries:
///
/// ```text
/// 1: FLOCK  ADVISORY  WRITE 4121 00:2a:123456 0 EOF
/// 1: -> FLOCK  ADVISORY  WRITE 4130 00:2a:123456 0 EOF
/// ```
///
/// The device is `major:minor` in hex, the inode in decimal.
fn parse_table(text: &str) -> HashMap<(u64, u64), Vec<Entry>> {
    let mut table: HashMap<(u64, u64), Vec<Entry>> = HashMap::new();
    for (key, e) in parse_lines(text) {
        let Some(e) = e else { continue };
        let entries = table.entry(key).or_default();
        if !entries.contains(&e) {
            entries.push(e);
        }
    }
    table
}

/// Every lock of the table, of any kind (`POSIX`, `OFDLCK`, `LEASE`,
/// `FLOCK`, …: the fields are in the same places), by device and inode;
/// with its entry for a flock.
fn parse_lines(text: &str) -> impl Iterator<Item = ((u64, u64), Option<Entry>)> + '_ {
    text.lines().filter_map(|line| {
        let mut f = line.split_whitespace().skip(1).peekable();
        let blocked = f.peek() == Some(&"->");
        if blocked {
            f.next();
        }
        let (Some(kind), Some(_), Some(rw), Some(pid), Some(id)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            return None;
        };
        let mut parts = id.split(':');
        let (Some(maj), Some(min), Some(ino)) = (parts.next(), parts.next(), parts.next()) else {
            return None;
        };
        let (Ok(maj), Ok(min), Ok(ino)) = (
            u32::from_str_radix(maj, 16),
            u32::from_str_radix(min, 16),
            ino.parse::<u64>(),
        ) else {
            return None;
        };
        let key = (libc::makedev(maj, min), ino);
        let mode = match rw {
            "WRITE" => Some(Mode::Exclusive),
            "READ" => Some(Mode::Shared),
            _ => None,
        };
        let entry = match (kind, mode) {
            ("FLOCK", Some(mode)) => {
                let pid = pid.parse::<i64>().ok().filter(|p| *p > 0).map(|p| p as u32);
                Some(Entry { pid, mode, blocked })
            }
            _ => None,
        };
        Some((key, entry))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folded_reads_show_a_state_the_lock_was_really_in() {
        let global = (libc::makedev(0, 0x2a), 7);
        let image = (libc::makedev(0, 0x2a), 8);
        // The global lock taken in turn by 100 and 200 between reads; an
        // image lock held shared throughout, a second reader arriving.
        let reads = [
            "1: FLOCK  ADVISORY  WRITE 100 00:2a:7 0 EOF\n\
             2: FLOCK  ADVISORY  READ 300 00:2a:8 0 EOF\n"
                .to_owned(),
            "1: FLOCK  ADVISORY  WRITE 200 00:2a:7 0 EOF\n\
             2: FLOCK  ADVISORY  READ 300 00:2a:8 0 EOF\n\
             3: FLOCK  ADVISORY  READ 301 00:2a:8 0 EOF\n"
                .to_owned(),
            "2: FLOCK  ADVISORY  READ 300 00:2a:8 0 EOF\n".to_owned(),
        ];
        let t = fold(&reads);
        let g = &t[&global];
        assert_eq!(g.len(), 1, "{g:?}");
        assert_eq!(g[0].pid, Some(200));
        // Shared holders from several reads are consistent: all kept.
        assert_eq!(t[&image].len(), 2);
        // A lock seen only in an earlier read still shows (the safe side).
        assert!(!fold(&reads[..2]).is_empty());
        // Exclusive then shared, across reads: the latest state.
        let t = fold(&[
            "1: FLOCK  ADVISORY  WRITE 100 00:2a:7 0 EOF\n".to_owned(),
            "1: FLOCK  ADVISORY  READ 400 00:2a:7 0 EOF\n".to_owned(),
        ]);
        assert_eq!(t[&global].len(), 1);
        assert_eq!(t[&global][0].mode, Mode::Shared);
    }

    #[test]
    fn parses_the_lock_table() {
        let t = parse_table(
            "1: FLOCK  ADVISORY  WRITE 4121 00:2a:123456 0 EOF\n\
             1: -> FLOCK  ADVISORY  READ 4130 00:2a:123456 0 EOF\n\
             2: POSIX  ADVISORY  WRITE 99 08:01:5 0 EOF\n\
             3: FLOCK  ADVISORY  READ 0 fd:01:77 0 EOF\n",
        );
        let e = &t[&(libc::makedev(0, 0x2a), 123456)];
        assert_eq!(e.len(), 2);
        assert_eq!(
            e[0],
            Entry {
                pid: Some(4121),
                mode: Mode::Exclusive,
                blocked: false
            }
        );
        assert_eq!(
            e[1],
            Entry {
                pid: Some(4130),
                mode: Mode::Shared,
                blocked: true
            }
        );
        assert!(
            !t.contains_key(&(libc::makedev(8, 1), 5)),
            "POSIX locks are not flocks"
        );
        assert_eq!(t[&(libc::makedev(0xfd, 1), 77)][0].pid, None);
    }

    #[test]
    fn a_free_verdict_from_the_table_is_confirmed_by_probing() {
        // A table that missed the entry (as a page-wise read of /proc/locks
        // can while locks change) must not make a held lock look free.
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.lock");
        let _g = lock::acquire_no_wait(&p, Mode::Exclusive, lock::IfMissing::Create)
            .unwrap()
            .unwrap();
        let kv = KernelView {
            table: Some(HashMap::new()),
            explained: Default::default(),
            leases_dir: None,
            leases: Default::default(),
            takers: Default::default(),
            said: Default::default(),
            listing: Default::default(),
            fresh: Default::default(),
        };
        let v = kv.view(&p).unwrap();
        assert_eq!(v.state, Some(Probe::Free));
        assert!(v.unconfirmed_free.is_some());
        assert_eq!(v.confirmed().state, Some(Probe::Exclusive));
        drop(_g);
        assert_eq!(kv.view(&p).unwrap().confirmed().state, Some(Probe::Free));
    }

    #[test]
    fn sees_our_own_lock_in_the_table() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.lock");
        let _g = lock::acquire_no_wait(&p, Mode::Exclusive, lock::IfMissing::Create)
            .unwrap()
            .unwrap();
        let kv = KernelView::new(d.path());
        let v = kv.view(&p).unwrap();
        assert_eq!(v.state, Some(Probe::Exclusive));
        if kv.has_table() {
            assert_eq!(v.holders[0].pid, Some(std::process::id()));
        }
    }
}
