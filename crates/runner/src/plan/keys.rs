//! Errors that name the spec file, the dotted key and its line (or the `--set` that wrote it).

use crate::spec::*;
use std::path::Path;

/// Builds errors that name the spec file, the dotted key and its line.
#[derive(Clone, Copy)]
pub struct Locator<'a> {
    pub file: &'a Path,
    pub text: &'a str,
    /// The `--set key=value` arguments (errors about their keys cite them).
    pub overrides: &'a [String],
}

impl Locator<'_> {
    /// An error at `path` (e.g. ["estimator", "1", "lr"] → `estimator[1].lr`).
    pub fn err(&self, path: &[&str], message: String) -> SpecError {
        let p: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        let key = path
            .iter()
            .enumerate()
            .map(|(i, s)| match (i, s.parse::<usize>().is_ok()) {
                (0, _) => s.to_string(),
                (_, true) => format!("[{s}]"),
                (_, false) => format!(".{s}"),
            })
            .collect::<String>();
        let line = locate(self.text, &p);
        // an error about a key a `--set` wrote cites that argument: the last of its key, the
        // one in force
        let set = self.overrides.iter().rev().find(|o| {
            let segs: Vec<&str> = override_key(o).split('.').collect();
            !segs.is_empty() && (path.starts_with(&segs) || (segs.starts_with(path) && !path.is_empty()))
        });
        match set {
            Some(o) => SpecError { file: self.file.to_path_buf(), key, line: None, message, set: Some(o.clone()) },
            None => SpecError { file: self.file.to_path_buf(), key, line, message, set: None },
        }
    }

    /// An error `why` at the first of the `env.<names>` that the spec writes.
    pub fn env_keys_refused(&self, names: &[&str], why: &str) -> Result<(), SpecError> {
        match names.iter().find(|k| self.written(&["env", k])) {
            Some(k) => Err(self.err(&["env", k], why.into())),
            None => Ok(()),
        }
    }

    /// Whether the key at `path` of plain tables is written in the spec.
    pub fn written(&self, path: &[&str]) -> bool {
        is_written(self.text, path)
    }
}
