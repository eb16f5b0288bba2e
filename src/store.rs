//! A store: a root, its global lock and its metadata.
//!
//! Invariants:
//! - The global lock is the last lock in the order (slots → images →
//!   global). It is held for exactly one short metadata transaction ([`Tx`])
//!   and never while waiting for another lock; under it a process may *try*
//!   image locks, never wait for one.
//! - Store-wide operations ([`Store::store_wide`]: schema migration, rebuild)
//!   conflict with every image lock. Holding the global lock, they try every
//!   image lock exclusively; if one is busy they release everything, wait for
//!   that image without holding anything, and start over. An image lock
//!   taken after the check cannot be used before the operation ends, because
//!   an image is only created, marked or recorded inside a transaction.
//! - A process holding image locks never migrates: if its transaction finds
//!   the schema behind ([`NeedsMigration`]), it releases its image locks,
//!   migrates, and acquires again.

use std::io;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::ctx::Ctx;
use crate::error::{Busy, Error};
use crate::lock::{self, Mode, Wait, Waited};
use crate::meta::{self, DatabaseError, Schema, Tx};
use crate::root::Root;

/// A transaction found the schema older than this binary.
#[derive(Debug, thiserror::Error)]
#[error("the metadata schema must be migrated first")]
pub struct NeedsMigration;

pub struct Store {
    conn: Option<rusqlite::Connection>,
    /// Device and inode of the database file `conn` has open.
    conn_file: Option<(u64, u64)>,
    ctx: Ctx,
    /// See [`Store::being_written`].
    being_written: Vec<String>,
}

/// How long a wait for the global lock goes before it is reported: it is
/// normally held for microseconds, so a long wait means a stuck holder.
const GLOBAL_NOTICE: Duration = Duration::from_secs(2);

/// A caller's deadline is about the locks it asked for; the global lock is
/// only ever held for one short transaction, so even `--no-wait` waits for
/// it — up to this long past the caller's deadline, which still bounds the
/// wait when a holder is stuck (a stopped process, a hung NFS server).
const GLOBAL_GRACE: Duration = Duration::from_secs(5);

/// How long cleanup waits for the global lock. If a holder is stuck even
/// longer, the cleanup is left undone and the next process that looks finds
/// the stale state (records of a dead process, an image whose writer is
/// gone) and repairs it.
pub const CLEANUP_PATIENCE: Duration = Duration::from_secs(30);

/// How long a failed request's tidying waits for the global lock.
pub const GIVE_UP_PATIENCE: Duration = Duration::from_millis(500);

impl Store {
    /// A store at `root`. No I/O happens until the first operation.
    pub fn new(root: Root) -> Store {
        Store {
            conn: None,
            conn_file: None,
            being_written: Vec::new(),
            ctx: Ctx::new(root),
        }
    }

    pub fn ctx(&self) -> &Ctx {
        &self.ctx
    }

    pub fn ctx_mut(&mut self) -> &mut Ctx {
        &mut self.ctx
    }

    pub fn root(&self) -> &Root {
        &self.ctx.root
    }

