//! The catalog: SQLite at `ROOT/stowage.db`, derived from the images' records and trees
//! (docs/design.md, "The catalog").
//!
//! - Derived, never trusted over the records: no decision changing an image rests on it.
//! - Losing it costs a rebuild and the sizes: one missing, empty, damaged or another program's is
//!   set aside (never deleted) and made anew.
//! - Used only under the global lock ([`Catalog`] owns the guard), in one short transaction.
//! - Rollback journal, never WAL (its shared-memory index is unsafe on NFS); a database switched to
//!   WAL from outside is switched back.
//! - `stowage.db` and its journal are checked to be regular files of their own (no link followed,
//!   no blocking) before SQLite opens them.

use crate::ident::STOWAGE;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rusqlite::{ErrorCode, OpenFlags, params};

use crate::clock::Millis;
use crate::image_record::{Record, State};
use crate::lock::Guard;
use crate::root::Root;

/// The catalog's schema version (`PRAGMA user_version`); 1 to 10 were releases' before records.
pub const SCHEMA: i64 = 11;

const SCHEMA_SQL: &str = r#"
CREATE TABLE IF NOT EXISTS images (
    name         TEXT PRIMARY KEY,
    state        TEXT NOT NULL,
    base         TEXT,
    created_ms   INTEGER NOT NULL,
    last_used_ms INTEGER NOT NULL,
    seq          INTEGER NOT NULL,
    size_bytes   INTEGER,
    size_seq     INTEGER,
    size_record  INTEGER
) WITHOUT ROWID;
"#;

/// Added to schema 11 in place: releases that know only `size_seq` go on reading it.
const SIZE_RECORD_SQL: &str = "ALTER TABLE images ADD COLUMN size_record INTEGER";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub name: String,
    pub state: State,
    pub base: Option<String>,
    pub created: Millis,
    pub last_used: Millis,
    /// The record's sequence number when the row was refreshed.
    pub seq: u64,
    /// The tree's size, measured for the record whose fingerprint is `size_record`.
    pub size: Option<u64>,
    pub size_record: Option<u64>,
}

impl Row {
    /// The size, if it was measured for the tree that `record` describes.
    pub fn size_for(&self, record: &Record) -> Option<u64> {
        self.size
            .filter(|_| self.size_record == Some(record.fingerprint()))
    }
}

/// What an opened catalog turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// Ours, at this schema.
    Current,
    /// Made just now (missing, empty): every row must come from the records.
    New,
    /// The metadata of a release before records: `migrate.rs` converts it.
    Legacy(i64),
    /// To be set aside and made anew (damaged, foreign), for the reason given.
    Replaced(String),
    /// At a schema version above ours, with a later release's schema ([`later_release`]): that
    /// release's store, refused whole, never set aside (that release's catalog is no damage, and a
    /// rebuild at ours would downgrade the store).
    Newer(i64),
}

/// The refusal of a store whose catalog is at schema version `v`, above ours.
pub fn newer(root: &Root, v: i64) -> anyhow::Error {
    let what = format!("catalog stowage.db schema version {v}, this stowage's {SCHEMA}");
    crate::Error::Newer {
        root: root.dir().to_path_buf(),
        what,
    }
    .into()
}

/// [`newer`] if the catalog's schema version, read from its header (SQLite keeps `user_version`
/// at bytes 60..64, big-endian), is above ours and its schema a later release's: the header read
/// without SQLite, so without taking its locks or making its journal (SQLite is asked only past
/// that). A catalog that is missing, no file or not SQLite's is left to its command.
pub fn refuse_newer(root: &Root) -> Result<()> {
    let Ok(dir) = root.opened() else {
        return Ok(());
    };
    let Ok(file) = dir.open_read_unchecked("stowage.db") else {
        return Ok(());
    };
    match header_version(&file) {
        Some(v) if v > SCHEMA && later_release_file(&root.db()) => Err(newer(root, v)),
        _ => Ok(()),
    }
}

/// The schema version in the header of the SQLite database open as `file`, if it is one.
fn header_version(file: &std::fs::File) -> Option<i64> {
    let mut header = [0u8; 64];
    // A plain read from the start (a fresh open): SQLite's own reads are `pread`s.
    match std::io::Read::read(&mut &*file, &mut header) {
        Ok(64) if header.starts_with(b"SQLite format 3\0") => {}
        _ => return None,
    }
    let version = i32::from_be_bytes([header[60], header[61], header[62], header[63]]);
    Some(i64::from(version))
}

/// Whether the catalog at `db` is a later release's, decided before anything is written to it:
/// switching a WAL catalog back to the rollback journal rewrites its header.
fn later_release_at(db: &Path) -> bool {
    let version = open_plain(db).ok().and_then(|f| header_version(&f));
    version.is_some_and(|v| v > SCHEMA) && later_release_file(db)
}

