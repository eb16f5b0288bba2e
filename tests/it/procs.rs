//! The command's processes: its whole tree under `--no-inherit`, signals
//! from a terminal in every arrangement of groups and sessions, real-time
//! signals, the command's environment, cancellation of long work, and the
//! command line's help for common mistakes.

use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::common::*;

/// A command (for `sh -c`) that appends a line to FILE every 10 ms, in the
/// background of a shell that waits for it, after touching STARTED. Bounded:
/// it ends by itself after about a minute, should a test fail. Its output
/// goes nowhere, so the test's pipes do not wait for it.
fn background_writer(file: &Path, started: &Path) -> String {
    format!(
        "( i=0; while [ $i -lt 6000 ]; do echo x >> '{f}'; sleep 0.01; i=$((i+1)); done ) </dev/null >/dev/null 2>&1 & touch '{s}'; wait",
        f = file.display(),
        s = started.display()
    )
}

/// Starts `stowage exec FLAGS… --write app -- sh -c SCRIPT` in the
/// background, where SCRIPT is `script(LOG, STARTED)`: LOG is a file in the
/// image for the command's writer, STARTED a sentinel the script touches
/// once that writer runs. Returns once STARTED exists, with LOG's path.
fn exec_writing(
    env: &Env,
    flags: &[&str],
    script: impl FnOnce(&Path, &Path) -> String,
) -> (Bg, PathBuf) {
    let img_file = env.root.join("img/app/log");
    let started = env.sentinel("started");
    let script = script(&img_file, &started);
    let mut args = vec!["exec"];
    args.extend(flags);
    args.extend(["--write", "app", "--", "sh", "-c", &script]);
    let bg = env.spawn(args);
    wait_for_file(&started);
    (bg, img_file)
}

/// Whether anything still appends to `file`: two looks 300 ms apart (the
/// writer appends every 10 ms, so a live one is seen).
fn still_written(file: &Path) -> bool {
    let a = lines(file);
    std::thread::sleep(std::time::Duration::from_millis(300));
    lines(file) != a
}

// ---------------------------------------------------------------------------
// --no-inherit: the whole tree of the command is gone before the locks go.

