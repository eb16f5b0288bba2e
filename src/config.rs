//! The store's configuration, `ROOT/store.conf`: the one home of where trees go and the store's id.
//!
//! ```text
//! stowage-store 1
//! id=5e1f00d2c0ffee0123456789abcdef01
//! images=default            (ROOT/img, as each process names the root)
//! images=/abs/ch/img        (init --images-dir)
//! identity=1234@ef53@9a1b   (the images directory's inode@fstype@fsid:
//!                            an unmounted one is not taken for empty)
//! root=77@ef53@9a1b          (the root's: a copied or moved store is
//!                            told from a mount)
//! adopting=ready             (init adopts the trees it found as ready:
//!                            one interrupted is finished so, not taken
//!                            for a managed store's leftovers)
//! ```
//!
//! - Written whole and renamed into place through the root's descriptor (under the store-wide lock
//!   when the images directory switches): a reader sees the old file or the new one.
//! - A change is made to the file read afresh ([`update`]), never to a copy read earlier.
//! - Read through the root's descriptor, only as a regular file: a planted FIFO hangs no command.
//! - Missing: a store from before this file (`migrate.rs`), or none yet.

use anyhow::{Context, Result};

use crate::dir::Dir;
use crate::image_record::ImagesDir;

const FORMAT: &str = "stowage-store 1\n";
/// The first line's words before its format number.
const FORMAT_WORD: &str = "stowage-store ";
pub const FILE: &str = "store.conf";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Random, made with the store.
    pub id: String,
    pub images: ImagesDir,
    /// The images directory's identity (`Dir::identity`), once known.
    pub identity: Option<String>,
    /// The root's identity when the images directory's was recorded: a root no longer that
    /// directory is a copied or moved store, whose default images directory came with it.
    pub root: Option<String>,
    /// `init` is adopting, as `ready`, the trees a builder left before stowage managed them.
    pub adopting: bool,
}

impl Config {
    /// The configuration of a new store: a fresh id, the default images directory.
    pub fn fresh() -> Config {
        Config {
            id: random_id(),
            images: ImagesDir::Default,
            identity: None,
            root: None,
            adopting: false,
        }
    }

    fn encode(&self) -> String {
        let images = match &self.images {
            ImagesDir::Default => "default".to_owned(),
            ImagesDir::External(p) => p.display().to_string(),
        };
        let mut text = format!("{FORMAT}id={}\nimages={images}\n", self.id);
        for (key, value) in [("identity", &self.identity), ("root", &self.root)] {
            if let Some(v) = value {
                text.push_str(&format!("{key}={v}\n"));
            }
        }
        if self.adopting {
            text.push_str("adopting=ready\n");
        }
        text
    }

    fn decode(text: &str) -> Option<Config> {
        let (mut id, mut images, mut identity, mut root) = (None, None, None, None);
        let mut adopting = false;
        // At '\n' only: `lines()` would drop a path's trailing '\r'.
        for line in text.strip_prefix(FORMAT)?.split_terminator('\n') {
            match line.split_once('=')? {
                ("id", v) if !v.is_empty() => id = Some(v.to_owned()),
                ("images", v) => images = ImagesDir::decode(v).or(images),
                ("identity", v) if !v.is_empty() => identity = Some(v.to_owned()),
                ("root", v) if !v.is_empty() => root = Some(v.to_owned()),
                ("adopting", v) => adopting = v == "ready",
                _ => {}
            }
        }
        Some(Config {
            id: id?,
            images: images?,
            identity,
            root,
            adopting,
        })
    }
}

/// Whether the root (its descriptor) has a configuration: a store of this release.
pub fn exists(dir: &Dir) -> bool {
    !matches!(dir.stat_at(FILE), Ok(None))
}

/// Reads the configuration through the root's descriptor (`root_dir` names it); `Ok(None)`: none.
pub fn read(root_dir: &std::path::Path, dir: &Dir) -> Result<Option<Config>> {
    let path = root_dir.join(FILE);
    let mut read = read_file(dir);
    // Replaced by another host (a new one renamed in) since this client looked its name up, the
    // file opened is gone on the server, a stale handle: a fresh open finds the new one.
    if let Err(e) | Ok(Some((_, Err(e)))) = &read
        && e.raw_os_error() == Some(libc::ESTALE)
    {
        read = read_file(dir);
    }
    let (file, data) = match read {
        Ok(Some(read)) => read,
        Ok(None) => return Ok(None),
        Err(e) => return Err(Unusable::because(&path, e)),
    };
    // What it is is asked only when the read finds no format (a FIFO reads empty, a dir fails).
    let not_a_file = |e: anyhow::Error| match crate::planted::check(&path, &file) {
        Err(planted) => Unusable::because(&path, planted),
        Ok(()) => e,
    };
    let data = data.map_err(|e| not_a_file(Unusable::because(&path, e)))?;
    let text = String::from_utf8_lossy(&data);
    if let Some(format) = crate::error::newer_format(&text, FORMAT_WORD, 1) {
        let root = root_dir.to_path_buf();
        let what = format!("{FILE} format {format}");
        return Err(crate::Error::Newer { root, what }.into());
    }
    let why = format!("{} is damaged", path.display());
    let config = Config::decode(&text);
    Ok(Some(
        config.ok_or_else(|| not_a_file(Unusable { why }.into()))?,
    ))
}

