//! Slots: counting semaphores per class, with a reserve for high priority.

use std::fs;
use std::time::Duration;

use crate::common::*;

/// A command that registers itself as inside, records how many are inside,
/// and stays until `target` are inside together (or all `total` have
/// entered), so that the limit is really reached; bounded.
fn counting_cmd(env: &Env, target: usize, total: usize) -> Vec<String> {
    let d = env.scratch.display();
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "mkdir '{d}/in.'$$; n=$(ls -d '{d}'/in.* | wc -l); echo $n >> '{d}/counts'; echo x >> '{d}/entered'; \
             i=0; while [ $(ls -d '{d}'/in.* | wc -l) -lt {target} ] && [ $(wc -l < '{d}/entered') -lt {total} ] \
             && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; \
             ls -d '{d}'/in.* | wc -l >> '{d}/counts'; rmdir '{d}/in.'$$"
        ),
    ]
}

/// `stowage exec OPTS -- <counting_cmd>` in the background.
fn counting_worker(env: &Env, opts: &[&str], target: usize, total: usize) -> Bg {
    let mut args = vec!["exec".to_string()];
    args.extend(opts.iter().map(|o| o.to_string()));
    args.push("--".into());
    args.extend(counting_cmd(env, target, total));
    env.spawn(&args)
}

fn max_count(env: &Env) -> usize {
    fs::read_to_string(env.scratch.join("counts"))
        .unwrap()
        .lines()
        .map(|l| l.trim().parse::<usize>().unwrap())
        .max()
        .unwrap()
}

#[test]
fn limit_three_with_nine_contenders() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "3"]);
    let workers: Vec<_> = (0..9)
        .map(|_| counting_worker(&env, &["--slot", "pull"], 3, 9))
        .collect();
    for w in workers {
        let out = w.finish();
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    }
    assert_eq!(
        max_count(&env),
        3,
        "never more than 3 at once, and 3 reached"
    );
    let entered = fs::read_to_string(env.scratch.join("entered"))
        .unwrap()
        .lines()
        .count();
    assert_eq!(entered, 9, "all finish");
}

#[test]
fn unlimited_class_lets_everyone_in_at_once() {
    let env = Env::new();
    env.ok(["slots", "set", "load/docker", "0"]);
    let workers: Vec<_> = (0..5)
        .map(|_| counting_worker(&env, &["--slot", "load/docker", "--no-wait"], 5, 5))
        .collect();
    for w in workers {
        assert_eq!(w.finish().status.code(), Some(0));
    }
    assert_eq!(max_count(&env), 5);
    assert!(
        !env.root.join("locks/slots/load%docker").exists(),
        "no lock files for an unlimited class"
    );
}

fn holder(env: &Env, class: &str, priority: &str, tag: &str) -> Bg {
    env.hold(
        &["--slot", class, "--priority", priority],
        &format!("started.{tag}"),
    )
}

