//! Image records: what an image's lock file says about the image, so that a
//! reader learns "ready" from the lock it takes anyway, without the global
//! lock or the database.
//!
//! The database stays the single source of truth for every image's state.
//! A record is a *ready token* derived from it and kept in the first bytes
//! of the image's lock file (`locks/images/ENC.lock`; the file remains an
//! ordinary lock file, flock(1) on it works as before):
//!
//! ```text
//! stowage-image 1
//! state=ready
//! images=/abs/images/dir
//! crc=1a2b3c4d
//! ```
//!
//! Invariants:
//! - **A valid `ready` record exists only while the image's row says
//!   `ready`.** Every change of a row away from `ready` — a write starting,
//!   a removal marking it, doctor dropping it, a rebuild of the database —
//!   first *invalidates* the record, durably (`fdatasync`), holding the
//!   image's exclusive lock or the store-wide lock (`locks/store.lock`),
//!   which excludes every reader of the fast path. A token is written only
//!   by a holder of the image's lock that saw the row `ready` in a
//!   transaction while holding that lock: a writer after committing
//!   `ready` (exclusive), a reader of the slow path (shared: no writer can
//!   change the row meanwhile, and two readers write the same bytes).
//! - **A reader trusts only what it can check:** the format line (another
//!   version means "ask the database"), the CRC of everything before the
//!   `crc=` line (a torn write, after a power loss, fails it), `state=ready`
//!   and an absolute images directory. Anything else, an empty file
//!   included (a store made before records, a lock file made by flock(1)),
//!   sends it to the database. A mistake can only ever cost a transaction.
//! - **The record's modification time is the image's last use, to
//!   [`crate::session::LAST_USE_RESOLUTION`]:** the fast path is taken only
//!   while it is fresher than that; a slow-path reader records the use in
//!   the database and then rewrites the record, so the row's last use is
//!   never older than the record's time (gc's `--unused-for` slack covers
//!   the resolution).
//! - Bytes after the `crc=` line are ignored: a record is rewritten with
//!   one `pwrite` at offset 0, never truncated (a setattr is one more round
//!   trip on NFS), so a shorter record leaves the tail of a longer one.
//!
//! Two *hints* follow at fixed offsets ([`HINTS_AT`]), one byte each, read
//! in the same `pread` as the token and never touched by a token write, so
//! that an uncontended read opens neither the image's gate nor the store
//! lock:
//! - **writer waits** (`Hint::WriterWaits`): set by a writer that holds the
//!   image's gate exclusively, before it waits for the lock; a reader that
//!   sees it tries the gate (and queues behind the writer if it is held).
//!   Cleared under the gate: by the writer once it has the lock and no
//!   other writer holds the gate, or by a reader that finds the gate free.
//!   Only fairness rests on it (writers are not starved); a lost hint
//!   costs no exclusion.
//! - **store-wide** (`Hint::StoreWide`): set on every image lock file by a
//!   store-wide operation that holds `locks/store.lock` exclusively, before
//!   it checks that every image lock is free; cleared when it ends (still
//!   holding it), or by a reader that holds `store.lock` shared (no
//!   operation can start meanwhile). A read that takes its image lock after
//!   the operation's check therefore sees the hint and asks `store.lock`; one
//!   that took it before is seen by the check. Lock files made after the
//!   pass carry no token a fast read could use: a token is written only
//!   after a start or finish transaction, which the operation's record
//!   refuses (docs/design.md, "Ready tokens").

use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::lock::Guard;

/// The first line; another version makes the record unusable here (the
/// reader asks the database, which knows the schema).
const FORMAT: &str = "stowage-image 1\n";

/// Where the hints start: records end before (a longer one, with a path
/// near PATH_MAX, is not written: such images are read through the
/// database every time).
pub const HINTS_AT: usize = 3072;
const MAX: usize = HINTS_AT;

/// A one-byte flag after the record (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hint {
    /// A writer may be waiting at the image's gate.
    WriterWaits,
    /// A store-wide operation may hold the store.
    StoreWide,
}

impl Hint {
    fn offset(self) -> u64 {
        (HINTS_AT
            + match self {
                Hint::WriterWaits => 0,
                Hint::StoreWide => 1,
            }) as u64
    }
}

/// What one read of a lock file says: the token, if valid and fresh, and
/// the hints.
#[derive(Debug, Default)]
pub struct Seen {
    pub ready: Option<Ready>,
    pub writer_waits: bool,
    pub store_wide: bool,
}

/// The schema version from which binaries keep records: a store migrated
/// to it has locked out every binary that would change an image without
/// invalidating its token. `STOWAGE_DEBUG_SCHEMA_LIMIT` below it acts as
/// such an older binary, which neither reads nor writes records.
const SINCE_SCHEMA: i64 = 5;

