//! `stowage lock-status`: who holds and awaits which lock.
//!
//! - One look (`holders::Look`): the leases, then the kernel's lock table where locks are local,
//!   probes elsewhere; image states from their records. No global lock or catalog is touched.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::IsTerminal;

use anyhow::Result;
use serde::Serialize;

use super::duration::TimeOption;
use crate::clock;
use crate::holders::{LockKind, LockReport, Look, Party};
use crate::ident::printable;
use crate::lock::Probe;
use crate::name::ImageName;
use crate::root::Root;
use crate::store::Store;

#[derive(clap::Args)]
#[command(
    after_help = "Exit status: 0 shown; 66 a named image (or --why's) does not exist, no process\n\
    has --why's PID, or the root does not exist; 64 bad usage or name (--why 0: no pid is 0);\n\
    69 locking does not work here; 1 other failures."
)]
pub struct Args {
    /// Show these images' locks even when free
    #[arg(value_name = "IMG")]
    images: Vec<OsString>,
    /// Show every image's lock
    #[arg(long)]
    all: bool,
    /// Print one JSON object (with --watch, one per line)
    #[arg(long)]
    json: bool,
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true, help = concat!(
        "Refresh every SECONDS (fractional, or with a unit of ", time_units!(),
        ": 1, 500ms) until interrupted"))]
    watch: Option<String>,
    /// Why IMG's waiters (or process PID) wait: the chain of waits to the
    /// process at its end, or the cycle they are caught in, and what to end
    /// (a number is a pid: an image named by digits is asked for by a waiter's pid)
    #[arg(long, value_name = "IMG|PID", allow_hyphen_values = true,
        conflicts_with_all = ["watch", "all", "images"])]
    why: Option<OsString>,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    if let Some(target) = &args.why {
        return super::why::run(store, target, args.json);
    }
    let sel = Selection {
        names: super::names(&args.images)?,
        all: args.all,
    };
    let every = (args.watch.as_deref())
        .map(|raw| TimeOption::Watch.parse(raw))
        .transpose()?;
    store.require_root()?;
    // Something planted in a lock directory's place is not "nothing held".
    store.root().check_lock_dirs(|line| store.ctx().say(line))?;
    let tty = std::io::stdout().is_terminal();
    let mut missing_any = false;
    let mut unknown_said: Vec<String> = Vec::new();
    loop {
        let root = store.root();
        let fs = root.filesystem_now().map_or("unknown".into(), |f| f.name);
        let look = Look::new(store.ctx());
        let mut locks = reports(&look, root, &sel)?;
        look.clean_leases();
        // A named image with no row whose lock nobody holds or awaits does not exist: not free.
        let missing: Vec<String> = locks
            .iter()
            .filter(|l| {
                l.kind == LockKind::Image
                    && l.image_state.is_none()
                    && l.image_unknown.is_none()
                    && l.holders.is_empty()
                    && l.waiters.is_empty()
                    && sel.names.iter().any(|n| n.as_str() == l.name)
            })
            .map(|l| l.name.clone())
            .collect();
        locks.retain(|l| !(l.kind == LockKind::Image && missing.contains(&l.name)));
        // Said once, however often --watch redraws.
        if !missing.is_empty() && !missing_any {
            for name in &missing {
                complain!("stowage: image '{name}' does not exist");
            }
            missing_any = true;
        }
        for l in &locks {
            if let Some(why) = &l.image_unknown
                && !unknown_said.contains(&l.name)
            {
                complain!("stowage: image '{}': its state is not known: {why}", l.name);
                unknown_said.push(l.name.clone());
            }
        }
        let text = if args.json {
            let doc = StatusJson {
                root: store.root().dir().display().to_string(),
                filesystem: fs,
                locks: &locks,
            };
            super::json_text(&doc, every.is_none())?
        } else {
            render(store.root().dir(), &fs, &locks)
        };
        match every {
            Some(_) if tty && !args.json => super::print(&format!("\x1b[H\x1b[2J{text}"))?,
            _ => super::print(&format!("{}\n", text.trim_end()))?,
        }
        match every {
            Some(d) => std::thread::sleep(d),
            None if missing_any => return Ok(crate::error::code::NO_INPUT),
            None => return Ok(0),
        }
    }
}

