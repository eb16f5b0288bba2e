//! The wrapper scripts under `scripts/`, called every way the docs call
//! them: the stowage root named with `--root` or `STOWAGE_ROOT` (and
//! mistyped), `CARGO_TARGET_DIR` unset, relative or absolute, times with
//! units, and signals — real processes, and bounded waits. The tests that
//! run ch-image skip, saying why, where it cannot run here (the
//! `charliecloud` module's [`Ch`]).

use std::fs;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::charliecloud::{CH_BUILD, CH_DELETE, Ch, assert_ok, assert_ok_ref, gated};
use crate::common::*;

const SCRIPTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts");
const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// How a wrapper is told which stowage root to use.
#[derive(Clone, Copy, Debug)]
enum Naming {
    Flag,
    Env,
}

/// `command` (ch-build or ch-delete, with `args`) naming `root` the `how`
/// way, and the other spelling absent.
fn naming(mut c: Command, how: Naming, root: &Path, args: &[&str]) -> Command {
    c.env_remove("STOWAGE_ROOT");
    match how {
        Naming::Flag => {
            c.arg("--root").arg(root);
        }
        Naming::Env => {
            c.env("STOWAGE_ROOT", root);
        }
    }
    c.args(args);
    c
}

/// The command a wrapper's refusal suggests: what follows its last ": ".
fn suggestion(out: &Output) -> String {
    let err = stderr(out);
    let line = err.lines().last().unwrap_or_default();
    line.rsplit_once(": ")
        .map(|(_, fix)| fix.trim().to_owned())
        .unwrap_or_default()
}

/// README's quick start leaves an image in the default root; docs'
/// setup then named that root for the storage directory. The refusal says
/// which command gives the storage directory a root of its own, that
/// command works as typed, and builds then work with that root named
/// either way.
#[test]
fn a_new_user_following_the_docs_is_led_to_a_root_that_works() {
    let Some(ch) = Ch::unadopted() else { return };
    ch.env.ok([
        "exec",
        "--write",
        "hello",
        "--",
        "sh",
        "-c",
        "echo hello > \"$STOWAGE_IMAGE_DIR/greeting\"",
    ]);
    ch.dockerfile("Dockerfile", "FROM base\nRUN echo app > /which\n");
    let out = output(ch.ch_build(["-t", "app"]));
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    let fix = suggestion(&out);
    assert!(fix.starts_with("stowage --root "), "{}", show(&out));
    let mut run = ch.command("sh");
    run.args(["-c", &fix]);
    assert_ok(output(run));

    let own = PathBuf::from(format!("{}.stowage", ch.storage.display()));
    for (i, how) in [Naming::Flag, Naming::Env].into_iter().enumerate() {
        let tag = format!("app{i}");
        let mut c = naming(ch.command(CH_BUILD), how, &own, &["-t", &tag]);
        c.arg(&ch.ctx);
        assert_ok(output(c));
        assert_eq!(ch.file(&tag, "which"), "app", "{how:?}");
    }
}

