//! A backbone (model + tokenizer + chat template) and the φ options: conversation → token ids
//! (template, EOS rule, truncation) → padded batches → hidden states at the last token (or the
//! mean over the response).

use crate::gguf::{meta_str, Gguf};
use crate::model::{mean_rows, resolve_layer, Config, HfConfig, Model};
use crate::template::{ChatTemplate, Message};
use crate::tokenizer::Tok;
use crate::Error;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// How the text ends (reference-code.md §1.2).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EosRule {
    /// The authors': strip trailing newlines, append `" " + eos` unless the text ends with
    /// eos, and after truncation force the last token to eos.
    Reference,
    /// The rendered template as is.
    Plain,
}

/// Which tokens go when a conversation exceeds `max_len`.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Truncation {
    /// Keep the first `max_len` tokens (the authors'): a long prompt can cut the response off.
    Right,
    /// Drop tokens from the start of the conversation, after its opening BOS, keeping the whole
    /// response (if the response alone is too long, its end is cut and the row is counted).
    PromptFirst,
}

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pool {
    /// The hidden state at the last token (the paper).
    Last,
    /// The mean over the response's tokens.
    Mean,
}

/// Everything that decides φ besides the model, the tokenizer, the template and the text.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PhiOptions {
    pub max_len: usize,
    pub eos_rule: EosRule,
    pub truncation: Truncation,
    /// Hugging Face's `hidden_states[layer]`; negative counts from the end (−1: final norm).
    pub layer: i64,
    pub pool: Pool,
}

impl Default for PhiOptions {
    fn default() -> Self {
        PhiOptions {
            max_len: 1024,
            eos_rule: EosRule::Reference,
            truncation: Truncation::PromptFirst,
            layer: -1,
            pool: Pool::Last,
        }
    }
}

/// A conversation made ready for the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    pub ids: Vec<u32>,
    /// [start, end) of the response's tokens in `ids`.
    pub response: (usize, usize),
    /// Tokens dropped by truncation.
    pub dropped: usize,
    /// The response itself lost tokens to truncation.
    pub response_cut: bool,
}

/// Model, tokenizer, template and the identity of the weights.
pub struct Backbone {
    pub model: Model,
    pub tok: Tok,
    pub template: ChatTemplate,
    /// blake3 over the weight files (GGUF: the file), so a safetensors download and a GGUF of
    /// the same model are never confused.
    pub weights_digest: String,
    pub source: String,
}

/// Where a model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Gguf(PathBuf),
    Dir(PathBuf),
    /// `hf:<owner>/<name>[@<revision>][:<file.gguf>]`, resolved through the hub cache at load.
    Hub(crate::hub::HubSpec),
}

impl Source {
    pub fn parse(s: &str) -> Result<Source, Error> {
        if let Some(repo) = s.strip_prefix("hf:") {
            return Ok(Source::Hub(crate::hub::HubSpec::parse(repo)?));
        }
        let p = PathBuf::from(s);
        if p.is_dir() {
            Ok(Source::Dir(p))
        } else if p.extension().is_some_and(|e| e == "gguf") {
            Ok(Source::Gguf(p))
        } else {
            Err(Error::Input(format!(
                "model `{s}`: expected a .gguf file, a directory with config.json, tokenizer.json and safetensors, or hf:<repo>"
            )))
        }
    }
}

fn file_digest(paths: &[PathBuf]) -> Result<String, Error> {
    let mut h = blake3::Hasher::new();
    for p in paths {
        let f = std::fs::File::open(p).map_err(|e| Error::Io(format!("{}: {e}", p.display())))?;
        h.update_reader(f).map_err(|e| Error::Io(format!("{}: {e}", p.display())))?;
    }
    Ok(h.finalize().to_hex().to_string())
}

fn read(p: &Path) -> Result<String, Error> {
    std::fs::read_to_string(p).map_err(|e| Error::Io(format!("{}: {e}", p.display())))
}

