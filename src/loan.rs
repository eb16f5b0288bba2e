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
//! - **Journaled, by each lender in a file of its own.** A lender's loans outstanding are lines of
//!   its journal `ENC.lend.UID` (the inode's names from the image's top, device, inode, mode before,
//!   mode lent), written durably before the chmod and cut off after the mode is back (loans are a
//!   stack). Only its lender can write it (its own, no group or other write bit, one name): in a
//!   group store any member may write the lend file, so a line there could make a restorer take
//!   owner bits away. The lend file only names the uids with a journal (also found by their
//!   `UID.loans` directories: any member, or an older release, may rewrite it without one),
//!   besides loan lines the previous release journaled in it:
//!   kept and reported, never acted on (anyone of the group may have written them). Whoever next holds the lock exclusively (the next copy, `gc`,
//!   `doctor --repair`) restores what a killed lender left: a line of UID's journal, on an inode
//!   of UID's that is the same and still has the lent mode, gets its mode back — by UID or root;
//!   anyone else says whose loans are left.
//! - An image's record dropped (removed) empties and unlinks its lend file and the journals it
//!   names: its loans end with it.

use crate::ident::STOWAGE;
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{self, Write as _};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
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
    /// When every wait for the lock gives up (the exec's `--wait`; now for `--no-wait`); `None`:
    /// none does.
    deadline: Option<std::time::Instant>,
    /// Our journal as loans share it (one descriptor however many are out), the lock held
    /// exclusively.
    lending: Option<Journal>,
}

/// A lender's own journal of loans, opened.
struct Journal {
    file: Rc<File>,
    /// The directory holding it, and its name there.
    dir: Dir,
    name: CString,
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

impl Drop for Loans {
    /// Every loan given back (our journal empty), our journal goes, then our uid from the lend
    /// file: the next copy finds it empty and reads nothing more. A crash between leaves a uid
    /// without a journal, passed over.
    fn drop(&mut self) {
        let (Some(j), Some(g)) = (&self.lending, &self.guard) else {
            return;
        };
        if !j.file.metadata().is_ok_and(|m| m.len() == 0) {
            return;
        }
        let Ok(st) = dir::fstat(&*j.file) else { return };
        let name = OsStr::from_bytes(j.name.to_bytes());
        if j.dir.unlink_if(name, st.st_dev, st.st_ino).is_ok()
            && let Ok((mut uids, old)) = lend_lines(g.file())
        {
            uids.retain(|u| *u != st.st_uid);
            let _ = set_lenders(g.file(), &uids, &old);
        }
    }
}

impl Loans {
    /// Takes the lend lock at `path` of the base whose top is `top`, shared (exclusive if a killed
    /// lender's journal must be restored first), waiting out a lender. A wait that goes on is said
    /// with the base's name `shown`, unless `None`. Every wait, here and for a loan later, gives
    /// up at `deadline` (busy, as any lock wait of the exec).
    pub fn take(
        path: PathBuf,
        top: &Dir,
        shown: Option<String>,
        deadline: Option<std::time::Instant>,
    ) -> Result<Loans> {
        let top = top.duplicate().context("cannot open the base")?;
        let mut loans = Loans {
            path,
            top,
            guard: None,
            shown,
            deadline,
            lending: None,
        };
        loans.lock(Mode::Shared)?;
        if loans.lend_file()?.metadata()?.len() > 0 || !journaled(&loans.path).is_empty() {
            loans.lock(Mode::Exclusive)?;
        }
        Ok(loans)
    }

    /// Lets go of the lock held, waits for it in `mode`, and held exclusively restores what is
    /// journaled.
    fn lock(&mut self, mode: Mode) -> Result<()> {
        (self.lending, self.guard) = (None, None);
        let shown = self.path.display();
        let dir = self.path.parent().unwrap_or(self.path.as_path());
        let mut wait = Wait::on(dir, self.deadline);
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
        let since = std::time::Instant::now();
        let got = lock::acquire(&self.path, mode, IfMissing::Create, &mut wait)
            .map_err(|e| lock::error("the base's lend lock", &self.path, e))?;
        let guard = got.or_else_busy(|| {
            let holders = match mode {
                Mode::Shared => "held by another copy of the image lending itself owner access",
                Mode::Exclusive => "held by other copies of the image",
            };
            crate::Error::Busy(crate::error::Busy {
                what: format!("the base's lend lock {shown}"),
                holders: holders.into(),
                waited: since.elapsed(),
            })
            .into()
        })?;
        if mode == Mode::Exclusive {
            restore(guard.file(), &self.path, &self.top)
                .with_context(|| format!("cannot restore the modes journaled for {shown}"))?;
        }
        self.guard = Some(guard);
        Ok(())
    }

