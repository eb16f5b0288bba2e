//! Whole processes: running a command and timing it, paired alternating
//! runs of two commands, and many concurrent builders.

use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::stats::ratios;

/// The binary under test: `--stowage PATH`, else the one cargo built.
pub static STOWAGE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

pub fn stowage_bin() -> &'static Path {
    STOWAGE
        .get()
        .map_or(Path::new(env!("CARGO_BIN_EXE_stowage")), |p| p.as_path())
}

/// A command line, run as often as needed with its output discarded.
#[derive(Clone, Debug)]
pub struct Cmd {
    program: OsString,
    args: Vec<OsString>,
}

impl Cmd {
    pub fn new(program: impl AsRef<OsStr>) -> Cmd {
        Cmd {
            program: program.as_ref().to_owned(),
            args: Vec::new(),
        }
    }

    /// `stowage --root ROOT ARGS…`
    pub fn stowage(root: &Path) -> Cmd {
        Cmd::new(stowage_bin()).arg("--root").arg(root)
    }

    /// `stowage --root ROOT exec --read IMG -- true`: a build that reads
    /// one base image and does nothing else.
    pub fn exec_read(root: &Path, image: &str) -> Cmd {
        Cmd::stowage(root).args(["exec", "--read", image, "--", "true"])
    }

    /// `flock -s LOCKFILE true`: the same, with util-linux flock(1).
    pub fn flock_read(lock_file: &Path) -> Cmd {
        Cmd::new("flock").arg("-s").arg(lock_file).arg("true")
    }

    pub fn arg(mut self, a: impl AsRef<OsStr>) -> Cmd {
        self.args.push(a.as_ref().to_owned());
        self
    }

    pub fn args<S: AsRef<OsStr>>(mut self, a: impl IntoIterator<Item = S>) -> Cmd {
        self.args
            .extend(a.into_iter().map(|s| s.as_ref().to_owned()));
        self
    }

    pub fn command(&self) -> Command {
        let mut c = Command::new(&self.program);
        c.args(&self.args)
            .env_remove("STOWAGE_ROOT")
            .env_remove("STOWAGE_HOSTNAME")
            .env_remove("STOWAGE_NOW");
        c
    }

