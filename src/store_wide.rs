//! Store-wide holds: `exec --store-wide` runs a command while nobody holds
//! or can use any image lock — for commands of a builder that act on the
//! whole storage (`ch-image build-cache --reset`, `reset`, a cache-mode
//! import that renames through the storage's top level).
//!
//! Invariants:
//! - The holder takes `ROOT/locks/store.lock` exclusively first, holding
//!   nothing else (waiting there is safe). Then, like every store-wide
//!   operation, it records itself (a `global` holder record named `store`)
//!   and then takes the global lock at a moment when every image lock is
//!   free ([`Store::global_with_images_free`]): from then on it runs.
//! - While that record stands and its lease (`store.lock`) is held, every
//!   transaction that would claim an image — an exec's start, a removal's
//!   mark — refuses ([`StoreHeld`]). An exec then releases everything it
//!   took and waits for `store.lock` shared, holding nothing, and starts
//!   over. So the command never runs beside an image user, no image user
//!   starts beside it, and none starts while it waits for those at work
//!   (no starvation by a stream of builds): images are only created, marked or recorded in
//!   those transactions (the argument of docs/design.md, store-wide
//!   operations).
//! - The command itself, and whatever it starts, inherits the lease (unless
//!   `--no-inherit`): a stowage exec holding that descriptor is inside the
//!   hold and goes ahead, rather than wait for itself.
//! - Nobody waits for `store.lock` while holding another lock (but its
//!   gate, `store.gate`, taken holding nothing: [`acquire_exclusive_gated`]),
//!   and the holder only *tries* image locks (under the global lock): no
//!   cycle. A new image's writer takes `store.lock` shared only while its
//!   gate is free: a waiter for it exclusively is not starved by them.
//! - A holder that dies leaves a record whose lock is free: stale, dropped
//!   by the next transaction that looks.
//! - Reads of the fast path (record.rs) take no transaction: the hold also
//!   sets the store-wide hint on every image lock file before it checks
//!   that every image lock is free, and clears them when it ends; such a
//!   read that sees the hint asks `store.lock` and, finding it held, goes
//!   the way that honours the record.
//! - The uncontended exec pays one indexed lookup in its start transaction
//!   and no extra lock (a fast read: one byte of a read it makes anyway).

use std::io;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::ctx::Ctx;
use crate::error::{Busy, Error};
use crate::lock::{self, Guard, Mode, Wait, Waited};
use crate::meta::{ImageState, LockKind, Role, Tx};
use crate::name::ImageName;
use crate::store::Store;

/// The record's name (kind `global`).
const NAME: &str = "store";

/// A transaction found a live store-wide hold.
#[derive(Debug, thiserror::Error)]
#[error("a store-wide command runs: {holder}")]
pub struct StoreHeld {
    pub holder: String,
}

fn path(ctx: &Ctx) -> PathBuf {
    ctx.root.store_wide_lock()
}

/// Whether this process runs inside a store-wide hold: its command, or
/// something that command started, holding `store.lock` through an
/// inherited descriptor, or under an ancestor that holds it (an enclosing
/// exec named by the environment, or any ancestor the lock table shows —
/// a `--no-inherit` keeper under a scrubbed environment).
pub fn inside_hold(root: &crate::root::Root) -> bool {
    let p = root.store_wide_lock();
    lock::inherited_exclusive(&p)
        || crate::nested::enclosing_hold(&p) == Some(Mode::Exclusive)
        || crate::nested::held_exclusively_by_ancestor(&p)
}

