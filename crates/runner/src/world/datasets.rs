//! Preference datasets as (chosen, rejected) conversations.
//!
//! Every file is read row by row into a JSON value (jsonl lines as they are; parquet rows through
//! [`arrow_cell`], only the columns a format names), then a format maps the row to a [`Pair`]:
//! - `hh-rlhf`: `chosen`/`rejected` strings, "\n\nHuman: … \n\nAssistant: …" transcripts;
//! - `ultrafeedback`: `chosen`/`rejected` message lists (the whole conversation, ending with the
//!   assistant), optional `score_chosen`/`score_rejected` (HuggingFaceH4/ultrafeedback_binarized);
//! - `mixture2`: `chosen`/`rejected` message lists (OpenRLHF/preference_dataset_mixture2_and_safe_pku);
//! - `generic`: key names from [`Keys`]; the prompt (optional) is a string or a message list, the
//!   sides are response strings or message lists.
//!
//! Errors name the file, the row and the field. A malformed row is an error, or, with
//! `skip_malformed`, skipped and counted (the first few reasons are kept for the run's report).

pub use super::arrow::arrow_cell;
pub use crate::spec::data::{LabelForm, PairRule};
pub use crate::spec::{Format, Keys};
use anyhow::{anyhow, bail, Context, Result};
use arrow_array::{Array, RecordBatch};
use features::Message;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

/// One preference pair: two conversations whose last message is the response.
#[derive(Clone, Debug, PartialEq)]
pub struct Pair {
    /// Row index over the files read, in order (0-based).
    pub row: usize,
    /// Where the row is, for messages, numbered as every data-file message is (1-based): the
    /// file and a jsonl file's line or a parquet file's row ("d.jsonl: line 4").
    pub at: std::sync::Arc<str>,
    pub chosen: Vec<Message>,
    pub rejected: Vec<Message>,
    /// (score_chosen, score_rejected) when the file has them (UltraFeedback).
    pub scores: Option<(f64, f64)>,
    /// The label form's tie: neither side won (label y = ½).
    pub tie: bool,
    /// A preference strength's soft label that `chosen` wins (in [½, 1]).
    pub soft: Option<f32>,
}

impl Pair {
    /// The two sides have the same score, or a label said tie: the "chosen" side is an
    /// arbitrary pick.
    pub fn score_tie(&self) -> bool {
        self.tie || self.scores.is_some_and(|(c, r)| c == r)
    }

    /// The Bradley–Terry label of z = φ(chosen) − φ(rejected): 1, or ½ for a label-form tie.
    pub fn y(&self) -> f32 {
        if self.tie {
            0.5
        } else {
            self.soft.unwrap_or(1.0)
        }
    }
}

/// Whether a JSON value equals a mapped TOML label value (after JSON typing: a string only
/// equals a string, a number a number of the same value, a boolean a boolean). Integers compare
/// exactly (2^53 + 1 is not 2^53, as it would be through f64); an integer equals a float only
/// when the float is that integer exactly.
fn label_is(v: &Value, t: &toml::Value) -> bool {
    match (v, t) {
        (Value::String(a), toml::Value::String(b)) => a == b,
        (Value::Bool(a), toml::Value::Boolean(b)) => a == b,
        (Value::Number(a), toml::Value::Integer(b)) => match (a.as_i64(), a.as_u64(), a.as_f64()) {
            (Some(x), _, _) => x == *b,
            (None, Some(_), _) => false, // above i64::MAX: no TOML integer
            (None, None, Some(f)) => crate::spec::data::float_is_int(f, *b),
            _ => false,
        },
        (Value::Number(a), toml::Value::Float(b)) => match a.as_i64() {
            Some(x) => crate::spec::data::float_is_int(*b, x),
            None => a.as_u64().is_none() && a.as_f64() == Some(*b),
        },
        _ => false,
    }
}

/// How to read a dataset.
#[derive(Clone, Debug, Default)]
pub struct ReadOptions {
    pub format: Option<Format>,
    pub keys: Keys,
    /// Stop after this many pairs.
    pub limit: Option<usize>,
    pub skip_malformed: bool,
}

