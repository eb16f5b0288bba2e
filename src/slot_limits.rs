//! A slot class's limits: one record per class, the one copy, at the start of the class's first
//! slot file (`locks/slots/ENC/0.lock`).
//!
//! ```text
//! stowage-class 1
//! class=pull
//! limit=4            (0: unlimited)
//! reserve=1          (slots only --priority high may take)
//! files=6            (normal slot files that may be held: more than the
//! high_files=1        limit after a lowered one, until their holders end)
//! crc=1a2b3c4d
//! ```
//!
//! - Written only under the global lock, in one synced `pwrite`; read with one `pread`, with or
//!   without `0.lock`'s lock: a torn read fails the CRC and is read again.
//! - A zeroed `0.lock` is no class (`slots rm` zeroes the record in place). One with no byte at
//!   all was emptied by an opener, never by stowage: a shell's `9>FILE` (flock(1)'s man page idiom)
//!   truncates it. Its class is not known, yet not removed: waiters keep the limits they read.
//! - A slot is taken only among the first `limit` (or `reserve`) files; the rest up to
//!   `files`/`high_files` are held under a higher, older limit.

use std::io;
use std::os::unix::fs::FileExt;

const FORMAT: &str = "stowage-class 1\n";
/// The bytes a class record takes: two slots (the rest of `0.lock` is unused).
pub const AREA: usize = 2 * SLOT;
/// One copy of the record; the valid one with the higher `seq` holds.
const SLOT: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    pub limit: u32,
    pub reserve: u32,
    /// Normal slot files that may be held (≥ limit).
    pub files: u32,
    /// Reserved slot files that may be held (≥ reserve).
    pub high_files: u32,
}

impl Limits {
    /// A class's new limits: its slots, plus files possibly still held under an earlier setting.
    pub fn set(limit: u32, reserve: u32, before: Option<Limits>) -> Limits {
        let (files, high_files) = before.map_or((0, 0), |b| (b.files, b.high_files));
        Limits {
            limit,
            reserve,
            files: files.max(limit),
            high_files: high_files.max(reserve),
        }
    }

    /// Whether a slot file beyond the limits may still be held.
    pub fn settled(&self) -> bool {
        self.files <= self.limit && self.high_files <= self.reserve
    }
}

/// Which slot a file is, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Normal(u32),
    High(u32),
}

/// The most slot files of a kind a class counts: a larger number in a name is no slot (planted,
/// or the holder of an unlimited class past it, which a limit set later does not count).
pub const MOST_FILES: u32 = 4096;

impl Kind {
    pub fn of(file_name: &str) -> Option<Kind> {
        let stem = file_name.strip_suffix(".lock")?;
        let kind = match stem.strip_prefix("high-") {
            Some(n) => Kind::High(n.parse().ok()?),
            None => Kind::Normal(stem.parse().ok()?),
        };
        let (Kind::Normal(n) | Kind::High(n)) = kind;
        // One spelling per slot: `007.lock` and `+7.lock` are none.
        (n < MOST_FILES && kind.file_name() == file_name).then_some(kind)
    }

    pub fn file_name(self) -> String {
        match self {
            Kind::Normal(n) => format!("{n}.lock"),
            Kind::High(n) => format!("high-{n}.lock"),
        }
    }
}

/// What a class's `0.lock` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Limits(Limits),
    /// Empty: no such class.
    None,
    /// Bytes that are no record: the class cannot be known.
    Damaged,
    /// No byte at all: emptied by an opener (module doc), the class not known.
    Emptied,
    /// A later release's record (`stowage-class N`, N above ours): that release's class, neither
    /// used nor rewritten here.
    Newer(u64),
}

impl Class {
    pub fn limits(self) -> Option<Limits> {
        match self {
            Class::Limits(l) => Some(l),
            _ => None,
        }
    }
}

fn encode(class: &str, l: &Limits, seq: u64) -> Vec<u8> {
    let body = format!(
        "{FORMAT}seq={seq}\nclass={class}\nlimit={}\nreserve={}\nfiles={}\nhigh_files={}\n",
        l.limit, l.reserve, l.files, l.high_files
    );
    let mut slot = crate::image_record::sealed(body).into_bytes();
    slot.resize(SLOT, 0);
    slot
}

/// What the two slots say: the valid one with the higher `seq`, and which slot that is.
fn decode(bytes: &[u8], class: &str) -> (Class, Option<(usize, u64)>) {
    // Left by an unlinker that did not get to unlink it: no class.
    if bytes.starts_with(crate::lock::GONE) {
        return (Class::None, None);
    }
    if bytes.is_empty() {
        return (Class::Emptied, None);
    }
    let slot = |i: usize| bytes.get(i * SLOT..((i + 1) * SLOT).min(bytes.len()));
    // A format line is trusted only where its slot's CRC holds (a later format keeps `crc=`
    // last): one damaged byte, even in the slot not in use, is damage, not a later release's.
    let newer = |i: usize| {
        let body = crate::image_record::checked_body(slot(i)?)?;
        crate::error::newer_format(body, "stowage-class ", 1)
    };
    if let Some(n) = newer(0).max(newer(1)) {
        return (Class::Newer(n), None);
    }
    let read = |i: usize| slot(i).map_or(Slot::Empty, |b| decode_slot(b, class));
    match (read(0), read(1)) {
        (Slot::Valid(sa, _), Slot::Valid(sb, lb)) if sb > sa => (Class::Limits(lb), Some((1, sb))),
        (Slot::Valid(s, l), _) => (Class::Limits(l), Some((0, s))),
        (_, Slot::Valid(s, l)) => (Class::Limits(l), Some((1, s))),
        (Slot::Empty, Slot::Empty) => (Class::None, None),
        _ => (Class::Damaged, None),
    }
}

