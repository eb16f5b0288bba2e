//! An image's record: the one authority for its state, kept in its lock file (format and rules:
//! docs/design.md, "The record").
//!
//! - Only a holder of the exclusive lock writes it, synced before release; nothing but a record
//!   that says `ready` makes an image readable.
//! - Two slots (A at 0, B at 4096), each with a sequence number and a CRC: the valid one with the
//!   higher number is the record, so a write cut short leaves the state before it.
//! - `writing`/`creating` under a lock nobody holds exclusively is incomplete: its writer died.
//! - An empty file is no image; bytes without a valid slot are a damaged record, kept and reported
//!   (state unknown).
//! - Hints (bytes 8192..8256: `W`, `S`, last use) are not the record: any process with the file
//!   open writes them; each is only a reason to ask the authority. Last use is refreshed at most
//!   every [`last_use_resolution`], when a read begins and when a long one ends.
//! - Unlinking empties and marks first (`lock::mark_gone`): read under a lock, a valid record proves
//!   the file is the one at its path; so does a file without the mark where none is unlinked.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::clock::Millis;

const FORMAT: &str = "stowage-record 1\n";
/// A lock file's first bytes from a release before records (`stowage-image N`): migrate its store.
pub const LEGACY_PREFIX: &[u8] = b"stowage-image ";

/// Size of one record slot; a record never exceeds it.
pub const SLOT: usize = 4096;
pub const HINTS_AT: usize = 2 * SLOT;
const HINTS_LEN: usize = 64;
/// Everything a reader reads, in one `pread`.
pub const AREA: usize = HINTS_AT + HINTS_LEN;

const WRITER_WAITS_AT: u64 = HINTS_AT as u64;
const STORE_WIDE_AT: u64 = HINTS_AT as u64 + 1;
/// `F` and the fingerprint of the record in flight it names, 16 hex digits.
const FOREIGN_WRITE_AT: u64 = HINTS_AT as u64 + 24;
const FOREIGN_WRITE_LEN: usize = 17;
const LAST_USE_AT: u64 = HINTS_AT as u64 + 8;
const LAST_USE_LEN: usize = 16;

/// A reader refreshes an image's last use only once the recorded one is older than this, so most
/// reads write nothing; `gc --unused-for D` counts unused only past D plus this.
pub fn last_use_resolution() -> Duration {
    crate::env::debug_ms(crate::env::DEBUG_USE_RESOLUTION_MS, 300_000)
}

/// Outcome of a tree adopted without a record: unknown readiness proves no failure; gc keeps it.
pub const ADOPTED: &str = "adopted (readiness unknown)";

/// Outcome for an unreadable record: kept and reported like an adopted tree.
pub const UNKNOWN: &str = "record damaged (readiness unknown)";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    Creating,
    Writing,
    Ready,
    Incomplete,
    Deleting,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Creating => "creating",
            State::Writing => "writing",
            State::Ready => "ready",
            State::Incomplete => "incomplete",
            State::Deleting => "deleting",
        }
    }

    pub fn parse(s: &str) -> Option<State> {
        use State::*;
        [Creating, Writing, Ready, Incomplete, Deleting]
            .into_iter()
            .find(|state| state.as_str() == s)
    }

    /// A write is under way (or its writer died: see [`Record::state_seen`]).
    pub fn in_flight(self) -> bool {
        matches!(self, State::Creating | State::Writing)
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where an image's tree lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImagesDir {
    /// `ROOT/img`, as this process names the root.
    Default,
    /// A directory given to `init --images-dir`, absolute.
    External(PathBuf),
}

impl ImagesDir {
    /// The directory as this process reaches it, for the root at `root_dir` (as it names the root).
    pub fn path_in(&self, root_dir: &Path) -> PathBuf {
        match self {
            ImagesDir::Default => root_dir.join("img"),
            ImagesDir::External(p) => p.clone(),
        }
    }