/// What a read returned.
#[derive(Clone, Debug, Default)]
pub struct ReadOut {
    pub pairs: Vec<Pair>,
    /// Rows looked at (kept + skipped).
    pub rows_read: usize,
    pub skipped: usize,
    /// The first reasons for skipping (file, row, field, what was wrong).
    pub skipped_examples: Vec<String>,
}

/// The first `limit` pairs of `path` (all when None); any malformed row is an error.
pub fn read_pairs(path: &Path, format: Format, limit: Option<usize>) -> Result<Vec<Pair>> {
    let o = ReadOptions { format: Some(format), limit, ..Default::default() };
    Ok(read_dataset(&[path.to_path_buf()], &o)?.pairs)
}

/// Reads `files` in order as one dataset.
pub fn read_dataset(files: &[PathBuf], o: &ReadOptions) -> Result<ReadOut> {
    let mut out = ReadOut::default();
    for path in files {
        let name = path.to_string_lossy();
        let format = match o.format.unwrap_or(Format::Auto) {
            Format::Auto if name.ends_with(".parquet") => Format::Ultrafeedback,
            Format::Auto if is_jsonl(&name) => Format::HhRlhf,
            Format::Auto => bail!("{name}: cannot tell the format from the name; give the format"),
            f => f,
        };
        let keys = keys_of(format, &o.keys);
        let form = keys.label_form().map_err(|(k, m)| anyhow!("{name}: data.keys.{k}: {m}"))?;
        let mut visit = |row_in_file: usize, v: Result<Value, String>| -> Result<bool> {
            if o.limit.is_some_and(|l| out.pairs.len() >= l) {
                return Ok(false);
            }
            let row = out.rows_read;
            out.rows_read += 1;
            match v.and_then(|v| to_pairs(&v, format, &keys, form, row)) {
                Ok(ps) => {
                    let at: std::sync::Arc<str> = format!("{name}: {}", place(&name, row_in_file)).into();
                    out.pairs.extend(ps.into_iter().map(|p| Pair { at: at.clone(), ..p }))
                }
                Err(why) => {
                    let why = if format == Format::Generic { with_user_key(&why, &keys) } else { why };
                    let msg = format!("{name}: {}{why}", place(&name, row_in_file));
                    if !o.skip_malformed {
                        bail!("{msg}");
                    }
                    out.skipped += 1;
                    if out.skipped_examples.len() < 10 {
                        out.skipped_examples.push(msg);
                    }
                }
            }
            Ok(true)
        };
        if name.ends_with(".parquet") {
            parquet_rows(path, &columns_of(format, &keys, form), &mut visit)?;
        } else if is_jsonl(&name) {
            jsonl_rows(path, &mut visit)?;
        } else {
            bail!("{name}: expected a .jsonl, .jsonl.gz or .parquet file");
        }
    }
    Ok(out)
}

/// Where a row is, 1-based: a jsonl file's line (blank lines counted, as an editor does), a
/// parquet file's row.
fn place(name: &str, row: usize) -> String {
    if name.ends_with(".parquet") {
        format!("row {}", row + 1)
    } else {
        format!("line {}", row + 1)
    }
}

/// A generic row's error ", field `good`: …" with the `[data.keys]` entry that names the field
/// (", field `good` (data.keys.chosen): …"): the user wrote the key, not the field.
fn with_user_key(why: &str, k: &Keys) -> String {
    let Some(rest) = why.strip_prefix(", field `") else { return why.to_string() };
    let Some((field, tail)) = rest.split_once('`') else { return why.to_string() };
    let base = field.split(['[', '.']).next().unwrap_or(field);
    let named: [(&str, Option<&String>); 10] = [
        ("prompt", k.prompt.as_ref()),
        ("chosen", Some(&k.chosen)),
        ("rejected", Some(&k.rejected)),
        ("score_chosen", k.score_chosen.as_ref()),
        ("score_rejected", k.score_rejected.as_ref()),
        ("side_a", k.side_a.as_ref()),
        ("side_b", k.side_b.as_ref()),
        ("label", k.label.as_ref()),
        ("strength", k.strength.as_ref()),
        ("responses", k.responses.as_ref()),
    ];
    match named.iter().find(|(_, v)| v.is_some_and(|v| v == base)) {
        Some((name, _)) => format!(", field `{field}` (data.keys.{name}){tail}"),
        None => why.to_string(),
    }
}

