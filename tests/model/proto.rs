//! The lock protocol of `src/` as a state machine, for exhaustive checking.
//!
//! - A process is one stowage invocation (with its command); each `Step`
//!   is one atomic move. SIGKILL may fall between any two steps: its locks
//!   go with their last descriptor (a running command keeps what it
//!   inherited); lock files, records and trees stay.
//! - An image's record lives in its lock file: two slots, the newest valid
//!   one wins, so a write cut short (`Torn`) leaves the record before it.
//!   Only the holder of the exclusive lock writes it.
//! - Lock files have generations: one unlinked (marked gone first) while a
//!   waiter is blocked on it is a ghost, which the waiter must notice: a
//!   record, or a file with nothing in it, proves the file at its path.
//! - The catalog is derived: an adversary deletes, empties, damages or
//!   replaces it at any moment, and nothing may depend on it.
//! - `store.lock` and the gates are single lock files (never unlinked in
//!   the model); hints (`W`, `S`) are bytes of the lock file any opener
//!   writes, erased by truncation and by the first record's whole-area write.

use crate::steps::Step;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    Shared,
    Exclusive,
}
use Mode::{Exclusive as EX, Shared as SH};

/// A lock: an image's lock file (image, generation), its gate, the slot
/// (one class, limit 1), `store.lock`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    Img(u8, u8),
    Gate(u8),
    Slot,
    Store,
}

/// A record's state; `Failed` and `Adopted` are `incomplete` with an
/// outcome (a failed writer's, or "adopted (readiness unknown)").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum St {
    Creating,
    Writing,
    Ready,
    Failed,
    Adopted,
    Deleting,
}

/// What a lock file's record area says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rec {
    Empty,
    Damaged,
    Valid(St),
    /// Marked gone by its unlinker (only ever in an unlinked file).
    Gone,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct File {
    pub g: u8,
    pub rec: Rec,
    /// Hints: a writer waits at the gate; a store-wide hold may run.
    pub ww: bool,
    pub sw: bool,
}

/// An image's tree in the images directory. `Gone`: deleted by a
/// store-wide command (or by hand), not by a removal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tree {
    None,
    Empty,
    Partial,
    Whole,
    Gone,
}

impl Tree {
    pub fn present(self) -> bool {
        matches!(self, Tree::Empty | Tree::Partial | Tree::Whole)
    }
}

/// What the catalog adversary does to `stowage.db`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Loss {
    Delete,
    Empty,
    Damage,
    /// Replaced by a database whose rows lie (ready ones say failed, the
    /// others ready).
    Replace,
    /// Replaced by an older release's catalog (schema ≤ 10: an old backup
    /// restored) whose rows say every image is ready.
    Legacy,
}

pub const LOSSES: [Loss; 5] = [
    Loss::Delete,
    Loss::Empty,
    Loss::Damage,
    Loss::Replace,
    Loss::Legacy,
];

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Catalog {
    pub lost: Option<Loss>,
    /// Each image's row, as the catalog says it (`None`: no row, or no
    /// usable catalog).
    pub rows: Vec<Option<St>>,
}

/// What a process does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `exec [--read R | --from R] [--write W] [--slot c]`.
    Exec {
        read: Option<u8>,
        write: Option<u8>,
        from: bool,
        slot: bool,
    },
    /// `exec --store-wide`, whose command may delete an image's tree.
    StoreWide {
        deletes: Option<u8>,
    },
    Rm(u8),
    /// `gc`, with `--max-size`/`--unused-for` (`lru`) or without.
    Gc {
        lru: bool,
    },
    /// `doctor --repair`.
    Doctor,
}

