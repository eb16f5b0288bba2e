//! Directory descriptors: how stowage moves and deletes anything.
//!
//! - Every destructive operation works from descriptors: a check on a path says nothing of its
//!   next use. A walk starts at a trusted directory opened once; below it,
//!   `openat(…, O_DIRECTORY|O_NOFOLLOW)`: a symlink where a directory should be is an error.
//! - Renames and deletions are `renameat`/`unlinkat` on those descriptors.
//! - Deleting a tree ([`Dir::remove_entry`]) unlinks symlinks, stops at any mount (bind mounts
//!   included), and holds few descriptors at any depth: far levels are reopened through `..`,
//!   which must be the directory left, so a tree moved mid-walk stops the walk.
//! - Nor does it delete a directory its caller's [`Keep`] says a store uses (a claimed images
//!   directory, a root): it stops there.
//! - The walks that copy and measure trees go the same way, at any depth, as few descriptors
//!   held; paths exist only for messages, bounded ([`Trail::show`]).

use std::ffi::{CStr, CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::resource::{Resource::RLIMIT_NOFILE, getrlimit, rlim_t, setrlimit};
use nix::sys::stat;
use nix::unistd::{AccessFlags, UnlinkatFlags};

use crate::error::{cstr, cvt, retrying};

/// Why a directory met in a tree to delete must be kept (a store uses it), if it must.
pub type Keep<'a> = &'a dyn Fn(&Dir) -> Option<String>;

#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
}

/// One entry of a directory listing ([`Dir::listing`]).
#[derive(Debug, Clone)]
pub struct DirEntry {
    pub name: OsString,
    pub ino: u64,
    /// `d_type`: `libc::DT_DIR`, `DT_REG`, …, or `DT_UNKNOWN` where the filesystem does not say.
    pub kind: u8,
}

impl From<OwnedFd> for Dir {
    /// A directory opened by other means: the caller vouches it is one.
    fn from(fd: OwnedFd) -> Dir {
        Dir { fd }
    }
}

impl AsFd for Dir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Dir {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

/// What `fstatat` says about an entry, without following it.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub dev: u64,
    pub ino: u64,
    pub mode: u32,
    pub nlink: u64,
    pub uid: u32,
    pub gid: u32,
}

impl Entry {
    pub fn is_dir(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }

    pub fn is_symlink(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFLNK
    }
}

pub fn fstat(fd: impl AsFd) -> io::Result<libc::stat> {
    Ok(nix::sys::stat::fstat(fd)?)
}

/// `chmod` of what the `O_PATH` descriptor `fd` is, by its /proc name (fchmod refuses one).
pub(crate) fn chmod_o_path(fd: std::os::fd::RawFd, mode: libc::mode_t) -> io::Result<()> {
    let proc = cstr(OsStr::new(&format!("/proc/self/fd/{fd}")))?;
    // SAFETY: a valid C string.
    cvt(unsafe { libc::chmod(proc.as_ptr(), mode) }).map(drop)
}

/// Whether a chmod of ours keeps the setgid bit of the inode `st`: the kernel clears it where the
/// caller is neither root nor in the inode's group, and only such a caller could set it again.
pub fn chmod_keeps_setgid(st: &libc::stat) -> bool {
    let gid = nix::unistd::Gid::from_raw(st.st_gid);
    st.st_mode & libc::S_ISGID == 0
        || nix::unistd::geteuid().is_root()
        || nix::unistd::getegid() == gid
        || nix::unistd::getgroups().is_ok_and(|g| g.contains(&gid))
}

const DIR_FLAGS: libc::c_int = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
const ANCHOR_FLAGS: libc::c_int = libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC;

impl Dir {
    /// Opens a directory the user named (the root, a configured images directory): symlinks in the
    /// path are followed, as the user's own choice; everything below is opened with [`Dir::sub`].
    pub fn open(path: &Path) -> io::Result<Dir> {
        Self::open_flags(path, DIR_FLAGS)
    }

    /// A second descriptor of the same open directory (`dup`: nothing is asked of a server).
    pub fn duplicate(&self) -> io::Result<Dir> {
        self.fd.try_clone().map(Dir::from)
    }

    /// A directory as an anchor for `*at()` calls only (`O_PATH`): no listing, no extended
    /// attributes — and nothing opened on a server (no OPENDIR/RELEASEDIR on a shared filesystem).
    pub fn anchor(path: &Path) -> io::Result<Dir> {
        Self::open_flags(path, ANCHOR_FLAGS)
    }

    /// [`Dir::anchor`], refusing a symlink as the last component (`ENOTDIR`).
    pub fn anchor_nofollow(path: &Path) -> io::Result<Dir> {
        Self::open_flags(path, ANCHOR_FLAGS | libc::O_NOFOLLOW)
    }

    /// [`Dir::anchor`] of the subdirectory `name`, never through a symlink.
    pub fn anchor_sub(&self, name: impl AsRef<OsStr>) -> io::Result<Dir> {
        let flags = ANCHOR_FLAGS | libc::O_NOFOLLOW;
        self.open_at(&cstr(name.as_ref())?, flags, 0).map(Dir::from)
    }

    /// Opens a directory whose last component must not be a symlink.
    pub fn open_nofollow(path: &Path) -> io::Result<Dir> {
        Self::open_flags(path, DIR_FLAGS | libc::O_NOFOLLOW)
    }

