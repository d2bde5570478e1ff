//! A content-addressed feature cache.
//!
//! Layout: `<root>/<space>/` holds the features of one *space* — one model (weight digest),
//! tokenizer, chat template, φ options and dtype: [`space_key`]. Inside it, `shard-NNNNNN.safetensors`
//! files each hold `phi` (rows × d, f32) and `keys` (rows × 32, u8: the blake3 of each
//! conversation's canonical JSON), readable by numpy/torch; `index.json` names the space and its
//! dimension. The index of keys is rebuilt from the shards' `keys` at open, so a shard written
//! by a killed run is either whole (written to a temporary name and renamed) or absent.

use crate::template::Message;
use crate::Error;
use memmap2::Mmap;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub type Key = [u8; 32];

/// The key of one conversation inside a space: blake3 of its canonical JSON.
pub fn text_key(messages: &[Message]) -> Key {
    let json = serde_json::to_vec(messages).expect("messages serialise");
    *blake3::hash(&json).as_bytes()
}

/// The key of a space: everything that decides φ besides the text.
pub fn space_key(parts: &[(&str, &str)]) -> String {
    let mut h = blake3::Hasher::new();
    for (k, v) in parts {
        h.update(k.as_bytes());
        h.update(b"=");
        h.update(v.as_bytes());
        h.update(b"\n");
    }
    h.finalize().to_hex()[..24].to_string()
}

struct Shard {
    map: Mmap,
    /// Byte range of `phi` inside `map` (found once at open, not per lookup).
    phi: std::ops::Range<usize>,
}

pub struct FeatureCache {
    pub dir: PathBuf,
    pub dim: usize,
    shards: Vec<Shard>,
    index: HashMap<Key, (u32, u32)>,
    pub hits: u64,
    pub misses: u64,
}

fn io(p: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: {e}", p.display()))
}

/// Writes `bytes` to a temporary name, then renames it to `path`. A failure is
/// [`Error::Storage`] (the temporary file removed). A test hook, as the runner's:
/// `ONEPASS_FAIL_WRITE=feature-cache` makes every shard write fail as a full disk does.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let write = || -> std::io::Result<()> {
        if std::env::var("ONEPASS_FAIL_WRITE").is_ok_and(|p| p == "feature-cache") {
            return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
        }
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|cause| {
        let _ = std::fs::remove_file(&tmp);
        Error::Storage { path: path.to_path_buf(), cause }
    })
}

