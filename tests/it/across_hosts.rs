//! One store shared by several hosts on a real shared filesystem
//! (GlusterFS: each host its own namespaces and FUSE client; see
//! cluster.rs): locks exclude across hosts, holders are named from every
//! host, a host's crash leaves nothing held and nothing ready that was being
//! written, and the catalog survives transactions from every host at once.
//! Skipped, saying why, where no volume runs.

use std::fs;
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
    // A bounded wait, not --no-wait: the FUSE client sends a lock's release
    // after its process is gone, so another host finds it free a moment later.
    ok(b.stowage_run(
        &root,
        ["exec", "--write", "base", "--wait", "30", "--", "true"],
    ));
}

/// A host whose connection to the server drops for a moment (a network
/// blip, a brick restart) loses its locks there, and its client reopens
/// its files without them. What another host did meanwhile shows in the
/// image's record: the writer never records `ready` over it, and says its
/// lock was lost (exit 1). Another host's gc removed the image as its
/// writer's; another host's write finished it: then it is incomplete, two
/// writers' files mixed in its tree.
#[test]
fn a_writer_whose_host_lost_its_connection_never_records_ready_over_another() {
    let Some(c) = Cluster::start("blip", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    for (other, then) in [("gc", None), ("write", Some("incomplete"))] {
        ok(a.stowage_run(&root, ["exec", "--write", "img", "--", "true"]));
        let (started, go) = (env.sentinel(other), env.sentinel(&format!("{other}.go")));
        let script = format!(
            "touch '{}'; while [ ! -e '{}' ]; do sleep 0.05; done; echo a > \"$STOWAGE_IMAGE_DIR/a\" || true",
            started.display(),
            go.display()
        );
        let writer = Bg::from_command(
            a.stowage(&root, ["exec", "--write", "img", "--", "sh", "-c", &script]),
        );
        wait_for_file(&started);
        a.disconnect();
        let out = match other {
            "gc" => ok(b.stowage_run(&root, ["gc"])),
            _ => ok(b.stowage_run(&root, ["exec", "--write", "img", "--no-wait", "--", "true"])),
        };
        assert!(
            other != "gc" || stdout(&out).contains("removed 'img'"),
            "{}",
            show(&out)
        );
        std::fs::write(&go, "").unwrap();
        let out = writer.finish();
        assert_eq!(code(&out), Some(1), "after {other}: {}", show(&out));
        assert!(
            stderr(&out).contains("lost the write lock on image 'img'"),
            "{}",
            show(&out)
        );
        assert_eq!(
            image_state(b, &root, "img").as_deref(),
            then,
            "after {other}"
        );
    }
}

/// The writer that took the lock of one whose host lost its connection is
/// told, at its end, that the other's command wrote into the tree while it
/// held the lock (the other, failing, leaves a hint in the lock file): its
/// image is incomplete, never `ready` with two writers' files in it.
#[test]
fn a_writer_after_one_that_lost_its_lock_and_wrote_on_is_never_ready() {
    let Some(c) = Cluster::start("mixed", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    ok(a.stowage_run(&root, ["exec", "--write", "img", "--", "true"]));
    let wait_for =
        |started: &Path, go: &Path, then: &str| format!("{}; {then}", hold_script(started, go));
    let [s1, go1, s2, go2] = ["s1", "go1", "s2", "go2"].map(|n| env.sentinel(n));
    let first = wait_for(&s1, &go1, "echo junk > \"$STOWAGE_IMAGE_DIR/junk\"");
    let w1 =
        Bg::from_command(a.stowage(&root, ["exec", "--write", "img", "--", "sh", "-c", &first]));
    wait_for_file(&s1);
    a.disconnect();
    let second = wait_for(&s2, &go2, "true");
    let args = [
        "exec", "--write", "img", "--wait", "30", "--", "sh", "-c", &second,
    ];
    let w2 = Bg::from_command(b.stowage(&root, args));
    wait_for_file(&s2);
    std::fs::write(&go1, "").unwrap();
    let out = w1.finish();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    std::fs::write(&go2, "").unwrap();
    let out = w2.finish();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = "a writer whose lock was lost wrote into its tree meanwhile";
    assert!(stderr(&out).contains(said), "{}", show(&out));
    assert_eq!(image_state(b, &root, "img").as_deref(), Some("incomplete"));
    // The hint is spent: the next write is ready.
    ok(b.stowage_run(&root, ["exec", "--write", "img", "--", "true"]));
    assert_eq!(image_state(b, &root, "img").as_deref(), Some("ready"));
}

/// The lost writer's hint names the record in flight of the writer that
/// holds the lock: one that comes late — here its probe's answer held back
/// five seconds by strace, while that writer ends and another takes the
/// image — lands on no one else. Before, the next writer, which began after
/// the lost writer's command had ended, was made incomplete (exit 1).
#[test]
fn a_lost_writers_late_hint_never_lands_on_the_next_writer() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let Some(c) = Cluster::start("latehint", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    ok(b.stowage_run(&root, ["exec", "--write", "img", "--", "true"]));
    let gate = |n: &str| {
        let (started, go) = (env.sentinel(n), env.sentinel(&format!("go{n}")));
        let script = hold_script(&started, &go);
        (started, go, script)
    };
    let (s1, go1, first) = gate("1");
    let w1 =
        Bg::from_command(a.stowage(&root, ["exec", "--write", "img", "--", "sh", "-c", &first]));
    wait_for_file(&s1);
    a.disconnect();
    let (s2, go2, second) = gate("2");
    let args = [
        "exec", "--write", "img", "--wait", "30", "--", "sh", "-c", &second,
    ];
    let w2 = Bg::from_command(b.stowage(&root, args));
    wait_for_file(&s2);
    // host-run's process is nsenter; stowage is its only child.
    let children = format!("/proc/{0}/task/{0}/children", w1.pid());
    let stowage = fs::read_to_string(children).unwrap().trim().to_owned();
    let delay = "flock:delay_exit=5000000:when=2";
    let tracer = Bg::from_command({
        let mut c = std::process::Command::new("strace");
        c.args([
            "-q",
            "-o",
            "/dev/null",
            "-p",
            &stowage,
            "-e",
            "trace=flock",
            "-e",
        ]);
        c.arg(format!("inject={delay}"));
        c
    });
    std::thread::sleep(Duration::from_millis(500));
    fs::write(&go1, "").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    fs::write(&go2, "").unwrap();
    ok(w2.finish());
    let (s3, go3, third) = gate("3");
    let args = [
        "exec", "--write", "img", "--wait", "30", "--", "sh", "-c", &third,
    ];
    let w3 = Bg::from_command(b.stowage(&root, args));
    wait_for_file(&s3);
    assert_eq!(code(&w1.finish()), Some(1));
    fs::write(&go3, "").unwrap();
    ok(w3.finish());
    tracer.finish();
    assert_eq!(image_state(b, &root, "img").as_deref(), Some("ready"));
}

/// A writer whose lock was lost while readers hold it leaves no hint: a
/// hint no writer takes in would fail every later read of the image, on
/// every host, while it is listed `ready`.
#[test]
fn a_writer_that_lost_its_lock_to_readers_leaves_later_reads_alone() {
    let Some(c) = Cluster::start("lostread", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    ok(b.stowage_run(&root, ["exec", "--write", "img", "--", "true"]));
    let [s1, go1, s2, go2] = ["s1", "go1", "s2", "go2"].map(|n| env.sentinel(n));
    let first = hold_script(&s1, &go1);
    let w1 =
        Bg::from_command(a.stowage(&root, ["exec", "--write", "img", "--", "sh", "-c", &first]));
    wait_for_file(&s1);
    a.disconnect();
    ok(b.stowage_run(
        &root,
        ["exec", "--write", "img", "--wait", "30", "--", "true"],
    ));
    let read = hold_script(&s2, &go2);
    let r1 = Bg::from_command(b.stowage(&root, ["exec", "--read", "img", "--", "sh", "-c", &read]));
    wait_for_file(&s2);
    std::fs::write(&go1, "").unwrap();
    assert_eq!(code(&w1.finish()), Some(1));
    std::fs::write(&go2, "").unwrap();
    r1.finish();
    for h in [a, b] {
        ok(h.stowage_run(&root, ["exec", "--read", "img", "--", "true"]));
    }
    assert_eq!(image_state(b, &root, "img").as_deref(), Some("ready"));
}

/// The same for a reader: its shared lock dropped with its host's
/// connection, another host rewrote the image it read. The read fails
/// (exit 1) when its command ends, and the image it wrote from what it read
/// is incomplete, never ready.
#[test]
fn a_read_whose_host_lost_its_connection_fails_if_another_wrote_meanwhile() {
    let Some(c) = Cluster::start("readblip", 3) else {
        return;
    };
    let env = Env::new();
    let (b, root) = (c.host(2), c.root());
    ok(b.stowage_run(&root, ["exec", "--write", "base", "--", "true"]));
    // A rewrite, or an exclusive read (which may change the tree, not the record's contents); a
    // reader's host of its own each time (a client reconnects more slowly once it has).
    for (i, other) in ["--write", "--read-exclusive"].into_iter().enumerate() {
        let a = c.host(i);
        let (started, go) = (env.sentinel(other), env.sentinel(&format!("{other}.go")));
        let script = hold_script(&started, &go);
        let args = [
            "exec", "--read", "base", "--write", "app", "--", "sh", "-c", &script,
        ];
        let reader = Bg::from_command(a.stowage(&root, args));
        wait_for_file(&started);
        a.disconnect();
        ok(b.stowage_run(&root, ["exec", other, "base", "--no-wait", "--", "true"]));
        std::fs::write(&go, "").unwrap();
        let out = reader.finish();
        assert_eq!(code(&out), Some(1), "{other}: {}", show(&out));
        let said = "image 'base' changed while the command read it";
        assert!(stderr(&out).contains(said), "{other}: {}", show(&out));
        assert_eq!(image_state(b, &root, "app").as_deref(), Some("incomplete"));
        assert_eq!(image_state(b, &root, "base").as_deref(), Some("ready"));
    }
}

/// A copy from a base another host has just rewritten copies the base as it
/// is: the file's length is asked of the server, not taken from what this
/// host's client cached (for a second, from its own last write), which cut
/// the copy short or padded it with zeros, and the image was `ready`.
#[test]
fn a_copy_right_after_another_host_rewrote_its_base_is_whole() {
    let Some(c) = Cluster::start("freshcopy", 2) else {
        return;
    };
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    let write = |chunks: usize| {
        format!(
            "d=$STOWAGE_IMAGE_DIR; : > $d/data; for i in $(seq {chunks}); do head -c 20000 /dev/urandom >> $d/data; done; cksum < $d/data > $d/SUM"
        )
    };
    let check = "[ \"$(cksum < $STOWAGE_IMAGE_DIR/data)\" = \"$(cat $STOWAGE_IMAGE_DIR/SUM)\" ] || { echo torn: $(wc -c < $STOWAGE_IMAGE_DIR/data) bytes >&2; exit 1; }";
    for (mine, theirs) in [(1, 3), (4, 2), (2, 5), (5, 1)] {
        ok(b.stowage_run(
            &root,
            ["exec", "--write", "base", "--", "sh", "-c", &write(mine)],
        ));
        ok(a.stowage_run(
            &root,
            ["exec", "--write", "base", "--", "sh", "-c", &write(theirs)],
        ));
        let args = [
            "exec", "--write", "app", "--from", "base", "--", "sh", "-c", check,
        ];
        ok(b.stowage_run(&root, args));
    }
}

/// A holder on another machine of our host name (a cloned VM: the same
/// name, another boot) is named as another host's: its pid is another
/// process here, and no advice says to kill it here.
#[test]
fn a_holder_on_another_machine_of_our_name_is_never_taken_for_ours() {
    let Some(c) = Cluster::start("namesake", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    let boot = env.sentinel("boot_id");
    std::fs::write(&boot, "0f0e0d0c-0b0a-4908-8706-050403020100\n").unwrap();
    let namesake = format!(
        "hostname '{}' && mount --bind '{}' /proc/sys/kernel/random/boot_id",
        a.name,
        boot.display()
    );
    ok(output(b.cmd(["sh", "-c", &namesake])));
    ok(a.stowage_run(&root, ["exec", "--write", "app", "--", "true"]));
    let holder = hold(&env, a, &root, &["--write", "app"], "h");
    let out = b.stowage_run(
        &root,
        ["exec", "--write", "app", "--wait", "0.3", "--", "true"],
    );
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    let named = format!("on another host named {}", a.name);
    assert!(stderr(&out).contains(&named), "{}", show(&out));
    let why = stdout(&ok(b.stowage_run(&root, ["lock-status", "--why", "app"])));
    assert!(why.contains(&named), "{why}");
    assert!(
        !why.contains(": kill ") || why.contains(": on the other host named"),
        "{why}"
    );
    release(&env, "h");
    ok(holder.finish());
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

/// A look asks about each lock it shows (no table names another host's
/// holders): by a query that takes no lock where the filesystem answers one
/// (GlusterFS), else by a try-lock let go at once. Other hosts' looks, asking
/// about the same locks meanwhile, hold nothing: they are never shown as
/// holders, of the global lock, a slot or an image, and never count as a
/// slot in use.
#[test]
fn another_hosts_look_is_never_shown_as_a_holder() {
    let Some(c) = Cluster::start("probes", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    ok(a.stowage_run(&root, ["exec", "--write", "base", "--", "true"]));
    ok(a.stowage_run(&root, ["slots", "set", "pull", "2"]));
    let stop = env.sentinel("stop");
    let loop_ = format!(
        "while [ ! -e '{}' ]; do \"$0\" --root '{}' lock-status --all --json >/dev/null; done",
        stop.display(),
        root.display()
    );
    // Two looks at once on the other host: twice the chances to meet one.
    let lookers: Vec<Bg> = (0..2)
        .map(|_| Bg::from_command(b.cmd(["sh", "-c", &loop_, bin()])))
        .collect();
    let mut seen = Vec::new();
    for _ in 0..60 {
        let st = status(a, &root, &["--all"]);
        for l in st["locks"].as_array().unwrap() {
            let held = !l["holders"].as_array().unwrap().is_empty();
            if held || l["state"] != "free" || l["in_use"].as_u64().unwrap_or(0) > 0 {
                seen.push(l.to_string());
            }
        }
    }
    std::fs::write(&stop, "").unwrap();
    for looker in lookers {
        ok(looker.finish());
    }
    assert!(
        seen.is_empty(),
        "nothing is held, yet a look showed: {seen:#?}"
    );
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
    // The server releases a dead client's locks a moment after it drops
    // its connection (seconds, under load): until then the writer's lock
    // is held and the image reads as `writing`.
    wait_until("the crashed writer's image reads as incomplete", || {
        image_state(b, &root, "app").as_deref() == Some("incomplete")
    });
    let out = b.stowage_run(&root, ["exec", "--read", "app", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    let st = status(b, &root, &["app"]);
    let app = image_lock(&st, "app").unwrap();
    assert_eq!(app["state"], "free", "{st}");
    assert!(app["holders"].as_array().unwrap().is_empty(), "{st}");
    ok(b.stowage_run(&root, ["exec", "--write", "app", "--no-wait", "--", "true"]));
    assert_eq!(image_state(b, &root, "app").as_deref(), Some("ready"));
}

/// On a shared filesystem a record, a hint and a lease are each one
/// stable write (`O_DSYNC`), never a write and then a sync: on NFS or
/// GlusterFS the sync is one more request to the server, which a write and
/// a new image each made twice. What is written is seen at once by another
/// host, its client's caches notwithstanding.
#[test]
fn records_reach_the_server_in_one_request_each() {
    let Some(c) = Cluster::start("through", 2) else {
        return;
    };
    let env = Env::new();
    let root = c.root();
    ok(c.host(0)
        .stowage_run(&root, ["exec", "--write", "base", "--", "true"]));
    for args in [
        ["exec", "--write", "base", "--", "true"],
        ["exec", "--write", "new", "--", "true"],
    ] {
        let log = env.sentinel("strace");
        let mut cmd = c.host(0).cmd([
            "strace",
            "-f",
            "-e",
            "trace=fsync,fdatasync,openat,openat2",
            "-o",
        ]);
        cmd.arg(&log).arg(bin()).arg("--root").arg(&root).args(args);
        ok(output(cmd));
        let trace = std::fs::read_to_string(&log).unwrap();
        let syncs: Vec<_> = trace.lines().filter(|l| l.contains("sync(")).collect();
        assert!(
            syncs.is_empty(),
            "{args:?} synced apart from its writes: {syncs:?}"
        );
        let lock = format!("images/{}.lock", args[2]);
        assert!(
            trace
                .lines()
                .any(|l| l.contains(&lock) && l.contains("O_DSYNC")),
            "{args:?} opened its lock file without O_DSYNC:\n{trace}"
        );
        assert_eq!(
            image_state(c.host(1), &root, args[2]).as_deref(),
            Some("ready")
        );
    }
}

/// Locks an exec holds are named by its lease on every other host while
/// it waits for a later one, and while it writes its records: there no
/// lock table shows them, and the lease listed only the awaited lock (and,
/// before the records, nothing), so they showed as held by an unknown
/// process outside stowage.
#[test]
fn locks_held_during_a_wait_and_a_start_are_named_on_other_hosts() {
    let Some(c) = Cluster::start("named", 2) else {
        return;
    };
    let env = Env::new();
    let root = c.root();
    for img in ["a", "b", "c"] {
        ok(c.host(0)
            .stowage_run(&root, ["exec", "--write", img, "--", "true"]));
    }
    let named = |lock: &str, why: &str| {
        let st = status(c.host(1), &root, &["--all"]);
        let l = image_lock(&st, lock).unwrap();
        let holders = l["holders"].as_array().unwrap();
        assert_eq!(holders.len(), 1, "{why}: {l}");
        assert_eq!(
            holders[0]["stowage"], true,
            "{why}: shown as an outsider: {l}"
        );
        assert!(holders[0]["lease"].is_string(), "{why}: {l}");
    };
    // A wait for c, holding a and b.
    let writer = hold(&env, c.host(1), &root, &["--write", "c"], "writer");
    let waiter = Bg::from_command(c.host(0).stowage(
        &root,
        [
            "exec", "--read", "a", "--read", "b", "--write", "c", "--", "true",
        ],
    ));
    wait_until("the waiter waits for c", || {
        let st = status(c.host(1), &root, &["--all"]);
        image_lock(&st, "c").is_some_and(|l| !l["waiters"].as_array().unwrap().is_empty())
    });
    named("a", "during the wait");
    named("b", "during the wait");
    release(&env, "writer");
    assert_eq!(code(&writer.finish()), Some(0));
    assert_eq!(code(&waiter.finish()), Some(0));
    // Stopped while it writes its records, holding a and c.
    let pause = env.sentinel("paused");
    let mut cmd = c
        .host(0)
        .stowage(&root, ["exec", "--read", "a", "--write", "c", "--", "true"]);
    cmd.env(
        stowage::env::DEBUG_PAUSE,
        format!("write-locked:{}", pause.display()),
    );
    let starting = Bg::from_command(cmd);
    wait_for_file(&pause);
    named("a", "before the records");
    named("c", "before the records");
    std::fs::remove_file(&pause).unwrap();
    assert_eq!(code(&starting.finish()), Some(0));
}

/// An image being removed (by `rm` or `gc`) is held by a process that
/// other hosts name from its lease, not by an unknown process outside
/// stowage: `rm` and `gc` listed no lock they held.
#[test]
fn removals_are_named_on_other_hosts() {
    let Some(c) = Cluster::start("removals", 2) else {
        return;
    };
    let env = Env::new();
    let root = c.root();
    ok(c.host(0)
        .stowage_run(&root, ["exec", "--write", "a", "--", "true"]));
    let out = c
        .host(0)
        .stowage_run(&root, ["exec", "--write", "b", "--", "false"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    for (args, image) in [(vec!["rm", "a"], "a"), (vec!["gc"], "b")] {
        let pause = env.sentinel(&format!("paused-{image}"));
        let mut cmd = c.host(0).stowage(&root, &args);
        cmd.env(
            stowage::env::DEBUG_PAUSE,
            format!("rm-marked:{}", pause.display()),
        );
        let removal = Bg::from_command(cmd);
        wait_for_file(&pause);
        let st = status(c.host(1), &root, &["--all"]);
        let l = image_lock(&st, image).unwrap();
        let holders = l["holders"].as_array().unwrap();
        assert_eq!(holders.len(), 1, "{args:?}: {l}");
        assert_eq!(
            holders[0]["stowage"], true,
            "{args:?}: shown as an outsider: {l}"
        );
        assert!(holders[0]["lease"].is_string(), "{args:?}: {l}");
        std::fs::remove_file(&pause).unwrap();
        let out = removal.finish();
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    // While gc judges an image under its lock (before it removes it), too.
    let out = c
        .host(0)
        .stowage_run(&root, ["exec", "--write", "c", "--", "false"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let pause = env.sentinel("paused-judged");
    let mut cmd = c.host(0).stowage(&root, ["gc"]);
    cmd.env(
        stowage::env::DEBUG_PAUSE,
        format!("gc-judged:{}", pause.display()),
    );
    let gc = Bg::from_command(cmd);
    wait_for_file(&pause);
    let st = status(c.host(1), &root, &["--all"]);
    let l = image_lock(&st, "c").expect("the judged image's lock is listed");
    assert_eq!(
        l["holders"][0]["stowage"], true,
        "shown as an outsider: {l}"
    );
    std::fs::remove_file(&pause).unwrap();
    assert_eq!(code(&gc.finish()), Some(0));
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
    // Free a moment after its holder is gone (the FUSE client's release is
    // sent after the process ends): a bounded wait.
    ok(c.host(2).stowage_run(
        &root,
        ["exec", "--slot", "pull", "--wait", "30", "--", "true"],
    ));
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
    // Named as lock-status names it, not by statfs's "fuse".
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("(glusterfs)"),
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

/// What every party runs on its host: random reads and writes. A writer
/// says `writing` in its tree while it writes, with a token of its own that
/// no other writer may replace meanwhile; a reader that finds `writing`
/// reports a read beside a write (to `$VIOLATIONS`, outside the volume). A
/// writer killed with its host leaves `writing`, in an image that is then
/// incomplete: no reader gets to it.
const GLUSTER_PARTY: &str = r#"
party() {
  while :; do
    n=$(od -An -N1 -tu1 /dev/urandom); n=$((n + 0)); i=$((n % 3))
    case $((n % 4)) in
      0|1) "$STOWAGE" exec --read "img$i" --wait 0.5 -- sh -c              '[ "$(cat "$STOWAGE_IMAGES_DIR/img'$i'/state" 2>/dev/null)" != writing ] || echo "read beside a write: img'$i'" >> "$VIOLATIONS"' ;;
      2|3) "$STOWAGE" exec --write "img$i" --wait 0.5 -- sh -c              'cd "${STOWAGE_IMAGE_DIR:?}" && t=$(od -An -N4 -tu4 /dev/urandom | tr -d " "); echo "$t" > owner; echo writing > state; sleep 0.0'$((n % 5 + 1))'; [ "$(cat owner)" = "$t" ] || echo "two writers: img'$i'" >> "$VIOLATIONS"; echo done > state' ;;
    esac >/dev/null 2>&1
  done
}
party & party & party &
wait
"#;

/// Torture on GlusterFS: parties on N hosts (`STOWAGE_STRESS_HOSTS`,
/// default 3) read and write one store while whole hosts crash at random
/// and new ones join (`STOWAGE_STRESS_SECS`, default 15). No reader ever
/// runs beside a writer, no two writers meet; after each crash, a look from
/// a live host lists nothing of the dead host and each holder once, with
/// no stowage process as an outsider; at the end nothing is held and
/// doctor is clean. `scripts/stress --hosts N` runs it (with the same run
/// on namespaces over one local lock table).
#[test]
fn torture_on_glusterfs() {
    let hosts = env_num("STOWAGE_STRESS_HOSTS", 3).max(2) as usize;
    let secs = env_num("STOWAGE_STRESS_SECS", 15);
    let seed = env_num("STOWAGE_STRESS_SEED", fastrand::u64(..));
    let Some(mut c) = Cluster::start("torture", hosts) else {
        return;
    };
    eprintln!("stress --hosts on GlusterFS: {hosts} hosts, {secs} s, seed {seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let env = Env::new();
    let violations = env.sentinel("violations");
    std::fs::write(&violations, "").unwrap();
    let root = c.root();
    for i in 0..3 {
        ok(c.host(0)
            .stowage_run(&root, ["exec", "--write", &format!("img{i}"), "--", "true"]));
    }
    let start = |h: &Host| -> Bg {
        let mut cmd = h.cmd(["sh", "-c", GLUSTER_PARTY]);
        cmd.env("STOWAGE", bin())
            .env("STOWAGE_ROOT", &root)
            .env("VIOLATIONS", &violations);
        Bg::from_command(cmd)
    };
    let mut parties: Vec<Option<Bg>> = c.hosts.iter().map(|h| Some(start(h))).collect();
    let (mut crashes, mut looks, mut settled) = (0u64, 0u64, Duration::ZERO);
    let mut problems: Vec<String> = Vec::new();
    let mut dead: Vec<String> = Vec::new();
    let t0 = std::time::Instant::now();
    while t0.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(rng.u64(300..1200)));
        let victim = rng.usize(0..c.hosts.len());
        parties[victim] = None;
        c.hosts[victim].crash();
        crashes += 1;
        dead.push(c.hosts[victim].name.clone());
        let watcher = (victim + 1) % c.hosts.len();
        looks += 1;
        settled = settled.max(settled_look(c.host(watcher), &root, &dead, &mut problems));
        c.hosts[victim] = c.replace(victim, crashes);
        parties[victim] = Some(start(c.host(victim)));
    }
    drop(parties);
    for h in c.hosts.iter_mut() {
        dead.push(h.name.clone());
        h.crash();
    }
    c.hosts[0] = c.replace(0, crashes + 1);
    let fresh = c.host(0);
    let st = status(fresh, &root, &["--all"]);
    check_look(&st, &dead, &mut problems);
    for lock in st["locks"].as_array().unwrap() {
        if lock["kind"] == "image" && lock["state"] != "free" {
            problems.push(format!("held after every host died: {lock}"));
        }
    }
    let said = std::fs::read_to_string(&violations).unwrap();
    problems.extend(said.lines().map(str::to_owned));
    let repair = fresh.stowage_run(&root, ["doctor", "--repair"]);
    let clean = fresh.stowage_run(&root, ["doctor"]);
    eprintln!(
        "stress --hosts on GlusterFS: seed {seed}, {hosts} hosts, {crashes} crashes, {looks} looks, \
         locks of a crashed host released within {:.1} s, problems {}",
        settled.as_secs_f64(),
        problems.len()
    );
    for p in problems.iter().take(10) {
        eprintln!("problem: {p}");
    }
    assert!(problems.is_empty(), "seed {seed}: {problems:?}");
    assert_eq!(code(&repair), Some(0), "{}", show(&repair));
    assert_eq!(code(&clean), Some(0), "{}", show(&clean));
}

/// A look after a crash: the server releases a dead client's locks one
/// file after another, a moment after the connection went (measured: up to
/// 3.4 s on a loaded 2-core machine, most within 1 s); until then a lock
/// of the dead host is held with no live lease to name it. What the look
/// shows must hold once that is done (within [`SETTLE`]). Returns how long
/// it took.
fn settled_look(h: &Host, root: &Path, dead: &[String], problems: &mut Vec<String>) -> Duration {
    let t0 = std::time::Instant::now();
    loop {
        let mut found = Vec::new();
        check_look(&status(h, root, &["--all"]), dead, &mut found);
        if found.is_empty() || t0.elapsed() > SETTLE {
            problems.extend(found);
            return t0.elapsed();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// How long the server may take to release a crashed client's locks.
const SETTLE: Duration = Duration::from_secs(10);

/// What a look must show after hosts died: nothing of them, each holder
/// once, no stowage process as an outsider, one holder of an exclusive
/// lock.
fn check_look(st: &Value, dead: &[String], problems: &mut Vec<String>) {
    for lock in st["locks"].as_array().unwrap() {
        let holders = lock["holders"].as_array().unwrap();
        let mut leases = std::collections::HashSet::new();
        for p in holders.iter().chain(lock["waiters"].as_array().unwrap()) {
            if p["host"]
                .as_str()
                .is_some_and(|h| dead.iter().any(|d| d == h))
            {
                problems.push(format!("a dead host is listed: {lock}"));
            }
        }
        for p in holders {
            if let Some(l) = p["lease"].as_str()
                && !leases.insert(l.to_owned())
            {
                problems.push(format!("a holder listed twice: {lock}"));
            }
        }
        // An image's holder is named by its lease; elsewhere (the global lock, a slot held for
        // less than a lease takes to be announced) a holder may be unknown, never an outsider.
        if lock["kind"] == "image" && holders.iter().any(|p| p["stowage"] != true)
            || holders.iter().any(|p| p["stowage"] == false)
        {
            problems.push(format!("a stowage holder listed as an outsider: {lock}"));
        }
        if lock["kind"] == "image" && lock["state"] == "exclusive" && holders.len() > 1 {
            problems.push(format!("an exclusive lock with two holders: {lock}"));
        }
    }
}

/// A removal cut short by its host's crash after the tree went to the
/// trash is finished by the next gc on another host — also on the host
/// that wrote the image a moment before, whose client still has the tree's
/// name cached and is told by the server, at the rename, that it is gone.
#[test]
fn a_removal_its_host_crashed_in_is_finished_where_the_tree_is_cached() {
    let Some(mut c) = Cluster::start("rmcrash", 2) else {
        return;
    };
    let env = Env::new();
    let root = c.root();
    let fill = "mkdir \"$STOWAGE_IMAGE_DIR/d\" && echo x > \"$STOWAGE_IMAGE_DIR/d/f\"";
    ok(c.host(1)
        .stowage_run(&root, ["exec", "--write", "img", "--", "sh", "-c", fill]));
    let pause = env.sentinel("paused");
    let mut cmd = c.host(0).stowage(&root, ["rm", "img"]);
    cmd.env(
        stowage::env::DEBUG_PAUSE,
        format!("rm-moved:{}", pause.display()),
    );
    let _removal = Bg::from_command(cmd);
    wait_for_file(&pause);
    c.hosts[0].crash();
    let b = c.host(1);
    wait_until("the crashed removal's lock is free", || {
        let st = status(b, &root, &["img"]);
        image_lock(&st, "img").is_some_and(|l| l["state"] == "free")
    });
    let out = b.stowage_run(&root, ["gc"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(image_state(b, &root, "img"), None);
}

/// Runs `exec ARGS -- hold` on `host` in the background, the hold ending in
/// `then`; returns once its command runs, and the file that lets it go on.
fn hold_then(
    env: &Env,
    host: &Host,
    root: &Path,
    args: &[&str],
    tag: &str,
    then: &str,
) -> (Bg, std::path::PathBuf) {
    let (started, go) = (env.sentinel(tag), env.sentinel(&format!("{tag}.go")));
    let script = format!("{}; {then}", hold_script(&started, &go));
    let mut a: Vec<&str> = vec!["exec"];
    a.extend(args);
    a.extend(["--", "sh", "-c", &script]);
    let bg = Bg::from_command(host.stowage(root, &a));
    wait_for_file(&started);
    (bg, go)
}

/// A store-wide hold whose host lost its connection while its command ran
/// (the server dropped `store.lock`, and an image user on another host got
/// in) says so and exits 1, its command's status 0 notwithstanding: before,
/// it exited 0 as if it had run alone. What its command deleted is not
/// forgotten on the strength of the lost hold: the image is gone to its
/// next user, as after a dead holder.
#[test]
fn a_store_wide_hold_whose_host_lost_its_connection_fails_and_says_so() {
    let Some(c) = Cluster::start("swblip", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    ok(b.stowage_run(&root, ["exec", "--write", "base", "--", "true"]));
    ok(b.stowage_run(&root, ["exec", "--write", "old", "--", "true"]));
    // Held throughout, with image users inside it: no loss is told.
    let nested = format!(
        "{0} --root {1} exec --write new -- true && {0} --root {1} exec --write base -- true",
        bin(),
        root.display()
    );
    let out = ok(a.stowage_run(&root, ["exec", "--store-wide", "--", "sh", "-c", &nested]));
    assert!(!stderr(&out).contains("lost"), "{}", show(&out));
    let delete = "rm -rf \"$STOWAGE_IMAGES_DIR/old\"";
    let (hold, go) = hold_then(&env, a, &root, &["--store-wide"], "sw", delete);
    a.disconnect();
    ok(b.stowage_run(&root, ["exec", "--write", "w2", "--no-wait", "--", "true"]));
    std::fs::write(&go, "").unwrap();
    let out = hold.finish();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = "lost the store-wide hold while the command ran";
    assert!(stderr(&out).contains(said), "{}", show(&out));
    let out = b.stowage_run(&root, ["exec", "--read", "old", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    ok(b.stowage_run(&root, ["exec", "--read", "base", "--no-wait", "--", "true"]));
}

/// A store-wide hold whose host lost its connection while it waited for
/// an image user lost `store.lock`: an image user on another host that
/// came in meanwhile is waited for too (the hold starts over), never run
/// beside the hold's command. Before, the hold asked its lock through its
/// own descriptor, which the server granted it anew.
#[test]
fn a_store_wide_hold_whose_lock_went_while_it_waited_waits_for_who_came_in() {
    let Some(c) = Cluster::start("swwait", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    for n in ["i1", "i2", "i3", "i4", "i5", "i6"] {
        ok(b.stowage_run(&root, ["exec", "--write", n, "--", "true"]));
    }
    // The hold passes the images in the order their directory lists them:
    // it waits for the last while the first, passed, is written.
    let listed = ok(a.run(["ls", "-U", root.join("locks/images").to_str().unwrap()]));
    let names: Vec<String> = stdout(&listed)
        .lines()
        .filter_map(|l| l.strip_suffix(".lock").map(str::to_owned))
        .collect();
    let (first, last) = (names[0].as_str(), names[names.len() - 1].as_str());
    let holder = hold(&env, b, &root, &["--write", last], "last");
    let [wide, started, go, overlap] =
        ["wide", "first.started", "first.go", "overlap"].map(|n| env.sentinel(n));
    let touch = format!("touch '{}'", wide.display());
    let args = ["exec", "--store-wide", "--", "sh", "-c", &touch];
    let hold_wide = waiter(&env, a, &root, &args, "sw");
    a.disconnect();
    // In while the hold's lock is gone: it checks, at its end, whether the
    // hold's command ran beside it.
    let script = format!(
        "touch '{}'; while [ ! -e '{}' ]; do sleep 0.05; done; if [ -e '{}' ]; then touch '{}'; fi",
        started.display(),
        go.display(),
        wide.display(),
        overlap.display()
    );
    let args = [
        "exec",
        "--write",
        first,
        "--no-wait",
        "--",
        "sh",
        "-c",
        &script,
    ];
    let user = Bg::from_command(b.stowage(&root, args));
    wait_for_file(&started);
    release(&env, "last");
    ok(holder.finish());
    // Either the hold's command ran (the defect) or it waits for `first`.
    let (log, waits) = (env.sentinel("sw.log"), format!("image '{first}'"));
    wait_until("the hold runs or waits for the image written", || {
        wide.exists() || fs::read_to_string(&log).is_ok_and(|l| l.contains(&waits))
    });
    std::fs::write(&go, "").unwrap();
    ok(user.finish());
    ok(hold_wide.finish());
    assert!(
        !overlap.exists(),
        "the store-wide command ran beside the image's writer"
    );
}

/// The same for an exclusive read: a reader on another host got in while
/// its lock was lost; it exits 1, and the image it wrote is incomplete.
#[test]
fn an_exclusive_read_whose_host_lost_its_connection_fails_and_says_so() {
    let Some(c) = Cluster::start("rxblip", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    ok(b.stowage_run(&root, ["exec", "--write", "base", "--", "true"]));
    let args = ["--read-exclusive", "base", "--write", "app"];
    let (reader, go) = hold_then(&env, a, &root, &args, "held", "true");
    std::fs::write(&go, "").unwrap();
    let out = ok(reader.finish());
    assert!(!stderr(&out).contains("lost"), "{}", show(&out));
    let (reader, go) = hold_then(&env, a, &root, &args, "rx", "true");
    a.disconnect();
    ok(b.stowage_run(&root, ["exec", "--read", "base", "--no-wait", "--", "true"]));
    std::fs::write(&go, "").unwrap();
    let out = reader.finish();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = "lost the exclusive read lock on image 'base'";
    assert!(stderr(&out).contains(said), "{}", show(&out));
    assert_eq!(image_state(b, &root, "app").as_deref(), Some("incomplete"));
    assert_eq!(image_state(b, &root, "base").as_deref(), Some("ready"));
}

/// A slot lost with its host's connection lets another host's command in
/// over the class's limit: the holder's exec warns that the class may have
/// run over it, and exits with its command's status.
#[test]
fn a_slot_whose_host_lost_its_connection_is_warned_of_with_the_commands_status() {
    let Some(c) = Cluster::start("slotblip", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    ok(b.stowage_run(&root, ["slots", "set", "pull", "1"]));
    let args = ["--slot", "pull", "--write", "s1"];
    let (holder, go) = hold_then(&env, a, &root, &args, "held", "true");
    std::fs::write(&go, "").unwrap();
    let out = ok(holder.finish());
    assert!(!stderr(&out).contains("lost"), "{}", show(&out));
    let (holder, go) = hold_then(&env, a, &root, &args, "slot", "exit 3");
    a.disconnect();
    ok(b.stowage_run(&root, ["exec", "--slot", "pull", "--no-wait", "--", "true"]));
    std::fs::write(&go, "").unwrap();
    let out = holder.finish();
    assert_eq!(code(&out), Some(3), "{}", show(&out));
    let said = "slot class 'pull' may have gone over its limit";
    assert!(stderr(&out).contains(said), "{}", show(&out));
}

/// A removal whose host lost its connection, after its record said
/// `deleting` or after the tree went to the trash, never moves or empties
/// what another host wrote meanwhile (its writer finished the removal and
/// wrote the image anew): it says the lock was lost, and the new image
/// stays, its tree with it. Before, the removal emptied the new record, or
/// moved the new tree to the trash behind a `ready` record.
#[test]
fn a_removal_whose_host_lost_its_connection_leaves_the_image_written_meanwhile() {
    let Some(c) = Cluster::start("rmblip", 3) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    for point in ["rm-marked", "rm-moved"] {
        ok(b.stowage_run(&root, ["exec", "--write", "img", "--", "true"]));
        let pause = env.sentinel(&format!("paused-{point}"));
        let mut cmd = a.stowage(&root, ["rm", "img"]);
        cmd.env(
            stowage::env::DEBUG_PAUSE,
            format!("{point}:{}", pause.display()),
        );
        let removal = Bg::from_command(cmd);
        wait_for_file(&pause);
        a.disconnect();
        let write = "touch \"$STOWAGE_IMAGE_DIR/new\"";
        let args = [
            "exec",
            "--write",
            "img",
            "--no-wait",
            "--",
            "sh",
            "-c",
            write,
        ];
        ok(b.stowage_run(&root, args));
        std::fs::remove_file(&pause).unwrap();
        let out = removal.finish();
        assert_eq!(code(&out), Some(1), "{point}: {}", show(&out));
        let said = "lost the lock on image 'img' while removing it";
        assert!(stderr(&out).contains(said), "{point}: {}", show(&out));
        assert_eq!(image_state(b, &root, "img").as_deref(), Some("ready"));
        let tree = root.join("img/img/new");
        // Looked at from a third host: the others' clients may answer from their caches.
        let found = c.host(2).run(["test", "-e", tree.to_str().unwrap()]);
        assert_eq!(code(&found), Some(0), "{point}: the new tree is gone");
    }
}

/// Starts `stowage ARGS` on `host`, its stderr in sentinel `LOG.log`, and
/// waits until it says it waits.
fn waiter(env: &Env, host: &Host, root: &Path, args: &[&str], log: &str) -> Bg {
    let path = env.sentinel(&format!("{log}.log"));
    let mut c = host.stowage(root, args);
    c.stderr(fs::File::create(&path).unwrap());
    let bg = Bg::from_command_keep_stderr(c);
    wait_until(&format!("{log} says it waits"), || {
        fs::read_to_string(&path)
            .unwrap_or_default()
            .contains("waiting for")
    });
    bg
}

#[test]
fn waiters_whose_host_lost_its_connection_wait_on_and_get_their_locks() {
    let Some(c) = Cluster::start("blip", 2) else {
        return;
    };
    let env = Env::new();
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    ok(b.stowage_run(&root, ["slots", "set", "s", "1"]));
    ok(b.stowage_run(&root, ["exec", "--write", "w", "--", "true"]));
    let holder = hold(&env, b, &root, &["--write", "w", "--slot", "s"], "h");
    let run = ["--", "true"];
    let waiters: Vec<(&str, Bg)> = [
        ("writer", vec!["exec", "--write", "w"]),
        ("bounded", vec!["exec", "--write", "w", "--wait", "60"]),
        ("slot", vec!["exec", "--slot", "s"]),
        ("wide", vec!["exec", "--store-wide"]),
    ]
    .into_iter()
    .map(|(log, mut args)| {
        args.extend(run);
        (log, waiter(&env, a, &root, &args, log))
    })
    .collect();
    // The blip: every waiter's descriptor, blocked or tried, dies with it.
    a.disconnect();
    // Connected again, host A works: the waiters have met their dead
    // descriptors by the time this returns.
    ok(a.stowage_run(&root, ["lock-status"]));
    release(&env, "h");
    ok(holder.finish());
    for (log, w) in waiters {
        let out = w.finish();
        let said = fs::read_to_string(env.sentinel(&format!("{log}.log"))).unwrap();
        assert_eq!(code(&out), Some(0), "{log}: {said}");
    }
}

/// A store-wide command that deletes the images directory and makes it
/// again (`ch-image reset` does) has deleted every tree in it, though the
/// client caches the old directory's link count, and then says it stale:
/// its images are forgotten, and new ones are made in the new directory.
/// The images directory both inside the root and outside it.
#[test]
fn an_images_directory_remade_by_a_store_wide_command_is_taken_on_a_shared_filesystem() {
    let Some(c) = Cluster::start("remade", 1) else {
        return;
    };
    let a = c.host(0);
    for (n, external) in [(0, false), (1, true)] {
        let root = c.dir.join(format!("root{n}"));
        if external {
            let img = c.dir.join(format!("img{n}"));
            ok(a.run(["mkdir", img.to_str().unwrap()]));
            ok(a.stowage_run(&root, ["init", "--images-dir", img.to_str().unwrap()]));
        }
        ok(a.stowage_run(&root, ["exec", "--write", "a", "--", "true"]));
        let script = "rm -rf \"$STOWAGE_IMAGES_DIR\" && mkdir \"$STOWAGE_IMAGES_DIR\"";
        let wide = ok(a.stowage_run(&root, ["exec", "--store-wide", "--", "sh", "-c", script]));
        let read = a.stowage_run(&root, ["exec", "--read", "a", "--", "true"]);
        assert_eq!(
            code(&read),
            Some(66),
            "external {external}: {}\n{}",
            show(&wide),
            show(&read)
        );
        ok(a.stowage_run(&root, ["exec", "--write", "b", "--", "true"]));
    }
}

/// A store on the volume whose images directory is a node-local path
/// (each host's own tmpfs there): on another host that path is another
/// directory, which holds a tree named as an image. Neither a read, a
/// rewrite, a removal nor an `init` there touches it, and the image stays
/// ready on the host whose directory it is.
#[test]
fn a_node_local_images_directory_is_never_used_from_another_host() {
    let Some(c) = Cluster::start("nodelocal", 2) else {
        return;
    };
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    let env = Env::new();
    let local = env.tmp.path().join("local");
    std::fs::create_dir(&local).unwrap();
    let (l, img) = (local.display(), local.join("img"));
    for (h, tree) in [(a, ""), (b, "/app")] {
        let make = format!("mount -t tmpfs tmpfs '{l}' && mkdir -p '{l}/img{tree}'");
        ok(h.run(["sh", "-c", &make]));
    }
    ok(b.run(["sh", "-c", &format!("echo theirs > '{l}/img/app/data'")]));
    ok(a.stowage_run(&root, ["init", "--images-dir", img.to_str().unwrap()]));
    ok(a.stowage_run(&root, ["exec", "--write", "app", "--", "true"]));
    for args in [
        &["exec", "--read", "app", "--", "true"][..],
        &["exec", "--write", "app", "--", "true"],
        &["rm", "app"],
        &["init"],
    ] {
        let out = b.stowage_run(&root, args);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains("not the directory recorded"),
            "{args:?}: {}",
            show(&out)
        );
    }
    let out = ok(b.run(["cat", &format!("{l}/img/app/data")]));
    assert_eq!(stdout(&out), "theirs\n");
    assert_eq!(image_state(a, &root, "app").as_deref(), Some("ready"));
    ok(a.stowage_run(&root, ["exec", "--read", "app", "--", "true"]));
    ok(a.run(["test", "-d", &format!("{l}/img/app")]));
}

/// A mount in the images directory whose server does not answer (a FUSE
/// client stopped) stops no look: gc, doctor and init never stat it, as the
/// mount table names it; it is no tree of the store's.
#[test]
fn a_mount_that_does_not_answer_in_the_images_directory_stops_no_look() {
    let Some(c) = Cluster::start("hung", 1) else {
        return;
    };
    let env = Env::new();
    env.make_image("a");
    let at = env.root.join("img/gl");
    fs::create_dir(&at).unwrap();
    let client = c.client_at("sub", &at);
    client.stop();
    // Past the client's attribute cache (1 s): a stat of the mount point would now wait.
    std::thread::sleep(Duration::from_secs(2));
    for args in [&["gc", "--max-size", "1G"][..], &["doctor"], &["init"]] {
        let mut cmd = std::process::Command::new("timeout");
        cmd.args(["-k", "5", "60", bin()])
            .arg("--root")
            .arg(&env.root)
            .args(args);
        let out = output(cmd);
        assert_ne!(code(&out), Some(124), "{args:?} waited on the mount");
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    drop(client);
}

/// A repair that found a tree without a record, then took its lock after
/// another host removed the image (its tree moved to the trash, its record
/// emptied), adopts nothing: this host's client still answers a lookup of
/// the tree from its cache for a while, but the listing asked under the
/// lock says it is gone. No phantom "incomplete" image is left behind.
#[test]
fn a_repair_never_adopts_a_tree_another_host_removed_a_moment_before() {
    let Some(c) = Cluster::start("adoptcache", 2) else {
        return;
    };
    let (root, a, b) = (c.root(), c.host(0), c.host(1));
    let env = Env::new();
    ok(a.stowage_run(&root, ["exec", "--write", "x", "--", "true"]));
    ok(a.stowage_run(&root, ["rm", "x"]));
    let (read, found) = (env.sentinel("records-read"), env.sentinel("orphans"));
    let mut repair = b.stowage(&root, ["doctor", "--repair"]);
    let points = format!(
        "doctor-records-read:{},doctor-orphans-found:{}",
        read.display(),
        found.display()
    );
    repair.env(stowage::env::DEBUG_PAUSE, points);
    let repair = Bg::from_command(repair);
    // Made after the repair read the records, so its tree is found without one; removed once
    // the repair has listed (and looked up) it.
    wait_for_file(&read);
    ok(a.stowage_run(&root, ["exec", "--write", "x", "--", "true"]));
    fs::remove_file(&read).unwrap();
    wait_for_file(&found);
    ok(a.stowage_run(&root, ["rm", "x"]));
    fs::remove_file(&found).unwrap();
    let out = repair.finish();
    assert!(!stdout(&out).contains("adopted"), "{}", show(&out));
    assert_eq!(image_state(a, &root, "x"), None);
    assert_eq!(image_state(b, &root, "x"), None);
}

/// A catalog an outside program (an sqlite3 shell) switched to WAL mode,
/// on a FUSE mount, which gives WAL's index no shared memory: every command
/// used to fail on it ("disk I/O error", code 5386) and `doctor --repair`
/// too, at every run. It is switched back by the first command, its rows
/// kept, with nothing said; `doctor` finds it intact.
#[test]
fn a_catalog_switched_to_wal_on_a_fuse_mount_is_switched_back() {
    if !tool_or_skip("sqlite3", "sqlite3") {
        return;
    }
    let Some(c) = Cluster::start("wal", 1) else {
        return;
    };
    let (host, root) = (c.host(0), c.root());
    ok(host.stowage_run(&root, ["exec", "--write", "base", "--", "true"]));
    ok(host.stowage_run(&root, ["images"]));
    let db = root.join("stowage.db");
    let wal = ok(host.run(["sqlite3", db.to_str().unwrap(), "PRAGMA journal_mode=WAL;"]));
    assert_eq!(stdout(&wal).trim(), "wal", "{}", show(&wal));
    let out = ok(host.stowage_run(&root, ["images"]));
    assert!(stdout(&out).contains("base "), "{}", show(&out));
    assert_eq!(stderr(&out), "", "{}", show(&out));
    let mode = ok(host.run([
        "sqlite3",
        db.to_str().unwrap(),
        "PRAGMA journal_mode; SELECT name FROM images;",
    ]));
    assert_eq!(stdout(&mode), "delete\nbase\n", "{}", show(&mode));
    let listed = stdout(&ok(host.run(["ls", root.to_str().unwrap()])));
    assert!(!listed.contains("stowage.db-wal"), "{listed}");
    let out = ok(host.stowage_run(&root, ["doctor"]));
    assert!(stdout(&out).contains("intact"), "{}", show(&out));
    ok(host.stowage_run(&root, ["doctor", "--repair"]));
}

/// `doctor` and `doctor --repair` on one host while two others commit to
/// the catalog: it is healthy, and nothing is set aside. Each commit deletes
/// the journal, which this host's client may have looked up a moment before:
/// SQLite met a stale handle, an I/O error, and doctor called the catalog
/// unusable (exit 1) and its repair said it set it aside and made it anew,
/// having done nothing.
#[test]
fn a_doctor_beside_commits_on_other_hosts_finds_the_catalog_healthy() {
    let Some(c) = Cluster::start("doctorio", 3) else {
        return;
    };
    let env = Env::new();
    let root = c.root();
    ok(c.host(0).stowage_run(&root, ["init"]));
    let stop = env.sentinel("stop");
    let mut writers = Vec::new();
    for (i, h) in c.hosts[..2].iter().enumerate() {
        let script = format!(
            "s() {{ '{bin}' --root '{root}' \"$@\" >/dev/null 2>&1; }}
             n=0; while [ ! -e '{stop}' ] && [ $n -lt 5000 ]; do
               s images; s exec --write cc{i} -- true; n=$((n + 1))
             done; exit 0",
            bin = bin(),
            root = root.display(),
            stop = stop.display()
        );
        writers.push(Bg::from_command(h.cmd(["sh", "-c", &script])));
    }
    let doctor = c.host(2);
    let mut failed = Vec::new();
    for args in [&["doctor"][..], &["doctor", "--repair"]] {
        for _ in 0..15 {
            let out = doctor.stowage_run(&root, args);
            let said = stdout(&out);
            if code(&out) != Some(0) || said.contains("set aside") {
                failed.push(show(&out));
            }
        }
    }
    fs::write(&stop, "").unwrap();
    for w in writers {
        ok(w.finish());
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    let names = ok(doctor.run(["ls", root.to_str().unwrap()]));
    assert!(!stdout(&names).contains("damaged"), "{}", show(&names));
}

/// A command on one host right after another host replaced `store.conf`
/// (`init --images-dir` renames a new one in) reads the new one: the file
/// this host's client looked up is gone on the server, a stale handle, and
/// a fresh open finds the new one (before: "cannot read …/store.conf: Stale
/// file handle", exit 1).
#[test]
fn a_configuration_another_host_replaced_is_read_afresh() {
    let Some(c) = Cluster::start("confstale", 2) else {
        return;
    };
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    ok(a.stowage_run(&root, ["init"]));
    for i in 0..4 {
        let img = c.dir.join(format!("img{}", i % 2));
        ok(a.run(["mkdir", "-p", img.to_str().unwrap()]));
        ok(a.stowage_run(&root, ["images"]));
        ok(b.stowage_run(&root, ["init", "--images-dir", img.to_str().unwrap()]));
        ok(a.stowage_run(&root, ["exec", "--write", &format!("new{i}"), "--", "true"]));
        ok(a.stowage_run(&root, ["rm", &format!("new{i}")]));
    }
}

/// A host that just looked at an image another host then removed makes it
/// anew at once: its client's cached entry for the gone tree (the server
/// says it is not there when it is listed) is no directory planted there.
#[test]
fn an_image_removed_on_another_host_is_made_anew_at_once() {
    let Some(c) = Cluster::start("remadeatonce", 2) else {
        return;
    };
    let (a, b, root) = (c.host(0), c.host(1), c.root());
    let state = "echo done > $STOWAGE_IMAGE_DIR/state";
    for round in 0..3 {
        ok(a.stowage_run(&root, ["exec", "--write", "x", "--", "sh", "-c", state]));
        let read = "cat $STOWAGE_IMAGES_DIR/x/state";
        ok(b.stowage_run(&root, ["exec", "--read", "x", "--", "sh", "-c", read]));
        ok(a.stowage_run(&root, ["rm", "x"]));
        let out = b.stowage_run(&root, ["exec", "--write", "x", "--", "true"]);
        assert_eq!(code(&out), Some(0), "round {round}: {}", show(&out));
        ok(b.stowage_run(&root, ["rm", "x"]));
    }
}