fn enabled() -> bool {
    crate::meta::schema_version() >= SINCE_SCHEMA
}

/// What a valid record says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ready {
    /// The images directory the image's tree is in.
    pub images_dir: PathBuf,
}

fn encode(state: &str, images_dir: Option<&Path>) -> Option<Vec<u8>> {
    let mut body = format!("{FORMAT}state={state}\n");
    if let Some(dir) = images_dir {
        let dir = dir.to_str()?;
        if !dir.starts_with('/') || dir.contains('\n') {
            return None;
        }
        body.push_str(&format!("images={dir}\n"));
    }
    body.push_str(&format!("crc={:08x}\n", crc32(body.as_bytes())));
    (body.len() <= MAX).then(|| body.into_bytes())
}

/// Parses a record: `Some` only for a valid, current, `ready` one.
fn decode(bytes: &[u8]) -> Option<Ready> {
    let text = std::str::from_utf8(bytes).ok().or_else(|| {
        // A longer record's tail may follow the crc line: valid UTF-8 up
        // to the point the parse needs is enough.
        let e = std::str::from_utf8(bytes).unwrap_err();
        std::str::from_utf8(&bytes[..e.valid_up_to()]).ok()
    })?;
    let body_len = text.find("\ncrc=")? + 1;
    let (body, rest) = text.split_at(body_len);
    let crc = rest.strip_prefix("crc=")?.split('\n').next()?;
    if crc != format!("{:08x}", crc32(body.as_bytes())) {
        return None;
    }
    let mut lines = body.strip_prefix(FORMAT)?.lines();
    if lines.next()? != "state=ready" {
        return None;
    }
    let dir = lines.next()?.strip_prefix("images=")?;
    if !dir.starts_with('/') || lines.next().is_some() {
        return None;
    }
    Some(Ready {
        images_dir: PathBuf::from(dir),
    })
}

/// How stale an image's recorded last use may be before a read records it
/// again (cargo's resolution for the same purpose): a read of an image
/// used in the last five minutes writes nothing to the metadata.
/// `gc --unused-for D` is that much coarser, on the safe side: it takes an
/// image for unused only once its recorded last use is older than D plus
/// this (a read in the last D may have recorded nothing).
pub const LAST_USE_RESOLUTION: Duration = Duration::from_secs(300);

/// Reads the record of a locked image: `Some` if it is a valid `ready`
/// token written less than [`LAST_USE_RESOLUTION`] ago (less a second: the
/// token is written just after the row's last use, see the module doc).
/// One `pread`; the time comes from the stat the lock already made (see
/// [`Guard::modified_ms`]).
pub fn read_ready(guard: &Guard) -> Option<Ready> {
    read(guard).ready
}

/// [`read_ready`] with the hints, in one `pread`.
pub fn read(guard: &Guard) -> Seen {
    if !enabled() {
        return Seen::default();
    }
    let mut buf = vec![0u8; HINTS_AT + 2];
    let Ok(n) = guard.file().read_at(&mut buf, 0) else {
        return Seen::default();
    };
    let set = |h: Hint| (h.offset() as usize) < n && buf[h.offset() as usize] == b'1';
    let fresh = LAST_USE_RESOLUTION - Duration::from_secs(1);
    let age = crate::clock::now_ms() - guard.modified_ms();
    // A time far in the future (a server clock ahead) is no proof of a
    // recent use either.
    let recent = age.unsigned_abs() < fresh.as_millis() as u64;
    Seen {
        ready: recent.then(|| decode(&buf[..n.min(MAX)])).flatten(),
        writer_waits: set(Hint::WriterWaits),
        store_wide: set(Hint::StoreWide),
    }
}

/// The record of a lock file, if it is a valid `ready` token, whatever its
/// time.
fn read_valid(file: &std::fs::File) -> Option<Ready> {
    let mut buf = vec![0u8; MAX];
    let n = file.read_at(&mut buf, 0).ok()?;
    decode(&buf[..n])
}

/// Sets or clears a hint (see the module doc for who may, holding what).
/// `sync`: durable before the caller lets go of what it holds, so that on
/// NFS a clearing cannot reach the server after a later setting.
pub fn set_hint(file: &std::fs::File, hint: Hint, on: bool, sync: bool) -> io::Result<()> {
    if !enabled() {
        return Ok(());
    }
    file.write_all_at(if on { b"1" } else { b"0" }, hint.offset())?;
    if sync { file.sync_data() } else { Ok(()) }
}

/// Sets (or clears) the store-wide hint on every image lock file: the
/// caller holds `locks/store.lock` exclusively. Each file is closed after
/// its write, which on NFS sends it to the server before the caller's
/// check of the image locks.
pub fn mark_store_wide(image_locks: &Path, on: bool) -> io::Result<()> {
    each_lock_file(image_locks, |file| {
        set_hint(file, Hint::StoreWide, on, false)
    })
}