/// Under the global lock: fails with [`StoreHeld`] while a store-wide
/// command runs; drops the records of holders that are gone. `Ok(true)`:
/// one runs, and we are inside it (its command calls us) — what we do is
/// part of its work, and a ready token written now would carry no
/// store-wide hint (record.rs), so none is written.
pub fn check(tx: &Tx, ctx: &Ctx) -> Result<bool> {
    let mut inside = false;
    for rec in tx.records_for(LockKind::Global, NAME)? {
        // A try, never a wait: the global lock is held.
        match lock::acquire_no_wait(&path(ctx), Mode::Shared, lock::IfMissing::Fail) {
            // Our own command (a wrapper calling stowage again) runs
            // under the hold: it has the store, and must not wait for it.
            // With --no-inherit the hold is not ours but an ancestor's
            // (stowage's keeper keeps the lease): the kernel says so.
            Ok(None) if inside_hold(&ctx.root) => inside = true,
            // The command of an image or slot user (it inherited that lock)
            // calls stowage again: the hold is still waiting for that very
            // lock, so waiting for the hold would deadlock. Going ahead is
            // safe: the hold's command starts only once our locks are free.
            Ok(None) if inherits_lock(ctx) || enclosing_exec_holds_lock(ctx) => inside = true,
            Ok(None) => {
                return Err(StoreHeld {
                    holder: format!(
                        "pid {} on {} ({}) since {}",
                        rec.pid,
                        rec.host,
                        rec.command,
                        crate::clock::local_short(rec.since)
                    ),
                }
                .into());
            }
            Ok(Some(_)) => tx.delete_record(rec.id)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => tx.delete_record(rec.id)?,
            Err(e) => return Err(lock::error("the store", &path(ctx), e)),
        }
    }
    Ok(inside)
}

/// Waits (as `wait` allows) for `locks/store.lock` exclusively, holding
/// its gate (`locks/store.gate`) exclusively meanwhile: a new image's
/// writer takes `store.lock` shared only while the gate is free
/// ([`gate_open`]), and flock(2) grants a shared lock beside a waiting
/// exclusive request — so without the gate a stream of overlapping new
/// images would keep the waiter out for good. The gate is taken first,
/// holding nothing (two such waiters queue on it), and unlinked (the
/// unlink rule: we hold it exclusively; kept on a shared filesystem) once
/// `store.lock` is ours or the wait ends — so that a new image's writer
/// where nobody waits finds no file, one failed open. A writer that opened
/// the file before its unlink slips in once, no more.
pub fn acquire_exclusive_gated(
    root: &crate::root::Root,
    wait: &mut Wait,
) -> io::Result<Waited<Guard>> {
    // Listed in our lease while we wait (for the gate too), so that
    // lock-status names us: no record says who waits here.
    let leases = root.leases();
    let rel = crate::root::Root::STORE_WIDE_LOCK_REL;
    let command = crate::ident::command_line(std::process::id()).unwrap_or_default();
    crate::lease::note(
        &leases,
        crate::lease::Holding::now(Mode::Exclusive, rel.into(), true, &command),
    );
    let got = lock::acquire(
        &root.store_gate(),
        Mode::Exclusive,
        lock::IfMissing::Create,
        wait,
    )
    .and_then(|gated| match gated {
        Waited::Acquired(gate) => {
            let got = lock::acquire(
                &root.store_wide_lock(),
                Mode::Exclusive,
                lock::IfMissing::Create,
                wait,
            );
            let _ = gate.unlink();
            got
        }
        Waited::TimedOut => Ok(Waited::TimedOut),
        Waited::Interrupted(sig) => Ok(Waited::Interrupted(sig)),
    });
    crate::lease::forget(&leases, rel);
    got
}

/// Whether nobody waits to take `store.lock` exclusively right now (its
/// gate is free, or was never made): a new image's writer takes
/// `store.lock` shared only then, else it goes the database's way, which
/// such a waiter does not wait for (a repair) or whose start a store-wide
/// hold's record refuses once it holds the store. A try, never a wait:
/// the writer holds its image lock.
pub fn gate_open(root: &crate::root::Root) -> bool {
    // No stats for the unlink race: a gate its waiter unlinked since our
    // open is one nobody waits at any more, so a try of it says "open"
    // rightly (and a waiter holding the file at the path refuses us).
    let tried = lock::acquire_no_wait_vouched(
        &root.store_gate(),
        Mode::Shared,
        lock::IfMissing::Fail,
        |_| ((), true),
    );
    match tried {
        Ok(Some(_)) => true,
        Err(e) => e.kind() == io::ErrorKind::NotFound,
        Ok(None) => false,
    }
}

