//! Faithful copies of image trees, for `exec --write NEW --from BASE`.
//!
//! - Kept: file types, modes with setuid/setgid/sticky, owners and device nodes where permitted,
//!   times, hard links, holes, every extended attribute the target accepts. What cannot be kept is
//!   counted and reported, never silently dropped.
//! - Data: FICLONE where the filesystem can, else only data regions (SEEK_DATA, copy_file_range).
//! - The walk goes by directory descriptor ([`crate::dir`]); symlinks are copied as links.
//! - Every destination is created fresh (`O_EXCL`, `mkdirat`, `mknodat`, `symlinkat`) in the new
//!   image's empty directory, mode 700 until done. No inode is shared with the base.
//! - Attribute order: owner (clears setuid and capabilities), mode, extended attributes (an ACL
//!   rewrites the group bits), times.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{FchmodatFlags, Mode, SFlag, UtimensatFlags};
use nix::sys::stat::{fchmod, fchmodat, futimens, utimensat};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, Whence, fchown, fchownat, linkat, lseek};

use crate::dir::{self, Dir, Trail, xattr_read};
use crate::error::{cvt, retrying};
use crate::loan::{Lent, Loans};

/// What a copy did.
#[derive(Debug, Default, Clone)]
pub struct Copied {
    pub files: u64,
    pub bytes: u64,
    /// Files cloned with FICLONE (sharing extents with the base).
    pub reflinked: u64,
    /// Special files that could not be created (no permission).
    pub skipped_special: u64,
    /// Mount points inside the base, copied as empty directories.
    pub mounts_left_out: Vec<String>,
    /// The base's top-level `.git` was a git worktree's link, left out ([`worktree_link`]).
    pub worktree_link_left_out: bool,
    /// Extended attributes the target refused, by name: how many, and the first cause.
    pub xattrs_lost: BTreeMap<String, (u64, String)>,
    /// The first few refusals in full (file, attribute, cause), for -v.
    pub xattr_details: Vec<String>,
}

impl Copied {
    /// What was not kept, as "security.selinux ×3 (Operation not permitted), user.x (…)"; or None.
    pub fn xattrs_summary(&self) -> Option<String> {
        let parts: Vec<String> = self
            .xattrs_lost
            .iter()
            .map(|(name, (n, cause))| {
                let name = crate::ident::printable(name);
                match n {
                    1 => format!("{name} ({cause})"),
                    n => format!("{name} ×{n} ({cause})"),
                }
            })
            .collect();
        (!parts.is_empty()).then(|| parts.join(", "))
    }
}

/// How many refusals -v lists one by one.
const DETAILS: usize = 20;

/// A directory being copied: the source, its copy, the names left to copy.
struct Frame {
    src: Dir,
    dst: Dir,
    meta: libc::stat,
    names: std::vec::IntoIter<CString>,
    /// The source directory's own mode, while it lends us access.
    lent: Option<Lent>,
}

/// The owner bits (read, and for a directory search) that the base's inode `meta` withholds from
/// the copy of its owner, not root, who may lend them ([`crate::loan`]); 0 if none.
fn withheld(meta: &libc::stat) -> libc::mode_t {
    let euid = nix::unistd::geteuid().as_raw();
    let need = if dir::file_type(meta) == libc::S_IFDIR {
        0o500
    } else {
        0o400
    };
    if euid == 0 || meta.st_uid != euid {
        return 0;
    }
    need & !meta.st_mode
}