    /// Opens a directory of the layout by its path under the root (whose own path is canonical): no
    /// component may be a symlink (`planted::open`), so a link planted for `locks` leads nowhere.
    pub fn open_in_root(path: &Path) -> io::Result<Dir> {
        let f = crate::planted::open(path, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        Ok(Dir::from(OwnedFd::from(f)))
    }

    fn open_flags(path: &Path, flags: libc::c_int) -> io::Result<Dir> {
        let fd = nix::fcntl::open(path, OFlag::from_bits_retain(flags), stat::Mode::empty())?;
        Ok(Dir::from(fd))
    }

    /// Opens the subdirectory `name`, refusing a symlink (ELOOP) or other non-directory (ENOTDIR).
    pub fn sub(&self, name: impl AsRef<OsStr>) -> io::Result<Dir> {
        let flags = DIR_FLAGS | libc::O_NOFOLLOW;
        self.open_at(&cstr(name.as_ref())?, flags, 0).map(Dir::from)
    }

    /// `openat` of `name` here, the descriptor owned (`mode` counts only where a file is created).
    pub(crate) fn open_at(
        &self,
        name: &CStr,
        flags: libc::c_int,
        mode: u32,
    ) -> io::Result<OwnedFd> {
        let mode = stat::Mode::from_bits_retain(mode);
        Ok(openat(self, name, OFlag::from_bits_retain(flags), mode)?)
    }

    pub fn stat(&self) -> io::Result<Entry> {
        Ok(entry(&fstat(self)?))
    }

    /// The directory above this one through `..`, which must be `id` (device, inode), the one a
    /// walk came down from: else the tree moved under the walk (being `what`), which stops.
    pub fn parent_checked(&self, id: (u64, u64), what: &str) -> io::Result<Dir> {
        let up = self.sub("..")?;
        let st = fstat(&up)?;
        if (st.st_dev, st.st_ino) != id {
            return Err(io::Error::other(format!(
                "the tree was moved while being {what}; stopped"
            )));
        }
        Ok(up)
    }

    /// Every field of `name`'s lstat, for the walks that copy and measure trees.
    pub fn lstat_at(&self, name: &CStr) -> io::Result<libc::stat> {
        Ok(stat::fstatat(&self.fd, name, AtFlags::AT_SYMLINK_NOFOLLOW)?)
    }

    /// The id of the mount this directory is on, where the kernel says (Linux 5.8+; else `None`).
    /// Unlike the device number it tells a bind mount of the same filesystem apart. A failed look
    /// is an error, never "another mount": a walk would leave a whole subtree out.
    pub fn mount_id(&self) -> io::Result<Option<u64>> {
        self.mount_id_of(c"", libc::AT_EMPTY_PATH)
    }

    /// The mount id of the entry `name`, not followed (`None` where the kernel does not tell it).
    pub fn mount_id_at(&self, name: impl AsRef<OsStr>) -> io::Result<Option<u64>> {
        let name = cstr(name.as_ref())?;
        self.mount_id_of(&name, libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT)
    }

    fn mount_id_of(&self, name: &CStr, flags: libc::c_int) -> io::Result<Option<u64>> {
        let stx = crate::planted::statx(self, name, flags, libc::STATX_MNT_ID)?;
        Ok(stx
            .filter(|s| s.stx_mask & libc::STATX_MNT_ID != 0)
            .map(|s| s.stx_mnt_id))
    }

    /// Whether the entry `name` is on another mount than this directory ([`another_mount`]);
    /// `None` if it is not there.
    pub fn is_mount_at(&self, name: impl AsRef<OsStr>) -> io::Result<Option<bool>> {
        let name = name.as_ref();
        let Some(there) = self.stat_at(name)? else {
            return Ok(None);
        };
        let here = (&self.stat()?, self.mount_id()?);
        Ok(Some(another_mount(here, (&there, self.mount_id_at(name)?))))
    }

    /// Whether this directory is the root of a mount (`..` is on another device or mount).
    pub fn is_mount_root(&self) -> io::Result<bool> {
        let up = self.sub("..")?;
        Ok(up.stat()?.dev != self.stat()?.dev || up.mount_id()? != self.mount_id()?)
    }

    /// The entry `name`, not followed; `None` if there is none.
    pub fn stat_at(&self, name: impl AsRef<OsStr>) -> io::Result<Option<Entry>> {
        match self.lstat_at(&cstr(name.as_ref())?) {
            Ok(st) => Ok(Some(entry(&st))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether this directory was deleted: no link left, or its handle stale, or dead to a listing.
    /// A client may cache the link count (GlusterFS keeps 2 for a second, then says ESTALE); the
    /// kernel marks a directory removed on this host dead at once, whatever the filesystem.
    pub fn deleted(&self) -> bool {
        let gone = |e: &io::Error| matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESTALE));
        match self.stat() {
            Ok(st) if st.nlink == 0 => return true,
            Err(e) => return gone(&e),
            Ok(_) => {}
        }
        self.getdents(&mut [0u8; 1024]).is_err_and(|e| gone(&e))
    }

    /// `getdents64` into `buf` (the system call: glibc's wrapper is recent); 0 at the end.
    fn getdents(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: a live buffer of the length given.
        let n = retrying(|| unsafe {
            libc::syscall(
                libc::SYS_getdents64,
                self.as_raw_fd(),
                buf.as_mut_ptr(),
                buf.len(),
            )
        });
        n.map(|n| n as usize)
    }

    /// The names in the directory (without `.` and `..`), by `getdents64` on this very descriptor:
    /// `opendir` would cost three more calls, each a round trip on NFS. Only this uses the offset.
    pub fn names(&self) -> io::Result<Vec<OsString>> {
        Ok(self.listing()?.into_iter().map(|e| e.name).collect())
    }

    /// [`Dir::names`] as C strings, for `*at()` calls.
    pub fn entries(&self) -> io::Result<Vec<CString>> {
        let names = self.names()?.into_iter();
        Ok(names
            .filter_map(|n| CString::new(n.into_vec()).ok())
            .collect())
    }

    /// [`Dir::names`] with each entry's inode and type as the directory gives them (no stat).
    pub fn listing(&self) -> io::Result<Vec<DirEntry>> {
        nix::unistd::lseek(self, 0, nix::unistd::Whence::SeekSet)?;
        let mut buf = vec![0u8; 32 * 1024];
        let mut out = Vec::new();
        loop {
            let n = match self.getdents(&mut buf) {
                // Removed meanwhile (by another removal): the end, as readdir(3) has it.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(out),
                Ok(0) => return Ok(out),
                n => n?,
            };
            let mut at = 0usize;
            while at < n {
                // struct linux_dirent64 { u64 d_ino; i64 d_off;
                // u16 d_reclen; u8 d_type; char d_name[]; }
                let reclen = u16::from_ne_bytes([buf[at + 16], buf[at + 17]]) as usize;
                if reclen < 20 || at + reclen > n {
                    return Err(io::Error::other("a malformed directory entry"));
                }
                let name = &buf[at + 19..at + reclen];
                let name = &name[..name.iter().position(|b| *b == 0).unwrap_or(name.len())];
                if name != b"." && name != b".." {
                    let ino = buf[at..at + 8].try_into().expect("reclen >= 20");
                    out.push(DirEntry {
                        name: OsStr::from_bytes(name).to_owned(),
                        ino: u64::from_ne_bytes(ino),
                        kind: buf[at + 18],
                    });
                }
                at += reclen;
            }
        }
    }

    /// Creates the subdirectory `name` (mode before umask).
    pub fn mkdir(&self, name: impl AsRef<OsStr>, mode: u32) -> io::Result<()> {
        let mode = stat::Mode::from_bits_retain(mode as libc::mode_t);
        Ok(stat::mkdirat(&self.fd, name.as_ref(), mode)?)
    }

    /// Moves `name` to `to/to_name` (a symlink moves as a link).
    pub fn rename_to(
        &self,
        name: impl AsRef<OsStr>,
        to: &Dir,
        to_name: impl AsRef<OsStr>,
    ) -> io::Result<()> {
        let (a, b) = (name.as_ref(), to_name.as_ref());
        Ok(nix::fcntl::renameat(&self.fd, a, &to.fd, b)?)
    }

    /// [`Dir::rename_to`] for a directory moved to another parent, which needs write permission
    /// on it (its `..` changes): refused so, one of ours without owner write (an image's `/` of mode
    /// 555) gets it through an `O_PATH|O_NOFOLLOW` descriptor and the move is tried again; its mode
    /// is put back if that fails too.
    pub fn move_dir_to(
        &self,
        name: impl AsRef<OsStr>,
        to: &Dir,
        to_name: impl AsRef<OsStr>,
    ) -> io::Result<()> {
        let (name, to_name) = (name.as_ref(), to_name.as_ref());
        let refused = match self.rename_to(name, to, to_name) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) => e,
            other => return other,
        };
        let Some(lent) = self.lend_owner(name, 0o200) else {
            return Err(refused);
        };
        let moved = self.rename_to(name, to, to_name);
        if moved.is_err() {
            lent.give_back();
        }
        moved
    }

