//! No file-level import circles: in every crate of the workspace, the graph file → files it
//! names (`crate::a::b…`, `super::x…`, `self::x…`, grouped `use crate::{a, b::{c, d}}`) has
//! its strongly connected components found (Tarjan's algorithm); a component of more than one
//! file is a circle. The test prints every crate's files and edges and fails on any circle: each
//! crate's files sit in an order (its `lib.rs` says which) where a file names only files before
//! it.
//!
//! A file `a/b.rs` or `a/b/mod.rs` is the module `a::b`, `lib.rs` the root; a path resolves to
//! the deepest module file it names (`crate::plan::chunk_range` → `plan`). Not read: a parent
//! naming its children by bare paths (`learner::Learner` in `settings/mod.rs`, the facade a
//! `mod.rs` is), `#[cfg(test)]` modules (their `super::` is the file itself), and `main.rs`
//! (a crate of its own).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Crates scanned, by their directory under `crates/`.
const CRATES: &[&str] = &["kernels", "features", "policy", "estimators", "selection", "runner"];

/// Tarjan's strongly connected components of the graph `edges` over nodes `0..n`, each
/// component's nodes sorted, components of one node included.
fn tarjan(n: usize, edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct S<'a> {
        edges: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut S, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on[v] = true;
        for &w in &s.edges[v] {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().expect("v is on the stack");
                s.on[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            comp.sort();
            s.out.push(comp);
        }
    }
    let mut s =
        S { edges, index: vec![None; n], low: vec![0; n], on: vec![false; n], stack: vec![], next: 0, out: vec![] };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

/// Components of more than one node, as sorted node names.
fn circles(names: &[String], edges: &[Vec<usize>]) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = tarjan(names.len(), edges)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut v: Vec<String> = c.into_iter().map(|i| names[i].clone()).collect();
            v.sort();
            v
        })
        .collect();
    out.sort();
    out
}

/// The code of a file: comments cut, `#[cfg(test)] mod … { … }` blocks dropped (counted by
/// their braces, so code after a test module is still read).
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let lines: Vec<&str> = text.lines().collect();
    let (mut skipping, mut depth) = (false, 0i64);
    for (i, line) in lines.iter().enumerate() {
        let code = line.split("//").next().unwrap_or_default();
        if !skipping
            && line.trim() == "#[cfg(test)]"
            && lines.get(i + 1).is_some_and(|n| n.trim_start().starts_with("mod ") && !n.trim_end().ends_with(';'))
        {
            skipping = true;
            depth = 0;
            continue;
        }
        if skipping {
            depth += code.matches('{').count() as i64 - code.matches('}').count() as i64;
            if depth <= 0 && code.contains('}') {
                skipping = false;
            }
            continue;
        }
        out.push_str(code);
        out.push('\n');
    }
    out
}

fn ident(s: &str) -> (&str, &str) {
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    (&s[..end], &s[end..])
}

/// Expands the use tree at the start of `s` (after a `crate::`/`super::`/`self::` head) into
/// its paths, each a list of segments; `{a, b::{c, d}}` gives `[a], [b, c], [b, d]`.
fn tree(s: &str) -> (Vec<Vec<String>>, &str) {
    let s = s.trim_start();
    if let Some(mut rest) = s.strip_prefix('{') {
        let mut out = Vec::new();
        loop {
            rest = rest.trim_start();
            if let Some(r) = rest.strip_prefix('}') {
                return (out, r);
            }
            if let Some(r) = rest.strip_prefix(',') {
                rest = r;
                continue;
            }
            let (paths, r) = tree(rest);
            if r.len() == rest.len() {
                // not a path (a `*`, an `as` alias, odd text): skip a character
                rest = &rest[rest.chars().next().map_or(0, char::len_utf8)..];
                if rest.is_empty() {
                    return (out, rest);
                }
            } else {
                rest = r;
            }
            out.extend(paths);
        }
    }
    let (name, rest) = ident(s);
    if name.is_empty() {
        return (vec![], s);
    }
    match rest.strip_prefix("::") {
        Some(r) => {
            let (tails, r) = tree(r);
            let head = vec![name.to_string()];
            if tails.is_empty() {
                return (vec![head], r);
            }
            (tails.into_iter().map(|t| [head.clone(), t].concat()).collect(), r)
        }
        None => (vec![vec![name.to_string()]], rest),
    }
}

/// Absolute module paths named in a file of module `module`: `crate::` from the root,
/// `super::` (repeated) from the parents, `self::` from the module itself.
fn references(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for head in ["crate::", "super::", "self::"] {
        for (at, _) in code.match_indices(head) {
            let before = code[..at].trim_end_matches(' ');
            let prev = bytes[..at].last().copied();
            if prev.is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'$' || c == b':')
                || before.ends_with("(in")
            {
                continue; // part of a longer path, a macro's `$crate`, or a `pub(in crate::…)`
            }
            let mut base: Vec<String> = match head {
                "crate::" => vec![],
                "self::" => module.to_vec(),
                _ => module[..module.len().saturating_sub(1)].to_vec(),
            };
            let mut rest = &code[at + head.len()..];
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
            for p in tree(rest).0 {
                out.push([base.clone(), p].concat());
            }
        }
    }
    out
}

