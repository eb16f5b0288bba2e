//! `lock-status --why IMG|PID`: the chain of waits from a waiter to the
//! process at its end, through locks held, nested calls and flock(1)
//! users; a cycle named, and the process to end to break it. Every chain
//! here is made of real processes of the real binary with bounded waits.

use std::fs;

use serde_json::Value;

use crate::common::*;

fn why(env: &Env, target: &str) -> Value {
    let out = env.ok(["lock-status", "--why", target, "--json"]);
    serde_json::from_slice(&out.stdout).unwrap()
}

fn pids(chain: &Value) -> Vec<u64> {
    chain["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["pid"].as_u64().unwrap_or(0))
        .collect()
}

#[test]
fn why_follows_a_chain_of_three_to_the_process_at_its_end() {
    let env = Env::new();
    let end = env.hold(&["--write", "c"], "started");
    let middle = env.spawn([
        "exec", "--write", "b", "--write", "c", "--wait", "60", "--", "true",
    ]);
    env.wait_for_waiter("c");
    let first = env.spawn(["exec", "--write", "b", "--wait", "60", "--", "true"]);
    env.wait_for_waiter("b");

    let doc = why(&env, "b");
    let chains = doc["chains"].as_array().unwrap();
    assert_eq!(chains.len(), 1, "{doc:#}");
    let chain = &chains[0];
    assert_eq!(
        pids(chain),
        [first.pid(), middle.pid(), end.pid()].map(u64::from),
        "{doc:#}"
    );
    let steps = chain["steps"].as_array().unwrap();
    assert_eq!(steps[0]["relation"], "waiter");
    assert_eq!(steps[0]["waits_for"]["name"], "b");
    assert_eq!(steps[1]["relation"], "holder");
    assert_eq!(steps[1]["waits_for"]["name"], "c");
    assert_eq!(steps[2]["waits_for"], Value::Null);
    assert_eq!(chain["cycle"], false);
    assert_eq!(chain["end_pid"], u64::from(end.pid()));
    // The same chain from the waiter's pid, and in words.
    assert_eq!(
        pids(&why(&env, &first.pid().to_string())["chains"][0]),
        pids(chain)
    );
    let out = env.ok(["lock-status", "--why", "b"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("waits for write lock on image 'c'"), "{text}");
    assert!(text.contains(&format!("kill {}", end.pid())), "{text}");

    env.release("release");
    assert_eq!(end.finish().status.code(), Some(0));
    assert_eq!(middle.finish().status.code(), Some(0));
    assert_eq!(first.finish().status.code(), Some(0));
}

/// Two builds, each holding its image and calling stowage again for the
/// other's: a deadlock through nested calls. `--why` names the cycle and
/// a process to end; ending it lets the other build finish.
#[test]
fn why_names_a_cycle_through_nested_calls_and_ending_the_named_process_breaks_it() {
    let env = Env::new();
    let (one, two) = nested_deadlock(&env);

    let doc = why(&env, "a");
    let chain = &doc["chains"][0];
    assert_eq!(chain["cycle"], true, "{doc:#}");
    let steps = chain["steps"].as_array().unwrap();
    let relations: Vec<&str> = steps
        .iter()
        .map(|s| s["relation"].as_str().unwrap())
        .collect();
    assert_eq!(
        relations,
        ["waiter", "holder", "inside", "holder"],
        "{doc:#}"
    );
    assert_eq!(steps[1]["pid"], u64::from(one.pid()), "a's holder: {doc:#}");
    assert_eq!(steps[3]["pid"], u64::from(two.pid()), "b's holder: {doc:#}");
    let end = chain["end_pid"].as_u64().unwrap() as u32;
    assert!(pids(chain).contains(&u64::from(end)), "{doc:#}");
    let out = env.ok(["lock-status", "--why", "a"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("a cycle"), "{text}");
    assert!(text.contains(&format!("kill {end}")), "{text}");

    // The advice works: the process it names ended, the other goes on.
    unsafe { libc::kill(end as i32, libc::SIGTERM) };
    let codes = [one.finish().status.code(), two.finish().status.code()];
    assert!(codes.contains(&Some(0)), "one build finished: {codes:?}");
}

/// The same cycle through flock(1): a script holds a lock file of the
/// store and calls stowage, while a build holding that image runs flock on
/// the file. The kernel's lock table shows the flock users.
#[test]
fn why_follows_a_cycle_through_flock_users() {
    if !have("flock") {
        eprintln!("skipping: flock(1) not found");
        return;
    }
    let env = Env::new();
    env.ok(["init"]);
    let tool = env.root.join("locks/images/tool.lock");
    std::fs::write(&tool, "").unwrap();
    let (one, two) = (env.sentinel("one"), env.sentinel("two"));
    let mut c = std::process::Command::new("flock");
    c.arg("-x").arg(&tool).args([
        "sh",
        "-c",
        &format!(
            "touch '{}'; while [ ! -e '{}' ]; do sleep 0.01; done; exec '{}' --root '{}' exec --write a --wait 60 -- true",
            one.display(),
            two.display(),
            bin(),
            env.root.display()
        ),
    ]);
    let script = Bg::from_command(c);
    wait_for_file(&one);
    let build = env.spawn([
        "exec",
        "--write",
        "a",
        "--",
        "sh",
        "-c",
        &format!(
            "touch '{}'; exec flock -w 60 -x '{}' true",
            two.display(),
            tool.display()
        ),
    ]);
    wait_for_file(&two);
    env.wait_for_waiter("a");
    wait_until("the build's flock waits", || flock_waited_on(&tool));

    let doc = why(&env, "a");
    let chain = &doc["chains"][0];
    assert_eq!(chain["cycle"], true, "{doc:#}");
    let steps = chain["steps"].as_array().unwrap();
    assert_eq!(steps[1]["pid"], u64::from(build.pid()), "{doc:#}");
    assert!(
        steps.iter().any(|s| s["stowage"] == false
            && s["command"]
                .as_str()
                .is_some_and(|c| c.starts_with("flock -x"))),
        "the script's flock(1) is a step: {doc:#}"
    );
    let end = chain["end_pid"].as_u64().unwrap() as u32;
    unsafe { libc::kill(end as i32, libc::SIGTERM) };
    let codes = [script.finish().status.code(), build.finish().status.code()];
    assert!(codes.contains(&Some(0)), "one side finished: {codes:?}");
}

#[test]
fn why_of_an_image_nobody_waits_for_says_so() {
    let env = Env::new();
    env.make_image("quiet");
    let out = env.ok(["lock-status", "--why", "quiet"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("nobody waits for image 'quiet'"));
    let doc = why(&env, "quiet");
    assert_eq!(doc["chains"], Value::Array(vec![]));
    let out = env.run(["lock-status", "--why", "missing"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
}

/// A pid no process has is said to be none (66, as an image that does not exist), not a process
/// that "waits for no lock"; 0 and negative numbers are never a pid (64). A root that does not
/// exist is said first, whatever pid is asked (it was "no process has pid N").
#[test]
fn why_of_a_pid_no_process_has_says_there_is_none() {
    let env = Env::new();
    // Pids are below pid_max: this one no process can have.
    let max = std::fs::read_to_string("/proc/sys/kernel/pid_max").unwrap();
    let none = max.trim();
    let out = env.run(["lock-status", "--why", none]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    let missing = format!("root {} does not exist", env.root.display());
    assert!(stderr(&out).contains(&missing), "{}", show(&out));
    env.ok(["init"]);
    for args in [&["--why", none][..], &["--why", none, "--json"]] {
        let out = env.run([&["lock-status"][..], args].concat());
        assert_eq!(code(&out), Some(66), "{}", show(&out));
        let err = stderr(&out);
        assert!(err.contains(&format!("no process has pid {none}")), "{err}");
        assert!(out.stdout.is_empty(), "{}", show(&out));
    }
    for pid in ["0", "-1"] {
        let out = env.run(["lock-status", "--why", pid]);
        assert_eq!(code(&out), Some(64), "{}", show(&out));
        assert!(
            stderr(&out).contains(&format!("--why '{pid}': a number is a pid")),
            "{}",
            show(&out)
        );
    }
    // A process that exists and waits for nothing is still told so.
    let out = env.ok(["lock-status", "--why", &std::process::id().to_string()]);
    assert!(stdout(&out).contains("waits for no lock"), "{}", show(&out));
}

#[test]
fn why_of_a_reader_names_the_writer_queued_ahead_as_queued_not_as_a_holder() {
    let env = Env::new();
    env.make_image("app");
    let reader = env.hold(&["--read", "app"], "started");
    let writer = env.spawn(["exec", "--write", "app", "--wait", "60", "--", "true"]);
    env.wait_for_waiter("app");
    let late = env.spawn(["exec", "--read", "app", "--wait", "60", "--", "true"]);
    env.wait_for_waiters("app", 2);

    let doc = why(&env, &late.pid().to_string());
    let chain = &doc["chains"][0];
    assert_eq!(
        pids(chain),
        [late.pid(), writer.pid(), reader.pid()].map(u64::from),
        "{doc:#}"
    );
    let relations: Vec<&str> = chain["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["relation"].as_str().unwrap())
        .collect();
    assert_eq!(relations, ["waiter", "queued", "holder"], "{doc:#}");
    let out = env.ok(["lock-status", "--why", &late.pid().to_string()]);
    let text = String::from_utf8_lossy(&out.stdout);
    let queued = format!("behind pid {}", writer.pid());
    assert!(text.contains(&queued), "{text}");
    assert!(text.contains("a writer queued ahead of it"), "{text}");
    assert!(
        !text.contains(&format!("held by pid {}", writer.pid())),
        "{text}"
    );
    env.release("release");
    assert_eq!(code(&reader.finish()), Some(0));
    assert_eq!(code(&writer.finish()), Some(0));
    assert_eq!(code(&late.finish()), Some(0));
}

/// A writer stopped (`^Z`, SIGSTOP) while it waits, once the lock it waits
/// for is free, keeps the gate and so every new reader out: lock-status
/// lists it (the lock free, its waiters shown, it marked stopped), `--why` ends the readers'
/// chain at it and says to continue it, and a reader that gives up names
/// it. Before, each said nobody waits, and the reader "a writer".
#[test]
fn a_writer_stopped_while_waiting_for_a_free_lock_is_named_as_what_keeps_readers_out() {
    let env = Env::new();
    env.make_image("app");
    let holder = env.hold(&["--write", "app"], "started");
    let writer = env.spawn(["exec", "--write", "app", "--", "true"]);
    env.wait_for_waiter("app");
    writer.signal(libc::SIGSTOP);
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
    let stopped = format!("pid {}", writer.pid());

    let out = env.run(["exec", "--read", "app", "--wait", "0.5", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    let said = stderr(&out);
    assert!(
        said.contains(&format!("a writer waits ahead of new readers: {stopped}")),
        "{said}"
    );
    assert!(said.contains(", stopped"), "{said}");
    let entry = env.lock_entry("app").unwrap();
    assert_eq!(entry["state"], "free", "{entry}");
    let waiters = entry["waiters"].as_array().unwrap();
    assert!(waiters.iter().any(|w| w["pid"] == writer.pid()), "{entry}");
    let table = stdout(&env.ok(["lock-status", "app"]));
    let row = table.lines().find(|l| l.contains(&format!("{stopped} ")));
    assert!(row.is_some_and(|l| l.contains("[stopped]")), "{table}");
    let out = env.ok(["lock-status", "--why", "app"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let advice = format!("is stopped: continue it (kill -CONT {})", writer.pid());
    assert!(text.contains(&advice), "{text}");

    writer.signal(libc::SIGCONT);
    assert_eq!(code(&writer.finish()), Some(0));
}

/// An exclusive read is said as one wherever a holder or a waiter is
/// shown: lock-status's table and `--why`'s chain. Before, the table said
/// `(exclusive)` and `--why` had the waiter wait for a "write lock".
#[test]
fn an_exclusive_read_is_never_said_to_be_a_write() {
    let env = Env::new();
    env.make_image("app");
    let holder = env.hold(&["--read-exclusive", "app"], "started");
    let waiter = env.spawn(["exec", "--read-exclusive", "app", "--", "true"]);
    env.wait_for_waiter("app");
    let table = stdout(&env.ok(["lock-status", "app"]));
    let said = |pid: u32| {
        (table.lines())
            .any(|l| l.contains(&format!("pid {pid} ")) && l.contains("(exclusive read)"))
    };
    assert!(said(holder.pid()) && said(waiter.pid()), "{table}");
    let text = stdout(&env.ok(["lock-status", "--why", &waiter.pid().to_string()]));
    assert!(
        text.contains("waits for exclusive read lock on image 'app'"),
        "{text}"
    );
    assert!(!text.contains("write lock"), "{text}");
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
    assert_eq!(code(&waiter.finish()), Some(0));
}

/// A process stopped deeper under a holder (its command's child) is named
/// with what continues it; a signal to the holder would end the command
/// alone, the stopped child keeping the lock. Before, the advice was
/// "waits for nothing stowage can see … kill PID", which freed nothing.
#[test]
fn why_names_a_stopped_process_deeper_under_a_holder() {
    let env = Env::new();
    env.make_image("app");
    let kid_file = env.sentinel("kid");
    let script = format!(
        "sleep 60 & echo $! > '{k}'; touch '{k}.started'; wait",
        k = kid_file.display()
    );
    let holder = env.spawn(["exec", "--write", "app", "--", "sh", "-c", &script]);
    wait_for_file(&env.sentinel("kid.started"));
    let kid: u32 = fs::read_to_string(&kid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    unsafe { libc::kill(kid as i32, libc::SIGSTOP) };
    wait_until("the child is stopped", || proc_state(kid) == Some('T'));
    let reader = env.spawn(["exec", "--read", "app", "--", "true"]);
    env.wait_for_waiter("app");
    let text = stdout(&env.ok(["lock-status", "--why", &reader.pid().to_string()]));
    let advice =
        format!("waits for pid {kid} under it, which is stopped: continue it (kill -CONT {kid})");
    assert!(text.contains(&advice), "{text}");
    unsafe { libc::kill(kid as i32, libc::SIGKILL) };
    assert_eq!(code(&holder.finish()), Some(0));
    assert_eq!(code(&reader.finish()), Some(0));
}

/// `--why PID` of the command an exec runs (the build a user sees in
/// ps), whose nested call waits: the chain starts at that nested call.
#[test]
fn why_of_an_execs_command_follows_the_nested_call_it_waits_for() {
    let env = Env::new();
    env.make_image("y");
    let holder = env.hold(&["--write", "y"], "y-started");
    let pidfile = env.sentinel("command-pid");
    let outer = env.start_sh(&["--write", "x"], |started| {
        format!(
            "echo $$ > '{p}'; touch '{s}'; '{bin}' --root '{r}' exec --read y --wait 60 -- true",
            p = pidfile.display(),
            s = started.display(),
            bin = bin(),
            r = env.root.display(),
        )
    });
    env.wait_for_waiter("y");
    let command: u32 = fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let doc = why(&env, &command.to_string());
    let chain = &doc["chains"][0];
    let steps = (chain["steps"].as_array()).unwrap_or_else(|| panic!("a chain: {doc:#}"));
    assert_eq!(steps[0]["waits_for"]["name"], "y", "{doc:#}");
    assert_eq!(chain["end_pid"], u64::from(holder.pid()), "{doc:#}");

    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert_eq!(outer.finish().status.code(), Some(0));
}

/// A waiter in a child pid namespace (a container) is listed by the pid
/// the lock table shows us; `--why` with that pid follows its chain.
#[test]
fn why_of_a_waiter_in_a_child_pid_namespace_follows_its_chain() {
    if !root_or_skip("a child pid namespace") || !tool_or_skip("unshare", "util-linux") {
        return;
    }
    let env = Env::new();
    env.make_image("y");
    let holder = env.hold(&["--write", "y"], "y-started");
    let mut c = std::process::Command::new("unshare");
    c.args(["--pid", "--fork", "--mount-proc", bin(), "--root"])
        .arg(&env.root)
        .args(["exec", "--read", "y", "--wait", "60", "--", "true"]);
    let contained = Bg::from_command(c);
    env.wait_for_waiter("y");
    let entry = env.lock_entry("y").unwrap();
    let waiter = &entry["waiters"][0];
    assert_eq!(waiter["pid_space"], "here", "{entry:#}");
    let pid = waiter["pid"].as_u64().unwrap();
    let doc = why(&env, &pid.to_string());
    let chain = &doc["chains"][0];
    assert_eq!(pids(chain).first(), Some(&pid), "{doc:#}");
    assert_eq!(chain["end_pid"], u64::from(holder.pid()), "{doc:#}");

    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert_eq!(contained.finish().status.code(), Some(0));
}

/// The cycle through nested calls (the build's shell replaced by them),
/// after one enclosing exec was SIGKILLed: its nested call holds that exec's image through the inherited
/// descriptor and still waits, so the deadlock stays. `--why` names the
/// cycle and that nested call by its pid, not a process "stowage cannot
/// identify" on the hosts sharing the store.
#[test]
fn why_names_a_cycle_kept_by_a_nested_call_whose_exec_was_killed() {
    let env = Env::new();
    let (mut one, two) = nested_deadlock(&env);
    let nested = env.lock_entry("b").unwrap()["waiters"][0]["pid"].clone();
    one.signal(libc::SIGKILL);
    let _ = one.child.as_mut().unwrap().wait();

    let doc = why(&env, "a");
    let chain = &doc["chains"][0];
    assert_eq!(chain["cycle"], true, "{doc:#}");
    let steps = chain["steps"].as_array().unwrap();
    assert_eq!(steps[1]["relation"], "holder", "{doc:#}");
    assert_eq!(steps[1]["pid"], nested, "a's holder, kept: {doc:#}");
    assert_eq!(steps[1]["kept"], true, "{doc:#}");
    let text = stdout(&env.ok(["lock-status", "--why", "a"]));
    assert!(text.contains("a cycle"), "{text}");
    one.kill_all();
    two.kill_all();
}

/// Two builds, of `a` and of `b`, each holding its image and calling stowage again for the
/// other's, both waiting by the time this returns: a deadlock through nested calls.
fn nested_deadlock(env: &Env) -> (Bg, Bg) {
    let script = |mine: &str, other: &str, theirs: &str| {
        format!(
            "touch '{m}'; while [ ! -e '{o}' ]; do sleep 0.01; done; exec '{bin}' exec --write {theirs} --wait 60 -- true",
            m = env.sentinel(mine).display(),
            o = env.sentinel(other).display(),
            bin = bin(),
        )
    };
    let build =
        |image: &str, s: String| env.spawn(["exec", "--write", image, "--", "sh", "-c", &s]);
    let one = build("a", script("one", "two", "b"));
    let two = build("b", script("two", "one", "a"));
    wait_for_file(&env.sentinel("one"));
    wait_for_file(&env.sentinel("two"));
    env.wait_for_waiter("a");
    env.wait_for_waiter("b");
    (one, two)
}
