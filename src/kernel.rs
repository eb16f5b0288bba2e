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

/// A filesystem, as statfs(2) names it.
#[derive(Debug, Clone)]
pub struct Filesystem {
    pub name: String,
    /// True when every lock on it is visible in this host's lock table.
    pub local: bool,
}

/// Hidden test hook: `STOWAGE_DEBUG_FILESYSTEM=NAME` makes every
/// filesystem look like NAME (`nfs`, `lustre`, `beegfs`, `tmpfs`, …), so
/// that the code for shared filesystems runs, with real processes, where
/// there is none.
pub const FILESYSTEM_ENV: &str = "STOWAGE_DEBUG_FILESYSTEM";

/// Hidden test hook: `STOWAGE_DEBUG_MOUNTINFO=FILE` is read instead of
/// /proc/self/mountinfo (mount options of filesystems that are not here).
pub const MOUNTINFO_ENV: &str = "STOWAGE_DEBUG_MOUNTINFO";

/// Filesystems whose locks this host's lock table shows completely.
const LOCAL: &[&str] = &[
    "tmpfs", "ext4", "xfs", "btrfs", "zfs", "overlay", "f2fs", "ramfs", "reiserfs",
];

pub fn filesystem(path: &Path) -> io::Result<Filesystem> {
    let st = nix::sys::statfs::statfs(path).map_err(io::Error::from)?;
    if let Some(name) = std::env::var_os(FILESYSTEM_ENV) {
        let name = name.to_string_lossy().into_owned();
        let local = LOCAL.contains(&name.as_str());
        return Ok(Filesystem { name, local });
    }
    #[allow(clippy::unnecessary_cast)]
    let magic = st.filesystem_type().0 as i64;
    let (name, local) = match magic {
        0x0102_1994 => ("tmpfs", true),
        0xEF53 => ("ext4", true),
        0x5846_5342 => ("xfs", true),
        0x9123_683E => ("btrfs", true),
        0x2FC1_2FC1 => ("zfs", true),
        0x794C_7630 => ("overlay", true),
        0xF2F5_2010 => ("f2fs", true),
        0x8584_58F6 => ("ramfs", true),
        0x5265_4973 => ("reiserfs", true),
        0x6969 => ("nfs", false),
        0x0BD0_0BD0 => ("lustre", false),
        0x4750_4653 => ("gpfs", false),
        0xFF53_4D42 => ("cifs", false),
        0xFE53_4D42 => ("smb2", false),
        0x00C3_6400 => ("ceph", false),
        0x1983_0326 => ("beegfs", false),
        0x6573_5546 => ("fuse", false),
        0x0000_564C => ("ncp", false),
        0x7366_7673 => ("afs", false),
        0x5346_414F => ("afs", false),
        _ => ("", false),
    };
    let name = if name.is_empty() {
        format!("unknown (0x{magic:x})")
    } else {
        name.to_owned()
    };
    Ok(Filesystem { name, local })
}

/// A mount, from /proc/self/mountinfo.
#[derive(Debug, Clone)]
pub struct Mount {
    pub mount_point: std::path::PathBuf,
    pub fstype: String,
    pub source: String,
    /// Per-mount and superblock options together.
    pub options: Vec<String>,
}

/// The mount that holds `path` (the longest mount point that contains it).
pub fn mount_of(path: &Path) -> Option<Mount> {
    let path = fs::canonicalize(path).ok()?;
    let info = std::env::var_os(MOUNTINFO_ENV)
        .map_or_else(|| "/proc/self/mountinfo".into(), std::path::PathBuf::from);
    let text = fs::read_to_string(info).ok()?;
    parse_mountinfo(&text)
        .into_iter()
        .filter(|m| path.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.as_os_str().len())
}

fn parse_mountinfo(text: &str) -> Vec<Mount> {
    let mut out = Vec::new();
    for line in text.lines() {
        // id parent maj:min root mount-point options [optional...] - fstype source super-options
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let l: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        if l.len() < 6 || r.len() < 3 {
            continue;
        }
        let options = l[5]
            .split(',')
            .chain(r[2].split(','))
            .map(str::to_owned)
            .collect();
        out.push(Mount {
            mount_point: std::path::PathBuf::from(unescape(l[4])),
            fstype: r[0].to_owned(),
            source: unescape(r[1]),
            options,
        });
    }
    out
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let oct: String = chars.by_ref().take(3).collect();
            if let Ok(v) = u8::from_str_radix(&oct, 8) {
                out.push(v as char);
                continue;
            }
            out.push(c);
            out.push_str(&oct);
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether locks on a shared filesystem exclude other hosts, as far as its
/// mount options and client configuration tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// Nothing says otherwise (a local filesystem, or a shared one whose
    /// settings give cluster-wide locks).
    ClusterWide,
    /// Locks exclude only processes on the same host: refused (exit 69).
    NodeLocal { why: String, advice: String },
    /// Could not be told (e.g. Lustre mounted without `flock` or
    /// `localflock`, whose default differs between releases): doctor says
    /// so and offers the two-host probe.
    Unknown { why: String },
}

