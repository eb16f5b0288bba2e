//! The metadata: an SQLite database at `ROOT/stowage.db`.
//!
//! Invariants:
//! - The database is read and written only inside a [`Tx`], and a `Tx` owns
//!   the global lock: the type system makes "only while the global lock is
//!   held" impossible to get wrong. SQLite's own locks are then never
//!   contended by stowage, only by outside programs.
//! - Rollback journal, never WAL: WAL needs shared memory between the
//!   processes that open the database, which NFS cannot provide.
//! - The schema is an append-only list of migrations keyed on
//!   `PRAGMA user_version`. Never remove or edit a migration; add a new one.
//!   Migrating is a store-wide operation (see `store.rs`).
//! - Rows are information about images and lock holders; the image
//!   directories and the kernel's lock table are the truth, and the database
//!   can be rebuilt from the images directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rusqlite::{OptionalExtension, params};

use crate::clock::Millis;
use crate::lock::{self, Mode};

/// The schema, one migration per entry. Append only.
const MIGRATIONS: &[&str] = &[
    // 1: images, holder/waiter records, settings.
    r#"
    CREATE TABLE config (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE images (
        name         TEXT PRIMARY KEY,
        state        TEXT NOT NULL CHECK (state IN
                         ('creating', 'writing', 'ready', 'incomplete', 'deleting')),
        base         TEXT,
        created_ms   INTEGER NOT NULL,
        last_used_ms INTEGER NOT NULL,
        size_bytes   INTEGER
    ) WITHOUT ROWID;
    CREATE INDEX images_by_last_use ON images (last_used_ms);
    CREATE TABLE records (
        id        INTEGER PRIMARY KEY,
        kind      TEXT NOT NULL CHECK (kind IN ('global', 'image', 'slot')),
        name      TEXT NOT NULL,
        lockfile  TEXT NOT NULL,
        role      TEXT NOT NULL CHECK (role IN ('holder', 'waiter')),
        mode      TEXT NOT NULL CHECK (mode IN ('shared', 'exclusive')),
        pid       INTEGER NOT NULL,
        pid_start INTEGER,
        host      TEXT NOT NULL,
        boot_id   TEXT,
        user      TEXT NOT NULL,
        command   TEXT NOT NULL,
        since_ms  INTEGER NOT NULL
    );
    CREATE INDEX records_by_lock ON records (kind, name);
    "#,
    // 2: slot classes (counting semaphores per runtime).
    r#"
    CREATE TABLE slot_classes (
        name         TEXT PRIMARY KEY,
        lim          INTEGER NOT NULL CHECK (lim >= 0),
        reserve_high INTEGER NOT NULL DEFAULT 0 CHECK (reserve_high >= 0)
    ) WITHOUT ROWID;
    "#,
    // 3: every exec updates last_used, and an index on it cost a page write
    // each time for nothing (gc orders images in memory); whoever looks for
    // dead writers scans only images in flux, which a partial index keeps
    // tiny however many images there are.
    r#"
    DROP INDEX images_by_last_use;
    CREATE INDEX images_in_flux ON images (state)
        WHERE state IN ('creating', 'writing', 'deleting');
    "#,
    // 4: each record names its owner's lease (lease.rs), which is how its
    // liveness is judged on any host and in any pid namespace. NULL in
    // records written before: those are judged by pid as they were.
    r#"
    ALTER TABLE records ADD COLUMN lease TEXT;
    "#,
    // 5: image lock files carry ready tokens (record.rs), which every binary
    // that changes an image's state must invalidate first: the version
    // locks older binaries out of a store that has them.
    r#"
    INSERT OR REPLACE INTO config (key, value) VALUES ('image_records', '1');
    "#,
    // 6: slot files carry their class's limits (slot_record.rs), which
    // every binary that changes a class must rewrite: the version locks
    // older binaries out of a store that has them.
    r#"
    INSERT OR REPLACE INTO config (key, value) VALUES ('slot_records', '1');
    "#,
    // 7: every slot class has its directory under locks/slots, and an
    // unlimited one a `0.lock` carrying its record (slots.rs), so that
    // lock-status can list the classes without the database (idle.rs): the
    // version locks out older binaries, which make a class without its
    // directory. The migration makes the directories (store.rs).
    r#"
    INSERT OR REPLACE INTO config (key, value) VALUES ('slot_class_dirs', '1');
    "#,
    // 8: writers may rewrite an image without a transaction, leaving a
    // marker (written.rs) that every binary must fold into the rows before
    // it reads them: the version locks older binaries out of such a store.
    r#"
    INSERT OR REPLACE INTO config (key, value) VALUES ('writer_records', '1');
    "#,
    // 9: readers trust ready tokens and slot records without the database's
    // header, because every binary that uses the database first takes away
    // the records of any other database it finds the store's lock files
    // speaking for (record.rs, "The records' database"): the version locks
    // out older binaries, which renew an identity without doing so.
    r#"
    INSERT OR REPLACE INTO config (key, value) VALUES ('records_database', '1');
    "#,
    // 10: a new image may be written without the database (written.rs):
    // its tree has no row until the next transaction folds its record, so
    // every binary must leave such a tree alone (adoption, cleanup of lock
    // files without rows): the version locks older binaries out.
    r#"
    INSERT OR REPLACE INTO config (key, value) VALUES ('new_images_alone', '1');
    "#,
];

/// The schema version this binary writes.
pub fn schema_version() -> i64 {
    let all = MIGRATIONS.len() as i64;
    std::env::var(crate::env::DEBUG_SCHEMA_LIMIT)
        .ok()
        .and_then(|v| v.parse::<i64>().ok())
        .map_or(all, |n| n.clamp(1, all))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageState {
    Creating,
    Writing,
    Ready,
    Incomplete,
    Deleting,
}

impl ImageState {
    pub fn as_str(self) -> &'static str {
        match self {
            ImageState::Creating => "creating",
            ImageState::Writing => "writing",
            ImageState::Ready => "ready",
            ImageState::Incomplete => "incomplete",
            ImageState::Deleting => "deleting",
        }
    }

    fn parse(s: &str) -> ImageState {
        match s {
            "creating" => ImageState::Creating,
            "writing" => ImageState::Writing,
            "ready" => ImageState::Ready,
            "deleting" => ImageState::Deleting,
            // The CHECK constraint admits nothing else; treat the impossible
            // as the safe choice.
            _ => ImageState::Incomplete,
        }
    }

    /// A writer is (or was) at work: if its lock is free, it died.
    pub fn being_written(self) -> bool {
        matches!(self, ImageState::Creating | ImageState::Writing)
    }
}

impl std::fmt::Display for ImageState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone)]
pub struct ImageRow {
    pub name: String,
    pub state: ImageState,
    pub base: Option<String>,
    pub created: Millis,
    pub last_used: Millis,
    pub size_bytes: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockKind {
    Global,
    Image,
    Slot,
}

impl LockKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LockKind::Global => "global",
            LockKind::Image => "image",
            LockKind::Slot => "slot",
        }
    }

    fn parse(s: &str) -> LockKind {
        match s {
            "global" => LockKind::Global,
            "slot" => LockKind::Slot,
            _ => LockKind::Image,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Holder,
    Waiter,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::Holder => "holder",
            Role::Waiter => "waiter",
        }
    }
}

