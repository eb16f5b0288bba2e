//! File locks: the only module that calls flock(2).
//!
//! Everything else asks for a [`Guard`]. The rules this module keeps:
//!
//! - **Open mode.** Lock files are opened read-write (NFS emulates flock with
//!   byte-range locks, and an exclusive byte-range lock needs a writable
//!   descriptor), close-on-exec (a lock reaches a child only when the caller
//!   asks, see [`Guard::set_inheritable`]) and without following a symlink at
//!   the final component.
//! - **The unlink race.** A lock file may be unlinked only by a holder of its
//!   exclusive lock. Every acquirer checks, after flock returns, that the file
//!   it locked still has links and is still the file at the path (device and
//!   inode); if not it locked a ghost, and it retries on the new file.
//! - **Shared filesystems.** An NFS client may answer `lstat(path)` from its
//!   caches for many seconds after another host unlinked the file (which
//!   lives on under a `.nfs…` name while its holder has it open), so there
//!   the check re-opens the path — an open makes the client look the name up on
//!   the server — and compares the fresh descriptor. `ESTALE` (the file is
//!   gone on the server) means "retry with a fresh open", never an error.
//!   And on a filesystem not known to be local, lock files are never
//!   unlinked at all ([`Guard::unlink`] keeps them): a ghost then needs an
//!   older release, or a host that sees the store as local, to unlink one.
//! - **Release is close.** Dropping a guard closes its descriptor and never
//!   calls `LOCK_UN`: a child that inherited the descriptor shares the lock,
//!   and `LOCK_UN` would drop it under the child's feet.
//! - **Contention is a value.** [`try_lock`] returns `Ok(None)` when busy;
//!   a bounded wait that runs out returns [`Waited::TimedOut`].
//! - **Waiting does not spin.** A blocked flock(2) sleeps in the kernel, in a
//!   helper thread, and is woken by the kernel the moment the lock is free.
//!   A deadline or a cancellation interrupts it with [`wake_signal`], whose
//!   handler does nothing, so the call returns `EINTR`. If no helper thread
//!   can be started (a pids limit), the wait polls instead of failing.
//! - **Waiting for one of many needs one thread.** A slot waiter keeps its
//!   [`FileSet`] open and sleeps on a [`Waker`] (inotify on the directory:
//!   the last close of a lock file is its release), so a pids limit cannot
//!   make the wait fail, and its tries open and close nothing that would
//!   wake other waiters. [`lock_any`] (a helper thread per file) remains for
//!   library callers with a few files.
//! - **Nested holds.** [`held_here`] finds a lock this process holds through
//!   an inherited descriptor: the caller's enclosing command's hold, which a
//!   wait must never wait for.

#![allow(clippy::disallowed_methods)] // this is the one module that may call flock

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::thread::JoinHandleExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use fs2::FileExt;

/// How a lock is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
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

    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "shared" => Some(Mode::Shared),
            "exclusive" => Some(Mode::Exclusive),
            _ => None,
        }
    }
}

/// A held lock. Dropping it closes the descriptor, which releases the lock
/// unless a child process inherited the descriptor (then the lock lives until
/// the child closes it too).
#[must_use = "the lock is released when the guard is dropped"]
#[derive(Debug)]
pub struct Guard {
    file: File,
    path: PathBuf,
    mode: Mode,
    dev: u64,
    ino: u64,
}

impl std::os::fd::AsRawFd for Guard {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }
}

impl Guard {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Device and inode of the locked file: what /proc/locks reports.
    pub fn identity(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }

