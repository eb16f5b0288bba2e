//! Filesystems: how far a lock reaches, per statfs(2) and mountinfo; home of the filesystem table.
//!
//! - Local filesystems (`LOCAL`) show every lock in this host's lock table.
//! - NFS, Lustre and BeeGFS keep locks cluster-wide only with the right mount options or client
//!   configuration ([`lock_reach_with`]).
//! - Anything else is treated as shared: locks reach other hosts, the table does not show them.

use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::Path;

/// A filesystem, as statfs(2) names it.
#[derive(Debug, Clone)]
pub struct Filesystem {
    pub name: String,
    /// True when every lock on it is visible in this host's lock table.
    pub local: bool,
    /// True when a lock query (`F_OFD_GETLK`) sees every host's flocks, so a look need not take a
    /// lock: GlusterFS (its client sends every query to the server), as the mount table names it.
    /// Not NFS: under a write delegation the client answers a query itself and misses flocks.
    pub queries_see_flocks: bool,
}

/// Filesystems whose locks this host's lock table shows completely.
const LOCAL: &[&str] = &[
    "tmpfs", "ext4", "xfs", "btrfs", "zfs", "overlay", "f2fs", "ramfs", "reiserfs",
];

pub fn filesystem(path: &Path) -> io::Result<Filesystem> {
    let st = nix::sys::statfs::statfs(path).map_err(io::Error::from)?;
    #[allow(clippy::unnecessary_cast)]
    let name = match std::env::var_os(crate::env::DEBUG_FILESYSTEM) {
        Some(name) => name.to_string_lossy().into_owned(),
        None => name_of_magic(st.filesystem_type().0 as i64),
    };
    Ok(Filesystem {
        local: LOCAL.contains(&name.as_str()),
        name,
        queries_see_flocks: false,
    })
}

/// The name of the filesystem whose statfs(2) magic is `magic` (local ones as in [`LOCAL`]).
fn name_of_magic(magic: i64) -> String {
    let name = match magic {
        0x0102_1994 => "tmpfs",
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x2FC1_2FC1 => "zfs",
        0x794C_7630 => "overlay",
        0xF2F5_2010 => "f2fs",
        0x8584_58F6 => "ramfs",
        0x5265_4973 => "reiserfs",
        0x6969 => "nfs",
        0x0BD0_0BD0 => "lustre",
        0x4750_4653 => "gpfs",
        0xFF53_4D42 => "cifs",
        0xFE53_4D42 => "smb2",
        0x00C3_6400 => "ceph",
        0x1983_0326 => "beegfs",
        0x6573_5546 => "fuse",
        0x0000_564C => "ncp",
        0x7366_7673 | 0x5346_414F => "afs",
        _ => return format!("unknown (0x{magic:x})"),
    };
    name.to_owned()
}

/// A mount, from /proc/self/mountinfo.
#[derive(Debug, Clone)]
pub struct Mount {
    pub mount_point: std::path::PathBuf,
    pub fstype: String,
    pub source: String,
    /// Per-mount and superblock options together.
    pub options: Vec<String>,
}

/// The mount that holds `path` (the longest mount point that contains it).
pub fn mount_of(path: &Path) -> Option<Mount> {
    let path = fs::canonicalize(path).ok()?;
    let text = fs::read_to_string(mountinfo_path()).ok()?;
    parse_mountinfo(&text)
        .into_iter()
        .filter(|m| path.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.as_os_str().len())
}

/// A mount point (or another field) as /proc/self/mountinfo writes it (`\ooo` escapes), as a path.
pub(crate) fn unescaped(field: &str) -> std::path::PathBuf {
    let (b, mut out, mut i) = (field.as_bytes(), Vec::new(), 0);
    while i < b.len() {
        let oct = b
            .get(i + 1..i + 4)
            .and_then(|o| std::str::from_utf8(o).ok());
        match oct.map(|o| u8::from_str_radix(o, 8)) {
            Some(Ok(c)) if b[i] == b'\\' => (out.push(c), i += 4),
            _ => (out.push(b[i]), i += 1),
        };
    }
    std::path::PathBuf::from(OsString::from_vec(out))
}