    /// Lends owner permission `bits` to the directory `name`, one of ours that lacks some of them
    /// (an image's `/` of mode 555), through an `O_PATH|O_NOFOLLOW` descriptor (the owner may chmod
    /// what it may not write); `None` if not ours or not lent.
    pub fn lend_owner(&self, name: impl AsRef<OsStr>, bits: libc::mode_t) -> Option<Loan> {
        let top = self.anchor_sub(name).ok()?;
        let st = top.stat().ok()?;
        let mode = (st.mode & 0o7777) as libc::mode_t;
        if st.uid != me() || mode & bits == bits {
            return None;
        }
        chmod_o_path(top.as_raw_fd(), mode | bits).ok()?;
        Some(Loan { top, mode })
    }

    /// Renames `name` aside here as `NAME.WHY-TIME` (`-N` added while taken), never over an
    /// entry: nothing is followed or deleted. Returns the new name; `name` gone is `NotFound`.
    pub fn set_aside(&self, name: &str, why: &str) -> io::Result<String> {
        let stamp = crate::clock::rfc3339(crate::clock::now_ms())
            .unwrap_or_default()
            .replace(':', "");
        for n in 0..100 {
            let aside = match n {
                0 => format!("{name}.{why}-{stamp}"),
                n => format!("{name}.{why}-{stamp}-{n}"),
            };
            match self.rename_new(name, &aside) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                other => return other.map(|()| aside),
            }
        }
        Err(io::Error::other(
            "too many set aside already under that name",
        ))
    }

    /// `renameat2(RENAME_NOREPLACE)` here; where the filesystem cannot, a look first.
    fn rename_new(&self, name: &str, to_name: &str) -> io::Result<()> {
        let a = cstr(name.as_ref())?;
        let b = cstr(to_name.as_ref())?;
        let fd = self.fd.as_raw_fd();
        // SAFETY: valid C strings and descriptor; a raw syscall (older libcs lack the wrapper).
        let r = unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                fd,
                a.as_ptr(),
                fd,
                b.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        match cvt(r) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {}
            other => return other.map(drop),
        }
        if self.stat_at(to_name)?.is_some() {
            return Err(io::ErrorKind::AlreadyExists.into());
        }
        self.rename_to(name, self, to_name)
    }

    /// Sets the mode of the regular file `name` through an `O_PATH|O_NOFOLLOW` descriptor of it: a
    /// symlink swapped in after a look is refused, not followed.
    pub fn chmod_at(&self, name: &str, mode: u32) -> io::Result<()> {
        let flags = libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        let file = std::fs::File::from(self.open_at(&cstr(name.as_ref())?, flags, 0)?);
        crate::planted::check_written(Path::new(name), &file)?;
        chmod_o_path(file.as_raw_fd(), mode as libc::mode_t)
    }

    /// Makes `to_name` a second link to `name` here: `AlreadyExists` if taken (an atomic create).
    pub fn link_to(&self, name: impl AsRef<OsStr>, to_name: impl AsRef<OsStr>) -> io::Result<()> {
        let (a, b) = (name.as_ref(), to_name.as_ref());
        Ok(nix::unistd::linkat(self, a, self, b, AtFlags::empty())?)
    }

    /// Opens `name` for writing (created, never through a symlink) and closes it: what inotify
    /// watchers see (`IN_CLOSE_WRITE`). A FIFO planted there fails the open (`ENXIO`), no block.
    pub fn touch_closed(&self, name: impl AsRef<OsStr>) -> io::Result<()> {
        let flags = libc::O_WRONLY | libc::O_CREAT | crate::planted::FLAGS;
        self.open_at(&cstr(name.as_ref())?, flags, 0o666).map(drop)
    }

    /// Opens the regular file `name` read-write (made if `create`, mode 0666 before umask), never
    /// through a symlink or blocking on a FIFO; anything else is a `planted::NotAFile`.
    pub fn open_rw(&self, name: impl AsRef<OsStr>, create: bool) -> io::Result<std::fs::File> {
        let flags = libc::O_RDWR
            | crate::planted::FLAGS
            | crate::lock::write_through_flag()
            | if create { libc::O_CREAT } else { 0 };
        let f = self.open_flags_at(name.as_ref(), flags)?;
        crate::planted::check_written(Path::new(name.as_ref()), &f)?;
        Ok(f)
    }

    /// `INO@FSTYPE[@FSID]`: inode, statfs magic (hex) and `f_fsid` where not 0 (NFS gives none).
    /// Not the device number, which NFS numbers anew at each mount; the fsid tells apart two
    /// filesystems of one type whose roots share an inode (every ext4's is 2).
    pub fn identity(&self) -> io::Result<String> {
        self.identity_of(self.stat()?.ino)
    }

    /// [`Dir::identity`] of this directory, whose inode `ino` is already known.
    pub fn identity_of(&self, ino: u64) -> io::Result<String> {
        let fs = nix::sys::statfs::fstatfs(&self.fd)?;
        let magic = fs.filesystem_type().0 as u64;
        let id = format!("{ino}@{magic:x}");
        Ok(
            match (statvfs_fsid(&fs), self.uuid_where_fsid_is_the_device(magic)) {
                (0, _) => id,
                (fsid, None) => format!("{id}@{fsid:x}"),
                (fsid, Some(uuid)) => format!("{id}@{fsid:x}@{uuid}"),
            },
        )
    }

    /// The filesystem's UUID where its `f_fsid` is its device number (XFS), which changes when
    /// disks come up in another order: the UUID tells it the same across boots.
    fn uuid_where_fsid_is_the_device(&self, magic: u64) -> Option<String> {
        const XFS_MAGIC: u64 = 0x5846_5342;
        // FS_IOC_GETFSUUID (Linux 6.5): _IOR(0x15, 0, struct fsuuid2 { u8 len; u8 uuid[16]; }).
        const FS_IOC_GETFSUUID: libc::c_ulong = 0x8011_1500;
        if magic != XFS_MAGIC {
            return None;
        }
        let mut u = [0u8; 17];
        // SAFETY: a live buffer of the size the request encodes.
        let ask = |fd: i32, u: &mut [u8; 17]| unsafe {
            libc::ioctl(fd, FS_IOC_GETFSUUID as _, u.as_mut_ptr())
        };
        let mut r = ask(self.fd.as_raw_fd(), &mut u);
        // A descriptor opened only to name the directory (`O_PATH`) takes no ioctl.
        if r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EBADF) {
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
            let d = openat(&self.fd, ".", flags, stat::Mode::empty()).ok()?;
            r = ask(d.as_raw_fd(), &mut u);
        }
        let len = usize::from(u[0]).min(16);
        (r == 0 && len > 0).then(|| u[1..=len].iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Opens the regular file `name` read-only, as [`Dir::open_rw`] does (one `fstat`).
    pub fn open_read(&self, name: impl AsRef<OsStr>) -> io::Result<std::fs::File> {
        let f = self.open_read_unchecked(name.as_ref())?;
        crate::planted::check(Path::new(name.as_ref()), &f)?;
        Ok(f)
    }

    /// [`Dir::open_read`] without its `fstat` (a round trip), for a caller whose read proves a
    /// regular file when it finds what it expects, and that asks `planted::check` only if not.
    pub fn open_read_unchecked(&self, name: impl AsRef<OsStr>) -> io::Result<std::fs::File> {
        self.open_flags_at(name.as_ref(), libc::O_RDONLY | crate::planted::FLAGS)
    }

    /// Creates the file `name`, which must not exist (mode before umask).
    pub fn create_file(&self, name: impl AsRef<OsStr>, mode: u32) -> io::Result<std::fs::File> {
        let flags =
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        self.open_at(&cstr(name.as_ref())?, flags, mode)
            .map(std::fs::File::from)
    }

    /// Opens the file `name` (mode 0666 where made); a refusal for its type is said as
    /// [`crate::planted::refused`] says it, told by `fstatat` (no path is built).
    fn open_flags_at(&self, name: &OsStr, flags: libc::c_int) -> io::Result<std::fs::File> {
        let e = match cstr(name).and_then(|c| self.open_at(&c, flags, 0o666)) {
            Ok(fd) => return Ok(fd.into()),
            Err(e) => e,
        };
        let typed = matches!(
            e.raw_os_error(),
            Some(libc::ELOOP | libc::EISDIR | libc::ENXIO)
        );
        if typed
            && let Ok(Some(st)) = self.stat_at(name)
            && let Some(kind) = crate::planted::kind_of_mode(st.mode)
        {
            return Err(crate::planted::not_a_file(Path::new(name), kind));
        }
        Err(e)
    }

    /// Unlinks a non-directory entry. A missing entry is not an error.
    pub fn unlink(&self, name: impl AsRef<OsStr>) -> io::Result<()> {
        self.unlinkat(name.as_ref(), UnlinkatFlags::NoRemoveDir)
    }

    fn unlinkat(&self, name: &OsStr, flags: UnlinkatFlags) -> io::Result<()> {
        match nix::unistd::unlinkat(&self.fd, name, flags) {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes the directory `name` if empty; a missing one is no error.
    pub fn rmdir(&self, name: impl AsRef<OsStr>) -> io::Result<()> {
        self.unlinkat(name.as_ref(), UnlinkatFlags::RemoveDir)
    }

    /// Unlinks `name` only while it is the file `(dev, ino)` (a lock we hold), not a replacement.
    pub fn unlink_if(&self, name: impl AsRef<OsStr>, dev: u64, ino: u64) -> io::Result<()> {
        match self.stat_at(name.as_ref())? {
            Some(e) if e.dev == dev && e.ino == ino && !e.is_dir() => self.unlink(name),
            _ => Ok(()),
        }
    }

    /// Deletes the entry `name` whatever it is: a tree is emptied and removed (see the module doc),
    /// anything else unlinked. A missing entry is not an error. `removed` counts what was deleted or
    /// lent owner access (a change too), so a caller can tell a failure before anything changed from
    /// one half-way.
    pub fn remove_entry(
        &self,
        name: impl AsRef<OsStr>,
        removed: &mut u64,
        keep: Keep,
    ) -> io::Result<()> {
        let name = name.as_ref();
        let shown = || "the directory".to_owned();
        let in_dir = |e| explain_refusal(e, &[(self, None, DELETE_IN, "the directory holding it")]);
        let Some(top) = self.open_to_empty(name, None, removed, &in_dir, &shown)? else {
            return Ok(());
        };
        // The walk checks for mounts below the top; one at the top itself is caught here.
        let (here, there) = (self.stat()?, top.stat()?);
        if another_mount((&here, self.mount_id()?), (&there, top.mount_id()?)) {
            return Err(mount_point(name));
        }
        empty_tree(top, removed, keep)?;
        self.unlinkat(name, UnlinkatFlags::RemoveDir).map_err(|e| {
            explain_refusal(e, &[(self, None, DELETE_IN, "the directory holding it")])
        })?;
        *removed += 1;
        Ok(())
    }

    /// The directory `name`, opened to be emptied; anything else there is unlinked and `None`
    /// returned, as for an entry gone. A directory on another device than `dev` (if given) is a
    /// mount point. `in_dir` explains a step refused here, `shown` names `name` for a refused open.
    fn open_to_empty(
        &self,
        name: &OsStr,
        dev: Option<(u64, Option<u64>)>,
        removed: &mut u64,
        in_dir: &dyn Fn(io::Error) -> io::Error,
        shown: &dyn Fn() -> String,
    ) -> io::Result<Option<Dir>> {
        let Some(st) = self.stat_at(name).map_err(in_dir)? else {
            return Ok(None);
        };
        let unlink = |removed: &mut u64| {
            self.unlink(name).map_err(in_dir)?;
            *removed += 1;
            Ok(None)
        };
        if !st.is_dir() {
            return unlink(removed);
        }
        // Asked before it is opened (an automount point is not triggered): on another device, a
        // mount, unless its mount id (asked without automounting) says it is a btrfs subvolume.
        if let Some((dev, mount)) = dev
            && st.dev != dev
            && (mount.is_none() || self.mount_id_at(name).ok().flatten() != mount)
        {
            return Err(mount_point(name));
        }
        let opened = match self.sub(name) {
            // A directory of ours we may not search (a build can leave one mode 000) first gets
            // owner access through an `O_PATH|O_NOFOLLOW` descriptor.
            Err(e) if e.raw_os_error() == Some(libc::EACCES) => (|| {
                let path = self.anchor_sub(name)?;
                let st = path.stat()?;
                chmod_o_path(path.as_raw_fd(), ((st.mode & 0o7777) | 0o700) as _).map_err(|_| e)?;
                *removed += 1;
                self.sub(name)
            })(),
            other => other,
        };
        match opened {
            Ok(d) => Ok(Some(d)),
            // Replaced by a non-directory since the stat: unlink that.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                unlink(removed)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(explain_refusal(e, &[(self, Some(name), LIST, &shown())])),
        }
    }

    /// The owner of this directory (or of its subdirectory `name`) if it lacks `access` for us and
    /// is not ours: who refused a step that needed that access.
    fn refuser(&self, name: Option<&OsStr>, access: libc::c_int) -> Option<u32> {
        let st = match name {
            Some(n) => self.stat_at(n).ok()??,
            None => self.stat().ok()?,
        };
        let path = name.unwrap_or(OsStr::new("."));
        let flags = AtFlags::AT_EACCESS | AtFlags::AT_SYMLINK_NOFOLLOW;
        let r = nix::unistd::faccessat(self, path, AccessFlags::from_bits_retain(access), flags);
        // Only EACCES names a refuser; other failures (a sandbox forbidding faccessat2) do not.
        let refused = r == Err(Errno::EACCES);
        (st.is_dir() && refused && st.uid != me()).then_some(st.uid)
    }
}

/// Owner permission lent to a directory by [`Dir::lend_owner`]: its mode to give back.
pub struct Loan {
    top: Dir,
    mode: libc::mode_t,
}

impl Loan {
    /// Puts the directory's mode back as it was.
    pub fn give_back(self) {
        let _ = chmod_o_path(self.top.as_raw_fd(), self.mode);
    }
}

fn mount_point(name: &OsStr) -> io::Error {
    io::Error::other(format!(
        "{} is a mount point; unmount it first (nothing is deleted across a mount)",
        Path::new(name).display()
    ))
}

fn entry(st: &libc::stat) -> Entry {
    Entry {
        dev: st.st_dev,
        ino: st.st_ino,
        mode: st.st_mode,
        nlink: st.st_nlink,
        uid: st.st_uid,
        gid: st.st_gid,
    }
}

/// Levels of a walk that keep their descriptors open (the deepest); the others are closed, and
/// reopened through `..` ([`Dir::parent_checked`]) on the way back: a walk holds few at any depth.
pub const OPEN_LEVELS: usize = 16;

/// How often a directory is relisted while entries keep appearing in it (a process still writing).
const RELISTS: u32 = 8;

struct Level {
    dir: Option<Dir>,
    /// Device and inode of this directory, to recognise it through `..`.
    id: (u64, u64),
    /// Its name in its parent.
    name: OsString,
    pending: Vec<OsString>,
    relisted: u32,
}

/// Empties the tree `top` (left for the caller to remove), with at most [`OPEN_LEVELS`] open.
fn empty_tree(top: Dir, removed: &mut u64, keep: Keep) -> io::Result<()> {
    let st = top.stat()?;
    let mount = top.mount_id()?;
    let shown = || "the directory".to_owned();
    let mut stack = vec![Level::enter(top, &st, &shown, keep, removed)?];
    loop {
        crate::signals::check().map_err(|e| io::Error::new(io::ErrorKind::Interrupted, e))?;
        let depth = stack.len();
        let level = stack.last_mut().expect("the walk ends when the stack does");
        let Some(name) = level.pending.pop() else {
            match level.found_more() {
                Ok(true) => {}
                Ok(false) if depth == 1 => return Ok(()),
                Ok(false) => climb_out(&mut stack, removed)?,
                Err(e) => return Err(refused_here(&stack, e, LIST, None)),
            }
            continue;
        };
        if let Some(sub) = remove_or_open(&stack, name, (st.dev, mount), removed, keep)? {
            stack.push(sub);
            // Only the last few levels keep their descriptor (the open ones are the top ones).
            if let Some(i) = stack.len().checked_sub(OPEN_LEVELS + 1) {
                stack[i].dir = None;
            }
        }
    }
}

impl Level {
    /// The directory `dir` (its stat `st`; `shown` names it), made writable and listed: a level to
    /// empty, its name in its parent still to be set.
    fn enter(
        dir: Dir,
        st: &Entry,
        shown: &dyn Fn() -> String,
        keep: Keep,
        removed: &mut u64,
    ) -> io::Result<Level> {
        if let Some(why) = keep(&dir) {
            let shown = shown();
            return Err(io::Error::other(format!(
                "{shown} is {why}: not deleted; move it out"
            )));
        }
        // A read-only directory inside an image gets owner access; a failure shows in the unlinks.
        // A change to the tree as much as an unlink: counted.
        if st.mode & 0o700 != 0o700 {
            let mode = stat::Mode::from_bits_retain((st.mode & 0o7777) | 0o700);
            *removed += u64::from(stat::fchmod(&dir, mode).is_ok());
        }
        let pending = dir
            .names()
            .map_err(|e| explain_refusal(e, &[(&dir, None, LIST, &shown())]))?;
        Ok(Level {
            dir: Some(dir),
            id: (st.dev, st.ino),
            name: OsString::new(),
            pending,
            relisted: 0,
        })
    }

    /// Whether the emptied level has entries after all (something appeared meanwhile: it is looked
    /// at again, a bounded number of times); they are pending then.
    fn found_more(&mut self) -> io::Result<bool> {
        let dir = self.dir.as_ref().expect("the current level is open");
        let again = dir.names()?;
        if again.is_empty() {
            return Ok(false);
        }
        self.relisted += 1;
        if self.relisted > RELISTS {
            return Err(io::Error::from_raw_os_error(libc::ENOTEMPTY));
        }
        self.pending = again;
        Ok(true)
    }
}

/// The access a removal's steps need: to delete in a directory, to list one, to move one elsewhere.
pub const DELETE_IN: libc::c_int = libc::W_OK | libc::X_OK;
pub const LIST: libc::c_int = libc::R_OK | libc::X_OK;
pub const MOVE: libc::c_int = libc::W_OK;

/// A permission error of a step of a removal, said with the directory that refused it: for EACCES,
/// the first of `suspects` (a directory, or its subdirectory `name`; the access the step needed of
/// it; how it is named) that lacks that access and is not ours, with its owner — in a store shared
/// by a group, only a directory's owner (or root) can empty or move it; for EPERM, a sticky
/// directory not ours that the step deleted in. Any other error (an immutable file) is kept as is.
pub fn explain_refusal(
    e: io::Error,
    suspects: &[(&Dir, Option<&OsStr>, libc::c_int, &str)],
) -> io::Error {
    for (dir, name, access, shown) in suspects {
        let why = match e.raw_os_error() {
            Some(libc::EACCES) => dir.refuser(*name, *access).map(|owner| {
                format!("{shown} is uid {owner}'s, and only that user or root can empty or move it")
            }),
            // A sticky directory not ours.
            Some(libc::EPERM) if name.is_none() && *access == DELETE_IN => dir
                .stat()
                .ok()
                .filter(|st| st.mode & libc::S_ISVTX != 0 && st.uid != me())
                .map(|st| {
                    let owner = st.uid;
                    format!("{shown} is sticky and uid {owner}'s: only an entry's owner, that user or root may delete in it")
                }),
            // Read-only for everyone, root too: a read-only btrfs subvolume (a snapshot `-r`), or a
            // read-only mount.
            Some(libc::EROFS) => Some(format!("{shown} is read-only: a read-only btrfs subvolume ('btrfs property set -ts DIR ro false' makes it writable) or a read-only mount")),
            _ => None,
        };
        if let Some(why) = why {
            return io::Error::new(e.kind(), format!("{e}: {why}"));
        }
    }
    e
}

fn me() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// The path from a walk's top to its current level (the top itself: empty).
fn trail(stack: &[Level]) -> std::path::PathBuf {
    stack.iter().skip(1).map(|l| l.name.as_os_str()).collect()
}

/// An error's name for directory `rel` under a walk's top: quoted, escaped, a long one by its end.
fn shown(rel: &Path) -> String {
    if rel.as_os_str().is_empty() {
        return "the directory".to_owned();
    }
    let quoted = format!("{rel:?}");
    let n = quoted.chars().count();
    if n <= 200 {
        return format!("directory {quoted} in it");
    }
    let tail: String = quoted.chars().skip(n - 200).collect();
    format!("directory \"…{tail} in it")
}

/// Removes the emptied level on top of `stack` from its parent.
fn climb_out(stack: &mut Vec<Level>, removed: &mut u64) -> io::Result<()> {
    let done = stack.pop().expect("depth > 1");
    let parent = stack.last_mut().expect("depth > 1");
    if parent.dir.is_none() {
        let done = done.dir.as_ref().expect("open");
        parent.dir = Some(done.parent_checked(parent.id, "deleted")?);
    }
    drop(done.dir);
    let pdir = parent.dir.as_ref().expect("reopened above");
    match pdir.unlinkat(&done.name, UnlinkatFlags::RemoveDir) {
        Ok(()) => *removed += 1,
        Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => {
            // Written to after we emptied it: go through it again (a bounded number of times).
            parent.relisted += 1;
            if parent.relisted > RELISTS {
                return Err(e);
            }
            parent.pending.push(done.name);
        }
        Err(e) => return Err(refused_here(stack, e, DELETE_IN, Some(&done.name))),
    }
    Ok(())
}

/// `e`, a step refused in the walk's current level (on its entry `name`), explained
/// ([`explain_refusal`]); an EPERM it leaves unexplained names the entry and the likely cause.
fn refused_here(
    stack: &[Level],
    e: io::Error,
    access: libc::c_int,
    name: Option<&OsStr>,
) -> io::Error {
    let dir = stack.last().and_then(|l| l.dir.as_ref()).expect("open");
    let e = explain_refusal(e, &[(dir, None, access, &shown(&trail(stack)))]);
    match (e.raw_os_error(), name) {
        (Some(libc::EPERM), Some(name)) => io::Error::new(
            e.kind(),
            format!(
                "{e}: {:?} in it, or the directory holding it, is immutable or append-only ('lsattr -d' shows it, 'chattr -i' or 'chattr -a' clears it)",
                trail(stack).join(name)
            ),
        ),
        _ => e,
    }
}

/// Removes the entry `name` of the walk's current level, or opens it if a directory (not a mount
/// point): the next level to empty. A refused step names its directory (its path made only then).
fn remove_or_open(
    stack: &[Level],
    name: OsString,
    (dev, mount): (u64, Option<u64>),
    removed: &mut u64,
    keep: Keep,
) -> io::Result<Option<Level>> {
    let dir = stack.last().and_then(|l| l.dir.as_ref()).expect("open");
    let there = || shown(&trail(stack).join(&name));
    let in_dir = |e| refused_here(stack, e, DELETE_IN, Some(&name));
    let Some(sub) = dir.open_to_empty(&name, Some((dev, mount)), removed, &in_dir, &there)? else {
        return Ok(None);
    };
    let sst = sub.stat()?;
    if mount.is_none() && sst.dev != dev || mount.is_some() && sub.mount_id()? != mount {
        return Err(mount_point(trail(stack).join(&name).as_os_str()));
    }
    let mut level = Level::enter(sub, &sst, &there, keep, removed)?;
    level.name = name;
    Ok(Some(level))
}

/// Whether two directories (their stat and mount id) are on different mounts: by mount id where
/// the kernel tells both (a btrfs subvolume has a device of its own on its parent's mount), else
/// by device.
fn another_mount((a, a_mount): (&Entry, Option<u64>), (b, b_mount): (&Entry, Option<u64>)) -> bool {
    match (a_mount, b_mount) {
        (Some(x), Some(y)) => x != y,
        _ => a.dev != b.dev,
    }
}

pub fn file_type(st: &libc::stat) -> libc::mode_t {
    st.st_mode & libc::S_IFMT
}

/// The names from the top of a walk to where it is, for messages only.
#[derive(Debug, Default, Clone)]
pub struct Trail(pub Vec<CString>);

/// How much of a path a message shows: both ends of a deeper one.
const SHOWN: usize = 160;

impl Trail {
    /// `top/a/b/name`, or for a path longer than a line
    /// `top/a/b/…(2400 more bytes, depth 1200)…/y/name`.
    pub fn show(&self, top: &Path, name: Option<&CStr>) -> String {
        let names = self.0.iter().map(CString::as_c_str).chain(name);
        let names = names.map(|c| String::from_utf8_lossy(c.to_bytes()).into_owned());
        let top = std::iter::once(top.display().to_string());
        let parts: Vec<String> = top.chain(names).collect();
        let full = parts.join("/");
        if full.len() <= SHOWN {
            return full;
        }
        let head: String = full.chars().take(SHOWN / 3).collect();
        let skip = full.chars().count().saturating_sub(SHOWN / 2);
        let tail: String = full.chars().skip(skip).collect();
        let (more, depth) = (full.len() - head.len() - tail.len(), parts.len() - 1);
        format!("{head}…({more} more bytes, depth {depth})…{tail}")
    }
}

/// The limit on open files (soft, hard) stowage was started with, if [`raise_open_files`] raised it.
static GIVEN_OPEN_FILES: std::sync::OnceLock<(rlim_t, rlim_t)> = std::sync::OnceLock::new();

/// Raises the soft limit on open files to the hard one for the whole run, once, at start: a command
/// may hold a descriptor per image (rm, exec, gc, doctor, the listings), a walk two per open level.
/// What stowage starts gets the limit it was given ([`with_given_open_files`]).
pub fn raise_open_files() {
    let Ok((soft, hard)) = getrlimit(RLIMIT_NOFILE) else {
        return;
    };
    if soft < hard && setrlimit(RLIMIT_NOFILE, hard, hard).is_ok() {
        let _ = GIVEN_OPEN_FILES.set((soft, hard));
    }
}

/// The limit on open files stowage was given, if it raised it: what a process it starts must get.
pub fn given_open_files() -> Option<(rlim_t, rlim_t)> {
    GIVEN_OPEN_FILES.get().copied()
}

/// Runs `start` (a spawn) under the limit on open files stowage was given, which the new process
/// inherits, ours again after (no other thread opens files meanwhile) — unless a descriptor it is
/// to inherit (`inherited`) lies beyond that limit: then, as one it could not have held, it gets ours.
pub fn with_given_open_files<T>(inherited: &[RawFd], start: impl FnOnce() -> T) -> T {
    let given = given_open_files();
    let Some((soft, hard)) =
        given.filter(|(soft, _)| inherited.iter().all(|&fd| (fd as rlim_t) < *soft))
    else {
        return start();
    };
    let _ = setrlimit(RLIMIT_NOFILE, soft, hard);
    let started = start();
    let _ = setrlimit(RLIMIT_NOFILE, hard, hard);
    started
}

/// Reads the list or a value of extended attributes into a growing buffer, `size` bytes at first.
pub fn xattr_read(
    size: usize,
    mut call: impl FnMut(*mut libc::c_void, usize) -> isize,
) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; size];
    loop {
        let n = call(buf.as_mut_ptr().cast(), buf.len());
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) || buf.len() >= 1 << 24 {
            return Err(e);
        }
        // Ask for the size needed (it may have grown since), then try again with it.
        let need = cvt(call(std::ptr::null_mut(), 0))?;
        buf.resize((need as usize).max(buf.len() * 2), 0);
    }
}

