//! Model checking of the lock protocol: every interleaving of a few
//! processes, SIGKILLs, torn record writes and catalog losses included
//! (`cargo test --test model`).
//!
//! - `proto`: the state (locks, lock files with their records and hints,
//!   trees, the catalog) and its helpers; `ops`: each operation's steps;
//!   `props`: the moves and the properties; `steps`: the steps with the
//!   functions of `src/` that implement them (compared with docs/design.md);
//!   `trace`: counterexamples.
//! - Each rule of the protocol has a mutation test: with the rule off the
//!   checker finds a counterexample; with it kept, none.
//! - `Rules::default()` is the code as it is. What the checker found in
//!   the code was fixed there; each fix is a rule with a mutation test.
//! - The default sizes run with the suite; `STOWAGE_MODEL_BIG=1` checks
//!   larger ones and prints state counts and times.

// Tests and benchmarks print where they like; the binary may not (clippy.toml).
#![allow(clippy::disallowed_macros)]

mod ops;
mod props;
mod proto;
mod steps;
mod trace;

use std::collections::BTreeSet;
use std::time::Instant;

use stateright::{Checker, Expectation, HasDiscoveries, Model};

use proto::{Config, Op, Proto, Reads, Role, Rules, St};

const A: u8 = 0;
const B: u8 = 1;

const fn exec(read: Option<u8>, write: Option<u8>, from: bool) -> Op {
    let slot = false;
    Op::Exec {
        read,
        write,
        from,
        slot,
    }
}

const fn read(i: u8) -> Op {
    exec(Some(i), None, false)
}

const fn write(i: u8) -> Op {
    exec(None, Some(i), false)
}

const fn from(base: u8, target: u8) -> Op {
    exec(Some(base), Some(target), true)
}

fn slot(mut op: Op) -> Op {
    if let Op::Exec { slot, .. } = &mut op {
        *slot = true;
    }
    op
}

const GC: Op = Op::Gc { lru: false };
const GC_LRU: Op = Op::Gc { lru: true };

fn sw(deletes: Option<u8>) -> Op {
    Op::StoreWide { deletes }
}

/// `images` images (A ready), one process per menu, `crashes` crashes.
fn config(images: u8, menus: &[&[Op]], crashes: u8) -> Config {
    let roles = menus.iter().map(|m| Role {
        parent: None,
        menu: m.to_vec(),
    });
    Config {
        images,
        roles: roles.collect(),
        crashes,
        losses: 0,
        rules: Rules::default(),
        records: vec![(A, St::Ready)],
        catalog_check: false,
        legacy: false,
    }
}

/// Process `child` is called by the command of `parent`.
fn nested(mut cfg: Config, child: usize, parent: u8) -> Config {
    cfg.roles[child].parent = Some(parent);
    cfg
}

/// Exec (read, write, `--from`, a new image, slots), rm and gc, a call
/// nested in P0's command: 3 processes × 2 images (A ready, B new), one
/// crash. (A nested slot wait beside an outside slot holder is a known
/// limit, checked on its own: P1 takes no slot.)
fn default_config() -> Config {
    nested(
        config(
            2,
            &[
                &[read(A), slot(write(A)), from(A, B), GC],
                &[write(A), Op::Rm(A), write(B), GC],
                &[read(A), slot(write(B))],
            ],
            1,
        ),
        2,
        0,
    )
}

/// A store-wide command (deleting A's tree, or a write of A instead),
/// beside a read, a new image, a removal and another hold; P2 runs inside
/// P0's hold or its write. (A write inside a hold is a known bug, checked
/// on its own.)
fn store_config() -> Config {
    nested(
        config(
            2,
            &[
                &[sw(Some(A)), write(A)],
                &[read(A), write(B), Op::Rm(A), sw(None)],
                &[read(A)],
            ],
            1,
        ),
        2,
        0,
    )
}

/// gc (with and without a budget) and doctor beside writes and reads,
/// while the catalog may be lost: A ready, B adopted (readiness unknown),
/// one crash, one catalog loss, every move compared under every loss.
fn catalog_config() -> Config {
    let mut cfg = config(
        2,
        &[
            &[write(A), read(A), read(B), write(B)],
            &[GC_LRU, GC, Op::Doctor],
        ],
        1,
    );
    cfg.records.push((B, St::Adopted));
    cfg.losses = 1;
    cfg.catalog_check = true;
    cfg
}

