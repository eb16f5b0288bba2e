//! Image records: what an image's lock file says about the image, so that a
//! reader learns "ready" from the lock it takes anyway, without the global
//! lock or the database.
//!
//! The database is the source of truth for every image's state, except
//! while a writer's marker stands (`crate::written`: a write without the
//! database leaves a record `writing`, then `ready` or `incomplete`, here,
//! which is the truth until a transaction folds it in). Otherwise a record
//! is a *ready token* derived from the database and kept in the first
//! bytes of the image's lock file (`locks/images/ENC.lock`; the file
//! remains an ordinary lock file, flock(1) on it works as before):
//!
//! ```text
//! stowage-image 3                 (2: written by a release before schema 8)
//! state=ready
//! image=alpine:3.17
//! images=default                  (or the configured absolute directory)
//! db=5e1f00d2                     (the database's identity)
//! used=1764543600000              (the row's last use, written with it)
//! crc=1a2b3c4d
//! ```
//!
//! Invariants:
//! - **A valid `ready` token exists only while the image's row says
//!   `ready`.** Every change of a row away from `ready` — a write starting,
//!   a removal marking it, doctor dropping it, a store-wide command's
//!   deletions, a rebuild of the database — first *invalidates* the token
//!   (the file is truncated: that frees, so it works on a full
//!   copy-on-write filesystem too), durably, holding the image's exclusive
//!   lock or the store-wide lock; anything in the token area is taken away,
//!   whatever it says (another layout, another release). A token is
//!   written only by a holder of the image's lock that saw the row `ready`
//!   in a transaction while holding that lock, once that transaction has
//!   committed and while the global lock is still held — so that no
//!   transaction that forgets the image can come between what it saw and
//!   what it writes, and what it writes (the last use) is committed — and
//!   only while no store-wide hold stands (a token written beside one,
//!   by a command nested in it, would carry no store-wide hint): a writer
//!   that made the row ready (exclusive), a reader of the slow path, an
//!   exclusive read at its finish.
//! - **A token speaks for one database and one image:** it names the
//!   database's identity ([`DbId`]: random, given to every database when
//!   stowage first opens it; a rebuilt one, one deleted and made anew, one
//!   made by a release that gives none, is another) and the image (a lock
//!   file copied onto another name says nothing). The images directory is
//!   `default` (the root's `img`, as *this* process names the root: a
//!   store seen at another path, by another host or a container, resolves
//!   it there) or the configured absolute directory.
//! - **A reader trusts only what it can check:** the format line (another
//!   version means "ask the database"), the CRC of everything before the
//!   `crc=` line (a torn write, after a power loss, fails it), `state=ready`,
//!   its image's name, the database's identity (the header's four bytes:
//!   open, read, close), and the
//!   freshness of `used`. Anything else, an empty file included (a store
//!   made before records, a lock file made by flock(1)), sends it to the
//!   database. A mistake can only ever cost a transaction.
//! - **`used` is the row's last use, to
//!   [`LAST_USE_RESOLUTION`]:** the fast path is taken only while it is
//!   within that of the reader's own clock (either way); otherwise the
//!   slow path records the use and writes a token with it. So a read
//!   without a transaction is one whose use the row already holds to the
//!   resolution — judged by the clock of the process that reads, as the
//!   row's last use always was (gc's `--unused-for` slack covers it).
//! - Bytes after the `crc=` line are ignored: a token is written with one
//!   `pwrite` at offset 0 over an empty or invalidated file.
//!
//! Two *hints* follow at fixed offsets ([`HINTS_AT`]), one byte each, read
//! in the same `pread` as the token and never touched by a token write, so
//! that an uncontended read opens neither the image's gate nor the store
//! lock:
//! - **writer waits** (`Hint::WriterWaits`): set by a writer that holds the
//!   image's gate exclusively, before it waits for the lock; a reader that
//!   sees it tries the gate (and queues behind the writer if it is held).
//!   Cleared under the gate: by the writer once it has the lock and no
//!   other writer holds the gate, or by a reader that finds the gate free.
//!   Only fairness rests on it (writers are not starved); a lost hint
//!   costs no exclusion.
//! - **store-wide** (`Hint::StoreWide`): set on every image lock file by a
//!   store-wide operation that holds `locks/store.lock` exclusively, before
//!   it checks that every image lock is free; cleared when it ends (still
//!   holding it), or by a reader that holds `store.lock` shared (no
//!   operation can start meanwhile). A read that takes its image lock after
//!   the operation's check therefore sees the hint and asks `store.lock`; one
//!   that took it before is seen by the check. Lock files made after the
//!   pass carry no token a fast read could use: a token is written only
//!   after a start or finish transaction, which the operation's record
//!   refuses (docs/design.md, "Ready tokens").