/// A JSON row as a value, with a key written twice in one object refused (serde_json keeps the
/// last silently: a row `{"chosen": "a", "chosen": "b"}` would be read as "b").
fn json_row(bytes: &[u8]) -> Result<Value, String> {
    struct Strict;
    impl<'de> serde::de::DeserializeSeed<'de> for Strict {
        type Value = Value;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
            d.deserialize_any(Strict)
        }
    }
    impl<'de> serde::de::Visitor<'de> for Strict {
        type Value = Value;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
            Ok(Value::Bool(v))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
            Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
        }
        fn visit_str<E>(self, v: &str) -> Result<Value, E> {
            Ok(Value::String(v.to_string()))
        }
        fn visit_string<E>(self, v: String) -> Result<Value, E> {
            Ok(Value::String(v))
        }
        fn visit_unit<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_none<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
            d.deserialize_any(Strict)
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Value, A::Error> {
            let mut out = Vec::new();
            while let Some(v) = a.next_element_seed(Strict)? {
                out.push(v);
            }
            Ok(Value::Array(out))
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Value, A::Error> {
            let mut out = serde_json::Map::new();
            while let Some(k) = a.next_key::<String>()? {
                let v = a.next_value_seed(Strict)?;
                if out.contains_key(&k) {
                    return Err(serde::de::Error::custom(format!("DUPLICATE:{k}")));
                }
                out.insert(k, v);
            }
            Ok(Value::Object(out))
        }
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let v = serde::de::DeserializeSeed::deserialize(Strict, &mut de).and_then(|v| de.end().map(|_| v));
    v.map_err(|e| {
        let m = e.to_string();
        match m.strip_prefix("DUPLICATE:") {
            Some(rest) => {
                let key = rest.rsplit_once(" at line ").map_or(rest, |(k, _)| k);
                format!(", field `{key}`: written twice in one object (JSON would keep the last silently): keep one")
            }
            None => format!(": not JSON: {m}"),
        }
    })
}

fn is_jsonl(name: &str) -> bool {
    name.ends_with(".jsonl") || name.ends_with(".jsonl.gz") || name.ends_with(".json.gz")
}

/// The keys each named format reads.
fn keys_of(format: Format, generic: &Keys) -> Keys {
    match format {
        Format::Generic => generic.clone(),
        Format::Ultrafeedback => Keys {
            score_chosen: Some("score_chosen".into()),
            score_rejected: Some("score_rejected".into()),
            ..Keys::default()
        },
        _ => Keys::default(),
    }
}

/// The parquet columns a format needs: (name, required).
fn columns_of(format: Format, k: &Keys, form: LabelForm<'_>) -> Vec<(String, bool)> {
    let mut c: Vec<(String, bool)> = match form {
        LabelForm::Ranked { responses } => vec![(responses.into(), true)],
        LabelForm::Winner { a, b, label: l } | LabelForm::Strength { a, b, strength: l } => {
            vec![(a.into(), true), (b.into(), true), (l.into(), true)]
        }
        LabelForm::ChosenRejected { chosen, rejected } => vec![(chosen.into(), true), (rejected.into(), true)],
    };
    if let Some(p) = &k.prompt {
        c.push((p.clone(), true));
    }
    // UltraFeedback's scores are optional columns; a generic spec that names them needs them
    let scores_required = format == Format::Generic;
    for s in [&k.score_chosen, &k.score_rejected].into_iter().flatten() {
        c.push((s.clone(), scores_required));
    }
    c
}

/// The value at a dotted path ("annotations.helpfulness.Rating") inside `v`.
fn at_path<'a>(v: &'a Value, dotted: &str) -> Option<&'a Value> {
    dotted.split('.').try_fold(v, |x, k| x.get(k))
}

/// A row's pairs: one, or with the ranked form those its rule makes.
fn to_pairs(v: &Value, format: Format, k: &Keys, form: LabelForm<'_>, row: usize) -> Result<Vec<Pair>, String> {
    match form {
        LabelForm::Ranked { responses } => ranked_pairs(v, k, responses, row),
        LabelForm::ChosenRejected { .. } | LabelForm::Winner { .. } | LabelForm::Strength { .. } => {
            Ok(vec![to_pair(v, format, k, form, row)?])
        }
    }
}

