//! Typed errors for the conditions a caller must tell apart, and the exit code each maps to.
//!
//! Everything else travels as `anyhow::Error` with context naming the object and cause; the CLI
//! finds a typed [`Error`] anywhere in the chain ([`exit_code`]), so no code matches on error text.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use crate::name::InvalidName;

/// A C call's return value as a result: a negative one failed, and `errno` says why.
pub fn cvt<T: Default + PartialOrd>(r: T) -> io::Result<T> {
    if r < T::default() {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// `call`'s result (`cvt`), called again while it fails with `EINTR`.
pub fn retrying<T: Default + PartialOrd>(mut call: impl FnMut() -> T) -> io::Result<T> {
    loop {
        match cvt(call()) {
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            done => return done,
        }
    }
}

/// `m` locked; a panic while another thread held it leaves its data usable as it is.
pub fn locked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A name or path as a C string: one with a NUL in it is `EINVAL`.
pub(crate) fn cstr(name: &std::ffi::OsStr) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(name.as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Exit codes fixed by the contract (sysexits.h values).
pub mod code {
    pub const FAILURE: u8 = 1;
    pub const USAGE: u8 = 64;
    pub const NO_INPUT: u8 = 66;
    pub const UNAVAILABLE: u8 = 69;
    pub const TEMPFAIL: u8 = 75;
}

/// Where the recipe for a group-shared store is documented; every message on its modes points here.
pub const GROUP_STORE_DOC: &str = "docs/reliability.md#shared-stores";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad arguments (exit 64).
    #[error("{0}")]
    Usage(String),

    /// A name broke one of the naming rules (exit 64).
    #[error(transparent)]
    InvalidName(#[from] InvalidName),

    /// The images (one or more, named at once) do not exist (exit 66).
    #[error("{}", no_such_images(.0))]
    NoSuchImage(Vec<String>),

    /// No process has this pid on this host (exit 66, as a named image that does not exist).
    #[error("no process has pid {0} (on this host, in this pid namespace)")]
    NoSuchProcess(u32),

    /// The root does not exist, and the command only reads (exit 66). `refused`: why `init` would
    /// refuse it (said instead of suggesting it).
    #[error("root {} does not exist ({})", dir.display(), way_out(dir, refused.as_deref(), "creates it"))]
    NoRoot {
        dir: PathBuf,
        refused: Option<String>,
    },

    /// The root is a directory that holds no store (exit 66): a command that reads creates
    /// nothing there, one that writes makes a store only in an empty one; `init` is asked to.
    #[error("root {} holds no store{}", dir.display(), not_a_store_detail(dir, held.as_deref(), refused.as_deref()))]
    NotAStore {
        dir: PathBuf,
        held: Option<String>,
        refused: Option<String>,
    },

    /// The image exists but cannot be read in its state (exit 66).
    #[error("image '{name}' is not ready (state: {state})")]
    NotReady { name: String, state: String },

    /// The image's record cannot be read: its state is not known (exit 66).
    #[error("image '{name}': its record in {} {}, its state unknown ('{} exec --write {name} -- true' marks it ready)", path.display(), damage(.holds), crate::ident::STOWAGE)]
    DamagedRecord {
        name: String,
        path: PathBuf,
        /// The image whose valid record the file holds instead (copied over it), if any.
        holds: Option<String>,
    },

    /// No record while the image's tree is there, its lock file empty (exit 66): an opener erased
    /// the record, the image's only state (`images_dir::record_erased`).
    #[error("image '{name}' has no record, yet a directory is at its name: if it was an image, a '>' likely erased its record (in {}); see '{} doctor'", lock.display(), crate::ident::STOWAGE)]
    RecordErased { name: String, lock: PathBuf },

    /// A file of the store is in a format a later release writes (exit 1): read as damage, a repair
    /// would set it aside or write it back in this release's format, downgrading the store.
    #[error("store {} was made by a newer stowage ({what}); upgrade stowage", root.display())]
    Newer { root: PathBuf, what: String },

    /// flock(2) does not work on this filesystem (exit 69).
    #[error("cannot lock {what} ({}): {cause}{}", path.display(), lock_advice(cause))]
    LockingUnavailable {
        what: String,
        path: PathBuf,
        cause: io::Error,
    },

    /// Locks work here, but would not exclude other hosts (exit 69).
    #[error("{0}")]
    UnsafeLocking(String),

    /// A lock was not acquired in time (exit 75, or --conflict-exit-code).
    #[error("{0}")]
    Busy(Busy),

    /// Standard output's reader is gone (`| head`): the command ends quietly, as SIGPIPE would
    /// end it (exit 141).
    #[error("standard output closed by its reader")]
    ReaderGone,

    /// A termination signal arrived before the command started.
    #[error("interrupted by {} before the command started", signal_name(*.0))]
    Interrupted(i32),

    /// A termination signal was passed on to the command, whose end is unknown (its keeper gone).
    #[error("stopped by {}", signal_name(*.0))]
    Stopped(i32),
}

/// A lock that stayed busy past the caller's deadline.
#[derive(Debug)]
pub struct Busy {
    /// What was waited for, e.g. "write lock on image 'app'".
    pub what: String,
    /// Who held it when the wait began, already phrased ("held (read) by …").
    pub holders: String,
    pub waited: Duration,
}

impl Busy {
    /// Busy at the first try, with no wait asked for (`--no-wait`).
    pub fn now(what: String, holders: String) -> Error {
        Error::Busy(Busy {
            what,
            holders,
            waited: Duration::ZERO,
        })
    }
}

impl std::fmt::Display for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (what, holders) = (&self.what, &self.holders);
        if self.waited.is_zero() {
            write!(f, "{what} is busy: {holders}")
        } else {
            let secs = self.waited.as_secs_f64();
            write!(f, "gave up after {secs:.1} s waiting for {what}: {holders}")
        }
    }
}

/// "image 'a' does not exist", or "images 'a', 'b' do not exist".
fn no_such_images(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
    match quoted.as_slice() {
        [one] => format!("image {one} does not exist"),
        many => format!("images {} do not exist", many.join(", ")),
    }
}

/// The exit code for any error: the first typed [`Error`] in the chain decides, else a failure.
pub fn exit_code(err: &anyhow::Error) -> u8 {
    match typed(err) {
        None | Some(Error::Newer { .. }) => code::FAILURE,
        Some(Error::Usage(_) | Error::InvalidName(_)) => code::USAGE,
        Some(
            Error::NoSuchImage(_)
            | Error::NoSuchProcess(_)
            | Error::NotReady { .. }
            | Error::DamagedRecord { .. }
            | Error::RecordErased { .. }
            | Error::NoRoot { .. }
            | Error::NotAStore { .. },
        ) => code::NO_INPUT,
        Some(Error::LockingUnavailable { .. } | Error::UnsafeLocking(_)) => code::UNAVAILABLE,
        Some(Error::Busy(_)) => code::TEMPFAIL,
        Some(Error::Interrupted(sig) | Error::Stopped(sig)) => 128u8.saturating_add(*sig as u8),
        Some(Error::ReaderGone) => 128 + libc::SIGPIPE as u8,
    }
}

/// The format number above `ours` that `text`'s first line (`WORD N`) names, if it names one: a
/// later release's file, to be refused whole, never read as damage (and never rewritten).
pub fn newer_format(text: &str, word: &str, ours: u64) -> Option<u64> {
    let line = text.split('\n').next()?.strip_prefix(word)?;
    line.parse::<u64>().ok().filter(|&n| n > ours)
}

/// Whether `err` is a later release's store refused ([`Error::Newer`]): never gone on from.
pub fn is_newer(err: &anyhow::Error) -> bool {
    matches!(typed(err), Some(Error::Newer { .. }))
}

/// The error chain on one line, outermost first, minus causes whose words are already there (SQLite
/// repeats its message as the source: "database is locked: Error code 5: database is locked").
pub fn one_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        let words = match text.split_once(": ") {
            Some((head, rest)) if head.starts_with("Error code ") => rest,
            _ => text.as_str(),
        };
        if line.contains(words) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// The typed error in the chain, if any, one given as a context included.
pub fn typed(err: &anyhow::Error) -> Option<&Error> {
    err.downcast_ref::<Error>()
        .or_else(|| err.chain().find_map(|e| e.downcast_ref::<Error>()))
}

/// True for errno values meaning "this filesystem cannot lock at all", not a transient failure.
pub fn flock_unsupported(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS)
    )
}

