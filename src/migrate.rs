//! The migration of a store made by a release before image records (catalog schema 1 to 10): each
//! image's record is written once, from what that release held true, as a store-wide operation
//! (docs/design.md, "Migration of a schema-10 store").
//!
//! - What it held true: the image's row, or while a writer's marker (`locks/leases/ENC.dirty`)
//!   stood, the writer's record. A row `creating`/`writing` under a free lock is incomplete; a
//!   ready token without a row is ready; a tree with neither is adopted, readiness unknown. No
//!   image loses its state or its base.
//! - Older binaries are held off as their own store-wide operations were: `store.lock`, the hint on
//!   every lock file, a holder record in the database, the global lock while converting.
//! - A pass that finds an image lock busy lets the global lock go, waits, and starts over; one that
//!   finds all free converts and commits schema 11 last, after which the older release refuses the
//!   store.
//! - Every pass derives every record anew (one that gave up let the older release back in) from
//!   the older release's token, which stays in slot A (the record goes in slot B), disabled for
//!   that release once the record is durable.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::catalog::{Found, Legacy};
use crate::clock::Millis;
use crate::config::Config;
use crate::dir::Dir;
use crate::holders::LockKind;
use crate::image_record::{self, ImagesDir, LEGACY_PREFIX, Record, State};
use crate::lock::{self, Mode};
use crate::name::ImageName;
use crate::root::Root;
use crate::slot_limits::Kind;
use crate::store::{Store, sqlite_error};

/// Where the older release's token is: the first bytes of an image's lock file (its slot A).
const TOKEN_AREA: usize = 3072;

/// Whether the store is one to migrate: no configuration yet, and an older release's catalog.
pub fn is_legacy(root: &Root) -> bool {
    let Ok(dir) = root.open() else { return false };
    if !matches!(dir.stat_at(crate::config::FILE), Ok(None)) {
        return false;
    }
    // One that cannot be asked (busy) may be one: `run` says so.
    crate::catalog::legacy_state(root).map_or(true, |v| v.is_some())
}

/// Migrates the store, if one to migrate, before a command reads or changes it (one stat once not).
pub fn if_needed(store: &mut Store, deadline: Option<Instant>) -> Result<()> {
    if is_legacy(store.root()) {
        run(store, deadline)?;
    }
    Ok(())
}

/// Migrates the store, if it needs it (a no-op once another process has).
pub fn run(store: &mut Store, deadline: Option<Instant>) -> Result<()> {
    let root = store.root().clone();
    // A configuration means this release made or migrated the store, whatever its catalog says.
    if root.open().is_ok_and(|d| crate::config::exists(&d)) {
        return Ok(());
    }
    let db = root.db();
    // A catalog held by another program may be that release's: not migrated without it (75).
    let legacy = crate::catalog::legacy_state(&root).map_err(|e| sqlite_error(&db, e))?;
    let Some(legacy) = legacy else {
        // Nothing of that release: a store whose records are all there is.
        ensure_config(&root)?;
        return Ok(());
    };
    let (at, db) = (root.dir().display(), db.display());
    let said = match legacy {
        Legacy::Catalog(v) => {
            format!("migrating the store at {at} (catalog schema {v}) to image records")
        }
        // The bases were only in the catalog.
        Legacy::Lost(why) => format!(
            "migrating the store at {at} to image records from its lock files, its catalog {db} lost ({why}): states kept, bases not known"
        ),
    };
    store.ctx().say(&said);
    let hold =
        crate::store_wide::Hold::take_raw(store, "migrating to image records", deadline, false)?;
    let out = convert_passes(store, deadline);
    hold.release(store);
    out
}