/// A special token in tokenizer_config.json: a string or an AddedToken dict.
/// A hub source resolved to its local directory or GGUF file (downloaded when missing).
fn resolve_hub(spec: &crate::hub::HubSpec) -> Result<Source, Error> {
    Ok(match crate::hub::resolve(spec, &crate::hub::HubEnv::from_env())? {
        crate::hub::Resolved::Dir(d) => Source::Dir(d),
        crate::hub::Resolved::Gguf(f) => Source::Gguf(f),
    })
}

/// The tokenizer and chat template a GGUF file carries in its metadata.
fn gguf_text(
    metadata: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
    path: &Path,
) -> Result<(Tok, ChatTemplate), Error> {
    let tok = Tok::from_gguf(metadata)?;
    let tmpl = meta_str(metadata, "tokenizer.chat_template")
        .ok_or_else(|| Error::Template(format!("{}: no `tokenizer.chat_template` in the metadata", path.display())))?;
    let template = ChatTemplate::new(
        tmpl,
        &format!("{} tokenizer.chat_template", path.display()),
        tok.bos.as_ref().map(|b| b.0.as_str()),
        tok.eos.as_ref().map(|b| b.0.as_str()),
    )?;
    Ok((tok, template))
}

/// A model directory's config (as written and as read), tokenizer and chat template.
fn dir_text(dir: &Path) -> Result<(HfConfig, Config, Tok, ChatTemplate), Error> {
    let cfg_text = read(&dir.join("config.json"))?;
    let hf: HfConfig = serde_json::from_str(&cfg_text)
        .map_err(|e| Error::Format(format!("{}: {e}", dir.join("config.json").display())))?;
    let cfg = Config::from_hf(&hf)?;
    let tc_path = dir.join("tokenizer_config.json");
    let tc: serde_json::Value =
        serde_json::from_str(&read(&tc_path)?).map_err(|e| Error::Format(format!("{}: {e}", tc_path.display())))?;
    let (bos, eos) = (special(tc.get("bos_token")), special(tc.get("eos_token")));
    let tok_path = dir.join("tokenizer.json");
    let tok = Tok::from_json(&read(&tok_path)?, &tok_path, bos.as_deref(), eos.as_deref())?;
    let tmpl = match tc.get("chat_template") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(String::from))
            .ok_or_else(|| Error::Template(format!("{}: no `default` chat template", tc_path.display())))?,
        _ => match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(s) => s,
            Err(_) => {
                return Err(Error::Template(format!(
                    "{}: no `chat_template` (and no chat_template.jinja beside it)",
                    tc_path.display()
                )))
            }
        },
    };
    let template =
        ChatTemplate::new(&tmpl, &format!("{} chat_template", tc_path.display()), bos.as_deref(), eos.as_deref())?;
    Ok((hf, cfg, tok, template))
}

