//! A store shared by a group: the modes every part of its layout needs.
//!
//! - **A group store** is a group-writable root: every part of its layout must be group-writable
//!   and of the root's group; directories are setgid, so what is made later gets the group too.
//! - **One list of parts** ([`parts`]): the layout, lock files, gates, slot classes, leases, image
//!   directories (not the trees inside: those are the builder's), the catalog's journal.
//! - **No default ACL on its directories**: with one the kernel ignores the umask, and what a
//!   member makes in it would not be group-writable; [`repair`] removes it, [`check`] reports it.
//!   Nor an access ACL that gives the group, or a user it names, less than a part needs.
//! - **Only what is ours is fixed** ([`repair`]), each on a descriptor opened without following a
//!   link: a link planted in a part's place changes nothing outside the store. [`check`] lists and
//!   reads the parts so too: it names nothing outside the store.
//! - **An image being written is its writer's**: a copy keeps its top private (700) until done, so
//!   no member can swap a name in it. [`check`] passes over an image whose lock is held
//!   exclusively; [`repair`] changes an image's directory only under its lock, taken shared.

use crate::ident::STOWAGE;
use std::fs;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use anyhow::{Context, Result};
use nix::sys::stat::{Mode, fchmod};
use nix::unistd::{Gid, fchown};

use crate::root::Root;

/// The mode bits a group store's directories need: setgid, group rwx.
const DIR_BITS: u32 = 0o2070;
/// The mode bits a group store's files need: group read-write.
const FILE_BITS: u32 = 0o060;

/// One part of the layout whose mode or group is not what a group store needs.
#[derive(Debug, Clone)]
pub struct Wrong {
    /// Relative to the root ("" for the root itself).
    pub rel: String,
    pub dir: bool,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// A directory with a default ACL, which overrides the umask of whoever makes a part in it.
    pub default_acl: bool,
    /// What an access ACL lets the group do, where less than it needs (the mode shows its mask).
    pub acl_group: Option<u32>,
    /// Users an access ACL names and gives less than a part needs (uid, what it gives): theirs
    /// alone, whatever the group may do.
    pub acl_users: Vec<(u32, u32)>,
}

impl Wrong {
    /// "locks/images (mode 755, uid 0, group 0)"
    pub fn describe(&self) -> String {
        let rel = if self.rel.is_empty() { "." } else { &self.rel };
        let (mode, uid, gid) = (self.mode & 0o7777, self.uid, self.gid);
        let acl = if self.default_acl {
            ", default ACL"
        } else {
            ""
        };
        let access = (self.acl_group)
            .map(|p| format!(", ACL gives the group {}", crate::planted::rwx(p)))
            .unwrap_or_default();
        let users: String = (self.acl_users.iter())
            .map(|&(u, p)| format!(", ACL gives uid {u} only {}", crate::planted::rwx(p)))
            .collect();
        format!("{rel} (mode {mode:o}, uid {uid}, group {gid}{acl}{access}{users})")
    }
}

/// Whether the root at `dir` is a group store: group-writable.
pub fn is_group_store(dir: &Path) -> Option<(u32, u32)> {
    let m = fs::metadata(dir).ok()?;
    (m.mode() & 0o020 != 0).then_some((m.gid(), m.mode()))
}

/// Every part the layout may have, relative to the root, with whether it is a directory.
fn parts(root: &Root) -> Vec<(String, bool)> {
    let dirs = std::iter::once("").chain(Root::LAYOUT_DIRS);
    let files = Root::LAYOUT_FILES
        .into_iter()
        .chain(["stowage.db-journal", "locks/gc.lock"]);
    let mut out: Vec<_> = (dirs.map(|d| (d.to_owned(), true)))
        .chain(files.map(|f| (f.to_owned(), false)))
        .collect();
    for d in ["locks/images", "locks/leases", "img"] {
        for (name, is_dir) in entries(root, d) {
            // Image directories only: what is inside is the builder's.
            if is_dir == (d == "img") {
                out.push((format!("{d}/{name}"), is_dir));
            }
        }
    }
    for (class, is_dir) in entries(root, "locks/slots") {
        if is_dir {
            let rel = format!("locks/slots/{class}");
            let files = entries(root, &rel).into_iter();
            let files = files.filter(|(_, d)| !d);
            out.extend(files.map(|(n, _)| (format!("{rel}/{n}"), false)));
            out.push((rel, true));
        }
    }
    out
}

