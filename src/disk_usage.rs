//! Disk usage of an image tree, as gc and `images` count it.
//!
//! - Allocated blocks (a sparse file counts what it uses), each hard-linked inode once, symlinks as
//!   themselves, never crossing into another filesystem or mount (a bind mount has the same device).
//! - Shared extents (reflinks on btrfs, XFS, bcachefs) and inodes with several names: the walk
//!   keeps each file's `FIEMAP_EXTENT_SHARED` ranges and each such inode with its names found
//!   and `st_nlink` ([`Shares`]), so a [`Footprint`] of all images says what they take together
//!   and what removing one frees. An extent shared only outside the store counts as the image's
//!   own (FIEMAP names no other owner); an inode named outside the store is never freed.
//! - Extent maps are read after the file's dirty data is written back (`FIEMAP_FLAG_SYNC`):
//!   before, btrfs maps a rewritten range to the old extent it shared.
//! - The walk goes by directory descriptor ([`crate::dir`]), with at most
//!   [`dir::OPEN_LEVELS`] open at any depth.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::dir::{self, Dir, Trail};

/// What one image tree takes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Measure {
    /// Allocated bytes of every inode once.
    pub allocated: u64,
    /// Of those, bytes in extents shared with another file (here, in another image, or outside).
    pub shared: u64,
    /// What another image may refer to too.
    pub shares: Shares,
    /// Whether `dir` was there (a missing one measures nothing; one walk: the top's open tells).
    pub there: bool,
    /// Whether a directory we may not read was left out: the measure is less than the tree.
    pub partial: bool,
}

/// Bytes deleting `dir` alone gives back ([`Measure::freed`]); extents read where they may be
/// shared. A missing directory frees nothing.
pub fn freed_by_deleting(dir: &Path) -> io::Result<u64> {
    Ok(measure(dir, can_share(dir))?.freed())
}

/// What an image may share with others.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shares {
    /// The physical ranges of its shared extents, sorted and merged: `[start, end)`.
    pub ranges: Vec<(u64, u64)>,
    /// Its inodes with several names: another image may hold a name of one (a build that
    /// hard-linked a file it read), or a file outside the store.
    pub inodes: Vec<Linked>,
}

/// An inode with several names, as one tree has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Linked {
    /// (device, inode).
    pub key: (u64, u64),
    /// Its allocated bytes outside shared extents.
    pub bytes: u64,
    /// Its names in this tree.
    pub names: u64,
    /// Its names on the filesystem (`st_nlink`): more than all images hold keep it allocated.
    pub nlink: u64,
}

impl Measure {
    /// Bytes no other image can refer to: outside shared extents and inodes with several names.
    pub fn own(&self) -> u64 {
        let linked: u64 = self.shares.inodes.iter().map(|l| l.bytes).sum();
        self.allocated.saturating_sub(self.shared + linked)
    }

    /// Bytes deleting this tree alone gives back: [`own`](Self::own), and the inodes it holds every
    /// name of. A shared extent is not counted, whoever else holds it (this tree too, at worst).
    pub fn freed(&self) -> u64 {
        let linked = self.shares.inodes.iter().filter(|l| l.names >= l.nlink);
        self.own() + linked.map(|l| l.bytes).sum::<u64>()
    }
}

/// The blocks an open file takes (a lock file: `df` gets them back once it is unlinked).
pub fn blocks_of(file: &std::fs::File) -> u64 {
    use std::os::unix::fs::MetadataExt;
    file.metadata().map_or(0, |m| m.blocks() * 512)
}