/// Who holds or awaits a lock, as recorded by stowage.
#[derive(Debug, Clone)]
pub struct Record {
    pub id: i64,
    pub kind: LockKind,
    /// Image name or slot class.
    pub name: String,
    /// The lock file, relative to `ROOT/locks`.
    pub lockfile: String,
    pub role: Role,
    pub mode: Mode,
    pub pid: u32,
    pub pid_start: Option<u64>,
    pub host: String,
    pub boot_id: Option<String>,
    pub user: String,
    pub command: String,
    pub since: Millis,
    /// The file name of the owner's lease under `ROOT/locks/leases` (None
    /// for records of older releases). `Ctx::record` fills it in for this
    /// process's own records.
    pub lease: Option<String>,
}

impl Record {
    /// A record of this process for a lock it holds or awaits, from now.
    pub fn ours(
        me: &crate::ident::Me,
        kind: LockKind,
        name: &str,
        lockfile: String,
        role: Role,
        mode: Mode,
        command: &str,
    ) -> Record {
        Record {
            id: 0,
            kind,
            name: name.to_owned(),
            lockfile,
            role,
            mode,
            pid: me.pid,
            pid_start: me.pid_start,
            host: me.host.clone(),
            boot_id: me.boot_id.clone(),
            user: me.user.clone(),
            command: command.to_owned(),
            since: crate::clock::now_ms(),
            lease: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct SlotClass {
    pub name: String,
    pub limit: u32,
    pub reserve_high: u32,
}

/// A stowage process runs a few tiny transactions and exits. SQLite's
/// defaults are for long-lived connections: per-connection lookaside memory
/// and a bulk page-cache allocation made up front, all of it touched (page
/// faults) before the first query. Without them each process starts
/// measurably faster; nothing is lost for transactions this small.
fn configure_sqlite() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use rusqlite::ffi;
        // SAFETY: sqlite3_config before any connection is opened (and so
        // before SQLite initialises), with the argument types each option
        // documents. A refusal (SQLITE_MISUSE, if something initialised
        // SQLite already) only keeps the defaults.
        unsafe {
            ffi::sqlite3_config(
                ffi::SQLITE_CONFIG_LOOKASIDE,
                0 as libc::c_int,
                0 as libc::c_int,
            );
            ffi::sqlite3_config(
                ffi::SQLITE_CONFIG_PAGECACHE,
                std::ptr::null_mut::<libc::c_void>(),
                0 as libc::c_int,
                0 as libc::c_int,
            );
            ffi::sqlite3_config(ffi::SQLITE_CONFIG_MEMSTATUS, 0 as libc::c_int);
        }
    });
}