use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::lock::Guard;

/// The first line; another version makes the record unusable here (the
/// reader asks the database, which knows the schema).
const FORMAT: &str = "stowage-image 2\n";

/// The first line of records written on a store whose binaries all fold
/// writers' records (schema [`WRITERS_SINCE_SCHEMA`]): only a token in
/// this format lets a writer skip the database (`crate::written`). A
/// reader takes either.
const FORMAT_WRITERS: &str = "stowage-image 3\n";

/// The schema version from which every binary that uses the database
/// folds writers' records first (`crate::written`): a token written by
/// such a binary proves that the store is at it, since a token is only
/// written after a transaction on the binary's own schema.
pub const WRITERS_SINCE_SCHEMA: i64 = 8;

/// The first line of records written on a store whose binaries all keep
/// the records' database (schema [`ALONE_SINCE_SCHEMA`]): a reader trusts
/// such a token without reading the database's header.
const FORMAT_ALONE: &str = "stowage-image 4\n";

/// The schema version from which every binary that uses the database
/// keeps the records' database ([`for_this_database`]): a token in
/// [`FORMAT_ALONE`], written only by such a binary after a transaction on
/// its own schema, proves that the store is at it — so that no binary that
/// could renew the database's identity without taking away the tokens of
/// the old one can still run on it.
pub const ALONE_SINCE_SCHEMA: i64 = 9;

/// The schema version from which every binary that uses the database
/// leaves alone an image tree without a row whose lock is held or whose
/// lock file carries a writer's record, and folds such a record before it
/// calls the image missing: so that a new image may be written without
/// the database (`crate::written`, new images). The global lock file's
/// statement in the format only such binaries write proves the store is
/// at it (`records_db::statement`).
pub const NEW_ALONE_SINCE_SCHEMA: i64 = 10;

/// The format this binary writes tokens in.
fn format() -> &'static str {
    let v = crate::meta::schema_version();
    if v >= ALONE_SINCE_SCHEMA {
        FORMAT_ALONE
    } else if v >= WRITERS_SINCE_SCHEMA {
        FORMAT_WRITERS
    } else {
        FORMAT
    }
}

/// Where the hints start: tokens end before (a longer one, with a path
/// near PATH_MAX, is not written: such images are read through the
/// database every time).
pub const HINTS_AT: usize = 3072;
const MAX: usize = HINTS_AT;

/// A one-byte flag after the token (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hint {
    /// A writer may be waiting at the image's gate.
    WriterWaits,
    /// A store-wide operation may hold the store.
    StoreWide,
}

impl Hint {
    fn offset(self) -> u64 {
        (HINTS_AT
            + match self {
                Hint::WriterWaits => 0,
                Hint::StoreWide => 1,
            }) as u64
    }
}

/// The schema version from which binaries keep tokens: a store migrated
/// to it has locked out every binary that would change an image without
/// invalidating its token. `STOWAGE_DEBUG_SCHEMA_LIMIT` below it acts as
/// such an older binary, which neither reads nor writes them.
const SINCE_SCHEMA: i64 = 5;

fn enabled() -> bool {
    crate::meta::schema_version() >= SINCE_SCHEMA
}

/// How stale an image's recorded last use may be before a read records it
/// again (cargo's resolution for the same purpose): a read of an image
/// used in the last five minutes writes nothing to the metadata.
/// `gc --unused-for D` is that much coarser, on the safe side: it takes an
/// image for unused only once its recorded last use is older than D plus
/// this (a read in the last D may have recorded nothing).
pub const LAST_USE_RESOLUTION: Duration = Duration::from_secs(300);