pub fn img_name(i: u8) -> char {
    (b'A' + i) as char
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Op::Exec {
                read,
                write,
                from,
                slot,
            } => {
                write!(f, "exec")?;
                if let Some(r) = read {
                    let how = if from { "from" } else { "read" };
                    write!(f, " --{how} {}", img_name(r))?;
                }
                if let Some(w) = write {
                    write!(f, " --write {}", img_name(w))?;
                }
                if slot {
                    write!(f, " --slot c")?;
                }
                Ok(())
            }
            Op::StoreWide { deletes } => {
                write!(f, "exec --store-wide")?;
                match deletes {
                    Some(i) => write!(f, " -- (deletes {})", img_name(i)),
                    None => Ok(()),
                }
            }
            Op::Rm(i) => write!(f, "rm {}", img_name(i)),
            Op::Gc { lru } => write!(f, "gc{}", if lru { " --max-size S" } else { "" }),
            Op::Doctor => write!(f, "doctor --repair"),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Role {
    /// A nested call: run by the command of this process.
    pub parent: Option<u8>,
    /// The operations it may do (one of them, chosen by the checker).
    pub menu: Vec<Op>,
}

/// How a reader decides that an image is readable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reads {
    /// The record read under its shared lock says `ready` (the code).
    #[default]
    UnderLock,
    /// (Mutation) the record read before it took its lock.
    BeforeLock,
    /// (Mutation) the catalog's row.
    Catalog,
}

