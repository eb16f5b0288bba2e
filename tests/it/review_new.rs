//! Adversarial checks of a new image written without the database
//! (src/written.rs, new images): what runs beside such a writer must not
//! lose an image its writer finished with exit 0, nor call ready what is
//! not complete.

use crate::common::*;

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
    // A repair while it runs: it renews the database's identity.
    env.ok(["doctor", "--repair"]);
    env.release("release");
    let out = writer.finish();
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
