//! The sweep: at every path of the layout, each of a FIFO, a symlink to a
//! directory outside the root, a directory, a socket, an empty file, an
//! unreadable file and hard links to files outside the root (one empty),
//! planted where stowage keeps its own file or directory; then every
//! command, each bounded. Each must end within 10 s, say at most one line
//! on stderr that names the planted path when it fails, touch nothing
//! outside the root, and lose nothing: once the plant is gone, the ready
//! images are ready and readable. The matrix of what each command did is
//! printed (docs/reliability.md, "The sweep").
//!
//! Run as an unprivileged user where the tests run as root (an unreadable
//! file means nothing to root). Cases run in parallel, each on its own
//! store.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::common::*;

/// The bound on every command of the sweep.
const BOUND: Duration = Duration::from_secs(10);

/// Where stowage keeps a file (`false`) or a directory (`true`), relative
/// to the root. The store has the ready images `base`, `rw` and `old`, the
/// slot class `pull`, and is about to make the image `new`.
const LAYOUT: &[(&str, bool)] = &[
    ("store.conf", false),
    ("stowage.db", false),
    ("stowage.db-journal", false),
    ("stowage.db-wal", false),
    ("stowage.db-shm", false),
    ("reserve", false),
    ("locks/global.lock", false),
    ("locks/store.lock", false),
    ("locks/probe.lock", false),
    ("locks/images/base.lock", false),
    ("locks/images/base.gate", false),
    ("locks/images/new.lock", false),
    ("locks/slots/pull/0.lock", false),
    ("locks/slots/pull/1.lock", false),
    ("locks/slots/pull/changed", false),
    ("locks/leases/planted.lease", false),
    ("locks", true),
    ("locks/images", true),
    ("locks/slots", true),
    ("locks/slots/pull", true),
    ("locks/leases", true),
    ("img", true),
    ("img/new", true),
    ("trash", true),
];

/// Every command, in the order run on one planted store.
const COMMANDS: &[&[&str]] = &[
    &["exec", "--read", "base", "--", "true"],
    &["exec", "--write", "rw", "--", "true"],
    &["exec", "--write", "new", "--", "true"],
    &["rm", "old"],
    &["gc"],
    &["images"],
    &["lock-status"],
    &["slots"],
    &["slots", "set", "pull", "3"],
    &["doctor"],
    &["doctor", "--repair"],
    &["init"],
];

/// What one command did on one planted store.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Ok,
    /// Failed (this exit code) with one line naming the plant.
    Refused(i32),
    /// Broke a rule: why.
    Broke(String),
}

/// The user the commands run as: uid 65534 when we are root.
fn user() -> Option<u32> {
    is_root().then_some(65534)
}

