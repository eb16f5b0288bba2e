//! `stowage init`: create the layout and adopt existing image directories.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use nix::unistd::AccessFlags;

use crate::adopt::{self, Adopt};
use crate::config::Config;
use crate::ident::STOWAGE;
use crate::ident::shell_path;
use crate::image_record::ImagesDir;
use crate::root::{Root, make_dir};
use crate::sharing;
use crate::store::Store;
use crate::system_dirs;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    stowage init --images-dir \"$CH_IMAGE_STORAGE/img\"   (a Charliecloud storage directory)\n  \
    stowage --root /scratch/build-images init --group builders   (a store for a group)\n\
    Nothing of stowage's own is ever written into the images directory or its parent.")]
pub struct Args {
    /// Keep image trees in DIR instead of ROOT/img
    #[arg(long, value_name = "DIR")]
    images_dir: Option<PathBuf>,
    /// Share the store with GROUP (name or number): the root and every part
    /// of its layout get the group, group write and (directories) setgid.
    /// Makes a new store, or converts an existing one of yours
    #[arg(long, value_name = "GROUP", allow_hyphen_values = true)]
    group: Option<String>,
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    crate::migrate::if_needed(store, None)?;
    let resolve = |d: &PathBuf| {
        let absolute = std::path::absolute(d);
        let absolute = absolute.with_context(|| format!("cannot resolve {}", d.display()))?;
        anyhow::Ok(crate::root::as_named(&absolute))
    };
    let wanted = args.images_dir.as_ref().map(resolve).transpose()?;
    if let Some(dir) = &wanted {
        refuse_unrecordable(dir)?;
    }
    // Refused before anything is created. Judged by its path always (a group's members may write
    // the configuration), by what it holds only when a store takes it (an idempotent `init` goes on).
    let root = store.root();
    let config = root.exists().then(|| crate::images_dir::config(root).ok());
    let config = config.flatten();
    let current = config.as_ref().map(|c| c.images.path_in(root.dir()));
    let taken = wanted.as_ref().filter(|d| current.as_ref() != Some(*d));
    if let Some(dir) = &wanted {
        refuse_images_dir(root, dir)?;
        refuse_what_is_no_images_dir(dir, taken.is_some())?;
        refuse_another_stores(root, dir)?;
        refuse_nesting(root, dir, taken.is_some())?;
    } else if let Some(dir) = current.filter(|d| *d != root.default_images_dir()) {
        refuse_what_is_no_images_dir(&dir, false)?;
        refuse_unclaimed(root, &dir)?;
    }
    store.root().refuse_planted_layout()?;
    refuse_what_is_no_root(store.root())?;
    let group = args
        .group
        .as_deref()
        .map(|g| open_to_group(store, g))
        .transpose()?;
    store.root().lay_out(true)?;
    let root = store.root().clone();
    let mut config = crate::images_dir::config(&root)?;
    if let Some(dir) = &wanted
        && config.images.path_in(root.dir()) != *dir
    {
        switch(store, &mut config, dir)?;
    }
    let dir = config.images.path_in(root.dir());
    let images =
        root.open_or_make_images_dir(&dir, config.identity.is_none() || wanted.is_some())?;
    // Another directory at the recorded path (another disk; the path seen from a container or from
    // another host) is made the store's, for every view, only if named: never by a plain init.
    if wanted.is_none()
        && let Some(why) = crate::images_dir::not_the_recorded_one(&root, &config, &images, &dir)
    {
        bail!("{why}");
    }
    // Before anything is adopted: a directory another store claims is refused untouched.
    make_ours(store, &root, &mut config, (&images, &dir), wanted.is_some())?;
    let (adopted, how) = adopt_found(store, &config, (&images, &dir), taken.is_some())?;
    // The whole layout, the catalog and the global lock too (filled by the next look).
    store.with_catalog(None, |_, _| Ok(()))?;
    let (at, note) = (root.dir().display(), adopted_note(adopted, how));
    let said = format!("root {at} ready; images in {}{note}", dir.display());
    store.ctx().say(&said);
    // Shared last, once nothing is left to refuse: a refused init changes no mode and no group.
    if let Some(gid) = group {
        return share(store, &images, &dir, gid);
    }
    // A group store's images directory, made or named by any member, is the group's too.
    if let Some((gid, _)) = sharing::is_group_store(root.dir())
        && dir != root.default_images_dir()
    {
        sharing::images_dir_to_group(&images, &dir, gid)?;
    }
    Ok(0)
}