/// A mistyped root, given either way, is refused by ch-build and
/// ch-delete alike and never created; the suggested command, typed as is,
/// names the root that keeps the storage directory's images.
#[test]
fn a_mistyped_root_is_refused_and_never_created() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    ch.dockerfile("Dockerfile", "FROM base\nRUN true\n");
    assert_ok(output(ch.ch_build(["-t", "app"])));
    let typo = ch.env.tmp.path().join("rooot");
    for how in [Naming::Flag, Naming::Env] {
        let mut c = naming(ch.command(CH_BUILD), how, &typo, &["-t", "next"]);
        c.arg(&ch.ctx);
        let out = output(c);
        assert_eq!(out.status.code(), Some(64), "{how:?}: {}", show(&out));
        assert!(stderr(&out).contains("does not exist"), "{}", show(&out));
        assert!(
            !typo.exists(),
            "{how:?}: ch-build created the mistyped root"
        );
        assert!(!ch.img("next").exists());
        let fix = suggestion(&out);
        assert_eq!(
            fix,
            format!(
                "stowage --root {} init --images-dir {}/img",
                typo.display(),
                ch.storage.display()
            ),
            "{}",
            show(&out)
        );
        let mut run = ch.command("sh");
        run.args(["-c", &fix]);
        let out = output(run);
        assert!(
            stderr(&out).contains(&format!("use that root: --root {}", ch.env.root.display())),
            "{}",
            show(&out)
        );
        assert!(
            !typo.exists(),
            "the suggested init created the mistyped root"
        );

        let out = output(naming(ch.command(CH_DELETE), how, &typo, &["app"]));
        assert_eq!(out.status.code(), Some(64), "{how:?}: {}", show(&out));
        assert!(
            !typo.exists(),
            "{how:?}: ch-delete created the mistyped root"
        );
        assert!(
            ch.img("app").exists(),
            "{how:?}: deleted under another root's lock"
        );
        assert_eq!(ch.env.state("app").as_deref(), Some("ready"));
    }
    // A directory that exists but holds no store (a project's) is as
    // mistyped: nothing of a store is made in it either.
    let project = ch.env.tmp.path().join("project");
    fs::create_dir(&project).unwrap();
    fs::write(project.join("notes"), "mine").unwrap();
    for wrapper in [CH_BUILD, CH_DELETE] {
        let args: &[&str] = if wrapper == CH_BUILD {
            &["-t", "next"]
        } else {
            &["app"]
        };
        let mut c = naming(ch.command(wrapper), Naming::Flag, &project, args);
        if wrapper == CH_BUILD {
            c.arg(&ch.ctx);
        }
        let out = output(c);
        assert_eq!(out.status.code(), Some(64), "{wrapper}: {}", show(&out));
        assert!(stderr(&out).contains("holds no store"), "{}", show(&out));
        assert_eq!(tree(&project), ["notes"], "{wrapper}");
    }
    assert_eq!(ch.env.state("app").as_deref(), Some("ready"));
}

/// Builds and deletes work with the root named either way; `--root`
/// wins over a `STOWAGE_ROOT` that names another root.
#[test]
fn ch_build_and_ch_delete_work_with_the_root_named_either_way() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    ch.dockerfile("Dockerfile", "FROM base\nRUN true\n");
    for (i, how) in [Naming::Flag, Naming::Env].into_iter().enumerate() {
        let tag = format!("app{i}");
        let mut c = naming(ch.command(CH_BUILD), how, &ch.env.root, &["-t", &tag]);
        c.arg(&ch.ctx);
        assert_ok(output(c));
        assert_eq!(ch.env.state(&tag).as_deref(), Some("ready"), "{how:?}");
        assert_ok(output(naming(
            ch.command(CH_DELETE),
            how,
            &ch.env.root,
            &[&tag],
        )));
        assert!(!ch.img(&tag).exists(), "{how:?}");
        assert_eq!(ch.env.state(&tag), None, "{how:?}");
    }
    let mut c = ch.command(CH_BUILD);
    c.env("STOWAGE_ROOT", ch.env.tmp.path().join("elsewhere"))
        .arg("--root")
        .arg(&ch.env.root)
        .args(["-t", "app"])
        .arg(&ch.ctx);
    assert_ok(output(c));
    assert!(!ch.env.tmp.path().join("elsewhere").exists());
}

