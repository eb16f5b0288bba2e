//! Holder leases: who holds and awaits which lock, on any host and in any pid namespace, without
//! trusting a pid (protocol: docs/design.md, "Leases and holders").
//!
//! - One lease per process that holds or awaits a lock, flocked exclusively for its life; written
//!   with its first lock in one write (`O_DSYNC` on shared filesystems, where other hosts read it).
//! - Alive exactly while locked: a prober's non-waiting shared lock is granted only once the owner
//!   (or an inheritor of its descriptor) is gone.
//! - The owner makes a fresh name (`O_EXCL`) and locks it at once; a lease never written is
//!   unlinked only if its name says its maker is gone or it is older than 10 minutes (filesystem
//!   clock), so the file an owner locks is the one at its path (Nix's temproots, on flock).
//! - Unlinked only under the exclusive lock, by its owner ([`retire`]) or by [`clean_keeping`] for
//!   dead owners; kept while an inheritor still holds its lock (`holders::Look::clean_leases`).
//! - Inheritance follows the image locks; with `--no-inherit` the keeper holds both.
//! - Announced late on a shared filesystem, where each request is a round trip: an exec names its
//!   lease (records, its command's environment) but makes it only once it awaits a lock, copies a
//!   base, or [`announce_after`] has passed since it named it (a thread of its own). A look waits
//!   that long for a holder to list its lock; a nested call for its enclosing exec's (nested.rs).

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use crate::error::locked;
use crate::lock::{self, Guard, Mode};

const SUFFIX: &str = ".lease";

/// One of this process's leases: named at once, its file made at once or, announced late, later.
#[derive(Debug, Default)]
struct Lease {
    dir: PathBuf,
    name: String,
    /// What it lists as held and awaited (the lines after its identity).
    holdings: Vec<Holding>,
    /// None until made.
    file: Option<LeaseFile>,
}

#[derive(Debug)]
struct LeaseFile {
    guard: Guard,
    /// What the file says of its owner (the first lines).
    identity: String,
    /// File size: a shorter text is padded with empty lines, not truncated (a request more on NFS).
    written: usize,
    /// The leases directory, opened following no link: the lease's path goes through it.
    _dir: fs::File,
}

/// Our leases, one per root used (a library caller may use several), until [`retire`].
static MINE: Mutex<Vec<Lease>> = Mutex::new(Vec::new());

fn with_lease(leases: &Path, f: impl FnOnce(&mut Lease)) {
    if let Some(l) = locked(&MINE).iter_mut().find(|l| l.dir == leases) {
        f(l);
    }
}

fn files(all: &[Lease]) -> impl Iterator<Item = &LeaseFile> {
    all.iter().filter_map(|l| l.file.as_ref())
}

/// How long after naming its lease an exec makes it, where announced late: an exec whose command
/// ends sooner (`true`, a test) costs the server no lease at all. 30 ms unless a test says.
pub fn announce_after() -> std::time::Duration {
    crate::env::debug_ms(crate::env::DEBUG_ANNOUNCE_MS, 30)
}

/// Whether this process announces its lease late (set by an exec; off once it is made).
static LATE: AtomicBool = AtomicBool::new(false);

/// This process (an exec) announces its lease late where the store is on a shared filesystem.
pub fn announce_late() {
    LATE.store(true, Relaxed);
}

/// The name of our lease in `leases` (a root's leases directory), made (or named, where announced
/// late) if there is none.
pub fn mine(leases: &Path) -> io::Result<String> {
    let mut all = locked(&MINE);
    if let Some(l) = all.iter().find(|l| l.dir == leases) {
        return Ok(l.name.clone());
    }
    let late = LATE.load(Relaxed) && lock::write_through_flag() != 0;
    let lease = match late {
        true => Lease {
            dir: leases.to_owned(),
            name: fresh_name(&crate::ident::Me::current()),
            ..Lease::default()
        },
        false => create(leases)?,
    };
    let name = lease.name.clone();
    all.push(lease);
    if late {
        // Detached: the process may end first, and then nothing is announced. Threads start
        // after the exec's signal mask is set (exec.rs), so this one takes none of its signals.
        let after = announce_after();
        let timer = std::thread::Builder::new().name("announce".into());
        if timer
            .spawn(move || {
                std::thread::sleep(after);
                announce();
            })
            .is_err()
        {
            drop(all);
            announce();
        }
    }
    Ok(name)
}

