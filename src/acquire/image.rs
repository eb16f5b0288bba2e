//! Taking an image lock: the gate that gives writers preference, the check that a wait could ever
//! end, and the record read under the lock.
//!
//! - **Writer preference.** Each image has a *gate* beside its lock (`ENC.gate`). A writer that has
//!   to wait holds the gate exclusively while it waits, and sets the writer-waits hint in the lock
//!   file; a reader that sees the hint passes the gate (shared) before it keeps its lock, so once a
//!   writer waits, new readers queue behind it. The gate precedes its lock in the lock order.
//! - **No wait for oneself.** A lock an enclosing exec holds (`nested.rs`) in a conflicting mode
//!   fails at once; a reader inside a reader passes the gate; a reader inside an exclusive read
//!   runs under it, taking no lock.
//! - **The record comes with the lock**, read by the `pread` proving the file is still at its path.

use std::io;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::error::{Busy, Error};
use crate::holders::LockKind;
use crate::image_record::{self, Seen};
use crate::lock::{self, Guard, Mode, Wait, Waited};
use crate::name::ImageName;
use crate::nested::HeldAs;
use crate::root::Root;
use crate::store::Store;

use super::wait_for;

/// An image lock and what its file said when taken.
pub struct Held {
    pub name: ImageName,
    pub guard: Guard,
    pub seen: Seen,
    /// The lock is an enclosing command's, not taken: `guard` has none, and nothing is written
    /// through it (a read inside an exclusive read).
    pub under: bool,
}

/// How to take one image lock.
pub(crate) struct Want<'a> {
    pub mode: Mode,
    /// The lock file may be created (a write: the image may be new).
    pub create: bool,
    /// An exclusive lock only to read (`--read-exclusive`).
    pub reading: bool,
    pub deadline: Option<Instant>,
    pub no_wait: bool,
    pub command: &'a str,
    /// Images that must exist (the reads): checked before any wait, to fail at once.
    pub must_exist: &'a [ImageName],
    /// The locks the request holds already, listed in the lease with a wait (`acquire::wait_for`).
    pub held: &'a [crate::lease::Holding],
}

impl Want<'_> {
    /// "read", "write", "exclusive read": as messages say the lock wanted.
    fn verb(&self) -> &'static str {
        if self.reading {
            "exclusive read"
        } else {
            self.mode.verb()
        }
    }
}

/// Takes one image lock, waiting as allowed; nothing is created unless `want.create`.
pub(crate) fn take(store: &Store, name: &ImageName, want: &Want) -> Result<Held> {
    let root = store.root();
    let path = root.image_lock(name);
    // A lock file is made only once a later release's store is ruled out: asked first without
    // making one, so an existing image's lock (which says it) costs nothing more.
    let first = match try_image(root, name, want.mode, false) {
        Err(e) if e.kind() == io::ErrorKind::NotFound && want.create => {
            root.refuse_newer_config()?;
            match try_image(root, name, want.mode, true) {
                // The layout does not exist yet: the first use of this root.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    root.create_layout()?;
                    try_image(root, name, want.mode, true)
                }
                other => other,
            }
        }
        // No lock file: no such image, or no store here at all (a mistyped root), said as such.
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            root.require_store()?;
            return Err(no_such(name));
        }
        // A file at `locks` where no store is (a project's own): said as no store, never repaired.
        Err(e)
            if crate::planted::find(&e).is_some()
                && let Some(no) = root.foreign_locks() =>
        {
            return Err(no);
        }
        other => other,
    };
    let held = match first.map_err(|e| lock::error(&format!("image '{name}'"), &path, e))? {
        Tried::Got(h) => *h,
        busy => {
            crate::debug::pause("image-busy");
            // A name that can never be used does not wait: a cut name's record is read without the
            // lock (its two slots make that safe).
            let file = crate::root::lock_file_name(name.encoded());
            if file != format!("{}.lock", name.encoded())
                && let Ok(Some(f)) = lock::open_existing_read(&path)
            {
                refuse_shared_lock_file(name, &image_record::read_of(&f, name.as_str())?)?;
            }
            let enclosing = crate::nested::enclosing(root);
            match enclosed(&enclosing, &Root::image_lock_rel(name), want) {
                Some(Enclosed::Under) => under_enclosing(root, name)?,
                Some(Enclosed::Conflict(held)) => return Err(waits_for_itself(name, want, held)),
                None => {
                    require_all(root, want.must_exist)?;
                    let writer_ahead = matches!(busy, Tried::WriterWaiting);
                    wait_taking(store, name, want, writer_ahead, &enclosing)?
                }
            }
        }
    };
    refuse_shared_lock_file(name, &held.seen)?;
    Ok(held)
}