/// `stowage --root ROOT ARGS…` as [`user`], bounded by [`BOUND`]: `Err`
/// if it had to be killed.
fn run(root: &Path, args: &[&str]) -> Result<Output, String> {
    let mut c = match user() {
        Some(uid) => {
            let mut c = Command::new("setpriv");
            c.args([
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
                bin(),
            ]);
            c
        }
        None => Command::new(bin()),
    };
    c.arg("--root").arg(root).args(args);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = c.spawn().map_err(|e| e.to_string())?;
    let until = Instant::now() + BOUND;
    loop {
        if child.try_wait().map_err(|e| e.to_string())?.is_some() {
            return child.wait_with_output().map_err(|e| e.to_string());
        }
        if Instant::now() > until {
            // SAFETY: kill(2) of the process group we made.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let out = child.wait_with_output().map_err(|e| e.to_string())?;
            return Err(format!(
                "did not end within {BOUND:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Gives what the test made to [`user`], so that it is the user's own.
fn own(p: &Path) {
    if let Some(uid) = user() {
        let _ = std::os::unix::fs::lchown(p, Some(uid), Some(uid));
    }
}

/// A store for one case: ready images `base` (its tree says `content`),
/// `rw` and `old`, the slot class `pull`, a catalog; a victim directory
/// outside the root, with files that must stay as they are.
struct Case {
    env: Env,
    victim: PathBuf,
    /// Where the original of the planted path waits to be put back.
    kept: PathBuf,
}

impl Case {
    fn new() -> Case {
        let env = unprivileged_env();
        for (name, script) in [
            ("base", "echo content > \"$STOWAGE_IMAGE_DIR/file\""),
            ("rw", "echo rw > \"$STOWAGE_IMAGE_DIR/file\""),
            ("old", "true"),
        ] {
            let out = run(
                &env.root,
                &["exec", "--write", name, "--", "sh", "-c", script],
            )
            .unwrap();
            assert_eq!(code(&out), Some(0), "{}", show(&out));
        }
        for args in [&["slots", "set", "pull", "2"][..], &["images"]] {
            let out = run(&env.root, args).unwrap();
            assert_eq!(code(&out), Some(0), "{}", show(&out));
        }
        let victim = env.tmp.path().join("victim");
        fs::create_dir(&victim).unwrap();
        fs::write(victim.join("sentinel"), "precious").unwrap();
        fs::write(victim.join("empty"), "").unwrap();
        own(&victim);
        own(&victim.join("sentinel"));
        own(&victim.join("empty"));
        let kept = env.tmp.path().join("kept");
        Case { env, victim, kept }
    }

    /// Plants `plant` at `rel`, keeping what was there; a symlink points
    /// into the victim (at the directory, or at its file).
    fn plant(&self, rel: &str, dir: bool, plant: Plant) {
        let at = self.env.root.join(rel);
        if fs::symlink_metadata(&at).is_ok() && fs::symlink_metadata(&self.kept).is_err() {
            fs::rename(&at, &self.kept).unwrap();
        }
        // The leases directory goes with the last lease: made for the plant.
        let parent = at.parent().unwrap();
        if !parent.exists() {
            fs::create_dir_all(parent).unwrap();
            own(parent);
        }
        let target = if dir {
            self.victim.clone()
        } else {
            self.victim.join("sentinel")
        };
        plant.at(&at, &target);
        own(&at);
    }

    /// What the victim holds: names, sizes, modes and the sentinel's text.
    fn victim_state(&self) -> (Vec<(String, u64, u32)>, String) {
        let mut names: Vec<(String, u64, u32)> = walkdir(&self.victim)
            .iter()
            .map(|p| {
                let m = fs::symlink_metadata(p).unwrap();
                (p.display().to_string(), m.len(), m.mode())
            })
            .collect();
        names.sort();
        let text = fs::read_to_string(self.victim.join("sentinel")).unwrap_or_default();
        (names, text)
    }

    /// Takes away whatever is at `rel` (the plant, or what stowage put in
    /// its place) and puts the original back.
    fn unplant(&self, rel: &str) {
        let at = self.env.root.join(rel);
        if let Ok(m) = fs::symlink_metadata(&at) {
            if m.is_dir() {
                make_removable(&at);
                fs::remove_dir_all(&at).unwrap();
            } else {
                fs::remove_file(&at).unwrap();
            }
        }
        if fs::symlink_metadata(&self.kept).is_ok() {
            fs::rename(&self.kept, &at).unwrap();
        }
    }
}

/// Gives the owner access to every directory under `dir`, so that a tree
/// a command left unreadable can be removed.
fn make_removable(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o700));
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                make_removable(&e.path());
            }
        }
    }
}

/// Whether `text` names `path` itself (not only a path below it).
fn names(text: &str, path: &Path) -> bool {
    let p = path.display().to_string();
    text.match_indices(&p).any(|(i, _)| {
        !text[i + p.len()..]
            .chars()
            .next()
            .is_some_and(|c| c == '/' || c.is_alphanumeric() || c == '.' || c == '-')
    })
}

/// Whether `plant` at `rel` is something stowage itself keeps there: an
/// empty lock file (one emptied for a removal, a record not written yet)
/// or an empty directory. Not hostile by its type: a command that fails
/// on the state it makes (no record: "does not exist") need not name it.
fn legit(rel: &str, dir: bool, plant: Plant) -> bool {
    match plant {
        Plant::Empty => !dir && rel.ends_with(".lock"),
        Plant::Dir => dir,
        _ => false,
    }
}

/// Judges one command's run by the sweep's rules.
fn judge(ran: Result<Output, String>, planted: &Path, legit: bool) -> Outcome {
    let out = match ran {
        Ok(out) => out,
        Err(why) => return Outcome::Broke(why),
    };
    let err = stderr(&out);
    if let Some(sig) = out.status.signal() {
        return Outcome::Broke(format!("killed by signal {sig}: {err}"));
    }
    if err.contains("panicked") || err.contains("RUST_BACKTRACE") {
        return Outcome::Broke(format!("panicked: {err}"));
    }
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    let naming = lines.iter().filter(|l| names(l, planted)).count();
    if naming > 1 {
        return Outcome::Broke(format!("{naming} lines name the plant: {err}"));
    }
    // doctor reports on standard output (exit 1: problems remain).
    let reported = String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.contains("PROBLEM") && names(l, planted));
    match code(&out) {
        Some(0) => Outcome::Ok,
        Some(c) => match lines.last() {
            Some(last) if names(last, planted) => Outcome::Refused(c),
            None if reported => Outcome::Refused(c),
            // A state stowage makes itself, reported as such.
            None if legit && !out.stdout.is_empty() => Outcome::Refused(c),
            Some(_) if legit && lines.len() == 1 => Outcome::Refused(c),
            _ => Outcome::Broke(format!(
                "exit {c} without naming {}: {err}",
                planted.display()
            )),
        },
        None => Outcome::Broke("no exit code".into()),
    }
}

/// What one case came to: each command's outcome, and what broke after
/// them (the victim touched, an image lost).
type Swept = (Vec<Outcome>, Vec<String>);

