//! `doctor`'s look at every path where stowage keeps a file of its own: each holds a regular file
//! this user may read and write, or nothing.
//!
//! - Anything else there (FIFO, symlink, directory, socket, device, hard link) was planted:
//!   reported; `--repair` renames it aside (`NAME.planted-TIME`), never deletes or follows it (no
//!   stowage process locks it). A hard link holding an image's record (a store copied with `cp -al`)
//!   is only reported: moving it would make its image unreadable.
//! - A file of ours we may not read or write gets its mode back; another user's is reported.
//! - The catalog's files are the catalog check's (it asks [`catalog_modes`]); the layout's
//!   directories, `layout`'s.

use std::path::Path;

use crate::dir::{Dir, Entry};
use crate::root::Root;
use crate::slot_limits::Kind;

use super::Report;
use super::Verdict::{Problem, Repaired};
use crate::ident::{Hint, STOWAGE};

/// The files stowage keeps in a directory of the layout, by name.
type Wanted = fn(&str) -> bool;

pub(super) fn check(root: &Root, repair: bool, shared: bool, report: &mut Report) {
    let mut places: Vec<(String, Wanted)> = vec![
        (String::new(), |n| {
            matches!(n, crate::config::FILE | "reserve")
        }),
        (Root::LOCKS_REL.into(), |n| {
            matches!(n, "global.lock" | "store.lock" | "gc.lock" | "probe.lock")
        }),
        (Root::IMAGE_LOCKS_REL.into(), |n| {
            n.ends_with(".lock") || n.ends_with(".gate") || n.ends_with(".lend")
        }),
        ("locks/leases".into(), |n| {
            n.ends_with(".lease") && !n.starts_with('.')
        }),
    ];
    let in_class: Wanted = |n| Kind::of(n).is_some() || n == crate::slots::CHANGED;
    let classes = classes(root, repair, report).into_iter();
    places.extend(classes.map(|c| (format!("locks/slots/{c}"), in_class)));
    for (rel, wanted) in places {
        // The root's own descriptor is an anchor, not listed: "." is opened through it. A
        // directory of the layout that cannot be opened is `layout`'s.
        let dir = match rel.as_str() {
            "" => root.open().and_then(|d| Ok(d.sub(".")?)),
            _ => root.open_sub(&rel),
        };
        let Ok(dir) = dir else { continue };
        let at = root.dir().join(&rel);
        for name in dir.names().unwrap_or_default() {
            let Some(name) = name.to_str().filter(|n| wanted(n)) else {
                continue;
            };
            let Ok(Some(st)) = dir.stat_at(name) else {
                continue;
            };
            crate::debug::pause(&format!("doctor-file-stated-{name}"));
            let path = at.join(name);
            // Replaced by rename, never written in place: a second name for it is harmless.
            let conf = name == crate::config::FILE;
            let nlink = if conf { 1 } else { st.nlink };
            match crate::planted::kind_of(st.mode, nlink) {
                Some(crate::planted::HARD_LINK) if holds_a_record(&dir, name) => {
                    shared_record(&path, report)
                }
                Some(kind) => {
                    let not = crate::planted::expected(kind);
                    planted(&dir, name, &path, (kind, not), repair, report)
                }
                None => mode(&dir, &path, &st, (repair, shared), ("files", report)),
            }
        }
    }
}

/// The slot class directories in `locks/slots`; one named as a class but no directory is planted.
fn classes(root: &Root, repair: bool, report: &mut Report) -> Vec<String> {
    let Ok(slots) = root.open_sub("locks/slots") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for name in slots.names().unwrap_or_default() {
        let Some(name) = name.to_str() else { continue };
        match slots.stat_at(name) {
            Ok(Some(st)) if st.is_dir() => out.push(name.to_owned()),
            Ok(Some(st)) if crate::slots::validate_class(&name.replace('%', "/")).is_ok() => {
                let kind = crate::planted::kind_of_mode(st.mode).unwrap_or("a regular file");
                let path = root.slot_locks().join(name);
                planted(&slots, name, &path, (kind, "a directory"), repair, report);
            }
            _ => {}
        }
    }
    out
}