/// The root is checked before anything is planned or advised: ch-delete
/// of a name this storage directory lacks, under another store's root
/// that keeps a ready image of that name, is refused as any wrong root
/// is, and never advises the `stowage rm` that would delete that image;
/// a mistyped root is named, whatever the glob matches (before: a Python
/// traceback). ch-build likewise names the root before refusing its
/// Dockerfile.
#[test]
fn the_wrappers_check_the_root_before_they_plan() {
    let Some(ch) = Ch::new() else { return };
    let other = ch.env.tmp.path().join("other.stowage");
    let other_img = ch.env.tmp.path().join("other-img");
    fs::create_dir(&other_img).unwrap();
    let mut stowage = ch.command(bin());
    stowage
        .arg("--root")
        .arg(&other)
        .arg("init")
        .arg("--images-dir")
        .arg(&other_img);
    assert_ok(output(stowage));
    let mut stowage = ch.command(bin());
    stowage.arg("--root").arg(&other).args([
        "exec",
        "--write",
        "precious",
        "--",
        "sh",
        "-c",
        "echo data > \"$STOWAGE_IMAGE_DIR/file\"",
    ]);
    assert_ok(output(stowage));
    for how in [Naming::Flag, Naming::Env] {
        let out = output(naming(ch.command(CH_DELETE), how, &other, &["precious"]));
        assert_eq!(out.status.code(), Some(64), "{how:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(err.contains("keeps images of its own"), "{}", show(&out));
        assert!(!err.contains(" rm "), "{}", show(&out));
    }
    assert!(other_img.join("precious/file").is_file());

    let typo = ch.env.tmp.path().join("rooot");
    let out = output(naming(
        ch.command(CH_DELETE),
        Naming::Flag,
        &typo,
        &["nomatch*"],
    ));
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(stderr(&out).contains("does not exist"), "{}", show(&out));
    assert!(!stderr(&out).contains("Traceback"), "{}", show(&out));

    ch.dockerfile("Dockerfile", "FROM --platform=x base\nRUN true\n");
    let mut c = naming(ch.command(CH_BUILD), Naming::Flag, &typo, &["-t", "next"]);
    c.arg(&ch.ctx);
    let out = output(c);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(stderr(&out).contains("does not exist"), "{}", show(&out));
    assert!(!typo.exists());
}

/// `bash -c '. ch-wrapper.bash; FUNCTION ARG'`.
fn wrapper_fn(function: &str, arg: &str) -> Output {
    let mut c = Command::new("bash");
    c.args([
        "-c",
        &format!(". '{SCRIPTS}/ch-wrapper.bash' && me=test && {function} \"$1\""),
        "bash",
        arg,
    ]);
    output(c)
}

/// Every time stowage accepts, the wrappers read as stowage does; what
/// stowage refuses, it refuses (the wrappers ask it first). A comparison of
/// strings (awk's, of "1m" against a count of seconds) would get these wrong.
#[test]
fn the_wrappers_read_times_as_stowage_does() {
    let env = Env::new();
    for (text, ms) in [
        ("500ms", "500"),
        ("1m", "60000"),
        ("1.5m", "90000"),
        ("2", "2000"),
        ("0.25", "250"),
        ("10s", "10000"),
        (" 3 s ", "3000"),
        ("2h", "7200000"),
        ("1d", "86400000"),
        ("+1", "1000"),
        ("-0", "0"),
        (".5", "500"),
        ("5.", "5000"),
        ("1min", "60000"),
        ("2secs", "2000"),
        ("0", "0"),
        ("1w", "604800000"),
        ("2weeks", "1209600000"),
        ("1hour", "3600000"),
        ("3 hrs", "10800000"),
        ("10seconds", "10000"),
        ("5minutes", "300000"),
        ("2days", "172800000"),
        ("250msec", "250"),
    ] {
        let out = env.run(["exec", "--wait", text, "--", "true"]);
        assert_ok_ref(&out);
        let out = wrapper_fn("time_ms", text);
        assert_ok_ref(&out);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), ms, "{text:?}");
    }
    for bad in [
        "10x", "-1", "inf", "1e3", "", "1.2.3", "NaN", "5 5", "1M", "1y",
    ] {
        let out = env.run(["exec", "--wait", bad, "--", "true"]);
        assert_eq!(out.status.code(), Some(64), "{bad:?}: {}", show(&out));
    }
    for (ms, says) in [
        ("90000", "90"),
        ("500", "0.5"),
        ("1234", "1.234"),
        ("0", "0"),
    ] {
        let out = wrapper_fn("seconds", ms);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), says, "{ms}");
    }
}

