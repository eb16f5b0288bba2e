//! A store: its root, its global lock and its catalog.
//!
//! - The global lock guards the catalog (and the slot classes' limits, written by `slots set`).
//!   Last in the lock order (slots → images → global), it is held for one short transaction, under
//!   which a process may *try* a lock, never wait for one.
//! - No image changes state under the global lock: an image's state is its record, written under
//!   the image's own exclusive lock. The catalog is refreshed from the records (`survey.rs`).
//! - A catalog that cannot be used (damaged, emptied, another program's) is set aside and made anew
//!   by whoever finds it: it is derived, so nothing is lost but measured sizes.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::catalog::{self, Catalog, CatalogError, Found, NeedsMigration};
use crate::ctx::Ctx;
use crate::error::{Busy, Error};
use crate::ident::STOWAGE;
use crate::lock::{self, Mode, Wait};
use crate::root::Root;

pub struct Store {
    /// The catalog's connection, with the device and inode of its file: a catalog replaced under a
    /// running process is reopened.
    conn: Option<(rusqlite::Connection, Option<(u64, u64)>)>,
    ctx: Ctx,
}

/// How long a wait for the global lock goes before it is reported.
const GLOBAL_NOTICE: Duration = Duration::from_secs(2);

/// How long past the caller's deadline even `--no-wait` waits for the global lock (held briefly).
const GLOBAL_GRACE: Duration = Duration::from_secs(5);