    /// Whether a spawned child inherits this lock's descriptor (and so keeps
    /// the lock as long as it lives). Off by default.
    pub fn set_inheritable(&self, inherit: bool) -> io::Result<()> {
        let fd = self.file.as_raw_fd();
        // SAFETY: plain fcntl on a descriptor we own.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        let flags = if inherit {
            flags & !libc::FD_CLOEXEC
        } else {
            flags | libc::FD_CLOEXEC
        };
        if unsafe { libc::fcntl(fd, libc::F_SETFD, flags) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Replaces the lock file's contents (a note for others, such as who
    /// holds the probe lock), through the locked descriptor: never through
    /// the path, where a symlink could have been planted since.
    pub fn set_contents(&self, bytes: &[u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        self.file.set_len(0)?;
        self.file.write_all_at(bytes, 0)?;
        // On NFS, what is written reaches the server (and other hosts) on
        // a sync or a close; we keep the descriptor open.
        self.file.sync_data()
    }

    /// Checks that the lock is still ours as far as the filesystem can
    /// tell. After a network partition longer than an NFS server's lease the
    /// server drops the client's locks (another host may then take them),
    /// and the Linux client fails I/O on such a descriptor with `EIO`. So
    /// the lock is asserted again (a non-blocking flock in the held mode:
    /// a no-op locally, a request to the server on NFS) and the descriptor
    /// is read and stat'ed. Any failure means the lock cannot be vouched
    /// for. `STOWAGE_DEBUG_LOST_LOCK=FILE_NAME` (a hidden test hook) makes
    /// the check fail for that lock file, as a lost NFS lock would.
    pub fn verify(&self) -> io::Result<()> {
        if crate::debug::lost_lock(&self.path) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        if !flock_try(&self.file, self.mode)? {
            return Err(io::Error::other("the lock is held by someone else now"));
        }
        let mut byte = [0u8; 1];
        // SAFETY: a one-byte pread into a live buffer on our descriptor.
        if unsafe { libc::pread(self.file.as_raw_fd(), byte.as_mut_ptr().cast(), 1, 0) } < 0 {
            return Err(io::Error::last_os_error());
        }
        self.file.metadata().map(|_| ())
    }

    /// Unlinks a lease file (`lease.rs`), on every filesystem. Lock files
    /// are kept on shared filesystems (see the module doc) because two
    /// processes could come to lock two files of one name; a lease has one
    /// owner, who made it under a fresh name and re-checks it after locking
    /// (re-opening the path there), and whoever unlinks it holds it
    /// exclusively — a lock that goes to the server, so a lease its owner
    /// holds is never taken for dead. Leaving leases would leave one file
    /// per exec on NFS.
    pub fn unlink_lease(self) -> io::Result<()> {
        assert_eq!(
            self.mode,
            Mode::Exclusive,
            "unlink needs the exclusive lock"
        );
        match fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The locked file, for writing what it says about its holder (a lease).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Unlinks the lock file. Only an exclusive holder may do this: anyone
    /// blocked on the file, or who opened it before the unlink, will find it
    /// unlinked after locking and retry on a fresh file.
    ///
    /// On a filesystem not known to be local the file is kept (and this
    /// succeeds): another host's cached lookup could still lead it to the
    /// unlinked file, whose lock no longer excludes anyone. A kept lock file
    /// is a few bytes, reused if the name comes back.
    pub fn unlink(self) -> io::Result<()> {
        assert_eq!(
            self.mode,
            Mode::Exclusive,
            "unlink needs the exclusive lock"
        );
        if !unlinks_allowed(&self.path) {
            return Ok(());
        }
        match fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// The outcome of a wait.
#[derive(Debug)]
pub enum Waited<T> {
    Acquired(T),
    TimedOut,
    /// [`interrupt_waits`] was called with this signal number.
    Interrupted(i32),
}

/// How long to wait, and what to say if it takes a while.
#[derive(Default)]
pub struct Wait<'a> {
    /// `None`: wait until acquired.
    pub deadline: Option<Instant>,
    /// Called once if the lock is still not acquired after this long.
    pub notice: Option<(Duration, Box<dyn FnMut() + 'a>)>,
    /// Ignore [`interrupt_waits`]: for cleanup that must happen even after a
    /// termination signal (undoing a start, recording an outcome).
    pub uninterruptible: bool,
    /// Re-issue blocked requests this often. On NFS a blocked lock request
    /// is retried by the client with a back-off that grows to 30 s (NFSv4),
    /// so a freed lock may sit unnoticed that long; interrupting and
    /// re-issuing the request makes the client ask again at once. Local
    /// filesystems wake waiters themselves and need none.
    pub rearm: Option<Duration>,
}

impl<'a> Wait<'a> {
    pub fn until(deadline: Option<Instant>) -> Self {
        Wait {
            deadline,
            ..Wait::default()
        }
    }

    /// A wait suited to the filesystem holding the lock files in `dir`.
    pub fn on(dir: &Path, deadline: Option<Instant>) -> Self {
        let local = crate::filesystem::filesystem(dir)
            .map(|f| f.local)
            .unwrap_or(false);
        Wait {
            deadline,
            rearm: (!local).then_some(REMOTE_REARM),
            ..Wait::default()
        }
    }
}

/// How often blocked requests are re-issued on remote filesystems.
pub const REMOTE_REARM: Duration = Duration::from_millis(250);

/// Opens a lock file: read-write, close-on-exec, never through a symlink.
fn open(path: &Path, create: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .mode(0o666)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

fn flock_try(file: &File, mode: Mode) -> io::Result<bool> {
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

/// Is an exclusive lock on `path` held through a descriptor this process
/// inherited (it runs under the holder, as a command inherits its locks)?
/// Such a descriptor's lock is ours already: taking it again is a no-op.
pub fn inherited_exclusive(path: &Path) -> bool {
    let Ok(target) = fs::metadata(path) else {
        return false;
    };
    let Ok(fds) = fs::read_dir("/proc/self/fd") else {
        return false;
    };
    fds.flatten().any(|e| {
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            return false;
        };
        // SAFETY: borrowed for fstat/flock only; the descriptor stays open.
        let file = std::mem::ManuallyDrop::new(unsafe {
            <File as std::os::fd::FromRawFd>::from_raw_fd(fd)
        });
        file.metadata()
            .is_ok_and(|m| m.dev() == target.dev() && m.ino() == target.ino())
            && flock_try(&file, Mode::Exclusive).unwrap_or(false)
    })
}

fn flock_blocking(file: &File, mode: Mode) -> io::Result<()> {
    match mode {
        Mode::Shared => FileExt::lock_shared(file),
        Mode::Exclusive => FileExt::lock_exclusive(file),
    }
}

/// Whether lock files in the directory of `path` may be unlinked: only
/// where the filesystem is known to be local (see the module doc). Decided
/// once per directory and process (one statfs).
pub fn unlinks_allowed(path: &Path) -> bool {
    local_dir(path)
}

fn local_dir(path: &Path) -> bool {
    static SEEN: Mutex<Vec<(PathBuf, bool)>> = Mutex::new(Vec::new());
    let dir = path.parent().unwrap_or(Path::new("/"));
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, local)) = seen.iter().find(|(d, _)| d == dir) {
        return *local;
    }
    // Unknown counts as shared: the careful side.
    let local = crate::filesystem::filesystem(dir).is_ok_and(|f| f.local);
    seen.push((dir.to_owned(), local));
    local
}

/// `ESTALE`: the file behind a descriptor is gone on the (NFS) server —
/// another host unlinked it. For a lock: retry with a fresh open.
fn is_stale(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ESTALE)
}

/// Is the file we locked still the one at `path`?
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
    if !local_dir(path) {
        // A stat of the path may come from the client's caches; an open
        // is looked up on the server (close-to-open consistency).
        let at = match open(path, false).and_then(|f| f.metadata()) {
            Ok(m) => m,
            Err(e)
                if e.kind() == io::ErrorKind::NotFound
                    || is_stale(&e)
                    || e.raw_os_error() == Some(libc::ELOOP) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        return Ok(
            (at.dev() == ours.dev() && at.ino() == ours.ino()).then_some((ours.dev(), ours.ino()))
        );
    }
    match fs::symlink_metadata(path) {
        Ok(at) if at.dev() == ours.dev() && at.ino() == ours.ino() => {
            Ok(Some((ours.dev(), ours.ino())))
        }
        Ok(_) => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESTALE) => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// How many times a lock is retried after finding its file unlinked before
/// giving up: each retry means some holder deleted the file in between,
/// which cannot go on forever unless something is badly wrong.
const MAX_GHOSTS: usize = 1000;

fn ghost_error(path: &Path) -> io::Error {
    io::Error::other(format!(
        "lock file {} keeps being replaced while locking it",
        path.display()
    ))
}

/// Takes the lock if it is free right now. `Ok(None)`: someone holds it in a
/// conflicting mode. With `create` false a missing file is `NotFound`.
pub fn try_lock(path: &Path, mode: Mode, create: bool) -> io::Result<Option<Guard>> {
    for _ in 0..MAX_GHOSTS {
        let file = open(path, create)?;
        match flock_try(&file, mode) {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(e) if is_stale(&e) => continue,
            Err(e) => return Err(e),
        }
        if let Some((dev, ino)) = still_linked(&file, path)? {
            return Ok(Some(Guard {
                file,
                path: path.to_owned(),
                mode,
                dev,
                ino,
            }));
        }
    }
    Err(ghost_error(path))
}

/// Takes the lock, waiting as `wait` allows. Tries first without blocking.
pub fn lock(path: &Path, mode: Mode, create: bool, wait: &mut Wait) -> io::Result<Waited<Guard>> {
    let paths = [path.to_owned()];
    Ok(match lock_any(&paths, mode, create, wait)? {
        Waited::Acquired((_, guard)) => Waited::Acquired(guard),
        Waited::TimedOut => Waited::TimedOut,
        Waited::Interrupted(sig) => Waited::Interrupted(sig),
    })
}

/// Takes a lock on whichever of `paths` becomes free first, trying them in
/// order before blocking on all of them at once. Returns its index.
pub fn lock_any(
    paths: &[PathBuf],
    mode: Mode,
    create: bool,
    wait: &mut Wait,
) -> io::Result<Waited<(usize, Guard)>> {
    assert!(!paths.is_empty());
    for _ in 0..MAX_GHOSTS {
        let mut files = Vec::with_capacity(paths.len());
        for (i, path) in paths.iter().enumerate() {
            let file = open(path, create)?;
            let got = match flock_try(&file, mode) {
                Ok(got) => got,
                // Gone on the server: leave it out, so the pass starts over.
                Err(e) if is_stale(&e) => continue,
                Err(e) => return Err(e),
            };
            if got {
                match still_linked(&file, path)? {
                    Some((dev, ino)) => {
                        return Ok(Waited::Acquired((i, guard(file, path, mode, dev, ino))));
                    }
                    None => continue,
                }
            }
            files.push((i, file));
        }
        if files.len() < paths.len() {
            // Some file was a ghost: start over with fresh opens.
            continue;
        }
        let refs: Vec<&File> = files.iter().map(|(_, f)| f).collect();
        let blocked = match block_any(&refs, mode, wait) {
            Err(e) if is_stale(&e) => continue,
            other => other?,
        };
        match blocked {
            Waited::Acquired(k) => {
                let (i, file) = files.swap_remove(k);
                if let Some((dev, ino)) = still_linked(&file, &paths[i])? {
                    return Ok(Waited::Acquired((
                        i,
                        guard(file, &paths[i], mode, dev, ino),
                    )));
                }
            }
            Waited::TimedOut => return Ok(Waited::TimedOut),
            Waited::Interrupted(sig) => return Ok(Waited::Interrupted(sig)),
        }
    }
    Err(ghost_error(&paths[0]))
}

fn guard(file: File, path: &Path, mode: Mode, dev: u64, ino: u64) -> Guard {
    Guard {
        file,
        path: path.to_owned(),
        mode,
        dev,
        ino,
    }
}

/// The lock this process already holds on the file at `path` through a
/// descriptor it did not take here — one inherited from an enclosing
/// command, as `stowage exec` passes its lock descriptors on (like
/// flock(1)). The kernel says so itself: `/proc/self/fdinfo/N` lists, under
/// `lock:`, the flocks of that descriptor's open file description. `None`
/// when no descriptor of ours locks that file (or /proc is not mounted).
///
/// A wait for a conflicting lock on such a file would wait for ourselves.
pub fn held_here(path: &Path) -> Option<Mode> {
    held_here_except(path, None)
}

/// [`held_here`], not counting descriptor `except` — the one the caller
/// just locked itself, which is no enclosing command's hold.
pub fn held_here_except(path: &Path, except: Option<std::os::fd::RawFd>) -> Option<Mode> {
    let at = fs::symlink_metadata(path).ok()?;
    let fds = fs::read_dir("/proc/self/fd").ok()?;
    let mut held = None;
    for entry in fds.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
            .filter(|fd| Some(*fd) != except)
        else {
            continue;
        };
        // SAFETY: fstat on a descriptor number into a zeroed buffer; a
        // number that is no longer open (the listing's own) fails harmlessly.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0
            || st.st_dev != at.dev()
            || st.st_ino != at.ino()
        {
            continue;
        }
        let Ok(info) = fs::read_to_string(format!("/proc/self/fdinfo/{fd}")) else {
            continue;
        };
        if let Some(m) = fdinfo_flock(&info) {
            held = held.max(Some(m));
        }
    }
    held
}

/// The flock mode in an fdinfo text, from lines like
/// `lock:\t1: FLOCK  ADVISORY  WRITE 4121 00:2a:123456 0 EOF`.
fn fdinfo_flock(info: &str) -> Option<Mode> {
    info.lines()
        .filter_map(|l| l.strip_prefix("lock:"))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // "1:" "FLOCK" "ADVISORY" "WRITE" …; a blocked request has "->".
            match f.as_slice() {
                [_, "FLOCK", _, "WRITE", ..] => Some(Mode::Exclusive),
                [_, "FLOCK", _, "READ", ..] => Some(Mode::Shared),
                _ => None,
            }
        })
        .max()
}

/// What a lock file's lock looks like from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    Missing,
    Free,
    Shared,
    Exclusive,
}

