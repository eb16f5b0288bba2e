//! `stowage lock-status`: who holds and awaits which lock.

use std::ffi::OsString;
use std::io::{IsTerminal, Write};

use anyhow::Result;

use crate::clock;
use crate::ident::printable;
use crate::status::{self, LockReport, Party, Selection, StatusJson};
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
        let (fs, mut locks) = status::gather(store, &sel)?;
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
                locks: locks.iter().map(LockReport::to_json).collect(),
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
            Some(s) => format!("{} ({s})", status::state_str(l.state)),
            None => status::state_str(l.state).to_owned(),
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