/// Opens `name` of `dir` (stat `meta`) with `flags`, never through a symlink. One whose mode (ours)
/// keeps the owner's read (and for a directory search) bits from us gets a loan of them through an
/// `O_PATH` descriptor of the very inode (`names` from the base's top, the lend lock held
/// exclusively), is reopened through it, and comes with the loan.
fn open_source(
    (dir, name, names): (&Dir, &CStr, &[CString]),
    meta: &libc::stat,
    flags: libc::c_int,
    loans: &mut Loans,
) -> io::Result<(OwnedFd, Option<Lent>)> {
    let need = withheld(meta);
    if need == 0 {
        let opened = dir.open_at(name, flags | libc::O_NOFOLLOW | libc::O_CLOEXEC, 0);
        // Another's: says whose it is (only they or root may copy it).
        let (mode, uid) = (meta.st_mode & 0o7777, meta.st_uid);
        let theirs = uid != nix::unistd::geteuid().as_raw();
        return opened.map(|fd| (fd, None)).map_err(|e| match e.kind() {
            io::ErrorKind::PermissionDenied if theirs => {
                let why = format!("it is mode {mode:03o} and belongs to uid {uid}, so only they or root can copy it");
                io::Error::new(e.kind(), format!("{e}: {why}"))
            }
            _ => e,
        });
    }
    let path = dir.open_at(name, libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC, 0)?;
    let now = dir::fstat(&path)?;
    if (now.st_dev, now.st_ino) != (meta.st_dev, meta.st_ino) {
        return Err(io::Error::other("changed while being copied"));
    }
    let proc = format!("/proc/self/fd/{}", path.as_raw_fd());
    let mut names = names.to_vec();
    names.push(name.to_owned());
    let lent = loans.lend(&names, path, &now, need)?;
    let flags = OFlag::from_bits_retain(flags | libc::O_CLOEXEC);
    let fd = nix::fcntl::open(proc.as_str(), flags, Mode::empty())?;
    Ok((fd, Some(lent)))
}

/// Copies the tree of `src_root` into the empty directory `dst_root`, both opened by the caller
/// from the images directory's descriptor (`src` and `dst` name them in messages), holding the
/// base's lend lock `loans`.
pub fn copy_tree_at(
    (src_root, src): (Dir, &Path),
    (dst_root, dst): (Dir, &Path),
    loans: &mut Loans,
    progress: &mut Bar,
) -> Result<Copied> {
    // A bar never shown needs no total: the base is not walked for it.
    if progress.enabled {
        // What the copy reads: the lengths of the regular files.
        let mut total = 0;
        let walked = crate::disk_usage::walk(src, &mut |_, _, st| {
            if dir::file_type(st) == libc::S_IFREG {
                total += st.st_size as u64;
            }
            Ok(())
        });
        progress.total = walked.map_or(0, |_| total);
    }
    let meta = dir::fstat(&src_root).with_context(|| format!("cannot read {}", src.display()))?;
    let mount = src_root
        .mount_id()
        .with_context(|| format!("cannot read {}", src.display()))?;
    let was = make_private(&dst_root, dst)?;
    let mut names = src_root
        .entries()
        .with_context(|| format!("cannot list {}", src.display()))?;
    let before = names.len();
    names.retain(|n| n.as_bytes() != b".git" || !worktree_link(&src_root));
    let worktree_link_left_out = names.len() < before;
    let top = Frame {
        src: src_root,
        dst: dst_root
            .sub(".")
            .with_context(|| format!("cannot open {}", dst.display()))?,
        meta,
        names: names.into_iter(),
        lent: None,
    };
    let mut copy = TreeCopy {
        src,
        dst,
        dst_root,
        dev: meta.st_dev,
        mount,
        trail: Trail::default(),
        links: HashMap::new(),
        reflink_works: true,
        // Where a client may answer from stale attributes (not a local filesystem).
        shared: !crate::filesystem::filesystem(src).is_ok_and(|f| f.local),
        out: Copied {
            worktree_link_left_out,
            ..Copied::default()
        },
        progress,
        loans,
    };
    let mut stack = vec![top];
    if let Err(e) = copy.walk(&mut stack) {
        // The directories made 700 get their mode back, so a group store's member can remove them.
        for d in stack.iter().map(|f| &f.dst).chain([&copy.dst_root]) {
            let _ = nix::sys::stat::fchmod(d, Mode::from_bits_retain(was));
        }
        // Loans end innermost first, as their journal lines are cut off.
        while stack.pop().is_some() {}
        return Err(e);
    }
    drop(copy.dst_root);
    if let Some(b) = copy.progress.bar.take() {
        b.finish_and_clear();
    }
    Ok(copy.out)
}

/// Whether the tree's top-level `.git` is a git worktree's link (a file `gitdir: …`): copied, it
/// would make the copy a second checkout claiming the base's worktree, and git (ch-image's build
/// cache) fails on it from then on. Left out, as ch-image's own copy of an image leaves it.
fn worktree_link(top: &Dir) -> bool {
    use std::os::unix::fs::FileExt as _;
    let mut head = [0u8; 7];
    // One we may not read (mode 000, not ours to lend) is a file named `.git` all the same.
    match top
        .open_read(".git")
        .and_then(|f| f.read_exact_at(&mut head, 0))
    {
        Ok(()) => &head == b"gitdir:",
        Err(e) => e.kind() == io::ErrorKind::PermissionDenied,
    }
}

