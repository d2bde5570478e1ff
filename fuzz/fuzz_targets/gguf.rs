//! GGUF: header, metadata, tensor table and the model configuration read from it.
#![no_main]
use libfuzzer_sys::fuzz_target;
mod common;

fuzz_target!(|data: &[u8]| {
    let p = common::file("m.gguf", data);
    let _ = features::gguf::Gguf::read(&p, &candle_core::Device::Cpu, candle_core::DType::F32);
});
