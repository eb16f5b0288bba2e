//! The steps of each operation: what one move of a process does.
//!
//! - exec: slot, image locks in order (try, gate, wait), `check` (the
//!   store-wide probe and the reads' `ready`), the writes' records and
//!   trees, the command, the outcome record, the release.
//! - rm, gc, doctor: the removal (`mark` `deleting`, `trash`, `drop`),
//!   each decided under the image's exclusive lock on what its record says.
//! - store-wide: `store.lock`, a pass over every lock file, the command,
//!   forgetting deleted images, the release.

use crate::proto::*;
use Mode::{Exclusive as EX, Shared as SH};

impl Proto {
    pub fn first(&self, op: Op) -> Pc {
        match op {
            Op::Exec { slot: true, .. } => Pc::SlotTry,
            Op::Exec { .. } | Op::Rm(_) => Pc::Try(0),
            Op::Gc { .. } => Pc::ListInterrupted,
            Op::Doctor => Pc::DocRecords,
            Op::StoreWide { .. } => Pc::StoreLock,
        }
    }

    fn want(&self, s: &State, p: usize, k: u8) -> (u8, Mode, bool) {
        let op = self.op(s, p).expect("started");
        let (i, mode) = Self::wanted(op)[k as usize];
        (i, mode, mode == EX && matches!(op, Op::Exec { .. }))
    }

    /// Whether `p`'s next step can be taken (a blocking one: its lock free).
    pub fn enabled(&self, s: &State, p: usize) -> bool {
        let pr = &s.procs[p];
        if pr.killed || pr.op.is_none() {
            return false;
        }
        match pr.pc {
            Pc::Choose | Pc::Done | Pc::Command => false,
            Pc::SlotWait => Self::grantable(s, Key::Slot, EX),
            Pc::Gate(k) => {
                let (i, mode, _) = self.want(s, p, k);
                Self::grantable(s, Key::Gate(i), mode)
            }
            Pc::Wait(k) => {
                let (i, mode, _) = self.want(s, p, k);
                Self::grantable(s, Key::Img(i, pr.wgen), mode)
            }
            Pc::StoreAwait => Self::grantable(s, Key::Store, SH),
            Pc::StoreLock => {
                Self::grantable(s, Key::Store, EX)
                    || self.inside_store_wide(s, p)
                    || self.under_image(s, p)
            }
            Pc::PassWait(i) => Self::grantable(s, Key::Img(i, pr.wgen), EX),
            _ => true,
        }
    }

    /// The other outcome of `p`'s next step, if it has one.
    pub fn may_fail(&self, s: &State, p: usize) -> bool {
        match s.procs[p].pc {
            Pc::Clone | Pc::Spawn => true,
            Pc::Collect(i) => {
                matches!(self.op(s, p), Some(Op::Gc { lru: true }))
                    && Self::cur_rec(s, i) == Rec::Valid(St::Ready)
            }
            _ => false,
        }
    }

    pub fn step(&self, s: &mut State, p: usize) {
        let op = self.op(s, p).expect("started");
        match s.procs[p].pc {
            Pc::SlotTry | Pc::SlotWait => self.slot(s, p),
            Pc::Try(k) => self.try_image(s, p, op, k),
            Pc::Gate(k) => self.gate(s, p, k),
            Pc::Wait(k) => self.wait(s, p, k),
            Pc::Check => self.check(s, p, op),
            Pc::ClearHints => {
                for h in s.procs[p].held.clone() {
                    Self::set_sw(s, h.img, h.g, false);
                }
                self.after_check(s, p, op);
            }
            Pc::StoreAwait => {
                let pr = &mut s.procs[p];
                (pr.early, pr.target) = (None, None);
                pr.pc = self.first(op);
            }
            Pc::FinishRemoval => self.finish_removal(s, p, op),
            Pc::Start => self.start(s, p, op),
            Pc::Mkdir => self.mkdir(s, p, op),
            Pc::Clone => {
                let (i, _) = s.procs[p].target.expect("a written image");
                self.set_tree(s, p, i, Tree::Partial);
                s.procs[p].pc = Pc::ReleaseBase;
            }
            Pc::ReleaseBase => {
                for h in s.procs[p].held.clone().iter().filter(|h| h.mode == SH) {
                    Self::drop_key(s, Key::Img(h.img, h.g), p);
                }
                s.procs[p].held.retain(|h| h.mode == EX);
                s.procs[p].pc = Pc::Spawn;
            }
            Pc::Spawn => self.spawn(s, p, op),
            Pc::Finish => self.finish(s, p),
            Pc::Abandon => self.abandon(s, p),
            Pc::Release => self.release(s, p),
            Pc::Mark(..) | Pc::Trash(..) | Pc::DropRecord(..) | Pc::DeleteTrash(..) => {
                self.removal(s, p)
            }
            Pc::ListInterrupted | Pc::LockInterrupted(_) | Pc::Survey | Pc::Collect(_) => {
                self.gc(s, p, op)
            }
            Pc::StoreLock
            | Pc::Hint
            | Pc::Pass(_)
            | Pc::PassWait(_)
            | Pc::Forget
            | Pc::StoreRelease => self.store_wide(s, p),
            Pc::Choose | Pc::Done | Pc::Command => unreachable!("not a step"),
            _ => self.doctor(s, p),
        }
    }

