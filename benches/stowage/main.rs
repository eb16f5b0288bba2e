//! The performance targets of the spec, measured in one run.
//!
//! `bash scripts/bench` builds, runs this and draws the plot; or run
//! `cargo bench --bench stowage -- [--quick] [--images N] [--dir DIR]`.
//!
//! Everything runs in a fresh directory on a tmpfs (/dev/shm) unless
//! `--dir` names another filesystem. Every comparison is paired: the two
//! sides run back to back in alternating order, and the figure is the
//! median of the per-pair ratios, so a noisy neighbour on a shared machine
//! slows both sides of a pair rather than one side of the result. Ratios
//! are the verdicts; absolute times are context, true of this machine only.
//!
//! Sections:
//! - `library`: the raw floor (open+flock+close, flock+unlock) and the
//!   library's image lock and whole sessions against it ([`library`]);
//! - `exec`: `stowage exec` against `flock(1)` as whole processes ([`exec`]);
//! - `builders`: 32 concurrent builders reading one base, and the curve
//!   over 1 … 32 builders ([`exec::concurrent`]);
//! - `images`: init, exec and lock-status with 100,000 images ([`scale`]);
//! - `slots`: slot handover latency and a waiter's CPU use ([`slots`]).

// Tests and benchmarks print where they like; the binary may not (clippy.toml).
#![allow(clippy::disallowed_macros)]

mod exec;
mod floor;
mod library;
mod process;
mod report;
mod scale;
mod slots;
mod stats;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;

use report::Report;

const SECTIONS: &[&str] = &["library", "exec", "builders", "images", "slots"];

const USAGE: &str = "\
usage: cargo bench --bench stowage -- [OPTIONS]   (or: bash scripts/bench [OPTIONS])

  --quick        a smoke run: few iterations, 2,000 images (seconds)
  --images N     images for the scale figures [default: 100000]
  --dir DIR      benchmark on the filesystem of DIR [default: /dev/shm, a tmpfs]
  --out DIR      where results.{json,md,txt} go [default: target/bench]
  --stowage PATH the stowage binary to measure [default: the one cargo built]
                 (scripts/bench measures the static build scripts/install makes)
  --only LIST    run only these sections (comma-separated):
                 library, exec, builders, images, slots
";

struct Options {
    quick: bool,
    images: Option<usize>,
    dir: Option<PathBuf>,
    out: PathBuf,
    only: Vec<String>,
}

