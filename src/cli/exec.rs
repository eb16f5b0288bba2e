//! `stowage exec`: run a command holding image locks.

use std::ffi::OsString;

use anyhow::Result;

use crate::exec::Plan;
use crate::ident;
use crate::ident::lossy;
use crate::name::ImageName;
use crate::session::Request;
use crate::slots::Priority;
use crate::store::Store;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    stowage exec --no-inherit --read alpine:3.17 --write app -- \\\n      \
    ch-image --no-lock --no-cache build -t app .\n  \
    stowage exec --write base --wait 30 -- ./pull base\n  \
    stowage exec --no-inherit --store-wide -- ch-image --no-lock build-cache --gc\n\n\
    Exit status: the command's own; 128+N if it died of signal N; 64 bad usage or name;\n\
    66 an image to read does not exist or is not ready; 69 locking does not work here;\n\
    75 a lock was busy past --wait/--no-wait (or --conflict-exit-code); 1 other failures.")]
pub struct Args {
    /// Take a shared lock on IMG, which must exist and be ready
    #[arg(long, value_name = "IMG", allow_hyphen_values = true)]
    read: Vec<OsString>,
    /// Take an exclusive lock on IMG, creating it if new
    #[arg(long, value_name = "IMG", allow_hyphen_values = true)]
    write: Vec<OsString>,
    /// Take an exclusive lock on IMG, which must exist and be ready, without
    /// writing it: its state stays (for a builder that rewrites a base's
    /// metadata in place)
    #[arg(long, value_name = "IMG", allow_hyphen_values = true)]
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
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true, help = concat!(
        "Give up after SECONDS (fractional, or with a unit of ", time_units!(),
        ": 30, 500ms, 2m) waiting for locks [default: wait forever]"))]
    wait: Option<String>,
    /// Fail at once if a lock is busy
    #[arg(long, conflicts_with = "wait")]
    no_wait: bool,
    /// Exit with N instead of 75 when a lock is not acquired in time (0 too:
    /// the command is then skipped, and only stderr says so)
    #[arg(long, value_name = "N", value_parser = exit_status, allow_hyphen_values = true)]
    conflict_exit_code: Option<u8>,
    /// Keep the lock descriptors from the command: stowage holds the locks
    /// until the command and every process it started have exited, and
    /// kills them all if it dies
    #[arg(long)]
    no_inherit: bool,
    /// The command and its arguments (after --)
    // Only after `--`, as the contract writes it: a misspelled option is an error, not a command.
    #[arg(value_name = "CMD", required = true, last = true)]
    command: Vec<OsString>,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    let plan = plan(args)?;
    refuse_before_anything_is_made(store.root(), &plan)?;
    crate::exec::run(store, &plan)
}

/// What is refused before a lock is taken, a base copied or a new root laid out, so that a
/// request that cannot succeed creates nothing: a command that cannot be started, and a write that
/// reads an image (or copies one) where no store is yet (a read alone lays out nothing anyway, and
/// pays no look for it).
fn refuse_before_anything_is_made(root: &crate::root::Root, plan: &Plan) -> Result<()> {
    crate::command::check_runnable(&plan.argv[0])?;
    let req = &plan.request;
    // Said as a read alone says it: the root (mistyped, most often) is what is missing.
    match req.reads.first() {
        Some(_) if !req.writes.is_empty() => root.require_store(),
        _ => Ok(()),
    }
}

/// The command line's rules: which images in which roles, the base and its lineage, the deadline.
/// All that can be refused is refused here, before anything is locked or created.
fn plan(args: Args) -> Result<Plan> {
    if let Some(class) = &args.slot {
        crate::slots::validate_class(class)?;
    }
    let mut reads = super::names(&args.read)?;
    let writes = super::names(&args.write)?;
    let exclusive_reads = super::names(&args.read_exclusive)?;
    // An image in two roles: --read and --write, or --read-exclusive and anything else.
    if let Some(both) = reads.iter().find(|r| writes.contains(r)) {
        return super::usage(format!(
            "image '{both}' is both --read and --write; --write alone gives the command full access"
        ));
    }
    let as_from = |r: &ImageName| args.from.as_deref() == Some(r.as_str().as_ref());
    if let Some(both) = exclusive_reads
        .iter()
        .find(|r| reads.contains(r) || writes.contains(r) || as_from(r))
    {
        return super::usage(format!(
            "image '{both}' is --read-exclusive and also --read, --write or --from; name it once"
        ));
    }
    let from = super::names(args.from.as_slice())?.pop();
    // The base is locked for the copy, and while the command runs only if also asked to read it.
    let keep_base = from.as_ref().is_some_and(|b| reads.contains(b));
    // --from BASE: the one image written starts as a copy of BASE, read (locked shared) for it.
    if let Some(base) = &from {
        if writes.len() != 1 {
            return super::usage(
                "--from needs exactly one --write (the image to start as a copy)".into(),
            );
        }
        if writes[0] == *base {
            return super::usage(format!("--from '{base}' names the image being written"));
        }
        if !keep_base {
            reads.push(base.clone());
        }
    }
    // Lineage: the --from image, else the one image read (shared or exclusively) by a one-image write.
    let mut read_any = reads.iter().chain(&exclusive_reads);
    let base = match (&from, read_any.next(), read_any.next(), writes.len()) {
        (Some(b), ..) => Some(b.clone()),
        (None, Some(only), None, 1) => Some(only.clone()),
        _ => None,
    };
    let (deadline, no_wait) = super::duration::deadline(args.wait.as_deref(), args.no_wait)?;
    let request = Request {
        reads,
        writes,
        exclusive_reads,
        base,
        deadline,
        no_wait,
        slot: args
            .slot
            .map(|class| (class, args.priority.unwrap_or_default())),
        // The command as leases list it: one line a shell would take.
        command: ident::shell_join(&lossy(&args.command)),
    };
    Ok(Plan {
        request,
        store_wide: args.store_wide,
        from,
        keep_base,
        argv: args.command,
        no_inherit: args.no_inherit,
        conflict_exit_code: args.conflict_exit_code,
    })
}

/// An exit status given on the command line (`--conflict-exit-code`).
fn exit_status(raw: &str) -> Result<u8, String> {
    raw.trim()
        .parse()
        .map_err(|_| "an exit status is a whole number from 0 to 255".to_owned())
}
