//! What is found where stowage keeps a file of its own: a regular file, or
//! something planted there (a FIFO, a symlink, a directory, a socket, a
//! device) by another program or another member of the store's group.
//!
//! - **Opened so that its type cannot block or redirect the open**:
//!   `O_NOFOLLOW|O_NONBLOCK|O_NOCTTY|O_CLOEXEC` ([`FLAGS`]). A FIFO cannot
//!   hang the open, a symlink is refused (`ELOOP`), a socket cannot be
//!   opened (`ENXIO`), a directory cannot be opened for writing (`EISDIR`),
//!   a terminal never becomes the command's.
//! - **Then used only as a regular file.** What the open refuses, and what
//!   `fstat` finds to be anything else, is a [`NotAFile`] error that keeps
//!   the file's path: whoever reports it names the file that is wrong, not
//!   the one it was looking for (an image's gate, not its lock file).
//! - **A valid record read proves a regular file**: a FIFO cannot `pread`,
//!   a directory or socket cannot be opened read-write. Where a file's
//!   record was read, the `fstat` is spared (it is a round trip on NFS).
//! - **Nothing planted is deleted**: `doctor --repair` renames it aside
//!   (`NAME.planted-TIME`), and every refusal says so.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// How every file under the root is opened, whatever else is asked.
pub const FLAGS: libc::c_int =
    libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;

/// What every refusal tells the user to do.
pub const FIX: &str = "'stowage doctor --repair' sets it aside (renamed, never deleted)";

/// A file of the layout that is not a regular file.
#[derive(Debug)]
pub struct NotAFile {
    /// The path as the caller named it (an entry's name when opened
    /// through a directory's descriptor, until [`at`] names it in full).
    pub path: PathBuf,
    /// "a FIFO", "a symlink", …
    pub kind: &'static str,
}

impl std::fmt::Display for NotAFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is {}, not a regular file (not made by stowage); {FIX}",
            self.path.display(),
            self.kind
        )
    }
}

impl std::error::Error for NotAFile {}

/// What a file type (`st_mode & S_IFMT`) is called; `None` for a regular
/// file.
pub fn kind_of_mode(mode: u32) -> Option<&'static str> {
    match mode & libc::S_IFMT {
        libc::S_IFREG => None,
        libc::S_IFIFO => Some("a FIFO"),
        libc::S_IFLNK => Some("a symlink"),
        libc::S_IFDIR => Some("a directory"),
        libc::S_IFSOCK => Some("a socket"),
        libc::S_IFCHR | libc::S_IFBLK => Some("a device"),
        _ => Some("not a regular file"),
    }
}

/// The kind of a file an open refused for its type (`ELOOP`, `ENXIO`,
/// `EISDIR`), asked of the entry itself without following it; `None` for
/// any other failure.
fn kind_refused(path: &Path, e: &io::Error) -> Option<&'static str> {
    let by_errno = match e.raw_os_error()? {
        libc::ELOOP => "a symlink",
        libc::EISDIR => "a directory",
        libc::ENXIO => "a socket",
        _ => return None,
    };
    use std::os::unix::fs::MetadataExt;
    Some(
        std::fs::symlink_metadata(path)
            .ok()
            .and_then(|m| kind_of_mode(m.mode()))
            .unwrap_or(by_errno),
    )
}

/// An open's failure, with a refusal for the file's type turned into
/// [`NotAFile`] at `path`; any other failure as it was (its errno kept:
/// callers tell a missing file or a read-only filesystem by it).
pub fn refused(path: &Path, e: io::Error) -> io::Error {
    match kind_refused(path, &e) {
        Some(kind) => not_a_file(path, kind),
        None => e,
    }
}

/// The error for `path`, found to be `kind`.
pub fn not_a_file(path: &Path, kind: &'static str) -> io::Error {
    io::Error::other(NotAFile {
        path: path.to_owned(),
        kind,
    })
}

/// Fails unless `file` (opened from `path`) is a regular file: one `fstat`.
pub fn check(path: &Path, file: &File) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    match kind_of_mode(file.metadata()?.mode()) {
        None => Ok(()),
        Some(kind) => Err(not_a_file(path, kind)),
    }
}

/// [`check`] for what an `fstat` already said (`st_mode`).
pub fn check_mode(path: &Path, mode: u32) -> io::Result<()> {
    match kind_of_mode(mode) {
        None => Ok(()),
        Some(kind) => Err(not_a_file(path, kind)),
    }
}

/// The [`NotAFile`] an I/O error carries, if any.
pub fn find(e: &io::Error) -> Option<&NotAFile> {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<NotAFile>())
}

/// The [`NotAFile`] anywhere in an error's chain, if any.
pub fn find_in(e: &anyhow::Error) -> Option<&NotAFile> {
    e.chain().find_map(|c| {
        c.downcast_ref::<NotAFile>()
            .or_else(|| c.downcast_ref::<io::Error>().and_then(find))
    })
}

/// Names the file of a [`NotAFile`] in full: one opened through a
/// directory's descriptor knows only its entry's name. Other errors pass.
pub fn at(full: &Path, e: io::Error) -> io::Error {
    match find(&e) {
        Some(n) => not_a_file(full, n.kind),
        None => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;

    fn open(path: &Path) -> io::Result<File> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(FLAGS)
            .open(path)
            .map_err(|e| refused(path, e))?;
        check(path, &f)?;
        Ok(f)
    }

    #[test]
    fn each_kind_is_refused_without_blocking_and_named() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let link = d.path().join("link");
        std::os::unix::fs::symlink("/etc/hostname", &link).unwrap();
        let dir = d.path().join("dir");
        std::fs::create_dir(&dir).unwrap();
        let sock = d.path().join("sock");
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        for (p, kind) in [
            (&fifo, "a FIFO"),
            (&link, "a symlink"),
            (&dir, "a directory"),
            (&sock, "a socket"),
        ] {
            let e = open(p).unwrap_err();
            let n = find(&e).unwrap_or_else(|| panic!("{}: {e}", p.display()));
            assert_eq!((n.path.as_path(), n.kind), (p.as_path(), kind));
            assert!(e.to_string().contains("doctor --repair"), "{e}");
        }
        let file = d.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(open(&file).is_ok());
        let missing = open(&d.path().join("missing")).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
        assert!(find(&missing).is_none());
    }
}