/// The ranked form: a prompt and its scored responses → pairs by `k.pairs` (higher score chosen;
/// equal scores make a tie, y = ½). Fewer than two responses make no pair.
fn ranked_pairs(v: &Value, k: &Keys, rkey: &str, row: usize) -> Result<Vec<Pair>, String> {
    use rand::{Rng, SeedableRng};
    let Some(pkey) = &k.prompt else {
        return Err(": data.keys.prompt: the ranked form needs the prompt's key".into());
    };
    let prompt = match v.get(pkey.as_str()) {
        None | Some(Value::Null) => return Err(format!(", field `{pkey}`: missing or null")),
        Some(Value::String(s)) => vec![Message::new("user", s)],
        Some(x) => messages(x).map_err(|m| format!(", field `{pkey}`: {m}"))?,
    };
    let list = match v.get(rkey) {
        None | Some(Value::Null) => return Err(format!(", field `{rkey}`: missing or null")),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(format!(", field `{rkey}`: not a list of responses")),
    };
    let text_key = k.response_text.as_deref().unwrap_or("response");
    let mut items: Vec<(String, f64)> = Vec::with_capacity(list.len());
    for (j, e) in list.iter().enumerate() {
        let text = match e {
            Value::String(s) => s.clone(),
            _ => at_path(e, text_key)
                .and_then(|t| t.as_str())
                .ok_or_else(|| format!(", field `{rkey}[{j}].{text_key}`: missing or not a string"))?
                .to_string(),
        };
        // the mean of the scores, each divided before summing: two scores of 1e308 average to
        // 1e308, not to inf
        let mut score = 0.0;
        for p in &k.score {
            let x = at_path(e, p)
                .and_then(|x| x.as_f64().or_else(|| x.as_str().and_then(|s| s.trim().parse().ok())))
                .filter(|x| x.is_finite())
                .ok_or_else(|| format!(", field `{rkey}[{j}].{p}`: missing or not a number"))?;
            score += x / k.score.len() as f64;
        }
        items.push((text, if k.score_lower_is_better { -score } else { score }));
    }
    let n = items.len();
    if n < 2 {
        return Ok(Vec::new());
    }
    // best first; equal scores keep the file's order
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| items[b].1.total_cmp(&items[a].1));
    let picks: Vec<(usize, usize)> = match k.pairs.unwrap_or(PairRule::BestRandom) {
        PairRule::BestWorst => vec![(0, n - 1)],
        PairRule::BestRandom => {
            // one stream per (seed, row): the same pairs whatever else the file holds
            let mut rng =
                rand_chacha::ChaCha8Rng::seed_from_u64(k.pairs_seed ^ (row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            vec![(0, rng.random_range(1..n))]
        }
        PairRule::All => (0..n).flat_map(|i| (i + 1..n).map(move |j| (i, j))).collect(),
        PairRule::Adjacent => (0..n - 1).map(|i| (i, i + 1)).collect(),
    };
    let conv = |i: usize| {
        let mut m = prompt.clone();
        m.push(Message::new("assistant", &items[order[i]].0));
        m
    };
    Ok(picks
        .into_iter()
        .map(|(i, j)| {
            let (si, sj) = (items[order[i]].1, items[order[j]].1);
            Pair {
                row,
                at: "".into(),
                chosen: conv(i),
                rejected: conv(j),
                scores: Some((si, sj)),
                tie: si == sj,
                soft: None,
            }
        })
        .collect())
}

/// Row errors are written as ", field `x`: what" or ": what" after "file: row N".
fn to_pair(v: &Value, format: Format, k: &Keys, form: LabelForm<'_>, row: usize) -> Result<Pair, String> {
    let Sides { chosen, rejected, tie, soft } = if format == Format::HhRlhf {
        let side = |key: &str| -> Result<Vec<Message>, String> {
            let s = field(v, key)?.as_str().ok_or_else(|| format!(", field `{key}`: not a string"))?;
            hh_messages(s).map_err(|m| format!(", field `{key}`: {m}"))
        };
        Sides { chosen: side(&k.chosen)?, rejected: side(&k.rejected)?, tie: false, soft: None }
    } else {
        labelled_sides(v, k, form)?
    };
    let scores = pair_scores(v, format, k)?;
    Ok(Pair { row, at: "".into(), chosen, rejected, scores, tie, soft })
}

/// A pair's two conversations as its label form orders them, with the form's tie or soft label.
struct Sides {
    chosen: Vec<Message>,
    rejected: Vec<Message>,
    tie: bool,
    soft: Option<f32>,
}

/// The row's field `key`, an error when it is missing or null.
fn field<'v>(v: &'v Value, key: &str) -> Result<&'v Value, String> {
    match v.get(key) {
        None | Some(Value::Null) => Err(format!(", field `{key}`: missing or null")),
        Some(x) => Ok(x),
    }
}