/// Makes the copy's top ours alone while the copy is made; returns the mode it had. Attributes are
/// set by name, so a group store's member could otherwise swap in a link between create and chmod:
/// it must be ours and empty (a name made before may be held open by its maker).
fn make_private(top: &Dir, dst: &Path) -> Result<libc::mode_t> {
    let dst = dst.display();
    let st = dir::fstat(top).with_context(|| format!("cannot read {dst}"))?;
    let (uid, was) = (st.st_uid, st.st_mode & 0o7777);
    if uid != nix::unistd::geteuid().as_raw() {
        anyhow::bail!(
            "{dst} belongs to uid {uid}, not to you: refusing to copy into it (its owner could change names in the copy)"
        );
    }
    fchmod(top, Mode::from_bits_retain(0o700))
        .map_err(io::Error::from)
        .with_context(|| format!("cannot make {dst} private while copying"))?;
    if !top.entries().is_ok_and(|n| n.is_empty()) {
        let _ = fchmod(top, Mode::from_bits_retain(was));
        anyhow::bail!(
            "{dst} is not empty: refusing to copy into it (another user could change names in the copy)"
        );
    }
    Ok(was)
}

/// A copy under way: where it goes, what it has seen, what it did.
struct TreeCopy<'a> {
    /// The two tops, as messages name them.
    src: &'a Path,
    dst: &'a Path,
    /// The top of the copy, where hard links find their first copies.
    dst_root: Dir,
    /// The base's filesystem and mount: a directory on another is a mount point.
    dev: u64,
    mount: Option<u64>,
    /// The names from the tops down to the directory being copied.
    trail: Trail,
    /// First copy of each hard-linked inode, as names from `dst`.
    links: HashMap<(u64, u64), Vec<CString>>,
    reflink_works: bool,
    /// Files' lengths are read from their data too ([`length_read`]).
    shared: bool,
    out: Copied,
    progress: &'a mut Bar,
    loans: &'a mut Loans,
}