/// doctor --repair beside a store-wide command deleting A's tree, a write
/// of A, a read and a removal (interrupted by the crash): 3 processes × 1
/// image.
fn doctor_config() -> Config {
    config(
        1,
        &[
            &[sw(Some(A)), write(A)],
            &[Op::Doctor],
            &[read(A), Op::Rm(A)],
        ],
        1,
    )
}

/// Two readers and a writer of one image: enough for a reader to pass a
/// waiting writer.
fn readers_and_writer() -> Config {
    config(1, &[&[read(A)], &[write(A)], &[read(A)]], 0)
}

struct Run {
    unique: usize,
    total: usize,
    depth: usize,
    secs: f64,
    /// Property name, whether it is a situation to reach (not an
    /// invariant), and the trace, for every property with a discovery.
    found: Vec<(&'static str, bool, String)>,
}

fn run(cfg: Config, stop_at: Option<&'static str>) -> Run {
    let t0 = Instant::now();
    let builder = Proto::new(cfg).checker().threads(1);
    match stop_at {
        // Breadth first: the shortest counterexample.
        Some(name) => report(
            builder
                .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name])))
                .spawn_bfs()
                .join(),
            t0,
        ),
        None => report(
            builder
                .finish_when(HasDiscoveries::AnyFailures)
                .spawn_dfs()
                .join(),
            t0,
        ),
    }
}

fn report(checker: impl Checker<Proto>, t0: Instant) -> Run {
    let secs = t0.elapsed().as_secs_f64();
    let model = checker.model();
    let mut found = Vec::new();
    for p in model.properties() {
        if let Some(path) = checker.discovery(p.name) {
            let sometimes = p.expectation == Expectation::Sometimes;
            found.push((p.name, sometimes, trace::render(model, path.into_vec())));
        }
    }
    Run {
        unique: checker.unique_state_count(),
        total: checker.state_count(),
        depth: checker.max_depth(),
        secs,
        found,
    }
}

/// Checks every invariant exhaustively, and that each situation of
/// `reach` happens (else the invariants might hold only because nothing
/// interesting ever does).
fn assert_holds(what: &str, cfg: Config, reach: &[&str]) {
    let r = run(cfg, None);
    eprintln!(
        "{what}: {} states ({} generated), depth {}, {:.2} s",
        r.unique, r.total, r.depth, r.secs
    );
    let bad: Vec<_> = r.found.iter().filter(|f| !f.1).collect();
    for (name, _, trace) in &bad {
        eprintln!("VIOLATED: {name}\n{trace}");
    }
    assert!(bad.is_empty(), "{what}: the protocol breaks an invariant");
    for name in reach {
        assert!(
            r.found.iter().any(|(n, s, _)| n == name && *s),
            "{what}: never reached: {name}"
        );
    }
}

/// Checks that the checker finds `property` violated (a rule turned off,
/// or a known bug), and returns the counterexample.
fn found(what: &str, cfg: Config, property: &'static str) -> String {
    let r = run(cfg, Some(property));
    let (_, _, trace) = r
        .found
        .iter()
        .find(|(n, _, _)| *n == property)
        .unwrap_or_else(|| panic!("{what}: the checker did not find '{property}' violated"));
    eprintln!(
        "{what}: '{property}' violated ({} states, {:.2} s):\n{trace}",
        r.unique, r.secs
    );
    trace.clone()
}

/// Checks that `cfg` keeps every invariant, and that with `mutate` applied
/// the checker finds `property` violated; returns the counterexample.
fn mutation(
    what: &str,
    cfg: Config,
    mutate: impl FnOnce(&mut Rules),
    property: &'static str,
) -> String {
    assert_holds(&format!("{what}: with the rule"), cfg.clone(), &[]);
    let mut cfg = cfg;
    mutate(&mut cfg.rules);
    found(what, cfg, property)
}

const EXCLUSION: &str = "never two writers in one tree, never a reader beside a writer";
const READS_READY: &str = "a reader at work reads a ready record over a whole tree";
const READY_WHOLE: &str = "a ready record only over a whole tree";
const NO_ORPHAN: &str = "no tree without a record but its maker's";
const EVIDENCE: &str = "gc, repair and holds destroy records only on positive evidence";
const TORN: &str = "a torn write never loses the record before it";
const HOLD_ALONE: &str = "while a store-wide hold is granted, nobody else is at work on an image";
const CATALOG: &str = "the catalog decides nothing";
const DEADLOCK: &str = "no deadlock";
const BYPASS: &str = "no new reader passes a waiting writer";
const ADOPTED: &str = "an adopted record names a tree that is there";