/// Writes the `ready` token, holding the image's lock after seeing its row
/// `ready` (see the module doc). Not synced: a token lost in a crash only
/// sends the next reader to the database. Best effort for the same reason.
pub fn write_ready(guard: &Guard, images_dir: &Path) {
    if !enabled() {
        return;
    }
    if let Some(bytes) = encode("ready", Some(images_dir)) {
        let _ = guard.file().write_all_at(&bytes, 0);
    }
}

/// Makes the record say nothing, durably, before a row leaves `ready`
/// (the caller holds the image's exclusive lock, or the store-wide lock).
/// A lock file that has no valid token is left alone (nothing written: a
/// new image's first write costs no sync).
pub fn invalidate(file: &std::fs::File) -> io::Result<()> {
    if !enabled() {
        return Ok(());
    }
    if read_valid(file).is_none() {
        return Ok(());
    }
    let bytes = encode("unknown", None).expect("a short record");
    file.write_all_at(&bytes, 0)?;
    // Durable before the row changes: after a power loss, a token that
    // outlived the change would let a reader in on a tree being written.
    file.sync_data()
}

/// Invalidates the records of every image of the root: a rebuilt database
/// has no history to vouch for them. The caller holds the store-wide lock
/// and the global lock while no image lock is held, so no reader of the
/// fast path can be inside; readers of the slow path that took their locks
/// since wait for the global lock and have decided nothing yet.
pub fn invalidate_all(image_locks: &Path) -> io::Result<()> {
    each_lock_file(image_locks, invalidate)
}

/// Runs `f` on every image lock file of `image_locks` (regular files named
/// `*.lock`, opened without following links or creating anything).
fn each_lock_file(
    image_locks: &Path,
    mut f: impl FnMut(&std::fs::File) -> io::Result<()>,
) -> io::Result<()> {
    let entries = match std::fs::read_dir(image_locks) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for e in entries {
        let e = e?;
        if e.file_name().to_str().is_some_and(|n| n.ends_with(".lock"))
            && let Some(file) = open_lock_file(&e.path())?
        {
            f(&file)?;
        }
    }
    Ok(())
}

/// Opens an image lock file for its record: `None` if it is missing or not
/// a regular file (never a lock file stowage made).
fn open_lock_file(path: &Path) -> io::Result<Option<std::fs::File>> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ELOOP) => {
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    Ok(file.metadata()?.is_file().then_some(file))
}

/// [`invalidate`] through the path of an image's lock file, for a caller
/// that excludes the fast path by holding the store-wide lock (so needs no
/// image lock). A missing file has nothing to invalidate; anything but a
/// regular file (never a lock file stowage made) is left alone.
pub fn invalidate_at(path: &Path) -> io::Result<()> {
    match open_lock_file(path)? {
        Some(file) => invalidate(&file),
        None => Ok(()),
    }
}

/// CRC-32 (IEEE 802.3, reflected), bitwise: records are a few hundred
/// bytes, read once per exec.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn a_ready_record_reads_back() {
        let b = encode("ready", Some(Path::new("/s/img"))).unwrap();
        assert_eq!(
            decode(&b),
            Some(Ready {
                images_dir: "/s/img".into()
            })
        );
    }

    #[test]
    fn anything_but_a_valid_ready_record_is_none() {
        let good = encode("ready", Some(Path::new("/s/img"))).unwrap();
        assert_eq!(decode(b""), None);
        assert_eq!(decode(&encode("unknown", None).unwrap()), None);
        // A torn write: any byte changed fails the CRC.
        for i in 0..good.len() - 1 {
            let mut bad = good.clone();
            bad[i] ^= 0x20;
            assert_eq!(decode(&bad), None, "byte {i} changed");
        }
        let newer = String::from_utf8(good.clone())
            .unwrap()
            .replace("stowage-image 1", "stowage-image 2");
        assert_eq!(decode(newer.as_bytes()), None);
        assert_eq!(encode("ready", Some(Path::new("relative"))), None);
        assert_eq!(encode("ready", Some(Path::new("/a\nb"))), None);
    }

    #[test]
    fn a_shorter_record_over_a_longer_one_is_what_reads_back() {
        let mut file = encode("ready", Some(Path::new("/a/long/images/dir"))).unwrap();
        let short = encode("unknown", None).unwrap();
        file[..short.len()].copy_from_slice(&short);
        assert_eq!(decode(&file), None);
        let ready = encode("ready", Some(Path::new("/s"))).unwrap();
        file[..ready.len()].copy_from_slice(&ready);
        assert_eq!(
            decode(&file),
            Some(Ready {
                images_dir: "/s".into()
            })
        );
    }
}
