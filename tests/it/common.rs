//! The test harness: a store in a temporary directory, the real binary, and
//! bounded waits. Nothing here sleeps to synchronise: processes signal
//! progress through sentinel files, and every wait has a deadline that fails
//! the test instead of hanging it.
//!
//! It also holds every setup more than one test needs, so that each exists
//! once: images made from a script (`Env::build`), commands held or started
//! until a sentinel says they run, waits for waiter records, root-only skips
//! (`root_or_skip`), mounts that go away with the test (`Mount`), locks held
//! from outside by flock(1), stowage run as an unprivileged user
//! (`unprivileged`, `as_nobody`), walks of a tree, and probes of /proc for
//! lock waiters and for what is left of a command's process tree.

#![allow(dead_code)]

use std::ffi::OsStr;
use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Deadline for anything that should take a moment: generous, because
/// these machines are shared and slow at times; reaching it is a failure.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// The binary under test: this build's, or `STOWAGE_TEST_BIN` (to run a
/// regression test against an older build and see it fail there).
pub fn bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        default_interrupts();
        std::env::var("STOWAGE_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_stowage").into())
    })
}

/// SIGINT, SIGQUIT and SIGHUP back to their defaults in this process, so
/// that every process a test starts gets them so: a shell starts a
/// background job (`cargo test &` in a script) with SIGINT and SIGQUIT
/// ignored, `nohup` ignores SIGHUP, children inherit that, and the tests of
/// Ctrl-C and of a closed terminal would then test nothing. Tests that want
/// a signal ignored ignore it in the child they start.
fn default_interrupts() {
    for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGHUP] {
        // SAFETY: signal(2) with SIG_DFL installs no handler of ours.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    }
}

/// A fresh store root in a temporary directory, plus a scratch directory
/// for sentinel files.
pub struct Env {
    pub tmp: tempfile::TempDir,
    pub root: PathBuf,
    pub scratch: PathBuf,
}

impl Env {
    pub fn new() -> Env {
        bin();
        let tmp = tempfile::Builder::new()
            .prefix("stowage-it.")
            .tempdir()
            .unwrap();
        let root = tmp.path().join("root");
        let scratch = tmp.path().join("scratch");
        fs::create_dir(&scratch).unwrap();
        Env { tmp, root, scratch }
    }

