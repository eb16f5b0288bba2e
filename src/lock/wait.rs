//! Waiting for locks: in flock(2) in a helper thread, or for many files at once, on inotify.
//!
//! - A helper thread sleeps in a blocked flock(2) until the lock is free, or [`wake_signal`] (a
//!   no-op handler: `EINTR`) interrupts it for a deadline or cancellation. Nothing spins.
//! - If no helper thread can be started (a pids limit), the wait polls instead of failing.
//! - A termination signal cancels every wait ([`interrupt_waits`]).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::thread::JoinHandleExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use fs2::FileExt;
use nix::fcntl::OFlag;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};

use super::{Mode, flock_blocking, flock_try};
use crate::error::{cvt, locked};

/// The outcome of a wait.
#[derive(Debug)]
pub enum Waited<T> {
    Acquired(T),
    TimedOut,
    /// [`interrupt_waits`] was called with this signal number.
    Interrupted(i32),
}

impl<T> Waited<T> {
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Waited<U> {
        match self {
            Waited::Acquired(t) => Waited::Acquired(f(t)),
            Waited::TimedOut => Waited::TimedOut,
            Waited::Interrupted(sig) => Waited::Interrupted(sig),
        }
    }

    /// The lock, or the error for a wait that ended without it: `timed_out()`, or interrupted.
    pub fn or_else_busy(self, timed_out: impl FnOnce() -> anyhow::Error) -> anyhow::Result<T> {
        match self {
            Waited::Acquired(t) => Ok(t),
            Waited::TimedOut => Err(timed_out()),
            Waited::Interrupted(sig) => Err(crate::error::Error::Interrupted(sig).into()),
        }
    }
}

/// How long to wait, and what to say if it takes a while.
#[derive(Default)]
pub struct Wait<'a> {
    /// `None`: wait until acquired.
    pub deadline: Option<Instant>,
    /// Called once if the lock is still not acquired after this long.
    pub notice: Option<Notice<'a>>,
    /// Re-issue blocked requests this often: NFS clients retry a blocked lock with a back-off up to
    /// 30 s (NFSv4), so a freed lock may go unnoticed that long; local filesystems need none.
    pub rearm: Option<Duration>,
    /// Asked at each re-arm: true gives the wait up as timed out (the caller asks why).
    pub give_up: Option<Box<dyn FnMut() -> bool + 'a>>,
    /// Try without blocking, again and again, instead of one blocked request: on FUSE, whose
    /// servers may wedge on an interrupted lock request (GlusterFS 10's client, when the holder's
    /// host crashes while two of its processes wait).
    pub poll: bool,
}

impl<'a> Wait<'a> {
    /// A wait suited to the filesystem holding the lock files in `dir`.
    pub fn on(dir: &Path, deadline: Option<Instant>) -> Self {
        let fs = crate::filesystem::filesystem(dir);
        let local = fs.as_ref().is_ok_and(|f| f.local);
        Wait {
            deadline,
            rearm: (!local).then_some(REMOTE_REARM),
            poll: fs.is_ok_and(|f| polls(&f)),
            ..Wait::default()
        }
    }
}

/// Whether waits on filesystem `fs` poll ([`Wait::poll`]): FUSE.
pub fn polls(fs: &crate::filesystem::Filesystem) -> bool {
    fs.name == "fuse"
}

/// How often blocked requests are re-issued on remote filesystems.
pub const REMOTE_REARM: Duration = Duration::from_millis(250);

/// The signal that interrupts a helper thread's blocked flock(2) (`EINTR`: its handler does nothing,
/// without `SA_RESTART`).
pub fn wake_signal() -> libc::c_int {
    libc::SIGRTMIN() + 5
}

extern "C" fn do_nothing(_: libc::c_int) {}

/// Makes [`wake_signal`] harmless before any wait needs it: its handler, unless the parent made
/// us ignore it (kept so, for the command to inherit, until a wait needs the handler).
pub fn disarm_wake_signal() {
    if !crate::spawn::ignored(wake_signal()) {
        install_wake_handler();
    }
}