/// Under the store-wide hold: passes until one finds every image lock free.
fn convert_passes(store: &mut Store, deadline: Option<Instant>) -> Result<()> {
    let root = store.root().clone();
    let db = root.db();
    hint_older_release(&root);
    loop {
        let global = store.global(deadline)?;
        store.close_catalog();
        // Another process finished it while this one waited for the hold: its records, beside
        // the tokens they disabled, are no store still to migrate.
        if root.open().is_ok_and(|d| crate::config::exists(&d)) {
            return Ok(());
        }
        let Some((conn, old)) = read_old(store)? else {
            ensure_config(&root)?;
            return Ok(());
        };
        match convert(&root, &old)? {
            Some(busy) => {
                drop(conn);
                drop(global);
                wait_for(store, &busy, deadline)?;
            }
            None => {
                finish(store, conn.as_ref(), &old).map_err(|e| sqlite_error(&db, e))?;
                drop(global);
                return Ok(());
            }
        }
    }
}

/// What the older release held true, from its catalog (returned, to be retired at the end) or,
/// that lost, from its tokens; `None` if the store holds nothing of it (migrated meanwhile).
fn read_old(store: &Store) -> Result<Option<(Option<rusqlite::Connection>, Old)>> {
    let root = store.root();
    let db = root.db();
    let conn = crate::catalog::open(&db).map_err(|e| sqlite_error(&db, e))?;
    let found = crate::catalog::inspect_in(&conn, root);
    // Damage the migration's line said already (its header), or found only now (its rows).
    let (damage, said) = match found {
        Ok(Found::Legacy(_)) => {
            mark_held_off(&conn);
            match Old::read(&conn, root) {
                Ok(old) => return Ok(Some((Some(conn), old))),
                Err(e) if crate::catalog::is_damage(&e, &db) => (Some(e), false),
                Err(e) => return Err(sqlite_error(&db, e)),
            }
        }
        Err(e) if crate::catalog::is_damage(&e, &db) => (Some(e), true),
        Err(e) => return Err(sqlite_error(&db, e)),
        Ok(_) => (None, true),
    };
    drop(conn);
    if !root.older_release_left() {
        return Ok(None);
    }
    if let Some(e) = damage {
        let line = set_aside_damaged(store, &e)?;
        let line = format!("{line}; migrating from the lock files, bases not known");
        if said {
            store.ctx().detail(&line);
        } else {
            store.ctx().say(&line);
        }
    }
    Ok(Some((None, Old::from_tokens(root))))
}

/// Sets a damaged catalog aside (never deleted), as any use of it would; the line saying so.
fn set_aside_damaged(store: &Store, e: &anyhow::Error) -> Result<String> {
    let aside = crate::store::set_aside(store.root(), "damaged")?;
    let (db, aside) = (store.root().db(), aside.display());
    let db = db.display();
    Ok(format!(
        "catalog {db} is damaged ({e:#}): set aside as {aside}"
    ))
}

/// The older release's store-wide hint (byte 3073 of each lock file): its reads see it and wait.
fn hint_older_release(root: &Root) {
    for file in image_lock_files(root) {
        if let Ok(Some(f)) = lock::open_existing(&root.image_locks().join(&file)) {
            let _ = f.write_all_at(b"1", 3073);
        }
    }
}

/// The older release's store-wide holder record: with `store.lock` held, it claims no image.
fn mark_held_off(conn: &rusqlite::Connection) {
    let me = crate::ident::Me::current();
    let _ = conn.execute(
        "INSERT INTO records (kind, name, lockfile, role, mode, pid, host, user, command, since_ms)
         SELECT 'global', 'store', 'store.lock', 'holder', 'exclusive', ?1, ?2, ?3, 'stowage: migrating to image records', ?4
         WHERE NOT EXISTS (SELECT 1 FROM records WHERE kind = 'global' AND name = 'store')",
        rusqlite::params![me.pid, me.host, me.user, crate::clock::now_ms()],
    );
}

