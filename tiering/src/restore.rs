//! What survives a restart: the index is rebuilt by scanning the tier directories (chunk files
//! carry their own key), and pins and access history are reloaded from the state dir.
//!
//! Nothing here trusts what it reads. A torn or foreign chunk file is deleted; a corrupt state
//! file is set aside with a warning and the cache starts without it.

use crate::chunkfile;
use crate::core::{Core, Pin};
use crate::error::CacheError;
use crate::index::{Entry, now_ms};
use crate::tier::ScanItem;
use std::collections::HashMap;
use std::path::Path;
use tracing::warn;

const PINS_FILE: &str = "pins.json";
const ACCESS_FILE: &str = "access.json";

#[derive(Debug, Default)]
pub(crate) struct RebuildReport {
    pub chunks: u64,
    pub bytes: u64,
    pub discarded: u64,
}

pub(crate) fn rebuild_index(core: &Core) -> RebuildReport {
    let access = load_access(&core.state_dir);
    let mut report = RebuildReport::default();
    let mut ix = core.lock();
    // Hot first: after a crash in the middle of a move both tiers may hold a chunk, and the hot
    // copy is the one worth keeping.
    for tier in core.tiers.iter().flatten() {
        let items = match tier.scan() {
            Ok(items) => items,
            Err(e) => {
                warn!(tier = %tier.kind, path = %tier.root().display(), error = %e, "cannot scan tier; starting it empty");
                continue;
            }
        };
        for item in items {
            match item {
                ScanItem::Whole { id, path } => {
                    // Kept only whole and with its key: it was fsynced before being renamed
                    // into place, and its sidecar written before that.
                    let sidecar = path.with_extension(crate::tier::WHOLE_KEY_EXT);
                    let key =
                        std::fs::read(&sidecar).ok().and_then(|b| serde_json::from_slice::<crate::ChunkKey>(&b).ok());
                    let len = std::fs::metadata(&path).map(|m| m.len()).ok();
                    let sound = match (&key, len) {
                        (Some(k @ crate::ChunkKey { identity: crate::Identity::File { size, .. }, .. }), Some(len)) => {
                            k.id() == id
                                && *size == len
                                && tier.kind == crate::TierKind::Hot
                                && !ix.entries.contains_key(&id)
                        }
                        _ => false,
                    };
                    if !sound {
                        let _ = std::fs::remove_file(&path);
                        let _ = std::fs::remove_file(&sidecar);
                        report.discarded += 1;
                        continue;
                    }
                    let (key, len) = (key.expect("checked"), len.expect("checked"));
                    let pin = core.resolve(&key.path).pin;
                    ix.insert(id, Entry::new(key, tier.kind, len, len, now_ms(), pin));
                }
                ScanItem::Stray { path } => {
                    let _ = std::fs::remove_file(&path);
                    report.discarded += 1;
                }
                ScanItem::Chunk { id, path } => {
                    let header = chunkfile::read_header(&path);
                    let keep = match &header {
                        Ok(h) => h.key.id() == id && !ix.entries.contains_key(&id),
                        Err(e) => {
                            warn!(path = %path.display(), error = %e, "discarding unusable chunk file");
                            false
                        }
                    };
                    if !keep {
                        let _ = std::fs::remove_file(&path);
                        report.discarded += 1;
                        continue;
                    }
                    let h = header.expect("kept headers are valid");
                    let disk_len = h.file_len();
                    let mtime = std::fs::metadata(&path)
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                        .map(|d| d.as_millis() as u64)
                        .unwrap_or_else(now_ms);
                    let (last_ms, hits) = access.get(&id.to_hex()).copied().unwrap_or((mtime, 1));
                    report.chunks += 1;
                    report.bytes += h.data_len;
                    let pin = core.resolve(&h.key.path).pin;
                    ix.insert(
                        id,
                        Entry {
                            key: h.key,
                            tier: tier.kind,
                            disk_len,
                            data_len: h.data_len,
                            inserted_ms: mtime,
                            last_ms,
                            hits,
                            crf: 1.0,
                            pin,
                            moving: false,
                            generation: 0,
                        },
                    );
                }
            }
        }
    }
    core.update_gauges(&ix);
    report
}