/// `locks/store.lock` taken shared if no store-wide operation holds the
/// store right now (a read of the fast path asks, holding its image locks,
/// when a hint says one may: see `Session::begin`), created if missing so
/// that no answer rests on a file not existing. Anything but a plain yes —
/// held, or an error — is `None`: the caller then goes the way that checks
/// the metadata. store.lock is never unlinked, so its path needs no check.
pub fn try_shared(root: &crate::root::Root) -> Option<Guard> {
    // Never unlinked: the file locked is the one at the path, without the
    // unlink rule's two stats (`lock::acquire_no_wait_vouched`).
    lock::acquire_no_wait_vouched(
        &root.store_wide_lock(),
        Mode::Shared,
        lock::IfMissing::Create,
        |_| ((), true),
    )
    .ok()
    .flatten()
    .map(|(g, ())| g)
}

/// Is `target` an image lock or a slot file of this store (`dirs`: the
/// image locks' and the slot classes' directories, canonical)?
fn is_store_lock(target: &std::path::Path, dirs: &(PathBuf, PathBuf)) -> bool {
    target.extension().is_some_and(|x| x == "lock")
        && (target.parent() == Some(dirs.0.as_path())
            || target.parent().and_then(|d| d.parent()) == Some(dirs.1.as_path()))
}

fn lock_dirs(ctx: &Ctx) -> Option<(PathBuf, PathBuf)> {
    Some((
        std::fs::canonicalize(ctx.root.image_locks()).ok()?,
        std::fs::canonicalize(ctx.root.slot_locks()).ok()?,
    ))
}

/// Does this process run in the command of an exec that holds image
/// locks or a slot (inherited, or kept by the exec with `--no-inherit`)?
/// Such a process must not wait for `store.lock` held by anyone but an
/// enclosing hold: its holder may be waiting for those very locks.
pub fn inside_image_user(ctx: &Ctx) -> bool {
    inherits_lock(ctx) || enclosing_exec_holds_lock(ctx)
}

/// Does an exec that runs us (with `--no-inherit`, its command holds no
/// descriptor) hold an image lock or a slot file open? Its command is
/// running, so what it holds open are the locks it was granted.
fn enclosing_exec_holds_lock(ctx: &Ctx) -> bool {
    let execs = crate::nested::enclosing_execs();
    if execs.is_empty() {
        return false;
    }
    let Some(dirs) = lock_dirs(ctx) else {
        return false;
    };
    execs.iter().any(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
            fds.flatten().any(|e| {
                std::fs::read_link(e.path()).is_ok_and(|target| is_store_lock(&target, &dirs))
            })
        })
    })
}

/// Does this process hold a descriptor of an image lock or a slot file
/// inherited from the exec whose command it is part of? Inherited
/// descriptors are the ones without close-on-exec: stowage opens its own
/// with it, and clears it only on the locks it hands to its command.
fn inherits_lock(ctx: &Ctx) -> bool {
    let Some(dirs) = lock_dirs(ctx) else {
        return false;
    };
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return false;
    };
    fds.flatten().any(|e| {
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            return false;
        };
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        flags >= 0
            && flags & libc::FD_CLOEXEC == 0
            && std::fs::read_link(e.path()).is_ok_and(|target| is_store_lock(&target, &dirs))
    })
}

/// Drops the rows (and lock files) of images whose trees the store-wide
/// command removed (`ch-image build-cache --reset` deletes the images linked
/// to the cache), so that no image is listed `ready` without a tree. Nobody
/// else uses any image meanwhile. An images directory that looks unmounted
/// (missing, empty while images are recorded, another filesystem) says
/// nothing about the trees: then no row goes, and the reason is said.
fn forget_deleted(store: &mut Store) -> Result<()> {
    let gone = store.with_tx(None, |tx, ctx| {
        let dir = tx.images_dir(&ctx.root)?;
        let rows = tx.images()?;
        let ready = rows.iter().any(|r| r.state == ImageState::Ready);
        let mount = crate::adopt::mount(tx, &ctx.root, &dir, ready)?;
        if let Some(why) = mount.doubt(&dir) {
            ctx.say(&format!("not checking for deleted images: {why}"));
            return Ok(Vec::new());
        }
        let mut gone = Vec::new();
        for row in rows {
            if row.state == ImageState::Deleting {
                continue; // a removal's own business (gc finishes it)
            }
            // An incomplete image may have no tree (its writer failed with
            // an empty one, see Session::finish): a missing tree is no
            // deletion, and the failure stays listed until gc or rm.
            if row.state == ImageState::Incomplete {
                continue;
            }
            let Ok(name) = ImageName::parse(&row.name) else {
                continue;
            };
            if let Err(e) = std::fs::symlink_metadata(dir.join(name.encoded()))
                && e.kind() == io::ErrorKind::NotFound
            {
                // Its ready token first (record.rs); the hold keeps every
                // reader out, so no image lock is needed for it.
                crate::record::invalidate_at(&ctx.root.image_lock(&name))?;
                tx.delete_image(&row.name)?;
                gone.push(name);
            }
        }
        Ok(gone)
    })?;
    for name in gone {
        store.ctx().say(&format!(
            "image '{name}' was deleted by the store-wide command"
        ));
        // The unlink rule: only under our exclusive lock.
        for file in [
            store.root().image_lock(&name),
            store.root().image_gate(&name),
        ] {
            if let Ok(Some(g)) =
                lock::acquire_no_wait(&file, Mode::Exclusive, lock::IfMissing::Fail)
            {
                let _ = g.unlink();
            }
        }
    }
    Ok(())
}