/// What the older release held true.
struct Old {
    /// The catalog file the rows were read from (device, inode), if any.
    catalog: Option<(u64, u64)>,
    /// Its catalog lost: no rows, the tokens alone tell (a record an earlier pass wrote from a
    /// row, its token disabled since, is kept: it had the row).
    lost: bool,
    rows: BTreeMap<String, OldRow>,
    markers: BTreeSet<String>,
    classes: Vec<(String, u32, u32)>,
    images: ImagesDir,
    identity: Option<String>,
}

struct OldRow {
    state: String,
    base: Option<String>,
    created: Millis,
    last_used: Millis,
}

impl Old {
    fn read(conn: &rusqlite::Connection, root: &Root) -> Result<Old> {
        let rows = conn
            .prepare("SELECT name, state, base, created_ms, last_used_ms FROM images")?
            .query_map([], |r| {
                let row = OldRow {
                    state: r.get(1)?,
                    base: r.get(2)?,
                    created: r.get(3)?,
                    last_used: r.get(4)?,
                };
                Ok((r.get(0)?, row))
            })?
            .collect::<rusqlite::Result<BTreeMap<String, OldRow>>>()?;
        let sql = "SELECT value FROM config WHERE key = ?1";
        let config = |key: &str| conn.query_row(sql, [key], |r| r.get::<_, String>(0)).ok();
        let classes = conn
            .prepare("SELECT name, lim, reserve_high FROM slot_classes")
            .and_then(|mut s| {
                s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
                    .collect::<rusqlite::Result<Vec<_>>>()
            })
            .unwrap_or_default();
        let images = match config("images_dir") {
            Some(d) if Path::new(&d) != root.default_images_dir() => ImagesDir::External(d.into()),
            _ => ImagesDir::Default,
        };
        Ok(Old {
            catalog: crate::store::file_id(&root.db()),
            lost: false,
            rows,
            markers: markers(root),
            classes,
            images,
            identity: config("images_dir_identity"),
        })
    }

    /// What the older release held true with its catalog lost: its tokens and markers, and the
    /// slot classes its slot files repeat; the images directory its tokens name.
    fn from_tokens(root: &Root) -> Old {
        let mut images = None;
        for (_, name, bytes) in lock_files_read(root) {
            if let Some(t) = Token::of(&bytes, name.as_str()) {
                images = images.or(t.images);
            }
        }
        Old {
            catalog: None,
            lost: true,
            rows: BTreeMap::new(),
            markers: markers(root),
            classes: old_slot_classes(root),
            images: images.unwrap_or(ImagesDir::Default),
            identity: None,
        }
    }
}

/// The images writers' markers stand for (`locks/leases/ENC.dirty`).
fn markers(root: &Root) -> BTreeSet<String> {
    crate::root::names_in(&root.leases())
        .into_iter()
        .filter_map(|n| ImageName::from_encoded(n.strip_suffix(".dirty")?).ok())
        .map(|n| n.as_str().to_owned())
        .collect()
}

/// The first bytes of `name` in `dir`, as a record reader reads them: what is planted there is
/// refused without waiting, or costs one buffer, never hanging a migration under the hold.
fn read_old_file(dir: &Dir, name: &str) -> Option<Vec<u8>> {
    let file = dir.open_read(name).ok()?;
    image_record::read_area(&file).ok()
}

/// Each image lock file (named as an image) that can be read, with its first bytes.
fn lock_files_read(root: &Root) -> Vec<(String, ImageName, Vec<u8>)> {
    let Ok(locks) = Dir::open_in_root(&root.image_locks()) else {
        return Vec::new();
    };
    let read = |file: String| {
        let name = Root::image_of_lock_file(&file)?;
        let bytes = read_old_file(&locks, &file)?;
        Some((file, name, bytes))
    };
    let files = image_lock_files(root);
    files.into_iter().filter_map(read).collect()
}

/// The entries of `dir` whose names are text.
fn names(dir: &Dir) -> Vec<String> {
    let names = dir.names().unwrap_or_default().into_iter();
    names.filter_map(|n| n.into_string().ok()).collect()
}

