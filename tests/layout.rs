//! The source layout keeps its promises (docs/design.md, "Source layout"):
//! no import circle between the modules of `src/`, and the map at the top
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
