//! File locks: the only module that calls flock(2); everything else asks for a [`Guard`]. Why
//! each rule: docs/design.md, "Locks".
//!
//! - Open mode: read-write (NFS's flock needs it for exclusive), close-on-exec
//!   ([`Guard::set_inheritable`]), non-blocking, no symlink followed; only a regular file locked.
//! - The unlink race: only an exclusive holder unlinks, after [`mark_gone`]; acquirers check they
//!   locked the file at the path (by proving contents, else device and inode), retrying a ghost.
//! - NFS may answer `lstat` from its cache, so there the check re-opens the path; `ESTALE` means
//!   retry. Lock files are never unlinked on a filesystem not known local (`Root::unlink_lock`).
//! - On shared filesystems lock files and leases are `O_DSYNC`: a write is one stable request,
//!   seen by other hosts, and [`sync_written`] sends none.
//! - A guard is released by close, never `LOCK_UN`, which would drop an inheritor's lock. A probe
//!   lets go by `LOCK_UN` (`let_go`): on FUSE a close's release is asynchronous.
//! - A look that changes nothing asks by [`query`] (`F_OFD_GETLK`, no lock taken) where the
//!   filesystem answers it for every host's flocks; elsewhere by try-lock ([`probe`]).
//! - Contention is a value: [`acquire_no_wait`]'s `Ok(None)`, a timed wait's [`Waited::TimedOut`].
//! - Waits sleep in flock(2) in a helper thread, interrupted by a no-op signal; without a thread,
//!   for the wait or for signals (a pids limit), they poll. A slot waiter sleeps on one [`Waker`]
//!   (inotify) for its [`FileSet`].

#![allow(clippy::disallowed_methods)] // this is the one module that may call flock

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt as _, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};

use fs2::FileExt;

use crate::error::{cvt, locked};

mod wait;

use crate::ident::STOWAGE;
use wait::block;
pub use wait::{
    REMOTE_REARM, Reconnect, Wait, Waited, Waker, Woke, before_waiting, disarm_wake_signal,
    interrupt_waits, interrupted, polls, starting_to_wait, wake_signal,
    watch_signals_while_waiting,
};

/// How a lock is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Shared,
    Exclusive,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Shared => "shared",
            Mode::Exclusive => "exclusive",
        }
    }

    /// "read"/"write", as messages about image locks say it.
    pub fn verb(self) -> &'static str {
        match self {
            Mode::Shared => "read",
            Mode::Exclusive => "write",
        }
    }
}

/// A held lock. Dropping it closes the descriptor, releasing the lock unless a child process
/// inherited the descriptor (then the lock lives until the child closes it too).
#[must_use = "the lock is released when the guard is dropped"]
#[derive(Debug)]
pub struct Guard {
    file: File,
    path: PathBuf,
    mode: Mode,
    /// Device and inode, from the unlink-race check, else fstat'ed when first wanted.
    id: OnceLock<(u64, u64)>,
}

impl AsRawFd for Guard {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl Guard {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Device and inode of the locked file, as in /proc/locks; (0, 0), no file's, if fstat fails.
    pub fn identity(&self) -> (u64, u64) {
        *self
            .id
            .get_or_init(|| fd_identity(self.file.as_raw_fd()).unwrap_or((0, 0)))
    }

    /// Whether a spawned child inherits the descriptor, and so keeps the lock (default: no).
    pub fn set_inheritable(&self, inherit: bool) -> io::Result<()> {
        set_cloexec(self.file.as_raw_fd(), !inherit)
    }

    /// Replaces the lock file's contents through the locked descriptor (never the path, where a
    /// symlink may be planted since); written before the tail is cut: a reader never finds it empty.
    pub fn set_contents(&self, bytes: &[u8]) -> io::Result<()> {
        self.file.write_all_at(bytes, 0)?;
        self.file.set_len(bytes.len() as u64)?;
        // On NFS a write reaches the server (and other hosts) on a sync or close; we stay open.
        sync_written(&self.file)
    }

    /// Checks in one request that the lock is still ours before a holder writes (an NFS server drops
    /// locks after a partition longer than its lease): a non-blocking flock of the held mode.
    pub fn still_held(&self) -> io::Result<()> {
        // Test hook: this lock file's lock is lost, as an NFS lock to lease expiry.
        let lost = std::env::var_os(crate::env::DEBUG_LOST_LOCK);
        if lost.is_some_and(|v| self.path.file_name() == Some(v.as_os_str())) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        match flock_try(&self.file, self.mode) {
            Ok(true) => Ok(()),
            Ok(false) => Err(io::Error::other("the lock is held by someone else now")),
            // GlusterFS with strict locks: a descriptor that held locks is not reopened on a reconnect.
            Err(e) if e.raw_os_error() == Some(libc::EBADFD) => Err(io::Error::new(
                e.kind(),
                "its connection to the server dropped",
            )),
            Err(e) => Err(e),
        }
    }

    /// Whether a lock that [may be lost](Guard::may_be_lost) was lost while held: `Some(cause)`. An
    /// exclusive lock is first tried shared through a fresh descriptor: granted, ours was dropped (a
    /// try through our own would be granted anew: a GlusterFS client reconnects with its files
    /// reopened without locks). Then [`Guard::still_held`]: another may hold it now.
    pub fn lost(&self) -> Option<String> {
        if !self.may_be_lost() {
            return None;
        }
        if self.mode == Mode::Exclusive {
            let dropped = found(open(&self.path, IfMissing::Fail)).and_then(|f| match f {
                Some(fresh) => no_writer_now(&fresh),
                None => Err(io::Error::other("its lock file is gone")),
            });
            match dropped {
                Ok(false) => {}
                Ok(true) => return Some("the server holds it for us no more".to_owned()),
                Err(why) => return Some(format!("it cannot be asked: {why}")),
            }
        }
        self.still_held().err().map(|e| e.to_string())
    }

