//! The conventions of a Unix tool: manual pages that render cleanly, and
//! completion scripts that load in bash, zsh and fish and complete
//! subcommands, image names and slot classes from the store.
//!
//! Each shell test loads the script that `stowage completions SHELL` prints
//! into the real shell and runs it the way the shell would at a TAB: bash's
//! completion function with COMP_WORDS set, zsh's with `words`/`CURRENT`
//! (and `_describe` standing in for the completion system's printer), fish's
//! own `complete -C`. Tests skip, saying why, when a shell or groff is
//! missing.

use std::fs;
use std::process::{Command, Stdio};

use crate::common::*;

/// A store with a ready image, an incomplete one and a slot class; PATH
/// leads to this build's stowage, as an installed script expects.
fn store() -> Env {
    let env = Env::new();
    env.make_image("alpine:3.17");
    env.make_image("app");
    let out = env.run(["exec", "--write", "broken", "--", "false"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    env.ok(["slots", "set", "load/podman", "2"]);
    env
}

fn path_with_stowage() -> String {
    let dir = std::path::Path::new(bin())
        .parent()
        .unwrap()
        .display()
        .to_string();
    format!("{dir}:{}", std::env::var("PATH").unwrap_or_default())
}

/// Runs `script` in `shell` with the completion script loaded; returns
/// the lines it prints.
fn in_shell(shell: &str, env: &Env, script: &str) -> Vec<String> {
    let mut c = Command::new(shell);
    c.arg("-c")
        .arg(script)
        .env("PATH", path_with_stowage())
        .env("STOWAGE_ROOT", &env.root)
        .stdin(Stdio::null());
    let out = output(c);
    assert!(out.status.success(), "{shell}: {}", show(&out));
    // Flags are offered beside values when the word is empty; these tests
    // are about the values.
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        // fish prints "value<TAB>description"; zsh's printer "value:description",
        // with a colon inside the value escaped.
        .map(|l| {
            let l = l.split('\t').next().unwrap();
            if shell != "zsh" {
                return l.to_owned();
            }
            let l = l.replace("\\:", "\u{0}");
            l.split(':').next().unwrap().replace('\u{0}', ":")
        })
        .filter(|l| !l.is_empty() && !l.starts_with('-'))
        .collect();
    lines.sort();
    lines
}

fn bash_complete(env: &Env, words: &[&str]) -> Vec<String> {
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let script = format!(
        "source <(stowage completions bash) || exit 1
         COMP_WORDS=({words}); COMP_CWORD={cword}; COMP_TYPE=9
         COMP_LINE=\"${{COMP_WORDS[*]}}\"; COMP_POINT=${{#COMP_LINE}}
         _clap_complete_stowage stowage '{cur}' '{prev}'
         printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        words = quoted.join(" "),
        cword = words.len() - 1,
        cur = words[words.len() - 1],
        prev = words[words.len().saturating_sub(2)],
    );
    in_shell("bash", env, &script)
}

#[test]
fn bash_completes_subcommands_images_and_classes() {
    if !tool_or_skip("bash", "bash") {
        return;
    }
    let env = store();
    assert_eq!(bash_complete(&env, &["stowage", "lock-"]), ["lock-status"]);
    // --read offers what can be read: ready images only.
    assert_eq!(
        bash_complete(&env, &["stowage", "exec", "--read", ""]),
        ["alpine:3.17", "app"]
    );
    assert_eq!(
        bash_complete(&env, &["stowage", "rm", ""]),
        ["alpine:3.17", "app", "broken"]
    );
    assert_eq!(
        bash_complete(&env, &["stowage", "exec", "--slot", ""]),
        ["load/podman"]
    );
}

#[test]
fn completion_follows_root_and_creates_nothing() {
    if !tool_or_skip("bash", "bash") {
        return;
    }
    let env = store();
    let elsewhere = env.tmp.path().join("no-store");
    let root = elsewhere.display().to_string();
    let offered = bash_complete(&env, &["stowage", "--root", &root, "exec", "--read", ""]);
    assert!(offered.is_empty(), "{offered:?}");
    assert!(!elsewhere.exists(), "completion created a root");
    // The --root on the line wins over $STOWAGE_ROOT.
    let root = env.root.display().to_string();
    let offered = bash_complete(&env, &["stowage", "--root", &root, "rm", "a"]);
    assert_eq!(offered, ["alpine:3.17", "app"]);
}

#[test]
fn zsh_completes_subcommands_and_images() {
    if !tool_or_skip("zsh", "zsh") {
        return;
    }
    let env = store();
    let complete = |words: &[&str]| {
        let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
        // Outside the completion system `words` and `CURRENT` are plain
        // variables, and `_describe` is replaced by a printer.
        let script = format!(
            "compdef() {{ :; }}
             _describe() {{ local -a arr; arr=(\"${{(@P)${{@[-1]}}}}\"); print -rl -- $arr; }}
             source <(stowage completions zsh) || exit 1
             words=({words}); CURRENT={current}
             _clap_dynamic_completer_stowage",
            words = quoted.join(" "),
            current = words.len(),
        );
        in_shell("zsh", &env, &script)
    };
    assert_eq!(complete(&["stowage", "lock-"]), ["lock-status"]);
    assert_eq!(
        complete(&["stowage", "exec", "--read", ""]),
        ["alpine:3.17", "app"]
    );
}

#[test]
fn fish_completes_subcommands_and_images() {
    if !tool_or_skip("fish", "fish") {
        return;
    }
    let env = store();
    let complete = |line: &str| {
        let script = format!("stowage completions fish | source; or exit 1; complete -C '{line}'");
        in_shell("fish", &env, &script)
    };
    assert_eq!(complete("stowage lock-"), ["lock-status"]);
    assert_eq!(complete("stowage exec --read "), ["alpine:3.17", "app"]);
    assert_eq!(complete("stowage slots rm "), ["load/podman"]);
}

#[test]
fn man_pages_render_without_warnings() {
    if !tool_or_skip("groff", "groff-base") {
        return;
    }
    let env = Env::new();
    let dir = env.tmp.path().join("man");
    let out = output({
        let mut c = Command::new(bin());
        c.arg("man").arg(&dir);
        c
    });
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let mut pages: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    pages.sort();
    for cmd in [
        "exec",
        "lock-status",
        "images",
        "rm",
        "gc",
        "slots",
        "doctor",
        "init",
    ] {
        assert!(pages.contains(&format!("stowage-{cmd}.1")), "{pages:?}");
    }
    assert!(pages.contains(&"stowage.1".to_owned()));
    for page in &pages {
        let mut c = Command::new("groff");
        c.args(["-man", "-Tutf8", "-ww"]).arg(dir.join(page));
        let out = output(c);
        assert!(out.status.success(), "{page}: {}", show(&out));
        assert_eq!(stderr(&out), "", "{page} renders with warnings");
        let source = fs::read_to_string(dir.join(page)).unwrap();
        for section in ["SYNOPSIS", "\"EXIT STATUS\"", "ENVIRONMENT", "FILES"] {
            assert!(
                source.contains(&format!(".SH {section}")),
                "{page} lacks {section}"
            );
        }
    }
    let exec = fs::read_to_string(dir.join("stowage-exec.1")).unwrap();
    assert!(exec.contains("no\\-inherit"), "exec page lacks its flags");
    assert!(!env.root.exists(), "writing man pages touched a store");
}

/// Every page another page names is written: `stowage-slots(1)` names
/// `stowage-slots-set(1)` and `stowage-slots-rm(1)`, which say what
/// `slots set` takes. The SYNOPSIS keeps value names and the `--` before
/// exec's command. Before, only top-level subcommands had pages, and the
/// SYNOPSIS read `[--read] ... <CMD>`.
#[test]
fn every_man_page_named_is_written() {
    let env = Env::new();
    let dir = env.tmp.path().join("man");
    let out = output({
        let mut c = Command::new(bin());
        c.arg("man").arg(&dir);
        c
    });
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let pages: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for page in &pages {
        let source = fs::read_to_string(dir.join(page)).unwrap();
        // A reference is "stowage\-NAME(1)".
        for before in source.split("(1)") {
            let at = before
                .rfind(|c: char| !(c.is_ascii_lowercase() || c == '\\' || c == '-'))
                .map_or(0, |i| i + 1);
            let named = before[at..].replace("\\-", "-");
            if named.starts_with("stowage") {
                let file = format!("{named}.1");
                assert!(pages.contains(&file), "{page} names {file}: {pages:?}");
            }
        }
    }
    let set = fs::read_to_string(dir.join("stowage-slots-set.1")).unwrap();
    assert!(set.contains("reserve\\-high"), "{set}");
    let exec = fs::read_to_string(dir.join("stowage-exec.1")).unwrap();
    assert!(exec.contains("[\\-\\-read IMG]"), "{exec}");
    assert!(exec.contains("\\-\\- <CMD>..."), "{exec}");
}
