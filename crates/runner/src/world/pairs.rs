//! "Bring your own features": labelled pairs read from a parquet file with list<float32> columns
//! `phi_chosen` and `phi_rejected` and an optional `label` (1: the chosen side is preferred,
//! the default when the column is absent; 0: the rejected side is). z = φ_chosen − φ_rejected.
//! There is no θ*, so θ-error and SubOpt are null for these runs.

use crate::spec::SpecError;
use arrow_array::{Array, ArrayRef, Float32Array, Float64Array, RecordBatch};
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use std::path::{Path, PathBuf};

/// z rows and labels of one file.
#[derive(Clone, Debug, PartialEq)]
pub struct Pairs {
    pub d: usize,
    pub z: Vec<f32>,
    pub y: Vec<f32>,
    /// blake3 of the file's bytes (stored in meta.json).
    pub digest: String,
}

impl Pairs {
    pub fn len(&self) -> usize {
        self.y.len()
    }
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }
    pub fn row(&self, i: usize) -> &[f32] {
        &self.z[i * self.d..(i + 1) * self.d]
    }
}

/// The training pairs and the held-out evaluation pairs of a `features` environment.
#[derive(Clone, Debug, PartialEq)]
pub struct PairData {
    pub d: usize,
    pub train: Pairs,
    pub eval: Pairs,
    pub train_path: PathBuf,
    pub eval_path: Option<PathBuf>,
    /// kind = "dataset": what was read, split, dropped and computed (meta.json).
    pub report: Option<serde_json::Value>,
    /// For each training row, its index among the training pairs before any was dropped
    /// (degenerate pairs): what an `env.order_path` file indexes. Empty: the identity.
    pub train_origin: Vec<usize>,
    /// Training pairs before dropping (the range of `env.order_path` indices).
    pub train_total: usize,
    /// `env.order = "indices"`: the training rows in stream order (read from `env.order_path`,
    /// dropped rows left out).
    pub order: Option<Vec<usize>>,
    /// kind = "dataset" with a reward model whose features learn: the token ids of each
    /// pair's two sides, row for row with `train` and `eval`.
    pub ids: Option<PairIds>,
}

/// The chat-templated token ids of pairs' (chosen, rejected) sides.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PairIds {
    pub train: Vec<(Vec<u32>, Vec<u32>)>,
    pub eval: Vec<(Vec<u32>, Vec<u32>)>,
}

fn bad(path: &Path, message: String) -> SpecError {
    SpecError { file: path.to_path_buf(), key: String::new(), line: None, message, set: None }
}

/// One row's list as f32 values (float32 or float64 elements; nulls are errors).
fn list_row(col: &ArrayRef, i: usize) -> Result<Vec<f32>, String> {
    if col.is_null(i) {
        return Err("is null".into());
    }
    let values = match col.data_type() {
        DataType::List(_) => col.as_any().downcast_ref::<arrow_array::ListArray>().map(|l| l.value(i)),
        DataType::LargeList(_) => col.as_any().downcast_ref::<arrow_array::LargeListArray>().map(|l| l.value(i)),
        DataType::FixedSizeList(_, _) => {
            col.as_any().downcast_ref::<arrow_array::FixedSizeListArray>().map(|l| l.value(i))
        }
        other => return Err(format!("has type {other}, expected list<float32>")),
    }
    .ok_or("is not a list array")?;
    if values.null_count() > 0 {
        return Err("holds a null value".into());
    }
    let out: Vec<f32> = if let Some(v) = values.as_any().downcast_ref::<Float32Array>() {
        v.values().to_vec()
    } else if let Some(v) = values.as_any().downcast_ref::<Float64Array>() {
        v.values().iter().map(|&x| x as f32).collect()
    } else {
        return Err(format!("has elements of type {}, expected float32", values.data_type()));
    };
    if let Some(j) = out.iter().position(|v| !v.is_finite()) {
        return Err(format!("element {j} is {}", out[j]));
    }
    Ok(out)
}

