//! The images directory: where an image's tree is, and whether the directory there is the one whose
//! trees the records describe.
//!
//! - **Where trees go** comes from the store's configuration (`config.rs`); a record repeats it
//!   for reads, never trusted where something is written or deleted ([`of_record`]).
//! - **A missing tree proves nothing** when the images directory is missing or is not the one
//!   recorded (unmounted, or another filesystem mounted there) ([`unmounted`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::claim::Claim;
use crate::config::Config;
use crate::dir::Dir;
use crate::ident::STOWAGE;
use crate::image_record::{self, ImagesDir, Record};
use crate::name::ImageName;
use crate::root::Root;

/// The store's configuration; for a store with no record yet that has none, one made now, so no
/// record is written without one on disk. One lost while images have records is refused, not made
/// anew: a new one would name the default directory and a new store id.
pub fn config(root: &Root) -> Result<Config> {
    if let Some(c) = root.take_config_read() {
        return Ok(c);
    }
    if let Some(c) = crate::config::read(root.dir(), root.opened()?)? {
        return Ok(c);
    }
    // An old release's catalog is migrated first; one that cannot be asked is refused.
    let legacy = crate::catalog::legacy_state(root).with_context(|| {
        format!(
            "{} is missing, and {} cannot be asked whether to migrate it ('{STOWAGE} doctor' tells more)",
            root.dir().join(crate::config::FILE).display(),
            root.db().display()
        )
    })?;
    if legacy.is_some() {
        return Err(crate::catalog::NeedsMigration.into());
    }
    if !has_records(root)? {
        // Made as the first use does (`Root::create_config`), only in a laid-out store (another's
        // half made is finished first, so `img` is there); one who may not write the root goes on
        // with one of its own.
        let laid_out = |d: &Dir| matches!(d.stat_at("locks/images"), Ok(Some(e)) if e.is_dir());
        return Ok(match root.open() {
            Ok(d) if laid_out(&d) && root.create_layout().is_ok() => root.create_config(&d).0,
            _ => root.fresh_config(),
        });
    }
    // Read again after the records were seen: lost if still missing (else made meanwhile).
    crate::config::read(root.dir(), root.opened()?)?.with_context(|| {
        format!(
            "{} is missing while images have records: '{STOWAGE} doctor --repair' writes it anew from them",
            root.dir().join(crate::config::FILE).display()
        )
    })
}

/// Whether any image lock file holds a record (the store is not new): one that cannot be read
/// counts (an older release's token does not).
pub fn has_records(root: &Root) -> Result<bool> {
    Ok(crate::census::take(root)?
        .iter()
        .any(|e| e.seen.record.is_some() || (e.seen.damaged && !e.seen.legacy)))
}

/// The images directory `record` names where it is not the store's (an image whose tree is not ours
/// to touch: `rm` drops its record alone, gc keeps it).
pub fn named_elsewhere(root: &Root, record: &Record) -> Result<Option<PathBuf>> {
    let config = config(root)?;
    Ok((config.images != record.images).then(|| record.images.path_in(root.dir())))
}

/// Where the tree of the image `record` describes lives, refused unless the configuration agrees.
pub fn of_record(root: &Root, record: &Record) -> Result<PathBuf> {
    let config = config(root)?;
    if config.images != record.images {
        anyhow::bail!(
            "the record of image '{}' names images directory {}, but the store's is {}: refusing to touch it (run '{STOWAGE} doctor')",
            record.name,
            record.images.path_in(root.dir()).display(),
            config.images.path_in(root.dir()).display()
        );
    }
    checked(root, &config)
}

/// The images directory `config` names — refused if it is external and not this store's
/// ([`not_this_stores`], by the claim on its path; one missing is left to what opens it).
pub fn checked(root: &Root, config: &Config) -> Result<PathBuf> {
    let dir = config.images.path_in(root.dir());
    if config.images != ImagesDir::Default
        && let Some(why) = not_this_stores_by_path(root, config, &dir)
    {
        anyhow::bail!("{why}");
    }
    Ok(dir)
}