/// Refuses `name` (exit 64) if its lock file holds the record of another image whose name, cut to
/// fit a file name, hashes alike: that record is the other image's, never used as `name`'s.
fn refuse_shared_lock_file(name: &ImageName, seen: &Seen) -> Result<()> {
    let Some(other) = seen
        .foreign
        .as_deref()
        .and_then(|n| ImageName::parse(n).ok())
    else {
        return Ok(());
    };
    let file = crate::root::lock_file_name;
    if file(other.encoded()) != file(name.encoded()) {
        return Ok(());
    }
    Err(Error::Usage(format!(
        "image name '{name}' cannot be used: cut to fit with a hash, its lock file is image '{other}''s; choose another name"
    ))
    .into())
}

/// [`take`] once the lock proved busy: says for whom we wait, waits as allowed, and gives up if an
/// enclosing exec announces meanwhile that it holds the lock.
fn wait_taking(
    store: &Store,
    name: &ImageName,
    want: &Want,
    writer_ahead: bool,
    enclosing: &crate::nested::Enclosing,
) -> Result<Held> {
    let root = store.root();
    let (path, rel) = (root.image_lock(name), Root::image_lock_rel(name));
    let err = |e| lock::error(&format!("image '{name}'"), &path, e);
    let what = format!("{} lock on image '{name}'", want.verb());
    let until = crate::holders::looked_for_until(want.deadline, want.no_wait);
    let now =
        || crate::holders::holders_phrase(store.ctx(), LockKind::Image, &path, writer_ahead, until);
    let holders = now();
    // The holder may be gone by now (on FUSE and NFS a close releases the lock late): one more try.
    if let Ok(Tried::Got(h)) = try_image(root, name, want.mode, want.create) {
        return Ok(*h);
    }
    // `--no-wait`: once more (lock-status or a store-wide scan may hold it a moment), then busy.
    if want.no_wait {
        return match try_image(root, name, want.mode, want.create) {
            Ok(Tried::Got(h)) => Ok(*h),
            // Removed meanwhile.
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(no_such(name)),
            Err(e) => Err(err(e)),
            Ok(_) => Err(Busy::now(what, holders).into()),
        };
    }
    let reread: crate::wait_line::Reread = {
        let (name, path) = (name.as_str().to_owned(), path.clone());
        Box::new(move |look| look.report(LockKind::Image, &name, &path))
    };
    let line = crate::wait_line::announce(store.ctx(), &what, &holders, Some(reread));
    let mut holding = crate::lease::Holding::now(want.mode, rel.clone(), true, want.command);
    holding.reading = want.reading;
    // An enclosing exec that had not announced its lease: looked for again while we wait.
    let ours_now = || enclosed(&crate::nested::enclosing_now(root), &rel, want);
    let mut wait = Wait::on(&root.image_locks(), want.deadline);
    if enclosing.unannounced {
        wait.give_up = Some(Box::new(|| ours_now().is_some()));
    }
    let waited = wait_for(store, holding, want.held, what, now, || {
        wait_image(store.ctx(), name, want.mode, &mut wait).map_err(err)
    });
    // Cleared before anything else is said.
    drop(line);
    if waited.is_err()
        && enclosing.unannounced
        && let Some(found) = ours_now()
    {
        return match found {
            Enclosed::Under => under_enclosing(root, name),
            Enclosed::Conflict(held) => Err(waits_for_itself(name, want, held)),
        };
    }
    let guard = match waited {
        // Removed while we waited (a reader makes no lock file).
        Err(e) if crate::root::is_missing(&e) => return Err(no_such(name)),
        other => other?,
    };
    // A planted FIFO or socket fails the read (ESPIPE or so).
    let seen = image_record::read_of(guard.file(), name.as_str()).with_context(|| {
        let path = path.display();
        format!("cannot read the record in {path} (is it a regular file?)")
    })?;
    Ok(Held {
        name: name.clone(),
        guard,
        seen,
        under: false,
    })
}

