//! Why a process waits: the chain from a waiter to the process at its end (`lock-status --why`),
//! or the cycle it is caught in.
//!
//! - **One step** is a party waiting for a lock (its holders are the next steps) or for a command
//!   it runs, inside which another waits (a nested `stowage exec`, a script's `flock(1)`).
//! - **Blocked by** whoever holds the lock in a conflicting mode; a reader of an image that is
//!   only read waits behind the writers queued ahead of it (the gate).
//! - **Inside** is told for processes of this host and pid namespace by their ancestry in `/proc`
//!   (placing `flock(1)` users too), else by the leases (`within`: the execs it runs inside).
//! - Built from one look ([`Look`]) and its reports: no lock is taken, nothing is waited for.

use std::collections::HashMap;

use serde::Serialize;

use crate::clock;
use crate::holders::{LockKind, LockReport, Look, Party, PidSpace, Stopped, command_cut, pid_on};
use crate::lock::Mode;

/// The lock a step waits for.
#[derive(Debug, Clone, Serialize)]
pub struct Awaited {
    pub kind: LockKind,
    pub name: String,
    pub mode: Mode,
    /// Exclusive, to read (`--read-exclusive`): said so, never as a write.
    #[serde(skip)]
    pub reading: bool,
}

impl Awaited {
    /// "write lock on image 'app'", "a slot of class 'pull'"
    pub fn describe(&self) -> String {
        match self.kind {
            LockKind::Image if self.reading => {
                format!("exclusive read lock on image '{}'", self.name)
            }
            LockKind::Image => format!("{} lock on image '{}'", self.mode.verb(), self.name),
            LockKind::Slot => format!("a slot of class '{}'", self.name),
            // The global lock is never awaited in a graph ([`Graph::new`]): the store's or gc's.
            LockKind::Global if self.name == "gc" => "the gc lock".into(),
            LockKind::Global => "the store-wide lock".into(),
        }
    }
}

/// How a step is related to the one before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Relation {
    /// The first step: the waiter asked about.
    Waiter,
    /// Holds the lock the step before waits for.
    Holder,
    /// A writer queued ahead of the step before, a reader of a lock only read: it goes first.
    Queued,
    /// Runs inside the step before (its command, or a command of that).
    Inside,
}

impl Relation {
    /// How a chain's text introduces a step so related to the one before.
    fn lead(self) -> &'static str {
        match self {
            Relation::Waiter => "",
            Relation::Holder => "held by ",
            Relation::Queued => "behind ",
            Relation::Inside => "running inside it, ",
        }
    }
}

/// A step; as JSON, its relation, its party's fields, and what it waits for.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub relation: Relation,
    #[serde(flatten)]
    pub party: Party,
    /// What this step waits for; None for a step waiting on a command it runs, or at a chain's end.
    pub waits_for: Option<Awaited>,
}

#[derive(Debug, Clone)]
pub struct Chain {
    pub steps: Vec<Step>,
    /// A cycle: the index of the step the last one waits for again, and how the last step leads
    /// back to it (a lock it holds, or a command it runs).
    pub cycle: Option<(usize, Relation)>,
}

/// A party as the graph knows it: by its lease, else its pid and host.
fn key(p: &Party) -> String {
    match (&p.lease, p.pid) {
        (Some(l), _) => format!("lease:{l}"),
        (None, Some(pid)) => format!("pid:{pid}@{}", p.host.as_deref().unwrap_or("?")),
        (None, None) => format!("unknown:{:p}", p),
    }
}

/// Who waits for what, who holds what, and who runs inside whom.
#[derive(Default)]
pub struct Graph {
    /// Per party key: the locks it waits for, with who blocks it there.
    waits: HashMap<String, Vec<(Awaited, Blockers)>>,
    /// Every party that waits, by key.
    waiters: Vec<Party>,
    /// Lease name → the leases it runs within.
    within: HashMap<String, Vec<String>>,
    /// Lease names whose pid means a process of ours.
    ours: Vec<String>,
    host: String,
}

