//! `stowage exec` as a whole process against util-linux flock(1) taking
//! the same lock: one at a time (paired, alternating runs) and under many
//! concurrent builders reading one base image.

use std::path::{Path, PathBuf};

use anyhow::Result;
use serde_json::json;

use crate::process::{Cmd, load, paired};
use crate::report::{Bound, Report, Unit, time};
use crate::stats::{median, p95, ratios};

pub struct Plan {
    pub pairs: usize,
    pub warmup: usize,
    /// Rounds of the per-process breakdown.
    pub breakdown_rounds: usize,
    /// Paired rounds of the 32-builder load, and runs per builder.
    pub rounds: usize,
    pub iters: usize,
    /// Builder counts for the curve (32 comes from the rounds above),
    /// commands per round at each count, and rounds per count.
    pub levels: Vec<usize>,
    pub curve_ops: usize,
    pub curve_rounds: usize,
}

pub const BUILDERS: usize = 32;

/// A root with one ready image, `base`; returns the root and the image's
/// lock file, which flock(1) takes in the comparison.
pub fn setup(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let root = dir.join("exec-root");
    Cmd::stowage(&root)
        .args(["exec", "--write", "base", "--", "true"])
        .ok()?;
    let lock = root.join("locks/images/base.lock");
    Ok((root, lock))
}

pub fn single(root: &Path, lock: &Path, plan: &Plan, report: &mut Report) -> Result<()> {
    let stow = Cmd::exec_read(root, "base");
    let flock = Cmd::flock_read(lock);
    let p = paired(&stow, &flock, plan.pairs, plan.warmup)?;
    report.target(
        "exec_vs_flock",
        "exec --read base -- true vs flock -s LOCK true (whole process)",
        median(&p.ratios()),
        Unit::Ratio,
        Bound::AtMost(1.2),
        format!(
            "median of {} paired, alternating runs; exec {} vs flock(1) {}",
            plan.pairs,
            time(median(&p.a)),
            time(median(&p.b))
        ),
    );
    report.context(
        "exec_wall",
        "exec --read base -- true, wall time",
        median(&p.a),
        Unit::Seconds,
        format!("median of {}; p95 {}", plan.pairs, time(p95(&p.a))),
    );
    report.context(
        "flock_wall",
        "flock -s LOCK true, wall time",
        median(&p.b),
        Unit::Seconds,
        format!("median of {}; p95 {}", plan.pairs, time(p95(&p.b))),
    );
    report.context(
        "exec_minus_flock",
        "exec overhead over flock(1) (difference of medians)",
        median(&p.a) - median(&p.b),
        Unit::Seconds,
        "the cost stowage adds per build".to_owned(),
    );
    report.context(
        "exec_cpu",
        "exec --read base -- true, CPU time (whole process tree)",
        median(&p.a_cpu),
        Unit::Seconds,
        format!(
            "median of {}; flock(1) {}: {:.2}× the CPU",
            plan.pairs,
            time(median(&p.b_cpu)),
            median(&p.a_cpu) / median(&p.b_cpu)
        ),
    );
    write(root, lock, plan, report)?;
    new_image(root, lock, plan, report)?;
    breakdown(root, lock, plan, report)
}

/// A write of a new image each time (no transaction either: docs/design.md,
/// "New images without the database") against flock(1) taking a lock
/// exclusively. Context, not a target. In a root of its own: the markers
/// these writes leave are folded by the next transaction, which would
/// weigh on whatever is measured after them.
fn new_image(root: &Path, lock: &Path, plan: &Plan, report: &mut Report) -> Result<()> {
    let own = root.with_file_name("new-images-root");
    Cmd::stowage(&own)
        .args(["exec", "--write", "base", "--", "true"])
        .ok()?;
    let flock = Cmd::new("flock").arg("-x").arg(lock).arg("true");
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..plan.warmup + plan.pairs {
        let name = format!("new{i}");
        let stow = Cmd::stowage(&own).args(["exec", "--write", &name, "--", "true"]);
        // Alternating which goes first, as `paired` does.
        let (ta, tb) = if i % 2 == 0 {
            let ta = stow.time()?;
            (ta, flock.time()?)
        } else {
            let tb = flock.time()?;
            (stow.time()?, tb)
        };
        if i >= plan.warmup {
            a.push(ta);
            b.push(tb);
        }
    }
    report.context(
        "exec_new_vs_flock",
        "exec --write NEW -- true (a new image each run) vs flock -x LOCK true",
        median(&ratios(&a, &b)),
        Unit::Ratio,
        format!(
            "median of {} paired, alternating runs; exec {} vs flock(1) {}",
            plan.pairs,
            time(median(&a)),
            time(median(&b))
        ),
    );
    Ok(())
}