enum Slot {
    Empty,
    Invalid,
    Valid(u64, Limits),
}

fn decode_slot(bytes: &[u8], class: &str) -> Slot {
    if bytes.first().is_none_or(|&b| b == 0) {
        return if bytes.iter().all(|&b| b == 0) {
            Slot::Empty
        } else {
            Slot::Invalid
        };
    }
    let mut seq = 0;
    let mut parse = || -> Option<Limits> {
        let body = crate::image_record::checked_body(bytes)?;
        let mut l = Limits::default();
        let mut named = false;
        for line in body.strip_prefix(FORMAT)?.lines() {
            let (k, v) = line.split_once('=')?;
            match k {
                "seq" => seq = v.parse().ok()?,
                "class" => named = v == class,
                "limit" => l.limit = v.parse().ok()?,
                "reserve" => l.reserve = v.parse().ok()?,
                "files" => l.files = v.parse().ok()?,
                "high_files" => l.high_files = v.parse().ok()?,
                _ => {}
            }
        }
        named.then_some(l)
    };
    parse().map_or(Slot::Invalid, |l| Slot::Valid(seq, l))
}

/// Reads the class record from `0.lock`: one `pread`, again a few times if a write was under way.
pub fn read(file: &std::fs::File, class: &str) -> io::Result<Class> {
    let mut buf = vec![0u8; AREA];
    for attempt in 0..4 {
        let n = file.read_at(&mut buf, 0)?;
        match decode(&buf[..n], class).0 {
            Class::Damaged if attempt < 3 => {
                std::thread::sleep(std::time::Duration::from_millis(1 << attempt));
            }
            c => return Ok(c),
        }
    }
    Ok(Class::Damaged)
}

/// Writes the class record into the slot of `0.lock` not holding the current one, synced (under the
/// global lock). `None` removes the class: the older slot is emptied first, then the current one.
pub fn write(file: &std::fs::File, class: &str, limits: Option<&Limits>) -> io::Result<()> {
    let mut buf = vec![0u8; AREA];
    let n = file.read_at(&mut buf, 0)?;
    let (now, found) = decode(&buf[..n], class);
    // Never written over in this release's format: that would downgrade a later release's class.
    if let Class::Newer(format) = now {
        let why = format!("slot class '{class}' has limits of a later format ({format})");
        return Err(io::Error::new(io::ErrorKind::Unsupported, why));
    }
    let (newest, seq) = found.unwrap_or((1, 0));
    let other = (1 - newest) as u64 * SLOT as u64;
    match limits {
        Some(l) => {
            let slot = encode(class, l, seq + 1);
            if n < AREA {
                // A new or short file: both slots written, the current record's as it was (a
                // write cut short keeps it), an empty one's emptied.
                if found.is_none() {
                    buf.fill(0);
                }
                buf[(1 - newest) * SLOT..(2 - newest) * SLOT].copy_from_slice(&slot);
                file.write_all_at(&buf, 0)?;
            } else {
                file.write_all_at(&slot, other)?;
            }
            crate::lock::sync_written(file)
        }
        None => {
            file.write_all_at(&[0u8; SLOT], other)?;
            crate::lock::sync_written(file)?;
            file.write_all_at(&[0u8; SLOT], newest as u64 * SLOT as u64)?;
            crate::lock::sync_written(file)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_says_its_class_and_nothing_else_passes() {
        let l = Limits::set(4, 1, None);
        let bytes = encode("load/podman", &l, 1);
        assert_eq!(decode(&bytes, "load/podman").0, Class::Limits(l));
        assert_eq!(decode(&bytes, "pull").0, Class::Damaged);
        assert_eq!(decode(&[0u8; 10], "pull").0, Class::None);
        assert_eq!(decode(b"", "pull").0, Class::Emptied);
        for i in 0..60 {
            let mut b = bytes.clone();
            b[i] ^= 0x04;
            assert_ne!(decode(&b, "load/podman").0, Class::Limits(l), "byte {i}");
        }
    }

    #[test]
    fn a_write_to_a_short_file_keeps_the_current_record_until_the_new_one_is_written() {
        // A first write cut short after its first slot: the record, alone, in a short file.
        let f = tempfile::tempfile().unwrap();
        let old = Limits::set(4, 1, None);
        f.write_all_at(&encode("pull", &old, 1), 0).unwrap();
        write(&f, "pull", Some(&Limits::set(2, 0, None))).unwrap();
        let mut first = vec![0u8; SLOT];
        f.read_at(&mut first, 0).unwrap();
        // Written over in the same write, the slot says what it said: a cut there loses nothing.
        assert_eq!(decode(&first, "pull").0, Class::Limits(old));
        assert_eq!(
            read(&f, "pull").unwrap(),
            Class::Limits(Limits::set(2, 0, None))
        );
    }

    #[test]
    fn a_lowered_limit_keeps_the_files_that_may_be_held() {
        let high = Limits::set(4, 1, None);
        let low = Limits::set(2, 0, Some(high));
        assert_eq!((low.files, low.high_files), (4, 1));
        assert!(!low.settled());
        assert!(Limits::set(2, 0, None).settled());
        assert_eq!(Kind::of("high-3.lock"), Some(Kind::High(3)));
        assert_eq!(Kind::of("changed"), None);
    }
}
