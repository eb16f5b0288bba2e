//! What is found where stowage keeps a file of its own: a regular file, or something planted there
//! (docs/design.md, "What is planted in the layout").
//!
//! - Opened with [`FLAGS`]: a FIFO cannot hang the open, a symlink or socket fails it, a directory
//!   cannot be opened to write, a terminal never becomes the command's.
//! - Written in place only with one name: a planted hard link would carry the write outside the
//!   root ([`check_written`]).
//! - Anything but a regular file is a [`NotAFile`] naming its path.
//! - A valid record read proves a regular file (a FIFO cannot `pread`): the `fstat`, a round trip
//!   on NFS, is spared.
//! - No symlink under the root is followed: `openat2(RESOLVE_NO_SYMLINKS)` ([`open`]), or on older
//!   kernels the parent's descriptor, checked.
//! - Nothing planted is deleted: `doctor --repair` renames it aside (`NAME.planted-TIME`).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::clock::Millis;
use crate::error::{cstr, cvt};
use crate::ident::{Hint, STOWAGE};

/// How every file under the root is opened, whatever else is asked.
pub const FLAGS: libc::c_int =
    libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;

/// What to do of a symlink in `ROOT/img`'s place, which a repair leaves (its user's, perhaps).
pub const IMG_LINK: Hint = Hint(
    "stowage never deletes through it; to keep images elsewhere use 'stowage init --images-dir DIR' on a new root",
);

/// What every refusal tells the user to do.
pub const FIX: Hint = Hint("'stowage doctor --repair' sets it aside (renamed, never deleted)");

/// A path of the layout that is not what stowage keeps there: a file that is not a regular file, or
/// a directory on the way that is not one.
#[derive(Debug)]
pub struct NotAFile {
    /// The path as the caller named it (an entry's name when opened through a directory's
    /// descriptor, until [`at`] names it in full).
    pub path: PathBuf,
    /// "a FIFO", "a symlink", …
    pub kind: &'static str,
    /// What belongs there: "a regular file" or "a directory".
    pub expected: &'static str,
}

impl std::fmt::Display for NotAFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A hard link holding an image's record is another store's lock file too, which doctor
        // reports and leaves: it says what to do.
        let (refusal, fix) = match self.kind {
            HARD_LINK => (
                "refusing to write through it",
                Hint("'stowage doctor' says what to do"),
            ),
            _ => ("refusing to use it", FIX),
        };
        let (path, kind, expected) = (self.path.display(), self.kind, self.expected);
        write!(f, "{path} is {kind}, not {expected}: {refusal}; {fix}")
    }
}

impl std::error::Error for NotAFile {}

/// What a file type (`st_mode & S_IFMT`) is called; `None` for a regular file.
pub fn kind_of_mode(mode: u32) -> Option<&'static str> {
    match mode & libc::S_IFMT {
        libc::S_IFREG => None,
        libc::S_IFIFO => Some("a FIFO"),
        libc::S_IFLNK => Some("a symlink"),
        libc::S_IFDIR => Some("a directory"),
        libc::S_IFSOCK => Some("a socket"),
        libc::S_IFCHR | libc::S_IFBLK => Some("a device"),
        _ => Some("not a regular file"),
    }
}

/// [`kind_of_mode`], "a regular file" for a regular file.
pub fn kind_name(mode: u32) -> &'static str {
    kind_of_mode(mode).unwrap_or("a regular file")
}

/// What a regular file with more than one name is called: writing through it could change a file
/// outside the root (a hard link planted for a lock file whose record was never written).
pub const HARD_LINK: &str = "a hard link (a file with other names)";

/// [`kind_of_mode`], and a regular file with other names ([`HARD_LINK`]).
pub fn kind_of(mode: u32, nlink: u64) -> Option<&'static str> {
    kind_of_mode(mode).or((nlink > 1).then_some(HARD_LINK))
}

/// What belongs where a file found to be `kind` is.
pub fn expected(kind: &str) -> &'static str {
    if kind == HARD_LINK {
        "a file of its own"
    } else {
        "a regular file"
    }
}