/// An error whose message already names the metadata database, to which
/// [`annotate`] adds nothing.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DatabaseError(pub String);

/// Opens the database file. Never follows a symlink at the database path.
/// Gives the database the identity `id` (SQLite's `application_id`, in
/// its header), which ready tokens name (record.rs).
pub fn set_identity(conn: &rusqlite::Connection, id: u32) -> Result<()> {
    conn.pragma_update(None, "application_id", id as i32)?;
    Ok(())
}

pub fn open(path: &Path) -> Result<rusqlite::Connection> {
    use rusqlite::OpenFlags;
    configure_sqlite();
    // SQLITE_OPEN_NOFOLLOW refuses a symlink itself (no stat of ours).
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_NOFOLLOW;
    let conn = rusqlite::Connection::open_with_flags(path, flags).map_err(|e| match e {
        rusqlite::Error::SqliteFailure(f, _)
            if f.extended_code == rusqlite::ffi::SQLITE_CANTOPEN_SYMLINK =>
        {
            DatabaseError(format!(
                "metadata database {} is a symlink; refusing to open it",
                path.display()
            ))
        }
        // SQLite's error repeats its message in its source: say it once.
        e => DatabaseError(format!(
            "cannot open metadata database {}: {e}",
            path.display()
        )),
    })?;
    // Only outside programs (an sqlite3 shell) can hold SQLite's own locks
    // while we hold the global lock; give them a moment, then say so.
    conn.busy_timeout(busy_timeout())?;
    Ok(conn)
}

/// Names the database in an SQLite error that does not say which file it is
/// about, and says what to do about a full disk.
pub fn annotate(err: anyhow::Error, db: &Path) -> anyhow::Error {
    let sqlite = err
        .chain()
        .find_map(|e| e.downcast_ref::<rusqlite::Error>());
    let Some(sqlite) = sqlite else { return err };
    if err.downcast_ref::<DatabaseError>().is_some() {
        return err;
    }
    let full = matches!(sqlite, rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DiskFull);
    let hint = if full {
        " (no space left on its filesystem: free some with 'stowage rm IMAGE' or 'stowage gc')"
    } else {
        ""
    };
    err.context(format!("metadata database {}{hint}", db.display()))
}

/// Journals in memory and never spills the page cache to the file (`on`),
/// for a transaction that is rolled back and must need no disk space; or
/// back to the rollback journal on disk.
pub fn journal_in_memory(conn: &rusqlite::Connection, on: bool) -> rusqlite::Result<()> {
    conn.execute_batch(if on {
        "PRAGMA journal_mode = MEMORY; PRAGMA cache_spill = OFF;"
    } else {
        "PRAGMA journal_mode = DELETE; PRAGMA cache_spill = ON;"
    })
}

/// Switches a database some outside program put in WAL mode back to the
/// rollback journal (WAL's index in shared memory is unsafe on NFS).
///
/// SQLite asks for the exclusive lock this needs without its busy handler:
/// while the outside program still has the database open the switch fails
/// at once with SQLITE_BUSY. It is tried again for as long as any other
/// statement would wait ([`busy_timeout`]), so an outside program that
/// closes the database in time costs a moment, not a failed command, and
/// the "gave up after 10 s" said on failure is true.
pub fn leave_wal(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    let until = std::time::Instant::now() + busy_timeout();
    loop {
        match conn.pragma_update(None, "journal_mode", "DELETE") {
            Err(rusqlite::Error::SqliteFailure(f, _))
                if matches!(
                    f.code,
                    rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
                ) && std::time::Instant::now() < until
                    // A signal to an exec ends the wait now, not in 10 s.
                    && crate::signals::cancelled().is_none() =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

/// SQLite's quick integrity check ("ok" when sound) and the schema version.
pub fn quick_check(conn: &rusqlite::Connection) -> rusqlite::Result<(String, i64)> {
    let check: String = conn.query_row("PRAGMA quick_check", [], |r| r.get(0))?;
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    Ok((check, version))
}

/// Makes the database group-writable if we own it and it is not already.
pub fn share_with_group(path: &Path) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let m = std::fs::metadata(path)?;
    if m.uid() == nix::unistd::geteuid().as_raw() && m.mode() & 0o060 != 0o060 {
        std::fs::set_permissions(
            path,
            std::fs::Permissions::from_mode((m.mode() | 0o060) & 0o7777),
        )
        .with_context(|| format!("cannot share {} with its group", path.display()))?;
    }
    Ok(())
}

/// How long to wait for SQLite's own lock, held only by outside programs.
/// `STOWAGE_DEBUG_DB_BUSY_MS` shortens it for tests.
pub fn busy_timeout() -> std::time::Duration {
    let ms = std::env::var(crate::env::DEBUG_DB_BUSY_MS)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    std::time::Duration::from_millis(ms)
}

/// Is this error SQLite saying its lock stayed busy?
pub fn is_busy(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        matches!(
            e.downcast_ref::<rusqlite::Error>(),
            Some(rusqlite::Error::SqliteFailure(f, _))
                if matches!(f.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
        )
    })
}

/// Is this error SQLite saying the file is not a healthy database?
pub fn is_corruption(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        matches!(
            e.downcast_ref::<rusqlite::Error>(),
            Some(rusqlite::Error::SqliteFailure(f, _))
                if matches!(f.code, rusqlite::ErrorCode::DatabaseCorrupt | rusqlite::ErrorCode::NotADatabase)
        )
    })
}

