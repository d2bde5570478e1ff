//! Reading a spec file: `--set` overrides, and the errors that name the file, the key path and
//! the line ([`SpecError`]).

use super::Spec;
use std::fmt;
use std::path::{Path, PathBuf};

/// A bad spec: where, and what was expected. Exit code 2.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecError {
    pub file: PathBuf,
    /// Dotted key path, e.g. `estimator[1].lr` (empty when the error is about the whole file).
    pub key: String,
    pub line: Option<usize>,
    pub message: String,
    /// The `--set key=value` argument the error is about, when it came from one (it is then
    /// cited instead of a line of the file).
    pub set: Option<String>,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.set, self.line) {
            (Some(s), _) => write!(f, "--set {} (over {})", shorten_numbers(s), self.file.display())?,
            (None, Some(l)) => write!(f, "{}:{l}", self.file.display())?,
            (None, None) => write!(f, "{}", self.file.display())?,
        }
        if !self.key.is_empty() {
            write!(f, ": `{}`", self.key)?;
        }
        write!(f, ": {}", shorten_numbers(&self.message))
    }
}

impl std::error::Error for SpecError {}
/// 1-based line of byte offset `at` in `text`.
pub fn line_of(text: &str, at: usize) -> usize {
    text[..at.min(text.len())].bytes().filter(|&b| b == b'\n').count() + 1
}

/// The line where `path` (e.g. ["estimator", "1", "lr"]) is written, if it is; else the line
/// of its closest written parent.
pub fn locate(text: &str, path: &[String]) -> Option<usize> {
    let doc = toml_edit::Document::parse(text.to_string()).ok()?;
    find_span(doc.as_item(), path).map(|s| line_of(text, s.start))
}

/// Whether the key at `path` of plain tables (e.g. ["env", "dim"]) is written in `text`.
pub fn is_written(text: &str, path: &[&str]) -> bool {
    let Ok(doc) = toml_edit::Document::parse(text.to_string()) else { return false };
    let mut item = doc.as_item();
    for seg in path {
        match item.get(seg) {
            Some(next) => item = next,
            None => return false,
        }
    }
    true
}

type Span = std::ops::Range<usize>;

fn find_span(item: &toml_edit::Item, path: &[String]) -> Option<Span> {
    let Some((seg, rest)) = path.split_first() else { return item.span() };
    match item {
        toml_edit::Item::Table(t) => find_in_table(t, seg, rest),
        toml_edit::Item::ArrayOfTables(a) => {
            let t = a.get(seg.parse().ok()?)?;
            match rest.split_first() {
                None => t.span(),
                Some((s2, r2)) => find_in_table(t, s2, r2).or_else(|| t.span()),
            }
        }
        toml_edit::Item::Value(toml_edit::Value::InlineTable(t)) => t.key(seg).and_then(|k| k.span()),
        _ => None,
    }
}

fn find_in_table(t: &toml_edit::Table, seg: &str, rest: &[String]) -> Option<Span> {
    let key_span = t.key(seg).and_then(|k| k.span());
    let child = t.get(seg)?;
    if rest.is_empty() {
        key_span.or_else(|| child.span())
    } else {
        find_span(child, rest).or(key_span)
    }
}

/// Reads a spec file, applies `--set key=value` overrides, and parses it.
pub fn load(path: &Path, overrides: &[String]) -> Result<(Spec, String), SpecError> {
    let text = std::fs::read_to_string(path).map_err(|e| SpecError {
        file: path.to_path_buf(),
        key: String::new(),
        line: None,
        message: format!("cannot read the spec: {e}"),
        set: None,
    })?;
    parse(&text, path, overrides)
}

