//! `stowage images` (alias `ls`): one row per image.

use std::collections::HashMap;

use anyhow::Result;
use serde::Serialize;

use crate::clock;
use crate::lock::{self, Mode};
use crate::meta::{ImageRow, ImageState};
use crate::name::ImageName;
use crate::status;
use crate::store::Store;
use crate::usage;

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
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    let (mut rows, in_use, images_dir) = store.with_tx(None, |tx, ctx| {
        let kv = tx.kernel_view(&ctx.root.image_locks());
        let in_use = status::in_use(tx, ctx, &kv)?;
        Ok((tx.images()?, in_use, tx.images_dir(&ctx.root)?))
    })?;
    fill_sizes(store, &mut rows, &in_use, &images_dir)?;

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
            r.size_bytes.map_or_else(|| "?".into(), usage::human),
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
    Ok(0)
}

/// Measures ready images whose size is not known yet (adopted ones), each
/// under a shared lock taken without waiting — a busy image keeps its "?" —
/// and records the sizes. Done once per image, then remembered.
fn fill_sizes(
    store: &mut Store,
    rows: &mut [ImageRow],
    in_use: &HashMap<String, bool>,
    images_dir: &std::path::Path,
) -> Result<()> {
    let mut found = Vec::new();
    for r in rows.iter_mut() {
        if r.size_bytes.is_some()
            || r.state != ImageState::Ready
            || in_use.get(&r.name).copied().unwrap_or(false)
        {
            continue;
        }
        let Ok(name) = ImageName::parse(&r.name) else {
            continue;
        };
        let Ok(Some(_guard)) = lock::try_lock(&store.root().image_lock(&name), Mode::Shared, true)
        else {
            continue;
        };
        if let Ok(size) = usage::disk_usage(&images_dir.join(name.encoded())) {
            r.size_bytes = Some(size);
            found.push((r.name.clone(), size));
        }
    }
    if !found.is_empty() {
        store.with_tx(None, |tx, _| {
            for (name, size) in &found {
                tx.set_size(name, Some(*size))?;
            }
            Ok(())
        })?;
    }
    Ok(())
}