impl TreeCopy<'_> {
    /// Copies the tree below `top`, depth first.
    fn walk(&mut self, stack: &mut Vec<Frame>) -> Result<()> {
        while let Some(top) = stack.last_mut() {
            let Some(name) = top.names.next() else {
                // A directory gets its mode and times after its contents (read-only ones, mtimes).
                let done = stack.pop().expect("not empty");
                self.trail.0.pop();
                let lent = done.lent.is_some();
                self.attrs_fd((done.dst.as_fd(), done.src.as_fd()), None, &done.meta, lent)?;
                continue;
            };
            crate::signals::check()?;
            if let Some(sub) = self.copy_entry(top, name)? {
                stack.push(sub);
            }
        }
        Ok(())
    }

    /// Copies the entry `name` of `top`; a directory is created and returned, to be filled next.
    fn copy_entry(&mut self, top: &Frame, name: CString) -> Result<Option<Frame>> {
        let meta = top
            .src
            .lstat_at(&name)
            .with_context(|| self.cannot_copy(&name))?;
        let ft = dir::file_type(&meta);
        if ft == libc::S_IFDIR {
            return self.enter_dir(top, name, meta).map(Some);
        }
        if meta.st_nlink > 1 && self.linked_to_copy(top, &name, &meta)? {
            return Ok(None);
        }
        match ft {
            libc::S_IFLNK => self.copy_symlink(top, &name, &meta)?,
            libc::S_IFREG => self.copy_file(top, &name, &meta)?,
            _ => self.copy_special(top, &name, &meta)?,
        }
        Ok(None)
    }

    /// Creates the copy of directory `name` (mode 700 until filled) and opens both for the walk.
    fn enter_dir(&mut self, top: &Frame, name: CString, meta: libc::stat) -> Result<Frame> {
        let entry = OsStr::from_bytes(name.to_bytes());
        if withheld(&meta) != 0 {
            self.loans
                .exclusive()
                .with_context(|| self.cannot_copy(&name))?;
        }
        let opened = (|| {
            top.dst.mkdir(entry, 0o700)?;
            let flags = libc::O_RDONLY | libc::O_DIRECTORY;
            let at = (&top.src, name.as_c_str(), &self.trail.0[..]);
            let (fd, lent) = open_source(at, &meta, flags, self.loans)?;
            let (s, d) = (Dir::from(fd), top.dst.sub(entry)?);
            // A filesystem mounted inside the base is not its tree: the mount point is copied,
            // empty. A bind mount of the base's own filesystem shows only in its mount id.
            let mount =
                meta.st_dev != self.dev || (self.mount.is_some() && s.mount_id()? != self.mount);
            let names = if mount { Vec::new() } else { s.entries()? };
            io::Result::Ok((s, d, names, lent, mount))
        })();
        let (s, d, names, lent, mount) = opened.with_context(|| self.cannot_copy(&name))?;
        if mount {
            let mount = self.trail.show(self.src, Some(&name));
            self.out.mounts_left_out.push(mount);
        }
        self.trail.0.push(name);
        Ok(Frame {
            src: s,
            dst: d,
            meta,
            names: names.into_iter(),
            lent,
        })
    }

    /// For an inode with several names: a later name becomes a link to the first one's copy (true).
    fn linked_to_copy(&mut self, top: &Frame, name: &CStr, meta: &libc::stat) -> Result<bool> {
        let key = (meta.st_dev, meta.st_ino);
        if let Some(first) = self.links.get(&key) {
            link_to(&self.dst_root, first, &top.dst, name)
                .with_context(|| self.cannot_copy(name))?;
            return Ok(true);
        }
        let mut names = self.trail.0.clone();
        names.push(name.to_owned());
        self.links.insert(key, names);
        Ok(false)
    }

    fn copy_symlink(&mut self, top: &Frame, name: &CStr, meta: &libc::stat) -> Result<()> {
        nix::fcntl::readlinkat(&top.src, name)
            .and_then(|target| nix::unistd::symlinkat(target.as_os_str(), &top.dst, name))
            .map_err(io::Error::from)
            .with_context(|| self.cannot_copy(name))?;
        self.attrs_at(top, name, meta)
    }

    fn copy_file(&mut self, top: &Frame, name: &CStr, meta: &libc::stat) -> Result<()> {
        // A loan is kept until the attributes are copied: reading `user.*` needs the data's access.
        if withheld(meta) != 0 {
            self.loans
                .exclusive()
                .with_context(|| self.cannot_copy(name))?;
        }
        let opened = (|| {
            // Never blocking on a FIFO; the copy is made fresh.
            let flags = libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY;
            let at = (&top.src, name, &self.trail.0[..]);
            let (fd, lent) = open_source(at, meta, flags, self.loans)?;
            let now = dir::fstat(&fd)?;
            if dir::file_type(&now) != libc::S_IFREG || now.st_ino != meta.st_ino {
                return Err(io::Error::other("changed while being copied"));
            }
            let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
            let copy = top.dst.open_at(name, flags | libc::O_CLOEXEC, 0o600)?;
            Ok((File::from(fd), File::from(copy), lent))
        })();
        let (src_f, dst_f, lent) = opened.with_context(|| self.cannot_copy(name))?;
        let reflinked = copy_data(&src_f, &dst_f, &mut self.reflink_works, self.shared)
            .with_context(|| self.cannot_copy(name))?;
        let fds = (dst_f.as_fd(), src_f.as_fd());
        self.attrs_fd(fds, Some(name), meta, lent.is_some())?;
        let len = meta.st_size as u64;
        self.out.files += 1;
        self.out.bytes += len;
        self.out.reflinked += u64::from(reflinked);
        self.progress.advance(len);
        if self.out.files == 1 {
            crate::debug::pause("clone-copying");
        }
        Ok(())
    }

    /// A FIFO, socket or device node; one we may not make (no privilege) is counted, not copied.
    fn copy_special(&mut self, top: &Frame, name: &CStr, meta: &libc::stat) -> Result<()> {
        // The whole mode, type bits included, as mknodat(2) takes it.
        let mode = Mode::from_bits_retain(meta.st_mode);
        match nix::sys::stat::mknodat(&top.dst, name, SFlag::empty(), mode, meta.st_rdev) {
            Ok(_) => {}
            Err(Errno::EPERM) => {
                self.out.skipped_special += 1;
                // Its other names are skipped too, not linked to nothing.
                self.links.remove(&(meta.st_dev, meta.st_ino));
                return Ok(());
            }
            Err(e) => return Err(io::Error::from(e)).with_context(|| self.cannot_copy(name)),
        }
        self.attrs_at(top, name, meta)
    }

    /// Owner, mode, times and attributes of the entry `name` (not followed), from source to copy.
    fn attrs_at(&mut self, top: &Frame, name: &CStr, meta: &libc::stat) -> Result<()> {
        self.attrs(
            Target::At(&top.dst, name),
            Target::At(&top.src, name),
            Some(name),
            meta,
        )
    }

    /// [`TreeCopy::attrs`] from an open source to its open copy. A source `lent` to us shows the
    /// lent owner bits in its access ACL too, copied with it: the copy's mode is set again after
    /// (a chmod sets the ACL's owner, mask and other entries from the mode: the base's ACL).
    fn attrs_fd(
        &mut self,
        (dst, src): (BorrowedFd, BorrowedFd),
        name: Option<&CStr>,
        meta: &libc::stat,
        lent: bool,
    ) -> Result<()> {
        self.attrs(Target::Fd(dst), Target::Fd(src), name, meta)?;
        if lent {
            let mode = Mode::from_bits_retain(meta.st_mode & 0o7777);
            fchmod(dst, mode)
                .map_err(io::Error::from)
                .with_context(|| match name {
                    Some(n) => self.cannot_copy(n),
                    None => format!(
                        "cannot set attributes of {}",
                        self.trail.show(self.dst, None)
                    ),
                })?;
        }
        Ok(())
    }

    /// [`set_attrs`] for the entry `name` of the current directory's copy (or, without a name, the
    /// directory itself), which messages name.
    fn attrs(
        &mut self,
        dst: Target,
        src: Target,
        name: Option<&CStr>,
        meta: &libc::stat,
    ) -> Result<()> {
        let at = || self.trail.show(self.dst, name);
        set_attrs(dst, src, meta, &mut self.out, &at).with_context(|| match name {
            Some(n) => self.cannot_copy(n),
            None => format!("cannot set attributes of {}", at()),
        })
    }

    /// The message of a failure to copy `name` of the current directory.
    fn cannot_copy(&self, name: &CStr) -> String {
        format!(
            "cannot copy {} to {}",
            self.trail.show(self.src, Some(name)),
            self.trail.show(self.dst, Some(name))
        )
    }
}

