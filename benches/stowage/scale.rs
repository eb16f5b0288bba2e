//! Cost against the number of images: `init` adopting N existing image
//! directories, `exec` with N images against one image, `lock-status` with
//! N images (idle, and with a handful of locks held and awaited), and the
//! exec curve over 1 … N images.
//!
//! `lock-status` is measured twice: right after adoption, when no image has
//! a lock file yet, and once every image has one — a store where every image
//! has been used at least once, which is the harder case for anything that
//! lists the lock directory.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde_json::json;

use crate::process::{Cmd, await_blocked, await_file, paired};
use crate::report::{Bound, Report, Unit, time};
use crate::stats::{median, quantile};

pub struct Plan {
    pub images: usize,
    pub pairs: usize,
    pub warmup: usize,
    pub status_runs: usize,
    pub curve_rounds: usize,
}

pub fn image_name(i: usize) -> String {
    format!("img{i:06}")
}

/// The image counts of the curve: 1, powers of ten below N, and N.
fn sizes(n: usize) -> Vec<usize> {
    let mut v = vec![1];
    let mut p = 1000;
    while p < n {
        v.push(p);
        p *= 10;
    }
    if n > 1 {
        v.push(n);
    }
    v
}

struct Store {
    images: usize,
    root: PathBuf,
    init: f64,
}

/// A root whose images directory holds `n` image directories (not yet
/// known to stowage), then `stowage init` adopting them, timed.
fn adopted(dir: &Path, n: usize) -> Result<Store> {
    let root = dir.join(format!("images-{n}"));
    let img = root.join("img");
    fs::create_dir_all(&img)?;
    let t0 = Instant::now();
    for i in 1..=n {
        fs::create_dir(img.join(image_name(i)))?;
    }
    eprintln!(
        "    {n} image directories made in {}",
        time(t0.elapsed().as_secs_f64())
    );
    let init = Cmd::stowage(&root).arg("init").time()?;
    eprintln!("    init adopted {n} in {}", time(init));
    Ok(Store {
        images: n,
        root,
        init,
    })
}

/// Gives every image a lock file, as using each image once would.
fn lock_every_image(store: &Store) -> Result<()> {
    let locks = store.root.join("locks/images");
    fs::create_dir_all(&locks)?;
    for i in 1..=store.images {
        let p = locks.join(format!("{}.lock", image_name(i)));
        if !p.exists() {
            fs::File::create(p)?;
        }
    }
    Ok(())
}

/// A handful of parties on one root: three readers (two sharing one
/// image), a writer, a flock(1) holder outside stowage, and a writer
/// waiting for a read-locked image. Each one's command blocks reading its
/// stdin, so closing the pipes releases everything.
struct Busy {
    children: Vec<(String, Child)>,
}

impl Busy {
    fn start(root: &Path, scratch: &Path) -> Result<Busy> {
        let _ = fs::remove_dir_all(scratch);
        fs::create_dir_all(scratch)?;
        let hold = "touch \"$0\"; exec cat";
        let mut busy = Busy {
            children: Vec::new(),
        };
        let mut sentinels = Vec::new();
        let parties: Vec<(String, Cmd)> = vec![
            ("read 1".into(), exec_hold(root, "--read", &image_name(1))),
            ("read 2".into(), exec_hold(root, "--read", &image_name(2))),
            ("read 2'".into(), exec_hold(root, "--read", &image_name(2))),
            ("write 3".into(), exec_hold(root, "--write", &image_name(3))),
            (
                "flock(1) 4".into(),
                Cmd::new("flock")
                    .arg("-s")
                    .arg(root.join(format!("locks/images/{}.lock", image_name(4))))
                    .args(["sh", "-c"]),
            ),
        ];
        for (k, (what, cmd)) in parties.into_iter().enumerate() {
            let s = scratch.join(format!("held-{k}"));
            let cmd = cmd.arg(hold).arg(&s);
            busy.spawn(what, &cmd)?;
            sentinels.push(s);
        }
        for s in &sentinels {
            await_file(s, "a lock holder to start")?;
        }
        // Waits for reader 1: a waiter record, and a blocked request.
        busy.spawn(
            "waiting write 1".into(),
            &Cmd::stowage(root).args(["exec", "--write", &image_name(1), "--", "cat"]),
        )?;
        await_blocked(&root.join(format!("locks/images/{}.lock", image_name(1))))?;
        Ok(busy)
    }

    fn spawn(&mut self, what: String, cmd: &Cmd) -> Result<()> {
        let child = cmd
            .command()
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.children.push((what, child));
        Ok(())
    }