fn lock_advice(err: &io::Error) -> &'static str {
    match err.raw_os_error() {
        Some(libc::EROFS) => {
            " — it is on a read-only mount: stowage writes lock files in the root (remount it read-write, or use a --root on a writable filesystem)"
        }
        _ if flock_unsupported(err) => {
            " — is this NFS mounted with 'nolock', or a filesystem without flock? run 'stowage doctor' (with the same --root)"
        }
        _ => "",
    }
}

/// True when locks cannot be taken at all on this filesystem (exit 69).
pub fn locking_unavailable(err: &io::Error) -> bool {
    flock_unsupported(err) || err.raw_os_error() == Some(libc::EROFS)
}

/// "SIGINT" for 2; "signal 99" for a number with no name.
pub fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_owned())
}

/// `text` without the " (os error 13)" Rust appends to a system error's words.
pub fn without_errno(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(" (os error ") {
        let tail = &rest[at + " (os error ".len()..];
        let digits = tail.bytes().take_while(u8::is_ascii_digit).count();
        // Where a cause ends (the line, or ": " before the next): never inside a path.
        let after = tail.get(digits + 1..).unwrap_or("");
        let whole = digits > 0
            && tail[digits..].starts_with(')')
            && (after.is_empty() || after.starts_with(": ") || after.starts_with("; "));
        out.push_str(&rest[..at]);
        if whole {
            rest = &tail[digits + 1..];
        } else {
            out.push(' ');
            rest = &rest[at + 1..];
        }
    }
    out.push_str(rest);
    out
}

