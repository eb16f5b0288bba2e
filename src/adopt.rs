//! Adopting image trees that have no row: `init` (directories a builder
//! made before stowage), `doctor --repair` (trees whose rows were lost) and
//! the rebuild of a damaged database; and knowing whether the images
//! directory is the one whose trees the rows describe.
//!
//! The rule: a tree whose readiness is not known is adopted `incomplete`.
//! Only `init` adopting a directory that stowage never managed (no image
//! recorded, no identity recorded) calls its trees `ready` — they are what
//! a builder put there. In a store stowage manages, a tree without a row
//! may be a failed build's partial tree or a creation a crash cut short;
//! content says nothing about which, so it is never readable until a
//! writer makes it ready (`stowage exec --write NAME -- true`). A rebuild
//! keeps the state the damaged database still yields for a tree.
//!
//! Rows are information about trees; a missing tree normally means the row
//! goes. But an images directory that is missing, empty, or not the
//! directory recorded (another inode or filesystem type: an unmounted or
//! wrongly mounted filesystem) says nothing about the trees, so no row is dropped
//! and no tree adopted from it ([`Mount`]). The identity is recorded by
//! `init` and by `doctor --repair`; `init` also accepts a new one.
//!
//! Entries that are not directories (symlinks are never followed) or whose
//! names do not decode to valid image names are reported and left alone.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::clock::{self, Millis};
use crate::dir::Dir;
use crate::meta::{ImageRow, ImageState, Tx};
use crate::name::ImageName;

/// Trees in `dir` without a row, and the entries that are not image trees
/// (name and reason).
pub struct Orphans {
    pub trees: Vec<(ImageName, PathBuf)>,
    pub skipped: Vec<(String, String)>,
}

/// Lists the trees in the images directory `images` (at `dir`) that no row
/// names.
///
/// A tree a new image's writer made without the database is no orphan:
/// its row comes when its record is folded ([`crate::written::new_write_of`]).
pub fn orphans(tx: &Tx, root: &crate::root::Root, images: &Dir, dir: &Path) -> Result<Orphans> {
    let known: HashSet<String> = tx.images()?.into_iter().map(|r| r.name).collect();
    let mut out = Orphans {
        trees: Vec::new(),
        skipped: Vec::new(),
    };
    let entries = tree_names(images)
        .with_context(|| format!("cannot list images directory {}", dir.display()))?;
    for raw in entries {
        if !images
            .stat_at(&raw)
            .ok()
            .flatten()
            .is_some_and(|e| e.is_dir())
        {
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
            Ok(name) if !known.contains(name.as_str()) => {
                if !crate::written::new_write_of(tx, root, &name) {
                    out.trees.push((name, dir.join(&raw)));
                }
            }
            Ok(_) => {}
            Err(e) => out.skipped.push((enc.to_owned(), e.rule.to_string())),
        }
    }
    Ok(out)
}

/// The entries of the images directory that may be image trees. An
/// images directory that is the root of its filesystem has the
/// filesystem's `lost+found` (ext4 makes one): it decodes to the valid name
/// `lost:found`, but it is fsck's, never an image to adopt, measure or
/// delete — nor a sign that a fresh filesystem holds trees.
fn tree_names(images: &Dir) -> io::Result<Vec<std::ffi::OsString>> {
    let mut names = images.names()?;
    if names.iter().any(|n| n == "lost+found") && images.is_mount_root()? {
        names.retain(|n| n != "lost+found");
    }
    Ok(names)
}

/// How an adopted tree starts out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adopt {
    /// `ready`: a tree a builder put there before stowage managed the
    /// directory (`init`, the first time).
    AsReady,
    /// `incomplete`: readiness unknown (repair, rebuild, a later `init`).
    Unknown,
}

/// Inserts a row for every tree in `dir` without one: the row `salvaged`
/// still holds for it if any (a rebuild), else a fresh one made `how`.
/// Returns what was found, and how many rows came from `salvaged`.
pub fn adopt(
    tx: &Tx,
    root: &crate::root::Root,
    images: &Dir,
    dir: &Path,
    how: Adopt,
    salvaged: &HashMap<String, ImageRow>,
) -> Result<(Orphans, usize)> {
    let found = orphans(tx, root, images, dir)?;
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
    let created: Millis = fs::metadata(tree)
        .ok()
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(now, |d| d.as_millis() as Millis);
    ImageRow {
        name: name.as_str().to_owned(),
        state: match how {
            Adopt::AsReady => ImageState::Ready,
            Adopt::Unknown => ImageState::Incomplete,
        },
        base: None,
        created,
        last_used: created,
        size_bytes: None,
    }
}

/// The config key holding the images directory's identity.
const IDENTITY: &str = "images_dir_identity";