/// Runs every command on a store with `plant` at `rel`.
fn sweep_one(rel: &str, dir: bool, plant: Plant) -> Swept {
    let case = Case::new();
    let planted = case.env.root.join(rel);
    let before = case.victim_state();
    case.plant(rel, dir, plant);
    let mut outcomes = Vec::new();
    let mut broke = Vec::new();
    for args in COMMANDS {
        // A plant set aside by an earlier command is planted again.
        if fs::symlink_metadata(&planted).is_err() && planted.parent().is_some_and(Path::is_dir) {
            case.plant(rel, dir, plant);
        }
        let legit = legit(rel, dir, plant);
        let ran = run(&case.env.root, args);
        log(rel, plant, args, &ran);
        outcomes.push(judge(ran, &planted, legit));
        if case.victim_state() != before {
            broke.push(format!("{args:?} touched the victim outside the root"));
        }
    }
    case.unplant(rel);
    for (name, text) in [("base", "content\n"), ("rw", "rw\n")] {
        let script = format!("cat \"$STOWAGE_IMAGES_DIR/{name}/file\"");
        match run(
            &case.env.root,
            &["exec", "--read", name, "--", "sh", "-c", &script],
        ) {
            Ok(out) if code(&out) == Some(0) && String::from_utf8_lossy(&out.stdout) == text => {}
            Ok(out) => broke.push(format!(
                "'{name}' is not ready and readable after: {}",
                show(&out)
            )),
            Err(why) => broke.push(format!("reading '{name}' after: {why}")),
        }
    }
    (outcomes, broke)
}

/// Appends what a command said to the file `STOWAGE_SWEEP_LOG` names, if
/// any: every message of the sweep, to read them all.
fn log(rel: &str, plant: Plant, args: &[&str], ran: &Result<Output, String>) {
    let Some(file) = std::env::var_os("STOWAGE_SWEEP_LOG") else {
        return;
    };
    let said = match ran {
        Ok(out) => format!("exit {:?}: {}", code(out), stderr(out).trim_end()),
        Err(why) => why.clone(),
    };
    let line = format!("{rel} {plant:?} {args:?} {said}\n");
    let mut f = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .unwrap();
    std::io::Write::write_all(&mut f, line.as_bytes()).unwrap();
}

/// One cell of the matrix: how many commands ended well, how many refused
/// (naming the plant), and which broke a rule.
fn cell(outcomes: &[Outcome], broke: &[String]) -> String {
    let ok = outcomes.iter().filter(|o| **o == Outcome::Ok).count();
    let refused = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Refused(_)))
        .count();
    let failed = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Broke(_)))
        .count()
        + broke.len();
    if failed > 0 {
        format!("{ok}/{refused}/BROKE {failed}")
    } else {
        format!("{ok}/{refused}")
    }
}

#[test]
fn every_plant_at_every_path_of_the_layout_stops_nothing_for_good() {
    let t0 = Instant::now();
    let cases: Vec<(&str, bool, Plant)> = LAYOUT
        .iter()
        .flat_map(|&(rel, dir)| Plant::ALL.iter().map(move |&p| (rel, dir, p)))
        .collect();
    let next = Mutex::new(cases.iter());
    let results: Mutex<BTreeMap<(usize, usize), Swept>> = Mutex::new(BTreeMap::new());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) * 2;
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let Some(&(rel, dir, plant)) = next.lock().unwrap().next() else {
                        break;
                    };
                    let r = std::panic::catch_unwind(|| sweep_one(rel, dir, plant))
                        .unwrap_or_else(|_| (Vec::new(), vec!["the case itself failed".into()]));
                    let row = LAYOUT.iter().position(|(p, _)| *p == rel).unwrap();
                    let col = Plant::ALL.iter().position(|p| *p == plant).unwrap();
                    results.lock().unwrap().insert((row, col), r);
                }
            });
        }
    });
    let results = results.into_inner().unwrap();
    let mut table = format!(
        "{:<28}{}\n",
        "path",
        Plant::ALL
            .iter()
            .map(|p| format!("{:<16}", format!("{p:?}")))
            .collect::<String>()
    );
    let mut failures = Vec::new();
    for (row, (rel, _)) in LAYOUT.iter().enumerate() {
        table.push_str(&format!("{rel:<28}"));
        for (col, plant) in Plant::ALL.iter().enumerate() {
            let (outcomes, broke) = &results[&(row, col)];
            table.push_str(&format!("{:<16}", cell(outcomes, broke)));
            for (args, o) in COMMANDS.iter().zip(outcomes) {
                if let Outcome::Broke(why) = o {
                    failures.push(format!("{rel} {plant:?} {args:?}: {why}"));
                }
            }
            failures.extend(broke.iter().map(|b| format!("{rel} {plant:?}: {b}")));
        }
        table.push('\n');
    }
    eprintln!(
        "commands that ended 0 / refused naming the plant, of {} per cell ({} cases in {:.1} s):\n{table}",
        COMMANDS.len(),
        cases.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} rule(s) broken:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