#[test]
fn sigkill_of_stowage_with_no_inherit_leaves_no_writer_behind() {
    let env = Env::new();
    let (bg, img_file) = exec_writing(&env, &["--no-inherit"], background_writer);
    wait_until("the background job writes", || lines(&img_file) > 2);
    // stowage alone, not its group (the command is in that group).
    bg.signal(libc::SIGKILL);
    // A second writer gets the image once the locks are free: by then
    // nothing of the first command's tree may write any more.
    let out = env.run([
        "exec",
        "--write",
        "app",
        "--wait",
        "30",
        "--",
        "sh",
        "-c",
        &format!(
            "a=$(wc -l < '{f}'); sleep 0.3; b=$(wc -l < '{f}'); [ \"$a\" = \"$b\" ] || {{ echo \"still written: $a then $b\" >&2; exit 9; }}",
            f = img_file.display()
        ),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(!still_written(&img_file));
    drop(bg);
}

#[test]
fn sigterm_of_stowage_with_no_inherit_ends_the_background_job_too() {
    let env = Env::new();
    let (bg, img_file) = exec_writing(&env, &["--no-inherit"], background_writer);
    wait_until("the background job writes", || lines(&img_file) > 2);
    bg.signal(libc::SIGTERM);
    let out = bg.finish();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    // stowage has exited, so its locks are free: nothing may write now.
    assert!(
        !still_written(&img_file),
        "the background job outlived the locks"
    );
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    assert!(flock_free(&env.lock_file("app")));
}

#[test]
fn no_inherit_holds_the_locks_until_the_whole_tree_has_exited() {
    let env = Env::new();
    let late = env.root.join("img/app/late");
    // The shell exits at once; its background job writes half a second on.
    // Its output goes nowhere: the test's pipes must not wait for it.
    let script = format!(
        "( sleep 0.5; echo done > '{}' ) </dev/null >/dev/null 2>&1 &",
        late.display()
    );
    let out = env.run([
        "exec",
        "--no-inherit",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(
        fs::read_to_string(&late).unwrap_or_default(),
        "done\n",
        "exec returned (and released the image) before the background job ended"
    );
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn a_killed_keeper_takes_the_command_tree_with_it() {
    let env = Env::new();
    let (bg, img_file) = exec_writing(&env, &["--no-inherit"], background_writer);
    let keeper = processes_mentioning("__keeper")
        .into_iter()
        .find(|p| {
            fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&*img_file.to_string_lossy()))
        })
        .expect("the keeper runs");
    unsafe { libc::kill(keeper as i32, libc::SIGKILL) };
    let out = bg.finish();
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("keeper"), "{}", show(&out));
    assert!(
        !still_written(&img_file),
        "the background job outlived the locks"
    );
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
}

#[test]
fn by_default_descendants_keep_the_inherited_locks() {
    let env = Env::new();
    let (bg, img_file) = exec_writing(&env, &[], background_writer);
    bg.signal(libc::SIGKILL);
    let out = env.run(["exec", "--write", "app", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    drop(bg);
    // Stop the writer (its group) so the temporary directory can go.
    let marker = img_file.to_string_lossy().into_owned();
    for p in processes_mentioning(&marker) {
        unsafe { libc::kill(p as i32, libc::SIGKILL) };
    }
}

// ---------------------------------------------------------------------------
// Real-time signals.

#[test]
fn a_command_killed_by_a_real_time_signal_gives_128_plus_n() {
    let env = Env::new();
    for inherit in [true, false] {
        let mut args = vec!["exec", "--write", "app"];
        if !inherit {
            args.push("--no-inherit");
        }
        args.extend(["--", "sh", "-c", "kill -50 $$"]);
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(178), "{}", show(&out));
        assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    }
}

// ---------------------------------------------------------------------------
// The command's environment.

#[test]
fn the_command_gets_each_stowage_variable_once_from_this_exec() {
    let env = Env::new();
    env.make_image("a");
    let other = env.tmp.path().join("callers-store");
    // The caller works in another store. No shell in between: a shell
    // would tidy duplicate entries away, a C, Rust or Go program reads the
    // first.
    let with_callers_env = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env("STOWAGE_ROOT", &other)
            .env("STOWAGE_IMAGE_DIR", "/stale/x")
            .env("STOWAGE_IMAGES_DIR", "/stale");
        output(c)
    };
    let out = with_callers_env(&["exec", "--write", "w", "--", "env"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let values = |text: &str, k: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix(&format!("{k}=")))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(
        values(&text, "STOWAGE_ROOT"),
        [env.root.display().to_string()]
    );
    assert_eq!(
        values(&text, "STOWAGE_IMAGES_DIR"),
        [env.root.join("img").display().to_string()]
    );
    assert_eq!(
        values(&text, "STOWAGE_IMAGE_DIR"),
        [env.root.join("img/w").display().to_string()]
    );

    // A nested exec works in this exec's store.
    let out = with_callers_env(&[
        "exec",
        "--write",
        "w",
        "--",
        bin(),
        "exec",
        "--read",
        "a",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(!other.exists(), "the caller's store was created");

    // Two writes: no single image directory, and none left from the caller.
    let out = with_callers_env(&["exec", "--write", "x", "--write", "y", "--", "env"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(values(&text, "STOWAGE_IMAGE_DIR").is_empty(), "{text}");
    assert_eq!(values(&text, "STOWAGE_ROOT").len(), 1, "{text}");
}

// ---------------------------------------------------------------------------
// Signals from a terminal.

/// A pseudo-terminal whose slave is the controlling terminal of a new
/// session led by the process started on it.
struct Pty {
    master: OwnedFd,
    slave: PathBuf,
}

impl Pty {
    fn new() -> Pty {
        unsafe {
            let m = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
            assert!(m >= 0, "posix_openpt");
            assert_eq!(libc::grantpt(m), 0);
            assert_eq!(libc::unlockpt(m), 0);
            let mut buf = [0 as libc::c_char; 128];
            assert_eq!(libc::ptsname_r(m, buf.as_mut_ptr(), buf.len()), 0);
            let slave = std::ffi::CStr::from_ptr(buf.as_ptr())
                .to_string_lossy()
                .into_owned();
            Pty {
                master: OwnedFd::from_raw_fd(m),
                slave: PathBuf::from(slave),
            }
        }
    }

    /// Starts `c` as the leader of a new session whose controlling terminal
    /// is this pty, on its stdin/stdout/stderr.
    fn start(&self, mut c: Command) -> std::process::Child {
        let slave = std::ffi::CString::new(self.slave.to_str().unwrap()).unwrap();
        c.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        unsafe {
            c.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let fd = libc::open(slave.as_ptr(), libc::O_RDWR);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::ioctl(fd, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                for target in 0..3 {
                    libc::dup2(fd, target);
                }
                Ok(())
            });
        }
        c.spawn().expect("start on the pty")
    }

    /// Types on the terminal.
    fn type_bytes(&self, bytes: &[u8]) {
        let n = unsafe {
            libc::write(
                self.master.as_raw_fd(),
                bytes.as_ptr() as *const libc::c_void,
                bytes.len(),
            )
        };
        assert_eq!(n, bytes.len() as isize);
    }
}

/// A command that touches STARTED, then sleeps in the foreground for a
/// while (bounded) — longer than any test waits for a signal to act.
fn sleeper(started: &Path) -> String {
    format!("touch '{}'; sleep 20", started.display())
}

/// Starts `stowage exec --write app [--no-inherit] -- PREFIX… sh -c
/// SLEEPER` with `pty` as its controlling terminal, and returns once the
/// sleeper runs.
fn exec_on_terminal(
    env: &Env,
    pty: &Pty,
    no_inherit: bool,
    prefix: &[&str],
) -> std::process::Child {
    let started = env.sentinel("started");
    let mut c = env.cmd(["exec", "--write", "app"]);
    if no_inherit {
        c.arg("--no-inherit");
    }
    c.arg("--")
        .args(prefix)
        .args(["sh", "-c", &sleeper(&started)]);
    let child = pty.start(c);
    wait_for_file(&started);
    child
}

#[test]
fn ctrl_c_reaches_a_command_in_its_own_process_group() {
    for no_inherit in [false, true] {
        let env = Env::new();
        let pty = Pty::new();
        // GNU timeout moves itself into a process group of its own: the
        // terminal's Ctrl-C reaches stowage's group only.
        let child = exec_on_terminal(&env, &pty, no_inherit, &["timeout", "60"]);
        pty.type_bytes(b"\x03");
        let out = wait_output(child, PATIENCE);
        assert_eq!(
            out.status.code(),
            Some(130),
            "no_inherit={no_inherit}: {}",
            show(&out)
        );
        assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    }
}

#[test]
fn closing_the_terminal_of_a_session_leading_stowage_ends_the_command() {
    for no_inherit in [false, true] {
        let env = Env::new();
        let pty = Pty::new();
        let child = exec_on_terminal(&env, &pty, no_inherit, &[]);
        // The hangup goes to the session leader — stowage — alone.
        let Pty { master, .. } = pty;
        drop(master);
        let out = wait_output(child, PATIENCE);
        assert_eq!(
            out.status.code(),
            Some(129),
            "no_inherit={no_inherit}: {}",
            show(&out)
        );
        assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    }
}

#[test]
fn ctrl_c_reaches_a_command_in_our_group_once() {
    let env = Env::new();
    let started = env.sentinel("started");
    let log = env.sentinel("ints");
    let pty = Pty::new();
    // The command counts the SIGINTs it gets, then ends by itself.
    let script = format!(
        "trap 'echo INT >> \"{log}\"' INT; touch '{s}'; i=0; while [ $i -lt 100 ]; do sleep 0.01; i=$((i+1)); done",
        log = log.display(),
        s = started.display()
    );
    let c = env.cmd(["exec", "--write", "app", "--", "sh", "-c", &script]);
    let child = pty.start(c);
    wait_for_file(&started);
    pty.type_bytes(b"\x03");
    let out = wait_output(child, PATIENCE);
    // The terminal signalled the whole group; stowage did not add a second.
    assert_eq!(
        fs::read_to_string(&log).unwrap_or_default(),
        "INT\n",
        "{}",
        show(&out)
    );
}

// ---------------------------------------------------------------------------
// Long work stops for a termination signal.

#[test]
fn sigterm_stops_a_from_copy_promptly() {
    let env = Env::new();
    // A base of many small files: its copy takes far longer than a signal
    // needs to be seen.
    let files = 4000;
    let script = format!(
        "cd \"$STOWAGE_IMAGE_DIR\" && for d in $(seq 1 40); do mkdir d$d; for f in $(seq 1 {}); do echo $d$f > d$d/f$f; done; done",
        files / 40
    );
    env.build("base", &script);
    let (bg, pause) = env.paused(
        ["exec", "--write", "copy", "--from", "base", "--", "true"],
        "clone-copying",
    );
    bg.signal(libc::SIGTERM);
    fs::remove_file(&pause).unwrap();
    let t0 = std::time::Instant::now();
    let out = bg.finish();
    let took = t0.elapsed();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    let copied = walkdir_files(&env.root.join("img/copy")).len();
    eprintln!("stopped after copying {copied} of {files} files, {took:?} after SIGTERM");
    assert!(
        copied < files / 2,
        "the copy ran on after SIGTERM: {copied} of {files} files"
    );
    assert_eq!(env.state("copy").as_deref(), Some("incomplete"));
    assert!(flock_free(&env.lock_file("copy")));
    assert!(flock_free(&env.lock_file("base")));
}

// ---------------------------------------------------------------------------
// --from: the base is locked for the copy, not for the whole command.

#[test]
fn from_releases_the_base_once_copied_unless_also_read() {
    let env = Env::new();
    env.make_image("base");
    let hold = |extra: &[&str], started: &str| {
        let mut locks = vec!["--write", "app", "--from", "base"];
        locks.extend(extra);
        env.hold(&locks, started)
    };
    let bg = hold(&[], "started1");
    // The command runs: the base is free for a writer (a pull, an rm).
    let out = env.run(["exec", "--write", "base", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let entry = env.lock_entry("base");
    assert!(
        entry
            .as_ref()
            .is_none_or(|e| e["holders"].as_array().unwrap().is_empty()),
        "no holder is recorded for the released base: {entry:?}"
    );
    env.release("release");
    assert_eq!(bg.finish().status.code(), Some(0));
    assert_eq!(env.image("app").unwrap()["base"], "base");

    // With --read BASE as well, it stays read-locked while the command runs.
    fs::remove_file(env.sentinel("release")).unwrap();
    let bg = hold(&["--read", "base"], "started2");
    let out = env.run(["exec", "--write", "base", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    env.release("release");
    assert_eq!(bg.finish().status.code(), Some(0));
}

// ---------------------------------------------------------------------------
// The command line.

#[test]
fn a_command_without_the_double_dash_is_explained() {
    let env = Env::new();
    let out = env.run([
        "exec", "--write", "app", "ch-image", "build", "-t", "app", ".",
    ]);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("put the command after '--'"), "{err}");
    assert!(
        err.contains("exec --write app -- ch-image build -t app ."),
        "{err}"
    );
    assert!(err.contains("usage: stowage exec"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(!env.root.exists(), "nothing created");
}

#[test]
fn typos_get_a_suggestion() {
    let env = Env::new();
    for (args, want) in [
        (&["exec", "--wirte", "app", "--", "true"][..], "'--write'"),
        (&["image"][..], "'images'"),
        (&["lock-status", "--wath", "1"][..], "'--watch'"),
    ] {
        let out = env.run(args);
        assert_eq!(out.status.code(), Some(64), "{}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&format!("did you mean {want}")),
            "{args:?}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

#[test]
fn times_take_units() {
    let env = Env::new();
    let out = env.run(["exec", "--write", "app", "--wait", "10s", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let out = env.run(["exec", "--write", "app", "--wait", "1.5", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    // A busy lock and a wait in milliseconds: 75 after the wait.
    let holder = env.hold(&["--write", "app"], "started");
    let out = env.run(["exec", "--write", "app", "--wait", "200ms", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    env.release("release");
    holder.finish();
    let out = env.run(["rm", "app", "--wait", "1m"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let out = env.run(["exec", "--write", "x", "--wait", "10 parsecs", "--", "true"]);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(stderr(&out).contains("--wait"), "{}", show(&out));
}

#[test]
fn a_trailing_slash_is_an_invalid_name() {
    let env = Env::new();
    let out = env.run(["exec", "--write", "q/", "--", "true"]);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(
        stderr(&out).contains("may not end with '/'"),
        "{}",
        show(&out)
    );
    assert!(!env.root.join("img").exists(), "nothing created");
}

#[test]
fn a_daemonised_descendant_is_still_part_of_the_tree() {
    let env = Env::new();
    // The command double-forks a writer into a session of its own and
    // exits at once, as a daemon does.
    let daemon = env.sentinel("daemon.sh");
    let (mut bg, img_file) = exec_writing(&env, &["--no-inherit"], |log, started| {
        fs::write(&daemon, background_writer(log, started)).unwrap();
        format!(
            "setsid sh '{}' </dev/null >/dev/null 2>&1 &",
            daemon.display()
        )
    });
    wait_until("the daemon writes", || lines(&img_file) > 2);
    // The command has exited, but its daemon writes: the image stays held.
    assert!(bg.is_running(), "stowage returned while the daemon writes");
    let out = env.run(["exec", "--write", "app", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    bg.signal(libc::SIGKILL);
    let out = env.run(["exec", "--write", "app", "--wait", "30", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(!still_written(&img_file), "the daemon outlived the locks");
}

#[test]
fn a_kill_of_stowages_whole_group_still_ends_a_daemonised_descendant() {
    let env = Env::new();
    let daemon = env.sentinel("daemon.sh");
    let (bg, img_file) = exec_writing(&env, &["--no-inherit"], |log, started| {
        fs::write(&daemon, background_writer(log, started)).unwrap();
        format!(
            "setsid sh '{}' </dev/null >/dev/null 2>&1 & wait",
            daemon.display()
        )
    });
    wait_until("the daemon writes", || lines(&img_file) > 2);
    // `kill -9 -PGID`: stowage and the command's shell die together; the
    // daemon left the group, the keeper leads its own.
    bg.signal_group(libc::SIGKILL);
    let out = env.run(["exec", "--write", "app", "--wait", "30", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(!still_written(&img_file), "the daemon outlived the locks");
}

#[test]
fn a_leftover_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let env = Env::new();
    let (bg, img_file) = exec_writing(&env, &["--no-inherit"], |log, started| {
        format!(
            "( trap '' TERM; i=0; while [ $i -lt 6000 ]; do echo x >> '{f}'; sleep 0.01; i=$((i+1)); done ) </dev/null >/dev/null 2>&1 & touch '{s}'; wait",
            f = log.display(),
            s = started.display()
        )
    });
    wait_until("the background job writes", || lines(&img_file) > 2);
    bg.signal(libc::SIGTERM);
    let t0 = std::time::Instant::now();
    let out = bg.finish();
    eprintln!("stowage ended {:?} after SIGTERM", t0.elapsed());
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    assert!(!still_written(&img_file), "the job outlived the locks");
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
}