/// [`check`] for a caller that does not wait (a removal): a live hold is a
/// busy lock (exit 75).
pub fn check_busy(tx: &Tx, ctx: &Ctx) -> Result<bool> {
    check(tx, ctx).map_err(|e| match e.downcast::<StoreHeld>() {
        Ok(held) => Error::Busy(Busy {
            what: "the store".into(),
            holders: held.to_string(),
            waited: Duration::ZERO,
        })
        .into(),
        Err(e) => e,
    })
}

/// Holding nothing: waits until the store-wide command ends.
pub fn wait_until_free(
    store: &mut Store,
    held: &StoreHeld,
    deadline: Option<Instant>,
    no_wait: bool,
    command: &str,
) -> Result<()> {
    let busy = |waited| {
        Error::Busy(Busy {
            what: "the store".into(),
            holders: format!("a store-wide command runs: {}", held.holder),
            waited,
        })
    };
    if no_wait {
        return Err(busy(Duration::ZERO).into());
    }
    crate::holders::announce_wait(
        store.ctx(),
        "the store-wide command to finish",
        &held.holder,
    );
    // Recorded, so that lock-status names us among its waiters.
    let waiter = store.with_tx(deadline, |tx, ctx| {
        tx.insert_record(&ctx.record(
            LockKind::Global,
            NAME,
            crate::root::Root::STORE_WIDE_LOCK_REL.into(),
            Role::Waiter,
            Mode::Shared,
            command,
        ))
    })?;
    let ctx = store.ctx();
    let p = path(ctx);
    let t0 = Instant::now();
    let mut wait = Wait::on(&ctx.root.locks(), deadline);
    let waited = lock::acquire(&p, Mode::Shared, lock::IfMissing::Fail, &mut wait);
    store.forget_record(waiter);
    match waited {
        Ok(Waited::Acquired(_)) => Ok(()),
        Ok(Waited::TimedOut) => Err(busy(t0.elapsed()).into()),
        Ok(Waited::Interrupted(sig)) => Err(Error::Interrupted(sig).into()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(lock::error("the store", &p, e)),
    }
}

/// Takes `locks/store.lock` exclusively, waiting as allowed, for a
/// store-wide operation: the first lock it takes, holding nothing else. Fails at once where waiting could never end: inside the command
/// of an exec that holds image locks or a slot (the operation waits for
/// them to be free), or inside another store-wide hold.
pub fn lock_store(store: &mut Store, deadline: Option<Instant>, no_wait: bool) -> Result<Guard> {
    store.root().create_layout()?;
    // Inside the command of an exec that holds image locks or a slot: a
    // store-wide command waits for every one of them to be free, that
    // exec's included, which waits for us. Said at once, before waiting
    // for another hold (which would itself wait for that exec).
    if inside_image_user(store.ctx()) {
        return Err(Error::Busy(Busy {
            what: "the store-wide lock".into(),
            holders: "this process runs in the command of a 'stowage exec' that holds \
                          image locks or a slot, and a store-wide command waits for every one \
                          of them to be free; waiting would never end"
                .into(),
            waited: Duration::ZERO,
        })
        .into());
    }
    let p = path(store.ctx());
    let err = |e| lock::error("the store", &p, e);
    let guard =
        match lock::acquire_no_wait(&p, Mode::Exclusive, lock::IfMissing::Create).map_err(err)? {
            Some(g) => g,
            None => {
                // A store-wide command inside another one would wait for
                // its own enclosing command, which waits for it.
                if inside_hold(store.root()) {
                    return Err(Error::Busy(Busy {
                        what: "the store-wide lock".into(),
                        holders: "held by an enclosing command of this process (a 'stowage exec \
                                  --store-wide' that runs it); waiting for it would never end"
                            .into(),
                        waited: Duration::ZERO,
                    })
                    .into());
                }
                let holders = crate::holders::kernel_holders_phrase(store.ctx(), &p);
                let busy = |waited| {
                    Error::Busy(Busy {
                        what: "the store-wide lock".into(),
                        holders: holders.clone(),
                        waited,
                    })
                };
                if no_wait {
                    return Err(busy(Duration::ZERO).into());
                }
                crate::holders::announce_wait(store.ctx(), "the store-wide lock", &holders);
                let t0 = Instant::now();
                let mut wait = Wait::on(&store.ctx().root.locks(), deadline);
                match acquire_exclusive_gated(store.root(), &mut wait).map_err(err)? {
                    Waited::Acquired(g) => g,
                    Waited::TimedOut => return Err(busy(t0.elapsed()).into()),
                    Waited::Interrupted(sig) => return Err(Error::Interrupted(sig).into()),
                }
            }
        };
    Ok(guard)
}

/// A store-wide hold: release it with [`Hold::release`].
#[must_use = "release() drops the record; dropping leaves it to be found stale"]
pub struct Hold {
    guard: Guard,
    record: i64,
}

impl Hold {
    /// Waits (as allowed) until nobody holds any image lock, and holds the
    /// store from then on.
    pub fn take(
        store: &mut Store,
        command: &str,
        deadline: Option<Instant>,
        no_wait: bool,
    ) -> Result<Hold> {
        let guard = lock_store(store, deadline, no_wait)?;
        let deadline = if no_wait {
            Some(Instant::now())
        } else {
            deadline
        };
        // Recorded first, so that no new image user starts while we wait
        // for those already at work: a stream of builds cannot starve us.
        let record = store.with_tx(deadline, |tx, ctx| {
            // Records of earlier holders are stale: we hold their lease.
            for rec in tx.records_for(LockKind::Global, NAME)? {
                tx.delete_record(rec.id)?;
            }
            tx.insert_record(&ctx.record(
                LockKind::Global,
                NAME,
                crate::root::Root::STORE_WIDE_LOCK_REL.into(),
                Role::Holder,
                Mode::Exclusive,
                command,
            ))
        })?;
        // Then the hint on every image lock file, before the check that
        // every image lock is free: a read of the fast path, which takes no
        // transaction, learns of the hold from it (record.rs).
        let locks = store.root().image_locks();
        let marked = crate::record::mark_store_wide(&locks, true).map_err(|e| {
            anyhow::Error::new(e).context(format!(
                "cannot mark the image lock files in {}",
                locks.display()
            ))
        });
        match marked.and_then(|()| {
            store.store_wide("running a store-wide command", deadline, |_, _| Ok(()))
        }) {
            Ok(()) => Ok(Hold { guard, record }),
            Err(e) => {
                let _ = crate::record::mark_store_wide(&locks, false);
                store.forget_record(record);
                Err(e)
            }
        }
    }

    /// Ends the hold: the records of images the command deleted go (still
    /// under the hold), then the hold's record, then the lease.
    pub fn release(self, store: &mut Store) {
        if let Err(e) = forget_deleted(store) {
            store
                .ctx()
                .say(&format!("after the store-wide command: {e:#}"));
        }
        store.forget_record(self.record);
        // Still holding store.lock: nobody can be setting the hints now. One
        // left (a failure here, a crash) is cleared by the next reader.
        let _ = crate::record::mark_store_wide(&store.root().image_locks(), false);
        drop(self.guard);
    }

    pub fn set_inheritable(&self, inherit: bool) -> io::Result<()> {
        crate::lease::set_inheritable(inherit)?;
        self.guard.set_inheritable(inherit)
    }

    /// The descriptor of the hold, for a keeper to keep (`--no-inherit`).
    pub fn lock_fds(&self) -> Vec<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        let mut fds = vec![self.guard.as_raw_fd()];
        fds.extend(crate::lease::raw_fds());
        fds
    }
}