/// The slot classes the older release's slot files state (class, limit, reserve), each once.
fn old_slot_classes(root: &Root) -> Vec<(String, u32, u32)> {
    let Ok(slots) = Dir::open_in_root(&root.slot_locks()) else {
        return Vec::new();
    };
    let mut classes = Vec::new();
    for dir in names(&slots) {
        // Never through a link, nor into anything but a directory.
        let Ok(class) = slots.sub(&dir) else {
            continue;
        };
        let mut files = names(&class);
        files.sort();
        let stated = files.iter().find_map(|f| {
            let bytes = read_old_file(&class, f)?;
            let body = image_record::checked_body(&bytes)?;
            let body = body.strip_prefix("stowage-slot ")?;
            let field = |k| field(body, k);
            let limit = field("limit")?.parse().ok()?;
            Some((
                field("class")?.to_owned(),
                limit,
                field("reserve")?.parse().ok()?,
            ))
        });
        classes.extend(stated);
    }
    classes
}

/// Writes every image's record under its lock taken without waiting. `Some(name)`: a lock was busy,
/// to wait for before another pass; the records written so far stand.
fn convert(root: &Root, old: &Old) -> Result<Option<ImageName>> {
    let mut names: BTreeSet<String> = old.rows.keys().cloned().collect();
    names.extend(old.markers.iter().cloned());
    let on_file = image_lock_files(root).into_iter();
    let on_file = on_file.filter_map(|f| Root::image_of_lock_file(&f));
    names.extend(on_file.map(|n| n.as_str().to_owned()));
    let dir = old.images.path_in(root.dir());
    for name in names {
        let Ok(n) = ImageName::parse(&name) else {
            continue;
        };
        let path = root.image_lock(&n);
        let missing = lock::IfMissing::create_if(old.rows.contains_key(&name));
        let guard = match lock::acquire_no_wait(&path, Mode::Exclusive, missing) {
            Ok(Some(g)) => g,
            Ok(None) => return Ok(Some(n)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(lock::error(&format!("image '{name}'"), &path, e)),
        };
        let bytes = image_record::read_area(guard.file())
            .with_context(|| format!("cannot read the lock file of image '{name}'"))?;
        let (seen, token) = (image_record::Seen::parse(&bytes), Token::of(&bytes, &name));
        // Its catalog lost since an earlier pass wrote this record from its row: the record knows
        // more (the base, a deletion) than any token, which that release has not written since.
        if old.lost && seen.record.is_some() && token.as_ref().is_none_or(|t| t.disabled) {
            continue;
        }
        let record = derive(&name, old, token.as_ref(), &dir.join(n.encoded()));
        crate::debug::pause(&format!("migrate-converting-{name}"));
        let Some(r) = record else {
            guard.file().set_len(0)?;
            continue;
        };
        write_beside_token(guard.file(), seen, &r)
            .with_context(|| format!("cannot write the record of image '{name}'"))?;
        // Only once the record is durable: that release no longer takes its token (it asks its
        // catalog, which changes the file for anything it changes), this one still does.
        if bytes.starts_with(LEGACY_PREFIX) {
            guard
                .file()
                .write_all_at(&[DISABLED], 0)
                .with_context(|| format!("cannot write the lock file of image '{name}'"))?;
        }
        let used = old.rows.get(&name).map(|r| r.last_used);
        if let Some(used) = used.or(token.and_then(|t| t.used)) {
            let _ = image_record::set_last_use(guard.file(), used);
        }
    }
    Ok(None)
}

/// The value of `KEY=` in an older release's `body`.
fn field<'a>(body: &'a str, key: &str) -> Option<&'a str> {
    body.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

/// A record in the older release's format (`stowage-image 2|3|4`), if of this image.
struct Token {
    state: String,
    /// The row's last use, written with it.
    used: Option<Millis>,
    /// The images directory it names (`default`, or an absolute path).
    images: Option<ImagesDir>,
    /// Disabled by a pass that wrote the record beside it (that release has not written since).
    disabled: bool,
}