/// The part `rel` of the root, opened with `flags` through no link on the way or at its end: a
/// member's link at `img` leads the check to no directory outside the store.
fn open_part(root: &Root, rel: &str, flags: libc::c_int) -> Option<fs::File> {
    crate::planted::open(&root.dir().join(rel), flags, 0).ok()
}

/// The names in the root's directory `rel`, each with whether it is a directory (links are
/// neither, and are left out).
fn entries(root: &Root, rel: &str) -> Vec<(String, bool)> {
    let Some(dir) = open_part(root, rel, libc::O_RDONLY | libc::O_DIRECTORY) else {
        return Vec::new();
    };
    let dir = crate::dir::Dir::from(std::os::fd::OwnedFd::from(dir));
    let Ok(names) = dir.names() else {
        return Vec::new();
    };
    names
        .into_iter()
        .filter_map(|n| {
            let e = dir.stat_at(&n).ok()??;
            let file = e.mode & libc::S_IFMT == libc::S_IFREG;
            (e.is_dir() || file).then_some((n.into_string().ok()?, e.is_dir()))
        })
        .collect()
}

/// `/proc/self/fd/N` for `fd`: what it is open on, for calls that take only a path (xattrs).
fn fd_path(fd: BorrowedFd) -> std::path::PathBuf {
    format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd)).into()
}

/// The image whose directory the part `rel` is, if it is one.
fn image_of_part(rel: &str) -> Option<crate::name::ImageName> {
    crate::name::ImageName::from_encoded(rel.strip_prefix("img/")?).ok()
}

/// Whether the part `rel` is the directory of an image a writer holds: its tree is the writer's
/// meanwhile (a copy keeps its top private until done), neither to report nor to repair.
fn being_written(root: &Root, rel: &str) -> bool {
    image_of_part(rel).is_some_and(|name| {
        let look = crate::lock::look(&root.image_lock(&name), root.lock_queries());
        look.is_ok_and(|p| p == crate::lock::Probe::Exclusive)
    })
}

/// For the part `rel` that is an image's directory, its lock taken shared without waiting, to hold
/// while the directory is changed: no writer can begin meanwhile. `WouldBlock`: a writer holds it.
fn keep_writers_out(root: &Root, rel: &str) -> io::Result<Option<crate::lock::Guard>> {
    let Some(name) = image_of_part(rel) else {
        return Ok(None);
    };
    let (shared, fail) = (crate::lock::Mode::Shared, crate::lock::IfMissing::Fail);
    match crate::lock::acquire_no_wait(&root.image_lock(&name), shared, fail) {
        Ok(Some(held)) => Ok(Some(held)),
        Ok(None) => Err(io::ErrorKind::WouldBlock.into()),
        // No lock file, or something planted in its place: a writer may hold one a member
        // unlinked, unseen; its tree is left as it is until it has a record again.
        Err(e) if e.kind() == io::ErrorKind::NotFound || crate::planted::find(&e).is_some() => {
            Err(io::Error::other(
                "its image has no usable lock file, so a writer may be at work unseen: left as it is (a repair adopts a tree without a record; the next one shares it)",
            ))
        }
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("cannot lock its image: {e}"),
        )),
    }
}

/// The parts of a group store (group `gid`) that its members cannot use; an image being written is
/// passed over.
pub fn check(root: &Root, gid: u32) -> Vec<Wrong> {
    parts(root)
        .into_iter()
        .filter(|(rel, _)| !being_written(root, rel))
        .filter_map(|(rel, dir)| {
            // Missing, or not of its kind (a link; a FIFO, socket or device where a file is kept):
            // no part. Planted, it is `doctor`'s files check's.
            let part = open_part(root, &rel, libc::O_PATH)?;
            let kind = |m: &std::fs::Metadata| match dir {
                true => m.is_dir(),
                false => m.file_type().is_file(),
            };
            let m = part.metadata().ok().filter(kind)?;
            let path = fd_path(part.as_fd());
            let bits = if dir { DIR_BITS } else { FILE_BITS };
            let default_acl = dir && has_default_acl(&path);
            let acl_group = crate::planted::acl_short(&path, true, dir);
            let acl_users = crate::planted::acl_short_users(&path, true, dir, gid);
            let fine = m.mode() & bits == bits && m.gid() == gid && !default_acl;
            (!fine || acl_group.is_some() || !acl_users.is_empty()).then(|| Wrong {
                rel,
                dir,
                mode: m.mode(),
                uid: m.uid(),
                gid: m.gid(),
                default_acl,
                acl_group,
                acl_users,
            })
        })
        .collect()
}