/// Takes an exclusive lock on `<state_dir>/lock`, released when the process exits however it
/// exits, so a second daemon on the same cache fails at once instead of corrupting it.
pub(crate) fn lock_state_dir(dir: &Path) -> Result<std::fs::File, CacheError> {
    let path = dir.join("lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| CacheError::io("opening lock file", &path, e))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => Err(CacheError::State {
            path,
            message: "another strata process is using this cache; stop it or give this one another state_dir".into(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(CacheError::io("locking", &path, e)),
    }
}

/// Removes the temp files of state writes that a crash or power cut interrupted. Called with
/// the state dir's lock held, so no other process is writing one.
pub(crate) fn remove_stale_temps(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let ours = [PINS_FILE, ACCESS_FILE].iter().any(|f| name.starts_with(&format!(".{f}.")));
        if ours && name.ends_with(".tmp") {
            match std::fs::remove_file(e.path()) {
                Ok(()) => tracing::info!(file = name, "removed the temp file of an interrupted state write"),
                Err(err) => {
                    warn!(file = name, error = %err, "cannot remove the temp file of an interrupted state write")
                }
            }
        }
    }
}

/// Replaces the state file `name` in `dir` whole and durably: a crash or power cut leaves the
/// old file or the new one, never an empty or torn one that the next start would set aside,
/// losing every pin. The temp file is this write's own: another process on the same cache may
/// be saving the same state.
fn write_state(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), CacheError> {
    let path = dir.join(name);
    write_durably(&path, bytes).map_err(|e| CacheError::io("writing state file", &path, e))
}

/// Replaces `path` with `bytes` so that after a crash or power cut it holds either the old
/// content or the new, whole: a private temp file beside it, synced, renamed over it, and the
/// directory synced. The temp's name is unique per call, so concurrent writers never rename
/// each other's half-written file. [`remove_stale_temps`] clears those a crash leaves of the
/// state files; one of the policy file's is a dotfile beside it, ignored.
pub(crate) fn write_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|_| f.sync_all()))
        .and_then(|_| std::fs::rename(&tmp, path))
        .and_then(|_| std::fs::File::open(dir).and_then(|d| d.sync_all()));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn read_state<T: serde::de::DeserializeOwned + Default>(dir: &Path, name: &str) -> T {
    let path = dir.join(name);
    match std::fs::read(&path) {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(v) => v,
            Err(e) => {
                let aside = dir.join(format!("{name}.corrupt"));
                warn!(path = %path.display(), error = %e, moved_to = %aside.display(), "state file is corrupt; starting without it");
                let _ = std::fs::rename(&path, aside);
                T::default()
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => T::default(),
        Err(e) => {
            warn!(path = %path.display(), error = %e, "cannot read state file; starting without it");
            T::default()
        }
    }
}

pub(crate) fn load_pins(dir: &Path) -> Vec<Pin> {
    read_state(dir, PINS_FILE)
}

pub(crate) fn save_pins(dir: &Path, pins: &[Pin]) -> Result<(), CacheError> {
    write_state(dir, PINS_FILE, &serde_json::to_vec_pretty(pins).expect("pins serialise"))
}

fn load_access(dir: &Path) -> HashMap<String, (u64, u64)> {
    read_state(dir, ACCESS_FILE)
}

pub(crate) fn save_access(core: &Core) -> Result<(), CacheError> {
    let snapshot = core.access_snapshot();
    write_state(&core.state_dir, ACCESS_FILE, &serde_json::to_vec(&snapshot).expect("access map serialises"))
}

#[cfg(test)]
mod stale_temp_tests {
    use super::*;

    #[test]
    fn temps_of_interrupted_state_writes_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for name in [".pins.json.4242.0.tmp", ".access.json.17.3.tmp", "pins.json", ".other.tmp", "lock"] {
            std::fs::write(d.join(name), b"x").unwrap();
        }
        remove_stale_temps(d);
        let mut left: Vec<String> =
            std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, [".other.tmp", "lock", "pins.json"]);
    }
}