    /// Whether the lock can be lost while held: on a filesystem not known local, a server drops
    /// the locks of a client it lost touch with (NFS lease expiry, a GlusterFS reconnect).
    pub fn may_be_lost(&self) -> bool {
        !local_dir(&self.path, None)
    }

    /// Unlinks a lease (`lease.rs`) on every filesystem, else NFS keeps one per exec: unlike a lock
    /// file, it has one owner, who made it under a fresh name and checks it after locking.
    pub fn unlink_lease(self) -> io::Result<()> {
        assert_eq!(
            self.mode,
            Mode::Exclusive,
            "unlink needs the exclusive lock"
        );
        found(fs::remove_file(&self.path)).map(drop)
    }

    /// The locked file, for writing what it says about its holder (a lease).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Whether the locked file has no other name (one `fstat`), before a hint is written into it.
    pub fn has_one_name(&self) -> bool {
        crate::planted::check_written(&self.path, &self.file).is_ok()
    }

    /// [`Guard::has_one_name`], and if so when the file was last written by the filesystem's clock
    /// (`Some(None)` where not told), in the same `fstat`.
    pub fn one_name_written(&self) -> Option<Option<crate::clock::Millis>> {
        crate::planted::check_written_dated(&self.path, &self.file).ok()
    }
}

/// Opens an existing lock file, unlocked, to write a hint: `None` if missing. Only a regular file
/// with no other name (`fstat`).
pub fn open_existing(path: &Path) -> io::Result<Option<File>> {
    let opened = open(path, IfMissing::Fail);
    found(opened.and_then(|f| crate::planted::check_written(path, &f).map(|()| f)))
}

/// An existing lock file opened with no lock of ours, for a command that works under the lock an
/// enclosing command holds (`nested.rs`): read through, never written; its close releases nothing.
/// `None` if missing.
pub fn open_under(path: &Path, mode: Mode) -> io::Result<Option<Guard>> {
    Ok(open_existing_read(path)?.map(|file| guard(file, path, mode, None)))
}

/// [`open_existing`] for a file only read or locked: only its type is checked, so a lock file with
/// other names (a store copied by `cp -al`) is read.
pub fn open_existing_read(path: &Path) -> io::Result<Option<File>> {
    found(open_to_look(path).and_then(|f| crate::planted::check(path, &f).map(|()| f)))
}

/// Opens an existing lock file to read it or to ask who holds it: read-write, as lock files are
/// opened, else read-only where this view may not write it (the store through a read-only mount,
/// another user's file): a flock is taken and seen through either, so a holder is still seen.
fn open_to_look(path: &Path) -> io::Result<File> {
    match open(path, IfMissing::Fail) {
        Err(e)
            if e.raw_os_error() == Some(libc::EROFS)
                || e.kind() == io::ErrorKind::PermissionDenied =>
        {
            crate::planted::open(path, libc::O_RDONLY, 0).map_err(|r| match r.kind() {
                io::ErrorKind::PermissionDenied => e,
                _ => r,
            })
        }
        other => other,
    }
}

/// `Ok(None)` for `NotFound`.
fn found<T>(r: io::Result<T>) -> io::Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Opens a lock file: read-write, close-on-exec, no symlink in any component, never blocking (a
/// planted FIFO opens, and is refused by the type check after locking or before a wait).
fn open(path: &Path, missing: IfMissing) -> io::Result<File> {
    let create = match missing {
        IfMissing::Create => libc::O_CREAT,
        IfMissing::Fail => 0,
    };
    let flags = libc::O_RDWR | create | write_through_flag();
    crate::planted::open(path, flags, 0o666).map_err(|e| match e.kind() {
        io::ErrorKind::PermissionDenied => {
            let path = path.to_owned();
            io::Error::new(e.kind(), Denied { path, cause: e })
        }
        _ => e,
    })
}

/// A lock file we may not open, with its path: the message names it, whatever lock was asked for.
#[derive(Debug, thiserror::Error)]
#[error("{cause}")]
struct Denied {
    path: PathBuf,
    cause: io::Error,
}

/// A shared flock on a directory descriptor, without waiting, only so `/proc/self/fdinfo` gives
/// the lock table's device number for that filesystem (`kernel::device_of`).
pub fn flock_dir_shared(fd: RawFd) -> io::Result<()> {
    // SAFETY: flock on a descriptor the caller owns; no memory is passed.
    cvt(unsafe { libc::flock(fd, libc::LOCK_SH | libc::LOCK_NB) }).map(drop)
}

/// An exclusive flock on a directory descriptor, waited for in short sleeps (its holders keep it
/// for milliseconds); none where the filesystem takes none on directories (NFS). Held until the
/// descriptor closes.
pub fn flock_dir_exclusive(fd: RawFd) {
    // SAFETY: flock on a descriptor the caller owns; no memory is passed.
    while let Err(e) = cvt(unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) }) {
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Sets or clears close-on-exec on `fd`: whether a spawned child inherits it (and any lock on it).
pub fn set_cloexec(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: plain fcntl on a descriptor the caller names; no memory is passed.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    let flags = if on {
        flags | libc::FD_CLOEXEC
    } else {
        flags & !libc::FD_CLOEXEC
    };
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, flags) }).map(drop)
}