/// Schema status of a database, read inside a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schema {
    Current,
    /// Older than this binary: a store-wide migration is needed.
    Behind(i64),
    /// Newer than this binary: refuse to touch it.
    Ahead(i64),
}

/// A metadata transaction. It owns the global lock, which it releases after
/// the transaction ends (commit or rollback on drop).
pub struct Tx<'c> {
    // Declared before the guard so that it ends first on drop.
    tx: rusqlite::Transaction<'c>,
    global: lock::Guard,
}

impl<'c> Tx<'c> {
    /// Begins a write transaction; `global` proves the global lock is held.
    pub fn begin(conn: &'c mut rusqlite::Connection, global: lock::Guard) -> Result<Tx<'c>> {
        // `&mut` is what guarantees no other transaction is open on this
        // connection, as `Connection::transaction` would.
        Self::begin_on(conn, global)
    }

    /// [`Tx::begin`] on a connection the caller borrows mutably and on
    /// which it has no other transaction open (so that it can begin again
    /// after a rollback on the same borrow).
    pub(crate) fn begin_on(conn: &'c rusqlite::Connection, global: lock::Guard) -> Result<Tx<'c>> {
        let tx =
            rusqlite::Transaction::new_unchecked(conn, rusqlite::TransactionBehavior::Immediate)?;
        Ok(Tx { tx, global })
    }

    /// Whether the database is in WAL mode, as the header SQLite read at
    /// the transaction's start says (no system call): only an outside
    /// program (an sqlite3 shell) puts it there, and WAL's index lives in
    /// shared memory that NFS cannot share.
    pub fn in_wal(&self) -> Result<bool> {
        let mode: String = self
            .tx
            .pragma_query_value(None, "journal_mode", |r| r.get(0))?;
        Ok(mode.eq_ignore_ascii_case("wal"))
    }

    /// Rolls back and hands back the global lock (to leave WAL mode, which
    /// no transaction may do, and begin again under the same lock).
    /// One that SQLite already ended ([`Tx::ended`]) is only let go.
    pub fn rollback_keeping_global(self) -> Result<lock::Guard> {
        let Tx { tx, global } = self;
        if !tx.is_autocommit() {
            tx.rollback()?;
        }
        Ok(global)
    }

    /// Whether SQLite ended this transaction itself: some errors (a full
    /// filesystem, SQLITE_FULL; an I/O error) roll the whole transaction
    /// back, and the statements after them would each run on their own.
    pub fn ended(&self) -> bool {
        self.tx.is_autocommit()
    }

    /// Gives a database without an identity (a new one, a rebuilt one, one
    /// made by an older release) one, which ready tokens name (record.rs).
    /// Asked inside a transaction that has read the header anyway, this
    /// costs no system call.
    pub fn settle_header(&mut self) -> Result<()> {
        if self.identity()? == 0 {
            // Best effort: without one (a read-only or full store) no token
            // is written or trusted, and reads take the database's way. A
            // failure may have ended the transaction: see `store::begin_tx`.
            let _ = self.renew_identity();
        }
        Ok(())
    }

    pub fn commit(self) -> Result<()> {
        self.commit_keeping_global().map(drop)
    }

    /// Commits and hands back the global lock, for a step that must follow
    /// the commit under the same lock (putting a rebuilt database in place).
    pub fn commit_keeping_global(self) -> Result<lock::Guard> {
        self.tx.commit()?;
        Ok(self.global)
    }

    /// Device and inode of the global lock this transaction holds.
    /// The global lock file, held: where the records' database is kept
    /// (record.rs).
    pub fn global_file(&self) -> &std::fs::File {
        self.global.file()
    }

    pub fn global_identity(&self) -> (u64, u64) {
        self.global.identity()
    }

    pub fn schema(&self) -> Result<Schema> {
        let v: i64 = self.tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        let ours = schema_version();
        Ok(match v {
            v if v == ours => Schema::Current,
            v if v < ours => Schema::Behind(v),
            v => Schema::Ahead(v),
        })
    }

    /// Applies the migrations this database lacks. The caller must have
    /// made sure no image lock is held (a store-wide operation).
    pub fn migrate(&self) -> Result<()> {
        let have: i64 = self.tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        let want = schema_version();
        for (i, sql) in MIGRATIONS
            .iter()
            .enumerate()
            .take(want as usize)
            .skip(have.max(0) as usize)
        {
            self.tx
                .execute_batch(sql)
                .with_context(|| format!("schema migration {} failed", i + 1))?;
        }
        self.tx.pragma_update(None, "user_version", want)?;
        Ok(())
    }

    // --- settings ---------------------------------------------------------

    pub fn config(&self, key: &str) -> Result<Option<String>> {
        Ok(self
            .tx
            .query_row("SELECT value FROM config WHERE key = ?1", [key], |r| {
                r.get(0)
            })
            .optional()?)
    }

    /// The database's identity (see [`set_identity`]; 0: none), read by
    /// SQLite inside the transaction — not through a descriptor of our own,
    /// whose close would drop SQLite's POSIX locks in this process.
    pub fn identity(&self) -> Result<u32> {
        let id: i32 = self
            .tx
            .pragma_query_value(None, "application_id", |r| r.get(0))?;
        Ok(id as u32)
    }

    /// Gives the database a new identity (see [`set_identity`]): every
    /// ready token derived from it until now stops counting.
    pub fn renew_identity(&self) -> Result<()> {
        self.tx
            .pragma_update(None, "application_id", new_identity() as i32)?;
        Ok(())
    }

    pub fn set_config(&self, key: &str, value: &str) -> Result<()> {
        self.tx.execute(
            "INSERT INTO config (key, value) VALUES (?1, ?2)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            [key, value],
        )?;
        Ok(())
    }

    /// The images directory: the configured one, else `ROOT/img`.
    pub fn images_dir(&self, root: &crate::root::Root) -> Result<PathBuf> {
        Ok(self
            .config("images_dir")?
            .map_or_else(|| root.default_images_dir(), PathBuf::from))
    }

    // --- images -----------------------------------------------------------

    pub fn image(&self, name: &str) -> Result<Option<ImageRow>> {
        Ok(self
            .tx
            .query_row(
                "SELECT name, state, base, created_ms, last_used_ms, size_bytes
                 FROM images WHERE name = ?1",
                [name],
                image_row,
            )
            .optional()?)
    }

    pub fn images(&self) -> Result<Vec<ImageRow>> {
        let mut st = self.tx.prepare(
            "SELECT name, state, base, created_ms, last_used_ms, size_bytes
             FROM images ORDER BY name",
        )?;
        let rows = st
            .query_map([], image_row)?
            .collect::<rusqlite::Result<_>>()?;
        Ok(rows)
    }

    pub fn images_in_states(&self, states: &[ImageState]) -> Result<Vec<ImageRow>> {
        let list = states
            .iter()
            .map(|s| format!("'{}'", s.as_str()))
            .collect::<Vec<_>>()
            .join(",");
        // Repeating the partial index's own condition lets SQLite use it
        // (its planner matches that term literally): no scan of every image.
        let in_flux = if states
            .iter()
            .all(|s| s.being_written() || *s == ImageState::Deleting)
        {
            "state IN ('creating', 'writing', 'deleting') AND "
        } else {
            ""
        };
        let mut st = self.tx.prepare(&format!(
            "SELECT name, state, base, created_ms, last_used_ms, size_bytes
             FROM images WHERE {in_flux}state IN ({list}) ORDER BY name"
        ))?;
        let rows = st
            .query_map([], image_row)?
            .collect::<rusqlite::Result<_>>()?;
        Ok(rows)
    }

    pub fn image_count(&self) -> Result<u64> {
        let n: i64 = self
            .tx
            .query_row("SELECT count(*) FROM images", [], |r| r.get(0))?;
        Ok(n as u64)
    }

    pub fn insert_image(&self, row: &ImageRow) -> Result<()> {
        self.tx
            .prepare_cached(
                "INSERT INTO images (name, state, base, created_ms, last_used_ms, size_bytes)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )?
            .execute(params![
                row.name,
                row.state.as_str(),
                row.base,
                row.created,
                row.last_used,
                row.size_bytes.map(|s| s as i64)
            ])?;
        Ok(())
    }

    pub fn set_state(&self, name: &str, state: ImageState) -> Result<()> {
        self.tx.execute(
            "UPDATE images SET state = ?2 WHERE name = ?1",
            params![name, state.as_str()],
        )?;
        Ok(())
    }

    pub fn set_base(&self, name: &str, base: Option<&str>) -> Result<()> {
        self.tx.execute(
            "UPDATE images SET base = ?2 WHERE name = ?1",
            params![name, base],
        )?;
        Ok(())
    }

    pub fn touch(&self, name: &str, now: Millis) -> Result<()> {
        self.tx.execute(
            "UPDATE images SET last_used_ms = ?2 WHERE name = ?1",
            params![name, now],
        )?;
        Ok(())
    }

    pub fn set_size(&self, name: &str, size: Option<u64>) -> Result<()> {
        self.tx.execute(
            "UPDATE images SET size_bytes = ?2 WHERE name = ?1",
            params![name, size.map(|s| s as i64)],
        )?;
        Ok(())
    }

    /// Records a size measured from `seen` only if the row is still as it
    /// was then (same state, creation, last use) and its size still
    /// unknown; returns whether it was recorded. A measurement races with
    /// writers: one that finished meanwhile has recorded its own size.
    pub fn set_size_if_unchanged(&self, seen: &ImageRow, size: u64) -> Result<bool> {
        let n = self.tx.execute(
            "UPDATE images SET size_bytes = ?2
             WHERE name = ?1 AND size_bytes IS NULL AND state = ?3
               AND created_ms = ?4 AND last_used_ms = ?5",
            params![
                seen.name,
                size as i64,
                seen.state.as_str(),
                seen.created,
                seen.last_used
            ],
        )?;
        Ok(n > 0)
    }

    pub fn delete_image(&self, name: &str) -> Result<()> {
        self.tx
            .execute("DELETE FROM images WHERE name = ?1", [name])?;
        Ok(())
    }

    // --- holder and waiter records ------------------------------------------

    /// Inserts a record.
    pub fn insert_record(&self, r: &Record) -> Result<i64> {
        // A binary playing an older release (the schema hook) writes no
        // lease, as that release did.
        let leased = schema_version() >= LEASE_SCHEMA;
        let lease = if leased { r.lease.clone() } else { None };
        // Ids are never reused (SQLite would give a deleted largest id to
        // the next row): a process deletes its own record by the id it was
        // given, possibly transactions later, after someone else dropped
        // that record as stale — by then a reused id would name another
        // process's record (a store-wide hold's, whose loss lets image
        // users run beside its command). A random id is fresh.
        let id = fresh_record_id();
        let sql = if leased {
            "INSERT INTO records (kind, name, lockfile, role, mode, pid, pid_start, host,
                                  boot_id, user, command, since_ms, id, lease)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)"
        } else {
            "INSERT INTO records (kind, name, lockfile, role, mode, pid, pid_start, host,
                                  boot_id, user, command, since_ms, id)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"
        };
        let base = params![
            r.kind.as_str(),
            r.name,
            r.lockfile,
            r.role.as_str(),
            r.mode.as_str(),
            r.pid,
            r.pid_start.map(|t| t as i64),
            r.host,
            r.boot_id,
            r.user,
            r.command,
            r.since,
        ];
        let mut all: Vec<&dyn rusqlite::ToSql> = base.to_vec();
        all.push(&id);
        if leased {
            all.push(&lease);
        }
        self.tx.execute(sql, all.as_slice())?;
        Ok(id)
    }