    /// Takes the global lock, creating the layout on first use.
    fn take_global(ctx: &Ctx, deadline: Option<Instant>, cleanup: bool) -> Result<lock::Guard> {
        let path = ctx.root.global_lock();
        // A caller's short bound is stretched to the grace period, since the
        // lock is normally held for one quick transaction; cleanup states
        // its own patience.
        let deadline = if cleanup {
            deadline
        } else {
            deadline.map(|d| d.max(Instant::now() + GLOBAL_GRACE))
        };
        let mut created = false;
        loop {
            let first = lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Create);
            match first {
                Ok(Some(g)) => return Ok(g),
                Ok(None) => break,
                Err(e) if e.kind() == io::ErrorKind::NotFound && !created => {
                    if !ctx.creates_root && !ctx.root.exists() {
                        return Err(Error::NoRoot(ctx.root.dir().to_owned()).into());
                    }
                    ctx.root.create_layout()?;
                    created = true;
                }
                Err(e) => return Err(lock::error("the global lock", &path, e)),
            }
        }
        // It is held for one short transaction: a few quick retries usually
        // see it released, without the helper thread a real wait starts.
        for i in 0..16 {
            if i < 6 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(40));
            }
            match lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Create) {
                Ok(Some(g)) => return Ok(g),
                Ok(None) => {}
                Err(e) => return Err(lock::error("the global lock", &path, e)),
            }
        }
        let mut wait = Wait::on(&ctx.root.locks(), deadline);
        wait.uninterruptible = cleanup;
        if !ctx.noticed_global.get() {
            wait.notice = Some((
                GLOBAL_NOTICE,
                Box::new(move || {
                    ctx.noticed_global.set(true);
                    crate::holders::announce_wait(
                        ctx,
                        &format!(
                            "the global metadata lock ({})",
                            ctx.root.global_lock().display()
                        ),
                        &crate::holders::global_holder_phrase(ctx),
                    );
                }),
            ));
        }
        match lock::acquire(&path, Mode::Exclusive, lock::IfMissing::Create, &mut wait)
            .map_err(|e| lock::error("the global lock", &path, e))?
        {
            Waited::Acquired(g) => Ok(g),
            Waited::TimedOut => Err(Error::Busy(Busy {
                what: "the global metadata lock".into(),
                holders: crate::holders::global_holder_phrase(ctx),
                waited: Duration::ZERO,
            })
            .into()),
            Waited::Interrupted(sig) => Err(Error::Interrupted(sig).into()),
        }
    }

    /// Begins a transaction without looking at the schema version.
    fn begin_raw(&mut self, deadline: Option<Instant>, cleanup: bool) -> Result<(Tx<'_>, &Ctx)> {
        let mut global = Self::take_global(&self.ctx, deadline, cleanup)?;
        let db = self.ctx.root.db();
        let id = self.forget_replaced_db(&db);
        connection(&mut self.conn, &db, self.ctx.shared())?;
        if self.conn_file.is_none() {
            // A database created just now had no identity before.
            self.conn_file = id.or_else(|| file_id(&db));
        }
        // Writers' records first, in a transaction of their own that
        // commits before the markers go (written.rs); only when there is
        // something to fold. Cleanup (an outcome, an undone start, waiter
        // records) reads no row but those of images its caller has held
        // since a transaction that folded them — exclusively, or shared:
        // either way no writer could write them since.
        // A backlog is folded in batches, the global lock let go between
        // them (written::FOLD_BATCH).
        loop {
            let markers = if cleanup {
                crate::written::Markers::default()
            } else {
                crate::written::markers(&self.ctx.root)?
            };
            self.being_written = markers.busy.clone();
            if !markers.any() {
                break;
            }
            let more = markers.more;
            let conn = connection(&mut self.conn, &db, self.ctx.shared())?;
            let tx = begin_tx_for(conn, global, &self.ctx.root).map_err(|e| damaged(&db, e))?;
            let folded = match tx.schema().map_err(|e| damaged(&db, e))? {
                Schema::Current => {
                    crate::written::fold(&tx, &self.ctx, &markers)?;
                    let global = tx.commit_keeping_global()?;
                    // No progress through a backlog unless they went.
                    let gone = markers.unlink_folded();
                    (global, gone)
                }
                // Folded once the schema is brought up to date.
                _ => (tx.rollback_keeping_global()?, false),
            };
            global = folded.0;
            if !folded.1 || !more {
                break;
            }
            drop(global);
            global = Self::take_global(&self.ctx, deadline, cleanup)?;
        }
        let conn = connection(&mut self.conn, &db, self.ctx.shared())?;
        let tx = begin_tx_for(conn, global, &self.ctx.root).map_err(|e| damaged(&db, e))?;
        Ok((tx, &self.ctx))
    }

    /// Images a writer that took no transaction holds now, as the last
    /// transaction begun found them (written.rs): their rows still show
    /// the state before that write.
    pub fn being_written(&self) -> &[String] {
        &self.being_written
    }

    /// Begins a transaction on a current schema. Fails with
    /// [`NeedsMigration`] when the schema is behind: the caller releases
    /// any image locks and calls [`Store::migrate`].
    pub fn begin(&mut self, deadline: Option<Instant>) -> Result<(Tx<'_>, &Ctx)> {
        self.begin_checked(deadline, false)
    }

    /// Begins a transaction for cleanup that must happen even after a
    /// termination signal cancelled every other wait: undoing a start,
    /// recording an outcome, dropping a waiter record. Waits for the global
    /// lock up to [`CLEANUP_PATIENCE`].
    pub fn begin_cleanup(&mut self) -> Result<(Tx<'_>, &Ctx)> {
        self.begin_checked(Some(Instant::now() + CLEANUP_PATIENCE), true)
    }

    /// [`Store::begin_cleanup`] for the tidying of a request that failed
    /// (a wait that timed out, a refused start): it waits for the global
    /// lock only [`GIVE_UP_PATIENCE`]. What it leaves is stale once the
    /// process is gone and is dropped by the next look; waiting longer
    /// would stretch a `--wait 0.3` that ran out into half a minute when
    /// the global lock is what is stuck.
    pub fn begin_give_up(&mut self) -> Result<(Tx<'_>, &Ctx)> {
        self.begin_checked(Some(Instant::now() + GIVE_UP_PATIENCE), true)
    }

    fn begin_checked(
        &mut self,
        deadline: Option<Instant>,
        cleanup: bool,
    ) -> Result<(Tx<'_>, &Ctx)> {
        let db = self.ctx.root.db();
        let (tx, ctx) = self.begin_raw(deadline, cleanup)?;
        match tx.schema().map_err(|e| damaged(&db, e))? {
            Schema::Current => Ok((tx, ctx)),
            Schema::Behind(_) => Err(NeedsMigration.into()),
            Schema::Ahead(v) => Err(DatabaseError(format!(
                "metadata database {} has schema version {v}, newer than this stowage knows ({}); use a newer stowage",
                db.display(),
                meta::schema_version()
            ))
            .into()),
        }
    }

    /// Runs `f` in one transaction and commits. For callers that hold no
    /// image lock: migrates the schema first when needed. On a full disk it
    /// runs once more in the space kept in reserve ([`Store::retry_full`]).
    pub fn with_tx<T>(
        &mut self,
        deadline: Option<Instant>,
        mut f: impl FnMut(&Tx, &Ctx) -> Result<T>,
    ) -> Result<T> {
        self.retry_full(|store| {
            loop {
                let err = match store.begin(deadline) {
                    Ok((tx, ctx)) => {
                        let out = f(&tx, ctx)?;
                        tx.commit()?;
                        return Ok(out);
                    }
                    Err(e) => e,
                };
                if err.downcast_ref::<NeedsMigration>().is_none() {
                    return Err(err);
                }
                store.migrate(deadline)?;
            }
        })
    }

    /// Runs `f` in one transaction and commits, for a caller that holds
    /// image locks: it never migrates (a migration waits until no image
    /// lock is held — the caller's included — so it would wait for itself).
    /// Such callers bring the schema up to date before taking locks; a
    /// schema found behind anyway is an error, not a hang.
    pub fn with_tx_holding_locks<T>(
        &mut self,
        deadline: Option<Instant>,
        mut f: impl FnMut(&Tx, &Ctx) -> Result<T>,
    ) -> Result<T> {
        self.retry_full(|store| {
            let (tx, ctx) = store.begin(deadline)?;
            let out = f(&tx, ctx)?;
            tx.commit()?;
            Ok(out)
        })
    }

    /// Runs `f` (one or more metadata transactions); if it fails because
    /// the disk is full, empties the reserve (see `space.rs`), runs it once
    /// more, and fills the reserve again with what is left free. `f` must be
    /// a transaction that can simply be repeated (a failed one rolled back).
    pub fn retry_full<T>(&mut self, mut f: impl FnMut(&mut Store) -> Result<T>) -> Result<T> {
        match f(self) {
            Err(e)
                if crate::space::is_full(&e) && crate::space::release(&self.ctx.root.reserve()) =>
            {
                self.ctx.detail(&format!(
                    "the filesystem of {} is full: using the space kept in reserve for the metadata",
                    self.ctx.root.dir().display()
                ));
                let out = f(self);
                crate::space::refill(&self.ctx.root.reserve());
                out
            }
            other => other,
        }
    }

    /// Like [`Store::with_tx`], for a command that only shows the store:
    /// if even the reserve cannot make room for the metadata's journal, `f`
    /// runs in a transaction that is rolled back and journalled in memory,
    /// so the command still shows what it would record (stale records,
    /// writers found gone) and writes nothing.
    pub fn read_tx<T>(&mut self, mut f: impl FnMut(&Tx, &Ctx) -> Result<T>) -> Result<T> {
        match self.with_tx(None, &mut f) {
            Err(e) if crate::space::is_full(&e) => {
                self.ctx.detail(&format!(
                    "the filesystem of {} is full: showing the store without recording anything",
                    self.ctx.root.dir().display()
                ));
                self.view_tx(f)
            }
            other => other,
        }
    }

    /// Runs `f` in a transaction that is always rolled back, with the
    /// journal in memory and the page cache never spilled to the file: it
    /// needs no disk space, and writes nothing to the database file.
    pub fn view_tx<T>(&mut self, mut f: impl FnMut(&Tx, &Ctx) -> Result<T>) -> Result<T> {
        let global = Self::take_global(&self.ctx, None, false)?;
        let db = self.ctx.root.db();
        let conn = connection(&mut self.conn, &db, self.ctx.shared())?;
        meta::journal_in_memory(conn, true)?;
        let out = (|| {
            let markers = crate::written::markers(&self.ctx.root)?;
            self.being_written = markers.busy.clone();
            let tx = begin_tx_for(conn, global, &self.ctx.root).map_err(|e| damaged(&db, e))?;
            match tx.schema()? {
                Schema::Current => {
                    // Folded in this transaction only: rolled back, the
                    // markers stay for one that commits. The image locks
                    // taken to read the records go before `f`, which may
                    // judge who holds the images.
                    crate::written::fold(&tx, &self.ctx, &markers)?;
                    drop(markers);
                    f(&tx, &self.ctx)
                }
                _ => bail!("the metadata schema needs an upgrade, which needs disk space"),
            }
            // Dropping `tx` rolls it back.
        })();
        let conn = self.conn.as_mut().expect("opened above");
        meta::journal_in_memory(conn, false)?;
        out
    }

    /// Brings the schema up to date: a store-wide operation.
    pub fn migrate(&mut self, deadline: Option<Instant>) -> Result<()> {
        let db = self.ctx.root.db();
        self.store_wide("upgrading the metadata schema", deadline, |tx, ctx| {
            match tx.schema()? {
                Schema::Current => {}
                Schema::Behind(v) => {
                    if v > 0 {
                        ctx.say(&format!(
                            "upgrading metadata schema {} from version {v} to {}",
                            db.display(),
                            meta::schema_version()
                        ));
                    }
                    tx.migrate()?;
                    if v < crate::slot_record::CLASS_DIRS_SCHEMA
                        && meta::schema_version() >= crate::slot_record::CLASS_DIRS_SCHEMA
                    {
                        crate::slot_record::make_class_dirs(tx, &ctx.root)?;
                    }
                }
                Schema::Ahead(v) => {
                    return Err(DatabaseError(format!(
                        "metadata database {} has schema version {v}, newer than this stowage knows ({})",
                        db.display(),
                        meta::schema_version()
                    ))
                    .into());
                }
            }
            Ok(())
        })
    }

    /// Runs `f` in a transaction while no image lock is held by anyone.
    pub fn store_wide<T>(
        &mut self,
        what: &str,
        deadline: Option<Instant>,
        f: impl FnOnce(&Tx, &Ctx) -> Result<T>,
    ) -> Result<T> {
        let global = self.global_with_images_free(what, deadline)?;
        let db = self.ctx.root.db();
        let id = self.forget_replaced_db(&db);
        let conn = connection(&mut self.conn, &db, self.ctx.shared())?;
        if self.conn_file.is_none() {
            // A database created just now had no identity before.
            self.conn_file = id.or_else(|| file_id(&db));
        }
        let tx = begin_tx_for(conn, global, &self.ctx.root).map_err(|e| damaged(&db, e))?;
        let out = f(&tx, &self.ctx)?;
        tx.commit()?;
        Ok(out)
    }

    /// Takes the global lock at a moment when nobody holds any image lock:
    /// the basis of every store-wide operation. Needs no database, so it
    /// also serves to rebuild a damaged one.
    pub fn global_with_images_free(
        &mut self,
        what: &str,
        deadline: Option<Instant>,
    ) -> Result<lock::Guard> {
        let mut told = false;
        loop {
            let global = Self::take_global(&self.ctx, deadline, false)?;
            let Some((path, name)) = first_busy_image(&self.ctx)? else {
                return Ok(global);
            };
            drop(global);
            if let Some(held) = crate::nested::enclosing_hold(&path)
                .or_else(|| crate::nested::held_by_ancestor(&path))
            {
                // Our enclosing command holds it and waits for us.
                return Err(Error::Busy(Busy {
                    what: format!("{name} (needed free before {what})"),
                    holders: format!(
                        "held ({}) by an enclosing command of this process (a 'stowage exec' that runs it); waiting for it would never end",
                        held.verb()
                    ),
                    waited: Duration::ZERO,
                })
                .into());
            }
            let holders = crate::holders::kernel_holders_phrase(&self.ctx, &path);
            if !told {
                crate::holders::announce_wait(
                    &self.ctx,
                    &format!("{name} to be released before {what}"),
                    &holders,
                );
                told = true;
            }
            let mut wait = Wait::on(&self.ctx.root.image_locks(), deadline);
            match lock::acquire(&path, Mode::Exclusive, lock::IfMissing::Fail, &mut wait) {
                Ok(Waited::Acquired(g)) => drop(g),
                Ok(Waited::TimedOut) => {
                    return Err(Error::Busy(Busy {
                        what: format!("{name} (needed free before {what})"),
                        holders,
                        waited: Duration::ZERO,
                    })
                    .into());
                }
                Ok(Waited::Interrupted(sig)) => return Err(Error::Interrupted(sig).into()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(lock::error(&name, &path, e)),
            }
        }
    }

    /// Deletes a record, best effort, even after a termination signal: if
    /// this fails the record is judged stale later (its process is gone).
    pub fn forget_record(&mut self, id: i64) {
        let _ = self.begin_cleanup().and_then(|(tx, _)| {
            tx.delete_record(id)?;
            tx.commit()
        });
    }

    /// Takes the global lock alone, without touching the database (doctor
    /// inspects a possibly damaged database under it).
    pub fn global(&self) -> Result<lock::Guard> {
        Self::take_global(&self.ctx, None, false)
    }

    /// Forgets the open database connection (before the file is replaced).
    pub fn close_db(&mut self) {
        self.conn = None;
        self.conn_file = None;
    }

    /// Under the global lock: drops a connection whose file is no longer
    /// the database at the path — `doctor --repair` moved a damaged one
    /// aside and built a new one while this process kept its connection
    /// (a slot waiter, `lock-status --watch`, an exec whose command ran).
    /// Writing through the old connection would fail ("readonly database")
    /// or, worse, go to the file moved aside. One stat per transaction
    /// (which also names the file a new connection opens).
    fn forget_replaced_db(&mut self, db: &std::path::Path) -> Option<(u64, u64)> {
        let id = file_id(db);
        if self.conn.is_some() && id != self.conn_file {
            self.close_db();
        }
        id
    }
}