    /// `stowage --root ROOT ARGS…`
    pub fn cmd<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut c = Command::new(bin());
        c.arg("--root").arg(&self.root).args(args);
        c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
        c.stdin(Stdio::null());
        c
    }

    /// Runs stowage to completion (bounded).
    pub fn run<I, S>(&self, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        output(self.cmd(args))
    }

    /// Runs stowage and insists on exit 0.
    pub fn ok<I, S>(&self, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let out = self.run(args);
        assert_eq!(out.status.code(), Some(0), "stowage failed: {}", show(&out));
        out
    }

    /// Creates a ready image with one file in it.
    pub fn make_image(&self, name: &str) {
        self.build(name, "echo content > \"$STOWAGE_IMAGE_DIR/file\"");
    }

    /// Runs `sh -c SCRIPT` as the writer of image NAME (which it finds at
    /// `$STOWAGE_IMAGE_DIR`), creating the image if need be; fails the test
    /// unless that exits 0, so the image is ready with what SCRIPT made.
    pub fn build(&self, name: &str, script: &str) -> Output {
        let out = self.run_sh(name, script);
        assert_eq!(out.status.code(), Some(0), "stowage failed: {}", show(&out));
        out
    }

    /// Runs `sh -c SCRIPT` as the writer of image NAME, as
    /// [`Env::build`] does, and returns how it ended, whatever that was.
    pub fn run_sh(&self, name: &str, script: &str) -> Output {
        self.run(["exec", "--write", name, "--", "sh", "-c", script])
    }

    /// Starts stowage in the background, in its own process group so a
    /// test can kill it together with its command.
    pub fn spawn<I, S>(&self, args: I) -> Bg
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut c = self.cmd(args);
        c.process_group(0)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        Bg {
            child: Some(c.spawn().expect("spawn stowage")),
        }
    }

    /// Starts stowage in the background with the debug pause at `point`,
    /// and returns once it waits there, with the file whose removal lets it
    /// go on. The file is named after the point, so several processes can
    /// be paused at once.
    pub fn paused<I, S>(&self, args: I, point: &str) -> (Bg, PathBuf)
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let file = self.sentinel(&format!("paused.{point}"));
        let mut c = self.cmd(args);
        c.env(
            stowage::env::DEBUG_PAUSE,
            format!("{point}:{}", file.display()),
        );
        let bg = Bg::from_command(c);
        wait_for_file(&file);
        (bg, file)
    }

    /// `stowage ARGS… -- BUILDER` where BUILDER is a script that can run
    /// when exec looks for it and is gone by its start (removed at the
    /// `exec-before-spawn` pause): the start's own failure, after the
    /// session began.
    pub fn run_with_vanishing_command(&self, args: &[&str]) -> Output {
        use std::os::unix::fs::PermissionsExt;
        let cmd = self.scratch.join("vanishing-builder");
        fs::write(&cmd, "#!/bin/sh\n").unwrap();
        fs::set_permissions(&cmd, fs::Permissions::from_mode(0o755)).unwrap();
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--", cmd.to_str().unwrap()]);
        let (bg, go) = self.paused(&all, "exec-before-spawn");
        fs::remove_file(&cmd).unwrap();
        fs::remove_file(&go).unwrap();
        bg.finish()
    }

    pub fn sentinel(&self, name: &str) -> PathBuf {
        self.scratch.join(name)
    }

    /// A command that creates sentinel `started`, then waits (bounded) for
    /// sentinel `release` before exiting 0.
    pub fn hold_cmd(&self, started: &str, release: &str) -> Vec<String> {
        vec![
            "sh".into(),
            "-c".into(),
            format!(
                "touch '{s}'; i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done; [ -e '{r}' ]",
                s = self.sentinel(started).display(),
                r = self.sentinel(release).display()
            ),
        ]
    }

    /// Starts `stowage exec LOCKS... -- CMD` in the background, where CMD
    /// creates sentinel `started` and waits (bounded) for sentinel
    /// `release`; returns once CMD runs, so the locks are held.
    pub fn hold(&self, locks: &[&str], started: &str) -> Bg {
        self.hold_until(locks, started, "release")
    }

    /// Like [`Env::hold`], with CMD waiting for sentinel `release` (so
    /// several holders can be let go one by one).
    pub fn hold_until(&self, locks: &[&str], started: &str, release: &str) -> Bg {
        let bg = self.spawn(self.hold_args(locks, started, release));
        wait_for_file(&self.sentinel(started));
        bg
    }

    /// Like [`Env::hold`], with `tweak` applied to the stowage command
    /// first (an environment variable, say); stdin is /dev/null. Returns
    /// once the command runs, so the locks are held.
    pub fn hold_with(&self, locks: &[&str], started: &str, tweak: impl FnOnce(&mut Command)) -> Bg {
        let mut c = self.cmd(self.hold_args(locks, started, "release"));
        tweak(&mut c);
        let bg = Bg::from_command(c);
        wait_for_file(&self.sentinel(started));
        bg
    }

    fn hold_args(&self, locks: &[&str], started: &str, release: &str) -> Vec<String> {
        let mut args: Vec<String> = vec!["exec".into()];
        args.extend(locks.iter().map(|s| s.to_string()));
        args.push("--".into());
        args.extend(self.hold_cmd(started, release));
        args
    }

    /// Starts `stowage exec LOCKS... -- sh -c SCRIPT` in the background,
    /// where SCRIPT is `script(STARTED)` and touches the sentinel file
    /// STARTED once under way; returns once it has.
    pub fn start_sh(&self, locks: &[&str], script: impl FnOnce(&Path) -> String) -> Bg {
        let started = self.sentinel("started");
        let script = script(&started);
        let mut args = vec!["exec"];
        args.extend(locks);
        args.extend(["--", "sh", "-c", &script]);
        let bg = self.spawn(args);
        wait_for_file(&started);
        bg
    }

    /// Waits (bounded) until lock-status shows a waiter on `image`.
    pub fn wait_for_waiter(&self, image: &str) {
        self.wait_for_waiters(image, 1);
    }

    /// Waits (bounded) until lock-status shows at least `n` waiters on
    /// `image`.
    pub fn wait_for_waiters(&self, image: &str, n: usize) {
        wait_until(&format!("{n} waiter(s) on '{image}' recorded"), || {
            self.lock_entry(image)
                .is_some_and(|e| e["waiters"].as_array().unwrap().len() >= n)
        });
    }

    /// Waits (bounded) until lock-status shows process `pid` waiting for
    /// some lock (`what` names it in a failure).
    pub fn wait_for_waiting_pid(&self, pid: u32, what: &str) {
        wait_until(&format!("the {what} waiter is recorded"), || {
            let st = self.status_json(Vec::<&str>::new());
            st["locks"].as_array().unwrap().iter().any(|l| {
                l["waiters"]
                    .as_array()
                    .is_some_and(|w| w.iter().any(|w| w["pid"] == pid))
            })
        });
    }

    /// Makes the store with its images directory on a 4 MiB tmpfs of its
    /// own (`images` in the scratch directory), so trees there are deleted
    /// in place; `None`, with the reason printed, unless this test runs as
    /// root on a machine that lets it mount.
    pub fn init_on_tmpfs(&self) -> Option<Mount> {
        if !root_or_skip("mounting a tmpfs") {
            return None;
        }
        let images = self.tmp.path().join("images");
        fs::create_dir(&images).unwrap();
        let m = Mount::tmpfs_at(&images, "4m")?;
        self.ok(["init", "--images-dir", images.to_str().unwrap()]);
        Some(m)
    }

    /// lock-status's entry for slot class `class`, if it shows one.
    pub fn slot_entry(&self, class: &str) -> Option<Value> {
        let st = self.status_json(Vec::<&str>::new());
        st["locks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["kind"] == "slot" && l["name"] == class)
            .cloned()
    }

    /// Waits (bounded) until lock-status shows at least `n` waiters on
    /// slot class `class`.
    pub fn wait_for_slot_waiters(&self, class: &str, n: usize) {
        wait_until(&format!("{n} waiter(s) on slot class '{class}'"), || {
            self.slot_entry(class)
                .is_some_and(|e| e["waiters"].as_array().unwrap().len() >= n)
        });
    }

    pub fn release(&self, release: &str) {
        fs::write(self.sentinel(release), "").unwrap();
    }

    pub fn images_json(&self) -> Vec<Value> {
        let out = self.ok(["images", "--json"]);
        serde_json::from_slice::<Value>(&out.stdout)
            .unwrap()
            .as_array()
            .unwrap()
            .clone()
    }

    pub fn image(&self, name: &str) -> Option<Value> {
        self.images_json().into_iter().find(|i| i["name"] == name)
    }

    pub fn state(&self, name: &str) -> Option<String> {
        self.image(name)
            .map(|i| i["state"].as_str().unwrap().to_owned())
    }

    pub fn status_json<I, S>(&self, args: I) -> Value
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut c = self.cmd(["lock-status", "--json"]);
        c.args(args);
        let out = output(c);
        assert_eq!(
            out.status.code(),
            Some(0),
            "lock-status failed: {}",
            show(&out)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The lock-status entry for an image, if shown.
    pub fn lock_entry(&self, image: &str) -> Option<Value> {
        let st = self.status_json([image]);
        st["locks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["kind"] == "image" && l["name"] == image)
            .cloned()
    }

    /// Writes image `name` (a plain name) as if at 2020-01-01: its
    /// recorded last use is long past, and so is its lock file's last write.
    pub fn make_image_used_long_ago(&self, name: &str) {
        self.ok_at(
            "2020-01-01T00:00:00Z",
            &["exec", "--write", name, "--", "true"],
        );
        self.date_lock_file(name, "2020-01-01T00:00:00Z");
    }

    /// `stowage ARGS` on a host whose clock says `now` (`STOWAGE_NOW`: RFC
    /// 3339 or epoch seconds); it must succeed.
    pub fn ok_at(&self, now: &str, args: &[&str]) -> Output {
        let mut c = self.cmd(args);
        c.env("STOWAGE_NOW", now);
        let out = output(c);
        assert_eq!(code(&out), Some(0), "at {now}: {}", show(&out));
        out
    }

    /// [`Env::ok_at`], and image `enc`'s lock file dated `now` if the
    /// command wrote it (its bytes changed), else left as dated before: what
    /// a filesystem whose clock says `now` would leave.
    pub fn ok_at_dated(&self, now: &str, args: &[&str], enc: &str) -> Output {
        let path = self.lock_file(enc);
        let (before, dated) = (
            fs::read(&path).ok(),
            fs::metadata(&path).and_then(|m| m.modified()),
        );
        let out = self.ok_at(now, args);
        match dated {
            Ok(t) if fs::read(&path).ok() == before => {
                let secs = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
                self.date_lock_file(enc, &secs.to_string());
            }
            _ => self.date_lock_file(enc, now),
        }
        out
    }

    /// Sets when the lock file of image `enc` was last written, by the
    /// filesystem's clock, to `when` (RFC 3339 or epoch seconds): what a
    /// file last written then has, where a test fakes the hosts' clocks.
    pub fn date_lock_file(&self, enc: &str, when: &str) {
        let date = match when.parse::<u64>() {
            Ok(secs) => format!("@{secs}"),
            Err(_) => when.to_owned(),
        };
        let path = self.lock_file(enc);
        let st = std::process::Command::new("touch")
            .args(["-m", "-d", &date])
            .arg(&path)
            .status()
            .unwrap();
        assert!(st.success(), "touch -d {date} {}", path.display());
    }

    /// Puts the catalog of `from` in the place of this store's (a copy
    /// written over the file, as a restore or a mistaken copy would).
    pub fn put_catalog_of(&self, from: &Env) {
        from.ok(["images"]);
        fs::copy(from.root.join("stowage.db"), self.root.join("stowage.db")).unwrap();
    }

    /// Asserts that `exec --read NAME -- true` is refused as not ready or
    /// missing (66), saying `why` otherwise.
    pub fn assert_read_refused(&self, name: &str, why: &str) {
        let out = self.run(["exec", "--read", name, "--", "true"]);
        assert_eq!(code(&out), Some(66), "{why}: {}", show(&out));
    }

    /// The default images directory.
    pub fn images_dir(&self) -> PathBuf {
        self.root.join("img")
    }

    /// Writes image `name` with `sh -c SCRIPT` as [`Env::build`] does,
    /// holding the global lock from another process meanwhile: a write
    /// takes no global lock (a wait for it would end after 0.3 s, and fail
    /// the test).
    pub fn build_without_global_lock(&self, name: &str, script: &str) {
        let global = hold_global(self);
        self.build_waiting_briefly(name, script);
        global.kill_all();
    }

    fn build_waiting_briefly(&self, name: &str, script: &str) {
        self.ok([
            "exec", "--write", name, "--wait", "0.3", "--", "sh", "-c", script,
        ]);
    }

    /// What `file` of image `name` holds, read by a command of `exec
    /// --read NAME` (which must succeed). For a name that is its own
    /// encoding (no `/` or `:`).
    pub fn read_in_image(&self, name: &str, file: &str) -> String {
        let script = format!("cat \"$STOWAGE_IMAGES_DIR/{name}/{file}\"");
        let out = self.ok(["exec", "--read", name, "--", "sh", "-c", &script]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Starts a write of `name` whose command writes half a file, and
    /// SIGKILLs stowage and the command together (a host crash, kill -9
    /// of the job) while it runs: nothing records the outcome.
    pub fn kill_a_writer_in_its_command(&self, name: &str) {
        let started = self.sentinel("started");
        let writer = self.spawn([
            "exec",
            "--write",
            name,
            "--",
            "sh",
            "-c",
            &format!(
                "echo half > \"$STOWAGE_IMAGE_DIR/file\"; touch '{}'; sleep 60",
                started.display()
            ),
        ]);
        wait_for_file(&started);
        writer.kill_all();
    }

    pub fn lock_file(&self, enc: &str) -> PathBuf {
        self.root.join("locks/images").join(format!("{enc}.lock"))
    }
}

/// A background process, killed (with its group) if the test forgets it.
pub struct Bg {
    pub child: Option<Child>,
}

impl Bg {
    /// A background process from any command, in its own process group.
    pub fn from_command(mut c: Command) -> Bg {
        c.process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        Bg {
            child: Some(c.spawn().expect("spawn")),
        }
    }

    /// Like [`Bg::from_command`], but keeps a stderr the caller redirected.
    pub fn from_command_keep_stderr(mut c: Command) -> Bg {
        c.process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        Bg {
            child: Some(c.spawn().expect("spawn")),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits (bounded) for exit and returns the output.
    pub fn finish(mut self) -> Output {
        let child = self.child.take().unwrap();
        wait_output(child, PATIENCE)
    }

    /// Sends a signal to the stowage process only.
    pub fn signal(&self, sig: i32) {
        unsafe { libc::kill(self.pid() as i32, sig) };
    }

    /// Sends a signal to the whole process group (stowage and its command).
    pub fn signal_group(&self, sig: i32) {
        unsafe { libc::kill(-(self.pid() as i32), sig) };
    }

    /// SIGKILLs stowage and everything it started, and waits (bounded) until
    /// every process of the group has exited — orphans included, whose exit
    /// (and so the release of inherited locks) is asynchronous.
    pub fn kill_all(mut self) {
        let pgid = self.pid() as i32;
        self.signal_group(libc::SIGKILL);
        let mut child = self.child.take().unwrap();
        let _ = child.wait();
        wait_until(&format!("process group {pgid} is gone"), || {
            group_members(pgid) == 0
        });
    }

    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().unwrap().try_wait().unwrap().is_none()
    }
}

impl Drop for Bg {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.wait();
        }
    }
}

/// Runs a command to completion within [`PATIENCE`].
pub fn output(mut c: Command) -> Output {
    c.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let child = c.spawn().expect("spawn");
    wait_output(child, PATIENCE)
}

/// Waits for a child, killing its group and failing if it takes too long.
pub fn wait_output(mut child: Child, limit: Duration) -> Output {
    wait_reaping(&mut child, limit, |c| c.try_wait().unwrap())
}

/// Runs a command to completion within [`PATIENCE`], as [`output`] does,
/// with the most memory it held at once (KiB resident). Through GNU
/// time(1) where it is: a child this process spawns starts from its mm
/// (vfork), and the kernel counts that mm's peak (this test process's,
/// grown with the suite) as the child's; time's own child starts small.
pub fn output_and_peak(c: Command) -> (Output, u64) {
    let time = Path::new("/usr/bin/time");
    if !time.exists() {
        return output_and_own_peak(c);
    }
    let file = tempfile::NamedTempFile::new().unwrap();
    let mut t = Command::new(time);
    t.args(["-f", "%M", "-o"]).arg(file.path());
    t.arg(c.get_program()).args(c.get_args());
    for (k, v) in c.get_envs() {
        match v {
            Some(v) => t.env(k, v),
            None => t.env_remove(k),
        };
    }
    if let Some(d) = c.get_current_dir() {
        t.current_dir(d);
    }
    let out = output(t);
    let said = fs::read_to_string(file.path()).unwrap_or_default();
    let peak = said.lines().last().and_then(|l| l.trim().parse().ok());
    (out, peak.unwrap_or(u64::MAX))
}

/// [`output_and_peak`] by the kernel's count for the child itself.
fn output_and_own_peak(mut c: Command) -> (Output, u64) {
    use std::os::unix::process::ExitStatusExt;
    c.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = c.spawn().expect("spawn");
    let mut peak = 0;
    let out = wait_reaping(&mut child, PATIENCE, |c| {
        let (mut status, pid) = (0, c.id() as i32);
        // SAFETY: all-zero bytes are a valid rusage, filled by wait4.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: our own child, and out-pointers of ours.
        let reaped = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        (reaped == pid).then(|| {
            peak = usage.ru_maxrss as u64;
            std::process::ExitStatus::from_raw(status)
        })
    });
    (out, peak)
}

/// Waits for `child` until `reap` gives its status, killing its group
/// and failing after `limit`.
fn wait_reaping(
    child: &mut Child,
    limit: Duration,
    mut reap: impl FnMut(&mut Child) -> Option<std::process::ExitStatus>,
) -> Output {
    let deadline = Instant::now() + limit;
    // Drain pipes in threads so a chatty child never blocks on a full pipe.
    let out = child.stdout.take().map(|mut s| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = std::io::Read::read_to_end(&mut s, &mut v);
            v
        })
    });
    let err = child.stderr.take().map(|mut s| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = std::io::Read::read_to_end(&mut s, &mut v);
            v
        })
    });
    let status = loop {
        if let Some(st) = reap(child) {
            break st;
        }
        if Instant::now() > deadline {
            // Where each process of the group waits, so that a rare hang
            // can be diagnosed from one run's log.
            let stuck = group_waits(child.id()) + &brick_waits();
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            panic!(
                "process {} did not finish within {limit:?}; its group:\n{stuck}",
                child.id()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Output {
        status,
        stdout: out.map(|t| t.join().unwrap()).unwrap_or_default(),
        stderr: err.map(|t| t.join().unwrap()).unwrap_or_default(),
    }
}

/// Polls `cond` until it holds, failing with `what` after [`PATIENCE`].
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn wait_for_file(p: &Path) {
    wait_until(&format!("{} exists", p.display()), || p.exists());
}

pub fn show(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Is the lock on this file free right now? Asked with flock(1), an
/// independent implementation.
pub fn flock_free(path: &Path) -> bool {
    let st = Command::new("flock")
        .args(["-n", "-x"])
        .arg(path)
        .arg("true")
        .status()
        .expect("flock(1)");
    st.success()
}

/// Whether some process is blocked in flock(2) on this file right now:
/// /proc/locks lists each waiter as a "->" line naming the file's device
/// (hex major:minor) and inode. False if the file does not exist.
pub fn flock_waited_on(path: &Path) -> bool {
    flock_waiters_on(path) > 0
}

/// How many processes are blocked in flock(2) on this file right now (see
/// [`flock_waited_on`]); 0 if the file does not exist.
pub fn flock_waiters_on(path: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = fs::metadata(path) else {
        return 0;
    };
    let id = format!(
        "{:02x}:{:02x}:{}",
        libc::major(md.dev()),
        libc::minor(md.dev()),
        md.ino()
    );
    fs::read_to_string("/proc/locks")
        .unwrap()
        .lines()
        .filter(|l| l.contains("->") && l.split_whitespace().any(|f| f == id))
        .count()
}

/// Starts flock(1), an outside program, holding `path` exclusively while
/// it runs `sh -c "touch STARTED; THEN"`; returns once STARTED exists, so
/// the lock is held until THEN ends or the holder is killed.
pub fn flock_holder(path: &Path, started: &Path, then: &str) -> Bg {
    let mut c = Command::new("flock");
    c.arg("-x").arg(path).args([
        "sh",
        "-c",
        &format!("touch '{}'; {then}", started.display()),
    ]);
    let bg = Bg::from_command(c);
    wait_for_file(started);
    bg
}

/// Every path under `dir` (relative), for "nothing created or deleted".
pub fn tree(dir: &Path) -> Vec<String> {
    if !dir.exists() {
        return Vec::new();
    }
    let mut v: Vec<String> = walkdir(dir)
        .into_iter()
        .map(|p| p.strip_prefix(dir).unwrap().display().to_string())
        .collect();
    v.sort();
    v
}

/// Every file (anything but a directory) under `dir`; what cannot be read
/// is passed over.
pub fn walkdir_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

/// Every path under `dir`, directories included, depth first.
pub fn walkdir(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                stack.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}

/// The state letter of process `pid` (field 3 of /proc/PID/stat: R, S,
/// Z, …), or `None` once it is gone.
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

/// Whether process `pid` still runs: it exists and is neither a zombie
/// (Z) nor dead (X).
pub fn alive(pid: u32) -> bool {
    proc_state(pid).is_some_and(|s| s != 'Z' && s != 'X')
}

/// Every live process but this test's own whose command line contains
/// `needle` (a test's own marker, such as a path in its scratch
/// directory), to find what survived of a command's tree.
pub fn processes_mentioning(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me && alive(pid))
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .collect()
}

/// utime + stime of a process, in clock ticks (including its threads).
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // fields 14 and 15 (utime, stime) are at 11 and 12 after the state (field 3)
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Live (non-zombie) processes in a process group.
/// Asserts that `waiter` uses no CPU over 2 s of waiting: a spinning one would use ~200 clock
/// ticks, a blocked one ~0.
pub fn assert_waits_without_cpu(waiter: &Bg) {
    let before = cpu_ticks(waiter.pid());
    std::thread::sleep(Duration::from_secs(2)); // the measurement window
    let used = cpu_ticks(waiter.pid()) - before;
    assert!(
        used <= 5,
        "waiter used {used} clock ticks of CPU in 2 s of waiting"
    );
}

pub fn group_members(pgid: i32) -> usize {
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter_map(|e| fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| {
            let Some(close) = stat.rfind(')') else {
                return false;
            };
            let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
            f.len() > 2 && f[0] != "Z" && f[2] == pgid.to_string()
        })
        .count()
}

/// The exit code of a finished command (`None` when a signal ended it).
pub fn code(out: &Output) -> Option<i32> {
    out.status.code()
}

/// Whether this test runs as root (effective uid 0).
pub fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

/// Whether this test runs as root; if not, prints "skipping: WHAT needs
/// root" so the skip is visible, and the caller returns at once.
pub fn root_or_skip(what: &str) -> bool {
    if !is_root() {
        eprintln!("skipping: {what} needs root");
    }
    is_root()
}

/// Whether `tool` is on PATH (asked of `sh`, as a test's script would).
pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether `tool` is on PATH; if not, prints "skipping: TOOL is not
/// installed (Debian package PACKAGE)" so the skip is visible, and the
/// caller returns at once.
/// gdb present and allowed to run a program under ptrace (a container may
/// forbid it): else the caller skips, saying why.
pub fn gdb_or_skip() -> bool {
    if !tool_or_skip("gdb", "gdb") {
        return false;
    }
    let ran = Command::new("gdb")
        .args(["-q", "-batch", "-ex", "run", "--args", "true"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("exited normally"));
    if !ran {
        eprintln!("skipping: gdb cannot run a program here (ptrace not permitted?)");
    }
    ran
}

/// stowage with ARGS on `env`'s root under gdb running the command file
/// `cmds` (breakpoints, `shell` steps, `continue`), with the environment
/// the tests' own commands get. The caller runs or spawns it.
pub fn stowage_under_gdb<I, S>(env: &Env, cmds: &Path, args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut c = Command::new("gdb");
    c.args(["-q", "-batch", "-x"])
        .arg(cmds)
        .arg("--args")
        .arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(args);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    c
}

/// Runs `stowage ARGS…` under gdb and SIGKILLs it where it reaches the
/// function `at` (once that has returned, if `returned`): what a crash at
/// that step leaves. Fails the test unless it got there. The caller
/// checks [`gdb_or_skip`] first.
pub fn killed_at_function(env: &Env, at: &str, returned: bool, args: &[&str]) -> Output {
    let cmds = env.sentinel("gdb-kill-cmds");
    fs::write(
        &cmds,
        format!(
            "set pagination off\nset confirm off\nbreak {at}\nrun\n{}kill\nquit\n",
            if returned { "finish\n" } else { "" }
        ),
    )
    .unwrap();
    let out = output(stowage_under_gdb(env, &cmds, args));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("Breakpoint 1, ") && said.contains("killed]"),
        "stowage was not killed at {at}: {}",
        show(&out)
    );
    out
}

/// Holds the global lock with flock(1), as an outside program could.
pub fn hold_global(env: &Env) -> Bg {
    flock_holder(
        &env.root.join("locks/global.lock"),
        &env.sentinel("global-held"),
        "sleep 60",
    )
}

pub fn tool_or_skip(tool: &str, package: &str) -> bool {
    let found = have(tool);
    if !found {
        eprintln!("skipping: {tool} is not installed (Debian package {package})");
    }
    found
}

/// `stowage --root ROOT ARGS…` of `env`, under strace with `faults` (its
/// `-P PATH`, `-e trace=…` and `--inject=…` options) and its trace
/// discarded: errors injected into real calls of the real binary.
pub fn under_strace<S: AsRef<OsStr>>(env: &Env, faults: &[S], args: &[&str]) -> Command {
    let mut c = Command::new("strace");
    c.args(["-f", "-qq", "-o", "/dev/null"])
        .args(faults)
        .arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(args);
    c
}

/// A directory outside the root (in the test's scratch directory) with
/// files at two depths that must survive whatever the test does; check
/// with [`assert_intact`].
pub fn victim(env: &Env) -> PathBuf {
    let v = env.tmp.path().join("victim");
    fs::create_dir_all(v.join("sub")).unwrap();
    fs::write(v.join("keep"), "precious").unwrap();
    fs::write(v.join("sub/keep"), "precious").unwrap();
    v
}

/// The names in the directory `dir`, sorted (one level).
pub fn names_at(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Fails unless both files [`victim`] planted are there, unchanged.
pub fn assert_intact(v: &Path) {
    assert_eq!(fs::read_to_string(v.join("keep")).unwrap(), "precious");
    assert_eq!(fs::read_to_string(v.join("sub/keep")).unwrap(), "precious");
}

/// `chattr +i` (`on`) or `chattr -i` on `path`; false where the filesystem
/// cannot.
pub fn immutable(path: &Path, on: bool) -> bool {
    Command::new("chattr")
        .arg(if on { "+i" } else { "-i" })
        .arg(path)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A filesystem mounted for one test. Dropping it takes the mount away
/// (lazily if something still uses it), before the scratch directory it
/// may sit in is removed, so no test leaves a mount behind.
pub struct Mount {
    pub dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl Mount {
    /// `mount ARGS… TARGET` on an existing directory; `None` where this
    /// machine cannot mount it (the caller says why it skips).
    pub fn at(args: &[&str], target: &Path) -> Option<Mount> {
        let ok = Command::new("mount")
            .args(args)
            .arg(target)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Mount::adopt(target))
    }

    /// A tmpfs of `size` mounted on the existing directory `target`;
    /// `None`, with the reason printed, where this machine cannot mount it.
    pub fn tmpfs_at(target: &Path, size: &str) -> Option<Mount> {
        let m = Mount::at(
            &["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"],
            target,
        );
        if m.is_none() {
            eprintln!("skipping: cannot mount a tmpfs here");
        }
        m
    }

    /// A ramfs (no extended attributes, no size limit) mounted on the existing directory `target`;
    /// `None`, with the reason printed, where this machine cannot mount it.
    pub fn ramfs_at(target: &Path) -> Option<Mount> {
        let m = Mount::at(&["-t", "ramfs", "ramfs"], target);
        if m.is_none() {
            eprintln!("skipping: cannot mount a ramfs here");
        }
        m
    }

    /// Takes charge of a mount already at `dir`: unmounted on drop.
    pub fn adopt(dir: &Path) -> Mount {
        Mount {
            dir: dir.to_owned(),
            _tmp: None,
        }
    }

    /// A tmpfs mounted with `-o OPTS` on a fresh directory of its own;
    /// `None`, with the reason printed, unless this test runs as root on a
    /// machine that lets it mount.
    pub fn tmpfs(opts: &str) -> Option<Mount> {
        if !root_or_skip("mounting a tmpfs") {
            return None;
        }
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("mnt");
        fs::create_dir(&dir).unwrap();
        let Some(mut m) = Mount::at(&["-t", "tmpfs", "-o", opts, "tmpfs"], &dir) else {
            eprintln!("skipping: cannot mount a tmpfs here");
            return None;
        };
        m._tmp = Some(tmp);
        Some(m)
    }

    /// A fresh btrfs of `size` (as truncate(1) takes it) on a loop device,
    /// mounted on a directory of its own; `None`, with the reason printed,
    /// unless this test runs as root with btrfs-progs on a machine that
    /// lets it mount.
    pub fn btrfs_loop(size: &str) -> Option<Mount> {
        if !root_or_skip("a btrfs loop device") {
            return None;
        }
        if !tool_or_skip("mkfs.btrfs", "btrfs-progs") {
            return None;
        }
        let tmp = tempfile::tempdir().unwrap();
        let img = tmp.path().join("fs.img");
        let dir = tmp.path().join("mnt");
        fs::create_dir(&dir).unwrap();
        let made = Command::new("truncate")
            .args(["-s", size])
            .arg(&img)
            .status()
            .is_ok_and(|s| s.success())
            && Command::new("mkfs.btrfs")
                .arg("-q")
                .arg(&img)
                .output()
                .is_ok_and(|o| o.status.success());
        let mounted = made
            .then(|| Mount::at(&["-o", "loop", img.to_str().unwrap()], &dir))
            .flatten();
        let Some(mut m) = mounted else {
            eprintln!("skipping: cannot make and mount a btrfs loop device here");
            return None;
        };
        m._tmp = Some(tmp);
        Some(m)
    }

    /// An overlayfs (a container's root filesystem) of a fresh lower and
    /// upper directory, mounted on a directory of its own; `None`, with
    /// the reason printed, unless this test runs as root on a machine that
    /// lets it mount one.
    pub fn overlay() -> Option<Mount> {
        if !root_or_skip("mounting an overlayfs") {
            return None;
        }
        let tmp = tempfile::tempdir().unwrap();
        let [lower, upper, work, dir] =
            ["lower", "upper", "work", "mnt"].map(|d| tmp.path().join(d));
        for d in [&lower, &upper, &work, &dir] {
            fs::create_dir(d).unwrap();
        }
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            upper.display(),
            work.display()
        );
        let Some(mut m) = Mount::at(&["-t", "overlay", "overlay", "-o", &opts], &dir) else {
            eprintln!("skipping: cannot mount an overlayfs here");
            return None;
        };
        m._tmp = Some(tmp);
        Some(m)
    }

    /// An [`Env`] whose root is `root` on this filesystem (not yet made).
    pub fn env(&self) -> Env {
        let mut env = Env::new();
        env.root = self.dir.join("root");
        env
    }

    /// Bytes in use on this filesystem, after syncing it so that what was
    /// just written is counted.
    pub fn used(&self) -> u64 {
        let _ = Command::new("sync").arg("-f").arg(&self.dir).status();
        let st = nix::sys::statvfs::statvfs(&self.dir).unwrap();
        (st.blocks() - st.blocks_free()) * st.fragment_size()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let gone = Command::new("umount")
            .arg(&self.dir)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !gone {
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// Fails unless `out`, from `stowage ARGS…` run against `env`, whose root
/// does not exist, is the refusal the spec fixes: exit 66 and one line on
/// stderr saying the root does not exist and naming it; and the root is
/// still not there afterwards.
pub fn assert_missing_root_refused(env: &Env, args: &[&str], out: &Output) {
    assert_eq!(code(out), Some(66), "{args:?}: {}", show(out));
    let err = stderr(out);
    assert!(
        err.contains("does not exist") && err.contains(env.root.to_str().unwrap()),
        "{args:?}: {}",
        show(out)
    );
    assert_eq!(err.lines().count(), 1, "{args:?}: {}", show(out));
    assert!(!env.root.exists(), "{args:?} created the root");
}

/// A pids cgroup (v1, or v2 where the controller is delegated) of this
/// test, admitting at most `max` tasks. Its name is unique, so tests that
/// run at once each get their own. Dropped, it waits (bounded) until the
/// processes it held are reaped and removes it; a test that leaves one of
/// them running fails there.
pub struct PidsCgroup(PathBuf);

impl PidsCgroup {
    /// `None`, with the reason printed, where this process may not make
    /// one (not root, no pids controller).
    pub fn new(max: u32) -> Option<PidsCgroup> {
        let name = format!("stowage-it.{}.{}", std::process::id(), fastrand::u32(..));
        for base in ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"] {
            let dir = Path::new(base).join(&name);
            if fs::create_dir(&dir).is_err() {
                continue;
            }
            if fs::write(dir.join("pids.max"), max.to_string()).is_ok() {
                return Some(PidsCgroup(dir));
            }
            let _ = fs::remove_dir(&dir);
        }
        eprintln!("skipping: no pids cgroup can be made here (needs root and the pids controller)");
        None
    }

    /// Admits at most `max` tasks from now on.
    pub fn set_max(&self, max: u32) {
        fs::write(self.0.join("pids.max"), max.to_string()).unwrap();
    }

    /// Makes `c` start inside the cgroup.
    pub fn enter(&self, c: &mut Command) {
        let procs = std::ffi::CString::new(
            self.0
                .join("cgroup.procs")
                .into_os_string()
                .into_encoded_bytes(),
        )
        .unwrap();
        // SAFETY: only open/write/close between fork and exec.
        unsafe {
            c.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
                Ok(())
            });
        }
    }

    /// `sh -c` that moves itself into the cgroup, then runs `cmd`.
    pub fn wrap(&self, cmd: &str) -> Command {
        let mut c = Command::new("sh");
        c.args([
            "-c",
            &format!(
                "echo $$ > '{}/cgroup.procs' && exec {cmd}",
                self.0.display()
            ),
        ]);
        c
    }
}

impl Drop for PidsCgroup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = fs::remove_dir(&self.0);
            return;
        }
        // The cgroup empties as its processes are reaped.
        wait_until("the test cgroup is empty", || {
            fs::remove_dir(&self.0).is_ok()
        });
    }
}