impl Store {
    /// A store at `root`. No I/O happens until the first operation.
    pub fn new(root: Root) -> Store {
        Store {
            conn: None,
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

    /// For a command that only reads: a missing root, or a directory that holds no store, is
    /// reported (66), never made a store.
    pub fn require_root(&self) -> Result<()> {
        if !self.ctx.creates_root {
            self.ctx.root.require_store()?;
        }
        Ok(())
    }

    /// Takes the global lock, creating the layout on first use.
    pub fn global(&self, deadline: Option<Instant>) -> Result<lock::Guard> {
        take_global(&self.ctx, deadline)
    }

    /// Runs `f` in one catalog transaction under the global lock (again with the reserve if full).
    pub fn with_catalog<T>(
        &mut self,
        deadline: Option<Instant>,
        mut f: impl FnMut(&Catalog, &Ctx) -> Result<T>,
    ) -> Result<T> {
        self.retry_full(|store| store.transaction(|c| take_global(c, deadline), false, &mut f))
    }

    /// [`Store::with_catalog`] for a look that can do without the catalog: the global lock is waited
    /// for a bounded time, silently ([`Error::Busy`] past it). On a full filesystem, if even the
    /// reserve cannot make room for the journal, `f` runs journalled in memory and rolled back.
    pub fn look_catalog<T>(&mut self, mut f: impl FnMut(&Catalog, &Ctx) -> Result<T>) -> Result<T> {
        match self.retry_full(|store| store.transaction(take_global_quietly, false, &mut f)) {
            Err(e) if crate::space::is_full(&e) => {
                self.transaction(take_global_quietly, true, &mut f)
            }
            other => other,
        }
    }

    /// Runs `f` in one transaction under the global lock, taken by `take`.
    fn transaction<T>(
        &mut self,
        take: impl Fn(&Ctx) -> Result<lock::Guard>,
        in_memory: bool,
        f: &mut impl FnMut(&Catalog, &Ctx) -> Result<T>,
    ) -> Result<T> {
        let global = take(&self.ctx)?;
        let mut tries = 1;
        loop {
            match self.attempt(&global, in_memory, f) {
                // Damage past what opening reads (a page of the table): set aside and made anew
                // here, as at the open, then done once more. Not while full: nothing could be made.
                Err(e) if !in_memory && catalog::is_damage(&e, &self.ctx.root.db()) => {
                    self.conn = None;
                    self.replace(&e.root_cause().to_string())?;
                    return self.attempt(&global, in_memory, f);
                }
                // A stale handle on a file of the catalog: done again on a fresh connection.
                Err(e) if catalog::try_again(&mut tries, &e) => self.conn = None,
                other => return other,
            }
        }
    }

    /// One transaction on the catalog, under `global`; SQLite's errors name the file.
    fn attempt<T>(
        &mut self,
        global: &lock::Guard,
        in_memory: bool,
        f: &mut impl FnMut(&Catalog, &Ctx) -> Result<T>,
    ) -> Result<T> {
        let db = self.ctx.root.db();
        self.connection()?;
        let conn = &self.conn.as_ref().expect("opened above").0;
        let ctx = &self.ctx;
        if in_memory {
            conn.execute_batch("PRAGMA journal_mode = MEMORY; PRAGMA cache_spill = OFF;")?;
        }
        let out = (|| {
            let tx = conn.unchecked_transaction()?;
            let out = f(&Catalog::new(&tx, global), ctx)?;
            if in_memory {
                tx.rollback()?;
            } else {
                tx.commit()?;
            }
            Ok(out)
        })();
        if in_memory {
            let _ = conn.execute_batch("PRAGMA journal_mode = DELETE; PRAGMA cache_spill = ON;");
        }
        out.map_err(|e| sqlite_error(&db, e))
    }

    /// The catalog's connection, under the global lock: opened on first use, and anew once the file
    /// at the path is another (rebuilt by another process); made, rebuilt, or refused to migrate.
    fn connection(&mut self) -> Result<()> {
        let db = self.ctx.root.db();
        let id = file_id(&db);
        if self.conn.as_ref().is_some_and(|(_, file)| *file == id) {
            // SQLite opens the journal each transaction: anything planted there since is refused.
            return catalog::check_files(&db).map(drop);
        }
        self.conn = None;
        let conn = self.open_settled()?;
        self.conn = Some((conn, file_id(&db)));
        Ok(())
    }

    fn open_settled(&self) -> Result<rusqlite::Connection> {
        let db = self.ctx.root.db();
        // Something planted at the catalog is an error here: only `doctor --repair` moves it.
        let conn = catalog::open(&db).map_err(|e| sqlite_error(&db, e))?;
        let root = &self.ctx.root;
        let found = match catalog::inspect_in(&conn, root) {
            Ok(f) => f,
            Err(e) if catalog::is_damage(&e, &db) => Found::Replaced(format!("{e:#}")),
            Err(e) => return Err(catalog_error(&db, e)),
        };
        let new = matches!(found, Found::New);
        let conn = match found {
            Found::Current => {
                catalog::complete_schema(&conn).map_err(|e| catalog_error(&db, e))?;
                return Ok(conn);
            }
            Found::Legacy(_) => return Err(NeedsMigration.into()),
            Found::Newer(v) => return Err(catalog::newer(root, v)),
            Found::New => conn,
            Found::Replaced(why) => {
                drop(conn);
                self.replace(&why)?;
                catalog::open(&db).map_err(|e| sqlite_error(&db, e))?
            }
        };
        catalog::create_schema(&conn).map_err(|e| catalog_error(&db, e))?;
        if self.ctx.shared() {
            if new {
                crate::debug::pause("catalog-made");
            }
            catalog::share_with_group(&db)?;
        }
        Ok(conn)
    }

    /// Sets aside a catalog that cannot be used, for `why`, saying so: the next open makes it anew.
    fn replace(&self, why: &str) -> Result<()> {
        let aside = set_aside(&self.ctx.root, "damaged")?;
        self.ctx.say(&format!(
            "catalog {} could not be used ({why}); set aside as {} and made anew from the images' records (no image is lost)",
            self.ctx.root.db().display(),
            aside.display()
        ));
        Ok(())
    }

    /// Forgets the open connection (before the file is replaced).
    pub fn close_catalog(&mut self) {
        self.conn = None;
    }

    /// Runs `f`, once more with the reserve (`space.rs`) freed if the disk is full.
    pub fn retry_full<T>(&mut self, mut f: impl FnMut(&mut Store) -> Result<T>) -> Result<T> {
        match f(self) {
            Err(e)
                if crate::space::is_full(&e) && crate::space::release(&self.ctx.root.reserve()) =>
            {
                self.ctx.detail(&format!(
                    "the filesystem of {} is full: using the space kept in reserve",
                    self.ctx.root.dir().display()
                ));
                let out = f(self);
                crate::space::refill(&self.ctx.root.reserve());
                out
            }
            other => other,
        }
    }
}

/// Sets the catalog aside as `stowage.db.WHY-STAMP` (never deleted), with its journal and its WAL
/// files; says where.
pub(crate) fn set_aside(root: &Root, why: &str) -> Result<PathBuf> {
    // A journal or WAL beside a damaged file is part of it, and WAL's index belongs to that WAL:
    // they go along, so none is ever read with the catalog made anew.
    for (path, _) in &crate::catalog::files(&root.db())[1..] {
        if std::fs::symlink_metadata(path).is_ok() {
            set_aside_file(root, path, why)?;
        }
    }
    set_aside_file(root, &root.db(), why)
}

/// Renames an entry of the root to `NAME.WHY-STAMP` through the root's descriptor: nothing is
/// followed, nothing deleted.
pub(crate) fn set_aside_file(root: &Root, path: &Path, why: &str) -> Result<PathBuf> {
    let dir = root.open()?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .context("not a file of the root")?;
    match dir.set_aside(name, why) {
        Ok(aside) => Ok(root.dir().join(aside)),
        // Set aside by another process meanwhile: as good.
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(path.to_owned()),
        Err(e) => Err(e).with_context(|| format!("cannot set {} aside", path.display())),
    }
}

/// [`catalog_error`] for an error of SQLite's; any other as it is.
pub(crate) fn sqlite_error(db: &Path, e: anyhow::Error) -> anyhow::Error {
    if catalog::is_sqlite(&e) {
        catalog_error(db, e)
    } else {
        e
    }
}

/// Names the catalog in SQLite errors; its lock held by an outside program is busy (exit 75).
pub(crate) fn catalog_error(db: &Path, e: anyhow::Error) -> anyhow::Error {
    if catalog::is_busy(&e) {
        return Error::Busy(Busy {
            what: format!("the catalog {}", db.display()),
            holders: "locked by a program outside stowage (an sqlite3 shell?) for longer than stowage waits".into(),
            waited: catalog::busy_timeout(),
        })
        .into();
    }
    if e.downcast_ref::<CatalogError>().is_some() {
        return e;
    }
    // SQLite names neither the file it could not write or open nor why: the catalog's files say.
    if catalog::is_refused(&e) {
        let why = catalog::check_files(db).err().map(|e| format!("{e:#}"));
        if let Some(why) = why.or_else(|| catalog::unwritable(db)) {
            let shown = db.display();
            return CatalogError(format!("catalog {shown} cannot be used: {why}")).into();
        }
    }
    // What SQLite calls damage may be a read that failed: said as what it is.
    if let Some(io) = catalog::unreadable(db) {
        let io = crate::error::without_errno(&io.to_string());
        return CatalogError(format!("catalog {} cannot be read: {io}", db.display())).into();
    }
    let hint = if catalog::is_full(&e) {
        format!(" (its filesystem is full: free space with '{STOWAGE} rm IMAGE' or '{STOWAGE} gc')")
    } else {
        String::new()
    };
    e.context(CatalogError(format!("catalog {}{hint}", db.display())))
}

/// [`take_global`] for a look that can do without the catalog: waits [`GLOBAL_GRACE`] at most,
/// silently, then fails naming the holder.
fn take_global_quietly(ctx: &Ctx) -> Result<lock::Guard> {
    let path = ctx.root.global_lock();
    let t0 = Instant::now();
    let mut wait = Wait::on(&ctx.root.locks(), Some(t0 + GLOBAL_GRACE));
    match lock::acquire(&path, Mode::Exclusive, lock::IfMissing::Create, &mut wait) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => take_global(ctx, None),
        other => other
            .map_err(|e| lock::error("the global lock", &path, e))?
            .or_else_busy(|| {
                Error::Busy(Busy {
                    what: format!("the global lock ({})", path.display()),
                    holders: crate::holders::global_holder_phrase(ctx, Some(t0 + GLOBAL_GRACE)),
                    waited: t0.elapsed(),
                })
                .into()
            }),
    }
}

/// Takes the global lock: tried a few times (it is held for microseconds), then waited for until the
/// caller's deadline plus a grace, reported if the wait goes on.
fn take_global(ctx: &Ctx, deadline: Option<Instant>) -> Result<lock::Guard> {
    let path = ctx.root.global_lock();
    let deadline = deadline.map(|d| d.max(Instant::now() + GLOBAL_GRACE));
    let mut created = false;
    for i in 0..16 {
        match lock::acquire_no_wait(&path, Mode::Exclusive, lock::IfMissing::Create) {
            Ok(Some(g)) => return Ok(g),
            Ok(None) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound && !created => {
                if !ctx.creates_root {
                    ctx.root.require_store()?;
                }
                ctx.root.create_layout()?;
                created = true;
                continue;
            }
            Err(e) => {
                let no_store = ctx.root.foreign_locks();
                return Err(no_store.unwrap_or_else(|| lock::error("the global lock", &path, e)));
            }
        }
        if i < 6 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(40));
        }
    }
    // Said only if the wait goes on (it is held for microseconds), and followed until it ends.
    let line = std::cell::RefCell::new(None);
    let mut wait = Wait::on(&ctx.root.locks(), deadline);
    wait.notice = Some((
        GLOBAL_NOTICE,
        Box::new(|| {
            *line.borrow_mut() = Some(crate::wait_line::announce(
                ctx,
                &format!("the global lock ({})", ctx.root.global_lock().display()),
                &crate::holders::global_holder_phrase(ctx, deadline),
                None,
            ));
        }),
    ));
    let waited = lock::acquire(&path, Mode::Exclusive, lock::IfMissing::Create, &mut wait);
    drop(wait);
    drop(line);
    let holders = || crate::holders::global_holder_phrase(ctx, deadline);
    waited
        .map_err(|e| lock::error("the global lock", &path, e))?
        .or_else_busy(|| Busy::now("the global lock".into(), holders()).into())
}

/// The file at `path` (device, inode), if any.
pub(crate) fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}
