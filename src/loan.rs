//! Loans of owner access on a base's own inodes, for a copy by their owner (not root) whose mode
//! keeps them from it (a mode-000 `/etc/shadow`, as RHEL-family images hold): the read (and
//! search) bits are set on the very inode while it is copied. The base is only read-locked, so:
//!
//! - **One lender at a time, and no copy meanwhile.** Each image has a *lend lock* beside its lock
//!   (`ENC.lend`): every copy of the image holds it shared while it reads the base, a lender
//!   exclusively from its first loan to the end of its copy. A copy thus sees no loan but its own,
//!   and copies the modes it stats. Shared is let go before exclusive is waited for (two upgraders
//!   in place would deadlock). Only copies take it, after their image locks, and none waits for
//!   another lock while holding it.
//! - **Journaled.** The lend file holds the loans outstanding, one line each (the inode's names
//!   from the image's top, device, inode, mode before, mode lent), written durably before the
//!   chmod and cut off after the mode is back (loans are a stack). Whoever next holds the lock
//!   exclusively (the next copy, `gc`, `doctor --repair`) restores what a killed lender left: an
//!   inode that is the same and still has the lent mode gets its mode back.
//! - An image's record dropped (removed) empties and unlinks its lend file: its loans end with it.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{self, Write as _};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt as _;
use std::path::PathBuf;
use std::rc::Rc;

use anyhow::{Context, Result};

use crate::dir::{self, Dir};
use crate::lock::{self, Guard, IfMissing, Mode, Wait};

/// The lend lock of one base, held while it is copied.
pub struct Loans {
    path: PathBuf,
    /// The base's top, where journaled names start.
    top: Dir,
    guard: Option<Guard>,
    /// The base as a wait says it; `None`: quiet.
    shown: Option<String>,
    /// The journal as loans share it (one descriptor however many are out), held exclusively.
    lending: Option<Rc<File>>,
}

/// How long a wait for the lend lock goes on before it is said.
const NOTICE: std::time::Duration = std::time::Duration::from_secs(2);

/// A loan on one inode: its mode is put back, then its journal line cut off, when dropped.
pub struct Lent {
    /// The inode; `None` while detached, when its loan outlives this only in the journal.
    fd: Option<OwnedFd>,
    mode: libc::mode_t,
    journal: Rc<File>,
    /// The journal's length before this loan's line.
    at: u64,
}

impl Drop for Lent {
    fn drop(&mut self) {
        let Some(fd) = &self.fd else { return };
        if dir::chmod_o_path(fd.as_raw_fd(), self.mode).is_ok() {
            let _ = self
                .journal
                .set_len(self.at)
                .and_then(|()| self.journal.sync_data());
        }
    }
}

impl Lent {
    /// Closes the inode's descriptor, the mode still lent (a walk keeps few open): unless
    /// [`Lent::reattach`]ed, the loan is given back from its journal line only.
    pub fn detach(&mut self) {
        self.fd = None;
    }

    /// Takes up the inode again by `fd`, which the caller checked is the very one.
    pub fn reattach(&mut self, fd: OwnedFd) {
        self.fd = Some(fd);
    }
}

impl Loans {
    /// Takes the lend lock at `path` of the base whose top is `top`, shared (exclusive if a killed
    /// lender's journal must be restored first), waiting out a lender. A wait that goes on is said
    /// with the base's name `shown`, unless `None`.
    pub fn take(path: PathBuf, top: &Dir, shown: Option<String>) -> Result<Loans> {
        let top = top.duplicate().context("cannot open the base")?;
        let mut loans = Loans {
            path,
            top,
            guard: None,
            shown,
            lending: None,
        };
        loans.lock(Mode::Shared)?;
        if loans.journal()?.metadata()?.len() > 0 {
            loans.lock(Mode::Exclusive)?;
        }
        Ok(loans)
    }

