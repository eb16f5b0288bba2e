//! Every image's record, read in one pass over `locks/images/`: what `images`, `gc`, `doctor`,
//! `init` and store-wide operations start from.
//!
//! - Records are read without their locks: the two slots make a read beside a write return the
//!   record before or after it, never a mix. Whoever acts on an image re-reads it under its lock.
//! - A write in flight is told from a dead one by a probe of its lock (only for records that say
//!   `creating` or `writing`).
//! - Only regular files named `*.lock` are read, opened without following links or blocking.
//!   Anything else planted under such a name (directory, FIFO, link) holds no record to read; where
//!   its image's tree is there it stands for that image: an entry whose state is unknown, as for a
//!   file that cannot be read, never "no such image" (`doctor` reports it planted, sets it aside).

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::image_record::{self, Seen, State};
use crate::lock::Probe;
use crate::root::Root;

/// One image lock file and what it says.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The lock file's name in `locks/images/`.
    pub file: String,
    pub path: PathBuf,
    pub seen: Seen,
    /// For a record in flight: whether its writer still holds the lock.
    pub writer_alive: bool,
    /// When the file was last written, by the filesystem's clock (`None` where not told).
    pub written: Option<crate::clock::Millis>,
    /// Something other than a regular file of its own stands at the lock file: no record is read.
    pub planted: bool,
}

impl Entry {
    /// The image's state as a reader must take it, if it has a record of this release's format:
    /// a later release's record makes the older slot's state untrue of the image.
    pub fn state(&self) -> Option<State> {
        let record = self
            .seen
            .record
            .as_ref()
            .filter(|_| self.seen.newer.is_none());
        record.map(|r| r.state_seen(self.writer_alive))
    }

    pub fn name(&self) -> Option<&str> {
        self.seen.record.as_ref().map(|r| r.name.as_str())
    }

    /// The image this file is for: its record's, else, for one that cannot be read (or an old
    /// release's token), the name the file's own name encodes (hashed names say none).
    pub fn image(&self) -> Option<String> {
        let unread = self.seen.damaged || self.seen.legacy;
        (self.name().map(str::to_owned)).or_else(|| {
            let named = unread
                .then(|| Root::image_of_lock_file(&self.file))
                .flatten();
            named.map(|n| n.as_str().to_owned())
        })
    }
}

/// The `*.lock` files (regular, or of no type the directory says) in a listing of `locks/images/`.
pub fn lock_file_names(listing: Vec<crate::dir::DirEntry>) -> Vec<String> {
    listing
        .into_iter()
        .filter(|e| e.kind == libc::DT_REG || e.kind == libc::DT_UNKNOWN)
        .filter_map(|e| e.name.into_string().ok())
        .filter(|n| n.ends_with(".lock"))
        .collect()
}

/// Reads every image lock file's record.
pub fn take(root: &Root) -> Result<Vec<Entry>> {
    let Some(dir) = root.open_sub_if_there(Root::IMAGE_LOCKS_REL)? else {
        return Ok(Vec::new());
    };
    let listing = dir
        .listing()
        .with_context(|| format!("cannot list {}", root.image_locks().display()))?;
    let mut out = Vec::new();
    let names = listing
        .into_iter()
        .filter_map(|e| e.name.into_string().ok());
    for file in names.filter(|n| n.ends_with(".lock")) {
        let path = root.image_locks().join(&file);
        // Only a regular file (the open checks) holds a record; one removed meanwhile is none. A file
        // that could not be read (no permission, an I/O error) may hold one, and anything planted in
        // its place may stand for an image's: its state is unknown, so it is kept and reported as a
        // damaged record is; taken for none, its tree would be adopted or its name said free.
        let unread = Seen {
            damaged: true,
            ..Seen::default()
        };
        // Its type and when it was last written, told by one `statx`.
        let opened = dir.open_read_unchecked(&file).and_then(|f| {
            let written = crate::planted::check_dated(std::path::Path::new(&file), &f)?;
            Ok((f, written))
        });
        let ours = |s: Seen| s.of(|n| crate::root::is_lock_file_of(&file, n));
        let planted = matches!(&opened, Err(e) if crate::planted::find(e).is_some());
        let (seen, writer_alive, written) = match opened {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) if planted && !tree_there(root, &file) => continue,
            Err(_) => (unread, false, None),
            Ok((f, written)) => {
                let seen = ours(image_record::read(&f).unwrap_or(unread));
                let read = || image_record::read(&f).ok().map(ours);
                let probe = || {
                    crate::lock::look(&path, root.lock_queries())
                        .is_ok_and(|p| p == Probe::Exclusive)
                };
                let (seen, alive) = writer_judged(seen, read, probe);
                (seen, alive, written)
            }
        };
        out.push(Entry {
            file,
            path,
            seen,
            writer_alive,
            written,
            planted,
        });
    }
    out.sort_by(|a, b| a.file.cmp(&b.file));
    Ok(out)
}

/// Whether the image lock file `file` names an image whose tree is in the store's images directory
/// (read from the configuration as it is: nothing made or migrated for a look).
pub fn tree_there(root: &Root, file: &str) -> bool {
    let Some(name) = Root::image_of_lock_file(file) else {
        return false;
    };
    let config = root
        .opened()
        .ok()
        .and_then(|d| crate::config::read(root.dir(), d).ok());
    let Some(config) = config.flatten() else {
        return false;
    };
    let dir = config.images.path_in(root.dir());
    let images = root.open_images_dir(&dir);
    images.is_ok_and(|d| matches!(d.stat_at(name.encoded()), Ok(Some(_))))
}

/// [`crate::Error::Newer`] for the first record in `entries` a later release wrote: that release's
/// image, which no command of this release may hint, list as its own or remove.
pub fn newer(root: &Root, entries: &[Entry]) -> Option<crate::Error> {
    let e = entries.iter().find(|e| e.seen.newer.is_some())?;
    let name = e.image().unwrap_or_else(|| e.file.clone());
    Some(crate::Error::Newer {
        root: root.dir().to_path_buf(),
        what: format!("the record of image '{name}', format {}", e.seen.newer?),
    })
}

/// A record read without its lock, with whether its writer, if it is in flight, still holds the
/// lock (`probe`: held exclusively now). A writer may finish between the read and the probe: its
/// lock found free then says nothing of the record read before, so the record is read again after
/// the probe and judged by that; only one unchanged across a probe that found its lock free is a
/// dead writer's. A shared holder (a reader, a size being measured) is no writer.
pub fn writer_judged(
    mut seen: Seen,
    read: impl Fn() -> Option<Seen>,
    probe: impl Fn() -> bool,
) -> (Seen, bool) {
    let fingerprint = |s: &Seen| s.record.as_ref().map(image_record::Record::fingerprint);
    // Each round a writer that began after the last read: a few, then the record stands as read.
    for _ in 0..3 {
        if !seen.record.as_ref().is_some_and(|r| r.state.in_flight()) {
            return (seen, false);
        }
        crate::debug::pause("census-record-read");
        if probe() {
            return (seen, true);
        }
        match read() {
            Some(again) if fingerprint(&again) != fingerprint(&seen) => seen = again,
            _ => break,
        }
    }
    (seen, false)
}