    fn encode(&self) -> Option<String> {
        match self {
            ImagesDir::Default => Some("default".into()),
            ImagesDir::External(p) => {
                let s = p.to_str()?;
                (s.starts_with('/') && !s.contains('\n')).then(|| s.to_owned())
            }
        }
    }

    pub(crate) fn decode(s: &str) -> Option<ImagesDir> {
        match s {
            "default" => Some(ImagesDir::Default),
            // As named, without a trailing `/` (`root::as_named`): opened without following a
            // link, it is then checked itself.
            _ if s.starts_with('/') => {
                Some(ImagesDir::External(Path::new(s).components().collect()))
            }
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Increases with every write.
    pub seq: u64,
    pub name: String,
    pub state: State,
    /// Lineage: the image this one was built from, when known.
    pub base: Option<String>,
    pub created: Millis,
    /// When the state last changed.
    pub changed: Millis,
    /// The lease of the write in flight, or of the last write.
    pub writer: Option<String>,
    /// How the last write ended (`exit 0`, `exit 2`, `signal 9`, …).
    pub outcome: Option<String>,
    pub images: ImagesDir,
}

impl Record {
    /// A record for a new image, about to be created.
    pub fn new(name: &str, images: ImagesDir, now: Millis) -> Record {
        Record {
            seq: 0,
            name: name.to_owned(),
            state: State::Creating,
            base: None,
            created: now,
            changed: now,
            writer: None,
            outcome: None,
            images,
        }
    }

    /// What stands for a record that cannot be read: incomplete, readiness unknown (never collected).
    pub fn unknown(name: &str, images: ImagesDir, now: Millis) -> Record {
        Record {
            state: State::Incomplete,
            outcome: Some(UNKNOWN.to_owned()),
            ..Record::new(name, images, now)
        }
    }

    /// Whether the image's readiness is unknown (adopted, or record damaged): no evidence for gc.
    pub fn readiness_unknown(&self) -> bool {
        matches!(self.outcome.as_deref(), Some(ADOPTED | UNKNOWN))
    }

    /// The state as a reader takes it: a write in flight under no exclusive lock is incomplete.
    pub fn state_seen(&self, exclusively_held: bool) -> State {
        if self.state.in_flight() && !exclusively_held {
            State::Incomplete
        } else {
            self.state
        }
    }

    /// Which write of which image this record is, across stores: its sequence number and a checksum
    /// of all it says. The catalog's sizes are kept for it.
    pub fn fingerprint(&self) -> u64 {
        let said = self
            .encode()
            .unwrap_or_else(|| format!("{self:?}").into_bytes());
        (u64::from(crc32(&said)) << 32) | (self.seq & 0xffff_ffff)
    }

    fn encode(&self) -> Option<Vec<u8>> {
        let clean = |s: &str| !s.contains('\n') && !s.contains('\0');
        let mut body = format!(
            "{FORMAT}seq={}\nname={}\nstate={}\ncreated={}\nchanged={}\nimages={}\n",
            self.seq,
            self.name,
            self.state.as_str(),
            self.created,
            self.changed,
            self.images.encode()?
        );
        for (key, value) in [
            ("base", &self.base),
            ("writer", &self.writer),
            ("outcome", &self.outcome),
        ] {
            if let Some(v) = value {
                if !clean(v) {
                    return None;
                }
                body.push_str(&format!("{key}={v}\n"));
            }
        }
        let body = sealed(body);
        (clean(&self.name) && body.len() <= SLOT).then(|| body.into_bytes())
    }

    fn decode(slot: &[u8]) -> Option<Record> {
        let body = checked_body(slot)?;
        let mut r = Record::new("", ImagesDir::Default, 0);
        let mut have = (false, false, false);
        // At '\n' only: `lines()` would drop a path's trailing '\r'.
        for line in body.strip_prefix(FORMAT)?.split_terminator('\n') {
            let (k, v) = line.split_once('=')?;
            match k {
                "seq" => r.seq = v.parse().ok()?,
                "name" => (r.name, have.0) = (v.to_owned(), true),
                "state" => (r.state, have.1) = (State::parse(v)?, true),
                "created" => r.created = v.parse().ok()?,
                "changed" => r.changed = v.parse().ok()?,
                "images" => (r.images, have.2) = (ImagesDir::decode(v)?, true),
                "base" => r.base = Some(v.to_owned()),
                "writer" => r.writer = Some(v.to_owned()),
                "outcome" => r.outcome = Some(v.to_owned()),
                // A later version may add fields; what this one knows holds.
                _ => {}
            }
        }
        (have == (true, true, true)).then_some(r)
    }
}

/// What a lock file says, read in one `pread`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    /// The record: the valid slot with the higher sequence number.
    pub record: Option<Record>,
    /// Bytes in the record area but no valid slot: state unknown (unless `legacy`, to migrate).
    pub damaged: bool,
    /// Written by a release before records: migrate the store, if one to migrate (else damaged).
    pub legacy: bool,
    pub writer_waits: bool,
    pub store_wide: bool,
    /// `F`: a writer that lost its lock wrote into the tree during the write of this fingerprint.
    pub foreign_write: Option<u64>,
    pub last_use: Option<Millis>,
    /// Marked gone by an unlinker (`lock::mark_gone`): no image, no proof the file is at its path.
    pub gone: bool,
    /// The format of a later release's record in a slot (`stowage-record N`, N above ours): that
    /// release's image, refused whole, never rewritten in this release's format.
    pub newer: Option<u64>,
    /// The image a record set aside by [`Seen::of`] names: another image's.
    pub foreign: Option<String>,
    /// The highest sequence number of any slot that decodes, ours or not, torn beside or not: the
    /// next record is numbered above it, so a stale slot never reads as a later one.
    pub top_seq: u64,
}

impl Seen {
    /// The record only if it is the image's that `is_ours` accepts: a record copied from another
    /// image's lock file says nothing of this one, whose state is then not known (damaged).
    pub fn of(mut self, is_ours: impl FnOnce(&str) -> bool) -> Seen {
        if let Some(r) = self.record.take_if(|r| !is_ours(&r.name)) {
            (self.foreign, self.damaged) = (Some(r.name), true);
        }
        self
    }

