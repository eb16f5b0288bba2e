//! Holder leases and holders on other hosts: each stowage process's lease
//! (where it goes, how it names a holder that left no record), holders in
//! other pid namespaces and on other "hosts" (UTS namespaces), and attacks on
//! leases (planted lease files, commands that drop the lease they inherited).
//!
//! The hosts are real namespaces made with `unshare --pid --fork --uts
//! --mount-proc`, each with its own /proc, so its lock table hides every lock
//! taken outside it and its pids mean nothing outside. Killing a namespace's
//! init kills every process in it at once: a host crash. Needs root; skipped
//! (with the reason printed) where namespaces cannot be made.

use std::collections::HashSet;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::common::*;

/// Whether real namespaces can be made here; prints why not when not.
fn namespaces() -> bool {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: making pid and UTS namespaces needs root");
        return false;
    }
    let ok = Command::new("unshare")
        .args(["--pid", "--fork", "--uts", "--mount-proc", "true"])
        .stdin(std::process::Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: `unshare --pid --fork --uts --mount-proc` does not work here");
    }
    ok
}

/// A "host": a new pid, UTS and mount namespace (own /proc) named
/// `hostname` (None: ours, as a container on this host has), whose init is
/// `sh`, running `stowage ARGS` and waiting for it.
struct Host {
    bg: Bg,
}

impl Host {
    /// Starts `stowage exec LOCKS -- CMD` in a new namespace, where CMD
    /// creates sentinel `started` and waits for sentinel `release`; returns
    /// once CMD runs.
    fn hold(env: &Env, hostname: Option<&str>, locks: &[&str], started: &str) -> Host {
        let mut args: Vec<String> = vec!["exec".into()];
        args.extend(locks.iter().map(|s| s.to_string()));
        args.push("--".into());
        args.extend(env.hold_cmd(started, "release"));
        let bg = Bg::from_command(in_lingering_namespace(
            hostname,
            &stowage_argv(env, &args),
            Some(&env.sentinel("release")),
        ));
        wait_for_file(&env.sentinel(started));
        Host { bg }
    }

    /// The namespace's init (its pid 1), as this namespace sees it.
    fn init(&self) -> u32 {
        let unshare = self.bg.pid();
        let children =
            std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children")).unwrap();
        children
            .split_whitespace()
            .next()
            .expect("unshare has forked the namespace's init")
            .parse()
            .unwrap()
    }

    /// Runs `stowage ARGS` inside this host's namespaces (pid, UTS, mount).
    fn run(&self, env: &Env, args: &[&str]) -> std::process::Output {
        let mut c = Command::new("nsenter");
        c.args(["-t", &self.init().to_string(), "-p", "-u", "-m", "--"]);
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        c.args(stowage_argv(env, &args));
        c.env_remove("STOWAGE_ROOT");
        output(c)
    }

    /// A host crash: SIGKILL to the namespace's init, which takes every
    /// process of the namespace with it; returns once all are gone.
    fn crash(self) {
        let init = self.init();
        unsafe { libc::kill(init as i32, libc::SIGKILL) };
        wait_until("the namespace's init is gone", || {
            !Path::new(&format!("/proc/{init}")).exists()
                || std::fs::read_to_string(format!("/proc/{init}/stat"))
                    .is_ok_and(|s| s.contains(") Z "))
        });
        // unshare exits once its child (the init) is reaped; by then the
        // kernel has killed the whole namespace and released its locks.
        let out = self.bg.finish();
        assert!(!out.status.success(), "the namespace was killed");
    }
}

/// `unshare … sh -c 'hostname NAME; "$@"' sh PROGRAM ARGS…`
fn in_namespace(hostname: Option<&str>, program: &[String]) -> Command {
    in_lingering_namespace(hostname, program, None)
}

/// Like [`in_namespace`], but the namespace's init (sh, pid 1) stays until
/// file `linger` exists: when the init ends, the kernel kills the whole
/// namespace, so a namespace that must outlive its stowage needs one.
fn in_lingering_namespace(
    hostname: Option<&str>,
    program: &[String],
    linger: Option<&Path>,
) -> Command {
    let mut c = Command::new("unshare");
    c.args(["--pid", "--fork", "--uts", "--mount-proc", "sh", "-c"]);
    let name = hostname.map_or(String::new(), |h| format!("hostname '{h}' && "));
    let wait = linger.map_or(String::new(), |f| {
        format!(
            "i=0; while [ ! -e '{}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done; ",
            f.display()
        )
    });
    c.arg(format!("{name}\"$@\"; st=$?; {wait}exit $st"));
    c.arg("sh").args(program);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    c
}

fn stowage_argv(env: &Env, args: &[String]) -> Vec<String> {
    let mut v = vec![
        bin().to_owned(),
        "--root".into(),
        env.root.display().to_string(),
    ];
    v.extend(args.iter().cloned());
    v
}