// -- the protocol holds -------------------------------------------------------

const DEFAULT_REACHED: &[&str] = &[
    "a reader's command runs",
    "a new image becomes ready",
    "an image is removed",
    "gc collects a failed or dead writer's image",
    "an interrupted removal is finished",
    "a dead writer's record reads incomplete",
    "a waiter is blocked on an unlinked lock file",
    "a command outlives its killed stowage, holding the lock",
    "a torn write leaves the record before it",
    "a nested reader holds the image while a writer waits",
    "a process works under its enclosing command's slot",
];

const STORE_REACHED: &[&str] = &[
    "a reader's command runs",
    "a store-wide hold waits for an image user",
    "an exec waits for a granted store-wide hold",
    "a store-wide command's deleted image is forgotten",
    "a waiter is blocked on an unlinked lock file",
];

const CATALOG_REACHED: &[&str] = &[
    "a lost catalog is rebuilt from the records",
    "gc collects a failed or dead writer's image",
    "an image is removed",
    "a dead writer's record reads incomplete",
];

const DOCTOR_REACHED: &[&str] = &[
    "an interrupted removal is finished",
    "a store-wide command's deleted image is forgotten",
    "a store-wide hold waits for an image user",
];

#[test]
fn exec_rm_and_gc_hold_with_crashes() {
    assert_holds(
        "exec, rm, gc: 3 processes × 2 images, 1 crash",
        default_config(),
        DEFAULT_REACHED,
    );
}

#[test]
fn store_wide_holds_hold_with_crashes() {
    assert_holds(
        "store-wide: 3 processes × 2 images, 1 crash",
        store_config(),
        STORE_REACHED,
    );
}

#[test]
fn gc_and_doctor_hold_when_the_catalog_is_lost() {
    assert_holds(
        "catalog: 2 processes × 2 images, 1 crash, 1 catalog loss",
        catalog_config(),
        CATALOG_REACHED,
    );
}

#[test]
fn doctor_holds_beside_holds_and_removals() {
    assert_holds(
        "doctor: 3 processes × 1 image, 1 crash",
        doctor_config(),
        DOCTOR_REACHED,
    );
}

// -- each rule, turned off ------------------------------------------------------

/// A waiter that keeps the lock of a file unlinked while it waited (by a
/// removal) writes a tree another writer has under a new lock file.
#[test]
fn without_the_recheck_after_flock_two_writers_meet() {
    let cfg = config(1, &[&[Op::Rm(A)], &[write(A)], &[write(A)]], 0);
    let trace = mutation("no re-check", cfg, |r| r.no_recheck = true, EXCLUSION);
    assert!(trace.contains("rm A: drop"), "{trace}");
}

/// A removal that unlinks the lock file without marking it gone: the
/// waiter reads the record (`deleting`) in the unlinked file, takes it as
/// proof that the file is at its path, and writes beside the next writer.
#[test]
fn without_marking_before_unlink_a_record_proves_a_ghost() {
    let cfg = config(1, &[&[Op::Rm(A)], &[write(A)], &[write(A)]], 0);
    let trace = mutation(
        "not marked before unlink",
        cfg,
        |r| r.unlink_unmarked = true,
        EXCLUSION,
    );
    assert!(trace.contains("unlinked files still saying"), "{trace}");
}

/// Unlinkers that empty the file instead of marking it gone: a writer
/// that waited on a lock file unlinked meanwhile finds it empty, takes
/// that as a new image's fresh file at its path, and writes beside the
/// next writer of the image.
#[test]
fn emptied_instead_of_marked_an_unlinked_file_passes_for_a_fresh_one() {
    let cfg = config(1, &[&[Op::Rm(A)], &[write(A)], &[write(A)]], 0);
    let trace = mutation(
        "emptied, not marked, before unlink",
        cfg,
        |r| r.unlink_emptied = true,
        EXCLUSION,
    );
    assert!(trace.contains("rm A"), "{trace}");
}