/// Gives [`wake_signal`] its handler that does nothing, once per process.
fn install_wake_handler() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // SAFETY: installs a handler that touches nothing; sa is zeroed, its mask emptied first.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = do_nothing as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(wake_signal(), &sa, std::ptr::null_mut());
        }
    });
}

enum Event {
    /// The worker finished: `Ok(true)` acquired, `Ok(false)` stopped.
    Done(io::Result<bool>),
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

static BEFORE_WAIT: OnceLock<fn() -> bool> = OnceLock::new();

/// Registers a function to run before any wait begins: the CLI starts its signal thread so, and
/// says whether it runs (else a wait polls, watching the signalfd of [`watch_signals_while_waiting`]).
pub fn before_waiting(f: fn() -> bool) {
    let _ = BEFORE_WAIT.set(f);
}

/// Runs [`before_waiting`]'s function, also for waits outside [`super::acquire`] (a polled slot
/// wait): whether a thread takes signals (`true` where none are taken).
pub fn starting_to_wait() -> bool {
    BEFORE_WAIT.get().is_none_or(|f| f())
}

/// A descriptor readable while a terminating signal is pending, and the function taking it, for a
/// process with no thread to watch signals (a pids limit).
static SIGNAL_WATCH: OnceLock<(RawFd, fn())> = OnceLock::new();

/// Registers `SIGNAL_WATCH` (once, for good).
pub fn watch_signals_while_waiting(fd: RawFd, take: fn()) {
    let _ = SIGNAL_WATCH.set((fd, take));
}

/// Makes every current and future wait in this process return [`Waited::Interrupted`].
pub fn interrupt_waits(sig: i32) {
    let mut reg = locked(&CANCEL);
    reg.fired = Some(sig);
    for (_, tx) in &reg.waiters {
        let _ = tx.send(Event::Cancelled(sig));
    }
    // Polled waits ([`Waker`]) watch the pipe, never drained: once fired, every wait here is over.
    if let Some((_, w)) = cancel_pipe() {
        let _ = nix::unistd::write(w, &[1]);
    }
}

/// The pipe that [`interrupt_waits`] makes readable: (read end, write end), both for the process.
fn cancel_pipe() -> Option<&'static (OwnedFd, OwnedFd)> {
    static PIPE: OnceLock<Option<(OwnedFd, OwnedFd)>> = OnceLock::new();
    PIPE.get_or_init(|| nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).ok())
        .as_ref()
}

/// The signal passed to [`interrupt_waits`], if it was called.
pub fn interrupted() -> Option<i32> {
    locked(&CANCEL).fired
}

struct Registration(u64);

impl Registration {
    fn new(tx: mpsc::Sender<Event>) -> Result<Registration, i32> {
        let mut reg = locked(&CANCEL);
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
        locked(&CANCEL).waiters.retain(|(id, _)| *id != self.0);
    }
}

/// The helper thread blocked in flock(2) for a wait.
struct Worker {
    handle: thread::JoinHandle<()>,
    stop: Arc<AtomicBool>,
    finished: bool,
}

/// How long a stopped worker may take to answer before being left behind (a flock(2) ignoring
/// signals: a hard NFS mount, server gone); it releases whatever it later acquires.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// Blocks until `file` is locked in `mode`.
pub(super) fn block(file: &File, mode: Mode, wait: &mut Wait) -> io::Result<Waited<()>> {
    // A deadline already past (a try pass) needs no thread to say so.
    if wait.deadline.is_some_and(|d| Instant::now() >= d) {
        return Ok(Waited::TimedOut);
    }
    // Asked first, polling or not: it starts the thread that takes the signals ending a wait.
    if !starting_to_wait() || wait.poll {
        return poll(file, mode, wait);
    }
    install_wake_handler();
    let (tx, rx) = mpsc::channel();
    let _registration = match Registration::new(tx.clone()) {
        Ok(r) => r,
        Err(sig) => return Ok(Waited::Interrupted(sig)),
    };
    let mut worker = match Worker::spawn(file, mode, tx) {
        Ok(w) => w,
        // EAGAIN, no thread to be had (a pids limit in a container or a job's cgroup): poll instead.
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return poll(file, mode, wait),
        Err(e) => return Err(e),
    };
    let outcome = worker.acquired(&rx, wait);
    worker.stop(file, &rx);
    outcome
}

