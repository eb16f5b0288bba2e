//! Counterexamples as a readable trace: one line per move, naming the
//! process, its operation, the protocol step and the code that does it,
//! then the final state.

use std::fmt::Write;

use stateright::Model;

use crate::proto::{Action, Cmd, Key, Mode, Proto, State, img_name};

fn who(m: &Proto, s: &State, p: u8) -> String {
    let op = m
        .op(s, p as usize)
        .map_or_else(|| "(not started)".to_owned(), |o| o.to_string());
    let nested = m.cfg.roles[p as usize]
        .parent
        .map_or_else(String::new, |q| format!(" [run by P{q}'s command]"));
    format!("P{p}{nested} {op}")
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
            let step = pc.step().expect("a step has a name");
            let fail = if matches!(a, Action::Fail(_)) {
                " — FAILS / PASSES OVER"
            } else {
                ""
            };
            format!(
                "{}: {} {pc:?}{fail}   [{}]",
                who(m, s, p),
                step.name(),
                step.code().join(", ")
            )
        }
        Action::Exit(p, ok) => format!(
            "{}: command exits {}   [command::wait]",
            who(m, s, p),
            if ok { "0" } else { "≠0" }
        ),
        Action::Crash(p) => format!("{}: SIGKILL", who(m, s, p)),
        Action::Torn(p) => format!("{}: crash in the middle of its record write", who(m, s, p)),
        Action::Lose(l) => format!("the catalog is lost: {l:?}"),
    }
}

fn key(k: &Key) -> String {
    match *k {
        Key::Img(i, g) => format!("{}.lock#{g}", img_name(i)),
        Key::Gate(i) => format!("{}.gate", img_name(i)),
        Key::Slot => "slot".to_owned(),
        Key::Store => "store.lock".to_owned(),
    }
}

/// The state, briefly.
pub fn summary(m: &Proto, s: &State) -> String {
    let mut out = String::new();
    for (p, pr) in s.procs.iter().enumerate() {
        let _ = writeln!(
            out,
            "    P{p}: {:?}{}{}{}",
            pr.pc,
            if pr.killed { " (killed)" } else { "" },
            if pr.cmd == Cmd::Running {
                " command running"
            } else {
                ""
            },
            if pr.claimed { " claimed" } else { "" }
        );
    }
    let locks: Vec<String> = s
        .locks
        .iter()
        .map(|(k, o, md)| {
            let mode = if *md == Mode::Exclusive {
                "excl"
            } else {
                "shared"
            };
            format!("{} {mode} by P{o}", key(k))
        })
        .collect();
    let _ = writeln!(out, "    flocks: {}", locks.join("; "));
    for i in 0..m.cfg.images {
        let file = s.files[i as usize].map_or("no lock file".to_owned(), |f| {
            let hints = format!(
                "{}{}",
                if f.ww { "W" } else { "" },
                if f.sw { "S" } else { "" }
            );
            format!("{}.lock#{} {:?} hints [{hints}]", img_name(i), f.g, f.rec)
        });
        let _ = writeln!(
            out,
            "    image {}: {file}, tree {:?}, catalog row {:?}",
            img_name(i),
            s.trees[i as usize],
            s.cat.rows[i as usize]
        );
    }
    if !s.ghosts.is_empty() {
        let _ = writeln!(out, "    unlinked files still saying: {:?}", s.ghosts);
    }
    if let Some(l) = s.cat.lost {
        let _ = writeln!(out, "    catalog: {l:?}");
    }
    out
}

/// The whole trace of a path.
pub fn render(m: &Proto, path: Vec<(State, Option<Action>)>) -> String {
    let mut out = String::new();
    let mut last = None;
    for (n, (s, a)) in path.into_iter().enumerate() {
        if let Some(a) = a {
            let _ = writeln!(out, "  {:2}. {}", n + 1, describe(m, &s, a));
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