fn special(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

impl Backbone {
    pub fn load(source: &Source, device: &Device, dtype: DType, max_len: usize) -> Result<Backbone, Error> {
        Backbone::load_with(source, device, dtype, max_len, false)
    }

    /// As [`Backbone::load`]; with `lm_head`, also the LM head, so the model can generate
    /// ([`crate::generate`]).
    pub fn load_with(
        source: &Source,
        device: &Device,
        dtype: DType,
        max_len: usize,
        lm_head: bool,
    ) -> Result<Backbone, Error> {
        match source {
            Source::Hub(spec) => {
                let mut b = Backbone::load_with(&resolve_hub(spec)?, device, dtype, max_len, lm_head)?;
                b.source = spec.display();
                Ok(b)
            }
            Source::Gguf(path) => {
                let g = Gguf::read_with(path, device, dtype, lm_head)?;
                let tied = !g.tensors.contains_key("lm_head.weight");
                let (tok, template) = gguf_text(&g.metadata, path)?;
                let vb = VarBuilder::from_tensors(g.tensors, dtype, device);
                let model = Model::load_with(vb, g.cfg, max_len, lm_head.then_some(tied))?;
                Ok(Backbone {
                    model,
                    tok,
                    template,
                    weights_digest: file_digest(std::slice::from_ref(path))?,
                    source: path.display().to_string(),
                })
            }
            Source::Dir(dir) => {
                let (hf, cfg, tok, template) = dir_text(dir)?;
                let files = safetensors_files(dir)?;
                // SAFETY: the weight files are memory-mapped read-only; onepass never writes them.
                let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device) }
                    .map_err(|e| Error::Weights(format!("{}: {e}", dir.display())))?;
                let model = Model::load_with(vb, cfg, max_len, lm_head.then_some(hf.tie_word_embeddings))?;
                Ok(Backbone {
                    model,
                    tok,
                    template,
                    weights_digest: file_digest(&files)?,
                    source: dir.display().to_string(),
                })
            }
        }
    }

    /// A policy's weights read once: the backbone (with its LM head, in `dtype`, for generation
    /// and templating) and the same weights as f32 tensors under Hugging Face names (what a
    /// trainer puts adapters on and merges them into), with whether the LM head is tied.
    pub fn load_base(
        source: &Source,
        device: &Device,
        dtype: DType,
        max_len: usize,
    ) -> Result<(Backbone, std::collections::HashMap<String, Tensor>, bool), Error> {
        let (base, cfg, tied, tok, template, files, name) = match source {
            Source::Hub(spec) => {
                let (mut b, base, tied) = Backbone::load_base(&resolve_hub(spec)?, device, dtype, max_len)?;
                b.source = spec.display();
                return Ok((b, base, tied));
            }
            Source::Gguf(path) => {
                let g = Gguf::read_with(path, device, DType::F32, true)?;
                let tied = !g.tensors.contains_key("lm_head.weight");
                let (tok, template) = gguf_text(&g.metadata, path)?;
                (g.tensors, g.cfg, tied, tok, template, vec![path.clone()], path.display().to_string())
            }
            Source::Dir(dir) => {
                let (hf, cfg, tok, template) = dir_text(dir)?;
                let files = safetensors_files(dir)?;
                let mut base = std::collections::HashMap::new();
                for f in &files {
                    let ts = candle_core::safetensors::load(f, device)
                        .map_err(|e| Error::Weights(format!("{}: {e}", f.display())))?;
                    for (k, v) in ts {
                        base.insert(k, v.to_dtype(DType::F32)?);
                    }
                }
                (base, cfg, hf.tie_word_embeddings, tok, template, files, dir.display().to_string())
            }
        };
        // The backbone shares the f32 tensors (candle tensors are reference-counted); only fused
        // or packed layers are copies.
        let vb = VarBuilder::from_tensors(base.clone(), dtype, device);
        let model = Model::load_with(vb, cfg, max_len, Some(tied))?;
        let b = Backbone { model, tok, template, weights_digest: file_digest(&files)?, source: name };
        Ok((b, base, tied))
    }

    pub fn dim(&self) -> usize {
        self.model.cfg.hidden
    }

    fn eos(&self) -> Result<&(String, u32), Error> {
        self.tok
            .eos
            .as_ref()
            .ok_or_else(|| Error::Input("the EOS rule `reference` needs an EOS token; the tokenizer names none".into()))
    }

    /// Template, EOS rule and truncation for one conversation whose last message is the response.
    pub fn prepare(&self, messages: &[Message], opts: &PhiOptions) -> Result<Prepared, Error> {
        let Some((last, prompt)) = messages.split_last() else {
            return Err(Error::Input("an empty conversation: expected at least the response message".into()));
        };
        if last.content.trim().is_empty() && prompt.iter().all(|m| m.content.trim().is_empty()) {
            return Err(Error::Input("an empty text: every message of the conversation is blank".into()));
        }
        let mut text = self.template.render(messages, false)?;
        if opts.eos_rule == EosRule::Reference {
            let eos = &self.eos()?.0;
            text = text.trim_end_matches('\n').to_string();
            if !text.ends_with(eos.as_str()) {
                text.push(' ');
                text.push_str(eos);
            }
        }
        let mut ids = self.tok.encode(&text)?;
        if ids.is_empty() {
            return Err(Error::Input("the conversation tokenizes to nothing".into()));
        }
        if let Some((_, bos)) = &self.tok.bos {
            if ids.len() >= 2 && ids[0] == *bos && ids[1] == *bos {
                return Err(Error::Input(format!(
                    "the rendered conversation starts with two BOS tokens ({}): the template and the tokenizer both added one",
                    self.template.origin
                )));
            }
        }
        let prefix = self.tok.encode(&self.template.render(prompt, true)?)?;
        let mut start = ids.iter().zip(&prefix).take_while(|(a, b)| a == b).count().min(ids.len() - 1);
        let (mut dropped, mut response_cut) = (0, false);
        if ids.len() > opts.max_len {
            dropped = ids.len() - opts.max_len;
            match opts.truncation {
                Truncation::Right => {
                    ids.truncate(opts.max_len);
                    response_cut = true;
                    start = start.min(ids.len() - 1);
                }
                Truncation::PromptFirst => {
                    let opening = self.content_start(messages, &ids)?.min(start);
                    let prompt_room = start.saturating_sub(opening);
                    let cut = dropped.min(prompt_room);
                    ids.drain(opening..opening + cut);
                    start -= cut;
                    if ids.len() > opts.max_len {
                        ids.truncate(opts.max_len);
                        response_cut = true;
                    }
                    start = start.min(ids.len() - 1);
                }
            }
            if opts.eos_rule == EosRule::Reference {
                let eos = self.eos()?.1;
                *ids.last_mut().expect("non-empty") = eos;
            }
        }
        let end = ids.len();
        Ok(Prepared { ids, response: (start, end), dropped, response_cut })
    }

    /// Where the first message's content begins in `ids` (the rendering of `messages`): the
    /// tokens before it — a BOS, a system prompt the template adds, the first role header — are
    /// what prompt-first truncation keeps. Found as the tokens `ids` shares with the rendering
    /// whose first message is emptied (at least the opening BOS).
    fn content_start(&self, messages: &[Message], ids: &[u32]) -> Result<usize, Error> {
        let bos = usize::from(self.tok.bos.as_ref().is_some_and(|(_, b)| ids.first() == Some(b)));
        let mut emptied = messages.to_vec();
        emptied[0].content.clear();
        // a template that refuses an empty message keeps the old rule: only the BOS stays
        let Ok(text) = self.template.render(&emptied, false) else { return Ok(bos) };
        let head = self.tok.encode(&text)?;
        Ok(ids.iter().zip(&head).take_while(|(a, b)| a == b).count().max(bos))
    }

    /// φ of prepared conversations, in order, `batch` at a time (right-padded; each row read at
    /// its own length, never by searching for a pad id).
    pub fn features(&self, items: &[&Prepared], opts: &PhiOptions) -> Result<Vec<Vec<f32>>, Error> {
        let layer = resolve_layer(opts.layer, self.model.cfg.layers)?;
        let t = items.iter().map(|p| p.ids.len()).max().unwrap_or(0);
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let pad = self.tok.eos.as_ref().map_or(0, |e| e.1);
        let mut ids = Vec::with_capacity(items.len() * t);
        for p in items {
            ids.extend_from_slice(&p.ids);
            ids.extend(std::iter::repeat_n(pad, t - p.ids.len()));
        }
        let ids = Tensor::from_vec(ids, (items.len(), t), self.model.device())?;
        let rows = match opts.pool {
            Pool::Last => {
                self.model.hidden_at(&ids, layer, &items.iter().map(|p| p.ids.len() - 1).collect::<Vec<_>>())?
            }
            Pool::Mean => mean_rows(
                &self.model.hidden_states(&ids, layer)?,
                &items.iter().map(|p| p.response).collect::<Vec<_>>(),
            )?,
        };
        Ok(rows.to_dtype(DType::F32)?.to_vec2()?)
    }
}