/// Finds out whether anyone holds the lock, without waiting. This briefly
/// takes the lock itself (shared, then exclusive), so a concurrent
/// non-blocking attempt may see it busy for a few microseconds: prefer the
/// kernel's lock table where it is complete (local filesystems).
pub fn probe(path: &Path) -> io::Result<Probe> {
    let file = match open(path, false) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Probe::Missing),
        Err(e) => return Err(e),
    };
    if !flock_try(&file, Mode::Shared)? {
        return Ok(Probe::Exclusive);
    }
    // We hold it shared; converting to exclusive succeeds only if nobody else
    // holds it. A failed conversion leaves us without a lock, which is fine.
    Ok(if flock_try(&file, Mode::Exclusive)? {
        Probe::Free
    } else {
        Probe::Shared
    })
}

/// Judges a lease (see `lease.rs`): `Some(device, inode)` while its owner
/// holds it exclusively, `None` when the owner is gone (the file is missing,
/// or a shared lock is granted). The shared lock taken to find out is
/// dropped on return; it never makes an owner's own lock fail for long, and
/// an owner that does find its fresh file busy takes another.
pub fn probe_lease(path: &Path) -> io::Result<Option<(u64, u64)>> {
    let opened = match open(path, false) {
        // Another user's lease in a store without a shared group: a
        // read-only descriptor takes a shared flock as well (not on NFS,
        // where the probe then fails and says so).
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path),
        other => other,
    };
    let file = match opened {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        // NFS: unlinked on the server since the lookup.
        Err(e) if e.raw_os_error() == Some(libc::ESTALE) => return Ok(None),
        Err(e) => return Err(e),
    };
    if flock_try(&file, Mode::Shared)? {
        return Ok(None);
    }
    let m = file.metadata()?;
    Ok(Some((m.dev(), m.ino())))
}