impl Graph {
    /// The graph of `reports`, all from `look`.
    pub fn new(look: &Look, host: &str, reports: &[LockReport]) -> Graph {
        let mut g = Graph {
            host: host.to_owned(),
            ..Graph::default()
        };
        for (name, id) in look.leases() {
            g.within.insert(name.clone(), id.within.clone());
            if id.pid_is_ours() {
                g.ours.push(name.clone());
            }
        }
        for r in reports.iter().filter(|r| r.name != "global") {
            for w in &r.waiters {
                let awaited = Awaited {
                    kind: r.kind,
                    name: r.name.clone(),
                    mode: w.mode,
                    reading: w.reading,
                };
                let ws = g.waits.entry(key(w)).or_insert_with(|| {
                    g.waiters.push(w.clone());
                    Vec::new()
                });
                ws.push((awaited, blockers(r, w)));
            }
        }
        g
    }

    pub fn waiters_of_image(&self, name: &str) -> Vec<Party> {
        self.waiters
            .iter()
            .filter(|p| {
                self.waits.get(&key(p)).is_some_and(|ws| {
                    ws.iter()
                        .any(|(a, _)| a.kind == LockKind::Image && a.name == name)
                })
            })
            .cloned()
            .collect()
    }

    /// The waiter that is local process `pid`, runs inside it (a holder in `reports`, or any
    /// process: the command an exec runs, whose nested call waits), or it runs inside (a build's).
    pub fn waiter_for_pid(&self, pid: u32, reports: &[LockReport]) -> Option<Party> {
        let local = |p: &&Party| p.pid == Some(pid) && self.is_local(p);
        if let Some(w) = self.waiters.iter().find(local) {
            return Some(w.clone());
        }
        if let Some(h) = reports.iter().flat_map(|r| &r.holders).find(local)
            && let Some(w) = self.inside(h).into_iter().next()
        {
            return Some(w);
        }
        let above = crate::nested::ancestors_of(pid);
        let local_waiters = self.waiters.iter().filter(|p| self.is_local(p));
        let mut pids = local_waiters.filter_map(|p| Some((p, p.pid?)));
        let found = pids.clone().find(|(_, q)| above.contains(q));
        let found =
            found.or_else(|| pids.find(|(_, q)| crate::nested::ancestors_of(*q).contains(&pid)));
        found.map(|(p, _)| p.clone())
    }

    /// Whether `p`'s pid names a process of this pid namespace (the table's pid, or a lease's pid
    /// of it: a waiter in a child namespace is named by the pid the table shows us).
    fn is_local(&self, p: &Party) -> bool {
        let ours = |l: &String| self.ours.contains(l) || p.pid_space == PidSpace::Here;
        match &p.lease {
            Some(l) => ours(l),
            None => p.pid.is_some() && p.host.as_deref() == Some(self.host.as_str()),
        }
    }

    /// Waiters inside `holder`: nested execs whose lease says so, and local processes below it.
    fn inside(&self, holder: &Party) -> Vec<Party> {
        let hkey = key(holder);
        self.waiters
            .iter()
            .filter(|w| key(w) != hkey)
            .filter(|w| {
                // Where pids tell, they alone do: a lease's `within` is the environment it was
                // started with, which any process may have restored (nested.rs).
                if self.is_local(w) && self.is_local(holder) {
                    return (w.pid.zip(holder.pid))
                        .is_some_and(|(wp, hp)| crate::nested::ancestors_of(wp).contains(&hp));
                }
                (w.lease.as_ref().zip(holder.lease.as_ref()))
                    .is_some_and(|(wl, hl)| self.within.get(wl).is_some_and(|v| v.contains(hl)))
            })
            .cloned()
            .collect()
    }

    /// Every chain from waiter `start`, branching at locks with many holders; at most `MAX_CHAINS`.
    pub fn chains(&self, start: &Party) -> Vec<Chain> {
        let mut out = Vec::new();
        let first = Step {
            party: start.clone(),
            relation: Relation::Waiter,
            waits_for: None,
        };
        self.walk(vec![first], &mut out);
        out
    }

