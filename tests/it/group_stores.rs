//! A store shared by a group: `init --group` makes one in one command, new
//! or from an existing store; `doctor` names each part of the layout a
//! member cannot use, and `doctor --repair` fixes what is its caller's.
//! Members are other uids (setpriv), so these run as root.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output};

use crate::common::*;

/// The group the stores are shared with, and a member of it that is not
/// the owner: gid 100 ("users" on Debian), uid 65534.
const GID: u32 = 100;

fn can_act_as_a_member() -> bool {
    if !root_or_skip("acting as another user") {
        return false;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("skipping: setpriv (util-linux) not found");
        return false;
    }
    true
}

/// An Env whose root a member can reach (its temporary directory is
/// private by default).
/// A store of group 100 that members may use, or `None` (the reason
/// printed) where this process cannot act as a member.
fn group_store() -> Option<Env> {
    if !can_act_as_a_member() {
        return None;
    }
    let env = env_for_members();
    env.ok(["init", "--group", "100"]);
    Some(env)
}

fn env_for_members() -> Env {
    let env = Env::new();
    fs::set_permissions(env.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    env
}

/// `stowage --root ROOT ARGS…` as uid 65534 in group 100 only.
fn as_member(env: &Env, args: &[&str]) -> Output {
    as_uid(env, 65534, args)
}

/// `stowage --root ROOT ARGS…` as `uid` in group 100 only.
fn as_uid(env: &Env, uid: u32, args: &[&str]) -> Output {
    let mut c = Command::new("setpriv");
    c.arg(format!("--reuid={uid}"))
        .args(["--regid=100", "--clear-groups", "--"])
        .arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(args)
        .env("USER", "nobody")
        .env_remove("STOWAGE_ROOT");
    output(c)
}

/// Every part a member must be able to use: group 100, group-writable,
/// directories setgid.
fn assert_every_part_shared(root: &Path) {
    for p in walkdir(root).into_iter().chain([root.to_owned()]) {
        let rel = p.strip_prefix(root).unwrap();
        // Trees inside images are the builder's, not the layout.
        if rel.starts_with("img") && rel.components().count() > 2 {
            continue;
        }
        let m = fs::symlink_metadata(&p).unwrap();
        let want = if m.is_dir() { 0o2070 } else { 0o060 };
        assert_eq!(m.mode() & want, want, "{} mode {:o}", p.display(), m.mode());
        assert_eq!(m.gid(), GID, "{} belongs to the group", p.display());
    }
}

#[test]
fn init_group_makes_a_store_every_member_can_use() {
    if !can_act_as_a_member() {
        return;
    }
    let env = env_for_members();
    // The owner, with a strict umask, makes it in one command.
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg("umask 077; exec \"$0\" --root \"$1\" init --group 100")
        .arg(bin())
        .arg(&env.root);
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let m = fs::metadata(&env.root).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o2775, "root: setgid, group-writable");
    env.ok(["exec", "--write", "base", "--", "true"]);
    env.ok(["slots", "set", "pull", "2"]);
    assert_every_part_shared(&env.root);
    // A member reads, writes, takes a slot and removes.
    for args in [
        &["exec", "--read", "base", "--write", "app", "--", "true"][..],
        &["exec", "--slot", "pull", "--read", "app", "--", "true"],
        &["rm", "app"],
        &["doctor"],
    ] {
        let out = as_member(&env, args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
}

#[test]
fn init_group_converts_an_existing_store() {
    if !can_act_as_a_member() {
        return;
    }
    let env = env_for_members();
    env.make_image("base");
    env.ok(["slots", "set", "pull", "2"]);
    let refused = as_member(&env, &["exec", "--read", "base", "--", "true"]);
    assert_eq!(code(&refused), Some(1), "{}", show(&refused));
    let out = env.ok(["init", "--group", "100"]);
    // Named as /etc/group names it, with its number (the number alone before).
    assert!(
        stderr(&out).contains("shared with group 'users' (100)"),
        "{}",
        show(&out)
    );
    assert_every_part_shared(&env.root);
    for args in [
        &["exec", "--read", "base", "--write", "app", "--", "true"][..],
        &["exec", "--write", "base", "--", "true"],
        &["exec", "--slot", "pull", "--", "true"],
        &["rm", "app"],
    ] {
        let out = as_member(&env, args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
}

/// The walk of the issue: an existing store turned into a group store by
/// hand (chgrp, chmod 2775 of the root alone). A member is told which
/// part stops them, in one short line pointing at the recipe; doctor lists
/// the parts; the owner's `doctor --repair` fixes them and says so.
#[test]
fn doctor_names_and_repairs_the_parts_a_member_cannot_use() {
    if !can_act_as_a_member() {
        return;
    }
    let env = env_for_members();
    env.make_image("base");
    let c = std::ffi::CString::new(env.root.as_os_str().as_encoded_bytes()).unwrap();
    unsafe { assert_eq!(libc::chown(c.as_ptr(), 0, GID), 0) };
    fs::set_permissions(&env.root, fs::Permissions::from_mode(0o2775)).unwrap();

    let out = as_member(&env, &["exec", "--read", "base", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("locks/images"), "names the part: {err}");
    assert!(
        err.contains("mode 644") || err.contains("mode 755"),
        "{err}"
    );
    assert!(err.contains("doctor --repair"), "{err}");
    assert!(err.contains("docs/reliability.md#shared-stores"), "{err}");
    assert!(!err.contains("a group-writable setgid root"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let line = err
        .trim_end()
        .replace(&env.root.display().to_string(), "ROOT");
    // Room for the group named twice (name and number), who may repair,
    // and the root the repair is named with.
    assert!(line.chars().count() <= 245, "{} chars: {line}", line.len());

    let out = as_member(&env, &["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("sharing"), "{text}");
    assert!(text.contains("locks (mode 755"), "{text}");

    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("repaired  sharing"),
        "says what it did: {text}"
    );
    assert_every_part_shared(&env.root);
    let out = as_member(
        &env,
        &["exec", "--read", "base", "--write", "app", "--", "true"],
    );
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = env.ok(["doctor"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok  sharing"));
}

/// A part that belongs to a member is theirs: the owner's repair leaves
/// it, says whose it is, and exits 1.
#[test]
fn doctor_repair_leaves_another_users_part_and_says_so() {
    let Some(env) = group_store() else {
        return;
    };
    let out = as_member(&env, &["exec", "--write", "theirs", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let lock = env.lock_file("theirs");
    fs::set_permissions(&lock, fs::Permissions::from_mode(0o644)).unwrap();
    // The owner here is not root: a uid of its own that owns the root.
    let c = std::ffi::CString::new(env.root.as_os_str().as_encoded_bytes()).unwrap();
    unsafe { assert_eq!(libc::chown(c.as_ptr(), 65533, GID), 0) };
    let mut c = Command::new("setpriv");
    c.args(["--reuid=65533", "--regid=100", "--clear-groups", "--"])
        .arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(["doctor", "--repair"])
        .env("USER", "owner");
    let out = output(c);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("not ours to fix"), "{text}");
    assert!(text.contains("locks/images/theirs.lock"), "{text}");
    assert_eq!(fs::metadata(&lock).unwrap().mode() & 0o777, 0o644);
}

/// Someone outside the store's group is told so, and who can fix it: not
/// sent to a repair that would change nothing (every part is already the
/// group's and group-writable).
#[test]
fn a_user_outside_the_group_is_told_to_join_it() {
    let Some(env) = group_store() else {
        return;
    };
    env.make_image("a");
    let mut c = Command::new("setpriv");
    c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(["exec", "--read", "a", "--", "true"])
        .env("USER", "nobody")
        .env_remove("STOWAGE_ROOT");
    let out = output(c);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("not in group ") && err.contains("100") && !err.contains("doctor --repair"),
        "{}",
        show(&out)
    );
    assert_eq!(err.lines().count(), 1, "{}", show(&out));
}

/// A new images directory outside the root made by `init --group` is the
/// group's to write in, as every part of the root is (it is made with the
/// group store's umask; it is no part of the root that sharing repairs).
#[test]
fn init_group_makes_a_new_outside_images_directory_group_writable() {
    if !can_act_as_a_member() {
        return;
    }
    let env = env_for_members();
    let img = env.tmp.path().join("images");
    let out = env.run([
        "init",
        "--group",
        &GID.to_string(),
        "--images-dir",
        img.to_str().unwrap(),
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let m = fs::metadata(&img).unwrap();
    assert_eq!(m.mode() & 0o070, 0o070, "mode {:o}", m.mode());
    let out = as_member(&env, &["exec", "--write", "app", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// A member of the group who swaps a directory of the layout for a link
/// while `init --group` (run by root) gives the parts the group's modes
/// leads it nowhere outside the root: every part is opened without
/// following a link in any component, and a file elsewhere keeps its
/// group and mode.
#[test]
fn sharing_never_reaches_outside_the_root_through_a_swapped_link() {
    if !can_act_as_a_member() {
        return;
    }
    let env = env_for_members();
    env.make_image("app");
    let outside = env.tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let victim = outside.join("app.lock");
    fs::write(&victim, "secret").unwrap();
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o600)).unwrap();
    let before = fs::metadata(&victim).unwrap();
    let (init, go) = env.paused(["init", "--group", &GID.to_string()], "init-share");
    let images = env.root.join("locks/images");
    fs::rename(&images, env.root.join("locks/images.real")).unwrap();
    std::os::unix::fs::symlink(&outside, &images).unwrap();
    fs::remove_file(&go).unwrap();
    let out = init.finish();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let after = fs::metadata(&victim).unwrap();
    assert_eq!(
        (after.gid(), after.mode()),
        (before.gid(), before.mode()),
        "a file outside the root was given the group's modes"
    );
}

/// A victim outside every store: a directory or file of root's, mode 700
/// or 600, and what its mode and group are.
fn victim(env: &Env, dir: bool) -> (std::path::PathBuf, (u32, u32)) {
    let v = env
        .tmp
        .path()
        .join(if dir { "victim-dir" } else { "victim-file" });
    if dir {
        fs::create_dir(&v).unwrap();
        fs::set_permissions(&v, fs::Permissions::from_mode(0o700)).unwrap();
    } else {
        fs::write(&v, "secret").unwrap();
        fs::set_permissions(&v, fs::Permissions::from_mode(0o600)).unwrap();
    }
    let m = fs::metadata(&v).unwrap();
    (v, (m.mode(), m.gid()))
}

fn mode_and_group(p: &Path) -> (u32, u32) {
    let m = fs::metadata(p).unwrap();
    (m.mode(), m.gid())
}

/// An outside images directory swapped for a link (its parent is a
/// project directory the group may write) after init checked it: the
/// directory init checked gets the group, through its descriptor; the
/// link's target is left as it was.
#[test]
fn an_outside_images_directory_swapped_for_a_link_leads_sharing_nowhere() {
    if !can_act_as_a_member() {
        return;
    }
    let env = env_for_members();
    let (victim, before) = victim(&env, true);
    let img = env.tmp.path().join("images");
    let (init, go) = env.paused(
        [
            "init",
            "--group",
            &GID.to_string(),
            "--images-dir",
            img.to_str().unwrap(),
        ],
        "init-share",
    );
    fs::rename(&img, env.tmp.path().join("images.real")).unwrap();
    std::os::unix::fs::symlink(&victim, &img).unwrap();
    fs::remove_file(&go).unwrap();
    let _ = init.finish();
    assert_eq!(
        mode_and_group(&victim),
        before,
        "the link's target was shared"
    );
    assert_eq!(
        fs::metadata(env.tmp.path().join("images.real"))
            .unwrap()
            .gid(),
        GID
    );
}

/// A catalog swapped for a link between its making and its being given
/// to the group: the link's target keeps its mode.
#[test]
fn a_catalog_swapped_for_a_link_is_not_shared_through_it() {
    if !can_act_as_a_member() {
        return;
    }
    let env = env_for_members();
    env.ok(["init", "--group", &GID.to_string()]);
    env.make_image("base");
    let (victim, before) = victim(&env, false);
    let db = env.root.join("stowage.db");
    let _ = fs::remove_file(&db);
    let (look, go) = env.paused(["images"], "catalog-made");
    fs::rename(&db, env.root.join("elsewhere.db")).unwrap();
    std::os::unix::fs::symlink(&victim, &db).unwrap();
    fs::remove_file(&go).unwrap();
    let _ = look.finish();
    assert_eq!(
        mode_and_group(&victim),
        before,
        "the link's target was shared"
    );
}

/// A part with another name (a hard link to a file outside the store) is
/// refused by the repair of a group store's modes, not given the group; the
/// files check sets it aside, so the repair ends with the store whole. A
/// hard-linked `store.conf`, which no check sets aside (it is replaced by
/// rename), stays a problem the repair names.
#[test]
fn a_hard_link_in_the_layout_is_not_given_the_group() {
    if !can_act_as_a_member() {
        return;
    }
    let env = env_for_members();
    env.ok(["init", "--group", &GID.to_string()]);
    let (victim, before) = victim(&env, false);
    fs::hard_link(&victim, env.root.join("locks/images/zzz.lock")).unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(mode_and_group(&victim), before, "a file outside was shared");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("zzz.lock"),
        "{}",
        show(&out)
    );
    let conf = env.root.join("store.conf");
    let copy = env.tmp.path().join("conf-copy");
    fs::copy(&conf, &copy).unwrap();
    fs::set_permissions(&copy, fs::Permissions::from_mode(0o600)).unwrap();
    fs::remove_file(&conf).unwrap();
    fs::hard_link(&copy, &conf).unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("store.conf") && said.contains("other names"),
        "{said}"
    );
    assert_eq!(fs::metadata(&copy).unwrap().mode() & 0o777, 0o600);
}

/// `ln -s TARGET LINK` as uid 65534 in group 100: whether it worked.
fn member_links(target: &Path, link: &Path) -> Output {
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid=65534",
        "--regid=100",
        "--clear-groups",
        "--",
        "ln",
        "-s",
    ])
    .arg(target)
    .arg(link);
    output(c)
}

/// While a copy (`--from`) is made in a group store, no member can create
/// or rename a name in it — not even the member who made the image first
/// and owned its directory: an entry's owner and mode are set by its name,
/// so a link swapped in between would carry them to a file elsewhere.
/// When the copy is done, its top has the base's mode again.
#[test]
fn no_member_can_swap_a_name_in_a_copy_under_way() {
    if !can_act_as_a_member() {
        return;
    }
    for first_made_by_member in [false, true] {
        let env = env_for_members();
        env.ok(["init", "--group", "100"]);
        env.build(
            "base",
            "echo a > \"$STOWAGE_IMAGE_DIR/a\"; mkfifo \"$STOWAGE_IMAGE_DIR/z\"",
        );
        if first_made_by_member {
            let out = as_member(&env, &["exec", "--write", "app", "--", "true"]);
            assert_eq!(code(&out), Some(0), "{}", show(&out));
        }
        let base_mode = fs::metadata(env.root.join("img/base")).unwrap().mode() & 0o7777;
        let (bg, pause) = env.paused(
            ["exec", "--write", "app", "--from", "base", "--", "true"],
            "clone-copying",
        );
        let victim = env.tmp.path().join("victim");
        fs::write(&victim, "precious").unwrap();
        let out = member_links(&victim, &env.root.join("img/app/planted"));
        assert_ne!(
            code(&out),
            Some(0),
            "made by the member first: {first_made_by_member}: a member made a name in the copy"
        );
        fs::remove_file(&pause).unwrap();
        let out = bg.finish();
        assert_eq!(code(&out), Some(0), "{}", show(&out));
        assert_eq!(env.state("app").as_deref(), Some("ready"));
        let m = fs::metadata(env.root.join("img/app")).unwrap();
        assert_eq!(
            m.mode() & 0o7777,
            base_mode,
            "the copy's top has the base's mode"
        );
    }
}

/// Builds `image` as uid 65534 with `script`, its tree then readable and
/// writable by the group.
fn member_builds(env: &Env, image: &str, script: &str) {
    let script = format!("{script} && chmod -R g+rwX \"$STOWAGE_IMAGE_DIR\"");
    builds_as(env, 65534, image, &script);
}

/// Member `uid` writes `image` with `script`, which must succeed.
fn builds_as(env: &Env, uid: u32, image: &str, script: &str) {
    let out = as_uid(
        env,
        uid,
        &["exec", "--write", image, "--", "sh", "-c", script],
    );
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// What a killed removal of member 1001's leaves in the trash: entry
/// `name` holding `d/q`, all 1001's, with `private` (relative to the
/// entry; "" for the entry itself) mode 700.
fn left_in_trash(env: &Env, name: &str, private: &str) {
    let entry = env.root.join("trash").join(name);
    fs::create_dir_all(entry.join("d")).unwrap();
    fs::write(entry.join("d/q"), "q").unwrap();
    for p in [entry.join("d/q"), entry.join("d"), entry.clone()] {
        std::os::unix::fs::chown(&p, Some(1001), Some(GID)).unwrap();
    }
    fs::set_permissions(entry.join(private), fs::Permissions::from_mode(0o700)).unwrap();
}

/// A member rebuilds from a base an image another member made first, and
/// a copy that fails (a base file it may not read) leaves nothing the
/// other member cannot remove.
#[test]
fn members_copy_into_and_remove_each_others_images() {
    let Some(env) = group_store() else {
        return;
    };
    member_builds(
        &env,
        "base",
        "mkdir -p \"$STOWAGE_IMAGE_DIR/d/e\" && echo x > \"$STOWAGE_IMAGE_DIR/d/e/z\"",
    );
    let out = as_member(&env, &["exec", "--write", "app", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = as_uid(
        &env,
        1234,
        &["exec", "--write", "app", "--from", "base", "--", "true"],
    );
    assert_eq!(
        code(&out),
        Some(0),
        "the second member's rebuild: {}",
        show(&out)
    );
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    // A copy that fails deep in the tree: the first member's file, no
    // longer readable by the group.
    fs::set_permissions(
        env.root.join("img/base/d/e/z"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let out = as_uid(
        &env,
        1234,
        &["exec", "--write", "new", "--from", "base", "--", "true"],
    );
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    let out = as_member(&env, &["rm", "new"]);
    assert_eq!(
        code(&out),
        Some(0),
        "the first member removes it: {}",
        show(&out)
    );
    let out = as_member(&env, &["gc"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(!env.root.join("img/new").exists());
}

/// A copy killed mid-way leaves its tree private to its maker (nobody
/// could swap names in it): another member's `rm` and `gc` cannot delete
/// it, and say whose it is and who can; nothing else is lost.
#[test]
fn a_killed_copy_says_whose_tree_is_left() {
    let Some(env) = group_store() else {
        return;
    };
    member_builds(
        &env,
        "base",
        "for i in 1 2 3; do echo $i > \"$STOWAGE_IMAGE_DIR/f$i\"; done",
    );
    let bg = paused_as(
        &env,
        1234,
        &["--write", "new", "--from", "base"],
        "clone-copying",
    );
    bg.kill_all();
    let out = as_member(&env, &["rm", "new"]);
    let said = format!("{}{}", stderr(&out), String::from_utf8_lossy(&out.stdout));
    assert!(
        said.contains("uid 1234") && said.contains("only that user or root"),
        "{}",
        show(&out)
    );
    let out = as_member(&env, &["gc"]);
    assert!(stderr(&out).contains("uid 1234"), "{}", show(&out));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    env.ok(["gc"]);
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
}

/// `stowage ARGS…` as member `uid`: its exit code and what it said.
fn said_by(env: &Env, uid: u32, args: &[&str]) -> (Option<i32>, String) {
    let out = as_uid(env, uid, args);
    let said = format!("{}{}", stderr(&out), String::from_utf8_lossy(&out.stdout));
    (code(&out), said)
}

/// A removal that permissions refuse names the directory that refused it
/// and its owner — a private directory deep in another member's tree, a
/// killed removal's private trash entry, a trash that refuses the move —
/// and never blames an owner for what no owner causes (an immutable file).
#[test]
fn a_refused_removal_names_the_directory_that_refused_and_its_owner() {
    let Some(env) = group_store() else {
        return;
    };
    let build = |uid: u32, image: &str, script: &str| builds_as(&env, uid, image, script);
    // 1001's tree, open to the group, holding 1002's private directory.
    build(
        1001,
        "x",
        "mkdir \"$STOWAGE_IMAGE_DIR/d\" && echo a > \"$STOWAGE_IMAGE_DIR/d/a\" && chmod -R g+rwX \"$STOWAGE_IMAGE_DIR\"",
    );
    build(
        1002,
        "x",
        "mkdir -m 700 \"$STOWAGE_IMAGE_DIR/priv\" && echo b > \"$STOWAGE_IMAGE_DIR/priv/b\"",
    );
    let (exit, said) = said_by(&env, 1003, &["rm", "x"]);
    assert_eq!(exit, Some(1), "{said}");
    assert!(
        said.contains("\"priv\"") && said.contains("uid 1002's") && !said.contains("uid 1001"),
        "{said}"
    );
    // The tree is in the trash now; the member who owns its top cannot
    // empty it either, and is told whose directory stops it.
    let (exit, said) = said_by(&env, 1001, &["gc"]);
    assert_eq!(exit, Some(1), "{said}");
    assert!(said.contains("uid 1002's"), "{said}");
    let (exit, said) = said_by(&env, 1002, &["gc"]);
    assert_eq!(exit, Some(0), "{said}");
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);

    // A killed removal's entry in the trash, private to its member.
    left_in_trash(&env, "1.2.0.z", "");
    for args in [&["gc"][..], &["doctor", "--repair"][..]] {
        let (_, said) = said_by(&env, 1003, args);
        assert!(said.contains("uid 1001's"), "{args:?}: {said}");
    }
    env.ok(["gc"]);

    // A trash that refuses the move: the trash is named, not the tree's
    // owner; the image stays as it was.
    build(
        1001,
        "w",
        "echo a > \"$STOWAGE_IMAGE_DIR/a\" && chmod -R g+rwX \"$STOWAGE_IMAGE_DIR\"",
    );
    let trash = env.root.join("trash");
    let mode = fs::metadata(&trash).unwrap().mode();
    fs::set_permissions(&trash, fs::Permissions::from_mode(0o755)).unwrap();
    let (exit, said) = said_by(&env, 1003, &["rm", "w"]);
    fs::set_permissions(&trash, fs::Permissions::from_mode(mode & 0o7777)).unwrap();
    assert_eq!(exit, Some(1), "{said}");
    assert!(
        said.contains("the trash is uid 0's") && !said.contains("uid 1001"),
        "{said}"
    );
    assert_eq!(env.state("w").as_deref(), Some("ready"));

    // An immutable file is nobody's doing: no owner is named.
    let file = env.root.join("img/w/a");
    let immutable = Command::new("chattr").arg("+i").arg(&file).status();
    if !immutable.is_ok_and(|s| s.success()) {
        eprintln!("skipping the immutable file: chattr +i does not work here");
        return;
    }
    let (exit, said) = said_by(&env, 1003, &["rm", "w"]);
    let out = env.run(["gc"]);
    // The file went to the trash with its tree before it refused.
    let unset = Command::new("chattr")
        .args(["-R", "-i"])
        .arg(env.root.join("trash"))
        .status();
    assert!(unset.is_ok_and(|s| s.success()));
    assert_eq!(exit, Some(1), "{said}");
    assert!(!said.contains("uid "), "{said}");
    assert!(!stderr(&out).contains("uid "), "{}", show(&out));
    env.ok(["gc"]);
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
}

/// A deletion refused deep in a tree names the directory that refused it
/// by its path from the tree's top — the one whose access the step needed,
/// not its parent — and a sticky directory of another member as sticky;
/// a name with a newline never makes a second line of a message.
#[test]
fn a_refused_deletion_names_the_refusing_directory_by_its_path() {
    let Some(env) = group_store() else {
        return;
    };
    let build = |uid: u32, image: &str, script: &str| builds_as(&env, uid, image, script);
    // 1001's tree: x (group may list and enter, not delete in it), deep
    // down d/d/d, 1003's private y in it.
    build(
        1001,
        "deep",
        "cd \"$STOWAGE_IMAGE_DIR\" && mkdir -p d/d/d && chmod -R g+rwX .",
    );
    build(
        1003,
        "deep",
        "cd \"$STOWAGE_IMAGE_DIR\" && mkdir -m 700 d/d/d/y && echo z > d/d/d/y/z",
    );
    build(1001, "deep", "chmod 2755 \"$STOWAGE_IMAGE_DIR/d/d/d\"");
    let (exit, said) = said_by(&env, 1002, &["rm", "deep"]);
    assert_eq!(exit, Some(1), "{said}");
    assert!(
        said.contains("directory \"d/d/d/y\" in it is uid 1003's"),
        "{said}"
    );
    let (_, said) = said_by(&env, 1003, &["gc"]);
    assert!(
        said.contains("directory \"d/d/d\" in it is uid 1001's"),
        "{said}"
    );
    let (exit, said) = said_by(&env, 1001, &["gc"]);
    assert!(exit == Some(1) && said.contains("uid 1003's"), "{said}");
    env.ok(["gc"]);

    // A sticky directory of 1001's holding 1001's file: 1002 may not
    // delete in it, and is told why.
    build(
        1001,
        "sticky",
        "cd \"$STOWAGE_IMAGE_DIR\" && mkdir s && echo a > s/a && chmod -R g+rwX . && chmod 1777 s",
    );
    let (exit, said) = said_by(&env, 1002, &["rm", "sticky"]);
    assert_eq!(exit, Some(1), "{said}");
    assert!(
        said.contains("directory \"s\" in it is sticky and uid 1001's"),
        "{said}"
    );
    env.ok(["gc"]);

    // A trash entry named with a newline and a forged line, that 1003
    // may not delete: one line says so, escaped.
    left_in_trash(&env, "e1\nstowage: removed 'prod'", "d");
    let (exit, said) = said_by(&env, 1003, &["gc"]);
    assert_eq!(exit, Some(1), "{said}");
    assert!(
        !said
            .lines()
            .any(|l| l.starts_with("stowage: removed 'prod'")),
        "{said}"
    );
    env.ok(["gc"]);
    assert_eq!(fs::read_dir(env.root.join("trash")).unwrap().count(), 0);
}

/// A member rewrites the group store's `store.conf` to name a directory
/// of another user's that the member may not write, and plants a record
/// saying an image there failed: no command of that user's makes, marks,
/// adopts, shares or deletes anything there. Only `init --images-dir`
/// naming a directory makes it the store's.
#[test]
fn a_configuration_a_member_rewrote_sends_nothing_outside_the_store() {
    let Some(env) = group_store() else {
        return;
    };
    env.make_image("base");
    let data = env.tmp.path().join("data");
    fs::create_dir_all(data.join("projects/thesis")).unwrap();
    fs::write(data.join("projects/thesis/ch1.tex"), "chapter 1").unwrap();
    let before = mode_and_group(&data);
    let conf = env.root.join("store.conf");
    let id = fs::read_to_string(&conf).unwrap();
    let id = id.lines().find(|l| l.starts_with("id=")).unwrap();
    let planted = format!("stowage-store 1\n{id}\nimages={}\n", data.display());
    let mut c = Command::new("setpriv");
    c.args(["--reuid=65534", "--regid=100", "--clear-groups", "--"])
        .args([
            "sh",
            "-c",
            "printf %s \"$1\" > \"$2.new\" && mv \"$2.new\" \"$2\"",
        ])
        .args(["sh", &planted, conf.to_str().unwrap()]);
    assert_eq!(code(&output(c)), Some(0), "the member rewrites store.conf");
    plant_failed_record(&env, "projects", &data);
    for args in [
        &["gc"][..],
        &["rm", "projects"],
        &["exec", "--write", "newthing", "--", "true"],
        &["exec", "--write", "projects", "--", "true"],
        &["doctor", "--repair"],
        &["init"],
    ] {
        let out = env.run(args);
        assert_ne!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    assert_eq!(
        fs::read_to_string(data.join("projects/thesis/ch1.tex")).unwrap(),
        "chapter 1"
    );
    assert_eq!(
        fs::read_dir(&data).unwrap().count(),
        1,
        "nothing made there"
    );
    assert_eq!(mode_and_group(&data), before, "not shared");
    assert!(!has_claim(&data), "not marked as the store's");
    // Named on the command line, a directory becomes the store's for every member.
    let env = group_store().unwrap();
    let ext = env.tmp.path().join("images");
    fs::create_dir(&ext).unwrap();
    std::os::unix::fs::chown(&ext, None, Some(GID)).unwrap();
    fs::set_permissions(&ext, fs::Permissions::from_mode(0o2775)).unwrap();
    let out = as_member(&env, &["init", "--images-dir", ext.to_str().unwrap()]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    member_builds(&env, "app", "true");
    env.ok(["exec", "--write", "app2", "--from", "app", "--", "true"]);
    env.ok(["rm", "app"]);
    assert!(!ext.join("app").exists() && ext.join("app2").is_dir());
}

/// A record of image `name` in `images`, saying its writer failed, as a
/// member may write one into its lock file.
fn plant_failed_record(env: &Env, name: &str, images: &Path) {
    use stowage::image_record::{self, ImagesDir, Record, State};
    let path = env.root.join(format!("locks/images/{name}.lock"));
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .unwrap();
    let mut seen = image_record::read(&file).unwrap();
    let record = Record {
        state: State::Incomplete,
        outcome: Some("exit 1".into()),
        ..Record::new(name, ImagesDir::External(images.to_owned()), 0)
    };
    image_record::write(&file, &mut seen, &record).unwrap();
    std::os::unix::fs::chown(&path, Some(65534), Some(GID)).unwrap();
}

fn has_claim(dir: &Path) -> bool {
    let c = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    // SAFETY: NUL-terminated path and name; a size query (no buffer).
    let n = unsafe {
        libc::getxattr(
            c.as_ptr(),
            c"user.stowage.store".as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    n >= 0
}

/// The claim is judged on the directory a command then uses, not on a path
/// looked at before: a link in the configured path that a member swaps, from
/// a directory carrying the store's claim to one of another user's, between
/// the look and the use, gets nothing made there.
#[test]
fn a_link_swapped_after_the_claim_was_looked_at_leads_nowhere() {
    let Some(env) = group_store() else {
        return;
    };
    let member = env.tmp.path().join("member");
    let claimed = member.join("real/work");
    fs::create_dir_all(&claimed).unwrap();
    std::os::unix::fs::chown(&claimed, None, Some(GID)).unwrap();
    fs::set_permissions(&claimed, fs::Permissions::from_mode(0o2775)).unwrap();
    let link = member.join("p");
    std::os::unix::fs::symlink(member.join("real"), &link).unwrap();
    let images = link.join("work");
    env.ok(["init", "--images-dir", images.to_str().unwrap()]);
    // The member drops the directory's recorded identity, which would tell the swap otherwise.
    let conf = env.root.join("store.conf");
    let text = fs::read_to_string(&conf).unwrap();
    let kept: String = text
        .lines()
        .filter(|l| !l.starts_with("identity="))
        .map(|l| format!("{l}\n"))
        .collect();
    fs::write(&conf, kept).unwrap();
    let victim = env.tmp.path().join("victim");
    fs::create_dir_all(victim.join("work")).unwrap();
    let (write, go) = env.paused(
        ["exec", "--write", "new", "--", "true"],
        "images-dir-checked",
    );
    fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    fs::remove_file(&go).unwrap();
    let out = write.finish();
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    let made = fs::read_dir(victim.join("work")).unwrap().count();
    assert_eq!(made, 0, "made in the other directory");
}

/// The owner of a private store kept out by a directory's mode (a `chmod
/// 000` of `locks/images`, or of the root) is told that mode is the cause,
/// naming the directory, its mode and the chmod that gives it back; not
/// (as before) that the store is theirs and not shared, with `init --group`
/// as the fix.
#[test]
fn the_owner_kept_out_by_a_mode_is_told_the_mode_not_sharing() {
    if !root_or_skip("acting as the store's owner, another user") {
        return;
    }
    let env = unprivileged_env();
    assert_eq!(code(&unprivileged(&env, &["init"])), Some(0));
    unprivileged_build(&env, "x", "true");
    for dir in [env.root.join("locks/images"), env.root.clone()] {
        let mode = fs::metadata(&dir).unwrap().mode() & 0o7777;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o000)).unwrap();
        let mut outs = vec![unprivileged(&env, &["exec", "--read", "x", "--", "true"])];
        if dir == env.root {
            // A command that only reads is not told the root holds no store.
            outs.push(unprivileged(&env, &["images"]));
        }
        fs::set_permissions(&dir, fs::Permissions::from_mode(mode)).unwrap();
        for out in outs {
            assert_eq!(code(&out), Some(1), "{}", show(&out));
            let said = stderr(&out);
            let cause = format!(
                "{} is mode 000, which keeps you, its owner, out",
                dir.display()
            );
            assert!(said.contains(&cause), "{}", show(&out));
            let fix = format!("'chmod u+rwx {}'", dir.display());
            assert!(said.contains(&fix), "{}", show(&out));
            assert!(!said.contains("init"), "{}", show(&out));
            assert_eq!(said.lines().count(), 1, "{}", show(&out));
        }
    }
    // A directory of the store another user owns: its owner is the cause, not a mode to change.
    let dir = env.root.join("locks/images");
    let uid = fs::metadata(&dir).unwrap().uid();
    std::os::unix::fs::chown(&dir, Some(0), None).unwrap();
    let out = unprivileged(&env, &["exec", "--write", "y", "--", "true"]);
    std::os::unix::fs::chown(&dir, Some(uid), None).unwrap();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let cause = format!("{} belongs to uid 0", dir.display());
    assert!(stderr(&out).contains(&cause), "{}", show(&out));
    assert_eq!(
        code(&unprivileged(&env, &["exec", "--read", "x", "--", "true"])),
        Some(0)
    );
}

/// A tree measured by a member who may not read all of it is shown at what
/// it saw, not kept at that size: one who may measures it whole, and gc's
/// budget counts it whole. Before, the first look's figure (the tree less its private
/// directory) was kept, and `gc --max-size` freed nothing of 5 MB.
#[test]
fn a_size_measured_in_part_is_not_kept() {
    let Some(env) = group_store() else { return };
    let script = "mkdir -m 700 \"$STOWAGE_IMAGE_DIR/p\" && \
                  head -c 5000000 /dev/zero > \"$STOWAGE_IMAGE_DIR/p/f\"";
    builds_as(&env, 1001, "big", script);
    let out = as_member(&env, &["images", "--json"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let seen: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let part = seen[0]["size_bytes"].as_u64().unwrap();
    assert!(part < 5_000_000, "the member sees what it may read: {seen}");
    let size = env.images_json()[0]["size_bytes"].as_u64().unwrap();
    assert!(size >= 5_000_000, "measured whole by root: {size}");
    // The member's budget counts the size kept, not the part it may see.
    let out = as_member(&env, &["gc", "--max-size", "1M", "--dry-run", "--json"]);
    let said: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(said["size_before"].as_u64() >= Some(5_000_000), "{said}");
    assert_eq!(said["removed"][0]["name"], "big", "{said}");
    let out = env.ok(["gc", "--max-size", "1M"]);
    assert!(env.images_json().is_empty(), "{}", show(&out));
}

/// The store's owner, a member and a user of a second group, as uids with
/// no name (setpriv needs none): the owner is in both groups.
const OWNER: u32 = 64001;
const MEMBER: u32 = 64002;
const OTHER: u32 = 64003;
/// A second group, and a member's own group (neither the store's).
const GID2: u32 = 64010;
const OWN_GID: u32 = 64011;

/// `stowage --root ROOT ARGS…` as `uid` in `groups` (the first its
/// primary) under `umask`.
fn as_ids(env: &Env, uid: u32, groups: &[u32], umask: &str, args: &[&str]) -> Output {
    let list: Vec<String> = groups.iter().map(u32::to_string).collect();
    let mut c = Command::new("setpriv");
    c.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={}", groups[0]))
        .arg(format!("--groups={}", list.join(",")))
        .args([
            "--",
            "sh",
            "-c",
            "umask \"$1\"; shift; exec \"$@\"",
            "sh",
            umask,
        ])
        .arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(args)
        .env("USER", "nobody")
        .env_remove("STOWAGE_ROOT");
    output(c)
}

/// A group store of group 100 whose root `OWNER` made (in a directory of
/// root's), its owner in groups 100 and `GID2`.
/// A group store (group 100) its owner, not root, made; `None` (the reason printed) where this
/// process cannot act as another user.
fn owners_store() -> Option<Env> {
    if !can_act_as_a_member() {
        return None;
    }
    let env = env_for_members();
    owners_group_store(&env);
    Some(env)
}

fn owners_group_store(env: &Env) {
    fs::create_dir(&env.root).unwrap();
    chown(&env.root, OWNER, GID);
    let out = as_ids(env, OWNER, &[GID, GID2], "022", &["init", "--group", "100"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

fn ok_as(env: &Env, uid: u32, groups: &[u32], args: &[&str]) {
    let out = as_ids(env, uid, groups, "022", args);
    assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
}

#[test]
fn root_repairs_and_uses_a_group_store_of_a_group_it_is_not_in() {
    let Some(env) = owners_store() else { return };
    ok_as(
        &env,
        MEMBER,
        &[GID],
        &["exec", "--write", "b", "--", "true"],
    );
    // The member's lock file loses its group bits (their own chmod): the owner may not fix it.
    let lock = env.lock_file("b");
    fs::set_permissions(&lock, fs::Permissions::from_mode(0o600)).unwrap();
    let out = as_ids(&env, OWNER, &[GID], "022", &["doctor", "--repair"]);
    assert!(
        stdout(&out).contains("left to their owners or root"),
        "{}",
        show(&out)
    );
    // Root, whom that sends the owner to, can: root is in no group of the store's.
    for args in [
        &["doctor", "--repair"][..],
        &["init", "--group", "100"],
        &["gc"],
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    let (mode, group) = mode_and_group(&lock);
    assert_eq!((mode & 0o7777, group), (0o660, GID), "{}", lock.display());
    ok_as(&env, OWNER, &[GID], &["exec", "--read", "b", "--", "true"]);
    // What root makes in the store is the group's.
    env.ok(["exec", "--write", "r", "--", "true"]);
    env.ok(["slots", "set", "pull", "1"]);
    assert_every_part_shared(&env.root);
    ok_as(
        &env,
        MEMBER,
        &[GID],
        &["exec", "--write", "r", "--slot", "pull", "--", "true"],
    );
    // Another user's private store stays theirs: root is refused there.
    let private = env.tmp.path().join("private");
    fs::create_dir(&private).unwrap();
    std::os::unix::fs::chown(&private, Some(OWNER), Some(OWNER)).unwrap();
    let mut init = Command::new("setpriv");
    init.args([
        &format!("--reuid={OWNER}"),
        &format!("--regid={OWNER}"),
        "--clear-groups",
        "--",
    ])
    .arg(bin())
    .arg("--root")
    .arg(&private)
    .arg("init");
    assert_eq!(code(&output(init)), Some(0));
    let mut images = Command::new(bin());
    images.arg("--root").arg(&private).arg("images");
    let out = output(images);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("not shared with a group of yours"),
        "{}",
        show(&out)
    );
}

#[test]
fn a_default_acl_above_a_group_store_leaves_every_new_part_group_writable() {
    if !can_act_as_a_member() {
        return;
    }
    let env = env_for_members();
    // A project directory whose default ACL gives the group read only: it overrides the umask.
    if !default_acl(env.tmp.path(), "u::rwx,g::rx,o::rx") {
        return;
    }
    owners_group_store(&env);
    let out = as_ids(&env, OWNER, &[GID], "022", &["doctor"]);
    assert!(
        stdout(&out).contains("every part is group-writable"),
        "{}",
        show(&out)
    );
    ok_as(
        &env,
        MEMBER,
        &[GID],
        &["exec", "--write", "b", "--", "true"],
    );
    ok_as(&env, MEMBER, &[GID], &["slots", "set", "pull", "1"]);
    ok_as(
        &env,
        MEMBER,
        &[GID],
        &["exec", "--slot", "pull", "--", "true"],
    );
    assert_every_part_shared(&env.root);
    ok_as(
        &env,
        OWNER,
        &[GID],
        &["exec", "--read", "b", "--slot", "pull", "--", "true"],
    );
}

#[test]
fn a_member_kept_out_by_a_parts_group_is_told_the_group_and_whose_repair_fixes_it() {
    let Some(env) = owners_store() else { return };
    ok_as(
        &env,
        MEMBER,
        &[GID],
        &["exec", "--write", "b", "--", "true"],
    );
    ok_as(&env, MEMBER, &[GID], &["slots", "set", "pull", "1"]);
    // The owner moves the store to its second group; the member's parts stay in the first.
    let out = as_ids(
        &env,
        OWNER,
        &[GID, GID2],
        "022",
        &["init", "--group", &GID2.to_string()],
    );
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let (lock, theirs) = (env.lock_file("b"), format!("uid {MEMBER}"));
    let exec = as_ids(
        &env,
        OTHER,
        &[GID2],
        "022",
        &["exec", "--read", "b", "--", "true"],
    );
    assert_eq!(code(&exec), Some(1), "{}", show(&exec));
    let doctor = as_ids(&env, OTHER, &[GID2], "022", &["doctor"]);
    let said = [stderr(&exec), stdout(&doctor)];
    // exec's refusal, and doctor's `files` line (its `sharing` line lists every part).
    let line = |s: &String| {
        let mut lines = s.lines();
        lines
            .find(|l| l.contains("b.lock") && !l.contains("sharing"))
            .unwrap_or("")
            .to_owned()
    };
    for said in said.iter().map(line) {
        let group = format!("100) is not the store's {GID2}");
        assert!(
            said.contains(&group),
            "{said}\n{}\n{}",
            show(&exec),
            show(&doctor)
        );
        assert!(
            said.contains(&theirs) && said.contains(" doctor --repair'"),
            "{said}"
        );
        assert!(!said.contains("chmod 666"), "{said}");
    }
    // The member's slot class: the same cause, the same fix.
    let out = as_ids(
        &env,
        OTHER,
        &[GID2],
        "022",
        &["exec", "--slot", "pull", "--", "true"],
    );
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("not the store's"), "{}", show(&out));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", show(&out));
    env.ok(["doctor", "--repair"]);
    let (mode, group) = mode_and_group(&lock);
    assert_eq!((mode & 0o7777, group), (0o664, GID2), "{}", lock.display());
    ok_as(
        &env,
        OTHER,
        &[GID2],
        &["exec", "--read", "b", "--slot", "pull", "--", "true"],
    );
}

#[test]
fn a_members_new_outside_images_directory_is_the_groups() {
    let Some(env) = owners_store() else { return };
    // The member's directory, of the member's own group, not setgid; the member's umask strict.
    let parent = env.tmp.path().join("members");
    fs::create_dir(&parent).unwrap();
    chown(&parent, MEMBER, OWN_GID);
    let images = parent.join("img");
    let dir = images.to_str().unwrap();
    let out = as_ids(
        &env,
        MEMBER,
        &[OWN_GID, GID],
        "077",
        &["init", "--images-dir", dir],
    );
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let (mode, group) = mode_and_group(&images);
    assert_eq!((mode & 0o2070, group), (0o2070, GID), "{mode:o}");
    ok_as(
        &env,
        MEMBER,
        &[OWN_GID, GID],
        &["exec", "--write", "x", "--", "true"],
    );
    ok_as(
        &env,
        OWNER,
        &[GID],
        &["exec", "--read", "x", "--write", "y", "--", "true"],
    );
    // One the owner may not read is said so, never "not marked as this store's".
    fs::set_permissions(&images, fs::Permissions::from_mode(0o700)).unwrap();
    let out = as_ids(
        &env,
        OWNER,
        &[GID],
        "022",
        &["exec", "--read", "x", "--", "true"],
    );
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("cannot be read"), "{}", show(&out));
    assert!(!stderr(&out).contains("not marked"), "{}", show(&out));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", show(&out));
}

/// `doctor --repair` changes nothing through another filesystem mounted
/// on a part's place: a directory bind-mounted on an image's directory
/// keeps its mode, group and default ACL (before, root's repair gave a
/// user's private directory outside the store the group, group write and
/// setgid, and removed its default ACL).
#[test]
fn a_repair_changes_nothing_mounted_on_a_parts_place() {
    let Some(env) = group_store() else { return };
    env.ok(["exec", "--write", "bm", "--", "true"]);
    let victim = env.tmp.path().join("victim");
    fs::create_dir(&victim).unwrap();
    std::os::unix::fs::chown(&victim, Some(64003), Some(64003)).unwrap();
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o700)).unwrap();
    let acl = Command::new("setfacl")
        .args(["-d", "-m", "u::rwx,g::rx,o::-"])
        .arg(&victim)
        .status()
        .is_ok_and(|s| s.success());
    let place = env.root.join("img/bm");
    let mounted = Command::new("mount")
        .arg("--bind")
        .arg(&victim)
        .arg(&place)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("skipping: cannot bind-mount here");
        return;
    }
    // A file mounted on a lock file's place, and a directory of files on the leases directory's.
    let secret = env.tmp.path().join("secret");
    fs::write(&secret, "x").unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
    let keys = env.tmp.path().join("keys");
    fs::create_dir(&keys).unwrap();
    fs::write(keys.join("k.lock"), "x").unwrap();
    fs::set_permissions(keys.join("k.lock"), fs::Permissions::from_mode(0o600)).unwrap();
    let (lock, leases) = (env.lock_file("bm"), env.root.join("locks/leases"));
    for (from, to) in [(&secret, &lock), (&keys, &leases)] {
        let ok = Command::new("mount")
            .arg("--bind")
            .arg(from)
            .arg(to)
            .status();
        assert!(ok.is_ok_and(|s| s.success()), "mount {}", to.display());
    }
    let out = env.run(["doctor", "--repair"]);
    let acl_kept = !acl
        || xattr_names(&victim)
            .iter()
            .any(|n| n == "system.posix_acl_default");
    for at in [&place, &lock, &leases] {
        let _ = Command::new("umount").arg(at).status();
    }
    let (mode, group) = mode_and_group(&victim);
    assert_eq!((mode & 0o7777, group), (0o700, 64003), "{}", show(&out));
    assert!(acl_kept, "{}", show(&out));
    for file in [secret, keys.join("k.lock")] {
        let (mode, group) = mode_and_group(&file);
        assert_eq!((mode & 0o7777, group), (0o600, 0), "{}", show(&out));
    }
    assert!(
        stdout(&out).contains("another filesystem"),
        "{}",
        show(&out)
    );
}

fn xattr_names(p: &Path) -> Vec<String> {
    let out = Command::new("getfattr")
        .args(["-d", "-m", "-", "--absolute-names"])
        .arg(p)
        .output();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split('=').next())
        .map(str::to_owned)
        .collect()
}

/// A member kept out of a part is told the part's real fault: a directory
/// its group may write but not search, an outside images directory whose
/// default ACL would keep what members make private (before: "not
/// group-writable", and "lacks the store's group" of a directory of the
/// store's group).
#[test]
fn a_member_is_told_the_real_fault_of_a_part_that_keeps_it_out() {
    let Some(env) = group_store() else { return };
    env.ok(["exec", "--write", "x", "--", "true"]);
    let images = env.root.join("locks/images");
    fs::set_permissions(&images, fs::Permissions::from_mode(0o2765)).unwrap();
    let out = as_member(&env, &["exec", "--write", "new", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("its group may not search it"),
        "{}",
        show(&out)
    );

    // A store with no image yet, whose images a member moves outside.
    let Some(env) = group_store() else { return };
    let ext = env.tmp.path().join("ext");
    fs::create_dir(&ext).unwrap();
    std::os::unix::fs::chown(&ext, None, Some(GID)).unwrap();
    fs::set_permissions(&ext, fs::Permissions::from_mode(0o2770)).unwrap();
    if !default_acl(&ext, "g::rwx") {
        return;
    }
    let conf = env.root.join("store.conf");
    let before = fs::read_to_string(&conf).unwrap();
    let out = as_member(&env, &["init", "--images-dir", ext.to_str().unwrap()]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("has a default ACL"), "{}", show(&out));
    // Refused before anything is recorded: the store keeps its images directory.
    assert_eq!(fs::read_to_string(&conf).unwrap(), before);
    env.ok(["exec", "--write", "x", "--", "true"]);
    assert!(env.root.join("img/x").is_dir());
}

/// A group store's images directory outside the root is one of its parts
/// to doctor: a default ACL or another group on it is named, and a repair
/// by root gives it what the parts get.
#[test]
fn doctor_names_and_repairs_a_group_stores_outside_images_directory() {
    let Some(env) = group_store() else { return };
    let ext = env.tmp.path().join("ext");
    env.ok(["init", "--images-dir", ext.to_str().unwrap()]);
    if !default_acl(&ext, "g::rx") {
        return;
    }
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stdout(&out).contains("has a default ACL"), "{}", show(&out));
    std::os::unix::fs::chown(&ext, None, Some(0)).unwrap();
    let out = env.run(["doctor"]);
    assert!(
        stdout(&out).contains("lacks the store's group"),
        "{}",
        show(&out)
    );
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stdout(&out).contains("gave images directory"),
        "{}",
        show(&out)
    );
    let (mode, group) = mode_and_group(&ext);
    assert_eq!((mode & 0o2070, group), (0o2070, GID), "{mode:o}");
    let acl = Command::new("getfacl")
        .args(["-d", "-c"])
        .arg(&ext)
        .output();
    let acl = String::from_utf8_lossy(&acl.unwrap().stdout).to_string();
    assert!(acl.trim().is_empty(), "default ACL left: {acl}");
    assert!(stdout(&env.ok(["doctor"])).contains("ok  sharing"));
    // An access ACL whose mask the mode shows, while its group entry keeps the group out.
    let set = Command::new("setfacl")
        .args(["-m", "g::rx,u:64003:rwx"])
        .arg(&ext)
        .status();
    assert!(set.is_ok_and(|s| s.success()));
    let out = env.run(["doctor"]);
    assert!(
        stdout(&out).contains("gives its group only r-x"),
        "{}",
        show(&out)
    );
    env.ok(["doctor", "--repair"]);
    assert!(stdout(&env.ok(["doctor"])).contains("ok  sharing"));
    let out = as_member(&env, &["exec", "--write", "x", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// A project directory's default ACL with a named entry gives every part
/// an access ACL whose mask, not the group, the mode's group bits show: a
/// member was kept out of a store that init and doctor said was shared.
/// init, and doctor --repair on one made before, take such ACLs away.
#[test]
fn an_access_acl_that_keeps_the_group_out_is_found_and_taken_away() {
    if !can_act_as_a_member() {
        return;
    }
    let env = env_for_members();
    if !default_acl(env.tmp.path(), "u::rwx,g::rx,o::rx,u:64003:rwx") {
        return;
    }
    owners_group_store(&env);
    ok_as(
        &env,
        MEMBER,
        &[GID],
        &["exec", "--write", "b", "--", "true"],
    );
    assert!(stdout(&as_ids(&env, OWNER, &[GID], "022", &["doctor"])).contains("ok  sharing"));

    // One given to a part later: named by doctor and to a member, taken away by a repair.
    let lock = env.lock_file("b");
    let set = Command::new("setfacl")
        .args(["-m", "g::r,u:64003:rw"])
        .arg(&lock)
        .status();
    assert!(set.is_ok_and(|s| s.success()));
    let out = as_ids(
        &env,
        OWNER,
        &[GID],
        "022",
        &["exec", "--write", "b", "--", "true"],
    );
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("its ACL gives its group"),
        "{}",
        show(&out)
    );
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stdout(&out).contains("ACL gives the group r--"),
        "{}",
        show(&out)
    );
    env.ok(["doctor", "--repair"]);
    ok_as(&env, OWNER, &[GID], &["exec", "--write", "b", "--", "true"]);
    assert!(stdout(&env.ok(["doctor"])).contains("ok  sharing"));
}

/// A member whose primary group is its own, not the store's, copies a base: the copy and all in it
/// get the store's group (the base's), so another member writes into it, and removes a copy that
/// failed half-way, as on the base.
#[test]
fn a_copy_by_a_member_of_another_primary_group_stays_the_stores() {
    let Some(env) = owners_store() else { return };
    let made = "mkdir -p \"$STOWAGE_IMAGE_DIR/pub/d\" && echo x > \"$STOWAGE_IMAGE_DIR/pub/f\"";
    let build = ["exec", "--write", "base", "--", "sh", "-c", made];
    let out = as_ids(&env, OWNER, &[GID], "002", &build);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let copy = ["exec", "--write", "copy", "--from", "base", "--", "true"];
    let out = as_ids(&env, MEMBER, &[OWN_GID, GID], "002", &copy);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    for rel in ["", "pub", "pub/d", "pub/f"] {
        let p = env.root.join("img/copy").join(rel);
        assert_eq!(mode_and_group(&p).1, GID, "{}", p.display());
    }
    let write = "echo z > \"$STOWAGE_IMAGE_DIR/pub/g\" && mkdir \"$STOWAGE_IMAGE_DIR/pub/d/e\"";
    let out = as_ids(
        &env,
        OWNER,
        &[GID],
        "002",
        &["exec", "--write", "copy", "--", "sh", "-c", write],
    );
    assert_eq!(
        code(&out),
        Some(0),
        "the other member writes in the copy: {}",
        show(&out)
    );
    // A copy that fails after `pub` and `pub/d` were made: the base's file it may not read.
    let private = env.root.join("img/base/pub/d/priv");
    fs::write(&private, "p").unwrap();
    chown(&private, OWNER, GID);
    fs::set_permissions(&private, fs::Permissions::from_mode(0o600)).unwrap();
    let failed = ["exec", "--write", "new", "--from", "base", "--", "true"];
    let out = as_ids(&env, MEMBER, &[OWN_GID, GID], "002", &failed);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    for args in [&["rm", "new"][..], &["gc"]] {
        let out = as_ids(&env, OWNER, &[GID], "002", args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    let trash: Vec<_> = fs::read_dir(env.root.join("trash")).unwrap().collect();
    assert!(
        trash.is_empty() && !env.root.join("img/new").exists(),
        "{trash:?}"
    );
}

/// A link a member put at `img` (to root's private directory) leads doctor's sharing check
/// nowhere: it lists and reports no name outside the store.
#[test]
fn the_sharing_check_lists_nothing_through_a_link_at_a_layout_directory() {
    let Some(env) = group_store() else {
        return;
    };
    env.make_image("app");
    let (outside, _) = victim(&env, true);
    fs::create_dir(outside.join("secret-dir")).unwrap();
    let img = env.root.join("img");
    fs::rename(&img, env.root.join("img.real")).unwrap();
    std::os::unix::fs::symlink(&outside, &img).unwrap();
    let out = env.run(["doctor"]);
    let said = stdout(&out);
    assert!(said.contains("img is a symlink"), "{}", show(&out));
    assert!(!said.contains("secret"), "{}", show(&out));
}

/// A user outside the group of a group store its (non-root) owner made is told the group and to
/// ask to join it, as for a store of root's.
#[test]
fn a_user_outside_the_group_of_a_members_store_is_told_to_join_it() {
    let Some(env) = owners_store() else { return };
    ok_as(&env, OWNER, &[GID], &["exec", "--write", "a", "--", "true"]);
    let label = match fs::read_to_string("/etc/group")
        .unwrap()
        .lines()
        .find(|l| l.split(':').nth(2) == Some("100"))
    {
        Some(l) => format!("'{}' (100)", l.split(':').next().unwrap()),
        None => "100".to_owned(),
    };
    let out = as_ids(
        &env,
        OTHER,
        &[GID2],
        "022",
        &["exec", "--read", "a", "--", "true"],
    );
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let err = stderr(&out);
    let want =
        format!("you are not in group {label}, whose store this is: ask its owner to add you");
    assert!(err.contains(&want), "{}", show(&out));
    assert_eq!(err.lines().count(), 1, "{}", show(&out));
}

/// An ACL entry naming a member with less than a part needs (a project directory's default ACL
/// giving one user read access) keeps that member out whatever the group may do: init shares the
/// store without it; one set on a part later is named to the member and by doctor, and taken out
/// by a repair, the ACL's other entries kept.
#[test]
fn an_acl_entry_naming_a_member_is_found_and_taken_out() {
    if !can_act_as_a_member() {
        return;
    }
    let env = env_for_members();
    if !default_acl(env.tmp.path(), "u::rwx,g::rwx,o::rx,u:64002:rx") {
        return;
    }
    owners_group_store(&env);
    let write = ["exec", "--write", "b", "--", "true"];
    ok_as(
        &env,
        MEMBER,
        &[GID],
        &["exec", "--write", "m", "--", "true"],
    );
    ok_as(&env, OWNER, &[GID], &write);
    assert!(stdout(&env.ok(["doctor"])).contains("ok  sharing"));

    // On the owner's lock file: a named entry for its owner would not count.
    let lock = env.lock_file("b");
    let set = Command::new("setfacl")
        .args(["-m", "u:64002:r,u:64003:rw"])
        .arg(&lock)
        .status();
    assert!(set.is_ok_and(|s| s.success()));
    let out = as_ids(&env, MEMBER, &[GID], "022", &write);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = "its ACL gives you (uid 64002) only r--";
    assert!(stderr(&out).contains(said), "{}", show(&out));
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = "ACL gives uid 64002 only r--";
    assert!(stdout(&out).contains(said), "{}", show(&out));
    env.ok(["doctor", "--repair"]);
    ok_as(&env, MEMBER, &[GID], &write);
    assert!(stdout(&env.ok(["doctor"])).contains("ok  sharing"));
    let kept = Command::new("getfacl")
        .arg("-p")
        .arg(&lock)
        .output()
        .unwrap();
    let kept = String::from_utf8_lossy(&kept.stdout).into_owned();
    assert!(
        kept.contains("user:64003:rw-") && !kept.contains("user:64002"),
        "{kept}"
    );
}

/// An ACL entry giving a user the user and group databases show outside the store's group less than
/// a member needs (an owner's grant of read access to an auditor) is none of the group's business:
/// doctor does not call it a problem and a repair keeps it. Both took it out.
#[test]
fn an_acl_entry_naming_a_user_outside_the_group_is_kept() {
    if !can_act_as_a_member() {
        return;
    }
    // What the user and group databases say of nobody's groups (`id`, not this process's NSS).
    let groups = Command::new("id").args(["-G", "nobody"]).output();
    let in_group = |_| match &groups {
        Ok(o) if o.status.success() => {
            let ids = String::from_utf8_lossy(&o.stdout).into_owned();
            ids.split_whitespace().any(|g| g == GID.to_string())
        }
        _ => true,
    };
    if in_group(65534) {
        eprintln!("skipping: no user known to be outside group {GID}");
        return;
    }
    let env = env_for_members();
    owners_group_store(&env);
    let img = env.root.join("img");
    let set = Command::new("setfacl")
        .args(["-m", "u:65534:rx"])
        .arg(&img)
        .status();
    if !set.is_ok_and(|s| s.success()) {
        eprintln!("skipping: setfacl failed or is missing (no ACLs here)");
        return;
    }
    assert!(stdout(&env.ok(["doctor"])).contains("ok  sharing"));
    env.ok(["doctor", "--repair"]);
    let kept = Command::new("getfacl")
        .arg("-p")
        .arg(&img)
        .output()
        .unwrap();
    let kept = String::from_utf8_lossy(&kept.stdout).into_owned();
    assert!(
        kept.contains("user:nobody:r-x") || kept.contains("user:65534:r-x"),
        "{kept}"
    );
}

/// While a copy (`--from`) is made in a group store, its top is private
/// (2700): `doctor` does not report it as a part members cannot use, and
/// `doctor --repair` (root's, who may change any part) leaves it so: no member
/// can make or swap a name in the copy. Once the copy is done the top has
/// the base's mode.
#[test]
fn doctor_leaves_the_private_top_of_a_copy_under_way_alone() {
    let Some(env) = group_store() else {
        return;
    };
    env.build("base", "mkfifo \"$STOWAGE_IMAGE_DIR/z\"");
    let base_mode = fs::metadata(env.root.join("img/base")).unwrap().mode() & 0o7777;
    let (bg, pause) = env.paused(
        ["exec", "--write", "app", "--from", "base", "--", "true"],
        "clone-made",
    );
    let top = env.root.join("img/app");
    let private = fs::metadata(&top).unwrap().mode() & 0o7777;
    assert_eq!(private, 0o2700);
    let out = env.run(["doctor"]);
    assert!(!stdout(&out).contains("img/app"), "{}", show(&out));
    let out = env.run(["doctor", "--repair"]);
    assert!(!stdout(&out).contains("img/app"), "{}", show(&out));
    assert_eq!(fs::metadata(&top).unwrap().mode() & 0o7777, private);
    let victim = env.tmp.path().join("victim");
    fs::write(&victim, "precious").unwrap();
    let out = member_links(&victim, &top.join("planted"));
    assert_ne!(code(&out), Some(0), "a member made a name in the copy");
    fs::remove_file(&pause).unwrap();
    let out = bg.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(fs::metadata(&top).unwrap().mode() & 0o7777, base_mode);
}

/// The names in image `name`'s tree, sorted.
fn names_in(env: &Env, name: &str) -> Vec<String> {
    names_at(&env.root.join("img").join(name))
}

/// Rebuilding an image from a base, by its owner, when a directory in it
/// that another member made keeps the owner from emptying it (mode 555,
/// not empty): refused before anything is deleted, naming the directory
/// and its owner; the image keeps its files, state and base. Before, the
/// image was emptied up to that directory and left `incomplete`.
#[test]
fn a_rebuild_refused_by_a_members_directory_leaves_the_image_as_it_was() {
    let Some(env) = group_store() else {
        return;
    };
    builds_as(&env, 1001, "base", "echo b > \"$STOWAGE_IMAGE_DIR/b\"");
    builds_as(
        &env,
        1001,
        "app",
        "cd \"$STOWAGE_IMAGE_DIR\" && mkdir pub && chmod 777 pub && for i in 1 2 3 4 5 6; do echo $i > a$i; done",
    );
    let bd = env.root.join("img/app/pub/bd");
    fs::create_dir(&bd).unwrap();
    fs::write(bd.join("f"), "f").unwrap();
    for p in [bd.join("f"), bd.clone()] {
        std::os::unix::fs::chown(&p, Some(65534), Some(GID)).unwrap();
    }
    fs::set_permissions(&bd, fs::Permissions::from_mode(0o555)).unwrap();
    let before = names_in(&env, "app");
    let rebuild = ["exec", "--write", "app", "--from", "base", "--", "true"];
    let (code, said) = said_by(&env, 1001, &rebuild);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("pub/bd")
            && said.contains("uid 65534")
            && said.contains("nothing was deleted"),
        "{said}"
    );
    assert_eq!(said.lines().count(), 1, "{said}");
    assert_eq!(names_in(&env, "app"), before);
    assert!(bd.join("f").exists());
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert!(env.image("app").unwrap()["base"].is_null());
}

/// Rebuilding an image from a base when a directory of the owner's own that it may not search
/// (mode 000, or 600) holds another member's directory: refused before anything is deleted,
/// naming that directory; the owner's directory gets its mode back and the image keeps its files
/// and state. Once the other member's directory is gone, the rebuild empties the owner's hidden
/// directory. Before, the check walk did not look inside it: the files beside it were deleted,
/// and the image left `incomplete`.
#[test]
fn a_rebuild_looks_inside_its_owners_unsearchable_directories_before_deleting() {
    let Some(env) = group_store() else {
        return;
    };
    builds_as(&env, 1001, "base", "echo b > \"$STOWAGE_IMAGE_DIR/b\"");
    for mode in ["000", "600"] {
        builds_as(
            &env,
            1001,
            "app",
            "cd \"$STOWAGE_IMAGE_DIR\" && rm -rf ./* && echo 1 > a1 && mkdir p && chmod 777 p && echo z > zz",
        );
        builds_as(
            &env,
            65534,
            "app",
            "mkdir \"$STOWAGE_IMAGE_DIR/p/q\" && echo q > \"$STOWAGE_IMAGE_DIR/p/q/f\" && chmod 755 \"$STOWAGE_IMAGE_DIR/p/q\"",
        );
        builds_as(
            &env,
            1001,
            "app",
            &format!("chmod {mode} \"$STOWAGE_IMAGE_DIR/p\""),
        );
        let p = env.root.join("img/app/p");
        let before = fs::metadata(&p).unwrap().mode() & 0o7777;
        let rebuild = ["exec", "--write", "app", "--from", "base", "--", "true"];
        let (code, said) = said_by(&env, 1001, &rebuild);
        assert_eq!(code, Some(1), "{mode}: {said}");
        assert!(
            said.contains("p/q")
                && said.contains("uid 65534")
                && said.contains("nothing was deleted"),
            "{mode}: {said}"
        );
        assert_eq!(said.lines().count(), 1, "{said}");
        assert_eq!(names_in(&env, "app"), ["a1", "p", "zz"], "{mode}");
        assert_eq!(fs::metadata(&p).unwrap().mode() & 0o7777, before, "{mode}");
        assert_eq!(env.state("app").as_deref(), Some("ready"), "{mode}");
        fs::remove_dir_all(p.join("q")).unwrap();
        let (code, said) = said_by(&env, 1001, &rebuild);
        assert_eq!(code, Some(0), "{mode}: {said}");
        assert_eq!(names_in(&env, "app"), ["b"], "{mode}");
    }
}

/// A directory of the owner's that the check before a rebuild lends owner
/// access, renamed away while lent and another of the owner's put at its
/// name, gets its mode back, and the other keeps its own: the mode was given
/// back through the directory opened again by name, the one put there.
#[test]
fn a_directory_renamed_while_a_rebuild_lends_it_access_gets_its_own_mode_back() {
    let Some(env) = group_store() else {
        return;
    };
    builds_as(&env, 1001, "base", "echo b > \"$STOWAGE_IMAGE_DIR/b\"");
    builds_as(&env, 1001, "app", "mkdir \"$STOWAGE_IMAGE_DIR/d\"");
    let (d, outside) = (env.root.join("img/app/d"), env.tmp.path().join("outside"));
    // Each holds another member's directory: the check refuses either, deleting nothing.
    for dir in [&d, &outside] {
        fs::create_dir_all(dir.join("q")).unwrap();
        nix::unistd::chown(
            &dir.join("q"),
            Some(nix::unistd::Uid::from_raw(65534)),
            None,
        )
        .unwrap();
        nix::unistd::chown(dir, Some(nix::unistd::Uid::from_raw(1001)), None).unwrap();
    }
    fs::set_permissions(&d, fs::Permissions::from_mode(0o300)).unwrap();
    fs::set_permissions(&outside, fs::Permissions::from_mode(0o755)).unwrap();
    let rebuild = ["--write", "app", "--from", "base"];
    let bg = paused_as(&env, 1001, &rebuild, "walk-lent");
    let aside = env.root.join("img/app/d.old");
    fs::rename(&d, &aside).unwrap();
    fs::rename(&outside, &d).unwrap();
    fs::remove_file(env.tmp.path().join("pauses-1001/paused")).unwrap();
    let out = bg.finish();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert_eq!(
        mode_of(&d),
        0o755,
        "the directory put at the name was chmodded"
    );
    assert_eq!(mode_of(&aside), 0o300, "the lent directory kept its loan");
}

/// Uid 1001's image `base` with a directory `a` whose mode (000) keeps its owner out: a copy of it
/// by 1001 lends itself access to `a`. Where `a` is.
fn base_with_a_withheld_dir(env: &Env) -> std::path::PathBuf {
    let script = "cd \"$STOWAGE_IMAGE_DIR\" && mkdir a && echo x > a/f && chmod 000 a";
    builds_as(env, 1001, "base", script);
    env.root.join("img/base/a")
}

/// A copy of `base` to `target` by uid 1001, killed while it has `a` lent (mode 500).
fn kill_lending(env: &Env, target: &str, a: &Path) {
    paused_as(
        env,
        1001,
        &["--write", target, "--from", "base"],
        "clone-copying",
    )
    .kill_all();
    // Its pause's directory, made anew by the next.
    fs::remove_dir_all(env.tmp.path().join("pauses-1001")).unwrap();
    assert_eq!(mode_of(a), 0o500, "lent");
}

/// The mode of `p`'s permission bits (a group store's directories are setgid besides).
fn mode_of(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().mode() & 0o777
}

/// A base of uid 1001's holding `etc` (mode 755), and its lend file made by
/// a copy: what every member may write.
fn base_with_lend_file(env: &Env) -> (std::path::PathBuf, std::path::PathBuf) {
    builds_as(
        env,
        1001,
        "base",
        "cd \"$STOWAGE_IMAGE_DIR\" && mkdir etc && chmod 755 etc && echo x > etc/passwd",
    );
    let out = as_uid(
        env,
        1001,
        &["exec", "--write", "c0", "--from", "base", "--", "true"],
    );
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let lend = env.root.join("locks/images/base.lend");
    assert!(lend.exists());
    (env.root.join("img/base/etc"), lend)
}

/// A loan's journal line for `p` (named `rel` from the base's top) that
/// says it lacked the owner bits `taken` before they were lent.
fn loan_line(p: &Path, rel: &str, taken: u32) -> String {
    let m = fs::symlink_metadata(p).unwrap();
    let hex: String = rel.bytes().map(|b| format!("{b:02x}")).collect();
    let lent = m.mode() & 0o7777;
    let was = lent & !taken;
    format!("{was:o} {lent:o} {} {} {hex}\n", m.dev(), m.ino())
}

/// A member writes, in the base's lend file every member may write, a
/// loan that never happened: "`etc` was 255 before its owner bits were
/// lent". Neither the owner's next copy, nor the owner's gc, nor root's
/// doctor --repair takes owner bits from the base for it: a loan is
/// journaled by its lender, in a file only it can write. Before, each of
/// them set `etc` to mode 255.
#[test]
fn a_members_line_in_a_lend_file_takes_no_owner_bits_from_a_base() {
    let Some(env) = group_store() else {
        return;
    };
    let (etc, lend) = base_with_lend_file(&env);
    let copy = ["exec", "--write", "c1", "--from", "base", "--", "true"];
    let runs: [(u32, &[&str]); 3] = [(1001, &copy), (0, &["doctor", "--repair"]), (1001, &["gc"])];
    for (uid, args) in runs {
        fs::write(&lend, loan_line(&etc, "etc", 0o500)).unwrap();
        let out = match uid {
            0 => env.run(args),
            uid => as_uid(&env, uid, args),
        };
        // The line is kept, so the repair reports it (a line of the previous release's format).
        let reported = uid == 0 && stdout(&out).contains("older release");
        assert!(
            code(&out) == Some(0) || reported,
            "{args:?}: {}",
            show(&out)
        );
        assert_eq!(mode_of(&etc), 0o755, "after {args:?} as uid {uid}");
    }
    let out = as_uid(&env, 1001, &copy);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(mode_of(&env.root.join("img/c1/etc")), 0o755);
}

/// What is planted where uid 1001's journal of loans goes — a FIFO, a
/// symlink, a directory, a file of another member's or one others may
/// write, or in place of 1001's directory of journals a symlink or another
/// member's directory — is never followed or written: the copy that would
/// restore from it is refused in one line naming it, and neither the base
/// nor what a link leads to changes.
#[test]
fn a_journal_of_loans_planted_for_a_lender_is_refused_not_followed() {
    let Some(env) = group_store() else {
        return;
    };
    let (etc, lend) = base_with_lend_file(&env);
    let outside = env.tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let fake = loan_line(&etc, "etc", 0o500);
    fs::write(outside.join("base.lend"), &fake).unwrap();
    let loans = env.root.join("locks/images/1001.loans");
    let journal = loans.join("base.lend");
    let own = |p: &Path, uid: u32, mode: u32| {
        std::os::unix::fs::chown(p, Some(uid), Some(GID)).unwrap();
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
    };
    for case in [
        "fifo",
        "symlink",
        "dir",
        "theirs",
        "group-writable",
        "dir-link",
        "their-dir",
    ] {
        let _ = fs::remove_dir_all(&loans).or_else(|_| fs::remove_file(&loans));
        match case {
            "dir-link" => std::os::unix::fs::symlink(&outside, &loans).unwrap(),
            "their-dir" => {
                fs::create_dir(&loans).unwrap();
                fs::write(&journal, &fake).unwrap();
                own(&journal, 65534, 0o644);
                own(&loans, 65534, 0o755);
            }
            _ => {
                fs::create_dir(&loans).unwrap();
                match case {
                    "fifo" => Plant::Fifo.at(&journal, &outside),
                    "symlink" => Plant::Symlink.at(&journal, &outside.join("base.lend")),
                    "dir" => Plant::Dir.at(&journal, &outside),
                    _ => fs::write(&journal, &fake).unwrap(),
                }
                match case {
                    "theirs" => own(&journal, 65534, 0o644),
                    "group-writable" => own(&journal, 1001, 0o664),
                    _ => {}
                }
                own(&loans, 1001, 0o755);
            }
        }
        fs::write(&lend, "1001\n").unwrap();
        let copy = ["exec", "--write", "c1", "--from", "base", "--", "true"];
        let (code, said) = said_by(&env, 1001, &copy);
        assert_eq!(code, Some(1), "{case}: {said}");
        assert_eq!(said.lines().count(), 1, "{case}: {said}");
        assert!(said.contains("1001.loans"), "{case}: {said}");
        assert_eq!(mode_of(&etc), 0o755, "{case}");
        assert_eq!(
            fs::read_to_string(outside.join("base.lend")).unwrap(),
            fake,
            "{case}"
        );
    }
}

/// A copy by uid 1001 killed while it has `B/sec` of the base lent, `B` being another member's
/// directory that member then makes unsearchable: 1001's next copy cannot put the mode back, says
/// so naming the entry, and keeps the loan journaled (its uid in the lend file); once `B` is
/// searchable again, the next copy puts the mode back. Before, the loan was dropped from the
/// journal as if it were none: the mode stayed lent for good, and nothing reported it.
#[test]
fn a_loan_its_lender_cannot_reach_stays_journaled_until_it_can() {
    let Some(env) = group_store() else {
        return;
    };
    builds_as(&env, 1001, "base", "true");
    builds_as(&env, 65534, "base", "mkdir -m 777 \"$STOWAGE_IMAGE_DIR/B\"");
    builds_as(
        &env,
        1001,
        "base",
        "cd \"$STOWAGE_IMAGE_DIR\" && echo s > B/sec && chmod 000 B/sec",
    );
    let b = env.root.join("img/base/B");
    let sec = b.join("sec");
    fs::set_permissions(&b, fs::Permissions::from_mode(0o755)).unwrap();
    let bg = paused_as(
        &env,
        1001,
        &["--write", "k", "--from", "base"],
        "clone-copying",
    );
    bg.kill_all();
    assert_eq!(mode_of(&sec), 0o400, "lent");
    fs::set_permissions(&b, fs::Permissions::from_mode(0o700)).unwrap();
    let copy = |t| ["exec", "--write", t, "--from", "base", "--", "true"];
    let (code, said) = said_by(&env, 1001, &copy("k2"));
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("B/sec") && said.contains("stays journaled"),
        "{said}"
    );
    let lend = env.root.join("locks/images/base.lend");
    assert_eq!(fs::read_to_string(&lend).unwrap(), "1001\n");
    fs::set_permissions(&b, fs::Permissions::from_mode(0o755)).unwrap();
    let (code, said) = said_by(&env, 1001, &copy("k3"));
    assert_eq!(code, Some(0), "{said}");
    assert_eq!(mode_of(&sec), 0, "given back");
}

/// A member whose umask masks its own bits (0277) writes and copies images of a group store: the
/// lock and lend files it makes keep the owner's read and write, so its copy that lends, and every
/// later command, may reopen them. Before, they were made mode 460: the copy failed part-way
/// taking the lend lock exclusively, and every later command was refused until a repair.
#[test]
fn a_members_umask_that_masks_its_own_bits_leaves_its_lock_files_usable() {
    let Some(env) = group_store() else {
        return;
    };
    let script = "cd \"$STOWAGE_IMAGE_DIR\" && umask 022 && mkdir a && echo x > a/f && chmod 000 a";
    for args in [
        &["exec", "--write", "base", "--", "sh", "-c", script][..],
        &["exec", "--write", "c", "--from", "base", "--", "true"],
        &["exec", "--write", "c", "--from", "base", "--", "true"],
    ] {
        let out = as_ids(&env, 1001, &[GID], "0277", args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
    }
    for name in ["base.lock", "base.lend", "c.lock"] {
        let mode = mode_of(&env.root.join("locks/images").join(name));
        assert_eq!(mode & 0o660, 0o660, "{name}: {mode:o}");
    }
}

/// A copy by uid 1001 killed with a directory of the base lent, then another member gives the
/// lend file a second name: root's `doctor --repair` sets it aside, and still puts the mode back
/// (the lenders it names carried over to a fresh lend file). Before, the list of lenders went with
/// the file set aside: the mode stayed lent for good, and nothing reported it.
#[test]
fn a_lend_file_set_aside_for_a_second_name_keeps_its_lenders() {
    let Some(env) = group_store() else {
        return;
    };
    let a = base_with_a_withheld_dir(&env);
    kill_lending(&env, "k", &a);
    let lend = env.root.join("locks/images/base.lend");
    // As a member may (group-writable), made here by root: the doctor sees a second name.
    fs::hard_link(&lend, env.tmp.path().join("other-name")).unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert!(stdout(&out).contains("set aside"), "{}", show(&out));
    assert_eq!(mode_of(&a), 0, "given back");
    let out = env.run(["doctor"]);
    assert!(!stdout(&out).contains("loans"), "{}", show(&out));
}

/// A copy by uid 1001 killed with a directory of the base lent, then its uid taken out of the
/// lend file (as an older release's gc or repair rewrites it, keeping only its own lines; or any
/// member, who may write it): doctor still reports the loan, and the next copy puts the mode back
/// before copying (the copy faithful), as `doctor --repair` does. Before, the journal was reached
/// only through the lend file: the mode stayed lent for good, and nothing reported it.
#[test]
fn a_loan_whose_lender_the_lend_file_no_longer_names_is_still_restored() {
    let Some(env) = group_store() else {
        return;
    };
    let a = base_with_a_withheld_dir(&env);
    let lend = env.root.join("locks/images/base.lend");
    let kill_lending = |t: &str| {
        kill_lending(&env, t, &a);
        fs::write(&lend, "").unwrap();
    };
    kill_lending("k1");
    let out = env.run(["doctor"]);
    assert!(stdout(&out).contains("loans"), "{}", show(&out));
    let copy = ["exec", "--write", "c", "--from", "base", "--", "true"];
    let (code, said) = said_by(&env, 1001, &copy);
    assert_eq!(code, Some(0), "{said}");
    assert_eq!(mode_of(&a), 0, "given back by the next copy");
    assert_eq!(mode_of(&env.root.join("img/c/a")), 0, "copied as it was");
    kill_lending("k2");
    let out = env.run(["doctor", "--repair"]);
    assert!(stdout(&out).contains("restored"), "{}", show(&out));
    assert_eq!(mode_of(&a), 0, "given back by the repair");
}

/// A lend file another member made that uid 1001 may not write (mode 644,
/// as flock(1) under a 022 umask makes one): the copy's one line names the
/// file, its mode, its owner and the fix. Before: "Permission denied".
#[test]
fn a_lend_file_a_member_made_unwritable_is_named_with_its_owner_and_fix() {
    let Some(env) = group_store() else {
        return;
    };
    builds_as(&env, 1001, "base", "echo b > \"$STOWAGE_IMAGE_DIR/b\"");
    let lend = env.root.join("locks/images/base.lend");
    fs::write(&lend, "").unwrap();
    std::os::unix::fs::chown(&lend, Some(65534), Some(GID)).unwrap();
    fs::set_permissions(&lend, fs::Permissions::from_mode(0o644)).unwrap();
    let (code, said) = said_by(
        &env,
        1001,
        &["exec", "--write", "c", "--from", "base", "--", "true"],
    );
    assert_eq!(code, Some(1), "{said}");
    assert_eq!(said.lines().count(), 1, "{said}");
    for part in ["base.lend", "644", "uid 65534", "doctor --repair"] {
        assert!(said.contains(part), "{part}: {said}");
    }
}

/// A copy by uid 1001 killed while it has a directory of the base lent:
/// another member's doctor --repair cannot put the mode back, and says
/// which uid must (1001, or root), and so does its gc; root's repair puts it
/// back. Before, the repair advised 'stowage doctor --repair', what was just
/// run, and gc said nothing.
#[test]
fn doctor_repair_names_who_must_restore_another_members_loans() {
    let Some(env) = group_store() else {
        return;
    };
    let a = base_with_a_withheld_dir(&env);
    kill_lending(&env, "k", &a);
    let (code, said) = said_by(&env, 65534, &["doctor", "--repair"]);
    assert_eq!(code, Some(1), "{said}");
    let line = said
        .lines()
        .find(|l| l.contains("loans"))
        .unwrap_or_default();
    assert!(
        line.contains("uid 1001") && line.contains("only that user or root"),
        "{said}"
    );
    assert_eq!(mode_of(&a), 0o500);
    // So does the member's gc (it said nothing of them).
    let (_, said) = said_by(&env, 65534, &["gc"]);
    let line = said
        .lines()
        .find(|l| l.starts_with("image 'base': "))
        .unwrap_or_default();
    assert!(
        line.contains("uid 1001") && line.contains("only that user or root"),
        "{said}"
    );
    env.ok(["doctor", "--repair"]);
    assert_eq!(mode_of(&a), 0o000, "after root's repair");
}

/// Another member's `gc` killed while it rewrites the lend file of a base whose loans uid 1001's
/// killed copy left: the lend file still names uid 1001, so doctor says so and root's repair puts
/// the mode back. Before, the file was emptied first: its kill there left the journal unnamed,
/// never restored and never reported.
#[test]
fn a_member_killed_rewriting_the_lend_file_keeps_the_other_lenders() {
    let Some(env) = group_store() else {
        return;
    };
    let a = base_with_a_withheld_dir(&env);
    kill_lending(&env, "k", &a);
    stowage_paused_as(&env, 65534, &["gc"], "lenders-written").kill_all();
    let lend = env.root.join("locks/images/base.lend");
    let named = fs::read_to_string(&lend).unwrap();
    assert!(named.lines().any(|l| l == "1001"), "{named:?}");
    let out = env.run(["doctor"]);
    assert!(stdout(&out).contains("loans"), "{}", show(&out));
    env.ok(["doctor", "--repair"]);
    assert_eq!(mode_of(&a), 0o000, "after root's repair");
}

/// Rebuilding from a base another member's image that the images
/// directory (sticky, root's) does not let the caller replace: refused
/// before anything is deleted, and the image keeps its files, state and
/// base. Before, it was emptied, then its top could not be replaced, and
/// it was left empty and `incomplete`.
#[test]
fn a_rebuild_of_a_members_image_the_images_directory_keeps_is_refused_first() {
    let Some(env) = group_store() else {
        return;
    };
    builds_as(&env, 1001, "base", "echo b > \"$STOWAGE_IMAGE_DIR/b\"");
    member_builds(&env, "app", "echo a > \"$STOWAGE_IMAGE_DIR/a\"");
    let img = env.root.join("img");
    let mode = fs::metadata(&img).unwrap().mode() & 0o7777;
    fs::set_permissions(&img, fs::Permissions::from_mode(mode | 0o1000)).unwrap();
    let rebuild = ["exec", "--write", "app", "--from", "base", "--", "true"];
    let (code, said) = said_by(&env, 1001, &rebuild);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("uid 65534") && said.contains("lets only that user, uid 0 or root"),
        "{said}"
    );
    assert_eq!(names_in(&env, "app"), ["a"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// A copy under way whose lock file a member unlinked (the locks directory
/// is the group's to write) is still its writer's: `doctor --repair` leaves
/// its private top as it is and says why. Before, a missing lock file read
/// as "no writer", and the repair opened the top to the group mid-copy.
#[test]
fn a_repair_leaves_a_copy_whose_lock_file_was_unlinked_alone() {
    let Some(env) = group_store() else {
        return;
    };
    env.build("base", "mkfifo \"$STOWAGE_IMAGE_DIR/z\"");
    let (bg, pause) = env.paused(
        ["exec", "--write", "app", "--from", "base", "--", "true"],
        "clone-made",
    );
    let top = env.root.join("img/app");
    fs::remove_file(env.root.join("locks/images/app.lock")).unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(
        fs::metadata(&top).unwrap().mode() & 0o7777,
        0o2700,
        "{}",
        show(&out)
    );
    assert!(
        stdout(&out).contains("no usable lock file"),
        "{}",
        show(&out)
    );
    fs::remove_file(&pause).unwrap();
    bg.finish();
}

/// `stowage exec EXEC -- true` run as uid `uid` (group 100), paused at debug point `point`: it
/// says so in a directory every uid may write.
fn paused_as(env: &Env, uid: u32, exec: &[&str], point: &str) -> Bg {
    let mut args = vec!["exec"];
    args.extend(exec);
    args.extend(["--", "true"]);
    stowage_paused_as(env, uid, &args, point)
}

/// `stowage ARGS` run as uid `uid` (group 100), paused at debug point `point` (see [`paused_as`]).
fn stowage_paused_as(env: &Env, uid: u32, args: &[&str], point: &str) -> Bg {
    let pauses = env.tmp.path().join(format!("pauses-{uid}"));
    fs::create_dir(&pauses).unwrap();
    fs::set_permissions(&pauses, fs::Permissions::from_mode(0o777)).unwrap();
    let file = pauses.join("paused");
    let mut c = Command::new("setpriv");
    c.arg(format!("--reuid={uid}"))
        .args(["--regid=100", "--clear-groups", "--"])
        .arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(args)
        .env(
            stowage::env::DEBUG_PAUSE,
            format!("{point}:{}", file.display()),
        )
        .env_remove("STOWAGE_ROOT");
    let bg = Bg::from_command(c);
    wait_for_file(&file);
    bg
}

/// Rebuilding from a base a member's image holding a sticky directory (as `/tmp` is) with another
/// user's file in it: refused before anything is deleted, naming the file's and the directory's
/// owners; the image keeps its files and state. Before, the files beside it were deleted first and
/// the image was left emptied in part and `incomplete`.
#[test]
fn a_rebuild_of_an_image_with_anothers_file_in_a_sticky_directory_is_refused_first() {
    let Some(env) = group_store() else {
        return;
    };
    builds_as(&env, 1001, "base", "echo b > \"$STOWAGE_IMAGE_DIR/b\"");
    builds_as(
        &env,
        1001,
        "app",
        "cd \"$STOWAGE_IMAGE_DIR\" && echo 1 > top1 && mkdir s && chmod 1777 s && echo x > s/afile",
    );
    let write = ["exec", "--write", "app", "--", "sh", "-c"];
    let mut add = write.to_vec();
    add.push("echo b > \"$STOWAGE_IMAGE_DIR/bfile\"");
    assert_eq!(as_uid(&env, 65534, &add).status.code(), Some(0));
    let rebuild = ["exec", "--write", "app", "--from", "base", "--", "true"];
    let (code, said) = said_by(&env, 65534, &rebuild);
    assert_eq!(code, Some(1), "{said}");
    assert_eq!(said.lines().count(), 1, "{said}");
    assert!(
        said.contains("afile") && said.contains("sticky") && said.contains("nothing was deleted"),
        "{said}"
    );
    assert_eq!(names_in(&env, "app"), ["bfile", "s", "top1"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// Lends `img/base/a/b/f` (uid 1001's, mode 000) owner read as the previous release did after a
/// kill: its loan line (mode before, mode lent, device, inode, names in hex) in the lend file
/// itself, the mode lent.
fn lend_the_old_way(env: &Env) -> std::path::PathBuf {
    let f = env.root.join("img/base/a/b/f");
    let st = fs::metadata(&f).unwrap();
    let names: String = b"a/b/f".iter().map(|b| format!("{b:02x}")).collect();
    let line = format!("0 400 {} {} {names}\n", st.dev(), st.ino());
    fs::write(env.root.join("locks/images/base.lend"), line).unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o400)).unwrap();
    f
}

/// A loan the previous release left in the lend file itself (its format then): kept by every
/// copy, gc and repair, never acted on (any member may write that file), and reported by doctor
/// until removed by hand. Before, the first copy erased the line, the mode stayed lent for good,
/// and nothing said so.
#[test]
fn a_loan_an_older_release_left_in_the_lend_file_is_kept_and_reported() {
    let Some(env) = group_store() else {
        return;
    };
    builds_as(
        &env,
        1001,
        "base",
        "cd \"$STOWAGE_IMAGE_DIR\" && mkdir -p a/b && echo x > a/b/f && chmod 000 a/b/f",
    );
    let copy = |uid, to| {
        let args = ["exec", "--write", to, "--from", "base", "--", "true"];
        said_by(&env, uid, &args)
    };
    assert_eq!(copy(1001, "c0").0, Some(0), "makes the lend file");
    let f = lend_the_old_way(&env);
    let lend = env.root.join("locks/images/base.lend");
    let line = fs::read_to_string(&lend).unwrap();
    assert_eq!(copy(1001, "c1").0, Some(0));
    assert_eq!(as_uid(&env, 1001, &["gc"]).status.code(), Some(0));
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(fs::read_to_string(&lend).unwrap(), line, "kept");
    assert_eq!(mode_of(&f), 0o400, "not acted on");
    let said = stdout(&out);
    assert!(
        said.contains("older release") && !said.contains("restored"),
        "{}",
        show(&out)
    );
    fs::write(&lend, "").unwrap();
    let out = env.run(["doctor"]);
    assert!(!stdout(&out).contains("loans"), "{}", show(&out));
}

/// Plain `doctor` promises no restore a repair would not make: with an older release's loan line
/// in the lend file, it names the line as not acted on; with another member's loan left, run by a
/// member who cannot restore it, it names the uid who must. Before, both said "the next copy of
/// each, 'stowage gc' or 'stowage doctor --repair' restores them", which never happened.
#[test]
fn plain_doctor_promises_no_restore_the_repair_would_not_make() {
    let Some(env) = group_store() else {
        return;
    };
    builds_as(
        &env,
        1001,
        "base",
        "cd \"$STOWAGE_IMAGE_DIR\" && mkdir -p a/b && echo x > a/b/f && chmod 000 a/b/f",
    );
    let copy = ["exec", "--write", "c0", "--from", "base", "--", "true"];
    assert_eq!(said_by(&env, 1001, &copy).0, Some(0), "makes the lend file");
    let f = lend_the_old_way(&env);
    let out = env.run(["doctor"]);
    let said = stdout(&out);
    assert!(
        said.contains("older release") && !said.contains("restores them"),
        "{}",
        show(&out)
    );
    fs::write(env.root.join("locks/images/base.lend"), "").unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o000)).unwrap();
    let bg = paused_as(
        &env,
        1001,
        &["--write", "k", "--from", "base"],
        "clone-copying",
    );
    bg.kill_all();
    let (_, said) = said_by(&env, 65534, &["doctor"]);
    assert!(
        said.contains("uid 1001") && !said.contains("restores them"),
        "{said}"
    );
}

/// Gives `dir` the default ACL `spec` (`setfacl -d -m`); false, said, where this machine has no
/// ACLs (or no setfacl): the caller skips.
fn default_acl(dir: &Path, spec: &str) -> bool {
    let set = Command::new("setfacl")
        .args(["-d", "-m", spec])
        .arg(dir)
        .status();
    let ok = set.is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipping: setfacl -d failed or is missing (no ACLs here)");
    }
    ok
}

/// In a group store a FIFO or a hard link planted where a file of the store
/// is kept is set aside by the first `doctor --repair`, which then exits 0:
/// the group-modes step before reported it as a part it could not fix
/// ("changed kind", "has other names"), so a repair that had put everything
/// right still said there was a problem.
#[test]
fn a_file_planted_in_a_group_store_is_repaired_in_one_go() {
    for (kind, rel) in [
        ("fifo", "store.conf"),
        ("fifo", "locks/global.lock"),
        ("link", "store.conf"),
        ("link", "locks/global.lock"),
    ] {
        let Some(env) = group_store() else {
            return;
        };
        env.make_image("base");
        let at = env.root.join(rel);
        fs::remove_file(&at).unwrap();
        if kind == "fifo" {
            nix::unistd::mkfifo(&at, nix::sys::stat::Mode::from_bits_truncate(0o660)).unwrap();
        } else {
            let outside = env.tmp.path().join("outside");
            fs::write(&outside, "kept").unwrap();
            fs::hard_link(&outside, &at).unwrap();
        }
        let out = env.run(["doctor", "--repair"]);
        assert_eq!(code(&out), Some(0), "{kind} at {rel}: {}", show(&out));
        assert!(
            stdout(&out).contains("set aside"),
            "{kind} at {rel}: {}",
            show(&out)
        );
        env.ok(["doctor"]);
        assert_eq!(env.state("base").as_deref(), Some("ready"));
    }
}

/// A lock file with a second name that this member may not read (its owner
/// made it 600) may hold a record: a member's repair reports it and sets
/// nothing aside. It took it for a planted hard link, set the image's real
/// lock file aside and adopted the ready image as incomplete.
#[test]
fn a_member_never_sets_aside_a_linked_lock_file_it_cannot_read() {
    let Some(env) = group_store() else {
        return;
    };
    builds_as(&env, 1001, "base", "echo b > \"$STOWAGE_IMAGE_DIR/b\"");
    let lock = env.lock_file("base");
    fs::hard_link(&lock, env.root.join("locks/images/junk.lock")).unwrap();
    fs::set_permissions(&lock, fs::Permissions::from_mode(0o600)).unwrap();
    let out = as_uid(&env, 65534, &["doctor", "--repair"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(lock.exists(), "set aside: {}", show(&out));
    fs::set_permissions(&lock, fs::Permissions::from_mode(0o660)).unwrap();
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}
