//! The lock protocol as a state machine, for exhaustive checking.
//!
//! Processes are `stowage` invocations (with their command), images are
//! small indices, ENC order is index order. Every step is one atomic move of
//! one process; a step inside a transaction is atomic because the global
//! lock serialises transactions, and no transaction step ever blocks (see
//! `Step::in_transaction` and `Step::blocks`). Crashes (SIGKILL of one
//! stowage, or a host with everything on it) may happen between any two
//! steps.
//!
//! What the kernel does is modelled as it is: a flock belongs to an open
//! file description (here: to a process's set of descriptors), shared or
//! exclusive, released when the last descriptor closes; a command inherits
//! the image and slot descriptors unless `--no-inherit`; a lock file has a
//! generation, so a process may hold a lock on a file that was unlinked
//! since it opened it (a ghost).
//!
//! Leases are lock files too: one per process that locks something, made
//! in two steps (open, then lock and re-check) so that a cleaning prober
//! can come between, held by the process's descriptors (and so inherited
//! with its image locks), probed to judge its records. The look that
//! cleans them holds the global lock over several steps (`State::global`);
//! every other transaction is one step. `exec --store-wide` is its
//! `store.lock`, a record every claiming transaction honours, and the wait
//! for every image lock and slot to be free.
//!
//! Ready tokens (src/record.rs) belong to lock files: a plain read that
//! finds one takes the fast path (its image lock, then a try of
//! `store.lock`) and never transacts; every change of a row away from
//! ready invalidates the token first, in a step of its own, and a token is
//! written in a step after the commit that saw the row ready, so that a
//! crash can fall between either pair.
//!
//! Writes without the database (src/written.rs): a write of one image whose
//! lock is free and holds a ready token takes it exclusively at once
//! (`fast-write`), makes the marker (`marker`), replaces the token with a
//! `writing` record (`writing`), runs its command and writes `ready` (a
//! token) or `incomplete` (`record`), each a step of its own; one whose
//! command never runs puts the token back (`put-back`). Every transaction
//! that is not cleanup (`waiter`, `start`, `mark`, gc's and doctor's
//! `sweep`) begins, under the global lock, with the fold: every marker
//! whose image lock it gets shared without waiting, or holds exclusively
//! itself, has its record folded into the row and committed (`fold`), then
//! is unlinked while that lock is still held (`fold-unlink`); a crash may
//! fall between. Holders fold what they read under their lock (`start`,
//! gc's re-check). `whole` is the truth those guarantees are about: false
//! from the start of a writer's command (or copy) until one exits 0.

use stateright::{Model, Property};

use crate::steps::Step;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    Shared,
    Exclusive,
}

/// A lock file: an image's (with its generation), its gate, a slot file,
/// a lease (owner, name, generation: the owner makes a file anew under the
/// same name when a prober unlinked the one it made), `store.lock`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    Img(u8, u8),
    Gate(u8),
    Slot(u8),
    Lease(u8, u8, u8),
    Store,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Row {
    Creating,
    Writing,
    Ready,
    Incomplete,
    Deleting,
}

impl Row {
    fn being_written(self) -> bool {
        matches!(self, Row::Creating | Row::Writing)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Prio {
    Normal,
    High,
}

/// What a process does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `exec [--read R | --read-exclusive R] [--write W [--from R]]
    /// [--slot C --priority P] [--no-inherit]`.
    Exec {
        read: Option<u8>,
        /// `read` is `--read-exclusive`: locked exclusively, must be ready,
        /// its state left as it is.
        read_excl: bool,
        write: Option<u8>,
        from: bool,
        slot: Option<Prio>,
        inherit: bool,
    },
    /// `exec --store-wide [--no-inherit]`, whose command may delete an
    /// image's tree (`ch-image build-cache --reset`).
    StoreWide {
        inherit: bool,
        deletes: Option<u8>,
    },
    Rm(u8),
    Gc,
    /// `doctor --repair`.
    Doctor,
    /// `lock-status` / `images`: a look at every record.
    Look,
}

pub fn exec_read(i: u8) -> Op {
    Op::Exec {
        read: Some(i),
        read_excl: false,
        write: None,
        from: false,
        slot: None,
        inherit: true,
    }
}

pub fn exec_write(i: u8) -> Op {
    Op::Exec {
        read: None,
        read_excl: false,
        write: Some(i),
        from: false,
        slot: None,
        inherit: true,
    }
}

pub fn img_name(i: u8) -> char {
    (b'A' + i) as char
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Op::Exec {
                read,
                read_excl,
                write,
                from,
                slot,
                inherit,
            } => {
                write!(f, "exec")?;
                match (read, from, read_excl) {
                    (Some(r), false, false) => write!(f, " --read {}", img_name(r))?,
                    (Some(r), false, true) => write!(f, " --read-exclusive {}", img_name(r))?,
                    (Some(r), true, _) => write!(f, " --from {}", img_name(r))?,
                    _ => {}
                }
                if let Some(w) = write {
                    write!(f, " --write {}", img_name(w))?;
                }
                match slot {
                    Some(Prio::Normal) => write!(f, " --slot c")?,
                    Some(Prio::High) => write!(f, " --slot c --priority high")?,
                    None => {}
                }
                if !inherit {
                    write!(f, " --no-inherit")?;
                }
                Ok(())
            }
            Op::StoreWide { inherit, deletes } => {
                write!(f, "exec --store-wide")?;
                if !inherit {
                    write!(f, " --no-inherit")?;
                }
                if let Some(i) = deletes {
                    write!(f, " -- (deletes {})", img_name(i))?;
                }
                Ok(())
            }
            Op::Rm(i) => write!(f, "rm {}", img_name(i)),
            Op::Gc => write!(f, "gc"),
            Op::Doctor => write!(f, "doctor --repair"),
            Op::Look => write!(f, "lock-status"),
        }
    }
}

/// One process slot of the configuration.
#[derive(Clone, Debug)]
pub struct Role {
    pub host: u8,
    /// A nested call: run by the command of this process.
    pub parent: Option<u8>,
    /// The operations it may do (one of them, chosen by the checker).
    pub menu: Vec<Op>,
}

/// The protocol's rules, each of which a mutation test turns off.
#[derive(Clone, Debug)]
pub struct Rules {
    /// A reader whose enclosing command holds the image passes the gate; a
    /// wait that would wait for the enclosing command fails at once (and a
    /// full slot class held by it is worked under).
    pub nested: bool,
    /// After flock, check that the file is still the one at the path.
    pub recheck: bool,
    /// Writer preference through the gate.
    pub gate: bool,
    /// `--no-inherit`: the command's tree is killed before the locks go.
    pub keeper: bool,
    /// The lock table names holders (local filesystem): a `--no-inherit`
    /// ancestor's hold is found. On NFS only inherited descriptors are.
    pub local_fs: bool,
    /// Records judged by their owner's lease (and, locally, holders by the
    /// lock table's entry of the owner). Off: by the lock's mode alone, as
    /// records of releases before leases are on NFS.
    pub leases: bool,
    /// The lease's owner, after locking its fresh file, checks that the file
    /// is still the one at the path, and makes it again if not.
    pub lease_recheck: bool,
    /// A prober unlinks a lease only under its exclusive lock. Off: it
    /// unlinks the leases its probe found free.
    pub lease_unlink_locked: bool,
    /// A prober leaves a lease its owner has not written yet (a fresh file
    /// whose owner may be between its create and its lock), unless it
    /// knows the owner is gone: a process of its own host that is dead.
    /// What lets the owner skip the re-check.
    pub lease_unwritten_kept: bool,
    /// Claiming transactions (an exec's start, a removal's mark) honour a
    /// live store-wide hold.
    pub store_check: bool,
    /// Inside the command of an image or slot user: a claim passes a live
    /// store-wide hold (slots counted, not only images), and a store-wide
    /// call fails at once instead of waiting for the store (Hold::take).
    /// Off: the rules before, which the checker shows can deadlock.
    pub nested_store: bool,
    /// A writer invalidates its image's ready token before its `start`.
    pub writer_invalidates: bool,
    /// A removal (rm, gc, doctor) invalidates the token before its `mark`.
    pub remove_invalidates: bool,
    /// `doctor --repair` invalidates the token of a ready image whose tree
    /// is gone before it drops the row.
    pub doctor_invalidates: bool,
    /// Where a read of the fast path asks whether `store.lock` is free.
    pub fast_store: FastStore,
    /// A writer that waits sets the writer-waits hint, holding the gate.
    pub writer_hints: bool,
    /// A store-wide hold sets the store-wide hint on every image lock file
    /// before it checks that every image lock is free.
    pub store_marks: bool,
    /// A fast read sent to `store.lock` by the store-wide hint reads its
    /// tokens again once it holds `store.lock` shared (`Session::begin_fast`;
    /// off: trusting what `try_ready` read before, as the first version
    /// did). See `without_the_token_reread_a_fast_read_runs_on_an_image_a_store_wide_command_deleted`.
    pub token_after_store: bool,
    /// No ready token is written while a store-wide hold stands (a
    /// transaction that passed one from inside, a finish that finds one):
    /// a lock file made after the hold's pass has no store-wide hint, so a
    /// token on it would let an outside read past the hold. See
    /// `without_no_token_beside_a_hold_an_outside_read_runs_beside_it`.
    pub no_token_beside_hold: bool,
    /// A write without the database makes its marker before it replaces
    /// the token with its `writing` record (off: after).
    pub marker_first: bool,
    /// A fold unlinks its markers after its transaction committed (off:
    /// before the commit, a crash between them possible).
    pub unlink_after_commit: bool,
    /// A fold leaves alone a marker whose lock another process holds
    /// exclusively (off: folds it anyway, reading the record of a write in
    /// progress).
    pub skip_busy: bool,
    /// Whoever holds an image folds the record it reads under its lock:
    /// the slow path's start (a writer: the record read before it took the
    /// token away), gc's recheck.
    pub holder_folds: bool,
    /// The fold of a marker whose image the folding writer holds through
    /// its own guard reads the record the writer read before it took the
    /// token away, not the emptied lock file. (The code leaves such a
    /// marker out of its listing; the holder's start folds that record
    /// and takes the marker away after its commit: the same row, the same
    /// marker gone under the same locks.)
    pub own_fold_reads_before: bool,
}

/// When a read of the fast path tries `locks/store.lock` shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FastStore {
    /// After taking its image locks, when the store-wide hint in a lock
    /// file says a hold may run (`Session::begin_fast`): a hold that checks
    /// the image locks later finds them held and waits.
    AfterLocks,
    /// Before its image locks, hint or not (a mutation).
    BeforeLocks,
    /// Never: the hint ignored (a mutation).
    Never,
}