    fn lend_file(&self) -> io::Result<&File> {
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

    /// Our journal, opened (made) on the first loan, its uid named in the lend file first and
    /// both names synced: a crash after leaves a journal its restorer finds.
    fn journal(&mut self) -> io::Result<Rc<File>> {
        if let Some(j) = &self.lending {
            return Ok(j.file.clone());
        }
        let me = nix::unistd::geteuid().as_raw();
        let lend = self.lend_file()?;
        let (mut uids, old) = lend_lines(lend)?;
        if !uids.contains(&me) {
            uids.push(me);
            set_lenders(lend, &uids, &old)?;
        }
        let (dir, name) = journal_of(&self.path, me, true)?.ok_or(io::ErrorKind::NotFound)?;
        let flags = libc::O_RDWR | libc::O_CREAT;
        let file = open_journal(&dir, &name, me, flags, &self.path)?;
        let file = file.ok_or(io::ErrorKind::NotFound)?;
        // Lines the lend file did not name (emptied meanwhile): ours, so put back before ours.
        if file.metadata()?.len() > 0 {
            empty_journal(&file, me, &self.top)?;
        }
        nix::unistd::fsync(&dir)?;
        let file = Rc::new(file);
        self.lending = Some(Journal {
            file: file.clone(),
            dir,
            name,
        });
        Ok(file)
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
        let journal = self.journal()?;
        let at = journal.metadata()?.len();
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

/// At most this much of a lend file is read: a uid a line, a few at once, and the loans an older
/// release's killed copy left (see [`lend_lines`]); any member may write it, so more is not read.
const LENDERS_MAX: usize = 1 << 20;

/// The uids the lend file `lend` names as having a journal; anything else in it is passed over.
fn lenders(lend: &File) -> io::Result<Vec<u32>> {
    lend_lines(lend).map(|(uids, _)| uids)
}

/// The lend file's uids, and its loan lines (`MODE LENT DEV INO NAMES`, as in a journal): the
/// previous release journaled its loans in the lend file itself, and a copy of it killed mid-loan
/// left them there: kept (see [`restore_left`]). Anything else, or a line cut short, is passed over.
fn lend_lines(lend: &File) -> io::Result<(Vec<u32>, Vec<String>)> {
    let mut text = vec![0u8; LENDERS_MAX];
    // By offset: the descriptor's position is the lock's business.
    let n = lend.read_at(&mut text, 0)?;
    let (mut uids, mut old): (Vec<u32>, Vec<String>) = (Vec::new(), Vec::new());
    let text = String::from_utf8_lossy(&text[..n]);
    let ended = text.rfind('\n').map_or("", |at| &text[..=at]);
    for word in ended.split_terminator('\n') {
        if let Ok(uid) = word.parse() {
            if !uids.contains(&uid) {
                uids.push(uid);
            }
        } else if word.split(' ').count() == 5 {
            old.push(word.to_owned());
        }
    }
    Ok((uids, old))
}

/// Writes `uids`, then the older release's loan lines `old` still outstanding, as the lend file's
/// content (held exclusively), synced. Written over the old content before it is cut to length: a
/// kill between leaves more than meant (a uid without a journal is passed over), never less — the
/// lend file is the only way to another lender's journal.
fn set_lenders(lend: &File, uids: &[u32], old: &[String]) -> io::Result<()> {
    let mut text: String = uids.iter().map(|u| format!("{u}\n")).collect();
    text.extend(old.iter().map(|l| format!("{l}\n")));
    lend.write_all_at(text.as_bytes(), 0)?;
    crate::debug::pause("lenders-written");
    lend.set_len(text.len() as u64)?;
    lend.sync_data()
}

/// Writes the lenders (and older loan lines) the lend file `from` names into `to`, a fresh one in
/// its place (`from` set aside, a second name given it): the lend file is the only way to their
/// journals.
pub fn carry_lenders(from: &File, to: &File) -> io::Result<()> {
    let (uids, old) = lend_lines(from)?;
    set_lenders(to, &uids, &old)
}

/// Where `uid`'s journal for the lend file `lend` is: in `UID.loans`, a directory of `uid`'s beside
/// it (so no part of a group store's layout, which a repair makes group-writable), under the lend
/// file's name. The directory opened (made if `make`) only if it is `uid`'s and writable by nobody
/// else; `None` where missing, an error naming it for anything else there.
fn journal_of(lend: &Path, uid: u32, make: bool) -> io::Result<Option<(Dir, CString)>> {
    let locks = Dir::open_in_root(lend.parent().unwrap_or(lend))?;
    let sub = CString::new(format!("{uid}.loans"))?;
    let shown = lend.with_file_name(OsStr::from_bytes(sub.to_bytes()));
    let refuse = |why: String| {
        io::Error::other(format!(
            "{}: {why}, so it holds no journal of loans: refusing to use it; remove it",
            shown.display()
        ))
    };
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    let open = || locks.open_at(&sub, flags | libc::O_CLOEXEC, 0);
    let fd = match open() {
        Err(e) if e.kind() == io::ErrorKind::NotFound && make => {
            match locks.mkdir(OsStr::from_bytes(sub.to_bytes()), 0o755) {
                Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
                _ => nix::unistd::fsync(&locks)?,
            }
            open()
        }
        other => other,
    };
    let fd = match fd {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
            return Err(refuse("not a directory".into()));
        }
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("{}: {e}", shown.display()),
            ));
        }
    };
    let st = dir::fstat(&fd)?;
    if st.st_uid != uid {
        return Err(refuse(format!("uid {}'s, not uid {uid}'s", st.st_uid)));
    }
    if st.st_mode & 0o022 != 0 {
        let mode = st.st_mode & 0o7777;
        return Err(refuse(format!(
            "mode {mode:o}, writable by others than uid {uid}"
        )));
    }
    let name = CString::new(lend.file_name().unwrap_or_default().as_bytes())?;
    Ok(Some((Dir::from(fd), name)))
}

