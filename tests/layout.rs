//! The source layout keeps its promises (docs/design.md, "Source layout"):
//! no import circle between the modules of `src/`, no module above its floor, and the map at the top
//! of `lib.rs` names every module. Read from the source text: each module's
//! `crate::NAME` references, outside comments and its unit tests.

// Tests and benchmarks print where they like; the binary may not (clippy.toml).
#![allow(clippy::disallowed_macros)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module name → the top-level modules it refers to.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let top = |p: &Path| -> String {
        let rel = p.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        first.trim_end_matches(".rs").to_owned()
    };
    let modules: BTreeSet<String> = files.iter().map(|p| top(p)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let m = top(f);
        let text = std::fs::read_to_string(f).unwrap();
        let code = match text.find("#[cfg(test)]\nmod tests") {
            Some(i) => &text[..i],
            None => &text[..],
        };
        let code: String = code
            .lines()
            .map(|l| match l.find("//") {
                Some(i) => &l[..i],
                None => l,
            })
            .collect::<Vec<_>>()
            .join("\n");
        let deps = graph.entry(m.clone()).or_default();
        let mut rest = code.as_str();
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let names: Vec<String> = if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                group[..end]
                    .split(',')
                    .filter_map(|part| {
                        let name: String = part
                            .trim()
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        (!name.is_empty()).then_some(name)
                    })
                    .collect()
            } else {
                vec![
                    rest.chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect(),
                ]
            };
            for n in names {
                if n != m && modules.contains(&n) {
                    deps.insert(n);
                }
            }
        }
    }
    graph
}

/// The strongly connected components with more than one module.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    // Two modules are in one circle when each reaches the other.
    let reach = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_owned()];
        while let Some(m) = todo.pop() {
            for d in graph.get(&m).into_iter().flatten() {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> =
        graph.keys().map(|m| (m, reach(m))).collect();
    let mut out: Vec<Vec<String>> = Vec::new();
    let mut placed = BTreeSet::new();
    for m in graph.keys() {
        if placed.contains(m) {
            continue;
        }
        let circle: Vec<String> = graph
            .keys()
            .filter(|o| *o == m || (reaches[m].contains(*o) && reaches[*o].contains(m)))
            .cloned()
            .collect();
        if circle.len() > 1 {
            placed.extend(circle.iter().cloned());
            out.push(circle);
        }
    }
    out
}

#[test]
fn no_module_imports_in_a_circle() {
    let graph = imports();
    assert!(graph.contains_key("session") && graph["session"].contains("store"));
    let found = cycles(&graph);
    assert!(found.is_empty(), "import circles: {found:?}");
}

#[test]
fn the_cycle_finder_finds_a_circle() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    g.entry("c".into()).or_default().insert("a".into());
    g.entry("d".into()).or_default().insert("a".into());
    assert_eq!(cycles(&g), [["a", "b", "c"]]);
}

#[test]
fn the_map_in_lib_rs_names_every_module() {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let doc: String = lib
        .lines()
        .filter(|l| l.starts_with("//!"))
        .collect::<Vec<_>>()
        .join("\n");
    for line in lib.lines().filter_map(|l| l.strip_prefix("pub mod ")) {
        let m = line.trim_end_matches(';');
        assert!(
            doc.contains(&format!("[`{m}`]")),
            "lib.rs's map does not name module {m}"
        );
    }
}

/// Each module's floor in lib.rs's map: a numbered item names the modules of its floor, until the
/// next item or a blank line.
fn floors() -> BTreeMap<String, u32> {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let mut floors = BTreeMap::new();
    let mut floor = None;
    for line in lib.lines().filter_map(|l| l.strip_prefix("//!")) {
        let line = line.trim();
        match line.split_once(". **") {
            Some((n, _)) if n.parse::<u32>().is_ok() => floor = n.parse().ok(),
            _ if line.is_empty() => floor = None,
            _ => {}
        }
        let Some(f) = floor else { continue };
        for part in line.split("[`").skip(1) {
            let name = part.split('`').next().unwrap();
            floors.entry(name.to_owned()).or_insert(f);
        }
    }
    floors
}

