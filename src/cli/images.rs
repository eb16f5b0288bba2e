//! `stowage images` (alias `ls`): one row per image.

use std::collections::HashMap;

use anyhow::Result;
use serde::Serialize;

use crate::clock;
use crate::disk_usage;
use crate::lock::{self, Mode};
use crate::meta::{ImageRow, ImageState};
use crate::name::ImageName;
use crate::store::Store;

#[derive(clap::Args)]
pub struct Args {
    /// Print a JSON array
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct ImageJson<'a> {
    name: &'a str,
    state: &'static str,
    size_bytes: Option<u64>,
    base: Option<&'a str>,
    /// null for a stored time RFC 3339 cannot express.
    created: Option<String>,
    last_used: Option<String>,
    in_use: bool,
    /// What removing this image alone would free: its blocks that no other
    /// image shares (extra field; null when the size is unknown).
    exclusive_bytes: Option<u64>,
    /// Of size_bytes, the bytes in extents shared with other files (reflink
    /// clones); 0 on filesystems that cannot share.
    shared_bytes: Option<u64>,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    let (mut rows, mut in_use, images_dir) = store.read_tx(|tx, ctx| {
        let kv = crate::judge::kernel_view(tx, ctx, &ctx.root.image_locks());
        let in_use = crate::judge::in_use(tx, ctx, &kv)?;
        Ok((tx.images()?, in_use, tx.images_dir(&ctx.root)?))
    })?;
    // A writer that took no transaction is at work on these: their rows
    // still say what they were (written.rs).
    for r in rows.iter_mut() {
        if store.being_written().contains(&r.name) {
            r.state = ImageState::Writing;
        }
    }
    // A new image's writer that took no transaction: no row yet, but there
    // it is, being created (as the database's way would list it).
    let now = clock::now_ms();
    for name in store.being_written() {
        if !rows.iter().any(|r| r.name == *name) {
            rows.push(ImageRow {
                name: name.clone(),
                state: ImageState::Creating,
                base: None,
                created: now,
                last_used: now,
                size_bytes: None,
            });
            in_use.insert(name.clone(), true);
        }
    }
    rows.sort_by(|a, b| a.name.cmp(&b.name));
    fill_sizes(store, &mut rows, &in_use, &images_dir)?;
    let sharing = Sharing::measure(&rows, &images_dir);

    if args.json {
        let out: Vec<ImageJson> = rows
            .iter()
            .map(|r| ImageJson {
                name: &r.name,
                state: r.state.as_str(),
                size_bytes: r.size_bytes,
                base: r.base.as_deref(),
                created: clock::rfc3339(r.created),
                last_used: clock::rfc3339(r.last_used),
                in_use: in_use.get(&r.name).copied().unwrap_or(false),
                exclusive_bytes: sharing.exclusive(r),
                shared_bytes: sharing.shared(r),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(0);
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
    for r in &rows {
        table.push([
            r.name.clone(),
            r.state.as_str().into(),
            r.size_bytes.map_or_else(|| "?".into(), disk_usage::human),
            r.base.clone().unwrap_or_else(|| "-".into()),
            clock::local_minutes(r.created),
            clock::local_minutes(r.last_used),
            if in_use.get(&r.name).copied().unwrap_or(false) {
                "yes".into()
            } else {
                "no".into()
            },
        ]);
    }
    print!("{}", super::table(&table));
    if let Some(line) = sharing.summary(&rows) {
        println!("{line}");
    }
    Ok(0)
}

/// Shared extents between images, on a filesystem that can share them
/// (reflink clones): what each image shares, and what removing it frees.
/// Elsewhere nothing is shared and nothing is read.
struct Sharing {
    by_image: HashMap<String, disk_usage::Measure>,
    footprint: Option<disk_usage::Footprint>,
}

impl Sharing {
    fn measure(rows: &[ImageRow], images_dir: &std::path::Path) -> Sharing {
        let mut by_image = HashMap::new();
        if !disk_usage::can_share(images_dir) {
            return Sharing {
                by_image,
                footprint: None,
            };
        }
        for r in rows.iter().filter(|r| r.state != ImageState::Deleting) {
            let Ok(name) = ImageName::parse(&r.name) else {
                continue;
            };
            if let Ok(m) = disk_usage::measure(&images_dir.join(name.encoded()), true) {
                by_image.insert(r.name.clone(), m);
            }
        }
        let footprint =
            disk_usage::Footprint::new(by_image.values().map(|m| m.shared_ranges.as_slice()));
        Sharing {
            by_image,
            footprint: Some(footprint),
        }
    }

    fn shared(&self, r: &ImageRow) -> Option<u64> {
        match &self.footprint {
            None => r.size_bytes.map(|_| 0),
            Some(_) => self.by_image.get(&r.name).map(|m| m.shared),
        }
    }

    fn exclusive(&self, r: &ImageRow) -> Option<u64> {
        match &self.footprint {
            None => r.size_bytes,
            Some(fp) => self
                .by_image
                .get(&r.name)
                .map(|m| m.allocated.saturating_sub(m.shared) + fp.unique(&m.shared_ranges)),
        }
    }

    /// "images take 410.2 MiB on the filesystem (1.6 GiB allocated, 1.2 GiB
    /// of it shared between images)" — only when something is shared.
    fn summary(&self, rows: &[ImageRow]) -> Option<String> {
        let fp = self.footprint.as_ref()?;
        let shared: u64 = self.by_image.values().map(|m| m.shared).sum();
        if shared == 0 {
            return None;
        }
        let allocated: u64 = rows.iter().filter_map(|r| r.size_bytes).sum();
        let own: u64 = self
            .by_image
            .values()
            .map(|m| m.allocated.saturating_sub(m.shared))
            .sum();
        Some(format!(
            "images take {} on the filesystem ({} allocated; {} in extents shared between files)",
            disk_usage::human(own + fp.bytes()),
            disk_usage::human(allocated),
            disk_usage::human(shared)
        ))
    }
}

/// Measures ready and incomplete images whose size is not known yet
/// (adopted ones, or a writer that could not measure), each under a shared
/// lock taken without waiting — a busy image keeps its "?" — and records
/// the sizes, each only if the row is unchanged since it was read (a writer
/// that started and finished meanwhile has recorded its own). Done once per
/// image, then remembered.
fn fill_sizes(
    store: &mut Store,
    rows: &mut [ImageRow],
    in_use: &HashMap<String, bool>,
    images_dir: &std::path::Path,
) -> Result<()> {
    let mut found = Vec::new();
    for r in rows.iter_mut() {
        if r.size_bytes.is_some()
            || !matches!(r.state, ImageState::Ready | ImageState::Incomplete)
            || in_use.get(&r.name).copied().unwrap_or(false)
        {
            continue;
        }
        let Ok(name) = ImageName::parse(&r.name) else {
            continue;
        };
        let Ok(Some(_guard)) = lock::acquire_no_wait(
            &store.root().image_lock(&name),
            Mode::Shared,
            lock::IfMissing::Create,
        ) else {
            continue;
        };
        if let Ok(size) = disk_usage::disk_usage(&images_dir.join(name.encoded())) {
            found.push((r.clone(), size));
            r.size_bytes = Some(size);
        }
    }
    crate::debug::pause("images-measured");
    if !found.is_empty() {
        let recorded = store.with_tx(None, |tx, _| {
            for (seen, size) in &found {
                tx.set_size_if_unchanged(seen, *size)?;
            }
            Ok(())
        });
        match recorded {
            // On a full disk the sizes are shown, and measured again next time.
            Err(e) if crate::space::is_full(&e) => {}
            other => other?,
        }
    }
    Ok(())
}