/// The number in environment variable `name`, or `default`.
pub fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A mebibyte, for sizes.
pub const MIB: u64 = 1 << 20;

/// The lines in a file, 0 while it does not exist.
pub fn lines(file: &Path) -> usize {
    fs::read_to_string(file).map_or(0, |t| t.lines().count())
}

/// This machine's host name, as a holder's record names it.
pub fn our_hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_owned()
}

/// The writer gate of the image whose encoded name is `enc`.
pub fn gate_file(env: &Env, enc: &str) -> PathBuf {
    env.root.join("locks/images").join(format!("{enc}.gate"))
}

/// Gives `p` to `uid`:`gid`.
pub fn chown(p: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
}

/// `stowage --root ROOT ARGS…` with the soft limit on open files lowered
/// to `soft` (the hard one kept), as `ulimit -Sn` in a shell does.
pub fn with_soft_files_limit(env: &Env, soft: u32, args: &[&str]) -> Command {
    let mut c = Command::new("sh");
    c.args([
        "-c",
        &format!("ulimit -Sn {soft} && exec \"$0\" \"$@\""),
        bin(),
    ]);
    c.arg("--root").arg(&env.root).args(args);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    c.stdin(Stdio::null());
    c
}

/// `setpriv` to run as nobody (65534), if this test runs as root and the
/// tool is there.
pub fn as_nobody() -> Option<Command> {
    if !root_or_skip("running as another user") {
        return None;
    }
    let ok = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipping: setpriv cannot switch to uid 65534 here");
        return None;
    }
    let mut c = Command::new("setpriv");
    c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"]);
    Some(c)
}