/// A label column as numbers (booleans, integers or floats; nulls stay None).
fn labels_of(col: &ArrayRef) -> Result<Vec<Option<f64>>, String> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::*;
    macro_rules! num {
        ($t:ty) => {
            col.as_primitive::<$t>().iter().map(|v| v.map(|x| x as f64)).collect()
        };
    }
    Ok(match col.data_type() {
        DataType::Boolean => col.as_boolean().iter().map(|v| v.map(|b| f64::from(u8::from(b)))).collect(),
        DataType::Float64 => num!(Float64Type),
        DataType::Float32 => num!(Float32Type),
        DataType::Int8 => num!(Int8Type),
        DataType::Int16 => num!(Int16Type),
        DataType::Int32 => num!(Int32Type),
        DataType::Int64 => num!(Int64Type),
        DataType::UInt8 => num!(UInt8Type),
        DataType::UInt16 => num!(UInt16Type),
        DataType::UInt32 => num!(UInt32Type),
        DataType::UInt64 => num!(UInt64Type),
        other => return Err(format!("has type {other}, expected 0/1 as an integer, float or boolean")),
    })
}

/// An `env.order_path` file: 0-based row indices, from a 1-D integer .npy (little-endian
/// i8/i16/i32/i64/u8/u16/u32/u64, what `np.save(torch.randperm(n).numpy())` writes) or a text file
/// of whitespace-separated integers. Indices must be distinct and below `n`.
pub fn read_order(path: &Path, n: usize) -> Result<Vec<usize>, SpecError> {
    let bytes = std::fs::read(path)
        .map_err(|e| bad(path, format!("cannot read the order file: {}", crate::io::io_message(path, &e))))?;
    let idx: Vec<i128> = if bytes.starts_with(b"\x93NUMPY") {
        npy_ints(&bytes).map_err(|m| bad(path, m))?
    } else {
        let text = std::str::from_utf8(&bytes).map_err(|_| bad(path, "neither a .npy nor a text file".into()))?;
        text.split_whitespace()
            .enumerate()
            .map(|(i, w)| w.parse::<i128>().map_err(|_| bad(path, format!("entry {i}: `{w}` is not an integer"))))
            .collect::<Result<_, _>>()?
    };
    let mut seen = vec![false; n];
    idx.iter()
        .enumerate()
        .map(|(i, &v)| {
            if v < 0 || v >= n as i128 {
                return Err(bad(path, format!("entry {i}: {v} is not a training-row index (expected 0..{n})")));
            }
            let u = v as usize;
            if std::mem::replace(&mut seen[u], true) {
                return Err(bad(path, format!("entry {i}: index {u} appears twice")));
            }
            Ok(u)
        })
        .collect()
}

fn npy_ints(b: &[u8]) -> Result<Vec<i128>, String> {
    let (hlen, start) = match b.get(6) {
        Some(1) if b.len() >= 10 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        Some(2 | 3) if b.len() >= 12 => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
        _ => return Err("not a .npy file (bad version or truncated header)".into()),
    };
    let header = b.get(start..start + hlen).ok_or("truncated .npy header")?;
    let header = String::from_utf8_lossy(header);
    let field = |k: &str| -> Option<String> {
        let i = header.find(&format!("'{k}'"))?;
        let rest = &header[i + k.len() + 2..];
        let rest = rest.trim_start().strip_prefix(':')?.trim_start();
        let end = if rest.starts_with('(') { rest.find(')')? + 1 } else { rest.find([',', '}'])? };
        Some(rest[..end].trim().trim_matches('\'').to_string())
    };
    let descr = field("descr").ok_or("no 'descr' in the .npy header")?;
    if field("fortran_order").as_deref() == Some("True") {
        return Err("a Fortran-ordered .npy: save a 1-D array".into());
    }
    let shape = field("shape").ok_or("no 'shape' in the .npy header")?;
    let dims: Vec<&str> =
        shape.trim_matches(|c| c == '(' || c == ')').split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if dims.len() != 1 {
        return Err(format!("shape {shape}: expected a 1-D array of indices"));
    }
    let len: usize = dims[0].parse().map_err(|_| format!("shape {shape}: not a length"))?;
    let (signed, width) = match descr.as_str() {
        "<i8" => (true, 8),
        "<i4" => (true, 4),
        "<i2" => (true, 2),
        "|i1" => (true, 1),
        "<u8" => (false, 8),
        "<u4" => (false, 4),
        "<u2" => (false, 2),
        "|u1" => (false, 1),
        d => return Err(format!("dtype {d}: expected little-endian integers (e.g. int64)")),
    };
    let data = &b[start + hlen..];
    if data.len() != len * width {
        return Err(format!("{} data bytes for {len} entries of {width} bytes", data.len()));
    }
    Ok(data
        .chunks_exact(width)
        .map(|c| {
            let mut buf = [0u8; 16];
            buf[..width].copy_from_slice(c);
            if signed && c[width - 1] & 0x80 != 0 {
                buf[width..].fill(0xff);
            }
            i128::from_le_bytes(buf)
        })
        .collect())
}

