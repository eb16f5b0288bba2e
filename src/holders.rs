//! Who holds and awaits a lock, and how to say it.
//!
//! A [`Party`] is a holder or waiter, from a record or straight from the
//! kernel's lock table. This module turns parties into the sentences every
//! message uses ("held (read) by pid 4121 on node07 (…) since 12:03:04"),
//! and announces waits: [`announce_wait`] is the one place that prints
//! "waiting for …". It reads, never writes: judging records (and dropping
//! stale ones) is `judge.rs`.

use std::path::Path;

use crate::clock::{self, Millis};
use crate::ctx::Ctx;
use crate::ident;
use crate::kernel::{Entry, KernelView, LockView};
use crate::lock::Mode;

/// A holder or waiter, from a record or straight from the kernel.
#[derive(Debug, Clone)]
pub struct Party {
    pub pid: Option<u32>,
    pub host: Option<String>,
    pub user: Option<String>,
    pub mode: Mode,
    pub command: Option<String>,
    pub since: Option<Millis>,
    /// False for a process stowage did not start.
    pub stowage: bool,
    /// The lease that proves the party alive (`lease.rs`); None for an
    /// outsider or a record of an older release.
    pub lease: Option<String>,
}

/// A lock-table entry no record claims: a stowage process that has not
/// recorded itself (a reader or slot holder, which never does; or a writer
/// a moment before it does), known by the lease it took — for the command
/// its lease lists with `lockfile` (relative to the locks directory), else
/// stowage's own command line — and else a process stowage did not start.
pub(crate) fn unrecorded(ctx: &Ctx, kv: &KernelView, e: &Entry, lockfile: &str) -> Party {
    let leased = e.pid.and_then(|p| kv.lease_taken_by(p)).and_then(|name| {
        let id = kv.said_by(&name)?;
        let listed = id
            .holdings
            .iter()
            .find(|h| h.lockfile == lockfile && h.mode == e.mode && h.awaits == e.blocked)
            .cloned();
        Some(match listed {
            Some(h) => Party::leased(name, id, &h),
            None => Party {
                pid: id.pid,
                host: Some(id.host),
                user: Some(id.user),
                mode: e.mode,
                command: Some(id.command),
                since: id.since,
                stowage: true,
                lease: Some(name),
            },
        })
    });
    leased.unwrap_or_else(|| outsider(ctx, e))
}

pub(crate) fn outsider(ctx: &Ctx, e: &Entry) -> Party {
    Party {
        pid: e.pid,
        host: Some(ctx.me.host.clone()),
        user: e.pid.and_then(ident::process_user),
        mode: e.mode,
        command: e.pid.and_then(ident::command_line),
        since: None,
        stowage: false,
        lease: None,
    }
}

impl Party {
    /// The party a lease names for one of the locks it lists.
    pub fn leased(name: String, id: crate::lease::Identity, h: &crate::lease::Holding) -> Party {
        Party {
            pid: id.pid,
            host: Some(id.host),
            user: Some(id.user),
            mode: h.mode,
            command: Some(h.command.clone()),
            since: Some(h.since),
            stowage: true,
            lease: Some(name),
        }
    }

    /// The party a record names.
    pub fn recorded(rec: &crate::meta::Record) -> Party {
        Party {
            pid: Some(rec.pid),
            host: Some(rec.host.clone()),
            user: Some(rec.user.clone()),
            mode: rec.mode,
            command: Some(rec.command.clone()),
            since: Some(rec.since),
            stowage: true,
            lease: rec.lease.clone(),
        }
    }
}

/// Says, once, before blocking, what a process waits for and who holds it:
/// "stowage: waiting for write lock on image 'app': held (read) by …". The
/// one place the sentence is made (quiet mode says nothing).
pub fn announce_wait(ctx: &Ctx, what: &str, holders: &str) {
    ctx.say(&format!("waiting for {what}: {holders}"));
}

/// "held (read) by pid 4121 on node07 (ch-image build -t app .) since 12:03:04"
pub fn phrase(holders: &[Party]) -> String {
    match holders.first() {
        Some(first) => phrase_as(&format!("held ({}) by ", first.mode.verb()), holders, true),
        None => phrase_as("", holders, true),
    }
}

/// "in use by pid 4121 on node07 (ch-image pull alpine) since 12:03:04"
pub fn phrase_slots(holders: &[Party]) -> String {
    phrase_as("in use by ", holders, true)
}

fn phrase_as(lead: &str, holders: &[Party], origin: bool) -> String {
    if holders.is_empty() {
        return "no holder is known (it may have just been released)".into();
    }
    let mut s = lead.to_owned();
    let shown: Vec<String> = holders
        .iter()
        .take(3)
        .map(|p| describe(p, origin))
        .collect();
    s.push_str(&shown.join("; "));
    if holders.len() > 3 {
        s.push_str(&format!("; and {} more", holders.len() - 3));
    }
    s
}

/// One party; with `origin`, says when a process with a pid was not
/// started by stowage.
fn describe(p: &Party, origin: bool) -> String {
    let mut s = match p.pid {
        Some(pid) => format!("pid {pid}"),
        None => "a process".into(),
    };
    if let Some(h) = &p.host {
        s.push_str(&format!(" on {}", ident::printable(h)));
    }
    if let Some(c) = &p.command {
        s.push_str(&format!(" ({})", truncate(&ident::printable(c), 80)));
    }
    if let Some(t) = p.since {
        s.push_str(&format!(" since {}", clock::local_short(t)));
    }
    if !p.stowage {
        if p.pid.is_none() {
            s.push_str(" that stowage cannot identify (outside stowage, or on another host)");
        } else if origin {
            s.push_str(", not started by stowage");
        }
    }
    s
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let cut: String = s.chars().take(max - 1).collect();
        format!("{cut}…")
    }
}

/// Who holds a lock, from the kernel alone (no records): for messages
/// where the database may be unusable, such as waiting to rebuild it.
pub fn kernel_holders_phrase(ctx: &Ctx, path: &Path) -> String {
    let view = KernelView::new(&ctx.root.locks())
        .view(path)
        .unwrap_or_default();
    let holders: Vec<Party> = view.holders.iter().map(|e| outsider(ctx, e)).collect();
    if holders.is_empty() {
        "held by a process stowage cannot identify (on another host?)".into()
    } else {
        // Stowage's own processes or not, the kernel cannot say: no
        // "not started by stowage" here.
        phrase_as(
            &format!("held ({}) by ", holders[0].mode.verb()),
            &holders,
            false,
        )
    }
}

/// Who holds the global lock, for the rare message about waiting for it.
/// Read without the global lock, so from the kernel only.
pub fn global_holder_phrase(ctx: &Ctx) -> String {
    let path = ctx.root.global_lock();
    let kv = KernelView::new(&ctx.root.locks());
    let view = kv.view(&path).unwrap_or_default();
    let holders = global_holders(ctx, &view);
    if holders.is_empty() {
        "held by a process stowage cannot identify (on another host, or stopped)".into()
    } else {
        phrase(&holders)
    }
}

/// The global lock's holders, from the kernel's table: there are no records
/// of it. They are almost always stowage itself, in a short transaction.
pub(crate) fn global_holders(ctx: &Ctx, view: &LockView) -> Vec<Party> {
    view.holders
        .iter()
        .map(|e| Party {
            stowage: e.pid.is_some_and(ident::runs_stowage),
            ..outsider(ctx, e)
        })
        .collect()
}
