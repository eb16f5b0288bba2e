//! `stowage doctor` and `doctor --repair`: what they report (the
//! filesystem, flock, records against trees, leftovers, holds probed from
//! other hosts), trees without records adopted but never collected, and a
//! user who may not write the store told so. (A lost or damaged catalog:
//! catalog_loss.rs.)

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use crate::common::*;

#[test]
fn doctor_finds_and_repairs_inconsistencies() {
    let env = Env::new();
    env.make_image("ok");
    env.make_image("vanished");
    fs::remove_dir_all(env.root.join("img/vanished")).unwrap();
    fs::create_dir_all(env.root.join("img/stray+1/bin")).unwrap();
    fs::write(env.root.join("img/stray+1/bin/x"), "x").unwrap();
    fs::create_dir_all(env.root.join("trash/leftover/deep")).unwrap();
    let out = env.run(["doctor", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["healthy"], false);
    assert_eq!(report["locking"], true);
    let problems: Vec<&str> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "problem")
        .map(|c| c["check"].as_str().unwrap())
        .collect();
    assert_eq!(problems, ["images", "images", "trash"], "{report}");
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("vanished"), None);
    // Whether a tree found without its row is complete is not known.
    assert_eq!(env.state("stray:1").as_deref(), Some("incomplete"));
    assert_eq!(env.state("ok").as_deref(), Some("ready"));
    assert!(!env.root.join("trash/leftover").exists());
    env.ok(["doctor"]);
}

#[test]
fn doctor_reports_the_filesystem_and_flock() {
    let env = Env::new();
    // (On a root that does not exist doctor says so: make one.)
    env.ok(["init"]);
    let out = env.ok(["doctor", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["filesystem"].as_str().is_some_and(|f| !f.is_empty()));
    let flock = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "flock")
        .unwrap();
    assert_eq!(flock["status"], "ok");
    assert_eq!(report["healthy"], true);
    assert!(
        fs::read_dir(env.root.join("locks")).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains("doctor")),
        "its probe file is gone"
    );
    let _ = PermissionsExt::mode(&fs::metadata(&env.root).unwrap().permissions());
}

#[test]
fn doctor_by_a_user_who_may_not_write_the_store_says_so() {
    let Some(mut c) = as_nobody() else { return };
    let env = Env::new();
    env.make_image("a");
    fs::set_permissions(env.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    c.arg(bin()).arg("--root").arg(&env.root).arg("doctor");
    let out = output(c);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("may not write this store"),
        "{}",
        show(&out)
    );
    assert!(!stdout.contains("--repair"), "{}", show(&out));
    // Listing needs no write: the records are read, the catalog left be.
    let mut c = as_nobody().unwrap();
    c.arg(bin()).arg("--root").arg(&env.root).arg("images");
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ready"),
        "{}",
        show(&out)
    );
    // Writing does, and says so in one line.
    let mut c = as_nobody().unwrap();
    c.arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(["exec", "--write", "a", "--", "true"]);
    let out = output(c);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stderr(&out).contains("may not write this store"),
        "{}",
        show(&out)
    );
    assert_eq!(stderr(&out).lines().count(), 1, "{}", show(&out));
}

#[test]
fn a_hold_probe_on_another_host_is_seen_by_doctor() {
    let env = Env::new();
    env.ok(["init"]);
    // Another "host": a new UTS and pid namespace (needs root).
    let ok = Command::new("unshare")
        .args(["--pid", "--fork", "--uts", "--mount-proc", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: cannot make a pid and UTS namespace (unshare needs root)");
        return;
    }
    let mut c = Command::new("unshare");
    c.args(["--pid", "--fork", "--uts", "--mount-proc", "sh", "-c"])
        .arg(format!(
            "hostname probe-host && exec '{bin}' --root '{root}' doctor --hold-probe 60",
            bin = bin(),
            root = env.root.display()
        ));
    let holder = Bg::from_command(c);
    let file = env.root.join("locks/probe.lock");
    wait_until("the probe is held", || {
        fs::read_to_string(&file).is_ok_and(|t| t.starts_with("probe-host")) && !flock_free(&file)
    });
    let out = env.run(["doctor"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("probe lock held on another host (host probe-host"),
        "{}",
        show(&out)
    );
    // The other host goes away: its lock goes with it.
    holder.kill_all();
    let out = env.run(["doctor"]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("probe"),
        "{}",
        show(&out)
    );
    // A probe on this host is told apart from one elsewhere.
    let here = env.spawn(["doctor", "--hold-probe", "60"]);
    wait_until("the probe is held here", || {
        // The whole note, not the moment its holder begins to write it.
        fs::read_to_string(&file).is_ok_and(|t| t.ends_with('\n') && !t.starts_with("probe-host"))
            && !flock_free(&file)
    });
    let out = env.run(["doctor"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("held on this host"),
        "{}",
        show(&out)
    );
    here.kill_all();
}

// --- trees without records -------------------------------------------------

/// A tree whose record is gone (its lock file deleted by hand) is adopted
/// by a repair as incomplete with its readiness unknown: kept, listed, and
/// never collected by gc, until a writer makes it ready again.
#[test]
fn a_tree_without_a_record_is_adopted_and_never_collected() {
    let env = Env::new();
    env.make_image("good");
    fs::remove_file(env.lock_file("good")).unwrap();
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("has no record"),
        "{}",
        show(&out)
    );
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("good").as_deref(), Some("incomplete"));
    let out = env.run(["exec", "--read", "good", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    env.ok(["gc"]);
    assert!(env.root.join("img/good/file").exists(), "gc kept it");
    assert_eq!(env.state("good").as_deref(), Some("incomplete"));
    // A writer makes it ready again.
    env.ok(["exec", "--write", "good", "--", "true"]);
    env.ok(["exec", "--read", "good", "--", "true"]);
    assert_eq!(env.run(["doctor"]).status.code(), Some(0));
}

/// A tree adopted without a record was all there was of its image: once
/// it is gone (deleted by hand, or adopted from a client's stale lookup
/// after another host removed it), a repair drops the record rather than
/// keep an unreadable "incomplete" image forever.
#[test]
fn an_adopted_image_whose_tree_is_gone_has_its_record_dropped_by_repair() {
    let env = Env::new();
    // Another image's tree: an images directory found empty would prove nothing.
    env.make_image("kept");
    env.make_image("stray");
    fs::remove_file(env.lock_file("stray")).unwrap();
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("stray").as_deref(), Some("incomplete"));
    fs::remove_dir_all(env.root.join("img/stray")).unwrap();
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stdout(&out).contains("but no tree"), "{}", show(&out));
    let out = env.ok(["doctor", "--repair"]);
    assert!(
        stdout(&out).contains("dropped the records of"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("stray"), None);
    assert_eq!(env.run(["doctor"]).status.code(), Some(0));
    // One whose writer failed may have no tree: gc's to remove, not doctor's.
    let out = env.run(["exec", "--write", "failed", "--", "false"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let _ = fs::remove_dir_all(env.root.join("img/failed"));
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("failed").as_deref(), Some("incomplete"));
}

/// An image created while doctor (or a repair) runs, between its reading
/// of the records and its listing of the trees: its tree is no orphan (its
/// creator wrote the record first and holds the lock), so doctor reports
/// nothing about it and exits 0; the image ends ready.
#[test]
fn doctor_says_nothing_of_an_image_created_while_it_looks() {
    let env = Env::new();
    env.make_image("base");
    for (i, how) in [&["doctor"][..], &["doctor", "--repair"]]
        .iter()
        .enumerate()
    {
        let (doctor, go_on) = env.paused(*how, "doctor-records-read");
        let new = format!("new{i}");
        let (started, release) = (format!("started{i}"), format!("release{i}"));
        let writer = env.hold_until(&["--write", &new], &started, &release);
        fs::remove_file(&go_on).unwrap();
        let out = doctor.finish();
        assert_eq!(code(&out), Some(0), "{how:?}: {}", show(&out));
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains(&new),
            "{}",
            show(&out)
        );
        env.release(&release);
        let out = writer.finish();
        assert_eq!(code(&out), Some(0), "{}", show(&out));
        assert_eq!(env.state(&new).as_deref(), Some("ready"));
    }
}

/// A repair drops the record of a gone tree only on the word of the images
/// directory recorded: another put in its place between the listing and
/// the drop (unmounted meanwhile, leaving the bare mount point) says
/// nothing of the tree, and the record stays until a repair sees the
/// recorded directory again.
#[test]
fn a_repair_drops_no_record_on_the_word_of_another_images_directory() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    env.ok(["doctor", "--repair"]);
    let (doctor, go_on) = env.paused(["doctor", "--repair"], "doctor-records-read");
    let (img, away) = (env.images_dir(), env.tmp.path().join("img.away"));
    fs::remove_dir_all(img.join("a")).unwrap();
    fs::rename(&img, &away).unwrap();
    fs::create_dir(&img).unwrap();
    fs::remove_file(&go_on).unwrap();
    let out = doctor.finish();
    assert!(!stdout(&out).contains("dropped"), "{}", show(&out));
    assert_eq!(env.state("a").as_deref(), Some("ready"), "{}", show(&out));
    fs::remove_dir(&img).unwrap();
    fs::rename(&away, &img).unwrap();
    let out = env.ok(["doctor", "--repair"]);
    assert!(
        stdout(&out).contains("dropped the records of 'a'"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("a"), None);
    assert_eq!(env.state("b").as_deref(), Some("ready"));
}

/// A record whose tree was deleted by hand: the repair drops the record
/// (the image is gone); a record of the wrong images directory is left.
#[test]
fn a_record_whose_tree_is_gone_is_dropped_by_a_repair() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("b");
    fs::remove_dir_all(env.root.join("img/a")).unwrap();
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert_eq!(
        env.state("a").as_deref(),
        Some("ready"),
        "doctor alone changes nothing"
    );
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("a"), None);
    assert_eq!(env.state("b").as_deref(), Some("ready"));
}

