//! The workspace's structure, as DESIGN.md's "Code map" describes it, checked from its source:
//! dependencies between the core crate's modules point one way (no import cycle, counting every
//! `crate::module` path outside test modules), no two files of any crate import each other in
//! a circle, no function is longer than 80 lines, and only the clock module reads time.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use leasehold_tests::repo_root;

/// Longest function allowed, in lines from its `fn` line to its closing brace.
const MAX_FN_LINES: usize = 80;

fn src() -> PathBuf {
    repo_root().join("shared").join("src")
}

/// The source directories of the crates whose files import each other in no circle (tests/tests,
/// the integration tests themselves, stay out).
const ACYCLIC_CRATES: [&str; 5] = ["shared/src", "cli/src", "bench/src", "tests/src", "sim/src"];

/// The source directories of the crates held to `MAX_FN_LINES`: every crate's.
const BOUNDED_CRATES: [&str; 5] = ["shared/src", "sim/src", "cli/src", "bench/src", "tests/src"];

/// `p` relative to the repository (as the failure messages name files), or as it is when it is
/// outside it.
fn rel(p: &Path) -> String {
    p.strip_prefix(repo_root()).unwrap_or(p).display().to_string()
}

/// Every `.rs` file under `dir`, with its source up to its test module.
fn sources(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                // A file's unit tests (also those that need the `testing` feature) are no part of
                // its module's imports.
                let end = ["#[cfg(test)]\nmod tests", "#[cfg(all(test, feature = \"testing\"))]\nmod tests"]
                    .iter()
                    .filter_map(|m| text.find(m))
                    .min()
                    .unwrap_or(text.len());
                out.push((p, text[..end].to_string()));
            }
        }
    }
    out.sort();
    out
}

/// The top-level module a file belongs to (`protocol` for shared/src/protocol/acquire.rs).
fn module_of(path: &Path) -> String {
    let rel = path.strip_prefix(src()).unwrap();
    let first = rel.components().next().unwrap().as_os_str().to_string_lossy().to_string();
    first.trim_end_matches(".rs").to_string()
}

fn ident_at(s: &str) -> String {
    s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect()
}

/// The modules named by `crate::` paths in `text`: `crate::x::...` and `crate::{x, y::z}`.
fn crate_paths(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for part in group.split(',') {
                let name = ident_at(part.trim());
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        } else {
            out.insert(ident_at(rest));
        }
    }
    out
}

fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let files = sources(&src());
    let modules: BTreeSet<String> = files.iter().map(|(p, _)| module_of(p)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for (p, text) in &files {
        let m = module_of(p);
        for dep in crate_paths(text) {
            if dep != m && modules.contains(&dep) {
                graph.get_mut(&m).unwrap().insert(dep);
            }
        }
    }
    graph
}

/// A cycle through `start`, if there is one.
fn cycle_from(graph: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    let mut stack = vec![(start.to_string(), vec![start.to_string()])];
    let mut seen = BTreeSet::new();
    while let Some((node, path)) = stack.pop() {
        for next in &graph[&node] {
            if next == start {
                return Some([path.clone(), vec![start.to_string()]].concat());
            }
            if seen.insert(next.clone()) {
                stack.push((next.clone(), [path.clone(), vec![next.clone()]].concat()));
            }
        }
    }
    None
}

#[test]
fn no_import_cycle_among_the_core_crates_modules() {
    let graph = imports();
    assert!(graph.len() > 10 && graph["protocol"].contains("store"), "the import graph was read: {graph:?}");
    let cycles: Vec<String> = graph.keys().filter_map(|m| cycle_from(&graph, m)).map(|c| c.join(" -> ")).collect();
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn the_layers_point_one_way() {
    // Bottom, store boundary, core: none of them imports a feature or an adapter.
    let graph = imports();
    let below = ["model", "error", "validate", "clock", "backoff", "store", "protocol"];
    let above = ["batch", "queue", "keepalive", "fenced", "history", "api", "lambda", "holder", "env"];
    for low in below {
        for high in above {
            assert!(
                !graph.get(low).is_some_and(|deps| deps.contains(high)),
                "{low} imports {high}: a lower layer must not depend on a higher one"
            );
        }
    }
}

/// `(file, line, name, length)` of every function body in `text`.
fn functions(path: &Path, text: &str) -> Vec<(String, usize, String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let indent = line.len() - t.len();
        let mut head = t;
        for prefix in ["pub(crate) ", "pub(super) ", "pub ", "const ", "async ", "unsafe "] {
            head = head.strip_prefix(prefix).unwrap_or(head);
        }
        let Some(sig) = head.strip_prefix("fn ") else { continue };
        // The body opens on the signature's last line, and closes at the same indent.
        let Some(open) = (i..lines.len()).find(|&j| lines[j].trim_end().ends_with('{') || lines[j].ends_with(';'))
        else {
            continue;
        };
        if lines[open].ends_with(';') {
            continue;
        }
        let close = (open + 1..lines.len()).find(|&j| {
            lines[j].len() - lines[j].trim_start().len() == indent && lines[j].trim_start().starts_with('}')
        });
        if let Some(close) = close {
            out.push((rel(path), i + 1, ident_at(sig), close - i + 1));
        }
    }
    out
}