    /// Whether this, read under a lock just taken from `path`, proves the file still at its path: a
    /// record (only holders write one), or a file never marked gone where lock files are not
    /// unlinked. A file to be written, or without a record, proves nothing with another name.
    pub fn proves_linked(&self, file: &File, path: &Path, writes: bool) -> bool {
        let one_name = || {
            crate::planted::type_and_links(file, false)
                .is_ok_and(|(mode, links, _)| mode & libc::S_IFMT == libc::S_IFREG && links == 1)
        };
        if self.record.is_some() {
            return !writes || one_name();
        }
        !(self.damaged || self.legacy || self.gone || crate::lock::unlinks_allowed(path))
            && one_name()
    }

    /// No record there, not even one that cannot be read.
    pub fn unrecorded(&self) -> bool {
        self.record.is_none() && !self.damaged && !self.legacy
    }

    /// Nothing at all: no record, hint or last use.
    pub fn names_nothing(&self) -> bool {
        Seen {
            gone: false,
            ..self.clone()
        } == Seen::default()
    }

    /// What `bytes` (the file's first [`AREA`] bytes, or fewer) say.
    pub fn parse(bytes: &[u8]) -> Seen {
        if bytes.starts_with(crate::lock::GONE) {
            return Seen {
                gone: true,
                ..Seen::default()
            };
        }
        let decoded = |i| slot(bytes, i).and_then(Record::decode);
        let (a, b) = (decoded(0), decoded(1));
        // Only a slot whose CRC holds: a format line damaged into a higher number is damage, its
        // image's state unknown here, not a later release's image.
        let newer =
            |i| crate::error::newer_format(checked_body(slot(bytes, i)?)?, "stowage-record ", 1);
        let noise =
            |i, valid: bool| !valid && slot(bytes, i).is_some_and(|s| s.iter().any(|&b| b != 0));
        let torn = noise(0, a.is_some()) || noise(1, b.is_some());
        let top_seq = a.iter().chain(&b).map(|r| r.seq).max().unwrap_or(0);
        let record = match (a, b) {
            (Some(a), Some(b)) => Some(if b.seq > a.seq { b } else { a }),
            (a, b) => a.or(b),
        };
        // A write in flight beside a torn slot (maybe its `ready` cut short): state unknown.
        let record = record.filter(|r| !(torn && r.state.in_flight()));
        let area = &bytes[..bytes.len().min(HINTS_AT)];
        // Anything but unset asks the authority: a torn byte costs a look, never a missed hold.
        let hint = |at: u64| !matches!(bytes.get(at as usize), None | Some(0 | b'-'));
        Seen {
            damaged: record.is_none() && area.iter().any(|&b| b != 0),
            legacy: bytes.starts_with(LEGACY_PREFIX),
            record,
            writer_waits: hint(WRITER_WAITS_AT),
            store_wide: hint(STORE_WIDE_AT),
            foreign_write: foreign_write_in(bytes),
            last_use: bytes
                .get(LAST_USE_AT as usize..LAST_USE_AT as usize + LAST_USE_LEN)
                .and_then(|b| std::str::from_utf8(b).ok())
                .and_then(|s| Millis::from_str_radix(s, 16).ok())
                .filter(|&ms| ms > 0),
            top_seq,
            newer: newer(0).max(newer(1)),
            ..Seen::default()
        }
    }
}

/// [`write()`], using the space kept in `reserve` (`space.rs`) when the filesystem is full (on a
/// copy-on-write filesystem even an overwrite needs new blocks).
pub fn write_reserved(
    file: &File,
    seen: &mut Seen,
    record: &Record,
    reserve: &Path,
) -> io::Result<()> {
    match write(file, seen, record) {
        Err(e) if crate::space::is_full_io(&e) && crate::space::release(reserve) => {
            let out = write(file, seen, record);
            crate::space::refill(reserve);
            out
        }
        other => other,
    }
}

/// Reads what the lock file of the image `name` says (see [`Seen::of`]).
pub fn read_of(file: &File, name: &str) -> io::Result<Seen> {
    Ok(read(file)?.of(|n| n == name))
}

/// [`read_of`] under an exclusive lock just taken, and [`Seen::proves_linked`].
pub fn read_proving(file: &File, path: &Path, name: &str) -> (Seen, bool) {
    read_of(file, name).map_or((Seen::default(), false), |seen| {
        let proven = seen.proves_linked(file, path, true);
        (seen, proven)
    })
}

pub fn read(file: &File) -> io::Result<Seen> {
    Ok(Seen::parse(&read_area(file)?))
}

/// What slot A holds besides a record of this release: which release wrote the file last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotA {
    /// Zeros, a record or part of one: this release's.
    Ours,
    /// The older release's token, which it still takes: its store is one to migrate.
    Token,
    /// That token disabled by a migration once the record beside it was durable.
    Disabled,
    /// Nothing but the older release's store-wide hint (byte 3073), which a migration sets on every
    /// lock file before it writes a record: a record beside it is the migration's.
    Hint,
}