/// Each flag breaks one rule of the protocol (a mutation test turns it
/// on). All off: the code as it is.
#[derive(Clone, Debug, Default)]
pub struct Rules {
    /// A waiter keeps the lock of a file unlinked since it opened it (no
    /// check that the file is still the one at its path).
    pub no_recheck: bool,
    /// Lock files are unlinked as they are, not marked gone first (so a
    /// valid record no longer proves that the file is at its path).
    pub unlink_unmarked: bool,
    /// Lock files are emptied, not marked gone, before an unlink (so an
    /// unlinked file passes for a new image's fresh one).
    pub unlink_emptied: bool,
    /// The command touches the tree before `writing`/`creating` is written.
    pub tree_before_record: bool,
    /// A new image's `mkdir` before its `creating` record.
    pub mkdir_before_record: bool,
    /// The outcome record is written after the lock goes.
    pub record_after_unlock: bool,
    pub reads: Reads,
    /// gc collects an adopted image (readiness unknown) as a failed one.
    pub gc_takes_adopted: bool,
    /// gc trusts its survey, not the record read again under the lock.
    pub gc_trusts_survey: bool,
    /// gc lists and judges images by the catalog as it finds it.
    pub gc_trusts_catalog: bool,
    /// An empty lock file is unlinked without a look under its lock.
    pub unlink_unchecked: bool,
    /// One record slot, written in place.
    pub one_slot: bool,
    /// A new image's writer does not ask `store.lock`.
    pub no_probe_new: bool,
    /// Image users ignore the store-wide hint.
    pub hint_ignored: bool,
    /// A hold sets the hint before each lock only, not again under it.
    pub no_rehint: bool,
    /// Readers do not queue at the gate behind a waiting writer.
    pub no_gate: bool,
    /// Nested calls wait for their enclosing command's locks.
    pub no_nested: bool,
    /// A writer inside a store-wide hold leaves its new lock file without
    /// the hint (so users outside do not ask `store.lock`).
    pub no_hint_inside_hold: bool,
    /// doctor asks `store.lock` once, not again under each image's lock
    /// before it clears the hint.
    pub doctor_probes_once: bool,
    /// Adoption does not check under the lock that the tree is still there.
    pub adopt_unchecked: bool,
    /// A new image's first record write erases the hints.
    pub first_write_erases_hints: bool,
    /// An older release's catalog is migrated in any store, not only one
    /// without a configuration (`migrate::is_legacy`).
    pub migrate_any_old_catalog: bool,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub images: u8,
    pub roles: Vec<Role>,
    /// SIGKILLs (or torn writes) one run may have.
    pub crashes: u8,
    /// Catalog losses one run may have.
    pub losses: u8,
    pub rules: Rules,
    /// The images at the start (a record each, and a tree: whole for a
    /// ready or adopted one, partial for a failed one).
    pub records: Vec<(u8, St)>,
    /// Check that the catalog decides nothing (each state's moves compared
    /// under every lost catalog: costs a few times the run).
    pub catalog_check: bool,
    /// The adversary may also put an older release's catalog in place.
    pub legacy: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ret {
    Rm,
    Interrupted,
    Collect,
}

/// Defines `Pc` (a process's next step, with its operands) and its step:
/// each variant is named as its `Step`.
macro_rules! pcs {
    ($($pc:ident $(($($arg:ty),*))?)*) => {
        /// The program counter of a process.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        pub enum Pc { #[default] Choose, Done, $($pc $(($($arg),*))?),* }

        impl Pc {
            pub fn step(self) -> Option<Step> {
                match self {
                    Pc::Choose | Pc::Done => None,
                    $(Pc::$pc { .. } => Some(Step::$pc)),*
                }
            }
        }
    };
}

pcs! {
    SlotTry SlotWait Try(u8) Gate(u8) Wait(u8) Check ClearHints StoreAwait
    FinishRemoval Start Mkdir Clone ReleaseBase Spawn Command Finish Abandon Release
    Mark(u8, Ret) Trash(u8, Ret) DropRecord(u8, Ret) DeleteTrash(u8, Ret)
    ListInterrupted LockInterrupted(u8) Survey Collect(u8)
    DocRecords DocHints ClearHint(u8) DocTrees DropMissing(u8) ListOrphans Adopt(u8)
    DocLeftovers UnlinkEmpty(u8)
    StoreLock Hint Pass(u8) PassWait(u8) Forget StoreRelease
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Cmd {
    #[default]
    NotRun,
    Running,
    Exited,
}

/// An image lock a process holds (by its own belief), with what the file
/// said when it took it (updated by its own writes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Held {
    pub img: u8,
    pub g: u8,
    pub mode: Mode,
    pub seen: Rec,
    pub sw: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Proc {
    pub op: Option<u8>,
    pub pc: Pc,
    /// The stowage process itself.
    pub killed: bool,
    pub cmd: Cmd,
    pub held: Vec<Held>,
    /// The generation of the file a blocked wait is on.
    pub wgen: u8,
    /// A writer: the record before its own (`None`: a new image), whether
    /// it made the tree, the file it writes, and the command's outcome.
    pub before: Option<Rec>,
    pub made_tree: bool,
    pub target: Option<(u8, u8)>,
    pub ok: bool,
    /// (Mutation `Reads::BeforeLock`) the record a reader read first.
    pub early: Option<Rec>,
    /// gc/doctor: images to visit (a bit each); doctor's images named by
    /// a record; a hold's images passed.
    pub list: u8,
    pub list2: u8,
    pub named: u8,
    /// Past its claim: an exec's checks, a removal's mark, a hold's grant.
    pub claimed: bool,
    /// (Mutation) the outcome record is still to write after the unlock.
    pub late: bool,
    /// A reader that took its lock while a writer waited at the gate.
    pub passed: bool,
}

/// Violations, recorded by the move that commits them, and situations.
pub mod bad {
    pub const EVIDENCE: u16 = 1;
    pub const PASSED_HOLD: u16 = 2;
    pub const TORN_LOST: u16 = 4;
    pub const BYPASS: u16 = 8;
    pub const ADOPT_PHANTOM: u16 = 16;
    /// Situations to reach (not violations).
    pub const TORN_KEPT: u16 = 256;
    pub const GC_DEAD: u16 = 512;
    pub const REBUILT: u16 = 1024;
    pub const FORGOTTEN: u16 = 2048;
    pub const REMOVED: u16 = 4096;
    pub const INTERRUPTED: u16 = 8192;
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub procs: Vec<Proc>,
    /// Every flock: lock, owner (its descriptors), mode. Sorted.
    pub locks: Vec<(Key, u8, Mode)>,
    /// The lock file at each image's path.
    pub files: Vec<Option<File>>,
    pub next_gen: Vec<u8>,
    /// Unlinked lock files that still say something (`Gone`, unless a rule
    /// is off).
    pub ghosts: Vec<(u8, u8, Rec)>,
    pub trees: Vec<Tree>,
    pub cat: Catalog,
    pub crashes: u8,
    pub losses: u8,
    pub bad: u16,
}

/// One move of the system.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Choose(u8, u8),
    Step(u8),
    /// The other outcome of a step: a copy or a spawn fails; gc passes over
    /// an image it may collect for the budget.
    Fail(u8),
    Exit(u8, bool),
    /// SIGKILL of the stowage process.
    Crash(u8),
    /// A crash in the middle of the record write that is the next step.
    Torn(u8),
    Lose(Loss),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    Free,
    Inside,
    Held,
}

pub struct Proto {
    pub cfg: Config,
}

pub(crate) fn pop(mask: &mut u8) -> Option<u8> {
    (*mask != 0).then(|| {
        let i = mask.trailing_zeros() as u8;
        *mask &= !(1 << i);
        i
    })
}

impl Proto {
    pub fn new(cfg: Config) -> Self {
        Proto { cfg }
    }