/// Device and inode of a file, if it exists.
fn file_id(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// The database connection, opened on first use (with the global lock held
/// by the caller). The database keeps SQLite's default rollback journal
/// (created and deleted by each write transaction; no setting to repeat per
/// connection); what its header says is looked at inside each transaction
/// ([`begin_tx`]).
fn connection<'c>(
    conn: &'c mut Option<rusqlite::Connection>,
    db: &std::path::Path,
    shared: bool,
) -> Result<&'c mut rusqlite::Connection> {
    if conn.is_none() {
        let c = meta::open(db)?;
        if shared {
            // SQLite creates files at most 0644; a group's store needs its
            // database group-writable (the journal copies its mode).
            meta::share_with_group(db)?;
        }
        *conn = Some(c);
    }
    Ok(conn.as_mut().expect("opened above"))
}

/// Begins a transaction and settles what the header says — in every
/// transaction, since the first one of a connection may be rolled back (a
/// schema to migrate) and the header may change under a long-lived
/// connection. A database an outside program put in WAL mode goes back to
/// the rollback journal *before* anything is done in it: the transaction
/// is rolled back, WAL left (still under the global lock), and a new one
/// begun. Leaving WAL fails while that program still has the database
/// open; failing then, before any change, leaves nothing half done — a
/// commit followed by that failure would report an error for a change
/// that was made. An identity is given to a database without one
/// ([`Tx::settle_header`]) where it can be written.
fn begin_tx<'c>(conn: &'c mut rusqlite::Connection, global: lock::Guard) -> Result<Tx<'c>> {
    // One transaction at a time on this `&mut` borrow, shared below so
    // that it can begin again after the rollback.
    let conn: &'c rusqlite::Connection = conn;
    let mut tx = Tx::begin_on(conn, global)?;
    if tx.in_wal()? {
        let global = tx.rollback_keeping_global()?;
        let db = conn.path().unwrap_or("the metadata database").to_owned();
        if let Err(e) = meta::leave_wal(conn) {
            // A signal that ended the wait is what to report, not the wait.
            crate::signals::check()?;
            return Err(e)
                .with_context(|| format!("cannot switch {db} from WAL to a rollback journal"));
        }
        tx = Tx::begin_on(conn, global)?;
    }
    tx.settle_header()?;
    if tx.ended() {
        // The identity could not be written (a full filesystem), and SQLite
        // rolled the transaction back with it: begin again, without one,
        // rather than run the caller's statements each on its own.
        let global = tx.rollback_keeping_global()?;
        tx = Tx::begin_on(conn, global)?;
    }
    Ok(tx)
}