/// [`read`], and what its slot A holds (one `pread`): a record a migration wrote beside the older
/// release's bytes is no evidence of a store of this release.
pub fn read_with_slot_a(file: &File) -> io::Result<(Seen, SlotA)> {
    const OLDER_HINT_AT: usize = 3073;
    let bytes = read_area(file)?;
    let slot_a = &bytes[..bytes.len().min(SLOT)];
    let disabled = slot_a.first() == Some(&b'-') && slot_a[1..].starts_with(&LEGACY_PREFIX[1..]);
    let hint_only = slot_a.get(OLDER_HINT_AT).is_some_and(|&b| b != 0)
        && slot_a
            .iter()
            .enumerate()
            .all(|(i, &b)| i == OLDER_HINT_AT || b == 0);
    let a = match () {
        _ if slot_a.starts_with(LEGACY_PREFIX) => SlotA::Token,
        _ if disabled => SlotA::Disabled,
        _ if hint_only => SlotA::Hint,
        _ => SlotA::Ours,
    };
    Ok((Seen::parse(&bytes), a))
}

/// Whether `file` holds the record `seen` has still, and nothing later (one read); for a writer
/// (`in_flight`), also no `F` hint naming it. Slot by slot: noise in the other slot is no change.
pub fn holds_latest(file: &File, seen: &Seen, in_flight: bool) -> io::Result<bool> {
    let (bytes, ours) = (read_area(file)?, seen.record.as_ref());
    let named = |r: &Record| foreign_write_in(&bytes) == Some(r.fingerprint());
    if in_flight && ours.is_some_and(named) {
        return Ok(false);
    }
    let slot = |i| slot(&bytes, i).and_then(Record::decode);
    Ok(match ours {
        None => slot(0).is_none() && slot(1).is_none(),
        Some(r) => {
            let at = (r.seq % 2) as usize;
            slot(at).as_ref() == Some(r) && slot(1 - at).is_none_or(|o| o.seq < r.seq)
        }
    })
}