/// The extended attribute holding a directory's default ACL.
const DEFAULT_ACL: &std::ffi::CStr = c"system.posix_acl_default";

/// Whether the directory at `path` (followed: a descriptor's `/proc` name) has a default ACL (none
/// where the filesystem keeps no ACLs).
fn has_default_acl(path: &Path) -> bool {
    let Ok(c) = crate::error::cstr(path.as_os_str()) else {
        return false;
    };
    // SAFETY: two C strings of ours; a null buffer of size 0 asks only for the value's size.
    let n = unsafe { libc::getxattr(c.as_ptr(), DEFAULT_ACL.as_ptr(), std::ptr::null_mut(), 0) };
    n >= 0
}

/// What [`repair`] did.
#[derive(Debug, Default)]
pub struct Repaired {
    pub fixed: Vec<Wrong>,
    /// Owned by someone else: only they, or root, can fix these.
    pub not_ours: Vec<Wrong>,
    pub failed: Vec<(Wrong, String)>,
}

/// Gives each wrong part the group `gid` and the bits a group store needs, where ours to change;
/// an image's directory under its lock, held shared, and left alone while a writer holds it.
pub fn repair(root: &Root, gid: u32, wrong: Vec<Wrong>) -> Repaired {
    let euid = nix::unistd::geteuid().as_raw();
    let root_mount = crate::dir::Dir::open_nofollow(root.dir()).and_then(|d| d.mount_id());
    let root_mount = root_mount.ok().flatten();
    let on_root_mount = |mount, f: fs::File, dir: bool| {
        let part = crate::dir::Dir::from(std::os::fd::OwnedFd::from(f));
        // Another filesystem mounted on a part's place or above it (a bind mount on an image
        // directory, a lock file, the leases) is not the store's: a change would reach outside.
        if part.mount_id()? != mount {
            let e = "it is on another filesystem mounted in the store, not the store's";
            return Err(io::Error::other(e));
        }
        fix_fd(part.as_fd(), dir, gid, 0)
    };
    let mut done = Repaired::default();
    for w in wrong {
        if euid != 0 && w.uid != euid {
            done.not_ours.push(w);
            continue;
        }
        let _kept_out = match keep_writers_out(root, &w.rel) {
            Ok(held) => held,
            // Begun since the check: the writer's (the next repair looks again).
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                done.failed.push((w, e.to_string()));
                continue;
            }
        };
        let flags = libc::O_RDONLY | if w.dir { libc::O_DIRECTORY } else { 0 };
        let path = root.dir().join(&w.rel);
        let opened = match crate::planted::open(&path, flags, 0) {
            // A file of ours we may not read (mode 000, the catalog's say): an O_PATH descriptor.
            Err(e) if !w.dir && e.raw_os_error() == Some(libc::EACCES) => {
                crate::planted::open(&path, libc::O_PATH, 0)
            }
            other => other,
        };
        match opened.and_then(|f| on_root_mount(root_mount, f, w.dir)) {
            Ok(()) => done.fixed.push(w),
            // Gone since it was listed (a lock file its image's remover unlinked): nothing to fix.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => done.failed.push((w, e.to_string())),
        }
    }
    done
}

/// Gives an images directory outside the root (not what is in it) what a group store's parts get,
/// through the descriptor the caller checked it by.
pub fn share_images_dir(images: &crate::dir::Dir, shown: &Path, gid: u32) -> Result<()> {
    let shown = shown.display();
    fix_fd(images.as_fd(), true, gid, 0)
        .with_context(|| format!("cannot give images directory {shown} group {gid}"))
}