/// How far locks on the filesystem of `path` reach, with the mount looked
/// at. Cheap where it matters: one statfs(2); mountinfo (and a client
/// configuration file) only on NFS, Lustre and BeeGFS.
pub fn lock_reach(path: &Path) -> (Reach, Option<Mount>) {
    // A root not made yet lives where its nearest existing ancestor does;
    // the common case (it exists) costs the one statfs.
    let Some((path, Ok(fs))) = path.ancestors().find_map(|p| match filesystem(p) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        other => Some((p, other)),
    }) else {
        return (Reach::ClusterWide, None);
    };
    if !matches!(fs.name.as_str(), "nfs" | "lustre" | "beegfs") {
        return (Reach::ClusterWide, None);
    }
    let Some(m) = mount_of(path) else {
        return (
            Reach::Unknown {
                why: format!("{} mount options could not be read", fs.name),
            },
            None,
        );
    };
    let reach = match fs.name.as_str() {
        "nfs" => nfs_reach(&m.options),
        "lustre" => lustre_reach(&m.options),
        _ => beegfs_reach(&m.options, |p| fs::read_to_string(p).ok()),
    };
    (reach, Some(m))
}

/// NFS: `nolock` and `local_lock=flock|posix|all` keep locks on the client.
/// `local_lock=flock` breaks the image and global locks outright.
/// `local_lock=posix` looks harmless — SQLite's fcntl locks are only taken
/// under the global flock, which still reaches the server — but the NFS
/// client revalidates a file's cached pages when a lock *on that file* goes
/// to the server: with SQLite's locks local, a process could read stale
/// database pages cached before another host's transaction, and write a
/// transaction on top of them.
fn nfs_reach(options: &[String]) -> Reach {
    let bad = local_only_options(options);
    if bad.is_empty() {
        return Reach::ClusterWide;
    }
    Reach::NodeLocal {
        why: format!(
            "NFS mounted with {}: locks stay local to each client",
            bad.join(",")
        ),
        advice: "remount without it".into(),
    }
}

/// Lustre: `flock` gives cluster-wide flocks, `localflock` flocks that
/// exclude only on one client node (how shared SQLite databases get
/// corrupted on Lustre), `noflock` none at all (ENOSYS). With none of them
/// the default depends on the Lustre release.
fn lustre_reach(options: &[String]) -> Reach {
    let has = |o: &str| options.iter().any(|x| x == o);
    if has("localflock") {
        Reach::NodeLocal {
            why: "Lustre mounted with localflock: flocks exclude only processes on the same client node".into(),
            advice: "remount with -o flock (cluster-wide locks)".into(),
        }
    } else if has("noflock") {
        Reach::NodeLocal {
            why: "Lustre mounted with noflock: flock is disabled".into(),
            advice: "remount with -o flock (cluster-wide locks)".into(),
        }
    } else if has("flock") {
        Reach::ClusterWide
    } else {
        Reach::Unknown {
            why: "Lustre mounted without 'flock' or 'localflock': whether flocks reach other nodes depends on the Lustre release".into(),
        }
    }
}

/// BeeGFS: flocks are cluster-wide only with `tuneUseGlobalFileLocks =
/// true` in the client configuration (the mount's `cfgFile=`, else
/// /etc/beegfs/beegfs-client.conf); the default, false, keeps them on the
/// node.
fn beegfs_reach(options: &[String], read: impl Fn(&Path) -> Option<String>) -> Reach {
    let conf = options
        .iter()
        .find_map(|o| o.strip_prefix("cfgFile="))
        .unwrap_or("/etc/beegfs/beegfs-client.conf");
    let Some(text) = read(Path::new(conf)) else {
        return Reach::Unknown {
            why: format!(
                "BeeGFS client configuration {conf} could not be read (tuneUseGlobalFileLocks decides whether flocks reach other nodes)"
            ),
        };
    };
    let global = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter_map(|l| l.split_once('='))
        .rfind(|(k, _)| k.trim() == "tuneUseGlobalFileLocks")
        .map(|(_, v)| v.trim().eq_ignore_ascii_case("true"));
    if global == Some(true) {
        Reach::ClusterWide
    } else {
        Reach::NodeLocal {
            why: format!(
                "BeeGFS with tuneUseGlobalFileLocks={} ({conf}): flocks exclude only processes on the same client node",
                if global.is_some() {
                    "false"
                } else {
                    "false (the default)"
                }
            ),
            advice: format!("set tuneUseGlobalFileLocks = true in {conf} and remount"),
        }
    }
}