/// Record slot `i` of `bytes` (a lock file's first bytes), or what there is of it.
fn slot(bytes: &[u8], i: usize) -> Option<&[u8]> {
    bytes.get(i * SLOT..((i + 1) * SLOT).min(bytes.len()))
}

/// The file's first [`AREA`] bytes, or all it has: a huge file or a device costs one buffer.
pub fn read_area(file: &File) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; AREA];
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(got);
    Ok(buf)
}

/// Writes `record` (`seq` from `seen`, updated) and syncs it, holding the exclusive lock.
pub fn write(file: &File, seen: &mut Seen, record: &Record) -> io::Result<()> {
    let mut record = record.clone();
    record.seq = seen.record.as_ref().map_or(0, |r| r.seq).max(seen.top_seq) + 1;
    let mut area = record.encode().ok_or_else(|| {
        let name = &record.name;
        let why = format!("the record of image '{name}' does not fit its lock file");
        io::Error::new(io::ErrorKind::InvalidInput, why)
    })?;
    let mut at = (record.seq % 2) as usize * SLOT;
    // The slot ends at its first zero byte. A file without a record gets the area from its slot
    // on, so its blocks exist for every later write (a build may fill the filesystem first); from
    // 0 only if empty: bytes in slot A (an older release's token) stay until this record is
    // durable, whatever cuts the write short (a full filesystem, a crash).
    area.resize(SLOT, 0);
    if seen.record.is_none() && seen.last_use.is_none() {
        let from = if seen.unrecorded() { 0 } else { at };
        let mut whole = vec![0u8; AREA - from];
        whole[at - from..at - from + SLOT].copy_from_slice(&area);
        // The hints it carries stay.
        whole[WRITER_WAITS_AT as usize - from] = if seen.writer_waits { b'W' } else { 0 };
        whole[STORE_WIDE_AT as usize - from] = if seen.store_wide { b'S' } else { 0 };
        (area, at) = (whole, from);
    }
    file.write_all_at(&area, at as u64)?;
    crate::lock::sync_written(file)?;
    seen.top_seq = record.seq;
    (seen.record, seen.damaged, seen.legacy) = (Some(record), false, false);
    Ok(())
}

/// Empties the file (slots and hints): no record. Call only holding the exclusive lock.
pub fn clear(file: &File) -> io::Result<()> {
    file.set_len(0)?;
    file.sync_data()
}

/// Sets or clears the writer-waits hint (no lock needed: it is a hint).
pub fn set_writer_waits(file: &File, on: bool) -> io::Result<()> {
    file.write_all_at(&[if on { b'W' } else { b'-' }], WRITER_WAITS_AT)
}