/// A fresh store for [`unprivileged`]: as root, its scratch directory (and
/// so the root inside it) is handed to uid 65534, searchable by all, so
/// that user makes the store and owns what it builds.
pub fn unprivileged_env() -> Env {
    let env = Env::new();
    if is_root() {
        use std::os::unix::fs::PermissionsExt;
        let t = env.tmp.path();
        fs::set_permissions(t, fs::Permissions::from_mode(0o755)).unwrap();
        chown(t, 65534, 65534);
    }
    env
}

/// `stowage ARGS…` as an unprivileged user: as root, uid 65534 through
/// setpriv (root needs no permission, so the case would not arise);
/// otherwise as ourselves.
pub fn unprivileged(env: &Env, args: &[&str]) -> Output {
    let mut c = if is_root() {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", bin()]);
        c
    } else {
        Command::new(bin())
    };
    c.arg("--root").arg(&env.root).args(args);
    c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
    c.stdin(Stdio::null());
    output(c)
}

/// [`Env::build`] as an [`unprivileged`] user: `sh -c SCRIPT` as the
/// writer of image NAME, which must exit 0.
pub fn unprivileged_build(env: &Env, name: &str, script: &str) {
    let out = unprivileged(env, &["exec", "--write", name, "--", "sh", "-c", script]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// What a test plants where stowage keeps a file or a directory of its own
/// (as another program, or another member of a store's group, could).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plant {
    Fifo,
    /// A symlink to somewhere outside the root.
    Symlink,
    Dir,
    Socket,
    /// A regular file of no bytes.
    Empty,
    /// A regular file its owner may not read or write (mode 000).
    Unreadable,
    /// A second name of a file outside the root (of the target, or of the
    /// file `sentinel` in a target directory).
    HardLink,
    /// A second name of an empty file outside the root (`empty` beside
    /// the target, or in a target directory; made if missing).
    EmptyHardLink,
}

impl Plant {
    pub const ALL: [Plant; 8] = [
        Plant::Fifo,
        Plant::Symlink,
        Plant::Dir,
        Plant::Socket,
        Plant::Empty,
        Plant::Unreadable,
        Plant::HardLink,
        Plant::EmptyHardLink,
    ];

    /// Those that are not regular files.
    pub const NOT_FILES: [Plant; 4] = [Plant::Fifo, Plant::Symlink, Plant::Dir, Plant::Socket];

    /// Plants it at `path`, where nothing is; a symlink points at `target`.
    pub fn at(self, path: &Path, target: &Path) {
        use std::os::unix::fs::PermissionsExt;
        match self {
            Plant::Fifo => {
                nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o666)).unwrap()
            }
            Plant::Symlink => std::os::unix::fs::symlink(target, path).unwrap(),
            Plant::Dir => fs::create_dir(path).unwrap(),
            Plant::Socket => drop(std::os::unix::net::UnixListener::bind(path).unwrap()),
            Plant::Empty => fs::write(path, "").unwrap(),
            Plant::Unreadable => {
                fs::write(path, "planted").unwrap();
                fs::set_permissions(path, fs::Permissions::from_mode(0o000)).unwrap();
            }
            Plant::HardLink => {
                let file = if target.is_dir() {
                    target.join("sentinel")
                } else {
                    target.to_owned()
                };
                fs::hard_link(file, path).unwrap()
            }
            Plant::EmptyHardLink => {
                let file = if target.is_dir() {
                    target.join("empty")
                } else {
                    target.with_file_name("empty")
                };
                fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&file)
                    .unwrap();
                fs::hard_link(file, path).unwrap()
            }
        }
    }

    /// Whether `path` still holds what this plants.
    pub fn is_at(self, path: &Path) -> bool {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let Ok(m) = fs::symlink_metadata(path) else {
            return false;
        };
        let t = m.file_type();
        match self {
            Plant::Fifo => t.is_fifo(),
            Plant::Symlink => t.is_symlink(),
            Plant::Dir => t.is_dir(),
            Plant::Socket => t.is_socket(),
            Plant::Empty => t.is_file() && m.len() == 0,
            Plant::Unreadable => t.is_file() && m.mode() & 0o777 == 0,
            Plant::HardLink | Plant::EmptyHardLink => t.is_file() && m.nlink() > 1,
        }
    }

    /// As messages say it ("a FIFO", …); regular files have no word.
    pub fn word(self) -> &'static str {
        match self {
            Plant::Fifo => "a FIFO",
            Plant::Symlink => "a symlink",
            Plant::Dir => "a directory",
            Plant::Socket => "a socket",
            Plant::Empty => "an empty file",
            Plant::Unreadable => "an unreadable file",
            Plant::HardLink | Plant::EmptyHardLink => "a hard link",
        }
    }
}