/// The `f_fsid` statvfs(3) gives (64-bit glibc: statfs's two words, the second above the first),
/// from the statfs already made: identities are recorded, so they stay what they were, without a
/// second call to the server.
fn statvfs_fsid(fs: &nix::sys::statfs::Statfs) -> u64 {
    // SAFETY: `fsid_t` is `#[repr(C)]` around `[c_int; 2]` (its field is private).
    let [lo, hi]: [libc::c_int; 2] = unsafe { std::mem::transmute(fs.filesystem_id()) };
    u64::from(lo as u32) | (u64::from(hi as u32) << 32)
}

/// Whether `now` is the `recorded` identity (`INO@MAGIC[@FSID[@UUID]]`): one recorded without fs
/// id matches on inode and type; where one side lacks the UUID (recorded before it was asked, or a
/// kernel that does not tell it), on the fs id too; two with a UUID match on inode, type and UUID,
/// whatever device number the fs id says.
pub fn same_identity(recorded: &str, now: &str) -> bool {
    let (r, n): (Vec<&str>, Vec<&str>) = (recorded.split('@').collect(), now.split('@').collect());
    match (r.len(), n.len()) {
        (4, 4) if r[2] != n[2] => r[..2] == n[..2] && r[3] == n[3] && !twin_mounted(r[2], r[3]),
        (4, 4) => r == n,
        (2, 2..) => r[..] == n[..2],
        (3 | 4, 3 | 4) => r[..3] == n[..3],
        _ => recorded == now,
    }
}