    pub fn delete_record(&self, id: i64) -> Result<()> {
        self.tx.execute("DELETE FROM records WHERE id = ?1", [id])?;
        Ok(())
    }

    /// Holder records for an image lock in `mode` (or any mode) — used to
    /// drop records that the caller's own lock proves stale.
    pub fn delete_image_holders(&self, name: &str, mode: Option<Mode>) -> Result<usize> {
        let n = match mode {
            Some(m) => self.tx.execute(
                "DELETE FROM records WHERE kind = 'image' AND name = ?1 AND role = 'holder' AND mode = ?2",
                params![name, m.as_str()],
            )?,
            None => self.tx.execute(
                "DELETE FROM records WHERE kind = 'image' AND name = ?1 AND role = 'holder'",
                [name],
            )?,
        };
        Ok(n)
    }

    pub fn records_for(&self, kind: LockKind, name: &str) -> Result<Vec<Record>> {
        let mut st = self.tx.prepare_cached(&format!(
            "{} WHERE kind = ?1 AND name = ?2 ORDER BY since_ms, id",
            record_select()
        ))?;
        let rows = st
            .query_map(params![kind.as_str(), name], record_row)?
            .collect::<rusqlite::Result<_>>()?;
        Ok(rows)
    }

    pub fn all_records(&self) -> Result<Vec<Record>> {
        let mut st = self
            .tx
            .prepare(&format!("{} ORDER BY since_ms, id", record_select()))?;
        let rows = st
            .query_map([], record_row)?
            .collect::<rusqlite::Result<_>>()?;
        Ok(rows)
    }