/// Whether two opens of one file exclude each other here, as they must for
/// flock to mean anything: `Ok(true)` if they do.
pub fn opens_conflict(path: &Path) -> io::Result<bool> {
    let a = open(path, true)?;
    let b = open(path, false)?;
    if !flock_try(&a, Mode::Exclusive)? {
        return Err(io::Error::other("the test file is locked by someone else"));
    }
    Ok(!flock_try(&b, Mode::Exclusive)?)
}

// ---------------------------------------------------------------------------
// Waiting: helper threads blocked in flock(2), interrupted by a signal.

/// The signal that interrupts a blocked flock(2) in a helper thread. Its
/// handler does nothing; it is installed without `SA_RESTART`, so the call
/// returns `EINTR`. Signals are sent only to stowage's own helper threads.
pub fn wake_signal() -> libc::c_int {
    libc::SIGRTMIN() + 5
}

extern "C" fn do_nothing(_: libc::c_int) {}

fn install_wake_handler() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // SAFETY: installs a handler that touches nothing; sa is zeroed and
        // its mask emptied before use.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = do_nothing as *const () as libc::sighandler_t;
            sa.sa_flags = 0;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(wake_signal(), &sa, std::ptr::null_mut());
        }
    });
}

enum Event {
    /// Worker `i` finished: `Ok(true)` acquired, `Ok(false)` stopped.
    Done(usize, io::Result<bool>),
    Cancelled(i32),
}

struct Registry {
    fired: Option<i32>,
    next_id: u64,
    waiters: Vec<(u64, mpsc::Sender<Event>)>,
}

static CANCEL: Mutex<Registry> = Mutex::new(Registry {
    fired: None,
    next_id: 0,
    waiters: Vec::new(),
});

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    CANCEL.lock().unwrap_or_else(|e| e.into_inner())
}

static BEFORE_WAIT: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Registers a function to run before any wait begins (once registered,
/// for good). The CLI starts its signal-watching thread this way, so that a
/// process that never waits never starts it.
pub fn before_waiting(f: fn()) {
    let _ = BEFORE_WAIT.set(f);
}

/// Runs the function registered with [`before_waiting`]: for waits that
/// do not go through [`lock`] (a polled wait for a slot).
pub fn starting_to_wait() {
    if let Some(f) = BEFORE_WAIT.get() {
        f();
    }
}

/// A descriptor that is readable while a signal is pending that should end
/// the waits, and the function that takes it (and calls
/// [`interrupt_waits`]): for a process that could start no thread to watch
/// for signals (a pids limit), so that its waits watch for them themselves.
static SIGNAL_WATCH: std::sync::OnceLock<(std::os::fd::RawFd, fn())> = std::sync::OnceLock::new();

/// Registers [`SIGNAL_WATCH`] (once, for good).
pub fn watch_signals_while_waiting(fd: std::os::fd::RawFd, take: fn()) {
    let _ = SIGNAL_WATCH.set((fd, take));
}

/// Makes every current and future wait in this process return
/// [`Waited::Interrupted`]. The CLI calls it when a termination signal
/// arrives before its command has started.
pub fn interrupt_waits(sig: i32) {
    let mut reg = registry();
    reg.fired = Some(sig);
    for (_, tx) in &reg.waiters {
        let _ = tx.send(Event::Cancelled(sig));
    }
    // Polled waits (see [`Waker`]) watch the pipe. It is never drained:
    // once fired, every wait of this process is over.
    if let Some((_, w)) = cancel_pipe() {
        // SAFETY: a one-byte write from a live buffer to our own pipe.
        unsafe { libc::write(*w, [1u8].as_ptr().cast(), 1) };
    }
}

/// The pipe that [`interrupt_waits`] makes readable: (read end, write end).
fn cancel_pipe() -> Option<&'static (i32, i32)> {
    static PIPE: std::sync::OnceLock<Option<(i32, i32)>> = std::sync::OnceLock::new();
    PIPE.get_or_init(|| {
        let mut fds = [0; 2];
        // SAFETY: pipe2 into a two-element array. Both ends live for the
        // whole process (close-on-exec: no command inherits them).
        let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        (r == 0).then_some((fds[0], fds[1]))
    })
    .as_ref()
}

/// The signal passed to [`interrupt_waits`], if it was called.
pub fn interrupted() -> Option<i32> {
    registry().fired
}

struct Registration(u64);

impl Registration {
    fn new(tx: mpsc::Sender<Event>) -> Result<Registration, i32> {
        let mut reg = registry();
        if let Some(sig) = reg.fired {
            return Err(sig);
        }
        let id = reg.next_id;
        reg.next_id += 1;
        reg.waiters.push((id, tx));
        Ok(Registration(id))
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        registry().waiters.retain(|(id, _)| *id != self.0);
    }
}

struct Worker {
    handle: Option<thread::JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    finished: bool,
}