/// [`not_this_stores`] by the claim on `dir`'s path; one missing is left to what opens it.
fn not_this_stores_by_path(root: &Root, config: &Config, dir: &Path) -> Option<String> {
    let claim = crate::claim::read_path(dir, false);
    match &claim {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        // Not read, so not judged: what keeps us out is said, never taken for a missing mark.
        Err(e) if e.raw_os_error() == Some(libc::EACCES) => return Some(unreadable(root, dir, e)),
        _ => {}
    }
    let now = || root.open_images_dir(dir).ok()?.identity().ok();
    not_this_stores(root, Some(config), dir, claim, now)
}

/// `opened`, the images directory at `dir` opened to make, copy or remove trees in, refused unless
/// it is this store's and the one recorded ([`not_the_recorded_one`]: the default one too, where
/// another directory may be mounted, or none), judged on that very descriptor (a path checked,
/// then opened again, may lead elsewhere by then). A claim that cannot be read there refuses it:
/// the descriptor is what the trees are then made or removed through.
pub fn confirmed(root: &Root, dir: &Path, opened: Result<Dir>) -> Result<Dir> {
    let config = config(root)?;
    let images = confirmed_as(root, &config, dir, opened)?;
    // Asked where trees are removed, copied or written, not where a new one is made (the cost of
    // every new image's write; a tree made there is one the original may adopt, nothing lost).
    if dir == root.default_images_dir()
        && let Some(why) = the_originals(root, &config, &images, dir)
    {
        anyhow::bail!("{why}");
    }
    Ok(images)
}

/// [`confirmed`] by the store's configuration `config`, already read.
pub fn confirmed_as(root: &Root, config: &Config, dir: &Path, opened: Result<Dir>) -> Result<Dir> {
    let images = opened?;
    if let Some(why) = not_the_recorded_one(root, config, &images, dir) {
        anyhow::bail!("{why}");
    }
    if dir == root.default_images_dir() {
        return Ok(images);
    }
    let claim = crate::claim::read_fd(&images);
    if let Err(e) = &claim
        && e.raw_os_error() != Some(libc::ENOTSUP)
    {
        let shown = dir.display();
        anyhow::bail!("cannot read which store images directory {shown} serves: {e}");
    }
    match not_this_stores(root, Some(config), dir, claim, || images.identity().ok()) {
        Some(why) => anyhow::bail!("{why}"),
        None => Ok(images),
    }
}

/// Why this store may not use the external images directory `dir`, by `claim`, what was read of
/// its claim (the claim first: found, it settles it without asking who may write `store.conf`):
/// - another root's claim binds it (a copy of the store, or another store);
/// - no claim of this store's is on it, and its identity, `now` (asked only then), is not the one
///   recorded: another directory at the recorded path (another disk mounted there; the path seen
///   from a container, or another host, where another directory is at it);
/// - no claim of this store's is on it while others may have written the configuration (a group
///   store): a member may name any directory there, so only a claim, which `init --images-dir`
///   writes, makes it this store's. No extended attributes: nothing else to tell it by.
fn not_this_stores(
    root: &Root,
    config: Option<&Config>,
    dir: &Path,
    claim: std::io::Result<Option<Claim>>,
    now: impl FnOnce() -> Option<String>,
) -> Option<String> {
    let here = root.identity().ok()?;
    let no_xattrs = claim
        .as_ref()
        .is_err_and(|e| e.raw_os_error() == Some(libc::ENOTSUP));
    let theirs = claim.unwrap_or(None);
    if let Some(t) = &theirs {
        if crate::dir::same_identity(&t.root, &here) {
            return None;
        }
        let id = config.map_or("", |c| c.id.as_str());
        if let Some(why) = crate::claim::refusal_by(t, dir, id, &here) {
            let recorded = config.and_then(|c| c.root.as_deref());
            if recorded.is_some_and(|r| !crate::dir::same_identity(r, &here)) {
                return Some(format!(
                    "{why}; this root is a copy of that store ('stowage --root ROOT init --images-dir DIR' gives it images of its own)"
                ));
            }
            return Some(why);
        }
    }
    // Read only now, without a claim of ours: one found spares the store's every use a look.
    let loaded = config.is_none().then(|| self::config(root).ok()).flatten();
    if let Some(why) = config
        .or(loaded.as_ref())
        .and_then(|c| a_copys(c, dir, &here))
    {
        return Some(why);
    }
    if let Some(c) = config.or(loaded.as_ref())
        && let Some(recorded) = c.identity.as_deref()
        && let Some(now) = now()
        && !crate::dir::same_identity(recorded, &now)
    {
        return Some(not_recorded(dir, &now, recorded));
    }
    (!no_xattrs && others_may_write_config(root)).then(|| unclaimed(dir))
}