/// Which database a token was derived from: the random identity every
/// database is given when stowage first opens it (SQLite's
/// `application_id`, header bytes 68–71; see `Store`). A database rebuilt
/// (by any release), deleted and made anew, or made by a release that
/// gives none (0) is another database, whatever inode it has. A copy of
/// the same database restored over it is not told apart: `doctor
/// --repair` gives the database a new identity, which is what a restore
/// must be followed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DbId(pub(crate) u32);

impl DbId {
    /// The identity of the database at `db`, read from its header (open,
    /// one read, close), for a reader that holds no SQLite lock (the fast
    /// path); inside a transaction, ask it (`meta::Tx::identity`). `None`:
    /// no database, or one without identity.
    pub fn of(db: &Path) -> Option<DbId> {
        let header = header(db)?;
        let id = u32::from_be_bytes(header[68..72].try_into().ok()?);
        (id != 0).then_some(DbId(id))
    }

    /// The identity and the schema version (`PRAGMA user_version`) of the
    /// database at `db`, read from its header like [`DbId::of`] (open, one
    /// read, close). `None` unless it is a database in rollback-journal
    /// mode: in WAL mode the header in the main file may lag the log.
    pub fn with_schema(db: &Path) -> Option<(Option<DbId>, i64)> {
        let header = header(db)?;
        if header[18] != 1 || header[19] != 1 {
            return None;
        }
        let schema = i32::from_be_bytes(header[60..64].try_into().ok()?);
        let id = u32::from_be_bytes(header[68..72].try_into().ok()?);
        Some(((id != 0).then_some(DbId(id)), i64::from(schema)))
    }

    /// The identity a transaction read (`meta::Tx::identity`).
    pub fn from_id(id: u32) -> Option<DbId> {
        (id != 0).then_some(DbId(id))
    }
}

/// The first 72 bytes of the SQLite database at `db` (open, one read,
/// close), if it is one.
fn header(db: &Path) -> Option<[u8; 72]> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(db)
        .ok()?;
    let mut header = [0u8; 72];
    file.read_exact_at(&mut header, 0).ok()?;
    (&header[..16] == b"SQLite format 3\0").then_some(header)
}

/// What a record says of its image's tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Complete: a ready token.
    Ready,
    /// A writer that took no transaction is at work, or died at work
    /// (a writer's record, see `crate::written`).
    Writing,
    /// That writer's command failed: the tree is not complete.
    Incomplete,
}

impl State {
    fn as_str(self) -> &'static str {
        match self {
            State::Ready => "ready",
            State::Writing => "writing",
            State::Incomplete => "incomplete",
        }
    }

    fn parse(s: &str) -> Option<State> {
        Some(match s {
            "ready" => State::Ready,
            "writing" => State::Writing,
            "incomplete" => State::Incomplete,
            _ => return None,
        })
    }
}

/// What a valid record says: a ready token, or a writer's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub state: State,
    /// The image's name.
    pub image: String,
    /// The configured images directory; `None`: the root's default one.
    pub images_dir: Option<PathBuf>,
    pub db: DbId,
    /// The row's last use, as written with the token.
    pub used: crate::clock::Millis,
    /// The tree's size, in a writer's record once it has measured it.
    pub size: Option<u64>,
    /// A writer's record of a write that made the image's tree itself (a
    /// new image, or one whose tree was gone: `crate::written`, new
    /// images): its outcome describes a tree no earlier row describes.
    pub fresh: bool,
}

impl Token {
    /// A token for `name`, whose tree is in `images_dir` of `root`.
    pub fn new(
        root: &crate::root::Root,
        name: &crate::name::ImageName,
        images_dir: &Path,
        db: DbId,
        used: crate::clock::Millis,
    ) -> Token {
        Token {
            state: State::Ready,
            image: name.as_str().to_owned(),
            images_dir: (images_dir != root.default_images_dir()).then(|| images_dir.to_owned()),
            db,
            used,
            size: None,
            fresh: false,
        }
    }
}

fn encode(t: &Token) -> Option<Vec<u8>> {
    encode_in(t, format())
}