/// The first directory on the way to `path` that is not one (a symlink, a file, a FIFO …), for an
/// open that failed with `ELOOP` or `ENOTDIR` on the way: the component to name.
fn on_the_way(path: &Path) -> Option<(PathBuf, &'static str)> {
    let ancestors: Vec<&Path> = path.ancestors().skip(1).collect();
    ancestors.into_iter().rev().find_map(|dir| {
        let m = std::fs::symlink_metadata(dir).ok()?;
        (!m.is_dir()).then(|| (dir.to_owned(), kind_name(m.mode())))
    })
}

/// An open's failure, with a refusal for the type of the file or of a directory on the way turned
/// into [`NotAFile`] naming it; any other failure as it was (its errno kept: callers tell a missing
/// file or a read-only filesystem by it).
pub fn refused(path: &Path, e: io::Error) -> io::Error {
    if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR))
        && let Some((dir, kind)) = on_the_way(path)
    {
        return not_a_dir(&dir, kind);
    }
    // The kind is asked of the entry itself, not followed; the errno says it if that fails.
    let by_errno = match e.raw_os_error() {
        Some(libc::ELOOP) => "a symlink",
        Some(libc::EISDIR) => "a directory",
        Some(libc::ENXIO) => "a socket",
        _ => return e,
    };
    let m = std::fs::symlink_metadata(path).ok();
    not_a_file(
        path,
        m.and_then(|m| kind_of_mode(m.mode())).unwrap_or(by_errno),
    )
}

pub fn not_a_file(path: &Path, kind: &'static str) -> io::Error {
    not_a(path, kind, expected(kind))
}

/// For `path`, a directory of the layout.
pub fn not_a_dir(path: &Path, kind: &'static str) -> io::Error {
    not_a(path, kind, "a directory")
}

fn not_a(path: &Path, kind: &'static str, expected: &'static str) -> io::Error {
    io::Error::other(NotAFile {
        path: path.to_owned(),
        kind,
        expected,
    })
}

/// Opens `path`, a path under the root (whose own path is canonical), with `flags` added to
/// [`FLAGS`], refusing a symlink in any component. A path through `/proc/self/fd/N` (a directory
/// pinned by its descriptor) is opened as it is. Failures as [`refused`] says them.
pub fn open(path: &Path, flags: libc::c_int, mode: u32) -> io::Result<File> {
    let c = cstr(path.as_os_str())?;
    // With O_PATH, openat2 refuses flags that only I/O means; without I/O nothing can block either.
    let flags = if flags & libc::O_PATH != 0 {
        flags | libc::O_NOFOLLOW | libc::O_CLOEXEC
    } else {
        flags | FLAGS
    };
    let fd = if path.starts_with("/proc/self/fd") {
        // SAFETY: a valid C string; the descriptor is owned below.
        unsafe { libc::open(c.as_ptr(), flags, mode as libc::c_uint) }
    } else {
        match openat2(&c, flags, mode) {
            Some(fd) => fd,
            None => through_parent(path, flags, mode).map_err(|e| refused(path, e))?,
        }
    };
    let fd = cvt(fd).map_err(|e| refused(path, e))?;
    // SAFETY: a descriptor just returned to us and owned by nothing else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// `openat2(RESOLVE_NO_SYMLINKS)`; `None` where the kernel has it not (older than 5.6, or refused
/// by a container's seccomp profile), noted so it is not asked again.
fn openat2(path: &std::ffi::CStr, flags: libc::c_int, mode: u32) -> Option<libc::c_int> {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    static MISSING: AtomicBool = AtomicBool::new(false);
    if MISSING.load(Relaxed) {
        return None;
    }
    // openat2 refuses a mode where no file is created.
    let mode = if flags & libc::O_CREAT != 0 { mode } else { 0 };
    // SAFETY: all-zero bytes are a valid value of this plain C struct (not built by fields: it is
    // non-exhaustive).
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    (how.flags, how.mode, how.resolve) = (flags as u64, mode.into(), libc::RESOLVE_NO_SYMLINKS);
    // SAFETY: a valid C string and a live open_how of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            libc::AT_FDCWD,
            path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    let errno = io::Error::last_os_error().raw_os_error();
    if fd < 0 && matches!(errno, Some(libc::ENOSYS | libc::EPERM)) {
        MISSING.store(true, Relaxed);
        return None;
    }
    Some(fd as libc::c_int)
}

/// Without `openat2`: the parent directory is opened (`O_PATH`), the kernel is asked where that
/// descriptor really is, and only if that is the path's own parent is the last component opened
/// through it (never following it).
fn through_parent(path: &Path, flags: libc::c_int, mode: u32) -> io::Result<libc::c_int> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    };
    let anchor = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let dir = match nix::fcntl::open(parent, anchor, Mode::empty()) {
        Ok(dir) => dir,
        // Missing behind a link is a link on the way, as openat2 says it.
        Err(Errno::ENOENT) if on_the_way(path).is_some() => return Err(Errno::ELOOP.into()),
        Err(e) => return Err(e.into()),
    };
    let real = std::fs::read_link(format!("/proc/self/fd/{}", dir.as_raw_fd()))?;
    if real != parent {
        // A link on the way (refused() names it).
        return Err(io::Error::from_raw_os_error(libc::ELOOP));
    }
    let (flags, mode) = (OFlag::from_bits_retain(flags), Mode::from_bits_retain(mode));
    Ok(nix::fcntl::openat(&dir, name, flags, mode)?.into_raw_fd())
}