/// Whether an XFS of fs id `fsid` (its device number, hex) and UUID `uuid` is mounted now: then a
/// filesystem of that UUID on another device is a block-level copy of it (a cloned disk mounted
/// with `nouuid`), not the same one renumbered. A mount there this process cannot open (another
/// user's) is not the store's, whose root it could not use: no twin; one hidden by a later mount
/// may be: a twin.
fn twin_mounted(fsid: &str, uuid: &str) -> bool {
    let Ok(x) = u64::from_str_radix(fsid, 16) else {
        return false;
    };
    // The kernel's huge_encode_dev, undone.
    let (major, minor) = (
        ((x & 0xfff00) >> 8) as u32,
        ((x & 0xff) | ((x >> 12) & 0xfff00)) as u32,
    );
    let dev = format!("{major}:{minor}");
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    table.lines().any(|line| {
        let f: Vec<&str> = line.split(' ').collect();
        let fstype = f.iter().skip_while(|&&x| x != "-").nth(1);
        if f.get(2) != Some(&dev.as_str()) || fstype != Some(&"xfs") {
            return false;
        }
        // Opened onto another filesystem, its mount point is hidden by a later mount: the XFS
        // there cannot be asked, but it is mounted, and may be the store's own disk.
        Dir::open(&crate::filesystem::unescaped(f[4])).is_ok_and(|d| {
            let hidden = d
                .stat()
                .is_ok_and(|st| st.dev != libc::makedev(major, minor));
            hidden
                || d.uuid_where_fsid_is_the_device(0x5846_5342)
                    .is_some_and(|u| u == uuid)
        })
    })
}