/// The command touches the tree before the `writing` record replaces
/// `ready`: a ready record over a partial tree.
#[test]
fn without_the_writing_record_first_ready_stands_over_a_partial_tree() {
    let cfg = config(1, &[&[write(A)]], 1);
    let trace = mutation(
        "tree before record",
        cfg,
        |r| r.tree_before_record = true,
        READY_WHOLE,
    );
    assert!(trace.contains("spawn"), "{trace}");
}

/// A new image's `mkdir` before its `creating` record, killed between: a
/// tree no record names, which no gc can collect.
#[test]
fn without_the_record_before_mkdir_a_crash_leaves_an_orphan_tree() {
    let cfg = config(2, &[&[write(B)]], 1);
    let trace = mutation(
        "mkdir before record",
        cfg,
        |r| r.mkdir_before_record = true,
        NO_ORPHAN,
    );
    assert!(trace.contains("SIGKILL"), "{trace}");
}

/// The outcome written after the lock went: the next writer's `writing`
/// is overwritten by `ready` while its command runs.
#[test]
fn without_the_record_before_unlock_ready_lands_on_another_write() {
    let cfg = config(1, &[&[write(A)], &[write(A)]], 0);
    mutation(
        "record after unlock",
        cfg,
        |r| r.record_after_unlock = true,
        READY_WHOLE,
    );
}

/// A reader that judges by the record it read before its lock (it waited
/// behind a writer whose command then failed).
#[test]
fn without_the_ready_check_under_the_lock_a_reader_reads_a_failed_write() {
    let cfg = config(1, &[&[read(A)], &[write(A)]], 0);
    let trace = mutation(
        "ready read before the lock",
        cfg,
        |r| r.reads = Reads::BeforeLock,
        READS_READY,
    );
    assert!(trace.contains("exits ≠0"), "{trace}");
}

/// A reader that asks the catalog whether the image is ready: a replaced
/// catalog makes a failed image readable.
#[test]
fn a_reader_consulting_the_catalog_reads_a_failed_image() {
    let mut cfg = config(2, &[&[read(B)]], 0);
    cfg.records.push((B, St::Failed));
    cfg.losses = 1;
    cfg.catalog_check = true;
    mutation(
        "reader consults the catalog",
        cfg.clone(),
        |r| r.reads = Reads::Catalog,
        CATALOG,
    );
    cfg.catalog_check = false;
    cfg.rules.reads = Reads::Catalog;
    let trace = found("reader consults the catalog", cfg, READS_READY);
    assert!(trace.contains("Replace"), "{trace}");
}

/// gc that takes an adopted image (readiness unknown) for a failed one.
#[test]
fn without_positive_evidence_gc_collects_an_adopted_image() {
    let mut cfg = config(2, &[&[GC]], 0);
    cfg.records.push((B, St::Adopted));
    mutation(
        "adopted taken as failed",
        cfg,
        |r| r.gc_takes_adopted = true,
        EVIDENCE,
    );
}

/// gc that trusts its survey: the failed image it listed was rewritten
/// (ready) before its lock was taken.
#[test]
fn without_the_recheck_under_its_lock_gc_collects_a_rewritten_image() {
    let mut cfg = config(2, &[&[GC], &[write(B)]], 0);
    cfg.records.push((B, St::Failed));
    mutation(
        "gc trusts its survey",
        cfg,
        |r| r.gc_trusts_survey = true,
        EVIDENCE,
    );
}

/// gc that judges by the catalog under the lock: a replaced catalog says
/// a ready image failed.
#[test]
fn gc_consulting_the_catalog_collects_a_ready_image() {
    let mut cfg = config(1, &[&[GC]], 0);
    cfg.losses = 1;
    cfg.catalog_check = true;
    mutation(
        "gc consults the catalog",
        cfg.clone(),
        |r| r.gc_trusts_catalog = true,
        CATALOG,
    );
    cfg.catalog_check = false;
    cfg.rules.gc_trusts_catalog = true;
    found("gc consults the catalog", cfg, EVIDENCE);
}

/// doctor unlinking the lock files its listing found empty, without
/// looking again under the lock: a new image's record goes with its file.
#[test]
fn without_the_recheck_before_unlink_doctor_drops_a_new_image() {
    let cfg = config(2, &[&[write(B)], &[Op::Doctor]], 0);
    let trace = mutation(
        "unlink without re-check",
        cfg,
        |r| r.unlink_unchecked = true,
        EVIDENCE,
    );
    assert!(trace.contains("unlink-empty"), "{trace}");
}

