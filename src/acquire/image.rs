//! Taking an image lock: the gate that gives writers preference, the
//! waiter record, the check that a wait could ever end, and what a failed
//! request must not leave behind.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::ctx::Ctx;
use crate::error::{Busy, Error};
use crate::lock::{self, Guard, Mode, Wait, Waited};
use crate::meta::{ImageState, LockKind, Record, Role, Tx};
use crate::name::ImageName;
use crate::store::Store;

use super::wait_as_waiter;

/// What an image lock is taken for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Need {
    /// Writing: the image may be new, so its lock file may be created.
    Create,
    /// Reading: the image must exist and be ready.
    Ready,
    /// Removing: the image must exist, in any state.
    Exists,
}

/// How to take one image lock.
pub(crate) struct Want<'a> {
    pub mode: Mode,
    pub need: Need,
    pub deadline: Option<Instant>,
    pub no_wait: bool,
    pub command: &'a str,
    /// Images that must exist for the request to go ahead (its reads):
    /// checked before any wait, so that a request that can only fail says
    /// so at once instead of after the wait (they are checked again under
    /// the locks, by the start transaction).
    pub must_exist: &'a [ImageName],
}

/// Takes one image lock, waiting as allowed. Returns the guard and the id
/// of the waiter record made while waiting, if any. Creates nothing for an
/// image that does not exist unless `need` is [`Need::Create`].
///
/// Writer preference: each image has a *gate* file beside its lock. A
/// writer that has to wait holds the gate exclusively while it waits for the
/// lock; a reader passes the gate (shared) before taking the lock, so once a
/// writer waits, new readers queue behind it and the writer gets in as soon
/// as the readers already inside finish. Uncontended, a writer never touches
/// the gate and a reader only tries it (one extra lock operation, no file
/// created). In the lock order each image's gate comes just before its
/// lock, so multi-image requests stay deadlock-free.
pub(crate) fn acquire_image(
    store: &mut Store,
    name: &ImageName,
    want: &Want,
) -> Result<(Guard, Option<i64>)> {
    let mode = want.mode;
    let path = store.root().image_lock(name);
    let gate = store.root().image_gate(name);
    // A holder that records nothing (rm) is still known by its lease; made
    // already by an exec. A failure leaves it shown as an outsider.
    let _ = crate::lease::mine(&store.root().leases());
    // An exclusive lock on an image that must be ready is --read-exclusive.
    let verb = if mode == Mode::Exclusive && want.need == Need::Ready {
        "exclusive read"
    } else {
        mode.verb()
    };
    let what = format!("{verb} lock on image '{name}'");
    let err = |e| lock::error(&format!("image '{name}'"), &path, e);
    let first = match try_image(&gate, &path, mode, want.need == Need::Create) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if want.need == Need::Create {
                // The layout does not exist yet: first use of this root.
                store.root().create_layout()?;
            } else {
                // No lock file: either no such image (say so, creating
                // nothing), or an adopted image never locked before.
                require(store, name, want.need, want.deadline)?;
                crate::debug::pause("image-required");
            }
            try_image(&gate, &path, mode, true)
        }
        other => other,
    };
    let writer_ahead = match first.map_err(err)? {
        Tried::Got(g) => return Ok((g, None)),
        Tried::Held => false,
        Tried::WriterWaiting => true,
    };
    if let Some(held) = crate::nested::enclosing_hold(&path)
        && (mode == Mode::Exclusive || held == Mode::Exclusive)
    {
        return Err(waits_for_itself(name, mode, held));
    }

    // Busy. Record ourselves as a waiter and find out who holds it.
    let (waiter, mut holders) = {
        let (tx, ctx) = store.begin(want.deadline)?;
        let kv = crate::judge::kernel_view(&tx, ctx, &ctx.root.image_locks());
        let view = kv.view(&path)?;
        let records = tx.records_for(LockKind::Image, name.as_str())?;
        let lockfile = crate::root::Root::image_lock_rel(name);
        let (holders, _) = crate::judge::prune(&tx, ctx, &kv, &view, &records, &lockfile)?;
        require_all(&tx, &ctx.root, want.must_exist)?;
        let id = if want.no_wait {
            None
        } else {
            Some(tx.insert_record(&record(ctx, name, mode, Role::Waiter, want.command))?)
        };
        tx.commit()?;
        (id, crate::holders::phrase(&holders))
    };
    if writer_ahead {
        holders.push_str("; and a writer waits ahead of new readers");
    }
    if want.no_wait {
        // A probe by lock-status or a store-wide check may have held it for
        // a few microseconds: look once more before calling it busy.
        if let Tried::Got(g) = try_image(&gate, &path, mode, true).map_err(err)? {
            return Ok((g, None));
        }
        return Err(Error::Busy(Busy {
            what,
            holders,
            waited: Duration::ZERO,
        })
        .into());
    }
    crate::holders::announce_wait(store.ctx(), &what, &holders);
    // The lease says what we await while we wait (the waiter record says it
    // too, where it could be made).
    let leases = store.root().leases();
    let lockfile = crate::root::Root::image_lock_rel(name);
    crate::lease::note(
        &leases,
        crate::lease::Holding::now(mode, lockfile.clone(), true, want.command),
    );
    let mut wait = Wait::on(&store.root().image_locks(), want.deadline);
    let got = wait_as_waiter(store, waiter, what, holders, || {
        wait_image(&gate, &path, mode, &mut wait).map_err(err)
    });
    crate::lease::forget(&leases, &lockfile);
    Ok((got?, waiter))
}