fn parse_mountinfo(text: &str) -> Vec<Mount> {
    // id parent maj:min root mount-point options [optional...] - fstype source super-options
    let mount = |line: &str| {
        let (left, right) = line.split_once(" - ")?;
        let l: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        if l.len() < 6 || r.len() < 3 {
            return None;
        }
        let options = l[5].split(',').chain(r[2].split(','));
        Some(Mount {
            mount_point: unescaped(l[4]),
            fstype: r[0].to_owned(),
            source: unescaped(r[1]).to_string_lossy().into_owned(),
            options: options.map(str::to_owned).collect(),
        })
    };
    text.lines().filter_map(mount).collect()
}

/// Whether locks on a shared filesystem exclude other hosts, as its mount and client settings tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// Nothing says otherwise (a local filesystem, or a shared one set for cluster-wide locks).
    ClusterWide,
    /// Locks exclude only processes on the same host: refused (exit 69).
    NodeLocal { why: String, advice: String },
    /// Could not be told (e.g. Lustre mounted without `flock` or `localflock`, whose default
    /// differs between releases): doctor says so and offers the two-host probe.
    Unknown { why: String },
}

/// How far locks on the filesystem of `path` reach, the mount looked at, and the filesystem of
/// `path` itself when it exists: one statfs(2); mountinfo only on NFS, Lustre and BeeGFS.
pub fn lock_reach_with(path: &Path) -> (Reach, Option<Mount>, Option<Filesystem>) {
    let Some((at, fs)) = nearest(path) else {
        return (Reach::ClusterWide, None, None);
    };
    let mount = is_shared_kind(&fs.name).then(|| mount_of(at)).flatten();
    let reach = reach_with(&fs, mount.as_ref());
    (reach, mount, (at == path).then_some(fs))
}

/// The filesystem of `path`, or of its nearest existing ancestor, with where it was found.
pub fn nearest(path: &Path) -> Option<(&Path, Filesystem)> {
    let (at, fs) = path.ancestors().find_map(|p| match filesystem(p) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        other => Some((p, other)),
    })?;
    Some((at, fs.ok()?))
}

/// [`lock_reach_with`] for a root on device `dev`, from the mount table alone (a statfs is a
/// request to the server on NFS). `None` where the table lists no mount of that device (a btrfs
/// subvolume) or no filesystem this knows, or a test names one: the caller asks statfs then. The
/// table is read only up to the device's first mount: on a host with thousands it costs ms.
pub fn lock_reach_of_device(dev: u64) -> Option<(Reach, Option<Mount>, Option<Filesystem>)> {
    if std::env::var_os(crate::env::DEBUG_FILESYSTEM).is_some() {
        return None;
    }
    let want = format!("{}:{}", libc::major(dev), libc::minor(dev));
    use std::io::BufRead;
    let table = io::BufReader::new(fs::File::open(mountinfo_path()).ok()?);
    let mut lines = table.lines().map_while(Result::ok);
    let line = lines.find(|l| l.split(' ').nth(2) == Some(&want))?;
    let mount = parse_mountinfo(&line).into_iter().next()?;
    // Named as statfs names them: ext2/3/4 share one magic, NFS 3 and 4 too.
    let name = match mount.fstype.as_str() {
        "ext2" | "ext3" => "ext4",
        "nfs4" => "nfs",
        // Its FUSE client (statfs: "fuse") takes flock and fcntl locks on the bricks: cluster-wide.
        "fuse.glusterfs" => "glusterfs",
        other => other,
    };
    let local = LOCAL.contains(&name);
    if !local && !is_shared_kind(name) && name != "glusterfs" {
        return None;
    }
    let fs = Filesystem {
        name: name.to_owned(),
        local,
        queries_see_flocks: name == "glusterfs"
            && std::env::var_os(crate::env::DEBUG_MOUNTINFO).is_none(),
    };
    let reach = reach_with(&fs, Some(&mount));
    Some((reach, is_shared_kind(name).then_some(mount), Some(fs)))
}

fn mountinfo_path() -> std::path::PathBuf {
    std::env::var_os(crate::env::DEBUG_MOUNTINFO)
        .map_or_else(|| "/proc/self/mountinfo".into(), std::path::PathBuf::from)
}

