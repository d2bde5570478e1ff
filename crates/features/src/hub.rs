//! `hf:<owner>/<name>[@<revision>][:<file.gguf>]` model sources, through hf-hub's blocking client
//! and its cache (the same layout as Python's `huggingface_hub`, so models downloaded by either
//! are shared).
//!
//! Environment, as `huggingface_hub` reads it: `HF_HOME` (cache under `$HF_HOME/hub`, token at
//! `$HF_HOME/token`; default `~/.cache/huggingface`), `HF_ENDPOINT`, `HF_TOKEN` (wins over the
//! token file), `HF_HUB_OFFLINE=1` (never touch the network: the files must be in the cache).

use crate::Error;
use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use std::path::PathBuf;

/// A parsed `hf:` source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubSpec {
    pub repo: String,
    pub revision: String,
    /// A single GGUF file of the repository; `None`: the safetensors layout.
    pub file: Option<String>,
}

impl HubSpec {
    /// Parses what follows `hf:`.
    pub fn parse(s: &str) -> Result<HubSpec, Error> {
        let bad = |why: &str| {
            Error::Input(format!(
                "model `hf:{s}`: {why}; expected hf:<owner>/<name>[@<revision>][:<file.gguf>], e.g. hf:HuggingFaceTB/SmolLM2-135M-Instruct"
            ))
        };
        let (rest, file) = match s.rsplit_once(':') {
            Some((r, f)) => {
                if !f.ends_with(".gguf") {
                    return Err(bad("only a .gguf file may follow `:`"));
                }
                (r, Some(f.to_string()))
            }
            None => (s, None),
        };
        let (repo, revision) = repo_revision(rest).map_err(bad)?;
        Ok(HubSpec { repo, revision, file })
    }

    pub fn display(&self) -> String {
        let mut s = format!("hf:{}@{}", self.repo, self.revision);
        if let Some(f) = &self.file {
            s.push(':');
            s.push_str(f);
        }
        s
    }
}

/// `<owner>/<name>[@<revision>]` → (repository, revision; default `main`), or what is wrong.
fn repo_revision(s: &str) -> Result<(String, String), &'static str> {
    let (repo, revision) = match s.split_once('@') {
        Some((r, v)) if !v.is_empty() => (r, v),
        Some(_) => return Err("an empty revision after `@`"),
        None => (s, "main"),
    };
    let parts: Vec<&str> = repo.split('/').collect();
    if parts.len() != 2 || parts.iter().any(|p| p.is_empty() || p.contains(char::is_whitespace)) {
        return Err("the repository must be <owner>/<name>");
    }
    Ok((repo.to_string(), revision.to_string()))
}

/// The hub settings of this process (see the module docs); tests build their own.
#[derive(Clone, Debug, Default)]
pub struct HubEnv {
    /// `$HF_HOME`; `None`: `~/.cache/huggingface`.
    pub home: Option<PathBuf>,
    pub endpoint: Option<String>,
    pub token: Option<String>,
    pub offline: bool,
    pub progress: bool,
}

impl HubEnv {
    pub fn from_env() -> HubEnv {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        HubEnv {
            home: var("HF_HOME").map(PathBuf::from),
            endpoint: var("HF_ENDPOINT"),
            token: var("HF_TOKEN"),
            offline: var("HF_HUB_OFFLINE")
                .is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")),
            progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        }
    }

    /// The blocking client over this cache, endpoint and token.
    fn api(&self, name: &str) -> Result<hf_hub::api::sync::Api, Error> {
        let mut b = ApiBuilder::from_cache(self.cache()).with_progress(self.progress);
        if let Some(e) = &self.endpoint {
            b = b.with_endpoint(e.clone());
        }
        if let Some(t) = &self.token {
            b = b.with_token(Some(t.clone()));
        }
        b.build().map_err(|e| Error::Io(format!("{name}: starting the hub client: {e}")))
    }

    fn cache(&self) -> Cache {
        match &self.home {
            Some(h) => Cache::new(h.join("hub")),
            None => Cache::from_env(),
        }
    }
}