/// Measures `dir`; with `extents`, also which of its blocks are shared.
pub fn measure(dir: &Path, extents: bool) -> io::Result<Measure> {
    // Each linked inode's place in `out.shares.inodes`, to count its names.
    let mut seen: HashMap<(u64, u64), usize> = HashMap::new();
    let mut out = Measure::default();
    let mut ranges = Vec::new();
    let whole = walk(dir, &mut |parent, name, st| {
        // The top is visited first, as `.`, only if it could be opened.
        out.there |= name == c".";
        let ft = dir::file_type(st);
        let blocks = st.st_blocks as u64 * 512;
        let key = (st.st_nlink > 1 && ft != libc::S_IFDIR).then_some((st.st_dev, st.st_ino));
        if let Some(&i) = key.and_then(|k| seen.get(&k)) {
            out.shares.inodes[i].names += 1;
            return Ok(());
        }
        out.allocated += blocks;
        let mut shared = 0;
        if extents && ft == libc::S_IFREG && blocks > 0 {
            shared = shared_extents(parent, name, &mut ranges)?.min(blocks);
            out.shared += shared;
        }
        // An inode with several names is a unit another image may name too; what of it is in
        // extents shared anyway (a linked file cloned into another image) counts as ranges.
        if let Some(key) = key {
            seen.insert(key, out.shares.inodes.len());
            // nlink_t is narrower on some targets.
            #[allow(clippy::unnecessary_cast)]
            let nlink = st.st_nlink as u64;
            out.shares.inodes.push(Linked {
                key,
                bytes: blocks - shared,
                names: 1,
                nlink,
            });
        }
        Ok(())
    })?;
    out.partial = !whole;
    out.shares.ranges = merge(ranges);
    Ok(out)
}

/// Can files on the filesystem of `dir` share extents (reflink)?
pub fn can_share(dir: &Path) -> bool {
    // btrfs, XFS, bcachefs
    #[allow(clippy::unnecessary_cast)]
    nix::sys::statfs::statfs(dir).is_ok_and(|st| {
        matches!(
            st.filesystem_type().0 as i64,
            0x9123_683E | 0x5846_5342 | 0xCA45_1A4E
        )
    })
}

type Visit<'a> = dyn FnMut(&Dir, &CStr, &libc::stat) -> io::Result<()> + 'a;

/// How a walk meets what it cannot look inside.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Unseen {
    /// Passed over: another mount is no part of the tree, a directory we may not read counts as
    /// itself (the walk is then not whole).
    Skip,
    /// Refused with an error naming it, for a check that must see all a deletion would: a mount
    /// below the top, a directory that cannot be looked inside. One of ours (not root's) whose
    /// mode keeps us out is lent owner read and search while walked, its mode given back as the
    /// walk leaves it (as deleting it would lend it).
    Refuse,
}

/// Calls `visit` on every entry under `dir` (the top as `.`), depth first, on the top's mount;
/// skips vanished entries. False if a directory could not be read (counted as itself).
pub fn walk(dir: &Path, visit: &mut Visit) -> io::Result<bool> {
    let top = match Dir::open_nofollow(dir) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(true),
        Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", dir.display()))),
    };
    walk_dir(top, dir, Unseen::Skip, visit)
}

/// [`walk`] of the directory `top`, opened by the caller; `dir` names it in messages. Every loan
/// ([`Unseen::Refuse`]) is given back however the walk ends.
pub fn walk_dir(top: Dir, dir: &Path, unseen: Unseen, visit: &mut Visit) -> io::Result<bool> {
    let at_top = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", dir.display()));
    let st = dir::fstat(&top).map_err(at_top)?;
    let mount = top.mount_id().map_err(at_top)?;
    visit(&top, c".", &st)?;
    let names = top.entries().map_err(at_top)?;
    let mut trail = Trail::default();
    let mut stack = vec![(Some(top), (st.st_dev, st.st_ino), names.into_iter(), None)];
    let walked = walk_levels(&mut stack, &mut trail, (dir, mount), unseen, visit);
    // Left by an error: climbing out reopens the levels closed, and gives their loans back; those
    // above a level that cannot be reopened are given back through their own handles.
    while !stack.is_empty() && climb(&mut stack, &mut trail).is_ok() {}
    for (.., lent) in stack.drain(..) {
        let _ = lent.map(|l| l.give_back());
    }
    walked
}