/// "INO@FSTYPE[@FSID]" of an open images directory: its inode number, the
/// filesystem's type (statfs magic, in hex) and, where the filesystem has
/// one, its id (`f_fsid`, hex). Not the device number: NFS and others
/// number devices anew at each mount, and a remount of the same filesystem
/// must not look like another one (NFS gives no fsid, so it is left out
/// there). An unmounted directory (the mount point on the filesystem
/// below) differs in inode or type; another filesystem of the same type
/// mounted there — whose root has the same inode, as every ext4's does —
/// in its id.
fn identity_of(images: &Dir) -> io::Result<String> {
    let st = images.stat()?;
    let mut id = format!("{}@{:x}", st.ino, images.fs_magic()?);
    match images.fs_id()? {
        0 => {}
        fsid => id.push_str(&format!("@{fsid:x}")),
    }
    Ok(id)
}

/// Whether the identity `now` is the `recorded` one. An identity recorded
/// by an older release has no filesystem id: inode and type must match.
fn same_identity(recorded: &str, now: &str) -> bool {
    recorded == now
        || (recorded.matches('@').count() == 1
            && now
                .strip_prefix(recorded)
                .is_some_and(|rest| rest.starts_with('@')))
}

/// Whether stowage ever managed the images directory `images`: an image
/// is recorded, or its identity is.
pub fn managed(tx: &Tx, images: &Dir) -> Result<bool> {
    if tx.image_count()? > 0 {
        return Ok(true);
    }
    let id = identity_of(images).context("cannot inspect the images directory")?;
    Ok(tx
        .config(IDENTITY)?
        .is_some_and(|recorded| same_identity(&recorded, &id)))
}

/// Records `images` as the images directory whose trees the rows describe.
pub fn record_identity(tx: &Tx, images: &Dir) -> Result<()> {
    let id = identity_of(images).context("cannot inspect the images directory")?;
    if tx.config(IDENTITY)?.as_deref() != Some(id.as_str()) {
        tx.set_config(IDENTITY, &id)?;
    }
    Ok(())
}

/// What the images directory looks like, for deciding whether a missing
/// tree means a missing image.
pub enum Mount {
    /// The recorded directory (or none recorded yet), with entries.
    Ours(Dir),
    /// Missing or unusable.
    Missing(String),
    /// Empty, while rows say there are trees.
    Empty(Dir),
    /// Another directory than the one recorded.
    Other { recorded: String, now: String },
}

impl Mount {
    /// Why rows cannot be judged by this directory, if they cannot.
    pub fn doubt(&self, dir: &Path) -> Option<String> {
        match self {
            Mount::Ours(_) => None,
            Mount::Missing(why) => Some(format!(
                "images directory {} is not usable ({why}): is it mounted?",
                dir.display()
            )),
            Mount::Empty(_) => Some(format!(
                "images directory {} is empty while images are recorded: is it mounted? (if their trees are really gone, 'stowage rm' the images)",
                dir.display()
            )),
            Mount::Other { recorded, now } => Some(format!(
                "images directory {} is not the directory recorded (inode@filesystem {now}, recorded {recorded}): is the right filesystem mounted? ('stowage init' accepts it as the images directory if it is)",
                dir.display()
            )),
        }
    }
}

/// Looks at the images directory `dir` of `root`. `recorded_trees` says
/// whether any row expects a tree there.
pub fn mount(tx: &Tx, root: &crate::root::Root, dir: &Path, recorded_trees: bool) -> Result<Mount> {
    let images = match root.open_images_dir(dir) {
        Ok(d) => d,
        Err(e) => return Ok(Mount::Missing(format!("{e:#}"))),
    };
    let now = identity_of(&images).context("cannot inspect the images directory")?;
    if let Some(recorded) = tx.config(IDENTITY)?
        && !same_identity(&recorded, &now)
    {
        return Ok(Mount::Other { recorded, now });
    }
    let empty = tree_names(&images)
        .with_context(|| format!("cannot list images directory {}", dir.display()))?
        .is_empty();
    Ok(if empty && recorded_trees {
        Mount::Empty(images)
    } else {
        Mount::Ours(images)
    })
}

/// Whether a tree missing from `dir` may be the images directory's fault
/// (missing, or not the directory recorded) rather than a deletion: the
/// reason, if so. (An empty directory is no sign here: deleting the last
/// image leaves one.)
pub fn unmounted(tx: &Tx, root: &crate::root::Root, dir: &Path) -> Result<Option<String>> {
    Ok(match mount(tx, root, dir, false)? {
        m @ (Mount::Missing(_) | Mount::Other { .. }) => m.doubt(dir),
        Mount::Ours(_) | Mount::Empty(_) => None,
    })
}

#[cfg(test)]
mod tests {
    use super::same_identity;

    #[test]
    fn an_identity_recorded_without_a_filesystem_id_matches_on_inode_and_type() {
        assert!(same_identity("2@ef53@abc", "2@ef53@abc"));
        assert!(!same_identity("2@ef53@abc", "2@ef53@abd"));
        assert!(same_identity("2@ef53", "2@ef53@abc"));
        assert!(!same_identity("2@ef53", "2@ef5@abc"));
        assert!(!same_identity("2@ef53", "22@ef53@abc"));
        assert!(!same_identity("2@ef53@abc", "2@ef53"));
    }
}