/// Parses spec text (errors name `path`), after `--set` overrides; no file is read.
pub fn parse(text: &str, path: &Path, overrides: &[String]) -> Result<(Spec, String), SpecError> {
    let err = |key: &str, line, message: String| SpecError {
        file: path.to_path_buf(),
        key: key.into(),
        line,
        message,
        set: None,
    };
    let text = apply_overrides(text, overrides).map_err(|(k, m)| SpecError {
        set: overrides.iter().find(|o| o.starts_with(&format!("{k}="))).cloned(),
        ..err(&k, None, m)
    })?;
    let spec: Spec = toml::from_str(&text).map_err(|e: toml::de::Error| {
        let line = e.span().map(|s| line_of(&text, s.start));
        // name the key when the error sits on a `key = value` line (wrong types, bad values),
        // or the table when it sits on a `[table]` header (a table written twice)
        let at = line.and_then(|l| text.lines().nth(l - 1)).map(str::trim);
        let header = at.and_then(|l| l.strip_prefix('[')).and_then(|l| l.trim_start_matches('[').split(']').next());
        let written = at
            .and_then(|l| l.split_once('='))
            .map(|(k, _)| k.trim())
            .or(header.map(str::trim))
            .filter(|k| !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || "_-.\"".contains(c)))
            .unwrap_or("");
        // the whole dotted path of the value the error sits on (`deploy.policy`, not `policy`)
        let path = e.span().and_then(|s| key_at(&text, s.start));
        let key = path.as_deref().filter(|p| p.ends_with(written) || written.is_empty()).unwrap_or(written);
        let mut e = err(key, line, user_words(e.message()));
        // an error on a line that a `--set` wrote cites the argument (its line is not the file's)
        if let Some(o) = line.and_then(|l| override_at(&text, overrides, l)) {
            e.key = override_key(o).to_string();
            (e.set, e.line) = (Some(o.clone()), None);
        }
        e
    })?;
    Ok((spec, text))
}

/// The dotted path (`deploy.policy`, `estimator[1].lr`) of the innermost key whose `key = value`
/// holds byte `at` of `text`, if any.
pub fn key_at(text: &str, at: usize) -> Option<String> {
    fn in_table(t: &toml_edit::Table, at: usize, path: &mut Vec<String>) -> bool {
        for (k, item) in t.iter() {
            path.push(k.to_string());
            let start = t.key(k).and_then(|k| k.span()).map(|s| s.start);
            let end = item.span().map(|s| s.end);
            if let (Some(a), Some(b), true) = (start, end, item.is_value()) {
                if (a..b).contains(&at) {
                    if let toml_edit::Item::Value(toml_edit::Value::InlineTable(it)) = item {
                        in_inline(it, at, path);
                    }
                    return true;
                }
            }
            let found = match item {
                toml_edit::Item::Table(c) => in_table(c, at, path),
                toml_edit::Item::ArrayOfTables(a) => a.iter().enumerate().any(|(i, c)| {
                    let last = path.pop().unwrap_or_default();
                    path.push(format!("{last}[{i}]"));
                    in_table(c, at, path) || {
                        path.pop();
                        path.push(last);
                        false
                    }
                }),
                _ => false,
            };
            if found {
                return true;
            }
            path.pop();
        }
        false
    }
    fn in_inline(t: &toml_edit::InlineTable, at: usize, path: &mut Vec<String>) {
        for (k, v) in t.iter() {
            let start = t.key(k).and_then(|k| k.span()).or_else(|| v.span()).map(|s| s.start);
            if let (Some(a), Some(b)) = (start, v.span().map(|s| s.end)) {
                if !(a..b.max(a + 1)).contains(&at) {
                    continue;
                }
                path.push(k.to_string());
                if let toml_edit::Value::InlineTable(it) = v {
                    in_inline(it, at, path);
                }
                return;
            }
        }
    }
    let doc = toml_edit::Document::parse(text.to_string()).ok()?;
    let mut path = Vec::new();
    in_table(doc.as_table(), at, &mut path).then(|| path.join("."))
}