/// The configuration file opened (`None`: there is none), and what one read of it gave.
type Read = Option<(std::fs::File, std::io::Result<Vec<u8>>)>;

/// The configuration file opened through the root's descriptor and read once (64 KiB at most: more
/// is no configuration).
fn read_file(dir: &Dir) -> std::io::Result<Read> {
    let file = match dir.open_read_unchecked(FILE) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut buf = vec![0u8; 64 * 1024];
    let data = std::os::unix::fs::FileExt::read_at(&file, &mut buf, 0).map(|n| {
        buf.truncate(n);
        buf
    });
    Ok(Some((file, data)))
}

/// The configuration exists but is not its format, or is no regular file: only then is it set
/// aside. One that could not be read (a lost connection, EIO, EACCES) may be sound: that error is
/// said as it is.
#[derive(Debug, thiserror::Error)]
#[error(
    "{why}; {} sets it aside and writes it anew from the images' records",
    crate::ident::Hint("'stowage doctor --repair'")
)]
pub struct Unusable {
    /// What is wrong with it, naming it.
    pub why: String,
}

impl Unusable {
    /// The error for `e`, met opening or reading `path`: [`Unusable`] if something other than a
    /// regular file is there, else the I/O error naming the file.
    fn because(path: &std::path::Path, e: std::io::Error) -> anyhow::Error {
        let e = crate::planted::at(path, e);
        match crate::planted::find(&e) {
            Some(n) => {
                let why = format!("{} is {}, not a regular file", n.path.display(), n.kind);
                Unusable { why }.into()
            }
            None => anyhow::Error::new(e).context(format!("cannot read {}", path.display())),
        }
    }
}

/// Replaces the configuration: written beside, synced, renamed into place.
pub fn write(root_dir: &std::path::Path, dir: &Dir, config: &Config) -> Result<()> {
    put(root_dir, dir, config, |tmp| dir.rename_to(tmp, dir, FILE))
}

/// Reads the configuration afresh, changes it by `change` and writes it if that changed it: the
/// caller holds the global lock, which every such change takes (`images_dir::update_config`).
pub fn update(
    root_dir: &std::path::Path,
    dir: &Dir,
    change: impl FnOnce(&mut Config),
) -> Result<()> {
    let Some(was) = read(root_dir, dir)? else {
        return Ok(());
    };
    let mut now = was.clone();
    change(&mut now);
    if now == was {
        return Ok(());
    }
    write(root_dir, dir, &now)
}

/// Makes the configuration of a new store unless one is there (two first uses keep one identity):
/// linked into place, which fails if the name exists.
pub fn create(root_dir: &std::path::Path, dir: &Dir, config: &Config) -> Result<()> {
    put(root_dir, dir, config, |tmp| match dir.link_to(tmp, FILE) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(e),
        _ => dir.unlink(tmp),
    })
}

fn put(
    root_dir: &std::path::Path,
    dir: &Dir,
    config: &Config,
    place: impl FnOnce(&str) -> std::io::Result<()>,
) -> Result<()> {
    let path = root_dir.join(FILE);
    let tmp = format!(".{FILE}.{}.{}", std::process::id(), random_id());
    let written = (|| {
        let f = dir.create_file(&tmp, 0o666)?;
        std::io::Write::write_all(&mut &f, config.encode().as_bytes())?;
        f.sync_all()?;
        place(&tmp)
    })();
    if written.is_err() {
        let _ = dir.unlink(&tmp);
    }
    written.with_context(|| format!("cannot write {}", path.display()))
}

fn random_id() -> String {
    let nonce = crate::ident::nonce;
    format!("{:016x}{:016x}", nonce(), nonce())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_that_failed_is_its_cause_never_advice_to_set_the_file_aside() {
        let path = std::path::Path::new("/s/store.conf");
        for errno in [
            libc::ENOTCONN,
            libc::EBADFD,
            libc::EIO,
            libc::ETIMEDOUT,
            libc::EACCES,
        ] {
            let e = Unusable::because(path, std::io::Error::from_raw_os_error(errno));
            assert!(e.downcast_ref::<Unusable>().is_none(), "{e:#}");
            let said = format!("{e:#}");
            assert!(said.starts_with("cannot read /s/store.conf: "), "{said}");
            assert!(!said.contains("doctor"), "{said}");
        }
    }

    #[test]
    fn reads_back_and_refuses_what_is_not_its_format() {
        for images in [ImagesDir::Default, ImagesDir::External("/s/img".into())] {
            let c = Config {
                id: "ab".into(),
                images,
                identity: Some("2@ef53".into()),
                root: Some("7@ef53@1".into()),
                adopting: true,
            };
            assert_eq!(Config::decode(&c.encode()), Some(c));
        }
        assert_eq!(Config::decode("junk"), None);
        assert_eq!(Config::decode("stowage-store 1\nid=x\nimages=rel\n"), None);
    }

    #[test]
    fn ids_are_fresh() {
        assert_ne!(random_id(), random_id());
        assert_eq!(random_id().len(), 32);
    }
}