/// For a file we may not open: its mode was taken (an owner's `chmod`, or planted so), or a flag
/// refuses it or its directory, and what to do. `None` if the directory's mode refuses us.
pub fn denied(path: &Path) -> Option<String> {
    let wx = nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK;
    let dir = path.parent()?;
    match nix::unistd::access(dir, wx) {
        Ok(()) => {}
        Err(Errno::EPERM) => {
            let dir = dir.display();
            return Some(format!(
                "{dir} may not be written: it is immutable ('chattr -i' clears it), or a policy refuses it"
            ));
        }
        Err(Errno::EROFS) => {
            let dir = dir.display();
            return Some(format!(
                "{dir} is on a read-only mount: stowage writes in it (remount it read-write, or use a --root on a writable filesystem)"
            ));
        }
        Err(_) => return None,
    }
    let m = std::fs::symlink_metadata(path).ok()?;
    let (shown, mode) = (path.display(), m.mode() & 0o7777);
    // Refused although the mode allows it (or refused to root): a flag, not the mode.
    let rw = nix::unistd::AccessFlags::R_OK | nix::unistd::AccessFlags::W_OK;
    let asked = nix::unistd::access(path, rw);
    // Mounted read-only over the file itself (its directory is writable): no mode gives it back.
    if asked == Err(Errno::EROFS) {
        return Some(format!(
            "{shown} is on a read-only mount: stowage writes it (remount it read-write, or use a --root on a writable filesystem)"
        ));
    }
    if matches!(asked, Ok(()) | Err(Errno::EPERM)) {
        return Some(format!(
            "{shown} may not be written though its mode {mode:03o} allows it: it is immutable or append-only ('chattr -i -a' clears it), or a policy refuses it"
        ));
    }
    let uid = m.uid();
    let fix = if uid == nix::unistd::geteuid().as_raw() {
        format!("'{STOWAGE} doctor --repair' gives it back its mode")
    } else if let Some(why) = group_store_part(path, uid, m.gid()) {
        // A group store's file: its group and group write again, never world-writable.
        why
    } else {
        format!("it belongs to uid {uid}, who may 'chmod 666' it")
    };
    Some(format!(
        "{shown} is mode {mode:03o}, not readable and writable by you; {fix}"
    ))
}

