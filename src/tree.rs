//! Image trees by directory descriptor, for the walks that copy and measure
//! them.
//!
//! Invariants: every step goes from an open directory to a name in it
//! (`openat`, `fstatat`, `mkdirat` …), so a walk works at any depth — a
//! path is never built, and so never exceeds PATH_MAX — and nothing is ever
//! followed: directories are opened with `O_NOFOLLOW | O_DIRECTORY`, entries
//! are looked at with `AT_SYMLINK_NOFOLLOW`. Paths exist only for messages,
//! and those are bounded ([`Trail::show`]).

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// An open directory.
#[derive(Debug)]
pub struct Dir(OwnedFd);

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub fn cstr(p: &OsStr) -> io::Result<CString> {
    CString::new(p.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

const DIR_FLAGS: libc::c_int =
    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;

impl Dir {
    /// Opens a directory by path (the start of a walk); a symlink there is
    /// refused.
    pub fn open(path: &Path) -> io::Result<Dir> {
        let c = cstr(path.as_os_str())?;
        // SAFETY: a valid C string; the descriptor is owned at once.
        let fd = cvt(unsafe { libc::open(c.as_ptr(), DIR_FLAGS) })?;
        Ok(Dir(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Opens the subdirectory `name`, never following a symlink.
    pub fn open_at(&self, name: &CStr) -> io::Result<Dir> {
        // SAFETY: as above.
        let fd = cvt(unsafe { libc::openat(self.fd(), name.as_ptr(), DIR_FLAGS) })?;
        Ok(Dir(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// The names in this directory (without `.` and `..`).
    pub fn entries(&self) -> io::Result<Vec<CString>> {
        // fdopendir takes ownership of its descriptor: give it a duplicate,
        // rewound, so this can be called more than once.
        let dup = cvt(unsafe { libc::fcntl(self.fd(), libc::F_DUPFD_CLOEXEC, 0) })?;
        // SAFETY: `dup` is ours until closedir closes it.
        unsafe { libc::lseek(dup, 0, libc::SEEK_SET) };
        let dirp = unsafe { libc::fdopendir(dup) };
        if dirp.is_null() {
            let e = io::Error::last_os_error();
            unsafe { libc::close(dup) };
            return Err(e);
        }
        let mut out = Vec::new();
        let result = loop {
            // readdir reports an error only through errno.
            unsafe { *libc::__errno_location() = 0 };
            let ent = unsafe { libc::readdir(dirp) };
            if ent.is_null() {
                let errno = io::Error::last_os_error();
                break if errno.raw_os_error() == Some(0) {
                    Ok(())
                } else {
                    Err(errno)
                };
            }
            // SAFETY: d_name is a NUL-terminated array inside `ent`.
            let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) };
            let b = name.to_bytes();
            if b != b"." && b != b".." {
                out.push(name.to_owned());
            }
        };
        unsafe { libc::closedir(dirp) };
        result.map(|()| out)
    }

    /// lstat of `name` in this directory.
    pub fn stat_at(&self, name: &CStr) -> io::Result<libc::stat> {
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid descriptor, C string and out-pointer.
        cvt(unsafe {
            libc::fstatat(self.fd(), name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW)
        })?;
        Ok(st)
    }

    pub fn stat(&self) -> io::Result<libc::stat> {
        fstat(self.fd())
    }

    /// A short path naming `name` in this directory through /proc, for the
    /// few calls that have no descriptor form (`l*xattr` on a symlink or a
    /// device node): `l*` calls do not follow its last component.
    pub fn proc_path(&self, name: &CStr) -> CString {
        let mut p = format!("/proc/self/fd/{}/", self.fd()).into_bytes();
        p.extend_from_slice(name.to_bytes());
        CString::new(p).expect("no NUL in a directory entry")
    }
}

pub fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    cvt(unsafe { libc::fstat(fd, &mut st) })?;
    Ok(st)
}

pub fn file_type(st: &libc::stat) -> libc::mode_t {
    st.st_mode & libc::S_IFMT
}

/// The names from the top of a walk to where it is, for messages only.
#[derive(Debug, Default, Clone)]
pub struct Trail(pub Vec<CString>);

/// How much of a path a message shows: both ends of a deeper one.
const SHOWN: usize = 160;

impl Trail {
    /// `top/a/b/name`, or for a path longer than a line
    /// `top/a/b/…(2400 more bytes, depth 1200)…/y/name`.
    pub fn show(&self, top: &Path, name: Option<&CStr>) -> String {
        let mut parts: Vec<String> = vec![top.display().to_string()];
        parts.extend(
            self.0
                .iter()
                .map(CString::as_c_str)
                .chain(name)
                .map(|c| String::from_utf8_lossy(c.to_bytes()).into_owned()),
        );
        let full = parts.join("/");
        if full.len() <= SHOWN {
            return full;
        }
        let head: String = full.chars().take(SHOWN / 3).collect();
        let tail_rev: String = full.chars().rev().take(SHOWN / 2).collect();
        let tail: String = tail_rev.chars().rev().collect();
        format!(
            "{head}…({} more bytes, depth {})…{tail}",
            full.len() - head.len() - tail.len(),
            parts.len() - 1
        )
    }
}

/// Raises the soft limit on open files to the hard one for as long as it
/// lives (a deep walk holds one or two descriptors per level), and puts the
/// old limit back after, so a command started later gets the usual one.
pub struct MoreFiles(Option<libc::rlimit>);

impl MoreFiles {
    pub fn raise() -> MoreFiles {
        let mut old: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) } != 0
            || old.rlim_cur >= old.rlim_max
        {
            return MoreFiles(None);
        }
        let new = libc::rlimit {
            rlim_cur: old.rlim_max,
            rlim_max: old.rlim_max,
        };
        // SAFETY: valid pointer.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } != 0 {
            return MoreFiles(None);
        }
        MoreFiles(Some(old))
    }
}

impl Drop for MoreFiles {
    fn drop(&mut self) {
        if let Some(old) = self.0 {
            // SAFETY: valid pointer.
            unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &old) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deep_path_is_shown_bounded() {
        let t = Trail(vec![CString::new("d".repeat(200)).unwrap(); 40]);
        let s = t.show(Path::new("/store/img/base"), Some(c"bottom"));
        assert!(s.len() < 300, "{} bytes", s.len());
        assert!(s.starts_with("/store/img/base/"), "{s}");
        assert!(s.ends_with("/bottom"), "{s}");
        assert!(s.contains("depth 41"), "{s}");
        assert_eq!(
            Trail(vec![CString::new("a").unwrap()]).show(Path::new("/r"), None),
            "/r/a"
        );
    }
}
