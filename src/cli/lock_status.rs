//! `stowage lock-status`: who holds and awaits which lock.
//!
//! Built from the database's view under the global lock (records judged
//! against the kernel, stale ones deleted), except with the default
//! selection while nothing is held: then from the lock table and the slot
//! records, without the global lock or the database (idle.rs), printing
//! exactly what the database's view would.

use std::ffi::OsString;
use std::io::{IsTerminal, Write};

use anyhow::Result;

use crate::clock;
use crate::ident::printable;
use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;

use crate::ctx::Ctx;
use crate::holders::{Party, global_holders, outsider};
use crate::judge::{self, LockReport, kernel_locked_images, settle, sweep};
use crate::kernel::KernelView;
use crate::lock::Probe;
use crate::meta::{ImageState, LockKind, Tx};
use crate::name::ImageName;
use crate::store::Store;

#[derive(clap::Args)]
pub struct Args {
    /// Show these images' locks even when free
    #[arg(value_name = "IMG")]
    images: Vec<OsString>,
    /// Show every image's lock
    #[arg(long)]
    all: bool,
    /// Print one JSON object (with --watch, one per line)
    #[arg(long)]
    json: bool,
    /// Refresh every SECONDS (fractional, or with a unit: 500ms, 2s, 1m) until interrupted
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true)]
    watch: Option<String>,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    let sel = Selection {
        names: super::names(&args.images)?,
        all: args.all,
    };
    let every = match args.watch.as_deref() {
        Some(raw) => {
            let d = super::parse_seconds("--watch", raw)?;
            if d.is_zero() {
                return Err(crate::Error::Usage(
                    "--watch needs an interval above 0 seconds".into(),
                )
                .into());
            }
            Some(d)
        }
        None => None,
    };
    let tty = std::io::stdout().is_terminal();
    let mut missing_said = false;
    let mut missing_any = false;
    loop {
        let (fs, mut locks) = gather(store, &sel)?;
        // An image asked for by name that has no row, and whose lock nobody
        // holds or awaits, does not exist: say so rather than show it free.
        let missing: Vec<String> = locks
            .iter()
            .filter(|l| {
                l.kind == crate::meta::LockKind::Image
                    && l.image_state.is_none()
                    && l.holders.is_empty()
                    && l.waiters.is_empty()
                    && sel.names.iter().any(|n| n.as_str() == l.name)
            })
            .map(|l| l.name.clone())
            .collect();
        locks.retain(|l| !(l.kind == crate::meta::LockKind::Image && missing.contains(&l.name)));
        if !missing.is_empty() {
            missing_any = true;
            if !missing_said {
                for name in &missing {
                    let _ = writeln!(std::io::stderr(), "stowage: image '{name}' does not exist");
                }
                missing_said = true;
            }
        }
        let text = if args.json {
            let doc = StatusJson {
                root: store.root().dir().display().to_string(),
                filesystem: fs,
                locks: locks.iter().map(lock_json).collect(),
            };
            if every.is_some() {
                serde_json::to_string(&doc)?
            } else {
                serde_json::to_string_pretty(&doc)?
            }
        } else {
            render(store.root().dir(), &fs, &locks)
        };
        let mut out = std::io::stdout().lock();
        match every {
            Some(_) if tty && !args.json => write!(out, "\x1b[H\x1b[2J{text}")?,
            _ => writeln!(out, "{}", text.trim_end())?,
        }
        out.flush()?;
        match every {
            Some(d) => std::thread::sleep(d),
            None if missing_any => return Ok(crate::error::code::NO_INPUT),
            None => return Ok(0),
        }
    }
}

fn render(root: &std::path::Path, fs: &str, locks: &[LockReport]) -> String {
    let mut rows: Vec<[String; 4]> = vec![[
        "LOCK".into(),
        "KIND".into(),
        "STATE".into(),
        "HOLDERS AND WAITERS".into(),
    ]];
    for l in locks {
        let state = match l.image_state {
            Some(s) => format!("{} ({s})", state_str(l.state)),
            None => state_str(l.state).to_owned(),
        };
        let mut who: Vec<String> = l
            .holders
            .iter()
            .map(|p| format!("held: {}", party(p)))
            .collect();
        who.extend(l.waiters.iter().map(|p| format!("waiting: {}", party(p))));
        let first = who.first().cloned().unwrap_or_default();
        let name = if l.kind == crate::meta::LockKind::Slot && l.slot.is_none() {
            format!("{} (removed)", l.name)
        } else {
            l.name.clone()
        };
        rows.push([name, l.kind.as_str().into(), state, first]);
        for more in who.iter().skip(1) {
            rows.push([String::new(), String::new(), String::new(), more.clone()]);
        }
    }
    format!("root {} ({fs})\n{}", root.display(), super::table(&rows))
}

