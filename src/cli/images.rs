//! `stowage images` (alias `ls`): one row per image.

use std::collections::{HashMap, HashSet};

use anyhow::Result;
use serde::Serialize;

use crate::clock;
use crate::disk_usage;
use crate::holders::{LockKind, Look};
use crate::image_record::State;
use crate::store::Store;
use crate::survey::Image;

#[derive(clap::Args)]
pub struct Args {
    /// Print a JSON array
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct ImageJson<'a> {
    name: &'a str,
    /// null for an image a newer stowage recorded (its state is not known here).
    state: Option<&'static str>,
    /// The format of such an image's record (extra field; null for this release's).
    newer_format: Option<u64>,
    size_bytes: Option<u64>,
    base: Option<&'a str>,
    /// null for a stored time RFC 3339 cannot express.
    created: Option<String>,
    last_used: Option<String>,
    in_use: bool,
    /// What removing this image alone would free: its blocks that no other
    /// image shares (extra field; null when the size is unknown).
    exclusive_bytes: Option<u64>,
    /// Of size_bytes, the bytes other images hold too (reflinked extents, linked files), and
    /// files named outside the store; 0 if extents cannot be shared.
    shared_bytes: Option<u64>,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    store.require_root()?;
    // A tree no record describes is not listed: gc and doctor say it (a listing lists the images
    // directory only if it must, a round trip where each is one).
    let mut images = crate::survey::listing(store)?;
    let look = Look::new(store.ctx());
    // Whether each is in use, not by whom: a lock no lease explains is not waited on to name it.
    look.deferring(true);
    let in_use: HashSet<String> = images
        .iter()
        .filter(|i| {
            let r = look.report(LockKind::Image, i.name(), &i.entry.path);
            r.state != crate::lock::Probe::Free || i.entry.writer_alive
        })
        .map(|i| i.name().to_owned())
        .collect();
    // By name as the user writes it (the survey goes by lock file name: 'app%sub' before 'app').
    images.sort_by(|a, b| a.name().cmp(b.name()));
    let sharing = Sharing::measure(store, &images);
    if let Some(r) = images.iter().find(|r| r.entry.seen.newer.is_some()) {
        let (name, more) = (
            r.name(),
            images.iter().filter(|r| state(r).is_none()).count() - 1,
        );
        let others = if more > 0 {
            format!(" (and {more} more)")
        } else {
            String::new()
        };
        store.ctx().say(&format!(
            "image '{name}'{others} was written by a newer stowage: its state is not known here; upgrade stowage"
        ));
    }
    if args.json {
        let out: Vec<ImageJson> = images
            .iter()
            .map(|r| ImageJson {
                name: r.name(),
                state: state(r),
                newer_format: r.entry.seen.newer,
                size_bytes: r.size,
                base: r.record.base.as_deref(),
                created: clock::rfc3339(r.record.created),
                last_used: clock::rfc3339(r.last_used),
                in_use: in_use.contains(r.name()),
                exclusive_bytes: sharing.exclusive(r),
                shared_bytes: sharing.shared(r),
            })
            .collect();
        return super::print_json(&out).map(|()| 0);
    }
    let mut table = vec![[
        "NAME".to_owned(),
        "STATE".into(),
        "SIZE".into(),
        "BASE".into(),
        "CREATED".into(),
        "LAST USED".into(),
        "IN USE".into(),
    ]];
    for r in &images {
        let used = in_use.contains(r.name());
        table.push([
            r.name().to_owned(),
            state(r).unwrap_or("newer").into(),
            r.size.map_or_else(|| "?".into(), disk_usage::human),
            r.record.base.clone().unwrap_or_else(|| "-".into()),
            clock::local_minutes(r.record.created),
            clock::local_minutes(r.last_used),
            if used { "yes" } else { "no" }.into(),
        ]);
    }
    let mut out = super::table(&table);
    if let Some(line) = sharing.summary(&images) {
        out.push_str(&line);
        out.push('\n');
    }
    super::print(&out).map(|()| 0)
}

/// The image's state, `None` where a newer stowage wrote its record (this release cannot read it:
/// "incomplete" would say its writer failed).
fn state(r: &Image) -> Option<&'static str> {
    r.entry.seen.newer.is_none().then(|| r.state.as_str())
}

/// Shared extents between images on a filesystem that can share them (reflink clones): what each
/// image shares, and what removing it frees. Elsewhere nothing is shared and nothing is read.
struct Sharing {
    by_image: HashMap<String, disk_usage::Measure>,
    footprint: Option<disk_usage::Footprint>,
}

impl Sharing {
    fn measure(store: &Store, rows: &[Image]) -> Sharing {
        let mut by_image = HashMap::new();
        let images_dir = crate::images_dir::config(store.root())
            .map(|c| c.images.path_in(store.root().dir()))
            .unwrap_or_else(|_| store.root().default_images_dir());
        let footprint = disk_usage::can_share(&images_dir).then(|| {
            for r in rows.iter().filter(|r| r.state != State::Deleting) {
                let tree = crate::images_dir::tree_of(store.root(), &r.record);
                if let Ok(m) = disk_usage::measure(&tree, true) {
                    by_image.insert(r.name().to_owned(), m);
                }
            }
            disk_usage::Footprint::new(by_image.values().map(|m| &m.shares))
        });
        Sharing {
            by_image,
            footprint,
        }
    }

    fn shared(&self, r: &Image) -> Option<u64> {
        match &self.footprint {
            None => r.size.map(|_| 0),
            Some(fp) => self.by_image.get(r.name()).map(|m| fp.shared(m)),
        }
    }

    fn exclusive(&self, r: &Image) -> Option<u64> {
        match &self.footprint {
            None => r.size,
            // Seen in part (a directory we may not read): a size kept whole says more.
            Some(fp) => self.by_image.get(r.name()).map(|m| match m.partial {
                true => (m.own() + fp.unique(&m.shares)).max(r.size.unwrap_or(0)),
                false => m.own() + fp.unique(&m.shares),
            }),
        }
    }

    /// "images take 410.2 MiB on the filesystem (1.6 GiB allocated, 1.2 GiB
    /// of it shared between images)" — only when something is shared.
    fn summary(&self, rows: &[Image]) -> Option<String> {
        let fp = self.footprint.as_ref()?;
        let shared: u64 = self.by_image.values().map(|m| fp.shared(m)).sum();
        if shared == 0 {
            return None;
        }
        let allocated: u64 = rows.iter().filter_map(|r| r.size).sum();
        let own: u64 = self.by_image.values().map(disk_usage::Measure::own).sum();
        let h = disk_usage::human;
        let (total, allocated, shared) = (h(own + fp.bytes()), h(allocated), h(shared));
        Some(format!(
            "images take {total} on the filesystem ({allocated} allocated; {shared} of it shared between images or files)"
        ))
    }
}