/// Gets one file of the repository: `Ok(None)` when the hub says it does not exist.
type Fetch = Box<dyn Fn(&str) -> Result<Option<PathBuf>, Error>>;

/// Where the files of a resolved source are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolved {
    /// A snapshot directory with config.json, tokenizer files and safetensors.
    Dir(PathBuf),
    Gguf(PathBuf),
}

/// Downloads (or, offline, finds in the cache) what a model needs: the GGUF file, or config.json,
/// tokenizer.json, tokenizer_config.json, chat_template.jinja when the repository has one, and
/// the safetensors (every shard named by model.safetensors.index.json, else model.safetensors).
pub fn resolve(spec: &HubSpec, env: &HubEnv) -> Result<Resolved, Error> {
    let repo = Repo::with_revision(spec.repo.clone(), RepoType::Model, spec.revision.clone());
    let name = spec.display();
    let fetch = fetcher(&repo, &name, env)?;
    let need = |f: &str| -> Result<PathBuf, Error> {
        fetch(f)?.ok_or_else(|| Error::Io(format!("{name}: the repository has no `{f}` (HTTP 404)")))
    };
    if let Some(f) = &spec.file {
        return Ok(Resolved::Gguf(need(f)?));
    }
    let config = need("config.json")?;
    need("tokenizer.json")?;
    need("tokenizer_config.json")?;
    // optional: newer repositories keep the template beside tokenizer_config.json
    if !env.offline {
        fetch("chat_template.jinja")?;
    } else {
        let _ = fetch("chat_template.jinja");
    }
    match fetch("model.safetensors.index.json") {
        Ok(Some(index)) => {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::Io(format!("{}: {e}", index.display())))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::Format(format!("{}: {e}", index.display())))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::Format(format!("{}: no `weight_map` object", index.display())))?;
            let mut files: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
            files.sort();
            files.dedup();
            for f in files {
                need(f)?;
            }
        }
        Ok(None) | Err(_) => {
            need("model.safetensors")?;
        }
    }
    let dir = config.parent().map(PathBuf::from).unwrap_or_default();
    Ok(Resolved::Dir(dir))
}

/// Gets files of `repo` through the hub (or, offline, from the cache), with the error messages
/// of [`resolve`].
fn fetcher(repo: &Repo, name: &str, env: &HubEnv) -> Result<Fetch, Error> {
    let cache = env.cache();
    let name = name.to_string();
    let fetch: Fetch = if env.offline {
        let cached = cache.repo(repo.clone());
        let name = name.clone();
        let root = cache.path().clone();
        Box::new(move |f: &str| {
            match cached.get(f) {
            Some(p) => Ok(Some(p)),
            None => Err(Error::Io(format!(
                "{name}: `{f}` is not in the Hugging Face cache {} and HF_HUB_OFFLINE is set: download it once with network access (or unset HF_HUB_OFFLINE)",
                root.display()
            ))),
        }
        })
    } else {
        let api = env.api(&name)?;
        let api_repo = api.repo(repo.clone());
        let name = name.clone();
        let has_token = env.token.is_some() || cache.token().is_some();
        Box::new(move |f: &str| {
            match api_repo.get(f) {
            Ok(p) => Ok(Some(p)),
            Err(e) => match status(&e) {
                Some(404) => Ok(None),
                Some(401) | Some(403) => Err(Error::Io(format!(
                    "{name}: the hub refused `{f}` (HTTP {}): the repository is gated or private. Accept its licence on its Hugging Face page, then {}",
                    status(&e).unwrap_or(0),
                    if has_token {
                        "check that your token (HF_TOKEN or $HF_HOME/token) belongs to that account and may read gated repositories"
                    } else {
                        "set HF_TOKEN (or run `huggingface-cli login`): no token was found"
                    }
                ))),
                _ => Err(Error::Io(format!(
                    "{name}: downloading `{f}` failed: {e}. Without network access set HF_HUB_OFFLINE=1 to use the cache, or give a local directory or .gguf file"
                ))),
            },
        }
        })
    };
    Ok(fetch)
}