/// A plain read's fast path (record.rs): the image lock taken at once, a
/// fresh `ready` token in the lock file, and no writer waiting at the gate
/// (asked only when the file's hint says one may be; a stale hint is
/// cleared under the gate). Returns the lock, the images directory the
/// token names, and whether the store-wide hint is set (the caller asks
/// `store.lock` then). `None` sends the read the slow way (the database),
/// which decides everything this does not: a missing lock file, a wait, a
/// nested hold, an image not ready or not recorded lately.
pub(crate) fn try_ready(
    root: &crate::root::Root,
    name: &ImageName,
    db: &std::cell::OnceCell<Option<crate::record::DbId>>,
) -> Option<(Guard, PathBuf, bool)> {
    let path = root.image_lock(name);
    // A valid token vouches that the file is still the one at the path
    // (lock::acquire_no_wait_vouched): no stat for the unlink race.
    let (g, seen) =
        lock::acquire_no_wait_vouched(&path, Mode::Shared, lock::IfMissing::Fail, |f| {
            let seen = crate::record::read_file(f, root, name, db);
            let vouched = seen.ready.is_some();
            (seen, vouched)
        })
        .ok()??;
    let ready = seen.ready?;
    if seen.writer_waits {
        match lock::acquire_no_wait(&root.image_gate(name), Mode::Shared, lock::IfMissing::Fail) {
            // No writer holds the gate: the hint is stale (its writer got
            // in, or died waiting). Cleared while we hold the gate, when no
            // writer can be setting it.
            Ok(Some(_passed)) => {
                let _ = crate::record::set_hint(
                    g.file(),
                    crate::record::Hint::WriterWaits,
                    false,
                    true,
                );
            }
            // No gate file: nobody has it; the hint stays (clearing it
            // without the gate could undo a writer's hint set meanwhile).
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            _ => return None,
        }
    }
    Some((g, ready, seen.store_wide))
}