/// The walk of [`walk_dir`] from the levels on `stack` (`dir` names the top, on mount `mount`).
fn walk_levels(
    stack: &mut Vec<Level>,
    trail: &mut Trail,
    (dir, mount): (&Path, Option<u64>),
    unseen: Unseen,
    visit: &mut Visit,
) -> io::Result<bool> {
    let at_top = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", dir.display()));
    let gone = |e: &io::Error| e.raw_os_error() == Some(libc::ENOENT);
    let mut whole = true;
    // Each entry is compared with its own directory's device: a btrfs subvolume (a device of its
    // own on its parent's mount) is entered as the tree it is, and what it holds shares its device.
    while let Some((d, (dev, _), names, _)) = stack.last_mut() {
        let dev = *dev;
        crate::signals::check().map_err(|e| io::Error::new(io::ErrorKind::Interrupted, e))?;
        let d = d.as_ref().expect("the deepest levels are open");
        let Some(name) = names.next() else {
            climb(stack, trail).map_err(at_top)?;
            continue;
        };
        let bounded = |e: io::Error, trail: &Trail, name: &CStr| {
            io::Error::new(e.kind(), format!("{}: {e}", trail.show(dir, Some(name))))
        };
        let hidden = |trail: &Trail, name: &CStr, why: &str| {
            io::Error::other(format!("{}: {why}", trail.show(dir, Some(name))))
        };
        let st = match d.lstat_at(&name) {
            Ok(st) => st,
            Err(e) if gone(&e) => continue,
            // A directory we may list but not search (mode 600): its inside is not seen.
            Err(e) if e.raw_os_error() == Some(libc::EACCES) && unseen == Unseen::Skip => {
                whole = false;
                climb(stack, trail).map_err(at_top)?;
                continue;
            }
            Err(e) => return Err(bounded(e, trail, &name)),
        };
        let entered = match dir::file_type(&st) == libc::S_IFDIR || st.st_dev != dev {
            true => enter(d, &name, &st, (dev, mount), unseen),
            false => Ok(Entered::Leaf),
        };
        let sub = match entered.map_err(|e| bounded(e, trail, &name))? {
            Entered::Gone => continue,
            Entered::Mount if unseen == Unseen::Skip => continue,
            Entered::Mount => return Err(hidden(trail, &name, MOUNT)),
            Entered::Unread if unseen == Unseen::Skip => {
                whole = false;
                None
            }
            // Said as the visit says it where it can (another user's, with its owner).
            Entered::Unread => {
                visit(d, &name, &st).map_err(|e| bounded(e, trail, &name))?;
                return Err(hidden(trail, &name, UNREAD));
            }
            Entered::Leaf => None,
            Entered::Dir(sub, names, lent) => Some((sub, names, lent)),
        };
        visit(d, &name, &st).map_err(|e| bounded(e, trail, &name))?;
        if let Some((sub, names, lent)) = sub {
            trail.0.push(name);
            stack.push((Some(sub), (st.st_dev, st.st_ino), names.into_iter(), lent));
            if let Some(i) = stack.len().checked_sub(dir::OPEN_LEVELS + 1) {
                stack[i].0 = None;
            }
        }
    }
    Ok(whole)
}

const MOUNT: &str = "a mount point; unmount it first (nothing is deleted across a mount)";
const UNREAD: &str =
    "a directory that cannot be looked inside, so not all it holds can be known deletable";

/// What a walk finds at a directory (or another mount's) entry.
enum Entered {
    Gone,
    /// On another mount: no part of the tree.
    Mount,
    /// A directory we may not read.
    Unread,
    /// Not a directory.
    Leaf,
    /// Opened and listed, with its loan of owner access to give back, if lent.
    Dir(Dir, Vec<CString>, Option<LentMode>),
}