/// Makes every lease named and not yet made; from now on leases are made at once. One that cannot
/// be made is dropped (only information: a look names its holder "unknown").
pub fn announce() {
    // Under MINE throughout: no lease is made or noted meanwhile by another thread.
    let mut all = locked(&MINE);
    LATE.store(false, Relaxed);
    all.retain_mut(|l| {
        if l.file.is_some() {
            return true;
        }
        l.file = make_file(&l.dir, &l.name, &crate::ident::Me::current())
            .ok()
            .flatten();
        l.rewrite();
        l.file.is_some()
    });
}

/// [`mine`], with the identity written if nothing was yet: a process (gc, rm) that lists locks
/// only while removing an image is named between.
pub fn introduce(leases: &Path) -> io::Result<String> {
    announce();
    let name = mine(leases)?;
    with_lease(leases, |l| {
        if l.file.as_ref().is_some_and(|f| f.written == 0) {
            l.rewrite();
        }
    });
    Ok(name)
}

/// Our leases' descriptors, for the `--no-inherit` keeper, which holds them with the locks.
pub fn raw_fds() -> Vec<RawFd> {
    files(&locked(&MINE)).map(|f| f.guard.as_raw_fd()).collect()
}

/// Whether a spawned command inherits the leases: exactly when it inherits the lock descriptors.
pub fn set_inheritable(inherit: bool) -> io::Result<()> {
    files(&locked(&MINE)).try_for_each(|f| f.guard.set_inheritable(inherit))
}

/// Ends this process's leases once it is done with every lock: unlinks each file under its lock,
/// then closes it (a dying one's go to [`clean_keeping`]).
pub fn retire() {
    let all = std::mem::take(&mut *locked(&MINE));
    for f in all.into_iter().filter_map(|l| l.file) {
        let _ = f.guard.unlink_lease();
    }
}

/// A lock a lease's owner holds or awaits, as listed: `hold=shared images/base.lock SINCE COMMAND`
/// (or `await=…`, or `queue=…` for one to take once what it awaits is had), relative to `locks/`,
/// SINCE in ms since the epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    pub mode: Mode,
    pub lockfile: String,
    /// Awaited, not (yet) held.
    pub awaits: bool,
    pub since: crate::clock::Millis,
    /// The command the lock is taken for.
    pub command: String,
    /// Exclusive only to read (`--read-exclusive`): written `exclusive-read`, claiming no write.
    pub reading: bool,
    /// To be taken once what the owner awaits is had (`acquire::queue`): no wait of its own.
    pub queued: bool,
}

impl Holding {
    pub fn now(mode: Mode, lockfile: String, awaits: bool, command: &str) -> Holding {
        Holding {
            mode,
            lockfile,
            awaits,
            since: crate::clock::now_ms(),
            command: command.to_owned(),
            reading: false,
            queued: false,
        }
    }

    /// Its line in a lease; `same` (as the line before's command): written without the command, so
    /// a command of many images, or a long one, stays within what readers read of a lease.
    fn line(&self, same: bool) -> String {
        let verb = match (self.queued, self.awaits) {
            (true, _) => "queue",
            (false, true) => "await",
            (false, false) => "hold",
        };
        let mode = if self.reading {
            "exclusive-read"
        } else {
            self.mode.as_str()
        };
        let (lockfile, since) = (&self.lockfile, self.since);
        match same {
            true => format!("{verb}={mode} {lockfile} {since}\n"),
            false => format!(
                "{verb}={mode} {lockfile} {since} {}\n",
                self.command.replace('\n', "\\n")
            ),
        }
    }

