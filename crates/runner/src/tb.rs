//! TensorBoard event files: the writer the cells' live curves go through (`<run>/tb/<cell>/`,
//! see `settings::live` for what is written under which tag) and a reader for tests and
//! `onepass` itself (a resumed cell keeps what it had written before its checkpoint).
//!
//! The format is TensorFlow's: a file named `events.out.tfevents.<unix seconds>.<host>.<pid>.<n>`
//! holding TFRecords — u64 length (little-endian), the masked CRC-32C of those 8 bytes, the
//! record, the masked CRC-32C of the record — each record one protobuf `tensorflow.Event`. The
//! first event names the format (`file_version = "brain.Event:2"`); a scalar is a
//! `Summary.Value` with `simple_value` (f32, as every TensorBoard writer stores it); a text is a
//! scalar string `TensorProto` under the `text` plugin, rendered as markdown.
//!
//! Why not a TensorBoard crate: on crates.io (checked 2026-11-28) `tensorboard-rs` 0.5.9 depends
//! on `protobuf` 2 and `image` 0.23 (old majors, a second copy of half the image stack) and leaves
//! `add_text` `unimplemented!()`; `tboard` 0.1.1 (one release) compiles its `.proto` files with
//! `prost-build` 0.12 in a build script, which needs a `protoc` binary on every machine that
//! builds onepass, and brings `thiserror` 1 and `anyhow`'s backtraces. The messages a writer
//! needs are five, declared here with `prost`'s derive (field numbers from TensorFlow's
//! `event.proto`, `summary.proto`, `tensor.proto`, `tensor_shape.proto`), with `crc32c` for the
//! checksums.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// `tensorflow.Event`: one record of an event file (the `what` fields onepass writes or reads).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
    #[prost(message, optional, tag = "7")]
    pub session_log: Option<SessionLog>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

/// `tensorflow.Summary.Value`: a scalar (`simple_value`) or a tensor with its plugin.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Value {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    pub tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
}

/// `tensorflow.SummaryMetadata`: which plugin reads a tensor value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

/// `tensorflow.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `tensorflow.TensorProto`, for a string tensor (`dtype` 7 = DT_STRING).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto` (no dimensions: a scalar).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShape {
    #[prost(message, repeated, tag = "2")]
    pub dim: Vec<Dim>,
}

/// `tensorflow.TensorShapeProto.Dim`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Dim {
    #[prost(int64, tag = "1")]
    pub size: i64,
}

/// `tensorflow.SessionLog` (read only: a writer that restarts may mark it).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionLog {
    #[prost(int32, tag = "1")]
    pub status: i32,
}

const DT_STRING: i32 = 7;

impl Event {
    /// The scalars of this event: (tag, value).
    pub fn scalars(&self) -> impl Iterator<Item = (&str, f32)> {
        self.summary.iter().flat_map(|s| &s.value).filter_map(|v| Some((v.tag.as_str(), v.simple_value?)))
    }

    /// The texts of this event: (tag, text).
    pub fn texts(&self) -> impl Iterator<Item = (&str, String)> {
        self.summary.iter().flat_map(|s| &s.value).filter_map(|v| {
            let t = v.tensor.as_ref().filter(|t| t.dtype == DT_STRING)?;
            Some((v.tag.as_str(), String::from_utf8_lossy(t.string_val.first()?).into_owned()))
        })
    }
}

/// TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant.
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord of `data`.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// The records of a TFRecord file's bytes, each checked against its two checksums. A record
/// cut short at the end (a writer killed mid-write) ends the list without an error, as
/// TensorBoard reads it; a checksum that does not match is an error naming the record's offset.
pub fn records(bytes: &[u8]) -> Result<Vec<&[u8]>, String> {
    let (mut out, mut at) = (Vec::new(), 0usize);
    while at < bytes.len() {
        let Some(head) = bytes.get(at..at + 12) else { break };
        let (len, crc) = (&head[..8], u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")));
        if masked_crc(len) != crc {
            return Err(format!("record at byte {at}: the length's checksum does not match"));
        }
        let n = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
        let Some(body) = bytes.get(at + 12..at + 12 + n) else { break };
        let Some(tail) = bytes.get(at + 12 + n..at + 16 + n) else { break };
        if masked_crc(body) != u32::from_le_bytes(tail.try_into().expect("4 bytes")) {
            return Err(format!("record at byte {at}: the data's checksum does not match"));
        }
        out.push(body);
        at += 16 + n;
    }
    Ok(out)
}

/// Every event of an event file, in order.
pub fn read_events(path: &Path) -> Result<Vec<Event>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let recs = records(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    recs.iter()
        .enumerate()
        .map(|(i, r)| <Event as prost::Message>::decode(*r).map_err(|e| format!("{}: event {i}: {e}", path.display())))
        .collect()
}

/// The event files of `dir` (names holding "tfevents", as TensorBoard finds them), sorted by
/// name: the order TensorBoard reads them in. None when `dir` does not exist.
pub fn event_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for e in rd {
        let p = e?.path();
        if p.is_file() && p.file_name().is_some_and(|n| n.to_string_lossy().contains("tfevents")) {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn host() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name: String = String::from_utf8_lossy(&buf[..end])
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
        .collect();
    if ok && !name.is_empty() {
        name
    } else {
        "localhost".into()
    }
}

/// An event file being written. Writes are buffered: [`EventWriter::flush`] makes them visible
/// to a TensorBoard reading the directory.
pub struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// A new event file in `dir` (made if missing), its first event the format's version.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        std::fs::create_dir_all(dir)?;
        let secs = now() as u64;
        let name = format!(
            "events.out.tfevents.{secs:010}.{}.{}.{}",
            host(),
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = std::fs::OpenOptions::new().write(true).create_new(true).open(&path)?;
        let mut w = EventWriter { file: BufWriter::new(file), path };
        w.write(&Event { wall_time: now(), file_version: Some("brain.Event:2".into()), ..Default::default() })?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event.
    pub fn write(&mut self, e: &Event) -> std::io::Result<()> {
        self.file.write_all(&record(&prost::Message::encode_to_vec(e)))
    }

    /// Scalar `tag` = `value` (stored as f32) at `step`, at wall time `wall` (None: now).
    pub fn scalar(&mut self, tag: &str, step: i64, value: f64, wall: Option<f64>) -> std::io::Result<()> {
        let v = Value { tag: tag.into(), simple_value: Some(value as f32), ..Default::default() };
        self.write(&Event {
            wall_time: wall.unwrap_or_else(now),
            step,
            summary: Some(Summary { value: vec![v] }),
            ..Default::default()
        })
    }

    /// Markdown `text` under `tag` at `step` (TensorBoard's Text tab).
    pub fn text(&mut self, tag: &str, step: i64, text: &str, wall: Option<f64>) -> std::io::Result<()> {
        let v = Value {
            tag: tag.into(),
            tensor: Some(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShape::default()),
                string_val: vec![text.as_bytes().to_vec()],
            }),
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData { plugin_name: "text".into(), content: Vec::new() }),
            }),
            ..Default::default()
        };
        self.write(&Event {
            wall_time: wall.unwrap_or_else(now),
            step,
            summary: Some(Summary { value: vec![v] }),
            ..Default::default()
        })
    }

    /// Writes the buffered events to the file.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads an event file back with a reader of its own (length, both checksums, protobuf),
    /// independent of [`records`]: what TensorBoard would see.
    fn read_back(bytes: &[u8]) -> Vec<Event> {
        let mut out = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(rest[8..12].try_into().unwrap());
            // the masked CRC by its definition: ((c >> 15) | (c << 17)) + 0xa282ead8
            #[allow(clippy::manual_rotate)]
            let mask = |c: u32| ((c >> 15) | (c << 17)).wrapping_add(0xa282_ead8);
            assert_eq!(mask(crc32c::crc32c(&rest[..8])), len_crc, "length checksum");
            let body = &rest[12..12 + n];
            let crc = u32::from_le_bytes(rest[12 + n..16 + n].try_into().unwrap());
            assert_eq!(mask(crc32c::crc32c(body)), crc, "data checksum");
            out.push(<Event as prost::Message>::decode(body).unwrap());
            rest = &rest[16 + n..];
        }
        out
    }

    #[test]
    fn scalars_and_text_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        let want = [("eval/loss", 10, 0.312_5), ("eval/accuracy", 10, 0.5), ("eval/loss", 20, 0.41)];
        for (tag, step, v) in want {
            w.scalar(tag, step, v, None).unwrap();
        }
        w.text("completions", 3, "| prompt | completion |\n|---|---|\n| hi | hello |", Some(1.5)).unwrap();
        w.flush().unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let files = event_files(dir.path()).unwrap();
        assert_eq!(files, [w.path().to_path_buf()]);
        let bytes = std::fs::read(w.path()).unwrap();
        let events = read_back(&bytes);
        assert_eq!(events.len(), 5, "file version, three scalars, one text");
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        let got: Vec<(String, i64, f32)> = events[1..4]
            .iter()
            .map(|e| {
                let (t, v) = e.scalars().next().unwrap();
                (t.to_string(), e.step, v)
            })
            .collect();
        let want: Vec<(String, i64, f32)> = want.iter().map(|&(t, s, v)| (t.to_string(), s, v as f32)).collect();
        assert_eq!(got, want);
        let texts: Vec<(&str, String)> = events[4].texts().collect();
        assert_eq!(texts, [("completions", "| prompt | completion |\n|---|---|\n| hi | hello |".to_string())]);
        assert_eq!((events[4].step, events[4].wall_time), (3, 1.5));
        let plugin = events[4].summary.as_ref().unwrap().value[0].metadata.as_ref().unwrap();
        assert_eq!(plugin.plugin_data.as_ref().unwrap().plugin_name, "text");
        // the crate's own reader agrees, and refuses a flipped byte
        assert_eq!(read_events(w.path()).unwrap(), events);
        let mut bad = bytes.clone();
        let at = bytes.len() - 6;
        bad[at] ^= 1;
        assert!(records(&bad).unwrap_err().contains("checksum"), "a flipped byte is caught");
        // a record cut short (a writer killed mid-write) ends the list
        assert_eq!(records(&bytes[..bytes.len() - 3]).unwrap().len(), 4);
    }

    #[test]
    fn the_checksum_is_crc32c() {
        // TensorFlow's crc32c_test: the standard check value of CRC-32C
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }
}