/// Classes whose record cannot be read (one read per class; asked of a migrated store, whose class
/// files are records): every acquirer of one is refused until it is set again. A `0.lock` that is
/// no file is reported as planted by [`check`]; a zeroed one, of a removed class, is no class; one
/// with no byte at all was emptied by an opener (`slot_limits.rs`), and only its user knows the
/// limits: the catalog keeps no copy of them to restore.
pub(super) fn class_records(root: &Root, report: &mut Report) {
    use crate::slot_limits::Class::Damaged;
    for (class, found) in crate::slots::classes(root) {
        if let crate::slot_limits::Class::Newer(n) = found {
            report.add("slots", Problem, format!("the limits of slot class '{class}' are of a later format ({n}): the store was made by a newer stowage; upgrade stowage"));
            continue;
        }
        if found == crate::slot_limits::Class::Emptied {
            let emptied = crate::slots::emptied(root, &class);
            report.add("slots", Problem, format!("{emptied} (no copy is kept to restore them from; waiting commands keep the limits they read, new ones are refused)"));
            continue;
        }
        // Read again only where `classes` found no limits: told from a file that cannot be opened.
        if found != Damaged || !matches!(crate::slots::read_class(root, &class), Ok(Damaged)) {
            continue;
        }
        let path = root
            .slot_class_dir(&class)
            .join(Kind::Normal(0).file_name());
        let shown = path.display();
        report.add("slots", Problem, format!("the limits of slot class '{class}' in {shown} are damaged: '{STOWAGE} exec --slot {class}' is refused until they are set again with '{STOWAGE} slots set {class} LIMIT'"));
    }
}

/// Whether `name` holds an image's record: only stowage writes one, so a second name for it is
/// another store's lock file (`cp -al`), not an outside file a plant would have stowage write.
fn holds_a_record(dir: &Dir, name: &str) -> bool {
    // One we may not read (another member's, mode 600) may hold one: never set aside as junk.
    let seen = match dir.open_read_unchecked(name) {
        Err(e) => {
            return name.ends_with(".lock") && e.kind() == std::io::ErrorKind::PermissionDenied;
        }
        Ok(f) => crate::image_record::read(&f),
    };
    name.ends_with(".lock") && seen.is_ok_and(|s| s.record.is_some())
}

/// A lock file whose record another name shares: left as it is even by `--repair` (set aside, its
/// image would be unreadable here). Only the user knows when nothing uses the store.
fn shared_record(path: &Path, report: &mut Report) {
    let shown = path.display();
    let p = crate::ident::shell_path(path);
    let own = crate::ident::shell_path(&crate::catalog::beside(path, ".own"));
    report.add("files", Problem, format!("{shown} is a hard link: its image's record is shared with another name (a store copied with 'cp -al'?), so the image is read but not written or removed here; while nothing uses this store, give it a file of its own: cp {p} {own} && mv {own} {p}"));
}

fn what_it_replaced(path: &Path) -> Hint {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let dir = path
        .parent()
        .and_then(|d| d.file_name())
        .and_then(|n| n.to_str())
        .unwrap_or("");
    if name.ends_with(".lock") && dir == "images" {
        Hint(" (an image's record was kept there: its tree, if any, is adopted as incomplete)")
    } else if name == "0.lock" || (dir == "slots" && !name.contains('.')) {
        Hint(" (a slot class's limits were kept there: set them again with 'stowage slots set')")
    } else if name == crate::config::FILE {
        Hint(" (the store's configuration: written anew from the images' records)")
    } else {
        Hint("")
    }
}

