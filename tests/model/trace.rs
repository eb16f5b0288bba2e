//! Counterexamples as a readable trace: one line per move, naming the
//! process, its operation, the protocol step and the code that does it.

use std::fmt::Write;

use stateright::Model;

use crate::proto::{Action, Cmd, Key, Mode, Proto, State, img_name};
use crate::steps::Step;

fn who(m: &Proto, s: &State, p: u8) -> String {
    let role = &m.cfg.roles[p as usize];
    let op = m
        .op(s, p as usize)
        .map_or_else(|| "(not started)".to_owned(), |o| o.to_string());
    let nested = role
        .parent
        .map_or_else(String::new, |q| format!(", run by P{q}'s command"));
    format!("P{p} [host {}{nested}] {op}", role.host)
}

/// One line for a move made from state `s`.
pub fn describe(m: &Proto, s: &State, a: Action) -> String {
    match a {
        Action::Choose(p, i) => {
            let op = m.cfg.roles[p as usize].menu[i as usize];
            format!("P{p} starts: stowage {op}")
        }
        Action::Step(p) | Action::Fail(p) => {
            let pc = s.procs[p as usize].pc;
            let step = m.next_step(s, p as usize).expect("a step has a name");
            let fail = match (a, step) {
                (Action::Fail(_), Step::Fold | Step::FoldUnlink) => {
                    " — THE LISTING MISSES THE MARKERS (NFS)"
                }
                (Action::Fail(_), _) => " — FAILS",
                _ => "",
            };
            format!(
                "{}: {} {pc:?}{fail}   [{}]",
                who(m, s, p),
                step.name(),
                step.code().join(", ")
            )
        }
        Action::Exit(p, ok) => format!(
            "{}: command exits {}   [signals::wait]",
            who(m, s, p),
            if ok { "0" } else { "≠0" }
        ),
        Action::Crash(p) => format!("{}: SIGKILL", who(m, s, p)),
        Action::HostDies(h) => format!("host {h} dies with every process on it"),
    }
}

fn key(k: &Key) -> String {
    match *k {
        Key::Img(i, g) => format!("{}.lock#{g}", img_name(i)),
        Key::Gate(i) => format!("{}.gate", img_name(i)),
        Key::Slot(f) => format!("slot{f}"),
        Key::Lease(o, n, g) => format!("lease P{o}.{n}#{g}"),
        Key::Store => "store.lock".to_owned(),
    }
}

/// The state, briefly.
pub fn summary(m: &Proto, s: &State) -> String {
    let mut out = String::new();
    for (p, pr) in s.procs.iter().enumerate() {
        let _ = writeln!(
            out,
            "    P{p}: {:?}{}{}",
            pr.pc,
            if pr.alive { "" } else { " (killed)" },
            match pr.cmd {
                Cmd::Running => " command running",
                _ => "",
            }
        );
    }
    let locks: Vec<String> = s
        .locks
        .iter()
        .map(|(k, o, md)| {
            format!(
                "{} {} by P{o}",
                key(k),
                if *md == Mode::Exclusive {
                    "excl"
                } else {
                    "shared"
                }
            )
        })
        .collect();
    let _ = writeln!(out, "    flocks: {}", locks.join("; "));
    for i in 0..m.cfg.images as usize {
        let _ = writeln!(
            out,
            "    image {}: row {:?}, lock file {}{}, tree {}{}{}",
            img_name(i as u8),
            s.rows[i],
            s.file[i].map_or("none".to_owned(), |g| format!("#{g}")),
            s.file[i].map_or(String::new(), |g| format!(
                " (record {:?})",
                Proto::record_at(s, i as u8, g)
            )),
            if s.tree[i] { "present" } else { "gone" },
            if s.whole[i] {
                ""
            } else {
                ", left incomplete by a write"
            },
            if s.marks & (1 << i) != 0 {
                ", marker"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(out, "    records: {:?}", s.records);
    let leases: Vec<String> = s
        .lfiles
        .iter()
        .map(|&(o, n, g)| key(&Key::Lease(o, n, g)))
        .collect();
    let _ = writeln!(out, "    lease files: {}", leases.join("; "));
    if let Some(h) = s.store_rec {
        let _ = writeln!(out, "    store-wide record of P{h}");
    }
    out
}

/// The whole trace of a path.
pub fn render(m: &Proto, path: Vec<(State, Option<Action>)>) -> String {
    let mut out = String::new();
    let mut n = 0;
    let mut last = None;
    for (s, a) in path {
        if let Some(a) = a {
            n += 1;
            let _ = writeln!(out, "  {n:2}. {}", describe(m, &s, a));
        }
        last = Some(s);
    }
    if let Some(s) = last {
        let _ = writeln!(out, "  final state:\n{}", summary(m, &s));
        let mut acts = Vec::new();
        m.actions(&s, &mut acts);
        let _ = writeln!(out, "  moves left: {}", acts.len());
    }
    out
}