/// [`encode`] with the format line `format`.
fn encode_in(t: &Token, format: &str) -> Option<Vec<u8>> {
    let images = match &t.images_dir {
        None => "default",
        Some(dir) => {
            let dir = dir.to_str()?;
            if !dir.starts_with('/') {
                return None;
            }
            dir
        }
    };
    if images.contains('\n') || t.image.contains('\n') {
        return None;
    }
    let mut body = format!(
        "{format}state={}\nimage={}\nimages={images}\ndb={:08x}\nused={}\n",
        t.state.as_str(),
        t.image,
        t.db.0,
        t.used
    );
    if let Some(size) = t.size {
        body.push_str(&format!("size={size}\n"));
    }
    if t.fresh {
        body.push_str("fresh=1\n");
    }
    body.push_str(&format!("crc={:08x}\n", crc32(body.as_bytes())));
    (body.len() <= MAX).then(|| body.into_bytes())
}

/// The lines of a record after its format line `format`, if its CRC (of
/// everything before the `crc=` line) holds; what follows that line
/// (hints, zeros) is ignored. Shared by image and slot records.
pub(crate) fn checked_body<'a>(bytes: &'a [u8], format: &str) -> Option<&'a str> {
    let text = match std::str::from_utf8(bytes) {
        Ok(t) => t,
        // Bytes after the crc line (hints, zeros) need not be text.
        Err(e) => std::str::from_utf8(&bytes[..e.valid_up_to()]).ok()?,
    };
    let body_len = text.find("\ncrc=")? + 1;
    let (body, rest) = text.split_at(body_len);
    let crc = rest.strip_prefix("crc=")?.split('\n').next()?;
    if crc != format!("{:08x}", crc32(body.as_bytes())) {
        return None;
    }
    body.strip_prefix(format)
}

/// Parses a token: `Some` only for a valid, current, `ready` one.
fn decode(bytes: &[u8]) -> Option<Token> {
    decode_any(bytes).filter(|t| t.state == State::Ready)
}

/// Parses a record in either format, in any state.
fn decode_any(bytes: &[u8]) -> Option<Token> {
    let (body, writers) = match checked_body(bytes, FORMAT_ALONE) {
        Some(b) => (b, true),
        None => match checked_body(bytes, FORMAT_WRITERS) {
            Some(b) => (b, true),
            None => (checked_body(bytes, FORMAT)?, false),
        },
    };
    let mut lines = body.lines();
    let mut field = |key: &str| lines.next()?.strip_prefix(key)?.strip_prefix('=');
    let state = State::parse(field("state")?)?;
    if !writers && state != State::Ready {
        return None;
    }
    let image = field("image")?.to_owned();
    let images_dir = match field("images")? {
        "default" => None,
        dir if dir.starts_with('/') => Some(PathBuf::from(dir)),
        _ => return None,
    };
    let db = DbId(u32::from_str_radix(field("db")?, 16).ok()?);
    let used = field("used")?.parse().ok()?;
    // A writer's record may go on with its size, then `fresh=1`; a token
    // (the first format) with nothing.
    let mut next = lines.next();
    let mut size = None;
    if let Some(v) = next.and_then(|l| l.strip_prefix("size="))
        && writers
    {
        size = Some(v.parse().ok()?);
        next = lines.next();
    }
    let fresh = next == Some("fresh=1") && writers;
    if fresh {
        next = lines.next();
    }
    if next.is_some() {
        return None;
    }
    Some(Token {
        state,
        image,
        images_dir,
        db,
        used,
        size,
        fresh,
    })
}

/// What one read of a lock file says: where the image is if its token is
/// valid here and now, and the hints.
#[derive(Debug, Default)]
pub struct Seen {
    /// The images directory, if the token vouches for the image.
    pub ready: Option<PathBuf>,
    pub writer_waits: bool,
    pub store_wide: bool,
}

/// Reads the lock file of `name`, locked by `guard`, in one `pread`: the
/// token counts if it is valid, names `name`, was derived from the
/// database now at `root` (its header read, only then), and its `used`
/// is within [`LAST_USE_RESOLUTION`] of our clock.
/// `db` keeps the database's identity once looked up, for the other
/// images of one request.
pub fn read(
    guard: &Guard,
    root: &crate::root::Root,
    name: &crate::name::ImageName,
    db: &std::cell::OnceCell<Option<DbId>>,
) -> Seen {
    read_file(guard.file(), root, name, db)
}