/// The lock-status entry of the (only) slot class.
fn slot_entry(env: &Env) -> serde_json::Value {
    let st = env.status_json(Vec::<String>::new());
    st["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "slot")
        .unwrap()
        .clone()
}

/// Waits (bounded) until lock-status shows a waiter on the slot class.
fn wait_for_slot_waiter(env: &Env) {
    wait_until("the slot waiter is recorded", || {
        !slot_entry(env)["waiters"].as_array().unwrap().is_empty()
    });
}

#[test]
fn high_priority_gets_the_reserved_slot() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2", "--reserve-high", "1"]);
    let a = holder(&env, "pull", "normal", "a");
    let b = holder(&env, "pull", "normal", "b");
    // Saturated with normal work: normal requests are refused...
    let out = env.run(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(
        stderr(&out).contains("slot of class 'pull'"),
        "{}",
        stderr(&out)
    );
    // ...but a high-priority one gets through without waiting.
    env.ok([
        "exec",
        "--slot",
        "pull",
        "--priority",
        "high",
        "--no-wait",
        "--",
        "true",
    ]);
    // The reserve is one slot: with it taken, high priority waits too.
    let c = holder(&env, "pull", "high", "c");
    let out = env.run([
        "exec",
        "--slot",
        "pull",
        "--priority",
        "high",
        "--no-wait",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));

    let slot = slot_entry(&env);
    assert_eq!(slot["name"], "pull");
    assert_eq!(slot["limit"], 2);
    assert_eq!(slot["reserve_high"], 1);
    assert_eq!(slot["in_use"], 3);
    assert_eq!(slot["state"], "shared");
    let pids: Vec<u64> = slot["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["pid"].as_u64().unwrap())
        .collect();
    for bg in [&a, &b, &c] {
        assert!(pids.contains(&u64::from(bg.pid())), "{slot}");
    }
    env.release("release");
    for bg in [a, b, c] {
        assert_eq!(bg.finish().status.code(), Some(0));
    }
    let slot = slot_entry(&env);
    assert_eq!(slot["in_use"], 0, "{slot}");
    assert_eq!(slot["state"], "free");
    assert!(slot["holders"].as_array().unwrap().is_empty());
}

#[test]
fn a_waiter_shows_in_lock_status_and_gets_the_freed_slot() {
    let env = Env::new();
    env.ok(["slots", "set", "load/podman", "1"]);
    let a = holder(&env, "load/podman", "normal", "a");
    let ran = env.sentinel("ran");
    let waiter = env.spawn([
        "exec",
        "--slot",
        "load/podman",
        "--",
        "touch",
        ran.to_str().unwrap(),
    ]);
    wait_for_slot_waiter(&env);
    let slot = slot_entry(&env);
    let w = &slot["waiters"][0];
    assert_eq!(w["pid"], waiter.pid());
    assert_eq!(w["command"], format!("touch {}", ran.display()));
    assert!(
        w["since"].is_string() && w["user"].is_string() && w["host"].is_string(),
        "{w}"
    );
    assert!(!ran.exists());
    env.release("release");
    a.finish();
    assert_eq!(waiter.finish().status.code(), Some(0));
    assert!(ran.exists());
}

#[test]
fn sigkill_of_a_holder_frees_its_slot() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "1"]);
    let a = holder(&env, "pull", "normal", "a");
    let out = env.run(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75));
    a.kill_all();
    env.ok(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    let slot = slot_entry(&env);
    assert!(
        slot["holders"].as_array().unwrap().is_empty(),
        "the dead holder's record is gone: {slot}"
    );
}

#[test]
fn lowering_a_limit_keeps_current_holders() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let a = holder(&env, "pull", "normal", "a");
    let b = holder(&env, "pull", "normal", "b");
    env.ok(["slots", "set", "pull", "1"]);
    let out = env.ok(["slots", "--json"]);
    let classes: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(classes[0]["limit"], 1);
    assert_eq!(classes[0]["in_use"], 2, "both holders keep their slots");
    let out = env.run(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75));
    env.release("release");
    assert_eq!(a.finish().status.code(), Some(0));
    assert_eq!(b.finish().status.code(), Some(0));
    env.ok(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
}

#[test]
fn waiting_for_a_slot_burns_no_cpu() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let a = holder(&env, "pull", "normal", "a");
    let b = holder(&env, "pull", "normal", "b");
    let waiter = env.spawn(["exec", "--slot", "pull", "--", "true"]);
    wait_for_slot_waiter(&env);
    let before = cpu_ticks(waiter.pid());
    std::thread::sleep(Duration::from_secs(2)); // the measurement window
    let used = cpu_ticks(waiter.pid()) - before;
    // A spinning waiter would use ~200 ticks (2 s); a blocked one ~0.
    assert!(
        used <= 5,
        "waiter used {used} clock ticks of CPU in 2 s of waiting"
    );
    env.release("release");
    a.finish();
    b.finish();
    assert_eq!(waiter.finish().status.code(), Some(0));
}

