//! `stowage lock-status --why IMG|PID`: the chain of waits from a waiter to the process at its
//! end, or the cycle it is caught in (`wait_chain.rs`), from one look.

use std::ffi::OsStr;

use anyhow::Result;
use serde::Serialize;

use super::lock_status::Selection;
use crate::holders::{LockKind, LockReport, Look, Party};
use crate::name::ImageName;
use crate::store::Store;
use crate::wait_chain::{self, Chain, Graph};

/// What `--why` was given; as JSON, `{"image": NAME}` or `{"pid": PID}`.
#[derive(Serialize)]
#[serde(rename_all = "lowercase")]
enum Target {
    Image(#[serde(serialize_with = "name_json")] ImageName),
    Pid(u32),
}

fn name_json<S: serde::Serializer>(name: &ImageName, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(name.as_str())
}

pub fn run(store: &mut Store, raw: &OsStr, json: bool) -> Result<u8> {
    let target = target(raw)?;
    // The root first: a mistyped one is what a pid asked of it would otherwise be blamed for.
    store.require_root()?;
    // A pid no process has would get "waits for no lock", as if it were one that waits for none.
    if let Target::Pid(pid) = target
        && !crate::ident::process_exists(pid)
    {
        return Err(crate::Error::NoSuchProcess(pid).into());
    }
    let root = store.root().clone();
    let look = Look::new(store.ctx());
    // Every lock held or awaited (a chain goes where it goes) and the one asked, even if free.
    let mut reports = super::lock_status::reports(&look, &root, &Selection::default())?;
    if let Target::Image(n) = &target
        && !reports.iter().any(|r| is_image(r, n))
    {
        let sel = Selection {
            names: vec![n.clone()],
            all: false,
        };
        let more = super::lock_status::reports(&look, &root, &sel)?;
        reports.extend(more.into_iter().filter(|r| is_image(r, n)));
    }
    let graph = Graph::new(&look, &store.ctx().me.host, &reports);
    let starts: Vec<Party> = match &target {
        Target::Image(n) => graph.waiters_of_image(n.as_str()),
        Target::Pid(pid) => graph.waiter_for_pid(*pid, &reports).into_iter().collect(),
    };
    let chains: Vec<Chain> = starts.iter().flat_map(|s| graph.chains(s)).collect();
    let image = |n: &ImageName| reports.iter().find(|r| is_image(r, n));
    if let Target::Image(n) = &target
        && chains.is_empty()
        && image(n).is_none_or(|r| {
            r.image_state.is_none() && r.image_unknown.is_none() && r.holders.is_empty()
        })
    {
        return Err(crate::Error::NoSuchImage(vec![n.as_str().to_owned()]).into());
    }
    if json {
        let doc = WhyJson {
            root: root.dir().display().to_string(),
            target: &target,
            chains: &chains,
        };
        return super::print_json(&doc).map(|()| 0);
    }
    let text = if chains.is_empty() {
        nothing_waits(&target, &reports)
    } else {
        chains
            .iter()
            .map(wait_chain::render)
            .collect::<Vec<_>>()
            .join("\n")
    };
    super::print(&text).map(|()| 0)
}

/// A number is a pid (an image named so is asked for by its waiters' pids); anything else an image.
fn target(raw: &OsStr) -> Result<Target> {
    let text = raw.to_str().unwrap_or_default();
    let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        let name = ImageName::parse_os(raw).map_err(crate::Error::from)?;
        return Ok(Target::Image(name));
    }
    // 0 and negative numbers name process groups to kill(2), never a process.
    match text.parse::<i32>() {
        Ok(pid) if pid > 0 => Ok(Target::Pid(pid as u32)),
        _ => super::usage(format!(
            "--why '{text}': a number is a pid, and a pid is from 1 to {}",
            i32::MAX
        )),
    }
}

fn is_image(r: &LockReport, n: &ImageName) -> bool {
    r.kind == LockKind::Image && r.name == n.as_str()
}

/// The answer when no chain starts at the target: nobody waits for the image, or the process
/// waits for no lock.
fn nothing_waits(target: &Target, reports: &[LockReport]) -> String {
    match target {
        Target::Image(n) => format!(
            "nobody waits for image '{n}'{}\n",
            (reports.iter().find(|r| is_image(r, n)))
                .and_then(|r| r.holders.first())
                .map(|h| format!(" (held by {})", wait_chain::who(h)))
                .unwrap_or_default()
        ),
        Target::Pid(p) => format!(
            "pid {p} waits for no lock, and nothing it runs does (of those this host's leases and lock table show)\n"
        ),
    }
}

#[derive(Serialize)]
struct WhyJson<'a> {
    root: String,
    target: &'a Target,
    chains: &'a [Chain],
}

/// As JSON: its steps, whether a cycle, the index of the step the cycle returns to, the pid to end
/// (the chain's last process, or the cycle's newest), and the advice.
impl Serialize for Chain {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut m = s.serialize_struct("Chain", 5)?;
        m.serialize_field("steps", &self.steps)?;
        m.serialize_field("cycle", &self.cycle.is_some())?;
        m.serialize_field("cycle_from", &self.cycle.map(|(from, _)| from))?;
        m.serialize_field("end_pid", &wait_chain::to_end(self).pid)?;
        m.serialize_field("advice", &wait_chain::advice(self))?;
        m.end()
    }
}