/// How long a stopped worker may take to answer before it is left behind.
/// Only a flock(2) that ignores signals (a hard NFS mount whose server is
/// gone) takes that long; the abandoned thread releases anything it later
/// acquires.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// Blocks until one of `files` is locked in `mode`; returns its index.
fn block_any(files: &[&File], mode: Mode, wait: &mut Wait) -> io::Result<Waited<usize>> {
    // A deadline already past (a try pass) needs no threads to say so.
    if wait.deadline.is_some_and(|d| Instant::now() >= d) {
        return Ok(Waited::TimedOut);
    }
    if let Some(f) = BEFORE_WAIT.get() {
        f();
    }
    install_wake_handler();
    let (tx, rx) = mpsc::channel();
    let _registration = if wait.uninterruptible {
        None
    } else {
        match Registration::new(tx.clone()) {
            Ok(r) => Some(r),
            Err(sig) => return Ok(Waited::Interrupted(sig)),
        }
    };

    let mut workers = Vec::with_capacity(files.len());
    for (i, file) in files.iter().enumerate() {
        // The duplicate shares the open file description, so a lock taken
        // through it is a lock on `file` itself.
        let dup = file.try_clone()?;
        let stop = Arc::new(AtomicBool::new(false));
        let handle = match spawn_worker(i, dup, mode, Arc::clone(&stop), tx.clone()) {
            Ok(h) => h,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.raw_os_error() == Some(libc::EAGAIN) =>
            {
                // No thread to be had (a pids limit in a container or a
                // job's cgroup): wait without one, polling.
                drop(tx);
                stop_workers(&mut workers, files, &rx, None);
                return poll_any(files, mode, wait);
            }
            Err(e) => return Err(e),
        };
        workers.push(Worker {
            handle: Some(handle),
            stop,
            finished: false,
        });
    }
    drop(tx);

    let started = Instant::now();
    let mut notice = wait.notice.take();
    let mut next_rearm = wait.rearm.map(|r| started + r);
    let outcome = loop {
        let now = Instant::now();
        let mut until = wait.deadline;
        for at in [
            notice.as_ref().map(|(after, _)| started + *after),
            next_rearm,
        ]
        .into_iter()
        .flatten()
        {
            until = Some(until.map_or(at, |d| d.min(at)));
        }
        let event = match until {
            None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some(t) => rx.recv_timeout(t.saturating_duration_since(now)),
        };
        match event {
            Ok(Event::Done(i, Ok(true))) => {
                workers[i].finished = true;
                break Ok(Waited::Acquired(i));
            }
            Ok(Event::Done(i, Ok(false))) => workers[i].finished = true,
            Ok(Event::Done(i, Err(e))) => {
                workers[i].finished = true;
                break Err(e);
            }
            Ok(Event::Cancelled(sig)) => break Ok(Waited::Interrupted(sig)),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Some((after, mut say)) = notice.take() {
                    if Instant::now() >= started + after {
                        say();
                    } else {
                        notice = Some((after, say));
                    }
                }
                if let (Some(at), Some(every)) = (next_rearm, wait.rearm)
                    && Instant::now() >= at
                {
                    // Interrupted workers see no stop flag and block again.
                    for w in workers.iter().filter(|w| !w.finished) {
                        if let Some(h) = &w.handle {
                            // SAFETY: see stop_workers.
                            unsafe { libc::pthread_kill(h.as_pthread_t(), wake_signal()) };
                        }
                    }
                    next_rearm = Some(Instant::now() + every);
                }
                if wait.deadline.is_some_and(|d| Instant::now() >= d) {
                    break Ok(Waited::TimedOut);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                break Err(io::Error::other("lock wait helpers vanished"));
            }
        }
    };

    // Stop the others. A worker that acquired in the meantime releases what
    // it took unless it is the winner; nobody else has seen those locks.
    let winner = match outcome {
        Ok(Waited::Acquired(i)) => Some(i),
        _ => None,
    };
    stop_workers(&mut workers, files, &rx, winner);
    outcome
}

/// How often a polled wait retries at most, and at least: a freed lock is
/// taken within [`POLL_MAX`] (the slots' handover promise is 100 ms).
const POLL_MIN: Duration = Duration::from_millis(2);
const POLL_MAX: Duration = Duration::from_millis(50);

/// Waits for any of `files` without helper threads: non-blocking tries
/// with a capped backoff, woken early by a cancellation.
fn poll_any(files: &[&File], mode: Mode, wait: &mut Wait) -> io::Result<Waited<usize>> {
    let waker = Waker::none();
    let started = Instant::now();
    let mut notice = wait.notice.take();
    let mut pause = POLL_MIN;
    loop {
        for (i, f) in files.iter().enumerate() {
            if flock_try(f, mode)? {
                return Ok(Waited::Acquired(i));
            }
        }
        if let Some((after, mut say)) = notice.take() {
            if started.elapsed() >= after {
                say();
            } else {
                notice = Some((after, say));
            }
        }
        let now = Instant::now();
        if wait.deadline.is_some_and(|d| now >= d) {
            return Ok(Waited::TimedOut);
        }
        let mut until = now + pause;
        if let Some(d) = wait.deadline {
            until = until.min(d);
        }
        pause = (pause * 2).min(POLL_MAX);
        if wait.uninterruptible {
            thread::sleep(until.saturating_duration_since(Instant::now()));
        } else if let Woke::Interrupted(sig) = waker.sleep(Some(until))? {
            return Ok(Waited::Interrupted(sig));
        }
    }
}

/// Why [`Waker::sleep`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woke {
    /// Something happened in the watched directory: a file opened for
    /// writing was closed (a lock file's last descriptor, so its locks are
    /// gone) or created. `named` is true if that file was the one named in
    /// [`Waker::watch`] (a configuration change, for slots).
    Changed { named: bool },
    /// The time given ran out.
    Timeout,
    /// [`interrupt_waits`] was called.
    Interrupted(i32),
}

/// Sleeps until a directory changes, a time passes, or the waits of this
/// process are interrupted — in the calling thread, needing no helper
/// thread (waiting for one of many lock files must not need one thread per
/// file: a pids limit would make such a wait fail).
///
/// The kernel releases a flock when the last descriptor of its open file
/// description is closed, and that last close is exactly when inotify
/// reports `IN_CLOSE_WRITE` — or `IN_CLOSE_NOWRITE` for a holder that
/// opened the file read-only, as flock(1) does: both are watched, so a waiter
/// that watches the directory before it tries the files wakes the moment
/// one of them may be free. Other hosts' closes are not seen (NFS): callers
/// poll there too. Without inotify (limits on instances) it only sleeps.
pub struct Waker {
    inotify: Option<std::os::fd::OwnedFd>,
    /// The watch on `inotify`, removed again on drop.
    wd: i32,
    named: Option<std::ffi::OsString>,
}

/// inotify instances of finished waits, kept for the next: closing one
/// costs the closer an RCU grace period (measured: ~18 ms), which would
/// land between a slot's release and its taker's command. They are
/// close-on-exec, and there are never more than waits at once.
static SPARE_INOTIFY: Mutex<Vec<std::os::fd::OwnedFd>> = Mutex::new(Vec::new());

impl Waker {
    /// Sleeps only until a time or an interruption.
    pub fn none() -> Waker {
        Waker {
            inotify: None,
            wd: -1,
            named: None,
        }
    }

