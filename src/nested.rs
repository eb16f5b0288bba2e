//! Nested calls: the holds of the `stowage exec` commands that run us.
//!
//! - Each exec appends its lease to its command's [`crate::env::EXEC_LEASES`] (outermost first).
//!   A lock a live lease named there lists is held by an enclosing command, which waits for us;
//!   but an environment can be saved and restored by anyone: where the lease's pid means a process
//!   to us, its owner must also be our ancestor.
//! - Judged by leases and the environment, never a pid alone or a device number: it holds across
//!   pid namespaces, on btrfs and on shared filesystems. A stale name's lease is dead: harmless.
//! - An exclusive read ([`HeldAs::ExclusiveRead`]) is no write: a read inside it runs under it.
//! - An environment cleared on the way (`env -i`, sudo) names nothing: then the live leases of
//!   our ancestors do, where a lease's pid means the same process to us and it has the lease open.
//! - Always: a lock of this root held through an inherited descriptor is an enclosing command's.
//! - Looked at only when a lock is busy or a hint asks: an uncontended exec pays nothing for it.
//! - On a shared filesystem an enclosing exec may announce its lease late (lease.rs): a lease
//!   named here, missing or unwritten, whose maker is our ancestor is waited for a moment, then
//!   looked at again while we wait for the lock. Never on a local filesystem.

use std::path::Path;
use std::time::Duration;

use crate::lease::{Holding, Identity};
use crate::lock::Mode;
use crate::root::Root;

/// The value of [`crate::env::EXEC_LEASES`] for the command of an exec whose lease is `mine`.
pub fn for_command(mine: Option<&str>) -> String {
    let outer = std::env::var(crate::env::EXEC_LEASES).unwrap_or_default();
    match (outer.is_empty(), mine) {
        (_, None) => outer,
        (true, Some(m)) => m.to_owned(),
        (false, Some(m)) => format!("{outer}:{m}"),
    }
}

/// What the live leases of our enclosing execs list as held in this root, and whether one of them
/// may announce more yet (module doc).
#[derive(Default)]
pub struct Enclosing {
    pub holds: Vec<Holding>,
    pub unannounced: bool,
}

impl Enclosing {
    /// How an enclosing exec holds the lock file `rel` (relative to `locks/`), if one does.
    pub fn hold(&self, rel: &str) -> Option<HeldAs> {
        self.holds
            .iter()
            .filter(|h| h.lockfile == rel)
            .map(HeldAs::of)
            .max()
    }
}

/// How an enclosing exec holds a lock: an exclusive read is exclusive, yet no write (the image is
/// ready and stays so), so a read inside it may run under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HeldAs {
    Read,
    ExclusiveRead,
    Write,
}

impl HeldAs {
    pub fn of(h: &Holding) -> HeldAs {
        match (h.mode, h.reading) {
            (Mode::Shared, _) => HeldAs::Read,
            (Mode::Exclusive, true) => HeldAs::ExclusiveRead,
            (Mode::Exclusive, false) => HeldAs::Write,
        }
    }

    pub fn mode(self) -> Mode {
        match self {
            HeldAs::Read => Mode::Shared,
            HeldAs::ExclusiveRead | HeldAs::Write => Mode::Exclusive,
        }
    }

    /// As holders are said: "held (exclusive read) by …".
    pub fn verb(self) -> &'static str {
        match self {
            HeldAs::Read => "read",
            HeldAs::ExclusiveRead => "exclusive read",
            HeldAs::Write => "write",
        }
    }
}

/// How long a nested call waits for an enclosing exec to announce its lease before it looks at a
/// busy lock's holders, beyond [`crate::lease::announce_after`]; it looks again while it waits.
const ANNOUNCE_GRACE: Duration = Duration::from_millis(100);

