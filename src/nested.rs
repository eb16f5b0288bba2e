//! Nested calls: the holds of the `stowage exec` commands that run us.
//!
//! - Each exec appends its lease to its command's [`crate::env::EXEC_LEASES`] (outermost first).
//!   A lock a live lease named there lists is held by an enclosing command, which waits for us:
//!   waiting for it would never end.
//! - Judged by leases and the environment, never a pid or device number, so it holds across pid
//!   namespaces, on btrfs and on shared filesystems. A stale name is harmless: its lease is dead.
//! - An environment cleared on the way (`env -i`, sudo) names nothing: then the live leases of
//!   our ancestors do, where a lease's pid means the same process to us (same host, boot and pid
//!   namespace); and so does an inherited descriptor that locks a store file (`lock.rs`).
//! - Looked at only when a lock is busy or a hint asks: an uncontended exec pays nothing for it.
//! - An enclosing exec that announces its lease late (lease.rs) makes it within
//!   [`crate::lease::announce_after`] of its start, so of its command's: a lease of an ancestor
//!   missing or unwritten is waited for until then, and [`ANNOUNCE_GRACE`] more.

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

/// What the live leases of our enclosing execs list as held.
pub fn enclosing_holds(root: &Root) -> Vec<Holding> {
    let Ok(named) = std::env::var(crate::env::EXEC_LEASES) else {
        // No word from the environment (cleared on the way, or none): our ancestors' leases.
        return ancestor_holds(root);
    };
    let leases = root.leases();
    let chain = chain_of(std::process::id());
    named
        .split(':')
        .filter(|n| !n.is_empty() && !crate::lease::is_mine(n))
        .filter_map(|n| enclosing_identity(&leases, n, &chain))
        .flat_map(|id| id.holdings.into_iter().filter(|h| !h.awaits))
        .collect()
}

/// How long past the start of its command a late-announced lease is waited for, beyond
/// [`crate::lease::announce_after`]: a loaded host or a slow server delays its maker.
const ANNOUNCE_GRACE: Duration = Duration::from_secs(1);

/// What the live lease `name` (named by our environment) says, waited for while its maker, one of
/// our ancestors, may still be about to make or write it.
fn enclosing_identity(leases: &Path, name: &str, chain: &[u32]) -> Option<Identity> {
    let until = crate::lease::maker_here(name)
        .and_then(|pid| u32::try_from(pid).ok())
        .and_then(|pid| announced_by(chain, pid));
    loop {
        let alive = !matches!(
            crate::lease::probe(leases, name),
            Ok(crate::lease::Liveness::Dead)
        );
        let id = alive
            .then(|| crate::lease::identity(leases, name))
            .flatten();
        if id.as_ref().is_some_and(|id| id.since.is_some()) || !pending(until) {
            return id;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether a late-announced lease due by `until` (time since boot) may still come.
fn pending(until: Option<Duration>) -> bool {
    until.is_some_and(|u| crate::lease::boot_time() < u)
}

/// When our ancestor `maker` has made its lease if it announces it late: its command (the process
/// below it in `chain`, ours then our ancestors') started `announce_after` and the grace before.
fn announced_by(chain: &[u32], maker: u32) -> Option<Duration> {
    let at = chain.iter().position(|p| *p == maker)?;
    let command = *chain.get(at.checked_sub(1)?)?;
    let ticks = crate::ident::start_time(command)?;
    // SAFETY: sysconf reads a constant.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok()?;
    let started = Duration::from_millis(ticks.checked_mul(1000)? / hz.max(1));
    Some(started + crate::lease::announce_after() + ANNOUNCE_GRACE)
}

/// This process, then its ancestors ([`ancestors_of`]).
fn chain_of(pid: u32) -> Vec<u32> {
    std::iter::once(pid).chain(ancestors_of(pid)).collect()
}

/// How an enclosing exec holds the lock file `rel` (relative to `locks/`), if one does.
pub fn enclosing_hold(root: &Root, rel: &str) -> Option<Mode> {
    enclosing_holds(root)
        .into_iter()
        .filter(|h| h.lockfile == rel)
        .map(|h| h.mode)
        .max()
}

/// The holds of live leases owned by our ancestors, by a pid that is ours (module doc): enclosing
/// execs whose naming environment was cleared (`env -i`, sudo) and descriptors not inherited
/// (`--no-inherit`). Reads every lease: asked only when a hold would be waited for.
pub fn ancestor_holds(root: &Root) -> Vec<Holding> {
    let chain = chain_of(std::process::id());
    if chain.len() < 2 {
        return Vec::new();
    }
    let leases = root.leases();
    loop {
        let ids: Vec<Identity> = crate::lease::listing(&leases)
            .names
            .iter()
            .filter(|n| !crate::lease::is_mine(n))
            .filter_map(|n| crate::lease::identity(&leases, n))
            .filter(|id| id.pid_is_ours() && id.pid.is_some_and(|p| chain[1..].contains(&p)))
            .collect();
        // An ancestor running stowage whose lease is not written yet may announce it late.
        let written = |p: &u32| {
            ids.iter()
                .any(|id| id.pid == Some(*p) && id.since.is_some())
        };
        let awaited = chain[1..].iter().any(|p| {
            !written(p) && pending(announced_by(&chain, *p)) && crate::ident::runs_stowage(*p)
        });
        if !awaited {
            return ids
                .into_iter()
                .flat_map(|id| id.holdings.into_iter().filter(|h| !h.awaits))
                .collect();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The local process `pid`'s ancestors from `/proc`, parent first, init excluded (none without it).
pub fn ancestors_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut pid = pid;
    while out.len() < 64 {
        let Some(ppid) = crate::ident::stat_fields(pid)
            .and_then(|rest| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
        else {
            break;
        };
        if ppid <= 1 {
            break;
        }
        out.push(ppid);
        pid = ppid;
    }
    out
}

/// Whether an enclosing exec holds the store-wide lock: we run inside a store-wide command.
pub fn inside_store_wide(root: &Root) -> bool {
    enclosing_hold(root, Root::STORE_WIDE_LOCK_REL) == Some(Mode::Exclusive)
}