/// Copies one regular file's data; returns whether it was reflinked. Without reflink only the data
/// regions are copied and the length set after: holes stay holes.
fn copy_data(src: &File, dst: &File, reflink_works: &mut bool, shared: bool) -> io::Result<bool> {
    let len = dir::fstat(src)?.st_size as u64;
    if *reflink_works && len > 0 {
        match reflink_copy::reflink_file(src, dst) {
            Ok(()) => return Ok(true),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::EXDEV | libc::EINVAL | libc::ENOTTY)
                ) =>
            {
                // This filesystem cannot clone; do not ask again.
                *reflink_works = false;
            }
            Err(e) => return Err(e),
        }
    }
    let mut pos: u64 = 0;
    while pos < len {
        let data = match lseek(src, pos as libc::off_t, Whence::SeekData) {
            Ok(data) => data as u64,
            // No data after `pos`: the rest is a hole.
            Err(Errno::ENXIO) => break,
            // No hole support here: all of it is data.
            Err(Errno::EINVAL | Errno::EOPNOTSUPP) => pos,
            Err(e) => return Err(e.into()),
        };
        let hole = lseek(src, data as libc::off_t, Whence::SeekHole).map_or(len, |h| h as u64);
        let hole = hole.min(len);
        if hole <= data {
            break;
        }
        copy_range(src, dst, data, hole - data)?;
        pos = hole;
    }
    let len = if shared {
        length_read(src, dst, len)?
    } else {
        len
    };
    nix::unistd::ftruncate(dst, len as libc::off_t)?;
    Ok(false)
}

