//! Slots: counting semaphores per class, with a reserve for high priority,
//! waits for a slot, and limits changed or classes removed while holders and
//! waiters are there.

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
    // Each holder took a file of its own without waiting (so a limit set
    // later counts it): no more files than ran at once, numbered from 0.
    let files: Vec<String> = fs::read_dir(env.root.join("locks/slots/load%docker"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".lock"))
        .collect();
    assert!((1..=5).contains(&files.len()), "{files:?}");
    for i in 0..files.len() {
        assert!(files.contains(&format!("{i}.lock")), "{files:?}");
    }
}

/// Holders of an unlimited class count against a limit set while they run:
/// with two holders and the limit lowered from 0 to 1, lock-status says 2
/// in use and no one new gets in until both have ended.
#[test]
fn holders_of_an_unlimited_class_count_against_a_limit_set_later() {
    let env = Env::new();
    env.ok(["slots", "set", "z", "0"]);
    let a = env.hold_until(&["--slot", "z"], "a", "release-a");
    let b = env.hold_until(&["--slot", "z"], "b", "release-b");
    env.ok(["slots", "set", "z", "1"]);
    let e = env.slot_entry("z").unwrap();
    assert_eq!(e["in_use"], 2, "{e}");
    let ran = env.sentinel("waiter-ran");
    let waiter = env.spawn(["exec", "--slot", "z", "--", "touch", ran.to_str().unwrap()]);
    env.wait_for_slot_waiters("z", 1);
    env.release("release-a");
    assert_eq!(a.finish().status.code(), Some(0));
    // b still runs, the limit is 1: the waiter stays out (its tries of the freed file, each let
    // go on reading the record, end first).
    wait_until("the waiter's tries end", || {
        env.slot_entry("z").unwrap()["in_use"] == 1
    });
    for _ in 0..20 {
        assert!(
            !ran.exists(),
            "a holder from before the limit was not counted"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    env.release("release-b");
    assert_eq!(b.finish().status.code(), Some(0));
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(ran.exists());
}

/// Holders of a slot of `class`, one per tag, each until sentinel `release-TAG`.
fn slot_holders(env: &Env, class: &str, tags: &[&str]) -> Vec<(String, Bg)> {
    let hold = |t: &&str| env.hold_until(&["--slot", class], t, &format!("release-{t}"));
    tags.iter().map(|t| (t.to_string(), hold(t))).collect()
}

/// Lets each holder go and checks it ended well.
fn release_all(env: &Env, held: impl IntoIterator<Item = (String, Bg)>) {
    for (t, h) in held {
        env.release(&format!("release-{t}"));
        assert_eq!(code(&h.finish()), Some(0), "{t}");
    }
}

fn holder(env: &Env, class: &str, priority: &str, tag: &str) -> Bg {
    env.hold(
        &["--slot", class, "--priority", priority],
        &format!("started.{tag}"),
    )
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

    let slot = env.slot_entry("pull").unwrap();
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
    let slot = env.slot_entry("pull").unwrap();
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
    env.wait_for_slot_waiters("load/podman", 1);
    let slot = env.slot_entry("load/podman").unwrap();
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
    let slot = env.slot_entry("pull").unwrap();
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
    env.wait_for_slot_waiters("pull", 1);
    assert_waits_without_cpu(&waiter);
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
    // A mistake in a subcommand of slots points to that subcommand's help
    // (it pointed to 'stowage slots --help', which has no LIMIT, and for an
    // unknown one to 'stowage --help').
    for (args, page) in [
        (
            &["slots", "set", "pull"][..],
            "see 'stowage slots set --help'",
        ),
        (&["slots", "frobnicate"], "see 'stowage slots --help'"),
    ] {
        let out = env.run(args);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", show(&out));
        assert!(stderr(&out).contains(page), "{args:?}: {}", show(&out));
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
    let holder = flock_holder(
        &dir.join("0.lock"),
        &env.sentinel("held"),
        &format!(
            "while [ ! -e '{}' ]; do sleep 0.01; done",
            release.display()
        ),
    );
    let waiter = env.spawn(["exec", "--slot", "one", "--wait", "20", "--", "true"]);
    env.wait_for_slot_waiters("one", 1);
    fs::write(&release, "").unwrap();
    let released = std::time::Instant::now();
    assert_eq!(holder.finish().status.code(), Some(0));
    assert_in_soon(waiter, released, "the waiter slept through the release");
}

/// A script holds class `one`'s slot `0.lock` the flock(1) way on a
/// descriptor, a waiter queues for it, and the script lets go by `let_go`
/// (shell, `{slot}` naming the file): returns once it has let go.
fn slot_let_go_by_a_script(env: &Env, let_go: &str) -> (Bg, Bg) {
    let slot = env.root.join("locks/slots/one/0.lock");
    let let_go = let_go.replace("{slot}", &slot.display().to_string());
    let [held, release, released] = ["held", "release", "released"].map(|s| env.sentinel(s));
    let holder = Bg::from_command({
        let mut c = std::process::Command::new("sh");
        c.arg("-c").arg(format!(
            "exec 9<>'{slot}'; flock -x 9; touch '{held}'; \
             while [ ! -e '{release}' ]; do sleep 0.01; done; \
             {let_go} touch '{released}'; sleep 30",
            slot = slot.display(),
            held = held.display(),
            release = release.display(),
            released = released.display(),
        ));
        c
    });
    wait_for_file(&held);
    let waiter = env.spawn(["exec", "--slot", "one", "--wait", "20", "--", "true"]);
    env.wait_for_slot_waiters("one", 1);
    fs::write(&release, "").unwrap();
    wait_for_file(&released);
    (holder, waiter)
}

/// The kernel tells of a file's last close before it releases the file's flock, so a waiter woken
/// by a holder's exit may try while the slot is still held. Here the holder closes another
/// descriptor of the slot file, which wakes the waiter, and lets go 50 ms later by `flock -u`, with
/// no close: the waiter must take the slot then, not at its next periodic look (30 s) or the last
/// try at its deadline (20 s below).
#[test]
fn a_slot_released_just_after_the_close_that_woke_its_waiter_is_taken() {
    let env = Env::new();
    env.ok(["slots", "set", "one", "1"]);
    let (holder, waiter) =
        slot_let_go_by_a_script(&env, "exec 8<'{slot}'; exec 8<&-; sleep 0.05; flock -u 9;");
    let let_go = std::time::Instant::now();
    assert_in_soon(waiter, let_go, "the waiter slept through the release");
    holder.kill_all();
}

/// A script that takes a slot the flock(1) way on a descriptor and lets go
/// by `flock -u`, keeping the descriptor open, closes nothing: the waiter,
/// which saw the slot held by a process stowage did not start, tries often
/// and takes it then, not at its next periodic look (30 s) or its deadline.
/// It lets go a second after being told: the tries after the last close
/// (lock-status's look) are over by then.
#[test]
fn a_slot_let_go_by_flock_u_without_a_close_is_taken_soon() {
    let env = Env::new();
    env.ok(["slots", "set", "one", "1"]);
    let (holder, waiter) = slot_let_go_by_a_script(&env, "sleep 1; flock -u 9;");
    let let_go = std::time::Instant::now();
    assert_in_soon(waiter, let_go, "the waiter slept through the flock -u");
    holder.kill_all();
}

/// A waiter whose take is given back because holders beyond a lowered limit still fill it reads
/// nothing, so it closes nothing: a close would wake itself, and it would spin until they end.
#[test]
fn a_waiter_held_back_by_a_lowered_limit_burns_no_cpu() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "3"]);
    let zero = hold_slot_file(&env, "pull", "0.lock");
    let _one = hold_slot_file(&env, "pull", "1.lock");
    let _two = hold_slot_file(&env, "pull", "2.lock");
    let mut waiter = env.spawn(["exec", "--slot", "pull", "--", "true"]);
    env.wait_for_slot_waiters("pull", 1);
    env.ok(["slots", "set", "pull", "2"]);
    // Slot 0 comes free, but the holders of 1 and 2 (2 now beyond the limit) still fill it.
    zero.kill_all();
    wait_until("slot 0 is free", || {
        flock_free(&env.root.join("locks/slots/pull/0.lock"))
    });
    assert_waits_without_cpu(&waiter);
    assert!(waiter.is_running(), "the lowered limit still binds");
}

