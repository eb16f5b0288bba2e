//! One store shared by several hosts on a real shared filesystem
//! (GlusterFS: each host its own namespaces and FUSE client; see
//! cluster.rs): locks exclude across hosts, holders are named from every
//! host, a host's crash leaves nothing held and nothing ready that was being
//! written, and the catalog survives transactions from every host at once.
//! Skipped, saying why, where no volume runs.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use serde_json::Value;

use crate::cluster::{Cluster, Host};
use crate::common::*;

/// A script that says it started (a file in the test's scratch, which every
/// host sees: only the volume is mounted per host), then waits for a
/// release file.
fn hold_script(started: &Path, release: &Path) -> String {
    format!(
        "touch '{}'; while [ ! -e '{}' ]; do sleep 0.05; done",
        started.display(),
        release.display()
    )
}

/// Starts `exec LOCKS -- hold` on `host`, and waits until its command runs.
fn hold(env: &Env, host: &Host, root: &Path, locks: &[&str], tag: &str) -> Bg {
    let started = env.sentinel(&format!("{tag}.started"));
    let release = env.sentinel(&format!("{tag}.release"));
    let mut args: Vec<String> = vec!["exec".into()];
    args.extend(locks.iter().map(|s| s.to_string()));
    args.extend(["--".into(), "sh".into(), "-c".into()]);
    args.push(hold_script(&started, &release));
    let bg = Bg::from_command(host.stowage(root, &args));
    wait_for_file(&started);
    bg
}

fn release(env: &Env, tag: &str) {
    std::fs::write(env.sentinel(&format!("{tag}.release")), "").unwrap();
}

fn ok(out: Output) -> Output {
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    out
}

fn status(host: &Host, root: &Path, args: &[&str]) -> Value {
    let mut a = vec!["lock-status", "--json"];
    a.extend(args);
    let out = ok(host.stowage_run(root, &a));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn image_lock<'a>(st: &'a Value, name: &str) -> Option<&'a Value> {
    st["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "image" && l["name"] == name)
}

fn image_state(host: &Host, root: &Path, name: &str) -> Option<String> {
    let out = ok(host.stowage_run(root, ["images", "--json"]));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == name)
        .map(|i| i["state"].as_str().unwrap().to_owned())
}

