//! Slots around real container-runtime clients: `scripts/load-image` with
//! the real Podman (a daemonless runtime, whose loads must be limited), and a
//! `--priority high` metadata read with the real skopeo while the load class
//! is saturated.
//!
//! No network: each test makes its image archives here, by `podman import`
//! of a tarball of random files and `podman save`. Podman runs with its own
//! storage under the test's temporary directory (`--root`, `--runroot`,
//! vfs), so nothing on the machine is touched. How many loads run at once is
//! observed from outside, by scanning /proc for `podman … load` processes,
//! never from stowage's own bookkeeping. Tests skip, saying why, without
//! root, podman or skopeo.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use crate::common::*;

const LOAD_IMAGE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/load-image");
const LOADS: usize = 6;

/// A stowage store plus a private Podman storage and image archives.
struct Podman {
    env: Env,
    dir: PathBuf,
}

impl Podman {
    fn new(needs: &[&str]) -> Option<Podman> {
        if !root_or_skip("Podman with a private --root") {
            return None;
        }
        for prog in needs {
            let found = Command::new(prog)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !found {
                eprintln!("skipping: {prog} is not installed (Debian package {prog})");
                return None;
            }
        }
        let env = Env::new();
        let dir = env.tmp.path().join("podman");
        fs::create_dir(&dir).unwrap();
        Some(Podman { env, dir })
    }