/// Why a root of identity `here` that `config` does not record (a copy of the store, or one moved
/// to another filesystem) may not use the external directory `dir` without a claim of its own: its
/// locks are not the original's, which may use the directory still. Only `init --images-dir`
/// naming it makes it this root's.
fn a_copys(config: &Config, dir: &Path, here: &str) -> Option<String> {
    let recorded = config.root.as_deref()?;
    (!crate::dir::same_identity(recorded, here)).then(|| {
        let (at, shown) = (dir.display(), crate::ident::shell_path(dir));
        let why = format!(
            "images directory {at} is not marked as this store's, and this root is not the one its store.conf records (a copy, or moved to another filesystem)"
        );
        format!(
            "{why}: its locks are not the original's; a copy needs images of its own; one whose original is gone takes it by '{STOWAGE} init --images-dir {shown}'"
        )
    })
}

/// An images directory we may not read (`e`): whose it is, and in a group store who gives it the
/// store's group.
fn unreadable(root: &Root, dir: &Path, e: &std::io::Error) -> String {
    use std::os::unix::fs::MetadataExt;
    let said = format!("images directory {} cannot be read: {e}", dir.display());
    let Ok(m) = std::fs::metadata(dir) else {
        return said;
    };
    let (mode, uid, gid) = (m.mode() & 0o7777, m.uid(), m.gid());
    let said = format!("{said} (mode {mode:o}, uid {uid}, group {gid})");
    let Some((store, _)) = crate::sharing::is_group_store(root.dir()) else {
        return said;
    };
    let (group, path) = (
        crate::ident::group_label(store),
        crate::ident::shell_path(dir),
    );
    format!(
        "{said}; its owner or root gives it the store's group {group} by '{STOWAGE} init --images-dir {path}'"
    )
}

fn unclaimed(dir: &Path) -> String {
    let shown = crate::ident::shell_path(dir);
    format!(
        "images directory {} is not marked as this store's, and others may rewrite its store.conf: if it is this store's, '{STOWAGE} init --images-dir {shown}'",
        dir.display()
    )
}

/// Whether anyone but the root's owner may have written the store's configuration: the root or
/// `store.conf` writable by group or others (a group store), or `store.conf` another user's.
fn others_may_write_config(root: &Root) -> bool {
    let Ok(dir) = root.open() else {
        return true;
    };
    // None yet (a migration): the root alone decides.
    match (dir.stat(), dir.stat_at(crate::config::FILE)) {
        (Ok(r), Ok(c)) => {
            r.mode & 0o022 != 0 || c.is_some_and(|c| c.mode & 0o022 != 0 || c.uid != r.uid)
        }
        _ => true,
    }
}

/// Where the tree of the image `record` describes lives, for its command: `ROOT/img`, or an
/// external directory only if the configuration names it too ([`of_record`]).
pub fn for_command(root: &Root, record: &Record) -> Result<PathBuf> {
    match record.images {
        ImagesDir::Default => Ok(root.default_images_dir()),
        ImagesDir::External(_) => of_record(root, record),
    }
}

