//! The HH-RLHF / generic jsonl reader (transcript parsing included) and the prompt reader.
#![no_main]
use libfuzzer_sys::fuzz_target;
use runner::world::datasets::{read_dataset, read_prompts, Format, ReadOptions};
mod common;

fuzz_target!(|data: &[u8]| {
    let p = common::file("x.jsonl", data);
    for skip in [false, true] {
        let o = ReadOptions { format: Some(Format::HhRlhf), skip_malformed: skip, ..Default::default() };
        let _ = read_dataset(std::slice::from_ref(&p), &o);
    }
    let _ = read_prompts(std::slice::from_ref(&p), "prompt", Some(50));
});