/// `uid`'s journal for the lend file `lend`, as messages name it.
fn journal_path(lend: &Path, uid: u32) -> PathBuf {
    let name = lend.file_name().unwrap_or_default();
    lend.with_file_name(format!("{uid}.loans")).join(name)
}

/// Opens `uid`'s journal `name` in `dir` (beside the lend file `lend`) with `flags`, only if it is
/// one: a regular file of `uid` with one name and no group or other write bit, opened without
/// following a link or blocking on a FIFO. `None` where missing; an error, one line naming it, for
/// anything else there (planted: never written or followed).
fn open_journal(
    dir: &Dir,
    name: &CString,
    uid: u32,
    flags: libc::c_int,
    lend: &Path,
) -> io::Result<Option<File>> {
    let flags = flags | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
    let shown = journal_path(lend, uid);
    let planted = |why: String| {
        io::Error::other(format!(
            "{}: {why}, so no journal of loans: refusing to use it; remove it",
            shown.display()
        ))
    };
    let fd = match dir.open_at(name, flags, 0o644) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(planted("a symlink".into())),
        Err(e) if e.raw_os_error() == Some(libc::EISDIR) => {
            return Err(planted("a directory".into()));
        }
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("{}: {e}", shown.display()),
            ));
        }
    };
    let st = dir::fstat(&fd)?;
    let why = match crate::planted::kind_of(st.st_mode, st.st_nlink) {
        Some(kind) => Some(kind.to_owned()),
        None if st.st_uid != uid => Some(format!("uid {}'s, not uid {uid}'s", st.st_uid)),
        None if st.st_mode & 0o022 != 0 => Some(format!(
            "mode {:o}, writable by others than uid {uid}",
            st.st_mode & 0o7777
        )),
        None => None,
    };
    match why {
        Some(why) => Err(planted(why)),
        None => Ok(Some(File::from(fd))),
    }
}

/// A journal's line longer than this is none of a loan (its path from the top, in hex: a tree
/// 30,000 levels deep of 255-byte names): the journal is reported, not emptied.
const LINE_MAX: usize = 1 << 26;

/// Calls `each` on every whole line of `journal`, last first, read from its end a block at a
/// time: a journal of any length (a deep tree's loans each name their path from the top) is read
/// whole, one line in memory at once. What follows the last newline, cut short by a crash, was
/// never lent (lines are synced before the chmod).
fn lines_last_first(
    journal: &File,
    mut each: impl FnMut(&str) -> io::Result<()>,
) -> io::Result<()> {
    const BLOCK: u64 = 1 << 16;
    let len = journal.metadata()?.len();
    let mut end = len;
    // The line being read, its pieces last first; `None` before the last newline is met.
    let mut line: Option<Vec<Vec<u8>>> = None;
    let whole =
        |pieces: &mut Vec<Vec<u8>>| -> Vec<u8> { pieces.drain(..).rev().flatten().collect() };
    while end > 0 {
        let start = end.saturating_sub(BLOCK);
        let mut block = vec![0u8; (end - start) as usize];
        journal.read_exact_at(&mut block, start)?;
        end = start;
        let mut rest = &block[..];
        while let Some(nl) = rest.iter().rposition(|b| *b == b'\n') {
            if let Some(pieces) = &mut line {
                pieces.push(rest[nl + 1..].to_vec());
                each(&String::from_utf8_lossy(&whole(pieces)))?;
            }
            line.get_or_insert_with(Vec::new);
            rest = &rest[..nl];
        }
        let unended = match &mut line {
            Some(pieces) => {
                pieces.push(rest.to_vec());
                pieces.iter().map(Vec::len).sum::<usize>()
            }
            None => (len - end) as usize,
        };
        if unended > LINE_MAX {
            return Err(io::Error::other(format!(
                "a line of over {LINE_MAX} bytes, no loan's: it is kept; remove it"
            )));
        }
    }
    match &mut line {
        Some(pieces) => each(&String::from_utf8_lossy(&whole(pieces))),
        None => Ok(()),
    }
}

