//! `stowage init`: create the layout and adopt existing image directories.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use crate::clock;
use crate::meta::{ImageRow, ImageState};
use crate::name::ImageName;
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
    store.root().create_layout()?;
    let wanted = match &args.images_dir {
        Some(d) => Some(
            std::path::absolute(d).with_context(|| format!("cannot resolve {}", d.display()))?,
        ),
        None => None,
    };
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
    let (dir, adopted, skipped) = store.with_tx(None, |tx, ctx| {
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
            make_dir(dir)?;
            tx.set_config("images_dir", &dir.display().to_string())?;
            // Kept beside the database too, so that rebuilding a damaged
            // database still finds the images.
            crate::doctor::write_images_dir_note(&ctx.root, dir)?;
        }
        let dir = tx.images_dir(&ctx.root)?;
        let (adopted, skipped) = adopt(tx, &dir)?;
        Ok((dir, adopted, skipped))
    })?;
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
                "; adopted {adopted} existing image{}",
                if adopted == 1 { "" } else { "s" }
            )
        } else {
            String::new()
        }
    ));
    Ok(0)
}

/// Inserts a `ready` row for every image directory without one. Entries
/// that are not directories, or whose names do not decode to valid image
/// names, are reported and left alone.
fn adopt(tx: &crate::meta::Tx, dir: &std::path::Path) -> Result<(usize, Vec<(String, String)>)> {
    let now = clock::now_ms();
    let known: std::collections::HashSet<String> =
        tx.images()?.into_iter().map(|r| r.name).collect();
    let mut adopted = 0;
    let mut skipped = Vec::new();
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list images directory {}", dir.display()))?;
    for entry in entries {
        let entry =
            entry.with_context(|| format!("cannot list images directory {}", dir.display()))?;
        let raw = entry.file_name();
        let Some(enc) = raw.to_str() else {
            skipped.push((
                raw.to_string_lossy().into_owned(),
                "the name is not valid UTF-8".into(),
            ));
            continue;
        };
        let ft = entry.file_type()?;
        if !ft.is_dir() {
            // Not an image tree; a symlink is never followed.
            continue;
        }
        let name = match ImageName::from_encoded(enc) {
            Ok(n) => n,
            Err(e) => {
                skipped.push((enc.to_owned(), e.rule.to_string()));
                continue;
            }
        };
        if known.contains(name.as_str()) {
            continue;
        }
        let created = entry
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(now, |d| d.as_millis() as i64);
        tx.insert_image(&ImageRow {
            name: name.as_str().to_owned(),
            state: ImageState::Ready,
            base: None,
            created,
            last_used: created,
            size_bytes: None,
        })?;
        adopted += 1;
    }
    Ok((adopted, skipped))
}
