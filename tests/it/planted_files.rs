//! Something other than a regular file where stowage keeps a file of its
//! own — a FIFO, a symlink, a directory, a socket, planted by another
//! program or another member of a store's group: every command ends, its
//! one line names the file that is wrong (not the one it was after) and
//! what to do, `doctor` reports it and `doctor --repair` sets it aside.
//! (`planted_everywhere` plants each kind at every path of the layout.)

use std::fs;
use std::path::Path;

use crate::common::*;

/// `doctor` names `path` as a problem (exit 1); `doctor --repair` sets it
/// aside (exit 0), after which `doctor` finds nothing wrong.
fn doctor_sets_aside(env: &Env, path: &Path, plant: Plant) {
    let out = env.run(["doctor"]);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(code(&out), Some(1), "{plant:?}: {}", show(&out));
    assert!(
        said.contains(&format!("{} is {}", path.display(), plant.word())),
        "{plant:?}: doctor does not name {}: {}",
        path.display(),
        show(&out)
    );
    let out = env.run(["doctor", "--repair"]);
    assert_eq!(code(&out), Some(0), "{plant:?}: {}", show(&out));
    assert!(!plant.is_at(path), "{plant:?} still at {}", path.display());
    let aside = fs::read_dir(path.parent().unwrap())
        .unwrap()
        .flatten()
        .any(|e| {
            e.file_name().to_string_lossy().starts_with(&format!(
                "{}.planted-",
                path.file_name().unwrap().to_string_lossy()
            ))
        });
    assert!(aside, "{plant:?}: nothing set aside for {}", path.display());
    let out = env.run(["doctor"]);
    assert_eq!(code(&out), Some(0), "{plant:?}: {}", show(&out));
}

/// Something planted at an image's gate is named as itself, never as the
/// image's lock file; and since no writer can hold it, it stops nobody: a
/// writer that must wait waits without it, a reader that finds the hint
/// of a waiting writer passes.
#[test]
fn a_planted_gate_is_named_and_stops_no_writer_or_reader() {
    for plant in Plant::NOT_FILES {
        let env = Env::new();
        env.make_image("base");
        let gate = gate_file(&env, "base");
        plant.at(&gate, env.tmp.path());
        let reader = env.hold(&["--read", "base"], "held");
        let writer = env.spawn(["exec", "--write", "base", "--wait", "60", "--", "true"]);
        env.wait_for_waiter("base");
        env.release("release");
        assert_eq!(code(&reader.finish()), Some(0));
        let out = writer.finish();
        let err = stderr(&out);
        assert_eq!(code(&out), Some(0), "{plant:?}: {}", show(&out));
        assert!(
            err.contains(&gate.display().to_string()) && !err.contains("base.lock"),
            "{plant:?}: the gate is not the one named: {err}"
        );
        // A writer that waited once left the hint behind it.
        let f = fs::OpenOptions::new()
            .write(true)
            .open(env.lock_file("base"))
            .unwrap();
        stowage::image_record::set_writer_waits(&f, true).unwrap();
        let out = env.run(["exec", "--read", "base", "--", "true"]);
        assert_eq!(code(&out), Some(0), "{plant:?}: {}", show(&out));
        doctor_sets_aside(&env, &gate, plant);
    }
}

/// Something planted at `store.lock` holds no store-wide hold (none can be
/// taken on it): new images are made beside it; a store-wide command
/// refuses, naming it, until `doctor --repair` sets it aside.
#[test]
fn a_planted_store_lock_stops_no_new_image_and_is_named() {
    for plant in Plant::NOT_FILES {
        let env = Env::new();
        env.make_image("base");
        let store_lock = env.root.join("locks/store.lock");
        plant.at(&store_lock, env.tmp.path());
        env.ok(["exec", "--write", "new", "--", "true"]);
        env.ok(["exec", "--read", "base", "--", "true"]);
        let out = env.run(["exec", "--store-wide", "--", "true"]);
        assert_eq!(code(&out), Some(1), "{plant:?}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&format!("{} is {}", store_lock.display(), plant.word()))
                && err.contains("doctor --repair")
                && err.trim_end().lines().count() == 1,
            "{plant:?}: {err}"
        );
        doctor_sets_aside(&env, &store_lock, plant);
        env.ok(["exec", "--store-wide", "--", "true"]);
        assert_eq!(env.state("new").as_deref(), Some("ready"));
    }
}

