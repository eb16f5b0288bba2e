//! Faithful copies of image trees, for `exec --write NEW --from BASE`.
//!
//! The copy keeps what a root filesystem needs: file types (regular files,
//! directories, symlinks, FIFOs, sockets, device nodes where permitted),
//! permission bits including setuid/setgid/sticky, ownership where
//! permitted, modification and access times, and hard links — two names for
//! one inode in the base are two names for one (new) inode in the copy.
//! Regular files are cloned with FICLONE where the filesystem can (btrfs,
//! XFS), so a clone costs no space; elsewhere they are copied.
//!
//! Invariants: nothing is ever followed. Sources are opened with
//! `O_NOFOLLOW`, symlinks are copied as links, the walk does not descend
//! through them, and every destination is created fresh (`O_EXCL`) inside the
//! new image's (empty) directory, so the copy cannot write outside it. No
//! inode is shared with the base.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// What a copy did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Copied {
    pub files: u64,
    pub bytes: u64,
    /// Files cloned with FICLONE (sharing extents with the base).
    pub reflinked: u64,
    /// Special files that could not be created (no permission).
    pub skipped_special: u64,
}

/// Reports progress; `None` when nothing should be shown.
pub trait Progress {
    /// Whether progress may be shown at all: if not, the copy does not walk
    /// the base an extra time to learn its total.
    fn shown(&self) -> bool;
    fn total(&mut self, bytes: u64);
    fn advance(&mut self, bytes: u64);
    fn finish(&mut self);
}

/// Copies the tree at `src` into the existing, empty directory `dst`.
pub fn copy_tree(src: &Path, dst: &Path, progress: &mut dyn Progress) -> Result<Copied> {
    if progress.shown() {
        let total: u64 = walkdir::WalkDir::new(src)
            .follow_links(false)
            .into_iter()
            .filter_map(|e| e.ok())
            .take_while(|_| crate::signals::cancelled().is_none())
            .filter(|e| e.file_type().is_file())
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.len())
            .sum();
        progress.total(total);
    }

    let mut out = Copied::default();
    let mut links: HashMap<(u64, u64), std::path::PathBuf> = HashMap::new();
    let mut reflink_works = true;
    // Directories get their mode and times after their contents are in
    // place: a read-only directory must stay writable while we fill it, and
    // writing into it would change its mtime.
    let mut dirs: Vec<(std::path::PathBuf, fs::Metadata)> = Vec::new();

    let root_meta =
        fs::symlink_metadata(src).with_context(|| format!("cannot read {}", src.display()))?;
    dirs.push((dst.to_owned(), root_meta));

    for entry in walkdir::WalkDir::new(src).follow_links(false).min_depth(1) {
        crate::signals::check()?;
        let entry = entry.with_context(|| format!("cannot walk {}", src.display()))?;
        let rel = entry
            .path()
            .strip_prefix(src)
            .expect("walk stays under src");
        let to = dst.join(rel);
        let meta = entry
            .metadata()
            .with_context(|| format!("cannot read {}", entry.path().display()))?;
        let ft = meta.file_type();
        let ctx = || format!("cannot copy {} to {}", entry.path().display(), to.display());
        if ft.is_dir() {
            fs::create_dir(&to).with_context(ctx)?;
            // Owner rwx while filling; the real mode is set at the end.
            fs::set_permissions(&to, fs::Permissions::from_mode(0o700)).with_context(ctx)?;
            dirs.push((to, meta));
            continue;
        }
        if meta.nlink() > 1 {
            if let Some(first) = links.get(&(meta.dev(), meta.ino())) {
                fs::hard_link(first, &to).with_context(ctx)?;
                continue;
            }
            links.insert((meta.dev(), meta.ino()), to.clone());
        }
        if ft.is_symlink() {
            let target = fs::read_link(entry.path()).with_context(ctx)?;
            std::os::unix::fs::symlink(&target, &to).with_context(ctx)?;
        } else if ft.is_file() {
            let reflinked =
                copy_file(entry.path(), &to, &meta, &mut reflink_works).with_context(ctx)?;
            out.files += 1;
            out.bytes += meta.len();
            out.reflinked += u64::from(reflinked);
            progress.advance(meta.len());
            if out.files == 1 {
                crate::debug::pause("clone-copying");
            }
        } else if ft.is_fifo() || ft.is_socket() || ft.is_char_device() || ft.is_block_device() {
            match mknod(&to, &meta) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                    out.skipped_special += 1;
                    continue;
                }
                Err(e) => return Err(e).with_context(ctx),
            }
        }
        set_owner_mode_times(&to, &meta, !ft.is_symlink()).with_context(ctx)?;
    }
    for (dir, meta) in dirs.iter().rev() {
        set_owner_mode_times(dir, meta, true)
            .with_context(|| format!("cannot set attributes of {}", dir.display()))?;
    }
    progress.finish();
    Ok(out)
}