/// Adopts the trees in the images directory (`images`, at `dir`) that have no record, saying which
/// it left and why; `stores_judged`: as for [`adopt::orphans`].
fn adopt_found(
    store: &Store,
    config: &Config,
    (images, dir): (&crate::dir::Dir, &Path),
    stores_judged: bool,
) -> Result<(usize, Adopt)> {
    let root = store.root();
    // Trees are adopted ready only in a directory stowage never managed, where no image has ever
    // had a lock file, or by an init finishing such an adoption, interrupted (see adopt.rs).
    let census = crate::census::take(root)?;
    let how = if census.is_empty() || config.adopting {
        Adopt::AsReady
    } else {
        Adopt::Unknown
    };
    let named: HashSet<String> = census.iter().filter_map(|e| e.image()).collect();
    let mut orphans = adopt::orphans(images, dir, &named, stores_judged)?;
    // Records a repair set aside with a layout directory may be these trees': none is adopted.
    if let Some((at, _, n)) = (!orphans.trees.is_empty())
        .then(|| root.records_set_aside().into_iter().next())
        .flatten()
    {
        let (trees, at) = (orphans.trees.len(), at.display());
        store.ctx().say(&format!("not adopting {trees} tree(s) in {}: {n} image record(s) are set aside in {at}, which may be theirs ('{STOWAGE} doctor' says what to do)", dir.display()));
        orphans.trees.clear();
    }
    let as_ready = how == Adopt::AsReady && !orphans.trees.is_empty();
    if as_ready {
        adopt::mark_adopting(store, true)?;
    }
    let adopted = adopt::adopt(root, config, &orphans, how)?;
    // Ended, not interrupted: a tree left (its lock held, its file planted) is said, and adopted
    // as `incomplete` later; a mark kept for it would make any later stray tree `ready`.
    if as_ready || config.adopting {
        adopt::mark_adopting(store, false)?;
    }
    let (ctx, shown) = (store.ctx(), dir.display());
    for why in &adopted.left {
        ctx.say(&format!("not adopting {why}"));
    }
    for (entry, why) in &orphans.skipped {
        ctx.say(&format!("not adopting {entry:?} in {shown}: {why}"));
    }
    Ok((adopted.names.len(), how))
}

/// Checks the root may be shared with group `name`; makes what init creates from now on
/// group-writable (an external images directory too); the root is shared last. Returns the gid.
fn open_to_group(store: &mut Store, name: &str) -> Result<u32> {
    let gid = sharing::group_id(name)?;
    sharing::may_share(store.root().dir(), gid)?;
    let umask = &mut store.ctx_mut().child_umask;
    umask.get_or_insert_with(sharing::open_umask);
    Ok(gid)
}

/// Makes `dir` the images directory from now on (accepting a remount), and this store's; one the
/// configuration names without a claim only if `named` on the command line (see `claim`).
fn make_ours(
    store: &Store,
    root: &Root,
    config: &mut Config,
    (images, dir): (&crate::dir::Dir, &Path),
    named: bool,
) -> Result<()> {
    // Claimed first, on the descriptor adoption and sharing use: a root whose identity is recorded
    // is no copy any more, and a copy refused here must stay one, so every later use asks again.
    if !crate::images_dir::claim(root, config, named, images)? {
        let shown = dir.display();
        store.ctx().say(&format!("cannot mark {shown} as this store's (its filesystem keeps no extended attributes): another store's init would not be refused"));
    }
    crate::images_dir::record_identity(root, config, true, || store.global(None))
}

/// Shares with group `gid` the root, an external images directory (not the builders' trees in it)
/// and every part of the layout made before; exit 1 naming a part that is someone else's.
fn share(store: &Store, images: &crate::dir::Dir, dir: &Path, gid: u32) -> Result<u8> {
    let root = store.root();
    crate::debug::pause("init-share");
    sharing::share_root(root.dir(), gid)?;
    if dir != root.default_images_dir() {
        sharing::share_images_dir(images, dir, gid)?;
    }
    let (label, at) = (sharing::group_label(gid), root.dir().display());
    // The check passes over a link put at a layout directory since it was made (it reads through
    // none): named here, not said to be shared.
    root.refuse_planted_layout()?;
    let done = sharing::repair(root, gid, sharing::check(root, gid));
    if !done.fixed.is_empty() {
        let parts = sharing::list(&done.fixed, 8);
        let said = format!("gave group {label} and group write to {parts}");
        store.ctx().detail(&said);
    }
    let left: Vec<_> = done
        .not_ours
        .iter()
        .chain(done.failed.iter().map(|(w, _)| w))
        .cloned()
        .collect();
    if !left.is_empty() {
        let (parts, doc) = (sharing::list(&left, 3), crate::error::GROUP_STORE_DOC);
        bail!(
            "root {at} is shared with group {label}, but not every part: {parts} (their owners or root can run '{STOWAGE} doctor --repair'; {doc})"
        );
    }
    let said = format!("root {at} shared with group {label}: every part is group-writable");
    store.ctx().say(&said);
    Ok(0)
}