    /// A failed request: what it made goes, then its locks.
    fn fail(s: &mut State, p: usize) {
        s.procs[p].pc = Pc::Release;
    }

    // -- exec: locks -----------------------------------------------------------

    /// `acquire::slot::take`: try, work under an enclosing command's slot,
    /// or wait.
    fn slot(&self, s: &mut State, p: usize) {
        if Self::grantable(s, Key::Slot, EX) {
            Self::take(s, Key::Slot, p, EX);
            s.procs[p].pc = Pc::Try(0);
        } else if self.enclosing(s, p, |k| k == Key::Slot).is_some() {
            s.procs[p].pc = Pc::Try(0);
        } else {
            s.procs[p].pc = Pc::SlotWait;
        }
    }

    /// `acquire::image::try_image`, then (busy) the nested-call and
    /// existence checks before a wait.
    fn try_image(&self, s: &mut State, p: usize, op: Op, k: u8) {
        let (i, mode, create) = self.want(s, p, k);
        if mode == SH {
            s.procs[p].early = Some(Self::cur_rec(s, i));
        }
        let g = match Self::gen_at(s, i) {
            Some(g) => g,
            None if create => Self::open_create(s, i),
            None => return Self::fail(s, p),
        };
        if Self::grantable(s, Key::Img(i, g), mode) {
            let ww = s.files[i as usize].is_some_and(|f| f.ww);
            let nested = self.enclosing_img(s, p, i).is_some();
            let mut queue = false;
            if mode == SH && ww && !self.cfg.rules.no_gate {
                if Self::grantable(s, Key::Gate(i), SH) {
                    if let Some(f) = s.files[i as usize].as_mut() {
                        f.ww = false;
                    }
                } else {
                    queue = !nested;
                }
            }
            if !queue {
                s.procs[p].passed |= mode == SH && !nested && self.writer_waits(s, i);
                return self.got(s, p, k, g);
            }
        }
        if let Some(m) = self.enclosing_img(s, p, i)
            && (mode == EX || m == EX)
        {
            return Self::fail(s, p);
        }
        if let Op::Exec { read: Some(r), .. } = op
            && Self::cur_rec(s, r) == Rec::Empty
        {
            return Self::fail(s, p);
        }
        s.procs[p].pc = Pc::Gate(k);
    }

    /// The lock on file `g` is ours, with what the file says.
    fn got(&self, s: &mut State, p: usize, k: u8, g: u8) {
        let (i, mode, _) = self.want(s, p, k);
        let f = s.files[i as usize].filter(|f| f.g == g);
        // A mark reads as no image (kept only by a mutation's ghost).
        let seen = match Self::rec_at(s, i, g) {
            Rec::Gone => Rec::Empty,
            r => r,
        };
        Self::take(s, Key::Img(i, g), p, mode);
        let pr = &mut s.procs[p];
        pr.held.push(Held {
            img: i,
            g,
            mode,
            seen,
            sw: f.is_some_and(|f| f.sw),
        });
        if mode == EX {
            pr.target = Some((i, g));
        }
        let last = (k as usize + 1) == Self::wanted(self.op(s, p).expect("started")).len();
        s.procs[p].pc = if last { Pc::Check } else { Pc::Try(k + 1) };
    }

    /// `wait_image`: the gate in our mode (a writer sets `W`), then the
    /// file to wait on.
    fn gate(&self, s: &mut State, p: usize, k: u8) {
        let (i, mode, _) = self.want(s, p, k);
        Self::take(s, Key::Gate(i), p, mode);
        if mode == EX
            && let Some(f) = s.files[i as usize].as_mut()
        {
            f.ww = true;
        }
        self.open_for_wait(s, p, k);
    }

