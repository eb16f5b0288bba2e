//! Every `stowage …` example in README.md and docs/*.md runs as written.
//!
//! Documentation drifts: a flag renamed, a subcommand that never had the
//! option shown beside it. This test extracts each command line that starts
//! with `stowage` from the `sh`/`bash` code blocks (continuation lines
//! joined, trailing comments and `&` dropped) and runs it with `sh -c`, word
//! for word, in a fresh store of its own. What the example assumes is made
//! first: the images it reads (`--read`, `--from`, `rm`'s arguments) exist
//! and are ready, the slot class it names is configured, and the builders it
//! calls (`./build`, `ch-image`, `skopeo`, …) are stand-ins that succeed.
//! Stowage itself is never a stand-in. An example must exit 0; those that
//! cannot run unattended (`--watch`, placeholders such as `BASE…`) are
//! skipped by a rule stated below.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

const DOCS: &str = env!("CARGO_MANIFEST_DIR");

/// A command line from the docs, and where it stands.
struct Example {
    file: String,
    line: usize,
    text: String,
}

fn examples() -> Vec<Example> {
    let mut files = vec![PathBuf::from(DOCS).join("README.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(Path::new(DOCS).join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut found = Vec::new();
    for file in files {
        let text = fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(DOCS).unwrap().display().to_string();
        let mut in_shell = false;
        let mut pending: Option<(usize, String)> = None;
        for (i, raw) in text.lines().enumerate() {
            let trimmed = raw.trim_start();
            if let Some(lang) = trimmed.strip_prefix("```") {
                in_shell = !in_shell && matches!(lang.trim(), "sh" | "bash" | "shell" | "console");
                pending = None;
                continue;
            }
            if !in_shell {
                continue;
            }
            let line = trimmed.strip_prefix("$ ").unwrap_or(trimmed);
            let (start, joined) = match pending.take() {
                Some((start, so_far)) => (start, format!("{so_far} {line}")),
                None => (i + 1, line.to_owned()),
            };
            if let Some(cont) = joined.strip_suffix('\\') {
                pending = Some((start, cont.trim_end().to_owned()));
                continue;
            }
            let command = strip_comment(&joined);
            let command = command.trim().trim_end_matches('&').trim();
            if command.starts_with("stowage ") || command == "stowage" {
                found.push(Example {
                    file: name.clone(),
                    line: start,
                    text: command.to_owned(),
                });
            }
        }
    }
    found
}

/// The line without a trailing `# comment` (a `#` after a blank, outside
/// quotes).
fn strip_comment(line: &str) -> String {
    let (mut single, mut double) = (false, false);
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev.is_whitespace() => return line[..i].to_owned(),
            _ => {}
        }
        prev = c;
    }
    line.to_owned()
}

/// Why an example cannot run unattended, if it cannot.
fn unrunnable(text: &str) -> Option<&'static str> {
    if text.contains('…') || text.contains("[--") || text.contains(" BASE") {
        return Some("a synopsis with placeholders, not a command");
    }
    if text.contains("--watch") {
        return Some("--watch runs until interrupted");
    }
    None
}

/// The words after each of `flags` in `words`.
fn values_of<'a>(words: &[&'a str], flags: &[&str]) -> Vec<&'a str> {
    words
        .windows(2)
        .filter(|w| flags.contains(&w[0]))
        .map(|w| w[1].trim_matches('"'))
        .collect()
}