    /// Watches `dir` for closes and creations; `named` is a file in it
    /// whose changes are told apart.
    pub fn watch(dir: &Path, named: Option<&str>) -> Waker {
        use std::os::fd::{AsRawFd, FromRawFd};
        use std::os::unix::ffi::OsStrExt;
        let spare = SPARE_INOTIFY
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        let owned = match spare {
            Some(fd) => fd,
            None => {
                // SAFETY: inotify_init1 returns a new descriptor or -1.
                let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
                if fd < 0 {
                    return Waker::none();
                }
                // SAFETY: fd was just returned to us and is owned from here on.
                unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }
            }
        };
        let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
            return Waker::none();
        };
        let mask = libc::IN_CLOSE_WRITE
            | libc::IN_CLOSE_NOWRITE
            | libc::IN_CREATE
            | libc::IN_MOVED_TO
            | libc::IN_ONLYDIR;
        // SAFETY: a valid inotify descriptor and a NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(owned.as_raw_fd(), c.as_ptr(), mask) };
        if wd < 0 {
            SPARE_INOTIFY
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(owned);
            return Waker::none();
        }
        let waker = Waker {
            inotify: Some(owned),
            wd,
            named: named.map(Into::into),
        };
        // Whatever a previous wait left unread is not news for this one.
        waker.drain();
        waker
    }

    /// Whether closes in the directory wake this waker.
    pub fn watching(&self) -> bool {
        self.inotify.is_some()
    }

    /// Sleeps until the directory changes, `until` passes (`None`: no
    /// limit) or the process's waits are interrupted.
    pub fn sleep(&self, until: Option<Instant>) -> io::Result<Woke> {
        use std::os::fd::AsRawFd;
        if let Some(sig) = interrupted() {
            return Ok(Woke::Interrupted(sig));
        }
        let cancel = cancel_pipe().map(|(r, _)| *r);
        let mut fds = Vec::with_capacity(3);
        let signals = SIGNAL_WATCH.get();
        if let Some((fd, _)) = signals {
            fds.push(libc::pollfd {
                fd: *fd,
                events: libc::POLLIN,
                revents: 0,
            });
        }
        if let Some(ino) = &self.inotify {
            fds.push(libc::pollfd {
                fd: ino.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        if let Some(c) = cancel {
            fds.push(libc::pollfd {
                fd: c,
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let timeout = match until {
            None => -1,
            Some(t) => {
                let left = t.saturating_duration_since(Instant::now());
                // Round up: waking a hair early would only loop once more.
                left.as_millis().min(i32::MAX as u128 - 1) as i32
                    + i32::from(left.subsec_nanos() % 1_000_000 != 0)
            }
        };
        // SAFETY: poll on a live array of pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                return Ok(Woke::Timeout);
            }
            return Err(e);
        }
        if let Some((_, take)) = signals
            && fds[0].revents != 0
        {
            take();
        }
        if let Some(sig) = interrupted() {
            return Ok(Woke::Interrupted(sig));
        }
        if n == 0 {
            return Ok(Woke::Timeout);
        }
        Ok(Woke::Changed {
            named: self.drain(),
        })
    }

    /// Reads every pending event; true if one concerned the named file.
    fn drain(&self) -> bool {
        use std::os::fd::AsRawFd;
        let Some(ino) = &self.inotify else {
            return false;
        };
        let mut named = false;
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: read into a live buffer of its length.
            let n = unsafe { libc::read(ino.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return named;
            }
            let mut at = 0usize;
            let head = std::mem::size_of::<libc::inotify_event>();
            while at + head <= n as usize {
                // SAFETY: the kernel wrote whole events; read_unaligned
                // copes with the byte buffer's alignment.
                let ev: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
                let name = &buf[at + head..(at + head + ev.len as usize).min(n as usize)];
                let name = name.split(|b| *b == 0).next().unwrap_or(&[]);
                if let Some(want) = &self.named {
                    use std::os::unix::ffi::OsStrExt;
                    if ev.wd == self.wd && name == want.as_bytes() {
                        named = true;
                    }
                }
                at += head + ev.len as usize;
            }
        }
    }
}

impl Drop for Waker {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        if let Some(fd) = self.inotify.take() {
            // SAFETY: removes our own watch from our own descriptor.
            unsafe { libc::inotify_rm_watch(fd.as_raw_fd(), self.wd) };
            SPARE_INOTIFY
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(fd);
        }
    }
}

/// Lock files tried again and again without closing them in between: the
/// descriptors stay open while a waiter waits, so its tries make no close
/// events that would wake other waiters (see [`Waker`]).
pub struct FileSet {
    paths: Vec<PathBuf>,
    files: Vec<Option<File>>,
    mode: Mode,
}

impl FileSet {
    pub fn new(paths: Vec<PathBuf>, mode: Mode) -> FileSet {
        let files = paths.iter().map(|_| None).collect();
        FileSet { paths, files, mode }
    }

    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Tries each file once, in order, creating missing ones; the first
    /// taken is returned with its index. A file found unlinked after
    /// locking (a ghost) is reopened on the next try.
    pub fn try_any(&mut self) -> io::Result<Option<(usize, Guard)>> {
        for i in 0..self.paths.len() {
            if self.files[i].is_none() {
                self.files[i] = Some(open(&self.paths[i], true)?);
            }
            let file = self.files[i].as_ref().expect("opened above");
            match flock_try(file, self.mode) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) if is_stale(&e) => {
                    self.files[i] = None;
                    continue;
                }
                Err(e) => return Err(e),
            }
            let file = self.files[i].take().expect("opened above");
            if let Some((dev, ino)) = still_linked(&file, &self.paths[i])? {
                return Ok(Some((i, guard(file, &self.paths[i], self.mode, dev, ino))));
            }
        }
        Ok(None)
    }

    /// Gives back a lock taken by [`FileSet::try_any`] that the caller may
    /// not keep after all. The descriptor stays open (closing it would wake
    /// every waiter watching the directory, this one included); the lock is
    /// dropped with `LOCK_UN`, safe here because no child ever had this
    /// descriptor.
    pub fn put_back(&mut self, i: usize, g: Guard) {
        let _ = FileExt::unlock(&g.file);
        self.files[i] = Some(g.file);
    }

    /// How many of the files that `include` accepts someone holds right now,
    /// asked through our own descriptors (no open or close that would wake
    /// other waiters). Missing files count as free and are not created.
    pub fn held_count(&mut self, include: impl Fn(usize) -> bool) -> io::Result<usize> {
        let mut held = 0;
        for i in 0..self.paths.len() {
            if !include(i) {
                continue;
            }
            if self.files[i].is_none() {
                match open(&self.paths[i], false) {
                    Ok(f) => self.files[i] = Some(f),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e),
                }
            }
            let f = self.files[i].as_ref().expect("opened above");
            if flock_try(f, Mode::Exclusive)? {
                let _ = FileExt::unlock(f);
            } else {
                held += 1;
            }
        }
        Ok(held)
    }
}

