//! Integration tests: the real binary, real processes, a real directory.
//! One test binary with modules keeps link time down.
//!
//! The modules are organised one way, by capability: a test lives with the
//! capability it exercises, whatever defect it guards against.
//!
//! - `exec`: running a command — exit status, the state a write records,
//!   the command's environment, starts that fail, exec's command line
//! - `locking`: image locks — waits, the writer gate and fairness,
//!   concurrency, exclusive reads, nested calls
//! - `slots`: slot classes, their limits and their waiters
//! - `store_wide`: `exec --store-wide` and the calls nested inside it
//! - `clone`: `--from`, the copy of a base
//! - `rm`, `gc`, `doctor`, `init`: those commands
//! - `group_stores`: a store shared by a group — `init --group`, and the
//!   modes `doctor` checks and repairs
//! - `catalog_loss`: the catalog deleted, emptied, damaged or replaced,
//!   and stores moved or seen at another path — no image changes
//! - `status`: what `lock-status` and `images` show
//! - `wait_chains`: `lock-status --why`, chains of waits and cycles
//! - `wait_line`: the line of a wait, followed on a terminal and in a log
//! - `names`: image names valid and invalid
//! - `leases`: holder leases and holders on other hosts
//! - `round_trips`: the server round trips a command costs
//! - `signals`: signals and crashes of stowage, its command and its waiters
//! - `hostile`: a hostile or broken environment — planted links, foreign
//!   roots, read-only and full filesystems, outside programs
//! - `bare_environment`: no `USER`, a uid without a password entry, a
//!   standard output that cannot be written
//! - `planted_everywhere`: the sweep — each kind of plant at every path
//!   of the layout, every command
//! - `planted_files`: FIFOs, links, directories, sockets where stowage
//!   keeps a file of its own, each case on its own
//! - `filesystems`: where the images live — other filesystems, unmounted
//!   ones, mounts inside trees, network and cluster filesystems
//! - `charliecloud`, `runtimes`: stowage around real builders and runtimes
//! - `wrapper_calls`: the scripts under `scripts/` called every way the
//!   docs call them — the root named either way, `CARGO_TARGET_DIR`,
//!   times with units, signals
//! - `shell`: completion scripts and manual pages
//! - `docs`: every example in the documentation runs
//! - `stress`: a randomized torture run with an independent checker
//!
//! Where two homes seem to fit, the narrower wins: a crash in the middle of
//! rm's, gc's, a copy's or doctor's own work lives with that command (and
//! `signals` holds those of exec and its command); a planted link or a
//! foreign owner lives in `hostile`, a mount in `filesystems`, a call nested
//! in a store-wide command in `store_wide`. Setup that more than one module
//! needs is in `common`, once.

// Tests and benchmarks print where they like; the binary may not (clippy.toml).
#![allow(clippy::disallowed_macros)]

mod common;

mod across_hosts;
mod bare_environment;
mod catalog_loss;
mod charliecloud;
mod clone;
mod cluster;
mod docs;
mod doctor;
mod exec;
mod filesystems;
mod gc;
mod group_stores;
mod hostile;
mod init;
mod leases;
mod locking;
mod migration;
mod names;
mod planted_everywhere;
mod planted_files;
mod record_crashes;
mod rm;
mod round_trips;
mod runtimes;
mod shell;
mod signals;
mod slots;
mod status;
mod store_wide;
mod stress;
mod viewpoints;
mod wait_chains;
mod wait_line;
mod wrapper_calls;
