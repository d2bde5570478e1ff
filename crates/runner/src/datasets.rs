//! Preference datasets as (chosen, rejected) conversations: UltraFeedback-binarized parquet
//! (`chosen`/`rejected` message lists) and HH-RLHF jsonl(.gz) transcripts
//! ("\n\nHuman: … \n\nAssistant: …"). Errors name the file, the row and the field.

use anyhow::{anyhow, bail, Context, Result};
use arrow_array::{Array, ListArray, StringArray, StructArray};
use features::Message;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// One preference pair: two conversations whose last message is the response.
#[derive(Clone, Debug, PartialEq)]
pub struct Pair {
    pub row: usize,
    pub chosen: Vec<Message>,
    pub rejected: Vec<Message>,
    /// (score_chosen, score_rejected) when the file has them (UltraFeedback).
    pub scores: Option<(f64, f64)>,
}

impl Pair {
    /// The two sides have the same score: the "chosen" side is an arbitrary pick.
    pub fn score_tie(&self) -> bool {
        self.scores.is_some_and(|(c, r)| c == r)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// From the file name: .jsonl / .jsonl.gz → hh-rlhf, .parquet → ultrafeedback.
    Auto,
    HhRlhf,
    Ultrafeedback,
}

/// The first `limit` pairs of `path` (all when None).
pub fn read_pairs(path: &Path, format: Format, limit: Option<usize>) -> Result<Vec<Pair>> {
    let name = path.to_string_lossy();
    let format = match format {
        Format::Auto if name.ends_with(".parquet") => Format::Ultrafeedback,
        Format::Auto if name.ends_with(".jsonl") || name.ends_with(".jsonl.gz") => Format::HhRlhf,
        Format::Auto => bail!("{name}: cannot tell the format from the name; give --format"),
        f => f,
    };
    match format {
        Format::HhRlhf => hh(path, limit),
        Format::Ultrafeedback => ultrafeedback(path, limit),
        Format::Auto => unreachable!(),
    }
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

fn hh(path: &Path, limit: Option<usize>) -> Result<Vec<Pair>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let r: Box<dyn BufRead> = if path.to_string_lossy().ends_with(".gz") {
        Box::new(BufReader::new(flate2::read::GzDecoder::new(f)))
    } else {
        Box::new(BufReader::new(f))
    };
    let mut out = Vec::new();
    for (row, line) in r.lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let line = line.with_context(|| format!("{}: reading row {row}", path.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| anyhow!("{}: row {row}: not JSON: {e}", path.display()))?;
        let side = |k: &str| -> Result<Vec<Message>> {
            let s = v
                .get(k)
                .and_then(|x| x.as_str())
                .ok_or_else(|| anyhow!("{}: row {row}: field `{k}` is missing or not a string", path.display()))?;
            hh_messages(s).map_err(|m| anyhow!("{}: row {row}, field `{k}`: {m}", path.display()))
        };
        out.push(Pair { row, chosen: side("chosen")?, rejected: side("rejected")?, scores: None });
    }
    Ok(out)
}

fn messages_at(list: &ListArray, i: usize) -> Result<Vec<Message>, String> {
    if list.is_null(i) {
        return Err("is null".into());
    }
    let v = list.value(i);
    let s = v.as_any().downcast_ref::<StructArray>().ok_or("is not a list of {role, content} structs")?;
    let col = |n: &str| {
        s.column_by_name(n)
            .and_then(|c| c.as_any().downcast_ref::<StringArray>())
            .ok_or_else(|| format!("has no string field `{n}` in its messages"))
    };
    let (role, content) = (col("role")?, col("content")?);
    (0..s.len())
        .map(|j| {
            if s.is_null(j) || role.is_null(j) || content.is_null(j) {
                return Err(format!("message {j} has a null `role` or `content`"));
            }
            Ok(Message::new(role.value(j), content.value(j)))
        })
        .collect()
}

fn ultrafeedback(path: &Path, limit: Option<usize>) -> Result<Vec<Pair>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(f)
        .with_context(|| format!("{}: not a readable parquet file", path.display()))?
        .build()?;
    let mut out = Vec::new();
    let mut row = 0;
    for batch in reader {
        let batch = batch.with_context(|| format!("reading {}", path.display()))?;
        let list = |k: &str| {
            batch.column_by_name(k).and_then(|c| c.as_any().downcast_ref::<ListArray>()).ok_or_else(|| {
                anyhow!("{}: no list column `{k}` (expected the ultrafeedback_binarized schema)", path.display())
            })
        };
        let (c, r) = (list("chosen")?, list("rejected")?);
        // optional numeric score columns
        let score = |k: &str| -> Result<Option<Vec<Option<f64>>>> {
            let Some(col) = batch.column_by_name(k) else { return Ok(None) };
            let any = col.as_any();
            let v: Vec<Option<f64>> = if let Some(a) = any.downcast_ref::<arrow_array::Float64Array>() {
                a.iter().collect()
            } else if let Some(a) = any.downcast_ref::<arrow_array::Float32Array>() {
                a.iter().map(|x| x.map(f64::from)).collect()
            } else if let Some(a) = any.downcast_ref::<arrow_array::Int64Array>() {
                a.iter().map(|x| x.map(|v| v as f64)).collect()
            } else {
                bail!("{}: column `{k}` has type {}, expected a number", path.display(), col.data_type())
            };
            Ok(Some(v))
        };
        let (sc, sr) = (score("score_chosen")?, score("score_rejected")?);
        for i in 0..batch.num_rows() {
            if limit.is_some_and(|l| out.len() >= l) {
                return Ok(out);
            }
            let get = |l: &ListArray, k: &str| {
                let m = messages_at(l, i).map_err(|m| anyhow!("{}: row {row}, field `{k}`: {m}", path.display()))?;
                match m.last() {
                    Some(last) if last.role == "assistant" => Ok(m),
                    _ => Err(anyhow!(
                        "{}: row {row}, field `{k}`: does not end with an assistant message",
                        path.display()
                    )),
                }
            };
            let scores = match (&sc, &sr) {
                (Some(a), Some(b)) => match (a[i], b[i]) {
                    (Some(x), Some(y)) if x.is_finite() && y.is_finite() => Some((x, y)),
                    _ => bail!("{}: row {row}: `score_chosen`/`score_rejected` is null or not finite", path.display()),
                },
                _ => None,
            };
            out.push(Pair { row, chosen: get(c, "chosen")?, rejected: get(r, "rejected")?, scores });
            row += 1;
        }
    }
    Ok(out)
}