/// A tree without a record whose lock file's place holds something
/// planted: `doctor --repair` sets that aside and adopts the tree; it never
/// stops half-way ("Illegal seek") nor says it repaired what it did not.
#[test]
fn a_planted_lock_file_of_a_tree_without_a_record_is_set_aside_and_the_tree_adopted() {
    for plant in Plant::NOT_FILES {
        let env = Env::new();
        env.make_image("base");
        fs::create_dir_all(env.images_dir().join("orphan")).unwrap();
        let lock = env.lock_file("orphan");
        plant.at(&lock, env.tmp.path());
        doctor_sets_aside(&env, &lock, plant);
        let orphan = env.image("orphan").expect("adopted");
        assert_eq!(orphan["state"], "incomplete", "{plant:?}");
        assert_eq!(env.state("base").as_deref(), Some("ready"));
    }
}

/// Something planted at a slot class's `0.lock`, which carries the class's
/// limits: `slots set` and acquirers name it (not "Illegal seek", not an
/// unknown class), and after `doctor --repair` the class is set anew.
#[test]
fn a_planted_first_slot_file_is_named_and_set_aside() {
    for plant in Plant::NOT_FILES {
        let env = Env::new();
        env.ok(["slots", "set", "pull", "2"]);
        let zero = env.root.join("locks/slots/pull/0.lock");
        fs::remove_file(&zero).unwrap();
        plant.at(&zero, env.tmp.path());
        let named = format!("{} is {}", zero.display(), plant.word());
        for args in [
            &["slots", "set", "pull", "3"][..],
            &["exec", "--slot", "pull", "--", "true"],
            &["slots"],
        ] {
            let out = env.run(args);
            let said = format!("{}{}", stderr(&out), String::from_utf8_lossy(&out.stdout));
            assert!(
                said.contains(&named) && said.contains("doctor --repair"),
                "{plant:?} {args:?}: {}",
                show(&out)
            );
        }
        doctor_sets_aside(&env, &zero, plant);
        env.ok(["slots", "set", "pull", "3"]);
        env.ok(["exec", "--slot", "pull", "--", "true"]);
    }
}

/// A slot class's `0.lock`, which carries its limits, replaced by something
/// that is no file while a waiter waits (the old file moved aside, still
/// held): once the holder lets go the waiter ends with the refusal a newcomer
/// gets, naming what is there, and runs nothing. It waited on for ever: the
/// try after the close found the path no longer its file and slept on. Its
/// `--wait` ends before the waiter's periodic look at the class would.
#[test]
fn a_slot_waiter_whose_class_record_file_is_replaced_ends_with_the_refusal() {
    for plant in Plant::NOT_FILES {
        let env = Env::new();
        env.ok(["slots", "set", "build", "1"]);
        let holder = env.hold(&["--slot", "build"], "started");
        let ran = env.sentinel("ran");
        let touch = ["touch", ran.to_str().unwrap()];
        let args = ["exec", "--slot", "build", "--wait", "25", "--"];
        let waiter = env.spawn(args.iter().chain(&touch));
        env.wait_for_slot_waiters("build", 1);
        let zero = env.root.join("locks/slots/build/0.lock");
        fs::rename(&zero, zero.with_extension("lock.x")).unwrap();
        plant.at(&zero, env.tmp.path());
        env.release("release");
        assert_eq!(code(&holder.finish()), Some(0), "{plant:?}");
        let named = format!("{} is {}", zero.display(), plant.word());
        let out = waiter.finish();
        assert_eq!(code(&out), Some(1), "{plant:?}: {}", show(&out));
        assert!(stderr(&out).contains(&named), "{plant:?}: {}", show(&out));
        assert!(!ran.exists(), "{plant:?}: the waiter ran its command");
        let out = env.run(args.iter().chain(&touch));
        assert!(stderr(&out).contains(&named), "{plant:?}: {}", show(&out));
    }
}

/// A file where a slot class's directory belongs is called what it is, in
/// place of what: "a regular file, not a directory" (it said "a regular
/// file, not a regular file").
#[test]
fn a_file_in_a_slot_class_directorys_place_is_said_to_be_no_directory() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let class = env.root.join("locks/slots/pull");
    fs::remove_dir_all(&class).unwrap();
    fs::write(&class, "x").unwrap();
    let out = env.run(["doctor"]);
    let said = format!("{} is a regular file, not a directory", class.display());
    assert!(stdout(&out).contains(&said), "{}", show(&out));
}