/// Opens the entry `name` of `d` (stat `st`), a directory or on another device than the tree's
/// (`dev`, `mount`), to walk it; with [`Unseen::Refuse`], one of ours that keeps us out is lent
/// owner access first. A file is on another mount only if its mount id says so (overlayfs gives
/// files the device of the layer holding them).
fn enter(
    d: &Dir,
    name: &CStr,
    st: &libc::stat,
    (dev, mount): (u64, Option<u64>),
    unseen: Unseen,
) -> io::Result<Entered> {
    let gone = |e: &io::Error| e.raw_os_error() == Some(libc::ENOENT);
    let name = OsStr::from_bytes(name.to_bytes());
    // Only on another device is a file entered here.
    if dir::file_type(st) != libc::S_IFDIR {
        let other = match d.mount_id_at(name) {
            Err(e) if gone(&e) => return Ok(Entered::Gone),
            here => mount.is_none() || here? != mount,
        };
        return Ok(if other { Entered::Mount } else { Entered::Leaf });
    }
    // Another device on the same mount is a btrfs subvolume: part of the tree.
    if st.st_dev != dev && !same_mount(d, name, mount)? {
        return Ok(Entered::Mount);
    }
    let lent = match lends(st, unseen) {
        false => None,
        true => match lend(d, name, st) {
            Err(e) if gone(&e) => return Ok(Entered::Gone),
            lent => Some(lent?),
        },
    };
    if lent.is_some() {
        crate::debug::pause("walk-lent");
    }
    let give_back = || {
        if let Some(l) = &lent {
            let _ = l.give_back();
        }
    };
    // A directory is opened before it is counted: a bind mount of this same filesystem has its
    // device number, and only the mount id tells it is not the tree. One lent is opened through
    // its loan's own handle: the name may lead elsewhere by now.
    let opened = match &lent {
        Some(l) => l.open(),
        None => d.sub(name),
    };
    let sub = match opened.inspect_err(|_| give_back()) {
        Ok(sub) => sub,
        Err(e) if gone(&e) => return Ok(Entered::Gone),
        Err(e) if e.raw_os_error() == Some(libc::EACCES) => return Ok(Entered::Unread),
        Err(e) => return Err(e),
    };
    let here = sub.mount_id().inspect_err(|_| give_back())?;
    if mount.is_some() && here != mount {
        give_back();
        return Ok(Entered::Mount);
    }
    // A listing never fails for a directory gone (`Dir::listing`); one refused (failing would
    // leave the image unmeasured, counted as nothing against gc's budget) is not seen.
    match sub.entries() {
        Ok(names) => Ok(Entered::Dir(sub, names, lent)),
        Err(e) if e.raw_os_error() == Some(libc::EACCES) => {
            give_back();
            Ok(Entered::Unread)
        }
        Err(e) => {
            give_back();
            Err(e)
        }
    }
}

/// Whether the entry `name` of `d` is on the mount `mount` (by mount id; where the kernel tells
/// none, it is taken for another).
fn same_mount(d: &Dir, name: &OsStr, mount: Option<u64>) -> io::Result<bool> {
    match d.mount_id_at(name) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        here => Ok(mount.is_some() && here? == mount),
    }
}

/// Whether the directory `st` is lent owner access to be walked: ours (not root's), its mode
/// keeping us out, and a chmod of ours would not clear its setgid bit (never given back then).
fn lends(st: &libc::stat, unseen: Unseen) -> bool {
    let me = nix::unistd::geteuid().as_raw();
    unseen == Unseen::Refuse
        && me != 0
        && st.st_uid == me
        && st.st_mode & 0o500 != 0o500
        && dir::chmod_keeps_setgid(st)
}

/// A directory lent owner read and search by a walk: its handle (`O_PATH`, the very inode, what
/// its name leads to since notwithstanding) and its mode before.
struct LentMode {
    anchor: Dir,
    mode: libc::mode_t,
}

impl LentMode {
    /// The lent directory opened to be listed, through its handle.
    fn open(&self) -> io::Result<Dir> {
        Dir::open(Path::new(&format!(
            "/proc/self/fd/{}",
            self.anchor.as_raw_fd()
        )))
    }

    fn give_back(&self) -> io::Result<()> {
        dir::chmod_o_path(self.anchor.as_raw_fd(), self.mode)
    }
}

/// Lends owner read and search to the directory `name` of `d`, still the inode `st`.
fn lend(d: &Dir, name: &OsStr, st: &libc::stat) -> io::Result<LentMode> {
    let anchor = d.anchor_sub(name)?;
    let now = anchor.stat()?;
    if (now.dev, now.ino) != (st.st_dev, st.st_ino) {
        return Err(io::Error::other("changed while looked at"));
    }
    let mode = st.st_mode & 0o7777;
    dir::chmod_o_path(anchor.as_raw_fd(), mode | 0o500)?;
    Ok(LentMode { anchor, mode })
}

/// A level of [`walk`]: its directory (closed far above the deepest), its identity, its names
/// left, and its loan of owner access to give back, if lent.
type Level = (
    Option<Dir>,
    (u64, u64),
    std::vec::IntoIter<CString>,
    Option<LentMode>,
);

