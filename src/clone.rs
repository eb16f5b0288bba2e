//! Faithful copies of image trees, for `exec --write NEW --from BASE`.
//!
//! - Kept: file types, modes with setuid/setgid/sticky, owners and device nodes where permitted,
//!   times, hard links, holes, every extended attribute the target accepts. What cannot be kept is
//!   counted and reported, never silently dropped; but `trusted.*` attributes are listed only to
//!   root, and a copy without privilege cannot tell that they are there.
//! - Data: FICLONE where the filesystem can, else only data regions (SEEK_DATA, copy_file_range).
//! - The walk goes by directory descriptor ([`crate::dir`]); symlinks are copied as links. It
//!   holds a bounded number of descriptors at any depth: levels far above the one being copied are
//!   closed and reopened through `..` ([`dir::OPEN_LEVELS`]).
//! - Memory is bounded by the tree's width and names, not by hard links × depth: a linked inode's
//!   first copy is kept as its directory's line in a tree of directories that leads to one, and a
//!   later name is linked by a route up through `..` and down from the nearest common directory.
//! - A large file is copied in chunks, a termination signal looked for between them.
//! - Every destination is created fresh (`O_EXCL`, `mkdirat`, `mknodat`, `symlinkat`) in the new
//!   image's empty directory, mode 700 (setgid kept) until done. No inode is shared with the base.
//!   Attributes are set through a descriptor of what was made, never by name: a directory or
//!   entry that takes no open (link, FIFO, socket, device) is opened `O_PATH|O_NOFOLLOW` and
//!   checked to be the new entry ([`made_here`]); one swapped for another fails the copy.
//! - Attribute order: owner (clears setuid and capabilities), mode, extended attributes (an ACL
//!   rewrites the group bits), times. Owner refused: the group alone, where it is the caller's.

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
use nix::fcntl::AT_FDCWD;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag, UtimensatFlags};
use nix::sys::stat::{fchmod, futimens, utimensat};
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

/// A [`Frame`] far above the directory being copied, its two directories closed and known by
/// device and inode, to be reopened through `..` on the way back. Its loan, if any, holds no
/// descriptor meanwhile ([`Lent::detach`]): the mode stays lent until the level is reopened.
struct Far {
    src: (u64, u64),
    dst: (u64, u64),
    meta: libc::stat,
    names: std::vec::IntoIter<CString>,
    lent: Option<Lent>,
}

impl Frame {
    /// Its two directories' device and inode, as a [`Far`] knows them.
    fn ids(&self) -> io::Result<((u64, u64), (u64, u64))> {
        let (s, d) = (dir::fstat(&self.src)?, dir::fstat(&self.dst)?);
        Ok(((s.st_dev, s.st_ino), (d.st_dev, d.st_ino)))
    }

    /// Closed, known by `(src, dst)` from [`Frame::ids`].
    fn close(self, (src, dst): ((u64, u64), (u64, u64))) -> Far {
        let mut lent = self.lent;
        lent.as_mut().map(Lent::detach);
        Far {
            src,
            dst,
            meta: self.meta,
            names: self.names,
            lent,
        }
    }
}

impl Far {
    /// Its two directories, reopened from their subdirectories' frame `below` (each `..` must be
    /// the directory left), and a descriptor of the source for its loan.
    fn reopen(&self, below: &Frame) -> io::Result<(Dir, Dir, Option<OwnedFd>)> {
        let src = below.src.parent_checked(self.src, "copied")?;
        let dst = below.dst.parent_checked(self.dst, "copied")?;
        let lent = match self.lent {
            Some(_) => Some(src.as_fd().try_clone_to_owned()?),
            None => None,
        };
        Ok((src, dst, lent))
    }