fn spawn_worker(
    i: usize,
    file: File,
    mode: Mode,
    stop: Arc<AtomicBool>,
    tx: mpsc::Sender<Event>,
) -> io::Result<thread::JoinHandle<()>> {
    thread::Builder::new()
        .name("stowage-lock-wait".into())
        .stack_size(64 * 1024)
        .spawn(move || {
            // The mask is inherited (even across exec, from whoever started
            // us); a blocked wake signal would leave this thread deaf.
            // SAFETY: sigset manipulation on a local set.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, wake_signal());
                libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            }
            let result = loop {
                if stop.load(Ordering::Acquire) {
                    break Ok(false);
                }
                match flock_blocking(&file, mode) {
                    Ok(()) => break Ok(true),
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                    Err(e) => break Err(e),
                }
            };
            if matches!(result, Ok(true)) && stop.load(Ordering::Acquire) {
                // Abandoned after its grace period: nobody will use this lock.
                let _ = FileExt::unlock(&file);
            }
            let _ = tx.send(Event::Done(i, result));
        })
}

fn stop_workers(
    workers: &mut [Worker],
    files: &[&File],
    rx: &mpsc::Receiver<Event>,
    winner: Option<usize>,
) {
    for w in workers.iter() {
        w.stop.store(true, Ordering::Release);
    }
    let give_up = Instant::now() + STOP_GRACE;
    while workers.iter().any(|w| !w.finished) && Instant::now() < give_up {
        for w in workers.iter().filter(|w| !w.finished) {
            if let Some(h) = &w.handle {
                // SAFETY: the thread has not been joined, so its pthread_t is
                // valid; the signal's handler does nothing.
                unsafe { libc::pthread_kill(h.as_pthread_t(), wake_signal()) };
            }
        }
        match rx.recv_timeout(Duration::from_millis(5)) {
            Ok(Event::Done(i, r)) => {
                workers[i].finished = true;
                if matches!(r, Ok(true)) && Some(i) != winner {
                    let _ = FileExt::unlock(files[i]);
                }
            }
            Ok(Event::Cancelled(_)) | Err(_) => {}
        }
    }
    for w in workers.iter_mut() {
        // An unfinished worker is left detached: its stop flag is set, so it
        // unlocks whatever it acquires.
        if let Some(h) = w.handle.take()
            && w.finished
        {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// Errors the next flock tries of this thread fail with.
        static INJECT: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    pub(super) fn injected() -> Option<i32> {
        INJECT.with(|v| v.borrow_mut().pop())
    }

    #[test]
    fn a_stale_file_handle_means_retry_not_failure() {
        // NFS: another host unlinked the lock file between our open and our
        // flock; the server answers ESTALE.
        let d = tmp();
        let p = d.path().join("a.lock");
        INJECT.with(|v| v.borrow_mut().extend([libc::ESTALE, libc::ESTALE]));
        let g = try_lock(&p, Mode::Exclusive, true).unwrap();
        assert!(g.is_some(), "retried on a fresh open");
        drop(g);
        INJECT.with(|v| v.borrow_mut().push(libc::ESTALE));
        let paths = [p.clone()];
        let got = lock_any(&paths, Mode::Shared, true, &mut Wait::default()).unwrap();
        assert!(matches!(got, Waited::Acquired((0, _))));
        // Anything else is still an error.
        INJECT.with(|v| v.borrow_mut().push(libc::EIO));
        assert_eq!(
            try_lock(&p, Mode::Exclusive, true)
                .unwrap_err()
                .raw_os_error(),
            Some(libc::EIO)
        );
    }

    fn tmp() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn shared_locks_coexist_and_exclude_writers() {
        let d = tmp();
        let p = d.path().join("a.lock");
        let r1 = try_lock(&p, Mode::Shared, true).unwrap().unwrap();
        let r2 = try_lock(&p, Mode::Shared, true).unwrap().unwrap();
        assert!(try_lock(&p, Mode::Exclusive, true).unwrap().is_none());
        assert_eq!(probe(&p).unwrap(), Probe::Shared);
        drop((r1, r2));
        assert_eq!(probe(&p).unwrap(), Probe::Free);
        let w = try_lock(&p, Mode::Exclusive, true).unwrap().unwrap();
        assert!(try_lock(&p, Mode::Shared, true).unwrap().is_none());
        assert_eq!(probe(&p).unwrap(), Probe::Exclusive);
        drop(w);
    }

    #[test]
    fn missing_file_without_create() {
        let d = tmp();
        let e = try_lock(&d.path().join("nope.lock"), Mode::Shared, false).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(!d.path().join("nope.lock").exists());
        assert_eq!(probe(&d.path().join("nope.lock")).unwrap(), Probe::Missing);
    }

    #[test]
    fn refuses_symlinks() {
        let d = tmp();
        let target = d.path().join("target");
        std::os::unix::fs::symlink(&target, d.path().join("link.lock")).unwrap();
        let e = try_lock(&d.path().join("link.lock"), Mode::Exclusive, true).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP));
        assert!(!target.exists());
    }

    #[test]
    fn timed_wait_times_out_and_then_succeeds() {
        let d = tmp();
        let p = d.path().join("a.lock");
        let held = try_lock(&p, Mode::Exclusive, true).unwrap().unwrap();
        let t0 = Instant::now();
        let r = lock(
            &p,
            Mode::Shared,
            true,
            &mut Wait::until(Some(t0 + Duration::from_millis(200))),
        )
        .unwrap();
        assert!(matches!(r, Waited::TimedOut));
        assert!(t0.elapsed() >= Duration::from_millis(200));
        let p2 = p.clone();
        let releaser = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            drop(held);
            p2
        });
        let r = lock(
            &p,
            Mode::Exclusive,
            true,
            &mut Wait::until(Some(Instant::now() + Duration::from_secs(30))),
        )
        .unwrap();
        assert!(matches!(r, Waited::Acquired(_)));
        releaser.join().unwrap();
    }

    #[test]
    fn waiter_retries_when_holder_unlinks() {
        let d = tmp();
        let p = d.path().join("a.lock");
        let held = try_lock(&p, Mode::Exclusive, true).unwrap().unwrap();
        let t = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            held.unlink().unwrap();
        });
        let g = match lock(&p, Mode::Exclusive, true, &mut Wait::default()).unwrap() {
            Waited::Acquired(g) => g,
            other => panic!("{other:?}"),
        };
        t.join().unwrap();
        // The lock must be on the file now at the path (the inode number
        // may be reused, so check by locking the path).
        assert_eq!(fs::metadata(&p).unwrap().ino(), g.identity().1);
        assert!(try_lock(&p, Mode::Shared, false).unwrap().is_none());
    }

    #[test]
    fn any_of_several() {
        let d = tmp();
        let paths: Vec<PathBuf> = (0..3).map(|i| d.path().join(format!("{i}.lock"))).collect();
        let a = try_lock(&paths[0], Mode::Exclusive, true).unwrap().unwrap();
        let b = try_lock(&paths[1], Mode::Exclusive, true).unwrap().unwrap();
        let (i, c) = match lock_any(&paths, Mode::Exclusive, true, &mut Wait::default()).unwrap() {
            Waited::Acquired(x) => x,
            other => panic!("{other:?}"),
        };
        assert_eq!(i, 2);
        let t = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            drop(b);
        });
        let got = lock_any(
            &paths,
            Mode::Exclusive,
            true,
            &mut Wait::until(Some(Instant::now() + Duration::from_secs(30))),
        )
        .unwrap();
        assert!(matches!(got, Waited::Acquired((1, _))), "{got:?}");
        t.join().unwrap();
        // The losing helper (blocked on 0 and 2) must not have kept anything.
        drop(a);
        drop(c);
        assert_eq!(probe(&paths[0]).unwrap(), Probe::Free);
        assert_eq!(probe(&paths[2]).unwrap(), Probe::Free);
    }

    #[test]
    fn rearmed_waits_still_acquire() {
        let d = tmp();
        let p = d.path().join("a.lock");
        let held = try_lock(&p, Mode::Exclusive, true).unwrap().unwrap();
        let t = thread::spawn(move || {
            thread::sleep(Duration::from_millis(120));
            drop(held);
        });
        let mut wait = Wait {
            rearm: Some(Duration::from_millis(10)),
            deadline: Some(Instant::now() + Duration::from_secs(30)),
            ..Wait::default()
        };
        assert!(matches!(
            lock(&p, Mode::Exclusive, true, &mut wait).unwrap(),
            Waited::Acquired(_)
        ));
        t.join().unwrap();
    }

    #[test]
    fn an_inherited_flock_is_seen_in_fdinfo() {
        assert_eq!(
            fdinfo_flock(
                "pos:\t0\nflags:\t02\nlock:\t1: FLOCK  ADVISORY  WRITE 12 00:2a:5 0 EOF\n"
            ),
            Some(Mode::Exclusive)
        );
        assert_eq!(
            fdinfo_flock("lock:\t1: FLOCK  ADVISORY  READ 12 00:2a:5 0 EOF\n"),
            Some(Mode::Shared)
        );
        assert_eq!(
            fdinfo_flock("lock:\t1: POSIX  ADVISORY  WRITE 12 00:2a:5 0 EOF\n"),
            None
        );
        // Our own lock, through our own descriptor: the check sees it.
        let d = tmp();
        let p = d.path().join("a.lock");
        assert_eq!(held_here(&p), None);
        let g = try_lock(&p, Mode::Shared, true).unwrap().unwrap();
        if std::path::Path::new("/proc/self/fdinfo").exists() {
            assert_eq!(held_here(&p), Some(Mode::Shared));
        }
        drop(g);
        assert_eq!(held_here(&p), None);
    }

    #[test]
    fn a_polled_wait_acquires_and_times_out() {
        // The fallback when no helper thread can be started.
        let d = tmp();
        let p = d.path().join("a.lock");
        let held = try_lock(&p, Mode::Exclusive, true).unwrap().unwrap();
        let f = open(&p, false).unwrap();
        let t0 = Instant::now();
        let r = poll_any(
            &[&f],
            Mode::Exclusive,
            &mut Wait::until(Some(t0 + Duration::from_millis(100))),
        )
        .unwrap();
        assert!(matches!(r, Waited::TimedOut));
        assert!(t0.elapsed() >= Duration::from_millis(100));
        let t = thread::spawn(move || {
            thread::sleep(Duration::from_millis(50));
            drop(held);
        });
        let r = poll_any(
            &[&f],
            Mode::Exclusive,
            &mut Wait::until(Some(Instant::now() + Duration::from_secs(30))),
        )
        .unwrap();
        assert!(matches!(r, Waited::Acquired(0)));
        t.join().unwrap();
    }

    #[test]
    fn a_file_set_keeps_its_descriptors_and_a_waker_sees_closes() {
        let d = tmp();
        let paths: Vec<PathBuf> = (0..2).map(|i| d.path().join(format!("{i}.lock"))).collect();
        let a = try_lock(&paths[0], Mode::Exclusive, true).unwrap().unwrap();
        let b = try_lock(&paths[1], Mode::Exclusive, true).unwrap().unwrap();
        let waker = Waker::watch(d.path(), Some("changed"));
        let mut set = FileSet::new(paths.clone(), Mode::Exclusive);
        assert!(set.try_any().unwrap().is_none());
        assert_eq!(set.held_count(|_| true).unwrap(), 2);
        if waker.watching() {
            // Nothing closed yet: the tries made no event.
            assert_eq!(
                waker
                    .sleep(Some(Instant::now() + Duration::from_millis(20)))
                    .unwrap(),
                Woke::Timeout
            );
        }
        drop(b); // the last descriptor of that lock closes: wake
        if waker.watching() {
            assert_eq!(waker.sleep(None).unwrap(), Woke::Changed { named: false });
        }
        let (i, g) = set.try_any().unwrap().unwrap();
        assert_eq!(i, 1);
        set.put_back(i, g);
        assert_eq!(set.held_count(|_| true).unwrap(), 1);
        std::fs::write(d.path().join("changed"), "").unwrap();
        if waker.watching() {
            assert_eq!(waker.sleep(None).unwrap(), Woke::Changed { named: true });
        }
        drop(a);
    }

    #[test]
    fn two_opens_conflict_here() {
        let d = tmp();
        assert!(opens_conflict(&d.path().join("t.lock")).unwrap());
    }
}