    pub fn op(&self, s: &State, p: usize) -> Option<Op> {
        s.procs[p].op.map(|i| self.cfg.roles[p].menu[i as usize])
    }

    /// The image locks an operation takes, in lock order.
    pub fn wanted(op: Op) -> Vec<(u8, Mode)> {
        let mut w = match op {
            Op::Exec { read, write, .. } => read
                .map(|r| (r, SH))
                .into_iter()
                .chain(write.map(|w| (w, EX)))
                .collect(),
            Op::Rm(i) => vec![(i, EX)],
            _ => vec![],
        };
        w.sort();
        w
    }

    // -- locks and files -----------------------------------------------------

    pub fn grantable(s: &State, key: Key, mode: Mode) -> bool {
        s.locks
            .iter()
            .filter(|(k, _, _)| *k == key)
            .all(|(_, _, m)| mode == SH && *m == SH)
    }

    pub(crate) fn take(s: &mut State, key: Key, p: usize, mode: Mode) {
        s.locks.push((key, p as u8, mode));
        s.locks.sort();
    }

    pub(crate) fn drop_key(s: &mut State, key: Key, p: usize) {
        s.locks.retain(|(k, o, _)| !(*k == key && *o as usize == p));
    }

    pub(crate) fn close_all(s: &mut State, p: usize) {
        s.locks.retain(|(_, o, _)| *o as usize != p);
        s.procs[p].held.clear();
        s.procs[p].claimed = false;
    }

    pub(crate) fn gen_at(s: &State, i: u8) -> Option<u8> {
        s.files[i as usize].map(|f| f.g)
    }

    /// What lock file `(i, g)` says (an unlinked one: what it kept).
    pub fn rec_at(s: &State, i: u8, g: u8) -> Rec {
        match s.files[i as usize] {
            Some(f) if f.g == g => f.rec,
            _ => s
                .ghosts
                .iter()
                .find(|x| (x.0, x.1) == (i, g))
                .map_or(Rec::Empty, |x| x.2),
        }
    }

    pub fn cur_rec(s: &State, i: u8) -> Rec {
        s.files[i as usize].map_or(Rec::Empty, |f| f.rec)
    }

    pub(crate) fn open_create(s: &mut State, i: u8) -> u8 {
        let ix = i as usize;
        if let Some(f) = s.files[ix] {
            return f.g;
        }
        let g = s.next_gen[ix];
        s.next_gen[ix] += 1;
        s.files[ix] = Some(File {
            g,
            rec: Rec::Empty,
            ww: false,
            sw: false,
        });
        g
    }

    /// Writes file `(i, g)`'s record (`Rec::Empty`: truncates it). A first
    /// record is written over the whole area, hints included.
    pub(crate) fn set_rec(&self, s: &mut State, p: usize, i: u8, g: u8, rec: Rec) {
        // Marking a file that names no image gone changes no image.
        let image = |r: Rec| if r == Rec::Gone { Rec::Empty } else { r };
        if image(Self::rec_at(s, i, g)) != image(rec) {
            self.touch(s, p, i);
        }
        match &mut s.files[i as usize] {
            Some(f) if f.g == g => {
                let whole = f.rec == Rec::Empty && self.cfg.rules.first_write_erases_hints;
                if matches!(rec, Rec::Empty | Rec::Gone) || whole {
                    (f.ww, f.sw) = (false, false);
                }
                f.rec = rec;
            }
            _ => {
                s.ghosts.retain(|x| (x.0, x.1) != (i, g));
                if rec != Rec::Empty {
                    s.ghosts.push((i, g, rec));
                    s.ghosts.sort();
                }
            }
        }
    }

