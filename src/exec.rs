//! One `stowage exec`, from a validated plan to the exit code: acquire the locks (`session.rs`),
//! clone the base for `--from`, run the command (`command.rs`), record its outcome, release. Or,
//! for `--store-wide`, the same around a store-wide hold (`store_wide.rs`).
//!
//! `cli/exec.rs` holds the command line's rules and builds the [`Plan`]; nothing here parses them.

use std::ffi::OsString;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::command;
use crate::error::{self, Error};
use crate::ident::STOWAGE;
use crate::name::ImageName;
use crate::session::{Outcome, Request, Session};
use crate::signals::Forwarder;
use crate::store::Store;

/// What an exec does, validated.
#[derive(Debug)]
pub struct Plan {
    /// The image locks to hold, or (empty) the store-wide hold's deadline and command line.
    pub request: Request,
    /// Hold no image lock, and let none be held or granted meanwhile.
    pub store_wide: bool,
    /// Start the single written image as a copy of this image.
    pub from: Option<ImageName>,
    /// Keep `from` read-locked for the command (also named with `--read`), not just the copy.
    pub keep_base: bool,
    pub argv: Vec<OsString>,
    /// The command does not inherit the lock descriptors; a keeper holds them.
    pub no_inherit: bool,
    /// Exit with this instead of 75 when a lock is busy past the deadline.
    pub conflict_exit_code: Option<u8>,
}

/// Runs the exec; returns its exit code (the command's own, or 128+N).
pub fn run(store: &mut Store, plan: &Plan) -> Result<u8> {
    // Before any other thread exists, so that every thread inherits the mask.
    let signals = Forwarder::install().context("cannot set up signal handling")?;
    if plan.store_wide {
        return run_store_wide(store, plan, signals);
    }
    let req = &plan.request;
    let from = plan.from.as_ref();
    // A command that ends at once is never announced (lease.rs), unless a keeper must hold it.
    if !plan.no_inherit {
        crate::lease::announce_late();
    }
    let t0 = Instant::now();
    let mut session = match Session::begin(store, req) {
        Ok(s) => s,
        Err(e) => return refused(store, plan, e),
    };
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    store.ctx().detail(&format!("locks acquired in {ms:.1} ms"));

    if let Some(base) = from {
        // A copy takes a while: its holder is named meanwhile.
        crate::lease::announce();
        // A base's lend lock busy past the deadline skips the command as any lock does.
        session = match copy_base(store, session, plan, base, &req.writes[0]) {
            Ok(session) => session,
            Err(e) => return refused(store, plan, e),
        };
    }

    // Ours, where the images are, and the tree of the one image written.
    let mut told = told(store, session.images_dir().into());
    if let [only] = session.writes().collect::<Vec<_>>().as_slice() {
        told.push((crate::env::IMAGE_DIR, session.image_dir(only).into()));
    }
    let env = command::environment(std::env::vars_os(), &told);

    crate::debug::pause("exec-before-spawn");
    let started = command::start(
        &signals,
        &plan.argv,
        &env,
        store.ctx().child_umask,
        plan.no_inherit,
        &session.lock_fds(),
        &|inherit| session.set_inheritable(inherit),
    );
    let (pid, keeper) = match started {
        Ok(started) => started,
        // Undone, unless a copy from the base already changed the image: then it is incomplete.
        Err(e) if from.is_some() => {
            session.finish(store, Outcome::Failure("the command never started".into()))?;
            return Err(e);
        }
        Err(e) => {
            session.abandon()?;
            return Err(e);
        }
    };
    let status = match command::wait(&signals, pid, keeper) {
        Ok(s) => s,
        Err(e) => {
            // Without its status the outcome is unknown: not ready.
            let _ = session.finish(store, Outcome::Failure("its status is unknown".into()));
            return Err(wait_failed(e));
        }
    };
    record_outcome(store, session, &status)
}

