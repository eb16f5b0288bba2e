//! Slot records: what a slot file says about its class, so that taking a
//! slot needs neither the global lock nor the database.
//!
//! The database stays the single source of truth for every slot class
//! (`slots set` / `slots rm` change it in a transaction). A record is a
//! copy of the class's configuration derived from it, kept in the first
//! bytes of **every** slot file of the class (`locks/slots/ENC/N.lock`,
//! `high-N.lock`; each stays an ordinary lock file):
//!
//! ```text
//! stowage-slot 1
//! class=pull
//! limit=4
//! reserve=1
//! settled=1        (no slot file beyond the limits is held)
//! db=5e1f00d2      (the database's identity, as in an image's record)
//! crc=1a2b3c4d
//! ```
//!
//! Invariants:
//! - **A valid record says what the database says, or what it said a
//!   moment ago.** Records are written (or taken away) only under the
//!   global lock, inside a transaction that read the class: by `slots set`
//!   after its change committed, and by an acquirer that found a record
//!   wanting. Both `slots set` and `slots rm` take them away inside the
//!   changing transaction, before it commits, or fail: a change that
//!   dies or fails before its new records are written leaves none, never
//!   the old configuration valid beside the new one. They go to
//!   every slot file of the class present then (and to every file the
//!   configuration names, which they create), so a file beyond a lowered
//!   limit never keeps the higher one. An acquirer that read the record
//!   just before a change works under the configuration of a moment ago —
//!   as one that took its slot a moment earlier would.
//! - **A slot is taken on a record only from the file it holds:** the
//!   acquirer reads the record of the file it has locked (on NFS the lock
//!   makes the client read it anew), and keeps the slot only if that record
//!   is valid (format, CRC, its class, this database's identity) and
//!   *settled*, and the file is within the limits it states (`N.lock` for
//!   N < limit; `high-N.lock` for N < reserve, only for high priority).
//!   Anything else — an empty file, another layout, an unsettled class —
//!   sends it to the database, which is never wrong; a mistake can only
//!   cost a transaction.
//! - **Settled:** when a limit is lowered, slots beyond it may still be
//!   held, and count against it until they end (slots.rs). A record is
//!   written settled only when no file beyond the limits is held at that
//!   moment (tried under the global lock); an unsettled one sends every
//!   acquirer to the database, whose way counts such holders, and the
//!   first acquirer to find them all gone writes the records settled.
//!   Nobody takes a file beyond the limits for a command: one taken on a
//!   stale read is let go once its own record is read. The records are
//!   written unsettled everywhere *before* that question is asked, and
//!   settled after: a file taken after the question carries the new
//!   limits, and an acquirer that read the class from the database before
//!   the change (and so took a file the change put beyond its limits)
//!   finds them there, lets the file go and reads the class again (a
//!   record settled or not, of this database, that states other limits
//!   than the ones it went by); one that took it before the question is
//!   what the question finds.
//! - Records carry no hint and no durability: a record lost in a crash or
//!   torn by a power loss only sends the next acquirer to the database.

use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::dir::Dir;
use crate::meta::SlotClass;
use crate::record::{DbId, crc32};

/// The first line; another version sends the acquirer to the database.
const FORMAT: &str = "stowage-slot 1\n";

/// The first line of records written on a store whose binaries all keep
/// the records' database (`record::ALONE_SINCE_SCHEMA`): an acquirer
/// trusts such a record without reading the database's header.
const FORMAT_ALONE: &str = "stowage-slot 2\n";

/// The format this binary writes records in.
fn format() -> &'static str {
    if crate::meta::schema_version() >= crate::record::ALONE_SINCE_SCHEMA {
        FORMAT_ALONE
    } else {
        FORMAT
    }
}

/// Records end before this offset (the same area an image's record uses).
const MAX: usize = crate::record::HINTS_AT;

/// The schema version from which binaries keep slot records: a store
/// migrated to it has locked out every binary that would change a class
/// without them.
const SINCE_SCHEMA: i64 = 6;

fn enabled() -> bool {
    crate::meta::schema_version() >= SINCE_SCHEMA
}

/// What a valid, settled record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub limit: u32,
    pub reserve: u32,
}

/// Which slot a file is, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Normal(u32),
    High(u32),
}

impl Kind {
    pub fn of(file_name: &str) -> Option<Kind> {
        let stem = file_name.strip_suffix(".lock")?;
        match stem.strip_prefix("high-") {
            Some(n) => n.parse().ok().map(Kind::High),
            None => stem.parse().ok().map(Kind::Normal),
        }
    }

