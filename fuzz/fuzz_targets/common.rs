// Shared by the targets: the readers take paths, so each input is written to a file in a
// per-process temporary directory first.
use std::path::PathBuf;
use std::sync::OnceLock;

pub fn file(name: &str, data: &[u8]) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("onepass-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    });
    let p = dir.join(name);
    std::fs::write(&p, data).unwrap();
    p
}