/// In a group store (group `gid`), gives its external images directory `images` (at `shown`) what
/// its parts get where it lacks it: ours (or root's) to change, else refused naming who can.
pub fn images_dir_to_group(images: &crate::dir::Dir, shown: &Path, gid: u32) -> Result<()> {
    if refuse_images_dir(images, shown, gid)? {
        share_images_dir(images, shown, gid)?;
    }
    Ok(())
}

/// Refuses, naming who can repair it, a group store's external images directory that lacks what
/// its parts get and is neither ours nor are we root; says whether it lacks it.
pub fn refuse_images_dir(images: &crate::dir::Dir, shown: &Path, gid: u32) -> Result<bool> {
    let st = crate::dir::fstat(images.as_fd())?;
    let Some(lacks) = images_dir_lacks(images, &st, gid) else {
        return Ok(false);
    };
    let euid = nix::unistd::geteuid().as_raw();
    if euid != 0 && st.st_uid != euid {
        let (mode, uid) = (st.st_mode & 0o7777, st.st_uid);
        let (at, path) = (shown.display(), crate::ident::shell_path(shown));
        anyhow::bail!(
            "images directory {at} (mode {mode:o}, uid {uid}) {lacks}: its owner or root can run '{STOWAGE} init --images-dir {path}'"
        );
    }
    Ok(true)
}

/// What a group store's (group `gid`) external images directory `images`, of status `st`, lacks
/// that its parts get, if anything.
pub fn images_dir_lacks(images: &crate::dir::Dir, st: &libc::stat, gid: u32) -> Option<String> {
    let shown = &fd_path(images.as_fd());
    Some(if st.st_gid != gid {
        format!("lacks the store's group {}", group_label(gid))
    } else if st.st_mode & DIR_BITS != DIR_BITS {
        "is not setgid and group-writable".to_owned()
    } else if has_default_acl(shown) {
        "has a default ACL, which keeps what members make in it private".to_owned()
    } else if let Some(p) = crate::planted::acl_short(shown, true, true) {
        format!(
            "has an ACL that gives its group only {}",
            crate::planted::rwx(p)
        )
    } else {
        return None;
    })
}

/// Gives the file or directory behind `fd` group `gid`, the group store's bits and the mode bits
/// `more`. A file with other names (a member's hard link to a file elsewhere) is refused.
fn fix_fd(fd: BorrowedFd, dir: bool, gid: u32, more: u32) -> io::Result<()> {
    let st = crate::dir::fstat(fd)?;
    // A directory or a regular file, nothing else: a link swapped in is never chmodded through.
    let kind = if dir { libc::S_IFDIR } else { libc::S_IFREG };
    if st.st_mode & libc::S_IFMT != kind {
        return Err(io::Error::other("changed kind while being repaired"));
    }
    if !dir && st.st_nlink > 1 {
        return Err(io::Error::other(
            "it has other names (hard links), which may be outside the store",
        ));
    }
    // An O_PATH descriptor takes neither fchown nor fchmod: the same through the kernel's links.
    let by_path = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL)? & libc::O_PATH != 0;
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    if st.st_gid != gid && by_path {
        // SAFETY: a descriptor of ours and an empty C string, as AT_EMPTY_PATH asks.
        crate::error::cvt(unsafe {
            libc::fchownat(raw, c"".as_ptr(), u32::MAX, gid, libc::AT_EMPTY_PATH)
        })?;
    } else if st.st_gid != gid {
        fchown(fd, None, Some(Gid::from_raw(gid)))?;
    }
    if dir && !by_path {
        // SAFETY: a descriptor of ours and a C string.
        match crate::error::cvt(unsafe { libc::fremovexattr(raw, DEFAULT_ACL.as_ptr()) }) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENODATA | libc::ENOTSUP)) => {}
            other => drop(other?),
        }
    }
    // An access ACL shutting the group out goes: with none, the mode's group bits are the group's.
    // One that only names users short of what they need loses those: they get the group's due.
    let proc = fd_path(fd);
    if crate::planted::acl_short(&proc, true, dir).is_some() {
        let proc = crate::error::cstr(proc.as_os_str())?;
        // SAFETY: a C string of ours naming our own descriptor's file, and a C string.
        crate::error::cvt(unsafe {
            libc::removexattr(proc.as_ptr(), crate::planted::ACCESS_ACL.as_ptr())
        })?;
    } else if !crate::planted::acl_short_users(&proc, true, dir, gid).is_empty() {
        crate::planted::drop_short_users(&proc, dir, gid)?;
    }
    let bits = if dir { DIR_BITS } else { FILE_BITS };
    // Set after the chown, which clears setgid on a file (not a directory).
    let mode = (st.st_mode & 0o7777) | bits | more;
    if by_path {
        return crate::dir::chmod_o_path(raw, mode);
    }
    Ok(fchmod(fd, Mode::from_bits_retain(mode))?)
}

