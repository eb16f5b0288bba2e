//! A randomized torture run against a real directory, with an independent
//! checker.
//!
//! Several workers run random operations — writes (some cloning a base,
//! some taking a slot, some failing on purpose), reads, rm, gc, lock-status,
//! doctor, store-wide commands (some deleting an image's tree) — on random
//! sets of images in random order, while a killer
//! SIGKILLs stowage processes, or whole process groups (stowage and its
//! command), at random moments. The commands themselves detect what must
//! never happen: two writers in one image, a read while a writer is at
//! work, a ready image with torn content (or none: a deleted one read), an
//! image used beside a store-wide command. Afterwards the checker verifies,
//! independently of stowage's own view: no violation was seen, every ready
//! image has complete content, `doctor --repair` then `doctor` is clean, no
//! lock on the store's files is held, no process is left.
//!
//! Duration and seed: `STOWAGE_STRESS_SECS` (default 20), `STOWAGE_STRESS_SEED`
//! (default random, printed), `STOWAGE_STRESS_WORKERS` (default 6). The script
//! `scripts/stress` runs it for minutes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;

const POOL: [&str; 8] = [
    "base", "tools:1", "team/app", "app:2", "x", "y.z", "lib/a", "lib/b",
];
const FILES: usize = 8;

/// The shell functions the commands run. `w DIR TOKEN` writes an image
/// (detecting another live writer), `r DIR` checks one (detecting a live
/// writer and torn content). Violations are appended to $V.
const LIB: &str = r#"
# A process is identified by pid and start time: pids are reused quickly
# (pid_max may be 32768), so a pid alone could name somebody else. A process
# killed by SIGKILL releases its locks when it closes its files, before it
# is a zombie (it may show running for milliseconds after, longer under
# load): one with no open file can write nothing more, and counts as gone.
started() { read -r l < "/proc/$1/stat" 2>/dev/null || return 1; l=${l##*) }; set -- $l; [ "$1" = Z ] && return 1; eval "echo \${20}"; }
has_files() { for f in /proc/$1/fd/*; do [ -L "$f" ] && return 0; done; return 1; }
alive() { [ -n "$1" ] && [ "$(started "$1")" = "$2" ] && has_files "$1"; }
# What a violation's message says of the other process.
files() { n=0; for f in /proc/$1/fd/*; do [ -L "$f" ] && n=$((n+1)); done; read -r l < "/proc/$1/stat" 2>/dev/null; l=${l##*) }; echo "[state ${l%% *}, $n open files]"; }
# A store-wide command's own command marks $V.sw while it runs; no image
# user may run beside it.
beside() { if [ -e "$V.sw" ]; then read -r p s < "$V.sw" 2>/dev/null && alive "$p" "$s" && echo "$1 of $2 beside store-wide command $p $(files $p)" >> "$V"; fi; return 0; }
# A tree a store-wide command deleted may stay listed ready if its stowage
# is killed before it ends the hold (which forgets such rows; so do the
# next hold and doctor --repair): reads of it find no tree, and that is no
# violation. A tree that is there must be whole: the command deletes it as
# a careful builder does, moving it out in one rename before deleting it
# (an `rm -rf` in place, killed after its first file, leaves a tree that
# no lock manager can tell from a whole one).
sw() {
  echo "$$ $(started $$)" > "$V.sw"
  sleep 0.0$((TOKEN % 5 + 1))
  if [ -n "$DELETE" ]; then
    : > "$V.gone.$DELETE"
    mv "$STOWAGE_IMAGES_DIR/$DELETE" "$V.deleted.$$" 2>/dev/null && rm -rf "$V.deleted.$$"
  fi
  rm -f "$V.sw"
}
w() {
  d=$1
  beside write "$d"
  if [ -e "$d/.writer" ]; then read -r p s < "$d/.writer"; alive "$p" "$s" && echo "two writers in $d ($p and $$) $(files $p)" >> "$V"; fi
  echo "$$ $(started $$)" > "$d/.writer"
  i=1
  while [ $i -le 8 ]; do
    echo "$TOKEN" > "$d/f$i"
    [ $((i % 3)) = 0 ] && sleep 0.003
    [ "$FAIL" = $i ] && exit 3
    i=$((i+1))
  done
  echo "$TOKEN" > "$d/MANIFEST"
  rm -f "$d/.writer"
  beside write "$d"
}
r() {
  d=$1
  beside read "$d"
  [ ! -e "$d" ] && [ -e "$V.gone.${d##*/}" ] && return 0
  if [ -e "$d/.writer" ]; then read -r p s < "$d/.writer"; alive "$p" "$s" && echo "read of $d while writer $p works $(files $p)" >> "$V"; fi
  if ! read -r m < "$d/MANIFEST"; then echo "ready image $d has no manifest" >> "$V"; return; fi
  for i in 1 2 3 4 5 6 7 8; do
    read -r v < "$d/f$i" || v=missing
    [ "$v" = "$m" ] || echo "torn read of $d: f$i=$v manifest=$m" >> "$V"
  done
  beside read "$d"
}
"#;

struct Shared {
    env_root: PathBuf,
    violations: PathBuf,
    running: Mutex<HashSet<u32>>,
    groups: Mutex<Vec<i32>>,
    stop: AtomicBool,
    kills: AtomicU64,
    ops: Mutex<BTreeMap<String, u64>>,
    outcomes: Mutex<BTreeMap<String, u64>>,
    unexpected: Mutex<Vec<String>>,
}

impl Shared {
    fn count(map: &Mutex<BTreeMap<String, u64>>, key: String) {
        *map.lock().unwrap().entry(key).or_default() += 1;
    }
}

fn enc(name: &str) -> String {
    name.replace('/', "%").replace(':', "+")
}

/// One random operation: the stowage arguments, the exit codes that are
/// fine for it (besides death by the killer), and the command's environment.
struct Op {
    kind: String,
    args: Vec<String>,
    fine: Vec<i32>,
    envs: Vec<(String, String)>,
}

fn op(kind: &str, args: Vec<String>, fine: &[i32], envs: Vec<(String, String)>) -> Op {
    Op {
        kind: kind.into(),
        args,
        fine: fine.to_vec(),
        envs,
    }
}

fn pick(rng: &mut fastrand::Rng, token: u64) -> Op {
    let mut names: Vec<&str> = POOL.to_vec();
    rng.shuffle(&mut names);
    let roll = rng.u32(0..100);
    let mut args: Vec<String> = Vec::new();
    let mut envs = Vec::new();
    let wait_flags = |rng: &mut fastrand::Rng, args: &mut Vec<String>| match rng.u32(0..4) {
        0 => args.push("--no-wait".into()),
        1 => args.extend(["--wait".into(), format!("0.{}", rng.u32(1..9))]),
        _ => {}
    };
    if roll < 40 {
        let writes = &names[..1 + rng.usize(0..2)];
        let reads = &names[writes.len()..writes.len() + rng.usize(0..3)];
        args.push("exec".into());
        let mut body = String::new();
        for w in writes {
            args.extend(["--write".into(), (*w).into()]);
            body.push_str(&format!("w \"$STOWAGE_IMAGES_DIR/{}\"; ", enc(w)));
        }
        for r in reads {
            args.extend(["--read".into(), (*r).into()]);
            body.push_str(&format!("r \"$STOWAGE_IMAGES_DIR/{}\"; ", enc(r)));
        }
        if writes.len() == 1 && !reads.is_empty() && rng.u32(0..4) == 0 {
            args.extend(["--from".into(), reads[0].into()]);
        }
        if rng.u32(0..5) == 0 {
            args.extend(["--slot".into(), "pull".into()]);
            if rng.bool() {
                args.extend(["--priority".into(), "high".into()]);
            }
        }
        wait_flags(rng, &mut args);
        envs.push(("TOKEN".into(), token.to_string()));
        if rng.u32(0..10) == 0 {
            envs.push(("FAIL".into(), rng.u32(1..9).to_string()));
        }
        if rng.u32(0..4) == 0 {
            // The writer runs in a background process of the command: with
            // --no-inherit, nothing of the command's tree may outlive the
            // locks (a SIGKILL of stowage alone included).
            args.extend([
                "--no-inherit".into(),
                "--".into(),
                "sh".into(),
                "-c".into(),
                "sh -c \"$1\" & wait $!".into(),
                "_".into(),
                format!("{LIB}\n{body}"),
            ]);
        } else {
            args.extend([
                "--".into(),
                "sh".into(),
                "-c".into(),
                format!("{LIB}\n{body}"),
            ]);
        }
        op("write", args, &[0, 3, 66, 75], envs)
    } else if roll < 75 {
        let reads = &names[..1 + rng.usize(0..3)];
        args.push("exec".into());
        let mut body = String::new();
        for r in reads {
            args.extend(["--read".into(), (*r).into()]);
            body.push_str(&format!("r \"$STOWAGE_IMAGES_DIR/{}\"; ", enc(r)));
        }
        wait_flags(rng, &mut args);
        args.extend([
            "--".into(),
            "sh".into(),
            "-c".into(),
            format!("{LIB}\n{body}"),
        ]);
        op("read", args, &[0, 66, 75], envs)
    } else if roll < 83 {
        args.extend(["rm".into(), names[0].into()]);
        wait_flags(rng, &mut args);
        op("rm", args, &[0, 66, 75], envs)
    } else if roll < 88 {
        args.push("gc".into());
        match rng.u32(0..3) {
            0 => args.extend(["--max-size".into(), "60K".into()]),
            1 => args.extend(["--unused-for".into(), "2s".into()]),
            _ => {}
        }
        op("gc", args, &[0], envs)
    } else if roll < 95 {
        let what = if rng.bool() { "lock-status" } else { "images" };
        args.extend([what.into(), "--json".into()]);
        op(what, args, &[0], envs)
    } else if roll < 97 {
        // A store-wide command (as `ch-image build-cache --reset`), which
        // sometimes deletes an image's tree: no image user may run beside
        // it, and a deleted image must never be read again.
        args.extend(["exec".into(), "--store-wide".into()]);
        wait_flags(rng, &mut args);
        args.extend(["--".into(), "sh".into(), "-c".into(), format!("{LIB}\nsw")]);
        envs.push(("TOKEN".into(), token.to_string()));
        if rng.u32(0..3) == 0 {
            envs.push(("DELETE".into(), enc(names[0])));
        }
        op("store-wide", args, &[0, 75], envs)
    } else {
        args.push("doctor".into());
        op("doctor", args, &[0, 1], envs)
    }
}

fn worker(shared: Arc<Shared>, seed: u64, id: u64) {
    let mut rng =
        fastrand::Rng::with_seed(seed.wrapping_add(id.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    let mut token = id << 40;
    while !shared.stop.load(Ordering::Relaxed) {
        token += 1;
        let Op {
            kind,
            args,
            fine,
            envs,
        } = pick(&mut rng, token);
        let mut c = Command::new(bin());
        c.arg("--root").arg(&shared.env_root).arg("-q").args(&args);
        c.env("V", &shared.violations).envs(envs);
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c.process_group(0);
        let child = c.spawn().expect("spawn stowage");
        let pid = child.id();
        shared.groups.lock().unwrap().push(pid as i32);
        shared.running.lock().unwrap().insert(pid);
        let out = child.wait_with_output().expect("wait");
        shared.running.lock().unwrap().remove(&pid);
        Shared::count(&shared.ops, kind.clone());
        let code = out.status.code();
        let outcome = match (code, out.status.signal()) {
            (Some(c), _) => format!("exit {c}"),
            (None, Some(s)) => format!("signal {s}"),
            _ => "?".into(),
        };
        Shared::count(&shared.outcomes, outcome);
        let killed = out.status.signal() == Some(libc::SIGKILL);
        // A command killed by the killer reports 137 through a live stowage.
        let ok = killed || code.is_some_and(|c| fine.contains(&c) || c == 137);
        // A store-wide command's stowage killed after its command deleted a
        // tree leaves that image listed ready until the next hold ends or
        // doctor --repair (docs/reliability.md): a copy from it finds no
        // tree and fails, saying so. Expected for a base marked gone.
        let from_gone = code == Some(1)
            && String::from_utf8_lossy(&out.stderr).contains("cannot copy it")
            && args
                .iter()
                .position(|a| a == "--from")
                .and_then(|i| args.get(i + 1))
                .is_some_and(|base| {
                    let mut gone = shared.violations.clone().into_os_string();
                    gone.push(format!(".gone.{}", enc(base)));
                    std::path::Path::new(&gone).exists()
                });
        if !ok && !from_gone {
            shared.unexpected.lock().unwrap().push(format!(
                "{kind} {args:?} -> {:?}: {}",
                code,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        if (kind == "lock-status" || kind == "images")
            && code == Some(0)
            && serde_json::from_slice::<serde_json::Value>(&out.stdout).is_err()
        {
            shared
                .unexpected
                .lock()
                .unwrap()
                .push(format!("{kind} printed invalid JSON"));
        }
    }
}

fn killer(shared: Arc<Shared>, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5bd1_e995);
    while !shared.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(rng.u64(20..250)));
        let victims: Vec<u32> = shared.running.lock().unwrap().iter().copied().collect();
        if victims.is_empty() {
            continue;
        }
        let pid = victims[rng.usize(0..victims.len())] as i32;
        // Stowage alone (its command keeps the inherited locks), or stowage
        // together with its command.
        let target = if rng.bool() { pid } else { -pid };
        if unsafe { libc::kill(target, libc::SIGKILL) } == 0 {
            shared.kills.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Reads an image the way the commands do; None if consistent.
fn torn(dir: &Path) -> Option<String> {
    let manifest = fs::read_to_string(dir.join("MANIFEST")).ok()?;
    for i in 1..=FILES {
        let v = fs::read_to_string(dir.join(format!("f{i}"))).unwrap_or_default();
        if v != manifest {
            return Some(format!(
                "{}: f{i} is {v:?}, manifest {manifest:?}",
                dir.display()
            ));
        }
    }
    None
}

#[test]
fn torture() {
    let secs = env_num("STOWAGE_STRESS_SECS", 20);
    let seed = env_num("STOWAGE_STRESS_SEED", fastrand::u64(..));
    let workers = env_num("STOWAGE_STRESS_WORKERS", 6);
    eprintln!("stress: {secs} s, {workers} workers, seed {seed}");
    let env = Env::new();
    let violations = env.scratch.join("violations");
    env.ok(["slots", "set", "pull", "1", "--reserve-high", "1"]);
    for name in POOL {
        let mut c = env.cmd([
            "exec",
            "--write",
            name,
            "--",
            "sh",
            "-c",
            &format!("{LIB}\nw \"$STOWAGE_IMAGE_DIR\""),
        ]);
        c.env("V", &violations).env("TOKEN", "0");
        assert_eq!(output(c).status.code(), Some(0));
    }

    let shared = Arc::new(Shared {
        env_root: env.root.clone(),
        violations: violations.clone(),
        running: Mutex::new(HashSet::new()),
        groups: Mutex::new(Vec::new()),
        stop: AtomicBool::new(false),
        kills: AtomicU64::new(0),
        ops: Mutex::new(BTreeMap::new()),
        outcomes: Mutex::new(BTreeMap::new()),
        unexpected: Mutex::new(Vec::new()),
    });
    let t0 = Instant::now();
    let mut threads: Vec<_> = (0..workers)
        .map(|id| {
            let s = Arc::clone(&shared);
            std::thread::spawn(move || worker(s, seed, id))
        })
        .collect();
    let s = Arc::clone(&shared);
    threads.push(std::thread::spawn(move || killer(s, seed)));
    std::thread::sleep(Duration::from_secs(secs)); // the run's length
    shared.stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    let ran = t0.elapsed();

    // No process is left: orphaned commands of killed stowages finish on
    // their own (they are short), bounded.
    let groups = shared.groups.lock().unwrap().clone();
    // On a timeout, say who is left and where each waits in the kernel, so
    // that a rare hang can be diagnosed from the log of one run.
    // A recorded group id outlives its processes and may be reused by an
    // unrelated process that leads a group of its own (pid reuse): only
    // members that belong to this run count — a stowage of this root, or a
    // command whose environment names it.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let left = left_in_groups(&groups, &env.root);
        if left.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            panic!("processes of the run still alive after {PATIENCE:?}:\n{left}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }

    // No lock on the store's files is held.
    let mut inodes = HashSet::new();
    for e in walkdir_files(&env.root.join("locks")) {
        if let Ok(m) = fs::metadata(&e) {
            inodes.insert(m.ino());
        }
    }
    let held: Vec<String> = fs::read_to_string("/proc/locks")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .find(|f| f.matches(':').count() == 2)
                .and_then(|f| f.rsplit(':').next())
                .and_then(|i| i.parse::<u64>().ok())
                .is_some_and(|i| inodes.contains(&i))
        })
        .map(str::to_owned)
        .collect();

    // Repair, then a clean bill of health.
    let repair = env.run(["doctor", "--repair"]);
    let clean = env.run(["doctor"]);

    // Every ready image has complete content; nothing is left mid-way.
    let mut states: BTreeMap<String, u64> = BTreeMap::new();
    let mut bad_images = Vec::new();
    for img in env.images_json() {
        let name = img["name"].as_str().unwrap();
        let state = img["state"].as_str().unwrap().to_owned();
        if state == "ready"
            && let Some(t) = torn(&env.root.join("img").join(enc(name)))
        {
            bad_images.push(format!("ready but torn: {t}"));
        }
        if !["ready", "incomplete"].contains(&state.as_str()) {
            bad_images.push(format!("{name} left {state} after repair"));
        }
        *states.entry(state).or_default() += 1;
    }

    let seen = fs::read_to_string(&violations).unwrap_or_default();
    let unexpected = shared.unexpected.lock().unwrap().clone();
    let ops = shared.ops.lock().unwrap().clone();
    let total: u64 = ops.values().sum();
    for u in unexpected.iter().take(10) {
        eprintln!("unexpected: {u}");
    }
    eprintln!(
        "stress summary: seed {seed}, {:.1} s, {total} operations {ops:?}, outcomes {:?}, {} kills, \
         final images {states:?}, violations {}",
        ran.as_secs_f64(),
        shared.outcomes.lock().unwrap(),
        shared.kills.load(Ordering::Relaxed),
        seen.lines().count() + unexpected.len() + bad_images.len() + held.len()
    );
    assert!(
        seen.is_empty(),
        "seed {seed}: violations seen by the commands:\n{seen}"
    );
    assert!(bad_images.is_empty(), "seed {seed}: {bad_images:#?}");
    assert!(
        unexpected.is_empty(),
        "seed {seed}: unexpected outcomes:\n{}",
        unexpected.join("\n")
    );
    assert!(held.is_empty(), "seed {seed}: locks still held: {held:#?}");
    assert_eq!(
        repair.status.code(),
        Some(0),
        "seed {seed}: {}",
        show(&repair)
    );
    assert_eq!(
        clean.status.code(),
        Some(0),
        "seed {seed}: {}",
        show(&clean)
    );
    assert!(total > workers, "seed {seed}: the run did almost nothing");
    let _ = HashMap::<u8, u8>::new();
}

/// The live processes of `groups` that belong to the run on `root` (its
/// path in their command line or environment): pid, state, kernel wait
/// channel and command line, one per line.
fn left_in_groups(groups: &[i32], root: &Path) -> String {
    let root = root.to_string_lossy().into_owned();
    let mut out = String::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let cmd = fs::read(e.path().join("cmdline"))
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .unwrap_or_default();
        // A --no-inherit keeper leads a group of its own; it ends its
        // command's tree and exits, releasing the locks, just after a
        // killed stowage: the repair below must not run before it has.
        let keeper = cmd.starts_with("stowage __keeper ");
        if f.len() < 3 || f[0] == "Z" || !(keeper || groups.iter().any(|g| f[2] == g.to_string())) {
            continue;
        }
        let wchan = fs::read_to_string(e.path().join("wchan")).unwrap_or_default();
        let environ = fs::read(e.path().join("environ"))
            .map(|c| String::from_utf8_lossy(&c).into_owned())
            .unwrap_or_default();
        if !cmd.contains(&root) && !environ.contains(&root) {
            continue;
        }
        out.push_str(&format!(
            "  pid {pid} state {} wchan {wchan}: {cmd}\n",
            f[0]
        ));
    }
    out
}