/// The first byte of a token once the record beside it is durable (`stowage-image` → `-towage-image`).
const DISABLED: u8 = b'-';

impl Token {
    /// The token in a lock file's first `bytes` (slot A), disabled or not, if of the image `name`.
    fn of(bytes: &[u8], name: &str) -> Option<Token> {
        let mut bytes = bytes[..bytes.len().min(TOKEN_AREA)].to_vec();
        let disabled = bytes.first() == Some(&DISABLED);
        if disabled {
            bytes[0] = LEGACY_PREFIX[0];
        }
        if !bytes.starts_with(LEGACY_PREFIX) {
            return None;
        }
        let body = image_record::checked_body(&bytes)?;
        let field = |k| field(body, k);
        (field("image")? == name).then(|| Token {
            state: field("state").unwrap_or("").to_owned(),
            used: field("used").and_then(|u| u.parse().ok()),
            images: field("images").and_then(ImagesDir::decode),
            disabled,
        })
    }
}

/// Writes `r` unless the record there says the same, in slot B (odd sequence numbers): the token
/// stays in slot A for every pass to derive from (module doc).
fn write_beside_token(
    file: &std::fs::File,
    mut seen: image_record::Seen,
    r: &Record,
) -> Result<()> {
    let same = |s: &Record| {
        *s == Record {
            seq: s.seq,
            ..r.clone()
        }
    };
    if seen.record.as_ref().is_some_and(same) {
        return Ok(());
    }
    if let Some(s) = seen.record.as_mut() {
        s.seq += s.seq % 2;
    }
    Ok(image_record::write(file, &mut seen, r)?)
}

/// The record an image gets, from what the older release held true.
fn derive(name: &str, old: &Old, token: Option<&Token>, path: &Path) -> Option<Record> {
    let tree = path.exists();
    let row = old.rows.get(name);
    let marked = old.markers.contains(name);
    let (state, outcome, base) = match (row, marked, token.map(|t| t.state.as_str())) {
        // A writer's record is the truth while its marker stands.
        (_, true, Some("ready")) => (State::Ready, "exit 0", None),
        (_, true, _) if row.is_some() || token.is_some() => {
            (State::Incomplete, "its writer failed or died", None)
        }
        (Some(r), _, _) => {
            let (state, outcome) = old_state(&r.state);
            (state, outcome, r.base.clone())
        }
        // A ready token whose row was lost: it was ready.
        (None, false, Some("ready")) if tree => (State::Ready, "exit 0", None),
        // The catalog lost: the token is all that says what the image was.
        (None, false, Some(said)) if tree && old.lost => {
            let (state, outcome) = old_state(said);
            (state, outcome, None)
        }
        (None, _, _) if tree => (State::Incomplete, crate::image_record::ADOPTED, None),
        (None, _, _) => return None,
    };
    // No row: that release recorded no creation: its token's last use keeps gc's age and order;
    // else the tree's time and a last use of now (a tree's time says nothing of use).
    let (created, changed) = match (row, token.and_then(|t| t.used)) {
        (Some(r), _) => (r.created, r.created),
        (None, Some(used)) => (used, used),
        (None, None) => {
            let made = crate::clock::tree_time(path);
            (made, crate::clock::now_ms().max(made))
        }
    };
    let mut r = Record::new(name, old.images.clone(), created);
    r.changed = changed;
    (r.state, r.outcome, r.base) = (state, Some(outcome.to_owned()), base);
    Some(r)
}