/// A rewrite of an existing image (no transaction: docs/design.md,
/// "Writes without the database") against flock(1) taking the lock
/// exclusively. Context, not a target: the contract's 1.2× is for reads.
/// Its marker is folded by the next transaction, which this loop never
/// makes: every run after the first finds it there already.
fn write(root: &Path, lock: &Path, plan: &Plan, report: &mut Report) -> Result<()> {
    let stow = Cmd::stowage(root).args(["exec", "--write", "base", "--", "true"]);
    let flock = Cmd::new("flock").arg("-x").arg(lock).arg("true");
    let p = paired(&stow, &flock, plan.pairs, plan.warmup)?;
    report.context(
        "exec_write_vs_flock",
        "exec --write base -- true (existing image) vs flock -x LOCK true",
        median(&p.ratios()),
        Unit::Ratio,
        format!(
            "median of {} paired, alternating runs; exec {} vs flock(1) {}",
            plan.pairs,
            time(median(&p.a)),
            time(median(&p.b))
        ),
    );
    Ok(())
}

/// Where an exec's time goes, process by process: the command alone, the
/// stowage binary starting and exiting, exec without any image (database
/// and transactions), exec with one image, and flock(1). Interleaved
/// round-robin, medians of each.
fn breakdown(root: &Path, lock: &Path, plan: &Plan, report: &mut Report) -> Result<()> {
    let steps = [
        ("true", "the command alone: true", Cmd::new("true")),
        (
            "version",
            "stowage --version (binary start and exit)",
            Cmd::new(crate::process::stowage_bin()).arg("--version"),
        ),
        (
            "exec_no_image",
            "stowage exec -- true (no image: database, two transactions)",
            Cmd::stowage(root).args(["exec", "--", "true"]),
        ),
        (
            "exec_read",
            "stowage exec --read base -- true",
            Cmd::exec_read(root, "base"),
        ),
        ("flock", "flock -s LOCK true", Cmd::flock_read(lock)),
    ];
    let mut wall = vec![Vec::new(); steps.len()];
    let mut cpu = vec![Vec::new(); steps.len()];
    for r in 0..plan.breakdown_rounds {
        for k in 0..steps.len() {
            let i = (k + r) % steps.len();
            let (w, c) = steps[i].2.time_cpu()?;
            wall[i].push(w);
            cpu[i].push(c);
        }
    }
    for (i, (id, what, _)) in steps.iter().enumerate() {
        report.context(
            &format!("breakdown_{id}"),
            format!("breakdown: {what}"),
            median(&wall[i]),
            Unit::Seconds,
            format!(
                "median of {}, interleaved; CPU {}",
                wall[i].len(),
                time(median(&cpu[i]))
            ),
        );
    }
    Ok(())
}

/// Per-pair CPU ratios flock(1) / exec, from a few sequential pairs.
fn cpu_ratio(root: &Path, lock: &Path) -> Result<Vec<f64>> {
    let p = paired(&Cmd::exec_read(root, "base"), &Cmd::flock_read(lock), 20, 2)?;
    Ok(ratios(&p.b_cpu, &p.a_cpu))
}

/// One point of the concurrency curve.
struct Point {
    builders: usize,
    stowage: Vec<f64>,
    flock: Vec<f64>,
    stowage_lat: Vec<f64>,
    flock_lat: Vec<f64>,
    stowage_cpu: Vec<f64>,
    flock_cpu: Vec<f64>,
}

