//! One local cache tier: a directory with a capacity and watermarks.
//!
//! Chunk files live at `chunks/<2 hex>/<64 hex>`; temp files are written beside them as
//! `<id>.tmp.<n>` and renamed into place, so a crash leaves at worst a temp file, which the next
//! scan deletes.

use crate::chunkfile;
use crate::key::KeyId;
use crate::units::ByteSize;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TierKind {
    Hot,
    Warm,
}

impl TierKind {
    pub const ALL: [TierKind; 2] = [TierKind::Hot, TierKind::Warm];

    pub fn as_str(self) -> &'static str {
        match self {
            TierKind::Hot => "hot",
            TierKind::Warm => "warm",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for TierKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TierKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hot" => Ok(TierKind::Hot),
            "warm" => Ok(TierKind::Warm),
            _ => Err(format!("unknown tier `{s}` (expected `hot` or `warm`)")),
        }
    }
}

/// Settings of one tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierConfig {
    pub path: PathBuf,
    pub capacity: ByteSize,
    #[serde(default = "default_high")]
    pub high_watermark: f64,
    #[serde(default = "default_low")]
    pub low_watermark: f64,
    /// fsync each chunk before it is renamed into place. Off by default: a torn chunk is caught
    /// by its checksum and refetched, so durability buys nothing for a cache.
    #[serde(default)]
    pub fsync: bool,
}

fn default_high() -> f64 {
    0.9
}
fn default_low() -> f64 {
    0.8
}

impl TierConfig {
    pub fn new(path: impl Into<PathBuf>, capacity: u64) -> Self {
        TierConfig {
            path: path.into(),
            capacity: ByteSize(capacity),
            high_watermark: default_high(),
            low_watermark: default_low(),
            fsync: false,
        }
    }

    /// Checks the watermarks; `key` is the config path of this tier, for the message.
    pub fn validate(&self, key: &str) -> Result<(), (String, String)> {
        let bad = |f: &str, m: &str| Err((format!("{key}.{f}"), m.to_string()));
        if !(0.0..=1.0).contains(&self.high_watermark) || self.high_watermark == 0.0 {
            return bad("high_watermark", "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.low_watermark) {
            return bad("low_watermark", "must be in [0, 1]");
        }
        if self.low_watermark > self.high_watermark {
            return bad("low_watermark", "must not be above high_watermark");
        }
        if self.path.as_os_str().is_empty() {
            return bad("path", "must not be empty");
        }
        Ok(())
    }
}

/// A tier's directory and its counters. Accounting of used bytes lives in the index.
#[derive(Debug)]
pub struct Tier {
    pub kind: TierKind,
    pub config: TierConfig,
    root: PathBuf,
    tmp_seq: AtomicU64,
}

impl Tier {
    pub fn open(kind: TierKind, config: TierConfig) -> io::Result<Tier> {
        let root = config.path.join("chunks");
        std::fs::create_dir_all(&root)?;
        Ok(Tier { kind, config, root, tmp_seq: AtomicU64::new(0) })
    }

    pub fn capacity(&self) -> u64 {
        self.config.capacity.0
    }
    pub fn high_bytes(&self) -> u64 {
        (self.capacity() as f64 * self.config.high_watermark) as u64
    }
    pub fn low_bytes(&self) -> u64 {
        (self.capacity() as f64 * self.config.low_watermark) as u64
    }

    pub fn chunk_path(&self, id: &KeyId) -> PathBuf {
        let hex = id.to_hex();
        self.root.join(&hex[..2]).join(hex)
    }

    /// Where an entry's file lives: whole-file copies carry a suffix, so a scan can tell them
    /// from chunk files without reading them.
    pub fn entry_path(&self, id: &KeyId, key: &crate::ChunkKey) -> PathBuf {
        let p = self.chunk_path(id);
        if key.is_whole() { p.with_extension(WHOLE_EXT) } else { p }
    }

    /// A number no other temp file of this tier in this process has.
    pub(crate) fn next_tmp(&self) -> u64 {
        self.tmp_seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Writes a chunk to a temp file beside its final name, creating the fan-out directory on
    /// first use. [`Tier::commit`] renames it into place.
    pub fn write_tmp(&self, id: &KeyId, key: &crate::ChunkKey, data: &[u8]) -> io::Result<(PathBuf, u64)> {
        let dest = self.chunk_path(id);
        let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = dest.with_extension(format!("tmp.{}.{n}", std::process::id()));
        let len = in_fan_out(&dest, || chunkfile::write_tmp(&tmp, key, data, self.config.fsync))?;
        Ok((tmp, len))
    }

    /// Renames a temp file written by [`Tier::write_tmp`] to the chunk's name.
    pub fn commit(&self, tmp: &Path, id: &KeyId) -> io::Result<()> {
        std::fs::rename(tmp, self.chunk_path(id)).inspect_err(|_| {
            let _ = std::fs::remove_file(tmp);
        })
    }

    /// Every file under the tier: chunk files and leftovers of interrupted writes.
    pub fn scan(&self) -> io::Result<Vec<ScanItem>> {
        let mut out = Vec::new();
        for fan in std::fs::read_dir(&self.root)? {
            let fan = fan?;
            if !fan.file_type()?.is_dir() {
                continue;
            }
            for f in std::fs::read_dir(fan.path())? {
                let f = f?;
                let name = f.file_name().to_string_lossy().into_owned();
                let path = f.path();
                let item = match KeyId::from_hex(&name) {
                    Some(id) => ScanItem::Chunk { id, path },
                    None => match name.rsplit_once('.').and_then(|(n, ext)| Some((KeyId::from_hex(n)?, ext))) {
                        Some((id, WHOLE_EXT)) => ScanItem::Whole { id, path },
                        // Read along with its data file.
                        Some((_, WHOLE_KEY_EXT)) => continue,
                        _ => ScanItem::Stray { path },
                    },
                };
                out.push(item);
            }
        }
        Ok(out)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
}

#[derive(Debug)]
pub enum ScanItem {
    Chunk {
        id: KeyId,
        path: PathBuf,
    },
    Stray {
        path: PathBuf,
    },
    /// A whole-file copy; its key is in a sidecar beside it.
    Whole {
        id: KeyId,
        path: PathBuf,
    },
}

/// Extension of whole-file copies.
pub(crate) const WHOLE_EXT: &str = "file";
/// Extension of the sidecar that holds a whole-file copy's key.
pub(crate) const WHOLE_KEY_EXT: &str = "filekey";

/// Runs `create`, which makes a file at `path`, and if it finds the fan-out directory missing,
/// creates that and runs it again: asking for the directory before every file would cost two
/// system calls each, which a dataset of small files pays thousands of times.
pub(crate) fn in_fan_out<T>(path: &Path, create: impl Fn() -> io::Result<T>) -> io::Result<T> {
    match create() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(path.parent().expect("tier paths have a parent"))?;
            create()
        }
        r => r,
    }
}