/// A write's fast path (`crate::written`): the image lock taken at once,
/// exclusively, over a valid ready token in the writers' format that names
/// the image, and no store-wide hint. Returns the lock, the token and the
/// token area's bytes (put back if the write never starts). `None` sends
/// the write the slow way: a new image, a wait, an image not ready, a
/// store not yet at the schema whose binaries fold writers' records.
pub(crate) fn try_write(
    root: &crate::root::Root,
    name: &ImageName,
    db: &std::cell::OnceCell<Option<crate::record::DbId>>,
) -> Option<(Guard, crate::record::Token, Vec<u8>)> {
    let path = root.image_lock(name);
    // The token vouches for the file, as for a read.
    let (g, (token, bytes)) =
        lock::acquire_no_wait_vouched(&path, Mode::Exclusive, lock::IfMissing::Fail, |f| {
            let Ok(found) = crate::record::found(f) else {
                return ((None, Vec::new()), false);
            };
            let token = found.record.filter(|t| {
                found.writers_format
                    && t.state == crate::record::State::Ready
                    && t.image == name.as_str()
                    && !found.store_wide
                    // Of the database there now, as a read checks: a write
                    // that succeeds is then recorded as ready by it (a
                    // damaged or replaced database sends the write its way,
                    // to fail or wait).
                    && db
                        .get_or_init(|| crate::record::DbId::of(&root.db()))
                        .is_some_and(|now| now == t.db)
            });
            let vouched = token.is_some();
            ((token, found.bytes), vouched)
        })
        .ok()??;
    Some((g, token?, bytes))
}

/// A new image's fast path (`crate::written`, new images): the image's
/// lock, taken exclusively at once, and whether this very open made the
/// file. Either it made the lock file (`O_EXCL`: no file was there), or
/// the file there says nothing — no valid record: a removed image's (on a
/// filesystem where lock files are kept: NFS), a leftover, an image whose
/// last write failed or was taken away. Either way the caller makes the
/// tree itself (`mkdirat`: it must not exist), so whatever row the name
/// may have describes no tree that is there. The lock is checked to be
/// the file at its path (the unlink rule's two stats). `None`: a lock
/// file with a record (an image, ready or being written: the slow way
/// decides), a lock someone holds, or the store's layout not made yet.
pub(crate) fn try_new(root: &crate::root::Root, name: &ImageName) -> Option<(Guard, bool)> {
    let path = root.image_lock(name);
    match lock::create_locked(&path) {
        Ok(Some(g)) => return lock::still_at_path(&g).ok()?.then_some((g, true)),
        Ok(None) => {}
        Err(_) => return None,
    }
    let g = lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Fail).ok()??;
    let found = crate::record::found(g.file()).ok()?;
    found.record.is_none().then_some((g, false))
}

/// The error for a lock that this process's enclosing command holds in a
/// conflicting mode (`held`): waiting would never end, since the enclosing
/// command waits for us. A read of an image it writes finds the image not
/// ready (exit 66); a write of an image it holds is a lock that cannot be
/// had (exit 75).
fn waits_for_itself(name: &ImageName, mode: Mode, held: Mode) -> anyhow::Error {
    let by = "an enclosing command of this process (a 'stowage exec' that runs it)";
    match mode {
        Mode::Shared => Error::NotReady {
            name: name.as_str().to_owned(),
            state: format!("being written by {by}"),
        }
        .into(),
        Mode::Exclusive => Error::Busy(Busy {
            what: format!("write lock on image '{name}'"),
            holders: format!(
                "held ({}) by {by}; waiting for it would never end",
                held.verb()
            ),
            waited: Duration::ZERO,
        })
        .into(),
    }
}

enum Tried {
    Got(Guard),
    /// Someone holds the lock in a conflicting mode.
    Held,
    /// A writer waits at the gate: a reader must queue behind it.
    WriterWaiting,
}

/// One non-blocking attempt. A writer goes straight for the lock; a reader
/// takes the lock, then checks that no writer waits at the gate (a missing
/// gate file means none ever waited).
fn try_image(gate: &Path, path: &Path, mode: Mode, create: bool) -> io::Result<Tried> {
    let Some(g) = lock::acquire_no_wait(path, mode, lock::IfMissing::create_if(create))? else {
        return Ok(Tried::Held);
    };
    if mode == Mode::Exclusive {
        return Ok(Tried::Got(g));
    }
    match lock::acquire_no_wait(gate, Mode::Shared, lock::IfMissing::Fail) {
        Ok(Some(_passed)) => Ok(Tried::Got(g)),
        // A reader whose enclosing command already reads the image is part
        // of that hold: the writer at the gate waits for the enclosing
        // reader, which waits for us, so queueing behind the writer would
        // be a cycle. It passes, as it would under flock(1).
        // (Our own lock on it, just taken, is no such hold.)
        Ok(None)
            if crate::nested::enclosing_hold_except(
                path,
                Some(std::os::fd::AsRawFd::as_raw_fd(&g)),
            )
            .is_some() =>
        {
            Ok(Tried::Got(g))
        }
        Ok(None) => Ok(Tried::WriterWaiting),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Tried::Got(g)),
        Err(e) => Err(e),
    }
}