/// Reports (with `repair` sets aside) the `kind` planted at `path` in `dir`, where `not` belongs.
fn planted(
    dir: &Dir,
    name: &str,
    path: &Path,
    found: (&str, &str),
    repair: bool,
    report: &mut Report,
) {
    let (kind, not) = found;
    let replaced = what_it_replaced(path);
    // A hard link may be our own file given a second name ('cp -al'): the other name is wrong.
    let why = if kind == crate::planted::HARD_LINK {
        "stowage writes no file that has another name"
    } else {
        "not made by stowage"
    };
    let shown = path.display();
    if !repair {
        let fix = crate::planted::FIX;
        let detail = format!("{shown} is {kind}, not {not}: {why}{replaced}; {fix}");
        report.by_repair().add("files", Problem, detail);
        return;
    }
    // A lend file's list of lenders is the only way to their journals of loans: carried over to a
    // fresh one, whose loans the repair then restores. Read from a regular file only.
    let lenders = (name.ends_with(".lend") && kind == crate::planted::HARD_LINK)
        .then(|| dir.open_read_unchecked(name).ok())
        .flatten();
    match dir.set_aside(name, "planted") {
        Ok(aside) => {
            let aside = path.with_file_name(aside);
            let aside = aside.display();
            let detail = format!("{shown} was {kind}, not {not}: set aside as {aside}{replaced}");
            report.add("files", Repaired, detail);
            let carried = lenders.map(|from| {
                let to = dir.create_file(name, 0o666)?;
                crate::loan::carry_lenders(&from, &to)
            });
            if let Some(Err(e)) = carried {
                let detail = format!(
                    "the lenders {aside} names cannot be carried over to a new {shown}: {e}; its loans are not restored"
                );
                report.add("loans", Problem, detail);
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            let detail = format!("{shown} is {kind}, not {not}, and cannot be set aside: {e}");
            report.add("files", Problem, detail);
        }
    }
}

/// The catalog and its journal, where each is a regular file, as [`check`] judges the layout's:
/// whether one is left that this user may not read and write.
pub(super) fn catalog_modes(root: &Root, repair: bool, shared: bool, report: &mut Report) -> bool {
    let Ok(dir) = root.open().and_then(|d| Ok(d.sub(".")?)) else {
        return false;
    };
    let problems = |r: &Report| r.checks.iter().filter(|c| c.status == Problem).count();
    let before = problems(report);
    for (path, _) in crate::catalog::files(&root.db()).into_iter().take(2) {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if let Ok(Some(st)) = dir.stat_at(name)
            && crate::planted::kind_of(st.mode, st.nlink).is_none()
        {
            mode(&dir, &path, &st, (repair, shared), ("catalog", report));
        }
    }
    problems(report) > before
}

/// Reports, under `check`, a mode that keeps this user from reading and writing a layout file.
fn mode(dir: &Dir, path: &Path, st: &Entry, how: (bool, bool), to: (&'static str, &mut Report)) {
    let ((repair, shared), (check, report)) = (how, to);
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let (shown, bits, uid) = (path.display(), st.mode & 0o7777, st.uid);
    // Whether this process (its effective user) may open it read-write, by its permissions.
    let rw = nix::unistd::AccessFlags::R_OK | nix::unistd::AccessFlags::W_OK;
    match nix::unistd::faccessat(dir, name, rw, nix::fcntl::AtFlags::AT_EACCESS) {
        // Gone since it was listed (an image removed meanwhile): nothing to judge.
        Ok(()) | Err(nix::errno::Errno::ENOENT) => return,
        // No mode gives it back: a flag (or a security policy) refuses the write, or a read-only
        // mount over it.
        Err(nix::errno::Errno::EPERM | nix::errno::Errno::EROFS) => {
            let why = crate::planted::denied(path);
            let why = why.unwrap_or_else(|| format!("{shown} may not be written"));
            report.add(check, Problem, why);
            return;
        }
        Err(_) => {}
    }
    if uid != nix::unistd::geteuid().as_raw() {
        // In a group store: its group and group write, never world-writable.
        let fix = crate::planted::group_store_part(path, uid, st.gid);
        let fix = fix.unwrap_or_else(|| "they may 'chmod 666' it".to_owned());
        report.add(check, Problem, format!("{shown} (mode {bits:03o}) belongs to uid {uid}, and you may not read and write it: {fix}"));
        return;
    }
    let want = bits | 0o600 | if shared { 0o060 } else { 0 };
    if !repair {
        report.by_repair().add(check, Problem, format!("{shown} is mode {bits:03o}: you may not read and write it; '{STOWAGE} doctor --repair' makes it {want:03o}"));
        return;
    }
    let fixed = format!("{shown} was mode {bits:03o}: now {want:03o}");
    match dir.chmod_at(name, want) {
        Ok(()) => report.add(check, Repaired, fixed),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            let detail = format!("cannot give {shown} back its mode: {e}");
            report.add(check, Problem, detail);
        }
    }
}
