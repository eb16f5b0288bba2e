//! The claim of an images directory by one store: an extended attribute on the directory itself
//! (`user.stowage.store`), since nothing of stowage's may go *into* it.
//!
//! ```text
//! stowage-claim 1
//! id=5e1f00d2c0ffee0123456789abcdef01     (the store's, from store.conf)
//! root=77@ef53                            (the root's identity)
//! path=/var/tmp/ana.stowage               (where it was, to name it; `\\`, `\n` and bytes that
//!                                          are not UTF-8 as `\xNN` escaped: any path is one line)
//! ```
//!
//! - One store per images directory: `init` refuses one another store claims, naming its root. A
//!   copy (same id, another root) is another store.
//! - Nothing is deleted in a directory another store claims.
//! - Where others may write the store's configuration (a group store), an external images directory
//!   is used only with this store's claim, written only by `init --images-dir` naming it: a member
//!   rewriting `store.conf` cannot send writes or deletions to a directory of the user's.
//! - No extended attributes (old NFS servers): the directory stays unclaimed; `init` says so once.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use crate::dir::Dir;

const NAME: &std::ffi::CStr = c"user.stowage.store";

const FORMAT: &str = "stowage-claim 1\n";

/// Who claims an images directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claim {
    pub id: String,
    pub root: String,
    pub path: PathBuf,
}

impl Claim {
    /// This store's claim: its id, its root's identity and path.
    pub fn of(id: &str, root_dir: &Dir, root_path: &Path) -> io::Result<Claim> {
        Ok(Claim {
            id: id.to_owned(),
            root: root_dir.identity()?,
            path: root_path.to_owned(),
        })
    }

    fn encode(&self) -> String {
        format!(
            "{FORMAT}id={}\nroot={}\npath={}\n",
            self.id,
            self.root,
            escaped(&self.path)
        )
    }

    fn decode(text: &str) -> Option<Claim> {
        let body = text.strip_prefix(FORMAT)?;
        // The path is the last field, taken whole: an older release wrote it unescaped.
        let (fields, path) = match body.strip_prefix("path=") {
            Some(path) => ("", Some(path)),
            None => body
                .split_once("\npath=")
                .map_or((body, None), |(f, p)| (f, Some(p))),
        };
        let mut c = Claim {
            path: path.map_or_else(PathBuf::new, |p| {
                unescaped(p.strip_suffix('\n').unwrap_or(p))
            }),
            ..Claim::default()
        };
        // At '\n' only: `lines()` would drop a trailing '\r'.
        for line in fields.split_terminator('\n') {
            match line.split_once('=') {
                Some(("id", v)) => c.id = v.to_owned(),
                Some(("root", v)) => c.root = v.to_owned(),
                _ => {}
            }
        }
        (!c.id.is_empty() && !c.root.is_empty()).then_some(c)
    }

    /// Whether `other` is the same store at the same root (as `dir::same_identity` matches roots).
    pub fn same_store(&self, other: &Claim) -> bool {
        self.id == other.id && crate::dir::same_identity(&self.root, &other.root)
    }

    /// Whether this claim still binds the images directory at `path`: unless its root is where it
    /// says and its configuration records another images directory (`path` is a copy's `img`,
    /// claim and all). A root gone may only have moved, and an error looking is no evidence.
    pub fn binds(&self, path: &Path) -> bool {
        let Some(recorded) = self.recorded() else {
            return true;
        };
        match (recorded, Dir::anchor(path).and_then(|d| d.identity())) {
            (Some(theirs), Ok(this)) => crate::dir::same_identity(&theirs, &this),
            _ => true,
        }
    }

    /// Whether the claiming store uses `dir` as its images directory now, by positive evidence: its
    /// root is where it says and records `dir`'s identity (a copy of a claimed directory is none).
    pub fn in_use_for(&self, dir: &Dir) -> bool {
        self.recorded().flatten().is_some_and(|r| {
            dir.identity()
                .is_ok_and(|d| crate::dir::same_identity(&r, &d))
        })
    }

    /// The images directory's identity the claiming store's configuration records, if any; `None`
    /// if its root is not where it says.
    fn recorded(&self) -> Option<Option<String>> {
        let anchor = self.root_there()?;
        let config = crate::config::read(&self.path, &anchor).ok().flatten();
        Some(config.and_then(|c| c.identity))
    }

    /// The claiming store's root, if the directory at its path is still the one it names.
    pub fn root_there(&self) -> Option<Dir> {
        let anchor = Dir::anchor_nofollow(&self.path).ok()?;
        let now = anchor.identity().ok()?;
        crate::dir::same_identity(&self.root, &now).then_some(anchor)
    }
}

/// What claims the directory `dir`: `None` if nothing does (or no extended attributes, a value
/// that is no claim, a failed read). Read whole, however long: a claim read cut would be none.
pub fn read(dir: &Dir) -> Option<Claim> {
    read_of_fd(dir.as_raw_fd()).ok().flatten()
}

fn read_of_fd(fd: std::os::fd::RawFd) -> io::Result<Option<Claim>> {
    // SAFETY: valid descriptor, C string and buffer of the length given.
    decoded(crate::dir::xattr_read(1024, |p, n| unsafe {
        libc::fgetxattr(fd, NAME.as_ptr(), p, n)
    }))
}

/// What claims the directory at `path`, its last component followed only if `follow`: `Ok(None)`
/// if nothing does or the value is no claim; an error reading it as it is (`ENOTSUP`: no extended
/// attributes).
pub fn read_path(path: &Path, follow: bool) -> io::Result<Option<Claim>> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let get = if follow {
        libc::getxattr
    } else {
        libc::lgetxattr
    };
    // SAFETY: valid C strings and a buffer of the length given.
    decoded(crate::dir::xattr_read(1024, |p, n| unsafe {
        get(c.as_ptr(), NAME.as_ptr(), p, n)
    }))
}

