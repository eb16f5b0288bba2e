//! The library against the raw floor, in one process: an image lock
//! (`lock::acquire_no_wait` + drop) against open + flock + close with the same
//! flags, and a whole session (`Session::begin` + `finish`: the lock plus
//! its metadata transactions) for context.
//!
//! Floor and library run in alternating batches and each batch pair gives
//! one ratio, so a burst of noise on the machine hits both sides of a ratio.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use stowage::lock::{self, Mode};
use stowage::session::{Outcome, Request, Session};
use stowage::{ImageName, Root, Store};

use crate::floor;
use crate::report::{Bound, Report, Unit};
use crate::stats::{median, ratios};

pub struct Plan {
    /// Batch pairs for the lock figures, and operations per batch.
    pub batches: usize,
    pub ops: usize,
    /// The same for whole sessions (each is two SQLite transactions).
    pub session_batches: usize,
    pub session_ops: usize,
}

/// Seconds per operation of a batch of `n` that took `d`.
fn per_op(d: std::time::Duration, n: usize) -> f64 {
    d.as_secs_f64() / n as f64
}

fn library_batch(path: &Path, mode: Mode, n: usize) -> Result<f64> {
    let t0 = Instant::now();
    for _ in 0..n {
        let guard = lock::acquire_no_wait(path, mode, lock::IfMissing::Create)?
            .expect("nobody else holds the bench lock");
        drop(guard);
    }
    Ok(per_op(t0.elapsed(), n))
}

/// Runs `a` and `b` in alternating order `batches` times; returns each
/// side's per-operation times.
fn alternate(
    batches: usize,
    mut a: impl FnMut() -> Result<f64>,
    mut b: impl FnMut() -> Result<f64>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    a()?;
    b()?;
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for i in 0..batches {
        if i % 2 == 0 {
            xs.push(a()?);
            ys.push(b()?);
        } else {
            ys.push(b()?);
            xs.push(a()?);
        }
    }
    Ok((xs, ys))
}

pub fn run(dir: &Path, plan: &Plan, report: &mut Report) -> Result<()> {
    let locks = dir.join("floor");
    std::fs::create_dir_all(&locks)?;
    let path = locks.join("base.lock");
    let n = plan.ops;

    let fu: Vec<f64> = (0..plan.batches)
        .map(|_| per_op(floor::flock_unlock(&path, Mode::Exclusive, n), n))
        .collect();
    let how = format!("median of {} batches of {n}", plan.batches);
    report.context(
        "floor_flock_unlock",
        "floor: flock(LOCK_EX)+flock(LOCK_UN) on an open fd",
        median(&fu),
        Unit::Seconds,
        how.clone(),
    );

    let mut floor_ex = 0.0;
    for mode in [Mode::Exclusive, Mode::Shared] {
        let (lib, raw) = alternate(
            plan.batches,
            || library_batch(&path, mode, n),
            || Ok(per_op(floor::open_flock_close(&path, mode, n), n)),
        )?;
        let m = mode.as_str();
        let op = if mode == Mode::Shared {
            "LOCK_SH"
        } else {
            "LOCK_EX"
        };
        report.target(
            &format!("library_try_lock_{m}_vs_floor"),
            format!("library lock::acquire_no_wait {m} + drop vs open+flock({op})+close"),
            median(&ratios(&lib, &raw)),
            Unit::Ratio,
            Bound::AtMost(3.0),
            format!(
                "median of {} paired batches of {n}; library {} vs floor {} per op",
                plan.batches,
                crate::report::time(median(&lib)),
                crate::report::time(median(&raw))
            ),
        );
        report.context(
            &format!("floor_open_flock_close_{m}"),
            format!("floor: open+flock({op})+close"),
            median(&raw),
            Unit::Seconds,
            how.clone(),
        );
        report.context(
            &format!("library_try_lock_{m}"),
            format!("library: lock::acquire_no_wait {m} + drop"),
            median(&lib),
            Unit::Seconds,
            format!("{how}; open, flock, fstat+lstat (unlink-race check), close"),
        );
        if mode == Mode::Exclusive {
            floor_ex = median(&raw);
        }
    }

    // Whole sessions: what `exec` does minus the
    // processes. One store, so the database stays open as in a library
    // user that runs many sessions.
    let mut store = Store::new(Root::at(dir.join("library-root")));
    store.ctx_mut().quiet = true;
    let base = ImageName::parse("base")?;
    let work = ImageName::parse("work")?;
    for name in [&base, &work] {
        let req = Request {
            writes: vec![name.clone()],
            command: "bench setup".into(),
            ..Request::default()
        };
        Session::begin(&mut store, &req)?.finish(&mut store, Outcome::Success)?;
    }
    let read = Request {
        reads: vec![base.clone()],
        command: "bench read".into(),
        ..Request::default()
    };
    let write = Request {
        writes: vec![work.clone()],
        command: "bench write".into(),
        ..Request::default()
    };
    let k = plan.session_ops;
    let mut session_batch = |req: &Request| -> Result<f64> {
        let t0 = Instant::now();
        for _ in 0..k {
            Session::begin(&mut store, req)?.finish(&mut store, Outcome::Success)?;
        }
        Ok(per_op(t0.elapsed(), k))
    };
    let mut reads = Vec::new();
    let mut writes = Vec::new();
    session_batch(&read)?;
    session_batch(&write)?;
    for _ in 0..plan.session_batches {
        reads.push(session_batch(&read)?);
        writes.push(session_batch(&write)?);
    }
    let how = |v: &[f64]| {
        format!(
            "median of {} batches of {k}; {:.0}× the open+flock(LOCK_EX)+close floor",
            plan.session_batches,
            median(v) / floor_ex
        )
    };
    report.context(
        "library_session_read",
        "library: Session::begin+finish, one --read (shared: no record, the lease names it)",
        median(&reads),
        Unit::Seconds,
        how(&reads),
    );
    report.context(
        "library_session_write",
        "library: Session::begin+finish, one --write (exclusive: state and holder record)",
        median(&writes),
        Unit::Seconds,
        how(&writes),
    );
    Ok(())
}