/// The NFS mount options that keep locks on the client.
fn local_only_options(options: &[String]) -> Vec<String> {
    options
        .iter()
        .filter(|o| {
            o.as_str() == "nolock" || (o.starts_with("local_lock=") && *o != "local_lock=none")
        })
        .cloned()
        .collect()
}

/// Set by `stowage exec` for its command: the pids of the execs that run
/// it, outermost first, separated by `:` (each appends its own).
pub const EXEC_PIDS_ENV: &str = "STOWAGE_EXEC_PIDS";

/// The value of [`EXEC_PIDS_ENV`] for the command of an exec with pid `me`.
pub fn exec_pids_for_command(me: u32) -> String {
    match std::env::var(EXEC_PIDS_ENV) {
        Ok(v) if !v.is_empty() => format!("{v}:{me}"),
        _ => me.to_string(),
    }
}

/// The `stowage exec` processes that run us, directly or not: named in
/// [`EXEC_PIDS_ENV`] and found among our ancestors (a name alone could be
/// a stale variable, or a recycled pid).
pub fn enclosing_execs() -> Vec<u32> {
    let Ok(named) = std::env::var(EXEC_PIDS_ENV) else {
        return Vec::new();
    };
    let named: Vec<u32> = named.split(':').filter_map(|p| p.parse().ok()).collect();
    ancestors()
        .into_iter()
        .filter(|p| named.contains(p))
        .collect()
}

/// The lock that this process, or one of its ancestors, holds on the file
/// at `path`: the hold of an enclosing command. Found through a descriptor
/// this process inherited ([`lock::held_here`], on every filesystem: it
/// holds the lock itself), else through the lock table, whose holder pid
/// is an ancestor that is a `stowage exec` running us — named in
/// [`EXEC_PIDS_ENV`] *and* found among our ancestors, since only an exec
/// is known to wait for its command (local filesystems; this covers an
/// enclosing `exec --no-inherit`, whose command does not inherit the
/// descriptors). Waiting for a conflicting lock on such a file would wait
/// for ourselves.
pub fn enclosing_hold(path: &Path) -> Option<Mode> {
    enclosing_hold_except(path, None)
}

/// [`enclosing_hold`], not counting our own descriptor `except` (a lock
/// the caller has just taken on that file).
pub fn enclosing_hold_except(path: &Path, except: Option<std::os::fd::RawFd>) -> Option<Mode> {
    if let Some(m) = lock::held_here_except(path, except) {
        return Some(m);
    }
    // Cheapest first: not run by an exec at all, nothing more to look at.
    let execs: Vec<u32> = std::env::var(EXEC_PIDS_ENV)
        .ok()?
        .split(':')
        .filter_map(|p| p.parse().ok())
        .collect();
    let dir = path.parent()?;
    if !filesystem(dir).is_ok_and(|f| f.local) {
        return None;
    }
    let meta = fs::symlink_metadata(path).ok()?;
    let table = read_table().ok()?;
    let entries = table.get(&(meta.dev(), meta.ino()))?;
    let ancestors: Vec<u32> = ancestors()
        .into_iter()
        .filter(|p| execs.contains(p))
        .collect();
    entries
        .iter()
        .filter(|e| !e.blocked && e.pid.is_some_and(|p| ancestors.contains(&p)))
        .map(|e| e.mode)
        .max()
}

