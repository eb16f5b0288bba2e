//! The model's moves (steps, command exits, crashes, catalog losses) and
//! the properties checked on every state:
//!
//! - never two writers in one tree, never a reader beside a writer;
//! - a reader at work reads a `ready` record over a whole tree;
//! - a `ready` record stands only over a whole tree (or one a store-wide
//!   command deleted), whatever crashed where;
//! - no tree without a record, unless its maker holds the lock;
//! - gc, repair and holds destroy records only on positive evidence;
//! - a torn record write leaves the record before it;
//! - while a store-wide hold is granted nobody else is at work on an image;
//! - the catalog decides nothing (every move is the same under any loss);
//! - no deadlock; no new reader passes a waiting writer; an adopted record
//!   names a tree that is there.

use stateright::{Model, Property};

use crate::proto::*;

/// An invariant kept as a flag that the move breaking it sets.
macro_rules! never {
    ($name:expr, $bit:expr) => {
        Property::always($name, |_, s: &State| s.bad & $bit == 0)
    };
}

/// A situation flagged by the move that reaches it.
macro_rules! reached {
    ($name:expr, $bit:expr) => {
        Property::sometimes($name, |_, s: &State| s.bad & $bit != 0)
    };
}
use Mode::Exclusive as EX;

impl Proto {
    fn may_start(&self, s: &State, p: usize) -> bool {
        self.cfg.roles[p]
            .parent
            .is_none_or(|q| s.procs[q as usize].cmd == Cmd::Running)
    }