    fn open_for_wait(&self, s: &mut State, p: usize, k: u8) {
        let (i, _, create) = self.want(s, p, k);
        match Self::gen_at(s, i) {
            Some(g) => s.procs[p].wgen = g,
            None if create => s.procs[p].wgen = Self::open_create(s, i),
            None => {
                Self::drop_key(s, Key::Gate(i), p);
                return Self::fail(s, p);
            }
        }
        s.procs[p].pc = Pc::Wait(k);
    }

    /// The blocked flock returns: a ghost (unlinked since we opened it) is
    /// let go and the path opened again — unless what the file says proves
    /// it at its path: a valid record, or nothing (never marked gone).
    fn wait(&self, s: &mut State, p: usize, k: u8) {
        let (i, mode, _) = self.want(s, p, k);
        let g = s.procs[p].wgen;
        let here = Self::gen_at(s, i) == Some(g);
        let proven = matches!(Self::rec_at(s, i, g), Rec::Valid(_) | Rec::Empty);
        if !here && !proven && !self.cfg.rules.no_recheck {
            return self.open_for_wait(s, p, k);
        }
        Self::drop_key(s, Key::Gate(i), p);
        if mode == EX
            && here
            && Self::grantable(s, Key::Gate(i), EX)
            && let Some(f) = s.files[i as usize].as_mut()
        {
            f.ww = false;
        }
        self.got(s, p, k, g);
    }

    // -- exec: checks ------------------------------------------------------------

    /// `settle_store_wide` (and `rm`'s `take_all`): ask `store.lock` when a
    /// hint says so, or for a new image; then the reads' records.
    fn check(&self, s: &mut State, p: usize, op: Op) {
        let r = &self.cfg.rules;
        let held = s.procs[p].held.clone();
        let hinted = !r.hint_ignored && held.iter().any(|h| h.sw);
        let new = matches!(op, Op::Exec { .. })
            && held.iter().any(|h| {
                h.mode == EX
                    && matches!(h.seen, Rec::Empty | Rec::Damaged | Rec::Valid(St::Deleting))
            });
        if hinted || (new && !r.no_probe_new) {
            match self.probe(s, p) {
                Probe::Held => {
                    self.release_unclaimed(s, p);
                    Self::close_all(s, p);
                    let rm = matches!(op, Op::Rm(_));
                    s.procs[p].pc = if rm { Pc::Done } else { Pc::StoreAwait };
                    return;
                }
                Probe::Free if hinted => {
                    s.procs[p].pc = Pc::ClearHints;
                    return;
                }
                _ => {}
            }
        }
        self.after_check(s, p, op);
    }

    pub(crate) fn set_sw(s: &mut State, i: u8, g: u8, on: bool) {
        if let Some(f) = s.files[i as usize].as_mut().filter(|f| f.g == g) {
            f.sw = on;
        }
    }

    /// `check_reads` and the claim (exec); `remove_held`'s record check (rm).
    fn after_check(&self, s: &mut State, p: usize, op: Op) {
        let held = s.procs[p].held.clone();
        if let Op::Rm(i) = op {
            match held[0].seen {
                // `remove_held`: no record (a file made for nothing, or
                // damaged); the file goes, and our lock.
                Rec::Empty | Rec::Gone | Rec::Damaged => {
                    self.drop_record(s, p, i, held[0].g);
                    Self::fail(s, p);
                }
                Rec::Valid(_) => {
                    s.procs[p].claimed = true;
                    s.procs[p].pc = Pc::Mark(i, Ret::Rm);
                }
            }
            return;
        }
        if !held
            .iter()
            .filter(|h| h.mode == SH)
            .all(|h| self.readable(s, p, h))
        {
            return Self::fail(s, p);
        }
        s.procs[p].claimed = true;
        if s.procs[p].passed {
            s.bad |= bad::BYPASS;
        }
        match held.iter().find(|h| h.mode == EX) {
            None => s.procs[p].pc = Pc::Spawn,
            Some(w) if w.seen == Rec::Valid(St::Deleting) => s.procs[p].pc = Pc::FinishRemoval,
            Some(_) => self.begin_writes(s, p, op),
        }
    }

    fn readable(&self, s: &State, p: usize, h: &Held) -> bool {
        let ready = Rec::Valid(St::Ready);
        match self.cfg.rules.reads {
            Reads::UnderLock => h.seen == ready,
            Reads::BeforeLock => s.procs[p].early == Some(ready),
            Reads::Catalog => Self::cat_row(s, h.img) == Some(St::Ready),
        }
    }

    // -- exec: the write ---------------------------------------------------------

