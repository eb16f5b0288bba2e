//! The storage root: where it is and what lives in it (the layout: docs/design.md, "Layout").
//!
//! - An external images directory (`init --images-dir`) holds image trees only, never a file of
//!   stowage's own.
//! - Directories are made lazily, when first needed: `exec`'s fast path makes no mkdir calls.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::dir::Dir;
use crate::ident::STOWAGE;
use crate::name::ImageName;
use crate::planted;

#[derive(Debug, Clone, Default)]
pub struct Root {
    dir: PathBuf,
    /// The default root, `/var/tmp/$USER.stowage`: it must be the user's own (anyone may create
    /// that name in /var/tmp before its user does).
    default: bool,
    /// The root's device, once [`Root::check`] has looked at it.
    dev: Option<u64>,
    /// The root's filesystem, once [`Root::check_locking`] has looked at it (every lock file's).
    fs: Option<crate::filesystem::Filesystem>,
    /// The root, opened and its owner checked once, on first use; and its inode, fixed for its life.
    opened: std::sync::Arc<std::sync::OnceLock<(Dir, u64)>>,
    /// That descriptor's identity: its inode's, fixed for its life.
    identity: std::sync::Arc<std::sync::OnceLock<String>>,
    /// A descriptor kept in reserve from before this process may create a lock file: a start that
    /// fails out of descriptors lets it go to open the directory it unlinks that file from.
    spare: std::sync::Arc<std::sync::Mutex<Option<std::os::fd::OwnedFd>>>,
    /// The configuration read to refuse a later release's store before a new image's lock file is
    /// made ([`Root::refuse_newer_config`]), for that image's start: one read serves both.
    config_read: std::sync::Arc<std::sync::Mutex<Option<crate::config::Config>>>,
}

/// What the image lock files tell of the release that used a store last ([`Root::records_tell`]).
enum Told {
    OwnUse,
    /// An older release's tokens, and no record of this release's own use; the images directories
    /// the records a migration wrote beside them name.
    Tokens(Vec<crate::image_record::ImagesDir>),
    Nothing,
}