/// [`read`] of a lock file locked through `file`.
pub fn read_file(
    file: &std::fs::File,
    root: &crate::root::Root,
    name: &crate::name::ImageName,
    db: &std::cell::OnceCell<Option<DbId>>,
) -> Seen {
    if !enabled() {
        return Seen::default();
    }
    let mut buf = vec![0u8; HINTS_AT + 2];
    let Ok(n) = file.read_at(&mut buf, 0) else {
        return Seen::default();
    };
    let set = |h: Hint| (h.offset() as usize) < n && buf[h.offset() as usize] == b'1';
    // A token in the format of a store that keeps the records' database
    // speaks for the database there: no other's survives the first
    // transaction on it ([`for_this_database`]). An older one is checked
    // against the header (open, read, close).
    let alone = buf.starts_with(FORMAT_ALONE.as_bytes());
    let ready = decode(&buf[..n.min(MAX)]).filter(|t| {
        let age = crate::clock::now_ms() - t.used;
        t.image == name.as_str()
            && age.unsigned_abs() < LAST_USE_RESOLUTION.as_millis() as u64
            && (alone
                || db
                    .get_or_init(|| DbId::of(&root.db()))
                    .is_some_and(|now| now == t.db))
    });
    Seen {
        ready: ready.map(|t| t.images_dir.unwrap_or_else(|| root.default_images_dir())),
        writer_waits: set(Hint::WriterWaits),
        store_wide: set(Hint::StoreWide),
    }
}

/// What a writer that takes no transaction reads of its image's lock file
/// (`crate::written`), holding it exclusively: the record in any state and
/// format (with the bytes of its area, to put back if the write never
/// starts), and whether the store-wide hint is set.
pub struct Found {
    pub record: Option<Token>,
    /// Written on a store at [`WRITERS_SINCE_SCHEMA`] or later.
    pub writers_format: bool,
    pub bytes: Vec<u8>,
    pub store_wide: bool,
}

/// Reads a lock file's record and hints in one `pread`.
pub fn found(file: &std::fs::File) -> io::Result<Found> {
    let mut buf = vec![0u8; HINTS_AT + 2];
    let n = file.read_at(&mut buf, 0)?;
    let set = |h: Hint| (h.offset() as usize) < n && buf[h.offset() as usize] == b'1';
    let area = &buf[..n.min(MAX)];
    Ok(Found {
        record: decode_any(area),
        writers_format: area.starts_with(FORMAT_WRITERS.as_bytes())
            || area.starts_with(FORMAT_ALONE.as_bytes()),
        bytes: area.to_vec(),
        store_wide: set(Hint::StoreWide),
    })
}

/// Writes a writer's record (any state) over the token area, durably: a
/// `writing` record must be on disk before the command touches the tree,
/// a `ready` one before the lock is let go (on NFS, before the next locker
/// reads it). Bytes left after it from a longer record are ignored.
pub fn write_record(file: &std::fs::File, t: &Token) -> io::Result<()> {
    let bytes = encode(t).ok_or_else(|| io::Error::other("record too long"))?;
    file.write_all_at(&bytes, 0)?;
    file.sync_data()
}

/// Puts back the bytes of a token area read by [`found`] (a write that
/// never started), durably. A ready token in [`FORMAT_ALONE`] goes back in
/// [`FORMAT_WRITERS`], which a reader checks against the database's
/// header: while the write held the lock, a transaction may have found the
/// store's database renewed or replaced and taken away every token of the
/// old one but this (held: `records_db::for_this_database` skips it), and
/// a token put back as it was would then be trusted, without the header,
/// for a database that no longer vouches for it. The next read that goes
/// the database's way writes it in the current format again.
pub fn put_back(file: &std::fs::File, bytes: &[u8]) -> io::Result<()> {
    let checked = decode_any(bytes)
        .filter(|t| bytes.starts_with(FORMAT_ALONE.as_bytes()) && t.state == State::Ready)
        .and_then(|t| encode_in(&t, FORMAT_WRITERS));
    file.write_all_at(checked.as_deref().unwrap_or(bytes), 0)?;
    file.sync_data()
}

