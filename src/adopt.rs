//! Adopting image trees that have no row: `init` (directories a builder
//! made before stowage), `doctor --repair` (trees whose rows were lost) and
//! the rebuild of a damaged database.
//!
//! `init` adopts every tree as `ready`, as the contract says: they are what
//! a builder put there. A repair is more careful ([`Adopt::ByContent`]): a
//! tree found without its row after a crash may be a creation that never
//! finished (the process died between making the directory and recording
//! the image), so an empty one is `incomplete` and never readable. Entries
//! that are not directories (symlinks are never followed) or whose names do
//! not decode to valid image names are reported and left alone.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::clock::{self, Millis};
use crate::meta::{ImageRow, ImageState, Tx};
use crate::name::ImageName;

/// Trees in `dir` without a row, and the entries that are not image trees
/// (name and reason).
pub struct Orphans {
    pub trees: Vec<(ImageName, PathBuf)>,
    pub skipped: Vec<(String, String)>,
}

/// Lists the trees in the images directory that no row names.
pub fn orphans(tx: &Tx, dir: &Path) -> Result<Orphans> {
    let known: HashSet<String> = tx.images()?.into_iter().map(|r| r.name).collect();
    let mut out = Orphans {
        trees: Vec::new(),
        skipped: Vec::new(),
    };
    let entries = fs::read_dir(dir)
        .with_context(|| format!("cannot list images directory {}", dir.display()))?;
    for entry in entries {
        let entry =
            entry.with_context(|| format!("cannot list images directory {}", dir.display()))?;
        let raw = entry.file_name();
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Some(enc) = raw.to_str() else {
            out.skipped.push((
                raw.to_string_lossy().into_owned(),
                "the name is not valid UTF-8".into(),
            ));
            continue;
        };
        match ImageName::from_encoded(enc) {
            Ok(name) if !known.contains(name.as_str()) => out.trees.push((name, entry.path())),
            Ok(_) => {}
            Err(e) => out.skipped.push((enc.to_owned(), e.rule.to_string())),
        }
    }
    Ok(out)
}

/// How an adopted tree starts out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adopt {
    /// `ready`: a tree a builder put there (`init`).
    AsReady,
    /// `ready` if it has content, `incomplete` if empty: a tree a crash may
    /// have left (repair).
    ByContent,
}

/// Inserts a row for every tree in `dir` without one: the row `salvaged`
/// still holds for it if any (a rebuild), else a fresh one made `how`.
/// Returns what was found, and how many rows came from `salvaged`.
pub fn adopt(
    tx: &Tx,
    dir: &Path,
    how: Adopt,
    salvaged: &HashMap<String, ImageRow>,
) -> Result<(Orphans, usize)> {
    let found = orphans(tx, dir)?;
    let mut from_salvage = 0;
    for (name, tree) in &found.trees {
        let row = match salvaged.get(name.as_str()) {
            Some(r) => {
                from_salvage += 1;
                r.clone()
            }
            None => row_for(name, tree, how),
        };
        tx.insert_image(&row)?;
    }
    Ok((found, from_salvage))
}

/// The row an adopted tree gets; created and last used when the directory
/// was last modified.
pub fn row_for(name: &ImageName, tree: &Path, how: Adopt) -> ImageRow {
    let now = clock::now_ms();
    let empty = how == Adopt::ByContent
        && fs::read_dir(tree)
            .map(|mut d| d.next().is_none())
            .unwrap_or(true);
    let created: Millis = fs::metadata(tree)
        .ok()
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(now, |d| d.as_millis() as Millis);
    ImageRow {
        name: name.as_str().to_owned(),
        state: if empty {
            ImageState::Incomplete
        } else {
            ImageState::Ready
        },
        base: None,
        created,
        last_used: created,
        size_bytes: None,
    }
}
