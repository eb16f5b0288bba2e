//! The kernel's lock table (`/proc/locks`): who holds and awaits flocks on this host, by pid — to
//! name processes stowage did not start.
//!
//! - Only where locks are local: on NFS, Lustre and the like it lists this client's locks alone,
//!   so there a lock's state is found by probing.
//! - It names files by their superblock's device number, not always stat(2)'s (btrfs
//!   subvolumes): learned from a lock of our own via `/proc/self/fdinfo`, never assumed `st_dev`.
//! - Pids are as our pid namespace numbers them; locks of processes outside it are hidden, so
//!   "free" from the table is confirmed by a probe before it contradicts a live lease.
//! - [`inherited_flocks`] finds an enclosing command's inherited holds, never to be waited for.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::lock::Mode;

/// One entry of the kernel's lock table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// The process that took the lock (None where the table shows none).
    pub pid: Option<u32>,
    pub mode: Mode,
    /// A request waiting for the lock rather than holding it.
    pub blocked: bool,
}

/// The flock table: each locked file's entries, by the kernel's device number and inode.
pub type Table = HashMap<(u64, u64), Vec<Entry>>;

/// The kernel's device number for the filesystem of `dir` (readable by us): what
/// `/proc/self/fdinfo` shows for a moment's shared flock on it. None without /proc or flock lines.
pub fn device_of(dir: &Path) -> Option<u64> {
    let d = crate::dir::Dir::open_in_root(dir).ok()?;
    crate::lock::flock_dir_shared(d.as_raw_fd()).ok()?;
    let info = fs::read_to_string(format!("/proc/self/fdinfo/{}", d.as_raw_fd())).ok()?;
    fdinfo_flocks(&info).next().map(|((dev, _), _)| dev)
}

/// The flocks held, not awaited, in an fdinfo text (its `lock:` lines).
fn fdinfo_flocks(info: &str) -> impl Iterator<Item = ((u64, u64), Mode)> + '_ {
    info.lines()
        .filter_map(|l| parse_line(l.strip_prefix("lock:")?))
        .filter(|(_, e)| !e.blocked)
        .map(|(key, e)| (key, e.mode))
}

/// A flocked file by the lock table's key (device, inode), and the pid that took its lock.
pub type Taken = ((u64, u64), Option<u32>);

/// The flocks held, not awaited, in an fdinfo text, each with the pid that took it.
fn fdinfo_takers(info: &str) -> impl Iterator<Item = Taken> + '_ {
    info.lines()
        .filter_map(|l| parse_line(l.strip_prefix("lock:")?))
        .filter(|(_, e)| !e.blocked)
        .map(|(key, e)| (key, e.pid))
}

/// The descriptors this process was started with (noted by [`note_inherited`]).
static INHERITED: OnceLock<Vec<RawFd>> = OnceLock::new();

/// Notes inherited descriptors before we open any: a `/proc/self/fd` listing, no server request.
pub fn note_inherited() {
    use nix::fcntl::OFlag;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let fds = nix::dir::Dir::open("/proc/self/fd", flags, nix::sys::stat::Mode::empty())
        .map(|mut d| {
            // Not the listing's own descriptor: its number, free again once it closes, goes to the
            // next open (an image lock a repair takes), which must not pass for an inherited one.
            let own = d.as_raw_fd();
            d.iter()
                .flatten()
                .filter_map(|e| e.file_name().to_str().ok()?.parse().ok())
                .filter(|&fd| fd != own)
                .collect()
        })
        .unwrap_or_default();
    let _ = INHERITED.set(fds);
}

/// The flocks this process holds through the descriptors it was started with ([`note_inherited`]):
/// each one's `/proc/self/fd` link (read, never followed), its file's device and inode, and the
/// mode. An enclosing command's, held while it waits for us: a wait on one would never end.
pub fn inherited_flocks() -> Vec<(PathBuf, (u64, u64), Mode)> {
    let fds = INHERITED.get().into_iter().flatten();
    fds.filter_map(|&fd| {
        let mode = fd_flock(fd)?;
        let link = fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
        Some((link, crate::lock::fd_identity(fd)?, mode))
    })
    .collect()
}