/// Rewrites a record `t` read by [`found`] in [`FORMAT_ALONE`] into
/// [`FORMAT_WRITERS`], durably: the same record, for the fold of its
/// writer's marker, but one a reader trusts only if the database's header
/// names its identity (`records_db::for_this_database`, for a writer's
/// record of another database). The caller holds the file's lock (shared
/// will do: no token is written beside it, as that takes the global lock
/// it holds) and knows it was in [`FORMAT_ALONE`].
pub fn demote(file: &std::fs::File, t: &Token) -> io::Result<()> {
    let bytes = encode_in(t, FORMAT_WRITERS).ok_or_else(|| io::Error::other("record too long"))?;
    file.write_all_at(&bytes, 0)?;
    file.sync_data()
}

/// Whether the record read by [`found`] is in [`FORMAT_ALONE`]: one a
/// reader trusts without the database's header.
pub fn trusted_alone(found: &Found) -> bool {
    found.bytes.starts_with(FORMAT_ALONE.as_bytes())
}

/// Whether anything is written in the lock file's token area (a token of
/// any layout or release, valid or not), and its hints.
fn token_area_used(file: &std::fs::File) -> io::Result<Option<[bool; 2]>> {
    let mut buf = vec![0u8; HINTS_AT + 2];
    let n = file.read_at(&mut buf, 0)?;
    let set = |h: Hint| (h.offset() as usize) < n && buf[h.offset() as usize] == b'1';
    let used = buf[..n.min(MAX)].iter().any(|b| *b != 0);
    Ok(used.then(|| [set(Hint::WriterWaits), set(Hint::StoreWide)]))
}

/// Sets or clears a hint (see the module doc for who may, holding what).
/// `sync`: durable before the caller lets go of what it holds, so that on
/// NFS a clearing cannot reach the server after a later setting.
pub fn set_hint(file: &std::fs::File, hint: Hint, on: bool, sync: bool) -> io::Result<()> {
    if !enabled() {
        return Ok(());
    }
    file.write_all_at(if on { b"1" } else { b"0" }, hint.offset())?;
    if sync { file.sync_data() } else { Ok(()) }
}

/// Sets (or clears) the store-wide hint on every image lock file: the
/// caller holds `locks/store.lock` exclusively. Each file is closed after
/// its write, which on NFS sends it to the server before the caller's
/// check of the image locks.
pub fn mark_store_wide(image_locks: &Path, on: bool) -> io::Result<()> {
    each_lock_file(image_locks, |file| {
        set_hint(file, Hint::StoreWide, on, false)
    })
}

/// Writes a `ready` token, holding the image's lock after seeing its row
/// `ready` (see the module doc for when). Not synced: a token lost in a
/// crash only sends the next reader to the database. Best effort for the
/// same reason.
pub fn write_ready(guard: &Guard, token: &Token) {
    if !enabled() {
        return;
    }
    if let Some(bytes) = encode(token) {
        let _ = guard.file().write_all_at(&bytes, 0);
    }
}

/// Takes the token away, durably, before a row leaves `ready` (the caller
/// holds the image's exclusive lock, or the store-wide lock). The file is
/// truncated — which frees, so a full copy-on-write filesystem allows it —
/// and its hints are put back, best effort (a hint lost with the token
/// costs nothing: without a token no read takes the fast path). Whatever
/// is in the token area goes, in any layout; a lock file with nothing
/// there is left alone: a new image's first write costs no sync.
pub fn invalidate(file: &std::fs::File) -> io::Result<()> {
    if !enabled() {
        return Ok(());
    }
    let Some(hints) = token_area_used(file)? else {
        return Ok(());
    };
    file.set_len(0)?;
    // Durable before the row changes: after a power loss, a token that
    // outlived the change would let a reader in on a tree being written.
    file.sync_data()?;
    for (on, hint) in hints.into_iter().zip([Hint::WriterWaits, Hint::StoreWide]) {
        if on {
            let _ = set_hint(file, hint, true, false);
        }
    }
    Ok(())
}