/// A limit raised after a waiter's last try and before it watches the class (paused there) is seen:
/// the waiter reads the class once it watches, and takes the new slot, not at its next periodic
/// look (30 s) or its deadline (20 s, where it would give up under the old limit).
#[test]
fn a_limit_raised_before_a_waiter_watches_lets_it_in() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "1"]);
    let _zero = hold_slot_file(&env, "pull", "0.lock");
    let args = ["exec", "--slot", "pull", "--wait", "20", "--", "true"];
    let (waiter, paused) = env.paused(args, "slot-watching");
    env.ok(["slots", "set", "pull", "2"]);
    let let_go = std::time::Instant::now();
    fs::remove_file(&paused).unwrap();
    assert_in_soon(waiter, let_go, "the waiter missed the raised limit");
}

// --- a changing configuration -----------------------------------------------

#[test]
fn a_raised_or_lifted_slot_limit_lets_queued_waiters_in() {
    let env = Env::new();
    env.ok(["slots", "set", "one", "1"]);
    let mut holder = env.hold_until(&["--slot", "one"], "held", "release");
    let first = env.spawn(["exec", "--slot", "one", "--", "true"]);
    env.wait_for_slot_waiters("one", 1);
    env.ok(["slots", "set", "one", "2"]);
    let out = first.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        holder.is_running(),
        "the raised limit let the waiter in, not the holder's end"
    );

    let second = env.hold_until(&["--slot", "one"], "second", "release");
    let third = env.spawn(["exec", "--slot", "one", "--", "true"]);
    env.wait_for_slot_waiters("one", 1);
    env.ok(["slots", "set", "one", "0"]);
    let out = third.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(holder.is_running());
    env.release("release");
    for bg in [holder, second] {
        assert_eq!(bg.finish().status.code(), Some(0));
    }
}