impl Worker {
    /// Starts a helper blocked in flock(2) on a duplicate of `file`, which shares its open file
    /// description: a lock through it locks `file` itself.
    fn spawn(file: &File, mode: Mode, tx: mpsc::Sender<Event>) -> io::Result<Worker> {
        let file = file.try_clone()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let handle = thread::Builder::new()
            .name("stowage-lock-wait".into())
            .stack_size(64 * 1024)
            .spawn(move || {
                // Masks are inherited, even across exec: a blocked wake signal would deafen us.
                // SAFETY: sigset manipulation on a local set. (Not signals' helper: signals uses us.)
                unsafe {
                    let mut set: libc::sigset_t = std::mem::zeroed();
                    libc::sigemptyset(&mut set);
                    libc::sigaddset(&mut set, wake_signal());
                    libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
                }
                let result = loop {
                    if stopped.load(Ordering::Acquire) {
                        break Ok(false);
                    }
                    match flock_blocking(&file, mode) {
                        Ok(()) => break Ok(true),
                        Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                        Err(e) => break Err(e),
                    }
                };
                if matches!(result, Ok(true)) && stopped.load(Ordering::Acquire) {
                    // Abandoned after its grace period: nobody will use this lock.
                    let _ = FileExt::unlock(&file);
                }
                let _ = tx.send(Event::Done(result));
            })?;
        Ok(Worker {
            handle,
            stop,
            finished: false,
        })
    }

    /// Waits for the worker to acquire, re-arming and saying the notice when due.
    fn acquired(&mut self, rx: &mpsc::Receiver<Event>, wait: &mut Wait) -> io::Result<Waited<()>> {
        let started = Instant::now();
        let mut notice = wait.notice.take();
        let mut next_rearm = wait.rearm.map(|r| started + r);
        loop {
            let now = Instant::now();
            let notice_at = notice.as_ref().map(|(after, _)| started + *after);
            let event = match [wait.deadline, notice_at, next_rearm]
                .into_iter()
                .flatten()
                .min()
            {
                None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                Some(t) => rx.recv_timeout(t.saturating_duration_since(now)),
            };
            match event {
                Ok(Event::Done(result)) => {
                    self.finished = true;
                    if result? {
                        return Ok(Waited::Acquired(()));
                    }
                }
                Ok(Event::Cancelled(sig)) => return Ok(Waited::Interrupted(sig)),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    say_if_due(&mut notice, started);
                    if let (Some(at), Some(every)) = (next_rearm, wait.rearm)
                        && Instant::now() >= at
                    {
                        if wait.give_up.as_mut().is_some_and(|f| f()) {
                            return Ok(Waited::TimedOut);
                        }
                        self.rearm();
                        next_rearm = Some(Instant::now() + every);
                    }
                    if wait.deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(Waited::TimedOut);
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(io::Error::other("lock wait helpers vanished"));
                }
            }
        }
    }

    /// Interrupts the worker if still blocked: seeing no stop flag, it issues its request again.
    fn rearm(&self) {
        if !self.finished {
            // SAFETY: not yet joined, so its pthread_t is valid; the signal's handler does nothing.
            unsafe { libc::pthread_kill(self.handle.as_pthread_t(), wake_signal()) };
        }
    }

    /// Stops a worker still blocked; a lock it acquires meanwhile is let go (nobody saw it).
    fn stop(mut self, file: &File, rx: &mpsc::Receiver<Event>) {
        self.stop.store(true, Ordering::Release);
        let give_up = Instant::now() + STOP_GRACE;
        while !self.finished && Instant::now() < give_up {
            self.rearm();
            if let Ok(Event::Done(r)) = rx.recv_timeout(Duration::from_millis(5)) {
                self.finished = true;
                if matches!(r, Ok(true)) {
                    let _ = FileExt::unlock(file);
                }
            }
        }
        // An unfinished worker is left detached; its stop flag set, it unlocks what it acquires.
        if self.finished {
            let _ = self.handle.join();
        }
    }
}