/// A file (or `*` pattern) of a Hugging Face dataset repository:
/// `hf:datasets/<owner>/<name>[@<revision>]:<path>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubDataset {
    pub repo: String,
    pub revision: String,
    pub file: String,
}

impl HubDataset {
    /// Parses what follows `hf:datasets/`.
    pub fn parse(s: &str) -> Result<HubDataset, Error> {
        let bad = |why: &str| {
            Error::Input(format!(
                "dataset `hf:datasets/{s}`: {why}; expected hf:datasets/<owner>/<name>[@<revision>]:<file or pattern>, e.g. hf:datasets/HuggingFaceH4/ultrafeedback_binarized:data/train_prefs-*.parquet"
            ))
        };
        let (rest, file) = s.split_once(':').ok_or_else(|| bad("no `:<file>`"))?;
        if file.is_empty() {
            return Err(bad("an empty file after `:`"));
        }
        let (repo, revision) = repo_revision(rest).map_err(bad)?;
        Ok(HubDataset { repo, revision, file: file.to_string() })
    }

    pub fn display(&self) -> String {
        format!("hf:datasets/{}@{}:{}", self.repo, self.revision, self.file)
    }
}

/// `*` matches any run of characters (also `/`); everything else matches itself.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if name.len() < first.len() + last.len() || !name.starts_with(first) || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    true
}

/// Downloads (or, offline, finds in the cache) the dataset files `spec` names, sorted by name.
/// A pattern is matched against the repository's file list (online) or the cached snapshot.
pub fn dataset_files(spec: &HubDataset, env: &HubEnv) -> Result<Vec<PathBuf>, Error> {
    let repo = Repo::with_revision(spec.repo.clone(), RepoType::Dataset, spec.revision.clone());
    let name = spec.display();
    let names: Vec<String> = if !spec.file.contains('*') {
        vec![spec.file.clone()]
    } else if env.offline {
        let refs = env.cache().path().join(repo.folder_name()).join("refs").join(&spec.revision);
        let commit = std::fs::read_to_string(&refs).unwrap_or_else(|_| spec.revision.clone());
        let snap = env.cache().path().join(repo.folder_name()).join("snapshots").join(commit.trim());
        let mut found = Vec::new();
        let mut stack = vec![snap.clone()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if let Ok(rel) = p.strip_prefix(&snap) {
                    found.push(rel.to_string_lossy().replace('\\', "/"));
                }
            }
        }
        found.retain(|f| glob_match(&spec.file, f));
        found
    } else {
        let api = env.api(&name)?;
        let info = api.repo(repo.clone()).info().map_err(|e| {
            Error::Io(format!(
                "{name}: listing the repository failed: {e}. Without network access set HF_HUB_OFFLINE=1 to use the cache, or give a local path"
            ))
        })?;
        info.siblings.into_iter().map(|s| s.rfilename).filter(|f| glob_match(&spec.file, f)).collect()
    };
    if names.is_empty() {
        return Err(Error::Io(format!(
            "{name}: no file of the repository matches `{}`{}",
            spec.file,
            if env.offline { " in the Hugging Face cache (HF_HUB_OFFLINE is set)" } else { "" }
        )));
    }
    let fetch = fetcher(&repo, &name, env)?;
    let mut names = names;
    names.sort();
    names
        .iter()
        .map(|f| fetch(f)?.ok_or_else(|| Error::Io(format!("{name}: the repository has no `{f}` (HTTP 404)"))))
        .collect()
}

/// The HTTP status of a failed request, when there was one.
fn status(e: &ApiError) -> Option<u16> {
    match e {
        ApiError::RequestError(r) => match r.as_ref() {
            ureq::Error::Status(code, _) => Some(*code),
            _ => None,
        },
        ApiError::TooManyRetries(inner) => status(inner),
        _ => None,
    }
}
