//! `stowage lock-status`: the JSON contract, the kernel as the truth.

use serde_json::Value;

use crate::common::*;

fn is_rfc3339_utc(v: &Value) -> bool {
    let s = v.as_str().unwrap_or("");
    s.len() == 20 && s.ends_with('Z') && s.as_bytes()[10] == b'T'
}

#[test]
fn holder_and_waiter_with_every_field() {
    let env = Env::new();
    env.make_image("alpine:3.17");
    let holder = env.hold(&["--read", "alpine:3.17"], "started");
    let waiter = env.spawn(["exec", "--write", "alpine:3.17", "--", "true"]);
    env.wait_for_waiter("alpine:3.17");

    let st = env.status_json(Vec::<String>::new());
    assert_eq!(st["root"], env.root.display().to_string());
    assert!(st["filesystem"].as_str().is_some_and(|f| !f.is_empty()));
    let locks = st["locks"].as_array().unwrap();
    let global = locks
        .iter()
        .find(|l| l["kind"] == "global")
        .expect("global lock shown");
    assert_eq!(global["name"], "global");
    assert!(["free", "exclusive"].contains(&global["state"].as_str().unwrap()));
    let img = locks
        .iter()
        .find(|l| l["name"] == "alpine:3.17")
        .expect("held lock shown without asking");
    assert_eq!(img["kind"], "image");
    assert_eq!(img["image_state"], "ready");
    assert_eq!(img["state"], "shared");
    let user = std::env::var("USER").unwrap_or_else(|_| "root".into());
    let host = our_hostname();

    let h = &img["holders"][0];
    assert_eq!(h["pid"], holder.pid());
    assert_eq!(h["host"], host);
    assert_eq!(h["user"], user);
    assert_eq!(h["mode"], "shared");
    assert!(h["command"].as_str().unwrap().starts_with("sh -c "), "{h}");
    assert!(is_rfc3339_utc(&h["since"]), "{h}");

    let w = &img["waiters"][0];
    assert_eq!(w["pid"], waiter.pid());
    assert_eq!(w["host"], host);
    assert_eq!(w["user"], user);
    assert_eq!(w["mode"], "exclusive");
    assert_eq!(w["command"], "true");
    assert!(is_rfc3339_utc(&w["since"]), "{w}");

    // The human form names the same.
    let out = env.ok(["lock-status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("alpine:3.17") && text.contains(&format!("pid {}", holder.pid())),
        "{text}"
    );

    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert_eq!(waiter.finish().status.code(), Some(0));
    // Nothing is held now: only the global lock is listed.
    let st = env.status_json(Vec::<String>::new());
    assert_eq!(st["locks"].as_array().unwrap().len(), 1, "{st}");
}

#[test]
fn a_lock_taken_with_flock_shows_as_held() {
    let env = Env::new();
    env.make_image("app");
    let started = env.sentinel("started");
    let outsider = flock_holder(&env.lock_file("app"), &started, "sleep 60");

    let entry = env.lock_entry("app").unwrap();
    assert_eq!(entry["state"], "exclusive", "{entry}");
    let h = &entry["holders"][0];
    assert_eq!(h["mode"], "exclusive");
    assert_eq!(h["stowage"], false, "{h}");
    // On a local filesystem the kernel's lock table names the process.
    let fs = env.status_json(Vec::<String>::new())["filesystem"]
        .as_str()
        .unwrap()
        .to_owned();
    if ["ext4", "tmpfs", "xfs", "btrfs", "overlay"].contains(&fs.as_str()) {
        assert_eq!(h["pid"], outsider.pid(), "{h}");
        assert!(h["command"].as_str().unwrap().contains("flock"), "{h}");
    }
    // It is listed without being named, too.
    let st = env.status_json(Vec::<String>::new());
    assert!(
        st["locks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["name"] == "app"),
        "{st}"
    );
    // And stowage respects it.
    let out = env.run(["exec", "--read", "app", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(
        stderr(&out).contains("not started by stowage"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_record_from_another_host_whose_lock_is_free_is_dropped() {
    let env = Env::new();
    // A build on "another host" dies with its command: its record stays,
    // its pid cannot be checked from here, but its lock is free.
    let remote = env.hold_with(&["--write", "app"], "started", |c| {
        c.env("STOWAGE_HOSTNAME", "node07.elsewhere");
    });

    // While its lock is held, the record is shown with its host.
    let entry = env.lock_entry("app").unwrap();
    assert_eq!(entry["holders"][0]["host"], "node07.elsewhere", "{entry}");

    remote.kill_all();
    let entry = env.lock_entry("app").unwrap();
    assert!(
        entry["holders"].as_array().unwrap().is_empty(),
        "stale remote record dropped: {entry}"
    );
    assert_eq!(entry["state"], "free");
    assert_eq!(entry["image_state"], "incomplete");
}

#[test]
fn all_lists_every_image_and_names_select() {
    let env = Env::new();
    for n in ["a", "b", "c"] {
        env.make_image(n);
    }
    let names = |args: &[&str]| -> Vec<String> {
        env.status_json(args)["locks"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|l| l["name"].as_str().map(str::to_owned))
            .collect()
    };
    assert_eq!(names(&["--all"]), ["global", "a", "b", "c"]);
    assert_eq!(names(&["b"]), ["global", "b"]);
}

#[test]
fn watch_prints_repeatedly() {
    use std::io::BufRead;
    let env = Env::new();
    env.make_image("a");
    let mut c = env.cmd(["lock-status", "--json", "--watch", "0.05"]);
    c.stdout(std::process::Stdio::piped());
    let mut bg = Bg::from_command(c);
    let stdout = bg.child.as_mut().unwrap().stdout.take().unwrap();
    // Read three snapshots (bounded by the harness), then stop it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().take(3) {
            let _ = tx.send(line.unwrap());
        }
    });
    let docs: Vec<Value> = (0..3)
        .map(|_| serde_json::from_str(&rx.recv_timeout(PATIENCE).expect("a snapshot")).unwrap())
        .collect();
    assert!(docs.iter().all(|d| d["locks"].is_array()));
    bg.signal(libc::SIGTERM);
    bg.finish();
}