/// Refuses an images directory whose path cannot be one line of text, as records name it.
fn refuse_unrecordable(dir: &Path) -> Result<()> {
    let why = match dir.to_str() {
        None => "is not UTF-8",
        Some(s) if s.contains('\n') => "holds a newline",
        Some(_) => return Ok(()),
    };
    let shown = dir.display();
    super::usage(format!(
        "invalid images directory {shown}: its path {why} (the records name it on one line of text)"
    ))
}

/// Refuses an images directory `dir` (absolute) that cannot be made, or that overlaps the root.
fn refuse_images_dir(root: &Root, dir: &Path) -> Result<()> {
    let (shown, at) = (dir.display(), root.dir().display());
    if !dir.is_dir() && !dir.parent().is_some_and(Path::is_dir) {
        // `$CH_IMAGE_STORAGE/img` before ch-image made its storage: a directory made by hand
        // would not be one ch-image takes.
        let hint = match dir.file_name() {
            Some(n) if n == "img" => {
                "; a builder's storage directory is the builder's to make: use the builder first, then init"
            }
            _ => "",
        };
        bail!("cannot create images directory {shown}: its parent directory does not exist{hint}");
    }
    // Asked before the root is laid out: an init that cannot make it leaves nothing behind.
    if !dir.is_dir()
        && let Some(parent) = dir.parent()
        && let Err(e) = nix::unistd::access(parent, AccessFlags::W_OK | AccessFlags::X_OK)
    {
        let me = nix::unistd::geteuid();
        bail!(
            "cannot create images directory {shown}: its parent {} does not let you (uid {me}) create in it ({})",
            parent.display(),
            e.desc()
        );
    }
    if root.dir().starts_with(dir) {
        bail!(
            "images directory {shown} contains the root {at}: its trees and stowage's own files would mix"
        );
    }
    if *dir == root.default_images_dir() {
        return Ok(());
    }
    if dir.starts_with(root.dir()) {
        bail!(
            "images directory {shown} is inside the root {at}; use the default (omit --images-dir) or a directory outside it"
        );
    }
    refuse_overlap(root.dir(), dir)
}

/// Refuses the configured images directory `dir` if it carries no claim (where one could be
/// kept) and holds what no images directory holds: store.conf may name it by a hand's edit or a
/// copy, and the trees there are adopted next.
fn refuse_unclaimed(root: &Root, dir: &Path) -> Result<()> {
    let opened = root.open_images_dir(dir).ok();
    if opened.is_some_and(|d| crate::images_dir::claimable_unclaimed(&d))
        && let Some(what) = system_dirs::not_for_images_kept(dir)
    {
        bail!(
            "refusing {} as the images directory: it is {what}",
            dir.display()
        );
    }
    Ok(())
}

/// Refuses a directory that is no images directory (`system_dirs::not_for_images`).
fn refuse_what_is_no_images_dir(dir: &Path, contents: bool) -> Result<()> {
    let Some(what) = system_dirs::not_for_images(dir, contents) else {
        return Ok(());
    };
    let shown = dir.display();
    bail!(
        "refusing {shown} as the images directory: it is {what}; give a directory that holds image trees only (a new one, or a builder's own images directory)"
    )
}

/// A root that is no store, said with why `init` would refuse to make one there (if it would): the
/// hint to run it would only lead to that refusal.
pub fn with_refusal(e: anyhow::Error) -> anyhow::Error {
    let refusal = |dir: &Path| {
        let real = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
        crate::root::inside_another_store(&real, true, &real)
            .or_else(|| {
                system_dirs::no_root_reason(dir).map(|(what, tail)| format!("it is {what}; {tail}"))
            })
            .or_else(|| {
                Root::at(dir)
                    .refuse_claimed_img()
                    .err()
                    .map(|e| format!("{e:#}"))
            })
    };
    // Only these two, taken out whole: a downcast of a context would drop what it wraps.
    let no_store = matches!(
        e.downcast_ref::<crate::Error>(),
        Some(
            crate::Error::NoRoot { refused: None, .. }
                | crate::Error::NotAStore { refused: None, .. }
        )
    );
    if !no_store || e.chain().count() > 1 {
        return e;
    }
    match e.downcast::<crate::Error>() {
        Ok(crate::Error::NoRoot { dir, refused: None }) => {
            let refused = refusal(&dir);
            crate::Error::NoRoot { dir, refused }.into()
        }
        Ok(crate::Error::NotAStore {
            dir,
            held,
            refused: None,
        }) => {
            let refused = refusal(&dir);
            crate::Error::NotAStore { dir, held, refused }.into()
        }
        Ok(other) => other.into(),
        Err(e) => e,
    }
}