/// The shared filesystems whose mount options (or client configuration) decide how far locks reach.
fn is_shared_kind(name: &str) -> bool {
    matches!(name, "nfs" | "lustre" | "beegfs")
}

/// How far locks reach on `fs`, mounted as `mount` (if it could be read).
fn reach_with(fs: &Filesystem, mount: Option<&Mount>) -> Reach {
    if !is_shared_kind(&fs.name) {
        return Reach::ClusterWide;
    }
    let Some(m) = mount else {
        return Reach::Unknown {
            why: format!("{} mount options could not be read", fs.name),
        };
    };
    match fs.name.as_str() {
        "nfs" => nfs_reach(&m.options),
        "lustre" => lustre_reach(&m.options),
        _ => beegfs_reach(&m.options, |p| fs::read_to_string(p).ok()),
    }
}

/// NFS: `nolock` and `local_lock=flock|posix|all` keep locks on the client. Even `posix` is
/// unsafe: the client revalidates a file's cached pages only when a lock on that file goes to the
/// server, so with SQLite's locks local a process could write on stale database pages.
fn nfs_reach(options: &[String]) -> Reach {
    let local_only =
        |o: &&String| *o == "nolock" || (o.starts_with("local_lock=") && *o != "local_lock=none");
    let bad = options.iter().filter(local_only).map(String::as_str);
    let bad: Vec<&str> = bad.collect();
    if bad.is_empty() {
        return Reach::ClusterWide;
    }
    Reach::NodeLocal {
        why: format!(
            "NFS mounted with {}: locks stay local to each client",
            bad.join(",")
        ),
        advice: "remount without it".into(),
    }
}

/// Lustre: `flock` gives cluster-wide flocks, `localflock` node-local ones, `noflock` none. With
/// none of them the default depends on the Lustre release.
fn lustre_reach(options: &[String]) -> Reach {
    let has = |o: &str| options.iter().any(|x| x == o);
    let node_local = |why: &str| Reach::NodeLocal {
        why: why.into(),
        advice: "remount with -o flock (cluster-wide locks)".into(),
    };
    if has("localflock") {
        node_local(
            "Lustre mounted with localflock: flocks exclude only processes on the same client node",
        )
    } else if has("noflock") {
        node_local("Lustre mounted with noflock: flock is disabled")
    } else if has("flock") {
        Reach::ClusterWide
    } else {
        Reach::Unknown {
            why: "Lustre mounted without 'flock' or 'localflock': whether flocks reach other nodes depends on the Lustre release".into(),
        }
    }
}