/// serde's words in a spec error made the user's: what was written, then what the key takes
/// ("`1`: expected a table", not "invalid type: integer `1`, expected struct WarmStart";
/// "a whole number ≥ 0", not "u32"; no "as i128", no Rust type names), and long numbers cut.
pub fn user_words(message: &str) -> String {
    let m = message.trim().replace(" as i128", "").replace(" as u128", "");
    let rest = m.strip_prefix("invalid type: ").or_else(|| m.strip_prefix("invalid value: "));
    let out = match rest.and_then(|r| r.rsplit_once(", expected ")) {
        Some((got, want)) => {
            let got = match got {
                "map" => "a table".to_string(),
                "sequence" => "a list".to_string(),
                g => {
                    let g = ["integer ", "floating point ", "boolean "]
                        .iter()
                        .fold(g, |g, p| g.strip_prefix(p).unwrap_or(g));
                    match g.strip_prefix("string ") {
                        Some(s) => format!("the string {s}"),
                        None => g.to_string(),
                    }
                }
            };
            format!("{got}: expected {}", expected_words(want))
        }
        None => match m.strip_prefix("data did not match any variant of untagged enum ") {
            Some(name) => format!("expected {}", expected_words(name)),
            None => {
                if let Some(f) = m.strip_prefix("missing field ") {
                    format!("the key {f} is missing")
                } else if let Some((k, takes)) =
                    m.strip_prefix("unknown field ").and_then(|r| r.split_once(", expected "))
                {
                    let takes = takes.strip_prefix("one of ").unwrap_or(takes);
                    format!("unknown key {k}; this table takes {takes}")
                } else if let Some((v, choices)) =
                    m.strip_prefix("unknown variant ").and_then(|r| r.split_once(", expected "))
                {
                    format!("{v}: expected {choices}")
                } else {
                    m.clone()
                }
            }
        },
    };
    shorten_numbers(&out)
}

/// What a key takes, for serde's name of a type.
fn expected_words(want: &str) -> String {
    let want = want.trim();
    let whole = |max: &str| format!("a whole number from 0 to {max}");
    match want {
        "u8" => whole("255"),
        "u16" => whole("65535"),
        "u32" => whole("4294967295"),
        "u64" | "usize" => whole("18446744073709551615"),
        "i8" | "i16" | "i32" | "i64" | "isize" => "a whole number".into(),
        "f32" | "f64" => "a number".into(),
        "a boolean" => "true or false".into(),
        "a sequence" => "a list [ … ]".into(),
        "a map" => "a table".into(),
        "Targets" | "enum Targets" => "a list of module names or \"all-linear\"".into(),
        "OneOrMany" | "enum OneOrMany" => "a name or a list of names".into(),
        w if w.starts_with("struct ") => "a table ([section] or { key = … })".into(),
        w if w.starts_with("enum ") || w.starts_with("untagged enum ") => {
            "one of the forms this key takes (see the key reference)".into()
        }
        w => w.to_string(),
    }
}

/// Runs of more than 24 digits cut to their first 12 and a count ("123456789012… (300 digits)"):
/// a 300-digit number is not echoed back in full.
pub fn shorten_numbers(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut run = String::new();
    let flush = |run: &mut String, out: &mut String| {
        if run.len() > 24 {
            out.push_str(&format!("{}… ({} digits)", &run[..12], run.len()));
        } else {
            out.push_str(run);
        }
        run.clear();
    };
    for c in s.chars() {
        if c.is_ascii_digit() {
            run.push(c);
        } else {
            flush(&mut run, &mut out);
            out.push(c);
        }
    }
    flush(&mut run, &mut out);
    out
}

/// The key of a `--set key=value` argument.
pub fn override_key(o: &str) -> &str {
    o.split_once('=').map_or(o, |(k, _)| k)
}

/// The `--set` argument whose value sits on line `line` of the overridden `text`: the last one
/// of its key (the one in force).
pub fn override_at<'a>(text: &str, overrides: &'a [String], line: usize) -> Option<&'a String> {
    overrides.iter().rev().find(|o| {
        let key = override_key(o);
        let path: Vec<String> = key.split('.').map(String::from).collect();
        locate(text, &path) == Some(line)
    })
}