fn party(p: &Party) -> String {
    let mut s = match p.pid {
        Some(pid) => format!("pid {pid}"),
        None => "unknown process".into(),
    };
    if let Some(h) = &p.host {
        s.push_str(&format!(" on {}", printable(h)));
    }
    if let Some(u) = &p.user {
        s.push_str(&format!(" by {}", printable(u)));
    }
    s.push_str(&format!(" ({})", p.mode.as_str()));
    if let Some(c) = &p.command {
        s.push_str(&format!(": {}", printable(c)));
    }
    if let Some(t) = p.since {
        s.push_str(&format!(
            " since {} ({} ago)",
            clock::local_short(t),
            clock::ago(t)
        ));
    }
    if !p.stowage {
        s.push_str(" [outside stowage]");
    }
    s
}

#[derive(Debug, Serialize)]
pub struct StatusJson {
    pub root: String,
    pub filesystem: String,
    pub locks: Vec<LockJson>,
}

#[derive(Debug, Serialize)]
pub struct LockJson {
    pub kind: &'static str,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_state: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserve_high: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_use: Option<u32>,
    pub state: &'static str,
    pub holders: Vec<PartyJson>,
    pub waiters: Vec<PartyJson>,
}

#[derive(Debug, Serialize)]
pub struct PartyJson {
    pub pid: Option<u32>,
    pub host: Option<String>,
    pub user: Option<String>,
    pub mode: &'static str,
    pub command: Option<String>,
    pub since: Option<String>,
    /// False for a lock taken outside stowage.
    pub stowage: bool,
    /// The file name of the party's lease under `ROOT/locks/leases`, which
    /// proves it alive; null for an outsider.
    pub lease: Option<String>,
}

impl From<&Party> for PartyJson {
    fn from(p: &Party) -> Self {
        PartyJson {
            pid: p.pid,
            host: p.host.clone(),
            user: p.user.clone(),
            mode: p.mode.as_str(),
            command: p.command.clone(),
            since: p.since.and_then(clock::rfc3339),
            stowage: p.stowage,
            lease: p.lease.clone(),
        }
    }
}

pub fn state_str(p: Probe) -> &'static str {
    match p {
        Probe::Missing | Probe::Free => "free",
        Probe::Shared => "shared",
        Probe::Exclusive => "exclusive",
    }
}

/// Which image locks lock-status shows.
#[derive(Debug, Default)]
pub struct Selection {
    /// Named images (shown whatever their state).
    pub names: Vec<ImageName>,
    /// Every image.
    pub all: bool,
}

