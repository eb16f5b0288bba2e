//! `stowage exec`: run a command holding image locks.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;

use anyhow::{Context, Result};

use crate::error::{self, Error};
use crate::ident;
use crate::keeper::Keeper;
use crate::name::ImageName;
use crate::session::{Outcome, Request, Session};
use crate::signals::{Forwarder, Target};
use crate::slots::Priority;
use crate::store::Store;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    stowage exec --read alpine:3.17 --write app -- \\\n      \
    ch-image --no-lock --no-cache build -t app .\n  \
    stowage exec --write base --wait 30 -- ./pull base\n  \
    stowage exec --store-wide -- ch-image --no-lock build-cache --gc\n\n\
    Exit status: the command's own; 128+N if it died of signal N; 64 bad usage or name;\n\
    66 an image to read does not exist or is not ready; 69 locking does not work here;\n\
    75 a lock was busy past --wait/--no-wait (or --conflict-exit-code); 1 other failures.")]
pub struct Args {
    /// Take a shared lock on IMG, which must exist and be ready
    #[arg(long = "read", value_name = "IMG", allow_hyphen_values = true)]
    read: Vec<OsString>,
    /// Take an exclusive lock on IMG, creating it if new
    #[arg(long = "write", value_name = "IMG", allow_hyphen_values = true)]
    write: Vec<OsString>,
    /// Take an exclusive lock on IMG, which must exist and be ready, without
    /// writing it: its state stays (for a builder that rewrites a base's
    /// metadata in place)
    #[arg(
        long = "read-exclusive",
        value_name = "IMG",
        allow_hyphen_values = true
    )]
    read_exclusive: Vec<OsString>,
    /// Run CMD while no image lock is held or granted: it waits for every
    /// image user, and every later one waits for it (whole-store commands
    /// such as 'ch-image build-cache --reset')
    #[arg(long, conflicts_with_all = ["read", "write", "read_exclusive", "from", "slot"])]
    store_wide: bool,
    /// Start the (single) --write image as a copy of BASE: reflinked where
    /// the filesystem can, copied elsewhere. BASE is read-locked for the
    /// copy only (also give --read BASE to keep it locked while CMD runs)
    #[arg(long, value_name = "BASE", allow_hyphen_values = true)]
    from: Option<OsString>,
    /// Take a slot of CLASS before any image lock (see 'stowage slots')
    #[arg(long, value_name = "CLASS")]
    slot: Option<String>,
    /// Slot priority: high may also take the slots reserved for it
    #[arg(long, value_enum, value_name = "PRIORITY", requires = "slot")]
    priority: Option<Priority>,
    /// Give up after SECONDS (fractional, or with a unit: 500ms, 10s, 2m, 1h)
    /// waiting for locks [default: wait forever]
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true)]
    wait: Option<String>,
    /// Fail at once if a lock is busy
    #[arg(long, conflicts_with = "wait")]
    no_wait: bool,
    /// Exit with N instead of 75 when a lock is not acquired in time
    #[arg(long, value_name = "N")]
    conflict_exit_code: Option<u8>,
    /// Keep the lock descriptors from the command: stowage holds the locks
    /// until the command and every process it started have exited, and
    /// kills them all if it dies
    #[arg(long)]
    no_inherit: bool,
    /// The command and its arguments (after --)
    // Only after `--`, as the contract writes it: a misspelled option is
    // then an error rather than a command to run.
    #[arg(value_name = "CMD", required = true, last = true)]
    command: Vec<OsString>,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    if let Some(class) = &args.slot {
        crate::slots::validate_class(class)?;
    }
    let reads = super::names(&args.read)?;
    let writes = super::names(&args.write)?;
    let exclusive_reads = super::names(&args.read_exclusive)?;
    if let Some(both) = reads.iter().find(|r| writes.contains(r)) {
        return Err(Error::Usage(format!(
            "image '{both}' is both --read and --write; --write alone gives the command full access"
        ))
        .into());
    }
    if let Some(both) = exclusive_reads.iter().find(|r| {
        reads.contains(r) || writes.contains(r) || args.from.as_deref() == Some(r.as_str().as_ref())
    }) {
        return Err(Error::Usage(format!(
            "image '{both}' is --read-exclusive and also --read, --write or --from; name it once"
        ))
        .into());
    }
    let from = match &args.from {
        Some(raw) => Some(ImageName::parse_os(raw).map_err(Error::from)?),
        None => None,
    };
    let mut reads = reads;
    if let Some(base) = &from {
        if writes.len() != 1 {
            return Err(Error::Usage(
                "--from needs exactly one --write (the image to start as a copy)".into(),
            )
            .into());
        }
        if writes[0] == *base {
            return Err(
                Error::Usage(format!("--from '{base}' names the image being written")).into(),
            );
        }
        if !reads.contains(base) {
            reads.push(base.clone());
        }
    }
    // The base is locked for the copy; while the command runs only if the
    // caller also asked to read it.
    let keep_base = from.as_ref().is_some_and(|b| {
        args.read
            .iter()
            .any(|r| ImageName::parse_os(r).is_ok_and(|n| n == *b))
    });
    // Lineage: the --from image, else the one image read (shared or
    // exclusively) by a one-image write.
    let read_any: Vec<ImageName> = reads.iter().chain(&exclusive_reads).cloned().collect();
    let base = match (&from, read_any.as_slice(), writes.len()) {
        (Some(b), _, _) => Some(b.clone()),
        (None, [only], 1) => Some(only.clone()),
        _ => None,
    };
    let (deadline, no_wait) = super::deadline(args.wait.as_deref(), args.no_wait)?;

    // Before any other thread exists, so that every thread inherits the mask.
    let signals = Forwarder::install().context("cannot set up signal handling")?;

    let shown: Vec<String> = args
        .command
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    if args.store_wide {
        return run_store_wide(args, store, signals, deadline, no_wait, shown);
    }
    let req = Request {
        reads,
        writes,
        exclusive_reads,
        base,
        deadline,
        no_wait,
        slot: args
            .slot
            .map(|class| (class, args.priority.unwrap_or_default())),
        command: ident::shell_join(&shown),
    };
    // A start that fails leaves nothing behind, so one that found the disk
    // full can simply run again in the space kept in reserve (space.rs):
    // reading an image on a full filesystem works.
    let mut session = match store.retry_full(|store| Session::begin(store, &req)) {
        Ok(s) => s,
        Err(e) => {
            if let (Some(Error::Busy(_)), Some(code)) = (error::typed(&e), args.conflict_exit_code)
            {
                store.ctx().say(&format!("{e:#}"));
                return Ok(code);
            }
            return Err(e);
        }
    };
    store.ctx().detail(&format!(
        "locks acquired in {:.1} ms",
        session.elapsed().as_secs_f64() * 1e3
    ));

    if let Some(base) = &from {
        let target = req.writes[0].clone();
        if let Err(e) = clone_into(store, &session, base, &target) {
            // A half-made copy must never look ready.
            let _ = session.finish(store, Outcome::Failure);
            // Stopped by a termination signal (wherever the walk noticed
            // it, even inside an I/O error): exit 128+N, like any signal
            // before the command starts.
            if let Some(sig) = crate::signals::cancelled()
                && error::typed(&e).is_none()
            {
                return Err(e.context(Error::Interrupted(sig)));
            }
            return Err(e);
        }
        // Not fatal: if its record cannot be dropped, the base stays
        // locked (and recorded) until the end, as it did before.
        if !keep_base && let Err(e) = session.release_read(store, base) {
            store.ctx().detail(&format!(
                "image '{base}' stays read-locked until the command ends: {e:#}"
            ));
        }
    }

    let mut images = vec![
        (crate::env::ROOT, store.root().dir().as_os_str().to_owned()),
        (
            crate::env::IMAGES_DIR,
            session.images_dir().as_os_str().to_owned(),
        ),
        // Lets a stowage inside the command tell that we hold its locks.
        (
            crate::env::EXEC_PIDS,
            crate::nested::exec_pids_for_command(std::process::id()).into(),
        ),
    ];
    let written: Vec<_> = session.writes().cloned().collect();
    if let [only] = written.as_slice() {
        images.push((
            crate::env::IMAGE_DIR,
            session.image_dir(only).into_os_string(),
        ));
    }
    let env = command_env(std::env::vars_os(), &images);

    crate::debug::pause("exec-before-spawn");
    let child_umask = store.ctx().child_umask;
    let lock_fds = session.lock_fds();
    let started = start_command(
        &signals,
        &args.command,
        &env,
        child_umask,
        args.no_inherit,
        &lock_fds,
        &|inherit| session.set_inheritable(inherit),
    );
    // If the command never starts, the start is undone — unless a copy
    // from the base already changed the image: then it is incomplete, like
    // any write that did not finish.
    let undo = |session: Session, store: &mut Store| {
        if from.is_some() {
            session.finish(store, Outcome::Failure)
        } else {
            session.abandon(store)
        }
    };
    let (pid, keeper) = match started {
        Ok(Ok(started)) => started,
        Ok(Err(sig)) => {
            undo(session, store)?;
            return Err(Error::Interrupted(sig).into());
        }
        Err(e) => {
            let what = shown[0].clone();
            undo(session, store)?;
            return Err(e).with_context(|| format!("cannot run '{what}'"));
        }
    };
    let status = match wait_command(&signals, pid, keeper) {
        Ok(s) => s,
        Err(e) => {
            // Without its status the outcome is unknown: not ready.
            let _ = session.finish(store, Outcome::Failure);
            return Err(anyhow::Error::new(e).context("cannot wait for the command"));
        }
    };
    let code = exit_code(&status);
    let outcome = if status.success() {
        Outcome::Success
    } else {
        Outcome::Failure
    };
    let full = if outcome == Outcome::Failure && !written.is_empty() {
        full_note(session.images_dir())
    } else {
        None
    };
    session.finish(store, outcome).with_context(|| {
        format!("the command exited with status {code}, but recording that failed")
    })?;
    if !written.is_empty() && full.is_none() {
        crate::space::ensure(&store.root().reserve());
    }
    if let Some(note) = full {
        store.ctx().say(&format!(
            "{} incomplete: the command failed with {note}",
            written
                .iter()
                .map(|w| format!("image '{w}' is"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(code)
}

/// "its filesystem full (12 KiB free in /img): free space with 'stowage
/// rm' or 'stowage gc'" — when a failed writer left the images directory's
/// filesystem (nearly) full, which is then the likely cause.
fn full_note(images_dir: &std::path::Path) -> Option<String> {
    let free = crate::space::free_bytes(images_dir)?;
    // Less than a reserve's worth: no build can write there.
    (free < 1 << 20).then(|| {
        format!(
            "the filesystem of {} full ({} free): free space with 'stowage rm IMAGE' or 'stowage gc'",
            images_dir.display(),
            crate::disk_usage::human(free)
        )
    })
}

/// Starts the command. By default it inherits the lock descriptors (made
/// inheritable by `set_inheritable` for the moment of the spawn), like
/// flock(1); with `no_inherit` a keeper holds them (`lock_fds`), hides them
/// from the command, and ends the command's whole tree before they go
/// ([`crate::keeper`]). `Ok(Err(sig))`: a termination signal came first.
fn start_command(
    signals: &Forwarder,
    command: &[OsString],
    env: &[(OsString, OsString)],
    umask: Option<u32>,
    no_inherit: bool,
    lock_fds: &[std::os::fd::RawFd],
    set_inheritable: &dyn Fn(bool) -> std::io::Result<()>,
) -> std::io::Result<Result<(libc::pid_t, Option<Keeper>), i32>> {
    let mut keeper: Option<Keeper> = None;
    let started = signals.spawn(|| {
        set_inheritable(true)?;
        let spawned = if no_inherit {
            crate::keeper::become_subreaper().and_then(|()| {
                let k = Keeper::spawn(command, env, lock_fds, umask)?;
                let pid = k.pid;
                keeper = Some(k);
                Ok(Target::Keeper(pid))
            })
        } else {
            // posix_spawn cannot set a umask: give the child ours back for
            // the moment of the spawn (no other thread creates files).
            // SAFETY: umask(2) only swaps the process's mask.
            let ours = umask.map(|m| unsafe { libc::umask(m as libc::mode_t) });
            let pid = crate::spawn::spawn(command, env);
            if let Some(m) = ours {
                // SAFETY: as above, restoring our own mask.
                unsafe { libc::umask(m) };
            }
            pid.map(Target::Command)
        };
        if no_inherit || spawned.is_err() {
            set_inheritable(false)?;
        }
        spawned
    })?;
    Ok(started.map(|pid| (pid, keeper)))
}

/// Waits for the command (through its keeper's report for --no-inherit).
fn wait_command(
    signals: &Forwarder,
    pid: libc::pid_t,
    keeper: Option<Keeper>,
) -> std::io::Result<std::process::ExitStatus> {
    let status = signals.wait(pid)?;
    match keeper {
        Some(k) => k.outcome(status).map(std::process::ExitStatus::from_raw),
        None => Ok(status),
    }
}

/// The exit code of an exec: the command's, or 128+N for a death by
/// signal N (real-time signals included).
fn exit_code(status: &std::process::ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => 128u8.saturating_add(sig as u8),
        (None, None) => error::code::FAILURE,
    }
}

/// `--store-wide`: the command runs while no image lock is held or granted.
fn run_store_wide(
    args: Args,
    store: &mut Store,
    signals: Forwarder,
    deadline: Option<std::time::Instant>,
    no_wait: bool,
    shown: Vec<String>,
) -> Result<u8> {
    let hold =
        match crate::store_wide::Hold::take(store, &ident::shell_join(&shown), deadline, no_wait) {
            Ok(h) => h,
            Err(e) => {
                if let (Some(Error::Busy(_)), Some(code)) =
                    (error::typed(&e), args.conflict_exit_code)
                {
                    store.ctx().say(&format!("{e:#}"));
                    return Ok(code);
                }
                return Err(e);
            }
        };
    let images_dir = store.with_tx(None, |tx, ctx| tx.images_dir(&ctx.root));
    let run = || -> Result<u8> {
        let images = [
            (crate::env::ROOT, store.root().dir().as_os_str().to_owned()),
            (crate::env::IMAGES_DIR, images_dir?.into_os_string()),
            // A stowage inside the command tells by it that we hold the
            // store's lease (the keeper does, with --no-inherit).
            (
                crate::env::EXEC_PIDS,
                crate::nested::exec_pids_for_command(std::process::id()).into(),
            ),
        ];
        let env = command_env(std::env::vars_os(), &images);
        let started = start_command(
            &signals,
            &args.command,
            &env,
            store.ctx().child_umask,
            args.no_inherit,
            &hold.lock_fds(),
            &|inherit| hold.set_inheritable(inherit),
        );
        let (pid, keeper) = match started {
            Ok(Ok(started)) => started,
            Ok(Err(sig)) => return Err(Error::Interrupted(sig).into()),
            Err(e) => return Err(e).with_context(|| format!("cannot run '{}'", shown[0])),
        };
        let status = wait_command(&signals, pid, keeper).context("cannot wait for the command")?;
        Ok(exit_code(&status))
    };
    let code = run();
    hold.release(store);
    code
}

/// Makes the written image a copy of `base` (emptying it first if it had
/// content: it is being rebuilt from the base).
fn clone_into(
    store: &Store,
    session: &Session,
    base: &ImageName,
    target: &ImageName,
) -> Result<()> {
    use std::io::IsTerminal;
    let src = session.image_dir(base);
    let dst = session.image_dir(target);
    if !std::fs::symlink_metadata(&src).is_ok_and(|m| m.is_dir()) {
        anyhow::bail!(
            "image '{base}': {} is not a directory; cannot copy it",
            src.display()
        );
    }
    crate::remove::empty_image_dir(store.root(), session.images_dir(), target)?;
    crate::debug::pause("clone-emptied");
    let t0 = std::time::Instant::now();
    let show = std::io::stderr().is_terminal() && !store.ctx().quiet;
    let mut bar = crate::clone::Bar::new(format!("copying '{base}' to '{target}'"), show);
    // Both ends from one descriptor of the images directory, never a path
    // resolved again: a link swapped in above them cannot move the copy.
    let images = store.root().open_images_dir(session.images_dir())?;
    let open = |name: &ImageName, path: &std::path::Path| {
        images
            .sub(name.encoded())
            .with_context(|| format!("cannot open {}", path.display()))
    };
    let (s, d) = (open(base, &src)?, open(target, &dst)?);
    let done = crate::clone::copy_tree_at(s, &src, d, &dst, &mut bar)
        .with_context(|| format!("cannot copy image '{base}' to '{target}'"))?;
    store.ctx().detail(&format!(
        "copied '{base}' to '{target}': {} files, {} ({} reflinked) in {:.2} s",
        done.files,
        crate::disk_usage::human(done.bytes),
        done.reflinked,
        t0.elapsed().as_secs_f64()
    ));
    for m in &done.mounts_left_out {
        store.ctx().say(&format!(
            "image '{target}': {m} is a mount point in '{base}'; copied as an empty directory (a mounted filesystem is not part of the image)"
        ));
    }
    if done.skipped_special > 0 {
        store.ctx().say(&format!(
            "image '{target}': {} device node(s) of '{base}' not copied (creating them needs privilege)",
            done.skipped_special
        ));
    }
    if let Some(lost) = done.xattrs_summary() {
        store.ctx().say(&format!(
            "image '{target}': extended attributes of '{base}' the filesystem refused, not kept: {lost}{}",
            if store.ctx().verbose { "" } else { " (-v lists the files)" }
        ));
        for d in &done.xattr_details {
            store.ctx().detail(&format!("  not kept: {d}"));
        }
    }
    Ok(())
}

/// The command's environment: ours, without any `STOWAGE_*` variable that
/// this exec sets or that describes images (`STOWAGE_IMAGE_DIR` of an outer
/// exec would name another image), then the ones this exec means, once
/// each. Programs read the first of duplicate entries, so a caller's
/// `STOWAGE_ROOT` left in would win over `--root`.
fn command_env(
    ours: impl Iterator<Item = (OsString, OsString)>,
    set: &[(&str, OsString)],
) -> Vec<(OsString, OsString)> {
    let replaced = |k: &OsString| {
        k.to_str().is_some_and(|k| {
            k.starts_with("STOWAGE_IMAGE") || set.iter().any(|(name, _)| *name == k)
        })
    };
    ours.filter(|(k, _)| !replaced(k))
        .chain(set.iter().map(|(k, v)| (OsString::from(k), v.clone())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stowage_variable_once_and_ours() {
        let caller = [
            ("PATH", "/bin"),
            (crate::env::ROOT, "/caller"),
            (crate::env::IMAGE_DIR, "/caller/img/x"),
            (crate::env::IMAGES_DIR, "/caller/img"),
            ("STOWAGE_HOSTNAME", "kept"),
        ]
        .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        let env = command_env(
            caller.into_iter(),
            &[
                (crate::env::ROOT, "/r".into()),
                (crate::env::IMAGES_DIR, "/r/img".into()),
            ],
        );
        let get = |k: &str| -> Vec<&OsString> {
            env.iter().filter(|(n, _)| n == k).map(|(_, v)| v).collect()
        };
        assert_eq!(get("STOWAGE_ROOT"), [&OsString::from("/r")]);
        assert_eq!(get("STOWAGE_IMAGES_DIR"), [&OsString::from("/r/img")]);
        assert!(get("STOWAGE_IMAGE_DIR").is_empty(), "no single image here");
        assert_eq!(get("STOWAGE_HOSTNAME"), [&OsString::from("kept")]);
        assert_eq!(get("PATH"), [&OsString::from("/bin")]);
    }
}