/// Leaves the deepest level of a walk for the one above, reopened through `..` if it was closed,
/// then gives back its loan.
fn climb(stack: &mut Vec<Level>, trail: &mut Trail) -> io::Result<()> {
    let (done, _, _, lent) = stack.pop().expect("not empty");
    trail.0.pop();
    // Given back through its own handle, whatever else fails.
    let given = lent.map_or(Ok(()), |l| l.give_back());
    // Only after a climb failed (an error's way out) is the deepest closed.
    let done = done.ok_or_else(|| io::Error::other("a level above could not be reopened"))?;
    let reopened = match stack.last_mut() {
        Some((up @ None, id, ..)) => done.parent_checked(*id, "measured").map(|d| *up = Some(d)),
        _ => Ok(()),
    };
    given.and(reopened)
}

// The FIEMAP ioctl (linux/fiemap.h).
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
const FIEMAP_FLAG_SYNC: u32 = 0x1;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
const FIEMAP_EXTENT_UNKNOWN: u32 = 0x2;
const FIEMAP_EXTENT_DELALLOC: u32 = 0x4;
const FIEMAP_EXTENT_DATA_INLINE: u32 = 0x200;
const FIEMAP_EXTENT_SHARED: u32 = 0x2000;
const EXTENTS_PER_CALL: usize = 256;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapExtent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

#[repr(C)]
struct Fiemap {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
    extents: [FiemapExtent; EXTENTS_PER_CALL],
}

/// Bytes of `name`'s extents flagged shared (0 if it cannot be mapped); ranges go to `ranges`.
/// Only a termination signal fails it: a file of a million extents takes thousands of calls.
fn shared_extents(parent: &Dir, name: &CStr, ranges: &mut Vec<(u64, u64)>) -> io::Result<u64> {
    let flags =
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY;
    let Ok(file) = parent.open_at(name, flags, 0) else {
        return Ok(0);
    };
    let mut map: Box<Fiemap> = Box::new(Fiemap {
        start: 0,
        length: u64::MAX,
        // Dirty data written back first: btrfs maps it to where it was, an extent the file may no
        // longer share (a clone's rewrite read as shared with its base until the next sync).
        flags: FIEMAP_FLAG_SYNC,
        mapped_extents: 0,
        extent_count: EXTENTS_PER_CALL as u32,
        reserved: 0,
        extents: [FiemapExtent::default(); EXTENTS_PER_CALL],
    });
    let mut shared = 0u64;
    let fd = file.as_raw_fd();
    loop {
        crate::signals::check().map_err(|e| io::Error::new(io::ErrorKind::Interrupted, e))?;
        // SAFETY: `map` is a fiemap header followed by room for extent_count extents, as required.
        if unsafe { libc::ioctl(fd, FS_IOC_FIEMAP as _, &mut *map as *mut Fiemap) } != 0 {
            return Ok(shared);
        }
        let n = (map.mapped_extents as usize).min(EXTENTS_PER_CALL);
        if n == 0 {
            return Ok(shared);
        }
        let mut last = false;
        for e in &map.extents[..n] {
            last |= e.flags & FIEMAP_EXTENT_LAST != 0;
            let unplaced =
                FIEMAP_EXTENT_UNKNOWN | FIEMAP_EXTENT_DELALLOC | FIEMAP_EXTENT_DATA_INLINE;
            if e.flags & FIEMAP_EXTENT_SHARED != 0 && e.flags & unplaced == 0 {
                shared += e.length;
                ranges.push((e.physical, e.physical.saturating_add(e.length)));
            }
        }
        let e = map.extents[n - 1];
        if last || n < EXTENTS_PER_CALL {
            return Ok(shared);
        }
        map.start = e.logical.saturating_add(e.length);
        map.length = u64::MAX - map.start;
        map.mapped_extents = 0;
    }
}