/// The layout's paths, each `ROOT/REL`.
macro_rules! layout_paths {
    ($($(#[$doc:meta])* $name:ident => $rel:literal,)*) => {
        impl Root {
            $($(#[$doc])* pub fn $name(&self) -> PathBuf {
                self.dir.join($rel)
            })*
        }
    };
}

layout_paths! {
    db => "stowage.db",
    locks => "locks",
    global_lock => "locks/global.lock",
    image_locks => "locks/images",
    slot_locks => "locks/slots",
    /// Holder leases (`lease.rs`).
    leases => "locks/leases",
    default_images_dir => "img",
    trash => "trash",
    /// Space kept in reserve for the metadata (`space.rs`).
    reserve => "reserve",
    /// The lock of a store-wide hold (`store_wide.rs`), `locks/` + [`Root::STORE_WIDE_LOCK_REL`].
    store_wide_lock => "locks/store.lock",
    /// Held by a gc that removes, for its whole run (`gc.rs`), `locks/` + [`Root::GC_LOCK_REL`].
    gc_lock => "locks/gc.lock",
}

impl Root {
    /// `--root`, else `$STOWAGE_ROOT`, else `/var/tmp/$USER.stowage`.
    pub fn resolve(flag: Option<&Path>) -> Result<Root> {
        let env = std::env::var_os(crate::env::ROOT).filter(|_| flag.is_none());
        // Set but empty is a wrapper's unset variable, as `--root ""` is: never the default root.
        if env.as_ref().is_some_and(|d| d.is_empty()) {
            let e = "STOWAGE_ROOT is set but empty (is a variable unset? unset STOWAGE_ROOT for the default root)";
            return Err(crate::Error::Usage(e.to_owned()).into());
        }
        // Only blanks: a variable unset inside quotes, never a directory of blanks in the cwd.
        let blank = |d: &std::ffi::OsStr| d.as_encoded_bytes().iter().all(u8::is_ascii_whitespace);
        let given = flag.map(Path::as_os_str).or(env.as_deref());
        if given.is_some_and(|d| !d.is_empty() && blank(d)) {
            let from = flag.map_or("STOWAGE_ROOT", |_| "--root");
            let e = format!("{from}: the root given is only blanks (is a variable unset?)");
            return Err(crate::Error::Usage(e).into());
        }
        if let Some(flag) = flag {
            crate::ident::root_given(flag);
        }
        let named = flag.map(Path::to_owned).or_else(|| env.map(PathBuf::from));
        let default = named.is_none();
        let dir = named
            .unwrap_or_else(|| format!("/var/tmp/{}.stowage", crate::ident::user_name()).into());
        let absolute = std::path::absolute(&dir)
            .with_context(|| format!("cannot resolve root {}", dir.display()))?;
        Ok(Root {
            dir: as_named(&absolute),
            default,
            ..Default::default()
        })
    }

    /// A root at `dir`, for a library caller: its path made canonical, as [`Root::check`] does.
    pub fn at(dir: impl Into<PathBuf>) -> Root {
        let dir: PathBuf = dir.into();
        let dir = fs::canonicalize(&dir)
            .or_else(|_| real_path(&dir))
            .unwrap_or(dir);
        Root {
            dir,
            ..Default::default()
        }
    }

    /// Whether the root directory exists (a symlink to one counts).
    pub fn exists(&self) -> bool {
        self.dir.is_dir()
    }

    /// Whether a store's layout is here, seen from outside: its configuration, its catalog, or its
    /// image locks' directory (which outlives a lost configuration; a `locks` may be anyone's).
    pub fn has_layout(&self) -> bool {
        self.any_of([Self::IMAGE_LOCKS_REL, crate::config::FILE, "stowage.db"])
    }

    /// Whether a store lives here: one of its first-made parts (the `locks` directory, the
    /// configuration, an old release's catalog) is there. One lstat in a store. A file named
    /// `locks` alone is anyone's (a project's notes): taken for a store's, a repair would make one.
    pub fn holds_store(&self) -> bool {
        let locks = fs::symlink_metadata(self.dir.join("locks"));
        locks.is_ok_and(|m| m.is_dir()) || self.any_of([crate::config::FILE, "stowage.db"])
    }

    /// For a lock that could not be had: where no store is here but something not stowage's is at
    /// `locks` (a project's file), the root's refusal (66), for which no repair is offered.
    pub fn foreign_locks(&self) -> Option<anyhow::Error> {
        let locks = fs::symlink_metadata(self.dir.join("locks"));
        let foreign = locks.is_ok_and(|m| !m.is_dir()) && !self.holds_store();
        foreign.then(|| self.no_store().into())
    }

    fn any_of<const N: usize>(&self, names: [&str; N]) -> bool {
        (names.iter()).any(|n| fs::symlink_metadata(self.dir.join(n)).is_ok())
    }

    /// A store a later release made is refused whole ([`crate::Error::Newer`], from its
    /// configuration; its catalog's schema is `catalog::refuse_newer`'s); any other trouble with
    /// that file is left to the command that uses it.
    pub fn refuse_newer(&self) -> Result<()> {
        self.newer_config().map(drop)
    }

    /// [`Root::refuse_newer`] by the configuration alone, before a new image's lock file is made:
    /// what it read is kept for the image's start ([`Root::take_config_read`]), which would read it
    /// anyway, so a new image pays no read more for the check.
    pub fn refuse_newer_config(&self) -> Result<()> {
        let read = self.newer_config()?;
        *self.config_read.lock().unwrap_or_else(|e| e.into_inner()) = read;
        Ok(())
    }

    /// The configuration [`Root::refuse_newer_config`] read, once.
    pub fn take_config_read(&self) -> Option<crate::config::Config> {
        (self.config_read.lock().unwrap_or_else(|e| e.into_inner())).take()
    }

    /// The configuration, refused if a later release's; `None` if missing or of other trouble.
    fn newer_config(&self) -> Result<Option<crate::config::Config>> {
        let Ok(dir) = self.opened() else {
            return Ok(None);
        };
        match crate::config::read(&self.dir, dir) {
            Err(e) if crate::error::is_newer(&e) => Err(e),
            read => Ok(read.ok().flatten()),
        }
    }

    /// For a command that only reads: a store is here, else why not (66), nothing created. A lookup
    /// refused in the root (a mode, a client reconnecting) says nothing of whether a store is
    /// there, and is said as itself, never as "holds no store".
    pub fn require_store(&self) -> Result<()> {
        if self.holds_store() {
            return Ok(());
        } else if !self.exists() {
            let (dir, refused) = (self.dir.clone(), None);
            return Err(crate::Error::NoRoot { dir, refused }.into());
        }
        let e = match fs::symlink_metadata(self.dir.join("locks")) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => e,
            _ => return Err(self.no_store().into()),
        };
        let shown = self.dir.display();
        let mode = fs::metadata(&self.dir).map(|m| (m.mode() & 0o7777, m.uid()));
        let me = nix::unistd::geteuid().as_raw();
        match mode {
            Ok((mode, uid)) if e.kind() == io::ErrorKind::PermissionDenied && uid == me => {
                let fix = format!("'chmod u+rwx {shown}' gives it back");
                anyhow::bail!(
                    "cannot look into the root: {shown} is mode {mode:03o}, which keeps you, its owner, out; {fix}"
                )
            }
            Ok((mode, uid)) => {
                anyhow::bail!("cannot look into root {shown} (mode {mode:03o}, uid {uid}'s): {e}")
            }
            _ => anyhow::bail!("cannot look into root {shown}: {e}"),
        }
    }

    /// The root holds no store: what it holds that no store's making puts there, if anything
    /// (another maker's half-made layout is no reason to refuse).
    fn no_store(&self) -> crate::Error {
        // A `locks` that is no directory is no part either, and named first: `init` refuses it.
        let foreign_locks = fs::symlink_metadata(self.dir.join("locks")).is_ok_and(|m| !m.is_dir());
        let held = fs::read_dir(&self.dir).ok().and_then(|entries| {
            let name = entries
                .flatten()
                .map(|e| e.file_name())
                .find(|n| !Self::is_layout_part(&n.to_string_lossy()));
            let name = if foreign_locks { "locks".into() } else { name? };
            Some(crate::ident::printable(&name.to_string_lossy()).into_owned())
        });
        crate::Error::NotAStore {
            dir: self.dir.clone(),
            held,
            refused: None,
        }
    }

    /// The root directory's identity, through its open descriptor (no duplicate made), asked once.
    pub fn identity(&self) -> Result<String> {
        if let Some(id) = self.identity.get() {
            return Ok(id.clone());
        }
        self.opened()?;
        let (d, ino) = self.opened.get().expect("opened above");
        let id = d
            .identity_of(*ino)
            .with_context(|| format!("cannot inspect root {}", self.dir.display()))?;
        Ok(self.identity.get_or_init(|| id).clone())
    }

    /// Opens the root directory, its ownership checked again on the descriptor.
    pub fn open(&self) -> Result<Dir> {
        let cannot = || format!("cannot open root {}", self.dir.display());
        self.opened()?.duplicate().with_context(cannot)
    }

    /// The root directory's one descriptor ([`Root::open`]), lent: nothing duplicated or closed.
    pub fn opened(&self) -> Result<&Dir> {
        if let Some((d, _)) = self.opened.get() {
            return Ok(d);
        }
        let cannot = || format!("cannot open root {}", self.dir.display());
        let d = Dir::anchor(&self.dir).with_context(cannot)?;
        let st = d
            .stat()
            .with_context(|| format!("cannot inspect root {}", self.dir.display()))?;
        self.check_owner(st.uid, st.mode, st.gid)?;
        Ok(&self.opened.get_or_init(|| (d, st.ino)).0)
    }

    /// Opens `ROOT/NAME` (e.g. `trash`, `locks/images`), one component at a time, refusing a
    /// symlink or anything else that is not a directory in the place of any of them.
    pub fn open_sub(&self, name: &str) -> Result<Dir> {
        Ok(self
            .walk_sub(name, false)?
            .expect("a missing component is an error"))
    }

    /// [`Root::open_sub`], or `None` if a component is missing (a layout not made yet): what is
    /// planted in a directory's place is an error naming it, never taken for "nothing there".
    pub fn open_sub_if_there(&self, name: &str) -> Result<Option<Dir>> {
        self.walk_sub(name, true)
    }

    fn walk_sub(&self, name: &str, missing_ok: bool) -> Result<Option<Dir>> {
        let root = self.opened()?;
        let (mut d, mut at) = (None::<Dir>, self.dir.clone());
        for part in name.split('/') {
            at.push(part);
            d = match d.as_ref().unwrap_or(root).sub(part) {
                Ok(d) => Some(d),
                Err(e) if missing_ok && e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(not_a_dir(&at, e)),
            };
        }
        Ok(Some(d.expect("a name has a part")))
    }

    /// Fails, naming it, if something is planted in the place of the directory of image locks or of
    /// slots (not to be taken for an empty store); in the leases' place, `say` is told.
    pub fn check_lock_dirs(&self, say: impl Fn(&str)) -> Result<()> {
        let Some(locks) = self.open_sub_if_there(Self::LOCKS_REL)? else {
            return Ok(());
        };
        // Opened, not only looked at: one we may not list must not read as empty either.
        let usable = |name: &str| match locks.sub(name) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                Err(not_a_dir(&self.locks().join(name), e))
            }
            _ => Ok(()),
        };
        usable("images")?;
        usable("slots")?;
        if let Err(e) = usable("leases") {
            say(&format!(
                "{e:#} (holders are shown without what their leases say)"
            ));
        }
        Ok(())
    }

    /// Like [`Root::open_sub`] for a directory directly in the root, which is created if missing.
    pub fn open_or_make_sub(&self, name: &str) -> Result<Dir> {
        let root = self.open()?;
        let at = self.dir.join(name);
        match root.sub(name) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => mkdir_in(&root, name, &at)?,
            other => return other.map_err(|e| not_a_dir(&at, e)),
        };
        root.sub(name).map_err(|e| not_a_dir(&at, e))
    }

    /// The trash, made if missing, refused unless it is the store's own ([`Root::check_trash`]).
    pub fn open_trash(&self) -> Result<Dir> {
        let trash = self.open_or_make_sub("trash")?;
        self.check_trash(&trash)?;
        Ok(trash)
    }

    /// Refuses the trash opened as `trash` unless on the root's own mount (a filesystem mounted on
    /// its place is not the store's) and used by no store (its images directory, as a release that
    /// let `init` take it made it; or its root): a removal's walk there would delete what it holds.
    pub fn check_trash(&self, trash: &Dir) -> Result<()> {
        self.refuse_other_mount(trash, &self.trash())?;
        if let Some(what) = in_use_by_a_store(trash) {
            let at = self.trash();
            anyhow::bail!(
                "{} is {what}, not this store's trash: nothing in it is moved or deleted (give that store an images directory of its own)",
                at.display()
            );
        }
        Ok(())
    }

    /// Refuses `d` (the layout's directory at `path`) unless it is on the root's own mount (where
    /// either mount id cannot be told, as it is).
    pub fn refuse_other_mount(&self, d: &Dir, path: &Path) -> Result<()> {
        let root = self.open()?;
        if let (Ok(Some(here)), Ok(Some(ours))) = (d.mount_id(), root.mount_id())
            && here != ours
        {
            let at = path.display();
            anyhow::bail!(
                "{at} is another filesystem mounted there, not the store's: nothing in it is moved or deleted (unmount it)"
            );
        }
        Ok(())
    }

    /// Unlinks a lock file we hold exclusively, only the very file we locked, after marking it gone
    /// (`lock::acquire_no_wait_with`). Kept on a filesystem not known to be local.
    pub fn unlink_lock(&self, guard: crate::lock::Guard) -> Result<()> {
        let path = guard.path().to_owned();
        if !crate::lock::unlinks_allowed(&path) {
            return Ok(());
        }
        let rel = path.strip_prefix(&self.dir).ok();
        let (Some(parent), Some(file)) =
            (rel.and_then(Path::parent), rel.and_then(Path::file_name))
        else {
            anyhow::bail!("lock file {} is not in the root", path.display());
        };
        let parent = parent.to_str().with_context(|| {
            format!("lock file {} has a name that is not UTF-8", path.display())
        })?;
        let dir = match self.open_sub(parent) {
            // Out of descriptors (a start failed for it): the spare makes room for this one,
            // the directory opened by its path as the lock file was, in one step.
            Err(e) if out_of_descriptors(&e) && self.let_go_spare() => {
                Dir::open_in_root(&self.dir.join(parent))?
            }
            other => other?,
        };
        let (dev, ino) = guard.identity();
        crate::lock::mark_gone(guard.file())
            .with_context(|| format!("cannot mark {} gone before unlinking it", path.display()))?;
        dir.unlink_if(file, dev, ino)
            .with_context(|| format!("cannot unlink {}", path.display()))
    }

    /// Keeps a spare descriptor (see `spare`) if none is kept yet: a duplicate of stderr's, which
    /// is always open (the runtime opens `/dev/null` for a closed one), asking no filesystem.
    pub fn keep_spare(&self) -> io::Result<()> {
        use std::os::fd::AsFd;
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        if spare.is_none() {
            *spare = Some(io::stderr().as_fd().try_clone_to_owned()?);
        }
        Ok(())
    }

    /// Lets the spare descriptor go: whether one was kept.
    fn let_go_spare(&self) -> bool {
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        spare.take().is_some()
    }

    /// The image has no record any more: its lock file is emptied (synced) and unlinked where
    /// allowed, and its gate if nobody is passing it.
    /// Why the emptied lock file is left, if it is: it names no image, so the image is gone.
    pub fn drop_record(
        &self,
        name: &ImageName,
        guard: crate::lock::Guard,
    ) -> Result<Option<String>> {
        crate::image_record::clear(guard.file())
            .with_context(|| format!("cannot empty {}", guard.path().display()))?;
        let left = self.unlink_lock(guard).err();
        self.unlink_gate(name);
        // Its tree is gone, and with it what a killed copy left lent.
        let lend = self.image_lend(name);
        self.unlink_if_free(&lend, |f| crate::loan::forget(f, &lend));
        Ok(left.map(|e| format!("{e:#}")))
    }

    /// Unlinks the lock file at `path` if, under its exclusive lock taken without waiting, it names
    /// nothing (no record, hint or last use).
    pub fn unlink_if_empty(&self, path: &Path) -> bool {
        self.unlink_if_free(path, |f| {
            crate::image_record::read(f).is_ok_and(|s| s.names_nothing())
        })
    }

    /// Unlinks an image's gate under its own exclusive lock; kept while someone is passing it.
    pub fn unlink_gate(&self, name: &ImageName) {
        self.unlink_if_free(&self.image_gate(name), |_| true);
    }

    /// Unlinks the lock file at `path` if its exclusive lock is free and `unused` says so of it.
    fn unlink_if_free(&self, path: &Path, unused: impl FnOnce(&fs::File) -> bool) -> bool {
        let (mode, missing) = (crate::lock::Mode::Exclusive, crate::lock::IfMissing::Fail);
        let Ok(Some(g)) = crate::lock::acquire_no_wait(path, mode, missing) else {
            return false;
        };
        unused(g.file()) && self.unlink_lock(g).is_ok()
    }

    /// Opens images directory `dir` (the default via the root's descriptor), refusing a symlink.
    pub fn open_images_dir(&self, dir: &Path) -> Result<Dir> {
        if dir == self.default_images_dir() {
            self.open_sub("img")
        } else {
            Dir::open_nofollow(dir).map_err(|e| not_a_dir(dir, e))
        }
    }

    /// [`Root::open_or_make_images_dir`] as an anchor (`Dir::anchor`), for a new image's `mkdirat`.
    pub fn anchor_images_dir(&self, dir: &Path, make: bool) -> Result<Dir> {
        if dir != self.default_images_dir() {
            return Dir::anchor_nofollow(dir).map_err(|e| not_a_dir(dir, e));
        }
        let root = self.opened()?;
        match root.anchor_sub("img") {
            Err(e) if e.kind() == io::ErrorKind::NotFound && make => {
                self.open_or_make_sub("img")?;
                root.anchor_sub("img")
            }
            other => other,
        }
        .map_err(|e| not_a_dir(dir, e))
    }

    /// [`Root::open_images_dir`], making the default one if missing (not a configured one) and
    /// `make`: only while none is recorded. One made where another was recorded would stand in its
    /// place, and be in the way of putting it back.
    pub fn open_or_make_images_dir(&self, dir: &Path, make: bool) -> Result<Dir> {
        if make && dir == self.default_images_dir() {
            self.open_or_make_sub("img")
        } else {
            self.open_images_dir(dir)
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a look asks about locks by query, not try-lock ([`crate::lock::look`]).
    pub fn lock_queries(&self) -> bool {
        self.fs.as_ref().is_some_and(|f| f.queries_see_flocks)
    }

    /// The root's filesystem, if [`Root::check_locking`] found it.
    pub fn filesystem(&self) -> Option<&crate::filesystem::Filesystem> {
        self.fs.as_ref()
    }

    /// [`Root::filesystem`], or, if not found yet, what a statfs of the root says now.
    pub fn filesystem_now(&self) -> Option<crate::filesystem::Filesystem> {
        self.fs
            .clone()
            .or_else(|| crate::filesystem::filesystem(&self.dir).ok())
    }

    pub fn image_lock(&self, name: &ImageName) -> PathBuf {
        self.image_locks().join(lock_file_name(name.encoded()))
    }

    /// The image's gate, held by a waiting writer so new readers queue behind (`acquire/image.rs`).
    pub fn image_gate(&self, name: &ImageName) -> PathBuf {
        self.image_locks().join(named(name.encoded(), ".gate"))
    }

    /// The image's lend lock and journal, held by copies of it (`loan.rs`).
    pub fn image_lend(&self, name: &ImageName) -> PathBuf {
        self.image_locks().join(named(name.encoded(), ".lend"))
    }

    /// The relative name of an image's lock file under `locks/`, as holder records name it.
    pub fn image_lock_rel(name: &ImageName) -> String {
        format!("images/{}", lock_file_name(name.encoded()))
    }

    /// A slot class's directory: `locks/slots/ENC` (`/` → `%`).
    pub fn slot_class_dir(&self, class: &str) -> PathBuf {
        self.dir.join(Self::slot_class_rel(class))
    }

    /// [`Root::slot_class_dir`] relative to the root.
    pub fn slot_class_rel(class: &str) -> String {
        format!("locks/slots/{}", class.replace('/', "%"))
    }

    /// [`Root::store_wide_lock`] relative to `locks/`, as records name it.
    pub const STORE_WIDE_LOCK_REL: &'static str = "store.lock";
    /// [`Root::gc_lock`] relative to `locks/`, as leases name it.
    pub const GC_LOCK_REL: &'static str = "gc.lock";
    /// `locks/` and `locks/images/` relative to the root, to open through the root's descriptor.
    pub const LOCKS_REL: &'static str = "locks";
    /// The directories of the layout, parents first.
    pub const LAYOUT_DIRS: [&'static str; 6] = [
        "locks",
        "locks/images",
        "locks/slots",
        "locks/leases",
        "img",
        "trash",
    ];
    pub const IMAGE_LOCKS_REL: &'static str = "locks/images";
    /// The files of the layout (those it has once made).
    pub const LAYOUT_FILES: [&'static str; 5] = [
        crate::config::FILE,
        "stowage.db",
        "reserve",
        "locks/global.lock",
        "locks/store.lock",
    ];

    /// Whether `name`, directly in a root, is a part of its layout: a directory or file of it, the
    /// catalog's journal, or the configuration written under a temporary name (`config.rs`).
    pub fn is_layout_part(name: &str) -> bool {
        let mut parts = Self::LAYOUT_DIRS.iter().chain(&Self::LAYOUT_FILES);
        parts.any(|p| p.split('/').next() == Some(name))
            || name == "stowage.db-journal"
            || name.starts_with(&format!(".{}.", crate::config::FILE))
    }

    /// The image whose lock file (in `locks/images`) is `fname`, if any.
    pub fn image_of_lock_file(fname: &str) -> Option<ImageName> {
        ImageName::from_encoded(fname.strip_suffix(".lock")?).ok()
    }

    /// A lock file's name relative to `locks/`, as records name it.
    pub fn locks_rel(&self, path: &Path) -> String {
        path.strip_prefix(self.locks())
            .unwrap_or(path)
            .display()
            .to_string()
    }

    /// Creates the root and its directories. Idempotent. The root's parent must exist.
    pub fn create_layout(&self) -> Result<()> {
        self.lay_out(false)
    }

    /// [`Root::create_layout`], `asked` by `init`: also in a directory that holds other things than
    /// a store (a store is made only in a new or empty one unasked).
    pub fn lay_out(&self, asked: bool) -> Result<()> {
        let shown = self.dir.display();
        // Judged once: a maker racing us adds only a store's parts, which `no_store` passes.
        let store = self.holds_store();
        // Neither at nor in a part of another's layout (that store's gc would remove it, its init
        // adopt it), nor in an images directory a store claims. Judged on the real path.
        if !store
            && let Ok(real) = fs::canonicalize(&self.dir).or_else(|_| real_path(&self.dir))
            && let Some(why) = inside_another_store(&real, true, &real)
        {
            anyhow::bail!("refusing {shown} as a root: {why}");
        }
        let existed = match fs::symlink_metadata(&self.dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => match fs::create_dir(&self.dir) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    anyhow::bail!("cannot create root {shown}: its parent directory does not exist")
                }
                Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
                    return Err(e).with_context(|| format!("cannot create root {shown}"));
                }
                _ => false,
            },
            Err(e) => return Err(e).with_context(|| format!("cannot inspect root {shown}")),
            Ok(_) => true,
        };
        self.refuse_claimed_img()?;
        // A mistyped root (a builder's storage, a project's directory) must not grow a store.
        if existed && !asked && !store {
            let no = self.no_store();
            if matches!(no, crate::Error::NotAStore { held: Some(_), .. }) {
                return Err(no.into());
            }
        }
        make_dir(&self.dir)?;
        // Checked again on what was made or found (`open`): another may have made it meanwhile.
        let root = self.open()?;
        for rel in ["locks", "locks/images", "locks/slots", "img", "trash"] {
            if rel == "img" && root.stat_at(rel)?.is_none() && self.images_dir_recorded(&root) {
                continue;
            }
            self.make_layout_dir(&root, rel)?;
            if rel == "locks" {
                crate::debug::pause("layout-locks-made");
            }
        }
        // A new store's configuration (an old release's store is migrated first instead, its
        // catalog lost or not).
        if root.stat_at(crate::config::FILE)?.is_none()
            && root.stat_at("stowage.db")?.is_none()
            && !self.older_release_left()
        {
            self.create_config(&root).1?;
        }
        // The locks gc needs are made with the layout: made first when needed, a filesystem out of
        // inodes left gc unable to run (`store.lock` is not: a new image's write asks it if there).
        let (shared, create) = (crate::lock::Mode::Shared, crate::lock::IfMissing::Create);
        for lock in [self.global_lock(), self.gc_lock()] {
            match crate::lock::acquire_no_wait(&lock, shared, create) {
                // Something planted in its place is said now, not by the first gc.
                Err(e) if crate::planted::find(&e).is_some() => {
                    return Err(crate::lock::error("a lock of the layout", &lock, e));
                }
                _ => {}
            }
        }
        crate::space::refill(&self.reserve());
        Ok(())
    }

    /// Whether the store's configuration records the default images directory's identity: one
    /// missing then is unmounted or moved away, and one made in its place would stand for it (and
    /// be in the way of putting it back). Asked only where `img` is missing.
    fn images_dir_recorded(&self, root: &Dir) -> bool {
        let config = crate::config::read(&self.dir, root).ok().flatten();
        config.is_some_and(|c| {
            c.images == crate::image_record::ImagesDir::Default && c.identity.is_some()
        })
    }

    /// Makes layout directory `rel` by `mkdirat` in its parent, opened from the root's descriptor
    /// without following links: nothing is ever made outside the root.
    fn make_layout_dir(&self, root: &Dir, rel: &str) -> Result<()> {
        let path = self.dir.join(rel);
        let (parent, name) = match rel.rsplit_once('/') {
            Some((p, n)) => (
                root.anchor_sub(p)
                    .map_err(|e| not_a_dir(&self.dir.join(p), e))?,
                n,
            ),
            None => (root.duplicate()?, rel),
        };
        if mkdir_in(&parent, name, &path)? {
            return Ok(());
        }
        match parent.stat_at(name)? {
            Some(e) if e.is_dir() => Ok(()),
            Some(_) => Err(not_a_dir(&path, nix::errno::Errno::ENOTDIR.into())),
            None => anyhow::bail!("{} was removed while being made", path.display()),
        }
    }

    /// Refuses, before anything is made, a layout entry not of its kind (a symlink for a directory,
    /// a FIFO for `store.conf`), which `init` would refuse only halfway. A root not there passes.
    pub fn refuse_planted_layout(&self) -> Result<()> {
        let Ok(root) = Dir::anchor_nofollow(&self.dir) else {
            return Ok(());
        };
        let wanted = Self::LAYOUT_DIRS
            .iter()
            .map(|d| (*d, true))
            .chain(Self::LAYOUT_FILES.iter().map(|f| (*f, false)));
        // Below a `locks` that is none there is nothing to look at.
        let locks = root.stat_at("locks")?.is_some_and(|e| e.is_dir());
        for (rel, dir) in wanted {
            if rel.starts_with("locks/") && !locks {
                continue;
            }
            let Some(e) = root.stat_at(rel)? else {
                continue;
            };
            let path = self.dir.join(rel);
            return Err(match (dir, planted::kind_name(e.mode)) {
                (true, "a directory") | (false, "a regular file") => continue,
                // No store here: nothing in its place is stowage's to set aside.
                (true, kind) if rel == "locks" && !self.holds_store() => {
                    std::io::Error::other(format!("{} is {kind}, not a directory, and no store's: refusing to make a store here; move it away or choose another root", path.display()))
                }
                (true, "a symlink") if rel == "img" => {
                    std::io::Error::other(refusal(&path, "a symlink", &planted::IMG_LINK.to_string()))
                }
                (true, kind) => planted::not_a_dir(&path, kind),
                (false, kind) => planted::not_a_file(&path, kind),
            }
            .into());
        }
        Ok(())
    }

    /// Whether the store is a release's before records, still to migrate (its catalog aside): no
    /// record of this release's own use in any image lock file (a store used since is past it,
    /// whatever was put back beside), and that release's statement in the global lock file
    /// (emptied only once migrated), or its tokens, enabled or disabled beside a record a migration
    /// wrote (one begun stays to finish; a token put here alone makes no old store), in a store
    /// whose default images directory bears no claim of its own.
    pub fn older_release_left(&self) -> bool {
        match self.records_tell() {
            Told::OwnUse => false,
            // Disabled by a migration that finished (it claims the images directory after writing
            // the configuration: `img`, or the external one its records name): a configuration
            // lost since is `doctor --repair`'s to write.
            Told::Tokens(named) => {
                !self.claims_default_images_dir()
                    && !named.iter().any(|d| self.claims_images_dir(d))
            }
            Told::Nothing => self.older_release_catalog_id().is_some(),
        }
    }

    /// Whether this store's claim is on its default images directory: written by this release
    /// only once the store's configuration was (`Root::create_config`, a migration's end), so a
    /// store that bears it was made or migrated by this release, whatever tokens it still holds.
    pub fn claims_default_images_dir(&self) -> bool {
        self.claims_images_dir(&crate::image_record::ImagesDir::Default)
    }

    /// Whether this store's claim is on the images directory `images` (as this process reaches it).
    fn claims_images_dir(&self, images: &crate::image_record::ImagesDir) -> bool {
        let Ok(dir) = self.open_images_dir(&images.path_in(self.dir())) else {
            return false;
        };
        let me = self.open().and_then(|d| Ok(d.identity()?));
        let claim = crate::claim::read(&dir);
        claim
            .zip(me.ok())
            .is_some_and(|(c, me)| crate::dir::same_identity(&c.root, &me))
    }

    /// Whether an image lock file holds a record of this release's own use (not a migration's,
    /// which has that release's bytes beside it): the store is past any migration.
    pub fn own_use_recorded(&self) -> bool {
        matches!(self.records_tell(), Told::OwnUse)
    }

    /// What the image lock files tell of the release that used the store last.
    fn records_tell(&self) -> Told {
        use crate::image_record::SlotA;
        let Ok(locks) = Dir::open_in_root(&self.image_locks()) else {
            return Told::Nothing;
        };
        let mut told = Told::Nothing;
        for name in locks.names().unwrap_or_default() {
            if !name.to_str().is_some_and(|n| n.ends_with(".lock")) {
                continue;
            }
            // Through the directory's descriptor, never waiting: a FIFO or a directory planted
            // there reads as nothing (no `pread` of either succeeds).
            let opened = locks.open_read_unchecked(&name);
            let Ok(Ok((seen, a))) = opened.as_ref().map(crate::image_record::read_with_slot_a)
            else {
                continue;
            };
            match (seen.record.is_some(), a) {
                (true, SlotA::Ours) => return Told::OwnUse,
                (_, SlotA::Token) | (true, SlotA::Disabled) => {
                    let mut named = match std::mem::replace(&mut told, Told::Nothing) {
                        Told::Tokens(named) => named,
                        _ => Vec::new(),
                    };
                    let images = seen.record.map(|r| r.images);
                    named.extend(images.filter(|i| !named.contains(i)));
                    told = Told::Tokens(named);
                }
                _ => {}
            }
        }
        told
    }

    /// The catalog identity a release before records stated in the global lock file (`db=HEX`),
    /// if any (this release states nothing there).
    pub fn older_release_catalog_id(&self) -> Option<u32> {
        // Opened for reading only: a store on a read-only mount is still found to be one to migrate.
        let locks = Dir::open_in_root(&self.locks()).ok()?;
        let file = locks.open_read("global.lock").ok()?;
        let mut text = String::new();
        io::Read::read_to_string(&mut io::Read::take(&file, 4096), &mut text).ok()?;
        let body = text.strip_prefix("stowage-records ")?;
        body.lines()
            .find_map(|l| l.strip_prefix("db="))
            .and_then(|v| u32::from_str_radix(v, 16).ok())
    }

    /// Makes a new store's configuration through `root` unless one is there, and claims `img` for
    /// the store the file names if nothing claims it. Returns it, and whether it could be written.
    pub fn create_config(&self, root: &Dir) -> (crate::config::Config, Result<()>) {
        // Both identities from the start, to tell a directory mounted there later, or a copy.
        let img = self.open_sub("img").ok();
        let config = crate::config::Config {
            identity: img.as_ref().and_then(|d| d.identity().ok()),
            root: root.identity().ok(),
            ..self.fresh_config()
        };
        if let Err(e) = crate::config::create(&self.dir, root, &config) {
            return (config, Err(e));
        }
        let config = match crate::config::read(&self.dir, root) {
            Ok(Some(c)) => c,
            _ => config,
        };
        // Only where nothing claims it (XATTR_CREATE): another store's claim made meanwhile stands.
        if let Some(img) = &img
            && let Ok(mine) = crate::claim::Claim::of(&config.id, root, &self.dir)
        {
            let _ = crate::claim::write(img, &mine, true);
        }
        (config, Ok(()))
    }

    /// A fresh configuration, with the store id the claim of `ROOT/img` carries where it names this
    /// very root (a configuration lost).
    pub(crate) fn fresh_config(&self) -> crate::config::Config {
        let mut config = crate::config::Config::fresh();
        let claimed = || {
            let here = self.open().ok()?.identity().ok()?;
            let claim = crate::claim::read(&self.open_sub("img").ok()?)?;
            crate::dir::same_identity(&claim.root, &here).then_some(claim.id)
        };
        config.id = claimed().unwrap_or(config.id);
        config
    }

    /// Before a new store is made: an `img` in the root that another store's standing claim names
    /// is refused.
    pub fn refuse_claimed_img(&self) -> Result<()> {
        let here = || Dir::anchor_nofollow(&self.dir).and_then(|d| d.identity());
        // No id of ours yet: a claim whose root is gone is nobody's.
        if fs::symlink_metadata(self.dir.join(crate::config::FILE)).is_err()
            && let Ok(img) = Dir::open_nofollow(&self.default_images_dir())
            && let Some(theirs) = crate::claim::read(&img)
            && !here().is_ok_and(|me| crate::dir::same_identity(&theirs.root, &me))
            && theirs.binds(&self.default_images_dir())
        {
            anyhow::bail!(
                "images directory {} belongs to the store at {}: one images directory serves one store; choose another root",
                self.default_images_dir().display(),
                theirs.path.display()
            );
        }
        Ok(())
    }

    /// [`Root::create_layout`] for `doctor`: a non-directory planted in a layout directory's place
    /// is passed to `bad` (saying what it is), which says whether it put a directory there. Returns
    /// whether the lock directories are usable.
    pub fn create_layout_reporting(&self, mut bad: impl FnMut(&str, &str) -> bool) -> Result<bool> {
        if fs::symlink_metadata(&self.dir).is_err() {
            return self.create_layout().map(|()| true);
        }
        let root = self.open()?;
        let mut locks_ok = true;
        for name in Self::LAYOUT_DIRS {
            // Below a `locks` that is no directory: nothing to look at, and no link to follow.
            if !locks_ok && name.starts_with("locks/") {
                continue;
            }
            let path = self.dir.join(name);
            let what = match fs::symlink_metadata(&path) {
                Ok(m) if m.is_dir() => continue,
                Ok(m) => format!("{}, not a directory", planted::kind_name(m.mode())),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if locks_ok && (name != "img" || !self.images_dir_recorded(&root)) {
                        self.make_layout_dir(&root, name)?;
                    }
                    continue;
                }
                Err(e) => return Err(denied_in_store(&path, e, "inspect")),
            };
            if !bad(name, &what) && name.starts_with("locks") {
                locks_ok = false;
            }
        }
        Ok(locks_ok)
    }

    /// How many image records what is in place of layout directory `name` (`locks`,
    /// `locks/images`) leads to: a symlink there to a directory of records, the user's real one
    /// perhaps. Followed for this listing only.
    pub fn records_in_place_of(&self, name: &str) -> usize {
        let (parent, entry) = name.rsplit_once('/').unwrap_or(("", name));
        let below = (name == Self::LOCKS_REL).then_some("images");
        self.listable(parent)
            .map_or(0, |d| records_behind(&d, entry, below))
    }

    /// Layout directories of records a repair set aside (`locks.planted-*`, `locks/images.planted-*`,
    /// each a symlink planted in `locks`' or `locks/images`' place) that still lead to image
    /// records: each with where it points and how many. While one does, no tree is adopted: those
    /// records may be the trees' own.
    pub fn records_set_aside(&self) -> Vec<(PathBuf, Option<PathBuf>, usize)> {
        let mut out = Vec::new();
        let places = [
            ("", "locks.planted-", Some("images")),
            (Self::LOCKS_REL, "images.planted-", None),
        ];
        for (parent, prefix, below) in places {
            let Ok(dir) = self.listable(parent) else {
                continue;
            };
            for name in dir.names().unwrap_or_default() {
                let Some(name) = name.to_str().filter(|n| n.starts_with(prefix)) else {
                    continue;
                };
                let n = records_behind(&dir, name, below);
                let to = nix::fcntl::readlinkat(&dir, name).ok().map(PathBuf::from);
                if n > 0 {
                    out.push((self.dir.join(parent).join(name), to, n));
                }
            }
        }
        out
    }

    /// The layout directory `rel` (`""`: the root) opened to be listed.
    fn listable(&self, rel: &str) -> Result<Dir> {
        match rel {
            "" => Ok(self.open()?.sub(".")?),
            rel => self.open_sub(rel),
        }
    }

    /// Sets aside what is planted in place of layout directory `name` (`Dir::set_aside`) and makes
    /// an empty directory there. Returns where it went.
    pub fn replace_with_dir(&self, name: &str) -> Result<PathBuf> {
        let path = self.dir.join(name);
        let (parent, entry) = match name.rsplit_once('/') {
            Some((parent, entry)) => (self.open_sub(parent)?, entry),
            None => (self.open()?, name),
        };
        let aside = match parent.stat_at(entry)? {
            Some(e) if e.is_dir() => return Ok(path),
            Some(_) => parent
                .set_aside(entry, "planted")
                .with_context(|| format!("cannot set {} aside", path.display()))?,
            None => entry.to_owned(),
        };
        mkdir_in(&parent, entry, &path)?;
        Ok(path.with_file_name(aside))
    }

    /// Refuses a root someone else could control ([`Root::check_owner`]; a symlink must be ours:
    /// anyone can plant one in /var/tmp); says whether it is shared with a group. In a root that
    /// passes only we (or our group) can replace anything. A symlink that passes is resolved once,
    /// here: later uses go to the checked directory (and SQLite, which refuses links, gets it).
    pub fn check(&mut self) -> Result<bool> {
        let (euid, shown) = (nix::unistd::geteuid().as_raw(), self.dir.display());
        let link = match fs::symlink_metadata(&self.dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("cannot inspect root {shown}"));
            }
            found => found.ok(),
        };
        let m = match link {
            // Only a symlink needs a second look, at what it names.
            Some(link) if link.file_type().is_symlink() => {
                let uid = link.uid();
                if uid != euid && (uid != 0 || self.default) {
                    anyhow::bail!(
                        "root {shown} is a symlink owned by uid {uid}, not by you: refusing to follow it"
                    );
                }
                let real = fs::canonicalize(&self.dir).with_context(|| {
                    let to = fs::read_link(&self.dir).map(|t| t.display().to_string());
                    let to = to.unwrap_or_else(|_| "?".into());
                    format!("root {shown} is a symlink to {to}, which cannot be used")
                })?;
                let m = fs::metadata(&real)
                    .with_context(|| format!("cannot inspect root {}", real.display()))?;
                self.dir = real;
                m
            }
            found => {
                // Symlinks above the root are the user's choice; resolved once, for SQLite.
                if let Ok(real) = real_path(&self.dir) {
                    self.dir = real;
                }
                let Some(m) = found else { return Ok(false) };
                m
            }
        };
        if !m.is_dir() {
            anyhow::bail!("root {} is not a directory", self.dir.display());
        }
        self.check_owner(m.uid(), m.mode(), m.gid())?;
        self.dev = Some(m.dev());
        // Group-writable: files and directories are made so every member can lock and update them.
        Ok(m.mode() & 0o020 != 0)
    }

    /// A root must be ours (or root's) or writable by a group of ours (by any group, for root),
    /// and never world-writable without the sticky bit: owner `uid`, `mode`, group `gid`.
    fn check_owner(&self, uid: u32, mode: u32, gid: u32) -> Result<()> {
        let (euid, root) = (nix::unistd::geteuid().as_raw(), self.dir.display());
        if self.default && uid != euid {
            anyhow::bail!(
                "default root {root} belongs to {}, not to you: refusing it (its owner controls its locks); {}",
                crate::ident::someone(uid),
                Root::another_default(uid, euid)
            );
        }
        // Root may use a group's store of a group it is not in: its users are sent to root for the
        // repairs only it can make. Another user's private store stays theirs, root's too.
        let group_writable = mode & 0o020 != 0;
        let shared = group_writable && (crate::ident::in_group(gid) || euid == 0);
        if uid != euid && uid != 0 && group_writable && !shared {
            let why = crate::planted::not_a_member(gid);
            anyhow::bail!("root {root} belongs to uid {uid}: {why}");
        }
        if uid != euid && uid != 0 && !shared {
            anyhow::bail!(
                "root {root} belongs to uid {uid} and is not shared with a group of yours: refusing to use it (whoever owns it controls its locks)"
            );
        }
        if mode & 0o002 != 0 && mode & 0o1000 == 0 {
            anyhow::bail!(
                "root {root} is writable by everyone: refusing to use it (anyone could replace its lock files); chmod o-w it"
            );
        }
        Ok(())
    }

    /// What the user can do about a default root of someone else's, which they cannot remove.
    fn another_default(owner: u32, euid: u32) -> String {
        let user = crate::ident::user_name();
        let named = crate::ident::passwd_name(owner).is_some_and(|o| o == user);
        if named && crate::ident::passwd_name(euid).is_some_and(|me| me != user) {
            // `su` keeps USER: the root is named for the user the session started as.
            return format!(
                "it is named by $USER ({user}), who you are not: set USER to your name, or give --root DIR or STOWAGE_ROOT"
            );
        }
        format!(
            "give a root of your own with --root DIR or STOWAGE_ROOT, or ask {} to remove it",
            crate::ident::someone(owner)
        )
    }

    /// Refuses a root whose locks would not exclude other hosts ([`crate::filesystem::Reach`]);
    /// `doctor` reports it instead.
    pub fn check_locking(&mut self) -> Result<()> {
        // From the mount table (no request to an NFS server), else from a statfs of the root.
        let (reach, mount, own) = self
            .dev
            .and_then(crate::filesystem::lock_reach_of_device)
            .unwrap_or_else(|| crate::filesystem::lock_reach_with(&self.dir));
        // What was found serves every lock file on the root's filesystem (whether to unlink them).
        if let (Some(dev), Some(fs)) = (self.dev, &own) {
            let dirs = [self.locks(), self.image_locks(), self.leases()];
            crate::lock::note_filesystem(dev, fs.local, &dirs);
        }
        // Other hosts read leases and records: on a shared filesystem, writes go to the server at
        // once (a root not made yet: its nearest ancestor's filesystem).
        let local = match &own {
            Some(fs) => fs.local,
            None => crate::filesystem::nearest(&self.dir).is_some_and(|(_, fs)| fs.local),
        };
        crate::lock::set_write_through(!local);
        self.fs = own;
        if let crate::filesystem::Reach::NodeLocal { why, advice } = reach {
            let at = mount.map_or_else(String::new, |m| format!(" ({})", m.mount_point.display()));
            let root = self.dir.display();
            return Err(crate::Error::UnsafeLocking(format!(
                "root {root}{at} is on {why}, so other hosts' builds and metadata updates would not be excluded; {advice} (see '{STOWAGE} doctor')"
            ))
            .into());
        }
        Ok(())
    }
}

