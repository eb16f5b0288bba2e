//! Adopting trees that have no record.
//!
//! - A tree without a record gets one: `ready` when `init` adopts a directory stowage never managed;
//!   else `incomplete` ([`ADOPTED`]): kept, never collected until `exec --write` makes it ready.
//! - An adoption as `ready` is said in the configuration while it runs ([`mark_adopting`]): one
//!   interrupted is finished as it began, by the next `init` or `doctor --repair`.
//! - Entries that are no directories, whose names decode to no image name, or that a store uses
//!   (`root::in_use_by_a_store`): reported, left alone.

use std::path::Path;

use anyhow::Result;

use crate::clock;
use crate::config::Config;
use crate::ident::STOWAGE;
use crate::image_record::{self, ADOPTED, Record, State};
use crate::name::ImageName;
use crate::root::Root;

/// Where the images directory is listed: adoption, gc and listings see the same trees.
pub use crate::survey::{Orphans, has_record, never_adopted, orphans};

/// Says in the configuration, under the global lock, whether trees are being adopted as `ready`:
/// the lock files an interrupted adoption made must not make the next one judge them leftovers.
pub fn mark_adopting(store: &crate::store::Store, on: bool) -> Result<()> {
    let global = || store.global(None);
    crate::images_dir::update_config(store.root(), global, |c| c.adopting = on)
}

/// How an adopted tree starts out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adopt {
    /// `ready`: what a builder put there before stowage managed it.
    AsReady,
    /// `incomplete`, adopted: readiness unknown.
    Unknown,
}

/// What [`adopt`] did: the trees given a record, and those left without one, each with why (lock
/// held, lock file planted, filesystem full): one tree that cannot be adopted stops no other.
#[derive(Debug, Default)]
pub struct Adopted {
    pub names: Vec<String>,
    pub left: Vec<String>,
}

/// Gives each orphan tree a record made now, under the image's exclusive lock (a tree whose record
/// appeared meanwhile is left alone; one that cannot get one goes in [`Adopted::left`]).
pub fn adopt(root: &Root, config: &Config, orphans: &Orphans, how: Adopt) -> Result<Adopted> {
    let mut out = Adopted::default();
    for (name, tree) in &orphans.trees {
        match adopt_one(root, config, name, tree, how) {
            Ok(true) => {
                out.names.push(name.as_str().to_owned());
                crate::debug::pause("adopted-one");
            }
            Ok(false) => {}
            Err(e) if crate::error::typed(&e).is_some() => return Err(e),
            Err(e) => out.left.push(format!("'{name}': {e:#}")),
        }
    }
    Ok(out)
}

/// Whether the directory `tree` is a mount point, told by mount id as the survey tells it (a btrfs
/// subvolume has a device of its own on its parent's mount, and is a tree); by device where the
/// kernel gives no mount id. `None` if it cannot be asked.
fn mounted(tree: &Path) -> Option<bool> {
    let (parent, name) = (tree.parent()?, tree.file_name()?);
    crate::dir::Dir::open_nofollow(parent).ok()?.is_mount_at(name).ok()?
}

/// Adopts one tree; `Ok(false)` if it needs no record any more.
fn adopt_one(
    root: &Root,
    config: &Config,
    name: &ImageName,
    tree: &Path,
    how: Adopt,
) -> Result<bool> {
    let path = root.image_lock(name);
    let held = crate::gc::take_exclusive(root, name, crate::lock::IfMissing::Create)
        .map_err(|e| crate::lock::error(&format!("image '{name}'"), &path, e))?;
    let Some(held) = held else {
        // Held by the image's creator, which wrote its record before it made the tree: a tree
        // found after the records were read is no orphan.
        if has_record(&path) {
            return Ok(false);
        }
        anyhow::bail!("its lock is held (try again when it is free)");
    };
    let (guard, mut seen) = (held.guard, held.seen);
    if !seen.unrecorded() {
        return Ok(false);
    }
    // Again under the lock, by evidence no client's cache fakes: an undone start, or an `rm` on
    // another host, may have taken its tree since, while a lookup here still finds it.
    let there = (tree.parent().zip(tree.file_name().and_then(|n| n.to_str())))
        .and_then(|(dir, encoded)| crate::images_dir::tree_there(root, dir, encoded));
    if there != Some(true) || !std::fs::symlink_metadata(tree).is_ok_and(|m| m.is_dir()) {
        let _ = root.unlink_lock(guard);
        return Ok(false);
    }
    // Mounted there since it was found: another filesystem's, never an image of ours.
    if mounted(tree).unwrap_or(true) {
        let _ = root.unlink_lock(guard);
        anyhow::bail!("it is a mount point now (another filesystem's, no tree of the store's)");
    }
    // No store-wide command may find a new image made beside it.
    if crate::store_wide::probe(root)? == crate::store_wide::Probe::Held {
        let what = format!("the adoption of image '{name}'");
        let holders = "a store-wide command runs; try again when it ends".into();
        return Err(crate::error::Busy::now(what, holders).into());
    }
    // Made when its tree was, as far as anyone knows; used last when adopted (when it was really
    // used is not known, and a tree's time says nothing of it: an import keeps a tarball's times).
    let mut r = Record::new(name.as_str(), config.images.clone(), clock::tree_time(tree));
    r.changed = clock::now_ms().max(r.created);
    (r.state, r.outcome) = match how {
        Adopt::AsReady => (State::Ready, Some("adopted".to_owned())),
        Adopt::Unknown => (State::Incomplete, Some(ADOPTED.to_owned())),
    };
    if let Err(e) = image_record::write(guard.file(), &mut seen, &r) {
        // A lock file made just now for nothing goes again.
        let _ = root.unlink_lock(guard);
        let full = if crate::space::is_full_io(&e) {
            format!(
                " (the filesystem is full: '{STOWAGE} gc' or '{STOWAGE} rm IMAGE' free space, and both work on a full filesystem; then repair again)"
            )
        } else {
            String::new()
        };
        anyhow::bail!("cannot write its record in {}: {e}{full}", path.display());
    }
    Ok(true)
}