/// Whether the catalog at `db`, whose header says a schema above ours, holds a later release's
/// schema ([`later_release`]): four bytes of header are no proof, another program's database or
/// ours damaged there is set aside by its command. Opened read-only (no journal made, nothing
/// rolled back); one that cannot be read now is left to its command, which asks again.
fn later_release_file(db: &Path) -> bool {
    check_files(db).ok().flatten().is_some_and(|_| {
        let conn = connect(db, OpenFlags::SQLITE_OPEN_READ_ONLY);
        let objects = conn.as_ref().ok().and_then(|c| schema_objects(c).ok());
        conn.is_ok_and(|c| objects.is_some_and(|o| later_release(&c, &o).unwrap_or(false)))
    })
}

/// Whether a database whose schema version is above ours is a later release's catalog: it has
/// what every release's has (an `images` table with `name` and `state`), a schema other than ours
/// (a release that raises the version changes the schema: ours under a higher number is ours
/// damaged at its header) and not the shape of a release's before records (`images` beside
/// `records` and `config`: that catalog damaged at its header). `images` alone is a common name:
/// another program's table of that name is no later release's.
fn later_release(conn: &rusqlite::Connection, objects: &[[String; 3]]) -> Result<bool> {
    let has = |t: &str| objects.iter().any(|[k, n, _]| k == "table" && n == t);
    if !has("images") || is_ours(objects) || (has("records") && has("config")) {
        return Ok(false);
    }
    let cols = columns(conn, "images")?;
    Ok(["name", "state"]
        .iter()
        .all(|c| cols.iter().any(|x| x == c)))
}

/// The database's schema objects: type, name and statement, in one read.
fn schema_objects(conn: &rusqlite::Connection) -> rusqlite::Result<Vec<[String; 3]>> {
    let sql = "SELECT type, name, coalesce(sql, '') FROM sqlite_master ORDER BY type, name";
    conn.prepare(sql)?
        .query_map([], |r| Ok([r.get(0)?, r.get(1)?, r.get(2)?]))?
        .collect()
}

/// The catalog, open under the global lock.
pub struct Catalog<'a> {
    conn: &'a rusqlite::Connection,
    _global: &'a Guard,
}

/// Opens the catalog file (not yet a transaction), refusing anything planted at its files.
pub fn open(path: &Path) -> Result<rusqlite::Connection> {
    if check_files(path)?.as_ref().is_some_and(says_wal) && !later_release_at(path) {
        leave_outside_wal(path)?;
    }
    // SQLite names nothing it could not open: what was put in the catalog's place since, if any.
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE;
    connect(path, flags).map_err(|e| {
        check_files(path).err().unwrap_or_else(|| {
            CatalogError(format!("cannot open catalog {}: {e}", path.display())).into()
        })
    })
}

/// A connection to `path` opened with `flags`, never through a link, with our busy timeout.
fn connect(path: &Path, flags: OpenFlags) -> rusqlite::Result<rusqlite::Connection> {
    configure_sqlite();
    let flags = flags | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_NOFOLLOW;
    let conn = rusqlite::Connection::open_with_flags(path, flags)?;
    conn.busy_timeout(busy_timeout())?;
    Ok(conn)
}

/// `db` with `suffix`: a file SQLite keeps beside it (`-journal` during a transaction).
pub fn beside(db: &Path, suffix: &str) -> PathBuf {
    let mut s = db.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// Checks that every file SQLite may open for the catalog at `db` is missing or a regular file.
/// Returns the catalog itself, opened for reading, if it is there.
pub fn check_files(db: &Path) -> Result<Option<std::fs::File>> {
    let [(path, what), rest @ ..] = files(db);
    let catalog = check_plain_file(&path, what)?;
    for (path, what) in rest {
        check_plain_file(&path, what)?;
    }
    Ok(catalog)
}

/// Every file SQLite may open for the catalog at `db`, with what it is.
pub fn files(db: &Path) -> [(PathBuf, &'static str); 4] {
    [
        (db.to_owned(), "the catalog"),
        (beside(db, "-journal"), "the catalog's journal"),
        (beside(db, "-wal"), "the catalog's WAL file"),
        (beside(db, "-shm"), "the catalog's WAL index"),
    ]
}

/// Fails unless `path` is missing or a regular file (`open_plain`); returns it opened, if there.
pub fn check_plain_file(path: &Path, what: &str) -> Result<Option<std::fs::File>> {
    let opened = open_plain(path);
    // A stale handle: another host removed the file (a journal at its commit) since the lookup.
    let gone = |e: &std::io::Error| {
        e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESTALE)
    };
    let kind = match opened {
        // SQLite writes in place: not through a file with other names.
        Ok(f) => match f.metadata() {
            Ok(m) => match crate::planted::kind_of(m.mode(), m.nlink()) {
                None => return Ok(Some(f)),
                Some(kind) => kind,
            },
            Err(e) if gone(&e) => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot inspect {}", path.display())),
        },
        Err(e) if gone(&e) => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => "a symlink",
        // A socket cannot be opened at all (ENXIO); a directory can.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => "a socket",
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let why = crate::planted::denied(path)
                .unwrap_or_else(|| format!("cannot open {}: {e}", path.display()));
            return Err(CatalogError(format!("{what}: {why}")).into());
        }
        Err(e) => return Err(e).with_context(|| format!("cannot open {}", path.display())),
    };
    Err(CatalogError(format!(
        "{what} {} is {kind}, not {}: '{STOWAGE} doctor --repair' moves it aside (the catalog is rebuilt from the records)",
        path.display(),
        crate::planted::expected(kind)
    ))
    .into())
}