/// Why a part of a group store (its root group-writable) owned by `uid`, group `gid`, keeps a
/// member out, and who fixes it: its owner's or root's repair. `None` outside a group store.
pub fn group_store_part(path: &Path, uid: u32, gid: u32) -> Option<String> {
    // The root: the nearest directory above that holds `locks` (a part's own may be wrong too).
    let mut above = path.ancestors().skip(1);
    let root = above.find(|a| a.join("locks").is_dir()).or(path.parent())?;
    let store = std::fs::metadata(root).ok()?;
    if store.mode() & 0o020 == 0 {
        return None;
    }
    let label = crate::ident::group_label;
    // A directory must be searchable by the group too, a file readable.
    let (mode, dir) =
        std::fs::symlink_metadata(path).map_or((0, false), |m| (m.mode(), m.is_dir()));
    let cause = if gid != store.gid() {
        format!(
            "its group {} is not the store's {}",
            label(gid),
            label(store.gid())
        )
    } else if mode & 0o020 == 0 {
        "it is not group-writable".to_owned()
    } else if dir && mode & 0o010 == 0 {
        "its group may not search it".to_owned()
    } else if mode & 0o040 == 0 {
        "its group may not read it".to_owned()
    } else if let Some(p) = acl_short(path, false, dir) {
        format!("its ACL gives its group only {}", rwx(p))
    } else if let Some((me, p)) = acl_short_users(path, false, dir, store.gid())
        .into_iter()
        .find(|&(u, _)| u == nix::unistd::geteuid().as_raw())
    {
        format!("its ACL gives you (uid {me}) only {}", rwx(p))
    } else {
        "it is not open to its group".to_owned()
    };
    Some(format!(
        "{cause}: its owner (uid {uid}) or root can run '{STOWAGE} doctor --repair'"
    ))
}

/// Why a user outside group `gid` may not use its group store, and what to do.
pub fn not_a_member(gid: u32) -> String {
    let (label, doc) = (
        crate::ident::group_label(gid),
        crate::error::GROUP_STORE_DOC,
    );
    format!(
        "you are not in group {label}, whose store this is: ask its owner to add you to that group ({doc})"
    )
}

/// The extended attribute holding an access ACL.
pub const ACCESS_ACL: &std::ffi::CStr = c"system.posix_acl_access";

