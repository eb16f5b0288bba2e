//! The records' database: which database the ready tokens and slot
//! records in the store's lock files speak for, so that a reader (and a
//! slot's acquirer) can trust a record without reading the database's
//! header — three requests fewer per read on NFS.
//!
//! Invariant: once a transaction on a database has begun, no ready token
//! and no slot record of another database is left in the store's lock
//! files in the format a reader trusts without the header, except in files
//! this process holds (its own start takes them away) and writers' records
//! in the header-checked format (the truth about their images while their
//! markers stand, judged by their fold). A file another process holds
//! exclusively loses such a record without its lock ([`held_elsewhere`]).
//! See [`for_this_database`], and docs/design.md, "The records' database".

use std::os::unix::fs::FileExt;

/// The first line of the records' database as schema 9 wrote it: the
/// database's identity alone.
const RECORDS_DB: &str = "stowage-records 1\n";

/// The first line from schema 10 (`record::NEW_ALONE_SINCE_SCHEMA`): the
/// identity and the images directory, all a new image's write needs to
/// know without the database (`crate::written`, new images). Written only
/// by binaries at schema 10 or later, after a transaction on their own
/// schema: its presence proves that no older binary can still make
/// transactions on the store.
const RECORDS_DB_IMAGES: &str = "stowage-records 2\n";

/// What the global lock file states: the identity of the database the
/// store's records speak for and, from schema 10, its images directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    pub db: u32,
    pub images: Option<std::path::PathBuf>,
}

/// The longest statement read: an images directory's path is at most
/// `PATH_MAX`.
const STATEMENT_MAX: usize = 4200;

/// Parses a statement in either format.
fn parse(bytes: &[u8]) -> Option<Statement> {
    if let Some(body) = crate::record::checked_body(bytes, RECORDS_DB_IMAGES) {
        let mut lines = body.lines();
        let db = u32::from_str_radix(lines.next()?.strip_prefix("db=")?, 16).ok()?;
        let images = lines.next()?.strip_prefix("images=")?;
        if !images.starts_with('/') {
            return None;
        }
        return Some(Statement {
            db,
            images: Some(images.into()),
        });
    }
    let body = crate::record::checked_body(bytes, RECORDS_DB)?;
    let db = u32::from_str_radix(body.strip_prefix("db=")?.strip_suffix('\n')?, 16).ok()?;
    Some(Statement { db, images: None })
}

/// What the global lock file `global` (held) states: `None` if nothing.
fn stated(global: &std::fs::File) -> Option<Statement> {
    let mut buf = vec![0u8; STATEMENT_MAX];
    let n = global.read_at(&mut buf, 0).ok()?;
    parse(&buf[..n])
}

/// What the global lock file states, read without its lock (three calls:
/// open, read, close), for a write of a new image: the identity and the
/// images directory, in the format only binaries at schema 10 write.
/// `None` (no statement, an older one, a torn one, no file): the write
/// goes the database's way.
///
/// Read without the lock, the statement may be one a transaction is
/// changing: a torn one fails its CRC; a stale one (a database replaced,
/// not yet used) names an identity the fold then refuses to vouch for —
/// the write is lost to `incomplete`, never made ready.
pub fn statement(root: &crate::root::Root) -> Option<(crate::record::DbId, std::path::PathBuf)> {
    let st = stated(&crate::record::open_read_only(&root.global_lock()).ok()?)?;
    Some((crate::record::DbId::from_id(st.db)?, st.images?))
}

/// States `id` and, from schema 10, `images` in the global lock file
/// `global` (held), synced; a failure only makes the next transaction look
/// again.
fn restate(global: &std::fs::File, id: u32, images: Option<&std::path::Path>) {
    use std::os::unix::ffi::OsStrExt;
    let mut body = match images {
        Some(dir) => {
            // A path that cannot be stated on one line states none: new
            // images go the database's way.
            let dir = dir.as_os_str().as_bytes();
            if dir.contains(&b'\n') || std::str::from_utf8(dir).is_err() {
                return restate(global, id, None);
            }
            format!(
                "{RECORDS_DB_IMAGES}db={id:08x}\nimages={}\n",
                String::from_utf8_lossy(dir)
            )
        }
        None => format!("{RECORDS_DB}db={id:08x}\n"),
    };
    body.push_str(&format!(
        "crc={:08x}\n",
        crate::record::crc32(body.as_bytes())
    ));
    if global.set_len(0).is_ok() && global.write_all_at(body.as_bytes(), 0).is_ok() {
        let _ = global.sync_data();
    }
}

