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
            (Some(s), _) => write!(f, "--set {s} (over {})", self.file.display())?,
            (None, Some(l)) => write!(f, "{}:{l}", self.file.display())?,
            (None, None) => write!(f, "{}", self.file.display())?,
        }
        if !self.key.is_empty() {
            write!(f, ": `{}`", self.key)?;
        }
        write!(f, ": {}", self.message)
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
        let key = at
            .and_then(|l| l.split_once('='))
            .map(|(k, _)| k.trim())
            .or(header.map(str::trim))
            .filter(|k| !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || "_-.\"".contains(c)))
            .unwrap_or("");
        let mut e = err(key, line, e.message().trim().to_string());
        // an error on a line that a `--set` wrote cites the argument (its line is not the file's)
        if let Some(o) = line.and_then(|l| override_at(&text, overrides, l)) {
            e.key = override_key(o).to_string();
            (e.set, e.line) = (Some(o.clone()), None);
        }
        e
    })?;
    Ok((spec, text))
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