/// Why a directory at the real path `real` lies where another store would take it for its own: in
/// or at a part of a store's layout ([`Root::is_layout_part`]: its gc empties `trash`, its init
/// adopts what is in `img`) other than the store at `ours`'s, or in a directory a store uses as its
/// images directory (`real` itself too if `itself`). One walk up, for what is made once (a root, an
/// images directory).
pub fn inside_another_store(real: &Path, itself: bool, ours: &Path) -> Option<String> {
    let mut at = real;
    loop {
        let parent = at.parent()?;
        let part = at.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if Root::is_layout_part(part) && parent != ours && Root::at(parent).has_layout() {
            let (store, is) = (parent.display(), if at == real { "is" } else { "lies in" });
            return Some(format!(
                "it {is} '{part}' of the store at {store}, which would take it for its own"
            ));
        }
        let opened = (itself || at != real).then(|| Dir::open_nofollow(at).ok());
        let claim = opened
            .flatten()
            .and_then(|d| crate::claim::read(&d).filter(|c| c.in_use_for(&d)));
        if let Some(c) = claim {
            let (dir, store) = (at.display(), c.path.display());
            return Some(format!(
                "it lies in images directory {dir} of the store at {store}"
            ));
        }
        at = parent;
    }
}

/// Why the directory `dir` may not be deleted, adopted as an image or moved away: a store uses it,
/// by positive evidence ([`crate::claim::Claim::in_use_for`]; a root whose configuration records
/// it as itself). A copy of either (a backup inside an image) is no store's.
pub fn in_use_by_a_store(dir: &Dir) -> Option<String> {
    if let Some(c) = crate::claim::read(dir).filter(|c| c.in_use_for(dir)) {
        return Some(format!(
            "the images directory of the store at {}",
            c.path.display()
        ));
    }
    let config = crate::config::read(Path::new("."), dir).ok()??;
    let here = dir.identity().ok()?;
    let itself = config
        .root
        .is_some_and(|r| crate::dir::same_identity(&r, &here));
    itself.then(|| "a store's root".to_owned())
}

