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

use crate::lease::Holding;
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
    named
        .split(':')
        .filter(|n| !n.is_empty() && !crate::lease::is_mine(n))
        .filter(|n| {
            !matches!(
                crate::lease::probe(&leases, n),
                Ok(crate::lease::Liveness::Dead)
            )
        })
        .filter_map(|n| crate::lease::identity(&leases, n))
        .flat_map(|id| id.holdings.into_iter().filter(|h| !h.awaits))
        .collect()
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
    let ancestors = ancestors_of(std::process::id());
    if ancestors.is_empty() {
        return Vec::new();
    }
    let leases = root.leases();
    crate::lease::listing(&leases)
        .names
        .iter()
        .filter(|n| !crate::lease::is_mine(n))
        .filter_map(|n| crate::lease::identity(&leases, n))
        .filter(|id| id.pid_is_ours() && id.pid.is_some_and(|p| ancestors.contains(&p)))
        .flat_map(|id| id.holdings.into_iter().filter(|h| !h.awaits))
        .collect()
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