    pub fn file_name(self) -> String {
        match self {
            Kind::Normal(n) => format!("{n}.lock"),
            Kind::High(n) => format!("high-{n}.lock"),
        }
    }

    /// Whether the file is one of the class's slots under `limits`.
    pub fn within(self, limits: Limits) -> bool {
        match self {
            Kind::Normal(n) => n < limits.limit,
            Kind::High(n) => n < limits.reserve,
        }
    }
}

fn encode(class: &SlotClass, settled: bool, db: DbId) -> Vec<u8> {
    let mut body = format!(
        "{}class={}\nlimit={}\nreserve={}\nsettled={}\ndb={:08x}\n",
        format(),
        class.name,
        class.limit,
        class.reserve_high,
        u8::from(settled),
        db.0
    );
    body.push_str(&format!("crc={:08x}\n", crc32(body.as_bytes())));
    body.into_bytes()
}

/// Parses a record of `class`: `Some` only for a valid, settled one.
#[cfg(test)]
fn decode(bytes: &[u8], class: &str) -> Option<(Limits, DbId)> {
    match decode_any(bytes, class)? {
        (limits, true, db) => Some((limits, db)),
        _ => None,
    }
}

/// Parses a valid record of `class`, settled or not.
fn decode_any(bytes: &[u8], class: &str) -> Option<(Limits, bool, DbId)> {
    let body = crate::record::checked_body(bytes, FORMAT_ALONE)
        .or_else(|| crate::record::checked_body(bytes, FORMAT))?;
    let mut lines = body.lines();
    let mut field = |key: &str| lines.next()?.strip_prefix(key)?.strip_prefix('=');
    if field("class")? != class {
        return None;
    }
    let limit = field("limit")?.parse().ok()?;
    let reserve = field("reserve")?.parse().ok()?;
    let settled = match field("settled")? {
        "1" => true,
        "0" => false,
        _ => return None,
    };
    let db = DbId(u32::from_str_radix(field("db")?, 16).ok()?);
    if lines.next().is_some() {
        return None;
    }
    Some((Limits { limit, reserve }, settled, db))
}

/// Reads the record of a slot file of `class` (one `pread`): the limits
/// if it is valid, settled, and derived from the database now at `db_path`
/// (its identity looked up once per process through `db`).
pub fn read(
    file: &std::fs::File,
    class: &str,
    db_path: &Path,
    db: &std::cell::OnceCell<Option<DbId>>,
) -> Option<Limits> {
    read_settled(file, class, db_path, db).and_then(|(limits, settled)| settled.then_some(limits))
}

/// The limits a slot file's record states, settled or not, if it is a
/// valid record of `class` derived from the database now at `db_path`:
/// what an acquirer that read the class from the database checks the file
/// it took against (a change may have come between its read and its take).
pub fn read_any(
    file: &std::fs::File,
    class: &str,
    db_path: &Path,
    db: &std::cell::OnceCell<Option<DbId>>,
) -> Option<Limits> {
    read_settled(file, class, db_path, db).map(|(limits, _)| limits)
}

/// One `pread` of a slot file's record: its limits and whether they are
/// settled, if it is a valid record of `class` derived from the database
/// now at `db_path`.
fn read_settled(
    file: &std::fs::File,
    class: &str,
    db_path: &Path,
    db: &std::cell::OnceCell<Option<DbId>>,
) -> Option<(Limits, bool)> {
    if !enabled() {
        return None;
    }
    let mut buf = vec![0u8; MAX];
    let n = file.read_at(&mut buf, 0).ok()?;
    let (limits, settled, id) = decode_any(&buf[..n], class)?;
    // A record of a store that keeps the records' database speaks for the
    // database there (record.rs, `for_this_database`); an older one is
    // checked against the header (open, read, close).
    (buf.starts_with(FORMAT_ALONE.as_bytes())
        || db
            .get_or_init(|| DbId::of(db_path))
            .is_some_and(|now| now == id))
    .then_some((limits, settled))
}

/// One `pread` of a slot file's record, for a look that checks the
/// database's identity itself (`idle.rs`): its limits, whether they are
/// settled, and the identity of the database they were derived from, if it
/// is a valid record of `class`.
pub fn read_unchecked(file: &std::fs::File, class: &str) -> Option<(Limits, bool, DbId)> {
    if !enabled() {
        return None;
    }
    let mut buf = vec![0u8; MAX];
    let n = file.read_at(&mut buf, 0).ok()?;
    decode_any(&buf[..n], class)
}