/// A claim as read: `Ok(None)` for none (`ENODATA`) or a value that is no claim.
fn decoded(v: io::Result<Vec<u8>>) -> io::Result<Option<Claim>> {
    match v {
        Ok(v) => Ok(std::str::from_utf8(&v).ok().and_then(Claim::decode)),
        Err(e) if e.raw_os_error() == Some(libc::ENODATA) => Ok(None),
        Err(e) => Err(e),
    }
}

/// What claims the directory open as `dir`: as [`read_path`], on that very directory. An `O_PATH`
/// descriptor (an anchor) has no attributes to ask: it is asked through `/proc/self/fd`, else
/// (no `/proc` here, as in some containers) through the directory opened from it.
pub fn read_fd(dir: &Dir) -> io::Result<Option<Claim>> {
    let fd = dir.as_raw_fd();
    // SAFETY: F_GETFL on a valid descriptor.
    if unsafe { libc::fcntl(fd, libc::F_GETFL) } & libc::O_PATH == 0 {
        return read_of_fd(fd);
    }
    match read_path(Path::new(&format!("/proc/self/fd/{fd}")), true) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => read_of_fd(dir.sub(".")?.as_raw_fd()),
        read => read,
    }
}

/// Whether the filesystem of `dir` keeps extended attributes (claims).
pub fn supported(dir: &Dir) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: valid descriptor, C string and buffer of the length given.
    let r = unsafe { libc::fgetxattr(dir.as_raw_fd(), NAME.as_ptr(), b.as_mut_ptr().cast(), 1) };
    r >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ENOTSUP)
}

/// Claims `dir` for `claim`'s store. `Ok(false)`: the filesystem keeps no extended attributes.
/// `new`: only if nothing claims it (else `EEXIST`: of two stores at once, one wins).
pub fn write(dir: &Dir, claim: &Claim, new: bool) -> io::Result<bool> {
    let text = claim.encode();
    let flags = if new { libc::XATTR_CREATE } else { 0 };
    // SAFETY: valid descriptor, C string and buffer of the length given.
    let r = unsafe {
        libc::fsetxattr(
            dir.as_raw_fd(),
            NAME.as_ptr(),
            text.as_ptr().cast(),
            text.len(),
            flags,
        )
    };
    match crate::error::cvt(r) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Why `dir` (at `path`) may not be used by the store whose claim is `mine`: another store's claim.
/// One naming this very root is this store's under whatever id it had (a configuration made anew).
pub fn refusal(dir: &Dir, path: &Path, mine: &Claim) -> Option<String> {
    refusal_by(&read(dir)?, path, &mine.id, &mine.root)
}

/// Why the images directory at `path`, which `theirs` claims, is not for the store of id `id` at the
/// root of identity `root`: the claim is another root's and still binds the directory.
pub fn refusal_by(theirs: &Claim, path: &Path, id: &str, root: &str) -> Option<String> {
    let copy = theirs.id == id;
    let this_root = crate::dir::same_identity(&theirs.root, root);
    (!this_root && theirs.binds(path)).then(|| {
        // Nothing can tell a store gone for good from one moved.
        format!(
            "images directory {} belongs to the store at {} ({}): one store per images directory; gone for good (not moved)? 'setfattr -x user.stowage.store {}'",
            path.display(),
            theirs.path.display(),
            // Either may be the copy: each root records itself once `init --images-dir` named it.
            if copy { "this store's id: one of the two is a copy of the other" } else { "another store" },
            crate::ident::shell_path(path)
        )
    })
}

/// `path` as one line of a claim: `\\`, a newline and each byte that is not UTF-8 escaped.
fn escaped(path: &Path) -> String {
    let mut out = String::new();
    for chunk in path.as_os_str().as_bytes().utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

fn unescaped(text: &str) -> PathBuf {
    let (bytes, mut out) = (text.as_bytes(), Vec::with_capacity(text.len()));
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 2..i + 4)
            .and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
        match (bytes[i], bytes.get(i + 1)) {
            (b'\\', Some(b'\\')) => (out.push(b'\\'), i += 2),
            (b'\\', Some(b'n')) => (out.push(b'\n'), i += 2),
            (b'\\', Some(b'x')) if hex.is_some() => (out.extend(hex), i += 4),
            (b, _) => (out.push(b), i += 1),
        };
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_reads_back_and_names_its_store() {
        let c = Claim {
            id: "ab".into(),
            root: "7@ef53".into(),
            path: "/r".into(),
        };
        assert_eq!(Claim::decode(&c.encode()), Some(c.clone()));
        for odd in [&b"/r/a\nb\\n\\x41"[..], b"/r/\xff\xfe=\\", b"/r/\\"] {
            let path = PathBuf::from(std::ffi::OsStr::from_bytes(odd));
            let c = Claim { path, ..c.clone() };
            assert_eq!(c.encode().lines().count(), 4);
            assert_eq!(Claim::decode(&c.encode()), Some(c.clone()));
        }
        // An older release's unescaped newline: the path is whole.
        let old = Claim::decode("stowage-claim 1\nid=ab\nroot=7@ef53\npath=/r/a\nb\n").unwrap();
        assert_eq!(old.path, Path::new("/r/a\nb"));
        assert_eq!(Claim::decode("junk"), None);
        let moved = Claim {
            root: "8@ef53".into(),
            ..c.clone()
        };
        assert!(!c.same_store(&moved));
        assert!(c.same_store(&Claim {
            root: "7@ef53@99".into(),
            ..c.clone()
        }));
    }
}
