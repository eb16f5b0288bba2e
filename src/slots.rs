//! Slots: cross-process counting semaphores, one class per runtime or kind of heavy work (`pull`,
//! `load/podman`); files: docs/design.md, "Layout".
//!
//! - A slot is an exclusive flock: the kernel frees it when its holder dies, so no token is lost.
//! - Slots come first in the lock order (slots → images → global).
//! - Normal work takes one of the first LIMIT files; high priority a reserved one first, else a
//!   normal one: at most LIMIT + RESERVE at once. LIMIT 0 is unlimited: each holder takes the first
//!   free file, made if need be, so a limit set later counts it.
//! - Limits live in one record per class (`slot_limits.rs`), changed only under the global lock. A
//!   lowered limit never disturbs holders: they count against it until they end ([`settle`] forgets
//!   them once free).
//! - Waiters re-read the record when `slots set`/`slots rm` closes the class's `changed` file
//!   (inotify), and every few seconds where another host may change it unseen.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::dir::Dir;
use crate::error::Error;
use crate::holders::{LockKind, LockReport, Look, Party};
use crate::ident::STOWAGE;
use crate::lock::{self, Mode, Probe};
use crate::root::Root;
use crate::slot_limits::{self, Class, Kind, Limits};
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

/// Checks a class name: lowercase letters, digits, `.`, `_`, `-`, in components separated by single
/// `/`, at most 64 bytes.
pub fn validate_class(class: &str) -> Result<(), Error> {
    let shown = crate::ident::printable(class);
    let bad = |why: &str| Err(Error::Usage(format!("invalid slot class '{shown}': {why}")));
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
                "'{}' is not allowed (use lowercase letters, digits, '.', '_', '-', '/')",
                crate::ident::printable(&c.to_string())
            ));
        }
    }
    Ok(())
}

/// The files an acquirer of `priority` may take under `limits`, in the order it tries them.
pub(crate) fn candidates(dir: &Path, limits: &Limits, priority: Priority) -> Vec<PathBuf> {
    let normal = (0..limits.limit).map(|i| dir.join(Kind::Normal(i).file_name()));
    let high = (0..limits.reserve).map(|i| dir.join(Kind::High(i).file_name()));
    match priority {
        Priority::Normal => normal.collect(),
        Priority::High => high.chain(normal).collect(),
    }
}

/// Files beyond `limits` that holders of a higher limit may still hold: normal, then reserved.
pub(crate) fn beyond(dir: &Path, limits: &Limits) -> (Vec<PathBuf>, Vec<PathBuf>) {
    // A record's count past what a class counts (damaged, or written by hand) is no file.
    let most = |files: u32| files.min(slot_limits::MOST_FILES);
    let normal = (limits.limit..most(limits.files)).map(|i| dir.join(Kind::Normal(i).file_name()));
    let high =
        (limits.reserve..most(limits.high_files)).map(|i| dir.join(Kind::High(i).file_name()));
    (normal.collect(), high.collect())
}

/// The file whose close tells waiters that the class changed.
pub(crate) const CHANGED: &str = "changed";

/// Tells waiters of `class` on this host to re-read its record. Best effort.
fn notify_change(root: &Root, class: &str) {
    if let Ok(Some(dir)) = class_dir(root, class) {
        let _ = dir.touch_closed(CHANGED);
    }
}

