//! `doctor`'s look at the store's configuration (`store.conf`).
//!
//! - One that cannot be used (damaged, emptied, unreadable, or missing while images have records)
//!   is set aside by `--repair` (renamed `store.conf.damaged-TIME`, never deleted) and written anew
//!   from the images directory the records name: all `images=default`, or no record → the default;
//!   one absolute directory named by all → that, if it is a directory now.
//! - Records that disagree (or name a directory not there): nothing is guessed; the file stays,
//!   reported with what to do.

use anyhow::{Context, Result};

use crate::config::{self, Config};
use crate::image_record::ImagesDir;
use crate::root::Root;

use super::Report;
use super::Verdict::{Problem, Repaired};
use crate::ident::STOWAGE;

/// Checks the configuration; returns whether it can be used now.
pub(super) fn check(root: &Root, repair: bool, report: &mut Report) -> Result<bool> {
    let dir = root.open()?;
    let path = root.dir().join(config::FILE);
    let why = match unusable(root, &dir, &path) {
        Ok(None) => return Ok(true),
        Ok(Some(why)) => why,
        // Not read (a lost connection, EIO, EACCES): it may be sound, so nothing is set aside.
        Err(e) => {
            report.add("config", Problem, format!("{e:#}"));
            return Ok(false);
        }
    };
    let images = match from_records(root) {
        Ok(images) => images,
        Err(doubt) => {
            report.add("config", Problem, format!("{why}; it is not written anew because {doubt}: set it aside and run '{STOWAGE} init --images-dir DIR' with the images directory the records name"));
            return Ok(false);
        }
    };
    let in_records = images.path_in(root.dir());
    let shown = in_records.display();
    let images_dir = root.open_images_dir(&in_records).ok();
    let root_identity = dir.identity().ok();
    let ours = match whose(&images, images_dir.as_ref(), root_identity.as_deref()) {
        Ok(ours) => ours,
        Err(whose) => {
            report.add("config", Problem, format!("{why}; the images' records name images directory {shown}, but {whose}: nothing is written; if that directory is this store's, '{STOWAGE} init --images-dir {}' records it", crate::ident::shell_path(&in_records)));
            return Ok(false);
        }
    };
    if !repair {
        report.by_repair().add("config", Problem, format!("{why}; '{STOWAGE} doctor --repair' sets it aside and writes it anew from the images' records (they say: images in {shown})"));
        return Ok(false);
    }
    let aside = match dir.set_aside(config::FILE, "damaged") {
        Ok(aside) => format!("set aside as {}; ", root.dir().join(aside).display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot set {} aside", path.display())),
    };
    let mut fresh = Config {
        identity: images_dir.as_ref().and_then(|d| d.identity().ok()),
        root: root_identity,
        images,
        ..Config::fresh()
    };
    // The store keeps its id, which lives on in its images directory's claim.
    if let Some(c) = ours {
        fresh.id = c.id;
    }
    config::write(root.dir(), &dir, &fresh)?;
    let detail = format!("{why}: {aside}written anew from the images' records (images in {shown})");
    report.add("config", Repaired, detail);
    Ok(true)
}

/// Why the configuration cannot be used, if so: damaged, no regular file, or missing while images
/// have records; an error if it could not be read.
fn unusable(root: &Root, dir: &crate::dir::Dir, path: &std::path::Path) -> Result<Option<String>> {
    let shown = path.display();
    Ok(match config::read(root.dir(), dir) {
        Ok(Some(_)) => None,
        Ok(None) if !lost(root)? => None,
        // Made meanwhile by a first use beside this look (it writes no record before).
        Ok(None) if config::read(root.dir(), dir).is_ok_and(|c| c.is_some()) => None,
        Ok(None) => Some(format!("{shown} is missing while images have records")),
        Err(e) => match e.downcast_ref::<config::Unusable>() {
            Some(u) => Some(u.why.clone()),
            None => return Err(e),
        },
    })
}

/// Whose the images directory the records name is: `Ok` with this root's claim (it carries the
/// store's id), if any; `Err` why an external one that can keep a claim is not this store's.
fn whose(
    images: &ImagesDir,
    images_dir: Option<&crate::dir::Dir>,
    root_identity: Option<&str>,
) -> Result<Option<crate::claim::Claim>, String> {
    let claim = images_dir.and_then(crate::claim::read);
    let mine = |c: &crate::claim::Claim| {
        root_identity.is_some_and(|me| crate::dir::same_identity(&c.root, me))
    };
    if let Some(c) = claim.as_ref().filter(|c| mine(c)) {
        return Ok(Some(c.clone()));
    }
    let claimable = images_dir.is_some_and(crate::claim::supported);
    if *images == ImagesDir::Default || !claimable {
        return Ok(None);
    }
    Err(match &claim {
        Some(c) => format!("the store at {} claims it", c.path.display()),
        None => "it carries no claim of this store (is it mounted?)".to_owned(),
    })
}

/// A store whose configuration went missing: no older catalog to migrate, and records.
fn lost(root: &Root) -> Result<bool> {
    // A busy catalog may be an older release's mid-migration: not lost (the catalog check says).
    let legacy = match crate::catalog::legacy_state(root) {
        Err(e) if matches!(crate::error::typed(&e), Some(crate::Error::Busy(_))) => {
            return Ok(false);
        }
        other => other?,
    };
    Ok(legacy.is_none() && crate::images_dir::has_records(root)?)
}

/// The images directory every record names; or why not (they disagree, or it is no directory now).
fn from_records(root: &Root) -> Result<ImagesDir, String> {
    let mut named: Vec<ImagesDir> = Vec::new();
    for e in crate::census::take(root).map_err(|e| format!("{e:#}"))? {
        if let Some(r) = e.seen.record
            && !named.contains(&r.images)
        {
            named.push(r.images);
        }
    }
    let n = named.len();
    match named.as_slice() {
        [] | [ImagesDir::Default] => Ok(ImagesDir::Default),
        [ImagesDir::External(p)] if std::fs::metadata(p).is_ok_and(|m| m.is_dir()) => {
            Ok(ImagesDir::External(p.clone()))
        }
        [ImagesDir::External(p)] => Err(format!(
            "the records name {}, which is not a directory now",
            p.display()
        )),
        _ => Err(format!("the records name {n} images directories")),
    }
}