    fn walk(&self, mut path: Vec<Step>, out: &mut Vec<Chain>) {
        if out.len() >= MAX_CHAINS {
            return;
        }
        let deep = path.len() >= MAX_STEPS;
        let last = path.last_mut().expect("a path has a step");
        let next = self.next(&last.party).filter(|_| !deep);
        if let Some((awaited, _, _)) = &next {
            last.waits_for = awaited.clone();
        }
        // A wait nobody is in the way of (a free lock) ends the chain: the waiter is what to end.
        let Some((_, parties, relation)) = next.filter(|(_, ps, _)| !ps.is_empty()) else {
            out.push(Chain {
                steps: path,
                cycle: None,
            });
            return;
        };
        for p in parties {
            if let Some(i) = path.iter().position(|s| key(&s.party) == key(&p)) {
                out.push(Chain {
                    steps: path.clone(),
                    cycle: Some((i, relation)),
                });
                continue;
            }
            let mut longer = path.clone();
            longer.push(Step {
                party: p,
                relation,
                waits_for: None,
            });
            self.walk(longer, out);
        }
    }

    /// What `p` waits for: a lock and its blockers, or the waiters inside it; None ends the chain.
    fn next(&self, p: &Party) -> Option<(Option<Awaited>, Vec<Party>, Relation)> {
        if let Some((awaited, (by, how))) = self.waits.get(&key(p)).and_then(|ws| ws.first()) {
            return Some((Some(awaited.clone()), by.clone(), *how));
        }
        let inside = self.inside(p);
        (!inside.is_empty()).then_some((None, inside, Relation::Inside))
    }
}

/// At most this many chains from a waiter, each at most this long: a diagnosis, not a full search.
const MAX_CHAINS: usize = 16;
const MAX_STEPS: usize = 32;

/// Who keeps a waiter waiting, and how: they hold the lock, or are queued ahead.
type Blockers = (Vec<Party>, Relation);

/// Who keeps `w` waiting on the lock of `r`: the holders in a conflicting mode; for a reader of a
/// lock only read, the writers queued ahead; else all.
fn blockers(r: &LockReport, w: &Party) -> Blockers {
    let others = |ps: &[Party], pick: &dyn Fn(&Party) -> bool| -> Vec<Party> {
        ps.iter()
            .filter(|p| key(p) != key(w) && pick(p))
            .cloned()
            .collect()
    };
    let conflicting = others(&r.holders, &|h| {
        w.mode == Mode::Exclusive || h.mode == Mode::Exclusive
    });
    if !conflicting.is_empty() {
        return (conflicting, Relation::Holder);
    }
    let ahead = others(&r.waiters, &|o| {
        o.mode == Mode::Exclusive && o.since.unwrap_or(i64::MAX) <= w.since.unwrap_or(i64::MAX)
    });
    if !ahead.is_empty() {
        return (ahead, Relation::Queued);
    }
    (others(&r.holders, &|_| true), Relation::Holder)
}