/// Sorts ranges and merges those that overlap or touch.
fn merge(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (s, e) in ranges {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// What a set of images shares, each range and inode counted once however many refer to it.
#[derive(Debug, Default)]
pub struct Footprint {
    /// Disjoint segments `start → (end, how many images refer to it)`.
    segs: BTreeMap<u64, (u64, u32)>,
    /// Inodes with several names, by (device, inode).
    inodes: HashMap<(u64, u64), Named>,
}

/// An inode with several names, as the images together hold it.
#[derive(Debug, Clone, Copy)]
struct Named {
    bytes: u64,
    /// How many images name it.
    images: u32,
    /// Its names in those images, and on the filesystem.
    names: u64,
    nlink: u64,
}

impl Named {
    /// Named outside the images too (a file a build hard-linked from elsewhere): removing every
    /// image leaves it allocated, so it is none of theirs to free.
    fn kept_outside(&self) -> bool {
        self.names < self.nlink
    }
}

impl Footprint {
    /// From each image's shares.
    pub fn new<'a>(images: impl IntoIterator<Item = &'a Shares> + Clone) -> Footprint {
        let mut points: Vec<u64> = images
            .clone()
            .into_iter()
            .flat_map(|sh| sh.ranges.iter().flat_map(|&(s, e)| [s, e]))
            .collect();
        points.sort_unstable();
        points.dedup();
        let segs = points.windows(2).map(|w| (w[0], (w[1], 0))).collect();
        let mut fp = Footprint {
            segs,
            inodes: HashMap::new(),
        };
        for sh in images {
            fp.count(sh, true);
        }
        fp
    }

    /// Counts an image's shares in (`add`), or out: its names go with it, from `st_nlink` too.
    fn count(&mut self, sh: &Shares, add: bool) {
        let by = |n: &mut u32| *n = if add { *n + 1 } else { n.saturating_sub(1) };
        for &(s, e) in &sh.ranges {
            self.segs
                .range_mut(s..e)
                .for_each(|(_, seg)| by(&mut seg.1));
        }
        for l in &sh.inodes {
            let named = self.inodes.entry(l.key).or_insert(Named {
                bytes: l.bytes,
                images: 0,
                names: 0,
                nlink: 0,
            });
            by(&mut named.images);
            if add {
                named.names += l.names;
                // Measured apart, images may see a link made between their walks.
                named.nlink = named.nlink.max(l.nlink);
            } else {
                named.names = named.names.saturating_sub(l.names);
                named.nlink = named.nlink.saturating_sub(l.names);
            }
        }
    }

    /// Bytes referred to by at least one image.
    pub fn bytes(&self) -> u64 {
        let used = self.segs.iter().filter(|(_, (_, n))| *n > 0);
        let inodes = (self.inodes.values()).filter(|i| i.images > 0 && !i.kept_outside());
        used.map(|(s, (e, _))| e - s).sum::<u64>() + inodes.map(|i| i.bytes).sum::<u64>()
    }

    /// Bytes of `sh` that no other image refers to.
    pub fn unique(&self, sh: &Shares) -> u64 {
        let segs = sh.ranges.iter().flat_map(|&(s, e)| self.segs.range(s..e));
        let segs = segs.filter(|(_, (_, n))| *n == 1).map(|(s, (e, _))| e - s);
        let inodes = sh.inodes.iter().filter_map(|l| self.inodes.get(&l.key));
        let inodes = inodes.filter(|i| i.images == 1 && !i.kept_outside());
        segs.sum::<u64>() + inodes.map(|i| i.bytes).sum::<u64>()
    }

    /// Bytes of an image measured as `m` that others hold too: ranges another image refers to,
    /// inodes another image or a name outside holds. An extent flagged shared that no other image
    /// refers to is the image's own (shared outside, or left by a rewrite since).
    pub fn shared(&self, m: &Measure) -> u64 {
        let segs = (m.shares.ranges.iter()).flat_map(|&(s, e)| self.segs.range(s..e));
        let segs = segs.filter(|(_, (_, n))| *n > 1).map(|(s, (e, _))| e - s);
        let inodes = (m.shares.inodes.iter()).filter_map(|l| self.inodes.get(&l.key));
        let inodes = inodes.filter(|i| i.images > 1 || i.kept_outside());
        segs.sum::<u64>() + inodes.map(|i| i.bytes).sum::<u64>()
    }

    /// Forgets an image's shares.
    pub fn release(&mut self, sh: &Shares) {
        self.count(sh, false);
    }
}

/// "1.5 GiB" — for tables.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// Bytes allocated under `dir`. A missing directory uses nothing.
    fn disk_usage(dir: &Path) -> io::Result<u64> {
        Ok(measure(dir, false)?.allocated)
    }

    #[test]
    fn counts_hard_links_once_and_skips_symlink_targets() {
        let d = tempfile::tempdir().unwrap();
        let big = d.path().join("big");
        fs::write(&big, vec![1u8; 1 << 20]).unwrap();
        let one = disk_usage(d.path()).unwrap();
        fs::hard_link(&big, d.path().join("again")).unwrap();
        assert_eq!(disk_usage(d.path()).unwrap(), one);
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("huge"), vec![1u8; 4 << 20]).unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("link")).unwrap();
        assert!(disk_usage(d.path()).unwrap() < one + 64 * 1024);
        assert!(one >= 1 << 20);
    }

    #[test]
    fn deleting_frees_no_file_a_name_outside_keeps() {
        let top = tempfile::tempdir().unwrap();
        let d = top.path().join("tree");
        fs::create_dir(&d).unwrap();
        fs::write(d.join("inside"), vec![1u8; 1 << 20]).unwrap();
        fs::hard_link(d.join("inside"), d.join("again")).unwrap();
        fs::write(top.path().join("outside"), vec![1u8; 4 << 20]).unwrap();
        fs::hard_link(top.path().join("outside"), d.join("linked")).unwrap();
        let m = measure(&d, false).unwrap();
        assert!(m.allocated >= 5 << 20, "{m:?}");
        assert!((1 << 20..2 << 20).contains(&m.freed()), "{m:?}");
        assert_eq!(freed_by_deleting(&d).unwrap(), m.freed());
    }

    #[test]
    fn missing_dir_is_empty() {
        assert_eq!(disk_usage(Path::new("/nonexistent/x")).unwrap(), 0);
    }

    #[test]
    fn footprint_counts_shared_ranges_and_inodes_once() {
        let shares = |ranges: &[(u64, u64)]| Shares {
            ranges: ranges.to_vec(),
            inodes: Vec::new(),
        };
        let (base, clone1, clone2) = (
            shares(&[(0, 100)]),
            shares(&[(0, 100)]),
            shares(&[(50, 150)]),
        );
        let mut fp = Footprint::new([&base, &clone1, &clone2]);
        assert_eq!(fp.bytes(), 150);
        assert_eq!(fp.unique(&base), 0);
        assert_eq!(fp.unique(&clone2), 50);
        fp.release(&base);
        assert_eq!(fp.bytes(), 150);
        fp.release(&clone1);
        assert_eq!(fp.bytes(), 100);
        fp.release(&clone2);
        assert_eq!(fp.bytes(), 0);
        // A file hard-linked into a second image: its bytes once, freed only with both. One
        // also named outside the images: never theirs to free.
        let inode = |ino, bytes, nlink| Linked {
            key: (1, ino),
            bytes,
            names: 1,
            nlink,
        };
        let linked = |n| Shares {
            ranges: Vec::new(),
            inodes: vec![inode(7, 4096, 2), inode(n, 512, 2), inode(n + 2, 256, 2)],
        };
        let (mut a, b) = (linked(8), linked(9));
        a.inodes[1].names = 2;
        let mut fp = Footprint::new([&a, &b]);
        assert_eq!((fp.bytes(), fp.unique(&a)), (4096 + 512, 512));
        fp.release(&a);
        assert_eq!((fp.bytes(), fp.unique(&b)), (4096, 4096));
        assert_eq!(
            merge(vec![(5, 9), (0, 3), (3, 4), (8, 12)]),
            vec![(0, 4), (5, 12)]
        );
    }

    #[test]
    fn walks_deeper_than_path_max() {
        let d = tempfile::tempdir().unwrap();
        let mut dir = Dir::open_nofollow(d.path()).unwrap();
        let name = "d".repeat(200);
        for _ in 0..40 {
            dir.mkdir(&name, 0o755).unwrap();
            dir = dir.sub(&name).unwrap();
        }
        let f = dir.create_file("f", 0o644).unwrap();
        std::io::Write::write_all(&mut &f, &[1u8; 8192]).unwrap();
        drop(f);
        assert!(disk_usage(d.path()).unwrap() >= 8192);
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
    }
}
