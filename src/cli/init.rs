//! `stowage init`: create the layout and adopt existing image directories.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::adopt::{self, Adopt};
use crate::root::make_dir;
use crate::store::Store;

#[derive(clap::Args)]
#[command(after_help = "Example, for a Charliecloud storage directory:\n  \
    stowage init --images-dir \"$CH_IMAGE_STORAGE/img\"\n\
    Nothing of stowage's own is ever written into the images directory or its parent.")]
pub struct Args {
    /// Keep image trees in DIR instead of ROOT/img
    #[arg(long, value_name = "DIR")]
    images_dir: Option<PathBuf>,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    let wanted = match &args.images_dir {
        Some(d) => Some(
            std::path::absolute(d).with_context(|| format!("cannot resolve {}", d.display()))?,
        ),
        None => None,
    };
    // What can be refused is refused before anything is created: a failed
    // init leaves no root behind.
    if let Some(dir) = &wanted
        && !dir.is_dir()
        && !dir.parent().is_some_and(Path::is_dir)
    {
        bail!(
            "cannot create images directory {}: its parent directory does not exist",
            dir.display()
        );
    }
    if let Some(dir) = &wanted
        && store.root().dir().starts_with(dir)
    {
        bail!(
            "images directory {} contains the root {}: its trees and stowage's own files would mix",
            dir.display(),
            store.root().dir().display()
        );
    }
    if let Some(dir) = &wanted
        && dir.starts_with(store.root().dir())
        && *dir != store.root().default_images_dir()
    {
        bail!(
            "images directory {} is inside the root {}; use the default (omit --images-dir) or a directory outside it",
            dir.display(),
            store.root().dir().display()
        );
    }
    if let Some(dir) = &wanted
        && *dir != store.root().default_images_dir()
    {
        refuse_overlap(store.root().dir(), dir)?;
    }
    store.root().create_layout()?;
    // Kept until the switch has committed (below).
    let mut switch_held = None;
    let (dir, adopted, skipped, how) = store.with_tx(None, |tx, ctx| {
        let current = tx.images_dir(&ctx.root)?;
        if let Some(dir) = &wanted
            && *dir != current
        {
            let n = tx.image_count()?;
            if n > 0 {
                bail!(
                    "root {} already keeps {n} images in {}; refusing to switch to {} (remove them first)",
                    ctx.root.dir().display(),
                    current.display(),
                    dir.display()
                );
            }
            // A new image is written without the database (no row for the
            // count above) into the images directory the global lock file
            // states, its writer holding locks/store.lock shared from
            // before it reads that statement to its end (session.rs): the
            // switch holds it exclusively through its commit, so that no
            // such write is under way in the directory left behind, and
            // none starts there. (Inside a store-wide hold, none can.)
            if !crate::store_wide::inside_hold(&ctx.root) {
                let held = crate::lock::acquire_no_wait(
                    &ctx.root.store_wide_lock(),
                    crate::lock::Mode::Exclusive,
                    crate::lock::IfMissing::Create,
                )?;
                let Some(held) = held else {
                    // A lock not had (75, as the contract has it), never
                    // waited for inside a transaction.
                    let path = ctx.root.store_wide_lock();
                    return Err(crate::Error::Busy(crate::error::Busy {
                        what: format!(
                            "the store-wide lock {} (needed free to switch images directories; a new image is being written, or a store-wide command runs)",
                            path.display()
                        ),
                        holders: crate::holders::kernel_holders_phrase(ctx, &path),
                        waited: std::time::Duration::ZERO,
                    })
                    .into());
                };
                switch_held = Some(held);
            }
            // Its parent must exist: a mistyped path should not grow a tree.
            if !dir.is_dir() {
                std::fs::create_dir(dir).with_context(|| {
                    format!("cannot create images directory {} (does its parent exist?)", dir.display())
                })?;
            }
            make_dir(dir)?;
            tx.set_config("images_dir", &dir.display().to_string())?;
            // Stated where a new image's writer reads it (records_db.rs)
            // before anyone can write there.
            crate::records_db::for_this_database(tx, &ctx.root)?;
            // Kept beside the database too, so that rebuilding a damaged
            // database still finds the images.
            crate::doctor::write_images_dir_note(&ctx.root, dir)?;
        }
        let dir = tx.images_dir(&ctx.root)?;
        let images = ctx.root.open_images_dir(&dir)?;
        // Ready only in a directory stowage never managed (see adopt.rs).
        let how = if adopt::managed(tx, &images)? {
            Adopt::Unknown
        } else {
            Adopt::AsReady
        };
        let (found, _) = adopt::adopt(tx, &ctx.root, &images, &dir, how, &HashMap::new())?;
        // This is the images directory from now on (accepting a remount).
        adopt::record_identity(tx, &images)?;
        Ok((dir, found.trees.len(), found.skipped, how))
    })?;
    drop(switch_held);
    for (entry, why) in &skipped {
        store.ctx().say(&format!(
            "not adopting {entry:?} in {}: {why}",
            dir.display()
        ));
    }
    store.ctx().say(&format!(
        "root {} ready; images in {}{}",
        store.root().dir().display(),
        dir.display(),
        if adopted > 0 {
            format!(
                "; adopted {adopted} existing image{}{}",
                if adopted == 1 { "" } else { "s" },
                if how == Adopt::Unknown {
                    " as incomplete (this store was already managed, so whether they are complete is not known; 'stowage exec --write NAME -- true' marks one ready)"
                } else {
                    " as ready"
                }
            )
        } else {
            String::new()
        }
    ));
    Ok(0)
}

/// The checks above compare paths; this compares directories. Through a
/// bind mount of the root, or a symlink among the parents, a path that
/// looks unrelated can be the root itself or lie inside it, and its
/// `locks`, `img` and `trash` would be adopted as images (`gc` would then
/// delete the lock directory). So the images directory (or, if it does not
/// exist yet, its parent) must be neither the root nor one of the root's
/// parents, and the root must not be one of its parents: compared by
/// device and inode, climbing through `..`.
fn refuse_overlap(root: &Path, dir: &Path) -> Result<()> {
    use crate::dir::Dir;
    // The directories from `d` up to `/`, as (device, inode).
    let chain = |mut d: Dir| -> std::io::Result<Vec<(u64, u64)>> {
        let mut ids = Vec::new();
        loop {
            let st = d.stat()?;
            if ids.last() == Some(&(st.dev, st.ino)) || ids.len() > 4096 {
                return Ok(ids);
            }
            ids.push((st.dev, st.ino));
            d = d.sub("..")?;
        }
    };
    let existing =
        |p: &Path| Dir::open(p).or_else(|_| Dir::open(p.parent().unwrap_or(Path::new("/"))));
    let (Ok(r), Ok(i)) = (existing(root), existing(dir)) else {
        return Ok(()); // Reported by what follows.
    };
    let (Ok(root_ids), Ok(dir_ids)) = (chain(r), chain(i)) else {
        return Ok(());
    };
    if dir.is_dir() && root_ids.contains(&dir_ids[0]) {
        bail!(
            "images directory {} is the root {} or contains it (a bind mount or a symlink): its trees and stowage's own files would mix",
            dir.display(),
            root.display()
        );
    }
    let above = if dir.is_dir() {
        &dir_ids[1..]
    } else {
        &dir_ids[..]
    };
    if root.is_dir() && above.contains(&root_ids[0]) {
        bail!(
            "images directory {} is inside the root {} (through a bind mount or a symlink); use the default (omit --images-dir) or a directory outside it",
            dir.display(),
            root.display()
        );
    }
    Ok(())
}