/// The entries of the access ACL of `path` (followed if `follow`): tag, permissions (0o7: rwx),
/// id; `None` where it has none (or it cannot be read).
fn acl_entries(path: &Path, follow: bool) -> Option<Vec<(u16, u32, u32)>> {
    let c = cstr(path.as_os_str()).ok()?;
    let get = if follow {
        libc::getxattr
    } else {
        libc::lgetxattr
    };
    let mut buf = [0u8; 2048];
    // SAFETY: a C string of ours and a buffer of the length given.
    let n = unsafe {
        get(
            c.as_ptr(),
            ACCESS_ACL.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    // A version, then entries of 8 bytes: tag and permissions (u16 each), id (u32).
    let acl = buf.get(4..usize::try_from(n).ok()?)?;
    let entries = acl.chunks_exact(8).map(|e| {
        let perms = u32::from(u16::from_le_bytes([e[2], e[3]])) & 7;
        let id = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
        (u16::from_le_bytes([e[0], e[1]]), perms, id)
    });
    Some(entries.collect())
}

/// An ACL's tags: the owning group's entry, and a named user's.
const ACL_GROUP_OBJ: u16 = 4;
const ACL_USER: u16 = 2;

/// What a part needs: read and write, and search on a directory (`dir`).
fn needs(dir: bool) -> u32 {
    if dir { 7 } else { 6 }
}

/// What the access ACL of `path` (followed if `follow`) lets a group store's group do (0o7: rwx),
/// where that is less than a part needs: read and write, and search on a directory (`dir`). With
/// an ACL, the mode's group bits show the ACL's mask, not the group's due.
pub fn acl_short(path: &Path, follow: bool, dir: bool) -> Option<u32> {
    let group = acl_entries(path, follow)?
        .into_iter()
        .find(|e| e.0 == ACL_GROUP_OBJ)?;
    (group.1 & needs(dir) != needs(dir)).then_some(group.1)
}

/// The members of group `gid` the access ACL of `path` (followed if `follow`) names and gives less
/// than a part needs, with what it gives them: a named user's entry is theirs alone, so a member it
/// names is kept out whatever the group may do. An entry for a user the databases show outside the
/// group (read access given to an auditor) is theirs to keep; one they do not know may be a member.
pub fn acl_short_users(path: &Path, follow: bool, dir: bool, gid: u32) -> Vec<(u32, u32)> {
    let entries = acl_entries(path, follow).unwrap_or_default().into_iter();
    let short = entries.filter(|&e| short_member(e, dir, gid));
    short.map(|(_, perms, uid)| (uid, perms)).collect()
}

/// Whether ACL entry `(tag, perms, id)` names a (possible) member of group `gid` with less than a
/// part needs.
fn short_member((tag, perms, id): (u16, u32, u32), dir: bool, gid: u32) -> bool {
    tag == ACL_USER
        && perms & needs(dir) != needs(dir)
        && crate::ident::user_in_group(id, gid) != Some(false)
}

/// Takes the members [`acl_short_users`] finds out of the access ACL of `path` (followed: a
/// descriptor's `/proc` name), the rest kept: they get what the group gets.
pub fn drop_short_users(path: &Path, dir: bool, gid: u32) -> io::Result<()> {
    let c = cstr(path.as_os_str())?;
    let Some(entries) = acl_entries(path, true) else {
        return Ok(());
    };
    let mut acl = 2u32.to_le_bytes().to_vec();
    for (tag, perms, id) in entries {
        if short_member((tag, perms, id), dir, gid) {
            continue;
        }
        acl.extend(tag.to_le_bytes());
        acl.extend((perms as u16).to_le_bytes());
        acl.extend(id.to_le_bytes());
    }
    let (v, n) = (acl.as_ptr().cast(), acl.len());
    // SAFETY: C strings of ours; the value pointer and length describe `acl`.
    cvt(unsafe { libc::setxattr(c.as_ptr(), ACCESS_ACL.as_ptr(), v, n, 0) }).map(drop)
}

/// "r-x" for 0o5.
pub fn rwx(p: u32) -> String {
    let bit = |b: u32, c: char| if p & b != 0 { c } else { '-' };
    [bit(4, 'r'), bit(2, 'w'), bit(1, 'x')].iter().collect()
}

/// Fails unless `file` (opened from `path`) is a regular file: one `fstat`. Enough for a file that
/// is only read (or replaced by a rename).
pub fn check(path: &Path, file: &File) -> io::Result<()> {
    kind_of_mode(type_and_links(file, false)?.0).map_or(Ok(()), |kind| Err(not_a_file(path, kind)))
}

/// [`check`], and when the file was last written by the filesystem's clock (ms; `None` where not
/// told), in the same `statx`: a time no host's clock stamped.
pub fn check_dated(path: &Path, file: &File) -> io::Result<Option<Millis>> {
    let (mode, _, written) = type_and_links(file, true)?;
    kind_of_mode(mode).map_or(Ok(written), |kind| Err(not_a_file(path, kind)))
}

/// [`check_written`] and [`check_dated`] in one `statx`.
pub fn check_written_dated(path: &Path, file: &File) -> io::Result<Option<Millis>> {
    let (mode, nlink, written) = type_and_links(file, true)?;
    kind_of(mode, nlink).map_or(Ok(written), |kind| Err(not_a_file(path, kind)))
}

/// Fails unless `file` (opened from `path`) is a regular file with no other name: one `fstat`. For
/// a file written in place or chmod-ed: a second name would carry the change outside the root.
pub fn check_written(path: &Path, file: &File) -> io::Result<()> {
    let (mode, nlink, _) = type_and_links(file, false)?;
    kind_of(mode, nlink).map_or(Ok(()), |kind| Err(not_a_file(path, kind)))
}

/// An open file's type bits, link count and, if `dated`, last modification (ms, if told): one
/// `statx`, as the attributes its open fetched say where those are still valid. Only these are
/// asked: a FUSE client that read the file since has marked its access time stale, and a full
/// `fstat` would ask the filesystem's daemon again.
pub fn type_and_links(file: &File, dated: bool) -> io::Result<(u32, u64, Option<Millis>)> {
    let mask = libc::STATX_TYPE | libc::STATX_NLINK | if dated { libc::STATX_MTIME } else { 0 };
    let Some(stx) = statx(file, c"", libc::AT_EMPTY_PATH, mask)? else {
        let m = file.metadata()?;
        let ms = m.mtime().saturating_mul(1000) + m.mtime_nsec() / 1_000_000;
        return Ok((m.mode(), m.nlink(), Some(ms)));
    };
    let t = &stx.stx_mtime;
    let ms = t.tv_sec.saturating_mul(1000) + i64::from(t.tv_nsec / 1_000_000);
    let told = stx.stx_mask & libc::STATX_MTIME != 0;
    let (mode, nlink) = (u32::from(stx.stx_mode), u64::from(stx.stx_nlink));
    Ok((mode, nlink, told.then_some(ms)))
}

/// `statx` of `name` in the directory `fd` (`c""` with `AT_EMPTY_PATH`: what `fd` is open on),
/// fields `mask`: the system call itself, as in a static build libc's weak symbol can leave the
/// call jumping to address 0. `None` where there is none: a kernel before statx(2) (Linux 4.11),
/// or a sandbox that forbids it.
pub(crate) fn statx(
    fd: impl AsFd,
    name: &std::ffi::CStr,
    flags: libc::c_int,
    mask: u32,
) -> io::Result<Option<libc::statx>> {
    // SAFETY: all-zero bytes are a valid value of this plain C struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor and C string, a zeroed statx out-pointer.
    let r = unsafe {
        libc::syscall(
            libc::SYS_statx,
            fd.as_fd().as_raw_fd(),
            name.as_ptr(),
            flags,
            mask,
            &mut stx as *mut libc::statx,
        )
    };
    match cvt(r) {
        Ok(_) => Ok(Some(stx)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// [`check_written`] for what an `fstat` already said.
pub fn check_stat(path: &Path, m: &std::fs::Metadata) -> io::Result<()> {
    kind_of(m.mode(), m.nlink()).map_or(Ok(()), |kind| Err(not_a_file(path, kind)))
}

/// The [`NotAFile`] an I/O error carries, if any.
pub fn find(e: &io::Error) -> Option<&NotAFile> {
    e.get_ref()?.downcast_ref::<NotAFile>()
}

/// Names the file of a [`NotAFile`] in full: one opened through a directory's descriptor knows only
/// its entry's name. Other errors pass.
pub fn at(full: &Path, e: io::Error) -> io::Error {
    match find(&e) {
        Some(n) => not_a_file(full, n.kind),
        None => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens `path` as a file of the layout is opened to write, and checks its type.
    fn open(path: &Path) -> io::Result<File> {
        let f = super::open(path, libc::O_RDWR, 0)?;
        check(path, &f).map(|()| f)
    }

    #[test]
    fn each_kind_is_refused_without_blocking_and_named() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let link = d.path().join("link");
        std::os::unix::fs::symlink("/etc/hostname", &link).unwrap();
        let dir = d.path().join("dir");
        std::fs::create_dir(&dir).unwrap();
        let sock = d.path().join("sock");
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        for (p, kind) in [
            (&fifo, "a FIFO"),
            (&link, "a symlink"),
            (&dir, "a directory"),
            (&sock, "a socket"),
        ] {
            let e = open(p).unwrap_err();
            let n = find(&e).unwrap_or_else(|| panic!("{}: {e}", p.display()));
            assert_eq!((n.path.as_path(), n.kind), (p.as_path(), kind));
            assert!(e.to_string().contains("doctor --repair"), "{e}");
        }
        let file = d.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(open(&file).is_ok());
        let missing = open(&d.path().join("missing")).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
        assert!(find(&missing).is_none());
    }
}