/// Copies one regular file; returns whether it was reflinked.
fn copy_file(
    from: &Path,
    to: &Path,
    meta: &fs::Metadata,
    reflink_works: &mut bool,
) -> io::Result<bool> {
    let src = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(from)?;
    let mut dst = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(to)?;
    if *reflink_works && meta.len() > 0 {
        match reflink_copy::reflink_file(&src, &dst) {
            Ok(()) => return Ok(true),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::EXDEV | libc::EINVAL | libc::ENOTTY)
                ) =>
            {
                // This filesystem cannot clone; do not ask again.
                *reflink_works = false;
            }
            Err(e) => return Err(e),
        }
    }
    // std copies with copy_file_range(2) where it can (in-kernel, and
    // sparse-aware on some filesystems).
    io::copy(&mut &src, &mut dst)?;
    Ok(false)
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn mknod(to: &Path, meta: &fs::Metadata) -> io::Result<()> {
    let c = cpath(to)?;
    // SAFETY: plain mknod with a valid C string.
    let r = unsafe {
        libc::mknod(
            c.as_ptr(),
            meta.mode() as libc::mode_t,
            meta.rdev() as libc::dev_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Ownership (where permitted), mode and times, never following a symlink.
fn set_owner_mode_times(path: &Path, meta: &fs::Metadata, set_mode: bool) -> io::Result<()> {
    let c = cpath(path)?;
    // SAFETY: calls on a valid C string; no pointers are kept.
    unsafe {
        if libc::lchown(c.as_ptr(), meta.uid(), meta.gid()) != 0 {
            let e = io::Error::last_os_error();
            // An unprivileged user cannot give files away: keep our own.
            if e.raw_os_error() != Some(libc::EPERM) {
                return Err(e);
            }
        }
    }
    if set_mode {
        // After chown, which clears setuid/setgid bits.
        fs::set_permissions(path, fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    }
    let times = [
        libc::timespec {
            tv_sec: meta.atime() as libc::time_t,
            tv_nsec: meta.atime_nsec() as _,
        },
        libc::timespec {
            tv_sec: meta.mtime() as libc::time_t,
            tv_nsec: meta.mtime_nsec() as _,
        },
    ];
    // SAFETY: valid path and a two-element array, as utimensat requires.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A progress bar on stderr, shown only on a terminal and only once a copy
/// has taken longer than a moment.
pub struct Bar {
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    enabled: bool,
    total: u64,
    done: u64,
    label: String,
}

impl Bar {
    pub fn new(label: String, enabled: bool) -> Bar {
        Bar {
            bar: None,
            started: Instant::now(),
            enabled,
            total: 0,
            done: 0,
            label,
        }
    }
}

/// How long a copy runs before its progress is shown.
const SHOW_AFTER: Duration = Duration::from_millis(700);

impl Progress for Bar {
    fn shown(&self) -> bool {
        self.enabled
    }

    fn total(&mut self, bytes: u64) {
        self.total = bytes;
    }

    fn advance(&mut self, bytes: u64) {
        self.done += bytes;
        if self.bar.is_none() && self.enabled && self.started.elapsed() >= SHOW_AFTER {
            let bar = indicatif::ProgressBar::with_draw_target(
                Some(self.total),
                indicatif::ProgressDrawTarget::stderr(),
            );
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "stowage: {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
            ) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(self.label.clone());
            self.bar = Some(bar);
        }
        if let Some(b) = &self.bar {
            b.set_position(self.done);
        }
    }

    fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

/// No progress output.
pub struct Silent;

impl Progress for Silent {
    fn shown(&self) -> bool {
        false
    }
    fn total(&mut self, _: u64) {}
    fn advance(&mut self, _: u64) {}
    fn finish(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn copies_faithfully() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        let dst = d.path().join("dst");
        fs::create_dir_all(src.join("bin")).unwrap();
        fs::create_dir(&dst).unwrap();
        fs::write(src.join("bin/tool"), b"#!/bin/sh\n").unwrap();
        fs::set_permissions(src.join("bin/tool"), fs::Permissions::from_mode(0o4755)).unwrap();
        fs::hard_link(src.join("bin/tool"), src.join("bin/tool2")).unwrap();
        symlink("/etc/passwd", src.join("outside")).unwrap();
        symlink("bin", src.join("bin-link")).unwrap();
        fs::create_dir(src.join("ro")).unwrap();
        fs::write(src.join("ro/f"), b"x").unwrap();
        fs::set_permissions(src.join("ro"), fs::Permissions::from_mode(0o555)).unwrap();
        let fifo = cpath(&src.join("fifo")).unwrap();
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);

        let out = copy_tree(&src, &dst, &mut Silent).unwrap();
        assert_eq!(out.files, 2);

        let m = fs::metadata(dst.join("bin/tool")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o4755, "setuid and permission bits kept");
        let a = fs::metadata(dst.join("bin/tool")).unwrap();
        let b = fs::metadata(dst.join("bin/tool2")).unwrap();
        assert_eq!(a.ino(), b.ino(), "hard links stay hard links");
        assert_ne!(
            a.ino(),
            fs::metadata(src.join("bin/tool")).unwrap().ino(),
            "no inode shared with the base"
        );
        assert_eq!(
            fs::read_link(dst.join("outside")).unwrap(),
            Path::new("/etc/passwd")
        );
        assert!(
            fs::symlink_metadata(dst.join("bin-link"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(fs::metadata(dst.join("ro")).unwrap().mode() & 0o777, 0o555);
        assert_eq!(fs::read(dst.join("ro/f")).unwrap(), b"x");
        assert!(
            fs::symlink_metadata(dst.join("fifo"))
                .unwrap()
                .file_type()
                .is_fifo()
        );
        assert_eq!(
            fs::metadata(dst.join("bin/tool")).unwrap().mtime(),
            fs::metadata(src.join("bin/tool")).unwrap().mtime()
        );
        // Let the tempdir clean up.
        fs::set_permissions(src.join("ro"), fs::Permissions::from_mode(0o755)).unwrap();
        fs::set_permissions(dst.join("ro"), fs::Permissions::from_mode(0o755)).unwrap();
    }
}