fn render(root: &std::path::Path, fs: &str, locks: &[LockReport]) -> String {
    let mut rows = vec![["LOCK", "KIND", "STATE", "HOLDERS AND WAITERS"].map(String::from)];
    for l in locks {
        let state = match (l.image_state, &l.image_unknown) {
            (Some(s), _) => format!("{} ({s})", state_str(l.state)),
            (None, Some(_)) => format!("{} (unknown)", state_str(l.state)),
            (None, None) => state_str(l.state).to_owned(),
        };
        let name = if l.kind == LockKind::Slot && l.slot.is_none() {
            format!("{} (removed)", l.name)
        } else {
            l.name.clone()
        };
        let held = l.holders.iter().map(|p| {
            let or = crate::holders::unverifiable(p)
                .then_some(" [or the command it ran, if that exec has ended: not seen from here]");
            format!("held: {}{}", party(p), or.unwrap_or_default())
        });
        let waiting = l.waiters.iter().map(|p| format!("waiting: {}", party(p)));
        let queued = l.queued.iter().map(|p| format!("queued: {}", party(p)));
        let mut who = held.chain(waiting).chain(queued);
        let first = who.next().unwrap_or_default();
        let kind = format!("{:?}", l.kind).to_lowercase();
        rows.push([name, kind, state, first]);
        rows.extend(who.map(|more| [String::new(), String::new(), String::new(), more]));
    }
    let root = root.display().to_string();
    format!("root {} ({fs})\n{}", printable(&root), super::table(&rows))
}

fn party(p: &Party) -> String {
    let mut s = crate::holders::pid_on(p, "unknown process", None, true);
    if let Some(u) = &p.user {
        s.push_str(&format!(" by {}", printable(u)));
    }
    let mode = if p.reading {
        "exclusive read"
    } else {
        p.mode.as_str()
    };
    s.push_str(&format!(" ({mode})"));
    if let Some(c) = &p.command {
        s.push_str(&format!(": {}", printable(c)));
    }
    if let Some(t) = p.since {
        let (at, ago) = (clock::local_short(t), clock::ago(t));
        s.push_str(&format!(" since {at} ({ago} ago)"));
    }
    // A stopped party keeps its lock (or its place ahead of new readers) until it goes on.
    match crate::holders::stopped(p) {
        Some(crate::holders::Stopped::BySignal) => s.push_str(" [stopped]"),
        Some(crate::holders::Stopped::ByTracer) => s.push_str(" [stopped by its tracer]"),
        None => {}
    }
    match p.stowage {
        _ if p.kept => s.push_str(" [kept it after the exec that took it ended]"),
        Some(true) => {}
        Some(false) => s.push_str(" [outside stowage]"),
        None => s.push_str(" [outside stowage, or on another host]"),
    }
    s
}

#[derive(Debug, Serialize)]
struct StatusJson<'a> {
    root: String,
    filesystem: String,
    locks: &'a [LockReport],
}

/// As JSON: kind, name, an image's state (null: no record, or one that cannot be read), a slot class's limit, reserve and slots in use (null
/// once the class is removed while held), then state, holders, waiters and (images) queued waiters.
impl Serialize for LockReport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut m = s.serialize_struct("LockReport", 10)?;
        m.serialize_field("kind", &self.kind)?;
        m.serialize_field("name", &self.name)?;
        // Every image entry has it, null where no record says (a lock file taken from outside).
        if self.kind == LockKind::Image {
            m.serialize_field("image_state", &self.image_state.map(|st| st.as_str()))?;
        }
        if self.kind == LockKind::Slot {
            m.serialize_field("limit", &self.slot.map(|s| s.0))?;
            m.serialize_field("reserve_high", &self.slot.map(|s| s.1))?;
            // A removed class's holders are still counted.
            let in_use = self.slot.map_or(self.holders.len() as u32, |s| s.2);
            m.serialize_field("in_use", &in_use)?;
        }
        m.serialize_field("state", state_str(self.state))?;
        m.serialize_field("holders", &self.holders)?;
        m.serialize_field("waiters", &self.waiters)?;
        if self.kind == LockKind::Image {
            m.serialize_field("queued", &self.queued)?;
        }
        m.end()
    }
}

