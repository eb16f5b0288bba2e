//! `stowage doctor`: check (and with --repair, fix) the store.

use anyhow::Result;

use super::duration::TimeOption;
use crate::doctor::{self, Verdict};
use crate::error::code;
use crate::ident::STOWAGE;
use crate::store::Store;

#[derive(clap::Args)]
#[command(
    after_help = "Exit status: 0 healthy (or fully repaired); 1 problems remain (including a store\n\
    you may not write, and a root that does not exist: nothing is created);\n\
    69 flock does not work, or is not safe, on the root's filesystem."
)]
pub struct Args {
    /// Fix what is safe to fix, and say what was done
    #[arg(long)]
    repair: bool,
    /// Print a JSON report
    #[arg(long)]
    json: bool,
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true,
        conflicts_with_all = ["repair", "json"], help = concat!(
        "Hold a probe lock for SECONDS (fractional, or with a unit of ", time_units!(),
        ": 30, 10m), for 'stowage doctor' on another host sharing the root to see: the two-host \
        check that locks reach across"))]
    hold_probe: Option<String>,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    if let Some(raw) = &args.hold_probe {
        let secs = TimeOption::HoldProbe.parse(raw)?;
        return doctor::hold_probe(store, secs).map(|()| 0);
    }
    let report = match doctor::run(store, args.repair) {
        // A problem doctor finds (it exits 0, 1 or 69), not a missing image's 66.
        Err(e)
            if matches!(
                crate::error::typed(&e),
                Some(crate::Error::NoRoot { .. } | crate::Error::NotAStore { .. })
            ) =>
        {
            complain!("stowage: {}", super::init::with_refusal(e));
            return Ok(code::FAILURE);
        }
        other => other?,
    };
    if args.json {
        super::print_json(&report)?;
    } else {
        let root = crate::ident::printable(&report.root);
        let mut out = format!("root {root} ({})\n", report.filesystem);
        for c in &report.checks {
            let tag = match c.status {
                Verdict::Ok => "ok",
                Verdict::Info => "note",
                Verdict::Problem => "PROBLEM",
                Verdict::Repaired => "repaired",
            };
            let detail = crate::error::without_errno(&crate::ident::printable(&c.detail));
            out.push_str(&format!("{tag:>8}  {:<10}  {detail}\n", c.check));
        }
        // (A repair needs write access: no advice to someone without it.)
        let writable = !report.checks.iter().any(|c| c.check == "access");
        if report.repairable && !args.repair && report.locking && writable {
            out.push_str(&format!(
                "run '{STOWAGE} doctor --repair' to fix what is safe to fix\n"
            ));
        }
        super::print(&out)?;
    }
    Ok(match (report.locking, report.healthy) {
        (false, _) => code::UNAVAILABLE,
        (true, true) => 0,
        (true, false) => code::FAILURE,
    })
}
