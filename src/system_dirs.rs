//! Directories that are no place for a store: the filesystem's root, homes, the operating system's
//! trees, builders' storage. Judged by path (as written and as resolved), and where a store would
//! take a directory by what it holds.
//!
//! - An images directory is judged so wherever one is taken: by `init`, and by a repair that would
//!   claim one or adopt its trees (adopted, a tree is one `gc` from deletion).
//! - Nothing here opens a directory to use it: these are refusals, asked before.

use std::path::{Path, PathBuf};

/// Why `dir` is no images directory, if so: judged as written without `.` and `..`, and as the
/// kernel resolves it (`/lib` is `/usr/lib` on many systems); with `contents` by what it holds too.
pub fn not_for_images(dir: &Path, contents: bool) -> Option<String> {
    [lexical(dir), resolved(dir)]
        .iter()
        .find_map(|d| no_images_dir(d, contents))
}

/// [`not_for_images`] of a directory a store's configuration names but the store never claimed:
/// by its path, and by what no store's images directory holds (a system tree, a builder's
/// storage). Loose files are left out: an images directory in use may have gathered some.
pub fn not_for_images_kept(dir: &Path) -> Option<String> {
    [lexical(dir), resolved(dir)].iter().find_map(|d| {
        no_images_dir(d, false)
            .or_else(|| like_the_system(d).map(|held| format!("a system tree (it holds {held})")))
            .or_else(|| charliecloud_storage(d).then(|| "a Charliecloud storage directory".into()))
    })
}

/// Why `dir` (absolute, without `.` or `..`) is no images directory, if so: by its path, and with
/// `contents` by what it holds (an images directory holds image trees only).
fn no_images_dir(dir: &Path, contents: bool) -> Option<String> {
    let what = if dir == Path::new("/") {
        "the root of the filesystem".to_owned()
    } else if dir.parent() == Some(Path::new("/")) && !dir.exists() {
        "a new directory at the top of the filesystem (is a variable in its path unset?)".to_owned()
    } else if is_home(dir) {
        "a home directory".to_owned()
    } else if of_the_system(dir) {
        "a directory of the operating system".to_owned()
    } else if dir.parent() == Some(Path::new("/")) {
        // /scratch holds its users' directories, /nix its store, /efi a boot loader's.
        "a directory at the top of the filesystem, where the system's and its users' directories are".to_owned()
    } else if !contents {
        return None;
    } else if let Some(held) = like_the_system(dir) {
        format!("a system tree (it holds {held}), not a directory of image trees")
    } else if charliecloud_storage(dir) {
        let img = dir.join("img");
        let img = img.display();
        format!("a Charliecloud storage directory: its images are in {img}")
    } else if let Some(f) = files_in(dir) {
        format!("a directory that holds files ({f}), not image trees only")
    } else {
        return None;
    };
    Some(what)
}

/// Why `dir` is no place for stowage's files, and what to give instead: the filesystem's root, a
/// home, the system's, or a builder's storage (ch-image would stop).
pub fn no_root_reason(dir: &Path) -> Option<(String, String)> {
    let own = "give a directory of the store's own (a new or empty one)".to_owned();
    [lexical(dir), resolved(dir)].iter().find_map(|d| {
        Some(if d == Path::new("/") {
            ("the root of the filesystem".to_owned(), own.clone())
        } else if is_home(d) {
            ("a home directory".to_owned(), own.clone())
        } else if of_the_system(d) {
            ("a directory of the operating system".to_owned(), own.clone())
        } else if let Some(held) = like_the_system(d) {
            (format!("a system tree (it holds {held})"), own.clone())
        } else if d.parent() == Some(Path::new("/")) && d.exists() {
            let what = "a directory at the top of the filesystem, where the system's and its users' directories are";
            (what.to_owned(), "give a directory of the store's own below it".to_owned())
        } else if std::fs::read_dir(d.join("trash")).is_ok_and(|mut t| t.next().is_some()) {
            let what = "a directory whose 'trash' holds what stowage did not put there (gc would delete it)";
            (what.to_owned(), own.clone())
        } else if charliecloud_storage(d) {
            let img = d.join("img");
            let img = img.display();
            let what = "a Charliecloud storage directory, which ch-image uses only with nothing else in it";
            let tail = format!("give the store a root of its own and --images-dir {img}");
            (what.to_owned(), tail)
        } else {
            return None;
        })
    })
}

