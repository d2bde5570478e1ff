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
}

fn bad(path: &Path, message: String) -> SpecError {
    SpecError { file: path.to_path_buf(), key: String::new(), line: None, message }
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

/// Reads one pairs file. `dim`: the dimension the rows must have, when already known.
pub fn read_pairs(path: &Path, dim: Option<usize>) -> Result<Pairs, SpecError> {
    let bytes = std::fs::read(path).map_err(|e| bad(path, format!("cannot read the features file: {e}")))?;
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
            let at = |name: &str, m: String| bad(path, format!("row {row}, column `{name}`: {m}"));
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