    /// `Root::unlink_lock`: marked gone, then unlinked if it is still the
    /// file at the path (`unlink_if`).
    pub(crate) fn unlink(&self, s: &mut State, p: usize, i: u8, g: u8) {
        let r = &self.cfg.rules;
        if r.unlink_emptied {
            self.set_rec(s, p, i, g, Rec::Empty);
        } else if !r.unlink_unmarked {
            self.set_rec(s, p, i, g, Rec::Gone);
        }
        if let Some(f) = s.files[i as usize].filter(|f| f.g == g) {
            if f.rec != Rec::Empty {
                s.ghosts.push((i, g, f.rec));
                s.ghosts.sort();
            }
            s.files[i as usize] = None;
        }
    }

    /// `Root::drop_record`: the record goes, then the lock file, then our
    /// lock on it.
    pub(crate) fn drop_record(&self, s: &mut State, p: usize, i: u8, g: u8) {
        if !self.cfg.rules.unlink_unmarked {
            self.set_rec(s, p, i, g, Rec::Empty);
        }
        self.unlink(s, p, i, g);
        Self::drop_key(s, Key::Img(i, g), p);
        s.procs[p].held.retain(|h| h.img != i);
    }

    pub(crate) fn set_tree(&self, s: &mut State, p: usize, i: u8, t: Tree) {
        self.touch(s, p, i);
        s.trees[i as usize] = t;
    }

    /// Whether `f` carries no record and no hint (`Seen::default()`).
    pub(crate) fn blank(f: &File) -> bool {
        f.rec == Rec::Empty && !f.ww && !f.sw
    }

    // -- nested calls and store-wide holds -----------------------------------

    pub(crate) fn ancestors(&self, p: usize) -> impl Iterator<Item = usize> + '_ {
        std::iter::successors(self.cfg.roles[p].parent, |&a| {
            self.cfg.roles[a as usize].parent
        })
        .map(usize::from)
    }

    pub fn in_tree_of(&self, q: usize, h: usize) -> bool {
        self.ancestors(q).any(|a| a == h)
    }

    /// How an enclosing exec holds a lock matching `key` (any generation of
    /// an image's lock file: it is named by path).
    pub(crate) fn enclosing(&self, s: &State, p: usize, key: impl Fn(Key) -> bool) -> Option<Mode> {
        if self.cfg.rules.no_nested {
            return None;
        }
        let anc: Vec<usize> = self.ancestors(p).collect();
        s.locks
            .iter()
            .filter(|(k, o, _)| key(*k) && anc.contains(&(*o as usize)))
            .map(|x| x.2)
            .max()
    }

    pub(crate) fn enclosing_img(&self, s: &State, p: usize, i: u8) -> Option<Mode> {
        self.enclosing(s, p, |k| matches!(k, Key::Img(j, _) if j == i))
    }

    pub(crate) fn under_image(&self, s: &State, p: usize) -> bool {
        self.enclosing(s, p, |k| matches!(k, Key::Img(..)))
            .is_some()
    }

    pub(crate) fn inside_store_wide(&self, s: &State, p: usize) -> bool {
        self.enclosing(s, p, |k| k == Key::Store) == Some(EX)
    }

    /// `store_wide::probe`, holding the image locks it is for.
    pub(crate) fn probe(&self, s: &State, p: usize) -> Probe {
        if Self::grantable(s, Key::Store, SH) {
            Probe::Free
        } else if self.inside_store_wide(s, p) || self.under_image(s, p) {
            Probe::Inside
        } else {
            Probe::Held
        }
    }

    /// `store_wide::blocks`: someone else's hold stands over a hinted image.
    pub(crate) fn blocked(&self, s: &State, p: usize, f: &File) -> bool {
        f.sw && self.probe(s, p) == Probe::Held
    }

    /// A store-wide hold that was granted and has not ended.
    pub fn granted_hold(&self, s: &State) -> Option<usize> {
        (0..s.procs.len())
            .find(|&h| matches!(self.op(s, h), Some(Op::StoreWide { .. })) && s.procs[h].claimed)
    }

