//! `hf:` sources without the real hub: spec parsing, HF_HUB_OFFLINE against a cache laid out as
//! huggingface_hub lays it out, and a local HTTP server that refuses (401), hides (404) or is not
//! there, for the messages a user sees.

use features::hub::{resolve, HubEnv, HubSpec, Resolved};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;

#[test]
fn specs_parse() {
    let s = HubSpec::parse("HuggingFaceTB/SmolLM2-135M-Instruct").unwrap();
    assert_eq!(
        (s.repo.as_str(), s.revision.as_str(), s.file.as_deref()),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "main", None)
    );
    let s = HubSpec::parse("Qwen/Qwen2.5-7B-Instruct-GGUF@v1.0:qwen2.5-7b-instruct-q8_0.gguf").unwrap();
    assert_eq!(s.revision, "v1.0");
    assert_eq!(s.file.as_deref(), Some("qwen2.5-7b-instruct-q8_0.gguf"));
    assert_eq!(s.display(), "hf:Qwen/Qwen2.5-7B-Instruct-GGUF@v1.0:qwen2.5-7b-instruct-q8_0.gguf");
    for bad in ["justaname", "a/b/c", "a/b@", "a/b:weights.bin", "/b", "a b/c"] {
        let e = HubSpec::parse(bad).unwrap_err().to_string();
        assert!(e.contains(&format!("hf:{bad}")) && e.contains("expected hf:<owner>/<name>"), "{bad}: {e}");
    }
    assert!(matches!(features::Source::parse("hf:a/b").unwrap(), features::Source::Hub(_)));
}

/// `$home/hub/models--owner--name/{refs/main, snapshots/<commit>/files}`.
fn fake_cache(home: &Path, files: &[(&str, &str)]) -> std::path::PathBuf {
    let repo = home.join("hub").join("models--owner--tiny");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "c0ffee").unwrap();
    let snap = repo.join("snapshots").join("c0ffee");
    std::fs::create_dir_all(&snap).unwrap();
    for (f, body) in files {
        std::fs::write(snap.join(f), body).unwrap();
    }
    snap
}

fn offline(home: &Path) -> HubEnv {
    HubEnv { home: Some(home.to_path_buf()), offline: true, ..Default::default() }
}

#[test]
fn offline_resolves_from_the_cache_and_names_what_is_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let base = [("config.json", "{}"), ("tokenizer.json", "{}"), ("tokenizer_config.json", "{}")];
    let mut files = base.to_vec();
    files.push(("model.safetensors", "x"));
    let snap = fake_cache(tmp.path(), &files);
    let spec = HubSpec::parse("owner/tiny").unwrap();
    assert_eq!(resolve(&spec, &offline(tmp.path())).unwrap(), Resolved::Dir(snap.clone()));

    // a sharded checkpoint with one shard missing: the shard is named
    std::fs::remove_file(snap.join("model.safetensors")).unwrap();
    std::fs::write(
        snap.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    std::fs::write(snap.join("model-00001-of-00002.safetensors"), "x").unwrap();
    let e = resolve(&spec, &offline(tmp.path())).unwrap_err().to_string();
    assert!(e.contains("model-00002-of-00002.safetensors") && e.contains("HF_HUB_OFFLINE"), "{e}");
    std::fs::write(snap.join("model-00002-of-00002.safetensors"), "x").unwrap();
    assert_eq!(resolve(&spec, &offline(tmp.path())).unwrap(), Resolved::Dir(snap.clone()));

    // a missing tokenizer, another revision, a GGUF file
    std::fs::remove_file(snap.join("tokenizer.json")).unwrap();
    let e = resolve(&spec, &offline(tmp.path())).unwrap_err().to_string();
    assert!(e.contains("hf:owner/tiny@main") && e.contains("`tokenizer.json`"), "{e}");
    let e = resolve(&HubSpec::parse("owner/tiny@v2").unwrap(), &offline(tmp.path())).unwrap_err().to_string();
    assert!(e.contains("hf:owner/tiny@v2") && e.contains("config.json"), "{e}");
    std::fs::write(snap.join("m.gguf"), "x").unwrap();
    assert_eq!(
        resolve(&HubSpec::parse("owner/tiny:m.gguf").unwrap(), &offline(tmp.path())).unwrap(),
        Resolved::Gguf(snap.join("m.gguf"))
    );
}