    /// Lets go of the lock held, waits for it in `mode`, and held exclusively restores what is
    /// journaled.
    fn lock(&mut self, mode: Mode) -> Result<()> {
        (self.guard, self.lending) = (None, None);
        let shown = self.path.display();
        let dir = self.path.parent().unwrap_or(self.path.as_path());
        let mut wait = Wait::on(dir, None);
        if let Some(base) = &self.shown {
            let why = match mode {
                Mode::Shared => format!(
                    "another copy of {base} to end: it lends itself owner access to entries whose mode withholds it"
                ),
                Mode::Exclusive => format!(
                    "the other copies of {base} to end: this one lends itself owner access to entries whose mode withholds it"
                ),
            };
            // As `Ctx::say` writes, a line that cannot fail the copy.
            let line = format!("waiting for {why} ({shown})");
            let say = move || {
                let line = crate::ident::printable(&line);
                let _ = writeln!(io::stderr(), "stowage: {line}");
            };
            wait.notice = Some((NOTICE, Box::new(say)));
        }
        let got = lock::acquire(&self.path, mode, IfMissing::Create, &mut wait)
            .with_context(|| format!("cannot lock {shown}"))?;
        let guard = got.or_else_busy(|| anyhow::anyhow!("cannot lock {shown}"))?;
        if mode == Mode::Exclusive {
            restore(guard.file(), &self.top)
                .with_context(|| format!("cannot restore the modes journaled in {shown}"))?;
        }
        self.guard = Some(guard);
        Ok(())
    }

    fn journal(&self) -> io::Result<&File> {
        (self.guard.as_ref().map(Guard::file)).ok_or_else(|| io::Error::other("no lend lock"))
    }

    /// Holds the lock exclusively, as a loan needs: the first time, shared is let go and exclusive
    /// waited for.
    pub fn exclusive(&mut self) -> Result<()> {
        match &self.guard {
            Some(g) if g.mode() == Mode::Exclusive => Ok(()),
            _ => self.lock(Mode::Exclusive),
        }
    }

    /// Lends the owner bits `need` on `path` (an `O_PATH` descriptor of the inode `st`, named
    /// `names` from the base's top), journaled first; the lock is held exclusively
    /// ([`Loans::exclusive`]).
    pub fn lend(
        &mut self,
        names: &[CString],
        path: OwnedFd,
        st: &libc::stat,
        need: libc::mode_t,
    ) -> io::Result<Lent> {
        if self
            .guard
            .as_ref()
            .is_none_or(|g| g.mode() != Mode::Exclusive)
        {
            return Err(io::Error::other("a loan without the lend lock"));
        }
        let journal = match &self.lending {
            Some(j) => j.clone(),
            None => Rc::new(self.journal()?.try_clone()?),
        };
        self.lending = Some(journal.clone());
        let at = journal.metadata()?.len();
        if at == 0 {
            // The lend file's name must outlive a crash as its lines do.
            let dir = Dir::open_in_root(self.path.parent().unwrap_or(&self.path))?;
            nix::unistd::fsync(&dir)?;
        }
        let mode = st.st_mode & 0o7777;
        let (dev, ino, names) = (st.st_dev, st.st_ino, hex(names));
        let line = format!("{mode:o} {:o} {dev} {ino} {names}\n", mode | need);
        journal.write_all_at(line.as_bytes(), at)?;
        journal.sync_data()?;
        if let Err(e) = dir::chmod_o_path(path.as_raw_fd(), mode | need) {
            let _ = journal.set_len(at);
            return Err(e);
        }
        Ok(Lent {
            fd: Some(path),
            mode,
            journal,
            at,
        })
    }
}

/// The names joined by `/`, in hex: one word whatever bytes they hold.
fn hex(names: &[CString]) -> String {
    let joined: Vec<&[u8]> = names.iter().map(|n| n.to_bytes()).collect();
    joined
        .join(&b'/')
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn unhex(word: &str) -> Option<Vec<u8>> {
    let digits = word.as_bytes().chunks(2);
    digits
        .map(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 16).ok())
        .collect()
}

/// At most this much of a journal is read: a loan's line is under 600 bytes, a tree's loans at
/// once one a level; a bigger file (planted) is read no further, then emptied.
const JOURNAL_MAX: u64 = 1 << 20;

