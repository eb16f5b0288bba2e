//! `stowage exec`: run a command holding image locks.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Command;

use anyhow::{Context, Result};

use crate::error::{self, Error};
use crate::ident;
use crate::name::ImageName;
use crate::session::{Outcome, Request, Session};
use crate::signals::Forwarder;
use crate::slots::Priority;
use crate::store::Store;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    stowage exec --read alpine:3.17 --write app -- ch-image build -t app .\n  \
    stowage exec --write base --wait 30 -- ./pull base\n\n\
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
    /// Start the (single) --write image as a copy of BASE (read-locked):
    /// reflinked where the filesystem can, copied elsewhere
    #[arg(long, value_name = "BASE", allow_hyphen_values = true)]
    from: Option<OsString>,
    /// Take a slot of CLASS before any image lock (see 'stowage slots')
    #[arg(long, value_name = "CLASS")]
    slot: Option<String>,
    /// Slot priority: high may also take the slots reserved for it
    #[arg(long, value_enum, value_name = "PRIORITY", requires = "slot")]
    priority: Option<Priority>,
    /// Give up after SECONDS (fractional) waiting for locks [default: wait forever]
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true)]
    wait: Option<String>,
    /// Fail at once if a lock is busy
    #[arg(long, conflicts_with = "wait")]
    no_wait: bool,
    /// Exit with N instead of 75 when a lock is not acquired in time
    #[arg(long, value_name = "N")]
    conflict_exit_code: Option<u8>,
    /// Keep the lock descriptors in stowage alone (the command does not
    /// inherit them, and is killed if stowage dies)
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
    if let Some(both) = reads.iter().find(|r| writes.contains(r)) {
        return Err(Error::Usage(format!(
            "image '{both}' is both --read and --write; --write alone gives the command full access"
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
    // Lineage: the --from image, else the one image read by a one-image write.
    let base = match (&from, reads.as_slice(), writes.len()) {
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
    let req = Request {
        reads,
        writes,
        base,
        deadline,
        no_wait,
        slot: args
            .slot
            .map(|class| (class, args.priority.unwrap_or_default())),
        command: ident::shell_join(&shown),
    };
    let session = match Session::begin(store, &req) {
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
            return Err(e);
        }
    }

    let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(k, _)| !k.to_str().is_some_and(|k| k.starts_with("STOWAGE_IMAGE")))
        .collect();
    // Lets a stowage inside the command tell that we hold its locks.
    env.retain(|(k, _)| k != crate::kernel::EXEC_PIDS_ENV);
    env.push((
        crate::kernel::EXEC_PIDS_ENV.into(),
        crate::kernel::exec_pids_for_command(std::process::id()).into(),
    ));
    env.push(("STOWAGE_ROOT".into(), store.root().dir().into()));
    env.push(("STOWAGE_IMAGES_DIR".into(), session.images_dir().into()));
    let written: Vec<_> = session.writes().cloned().collect();
    if let [only] = written.as_slice() {
        env.push(("STOWAGE_IMAGE_DIR".into(), session.image_dir(only).into()));
    }
    if !args.no_inherit {
        session
            .set_inheritable(true)
            .context("cannot pass the locks to the command")?;
    }

    crate::debug::pause("exec-before-spawn");
    let child_umask = store.ctx().child_umask;
    let started = signals.spawn(|| {
        if args.no_inherit {
            spawn_dying_with_us(&args.command, &env, child_umask)
        } else {
            // posix_spawn cannot set a umask: give the child ours back for
            // the moment of the spawn (no other thread creates files).
            let ours = child_umask.map(|m| unsafe { libc::umask(m as libc::mode_t) });
            let pid = crate::spawn::spawn(&args.command, &env);
            if let Some(m) = ours {
                unsafe { libc::umask(m) };
            }
            pid
        }
    });
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
    let pid = match started {
        Ok(Ok(pid)) => pid,
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
    let status = match signals.wait(pid) {
        Ok(s) => s,
        Err(e) => {
            // Without its status the outcome is unknown: not ready.
            let _ = session.finish(store, Outcome::Failure);
            return Err(anyhow::Error::new(e).context("cannot wait for the command"));
        }
    };
    let code = match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => 128u8.saturating_add(sig as u8),
        (None, None) => error::code::FAILURE,
    };
    let outcome = if status.success() {
        Outcome::Success
    } else {
        Outcome::Failure
    };
    session.finish(store, outcome).with_context(|| {
        format!("the command exited with status {code}, but recording that failed")
    })?;
    Ok(code)
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
    for entry in
        std::fs::read_dir(&dst).with_context(|| format!("cannot list {}", dst.display()))?
    {
        crate::remove::remove_tree(&entry?.path())?;
    }
    let t0 = std::time::Instant::now();
    let show = std::io::stderr().is_terminal() && !store.ctx().quiet;
    let mut bar = crate::clone::Bar::new(format!("copying '{base}' to '{target}'"), show);
    let done = crate::clone::copy_tree(&src, &dst, &mut bar)
        .with_context(|| format!("cannot copy image '{base}' to '{target}'"))?;
    store.ctx().detail(&format!(
        "copied '{base}' to '{target}': {} files, {} ({} reflinked) in {:.2} s",
        done.files,
        crate::usage::human(done.bytes),
        done.reflinked,
        t0.elapsed().as_secs_f64()
    ));
    if done.skipped_special > 0 {
        store.ctx().say(&format!(
            "image '{target}': {} device node(s) of '{base}' not copied (creating them needs privilege)",
            done.skipped_special
        ));
    }
    Ok(())
}

/// `--no-inherit`: the locks stay in stowage, so the command must not
/// outlive it — PR_SET_PDEATHSIG kills it if stowage dies. That needs code
/// between fork and exec, hence std's fork path.
fn spawn_dying_with_us(
    argv: &[OsString],
    env: &[(OsString, OsString)],
    umask: Option<u32>,
) -> std::io::Result<libc::pid_t> {
    let parent = std::process::id() as libc::pid_t;
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)));
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            crate::signals::reset_mask_in_child()?;
            if let Some(mask) = umask {
                libc::umask(mask as libc::mode_t);
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::_exit(128 + libc::SIGKILL);
            }
            Ok(())
        });
    }
    // The child is waited for by pid (see signals.rs); std's handle is not
    // needed, and dropping it neither waits nor kills.
    Ok(cmd.spawn()?.id() as libc::pid_t)
}