/// Restores, last first, every loan journaled for the tree `top` by a lender the lend file
/// `lend` (at `path`, held exclusively) names: each journal of ours (or any, for root) is emptied
/// once its loans are back, and its uid goes from the lend file. A line is taken only for what a
/// loan can be (owner read and search bits added, nothing else) on an inode of the tree (no `..`)
/// owned by the journal's owner, who alone can have lent it. Another user's journal is kept, and
/// said: that user (or root) restores it.
pub fn restore(lend: &File, path: &Path, top: &Dir) -> io::Result<()> {
    let (mut uids, old) = lend_lines(lend)?;
    for uid in journaled(path) {
        if !uids.contains(&uid) {
            uids.push(uid);
        }
    }
    if uids.is_empty() && old.is_empty() {
        return Ok(());
    }
    let (mut left, mut refused) = (Vec::new(), None);
    for uid in uids {
        match restore_journal(path, uid, top) {
            Ok(false) => {}
            Ok(true) => left.push(uid),
            Err(e) => {
                left.push(uid);
                refused.get_or_insert(e);
            }
        }
    }
    set_lenders(lend, &left, &old)?;
    if let Some(e) = refused {
        return Err(e);
    }
    match left.first() {
        None => Ok(()),
        Some(uid) => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            theirs(*uid),
        )),
    }
}

/// Why loans `uid` journaled are left to that user or root.
fn theirs(uid: u32) -> String {
    format!(
        "modes a killed copy by uid {uid} lent are left on the base: only that user or root can put them back ('{STOWAGE} doctor --repair')"
    )
}

/// Why the lend file at `path` keeps older release's loan lines.
fn older(path: &Path) -> String {
    let path = path.display();
    format!(
        "{path} holds an older release's loan lines, not acted on (any member may write it): its owner or root checks the modes they name, then removes them"
    )
}

/// Whether `uid` has a journal of loans with lines for the lend file at `path`.
pub fn has_loans(path: &Path, uid: u32) -> bool {
    let Ok(Some((dir, name))) = journal_of(path, uid, false) else {
        return false;
    };
    let journal = open_journal(&dir, &name, uid, libc::O_RDONLY, path);
    journal.is_ok_and(|j| j.is_some_and(|j| j.metadata().is_ok_and(|m| m.len() > 0)))
}

/// The uids whose journal for the lend file at `path` has lines, found by their `UID.loans`
/// directories beside it: the lend file names them too, but any member may write it, and an older
/// release rewriting it drops them.
fn journaled(path: &Path) -> Vec<u32> {
    let lenders = lenders_beside(path.parent().unwrap_or(path));
    lenders
        .into_iter()
        .filter(|uid| has_loans(path, *uid))
        .collect()
}

/// The uids with a `UID.loans` directory in `locks` (the lend files' directory): every lender.
pub fn lenders_beside(locks: &Path) -> Vec<u32> {
    let Ok(locks) = Dir::open_in_root(locks) else {
        return Vec::new();
    };
    let names = locks.names().unwrap_or_default();
    let uids = names.iter().filter_map(|n| {
        let uid = n.to_str()?.strip_suffix(".loans")?;
        uid.parse().ok()
    });
    uids.collect()
}

/// Why a restore by us would leave the loans the lend file at `path` names, found without acting
/// on them (`doctor` without `--repair`): another user's journal, an older release's lines.
/// `None` where it would put them back (or cannot tell).
pub fn left_why(path: &Path) -> Option<String> {
    let lend = lock::open_existing_read(path).ok()??;
    let (uids, old) = lend_lines(&lend).ok()?;
    let me = nix::unistd::geteuid().as_raw();
    let other = (uids.into_iter().chain(journaled(path)))
        .find(|u| me != 0 && *u != me && has_loans(path, *u));
    match other {
        Some(uid) => Some(theirs(uid)),
        None => (!old.is_empty()).then(|| older(path)),
    }
}