/// `dir` as named, without trailing separators or `.` components (`link/`, `link/.`, `link//` are
/// `link`): every call on `link/` follows the link, so a symlink would pass for the directory it
/// names, and its owner and kind would never be checked.
pub fn as_named(dir: &Path) -> PathBuf {
    dir.components().collect()
}

/// The real path of `dir`, not itself a symlink: its parent's and its name (no readlink of the
/// root, a round trip on NFS).
fn real_path(dir: &Path) -> io::Result<PathBuf> {
    match (dir.parent(), dir.file_name()) {
        (Some(parent), Some(name)) if !parent.as_os_str().is_empty() => {
            fs::canonicalize(parent).map(|p| p.join(name))
        }
        _ => fs::canonicalize(dir),
    }
}

/// `e`, met doing `what` to `path`; a group store's directory that keeps a member out (`path`, or
/// the directory it is in) named with why, and who fixes it.
fn denied_in_store(path: &Path, e: io::Error, what: &str) -> anyhow::Error {
    let shown = path.display();
    let closed = [path, path.parent().unwrap_or(path)]
        .into_iter()
        .find_map(|p| {
            let m = fs::symlink_metadata(p).ok()?;
            Some((
                p,
                m.mode() & 0o7777,
                planted::group_store_part(p, m.uid(), m.gid())?,
            ))
        });
    match closed {
        Some((p, mode, why)) if e.raw_os_error() == Some(libc::EACCES) => {
            let p = p.display();
            anyhow::anyhow!("cannot {what} {shown}: {e}: {p} is mode {mode:o}; {why}")
        }
        _ => anyhow::Error::new(e).context(format!("cannot {what} {shown}")),
    }
}