/// One record slot, written in place: a torn write loses the state.
#[test]
fn without_two_slots_a_torn_write_loses_the_record() {
    let cfg = config(1, &[&[write(A), Op::Rm(A)]], 1);
    let trace = mutation("one slot", cfg, |r| r.one_slot = true, TORN);
    assert!(trace.contains("crash in the middle"), "{trace}");
}

/// A new image's writer that does not ask `store.lock`: its lock file,
/// made after the hold's pass, carries no hint.
#[test]
fn without_the_probe_a_new_image_is_made_beside_a_hold() {
    let cfg = config(2, &[&[sw(None)], &[write(B)]], 0);
    mutation(
        "no probe for new images",
        cfg,
        |r| r.no_probe_new = true,
        HOLD_ALONE,
    );
}

/// A reader that ignores the store-wide hint.
#[test]
fn without_the_hint_check_a_reader_runs_beside_a_hold() {
    let cfg = config(1, &[&[sw(None)], &[read(A)]], 0);
    mutation("hint ignored", cfg, |r| r.hint_ignored = true, HOLD_ALONE);
}

/// A hold that sets the hint only before it takes each lock: a reader
/// that found a dead hold's hint and `store.lock` free clears it while the
/// new hold waits for it; the next reader sees no hint.
#[test]
fn without_the_hint_set_again_under_the_lock_a_reader_runs_beside_a_hold() {
    let cfg = config(1, &[&[sw(None)], &[read(A)], &[read(A)], &[sw(None)]], 1);
    let trace = mutation(
        "hint not set again",
        cfg,
        |r| r.no_rehint = true,
        HOLD_ALONE,
    );
    assert!(trace.contains("clear-hints"), "{trace}");
}

/// Readers that do not queue at the gate behind a waiting writer.
#[test]
fn without_the_gate_new_readers_pass_a_waiting_writer() {
    mutation(
        "no gate",
        readers_and_writer(),
        |r| r.no_gate = true,
        BYPASS,
    );
}

/// No nested-call rule: the command of a reader reads the image again
/// while a writer queues in between.
#[test]
fn without_the_nested_call_rule_a_nested_reader_deadlocks() {
    let cfg = nested(config(1, &[&[read(A)], &[write(A)], &[read(A)]], 0), 2, 0);
    let trace = mutation("no nested-call rule", cfg, |r| r.no_nested = true, DEADLOCK);
    assert!(trace.contains("P1: Wait(0)"), "{trace}");
}

// -- known bugs and limits ----------------------------------------------------------

/// An image made inside a store-wide command (its writer's probe says
/// "inside") must carry the hold's hint: without it, once ready, a read
/// from outside asks nothing and runs while the hold's command runs
/// (which may delete that tree). (Found by the checker in the code.)
#[test]
fn without_the_hint_inside_a_hold_a_new_image_is_read_beside_it() {
    let cfg = nested(config(2, &[&[sw(None)], &[read(B)], &[write(B)]], 0), 2, 0);
    let trace = mutation(
        "write inside a hold, unhinted",
        cfg,
        |r| r.no_hint_inside_hold = true,
        HOLD_ALONE,
    );
    assert!(trace.contains("P1 exec --read B: check"), "{trace}");
}

/// doctor must ask `store.lock` again under each image's lock before it
/// clears a stale hint: asked once, a hold that began between has hinted
/// (and passed) that image, loses its hint, and a read runs beside the
/// hold's command. (Found by the checker in the code.)
#[test]
fn without_asking_again_under_each_lock_doctor_clears_a_live_hint() {
    let cfg = config(1, &[&[sw(None)], &[Op::Doctor], &[read(A)], &[sw(None)]], 1);
    let trace = mutation(
        "doctor asks once",
        cfg,
        |r| r.doctor_probes_once = true,
        HOLD_ALONE,
    );
    assert!(trace.contains("clear-hint"), "{trace}");
}

/// Adoption must look at the tree again under the lock: a new image's
/// writer whose start was undone took its tree back after doctor's
/// listing, and the adoption (which makes the lock file anew) would write
/// `incomplete (adopted)` for a tree that is not there — an image gc
/// never collects. (Found by the checker in the code.)
#[test]
fn without_the_tree_checked_under_the_lock_doctor_adopts_a_tree_taken_back() {
    let cfg = config(2, &[&[write(B)], &[Op::Doctor]], 0);
    let trace = mutation(
        "adoption unchecked",
        cfg,
        |r| r.adopt_unchecked = true,
        ADOPTED,
    );
    assert!(trace.contains("abandon"), "{trace}");
}