    fn children(&self, p: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.cfg.roles.len()).filter(move |&c| self.cfg.roles[c].parent == Some(p as u8))
    }

    /// A nested process still at work (its command is part of ours).
    fn child_running(&self, s: &State, p: usize) -> bool {
        self.children(p).any(|c| {
            let ch = &s.procs[c];
            (!ch.killed && !matches!(ch.pc, Pc::Choose | Pc::Done)) || ch.cmd == Cmd::Running
        })
    }

    fn started(pr: &Proc) -> bool {
        !pr.killed && !matches!(pr.pc, Pc::Choose | Pc::Done)
    }

    /// Every move but a crash or a catalog loss.
    pub fn progress_actions(&self, s: &State, out: &mut Vec<Action>) {
        for p in 0..s.procs.len() {
            let pr = &s.procs[p];
            if pr.pc == Pc::Choose && !pr.killed && self.may_start(s, p) {
                for i in 0..self.cfg.roles[p].menu.len() {
                    out.push(Action::Choose(p as u8, i as u8));
                }
            }
            if self.enabled(s, p) {
                out.push(Action::Step(p as u8));
                if self.may_fail(s, p) {
                    out.push(Action::Fail(p as u8));
                }
            }
            if pr.cmd == Cmd::Running
                && (pr.pc == Pc::Command || pr.killed)
                && !self.child_running(s, p)
            {
                out.push(Action::Exit(p as u8, true));
                if matches!(self.op(s, p), Some(Op::Exec { write: Some(_), .. })) {
                    out.push(Action::Exit(p as u8, false));
                }
            }
        }
    }

    /// Nothing left to do: done, never called, or dead with no command.
    pub fn quiet(&self, s: &State, p: usize) -> bool {
        let pr = &s.procs[p];
        let idle = pr.pc == Pc::Done || (pr.pc == Pc::Choose && !self.may_start(s, p));
        (idle || pr.killed) && pr.cmd != Cmd::Running
    }

    pub fn deadlocked(&self, s: &State) -> bool {
        let mut acts = Vec::new();
        self.progress_actions(s, &mut acts);
        acts.is_empty() && (0..s.procs.len()).any(|p| !self.quiet(s, p))
    }

    /// The file the next step of `p` writes a record into, if it does.
    pub fn record_write(&self, s: &State, p: usize) -> Option<(u8, u8)> {
        let pr = &s.procs[p];
        match pr.pc {
            Pc::Start | Pc::Finish => pr.target,
            Pc::Mark(i, _) => pr.held.iter().find(|h| h.img == i).map(|h| (i, h.g)),
            _ => None,
        }
    }

    /// SIGKILL: a running command keeps the descriptors it inherited (the
    /// gates are never inherited); otherwise every lock goes.
    fn kill(s: &mut State, p: usize) {
        let pr = &mut s.procs[p];
        pr.killed = true;
        s.locks
            .retain(|(k, o, _)| !(matches!(k, Key::Gate(_)) && *o as usize == p));
        if s.procs[p].cmd != Cmd::Running {
            Self::close_all(s, p);
        }
    }

    /// A crash in the middle of writing a record slot.
    fn torn(&self, s: &mut State, p: usize) {
        let (i, g) = self.record_write(s, p).expect("a record write");
        let after = match Self::rec_at(s, i, g) {
            Rec::Valid(r) if !self.cfg.rules.one_slot => {
                s.bad |= bad::TORN_KEPT;
                Rec::Valid(r)
            }
            Rec::Valid(_) => {
                s.bad |= bad::TORN_LOST;
                Rec::Damaged
            }
            _ => Rec::Damaged,
        };
        if let Some(f) = s.files[i as usize].as_mut().filter(|f| f.g == g) {
            f.rec = after;
        }
        Self::kill(s, p);
    }

    fn exit(&self, s: &mut State, p: usize, ok: bool) {
        let op = self.op(s, p).expect("started");
        match op {
            Op::StoreWide { deletes: Some(i) } if s.trees[i as usize].present() => {
                self.set_tree(s, p, i, Tree::Gone)
            }
            Op::Exec { write: Some(_), .. } if ok => {
                let (i, _) = s.procs[p].target.expect("a written image");
                self.set_tree(s, p, i, Tree::Whole);
            }
            _ => {}
        }
        s.procs[p].cmd = Cmd::Exited;
        s.procs[p].ok = ok;
        for c in self.children(p).collect::<Vec<_>>() {
            if s.procs[c].pc == Pc::Choose {
                s.procs[c].pc = Pc::Done;
            }
        }
        if s.procs[p].killed {
            // The last holder of the inherited descriptors is gone.
            return Self::close_all(s, p);
        }
        let writes = matches!(op, Op::Exec { write: Some(_), .. });
        s.procs[p].pc = match op {
            Op::StoreWide { .. } => Pc::Forget,
            _ if !writes => Pc::Release,
            _ if self.cfg.rules.record_after_unlock => {
                s.procs[p].late = true;
                Pc::Release
            }
            _ => Pc::Finish,
        };
    }

    fn initial(&self) -> State {
        let n = self.cfg.images as usize;
        let mut s = State {
            procs: vec![Proc::default(); self.cfg.roles.len()],
            locks: vec![],
            files: vec![None; n],
            next_gen: vec![0; n],
            ghosts: vec![],
            trees: vec![Tree::None; n],
            cat: Catalog {
                lost: None,
                rows: vec![None; n],
            },
            crashes: 0,
            losses: 0,
            bad: 0,
        };
        for &(i, st) in &self.cfg.records {
            let i = i as usize;
            s.files[i] = Some(File {
                g: 0,
                rec: Rec::Valid(st),
                ww: false,
                sw: false,
            });
            s.next_gen[i] = 1;
            s.trees[i] = if st == St::Failed {
                Tree::Partial
            } else {
                Tree::Whole
            };
            s.cat.rows[i] = Some(st);
        }
        s
    }

    // -- invariants ------------------------------------------------------------

    pub fn exclusion_holds(&self, s: &State) -> bool {
        (0..self.cfg.images).all(|i| {
            let modes = s
                .procs
                .iter()
                .flat_map(|pr| pr.held.iter())
                .filter(|h| h.img == i);
            let (mut w, mut r) = (0, 0);
            for h in modes {
                if h.mode == EX { w += 1 } else { r += 1 }
            }
            w <= 1 && (w == 0 || r == 0)
        })
    }

    /// At work on an image: past its claim (or its command running) with an
    /// image lock.
    fn at_work(pr: &Proc) -> bool {
        (pr.claimed || pr.cmd == Cmd::Running) && !pr.held.is_empty()
    }

    pub fn readers_read_ready(&self, s: &State) -> bool {
        s.procs.iter().filter(|pr| Self::at_work(pr)).all(|pr| {
            pr.held.iter().filter(|h| h.mode != EX).all(|h| {
                // (`Gone`: deleted by a store-wide command whose stowage
                // died before it forgot the image; the reader finds no
                // tree, never a partial one.)
                Self::cur_rec(s, h.img) == Rec::Valid(St::Ready)
                    && matches!(s.trees[h.img as usize], Tree::Whole | Tree::Gone)
            })
        })
    }

    pub fn ready_means_whole(&self, s: &State) -> bool {
        (0..self.cfg.images).all(|i| {
            Self::cur_rec(s, i) != Rec::Valid(St::Ready)
                || matches!(s.trees[i as usize], Tree::Whole | Tree::Gone)
        })
    }

    pub fn no_orphan_tree(&self, s: &State) -> bool {
        (0..self.cfg.images).all(|i| {
            !s.trees[i as usize].present()
                || s.files[i as usize].is_some_and(|f| {
                    f.rec != Rec::Empty
                        || s.locks
                            .iter()
                            .any(|(k, _, m)| *k == Key::Img(i, f.g) && *m == EX)
                })
        })
    }

    pub fn store_hold_alone(&self, s: &State) -> bool {
        let Some(h) = self.granted_hold(s) else {
            return true;
        };
        (0..s.procs.len())
            .filter(|&q| q != h && !self.in_tree_of(q, h))
            .all(|q| !Self::at_work(&s.procs[q]))
    }

    /// Every move from `s` is the same, the catalog aside, whatever became
    /// of the catalog.
    pub fn catalog_decides_nothing(&self, s: &State) -> bool {
        if !self.cfg.catalog_check {
            return true;
        }
        let strip = |mut t: State| {
            t.cat.lost = None;
            t.cat.rows.iter_mut().for_each(|r| *r = None);
            t.bad &= !bad::REBUILT;
            t
        };
        let mut acts = Vec::new();
        self.progress_actions(s, &mut acts);
        self.losses().iter().all(|&loss| {
            let mut t = s.clone();
            Self::lose(&mut t, loss);
            t.losses = s.losses;
            let mut other = Vec::new();
            self.progress_actions(&t, &mut other);
            other == acts
                && acts
                    .iter()
                    .all(|&a| self.next_state(s, a).map(strip) == self.next_state(&t, a).map(strip))
        })
    }

    /// Situations of images' lives, to be reached.
    fn situations() -> Vec<Property<Self>> {
        vec![
            Property::sometimes("a reader's command runs", |m: &Proto, s: &State| {
                (0..s.procs.len()).any(|q| {
                    s.procs[q].cmd == Cmd::Running
                        && matches!(
                            m.op(s, q),
                            Some(Op::Exec {
                                read: Some(_),
                                from: false,
                                ..
                            })
                        )
                })
            }),
            Property::sometimes("a new image becomes ready", |m: &Proto, s: &State| {
                (0..m.cfg.images).any(|i| {
                    !m.cfg.records.contains(&(i, St::Ready))
                        && Self::cur_rec(s, i) == Rec::Valid(St::Ready)
                })
            }),
            reached!("an image is removed", bad::REMOVED),
            reached!("gc collects a failed or dead writer's image", bad::GC_DEAD),
            reached!("an interrupted removal is finished", bad::INTERRUPTED),
            reached!(
                "a store-wide command's deleted image is forgotten",
                bad::FORGOTTEN
            ),
            reached!("a lost catalog is rebuilt from the records", bad::REBUILT),
            reached!("a torn write leaves the record before it", bad::TORN_KEPT),
        ]
    }

    /// Situations of crashes, waits and nested calls.
    fn waits() -> Vec<Property<Self>> {
        vec![
            Property::sometimes(
                "a dead writer's record reads incomplete",
                |m: &Proto, s: &State| {
                    (0..m.cfg.images).any(|i| {
                        matches!(Self::cur_rec(s, i), Rec::Valid(St::Creating | St::Writing))
                            && Self::census(s, i) == Some(St::Failed)
                    })
                },
            ),
            Property::sometimes(
                "a waiter is blocked on an unlinked lock file",
                |m: &Proto, s: &State| {
                    (0..s.procs.len()).any(|p| match (s.procs[p].pc, m.op(s, p)) {
                        (Pc::Wait(k), Some(op)) => {
                            let (i, _) = Self::wanted(op)[k as usize];
                            !s.procs[p].killed && Self::gen_at(s, i) != Some(s.procs[p].wgen)
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
                        .any(|pr| pr.killed && pr.cmd == Cmd::Running && !pr.held.is_empty())
                },
            ),
            Property::sometimes(
                "a store-wide hold waits for an image user",
                |_, s: &State| {
                    s.procs
                        .iter()
                        .any(|pr| !pr.killed && matches!(pr.pc, Pc::PassWait(_)))
                },
            ),
            Property::sometimes(
                "an exec waits for a granted store-wide hold",
                |m: &Proto, s: &State| {
                    m.granted_hold(s).is_some()
                        && s.procs
                            .iter()
                            .any(|pr| !pr.killed && pr.pc == Pc::StoreAwait)
                },
            ),
            Property::sometimes(
                "a nested reader holds the image while a writer waits",
                |m: &Proto, s: &State| {
                    (0..s.procs.len()).any(|p| {
                        m.cfg.roles[p].parent.is_some()
                            && s.procs[p]
                                .held
                                .iter()
                                .any(|h| h.mode != EX && m.writer_waits(s, h.img))
                    })
                },
            ),
            Property::sometimes(
                "a process works under its enclosing command's slot",
                |m: &Proto, s: &State| {
                    (0..s.procs.len()).any(|p| {
                        matches!(m.op(s, p), Some(Op::Exec { slot: true, .. }))
                            && s.procs[p].claimed
                            && !s.locks.contains(&(Key::Slot, p as u8, EX))
                    })
                },
            ),
        ]
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
                    if self.record_write(s, p).is_some() {
                        out.push(Action::Torn(p as u8));
                    }
                }
            }
        }
        if s.losses < self.cfg.losses {
            out.extend(self.losses().iter().map(|&l| Action::Lose(l)));
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
            Action::Fail(p) => {
                let p = p as usize;
                match s.procs[p].pc {
                    Pc::Clone => {
                        s.procs[p].ok = false;
                        s.procs[p].pc = Pc::Finish;
                    }
                    Pc::Spawn => self.spawn_failed(&mut s, p),
                    _ => self.pass_over(&mut s, p),
                }
            }
            Action::Exit(p, ok) => self.exit(&mut s, p as usize, ok),
            Action::Crash(p) => {
                s.crashes += 1;
                Self::kill(&mut s, p as usize);
            }
            Action::Torn(p) => {
                s.crashes += 1;
                self.torn(&mut s, p as usize);
            }
            Action::Lose(loss) => Self::lose(&mut s, loss),
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut v = vec![
            Property::always(
                "never two writers in one tree, never a reader beside a writer",
                |m: &Proto, s: &State| m.exclusion_holds(s),
            ),
            Property::always(
                "a reader at work reads a ready record over a whole tree",
                |m: &Proto, s: &State| m.readers_read_ready(s),
            ),
            Property::always(
                "a ready record only over a whole tree",
                |m: &Proto, s: &State| m.ready_means_whole(s),
            ),
            Property::always(
                "no tree without a record but its maker's",
                |m: &Proto, s: &State| m.no_orphan_tree(s),
            ),
            never!(
                "gc, repair and holds destroy records only on positive evidence",
                bad::EVIDENCE
            ),
            never!(
                "a torn write never loses the record before it",
                bad::TORN_LOST
            ),
            Property::always(
                "while a store-wide hold is granted, nobody else is at work on an image",
                |m: &Proto, s: &State| m.store_hold_alone(s),
            ),
            never!(
                "nobody outside a granted store-wide hold changes an image",
                bad::PASSED_HOLD
            ),
            Property::always("the catalog decides nothing", |m: &Proto, s: &State| {
                m.catalog_decides_nothing(s)
            }),
            Property::always("no deadlock", |m: &Proto, s: &State| !m.deadlocked(s)),
            Property::always(
                "no step under the global lock waits",
                |m: &Proto, s: &State| {
                    (0..s.procs.len()).all(|p| {
                        let step = s.procs[p].pc.step();
                        let under = step.is_some_and(|st| st.in_transaction());
                        s.procs[p].killed
                            || !under
                            || (m.enabled(s, p) && !step.is_some_and(|st| st.blocks()))
                    })
                },
            ),
            never!("no new reader passes a waiting writer", bad::BYPASS),
            never!(
                "an adopted record names a tree that is there",
                bad::ADOPT_PHANTOM
            ),
        ];
        v.extend(Self::situations());
        v.extend(Self::waits());
        v
    }
}