/// A message-list format's two sides, ordered by the label form: chosen/rejected as named; a
/// winner label mapped by data.keys.label_a/label_b/label_tie; a preference strength's y
/// (chosen: the side it favours, soft label max(y, 1 − y); y = ½ a tie).
fn labelled_sides(v: &Value, k: &Keys, form: LabelForm<'_>) -> Result<Sides, String> {
    let prompt = match &k.prompt {
        None => None,
        Some(key) => Some(match field(v, key)? {
            Value::String(s) => vec![Message::new("user", s)],
            x => messages(x).map_err(|m| format!(", field `{key}`: {m}"))?,
        }),
    };
    let side = |key: &str| side_conversation(v, prompt.as_deref(), key);
    let (mut tie, mut soft) = (false, None);
    let (chosen, rejected) = match form {
        LabelForm::Strength { a, b, strength: key } => {
            let sv = field(v, key)?;
            let st = sv
                .as_f64()
                .or_else(|| sv.as_str().and_then(|x| x.trim().parse().ok()))
                .filter(|x: &f64| x.is_finite())
                .ok_or_else(|| format!(", field `{key}`: {sv} is not a number"))?;
            let y = k.strength_y(st);
            let (sa, sb) = (side(a)?, side(b)?);
            // chosen is the side the strength favours; its soft label in [½, 1]
            if y == 0.5 {
                tie = true;
                (sa, sb)
            } else if y > 0.5 {
                soft = Some(y as f32);
                (sa, sb)
            } else {
                soft = Some((1.0 - y) as f32);
                (sb, sa)
            }
        }
        LabelForm::Winner { a, b, label } => {
            let lv = field(v, label)?;
            let (sa, sb) = (side(a)?, side(b)?);
            if k.label_a.iter().any(|t| label_is(lv, t)) {
                (sa, sb)
            } else if k.label_b.iter().any(|t| label_is(lv, t)) {
                (sb, sa)
            } else if k.label_tie.iter().any(|t| label_is(lv, t)) {
                tie = true;
                (sa, sb)
            } else {
                return Err(format!(
                    ", field `{label}`: {lv} is not a mapped label value (data.keys.label_a, label_b, label_tie)"
                ));
            }
        }
        LabelForm::ChosenRejected { chosen, rejected } => (side(chosen)?, side(rejected)?),
        LabelForm::Ranked { .. } => return Err(": the ranked form makes its pairs from the responses list".into()),
    };
    Ok(Sides { chosen, rejected, tie, soft })
}

/// One side's conversation: the prompt (if the format names one) and the field `key` (a
/// response string after a prompt, or a message list), ending with an assistant message.
fn side_conversation(v: &Value, prompt: Option<&[Message]>, key: &str) -> Result<Vec<Message>, String> {
    let mut conv = prompt.map(|p| p.to_vec()).unwrap_or_default();
    match (field(v, key)?, prompt) {
        (Value::String(s), Some(_)) => conv.push(Message::new("assistant", s)),
        (Value::String(_), None) => {
            return Err(format!(
                ", field `{key}`: a response string needs a prompt: name the prompt's key (data.keys.prompt)"
            ))
        }
        (x, _) => conv.extend(messages(x).map_err(|m| format!(", field `{key}`: {m}"))?),
    }
    match conv.last() {
        Some(m) if m.role == "assistant" => Ok(conv),
        _ => Err(format!(", field `{key}`: does not end with an assistant message")),
    }
}