/// Every process of process group `pgid`: pid, state, kernel wait channel,
/// kernel stack (when readable) and command line.
pub fn group_waits(pgid: u32) -> String {
    let mut out = String::new();
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        if f.get(2) != Some(&pgid.to_string().as_str()) {
            continue;
        }
        let read = |n: &str| fs::read_to_string(e.path().join(n)).unwrap_or_default();
        let cmd = read("cmdline").replace('\0', " ");
        let stack: Vec<String> = read("stack").lines().map(|l| l.trim().to_owned()).collect();
        out.push_str(&format!(
            "  pid {} state {} wchan {} [{}]: {}\n",
            e.file_name().to_string_lossy(),
            f[0],
            read("wchan"),
            stack.join(" < "),
            cmd.chars().take(200).collect::<String>()
        ));
    }
    out
}

/// Where a GlusterFS brick's threads wait, if a brick runs here: a server
/// that stalls makes every client's call wait, and this says so.
pub fn brick_waits() -> String {
    let mut waits: std::collections::BTreeMap<String, u32> = Default::default();
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        if fs::read_to_string(e.path().join("comm"))
            .unwrap_or_default()
            .trim()
            != "glusterfsd"
        {
            continue;
        }
        for t in fs::read_dir(e.path().join("task"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let stat = fs::read_to_string(t.path().join("stat")).unwrap_or_default();
            let state = stat
                .rfind(')')
                .and_then(|c| stat[c + 2..].split(' ').next());
            let wchan = fs::read_to_string(t.path().join("wchan")).unwrap_or_default();
            *waits
                .entry(format!("{} {wchan}", state.unwrap_or("?")))
                .or_default() += 1;
        }
    }
    if waits.is_empty() {
        return String::new();
    }
    let each: Vec<String> = waits.iter().map(|(w, n)| format!("{n}× {w}")).collect();
    format!("  brick threads: {}\n", each.join(", "))
}