/// What to do about a chain: which process to end.
pub fn advice(chain: &Chain) -> String {
    let end = to_end(chain);
    let (name, kill) = (who(end), kill(end));
    if let Some((from, _)) = chain.cycle {
        let n = chain.steps.len() - from;
        return format!(
            "a cycle of {n}: none of them can go on until one ends; ending {name} (the newest) breaks it{kill}"
        );
    }
    if end.pid.is_none() {
        return format!(
            "the end is {name}: look on the hosts sharing the store for a process holding it"
        );
    }
    let pid = end.pid.unwrap_or_default();
    match crate::holders::stopped(end) {
        Some(Stopped::BySignal) => {
            format!("{name} is stopped: continue it (kill -CONT {pid}), or end it{kill}")
        }
        Some(Stopped::ByTracer) => {
            format!("{name} is stopped by its tracer (a debugger): let it go on, or end it{kill}")
        }
        None => match crate::holders::stopped_below(end) {
            Some((command, Stopped::BySignal, true)) => format!(
                "{name} runs a stopped command (pid {command}): continue it (kill -CONT {command}), or end it{kill}"
            ),
            Some((command, Stopped::ByTracer, true)) => format!(
                "{name} runs a command stopped by its tracer (pid {command}, a debugger): let it go on, or end it{kill}"
            ),
            // Deeper, a signal to the exec reaches only its command: the stopped one is to go on.
            Some((other, Stopped::BySignal, false)) => format!(
                "{name} waits for pid {other} under it, which is stopped: continue it (kill -CONT {other})"
            ),
            Some((other, Stopped::ByTracer, false)) => format!(
                "{name} waits for pid {other} under it, stopped by its tracer (a debugger): let it go on"
            ),
            None => {
                format!("{name} waits for nothing stowage can see: let it finish, or end it{kill}")
            }
        },
    }
}

/// The process to end: a cycle's newest, which has done the least work; else the chain's last.
pub fn to_end(chain: &Chain) -> &Party {
    let from = chain.cycle.map_or(chain.steps.len() - 1, |(from, _)| from);
    let steps = chain.steps[from..].iter();
    let newest = steps.max_by_key(|s| s.party.since.unwrap_or(i64::MIN));
    &newest.expect("a chain has steps").party
}

/// "pid 4121 on node07 (make all)"
pub fn who(p: &Party) -> String {
    pid_on(p, "a process stowage cannot identify", None, false) + &command_cut(p, 71)
}

/// ": kill PID" (with the host where it is not this one, as a hint).
fn kill(p: &Party) -> String {
    let Some(pid) = p.pid else {
        return String::new();
    };
    match (p.pid_space, &p.host) {
        (PidSpace::OtherNamespace, _) if crate::holders::unverifiable(p) => format!(
            ": in the pid namespace it runs in, kill {pid} (if that exec has ended, the command it ran)"
        ),
        (PidSpace::OtherNamespace, _) => format!(": in the pid namespace it runs in, kill {pid}"),
        // Our namespace's pid, whatever host name (a local container with its own UTS namespace).
        (PidSpace::Here, _) => format!(": kill {pid}"),
        (_, Some(h)) if *h != crate::ident::Me::current().host => format!(": on {h}, kill {pid}"),
        // Of another machine of our name: the pid means another process here.
        (PidSpace::ItsHost, Some(h)) => format!(": on the other host named {h}, kill {pid}"),
        _ => format!(": kill {pid}"),
    }
}

/// The chain as lines of text, the advice last.
pub fn render(chain: &Chain) -> String {
    let mut out = String::new();
    for (i, s) in chain.steps.iter().enumerate() {
        // Only the first step is the waiter: at no depth.
        let mut line = format!("{}{}{}", "  ".repeat(i), s.relation.lead(), who(&s.party));
        if s.relation == Relation::Queued {
            line.push_str(", a writer queued ahead of it");
        }
        if let (Relation::Holder | Relation::Queued, Some(t)) = (s.relation, s.party.since) {
            line.push_str(&format!(" for {}", clock::ago(t)));
        }
        let next = chain.steps.get(i + 1).map(|n| n.relation).or(
            // The last step of a cycle leads back to the step it waits for again.
            chain.cycle.map(|(_, via)| via),
        );
        match (&s.waits_for, next) {
            (Some(a), _) => line.push_str(&format!(", waits for {}", a.describe())),
            (None, Some(Relation::Inside)) => line.push_str(", waits for its command"),
            _ => {}
        }
        out.push_str(&line);
        out.push('\n');
    }
    if let Some((from, via)) = chain.cycle {
        out.push_str(&format!(
            "{}{}{} again: a cycle\n",
            "  ".repeat(chain.steps.len()),
            via.lead(),
            who(&chain.steps[from].party)
        ));
    }
    out.push_str(&format!("what to do: {}\n", advice(chain)));
    out
}
