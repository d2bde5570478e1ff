//! The documents stay true to the code and to themselves:
//! - the reference pages under docs/src/reference/ are what `onepass reference` writes now
//!   (spec keys, CLI, result tables, estimators), and it writes them only when every key,
//!   argument and column has a doc;
//! - every relative link and `{{#include}}` of the book and the README points at a file that
//!   exists, and every `#anchor` at a heading of its page (mdBook's ids);
//! - the README is a front door (at most 200 lines), and no user document speaks of how the
//!   work was organised ("session 12", "issue 30").

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            markdown_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "md") {
            out.push(p);
        }
    }
}

/// The pages the book holds: docs/src/**.md, and the files they include.
fn book_pages() -> Vec<PathBuf> {
    let mut v = Vec::new();
    markdown_files(&root().join("docs/src"), &mut v);
    v.sort();
    v
}

#[test]
fn the_reference_pages_are_what_the_code_writes() {
    let dir = tempfile::tempdir().unwrap();
    let out =
        Command::new(env!("CARGO_BIN_EXE_onepass")).args(["reference", "--out"]).arg(dir.path()).output().unwrap();
    assert!(out.status.success(), "onepass reference failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let committed = root().join("docs/src/reference");
    let mut stale = Vec::new();
    for f in ["spec.md", "cli.md", "results.md", "estimators.md"] {
        let new = std::fs::read_to_string(dir.path().join(f)).unwrap();
        let old = std::fs::read_to_string(committed.join(f)).unwrap_or_default();
        if new != old {
            let line = new
                .lines()
                .zip(old.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(new.lines().count().min(old.lines().count()));
            stale.push(format!("docs/src/reference/{f}: differs from line {}", line + 1));
        }
    }
    assert!(stale.is_empty(), "the reference is stale (run `just reference`):\n{}", stale.join("\n"));
}

/// The id mdBook gives a heading: lower case, spaces to '-', other punctuation dropped
/// (markdown's inline code and link brackets too); a repeated id gets "-1", "-2", ….
fn heading_ids(text: &str) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    let mut seen = std::collections::HashMap::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        // a link in a heading keeps its text only
        let mut plain = String::new();
        let mut rest = title;
        while let Some(at) = rest.find("](") {
            plain.push_str(&rest[..at]);
            rest = rest[at..].split_once(')').map_or("", |(_, r)| r);
        }
        plain.push_str(rest);
        let id: String = plain
            .chars()
            .filter_map(|c| {
                if c.is_alphanumeric() || c == '_' || c == '-' {
                    Some(c.to_lowercase().next().unwrap())
                } else if c.is_whitespace() {
                    Some('-')
                } else {
                    None
                }
            })
            .collect();
        let n = seen.entry(id.clone()).or_insert(0usize);
        ids.push(if *n == 0 { id } else { format!("{id}-{n}") });
        *n += 1;
    }
    ids
}

/// Every `](target)` of a markdown text outside code: (line, target).
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // inline code spans hold no links
        let code_free: String =
            line.split('`').enumerate().filter(|(k, _)| k % 2 == 0).map(|(_, s)| s).collect::<Vec<_>>().join(" ");
        let mut rest = code_free.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].split_whitespace().next().unwrap_or_default().to_string();
            out.push((i + 1, target));
            rest = &after[end..];
        }
        let mut rest = line;
        while let Some(at) = rest.find("{{#include ") {
            let after = &rest[at + "{{#include ".len()..];
            let end = after.find("}}").unwrap_or(after.len());
            let target = after[..end].trim().split(':').next().unwrap_or_default().to_string();
            out.push((i + 1, format!("include:{target}")));
            rest = &after[end..];
        }
    }
    out
}