/// Keeps the records' database: makes sure that no ready token or slot
/// record of a database other than the one of `tx` is left in the store's
/// lock files, which is what lets a reader (and a slot's acquirer) trust a
/// record in `record::FORMAT_ALONE` without reading the database's header.
///
/// The global lock file states the identity of the database the records
/// speak for. Every transaction compares it with its own database's
/// identity (asked inside the transaction; one read of the global lock
/// file in all) — right after it began, before it reads a row, and again
/// after a repair renews the identity. They differ after the database was
/// made anew (deleted, rebuilt, made by an older release), restored or
/// copied in from elsewhere and repaired, or replaced by another store's:
/// then, under the global lock, every image lock file that no writer holds
/// (tried shared, without waiting) loses a ready token that names another
/// identity, durably (one held exclusively elsewhere loses any record in
/// the trusted format of another identity: [`held_elsewhere`]) — except a
/// writer's record (a sized outcome), the
/// truth about its image while its marker stands, which its fold judges:
/// that one is rewritten in the format a reader checks against the
/// header (its marker may be gone already, folded, and then nothing else
/// would take it away); every slot class whose files carry another
/// database's records loses them all; and only then is the new identity
/// written, durably. Until that first transaction no tree can have changed
/// (any change takes a transaction, and a write without one checks the
/// header itself), so a token read in between still names a complete,
/// unchanged tree. A file a writer without a transaction holds is written
/// by it at its end: its outcome (folded by the next transaction, which
/// judges its identity), or the token it found, put back in the format a
/// reader checks against the header (`record::put_back`). A failure to
/// take a token away fails the transaction; a failure to write the
/// identity only makes the next transaction look again.
///
/// Not covered: a database made anew (the file deleted) by a release
/// before schema 9, which knows nothing of this. Its transactions change
/// rows without the walk, and until a transaction of this release, readers
/// of this release trust the tokens of the database that was deleted (an
/// image that database called ready, which the new one may call
/// incomplete). Telling it without the walk would cost every read the
/// header again (open, read, close).
pub fn for_this_database(tx: &crate::meta::Tx, root: &crate::root::Root) -> anyhow::Result<()> {
    use anyhow::Context;
    if crate::meta::schema_version() < crate::record::ALONE_SINCE_SCHEMA {
        return Ok(());
    }
    let id = tx.identity()?;
    let global = tx.global_file();
    // The images directory is stated only by a binary at schema 10 on a
    // database at its own schema: the statement in that format proves to a
    // new image's writer that no older binary can make transactions here.
    let images = match crate::meta::schema_version() >= crate::record::NEW_ALONE_SINCE_SCHEMA
        && matches!(tx.schema()?, crate::meta::Schema::Current)
    {
        true => Some(tx.images_dir(root)?),
        false => None,
    };
    let now = stated(global);
    if now.as_ref().is_some_and(|s| s.db == id) {
        // The same database: only the images directory may need saying
        // (a store of schema 9, or `init --images-dir`).
        if now.is_some_and(|s| s.images != images)
            && !matches!(tx.schema()?, crate::meta::Schema::Ahead(_))
        {
            restate(global, id, images.as_deref());
        }
        return Ok(());
    }
    // A database of a newer release is refused by the caller: its own
    // binaries keep the records (asked inside the transaction: no call).
    if matches!(tx.schema()?, crate::meta::Schema::Ahead(_)) {
        return Ok(());
    }
    let locks = root.image_locks();
    crate::record::each_lock_file_or_denied(&locks, |file| {
        if !crate::lock::try_shared_open(file)? {
            return held_elsewhere(file, id);
        }
        let f = crate::record::found(file)?;
        let Some(t) = ready_of_another(&f, id) else {
            return Ok(());
        };
        if !crate::written::is_writers(&f) {
            crate::record::invalidate(file)?;
        } else if crate::record::trusted_alone(&f) {
            // A writer's outcome (sized): kept for its fold, but no longer
            // one a reader trusts without the header — its marker may be
            // gone already (folded), and then nothing else would take it
            // away.
            crate::record::demote(file, t)?;
        }
        Ok(())
    }, |path| {
        // Another user's lock file: its readers trust what it says
        // without the header, and we cannot take it away. The walk fails
        // (the identity stays unstated) until someone who may write it —
        // its owner, root — makes a transaction, which takes it away;
        // until then no tree can change here (every change takes a
        // transaction), so what the token says is still so.
        let f = match crate::record::found_read_only(path) {
            Ok(f) => f,
            // Not even readable: nobody can read it here but its owner,
            // and we cannot tell. Left, as before.
            Err(e) if e.raw_os_error() == Some(libc::EACCES) => return Ok(()),
            Err(e) => return Err(e),
        };
        if trusted_of_another(&f, id) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "{} holds a ready token of another database that this user may not take away (another user's lock file, not writable for its group); run any stowage command on this store as its owner or as root, and make the store's files group-writable (umask 002)",
                    path.display()
                ),
            ));
        }
        Ok(())
    })
    .with_context(|| {
        format!(
            "cannot take other databases' ready tokens out of {}",
            locks.display()
        )
    })?;
    take_away_other_slot_records(root, id)?;
    restate(global, id, images.as_deref());
    Ok(())
}

