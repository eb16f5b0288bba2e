//! Slot handover: how soon a waiting `stowage exec --slot` runs its command
//! after the slot is freed, and what the waiter costs while it waits.
//!
//! The holder is this process, holding the class's only slot file through
//! the library's lock guard, so the release instant is known exactly: the
//! clock is read just before the guard is dropped (one close(2)). The
//! waiter's command is this bench binary again in `--stamp` mode, which
//! writes the monotonic clock (shared by every process) to a file as soon
//! as it starts. Latency = stamp − release: the kernel waking the waiter,
//! its start transaction, and spawning the command.

use std::fs;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use stowage::lock::{self, Mode};

use crate::process::Cmd;
use crate::report::{Bound, Report, Unit, time};
use crate::stats::{median, p95, quantile};

pub struct Plan {
    pub rounds: usize,
    /// How long the waiter is watched for CPU use.
    pub cpu_wait: Duration,
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process.
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The `--stamp FILE` mode: the waiter's command.
pub fn stamp(file: &Path) -> std::io::Result<()> {
    let now = mono_ns();
    fs::write(file, now.to_string())
}

/// Waits until the slot waiter `pid` waits: it watches the class directory
/// (an inotify descriptor) from just before its last round of tries, so a
/// slot freed from then on wakes it.
fn await_waiting(pid: u32) -> Result<()> {
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let watching = fs::read_dir(format!("/proc/{pid}/fd"))?
            .flatten()
            .filter_map(|e| fs::read_link(e.path()).ok())
            .any(|l| l.to_string_lossy().contains("inotify"));
        if watching {
            // Its last tries come right after the watch is set up.
            std::thread::sleep(Duration::from_millis(20));
            return Ok(());
        }
        if Instant::now() > give_up {
            bail!("the slot waiter {pid} never started waiting");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// CPU time of every live thread of `pid`, in seconds (nanosecond
/// resolution from schedstat, unlike the 10 ms ticks of /proc/PID/stat).
fn cpu_seconds(pid: u32) -> Result<f64> {
    let mut ns: u64 = 0;
    for task in fs::read_dir(format!("/proc/{pid}/task"))? {
        let stat = fs::read_to_string(task?.path().join("schedstat"))?;
        ns += stat
            .split_whitespace()
            .next()
            .and_then(|f| f.parse::<u64>().ok())
            .context("unreadable schedstat")?;
    }
    Ok(ns as f64 / 1e9)
}

/// Reaps `child` and returns its total CPU time (user + system, all
/// threads) from wait4(2).
fn reap_with_cpu(child: Child) -> Result<f64> {
    let give_up = Instant::now() + Duration::from_secs(60);
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waits for our own child; WNOHANG keeps the wait bounded.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut ru) };
        if r == pid {
            break;
        }
        if r < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        if Instant::now() > give_up {
            // SAFETY: signals our own unreaped child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            bail!("the slot waiter did not finish");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("the slot waiter failed (wait status {status})");
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(secs(ru.ru_utime) + secs(ru.ru_stime))
}

pub fn run(dir: &Path, plan: &Plan, report: &mut Report) -> Result<()> {
    let root = dir.join("slots-root");
    Cmd::stowage(&root)
        .args(["slots", "set", "bench", "1"])
        .ok()?;
    let slot_dir = root.join("locks/slots/bench");
    fs::create_dir_all(&slot_dir)?;
    let slot = slot_dir.join("0.lock");
    let scratch = dir.join("stamps");
    fs::create_dir_all(&scratch)?;
    let me = std::env::current_exe()?;

    let waiter = |stamp: &Path| -> Result<Child> {
        Ok(Cmd::stowage(&root)
            .args(["exec", "--slot", "bench", "--"])
            .arg(&me)
            .arg("--stamp")
            .arg(stamp)
            .command()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?)
    };
    let hold = || -> Result<lock::Guard> {
        lock::acquire_no_wait(&slot, Mode::Exclusive, lock::IfMissing::Create)?
            .context("the bench slot is held by someone else")
    };

    let mut latencies = Vec::new();
    let mut waiter_cpu = Vec::new();
    for r in 0..=plan.rounds {
        let stamp_file = scratch.join(format!("stamp-{r}"));
        let guard = hold()?;
        let child = waiter(&stamp_file)?;
        await_waiting(child.id())?;
        let released = mono_ns();
        drop(guard);
        let cpu = reap_with_cpu(child)?;
        let started: u64 = fs::read_to_string(&stamp_file)?.trim().parse()?;
        // Round 0 warms the caches up.
        if r > 0 {
            latencies.push(started.saturating_sub(released) as f64 / 1e9);
            waiter_cpu.push(cpu);
        }
    }
    report.target(
        "slot_handover",
        "slot handover: slot freed → waiting exec's command starts",
        median(&latencies),
        Unit::Seconds,
        Bound::AtMost(0.1),
        format!(
            "median of {} rounds; p95 {}, max {}",
            latencies.len(),
            time(p95(&latencies)),
            time(quantile(&latencies, 1.0))
        ),
    );

    // CPU while waiting: every live thread of the waiting stowage, sampled
    // once it is blocked and again after the wait.
    let guard = hold()?;
    let stamp_file = scratch.join("stamp-cpu");
    let child = waiter(&stamp_file)?;
    await_waiting(child.id())?;
    let pid = child.id();
    let c0 = cpu_seconds(pid)?;
    let t0 = Instant::now();
    std::thread::sleep(plan.cpu_wait);
    let c1 = cpu_seconds(pid)?;
    let waited = t0.elapsed().as_secs_f64();
    drop(guard);
    let total = reap_with_cpu(child)?;
    report.target(
        "slot_waiter_cpu",
        format!("slot waiter's CPU use while blocked ({:.1} s)", waited),
        (c1 - c0) / waited,
        Unit::Cpu,
        Bound::AtMost(0.01),
        format!(
            "{} of CPU over {}, all threads (schedstat); spec: no measurable CPU",
            time(c1 - c0),
            time(waited)
        ),
    );
    report.context(
        "slot_waiter_total_cpu",
        "slot waiter: whole-process CPU (start to exit)",
        total,
        Unit::Seconds,
        format!(
            "wait4 rusage after a {:.1} s wait; {} in the handover rounds (median of {})",
            waited,
            time(median(&waiter_cpu)),
            waiter_cpu.len()
        ),
    );
    Ok(())
}