/// Refuses, before a store is made at the root, a directory that is no place for stowage's files.
fn refuse_what_is_no_root(root: &Root) -> Result<()> {
    if root.holds_store() {
        return Ok(());
    }
    match system_dirs::no_root_reason(root.dir()) {
        Some((what, tail)) => bail!(
            "refusing {} as the root: it is {what}; {tail}",
            root.dir().display()
        ),
        None => Ok(()),
    }
}

/// Refuses, before anything is made, an images directory another store claims (`claim.rs`).
fn refuse_another_stores(root: &Root, dir: &Path) -> Result<()> {
    // Another root's default images directory, claimed or not: told by its layout, which outlives a
    // lost configuration (`Root::has_layout`).
    let a_root = |p: &&Path| Root::at(p).has_layout();
    let belongs = |at: &Path, what: String| {
        let (shown, at) = (dir.display(), at.display());
        anyhow::anyhow!(
            "images directory {shown} belongs to the store at {at}: one images directory serves one store ({what})"
        )
    };
    let use_root = |at: &Path| format!("use that root: --root {}", shell_path(at));
    if let Some(other) = dir.parent().filter(a_root)
        && dir.file_name().is_some_and(|n| n == "img")
        && other != root.dir()
    {
        return Err(belongs(other, use_root(other)));
    }
    let images = crate::dir::Dir::open_nofollow(dir).ok();
    let Some(theirs) = images.and_then(|d| crate::claim::read(&d)) else {
        return Ok(());
    };
    let config = root
        .open()
        .ok()
        .and_then(|d| crate::config::read(root.dir(), &d).ok()?);
    let mine = config
        .map(|c| crate::images_dir::my_claim(root, &c))
        .transpose()?;
    // A claim binds too while its store holds its store-wide lock: its init may be switching to
    // the directory it just claimed, its configuration not naming it yet.
    let switching = || {
        let probe = crate::store_wide::probe(&Root::at(&theirs.path));
        matches!(probe, Ok(crate::store_wide::Probe::Held))
    };
    if mine.as_ref().is_some_and(|m| m.same_store(&theirs)) || !(theirs.binds(dir) || switching()) {
        return Ok(());
    }
    // Its root not where it says (the same path as ours, another directory; or gone): that store
    // moved away or is gone for good, and nothing tells which.
    let what = if theirs.root_there().is_none() || theirs.path == root.dir() {
        let arg = shell_path(dir);
        format!("a store that was here; gone for good? 'setfattr -x user.stowage.store {arg}'")
    } else {
        use_root(&theirs.path)
    };
    Err(belongs(&theirs.path, what))
}

/// Refuses an images directory that lies in another store's (whose removals would delete this
/// one's trees) or, with `contents`, holds one or a store's root (adopted as an image, gc would
/// delete it): one store's images may not hold another's, whichever was made first.
fn refuse_nesting(root: &Root, dir: &Path, contents: bool) -> Result<()> {
    let shown = dir.display();
    // The directory itself too, as a part of another store's layout (that store's gc empties its
    // `trash`); a claim on it is `refuse_another_stores`' to judge.
    if let Some(why) =
        crate::root::inside_another_store(&system_dirs::resolved(dir), false, root.dir())
    {
        bail!("refusing {shown} as the images directory: {why}");
    }
    let listed = || crate::dir::Dir::open_nofollow(dir).and_then(|d| Ok((d.names()?, d)));
    let Some(Ok((names, images))) = contents.then(listed) else {
        return Ok(());
    };
    for name in names {
        let Ok(sub) = images.sub(&name) else {
            continue;
        };
        if let Some(what) = crate::root::in_use_by_a_store(&sub) {
            let path = dir.join(&name);
            let path = path.display();
            bail!(
                "refusing {shown} as the images directory: {path} in it is {what}, which it would adopt as an image"
            );
        }
    }
    Ok(())
}

/// What init's last line says of the images it adopted, if any.
fn adopted_note(adopted: usize, how: Adopt) -> String {
    let s = if adopted == 1 { "" } else { "s" };
    let how = match how {
        Adopt::AsReady => "ready",
        Adopt::Unknown => &format!(
            "incomplete (whether complete is not known; '{STOWAGE} exec --write NAME -- true' marks one ready)"
        ),
    };
    let note = format!("; adopted {adopted} existing image{s} as {how}");
    if adopted == 0 { String::new() } else { note }
}

