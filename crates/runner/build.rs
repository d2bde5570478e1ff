//! Captures the git revision and dirty flag at build time for meta.json.
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let rev = git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).map(|s| !s.is_empty());
    println!("cargo:rustc-env=ONEPASS_GIT_REV={rev}");
    println!("cargo:rustc-env=ONEPASS_GIT_DIRTY={}", dirty.map_or("unknown".to_string(), |d| d.to_string()));
    // re-run when HEAD or the index moves
    for p in ["../../.git/HEAD", "../../.git/index"] {
        if std::path::Path::new(p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
}