pub fn set_store_wide(file: &File, on: bool) -> io::Result<()> {
    file.write_all_at(&[if on { b'S' } else { b'-' }], STORE_WIDE_AT)?;
    // A holder excludes image users through it: synced, so caching clients on other hosts see it.
    if on {
        crate::lock::sync_written(file)?;
    }
    Ok(())
}

/// The fingerprint the foreign-write hint in `bytes` (a lock file's first bytes) names, if set.
fn foreign_write_in(bytes: &[u8]) -> Option<u64> {
    let at = FOREIGN_WRITE_AT as usize;
    let hint = bytes.get(at..at + FOREIGN_WRITE_LEN)?.strip_prefix(b"F")?;
    u64::from_str_radix(std::str::from_utf8(hint).ok()?, 16).ok()
}

/// Sets the foreign-write hint for the record in flight of fingerprint `named` (synced: its writer
/// may be on another host), or clears it.
pub fn set_foreign_write(file: &File, named: Option<u64>) -> io::Result<()> {
    let Some(fp) = named else {
        return file.write_all_at(b"-", FOREIGN_WRITE_AT);
    };
    file.write_all_at(format!("F{fp:016x}").as_bytes(), FOREIGN_WRITE_AT)?;
    crate::lock::sync_written(file)
}

pub fn set_last_use(file: &File, now: Millis) -> io::Result<()> {
    file.write_all_at(format!("{now:016x}").as_bytes(), LAST_USE_AT)
}

/// The last use the record and hints say, by their writers' clocks (a write's use: its change).
pub fn recorded_use(seen: &Seen) -> Option<Millis> {
    seen.last_use.max(seen.record.as_ref().map(|r| r.changed))
}

/// Whether `used` is later than `now` beyond the resolution: by `now`'s clock, no use yet.
fn ahead(used: Millis, now: Millis) -> bool {
    used.saturating_sub(now) > last_use_resolution().as_millis() as Millis
}

/// Whether the recorded last use is later than `now` beyond the resolution: either this host's
/// clock is behind or the use was recorded by one ahead; the lock file's time tells which.
pub fn recorded_ahead(seen: &Seen, now: Millis) -> bool {
    recorded_use(seen).is_some_and(|used| ahead(used, now))
}

/// Records a use at `now`, unless the recorded one is later (a clock behind ages no image) and
/// not later than the file's last write `written` beyond the resolution (a clock ahead).
pub fn record_use(
    file: &File,
    seen: &mut Seen,
    now: Millis,
    written: Option<Millis>,
) -> io::Result<()> {
    let wrong = |used: Millis| written.filter(|&w| w > 0).is_some_and(|w| ahead(used, w));
    let kept = |used: Millis| used >= now && !wrong(used);
    // A record changed by a clock ahead stays so: a hint of a use since by a right clock says it.
    if recorded_use(seen).is_some_and(kept) || seen.last_use.is_some_and(kept) {
        return Ok(());
    }
    set_last_use(file, now)?;
    seen.last_use = Some(now);
    Ok(())
}

/// Whether a reader should record its use: the recorded one unknown, older than the resolution,
/// or later than `now` beyond it (a clock ahead, which would otherwise pin the image as used).
pub fn last_use_stale(seen: &Seen, now: Millis) -> bool {
    let res = last_use_resolution().as_millis() as Millis;
    let due = |used: Millis| now.saturating_sub(used) >= res || ahead(used, now);
    match recorded_use(seen) {
        // A record changed by a clock ahead: the hint decides, or every read would write.
        Some(used) if ahead(used, now) => seen.last_use.is_none_or(due),
        used => used.is_none_or(due),
    }
}

/// An image's last use as shown and gc decides on: `recorded`, but never later than the resolution
/// after the lock file's last write `written` (a clock ahead). Unknown (negative) stays so.
pub fn last_use(recorded: Millis, written: Option<Millis>) -> Millis {
    let res = last_use_resolution().as_millis() as Millis;
    // A filesystem that says no time (0) bounds nothing: lowered, an image would look unused.
    match written.filter(|&w| w > 0) {
        Some(w) => recorded.min(w.saturating_add(res)),
        None => recorded,
    }
}