impl Default for Rules {
    fn default() -> Self {
        Rules {
            nested: true,
            recheck: true,
            gate: true,
            keeper: true,
            local_fs: true,
            leases: true,
            lease_recheck: false,
            lease_unlink_locked: true,
            lease_unwritten_kept: true,
            store_check: true,
            nested_store: true,
            writer_invalidates: true,
            remove_invalidates: true,
            doctor_invalidates: true,
            fast_store: FastStore::AfterLocks,
            writer_hints: true,
            store_marks: true,
            token_after_store: true,
            no_token_beside_hold: true,
            marker_first: true,
            unlink_after_commit: true,
            skip_busy: true,
            holder_folds: true,
            own_fold_reads_before: true,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub images: u8,
    pub roles: Vec<Role>,
    /// How many crashes (a process, or a host) one run may have.
    pub crashes: u8,
    pub slot_limit: u8,
    pub slot_reserve: u8,
    pub rules: Rules,
    /// Images that exist (ready, with a ready token in their lock files)
    /// at the start.
    pub ready_at_start: Vec<u8>,
    /// Writes of an existing image try the way without the database
    /// (src/written.rs) first.
    pub fast_writes: bool,
    /// A listing of `locks/dirty` may miss the markers (an NFS client's
    /// cached directory), in which case the transaction folds nothing.
    pub nfs_listing: bool,
}

/// The program counter of a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pc {
    /// Not started (a nested one: its parent's command has not called it).
    Choose,
    /// The lease: open (creating) a fresh name, then lock it and re-check.
    LeaseCreate,
    LeaseLock,
    /// A plain read's fast path (`Session::begin_fast`): the image lock
    /// tried with the gate check and its ready token read, then
    /// `store.lock` tried shared; any miss goes the slow way (`Try`).
    FastTry,
    FastStore,
    /// A write without the database (src/written.rs): the image lock taken
    /// at once, exclusively, over a ready token and no store-wide hint
    /// (else the slow way, holding nothing); the marker; the `writing`
    /// record; after the command, the `ready` or `incomplete` record; or,
    /// when the command never ran, the token put back.
    FastWrite,
    FastMarker,
    FastWriting,
    FastRecord,
    PutBack,
    /// A writer makes its images' ready tokens say nothing, before `Start`.
    Invalidate,
    /// The ready token a writer writes after its `Finish` committed the
    /// row ready (a slow-path reader writes its token inside its `Start`
    /// transaction, an exclusive reader inside its `Finish`).
    FinishToken,
    /// `exec --store-wide`: `store.lock`, the record, the wait for every
    /// image lock and slot to be free.
    StoreLock,
    StoreRecord,
    StoreFree,
    StoreWaitFree(Key),
    /// An exec that found a store-wide hold at its start, holding nothing.
    StoreAwait,
    /// `forget_deleted`: the tokens of images whose trees the command
    /// deleted, then (`StoreEnd`) their rows, in one transaction.
    StoreInvalidate,
    /// The hold ends (`true`: `Hold::release`, which forgets deleted
    /// images first; `false`: `Hold::take` failing).
    StoreEnd(bool),
    SlotTry,
    SlotWaiter,
    SlotWait,
    Try(u8),
    Waiter(u8),
    Gate(u8),
    Wait(u8),
    Start,
    Clone,
    ReleaseBase,
    Spawn,
    Command,
    Abandon,
    Finish,
    Release,
    /// Removal of an image whose exclusive lock is held; `Ret` says where
    /// to go on. Its token is invalidated first.
    InvalidateRm(u8, Ret),
    Mark(u8, Ret),
    Trash(u8, Ret),
    DropRow(u8, Ret),
    Unlink(u8, Ret),
    DeleteTrash(u8, Ret),
    ListInterrupted,
    LockInterrupted(u8),
    OrphanLock(u8),
    Sweep,
    /// Cleaning the leases of dead owners (in the look's transaction).
    CleanLock,
    CleanUnlink,
    Collect(u8),
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ret {
    Rm,
    Interrupted,
    Collect,
}

impl Pc {
    pub fn step(self) -> Option<Step> {
        Some(match self {
            Pc::Choose | Pc::Done => return None,
            Pc::LeaseCreate => Step::LeaseCreate,
            Pc::LeaseLock => Step::LeaseLock,
            Pc::FastTry => Step::FastTry,
            Pc::FastStore => Step::FastStore,
            Pc::FastWrite => Step::FastWrite,
            Pc::FastMarker => Step::Marker,
            Pc::FastWriting => Step::Writing,
            Pc::FastRecord => Step::Record,
            Pc::PutBack => Step::PutBack,
            Pc::Invalidate | Pc::InvalidateRm(..) | Pc::StoreInvalidate => Step::Invalidate,
            Pc::FinishToken => Step::Token,
            Pc::StoreLock => Step::StoreLock,
            Pc::StoreRecord => Step::StoreRecord,
            Pc::StoreFree => Step::StoreFree,
            Pc::StoreWaitFree(_) => Step::StoreWaitFree,
            Pc::StoreAwait => Step::StoreAwait,
            Pc::StoreEnd(_) => Step::StoreEnd,
            Pc::CleanLock => Step::CleanLock,
            Pc::CleanUnlink => Step::CleanUnlink,
            Pc::SlotTry => Step::SlotTry,
            Pc::SlotWaiter => Step::SlotWaiter,
            Pc::SlotWait => Step::SlotWait,
            Pc::Try(_) => Step::Try,
            Pc::Waiter(_) => Step::Waiter,
            Pc::Gate(_) => Step::Gate,
            Pc::Wait(_) => Step::Wait,
            Pc::Start => Step::Start,
            Pc::Clone => Step::Clone,
            Pc::ReleaseBase => Step::ReleaseBase,
            Pc::Spawn => Step::Spawn,
            Pc::Command => Step::Command,
            Pc::Abandon => Step::Abandon,
            Pc::Finish => Step::Finish,
            Pc::Release => Step::Release,
            Pc::Mark(..) => Step::Mark,
            Pc::Trash(..) => Step::Trash,
            Pc::DropRow(..) => Step::DropRow,
            Pc::Unlink(..) => Step::Unlink,
            Pc::DeleteTrash(..) => Step::DeleteTrash,
            Pc::ListInterrupted => Step::ListInterrupted,
            Pc::LockInterrupted(_) => Step::LockInterrupted,
            Pc::OrphanLock(_) => Step::OrphanLock,
            Pc::Sweep => Step::Sweep,
            Pc::Collect(_) => Step::Collect,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cmd {
    NotRun,
    Running,
    Exited,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Proc {
    pub op: Option<u8>,
    pub pc: Pc,
    /// The stowage process itself.
    pub alive: bool,
    pub cmd: Cmd,
    /// Image locks it took (and checked), with the generation of the file.
    pub held: Vec<(u8, u8, Mode)>,
    pub slot: Option<u8>,
    /// The generation of the file a blocked wait is on.
    pub wgen: u8,
    /// For the written image: its state before the start (for abandon).
    pub prev: Option<Option<Row>>,
    /// gc/doctor: images listed (deleting, or incomplete for collect), and
    /// images that had rows when listed.
    pub listed: u8,
    pub names: u8,
    /// The command's outcome.
    pub ok: bool,
    /// The lease: its name once made (records name it), the name being
    /// made, and the generation of the file opened under that name.
    pub lease: Option<u8>,
    pub lname: u8,
    pub lgen: u8,
    /// Lease paths a cleaning prober is about to unlink.
    pub doomed: Vec<(u8, u8)>,
    /// Past its claim: an exec's start (or a store-wide hold's grant) until
    /// its locks close.
    pub claimed: bool,
    /// Claimed by the fast path (no transaction), until it spawns its
    /// command (no longer: a situation to reach, kept short-lived).
    pub fast: bool,
    /// A write without the database (src/written.rs), from its lock on.
    pub fw: bool,
    /// A slow-path writer: the record of its image read before it took
    /// the token away (folded in its start).
    pub before: Found,
    /// Where the fold of markers before its next transaction is.
    pub fold: Fold,
    /// Image locks taken shared for that fold.
    pub fold_locks: Vec<(u8, u8)>,
}

/// What a lock file's token area holds (record.rs): a valid ready token
/// (a writer's `ready` record is one too), a writer's `writing` or
/// `incomplete` record, or nothing that counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Found {
    Nothing,
    Token,
    Writing,
    Failed,
}

/// The fold of markers that begins a transaction (`Store::begin_raw`),
/// under the global lock held from the listing to the transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fold {
    /// Not begun: the next transaction step lists the markers first.
    Idle,
    /// Rows committed; these markers to unlink next, their locks held.
    Unlink(u8),
    /// (Mutation) markers unlinked; these rows to commit next.
    Commit(u8),
    /// Folded (or nothing to fold): the transaction itself is next.
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RecOf {
    Img(u8),
    /// A slot class's waiter (holders of slots record nothing).
    SlotClass,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RecRole {
    Holder,
    Waiter,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rec {
    pub of: RecOf,
    pub role: RecRole,
    pub mode: Mode,
    pub owner: u8,
}

/// Violations, recorded by the step that commits them.
pub mod bad {
    pub const STALE_RECORD: u8 = 1;
    pub const DELETED_WHILE_LOCKED: u8 = 2;
    pub const BYPASS: u8 = 4;
    pub const LIVE_DROPPED: u8 = 8;
    pub const LEASE_STALE: u8 = 16;
    pub const LIVE_UNLINKED: u8 = 32;
    /// Not a violation: a situation to reach (a clean unlinked the lease of
    /// an owner that is gone).
    pub const CLEANED_DEAD: u8 = 64;
    pub const PASSED_HOLD: u8 = 128;
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub procs: Vec<Proc>,
    /// Every flock: file, owning process (its descriptors), mode. Sorted.
    pub locks: Vec<(Key, u8, Mode)>,
    /// The generation of each image's lock file at its path, if any.
    pub file: Vec<Option<u8>>,
    pub next_gen: Vec<u8>,
    pub rows: Vec<Option<Row>>,
    pub tree: Vec<bool>,
    /// The truth about each image's last write: (in progress, succeeded).
    pub truth: Vec<(bool, bool)>,
    pub records: Vec<Rec>,
    /// Lease files present: (owner, name, generation). Sorted.
    pub lfiles: Vec<(u8, u8, u8)>,
    /// Those of them their owner has written (once it locked them). Sorted.
    pub lwritten: Vec<(u8, u8, u8)>,
    /// Who holds the global lock across steps (a look that cleans leases
    /// takes several; every other transaction is one step).
    pub global: Option<u8>,
    /// The store-wide holder record (its owner).
    pub store_rec: Option<u8>,
    /// Valid ready tokens: (image, generation of its lock file). Sorted.
    pub tokens: Vec<(u8, u8)>,
    /// The hints after the token (record.rs), set on these lock files:
    /// writer waits, store-wide. Sorted.
    pub ww: Vec<(u8, u8)>,
    pub sw: Vec<(u8, u8)>,
    /// Writers' records that are no token (`writing`, `incomplete`), on
    /// lock files. Sorted.
    pub wrecs: Vec<(u8, u8, Found)>,
    /// Markers `locks/dirty/ENC`: a bit per image.
    pub marks: u8,
    /// No write left the image's tree incomplete: false from the moment a
    /// writer's command (or copy) starts changing it until a command of a
    /// writer exits 0.
    pub whole: Vec<bool>,
    pub crashes: u8,
    pub bad: u8,
}

/// One move of the system.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Process starts the operation with this menu index.
    Choose(u8, u8),
    /// Process takes its next step.
    Step(u8),
    /// The other outcome of a step that may fail (a copy, a spawn).
    Fail(u8),
    /// The command of the process exits, successfully or not.
    Exit(u8, bool),
    /// SIGKILL of the stowage process.
    Crash(u8),
    /// A host dies with all its processes.
    HostDies(u8),
}

pub struct Proto {
    pub cfg: Config,
}

impl Proto {
    pub fn new(cfg: Config) -> Self {
        Proto { cfg }
    }

    pub fn op(&self, s: &State, p: usize) -> Option<Op> {
        s.procs[p].op.map(|i| self.cfg.roles[p].menu[i as usize])
    }

    /// The image locks an operation takes, in lock order (ascending ENC).
    pub fn wanted(op: Op) -> Vec<(u8, Mode)> {
        match op {
            Op::Exec {
                read,
                read_excl,
                write,
                ..
            } => {
                let rmode = if read_excl {
                    Mode::Exclusive
                } else {
                    Mode::Shared
                };
                let mut w: Vec<(u8, Mode)> = read
                    .map(|r| (r, rmode))
                    .into_iter()
                    .chain(write.map(|w| (w, Mode::Exclusive)))
                    .collect();
                w.sort();
                w
            }
            Op::Rm(i) => vec![(i, Mode::Exclusive)],
            _ => vec![],
        }
    }

    fn slot_candidates(&self, prio: Prio) -> Vec<u8> {
        let l = self.cfg.slot_limit;
        let normal = 0..l;
        match prio {
            Prio::Normal => normal.collect(),
            Prio::High => (l..l + self.cfg.slot_reserve).chain(normal).collect(),
        }
    }

    // -- flock ---------------------------------------------------------

    fn grantable(s: &State, key: Key, mode: Mode) -> bool {
        s.locks
            .iter()
            .filter(|(k, _, _)| *k == key)
            .all(|(_, _, m)| mode == Mode::Shared && *m == Mode::Shared)
    }

    fn take(s: &mut State, key: Key, p: usize, mode: Mode) {
        s.locks.push((key, p as u8, mode));
        s.locks.sort();
    }

    fn drop_key(s: &mut State, key: Key, p: usize) {
        s.locks.retain(|(k, o, _)| !(*k == key && *o as usize == p));
    }

    /// Closes every descriptor of the process: its flocks go, its lease's
    /// too.
    fn close_all(s: &mut State, p: usize) {
        s.locks.retain(|(_, o, _)| *o as usize != p);
        s.procs[p].held.clear();
        s.procs[p].slot = None;
        s.procs[p].claimed = false;
        s.procs[p].fast = false;
        s.procs[p].fold_locks.clear();
        if s.global == Some(p as u8) {
            s.global = None;
        }
    }

    /// Closes the image and slot descriptors, keeping the lease (a request
    /// that starts over).
    fn close_locks(s: &mut State, p: usize) {
        s.locks
            .retain(|(k, o, _)| *o as usize != p || matches!(k, Key::Lease(..)));
        s.procs[p].held.clear();
        s.procs[p].slot = None;
        s.procs[p].claimed = false;
    }

    // -- leases ------------------------------------------------------------

    /// The generation of the lease file at path (owner, name), if any.
    fn lease_file(s: &State, o: u8, n: u8) -> Option<u8> {
        s.lfiles
            .iter()
            .find(|(fo, fname, _)| *fo == o && *fname == n)
            .map(|f| f.2)
    }

    fn unlink_lease(s: &mut State, o: u8, n: u8) {
        s.lfiles.retain(|(fo, fname, _)| !(*fo == o && *fname == n));
        s.lwritten
            .retain(|(fo, fname, _)| !(*fo == o && *fname == n));
    }

    /// `lease::probe`: the owner's lease file is at its path and held
    /// exclusively. A process without a lease records nothing.
    fn lease_alive(s: &State, o: usize) -> bool {
        let Some(n) = s.procs[o].lease else {
            return false;
        };
        Self::lease_file(s, o as u8, n)
            .is_some_and(|g| !Self::grantable(s, Key::Lease(o as u8, n, g), Mode::Shared))
    }

    /// The truth: the owner, or a command holding what it inherited, lives.
    fn owner_lives(s: &State, o: usize) -> bool {
        s.procs[o].alive || s.procs[o].cmd == Cmd::Running
    }

    // -- store-wide holds --------------------------------------------------

    /// The holder of a store-wide record whose lease (`store.lock`) is held.
    fn live_hold(s: &State) -> Option<usize> {
        let h = s.store_rec?;
        s.locks
            .iter()
            .any(|(k, o, m)| *k == Key::Store && *o == h && *m == Mode::Exclusive)
            .then_some(h as usize)
    }

    /// `store_wide::check`: inside the hold (its command's tree), or in the
    /// command of an image user that the hold waits for.
    fn exempt_from_hold(&self, s: &State, p: usize) -> bool {
        self.enclosing(s, p, Key::Store) == Some(Mode::Exclusive) || self.nested_in_user(s, p)
    }

    /// `store_wide::inherits_lock` / `enclosing_exec_holds_lock`: the
    /// enclosing command holds an image lock, or (under `nested_store`) a
    /// slot.
    fn nested_in_user(&self, s: &State, p: usize) -> bool {
        s.locks.iter().any(|(k, _, _)| {
            (matches!(k, Key::Img(..))
                || (self.cfg.rules.nested_store && matches!(k, Key::Slot(..))))
                && self.enclosing(s, p, *k).is_some()
        })
    }

    /// A claiming transaction looks at the store-wide record: a stale one
    /// goes; a live one refuses the claim (true).
    fn store_refuses(&self, s: &mut State, p: usize) -> bool {
        if s.store_rec.is_none() {
            return false;
        }
        if Self::live_hold(s).is_none() {
            s.store_rec = None;
            return false;
        }
        self.cfg.rules.store_check && !self.exempt_from_hold(s, p)
    }

    /// A claim while a store-wide hold is recorded and live, by a process
    /// outside its command and not in the command of an image user it
    /// waits for: a stream of such claims could keep the hold waiting.
    fn claim_past_hold(&self, s: &mut State, p: usize) {
        if Self::live_hold(s).is_some() && !self.exempt_from_hold(s, p) {
            s.bad |= bad::PASSED_HOLD;
        }
    }

    fn in_tree_of(&self, q: usize, h: usize) -> bool {
        let mut at = self.cfg.roles[q].parent;
        while let Some(a) = at {
            if a as usize == h {
                return true;
            }
            at = self.cfg.roles[a as usize].parent;
        }
        false
    }

    /// The file at the image's path, created if missing.
    fn open_create(s: &mut State, img: u8) -> u8 {
        let i = img as usize;
        match s.file[i] {
            Some(g) => g,
            None => {
                let g = s.next_gen[i];
                s.next_gen[i] += 1;
                s.file[i] = Some(g);
                g
            }
        }
    }

    /// The mode in which the enclosing command of `p` holds `key`, as the
    /// code can find it (an inherited descriptor, or the lock table naming
    /// an ancestor on a local filesystem).
    fn enclosing(&self, s: &State, p: usize, key: Key) -> Option<Mode> {
        let q = self.cfg.roles[p].parent? as usize;
        let visible = match self.op(s, q) {
            Some(Op::Exec { inherit, .. } | Op::StoreWide { inherit, .. }) => {
                inherit || self.cfg.rules.local_fs
            }
            _ => false,
        };
        if !visible {
            return None;
        }
        s.locks
            .iter()
            .filter(|(k, o, _)| *k == key && *o as usize == q)
            .map(|(_, _, m)| *m)
            .max()
    }

    /// Whether the parent of `p` holds the image at all (the truth, for the
    /// bypass count: such a reader is part of a hold already inside).
    fn nested_in_holder(&self, s: &State, p: usize, img: u8) -> bool {
        self.cfg.roles[p].parent.is_some_and(|q| {
            s.locks
                .iter()
                .any(|(k, o, _)| matches!(k, Key::Img(i, _) if *i == img) && *o == q)
        })
    }

    fn writer_waits(s: &State, img: u8, cfg: &Config) -> bool {
        s.procs.iter().enumerate().any(|(q, pr)| {
            pr.alive
                && matches!(pr.pc, Pc::Wait(k) if {
                    let op = pr.op.map(|i| cfg.roles[q].menu[i as usize]);
                    op.is_some_and(|op| Self::wanted(op).get(k as usize) == Some(&(img, Mode::Exclusive)))
                })
        })
    }

    // -- records ---------------------------------------------------------

    fn owner_dead(s: &State, r: &Rec) -> bool {
        let o = r.owner as usize;
        match r.role {
            RecRole::Waiter => !s.procs[o].alive,
            RecRole::Holder => match r.of {
                RecOf::Img(i) => !s
                    .locks
                    .iter()
                    .any(|(k, q, _)| matches!(k, Key::Img(j, _) if *j == i) && *q == r.owner),
                RecOf::SlotClass => true,
            },
        }
    }

    /// `status::judge`: does the record stand? Its owner's lease is probed
    /// first: free or missing, the owner is gone and the record with it.
    fn stands(&self, s: &State, r: &Rec) -> bool {
        let held_in = |key: Key, mode: Option<Mode>, owner: Option<u8>| {
            s.locks.iter().any(|(k, o, m)| {
                *k == key && mode.is_none_or(|x| x == *m) && owner.is_none_or(|x| x == *o)
            })
        };
        let rules = &self.cfg.rules;
        let o = r.owner as usize;
        // Without leases a waiter was judged by its pid (alive or not).
        let owner_ok = if rules.leases {
            Self::lease_alive(s, o)
        } else {
            r.role == RecRole::Holder || s.procs[o].alive
        };
        if !owner_ok {
            return false;
        }
        match (r.role, r.of) {
            (RecRole::Holder, RecOf::Img(i)) => {
                let Some(g) = s.file[i as usize] else {
                    return false;
                };
                // The lock table names the lease's taker (local filesystems):
                // the holder must be among the lock's entries.
                let by = (rules.leases && rules.local_fs).then_some(r.owner);
                held_in(Key::Img(i, g), Some(r.mode), by)
            }
            (RecRole::Holder, RecOf::SlotClass) => false,
            (RecRole::Waiter, RecOf::Img(i)) => {
                s.file[i as usize].is_some_and(|g| held_in(Key::Img(i, g), None, None))
            }
            (RecRole::Waiter, _) => s.locks.iter().any(|(k, _, _)| matches!(k, Key::Slot(_))),
        }
    }

    /// A look at the records in `scope`: stale ones are deleted. A record
    /// of a dead owner (or with a free lease) that survives it, or one of a
    /// live owner dropped for a lease judged dead, is a violation.
    fn look(&self, s: &mut State, scope: impl Fn(&Rec) -> bool) {
        let leases = self.cfg.rules.leases;
        let mut keep = Vec::with_capacity(s.records.len());
        for r in &s.records {
            if !scope(r) || self.stands(s, r) {
                keep.push(*r);
            } else if leases
                && !Self::lease_alive(s, r.owner as usize)
                && Self::owner_lives(s, r.owner as usize)
            {
                s.bad |= bad::LIVE_DROPPED;
            }
        }
        s.records = keep;
        if s.records.iter().any(|r| scope(r) && Self::owner_dead(s, r)) {
            s.bad |= bad::STALE_RECORD;
        }
        if leases
            && s.records
                .iter()
                .any(|r| scope(r) && !Self::lease_alive(s, r.owner as usize))
        {
            s.bad |= bad::LEASE_STALE;
        }
    }

    fn insert_record(s: &mut State, r: Rec) {
        s.records.push(r);
        s.records.sort();
    }

    fn drop_records(s: &mut State, p: usize, role: Option<RecRole>) {
        s.records
            .retain(|r| !(r.owner as usize == p && role.is_none_or(|x| x == r.role)));
    }

    // -- enabledness ------------------------------------------------------

    fn enabled(&self, s: &State, p: usize) -> bool {
        let pr = &s.procs[p];
        if !pr.alive {
            return false;
        }
        let Some(op) = self.op(s, p) else {
            return false;
        };
        // The global lock serialises transactions; a look that cleans
        // leases holds it over several steps.
        if pr.pc.step().is_some_and(Step::in_transaction)
            && s.global.is_some_and(|g| g as usize != p)
        {
            return false;
        }
        match pr.pc {
            Pc::Choose | Pc::Done | Pc::Command => false,
            Pc::StoreLock => {
                Self::grantable(s, Key::Store, Mode::Exclusive)
                    || self.enclosing(s, p, Key::Store) == Some(Mode::Exclusive)
                    || (self.cfg.rules.nested_store && self.nested_in_user(s, p))
            }
            Pc::StoreWaitFree(k) => Self::grantable(s, k, Mode::Exclusive),
            Pc::StoreAwait => Self::grantable(s, Key::Store, Mode::Shared),
            Pc::SlotWait => {
                let Op::Exec {
                    slot: Some(prio), ..
                } = op
                else {
                    unreachable!()
                };
                self.slot_candidates(prio)
                    .into_iter()
                    .any(|f| Self::grantable(s, Key::Slot(f), Mode::Exclusive))
            }
            Pc::Gate(k) => {
                let (img, mode) = Self::wanted(op)[k as usize];
                Self::grantable(s, Key::Gate(img), mode)
            }
            Pc::Wait(k) => {
                let (img, mode) = Self::wanted(op)[k as usize];
                Self::grantable(s, Key::Img(img, pr.wgen), mode)
            }
            _ => true,
        }
    }

    fn nested_children(&self, p: usize) -> impl Iterator<Item = usize> + '_ {
        self.cfg
            .roles
            .iter()
            .enumerate()
            .filter(move |(_, r)| r.parent == Some(p as u8))
            .map(|(c, _)| c)
    }

    /// A nested process still at work (its command is part of ours).
    fn child_running(&self, s: &State, p: usize) -> bool {
        self.nested_children(p).any(|c| {
            let ch = &s.procs[c];
            (ch.alive && !matches!(ch.pc, Pc::Choose | Pc::Done)) || ch.cmd == Cmd::Running
        })
    }

    fn may_start(&self, s: &State, p: usize) -> bool {
        match self.cfg.roles[p].parent {
            None => true,
            Some(q) => {
                let q = q as usize;
                s.procs[q].cmd == Cmd::Running
            }
        }
    }

    /// Every move but a crash.
    pub fn progress_actions(&self, s: &State, out: &mut Vec<Action>) {
        for p in 0..s.procs.len() {
            let pr = &s.procs[p];
            if pr.pc == Pc::Choose && pr.alive && self.may_start(s, p) {
                for i in 0..self.cfg.roles[p].menu.len() {
                    out.push(Action::Choose(p as u8, i as u8));
                }
            }
            if self.enabled(s, p) {
                out.push(Action::Step(p as u8));
                if matches!(pr.pc, Pc::Clone | Pc::Spawn)
                    || self.stale_possible(s, p)
                    || self.listing_may_miss(s, p)
                {
                    out.push(Action::Fail(p as u8));
                }
            }
            if pr.cmd == Cmd::Running && !self.child_running(s, p) {
                out.push(Action::Exit(p as u8, true));
                out.push(Action::Exit(p as u8, false));
            }
        }
    }

    /// On NFS, a fold's listing may miss the markers.
    fn listing_may_miss(&self, s: &State, p: usize) -> bool {
        self.cfg.nfs_listing
            && s.procs[p].fold == Fold::Idle
            && self.fold_pending(s, p)
            && !matches!(s.procs[p].pc, Pc::Clone | Pc::Spawn | Pc::FastTry)
    }

    /// At `fast-try` with a ready token: it may also be older than the
    /// resolution (freshness is not modelled otherwise), which sends the
    /// read the slow way.
    fn stale_possible(&self, s: &State, p: usize) -> bool {
        s.procs[p].pc == Pc::FastTry
            && self.op(s, p).is_some_and(|op| {
                let (img, _) = Self::wanted(op)[0];
                s.file[img as usize].is_some_and(|g| s.tokens.contains(&(img, g)))
            })
    }

    fn started(pr: &Proc) -> bool {
        pr.alive && !matches!(pr.pc, Pc::Choose | Pc::Done)
    }

    /// Nothing left to do for this process: done, never called, or dead
    /// with no command left running.
    pub fn quiet(&self, s: &State, p: usize) -> bool {
        let pr = &s.procs[p];
        let idle = pr.pc == Pc::Done || (pr.pc == Pc::Choose && !self.may_start(s, p));
        (idle || !pr.alive) && pr.cmd != Cmd::Running
    }

    /// No move but crashes, while something is not finished.
    pub fn deadlocked(&self, s: &State) -> bool {
        let mut acts = Vec::new();
        self.progress_actions(s, &mut acts);
        acts.is_empty() && (0..s.procs.len()).any(|p| !self.quiet(s, p))
    }

    // -- crashes -------------------------------------------------------------

    /// SIGKILL of one stowage process.
    fn kill(&self, s: &mut State, p: usize) {
        let inherit = match self.op(s, p) {
            Some(Op::Exec { inherit, .. } | Op::StoreWide { inherit, .. }) => inherit,
            _ => true,
        };
        let pr = &mut s.procs[p];
        if !pr.alive {
            return;
        }
        pr.alive = false;
        let running = pr.cmd == Cmd::Running;
        // Gates are never inherited.
        s.locks
            .retain(|(k, o, _)| !(matches!(k, Key::Gate(_)) && *o as usize == p));
        if running && inherit {
            // The command keeps the inherited descriptors, and so the locks.
            return;
        }
        if running && self.cfg.rules.keeper {
            // --no-inherit: the keeper ends the command's whole tree before
            // the descriptors close.
            self.kill_tree(s, p);
        }
        Self::close_all(s, p);
    }

    /// The command of `p` and everything it runs.
    fn kill_tree(&self, s: &mut State, p: usize) {
        if s.procs[p].cmd == Cmd::Running {
            s.procs[p].cmd = Cmd::Exited;
        }
        let children: Vec<usize> = self.nested_children(p).collect();
        for c in children {
            if s.procs[c].pc == Pc::Choose {
                s.procs[c].pc = Pc::Done;
            }
            self.kill(s, c);
            self.kill_tree(s, c);
            Self::close_all(s, c);
        }
    }

    fn host_dies(&self, s: &mut State, h: u8) {
        for p in 0..s.procs.len() {
            if self.cfg.roles[p].host == h {
                if s.procs[p].pc == Pc::Choose {
                    s.procs[p].pc = Pc::Done;
                }
                s.procs[p].alive = false;
                s.procs[p].cmd = match s.procs[p].cmd {
                    Cmd::Running => Cmd::Exited,
                    c => c,
                };
                Self::close_all(s, p);
            }
        }
    }

    // -- steps -------------------------------------------------------------

    fn after_images(&self, op: Op) -> Pc {
        match op {
            Op::Rm(i) => self.remove(i, Ret::Rm),
            Op::Exec { write: Some(_), .. } if self.cfg.rules.writer_invalidates => Pc::Invalidate,
            _ => Pc::Start,
        }
    }

    /// `remove::remove_locked`: the token first, then the mark.
    fn remove(&self, img: u8, ret: Ret) -> Pc {
        if self.cfg.rules.remove_invalidates {
            Pc::InvalidateRm(img, ret)
        } else {
            Pc::Mark(img, ret)
        }
    }

    fn next_image(&self, op: Op, k: u8) -> Pc {
        if (k as usize + 1) < Self::wanted(op).len() {
            Pc::Try(k + 1)
        } else {
            self.after_images(op)
        }
    }

    /// A plain read (no write, no exclusive read, no slot): the fast path
    /// is tried first (`Session::begin_fast`).
    fn fast_eligible(op: Op) -> bool {
        matches!(
            op,
            Op::Exec {
                read: Some(_),
                read_excl: false,
                write: None,
                slot: None,
                ..
            }
        )
    }

    /// A write of one image, nothing else (`Session::begin_fast`'s
    /// `writes_ok`: no base, no exclusive read; the model's menus give no
    /// write a plain read beside it).
    fn fast_write_eligible(op: Op) -> bool {
        matches!(
            op,
            Op::Exec {
                read: None,
                read_excl: false,
                write: Some(_),
                from: false,
                slot: None,
                ..
            }
        )
    }

    // -- writes without the database (src/written.rs) ---------------------

    /// What the token area of lock file `(i, g)` holds.
    pub fn record_at(s: &State, i: u8, g: u8) -> Found {
        if s.tokens.contains(&(i, g)) {
            return Found::Token;
        }
        s.wrecs
            .iter()
            .find(|&&(j, h, _)| (j, h) == (i, g))
            .map_or(Found::Nothing, |r| r.2)
    }

    /// Writes the token area of lock file `(i, g)`.
    fn set_record(s: &mut State, i: u8, g: u8, r: Found) {
        s.tokens.retain(|t| *t != (i, g));
        s.wrecs.retain(|&(j, h, _)| (j, h) != (i, g));
        match r {
            Found::Nothing => {}
            Found::Token => {
                s.tokens.push((i, g));
                s.tokens.sort();
            }
            w => {
                s.wrecs.push((i, g, w));
                s.wrecs.sort();
            }
        }
    }

    /// The transaction steps that begin with a fold of the markers (the
    /// others are cleanup, `Store::begin_cleanup`, or a look's view that
    /// rolls back).
    fn folds_first(&self, s: &State, p: usize) -> bool {
        if !self.cfg.fast_writes {
            return false;
        }
        match s.procs[p].pc {
            Pc::Start | Pc::Waiter(_) | Pc::Mark(..) => true,
            Pc::Sweep => matches!(self.op(s, p), Some(Op::Gc | Op::Doctor)),
            _ => false,
        }
    }

    /// `written::markers`: the markers a transaction of `p` would fold now,
    /// and whether it takes the image lock shared for it (false: no lock
    /// file, or `p` holds it exclusively through its own guard, or — a
    /// mutation — another process holds it exclusively).
    fn foldable(&self, s: &State, p: usize) -> Vec<(u8, bool)> {
        let mut out = vec![];
        for i in 0..self.cfg.images {
            if s.marks & (1 << i) == 0 {
                continue;
            }
            let Some(g) = s.file[i as usize] else {
                out.push((i, false));
                continue;
            };
            let key = Key::Img(i, g);
            let own = s
                .locks
                .iter()
                .any(|&(k, o, m)| k == key && o as usize == p && m == Mode::Exclusive);
            if own {
                out.push((i, false));
            } else if Self::grantable(s, key, Mode::Shared) {
                out.push((i, true));
            } else if !self.cfg.rules.skip_busy {
                out.push((i, false));
            }
        }
        out
    }

    /// Whether `p`'s next step is (or may be) a fold.
    fn fold_pending(&self, s: &State, p: usize) -> bool {
        match s.procs[p].fold {
            Fold::Idle => self.folds_first(s, p) && !self.foldable(s, p).is_empty(),
            Fold::Unlink(_) | Fold::Commit(_) => true,
            Fold::Done => false,
        }
    }

    /// The step `p` takes next, its fold included.
    pub fn next_step(&self, s: &State, p: usize) -> Option<Step> {
        let rules = &self.cfg.rules;
        match s.procs[p].fold {
            Fold::Unlink(_) => return Some(Step::FoldUnlink),
            Fold::Commit(_) => return Some(Step::Fold),
            Fold::Idle if self.fold_pending(s, p) => {
                return Some(if rules.unlink_after_commit {
                    Step::Fold
                } else {
                    Step::FoldUnlink
                });
            }
            _ => {}
        }
        s.procs[p].pc.step()
    }

    /// `written::fold_one`: the row of image `i` set from the record `r`
    /// of its lock file `g`. Readiness may be lost, never claimed.
    fn fold_row(s: &mut State, i: u8, g: u8, r: Found) {
        let ix = i as usize;
        match (r, s.rows[ix]) {
            (Found::Token, Some(Row::Ready)) => return,
            (Found::Token, None) => {
                s.rows[ix] = Some(Row::Ready);
                s.truth[ix] = (false, true);
                return;
            }
            _ => {}
        }
        if r == Found::Token {
            // A ready token beside a row left not ready goes.
            Self::set_record(s, i, g, Found::Nothing);
        }
        let writer = matches!(r, Found::Writing | Found::Failed);
        match s.rows[ix] {
            Some(row) if row == Row::Ready || row.being_written() => {
                s.rows[ix] = Some(Row::Incomplete)
            }
            None if writer => s.rows[ix] = Some(Row::Incomplete),
            _ => {}
        }
    }

    /// The rows of the markers in `mask`, from the records `p` reads now.
    fn fold_rows(&self, s: &mut State, p: usize, mask: u8) {
        for i in 0..self.cfg.images {
            if mask & (1 << i) != 0
                && let Some(g) = s.file[i as usize]
            {
                let own_write = s.procs[p].before != Found::Nothing
                    && s.locks
                        .contains(&(Key::Img(i, g), p as u8, Mode::Exclusive));
                let r = if self.cfg.rules.own_fold_reads_before && own_write {
                    s.procs[p].before
                } else {
                    Self::record_at(s, i, g)
                };
                Self::fold_row(s, i, g, r);
            }
        }
    }

    /// `fold_found` by a holder: only a writer's record is folded.
    fn fold_held(&self, s: &mut State, i: u8, g: u8, r: Found) {
        if self.cfg.rules.holder_folds && matches!(r, Found::Writing | Found::Failed) {
            Self::fold_row(s, i, g, r);
        }
    }

    fn drop_fold_locks(s: &mut State, p: usize) {
        for (i, g) in std::mem::take(&mut s.procs[p].fold_locks) {
            let e = (Key::Img(i, g), p as u8, Mode::Shared);
            if let Some(at) = s.locks.iter().position(|x| *x == e) {
                s.locks.remove(at);
            }
        }
    }

    /// One step of the fold that begins `p`'s transaction; false when
    /// there is none (the transaction itself is the step).
    fn fold_step(&self, s: &mut State, p: usize) -> bool {
        if !self.folds_first(s, p) {
            return false;
        }
        match s.procs[p].fold {
            Fold::Idle => {
                let todo = self.foldable(s, p);
                if todo.is_empty() {
                    return false;
                }
                // Under the global lock until the transaction itself.
                s.global = Some(p as u8);
                let mut mask = 0;
                for (i, lock) in todo {
                    mask |= 1 << i;
                    if lock {
                        let g = s.file[i as usize].expect("a lock file");
                        Self::take(s, Key::Img(i, g), p, Mode::Shared);
                        s.procs[p].fold_locks.push((i, g));
                    }
                }
                if self.cfg.rules.unlink_after_commit {
                    self.fold_rows(s, p, mask);
                    s.procs[p].fold = Fold::Unlink(mask);
                } else {
                    s.marks &= !mask;
                    s.procs[p].fold = Fold::Commit(mask);
                }
                true
            }
            Fold::Unlink(mask) => {
                s.marks &= !mask;
                Self::drop_fold_locks(s, p);
                s.procs[p].fold = Fold::Done;
                true
            }
            Fold::Commit(mask) => {
                self.fold_rows(s, p, mask);
                Self::drop_fold_locks(s, p);
                s.procs[p].fold = Fold::Done;
                true
            }
            Fold::Done => {
                if s.global == Some(p as u8) {
                    s.global = None;
                }
                s.procs[p].fold = Fold::Idle;
                false
            }
        }
    }

    /// What follows the lease on the first go: the fast path for a plain
    /// read, the slow way for everything else (and for a read starting
    /// over after a store-wide hold).
    fn begin(&self, op: Op) -> Pc {
        if self.cfg.fast_writes && Self::fast_write_eligible(op) {
            return Pc::FastWrite;
        }
        if !Self::fast_eligible(op) {
            return self.after_lease(op);
        }
        match self.cfg.rules.fast_store {
            FastStore::BeforeLocks => Pc::FastStore,
            FastStore::AfterLocks | FastStore::Never => Pc::FastTry,
        }
    }

    /// The fast path's claim: the command may run.
    fn fast_claim(&self, s: &mut State, p: usize) {
        s.procs[p].claimed = true;
        s.procs[p].fast = true;
        self.claim_past_hold(s, p);
        s.procs[p].pc = Pc::Spawn;
    }

    /// Images whose trees a store-wide command deleted, that
    /// `forget_deleted` drops (not `deleting`: a removal's own business;
    /// not `incomplete`: a failed write may have no tree).
    fn deleted(&self, s: &State) -> Vec<u8> {
        (0..self.cfg.images)
            .filter(|&i| {
                s.rows[i as usize].is_some_and(|r| r != Row::Deleting && r != Row::Incomplete)
                    && !s.tree[i as usize]
            })
            .collect()
    }

    /// The tokens a step would write (`StartToken`, `FinishToken`): the
    /// files the process holds. A step that would change nothing is not
    /// taken (see `skip_noops`).
    fn tokens_to_write(&self, s: &State, p: usize) -> Vec<(u8, u8)> {
        if self.cfg.rules.no_token_beside_hold && Self::live_hold(s).is_some() {
            return vec![];
        }
        let pr = &s.procs[p];
        let Some(Op::Exec {
            read,
            read_excl,
            write,
            ..
        }) = self.op(s, p)
        else {
            return vec![];
        };
        pr.held
            .iter()
            .filter(|&&(i, _, m)| match pr.pc {
                // A slow-path reader, in its start transaction.
                Pc::Start => m == Mode::Shared,
                // A writer whose write succeeded, after its commit, for a
                // row that is there and ready (a store-wide command's end
                // may have forgotten it).
                Pc::FinishToken => {
                    write == Some(i) && pr.ok && s.rows[i as usize] == Some(Row::Ready)
                }
                // An exclusive reader, in its finish transaction, if its
                // row is ready (a store-wide command's deletions may have
                // forgotten it).
                Pc::Finish => {
                    read_excl && read == Some(i) && s.rows[i as usize] == Some(Row::Ready)
                }
                _ => false,
            })
            .map(|&(i, g, _)| (i, g))
            .filter(|t| !s.tokens.contains(t))
            .collect()
    }

    fn write_tokens(&self, s: &mut State, p: usize) {
        for t in self.tokens_to_write(s, p) {
            Self::set(&mut s.tokens, t, true);
        }
    }

    /// The tokens an invalidation would make say nothing: the files of
    /// images written (held exclusively), removed, or deleted by a
    /// store-wide command.
    fn tokens_to_invalidate(&self, s: &State, p: usize) -> Vec<(u8, u8)> {
        let pr = &s.procs[p];
        let held_excl = |img: u8| {
            pr.held
                .iter()
                .filter(move |&&(i, _, m)| i == img && m == Mode::Exclusive)
                .map(|&(i, g, _)| (i, g))
        };
        let cands: Vec<(u8, u8)> = match pr.pc {
            Pc::Invalidate => match self.op(s, p) {
                Some(Op::Exec { write: Some(w), .. }) => held_excl(w).collect(),
                _ => vec![],
            },
            Pc::InvalidateRm(img, _) => held_excl(img).collect(),
            // `record::invalidate_at`: the file at the path, no lock needed
            // (the hold keeps every reader out).
            Pc::StoreInvalidate => self
                .deleted(s)
                .into_iter()
                .filter_map(|i| s.file[i as usize].map(|g| (i, g)))
                .collect(),
            _ => vec![],
        };
        cands
            .into_iter()
            .filter(|&(i, g)| Self::record_at(s, i, g) != Found::Nothing)
            .collect()
    }

    /// A token step that would change nothing is no step: invalidating
    /// what is not valid, writing what is there (`record::invalidate`
    /// writes nothing then; `write_ready` would write the same bytes).
    fn skip_noops(&self, s: &mut State, p: usize) {
        loop {
            let pc = s.procs[p].pc;
            let next = match pc {
                Pc::Invalidate | Pc::InvalidateRm(..) | Pc::StoreInvalidate
                    if self.tokens_to_invalidate(s, p).is_empty() =>
                {
                    Self::after_invalidate(pc)
                }
                Pc::FinishToken if self.tokens_to_write(s, p).is_empty() => Pc::Release,
                _ => return,
            };
            s.procs[p].pc = next;
        }
    }

    fn after_invalidate(pc: Pc) -> Pc {
        match pc {
            Pc::Invalidate => Pc::Start,
            Pc::InvalidateRm(img, ret) => Pc::Mark(img, ret),
            Pc::StoreInvalidate => Pc::StoreEnd(true),
            _ => unreachable!(),
        }
    }

    /// The first step: the lease, for a process that locks something and
    /// records itself (exec, rm, gc; `store-wide`'s own record is judged by
    /// `store.lock`, and looks lock nothing of their own).
    fn first(&self, op: Op) -> Pc {
        match op {
            Op::Exec { .. } | Op::Rm(_) | Op::Gc if self.cfg.rules.leases => Pc::LeaseCreate,
            _ => self.begin(op),
        }
    }

    /// The image locks, or what follows them when there are none.
    fn images(&self, op: Op) -> Pc {
        if Self::wanted(op).is_empty() {
            self.after_images(op)
        } else {
            Pc::Try(0)
        }
    }

    fn after_lease(&self, op: Op) -> Pc {
        match op {
            Op::Exec { slot: Some(_), .. } => Pc::SlotTry,
            Op::Exec { .. } | Op::Rm(_) => self.images(op),
            Op::StoreWide { .. } => Pc::StoreLock,
            Op::Gc => Pc::ListInterrupted,
            Op::Doctor | Op::Look => Pc::Sweep,
        }
    }

    /// One image of gc's or doctor's pass over the images it listed: true
    /// when process `p` listed `img` and took its exclusive lock without
    /// waiting (the lock file made if missing). Otherwise the pass skips
    /// the image and `p` goes on at `next`.
    fn lock_listed(s: &mut State, p: usize, img: u8, next: Pc) -> bool {
        if s.procs[p].listed & (1 << img) == 0 || Self::try_exclusive(s, p, img, true).is_none() {
            s.procs[p].pc = next;
            return false;
        }
        true
    }

    /// Where a removal, or gc's or doctor's pass over the images, goes
    /// after image `i`.
    fn next_in_phase(&self, ret: Ret, i: u8) -> Pc {
        let n = self.cfg.images;
        match ret {
            Ret::Rm => Pc::Release,
            Ret::Interrupted if i + 1 < n => Pc::LockInterrupted(i + 1),
            Ret::Interrupted => Pc::OrphanLock(0),
            Ret::Collect if i + 1 < n => Pc::Collect(i + 1),
            Ret::Collect => Pc::Release,
        }
    }

    fn after_orphans(op: Op) -> Pc {
        match op {
            Op::Gc => Pc::Sweep,
            _ => Pc::Done,
        }
    }

    /// A try of an image's exclusive lock by gc or doctor (no wait), with
    /// the file created when `create`. Returns the generation locked.
    fn try_exclusive(s: &mut State, p: usize, img: u8, create: bool) -> Option<u8> {
        let g = if create {
            Self::open_create(s, img)
        } else {
            s.file[img as usize]?
        };
        if Self::grantable(s, Key::Img(img, g), Mode::Exclusive) {
            Self::take(s, Key::Img(img, g), p, Mode::Exclusive);
            s.procs[p].held.push((img, g, Mode::Exclusive));
            Some(g)
        } else {
            None
        }
    }

    /// The lock file left the path: no reader can open it again, so its
    /// token (if any) says nothing any more; the next file has none.
    fn forget_tokens(s: &mut State, img: u8) {
        s.tokens.retain(|(i, _)| *i != img);
        s.wrecs.retain(|(i, _, _)| *i != img);
        s.ww.retain(|(i, _)| *i != img);
        s.sw.retain(|(i, _)| *i != img);
    }

    fn set(v: &mut Vec<(u8, u8)>, f: (u8, u8), on: bool) {
        v.retain(|x| *x != f);
        if on {
            v.push(f);
            v.sort();
        }
    }

    /// `record::mark_store_wide`: the store-wide hint on every image lock
    /// file at its path.
    fn mark_store_wide(&self, s: &mut State, on: bool) {
        for i in 0..self.cfg.images {
            if let Some(g) = s.file[i as usize] {
                Self::set(&mut s.sw, (i, g), on);
            }
        }
    }

    fn release_image(s: &mut State, p: usize, img: u8) {
        let held = std::mem::take(&mut s.procs[p].held);
        for (i, g, _) in &held {
            if *i == img {
                Self::drop_key(s, Key::Img(*i, *g), p);
            }
        }
        s.procs[p].held = held.into_iter().filter(|(i, _, _)| *i != img).collect();
    }

    /// `Guard::unlink`: the path goes (whatever file it names now), and the
    /// descriptor closes.
    fn unlink(s: &mut State, p: usize, img: u8) {
        s.file[img as usize] = None;
        Self::forget_tokens(s, img);
        Self::release_image(s, p, img);
    }

    /// `remove::recheck`: the record of the image just locked, folded.
    fn recheck_fold(&self, s: &mut State, p: usize, img: u8) {
        if !self.cfg.fast_writes {
            return;
        }
        if let Some(&(_, g, _)) = s.procs[p].held.iter().find(|h| h.0 == img) {
            let r = Self::record_at(s, img, g);
            self.fold_held(s, img, g, r);
        }
    }

    fn step(&self, s: &mut State, p: usize) {
        let op = self.op(s, p).expect("a started process has an operation");
        let rules = &self.cfg.rules;
        if self.fold_step(s, p) {
            return;
        }
        let pc = s.procs[p].pc;
        match pc {
            Pc::Choose | Pc::Done | Pc::Command => unreachable!(),
            Pc::FastWrite => {
                // `try_write`: the lock file there, its lock free, and one
                // read of it finds a ready token and no store-wide hint.
                // Else the slow way, holding nothing.
                let Op::Exec { write: Some(w), .. } = op else {
                    unreachable!()
                };
                let slow = self.after_lease(op);
                let Some(g) = s.file[w as usize] else {
                    s.procs[p].pc = slow;
                    return;
                };
                let key = Key::Img(w, g);
                if !Self::grantable(s, key, Mode::Exclusive)
                    || Self::record_at(s, w, g) != Found::Token
                    || s.sw.contains(&(w, g))
                {
                    s.procs[p].pc = slow;
                    return;
                }
                Self::take(s, key, p, Mode::Exclusive);
                s.procs[p].held.push((w, g, Mode::Exclusive));
                s.procs[p].fw = true;
                s.procs[p].claimed = true;
                self.claim_past_hold(s, p);
                s.procs[p].pc = if rules.marker_first {
                    Pc::FastMarker
                } else {
                    Pc::FastWriting
                };
            }
            Pc::FastMarker => {
                let Op::Exec { write: Some(w), .. } = op else {
                    unreachable!()
                };
                s.marks |= 1 << w;
                s.procs[p].pc = if rules.marker_first {
                    Pc::FastWriting
                } else {
                    Pc::Spawn
                };
            }
            Pc::FastWriting => {
                let &(w, g, _) = s.procs[p].held.first().expect("its write lock");
                Self::set_record(s, w, g, Found::Writing);
                s.procs[p].pc = if rules.marker_first {
                    Pc::Spawn
                } else {
                    Pc::FastMarker
                };
            }
            Pc::FastRecord => {
                // `finish_fast`: the lock re-asserted (never lost here),
                // `ready` (a valid token) or `incomplete`, synced.
                let &(w, g, _) = s.procs[p].held.first().expect("its write lock");
                let ok = s.procs[p].ok;
                Self::set_record(s, w, g, if ok { Found::Token } else { Found::Failed });
                s.truth[w as usize] = (false, ok);
                s.procs[p].pc = Pc::Release;
            }
            Pc::PutBack => {
                // The command never ran: the bytes read at `fast-write`
                // (a ready token) go back.
                let &(w, g, _) = s.procs[p].held.first().expect("its write lock");
                Self::set_record(s, w, g, Found::Token);
                s.procs[p].pc = Pc::Release;
            }
            Pc::LeaseCreate => {
                // open(O_CREAT) of our name: the file there, or a new one.
                let (me, n) = (p as u8, s.procs[p].lname);
                let g = match Self::lease_file(s, me, n) {
                    Some(g) => g,
                    None => {
                        let g = s.procs[p].lgen + 1;
                        s.lfiles.push((me, n, g));
                        s.lfiles.sort();
                        g
                    }
                };
                s.procs[p].lgen = g;
                s.procs[p].pc = Pc::LeaseLock;
            }
            Pc::LeaseLock => {
                let (me, n, g) = (p as u8, s.procs[p].lname, s.procs[p].lgen);
                let key = Key::Lease(me, n, g);
                if !Self::grantable(s, key, Mode::Exclusive) {
                    // A prober holds our fresh file: another name.
                    s.procs[p].lname += 1;
                    s.procs[p].lgen = 0;
                    s.procs[p].pc = Pc::LeaseCreate;
                    return;
                }
                if rules.lease_recheck && Self::lease_file(s, me, n) != Some(g) {
                    // A prober found the fresh file unlocked and unlinked
                    // it: the lock is on nothing. Make it again.
                    s.procs[p].pc = Pc::LeaseCreate;
                    return;
                }
                Self::take(s, key, p, Mode::Exclusive);
                // Written right after the lock: a crash in between leaves
                // an unwritten file of a dead owner, which the rule lets
                // go just as a written one (a dead owner of this host).
                s.lwritten.push((me, n, g));
                s.lwritten.sort();
                s.procs[p].lease = Some(n);
                s.procs[p].pc = self.begin(op);
            }
            Pc::CleanLock => {
                let own = s.procs[p].lease.map(|n| (p as u8, n));
                let files = s.lfiles.clone();
                for (o, n, g) in files {
                    if Some((o, n)) == own {
                        continue;
                    }
                    let key = Key::Lease(o, n, g);
                    // Locked, then left if nobody wrote it yet (and its
                    // owner is not known to be gone): let go at the unlink
                    // step with the others.
                    let maker_known_gone = self.cfg.roles[o as usize].host
                        == self.cfg.roles[p].host
                        && !s.procs[o as usize].alive;
                    let kept = rules.lease_unwritten_kept
                        && !s.lwritten.contains(&(o, n, g))
                        && !maker_known_gone;
                    if rules.lease_unlink_locked {
                        if Self::grantable(s, key, Mode::Exclusive) {
                            Self::take(s, key, p, Mode::Exclusive);
                            if !kept {
                                s.procs[p].doomed.push((o, n));
                            }
                        }
                    } else if Self::grantable(s, key, Mode::Shared) && !kept {
                        // The probe's shared lock, dropped at once.
                        s.procs[p].doomed.push((o, n));
                    }
                }
                s.procs[p].pc = Pc::CleanUnlink;
            }
            Pc::CleanUnlink => {
                for (o, n) in std::mem::take(&mut s.procs[p].doomed) {
                    if let Some(g) = Self::lease_file(s, o, n) {
                        let held_by_other = s
                            .locks
                            .iter()
                            .any(|(k, q, _)| *k == Key::Lease(o, n, g) && *q as usize != p);
                        if held_by_other {
                            s.bad |= bad::LIVE_UNLINKED;
                        }
                        if !Self::owner_lives(s, o as usize) {
                            s.bad |= bad::CLEANED_DEAD;
                        }
                    }
                    Self::unlink_lease(s, o, n);
                }
                let own = s.procs[p].lease.map(|n| (p as u8, n));
                s.locks.retain(|(k, q, _)| match k {
                    Key::Lease(o, n, _) => *q as usize != p || Some((*o, *n)) == own,
                    _ => true,
                });
                s.global = None;
                s.procs[p].pc = match op {
                    Op::Gc => Pc::Collect(0),
                    Op::Doctor => Pc::ListInterrupted,
                    _ => Pc::Done,
                };
            }
            Pc::StoreLock => {
                if self.cfg.rules.nested_store && self.nested_in_user(s, p) {
                    // In the command of an image or slot user: the hold
                    // would wait for that user, which waits for us (75).
                    s.procs[p].pc = Pc::Release;
                } else if Self::grantable(s, Key::Store, Mode::Exclusive) {
                    Self::take(s, Key::Store, p, Mode::Exclusive);
                    s.procs[p].pc = Pc::StoreRecord;
                } else {
                    // Inside a store-wide command: waiting for it would
                    // never end (75).
                    s.procs[p].pc = Pc::Release;
                }
            }
            Pc::StoreRecord => {
                // Records of earlier holders are stale: we hold their lease.
                s.store_rec = Some(p as u8);
                // Then the store-wide hint on every image lock file, before
                // the check that every image lock is free.
                if rules.store_marks {
                    self.mark_store_wide(s, true);
                }
                s.procs[p].pc = Pc::StoreFree;
            }
            Pc::StoreFree => {
                let busy = s
                    .locks
                    .iter()
                    .filter(|(k, _, _)| match k {
                        Key::Img(i, g) => s.file[*i as usize] == Some(*g),
                        Key::Slot(_) => true,
                        _ => false,
                    })
                    .map(|(k, _, _)| *k)
                    .next();
                match busy {
                    None => {
                        s.procs[p].claimed = true;
                        s.procs[p].pc = Pc::Spawn;
                    }
                    // Held by our enclosing command, which waits for us.
                    Some(k) if self.enclosing(s, p, k).is_some() => {
                        s.procs[p].pc = Pc::StoreEnd(false)
                    }
                    Some(k) => s.procs[p].pc = Pc::StoreWaitFree(k),
                }
            }
            // Taken and dropped at once; then look again.
            Pc::StoreWaitFree(_) => s.procs[p].pc = Pc::StoreFree,
            Pc::StoreAwait => {
                // Taken shared and dropped: the hold is over. Start over.
                s.procs[p].pc = self.after_lease(op);
            }
            Pc::StoreInvalidate => {
                for (i, g) in self.tokens_to_invalidate(s, p) {
                    Self::set_record(s, i, g, Found::Nothing);
                }
                s.procs[p].pc = Pc::StoreEnd(true);
            }
            Pc::StoreEnd(forget) => {
                if forget {
                    // `forget_deleted`: the rows of deleted images go (their
                    // tokens went at `StoreInvalidate`), then their lock
                    // files, each under its exclusive lock if free.
                    for i in self.deleted(s) {
                        s.rows[i as usize] = None;
                        s.truth[i as usize] = (false, false);
                        if let Some(g) = s.file[i as usize]
                            && Self::grantable(s, Key::Img(i, g), Mode::Exclusive)
                        {
                            s.file[i as usize] = None;
                            Self::forget_tokens(s, i);
                        }
                    }
                }
                if s.store_rec == Some(p as u8) {
                    s.store_rec = None;
                }
                // Still holding store.lock: the hints go.
                self.mark_store_wide(s, false);
                s.procs[p].pc = Pc::Release;
            }
            Pc::FastTry => {
                // `try_ready`: the lock file must exist (no create), the
                // lock be free, and one read of the file find a ready token
                // and the hints. Writer waits: the gate tried (held, the slow
                // way; free, the stale hint cleared under it). Else the slow
                // way, holding nothing.
                let (img, _) = Self::wanted(op)[0];
                let slow = self.after_lease(op);
                let Some(g) = s.file[img as usize] else {
                    s.procs[p].pc = slow;
                    return;
                };
                let key = Key::Img(img, g);
                if !Self::grantable(s, key, Mode::Shared) || !s.tokens.contains(&(img, g)) {
                    s.procs[p].pc = slow;
                    return;
                }
                if rules.gate && s.ww.contains(&(img, g)) {
                    if !Self::grantable(s, Key::Gate(img), Mode::Shared) {
                        s.procs[p].pc = slow;
                        return;
                    }
                    Self::set(&mut s.ww, (img, g), false);
                }
                let hinted = s.sw.contains(&(img, g));
                if Self::writer_waits(s, img, &self.cfg) && !self.nested_in_holder(s, p, img) {
                    s.bad |= bad::BYPASS;
                }
                Self::take(s, key, p, Mode::Shared);
                s.procs[p].held.push((img, g, Mode::Shared));
                match rules.fast_store {
                    FastStore::AfterLocks if hinted => s.procs[p].pc = Pc::FastStore,
                    _ => self.fast_claim(s, p),
                }
            }
            Pc::FastStore => {
                // `store_wide::try_shared`: held, the slow way (which waits
                // for the hold, or passes it inside its command), our image
                // locks closed first. Free: the stale hints of our files
                // cleared while we hold it shared (then, under
                // `token_after_store`, the tokens read again).
                if !Self::grantable(s, Key::Store, Mode::Shared) {
                    Self::close_locks(s, p);
                    s.procs[p].pc = self.after_lease(op);
                    return;
                }
                if rules.fast_store == FastStore::BeforeLocks {
                    s.procs[p].pc = Pc::FastTry;
                    return;
                }
                let held = s.procs[p].held.clone();
                for &(i, g, _) in &held {
                    Self::set(&mut s.sw, (i, g), false);
                }
                if rules.token_after_store
                    && !held.iter().all(|&(i, g, _)| s.tokens.contains(&(i, g)))
                {
                    Self::close_locks(s, p);
                    s.procs[p].pc = self.after_lease(op);
                    return;
                }
                self.fast_claim(s, p);
            }
            Pc::Invalidate | Pc::InvalidateRm(..) => {
                // A writer reads what a writer without the database left
                // (for its start to fold) before the token goes.
                if pc == Pc::Invalidate
                    && let Op::Exec { write: Some(w), .. } = op
                    && let Some(&(_, g, _)) = s.procs[p].held.iter().find(|h| h.0 == w)
                {
                    s.procs[p].before = Self::record_at(s, w, g);
                }
                // `record::invalidate`, durably, under our exclusive lock,
                // before the transaction that moves the row away from ready.
                for (i, g) in self.tokens_to_invalidate(s, p) {
                    Self::set_record(s, i, g, Found::Nothing);
                }
                s.procs[p].pc = Self::after_invalidate(pc);
            }
            Pc::FinishToken => {
                // `record::write_ready`, holding the lock, after the commit
                // that made the row ready.
                self.write_tokens(s, p);
                s.procs[p].pc = Pc::Release;
            }
            Pc::SlotTry => {
                let Op::Exec {
                    slot: Some(prio), ..
                } = op
                else {
                    unreachable!()
                };
                let cands = self.slot_candidates(prio);
                if let Some(f) = cands
                    .iter()
                    .copied()
                    .find(|f| Self::grantable(s, Key::Slot(*f), Mode::Exclusive))
                {
                    Self::take(s, Key::Slot(f), p, Mode::Exclusive);
                    s.procs[p].slot = Some(f);
                    s.procs[p].pc = self.images(op);
                } else if rules.nested
                    && cands
                        .iter()
                        .any(|f| self.enclosing(s, p, Key::Slot(*f)).is_some())
                {
                    // Works under the enclosing command's slot.
                    s.procs[p].pc = self.images(op);
                } else {
                    s.procs[p].pc = Pc::SlotWaiter;
                }
            }
            Pc::SlotWaiter => {
                self.look(s, |r| r.of == RecOf::SlotClass);
                Self::insert_record(
                    s,
                    Rec {
                        of: RecOf::SlotClass,
                        role: RecRole::Waiter,
                        mode: Mode::Exclusive,
                        owner: p as u8,
                    },
                );
                s.procs[p].pc = Pc::SlotWait;
            }
            Pc::SlotWait => {
                let Op::Exec {
                    slot: Some(prio), ..
                } = op
                else {
                    unreachable!()
                };
                let f = self
                    .slot_candidates(prio)
                    .into_iter()
                    .find(|f| Self::grantable(s, Key::Slot(*f), Mode::Exclusive))
                    .expect("enabled");
                Self::take(s, Key::Slot(f), p, Mode::Exclusive);
                s.procs[p].slot = Some(f);
                s.procs[p].pc = self.images(op);
            }
            Pc::Try(k) => {
                let (img, mode) = Self::wanted(op)[k as usize];
                let i = img as usize;
                if s.file[i].is_none() {
                    // No lock file: only a write creates one unasked;
                    // otherwise `require` checks the row first.
                    let ok = match op {
                        Op::Exec { write, .. } if write == Some(img) => true,
                        Op::Exec { .. } => s.rows[i] == Some(Row::Ready),
                        _ => s.rows[i].is_some(),
                    };
                    if !ok {
                        s.procs[p].pc = Pc::Release;
                        return;
                    }
                }
                let g = Self::open_create(s, img);
                let key = Key::Img(img, g);
                let mut got = Self::grantable(s, key, mode);
                if got && mode == Mode::Shared && rules.gate {
                    let gate_free = Self::grantable(s, Key::Gate(img), Mode::Shared);
                    // A reader inside its enclosing command's hold passes.
                    let nested_pass = rules.nested && self.enclosing(s, p, key).is_some();
                    got = gate_free || nested_pass;
                }
                if got {
                    if mode == Mode::Shared
                        && Self::writer_waits(s, img, &self.cfg)
                        && !self.nested_in_holder(s, p, img)
                    {
                        s.bad |= bad::BYPASS;
                    }
                    Self::take(s, key, p, mode);
                    s.procs[p].held.push((img, g, mode));
                    s.procs[p].pc = self.next_image(op, k);
                    return;
                }
                if rules.nested
                    && let Some(h) = self.enclosing(s, p, key)
                    && (mode == Mode::Exclusive || h == Mode::Exclusive)
                {
                    // Would wait for itself: fails at once (75, or 66).
                    s.procs[p].pc = Pc::Release;
                    return;
                }
                s.procs[p].pc = Pc::Waiter(k);
            }
            Pc::Waiter(k) => {
                let (img, mode) = Self::wanted(op)[k as usize];
                self.look(s, |r| r.of == RecOf::Img(img));
                // `require_all`: an image to read that has no row is an
                // answer now (66), not after the wait.
                if let Op::Exec { read: Some(r), .. } = op
                    && s.rows[r as usize].is_none()
                {
                    s.procs[p].pc = Pc::Release;
                    return;
                }
                Self::insert_record(
                    s,
                    Rec {
                        of: RecOf::Img(img),
                        role: RecRole::Waiter,
                        mode,
                        owner: p as u8,
                    },
                );
                if rules.gate {
                    s.procs[p].pc = Pc::Gate(k);
                } else {
                    s.procs[p].wgen = Self::open_create(s, img);
                    s.procs[p].pc = Pc::Wait(k);
                }
            }
            Pc::Gate(k) => {
                let (img, mode) = Self::wanted(op)[k as usize];
                Self::take(s, Key::Gate(img), p, mode);
                // A writer, holding the gate: the writer-waits hint in the
                // lock file at the path, for reads of the fast path.
                if mode == Mode::Exclusive
                    && rules.writer_hints
                    && let Some(g) = s.file[img as usize]
                {
                    Self::set(&mut s.ww, (img, g), true);
                }
                s.procs[p].wgen = Self::open_create(s, img);
                s.procs[p].pc = Pc::Wait(k);
            }
            Pc::Wait(k) => {
                let (img, mode) = Self::wanted(op)[k as usize];
                let g = s.procs[p].wgen;
                if rules.recheck && s.file[img as usize] != Some(g) {
                    // A ghost: the file was unlinked since we opened it.
                    // Open the one at the path now and wait on that.
                    s.procs[p].wgen = Self::open_create(s, img);
                    return;
                }
                Self::take(s, Key::Img(img, g), p, mode);
                s.procs[p].held.push((img, g, mode));
                Self::drop_key(s, Key::Gate(img), p);
                // A writer in: the hint goes, unless the gate (tried
                // exclusively) is held by another writer, or a reader.
                if mode == Mode::Exclusive && Self::grantable(s, Key::Gate(img), Mode::Exclusive) {
                    Self::set(&mut s.ww, (img, g), false);
                }
                s.procs[p].pc = self.next_image(op, k);
            }
            Pc::Start => {
                let Op::Exec {
                    read, write, from, ..
                } = op
                else {
                    unreachable!()
                };
                Self::drop_records(s, p, Some(RecRole::Waiter));
                // What a writer without the database left, read under our
                // locks (a writer's: before its token went).
                let held = s.procs[p].held.clone();
                for &(img, g, mode) in &held {
                    let r = if mode == Mode::Exclusive && write == Some(img) {
                        s.procs[p].before
                    } else {
                        Self::record_at(s, img, g)
                    };
                    self.fold_held(s, img, g, r);
                }
                // What our locks prove: exclusive, nobody else holds it;
                // shared, nobody holds it exclusively.
                for (img, _, mode) in &held {
                    s.records.retain(|r| {
                        !(r.of == RecOf::Img(*img)
                            && r.role == RecRole::Holder
                            && r.owner as usize != p
                            && (*mode == Mode::Exclusive || r.mode == Mode::Exclusive))
                    });
                }
                // A live store-wide hold: claim nothing, wait, start over.
                let store_held = self.store_refuses(s, p);
                let mut refused = false;
                if let Some(r) = read {
                    let ri = r as usize;
                    match s.rows[ri] {
                        Some(Row::Ready) => {}
                        other => {
                            if other.is_some_and(Row::being_written) {
                                s.rows[ri] = Some(Row::Incomplete);
                            }
                            refused = true;
                        }
                    }
                }
                if refused || store_held {
                    // A lock file this exec made for an image it would have
                    // created goes again. (Unlinked after the commit and
                    // closed when the request gives up; it does nothing
                    // with the image between, so one step here.)
                    if let Some(w) = write
                        && s.rows[w as usize].is_none()
                    {
                        Self::unlink(s, p, w);
                    }
                    if store_held {
                        // Holding nothing (the lease aside).
                        Self::close_locks(s, p);
                        s.procs[p].pc = Pc::StoreAwait;
                    } else {
                        s.procs[p].pc = Pc::Release;
                    }
                    return;
                }
                s.procs[p].claimed = true;
                self.claim_past_hold(s, p);
                // A slot holder records nothing either: its lease names it.
                if let Some(w) = write {
                    let wi = w as usize;
                    s.procs[p].prev = Some(s.rows[wi]);
                    s.rows[wi] = Some(if s.tree[wi] {
                        Row::Writing
                    } else {
                        Row::Creating
                    });
                    s.tree[wi] = true;
                    s.truth[wi].0 = true;
                }
                // A plain read (the `--from` base too) records nothing: its
                // lease names it. Writers and exclusive readers record.
                for (img, _, mode) in &held {
                    if *mode == Mode::Exclusive {
                        Self::insert_record(
                            s,
                            Rec {
                                of: RecOf::Img(*img),
                                role: RecRole::Holder,
                                mode: *mode,
                                owner: p as u8,
                            },
                        );
                    }
                }
                // A plain reader writes its token in the transaction, under
                // the global lock (no transaction that forgets the image
                // can come between the row seen and the token written).
                self.write_tokens(s, p);
                s.procs[p].pc = if from { Pc::Clone } else { Pc::Spawn };
            }
            Pc::Clone => {
                // The copy changes the tree.
                if let Op::Exec { write: Some(w), .. } = op {
                    s.whole[w as usize] = false;
                }
                s.procs[p].pc = Pc::ReleaseBase
            }
            Pc::ReleaseBase => {
                // The base is copied: its holder record goes (one short
                // transaction), then its lock. (Also naming it --read would
                // keep it; no menu does.)
                let Op::Exec {
                    read: Some(base), ..
                } = op
                else {
                    unreachable!()
                };
                s.records.retain(|r| {
                    !(r.owner as usize == p
                        && r.of == RecOf::Img(base)
                        && r.role == RecRole::Holder)
                });
                Self::release_image(s, p, base);
                s.procs[p].pc = Pc::Spawn;
            }
            Pc::Spawn => {
                // A writer's command changes the tree from now on.
                if let Op::Exec { write: Some(w), .. } = op {
                    s.whole[w as usize] = false;
                    s.truth[w as usize].0 = true;
                }
                s.procs[p].fast = false;
                s.procs[p].cmd = Cmd::Running;
                s.procs[p].pc = Pc::Command;
            }
            Pc::Abandon => {
                let Op::Exec { write, .. } = op else {
                    unreachable!()
                };
                if let Some(w) = write {
                    let wi = w as usize;
                    match s.procs[p].prev.expect("started") {
                        None => {
                            s.rows[wi] = None;
                            s.tree[wi] = false;
                        }
                        Some(prev) => s.rows[wi] = Some(prev),
                    }
                    s.truth[wi].0 = false;
                }
                Self::drop_records(s, p, None);
                s.procs[p].pc = Pc::Release;
            }
            Pc::Finish => {
                let Op::Exec { write, .. } = op else {
                    unreachable!()
                };
                if let Some(w) = write {
                    let wi = w as usize;
                    let ok = s.procs[p].ok;
                    s.rows[wi] = Some(if ok { Row::Ready } else { Row::Incomplete });
                    s.truth[wi] = (false, ok);
                }
                // An exclusive reader's token, in the transaction.
                self.write_tokens(s, p);
                Self::drop_records(s, p, None);
                s.procs[p].pc = Pc::FinishToken;
            }
            Pc::Release => {
                // `lease::retire`: the lease file goes, under its lock.
                if let Some(n) = s.procs[p].lease.take() {
                    Self::unlink_lease(s, p as u8, n);
                }
                Self::close_all(s, p);
                // A failed request leaves no waiter record behind.
                Self::drop_records(s, p, Some(RecRole::Waiter));
                s.procs[p].pc = Pc::Done;
            }
            Pc::Mark(img, ret) => {
                let i = img as usize;
                if ret == Ret::Rm {
                    // `rm` drops its waiter record once it holds the lock.
                    Self::drop_records(s, p, Some(RecRole::Waiter));
                }
                if self.store_refuses(s, p) {
                    // A store-wide command runs: busy (75); gc and doctor
                    // leave the image for later.
                    Self::release_image(s, p, img);
                    s.procs[p].pc = match ret {
                        Ret::Rm => Pc::Release,
                        _ => self.next_in_phase(ret, img),
                    };
                    return;
                }
                if s.rows[i].is_none() {
                    // Removed by someone else meanwhile: the lock file
                    // (perhaps made by our lock) names nothing.
                    Self::unlink(s, p, img);
                    s.procs[p].pc = match ret {
                        Ret::Rm => Pc::Release,
                        _ => self.next_in_phase(ret, img),
                    };
                    return;
                }
                s.rows[i] = Some(Row::Deleting);
                self.claim_past_hold(s, p);
                s.procs[p].pc = Pc::Trash(img, ret);
            }
            Pc::Trash(img, ret) => {
                let i = img as usize;
                let (writers, readers) = self.users(s, img);
                let others_hold = writers.iter().chain(&readers).any(|&q| q != p);
                if others_hold {
                    s.bad |= bad::DELETED_WHILE_LOCKED;
                }
                s.tree[i] = false;
                s.procs[p].pc = Pc::DropRow(img, ret);
            }
            Pc::DropRow(img, ret) => {
                s.rows[img as usize] = None;
                s.truth[img as usize] = (false, false);
                s.procs[p].pc = Pc::Unlink(img, ret);
            }
            Pc::Unlink(img, ret) => {
                Self::unlink(s, p, img);
                s.procs[p].pc = Pc::DeleteTrash(img, ret);
            }
            Pc::DeleteTrash(img, ret) => {
                // The tree left the images directory at `trash`; deleting it
                // touches nothing any lock protects.
                s.procs[p].pc = self.next_in_phase(ret, img);
            }
            Pc::ListInterrupted => {
                let mut listed = 0;
                let mut names = 0;
                for i in 0..self.cfg.images {
                    match s.rows[i as usize] {
                        Some(Row::Deleting) => {
                            listed |= 1 << i;
                            names |= 1 << i;
                        }
                        Some(_) => names |= 1 << i,
                        None => {}
                    }
                }
                s.procs[p].listed = listed;
                s.procs[p].names = names;
                s.procs[p].pc = Pc::LockInterrupted(0);
            }
            Pc::LockInterrupted(img) => {
                let next = self.next_in_phase(Ret::Interrupted, img);
                if !Self::lock_listed(s, p, img, next) {
                    return;
                }
                self.recheck_fold(s, p, img);
                match s.rows[img as usize] {
                    Some(Row::Deleting) => s.procs[p].pc = self.remove(img, Ret::Interrupted),
                    None => {
                        Self::unlink(s, p, img);
                        s.procs[p].pc = next;
                    }
                    Some(_) => {
                        Self::release_image(s, p, img);
                        s.procs[p].pc = next;
                    }
                }
            }
            Pc::OrphanLock(img) => {
                let next = if img + 1 < self.cfg.images {
                    Pc::OrphanLock(img + 1)
                } else {
                    Self::after_orphans(op)
                };
                s.procs[p].pc = next;
                if s.procs[p].names & (1 << img) != 0 {
                    return;
                }
                if Self::try_exclusive(s, p, img, false).is_some() {
                    if s.rows[img as usize].is_none() {
                        Self::unlink(s, p, img);
                    } else {
                        Self::release_image(s, p, img);
                    }
                }
            }
            Pc::Sweep => {
                self.look(s, |_| true);
                if op == Op::Doctor {
                    // `find_inconsistencies`: a ready image without its tree
                    // (a store-wide command's deletion that its SIGKILLed
                    // stowage never forgot) loses its row, if its lock is
                    // free — tried exclusively, its token invalidated under
                    // it first.
                    for i in 0..self.cfg.images {
                        let ix = i as usize;
                        let free = s.file[ix]
                            .is_none_or(|g| Self::grantable(s, Key::Img(i, g), Mode::Exclusive));
                        if s.rows[ix] == Some(Row::Ready) && !s.tree[ix] && free {
                            if rules.doctor_invalidates
                                && let Some(g) = s.file[ix]
                            {
                                Self::set_record(s, i, g, Found::Nothing);
                            }
                            s.rows[ix] = None;
                            s.truth[ix] = (false, false);
                        }
                    }
                }
                // A writer that died leaves its image creating/writing with
                // the lock free.
                for i in 0..self.cfg.images as usize {
                    if s.rows[i].is_some_and(Row::being_written) {
                        let held_excl = s.file[i].is_some_and(|g| {
                            !Self::grantable(s, Key::Img(i as u8, g), Mode::Shared)
                        });
                        if !held_excl {
                            s.rows[i] = Some(Row::Incomplete);
                        }
                    }
                }
                let mut listed = 0;
                for i in 0..self.cfg.images {
                    if s.rows[i as usize] == Some(Row::Incomplete) {
                        listed |= 1 << i;
                    }
                }
                s.procs[p].listed = listed;
                if rules.leases {
                    // Then, in the same transaction, the leases of owners
                    // that died.
                    s.global = Some(p as u8);
                    s.procs[p].pc = Pc::CleanLock;
                } else {
                    s.procs[p].pc = match op {
                        Op::Gc => Pc::Collect(0),
                        Op::Doctor => Pc::ListInterrupted,
                        _ => Pc::Done,
                    };
                }
            }
            Pc::Collect(img) => {
                let next = self.next_in_phase(Ret::Collect, img);
                if !Self::lock_listed(s, p, img, next) {
                    return;
                }
                self.recheck_fold(s, p, img);
                match s.rows[img as usize] {
                    None => {
                        Self::unlink(s, p, img);
                        s.procs[p].pc = next;
                    }
                    Some(r) if r == Row::Incomplete || r.being_written() => {
                        s.procs[p].pc = self.remove(img, Ret::Collect);
                    }
                    Some(_) => {
                        Self::release_image(s, p, img);
                        s.procs[p].pc = next;
                    }
                }
            }
        }
    }

    fn initial(&self) -> State {
        let n = self.cfg.images as usize;
        let mut s = State {
            procs: vec![
                Proc {
                    op: None,
                    pc: Pc::Choose,
                    alive: true,
                    cmd: Cmd::NotRun,
                    held: vec![],
                    slot: None,
                    wgen: 0,
                    prev: None,
                    listed: 0,
                    names: 0,
                    ok: false,
                    lease: None,
                    lname: 0,
                    lgen: 0,
                    doomed: vec![],
                    claimed: false,
                    fast: false,
                    fw: false,
                    before: Found::Nothing,
                    fold: Fold::Idle,
                    fold_locks: vec![],
                };
                self.cfg.roles.len()
            ],
            locks: vec![],
            file: vec![None; n],
            next_gen: vec![0; n],
            rows: vec![None; n],
            tree: vec![false; n],
            truth: vec![(false, false); n],
            records: vec![],
            lfiles: vec![],
            lwritten: vec![],
            global: None,
            store_rec: None,
            tokens: vec![],
            ww: vec![],
            sw: vec![],
            wrecs: vec![],
            marks: 0,
            whole: vec![true; n],
            crashes: 0,
            bad: 0,
        };
        for &i in &self.cfg.ready_at_start {
            let i = i as usize;
            s.rows[i] = Some(Row::Ready);
            s.tree[i] = true;
            s.truth[i] = (false, true);
            s.file[i] = Some(0);
            s.next_gen[i] = 1;
            s.tokens.push((i as u8, 0));
        }
        s
    }

    // -- invariants ------------------------------------------------------------

    /// Who works on an image, and how: a process holding its lock (by its
    /// own belief, after its checks), or a command running on it.
    fn users(&self, s: &State, img: u8) -> (Vec<usize>, Vec<usize>) {
        let mut writers = vec![];
        let mut readers = vec![];
        for (p, pr) in s.procs.iter().enumerate() {
            let op = pr.op.map(|i| self.cfg.roles[p].menu[i as usize]);
            let cmd_mode = match op {
                Some(op) if pr.cmd == Cmd::Running => Self::wanted(op)
                    .into_iter()
                    .filter(|(_, m)| {
                        !(matches!(op, Op::Exec { from: true, .. }) && *m == Mode::Shared)
                    })
                    .find(|(i, _)| *i == img)
                    .map(|(_, m)| m),
                _ => None,
            };
            let held = pr
                .held
                .iter()
                .filter(|(i, _, _)| *i == img)
                .map(|(_, _, m)| *m)
                .max();
            match held.max(cmd_mode) {
                Some(Mode::Exclusive) => writers.push(p),
                Some(Mode::Shared) => readers.push(p),
                None => {}
            }
        }
        (writers, readers)
    }

    pub fn exclusion_holds(&self, s: &State) -> bool {
        (0..self.cfg.images).all(|i| {
            let (w, r) = self.users(s, i);
            w.len() <= 1 && (w.is_empty() || r.is_empty())
        })
    }

    /// A row `ready` without a marker: the last write succeeded (with a
    /// marker, the record says what the write did).
    pub fn ready_means_written(&self, s: &State) -> bool {
        (0..self.cfg.images as usize).all(|i| {
            s.rows[i] != Some(Row::Ready)
                || s.marks & (1 << i) != 0
                || (!s.truth[i].0 && s.truth[i].1)
        })
    }

    /// A process reading image `r` (a read's or exclusive read's claim or
    /// command, a `--from` copy's base while it is held).
    fn reads(&self, s: &State, q: usize) -> Option<u8> {
        let Some(Op::Exec {
            read: Some(r),
            from,
            ..
        }) = self.op(s, q)
        else {
            return None;
        };
        let pr = &s.procs[q];
        let reading =
            (pr.claimed && pr.held.iter().any(|h| h.0 == r)) || (pr.cmd == Cmd::Running && !from);
        reading.then_some(r)
    }

    /// No reader (fast or slow) is past its claim or runs its command on a
    /// tree a writer's command changed and did not finish successfully.
    pub fn readers_see_whole(&self, s: &State) -> bool {
        (0..s.procs.len()).all(|q| self.reads(s, q).is_none_or(|r| s.whole[r as usize]))
    }

    /// A valid ready token (a writer's `ready` record is one) in the lock
    /// file at the path only for a complete tree.
    pub fn token_means_whole(&self, s: &State) -> bool {
        s.tokens
            .iter()
            .all(|&(i, g)| s.file[i as usize] != Some(g) || s.whole[i as usize])
    }

    /// A row `ready` with no marker only for a complete tree (a fold at
    /// work on the image, holding the global lock and the image's, aside).
    pub fn unmarked_ready_means_whole(&self, s: &State) -> bool {
        let folding = s
            .procs
            .iter()
            .filter(|pr| pr.alive)
            .map(|pr| match pr.fold {
                Fold::Commit(m) => m,
                _ => 0,
            })
            .fold(0, |a, m| a | m);
        (0..self.cfg.images as usize).all(|i| {
            s.rows[i] != Some(Row::Ready) || (s.marks | folding) & (1 << i) != 0 || s.whole[i]
        })
    }

    /// A `writing` record in the lock file at the path, beside a row that
    /// says ready, has its marker: every write the row does not show is
    /// announced to the folds.
    pub fn writing_is_marked(&self, s: &State) -> bool {
        s.wrecs.iter().all(|&(i, g, r)| {
            r != Found::Writing
                || s.file[i as usize] != Some(g)
                || s.rows[i as usize] != Some(Row::Ready)
                || s.marks & (1 << i) != 0
        })
    }

    /// At work on an image or a slot: an exec past its start, or its
    /// command; a removal past its mark.
    fn at_work(&self, s: &State, q: usize) -> bool {
        let pr = &s.procs[q];
        match self.op(s, q) {
            Some(Op::Exec { .. }) => pr.claimed || pr.cmd == Cmd::Running,
            Some(Op::Rm(_) | Op::Gc | Op::Doctor) => {
                pr.alive && matches!(pr.pc, Pc::Trash(..) | Pc::DropRow(..) | Pc::Unlink(..))
            }
            _ => false,
        }
    }

    /// A store-wide hold that was granted and has not ended (its record
    /// dropped, or its command gone with its stowage).
    fn granted_hold(&self, s: &State) -> Option<usize> {
        let h = s.store_rec? as usize;
        (matches!(self.op(s, h), Some(Op::StoreWide { .. }))
            && (s.procs[h].claimed || s.procs[h].cmd == Cmd::Running))
            .then_some(h)
    }

    /// While a store-wide hold is granted, nobody outside its command is at
    /// work on an image or a slot, and every image or slot lock held
    /// outside it is a request's that will claim nothing.
    pub fn store_hold_alone(&self, s: &State) -> bool {
        let Some(h) = self.granted_hold(s) else {
            return true;
        };
        (0..s.procs.len())
            .filter(|&q| q != h && !self.in_tree_of(q, h))
            .all(|q| !self.at_work(s, q))
    }

    /// An image held by `--read-exclusive` is ready, before, during and
    /// after the command.
    pub fn exclusive_read_leaves_ready(&self, s: &State) -> bool {
        (0..s.procs.len()).all(|q| match self.op(s, q) {
            Some(Op::Exec {
                read: Some(r),
                read_excl: true,
                ..
            }) if s.procs[q].claimed || s.procs[q].cmd == Cmd::Running => {
                s.rows[r as usize] == Some(Row::Ready)
            }
            _ => true,
        })
    }

    /// `record.rs`: a valid ready token (in the file at the image's path)
    /// exists only while the image's row says ready.
    pub fn token_means_ready(&self, s: &State) -> bool {
        s.tokens
            .iter()
            .all(|&(i, g)| s.file[i as usize] != Some(g) || s.rows[i as usize] == Some(Row::Ready))
    }

    /// A plain reader (`--from`'s base too, while it is held) past its
    /// claim — the slow path's `start` or the fast path's `fast-store` —
    /// or whose command runs, reads a ready image.
    pub fn readers_read_ready(&self, s: &State) -> bool {
        (0..s.procs.len()).all(|q| match self.op(s, q) {
            Some(Op::Exec {
                read: Some(r),
                read_excl: false,
                from,
                ..
            }) => {
                let pr = &s.procs[q];
                let reading = (pr.claimed && pr.held.iter().any(|h| h.0 == r))
                    || (pr.cmd == Cmd::Running && !from);
                !reading || s.rows[r as usize] == Some(Row::Ready)
            }
            _ => true,
        })
    }

    /// A read of the fast path at `fast-store`, holding its image.
    fn fast_holding(s: &State) -> impl Iterator<Item = &Proc> {
        s.procs
            .iter()
            .filter(|pr| pr.alive && pr.pc == Pc::FastStore && !pr.held.is_empty())
    }

    pub fn slots_within_limits(&self, s: &State) -> bool {
        let l = self.cfg.slot_limit;
        s.procs.iter().enumerate().all(|(p, pr)| {
            let normal = matches!(
                pr.op.map(|i| self.cfg.roles[p].menu[i as usize]),
                Some(Op::Exec {
                    slot: Some(Prio::Normal),
                    ..
                })
            );
            !(normal && pr.slot.is_some_and(|f| f >= l))
        })
    }
}

impl Model for Proto {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.initial()]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        self.progress_actions(s, out);
        if s.crashes < self.cfg.crashes {
            for p in 0..s.procs.len() {
                if Self::started(&s.procs[p]) {
                    out.push(Action::Crash(p as u8));
                }
            }
            let mut hosts: Vec<u8> = self.cfg.roles.iter().map(|r| r.host).collect();
            hosts.sort();
            hosts.dedup();
            for h in hosts {
                let busy = (0..s.procs.len()).any(|p| {
                    self.cfg.roles[p].host == h
                        && (Self::started(&s.procs[p]) || s.procs[p].cmd == Cmd::Running)
                });
                if busy {
                    out.push(Action::HostDies(h));
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Choose(p, i) => {
                let p = p as usize;
                s.procs[p].op = Some(i);
                s.procs[p].pc = self.first(self.cfg.roles[p].menu[i as usize]);
            }
            Action::Step(p) => self.step(&mut s, p as usize),
            Action::Fail(p) if self.listing_may_miss(&s, p as usize) => {
                // The listing saw no marker: the transaction folds nothing.
                s.procs[p as usize].fold = Fold::Done;
                self.step(&mut s, p as usize);
            }
            Action::Fail(p) => {
                let p = p as usize;
                match s.procs[p].pc {
                    // A token older than the resolution: the slow way.
                    Pc::FastTry | Pc::FastStore => {
                        let op = self.op(&s, p).expect("started");
                        Self::close_locks(&mut s, p);
                        s.procs[p].pc = self.after_lease(op);
                    }
                    // A half-made copy is never ready.
                    Pc::Clone => {
                        s.procs[p].ok = false;
                        s.procs[p].pc = Pc::Finish;
                    }
                    Pc::Spawn => {
                        let from = matches!(self.op(&s, p), Some(Op::Exec { from: true, .. }));
                        if matches!(self.op(&s, p), Some(Op::StoreWide { .. })) {
                            s.procs[p].pc = Pc::StoreInvalidate;
                        } else if from {
                            s.procs[p].ok = false;
                            s.procs[p].pc = Pc::Finish;
                        } else if s.procs[p].fw {
                            s.procs[p].pc = Pc::PutBack;
                        } else {
                            s.procs[p].pc = Pc::Abandon;
                        }
                    }
                    _ => unreachable!(),
                }
            }
            Action::Exit(p, ok) => {
                let p = p as usize;
                if let Some(Op::StoreWide {
                    deletes: Some(i), ..
                }) = self.op(&s, p)
                {
                    s.tree[i as usize] = false;
                }
                s.procs[p].cmd = Cmd::Exited;
                s.procs[p].ok = ok;
                if ok && let Some(Op::Exec { write: Some(w), .. }) = self.op(&s, p) {
                    s.whole[w as usize] = true;
                }
                for c in self.nested_children(p).collect::<Vec<_>>() {
                    if s.procs[c].pc == Pc::Choose {
                        s.procs[c].pc = Pc::Done;
                    }
                }
                if s.procs[p].alive {
                    s.procs[p].pc = match self.op(&s, p) {
                        Some(Op::StoreWide { .. }) => Pc::StoreInvalidate,
                        _ if s.procs[p].fw => Pc::FastRecord,
                        _ => Pc::Finish,
                    };
                } else {
                    // The last holder of the inherited descriptors is gone.
                    Self::close_all(&mut s, p);
                }
            }
            Action::Crash(p) => {
                s.crashes += 1;
                self.kill(&mut s, p as usize);
            }
            Action::HostDies(h) => {
                s.crashes += 1;
                self.host_dies(&mut s, h);
            }
        }
        if let Action::Choose(p, _) | Action::Step(p) | Action::Fail(p) | Action::Exit(p, _) =
            action
            && s.procs[p as usize].alive
        {
            self.skip_noops(&mut s, p as usize);
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "never two writers, never a reader during a write",
                |m: &Proto, s: &State| m.exclusion_holds(s),
            ),
            Property::always(
                "ready only if the last writer succeeded",
                |m: &Proto, s: &State| m.ready_means_written(s),
            ),
            Property::always(
                "no record of a dead owner survives a look",
                |_, s: &State| s.bad & bad::STALE_RECORD == 0,
            ),
            Property::always("nothing deleted while locked", |_, s: &State| {
                s.bad & bad::DELETED_WHILE_LOCKED == 0
            }),
            Property::always("no deadlock", |m: &Proto, s: &State| !m.deadlocked(s)),
            Property::always("no new reader passes a waiting writer", |_, s: &State| {
                s.bad & bad::BYPASS == 0
            }),
            Property::always("slots within their limits", |m: &Proto, s: &State| {
                m.slots_within_limits(s)
            }),
            Property::always(
                "no record lives past a look once its lease is free",
                |_, s: &State| s.bad & bad::LEASE_STALE == 0,
            ),
            Property::always("a live holder's record is never dropped", |_, s: &State| {
                s.bad & bad::LIVE_DROPPED == 0
            }),
            Property::always(
                "a prober never unlinks a lease someone holds",
                |_, s: &State| s.bad & bad::LIVE_UNLINKED == 0,
            ),
            Property::always(
                "while a store-wide hold is granted, nobody else is at work on an image or slot",
                |m: &Proto, s: &State| m.store_hold_alone(s),
            ),
            Property::always(
                "no image user starts while a store-wide hold waits or runs",
                |_, s: &State| s.bad & bad::PASSED_HOLD == 0,
            ),
            Property::always(
                "an exclusively read image stays ready",
                |m: &Proto, s: &State| m.exclusive_read_leaves_ready(s),
            ),
            Property::always(
                "no reader runs on a tree a write left incomplete",
                |m: &Proto, s: &State| m.readers_see_whole(s),
            ),
            Property::always(
                "a valid ready token only for a complete tree",
                |m: &Proto, s: &State| m.token_means_whole(s),
            ),
            Property::always(
                "a ready row without a marker only for a complete tree",
                |m: &Proto, s: &State| m.unmarked_ready_means_whole(s),
            ),
            Property::always(
                "a writing record beside a ready row has its marker",
                |m: &Proto, s: &State| m.writing_is_marked(s),
            ),
            Property::sometimes(
                "without a crash, a complete image is left incomplete",
                |m: &Proto, s: &State| {
                    s.crashes == 0
                        && (0..s.procs.len()).all(|p| m.quiet(s, p))
                        && (0..m.cfg.images as usize)
                            .any(|i| s.rows[i] == Some(Row::Incomplete) && s.whole[i] && s.tree[i])
                },
            ),
            Property::sometimes(
                "a write runs its command without the database",
                |_, s: &State| s.procs.iter().any(|pr| pr.fw && pr.cmd == Cmd::Running),
            ),
            Property::sometimes(
                "a fold finds a marker whose write is in progress",
                |_, s: &State| {
                    s.procs
                        .iter()
                        .any(|pr| pr.alive && pr.fw && pr.cmd == Cmd::Running)
                        && s.procs.iter().any(|pr| pr.fold == Fold::Done)
                },
            ),
            Property::sometimes(
                "a crash falls between a fold's commit and its marker's unlink",
                |_, s: &State| {
                    s.procs
                        .iter()
                        .any(|pr| !pr.alive && matches!(pr.fold, Fold::Unlink(_)))
                },
            ),
            Property::sometimes(
                "a dead fast writer's record is folded to incomplete",
                |_, s: &State| {
                    s.wrecs.iter().any(|&(i, g, r)| {
                        r == Found::Writing
                            && s.file[i as usize] == Some(g)
                            && s.rows[i as usize] == Some(Row::Incomplete)
                            && s.marks & (1 << i) == 0
                    })
                },
            ),
            Property::sometimes(
                "a marker outlives a successful write and a read follows",
                |m: &Proto, s: &State| {
                    s.marks != 0
                        && (0..s.procs.len())
                            .any(|q| m.reads(s, q).is_some() && s.procs[q].cmd == Cmd::Running)
                },
            ),
            Property::always(
                "a ready token only on a ready row",
                |m: &Proto, s: &State| m.token_means_ready(s),
            ),
            Property::always(
                "no reader's command runs on an image whose row is not ready",
                |m: &Proto, s: &State| m.readers_read_ready(s),
            ),
            Property::sometimes(
                "a read claims its image on a ready token, without the database",
                |_, s: &State| s.procs.iter().any(|pr| pr.fast && pr.alive),
            ),
            Property::sometimes(
                "a writer waits with its hint in the lock file",
                |m: &Proto, s: &State| {
                    (0..m.cfg.images).any(|i| {
                        Self::writer_waits(s, i, &m.cfg)
                            && s.file[i as usize].is_some_and(|g| s.ww.contains(&(i, g)))
                    })
                },
            ),
            Property::sometimes(
                "a read of the fast path finds store.lock held",
                |_, s: &State| {
                    Self::fast_holding(s).next().is_some()
                        && !Self::grantable(s, Key::Store, Mode::Shared)
                },
            ),
            Property::sometimes("a ready image has no token", |m: &Proto, s: &State| {
                (0..m.cfg.images).any(|i| {
                    s.rows[i as usize] == Some(Row::Ready)
                        && s.file[i as usize].is_some_and(|g| !s.tokens.contains(&(i, g)))
                })
            }),
            Property::sometimes(
                "a store-wide command deleted an image's tree",
                |m: &Proto, s: &State| !m.deleted(s).is_empty(),
            ),
            Property::sometimes(
                "a nested reader holds the image while a writer waits",
                |m: &Proto, s: &State| {
                    s.procs.iter().enumerate().any(|(p, pr)| {
                        m.cfg.roles[p].parent.is_some()
                            && pr.held.iter().any(|(i, _, md)| {
                                *md == Mode::Shared && Self::writer_waits(s, *i, &m.cfg)
                            })
                    })
                },
            ),
            Property::sometimes(
                "a waiter is blocked on an unlinked lock file",
                |m: &Proto, s: &State| {
                    s.procs
                        .iter()
                        .enumerate()
                        .any(|(p, pr)| match (pr.pc, m.op(s, p)) {
                            (Pc::Wait(k), Some(op)) => {
                                let (img, _) = Self::wanted(op)[k as usize];
                                s.file[img as usize] != Some(pr.wgen)
                            }
                            _ => false,
                        })
                },
            ),
            Property::sometimes(
                "a command outlives its killed stowage, holding the lock",
                |_, s: &State| {
                    s.procs
                        .iter()
                        .any(|pr| !pr.alive && pr.cmd == Cmd::Running && !pr.held.is_empty())
                },
            ),
            Property::sometimes(
                "a dead writer's image is found incomplete",
                |_, s: &State| {
                    s.rows
                        .iter()
                        .zip(&s.truth)
                        .any(|(r, t)| *r == Some(Row::Incomplete) && t.0)
                },
            ),
            Property::sometimes("an image is removed", |m: &Proto, s: &State| {
                m.cfg
                    .ready_at_start
                    .iter()
                    .any(|&i| s.rows[i as usize].is_none())
            }),
            // What lets the owner skip the re-check (lease.rs): a prober
            // leaves a lease nobody wrote yet while its owner may lock it.
            // (Without the rule it happens: the re-check's mutation test.)
            Property::always(
                "no prober unlinks a fresh lease before its owner locks it",
                |m: &Proto, s: &State| {
                    !m.cfg.rules.lease_unwritten_kept
                        || !s.procs.iter().enumerate().any(|(p, pr)| {
                            pr.alive
                                && pr.pc == Pc::LeaseLock
                                && Self::lease_file(s, p as u8, pr.lname) != Some(pr.lgen)
                        })
                },
            ),
            Property::sometimes(
                "a prober leaves a fresh lease its owner has not locked yet",
                |m: &Proto, s: &State| {
                    !m.cfg.rules.lease_unwritten_kept
                        || s.procs.iter().enumerate().any(|(p, pr)| {
                            pr.alive
                                && pr.pc == Pc::LeaseLock
                                && Self::lease_file(s, p as u8, pr.lname) == Some(pr.lgen)
                                && s.procs.iter().any(|q| q.pc == Pc::CleanUnlink)
                        })
                },
            ),
            Property::sometimes(
                "an owner finds its fresh lease held by a prober",
                |_, s: &State| {
                    s.procs.iter().enumerate().any(|(p, pr)| {
                        pr.alive
                            && pr.pc == Pc::LeaseLock
                            && !Self::grantable(
                                s,
                                Key::Lease(p as u8, pr.lname, pr.lgen),
                                Mode::Exclusive,
                            )
                    })
                },
            ),
            Property::sometimes(
                "the lease of a dead owner waits to be cleaned",
                |_, s: &State| {
                    s.lfiles.iter().any(|&(o, n, g)| {
                        !Self::owner_lives(s, o as usize)
                            && Self::grantable(s, Key::Lease(o, n, g), Mode::Exclusive)
                    })
                },
            ),
            Property::sometimes(
                "a clean unlinks the lease of a dead owner",
                |_, s: &State| s.bad & bad::CLEANED_DEAD != 0,
            ),
            Property::sometimes(
                "an exec waits for a granted store-wide hold",
                |m: &Proto, s: &State| {
                    m.granted_hold(s).is_some()
                        && s.procs.iter().any(|pr| pr.alive && pr.pc == Pc::StoreAwait)
                },
            ),
            Property::sometimes(
                "a store-wide hold waits for an image user",
                |_, s: &State| {
                    s.procs
                        .iter()
                        .any(|pr| pr.alive && matches!(pr.pc, Pc::StoreWaitFree(Key::Img(..))))
                },
            ),
            Property::sometimes(
                "an exclusive reader's command runs",
                |m: &Proto, s: &State| {
                    (0..s.procs.len()).any(|q| {
                        s.procs[q].cmd == Cmd::Running
                            && matches!(
                                m.op(s, q),
                                Some(Op::Exec {
                                    read_excl: true,
                                    ..
                                })
                            )
                    })
                },
            ),
            Property::sometimes(
                "a process works under its enclosing command's slot",
                |m: &Proto, s: &State| {
                    s.procs.iter().enumerate().any(|(p, pr)| {
                        pr.alive
                            && pr.slot.is_none()
                            && matches!(m.op(s, p), Some(Op::Exec { slot: Some(_), .. }))
                            && matches!(pr.pc, Pc::Try(_) | Pc::Start | Pc::Spawn | Pc::Command)
                    })
                },
            ),
        ]
    }
}