    fn writer(s: &State, p: usize) -> Held {
        *s.procs[p]
            .held
            .iter()
            .find(|h| h.mode == EX)
            .expect("a written image")
    }

    fn set_seen(s: &mut State, p: usize, i: u8, rec: Rec) {
        if let Some(h) = s.procs[p].held.iter_mut().find(|h| h.img == i) {
            h.seen = rec;
        }
    }

    fn after_start(op: Op) -> Pc {
        match op {
            Op::Exec { from: true, .. } => Pc::Clone,
            _ => Pc::Spawn,
        }
    }

    fn begin_writes(&self, s: &mut State, p: usize, op: Op) {
        let r = &self.cfg.rules;
        let new = matches!(Self::writer(s, p).seen, Rec::Empty | Rec::Damaged);
        s.procs[p].pc = if r.tree_before_record {
            Self::after_start(op)
        } else if new && r.mkdir_before_record {
            Pc::Mkdir
        } else {
            Pc::Start
        };
    }

    /// `finish_removal`: a `deleting` image's tree to the trash, its record
    /// cleared, before the name is written anew.
    fn finish_removal(&self, s: &mut State, p: usize, op: Op) {
        let w = Self::writer(s, p);
        self.set_tree(s, p, w.img, Tree::None);
        self.set_rec(s, p, w.img, w.g, Rec::Empty);
        Self::set_seen(s, p, w.img, Rec::Empty);
        self.begin_writes(s, p, op);
    }

    /// `start_writes`: `writing` over an existing record, `creating` for a
    /// new image, synced.
    fn start(&self, s: &mut State, p: usize, op: Op) {
        let w = Self::writer(s, p);
        let (st, before) = match w.seen {
            Rec::Valid(st) => (St::Writing, Some(Rec::Valid(st))),
            _ => (St::Creating, None),
        };
        self.set_rec(s, p, w.img, w.g, Rec::Valid(st));
        Self::set_seen(s, p, w.img, Rec::Valid(st));
        if !self.cfg.rules.no_hint_inside_hold && self.inside_store_wide(s, p) {
            Self::set_sw(s, w.img, w.g, true);
        }
        let pr = &mut s.procs[p];
        pr.before = before;
        let mkdir = !pr.made_tree && before != Some(Rec::Valid(St::Ready));
        pr.pc = if pr.cmd == Cmd::Running {
            Pc::Command
        } else if mkdir {
            Pc::Mkdir
        } else {
            Self::after_start(op)
        };
    }

    /// `start_new`'s / `make_missing_tree`'s `mkdir`; a new image's tree
    /// that exists already must be an empty one (`refuse_planted`).
    fn mkdir(&self, s: &mut State, p: usize, op: Op) {
        let w = Self::writer(s, p);
        let unrecorded = matches!(w.seen, Rec::Empty | Rec::Damaged);
        let new = unrecorded || w.seen == Rec::Valid(St::Creating);
        match s.trees[w.img as usize] {
            Tree::None | Tree::Gone => {
                self.set_tree(s, p, w.img, Tree::Empty);
                s.procs[p].made_tree = true;
            }
            Tree::Empty => {}
            _ if new => {
                s.procs[p].pc = Pc::Abandon;
                return;
            }
            _ => {}
        }
        s.procs[p].pc = if unrecorded {
            Pc::Start
        } else {
            Self::after_start(op)
        };
    }

    fn spawn(&self, s: &mut State, p: usize, op: Op) {
        s.procs[p].cmd = Cmd::Running;
        s.procs[p].pc = Pc::Command;
        if let Op::StoreWide { .. } = op {
            s.procs[p].claimed = true;
            return;
        }
        if let Op::Exec { write: Some(_), .. } = op {
            let w = Self::writer(s, p);
            self.set_tree(s, p, w.img, Tree::Partial);
            if !matches!(w.seen, Rec::Valid(St::Creating | St::Writing)) {
                // (Mutation) the record after the tree is touched.
                s.procs[p].pc = Pc::Start;
            }
        }
    }

    /// The command never started.
    pub fn spawn_failed(&self, s: &mut State, p: usize) {
        let op = self.op(s, p).expect("started");
        s.procs[p].pc = match op {
            Op::StoreWide { .. } => Pc::Forget,
            Op::Exec { from: true, .. } => Pc::Finish,
            Op::Exec { write: Some(_), .. } => Pc::Abandon,
            _ => Pc::Release,
        };
        s.procs[p].ok = false;
    }