    // --- slot classes ---------------------------------------------------------

    pub fn slot_classes(&self) -> Result<Vec<SlotClass>> {
        let mut st = self
            .tx
            .prepare("SELECT name, lim, reserve_high FROM slot_classes ORDER BY name")?;
        let rows = st
            .query_map([], slot_row)?
            .collect::<rusqlite::Result<_>>()?;
        Ok(rows)
    }

    pub fn slot_class(&self, name: &str) -> Result<Option<SlotClass>> {
        Ok(self
            .tx
            .query_row(
                "SELECT name, lim, reserve_high FROM slot_classes WHERE name = ?1",
                [name],
                slot_row,
            )
            .optional()?)
    }

    pub fn set_slot_class(&self, class: &SlotClass) -> Result<()> {
        self.tx.execute(
            "INSERT INTO slot_classes (name, lim, reserve_high) VALUES (?1, ?2, ?3)
             ON CONFLICT (name) DO UPDATE SET lim = excluded.lim, reserve_high = excluded.reserve_high",
            params![class.name, class.limit, class.reserve_high],
        )?;
        Ok(())
    }

    pub fn delete_slot_class(&self, name: &str) -> Result<bool> {
        Ok(self
            .tx
            .execute("DELETE FROM slot_classes WHERE name = ?1", [name])?
            > 0)
    }