/// The `await=` lines of every lease: who waits for what, as lock-status
/// learns it.
pub fn waiter_lines(env: &Env) -> Vec<String> {
    fs::read_dir(env.root.join("locks/leases"))
        .map(|d| {
            d.flatten()
                .flat_map(|e| {
                    fs::read_to_string(e.path())
                        .unwrap_or_default()
                        .lines()
                        .filter(|l| l.starts_with("await="))
                        .map(str::to_owned)
                        .collect::<Vec<_>>()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// `cp -a FROM TO`: a store copied as its users copy one (extended attributes kept).
pub fn cp_a(from: &Path, to: &Path) {
    let out = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .output()
        .unwrap();
    assert!(out.status.success(), "cp -a: {}", show(&out));
}

/// An outside program (python3's sqlite3) holding the catalog of `env` in an exclusive
/// transaction, from when this returns until it is killed (or 30 s). Needs python3.
pub fn hold_catalog(env: &Env) -> Bg {
    let script = format!(
        "import sqlite3, time, pathlib\n\
         c = sqlite3.connect('{db}', isolation_level=None)\n\
         c.execute('BEGIN EXCLUSIVE')\n\
         pathlib.Path('{started}').touch()\n\
         time.sleep(30)\n",
        db = env.root.join("stowage.db").display(),
        started = env.sentinel("catalog-held").display()
    );
    let mut c = Command::new("python3");
    c.args(["-c", &script]);
    let holder = Bg::from_command(c);
    wait_for_file(&env.sentinel("catalog-held"));
    holder
}

/// CRC-32 (IEEE), bit by bit: the check of an older release's token
/// and of each record and class limits slot (its `crc=` line).
pub fn token_crc(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}
