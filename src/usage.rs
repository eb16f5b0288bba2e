//! Disk usage of an image tree, as gc and `images` count it: allocated
//! blocks (so sparse files and reflinked copies count what they really
//! use), each hard-linked inode once, symlinks as themselves (never
//! followed), and never crossing into another filesystem.

use std::collections::HashSet;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Bytes allocated under `dir`. A missing directory uses nothing.
pub fn disk_usage(dir: &Path) -> io::Result<u64> {
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    let mut total = 0u64;
    let walk = walkdir::WalkDir::new(dir)
        .follow_links(false)
        .same_file_system(true);
    for entry in walk {
        crate::signals::check().map_err(|e| io::Error::new(io::ErrorKind::Interrupted, e))?;
        let entry = match entry {
            Ok(e) => e,
            Err(e)
                if e.io_error()
                    .is_some_and(|io| io.kind() == io::ErrorKind::NotFound) =>
            {
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let meta = entry.metadata().map_err(io::Error::from)?;
        if meta.nlink() > 1 && !meta.is_dir() && !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        total += meta.blocks() * 512;
    }
    Ok(total)
}

/// "1.5 GiB" — for tables.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn counts_hard_links_once_and_skips_symlink_targets() {
        let d = tempfile::tempdir().unwrap();
        let big = d.path().join("big");
        fs::write(&big, vec![1u8; 1 << 20]).unwrap();
        let one = disk_usage(d.path()).unwrap();
        fs::hard_link(&big, d.path().join("again")).unwrap();
        assert_eq!(disk_usage(d.path()).unwrap(), one);
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("huge"), vec![1u8; 4 << 20]).unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("link")).unwrap();
        assert!(disk_usage(d.path()).unwrap() < one + 64 * 1024);
        assert!(one >= 1 << 20);
    }

    #[test]
    fn missing_dir_is_empty() {
        assert_eq!(
            disk_usage(Path::new("/nonexistent/stowage-test")).unwrap(),
            0
        );
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
    }
}