/// How a record that says nothing of its image is damaged: unreadable, or another image's.
fn damage(holds: &Option<String>) -> String {
    match holds {
        Some(other) => format!("is image '{other}''s, not its own"),
        None => "is damaged".into(),
    }
}

/// What [`Error::NotAStore`] says after "holds no store": what the root holds, and the way out. A
/// `locks` that is no directory is its owner's: `init` would refuse it.
fn not_a_store_detail(dir: &std::path::Path, held: Option<&str>, refused: Option<&str>) -> String {
    let way_out = way_out(dir, refused, "makes it one");
    match held {
        Some("locks") => ": its 'locks' is no directory of a store (mistyped? move it away, or name another root)".into(),
        Some(h) => format!(": it holds '{h}' but no 'locks' directory (mistyped? {way_out})"),
        None => format!(" (mistyped? {way_out})"),
    }
}

/// The way out of a root that is no store: `init` there, unless it would refuse (`refused`: why).
fn way_out(dir: &std::path::Path, refused: Option<&str>, does: &str) -> String {
    match refused {
        Some(why) => format!("no store can be made there: {why}"),
        None => format!(
            "'stowage --root {} init' {does}",
            crate::ident::shell_path(dir)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typed_error_given_as_a_context_decides_the_exit_code() {
        let e = anyhow::Error::new(io::Error::other("copy failed"))
            .context("cannot copy")
            .context(Error::Interrupted(15));
        assert_eq!(exit_code(&e), 143);
        let e = anyhow::Error::new(Error::NotReady {
            name: "app".into(),
            state: "incomplete".into(),
        })
        .context("while reading");
        assert_eq!(exit_code(&e), code::NO_INPUT);
        let e = anyhow::anyhow!("plain");
        assert_eq!(exit_code(&e), code::FAILURE);
    }

    #[test]
    fn errno_numbers_are_left_out_of_messages() {
        assert_eq!(
            without_errno("cannot run './b': No such file or directory (os error 2)"),
            "cannot run './b': No such file or directory"
        );
        assert_eq!(
            without_errno("a (os error 13): b (os error x) c"),
            "a: b (os error x) c"
        );
        // Inside a path it stays.
        let path = "root /tmp/a (os error 5)/r does not exist";
        assert_eq!(without_errno(path), path);
    }
}
