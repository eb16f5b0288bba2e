//! `stowage rm`: remove images, crash-safely.

use std::ffi::OsString;

use anyhow::Result;

use crate::acquire::image::{Held, Want};
use crate::disk_usage;
use crate::lease::Holding;
use crate::lock::Mode;
use crate::remove;
use crate::store::Store;
use crate::store_wide::Probe;

#[derive(clap::Args)]
#[command(
    after_help = "Each image is removed under its write lock: an image in use is not touched.\n\
    Exit status: 0 removed; 66 an image does not exist, or the root does not (nothing\n\
    removed); 75 an image stayed locked past --wait/--no-wait (nothing removed); 64 bad\n\
    name or usage; 1 a tree could not be taken out (that image and the ones after it\n\
    keep their state; the ones before it are removed)."
)]
pub struct Args {
    /// Images to remove
    #[arg(value_name = "IMG", required = true)]
    images: Vec<OsString>,
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true, help = concat!(
        "Give up after SECONDS (fractional, or with a unit of ", time_units!(),
        ": 30, 500ms, 2m) waiting for an image in use [default: wait forever]"))]
    wait: Option<String>,
    /// Fail at once if an image is in use
    #[arg(long, conflicts_with = "wait")]
    no_wait: bool,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    let mut names = super::names(&args.images)?;
    let (deadline, no_wait) = super::duration::deadline(args.wait.as_deref(), args.no_wait)?;
    // The lock order, and each image once.
    names.sort_by(|a, b| a.encoded().cmp(b.encoded()));
    names.dedup();
    let listed: Vec<&str> = names.iter().map(|n| n.as_str()).collect();
    let command = format!("stowage rm {}", listed.join(" "));
    store.require_root()?;
    let _ = crate::lease::introduce(&store.root().leases());
    // A store still to migrate (perhaps by another process now) is migrated first, or waited for.
    crate::migrate::if_needed(store, deadline)?;
    let mut migrated = false;
    let held = loop {
        match take_all(store, &names, deadline, no_wait, &command) {
            Ok(Some(held)) => break held,
            // As an image user does: wait for the hold to end, then take every lock again.
            Ok(None) => crate::store_wide::wait_free(store, deadline, no_wait, &command)?,
            Err(e)
                if !migrated
                    && matches!(crate::error::typed(&e), Some(crate::Error::NoSuchImage(_)))
                    && crate::migrate::is_legacy(store.root()) =>
            {
                migrated = true;
                crate::migrate::run(store, deadline)?;
            }
            Err(e) => return Err(e),
        }
    };
    let removed = (held.into_iter())
        .map(|h| remove::remove_held(store.root(), h, None))
        .collect::<Result<Vec<_>>>()?;
    crate::space::refill(&store.root().reserve());
    let ctx = store.ctx();
    for r in &removed {
        let size = r
            .bytes
            .map_or_else(|| "size unknown".into(), disk_usage::human);
        let (name, state) = (&r.name, r.state.as_str());
        ctx.say(&format!("removed '{name}' ({state}, {size})"));
    }
    let left = removed.iter().filter_map(|r| r.tree_left.as_deref());
    for why in left.chain(removed.iter().filter_map(|r| r.lock_file_left.as_deref())) {
        complain!("stowage: {why}");
    }
    // The images are gone; space that could not be freed is a failure.
    let mut code = 0;
    for why in removed.iter().filter_map(|r| r.left_in_trash.as_deref()) {
        complain!("stowage: {why}");
        code = crate::error::code::FAILURE;
    }
    Ok(code)
}

/// Every image's lock, first, so that either every image goes or none does: each must have a
/// record, and no store-wide command may run (`None`: one does; no lock is kept).
fn take_all(
    store: &Store,
    names: &[crate::name::ImageName],
    deadline: Option<std::time::Instant>,
    no_wait: bool,
    command: &str,
) -> Result<Option<Vec<Held>>> {
    // Every name that does not exist, said at once and before any wait for the others (a hint:
    // each image is judged again under its lock). Their record-less lock files go, if free.
    let missing = crate::acquire::image::missing(store.root(), names);
    if !missing.is_empty() {
        let free = missing
            .iter()
            .filter_map(|n| crate::acquire::image::try_exclusive(store.root(), n));
        remove::release_unclaimed(store.root(), free.collect(), &[]);
        return Err(crate::acquire::image::no_such_all(&missing));
    }
    let mut held = Vec::with_capacity(names.len());
    // Listed in our lease (with a wait, and once all are taken): on another host nothing else names
    // the holder of a removal.
    let mut listed: Vec<Holding> = Vec::with_capacity(names.len());
    for name in names {
        let want = Want {
            mode: Mode::Exclusive,
            create: false,
            reading: false,
            deadline,
            no_wait,
            command,
            must_exist: &[],
            held: &listed,
        };
        let h = match crate::acquire::image::take(store, name, &want) {
            Ok(h) => h,
            Err(e) => {
                remove::release_unclaimed(store.root(), held, &[]);
                return Err(e);
            }
        };
        let rel = crate::root::Root::image_lock_rel(name);
        listed.push(Holding::now(Mode::Exclusive, rel, false, command));
        let missing = (h.seen.record.is_none() && !h.seen.damaged) || h.seen.legacy;
        let newer = crate::acquire::image::newer(store.root(), &h);
        held.push(h);
        if let Some(e) = newer {
            remove::release_unclaimed(store.root(), held, &[]);
            return Err(e.into());
        }
        if missing {
            remove::release_unclaimed(store.root(), held, &[]);
            return Err(crate::Error::NoSuchImage(vec![name.as_str().to_owned()]).into());
        }
    }
    if held.iter().any(|h| h.seen.store_wide) {
        match crate::store_wide::probe(store.root())? {
            Probe::Held => {
                remove::release_unclaimed(store.root(), held, &[]);
                return Ok(None);
            }
            Probe::Free => crate::store_wide::clear_hints(held.iter().map(|h| h.guard.file())),
            Probe::Inside => {}
        }
    }
    crate::lease::note_all(&store.root().leases(), listed);
    Ok(Some(held))
}