/// `ch-build --wait 1m` waits a minute for a base to be started, not the
/// two seconds after which "2" sorts after "1m"; `--wait 500ms` half a
/// second, not six. A time stowage refuses is refused before anything.
#[test]
fn ch_build_waits_for_a_base_as_long_as_a_time_with_a_unit_says() {
    let Some(ch) = Ch::new() else { return };
    let df = ch.dockerfile("Dockerfile.app", "FROM later\nRUN true\n");
    let log = ch.env.tmp.path().join("waiting.log");
    let mut c = ch.ch_build(["--wait", "1m", "-t", "app", "-f", &df]);
    c.stderr(fs::File::create(&log).unwrap());
    let mut app = Bg::from_command_keep_stderr(c);
    wait_until("ch-build says how long it waits for 'later'", || {
        fs::read_to_string(&log).is_ok_and(|l| l.contains("waits for base 'later'"))
    });
    let said = fs::read_to_string(&log).unwrap();
    assert!(said.contains("to be started (up to 60 s)"), "{said}");
    // Past the point where a comparison of strings gave up: still waiting.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        assert!(
            app.is_running(),
            "gave up early: {}",
            fs::read_to_string(&log).unwrap()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let later = ch.dockerfile("Dockerfile.later", "FROM base\nRUN echo later > /which\n");
    assert_ok(output(ch.ch_build(["-t", "later", "-f", &later])));
    assert_ok(app.finish());
    assert_eq!(ch.file("app", "which"), "later");

    let df = ch.dockerfile("Dockerfile.never", "FROM never\nRUN true\n");
    let out = output(ch.ch_build(["--wait", "500ms", "-t", "x", "-f", &df]));
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("(up to 0.5 s)"), "{err}");
    assert!(
        err.contains("or start its build within --wait 500ms"),
        "{err}"
    );

    let locks = tree(&ch.env.root.join("locks"));
    // Each refused as stowage refuses it (before, "1 0" read as 10 s, and a
    // number past 64 bits wrapped round to a short wait).
    // An empty time too: before, it read as no --wait, waiting for ever.
    for bad in ["10x", "inf", "-1", "1 0", "18446744073710", ""] {
        let out = output(ch.ch_build(["--wait", bad, "-t", "x", "-f", &df]));
        assert_eq!(out.status.code(), Some(64), "{bad}: {}", show(&out));
        let said = stderr(&out);
        assert!(
            ["not a time", "must be 0 or more", "too long"]
                .iter()
                .any(|m| said.contains(m)),
            "{}",
            show(&out)
        );
    }
    assert_eq!(tree(&ch.env.root.join("locks")), locks);
    assert!(!ch.img("x").exists());
}

/// ch-delete's --wait takes units too: 500ms gives up on a base being
/// read (75), 1m outlasts the reader. An empty time is refused as stowage
/// refuses it (before, it read as no --wait: wait for ever).
#[test]
fn ch_delete_waits_as_long_as_a_time_with_a_unit_says() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    ch.dockerfile("Dockerfile", "FROM base\nRUN true\n");
    assert_ok(output(ch.ch_build(["-t", "app"])));
    for given in [&["--wait", ""][..], &["--wait="][..]] {
        let mut c = ch.command(CH_DELETE);
        c.args(given).arg("app");
        let out = output(c);
        assert_eq!(out.status.code(), Some(64), "{given:?}: {}", show(&out));
        assert!(stderr(&out).contains("not a time"), "{}", show(&out));
        assert_eq!(ch.env.state("app").as_deref(), Some("ready"));
    }
    let reader = ch.env.hold_until(&["--read", "app"], "held", "release");
    let mut c = ch.command(CH_DELETE);
    c.args(["--wait", "500ms", "app"]);
    let out = output(c);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(ch.img("app").exists());
    let mut c = ch.command(CH_DELETE);
    c.args(["--wait", "1m", "app"]);
    let delete = Bg::from_command(c);
    ch.env.wait_for_waiter("app");
    ch.env.release("release");
    assert_ok(reader.finish());
    assert_ok(delete.finish());
    assert!(!ch.img("app").exists());
}

