//! Arrow cells as JSON: how a parquet row's columns become the JSON value a dataset format maps
//! to a pair ([`super::datasets`] reads parquet rows through [`arrow_cell`]).

use arrow_array::Array;
use arrow_schema::DataType;
use serde_json::Value;

/// One cell of an arrow column as JSON: strings, numbers, booleans, and lists and structs of them.
pub fn arrow_cell(col: &dyn Array, i: usize) -> Result<Value, String> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::*;
    if col.is_null(i) {
        return Ok(Value::Null);
    }
    let num = |x: f64| -> Result<Value, String> {
        serde_json::Number::from_f64(x).map(Value::Number).ok_or_else(|| format!("is {x}, not a finite number"))
    };
    // a dictionary-encoded column: the cell is its key's entry of the dictionary
    macro_rules! dict {
        ($($k:ty),*) => {
            match col.data_type() {
                $(DataType::Dictionary(k, _) if **k == <$k as ArrowPrimitiveType>::DATA_TYPE => {
                    let d = col.as_dictionary::<$k>();
                    let key = d.key(i).ok_or("has a null dictionary key")?;
                    return arrow_cell(d.values().as_ref(), key);
                })*
                _ => {}
            }
        };
    }
    dict!(Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type, UInt32Type, UInt64Type);
    Ok(match col.data_type() {
        DataType::Utf8 => Value::String(col.as_string::<i32>().value(i).to_string()),
        DataType::LargeUtf8 => Value::String(col.as_string::<i64>().value(i).to_string()),
        DataType::Utf8View => Value::String(col.as_string_view().value(i).to_string()),
        DataType::Boolean => Value::Bool(col.as_boolean().value(i)),
        DataType::Float64 => num(col.as_primitive::<Float64Type>().value(i))?,
        DataType::Float32 => num(f64::from(col.as_primitive::<Float32Type>().value(i)))?,
        DataType::Float16 => num(col.as_primitive::<Float16Type>().value(i).to_f64())?,
        DataType::Decimal128(_, scale) => {
            let v = col.as_primitive::<Decimal128Type>().value(i);
            match (*scale, i64::try_from(v)) {
                (0, Ok(x)) => Value::from(x),
                _ => num(v as f64 / 10f64.powi(i32::from(*scale)))?,
            }
        }
        DataType::UInt16 => Value::from(col.as_primitive::<UInt16Type>().value(i)),
        DataType::UInt8 => Value::from(col.as_primitive::<UInt8Type>().value(i)),
        DataType::Int64 => Value::from(col.as_primitive::<Int64Type>().value(i)),
        DataType::Int32 => Value::from(col.as_primitive::<Int32Type>().value(i)),
        DataType::Int16 => Value::from(col.as_primitive::<Int16Type>().value(i)),
        DataType::Int8 => Value::from(col.as_primitive::<Int8Type>().value(i)),
        DataType::UInt64 => Value::from(col.as_primitive::<UInt64Type>().value(i)),
        DataType::UInt32 => Value::from(col.as_primitive::<UInt32Type>().value(i)),
        DataType::List(_) => list(col.as_list::<i32>().value(i).as_ref())?,
        DataType::LargeList(_) => list(col.as_list::<i64>().value(i).as_ref())?,
        DataType::Struct(fields) => {
            let s = col.as_struct();
            let mut obj = serde_json::Map::new();
            for (f, c) in fields.iter().zip(s.columns()) {
                obj.insert(f.name().clone(), arrow_cell(c.as_ref(), i)?);
            }
            Value::Object(obj)
        }
        t => return Err(format!("has type {t}, which onepass does not read (strings, numbers, lists, structs)")),
    })
}

/// A list cell's values as a JSON array.
fn list(values: &dyn Array) -> Result<Value, String> {
    (0..values.len()).map(|j| arrow_cell(values, j)).collect::<Result<Vec<_>, _>>().map(Value::Array)
}
