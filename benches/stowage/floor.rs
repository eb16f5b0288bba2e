//! The raw floor: what a lock costs with nothing but the system calls.
//!
//! The floor is measured with raw syscalls on purpose — it is the yardstick
//! the library is held to — so this module, like src/lock.rs, may call
//! flock(2) directly.
#![allow(clippy::disallowed_methods)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

use stowage::lock::Mode;

fn op(mode: Mode) -> libc::c_int {
    match mode {
        Mode::Shared => libc::LOCK_SH,
        Mode::Exclusive => libc::LOCK_EX,
    }
}

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("no NUL in a temporary path")
}

/// The same open flags the library uses for a lock file it may create.
const OPEN_FLAGS: libc::c_int = libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOFOLLOW;

/// `n` rounds of open + flock + close on `path`.
pub fn open_flock_close(path: &Path, mode: Mode, n: usize) -> Duration {
    let p = c_path(path);
    let op = op(mode);
    let t0 = Instant::now();
    for _ in 0..n {
        // SAFETY: plain system calls on a NUL-terminated path and the
        // descriptor they return.
        unsafe {
            let fd = libc::open(p.as_ptr(), OPEN_FLAGS, 0o666 as libc::c_uint);
            assert!(fd >= 0, "open {}", path.display());
            assert_eq!(libc::flock(fd, op), 0, "flock {}", path.display());
            libc::close(fd);
        }
    }
    t0.elapsed()
}

/// `n` rounds of flock + unlock on a descriptor opened once.
pub fn flock_unlock(path: &Path, mode: Mode, n: usize) -> Duration {
    let p = c_path(path);
    let op = op(mode);
    // SAFETY: as above; the descriptor is closed before returning.
    unsafe {
        let fd = libc::open(p.as_ptr(), OPEN_FLAGS, 0o666 as libc::c_uint);
        assert!(fd >= 0, "open {}", path.display());
        let t0 = Instant::now();
        for _ in 0..n {
            assert_eq!(libc::flock(fd, op), 0);
            assert_eq!(libc::flock(fd, libc::LOCK_UN), 0);
        }
        let took = t0.elapsed();
        libc::close(fd);
        took
    }
}