#[test]
fn a_lowered_slot_limit_binds_queued_waiters() {
    let env = Env::new();
    env.ok(["slots", "set", "two", "2"]);
    let a = env.hold_until(&["--slot", "two"], "a", "release-a");
    let b = env.hold_until(&["--slot", "two"], "b", "release-b");
    let waiter = env.spawn([
        "exec",
        "--slot",
        "two",
        "--",
        "touch",
        env.sentinel("waiter-ran").to_str().unwrap(),
    ]);
    env.wait_for_slot_waiters("two", 1);
    env.ok(["slots", "set", "two", "1"]);
    env.release("release-a");
    assert_eq!(a.finish().status.code(), Some(0));
    // One slot is still in use (b keeps it), and the limit is 1 now: the
    // waiter must stay out however often it is woken. Watch it a while, once its tries of the
    // freed file (each let go on reading the record) end.
    wait_until("the waiter's tries end", || {
        env.slot_entry("two").unwrap()["in_use"] == 1
    });
    for _ in 0..20 {
        assert!(
            !env.sentinel("waiter-ran").exists(),
            "the lowered limit did not bind the waiter"
        );
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    env.release("release-b");
    assert_eq!(b.finish().status.code(), Some(0));
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(env.sentinel("waiter-ran").exists());
}

/// A high-priority holder of a reserved slot counts against the limit once
/// the reserve is removed: with limit 2, reserve 0 and three holders (one
/// on `high-0`), a normal holder's end lets no one new in.
#[test]
fn a_holder_of_a_removed_reserve_counts_against_the_limit() {
    let env = Env::new();
    env.ok(["slots", "set", "c", "2", "--reserve-high", "1"]);
    let high = env.hold_until(
        &["--slot", "c", "--priority", "high"],
        "high",
        "release-high",
    );
    let a = env.hold_until(&["--slot", "c"], "a", "release-a");
    let b = env.hold_until(&["--slot", "c"], "b", "release-b");
    env.ok(["slots", "set", "c", "2", "--reserve-high", "0"]);
    let ran = env.sentinel("waiter-ran");
    let waiter = env.spawn(["exec", "--slot", "c", "--", "touch", ran.to_str().unwrap()]);
    env.wait_for_slot_waiters("c", 1);
    env.release("release-a");
    assert_eq!(a.finish().status.code(), Some(0));
    // The waiter, woken by the close, tries the freed file a few times (each a moment's hold, let
    // go on reading the record): two in use once its tries end.
    wait_until("the waiter's tries end", || {
        env.slot_entry("c").unwrap()["in_use"] == 2
    });
    // Two run (b and the high holder), the limit is 2: the waiter stays out.
    for _ in 0..20 {
        assert!(
            !ran.exists(),
            "the removed reserve's holder was not counted"
        );
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    env.release("release-high");
    assert_eq!(high.finish().status.code(), Some(0));
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(ran.exists());
    env.release("release-b");
    assert_eq!(b.finish().status.code(), Some(0));
}

/// Holders beyond a lowered limit count against the total a reserve
/// allows too: with three normal holders and the class set to limit 1,
/// reserve 2, the total (3) is at LIMIT+N already, so a high-priority
/// newcomer waits rather than take a reserved slot.
#[test]
fn a_high_priority_newcomer_waits_while_holders_beyond_a_lowered_limit_fill_the_total() {
    let env = Env::new();
    env.ok(["slots", "set", "c", "3"]);
    let held = slot_holders(&env, "c", &["a", "b", "d"]);
    env.ok(["slots", "set", "c", "1", "--reserve-high", "2"]);
    let args = [
        "exec",
        "--slot",
        "c",
        "--priority",
        "high",
        "--no-wait",
        "--",
        "true",
    ];
    let out = env.run(args);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    release_all(&env, held);
    env.ok(args);
}

#[test]
fn a_removed_class_shows_its_holders_until_they_end_and_ends_its_waits() {
    let env = Env::new();
    env.ok(["slots", "set", "one", "1"]);
    let holder = env.hold_until(&["--slot", "one"], "held", "release");
    let waiter = env.spawn(["exec", "--slot", "one", "--", "true"]);
    env.wait_for_slot_waiters("one", 1);
    env.ok(["slots", "rm", "one"]);
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(
        stderr(&out).contains("removed while waiting"),
        "{}",
        show(&out)
    );
    let e = env
        .slot_entry("one")
        .expect("the removed class is shown while held");
    assert_eq!(e["holders"].as_array().unwrap().len(), 1, "{e}");
    // Every field of a slot class's entry is there: no limit any more, its holders counted.
    assert_eq!(e.get("limit"), Some(&serde_json::Value::Null), "{e}");
    assert_eq!(e.get("reserve_high"), Some(&serde_json::Value::Null), "{e}");
    assert_eq!(e["in_use"], 1, "{e}");
    let text = String::from_utf8_lossy(&env.ok(["lock-status"]).stdout).into_owned();
    assert!(text.contains("one (removed)"), "{text}");
    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert!(env.slot_entry("one").is_none());
}

/// Holders of a removed class count against the class set again under its
/// name, whichever of its files they hold: `slots rm` then `slots set` lets
/// no one in beyond LIMIT+N (before, the new class did not know the files
/// still held and let three newcomers in beside three holders).
#[test]
fn holders_of_a_removed_class_count_against_the_class_set_again() {
    let env = Env::new();
    let newcomer = |priority: &str| {
        env.run([
            "exec",
            "--slot",
            "c",
            "--priority",
            priority,
            "--no-wait",
            "--",
            "true",
        ])
    };
    env.ok(["slots", "set", "c", "1", "--reserve-high", "2"]);
    let mut held = slot_holders(&env, "c", &["a"]);
    for t in ["h1", "h2"] {
        let opts = ["--slot", "c", "--priority", "high"];
        held.push((t.into(), env.hold_until(&opts, t, &format!("release-{t}"))));
    }
    env.ok(["slots", "rm", "c"]);
    env.ok(["slots", "set", "c", "3"]);
    let out = newcomer("normal");
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert_eq!(env.slot_entry("c").unwrap()["in_use"], 3);
    let mut held = held.into_iter();
    release_all(&env, held.next());
    env.ok(["slots", "rm", "c"]);
    env.ok(["slots", "set", "c", "1", "--reserve-high", "1"]);
    // Two holders of reserved files: the total of 2 is reached.
    for priority in ["normal", "high"] {
        let out = newcomer(priority);
        assert_eq!(code(&out), Some(75), "{priority}: {}", show(&out));
    }
    release_all(&env, held);
    for priority in ["normal", "high"] {
        assert_eq!(code(&newcomer(priority)), Some(0));
    }
}

/// A normal-priority waiter is told only of the holders in its way: the
/// holder of a reserved slot, which it can never take, is not among them
/// (before, "all in use by" named it too, as "and 1 more").
/// `slots set` counts a removed class's held files before it writes the new
/// limits: killed right after that write, the class still counts them
/// (before, a newcomer got in beside two holders under a limit of 2).
#[test]
fn a_slots_set_killed_after_its_write_still_counts_a_removed_class_holders() {
    let env = Env::new();
    env.ok(["slots", "set", "c", "3"]);
    let mut held = slot_holders(&env, "c", &["a", "b", "d"]).into_iter();
    env.ok(["slots", "rm", "c"]);
    let (set, _) = env.paused(["slots", "set", "c", "2"], "slots-written");
    set.kill_all();
    release_all(&env, held.next());
    let out = env.run(["exec", "--slot", "c", "--no-wait", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    release_all(&env, held);
}

/// Files in a class's directory with slot-like names that are no slot of
/// it (a number past what a class counts, another spelling of one) are
/// not counted: `slots set` and takers go on, and the limit admits its
/// full count (before, a `4000000000.lock` made `slots set` and every
/// take abort).
#[test]
fn files_with_slot_like_names_that_are_no_slot_are_not_counted() {
    let env = Env::new();
    env.ok(["slots", "set", "c", "2"]);
    let dir = env.root.join("locks/slots/c");
    for name in ["4000000000.lock", "007.lock", "+1.lock", "high-99999.lock"] {
        std::fs::write(dir.join(name), "").unwrap();
    }
    env.ok(["slots", "set", "c", "2"]);
    let held = slot_holders(&env, "c", &["a", "b"]);
    let out = env.run(["exec", "--slot", "c", "--no-wait", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    release_all(&env, held);
}

#[test]
fn a_normal_waiter_is_not_told_of_the_reserved_slots_holders() {
    let env = Env::new();
    env.ok(["slots", "set", "one", "1", "--reserve-high", "1"]);
    let normal = env.hold_until(&["--slot", "one"], "normal", "release-normal");
    let opts = ["--slot", "one", "--priority", "high"];
    let high = env.hold_until(&opts, "high", "release-high");
    let out = env.run(["exec", "--slot", "one", "--no-wait", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    let said = stderr(&out);
    assert!(said.contains(&format!("pid {}", normal.pid())), "{said}");
    assert!(!said.contains(&format!("pid {}", high.pid())), "{said}");
    assert!(!said.contains("more"), "{said}");
    release_all(&env, [("normal".into(), normal), ("high".into(), high)]);
}

#[test]
fn a_slot_waiter_under_a_pids_limit_still_waits_and_gets_in() {
    let env = Env::new();
    // Four tasks: stowage, its signal thread, the command, and one spare.
    // A helper thread per slot file (eight here) cannot start.
    let Some(cg) = PidsCgroup::new(4) else {
        return;
    };
    env.ok(["slots", "set", "eight", "8"]);
    let holders: Vec<Bg> = (0..8)
        .map(|i| env.hold_until(&["--slot", "eight"], &format!("h{i}"), "release"))
        .collect();
    let waiter = Bg::from_command(cg.wrap(&format!(
        "'{bin}' --root '{root}' exec --slot eight -- touch '{ran}'",
        bin = bin(),
        root = env.root.display(),
        ran = env.sentinel("ran").display()
    )));
    env.wait_for_slot_waiters("eight", 1);
    env.release("release");
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(env.sentinel("ran").exists());
    for h in holders {
        assert_eq!(h.finish().status.code(), Some(0));
    }
}

/// Taking a slot writes nothing to the metadata: its holder is named by its
/// lease (with the kernel's lock table and without one, as on NFS), and an
/// exec that takes a slot and reads a fresh image leaves the database file
/// as it was.
#[test]
fn a_slot_holder_is_named_by_its_lease_and_writes_no_metadata() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["slots", "set", "pull", "2"]);
    env.ok(["exec", "--slot", "pull", "--read", "base", "--", "true"]);
    let db = env.root.join("stowage.db");
    let zero = env.root.join("locks/slots/pull/0.lock");
    let before = (fs::read(&db).ok(), fs::read(&zero).unwrap());
    env.ok(["exec", "--slot", "pull", "--read", "base", "--", "true"]);
    assert!(
        (fs::read(&db).ok(), fs::read(&zero).unwrap()) == before,
        "something was written"
    );
    let holder = env.hold(&["--slot", "pull"], "held");
    let named = |e: &serde_json::Value, how: &str| {
        let h = e["holders"].as_array().unwrap();
        assert_eq!(h.len(), 1, "{how}: {e}");
        assert_eq!(h[0]["pid"], holder.pid(), "{how}: {e}");
        assert!(
            h[0]["command"]
                .as_str()
                .is_some_and(|c| c.starts_with("sh -c ")),
            "{how}: {e}"
        );
        assert_eq!(e["in_use"], 1, "{how}: {e}");
    };
    named(&env.slot_entry("pull").unwrap(), "with the lock table");
    let mut c = env.cmd(["lock-status", "--json"]);
    c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
    let out = output(c);
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let e = st["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "slot" && l["name"] == "pull")
        .cloned()
        .unwrap();
    named(&e, "without a lock table");
    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
}

/// Asserts that `waiter` got its slot (exit 0) well before its 20 s deadline, counted from
/// `since`: a wake that is seen takes milliseconds, one that is missed the whole deadline.
fn assert_in_soon(waiter: Bg, since: std::time::Instant, missed: &str) {
    let out = waiter.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let took = since.elapsed();
    assert!(took < Duration::from_secs(10), "{missed} ({took:?})");
}

// --- the class record: taking a slot without the global lock --------------

/// Holds a slot file with flock(1) (an outside holder counts as one).
fn hold_slot_file(env: &Env, class_dir: &str, file: &str) -> Bg {
    flock_holder(
        &env.root.join("locks/slots").join(class_dir).join(file),
        &env.sentinel(&format!("holding-{file}")),
        "sleep 60",
    )
}

fn record_of(env: &Env, class_dir: &str, file: &str) -> String {
    let bytes = fs::read(env.root.join("locks/slots").join(class_dir).join(file)).unwrap();
    String::from_utf8_lossy(&bytes)
        .trim_end_matches('\0')
        .to_owned()
}

#[test]
fn a_slot_is_taken_on_its_class_record_without_the_global_lock() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["slots", "set", "pull", "2"]);
    assert!(
        record_of(&env, "pull", "0.lock").contains("limit=2\n"),
        "slots set writes the class record into its first slot file"
    );
    let global = hold_global(&env);
    let read = [
        "exec", "--slot", "pull", "--read", "base", "--wait", "0.3", "--", "true",
    ];
    let out = env.run(read);
    assert_eq!(out.status.code(), Some(0), "slot 0: {}", show(&out));
    // Slot 0 held elsewhere: slot 1, by the record read without its lock.
    let zero = hold_slot_file(&env, "pull", "0.lock");
    let out = env.run(read);
    assert_eq!(out.status.code(), Some(0), "slot 1: {}", show(&out));
    // Both held: busy.
    let one = hold_slot_file(&env, "pull", "1.lock");
    let out = env.run(read);
    assert_eq!(out.status.code(), Some(75), "all held: {}", show(&out));
    for bg in [global, zero, one] {
        bg.kill_all();
    }
}

#[test]
fn after_a_lowered_limit_no_slot_is_taken_until_those_beyond_it_end() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["slots", "set", "pull", "3"]);
    let one = hold_slot_file(&env, "pull", "1.lock");
    let two = hold_slot_file(&env, "pull", "2.lock");
    env.ok(["slots", "set", "pull", "1"]);
    assert!(record_of(&env, "pull", "0.lock").contains("files=3\n"));
    // Slot 0 is free, but two holders beyond the new limit count against
    // it: no slot, and without the global lock.
    let global = hold_global(&env);
    let read = [
        "exec", "--slot", "pull", "--read", "base", "--wait", "0.3", "--", "true",
    ];
    let out = env.run(read);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    global.kill_all();
    let out = env.run([
        "exec",
        "--slot",
        "pull",
        "--read",
        "base",
        "--no-wait",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    // They end; the next acquirer gets its slot and settles the record
    // (its files are the limit's again).
    one.kill_all();
    two.kill_all();
    env.ok([
        "exec",
        "--slot",
        "pull",
        "--read",
        "base",
        "--no-wait",
        "--",
        "true",
    ]);
    assert!(record_of(&env, "pull", "0.lock").contains("files=1\n"));
    let global = hold_global(&env);
    let out = env.run(read);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    global.kill_all();
}

#[test]
fn a_removed_class_takes_the_records_of_its_held_slots_away() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let zero = hold_slot_file(&env, "pull", "0.lock");
    env.ok(["slots", "rm", "pull"]);
    assert_eq!(
        record_of(&env, "pull", "0.lock"),
        "",
        "no record left to take a slot on"
    );
    let out = env.run(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    zero.kill_all();
}

// --- a class changed or removed at the worst moment -----------------------------

/// The limit `slots --json` shows for `class`.
fn limit_of(env: &Env, class: &str) -> u64 {
    let out = env.ok(["slots", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == class)
        .map(|c| c["limit"].as_u64().unwrap())
        .unwrap()
}

/// Exactly `limit` holders of `pull` at once: that many get in, one more
/// is refused.
fn assert_limit_binds(env: &Env, limit: u64) {
    let holders: Vec<Bg> = (0..limit)
        .map(|i| env.hold_until(&["--slot", "pull"], &format!("h{i}"), "release"))
        .collect();
    let out = env.run(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert_eq!(
        code(&out),
        Some(75),
        "one more holder beside the {limit} the shown limit allows: {}",
        show(&out)
    );
    env.release("release");
    for h in holders {
        let out = h.finish();
        assert_eq!(code(&out), Some(0), "{}", show(&out));
    }
    // The sentinels go, for the next round.
    for i in 0..limit {
        fs::remove_file(env.sentinel(&format!("h{i}"))).unwrap();
    }
    fs::remove_file(env.sentinel("release")).unwrap();
}

/// `slots set pull 1` (from 4) SIGKILLed by strace's fault injection at
/// each write of the class record: before the new limit is written, and
/// between it and the record of the files beyond it. Whatever limit the
/// class shows afterwards is the one every acquirer goes by.
#[test]
fn a_slots_set_killed_midway_leaves_one_limit_that_binds() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    for (when, shown) in [(1, 4), (2, 1)] {
        let env = Env::new();
        env.ok(["slots", "set", "pull", "4"]);
        let mut c = std::process::Command::new("strace");
        c.args(["-f", "-qq", "-o", "/dev/null", "-e", "trace=pwrite64"])
            .arg("-e")
            .arg(format!("inject=pwrite64:signal=SIGKILL:when={when}"))
            .arg(bin())
            .arg("--root")
            .arg(&env.root)
            .args(["slots", "set", "pull", "1"]);
        let out = output(c);
        assert!(
            !out.status.success(),
            "slots set was not killed: {}",
            show(&out)
        );
        assert_eq!(limit_of(&env, "pull"), shown, "killed at write {when}");
        assert_limit_binds(&env, shown);
        env.ok(["slots", "set", "pull", "1"]);
        assert_limit_binds(&env, 1);
    }
}

/// An acquirer that read the class (limit 2) and, before it tries the
/// slot files, sees the limit lowered to 1 and a slot beyond it come free:
/// it must not run in that slot, beside the holder of the one slot the
/// limit allows. gdb stops it between the two (at `Slots::new`), as a slow
/// machine or a waiter on another host can be.
#[test]
fn a_slot_taken_on_a_class_read_before_a_lowered_limit_is_let_go() {
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let h0 = env.hold_until(&["--slot", "pull"], "h0", "r0");
    let h1 = env.hold_until(&["--slot", "pull"], "h1", "r1");
    let one = env.root.join("locks/slots/pull/1.lock");
    let at = env.sentinel("at-slots-new");
    let ran = env.sentinel("ran");
    let cmds = env.sentinel("gdb-cmds");
    fs::write(
        &cmds,
        format!(
            "set pagination off\n\
             break stowage::acquire::slot::Slots::new\n\
             run\n\
             delete\n\
             shell touch '{at}'; touch '{r1}'; i=0; while ! flock -n -x '{one}' true && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; \
             '{bin}' --root '{root}' slots set pull 1\n\
             continue\n",
            at = at.display(),
            r1 = env.sentinel("r1").display(),
            one = one.display(),
            bin = bin(),
            root = env.root.display(),
        ),
    )
    .unwrap();
    let mut c = stowage_under_gdb(&env, &cmds, ["exec", "--slot", "pull", "--"]);
    c.args(env.hold_cmd("ran", "r2"));
    let gdb = Bg::from_command(c);
    wait_for_file(&at);
    let out = h1.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    // Either it runs (in the slot beyond the new limit) or it waits.
    wait_until("the acquirer runs or waits", || {
        ran.exists()
            || env
                .slot_entry("pull")
                .is_some_and(|e| !e["waiters"].as_array().unwrap().is_empty())
    });
    assert!(
        !ran.exists(),
        "a second holder runs beside the one limit 1 allows"
    );
    env.release("r0");
    let out = h0.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    wait_for_file(&ran);
    env.release("r2");
    let out = gdb.finish();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("exited normally"),
        "{}",
        show(&out)
    );
}

/// `slots set pull 1` (from 2) stopped while it settles the lowered
/// limit — the new limit written, the slot beyond it found free and held,
/// the record that forgets it not yet written: an acquirer that comes then,
/// while `0.lock` is held, gets no slot (the one beyond the limit is not
/// for it), and the change then ends well.
#[test]
fn a_slot_is_not_taken_while_a_lowered_limit_is_settled() {
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let h0 = env.hold_until(&["--slot", "pull"], "h0", "r0");
    // A second holder makes `1.lock`, then goes.
    let h1 = env.hold_until(&["--slot", "pull"], "h1", "r1");
    env.release("r1");
    assert_eq!(code(&h1.finish()), Some(0));
    let one = env.root.join("locks/slots/pull/1.lock");
    assert!(one.exists());
    let at = env.sentinel("settling");
    let go = env.sentinel("go");
    let cmds = env.sentinel("gdb-cmds");
    fs::write(
        &cmds,
        format!(
            "set pagination off\n\
             break stowage::slot_limits::write\n\
             ignore 1 1\n\
             run\n\
             delete\n\
             shell touch '{at}'; i=0; while [ ! -e '{go}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n\
             continue\n",
            at = at.display(),
            go = go.display(),
        ),
    )
    .unwrap();
    let set = Bg::from_command(stowage_under_gdb(
        &env,
        &cmds,
        ["slots", "set", "pull", "1"],
    ));
    wait_for_file(&at);
    assert!(
        !flock_free(&one),
        "the change holds the slot beyond the new limit"
    );
    let ran = env.sentinel("ran");
    let out = env.run([
        "exec",
        "--slot",
        "pull",
        "--no-wait",
        "--",
        "touch",
        ran.to_str().unwrap(),
    ]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert!(
        !ran.exists(),
        "a second holder ran beside the one limit 1 allows"
    );
    fs::write(&go, "").unwrap();
    let out = set.finish();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("exited normally"),
        "{}",
        show(&out)
    );
    assert_eq!(limit_of(&env, "pull"), 1);
    let out = env.run(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    env.release("r0");
    assert_eq!(code(&h0.finish()), Some(0));
    env.ok(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
}

/// A waiter whose class directory was removed by hand (its class record
/// with it) does not look for its slot file forever: it ends, saying the
/// class was removed, without running its command.
#[test]
fn a_waiter_whose_class_directory_was_removed_ends_saying_so() {
    let env = Env::new();
    env.ok(["slots", "set", "c", "1"]);
    let holder = env.hold(&["--slot", "c"], "started");
    let ran = env.sentinel("ran");
    let waiter = env.spawn(["exec", "--slot", "c", "--", "touch", ran.to_str().unwrap()]);
    env.wait_for_slot_waiters("c", 1);
    fs::remove_dir_all(env.root.join("locks/slots/c")).unwrap();
    env.release("release");
    let out = holder.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = waiter.finish();
    assert_eq!(code(&out), Some(64), "{}", show(&out));
    assert!(stderr(&out).contains("'c' was removed"), "{}", show(&out));
    assert!(!ran.exists());
}

/// Changing a class's limit keeps its reserve for high priority unless one
/// is given: `slots set pull 1` after `--reserve-high 1` dropped the
/// reserve without a word.
#[test]
fn a_new_limit_keeps_the_reserve_unless_one_is_given() {
    let env = Env::new();
    let reserve = |env: &Env| env.slot_entry("pull").unwrap()["reserve_high"].clone();
    env.ok(["slots", "set", "pull", "4", "--reserve-high", "1"]);
    let out = env.ok(["slots", "set", "pull", "2"]);
    assert!(
        stderr(&out).contains("1 more for high priority"),
        "{}",
        show(&out)
    );
    assert_eq!(reserve(&env), 1);
    env.ok(["slots", "set", "pull", "2", "--reserve-high", "0"]);
    assert_eq!(reserve(&env), 0);
    env.ok(["slots", "set", "pull", "3", "--reserve-high", "2"]);
    // Unlimited: no reserve to keep.
    env.ok(["slots", "set", "pull", "0"]);
    assert_eq!(reserve(&env), 0);
}

/// Makes each slot of a class's limits in `bytes` what a later release
/// writes: format 2, its CRC whole (a format line damaged is no later one).
fn later_release_limits(bytes: &mut [u8]) {
    for area in bytes.chunks_mut(512) {
        let end = area.iter().position(|&b| b == 0).unwrap_or(area.len());
        let Ok(text) = String::from_utf8(area[..end].to_vec()) else {
            continue;
        };
        let Some(crc) = text.find("\ncrc=") else {
            continue;
        };
        let body = text[..crc + 1].replacen("class 1", "class 2", 1);
        let slot = format!("{body}crc={:08x}\n", token_crc(body.as_bytes()));
        area[..slot.len()].copy_from_slice(slot.as_bytes());
    }
}

/// A class whose limits have one byte damaged in the format line of the
/// slot not in use (its CRC no longer holds) is no later release's: the
/// slot in use is read, and the class used, listed, set and removed.
#[test]
fn limits_damaged_in_a_format_line_are_damage_not_a_later_release() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    env.ok(["slots", "set", "pull", "3"]);
    let zero = env.root.join("locks/slots/pull/0.lock");
    let mut bytes = fs::read(&zero).unwrap();
    // The first slot holds the older seq: the second is the one in use.
    assert!(bytes.starts_with(b"stowage-class 1\nseq=1\n"), "{bytes:?}");
    bytes[14] = b'7';
    fs::write(&zero, &bytes).unwrap();
    for args in [
        &["slots"][..],
        &["lock-status"],
        &["exec", "--slot", "pull", "--", "true"],
        &["slots", "set", "pull", "4"],
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
        assert!(!stderr(&out).contains("newer"), "{args:?}: {}", show(&out));
    }
    assert!(stdout(&env.run(["slots"])).contains('4'));
    env.ok(["slots", "rm", "pull"]);
}

/// A class whose limits a later release wrote (`stowage-class 2`) is that
/// release's: every use of it is refused as a newer store's, and `slots
/// set` never writes it back in this release's format.
#[test]
fn limits_of_a_newer_format_are_refused_never_rewritten() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let zero = env.root.join("locks/slots/pull/0.lock");
    let mut bytes = fs::read(&zero).unwrap();
    later_release_limits(&mut bytes);
    fs::write(&zero, &bytes).unwrap();
    for args in [
        &["slots"][..],
        &["slots", "set", "pull", "3"],
        &["slots", "rm", "pull"],
        &["exec", "--slot", "pull", "--", "true"],
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains("made by a newer stowage") && err.contains("format 2"),
            "{args:?}: {}",
            show(&out)
        );
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: {}",
            show(&out)
        );
    }
    assert_eq!(fs::read(&zero).unwrap(), bytes);
    let out = env.run(["doctor", "--repair"]);
    assert!(stdout(&out).contains("upgrade stowage"), "{}", show(&out));
    assert_eq!(fs::read(&zero).unwrap(), bytes);
}

/// `lock-status` refuses a slot class whose limits a later release wrote, as
/// `slots` does: free it would leave the class out, held call it removed,
/// both untrue (and exit 0).
#[test]
fn lock_status_refuses_limits_of_a_newer_format_free_or_held() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "1"]);
    let zero = env.root.join("locks/slots/pull/0.lock");
    let mut bytes = fs::read(&zero).unwrap();
    later_release_limits(&mut bytes);
    fs::write(&zero, &bytes).unwrap();
    let refused = |when: &str| {
        for args in [&["lock-status"][..], &["lock-status", "--json"]] {
            let out = env.run(args);
            assert_eq!(code(&out), Some(1), "{when} {args:?}: {}", show(&out));
            let err = stderr(&out);
            assert!(
                err.contains("made by a newer stowage")
                    && err.contains("the limits of slot class 'pull', format 2"),
                "{when} {args:?}: {}",
                show(&out)
            );
            assert!(!stdout(&out).contains("removed"), "{}", show(&out));
        }
    };
    refused("free");
    let started = env.sentinel("held");
    let holder = flock_holder(&zero, &started, "sleep 60");
    refused("held");
    holder.kill_all();
    assert_eq!(fs::read(&zero).unwrap(), bytes);
}