/// A new image's first record is written over the whole area: it must
/// keep the hints, or the `W` of a writer already waiting at the gate is
/// erased and new readers pass it (fairness). (Found by the checker.)
#[test]
fn without_the_hints_kept_a_first_record_lets_readers_pass_a_waiting_writer() {
    let cfg = config(2, &[&[write(B)], &[write(B)], &[read(B)]], 0);
    mutation(
        "first record erases W",
        cfg,
        |r| r.first_write_erases_hints = true,
        BYPASS,
    );
}

/// A catalog of an older release put in place of a migrated store's (an
/// old backup restored) must be set aside, not migrated again: a
/// migration gives each image whose lock file has no record the state its
/// row says, and an image removed since comes back `ready` with no tree.
/// (Found by the checker in the code.)
#[test]
fn without_migrating_only_unconfigured_stores_an_old_catalog_revives_an_image() {
    let mut cfg = config(1, &[&[Op::Rm(A)], &[GC]], 0);
    (cfg.losses, cfg.legacy) = (1, true);
    let trace = mutation(
        "an old catalog migrated",
        cfg.clone(),
        |r| r.migrate_any_old_catalog = true,
        READY_WHOLE,
    );
    assert!(trace.contains("Legacy"), "{trace}");
    cfg.catalog_check = true;
    mutation(
        "an old catalog migrated",
        cfg,
        |r| r.migrate_any_old_catalog = true,
        CATALOG,
    );
}

/// A known limit (design.md, nested calls): a nested call waits for a slot
/// held by an outside exec, which waits for an image the enclosing command
/// holds. The lock order binds each process, not a process tree.
#[test]
fn known_limit_a_nested_slot_wait_can_close_a_cycle() {
    let cfg = nested(
        config(2, &[&[write(B)], &[slot(read(B))], &[slot(read(A))]], 0),
        2,
        0,
    );
    let trace = found("nested slot wait", cfg, DEADLOCK);
    assert!(trace.contains("P2: SlotWait"), "{trace}");
}

// -- bigger sizes ---------------------------------------------------------------

/// `STOWAGE_MODEL_BIG=1 cargo test --release --test model big -- --nocapture`
#[test]
fn big_sizes_when_asked() {
    if std::env::var_os("STOWAGE_MODEL_BIG").is_none() {
        return;
    }
    let more = |mut cfg: Config, crashes, menu: &[Op]| {
        cfg.crashes = crashes;
        if !menu.is_empty() {
            let menu = menu.to_vec();
            cfg.roles.push(Role { parent: None, menu });
        }
        cfg
    };
    let fourth = [read(A), write(B), Op::Rm(B), GC_LRU];
    assert_holds(
        "exec, rm, gc: 2 crashes",
        more(default_config(), 2, &[]),
        DEFAULT_REACHED,
    );
    let four = more(default_config(), 1, &fourth);
    assert_holds("exec, rm, gc: 4 processes, 1 crash", four, DEFAULT_REACHED);
    let four = more(default_config(), 2, &fourth);
    assert_holds(
        "exec, rm, gc: 4 processes, 2 crashes",
        four,
        DEFAULT_REACHED,
    );
    let store = more(store_config(), 2, &[]);
    assert_holds("store-wide: 2 crashes", store, STORE_REACHED);
    let store = more(store_config(), 1, &[read(A), write(A), GC]);
    assert_holds("store-wide: 4 processes, 1 crash", store, STORE_REACHED);
    let mut cat = more(catalog_config(), 2, &[]);
    cat.losses = 2;
    assert_holds("catalog: 2 crashes, 2 losses", cat, CATALOG_REACHED);
    let cat = more(catalog_config(), 1, &[read(A), write(B), Op::Rm(A)]);
    assert_holds(
        "catalog: 3 processes, 1 crash, 1 loss",
        cat,
        CATALOG_REACHED,
    );
    let doctor = more(doctor_config(), 2, &[]);
    assert_holds("doctor: 2 crashes", doctor, DOCTOR_REACHED);
    let mut doctor = more(doctor_config(), 1, &[write(B), GC]);
    doctor.images = 2;
    assert_holds(
        "doctor: 4 processes × 2 images, 1 crash",
        doctor,
        DOCTOR_REACHED,
    );
}