/// `path` opened for reading, no link followed, without blocking (`planted::FLAGS`).
fn open_plain(path: &Path) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options
        .read(true)
        .custom_flags(crate::planted::FLAGS)
        .open(path)
}

/// An error that already names the catalog file.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CatalogError(pub String);

/// Few tiny transactions per process: no lookaside or page cache. Every open: [`open_no_wait`].
fn configure_sqlite() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use rusqlite::ffi;
        let (zero, none): (libc::c_int, *mut libc::c_void) = (0, std::ptr::null_mut());
        // SAFETY: sqlite3_config before any connection is opened, with the argument types each
        // option documents; a refusal keeps defaults. The default VFS (unix) lets a program replace
        // its system calls before use; `open_no_wait` has the signature of the "open" it replaces.
        unsafe {
            ffi::sqlite3_config(ffi::SQLITE_CONFIG_LOOKASIDE, zero, zero);
            ffi::sqlite3_config(ffi::SQLITE_CONFIG_PAGECACHE, none, zero, zero);
            ffi::sqlite3_config(ffi::SQLITE_CONFIG_MEMSTATUS, zero);
            let vfs = ffi::sqlite3_vfs_find(std::ptr::null());
            if let Some(set) = vfs.as_ref().and_then(|v| v.xSetSystemCall) {
                type Open = unsafe extern "C" fn(
                    *const libc::c_char,
                    libc::c_int,
                    libc::c_int,
                ) -> libc::c_int;
                let open = std::mem::transmute::<Open, unsafe extern "C" fn()>(open_no_wait);
                set(vfs, c"open".as_ptr(), Some(open));
            }
        }
    });
}

/// SQLite's open(2), never waiting (its hot-journal check would block on a FIFO planted since
/// `check_files`, under the global lock): `ENXIO` unless a file or directory, then blocking.
unsafe extern "C" fn open_no_wait(
    path: *const libc::c_char,
    flags: libc::c_int,
    mode: libc::c_int,
) -> libc::c_int {
    // SAFETY: `path` is SQLite's C string; the descriptor is ours until returned.
    unsafe {
        let fd = libc::open(path, flags | libc::O_NONBLOCK, mode as libc::c_uint);
        let mut st: libc::stat = std::mem::zeroed();
        if fd < 0 || libc::fstat(fd, &mut st) != 0 {
            return fd;
        }
        if !matches!(st.st_mode & libc::S_IFMT, libc::S_IFREG | libc::S_IFDIR) {
            libc::close(fd);
            *libc::__errno_location() = libc::ENXIO;
            return -1;
        }
        libc::fcntl(
            fd,
            libc::F_SETFL,
            libc::fcntl(fd, libc::F_GETFL) & !libc::O_NONBLOCK,
        );
        fd
    }
}

/// How long to wait for SQLite's own lock (only outside programs hold it under the global lock).
pub fn busy_timeout() -> std::time::Duration {
    crate::env::debug_ms(crate::env::DEBUG_DB_BUSY_MS, 10_000)
}

const BUSY: &[ErrorCode] = &[ErrorCode::DatabaseBusy, ErrorCode::DatabaseLocked];

/// Is this SQLite saying its lock stayed busy (an outside program)?
pub fn is_busy(err: &anyhow::Error) -> bool {
    said(err, BUSY)
}

/// Is this SQLite saying a read or write of a file failed (`SQLITE_IOERR` and its kinds)?
pub fn is_io(err: &anyhow::Error) -> bool {
    said(err, &[ErrorCode::SystemIoFailure])
}

/// How often a use of the catalog that meets an I/O error is made in all.
const IO_TRIES: u32 = 4;

/// Whether a use of the catalog that failed with `err` is to be made again (after a pause, taken
/// here), `tries` counting those made: while SQLite says an I/O error, a few times. On a shared
/// filesystem a file another host deleted since this client looked it up is a stale handle, which
/// SQLite calls an I/O error: the journal each commit deletes, met by the check for a hot journal
/// (a read) or at the next transaction's start (a write). A fresh look finds it gone; a failing
/// disk fails every try and is reported.
pub fn try_again(tries: &mut u32, err: &anyhow::Error) -> bool {
    if !is_io(err) || *tries >= IO_TRIES {
        return false;
    }
    *tries += 1;
    std::thread::sleep(std::time::Duration::from_millis(5 << *tries));
    true
}

/// `look` at the catalog, made again while it meets an I/O error ([`try_again`]).
pub fn again_on_io<T>(mut look: impl FnMut() -> Result<T>) -> Result<T> {
    let mut tries = 1;
    loop {
        match look() {
            Err(e) if try_again(&mut tries, &e) => {}
            other => return other,
        }
    }
}

/// Is this SQLite saying the catalog at `db` is no healthy database, and is it so? Not a failed
/// read (EIO: kept, [`unreadable`]), nor damage `quick_check` on a new connection does not meet.
pub fn is_damage(err: &anyhow::Error, db: &Path) -> bool {
    said(err, &[ErrorCode::DatabaseCorrupt, ErrorCode::NotADatabase])
        && unreadable(db).is_none()
        && !open(db).is_ok_and(|conn| quick_check(&conn).is_ok_and(|answer| answer == "ok"))
}