/// A command of a killed exec that closed its slot's descriptors, keeping the lease it inherited,
/// holds no slot: a call it nests in that class waits for the process that took the freed slot
/// (a lease held proved none of the locks it lists, and the call ran over the limit).
#[test]
fn a_lease_kept_without_its_slot_lets_no_nested_call_over_the_limit() {
    let env = Env::new();
    env.ok(["slots", "set", "c", "1"]);
    let (other, result) = (env.sentinel("other"), env.sentinel("result"));
    let script = format!(
        r#"kill -9 $PPID; sleep 0.2
for f in /proc/$$/fd/*; do case $(readlink "$f") in *slots/*) eval "exec ${{f##*/}}>&-";; esac; done
'{bin}' exec --slot c -- sh -c "touch '{other}'; sleep 5" &
i=0; while [ ! -e '{other}' ] && [ $i -lt 500 ]; do sleep 0.02; i=$((i+1)); done
'{bin}' exec --slot c --wait 0.5 -- true; echo $? > '{result}'; wait"#,
        bin = bin(),
        other = other.display(),
        result = result.display()
    );
    let outer = env.spawn(["exec", "--slot", "c", "--", "bash", "-c", &script]);
    wait_until("the nested call ends", || {
        fs::read_to_string(&result).is_ok_and(|t| t.ends_with('\n'))
    });
    assert_eq!(fs::read_to_string(&result).unwrap().trim(), "75");
    outer.kill_all();
}