/// The command's end is unknown (keeper gone): a failure, or 128+N if a signal was passed on.
fn wait_failed(e: std::io::Error) -> anyhow::Error {
    let e = anyhow::Error::new(e).context("cannot wait for the command");
    match crate::signals::passed_on().or_else(crate::signals::cancelled) {
        Some(sig) => e.context(Error::Stopped(sig)),
        None => e,
    }
}

/// `--from`: makes the written image a copy of the base, then lets the base go unless the command
/// is to read it too. A failed copy leaves the image incomplete, never ready.
fn copy_base(
    store: &mut Store,
    mut session: Session,
    plan: &Plan,
    base: &ImageName,
    target: &ImageName,
) -> Result<Session> {
    // Refused or stopped before anything of the image changed: its start is undone.
    let opened = session.open_base(store, base);
    let opened = opened.and_then(|o| crate::signals::check_now().map(|()| o).map_err(Into::into));
    let opened = match opened {
        Ok(opened) => opened,
        Err(e) => {
            session.abandon()?;
            return Err(e);
        }
    };
    let mut changed = false;
    if let Err(e) = session.clone_into(store, &plan.request, opened, base, target, &mut changed) {
        // Failed before anything of the image changed (its tree not ours to empty, no descriptor
        // left to open it): undone as above. Else the image is incomplete.
        if changed {
            let failed = Outcome::Failure("the copy from its base failed".into());
            let _ = session.finish(store, failed);
        } else {
            session.abandon()?;
        }
        // Stopped by a termination signal (even noticed inside an I/O error): exit 128+N.
        if let Some(sig) = crate::signals::cancelled()
            && error::typed(&e).is_none()
        {
            return Err(e.context(Error::Interrupted(sig)));
        }
        // A lock given up on once the image changed skipped nothing: the rebuild failed part-way.
        if changed && matches!(error::typed(&e), Some(Error::Busy(_))) {
            let said = error::one_line(&e);
            anyhow::bail!("{said}; '{target}' is incomplete");
        }
        return Err(e);
    }
    // Where its lock may have been lost during the copy, the base must be as it was read.
    if let Some(changed) = session.reads_changed(Some(base)) {
        let failed = Outcome::Failure("its base changed while copied".into());
        let _ = session.finish(store, failed);
        anyhow::bail!(
            "{changed} changed while copied to '{target}' (its read lock was lost: another host may have written it); '{target}' is incomplete"
        );
    }
    if !plan.keep_base {
        session.release_read(base);
    }
    Ok(session)
}

/// What every command is told: the root, the images directory, and our leases (nested execs).
fn told(store: &Store, images: OsString) -> Vec<(&'static str, OsString)> {
    let mine = crate::lease::mine(&store.root().leases()).ok();
    let leases = crate::nested::for_command(mine.as_deref());
    vec![
        (crate::env::ROOT, store.root().dir().as_os_str().to_owned()),
        (crate::env::IMAGES_DIR, images),
        (crate::env::EXEC_LEASES, leases.into()),
    ]
}