/// (score_chosen, score_rejected) when the format's keys name both and the row has them.
fn pair_scores(v: &Value, format: Format, k: &Keys) -> Result<Option<(f64, f64)>, String> {
    // a score key the generic form names is required (as its parquet column is); UltraFeedback's
    // are optional
    let required = format == Format::Generic;
    let score = |key: &Option<String>| -> Result<Option<f64>, String> {
        match key {
            None => Ok(None),
            Some(key) => match v.get(key.as_str()) {
                None if required => Err(format!(", field `{key}`: missing (data.keys names it)")),
                None => Ok(None),
                Some(x) => match x.as_f64() {
                    Some(s) if s.is_finite() => Ok(Some(s)),
                    _ => Err(format!(", field `{key}`: {x} is null or not a finite number")),
                },
            },
        }
    };
    Ok(match (score(&k.score_chosen)?, score(&k.score_rejected)?) {
        (Some(a), Some(b)) => Some((a, b)),
        _ => None,
    })
}

/// A list of {role, content} objects.
fn messages(v: &Value) -> Result<Vec<Message>, String> {
    let list = v.as_array().ok_or("is neither a string nor a list of {role, content} messages")?;
    list.iter()
        .enumerate()
        .map(|(j, m)| {
            let s = |k: &str| m.get(k).and_then(|x| x.as_str());
            match (s("role"), s("content")) {
                (Some(r), Some(c)) => Ok(Message::new(r, c)),
                _ => Err(format!("message {j} has a null or missing `role` or `content`")),
            }
        })
        .collect()
}

/// A "\n\nHuman: … \n\nAssistant: …" transcript as messages (user/assistant, stripped).
pub fn hh_messages(text: &str) -> Result<Vec<Message>, String> {
    const TAGS: [(&str, &str); 2] = [("\n\nHuman: ", "user"), ("\n\nAssistant: ", "assistant")];
    let mut msgs: Vec<Message> = Vec::new();
    let mut rest = text;
    loop {
        let next = TAGS.iter().filter_map(|(tag, role)| rest.find(tag).map(|i| (i, *tag, *role))).min_by_key(|x| x.0);
        match next {
            None => {
                if let Some(m) = msgs.last_mut() {
                    m.content.push_str(rest);
                }
                break;
            }
            Some((i, tag, role)) => {
                if let Some(m) = msgs.last_mut() {
                    m.content.push_str(&rest[..i]);
                }
                msgs.push(Message::new(role, ""));
                rest = &rest[i + tag.len()..];
            }
        }
    }
    for m in &mut msgs {
        m.content = m.content.trim().to_string();
    }
    match msgs.last() {
        None => Err("no \"\\n\\nHuman: \" or \"\\n\\nAssistant: \" turn".into()),
        Some(m) if m.role != "assistant" => Err("the transcript does not end with an Assistant turn".into()),
        Some(_) => Ok(msgs),
    }
}

type Visit<'a> = dyn FnMut(usize, Result<Value, String>) -> Result<bool> + 'a;

/// The longest jsonl row read, in bytes. Preference rows are kilobytes; a longer row is
/// malformed (an error, or skipped and counted), read in bounded pieces and never held whole:
/// through JSON and the tokenizer a row costs ~170 bytes per character (a 50 MB row took 7 GB).
pub const MAX_ROW_BYTES: usize = 4 << 20;