    /// A `hold=` line's value, or with `awaits` an `await=` line's.
    fn parse(awaits: bool, value: &str) -> Option<Holding> {
        let mut parts = value.splitn(4, ' ');
        let (mode, reading) = match parts.next()? {
            "shared" => (Mode::Shared, false),
            "exclusive" => (Mode::Exclusive, false),
            "exclusive-read" => (Mode::Exclusive, true),
            _ => return None,
        };
        Some(Holding {
            reading,
            mode,
            lockfile: parts.next()?.to_owned(),
            awaits,
            since: parts.next()?.parse().ok()?,
            command: parts.next().unwrap_or_default().to_owned(),
            queued: false,
        })
    }
}

impl Lease {
    /// Writes identity and holdings over the made file's start (failing is harmless: information).
    fn rewrite(&mut self) {
        use std::os::unix::fs::FileExt;
        let Some(f) = self.file.as_mut() else {
            return;
        };
        let mut text = f.identity.clone();
        let mut before: Option<&str> = None;
        // Queued lines last: a reader that reads only so much of a lease sees holds and waits.
        let (queued, now): (Vec<&Holding>, Vec<&Holding>) =
            self.holdings.iter().partition(|h| h.queued);
        for h in now.into_iter().chain(queued) {
            text.push_str(&h.line(before == Some(&h.command)));
            before = Some(&h.command);
        }
        if text.len() < f.written {
            text.push_str(&"\n".repeat(f.written - text.len()));
        }
        if f.guard.file().write_all_at(text.as_bytes(), 0).is_ok() {
            f.written = text.len();
        }
    }
}

/// Lists `h` in our lease for `leases`' store (made if none yet), replacing any entry for its lock.
pub fn note(leases: &Path, h: Holding) {
    note_all(leases, vec![h]);
}

/// [`note`] for every lock of `hs`, in one write: each write is a (synced) server request on a
/// shared filesystem, and an exec of a base and a new image holds two locks, a slot three.
pub fn note_all(leases: &Path, hs: Vec<Holding>) {
    // A process that awaits a lock is announced at once: waiters and their queue are named.
    if hs.iter().any(|h| h.awaits) {
        announce();
    }
    if hs.is_empty() || mine(leases).is_err() {
        return;
    }
    with_lease(leases, |l| {
        let written = l.file.as_ref().is_some_and(|f| f.written > 0);
        let mut changed = false;
        for h in hs {
            // Listed already as it is (announced before the lock was taken): nothing to write.
            let same = |o: &Holding| {
                (
                    &o.lockfile,
                    o.mode,
                    o.awaits,
                    o.reading,
                    o.queued,
                    &o.command,
                ) == (
                    &h.lockfile,
                    h.mode,
                    h.awaits,
                    h.reading,
                    h.queued,
                    &h.command,
                )
            };
            if written && l.holdings.iter().any(same) {
                continue;
            }
            l.holdings.retain(|o| o.lockfile != h.lockfile);
            l.holdings.push(h);
            changed = true;
        }
        if changed {
            l.rewrite();
        }
    });
}

pub fn forget(leases: &Path, lockfile: &str) {
    forget_all(leases, [lockfile]);
}

/// A hold our lease names while it lasts ([`note`], then [`forget`] when dropped): where no lock
/// table shows holders (another host's look), a lease is all that names a lock's holder.
pub struct Named {
    leases: PathBuf,
    lockfile: String,
}

impl Named {
    pub fn new(leases: &Path, h: Holding) -> Named {
        let lockfile = h.lockfile.clone();
        note(leases, h);
        Named {
            leases: leases.to_owned(),
            lockfile,
        }
    }
}