/// Restores, last first, every loan journaled in `journal` (held exclusively) on the tree `top`,
/// then empties it. A line cut short by a crash was never lent (lines are synced before the chmod).
/// In a group store any member may write the journal: a line is taken only for what a loan can
/// be (owner read and search bits added, nothing else), on an inode of the tree (no `..`) that is
/// the restorer's. One of another user's is kept, and said: that user (or root) restores it.
pub fn restore(journal: &File, top: &Dir) -> io::Result<()> {
    // By offset: the descriptor's position is the lock's business.
    let len = journal.metadata()?.len().min(JOURNAL_MAX);
    let mut text = vec![0u8; len as usize];
    if text.is_empty() {
        return Ok(());
    }
    journal.read_exact_at(&mut text, 0)?;
    let text = String::from_utf8_lossy(&text);
    let mut kept: Vec<(&str, u32)> = Vec::new();
    for line in text.split_terminator('\n').rev() {
        if let Some(owner) = restore_line(line, top)? {
            kept.push((line, owner));
        }
    }
    let left: String = kept.iter().rev().map(|(l, _)| format!("{l}\n")).collect();
    journal.set_len(0)?;
    journal.write_all_at(left.as_bytes(), 0)?;
    journal.sync_data()?;
    match kept.first() {
        None => Ok(()),
        Some((_, uid)) => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "modes a killed copy by uid {uid} lent are left on the base: only that user or root can put them back ('stowage doctor --repair')"
            ),
        )),
    }
}

/// Puts back the loan journaled in `line` where it is one (see [`restore`]); `Some(owner)` where the
/// inode is another user's, so not ours to set.
fn restore_line(line: &str, top: &Dir) -> io::Result<Option<u32>> {
    let w: Vec<&str> = line.split(' ').collect();
    let [was, lent, dev, ino, names] = w[..] else {
        return Ok(None);
    };
    let num = |s: &str, radix| u64::from_str_radix(s, radix).ok();
    let (Some(was), Some(lent), Some(dev), Some(ino), Some(names)) = (
        num(was, 8),
        num(lent, 8),
        num(dev, 10),
        num(ino, 10),
        unhex(names),
    ) else {
        return Ok(None);
    };
    // A loan adds owner read (and search) bits, and nothing else.
    let added = lent & !was;
    if lent > 0o7777 || was & !lent != 0 || added == 0 || added & !0o500 != 0 {
        return Ok(None);
    }
    let inside = |n: &[u8]| !n.is_empty() && n != b"." && n != b"..";
    if !names.split(|b| *b == b'/').all(inside) {
        return Ok(None);
    }
    let Ok(fd) = open_journaled(top, &names) else {
        return Ok(None);
    };
    let st = dir::fstat(&fd)?;
    // Another inode at that name now, or a mode changed since by a writer: not ours to set.
    if (st.st_dev, st.st_ino) != (dev, ino) || u64::from(st.st_mode & 0o7777) != lent {
        return Ok(None);
    }
    let me = nix::unistd::geteuid().as_raw();
    if st.st_uid != me && me != 0 {
        return Ok(Some(st.st_uid));
    }
    dir::chmod_o_path(fd.as_raw_fd(), was as libc::mode_t)?;
    Ok(None)
}

/// Restores what a killed lender left journaled in the lend file at `path` on the tree `top`, if no
/// copy holds its lock now: whether it did.
pub fn restore_left(path: &std::path::Path, top: &Dir) -> io::Result<bool> {
    match lock::acquire_no_wait(path, Mode::Exclusive, IfMissing::Fail)? {
        Some(g) => restore(g.file(), top).map(|()| true),
        None => Ok(false),
    }
}

/// An `O_PATH` descriptor of the entry at `names` (joined by `/`) below `top`, no symlink followed.
fn open_journaled(top: &Dir, names: &[u8]) -> io::Result<OwnedFd> {
    let mut parts: Vec<&[u8]> = names.split(|b| *b == b'/').collect();
    let last = parts
        .pop()
        .filter(|l| !l.is_empty())
        .ok_or(io::ErrorKind::InvalidData)?;
    let mut here: Option<Dir> = None;
    for p in parts {
        here = Some(
            here.as_ref()
                .unwrap_or(top)
                .anchor_sub(OsStr::from_bytes(p))?,
        );
    }
    let last = CString::new(last)?;
    let flags = libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    here.as_ref().unwrap_or(top).open_at(&last, flags, 0)
}
