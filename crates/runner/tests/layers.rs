//! The runner is a one-way street: every module of `src/` imports only from its own layer or
//! the layers before it. The order is declared here and in lib.rs's docs; a `use crate::x` (or
//! a path `crate::x::…`) that reaches a later layer fails this test, naming the file and line.

use std::path::Path;

/// Layers in order; a module may use its own layer and the ones before it.
const LAYERS: &[&[&str]] = &[
    &["io", "progress", "tb"],
    &["spec"],
    &["rows", "columns"],
    &["plan", "budget"],
    &["world"],
    &["settings"],
    &["results"],
    &["report"],
    &["run", "bench"],
    &["inspect", "reference"],
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

/// The function signatures of `text` that take `&mut Spec` (a signature runs from `fn ` to its
/// body's `{` or a `;`, over lines).
fn mut_spec_signatures(text: &str) -> Vec<String> {
    let (mut out, mut sig): (Vec<String>, Option<String>) = (Vec::new(), None);
    for line in text.lines() {
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
                    out.push(head.trim().to_string());
                }
                sig = None;
            }
        }
    }
    out
}

/// (file relative to src, the signature) of every function that takes `&mut Spec`.
fn spec_editors(dir: &Path, src: &Path, out: &mut Vec<(String, String)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            spec_editors(&p, src, out);
        } else if p.extension().and_then(|x| x.to_str()) == Some("rs") {
            let rel = p.strip_prefix(src).unwrap().to_string_lossy().into_owned();
            for head in mut_spec_signatures(&std::fs::read_to_string(&p).unwrap()) {
                out.push((rel.clone(), head));
            }
        }
    }
}

/// Nothing outside `spec/` changes a parsed spec (ARCHITECTURE.md): the world reports what the
/// data says (`DataFacts`) and the plan completes the cells' spec with it (`plan::resolve`, by
/// value); the plan resolves `[policy]`'s defaults into `Plan::policy`. A function taking
/// `&mut Spec` anywhere else fails here.
#[test]
fn nothing_outside_spec_changes_a_parsed_spec() {
    // negative control: the scan sees a signature over lines, and not a shared borrow
    let text = "pub(crate) fn load(\n    spec: &mut Spec, // the spec\n    keys: Locator<'_>,\n) -> Result<()> {\n}\nfn read(spec: &Spec) {}\n";
    assert_eq!(mut_spec_signatures(text).len(), 1, "{:?}", mut_spec_signatures(text));
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    spec_editors(&src, &src, &mut found);
    let outside: Vec<&(String, String)> = found.iter().filter(|(file, _)| !file.starts_with("spec/")).collect();
    assert!(outside.is_empty(), "functions that take &mut Spec outside spec/: {outside:?}");
}

/// `spec.<field>… = ` outside an `==`/`!=`/`<=`/`>=`: an assignment into a spec.
fn assigns_into_spec(code: &str) -> bool {
    let mut rest = code;
    while let Some(i) = rest.find("spec.") {
        let after = &rest[i + 5..];
        let path_end = after.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.')).unwrap_or(after.len());
        let tail = after[path_end..].trim_start();
        if tail.starts_with('=') && !tail.starts_with("==") {
            return true;
        }
        rest = &after[path_end..];
    }
    false
}

/// The world never writes into a spec, not even its own copy: it returns facts.
#[test]
fn the_world_writes_no_spec_field() {
    assert!(assigns_into_spec("    spec.env.dim = d.d;"), "negative control: an assignment is seen");
    assert!(!assigns_into_spec("if spec.env.dim == d.d {"), "a comparison is not an assignment");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/world");
    let mut found = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        for (i, line) in std::fs::read_to_string(&p).unwrap().lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            if assigns_into_spec(code) {
                found.push(format!("{}:{}: {}", p.file_name().unwrap().to_string_lossy(), i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "the world assigns into a spec: {found:?}");
}

/// Whether a line of code names the whole spec: the type `Spec` or the world's `world.spec`.
fn names_the_spec(code: &str) -> bool {
    let word = |w: &str| {
        code.match_indices(w).any(|(i, _)| {
            let before = code[..i].chars().next_back();
            let after = code[i + w.len()..].chars().next();
            !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
                && !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
    };
    word("Spec") || code.contains("world.spec")
}

/// The cells read their resolved `CellConfig` and nothing else of the spec (issue "resolve
/// once"): no code of `settings/` outside its tests names the `Spec` type or `world.spec`.
#[test]
fn the_cells_read_no_spec() {
    assert!(names_the_spec("fn f(spec: &Spec) {"), "negative control: the type is seen");
    assert!(names_the_spec("let s = &world.spec;"), "negative control: the world's spec is seen");
    assert!(!names_the_spec("use crate::spec::{CheckpointSpec, EnvSpec};"), "a table's type is not the spec");
    let mut found = Vec::new();
    let mut stack = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src/settings")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            for (i, line) in code.lines().enumerate() {
                if names_the_spec(line.split("//").next().unwrap_or_default()) {
                    found.push(format!("{}:{}: {}", p.display(), i + 1, line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "the cells read the spec: {found:?}");
}