    /// `finish_write`: `ready` or `incomplete` (synced); a failed new
    /// image's empty tree goes.
    fn finish(&self, s: &mut State, p: usize) {
        let pr = s.procs[p].clone();
        if let Some((i, g)) = pr.target {
            let st = if pr.ok { St::Ready } else { St::Failed };
            self.set_rec(s, p, i, g, Rec::Valid(st));
            Self::set_seen(s, p, i, Rec::Valid(st));
            if !pr.ok && pr.made_tree && pr.before.is_none() && s.trees[i as usize] == Tree::Empty {
                self.set_tree(s, p, i, Tree::None);
            }
        }
        s.procs[p].pc = if pr.late { Pc::Done } else { Pc::Release };
    }

    /// `undo`: the command never ran; each record as it was.
    fn abandon(&self, s: &mut State, p: usize) {
        let w = Self::writer(s, p);
        if matches!(w.seen, Rec::Valid(St::Creating | St::Writing)) {
            let pr = s.procs[p].clone();
            if pr.made_tree && s.trees[w.img as usize] == Tree::Empty {
                self.set_tree(s, p, w.img, Tree::None);
            }
            let back = pr.before.unwrap_or(Rec::Empty);
            self.set_rec(s, p, w.img, w.g, back);
            Self::set_seen(s, p, w.img, back);
        }
        s.procs[p].pc = Pc::Release;
    }

    /// `release_unclaimed` and the locks' close.
    fn release(&self, s: &mut State, p: usize) {
        self.release_unclaimed(s, p);
        Self::close_all(s, p);
        let pr = &mut s.procs[p];
        pr.pc = if pr.late { Pc::Finish } else { Pc::Done };
    }

    /// Lock files held that carry no record go: ours exclusively at once;
    /// shared ones let go, then taken exclusively and, still blank,
    /// unlinked.
    pub(crate) fn release_unclaimed(&self, s: &mut State, p: usize) {
        let held = s.procs[p].held.clone();
        for h in held.iter().filter(|h| h.seen == Rec::Empty) {
            if h.mode == EX {
                self.unlink(s, p, h.img, h.g);
            } else {
                Self::drop_key(s, Key::Img(h.img, h.g), p);
                if let Some(f) = s.files[h.img as usize]
                    && Self::grantable(s, Key::Img(h.img, f.g), EX)
                    && (self.cfg.rules.unlink_unchecked || Self::blank(&f))
                {
                    self.evidence(s, p, h.img, f.rec);
                    self.unlink(s, p, h.img, f.g);
                }
            }
        }
    }

    // -- removal (rm, gc, doctor) ----------------------------------------------

    fn removal(&self, s: &mut State, p: usize) {
        match s.procs[p].pc {
            Pc::Mark(i, ret) => {
                let g = Self::held_gen(s, p, i);
                if ret == Ret::Collect {
                    let rec = Self::rec_at(s, i, g);
                    self.evidence(s, p, i, rec);
                    if matches!(rec, Rec::Valid(St::Failed | St::Creating | St::Writing)) {
                        s.bad |= bad::GC_DEAD;
                    }
                }
                self.set_rec(s, p, i, g, Rec::Valid(St::Deleting));
                Self::set_seen(s, p, i, Rec::Valid(St::Deleting));
                s.procs[p].pc = Pc::Trash(i, ret);
            }
            Pc::Trash(i, ret) => {
                self.set_tree(s, p, i, Tree::None);
                s.procs[p].pc = Pc::DropRecord(i, ret);
            }
            Pc::DropRecord(i, ret) => {
                let g = Self::held_gen(s, p, i);
                self.drop_record(s, p, i, g);
                s.bad |= bad::REMOVED;
                s.procs[p].claimed = false;
                s.procs[p].pc = match ret {
                    Ret::Interrupted => {
                        s.bad |= bad::INTERRUPTED;
                        self.next_interrupted(s, p)
                    }
                    _ => Pc::DeleteTrash(i, ret),
                };
            }
            Pc::DeleteTrash(_, ret) => {
                s.procs[p].pc = match ret {
                    Ret::Collect => Self::next_collect(s, p),
                    _ => Pc::Release,
                };
            }
            _ => unreachable!(),
        }
    }

    fn held_gen(s: &State, p: usize, i: u8) -> u8 {
        s.procs[p].held.iter().find(|h| h.img == i).expect("held").g
    }

    /// Takes image `i`'s lock exclusively without waiting, with the file
    /// (`gc::take_to_repair`, `gc::take_exclusive`): `None` if busy, gone,
    /// or (a hinted image) a store-wide hold stands.
    fn take_exclusive(&self, s: &mut State, p: usize, i: u8) -> Option<File> {
        let f = s.files[i as usize]?;
        if self.blocked(s, p, &f) {
            return None;
        }
        Self::lock_ex(s, p, i)
    }