/// Records how the command ended and returns the exec's exit code.
fn record_outcome(
    store: &mut Store,
    mut session: Session,
    status: &std::process::ExitStatus,
) -> Result<u8> {
    let written: Vec<ImageName> = session.writes().cloned().collect();
    let code = command::exit_code(status);
    // An image read that another host may have written meanwhile, or read exclusively while
    // others came in: the command's result is no use.
    let lost = session.exclusive_reads_lost();
    let changed = session.reads_changed(None);
    let outcome = match (&lost, &changed) {
        (Some(_), _) => Outcome::Failure("its exclusive read lock was lost".into()),
        (_, Some(_)) => Outcome::Failure("an image it read changed meanwhile".into()),
        _ if status.success() => Outcome::Success,
        _ => Outcome::Failure(command::describe(status)),
    };
    // A failed write that left less than a reserve's worth free: no build can write there.
    let dir = session.images_dir().to_owned();
    let full = (!status.success() && !written.is_empty())
        .then(|| crate::space::free_bytes(&dir))
        .flatten()
        .filter(|free| *free < 1 << 20);
    // The lease goes with the process: no need to take out what it lists lock by lock.
    crate::lease::ending();
    session.finish(store, outcome).with_context(|| {
        format!("the command exited with status {code}, but recording that failed")
    })?;
    if let Some(free) = full {
        let which: Vec<String> = written.iter().map(|w| format!("image '{w}' is")).collect();
        let (which, at, free) = (
            which.join(", "),
            dir.display(),
            crate::disk_usage::human(free),
        );
        store.ctx().warn(&format!(
            "{which} incomplete: the command failed with the filesystem of {at} full ({free} free): free space with '{STOWAGE} rm IMAGE' or '{STOWAGE} gc'"
        ));
    }
    let wrote = match written.is_empty() {
        true => "",
        false => ", and what it wrote is incomplete",
    };
    if let Some(lost) = lost {
        anyhow::bail!("{lost}; its exit status {code} proves nothing{wrote}");
    }
    if let Some(changed) = changed {
        anyhow::bail!(
            "{changed} changed while the command read it (its read lock was lost: another host may have written it): its exit status {code} proves nothing{wrote}"
        );
    }
    Ok(code)
}

/// A start refused with `e`. A busy lock skips the command: said so (a log read after an exit 0
/// must tell it from a run), exiting with `--conflict-exit-code` if given, else 75.
fn refused(store: &Store, plan: &Plan, e: anyhow::Error) -> Result<u8> {
    if !matches!(error::typed(&e), Some(Error::Busy(_))) {
        return Err(e);
    }
    // Its name, not its path: the line stays short.
    let path = std::path::Path::new(&plan.argv[0]);
    let command = path
        .file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy();
    let said = error::one_line(&e);
    store.ctx().warn(&format!("{said}; '{command}' not run"));
    Ok(plan
        .conflict_exit_code
        .unwrap_or(crate::error::code::TEMPFAIL))
}

/// `--store-wide`: the command runs while no image lock is held or granted.
fn run_store_wide(store: &mut Store, plan: &Plan, signals: Forwarder) -> Result<u8> {
    let req = &plan.request;
    // Before any hold: a copied store gets no images directory of another.
    if store.root().exists()
        && let Ok(config) = crate::images_dir::config(store.root())
    {
        crate::images_dir::checked(store.root(), &config)?;
    }
    let hold = match crate::store_wide::Hold::take(store, &req.command, req.deadline, req.no_wait) {
        Ok(h) => h,
        Err(e) => return refused(store, plan, e),
    };
    let images_dir =
        crate::images_dir::config(store.root()).map(|c| c.images.path_in(store.root().dir()));
    let run = || -> Result<u8> {
        let env = command::environment(std::env::vars_os(), &told(store, images_dir?.into()));
        let (pid, keeper) = command::start(
            &signals,
            &plan.argv,
            &env,
            store.ctx().child_umask,
            plan.no_inherit,
            &hold.lock_fds(),
            &|inherit| hold.set_inheritable(inherit),
        )?;
        let status = command::wait(&signals, pid, keeper).map_err(wait_failed)?;
        Ok(command::exit_code(&status))
    };
    let before = crate::images_dir::recorded_open(store.root());
    let code = run();
    // Checked before its end is reconciled on its strength (docs/design.md, "Lost locks").
    if let Some(why) = hold.lost() {
        hold.end_lost(store);
        let code = code?;
        anyhow::bail!(
            "lost the store-wide hold while the command ran ({why}): other commands may have used the store meanwhile; its exit status {code} proves nothing"
        );
    }
    for name in hold.forget_deleted(store, before.as_ref()) {
        let said = format!("image '{name}' was deleted by the store-wide command");
        store.ctx().say(&said);
    }
    // Trees it changed keep their records: the sizes kept for them go (the next look measures),
    // while the hold stands, so none measured meanwhile outlives it. Only a cache: a failure is no
    // loss.
    let _ = store.with_catalog(None, |c, _| c.forget_sizes());
    hold.release(store);
    code
}
