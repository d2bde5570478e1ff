//! safetensors: the header and the score head read from a checkpoint or head file.
#![no_main]
use libfuzzer_sys::fuzz_target;
mod common;

fuzz_target!(|data: &[u8]| {
    let p = common::file("h.safetensors", data);
    let _ = features::head::read_score_head(std::slice::from_ref(&p), 8);
    let _ = features::extract::safetensors_files(p.parent().unwrap());
});