/// SQLite's own check of the database: "ok", or lines saying what is wrong.
pub fn quick_check(conn: &rusqlite::Connection) -> rusqlite::Result<String> {
    conn.query_row("PRAGMA quick_check", [], |r| r.get(0))
}

/// `db`'s catalog opened and asked what it is, as `root`'s ([`inspect_in`]).
pub fn inspect_file(db: &Path, root: &Root) -> Result<Found> {
    inspect_in(&open(db)?, root)
}

/// The most of the catalog's data [`unreadable`] reads: more than a catalog of some 300,000 images
/// takes, and little enough that a huge file planted there holds the global lock only a moment.
const READ_BOUND: u64 = 64 << 20;

/// Why the regular file at `db` cannot be read, if so: its data read once, [`READ_BOUND`] bytes at
/// most, only where it has any (a sparse file may claim exabytes of holes).
pub fn unreadable(db: &Path) -> Option<std::io::Error> {
    use std::os::unix::fs::FileExt as _;
    let file = open_plain(db).ok()?;
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return None;
    }
    let (mut buf, mut left, mut at) = (vec![0u8; 64 << 10], READ_BOUND, 0u64);
    while left > 0 {
        let (start, end) = data_region(&file, at)?;
        at = start;
        while at < end && left > 0 {
            let want = (end - at).min(left).min(buf.len() as u64) as usize;
            match file.read_at(&mut buf[..want], at) {
                Ok(0) => return None,
                Ok(n) => (at, left) = (at + n as u64, left - n as u64),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Some(e),
            }
        }
    }
    None
}

/// The next data region (start, end) of `file` at or after `at`; the rest if holes are not told.
fn data_region(file: &std::fs::File, at: u64) -> Option<(u64, u64)> {
    use nix::unistd::{Whence, lseek};
    let start = match lseek(file, at as libc::off_t, Whence::SeekData) {
        Ok(start) => start as u64,
        Err(nix::errno::Errno::ENXIO) => return None,
        Err(_) => at,
    };
    let end = lseek(file, start as libc::off_t, Whence::SeekHole).map_or(u64::MAX, |h| h as u64);
    // No data there after all (the file changed between the two questions): as at its end.
    (end > start).then_some((start, end))
}

/// Is this SQLite failing to write or open a file (which it does not name)?
pub fn is_refused(err: &anyhow::Error) -> bool {
    use ErrorCode::{CannotOpen, ReadOnly, SystemIoFailure};
    said(err, &[ReadOnly, SystemIoFailure, CannotOpen])
}

/// Why this process may not write the catalog at `db` (itself, its journal, their directory), if
/// it may not: the file and the cause, as [`crate::planted::denied`] words them.
pub fn unwritable(db: &Path) -> Option<String> {
    use nix::unistd::{AccessFlags, access};
    let files = [db.to_owned(), beside(db, "-journal")];
    if let Some(why) = files.iter().find_map(|p| denied(p)) {
        return Some(why);
    }
    let dir = db.parent()?;
    let wx = AccessFlags::W_OK | AccessFlags::X_OK;
    access(dir, wx).is_err().then(|| {
        let dir = dir.display();
        format!("{dir} may not be written by you, and the catalog's journal is made there")
    })
}

/// Why this process may not read and write the file at `path`, if it is there and may not.
fn denied(path: &Path) -> Option<String> {
    use nix::unistd::{AccessFlags, access};
    let there = std::fs::symlink_metadata(path).is_ok();
    (there && access(path, AccessFlags::R_OK | AccessFlags::W_OK).is_err()).then(|| {
        let not = || format!("{} may not be written by you", path.display());
        crate::planted::denied(path).unwrap_or_else(not)
    })
}

/// Is this an error SQLite gave?
pub fn is_sqlite(err: &anyhow::Error) -> bool {
    err.chain().any(|e| e.is::<rusqlite::Error>())
}

/// Is this a full filesystem, as SQLite says it?
pub fn is_full(err: &anyhow::Error) -> bool {
    said(err, &[ErrorCode::DiskFull])
}

/// Whether the first SQLite error in `err`'s chain has one of `codes`.
fn said(err: &anyhow::Error, codes: &[ErrorCode]) -> bool {
    let code = err
        .chain()
        .find_map(|e| match e.downcast_ref::<rusqlite::Error>() {
            Some(rusqlite::Error::SqliteFailure(f, _)) => Some(f.code),
            _ => None,
        });
    code.is_some_and(|c| codes.contains(&c))
}

/// Whether the database at `db` says it is in WAL mode: its read version (header byte 19) is 2,
/// and SQLite opens its WAL and the WAL's index to read it. One read, no link followed, no wait.
pub fn in_wal(db: &Path) -> bool {
    open_plain(db).is_ok_and(|f| says_wal(&f))
}

/// [`in_wal`] of the catalog already open: one read.
fn says_wal(file: &std::fs::File) -> bool {
    use std::os::unix::fs::FileExt as _;
    let mut byte = [0u8];
    file.read_at(&mut byte, 19).is_ok_and(|n| n == 1) && byte[0] == 2
}