// -- the model against the docs and the code --------------------------------

fn repo(path: &str) -> String {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Names, each with a list of words (steps, or functions).
type Lists = Vec<(String, Vec<String>)>;

/// The `<!-- model-steps -->` block of docs/design.md: `OP: step step …`
/// lines and `step NAME: code, code` lines.
fn design_block() -> (Lists, Lists) {
    let doc = repo("docs/design.md");
    let start = doc
        .find("<!-- model-steps -->")
        .expect("docs/design.md has a <!-- model-steps --> block");
    let end = doc[start..]
        .find("<!-- /model-steps -->")
        .expect("the block is closed")
        + start;
    let words = |s: &str| -> Vec<String> {
        s.split([' ', ',', '|', '`', '→'])
            .filter(|w| !w.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let mut ops = Vec::new();
    let mut code = Vec::new();
    for line in doc[start..end].lines() {
        let line = line.trim().trim_start_matches('|').trim();
        let Some((head, rest)) = line.split_once(':') else {
            continue;
        };
        if head.contains(' ') && !head.starts_with("step ") {
            continue;
        }
        if let Some(step) = head.strip_prefix("step ") {
            // `::` inside the functions is no separator.
            let (_, funcs) = line.split_once(": ").expect("step line");
            code.push((step.trim().to_owned(), words(funcs)));
        } else if !rest.starts_with(':') {
            ops.push((head.to_owned(), words(rest)));
        }
    }
    (ops, code)
}

/// The block as it should read (printed when the docs differ).
fn expected_block() -> String {
    let mut out = String::from("<!-- model-steps -->\n```text\n");
    let ops = steps::protocol();
    let w = ops.iter().map(|(o, _)| o.len()).max().unwrap_or(0) + 1;
    for (op, st) in &ops {
        let names: Vec<&str> = st.iter().map(|s| s.name()).collect();
        out += &format!("{:w$} {}\n", format!("{op}:"), names.join(" "));
    }
    out.push('\n');
    let w = steps::ALL.iter().map(|s| s.name().len()).max().unwrap_or(0) + 6;
    for s in steps::ALL {
        let head = format!("step {}:", s.name());
        out += &format!("{head:w$} {}\n", s.code().join(", "));
    }
    out + "```\n<!-- /model-steps -->\n"
}

#[test]
fn steps_match_design_md() {
    let (ops, code) = design_block();
    let model: Lists = steps::protocol()
        .into_iter()
        .map(|(op, st)| {
            (
                op.to_owned(),
                st.iter().map(|s| s.name().to_owned()).collect(),
            )
        })
        .collect();
    let model_code: Lists = steps::ALL
        .iter()
        .map(|s| {
            let code = s.code().iter().map(|c| (*c).to_owned()).collect();
            (s.name().to_owned(), code)
        })
        .collect();
    if ops != model || code != model_code {
        eprintln!("docs/design.md should have:\n{}", expected_block());
    }
    assert_eq!(
        ops, model,
        "docs/design.md's protocol steps differ from the model's"
    );
    assert_eq!(
        code, model_code,
        "docs/design.md's step functions differ from the model's"
    );
}

#[test]
fn every_step_belongs_to_an_operation() {
    for s in steps::ALL {
        assert!(
            steps::protocol().iter().any(|(_, st)| st.contains(s)),
            "{s:?} belongs to no operation"
        );
    }
}

#[test]
fn every_step_names_a_function_of_src() {
    for s in steps::ALL {
        for f in s.code() {
            let parts: Vec<&str> = f.split("::").collect();
            let (item, module) = parts.split_last().expect("module::item");
            let file = format!("src/{}.rs", module.join("/"));
            let folder = format!("src/{}/mod.rs", module.join("/"));
            let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
            let text = repo(if root.join(&file).exists() {
                &file
            } else {
                &folder
            });
            let found = [format!("fn {item}("), format!("fn {item}<")]
                .iter()
                .any(|pat| text.contains(pat.as_str()));
            assert!(found, "{s:?} names {f}, which {file} does not define");
        }
    }
}

/// Under the global lock (a catalog transaction) a process may try a lock,
/// never wait for one.
#[test]
fn no_transaction_step_waits() {
    for s in steps::ALL {
        assert!(
            !(s.in_transaction() && s.blocks()),
            "{s:?} would wait for a lock while holding the global lock"
        );
    }
}