/// A server that answers every request with `status` and counts them.
fn server(status: &'static str) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = write!(s, "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    format!("http://{addr}")
}

fn online(home: &Path, endpoint: String, token: Option<&str>) -> HubEnv {
    HubEnv {
        home: Some(home.to_path_buf()),
        endpoint: Some(endpoint),
        token: token.map(String::from),
        ..Default::default()
    }
}

#[test]
fn refused_missing_and_unreachable_hubs_say_what_to_do() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = HubSpec::parse("meta-llama/Meta-Llama-3-8B-Instruct").unwrap();
    let e = resolve(&spec, &online(tmp.path(), server("401 Unauthorized"), None)).unwrap_err().to_string();
    assert!(e.contains("gated or private") && e.contains("HTTP 401") && e.contains("set HF_TOKEN"), "{e}");
    let e = resolve(&spec, &online(tmp.path(), server("403 Forbidden"), Some("hf_x"))).unwrap_err().to_string();
    assert!(e.contains("HTTP 403") && e.contains("check that your token"), "{e}");
    let e = resolve(&spec, &online(tmp.path(), server("404 Not Found"), None)).unwrap_err().to_string();
    assert!(e.contains("has no `config.json`"), "{e}");
    // nothing listens on a port we bound and released
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let e = resolve(&spec, &online(tmp.path(), format!("http://127.0.0.1:{port}"), None)).unwrap_err().to_string();
    assert!(e.contains("downloading `config.json` failed") && e.contains("HF_HUB_OFFLINE=1"), "{e}");
}

#[test]
fn dataset_files_from_the_cache_by_pattern() {
    use features::hub::{dataset_files, HubDataset};
    let d = HubDataset::parse("OpenRLHF/preference_dataset_mixture2_and_safe_pku:data/train-*.parquet").unwrap();
    assert_eq!((d.revision.as_str(), d.file.as_str()), ("main", "data/train-*.parquet"));
    assert!(HubDataset::parse("owner/name").unwrap_err().to_string().contains("no `:<file>`"));
    assert!(HubDataset::parse("owner:x.parquet").unwrap_err().to_string().contains("<owner>/<name>"));
    assert_eq!(HubDataset::parse("o/n@v1:a.parquet").unwrap().display(), "hf:datasets/o/n@v1:a.parquet");

    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("hub").join("datasets--owner--data");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "beef").unwrap();
    let snap = repo.join("snapshots").join("beef");
    std::fs::create_dir_all(snap.join("data")).unwrap();
    for f in ["data/train-00001-of-00002-b.parquet", "data/train-00000-of-00002-a.parquet", "data/test-0.parquet"] {
        std::fs::write(snap.join(f), "x").unwrap();
    }
    let got =
        dataset_files(&HubDataset::parse("owner/data:data/train-*.parquet").unwrap(), &offline(tmp.path())).unwrap();
    assert_eq!(
        got,
        vec![snap.join("data/train-00000-of-00002-a.parquet"), snap.join("data/train-00001-of-00002-b.parquet")]
    );
    let one =
        dataset_files(&HubDataset::parse("owner/data:data/test-0.parquet").unwrap(), &offline(tmp.path())).unwrap();
    assert_eq!(one, vec![snap.join("data/test-0.parquet")]);
    let e = dataset_files(&HubDataset::parse("owner/data:data/dev-*.parquet").unwrap(), &offline(tmp.path()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no file of the repository matches `data/dev-*.parquet`") && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );
    // online, a hub that cannot list the repository
    let e = dataset_files(
        &HubDataset::parse("owner/data:data/train-*.parquet").unwrap(),
        &online(tmp.path(), server("500 Internal Server Error"), None),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("listing the repository failed") && e.contains("HF_HUB_OFFLINE=1"), "{e}");
}