/// `body` with its `crc=` line appended: a slot's text (records, slot limits).
pub(crate) fn sealed(mut body: String) -> String {
    body.push_str(&format!("crc={:08x}\n", crc32(body.as_bytes())));
    body
}

/// A slot's text up to its first NUL, less its `crc=` line, if that line checks out.
pub(crate) fn checked_body(slot: &[u8]) -> Option<&str> {
    let end = slot.iter().position(|&b| b == 0).unwrap_or(slot.len());
    let text = std::str::from_utf8(&slot[..end]).ok()?;
    let (body, rest) = text.split_at(text.find("\ncrc=")? + 1);
    let crc = rest.strip_prefix("crc=")?.split('\n').next()?;
    (crc == format!("{:08x}", crc32(body.as_bytes()))).then_some(body)
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc = CRC_TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// CRC-32 (IEEE) a byte at a time: a survey checks two record slots per image.
const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = (c >> 1) ^ (0xEDB8_8320 & (c & 1).wrapping_neg());
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    fn record(state: State) -> Record {
        Record {
            base: Some("alpine:3.17".into()),
            writer: Some("h-1-2-3-00.lease".into()),
            outcome: Some("exit 0".into()),
            state,
            ..Record::new(
                "app",
                ImagesDir::External("/s/img".into()),
                1_764_543_600_000,
            )
        }
    }

    /// A new file holding the records of `states`, written in turn.
    fn written(states: &[State]) -> File {
        let f = tempfile::tempfile().unwrap();
        let mut seen = Seen::default();
        for &state in states {
            write(&f, &mut seen, &record(state)).unwrap();
        }
        f
    }

    /// Slot A tells a migration's record (beside the older release's token, disabled or not, or
    /// its store-wide hint alone) from one of this release's own use.
    #[test]
    fn slot_a_tells_a_migrations_record_from_one_of_this_releases_use() {
        let slot_a = |f: &File| read_with_slot_a(f).unwrap().1;
        assert_eq!(slot_a(&written(&[State::Ready])), SlotA::Ours);
        assert_eq!(
            slot_a(&written(&[State::Writing, State::Ready])),
            SlotA::Ours
        );
        let hinted = tempfile::tempfile().unwrap();
        hinted.write_all_at(b"1", 3073).unwrap();
        let mut seen = read(&hinted).unwrap();
        write(&hinted, &mut seen, &record(State::Ready)).unwrap();
        assert_eq!(slot_a(&hinted), SlotA::Hint);
        let token = tempfile::tempfile().unwrap();
        token
            .write_all_at(b"stowage-image 4\nstate=ready\n", 0)
            .unwrap();
        let mut seen = read(&token).unwrap();
        write(&token, &mut seen, &record(State::Ready)).unwrap();
        assert_eq!(slot_a(&token), SlotA::Token);
        token.write_all_at(b"-", 0).unwrap();
        let (seen, a) = read_with_slot_a(&token).unwrap();
        assert_eq!(
            (seen.record.map(|r| r.state), a),
            (Some(State::Ready), SlotA::Disabled)
        );
    }

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn a_record_reads_back_and_alternates_slots() {
        let f = written(&[]);
        let mut seen = read(&f).unwrap();
        assert_eq!(seen, Seen::default());
        write(&f, &mut seen, &record(State::Writing)).unwrap();
        assert_eq!(read(&f).unwrap().record.unwrap().state, State::Writing);
        write(&f, &mut seen, &record(State::Ready)).unwrap();
        let now = read(&f).unwrap();
        assert_eq!(now.record.as_ref().unwrap().state, State::Ready);
        assert_eq!(now.record.unwrap().seq, 2);
        assert_eq!(read(&f).unwrap().record, seen.record);
    }

    #[test]
    fn a_write_cut_short_leaves_the_record_before_it() {
        let f = written(&[State::Ready, State::Writing]);
        // Slot A (seq 2) torn: B (seq 1, ready) is the record.
        f.write_all_at(b"garbage", 100).unwrap();
        let after = read(&f).unwrap();
        assert_eq!(after.record.unwrap().state, State::Ready);
        assert!(!after.damaged);
    }

    #[test]
    fn bytes_without_a_valid_slot_are_a_damaged_record_and_zeros_none() {
        assert!(Seen::parse(b"noise").damaged);
        assert!(!Seen::parse(&[0u8; 100]).damaged);
        let legacy = Seen::parse(b"stowage-image 4\nstate=ready\n");
        assert!(legacy.legacy && legacy.damaged && legacy.record.is_none());
    }

    #[test]
    fn hints_are_separate_from_the_record_and_cleared_with_it() {
        let f = written(&[State::Ready]);
        set_writer_waits(&f, true).unwrap();
        set_store_wide(&f, true).unwrap();
        set_last_use(&f, 1_764_543_600_123).unwrap();
        let s = read(&f).unwrap();
        assert!(s.writer_waits && s.store_wide);
        assert_eq!(s.last_use, Some(1_764_543_600_123));
        assert_eq!(s.record.unwrap().state, State::Ready);
        set_writer_waits(&f, false).unwrap();
        set_store_wide(&f, false).unwrap();
        let s = read(&f).unwrap();
        assert!(!s.writer_waits && !s.store_wide);
        // Clearing leaves no image, nor any hint (last_use is still set).
        clear(&f).unwrap();
        assert_eq!(read(&f).unwrap(), Seen::default());
    }

    /// A use recorded later than the reader's clock beyond the resolution is a clock ahead if it is
    /// later than the lock file's last write too (replaced), else the reader's clock is behind.
    #[test]
    fn a_use_recorded_by_a_clock_ahead_is_replaced_and_bounded_by_the_files_time() {
        let (t0, year) = (1_764_543_600_000, 365 * 86_400_000);
        let f = written(&[State::Ready]);
        set_last_use(&f, t0 + 3 * year).unwrap();
        let mut seen = read(&f).unwrap();
        assert!(last_use_stale(&seen, t0 + 100));
        // The file last written at t0: the reader is right, the recorded use ahead.
        record_use(&f, &mut seen, t0 + 100, Some(t0)).unwrap();
        assert_eq!(read(&f).unwrap().last_use, Some(t0 + 100));
        // Written when the use says: the reader's clock is behind, and it records nothing.
        set_last_use(&f, t0 + year).unwrap();
        let mut seen = read(&f).unwrap();
        record_use(&f, &mut seen, t0, Some(t0 + year)).unwrap();
        assert_eq!(read(&f).unwrap().last_use, Some(t0 + year));
        // Shown and decided on: no later than the resolution after the file's last write.
        let res = last_use_resolution().as_millis() as Millis;
        assert_eq!(last_use(t0 + 3 * year, Some(t0)), t0 + res);
        assert_eq!(last_use(t0, Some(t0 + year)), t0);
        assert_eq!(last_use(t0 + 3 * year, Some(0)), t0 + 3 * year);
        assert_eq!(
            last_use(crate::clock::UNKNOWN, Some(t0)),
            crate::clock::UNKNOWN
        );
    }

    #[test]
    fn a_write_in_flight_reads_incomplete_once_its_lock_is_free() {
        let r = record(State::Writing);
        assert_eq!(r.state_seen(true), State::Writing);
        assert_eq!(r.state_seen(false), State::Incomplete);
        assert_eq!(record(State::Ready).state_seen(false), State::Ready);
    }

    #[test]
    fn what_cannot_be_written_in_one_line_is_refused() {
        let mut r = record(State::Ready);
        r.base = Some("a\nstate=ready".into());
        assert!(r.encode().is_none());
        let mut r = record(State::Ready);
        r.images = ImagesDir::External("relative".into());
        assert!(r.encode().is_none());
    }
}