/// `dir` with `.` and `..` taken out as written (`/tmp/../usr/x` is `/usr/x`).
fn lexical(dir: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::from("/");
    for c in dir.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// `dir` as the kernel resolves it: its deepest existing ancestor resolved (links followed), the
/// rest as written; as written if none resolves.
pub fn resolved(dir: &Path) -> PathBuf {
    let mut rest = Vec::new();
    let mut at = dir.to_owned();
    loop {
        if let Ok(real) = std::fs::canonicalize(&at) {
            return lexical(&rest.iter().rev().fold(real, |p: PathBuf, n| p.join(n)));
        }
        match (at.file_name().map(ToOwned::to_owned), at.pop()) {
            (Some(name), true) => rest.push(name),
            _ => return lexical(dir),
        }
    }
}

/// The operating system's trees (the Filesystem Hierarchy Standard's, and the package stores of
/// Nix and Guix): nothing in them is an image. `/dev/shm` is a tmpfs for anyone's files.
const SYSTEM_TREES: &[&str] = &[
    "/bin", "/boot", "/dev", "/efi", "/etc", "/gnu", "/lib", "/lib32", "/lib64", "/libx32", "/nix",
    "/proc", "/sbin", "/sys", "/usr",
];

/// Directories of the operating system that hold others' directories: a directory below one may be
/// an images directory (`/var/tmp/me/img`, `/srv/images`), never the directory itself.
const SYSTEM_DIRS: &[&str] = &[
    "/dev/shm",
    "/run/user",
    "/var/cache",
    "/var/lib",
    "/var/local",
    "/var/log",
    "/var/opt",
    "/var/spool",
    "/var/tmp",
];

/// Names a system tree holds at its top (`/usr`, `/usr/local`, `/opt/tool`, a chroot's `/`).
const SYSTEM_NAMES: &[&str] = &[
    "bin", "sbin", "lib", "lib64", "libexec", "include", "share", "etc", "usr", "var",
];

/// Whether `dir` is the system's: its trees would be taken for images, one `gc` from deletion.
fn of_the_system(dir: &Path) -> bool {
    let shm = dir.starts_with("/dev/shm") && dir != Path::new("/dev/shm");
    (!shm && SYSTEM_TREES.iter().any(|t| dir.starts_with(t)))
        || SYSTEM_DIRS.iter().any(|t| dir == Path::new(t))
}

/// The names of a system tree `dir` holds at its top ("bin, lib, share"), if two or more.
fn like_the_system(dir: &Path) -> Option<String> {
    let held: Vec<&str> = SYSTEM_NAMES
        .iter()
        .copied()
        .filter(|n| dir.join(n).symlink_metadata().is_ok_and(|m| m.is_dir()))
        .collect();
    (held.len() >= 2).then(|| held.join(", "))
}

/// Whether `dir` is this user's home or any `/etc/passwd` user's (read directly: no name service),
/// each as written and as resolved (`/home` is a link on many clusters).
fn is_home(dir: &Path) -> bool {
    let is = |h: &Path| h.as_os_str().len() > 1 && (h == dir || resolved(h) == dir);
    std::env::var_os("HOME").is_some_and(|h| is(Path::new(&h)))
        || std::fs::read_to_string("/etc/passwd").is_ok_and(|t| {
            t.lines()
                .filter_map(|l| l.split(':').nth(5))
                .any(|h| is(Path::new(h)))
        })
}

fn files_in(dir: &Path) -> Option<String> {
    std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        let t = e.file_type().ok()?;
        (!name.starts_with('.') && !t.is_dir()).then_some(name)
    })
}

/// Whether `dir` is ch-image's storage directory, which ch-image refuses to use with other files in
/// it (stowage's, say).
fn charliecloud_storage(dir: &Path) -> bool {
    ["bucache", "dlcache", "ulcache"]
        .iter()
        .any(|d| dir.join(d).is_dir())
        && dir.join("img").is_dir()
}
