//! The runner is a one-way street: every module of `src/` imports only from its own layer or
//! the layers before it. The order is declared here and in lib.rs's docs; a `use crate::x` (or
//! a path `crate::x::…`) that reaches a later layer fails this test, naming the file and line.

use std::path::Path;

/// Layers in order; a module may use its own layer and the ones before it.
const LAYERS: &[&[&str]] = &[
    &["io", "progress"],
    &["spec"],
    &["rows"],
    &["plan", "budget"],
    &["world"],
    &["settings"],
    &["results"],
    &["report"],
    &["run", "bench"],
    &["lib", "main"],
];

fn rank(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// (module, line number, referenced module) for every `crate::<name>` in the file.
fn references(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or_default();
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let after = &rest[at + "crate::".len()..];
            let name: String = after.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            // `use crate::{a, b}` groups
            if let Some(group) = after.strip_prefix('{') {
                let inner = group.split('}').next().unwrap_or_default();
                for part in inner.split(',') {
                    let n: String =
                        part.trim().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    if !n.is_empty() {
                        out.push((i + 1, n));
                    }
                }
            } else if !name.is_empty() {
                out.push((i + 1, name));
            }
            rest = after;
        }
    }
    out
}

fn check_dir(dir: &Path, src: &Path, back_edges: &mut Vec<String>, files: &mut usize) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            check_dir(&p, src, back_edges, files);
            continue;
        }
        if p.extension().and_then(|x| x.to_str()) != Some("rs") {
            continue;
        }
        *files += 1;
        let rel = p.strip_prefix(src).unwrap();
        let module = rel.components().next().unwrap().as_os_str().to_string_lossy().trim_end_matches(".rs").to_string();
        let own = rank(&module).unwrap_or_else(|| panic!("{}: module `{module}` is in no layer", rel.display()));
        for (line, name) in references(&std::fs::read_to_string(&p).unwrap()) {
            let Some(theirs) = rank(&name) else { continue }; // items re-exported at the root
            if theirs > own {
                back_edges.push(format!("{}:{line}: `{module}` uses `crate::{name}` (a later layer)", rel.display()));
            }
        }
    }
}

#[test]
fn runner_modules_import_only_earlier_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (mut back, mut files) = (Vec::new(), 0);
    check_dir(&src, &src, &mut back, &mut files);
    assert!(files >= 20, "only {files} files read");
    assert!(back.is_empty(), "back-edges:\n{}", back.join("\n"));
}

/// Negative control: the scanner finds plain paths, grouped imports and a back-edge.
#[test]
fn the_scanner_sees_back_edges() {
    let text = "use crate::{io, settings::Learner};\nfn f() { crate::report::x(); } // crate::run\n";
    let refs = references(text);
    assert_eq!(refs, [(1, "io".into()), (1, "settings".into()), (2, "report".into())]);
    assert!(rank("report").unwrap() > rank("plan").unwrap());
}

/// The places that may change a parsed spec, each named (ARCHITECTURE.md): the world writes
/// what the data says into its copy (issue 33 removes it: the world will return facts); no other
/// function takes `&mut Spec`, so a new one fails here. (The plan resolves `[policy]`'s
/// defaults into `Plan::policy`, leaving the spec as written.)
const SPEC_EDITORS: &[(&str, &str)] = &[("world/mod.rs", "fn load_generated")];

/// (file relative to src, the line) of every function signature that takes `&mut Spec`.
fn spec_editors(dir: &Path, src: &Path, out: &mut Vec<(String, String)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            spec_editors(&p, src, out);
        } else if p.extension().and_then(|x| x.to_str()) == Some("rs") {
            let rel = p.strip_prefix(src).unwrap().to_string_lossy().into_owned();
            // a signature runs from `fn ` to its body's `{` (or a `;`), over lines
            let mut sig: Option<String> = None;
            for line in std::fs::read_to_string(&p).unwrap().lines() {
                let code = line.split("//").next().unwrap_or_default().trim();
                if sig.is_none() && (code.starts_with("fn ") || code.contains(" fn ")) {
                    sig = Some(String::new());
                }
                if let Some(s) = sig.as_mut() {
                    s.push_str(code);
                    s.push(' ');
                    if code.contains('{') || code.ends_with(';') {
                        let head = s.split('{').next().unwrap_or_default().to_string();
                        if head.contains("&mut Spec") || head.contains("&mut spec::Spec") {
                            out.push((rel.clone(), head.trim().to_string()));
                        }
                        sig = None;
                    }
                }
            }
        }
    }
}

#[test]
fn only_the_named_places_change_a_parsed_spec() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    spec_editors(&src, &src, &mut found);
    let unnamed: Vec<&(String, String)> = found
        .iter()
        .filter(|(file, line)| !SPEC_EDITORS.iter().any(|(f, name)| file == f && line.contains(name)))
        .filter(|(file, _)| !file.starts_with("spec/"))
        .collect();
    assert!(unnamed.is_empty(), "functions that take &mut Spec outside the named places: {unnamed:?}");
    // negative control: the named places are found (the scan sees signatures)
    for (f, name) in SPEC_EDITORS {
        assert!(found.iter().any(|(file, line)| file == f && line.contains(name)), "{f}: {name} not found");
    }
}