    /// Raw access, for tests that inspect the schema.
    #[cfg(test)]
    pub fn sql(&self) -> &rusqlite::Connection {
        &self.tx
    }
}

/// The first schema whose records name a lease.
const LEASE_SCHEMA: i64 = 4;

fn record_select() -> &'static str {
    if schema_version() >= LEASE_SCHEMA {
        "SELECT id, kind, name, lockfile, role, mode, pid, pid_start, host, boot_id,
                user, command, since_ms, lease FROM records"
    } else {
        "SELECT id, kind, name, lockfile, role, mode, pid, pid_start, host, boot_id,
                user, command, since_ms, NULL FROM records"
    }
}

fn image_row(r: &rusqlite::Row) -> rusqlite::Result<ImageRow> {
    Ok(ImageRow {
        name: r.get(0)?,
        state: ImageState::parse(&r.get::<_, String>(1)?),
        base: r.get(2)?,
        created: r.get(3)?,
        last_used: r.get(4)?,
        size_bytes: r.get::<_, Option<i64>>(5)?.map(|s| s.max(0) as u64),
    })
}

fn record_row(r: &rusqlite::Row) -> rusqlite::Result<Record> {
    Ok(Record {
        id: r.get(0)?,
        kind: LockKind::parse(&r.get::<_, String>(1)?),
        name: r.get(2)?,
        lockfile: r.get(3)?,
        role: if r.get::<_, String>(4)? == "waiter" {
            Role::Waiter
        } else {
            Role::Holder
        },
        mode: Mode::parse(&r.get::<_, String>(5)?).unwrap_or(Mode::Exclusive),
        pid: r.get(6)?,
        pid_start: r.get::<_, Option<i64>>(7)?.map(|t| t as u64),
        host: r.get(8)?,
        boot_id: r.get(9)?,
        user: r.get(10)?,
        command: r.get(11)?,
        since: r.get(12)?,
        lease: r.get(13)?,
    })
}

fn slot_row(r: &rusqlite::Row) -> rusqlite::Result<SlotClass> {
    Ok(SlotClass {
        name: r.get(0)?,
        limit: r.get(1)?,
        reserve_high: r.get(2)?,
    })
}

#[derive(Default)]
pub struct Salvage {
    pub images: std::collections::HashMap<String, ImageRow>,
    pub config: std::collections::HashMap<String, String>,
    /// None when the table could not be read at all.
    pub slot_classes: Option<Vec<SlotClass>>,
}

/// Reads what it can from a damaged database, table by table.
pub fn salvage(db: &Path) -> Salvage {
    let mut out = Salvage::default();
    let Ok(conn) = rusqlite::Connection::open_with_flags(
        db,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NOFOLLOW,
    ) else {
        return out;
    };
    if let Ok(mut st) =
        conn.prepare("SELECT name, state, base, created_ms, last_used_ms, size_bytes FROM images")
    {
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<String>>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, i64>(4)?,
                r.get::<_, Option<i64>>(5)?,
            ))
        });
        if let Ok(rows) = rows {
            for (name, state, base, created, last_used, size) in rows.flatten() {
                let state = match state.as_str() {
                    "ready" => ImageState::Ready,
                    _ => ImageState::Incomplete,
                };
                out.images.insert(
                    name.clone(),
                    ImageRow {
                        name,
                        state,
                        base,
                        created,
                        last_used,
                        size_bytes: size.map(|s| s.max(0) as u64),
                    },
                );
            }
        }
    }
    if let Ok(mut st) = conn.prepare("SELECT key, value FROM config")
        && let Ok(rows) = st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
    {
        out.config = rows.flatten().collect();
    }
    if let Ok(mut st) = conn.prepare("SELECT name, lim, reserve_high FROM slot_classes")
        && let Ok(rows) = st.query_map([], |r| {
            Ok(SlotClass {
                name: r.get(0)?,
                limit: r.get(1)?,
                reserve_high: r.get(2)?,
            })
        })
    {
        out.slot_classes = Some(rows.flatten().collect());
    }
    out
}

/// A fresh database identity: random, never 0 (which means none).
pub fn new_identity() -> u32 {
    loop {
        let mut buf = [0u8; 4];
        // SAFETY: getrandom writes at most buf.len() bytes into buf.
        let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
        let id = u32::from_ne_bytes(buf);
        if n == 4 && id != 0 {
            return id;
        }
        if n < 0 {
            // No entropy source: time and pid, still never 0.
            let t = crate::clock::now_ms() as u32 ^ (std::process::id() << 16);
            return t.max(1);
        }
    }
}

