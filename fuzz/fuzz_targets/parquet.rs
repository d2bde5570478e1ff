//! The UltraFeedback-binarized parquet reader and the "bring your own features" parquet reader.
#![no_main]
use libfuzzer_sys::fuzz_target;
use runner::world::datasets::{read_dataset, Format, ReadOptions};
mod common;

fuzz_target!(|data: &[u8]| {
    let p = common::file("x.parquet", data);
    let o = ReadOptions { format: Some(Format::Ultrafeedback), skip_malformed: true, ..Default::default() };
    let _ = read_dataset(std::slice::from_ref(&p), &o);
    let _ = runner::world::pairs::read_pairs(&p, None);
});