/// Each image's record as a migration with the catalog lost would write it, by lock file name:
/// what a listing shows of a store it cannot migrate now.
pub fn records_from_tokens(root: &Root) -> BTreeMap<String, Record> {
    let old = Old::from_tokens(root);
    let dir = old.images.path_in(root.dir());
    let mut records = BTreeMap::new();
    // A listing beside a busy catalog: what is planted among the lock files is left out.
    for (file, name, bytes) in lock_files_read(root) {
        let token = Token::of(&bytes, name.as_str());
        let seen = image_record::Seen::parse(&bytes);
        let record = match (&token, seen.record) {
            (t, Some(r)) if t.as_ref().is_none_or(|t| t.disabled) => Some(r),
            _ => derive(
                name.as_str(),
                &old,
                token.as_ref(),
                &dir.join(name.encoded()),
            ),
        };
        records.extend(record.map(|r| (file, r)));
    }
    records
}

/// A state of the older release's (a row's or a token's), as a record of this one, with its outcome.
fn old_state(said: &str) -> (State, &'static str) {
    match said {
        "ready" => (State::Ready, "exit 0"),
        "deleting" => (State::Deleting, "removal interrupted"),
        "incomplete" => (State::Incomplete, "its writer failed or died"),
        // Its lock is free (we hold it): the writer died.
        _ => (State::Incomplete, "its writer died"),
    }
}

/// Once a pass found every lock free and wrote every record: the slot classes, the configuration,
/// the catalog at schema 11 (last), then what the older release left behind.
fn finish(store: &Store, conn: Option<&rusqlite::Connection>, old: &Old) -> Result<()> {
    let root = store.root();
    slot_classes(root, old)?;
    let mut config = Config {
        images: old.images.clone(),
        // Only an external directory's identity tells anything: the default is found from the root.
        identity: match old.images {
            ImagesDir::Default => None,
            ImagesDir::External(_) => old.identity.clone(),
        },
        // Recorded and claimed as `init` does: a copy of the store is then told from it.
        root: root.open()?.identity().ok(),
        ..Config::fresh()
    };
    // A directory another root claims (this store was copied from that one before either
    // migrated): the root is left unrecorded, so every use asks the claim, and is refused.
    let external = matches!(config.images, ImagesDir::External(_));
    let claimed = |c: &Config| {
        let images = root.open_images_dir(&c.images.path_in(root.dir()))?;
        crate::images_dir::claim(root, c, false, &images)
    };
    if external && claimed(&config).is_err() {
        config.root = None;
    }
    crate::debug::pause("migrate-claimed");
    crate::config::write(root.dir(), &root.open()?, &config)?;
    // The default one is claimed too, so that no other store's init takes it; once the
    // configuration carries the id, so that a copy taken meanwhile finds its own id there.
    if !external {
        let _ = claimed(&config);
    }
    if let Some(conn) = conn {
        retire_catalog(store, conn, old.catalog)?;
    }
    // The older release's statement in the global lock file, and its markers.
    if let Ok(Some(g)) = lock::open_existing(&root.global_lock()) {
        let _ = g.set_len(0);
    }
    if let Ok(d) = crate::dir::Dir::open_in_root(&root.leases()) {
        for n in d.names().unwrap_or_default() {
            if n.to_str().is_some_and(|n| n.ends_with(".dirty")) {
                let _ = d.unlink(&n);
            }
        }
    }
    if let Ok(d) = root.open() {
        let _ = d.unlink("images-dir");
    }
    Ok(())
}

/// The older catalog at schema 11, emptied (that release then refuses the store). One deleted or
/// replaced since it was read is not the older release's any more: nothing to retire there.
fn retire_catalog(
    store: &Store,
    conn: &rusqlite::Connection,
    opened: Option<(u64, u64)>,
) -> Result<()> {
    let db = store.root().db();
    // One transaction: a look without the global lock (doctor's) never sees the catalog emptied.
    let retired = conn
        .execute_batch(
            "BEGIN IMMEDIATE;
         DROP TABLE IF EXISTS records;
         DROP TABLE IF EXISTS slot_classes;
         DROP TABLE IF EXISTS config;
         DROP TABLE IF EXISTS images;",
        )
        .map_err(anyhow::Error::from)
        .and_then(|()| crate::catalog::create_schema(conn))
        .and_then(|()| Ok(conn.execute_batch("COMMIT")?));
    match retired {
        Err(_) if crate::store::file_id(&db) != opened => Ok(()),
        // Damaged past its rows (read whole): the records are written, the catalog is made anew.
        Err(e) if crate::catalog::is_damage(&e, &db) => {
            let line = set_aside_damaged(store, &e)?;
            store
                .ctx()
                .say(&format!("{line} (the images' records are written)"));
            Ok(())
        }
        other => other,
    }
}