/// A [`Wait::notice`]: after how long, and what to say.
type Notice<'a> = (Duration, Box<dyn FnMut() + 'a>);

/// Says the notice once its time has come (and never again).
fn say_if_due(notice: &mut Option<Notice<'_>>, started: Instant) {
    if let Some((_, mut say)) = notice.take_if(|(after, _)| Instant::now() >= started + *after) {
        say();
    }
}

/// A polled wait's retry interval bounds: a freed lock is taken within [`POLL_MAX`].
const POLL_MIN: Duration = Duration::from_millis(2);
const POLL_MAX: Duration = Duration::from_millis(50);

/// Waits for `file` without a helper thread: capped-backoff tries, woken by a cancellation;
/// `give_up` is asked as often as a blocked wait would re-arm.
pub(super) fn poll(file: &File, mode: Mode, wait: &mut Wait) -> io::Result<Waited<()>> {
    let waker = Waker::default();
    let started = Instant::now();
    let mut notice = wait.notice.take();
    let mut pause = POLL_MIN;
    let mut next_ask = wait.rearm.map(|r| started + r);
    loop {
        if flock_try(file, mode)? {
            return Ok(Waited::Acquired(()));
        }
        say_if_due(&mut notice, started);
        let now = Instant::now();
        if wait.deadline.is_some_and(|d| now >= d) {
            return Ok(Waited::TimedOut);
        }
        if let (Some(at), Some(every)) = (next_ask, wait.rearm)
            && now >= at
        {
            if wait.give_up.as_mut().is_some_and(|f| f()) {
                return Ok(Waited::TimedOut);
            }
            next_ask = Some(now + every);
        }
        let until = wait.deadline.map_or(now + pause, |d| d.min(now + pause));
        pause = (pause * 2).min(POLL_MAX);
        if let Woke::Interrupted(sig) = waker.sleep(Some(until))? {
            return Ok(Waited::Interrupted(sig));
        }
    }
}

/// A wait's pauses while its connection to the server is lost: the first, then doubling to the last.
const RECONNECT_FIRST: Duration = Duration::from_millis(50);
const RECONNECT_LAST: Duration = Duration::from_secs(1);

/// Pauses of one wait between fresh opens of lock files whose descriptors died with their
/// connection ([`super::is_disconnected`]): the client reconnects by itself within seconds.
#[derive(Default)]
pub struct Reconnect {
    /// The last pause, `None` before the first.
    last: Option<Duration>,
}

impl Reconnect {
    /// After `lost`, a lost connection: pauses, within `deadline` and interruptibly, then `None`
    /// (open afresh), or how the wait ends. A try (its deadline past before any pause) fails with
    /// `lost`: it asked for no wait.
    pub fn pause<T, E: From<io::Error>>(
        &mut self,
        lost: E,
        deadline: Option<Instant>,
    ) -> Result<Option<Waited<T>>, E> {
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return match self.last {
                Some(_) => Ok(Some(Waited::TimedOut)),
                None => Err(lost),
            };
        }
        let pause = self
            .last
            .map_or(RECONNECT_FIRST, |p| (p * 2).min(RECONNECT_LAST));
        self.last = Some(pause);
        // The thread taking the signals that end a wait runs from now, if it did not yet.
        starting_to_wait();
        let until = deadline.map_or(now + pause, |d| d.min(now + pause));
        match Waker::default().sleep(Some(until))? {
            Woke::Interrupted(sig) => Ok(Some(Waited::Interrupted(sig))),
            Woke::Changed { .. } | Woke::Timeout => Ok(None),
        }
    }
}