/// The flock this process holds through descriptor `fd`, per `/proc/self/fdinfo/FD`.
fn fd_flock(fd: RawFd) -> Option<Mode> {
    let info = fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    fdinfo_flocks(&info).map(|(_, mode)| mode).max()
}

/// The files (device, inode) local process `pid` flocks through its own fds, each with the pid that
/// took the lock (the table names that one, maybe another's since: an inheritor holds it on).
/// Empty if no process has the pid, `None` if its fds are unreadable. No `stat` (it waits on a
/// hung FUSE or NFS mount).
pub fn locks_through_own_fds(pid: u32) -> Option<Vec<Taken>> {
    let fds = match fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(fds) => fds,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Some(Vec::new()),
        Err(_) => return None,
    };
    let mut held = Vec::new();
    for fd in fds.flatten() {
        match fs::read_link(fd.path()) {
            Ok(target) if is_lock_name(&target) => {}
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => return None,
            // No lock file of stowage's; or closed since.
            _ => continue,
        }
        let info = format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_string_lossy());
        match fs::read_to_string(info) {
            Ok(info) => held.extend(fdinfo_takers(&info)),
            // Closed since the listing.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(_) => return None,
        }
    }
    Some(held)
}

/// Whether a `/proc/PID/fd` link names a lock file or lease (an unlinked one's ends "(deleted)").
fn is_lock_name(target: &Path) -> bool {
    let name = target.to_string_lossy();
    let name = name.strip_suffix(" (deleted)").unwrap_or(&name);
    name.ends_with(".lock") || name.ends_with(".lease")
}

/// Reads /proc/locks until two reads agree (at most four), the reads folded: the kernel makes it a
/// page at a time, so entries that move meanwhile can be skipped or repeated.
pub fn read_table() -> io::Result<Table> {
    let mut reads: Vec<String> = Vec::with_capacity(4);
    for _ in 0..4 {
        let text = fs::read_to_string("/proc/locks")?;
        let agree = reads.last().is_some_and(|p| *p == text);
        reads.push(text);
        if agree {
            break;
        }
    }
    Ok(fold(&reads))
}

/// Folds reads into one, keeping everything seen (a lock held throughout is then all but surely
/// seen); but reads from different moments can show a state no lock was in (two exclusive holders
/// in turn): such a lock gets its entries from the latest read that holds together.
fn fold(reads: &[String]) -> Table {
    let parsed: Vec<Table> = reads
        .iter()
        .map(|t| tabled(t.lines().filter_map(parse_line)))
        .collect();
    let mut table = tabled(
        parsed
            .iter()
            .flat_map(|one| one.iter().flat_map(|(k, es)| es.iter().map(|e| (*k, *e)))),
    );
    for (key, entries) in table.iter_mut().filter(|(_, es)| !consistent(es)) {
        let latest = parsed
            .iter()
            .rev()
            .filter_map(|one| one.get(key))
            .find(|es| consistent(es) && es.iter().any(|e| !e.blocked));
        *entries = latest.cloned().unwrap_or_else(|| {
            let exclusive = |e: &&Entry| !e.blocked && e.mode == Mode::Exclusive;
            let holder = entries.iter().rev().find(exclusive);
            let blocked = entries.iter().filter(|e| e.blocked);
            holder.into_iter().chain(blocked).copied().collect()
        });
    }
    table
}

/// Could one lock be held this way at one moment?
fn consistent(entries: &[Entry]) -> bool {
    let held = |m| entries.iter().filter(|e| !e.blocked && e.mode == m).count();
    let exclusive = held(Mode::Exclusive);
    exclusive == 0 || (exclusive == 1 && held(Mode::Shared) == 0)
}