pub(super) fn flock_try(file: &File, mode: Mode) -> io::Result<bool> {
    #[cfg(test)]
    if let Some(errno) = tests::injected() {
        return Err(io::Error::from_raw_os_error(errno));
    }
    let r = match mode {
        Mode::Shared => FileExt::try_lock_shared(file),
        Mode::Exclusive => FileExt::try_lock_exclusive(file),
    };
    match r {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == fs2::lock_contended_error().raw_os_error() => Ok(false),
        Err(e) => Err(e),
    }
}

pub(super) fn flock_blocking(file: &File, mode: Mode) -> io::Result<()> {
    match mode {
        Mode::Shared => FileExt::lock_shared(file),
        Mode::Exclusive => FileExt::lock_exclusive(file),
    }
}

/// Whether lock files in `path`'s directory may be unlinked: only on a local filesystem.
pub fn unlinks_allowed(path: &Path) -> bool {
    local_dir(path, None)
}

/// Whether `path`'s directory is on a local filesystem. `dev`, a file's device there if known,
/// names the filesystem: a root's lock directories cost one statfs in all.
fn local_dir(path: &Path, dev: Option<u64>) -> bool {
    let dir = path.parent().unwrap_or(Path::new("/"));
    let mut seen = locked(&SEEN);
    if let Some((_, _, local)) = seen
        .iter()
        .find(|(d, v, _)| d.as_deref() == Some(dir) || (dev.is_some() && *v == dev))
    {
        return *local;
    }
    // Unknown counts as shared: the careful side.
    let local = crate::filesystem::filesystem(dir).is_ok_and(|f| f.local);
    seen.push((Some(dir.to_owned()), dev, local));
    local
}

/// Known filesystems: directory or device, and whether local.
type Seen = Vec<(Option<PathBuf>, Option<u64>, bool)>;
static SEEN: Mutex<Seen> = Mutex::new(Vec::new());

/// Records the root's device and locality from its checks: lock files under it cost no statfs.
pub fn note_filesystem(dev: u64, local: bool, dirs: &[PathBuf]) {
    let mut seen = locked(&SEEN);
    if !seen.iter().any(|(_, v, _)| *v == Some(dev)) {
        seen.push((None, Some(dev), local));
    }
    // Lock directories by name too: one is asked for by path where no lock file is stat'ed.
    for d in dirs {
        if !seen.iter().any(|(s, _, _)| s.as_ref() == Some(d)) {
            seen.push((Some(d.clone()), Some(dev), local));
        }
    }
}

static WRITE_THROUGH: AtomicBool = AtomicBool::new(false);

/// From now on opens lock files and leases written through (`O_DSYNC`) if `on` (a shared root).
pub fn set_write_through(on: bool) {
    WRITE_THROUGH.store(on, Relaxed);
}

/// The open flag that writes through, where the root is shared.
pub fn write_through_flag() -> libc::c_int {
    if WRITE_THROUGH.load(Relaxed) {
        libc::O_DSYNC
    } else {
        0
    }
}

/// Makes `file`'s writes durable and visible to other hosts: `fdatasync`, unless it is `O_DSYNC`
/// (each write synced already; on NFS or GlusterFS a sync is one more server request).
pub fn sync_written(file: &File) -> io::Result<()> {
    // SAFETY: F_GETFL on a descriptor we own.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags >= 0 && flags & libc::O_DSYNC == libc::O_DSYNC {
        return Ok(());
    }
    file.sync_data()
}

/// `ESTALE`: another host unlinked the file on the (NFS) server; a lock retries with a fresh open.
fn is_stale(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ESTALE)
}

/// A descriptor lost with its connection to the server (`EBADFD`: GlusterFS's answer, after its
/// client reconnects, on one in use meanwhile) or no connection now (`ENOTCONN`): a fresh open
/// after a pause works once the client has reconnected.
pub fn is_disconnected(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EBADFD | libc::ENOTCONN))
}

/// Whether [`is_disconnected`] says an error's cause (any in its chain).
pub fn disconnected_in(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<io::Error>())
        .any(is_disconnected)
}