#[test]
fn unknown_classes_and_bad_settings_are_usage_errors() {
    let env = Env::new();
    let out = env.run(["exec", "--slot", "pull", "--", "true"]);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(
        stderr(&out).contains("no slot classes are configured"),
        "{}",
        stderr(&out)
    );
    env.ok(["slots", "set", "pull", "2"]);
    env.ok(["slots", "set", "load/podman", "1"]);
    let out = env.run(["exec", "--slot", "push", "--", "true"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(
        stderr(&out).contains("load/podman, pull"),
        "lists the classes: {}",
        stderr(&out)
    );
    for args in [
        vec!["slots", "set", "Pull", "1"],
        vec!["slots", "set", "a//b", "1"],
        vec!["slots", "set", "pull", "-1"],
        vec!["slots", "set", "pull", "lots"],
        vec!["slots", "set", "pull", "100000"],
        vec!["slots", "set", "pull", "0", "--reserve-high", "1"],
        vec!["slots", "set", "pull", "1", "--reserve-high", "99"],
        vec!["slots", "rm", "push"],
        vec!["exec", "--priority", "high", "--", "true"],
        vec![
            "exec",
            "--slot",
            "pull",
            "--priority",
            "urgent",
            "--",
            "true",
        ],
    ] {
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", show(&out));
        assert_eq!(
            stderr(&out).trim_end().lines().count(),
            1,
            "{args:?}: {}",
            stderr(&out)
        );
    }
    env.ok(["slots", "rm", "pull"]);
    let out = env.ok(["slots", "--json"]);
    let classes: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(classes.as_array().unwrap().len(), 1);
}

#[test]
fn slots_compose_with_image_locks() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "1"]);
    let a = env.hold(&["--slot", "pull", "--write", "alpine"], "started");
    let entry = env.lock_entry("alpine").unwrap();
    assert_eq!(entry["state"], "exclusive");
    // The slot is busy, so a second pull of another image waits for the slot.
    let out = env.run([
        "exec", "--slot", "pull", "--write", "other", "--wait", "0.2", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert_eq!(
        env.state("other"),
        None,
        "nothing created while waiting for the slot"
    );
    env.release("release");
    assert_eq!(a.finish().status.code(), Some(0));
    assert_eq!(env.state("alpine").as_deref(), Some("ready"));
}

/// A slot held outside stowage by flock(1) — which opens the lock file
/// read-only — wakes a waiting exec when it is let go, not at the waiter's
/// next periodic look (30 s on a local filesystem) or the last try at its
/// deadline (20 s below). Half the deadline is the bound: a release that is
/// seen takes milliseconds, one that is missed takes the whole 20 s.
#[test]
fn a_slot_released_by_flock_1_wakes_its_waiter() {
    let env = Env::new();
    env.ok(["slots", "set", "one", "1"]);
    let dir = env.root.join("locks/slots/one");
    fs::create_dir_all(&dir).unwrap();
    let release = env.sentinel("release");
    let mut holder = std::process::Command::new("flock");
    holder.arg("-x").arg(dir.join("0.lock")).args([
        "sh",
        "-c",
        &format!(
            "touch '{}'; while [ ! -e '{}' ]; do sleep 0.01; done",
            env.sentinel("held").display(),
            release.display()
        ),
    ]);
    let holder = Bg::from_command(holder);
    wait_for_file(&env.sentinel("held"));
    let waiter = env.spawn(["exec", "--slot", "one", "--wait", "20", "--", "true"]);
    wait_until("the exec waits for the slot", || {
        env.status_json(Vec::<String>::new())["locks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["kind"] == "slot" && !l["waiters"].as_array().unwrap().is_empty())
    });
    fs::write(&release, "").unwrap();
    let released = std::time::Instant::now();
    assert_eq!(holder.finish().status.code(), Some(0));
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let took = released.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "the waiter slept through the release ({took:?})"
    );
}