impl Drop for Named {
    fn drop(&mut self) {
        forget(&self.leases, &self.lockfile);
    }
}

/// Set when the process is about to end and retire its leases: locks it drops stay listed (a
/// reader judges each listed lock by the lock itself, so one listed too long never shows held).
static ENDING: AtomicBool = AtomicBool::new(false);

/// Marks the process as ending (see `ENDING`): a lease not made yet never will be.
pub fn ending() {
    ENDING.store(true, Relaxed);
    locked(&MINE).retain(|l| l.file.is_some());
}

/// Takes each of `lockfiles` out of this process's lease, in one write.
pub fn forget_all<S: AsRef<str>>(leases: &Path, lockfiles: impl IntoIterator<Item = S>) {
    if ENDING.load(Relaxed) {
        return;
    }
    let lockfiles: Vec<S> = lockfiles.into_iter().collect();
    let listed = |o: &Holding| lockfiles.iter().any(|l| l.as_ref() == o.lockfile);
    with_lease(leases, |l| {
        if l.holdings.iter().any(listed) {
            l.holdings.retain(|o| !listed(o));
            l.rewrite();
        }
    });
}

pub fn is_mine(name: &str) -> bool {
    locked(&MINE).iter().any(|l| l.name == name)
}

/// The boot part of a lease name: the first 8 hex digits of the boot id.
fn boot_part(me: &crate::ident::Me) -> String {
    me.boot_id
        .as_deref()
        .unwrap_or("noboot")
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(8)
        .collect()
}

fn create(dir: &Path) -> io::Result<Lease> {
    let me = crate::ident::Me::current();
    for _ in 0..100 {
        let name = fresh_name(&me);
        if let Some(file) = make_file(dir, &name, &me)? {
            return Ok(Lease {
                dir: dir.to_owned(),
                name,
                file: Some(file),
                ..Lease::default()
            });
        }
    }
    Err(io::Error::other(format!(
        "cannot create a lease under {}: every fresh file was taken from us",
        dir.display()
    )))
}

/// Makes and locks lease file `name` in `dir`, reached through the directory opened following no
/// link; None: the name is taken, or not ours to keep ([`lock_fresh`]). Its identity is written
/// with the first lock it lists ([`note`], [`introduce`]): one write, not two. Probers leave it
/// until then (unwritten, it is its maker's).
fn make_file(dir: &Path, name: &str, me: &crate::ident::Me) -> io::Result<Option<LeaseFile>> {
    let pinned = open_leases_dir(dir)?;
    let via = PathBuf::from(format!("/proc/self/fd/{}", pinned.as_raw_fd()));
    let guard = lock_fresh(&via.join(name)).map_err(|e| {
        let msg = format!("cannot create lease {}: {e}", dir.join(name).display());
        io::Error::new(e.kind(), msg)
    })?;
    let Some(guard) = guard else {
        return Ok(None);
    };
    // Leases of the execs we run inside (nested.rs), so `lock-status --why` follows nested calls.
    let within = std::env::var(crate::env::EXEC_LEASES).unwrap_or_default();
    let identity = format!(
        "host={}\npid={}\npid_ns={}\ntime_ns={}\nstart={}\nboot_id={}\nuser={}\ncommand={}\nsince={}\nwithin={}\n",
        me.host,
        me.pid,
        namespace("pid").unwrap_or_default(),
        namespace("time").unwrap_or_default(),
        crate::ident::start_time("self").map_or(String::new(), |t| t.to_string()),
        me.boot_id.as_deref().unwrap_or(""),
        me.user,
        crate::ident::shell_join(&crate::ident::lossy(
            &std::env::args_os().collect::<Vec<_>>()
        ))
        .replace('\n', "\\n"),
        crate::clock::now_ms(),
        within.replace('\n', ""),
    );
    Ok(Some(LeaseFile {
        guard,
        identity,
        written: 0,
        _dir: pinned,
    }))
}