/// Is the file we locked still the one at `path`? If so, its device and inode.
fn still_linked(file: &File, path: &Path) -> io::Result<Option<(u64, u64)>> {
    let ours = match file.metadata() {
        Ok(m) => m,
        // NFS: the file was unlinked on the server since we opened it.
        Err(e) if is_stale(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    if ours.nlink() == 0 {
        return Ok(None);
    }
    // The stat made anyway refuses, naming it, a planted FIFO or a hard link (a record written
    // into it would change the file of its other names, which may lie outside the root).
    crate::planted::check_stat(path, &ours)?;
    let at = if local_dir(path, Some(ours.dev())) {
        fs::symlink_metadata(path)
    } else {
        // A path stat may hit client caches; an open asks the server (close-to-open consistency).
        open(path, IfMissing::Fail).and_then(|f| f.metadata())
    };
    match at {
        Ok(at) => Ok((dev_ino(&at) == dev_ino(&ours)).then(|| dev_ino(&ours))),
        // Something else planted at the path since is refused by the open (not the stat).
        Err(e) if gone(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Missing, unlinked on the server (`ESTALE`), or something planted in its place: not the file.
fn gone(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || is_stale(e) || crate::planted::find(e).is_some()
}

fn dev_ino(m: &fs::Metadata) -> (u64, u64) {
    (m.dev(), m.ino())
}

/// Retries of a lock found unlinked: each means a holder deleted it, which cannot go on forever.
const MAX_GHOSTS: usize = 1000;

fn ghost_error(path: &Path) -> io::Error {
    io::Error::other(format!(
        "lock file {} keeps being replaced while locking it",
        path.display()
    ))
}

/// What taking a lock does when its file does not exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfMissing {
    /// Creates the lock file (mode 0666 less the umask).
    Create,
    /// Fails with `NotFound`, for the caller to judge (no such image, a lock nobody ever took).
    Fail,
}

impl IfMissing {
    pub fn create_if(create: bool) -> IfMissing {
        if create {
            IfMissing::Create
        } else {
            IfMissing::Fail
        }
    }
}

/// [`acquire_no_wait`] where `read` reads the locked file and says whether its contents prove it is
/// still the file at its path (a record, or no [`GONE`] mark): a proof spares the unlink-race stat
/// (on NFS, a lookup at the server).
pub fn acquire_no_wait_with<T>(
    path: &Path,
    mode: Mode,
    missing: IfMissing,
    mut read: impl FnMut(&File) -> (T, bool),
) -> io::Result<Option<(Guard, T)>> {
    for _ in 0..MAX_GHOSTS {
        let file = open(path, missing)?;
        match flock_try(&file, mode) {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(e) if is_stale(&e) => continue,
            Err(e) => return Err(e),
        }
        let (found, proven) = read(&file);
        if proven {
            return Ok(Some((guard(file, path, mode, None), found)));
        }
        if let Some(linked) = still_linked(&file, path)? {
            return Ok(Some((guard(file, path, mode, Some(linked)), found)));
        }
    }
    Err(ghost_error(path))
}

/// What an unlinker leaves in a lock file: the only contents that do not prove it is still there.
pub const GONE: &[u8] = b"stowage-unlinked\n";

/// Marks a lock file we hold exclusively gone, before unlinking it: a process that locks it after
/// the unlink reads the mark and knows it locked a ghost (nothing else it could read says so).
pub fn mark_gone(file: &File) -> io::Result<()> {
    file.set_len(0)?;
    // Emptied, it already proves nothing where lock files are unlinked (only a record does): a
    // disk too full for the mark keeps no lock file of an image that is gone.
    match file.write_all_at(GONE, 0) {
        Err(e) if crate::space::is_full_io(&e) => Ok(()),
        marked => marked,
    }
}

/// Makes a fresh lock file at `path` (`O_EXCL`, written through where shared) and locks it
/// exclusively: a lease. No unlink-race check: a prober cleaning dead leases leaves an unwritten
/// file unless its maker is dead or slower than any (which checks with [`still_at_path`]). A
/// prober's lock is waited out briefly. `Ok(None)`: the name exists or stayed locked; take another.
pub fn create_locked(path: &Path) -> io::Result<Option<Guard>> {
    let file = match OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o666)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | write_through_flag())
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(None),
        Err(e) => return Err(e),
    };
    for _ in 0..20 {
        if flock_try(&file, Mode::Exclusive)? {
            return Ok(Some(guard(file, path, Mode::Exclusive, None)));
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Ok(None)
}

/// The unlink-race check, late, for a lock taken without it ([`create_locked`]).
pub fn still_at_path(guard: &Guard) -> io::Result<bool> {
    Ok(still_linked(&guard.file, &guard.path)?.is_some())
}

/// Takes the lock if it is free right now; `Ok(None)` if busy.
pub fn acquire_no_wait(path: &Path, mode: Mode, missing: IfMissing) -> io::Result<Option<Guard>> {
    Ok(acquire_no_wait_with(path, mode, missing, |_| ((), false))?.map(|(g, ())| g))
}

/// Takes the lock, waiting as `wait` allows. Tries first without blocking. A descriptor lost with
/// its connection to the server ([`is_disconnected`]) is dropped and the wait goes on afresh after
/// a pause ([`Reconnect`]): holding nothing yet, a waiter loses nothing by it.
pub fn acquire(
    path: &Path,
    mode: Mode,
    missing: IfMissing,
    wait: &mut Wait,
) -> io::Result<Waited<Guard>> {
    let mut reconnect = Reconnect::default();
    let mut ghosts = 0;
    loop {
        match acquire_once(path, mode, missing, wait) {
            Ok(Some(done)) => return Ok(done),
            // A ghost, or gone on the server (ESTALE): start over with a fresh open.
            Ok(None) if ghosts + 1 < MAX_GHOSTS => ghosts += 1,
            Ok(None) => return Err(ghost_error(path)),
            Err(e) if is_disconnected(&e) => {
                if let Some(end) = reconnect.pause(e, wait.deadline)? {
                    return Ok(end);
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// One open of `path` and a wait on it: `None` if what it locked is no longer the file at `path`.
fn acquire_once(
    path: &Path,
    mode: Mode,
    missing: IfMissing,
    wait: &mut Wait,
) -> io::Result<Option<Waited<Guard>>> {
    let file = open(path, missing)?;
    let blocked = match flock_try(&file, mode) {
        Ok(false) => {
            // Before waiting (off the fast path), a locked FIFO is refused by name, not waited for.
            crate::planted::check(path, &file)?;
            block(&file, mode, wait)
        }
        other => other.map(|_| Waited::Acquired(())),
    };
    match blocked {
        Ok(Waited::Acquired(())) => {}
        Ok(Waited::TimedOut) => return Ok(Some(Waited::TimedOut)),
        Ok(Waited::Interrupted(sig)) => return Ok(Some(Waited::Interrupted(sig))),
        Err(e) if is_stale(&e) => return Ok(None),
        Err(e) => return Err(e),
    }
    let linked = still_linked(&file, path)?;
    Ok(linked.map(|linked| Waited::Acquired(guard(file, path, mode, Some(linked)))))
}

fn guard(file: File, path: &Path, mode: Mode, id: Option<(u64, u64)>) -> Guard {
    Guard {
        file,
        path: path.to_owned(),
        mode,
        id: id.map(OnceLock::from).unwrap_or_default(),
    }
}

pub fn fd_identity(fd: RawFd) -> Option<(u64, u64)> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into a zeroed stat we own; an fd that is not open fails with EBADF.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some((st.st_dev, st.st_ino))
}

/// What a lock file's lock looks like from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    Missing,
    Free,
    Shared,
    Exclusive,
}

/// Whether anyone holds the lock, without waiting. It briefly takes the lock (shared, then
/// exclusive), so a concurrent try may find it busy for microseconds.
pub fn probe(path: &Path) -> io::Result<Probe> {
    let Some(file) = found(open_to_look(path))? else {
        return Ok(Probe::Missing);
    };
    if !flock_try(&file, Mode::Shared)? {
        return Ok(Probe::Exclusive);
    }
    // Held shared: the upgrade succeeds only if nobody else holds it (a failure leaves us unlocked
    // here, maybe not at a FUSE server, so either way we let go).
    let upgraded = flock_try(&file, Mode::Exclusive);
    let_go(&file);
    Ok(match upgraded? {
        true => Probe::Free,
        false => Probe::Shared,
    })
}

/// Whether anyone holds the lock, asked without taking it (`F_OFD_GETLK`, read-only): only where
/// such a query sees flocks ([`crate::filesystem::Filesystem::queries_see_flocks`]).
pub fn query(path: &Path) -> io::Result<Probe> {
    let opened = crate::planted::open(path, libc::O_RDONLY, 0)
        .and_then(|f| crate::planted::check(path, &f).map(|()| f));
    let Some(file) = found(opened)? else {
        return Ok(Probe::Missing);
    };
    // SAFETY: a zeroed flock is a valid value; every field the query reads is set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: fcntl on our descriptor, with a pointer to a flock that outlives the call.
    cvt(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) })?;
    Ok(match i32::from(fl.l_type) {
        libc::F_UNLCK => Probe::Free,
        libc::F_RDLCK => Probe::Shared,
        _ => Probe::Exclusive,
    })
}

/// [`query`] where `queries`, else (or if refused) [`probe`]: how a look asks.
pub fn look(path: &Path, queries: bool) -> io::Result<Probe> {
    match queries.then(|| query(path)) {
        Some(Ok(p)) => Ok(p),
        _ => probe(path),
    }
}

/// Whether no writer holds an open lock file's lock now: a shared try, let go at once (no
/// unlink-race check: a ghost does no harm here).
pub fn no_writer_now(file: &File) -> io::Result<bool> {
    let free = flock_try(file, Mode::Shared)?;
    if free {
        let_go(file);
    }
    Ok(free)
}

/// Lets go of a probe's lock before its descriptor closes: on FUSE a close's release is sent after
/// the close returns, `LOCK_UN` waits for the server. Only for descriptors no child shares.
fn let_go(file: &File) {
    let _ = FileExt::unlock(file);
}

/// Judges a lease (`lease.rs`): true while its owner holds it exclusively, false once gone (file
/// missing, or a shared lock granted, dropped at once).
pub fn probe_lease(path: &Path) -> io::Result<bool> {
    let file = match open_to_look(path) {
        Ok(f) => f,
        // Gone (on an NFS server since the lookup), or planted under a lease's name: no owner.
        Err(e) if gone(&e) => return Ok(false),
        Err(e) => return Err(e),
    };
    Ok(!no_writer_now(&file)?)
}

/// `Ok(true)` if two opens of one file exclude each other here, as flock needs to mean anything.
pub fn opens_conflict(path: &Path) -> io::Result<bool> {
    let a = open(path, IfMissing::Create)?;
    let b = open(path, IfMissing::Fail)?;
    if !flock_try(&a, Mode::Exclusive)? {
        return Err(io::Error::other("the test file is locked by someone else"));
    }
    let conflict = !flock_try(&b, Mode::Exclusive)?;
    let_go(&b);
    let_go(&a);
    Ok(conflict)
}

/// Lock files tried again and again (slots), kept open while a waiter waits: its tries make no
/// close events that would wake other waiters ([`Waker`]).
pub struct FileSet {
    paths: Vec<PathBuf>,
    files: Vec<Option<File>>,
    /// Files found not to be regular files (planted): no slot, never held.
    skip: Vec<bool>,
    /// Files found planted, each told once by [`FileSet::replaced`].
    planted: Vec<bool>,
    /// Whether a path was found to hold another file than the one opened, or something planted.
    replaced: bool,
}

impl FileSet {
    pub fn new(paths: Vec<PathBuf>) -> FileSet {
        FileSet {
            files: paths.iter().map(|_| None).collect(),
            skip: vec![false; paths.len()],
            planted: vec![false; paths.len()],
            replaced: false,
            paths,
        }
    }

    /// Whether, since last asked, a file was found replaced at its path or planted: what the
    /// waiter read of the class's files may be wrong now (a planted record file refuses the class),
    /// and none of the closes it sleeps on may come.
    pub fn replaced(&mut self) -> bool {
        std::mem::take(&mut self.replaced)
    }

    fn found_planted(&mut self, i: usize) {
        self.replaced |= !std::mem::replace(&mut self.planted[i], true);
    }

    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Tries each file `wanted` accepts (by index) once, in order, creating missing ones: the first
    /// taken, with its index. A ghost is reopened next try.
    pub fn try_any_where(
        &mut self,
        wanted: impl Fn(usize) -> bool,
    ) -> io::Result<Option<(usize, Guard)>> {
        for i in 0..self.paths.len() {
            if !wanted(i) || self.skip[i] {
                continue;
            }
            if self.files[i].is_none() {
                match open(&self.paths[i], IfMissing::Create) {
                    Ok(f) => self.files[i] = Some(f),
                    // A plant under a slot's name is no slot (doctor reports it).
                    Err(e) if crate::planted::find(&e).is_some() => {
                        self.found_planted(i);
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            let file = self.files[i].as_ref().expect("opened above");
            match flock_try(file, Mode::Exclusive) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) if is_stale(&e) => {
                    self.files[i] = None;
                    self.replaced = true;
                    continue;
                }
                Err(e) => return Err(e),
            }
            let file = self.files[i].take().expect("opened above");
            match still_linked(&file, &self.paths[i]) {
                Ok(Some(linked)) => {
                    let g = guard(file, &self.paths[i], Mode::Exclusive, Some(linked));
                    return Ok(Some((i, g)));
                }
                Ok(None) => self.replaced = true,
                // A FIFO: kept open (a close would wake the waiters), skipped from now on.
                Err(e) if crate::planted::find(&e).is_some() => {
                    let _ = FileExt::unlock(&file);
                    self.files[i] = Some(file);
                    self.skip[i] = true;
                    self.found_planted(i);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Gives back a lock from [`FileSet::try_any_where`]: `LOCK_UN`, the descriptor kept open (a
    /// close would wake every waiter on the directory); no child ever had it.
    pub fn put_back(&mut self, i: usize, g: Guard) {
        let _ = FileExt::unlock(&g.file);
        self.files[i] = Some(g.file);
    }

    /// How many of the files `include` accepts someone holds now, asked through our own descriptors
    /// (no close to wake waiters). Missing and planted files count as free.
    pub fn held_count(&mut self, include: impl Fn(usize) -> bool) -> io::Result<usize> {
        let mut held = 0;
        for i in 0..self.paths.len() {
            if !include(i) || self.skip[i] {
                continue;
            }
            if self.files[i].is_none() {
                match open_existing_read(&self.paths[i]) {
                    Ok(Some(f)) => self.files[i] = Some(f),
                    Ok(None) => continue,
                    Err(e) if crate::planted::find(&e).is_some() => {
                        self.skip[i] = true;
                        self.found_planted(i);
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            let f = self.files[i].as_ref().expect("opened above");
            if flock_try(f, Mode::Exclusive)? {
                let_go(f);
            } else {
                held += 1;
            }
        }
        Ok(held)
    }
}

/// Wraps a lock failure: "locking is unavailable" is typed (exit 69), others name lock and file.
pub fn error(what: &str, path: &std::path::Path, e: io::Error) -> anyhow::Error {
    // The error names the wrong file, maybe not `path` (an image's gate, locked on the way).
    if let Some(planted) = crate::planted::find(&e) {
        return anyhow::anyhow!("cannot lock {what}: {planted}");
    }
    if crate::error::locking_unavailable(&e) {
        crate::error::Error::LockingUnavailable {
            what: what.to_owned(),
            path: path.to_owned(),
            cause: e,
        }
        .into()
    } else if e.kind() == io::ErrorKind::PermissionDenied {
        let denied_at = e.get_ref().and_then(|d| d.downcast_ref::<Denied>());
        let path = denied_at.map_or(path, |d| d.path.as_path());
        let why = crate::planted::denied(path).unwrap_or_else(|| denied(path));
        anyhow::anyhow!("cannot lock {what}: {why}")
    } else {
        anyhow::Error::new(e).context(format!("cannot lock {what} ({})", path.display()))
    }
}

/// Why lock file `path` could not be opened read-write, naming file or directory, and the fix.
fn denied(path: &Path) -> String {
    use nix::unistd::{AccessFlags, access};
    let dir = path.parent().unwrap_or(Path::new("/"));
    let cause = if path.exists() && access(path, AccessFlags::R_OK | AccessFlags::W_OK).is_err() {
        path
    } else {
        dir
    };
    let said = std::fs::metadata(cause).map_or_else(
        |e| format!("{}: {e}", cause.display()),
        |m| {
            format!(
                "{}: mode {:o}, group {}",
                cause.display(),
                m.mode() & 0o7777,
                m.gid()
            )
        },
    );
    let root = path
        .ancestors()
        .find(|a| a.file_name().is_some_and(|n| n == "locks"))
        .and_then(Path::parent);
    let store = root.and_then(|r| std::fs::metadata(r).ok());
    let doc = crate::error::GROUP_STORE_DOC;
    // The owner is kept out by a mode alone (a chmod): sharing is not the cause, nor its fix.
    let owner = store.as_ref().map(MetadataExt::uid) == Some(nix::unistd::geteuid().as_raw());
    if let (true, Some(root)) = (owner, root) {
        return owner_kept_out(root, dir, path).unwrap_or_else(|| {
            format!("{said}: yours, but not writable by you; '{STOWAGE} doctor --repair' gives it its mode back")
        });
    }
    match store {
        Some(m) if m.mode() & 0o020 != 0 && !crate::ident::in_group(m.gid()) => {
            let why = crate::planted::not_a_member(m.gid());
            format!("{}: {why}", path.display())
        }
        Some(m) if m.mode() & 0o020 != 0 => {
            // The cause, or the directory above that keeps us from looking at it.
            let why = cause.ancestors().take(2).find_map(|c| {
                let m = std::fs::symlink_metadata(c).ok()?;
                crate::planted::group_store_part(c, m.uid(), m.gid())
            });
            let why =
                why.unwrap_or_else(|| format!("its owner's '{STOWAGE} doctor --repair' fixes it"));
            let mode = std::fs::metadata(cause).map_or_else(
                |e| format!(": {e}"),
                |m| format!(" (mode {:o})", m.mode() & 0o7777),
            );
            format!("{}{mode}: {why} ({doc})", cause.display())
        }
        Some(m) => format!(
            "{}: you may not write this store (uid {}'s, not shared); its owner can run '{STOWAGE} init --group GROUP' ({doc})",
            path.display(),
            m.uid()
        ),
        None => format!("{said}: not writable by you"),
    }
}

/// Why the store's owner cannot open `path`: the first directory from `root` down to `dir` whose
/// mode keeps them from passing through it (or, for `dir`, from making a file in it).
fn owner_kept_out(root: &Path, dir: &Path, path: &Path) -> Option<String> {
    use nix::unistd::{AccessFlags, access};
    let mut chain: Vec<&Path> = dir
        .ancestors()
        .take_while(|a| a.starts_with(root))
        .collect();
    chain.reverse();
    let closed = chain.into_iter().find(|d| {
        let need = if *d == dir {
            AccessFlags::W_OK
        } else {
            AccessFlags::empty()
        };
        access(*d, need | AccessFlags::X_OK).is_err()
    })?;
    let m = std::fs::symlink_metadata(closed).ok()?;
    let (mode, owner, shown) = (m.mode() & 0o7777, m.uid(), closed.display());
    // Another's directory in the store: its mode is not ours to change, its owner is the cause (in
    // a group store, a member's directory not group-writable, or not of the store's group).
    if owner != nix::unistd::geteuid().as_raw() {
        let why = crate::planted::group_store_part(closed, owner, m.gid());
        let why = why.unwrap_or_else(|| "'chown' it back to you (as root)".into());
        return Some(format!(
            "{}: {shown} belongs to uid {owner} (mode {mode:03o}), which keeps you out; {why}",
            path.display()
        ));
    }
    Some(format!(
        "{}: {shown} is mode {mode:03o}, which keeps you, its owner, out; 'chmod u+rwx {shown}' gives it back",
        path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::wait::poll;
    use super::*;
    use std::thread;
    use std::time::{Duration, Instant};

    thread_local! {
        /// Errors the next flock tries of this thread fail with.
        static INJECT: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    pub(super) fn injected() -> Option<i32> {
        INJECT.with(|v| v.borrow_mut().pop())
    }

    #[test]
    fn a_stale_file_handle_means_retry_not_failure() {
        // NFS: another host unlinked the file between our open and flock; the server says ESTALE.
        let (_d, p) = tmp_lock();
        INJECT.with(|v| v.borrow_mut().extend([libc::ESTALE, libc::ESTALE]));
        let g = try_take(&p, Mode::Exclusive).unwrap();
        assert!(g.is_some(), "retried on a fresh open");
        drop(g);
        INJECT.with(|v| v.borrow_mut().push(libc::ESTALE));
        let r = wait_for(&p, Mode::Shared, None);
        assert!(matches!(r, Waited::Acquired(_)));
        // Anything else is still an error.
        INJECT.with(|v| v.borrow_mut().push(libc::EIO));
        let e = try_take(&p, Mode::Exclusive).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
    }

    #[test]
    fn a_wait_whose_connection_is_lost_opens_afresh_and_waits_on() {
        // GlusterFS after a reconnect: EBADFD on a descriptor in use meanwhile; ENOTCONN before.
        let (_d, p) = tmp_lock();
        let lost = [libc::EBADFD, libc::ENOTCONN, libc::EBADFD];
        INJECT.with(|v| v.borrow_mut().extend(lost));
        let r = wait_for(&p, Mode::Exclusive, None);
        assert!(matches!(r, Waited::Acquired(_)), "{r:?}");
        assert!(INJECT.with(|v| v.borrow().is_empty()), "every loss retried");
        drop(r);
        // Lost for longer than the wait may last: timed out (75), not an error.
        INJECT.with(|v| v.borrow_mut().extend([libc::EBADFD; 64]));
        let t0 = Instant::now();
        let r = wait_for(&p, Mode::Exclusive, Some(t0 + Duration::from_millis(200)));
        assert!(matches!(r, Waited::TimedOut), "{r:?}");
        assert!(t0.elapsed() >= Duration::from_millis(200));
        INJECT.with(|v| v.borrow_mut().clear());
        // No wait asked: the loss is the answer.
        INJECT.with(|v| v.borrow_mut().push(libc::EBADFD));
        let e = try_take(&p, Mode::Exclusive).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADFD));
    }

    /// A wait until `deadline` (`None`: for good) that re-arms every `rearm`.
    fn until(deadline: Option<Instant>, rearm: Option<Duration>) -> Wait<'static> {
        Wait {
            deadline,
            rearm,
            ..Wait::default()
        }
    }

    /// Waits for the lock on `p` (made if missing) until `deadline` (`None`: for good).
    fn wait_for(p: &Path, mode: Mode, deadline: Option<Instant>) -> Waited<Guard> {
        acquire(p, mode, IfMissing::Create, &mut until(deadline, None)).unwrap()
    }

    /// A fresh directory, and a lock file's path in it.
    fn tmp_lock() -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.lock");
        (d, p)
    }

    /// Tries the lock on `p` (made if missing) without waiting.
    fn try_take(p: &Path, mode: Mode) -> io::Result<Option<Guard>> {
        acquire_no_wait(p, mode, IfMissing::Create)
    }

    /// The lock on `p` (made if missing), which must be free.
    fn take(p: &Path, mode: Mode) -> Guard {
        try_take(p, mode).unwrap().unwrap()
    }

    /// Whether the lock on `p` (made if missing) cannot be taken now.
    fn busy(p: &Path, mode: Mode) -> bool {
        try_take(p, mode).unwrap().is_none()
    }

    #[test]
    fn shared_locks_coexist_and_exclude_writers() {
        let (_d, p) = tmp_lock();
        let r1 = take(&p, Mode::Shared);
        let r2 = take(&p, Mode::Shared);
        assert!(busy(&p, Mode::Exclusive));
        assert_eq!(probe(&p).unwrap(), Probe::Shared);
        drop((r1, r2));
        assert_eq!(probe(&p).unwrap(), Probe::Free);
        let w = take(&p, Mode::Exclusive);
        assert!(busy(&p, Mode::Shared));
        assert_eq!(probe(&p).unwrap(), Probe::Exclusive);
        drop(w);
    }

    #[test]
    fn missing_file_without_create() {
        let (_d, p) = tmp_lock();
        let e = acquire_no_wait(&p, Mode::Shared, IfMissing::Fail).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(!p.exists());
        assert_eq!(probe(&p).unwrap(), Probe::Missing);
    }

    #[test]
    fn refuses_symlinks() {
        let (d, link) = tmp_lock();
        let target = d.path().join("target");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = try_take(&link, Mode::Exclusive).unwrap_err();
        assert_eq!(crate::planted::find(&e).map(|n| n.kind), Some("a symlink"));
        assert!(!target.exists());
    }

    /// While `held` is held, `wait(deadline)` times out no sooner than the deadline; once it is
    /// dropped, the wait acquires.
    fn times_out_then_acquires<T>(held: Guard, wait: impl Fn(Instant) -> Waited<T>) {
        let t0 = Instant::now();
        let r = wait(t0 + Duration::from_millis(100));
        assert!(matches!(r, Waited::TimedOut));
        assert!(t0.elapsed() >= Duration::from_millis(100));
        let releaser = thread::spawn(move || {
            thread::sleep(Duration::from_millis(50));
            drop(held);
        });
        let r = wait(Instant::now() + Duration::from_secs(30));
        assert!(matches!(r, Waited::Acquired(_)));
        releaser.join().unwrap();
    }

    #[test]
    fn timed_rearmed_and_polled_waits_time_out_and_then_succeed() {
        let (_d, p) = tmp_lock();
        times_out_then_acquires(take(&p, Mode::Exclusive), |d| {
            wait_for(&p, Mode::Shared, Some(d))
        });
        times_out_then_acquires(take(&p, Mode::Exclusive), |d| {
            let mut wait = until(Some(d), Some(Duration::from_millis(10)));
            acquire(&p, Mode::Exclusive, IfMissing::Create, &mut wait).unwrap()
        });
        // The fallback when no helper thread can be started.
        let f = open(&p, IfMissing::Fail).unwrap();
        times_out_then_acquires(take(&p, Mode::Exclusive), |d| {
            poll(&f, Mode::Exclusive, &mut until(Some(d), None)).unwrap()
        });
    }

    #[test]
    fn waiter_retries_when_holder_unlinks() {
        let (_d, p) = tmp_lock();
        let held = take(&p, Mode::Exclusive);
        let t = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            // As Root::unlink_lock does: emptied, then unlinked, held.
            held.file().set_len(0).unwrap();
            fs::remove_file(held.path()).unwrap();
            drop(held);
        });
        let g = match wait_for(&p, Mode::Exclusive, None) {
            Waited::Acquired(g) => g,
            other => panic!("{other:?}"),
        };
        t.join().unwrap();
        // The lock is on the file now at the path (inodes get reused: check by locking the path).
        assert_eq!(fs::metadata(&p).unwrap().ino(), g.identity().1);
        assert!(busy(&p, Mode::Shared));
    }

    #[test]
    fn a_file_set_keeps_its_descriptors_and_a_waker_sees_closes() {
        let (d, _) = tmp_lock();
        let paths: Vec<PathBuf> = (0..2).map(|i| d.path().join(format!("{i}.lock"))).collect();
        let a = take(&paths[0], Mode::Exclusive);
        let b = take(&paths[1], Mode::Exclusive);
        let waker = Waker::watch(d.path(), Some("changed"));
        // Where inotify is missing the waker is not checked.
        let woke = |until, want: Woke| {
            if waker.watching() {
                assert_eq!(waker.sleep(until).unwrap(), want);
            }
        };
        let mut set = FileSet::new(paths.clone());
        assert!(set.try_any_where(|_| true).unwrap().is_none());
        assert_eq!(set.held_count(|_| true).unwrap(), 2);
        // Nothing closed yet: the tries made no event.
        woke(
            Some(Instant::now() + Duration::from_millis(20)),
            Woke::Timeout,
        );
        drop(b); // the last descriptor of that lock closes: wake
        woke(None, Woke::Changed { named: false });
        let (i, g) = set.try_any_where(|_| true).unwrap().unwrap();
        assert_eq!(i, 1);
        set.put_back(i, g);
        assert_eq!(set.held_count(|_| true).unwrap(), 1);
        std::fs::write(d.path().join("changed"), "").unwrap();
        woke(None, Woke::Changed { named: true });
        drop(a);
    }

    #[test]
    fn two_opens_conflict_here() {
        let (_d, p) = tmp_lock();
        assert!(opens_conflict(&p).unwrap());
    }
}
