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

use stateright::{Model, Property};

use crate::steps::Step;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    Shared,
    Exclusive,
}

/// A lock file: an image's (with its generation), its gate, a slot file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    Img(u8, u8),
    Gate(u8),
    Slot(u8),
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
    /// `exec [--read R] [--write W [--from R]] [--slot C --priority P] [--no-inherit]`.
    Exec {
        read: Option<u8>,
        write: Option<u8>,
        from: bool,
        slot: Option<Prio>,
        inherit: bool,
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
        write: None,
        from: false,
        slot: None,
        inherit: true,
    }
}

pub fn exec_write(i: u8) -> Op {
    Op::Exec {
        read: None,
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
                write,
                from,
                slot,
                inherit,
            } => {
                write!(f, "exec")?;
                match (read, from) {
                    (Some(r), false) => write!(f, " --read {}", img_name(r))?,
                    (Some(r), true) => write!(f, " --from {}", img_name(r))?,
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
    /// Holder records judged by their owner's liveness (the lease probe to
    /// come; the lock table's pid locally). Off: by the lock's mode alone,
    /// as on NFS today.
    pub owner_judged: bool,
}

impl Default for Rules {
    fn default() -> Self {
        Rules {
            nested: true,
            recheck: true,
            gate: true,
            keeper: true,
            local_fs: true,
            owner_judged: true,
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
    /// Images that exist (ready) at the start.
    pub ready_at_start: Vec<u8>,
}

/// The program counter of a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pc {
    /// Not started (a nested one: its parent's command has not called it).
    Choose,
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
    /// to go on.
    Mark(u8, Ret),
    Trash(u8, Ret),
    DropRow(u8, Ret),
    Unlink(u8, Ret),
    DeleteTrash(u8, Ret),
    ListInterrupted,
    LockInterrupted(u8),
    OrphanLock(u8),
    Sweep,
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RecOf {
    Img(u8),
    Slot(u8),
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
            Op::Exec { read, write, .. } => {
                let mut w: Vec<(u8, Mode)> = read
                    .map(|r| (r, Mode::Shared))
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

    /// Closes every descriptor of the process: its flocks go.
    fn close_all(s: &mut State, p: usize) {
        s.locks.retain(|(_, o, _)| *o as usize != p);
        s.procs[p].held.clear();
        s.procs[p].slot = None;
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
            Some(Op::Exec { inherit, .. }) => inherit || self.cfg.rules.local_fs,
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
                RecOf::Slot(f) => !s
                    .locks
                    .iter()
                    .any(|(k, q, _)| *k == Key::Slot(f) && *q == r.owner),
                RecOf::SlotClass => true,
            },
        }
    }

    /// `status::judge`: does the record stand?
    fn stands(&self, s: &State, r: &Rec) -> bool {
        let held_in = |key: Key, mode: Option<Mode>, owner: Option<u8>| {
            s.locks.iter().any(|(k, o, m)| {
                *k == key && mode.is_none_or(|x| x == *m) && owner.is_none_or(|x| x == *o)
            })
        };
        let o = r.owner as usize;
        match (r.role, r.of) {
            (RecRole::Holder, RecOf::Img(i)) => {
                let Some(g) = s.file[i as usize] else {
                    return false;
                };
                let by = self.cfg.rules.owner_judged.then_some(r.owner);
                held_in(Key::Img(i, g), Some(r.mode), by)
            }
            (RecRole::Holder, RecOf::Slot(f)) => held_in(Key::Slot(f), None, Some(r.owner)),
            (RecRole::Holder, RecOf::SlotClass) => false,
            (RecRole::Waiter, RecOf::Img(i)) => {
                s.procs[o].alive
                    && s.file[i as usize].is_some_and(|g| held_in(Key::Img(i, g), None, None))
            }
            (RecRole::Waiter, _) => {
                s.procs[o].alive && s.locks.iter().any(|(k, _, _)| matches!(k, Key::Slot(_)))
            }
        }
    }

    /// A look at the records in `scope`: stale ones are deleted; a record
    /// of a dead owner that survives it is a violation.
    fn look(&self, s: &mut State, scope: impl Fn(&Rec) -> bool) {
        let keep: Vec<Rec> = s
            .records
            .iter()
            .filter(|r| !scope(r) || self.stands(s, r))
            .copied()
            .collect();
        s.records = keep;
        if s.records.iter().any(|r| scope(r) && Self::owner_dead(s, r)) {
            s.bad |= bad::STALE_RECORD;
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
        match pr.pc {
            Pc::Choose | Pc::Done | Pc::Command => false,
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
                if matches!(pr.pc, Pc::Clone | Pc::Spawn) {
                    out.push(Action::Fail(p as u8));
                }
            }
            if pr.cmd == Cmd::Running && !self.child_running(s, p) {
                out.push(Action::Exit(p as u8, true));
                out.push(Action::Exit(p as u8, false));
            }
        }
    }

    fn started(pr: &Proc) -> bool {
        pr.alive && !matches!(pr.pc, Pc::Choose | Pc::Done)
    }

    /// Nothing left to do for this process: done, never called, or dead
    /// with no command left running.
    fn quiet(&self, s: &State, p: usize) -> bool {
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
            Some(Op::Exec { inherit, .. }) => inherit,
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

    fn after_images(op: Op) -> Pc {
        match op {
            Op::Rm(i) => Pc::Mark(i, Ret::Rm),
            _ => Pc::Start,
        }
    }

    fn next_image(op: Op, k: u8) -> Pc {
        if (k as usize + 1) < Self::wanted(op).len() {
            Pc::Try(k + 1)
        } else {
            Self::after_images(op)
        }
    }

    fn first(op: Op) -> Pc {
        match op {
            Op::Exec { slot: Some(_), .. } => Pc::SlotTry,
            Op::Exec { .. } | Op::Rm(_) => Pc::Try(0),
            Op::Gc => Pc::ListInterrupted,
            Op::Doctor | Op::Look => Pc::Sweep,
        }
    }

    /// Where a removal, or gc's or doctor's pass over the images, goes
    /// after image `i`.
    fn next_in_phase(&self, ret: Ret, i: u8) -> Pc {
        let n = self.cfg.images;
        match ret {
            Ret::Rm => Pc::Done,
            Ret::Interrupted if i + 1 < n => Pc::LockInterrupted(i + 1),
            Ret::Interrupted => Pc::OrphanLock(0),
            Ret::Collect if i + 1 < n => Pc::Collect(i + 1),
            Ret::Collect => Pc::Done,
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
        Self::release_image(s, p, img);
    }

    fn step(&self, s: &mut State, p: usize) {
        let op = self.op(s, p).expect("a started process has an operation");
        let rules = &self.cfg.rules;
        let pc = s.procs[p].pc;
        match pc {
            Pc::Choose | Pc::Done | Pc::Command => unreachable!(),
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
                    s.procs[p].pc = Pc::Try(0);
                } else if rules.nested
                    && cands
                        .iter()
                        .any(|f| self.enclosing(s, p, Key::Slot(*f)).is_some())
                {
                    // Works under the enclosing command's slot.
                    s.procs[p].pc = Pc::Try(0);
                } else {
                    s.procs[p].pc = Pc::SlotWaiter;
                }
            }
            Pc::SlotWaiter => {
                self.look(s, |r| matches!(r.of, RecOf::Slot(_) | RecOf::SlotClass));
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
                s.procs[p].pc = Pc::Try(0);
            }
            Pc::Try(k) => {
                let (img, mode) = Self::wanted(op)[k as usize];
                let i = img as usize;
                if s.file[i].is_none() {
                    // No lock file: only a write creates one unasked;
                    // otherwise `require` checks the row first.
                    let ok = match op {
                        Op::Exec { .. } if mode == Mode::Exclusive => true,
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
                    s.procs[p].pc = Self::next_image(op, k);
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
                s.procs[p].pc = Self::next_image(op, k);
            }
            Pc::Start => {
                let Op::Exec {
                    read, write, from, ..
                } = op
                else {
                    unreachable!()
                };
                Self::drop_records(s, p, Some(RecRole::Waiter));
                // What our locks prove: exclusive, nobody else holds it;
                // shared, nobody holds it exclusively.
                let held = s.procs[p].held.clone();
                for (img, _, mode) in &held {
                    s.records.retain(|r| {
                        !(r.of == RecOf::Img(*img)
                            && r.role == RecRole::Holder
                            && r.owner as usize != p
                            && (*mode == Mode::Exclusive || r.mode == Mode::Exclusive))
                    });
                }
                if let Some(r) = read {
                    let ri = r as usize;
                    match s.rows[ri] {
                        Some(Row::Ready) => {}
                        other => {
                            if other.is_some_and(Row::being_written) {
                                s.rows[ri] = Some(Row::Incomplete);
                            }
                            // Refused: a lock file this exec made for an
                            // image it would have created goes again.
                            // (Unlinked after the commit and closed when the
                            // request gives up; it does nothing with the
                            // image between, so one step here.)
                            if let Some(w) = write
                                && s.rows[w as usize].is_none()
                            {
                                Self::unlink(s, p, w);
                            }
                            s.procs[p].pc = Pc::Release;
                            return;
                        }
                    }
                }
                if let Some(f) = s.procs[p].slot {
                    Self::insert_record(
                        s,
                        Rec {
                            of: RecOf::Slot(f),
                            role: RecRole::Holder,
                            mode: Mode::Exclusive,
                            owner: p as u8,
                        },
                    );
                }
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
                for (img, _, mode) in &held {
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
                s.procs[p].pc = if from { Pc::Clone } else { Pc::Spawn };
            }
            Pc::Clone => s.procs[p].pc = Pc::ReleaseBase,
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
                Self::drop_records(s, p, None);
                s.procs[p].pc = Pc::Release;
            }
            Pc::Release => {
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
                if s.procs[p].listed & (1 << img) == 0 {
                    s.procs[p].pc = next;
                    return;
                }
                if Self::try_exclusive(s, p, img, true).is_none() {
                    s.procs[p].pc = next;
                    return;
                }
                match s.rows[img as usize] {
                    Some(Row::Deleting) => s.procs[p].pc = Pc::Mark(img, Ret::Interrupted),
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
                s.procs[p].pc = match op {
                    Op::Gc => Pc::Collect(0),
                    Op::Doctor => Pc::ListInterrupted,
                    _ => Pc::Done,
                };
            }
            Pc::Collect(img) => {
                let next = self.next_in_phase(Ret::Collect, img);
                if s.procs[p].listed & (1 << img) == 0 {
                    s.procs[p].pc = next;
                    return;
                }
                if Self::try_exclusive(s, p, img, true).is_none() {
                    s.procs[p].pc = next;
                    return;
                }
                match s.rows[img as usize] {
                    None => {
                        Self::unlink(s, p, img);
                        s.procs[p].pc = next;
                    }
                    Some(r) if r == Row::Incomplete || r.being_written() => {
                        s.procs[p].pc = Pc::Mark(img, Ret::Collect);
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

    pub fn ready_means_written(&self, s: &State) -> bool {
        (0..self.cfg.images as usize)
            .all(|i| s.rows[i] != Some(Row::Ready) || (!s.truth[i].0 && s.truth[i].1))
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
                s.procs[p].pc = Self::first(self.cfg.roles[p].menu[i as usize]);
            }
            Action::Step(p) => self.step(&mut s, p as usize),
            Action::Fail(p) => {
                let p = p as usize;
                match s.procs[p].pc {
                    // A half-made copy is never ready.
                    Pc::Clone => {
                        s.procs[p].ok = false;
                        s.procs[p].pc = Pc::Finish;
                    }
                    Pc::Spawn => {
                        let from = matches!(self.op(&s, p), Some(Op::Exec { from: true, .. }));
                        if from {
                            s.procs[p].ok = false;
                            s.procs[p].pc = Pc::Finish;
                        } else {
                            s.procs[p].pc = Pc::Abandon;
                        }
                    }
                    _ => unreachable!(),
                }
            }
            Action::Exit(p, ok) => {
                let p = p as usize;
                s.procs[p].cmd = Cmd::Exited;
                s.procs[p].ok = ok;
                for c in self.nested_children(p).collect::<Vec<_>>() {
                    if s.procs[c].pc == Pc::Choose {
                        s.procs[c].pc = Pc::Done;
                    }
                }
                if s.procs[p].alive {
                    s.procs[p].pc = Pc::Finish;
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