/// A FIFO at a class's `changed` file, whose close wakes the class's
/// waiters: `slots set` and `slots rm` end (a plain open for writing would
/// wait for a reader for ever), and doctor sets the FIFO aside.
#[test]
fn a_fifo_at_a_classs_changed_file_hangs_no_change_of_the_class() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "2"]);
    let changed = env.root.join("locks/slots/pull/changed");
    let _ = fs::remove_file(&changed);
    Plant::Fifo.at(&changed, env.tmp.path());
    env.ok(["slots", "set", "pull", "3"]);
    doctor_sets_aside(&env, &changed, Plant::Fifo);
    Plant::Fifo.at(&changed, env.tmp.path());
    env.ok(["slots", "rm", "pull"]);
}

/// A FIFO put at the catalog's journal after stowage checked it, before
/// SQLite opens it (its hot-journal check opens the journal read-only,
/// which waits for a writer): the open is refused at once, the command ends
/// naming the FIFO, and the next one says what to do.
#[test]
fn a_fifo_put_at_the_catalogs_journal_after_the_check_blocks_nothing() {
    let env = Env::new();
    env.make_image("app");
    env.ok(["images"]);
    let (mut doctor, file) = env.paused(["doctor"], "doctor-catalog-check");
    let journal = env.root.join("stowage.db-journal");
    Plant::Fifo.at(&journal, env.tmp.path());
    fs::remove_file(&file).unwrap();
    wait_until("doctor ends, not waiting on the FIFO", || {
        !doctor.is_running()
    });
    let out = doctor.finish();
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    let named = format!("{} is a FIFO", journal.display());
    assert!(stdout(&out).contains(&named), "{}", show(&out));
    let out = env.run(["images"]);
    assert!(stderr(&out).contains(&named), "{}", show(&out));
    doctor_sets_aside(&env, &journal, Plant::Fifo);
}

/// A link and a directory planted under slot names that holders of a
/// higher limit may still hold (a lowered limit counts them): only regular
/// files are slots, so a waiter skips them and gets the slot freed.
#[test]
fn entries_planted_beyond_a_lowered_limit_do_not_fail_the_waiters() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "4"]);
    let first = env.hold_until(&["--slot", "pull"], "first", "release-first");
    let second = env.hold_until(&["--slot", "pull"], "second", "release-second");
    env.ok(["slots", "set", "pull", "1"]);
    let dir = env.root.join("locks/slots/pull");
    Plant::Symlink.at(&dir.join("3.lock"), &env.scratch);
    Plant::Dir.at(&dir.join("2.lock"), &env.scratch);
    let waiter = env.spawn(["exec", "--slot", "pull", "--wait", "60", "--", "true"]);
    env.wait_for_slot_waiters("pull", 1);
    env.release("release-first");
    env.release("release-second");
    assert_eq!(code(&first.finish()), Some(0));
    assert_eq!(code(&second.finish()), Some(0));
    let out = waiter.finish();
    assert_eq!(
        code(&out),
        Some(0),
        "the waiter gets the slot: {}",
        show(&out)
    );
}

/// A lock directory its user cannot list (its mode) is refused, naming it:
/// lock-status never reads it as "nothing held", nor `slots` as "no slot
/// classes".
#[test]
fn a_lock_directory_that_cannot_be_listed_is_named_not_taken_for_empty() {
    use std::os::unix::fs::PermissionsExt;
    let env = unprivileged_env();
    unprivileged_build(&env, "b", "true");
    let out = unprivileged(&env, &["slots", "set", "pull", "2"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    for (dir, args) in [
        ("locks/images", ["lock-status"]),
        ("locks/slots", ["slots"]),
    ] {
        let path = env.root.join(dir);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o300)).unwrap();
        let out = unprivileged(&env, &args);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        assert_ne!(code(&out), Some(0), "{dir}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&*path.to_string_lossy()) && err.lines().count() == 1,
            "{dir}: {}",
            show(&out)
        );
    }
}