/// "'users' (100)", by `/etc/group`; the number alone for a group it does not name.
pub fn group_label(gid: u32) -> String {
    crate::ident::group_label(gid)
}

/// A group by name or number, as `init --group` takes it (by number if not in /etc/group).
pub fn group_id(group: &str) -> Result<u32> {
    if let Ok(n) = group.parse::<u32>() {
        return Ok(n);
    }
    // Read directly: a static binary has no NSS.
    let text = fs::read_to_string("/etc/group").unwrap_or_default();
    crate::ident::id_entries(&text)
        .find_map(|(name, gid)| (name == group).then_some(gid))
        .ok_or_else(|| {
            crate::Error::Usage(format!(
                "--group '{group}': no such group in /etc/group (give its number, e.g. from 'getent group {group}')"
            ))
            .into()
        })
}

/// Refuses, before anything is changed, to share the root at `dir` with `gid` where [`share_root`]
/// could not: only its owner (or root) may, with a group of theirs.
pub fn may_share(dir: &Path, gid: u32) -> Result<()> {
    let euid = nix::unistd::geteuid().as_raw();
    if euid == 0 {
        return Ok(());
    }
    if let Ok(m) = fs::symlink_metadata(dir)
        && m.uid() != euid
    {
        let (root, uid) = (dir.display(), m.uid());
        anyhow::bail!(
            "root {root} belongs to uid {uid}: only its owner (or root) can share it with a group"
        );
    }
    if !crate::ident::in_group(gid) {
        return Err(not_in_group(dir, gid));
    }
    Ok(())
}

fn not_in_group(dir: &Path, gid: u32) -> anyhow::Error {
    let (root, doc) = (dir.display(), crate::error::GROUP_STORE_DOC);
    let label = group_label(gid);
    anyhow::anyhow!("cannot give root {root} group {label}: you are not in that group (see {doc})")
}

/// Makes the root at `dir` a group store for `gid`: its group, group-writable, setgid, not o+w.
pub fn share_root(dir: &Path, gid: u32) -> Result<()> {
    may_share(dir, gid)?;
    let root = crate::planted::open(dir, libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .with_context(|| format!("cannot share root {}", dir.display()))?;
    fix_fd(root.as_fd(), true, gid, 0o775).map_err(|e| match e.raw_os_error() {
        Some(libc::EPERM) => not_in_group(dir, gid),
        _ => anyhow::Error::new(e).context(format!("cannot share root {}", dir.display())),
    })?;
    // Others keep reading (the default), never writing.
    let mode = root.metadata()?.mode() & 0o7777 & !0o002;
    root.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))
        .with_context(|| format!("cannot set the mode of root {}", dir.display()))
}

/// Sets the umask for a group store (the caller's without its group bits, nor its owner's: a lock
/// file its maker could not open again to write would refuse every later user); returns the
/// caller's.
pub fn open_umask() -> u32 {
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    let shared = old.bits() & !0o770;
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(shared));
    old.bits() as u32
}

/// The paths of `wrong` parts, shortened for one line: the first few, then how many more.
pub fn list(wrong: &[Wrong], max: usize) -> String {
    let mut s: Vec<String> = wrong.iter().take(max).map(Wrong::describe).collect();
    if wrong.len() > max {
        s.push(format!("and {} more", wrong.len() - max));
    }
    s.join(", ")
}
