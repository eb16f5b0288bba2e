//! `stowage init`: create the layout and adopt existing image directories.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::adopt::{self, Adopt};
use crate::image_record::ImagesDir;
use crate::root::{Root, make_dir};
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
    crate::migrate::if_needed(store, None)?;
    let wanted = match &args.images_dir {
        Some(d) => Some(
            std::path::absolute(d).with_context(|| format!("cannot resolve {}", d.display()))?,
        ),
        None => None,
    };
    // What can be refused is refused before anything is created: a failed
    // init leaves no root behind.
    if let Some(dir) = &wanted {
        refuse_images_dir(store.root(), dir)?;
    }
    store.root().create_layout()?;
    let root = store.root().clone();
    let mut config = crate::images_dir::config(&root)?;
    if let Some(dir) = &wanted
        && crate::images_dir::show(&root, &config.images) != *dir
    {
        switch(store, &mut config, dir)?;
    }
    let dir = config.images_dir_in(root.dir());
    let images = root.open_or_make_images_dir(&dir)?;
    let how = adoption(&root)?;
    let named: HashSet<String> = crate::census::take(&root)?
        .into_iter()
        .filter_map(|e| e.name().map(str::to_owned))
        .collect();
    let orphans = adopt::orphans(&images, &dir, &named)?;
    let adopted = adopt::adopt(&root, &config, &orphans, how)?;
    for why in &adopted.left {
        store.ctx().say(&format!("not adopting {why}"));
    }
    let adopted = adopted.names.len();
    // This is the images directory from now on (accepting a remount).
    crate::images_dir::record_identity(&root, &mut config, true)?;
    for (entry, why) in &orphans.skipped {
        store.ctx().say(&format!(
            "not adopting {entry:?} in {}: {why}",
            dir.display()
        ));
    }
    store.ctx().say(&format!(
        "root {} ready; images in {}{}",
        root.dir().display(),
        dir.display(),
        adopted_note(adopted, how)
    ));
    Ok(0)
}

/// Refuses an images directory `dir` (absolute) that does not exist and
/// cannot be made, or that overlaps the root: by path, then by directory.
fn refuse_images_dir(root: &Root, dir: &Path) -> Result<()> {
    if !dir.is_dir() && !dir.parent().is_some_and(Path::is_dir) {
        bail!(
            "cannot create images directory {}: its parent directory does not exist",
            dir.display()
        );
    }
    if root.dir().starts_with(dir) {
        bail!(
            "images directory {} contains the root {}: its trees and stowage's own files would mix",
            dir.display(),
            root.dir().display()
        );
    }
    if dir.starts_with(root.dir()) && *dir != root.default_images_dir() {
        bail!(
            "images directory {} is inside the root {}; use the default (omit --images-dir) or a directory outside it",
            dir.display(),
            root.dir().display()
        );
    }
    if *dir != root.default_images_dir() {
        refuse_overlap(root.dir(), dir)?;
    }
    Ok(())
}

/// How trees found in the images directory are adopted: ready only in a
/// directory stowage never managed, where no image has ever had a lock
/// file (see adopt.rs).
fn adoption(root: &Root) -> Result<Adopt> {
    let managed = !crate::census::take(root)?.is_empty();
    Ok(if managed {
        Adopt::Unknown
    } else {
        Adopt::AsReady
    })
}

/// What init's last line says of the images it adopted, if any.
fn adopted_note(adopted: usize, how: Adopt) -> String {
    if adopted == 0 {
        return String::new();
    }
    format!(
        "; adopted {adopted} existing image{}{}",
        if adopted == 1 { "" } else { "s" },
        if how == Adopt::Unknown {
            " as incomplete (this store was already managed, so whether they are complete is not known; 'stowage exec --write NAME -- true' marks one ready)"
        } else {
            " as ready"
        }
    )
}

/// Switches the images directory to `dir`: a store-wide operation (no image
/// is written meanwhile, none is created in the directory left behind),
/// refused while any image exists.
fn switch(store: &mut Store, config: &mut crate::config::Config, dir: &Path) -> Result<()> {
    let root = store.root().clone();
    let hold = crate::store_wide::Hold::take(store, "stowage init --images-dir", None, true)?;
    let out = (|| {
        let n = crate::census::take(&root)?
            .iter()
            .filter(|e| e.seen.record.is_some() || e.seen.damaged)
            .count();
        if n > 0 {
            bail!(
                "root {} already keeps {n} images in {}; refusing to switch to {} (remove them first)",
                root.dir().display(),
                config.images_dir_in(root.dir()).display(),
                dir.display()
            );
        }
        // Its parent must exist: a mistyped path should not grow a tree.
        if !dir.is_dir() {
            std::fs::create_dir(dir).with_context(|| {
                format!(
                    "cannot create images directory {} (does its parent exist?)",
                    dir.display()
                )
            })?;
        }
        make_dir(dir)?;
        config.images = ImagesDir::External(dir.to_owned());
        config.identity = None;
        crate::config::write(root.dir(), &root.open()?, config)
    })();
    hold.release(store);
    out
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