#[test]
fn every_module_uses_only_its_floor_or_below() {
    let floors = floors();
    assert_eq!(floors.get("lock"), Some(&2), "{floors:?}");
    let mut up = Vec::new();
    for (m, deps) in imports() {
        let Some(own) = floors.get(&m) else {
            assert!(["lib", "main"].contains(&m.as_str()), "{m} has no floor");
            continue;
        };
        for d in deps {
            if floors.get(&d).is_some_and(|f| f > own) {
                up.push(format!("{m} ({own}) uses {d} ({})", floors[&d]));
            }
        }
    }
    assert!(
        up.is_empty(),
        "modules that reach above their floor: {up:#?}"
    );
}

/// Functions the standard library declares weak (it calls them only where
/// the C library has them). In the static release build, whose link-time
/// optimisation merges declarations, a weak one can win over ours: a direct
/// `libc::NAME(...)` call then jumps to address 0 (`rm` and `gc` crashed so
/// through `statx`). Such calls go through `libc::syscall` instead. The
/// list is what `nm` shows weak and undefined in that binary (Rust 1.95,
/// glibc 2.36); scripts/smoke runs every command on that binary in CI.
const WEAK_IN_STD: &[&str] = &[
    "statx",
    "copy_file_range",
    "gettid",
    "pidfd_getpid",
    "pidfd_spawnp",
    "posix_spawn_file_actions_addchdir",
    "posix_spawn_file_actions_addchdir_np",
];

#[test]
fn no_direct_call_of_a_function_the_standard_library_declares_weak() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut stack = vec![src];
    let mut found = Vec::new();
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                for name in WEAK_IN_STD {
                    if code.contains(&format!("libc::{name}(")) {
                        found.push(format!("{}:{}: libc::{name}(", p.display(), n + 1));
                    }
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "call these through libc::syscall(libc::SYS_...): {found:#?}"
    );
}

/// The string literals of a source text (ordinary and raw), with their
/// line numbers; comments and character literals skipped.
fn string_literals(text: &str) -> Vec<(usize, String)> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            i = text[i..].find('\n').map_or(b.len(), |j| i + j);
        } else if b[i] == b'\'' {
            // A char literal ('"', '\'', 'x'), else a lifetime.
            let close = if b.get(i + 1) == Some(&b'\\') {
                i + 3
            } else {
                i + 2
            };
            i = if b.get(close) == Some(&b'\'') {
                close + 1
            } else {
                i + 1
            };
        } else if b[i] == b'r'
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
            && matches!(b.get(i + 1), Some(b'"' | b'#'))
        {
            let hashes = b[i + 1..].iter().take_while(|c| **c == b'#').count();
            let start = i + 2 + hashes;
            let end = format!("\"{}", "#".repeat(hashes));
            let stop = text[start..].find(&end).map_or(b.len(), |j| start + j);
            out.push((text[..i].lines().count(), text[start..stop].to_owned()));
            i = stop + end.len();
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            out.push((text[..i].lines().count(), text[i + 1..j].to_owned()));
            i = j + 1;
        } else {
            i += 1;
        }
    }
    out
}

/// Every message fits on about one line: no format string the code prints
/// is longer than 150 characters (paths and names come on top). What more
/// there is to say goes to `doctor` (whose report is the long form, and is
/// not counted here) or `-v`. SQL, help text and manual pages are no
/// messages.
#[test]
fn messages_fit_on_a_line() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut stack = vec![src.clone()];
    let mut long = Vec::new();
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let rel = p.strip_prefix(&src).unwrap().display().to_string();
            if !rel.ends_with(".rs") || rel.starts_with("doctor/") || rel == "cli/shell.rs" {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            let code = match text.find("#[cfg(test)]\nmod tests") {
                Some(i) => &text[..i],
                None => &text[..],
            };
            for (line, lit) in string_literals(code) {
                let joined: String = lit.split("\\\n").map(str::trim_start).collect();
                let sql = ["SELECT ", "INSERT ", "CREATE ", "DROP ", "BEGIN"]
                    .iter()
                    .any(|k| joined.contains(k));
                let help = joined.contains("\\n")
                    || code
                        .lines()
                        .nth(line - 1)
                        .is_some_and(|l| l.contains("help"));
                if !sql && !help && joined.chars().count() > 150 {
                    long.push(format!(
                        "src/{rel}:{line}: {} chars: {joined}",
                        joined.chars().count()
                    ));
                }
            }
        }
    }
    assert!(
        long.is_empty(),
        "messages longer than a line:\n{}",
        long.join("\n")
    );
}
