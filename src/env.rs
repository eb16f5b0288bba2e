//! Every environment variable stowage reads or sets, named once.
//!
//! - Code uses these constants, never the string, so the compiler finds a renamed or retired one.
//! - The hidden `DEBUG_*` hooks let tests make, with real processes, what this machine cannot
//!   (another filesystem, a lost NFS lock, a pause at one step); docs/design.md documents them.

/// The store's root directory, when `--root` is not given (set but empty: refused, 64).
pub const ROOT: &str = "STOWAGE_ROOT";
/// Set for an exec's command: the images directory.
pub const IMAGES_DIR: &str = "STOWAGE_IMAGES_DIR";
/// Set for an exec's command when it writes exactly one image: its tree.
pub const IMAGE_DIR: &str = "STOWAGE_IMAGE_DIR";
/// Set for an exec's command: the leases of the execs that run it, outermost first, `:` between.
pub const EXEC_LEASES: &str = "STOWAGE_EXEC_LEASES";
/// The time "now" for recorded times (tests, reproducible reports): RFC 3339 or epoch seconds.
pub const NOW: &str = "STOWAGE_NOW";
/// The variable through which a completion script calls stowage back: stowage's own name, so
/// another tool's `COMPLETE` in a build's environment never turns an exec into a completion.
pub const COMPLETE: &str = "_STOWAGE_COMPLETE";

/// Hidden test hook: every filesystem looks like NAME (`nfs`, `lustre`, `beegfs`, `tmpfs`, …).
pub const DEBUG_FILESYSTEM: &str = "STOWAGE_DEBUG_FILESYSTEM";
/// Hidden test hook: a file read instead of /proc/self/mountinfo (mounts that are not here).
pub const DEBUG_MOUNTINFO: &str = "STOWAGE_DEBUG_MOUNTINFO";
/// Hidden test hook: `POINT:FILE[,POINT:FILE…]` pauses at a named step (`debug::pause`) for a test.
pub const DEBUG_PAUSE: &str = "STOWAGE_DEBUG_PAUSE";
/// Hidden test hook: a lock file whose lock is reported lost when verified, as on NFS lease expiry.
pub const DEBUG_LOST_LOCK: &str = "STOWAGE_DEBUG_LOST_LOCK";
/// Hidden test hook: SQLite's busy timeout in milliseconds.
pub const DEBUG_DB_BUSY_MS: &str = "STOWAGE_DEBUG_DB_BUSY_MS";
/// Hidden test hook: ms a lease nobody wrote is left to its maker (`lease.rs`; else 10 minutes).
pub const DEBUG_UNWRITTEN_LEASE_MS: &str = "STOWAGE_DEBUG_UNWRITTEN_LEASE_MS";
/// Hidden test hook: ms before an exec on a shared filesystem makes the lease it named (else 30).
pub const DEBUG_ANNOUNCE_MS: &str = "STOWAGE_DEBUG_ANNOUNCE_MS";
/// Hidden test hook: ms of the last use's resolution (`image_record.rs`; else five minutes).
pub const DEBUG_USE_RESOLUTION_MS: &str = "STOWAGE_DEBUG_USE_RESOLUTION_MS";
/// Test hook: ms between a wait's plain lines where stderr is no terminal (else one a minute).
pub const DEBUG_WAIT_LINE_MS: &str = "STOWAGE_DEBUG_WAIT_LINE_MS";

/// `ms` milliseconds, unless a test sets `var` (a `DEBUG_*_MS` hook) to a number.
pub fn debug_ms(var: &str, ms: u64) -> std::time::Duration {
    let set = std::env::var(var).ok().and_then(|v| v.parse().ok());
    std::time::Duration::from_millis(set.unwrap_or(ms))
}