#[test]
fn no_function_is_longer_than_80_lines() {
    let root = repo_root();
    let mut all = Vec::new();
    for dir in BOUNDED_CRATES {
        let files = sources(&root.join(dir));
        let fns: Vec<_> = files.iter().flat_map(|(p, t)| functions(p, t)).collect();
        assert!(fns.len() > 20, "the functions of {dir} were read: {}", fns.len());
        all.extend(fns);
    }
    assert!(all.len() > 500, "the functions were read: {}", all.len());
    let long: Vec<String> = all
        .iter()
        .filter(|f| f.3 > MAX_FN_LINES)
        .map(|(file, line, name, n)| format!("{file}:{line} {name}: {n} lines"))
        .collect();
    assert!(long.is_empty(), "functions longer than {MAX_FN_LINES} lines:\n{}", long.join("\n"));
}

/// The module path a file of the crate rooted at `dir` defines: `[]` for lib.rs or main.rs,
/// `[store, dynamo]` for store/dynamo/mod.rs, `[store, table]` for store/table.rs.
fn module_path(dir: &Path, path: &Path) -> Vec<String> {
    let rel = path.strip_prefix(dir).unwrap();
    let mut parts: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().to_string()).collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !(parts.is_empty() && (stem == "lib" || stem == "main")) && stem != "mod" {
        parts.push(stem.to_string());
    }
    parts
}

/// The paths a `use`-like path starting at `rest` names, with their `{..}` groups expanded:
/// `a::{b, c::d}` gives `[a, b]` and `[a, c, d]`.
fn expand(prefix: &[String], rest: &str, out: &mut Vec<Vec<String>>) {
    let mut path = prefix.to_vec();
    let mut rest = rest;
    loop {
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut start) = (0, 0);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        expand(&path, group[start..i].trim(), out);
                        return;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(&path, group[start..i].trim(), out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            return;
        }
        let name = ident_at(rest);
        if name.is_empty() || name == "self" {
            break;
        }
        path.push(name.clone());
        match rest[name.len()..].strip_prefix("::") {
            Some(next) => rest = next.trim_start(),
            None => break,
        }
    }
    out.push(path);
}

/// The files a crate's files import: every `crate::`, `super::` and `self::` path (outside
/// test modules) resolved to the file of the longest module it names. Paths to the crate root
/// (items lib.rs or main.rs re-export) are left out, as in the module graph.
fn file_imports(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let files = sources(dir);
    let modules: BTreeMap<Vec<String>, String> = files.iter().map(|(p, _)| (module_path(dir, p), rel(p))).collect();
    let mut graph = BTreeMap::new();
    for (p, text) in &files {
        let own = module_path(dir, p);
        let file = rel(p);
        let mut deps = BTreeSet::new();
        for (i, _) in text.match_indices("::") {
            let before = &text[..i];
            let word = before.rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).next().unwrap();
            let base: Vec<String> = match word {
                "crate" => vec![],
                "self" => own.clone(),
                "super" => {
                    // A `super` after `super::` was counted with the first one.
                    if before[..before.len() - word.len()].ends_with("::") {
                        continue;
                    }
                    let mut base = own.clone();
                    let mut rest = &text[i + 2..];
                    base.pop();
                    while let Some(r) = rest.strip_prefix("super::") {
                        base.pop();
                        rest = r;
                    }
                    let mut paths = Vec::new();
                    expand(&base, rest, &mut paths);
                    add_deps(&modules, &own, &paths, &mut deps);
                    continue;
                }
                _ => continue,
            };
            if before[..before.len() - word.len()].ends_with("::") {
                continue;
            }
            let mut paths = Vec::new();
            expand(&base, &text[i + 2..], &mut paths);
            add_deps(&modules, &own, &paths, &mut deps);
        }
        graph.insert(file, deps);
    }
    graph
}