#[test]
fn writers_exclude_each_other_and_readers_share_across_hosts() {
    let Some(c) = Cluster::start("excl", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    ok(a.stowage_run(&root, ["exec", "--write", "base", "--", "true"]));
    let reader = hold(&env, a, &root, &["--read", "base"], "r");
    ok(b.stowage_run(&root, ["exec", "--read", "base", "--no-wait", "--", "true"]));
    let out = b.stowage_run(
        &root,
        ["exec", "--write", "base", "--no-wait", "--", "true"],
    );
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    let said = stderr(&out);
    assert!(
        said.contains(&format!("on {}", a.name)),
        "names the host: {said}"
    );
    assert!(said.contains("sh -c"), "names the command: {said}");
    release(&env, "r");
    ok(reader.finish());

    let writer = hold(&env, a, &root, &["--write", "base"], "w");
    for args in [["--read", "base"], ["--write", "base"]] {
        let mut a2 = vec!["exec"];
        a2.extend(args);
        a2.extend(["--no-wait", "--", "true"]);
        let out = b.stowage_run(&root, &a2);
        assert_eq!(code(&out), Some(75), "{args:?}: {}", show(&out));
    }
    release(&env, "w");
    ok(writer.finish());
    ok(b.stowage_run(
        &root,
        ["exec", "--write", "base", "--no-wait", "--", "true"],
    ));
}

#[test]
fn a_waiter_on_another_host_names_the_holder_and_gets_in_when_it_ends() {
    let Some(c) = Cluster::start("wait", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    ok(a.stowage_run(&root, ["exec", "--write", "base", "--", "true"]));
    let reader = hold(&env, a, &root, &["--read", "base"], "r");
    let log = std::fs::File::create(env.sentinel("waiter.log")).unwrap();
    let mut w = b.stowage(&root, ["exec", "--write", "base", "--", "true"]);
    w.stderr(log);
    let mut waiter = Bg::from_command_keep_stderr(w);
    wait_until("the waiter says what it waits for", || {
        std::fs::read_to_string(env.sentinel("waiter.log"))
            .unwrap_or_default()
            .contains("waiting for write lock on image 'base'")
    });
    let said = std::fs::read_to_string(env.sentinel("waiter.log")).unwrap();
    assert!(said.contains(&format!("on {}", a.name)), "{said}");
    assert!(waiter.is_running());
    release(&env, "r");
    ok(reader.finish());
    ok(waiter.finish());
}

#[test]
fn lock_status_on_every_host_lists_each_holder_once_and_no_outsider() {
    let Some(c) = Cluster::start("status", 3) else {
        return;
    };
    let env = Env::new();
    let root = c.root();
    ok(c.host(0)
        .stowage_run(&root, ["exec", "--write", "base", "--", "true"]));
    let reader = hold(&env, c.host(0), &root, &["--read", "base"], "r");
    let writer = hold(&env, c.host(1), &root, &["--write", "app"], "w");
    for h in &c.hosts {
        let st = status(h, &root, &["--all"]);
        let base = image_lock(&st, "base").unwrap_or_else(|| panic!("{st}"));
        let app = image_lock(&st, "app").unwrap_or_else(|| panic!("{st}"));
        assert_eq!(base["state"], "shared", "from {}: {st}", h.name);
        assert_eq!(app["state"], "exclusive", "from {}: {st}", h.name);
        for (lock, host) in [(base, &c.host(0).name), (app, &c.host(1).name)] {
            let holders = lock["holders"].as_array().unwrap();
            assert_eq!(holders.len(), 1, "from {}: {lock}", h.name);
            assert_eq!(holders[0]["host"], host.as_str(), "from {}: {lock}", h.name);
            assert_eq!(holders[0]["stowage"], true, "from {}: {lock}", h.name);
        }
        for l in st["locks"].as_array().unwrap() {
            for p in l["holders"].as_array().unwrap() {
                assert_eq!(p["stowage"], true, "no outsider from {}: {l}", h.name);
            }
        }
    }
    release(&env, "r");
    release(&env, "w");
    ok(reader.finish());
    ok(writer.finish());
}

#[test]
fn a_host_crash_mid_write_leaves_the_image_incomplete_and_nothing_held() {
    let Some(mut c) = Cluster::start("crash", 2) else {
        return;
    };
    let env = Env::new();
    let root = c.root();
    ok(c.host(0)
        .stowage_run(&root, ["exec", "--write", "app", "--", "true"]));
    let started = env.sentinel("started");
    let script = format!(
        "echo half > \"$STOWAGE_IMAGE_DIR/f\"; touch '{}'; sleep 600",
        started.display()
    );
    let _writer = Bg::from_command(
        c.host(0)
            .stowage(&root, ["exec", "--write", "app", "--", "sh", "-c", &script]),
    );
    wait_for_file(&started);
    c.hosts[0].crash();
    let b = c.host(1);
    assert_eq!(image_state(b, &root, "app").as_deref(), Some("incomplete"));
    let out = b.stowage_run(&root, ["exec", "--read", "app", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    let st = status(b, &root, &["app"]);
    let app = image_lock(&st, "app").unwrap();
    assert_eq!(app["state"], "free", "{st}");
    assert!(app["holders"].as_array().unwrap().is_empty(), "{st}");
    ok(b.stowage_run(&root, ["exec", "--write", "app", "--no-wait", "--", "true"]));
    assert_eq!(image_state(b, &root, "app").as_deref(), Some("ready"));
}

#[test]
fn slots_count_across_hosts() {
    let Some(c) = Cluster::start("slots", 3) else {
        return;
    };
    let env = Env::new();
    let root = c.root();
    ok(c.host(0).stowage_run(&root, ["slots", "set", "pull", "2"]));
    let h0 = hold(&env, c.host(0), &root, &["--slot", "pull"], "s0");
    let h1 = hold(&env, c.host(1), &root, &["--slot", "pull"], "s1");
    let out = c
        .host(2)
        .stowage_run(&root, ["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    release(&env, "s0");
    ok(h0.finish());
    ok(c.host(2)
        .stowage_run(&root, ["exec", "--slot", "pull", "--no-wait", "--", "true"]));
    release(&env, "s1");
    ok(h1.finish());
}

/// rm, gc, doctor --repair, slots set and writes from every host at once:
/// the catalog stays a sound database, and every image is as its record
/// says.
#[test]
fn catalog_transactions_from_every_host_at_once_never_corrupt_it() {
    let Some(c) = Cluster::start("catalog", 3) else {
        return;
    };
    let root = c.root();
    ok(c.host(0)
        .stowage_run(&root, ["exec", "--write", "base", "--", "true"]));
    let rounds = 6;
    let mut jobs = Vec::new();
    for (i, h) in c.hosts.iter().enumerate() {
        let script = format!(
            "s() {{ '{bin}' --root '{root}' \"$@\" >/dev/null 2>&1; }}
             for r in $(seq {rounds}); do
               s exec --write img{i}-$r -- true
               s exec --read base --write app{i} -- true
               s images; s slots set pull$i $r; s gc
               s rm img{i}-$((r - 1)); s doctor --repair
             done; exit 0",
            bin = bin(),
            root = root.display()
        );
        jobs.push(Bg::from_command(h.cmd(["sh", "-c", &script])));
    }
    for j in jobs {
        ok(j.finish());
    }
    let a = c.host(0);
    let out = ok(a.run([
        "sqlite3",
        root.join("stowage.db").to_str().unwrap(),
        "PRAGMA integrity_check",
    ]));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    let out = a.stowage_run(&root, ["doctor"]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("damaged"),
        "{}",
        show(&out)
    );
    for i in 0..c.hosts.len() {
        assert_eq!(
            image_state(a, &root, &format!("app{i}")).as_deref(),
            Some("ready")
        );
        let last = format!("img{i}-{rounds}");
        assert_eq!(image_state(a, &root, &last).as_deref(), Some("ready"));
    }
    std::thread::sleep(Duration::from_millis(10));
}