/// A record id no record has had: random, positive (2^63 of them).
fn fresh_record_id() -> i64 {
    let mut buf = [0u8; 8];
    // SAFETY: getrandom writes at most buf.len() bytes into buf.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    let r = if n == 8 {
        u64::from_ne_bytes(buf)
    } else {
        // No entropy source: the clock and the pid, mixed.
        (crate::clock::now_ms() as u64).rotate_left(20) ^ u64::from(std::process::id())
    };
    (r >> 1).max(1) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tx_on<'a>(conn: &'a mut rusqlite::Connection, dir: &Path) -> Tx<'a> {
        let g = lock::acquire_no_wait(
            &dir.join("global.lock"),
            Mode::Exclusive,
            lock::IfMissing::Create,
        )
        .unwrap()
        .unwrap();
        Tx::begin(conn, g).unwrap()
    }

    #[test]
    fn identities_are_never_zero() {
        for _ in 0..1000 {
            assert_ne!(new_identity(), 0);
        }
    }

    #[test]
    fn a_record_id_is_never_given_twice() {
        // A process deletes its own record by id, maybe after another
        // dropped it as stale: a reused id would name someone else's.
        let d = tempfile::tempdir().unwrap();
        let mut conn = open(&d.path().join("db")).unwrap();
        let tx = tx_on(&mut conn, d.path());
        tx.migrate().unwrap();
        let me = crate::ident::Me::current();
        let rec = |name: &str| {
            Record::ours(
                &me,
                LockKind::Global,
                name,
                "store.lock".into(),
                Role::Holder,
                Mode::Exclusive,
                "cmd",
            )
        };
        let mut seen = std::collections::HashSet::new();
        for i in 0..50 {
            let id = tx.insert_record(&rec(&format!("r{i}"))).unwrap();
            assert!(seen.insert(id), "id {id} given twice");
            tx.delete_record(id).unwrap();
        }
    }

    #[test]
    fn migrate_twice_is_a_no_op() {
        let d = tempfile::tempdir().unwrap();
        let mut conn = open(&d.path().join("db")).unwrap();
        let tx = tx_on(&mut conn, d.path());
        assert_eq!(tx.schema().unwrap(), Schema::Behind(0));
        tx.migrate().unwrap();
        tx.commit().unwrap();
        let tx = tx_on(&mut conn, d.path());
        assert_eq!(tx.schema().unwrap(), Schema::Current);
        tx.migrate().unwrap();
        assert_eq!(tx.schema().unwrap(), Schema::Current);
        tx.commit().unwrap();
    }

    #[test]
    fn looking_for_images_in_flux_uses_the_partial_index() {
        let d = tempfile::tempdir().unwrap();
        let mut conn = open(&d.path().join("db")).unwrap();
        let tx = tx_on(&mut conn, d.path());
        tx.migrate().unwrap();
        let plan: String = tx
            .sql()
            .query_row(
                "EXPLAIN QUERY PLAN SELECT name FROM images
                 WHERE state IN ('creating', 'writing', 'deleting') AND state IN ('creating','writing')",
                [],
                |r| r.get(3),
            )
            .unwrap();
        assert!(plan.contains("images_in_flux"), "{plan}");
        assert!(
            tx.images_in_states(&[ImageState::Creating, ImageState::Writing])
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn journal_is_a_rollback_journal() {
        let d = tempfile::tempdir().unwrap();
        let mut conn = open(&d.path().join("db")).unwrap();
        let tx = tx_on(&mut conn, d.path());
        tx.migrate().unwrap();
        tx.commit().unwrap();
        let mode: String = conn
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "delete");
    }
}

// --- peeking without the global lock ------------------------------------

/// What [`peek_names`] lists.
#[derive(Debug, Clone, Copy)]
pub enum Peek {
    Images,
    ReadyImages,
    SlotClasses,
}

/// Names for shell completion, read without the global lock and without
/// waiting: the database is opened read-only, SQLite's busy timeout is zero,
/// and a store in the middle of a write simply offers nothing. Never
/// creates, migrates or repairs anything.
pub fn peek_names(path: &Path, what: Peek) -> Result<Vec<String>> {
    use rusqlite::OpenFlags;
    configure_sqlite();
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
        | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_NOFOLLOW;
    let conn = rusqlite::Connection::open_with_flags(path, flags)?;
    conn.busy_timeout(std::time::Duration::ZERO)?;
    let sql = match what {
        Peek::Images => "SELECT name FROM images ORDER BY name",
        Peek::ReadyImages => "SELECT name FROM images WHERE state = 'ready' ORDER BY name",
        Peek::SlotClasses => "SELECT name FROM slot_classes ORDER BY name",
    };
    let mut stmt = conn.prepare(sql)?;
    let names = stmt
        .query_map([], |r| r.get::<_, String>(0))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(names)
}