/// Invalidates the tokens of every image of the root: a rebuilt database
/// has no history to vouch for them. The caller holds the store-wide lock
/// (its hints set) and the global lock while no image lock is held.
/// Lock files whose content `keep` says yes to are left as they are (a
/// rebuild keeps writers' records: see `doctor`).
pub fn invalidate_all(image_locks: &Path, keep: impl Fn(&Found) -> bool) -> io::Result<()> {
    each_lock_file(image_locks, |file| {
        if found(file).is_ok_and(|f| keep(&f)) {
            return Ok(());
        }
        invalidate(file)
    })
}

/// Runs `f` on every image lock file of `image_locks` (regular files named
/// `*.lock`, opened without following links or creating anything).
pub(crate) fn each_lock_file(
    image_locks: &Path,
    f: impl FnMut(&std::fs::File) -> io::Result<()>,
) -> io::Result<()> {
    each_lock_file_or_denied(image_locks, f, |_| Ok(()))
}

/// [`each_lock_file`], with `denied` called on the path of each one this
/// process may not open for writing for want of permission (EACCES):
/// another user's lock file, which that user's readers can read through.
pub(crate) fn each_lock_file_or_denied(
    image_locks: &Path,
    mut f: impl FnMut(&std::fs::File) -> io::Result<()>,
    mut denied: impl FnMut(&Path) -> io::Result<()>,
) -> io::Result<()> {
    let entries = match std::fs::read_dir(image_locks) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for e in entries {
        let e = e?;
        if !e.file_name().to_str().is_some_and(|n| n.ends_with(".lock")) {
            continue;
        }
        let path = e.path();
        match open_lock_file(&path)? {
            Some(file) => f(&file)?,
            None if writable_by_others_only(&path) => denied(&path)?,
            None => {}
        }
    }
    Ok(())
}

/// Whether the regular file at `path` refuses this process an open for
/// writing for want of permission (EACCES: mode or owner), as opposed to
/// being no lock file at all or writable by nobody (immutable: EPERM; a
/// read-only filesystem: EROFS).
fn writable_by_others_only(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
        && std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(path)
            .is_err_and(|e| e.raw_os_error() == Some(libc::EACCES))
}

/// The record in the lock file at `path`, opened for reading only (one
/// this process may not write).
pub(crate) fn found_read_only(path: &Path) -> io::Result<Found> {
    found(&open_read_only(path)?)
}

/// Opens a lock file of the store for reading only (another user's, not
/// writable for us, too), never through a link in its place, and without
/// blocking on a FIFO planted there.
pub(crate) fn open_read_only(path: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
}

/// Opens an image lock file for its token: `None` if it is missing or is
/// no lock file a reader could take — a directory, a socket or FIFO, a
/// link, a file nobody may open for writing (immutable, read-only
/// filesystem): readers open lock files read-write, so nothing can be read
/// through it and it has nothing to mark. Other errors (EIO, ESTALE) are
/// errors: the caller cannot vouch for that file.
pub(crate) fn open_lock_file(path: &Path) -> io::Result<Option<std::fs::File>> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if no_lock_file_there(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok(file.metadata()?.is_file().then_some(file))
}

/// Whether an open of a would-be lock file for reading and writing failed
/// because there is no lock file a locker could use there (missing, a
/// link, a directory, a socket or FIFO, not writable) — not an error of
/// the filesystem (EIO, ESTALE), which the caller cannot vouch past.
pub(crate) fn no_lock_file_there(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound
        || matches!(
            e.raw_os_error(),
            Some(
                libc::ELOOP
                    | libc::EISDIR
                    | libc::ENXIO
                    | libc::EACCES
                    | libc::EPERM
                    | libc::EROFS
                    | libc::ETXTBSY
            )
        )
}

/// [`invalidate`] through the path of an image's lock file, for a caller
/// that excludes the fast path by holding the store-wide lock (so needs no
/// image lock). A missing file has nothing to invalidate; anything but a
/// regular file (never a lock file stowage made) is left alone.
pub fn invalidate_at(path: &Path) -> io::Result<()> {
    match open_lock_file(path)? {
        Some(file) => invalidate(&file),
        None => Ok(()),
    }
}