fn jsonl_rows(path: &Path, visit: &mut Visit<'_>) -> Result<()> {
    let f = std::fs::File::open(path)
        .map_err(|e| anyhow::anyhow!("opening {}: {}", path.display(), crate::io::io_message(path, &e)))?;
    let mut r: Box<dyn BufRead> = if path.to_string_lossy().ends_with(".gz") {
        Box::new(BufReader::new(flate2::read::GzDecoder::new(f)))
    } else {
        Box::new(BufReader::new(f))
    };
    // at most one row's limit (and a byte) per read
    let read = |r: &mut Box<dyn BufRead>, buf: &mut Vec<u8>| {
        std::io::Read::take(r, MAX_ROW_BYTES as u64 + 1).read_until(b'\n', buf)
    };
    let mut buf = Vec::new();
    let mut rows = 0usize;
    for row in 0.. {
        buf.clear();
        let n = read(&mut r, &mut buf).with_context(|| format!("{}: reading line {}", path.display(), row + 1))?;
        if n == 0 {
            break;
        }
        // a UTF-8 byte-order mark before the first row (as the spec reader skips one)
        if row == 0 && buf.starts_with(b"\xef\xbb\xbf") {
            buf.drain(..3);
        }
        // a blank line is no row (its number still counts, so rows keep their line's number)
        if buf.iter().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        rows += 1;
        let v = if buf.len() > MAX_ROW_BYTES && buf.last() != Some(&b'\n') {
            // skip the rest of the row without holding it
            let mut total = buf.len();
            loop {
                buf.clear();
                let m =
                    read(&mut r, &mut buf).with_context(|| format!("{}: reading line {}", path.display(), row + 1))?;
                total += m;
                if m == 0 || buf.last() == Some(&b'\n') {
                    break;
                }
            }
            Err(format!(": {total} bytes, over the {} MiB a row may hold", MAX_ROW_BYTES >> 20))
        } else {
            while matches!(buf.last(), Some(b'\n' | b'\r')) {
                buf.pop();
            }
            json_row(&buf)
        };
        if !visit(row, v)? {
            break;
        }
    }
    if rows == 0 {
        bail!("{}: no rows (the file is empty or holds only blank lines)", path.display());
    }
    Ok(())
}

fn parquet_rows(path: &Path, columns: &[(String, bool)], visit: &mut Visit<'_>) -> Result<()> {
    let f = std::fs::File::open(path)
        .map_err(|e| anyhow::anyhow!("opening {}: {}", path.display(), crate::io::io_message(path, &e)))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(f)
        .with_context(|| format!("{}: not a readable parquet file", path.display()))?;
    let schema = builder.schema().clone();
    for (c, required) in columns {
        if *required && schema.field_with_name(c).is_err() {
            let have: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            bail!("{}: no column `{c}` (the file has: {})", path.display(), have.join(", "));
        }
    }
    let mut row = 0;
    for batch in builder.build()? {
        let batch: RecordBatch = batch.with_context(|| format!("reading {}", path.display()))?;
        let cols: Vec<(&str, &dyn Array)> =
            columns.iter().filter_map(|(c, _)| batch.column_by_name(c).map(|a| (c.as_str(), a.as_ref()))).collect();
        for i in 0..batch.num_rows() {
            let mut obj = serde_json::Map::new();
            let mut err = None;
            for (name, col) in &cols {
                match arrow_cell(*col, i) {
                    Ok(v) => {
                        obj.insert(name.to_string(), v);
                    }
                    Err(e) => {
                        err = Some(format!(", field `{name}`: {e}"));
                        break;
                    }
                }
            }
            let v = match err {
                Some(e) => Err(e),
                None => Ok(Value::Object(obj)),
            };
            if !visit(row, v)? {
                return Ok(());
            }
            row += 1;
        }
    }
    Ok(())
}

/// The files a dataset path names: one file, or a `*` pattern in the file name (sorted).
pub fn expand_glob(path: &Path) -> Result<Vec<PathBuf>> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if !name.contains('*') {
        if !path.exists() {
            bail!("{}: no such file{}", path.display(), crate::io::where_missing(path));
        }
        return Ok(vec![path.to_path_buf()]);
    }
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: listing the directory", dir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| features::hub::glob_match(&name, &e.file_name().to_string_lossy()))
        .map(|e| e.path())
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(anyhow!("{}: no file matches", path.display()));
    }
    Ok(files)
}