    pub fn shown(&self) -> String {
        std::iter::once(&self.program)
            .chain(&self.args)
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Runs the command to completion and returns its wall time. A failure
    /// ends the bench: every figure after it would be meaningless.
    pub fn time(&self) -> Result<f64> {
        let mut c = self.command();
        c.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let t0 = Instant::now();
        let status = c.status()?;
        let took = t0.elapsed().as_secs_f64();
        if !status.success() {
            let out = self.command().stdin(Stdio::null()).output()?;
            bail!(
                "{} failed ({status}); run again: {}{}",
                self.shown(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim_end()
            );
        }
        Ok(took)
    }

    /// Runs the command to completion and returns its wall time and the
    /// CPU time of its whole process tree (user + system, every descendant
    /// it waited for). Only meaningful while no other child of this
    /// process finishes at the same time.
    pub fn time_cpu(&self) -> Result<(f64, f64)> {
        let before = children_cpu();
        let wall = self.time()?;
        Ok((wall, children_cpu() - before))
    }

    /// Runs once and insists on success (setup steps).
    pub fn ok(&self) -> Result<()> {
        let out = self.command().stdin(Stdio::null()).output()?;
        if !out.status.success() {
            bail!(
                "{} failed ({}): {}",
                self.shown(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim_end()
            );
        }
        Ok(())
    }
}

/// CPU time (user + system) of every child this process has reaped, and
/// of their descendants that they reaped.
fn children_cpu() -> f64 {
    // SAFETY: a zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the rusage we pass.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

/// Wall and CPU times of paired runs: `a[i]` and `b[i]` ran back to back,
/// in alternating order, so slow stretches of a noisy machine hit both.
pub struct Paired {
    pub a: Vec<f64>,
    pub b: Vec<f64>,
    pub a_cpu: Vec<f64>,
    pub b_cpu: Vec<f64>,
}

impl Paired {
    pub fn ratios(&self) -> Vec<f64> {
        ratios(&self.a, &self.b)
    }
}

pub fn paired(a: &Cmd, b: &Cmd, pairs: usize, warmup: usize) -> Result<Paired> {
    for _ in 0..warmup {
        a.time()?;
        b.time()?;
    }
    let mut p = Paired {
        a: Vec::with_capacity(pairs),
        b: Vec::with_capacity(pairs),
        a_cpu: Vec::with_capacity(pairs),
        b_cpu: Vec::with_capacity(pairs),
    };
    for i in 0..pairs {
        let (ra, rb) = if i % 2 == 0 {
            let ra = a.time_cpu()?;
            (ra, b.time_cpu()?)
        } else {
            let rb = b.time_cpu()?;
            (a.time_cpu()?, rb)
        };
        p.a.push(ra.0);
        p.a_cpu.push(ra.1);
        p.b.push(rb.0);
        p.b_cpu.push(rb.1);
    }
    Ok(p)
}

/// One run of a concurrent load: `builders` threads each run the command
/// `iters` times in a row, all starting together.
pub struct Load {
    pub wall: f64,
    /// CPU time of every process the load ran, per run.
    pub cpu_per_run: f64,
    /// Every run's wall time, from every builder.
    pub latencies: Vec<f64>,
}

impl Load {
    pub fn throughput(&self) -> f64 {
        self.latencies.len() as f64 / self.wall
    }
}

pub fn load(cmd: &Cmd, builders: usize, iters: usize) -> Result<Load> {
    let start = Barrier::new(builders);
    let cpu0 = children_cpu();
    // Each builder notes when it started and finished: with more builders
    // than CPUs, a coordinating thread may run late and read the clock
    // after much of the work is done.
    let results: Vec<_> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..builders)
            .map(|_| {
                s.spawn(|| -> Result<(Instant, Vec<f64>, Instant)> {
                    start.wait();
                    let t0 = Instant::now();
                    let runs = (0..iters).map(|_| cmd.time()).collect::<Result<_>>()?;
                    Ok((t0, runs, Instant::now()))
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("builder thread panicked"))
            .collect()
    });
    let cpu = children_cpu() - cpu0;
    let mut latencies = Vec::with_capacity(builders * iters);
    let mut first: Option<Instant> = None;
    let mut last: Option<Instant> = None;
    for r in results {
        let (t0, runs, t1) = r?;
        first = Some(first.map_or(t0, |f| f.min(t0)));
        last = Some(last.map_or(t1, |l| l.max(t1)));
        latencies.extend(runs);
    }
    let wall = match (first, last) {
        (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
        _ => bail!("no builders"),
    };
    Ok(Load {
        wall,
        cpu_per_run: cpu / latencies.len() as f64,
        latencies,
    })
}

/// Waits (bounded) until `path` exists: how background processes say they
/// are ready.
pub fn await_file(path: &Path, what: &str) -> Result<()> {
    let give_up = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        if Instant::now() > give_up {
            bail!(
                "timed out waiting for {what} ({} never appeared)",
                path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// The kernel's id of a file in /proc/locks: `MAJ:MIN:INODE`.
fn lock_table_id(path: &Path) -> Result<String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok(format!(
        "{:02x}:{:02x}:{}",
        libc::major(m.dev()),
        libc::minor(m.dev()),
        m.ino()
    ))
}

/// How many blocked flock requests wait on `path` right now.
pub fn blocked_on(path: &Path) -> Result<usize> {
    let id = lock_table_id(path)?;
    let table = std::fs::read_to_string("/proc/locks")?;
    Ok(table
        .lines()
        .filter(|l| l.contains(" -> FLOCK ") && l.split_whitespace().any(|f| f == id))
        .count())
}

/// Waits (bounded) until someone is blocked on `path` and stays blocked for
/// a moment — stowage's first attempt can block briefly before it records
/// itself as a waiter and blocks for good.
pub fn await_blocked(path: &Path) -> Result<()> {
    let give_up = Instant::now() + Duration::from_secs(60);
    let mut since: Option<Instant> = None;
    loop {
        if blocked_on(path)? > 0 {
            let t = *since.get_or_insert_with(Instant::now);
            if t.elapsed() >= Duration::from_millis(100) {
                return Ok(());
            }
        } else {
            since = None;
        }
        if Instant::now() > give_up {
            bail!("timed out waiting for a blocked lock on {}", path.display());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