/// The class's record, as its `0.lock` says now (read without its lock).
pub fn read_class(root: &Root, class: &str) -> Result<Class> {
    let path = root.slot_class_dir(class).join(Kind::Normal(0).file_name());
    // Through the root's descriptor: a link planted for a directory on the way is refused.
    let dir = match root.open_sub(&Root::slot_class_rel(class)) {
        Ok(d) => d,
        // No such class (or no slots directory yet).
        Err(e) if crate::root::is_missing(&e) => return Ok(Class::None),
        Err(e) => return Err(e),
    };
    match dir.open_read(Kind::Normal(0).file_name()) {
        Ok(f) => slot_limits::read(&f, class).with_context(|| {
            format!(
                "cannot read the limits of slot class '{class}' in {}",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Class::None),
        Err(e) => Err(planted_or(&path, class, e)),
    }
}

/// The error for a class file that cannot be opened, naming what is planted or the file.
fn planted_or(path: &Path, class: &str, e: std::io::Error) -> anyhow::Error {
    let e = crate::planted::at(path, e);
    if crate::planted::find(&e).is_some() {
        anyhow::anyhow!("slot class '{class}': {e}")
    } else if let Some(why) = (e.kind() == std::io::ErrorKind::PermissionDenied)
        .then(|| crate::planted::denied(path))
        .flatten()
    {
        anyhow::anyhow!("slot class '{class}': {why}")
    } else {
        anyhow::Error::new(e).context(format!("cannot open {}", path.display()))
    }
}

/// The refusal of a class whose limits a later release wrote, in format `n`.
fn newer(root: &Root, class: &str, n: u64) -> anyhow::Error {
    let what = format!("the limits of slot class '{class}', format {n}");
    Error::Newer {
        root: root.dir().to_path_buf(),
        what,
    }
    .into()
}

/// The configured classes, by their directories, with their records.
pub fn classes(root: &Root) -> Vec<(String, Class)> {
    let mut out: Vec<(String, Class)> = crate::root::names_in(&root.slot_locks())
        .into_iter()
        .map(|enc| enc.replace('%', "/"))
        .filter(|c| validate_class(c).is_ok())
        .map(|c| {
            let class = read_class(root, &c).unwrap_or(Class::Damaged);
            (c, class)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// A class among `classes` whose limits a later release wrote: that release's store, refused
/// whole by whatever lists the classes (`slots`, `lock-status`: "removed" would be untrue).
pub fn refuse_newer(root: &Root, classes: &[(String, Class)]) -> Result<()> {
    match classes.iter().find_map(|(c, k)| match k {
        Class::Newer(n) => Some((c, *n)),
        _ => None,
    }) {
        Some((class, n)) => Err(newer(root, class, n)),
        None => Ok(()),
    }
}

/// The names of the classes with limits, sorted.
pub fn configured(root: &Root) -> Vec<String> {
    let classes = classes(root).into_iter();
    classes.filter_map(|(n, c)| c.limits().map(|_| n)).collect()
}

/// The limits of `class`; an unknown class is a usage error that lists the configured ones.
pub fn lookup(root: &Root, class: &str) -> Result<Limits> {
    match read_class(root, class)? {
        Class::Limits(l) => return Ok(l),
        Class::Damaged => anyhow::bail!(
            "the limits of slot class '{class}' in {} are damaged; set them again with '{STOWAGE} slots set {class} LIMIT'",
            root.slot_class_dir(class).join("0.lock").display()
        ),
        Class::Newer(n) => return Err(newer(root, class, n)),
        Class::Emptied => anyhow::bail!("{}", emptied(root, class)),
        Class::None => {}
    }
    let known = configured(root);
    let hint = if known.is_empty() {
        format!("no slot classes are configured; add one with '{STOWAGE} slots set CLASS LIMIT'")
    } else {
        format!("configured classes: {}", known.join(", "))
    };
    Err(Error::Usage(format!("unknown slot class '{class}' ({hint})")).into())
}

/// What is said of a class whose `0.lock` was emptied (slot_limits.rs): its likely cause and cure.
pub fn emptied(root: &Root, class: &str) -> String {
    let path = root.slot_class_dir(class).join(Kind::Normal(0).file_name());
    format!(
        "slot class '{class}': its limits in {} were emptied, likely by a shell's '>' (use 'flock FILE' or '<>'); '{STOWAGE} slots set {class} LIMIT' sets them",
        path.display()
    )
}

/// Sets a class's limits under the global lock (`reserve` kept if not given): what was set.
pub fn set(store: &mut Store, class: &str, limit: u32, reserve: Option<u32>) -> Result<Limits> {
    validate_class(class)?;
    let root = store.root().clone();
    let global = store.global(None)?;
    let dir = make_class_dir(&root, class)?;
    let zero = dir
        .open_rw(Kind::Normal(0).file_name(), true)
        .map_err(|e| planted_or(&root.slot_class_dir(class).join("0.lock"), class, e))?;
    let before = match slot_limits::read(&zero, class)? {
        Class::Newer(n) => return Err(newer(&root, class, n)),
        c => c.limits(),
    };
    let kept = before.filter(|_| limit > 0).map_or(0, |b| b.reserve);
    let mut limits = Limits::set(limit, reserve.unwrap_or(kept), before);
    let write = |limits: &Limits| {
        slot_limits::write(&zero, class, Some(limits))
            .with_context(|| format!("cannot write the limits of slot class '{class}'"))
    };
    // Files beyond the record may be held: an unlimited class's holders each hold one of their
    // own, a removed class's holders keep theirs. Each counts against the new limits: listed
    // before the write (a set killed after it still counts them), and after it, as a holder
    // that took a file of its own meanwhile reads the record after its take.
    count_files(&dir, &mut limits);
    write(&limits)?;
    crate::debug::pause("slots-written");
    if count_files(&dir, &mut limits) {
        write(&limits)?;
    }
    settle(&root, class, &zero, limits);
    drop(global);
    notify_change(&root, class);
    Ok(limits)
}

/// Counts in `limits` every slot file in `dir` (listed), held or not: whether it counted more.
fn count_files(dir: &Dir, limits: &mut Limits) -> bool {
    let before = *limits;
    for name in dir.names().unwrap_or_default() {
        match name.to_str().and_then(Kind::of) {
            Some(Kind::Normal(i)) => limits.files = limits.files.max(i + 1),
            Some(Kind::High(i)) => limits.high_files = limits.high_files.max(i + 1),
            None => {}
        }
    }
    *limits != before
}

/// Forgets the files beyond a lowered limit once nobody holds them (under the global lock).
pub fn settle(root: &Root, class: &str, zero: &std::fs::File, limits: Limits) {
    if limits.settled() {
        return;
    }
    let dir = root.slot_class_dir(class);
    let (normal, high) = beyond(&dir, &limits);
    let mut held = Vec::new();
    for path in normal.iter().chain(&high) {
        match lock::acquire_no_wait(path, Mode::Exclusive, lock::IfMissing::Fail) {
            Ok(Some(g)) => held.push(g),
            Ok(None) => return,
            Err(_) => {}
        }
    }
    let settled = Limits {
        files: limits.limit,
        high_files: limits.reserve,
        ..limits
    };
    if slot_limits::write(zero, class, Some(&settled)).is_err() {
        return;
    }
    // `0.lock` carries the record (an unlimited class keeps it too).
    let first = dir.join(Kind::Normal(0).file_name());
    for g in held.into_iter().filter(|g| g.path() != first) {
        let _ = root.unlink_lock(g);
    }
}

/// Removes a class: its record goes, then every slot file nobody holds. Returns how many slots were
/// still held (their files stay until released).
pub fn remove(store: &mut Store, class: &str) -> Result<u32> {
    validate_class(class)?;
    let root = store.root().clone();
    let global = store.global(None)?;
    lookup(&root, class)?;
    let dir = root.slot_class_dir(class);
    let zero =
        lock::open_existing(&dir.join("0.lock"))?.context("the class's first slot file went")?;
    slot_limits::write(&zero, class, None)
        .with_context(|| format!("cannot remove slot class '{class}'"))?;
    drop(zero);
    notify_change(&root, class);
    let mut busy = 0;
    if let Some(d) = class_dir(&root, class)? {
        for name in d.names().unwrap_or_default() {
            let path = dir.join(&name);
            match lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Fail) {
                Ok(Some(g)) => {
                    let _ = root.unlink_lock(g);
                }
                Ok(None) => busy += 1,
                Err(_) => {}
            }
        }
        let _ = d.unlink(CHANGED);
    }
    remove_empty_class_dir(&root, class);
    drop(global);
    Ok(busy)
}

/// Removes the directory of a removed class once it is empty.
fn remove_empty_class_dir(root: &Root, class: &str) {
    let rel = Root::slot_class_rel(class);
    let (parent, name) = rel
        .rsplit_once('/')
        .expect("a class directory has a parent");
    if let Ok(d) = root.open_sub(parent) {
        let _ = d.rmdir(name);
    }
}

/// The class's directory, opened from the root's descriptor following no link; `None` if missing.
fn class_dir(root: &Root, class: &str) -> Result<Option<Dir>> {
    root.open_sub_if_there(&Root::slot_class_rel(class))
}

/// Makes (if missing) and opens the class's directory from the root's descriptor, no link followed.
pub fn make_class_dir(root: &Root, class: &str) -> Result<Dir> {
    let mut d = root.open_or_make_sub("locks")?;
    let mut at = root.locks();
    for part in Root::slot_class_rel(class).split('/').skip(1) {
        at.push(part);
        crate::root::mkdir_in(&d, part, &at)?;
        d = d.sub(part).map_err(|e| {
            if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) {
                anyhow::anyhow!(
                    "{} is a symlink or not a directory; refusing to use it",
                    at.display()
                )
            } else {
                anyhow::Error::new(e).context(format!("cannot open {}", at.display()))
            }
        })?;
    }
    Ok(d)
}

/// A class as lock-status and `slots` show it: every slot file's holders, how many, and who waits.
pub fn report(look: &Look, root: &Root, class: &str, limits: Option<Limits>) -> LockReport {
    report_of(look, root, class, limits, Priority::High)
}

/// [`report`] of the slots a waiter of `priority` may take: a normal one's leaves the reserved out.
pub fn report_of(
    look: &Look,
    root: &Root,
    class: &str,
    limits: Option<Limits>,
    priority: Priority,
) -> LockReport {
    let dir = root.slot_class_dir(class);
    let takes = |k: Kind| priority == Priority::High || matches!(k, Kind::Normal(_));
    let mut files: Vec<String> = crate::root::names_in(&dir)
        .into_iter()
        .filter(|n| Kind::of(n).is_some_and(takes))
        .collect();
    files.sort();
    let mut in_use = 0;
    let mut holders: Vec<Party> = Vec::new();
    for f in &files {
        let r = look.report(LockKind::Slot, class, &dir.join(f));
        if r.state != Probe::Free {
            in_use += 1;
        }
        holders.extend(r.holders);
    }
    let mut waiters = look.awaiting(&root.locks_rel(&dir));
    // A waiter granted a slot awaits its class in its lease until it lists the slot.
    crate::holders::listed_once(&holders, &mut waiters);
    LockReport {
        kind: LockKind::Slot,
        name: class.to_owned(),
        state: if in_use > 0 {
            Probe::Shared
        } else {
            Probe::Free
        },
        holders,
        waiters,
        queued: Vec::new(),
        image_state: None,
        image_unknown: None,
        slot: limits.map(|l| (l.limit, l.reserve, in_use)),
    }
}

/// Reports of configured classes, and of removed ones whose directory stays for a holder or waiter.
/// A class whose limits a later release wrote refuses the whole look (it would show as removed).
pub fn reports(look: &Look, root: &Root) -> Result<Vec<LockReport>> {
    let classes = classes(root);
    refuse_newer(root, &classes)?;
    let mut out = Vec::new();
    for (class, c) in classes {
        let limits = c.limits();
        let r = report(look, root, &class, limits);
        if limits.is_some() || !r.holders.is_empty() || !r.waiters.is_empty() {
            out.push(r);
        } else if class_dir(root, &class).ok().flatten().is_some() {
            // Nothing of a removed class is left in use: its files can go.
            tidy_removed(root, &class);
        }
    }
    Ok(out)
}

/// Takes away a removed class's files nobody holds, then its directory if empty, under the global
/// lock (tried) so no `slots set` makes the class anew meanwhile. Best effort.
fn tidy_removed(root: &Root, class: &str) {
    let Ok(Some(_global)) =
        lock::acquire_no_wait(&root.global_lock(), Mode::Exclusive, lock::IfMissing::Fail)
    else {
        return;
    };
    let Ok(Some(d)) = class_dir(root, class) else {
        return;
    };
    // Emptied, not removed: its files and directory stay for a `slots set` or a repair.
    if matches!(read_class(root, class), Ok(Class::Emptied) | Err(_)) {
        return;
    }
    let dir = root.slot_class_dir(class);
    for name in d.names().unwrap_or_default() {
        let Some(n) = name.to_str() else { continue };
        if n == CHANGED {
            let _ = d.unlink(CHANGED);
        } else if Kind::of(n).is_some()
            && let Ok(Some(g)) =
                lock::acquire_no_wait(&dir.join(n), Mode::Exclusive, lock::IfMissing::Fail)
            && matches!(
                slot_limits::read(g.file(), class),
                Ok(Class::None | Class::Emptied)
            )
        {
            let _ = root.unlink_lock(g);
        }
    }
    remove_empty_class_dir(root, class);
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
        let l = Limits::set(2, 1, None);
        let d = Path::new("/r");
        let names = |p| {
            candidates(d, &l, p)
                .iter()
                .map(|f| f.file_name().unwrap().to_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(Priority::Normal), ["0.lock", "1.lock"]);
        assert_eq!(names(Priority::High), ["high-0.lock", "0.lock", "1.lock"]);
    }
}