fn state_str(p: Probe) -> &'static str {
    match p {
        Probe::Missing | Probe::Free => "free",
        Probe::Shared => "shared",
        Probe::Exclusive => "exclusive",
    }
}

/// Which image locks lock-status shows.
#[derive(Debug, Default)]
pub struct Selection {
    /// Named images (shown whatever their state).
    pub names: Vec<ImageName>,
    pub all: bool,
}

/// Every report lock-status shows, from one look: the kernel, leases and records alone.
pub fn reports(look: &Look, root: &Root, sel: &Selection) -> Result<Vec<LockReport>> {
    // First: a slot class a later release wrote refuses the look before any other is made.
    let slots = crate::slots::reports(look, root)?;
    let mut locks = vec![look.global_report()];
    crate::debug::pause("status-table-read");
    let files = image_lock_files(look, root, sel)?;
    locks.extend(image_reports(look, root, sel, files));
    let r = look.report(LockKind::Global, "store", &root.store_wide_lock());
    if r.state != Probe::Free || !r.waiters.is_empty() {
        locks.push(r);
    }
    // Only gc takes it, naming it in its lease: looked at only then.
    if look.leased_lockfiles().any(|rel| rel == Root::GC_LOCK_REL) {
        let r = look.report(LockKind::Global, "gc", &root.gc_lock());
        if r.state != Probe::Free || !r.waiters.is_empty() {
            locks.push(r);
        }
    }
    locks.extend(slots);
    Ok(locks)
}

/// Image lock files by file name, with the name asked for, if any.
type Files = BTreeMap<String, Option<String>>;

/// The image lock files to look at: leased, held by outsiders, selected (every one with --all).
fn image_lock_files(look: &Look, root: &Root, sel: &Selection) -> Result<Files> {
    let mut files: Files = look
        .leased_lockfiles()
        .filter_map(|rel| rel.strip_prefix("images/"))
        .filter(|f| f.ends_with(".lock"))
        .map(|f| (f.to_owned(), None))
        .collect();
    let outsiders = outsider_files(look, root).into_iter().flatten();
    files.extend(outsiders.map(|f| (f, None)));
    for n in &sel.names {
        let file = crate::root::lock_file_name(n.encoded());
        files.insert(file, Some(n.as_str().to_owned()));
    }
    if sel.all {
        for e in crate::census::take(root)? {
            files.entry(e.file.clone()).or_insert(None);
        }
    }
    Ok(files)
}

/// The reports shown, by image name: the selected, and every busy lock unless images were named.
fn image_reports(look: &Look, root: &Root, sel: &Selection, files: Files) -> Vec<LockReport> {
    // Locks held that no lease lists yet are looked at again together, once their holders have
    // had their moment to list them: one wait, not one a lock.
    let deferring = look.deferring(true);
    let mut reports: Vec<(String, Option<String>, (LockReport, bool))> = files
        .into_iter()
        .map(|(file, asked)| {
            let r = image_report(look, root, &file, asked.clone());
            (file, asked, r)
        })
        .collect();
    let unlisted = |r: &LockReport| deferring && r.holders.iter().any(|p| p.lease.is_none());
    if reports.iter().any(|(_, _, (r, _))| unlisted(r)) {
        look.wait_for_listing();
        for (file, asked, r) in reports.iter_mut().filter(|(_, _, (r, _))| unlisted(r)) {
            *r = image_report(look, root, file, asked.clone());
        }
    }
    look.deferring(false);
    let mut images = Vec::new();
    // A file asked for is a named image's: shown whatever its state.
    for (_, asked, (r, recorded)) in reports {
        let busy = r.state != Probe::Free || !r.waiters.is_empty() || !r.queued.is_empty();
        // Every image with --all: not a free lock file whose record its image's removal emptied
        // (kept where lock files are never unlinked), which names none.
        if (sel.all && (busy || recorded)) || asked.is_some() || (busy && sel.names.is_empty()) {
            images.push(r);
        }
    }
    images.sort_by(|a, b| a.name.cmp(&b.name));
    images
}