/// What one cached extraction did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExtractStats {
    pub rows: usize,
    pub hits: usize,
    pub misses: usize,
    /// Tokens run through the model (misses only) and the seconds it took.
    pub tokens: usize,
    pub forward_s: f64,
}

impl Backbone {
    /// The cache space of this backbone under `opts` and `dtype`: weights, tokenizer, template
    /// and φ options.
    pub fn space(&self, opts: &PhiOptions) -> (String, serde_json::Value) {
        let o = serde_json::to_string(opts).expect("options serialise");
        let dtype = format!("{:?}", self.model.dtype());
        let mut parts = vec![
            ("weights", self.weights_digest.as_str()),
            ("tokenizer", self.tok.digest.as_str()),
            ("template", self.template.source.as_str()),
            ("options", o.as_str()),
            ("dtype", dtype.as_str()),
        ];
        // prompt-first truncation changed what it keeps (the role header since v2): φ cached by
        // the old rule is not reused
        if opts.truncation == Truncation::PromptFirst {
            parts.push(("prompt_first", "v2: keeps the template's opening and the first role header"));
        }
        // bf16 on the CPU changed meaning (bf16 weights, f32 activations, `kernels::bf16`): φ
        // computed by candle's all-bf16 composition before is not reused
        if self.model.dtype() == DType::BF16 && self.model.device().is_cpu() {
            parts.push(("bf16_cpu", "v2: bf16 weights and products, f32 activations"));
            // AMX rounds its dot products unlike VDPBF16PS and the other kernels (`kernels::amx`):
            // its φ is kept apart from theirs
            if kernels::bf16::Kernel::detect() == kernels::bf16::Kernel::Amx {
                parts.push(("bf16_kernel", "amx"));
            }
        }
        // f32 on the CPU moved from candle's matmul to packed kernels with one FMA sequence per
        // output (`kernels::f32mm`): φ rounds differently, so it is not mixed with φ cached before
        if self.model.f32_packed() {
            parts.push(("f32_cpu", "v2: packed products, one FMA sequence per output on every CPU"));
        }
        let describe = serde_json::json!({
            "source": self.source, "weights_blake3": self.weights_digest, "tokenizer_blake3": self.tok.digest,
            "options": opts, "dtype": dtype, "dim": self.dim(),
        });
        (crate::cache::space_key(&parts), describe)
    }