/// Paired rounds of the same load under stowage and under flock(1).
fn rounds(stow: &Cmd, flock: &Cmd, builders: usize, iters: usize, n: usize) -> Result<Point> {
    let mut p = Point {
        builders,
        stowage: Vec::new(),
        flock: Vec::new(),
        stowage_lat: Vec::new(),
        flock_lat: Vec::new(),
        stowage_cpu: Vec::new(),
        flock_cpu: Vec::new(),
    };
    for i in 0..n {
        let (s, f) = if i % 2 == 0 {
            let s = load(stow, builders, iters)?;
            (s, load(flock, builders, iters)?)
        } else {
            let f = load(flock, builders, iters)?;
            (load(stow, builders, iters)?, f)
        };
        p.stowage.push(s.throughput());
        p.flock.push(f.throughput());
        p.stowage_cpu.push(s.cpu_per_run);
        p.flock_cpu.push(f.cpu_per_run);
        p.stowage_lat.extend(s.latencies);
        p.flock_lat.extend(f.latencies);
    }
    Ok(p)
}

pub fn concurrent(root: &Path, lock: &Path, plan: &Plan, report: &mut Report) -> Result<()> {
    let stow = Cmd::exec_read(root, "base");
    let flock = Cmd::flock_read(lock);
    let top = rounds(&stow, &flock, BUILDERS, plan.iters, plan.rounds)?;
    let r: Vec<f64> = top
        .stowage
        .iter()
        .zip(&top.flock)
        .map(|(s, f)| s / f)
        .collect();
    report.target(
        "builders32_throughput_vs_flock",
        format!("{BUILDERS} concurrent builders reading one base: throughput vs flock(1)"),
        median(&r),
        Unit::Ratio,
        Bound::AtLeast(0.7),
        format!(
            "median of {} paired rounds of {BUILDERS}×{} runs; {:.0}/s vs {:.0}/s",
            plan.rounds,
            plan.iters,
            median(&top.stowage),
            median(&top.flock)
        ),
    );
    report.context(
        "builders32_cpu_bound",
        "CPU per build, flock(1) / exec, one at a time: the throughput ratio's ceiling on saturated CPUs",
        median(&cpu_ratio(root, lock)?),
        Unit::Ratio,
        format!(
            "median of 20 paired runs; {} CPUs",
            std::thread::available_parallelism().map_or(0, |n| n.get())
        ),
    );
    report.context(
        "builders32_cpu",
        format!("CPU per exec under {BUILDERS} builders"),
        median(&top.stowage_cpu),
        Unit::Seconds,
        format!(
            "median of {} rounds; flock(1) {}: flock(1) / exec {:.2}×",
            plan.rounds,
            time(median(&top.flock_cpu)),
            median(&top.flock_cpu) / median(&top.stowage_cpu)
        ),
    );
    report.context(
        "builders32_exec_latency",
        format!("exec wall time under {BUILDERS} builders"),
        median(&top.stowage_lat),
        Unit::Seconds,
        format!(
            "median of {} runs; p95 {}; flock(1) {}",
            top.stowage_lat.len(),
            time(p95(&top.stowage_lat)),
            time(median(&top.flock_lat))
        ),
    );

    let mut points = Vec::new();
    for &b in &plan.levels {
        let iters = (plan.curve_ops / b).max(1);
        eprintln!(
            "    {b} builder(s) × {iters} runs × {} rounds",
            plan.curve_rounds
        );
        points.push(rounds(&stow, &flock, b, iters, plan.curve_rounds)?);
    }
    points.push(top);
    let series: Vec<_> = points
        .iter()
        .map(|p| {
            json!({
                "builders": p.builders,
                "stowage_per_s": median(&p.stowage),
                "flock_per_s": median(&p.flock),
                "stowage_latency_s": median(&p.stowage_lat),
                "flock_latency_s": median(&p.flock_lat),
                "stowage_latency_p95_s": p95(&p.stowage_lat),
                "flock_latency_p95_s": p95(&p.flock_lat),
                "stowage_cpu_s": median(&p.stowage_cpu),
                "flock_cpu_s": median(&p.flock_cpu),
            })
        })
        .collect();
    report
        .series
        .insert("exec_vs_builders".into(), json!(series));
    Ok(())
}