/// The module path of a file relative to `src`, or None for `main.rs` (a crate of its own).
fn module_of(rel: &Path) -> Option<Vec<String>> {
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop()?;
    match last.as_str() {
        "lib.rs" if parts.is_empty() => {}
        "main.rs" if parts.is_empty() => return None,
        "mod.rs" => {}
        f => parts.push(f.trim_end_matches(".rs").to_string()),
    }
    Some(parts)
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().and_then(|x| x.to_str()) == Some("rs") {
            out.push(p);
        }
    }
}

/// A crate's file graph: (module names, edges, edge count).
fn crate_graph(src: &Path) -> (Vec<String>, Vec<Vec<usize>>) {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let mods: Vec<(Vec<String>, String)> = files
        .iter()
        .filter_map(|f| module_of(f.strip_prefix(src).unwrap()).map(|m| (m, std::fs::read_to_string(f).unwrap())))
        .collect();
    let index: BTreeMap<Vec<String>, usize> = mods.iter().enumerate().map(|(i, (m, _))| (m.clone(), i)).collect();
    let names: Vec<String> = mods.iter().map(|(m, _)| if m.is_empty() { "lib".into() } else { m.join("::") }).collect();
    let mut edges = vec![BTreeSet::new(); mods.len()];
    for (i, (m, text)) in mods.iter().enumerate() {
        for path in references(&code_of(text), m) {
            // the deepest module file the path names
            let j = (0..=path.len()).rev().find_map(|k| index.get(&path[..k]).copied());
            if let Some(j) = j.filter(|&j| j != i) {
                edges[i].insert(j);
            }
        }
    }
    (names, edges.into_iter().map(|s| s.into_iter().collect()).collect())
}

#[test]
fn no_import_circles_in_any_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut failures = Vec::new();
    for krate in CRATES {
        let (names, edges) = crate_graph(&root.join(krate).join("src"));
        assert!(names.iter().any(|n| n == "lib"), "{krate}: no lib.rs read ({} files)", names.len());
        let found = circles(&names, &edges);
        let n_edges: usize = edges.iter().map(Vec::len).sum();
        println!("{krate}: {} files, {n_edges} edges, {} circle(s)", names.len(), found.len());
        for c in &found {
            failures.push(format!("{krate}: {{{}}}", c.join(", ")));
        }
    }
    assert!(failures.is_empty(), "import circles:\n{}", failures.join("\n"));
}

/// Negative control: Tarjan finds a circle of three with a tail, and none in a DAG.
#[test]
fn the_finder_sees_a_circle_and_no_circle_in_a_dag() {
    let names: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
    // a → b → c → a, c → d
    let cyc = vec![vec![1], vec![2], vec![0, 3], vec![]];
    assert_eq!(circles(&names, &cyc), [["a", "b", "c"]]);
    // a → b, a → c, b → d, c → d
    let dag = vec![vec![1, 2], vec![3], vec![3], vec![]];
    assert!(circles(&names, &dag).is_empty());
    // two circles apart
    let two = vec![vec![1], vec![0], vec![3], vec![2]];
    assert_eq!(circles(&names, &two).len(), 2);
}

/// Negative control: the reader resolves `crate::`, `super::`, groups, and skips `pub(in …)`,
/// `$crate`, comments and test modules.
#[test]
fn the_reader_resolves_paths() {
    let m: Vec<String> = ["settings", "online"].map(String::from).to_vec();
    let text = "use super::arms::{self, Arm};\nuse crate::{io, plan::{Plan, chunk_range}};\n\
                pub(in crate::settings) struct X;\nfn f() { super::super::world::env::dot(); $crate::z(); }\n\
                // crate::report\n#[cfg(test)]\nmod tests {\n    use super::*;\n    fn g() {\n        crate::run::x();\n    }\n}\nuse crate::rows;\n";
    let refs = references(&code_of(text), &m);
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        refs,
        [
            s(&["io"]),
            s(&["plan", "Plan"]),
            s(&["plan", "chunk_range"]),
            s(&["rows"]),
            s(&["settings", "arms", "self"]),
            s(&["settings", "arms", "Arm"]),
            s(&["world", "env", "dot"]),
        ]
    );
    assert_eq!(module_of(Path::new("settings/mod.rs")), Some(s(&["settings"])));
    assert_eq!(module_of(Path::new("settings/arms/dpo.rs")), Some(s(&["settings", "arms", "dpo"])));
    assert_eq!(module_of(Path::new("lib.rs")), Some(vec![]));
    assert_eq!(module_of(Path::new("main.rs")), None);
}