/// An image lock file's report, named by its record, else as asked, else by its decoded file name;
/// with whether the file holds a record (readable or not).
fn image_report(look: &Look, root: &Root, file: &str, asked: Option<String>) -> (LockReport, bool) {
    let path = root.image_locks().join(file);
    // A file that cannot be opened or read (no permission, an I/O error) may hold a record: its
    // image's state is unknown, as the census takes it, never "no such image"; so is one with
    // something planted in its place while its image's tree is there. Without a tree it holds none.
    let (opened, unread) = match crate::lock::open_existing_read(&path) {
        Ok(f) => (f, None),
        Err(e) if crate::planted::find(&e).is_some() && !crate::census::tree_there(root, file) => {
            (None, None)
        }
        Err(e) => (None, Some(e)),
    };
    let read = || {
        let seen = crate::image_record::read(opened.as_ref()?).ok()?;
        Some(seen.of(|n| crate::root::is_lock_file_of(file, n)))
    };
    let unread = unread.or_else(|| {
        let f = opened.as_ref()?;
        crate::image_record::read(f).err()
    });
    let seen = match &unread {
        Some(_) => crate::image_record::Seen {
            damaged: true,
            ..Default::default()
        },
        None => read().unwrap_or_default(),
    };
    let name = seen
        .record
        .as_ref()
        .map(|r| r.name.clone())
        .or(asked)
        .or_else(|| Root::image_of_lock_file(file).map(|n| n.as_str().to_owned()))
        .unwrap_or_else(|| file.to_owned());
    let mut r = look.report(LockKind::Image, &name, &path);
    // Whether a record in flight has its writer is asked of the lock after the record was read:
    // the report's state may come of a lock table read before it, older than a writer begun since.
    let probe =
        || crate::lock::look(&path, root.lock_queries()).is_ok_and(|p| p == Probe::Exclusive);
    let (seen, alive) = crate::census::writer_judged(seen, read, probe);
    // A writer begun after the table was read holds it now: the state said is the later one.
    if alive && r.state == Probe::Free {
        r.state = Probe::Exclusive;
    }
    // A later release's record: no state of this release's is true of it, whatever the older slot
    // says (unknown, as for damage).
    let record = seen.record.as_ref().filter(|_| seen.newer.is_none());
    r.image_state = record.map(|rec| rec.state_seen(alive));
    r.image_unknown = unknown_why(&seen, unread.as_ref());
    (r, !seen.unrecorded())
}

/// Why an image's state is not known, if it is not: its record could not be read (`unread`: the
/// error), is damaged, or is of a later format.
fn unknown_why(
    seen: &crate::image_record::Seen,
    unread: Option<&std::io::Error>,
) -> Option<String> {
    if let Some(e) = unread.filter(|e| crate::planted::find(e).is_some()) {
        return Some(e.to_string());
    }
    if let Some(e) = unread {
        return Some(format!("its record cannot be read: {e}"));
    }
    if let Some(n) = seen.newer {
        return Some(format!(
            "its record is of a later format ({n}): a newer stowage's image"
        ));
    }
    (seen.record.is_none() && seen.damaged && !seen.legacy)
        .then(|| "its record cannot be read: it is damaged".to_owned())
}

/// Image lock files someone holds that no lease explains (flock(1) in a script), by inode in the
/// lock table: `locks/images/` is listed only then.
fn outsider_files(look: &Look, root: &Root) -> Option<Vec<String>> {
    let inodes = look.unexplained().filter(|i| !i.is_empty())?;
    let dir = root.open_sub(Root::IMAGE_LOCKS_REL).ok()?;
    let listed = dir.listing().unwrap_or_default().into_iter();
    let held = listed.filter(|e| inodes.contains(&e.ino));
    let names = held.filter_map(|e| e.name.into_string().ok());
    Some(names.filter(|n| n.ends_with(".lock")).collect())
}