/// What a lock an enclosing exec holds means for a request that finds it busy.
enum Enclosed {
    /// Held in a conflicting mode: a wait would be for good.
    Conflict(HeldAs),
    /// A read inside an exclusive read: no writer, the image ready, the holder waiting for us.
    Under,
}

/// How an enclosing exec's hold of `rel` bears on `want`, if one holds it; a read inside a read
/// shares the lock (None).
fn enclosed(enclosing: &crate::nested::Enclosing, rel: &str, want: &Want) -> Option<Enclosed> {
    match (want.mode, enclosing.hold(rel)?) {
        (Mode::Shared, HeldAs::Read) => None,
        (Mode::Shared, HeldAs::ExclusiveRead) => Some(Enclosed::Under),
        (_, held) => Some(Enclosed::Conflict(held)),
    }
}

/// A read under the lock an enclosing exclusive read holds: the lock file opened, not locked, and
/// its record read (two slots make that safe).
fn under_enclosing(root: &Root, name: &ImageName) -> Result<Held> {
    let path = root.image_lock(name);
    let err = |e| lock::error(&format!("image '{name}'"), &path, e);
    let Some(guard) = lock::open_under(&path, Mode::Shared).map_err(err)? else {
        return Err(no_such(name));
    };
    let seen = image_record::read_of(guard.file(), name.as_str()).map_err(err)?;
    Ok(Held {
        name: name.clone(),
        guard,
        seen,
        under: true,
    })
}

/// The error for a lock our enclosing command holds in a conflicting mode: a read finds the image
/// not ready (66); a write or exclusive read finds the lock busy (75), held as `held` says.
fn waits_for_itself(name: &ImageName, want: &Want, held: HeldAs) -> anyhow::Error {
    match want.mode {
        Mode::Shared => Error::NotReady {
            name: name.as_str().to_owned(),
            state: format!("being written by {}", super::ENCLOSING),
        }
        .into(),
        Mode::Exclusive => {
            super::never_ends(format!("{} lock on image '{name}'", want.verb()), held)
        }
    }
}

enum Tried {
    Got(Box<Held>),
    /// Someone holds the lock in a conflicting mode.
    Busy,
    /// A writer waits at the gate: a reader must queue behind it.
    WriterWaiting,
}

/// One non-blocking attempt, lock and record; a reader seeing the writer-waits hint asks the gate.
fn try_image(root: &Root, name: &ImageName, mode: Mode, create: bool) -> io::Result<Tried> {
    let path = root.image_lock(name);
    if create {
        // Before a lock file may be made: unlinking it again must not need a descriptor more.
        root.keep_spare()?;
    }
    let mut failed = None;
    let got = lock::acquire_no_wait_with(&path, mode, lock::IfMissing::create_if(create), |f| {
        match image_record::read_of(f, name.as_str()) {
            Ok(seen) => {
                let proven = seen.proves_linked(f, &path, mode == Mode::Exclusive);
                (seen, proven)
            }
            Err(e) => {
                failed = Some(e);
                (Seen::default(), false)
            }
        }
    })?;
    if let Some(e) = failed {
        return Err(io::Error::new(
            e.kind(),
            format!("cannot read the record in {}: {e}", path.display()),
        ));
    }
    let Some((guard, seen)) = got else {
        return Ok(Tried::Busy);
    };
    if mode == Mode::Shared && seen.writer_waits {
        match lock::acquire_no_wait(&root.image_gate(name), Mode::Shared, lock::IfMissing::Fail) {
            // No writer holds the gate: the hint is stale. Cleared while we hold the gate (no
            // writer can be setting it), but not through a file with other names.
            Ok(Some(_passed)) => {
                if guard.has_one_name() {
                    let _ = image_record::set_writer_waits(guard.file(), false);
                }
            }
            // No gate file, or something planted there that no writer can hold: nobody waits.
            Err(e) if e.kind() == io::ErrorKind::NotFound || crate::planted::find(&e).is_some() => {
            }
            // Our enclosing command reads the image: the writer waits for it, queueing is a cycle.
            Ok(None)
                if crate::nested::enclosing(root)
                    .hold(&Root::image_lock_rel(name))
                    .is_some() => {}
            Ok(None) => return Ok(Tried::WriterWaiting),
            Err(e) => return Err(e),
        }
    }
    Ok(Tried::Got(Box::new(Held {
        name: name.clone(),
        guard,
        seen,
        under: false,
    })))
}