/// A new lease name: `HOST-BOOT-PIDNS-PID-RANDOM.lease` (HOST has no '-').
fn fresh_name(me: &crate::ident::Me) -> String {
    let ns = pid_namespace_number().unwrap_or(0);
    format!(
        "{}-{}-{ns}-{}-{:016x}{SUFFIX}",
        safe_part(&me.host),
        boot_part(me),
        me.pid,
        crate::ident::nonce()
    )
}

/// Opens the leases directory, made by the store's first lease (a missing root or locks directory
/// is an error). A symlink in its place is refused: the lease would be made wherever it points.
fn open_leases_dir(dir: &Path) -> io::Result<fs::File> {
    // Only an anchor for the lease's path: `O_PATH` opens nothing on the server (no OPENDIR or
    // RELEASEDIR). No component, not even `locks`, is followed if a link (planted::open).
    let open_dir = || crate::planted::open(dir, libc::O_PATH | libc::O_DIRECTORY, 0);
    match open_dir() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => match make_leases_dir(dir) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(e),
            _ => open_dir(),
        },
        other => other,
    }
    .map_err(|e| match crate::planted::find(&e) {
        // Names itself, and the fix.
        Some(_) => e,
        None => io::Error::new(e.kind(), format!("cannot open {}: {e}", dir.display())),
    })
}

/// Makes the leases directory in `locks`, following no link in any component.
fn make_leases_dir(dir: &Path) -> io::Result<()> {
    let (Some(locks), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    };
    let parent = crate::planted::open(locks, libc::O_PATH | libc::O_DIRECTORY, 0)?;
    let mode = nix::sys::stat::Mode::from_bits_truncate(0o777);
    Ok(nix::sys::stat::mkdirat(&parent, name, mode)?)
}

/// Creates and locks the file `path` if it is fresh and stays ours; `None`: try another name.
fn lock_fresh(path: &Path) -> io::Result<Option<Guard>> {
    let began = boot_time();
    // Written through where shared: other hosts read it to name holders; a client may delay writes.
    // None: the name exists, or a prober keeps our fresh file (left to it, as a dead maker's).
    let guard = lock::create_locked(path)?;
    // A maker that took half the grace to lock its fresh file may have had it cleaned away.
    Ok(guard.filter(|g| {
        boot_time().saturating_sub(began) < unwritten_grace() / 2
            || lock::still_at_path(g).unwrap_or(false)
    }))
}

/// This process's namespace of `kind`, as `/proc/self/ns/KIND` names it.
fn namespace(kind: &str) -> Option<String> {
    fs::read_link(format!("/proc/self/ns/{kind}"))
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

/// How long an unwritten lease is left to a maker not known gone that may be about to lock it: 10
/// minutes. A maker that takes half that checks its file ([`lock_fresh`]): clocks' rates differ.
fn unwritten_grace() -> std::time::Duration {
    crate::env::debug_ms(crate::env::DEBUG_UNWRITTEN_LEASE_MS, 600_000)
}

/// This host's time since boot, suspend included (a stopped process's clock runs on).
fn boot_time() -> std::time::Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .map(Into::into)
        .unwrap_or_default()
}

/// The file's ctime, by the filesystem's clock: set by no client, never before the file's creation.
fn changed(m: &fs::Metadata) -> Option<std::time::SystemTime> {
    let secs = u64::try_from(m.ctime()).ok()?;
    let nanos = u32::try_from(m.ctime_nsec()).ok()?;
    std::time::UNIX_EPOCH.checked_add(std::time::Duration::new(secs, nanos))
}