/// The context of an error met switching a catalog back from WAL.
const SWITCHED: &str = "the catalog was switched to WAL by another program";

/// Switches a catalog another program put in WAL mode back to the rollback journal, on connections
/// of its own: first shared; then, where the `-shm` mapping is refused (FUSE) or denied, in
/// exclusive locking mode, which keeps WAL's index in its own memory.
fn leave_outside_wal(db: &Path) -> Result<()> {
    let rw = OpenFlags::SQLITE_OPEN_READ_WRITE;
    let leave = |exclusive: bool| {
        let conn = connect(db, rw)?;
        if exclusive {
            conn.pragma_update(None, "locking_mode", "EXCLUSIVE")?;
        }
        conn.query_row("PRAGMA journal_mode", [], |r| r.get::<_, String>(0))?;
        leave_wal(&conn)
    };
    let mut failed = Vec::new();
    for exclusive in [false, true] {
        match leave(exclusive) {
            Ok(()) => return Ok(()),
            Err(e) if e.sqlite_error_code().is_some_and(|c| BUSY.contains(&c)) => {
                return Err(anyhow::Error::from(e).context(SWITCHED));
            }
            Err(e) => failed.push(e),
        }
    }
    let why = wal_trouble(db, &failed[0], &failed[1]);
    Err(StuckInWal {
        db: db.to_owned(),
        why,
    }
    .into())
}

/// What keeps a catalog in WAL mode from being opened here, as far as it can be told: `shared`
/// the error through WAL's shared index, `alone` the error without it.
fn wal_trouble(db: &Path, shared: &rusqlite::Error, alone: &rusqlite::Error) -> String {
    use rusqlite::ffi::{
        SQLITE_IOERR_SHMLOCK, SQLITE_IOERR_SHMMAP, SQLITE_IOERR_SHMOPEN, SQLITE_IOERR_SHMSIZE,
    };
    let extended = |e: &rusqlite::Error| match e {
        rusqlite::Error::SqliteFailure(f, _) => f.extended_code,
        _ => 0,
    };
    let shm = [
        SQLITE_IOERR_SHMOPEN,
        SQLITE_IOERR_SHMSIZE,
        SQLITE_IOERR_SHMLOCK,
        SQLITE_IOERR_SHMMAP,
    ];
    let no_shm = shm.contains(&extended(shared)).then(|| {
        "its filesystem cannot map WAL's index into shared memory (as FUSE cannot)".to_owned()
    });
    let why = no_shm
        .or_else(|| unwritable(db))
        .or_else(|| files(db)[1..].iter().find_map(|(path, _)| denied(path)))
        .unwrap_or_else(|| shared.to_string());
    format!("{why}, and without it: {alone}")
}

/// A catalog in WAL mode that could not be switched back here, and why: commands go on without it,
/// and `doctor --repair` sets it aside with its WAL files.
#[derive(Debug, thiserror::Error)]
#[error(
    "catalog {} was switched to WAL by another program and cannot be switched back here: {why}; '{STOWAGE} doctor --repair' sets it aside and makes it anew",
    db.display()
)]
pub struct StuckInWal {
    pub db: PathBuf,
    pub why: String,
}