    /// Image `i`'s lock taken exclusively without waiting, with the file.
    fn lock_ex(s: &mut State, p: usize, i: u8) -> Option<File> {
        let f = s.files[i as usize]?;
        if !Self::grantable(s, Key::Img(i, f.g), EX) {
            return None;
        }
        Self::take(s, Key::Img(i, f.g), p, EX);
        s.procs[p].held.push(Held {
            img: i,
            g: f.g,
            mode: EX,
            seen: f.rec,
            sw: f.sw,
        });
        Some(f)
    }

    fn let_go(s: &mut State, p: usize, i: u8) {
        if let Some(h) = s.procs[p].held.iter().find(|h| h.img == i).copied() {
            Self::drop_key(s, Key::Img(i, h.g), p);
            s.procs[p].held.retain(|h| h.img != i);
        }
    }

    // -- gc ------------------------------------------------------------------------

    pub(crate) fn next_interrupted(&self, s: &mut State, p: usize) -> Pc {
        match pop(&mut s.procs[p].list) {
            Some(i) => Pc::LockInterrupted(i),
            None if matches!(self.op(s, p), Some(Op::Doctor)) => Pc::DocHints,
            None => Pc::Survey,
        }
    }

    fn next_collect(s: &mut State, p: usize) -> Pc {
        pop(&mut s.procs[p].list).map_or(Pc::Done, Pc::Collect)
    }

    fn gc(&self, s: &mut State, p: usize, op: Op) {
        match s.procs[p].pc {
            Pc::ListInterrupted => {
                s.procs[p].list =
                    self.listing(s, |s, i| Self::cur_rec(s, i) == Rec::Valid(St::Deleting));
                s.procs[p].pc = self.next_interrupted(s, p);
            }
            Pc::LockInterrupted(i) => {
                let Some(f) = self.take_exclusive(s, p, i) else {
                    s.procs[p].pc = self.next_interrupted(s, p);
                    return;
                };
                if f.rec != Rec::Valid(St::Deleting) {
                    Self::let_go(s, p, i);
                    s.procs[p].pc = self.next_interrupted(s, p);
                    return;
                }
                self.evidence(s, p, i, f.rec);
                s.procs[p].claimed = true;
                s.procs[p].pc = Pc::Trash(i, Ret::Interrupted);
            }
            Pc::Survey => {
                let r = &self.cfg.rules;
                // (Mutation `gc_catalog`) the catalog as found is trusted.
                if !r.gc_trusts_catalog {
                    self.refresh(s, p);
                }
                s.procs[p].pc = match op {
                    Op::Gc { lru } => {
                        let judge = |s: &State, i| match r.gc_trusts_catalog {
                            true => Self::cat_row(s, i),
                            false => Self::census(s, i),
                        };
                        s.procs[p].list = self.listing(s, |s, i| match judge(s, i) {
                            Some(St::Failed) => true,
                            Some(St::Adopted) => r.gc_takes_adopted,
                            Some(St::Ready) => lru,
                            _ => false,
                        });
                        Self::next_collect(s, p)
                    }
                    _ => Pc::Done,
                };
            }
            Pc::Collect(i) => self.collect(s, p, op, i),
            _ => unreachable!(),
        }
    }

    pub(crate) fn listing(&self, s: &State, f: impl Fn(&State, u8) -> bool) -> u8 {
        (0..self.cfg.images)
            .filter(|&i| f(s, i))
            .fold(0, |m, i| m | 1 << i)
    }

    /// `gc::collect`: the reason read again under the exclusive lock.
    fn collect(&self, s: &mut State, p: usize, op: Op, i: u8) {
        let r = &self.cfg.rules;
        let lru = matches!(op, Op::Gc { lru: true });
        let Some(f) = self.take_exclusive(s, p, i) else {
            s.procs[p].pc = Self::next_collect(s, p);
            return;
        };
        let judged = match f.rec {
            Rec::Valid(_) if r.gc_trusts_catalog => Self::cat_row(s, i),
            Rec::Valid(st) => Some(st),
            _ => None,
        };
        let qualifies = judged.is_some_and(|st| match st {
            // Under our lock, a write in flight is a dead one.
            St::Failed | St::Creating | St::Writing => true,
            St::Adopted => r.gc_takes_adopted,
            St::Ready => lru,
            St::Deleting => false,
        });
        let go = matches!(f.rec, Rec::Valid(_)) && (qualifies || r.gc_trusts_survey);
        if !go {
            Self::let_go(s, p, i);
            s.procs[p].pc = Self::next_collect(s, p);
            return;
        }
        s.procs[p].claimed = true;
        s.procs[p].pc = Pc::Mark(i, Ret::Collect);
    }