/// A nested `exec --slot` whose enclosing command holds an image refuses
/// (75) at once when the class is full instead of waiting: the slot's
/// holder may be waiting for that image (slots come before images), and the
/// two would wait for each other for ever.
#[test]
fn a_nested_slot_wait_under_an_enclosing_image_is_refused() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "1"]);
    let holder = env.hold_until(&["--slot", "pull"], "slot-held", "slot-go");
    let (rc, err) = (env.sentinel("inner-rc"), env.sentinel("inner-err"));
    let script = format!(
        "'{bin}' --root '{root}' exec --slot pull -- true 2>'{err}'; echo $? > '{rc}'",
        bin = bin(),
        root = env.root.display(),
        err = err.display(),
        rc = rc.display(),
    );
    let outer = env.spawn(["exec", "--write", "app", "--", "sh", "-c", &script]);
    wait_until("the inner exec ends or waits for the slot", || {
        rc.exists()
            || env
                .slot_entry("pull")
                .is_some_and(|e| !e["waiters"].as_array().unwrap().is_empty())
    });
    assert!(rc.exists(), "the inner exec waits for the slot");
    let said = fs::read_to_string(&err).unwrap();
    assert_eq!(fs::read_to_string(&rc).unwrap().trim(), "75", "{said}");
    assert!(
        said.contains("enclosing command holds image 'app'"),
        "{said}"
    );
    let out = outer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    env.release("slot-go");
    let out = holder.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// flock(1)'s man page idiom `( flock -n 9 …) 9>FILE` on a class's