    fn into_frame(self, (src, dst, fd): (Dir, Dir, Option<OwnedFd>)) -> Frame {
        let mut lent = self.lent;
        if let (Some(l), Some(fd)) = (lent.as_mut(), fd) {
            l.reattach(fd);
        }
        Frame {
            src,
            dst,
            meta: self.meta,
            names: self.names,
            lent,
        }
    }
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

/// Whether a copy of the base whose top is `top` (named `src`) may lend itself owner access: an
/// entry of ours withholds it ([`withheld`]), or the base could not be looked at whole.
pub fn lends(top: &Dir, src: &Path) -> bool {
    if nix::unistd::geteuid().is_root() {
        return false;
    }
    let Ok(top) = top.duplicate() else {
        return true;
    };
    let skip = crate::disk_usage::Unseen::Skip;
    let found = crate::disk_usage::walk_dir(top, src, skip, &mut |_, _, st| match withheld(st) {
        0 => Ok(()),
        _ => Err(io::Error::other("lends")),
    });
    !matches!(found, Ok(true))
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
    // The kernel clears the setgid bit on a chmod by one not in the inode's group: a loan would
    // take it from the base for good (its give-back could not set it again).
    if !dir::chmod_keeps_setgid(meta) {
        let (mode, gid) = (meta.st_mode & 0o7777, meta.st_gid);
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "it is mode {mode:04o}, setgid for group {gid} (not yours): a loan of its owner bits would clear that bit for good, so only root can copy it"
            ),
        ));
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
/// base's lend lock `loans`. On failure, `changed` says whether anything of `dst_root` changed
/// (else the image is as it was); every loan is given back either way.
pub fn copy_tree_at(
    (src_root, src): (Dir, &Path),
    (dst_root, dst): (Dir, &Path),
    loans: &mut Loans,
    progress: &mut Bar,
    changed: &mut bool,
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
    let mut names = src_root
        .entries()
        .with_context(|| format!("cannot list {}", src.display()))?;
    let before = names.len();
    names.retain(|n| n.as_bytes() != b".git" || !worktree_link(&src_root));
    let worktree_link_left_out = names.len() < before;
    // All that can fail before the first change, before it.
    let dst_top = (dst_root.sub(".")).with_context(|| format!("cannot open {}", dst.display()))?;
    let was = make_private(&dst_root, dst)?;
    let top = Frame {
        src: src_root,
        dst: dst_top,
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
        far: Vec::new(),
        dirs: vec![(0, CString::default())],
        here: vec![0],
        kept: 1,
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
        copy.give_back(&stack, Mode::from_bits_retain(was));
        // Loans end innermost first, as their journal lines are cut off.
        while stack.pop().is_some() {}
        while copy.far.pop().is_some() {}
        // Its mode back and nothing made in it: the copy changed nothing (this needs no new
        // descriptor, as one that ran out of them must not).
        let top = (dir::fstat(&copy.dst_root).ok()).map(|st| st.st_mode & 0o7777);
        *changed |= top != Some(was) || !copy.dst_root.names().is_ok_and(|n| n.is_empty());
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

/// Makes the copy's top ours alone while the copy is made; returns the mode it had. A group store's
/// member could otherwise rename names in it, or swap in a link (attributes go through a checked
/// descriptor of what was made, [`made_here`], but hard links are made by name): it must be ours
/// and empty (a name made before may be held open by its maker). Its setgid stays:
/// in a group store what is made below gets the store's group, not the copier's primary group.
fn make_private(top: &Dir, dst: &Path) -> Result<libc::mode_t> {
    let dst = dst.display();
    let st = dir::fstat(top).with_context(|| format!("cannot read {dst}"))?;
    let (uid, was) = (st.st_uid, st.st_mode & 0o7777);
    if uid != nix::unistd::geteuid().as_raw() {
        anyhow::bail!(
            "{dst} belongs to uid {uid}, not to you: refusing to copy into it (its owner could change names in the copy)"
        );
    }
    fchmod(top, Mode::from_bits_retain(0o700 | (was & libc::S_ISGID)))
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
    /// The top of the copy.
    dst_root: Dir,
    /// The base's filesystem and mount: a directory on another is a mount point.
    dev: u64,
    mount: Option<u64>,
    /// The names from the tops down to the directory being copied.
    trail: Trail,
    /// The levels above the deepest [`dir::OPEN_LEVELS`], closed; the top first.
    far: Vec<Far>,
    /// Directories of the copy, each as its parent's line here and its name (the top is line 0):
    /// those on the way to the directory being copied, and below `kept`, those on the way to a
    /// first copy of a hard-linked inode. A parent's line comes before its subdirectories'.
    dirs: Vec<(usize, CString)>,
    /// The lines of the directory being copied and of those above it, the top first.
    here: Vec<usize>,
    kept: usize,
    /// First copy of each hard-linked inode: its directory's line in `dirs`, and its name.
    links: HashMap<(u64, u64), (usize, CString)>,
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
                if stack.is_empty()
                    && let Some(far) = self.far.last()
                {
                    let up = far.reopen(&done).with_context(|| self.cannot_climb())?;
                    let far = self.far.pop().expect("seen");
                    stack.push(far.into_frame(up));
                }
                self.leave();
                let lent = done.lent.is_some();
                self.attrs_fd((done.dst.as_fd(), done.src.as_fd()), None, &done.meta, lent)?;
                continue;
            };
            crate::signals::check()?;
            if let Some(sub) = self.copy_entry(top, name)? {
                stack.push(sub);
                if stack.len() > dir::OPEN_LEVELS {
                    let ids = stack[0].ids().with_context(|| self.cannot_climb())?;
                    self.far.push(stack.remove(0).close(ids));
                }
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
            made_here(&d, libc::S_IFDIR)?;
            // A filesystem mounted inside the base is not its tree: the mount point is copied,
            // empty. A bind mount of the base's own filesystem shows only in its mount id, and a
            // btrfs subvolume (a device of its own on the same mount) is part of the tree.
            let mount = match self.mount {
                Some(m) => s.mount_id()? != Some(m),
                None => meta.st_dev != self.dev,
            };
            let names = if mount { Vec::new() } else { s.entries()? };
            io::Result::Ok((s, d, names, lent, mount))
        })();
        let (s, d, names, lent, mount) = opened.with_context(|| self.cannot_copy(&name))?;
        if mount {
            let mount = self.trail.show(self.src, Some(&name));
            self.out.mounts_left_out.push(mount);
        }
        let parent = *self.here.last().expect("the top is there");
        self.dirs.push((parent, name.clone()));
        self.here.push(self.dirs.len() - 1);
        self.trail.0.push(name);
        Ok(Frame {
            src: s,
            dst: d,
            meta,
            names: names.into_iter(),
            lent,
        })
    }

    /// After a failure: the copy's directories made 700 and not done get `mode`, the top's, back, so
    /// a group store's member can remove them; the far ones are reopened through `..`, and the
    /// loans of their sources get descriptors back to be given back by (else their journal lines
    /// stay, for the lend lock's next exclusive holder).
    fn give_back(&mut self, stack: &[Frame], mode: Mode) {
        for d in stack.iter().map(|f| &f.dst).chain([&self.dst_root]) {
            let _ = fchmod(d, mode);
        }
        let mut up = stack
            .first()
            .map(|f| (f.src.duplicate().ok(), f.dst.duplicate().ok()));
        for far in self.far.iter_mut().rev() {
            let Some((s, d)) = up else { break };
            let s = s.and_then(|s| s.parent_checked(far.src, "copied").ok());
            let d = d.and_then(|d| d.parent_checked(far.dst, "copied").ok());
            if let Some(d) = &d {
                let _ = fchmod(d, mode);
            }
            if let (Some(s), Some(lent)) = (&s, far.lent.as_mut())
                && let Ok(fd) = s.as_fd().try_clone_to_owned()
            {
                lent.reattach(fd);
            }
            up = Some((s, d));
        }
    }

    /// Leaves the directory being copied for the one above; its line in `dirs` goes unless it
    /// leads to a first copy.
    fn leave(&mut self) {
        self.trail.0.pop();
        if let Some(line) = self.here.pop()
            && line >= self.kept
        {
            // What came after it is below it, left already.
            self.dirs.truncate(line);
        }
    }

    /// For an inode with several names: a later name becomes a link to the first one's copy (true).
    fn linked_to_copy(&mut self, top: &Frame, name: &CStr, meta: &libc::stat) -> Result<bool> {
        let key = (meta.st_dev, meta.st_ino);
        if let Some((line, first)) = self.links.get(&key) {
            let route = self.route(*line, first);
            link_to(&top.dst, &route, &top.dst, name).with_context(|| self.cannot_copy(name))?;
            return Ok(true);
        }
        // This directory and those above it are kept: the way to this first copy.
        self.kept = self.dirs.len();
        let line = *self.here.last().expect("the top is there");
        self.links.insert(key, (line, name.to_owned()));
        Ok(false)
    }

    /// The names from the directory being copied to `name` in the directory at `line`: up through
    /// `..` to the nearest directory above both, then down.
    fn route(&self, mut line: usize, name: &CStr) -> Vec<CString> {
        let mut down = vec![name.to_owned()];
        // `here` is in ascending order: a parent's line comes before its subdirectories'.
        let above = loop {
            match self.here.binary_search(&line) {
                Ok(i) => break i,
                Err(_) => {
                    down.push(self.dirs[line].1.clone());
                    line = self.dirs[line].0;
                }
            }
        };
        let mut route = vec![c"..".to_owned(); self.here.len() - 1 - above];
        route.extend(down.into_iter().rev());
        route
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

    /// Owner, mode, times and attributes of the entry `name` just made (a symlink, FIFO, socket or
    /// device node), from source to copy, each through an `O_PATH` descriptor of the very inode
    /// ([`made_here`]): set by name, they would follow whatever stands at the name by then.
    fn attrs_at(&mut self, top: &Frame, name: &CStr, meta: &libc::stat) -> Result<()> {
        crate::debug::pause("clone-made");
        let opened = (|| {
            let flags = libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC;
            let src = top.src.open_at(name, flags, 0)?;
            let now = dir::fstat(&src)?;
            let kind = dir::file_type(meta);
            if (now.st_dev, now.st_ino, dir::file_type(&now)) != (meta.st_dev, meta.st_ino, kind) {
                return Err(io::Error::other("changed while being copied"));
            }
            let made = top.dst.open_at(name, flags, 0)?;
            made_here(&made, kind)?;
            Ok((src, made))
        })();
        let (src, made) = opened.with_context(|| self.cannot_copy(name))?;
        let (dst, src) = (Target::Path(made.as_fd()), Target::Path(src.as_fd()));
        self.attrs(dst, src, Some(name), meta)
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

    /// The message of a failure to reopen a directory above the current one, or to close one.
    fn cannot_climb(&self) -> String {
        let at = self.trail.show(self.src, None);
        format!("cannot go back up from {at}")
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

/// How much of a file's data is copied between two looks for a termination signal: a copy stops
/// within one chunk, not once a file of many GiB is done, while it holds its locks.
const CHUNK: u64 = 64 << 20;

/// A termination signal, as the error of a data copy's step ([`crate::exec`] exits 128+N on it).
fn stop_if_signalled() -> io::Result<()> {
    crate::signals::check().map_err(|e| io::Error::new(io::ErrorKind::Interrupted, e))
}

/// Copies `len` bytes at `off` from `src` to the same offset of `dst` (in the kernel if it can).
fn copy_range(src: &File, dst: &File, off: u64, len: u64) -> io::Result<()> {
    let (end, mut pos) = (off + len, off);
    while pos < end {
        stop_if_signalled()?;
        let want = (end - pos).min(CHUNK) as usize;
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
            Ok(n) => {
                pos += n as u64;
                crate::debug::pause("clone-data");
            }
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
        // Looks are cheap (at most one every few milliseconds asks the kernel).
        stop_if_signalled()?;
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

/// A second name for the copy of a hard-linked inode, its first copy found by the names `first`
/// (a route from `start`, `..` included). A directory on the way down whose copy is done already
/// has its final mode, which may keep even its owner out (000): the copy is ours alone while made,
/// so the owner's search bit is set on it for the link and its mode put back after. Only the
/// nearest directory is held open: the way back to those lent is through `..`.
fn link_to(start: &Dir, first: &[CString], dir: &Dir, name: &CStr) -> io::Result<()> {
    let (last, parents) = first.split_last().expect("a name");
    // Each directory opened on the way: its device and inode, and its mode if lent the bit.
    let mut way: Vec<((u64, u64), Option<libc::mode_t>)> = Vec::new();
    let mut here: Option<Dir> = None;
    let linked = (|| {
        for p in parents {
            let sub =
                (here.as_ref().unwrap_or(start)).anchor_sub(OsStr::from_bytes(p.to_bytes()))?;
            let st = dir::fstat(&sub)?;
            let mode = st.st_mode & 0o7777;
            let lent = (mode & 0o100 == 0).then_some(mode);
            if lent.is_some() {
                dir::chmod_o_path(sub.as_raw_fd(), mode | 0o100)?;
            }
            way.push(((st.st_dev, st.st_ino), lent));
            here = Some(sub);
        }
        // No AT_SYMLINK_FOLLOW: a symlink is linked as itself.
        let parent = here.as_ref().unwrap_or(start);
        Ok(linkat(
            parent,
            last.as_c_str(),
            dir,
            name,
            AtFlags::empty(),
        )?)
    })();
    let first_lent = way.iter().position(|(_, lent)| lent.is_some());
    if let (Some(nearest), Some(i)) = (here, first_lent) {
        give_back_search(nearest, &way[i..])?;
    }
    linked
}

/// Puts back the modes of the directories `way` (each its device, inode and mode if lent), the
/// last one `nearest` and each the one below the one before: the routes' `..` are all above the
/// first, which is lent.
fn give_back_search(nearest: Dir, way: &[((u64, u64), Option<libc::mode_t>)]) -> io::Result<()> {
    let mut here = nearest;
    for (i, (_, lent)) in way.iter().enumerate().rev() {
        // The way up before the mode goes: `..` needs the search bit.
        let up = match i.checked_sub(1) {
            Some(above) => {
                let up = here.anchor_sub("..")?;
                let st = dir::fstat(&up)?;
                if (st.st_dev, st.st_ino) != way[above].0 {
                    return Err(io::Error::other("the copy was moved while being linked"));
                }
                Some(up)
            }
            None => None,
        };
        if let Some(mode) = lent {
            dir::chmod_o_path(here.as_raw_fd(), *mode)?;
        }
        match up {
            Some(up) => here = up,
            None => break,
        }
    }
    Ok(())
}

/// Refuses what stands at a name the copy has just made unless it is that new entry: of the kind
/// made (`kind`), ours, and (not a directory) of no other name. Whoever could write in the copy
/// might have swapped it for a link to a file elsewhere, or a hard link of one, which would then get
/// the copy's owner, mode and times; or for a directory of theirs, to fill with names of theirs.
fn made_here(made: &impl AsFd, kind: libc::mode_t) -> io::Result<()> {
    let st = dir::fstat(made)?;
    let ours = st.st_uid == nix::unistd::geteuid().as_raw();
    if dir::file_type(&st) != kind || !ours || (kind != libc::S_IFDIR && st.st_nlink != 1) {
        return Err(io::Error::other(
            "replaced while being copied (not the entry the copy made): left as it is",
        ));
    }
    Ok(())
}

/// Where attributes are read or set: an open file, or an `O_PATH` descriptor of an inode that
/// takes no open (a symlink, FIFO, socket or device node), reached through its `/proc/self/fd`
/// link: the calls that take a path get that inode itself, a symlink too, and go no further.
enum Target<'a> {
    Fd(BorrowedFd<'a>),
    Path(BorrowedFd<'a>),
}

/// `/proc/self/fd/N` of the `O_PATH` descriptor `fd` of a [`Target::Path`].
fn proc_of(fd: BorrowedFd) -> CString {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    CString::new(path).expect("no NUL in a number")
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
    let chown = |uid| match &dst {
        Target::Fd(fd) => fchown(fd, uid, Some(gid)),
        // An O_PATH descriptor takes no fchown: the same, by its empty name.
        Target::Path(fd) => fchownat(fd, c"", uid, Some(gid), AtFlags::AT_EMPTY_PATH),
    };
    // An unprivileged user cannot give files away, but may give them a group of theirs: a group
    // store's base keeps its group, which its other members need to write and remove the copy.
    // Refused that too, the group stays the one it was made with (the setgid top's).
    match chown(Some(uid)).or_else(|e| match e {
        Errno::EPERM => chown(None),
        e => Err(e),
    }) {
        Ok(()) | Err(Errno::EPERM) => {}
        Err(e) => return Err(e.into()),
    }
    if dir::file_type(meta) != libc::S_IFLNK {
        // After chown, which clears setuid/setgid bits.
        let mode = meta.st_mode & 0o7777;
        match &dst {
            Target::Fd(fd) => fchmod(fd, Mode::from_bits_retain(mode))?,
            Target::Path(fd) => dir::chmod_o_path(fd.as_raw_fd(), mode)?,
        }
    }
    copy_xattrs(&src, &dst, out, at);
    let atime = TimeSpec::new(meta.st_atime, meta.st_atime_nsec);
    let mtime = TimeSpec::new(meta.st_mtime, meta.st_mtime_nsec);
    let follow = UtimensatFlags::FollowSymlink;
    Ok(match &dst {
        Target::Fd(fd) => futimens(fd, &atime, &mtime),
        Target::Path(fd) => utimensat(AT_FDCWD, proc_of(*fd).as_c_str(), &atime, &mtime, follow),
    }?)
}

/// The value of attribute `key` or, without a key, the list of names.
fn xattr(t: &Target, key: Option<&CStr>) -> io::Result<Vec<u8>> {
    let (fd, path) = match t {
        Target::Fd(fd) => (fd.as_raw_fd(), None),
        Target::Path(at) => (-1, Some(proc_of(*at))),
    };
    // SAFETY: each call gets a buffer of the length it is told, and valid C strings.
    xattr_read(256, |p, n| unsafe {
        match (&path, key) {
            (None, None) => libc::flistxattr(fd, p.cast(), n),
            (None, Some(k)) => libc::fgetxattr(fd, k.as_ptr(), p, n),
            (Some(at), None) => libc::listxattr(at.as_ptr(), p.cast(), n),
            (Some(at), Some(k)) => libc::getxattr(at.as_ptr(), k.as_ptr(), p, n),
        }
    })
}

fn set_xattr(t: &Target, key: &CStr, value: &[u8]) -> io::Result<()> {
    let (v, n) = (value.as_ptr().cast(), value.len());
    // SAFETY: valid C strings; the value pointer and length describe `value`.
    let r = match t {
        Target::Fd(fd) => unsafe { libc::fsetxattr(fd.as_raw_fd(), key.as_ptr(), v, n, 0) },
        Target::Path(fd) => {
            let at = proc_of(*fd);
            unsafe { libc::setxattr(at.as_ptr(), key.as_ptr(), v, n, 0) }
        }
    };
    cvt(r).map(drop)
}

fn remove_xattr(t: &Target, key: &CStr) -> io::Result<()> {
    // SAFETY: valid C strings.
    let r = match t {
        Target::Fd(fd) => unsafe { libc::fremovexattr(fd.as_raw_fd(), key.as_ptr()) },
        Target::Path(fd) => {
            let at = proc_of(*fd);
            unsafe { libc::removexattr(at.as_ptr(), key.as_ptr()) }
        }
    };
    cvt(r).map(drop)
}

/// Copies every extended attribute the source has and the target accepts; counts the refusals. One
/// the target has already (a label the filesystem gave it) is left alone, but not an ACL the source
/// lacks: a new file inherits its directory's default ACL (one set on the images directory).
fn copy_xattrs(src: &Target, dst: &Target, out: &mut Copied, at: &dyn Fn() -> String) {
    let names = xattr(src, None);
    let keys = |list: &[u8]| -> Vec<Vec<u8>> {
        let keys = list.split(|b| *b == 0).filter(|k| !k.is_empty());
        keys.map(<[u8]>::to_vec).collect()
    };
    let theirs = keys(names.as_deref().unwrap_or_default());
    for acl in keys(&xattr(dst, None).unwrap_or_default()) {
        if acl.starts_with(b"system.posix_acl_")
            && !theirs.contains(&acl)
            && let Ok(acl) = CString::new(acl)
        {
            // Our own new file: nothing refuses it but a filesystem without ACLs, which has none.
            let _ = remove_xattr(dst, &acl);
        }
    }
    // No extended attributes here at all, or none readable.
    let Ok(names) = names else { return };
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
        let mut loans = Loans::take(d.path().join("lend"), &s, None, None).unwrap();
        let bar = &mut Bar::new(String::new(), false);
        let out = copy_tree_at((s, &src), (t, &dst), &mut loans, bar, &mut false).unwrap();
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