/// Adds the file of the longest module each of `paths` names (other than the importing file
/// and the crate root) to `deps`.
fn add_deps(
    modules: &BTreeMap<Vec<String>, String>,
    own: &[String],
    paths: &[Vec<String>],
    deps: &mut BTreeSet<String>,
) {
    for path in paths {
        let found = (1..=path.len()).rev().find(|&n| modules.contains_key(&path[..n]));
        if let Some(n) = found {
            if path[..n] != *own {
                deps.insert(modules[&path[..n]].clone());
            }
        }
    }
}

#[test]
fn no_import_cycle_among_the_files_of_each_crate() {
    let root = repo_root();
    let mut cycles = BTreeSet::new();
    for dir in ACYCLIC_CRATES {
        let graph = file_imports(&root.join(dir));
        let edges: usize = graph.values().map(BTreeSet::len).sum();
        assert!(graph.len() > 5 && edges > 2, "the file import graph of {dir} was read: {graph:?}");
        for file in graph.keys() {
            if let Some(mut c) = cycle_from(&graph, file) {
                // One line per circle, whichever file it is found from.
                c.pop();
                let first = (0..c.len()).min_by_key(|&i| &c[i]).unwrap();
                c.rotate_left(first);
                c.push(c[0].clone());
                cycles.insert(c.join(" -> "));
            }
        }
    }
    let cycles: Vec<_> = cycles.into_iter().collect();
    assert!(cycles.is_empty(), "file import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn the_file_import_graph_resolves_paths_to_files() {
    let graph = file_imports(&src());
    let dynamo = &graph["shared/src/store/dynamo/mod.rs"];
    assert!(dynamo.contains("shared/src/store/table.rs"), "super::table is store/table.rs: {dynamo:?}");
    assert!(dynamo.contains("shared/src/clock/mod.rs") || dynamo.contains("shared/src/clock.rs"), "{dynamo:?}");
    let mut paths = Vec::new();
    expand(&[], "a::{b, c::{d, e}, self}", &mut paths);
    let want: Vec<Vec<String>> = [&["a", "b"][..], &["a", "c", "d"], &["a", "c", "e"], &["a"]]
        .iter()
        .map(|p| p.iter().map(|s| s.to_string()).collect())
        .collect();
    assert_eq!(paths, want);
}

#[test]
fn the_function_length_check_measures_bodies() {
    let text = "impl X {\n    pub(crate) async fn long(\n        a: u8,\n    ) -> u8 {\n        a\n    }\n}\nfn f();\n";
    let fns = functions(Path::new("x.rs"), text);
    assert_eq!(fns, vec![("x.rs".to_string(), 2, "long".to_string(), 5)]);
}

#[test]
fn only_the_clock_module_reads_time() {
    let clock = src().join("clock");
    let reads = ["Instant::now(", "SystemTime::now(", ".elapsed()", "UNIX_EPOCH", "Utc::now("];
    let mut found = Vec::new();
    for (p, text) in sources(&src()) {
        if p.starts_with(&clock) {
            continue;
        }
        for (n, line) in text.lines().enumerate() {
            if let Some(r) = reads.iter().find(|r| line.contains(*r)) {
                found.push(format!("{}:{} {r}", rel(&p), n + 1));
            }
        }
    }
    assert!(found.is_empty(), "time read outside shared/src/clock:\n{}", found.join("\n"));
    let clock_text: String = sources(&clock).into_iter().map(|(_, t)| t).collect();
    assert!(clock_text.contains("SystemTime::now(") && clock_text.contains("Instant::now("), "the clock reads time");
}

/// The `.rs` paths DESIGN.md's "Code map" names (relative to shared/src).
fn code_map_paths() -> BTreeSet<String> {
    let design = std::fs::read_to_string(repo_root().join("DESIGN.md")).unwrap();
    let start = design.find("\n## Code map").expect("DESIGN.md has a Code map section");
    let section = &design[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    section
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| s.ends_with(".rs") && !s.starts_with("tests/"))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_code_map_matches_the_tree() {
    let named = code_map_paths();
    let tree: BTreeSet<String> = sources(&src())
        .into_iter()
        .map(|(p, _)| p.strip_prefix(src()).unwrap().to_string_lossy().replace('\\', "/"))
        .filter(|p| p != "lib.rs")
        .collect();
    let missing: Vec<_> = tree.difference(&named).collect();
    let stale: Vec<_> = named.difference(&tree).collect();
    assert!(missing.is_empty(), "files the code map does not name: {missing:?}");
    assert!(stale.is_empty(), "the code map names files that do not exist: {stale:?}");
}

/// Every source file of the workspace opens with a module comment that says what the file is
/// for: a reader following a command lands on a file and learns its concern first. A
/// placeholder (`TODO`, `FIXME`, `XXX`) does not count.
#[test]
fn every_source_file_says_what_it_is_for() {
    let root = repo_root();
    let mut missing = Vec::new();
    for dir in ["shared/src", "cli/src", "sim/src", "bench/src", "tests/src", "functions"] {
        for (path, text) in sources(&root.join(dir)) {
            let doc: String = text
                .lines()
                .take_while(|l| l.starts_with("//!"))
                .map(|l| l.trim_start_matches("//!").trim())
                .collect::<Vec<_>>()
                .join(" ");
            let placeholder = ["TODO", "FIXME", "XXX"].iter().any(|p| doc.trim().starts_with(p));
            if doc.split_whitespace().count() < 4 || placeholder {
                missing.push(rel(&path));
            }
        }
    }
    assert!(missing.is_empty(), "files without a module comment saying what they are for: {missing:?}");
}

/// The store's vocabulary holds together by its types: no `unreachable!` under
/// shared/src/store (test modules included). A value one part of the store cannot handle is
/// one its types do not let it be given (each kind's enum is matched whole, by that kind).
#[test]
fn the_store_has_no_unreachable_arm() {
    let store = src().join("store");
    let mut found = Vec::new();
    let mut read = 0;
    let mut stack = vec![store.clone()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                read += 1;
                let text = std::fs::read_to_string(&p).unwrap();
                for (n, line) in text.lines().enumerate() {
                    if line.contains(concat!("unreachable", "!")) {
                        found.push(format!("{}:{}", rel(&p), n + 1));
                    }
                }
            }
        }
    }
    assert!(read > 10, "the store's files were read: {read}");
    assert!(found.is_empty(), "unreachable! in shared/src/store:\n{}", found.join("\n"));
}