    /// gc passes over an image it may collect for the budget (LRU chose
    /// another, or the images fit).
    pub fn pass_over(&self, s: &mut State, p: usize) {
        s.procs[p].pc = Self::next_collect(s, p);
    }

    // -- doctor --repair -----------------------------------------------------------

    fn doctor(&self, s: &mut State, p: usize) {
        match s.procs[p].pc {
            Pc::DocRecords => {
                let deleting =
                    self.listing(s, |s, i| Self::cur_rec(s, i) == Rec::Valid(St::Deleting));
                let hinted = self.listing(s, |s, i| s.files[i as usize].is_some_and(|f| f.sw));
                (s.procs[p].list, s.procs[p].list2) = (deleting, hinted);
                s.procs[p].pc = self.next_interrupted(s, p);
            }
            Pc::DocHints => {
                if self.probe(s, p) != Probe::Free {
                    s.procs[p].list2 = 0;
                }
                s.procs[p].pc = Self::next_hint(s, p);
            }
            Pc::ClearHint(i) => {
                let r = &self.cfg.rules;
                if let Some(f) = s.files[i as usize]
                    && Self::grantable(s, Key::Img(i, f.g), EX)
                    && (r.doctor_probes_once || self.probe(s, p) != Probe::Held)
                {
                    Self::set_sw(s, i, f.g, false);
                }
                s.procs[p].pc = Self::next_hint(s, p);
            }
            Pc::DocTrees => {
                s.procs[p].named =
                    self.listing(s, |s, i| matches!(Self::cur_rec(s, i), Rec::Valid(_)));
                s.procs[p].list = self.listing(s, |s, i| {
                    Self::census(s, i) == Some(St::Ready) && !s.trees[i as usize].present()
                });
                s.procs[p].pc = Self::next_missing(s, p);
            }
            Pc::DropMissing(i) => {
                if let Some(f) = self.take_exclusive(s, p, i) {
                    if f.rec == Rec::Valid(St::Ready) && !s.trees[i as usize].present() {
                        self.evidence(s, p, i, f.rec);
                        self.drop_record(s, p, i, f.g);
                    } else {
                        Self::let_go(s, p, i);
                    }
                }
                s.procs[p].pc = Self::next_missing(s, p);
            }
            Pc::ListOrphans => {
                let named = s.procs[p].named;
                s.procs[p].list = self.listing(s, |s, i| {
                    s.trees[i as usize].present() && named & (1 << i) == 0
                });
                s.procs[p].pc = Self::next_adopt(s, p);
            }
            Pc::Adopt(i) => self.adopt(s, p, i),
            Pc::DocLeftovers => {
                s.procs[p].list = self.listing(s, |s, i| {
                    s.files[i as usize].is_some_and(|f| Self::blank(&f))
                });
                s.procs[p].pc = Self::next_unlink(s, p);
            }
            Pc::UnlinkEmpty(i) => {
                if let Some(f) = s.files[i as usize]
                    && Self::grantable(s, Key::Img(i, f.g), EX)
                    && (self.cfg.rules.unlink_unchecked || Self::blank(&f))
                {
                    self.evidence(s, p, i, f.rec);
                    self.unlink(s, p, i, f.g);
                }
                s.procs[p].pc = Self::next_unlink(s, p);
            }
            _ => unreachable!(),
        }
    }

    fn next_hint(s: &mut State, p: usize) -> Pc {
        pop(&mut s.procs[p].list2).map_or(Pc::DocTrees, Pc::ClearHint)
    }

    fn next_missing(s: &mut State, p: usize) -> Pc {
        pop(&mut s.procs[p].list).map_or(Pc::ListOrphans, Pc::DropMissing)
    }

    fn next_adopt(s: &mut State, p: usize) -> Pc {
        pop(&mut s.procs[p].list).map_or(Pc::DocLeftovers, Pc::Adopt)
    }

    fn next_unlink(s: &mut State, p: usize) -> Pc {
        pop(&mut s.procs[p].list).map_or(Pc::Survey, Pc::UnlinkEmpty)
    }