/// Writes the record of `class` into every slot file of its directory and
/// into every file its configuration names (made if missing), or — `None`,
/// or a database without identity — takes every record away. The caller
/// holds the global lock, inside a transaction that read the class (see
/// the module doc), and opened the class directory from the root without
/// following a link at any step: everything here is done relative to that
/// descriptor, so a symlink planted for the directory (or a file) never
/// makes stowage write outside the root. Records are written over the
/// whole area (never a longer one's tail left), not synced: see the module
/// doc.
pub fn write_all(dir: &Dir, class: Option<&SlotClass>, db: Option<DbId>) -> io::Result<()> {
    if !enabled() {
        return Ok(());
    }
    if let (Some(c), Some(db)) = (class, db) {
        // An unlimited class gets one file, `0.lock`, beyond its limit
        // (nobody runs a command on it): it carries the record that tells
        // its acquirers no slot is needed, and lock-status its limit.
        for kind in (0..c.limit.max(1))
            .map(Kind::Normal)
            .chain((0..c.reserve_high).map(Kind::High))
        {
            // Made like any slot file an acquirer makes.
            drop(dir.open_rw(kind.file_name(), true)?);
        }
        // Unsettled first, everywhere; only then is "no file beyond the
        // limits held" asked, and the records settled if so. Whoever
        // takes a file beyond the limits after that question reads
        // this configuration in it and lets the file go (slot.rs); one
        // who took it before is what the question finds.
        write_each(dir, Some(&encode(c, false, db)))?;
        // Unlimited: nobody is counted, so nothing is left to settle.
        if c.limit == 0 || !beyond_held(dir, c)? {
            write_each(dir, Some(&encode(c, true, db)))?;
        }
        return Ok(());
    }
    write_each(dir, None)
}

/// Takes away the records of every slot file of `dir` (the directory of
/// `class`) if any of them names another database than `db`, durably: the
/// records' database is about to be recorded as `db` (record.rs,
/// `for_this_database`), after which an acquirer trusts a record without
/// the header. Under the global lock, as every change of records.
pub fn take_away_other(dir: &Dir, class: &str, db: Option<DbId>) -> io::Result<()> {
    let mut other = false;
    each_slot_file(dir, |_, file| {
        let mut buf = vec![0u8; MAX];
        let n = file.read_at(&mut buf, 0)?;
        if decode_any(&buf[..n], class).is_some_and(|(_, _, id)| Some(id) != db) {
            other = true;
        }
        Ok(())
    })?;
    if other {
        each_slot_file(dir, |_, file| {
            file.set_len(0)?;
            file.sync_data()
        })?;
    }
    Ok(())
}

/// The slot files of `dir`: its regular files named `*.lock`, opened
/// through its descriptor without following links; anything else planted
/// under such a name (a link, a directory, a FIFO) is nobody's slot file.
fn each_slot_file(
    dir: &Dir,
    mut f: impl FnMut(&str, &std::fs::File) -> io::Result<()>,
) -> io::Result<()> {
    for name in dir.names()? {
        let Some(name) = name.to_str().filter(|n| n.ends_with(".lock")) else {
            continue;
        };
        let file = match dir.open_rw(name, false) {
            Ok(file) => file,
            Err(e) if crate::record::no_lock_file_there(&e) => continue,
            Err(e) => return Err(e),
        };
        if file.metadata()?.is_file() {
            f(name, &file)?;
        }
    }
    Ok(())
}

/// Writes `record` over the record area of every slot file of `dir`, or
/// (`None`) empties them.
fn write_each(dir: &Dir, record: Option<&[u8]>) -> io::Result<()> {
    each_slot_file(dir, |_, file| match record {
        Some(bytes) => {
            let mut area = vec![0u8; MAX];
            area[..bytes.len()].copy_from_slice(bytes);
            file.write_all_at(&area, 0)
        }
        None => file.set_len(0),
    })
}

/// Whether some slot file of `dir` beyond the limits of `class` is held
/// right now (tried without waiting, as anything under the global lock).
/// Only regular files can be held slots (acquirers open slot files
/// without following links).
fn beyond_held(dir: &Dir, class: &SlotClass) -> io::Result<bool> {
    let limits = Limits {
        limit: class.limit,
        reserve: class.reserve_high,
    };
    let mut held = false;
    each_slot_file(dir, |name, file| {
        if !held
            && Kind::of(name).is_some_and(|k| !k.within(limits))
            && matches!(
                crate::lock::probe_open(file)?,
                crate::lock::Probe::Shared | crate::lock::Probe::Exclusive
            )
        {
            held = true;
        }
        Ok(())
    })?;
    Ok(held)
}