/// Waits through the gate, taken in our mode and held while waiting for the lock.
fn wait_image(
    ctx: &crate::ctx::Ctx,
    name: &ImageName,
    mode: Mode,
    wait: &mut Wait,
) -> io::Result<Waited<Guard>> {
    let root = &ctx.root;
    let (gate, path) = (root.image_gate(name), root.image_lock(name));
    let passage = match lock::acquire(&gate, mode, lock::IfMissing::Create, wait) {
        Ok(Waited::Acquired(g)) => Some(g),
        Ok(not_in) => return Ok(not_in),
        // Something planted as the gate orders no one (none can hold it): no writer preference.
        Err(e) if crate::planted::find(&e).is_some() => {
            ctx.say(&format!(
                "{e} — waiting without it (new readers may pass a waiting writer)"
            ));
            None
        }
        Err(e) => return Err(e),
    };
    let gated_writer = mode == Mode::Exclusive && passage.is_some();
    if gated_writer {
        // Readers that see the hint queue behind us (closed before the wait: NFS sends it then).
        if let Ok(Some(file)) = lock::open_existing(&path) {
            let _ = image_record::set_writer_waits(&file, true);
        }
    }
    // A reader makes no lock file: one unlinked while it waited (a removal) means no such image.
    let got = lock::acquire(
        &path,
        mode,
        lock::IfMissing::create_if(mode == Mode::Exclusive),
        wait,
    );
    drop(passage);
    // In: the hint goes unless another writer now waits at the gate.
    if gated_writer
        && let Ok(Waited::Acquired(g)) = &got
        && let Ok(Some(_alone)) =
            lock::acquire_no_wait(&gate, Mode::Exclusive, lock::IfMissing::Fail)
    {
        let _ = image_record::set_writer_waits(g.file(), false);
    }
    got
}

/// Before a wait: [`Error::NoSuchImage`] (66) naming every one of `names` that is [`missing`].
pub(crate) fn require_all(root: &Root, names: &[ImageName]) -> Result<()> {
    match missing(root, names).as_slice() {
        [] => Ok(()),
        gone => Err(no_such_all(gone)),
    }
}

/// The images of `names` without a lock file or with one that holds no record, read without the
/// lock (two slots make that safe). Only absence is final: any state may become readable
/// meanwhile, and a file that cannot be read is judged under its lock.
pub(crate) fn missing<'a>(root: &Root, names: &'a [ImageName]) -> Vec<&'a ImageName> {
    let absent = |n: &ImageName| match lock::open_existing_read(&root.image_lock(n)) {
        Ok(None) => true,
        Ok(Some(f)) => image_record::read_of(&f, n.as_str()).is_ok_and(|s| s.unrecorded()),
        Err(_) => false,
    };
    names.iter().filter(|n| absent(n)).collect()
}

/// [`Error::NoSuchImage`] naming all of `names`.
pub(crate) fn no_such_all(names: &[&ImageName]) -> anyhow::Error {
    Error::NoSuchImage(names.iter().map(|n| n.as_str().to_owned()).collect()).into()
}

/// The exclusive lock of `name`, with its record, if it is free now (tried, never awaited).
pub(crate) fn try_exclusive(root: &Root, name: &ImageName) -> Option<Held> {
    match try_image(root, name, Mode::Exclusive, false) {
        Ok(Tried::Got(held)) => Some(*held),
        _ => None,
    }
}

fn no_such(name: &ImageName) -> anyhow::Error {
    Error::NoSuchImage(vec![name.as_str().to_owned()]).into()
}

/// [`Error::Newer`] if `held`'s record is a later release's: that release's image, neither read,
/// written nor removed here.
pub(crate) fn newer(root: &Root, held: &Held) -> Option<Error> {
    let what = format!(
        "the record of image '{}', format {}",
        held.name, held.seen.newer?
    );
    Some(Error::Newer {
        root: root.dir().to_path_buf(),
        what,
    })
}
