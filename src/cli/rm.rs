//! `stowage rm`: remove images, crash-safely.

use std::ffi::OsString;

use anyhow::Result;

use crate::acquire::image::{Need, Want, acquire_image};
use crate::disk_usage;
use crate::lock::Mode;
use crate::remove;
use crate::store::Store;

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
    /// Give up after SECONDS (fractional, or with a unit: 500ms, 10s, 2m, 1h)
    /// waiting for an image in use [default: wait forever]
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true)]
    wait: Option<String>,
    /// Fail at once if an image is in use
    #[arg(long, conflicts_with = "wait")]
    no_wait: bool,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    let mut names = super::names(&args.images)?;
    let (deadline, no_wait) = super::deadline(args.wait.as_deref(), args.no_wait)?;
    // The lock order, and each image once.
    names.sort();
    names.dedup();
    let command = format!(
        "stowage rm {}",
        names
            .iter()
            .map(|n| n.as_str())
            .collect::<Vec<_>>()
            .join(" ")
    );
    // The schema is brought up to date before any lock is taken: migrating
    // waits until nobody holds an image lock, and we are about to.
    store.with_tx(deadline, |_, _| Ok(()))?;
    // All locks first, so that either every image goes or none does.
    let mut held = Vec::with_capacity(names.len());
    for name in &names {
        let want = Want {
            mode: Mode::Exclusive,
            need: Need::Exists,
            deadline,
            no_wait,
            command: &command,
            must_exist: &[],
        };
        let (guard, waiter) = acquire_image(store, name, &want)?;
        if let Some(id) = waiter {
            store.with_tx_holding_locks(None, |tx, _| tx.delete_record(id))?;
        }
        held.push((name.clone(), guard));
    }
    let removed = remove::remove_locked(store, held)?;
    // Space was freed: the metadata's reserve gets what it lacks.
    crate::space::refill(&store.root().reserve());
    for r in &removed {
        store.ctx().say(&format!(
            "removed '{}' ({}, {})",
            r.name,
            r.state,
            disk_usage::human(r.bytes)
        ));
    }
    // The images are gone; space that could not be freed is a failure.
    let mut code = 0;
    for why in removed.iter().filter_map(|r| r.left_in_trash.as_deref()) {
        eprintln!("stowage: {why}");
        code = crate::error::code::FAILURE;
    }
    Ok(code)
}