    /// `adopt::adopt`: a tree without a record gets `incomplete (adopted)`,
    /// under the exclusive lock of a lock file made if missing.
    fn adopt(&self, s: &mut State, p: usize, i: u8) {
        let g = Self::open_create(s, i);
        let f = s.files[i as usize].expect("made");
        if !Self::grantable(s, Key::Img(i, g), EX) || f.rec != Rec::Empty {
            s.procs[p].pc = Self::next_adopt(s, p);
            return;
        }
        if self.probe(s, p) == Probe::Held {
            // "a store-wide command runs": doctor stops there.
            Self::close_all(s, p);
            s.procs[p].pc = Pc::Done;
            return;
        }
        let there = s.trees[i as usize].present();
        if there || self.cfg.rules.adopt_unchecked {
            if !there {
                s.bad |= bad::ADOPT_PHANTOM;
            }
            self.set_rec(s, p, i, g, Rec::Valid(St::Adopted));
        }
        s.procs[p].pc = Self::next_adopt(s, p);
    }

    // -- store-wide ----------------------------------------------------------------

    /// The next file of this round (`list2`, hinted together) not yet passed (`list`); once the
    /// round is done, a new round if the listing shows files not passed, else the command.
    fn next_pass(&self, s: &State, p: usize) -> Pc {
        let (done, round) = (s.procs[p].list, s.procs[p].list2);
        let images = 0..self.cfg.images;
        if let Some(i) = images.clone().find(|&i| round & !done & (1 << i) != 0) {
            return Pc::Pass(i);
        }
        let fresh = |i: u8| s.files[i as usize].is_some() && done & (1 << i) == 0;
        if images.clone().any(fresh) {
            Pc::Hint
        } else {
            Pc::Spawn
        }
    }

    fn store_wide(&self, s: &mut State, p: usize) {
        match s.procs[p].pc {
            Pc::StoreLock => {
                if !Self::grantable(s, Key::Store, EX) || self.inside_store_wide(s, p) {
                    // Inside a hold, or busy under an image user: at once.
                    s.procs[p].pc = Pc::Done;
                    return;
                }
                Self::take(s, Key::Store, p, EX);
                (s.procs[p].list, s.procs[p].list2) = (0, 0);
                s.procs[p].pc = self.next_pass(s, p);
            }
            Pc::Hint => {
                let done = s.procs[p].list;
                let mut round = 0;
                for i in 0..self.cfg.images {
                    if let Some(f) = s.files[i as usize]
                        && done & (1 << i) == 0
                    {
                        Self::set_sw(s, i, f.g, true);
                        round |= 1 << i;
                    }
                }
                s.procs[p].list2 = round;
                s.procs[p].pc = self.next_pass(s, p);
            }
            Pc::Pass(i) => {
                let Some(f) = s.files[i as usize] else {
                    s.procs[p].list |= 1 << i;
                    s.procs[p].pc = self.next_pass(s, p);
                    return;
                };
                if Self::grantable(s, Key::Img(i, f.g), EX) {
                    // Hinted again under the lock.
                    Self::set_sw(s, i, f.g, true);
                    s.procs[p].list |= 1 << i;
                    s.procs[p].pc = self.next_pass(s, p);
                } else if self.enclosing_img(s, p, i).is_some() {
                    s.procs[p].pc = Pc::StoreRelease;
                } else {
                    s.procs[p].wgen = f.g;
                    s.procs[p].pc = Pc::PassWait(i);
                }
            }
            Pc::PassWait(i) => {
                match s.files[i as usize] {
                    Some(f) if f.g != s.procs[p].wgen => {
                        s.procs[p].wgen = f.g;
                        return;
                    }
                    Some(f) if !self.cfg.rules.no_rehint => Self::set_sw(s, i, f.g, true),
                    _ => {}
                }
                s.procs[p].list |= 1 << i;
                s.procs[p].pc = self.next_pass(s, p);
            }
            Pc::Forget => {
                for i in 0..self.cfg.images {
                    if let Some(f) = s.files[i as usize]
                        && f.rec == Rec::Valid(St::Ready)
                        && !s.trees[i as usize].present()
                        && Self::lock_ex(s, p, i).is_some()
                    {
                        self.evidence(s, p, i, f.rec);
                        self.drop_record(s, p, i, f.g);
                        s.bad |= bad::FORGOTTEN;
                    }
                }
                s.procs[p].pc = Pc::StoreRelease;
            }
            Pc::StoreRelease => {
                for i in 0..self.cfg.images {
                    if let Some(f) = s.files[i as usize]
                        && Self::grantable(s, Key::Img(i, f.g), EX)
                    {
                        Self::set_sw(s, i, f.g, false);
                    }
                }
                Self::close_all(s, p);
                s.procs[p].pc = Pc::Done;
            }
            _ => unreachable!(),
        }
    }
}