/// [`begin_tx`], then the records' database kept (record.rs): before any
/// row is read, no record of another database is left to be trusted.
fn begin_tx_for<'c>(
    conn: &'c mut rusqlite::Connection,
    global: lock::Guard,
    root: &crate::root::Root,
) -> Result<Tx<'c>> {
    let tx = begin_tx(conn, global)?;
    crate::records_db::for_this_database(&tx, root)?;
    Ok(tx)
}

/// Under the global lock: the first image or slot lock someone holds, if
/// any. Slots count too: a process of an older release that holds only a
/// slot (an exec with `--slot` and no image) still records and deletes its
/// holder record against the schema it knows, so a migration under it
/// would make its exec fail after its command succeeded.
fn first_busy_image(ctx: &Ctx) -> Result<Option<(std::path::PathBuf, String)>> {
    if let Some(busy) = first_busy_in(&ctx.root.image_locks(), crate::root::lock_file_label)? {
        return Ok(Some(busy));
    }
    let slots = ctx.root.slot_locks();
    let classes = match std::fs::read_dir(&slots) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", slots.display())),
    };
    for class in classes {
        let class = class.with_context(|| format!("cannot list {}", slots.display()))?;
        // A real directory only; a symlink planted here is not followed.
        if !class.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let name = class.file_name().to_string_lossy().replace('%', "/");
        let label = |f: &str| format!("slot {} of class '{name}'", f.trim_end_matches(".lock"));
        if let Some(busy) = first_busy_in(&class.path(), label)? {
            return Ok(Some(busy));
        }
    }
    Ok(None)
}

