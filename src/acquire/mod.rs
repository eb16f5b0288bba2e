//! Acquiring image and slot locks: gates, waiter records, waiting.
//!
//! Everything that takes a lock a process may have to wait for, except the
//! global lock (`store.rs`) and the store-wide hold (`store_wide.rs`), goes
//! through here: `image::acquire_image` for images (exec, rm),
//! [`slot::acquire`] for slots. The rules they keep:
//! - **Try, then announce, then wait.** A lock is first tried without
//!   blocking; only a busy one gets a waiter record (so lock-status lists
//!   the waiter) and one "waiting for …" line
//!   ([`crate::holders::announce_wait`]), and the wait holds no global lock.
//! - **No wait for oneself.** A lock held by an enclosing `stowage exec`
//!   (`nested.rs`) is never waited for.
//! - **Nothing left after a failure.** A wait that times out or is
//!   interrupted drops its waiter record (`wait_as_waiter`).

use std::time::Instant;

use anyhow::Result;

use crate::error::{Busy, Error};
use crate::lock::Waited;
use crate::store::Store;

pub mod image;
pub mod slot;

/// Runs a wait announced as `what`, held by `holders`, and makes its
/// outcome the caller's: a timeout is [`Error::Busy`] (exit 75), a signal
/// [`Error::Interrupted`]. On any failure the waiter record goes again.
pub(crate) fn wait_as_waiter<T>(
    store: &mut Store,
    waiter: Option<i64>,
    what: String,
    holders: String,
    wait: impl FnOnce() -> Result<Waited<T>>,
) -> Result<T> {
    let t0 = Instant::now();
    let failure = match wait() {
        Ok(Waited::Acquired(got)) => return Ok(got),
        Ok(Waited::TimedOut) => anyhow::Error::from(Error::Busy(Busy {
            what,
            holders,
            waited: t0.elapsed(),
        })),
        Ok(Waited::Interrupted(sig)) => Error::Interrupted(sig).into(),
        Err(e) => e,
    };
    if let Some(id) = waiter {
        store.forget_record(id);
    }
    Err(failure)
}