/// Each slot class's limits, into its first slot file (the others emptied of older notes).
fn slot_classes(root: &Root, old: &Old) -> Result<()> {
    for (class, limit, reserve) in &old.classes {
        let dir = crate::slots::make_class_dir(root, class)?;
        let files: Vec<String> = dir
            .names()
            .with_context(|| format!("cannot list {}", root.slot_class_dir(class).display()))?
            .into_iter()
            .filter_map(|n| n.into_string().ok())
            .collect();
        let top = |high: bool| {
            let next = |k| match (k, high) {
                (Kind::High(i), true) | (Kind::Normal(i), false) => Some(i + 1),
                _ => None,
            };
            let nexts = files.iter().filter_map(|f| Kind::of(f).and_then(next));
            nexts.max().unwrap_or(0)
        };
        for f in files.iter().filter(|f| f.ends_with(".lock")) {
            if let Ok(file) = dir.open_rw(f, false) {
                let _ = file.set_len(0);
            }
        }
        let mut limits = crate::slot_limits::Limits::set(*limit, *reserve, None);
        limits.files = limits.files.max(top(false));
        limits.high_files = limits.high_files.max(top(true));
        let zero = dir.open_rw("0.lock", true)?;
        crate::slot_limits::write(&zero, class, Some(&limits))?;
    }
    Ok(())
}

/// Waits (holding only `store.lock`) for an image lock a pass found busy.
fn wait_for(store: &Store, name: &ImageName, deadline: Option<Instant>) -> Result<()> {
    let path = store.root().image_lock(name);
    let mut wait = lock::Wait::on(&store.root().image_locks(), deadline);
    let holders =
        || crate::holders::holders_phrase(store.ctx(), LockKind::Image, &path, false, deadline);
    let what = format!("the lock on image '{name}' before migrating the store");
    let before = holders();
    let _line = crate::wait_line::announce(store.ctx(), &what, &before, None);
    let since = crate::acquire::waiting_since();
    match lock::acquire(&path, Mode::Exclusive, lock::IfMissing::Fail, &mut wait) {
        Ok(waited) => waited.map(drop).or_else_busy(|| {
            // Who holds it now, not who did when the wait began.
            let now = holders();
            crate::Error::Busy(crate::error::Busy {
                what: format!("the lock on image '{name}' (needed free to migrate the store)"),
                holders: if now.is_empty() { before } else { now },
                waited: since.elapsed(),
            })
            .into()
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(lock::error(&format!("image '{name}'"), &path, e)),
    }
}

/// A store without a configuration and without an older catalog: its configuration, made now
/// unless images have records (a store that lost it: refused until `doctor --repair` writes it
/// with the id its claim keeps; a fresh one would give the store a new id).
fn ensure_config(root: &Root) -> Result<()> {
    let dir = root.open()?;
    let path = root.dir().join(crate::config::FILE);
    let found = dir.stat_at(crate::config::FILE);
    if found
        .with_context(|| format!("cannot look at {}", path.display()))?
        .is_none()
        && !crate::images_dir::has_records(root)?
    {
        crate::config::create(root.dir(), &dir, &Config::fresh())?;
    }
    Ok(())
}

fn image_lock_files(root: &Root) -> Vec<String> {
    crate::root::names_in(&root.image_locks())
        .into_iter()
        .filter(|n| n.ends_with(".lock"))
        .collect()
}