/// The walk's part for an image lock file it could not take shared: held
/// exclusively by a writer, an exclusive reader (`--read-exclusive`, for
/// its whole command), or an outside program (flock(1)). A record there
/// that a reader trusts without the header (a ready token or a writer's
/// sized outcome in `record::FORMAT_ALONE`) of another identity is taken
/// away all the same, without the lock: left, it would go on counting
/// beside a database that may not even know the image — an exclusive
/// reader's finish writes nothing for an image its database lacks.
///
/// Taking it away without the lock is safe because nobody writes a token
/// meanwhile (tokens are written under the global lock, which the walk
/// holds), and whatever a writer without a transaction writes there
/// concurrently — its `writing` record, its outcome — can only be lost to
/// the truncation, never made: its marker then folds to not ready.
/// Readiness may be lost, never claimed. A file this very process holds is
/// left, as before: its holder (a write starting in this transaction)
/// folds and takes away what it reads itself.
fn held_elsewhere(file: &std::fs::File, id: u32) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    if !trusted_of_another(&crate::record::found(file)?, id) {
        return Ok(());
    }
    let st = file.metadata()?;
    if crate::lock::held_exclusively_here(st.dev(), st.ino()) {
        return Ok(());
    }
    crate::record::invalidate(file)
}

/// The ready record (a token, or a writer's sized outcome) in `f`, if it
/// names another database than `id`.
fn ready_of_another(f: &crate::record::Found, id: u32) -> Option<&crate::record::Token> {
    f.record
        .as_ref()
        .filter(|t| t.state == crate::record::State::Ready && t.db.0 != id)
}

/// Whether `f` holds a ready record of another database than `id` in the
/// format a reader trusts without the header.
fn trusted_of_another(f: &crate::record::Found, id: u32) -> bool {
    crate::record::trusted_alone(f) && ready_of_another(f, id).is_some()
}

/// The walk's part for slot records: every class directory (a real one;
/// anything planted in its place is no class's) whose files name another
/// database loses its records (`slot_record::take_away_other`).
fn take_away_other_slot_records(root: &crate::root::Root, id: u32) -> anyhow::Result<()> {
    use anyhow::Context;
    let slots = root.slot_locks();
    let Ok(top) = crate::dir::Dir::open_nofollow(&slots) else {
        return Ok(());
    };
    for enc in top.names().unwrap_or_default() {
        let Some(enc) = enc.to_str() else { continue };
        let Ok(dir) = top.sub(enc) else { continue };
        crate::slot_record::take_away_other(
            &dir,
            &enc.replace('%', "/"),
            crate::record::DbId::from_id(id),
        )
        .with_context(|| {
            format!(
                "cannot take other databases' slot records out of {}",
                slots.join(enc).display()
            )
        })?;
    }
    Ok(())
}