/// A hard link planted at a new image's lock file, to a file outside the
/// root — empty or not, on a store seen as local or as shared (where an
/// empty lock file is otherwise taken for a fresh one without a stat):
/// the writer refuses it in one line naming it, the file outside keeps
/// its bytes, and `doctor --repair` sets the link aside, after which the
/// image is made.
#[test]
fn a_hard_link_at_a_lock_file_is_never_written_through() {
    for (fs_type, contents) in [
        ("local", ""),
        ("local", "precious"),
        ("nfs", ""),
        ("nfs", "precious"),
    ] {
        let env = Env::new();
        env.make_image("base");
        let victim = env.tmp.path().join("victim");
        fs::write(&victim, contents).unwrap();
        let lock = env.lock_file("new");
        fs::hard_link(&victim, &lock).unwrap();
        let mut c = env.cmd(["exec", "--write", "new", "--", "true"]);
        if fs_type == "nfs" {
            c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
        }
        let out = output(c);
        let err = stderr(&out);
        assert_eq!(
            code(&out),
            Some(1),
            "{fs_type} {contents:?}: {}",
            show(&out)
        );
        assert!(
            err.contains(&format!("{} is a hard link", lock.display()))
                && err.trim_end().lines().count() == 1,
            "{fs_type} {contents:?}: {err}"
        );
        let intact = || fs::read(&victim).unwrap() == contents.as_bytes();
        assert!(intact(), "{fs_type} {contents:?}: written through");
        doctor_sets_aside(&env, &lock, Plant::HardLink);
        assert!(
            intact(),
            "{fs_type} {contents:?}: written through by doctor"
        );
        env.ok(["exec", "--write", "new", "--", "true"]);
        assert_eq!(env.state("new").as_deref(), Some("ready"));
    }
}