/// SIGTERM or SIGHUP to ch-build, or Ctrl-C (SIGINT to its process
/// group), stops the whole build — stowage, ch-image, the RUN step — and
/// ch-build says which images it left incomplete; the shell's job report
/// ("[1]+ Terminated …") and Python's traceback stay out of the log.
#[test]
fn a_signal_to_ch_build_stops_the_build_and_says_what_it_left() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", &gated("base"));
    for (i, (sig, to_group)) in [
        (libc::SIGINT, true),
        (libc::SIGTERM, false),
        (libc::SIGHUP, false),
    ]
    .into_iter()
    .enumerate()
    {
        let tag = format!("app{i}");
        let id = format!("sig{i}-7731");
        let b = ch.build(&tag, &id);
        ch.wait_started(&tag, &id);
        if to_group {
            b.signal_group(sig);
        } else {
            b.signal(sig);
        }
        let out = b.finish();
        let err = stderr(&out);
        for noise in ["[1]", "Terminated", "Hangup", "Traceback"] {
            assert!(!err.contains(noise), "{noise}: {err}");
        }
        assert_eq!(out.status.code(), Some(128 + sig), "{}", show(&out));
        assert!(err.contains(&format!("'{tag}' left incomplete")), "{err}");
        wait_until("no process of the build is left", || {
            processes_mentioning(&id).is_empty()
        });
        assert!(flock_free(&ch.env.lock_file(&tag)));
        assert_eq!(ch.env.state(&tag).as_deref(), Some("incomplete"));
        assert!(ch.img(&tag).join(format!("started-{id}")).exists());
    }
}

/// A signal to a ch-build that waits for its locks ends it, saying that
/// nothing was built; the build holding them goes on.
#[test]
fn a_signal_while_ch_build_waits_for_its_locks_leaves_nothing() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", &gated("base"));
    let first = ch.build("app", "first");
    ch.wait_started("app", "first");
    let second = ch.build("app", "second");
    ch.env.wait_for_waiter("app");
    second.signal(libc::SIGTERM);
    let out = second.finish();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    assert!(stderr(&out).contains("nothing was built"), "{}", show(&out));
    ch.go("app", "first");
    assert_ok(first.finish());
    assert_eq!(ch.file("app", "id"), "first");
    assert_eq!(ch.env.state("app").as_deref(), Some("ready"));
}

/// Ctrl-C while ch-build reads the Dockerfile for its plan (here a FIFO
/// nobody writes; ch-build reads it once, for the plan and the build) ends
/// it with 130, quietly and before anything exists.
#[test]
fn ctrl_c_while_ch_build_plans_ends_it_quietly() {
    let Some(ch) = Ch::new() else { return };
    let fifo = ch.ctx.join("Dockerfile.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let locks = tree(&ch.env.root.join("locks"));
    let b = Bg::from_command(ch.ch_build(["-t", "app", "-f", fifo.to_str().unwrap()]));
    // Opening a FIFO to write without blocking succeeds once a reader has it
    // open: ch-build is then reading the Dockerfile.
    let mut writer = None;
    wait_until("ch-plan opens the Dockerfile", || {
        writer = fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .ok();
        writer.is_some()
    });
    b.signal_group(libc::SIGINT);
    let out = b.finish();
    drop(writer);
    assert_eq!(out.status.code(), Some(130), "{}", show(&out));
    let err = stderr(&out);
    assert!(!err.contains("Traceback"), "{err}");
    assert!(err.contains("nothing was changed"), "{err}");
    assert!(!ch.img("app").exists());
    assert_eq!(tree(&ch.env.root.join("locks")), locks);
}

/// SIGTERM to a ch-delete that waits for a reader ends it: nothing is
/// deleted, and it says so.
#[test]
fn a_signal_while_ch_delete_waits_deletes_nothing() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    ch.dockerfile("Dockerfile", "FROM base\nRUN true\n");
    assert_ok(output(ch.ch_build(["-t", "app"])));
    let reader = ch.env.hold_until(&["--read", "app"], "held", "release");
    let mut c = ch.command(CH_DELETE);
    c.arg("app");
    let delete = Bg::from_command(c);
    ch.env.wait_for_waiter("app");
    delete.signal(libc::SIGTERM);
    let out = delete.finish();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    assert!(
        stderr(&out).contains("nothing was deleted"),
        "{}",
        show(&out)
    );
    ch.env.release("release");
    assert_ok(reader.finish());
    assert_eq!(ch.env.state("app").as_deref(), Some("ready"));
    assert!(ch.img("app/bin/busybox").exists());
}