/// [`Enclosing`], waited for a moment while an enclosing exec may not have announced its lease.
pub fn enclosing(root: &Root) -> Enclosing {
    let until = std::time::Instant::now() + crate::lease::announce_after() + ANNOUNCE_GRACE;
    loop {
        let e = enclosing_now(root);
        if !e.unannounced || std::time::Instant::now() >= until {
            return e;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// [`Enclosing`] as the leases say it now. An enclosing exec may announce its lease late only
/// where this root is on a shared filesystem (on a local one it is made before any lock).
pub fn enclosing_now(root: &Root) -> Enclosing {
    let late = root.filesystem().is_some_and(|f| !f.local);
    let chain = chain_of(std::process::id());
    let leases = root.leases();
    let locks = root.locks();
    let here = |p: u32| late && works_here(p, &locks);
    let Ok(named) = std::env::var(crate::env::EXEC_LEASES) else {
        // No word from the environment (cleared on the way, or none): our ancestors' leases.
        let mut out = ancestors(&leases, &chain, &here);
        out.holds.extend(inherited(&locks));
        return out;
    };
    let mut out = Enclosing::default();
    for name in named
        .split(':')
        .filter(|n| !n.is_empty() && !crate::lease::is_mine(n))
    {
        // A probe that fails counts as alive: nothing is taken for dead on no evidence.
        let alive = crate::lease::alive(&leases, name).unwrap_or(true);
        let id = alive
            .then(|| crate::lease::identity(&leases, name))
            .flatten();
        if let Some(id) = id.filter(|id| id.since.is_some()) {
            if encloses(name, &id, &chain) {
                out.holds.extend(held(id));
            }
            continue;
        }
        // Missing or unwritten: its maker, if our ancestor still and an exec of this root, may
        // announce it yet.
        out.unannounced |= crate::lease::maker_here(name)
            .and_then(|p| u32::try_from(p).ok())
            .is_some_and(|p| chain[1..].contains(&p) && here(p));
    }
    out.holds.extend(inherited(&locks));
    out
}

/// The locks of this root held through descriptors we were started with (an enclosing command's,
/// whatever our environment says): by device and inode, so the root may be reached by any path.
fn inherited(locks: &Path) -> Vec<Holding> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    for (link, id, mode) in crate::kernel::inherited_flocks() {
        let link = link.to_string_lossy();
        // Any "/locks/" in the link may be the root's, overlapping ones too: a root named `locks`
        // makes ".../locks/locks/images/...", where the root's is the second.
        let rel = link
            .match_indices('/')
            .filter_map(|(at, _)| link[at..].strip_prefix("/locks/"))
            .find(|rel| {
                !rel.contains("..")
                    && std::fs::symlink_metadata(locks.join(rel))
                        .is_ok_and(|m| (m.dev(), m.ino()) == id)
            });
        if let Some(rel) = rel {
            let mut h = Holding::now(mode, rel.to_owned(), false, "");
            // No lease says how: an exclusive hold of a ready image is an exclusive read, as a
            // writer records `writing` before its command starts.
            h.reading = mode == Mode::Exclusive && rel.starts_with("images/") && ready(locks, rel);
            out.push(h);
        }
    }
    out
}

/// Whether the record in the lock file `rel` says ready, read without its lock (two slots make
/// that safe).
fn ready(locks: &Path, rel: &str) -> bool {
    let Ok(Some(file)) = crate::lock::open_existing_read(&locks.join(rel)) else {
        return false;
    };
    crate::image_record::read(&file).is_ok_and(|seen| {
        seen.record
            .is_some_and(|r| r.state == crate::image_record::State::Ready)
    })
}

/// Whether the live lease `name` the environment names is of an exec that runs us. An environment
/// can be saved and restored by any process (`export -p`, a CI step's): where the lease's pid means
/// a process to us, its owner must be our ancestor, holding the lease (a double fork's orphan stays
/// under `--no-inherit`'s keeper, a subreaper; without one, it has the inherited descriptors, which
/// tell). Elsewhere (a container in another pid namespace inside the exec, another host) the
/// environment's word is all we have.
fn encloses(name: &str, id: &Identity, chain: &[u32]) -> bool {
    !id.pid_numbered_as_ours()
        || (id.pid.is_some_and(|p| chain[1..].contains(&p)) && owns(name, id))
}

fn held(id: Identity) -> impl Iterator<Item = Holding> {
    id.holdings.into_iter().filter(|h| !h.awaits)
}

/// This process, then its ancestors ([`ancestors_of`]).
fn chain_of(pid: u32) -> Vec<u32> {
    std::iter::once(pid).chain(ancestors_of(pid)).collect()
}

/// The holds of live leases owned by our ancestors (module doc), also where descriptors were not
/// inherited (`--no-inherit`). Reads every lease: asked only when a hold would be waited for.
pub fn ancestor_holds(root: &Root) -> Vec<Holding> {
    ancestors(&root.leases(), &chain_of(std::process::id()), &|_| false).holds
}

/// [`ancestor_holds`] of `chain` (ours, then our ancestors'); unannounced where an ancestor runs
/// stowage's exec (not its keeper) with no lease written here, and `here` says it may announce one.
fn ancestors(leases: &Path, chain: &[u32], here: &dyn Fn(u32) -> bool) -> Enclosing {
    let mut out = Enclosing::default();
    if chain.len() < 2 {
        return out;
    }
    let ids: Vec<Identity> = crate::lease::listing(leases)
        .iter()
        .filter(|n| !crate::lease::is_mine(n))
        .filter_map(|n| Some((n, crate::lease::identity(leases, n)?)))
        .filter(|(_, id)| {
            id.pid_numbered_as_ours() && id.pid.is_some_and(|p| chain[1..].contains(&p))
        })
        // Its owner, not a later user of its pid (a lease outlives its owner: dead until a look
        // cleans it, or kept alive by the owner's command): the owner has its lease open.
        .filter(|(n, id)| owns(n, id))
        .filter(|(n, _)| crate::lease::alive(leases, n).unwrap_or(true))
        .map(|(_, id)| id)
        .collect();
    let written = |p: &u32| {
        ids.iter()
            .any(|id| id.pid == Some(*p) && id.since.is_some())
    };
    out.unannounced = chain[1..]
        .iter()
        .any(|p| !written(p) && here(*p) && crate::ident::runs_stowage(*p) && !is_keeper(*p));
    out.holds = ids.into_iter().flat_map(held).collect();
    out
}

/// Whether the local process at the lease's pid is its owner: it has the lease file open (as an
/// owner has until it ends), else where that cannot be told, by its start.
fn owns(name: &str, id: &Identity) -> bool {
    id.pid.is_some_and(|pid| {
        let open = id.file.and_then(|(_, ino)| has_open(pid, name, ino));
        open.unwrap_or_else(|| id.owner_is(pid) != Some(false))
    })
}

/// Whether local process `pid` has a file named `name` with inode `ino` open; `None` where that
/// cannot be told (links readable only with ptrace access, or no `ino:` in `fdinfo`).
fn has_open(pid: u32, name: &str, ino: u64) -> Option<bool> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    let mut known = true;
    for fd in fds.flatten() {
        match std::fs::read_link(fd.path()) {
            Ok(l) if l.file_name().is_some_and(|f| f == name) => {
                match fd_ino(pid, &fd.file_name().to_string_lossy()) {
                    Some(i) if i == ino => return Some(true),
                    Some(_) => {}
                    None => known = false,
                }
            }
            Ok(_) => {}
            // Closed since the listing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => known = false,
        }
    }
    known.then_some(false)
}

/// The inode of the file local process `pid` has open as descriptor `fd` (`/proc/PID/fdinfo`).
fn fd_ino(pid: u32, fd: &str) -> Option<u64> {
    let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("ino:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Whether local process `pid` may be an exec of this root: it has one of its lock files open, by
/// inode, not path (a container sees another path); where that cannot be told, it may.
fn works_here(pid: u32, locks: &Path) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return true;
    };
    for fd in fds.flatten() {
        let Ok(link) = std::fs::read_link(fd.path()) else {
            continue;
        };
        // A lock file of some root: .../locks/images/NAME.lock, .../locks/slots/CLASS/N.lock.
        let link = link.to_string_lossy();
        let Some(rel) = link
            .rfind("/locks/")
            .map(|at| &link[at + "/locks/".len()..])
        else {
            continue;
        };
        if !(rel.starts_with("images/") || rel.starts_with("slots/")) || rel.contains("..") {
            continue;
        }
        let Some(ino) = fd_ino(pid, &fd.file_name().to_string_lossy()) else {
            return true;
        };
        use std::os::unix::fs::MetadataExt;
        if std::fs::symlink_metadata(locks.join(rel)).is_ok_and(|m| m.ino() == ino) {
            return true;
        }
    }
    false
}

/// Whether the local process `pid` is stowage's `--no-inherit` keeper, which makes no lease.
fn is_keeper(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.split(|b| *b == 0).nth(1) == Some(crate::keeper::ARG.as_bytes()))
}

/// The local process `pid`'s ancestors from `/proc`, parent first, init excluded (none without it).
pub fn ancestors_of(mut pid: u32) -> Vec<u32> {
    let parents = std::iter::from_fn(|| {
        let rest = crate::ident::stat_fields(pid)?;
        pid = rest.split_whitespace().nth(1)?.parse().ok()?;
        (pid > 1).then_some(pid)
    });
    parents.take(64).collect()
}
