//! Image trees by directory descriptor, for the walks that copy and measure them, on the same
//! [`Dir`] as every destructive operation (dir.rs).
//!
//! - Every step goes from an open directory to a name in it (`openat`, `fstatat`, `mkdirat` …): no
//!   path is built, so any depth works.
//! - Nothing is followed: `O_NOFOLLOW | O_DIRECTORY`, `AT_SYMLINK_NOFOLLOW`.
//! - Paths exist only for messages, bounded ([`Trail::show`]).

use std::ffi::{CStr, CString};
use std::path::Path;

use nix::sys::resource::{Resource::RLIMIT_NOFILE, getrlimit, rlim_t, setrlimit};

pub use crate::dir::{Dir, fstat};

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

/// Raises the soft limit on open files to the hard one while it lives (a deep walk holds one or two
/// descriptors per level), then restores it, so a command started later gets the usual one.
pub struct MoreFiles(Option<(rlim_t, rlim_t)>);

impl MoreFiles {
    pub fn raise() -> MoreFiles {
        let Ok((soft, hard)) = getrlimit(RLIMIT_NOFILE) else {
            return MoreFiles(None);
        };
        let raised = soft < hard && setrlimit(RLIMIT_NOFILE, hard, hard).is_ok();
        MoreFiles(raised.then_some((soft, hard)))
    }
}

impl Drop for MoreFiles {
    fn drop(&mut self) {
        if let Some((soft, hard)) = self.0 {
            let _ = setrlimit(RLIMIT_NOFILE, soft, hard);
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
