//! Space kept in reserve for the metadata, so a full filesystem never wedges the store
//! (docs/storage.md, "A full filesystem").
//!
//! - `ROOT/reserve` is a file of allocated blocks ([`target`]: 1 MiB, less on a small filesystem).
//!   A metadata write that fails for a full disk empties it, runs again in the space given back,
//!   and refills it with what is left ([`crate::store::Store::retry_full`]).
//! - Commands that free space (`rm`, `gc`, `doctor --repair`) top it up.
//! - Only ever truncated or extended in place, opened without following symlinks; two processes
//!   filling it at once allocate the same range (harmless). Losing it costs only the protection.

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use nix::fcntl::{FallocateFlags, fallocate};

/// Is this error the disk (or a quota) being full, from SQLite or the OS?
pub fn is_full(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        if let Some(rusqlite::Error::SqliteFailure(f, _)) = e.downcast_ref::<rusqlite::Error>() {
            return f.code == rusqlite::ErrorCode::DiskFull;
        }
        e.downcast_ref::<std::io::Error>().is_some_and(is_full_io)
    })
}

/// Is this I/O error the disk (or a quota) being full?
pub fn is_full_io(err: &std::io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// Reserve size: 1 MiB, or 1/64 of a smaller filesystem (a transaction needs a few journal pages).
pub fn target(reserve: &Path) -> u64 {
    const MAX: u64 = 1 << 20;
    match nix::sys::statvfs::statvfs(reserve.parent().unwrap_or(Path::new("/"))) {
        #[allow(clippy::unnecessary_cast)]
        Ok(st) => (st.blocks() as u64 * st.fragment_size() as u64 / 64).clamp(64 << 10, MAX),
        Err(_) => MAX,
    }
}

/// Opens the reserve for writing: no link in any component, no blocking on a planted FIFO, and
/// only a regular file with no other name (a hard link may lie outside the root).
fn open(reserve: &Path, create: bool) -> Option<std::fs::File> {
    let create = if create { libc::O_CREAT } else { 0 };
    let f = crate::planted::open(reserve, libc::O_WRONLY | create, 0o666).ok()?;
    crate::planted::check_written(reserve, &f).ok().map(|()| f)
}

/// Empties the reserve; true if it gave back any space.
pub fn release(reserve: &Path) -> bool {
    let Some(f) = open(reserve, false) else {
        return false;
    };
    let had = f.metadata().map(|m| m.blocks()).unwrap_or(0) > 0;
    had && f.set_len(0).is_ok()
}

/// Fills the reserve up to its size with what is free (best effort).
pub fn refill(reserve: &Path) {
    let Some(f) = open(reserve, true) else {
        return;
    };
    let want = target(reserve);
    let have = f.metadata().map(|m| m.blocks() * 512).unwrap_or(0);
    if have >= want {
        return;
    }
    let mode = FallocateFlags::empty();
    if fallocate(&f, mode, 0, want as libc::off_t).is_ok() {
        return;
    }
    // Not all free, or no fallocate: take a chunk at a time, writing zeros where fallocate fails.
    const CHUNK: u64 = 16 << 10;
    let zeros = [0u8; CHUNK as usize];
    for at in (0..want).step_by(CHUNK as usize) {
        let ok = fallocate(&f, mode, at as libc::off_t, CHUNK as libc::off_t).is_ok()
            || f.write_at(&zeros, at).is_ok_and(|n| n == CHUNK as usize);
        if !ok {
            break;
        }
    }
}

/// Bytes free for an unprivileged writer on the filesystem of `dir`.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(dir).ok()?;
    #[allow(clippy::unnecessary_cast)]
    Some(st.blocks_available() as u64 * st.fragment_size() as u64)
}