/// BeeGFS: flocks are cluster-wide only with `tuneUseGlobalFileLocks = true` in the client
/// configuration (the mount's `cfgFile=`, else /etc/beegfs/beegfs-client.conf).
fn beegfs_reach(options: &[String], read: impl Fn(&Path) -> Option<String>) -> Reach {
    let conf = options
        .iter()
        .find_map(|o| o.strip_prefix("cfgFile="))
        .unwrap_or("/etc/beegfs/beegfs-client.conf");
    let Some(text) = read(Path::new(conf)) else {
        return Reach::Unknown {
            why: format!(
                "BeeGFS client configuration {conf} could not be read (tuneUseGlobalFileLocks decides whether flocks reach other nodes)"
            ),
        };
    };
    let global = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter_map(|l| l.split_once('='))
        .rfind(|(k, _)| k.trim() == "tuneUseGlobalFileLocks")
        .map(|(_, v)| v.trim().eq_ignore_ascii_case("true"));
    if global == Some(true) {
        Reach::ClusterWide
    } else {
        Reach::NodeLocal {
            why: format!(
                "BeeGFS with tuneUseGlobalFileLocks={} ({conf}): flocks exclude only processes on the same client node",
                global.map_or("false (the default)", |_| "false")
            ),
            advice: format!("set tuneUseGlobalFileLocks = true in {conf} and remount"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mountinfo() {
        let m = parse_mountinfo(
            "36 35 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 - nfs4 server:/export rw,vers=4.2,local_lock=flock\n\
             22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n",
        );
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].mount_point, Path::new("/mnt/with space"));
        assert_eq!(m[0].fstype, "nfs4");
        assert!(m[0].options.contains(&"local_lock=flock".to_owned()));
        assert!(m[0].options.contains(&"noatime".to_owned()));
        assert!(mount_of(Path::new("/")).is_some());
    }

    #[test]
    fn only_mounts_that_keep_flock_local_are_unsafe() {
        let opts = |o: &str| o.split(',').map(str::to_owned).collect::<Vec<_>>();
        for (options, reach) in [
            ("rw,nolock", "node-local"),
            ("rw,vers=3,local_lock=flock", "node-local"),
            ("rw,local_lock=posix", "node-local"),
            ("local_lock=all,hard", "node-local"),
            ("rw,vers=4.2,local_lock=none", "cluster-wide"),
            ("rw,lock,hard", "cluster-wide"),
            ("rw,nolocks_are_not_a_thing", "cluster-wide"),
        ] {
            assert_eq!(kind(nfs_reach(&opts(options))), reach, "{options}");
        }
        // A local filesystem is never NFS, whatever its options.
        assert_eq!(lock_reach_with(Path::new("/")).0, Reach::ClusterWide);
    }

    /// Lines as /proc/self/mountinfo shows such mounts.
    const FIXTURE: &str = "\
101 30 0:60 / /lustre/scratch rw,relatime - lustre 10.0.0.1@o2ib:/scratch rw,localflock,lazystatfs\n\
102 30 0:61 / /lustre/work rw,relatime - lustre 10.0.0.1@o2ib:/work rw,flock,lazystatfs\n\
103 30 0:62 / /lustre/old rw,relatime - lustre 10.0.0.1@o2ib:/old rw,noflock\n\
104 30 0:63 / /lustre/plain rw,relatime - lustre 10.0.0.1@o2ib:/plain rw,lazystatfs\n\
105 30 0:64 / /mnt/beegfs rw,relatime - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf,_netdev\n\
106 30 0:65 / /mnt/nfs rw,relatime - nfs4 srv:/export rw,vers=4.2,local_lock=none\n";

    /// The options of the FIXTURE mount at `mount_point`.
    fn options_at(mount_point: &str) -> Vec<String> {
        let mut mounts = parse_mountinfo(FIXTURE).into_iter();
        let m = mounts.find(|m| m.mount_point == Path::new(mount_point));
        m.unwrap().options
    }

    /// What kind of reach `r` is, without its explanation.
    fn kind(r: Reach) -> &'static str {
        match r {
            Reach::ClusterWide => "cluster-wide",
            Reach::NodeLocal { .. } => "node-local",
            Reach::Unknown { .. } => "unknown",
        }
    }

    #[test]
    fn lustre_mount_options_decide_the_reach_of_locks() {
        for (mount_point, reach) in [
            ("/lustre/scratch", "node-local"),
            ("/lustre/old", "node-local"),
            ("/lustre/work", "cluster-wide"),
            ("/lustre/plain", "unknown"),
        ] {
            assert_eq!(kind(lustre_reach(&options_at(mount_point))), reach);
        }
        assert_eq!(nfs_reach(&options_at("/mnt/nfs")), Reach::ClusterWide);
    }

    #[test]
    fn beegfs_client_configuration_decides_the_reach_of_locks() {
        let options = options_at("/mnt/beegfs");
        let reach = |text: &'static str| {
            kind(beegfs_reach(&options, |p: &Path| {
                assert_eq!(p, Path::new("/etc/beegfs/beegfs-client.conf"));
                Some(text.to_owned())
            }))
        };
        // The default is node-local.
        assert_eq!(reach("sysMgmtdHost = mgmt\n"), "node-local");
        assert_eq!(reach("tuneUseGlobalFileLocks = false\n"), "node-local");
        assert_eq!(
            reach(
                "# tuneUseGlobalFileLocks = false\ntuneUseGlobalFileLocks   = true  # cluster-wide\n"
            ),
            "cluster-wide"
        );
        assert_eq!(kind(beegfs_reach(&options, |_| None)), "unknown");
    }
}
