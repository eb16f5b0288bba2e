//! Writer preference: a waiting writer blocks new readers, so a stream of
//! overlapping readers cannot keep it out — and readers are not starved by
//! writers either.

use std::fs;
use std::time::Instant;

use crate::common::*;

/// A reader loop: `exec --read base -- sleep HOLD` again and again until
/// the `done` sentinel exists (bounded).
fn reader_loop(env: &Env, hold: &str, tag: usize) -> Bg {
    let script = format!(
        "i=0; while [ ! -e '{done}' ] && [ $i -lt 40 ]; do \
         '{bin}' --root '{root}' -q exec --read base -- sh -c 'touch \"$0\"; sleep {hold}' '{started}' || exit 1; \
         i=$((i+1)); done; [ -e '{done}' ] || exit 9",
        done = env.sentinel("done").display(),
        bin = bin(),
        root = env.root.display(),
        started = env.sentinel(&format!("reading.{tag}")).display(),
    );
    let mut c = std::process::Command::new("sh");
    c.args(["-c", &script]);
    Bg::from_command(c)
}

#[test]
fn a_writer_gets_in_despite_a_stream_of_readers() {
    let env = Env::new();
    env.make_image("base");
    // Four reader loops, each holding the image for 1 s, staggered so that
    // the image is never free.
    let mut loops = Vec::new();
    for tag in 0..4 {
        loops.push(reader_loop(&env, "1", tag));
        wait_for_file(&env.sentinel(&format!("reading.{tag}")));
        std::thread::sleep(std::time::Duration::from_millis(250)); // the stagger
    }
    // The writer stops the loops when it gets in; without writer preference
    // it never would while they run, and the loops would end by their bound.
    let t0 = Instant::now();
    let writer = env.spawn([
        "exec",
        "--write",
        "base",
        "--",
        "sh",
        "-c",
        &format!(
            "echo new > \"$STOWAGE_IMAGE_DIR/file\"; touch '{}'",
            env.sentinel("done").display()
        ),
    ]);
    let out = writer.finish();
    let waited = t0.elapsed();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    eprintln!("the writer got in after {waited:?} behind 1 s readers");
    for l in loops {
        let out = l.finish();
        // 9: the loop ran out before the awaited process got in — starvation.
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    }
    assert_eq!(
        fs::read_to_string(env.root.join("img/base/file")).unwrap(),
        "new\n"
    );
}

#[test]
fn a_waiting_writer_shows_in_lock_status_and_holds_back_new_readers() {
    let env = Env::new();
    env.make_image("base");
    let reader = env.hold(&["--read", "base"], "started");
    let writer = env.spawn(["exec", "--write", "base", "--", "true"]);
    wait_until("the writer is recorded as waiting", || {
        env.lock_entry("base").is_some_and(|e| {
            e["waiters"]
                .as_array()
                .unwrap()
                .iter()
                .any(|w| w["mode"] == "exclusive")
        })
    });
    // It records itself, then takes the gate: wait for that too.
    let gate = env.root.join("locks/images/base.gate");
    wait_until("the writer holds the gate", || {
        gate.exists()
            && !std::process::Command::new("flock")
                .args(["-n", "-s"])
                .arg(&gate)
                .arg("true")
                .status()
                .unwrap()
                .success()
    });
    // A new reader may not overtake the waiting writer...
    let out = env.run(["exec", "--read", "base", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(
        stderr(&out).contains("write"),
        "says a writer is waiting: {}",
        stderr(&out)
    );
    // ...but flock(1) on the image lock itself still sees only a reader.
    env.release("release");
    assert_eq!(reader.finish().status.code(), Some(0));
    assert_eq!(writer.finish().status.code(), Some(0));
    env.ok(["exec", "--read", "base", "--no-wait", "--", "true"]);
}

#[test]
fn readers_get_in_between_a_stream_of_writers() {
    let env = Env::new();
    env.make_image("base");
    // Two writer loops keep the image busy; a reader must still get in.
    let script = |tag: usize| {
        format!(
            "i=0; while [ ! -e '{done}' ] && [ $i -lt 100 ]; do \
             '{bin}' --root '{root}' -q exec --write base -- sh -c 'touch \"$0\"; sleep 0.3' '{started}' || exit 1; \
             i=$((i+1)); done; [ -e '{done}' ] || exit 9",
            done = env.sentinel("done").display(),
            bin = bin(),
            root = env.root.display(),
            started = env.sentinel(&format!("writing.{tag}")).display(),
        )
    };
    let loops: Vec<Bg> = (0..2)
        .map(|tag| {
            let mut c = std::process::Command::new("sh");
            c.args(["-c", &script(tag)]);
            let bg = Bg::from_command(c);
            wait_for_file(&env.sentinel(&format!("writing.{tag}")));
            bg
        })
        .collect();
    let reader = env.spawn([
        "exec",
        "--read",
        "base",
        "--",
        "touch",
        env.sentinel("done").to_str().unwrap(),
    ]);
    assert_eq!(reader.finish().status.code(), Some(0));
    for l in loops {
        let out = l.finish();
        // 9: the loop ran out before the awaited process got in — starvation.
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    }
}