/// Broken relative links of one file: a missing file, an anchor its page lacks, or (in the
/// book) a page outside docs/src that the built book would not hold.
fn check_links(file: &Path, in_book: bool, bad: &mut Vec<String>) {
    let text = std::fs::read_to_string(file).unwrap();
    let src = root().join("docs/src");
    let rel = file.strip_prefix(root()).unwrap_or(file).display().to_string();
    for (line, target) in links(&text) {
        let (include, target) = match target.strip_prefix("include:") {
            Some(t) => (true, t.to_string()),
            None => (false, target),
        };
        if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p.to_string(), Some(a.to_string())),
            None => (target.clone(), None),
        };
        let dest = if path.is_empty() { file.to_path_buf() } else { file.parent().unwrap().join(&path) };
        let Ok(dest) = dest.canonicalize() else {
            bad.push(format!("{rel}:{line}: `{target}`: no such file"));
            continue;
        };
        if in_book && !include && !dest.starts_with(&src) {
            bad.push(format!(
                "{rel}:{line}: `{target}` is outside docs/src, so the built book has no page for it: link the repository's URL"
            ));
            continue;
        }
        if let Some(a) = anchor {
            if dest.extension().is_some_and(|x| x == "md") {
                let ids = heading_ids(&std::fs::read_to_string(&dest).unwrap());
                // included fragments add headings to the page that includes them
                let mut all = ids;
                for (_, t) in links(&std::fs::read_to_string(&dest).unwrap()) {
                    if let Some(inc) = t.strip_prefix("include:") {
                        if let Ok(s) = std::fs::read_to_string(dest.parent().unwrap().join(inc)) {
                            all.extend(heading_ids(&s));
                        }
                    }
                }
                if !all.contains(&a) {
                    bad.push(format!("{rel}:{line}: `{target}`: {} has no heading with id `{a}`", dest.display()));
                }
            }
        }
    }
}

#[test]
fn links_and_includes_resolve() {
    let mut bad = Vec::new();
    for p in book_pages() {
        check_links(&p, true, &mut bad);
    }
    check_links(&root().join("README.md"), false, &mut bad);
    assert!(bad.is_empty(), "broken links:\n{}", bad.join("\n"));
}

/// The negative control of the link check: a missing page, a missing anchor and a page outside
/// the book are each named.
#[test]
fn the_link_check_finds_broken_links() {
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("a.md");
    std::fs::write(dir.path().join("b.md"), "# Title\n\n## [policy.rloo]\n\n## `cells.parquet`\n").unwrap();
    std::fs::write(
        &page,
        "[ok](b.md#policyrloo) [ok](b.md#cellsparquet) [bad](c.md) [bad](b.md#nope) `[code](x.md)`\n```\n[fenced](y.md)\n```\n",
    )
    .unwrap();
    let mut bad = Vec::new();
    check_links(&page, false, &mut bad);
    assert_eq!(bad.len(), 2, "{bad:#?}");
    assert!(bad[0].contains("c.md") && bad[1].contains("nope"), "{bad:#?}");
    let mut bad = Vec::new();
    check_links(&page, true, &mut bad);
    assert!(bad.iter().any(|b| b.contains("outside docs/src")), "{bad:#?}");
}

/// Labels of how the work was organised, which a user cannot look up.
fn work_log_labels(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let lower = line.to_lowercase();
        for word in ["session", "issue", "sessions", "issues"] {
            let mut rest = lower.as_str();
            while let Some(at) = rest.find(word) {
                let before_ok = at == 0 || !rest.as_bytes()[at - 1].is_ascii_alphanumeric();
                let after = rest[at + word.len()..].trim_start_matches([' ', '-', '#']);
                if before_ok && after.starts_with(|c: char| c.is_ascii_digit()) {
                    out.push(format!("line {}: {}", i + 1, line.trim()));
                }
                rest = &rest[at + word.len()..];
            }
        }
    }
    out
}

#[test]
fn user_documents_carry_no_work_log_labels() {
    let mut files = book_pages();
    files.push(root().join("README.md"));
    files.push(root().join("crates/runner/ARCHITECTURE.md"));
    files.push(root().join("experiments/records/README.md"));
    files.push(root().join("docs/results/slices/online-proof/README.md"));
    let mut found = Vec::new();
    for f in files {
        for l in work_log_labels(&std::fs::read_to_string(&f).unwrap()) {
            found.push(format!("{}: {l}", f.strip_prefix(root()).unwrap().display()));
        }
    }
    assert!(
        found.is_empty(),
        "work-log labels in user documents (use dates, CPUs and revisions):\n{}",
        found.join("\n")
    );
    // the negative control
    assert_eq!(work_log_labels("as of session 12 and Issue-30; sessions are fine; tissue 3").len(), 2);
}

#[test]
fn the_readme_is_a_front_door() {
    let n = std::fs::read_to_string(root().join("README.md")).unwrap().lines().count();
    assert!(n <= 200, "README.md has {n} lines: at most 200 (the book holds the rest)");
}