/// Switches the images directory to `dir`: a store-wide operation (no image is written meanwhile,
/// none is created in the directory left behind), refused while any image exists.
fn switch(store: &mut Store, config: &mut Config, dir: &Path) -> Result<()> {
    let root = store.root().clone();
    let hold = crate::store_wide::Hold::take(store, "stowage init --images-dir", None, true)?;
    let out = (|| {
        let n = crate::census::take(&root)?
            .iter()
            .filter(|e| e.seen.record.is_some() || e.seen.damaged)
            .count();
        let shown = dir.display();
        if n > 0 {
            let (at, now) = (root.dir().display(), config.images.path_in(root.dir()));
            let now = now.display();
            let (s, them) = if n == 1 { ("", "it") } else { ("s", "them") };
            bail!(
                "root {at} already keeps {n} image{s} in {now}; refusing to switch to {shown} (remove {them} first)"
            );
        }
        // Its parent must exist: a mistyped path should not grow a tree.
        if !dir.is_dir() {
            let why = || format!("cannot create images directory {shown}");
            std::fs::create_dir(dir).with_context(why)?;
        }
        make_dir(dir)?;
        // Only while no image is created: a hold lost since the count proves nothing.
        if let Some(why) = hold.lost() {
            bail!("lost the store-wide hold before switching to {shown} ({why}): run it again");
        }
        // Named with its identity, so that another store's claim sees it bind, but with the
        // root unrecorded until `make_ours` records it.
        config.images = ImagesDir::External(dir.to_owned());
        let images = crate::dir::Dir::open(dir)?;
        // One store's init switches to it at a time: another's claim is then there, and binds
        // (its configuration names the directory), or not yet made.
        crate::lock::flock_dir_exclusive(std::os::fd::AsRawFd::as_raw_fd(&images));
        // Refused before it is recorded: a member's refused switch leaves the store as it was.
        if let Some((gid, _)) = sharing::is_group_store(root.dir()) {
            sharing::refuse_images_dir(&images, dir, gid)?;
        }
        let identity = images
            .identity()
            .context("cannot inspect the images directory");
        (config.identity, config.root) = (Some(identity?), None);
        // Claimed before the configuration names it: of two inits racing for one directory only
        // the claim's store switches, and one killed between the two leaves it claimed, never
        // named unclaimed for another store's init to take while this one uses it.
        // (A filesystem that keeps no claim is said by `make_ours`.)
        crate::images_dir::claim(&root, config, true, &images)?;
        let new = config.clone();
        crate::images_dir::update_config(
            &root,
            || store.global(None),
            |now| (now.images, now.identity, now.root) = (new.images, new.identity, new.root),
        )?;
        crate::debug::pause("init-switched");
        Ok(())
    })();
    hold.release(store);
    out
}

/// The checks above by directory (device and inode, climbing `..`): through a bind mount or a
/// symlinked parent another path can be the root or in it, and `gc` would delete the lock directory
/// adopted as an image.
fn refuse_overlap(root: &Path, dir: &Path) -> Result<()> {
    use crate::dir::Dir;
    // The directories from `d` up to `/`, as (device, inode).
    let chain = |mut d: Dir| -> std::io::Result<Vec<(u64, u64)>> {
        let mut ids = Vec::new();
        loop {
            let st = d.stat()?;
            if ids.last() == Some(&(st.dev, st.ino)) || ids.len() > 4096 {
                return Ok(ids);
            }
            ids.push((st.dev, st.ino));
            d = d.sub("..")?;
        }
    };
    let existing =
        |p: &Path| Dir::open(p).or_else(|_| Dir::open(p.parent().unwrap_or(Path::new("/"))));
    let (Ok(r), Ok(i)) = (existing(root), existing(dir)) else {
        return Ok(()); // Reported by what follows.
    };
    let (Ok(root_ids), Ok(dir_ids)) = (chain(r), chain(i)) else {
        return Ok(());
    };
    let (shown, at) = (dir.display(), root.display());
    if dir.is_dir() && root_ids.contains(&dir_ids[0]) {
        bail!(
            "images directory {shown} is the root {at} or contains it (a bind mount or a symlink): its trees and stowage's own files would mix"
        );
    }
    let above = &dir_ids[usize::from(dir.is_dir())..];
    if root.is_dir() && above.contains(&root_ids[0]) {
        bail!(
            "images directory {shown} is inside the root {at} (through a bind mount or a symlink); use the default (omit --images-dir) or a directory outside it"
        );
    }
    Ok(())
}
