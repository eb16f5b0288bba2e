//! Every invalid-name rule: exit 64, the rule named, nothing created or
//! deleted anywhere; and the valid references, encoded like Charliecloud's.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use crate::common::*;

const BAD: &[(&str, &str)] = &[
    ("", "empty"),
    (".hidden", "may not start with '.'"),
    ("-flag", "may not start with '-'"),
    ("/abs", "may not start with '/'"),
    ("team//app", "'//'"),
    ("team/./app", "'.' path component"),
    ("team/../app", "'..' path component"),
    ("a%b", "'%'"),
    ("a+b", "'+'"),
    ("a b", "whitespace"),
    ("a\tb", "whitespace"),
    ("a\u{1}b", "control characters"),
    ("a*b", "'*'"),
    ("café", "'é'"),
];

#[test]
fn every_rule_exits_64_naming_it_and_creates_nothing() {
    let env = Env::new();
    let long = "a".repeat(256);
    let mut cases: Vec<(String, &str)> = BAD.iter().map(|(n, r)| (n.to_string(), *r)).collect();
    cases.push((long, "256 bytes"));
    for (name, rule) in &cases {
        for flag in ["--read", "--write"] {
            let out = env.run([
                "exec",
                flag,
                name,
                "--",
                "touch",
                env.sentinel("ran").to_str().unwrap(),
            ]);
            assert_eq!(
                out.status.code(),
                Some(64),
                "{flag} {name:?}: {}",
                show(&out)
            );
            let err = stderr(&out);
            assert!(
                err.contains(rule),
                "{flag} {name:?}: message must name the rule ({rule}): {err}"
            );
            assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        }
        let out = env.run(["lock-status", name.as_str()]);
        assert_eq!(
            out.status.code(),
            Some(64),
            "lock-status {name:?}: {}",
            show(&out)
        );
    }
    assert!(!env.sentinel("ran").exists(), "the command must not run");
    assert!(
        !env.root.exists(),
        "an invalid name must not even create the root"
    );
}

#[test]
fn non_utf8_name_exits_64() {
    let env = Env::new();
    let mut c = env.cmd(["exec", "--write"]);
    c.arg(OsStr::from_bytes(b"bad\xffname"))
        .args(["--", "true"]);
    let out = output(c);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(stderr(&out).contains("UTF-8"));
    assert!(!env.root.exists());
}

#[test]
fn a_trailing_slash_is_an_invalid_name() {
    let env = Env::new();
    let out = env.run(["exec", "--write", "q/", "--", "true"]);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(
        stderr(&out).contains("may not end with '/'"),
        "{}",
        show(&out)
    );
    assert!(!env.root.join("img").exists(), "nothing created");
}

#[test]
fn invalid_name_in_an_existing_store_changes_nothing() {
    let env = Env::new();
    env.make_image("base");
    let before = tree(&env.root);
    let out = env.run(["exec", "--read", "base", "--write", "x//y", "--", "true"]);
    assert_eq!(out.status.code(), Some(64));
    assert_eq!(tree(&env.root), before);
}

#[test]
fn valid_references_are_accepted_and_encoded_like_charliecloud() {
    let env = Env::new();
    env.make_image("registry.example:5000/team/app:v1");
    env.make_image("app@sha256:0123abcd");
    assert!(
        env.root
            .join("img/registry.example+5000%team%app+v1/file")
            .exists()
    );
    assert!(env.root.join("img/app@sha256+0123abcd").is_dir());
    assert_eq!(
        env.state("registry.example:5000/team/app:v1").as_deref(),
        Some("ready")
    );
}

#[test]
fn the_longest_name_works() {
    let env = Env::new();
    let name = "a".repeat(255);
    env.make_image(&name);
    assert_eq!(env.state(&name).as_deref(), Some("ready"));
    env.ok(["exec", "--read", &name, "--", "true"]);
}

/// Two long names cut to fit a lock file's name hash alike (FNV-1a; such
/// pairs are found in minutes): the first keeps the lock file and its
/// record, the second is refused as a name, whatever is asked of it, and
/// the first stays ready and readable.
#[test]
fn a_name_whose_cut_lock_file_is_another_images_is_refused() {
    let env = Env::new();
    let (first, second) = ("a".repeat(235), "a".repeat(235));
    let (first, second) = (first + "cd82abed273c49b5", second + "234f0bb426e2641c");
    let lock_file = stowage::root::lock_file_name;
    assert_eq!(lock_file(&first), lock_file(&second), "a collision");
    env.make_image(&first);
    for args in [
        &["exec", "--write", &second, "--", "true"][..],
        &["exec", "--read", &second, "--", "true"],
        &["exec", "--write", &second, "--from", &first, "--", "true"],
        &["rm", &second],
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(64), "{}", show(&out));
        let err = stderr(&out);
        assert!(err.contains(&first) && err.lines().count() == 1, "{err}");
    }
    // Refused at once while the first is in use, never waited for (nor
    // 75): from outside, and from a command the first's writer runs.
    let holder = env.hold(&["--write", &first], "started");
    for args in [
        &["exec", "--write", &second, "--", "true"][..],
        &["exec", "--write", &second, "--no-wait", "--", "true"],
        &["exec", "--read", &second, "--wait", "1", "--", "true"],
        &["rm", &second],
    ] {
        let out = env.run(args);
        assert_eq!(code(&out), Some(64), "{}", show(&out));
    }
    env.release("release");
    holder.finish();
    for (outer, inner) in [("--read", "--write"), ("--write", "--read")] {
        let code_file = env.sentinel("inner");
        let script = format!(
            "'{}' --root '{}' exec {inner} {second} -- true; echo $? > '{}'",
            bin(),
            env.root.display(),
            code_file.display()
        );
        env.ok(["exec", outer, &first, "--", "sh", "-c", &script]);
        assert_eq!(
            std::fs::read_to_string(&code_file).unwrap(),
            "64\n",
            "{outer} {inner}"
        );
    }
    assert_eq!(env.state(&first).as_deref(), Some("ready"));
    assert_eq!(env.read_in_image(&first, "file"), "content\n");
    assert!(!env.root.join("img").join(&second).exists());
}