/// Applies `key=value` overrides (dotted keys; array-of-table entries by index, e.g.
/// `estimator.0.lr=0.1`, or the whole list as inline tables, e.g.
/// `estimator=[{kind="sgd", lr=0.1}]`); the value is read as TOML, else as a string.
pub fn apply_overrides(text: &str, overrides: &[String]) -> Result<String, (String, String)> {
    if overrides.is_empty() {
        return Ok(text.to_string());
    }
    let mut doc: toml_edit::DocumentMut =
        text.parse().map_err(|e: toml_edit::TomlError| (String::new(), e.message().to_string()))?;
    for o in overrides {
        let (key, raw) = o.split_once('=').ok_or_else(|| (o.clone(), "--set expects key=value".to_string()))?;
        let value = override_value(key, raw)?;
        let segs: Vec<&str> = key.split('.').collect();
        if let Some(bad) =
            segs.iter().find(|s| s.is_empty() || !s.chars().all(|c| c.is_ascii_alphanumeric() || "_-".contains(c)))
        {
            let why = if bad.is_empty() { "an empty name".to_string() } else { format!("`{bad}`") };
            return Err((
                key.to_string(),
                format!("{why} in the key: expected dotted names such as stream.samples or estimator.0.lr"),
            ));
        }
        set_in_table(doc.as_table_mut(), &segs, value).map_err(|m| (key.to_string(), m))?;
    }
    Ok(doc.to_string())
}

/// A `--set` value: TOML, else a bare word read as a string (`--set deploy.policy=rloo`). What
/// reads as a number, list, table, quoted string or comment but is not valid TOML is refused:
/// `99999999999999999999` (past i64), `1 ` (a space after it), `64 # comment` became strings,
/// then "invalid type: string, expected usize" far from the argument.
fn override_value(key: &str, raw: &str) -> Result<toml_edit::Value, (String, String)> {
    let err = match raw.parse::<toml_edit::Value>() {
        Ok(v) if raw.trim() == raw => return Ok(v),
        Ok(_) => None,
        Err(e) => Some(e.message().trim().to_string()),
    };
    let word = !raw.is_empty()
        && raw.trim() == raw
        && !raw.contains('#')
        && !raw.starts_with(|c: char| c.is_ascii_digit() || "+-.[{\"'".contains(c));
    if word {
        return Ok(toml_edit::Value::from(raw));
    }
    let why = if raw.trim() != raw {
        "spaces around the value".to_string()
    } else if raw.contains('#') {
        "a comment (`#`) in the value".to_string()
    } else {
        err.unwrap_or_else(|| "not a TOML value".into())
    };
    Err((
        key.to_string(),
        format!("`{raw}`: not a TOML value ({why}): expected a number, true/false, a [list], an {{inline table}} or a quoted string"),
    ))
}

