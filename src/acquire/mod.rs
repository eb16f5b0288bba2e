//! Acquiring image and slot locks.
//!
//! Every lock a process may have to wait for, but the global lock (`store.rs`) and the store-wide
//! lock (`store_wide.rs`), is taken here: `image::take` for images (exec, rm), [`slot::acquire`]
//! for slots. The rules they keep:
//! - **Try, then announce, then wait.** A lock is first tried without blocking; only a busy one is
//!   announced ("waiting for …", once) and listed as awaited in the lease, with the image locks the
//!   command takes after it as queued ([`queue`]), and the wait holds no global lock.
//! - **No wait for oneself.** A lock an enclosing exec holds (`nested.rs`) is never waited for.
//! - **Nothing left after a failure.** A timed-out or interrupted wait drops its lease line again.

use std::time::Instant;

use anyhow::Result;

use crate::error::{Busy, Error, locked};
use crate::lease::Holding;
use crate::lock::Waited;
use crate::store::Store;

pub mod image;
pub mod slot;

/// When this process began its first wait: a command that waits for several locks in turn gives
/// up after the whole of its `--wait`, and says so, not the part its last lock took.
pub(crate) fn waiting_since() -> Instant {
    static SINCE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *SINCE.get_or_init(Instant::now)
}

/// The image locks this process takes after the one it waits for (listed as awaited meanwhile).
static QUEUED: std::sync::Mutex<Vec<Holding>> = std::sync::Mutex::new(Vec::new());

/// Names the image locks a command takes (after its slot, in lock order): while it waits for any
/// lock, its lease lists those it has yet to take as queued, so gc keeps a base a queued build
/// will read (`lease::awaited`).
pub(crate) fn queue(images: Vec<Holding>) {
    *locked(&QUEUED) = images;
}

/// Runs a wait announced as `what`, with `awaited` and the locks `held` already listed in our lease
/// meanwhile (one write: another host sees no lock table). A timeout is [`Error::Busy`] naming the
/// holders then (`holders_now`) and the time waited in all; a signal interrupts.
pub(crate) fn wait_for<T>(
    store: &Store,
    awaited: Holding,
    held: &[Holding],
    what: String,
    holders_now: impl FnOnce() -> String,
    wait: impl FnOnce() -> Result<Waited<T>>,
) -> Result<T> {
    let leases = store.root().leases();
    let lockfile = awaited.lockfile.clone();
    let mut listed = held.to_vec();
    listed.push(awaited);
    let later = locked(&QUEUED).clone().into_iter();
    let taken =
        |h: &Holding| h.lockfile == lockfile || held.iter().any(|o| o.lockfile == h.lockfile);
    listed.extend(later.filter(|h| !taken(h)));
    crate::lease::note_all(&leases, listed);
    let since = waiting_since();
    let out = wait();
    if let Ok(Waited::Acquired(_)) = &out {
        crate::debug::pause("lock-granted");
    }
    crate::lease::forget(&leases, &lockfile);
    out?.or_else_busy(|| {
        Error::Busy(Busy {
            what,
            holders: holders_now(),
            waited: since.elapsed(),
        })
        .into()
    })
}

/// Who holds a lock a nested call finds its enclosing exec holding.
pub(crate) const ENCLOSING: &str =
    "an enclosing command of this process (a 'stowage exec' that runs it)";

/// Busy (75): `what` is held (as `held`) by our enclosing exec, which waits for us.
pub(crate) fn never_ends(what: String, held: crate::nested::HeldAs) -> anyhow::Error {
    let holders = format!(
        "held ({}) by {ENCLOSING}; waiting for it would never end",
        held.verb()
    );
    Busy::now(what, holders).into()
}