/// "PATH is a symlink, not a directory; refusing to use it", and what to do, for the errors an
/// `O_NOFOLLOW|O_DIRECTORY` open gives for what is planted in a directory's place.
/// Whether `e` is this process running out of descriptors.
fn out_of_descriptors(e: &anyhow::Error) -> bool {
    let io = e.root_cause().downcast_ref::<io::Error>();
    io.is_some_and(|e| e.raw_os_error() == Some(libc::EMFILE))
}

fn not_a_dir(path: &Path, e: io::Error) -> anyhow::Error {
    if e.raw_os_error() == Some(libc::EACCES) {
        return denied_in_store(path, e, "open");
    }
    if !matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) {
        return anyhow::Error::new(e).context(format!("cannot open {}", path.display()));
    }
    // Linux says ENOTDIR for a symlink opened O_DIRECTORY|O_NOFOLLOW: look.
    let kind =
        fs::symlink_metadata(path).map_or("not a directory", |m| planted::kind_name(m.mode()));
    // A link in the default images directory's place may be the user's own: it is left for them.
    let fix = if path.file_name().is_some_and(|n| n == "img") && kind == "a symlink" {
        planted::IMG_LINK
    } else {
        planted::FIX
    };
    anyhow::anyhow!("{}", refusal(path, kind, &fix.to_string()))
}