/// Restores `uid`'s journal for the lend file at `path` on the tree `top` where it is ours to (ours,
/// or we are root): whether loans are left in it (another's).
fn restore_journal(path: &Path, uid: u32, top: &Dir) -> io::Result<bool> {
    let me = nix::unistd::geteuid().as_raw();
    let ours = me == 0 || me == uid;
    let Some((dir, name)) = journal_of(path, uid, false)? else {
        return Ok(false);
    };
    let flags = if ours { libc::O_RDWR } else { libc::O_RDONLY };
    let Some(journal) = open_journal(&dir, &name, uid, flags, path)? else {
        return Ok(false);
    };
    if !ours {
        return Ok(journal.metadata()?.len() > 0);
    }
    let shown = journal_path(path, uid);
    empty_journal(&journal, uid, top)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", shown.display())))?;
    Ok(false)
}

/// Puts back every loan of `uid`'s journal on the tree `top`, last first, then empties it.
fn empty_journal(journal: &File, uid: u32, top: &Dir) -> io::Result<()> {
    lines_last_first(journal, |line| restore_line(line, top, uid))?;
    journal.set_len(0)?;
    journal.sync_data()
}

/// Puts back the loan journaled in `line` of `owner`'s journal where it is one (see [`restore`]).
fn restore_line(line: &str, top: &Dir, owner: u32) -> io::Result<()> {
    let w: Vec<&str> = line.split(' ').collect();
    let [was, lent, dev, ino, names] = w[..] else {
        return Ok(());
    };
    let num = |s: &str, radix| u64::from_str_radix(s, radix).ok();
    let (Some(was), Some(lent), Some(dev), Some(ino), Some(names)) = (
        num(was, 8),
        num(lent, 8),
        num(dev, 10),
        num(ino, 10),
        unhex(names),
    ) else {
        return Ok(());
    };
    // A loan adds owner read (and search) bits, and nothing else.
    let added = lent & !was;
    if lent > 0o7777 || was & !lent != 0 || added == 0 || added & !0o500 != 0 {
        return Ok(());
    }
    let inside = |n: &[u8]| !n.is_empty() && n != b"." && n != b"..";
    if !names.split(|b| *b == b'/').all(inside) {
        return Ok(());
    }
    // Gone (or a link now): no loan left there. Anything else (a directory on its path another
    // member made unsearchable) keeps the journal as it is, to be restored once it is reachable.
    let fd = match open_journaled(top, &names) {
        Ok(fd) => fd,
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)
            ) =>
        {
            return Ok(());
        }
        Err(e) if e.raw_os_error().is_none() => return Ok(()),
        Err(e) => {
            let shown = String::from_utf8_lossy(&names);
            return Err(io::Error::new(
                e.kind(),
                format!(
                    "cannot reach {shown:?} in the base to put its mode back ({e}): the loan stays journaled until it can be"
                ),
            ));
        }
    };
    let st = dir::fstat(&fd)?;
    // Another inode at that name now, a mode changed since by a writer, or an inode its journal's
    // owner could not have lent: not ours to set.
    if (st.st_dev, st.st_ino) != (dev, ino)
        || u64::from(st.st_mode & 0o7777) != lent
        || st.st_uid != owner
    {
        return Ok(());
    }
    dir::chmod_o_path(fd.as_raw_fd(), was as libc::mode_t)
}

/// Restores what a killed lender left journaled for the lend file at `path` on the tree `top`, if
/// no copy holds its lock now: whether it did.
pub fn restore_left(path: &Path, top: &Dir) -> io::Result<bool> {
    let Some(g) = lock::acquire_no_wait(path, Mode::Exclusive, IfMissing::Create)? else {
        return Ok(false);
    };
    restore(g.file(), path, top)?;
    // Kept, never acted on: any member may have written them (a loan counts only in its lender's
    // journal), so whether a mode they name is still lent is for its owner or root to judge.
    if !lend_lines(g.file())?.1.is_empty() {
        return Err(io::Error::other(older(path)));
    }
    Ok(true)
}

/// Ends the loans of a removed image: the journals its lend file `lend` (at `path`, held
/// exclusively) names are unlinked where we may, and the file emptied. Whether it is.
pub fn forget(lend: &File, path: &Path) -> bool {
    for uid in lenders(lend).unwrap_or_default() {
        if let Ok(Some((dir, name))) = journal_of(path, uid, false) {
            let _ = dir.unlink(OsStr::from_bytes(name.to_bytes()));
        }
    }
    lend.set_len(0).is_ok()
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