/// `0.lock` empties the class's limits, even when the lock is not had. The
/// class is then not taken for removed: a queued waiter keeps the limits it
/// read and runs once the slot is free, a new command is refused naming the
/// likely cause, `doctor` reports it, nothing tidies the class away, and
/// `slots set` sets it again.
#[test]
fn a_slot_class_emptied_by_a_shell_redirection_is_said_not_removed() {
    if !have("flock") {
        eprintln!("skipping: flock(1) not found");
        return;
    }
    let env = Env::new();
    env.ok(["slots", "set", "pull", "1"]);
    let holder = env.hold_until(&["--slot", "pull"], "slot-held", "slot-go");
    let ran = env.sentinel("waiter-ran");
    let ran_arg = ran.display().to_string();
    let waiter = env.spawn(["exec", "--slot", "pull", "--", "touch", &ran_arg]);
    env.wait_for_slot_waiters("pull", 1);
    let zero = env.root.join("locks/slots/pull/0.lock");
    let mut c = std::process::Command::new("sh");
    c.arg("-c")
        .arg(format!("( flock -n 9 || true ) 9>'{}'", zero.display()));
    assert_eq!(code(&output(c)), Some(0));
    assert_eq!(fs::metadata(&zero).unwrap().len(), 0, "emptied");
    let out = env.run(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(stderr(&out).contains("were emptied"), "{}", show(&out));
    let out = env.run(["doctor"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(stdout(&out).contains("were emptied"), "{}", show(&out));
    env.release("slot-go");
    assert_eq!(code(&holder.finish()), Some(0));
    let out = waiter.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(ran.exists());
    // Nothing holds or awaits it now: still not tidied away as removed.
    env.ok(["lock-status"]);
    assert!(zero.exists(), "the class's files stay for 'slots set'");
    env.ok(["slots", "set", "pull", "1"]);
    env.ok(["exec", "--slot", "pull", "--", "true"]);
}