    /// A change to image `i` by `p`: outside a granted hold's tree, a
    /// violation.
    pub(crate) fn touch(&self, s: &mut State, p: usize, i: u8) {
        let _ = i;
        if let Some(h) = self.granted_hold(s)
            && h != p
            && !self.in_tree_of(p, h)
        {
            s.bad |= bad::PASSED_HOLD;
        }
    }

    /// A writer waits at the gate of image `i` (holding it).
    pub fn writer_waits(&self, s: &State, i: u8) -> bool {
        (0..s.procs.len()).any(|q| {
            let pr = &s.procs[q];
            !pr.killed
                && matches!(pr.pc, Pc::Wait(k) if self.op(s, q).is_some_and(|op| {
                    Self::wanted(op).get(k as usize) == Some(&(i, EX))
                }))
        })
    }

    // -- the catalog -----------------------------------------------------------

    pub(crate) fn lose(s: &mut State, loss: Loss) {
        s.losses += 1;
        s.cat.lost = Some(loss);
        for r in s.cat.rows.iter_mut() {
            *r = match (loss, *r) {
                (Loss::Replace, Some(St::Ready)) => Some(St::Failed),
                (Loss::Replace | Loss::Legacy, _) => Some(St::Ready),
                _ => None,
            };
        }
    }

    /// The state a census gives an image (`Record::state_seen`, the
    /// writer judged alive by a probe of its lock).
    pub(crate) fn census(s: &State, i: u8) -> Option<St> {
        let f = s.files[i as usize]?;
        let Rec::Valid(st) = f.rec else { return None };
        let writer = !Self::grantable(s, Key::Img(i, f.g), EX);
        Some(match st {
            St::Creating | St::Writing if !writer => St::Failed,
            st => st,
        })
    }

    /// The losses the adversary may cause.
    pub fn losses(&self) -> &'static [Loss] {
        if self.cfg.legacy {
            &LOSSES
        } else {
            &LOSSES[..4]
        }
    }

    /// `survey::refresh`: a catalog that cannot be used is set aside and
    /// made anew; its rows say what the records say. An older release's
    /// catalog is migrated first (`migrate::run`): each image whose lock
    /// is free and whose file has no record gets the record its row says.
    pub(crate) fn refresh(&self, s: &mut State, p: usize) {
        if s.cat.lost == Some(Loss::Legacy) && self.cfg.rules.migrate_any_old_catalog {
            for i in 0..self.cfg.images {
                let free =
                    s.files[i as usize].is_none_or(|f| Self::grantable(s, Key::Img(i, f.g), EX));
                if free && matches!(Self::cur_rec(s, i), Rec::Empty | Rec::Damaged) {
                    let g = Self::open_create(s, i);
                    let row = s.cat.rows[i as usize].map_or(Rec::Empty, Rec::Valid);
                    self.set_rec(s, p, i, g, row);
                }
            }
        }
        if s.cat.lost.is_some() {
            s.bad |= bad::REBUILT;
        }
        s.cat.lost = None;
        for i in 0..self.cfg.images {
            s.cat.rows[i as usize] = Self::census(s, i);
        }
    }

    pub(crate) fn cat_row(s: &State, i: u8) -> Option<St> {
        match s.cat.lost {
            Some(Loss::Delete | Loss::Damage) => None,
            _ => s.cat.rows[i as usize],
        }
    }

    // -- evidence ----------------------------------------------------------------

    /// Why gc or repair may destroy image `i`'s record now: positive
    /// evidence only.
    pub(crate) fn evidence(&self, s: &mut State, p: usize, i: u8, rec: Rec) {
        let tree_gone = !s.trees[i as usize].present();
        let ok = match (self.op(s, p), rec) {
            (_, Rec::Valid(St::Deleting)) => true,
            (Some(Op::Gc { .. }), Rec::Valid(St::Failed | St::Creating | St::Writing)) => true,
            (Some(Op::Gc { lru }), Rec::Valid(St::Ready)) => lru,
            (Some(Op::Doctor | Op::StoreWide { .. }), Rec::Valid(St::Ready)) => tree_gone,
            // An empty lock file: nothing is destroyed.
            (_, Rec::Empty) => true,
            _ => false,
        };
        if !ok {
            s.bad |= bad::EVIDENCE;
        }
    }
}