/// ch-bench, interrupted (SIGTERM to it, or Ctrl-C), stops every build it
/// started and removes its directory.
#[test]
fn ch_bench_stops_its_builds_and_cleans_up_on_a_signal() {
    let Some(ch) = Ch::new() else { return };
    for (sig, to_group) in [(libc::SIGTERM, false), (libc::SIGINT, true)] {
        let tmp = ch.env.tmp.path().join(format!("bench-{sig}"));
        fs::create_dir(&tmp).unwrap();
        let mut c = ch.command(format!("{SCRIPTS}/ch-bench"));
        c.env("TMPDIR", &tmp).args(["--only", "stowage", "2", "1"]);
        let bench = Bg::from_command(c);
        wait_until("ch-bench's builds run", || {
            fs::read_dir(&tmp)
                .unwrap()
                .flatten()
                .any(|w| w.path().join("s/img/app1").exists())
        });
        if to_group {
            bench.signal_group(sig);
        } else {
            bench.signal(sig);
        }
        let out = bench.finish();
        assert_eq!(out.status.code(), Some(128 + sig), "{}", show(&out));
        let needle = tmp.display().to_string();
        wait_until("no build of ch-bench is left", || {
            processes_mentioning(&needle).is_empty()
        });
        assert_eq!(
            fs::read_dir(&tmp).unwrap().count(),
            0,
            "ch-bench left its directory"
        );
    }
}

/// The target directory the test binary was built in, and the host tuple:
/// TARGET/HOST/debug/stowage.
fn target_and_host() -> (PathBuf, String) {
    let me = Path::new(env!("CARGO_BIN_EXE_stowage"));
    let host_dir = me.parent().unwrap().parent().unwrap();
    let host = host_dir.file_name().unwrap().to_str().unwrap().to_owned();
    (host_dir.parent().unwrap().to_owned(), host)
}

/// One way of telling Cargo where its target directory is: a name for
/// it, the variable that says so (none: unset), and where the script runs.
struct TargetDirGiven<'a> {
    what: &'a str,
    var: Option<(&'a str, &'a Path)>,
    cwd: &'a Path,
}

impl TargetDirGiven<'_> {
    /// `bash SCRIPT ARGS…` run this way, without what `cargo test` set for
    /// this test process.
    fn run(&self, script: &str, args: &[&Path]) -> Output {
        let mut c = Command::new("bash");
        c.arg(format!("{SCRIPTS}/{script}"))
            .args(args)
            .current_dir(self.cwd);
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy().into_owned();
            if k.contains("CARGO") && k != "CARGO_HOME" {
                c.env_remove(&k);
            }
        }
        if let Some((var, value)) = self.var {
            c.env(var, value);
        }
        output(c)
    }
}

