//! The feature cache: rows survive a reopen bit for bit, duplicates are stored once, and a
//! dimension mismatch or a damaged shard is an error naming the file.

use features::cache::{text_key, FeatureCache};
use features::Message;

#[test]
fn rows_survive_a_reopen_and_bad_shards_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let conv = |i: usize| vec![Message::new("user", &format!("q{i}")), Message::new("assistant", "a")];
    let keys: Vec<_> = (0..5).map(|i| text_key(&conv(i))).collect();
    let rows: Vec<Vec<f32>> = (0..5).map(|i| (0..4).map(|j| (i * 4 + j) as f32 * 0.37 - 1.0).collect()).collect();
    {
        let mut c = FeatureCache::open(tmp.path(), "space", 4, serde_json::json!({})).unwrap();
        assert!(c.get(&keys[0]).is_none());
        c.put(&keys[..3], &rows[..3]).unwrap();
        c.put(&keys[2..], &rows[2..]).unwrap(); // key 2 again: skipped
        assert_eq!(c.len(), 5);
        assert_eq!((c.hits, c.misses), (0, 1));
    }
    let mut c = FeatureCache::open(tmp.path(), "space", 4, serde_json::json!({})).unwrap();
    for (k, r) in keys.iter().zip(&rows) {
        assert_eq!(c.get(k).as_ref(), Some(r));
    }
    assert_eq!(c.hits, 5);
    assert_ne!(text_key(&conv(0)), text_key(&[Message::new("user", "q0"), Message::new("assistant", "a ")]));

    let e = FeatureCache::open(tmp.path(), "space", 5, serde_json::json!({})).err().unwrap().to_string();
    assert!(e.contains("index.json") && e.contains("dimension 4") && e.contains("gives 5"), "{e}");

    let shard = std::fs::read_dir(tmp.path().join("space"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .unwrap();
    std::fs::write(&shard, b"garbage").unwrap();
    let e = FeatureCache::open(tmp.path(), "space", 4, serde_json::json!({})).err().unwrap().to_string();
    assert!(e.contains(&shard.file_name().unwrap().to_string_lossy().to_string()), "{e}");
}