impl FeatureCache {
    /// Opens (or creates) the space `space` under `root` for features of dimension `dim`;
    /// `describe` is stored in index.json for people reading the cache.
    pub fn open(root: &Path, space: &str, dim: usize, describe: serde_json::Value) -> Result<FeatureCache, Error> {
        let dir = root.join(space);
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
        let index_path = dir.join("index.json");
        if index_path.exists() {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&index_path).map_err(|e| io(&index_path, e))?)
                    .map_err(|e| Error::Format(format!("{}: {e}", index_path.display())))?;
            let have = v.get("dim").and_then(|d| d.as_u64()).unwrap_or(0) as usize;
            if have != dim {
                return Err(Error::Input(format!(
                    "{}: the cached features have dimension {have}, but the model gives {dim}",
                    index_path.display()
                )));
            }
        } else {
            let v = serde_json::json!({ "format": "onepass-feature-cache/1", "space": space, "dim": dim, "describe": describe });
            write_atomic(&index_path, serde_json::to_string_pretty(&v).expect("json").as_bytes())?;
        }
        let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(|e| io(&dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        names.sort();
        let mut cache = FeatureCache { dir, dim, shards: Vec::new(), index: HashMap::new(), hits: 0, misses: 0 };
        for p in names {
            cache.load_shard(&p)?;
        }
        Ok(cache)
    }

    fn load_shard(&mut self, p: &Path) -> Result<(), Error> {
        let f = std::fs::File::open(p).map_err(|e| io(p, e))?;
        // SAFETY: shards are written once under a temporary name and renamed; never modified.
        let map = unsafe { Mmap::map(&f) }.map_err(|e| io(p, e))?;
        // a shard is written whole or not at all: one that does not read was damaged after
        // (disk, copy): its rows can be computed again
        let bad = |m: String| {
            Error::Format(format!(
                "{}: {m} (a damaged cache shard: delete it and its rows are computed again)",
                p.display()
            ))
        };
        let st = SafeTensors::deserialize(&map).map_err(|e| bad(format!("not a readable safetensors shard: {e}")))?;
        let phi = st.tensor("phi").map_err(|e| bad(format!("{e}")))?;
        let keys = st.tensor("keys").map_err(|e| bad(format!("{e}")))?;
        let (rows, d) = match phi.shape() {
            [r, d] => (*r, *d),
            s => return Err(bad(format!("`phi` has shape {s:?}, expected (rows, d)"))),
        };
        if d != self.dim {
            return Err(Error::Input(format!(
                "{}: cached features have dimension {d}, but the model gives {}",
                p.display(),
                self.dim
            )));
        }
        if phi.dtype() != Dtype::F32 || keys.dtype() != Dtype::U8 || keys.shape() != [rows, 32] {
            return Err(bad("expected phi: f32 (rows, d) and keys: u8 (rows, 32)".into()));
        }
        let s = self.shards.len() as u32;
        for (r, k) in keys.data().chunks_exact(32).enumerate() {
            self.index.insert(k.try_into().expect("32 bytes"), (s, r as u32));
        }
        let start = phi.data().as_ptr() as usize - map.as_ptr() as usize;
        let phi = start..start + rows * d * 4;
        drop(st);
        self.shards.push(Shard { map, phi });
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
    pub fn contains(&self, k: &Key) -> bool {
        self.index.contains_key(k)
    }

    /// Every cached (key, φ), in shard and row order.
    pub fn rows(&self) -> impl Iterator<Item = (Key, Vec<f32>)> + '_ {
        let mut all: Vec<(&Key, &(u32, u32))> = self.index.iter().collect();
        all.sort_by_key(|(_, &pos)| pos);
        all.into_iter().map(|(k, &(s, r))| (*k, self.row(s, r)))
    }

    fn row(&self, s: u32, r: u32) -> Vec<f32> {
        let shard = &self.shards[s as usize];
        let data = &shard.map[shard.phi.clone()];
        let row = &data[r as usize * self.dim * 4..(r as usize + 1) * self.dim * 4];
        row.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))).collect()
    }

    /// Copies the rows of another directory of the same space (e.g. the cache of one shard of an
    /// extraction) that this one lacks, as one new shard. Returns (rows added, rows already here).
    pub fn merge_from(&mut self, other: &Path) -> Result<(usize, usize), Error> {
        let index_path = other.join("index.json");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&index_path).map_err(|e| io(&index_path, e))?)
                .map_err(|e| Error::Format(format!("{}: {e}", index_path.display())))?;
        let space = self.dir.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        if v.get("space").and_then(|s| s.as_str()) != Some(space.as_str()) {
            return Err(Error::Input(format!(
                "{}: `space` is {}, expected {space}",
                index_path.display(),
                v.get("space").map_or("missing".to_string(), |s| s.to_string())
            )));
        }
        let src =
            FeatureCache::open(other.parent().unwrap_or(Path::new(".")), &space, self.dim, v["describe"].clone())?;
        let (mut keys, mut rows, mut present) = (Vec::new(), Vec::new(), 0);
        for (k, r) in src.rows() {
            if self.index.contains_key(&k) {
                present += 1;
            } else {
                keys.push(k);
                rows.push(r);
            }
        }
        self.put(&keys, &rows)?;
        Ok((keys.len(), present))
    }

    /// The cached φ of `k` (counts a hit or a miss).
    pub fn get(&mut self, k: &Key) -> Option<Vec<f32>> {
        let Some(&(s, r)) = self.index.get(k) else {
            self.misses += 1;
            return None;
        };
        self.hits += 1;
        Some(self.row(s, r))
    }

    /// Writes new rows as one shard (keys already present are skipped).
    pub fn put(&mut self, keys: &[Key], rows: &[Vec<f32>]) -> Result<(), Error> {
        let mut seen = std::collections::HashSet::new();
        let fresh: Vec<usize> =
            (0..keys.len()).filter(|&i| !self.index.contains_key(&keys[i]) && seen.insert(keys[i])).collect();
        if fresh.is_empty() {
            return Ok(());
        }
        let mut phi = Vec::with_capacity(fresh.len() * self.dim * 4);
        let mut kb = Vec::with_capacity(fresh.len() * 32);
        for &i in &fresh {
            if rows[i].len() != self.dim {
                return Err(Error::Input(format!(
                    "a feature row of length {} for a cache of dimension {}",
                    rows[i].len(),
                    self.dim
                )));
            }
            phi.extend(rows[i].iter().flat_map(|v| v.to_le_bytes()));
            kb.extend_from_slice(&keys[i]);
        }
        let n = fresh.len();
        let views = vec![
            ("phi", TensorView::new(Dtype::F32, vec![n, self.dim], &phi).expect("shape")),
            ("keys", TensorView::new(Dtype::U8, vec![n, 32], &kb).expect("shape")),
        ];
        let bytes = safetensors::serialize(views, None).map_err(|e| Error::Io(format!("serialising a shard: {e}")))?;
        // the name is the hash of the content: two processes writing the same rows agree
        let name = format!("shard-{}.safetensors", &blake3::hash(&bytes).to_hex()[..16]);
        let path = self.dir.join(name);
        if !path.exists() {
            write_atomic(&path, &bytes)?;
        }
        self.load_shard(&path)
    }
}
