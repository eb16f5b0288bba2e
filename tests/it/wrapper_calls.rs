//! The wrapper scripts under `scripts/`, called every way the docs call
//! them; here, with `CARGO_TARGET_DIR` unset, relative or absolute.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::charliecloud::{assert_ok, assert_ok_ref};
use crate::common::*;

const SCRIPTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts");
const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// The target directory the test binary was built in, and the host tuple:
/// TARGET/HOST/debug/stowage.
fn target_and_host() -> (PathBuf, String) {
    let me = Path::new(env!("CARGO_BIN_EXE_stowage"));
    let host_dir = me.parent().unwrap().parent().unwrap();
    let host = host_dir.file_name().unwrap().to_str().unwrap().to_owned();
    (host_dir.parent().unwrap().to_owned(), host)
}

/// Cargo without what `cargo test` set for this test process, and with
/// the target directory named `how`: (variable, value) or none.
fn cargo_env(c: &mut Command, how: Option<(&str, &Path)>) {
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.contains("CARGO") && k != "CARGO_HOME" {
            c.env_remove(&k);
        }
    }
    if let Some((var, value)) = how {
        c.env(var, value);
    }
}

/// scripts/built-binary prints the binary Cargo builds, however the
/// target directory is given: unset, relative (to where Cargo runs),
/// absolute, or as CARGO_BUILD_TARGET_DIR.
#[test]
fn built_binary_names_the_binary_cargo_builds_however_the_target_dir_is_given() {
    if !tool_or_skip("cargo", "cargo") {
        return;
    }
    let (target, host) = target_and_host();
    let me = fs::canonicalize(env!("CARGO_BIN_EXE_stowage")).unwrap();
    let outside = target.parent().unwrap();
    let name = Path::new(target.file_name().unwrap());
    let cases: [(&str, Option<(&str, &Path)>, &Path); 4] = [
        (
            "absolute",
            Some(("CARGO_TARGET_DIR", &target)),
            Path::new(REPO),
        ),
        ("relative", Some(("CARGO_TARGET_DIR", name)), outside),
        (
            "CARGO_BUILD_TARGET_DIR",
            Some(("CARGO_BUILD_TARGET_DIR", &target)),
            Path::new(REPO),
        ),
        ("unset", None, Path::new("/")),
    ];
    for (what, how, cwd) in cases {
        let mut c = Command::new("bash");
        c.arg(format!("{SCRIPTS}/built-binary"))
            .arg("debug")
            .current_dir(cwd);
        cargo_env(&mut c, how);
        let out = output(c);
        assert_ok_ref(&out);
        let printed = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if how.is_some() {
            assert_eq!(
                fs::canonicalize(&printed).ok(),
                Some(me.clone()),
                "{what}: {}",
                show(&out)
            );
        } else {
            assert_eq!(
                printed,
                Path::new(REPO)
                    .join("target")
                    .join(&host)
                    .join("debug/stowage"),
                "{what}"
            );
        }
    }
}

/// Whether the release binary in `target` is at least as new as every
/// source it is built from (then `cargo build --release` has nothing to do).
fn release_is_fresh(release: &Path) -> bool {
    let Ok(built) = fs::metadata(release).and_then(|m| m.modified()) else {
        return false;
    };
    let mut sources = walkdir_files(&Path::new(REPO).join("src"));
    for f in ["Cargo.toml", "Cargo.lock", ".cargo/config.toml"] {
        sources.push(Path::new(REPO).join(f));
    }
    sources.iter().all(|s| {
        fs::metadata(s)
            .and_then(|m| m.modified())
            .is_ok_and(|m| m <= built)
    })
}

/// scripts/install and scripts/smoke (which build, then ask
/// scripts/built-binary) work with CARGO_TARGET_DIR absolute, relative or
/// unset. They run `cargo build --release`: where the release binary is
/// missing or older than the sources (a build of minutes), the test skips,
/// saying so; CI builds it before the tests.
#[test]
fn install_and_smoke_work_however_the_target_dir_is_given() {
    let (target, host) = target_and_host();
    let release = target.join(&host).join("release/stowage");
    if !release_is_fresh(&release) {
        eprintln!(
            "skipping: {} is missing or older than the sources; `cargo build --release` first",
            release.display()
        );
        return;
    }
    let env = Env::new();
    // These scripts run Cargo from the repository's top, so a relative
    // CARGO_TARGET_DIR is relative to it.
    let mut cases: Vec<(&str, Option<(&str, &Path)>, &Path)> = vec![(
        "absolute",
        Some(("CARGO_TARGET_DIR", &target)),
        Path::new("/"),
    )];
    match target.strip_prefix(REPO) {
        Ok(rel) => {
            cases.push(("relative", Some(("CARGO_TARGET_DIR", rel)), Path::new(REPO)));
            if rel == Path::new("target") {
                cases.push(("unset", None, Path::new("/")));
            }
        }
        Err(_) => eprintln!(
            "not run relative or unset: this build's target directory is outside the repository"
        ),
    }
    for (what, how, cwd) in cases {
        let dest = env.tmp.path().join(what).join("bin");
        let mut c = Command::new("bash");
        c.arg(format!("{SCRIPTS}/install"))
            .arg(&dest)
            .current_dir(cwd);
        cargo_env(&mut c, how);
        let out = output(c);
        assert_ok_ref(&out);
        let mut v = Command::new(dest.join("stowage"));
        v.arg("--version");
        assert_ok(output(v));
        assert!(
            env.tmp
                .path()
                .join(what)
                .join("share/man/man1/stowage.1")
                .exists(),
            "{what}"
        );

        let mut c = Command::new("bash");
        c.arg(format!("{SCRIPTS}/smoke")).current_dir(cwd);
        cargo_env(&mut c, how);
        let out = output(c);
        assert_ok_ref(&out);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(&release.display().to_string()),
            "{what}: {}",
            show(&out)
        );
    }
}