/// Why [`Waker::sleep`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woke {
    /// A file in the watched directory was closed (a lock file's last descriptor: its locks are
    /// gone) or created; `named`: the one named in [`Waker::watch`] (a config change, for slots).
    Changed { named: bool },
    /// The time given ran out.
    Timeout,
    /// [`interrupt_waits`] was called.
    Interrupted(i32),
}

/// Sleeps in the calling thread until a directory changes, a time passes or our waits are
/// interrupted: a wait on many lock files takes no thread per file.
///
/// A flock is released at the last close of its open file description, when inotify reports
/// `IN_CLOSE_WRITE`/`IN_CLOSE_NOWRITE`: a waiter watching before trying wakes when one may be free.
/// Other hosts' closes go unseen (callers poll there too). Without inotify it only sleeps.
#[derive(Default)]
pub struct Waker {
    /// The instance and its watch, removed again on drop; none by default (only sleeps).
    inotify: Option<(Inotify, WatchDescriptor)>,
    named: Option<std::ffi::OsString>,
}

/// Spare inotify instances, kept from finished waits: a close costs an RCU grace period (~18 ms)
/// between a slot's release and its taker's command.
static SPARE_INOTIFY: Mutex<Vec<Inotify>> = Mutex::new(Vec::new());

impl Waker {
    /// Watches `dir` for closes and creations; changes to `named`, a file in it, are told apart.
    pub fn watch(dir: &Path, named: Option<&str>) -> Waker {
        let spare = locked(&SPARE_INOTIFY).pop();
        let flags = InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK;
        let Some(ino) = spare.or_else(|| Inotify::init(flags).ok()) else {
            return Waker::default();
        };
        let mask = AddWatchFlags::IN_CLOSE_WRITE
            | AddWatchFlags::IN_CLOSE_NOWRITE
            | AddWatchFlags::IN_CREATE
            | AddWatchFlags::IN_MOVED_TO
            | AddWatchFlags::IN_ONLYDIR;
        let Ok(wd) = ino.add_watch(dir, mask) else {
            locked(&SPARE_INOTIFY).push(ino);
            return Waker::default();
        };
        let waker = Waker {
            inotify: Some((ino, wd)),
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

    /// Sleeps until the directory changes, `until` passes (`None`: never) or waits are interrupted.
    pub fn sleep(&self, until: Option<Instant>) -> io::Result<Woke> {
        if let Some(sig) = interrupted() {
            return Ok(Woke::Interrupted(sig));
        }
        let signals = SIGNAL_WATCH.get();
        // The signal watch first: its `revents` are looked at below.
        let mut fds: Vec<libc::pollfd> = [
            signals.map(|(fd, _)| *fd),
            self.inotify.as_ref().map(|(i, _)| i.as_fd().as_raw_fd()),
            cancel_pipe().map(|(r, _)| r.as_raw_fd()),
        ]
        .into_iter()
        .flatten()
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
        let timeout = until.map_or(-1, |t| {
            // Rounded up: waking a hair early would only loop once more.
            let left = t.saturating_duration_since(Instant::now()).as_nanos();
            left.div_ceil(1_000_000).min(i32::MAX as u128) as i32
        });
        // SAFETY: poll on a live array of pollfds.
        let n = match cvt(unsafe {
            libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout)
        }) {
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => return Ok(Woke::Timeout),
            n => n?,
        };
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
        let Some((ino, wd)) = &self.inotify else {
            return false;
        };
        let want = self.named.as_deref();
        let mut named = false;
        while let Ok(events) = ino.read_events()
            && !events.is_empty()
        {
            let ours =
                |e: &InotifyEvent| e.wd == *wd && want.is_some() && e.name.as_deref() == want;
            named |= events.iter().any(ours);
        }
        named
    }
}

impl Drop for Waker {
    fn drop(&mut self) {
        if let Some((ino, wd)) = self.inotify.take() {
            let _ = ino.rm_watch(wd);
            locked(&SPARE_INOTIFY).push(ino);
        }
    }
}