/// `Condition` and `Mutation` have one variant per kind of lease (and, for conditions, the few
/// every kind uses): at most 10 each, the kinds' own variants in their own enums
/// (shared/src/store/kinds/).
#[test]
fn the_store_vocabulary_is_nested_by_kind() {
    for (file, name) in [("condition.rs", "Condition"), ("mutation.rs", "Mutation")] {
        let text = std::fs::read_to_string(src().join("store").join(file)).unwrap();
        let start = text.find(&format!("pub enum {name} {{")).unwrap_or_else(|| panic!("{file} defines {name}"));
        let body = &text[start..];
        let body = &body[..body.find("\n}").unwrap()];
        let variants = body
            .lines()
            .skip(1)
            .filter(|l| l.starts_with("    ") && !l.starts_with("     ") && !l.trim_start().starts_with("//"))
            .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_uppercase()))
            .count();
        assert!((5..=10).contains(&variants), "{name} has {variants} top-level variants");
    }
}

/// The workspace's version is the newest release CHANGELOG.md names (a section above it may
/// only be "Unreleased"), and the HTTP API's description says the same version: a tag, the
/// crates and the document a user reads agree.
#[test]
fn the_version_is_the_changelogs_newest_release() {
    let root = repo_root();
    let cargo = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let version = cargo
        .split("[workspace.package]")
        .nth(1)
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("version = ")))
        .map(|v| v.trim_matches('"').to_string())
        .expect("Cargo.toml's [workspace.package] version");
    let changelog = std::fs::read_to_string(root.join("CHANGELOG.md")).unwrap();
    let newest = changelog
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .find(|h| !h.starts_with("Unreleased"))
        .and_then(|h| h.split_whitespace().next())
        .expect("CHANGELOG.md names a release");
    assert_eq!(version, newest, "Cargo.toml's version and CHANGELOG.md's newest release");
    assert!(changelog.contains(&format!("(tag v{version},")), "CHANGELOG.md names the tag of {version}");
    let api: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("shared/openapi.json")).unwrap()).unwrap();
    assert_eq!(api["info"]["version"], version.as_str(), "shared/openapi.json's info.version");
}
