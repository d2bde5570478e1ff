//! Dataset readers on files written here in the real layouts: an UltraFeedback-binarized parquet
//! (zstd-compressed, as the hub's files are) and HH-RLHF jsonl.gz.

use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
use arrow_array::{ArrayRef, Float64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Fields};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use runner::datasets::{read_pairs, Format};
use std::sync::Arc;

fn messages(rows: &[Vec<(&str, Option<&str>)>]) -> ArrayRef {
    let fields =
        Fields::from(vec![Field::new("content", DataType::Utf8, true), Field::new("role", DataType::Utf8, true)]);
    let mut b = ListBuilder::new(StructBuilder::new(
        fields.clone(),
        vec![Box::new(StringBuilder::new()), Box::new(StringBuilder::new())],
    ))
    .with_field(Arc::new(Field::new("item", DataType::Struct(fields), true)));
    for row in rows {
        for (role, content) in row {
            let s = b.values();
            s.field_builder::<StringBuilder>(0).unwrap().append_option(*content);
            s.field_builder::<StringBuilder>(1).unwrap().append_value(role);
            s.append(true);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

fn write_uf(path: &std::path::Path, chosen: &[Vec<(&str, Option<&str>)>], rejected: &[Vec<(&str, Option<&str>)>]) {
    let n = chosen.len();
    let batch = RecordBatch::try_from_iter([
        ("prompt", Arc::new(StringArray::from(vec!["p"; n])) as ArrayRef),
        ("prompt_id", Arc::new(StringArray::from(vec!["id"; n])) as ArrayRef),
        ("chosen", messages(chosen)),
        ("rejected", messages(rejected)),
        ("score_chosen", Arc::new(Float64Array::from(vec![8.0; n])) as ArrayRef),
        ("score_rejected", Arc::new(Float64Array::from(vec![3.0; n])) as ArrayRef),
    ])
    .unwrap();
    let props = WriterProperties::builder().set_compression(Compression::ZSTD(ZstdLevel::default())).build();
    let mut w = ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

#[test]
fn ultrafeedback_parquet_zstd() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("train_prefs-00000-of-00001.parquet");
    let c = vec![
        vec![("user", Some("What is 2+2?")), ("assistant", Some("4"))],
        vec![("user", Some("Hi")), ("assistant", Some("Hello!")), ("user", Some("Bye")), ("assistant", Some("Bye!"))],
    ];
    let r = vec![
        vec![("user", Some("What is 2+2?")), ("assistant", Some("5"))],
        vec![("user", Some("Hi")), ("assistant", Some("Hello!")), ("user", Some("Bye")), ("assistant", Some("No."))],
    ];
    write_uf(&p, &c, &r);
    let pairs = read_pairs(&p, Format::Auto, None).unwrap();
    assert_eq!(pairs.len(), 2);
    assert_eq!(pairs[0].chosen.last().unwrap().content, "4");
    assert_eq!(pairs[0].rejected.last().unwrap().content, "5");
    assert_eq!(pairs[1].chosen.len(), 4);
    assert_eq!(pairs[1].rejected[3].role, "assistant");
    assert_eq!(read_pairs(&p, Format::Ultrafeedback, Some(1)).unwrap().len(), 1);

    // a null content and a conversation that does not end with the assistant: file, row, field
    let bad = tmp.path().join("bad.parquet");
    write_uf(
        &bad,
        &[c[0].clone(), vec![("user", Some("q")), ("assistant", None)]],
        &[r[0].clone(), vec![("user", Some("q")), ("assistant", Some("a"))]],
    );
    let e = format!("{:#}", read_pairs(&bad, Format::Auto, None).unwrap_err());
    assert!(
        e.contains("bad.parquet")
            && e.contains("row 1")
            && e.contains("`chosen`")
            && e.contains("message 1 has a null"),
        "{e}"
    );
    let bad2 = tmp.path().join("bad2.parquet");
    write_uf(&bad2, &[vec![("user", Some("q"))]], &[vec![("user", Some("q")), ("assistant", Some("a"))]]);
    let e = format!("{:#}", read_pairs(&bad2, Format::Auto, None).unwrap_err());
    assert!(e.contains("row 0") && e.contains("does not end with an assistant message"), "{e}");
}