    fn release(mut self) -> Result<()> {
        for (_, c) in &mut self.children {
            drop(c.stdin.take());
        }
        let give_up = Instant::now() + Duration::from_secs(60);
        for (what, c) in &mut self.children {
            loop {
                if let Some(status) = c.try_wait()? {
                    if !status.success() {
                        bail!("lock holder '{what}' failed: {status}");
                    }
                    break;
                }
                if Instant::now() > give_up {
                    let _ = c.kill();
                    bail!("lock holder '{what}' did not finish");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Ok(())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            if c.try_wait().ok().flatten().is_none() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn exec_hold(root: &Path, flag: &str, image: &str) -> Cmd {
    Cmd::stowage(root).args(["exec", flag, image, "--", "sh", "-c"])
}

/// Median wall time of `runs` runs (after one warm-up).
fn median_of(cmd: &Cmd, runs: usize) -> Result<Vec<f64>> {
    cmd.time()?;
    (0..runs).map(|_| cmd.time()).collect()
}

/// `lock-status` and `lock-status --json` on `store`, idle and busy.
fn status_figures(
    store: &Store,
    scratch: &Path,
    state: &str,
    runs: usize,
) -> Result<Vec<(String, Vec<f64>)>> {
    let plain = Cmd::stowage(&store.root).arg("lock-status");
    let json = Cmd::stowage(&store.root).args(["lock-status", "--json"]);
    let mut out = Vec::new();
    out.push((
        format!("lock-status, idle, {state}"),
        median_of(&plain, runs)?,
    ));
    out.push((
        format!("lock-status --json, idle, {state}"),
        median_of(&json, runs)?,
    ));
    let busy = Busy::start(&store.root, scratch)?;
    out.push((
        format!("lock-status, 6 parties, {state}"),
        median_of(&plain, runs)?,
    ));
    out.push((
        format!("lock-status --json, 6 parties, {state}"),
        median_of(&json, runs)?,
    ));
    busy.release()?;
    Ok(out)
}

pub fn run(dir: &Path, plan: &Plan, report: &mut Report) -> Result<()> {
    let n = plan.images;
    let mut stores = Vec::new();
    for size in sizes(n) {
        stores.push(adopted(dir, size)?);
    }
    let big = stores.last().expect("at least one size");
    let one = &stores[0];
    report.target(
        "init_adopt",
        format!("init adopting {n} existing image directories"),
        big.init,
        Unit::Seconds,
        Bound::AtMost(10.0),
        "one run on a fresh root (database created in the same run)".to_owned(),
    );
    let scratch = dir.join("busy");

    eprintln!("    lock-status with {n} adopted images (no lock files yet)");
    let fresh = status_figures(big, &scratch, "images never locked", plan.status_runs)?;
    for s in &stores {
        lock_every_image(s)?;
    }
    eprintln!("    lock-status with {n} images, each with a lock file");
    let used = status_figures(
        big,
        &scratch,
        "every image has a lock file",
        plan.status_runs,
    )?;

    // The hardest realistic case is the target; the others are context.
    let how = |v: &[f64]| format!("median of {}; max {}", v.len(), time(quantile(v, 1.0)));
    for (k, (what, v)) in used.iter().enumerate() {
        if k >= 2 {
            report.target(
                &format!(
                    "lock_status_{}",
                    if what.contains("--json") {
                        "json"
                    } else {
                        "text"
                    }
                ),
                format!("{what}, {n} images"),
                median(v),
                Unit::Seconds,
                Bound::AtMost(0.2),
                how(v),
            );
        }
    }
    for (what, v) in used.iter().take(2).chain(&fresh) {
        report.context(
            &format!("status: {what}"),
            format!("{what}, {n} images"),
            median(v),
            Unit::Seconds,
            how(v),
        );
    }

    eprintln!("    exec with {n} images vs 1 image");
    let image = image_name(1);
    let p = paired(
        &Cmd::exec_read(&big.root, &image),
        &Cmd::exec_read(&one.root, &image),
        plan.pairs,
        plan.warmup,
    )?;
    report.target(
        "exec_n_vs_1",
        format!("exec with {n} images vs with 1 image"),
        median(&p.ratios()),
        Unit::Ratio,
        Bound::AtMost(1.1),
        format!(
            "median of {} paired, alternating runs on two roots; {} vs {}",
            plan.pairs,
            time(median(&p.a)),
            time(median(&p.b))
        ),
    );
    report.context(
        "init_adopt_1",
        "init adopting 1 image directory",
        one.init,
        Unit::Seconds,
        "one run on a fresh root".to_owned(),
    );

    // The curve: every root in each round, rotating who goes first, with
    // flock(1) on the one-image root as the reference.
    eprintln!("    exec against the number of images");
    let flock = Cmd::flock_read(&one.root.join(format!("locks/images/{image}.lock")));
    let cmds: Vec<Cmd> = stores
        .iter()
        .map(|s| Cmd::exec_read(&s.root, &image))
        .chain(std::iter::once(flock))
        .collect();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); cmds.len()];
    for c in &cmds {
        c.time()?;
    }
    for r in 0..plan.curve_rounds {
        for k in 0..cmds.len() {
            let i = (k + r) % cmds.len();
            samples[i].push(cmds[i].time()?);
        }
    }
    let flock_times = samples.pop().expect("the flock reference");
    let series: Vec<_> = stores
        .iter()
        .zip(&samples)
        .map(|(s, v)| {
            json!({
                "images": s.images,
                "stowage_s": median(v),
                "stowage_p25_s": quantile(v, 0.25),
                "stowage_p75_s": quantile(v, 0.75),
                "flock_s": median(&flock_times),
                "init_s": s.init,
            })
        })
        .collect();
    report.series.insert("exec_vs_images".into(), json!(series));
    let status: Vec<_> = fresh
        .iter()
        .chain(&used)
        .map(|(what, v)| json!({"what": what, "median_s": median(v), "runs_s": v}))
        .collect();
    report.series.insert("lock_status".into(), json!(status));
    Ok(())
}
