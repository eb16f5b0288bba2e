//! `stowage gc`: remove incomplete, unused and least recently used images.

use anyhow::Result;

use super::duration::TimeOption;
use crate::disk_usage;
use crate::error::{Error, code::FAILURE};
use crate::gc::{self, Policy};
use crate::store::Store;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    stowage gc                          # incomplete images and leftovers only\n  \
    stowage gc --unused-for 7d          # also images unused for a week\n  \
    stowage gc --max-size 20G --dry-run # what would go to fit 20 GiB\n\
    An image in use (locked) is never removed, however old.")]
pub struct Args {
    /// Remove least recently used images until the images fit SIZE: K M G T P E are powers of 1024, B or iB optional (500M, 20GiB, 1.5T); bytes: 4096B
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    max_size: Option<String>,
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, help = concat!(
        "Remove images not used for DURATION: a number and a unit of ", time_units!(),
        ", whole seconds (30m, 12h, 7d)"))]
    unused_for: Option<String>,
    /// Only say what would be removed
    #[arg(long)]
    dry_run: bool,
    /// Print a JSON report
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    let policy = policy(&args)?;
    store.require_root()?;
    let report = gc::run(store, &policy)?;
    let lines: Vec<&String> = report
        .failed
        .iter()
        .chain(&report.lock_files_left)
        .collect();
    // A cause said as part of a fuller line (the trash refused, and with it each removal) is said
    // once, in the fuller one.
    let fuller = |w: &&String| {
        lines
            .iter()
            .any(|l| l.len() > w.len() && l.ends_with(w.as_str()))
    };
    for why in lines.iter().filter(|w| !fuller(w)) {
        complain!("stowage: {why}");
    }
    // Everything else was done; a removal that failed is an error.
    let code = if report.failed.is_empty() { 0 } else { FAILURE };
    if args.json {
        return super::print_json(&report).map(|()| code);
    }
    // Its report, on stdout, even with -q (which silences stderr's progress only), as doctor's.
    super::print(&report_text(&report, args.dry_run))?;
    Ok(code)
}

/// The policy the options ask for; a size or duration that does not parse is a usage error.
fn policy(args: &Args) -> Result<Policy> {
    let size = |raw: &String| {
        let t = raw.trim();
        gc::parse_size(raw).map_err(|why| {
            Error::Usage(match why {
                gc::BadSize::NoUnit if t.contains('.') => {
                    format!("--max-size '{t}': give a unit (e.g. {t}G or {t}M)")
                }
                gc::BadSize::NoUnit => {
                    format!("--max-size '{t}': give a unit (e.g. {t}G, {t}M, or {t}B for bytes)")
                }
                gc::BadSize::TooLarge => {
                    format!("--max-size '{t}': too large (at most 18446744073709551615B, 16E less a byte)")
                }
                gc::BadSize::Invalid => {
                    format!("--max-size '{raw}': not a size (e.g. 500M, 20G, 1.5T, or 4096B)")
                }
            })
        })
    };
    let max_size = args.max_size.as_ref().map(size).transpose()?;
    let unused_for = (args.unused_for.as_deref())
        .map(|raw| TimeOption::UnusedFor.parse(raw))
        .transpose()?;
    Ok(Policy {
        max_size,
        unused_for,
        dry_run: args.dry_run,
    })
}

/// The report as text: what went (or would go), what was kept, and the space freed.
fn report_text(report: &gc::Report, dry_run: bool) -> String {
    let mut lines = Vec::new();
    let mut line = |l: String| lines.push(l);
    let (verb, frees, uses) = match dry_run {
        true => ("would remove", "would free", "would use"),
        false => ("removed", "freed", "now use"),
    };
    for name in &report.interrupted_removals {
        line(format!("{verb} '{name}' (an interrupted removal)"));
    }
    for name in &report.loans_restored {
        line(format!(
            "restored the modes a killed copy of '{name}' left lent"
        ));
    }
    for left in &report.loans_left {
        let (name, why) = left.split_once(": ").unwrap_or((left, ""));
        line(format!("image '{name}': {why}"));
    }
    let n = report.trash_entries;
    if n > 0 {
        let ending = if n == 1 { "y" } else { "ies" };
        line(format!("{verb} {n} leftover trash entr{ending}"));
    }
    for r in &report.removed {
        let (size, why) = (disk_usage::human(r.size_bytes), r.reason.describe());
        line(format!("{verb} '{}' ({}, {size}): {why}", r.name, r.state));
    }
    for name in &report.busy {
        match report.queued.contains(name) {
            true => line(format!("kept '{name}': a waiting command will use it")),
            false => line(format!("kept '{name}': in use")),
        }
    }
    for kept in &report.unknown {
        let (name, why) = kept.split_once(": ").unwrap_or((kept, ""));
        line(format!("kept '{name}': its state is not known: {why}"));
    }
    let budget = match report.max_size {
        Some(m) => format!(" (budget {})", disk_usage::human(m)),
        None => String::new(),
    };
    let freed = format!("{frees} {}", disk_usage::human(report.bytes_freed));
    let at_most = match report.sizes_as_recorded {
        true => "at most ",
        false => "",
    };
    line(match report.measured {
        true => format!(
            "{freed}; images {uses} {at_most}{}{budget}",
            disk_usage::human(report.size_after)
        ),
        false => freed,
    });
    lines.iter().map(|l| format!("{l}\n")).collect()
}