/// `lock-status --json IMAGE` run from a third "host".
fn status_from_elsewhere(env: &Env, hostname: &str, image: &str) -> Value {
    let args: Vec<String> = ["lock-status", "--json", image]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let out = output(in_namespace(Some(hostname), &stowage_argv(env, &args)));
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn parse(out: &std::process::Output) -> Value {
    assert_eq!(out.status.code(), Some(0), "{}", show(out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn image_entry(status: &Value, image: &str) -> Value {
    status["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "image" && l["name"] == image)
        .cloned()
        .unwrap_or(Value::Null)
}

/// The holders of an image lock whose command mentions `sentinel`: the
/// stowage holder started with that sentinel, as listed.
fn holders_of(entry: &Value, sentinel: &str) -> Vec<Value> {
    entry["holders"]
        .as_array()
        .map(|hs| {
            hs.iter()
                .filter(|h| {
                    h["command"]
                        .as_str()
                        .is_some_and(|c| c.contains(&format!("/{sentinel}'")))
                })
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// Each of `holders` (sentinel, host) is listed exactly once, as a stowage
/// party of that host, and nobody else holds the lock except `outsiders`
/// parties taken outside stowage.
fn assert_listed_once(entry: &Value, holders: &[(&str, &str)], outsiders: usize, seen_from: &str) {
    for (sentinel, host) in holders {
        let found = holders_of(entry, sentinel);
        assert_eq!(
            found.len(),
            1,
            "from {seen_from}: the holder '{sentinel}' is listed once: {entry:#}"
        );
        assert_eq!(found[0]["host"], *host, "from {seen_from}: {entry:#}");
        assert_eq!(found[0]["stowage"], true, "from {seen_from}: {entry:#}");
        assert!(found[0]["lease"].is_string(), "from {seen_from}: {entry:#}");
    }
    let all = entry["holders"].as_array().unwrap();
    assert_eq!(
        all.len(),
        holders.len() + outsiders,
        "from {seen_from}: nobody listed twice, nobody extra: {entry:#}"
    );
    assert_eq!(
        all.iter().filter(|h| h["stowage"] == false).count(),
        outsiders,
        "from {seen_from}: {entry:#}"
    );
}

#[test]
fn holders_in_other_pid_namespaces_are_listed_once_from_everywhere() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let here = our_hostname();
    // A container on this host (same host name, its own pids), another host,
    // a holder here, and a lock taken outside stowage.
    let container = Host::hold(&env, None, &["--read", "base"], "in-container");
    let host_b = Host::hold(&env, Some("hostB"), &["--read", "base"], "on-hostB");
    let local = env.hold(&["--read", "base"], "local");
    let mut flock = Command::new("flock");
    flock
        .arg("-s")
        .arg(env.lock_file("base"))
        .args(env.hold_cmd("by-flock", "release"));
    let flock = Bg::from_command(flock);
    wait_for_file(&env.sentinel("by-flock"));

    let all = [
        ("in-container", here.as_str()),
        ("on-hostB", "hostB"),
        ("local", here.as_str()),
    ];
    // From this host, which sees every lock in its table: each once, and
    // flock(1) as the one outsider.
    let from_here = env.lock_entry("base").unwrap();
    assert_listed_once(&from_here, &all, 1, "this host");
    let outsider = from_here["holders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["stowage"] == false)
        .unwrap()
        .clone();
    assert_eq!(outsider["pid"], flock.pid(), "{from_here:#}");
    // The container's holder by its pid here, the one signals from here
    // reach (the lease says the container's own).
    let pid = holders_of(&from_here, "in-container")[0]["pid"].clone();
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    assert!(
        String::from_utf8_lossy(&cmdline).contains("in-container"),
        "pid {pid} is not the container's holder here: {from_here:#}"
    );

    // From inside each holder's own namespace, whose table hides everything
    // taken outside it (flock(1) included: nobody can tell it is there).
    for (h, name) in [(&container, "the container"), (&host_b, "hostB")] {
        let entry = image_entry(
            &parse(&h.run(&env, &["lock-status", "--json", "base"])),
            "base",
        );
        assert_listed_once(&entry, &all, 0, name);
        assert_eq!(entry["state"], "shared", "{entry:#}");
    }
    // From a third host.
    let entry = image_entry(&status_from_elsewhere(&env, "hostC", "base"), "base");
    assert_listed_once(&entry, &all, 0, "hostC");

    // Listing judged nothing away: the records are all still there.
    assert_listed_once(&env.lock_entry("base").unwrap(), &all, 1, "this host again");
    env.release("release");
    drop((container, host_b));
    local.finish();
    flock.finish();
}

/// A lock held outside stowage, seen from a container: the holder is
/// unidentified, with no pid, and so no place where a pid would name it.
#[test]
fn an_unidentified_holder_has_no_pid_space() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let mut flock = Command::new("flock");
    flock.arg("-s").arg(env.lock_file("base"));
    flock.args(env.hold_cmd("by-flock", "release"));
    let flock = Bg::from_command(flock);
    wait_for_file(&env.sentinel("by-flock"));
    let args = ["lock-status", "base", "--json"].map(String::from);
    let out = output(in_namespace(None, &stowage_argv(&env, &args)));
    let status: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(&out)));
    let seen = &image_entry(&status, "base")["holders"][0];
    assert_eq!(seen["pid"], Value::Null, "{seen}");
    assert_eq!(seen["pid_space"], Value::Null, "{seen}");
    assert_eq!(
        env.lock_entry("base").unwrap()["holders"][0]["pid_space"],
        "here"
    );
    env.release("release");
    flock.finish();
}

#[test]
fn a_writer_in_a_container_names_the_holder_outside() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let holder = env.hold(&["--read", "base"], "outside");
    let here = our_hostname();
    // The same host name, as a container has: its table shows nothing of
    // the holder, and the holder's pid means nothing in it.
    for hostname in [None, Some("hostW")] {
        let args: Vec<String> = ["exec", "--write", "base", "--wait", "0.2", "--", "true"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let out = output(in_namespace(hostname, &stowage_argv(&env, &args)));
        assert_eq!(out.status.code(), Some(75), "{}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&format!("held (read) by pid {} on {here} (", holder.pid()))
                && err.contains("/outside'"),
            "the wait names the holder outside (from {hostname:?}): {err}"
        );
        // Its pid is not one a signal from the container reaches.
        assert_eq!(
            err.contains("(in another pid namespace)"),
            hostname.is_none(),
            "from {hostname:?}: {err}"
        );
        // JSON says so too: the host name alone would call it this host's pid.
        let args = ["lock-status", "base", "--json"].map(String::from);
        let out = output(in_namespace(hostname, &stowage_argv(&env, &args)));
        let status: Value =
            serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(&out)));
        let seen = &image_entry(&status, "base")["holders"][0];
        let space = match hostname {
            None => "another-namespace",
            Some(_) => "its-host",
        };
        assert_eq!(seen["pid_space"], space, "from {hostname:?}: {seen}");
    }
    // The holder's record survived both looks.
    let entry = env.lock_entry("base").unwrap();
    assert_eq!(entry["holders"][0]["pid_space"], "here", "{entry}");
    assert_listed_once(&entry, &[("outside", here.as_str())], 0, "this host");
    env.release("release");
    holder.finish();
}

/// The leases in `locks/leases` (not the markers of writes without the
/// database, which share the directory).
fn lease_names(env: &Env) -> Vec<String> {
    std::fs::read_dir(env.root.join("locks/leases"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".dirty"))
        .collect()
}

#[test]
fn a_crashed_host_loses_its_holders_everywhere_and_its_writes_go_incomplete() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let here = our_hostname();
    // hostK reads base and writes app; this host keeps reading base, so
    // base stays held after the crash (a lock state alone cannot tell).
    let keep = env.hold(&["--read", "base"], "survivor");
    let host_k = Host::hold(&env, Some("hostK"), &["--read", "base"], "k-reader");
    let writer = Host::hold(&env, Some("hostK2"), &["--write", "app"], "k-writer");
    let before = env.lock_entry("base").unwrap();
    assert_listed_once(
        &before,
        &[("survivor", here.as_str()), ("k-reader", "hostK")],
        0,
        "this host",
    );
    let leases_before = lease_names(&env).len();
    assert_eq!(leases_before, 3, "one lease per live stowage process");

    host_k.crash();
    writer.crash();

    // The next look from another host already drops them.
    let entry = image_entry(&status_from_elsewhere(&env, "hostC", "base"), "base");
    assert_listed_once(&entry, &[("survivor", here.as_str())], 0, "hostC");
    let app = image_entry(&status_from_elsewhere(&env, "hostC", "app"), "app");
    assert_eq!(app["state"], "free", "{app:#}");
    assert!(app["holders"].as_array().unwrap().is_empty(), "{app:#}");
    assert_eq!(app["image_state"], "incomplete", "{app:#}");
    // And from here: nothing of hostK left, and its leases are cleaned.
    let entry = env.lock_entry("base").unwrap();
    assert_listed_once(&entry, &[("survivor", here.as_str())], 0, "this host");
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    let leases = lease_names(&env);
    assert_eq!(
        leases.len(),
        1,
        "only the survivor's lease is left: {leases:?}"
    );
    assert!(leases[0].starts_with(&format!("{here}-")), "{leases:?}");
    env.release("release");
    keep.finish();
}

#[test]
fn a_build_in_a_container_outlives_its_killed_stowage_as_the_holder() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let h = Host::hold(&env, Some("hostI"), &["--write", "base"], "inherits");
    // SIGKILL the stowage process only (the init's child): its command
    // keeps the inherited lock and lease, so it is still the holder.
    let init = h.init();
    let stowage: u32 = std::fs::read_to_string(format!("/proc/{init}/task/{init}/children"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let cmdline = std::fs::read(format!("/proc/{stowage}/cmdline")).unwrap();
    assert!(
        String::from_utf8_lossy(&cmdline).starts_with(bin()),
        "pid {stowage} is stowage: {cmdline:?}"
    );
    unsafe { libc::kill(stowage as i32, libc::SIGKILL) };
    wait_until("the stowage process is gone", || {
        std::fs::read_to_string(format!("/proc/{stowage}/stat"))
            .map_or(true, |s| s.contains(") Z "))
    });
    for entry in [
        env.lock_entry("base").unwrap(),
        image_entry(&status_from_elsewhere(&env, "hostC", "base"), "base"),
    ] {
        assert_listed_once(&entry, &[("inherits", "hostI")], 0, "here and hostC");
        assert_eq!(entry["state"], "exclusive", "{entry:#}");
    }
    // The command ends: the lease goes with it, and the image is incomplete.
    env.release("release");
    h.bg.finish();
    let entry = env.lock_entry("base").unwrap();
    assert!(entry["holders"].as_array().unwrap().is_empty(), "{entry:#}");
    assert_eq!(env.state("base").as_deref(), Some("incomplete"));
}

#[test]
fn a_writer_here_names_the_holder_in_a_container_once() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let here = our_hostname();
    // Same host name, other pids: the pid in its record is not one here.
    let container = Host::hold(&env, None, &["--read", "base"], "in-container");
    let out = env.run(["exec", "--write", "base", "--wait", "0.2", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let err = stderr(&out);
    let named = err.lines().next().unwrap_or_default();
    assert!(
        named.contains(&format!(" on {here} (sh -c "))
            && named.contains("/in-container'")
            && named.matches(" since ").count() == 1
            && !named.contains("not started by stowage"),
        "the wait names the container's stowage holder, once, by its record: {err}"
    );
    env.release("release");
    drop(container);
}

#[test]
fn the_lease_goes_where_the_locks_go() {
    let env = Env::new();
    env.make_image("base");
    // The command's open descriptors, by target.
    let fds = |extra: &[&str]| -> String {
        let mut args = vec!["exec", "--read", "base"];
        args.extend(extra);
        args.extend(["--", "sh", "-c", "ls -l /proc/$$/fd/"]);
        String::from_utf8(env.ok(&args).stdout).unwrap()
    };
    let inherited = fds(&[]);
    assert!(
        inherited.contains("/locks/images/base.lock") && inherited.contains("/locks/leases/"),
        "the command inherits the lock and the lease: {inherited}"
    );
    let kept = fds(&["--no-inherit"]);
    assert!(
        !kept.contains("/locks/images/") && !kept.contains("/locks/leases/"),
        "with --no-inherit it gets neither: {kept}"
    );
    // Each stowage process unlinks its lease when it ends.
    let left: Vec<_> = std::fs::read_dir(env.root.join("locks/leases"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// The party a "host" runs, several at once: random reads and writes of a
/// few images, each held for a moment, until the namespace is killed.
pub(crate) const PARTY: &str = r#"
party() {
  while :; do
    n=$(od -An -N1 -tu1 /dev/urandom); n=$((n + 0))
    case $((n % 4)) in
      0|1) "$STOWAGE" exec --read base --wait 0.5 -- sleep 0.0$((n % 9 + 1)) ;;
      2) "$STOWAGE" exec --write "img$((n % 3))" --wait 0.5 -- sleep 0.0$((n % 5 + 1)) ;;
      3) "$STOWAGE" exec --read base --write "img$((n % 3))" --no-wait -- sleep 0.02 ;;
    esac >/dev/null 2>&1
  done
}
party & party & party &
wait
"#;

/// Torture across hosts: parties run in N namespaces ("hosts", each with its
/// own host name and pids) sharing the root, while whole namespaces are
/// killed at random and replaced. After each crash, a look from this host
/// must show no record of the dead host; every look must list each holder
/// once (no lease twice on one lock, no outsider on a lock whose holders
/// are all recorded). `STOWAGE_STRESS_HOSTS` (default 3) and
/// `STOWAGE_STRESS_SECS` (default 10); `scripts/stress --hosts N` runs it.
#[test]
fn torture_hosts() {
    if !namespaces() {
        return;
    }
    let hosts = env_num("STOWAGE_STRESS_HOSTS", 3).max(1) as usize;
    let secs = env_num("STOWAGE_STRESS_SECS", 10);
    let seed = env_num("STOWAGE_STRESS_SEED", fastrand::u64(..));
    eprintln!("stress --hosts: {hosts} hosts, {secs} s, seed {seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let env = Env::new();
    for name in ["base", "img0", "img1", "img2"] {
        env.make_image(name);
    }
    let start = |name: &str| -> Bg {
        let mut c = Command::new("unshare");
        c.args(["--pid", "--fork", "--uts", "--mount-proc", "sh", "-c"])
            .arg(format!("hostname '{name}' && {PARTY}"));
        c.env("STOWAGE", bin()).env("STOWAGE_ROOT", &env.root);
        Bg::from_command(c)
    };
    let mut generation = 0u64;
    let mut live: Vec<(String, Bg)> = (0..hosts)
        .map(|i| {
            let name = format!("h{i}g0");
            (name.clone(), start(&name))
        })
        .collect();
    let (mut looks, mut crashes, mut listed) = (0u64, 0u64, 0u64);
    let mut problems: Vec<String> = Vec::new();
    let mut check = |dead: &[String], problems: &mut Vec<String>| {
        let status = env.status_json(["--all"]);
        looks += 1;
        for lock in status["locks"].as_array().unwrap() {
            let holders = lock["holders"].as_array().unwrap();
            let waiters = lock["waiters"].as_array().unwrap();
            let mut leases = HashSet::new();
            for p in holders.iter().chain(waiters) {
                if let Some(h) = p["host"].as_str()
                    && dead.iter().any(|d| d == h)
                {
                    problems.push(format!("a record of dead host {h} survived a look: {lock}"));
                }
            }
            for p in holders {
                listed += 1;
                if let Some(l) = p["lease"].as_str()
                    && !leases.insert(l.to_owned())
                {
                    problems.push(format!("holder listed twice: {lock}"));
                }
            }
            // Nobody here takes a lock outside stowage: every holder is
            // known by its record or, a moment before it records itself,
            // by its lease — never as an outsider beside (or instead of)
            // its record. (The lock table is read more than once and the
            // reads are folded, so a process that released the lock and
            // exited meanwhile may still show, with no command left to
            // read: not a holder listed twice. A crashed host's command
            // may outlive its exec for a moment: "kept", no outsider.)
            if lock["kind"] == "image"
                && holders
                    .iter()
                    .any(|p| p["stowage"] != true && p["kept"] != true && !p["command"].is_null())
            {
                problems.push(format!("a stowage holder listed as an outsider: {lock}"));
            }
            if lock["kind"] == "image" && lock["state"] == "exclusive" && holders.len() > 1 {
                problems.push(format!("an exclusive lock listed with two holders: {lock}"));
            }
        }
    };
    let mut dead: Vec<String> = Vec::new();
    let t0 = std::time::Instant::now();
    while t0.elapsed() < std::time::Duration::from_secs(secs) {
        std::thread::sleep(std::time::Duration::from_millis(rng.u64(50..400)));
        check(&dead, &mut problems);
        // Crash a random host: kill its namespace's init, wait until every
        // process of it is gone, and look at once.
        let i = rng.usize(0..live.len());
        let (name, bg) = live.swap_remove(i);
        let host = Host { bg };
        host.crash();
        crashes += 1;
        dead.push(name);
        check(&dead, &mut problems);
        generation += 1;
        let name = format!("h{i}g{generation}");
        live.push((name.clone(), start(&name)));
    }
    for (name, bg) in live.drain(..) {
        Host { bg }.crash();
        dead.push(name);
    }
    check(&dead, &mut problems);
    let status = env.status_json(["--all"]);
    for lock in status["locks"].as_array().unwrap() {
        if lock["kind"] == "image" && lock["state"] != "free" {
            problems.push(format!("held after every host died: {lock}"));
        }
    }
    // A host killed between a lease's create and its lock leaves a file
    // nobody wrote, which another host can only take for dead once it is
    // older than any maker could take (lease.rs; 10 minutes): a look with
    // no grace finds them all, now that every host is dead.
    let mut c = env.cmd(["lock-status", "--all"]);
    c.env(stowage::env::DEBUG_UNWRITTEN_LEASE_MS, "0");
    assert_eq!(output(c).status.code(), Some(0));
    let leases = std::fs::read_dir(env.root.join("locks/leases"))
        .map(|d| d.count())
        .unwrap_or(0);
    if leases != 0 {
        problems.push(format!(
            "{leases} lease files of dead hosts left after a look"
        ));
    }
    let repair = env.run(["doctor", "--repair"]);
    let clean = env.run(["doctor"]);
    eprintln!(
        "stress --hosts summary: seed {seed}, {hosts} hosts, {crashes} crashes, {looks} looks, \
         {listed} holders listed, problems {}",
        problems.len()
    );
    for p in problems.iter().take(10) {
        eprintln!("problem: {p}");
    }
    assert!(
        problems.is_empty(),
        "seed {seed}: {} problems",
        problems.len()
    );
    assert_eq!(repair.status.code(), Some(0), "{}", show(&repair));
    assert_eq!(clean.status.code(), Some(0), "{}", show(&clean));
}

#[test]
fn cleaning_leases_never_follows_a_planted_symlink() {
    let env = Env::new();
    env.make_image("base");
    // Someone who can write locks/ points locks/leases at a directory of
    // theirs (or of a victim) holding an unlocked *.lease file.
    let victim = env.scratch.join("victim");
    std::fs::create_dir(&victim).unwrap();
    std::fs::write(victim.join("h-0-1-0.lease"), "not a lease of this store").unwrap();
    let leases = env.root.join("locks/leases");
    let _ = std::fs::remove_dir_all(&leases);
    std::os::unix::fs::symlink(&victim, &leases).unwrap();
    env.ok(["lock-status"]);
    env.ok(["images"]);
    env.ok(["gc"]);
    assert!(
        victim.join("h-0-1-0.lease").exists(),
        "nothing outside the root is unlinked through the symlink"
    );
    // doctor names it.
    let out = env.run(["doctor"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("locks/leases")
            || stderr(&out).contains("locks/leases"),
        "{}",
        show(&out)
    );
}

#[test]
fn a_stowage_holder_without_a_record_is_known_by_its_lease() {
    let env = Env::new();
    env.make_image("doomed");
    // rm holds the image exclusively and records nothing.
    let (rm, paused) = env.paused(["rm", "doomed"], "rm-marked");
    let entry = env.lock_entry("doomed").unwrap();
    let holders = entry["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{entry:#}");
    assert_eq!(holders[0]["stowage"], true, "not an outsider: {entry:#}");
    assert_eq!(holders[0]["pid"], rm.pid(), "{entry:#}");
    assert!(holders[0]["lease"].is_string(), "{entry:#}");
    assert!(
        holders[0]["command"]
            .as_str()
            .is_some_and(|c| c.contains(" rm doomed")),
        "{entry:#}"
    );
    std::fs::remove_file(paused).unwrap();
    assert_eq!(rm.finish().status.code(), Some(0));
}

#[test]
fn a_slot_holder_in_a_container_is_listed_once() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    env.ok(["slots", "set", "pull", "2"]);
    let here = our_hostname();
    let container = Host::hold(
        &env,
        None,
        &["--read", "base", "--slot", "pull"],
        "slot-in-container",
    );
    for (status, seen_from) in [
        (env.status_json(Vec::<String>::new()), "this host"),
        (status_from_elsewhere(&env, "hostC", "base"), "hostC"),
    ] {
        let slot = status["locks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["kind"] == "slot" && l["name"] == "pull")
            .cloned()
            .unwrap();
        assert_eq!(slot["in_use"], 1, "from {seen_from}: {slot:#}");
        assert_listed_once(&slot, &[("slot-in-container", here.as_str())], 0, seen_from);
    }
    env.release("release");
    drop(container);
}

// --- attacks on leases ------------------------------------------------------

/// Holds `path` exclusively, from this (test) process, as an outside
/// program would: by flock(2) on whatever is there (stowage's own lock
/// module takes no lock on a FIFO).
#[allow(clippy::disallowed_methods)]
fn hold(path: &std::path::Path) -> std::fs::File {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    f
}

#[test]
fn a_planted_fifo_lease_does_not_hang_lock_status() {
    let env = Env::new();
    env.make_image("app");
    // Someone who can write locks/leases plants a FIFO under a lease's name,
    // holds it exclusively (as an owner holds its lease) and holds an image
    // lock, so that lock-status looks for the identity of the lock's taker
    // in that "lease".
    let fifo = env.root.join("locks/leases/evil.lease");
    let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
    // Opened read-write (as lock files are): a FIFO opened so never
    // blocks, and counts as its own writer, so a reader would wait for data
    // for good.
    let planted = hold(&fifo);
    let image = hold(&env.lock_file("app"));

    let mut c = env.cmd(["lock-status", "--json", "app"]);
    std::os::unix::process::CommandExt::process_group(&mut c, 0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let out = wait_output(c.spawn().unwrap(), Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let entry = v["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "image" && l["name"] == "app")
        .cloned()
        .unwrap();
    let holders = entry["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "still shown held: {entry:#}");
    assert_eq!(holders[0]["pid"], std::process::id(), "{entry:#}");
    assert_eq!(holders[0]["stowage"], false, "{entry:#}");
    drop((planted, image));
}

#[test]
fn a_command_that_closes_its_lease_stays_the_recorded_holder_after_stowage_dies() {
    let env = Env::new();
    env.make_image("app");
    // A command that closes every descriptor it inherited but its image lock
    // (closefrom, a daemon's hygiene): stowage's lease then lives only in
    // stowage itself.
    let (mut bg, stowage) = start_closing_its_lease(&env, "--write");
    let command = command_of(stowage);
    // SIGKILL stowage only: the command keeps the image lock, not the lease.
    bg.signal(libc::SIGKILL);
    let _ = bg.child.as_mut().unwrap().wait();
    assert!(!flock_free(&env.lock_file("app")), "the command holds it");
    let entry = env.lock_entry("app").unwrap();
    let holders = entry["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{entry:#}");
    assert_eq!(holders[0]["stowage"], true, "not an outsider: {entry:#}");
    // Named by the command's pid, which holds it: its dead stowage's no longer reaches it (and
    // may be another's).
    assert_eq!(
        (&holders[0]["pid"], &holders[0]["kept"]),
        (&Value::from(command), &Value::from(true)),
        "{entry:#} (stowage was {stowage})"
    );
    assert!(
        holders[0]["command"]
            .as_str()
            .is_some_and(|c| c.contains("closes-its-lease")),
        "the record stands: {entry:#}"
    );
    assert_eq!(entry["state"], "exclusive", "{entry:#}");
    // Neither a repair nor a look from another host, which sees no lock
    // table of this one, cleans away the dead lease that names it.
    let _ = env.run(["doctor", "--repair"]);
    if namespaces() {
        status_from_elsewhere(&env, "hostB", "app");
    }
    let entry = env.lock_entry("app").unwrap();
    let holders = entry["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{entry:#}");
    assert_eq!(
        holders[0]["stowage"], true,
        "after a repair and a look from elsewhere: {entry:#}"
    );
    // The command ends: its record goes, and the image is incomplete.
    env.release("release");
    wait_until("the command released the image lock", || {
        flock_free(&env.lock_file("app"))
    });
    let entry = env.lock_entry("app").unwrap();
    assert!(entry["holders"].as_array().unwrap().is_empty(), "{entry:#}");
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    bg.kill_all();
}

#[test]
fn a_planted_leases_symlink_gets_no_lease_made_through_it() {
    let env = Env::new();
    env.make_image("app");
    // Someone who can write locks/ points locks/leases at another directory.
    let victim = env.scratch.join("victim");
    std::fs::create_dir(&victim).unwrap();
    let leases = env.root.join("locks/leases");
    let _ = std::fs::remove_dir_all(&leases);
    std::os::unix::fs::symlink(&victim, &leases).unwrap();
    // Every process that locks makes a lease: exec, rm, gc.
    let listing = env.sentinel("listing");
    let out = env.run([
        "exec",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        &format!("ls -A '{}' > '{}'", victim.display(), listing.display()),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(
        std::fs::read_to_string(&listing).unwrap(),
        "",
        "no lease made outside the root while the command ran"
    );
    env.ok(["gc"]);
    env.ok(["rm", "app"]);
    assert!(
        std::fs::read_dir(&victim).unwrap().next().is_none(),
        "nothing created outside the root"
    );
    assert!(
        std::fs::symlink_metadata(&leases)
            .unwrap()
            .file_type()
            .is_symlink(),
        "left for doctor to name"
    );
}

/// A reader is named by its lease: it lists the lock and the command it
/// is for, and lock-status names the reader from there, once —
/// with the kernel's lock table, without one (NFS, where the table shows
/// nothing of other hosts), in the default view and asked by name, and
/// after stowage itself died while its command (which inherited the lock
/// and the lease) runs on.
#[test]
fn a_reader_is_named_by_its_lease() {
    let env = Env::new();
    env.make_image("base");
    let mut bg = env.hold(&["--read", "base"], "started");
    let stowage = bg.pid();
    let leases: Vec<String> = std::fs::read_dir(env.root.join("locks/leases"))
        .unwrap()
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect();
    assert!(
        leases.iter().any(|t| t
            .lines()
            .any(|l| l.starts_with("hold=shared images/base.lock ") && l.contains(" sh -c "))),
        "the lease lists the hold: {leases:?}"
    );
    // By stowage's pid while it lives; once it died, by the command's, which
    // holds the lock (no signal reaches the command through stowage's pid,
    // which may be another's), where the lock table and /proc tell.
    let named_once = |entry: &Value, how: &str, pid: Value| {
        let holders = entry["holders"].as_array().unwrap();
        assert_eq!(holders.len(), 1, "{how}: {entry:#}");
        assert_eq!(holders[0]["pid"], pid, "{how}: {entry:#}");
        assert_eq!(holders[0]["stowage"], true, "{how}: {entry:#}");
        assert_eq!(holders[0]["mode"], "shared", "{how}: {entry:#}");
        assert!(
            holders[0]["command"]
                .as_str()
                .is_some_and(|c| c.starts_with("sh -c ")),
            "{how}: {entry:#}"
        );
        assert_eq!(entry["state"], "shared", "{how}: {entry:#}");
    };
    let nfs = |args: &[&str]| {
        let mut c = env.cmd(["lock-status", "--json"]);
        c.args(args).env(stowage::env::DEBUG_FILESYSTEM, "nfs");
        let out = output(c);
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
        let st: Value = serde_json::from_slice(&out.stdout).unwrap();
        image_entry(&st, "base")
    };
    let default_view = image_entry(&env.status_json::<[&str; 0], &str>([]), "base");
    let alive = Value::from(stowage);
    named_once(&default_view, "default view", alive.clone());
    named_once(&env.lock_entry("base").unwrap(), "by name", alive.clone());
    named_once(&nfs(&[]), "no lock table", alive.clone());
    named_once(&nfs(&["base"]), "no lock table, by name", alive);
    // stowage dies; its command keeps the lock and the lease.
    let command = command_of(stowage);
    bg.signal(libc::SIGKILL);
    let _ = bg.child.as_mut().unwrap().wait();
    assert!(!flock_free(&env.lock_file("base")), "the command holds it");
    named_once(
        &env.lock_entry("base").unwrap(),
        "after stowage died",
        Value::from(command),
    );
    named_once(
        &nfs(&["base"]),
        "after stowage died, no lock table",
        Value::Null,
    );
    // The command ends: nobody is listed any more.
    env.release("release");
    wait_until("the command released the lock", || {
        flock_free(&env.lock_file("base"))
    });
    let entry = env.lock_entry("base").unwrap();
    assert!(entry["holders"].as_array().unwrap().is_empty(), "{entry:#}");
    bg.kill_all();
}

/// A build on another host (a real one: its own UTS and pid namespaces)
/// is shown with that host's name while its lock is held; once its host
/// crashes, its lock is free and the next look drops its record and marks
/// its image incomplete — its pid could never be checked from here.
#[test]
fn a_record_from_another_host_whose_lock_is_free_is_dropped() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    let remote = Host::hold(
        &env,
        Some("node07.elsewhere"),
        &["--write", "app"],
        "started",
    );
    let entry = env.lock_entry("app").unwrap();
    assert_eq!(entry["holders"][0]["host"], "node07.elsewhere", "{entry}");
    remote.crash();
    let entry = env.lock_entry("app").unwrap();
    assert!(
        entry["holders"].as_array().unwrap().is_empty(),
        "stale remote record dropped: {entry}"
    );
    assert_eq!(entry["state"], "free");
    assert_eq!(entry["image_state"], "incomplete");
}

/// A reader writes no record; its lease names it. A command that closes
/// every descriptor it inherited but its image lock (closefrom) leaves the
/// lease to stowage alone: once stowage is SIGKILLed the lease is dead
/// while the command still holds the image. The reader must still be named
/// (as the holder record of a writer is, see `leases::`), on every look,
/// and its dead lease go once the lock is released.
#[test]
fn a_reader_whose_command_closes_its_lease_stays_named_after_stowage_dies() {
    let env = Env::new();
    env.make_image("app");
    let (mut bg, stowage) = start_closing_its_lease(&env, "--read");
    let command = command_of(stowage);
    bg.signal(libc::SIGKILL);
    let _ = bg.child.as_mut().unwrap().wait();
    assert!(!flock_free(&env.lock_file("app")), "the command holds it");
    // Every look names it (a look must not clean away what names it).
    for look in 0..3 {
        let entry = env.lock_entry("app").unwrap();
        let holders = entry["holders"].as_array().unwrap();
        assert_eq!(holders.len(), 1, "look {look}: {entry:#}");
        assert_eq!(
            holders[0]["stowage"], true,
            "look {look}: not an outsider: {entry:#}"
        );
        assert_eq!(
            holders[0]["pid"], command,
            "look {look}: stowage ({stowage}) is gone, its command holds it: {entry:#}"
        );
        assert!(
            holders[0]["command"]
                .as_str()
                .is_some_and(|c| c.contains("closes-its-lease")),
            "look {look}: the reader's command: {entry:#}"
        );
        assert_eq!(entry["state"], "shared", "{entry:#}");
        env.ok(["images"]);
    }
    env.release("release");
    wait_until("the command released the image lock", || {
        flock_free(&env.lock_file("app"))
    });
    let entry = env.lock_entry("app").unwrap();
    assert!(entry["holders"].as_array().unwrap().is_empty(), "{entry:#}");
    // The dead lease explains nothing now: it goes.
    env.ok(["lock-status"]);
    let left: Vec<_> = std::fs::read_dir(env.root.join("locks/leases"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "dead leases left: {left:?}");
    bg.kill_all();
}

/// A library caller that drops a session without finishing it releases its
/// locks, and its lease stops listing them: a long-lived process is never
/// named as the holder of a lock it let go (which another process may hold
/// now, where only leases can name holders).
#[test]
fn a_dropped_library_session_leaves_no_hold_line() {
    use stowage::session::{Request, Session};
    let env = Env::new();
    env.make_image("base");
    let mut store = stowage::Store::new(stowage::Root::at(&env.root));
    let req = Request {
        reads: vec![stowage::ImageName::parse("base").unwrap()],
        command: "library-reader".into(),
        ..Request::default()
    };
    let hold_lines = || -> usize {
        std::fs::read_dir(env.root.join("locks/leases"))
            .unwrap()
            .flatten()
            .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
            .map(|t| {
                t.lines()
                    .filter(|l| l.starts_with("hold=shared images/base.lock "))
                    .count()
            })
            .sum()
    };
    let session = Session::begin(&mut store, &req).unwrap();
    assert_eq!(hold_lines(), 1);
    drop(session);
    assert_eq!(hold_lines(), 0, "the dropped session is still listed");
    assert!(flock_free(&env.lock_file("base")));
}

/// The pid of the command local stowage process `stowage` runs (its one child).
fn command_of(stowage: u32) -> u64 {
    let children = fs::read_to_string(format!("/proc/{stowage}/task/{stowage}/children"));
    let children = children.unwrap_or_default();
    let first = children.split_whitespace().next();
    first
        .and_then(|p| p.parse().ok())
        .expect("stowage runs its command")
}

/// Starts `stowage exec MODE app -- bash -c …` whose command closes every
/// inherited descriptor of a lease (closefrom, a daemon's hygiene), keeping
/// the image lock, and waits for sentinel `release`; returns once the
/// command runs, with stowage's pid.
fn start_closing_its_lease(env: &Env, mode: &str) -> (Bg, u32) {
    let started = env.sentinel("started");
    let script = format!(
        "for fd in /proc/$$/fd/*; do case $(readlink \"$fd\") in */locks/leases/*) eval \"exec ${{fd##*/}}>&-\";; esac; done; \
         touch '{s}'; i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
        s = started.display(),
        r = env.sentinel("release").display()
    );
    let bg = env.spawn([
        "exec",
        mode,
        "app",
        "--",
        "bash",
        "-c",
        &script,
        "closes-its-lease",
    ]);
    wait_for_file(&started);
    let stowage = bg.pid();
    (bg, stowage)
}

#[test]
fn lock_status_in_a_container_with_nothing_held_sees_holders_outside_it() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    env.ok(["slots", "set", "pull", "2"]);
    let look_inside = || {
        let args: Vec<String> = ["lock-status", "--json"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let child = in_namespace(Some("inside"), &stowage_argv(&env, &args))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Bounded: with nothing held it must not wait for the global lock.
        parse(&wait_output(child, std::time::Duration::from_secs(60)))
    };
    // Nothing held: the same answer inside as here.
    assert_eq!(look_inside(), env.status_json(Vec::<String>::new()));
    // flock(1) outside holds the global lock: the table inside hides it,
    // a probe does not.
    let outsider = hold_global(&env);
    let st = look_inside();
    assert_eq!(st["locks"][0]["name"], "global", "{st}");
    assert_eq!(st["locks"][0]["state"], "exclusive", "{st}");
    outsider.kill_all();
    // A reader outside: its lease (which the table inside hides) sends the
    // look the database's way, which names it.
    let reader = env.hold(&["--read", "base"], "reader");
    let st = look_inside();
    let base = image_entry(&st, "base");
    assert_eq!(base["state"], "shared", "{st}");
    assert_eq!(base["holders"][0]["stowage"], true, "{st}");
    env.release("release");
    reader.finish();
}

/// The name a lease of this host, boot and pid namespace has (its first
/// three parts, as a stowage process here makes them), for a pid.
fn lease_name_here(env: &Env, pid: u32) -> String {
    let (started, release) = (format!("named-{pid}"), format!("unname-{pid}"));
    let holder = env.hold_until(&["--read", "base"], &started, &release);
    let name = std::fs::read_dir(env.root.join("locks/leases"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .find(|n| n.ends_with(".lease"))
        .expect("the holder's lease");
    env.release(&release);
    let out = holder.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let parts: Vec<&str> = name.split('-').collect();
    assert_eq!(parts.len(), 5, "{name}");
    format!(
        "{}-{}-{}-{pid}-00000000deadbeef.lease",
        parts[0], parts[1], parts[2]
    )
}

/// A lease nobody wrote may be its maker's between its create and its
/// lock, which is why a maker needs no re-check (lease.rs): a look leaves
/// it while its maker lives (or might: another host's), takes it once its
/// maker is known gone, or once it is older than the grace.
#[test]
fn a_lease_nobody_wrote_is_left_to_a_maker_that_may_lock_it() {
    let env = Env::new();
    env.make_image("base");
    let leases = env.root.join("locks/leases");
    let mut maker = Bg::from_command({
        let mut c = std::process::Command::new("sleep");
        c.arg("60");
        c
    });
    let alive = leases.join(lease_name_here(&env, maker.pid()));
    let dead_pid = {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    };
    let dead = leases.join(lease_name_here(&env, dead_pid));
    let elsewhere = leases.join("otherhost-0badb007-4026531836-42-00000000deadbeef.lease");
    for f in [&alive, &dead, &elsewhere] {
        std::fs::write(f, "").unwrap();
    }
    env.ok(["lock-status", "--all"]);
    assert!(alive.exists(), "a live maker's fresh lease was unlinked");
    assert!(
        !dead.exists(),
        "a dead maker's fresh lease of this host stayed"
    );
    assert!(
        elsewhere.exists(),
        "another host's fresh lease was unlinked"
    );
    // Past the grace (none here), whoever made them: no maker takes that
    // long between two calls without checking its file.
    let mut c = env.cmd(["lock-status", "--all"]);
    c.env(stowage::env::DEBUG_UNWRITTEN_LEASE_MS, "0");
    assert_eq!(output(c).status.code(), Some(0));
    assert!(!elsewhere.exists(), "an old fresh lease stayed");
    assert!(!alive.exists(), "an old fresh lease stayed");
    assert!(maker.is_running());
    maker.kill_all();
}

/// A look reads the lock table; a reader that held its image then and
/// ended (its locks released, its lease retired) before the look named the
/// holders is still named by its lease — the look lists and reads the
/// leases before the table — never shown as a process outside stowage (it
/// was, held by a gone process, before).
#[test]
fn a_reader_gone_after_a_looks_table_is_named_by_its_lease() {
    let env = Env::new();
    env.make_image("base");
    let reader = env.hold(&["--read", "base"], "reading");
    let (look, go) = env.paused(["lock-status", "--all", "--json"], "status-table-read");
    env.release("release");
    let held = reader.finish();
    assert_eq!(code(&held), Some(0), "{}", show(&held));
    std::fs::remove_file(&go).unwrap();
    let out = look.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let status: Value = serde_json::from_slice(&out.stdout).unwrap();
    let base = image_entry(&status, "base");
    let holders = base["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{base}");
    assert_eq!(holders[0]["stowage"], true, "shown as an outsider: {base}");
    assert!(holders[0]["lease"].is_string(), "{base}");
}

/// A lease nobody wrote is kept for a grace unless its maker is known
/// gone: its maker may be between its create and its lock. Its age must
/// not come from its mtime, which a client sets (an NFSv3 or 4.0
/// exclusive create stores its verifier there until the client's
/// SETATTR) — set here with `touch -d` while the maker, in another pid
/// namespace (so its name cannot show it alive), is stopped before its
/// first lock.
#[test]
fn a_lease_between_its_create_and_its_lock_is_not_judged_by_its_mtime() {
    if !root_or_skip("a pid namespace") || !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.make_image("X");
    let stopped = env.sentinel("stopped");
    let go = env.sentinel("go");
    let cmds = env.sentinel("gdb-cmds");
    std::fs::write(
        &cmds,
        format!(
            "set pagination off\ncatch syscall flock\nrun\n\
             shell touch '{s}'; i=0; while [ ! -e '{g}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done\n\
             delete\ncontinue\n",
            s = stopped.display(),
            g = go.display()
        ),
    )
    .unwrap();
    let mut c = Command::new("unshare");
    c.args([
        "--pid",
        "--fork",
        "--mount-proc",
        "gdb",
        "-q",
        "-batch",
        "-x",
    ])
    .arg(&cmds)
    .arg("--args")
    .arg(bin())
    .arg("--root")
    .arg(&env.root)
    .args(["exec", "--read", "X", "--"])
    .args(env.hold_cmd("started", "release"))
    .env_remove("STOWAGE_ROOT")
    .env_remove("STOWAGE_NOW");
    let maker = Bg::from_command(c);
    // Its first flock is its lease's: the file is made, not yet locked.
    wait_for_file(&stopped);
    let leases = env.root.join("locks/leases");
    let names: Vec<_> = std::fs::read_dir(&leases).unwrap().flatten().collect();
    assert_eq!(names.len(), 1, "{names:?}");
    let lease = names[0].path();
    assert_eq!(std::fs::metadata(&lease).unwrap().len(), 0);
    let out = Command::new("touch")
        .args(["-d", "2000-01-01"])
        .arg(&lease)
        .output()
        .unwrap();
    assert!(out.status.success());
    // Probers that clean leases.
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.ok(["lock-status", "--all"]);
    let kept = lease.exists();
    std::fs::write(&go, "").unwrap();
    wait_for_file(&env.sentinel("started"));
    let status = env.ok(["lock-status"]);
    env.release("release");
    let out = maker.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        kept,
        "a prober unlinked the lease of a live maker about to lock it"
    );
    let status = String::from_utf8_lossy(&status.stdout).into_owned();
    assert!(!status.contains("outside stowage"), "{status}");
}

/// Entries in the leases directory that are no leases (notes, files of
/// other tools) are left alone by every command that cleans leases.
#[test]
fn entries_in_the_leases_directory_that_are_no_leases_are_left_alone() {
    let env = Env::new();
    env.make_image("base");
    let leases = env.root.join("locks/leases");
    std::fs::write(leases.join("notes.txt"), "keep").unwrap();
    std::fs::write(leases.join("base.dirty"), "").unwrap();
    std::fs::write(leases.join("no%%lease"), "").unwrap();
    env.ok(["images"]);
    env.ok(["exec", "--write", "base", "--", "true"]);
    env.ok(["lock-status", "--all"]);
    env.ok(["gc"]);
    for f in ["notes.txt", "base.dirty", "no%%lease"] {
        assert!(leases.join(f).exists(), "{f} was removed");
    }
    assert_eq!(
        std::fs::read_to_string(leases.join("notes.txt")).unwrap(),
        "keep"
    );
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// Every command retires its lease: nothing is left in `locks/leases` once
/// they have ended (a dead process's lease is cleaned by the next look).
#[test]
fn commands_leave_no_lease_behind() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    env.ok(["exec", "--read", "base", "--write", "app", "--", "true"]);
    env.ok(["slots", "set", "pull", "1"]);
    env.ok(["exec", "--slot", "pull", "--read", "app", "--", "true"]);
    env.ok(["rm", "app"]);
    env.ok(["gc"]);
    let left: Vec<_> = fs::read_dir(env.root.join("locks/leases"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Runs shell `script` in a new pid namespace of its own (own /proc), with
/// `$S` the stowage binary and `$R` the root: there the script alone makes
/// processes, so it can give a pid it freed to the next one it starts
/// (`ns_last_pid`). Returns its output once it exits.
fn in_own_pids(env: &Env, script: &str) -> std::process::Output {
    let mut c = Command::new("unshare");
    c.args(["--pid", "--fork", "--mount-proc", "sh", "-eu", "-c", script])
        .env("S", bin())
        .env("R", &env.root)
        .env("T", &env.scratch)
        .env_remove("STOWAGE_ROOT")
        .env_remove("STOWAGE_NOW");
    wait_output(
        c.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
        Duration::from_secs(120),
    )
}

/// Shell functions for [`in_own_pids`]: `until_file F` waits (bounded) for
/// F; `as_pid P CMD…` starts CMD in the background as pid P (the pid just
/// freed), failing if another got it.
const PID_TOOLS: &str = r#"
until_file() { i=0; while [ ! -s "$1" ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; [ -s "$1" ]; }
as_pid() { p=$1; shift; echo $((p - 1)) > /proc/sys/kernel/ns_last_pid; "$@" & [ $! -eq $p ] || { echo "pid $p went to $!" >&2; exit 3; }; }
"#;

/// The one holder of `image` in `lock-status --json` output `text`.
fn only_holder(text: &str, image: &str) -> Value {
    let status: Value = serde_json::from_str(text).unwrap();
    let entry = image_entry(&status, image);
    let holders = entry["holders"].as_array().cloned().unwrap_or_default();
    assert_eq!(holders.len(), 1, "one holder of {image}: {entry:#}");
    holders[0].clone()
}

/// A pid the table shows is a lease owner's only while the process at that
/// pid is the owner: a killed stowage's pid, given to flock(1), names
/// flock(1) — in every view — both where the dead stowage's command still
/// holds its lease and image (an exec, which is named without a pid: no
/// signal to that pid reaches its command), and where its lease is dead
/// and lists the lock flock(1) now holds (an rm killed mid-removal). An
/// exec whose background job keeps its lock after the exec ended leaves
/// an unknown holder, not the process given its pid.
#[test]
fn a_dead_stowages_pid_given_to_another_process_names_that_process() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    for image in ["a", "b", "c", "d"] {
        env.make_image(image);
    }
    let script = format!(
        r#"{PID_TOOLS}
$S --root $R exec --read a -- sh -c 'echo $$ > $T/cmd; exec sleep 60' &
x=$!; until_file $T/cmd; kill -9 $x; wait $x || true
as_pid $x flock -x $R/locks/images/b.lock sleep 60
sleep 0.2; $S --root $R lock-status --json b > $T/exec.json
$S --root $R lock-status --json a > $T/exec-a.json
$S --root $R lock-status --json > $T/all.json
STOWAGE_DEBUG_PAUSE=rm-marked:$T/rm-paused $S --root $R rm c &
y=$!; until_file $T/rm-paused; kill -9 $y; wait $y || true
as_pid $y flock -x $R/locks/images/c.lock sleep 60
sleep 0.2; $S --root $R lock-status --json c > $T/rm.json
setpriv --reuid=65534 --regid=65534 --clear-groups $S --root $R lock-status --json c > $T/rm-nobody.json
$S --root $R exec --read d -- sh -c 'sleep 60 </dev/null >/dev/null 2>&1 &' &
z=$!; wait $z
as_pid $z sleep 60
sleep 0.2; $S --root $R lock-status --json d > $T/job.json
"#
    );
    let out = in_own_pids(&env, &script);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let json = |name: &str| fs::read_to_string(env.scratch.join(name)).unwrap();
    for (text, image) in [
        (json("exec.json"), "b"),
        (json("all.json"), "b"),
        (json("rm.json"), "c"),
        // One who cannot read flock(1)'s descriptors, root's.
        (json("rm-nobody.json"), "c"),
    ] {
        let h = only_holder(&text, image);
        assert_eq!(h["stowage"], false, "{image}: {h:#}");
        assert!(
            h["command"]
                .as_str()
                .is_some_and(|c| c.starts_with("flock")),
            "{image}: {h:#}"
        );
    }
    let a = only_holder(&json("exec-a.json"), "a");
    assert_eq!(a["stowage"], true, "{a:#}");
    assert_eq!(a["pid"], Value::Null, "{a:#}");
    let d = only_holder(&json("job.json"), "d");
    assert_eq!(d["pid"], Value::Null, "{d:#}");
    assert_eq!(d["command"], Value::Null, "{d:#}");
}

/// A holder the look's first table read showed, gone before its second,
/// its pid since given to a stowage process that holds nothing of the
/// lock: the lock is free, and nobody is named.
#[test]
fn a_holder_gone_during_a_look_is_not_named_by_its_pids_next_owner() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    let script = format!(
        r#"{PID_TOOLS}
flock -o -x $R/locks/images/b.lock sleep 60 &
f=$!; sleep 0.2
STOWAGE_DEBUG_PAUSE=status-table-read:$T/look-paused $S --root $R lock-status --json b > $T/look.json &
l=$!; until_file $T/look-paused
kill -9 $f; wait $f || true
as_pid $f $S --root $R exec --read a -- sh -c "touch $T/reading; exec sleep 60"
until_file_any() {{ i=0; while [ ! -e "$1" ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; }}
until_file_any $T/reading
rm $T/look-paused; wait $l
"#
    );
    let out = in_own_pids(&env, &script);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let text = fs::read_to_string(env.scratch.join("look.json")).unwrap();
    let entry = image_entry(&serde_json::from_str(&text).unwrap(), "b");
    assert_eq!(entry["state"], "free", "{entry:#}");
    assert_eq!(entry["holders"], serde_json::json!([]), "{entry:#}");
}

/// A removal lets go of each image once it is removed: the next holder
/// of the first image, while the removal waits at the second, is the one
/// holder named — from here (which sees the lock table) and from another
/// host (which sees only the leases).
#[test]
fn a_removal_names_only_the_images_it_still_holds() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    let (rm, pause) = env.paused(["rm", "a", "b"], "rm-marked");
    // Let it go on from `a`, to the same point at `b`.
    fs::remove_file(&pause).unwrap();
    wait_until("rm is at b", || {
        fs::read_to_string(&pause).is_ok_and(|s| !s.is_empty())
    });
    let writer = env.hold(&["--write", "a"], "writer");
    for (entry, from) in [
        (env.lock_entry("a").unwrap(), "here"),
        (
            image_entry(&status_from_elsewhere(&env, "hostC", "a"), "a"),
            "hostC",
        ),
    ] {
        assert_listed_once(&entry, &[("writer", our_hostname().as_str())], 0, from);
    }
    let b = env.lock_entry("b").unwrap();
    let holders = b["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{b:#}");
    assert!(
        holders[0]["command"].as_str().unwrap().contains("rm"),
        "{b:#}"
    );
    fs::remove_file(&pause).unwrap();
    let out = rm.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.release("release");
    writer.finish();
}

/// The survey of sizes (`images`, gc) holds each image it measures shared:
/// it is named by its lease, not shown as a process outside stowage — here
/// and on another host.
#[test]
fn a_size_measurement_is_named_by_its_lease() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("a");
    let (images, pause) = env.paused(["images"], "size-measuring");
    for (entry, from) in [
        (env.lock_entry("a").unwrap(), "here"),
        (
            image_entry(&status_from_elsewhere(&env, "hostC", "a"), "a"),
            "hostC",
        ),
    ] {
        let holders = entry["holders"].as_array().unwrap();
        assert_eq!(holders.len(), 1, "from {from}: {entry:#}");
        assert_eq!(holders[0]["stowage"], true, "from {from}: {entry:#}");
        assert!(
            holders[0]["command"]
                .as_str()
                .unwrap()
                .contains("measuring"),
            "from {from}: {entry:#}"
        );
    }
    fs::remove_file(&pause).unwrap();
    let out = images.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// In the first pid namespace the lock table keeps a dead taker's pid on
/// the locks its command inherited; given to flock(1), that pid must not
/// make flock(1)'s lock pass for the dead stowage's: the default view
/// lists it (it is no stowage holder's), as held by flock(1). The pid is
/// given with `ns_last_pid`, again until no other process took it first.
#[test]
fn a_reused_pid_on_this_host_hides_no_holder() {
    if unsafe { libc::geteuid() } != 0 || !stowage::kernel::shows_every_holder() {
        eprintln!("skipped: needs root in the first pid namespace");
        return;
    }
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    let script = format!(
        r#"{PID_TOOLS}
exec </dev/null
for attempt in $(seq 1 40); do
  rm -f $T/cmd
  $S --root $R exec --read a -- sh -c 'echo $$ > $T/cmd; exec sleep 60' >/dev/null 2>&1 &
  x=$!; until_file $T/cmd; kill -9 $x; wait $x || true
  echo $((x - 1)) > /proc/sys/kernel/ns_last_pid
  flock -o -x $R/locks/images/b.lock sleep 60 >/dev/null 2>&1 &
  f=$!
  [ $f -eq $x ] && break
  pkill -9 -P $f 2>/dev/null || true
  kill -9 $f $(cat $T/cmd) 2>/dev/null || true; wait $f 2>/dev/null || true
  f=
done
[ -n "$f" ] || {{ echo "no pid could be given again" >&2; exit 3; }}
sleep 0.2
$S --root $R lock-status --json > $T/all.json
pkill -9 -P $f 2>/dev/null || true
kill -9 $f $(cat $T/cmd) 2>/dev/null || true
"#
    );
    let mut c = Command::new("sh");
    c.args(["-eu", "-c", &script])
        .env("S", bin())
        .env("R", &env.root)
        .env("T", &env.scratch)
        .env_remove("STOWAGE_ROOT");
    let out = output(c);
    if code(&out) == Some(3) {
        eprintln!("skipped: another process took the pid every time");
        return;
    }
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let text = fs::read_to_string(env.scratch.join("all.json")).unwrap();
    let b = only_holder(&text, "b");
    assert_eq!(b["stowage"], false, "{b:#}");
    assert!(
        b["command"]
            .as_str()
            .is_some_and(|c| c.starts_with("flock")),
        "{b:#}"
    );
    let a = only_holder(&text, "a");
    assert_eq!(a["stowage"], true, "{a:#}");
    // Named by its command, which holds the lock, never by its dead stowage's pid.
    let command: u64 = fs::read_to_string(env.scratch.join("cmd"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(a["pid"], command, "{a:#}");
}

/// Shell functions for tests in the first pid namespace: `give PID CMD…`
/// starts CMD in the background as PID (freed just before), or fails if
/// another process took it first; `closing` is a command that closes the
/// lease it inherited and keeps its image lock (a daemon's hygiene).
const FIRST_NS_TOOLS: &str = r#"
exec </dev/null
until_file() { i=0; while [ ! -s "$1" ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; [ -s "$1" ]; }
give() { p=$1; shift; echo $((p - 1)) > /proc/sys/kernel/ns_last_pid; "$@" >/dev/null 2>&1 & [ $! -eq $p ] && return 0; kill -9 $! 2>/dev/null; return 1; }
closing='for fd in /proc/$$/fd/*; do case $(readlink "$fd") in */locks/leases/*) eval "exec ${fd##*/}>&-";; esac; done; echo $$ > "$0"; exec sleep 60'
"#;

/// Runs `script` (after [`FIRST_NS_TOOLS`]) with `$S`, `$R`, `$T`; `None`
/// (the reason printed) where it cannot run or no pid could be given.
fn in_first_ns(env: &Env, script: &str) -> Option<std::process::Output> {
    if unsafe { libc::geteuid() } != 0 || !stowage::kernel::shows_every_holder() {
        eprintln!("skipped: needs root in the first pid namespace");
        return None;
    }
    let mut c = Command::new("bash");
    c.args(["-eu", "-c", &format!("{FIRST_NS_TOOLS}\n{script}")])
        .env("S", bin())
        .env("R", &env.root)
        .env("T", &env.scratch)
        .env_remove("STOWAGE_ROOT");
    let out = output(c);
    if code(&out) == Some(3) {
        eprintln!("skipped: another process took the pid every time");
        return None;
    }
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    Some(out)
}

/// A dead taker's pid, given to a live stowage process, proves nothing of
/// the locks the table still shows under it: flock(1)'s lock kept by its
/// background child is not that exec's; a lock kept by a command that
/// closed its lease still shows in the default view; and cleaning keeps
/// the dead lease that names such a holder while another process of that
/// pid reads the same image.
#[test]
fn a_dead_takers_pid_given_to_a_stowage_process_proves_nothing() {
    let env = Env::new();
    for image in ["a", "b", "c", "d"] {
        env.make_image(image);
    }
    let script = r#"
ok=
for attempt in $(seq 1 40); do
  flock -s $R/locks/images/a.lock sh -c 'sleep 60 >/dev/null 2>&1 & echo $! > '$T'/bg; exit 0' &
  fl=$!; wait $fl; f=$(cat $T/bg)
  # flock(1) has ended, its background child keeping the lock: flock's
  # pid, the one the table shows, goes to a stowage exec.
  if give $fl $S --root $R exec --read b -- sleep 60; then e=$!; ok=1; break; fi
  kill -9 $f
done
[ -n "$ok" ] || exit 3
sleep 0.3
$S --root $R lock-status --json a > $T/a.json
setpriv --reuid=65534 --regid=65534 --clear-groups $S --root $R lock-status --json a > $T/a-nobody.json
kill -9 $e $f 2>/dev/null || true
ok=
for attempt in $(seq 1 40); do
  rm -f $T/cmd
  $S --root $R exec --read c -- bash -c "$closing" $T/cmd >/dev/null 2>&1 &
  x=$!; until_file $T/cmd; kill -9 $x; wait $x || true
  if give $x $S --root $R exec --read d -- sleep 60; then e=$!; ok=1; break; fi
  kill -9 $(cat $T/cmd)
done
[ -n "$ok" ] || exit 3
sleep 0.3
$S --root $R lock-status --json > $T/all.json
kill -9 $e 2>/dev/null || true; sleep 0.3
ok=
for attempt in $(seq 1 40); do
  if give $x flock -s $R/locks/images/c.lock sleep 2; then ok=1; break; fi
done
[ -n "$ok" ] || { kill -9 $(cat $T/cmd); exit 3; }
$S --root $R lock-status --json c > $T/c-during.json
sleep 2.5
$S --root $R lock-status --json c > $T/c-after.json
kill -9 $(cat $T/cmd) 2>/dev/null || true
"#;
    let Some(_) = in_first_ns(&env, script) else {
        return;
    };
    let json = |name: &str| fs::read_to_string(env.scratch.join(name)).unwrap();
    let a = only_holder(&json("a.json"), "a");
    assert_ne!(a["stowage"], true, "not the exec given the pid: {a:#}");
    // Nor for one who cannot read the holders' descriptors.
    let a = only_holder(&json("a-nobody.json"), "a");
    assert!(
        !a["command"]
            .as_str()
            .is_some_and(|c| c.contains("exec --read b")),
        "not the exec given the pid: {a:#}"
    );
    let all: Value = serde_json::from_str(&json("all.json")).unwrap();
    let c = image_entry(&all, "c");
    assert_eq!(c["state"], "shared", "the default view lists c: {all:#}");
    let c = only_holder(&json("c-after.json"), "c");
    assert_eq!(c["stowage"], true, "its dead lease still names it: {c:#}");
}

/// A lease planted by someone who can write the leases directory, naming
/// another process's pid (and start): the holder is shown by the pid the
/// lock table gives its lease's taker — the planter — never the victim's.
#[test]
fn a_planted_lease_never_names_a_process_that_holds_nothing() {
    if !tool_or_skip("python3", "python3") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let victim = Bg::from_command({
        let mut c = Command::new("sleep");
        c.arg("60");
        c
    });
    let v = victim.pid();
    let planted = env.sentinel("planted");
    let py = r#"
import fcntl, os, sys, time
root, victim, sentinel = sys.argv[1], int(sys.argv[2]), sys.argv[3]
stat = open(f"/proc/{victim}/stat").read()
start = stat[stat.rfind(")") + 2:].split()[19]
host = open("/proc/sys/kernel/hostname").read().strip()
boot = open("/proc/sys/kernel/random/boot_id").read().strip()
ns = os.readlink("/proc/self/ns/pid")
lease = os.open(f"{root}/locks/leases/{host}-x-x-{victim}-planted.lease", os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(lease, fcntl.LOCK_EX)
os.write(lease, f"host={host}\npid={victim}\npid_ns={ns}\nboot_id={boot}\nstart={start}\nuser=victim\ncommand=make world\nhold=shared images/base.lock 0 make world\n".encode())
img = os.open(f"{root}/locks/images/base.lock", os.O_RDWR)
fcntl.flock(img, fcntl.LOCK_SH)
open(sentinel, "w").write("x")
time.sleep(30)
"#;
    let mut c = Command::new("python3");
    c.args(["-c", py])
        .arg(&env.root)
        .arg(v.to_string())
        .arg(&planted);
    let planter = Bg::from_command(c);
    wait_for_file(&planted);
    let entry = env.lock_entry("base").unwrap();
    let holders = entry["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{entry:#}");
    assert_ne!(holders[0]["pid"], v, "the victim is named: {entry:#}");
    let out = env.run(["exec", "--write", "base", "--wait", "0.1", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert!(
        !stderr(&out).contains(&format!("pid {v} ")),
        "{}",
        show(&out)
    );
    planter.kill_all();
    victim.kill_all();
}

/// A look cleans the leases it listed only: a lease made while it looked
/// — here of a reader whose command closed it and whose stowage was then
/// killed, so that the lease alone names the holder — is left for the
/// next look to judge, which keeps it.
#[test]
fn a_lease_made_during_a_look_is_not_cleaned_by_it() {
    let env = Env::new();
    env.make_image("app");
    let (look, pause) = env.paused(["lock-status"], "status-table-read");
    let (mut bg, _) = start_closing_its_lease(&env, "--read");
    bg.signal(libc::SIGKILL);
    let _ = bg.child.as_mut().unwrap().wait();
    fs::remove_file(&pause).unwrap();
    let out = look.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let entry = env.lock_entry("app").unwrap();
    let holders = entry["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{entry:#}");
    assert_eq!(holders[0]["stowage"], true, "named by its lease: {entry:#}");
    env.release("release");
}

/// A look never stats a file through another process's descriptor links:
/// a stat follows the link into that file's filesystem, which may hang (a
/// stopped FUSE server, a gone NFS server) and with it every look and
/// every waiter's message. The links' names and fdinfo say enough.
#[test]
fn a_look_never_stats_through_another_processs_descriptors() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let env = Env::new();
    env.make_image("x");
    let mut flock = Command::new("flock");
    flock
        .arg("-x")
        .arg(env.lock_file("x"))
        .args(env.hold_cmd("by-flock", "release"));
    let flock = Bg::from_command(flock);
    wait_for_file(&env.sentinel("by-flock"));
    let log = env.scratch.join("look.strace");
    let mut c = Command::new("strace");
    c.args(["-f", "-e", "trace=%stat,statx,newfstatat", "-o"])
        .arg(&log)
        .arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(["lock-status", "x"])
        .env_remove("STOWAGE_ROOT");
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("flock"),
        "{}",
        show(&out)
    );
    let trace = fs::read_to_string(&log).unwrap();
    let through: Vec<_> = trace
        .lines()
        .filter(|l| {
            l.split('"')
                .nth(1)
                .is_some_and(|p| p.starts_with("/proc/") && p.contains("/fd/"))
        })
        .collect();
    assert!(through.is_empty(), "{through:#?}");
    env.release("release");
    flock.finish();
}

/// A container of this host with a host name of its own: its holder is
/// shown by this namespace's pid, and `--why` says to kill that pid here,
/// not "on" the container's host name (where the pid is another).
#[test]
fn why_says_to_kill_a_containers_holder_here() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("y");
    let h = Host::hold(&env, Some("ct"), &["--write", "y"], "ct-writer");
    let waiter = env.spawn(["exec", "--read", "y", "--", "true"]);
    env.wait_for_waiter("y");
    let out = env.run(["lock-status", "--why", "y"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!text.contains("on ct, kill"), "{text}");
    let entry = env.lock_entry("y").unwrap();
    let pid = entry["holders"][0]["pid"].clone();
    assert!(text.contains(&format!(": kill {pid}")), "{text}");
    drop(h);
    waiter.kill_all();
}

// --- leases announced late, where each request is a round trip --------------

/// `cmd` made to see the store as on a shared filesystem, its exec making
/// the lease it names only `announce_ms` in.
fn on_shared_fs(mut c: Command, announce_ms: u64) -> Command {
    c.env(stowage::env::DEBUG_FILESYSTEM, "nfs")
        .env(stowage::env::DEBUG_ANNOUNCE_MS, announce_ms.to_string());
    c
}

/// On a shared filesystem an exec whose command ends before its lease is
/// due never makes one (its create, synced write and unlink are each a
/// request to the server); on a local one the lease is there before the
/// command starts. Either way the write is recorded as ever.
#[test]
fn an_exec_that_ends_before_its_lease_is_due_makes_none() {
    let env = Env::new();
    env.make_image("base");
    let script = r#"ls -A "$STOWAGE_ROOT/locks/leases"; echo "lease: $STOWAGE_EXEC_LEASES""#;
    let run = |shared: bool| {
        let mut c = env.cmd([
            "exec", "--read", "base", "--write", "app", "--", "sh", "-c", script,
        ]);
        if shared {
            c = on_shared_fs(c, 600_000);
        }
        let out = output(c);
        assert_eq!(code(&out), Some(0), "{}", show(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let shared = run(true);
    let mut lines = shared.lines();
    let named = lines.next().unwrap_or_default();
    assert!(
        named.starts_with("lease: ") && named.ends_with(".lease"),
        "the command is told the lease's name: {shared}"
    );
    assert!(lines.next().is_none(), "a lease was made: {shared}");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    let local = run(false);
    assert_eq!(
        local.lines().count(),
        2,
        "no lease on a local filesystem: {local}"
    );
    let left: Vec<_> = fs::read_dir(env.root.join("locks/leases"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A holder whose lease is announced late is named by it once it is due,
/// without a lock table (as from another host): by its pid and command,
/// never as an outsider for good.
#[test]
fn a_holder_is_named_once_its_late_lease_is_due() {
    let env = Env::new();
    env.make_image("base");
    let bg = env.hold_with(&["--read", "base"], "started", |c| {
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs")
            .env(stowage::env::DEBUG_ANNOUNCE_MS, "200");
    });
    wait_until("the reader is named by its lease", || {
        let out = output(on_shared_fs(
            env.cmd(["lock-status", "--json", "base"]),
            200,
        ));
        let st: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let entry = image_entry(&st, "base");
        entry["holders"][0]["pid"] == bg.pid() && entry["holders"][0]["stowage"] == true
    });
    env.release("release");
    assert_eq!(code(&bg.finish()), Some(0));
}

/// A process that waits for a lock makes its lease at once, however late
/// it would have announced it: waiters and their queue are named.
#[test]
fn a_waiter_makes_its_lease_at_once() {
    let env = Env::new();
    env.make_image("base");
    let holder = env.hold_with(&["--write", "base"], "started", |c| {
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs")
            .env(stowage::env::DEBUG_ANNOUNCE_MS, "600000");
    });
    let waiter = Bg::from_command(on_shared_fs(
        env.cmd(["exec", "--read", "base", "--", "true"]),
        600_000,
    ));
    wait_until("the waiter lists what it awaits", || {
        waiter_lines(&env)
            .iter()
            .any(|l| l.starts_with("await=shared images/base.lock "))
    });
    let leases = fs::read_dir(env.root.join("locks/leases")).unwrap().count();
    assert_eq!(leases, 1, "the holder, not due yet, has none");
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
    assert_eq!(code(&waiter.finish()), Some(0));
}

/// A stowage call nested in an exec's command at once, before the exec's
/// lease is made (here 1.5 s in: a loaded host, a slow server), that would
/// wait for a lock the exec holds still knows the exec as enclosing it
/// once the lease is made, not after its wait: a write of the image the
/// exec reads fails, a slot of the class whose only slot the exec holds
/// is worked under, a store-wide command fails — whether the environment
/// names the lease or was cleared on the way. Its parent closes every
/// inherited descriptor (Python's subprocess does), so only the lease can
/// tell.
#[test]
fn a_call_nested_before_its_enclosing_exec_is_announced_knows_it() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["slots", "set", "one", "1"]);
    let cases: [(&[&str], &str, Option<&str>); 3] = [
        (
            &["--read", "base"],
            "'--write', 'base'",
            Some("enclosing command"),
        ),
        (&["--slot", "one"], "'--slot', 'one'", None),
        (
            &["--read", "base"],
            "'--store-wide'",
            Some("enclosing command"),
        ),
    ];
    for ((outer, inner, refused), cleared) in cases.iter().flat_map(|c| [(c, false), (c, true)]) {
        let environment = if cleared {
            "env={'PATH': os.environ['PATH'], 'STOWAGE_DEBUG_FILESYSTEM': 'nfs'}"
        } else {
            "env=os.environ"
        };
        // The inner call's own announcement time is the default: it looks again while it waits.
        let call = format!(
            "import os, subprocess, sys; os.environ.pop('STOWAGE_DEBUG_ANNOUNCE_MS'); \
             sys.exit(subprocess.run(['{bin}', '--root', '{root}', \
             'exec', {inner}, '--wait', '60', '--', 'true'], {environment}).returncode)",
            bin = bin(),
            root = env.root.display()
        );
        let mut args = vec!["exec"];
        args.extend_from_slice(outer);
        args.extend(["--", "python3", "-c", &call]);
        let out = output(on_shared_fs(env.cmd(&args), 1500));
        let case = format!("{inner} in {outer:?}, environment cleared {cleared}");
        match refused {
            Some(why) => {
                assert_eq!(code(&out), Some(75), "{case}: {}", show(&out));
                assert!(stderr(&out).contains(why), "{case}: {}", show(&out));
            }
            None => assert_eq!(code(&out), Some(0), "{case}: {}", show(&out)),
        }
    }
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// A command whose stowage was SIGKILLed after it announced its lease
/// still holds its locks (inherited descriptors), but not the lease (made
/// after the command started): without a lock table its dead lease keeps
/// the locks listed as held, by a holder it cannot name (the lock may be
/// anyone's since), and the lease goes once they are free.
#[test]
fn a_command_whose_stowage_died_keeps_its_locks_listed() {
    let env = Env::new();
    env.make_image("base");
    let c = env.cmd([
        "exec",
        "--read",
        "base",
        "--",
        "sh",
        "-c",
        &format!(
            "touch '{}'; while [ ! -e '{}' ]; do sleep 0.01; done",
            env.sentinel("started").display(),
            env.sentinel("release").display()
        ),
    ]);
    let mut bg = Bg::from_command(on_shared_fs(c, 0));
    wait_for_file(&env.sentinel("started"));
    // Listing the lock, not only made: on a shared filesystem a lease is made, then written, and
    // a kill between the two leaves a hold no lease names.
    wait_until("the lease lists the lock", || {
        let leases: Vec<_> = fs::read_dir(env.root.join("locks/leases"))
            .unwrap()
            .map(|e| fs::read_to_string(e.unwrap().path()).unwrap_or_default())
            .collect();
        leases.len() == 1 && leases[0].contains("hold=shared")
    });
    bg.signal(libc::SIGKILL);
    let _ = bg.child.as_mut().unwrap().wait();
    let look = || {
        let out = output(on_shared_fs(env.cmd(["lock-status", "--json"]), 0));
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let entry = image_entry(&look(), "base");
    assert_eq!(entry["state"], "shared", "{entry:#}");
    let holders = entry["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{entry:#}");
    assert_eq!(holders[0]["pid"], Value::Null, "{entry:#}");
    env.release("release");
    wait_until("the command released the lock", || {
        flock_free(&env.lock_file("base"))
    });
    let st = look();
    assert!(
        st["locks"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["name"] != "base"),
        "{st:#}"
    );
    let left = fs::read_dir(env.root.join("locks/leases")).unwrap().count();
    assert_eq!(left, 0, "the dead lease stayed");
    bg.kill_all();
}

/// A call nested in an exec that announces late, reaching the same root
/// through another path (a bind mount, as a container sees it), still
/// waits for the exec's lease and knows it as enclosing: an ancestor is
/// judged an exec of this root by the inodes of the lock files it holds,
/// not by their paths.
#[test]
fn a_call_nested_through_another_path_to_the_root_knows_its_late_enclosing_exec() {
    if !root_or_skip("bind mounts") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let other = env.scratch.join("elsewhere");
    fs::create_dir_all(&other).unwrap();
    let mounted = Command::new("mount")
        .arg("--bind")
        .arg(&env.root)
        .arg(&other)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("skipping: cannot bind-mount here");
        return;
    }
    let call = format!(
        "import os, subprocess, sys; os.environ.pop('STOWAGE_DEBUG_ANNOUNCE_MS'); \
         sys.exit(subprocess.run(['{bin}', '--root', '{other}', 'exec', '--write', 'base', \
         '--wait', '60', '--', 'true']).returncode)",
        bin = bin(),
        other = other.display()
    );
    let c = env.cmd(["exec", "--read", "base", "--", "python3", "-c", &call]);
    let out = output(on_shared_fs(c, 1500));
    let _ = Command::new("umount").arg(&other).status();
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert!(stderr(&out).contains("enclosing command"), "{}", show(&out));
}

/// A dead lease lingers until a look cleans it. Where its pid is taken again by an ancestor of a
/// later call (pids repeat, soonest in containers), that ancestor is not the enclosing exec the
/// lease names: the call waits for the lock like anyone, and no reader passes a waiting writer.
#[test]
fn a_dead_lease_whose_pid_an_ancestor_reuses_names_no_enclosing_exec() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    // In a pid namespace of its own, pids are handed out in order, and ns_last_pid sets the next.
    let script = format!(
        r#"B='{bin}'; R='{root}'; S='{scratch}'
        await_file() {{ i=0; while [ ! -e "$1" ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; }}
        "$B" --root "$R" exec --read base -- sh -c "touch $S/reader; exec sleep 100" &
        X=$!; await_file "$S/reader"
        kill -9 $(cat /proc/$X/task/$X/children) $X; wait $X
        "$B" --root "$R" exec --write base -- sh -c "touch $S/holder; sleep 1" &
        H=$!; await_file "$S/holder"
        echo $((X - 1)) > /proc/sys/kernel/ns_last_pid
        sh -c 'echo pid=$$; "$1" --root "$2" exec --write base --wait 20 -- true; echo rc=$?' sh "$B" "$R"
        echo dead=$X; wait $H"#,
        bin = bin(),
        root = env.root.display(),
        scratch = env.scratch.display(),
    );
    let mut c = Command::new("unshare");
    c.args(["--pid", "--fork", "--mount-proc", "sh", "-c", &script]);
    c.env_remove("STOWAGE_ROOT")
        .env_remove(stowage::env::EXEC_LEASES);
    let out = output(c);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(str::to_owned)
    };
    let pid = field("pid=");
    assert!(pid.is_some(), "{}", show(&out));
    assert_eq!(pid, field("dead="), "the pid was reused: {}", show(&out));
    assert_eq!(field("rc=").as_deref(), Some("0"), "{}", show(&out));
    assert!(!stderr(&out).contains("never end"), "{}", show(&out));
}

/// Starts a holder of `base`'s write lock, then runs `sh -c SCRIPT` where SCRIPT may plant what it
/// likes before `$B --root $R exec --write base --wait 20 -- true`, and returns its exit status
/// and what it said; the holder is let go once the call has begun to wait, or ended.
fn write_beside_a_holder(env: &Env, plant: &str) -> (Option<i32>, String) {
    let holder = env.hold_until(&["--write", "base"], "held", "let-go");
    let script = format!(
        "B='{bin}'; R='{root}'; k=; {plant}\n\"$B\" --root \"$R\" exec --write base --wait 20 -- true; \
         rc=$?; [ -z \"$k\" ] || kill $k; exit $rc",
        bin = bin(),
        root = env.root.display(),
    );
    let mut c = Command::new("sh");
    c.args(["-c", &script])
        .env_remove("STOWAGE_ROOT")
        .env_remove(stowage::env::EXEC_LEASES);
    let mut call = Bg::from_command(c);
    // Its lease lists the lock as awaited once it waits (read directly: a look would clean leases).
    let awaits = || {
        fs::read_dir(env.root.join("locks/leases"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                fs::read_to_string(e.path())
                    .is_ok_and(|t| t.contains("await=exclusive images/base.lock"))
            })
    };
    let started = std::time::Instant::now();
    while !awaits()
        && started.elapsed() < Duration::from_secs(20)
        && call.child.as_mut().unwrap().try_wait().unwrap().is_none()
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    env.release("let-go");
    assert_eq!(holder.finish().status.code(), Some(0));
    let out = call.finish();
    (out.status.code(), stderr(&out))
}

/// A dead lease that names our own shell — its pid, its start, our host, boot and namespaces —
/// as the holder of a lock (left by a killed exec whose pid the shell took in the same clock tick
/// of the start time) names no enclosing exec: it is dead.
#[test]
fn a_dead_lease_naming_an_ancestor_to_its_start_names_no_enclosing_exec() {
    let env = Env::new();
    env.make_image("base");
    let (rc, err) = write_beside_a_holder(&env, &plant_lease(""));
    assert!(env.root.join("locks/leases/planted.lease").exists());
    assert_eq!(rc, Some(0), "{err}");
    assert!(!err.contains("never end"), "{err}");
}

/// The same lease kept alive by another process (as a command keeps its killed stowage's lease):
/// still not our shell's, which does not have it open.
#[test]
fn a_live_lease_naming_an_ancestor_that_does_not_hold_it_names_no_enclosing_exec() {
    let env = Env::new();
    env.make_image("base");
    let keep = "flock -o -x \"$L\" sleep 30 >/dev/null 2>&1 & k=$!; while flock -n -s \"$L\" true; do sleep 0.01; done";
    let (rc, err) = write_beside_a_holder(&env, &plant_lease(keep));
    assert_eq!(rc, Some(0), "{err}");
    assert!(!err.contains("never end"), "{err}");
}

/// An exec taking `locks` whose command saves its `STOWAGE_EXEC_LEASES` (as `export -p` would) and
/// waits for sentinel `release`; with what it saved.
fn holder_saving_its_environment(env: &Env, locks: &[&str]) -> (Bg, String) {
    let saved = env.sentinel("saved");
    let holder = env.start_sh(locks, |started| {
        format!(
            "printf %s \"$STOWAGE_EXEC_LEASES\" > '{saved}'; touch '{started}'; \
             i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
            saved = saved.display(),
            started = started.display(),
            r = env.sentinel("release").display()
        )
    });
    (holder, fs::read_to_string(&saved).unwrap())
}

/// An environment saved under an exec (`export -p`, as CI steps do) and restored by a process the
/// exec does not run names a live lease whose owner is no ancestor of that process: it encloses
/// nothing. A full slot class is not worked under (two commands under a limit of 1), and a write
/// of the image the exec reads is busy like anyone's, not refused as a wait for itself.
#[test]
fn a_restored_environment_names_no_enclosing_exec_unless_its_owner_is_an_ancestor() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["slots", "set", "pull", "1"]);
    let (holder, leaked) =
        holder_saving_its_environment(&env, &["--slot", "pull", "--read", "base"]);
    assert!(leaked.ends_with(".lease"), "{leaked:?}");
    let restored = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env(stowage::env::EXEC_LEASES, &leaked);
        output(c)
    };
    let out = restored(&["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert_eq!(code(&out), Some(75), "ran past the limit: {}", show(&out));
    assert!(stderr(&out).contains("all in use by pid"), "{}", show(&out));
    let out = restored(&["exec", "--write", "base", "--no-wait", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert!(!stderr(&out).contains("enclosing"), "{}", show(&out));
    assert!(
        stderr(&out).contains("held (read) by pid"),
        "{}",
        show(&out)
    );
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// The same restored environment, used from a UTS namespace of its own (another host name, the
/// same boot and pid namespace: the lease's pid still numbers a process as ours): no enclosing exec
/// either. Before, the other host name made the environment's word stand, and a read of an image
/// held for an exclusive read ran "under" it with no lock, beside the writer that came next.
#[test]
fn a_restored_environment_in_a_uts_namespace_of_its_own_names_no_enclosing_exec() {
    if !root_or_skip("a UTS namespace (unshare --uts)") || !tool_or_skip("unshare", "util-linux") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let (holder, leaked) = holder_saving_its_environment(&env, &["--read-exclusive", "base"]);
    let mut c = Command::new("unshare");
    c.args([
        "--uts",
        "sh",
        "-c",
        "hostname elsewhere && exec \"$@\"",
        "sh",
        bin(),
    ]);
    c.args(["--root".as_ref(), env.root.as_os_str()]);
    c.args(["exec", "--read", "base", "--no-wait", "--", "true"]);
    c.env(stowage::env::EXEC_LEASES, &leaked);
    let out = output(c);
    assert_eq!(
        code(&out),
        Some(75),
        "ran under another's exclusive read: {}",
        show(&out)
    );
    assert!(
        stderr(&out).contains("held (exclusive read) by pid"),
        "{}",
        show(&out)
    );
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
}

/// A script that plants lease `planted.lease` naming the shell that runs it (pid, start, host,
/// boot, namespaces) as a holder of `base`'s lock, then runs `then`.
fn plant_lease(then: &str) -> String {
    let plant = r#"L="$R/locks/leases/planted.lease"; s=$$
        start=$(sed 's/.*) //' /proc/$s/stat | cut -d' ' -f20)
        printf 'host=%s\npid=%s\npid_ns=%s\ntime_ns=%s\nstart=%s\nboot_id=%s\nuser=u\ncommand=planted\nsince=1\nwithin=\nhold=shared images/base.lock 1 planted\n' \
          "$(uname -n)" $s "$(readlink /proc/self/ns/pid)" "$(readlink /proc/self/ns/time)" \
          "$start" "$(cat /proc/sys/kernel/random/boot_id)" > "$L""#;
    format!("{plant}\n{then}")
}

/// Process start times in `/proc` are shifted by the reader's time namespace: a call nested in
/// another one (its environment cleared, no descriptor inherited: `--no-inherit`) still knows the
/// exec that runs it by its lease, and fails at once instead of waiting for itself.
#[test]
fn a_call_nested_in_another_time_namespace_knows_its_enclosing_exec() {
    if unsafe { libc::geteuid() } != 0
        || !Command::new("unshare")
            .args(["-T", "-f", "--boottime", "1000", "true"])
            .status()
            .is_ok_and(|s| s.success())
    {
        eprintln!("skipped: `unshare -T --boottime` (a time namespace) does not work here");
        return;
    }
    knows_its_enclosing_exec_through("unshare -T -f --boottime 1000");
}

/// `stowage exec --no-inherit --write base -- sh -c 'env -i WRAPPER stowage exec --write base …'`:
/// the nested call, with neither the environment nor an inherited descriptor to go by, must fail
/// at once (75, "would never end") rather than wait 30 s for its own enclosing exec.
fn knows_its_enclosing_exec_through(wrapper: &str) {
    let env = Env::new();
    env.make_image("base");
    let inner = format!(
        "env -i {wrapper} '{bin}' --root '{root}' exec --write base --wait 30 -- true",
        bin = bin(),
        root = env.root.display()
    );
    let outer = ["exec", "--no-inherit", "--write", "base", "--", "sh", "-c"];
    let out = env.run(outer.iter().copied().chain([inner.as_str()]));
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(stderr(&out).contains("never end"), "{}", show(&out));
}

/// A call nested under another group and without capabilities (`sg`, `setpriv`) may list the
/// enclosing exec's descriptors but not read their links: it cannot see the lease open there, so
/// it goes by the exec's start, and still knows its enclosing exec.
#[test]
fn a_call_nested_that_cannot_read_its_ancestors_descriptors_knows_its_enclosing_exec() {
    let drop = [
        "--regid=1",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
    ];
    if unsafe { libc::geteuid() } != 0
        || !Command::new("setpriv")
            .args(drop)
            .arg("true")
            .status()
            .is_ok_and(|s| s.success())
    {
        eprintln!("skipped: needs root and setpriv(1) to drop group and capabilities");
        return;
    }
    knows_its_enclosing_exec_through(&format!("setpriv {}", drop.join(" ")));
}

/// A command with a long command line, waiting for its slot with many images to take after it, is
/// listed as waiting, and gc keeps those images: every lease line repeated the command, and past
/// what readers read of a lease (64 KiB) the wait was not seen and an image it queued was removed.
#[test]
fn a_long_command_waiting_with_many_images_is_listed_and_its_images_kept() {
    let env = Env::new();
    env.ok(["slots", "set", "c", "1"]);
    let names: Vec<String> = (0..8).map(|i| format!("img{i}")).collect();
    for name in &names {
        env.make_image_used_long_ago(name);
    }
    let slot = env.hold_until(&["--slot", "c"], "slot", "go");
    let mut args = vec!["exec".to_owned(), "--slot".into(), "c".into()];
    for name in &names {
        args.extend(["--read".into(), name.clone()]);
    }
    let long = "x".repeat(15_000);
    args.extend([
        "--".into(),
        "sh".into(),
        "-c".into(),
        format!("true {long}"),
    ]);
    let waiter = env.spawn(args);
    env.wait_for_slot_waiters("c", 1);
    let out = env.ok(["gc", "--unused-for", "1d", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["removed"], serde_json::json!([]), "{report}");
    env.release("go");
    for bg in [slot, waiter] {
        let out = bg.finish();
        assert_eq!(code(&out), Some(0), "{}", show(&out));
    }
}

/// A container's exec SIGKILLed: its command keeps the lock and the lease
/// (it inherited both). Seen from another container, where neither the lock
/// table nor /proc shows that exec's pid, the pid the lease gives may be
/// gone: lock-status says the command it ran may hold it instead, never
/// the dead exec's pid alone.
#[test]
fn a_lock_kept_in_a_container_after_its_exec_died_is_not_credited_to_that_pid_alone() {
    if !namespaces() {
        return;
    }
    let env = Env::new();
    let host = Host::hold(&env, None, &["--write", "u"], "inside");
    let init = host.init();
    let children = fs::read_to_string(format!("/proc/{init}/task/{init}/children")).unwrap();
    let stowage: u32 = children.split_whitespace().next().unwrap().parse().unwrap();
    // SAFETY: the exec this test started, in its namespace.
    unsafe { libc::kill(stowage as i32, libc::SIGKILL) };
    wait_until("the exec in the container is gone", || {
        !fs::read_to_string(format!("/proc/{init}/task/{init}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .any(|c| c == stowage.to_string())
    });
    let args = ["lock-status", "u"].map(String::from);
    let out = output(in_namespace(None, &stowage_argv(&env, &args)));
    host.crash();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let text = stdout(&out);
    assert!(text.contains("(in another pid namespace)"), "{text}");
    assert!(text.contains("if that exec has ended"), "{text}");
}