/// CRC-32 (IEEE 802.3, reflected), bitwise: records are a few hundred
/// bytes, read once per exec.
pub(crate) fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(images_dir: Option<&str>) -> Token {
        Token {
            state: State::Ready,
            image: "alpine:3.17".into(),
            images_dir: images_dir.map(PathBuf::from),
            db: DbId(0x5e1f_00d2),
            used: 1_764_543_600_000,
            size: None,
            fresh: false,
        }
    }

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn a_token_reads_back() {
        for t in [token(None), token(Some("/s/img"))] {
            assert_eq!(decode(&encode(&t).unwrap()), Some(t));
        }
    }

    #[test]
    fn anything_but_a_valid_token_is_none() {
        let good = encode(&token(Some("/s/img"))).unwrap();
        assert_eq!(decode(b""), None);
        // A torn write: any byte changed fails the CRC.
        for i in 0..good.len() - 1 {
            let mut bad = good.clone();
            bad[i] ^= 0x20;
            assert_eq!(decode(&bad), None, "byte {i} changed");
        }
        let newer = String::from_utf8(good.clone())
            .unwrap()
            .replace("stowage-image 4", "stowage-image 5");
        assert_eq!(decode(newer.as_bytes()), None);
        assert_eq!(encode(&token(Some("relative"))), None);
        assert_eq!(encode(&token(Some("/a\nb"))), None);
    }

    #[test]
    fn a_writers_record_reads_back_and_only_ready_counts_as_a_token() {
        for state in [State::Writing, State::Ready, State::Incomplete] {
            for (size, fresh) in [(Some(4096), false), (Some(4096), true), (None, true)] {
                let t = Token {
                    state,
                    size,
                    fresh,
                    ..token(None)
                };
                let bytes = encode(&t).unwrap();
                assert!(bytes.starts_with(FORMAT_ALONE.as_bytes()));
                assert_eq!(decode_any(&bytes), Some(t.clone()));
                assert_eq!(decode(&bytes).is_some(), state == State::Ready, "{state:?}");
            }
        }
        // The older format never says anything but ready, nor a size.
        let old = String::from_utf8(encode(&token(None)).unwrap())
            .unwrap()
            .replace("stowage-image 4", "stowage-image 2");
        let body = &old[..old.find("crc=").unwrap()];
        let resealed = format!("{body}crc={:08x}\n", crc32(body.as_bytes()));
        assert!(decode_any(resealed.as_bytes()).is_some());
        // A writers' record of a release before the records' database is
        // read too (checked against the header by a reader).
        let three = String::from_utf8(encode(&token(None)).unwrap())
            .unwrap()
            .replace("stowage-image 4", "stowage-image 3");
        let body = &three[..three.find("crc=").unwrap()];
        let three = format!("{body}crc={:08x}\n", crc32(body.as_bytes()));
        assert!(decode_any(three.as_bytes()).is_some());
        let writing = resealed.replace("state=ready", "state=writing");
        let body = &writing[..writing.find("crc=").unwrap()];
        let writing = format!("{body}crc={:08x}\n", crc32(body.as_bytes()));
        assert_eq!(decode_any(writing.as_bytes()), None);
    }

    #[test]
    fn bytes_after_the_token_are_ignored() {
        let t = token(None);
        let mut file = encode(&t).unwrap();
        file.resize(HINTS_AT, 0);
        file.extend_from_slice(b"11");
        assert_eq!(decode(&file[..MAX]), Some(t));
    }

    #[test]
    fn a_database_without_identity_vouches_for_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("stowage.db");
        assert_eq!(DbId::of(&db), None);
        let mut header = vec![0u8; 100];
        header[..16].copy_from_slice(b"SQLite format 3\0");
        std::fs::write(&db, &header).unwrap();
        assert_eq!(DbId::of(&db), None, "application_id 0");
        header[68..72].copy_from_slice(&0x0102_0304u32.to_be_bytes());
        std::fs::write(&db, &header).unwrap();
        assert_eq!(DbId::of(&db), Some(DbId(0x0102_0304)));
        std::fs::write(&db, b"not a database").unwrap();
        assert_eq!(DbId::of(&db), None);
    }
}