/// Gathers everything lock-status shows: the global lock, then image locks.
/// With the default selection, while nothing is held, without the global
/// lock or the database (idle.rs).
pub fn gather(
    store: &mut crate::store::Store,
    sel: &Selection,
) -> Result<(String, Vec<LockReport>)> {
    let root = store.root().clone();
    // The root's filesystem, found when the root was checked.
    let fs_name = match root.filesystem() {
        Some(f) => f.name.clone(),
        None => {
            crate::filesystem::filesystem(root.dir()).map_or_else(|_| "unknown".into(), |f| f.name)
        }
    };
    if sel.names.is_empty()
        && !sel.all
        && let Some(rows) = crate::idle::look(store.ctx())
    {
        return Ok((fs_name, rows));
    }
    // The global lock is looked at before we take it ourselves.
    let kv_global = match root.filesystem() {
        Some(f) => KernelView::verified_on(f.local, None),
        None => KernelView::new(&root.locks()),
    };
    let global = global_report(store.ctx(), &kv_global, &root.global_lock());

    let images = store.read_tx(|tx, ctx| {
        let kv = crate::judge::kernel_view(tx, ctx, &ctx.root.locks());
        // The lock table is read; the leases are listed next.
        crate::debug::pause("status-table-read");
        let (mut reports, slots) = sweep(tx, ctx, &kv)?;
        crate::judge::clean_leases(ctx, &kv);
        crate::slots::clean_removed(tx, ctx)?;
        for (name, view) in kernel_locked_images(ctx, &kv)? {
            if reports.contains_key(&name) {
                continue;
            }
            let Ok(n) = ImageName::parse(&name) else {
                continue;
            };
            let lockfile = crate::root::Root::image_lock_rel(&n);
            let (holders, waiters) = judge::prune(tx, ctx, &kv, &view, &[], &lockfile)?;
            if holders.is_empty() && waiters.is_empty() {
                continue;
            }
            reports.insert(
                name.clone(),
                LockReport::image(name, &view, holders, waiters),
            );
        }
        // With --all every row is read once, here, for the names and the
        // states below; otherwise the few shown are looked up one by one.
        let states: Option<HashMap<String, ImageState>> = if sel.all {
            Some(
                tx.images()?
                    .into_iter()
                    .map(|r| (r.name, r.state))
                    .collect(),
            )
        } else {
            None
        };
        let extra: Vec<String> = if let Some(states) = &states {
            states.keys().cloned().collect()
        } else {
            sel.names.iter().map(|n| n.as_str().to_owned()).collect()
        };
        for name in extra {
            if reports.contains_key(&name) {
                continue;
            }
            let Ok(n) = ImageName::parse(&name) else {
                continue;
            };
            // An image asked for by name gets a table's "free" confirmed
            // (a probe); --all trusts the table, as probing every image
            // would take every lock in turn.
            let view = kv.view(&ctx.root.image_lock(&n))?;
            let view = if sel.all { view } else { view.confirmed() };
            let lockfile = crate::root::Root::image_lock_rel(&n);
            let (holders, waiters) = judge::prune(tx, ctx, &kv, &view, &[], &lockfile)?;
            reports.insert(
                name.clone(),
                LockReport::image(name, &view, holders, waiters),
            );
        }
        // Without --all or names, only held or awaited locks are shown.
        let named: std::collections::HashSet<&str> =
            sel.names.iter().map(ImageName::as_str).collect();
        let mut out = Vec::new();
        for (name, mut r) in reports {
            let shown = sel.all
                || named.contains(name.as_str())
                || r.state != Probe::Free
                || !r.waiters.is_empty();
            if !shown || (!named.is_empty() && !named.contains(name.as_str()) && !sel.all) {
                continue;
            }
            r.image_state = match &states {
                Some(states) => states.get(&name).copied(),
                None => tx.image(&name)?.map(|row| row.state),
            };
            out.push(r);
        }
        out.extend(store_wide_report(tx, ctx, &kv)?);
        out.extend(slots);
        Ok(out)
    })?;
    let mut locks = vec![global];
    locks.extend(images.into_iter().map(|mut r| {
        // Written by a writer that took no transaction (written.rs): a
        // new image (no row yet) is being created, any other rewritten.
        if store.being_written().contains(&r.name) {
            r.image_state = Some(match r.image_state {
                None => ImageState::Creating,
                Some(_) => ImageState::Writing,
            });
        }
        r
    }));
    Ok((fs_name, locks))
}

/// A store-wide hold (`exec --store-wide`), while held or awaited: a
/// `global` entry named `store`, its holder the recorded command, its
/// waiters the processes queued for it (from the kernel).
fn store_wide_report(tx: &Tx, ctx: &Ctx, kv: &KernelView) -> Result<Option<LockReport>> {
    let path = ctx.root.store_wide_lock();
    let view = kv.view(&path)?;
    let records = tx.records_for(LockKind::Global, "store")?;
    if !view.is_held() && records.is_empty() {
        return Ok(None);
    }
    let (holders, waiters) = judge::prune(
        tx,
        ctx,
        kv,
        &view,
        &records,
        crate::root::Root::STORE_WIDE_LOCK_REL,
    )?;
    // Records found stale, of a lock nobody holds: nothing to show (as
    // when there were none).
    if !view.is_held() && holders.is_empty() && waiters.is_empty() {
        return Ok(None);
    }
    Ok(Some(LockReport {
        kind: LockKind::Global,
        name: "store".into(),
        state: settle(view.state),
        holders,
        waiters,
        image_state: None,
        slot: None,
    }))
}

fn global_report(ctx: &Ctx, kv: &KernelView, path: &Path) -> LockReport {
    let mut view = kv.view(path).unwrap_or_default();
    // The table may not cover this filesystem (it is not verified here, as
    // we hold no lock yet): a probe has the last word on "held".
    if !view.is_held()
        && let Ok(p @ (Probe::Shared | Probe::Exclusive)) = crate::lock::probe(path)
    {
        view.state = Some(p);
    }
    let holders = global_holders(ctx, &view);
    LockReport {
        kind: LockKind::Global,
        name: "global".into(),
        state: settle(view.state),
        holders,
        waiters: view.waiters.iter().map(|e| outsider(ctx, e)).collect(),
        image_state: None,
        slot: None,
    }
}
/// A lock report as JSON.
fn lock_json(r: &LockReport) -> LockJson {
    LockJson {
        kind: r.kind.as_str(),
        name: r.name.clone(),
        image_state: r.image_state.map(ImageState::as_str),
        limit: r.slot.map(|s| s.0),
        reserve_high: r.slot.map(|s| s.1),
        in_use: r.slot.map(|s| s.2),
        state: state_str(r.state),
        holders: r.holders.iter().map(PartyJson::from).collect(),
        waiters: r.waiters.iter().map(PartyJson::from).collect(),
    }
}