    /// φ of every item of `shard`, from `cache` where present, the rest computed and written to
    /// the cache. The batch plan is global: the distinct conversations of *all* items, sorted by
    /// length (so a padded batch wastes little) and cut into batches of `batch`; shard i of N
    /// owns batches i, i + N, i + 2N, … So which rows share a padded batch never depends on the
    /// sharding or on what is cached, and a sharded extraction gives the same bytes as one
    /// process. A batch with any row missing from the cache is run whole. Rows outside the shard
    /// come back as `None`. `progress(done_rows, tokens)` is called after every batch.
    pub fn features_cached(
        &self,
        cache: &mut crate::cache::FeatureCache,
        keys: &[crate::cache::Key],
        items: &[Prepared],
        opts: &PhiOptions,
        schedule: Schedule,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(ShardRows, ExtractStats), Error> {
        let Schedule { batch, shard } = schedule;
        let plan = batch_plan(keys, items, batch);
        let mut stats = ExtractStats::default();
        // key → φ of the rows this shard owns
        let mut got: std::collections::HashMap<crate::cache::Key, Vec<f32>> = std::collections::HashMap::new();
        let mut from_cache = std::collections::HashSet::new();
        let mut done = 0;
        let (mut pend_k, mut pend_v) = (Vec::new(), Vec::new());
        for chunk in plan.iter().skip(shard.index).step_by(shard.count) {
            let cached: Vec<Option<Vec<f32>>> = chunk.iter().map(|&i| cache.get(&keys[i])).collect();
            for (&i, c) in chunk.iter().zip(&cached) {
                if c.is_some() {
                    from_cache.insert(keys[i]);
                }
            }
            if cached.iter().all(Option::is_some) {
                for (&i, v) in chunk.iter().zip(cached) {
                    got.insert(keys[i], v.expect("checked"));
                }
            } else {
                let t0 = std::time::Instant::now();
                let refs: Vec<&Prepared> = chunk.iter().map(|&i| &items[i]).collect();
                let rows = self.features(&refs, opts)?;
                stats.forward_s += t0.elapsed().as_secs_f64();
                stats.tokens += refs.iter().map(|p| p.ids.len()).sum::<usize>();
                for ((&i, r), c) in chunk.iter().zip(rows).zip(cached) {
                    match c {
                        Some(v) => {
                            got.insert(keys[i], v);
                        }
                        None => {
                            stats.misses += 1;
                            pend_k.push(keys[i]);
                            pend_v.push(r.clone());
                            got.insert(keys[i], r);
                        }
                    }
                }
            }
            if pend_k.len() >= 1024 {
                cache.put(&pend_k, &pend_v)?;
                pend_k.clear();
                pend_v.clear();
            }
            done += chunk.len();
            progress(done, stats.tokens);
        }
        cache.put(&pend_k, &pend_v)?;
        let out: Vec<Option<Vec<f32>>> = keys.iter().map(|k| got.get(k).cloned()).collect();
        stats.rows = out.iter().filter(|o| o.is_some()).count();
        stats.hits = keys.iter().filter(|k| from_cache.contains(*k)).count();
        Ok((out, stats))
    }
}

/// φ per item: `None` for the items of other shards.
pub type ShardRows = Vec<Option<Vec<f32>>>;

/// Batch size and shard of a cached extraction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub batch: usize,
    pub shard: ShardSpec,
}