/// Prompts for generation: the string under `key` of every row of `files` (jsonl or parquet),
/// or, when it is a list of {role, content} messages, the conversation so far. A null, missing
/// or blank prompt is an error naming the file and row. At most `limit` prompts.
pub fn read_prompts(files: &[PathBuf], key: &str, limit: Option<usize>) -> Result<Vec<Vec<Message>>> {
    let mut out: Vec<Vec<Message>> = Vec::new();
    for path in files {
        let name = path.to_string_lossy().into_owned();
        let mut visit = |row: usize, v: Result<Value, String>| -> Result<bool> {
            if limit.is_some_and(|l| out.len() >= l) {
                return Ok(false);
            }
            // 1-based, a jsonl file's line or a parquet file's row
            let row = place(&name, row);
            let v = v.map_err(|e| anyhow::anyhow!("{name}: {row}{e}"))?;
            let msgs = match v.get(key) {
                Some(Value::String(s)) if !s.trim().is_empty() => vec![Message::new("user", s)],
                Some(l @ Value::Array(_)) => {
                    let m = messages(l)
                        .map_err(|e| anyhow::anyhow!("{name}: {row}, field `{key}` (generate.prompt_key): {e}"))?;
                    if m.is_empty() || m.iter().all(|m| m.content.trim().is_empty()) {
                        bail!("{name}: {row}, field `{key}` (generate.prompt_key): an empty conversation");
                    }
                    m
                }
                Some(Value::String(_)) => bail!("{name}: {row}, field `{key}` (generate.prompt_key): a blank prompt"),
                Some(Value::Null) | None => bail!("{name}: {row}: no `{key}` (generate.prompt_key; null or missing)"),
                Some(_) => {
                    bail!("{name}: {row}, field `{key}` (generate.prompt_key): expected a string or a list of messages")
                }
            };
            out.push(msgs);
            Ok(true)
        };
        if name.ends_with(".parquet") {
            parquet_rows(path, &[(key.to_string(), true)], &mut visit)?;
        } else if is_jsonl(&name) {
            jsonl_rows(path, &mut visit)?;
        } else {
            bail!("{name}: expected a .jsonl, .jsonl.gz or .parquet file of prompts");
        }
    }
    if out.is_empty() {
        bail!("{}: no prompts", files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`to_pair`] with the keys' own label form.
    fn pair_of(v: &Value, format: Format, k: &Keys, row: usize) -> Result<Pair, String> {
        to_pair(v, format, k, k.label_form().unwrap(), row)
    }

    #[test]
    fn globs() {
        use features::hub::glob_match;
        assert!(glob_match("train-*.parquet", "train-00000-of-00004-cee3.parquet"));
        assert!(!glob_match("train-*.parquet", "test-00000.parquet"));
        assert!(glob_match("*", "x"));
        assert!(glob_match("a*b*c", "aXbYc"));
        assert!(!glob_match("a*b*c", "aXcYb"));
        assert!(!glob_match("ab*ba", "aba"));
        assert!(glob_match("plain.jsonl", "plain.jsonl"));
    }

    #[test]
    fn generic_rows() {
        let k = Keys { prompt: Some("q".into()), chosen: "good".into(), rejected: "bad".into(), ..Keys::default() };
        let v: Value = serde_json::json!({"q": "Hi?", "good": "Hello.", "bad": "Go away."});
        let p = pair_of(&v, Format::Generic, &k, 3).unwrap();
        assert_eq!(p.chosen, vec![Message::new("user", "Hi?"), Message::new("assistant", "Hello.")]);
        assert_eq!(p.rejected[1].content, "Go away.");
        assert_eq!(p.row, 3);
        // the prompt as a message list (a system turn first)
        let v: Value = serde_json::json!({"q": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
            "good": "Hello.", "bad": [{"role": "assistant", "content": "No."}]});
        let p = pair_of(&v, Format::Generic, &k, 0).unwrap();
        assert_eq!(p.chosen.len(), 3);
        assert_eq!(p.rejected[2], Message::new("assistant", "No."));
        // a response string without a prompt key, a missing side, a user-final conversation
        let k2 = Keys::default();
        let e = pair_of(&serde_json::json!({"chosen": "a", "rejected": "b"}), Format::Generic, &k2, 0).unwrap_err();
        assert!(e.contains("`chosen`") && e.contains("data.keys.prompt"), "{e}");
        let e = pair_of(&serde_json::json!({"q": "x", "good": "a"}), Format::Generic, &k, 0).unwrap_err();
        assert!(e.contains("`bad`: missing"), "{e}");
        let e = pair_of(
            &serde_json::json!({"chosen": [{"role": "user", "content": "x"}], "rejected": []}),
            Format::Mixture2,
            &k2,
            0,
        )
        .unwrap_err();
        assert!(e.contains("does not end with an assistant"), "{e}");
    }
}