/// Switches a database put in WAL mode back to the rollback journal, retrying while busy.
fn leave_wal(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    let until = std::time::Instant::now() + busy_timeout();
    loop {
        match conn.pragma_update(None, "journal_mode", "DELETE") {
            Err(rusqlite::Error::SqliteFailure(f, _))
                if BUSY.contains(&f.code)
                    && std::time::Instant::now() < until
                    && crate::signals::cancelled().is_none() =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

/// The catalog's schema is a release's before records: the store must be migrated first.
#[derive(Debug, thiserror::Error)]
#[error("the store is being migrated to image records, or must be first ('stowage doctor' tells)")]
pub struct NeedsMigration;

/// What a store without a configuration holds of a release before records ([`legacy_state`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Legacy {
    /// This store's catalog of that release, at this schema version.
    Catalog(i64),
    /// That release's tokens in the image lock files, its catalog lost (missing, damaged…): why.
    Lost(String),
}

/// What `root` holds of a release before records: its catalog ([`inspect_in`]) or, that lost, its
/// tokens. Err only if busy (waited for once per process). Opened rw where it may be: rolls back.
pub fn legacy_state(root: &Root) -> Result<Option<Legacy>> {
    static BUSY_SEEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let path = root.db();
    let wal = check_files(&path)?.as_ref().is_some_and(says_wal) && !later_release_at(&path);
    let found = if !path.is_file() {
        Ok(Found::Replaced("missing".into()))
    } else if BUSY_SEEN.load(std::sync::atomic::Ordering::Relaxed) {
        // A second look gives the error without waiting again.
        let busy = rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY);
        let why = format!("{} stayed locked by another program", path.display());
        Err(rusqlite::Error::SqliteFailure(busy, Some(why)).into())
    } else {
        let left = wal.then(|| leave_outside_wal(&path)).transpose();
        left.and_then(|_| {
            let rw = connect(&path, OpenFlags::SQLITE_OPEN_READ_WRITE);
            let conn = rw.or_else(|_| connect(&path, OpenFlags::SQLITE_OPEN_READ_ONLY))?;
            inspect_in(&conn, root)
        })
    };
    let why = match found {
        Ok(Found::Legacy(v)) => return Ok(Some(Legacy::Catalog(v))),
        Ok(Found::New) => "empty".to_owned(),
        Ok(Found::Current) => "one of this release, not the older release's".to_owned(),
        Ok(Found::Replaced(why)) => why,
        Ok(Found::Newer(v)) => return Err(newer(root, v)),
        Err(e) if is_damage(&e, &path) => format!("damaged ({e:#})"),
        Err(e) if is_busy(&e) => {
            let waited = match BUSY_SEEN.swap(true, std::sync::atomic::Ordering::Relaxed) {
                true => std::time::Duration::ZERO,
                false => busy_timeout(),
            };
            return Err(crate::Error::Busy(crate::error::Busy {
                what: format!("the catalog {} (is the store to migrate?)", path.display()),
                holders: "held by a program outside stowage (an sqlite3 shell?)".into(),
                waited,
            })
            .into());
        }
        Err(e) => {
            let shown = path.display();
            return Err(e.context(format!("cannot tell whether {shown} is to be migrated")));
        }
    };
    Ok(root.older_release_left().then_some(Legacy::Lost(why)))
}

/// What the open database is, as `root`'s catalog: an older release's is one to migrate only if no
/// configuration of this release is there and the global lock file names its identity.
pub fn inspect_in(conn: &rusqlite::Connection, root: &Root) -> Result<Found> {
    let found = inspect(conn)?;
    let Found::Legacy(v) = found else {
        return Ok(found);
    };
    let id = || conn.query_row("PRAGMA application_id", [], |r| r.get::<_, i64>(0));
    let why = if root.open().is_ok_and(|d| crate::config::exists(&d)) {
        "in a store already past it"
    } else if root.own_use_recorded() {
        "in a store already past it (its images have records of this release's use)"
    // Nothing stated in the global lock file is no evidence that it is ours.
    } else if Some(id()? as u32) != root.older_release_catalog_id() {
        "not this store's (the global lock file does not name it)"
    } else {
        return Ok(found);
    };
    Ok(Found::Replaced(format!(
        "schema version {v} of a release before image records, {why}"
    )))
}

/// What the open database is: asked once per connection, before the first transaction.
pub fn inspect(conn: &rusqlite::Connection) -> Result<Found> {
    let found = inspect_schema(conn)?;
    // Switched back only once known to be no later release's: that release's file is left as is.
    let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
    if mode.eq_ignore_ascii_case("wal") && !matches!(found, Found::Newer(_)) {
        leave_wal(conn).context(SWITCHED)?;
    }
    Ok(found)
}

/// What the open database is, by its size, schema version and schema, read in one transaction.
fn inspect_schema(conn: &rusqlite::Connection) -> Result<Found> {
    // SQLite counts pages in 32 bits, taking a longer (sparse) file's count modulo 2^32, as if it
    // were empty or short: a file that long is no catalog.
    let page = conn.query_row("PRAGMA page_size", [], |r| r.get::<_, i64>(0))? as u64;
    let size = conn
        .path()
        .and_then(|db| std::fs::symlink_metadata(db).ok());
    let size = size.map_or(0, |m| m.len());
    if size / page.max(512) >= u32::MAX as u64 {
        let why = format!("{size} bytes long, more pages of {page} bytes than SQLite can count");
        return Ok(Found::Replaced(why));
    }
    // One read: a catalog being made beside us (doctor looks unlocked) is never seen half made.
    let alone = conn.is_autocommit();
    if alone {
        conn.execute_batch("BEGIN")?;
    }
    let read = || -> rusqlite::Result<(i64, Vec<[String; 3]>)> {
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        Ok((version, schema_objects(conn)?))
    };
    let read = read();
    if alone {
        let _ = conn.execute_batch("COMMIT");
    }
    let (version, objects) = read?;
    let tables: Vec<&str> = objects
        .iter()
        .filter(|[kind, ..]| kind == "table")
        .map(|[_, name, _]| name.as_str())
        .collect();
    let has = |t: &str| tables.contains(&t);
    Ok(match version {
        0 if objects.is_empty() => Found::New,
        SCHEMA if is_ours(&objects) => Found::Current,
        SCHEMA => {
            let listed: Vec<String> = objects.iter().map(|[k, n, _]| format!("{k} {n}")).collect();
            Found::Replaced(format!(
                "schema version {SCHEMA}, but not the schema stowage makes: it holds {}",
                listed.join(", ")
            ))
        }
        1..=10 if has("images") && has("records") && has("config") && legacy_columns(conn)? => {
            Found::Legacy(version)
        }
        v if v > SCHEMA && later_release(conn, &objects)? => Found::Newer(v),
        v if v > SCHEMA && is_ours(&objects) => Found::Replaced(format!(
            "schema version {v} in its header over this release's schema: damaged at its header"
        )),
        v if v > SCHEMA && has("images") && has("records") && has("config") => {
            Found::Replaced(format!(
                "schema version {v} in its header over the schema of a release before image records: damaged at its header"
            ))
        }
        _ => {
            let listed = match tables.is_empty() {
                true => "none".into(),
                false => tables.join(", "),
            };
            let why = format!("not a stowage catalog (schema version {version}, tables: {listed})");
            Found::Replaced(why)
        }
    })
}

/// Whether the database holds only the table this release makes (with or without `size_record`),
/// as made: nothing added or changed. SQLite keeps each statement as written: one read.
fn is_ours(objects: &[[String; 3]]) -> bool {
    // Spaces only where SQLite needs them: `ALTER TABLE … ADD COLUMN` appends its own way.
    let squeeze = |sql: &str| {
        let words = sql.split_whitespace().collect::<Vec<_>>().join(" ");
        ["(", ")", ","].iter().fold(words, |s, p| {
            s.replace(&format!(" {p}"), p).replace(&format!("{p} "), p)
        })
    };
    let made = squeeze(SCHEMA_SQL.trim().trim_end_matches(';')).replace(" IF NOT EXISTS", "");
    let before = made.replace(",size_record INTEGER", "");
    match objects {
        [[kind, name, sql]] => {
            kind == "table" && name == "images" && [&made, &before].contains(&&squeeze(sql))
        }
        _ => false,
    }
}

fn columns(conn: &rusqlite::Connection, table: &str) -> Result<Vec<String>> {
    let mut stmt = conn.prepare("SELECT name FROM pragma_table_info(?1)")?;
    Ok(stmt
        .query_map([table], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?)
}

/// Whether the images table has the columns releases before records gave it.
fn legacy_columns(conn: &rusqlite::Connection) -> Result<bool> {
    let cols = columns(conn, "images")?;
    Ok(["name", "state", "base", "created_ms", "last_used_ms"]
        .iter()
        .all(|c| cols.iter().any(|x| x == c)))
}

pub fn create_schema(conn: &rusqlite::Connection) -> Result<()> {
    // One transaction: a look without the global lock (doctor's) never finds the table without
    // its version (another program's database).
    let alone = conn.is_autocommit();
    if alone {
        conn.execute_batch("BEGIN IMMEDIATE")?;
    }
    let made = conn
        .execute_batch(SCHEMA_SQL)
        .and_then(|()| conn.pragma_update(None, "user_version", SCHEMA));
    if alone && made.is_err() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    made?;
    if alone {
        conn.execute_batch("COMMIT")?;
    }
    Ok(())
}

/// Gives a current catalog the columns this release added to its schema (under the global lock).
pub fn complete_schema(conn: &rusqlite::Connection) -> Result<()> {
    if !columns(conn, "images")?.iter().any(|c| c == "size_record") {
        conn.execute_batch(SIZE_RECORD_SQL)?;
    }
    Ok(())
}

impl<'a> Catalog<'a> {
    /// The catalog in a transaction `conn` has begun, under `global`.
    pub(crate) fn new(conn: &'a rusqlite::Connection, global: &'a Guard) -> Catalog<'a> {
        Catalog {
            conn,
            _global: global,
        }
    }

    pub fn rows(&self) -> Result<Vec<Row>> {
        let mut stmt = self.conn.prepare(
            "SELECT name, state, base, created_ms, last_used_ms, seq, size_bytes, size_record
             FROM images ORDER BY name",
        )?;
        Ok(stmt.query_map([], row)?.collect::<rusqlite::Result<_>>()?)
    }

    /// Makes the row of an image say what its record says now (keeping a measured size).
    pub fn upsert(&self, r: &Row) -> Result<()> {
        // Cached: a survey makes one call per image, and parsing the statement is most of its cost.
        self.conn
            .prepare_cached(
                "INSERT INTO images (name, state, base, created_ms, last_used_ms, seq)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT (name) DO UPDATE SET
                 state = excluded.state, base = excluded.base,
                 created_ms = excluded.created_ms,
                 last_used_ms = max(last_used_ms, excluded.last_used_ms),
                 seq = excluded.seq
             WHERE state IS NOT excluded.state OR base IS NOT excluded.base
                 OR created_ms IS NOT excluded.created_ms OR seq IS NOT excluded.seq
                 OR last_used_ms < excluded.last_used_ms",
            )?
            .execute(params![
                r.name,
                r.state.as_str(),
                r.base,
                r.created,
                r.last_used,
                r.seq as i64
            ])?;
        Ok(())
    }

    /// Forgets an image the records no longer have.
    pub fn remove(&self, name: &str) -> Result<()> {
        self.conn
            .prepare_cached("DELETE FROM images WHERE name = ?1")?
            .execute([name])?;
        Ok(())
    }

    /// Forgets every size kept: trees a store-wide command may have changed, their records not.
    pub fn forget_sizes(&self) -> Result<()> {
        let sql = "UPDATE images SET size_bytes = NULL, size_seq = NULL, size_record = NULL";
        self.conn.execute(sql, [])?;
        Ok(())
    }

    /// Keeps a size measured for the tree `record` describes (and its `seq`, for older releases).
    pub fn set_size(&self, name: &str, record: &Record, size: u64) -> Result<()> {
        let sql =
            "UPDATE images SET size_bytes = ?2, size_seq = ?3, size_record = ?4 WHERE name = ?1";
        let (size, seq, fingerprint) =
            (size as i64, record.seq as i64, record.fingerprint() as i64);
        let stmt = &mut self.conn.prepare_cached(sql)?;
        stmt.execute(params![name, size, seq, fingerprint])?;
        Ok(())
    }
}

fn row(r: &rusqlite::Row) -> rusqlite::Result<Row> {
    let state: String = r.get(1)?;
    Ok(Row {
        name: r.get(0)?,
        state: State::parse(&state).unwrap_or(State::Incomplete),
        base: r.get(2)?,
        created: r.get(3)?,
        last_used: r.get(4)?,
        seq: r.get::<_, i64>(5)? as u64,
        size: r.get::<_, Option<i64>>(6)?.map(|s| s.max(0) as u64),
        size_record: r.get::<_, Option<i64>>(7)?.map(|s| s as u64),
    })
}

/// Makes the database group-writable when we own it (a group's store), through a descriptor opened
/// with no link in any component, refusing a file with other names (hard links).
pub fn share_with_group(path: &Path) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let why = || format!("cannot share {} with its group", path.display());
    let f = crate::planted::open(path, libc::O_RDONLY, 0).with_context(why)?;
    let m = f.metadata()?;
    if m.nlink() > 1 {
        let links = "it has other names (hard links), which may be outside the store";
        return Err(anyhow::Error::msg(links)).with_context(why);
    }
    if m.uid() == nix::unistd::geteuid().as_raw() && m.mode() & 0o060 != 0o060 {
        f.set_permissions(std::fs::Permissions::from_mode((m.mode() | 0o060) & 0o7777))
            .with_context(why)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> (tempfile::TempDir, rusqlite::Connection) {
        let d = tempfile::tempdir().unwrap();
        let conn = open(&d.path().join("stowage.db")).unwrap();
        (d, conn)
    }

    #[test]
    fn a_new_file_is_new_and_gets_the_schema_once() {
        let (_d, conn) = fresh();
        assert_eq!(inspect(&conn).unwrap(), Found::New);
        create_schema(&conn).unwrap();
        create_schema(&conn).unwrap();
        assert_eq!(inspect(&conn).unwrap(), Found::Current);
    }

    #[test]
    fn another_programs_database_is_foreign() {
        let (_d, conn) = fresh();
        conn.execute_batch("CREATE TABLE t (x); PRAGMA user_version = 3;")
            .unwrap();
        assert!(matches!(inspect(&conn).unwrap(), Found::Replaced(..)));
    }

    #[test]
    fn a_size_is_current_only_for_the_record_it_was_measured_for() {
        use crate::image_record::{ImagesDir, Record};
        let mut measured = Record::new("a", ImagesDir::Default, 1_000);
        measured.seq = 3;
        let r = Row {
            name: "a".into(),
            state: State::Ready,
            base: None,
            created: 0,
            last_used: 0,
            seq: 3,
            size: Some(10),
            size_record: Some(measured.fingerprint()),
        };
        assert_eq!(r.size_for(&measured), Some(10));
        let mut later = measured.clone();
        later.seq = 4;
        assert_eq!(r.size_for(&later), None);
        // The same name and sequence number, made anew (after an `rm`, or in another store).
        measured.created = 2_000;
        assert_eq!(r.size_for(&measured), None);
    }

    #[test]
    fn a_catalog_of_schema_11_gets_the_size_record_column_once() {
        let (_d, conn) = fresh();
        conn.execute_batch(&SCHEMA_SQL.replace(",\n    size_record  INTEGER", ""))
            .unwrap();
        conn.pragma_update(None, "user_version", SCHEMA).unwrap();
        assert_eq!(inspect(&conn).unwrap(), Found::Current);
        complete_schema(&conn).unwrap();
        complete_schema(&conn).unwrap();
        let images = columns(&conn, "images").unwrap();
        assert!(images.contains(&"size_record".to_owned()));
        assert_eq!(inspect(&conn).unwrap(), Found::Current);
    }

    #[test]
    fn our_version_over_another_schema_is_not_ours() {
        let trigger = "CREATE TRIGGER t AFTER UPDATE ON images BEGIN SELECT 1; END;";
        let check = SCHEMA_SQL.replace("size_record  INTEGER", "size_record INTEGER CHECK (1)");
        let made = |sql: &str| {
            let (_d, conn) = fresh();
            conn.execute_batch(sql).unwrap();
            conn.pragma_update(None, "user_version", SCHEMA).unwrap();
            inspect(&conn).unwrap()
        };
        for sql in [
            "CREATE TABLE images (size_seq);",
            &check,
            &format!("{SCHEMA_SQL} {trigger}"),
            &format!("{SCHEMA_SQL} CREATE INDEX i ON images (seq);"),
        ] {
            assert!(matches!(made(sql), Found::Replaced(..)), "{sql}");
        }
        assert_eq!(made(SCHEMA_SQL), Found::Current);
    }

    #[test]
    fn a_fifo_at_the_catalog_is_refused_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("stowage.db");
        nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = open(&p).err().unwrap();
        assert!(format!("{e:#}").contains("is a FIFO"), "{e:#}");
    }
}