/// The pids of our ancestors (parent, grandparent, … up to init), from
/// /proc: the process tree of this pid namespace, which is the one the lock
/// table's pids are in.
fn ancestors() -> Vec<u32> {
    let mut out = Vec::new();
    let mut pid = std::os::unix::process::parent_id();
    while pid > 1 && out.len() < 4096 {
        out.push(pid);
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            break;
        };
        // "pid (comm) state ppid …"; comm may hold spaces and parentheses.
        let Some(ppid) = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            break;
        };
        pid = ppid;
    }
    out
}

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
    /// The root's locks directory, where leases live: set for views taken
    /// in a transaction, which judge records ([`KernelView::lease`]).
    locks: Option<std::path::PathBuf>,
    /// Leases probed so far, by name: one probe per lease per look.
    leases: std::cell::RefCell<HashMap<String, LeaseSeen>>,
    /// Live leases by the pid that the table shows took them: made once per
    /// look, when a lock-table entry is claimed by no record.
    takers: std::cell::RefCell<Option<HashMap<u32, String>>>,
}

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
        let local = filesystem(dir).map(|f| f.local).unwrap_or(false);
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
            locks: None,
            leases: Default::default(),
            takers: Default::default(),
        }
    }

    /// The live lease that the process the table shows as `pid` took: a
    /// stowage process that holds or awaits a lock it has not recorded (yet).
    /// Needs the table (local filesystems) and costs one `stat` per lease
    /// file, once per look; the table itself says which leases are held.
    pub fn lease_taken_by(&self, pid: u32) -> Option<String> {
        let table = self.table.as_ref()?;
        let locks = self.locks.as_ref()?;
        let mut takers = self.takers.borrow_mut();
        let map = takers.get_or_insert_with(|| {
            let dir = locks.join(crate::lease::DIR);
            let mut map = HashMap::new();
            for name in crate::lease::names(locks) {
                let Ok(m) = fs::symlink_metadata(dir.join(&name)) else {
                    continue;
                };
                let taker = table.get(&(m.dev(), m.ino())).and_then(|es| {
                    es.iter()
                        .find(|e| !e.blocked && e.mode == Mode::Exclusive)
                        .and_then(|e| e.pid)
                });
                if let Some(p) = taker {
                    self.explained.borrow_mut().insert((m.dev(), m.ino()));
                    map.insert(p, name);
                }
            }
            map
        });
        map.get(&pid).cloned()
    }

    /// This view, judging leases under `locks` (the root's locks directory).
    pub fn with_leases(mut self, locks: &Path) -> KernelView {
        self.locks = Some(locks.to_owned());
        self
    }

    /// Judges a lease by name: probed once per look. A probe that fails
    /// (I/O error) counts as alive, the side on which nothing is dropped.
    pub fn lease(&self, name: &str) -> LeaseSeen {
        if let Some(seen) = self.leases.borrow().get(name) {
            return *seen;
        }
        let seen = match &self.locks {
            None => LeaseSeen::Alive { taker: None },
            Some(locks) => match crate::lease::probe(locks, name) {
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

fn view_of(entries: &[Entry]) -> LockView {
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
fn read_table() -> io::Result<HashMap<(u64, u64), Vec<Entry>>> {
    let mut reads: Vec<String> = Vec::with_capacity(4);
    for _ in 0..4 {
        let text = fs::read_to_string("/proc/locks")?;
        let agree = reads.last().is_some_and(|p| *p == text);
        reads.push(text);
        if agree {
            break;
        }
    }
    Ok(fold(&reads))
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
    for line in text.lines() {
        let mut f = line.split_whitespace().skip(1).peekable();
        let blocked = f.peek() == Some(&"->");
        if blocked {
            f.next();
        }
        let (Some("FLOCK"), Some(_), Some(rw), Some(pid), Some(id)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let mode = match rw {
            "WRITE" => Mode::Exclusive,
            "READ" => Mode::Shared,
            _ => continue,
        };
        let mut parts = id.split(':');
        let (Some(maj), Some(min), Some(ino)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let (Ok(maj), Ok(min), Ok(ino)) = (
            u32::from_str_radix(maj, 16),
            u32::from_str_radix(min, 16),
            ino.parse::<u64>(),
        ) else {
            continue;
        };
        let pid = pid.parse::<i64>().ok().filter(|p| *p > 0).map(|p| p as u32);
        let entries = table.entry((libc::makedev(maj, min), ino)).or_default();
        let e = Entry { pid, mode, blocked };
        if !entries.contains(&e) {
            entries.push(e);
        }
    }
    table
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
    fn parses_mountinfo() {
        let m = parse_mountinfo(
            "36 35 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 - nfs4 server:/export rw,vers=4.2,local_lock=flock\n\
             22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n",
        );
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].mount_point, Path::new("/mnt/with space"));
        assert_eq!(m[0].fstype, "nfs4");
        assert!(m[0].options.contains(&"local_lock=flock".to_owned()));
        assert!(m[0].options.contains(&"noatime".to_owned()));
        assert!(mount_of(Path::new("/")).is_some());
    }

    #[test]
    fn only_mounts_that_keep_flock_local_are_unsafe() {
        let opts = |o: &str| o.split(',').map(str::to_owned).collect::<Vec<_>>();
        for unsafe_ in [
            "rw,nolock",
            "rw,vers=3,local_lock=flock",
            "rw,local_lock=posix",
            "local_lock=all,hard",
        ] {
            assert_eq!(local_only_options(&opts(unsafe_)).len(), 1, "{unsafe_}");
        }
        for safe in [
            "rw,vers=4.2,local_lock=none",
            "rw,lock,hard",
            "rw,nolocks_are_not_a_thing",
        ] {
            assert!(local_only_options(&opts(safe)).is_empty(), "{safe}");
        }
        // A local filesystem is never NFS, whatever its options.
        assert_eq!(lock_reach(Path::new("/")).0, Reach::ClusterWide);
    }

    /// Lines as /proc/self/mountinfo shows such mounts.
    const FIXTURE: &str = "\
101 30 0:60 / /lustre/scratch rw,relatime - lustre 10.0.0.1@o2ib:/scratch rw,localflock,lazystatfs\n\
102 30 0:61 / /lustre/work rw,relatime - lustre 10.0.0.1@o2ib:/work rw,flock,lazystatfs\n\
103 30 0:62 / /lustre/old rw,relatime - lustre 10.0.0.1@o2ib:/old rw,noflock\n\
104 30 0:63 / /lustre/plain rw,relatime - lustre 10.0.0.1@o2ib:/plain rw,lazystatfs\n\
105 30 0:64 / /mnt/beegfs rw,relatime - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf,_netdev\n\
106 30 0:65 / /mnt/nfs rw,relatime - nfs4 srv:/export rw,vers=4.2,local_lock=none\n";

    fn reach_of(mount_point: &str, fstype: &str) -> Reach {
        let m = parse_mountinfo(FIXTURE)
            .into_iter()
            .find(|m| m.mount_point == Path::new(mount_point))
            .unwrap();
        match fstype {
            "lustre" => lustre_reach(&m.options),
            "nfs" => nfs_reach(&m.options),
            _ => unreachable!(),
        }
    }

    #[test]
    fn lustre_mount_options_decide_the_reach_of_locks() {
        assert!(matches!(
            reach_of("/lustre/scratch", "lustre"),
            Reach::NodeLocal { .. }
        ));
        assert!(matches!(
            reach_of("/lustre/old", "lustre"),
            Reach::NodeLocal { .. }
        ));
        assert_eq!(reach_of("/lustre/work", "lustre"), Reach::ClusterWide);
        assert!(matches!(
            reach_of("/lustre/plain", "lustre"),
            Reach::Unknown { .. }
        ));
        assert_eq!(reach_of("/mnt/nfs", "nfs"), Reach::ClusterWide);
    }

    #[test]
    fn beegfs_client_configuration_decides_the_reach_of_locks() {
        let m = parse_mountinfo(FIXTURE)
            .into_iter()
            .find(|m| m.fstype == "beegfs")
            .unwrap();
        let conf = |text: &'static str| {
            move |p: &Path| {
                assert_eq!(p, Path::new("/etc/beegfs/beegfs-client.conf"));
                Some(text.to_owned())
            }
        };
        // The default is node-local.
        assert!(matches!(
            beegfs_reach(&m.options, conf("sysMgmtdHost = mgmt\n")),
            Reach::NodeLocal { .. }
        ));
        assert!(matches!(
            beegfs_reach(&m.options, conf("tuneUseGlobalFileLocks = false\n")),
            Reach::NodeLocal { .. }
        ));
        assert_eq!(
            beegfs_reach(
                &m.options,
                conf(
                    "# tuneUseGlobalFileLocks = false\ntuneUseGlobalFileLocks   = true  # cluster-wide\n"
                )
            ),
            Reach::ClusterWide
        );
        assert!(matches!(
            beegfs_reach(&m.options, |_| None),
            Reach::Unknown { .. }
        ));
    }

    #[test]
    fn a_free_verdict_from_the_table_is_confirmed_by_probing() {
        // A table that missed the entry (as a page-wise read of /proc/locks
        // can while locks change) must not make a held lock look free.
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.lock");
        let _g = lock::try_lock(&p, Mode::Exclusive, true).unwrap().unwrap();
        let kv = KernelView {
            table: Some(HashMap::new()),
            explained: Default::default(),
            locks: None,
            leases: Default::default(),
            takers: Default::default(),
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
        let _g = lock::try_lock(&p, Mode::Exclusive, true).unwrap().unwrap();
        let kv = KernelView::new(d.path());
        let v = kv.view(&p).unwrap();
        assert_eq!(v.state, Some(Probe::Exclusive));
        if kv.has_table() {
            assert_eq!(v.holders[0].pid, Some(std::process::id()));
        }
    }
}