/// The first `*.lock` file in `dir` that someone holds, with its label.
fn first_busy_in(
    dir: &std::path::Path,
    label: impl Fn(&str) -> String,
) -> Result<Option<(std::path::PathBuf, String)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", dir.display())),
    };
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
        // Only regular files are lock files; anything else planted here
        // (a symlink) is not ours to lock, and not followed.
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let file_name = entry.file_name();
        let Some(fname) = file_name.to_str() else {
            continue;
        };
        if !fname.ends_with(".lock") {
            continue;
        }
        let path = entry.path();
        match lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Fail) {
            Ok(Some(g)) => drop(g),
            Ok(None) => return Ok(Some((path, label(fname)))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(lock::error(&label(fname), &path, e)),
        }
    }
    Ok(None)
}

/// Adds "the database is damaged" advice to SQLite corruption errors.
fn damaged(db: &std::path::Path, e: anyhow::Error) -> anyhow::Error {
    if meta::is_busy(&e) {
        // Stowage touches the database only under its global lock, so only
        // an outside program can hold SQLite's own lock this long.
        return Error::Busy(Busy {
            what: format!("the metadata database {}", db.display()),
            holders: "locked by a program outside stowage (an sqlite3 shell?) for longer than stowage waits".into(),
            waited: meta::busy_timeout(),
        })
        .into();
    }
    if meta::is_corruption(&e) {
        // SQLite's own words once (its error chain repeats them).
        DatabaseError(format!(
            "metadata database {} is damaged ({e}); run 'stowage doctor --repair' (no image is lost)",
            db.display()
        ))
        .into()
    } else {
        e.context(DatabaseError(format!("metadata database {}", db.display())))
    }
}