/// Waits through the gate: takes it in our mode (a writer exclusively,
/// which holds back new readers; a reader shared, queueing behind a waiting
/// writer), holds it while waiting for the lock, then lets it go. The gate
/// descriptor is never inherited, so releasing it is a plain close.
fn wait_image(gate: &Path, path: &Path, mode: Mode, wait: &mut Wait) -> io::Result<Waited<Guard>> {
    use crate::record::{Hint, set_hint};
    let passage = match lock::acquire(gate, mode, lock::IfMissing::Create, wait)? {
        Waited::Acquired(g) => g,
        Waited::TimedOut => return Ok(Waited::TimedOut),
        Waited::Interrupted(sig) => return Ok(Waited::Interrupted(sig)),
    };
    if mode == Mode::Exclusive {
        // Holding the gate: tell readers of the fast path, which open it
        // only when hinted, to queue behind us (record.rs). Closed before
        // the wait, which on NFS sends the hint to the server.
        if let Ok(Some(file)) = lock::open_existing(path) {
            let _ = set_hint(&file, Hint::WriterWaits, true, false);
        }
    }
    let got = lock::acquire(path, mode, lock::IfMissing::Create, wait);
    if mode == Mode::Exclusive
        && let Ok(Waited::Acquired(g)) = &got
    {
        // In: the hint goes unless another writer now waits at the gate
        // (a try of the gate, ours included, fails while one holds it —
        // after we let it go).
        drop(passage);
        if let Ok(Some(_alone)) =
            lock::acquire_no_wait(gate, Mode::Exclusive, lock::IfMissing::Fail)
        {
            let _ = set_hint(g.file(), Hint::WriterWaits, false, true);
        }
        return got;
    }
    drop(passage);
    got
}

/// Before a wait: fails with [`Error::NoSuchImage`] (exit 66) if one of
/// `names` has no row. An image in any state may still become readable
/// while we wait (its writer finishes), so only absence is final — and a
/// new image written without the database has no row until its record is
/// folded (`crate::written::new_write_of`): it is there to wait for.
pub(crate) fn require_all(tx: &Tx, root: &crate::root::Root, names: &[ImageName]) -> Result<()> {
    for n in names {
        if tx.image(n.as_str())?.is_none() && !crate::written::new_write_of(tx, root, n) {
            return Err(Error::NoSuchImage(n.as_str().to_owned()).into());
        }
    }
    Ok(())
}

/// For an image that has no lock file: fails unless the image exists (and,
/// for [`Need::Ready`], is ready).
fn require(
    store: &mut Store,
    name: &ImageName,
    need: Need,
    deadline: Option<Instant>,
) -> Result<()> {
    let (tx, _) = store.begin(deadline)?;
    let row = tx.image(name.as_str())?;
    drop(tx);
    match row {
        None => Err(Error::NoSuchImage(name.as_str().to_owned()).into()),
        Some(r) if need == Need::Ready && r.state != ImageState::Ready => Err(Error::NotReady {
            name: r.name,
            state: r.state.as_str().to_owned(),
        }
        .into()),
        Some(_) => Ok(()),
    }
}

pub(crate) fn record(ctx: &Ctx, name: &ImageName, mode: Mode, role: Role, command: &str) -> Record {
    ctx.record(
        LockKind::Image,
        name.as_str(),
        crate::root::Root::image_lock_rel(name),
        role,
        mode,
        command,
    )
}
