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
    // the versions of the third-party crates that produce the numbers, for meta.json
    let lock = std::fs::read_to_string("../../Cargo.lock").unwrap_or_default();
    let wanted = ["candle-core", "gemm", "tokenizers", "minijinja", "parquet", "rand_chacha", "nalgebra"];
    let mut deps = Vec::new();
    for pkg in lock.split("[[package]]") {
        let field = |k: &str| {
            pkg.lines()
                .find_map(|l| l.strip_prefix(k).map(|v| v.trim_start_matches(" = ").trim_matches('"').to_string()))
        };
        if let (Some(name), Some(version)) = (field("name"), field("version")) {
            if wanted.contains(&name.as_str()) && !deps.iter().any(|d: &String| d.starts_with(&format!("{name}="))) {
                deps.push(format!("{name}={version}"));
            }
        }
    }
    println!("cargo:rustc-env=ONEPASS_DEP_VERSIONS={}", deps.join(","));
    println!("cargo:rerun-if-changed=../../Cargo.lock");
    // re-run when HEAD, a branch or the index moves, and when a source file changes (an edit
    // that is not staged leaves the index alone, and meta.json's git_dirty would go stale)
    for p in [
        "../../.git/HEAD",
        "../../.git/index",
        "../../.git/refs",
        "../../.git/packed-refs",
        "../../crates",
        "../../Cargo.toml",
    ] {
        if std::path::Path::new(p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
}