/// scripts/built-binary prints the binary Cargo builds, however the
/// target directory is given: unset, relative (to where Cargo runs),
/// absolute, or as CARGO_BUILD_TARGET_DIR.
#[test]
fn built_binary_names_the_binary_cargo_builds_however_the_target_dir_is_given() {
    if !tool_or_skip("cargo", "cargo") {
        return;
    }
    let (target, host) = target_and_host();
    let me = fs::canonicalize(env!("CARGO_BIN_EXE_stowage")).unwrap();
    let outside = target.parent().unwrap();
    let name = Path::new(target.file_name().unwrap());
    let cases = [
        TargetDirGiven {
            what: "absolute",
            var: Some(("CARGO_TARGET_DIR", &target)),
            cwd: Path::new(REPO),
        },
        TargetDirGiven {
            what: "relative",
            var: Some(("CARGO_TARGET_DIR", name)),
            cwd: outside,
        },
        TargetDirGiven {
            what: "CARGO_BUILD_TARGET_DIR",
            var: Some(("CARGO_BUILD_TARGET_DIR", &target)),
            cwd: Path::new(REPO),
        },
        TargetDirGiven {
            what: "unset",
            var: None,
            cwd: Path::new("/"),
        },
    ];
    for given in cases {
        let what = given.what;
        let out = given.run("built-binary", &[Path::new("debug")]);
        assert_ok_ref(&out);
        let printed = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if given.var.is_some() {
            assert_eq!(
                fs::canonicalize(&printed).ok(),
                Some(me.clone()),
                "{what}: {}",
                show(&out)
            );
        } else {
            assert_eq!(
                printed,
                Path::new(REPO)
                    .join("target")
                    .join(&host)
                    .join("debug/stowage"),
                "{what}"
            );
        }
    }
}

/// Whether the release binary in `target` is at least as new as every
/// source it is built from (then `cargo build --release` has nothing to do).
fn release_is_fresh(release: &Path) -> bool {
    let Ok(built) = fs::metadata(release).and_then(|m| m.modified()) else {
        return false;
    };
    let mut sources = walkdir_files(&Path::new(REPO).join("src"));
    for f in ["Cargo.toml", "Cargo.lock", ".cargo/config.toml"] {
        sources.push(Path::new(REPO).join(f));
    }
    sources.iter().all(|s| {
        fs::metadata(s)
            .and_then(|m| m.modified())
            .is_ok_and(|m| m <= built)
    })
}

/// scripts/install and scripts/smoke (which build, then ask
/// scripts/built-binary) work with CARGO_TARGET_DIR absolute, relative or
/// unset. They run `cargo build --release`: where the release binary is
/// missing or older than the sources (a build of minutes), the test skips,
/// saying so; CI builds it before the tests.
#[test]
fn install_and_smoke_work_however_the_target_dir_is_given() {
    let (target, host) = target_and_host();
    let release = target.join(&host).join("release/stowage");
    if !release_is_fresh(&release) {
        eprintln!(
            "skipping: {} is missing or older than the sources; `cargo build --release` first",
            release.display()
        );
        return;
    }
    let env = Env::new();
    // These scripts run Cargo from the repository's top, so a relative
    // CARGO_TARGET_DIR is relative to it.
    let mut cases = vec![TargetDirGiven {
        what: "absolute",
        var: Some(("CARGO_TARGET_DIR", &target)),
        cwd: Path::new("/"),
    }];
    match target.strip_prefix(REPO) {
        Ok(rel) => {
            cases.push(TargetDirGiven {
                what: "relative",
                var: Some(("CARGO_TARGET_DIR", rel)),
                cwd: Path::new(REPO),
            });
            if rel == Path::new("target") {
                cases.push(TargetDirGiven {
                    what: "unset",
                    var: None,
                    cwd: Path::new("/"),
                });
            }
        }
        Err(_) => eprintln!(
            "not run relative or unset: this build's target directory is outside the repository"
        ),
    }
    for given in &cases {
        let what = given.what;
        let dest = env.tmp.path().join(what).join("bin");
        let out = given.run("install", &[&dest]);
        assert_ok_ref(&out);
        let mut v = Command::new(dest.join("stowage"));
        v.arg("--version");
        assert_ok(output(v));
        assert!(
            env.tmp
                .path()
                .join(what)
                .join("share/man/man1/stowage.1")
                .exists(),
            "{what}"
        );

        let out = given.run("smoke", &[]);
        assert_ok_ref(&out);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(&release.display().to_string()),
            "{what}: {}",
            show(&out)
        );
    }
}
