//! The layout of agentd's source: its top-level modules import each other
//! without a cycle, so each can be read, changed and tested with only what
//! it builds on (docs/architecture.md, "agentd's modules"), and no source
//! file of agentd or agentctl runs past 800 lines.
//!
//! A module's imports are the `crate::NAME` paths in its files (comments and
//! unit tests left out), `crate::{A, B::…}` groups included.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_owned()];
    }
    let mut out = Vec::new();
    for e in std::fs::read_dir(path).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

/// The text of `file` without comments and without its unit tests.
fn code(file: &Path) -> String {
    let text = std::fs::read_to_string(file).unwrap();
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap();
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level module names `code` refers to as `crate::…`.
fn imports(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.trim()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group, up to its closing brace.
            let (mut depth, mut item) = (0, String::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(ident(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            out.insert(ident(&item));
        } else {
            out.insert(ident(rest));
        }
    }
    out
}

/// Modules that are part of an import cycle.
fn cyclic(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<String> {
    // A module is on a cycle when it can reach itself.
    graph
        .keys()
        .filter(|start| {
            let mut seen = BTreeSet::new();
            let mut todo: Vec<&String> = graph[*start].iter().collect();
            while let Some(m) = todo.pop() {
                if m == *start {
                    return true;
                }
                if seen.insert(m.clone()) {
                    todo.extend(graph.get(m).into_iter().flatten());
                }
            }
            false
        })
        .cloned()
        .collect()
}

fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        let p = e.path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        if name == "lib" || name == "main" {
            continue;
        }
        let mut files = rust_files(&p);
        if p.is_file() && src.join(&name).is_dir() {
            files.extend(rust_files(&src.join(&name)));
        }
        let entry = graph.entry(name.clone()).or_default();
        for f in files {
            entry.extend(imports(&code(&f)));
        }
        entry.remove(&name);
    }
    let names: BTreeSet<String> = graph.keys().cloned().collect();
    for deps in graph.values_mut() {
        deps.retain(|d| names.contains(d));
    }
    graph
}

#[test]
fn agentds_modules_import_each_other_without_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src);
    assert!(graph.len() > 10, "{graph:?}");
    let on_cycles = cyclic(&graph);
    assert!(
        on_cycles.is_empty(),
        "modules on an import cycle: {on_cycles:?}\nimports: {graph:#?}"
    );
}

#[test]
fn the_cycle_check_sees_cycles_and_groups() {
    let found = imports("use crate::{a::b, c, d::{e, f}};\nlet x = crate::g::h();");
    let want: BTreeSet<String> = ["a", "c", "d", "g"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    assert_eq!(found, want);
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    let want: BTreeSet<String> = ["a", "b", "c"].iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(cyclic(&graph), want);
}

#[test]
fn no_source_file_is_over_800_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut long = Vec::new();
    for dir in [root.join("src"), root.join("../agentctl/src")] {
        for f in rust_files(&dir) {
            let n = std::fs::read_to_string(&f).unwrap().lines().count();
            if n > 800 {
                long.push((f, n));
            }
        }
    }
    assert!(long.is_empty(), "split these: {long:?}");
}