/// The length the data shows, where `len` (from `fstat`) may be stale: a shared filesystem's
/// client answers from attributes it cached (GlusterFS: for a second), from before another host
/// rewrote the file, while reads reach the server. Data past `len` is copied too; a file that
/// ends before it is not padded. One read, and more only where `len` was wrong.
fn length_read(src: &File, dst: &File, len: u64) -> io::Result<u64> {
    let at = len.saturating_sub(1);
    let mut two = [0u8; 2];
    let seen = at + read_at(src, &mut two[..(len > 0) as usize + 1], at)? as u64;
    if seen > len {
        return copy_by_buffer(src, dst, len, u64::MAX);
    }
    if seen == len {
        return Ok(len);
    }
    // It ends before `len`: the first offset with nothing to read, found by halves.
    let (mut lo, mut hi) = (0, at);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match read_at(src, &mut two[..1], mid)? {
            0 => hi = mid,
            _ => lo = mid + 1,
        }
    }
    Ok(lo)
}

/// `pread`, again when interrupted.
fn read_at(file: &File, buf: &mut [u8], at: u64) -> io::Result<usize> {
    use std::os::unix::fs::FileExt as _;
    loop {
        match file.read_at(buf, at) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// Copies `len` bytes at `off` from `src` to the same offset of `dst` (in the kernel if it can).
fn copy_range(src: &File, dst: &File, off: u64, len: u64) -> io::Result<()> {
    let (end, mut pos) = (off + len, off);
    while pos < end {
        let want = (end - pos).min(1 << 30) as usize;
        let (mut off_in, mut off_out) = (pos as libc::loff_t, pos as libc::loff_t);
        // The system call itself: std declares libc's symbol weak, and a static LTO build may then
        // call address 0.
        // SAFETY: valid descriptors and offset pointers, as the system call documents them.
        let copied = retrying(|| unsafe {
            libc::syscall(
                libc::SYS_copy_file_range,
                src.as_raw_fd(),
                &mut off_in as *mut libc::loff_t,
                dst.as_raw_fd(),
                &mut off_out as *mut libc::loff_t,
                want,
                0u32,
            )
        });
        match copied {
            // The source ended before the range did (it shrank under us).
            Ok(0) => return Ok(()),
            Ok(n) => pos += n as u64,
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(
                        libc::EXDEV | libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP | libc::EPERM
                    )
                ) =>
            {
                return copy_by_buffer(src, dst, pos, end).map(drop);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The rest of a [`copy_range`] the kernel cannot copy for these files, from `pos` to `end`.
/// Returns where the source ended, or `end`.
fn copy_by_buffer(src: &File, dst: &File, mut pos: u64, end: u64) -> io::Result<u64> {
    use std::os::unix::fs::FileExt as _;
    let mut buf = vec![0u8; 1 << 20];
    while pos < end {
        let chunk = (end - pos).min(buf.len() as u64) as usize;
        let n = match read_at(src, &mut buf[..chunk], pos)? {
            0 => return Ok(pos),
            n => n,
        };
        dst.write_all_at(&buf[..n], pos)?;
        pos += n as u64;
    }
    Ok(pos)
}

/// A second name for the copy of a hard-linked inode, its first copy found from the copy's top. A
/// directory on the way whose copy is done already has its final mode, which may keep even its
/// owner out (000): the copy is ours alone while made, so the owner's search bit is set on it for
/// the link and its mode put back after.
fn link_to(dst_root: &Dir, first: &[CString], dir: &Dir, name: &CStr) -> io::Result<()> {
    let (last, parents) = first.split_last().expect("a name");
    let mut opened: Vec<(Dir, Option<libc::mode_t>)> = Vec::new();
    let linked = (|| {
        for p in parents {
            let here = opened.last().map_or(dst_root, |(d, _)| d);
            let sub = here.anchor_sub(OsStr::from_bytes(p.to_bytes()))?;
            let mode = dir::fstat(&sub)?.st_mode & 0o7777;
            let lent = (mode & 0o100 == 0).then_some(mode);
            if lent.is_some() {
                dir::chmod_o_path(sub.as_raw_fd(), mode | 0o100)?;
            }
            opened.push((sub, lent));
        }
        let parent = opened.last().map_or(dst_root, |(d, _)| d);
        // No AT_SYMLINK_FOLLOW: a symlink is linked as itself.
        Ok(linkat(
            parent,
            last.as_c_str(),
            dir,
            name,
            AtFlags::empty(),
        )?)
    })();
    for (d, lent) in opened.iter().rev() {
        if let Some(mode) = lent {
            dir::chmod_o_path(d.as_raw_fd(), *mode)?;
        }
    }
    linked
}

/// Where attributes are read or set: an open file, or a name in a directory (not opened).
enum Target<'a> {
    Fd(BorrowedFd<'a>),
    At(&'a Dir, &'a CStr),
}

/// Owner (where permitted), mode, extended attributes and times, in order; symlinks not followed.
fn set_attrs(
    dst: Target,
    src: Target,
    meta: &libc::stat,
    out: &mut Copied,
    at: &dyn Fn() -> String,
) -> io::Result<()> {
    let (uid, gid) = (Uid::from_raw(meta.st_uid), Gid::from_raw(meta.st_gid));
    let r = match &dst {
        Target::Fd(fd) => fchown(fd, Some(uid), Some(gid)),
        Target::At(d, n) => fchownat(d, *n, Some(uid), Some(gid), AtFlags::AT_SYMLINK_NOFOLLOW),
    };
    // An unprivileged user cannot give files away: keep our own.
    if let Err(e) = r
        && e != Errno::EPERM
    {
        return Err(e.into());
    }
    if dir::file_type(meta) != libc::S_IFLNK {
        // After chown, which clears setuid/setgid bits.
        let mode = Mode::from_bits_retain(meta.st_mode & 0o7777);
        match &dst {
            Target::Fd(fd) => fchmod(fd, mode)?,
            // A FIFO, socket or device node we just created, not a symlink.
            Target::At(d, n) => fchmodat(d, *n, mode, FchmodatFlags::FollowSymlink)?,
        }
    }
    copy_xattrs(&src, &dst, out, at);
    let atime = TimeSpec::new(meta.st_atime, meta.st_atime_nsec);
    let mtime = TimeSpec::new(meta.st_mtime, meta.st_mtime_nsec);
    Ok(match &dst {
        Target::Fd(fd) => futimens(fd, &atime, &mtime),
        Target::At(d, n) => utimensat(d, *n, &atime, &mtime, UtimensatFlags::NoFollowSymlink),
    }?)
}

/// The value of attribute `key` or, without a key, the list of names.
fn xattr(t: &Target, key: Option<&CStr>) -> io::Result<Vec<u8>> {
    // An entry is named by a /proc path, for the `l*` calls (the descriptor is then unused).
    let (fd, path) = match t {
        Target::Fd(fd) => (fd.as_raw_fd(), None),
        Target::At(d, name) => (-1, Some(d.proc_path(name))),
    };
    // SAFETY: each call gets a buffer of the length it is told, and valid C strings.
    xattr_read(256, |p, n| unsafe {
        match (&path, key) {
            (None, None) => libc::flistxattr(fd, p.cast(), n),
            (None, Some(k)) => libc::fgetxattr(fd, k.as_ptr(), p, n),
            (Some(at), None) => libc::llistxattr(at.as_ptr(), p.cast(), n),
            (Some(at), Some(k)) => libc::lgetxattr(at.as_ptr(), k.as_ptr(), p, n),
        }
    })
}

fn set_xattr(t: &Target, key: &CStr, value: &[u8]) -> io::Result<()> {
    let (v, n) = (value.as_ptr().cast(), value.len());
    // SAFETY: valid C strings; the value pointer and length describe `value`.
    let r = match t {
        Target::Fd(fd) => unsafe { libc::fsetxattr(fd.as_raw_fd(), key.as_ptr(), v, n, 0) },
        Target::At(d, name) => {
            let path = d.proc_path(name);
            unsafe { libc::lsetxattr(path.as_ptr(), key.as_ptr(), v, n, 0) }
        }
    };
    cvt(r).map(drop)
}

/// Copies every extended attribute the source has and the target accepts; counts the refusals. One
/// the target has already (a label the filesystem gave it) is left alone.
fn copy_xattrs(src: &Target, dst: &Target, out: &mut Copied, at: &dyn Fn() -> String) {
    // No extended attributes here at all, or none readable.
    let Ok(names) = xattr(src, None) else { return };
    for key in names.split(|b| *b == 0).filter(|k| !k.is_empty()) {
        let Ok(key) = CString::new(key) else { continue };
        let result = xattr(src, Some(&key)).and_then(|value| {
            if xattr(dst, Some(&key)).is_ok_and(|have| have == value) {
                return Ok(());
            }
            set_xattr(dst, &key, &value)
        });
        if let Err(e) = result {
            let name = String::from_utf8_lossy(key.to_bytes()).into_owned();
            if out.xattr_details.len() < DETAILS {
                out.xattr_details.push(format!(
                    "{}: {}: {e}",
                    crate::ident::printable(&at()),
                    crate::ident::printable(&name)
                ));
            }
            out.xattrs_lost.entry(name).or_insert((0, e.to_string())).0 += 1;
        }
    }
}

/// How long a copy runs before its progress is shown.
const SHOW_AFTER: Duration = Duration::from_millis(700);

/// A progress bar on stderr, shown only on a terminal and once a copy has taken more than a moment.
pub struct Bar {
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    enabled: bool,
    total: u64,
    done: u64,
    label: String,
}

impl Bar {
    pub fn new(label: String, enabled: bool) -> Bar {
        Bar {
            bar: None,
            started: Instant::now(),
            enabled,
            total: 0,
            done: 0,
            label,
        }
    }

    fn advance(&mut self, bytes: u64) {
        self.done += bytes;
        if self.bar.is_none() && self.enabled && self.started.elapsed() >= SHOW_AFTER {
            let bar = indicatif::ProgressBar::with_draw_target(
                Some(self.total),
                indicatif::ProgressDrawTarget::stderr(),
            );
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "stowage: {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
            ) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(self.label.clone());
            self.bar = Some(bar);
        }
        if let Some(b) = &self.bar {
            b.set_position(self.done);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt, symlink};

    #[test]
    fn copies_faithfully() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        let dst = d.path().join("dst");
        fs::create_dir_all(src.join("bin")).unwrap();
        fs::create_dir(&dst).unwrap();
        fs::write(src.join("bin/tool"), b"#!/bin/sh\n").unwrap();
        fs::set_permissions(src.join("bin/tool"), fs::Permissions::from_mode(0o4755)).unwrap();
        fs::hard_link(src.join("bin/tool"), src.join("bin/tool2")).unwrap();
        symlink("/etc/passwd", src.join("outside")).unwrap();
        symlink("bin", src.join("bin-link")).unwrap();
        fs::create_dir(src.join("ro")).unwrap();
        fs::write(src.join("ro/f"), b"x").unwrap();
        fs::set_permissions(src.join("ro"), fs::Permissions::from_mode(0o555)).unwrap();
        let fifo = CString::new(src.join("fifo").into_os_string().into_encoded_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);

        let (s, t) = (
            Dir::open_nofollow(&src).unwrap(),
            Dir::open_nofollow(&dst).unwrap(),
        );
        let mut loans = Loans::take(d.path().join("lend"), &s, None).unwrap();
        let bar = &mut Bar::new(String::new(), false);
        let out = copy_tree_at((s, &src), (t, &dst), &mut loans, bar).unwrap();
        assert_eq!(out.files, 2);

        let a = fs::metadata(dst.join("bin/tool")).unwrap();
        assert_eq!(a.mode() & 0o7777, 0o4755, "setuid and permission bits kept");
        let b = fs::metadata(dst.join("bin/tool2")).unwrap();
        assert_eq!(a.ino(), b.ino(), "hard links stay hard links");
        let base = fs::metadata(src.join("bin/tool")).unwrap();
        assert_ne!(a.ino(), base.ino(), "no inode shared with the base");
        assert_eq!(
            fs::read_link(dst.join("outside")).unwrap(),
            Path::new("/etc/passwd")
        );
        let kind = |p: &str| fs::symlink_metadata(dst.join(p)).unwrap().file_type();
        assert!(kind("bin-link").is_symlink());
        assert_eq!(fs::metadata(dst.join("ro")).unwrap().mode() & 0o777, 0o555);
        assert_eq!(fs::read(dst.join("ro/f")).unwrap(), b"x");
        assert!(kind("fifo").is_fifo());
        assert_eq!(a.mtime(), base.mtime());
        // Let the tempdir clean up.
        fs::set_permissions(src.join("ro"), fs::Permissions::from_mode(0o755)).unwrap();
        fs::set_permissions(dst.join("ro"), fs::Permissions::from_mode(0o755)).unwrap();
    }
}