/// Whether the tree `encoded` is gone from the images directory at `dir` as it is now (it, or the
/// directory, not found: one `lstat`). `ROOT/img` is looked in from the root's descriptor, never by
/// a path taken before (the root may have moved meanwhile); an external one by its own path. An
/// error that says nothing of the tree (EACCES, ENOTDIR, EIO) is no sign it is gone.
pub fn nothing_at(root: &Root, dir: &Path, encoded: &str) -> bool {
    match root.opened() {
        Ok(r) if dir == root.default_images_dir() => {
            matches!(r.stat_at(Path::new("img").join(encoded)), Ok(None))
        }
        _ => {
            matches!(std::fs::symlink_metadata(dir.join(encoded)), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
        }
    }
}

/// Whether the tree `encoded` is in the images directory at `dir` now, by the filesystem's own word
/// (`None`: it cannot be told, nor where the directory there is not the recorded one: a missing
/// tree proves nothing there). Where not local a client answers a lookup from its caches for a
/// while (GlusterFS, NFS): a tree another host moved to the trash a moment ago is still found, by
/// `lstat` and by an `openat` alike (the moved directory lives on). A listing through a descriptor
/// opened now is asked of the server, so there it is the evidence; locally one `lstat` is.
pub fn tree_there(root: &Root, dir: &Path, encoded: &str) -> Option<bool> {
    let images = root.open_images_dir(dir).ok()?;
    let there = if crate::filesystem::filesystem(dir).is_ok_and(|f| f.local) {
        images.stat_at(encoded).ok()?.is_some()
    } else {
        let names = images.names().ok()?;
        names.iter().any(|n| n.as_os_str() == encoded)
    };
    (there || unmounted_at(root, &images, dir).is_none()).then_some(there)
}

/// Whether image `name`'s record was erased by an opener (a shell's `>`, as in `9>FILE`): its lock
/// file holds no record (hints aside) and no unlinker's mark, while a directory is at its name.
/// stowage writes a record before it makes a tree, and marks a file before unlinking it; a write
/// refused on a directory planted there (or killed before its record) looks the same, so it is
/// said as likely, never acted on. `None`: the images directory cannot tell (unmounted): no
/// evidence. Asked only where a command found no record, before it says so.
pub fn record_erased(root: &Root, name: &ImageName) -> Option<bool> {
    let lock = crate::lock::open_existing_read(&root.image_lock(name));
    let Ok(Some(lock)) = lock else {
        return Some(false);
    };
    if !image_record::read(&lock).is_ok_and(|s| s.unrecorded() && !s.gone) {
        return Some(false);
    }
    let config = root
        .opened()
        .ok()
        .map(|d| crate::config::read(root.dir(), d));
    let Some(Ok(Some(config))) = config else {
        return Some(false);
    };
    let dir = config.images.path_in(root.dir());
    let images = root.open_images_dir(&dir).ok()?;
    if unmounted_at(root, &images, &dir).is_some() {
        return None;
    }
    Some(matches!(images.stat_at(name.encoded()), Ok(Some(e)) if e.is_dir()))
}

/// The tree a record describes, for reading and measuring only.
pub fn tree_of(root: &Root, r: &Record) -> PathBuf {
    let dir = r.images.path_in(root.dir());
    ImageName::parse(&r.name).map_or(dir.clone(), |n| dir.join(n.encoded()))
}

/// This store's claim on its images directory (`claim.rs`).
pub fn my_claim(root: &Root, config: &Config) -> Result<Claim> {
    Claim::of(&config.id, &root.open()?, root.dir())
        .with_context(|| format!("cannot inspect root {}", root.dir().display()))
}

/// Why nothing may be made or removed in the images directory `dir`: another store claims it, or
/// an external one is not this store's ([`not_this_stores`]).
pub fn not_ours(root: &Root, dir: &Path) -> Option<String> {
    let config = config(root).ok()?;
    if config.images != ImagesDir::Default {
        return not_this_stores_by_path(root, &config, dir);
    }
    let images = root.open_images_dir(dir).ok()?;
    if copied_with(root, &images, dir, &config) {
        return None;
    }
    crate::claim::refusal(&images, dir, &my_claim(root, &config).ok()?)
}

/// Whether `dir` is this root's `ROOT/img` and its claim carries this store's id: one that came
/// along with a copy of the store (`cp -a`), taken over; never the original's, mounted there while
/// the original claims it ([`the_originals`]).
fn copied_with(root: &Root, images: &Dir, dir: &Path, config: &Config) -> bool {
    dir == root.default_images_dir()
        && crate::claim::read(images).is_some_and(|c| c.id == config.id)
        && the_originals(root, config, images, dir).is_none()
}

/// Whether `images` could carry a claim and carries none: a directory no store took (`init`
/// judges one when it takes it), or one whose claim was lost. A filesystem without extended
/// attributes keeps none, so there it says nothing.
pub fn claimable_unclaimed(images: &Dir) -> bool {
    matches!(crate::claim::read_fd(images), Ok(None))
}

/// Claims the images directory for this store unless another does; `Ok(false)`: no xattrs. An
/// external one no claim marks is claimed only if `named` (`init --images-dir` names it), or if
/// nobody but the root's owner may have written the configuration that names it.
pub fn claim(root: &Root, config: &Config, named: bool, images: &Dir) -> Result<bool> {
    let dir = config.images.path_in(root.dir());
    let mine = my_claim(root, config)?;
    let copied = copied_with(root, images, &dir, config);
    if !copied && let Some(why) = crate::claim::refusal(images, &dir, &mine) {
        anyhow::bail!("{why}");
    }
    let now = crate::claim::read(images);
    // Ours whatever root path it names: the root seen at another path (a bind mount, a container)
    // is the same root, and rewriting the path from each view would only make them alternate.
    if let Some(c) = now.as_ref().filter(|c| c.same_store(&mine)) {
        refresh_claim(images, c, &mine);
        return Ok(true);
    }
    let external = config.images != ImagesDir::Default;
    // Another directory at the recorded path, or the original's seen from a copy of the store, is
    // claimed only if named (`init --images-dir`).
    if external
        && !named
        && let Some(why) = not_the_recorded_one(root, config, images, &dir)
            .or_else(|| a_copys(config, &dir, &mine.root))
    {
        anyhow::bail!("{why}");
    }
    let by_root = now
        .as_ref()
        .is_some_and(|c| crate::dir::same_identity(&c.root, &mine.root));
    if external && !named && !by_root && others_may_write_config(root) {
        anyhow::bail!("{}", unclaimed(&dir));
    }
    match crate::claim::write(images, &mine, now.is_none()) {
        // Claimed meanwhile: asked again. A value read as no claim may be a later release's: kept.
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => match crate::claim::read(images) {
            Some(_) => claim(root, config, named, images),
            _ => anyhow::bail!(
                "cannot claim images directory {}: its user.stowage.store holds no claim this release reads; unused? 'setfattr -x user.stowage.store {}'",
                dir.display(),
                crate::ident::shell_path(&dir)
            ),
        },
        done => done.with_context(|| format!("cannot claim images directory {}", dir.display())),
    }
}

/// Gives our claim `c` the root's identity as this release tells it, where it was written with less
/// (no filesystem UUID, asked where the fs id is the device number), and the root's path where the
/// path written leads to no directory of the root's identity (the root moved): kept otherwise, as
/// another view's (a container's) path is as good.
pub fn refresh_claim(images: &Dir, c: &Claim, mine: &Claim) {
    let fuller = c.root.split('@').count() < mine.root.split('@').count();
    let there = Dir::open(&c.path).and_then(|d| d.identity());
    let moved = !there.is_ok_and(|id| crate::dir::same_identity(&id, &mine.root));
    if fuller || moved {
        let refreshed = Claim {
            id: c.id.clone(),
            root: if fuller { &mine.root } else { &c.root }.clone(),
            path: if moved { &mine.path } else { &c.path }.clone(),
        };
        let _ = crate::claim::write(images, &refreshed, false);
    }
}

/// Changes the configuration, read afresh, under the global lock, which `global` takes (the
/// caller's wait, said as every wait for it is): every change to it is made so, and none undoes
/// another made at the same moment.
pub fn update_config(
    root: &Root,
    global: impl FnOnce() -> Result<crate::lock::Guard>,
    change: impl FnOnce(&mut Config),
) -> Result<()> {
    let _global = global()?;
    crate::config::update(root.dir(), &root.open()?, change)
}

/// Records the images directory's identity in the configuration, if not yet (or if `accept`), under
/// the global lock `global` takes.
pub fn record_identity(
    root: &Root,
    config: &mut Config,
    accept: bool,
    global: impl FnOnce() -> Result<crate::lock::Guard>,
) -> Result<()> {
    let dir = config.images.path_in(root.dir());
    let images = root.open_images_dir(&dir)?;
    let id = images
        .identity()
        .context("cannot inspect the images directory")?;
    let here = root.open()?.identity().ok();
    if config.identity.is_some() && !accept {
        // The directory's identity stays as recorded; the root's is filled in where it never was.
        if config.root.is_some() || here.is_none() {
            return Ok(());
        }
        config.root = here;
    } else if config.identity.as_deref() == Some(&id) && config.root == here {
        return Ok(());
    } else {
        (config.identity, config.root) = (Some(id), here);
    }
    // Into the configuration as it is now: what another process changed meanwhile stays.
    update_config(root, global, |now| {
        if now.images == config.images {
            (now.identity, now.root) = (config.identity.clone(), config.root.clone());
        }
    })
}

/// Whether the store was copied or moved since its default images directory's identity was recorded
/// (so its `img`, opened as `images`, is its own), or that was never recorded. Either way the
/// identities are recorded afresh, under the global lock (a switch of the images directory
/// meanwhile is never undone).
fn moved(root: &Root, seen: &Config, images: &Dir) -> bool {
    let Ok(here) = root.open().and_then(|d| Ok(d.identity()?)) else {
        return false;
    };
    if seen.identity.is_some()
        && seen
            .root
            .as_deref()
            .is_some_and(|r| crate::dir::same_identity(r, &here))
    {
        return false;
    }
    let _ = (|| -> Result<()> {
        let (mode, missing) = (crate::lock::Mode::Exclusive, crate::lock::IfMissing::Fail);
        let Some(_global) = crate::lock::acquire_no_wait(&root.global_lock(), mode, missing)?
        else {
            return Ok(());
        };
        let dir = root.open()?;
        let Some(mut now) = crate::config::read(root.dir(), &dir)? else {
            return Ok(());
        };
        crate::debug::pause("img-recording");
        // The directory judged, not one opened again: a mount made at `img` since is not recorded.
        if now.images == ImagesDir::Default && now.identity == seen.identity {
            (now.identity, now.root) = (Some(images.identity()?), Some(here));
            crate::config::write(root.dir(), &dir, &now)?;
        }
        Ok(())
    })();
    true
}

/// The images directory the configuration names, opened, if it is the one recorded: kept open
/// through a store-wide command, to tell afterwards whether the command deleted it
/// ([`accept_remade`]).
pub fn recorded_open(root: &Root) -> Option<Dir> {
    let config = config(root).ok()?;
    let images = root
        .open_images_dir(&config.images.path_in(root.dir()))
        .ok()?;
    let recorded = config.identity.as_deref()?;
    crate::dir::same_identity(recorded, &images.identity().ok()?).then_some(images)
}

/// Records the images directory a store-wide command made anew (`ch-image reset` does): `before`,
/// the recorded one it ran beside, was deleted (not moved: [`Dir::deleted`]), and a directory on
/// the same device that is no mount (a mount hides trees, it deletes none) is at its path now.
/// A claim of this store's on the old one goes to the new one. `Ok(true)` if recorded; an error if
/// remade but not recorded.
pub fn accept_remade(
    root: &Root,
    before: &Dir,
    global: impl FnOnce() -> Result<crate::lock::Guard>,
) -> Result<bool> {
    let Ok(mut config) = config(root) else {
        return Ok(false);
    };
    let dir = config.images.path_in(root.dir());
    if !before.deleted() {
        return Ok(false);
    }
    let Ok(images) = root.open_images_dir(&dir) else {
        return Ok(false);
    };
    let (Ok(now), Ok(false)) = (images.stat(), images.is_mount_root()) else {
        return Ok(false);
    };
    if before.stat().is_ok_and(|old| old.dev != now.dev) {
        return Ok(false);
    }
    // A claim of this store's goes along; one a stale handle hides was the recorded directory's.
    let here = root.identity();
    let claim = match crate::claim::read_fd(before) {
        Ok(c) => c.filter(|c| {
            here.as_ref()
                .is_ok_and(|h| crate::dir::same_identity(&c.root, h))
        }),
        Err(_) if config.images != ImagesDir::Default => my_claim(root, &config).ok(),
        Err(_) => None,
    };
    if let Some(c) = claim {
        let _ = crate::claim::write(&images, &c, true);
    }
    let shown = dir.display();
    record_identity(root, &mut config, true, global)
        .with_context(|| format!("cannot record images directory {shown}, made anew"))?;
    Ok(true)
}

/// Why the trees in `dir` are not this store's to judge, measure or remove: [`unmounted`], or
/// [`not_ours`].
pub fn not_usable(root: &Root, dir: &Path) -> Option<String> {
    unmounted(root, dir).or_else(|| not_ours(root, dir))
}

/// Why a tree missing from `dir` may be the images directory's fault rather than a deletion.
pub fn unmounted(root: &Root, dir: &Path) -> Option<String> {
    let images = match root.open_images_dir(dir) {
        Ok(d) => d,
        Err(e) => {
            let denied = e.chain().filter_map(|c| c.downcast_ref::<std::io::Error>());
            if let Some(e) = denied
                .last()
                .filter(|e| e.raw_os_error() == Some(libc::EACCES))
            {
                return Some(unreadable(root, dir, e));
            }
            return Some(format!(
                "images directory {} is not usable ({e:#}): is it mounted?",
                dir.display()
            ));
        }
    };
    unmounted_at(root, &images, dir)
}

/// [`unmounted`] of `images`, the images directory opened as `dir`: the one a command's tree was
/// found or made in, held since, whatever its path leads to now (the root moved meanwhile).
pub fn unmounted_at(root: &Root, images: &Dir, dir: &Path) -> Option<String> {
    not_the_recorded_one(root, &config(root).ok()?, images, dir)
}

/// Why no tree may be made, removed, copied or written in `images`, opened as `dir`: an images
/// directory that is not the one recorded (unmounted, another filesystem in its place, a
/// container's view that does not see its mount) holds none of the store's trees, and would hide a
/// new one once the right one is mounted again. The default one of a store copied or moved to
/// another filesystem is its own ([`moved`], asked only then).
pub fn not_the_recorded_one(
    root: &Root,
    config: &Config,
    images: &Dir,
    dir: &Path,
) -> Option<String> {
    let why = not_the_recorded(config, images, dir)?;
    (config.images != ImagesDir::Default || !moved(root, config, images)).then_some(why)
}

/// Why the default images directory `images` is not this root's, though the one recorded: the root is
/// not the one recorded (a copy of the store), and the original, still at its path, claims it
/// (mounted here). A store moved whole keeps it: its original is gone.
fn the_originals(root: &Root, config: &Config, images: &Dir, dir: &Path) -> Option<String> {
    let here = root.identity().ok()?;
    if crate::dir::same_identity(config.root.as_deref()?, &here) {
        return None;
    }
    let claim = crate::claim::read_fd(images).ok()??;
    claim.root_there()?;
    crate::claim::refusal_by(&claim, dir, &config.id, &here)
}

fn not_the_recorded(config: &Config, images: &Dir, dir: &Path) -> Option<String> {
    let recorded = config.identity.as_deref()?;
    let now = images.identity().ok()?;
    (!crate::dir::same_identity(recorded, &now)).then(|| not_recorded(dir, &now, recorded))
}

/// The directory at `dir`, of identity `now`, is not the images directory recorded. Accepting it
/// makes it the store's images directory for every host and container that uses the store.
fn not_recorded(dir: &Path, now: &str, recorded: &str) -> String {
    format!(
        "images directory {} is not the directory recorded ({now}, not {recorded}): not mounted? ('{STOWAGE} init --images-dir {}' is for all hosts)",
        dir.display(),
        crate::ident::shell_path(dir)
    )
}