fn refusal(path: &Path, kind: &str, fix: &str) -> String {
    let shown = path.display();
    format!("{shown} is {kind}, not a directory: refusing to use it; {fix}")
}

/// Whether an error comes of something missing (a file, a directory of the layout).
pub(crate) fn is_missing(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == io::ErrorKind::NotFound)
    })
}

/// The UTF-8 names in directory `dir` of the root (`Dir::open_in_root`); none if not listed.
pub(crate) fn names_in(dir: &Path) -> Vec<String> {
    let names = Dir::open_in_root(dir).and_then(|d| d.names());
    let names = names.unwrap_or_default().into_iter();
    names.filter_map(|n| n.into_string().ok()).collect()
}

/// Makes directory `name` (at `path`) in `parent`; one made there meanwhile is as good. Returns
/// whether this call made it.
pub(crate) fn mkdir_in(parent: &Dir, name: &str, path: &Path) -> Result<bool> {
    match parent.mkdir(name, 0o777) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        made => made
            .map(|()| true)
            .map_err(|e| denied_in_store(path, e, "create directory")),
    }
}

/// Creates `dir` (and missing parents), refusing a symlink in its place.
pub fn make_dir(dir: &Path) -> Result<()> {
    let shown = dir.display();
    match fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(m) if m.file_type().is_symlink() => {
            anyhow::bail!("{shown} is a symlink, not a directory; refusing to use it")
        }
        Ok(_) => anyhow::bail!("{shown} exists and is not a directory"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot inspect {shown}")),
    }
    match fs::create_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot create directory {shown}")),
    }
}