// --- an image whose state cannot be known ------------------------------------

/// Flips a byte in both slots of the record of image `name` (its lock
/// file): bytes no writer wrote, as a disk or a hand leaves them.
fn damage_record(env: &Env, name: &str) {
    let lock = env
        .root
        .join("locks/images")
        .join(stowage::root::lock_file_name(name));
    let mut bytes = fs::read(&lock).unwrap();
    let slot = stowage::image_record::SLOT;
    assert!(bytes.len() > slot + 40, "{name} has two record slots");
    bytes[30] ^= 1;
    bytes[slot + 30] ^= 1;
    fs::write(&lock, bytes).unwrap();
}

/// An image whose name is too long for its lock file's (cut and hashed)
/// and whose record is damaged is listed by the tree the name was cut
/// from, kept and reported by gc like any other. A second tree whose name
/// hashes alike (FNV-1a collides) makes the name unknown: neither is named.
#[test]
fn a_damaged_record_under_a_cut_lock_file_name_is_listed_by_its_tree() {
    let env = Env::new();
    let (long, twin) = ("a".repeat(235), "a".repeat(235));
    let (long, twin) = (long + "cd82abed273c49b5", twin + "234f0bb426e2641c");
    let lock_file = stowage::root::lock_file_name;
    assert_eq!(lock_file(&long), lock_file(&twin), "a collision");
    env.make_image(&long);
    env.make_image("b");
    damage_record(&env, &long);
    let listed = |env: &Env| {
        let out = env.ok(["images", "--json"]);
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let rows = listed(&env);
    let row = rows.as_array().unwrap().iter().find(|r| r["name"] == *long);
    assert_eq!(row.expect("listed")["state"], "incomplete", "{rows}");
    let out = env.ok(["gc"]);
    assert!(
        stdout(&out).contains("its state is not known"),
        "{}",
        show(&out)
    );
    assert!(env.root.join("img").join(&long).join("file").exists());
    fs::create_dir(env.root.join("img").join(&twin)).unwrap();
    let rows = listed(&env);
    let named = |n: &str| rows.as_array().unwrap().iter().any(|r| r["name"] == *n);
    assert!(!named(&long) && !named(&twin), "{rows}");
    env.ok(["gc", "--unused-for", "0s", "--max-size", "0"]);
    assert!(env.root.join("img").join(&long).join("file").exists());
    assert!(env.root.join("img").join(&twin).is_dir());
}

#[test]
fn a_damaged_record_is_kept_reported_and_mended_as_its_refusal_advises() {
    let env = Env::new();
    env.make_image("keep");
    env.make_image("b");
    env.make_image("c");
    damage_record(&env, "b");
    damage_record(&env, "c");
    // Not read: its state is not known. The refusal names the image and
    // what to do.
    let ran = env.sentinel("ran");
    let out = env.run(["exec", "--read", "b", "--", "touch", ran.to_str().unwrap()]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(!ran.exists(), "the command ran: {}", show(&out));
    let err = stderr(&out);
    assert!(
        err.contains("'b'") && err.contains("damaged") && err.contains("exec --write b"),
        "{}",
        show(&out)
    );
    // Kept by gc and by a repair, and reported by doctor.
    env.ok(["gc"]);
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("b.lock"), "{}", show(&out));
    // Its record is unreadable, not missing: no repair would adopt its tree.
    assert!(!said.contains("no record"), "{}", show(&out));
    // Listed with its state as the spec names it, and no time it cannot know.
    let listed = String::from_utf8_lossy(&env.ok(["images", "--json"]).stdout).into_owned();
    let rows: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let b = rows.as_array().unwrap().iter().find(|r| r["name"] == "b");
    let b = b.expect("b listed");
    assert_eq!(b["state"], "incomplete", "{listed}");
    assert!(b["created"].is_null(), "{listed}");
    let table = env.ok(["images"]);
    assert!(
        !String::from_utf8_lossy(&table.stdout).contains("1970"),
        "{}",
        show(&table)
    );
    env.run(["doctor", "--repair"]);
    let out = env.run(["doctor"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(!said.contains("no record"), "{}", show(&out));
    for n in ["b", "c"] {
        assert!(
            env.root.join("img").join(n).join("file").exists(),
            "{n}'s tree"
        );
    }
    assert_eq!(env.state("keep").as_deref(), Some("ready"));
    // The two ways out the refusal offers.
    let out = env.run(["exec", "--write", "b", "--", "true"]);
    assert_eq!(
        code(&out),
        Some(0),
        "a write marks it ready: {}",
        show(&out)
    );
    assert_eq!(env.state("b").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("b", "file"), "content\n");
    let out = env.run(["rm", "c"]);
    assert_eq!(code(&out), Some(0), "rm removes it: {}", show(&out));
    assert!(!env.root.join("img/c").exists());
    assert_eq!(env.state("c"), None);
}

// --- a repair beside writers ------------------------------------------------

/// `sh -c` text that touches `started`, waits (bounded) for `go`, then runs
/// `stowage ARGS` and prints its exit status as `tag=N`.
fn then_stowage(env: &Env, started: &str, go: &str, args: &str, tag: &str) -> String {
    format!(
        "touch '{s}'; i=0; while [ ! -e '{g}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done; \
         '{b}' --root '{r}' {args}; echo \"{tag}=$?\"",
        s = env.sentinel(started).display(),
        g = env.sentinel(go).display(),
        b = bin(),
        r = env.root.display(),
    )
}

/// A repair in the command of an exec that holds image `x` (`locks`),
/// while a new image's writer waits, in its command, for `x` (`nested`):
/// the repair does not wait for the new image's writer, which waits for
/// the repair's exec, which waits for the repair. Every process ends
/// (bounded), and the new image is ready.
fn repair_inside_an_image_user(locks: &[&str], nested: &[&str]) {
    let env = Env::new();
    env.make_image("x");
    let mut args = vec!["exec"];
    args.extend(locks);
    let script = then_stowage(&env, "user", "go", "doctor --repair", "repair");
    args.extend(["--", "sh", "-c", &script]);
    let user = env.spawn(args);
    wait_for_file(&env.sentinel("user"));
    let nested = nested.join(" ");
    let writer = env.spawn([
        "exec",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        &format!(
            "touch \"$STOWAGE_IMAGE_DIR/file\" '{}'; '{}' --root '{}' exec {nested} -- true",
            env.sentinel("writing").display(),
            bin(),
            env.root.display()
        ),
    ]);
    wait_for_file(&env.sentinel("writing"));
    env.wait_for_waiter("x");
    fs::write(env.sentinel("go"), "").unwrap();
    let out = user.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("repair=0"),
        "{}",
        show(&out)
    );
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.state("x").as_deref(), Some("ready"));
    env.ok(["doctor"]);
}

#[test]
fn a_repair_inside_a_reader_does_not_wait_for_a_new_images_writer_waiting_for_it() {
    repair_inside_an_image_user(&["--read", "x"], &["--write", "x"]);
}

#[test]
fn a_repair_inside_a_writer_does_not_wait_for_a_new_images_writer_waiting_for_it() {
    repair_inside_an_image_user(&["--write", "x"], &["--read", "x"]);
}

#[test]
fn a_repair_inside_a_no_inherit_writer_does_not_wait_for_a_new_images_writer_waiting_for_it() {
    repair_inside_an_image_user(&["--no-inherit", "--write", "x"], &["--read", "x"]);
}

/// A repair in the command of a new image's writer: it does not wait for
/// the writer that waits for it, and the image is ready.
#[test]
fn a_repair_inside_a_new_images_writers_command_does_not_wait_for_it() {
    let env = Env::new();
    env.make_image("base");
    let out = env.run([
        "exec",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        &format!(
            "echo made > \"$STOWAGE_IMAGE_DIR/file\"; '{}' --root '{}' doctor --repair; echo \"repair=$?\"",
            bin(),
            env.root.display()
        ),
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("repair=0"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("app", "file"), "made\n");
}

/// The same with `--no-inherit` and the repair in another pid namespace:
/// it inherits no descriptor and sees neither the exec nor its keeper
/// among its ancestors, yet must not wait for the writer around it.
#[test]
fn a_repair_in_another_pid_namespace_under_a_no_inherit_writer_does_not_wait_for_it() {
    if !root_or_skip("a pid namespace") || !tool_or_skip("unshare", "util-linux") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    let out = env.run([
        "exec",
        "--no-inherit",
        "--write",
        "app",
        "--",
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        "sh",
        "-c",
        &format!(
            "touch \"$STOWAGE_IMAGE_DIR/file\"; '{}' --root '{}' doctor --repair; echo \"repair=$?\"",
            bin(),
            env.root.display()
        ),
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("repair=0"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// A repair inside a reader that keeps its lock in a keeper
/// (`--no-inherit`), run with a scrubbed environment (`env -i`, as sudo
/// does) over a damaged catalog: nothing tells it the reader is its
/// ancestor, and it must not wait for the image that reader holds.
#[test]
fn a_rebuild_inside_a_reader_with_a_clean_environment_does_not_hang() {
    let env = Env::new();
    env.make_image("keep");
    env.make_image("base");
    let script = format!(
        "printf 'ZZZZZZZZ%.0s' $(seq 1024) > '{db}'; \
         env -i '{bin}' --root '{root}' doctor --repair >/dev/null 2>&1; echo \"repair=$?\"",
        db = env.root.join("stowage.db").display(),
        bin = bin(),
        root = env.root.display()
    );
    let out = env.run([
        "exec",
        "--read",
        "base",
        "--no-inherit",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("repair=0"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.state("keep").as_deref(), Some("ready"));
}

/// A ready image whose tree was deleted by hand is rebuilt by a writer
/// (its command makes the tree again) while a repair, which drops the
/// records of trees that are gone, runs: the repair leaves the image its
/// writer holds alone, and the write that ended well is the image.
#[test]
fn a_repair_leaves_alone_an_image_a_writer_rebuilds_after_its_tree_was_deleted() {
    let env = Env::new();
    env.make_image("base");
    env.make_image("app");
    fs::remove_dir_all(env.root.join("img/app")).unwrap();
    let writer = env.start_sh(&["--write", "app"], |started| {
        format!(
            "mkdir -p \"$STOWAGE_IMAGE_DIR\"; echo new > \"$STOWAGE_IMAGE_DIR/file\"; touch '{}'; \
             i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
            started.display(),
            r = env.sentinel("release").display()
        )
    });
    let out = env.run(["doctor", "--repair"]);
    assert_ne!(code(&out), None, "{}", show(&out));
    env.release("release");
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("app", "file"), "new\n");
    env.ok(["gc"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["doctor"]);
}

/// A write stopped before its command, a repair meanwhile, then the write
/// ends without running its command (SIGTERM): the image is as it was,
/// ready.
#[test]
fn a_repair_beside_a_write_that_never_starts_leaves_the_image_ready() {
    let env = Env::new();
    env.make_image("a");
    let (writer, _) = env.paused(["exec", "--write", "a", "--", "true"], "exec-before-spawn");
    assert_eq!(env.state("a").as_deref(), Some("writing"));
    let out = env.run(["doctor", "--repair"]);
    assert_ne!(code(&out), None, "{}", show(&out));
    writer.signal(libc::SIGTERM);
    let out = writer.finish();
    assert_eq!(code(&out), Some(143), "{}", show(&out));
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "a", "--", "true"]);
    env.ok(["doctor"]);
}

/// `doctor` without `--repair` changes nothing: not the catalog, not a
/// record, not a tree — even where it finds a problem to report.
#[test]
fn doctor_without_repair_writes_nothing() {
    let env = Env::new();
    env.make_image("base");
    env.build("app", "echo made > \"$STOWAGE_IMAGE_DIR/file\"");
    env.run(["exec", "--write", "failed", "--", "false"]);
    fs::create_dir_all(env.root.join("img/stray/bin")).unwrap();
    env.ok(["images"]);
    let contents = |env: &Env| -> Vec<(String, Vec<u8>)> {
        walkdir_files(&env.root)
            .into_iter()
            .filter(|p| !p.starts_with(env.root.join("locks/leases")))
            .map(|p| (p.display().to_string(), fs::read(&p).unwrap_or_default()))
            .collect::<std::collections::BTreeMap<_, _>>()
            .into_iter()
            .collect()
    };
    let files = tree(&env.root);
    let before = contents(&env);
    let out = env.run(["doctor"]);
    assert_eq!(
        code(&out),
        Some(1),
        "the stray tree is a problem: {}",
        show(&out)
    );
    let leases = |t: Vec<String>| -> Vec<String> {
        t.into_iter()
            .filter(|p| !p.starts_with("locks/leases/"))
            .collect()
    };
    assert_eq!(
        leases(tree(&env.root)),
        leases(files),
        "no file made or removed"
    );
    assert!(contents(&env) == before, "a file was written");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

/// On a shared filesystem, where lock files are kept: the record of a tree
/// that is gone, dropped by a repair, is not read afterwards.
#[test]
fn a_record_a_repair_drops_on_a_shared_filesystem_is_not_read() {
    let env = Env::new();
    let on_nfs = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
        output(c)
    };
    let out = on_nfs(&["exec", "--write", "lost", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    fs::remove_dir(env.root.join("img/lost")).unwrap();
    // The images directory is not empty: not taken for unmounted.
    env.make_image("kept");
    let out = on_nfs(&["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("lost"), None, "{}", show(&out));
    assert!(env.lock_file("lost").exists(), "the lock file is kept");
    let out = on_nfs(&["exec", "--read", "lost", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    assert_eq!(env.state("kept").as_deref(), Some("ready"));
}

/// A store's configuration damaged, emptied or replaced by a FIFO: the
/// error tells to run `doctor --repair`, and that does it — the file is
/// set aside (never deleted) and written anew from what the images'
/// records say of their images directory, the default one or one given to
/// `init --images-dir`; no image is lost. Until then a write is refused:
/// with the file missing too, a default one would put a new image where no
/// record's images are.
#[test]
fn an_unusable_configuration_is_set_aside_and_written_anew_from_the_records() {
    for external in [false, true] {
        for plant in ["garbage", "", "fifo", "missing"] {
            let env = Env::new();
            let ext = env.tmp.path().join("ext-img");
            if external {
                fs::create_dir(&ext).unwrap();
                env.ok(["init", "--images-dir", ext.to_str().unwrap()]);
            }
            env.make_image("base");
            let conf = env.root.join("store.conf");
            fs::remove_file(&conf).unwrap();
            match plant {
                "fifo" => Plant::Fifo.at(&conf, env.tmp.path()),
                "missing" => {}
                _ => fs::write(&conf, plant).unwrap(),
            }
            let case = format!("external {external}, {plant:?}");
            let out = env.run(["exec", "--write", "new", "--", "true"]);
            assert_eq!(code(&out), Some(1), "{case}: {}", show(&out));
            assert!(
                stderr(&out).contains("store.conf") && stderr(&out).contains("doctor --repair"),
                "{case}: {}",
                show(&out)
            );
            let out = env.run(["doctor"]);
            assert_eq!(code(&out), Some(1), "{case}: {}", show(&out));
            let out = env.run(["doctor", "--repair"]);
            assert_eq!(code(&out), Some(0), "{case}: {}", show(&out));
            let text = fs::read_to_string(&conf).unwrap();
            let images = if external {
                format!("images={}\n", ext.display())
            } else {
                "images=default\n".to_owned()
            };
            assert!(text.contains(&images), "{case}: {text}");
            let aside: Vec<String> = fs::read_dir(&env.root)
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("store.conf."))
                .collect();
            assert_eq!(
                aside.len(),
                usize::from(plant != "missing"),
                "{case}: {aside:?}"
            );
            env.ok(["exec", "--write", "new", "--", "true"]);
            if external {
                assert!(ext.join("new").is_dir(), "{case}: a new image goes there");
            }
            assert_eq!(env.read_in_image("base", "file"), "content\n", "{case}");
            env.ok(["doctor"]);
        }
    }
}

/// A configuration that could not be read (here: mode 000 to its owner;
/// on a shared filesystem, a lost connection) may be sound: the error says
/// the cause, never to set it aside, and `doctor --repair` leaves it where
/// it is.
#[test]
fn a_configuration_that_could_not_be_read_is_never_advised_set_aside() {
    if as_nobody().is_none() {
        return;
    }
    let env = unprivileged_env();
    unprivileged_build(&env, "a", "true");
    let conf = env.root.join("store.conf");
    fs::set_permissions(&conf, fs::Permissions::from_mode(0o000)).unwrap();
    let cause = format!("cannot read {}: Permission denied", conf.display());
    let out = unprivileged(&env, &["rm", "a"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains(&cause), "{}", show(&out));
    assert!(!stderr(&out).contains("set"), "{}", show(&out));
    let out = unprivileged(&env, &["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stdout(&out).contains(&cause), "{}", show(&out));
    assert!(!stdout(&out).contains("sets it aside"), "{}", show(&out));
    let out = unprivileged(&env, &["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let kept = fs::read_dir(&env.root).unwrap().flatten();
    let aside: Vec<_> = kept
        .filter(|e| e.file_name().to_string_lossy().contains("damaged"))
        .collect();
    assert!(aside.is_empty(), "{aside:?}");
    let out = unprivileged(&env, &["images"]);
    assert!(stdout(&out).contains("ready"), "{}", show(&out));
}

/// A lock file its user cannot read (a group member's mode 000, an I/O
/// error) may hold a record: its image's state is unknown, so it is kept
/// and reported, its tree never taken for one without a record, and no
/// other image is kept from being listed, collected or checked.
#[test]
fn a_record_that_could_not_be_read_is_kept_as_unknown() {
    if as_nobody().is_none() {
        return;
    }
    let env = unprivileged_env();
    unprivileged_build(&env, "a", "true");
    unprivileged_build(&env, "b", "true");
    let lock = env.root.join("locks/images/a.lock");
    fs::set_permissions(&lock, fs::Permissions::from_mode(0o000)).unwrap();
    let out = unprivileged(&env, &["images"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        stdout(&out).lines().any(|l| l.starts_with("a ")),
        "{}",
        show(&out)
    );
    let out = unprivileged(&env, &["gc"]);
    assert!(stdout(&out).contains("kept 'a'"), "{}", show(&out));
    let out = unprivileged(&env, &["doctor"]);
    assert!(stdout(&out).contains("cannot be read"), "{}", show(&out));
    assert!(!stdout(&out).contains("no record"), "{}", show(&out));
    let out = unprivileged(&env, &["init"]);
    assert!(!stderr(&out).contains("not adopting"), "{}", show(&out));
    assert!(env.root.join("img/a").is_dir());
}

/// Records that name two images directories say nothing sure: the
/// configuration is not guessed, and doctor says what to do.
#[test]
fn a_configuration_is_not_written_from_records_that_disagree() {
    let env = Env::new();
    env.make_image("base");
    let ext = env.tmp.path().join("ext-img");
    fs::create_dir(&ext).unwrap();
    // Another store's record, copied in: it names another directory.
    let other = Env::new();
    other.ok(["init", "--images-dir", ext.to_str().unwrap()]);
    other.make_image("elsewhere");
    fs::copy(other.lock_file("elsewhere"), env.lock_file("elsewhere")).unwrap();
    let conf = env.root.join("store.conf");
    fs::write(&conf, "garbage").unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("init --images-dir"),
        "{}",
        show(&out)
    );
    assert_eq!(fs::read_to_string(&conf).unwrap(), "garbage");
}

/// store.conf damaged while the external images directory is unmounted:
/// the directory the records name carries no claim of this store, so the
/// repair writes nothing and drops no record; once it is mounted again,
/// the repair writes the configuration and every image is there.
#[test]
fn a_configuration_is_not_written_for_an_images_directory_that_is_not_mounted() {
    if !root_or_skip("bind mounts") {
        return;
    }
    let env = Env::new();
    let real = env.tmp.path().join("real");
    let ext = env.tmp.path().join("ext");
    fs::create_dir(&real).unwrap();
    fs::create_dir(&ext).unwrap();
    let Some(m) = Mount::at(&["--bind", real.to_str().unwrap()], &ext) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    env.ok(["init", "--images-dir", ext.to_str().unwrap()]);
    env.make_image("base");
    drop(m);
    fs::write(ext.join("stray"), "").unwrap();
    let conf = env.root.join("store.conf");
    fs::write(&conf, "garbage").unwrap();
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("is it mounted?"),
        "{}",
        show(&out)
    );
    assert_eq!(fs::read_to_string(&conf).unwrap(), "garbage");
    let _m = Mount::at(&["--bind", real.to_str().unwrap()], &ext).unwrap();
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("base", "file"), "content\n");
}

/// Where the images directory keeps no extended attributes (ramfs), no
/// claim can say whose it is: a lost store.conf is written anew from the
/// records, as before claims, rather than left for a command that cannot
/// write it.
#[test]
fn a_configuration_is_written_from_the_records_where_no_claim_can_be_kept() {
    if !root_or_skip("mounting a ramfs") {
        return;
    }
    let env = Env::new();
    let ext = env.tmp.path().join("ext");
    fs::create_dir(&ext).unwrap();
    let Some(_m) = Mount::ramfs_at(&ext) else {
        return;
    };
    env.ok(["init", "--images-dir", ext.to_str().unwrap()]);
    env.make_image("base");
    fs::write(env.root.join("store.conf"), "garbage").unwrap();
    env.ok(["doctor", "--repair"]);
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("base", "file"), "content\n");
}

/// A repair that finds an image's lock held leaves the image and says so:
/// an interrupted removal is neither finished nor passed over in silence
/// (gc lists it as in use), and a record whose tree is gone is kept with a
/// problem instead of an empty "dropped the records of".
#[test]
fn a_repair_that_finds_a_lock_held_says_what_it_left() {
    let env = Env::new();
    env.make_image("doomed");
    env.make_image("vanished");
    env.make_image("ok");
    let (rm, _pause) = env.paused(["rm", "doomed"], "rm-marked");
    rm.kill_all();
    fs::remove_dir_all(env.root.join("img/vanished")).unwrap();
    let then = "i=0; while [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done";
    let holders = [
        // Exclusively, by an outside program: no removal is under way.
        flock_holder(&env.lock_file("doomed"), &env.sentinel("h1"), then),
        flock_holder(&env.lock_file("vanished"), &env.sentinel("h2"), then),
    ];

    let out = env.run(["gc", "--json"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["busy"],
        serde_json::json!(["doomed"]),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("doomed").as_deref(), Some("deleting"));

    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    says(
        &out,
        &[
            "removal of 'doomed' was interrupted, and its lock is held now",
            "'vanished' had no tree when the records were read, and is in use now",
        ],
    );
    assert!(
        !show(&out).contains("dropped the records of"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("doomed").as_deref(), Some("deleting"));
    assert!(env.state("vanished").is_some());

    for h in holders {
        h.kill_all();
    }
    wait_until("the holders let go", || {
        flock_free(&env.lock_file("doomed")) && flock_free(&env.lock_file("vanished"))
    });
    let out = env.run(["doctor", "--repair"]);
    says(
        &out,
        &[
            "finished the interrupted removal of 'doomed'",
            "dropped the records of 'vanished'",
        ],
    );
    assert_eq!(env.state("doomed"), None);
    assert_eq!(env.state("vanished"), None);
    assert_eq!(env.state("ok").as_deref(), Some("ready"));
}

/// A removal that is still running (its lock held exclusively) is under way,
/// not interrupted: doctor notes it and stays healthy, its repair and gc
/// leave it to its remover. Both said it was cut short (exit 1).
#[test]
fn a_removal_under_way_is_noted_not_taken_for_an_interrupted_one() {
    let env = Env::new();
    env.make_image("doomed");
    let (rm, pause) = env.paused(["rm", "doomed"], "rm-marked");
    for args in [&["doctor"][..], &["doctor", "--repair"]] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(0), "{args:?}: {}", show(&out));
        says(&out, &["removal of 'doomed' is under way"]);
        assert!(!show(&out).contains("interrupted"), "{}", show(&out));
    }
    let out = env.ok(["gc", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["busy"], serde_json::json!([]), "{report}");
    assert_eq!(
        report["interrupted_removals"],
        serde_json::json!([]),
        "{report}"
    );
    fs::remove_file(pause).unwrap();
    assert_eq!(code(&rm.finish()), Some(0));
    assert_eq!(env.state("doomed"), None);
}

/// A removal that finishes while doctor looks is no interrupted one: doctor
/// read its record `deleting`, and took the lock file gone since for one
/// nobody holds (a problem, exit 1).
#[test]
fn a_removal_that_finishes_while_doctor_looks_is_not_reported() {
    finishes_while_doctor_pauses("doctor-listed", false);
}

/// An image removed (and with `anew` written again) while doctor waits at
/// pause point `point`: doctor says nothing of it, and is healthy.
fn finishes_while_doctor_pauses(point: &str, anew: bool) {
    let env = Env::new();
    env.make_image("doomed");
    let (rm, rm_pause) = env.paused(["rm", "doomed"], "rm-moved");
    let (doctor, doctor_pause) = env.paused(["doctor"], point);
    fs::remove_file(rm_pause).unwrap();
    assert_eq!(code(&rm.finish()), Some(0));
    if anew {
        env.make_image("doomed");
    }
    fs::remove_file(doctor_pause).unwrap();
    let out = doctor.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(!show(&out).contains("'doomed'"), "{}", show(&out));
}

/// The same, when the removal finishes after doctor found its lock held
/// and before it asked who holds it, and the name is even written anew:
/// it found nobody holding it, and said interrupted.
#[test]
fn a_removal_that_finishes_while_doctor_asks_who_holds_it_is_not_reported() {
    finishes_while_doctor_pauses("underway-probed", true);
}

/// A repair that cannot take an image's lock file (here: not its user's to
/// open) says so, and never takes the image for gone: gc exited 0 saying
/// nothing, doctor's repair reported nothing of the removal.
#[test]
fn a_lock_file_a_repair_cannot_open_is_reported_not_passed_over() {
    if as_nobody().is_none() {
        return;
    }
    let env = unprivileged_env();
    unprivileged_build(&env, "doomed", "true");
    // Paused where a file of the store's owner can be made, and killed there.
    let pause = env.tmp.path().join("paused");
    let mut c = as_nobody().unwrap();
    c.arg(bin())
        .arg("--root")
        .arg(&env.root)
        .args(["rm", "doomed"]);
    c.env(
        stowage::env::DEBUG_PAUSE,
        format!("rm-marked:{}", pause.display()),
    );
    let rm = Bg::from_command(c);
    wait_for_file(&pause);
    rm.kill_all();
    let lock = env.lock_file("doomed");
    chown(&lock, 0, 0);
    fs::set_permissions(&lock, fs::Permissions::from_mode(0o644)).unwrap();

    let out = unprivileged(&env, &["gc", "--json"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let failed = report["failed"].to_string();
    assert!(
        failed.contains("cannot finish the removal of 'doomed'"),
        "{report}"
    );
    assert_eq!(
        report["interrupted_removals"],
        serde_json::json!([]),
        "{report}"
    );
    let out = unprivileged(&env, &["doctor", "--repair"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    says(&out, &["cannot finish the removal of 'doomed'"]);
    let out = unprivileged(&env, &["images"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("deleting"),
        "{}",
        show(&out)
    );
}

/// A root that does not exist is a problem doctor reports (exit 1, as the
/// contract gives doctor 0, 1 or 69), with or without a repair, and
/// creates nothing: a mistyped root is not grown into a store. doctor
/// exited 66, and its repair made an empty store at the mistyped path.
#[test]
fn doctor_of_a_root_that_does_not_exist_says_so_and_creates_nothing() {
    let env = Env::new();
    for args in [
        &["doctor"][..],
        &["doctor", "--repair"],
        &["doctor", "--json"],
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        assert!(stderr(&out).contains("does not exist"), "{}", show(&out));
        assert_eq!(stderr(&out).lines().count(), 1, "{}", show(&out));
        assert!(!env.root.exists(), "{args:?} created the root");
    }
}

/// Asserts that a command's output says each of `lines`.
fn says(out: &std::process::Output, lines: &[&str]) {
    let text = String::from_utf8_lossy(&out.stdout);
    for l in lines {
        assert!(text.contains(l), "no {l:?} in:\n{}", show(out));
    }
}

/// Another host's doctor (or one in another container) can have our pid:
/// its flock test file, held while it tests, is no file of ours to test,
/// and doctor still finds flock working.
#[test]
fn doctor_beside_another_hosts_doctor_of_the_same_pid_finds_flock_working() {
    if !root_or_skip("a pid namespace") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    // The first process of a new pid namespace is pid 1, as another host's may be.
    let theirs = env.root.join("locks/.doctor.1.lock");
    let wait = format!(
        "i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
        r = env.sentinel("release").display()
    );
    let holder = flock_holder(&theirs, &env.sentinel("held"), &wait);
    let mut c = Command::new("unshare");
    c.args(["--pid", "--fork", "--"]).arg(bin());
    c.arg("--root").arg(&env.root).arg("doctor");
    c.env_remove("STOWAGE_ROOT")
        .stdin(std::process::Stdio::null());
    let out = output(c);
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// A repair whose check of the catalog meets it held in a transaction by
/// an outside program (an sqlite3 shell) that began after doctor looked
/// for one: SQLite's check cannot run, which says nothing of the catalog,
/// and the repair leaves it where it is.
#[test]
fn a_repair_sets_no_busy_catalog_aside() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["images"]);
    let db = env.root.join("stowage.db");
    let file = env.sentinel("paused.doctor-catalog-check");
    let mut c = env.cmd(["doctor", "--repair"]);
    c.env(stowage::env::DEBUG_DB_BUSY_MS, "200");
    c.env(
        stowage::env::DEBUG_PAUSE,
        format!("doctor-catalog-check:{}", file.display()),
    );
    let doctor = Bg::from_command(c);
    wait_for_file(&file);
    let outside = rusqlite::Connection::open(&db).unwrap();
    outside.execute_batch("BEGIN EXCLUSIVE").unwrap();
    fs::remove_file(&file).unwrap();
    let out = doctor.finish();
    outside.execute_batch("COMMIT").unwrap();
    drop(outside);
    let aside: Vec<_> = fs::read_dir(&env.root)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("stowage.db."))
        .collect();
    assert!(aside.is_empty(), "set aside: {aside:?}: {}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("cannot check it"),
        "{}",
        show(&out)
    );
    env.ok(["doctor"]);
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// A temporary file of a `store.conf` write that a kill cut short is
/// reported once it is old (10 minutes), and removed by a repair; a fresh
/// one (a write in progress) is left alone.
#[test]
fn a_configuration_writes_leftover_is_removed_by_a_repair() {
    let env = Env::new();
    env.make_image("a");
    let old = env.root.join(".store.conf.4242.0123456789abcdef");
    fs::write(&old, "stowage-store 1\n").unwrap();
    let later = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let at_later = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env("STOWAGE_NOW", later.to_string());
        output(c)
    };
    let out = env.run(["doctor"]);
    assert!(!stdout(&out).contains("temporary"), "{}", show(&out));
    let out = at_later(&["doctor"]);
    assert!(
        stdout(&out).contains("found 1 temporary file"),
        "{}",
        show(&out)
    );
    assert!(old.exists());
    let out = env.run(["doctor", "--repair"]);
    assert!(old.exists(), "a fresh one stays: {}", show(&out));
    let out = at_later(&["doctor", "--repair"]);
    assert!(
        stdout(&out).contains("removed 1 temporary file"),
        "{}",
        show(&out)
    );
    assert!(!old.exists());
    assert_eq!(env.state("a").as_deref(), Some("ready"));
}

/// A lock file listed by `doctor --repair` and unlinked before it is looked
/// at (its image's remover was quicker) is no problem: nothing is left to
/// judge or repair.
#[test]
fn a_lock_file_gone_after_the_repair_listed_it_is_no_problem() {
    let env = Env::new();
    env.make_image("a");
    let (doctor, go) = env.paused(["doctor", "--repair"], "doctor-file-stated-a.lock");
    fs::remove_file(env.lock_file("a")).unwrap();
    fs::remove_file(&go).unwrap();
    let out = doctor.finish();
    assert!(!stdout(&out).contains("back its mode"), "{}", show(&out));
    assert!(!stdout(&out).contains("PROBLEM"), "{}", show(&out));
}

/// `lost+found` at the root of the images directory's filesystem is never
/// adopted: a write refused over it must not say that a repair adopts it.
#[test]
fn a_write_refused_over_lost_found_does_not_advise_a_repair_that_never_adopts_it() {
    let env = Env::new();
    let Some(_m) = env.init_on_tmpfs() else {
        return;
    };
    let lost = env.tmp.path().join("images/lost+found");
    fs::create_dir(&lost).unwrap();
    // Empty, as mkfs makes it: still the filesystem's, never an image's tree.
    let build = "touch \"$STOWAGE_IMAGE_DIR/built\"";
    let out = env.run(["exec", "--write", "lost:found", "--", "sh", "-c", build]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(stderr(&out).contains("lost+found"), "{}", show(&out));
    assert!(!stderr(&out).contains("adopts it"), "{}", show(&out));
    assert_eq!(fs::read_dir(&lost).unwrap().count(), 0, "{}", show(&out));
    fs::write(lost.join("#1234"), "a file fsck found").unwrap();
    let out = env.run(["exec", "--write", "lost:found", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(stderr(&out).contains("refusing"), "{}", show(&out));
    assert!(!stderr(&out).contains("adopts it"), "{}", show(&out));
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(env.image("lost:found"), None, "{}", show(&out));
}

/// doctor sends the user to `--repair` only where a repair puts something
/// right: not for a problem only the user can mend (a lock file hard-linked
/// elsewhere), but for a trash leftover. Before, every report with a
/// problem ended "run 'stowage doctor --repair' to fix what is safe to
/// fix", which then fixed nothing and exited 1 again.
#[test]
fn doctor_sends_to_a_repair_only_what_a_repair_puts_right() {
    let env = Env::new();
    env.make_image("app");
    let advice = &format!(
        "run 'stowage --root {} doctor --repair'",
        env.root.display()
    );
    let elsewhere = env.sentinel("second-name");
    fs::hard_link(env.lock_file("app"), &elsewhere).unwrap();
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stdout(&out).contains("is a hard link"), "{}", show(&out));
    assert!(!stdout(&out).contains(advice), "{}", show(&out));
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(
        code(&out),
        Some(1),
        "a repair does not mend it: {}",
        show(&out)
    );

    fs::remove_file(&elsewhere).unwrap();
    fs::create_dir_all(env.root.join("trash/left")).unwrap();
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(stdout(&out).contains(advice), "{}", show(&out));
    env.ok(["doctor", "--repair"]);
}

/// A ready image whose tree is a FIFO, a symlink or a file put in its
/// place is a problem naming the image and what is there, and a repair
/// leaves it (stowage did not make it). Only an absent tree counted: doctor
/// and its repair said nothing and exited 0.
#[test]
fn a_ready_image_whose_tree_is_no_directory_is_reported_and_left() {
    for (plant, word) in [
        (Plant::Fifo, "a FIFO"),
        (Plant::Symlink, "a symlink"),
        (Plant::Empty, "a regular file"),
    ] {
        let env = Env::new();
        env.make_image("base");
        let tree = env.root.join("img/base");
        fs::remove_dir_all(&tree).unwrap();
        plant.at(&tree, &env.scratch);
        let named = format!(
            "image 'base' is recorded, but its tree {} is {word}",
            tree.display()
        );
        for args in [&["doctor"][..], &["doctor", "--repair"]] {
            let out = env.run(args);
            assert_eq!(code(&out), Some(1), "{plant:?} {args:?}: {}", show(&out));
            assert!(
                stdout(&out).contains(&named),
                "{plant:?} {args:?}: {}",
                show(&out)
            );
        }
        assert!(plant.is_at(&tree), "{plant:?}: the repair moved it");
        assert_eq!(env.state("base").as_deref(), Some("ready"));
    }
}

/// A slot class whose record in `0.lock` is damaged, which refuses every
/// `exec --slot` of it, is a problem doctor names (it said nothing, exit 0),
/// and `slots` says it is damaged, not "no slot classes".
#[test]
fn a_damaged_slot_class_record_is_reported() {
    let env = Env::new();
    env.ok(["slots", "set", "build", "1"]);
    let zero = env.root.join("locks/slots/build/0.lock");
    fs::write(&zero, "junk\n").unwrap();
    let out = env.run(["exec", "--slot", "build", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let named = format!("slot class 'build' in {} are damaged", zero.display());
    for args in [&["doctor"][..], &["doctor", "--repair"]] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        assert!(stdout(&out).contains(&named), "{args:?}: {}", show(&out));
    }
    let out = env.run(["slots"]);
    assert!(!stdout(&out).contains("no slot classes"), "{}", show(&out));
    assert!(
        stderr(&out).contains("'build' are damaged"),
        "{}",
        show(&out)
    );
    env.ok(["slots", "set", "build", "1"]);
    env.ok(["doctor"]);
}

/// A `store.conf` naming (by a hand's edit, or a copy) an external images
/// directory the store never took, and that `init` refuses — a system tree,
/// a home — has nothing there claimed or adopted by a repair or a plain
/// `init`: both claimed it and adopted its directories as images, which
/// the next gc deleted.
#[test]
fn a_directory_init_refuses_is_never_taken_as_images_directory_by_a_repair() {
    use std::os::unix::fs::MetadataExt;
    for home in [false, true] {
        let env = Env::new();
        env.make_image("base");
        let v = env.tmp.path().join(if home { "someone" } else { "prefix" });
        let dirs: &[&str] = if home {
            &["projects", "thesis"]
        } else {
            &["bin", "lib", "share"]
        };
        for d in dirs {
            fs::create_dir_all(v.join(d)).unwrap();
            fs::write(v.join(d).join("kept"), "precious").unwrap();
        }
        let conf = env.root.join("store.conf");
        let ino = fs::metadata(&v).unwrap().ino();
        let edited: String = (fs::read_to_string(&conf).unwrap().lines())
            .map(|l| match l.split_once('=') {
                Some(("images", _)) => format!("images={}\n", v.display()),
                Some(("identity", id)) => {
                    format!("identity={ino}@{}\n", id.split_once('@').unwrap().1)
                }
                _ => format!("{l}\n"),
            })
            .collect();
        fs::write(&conf, edited + "adopting=ready\n").unwrap();
        let run = |args: &[&str]| {
            let mut c = env.cmd(args);
            if home {
                c.env("HOME", &v);
            }
            output(c)
        };
        for args in [
            &["doctor", "--repair"][..],
            &["init"],
            &["doctor", "--repair"],
        ] {
            let out = run(args);
            assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
            let said = format!("{}{}", stdout(&out), stderr(&out));
            let what = if home {
                "a home directory"
            } else {
                "a system tree"
            };
            assert!(said.contains(what), "{args:?}: {said}");
        }
        run(&["gc", "--max-size", "0"]);
        for d in dirs {
            assert_eq!(
                fs::read_to_string(v.join(d).join("kept")).unwrap(),
                "precious"
            );
        }
    }
}

/// A record an opener erased (as `9>FILE` does) is named as such by every
/// command that meets it, and its lock file is left for `doctor` to name the
/// cause by: a read, a copy from it, a removal all said "does not exist" and
/// unlinked the empty file, so `doctor` then saw a tree without a record only.
#[test]
fn a_record_emptied_by_a_shell_redirection_is_said_by_every_command_and_kept() {
    let env = Env::new();
    env.build("app", "echo hi > \"$STOWAGE_IMAGE_DIR/f\"");
    env.make_image("other");
    let lock = env.lock_file("app");
    fs::File::create(&lock).unwrap();
    let meets: [&[&str]; 4] = [
        &["exec", "--read", "app", "--", "true"],
        &["exec", "--read", "other", "--read", "app", "--", "true"],
        &["exec", "--write", "copy", "--from", "app", "--", "true"],
        &["rm", "app"],
    ];
    for args in meets {
        let out = env.run(args);
        assert_eq!(code(&out), Some(66), "{args:?}: {}", show(&out));
        let said = stderr(&out);
        assert!(
            said.contains("image 'app' has no record, yet a directory is at its name"),
            "{said}"
        );
        assert!(said.contains("a '>' likely erased its record"), "{said}");
        let left = fs::metadata(&lock).map(|m| m.len());
        assert_eq!(left.ok(), Some(0), "{args:?}: the emptied lock file went");
    }
    let said = stdout(&env.run(["doctor"]));
    assert!(
        said.contains("holds no record while its tree is there"),
        "{said}"
    );
    assert_eq!(env.state("other").as_deref(), Some("ready"));
}

/// Only a lock file with no record (store-wide hints aside, no unlinker's
/// mark) and a directory at the image's name is taken for an erased record:
/// a write refused on a symlink planted at a new image's name left an empty
/// lock file every command then blamed on a shell's `>`; a store-wide hold's
/// hint in an erased lock file hid the cause; an images directory that was
/// not mounted let a read unlink the evidence.
#[test]
fn only_a_directory_with_an_empty_record_is_said_to_be_an_erased_image() {
    let env = Env::new();
    env.ok(["init"]);
    std::os::unix::fs::symlink("/nowhere", env.images_dir().join("sl")).unwrap();
    let out = env.run(["exec", "--write", "sl", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let out = env.run(["exec", "--read", "sl", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains("image 'sl' does not exist"),
        "{}",
        show(&out)
    );
    assert!(
        !env.lock_file("sl").exists(),
        "the refused write's lock file stayed"
    );
    // A hint a store-wide hold set in an erased record's lock file is no record.
    env.make_image("x");
    fs::File::create(env.lock_file("x")).unwrap();
    env.ok(["exec", "--store-wide", "--", "true"]);
    let out = env.run(["exec", "--read", "x", "--", "true"]);
    assert_eq!(code(&out), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains("likely erased its record"),
        "{}",
        show(&out)
    );
    assert!(stdout(&env.run(["doctor"])).contains("holds no record while its tree is there"));
}

/// flock(1)'s man page idiom `( flock -s 9 …) 9>FILE` on an image's lock
/// file erases its record. The catalog's row is no copy to restore it from
/// (a failed write since may be missing from it), so `doctor` says what
/// emptied it and how to mark the image ready again, and `--repair` adopts
/// it as incomplete, saying its base is lost.
#[test]
fn a_record_emptied_by_a_shell_redirection_is_said_with_its_cure() {
    if !have("flock") {
        eprintln!("skipping: flock(1) not found");
        return;
    }
    let env = Env::new();
    env.build("app", "echo hi > \"$STOWAGE_IMAGE_DIR/f\"");
    let lock = env.lock_file("app");
    let mut c = std::process::Command::new("sh");
    c.arg("-c").arg(format!(
        "( flock -s 9 && cat '{}/app/f' ) 9>'{}'",
        env.images_dir().display(),
        lock.display()
    ));
    assert_eq!(code(&output(c)), Some(0));
    assert_eq!(fs::metadata(&lock).unwrap().len(), 0, "emptied");
    let out = env.run(["doctor"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    let said = stdout(&out);
    assert!(
        said.contains("holds no record while its tree is there"),
        "{said}"
    );
    assert!(said.contains("exec --write NAME -- true"), "{said}");
    let out = env.run(["doctor", "--repair"]);
    let said = stdout(&out);
    assert!(said.contains("its base is lost"), "{said}");
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    env.ok(["exec", "--write", "app", "--", "true"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("app", "f").trim(), "hi");
}

/// A store file with a read-only mount over it (the root writable) is said
/// to be on a read-only mount: it was blamed on its mode, with a repair
/// that then failed ("cannot give … back its mode: Read-only file system").
#[test]
fn a_store_file_on_a_read_only_mount_is_said_so() {
    if !root_or_skip("bind mounts") {
        return;
    }
    let env = Env::new();
    env.make_image("base");
    env.ok(["images"]);
    // Not yet in the catalog: the next look writes it.
    env.make_image("other");
    let db = env.root.join("stowage.db");
    let Some(_m) = Mount::at(&["--bind", db.to_str().unwrap()], &db) else {
        eprintln!("skipping: cannot bind-mount here");
        return;
    };
    let ro = Command::new("mount")
        .args(["-o", "remount,bind,ro"])
        .arg(&db)
        .status();
    assert!(ro.is_ok_and(|s| s.success()));
    let out = env.run(["images"]);
    assert!(
        stderr(&out).contains("is on a read-only mount"),
        "{}",
        show(&out)
    );
    for args in [&["doctor"][..], &["doctor", "--repair"]] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(1), "{}", show(&out));
        let said = stdout(&out);
        assert!(
            said.contains("stowage.db is on a read-only mount"),
            "{said}"
        );
        assert!(!said.contains("back its mode"), "{said}");
    }
    // A directory of the layout under a read-only mount (the root writable) is said so too.
    let locks = env.root.join("locks/images");
    let Some(_l) = Mount::at(&["--bind", locks.to_str().unwrap()], &locks) else {
        return;
    };
    let ro = Command::new("mount")
        .args(["-o", "remount,bind,ro"])
        .arg(&locks)
        .status();
    assert!(ro.is_ok_and(|s| s.success()));
    let said = stdout(&env.run(["doctor"]));
    assert!(
        said.contains("locks/images is on a read-only mount"),
        "{said}"
    );
}

/// A symlink, file or FIFO at an image's name in the images directory is no
/// image, yet it makes `exec --write NAME` refuse: `doctor` names it (and
/// leaves it to its owner) where it said the store was healthy and nothing
/// of it.
#[test]
fn doctor_names_what_in_the_images_directory_keeps_a_new_image_from_being_made() {
    let env = Env::new();
    env.make_image("base");
    let img = env.images_dir();
    std::os::unix::fs::symlink("/nowhere", img.join("nw")).unwrap();
    fs::write(img.join("cl"), "junk").unwrap();
    nix::unistd::mkfifo(
        &img.join("ff"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let out = env.run(["doctor"]);
    let said = stdout(&out);
    for (name, kind) in [("nw", "a symlink"), ("cl", "a file"), ("ff", "a FIFO")] {
        let line = said.lines().find(|l| l.contains(&format!("\"{name}\"")));
        let line = line.unwrap_or_else(|| panic!("{name} not named: {said}"));
        assert!(
            line.contains(kind) && line.contains("refused until it is removed"),
            "{line}"
        );
        let out = env.run(["exec", "--write", name, "--", "true"]);
        assert_eq!(code(&out), Some(1), "{}", show(&out));
    }
    assert!(img.join("ff").exists() && img.join("cl").exists());
}

/// A removal under way while `doctor --repair` reads the records (on
/// another host, say: its tree moved to the trash, its lock held) is no
/// problem of the store: the repair said "records but no tree" and exited 1.
#[test]
fn a_removal_under_way_during_a_repair_is_no_problem() {
    let env = Env::new();
    env.make_image("dr1");
    env.make_image("kept");
    let (doctor, read) = env.paused(["doctor", "--repair"], "doctor-records-read");
    let (rm, moved) = env.paused(["rm", "dr1"], "rm-moved");
    fs::remove_file(&read).unwrap();
    let out = doctor.finish();
    fs::remove_file(&moved).unwrap();
    assert_eq!(code(&rm.finish()), Some(0));
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(stdout(&out).contains("'dr1' had no tree"), "{}", show(&out));
    assert!(env.image("dr1").is_none());
    assert_eq!(env.state("kept").as_deref(), Some("ready"));
}

/// A record whose tree is gone while a reader holds the image is a problem
/// still: a read changes nothing, so no removal or write under way explains
/// it (a repair that only noted it kept a cron of repairs green).
#[test]
fn a_tree_gone_under_a_reader_is_a_problem_to_a_repair() {
    let env = Env::new();
    env.make_image("keep");
    env.make_image("other");
    let started = env.sentinel("reading");
    let script = format!("touch '{}'; sleep 30", started.display());
    let reader = env.spawn(["exec", "--read", "keep", "--", "sh", "-c", &script]);
    wait_for_file(&started);
    fs::remove_dir_all(env.root.join("img/keep")).unwrap();
    let out = env.run(["doctor", "--repair"]);
    reader.kill_all();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(
        stdout(&out).contains("'keep' had no tree"),
        "{}",
        show(&out)
    );
    assert!(stdout(&out).contains("is read now"), "{}", show(&out));
}