fn set_in_table(t: &mut toml_edit::Table, segs: &[&str], value: toml_edit::Value) -> Result<(), String> {
    let (seg, rest) = segs.split_first().ok_or("empty key")?;
    if rest.is_empty() {
        match t.get(seg) {
            // a table is set key by key: replaced by a value it would vanish
            Some(toml_edit::Item::Table(_)) => {
                return Err(format!("cannot replace the table `{seg}` with a value: set its keys ({seg}.KEY=…)"))
            }
            // a [[table]] list: key by key, or the whole list as inline tables (how a run keeps
            // some of a preset's estimators); a list of anything else, or none, would leave no
            // tables
            Some(toml_edit::Item::ArrayOfTables(_)) => {
                let tables = match &value {
                    toml_edit::Value::Array(list) if !list.is_empty() => list
                        .iter()
                        .map(|v| v.as_inline_table().map(|it| it.clone().into_table()))
                        .collect::<Option<Vec<_>>>(),
                    _ => None,
                };
                let Some(tables) = tables else {
                    return Err(format!(
                        "cannot replace the [[tables]] `{seg}` with {value}: set its keys ({seg}.0.lr=…) or give a non-empty list of inline tables ({seg}=[{{kind=\"sgd\", lr=0.1}}])",
                        value = value.to_string().trim()
                    ));
                };
                let mut list = toml_edit::ArrayOfTables::new();
                tables.into_iter().for_each(|t| list.push(t));
                t[seg] = toml_edit::Item::ArrayOfTables(list);
                return Ok(());
            }
            _ => {}
        }
        t[seg] = toml_edit::Item::Value(value);
        return Ok(());
    }
    match t.entry(seg).or_insert(toml_edit::table()) {
        toml_edit::Item::Table(child) => set_in_table(child, rest, value),
        toml_edit::Item::ArrayOfTables(a) => {
            let (idx, rest) = rest.split_first().ok_or("expected an index after an array of tables")?;
            let idx: usize = idx.parse().map_err(|_| format!("`{idx}` is not an index"))?;
            let len = a.len();
            let child = a.get_mut(idx).ok_or_else(|| format!("index {idx} out of range: {len} entries"))?;
            if rest.is_empty() {
                return Err("cannot replace a whole table".into());
            }
            set_in_table(child, rest, value)
        }
        _ => Err(format!("`{seg}` is not a table")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// serde's words become the user's: no Rust type or struct names, no "as i128", the whole
    /// key path, and a 300-digit number cut.
    #[test]
    fn serde_words_become_the_users() {
        for (serde, want) in [
            (
                "invalid type: integer `1`, expected struct WarmStart",
                "`1`: expected a table ([section] or { key = … })",
            ),
            ("invalid type: map, expected a sequence", "a table: expected a list [ … ]"),
            (
                "invalid type: integer `18446744073709551616` as i128, expected u32",
                "`18446744073709551616`: expected a whole number from 0 to 4294967295",
            ),
            (
                "invalid type: string \"two\", expected usize",
                "the string \"two\": expected a whole number from 0 to 18446744073709551615",
            ),
            (
                "invalid type: floating point `1.5`, expected u64",
                "`1.5`: expected a whole number from 0 to 18446744073709551615",
            ),
            (
                "data did not match any variant of untagged enum Targets",
                "expected a list of module names or \"all-linear\"",
            ),
            ("unknown variant `fp8`, expected `f32` or `bf16`", "`fp8`: expected `f32` or `bf16`"),
            (
                "unknown field `sampels`, expected one of `samples`, `ranks`",
                "unknown key `sampels`; this table takes `samples`, `ranks`",
            ),
        ] {
            assert_eq!(user_words(serde), want, "{serde}");
        }
        let big = "7".repeat(300);
        assert_eq!(shorten_numbers(&format!("`{big}` and 12345")), "`777777777777… (300 digits)` and 12345");
        let text = "seeds = 2\n[deploy]\npolicy = [\"rloo\", \"rloo\"]\n[[estimator]]\nkind = \"sgd\"\nlr = 1\n[[estimator]]\nlr = { a = 1 }\n";
        assert_eq!(key_at(text, text.find("\"rloo\"").unwrap()).as_deref(), Some("deploy.policy"));
        assert_eq!(key_at(text, text.rfind("a = 1").unwrap()).as_deref(), Some("estimator[1].lr.a"));
        assert_eq!(key_at(text, text.find("lr = 1").unwrap()).as_deref(), Some("estimator[0].lr"));
        assert_eq!(key_at(text, 0).as_deref(), Some("seeds"));
    }

    /// A `--set` value that is not TOML is refused naming what is wrong with it, where it used
    /// to become a string (and a type error far from the argument); bare words stay strings.
    #[test]
    fn a_set_value_that_is_not_toml_is_refused() {
        let text = "seeds = 2\n[env]\ndim = 4\n";
        for (o, why) in [
            ("seeds=99999999999999999999", "not a TOML value"),
            ("seeds=1 ", "spaces around the value"),
            ("env.dim=64 # comment", "a comment"),
            ("env.dim=[1, 2", "not a TOML value"),
        ] {
            let (key, msg) = apply_overrides(text, &[o.to_string()]).unwrap_err();
            assert_eq!(key, override_key(o), "{o}");
            assert!(msg.contains(why) && msg.contains(o.split_once('=').unwrap().1), "{o}: {msg}");
        }
        for (o, want) in [
            ("deploy.policy=rloo", "policy = \"rloo\""),
            ("env.dim=64", "dim = 64"),
            ("seeds=[1, 2]", "seeds = [1, 2]"),
        ] {
            let out = apply_overrides(text, &[o.to_string()]).unwrap();
            assert!(out.contains(want), "{o}: {out}");
        }
    }
}