/// Makes what `example` assumes, in `env`, and returns the command to run.
fn prepare(env: &Env, example: &str) -> Command {
    // Words of stowage's own part (before the command's `--`).
    let words: Vec<&str> = example
        .split_whitespace()
        .take_while(|w| *w != "--")
        .collect();
    fn image_like(w: &&str) -> bool {
        !w.starts_with('-') && !w.starts_with('$') && !w.contains('"')
    }
    // A store exists (reading commands on a missing root, or a directory
    // that holds no store, say so), except for the examples that make one.
    if words.get(1) != Some(&"init") {
        env.ok(["init"]);
    }
    let mut reads = values_of(&words, &["--read", "--from", "--why"]);
    if words.get(1) == Some(&"rm") {
        reads.extend(words[2..].iter().copied().filter(image_like));
    }
    for name in reads.into_iter().filter(image_like) {
        if env.image(name).is_none() {
            env.make_image(name);
        }
    }
    let is_slots_set = words.get(1) == Some(&"slots") && words.get(2) == Some(&"set");
    for class in values_of(&words, &["--slot"]) {
        if !is_slots_set {
            env.ok(["slots", "set", class, "2", "--reserve-high", "1"]);
        }
    }
    if words.get(1) == Some(&"slots") && words.get(2) == Some(&"rm") {
        env.ok(["slots", "set", words[3], "1"]);
    }

    // Stand-ins for the builders and tools the examples call.
    let stubs = env.tmp.path().join("stubs");
    let work = env.tmp.path().join("work");
    for dir in [&stubs, &work, &work.join("src")] {
        fs::create_dir_all(dir).unwrap();
    }
    let stub = |path: PathBuf| {
        fs::write(&path, "#!/bin/sh\nexit 0\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    };
    for tool in ["ch-image", "skopeo", "podman", "docker"] {
        stub(stubs.join(tool));
    }
    for script in [
        "build",
        "pull",
        "fetch-manifest",
        "add-debug-tools",
        "build-into",
    ] {
        stub(work.join(script));
    }
    let storage = env.tmp.path().join("ch-storage");
    fs::create_dir_all(storage.join("img")).unwrap();

    let stowage_dir = Path::new(bin()).parent().unwrap();
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(example)
        .arg("sh")
        .arg("alpine:3.17") // $1 of the wrapper-script examples
        .current_dir(&work)
        .env(
            "PATH",
            format!(
                "{}:{}:{}",
                stubs.display(),
                stowage_dir.display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .env("STOWAGE_ROOT", &env.root)
        .env("CH_IMAGE_STORAGE", &storage)
        .env_remove("STOWAGE_NOW")
        .stdin(std::process::Stdio::null());
    c
}

/// A `$STOWAGE_…` variable of the command's, after the `--`, that the
/// caller's shell would expand (outside single quotes) before stowage sets it.
fn expanded_too_early(example: &str) -> Option<String> {
    let (_, command) = example.split_once(" -- ")?;
    let mut quoted = false;
    for (i, c) in command.char_indices() {
        match c {
            '\'' => quoted = !quoted,
            '$' if !quoted && command[i + 1..].starts_with("STOWAGE_") => {
                let name: String = command[i + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                return Some(name);
            }
            _ => {}
        }
    }
    None
}

#[test]
fn every_stowage_example_in_the_docs_runs() {
    let examples = examples();
    assert!(
        examples.len() >= 30,
        "found only {} examples: is the extraction broken?",
        examples.len()
    );
    let mut failures = Vec::new();
    let mut ran = 0;
    for ex in &examples {
        if let Some(why) = unrunnable(&ex.text) {
            eprintln!("skipping {}:{} ({why}): {}", ex.file, ex.line, ex.text);
            continue;
        }
        if let Some(var) = expanded_too_early(&ex.text) {
            failures.push(format!(
                "{}:{}: {}\n    ${var} is set for the command, yet the caller's shell expands it (quote it in sh -c '…')",
                ex.file, ex.line, ex.text
            ));
        }
        let env = Env::new();
        let out = output(prepare(&env, &ex.text));
        ran += 1;
        if out.status.code() != Some(0) {
            failures.push(format!(
                "{}:{}: {}\n    exit {:?}: {}",
                ex.file,
                ex.line,
                ex.text,
                out.status.code(),
                stderr(&out).trim()
            ));
        }
    }
    eprintln!("ran {ran} of {} examples", examples.len());
    assert!(
        failures.is_empty(),
        "{} examples fail:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn the_extraction_finds_continued_and_commented_lines() {
    assert_eq!(strip_comment("stowage gc   # all of it"), "stowage gc   ");
    assert_eq!(
        strip_comment("stowage exec -- sh -c 'echo # not a comment'"),
        "stowage exec -- sh -c 'echo # not a comment'"
    );
    let found = examples();
    assert!(found.iter().any(|e| e.text.starts_with("stowage exec")));
    assert!(found.iter().all(|e| !e.text.ends_with('\\')));
}

/// README's quick start is two commands (build and run a real exec; run
/// the suite), and the text after them says how to get `stowage` onto
/// `PATH`, which `cargo run` does not do: the way it gives finds the
/// binary Cargo built.
#[test]
fn the_quick_start_is_two_commands_then_how_to_get_stowage() {
    let readme = fs::read_to_string(Path::new(DOCS).join("README.md")).unwrap();
    let start = readme.find("## Quick start").expect("a quick start");
    let section = &readme[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let block = section.split("```").nth(1).expect("a code block");
    let commands: Vec<&str> = block
        .lines()
        .skip(1)
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert_eq!(commands.len(), 2, "{commands:?}");
    assert!(
        commands[0].starts_with("cargo run --release -- exec "),
        "{commands:?}"
    );
    assert_eq!(commands[1], "cargo test");
    let after = section.split("```").nth(2).unwrap();
    for way in [
        "cargo install --locked --path .",
        "scripts/built-binary",
        "PATH",
    ] {
        assert!(after.contains(way), "the quick start says {way:?}");
    }
    // The advice finds the binary these tests run (unless overridden).
    if std::env::var_os("STOWAGE_TEST_BIN").is_none() {
        let profile = if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        };
        let out = output({
            let mut c = Command::new("bash");
            c.arg(Path::new(DOCS).join("scripts/built-binary"))
                .arg(profile);
            c
        });
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), bin());
    }
}

/// Every shell line of the docs that is not a `stowage` command (those
/// run above), with what runs it: a test of this suite (`module::name`),
/// `scripts/smoke`, or `.ci/run` — which run the line itself — or a test
/// that runs the same steps with the same tools on a store of its own.
/// Only the benchmarks are run by hand: minutes long, and what they
/// measure is reported in docs/performance.md, not checked.
const OTHER_EXAMPLES: &[(&str, &str)] = &[
    ("cargo run --release -- exec ", "scripts/smoke"),
    ("cargo test", ".ci/run"),
    (
        "scripts/load-image podman app.tar",
        "runtimes::podman_loads_never_exceed_the_runtime_limit_and_all_arrive",
    ),
    (
        "scripts/load-image docker app.tar",
        "runtimes::urgent_metadata_read_passes_a_saturated_load_class",
    ),
    (
        "scripts/ch-build -t app ./app-context",
        "charliecloud::parallel_builds_from_one_base_share_it",
    ),
    (
        "scripts/ch-delete app",
        "charliecloud::ch_delete_locks_and_forgets_the_stage_images",
    ),
    (
        "flock -s /var/tmp/$USER.stowage/locks/images/alpine+3.17.lock",
        "docs::the_readme_flock_example_shares_the_image_lock",
    ),
    ("scripts/install", "scripts/smoke"),
    ("cargo install --locked --path .", "scripts/smoke"),
    (
        "export PATH=/usr/bin:$PATH USER=",
        "charliecloud::parallel_builds_from_one_base_share_it",
    ),
    (
        "export CH_IMAGE_STORAGE=",
        "charliecloud::parallel_builds_from_one_base_share_it",
    ),
    (
        "export STOWAGE_ROOT=$CH_IMAGE_STORAGE.stowage",
        "wrapper_calls::a_new_user_following_the_docs_is_led_to_a_root_that_works",
    ),
    (
        "ch-image import base.tar.gz base",
        "charliecloud::parallel_builds_from_one_base_share_it",
    ),
    (
        "ch-image pull scratch",
        "charliecloud::an_import_by_build_runs_beside_builds",
    ),
    (
        "scripts/ch-build -t mid mid-ctx &",
        "charliecloud::a_dependency_chain_launched_at_once_builds",
    ),
    (
        "scripts/ch-build --wait 10m -t app app-ctx &",
        "charliecloud::a_dependency_chain_launched_at_once_builds",
    ),
    (
        "wait",
        "charliecloud::a_dependency_chain_launched_at_once_builds",
    ),
    (
        "mkdir -p ctx/rootfs && tar -C ctx/rootfs -xf base.tar.gz",
        "charliecloud::an_import_by_build_runs_beside_builds",
    ),
    (
        "printf 'FROM scratch\\nCOPY rootfs/ /\\n' > ctx/Dockerfile",
        "charliecloud::an_import_by_build_runs_beside_builds",
    ),
    ("bash scripts/bench", "by hand"),
    (
        "bash scripts/roundtrips",
        "round_trips::execs_cost_no_more_round_trips_than_the_contract_allows",
    ),
    (
        "exec stowage exec --no-inherit --slot ch-cache --write \"$1\"",
        "docs::every_stowage_example_in_the_docs_runs",
    ),
    (
        "export STOWAGE_ROOT=/dev/shm/$USER.stowage",
        "docs::every_stowage_example_in_the_docs_runs",
    ),
];

/// The shell lines of the docs that do not start with `stowage`.
fn other_examples() -> Vec<Example> {
    let mut files = vec![PathBuf::from(DOCS).join("README.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(Path::new(DOCS).join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut found = Vec::new();
    for file in files {
        let text = fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(DOCS).unwrap().display().to_string();
        let mut in_shell = false;
        for (i, raw) in text.lines().enumerate() {
            let t = raw.trim();
            if let Some(lang) = t.strip_prefix("```") {
                in_shell = !in_shell && matches!(lang.trim(), "sh" | "bash" | "shell" | "console");
                continue;
            }
            let line = strip_comment(t.strip_prefix("$ ").unwrap_or(t));
            let line = line.trim();
            if in_shell
                && !line.is_empty()
                && !line.starts_with("stowage")
                && !raw.starts_with("    ")
            {
                found.push(Example {
                    file: name.clone(),
                    line: i + 1,
                    text: line.to_owned(),
                });
            }
        }
    }
    found
}

/// Each of those lines is run somewhere, and what runs it exists.
#[test]
fn every_other_example_in_the_docs_is_run_somewhere() {
    let tests: String = fs::read_dir(Path::new(DOCS).join("tests/it"))
        .unwrap()
        .map(|e| fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    let smoke = fs::read_to_string(Path::new(DOCS).join("scripts/smoke")).unwrap();
    let ci = fs::read_to_string(Path::new(DOCS).join(".ci/run")).unwrap();
    let mut unrun = Vec::new();
    for ex in other_examples() {
        let Some((pattern, by)) = OTHER_EXAMPLES.iter().find(|(p, _)| ex.text.starts_with(p))
        else {
            unrun.push(format!(
                "{}:{}: {} (run by nothing)",
                ex.file, ex.line, ex.text
            ));
            continue;
        };
        let exists = match *by {
            "scripts/smoke" => smoke.contains(pattern),
            ".ci/run" => ci.contains(&ex.text),
            "by hand" => ex.text.starts_with("bash scripts/bench"),
            test => tests.contains(&format!("fn {}(", test.rsplit("::").next().unwrap())),
        };
        if !exists {
            unrun.push(format!(
                "{}:{}: {} ({by} does not run it)",
                ex.file, ex.line, ex.text
            ));
        }
    }
    assert!(
        unrun.is_empty(),
        "examples nothing runs:\n{}",
        unrun.join("\n")
    );
}

/// README's flock(1) example, as written: the default root of a user of
/// its own (so `/var/tmp/$USER.stowage` is this test's store), whose image
/// `alpine:3.17` it reads under the image's shared lock.
#[test]
fn the_readme_flock_example_shares_the_image_lock() {
    if !have("flock") {
        eprintln!("skipping: flock(1) not found");
        return;
    }
    let readme = fs::read_to_string(Path::new(DOCS).join("README.md")).unwrap();
    let line = readme
        .lines()
        .find(|l| l.starts_with("flock -s /var/tmp/$USER.stowage/"))
        .expect("README's flock example");
    let user = format!("stowage-docs-{}", std::process::id());
    let root = PathBuf::from(format!("/var/tmp/{user}.stowage"));
    let env = Env::new();
    let stowage = |args: &[&str]| {
        let mut c = Command::new(bin());
        c.args(args).env("USER", &user).env_remove("STOWAGE_ROOT");
        output(c)
    };
    let out = stowage(&["exec", "--write", "alpine:3.17", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    // The example reads under the image's shared lock, then lets it go.
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(format!(
            "{line} >/dev/null; touch '{}'",
            env.sentinel("read").display()
        ))
        .env("USER", &user);
    let out = output(c);
    let after = stowage(&["exec", "--write", "alpine:3.17", "--no-wait", "--", "true"]);
    let _ = fs::remove_dir_all(&root);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert!(env.sentinel("read").exists());
    assert_eq!(
        code(&after),
        Some(0),
        "the lock is free again: {}",
        show(&after)
    );
}

/// README's flock(1) recipe names the lock file of a long name too: an ENC
/// of 251 bytes or more gets its first 200 bytes, `~` and 16 hex digits of
/// its FNV-1a hash. Built by that rule, the path is the image's lock.
#[test]
fn the_readme_says_how_a_long_names_lock_file_is_named() {
    let readme = fs::read_to_string(Path::new(DOCS).join("README.md")).unwrap();
    let rule = "ENC's first 200 bytes,\n# '~', and the 16 hex digits of ENC's 64-bit FNV-1a hash";
    assert!(
        readme.contains(rule),
        "README's flock recipe says how a long name's lock file is named"
    );
    let env = Env::new();
    let name = format!("team/{}:v1", "a".repeat(246));
    let enc = name.replace('/', "%").replace(':', "+");
    assert!(enc.len() >= 251);
    env.ok(["exec", "--write", &name, "--", "true"]);
    let hash = (enc.bytes()).fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let file = env.lock_file(&format!("{}~{hash:016x}", &enc[..200]));
    assert!(
        file.exists(),
        "{}: {:?}",
        file.display(),
        tree(&env.root.join("locks/images"))
    );
}

/// README's headline example reads its base under a shared lock, which is
/// sound only for a base ch-image only reads (pulled: linked to its build
/// cache). The text beside it says so, and sends builds from a base built
/// or imported with `--no-cache`, whose `ch/metadata.json` every `FROM`
/// rewrites, to `scripts/ch-build`: run 24 times at once from such a base,
/// the example failed 8 times.
#[test]
fn the_readme_headline_example_says_which_bases_it_suits() {
    let readme = fs::read_to_string(Path::new(DOCS).join("README.md")).unwrap();
    let at = readme
        .find("--write app -- ch-image --no-lock --no-cache build")
        .expect("README's headline example");
    let after = &readme[at..];
    // The paragraph right after the example's code block.
    let beside = after
        .split("```")
        .nth(1)
        .and_then(|rest| rest.trim_start().split("\n\n").next())
        .unwrap_or_default();
    for says in ["pulled", "--no-cache", "metadata.json", "scripts/ch-build"] {
        assert!(beside.contains(says), "{says}: {beside}");
    }
}

/// Every example that runs ch-image itself as the command gives
/// `--no-inherit`: ch-image starts its `RUN` steps with the inherited
/// descriptors closed, so with inherited locks a build killed alone let go
/// of them while its `RUN` step still wrote the image. README's headline
/// example and `exec --help`'s did not.
#[test]
fn every_example_running_ch_image_keeps_its_locks_with_no_inherit() {
    let help = stdout(&Env::new().ok(["exec", "--help"]));
    let mut texts: Vec<(String, String)> = examples()
        .into_iter()
        .map(|e| (format!("{}:{}", e.file, e.line), e.text))
        .collect();
    let joined = help.replace("\\\n", " ");
    let lines = joined
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("stowage exec"));
    texts.extend(lines.map(|l| ("exec --help".to_owned(), l.to_owned())));
    let mut checked = 0;
    for (at, text) in texts {
        let words: Vec<&str> = text.split_whitespace().collect();
        let Some(dash) = words.iter().position(|w| *w == "--") else {
            continue;
        };
        if words[0] == "stowage"
            && words.get(1) == Some(&"exec")
            && words.get(dash + 1) == Some(&"ch-image")
        {
            checked += 1;
            assert!(words[..dash].contains(&"--no-inherit"), "{at}: {text}");
        }
    }
    assert!(checked >= 3, "{checked}");
}

/// Every flock(1) example in the docs and the manual page opens its lock
/// file without truncating it: a lock file holds an image's record or a
/// slot class's limits, and a shell's `>` (flock(1)'s own man page idiom,
/// `( flock 9 …) 9>FILE`) empties it even when the lock is not had. Looked
/// at: the lines of code blocks and the inline code spans that name flock.
#[test]
fn every_flock_example_opens_its_lock_file_without_truncating() {
    let mut files = vec![PathBuf::from(DOCS).join("README.md")];
    for e in fs::read_dir(Path::new(DOCS).join("docs")).unwrap() {
        files.push(e.unwrap().path());
    }
    let mut truncating = Vec::new();
    let mut seen = 0;
    for file in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "md"))
    {
        let text = fs::read_to_string(file).unwrap();
        let mut in_code = false;
        for (i, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                in_code = !in_code;
                continue;
            }
            // A comment in a code block says, it runs nothing.
            let spans: Vec<&str> = if in_code {
                vec![line.split(" #").next().unwrap_or(line)]
                    .into_iter()
                    .filter(|l| !l.trim_start().starts_with('#'))
                    .collect()
            } else {
                line.split('`').skip(1).step_by(2).collect()
            };
            for span in spans.into_iter().filter(|s| s.contains("flock")) {
                seen += 1;
                if truncates(span) {
                    truncating.push(format!("{}:{}: {span}", file.display(), i + 1));
                }
            }
        }
    }
    assert!(seen > 0, "no flock example found");
    assert!(truncates(
        "( flock -n 9 || exit 1; make ) 9>ROOT/locks/slots/pull/0.lock"
    ));
    assert!(!truncates(
        "exec 9<>ROOT/locks/slots/pull/0.lock; flock 9 2>/dev/null"
    ));
    assert!(
        truncating.is_empty(),
        "flock examples that open a file with '>':\n{}",
        truncating.join("\n")
    );
}

/// Whether a shell line opens a file for writing with `>` (not `<>`, `>>`
/// is not one either; `>/dev/null` and `>&N` open no lock file).
fn truncates(line: &str) -> bool {
    line.match_indices('>').any(|(i, _)| {
        let rest = line[i + 1..].trim_start();
        !line[..i].ends_with(['<', '>', '-', '='])
            && !rest.starts_with(['>', '&'])
            && !rest.starts_with("/dev/null")
            && !rest.is_empty()
    })
}
