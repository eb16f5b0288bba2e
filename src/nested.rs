//! Nested calls: finding the holds of the `stowage exec` that runs us.
//!
//! A command run by `stowage exec` may call stowage again. A wait of such a
//! nested call for a lock its enclosing exec holds would never end (the
//! enclosing exec waits for its command), so every wait first asks
//! [`enclosing_hold`]. The enclosing execs are named in [`crate::env::EXEC_PIDS`]
//! and must also be our ancestors: a name alone could be a stale variable
//! or a recycled pid.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::filesystem::filesystem;
use crate::kernel::read_table;
use crate::lock::{self, Mode};

/// The value of [`crate::env::EXEC_PIDS`] for the command of an exec with pid `me`.
pub fn exec_pids_for_command(me: u32) -> String {
    match std::env::var(crate::env::EXEC_PIDS) {
        Ok(v) if !v.is_empty() => format!("{v}:{me}"),
        _ => me.to_string(),
    }
}

/// The `stowage exec` processes that run us, directly or not: named in
/// [`crate::env::EXEC_PIDS`] and found among our ancestors (a name alone could be
/// a stale variable, or a recycled pid).
pub fn enclosing_execs() -> Vec<u32> {
    let Ok(named) = std::env::var(crate::env::EXEC_PIDS) else {
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
/// [`crate::env::EXEC_PIDS`] *and* found among our ancestors, since only an exec
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
    let execs: Vec<u32> = std::env::var(crate::env::EXEC_PIDS)
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

/// Whether one of our ancestors holds the lock on `path` exclusively, as
/// the kernel's lock table says (local filesystems): whatever it is, it
/// holds that lock while it waits for us. For `locks/store.lock`, whose
/// holder may keep it in a `--no-inherit` keeper and run us with an
/// environment scrubbed of [`crate::env::EXEC_PIDS`] (`env -i`, sudo), so
/// that [`enclosing_hold`] cannot tell.
pub fn held_exclusively_by_ancestor(path: &Path) -> bool {
    let Some(dir) = path.parent() else {
        return false;
    };
    if !filesystem(dir).is_ok_and(|f| f.local) {
        return false;
    }
    let (Ok(meta), Ok(table)) = (fs::symlink_metadata(path), read_table()) else {
        return false;
    };
    let Some(entries) = table.get(&(meta.dev(), meta.ino())) else {
        return false;
    };
    let ancestors = ancestors();
    entries.iter().any(|e| {
        !e.blocked && e.mode == Mode::Exclusive && e.pid.is_some_and(|p| ancestors.contains(&p))
    })
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