/// A hard link at a busy image's lock file, to a file outside the root
/// that an outside program holds locked: a writer that waits for it, and
/// a store-wide command that marks every lock file, write no hint through
/// it (each is written without the lock, off the path that checks).
#[test]
fn a_hard_link_at_a_busy_lock_file_gets_no_hint_written_through() {
    let env = Env::new();
    env.make_image("base");
    let victim = env.tmp.path().join("victim");
    fs::write(&victim, "precious").unwrap();
    let lock = env.lock_file("base");
    fs::remove_file(&lock).unwrap();
    fs::hard_link(&victim, &lock).unwrap();
    let started = env.tmp.path().join("outsider-started");
    let outsider = flock_holder(&victim, &started, "sleep 60");
    let out = env.run(["exec", "--write", "base", "--wait", "1", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    let intact = || fs::read(&victim).unwrap() == b"precious";
    assert!(intact(), "the waiting writer wrote through the link");
    let out = env.run(["exec", "--store-wide", "--", "true"]);
    assert!(
        intact(),
        "the store-wide command wrote through the link: {}",
        show(&out)
    );
    drop(outsider);
    let out = env.run(["exec", "--write", "base", "--", "true"]);
    assert_eq!(code(&out), Some(1), "{}", show(&out));
    assert!(intact(), "the writer wrote through the link");
}

/// A store copied with `cp -al` shares each image's lock file with the
/// original: both read their images (a read long after the last use
/// records none through it), neither writes or removes one through the
/// shared file (which would change the other store's record), each says
/// so in one line; `doctor` reports it with what to
/// do and `--repair` leaves it; once given a file of its own, the copy
/// writes its image and the original's record is as it was.
#[test]
fn a_store_copied_with_hard_links_reads_both_and_writes_neither_through_them() {
    let env = Env::new();
    env.build("base", "echo hi > \"$STOWAGE_IMAGE_DIR/f\"");
    let copy = env.tmp.path().join("copy");
    let st = std::process::Command::new("cp")
        .arg("-al")
        .arg(&env.root)
        .arg(&copy)
        .status()
        .unwrap();
    assert!(st.success());
    let original_lock = env.lock_file("base");
    // A store-wide command killed in its hold left its hint: readers find
    // the store free, and may clear it only in a file of their own.
    let f = fs::OpenOptions::new()
        .write(true)
        .open(&original_lock)
        .unwrap();
    stowage::image_record::set_store_wide(&f, true).unwrap();
    drop(f);
    let before = fs::read(&original_lock).unwrap();
    let run = |root: &Path, args: &[&str]| {
        let mut c = std::process::Command::new(bin());
        c.arg("--root").arg(root).args(args);
        c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
        output(c)
    };
    // A day later: a reader records its use where it may.
    let later = |root: &Path, args: &[&str]| {
        let mut c = std::process::Command::new(bin());
        c.arg("--root").arg(root).args(args);
        c.env_remove("STOWAGE_ROOT")
            .env("STOWAGE_NOW", "2099-01-01T00:00:00Z");
        output(c)
    };
    let read = [
        "exec",
        "--read",
        "base",
        "--",
        "sh",
        "-c",
        "cat \"$STOWAGE_IMAGES_DIR/base/f\"",
    ];
    for root in [&env.root, &copy] {
        let out = later(root, &read);
        assert_eq!(code(&out), Some(0), "{}", show(&out));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
        let out = run(root, &["images"]);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("base"),
            "{}",
            show(&out)
        );
        for args in [
            &["exec", "--write", "base", "--", "true"][..],
            &["rm", "base"],
        ] {
            let out = run(root, args);
            let err = stderr(&out);
            assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
            assert!(
                err.contains("is a hard link") && err.trim_end().lines().count() == 1,
                "{args:?}: {err}"
            );
        }
    }
    // A read that must wait (for another image of its request) still
    // finds the shared file's record: the image exists.
    let holder = env.hold(&["--write", "other"], "held");
    let waiter = env.spawn([
        "exec", "--read", "base", "--write", "other", "--wait", "30", "--", "true",
    ]);
    env.wait_for_waiter("other");
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
    let out = waiter.finish();
    assert_eq!(
        code(&out),
        Some(0),
        "a waiting reader of the shared file: {}",
        show(&out)
    );
    let copy_lock = copy.join("locks/images/base.lock");
    for args in [&["doctor"][..], &["doctor", "--repair"]] {
        let out = run(&copy, args);
        assert_eq!(code(&out), Some(1), "{args:?}: {}", show(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout)
                .contains(&format!("{} is a hard link", copy_lock.display())),
            "{args:?}: {}",
            show(&out)
        );
    }
    assert!(
        fs::read(&original_lock).unwrap() == before,
        "the original's record changed"
    );
    let own = copy_lock.with_extension("own");
    fs::copy(&copy_lock, &own).unwrap();
    fs::rename(&own, &copy_lock).unwrap();
    let out = run(&copy, &["exec", "--write", "base", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(
        fs::read(&original_lock).unwrap() == before,
        "the original's record changed"
    );
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// What is planted among the root's own files (the reserve, the
/// configuration) is found by `doctor` and set aside by `--repair` like
/// anywhere else in the layout: the root is listed, not only looked into.
#[test]
fn doctor_finds_what_is_planted_among_the_roots_own_files() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["gc"]);
    let reserve = env.root.join("reserve");
    assert!(reserve.is_file(), "gc tops the reserve up");
    fs::remove_file(&reserve).unwrap();
    let victim = env.tmp.path().join("victim");
    fs::write(&victim, "precious").unwrap();
    Plant::HardLink.at(&reserve, &victim);
    doctor_sets_aside(&env, &reserve, Plant::HardLink);
    assert!(fs::read(&victim).unwrap() == b"precious", "written through");
}

/// A name planted among the store's files — with a newline and a forged
/// line, or with shell syntax — never makes a second line of what doctor
/// says, and a command doctor tells the user to run quotes it: pasted, it
/// does what it says and nothing else.
#[test]
fn planted_names_make_no_second_line_and_no_command_of_their_own() {
    let env = Env::new();
    env.ok(["exec", "--write", "base", "--", "true"]);
    let images = env.root.join("locks/images");
    Plant::Fifo.at(&images.join("f\nstowage: all is well.lock"), &env.scratch);
    let link = images.join("x;touch pwned;.lock");
    fs::hard_link(images.join("base.lock"), &link).unwrap();
    for args in [&["doctor"][..], &["doctor", "--repair"][..]] {
        let out = env.run(args);
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
        assert!(
            !said
                .lines()
                .any(|l| l.trim_start().starts_with("stowage: all is well")),
            "{args:?}: {said}"
        );
        assert!(
            said.contains("f\\nstowage: all is well.lock"),
            "{args:?}: {said}"
        );
    }
    // The advice for the shared record, run as a shell would run it.
    let said = String::from_utf8_lossy(&env.run(["doctor"]).stdout).into_owned();
    let advice = said
        .lines()
        .find(|l| l.contains("x;touch pwned;.lock is a hard link"))
        .and_then(|l| l.split_once("give it a file of its own: "))
        .map(|(_, cmd)| cmd.to_owned())
        .unwrap_or_else(|| panic!("no advice for the link: {said}"));
    let out = output({
        let mut c = std::process::Command::new("sh");
        c.arg("-c").arg(&advice).current_dir(&env.scratch);
        c
    });
    assert_eq!(code(&out), Some(0), "{advice}: {}", show(&out));
    assert!(
        !env.scratch.join("pwned").exists(),
        "{advice} ran more than it said"
    );
    use std::os::unix::fs::MetadataExt as _;
    assert_eq!(fs::metadata(&link).unwrap().nlink(), 1, "{advice}");
}
