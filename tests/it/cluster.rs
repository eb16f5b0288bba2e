//! Hosts that share a store on a real shared filesystem: a GlusterFS
//! volume served on this machine (scripts/gluster), each host its own
//! mount, UTS and pid namespaces with its own FUSE client at the same path.
//! Locks exclude at the server; killing a host (its client included) is a
//! host crash.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::*;

fn script() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/gluster")
}

fn gluster<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut c = Command::new("bash");
    c.arg(script()).args(args);
    output(c)
}

/// A volume shared by `n` hosts, with a directory of this test's own on it.
pub struct Cluster {
    /// The test's directory on the volume, as every host names it.
    pub dir: PathBuf,
    pub hosts: Vec<Host>,
}

pub struct Host {
    pub name: String,
    pid: u32,
}

impl Cluster {
    /// `None`, after saying why, where no volume is up here.
    pub fn start(test: &str, n: usize) -> Option<Cluster> {
        let st = gluster(["status"]);
        if st.status.code() != Some(0) {
            let why = stderr(&st);
            if std::env::var_os("STOWAGE_GLUSTER_REQUIRED").is_some() {
                panic!("no GlusterFS volume: {why}");
            }
            eprintln!("skipped: no GlusterFS volume ({})", why.trim());
            return None;
        }
        let info = String::from_utf8_lossy(&gluster(["info"]).stdout).into_owned();
        let mount = info
            .lines()
            .find_map(|l| l.strip_prefix("mount="))
            .expect("the volume's mount point")
            .to_owned();
        let tag: String = format!("{}-{}", test, std::process::id())
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '-'
                }
            })
            .take(60)
            .collect();
        let hosts: Vec<Host> = (0..n).map(|i| Host::start(&format!("{tag}-{i}"))).collect();
        let dir = Path::new(&mount).join(&tag);
        let out = hosts[0].run(["mkdir", "-p", dir.to_str().unwrap()]);
        assert!(out.status.success(), "{}", show(&out));
        Some(Cluster { dir, hosts })
    }

    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i]
    }

    /// A new host in place of host `i` (crashed), named anew.
    pub fn replace(&self, i: usize, generation: u64) -> Host {
        let base = self.hosts[i]
            .name
            .rsplit_once("-g")
            .map_or(self.hosts[i].name.as_str(), |(b, _)| b);
        Host::start(&format!("{base}-g{generation}"))
    }

    /// The store's root on the volume.
    pub fn root(&self) -> PathBuf {
        self.dir.join("root")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(h) = self.hosts.iter().find(|h| h.pid != 0) {
            quietly(h.cmd(["rm", "-rf", self.dir.to_str().unwrap()]));
        }
    }
}

impl Host {
    fn start(name: &str) -> Host {
        let out = gluster(["host-start", name]);
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
        let pid = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        Host {
            name: name.into(),
            pid,
        }
    }

    /// A command run inside this host.
    pub fn cmd<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut c = Command::new("bash");
        c.arg(script())
            .args(["host-run", &self.name, "-C", "/", "--"])
            .args(args);
        c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
        c
    }

    /// `stowage --root ROOT ARGS…` inside this host.
    pub fn stowage<I, S>(&self, root: &Path, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut c = self.cmd([bin()]);
        c.arg("--root").arg(root).args(args);
        c
    }

    pub fn run<I, S>(&self, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        output(self.cmd(args))
    }

    /// Runs stowage inside this host to completion.
    pub fn stowage_run<I, S>(&self, root: &Path, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        output(self.stowage(root, args))
    }

    /// Drops the host's connection to the server for a moment (a network
    /// blip): the server releases its client's locks; the client connects
    /// again by itself, its files reopened without them.
    pub fn disconnect(&self) {
        let out = gluster(["host-disconnect", &self.name]);
        assert!(out.status.success(), "{}", show(&out));
    }

    /// Kills the whole host, its client included; returns once the server
    /// has dropped its connection (and so its locks).
    pub fn crash(&mut self) {
        let out = gluster(["host-crash", &self.name]);
        assert!(out.status.success(), "{}", show(&out));
        self.pid = 0;
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if self.pid != 0 {
            let mut c = Command::new("bash");
            c.arg(script()).args(["host-crash", &self.name]);
            if !quietly(c) {
                eprintln!("host {} may be left running", self.name);
            }
        }
    }
}

/// A client of the volume mounted in the test's own namespace, serving only
/// a subdirectory of the test's directory: its process can be stopped, as a
/// server that does not answer. Continued and unmounted on drop.
pub struct Client {
    at: PathBuf,
    pid: i32,
}

impl Cluster {
    /// Mounts the test's subdirectory `sub` (made if missing) at `at`.
    pub fn client_at(&self, sub: &str, at: &Path) -> Client {
        let info = String::from_utf8_lossy(&gluster(["info"]).stdout).into_owned();
        let value = |k: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(k))
                .unwrap()
                .to_owned()
        };
        let (volume, server) = (value("volume="), value("server="));
        let out = self
            .host(0)
            .run(["mkdir", "-p", self.dir.join(sub).to_str().unwrap()]);
        assert!(out.status.success(), "{}", show(&out));
        let tag = self.dir.file_name().unwrap().to_str().unwrap();
        let source = format!("{server}:/{volume}/{tag}/{sub}");
        let st = Command::new("mount")
            .args(["-t", "glusterfs", &source])
            .arg(at)
            .status();
        assert!(st.is_ok_and(|s| s.success()), "mount {source}");
        let pgrep = Command::new("pgrep")
            .args(["-f", &format!("glusterfs.*{}", at.display())])
            .output()
            .unwrap();
        let pid = String::from_utf8_lossy(&pgrep.stdout)
            .lines()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        Client {
            at: at.to_owned(),
            pid,
        }
    }
}

impl Client {
    /// Stops the client: every request through the mount waits.
    pub fn stop(&self) {
        unsafe { libc::kill(self.pid, libc::SIGSTOP) };
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        unsafe { libc::kill(self.pid, libc::SIGCONT) };
        let mut c = Command::new("umount");
        c.arg("-l").arg(&self.at);
        quietly(c);
    }
}

/// Runs `c` within [`PATIENCE`] without ever panicking, for drops: a drop
/// that panics while a failed test unwinds aborts the whole test binary.
/// Whether it ran and succeeded; a command still running is killed.
fn quietly(mut c: Command) -> bool {
    use std::os::unix::process::CommandExt;
    c.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0);
    let Ok(mut child) = c.spawn() else {
        return false;
    };
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return st.success(),
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            _ => {
                eprintln!(
                    "left behind after {PATIENCE:?}:\n{}",
                    group_waits(child.id())
                );
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
                return false;
            }
        }
    }
}