/// The entries by file, each once, in the order first given.
fn tabled(entries: impl Iterator<Item = ((u64, u64), Entry)>) -> Table {
    let mut table = Table::new();
    for (key, e) in entries {
        let all = table.entry(key).or_default();
        if !all.contains(&e) {
            all.push(e);
        }
    }
    table
}

/// One entry: `1: [->] FLOCK  ADVISORY  WRITE 4121 00:2a:123456 0 EOF` (`->`: blocked).
fn parse_line(line: &str) -> Option<((u64, u64), Entry)> {
    let mut f = line.split_whitespace().peekable();
    f.next_if(|w| w.ends_with(':'));
    let blocked = f.next_if_eq(&"->").is_some();
    let (kind, _, rw, pid, id) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    if kind != "FLOCK" {
        return None;
    }
    let mut parts = id.split(':');
    let maj = u32::from_str_radix(parts.next()?, 16).ok()?;
    let min = u32::from_str_radix(parts.next()?, 16).ok()?;
    let ino = parts.next()?.parse::<u64>().ok()?;
    let mode = match rw {
        "WRITE" => Mode::Exclusive,
        "READ" => Mode::Shared,
        _ => return None,
    };
    let pid = pid.parse::<i64>().ok().filter(|p| *p > 0).map(|p| p as u32);
    Some(((libc::makedev(maj, min), ino), Entry { pid, mode, blocked }))
}

/// Whether the lock table shows every holder of a local lock: only in the initial pid namespace
/// (fixed inode `PROC_PID_INIT_INO`); a child namespace's omits processes it cannot see.
pub fn shows_every_holder() -> bool {
    static SHOWS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SHOWS.get_or_init(|| {
        std::fs::read_link("/proc/self/ns/pid").is_ok_and(|l| l.as_os_str() == "pid:[4026531836]")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_lock_table() {
        let text = "1: FLOCK  ADVISORY  WRITE 4121 00:2a:123456 0 EOF\n\
             1: -> FLOCK  ADVISORY  READ 4130 00:2a:123456 0 EOF\n\
             2: POSIX  ADVISORY  WRITE 99 00:2a:7 0 EOF\n";
        let t = tabled(text.lines().filter_map(parse_line));
        let es = &t[&(libc::makedev(0, 0x2a), 123456)];
        assert_eq!(es.len(), 2);
        assert!(es[1].blocked && es[1].mode == Mode::Shared);
        assert!(!t.contains_key(&(libc::makedev(0, 0x2a), 7)));
    }

    #[test]
    fn folded_reads_show_a_state_the_lock_was_really_in() {
        let a = "1: FLOCK  ADVISORY  WRITE 1 00:2a:5 0 EOF\n".to_owned();
        let b = "1: FLOCK  ADVISORY  WRITE 2 00:2a:5 0 EOF\n".to_owned();
        let t = fold(&[a, b]);
        let es = &t[&(libc::makedev(0, 0x2a), 5)];
        assert_eq!(es.len(), 1);
        assert_eq!(es[0].pid, Some(2));
    }

    #[test]
    fn an_inherited_flock_is_seen_in_fdinfo() {
        use crate::lock::{IfMissing, acquire_no_wait};
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.lock");
        let g = acquire_no_wait(&p, Mode::Shared, IfMissing::Create)
            .unwrap()
            .unwrap();
        assert_eq!(fd_flock(g.as_raw_fd()), Some(Mode::Shared));
        assert_eq!(fd_flock(fs::File::open(&p).unwrap().as_raw_fd()), None);
    }

    #[test]
    fn the_device_is_learned_from_a_lock_of_our_own() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let dev = device_of(d.path()).expect("fdinfo lists flocks here");
        // On most filesystems it is stat's device; on btrfs it is not.
        if crate::filesystem::filesystem(d.path()).unwrap().name != "btrfs" {
            assert_eq!(dev, fs::metadata(d.path()).unwrap().dev());
        }
    }
}
