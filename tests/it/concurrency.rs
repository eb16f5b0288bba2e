//! Mutual exclusion, real read concurrency and deadlock freedom, proven
//! with many real processes.

use std::fs;
use std::process::Command;

use crate::common::*;

/// A critical section that detects overlap by itself: `mkdir` is atomic, so
/// a second process inside at the same time fails to create the directory
/// and records a violation.
fn critical_section(dir: &std::path::Path) -> String {
    format!(
        "if mkdir '{d}/cs' 2>/dev/null; then sleep 0.002; rmdir '{d}/cs'; echo ok >> '{d}/entries'; \
         else echo overlap >> '{d}/violations'; fi",
        d = dir.display()
    )
}

#[test]
fn writers_never_overlap() {
    const PROCS: usize = 16;
    const ROUNDS: usize = 25;
    let env = Env::new();
    let script = critical_section(&env.scratch);
    let workers: Vec<_> = (0..PROCS)
        .map(|_| {
            let loop_script = format!(
                "for i in $(seq {ROUNDS}); do '{bin}' --root '{root}' -q exec --write app -- sh -c \"$0\" || exit 1; done",
                bin = bin(),
                root = env.root.display()
            );
            let mut c = Command::new("sh");
            c.args(["-c", &loop_script, &script]);
            c
        })
        .map(Bg::from_command)
        .collect();
    for w in workers {
        let out = w.finish();
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    }
    assert_eq!(
        lines(&env.scratch.join("violations")),
        0,
        "two writers were inside at once"
    );
    assert_eq!(lines(&env.scratch.join("entries")), PROCS * ROUNDS);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// The overlap detector above can fail: without stowage, the same load
/// overlaps. (Otherwise the test above would prove nothing.)
#[test]
fn the_overlap_detector_detects_overlap() {
    let env = Env::new();
    let script = critical_section(&env.scratch).replace("sleep 0.002", "sleep 0.05");
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let mut c = Command::new("sh");
            c.args(["-c", "for i in $(seq 5); do sh -c \"$0\"; done", &script]);
            Bg::from_command(c)
        })
        .collect();
    for w in workers {
        w.finish();
    }
    assert!(
        lines(&env.scratch.join("violations")) > 0,
        "the detector never fired without locks"
    );
}

#[test]
fn readers_really_run_at_the_same_time() {
    const READERS: usize = 4;
    let env = Env::new();
    env.make_image("base");
    // Each reader announces itself, then waits (bounded) until all readers
    // are inside: that only completes if they hold the lock together.
    let readers: Vec<_> = (0..READERS)
        .map(|i| {
            let script = format!(
                "touch '{d}/in.{i}'; n=0; while [ $(ls '{d}' | grep -c '^in\\.') -lt {READERS} ]; do \
                 sleep 0.01; n=$((n+1)); [ $n -gt 3000 ] && exit 1; done; exit 0",
                d = env.scratch.display()
            );
            env.spawn(["exec", "--read", "base", "--no-wait", "--", "sh", "-c", &script])
        })
        .collect();
    for r in readers {
        let out = r.finish();
        assert_eq!(
            out.status.code(),
            Some(0),
            "reader did not see all others inside: {}",
            show(&out)
        );
    }
}

#[test]
fn random_multi_image_requests_all_finish() {
    const PROCS: usize = 6;
    const ROUNDS: usize = 12;
    const IMAGES: [&str; 5] = ["a", "b:1", "c/d", "e", "f.g"];
    let env = Env::new();
    for img in IMAGES {
        env.make_image(img);
    }
    let seed = fastrand::u64(..);
    eprintln!("seed {seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let d = env.scratch.display().to_string();
    let workers: Vec<_> = (0..PROCS)
        .map(|_| {
            // Each round: a random set of images, random modes, listed in a
            // random order. The command checks exclusion per image: a writer
            // marks its images, a reader checks no writer mark is present.
            let mut script = String::new();
            for _ in 0..ROUNDS {
                let mut picked: Vec<(&str, bool)> = Vec::new();
                for img in IMAGES {
                    if rng.bool() {
                        picked.push((img, rng.u8(..).is_multiple_of(3)));
                    }
                }
                if picked.is_empty() {
                    picked.push((IMAGES[rng.usize(..IMAGES.len())], true));
                }
                rng.shuffle(&mut picked);
                let mut args = String::new();
                let mut body = String::new();
                for (img, write) in &picked {
                    let tag = img.replace(['/', ':'], "_");
                    if *write {
                        args.push_str(&format!(" --write '{img}'"));
                        body.push_str(&format!(
                            "mkdir '{d}/w.{tag}' || echo 'overlap {img}' >> '{d}/violations'; "
                        ));
                    } else {
                        args.push_str(&format!(" --read '{img}'"));
                        body.push_str(&format!(
                            "[ -e '{d}/w.{tag}' ] && echo 'read during write {img}' >> '{d}/violations'; "
                        ));
                    }
                }
                body.push_str(&format!("sleep 0.0{}; ", rng.u8(0..3)));
                for (img, write) in &picked {
                    if *write {
                        body.push_str(&format!("rmdir '{d}/w.{}'; ", img.replace(['/', ':'], "_")));
                    }
                }
                body.push_str(&format!("echo done >> '{d}/done'"));
                script.push_str(&format!(
                    "'{bin}' --root '{root}' -q exec{args} -- sh -c \"{body}\" || exit 1\n",
                    bin = bin(),
                    root = env.root.display()
                ));
            }
            let mut c = Command::new("sh");
            c.args(["-c", &script]);
            Bg::from_command(c)
        })
        .collect();
    for w in workers {
        let out = w.finish();
        assert_eq!(out.status.code(), Some(0), "seed {seed}: {}", show(&out));
    }
    let violations = fs::read_to_string(env.scratch.join("violations")).unwrap_or_default();
    assert!(violations.is_empty(), "seed {seed}: {violations}");
    assert_eq!(
        lines(&env.scratch.join("done")),
        PROCS * ROUNDS,
        "seed {seed}"
    );
    for img in IMAGES {
        assert_eq!(env.state(img).as_deref(), Some("ready"), "{img}");
    }
}