/// The schema version from which every configured class has its directory
/// `locks/slots/ENC` (made before the class is committed, and by the
/// migration to it for the classes already there): what lets `lock-status`
/// list the classes without the database (idle.rs).
pub const CLASS_DIRS_SCHEMA: i64 = 7;

/// Gives every configured class its directory, and its records (an
/// unlimited class's `0.lock` with them): what the migration to
/// [`CLASS_DIRS_SCHEMA`] needs. Inside the transaction that commits the
/// schema, under the global lock: a directory that cannot be made fails
/// it; the records are best effort (a record missing only sends acquirers,
/// and lock-status, to the database).
pub fn make_class_dirs(tx: &crate::meta::Tx, root: &crate::root::Root) -> anyhow::Result<()> {
    let db = tx.identity().ok().and_then(DbId::from_id);
    for c in tx.slot_classes()? {
        let dir = make_class_dir(root, &c.name)?;
        let _ = write_all(&dir, Some(&c), db);
    }
    Ok(())
}

/// Makes (if missing) and opens the class's directory, every step from the
/// root's descriptor without following a link: a link planted for
/// `locks/slots` or the class directory is an error, never a directory
/// made or a file created elsewhere.
pub fn make_class_dir(root: &crate::root::Root, class: &str) -> anyhow::Result<Dir> {
    let locks = root.open_or_make_sub("locks")?;
    let rel = crate::root::Root::slot_class_rel(class);
    let mut d = locks;
    let mut at = root.locks();
    for part in rel.split('/').skip(1) {
        at.push(part);
        match d.sub(part) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match d.mkdir(part, 0o777) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(anyhow::Error::new(e)
                        .context(format!("cannot create directory {}", at.display())));
                }
            },
            Err(e) => return Err(refused(&at, e)),
            Ok(_) => {}
        }
        d = d.sub(part).map_err(|e| refused(&at, e))?;
    }
    Ok(d)
}

/// The error for a directory on the way to a class's slot files that
/// cannot be opened without following a link.
fn refused(at: &Path, e: std::io::Error) -> anyhow::Error {
    if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) {
        anyhow::anyhow!(
            "{} is a symlink or not a directory; refusing to use it",
            at.display()
        )
    } else {
        anyhow::Error::new(e).context(format!("cannot open {}", at.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(limit: u32, reserve_high: u32) -> SlotClass {
        SlotClass {
            name: "load/podman".into(),
            limit,
            reserve_high,
        }
    }

    #[test]
    fn a_record_says_its_class_and_nothing_else_passes() {
        let db = DbId(0x5e1f_00d2);
        let bytes = encode(&class(4, 1), true, db);
        assert_eq!(
            decode(&bytes, "load/podman"),
            Some((
                Limits {
                    limit: 4,
                    reserve: 1
                },
                db
            ))
        );
        // Another class's name, an unsettled one, one flipped bit: no.
        assert_eq!(decode(&bytes, "pull"), None);
        assert_eq!(
            decode(&encode(&class(4, 1), false, db), "load/podman"),
            None
        );
        // An unsettled one still states its limits, for the database's way.
        assert_eq!(
            decode_any(&encode(&class(4, 1), false, db), "load/podman"),
            Some((
                Limits {
                    limit: 4,
                    reserve: 1
                },
                false,
                db
            ))
        );
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x04;
            assert_eq!(decode(&b, "load/podman"), None, "byte {i}");
        }
        // Zeros after it (the rest of the area) are ignored.
        let mut area = bytes.clone();
        area.resize(MAX, 0);
        assert!(decode(&area, "load/podman").is_some());
        assert_eq!(decode(b"", "load/podman"), None);
    }

    #[test]
    fn file_names_and_limits() {
        let l = Limits {
            limit: 2,
            reserve: 1,
        };
        assert_eq!(Kind::of("0.lock"), Some(Kind::Normal(0)));
        assert_eq!(Kind::of("high-0.lock"), Some(Kind::High(0)));
        assert_eq!(Kind::of("changed"), None);
        assert_eq!(Kind::of("x.lock"), None);
        assert!(Kind::Normal(1).within(l));
        assert!(!Kind::Normal(2).within(l));
        assert!(Kind::High(0).within(l));
        assert!(!Kind::High(1).within(l));
        assert_eq!(Kind::High(3).file_name(), "high-3.lock");
    }
}