/// The names in directory `dir` that something is mounted on, by the mount table: known without a
/// stat of them, which would wait on a mount whose server does not answer.
pub fn mount_points_in(dir: &Path) -> std::collections::HashSet<OsString> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let points = table
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(crate::filesystem::unescaped);
    points
        .filter(|p| p.parent() == Some(dir.as_path()))
        .filter_map(|p| p.file_name().map(OsStr::to_owned))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    #[test]
    fn names_lists_every_entry_however_many_and_again() {
        let t = tempfile::tempdir().unwrap();
        // More than one getdents64 buffer of names, long and short ones.
        let mut want: Vec<OsString> = (0..3000)
            .map(|i| format!("{i:0>width$}", width = 1 + i % 200).into())
            .collect();
        for n in &want {
            std::fs::write(t.path().join(n), b"").unwrap();
        }
        std::fs::create_dir(t.path().join("sub")).unwrap();
        want.push("sub".into());
        want.sort();
        let d = Dir::open(t.path()).unwrap();
        for _ in 0..2 {
            let mut got = d.names().unwrap();
            got.sort();
            assert_eq!(got, want);
        }
        // The descriptor still serves *at() calls after a listing.
        assert!(d.stat_at("sub").unwrap().unwrap().is_dir());
        // A directory removed while open lists nothing (so says readdir(3)): another removal won.
        let sub = d.sub("sub").unwrap();
        std::fs::remove_dir(t.path().join("sub")).unwrap();
        assert!(sub.names().unwrap().is_empty());
    }

    #[test]
    fn deletes_a_tree_deeper_than_path_max_without_following_links() {
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        fs::create_dir(&victim).unwrap();
        fs::write(victim.join("keep"), "x").unwrap();
        let top = Dir::open(t.path()).unwrap();
        top.mkdir("tree", 0o755).unwrap();
        // 3000 levels of 3-byte names: a path of 12000 bytes.
        let mut d = top.sub("tree").unwrap();
        for _ in 0..3000 {
            d.mkdir("abc", 0o755).unwrap();
            d = d.sub("abc").unwrap();
        }
        d.create_file("f", 0o644).unwrap();
        nix::unistd::symlinkat(&victim, &d, "link").unwrap();
        drop(d);
        let mut removed = 0;
        top.remove_entry("tree", &mut removed, &|_| None).unwrap();
        assert!(top.stat_at("tree").unwrap().is_none());
        assert_eq!(removed, 3000 + 1 + 2);
        assert_eq!(fs::read_to_string(victim.join("keep")).unwrap(), "x");
        symlink(&victim, t.path().join("l")).unwrap();
        assert!(top.sub("l").is_err(), "a symlink is never opened as a dir");
    }

    #[test]
    fn a_deep_path_is_shown_bounded() {
        let t = Trail(vec![CString::new("d".repeat(200)).unwrap(); 40]);
        let s = t.show(Path::new("/store/img/base"), Some(c"bottom"));
        assert!(s.len() < 300, "{} bytes", s.len());
        assert!(s.starts_with("/store/img/base/"), "{s}");
        assert!(s.ends_with("/bottom"), "{s}");
        assert!(s.contains("depth 41"), "{s}");
        assert_eq!(
            Trail(vec![CString::new("a").unwrap()]).show(Path::new("/r"), None),
            "/r/a"
        );
    }

    #[test]
    fn an_identity_recorded_without_a_filesystem_id_matches_on_inode_and_type() {
        assert!(same_identity("2@ef53@abc", "2@ef53@abc"));
        assert!(!same_identity("2@ef53@abc", "2@ef53@abd"));
        assert!(same_identity("2@ef53", "2@ef53@abc"));
        assert!(!same_identity("2@ef53", "2@ef5@abc"));
        assert!(!same_identity("2@ef53", "22@ef53@abc"));
        assert!(!same_identity("2@ef53@abc", "2@ef53"));
        // A UUID where the fs id is the device number: the device may change, not the UUID.
        assert!(same_identity("128@58465342@703@aa", "128@58465342@704@aa"));
        assert!(!same_identity("128@58465342@703@aa", "128@58465342@703@bb"));
        assert!(same_identity("128@58465342@703", "128@58465342@703@aa"));
        assert!(same_identity("128@58465342@703@aa", "128@58465342@703"));
        assert!(!same_identity("128@58465342@703", "128@58465342@704@aa"));
        assert_eq!(
            crate::filesystem::unescaped(r"/m\040n\134b"),
            Path::new("/m n\\b")
        );
    }

    #[test]
    fn an_identity_has_the_fsid_statvfs_gives_on_every_mounted_filesystem() {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let mut compared = 0;
        // A FUSE or network filesystem whose server is stopped would hang the test's every call.
        let remote = ["fuse", "nfs", "cifs", "smb", "9p", "ceph", "lustre"];
        let local = |l: &&str| {
            !l.split(' ')
                .nth(2)
                .is_some_and(|t| remote.iter().any(|r| t.starts_with(r)))
        };
        for point in mounts
            .lines()
            .filter(local)
            .filter_map(|l| l.split(' ').nth(1))
        {
            let Ok(d) = Dir::anchor(Path::new(point)) else {
                continue;
            };
            let (Ok(fs), Ok(vfs)) = (
                nix::sys::statfs::fstatfs(&d.fd),
                nix::sys::statvfs::fstatvfs(&d.fd),
            ) else {
                continue;
            };
            #[allow(clippy::unnecessary_cast)]
            let want = vfs.filesystem_id() as u64;
            assert_eq!(statvfs_fsid(&fs), want, "{point}");
            compared += 1;
        }
        assert!(compared > 0, "no filesystem to compare on");
    }
}