fn parse_args(args: &[String]) -> Result<Option<Options>> {
    let mut o = Options {
        quick: false,
        images: None,
        dir: None,
        out: Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench"),
        only: SECTIONS.iter().map(|s| s.to_string()).collect(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .with_context(|| format!("{a} needs a value"))
        };
        match a.as_str() {
            // cargo bench passes --bench to benches without a harness.
            "--bench" => {}
            "--quick" => o.quick = true,
            "--images" => {
                let n: usize = value()?.parse().context("--images: not a number")?;
                if n < 10 {
                    bail!("--images: at least 10 (the busy lock-status case uses several)");
                }
                o.images = Some(n);
            }
            "--dir" => o.dir = Some(PathBuf::from(value()?)),
            "--out" => o.out = PathBuf::from(value()?),
            "--stowage" => {
                let p = PathBuf::from(value()?);
                if !p.is_file() {
                    bail!("--stowage: {} is not a file", p.display());
                }
                let _ = process::STOWAGE.set(p);
            }
            "--only" => {
                let v = value()?;
                o.only = v.split(',').map(str::to_owned).collect();
                if let Some(bad) = o.only.iter().find(|s| !SECTIONS.contains(&s.as_str())) {
                    bail!(
                        "--only: unknown section {bad:?} (sections: {})",
                        SECTIONS.join(", ")
                    );
                }
            }
            "-h" | "--help" => {
                print!("{USAGE}");
                return Ok(None);
            }
            other => bail!("unknown option {other:?}\n{USAGE}"),
        }
    }
    Ok(Some(o))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The slot bench's waiter command: stamp the clock and leave, first of
    // all, so the stamp is as close to the command's start as it gets.
    if let [flag, file] = args.as_slice()
        && flag == "--stamp"
    {
        return match slots::stamp(Path::new(file)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(_) => ExitCode::FAILURE,
        };
    }
    // `cargo test --benches` runs bench binaries without --bench: these
    // figures take minutes and assert nothing, so do nothing then.
    if !args
        .iter()
        .any(|a| a == "--bench" || a == "-h" || a == "--help")
    {
        println!(
            "stowage bench: run it with 'cargo bench --bench stowage' or 'bash scripts/bench'"
        );
        return ExitCode::SUCCESS;
    }
    match parse_args(&args).and_then(|o| o.map_or(Ok(()), run)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stowage bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(o: Options) -> Result<()> {
    let started = Instant::now();
    let base = match &o.dir {
        Some(d) => d.clone(),
        None if Path::new("/dev/shm").is_dir() => PathBuf::from("/dev/shm"),
        None => {
            eprintln!("stowage bench: no /dev/shm here; using the temporary directory");
            std::env::temp_dir()
        }
    };
    let tmp = tempfile::Builder::new()
        .prefix("stowage-bench.")
        .tempdir_in(&base)
        .with_context(|| format!("cannot make a directory in {}", base.display()))?;
    let dir = tmp.path();
    let fs = stowage::filesystem::filesystem(dir).map_or_else(|_| "unknown".into(), |f| f.name);
    let q = o.quick;
    let images = o.images.unwrap_or(if q { 2_000 } else { 100_000 });

    let mut report = Report {
        meta: machine(dir, &fs),
        ..Report::default()
    };
    report.meta.insert(
        "options".into(),
        json!({"quick": q, "images": images, "sections": o.only}),
    );
    eprintln!(
        "stowage bench: {} on {fs} ({}), {images} images{}",
        dir.display(),
        report.meta["cpu"].as_str().unwrap_or("?"),
        if q { ", quick" } else { "" }
    );
    let on = |s: &str| o.only.iter().any(|x| x == s);

    if on("library") {
        eprintln!("== raw floor and library");
        library::run(
            dir,
            &library::Plan {
                batches: if q { 5 } else { 15 },
                ops: if q { 10_000 } else { 40_000 },
                session_batches: if q { 3 } else { 9 },
                session_ops: if q { 50 } else { 200 },
            },
            &mut report,
        )?;
    }
    let plan = exec::Plan {
        pairs: if q { 30 } else { 400 },
        warmup: if q { 3 } else { 10 },
        breakdown_rounds: if q { 10 } else { 100 },
        rounds: if q { 2 } else { 9 },
        iters: if q { 3 } else { 20 },
        levels: vec![1, 2, 4, 8, 16],
        curve_ops: if q { 16 } else { 128 },
        curve_rounds: if q { 1 } else { 5 },
    };
    if on("exec") || on("builders") {
        let (root, lock) = exec::setup(dir)?;
        if on("exec") {
            eprintln!("== exec vs flock(1), one at a time");
            exec::single(&root, &lock, &plan, &mut report)?;
        }
        if on("builders") {
            eprintln!("== concurrent builders");
            exec::concurrent(&root, &lock, &plan, &mut report)?;
        }
    }
    if on("images") {
        eprintln!("== {images} images");
        scale::run(
            dir,
            &scale::Plan {
                images,
                pairs: if q { 20 } else { 200 },
                warmup: if q { 2 } else { 10 },
                status_runs: if q { 3 } else { 15 },
                curve_rounds: if q { 5 } else { 40 },
            },
            &mut report,
        )?;
    }
    if on("slots") {
        eprintln!("== slots");
        slots::run(
            dir,
            &slots::Plan {
                rounds: if q { 5 } else { 20 },
                cpu_wait: Duration::from_secs(if q { 1 } else { 2 }),
            },
            &mut report,
        )?;
    }

    let took = started.elapsed().as_secs_f64();
    report.meta.insert("bench_seconds".into(), json!(took));
    let text = report.text();
    println!("\n{text}");
    let failures = report.failures();
    println!(
        "{} of {} targets met; the run took {}",
        report.targets.len() - failures,
        report.targets.len(),
        report::time(took)
    );
    std::fs::create_dir_all(&o.out)?;
    let summary = summary(&report);
    std::fs::write(
        o.out.join("results.json"),
        serde_json::to_string_pretty(&report.json())?,
    )?;
    std::fs::write(
        o.out.join("results.md"),
        format!("{summary}\n\n{}", report.markdown()),
    )?;
    std::fs::write(o.out.join("results.txt"), format!("{summary}\n\n{text}"))?;
    println!("results: {}", o.out.join("results.json").display());
    eprintln!("cleaning up {}", dir.display());
    Ok(())
}

/// What the figures were measured on.
fn machine(dir: &Path, fs: &str) -> serde_json::Map<String, serde_json::Value> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or_else(|| "unknown".to_owned(), |(_, m)| m.trim().to_owned());
    let first_line = |prog: &str, args: &[&str]| {
        std::process::Command::new(prog)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .map(str::to_owned)
            })
    };
    let repo = env!("CARGO_MANIFEST_DIR");
    let mut m = serde_json::Map::new();
    m.insert(
        "cpus".into(),
        json!(std::thread::available_parallelism().map_or(0, |n| n.get())),
    );
    m.insert("cpu".into(), json!(cpu));
    m.insert(
        "kernel".into(),
        json!(read("/proc/sys/kernel/osrelease").trim()),
    );
    m.insert("filesystem".into(), json!(fs));
    m.insert("dir".into(), json!(dir.display().to_string()));
    m.insert("stowage".into(), json!(env!("CARGO_PKG_VERSION")));
    m.insert(
        "commit".into(),
        json!(first_line(
            "git",
            &["-C", repo, "describe", "--always", "--dirty"]
        )),
    );
    m.insert("flock".into(), json!(first_line("flock", &["--version"])));
    let bin = process::stowage_bin();
    let linking = first_line("file", &["-b", &bin.display().to_string()]).map(|f| {
        if f.contains("static") {
            "static"
        } else {
            "dynamic"
        }
        .to_owned()
    });
    m.insert("binary".into(), json!(bin.display().to_string()));
    m.insert("linking".into(), json!(linking));
    m.insert(
        "date".into(),
        json!(stowage::clock::rfc3339(stowage::clock::now_ms())),
    );
    m
}

fn summary(r: &Report) -> String {
    let m = &r.meta;
    let s = |k: &str| m.get(k).map(|v| v.to_string().trim_matches('"').to_owned());
    format!(
        "stowage {} ({}, {} build) on {} CPUs ({}), Linux {}, {} at {}; {}; {} images{}",
        s("stowage").unwrap_or_default(),
        s("commit").unwrap_or_default(),
        s("linking").unwrap_or_default(),
        s("cpus").unwrap_or_default(),
        s("cpu").unwrap_or_default(),
        s("kernel").unwrap_or_default(),
        s("filesystem").unwrap_or_default(),
        s("dir").unwrap_or_default(),
        s("date").unwrap_or_default(),
        m["options"]["images"],
        if m["options"]["quick"] == json!(true) {
            " (quick run)"
        } else {
            ""
        }
    )
}