    /// Podman's options that keep it inside the test's directory.
    fn options(&self) -> Vec<String> {
        [
            "--root",
            &self.path("root"),
            "--runroot",
            &self.path("run"),
            "--tmpdir",
            &self.path("tmp"),
            "--storage-driver",
            "vfs",
            "--cgroup-manager",
            "cgroupfs",
            "--events-backend",
            "none",
        ]
        .map(String::from)
        .to_vec()
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    fn podman(&self, args: &[&str]) -> String {
        let mut c = Command::new("podman");
        c.args(self.options()).args(args);
        let out = output(c);
        assert!(out.status.success(), "podman {args:?}: {}", show(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `n` archives of distinct images `localhost/load-I:1`, each a layer
    /// of 16 MiB of random bytes, so that every load has real work to do;
    /// Podman's storage is left empty.
    fn archives(&self, n: usize) -> Vec<PathBuf> {
        let archives: Vec<PathBuf> = (0..n)
            .map(|i| {
                let rootfs = self.dir.join(format!("rootfs{i}"));
                fs::create_dir(&rootfs).unwrap();
                let mut blob = vec![0u8; 16 << 20];
                fastrand::fill(&mut blob);
                fs::write(rootfs.join("blob"), &blob).unwrap();
                let tar = self.dir.join(format!("rootfs{i}.tar"));
                let mut c = Command::new("tar");
                c.arg("-C").arg(&rootfs).arg("-cf").arg(&tar).arg(".");
                assert!(output(c).status.success());
                let tag = format!("localhost/load-{i}:1");
                self.podman(&["import", &tar.display().to_string(), &tag]);
                let archive = self.dir.join(format!("load-{i}.tar"));
                self.podman(&["save", "-o", &archive.display().to_string(), &tag]);
                archive
            })
            .collect();
        self.podman(&["rmi", "--all", "--force"]);
        archives
    }

    /// `scripts/load-image [EXTRA...] podman ARCHIVE PODMAN-OPTIONS…`
    fn load_image(&self, extra: &[&str], archive: &Path) -> Command {
        let mut c = Command::new("bash");
        c.arg(LOAD_IMAGE)
            .args(extra)
            .arg("podman")
            .arg(archive)
            .args(self.options())
            .env("STOWAGE", bin())
            .env("STOWAGE_ROOT", &self.env.root)
            .stdin(Stdio::null());
        c
    }

    fn loaded_tags(&self) -> Vec<String> {
        let mut tags: Vec<String> = self
            .podman(&["images", "--format", "{{.Repository}}:{{.Tag}}"])
            .lines()
            .map(String::from)
            .collect();
        tags.sort();
        tags
    }

    /// Loads every archive at once through `scripts/load-image`, watching
    /// from outside; returns the most `podman load` processes seen at once
    /// and the most resident memory they held together.
    fn load_all(&self, archives: &[PathBuf]) -> (usize, u64) {
        let began = std::time::Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let marker = self.dir.display().to_string();
        let watcher = {
            let stop = stop.clone();
            thread::spawn(move || {
                let (mut most, mut peak) = (0, 0);
                while !stop.load(Ordering::Relaxed) {
                    let (n, rss) = podman_loads(&marker);
                    most = most.max(n);
                    peak = peak.max(rss);
                    thread::sleep(Duration::from_millis(1));
                }
                (most, peak)
            })
        };
        let loads: Vec<Bg> = archives
            .iter()
            .map(|a| Bg::from_command(self.load_image(&[], a)))
            .collect();
        for load in loads {
            let out = load.finish();
            assert_eq!(out.status.code(), Some(0), "load-image: {}", show(&out));
        }
        stop.store(true, Ordering::Relaxed);
        eprintln!("{} loads took {:?}", archives.len(), began.elapsed());
        watcher.join().unwrap()
    }
}

/// Counts the `podman … load` processes whose command line mentions
/// `marker` and that are all alive at one instant, and adds up their
/// resident memory (bytes). A scan of /proc is not a snapshot: a load seen
/// early may have ended (and its successor started) before the scan is
/// over, so every match is checked again after the scan, and only those
/// still running then count. A child that Podman forks shares its parent's
/// memory, and so its command line, until it executes a helper: processes
/// whose parent is podman are that, not another load.
fn podman_loads(marker: &str) -> (usize, u64) {
    let Ok(procs) = fs::read_dir("/proc") else {
        return (0, 0);
    };
    let matches: Vec<PathBuf> = procs
        .flatten()
        .map(|p| p.path())
        .filter(|p| {
            let Ok(cmdline) = fs::read(p.join("cmdline")) else {
                return false;
            };
            let argv: Vec<String> = cmdline
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let is_podman = argv
                .first()
                .is_some_and(|a| Path::new(a).file_name().is_some_and(|f| f == "podman"));
            is_podman && argv.iter().any(|a| a == "load") && argv.iter().any(|a| a.contains(marker))
        })
        .collect();
    let (mut n, mut rss) = (0, 0);
    for p in matches {
        let status = fs::read_to_string(p.join("status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_owned())
        };
        let alive = field("State:").is_some_and(|s| !s.starts_with('Z') && !s.starts_with('X'));
        let forked = field("PPid:").is_some_and(|ppid| {
            fs::read_to_string(format!("/proc/{ppid}/comm")).is_ok_and(|c| c.trim() == "podman")
        });
        if alive && !forked {
            n += 1;
            rss += field("VmRSS:")
                .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap_or(0)
                * 1024;
        }
    }
    (n, rss)
}

#[test]
fn podman_loads_never_exceed_the_runtime_limit_and_all_arrive() {
    let Some(pm) = Podman::new(&["podman"]) else {
        return;
    };
    let archives = pm.archives(LOADS);
    pm.env.ok(["slots", "set", "load/podman", "2"]);

    let (most, rss) = pm.load_all(&archives);
    eprintln!(
        "limit 2: at most {most} loads at once, {} MiB together",
        rss >> 20
    );
    assert_eq!(most, 2, "6 loads under limit 2 must run two at a time");
    let expected: Vec<String> = (0..LOADS)
        .map(|i| format!("localhost/load-{i}:1"))
        .collect();
    assert_eq!(pm.loaded_tags(), expected);

    // A runtime with its own daemon needs no limit: 0 lets every load in.
    pm.podman(&["rmi", "--all", "--force"]);
    pm.env.ok(["slots", "set", "load/podman", "0"]);
    let (most, rss) = pm.load_all(&archives);
    eprintln!(
        "limit 0: at most {most} loads at once, {} MiB together",
        rss >> 20
    );
    assert!(
        most > 2,
        "with limit 0 loads must overlap freely, saw {most}"
    );
    assert_eq!(pm.loaded_tags(), expected);
}

#[test]
fn load_image_reports_an_unconfigured_class_and_a_missing_archive() {
    let Some(pm) = Podman::new(&["podman"]) else {
        return;
    };
    let out = output(pm.load_image(&[], &pm.dir.join("none.tar")));
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(stderr(&out).contains("none.tar"), "{}", show(&out));

    let archive = pm.dir.join("a.tar");
    fs::write(&archive, "").unwrap();
    pm.env.ok(["slots", "set", "pull", "1"]);
    let out = output(pm.load_image(&[], &archive));
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(stderr(&out).contains("load/podman"), "{}", show(&out));
}

#[test]
fn urgent_metadata_read_passes_a_saturated_load_class() {
    let Some(pm) = Podman::new(&["podman", "skopeo"]) else {
        return;
    };
    let archives = pm.archives(3);
    pm.env
        .ok(["slots", "set", "load/podman", "2", "--reserve-high", "1"]);

    // Two slow loads fill the class: each loads its archive for real, then
    // keeps its slot until released.
    let slow: Vec<Bg> = archives[..2]
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let hold = pm.env.hold_cmd(&format!("loaded{i}"), "release");
            let mut cmd = pm
                .env
                .cmd(["exec", "--slot", "load/podman", "--", "sh", "-c"]);
            cmd.arg(format!(
                "podman {} load -q -i '{}' >/dev/null && exec \"$@\"",
                pm.options().join(" "),
                a.display()
            ))
            .arg("sh")
            .args(&hold);
            Bg::from_command(cmd)
        })
        .collect();
    for i in 0..2 {
        wait_for_file(&pm.env.sentinel(&format!("loaded{i}")));
    }

    let inspect = |priority: &str, wait: &[&str]| {
        let mut c = pm
            .env
            .cmd(["exec", "--slot", "load/podman", "--priority", priority]);
        c.args(wait)
            .args(["--", "skopeo", "inspect"])
            .arg(format!("docker-archive:{}", archives[2].display()));
        c
    };

    // Normal priority finds no slot: it waits (here: gives up at once).
    let out = output(inspect("normal", &["--no-wait"]));
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let queued = Bg::from_command(inspect("normal", &[]));
    pm.env.wait_for_slot_waiters("load/podman", 1);

    // High priority takes the reserved slot at once and really reads the
    // archive's metadata, while the loads and the queued read go on.
    let out = output(inspect("high", &["--no-wait"]));
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(meta["Layers"].as_array().map(Vec::len), Some(1), "{meta}");
    let mut queued = queued;
    assert!(queued.is_running(), "the normal read must still be waiting");

    pm.env.release("release");
    for s in slow {
        assert_eq!(s.finish().status.code(), Some(0));
    }
    let out = queued.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}