/// Reads one pairs file. `dim`: the dimension the rows must have, when already known.
pub fn read_pairs(path: &Path, dim: Option<usize>) -> Result<Pairs, SpecError> {
    let bytes = std::fs::read(path)
        .map_err(|e| bad(path, format!("cannot read the features file: {}", crate::io::io_message(path, &e))))?;
    let digest = blake3::hash(&bytes).to_hex().to_string();
    let reader = ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(bytes))
        .map_err(|e| bad(path, format!("not a readable parquet file: {e}")))?;
    let schema = reader.schema().clone();
    for need in ["phi_chosen", "phi_rejected"] {
        if schema.column_with_name(need).is_none() {
            let have: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            return Err(bad(
                path,
                format!("no column `{need}`: expected list<float32> columns phi_chosen and phi_rejected (and optionally label); found {}", have.join(", ")),
            ));
        }
    }
    let has_label = schema.column_with_name("label").is_some();
    let reader = reader.build().map_err(|e| bad(path, format!("reading parquet: {e}")))?;
    let (mut d, mut z, mut y, mut row) = (dim, Vec::new(), Vec::new(), 0usize);
    for batch in reader {
        let batch: RecordBatch = batch.map_err(|e| bad(path, format!("reading parquet: {e}")))?;
        let col = |name: &str| batch.column_by_name(name).cloned().expect("checked in the schema");
        let (c, r) = (col("phi_chosen"), col("phi_rejected"));
        let l = match has_label {
            true => Some(labels_of(&col("label")).map_err(|m| bad(path, format!("column `label` {m}")))?),
            false => None,
        };
        for i in 0..batch.num_rows() {
            // 1-based, as every data-file message
            let at = |name: &str, m: String| bad(path, format!("row {}, column `{name}`: {m}", row + 1));
            let pc = list_row(&c, i).map_err(|m| at("phi_chosen", m))?;
            let pr = list_row(&r, i).map_err(|m| at("phi_rejected", m))?;
            let want = *d.get_or_insert(pc.len());
            for (name, v) in [("phi_chosen", &pc), ("phi_rejected", &pr)] {
                if v.len() != want {
                    return Err(at(name, format!("has {} values, expected {want} (the dimension)", v.len())));
                }
            }
            if want == 0 {
                return Err(at("phi_chosen", "is empty: expected at least one feature".into()));
            }
            z.extend(pc.iter().zip(&pr).map(|(a, b)| a - b));
            y.push(match l.as_ref().map(|l| l[i]) {
                None => 1.0,
                Some(Some(v)) if v == 0.0 || v == 1.0 => v as f32,
                Some(Some(v)) => return Err(at("label", format!("is {v}, expected 0 or 1"))),
                Some(None) => return Err(at("label", "is null, expected 0 or 1".into())),
            });
            row += 1;
        }
    }
    let d = d.filter(|_| row > 0).ok_or_else(|| bad(path, "holds no rows".into()))?;
    Ok(Pairs { d, z, y, digest })
}
