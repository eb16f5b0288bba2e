//! Adversarial checks of a new image written without the database
//! (src/written.rs, new images): what runs beside such a writer must not
//! lose an image its writer finished with exit 0, nor call ready what is
//! not complete.

use std::fs;

use crate::common::*;

/// A store whose global lock file states its images directory, with no
/// image in it yet.
fn empty_store() -> Env {
    let env = Env::new();
    env.ok(["init"]);
    env.ok(["images"]);
    env
}

#[test]
fn a_repair_beside_a_new_images_writer_does_not_lose_its_image() {
    let env = Env::new();
    env.make_image("base");
    let writer = env.start_sh(&["--write", "app"], |started| {
        format!(
            "echo made > \"$STOWAGE_IMAGE_DIR/file\"; touch '{}'; \
             i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
            started.display(),
            r = env.sentinel("release").display()
        )
    });
    assert!(env.marker("app").exists(), "written without the database");
    // A repair renews the database's identity: it waits for the writer,
    // whose record names the identity it started under.
    let repair = env.spawn(["doctor", "--repair"]);
    let store_lock = env.root.join("locks/store.lock");
    wait_until("the repair waits for the writer", || {
        flock_waited_on(&store_lock)
    });
    env.release("release");
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = repair.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    // The writer finished with exit 0: its image is ready, and gc keeps it.
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["gc"]);
    assert!(
        env.images_dir().join("app/file").exists(),
        "its tree is kept"
    );
    env.ok(["exec", "--read", "app", "--", "true"]);
    env.ok(["doctor"]);
}

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
        String::from_utf8_lossy(&out.stdout).contains("repair=75"),
        "{}",
        show(&out)
    );
    assert_eq!(env.state("app").as_deref(), Some("ready"));
}

#[test]
fn the_images_directory_does_not_switch_beside_a_new_images_writer() {
    let env = empty_store();
    let writer = env.hold(&["--write", "app"], "started");
    assert!(env.marker("app").exists(), "written without the database");
    let other = env.tmp.path().join("elsewhere");
    // No row counts the image yet: the switch must see its writer all the
    // same (its tree is in the directory it would leave behind).
    let out = env.run(["init", "--images-dir", other.to_str().unwrap()]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    assert!(stderr(&out).contains("busy"), "{}", show(&out));
    env.release("release");
    let w = writer.finish();
    assert_eq!(code(&w), Some(0), "{}", show(&w));
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["gc"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "app", "--", "true"]);
    env.ok(["doctor"]);
}

#[test]
fn a_new_image_is_not_made_through_a_link_in_the_images_directorys_place() {
    // The write without the database refuses the link; the database's way,
    // which it falls back to, must not follow it either.
    let env = Env::new();
    env.make_image("base");
    let outside = env.tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let img = env.images_dir();
    fs::rename(&img, env.tmp.path().join("img.real")).unwrap();
    std::os::unix::fs::symlink(&outside, &img).unwrap();
    let out = env.run(["exec", "--write", "app", "--", "true"]);
    assert_ne!(code(&out), Some(0), "{}", show(&out));
    assert!(
        fs::read_dir(&outside).unwrap().next().is_none(),
        "a tree was made outside the images directory: {}",
        show(&out)
    );
}

#[test]
fn a_lost_database_does_not_make_a_finished_new_image_gcs_to_delete() {
    // Written without the database and folded: its record stays in its
    // lock file, naming the database that is then lost.
    let env = Env::new();
    env.make_image("base");
    env.build("app", "echo made > \"$STOWAGE_IMAGE_DIR/file\"");
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    fs::rename(env.root.join("stowage.db"), env.scratch.join("lost.db")).unwrap();
    // The first command on the new database: its tree is kept …
    env.ok(["gc"]);
    assert!(
        env.images_dir().join("app/file").exists(),
        "gc deleted a tree its writer finished"
    );
    // … and adopted as any other tree of a directory no database managed.
    env.ok(["init"]);
    assert_eq!(env.state("app").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "app", "--", "true"]);
    env.ok(["doctor"]);
}