/// The number of this process's pid namespace (`pid:[N]`).
fn pid_namespace_number() -> Option<u64> {
    let ns = namespace("pid")?;
    ns.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// The pid of the process that named lease `name`, where its name says this host, boot and pid
/// namespace (so the pid means that process to us, or a later one given its pid).
pub fn maker_here(name: &str) -> Option<i32> {
    let parts: Vec<&str> = name.strip_suffix(SUFFIX)?.split('-').collect();
    let [host, boot, ns, pid, _random] = parts[..] else {
        return None;
    };
    let me = crate::ident::Me::current();
    let (ns, pid) = (ns.parse::<u64>().ok()?, pid.parse::<i32>().ok()?);
    (host == safe_part(&me.host) && boot == boot_part(&me) && Some(ns) == pid_namespace_number())
        .then_some(pid)
}

/// A host name as a file name component: no '/', no control characters, bounded length.
fn safe_part(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || c == '.' || c == '_';
    let out: String = s
        .chars()
        .map(|c| if safe(c) { c } else { '_' })
        .take(64)
        .collect();
    if out.is_empty() { "host".into() } else { out }
}

/// The most of a lease file read: an identity is a few hundred bytes, a command line a few KiB.
const IDENTITY_MAX: u64 = 64 * 1024;

/// What a lease file says of its owner.
#[derive(Debug, Clone, Default)]
pub struct Identity {
    pub host: String,
    pub pid: Option<u32>,
    pub user: String,
    pub command: String,
    pub since: Option<crate::clock::Millis>,
    /// The owner's boot and pid namespace: its pid is as we number pids only where both are ours.
    pub boot_id: Option<String>,
    pub pid_ns: Option<String>,
    /// The owner's time namespace: process start times read from `/proc` are shifted by the
    /// reader's, so they compare only within one.
    pub time_ns: Option<String>,
    /// Owner's start, in ticks since boot (`/proc/PID/stat`): tells it from later users of its pid.
    pub start: Option<u64>,
    /// What the owner holds and awaits, as it listed it.
    pub holdings: Vec<Holding>,
    /// The locks it will take once it has what it awaits.
    pub queued: Vec<Holding>,
    /// The leases of the execs the owner runs inside, outermost first.
    pub within: Vec<String>,
    /// The lease file's device and inode as read: they find its table entry even once unlinked.
    pub file: Option<(u64, u64)>,
}

impl Identity {
    /// Whether the process we see as `pid` is the lease's owner, by its start: `None` where that
    /// cannot be told (another host, boot or time namespace, no start in the lease).
    pub fn owner_is(&self, pid: u32) -> Option<bool> {
        if !self.this_boot() || (self.time_ns.is_some() && self.time_ns != namespace("time")) {
            return None;
        }
        let start = self.start?;
        Some(crate::ident::start_time(pid) == Some(start))
    }

    /// Whether the owner's pid means the same process to us: same host, boot and pid namespace.
    pub fn pid_is_ours(&self) -> bool {
        self.host == crate::ident::Me::current().host && self.pid_numbered_as_ours()
    }

    /// Whether the owner's pid numbers a process as we do: same boot and pid namespace, whatever
    /// its host name (a UTS namespace of its own changes that alone).
    pub fn pid_numbered_as_ours(&self) -> bool {
        let me = crate::ident::Me::current();
        self.boot_id.is_some()
            && self.boot_id == me.boot_id
            && self.pid_ns.is_some()
            && self.pid_ns == namespace("pid")
    }

    pub fn this_boot(&self) -> bool {
        let me = crate::ident::Me::current();
        self.host == me.host && self.boot_id.is_some() && self.boot_id == me.boot_id
    }
}

/// Reads what a lease says of its owner (None if it cannot be read).
pub fn identity(leases: &Path, name: &str) -> Option<Identity> {
    if !valid_name(name) {
        return None;
    }
    // A file planted under a lease's name may be a FIFO (blocking this look for good), a symlink or
    // a huge file: only a regular file is read, never waited on, and at most an identity's worth.
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(crate::planted::FLAGS)
        .open(leases.join(name))
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.file_type().is_file() {
        return None;
    }
    let mut bytes = Vec::new();
    io::Read::read_to_end(&mut io::Read::take(&file, IDENTITY_MAX), &mut bytes).ok()?;
    let text = String::from_utf8_lossy(&bytes);
    let mut before = String::new();
    let mut id = Identity {
        file: Some((meta.dev(), meta.ino())),
        ..Identity::default()
    };
    for line in text.lines() {
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        match k {
            "host" => id.host = v.to_owned(),
            "pid" => id.pid = v.parse().ok(),
            "user" => id.user = v.to_owned(),
            "command" => id.command = v.to_owned(),
            "since" => id.since = v.parse().ok(),
            "boot_id" if !v.is_empty() => id.boot_id = Some(v.to_owned()),
            "pid_ns" if !v.is_empty() => id.pid_ns = Some(v.to_owned()),
            "time_ns" if !v.is_empty() => id.time_ns = Some(v.to_owned()),
            "start" => id.start = v.parse().ok(),
            "hold" | "await" | "queue" => {
                let Some(mut h) = Holding::parse(k == "await", v) else {
                    continue;
                };
                h.queued = k == "queue";
                // A line without a command has the command of the line before.
                match h.command.is_empty() {
                    true => h.command.clone_from(&before),
                    false => before.clone_from(&h.command),
                }
                match k {
                    "queue" => id.queued.push(h),
                    _ => id.holdings.push(h),
                }
            }
            "within" => {
                id.within = v
                    .split(':')
                    .filter(|n| !n.is_empty())
                    .map(Into::into)
                    .collect()
            }
            _ => {}
        }
    }
    if id.host.is_empty() {
        // Not written yet: what its name says (HOST-BOOT-PIDNS-PID-RANDOM; HOST has no '-').
        let mut parts = name.strip_suffix(SUFFIX)?.split('-');
        id.host = parts.next()?.to_owned();
        id.pid = parts.nth(2).and_then(|p| p.parse().ok());
        id.command = "(starting)".into();
    }
    Some(id)
}

/// The lease file names in `leases` (none if it cannot be opened: no lease yet).
pub fn listing(leases: &Path) -> Vec<String> {
    crate::dir::Dir::open_in_root(leases)
        .ok()
        .map_or_else(Vec::new, |d| names_in(&d))
}

fn names_in(dir: &crate::dir::Dir) -> Vec<String> {
    let names = dir.names().unwrap_or_default().into_iter();
    names
        .filter_map(|n| n.into_string().ok())
        .filter(|n| valid_name(n))
        .collect()
}

/// Whether a live process lists lock file `lockfile` (relative to the locks) as one it awaits or
/// will take once it has what it waits for (`acquire::queue`).
pub fn awaited(leases: &Path, lockfile: &str) -> bool {
    let awaits = |id: Identity| {
        id.queued.iter().any(|q| q.lockfile == lockfile)
            || (id.holdings.iter()).any(|h| h.awaits && h.lockfile == lockfile)
    };
    listing(leases)
        .iter()
        .any(|n| identity(leases, n).is_some_and(awaits) && alive(leases, n).unwrap_or(true))
}

/// Whether lease `name` belongs to a live owner (its owner holds it locked). A name that is not a
/// plain lease file name is dead.
pub fn alive(leases: &Path, name: &str) -> io::Result<bool> {
    Ok(valid_name(name) && lock::probe_lease(&leases.join(name))?)
}

fn valid_name(name: &str) -> bool {
    name.ends_with(SUFFIX) && !name.contains('/') && !name.starts_with('.')
}

/// Unlinks the leases of gone owners under their exclusive locks, except those `keep` accepts; how
/// many went. `ending` is told each name about to go, under its lock: what it lists is then said
/// nowhere else. Through a descriptor that refused a symlink in the directory's place.
pub fn clean_keeping(
    leases: &Path,
    keep: &mut dyn FnMut(&str) -> bool,
    ending: &mut dyn FnMut(&str),
) -> usize {
    let Ok(dir) = crate::dir::Dir::open_in_root(leases) else {
        return 0;
    };
    let pinned = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
    // The filesystem's time now or earlier: the latest ctime of the directory (changed by every
    // lease made or unlinked) or of our own lease. ctime, as for the lease judged: only the
    // filesystem sets it, unlike mtime (`touch -d`; NFS exclusive creates park a verifier there).
    let now = std::cell::OnceCell::new();
    let fs_now = || {
        *now.get_or_init(|| {
            let own = files(&locked(&MINE))
                .filter_map(|f| f.guard.file().metadata().ok())
                .filter_map(|m| changed(&m))
                .max();
            let dir = std::fs::metadata(&pinned).ok().and_then(|m| changed(&m));
            own.max(dir)
        })
    };
    let mut gone = 0;
    for name in &names_in(&dir) {
        if is_mine(name) {
            continue;
        }
        // A lease never written may be a maker's between its create and its lock: it goes if its
        // name says a gone maker (this host, boot and pid namespace, a pid no longer there) or age.
        let maker_gone = || {
            let pid = maker_here(name).and_then(|p| u32::try_from(p).ok());
            pid.is_some_and(|pid| pid > 0 && !crate::ident::process_exists(pid))
        };
        let goes = |g: &Guard| match g.file().metadata() {
            Ok(m) if m.len() > 0 => true,
            Ok(m) => {
                maker_gone()
                    || changed(&m).zip(fs_now()).is_some_and(|(made, now)| {
                        now.duration_since(made)
                            .is_ok_and(|age| age >= unwritten_grace())
                    })
            }
            Err(_) => false,
        };
        if let Ok(Some(g)) =
            lock::acquire_no_wait(&pinned.join(name), Mode::Exclusive, lock::IfMissing::Fail)
            && !keep(name)
            && goes(&g)
        {
            ending(name);
            if g.unlink_lease().is_err() {
                continue;
            }
            gone += 1;
        }
    }
    gone
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_become_safe_file_name_parts() {
        assert_eq!(safe_part("node07.example"), "node07.example");
        assert_eq!(safe_part("a/b\nc"), "a_b_c");
        assert_eq!(safe_part(""), "host");
    }

    #[test]
    fn a_lease_is_alive_while_held_and_cleaned_once_free() {
        let d = tempfile::tempdir().unwrap();
        let leases = &d.path().join("leases");
        let mut lease = create(leases).unwrap();
        let name = lease.name.clone();
        // Written with the first lock it lists.
        assert_eq!(std::fs::metadata(leases.join(&name)).unwrap().len(), 0);
        lease.rewrite();
        assert!(alive(leases, &name).unwrap());
        // Held: cleaning leaves it alone.
        assert_eq!(clean_keeping(leases, &mut |_| false, &mut |_| {}), 0);
        assert!(leases.join(&name).exists());
        let text = std::fs::read_to_string(leases.join(&name)).unwrap();
        let pid = format!("pid={}\n", std::process::id());
        assert!(text.contains(&pid), "{text}");
        assert!(text.contains("pid_ns=pid:["), "{text}");
        // Its owner gone (the descriptor closed): dead, then cleaned.
        drop(lease);
        assert!(!alive(leases, &name).unwrap());
        assert_eq!(clean_keeping(leases, &mut |_| false, &mut |_| {}), 1);
        assert!(!leases.join(&name).exists());
        assert!(!alive(leases, &name).unwrap());
    }

    #[test]
    fn only_plain_lease_names_are_probed() {
        assert!(valid_name("h-1234abcd-42-00ff.lease"));
        assert!(!valid_name("../images/app.lock"));
        assert!(!valid_name("x/y.lease"));
        assert!(!valid_name(".hidden.lease"));
    }
}