/// Whether `file` (in `locks/images/`) is the lock file of the image named `name` (any string).
pub fn is_lock_file_of(file: &str, name: &str) -> bool {
    ImageName::parse(name).is_ok_and(|n| lock_file_name(n.encoded()) == file)
}

/// `ENC.lock`; an ENC too long for NAME_MAX is cut and suffixed with a hash of the whole (a
/// collision would share a record: the second name is refused, `acquire::image::take`).
pub fn lock_file_name(enc: &str) -> String {
    named(enc, ".lock")
}

fn named(enc: &str, suffix: &str) -> String {
    if enc.len() + suffix.len() <= crate::name::MAX_ENCODED_LEN {
        return format!("{enc}{suffix}");
    }
    // FNV-1a; ENC is ASCII, so any byte index is a char boundary.
    let hash = (enc.bytes()).fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{}~{hash:016x}{suffix}", &enc[..200])
}

/// "image 'alpine:3.17'" for a lock file name, or the name itself if shortened (not decodable).
pub fn lock_file_label(fname: &str) -> String {
    match Root::image_of_lock_file(fname) {
        Some(n) => format!("image '{n}'"),
        None => format!("image lock {fname}"),
    }
}

/// How many image records the directory `name` in `dir` holds in its `.lock` files (`below`: in its
/// subdirectory, never through a link), `name` followed if a symlink: a count for a report, each
/// file only read (opened following no link, never blocking).
fn records_behind(dir: &Dir, name: &str, below: Option<&str>) -> usize {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC | libc::O_NONBLOCK;
    let Ok(name) = std::ffi::CString::new(name) else {
        return 0;
    };
    let Ok(d) = dir.open_at(&name, flags, 0).map(Dir::from) else {
        return 0;
    };
    let d = match below.map(|b| d.sub(b)) {
        None => d,
        Some(Ok(sub)) => sub,
        Some(Err(_)) => return 0,
    };
    let names = d.names().unwrap_or_default();
    let holds_record = |n: &std::ffi::OsString| {
        let seen = d.open_read(n).and_then(|f| crate::image_record::read(&f));
        seen.is_ok_and(|s| s.record.is_some() || s.legacy)
    };
    names
        .iter()
        .filter(|n| n.to_str().is_some_and(|n| n.ends_with(".lock")) && holds_record(n))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_names_fit_name_max() {
        assert_eq!(lock_file_name("alpine+3.17"), "alpine+3.17.lock");
        let long = "a".repeat(255);
        let n = lock_file_name(&long);
        assert!(n.len() <= 255, "{}", n.len());
        assert_ne!(n, lock_file_name(&"a".repeat(254)));
    }

    #[test]
    fn refuses_symlinked_dirs() {
        let d = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/", d.path().join("evil")).unwrap();
        assert!(make_dir(&d.path().join("evil")).is_err());
    }
}
