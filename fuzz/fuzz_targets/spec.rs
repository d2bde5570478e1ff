//! The spec parser and the plan's validation, for every env kind: the plan reads nothing but the
//! spec, so a fuzzed spec cannot point it at a file.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = std::path::Path::new("fuzz.toml");
    // --set overrides take the same path through toml_edit
    let overrides: Vec<String> = text.lines().take(2).filter(|l| l.contains('=')).map(String::from).collect();
    for o in [&[][..], &overrides[..]] {
        if let Ok((s, text)) = runner::spec::parse(text, path, o) {
            let _ = runner::plan::build(s, path, &text, o);
        }
    }
});