/// Which part of an extraction one process runs: batches `index`, `index + count`, … of the
/// global plan. `ShardSpec::ALL` is the whole extraction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    pub index: usize,
    pub count: usize,
}

impl ShardSpec {
    pub const ALL: ShardSpec = ShardSpec { index: 0, count: 1 };

    /// `i/N` with 0 ≤ i < N (SLURM's `$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT` for an
    /// array 0..N−1).
    pub fn parse(s: &str) -> Result<ShardSpec, Error> {
        let bad = || Error::Input(format!("shard `{s}`: expected i/N with 0 <= i < N, e.g. 0/4"));
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count): (usize, usize) =
            (i.trim().parse().map_err(|_| bad())?, n.trim().parse().map_err(|_| bad())?);
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(ShardSpec { index, count })
    }
}

/// The global batch plan: indices of the first item of every distinct key, sorted by (length,
/// index), in batches of `batch`.
pub fn batch_plan(keys: &[crate::cache::Key], items: &[Prepared], batch: usize) -> Vec<Vec<usize>> {
    let mut seen = std::collections::HashSet::new();
    let mut firsts: Vec<usize> = (0..keys.len()).filter(|&i| seen.insert(keys[i])).collect();
    firsts.sort_by_key(|&i| (items[i].ids.len(), i));
    firsts.chunks(batch.max(1)).map(<[usize]>::to_vec).collect()
}

/// The safetensors files of a model directory: the shards named by
/// `model.safetensors.index.json`, else `model.safetensors`.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v: serde_json::Value =
            serde_json::from_str(&read(&index)?).map_err(|e| Error::Format(format!("{}: {e}", index.display())))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Format(format!("{}: no `weight_map` object", index.display())))?;
        let mut files: Vec<String> = map.values().filter_map(|f| f.as_str().map(String::from)).collect();
        files.sort();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(Error::Weights(format!("{}: no model.safetensors or model.safetensors.index.json", dir.display())))
}
