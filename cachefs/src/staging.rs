//! Write staging: a file being written through the mount lives in a local staging file until
//! it is published (uploaded) as one object. A small manifest beside it names the target and
//! says whether the content is complete, so a restart can tell a finished checkpoint whose
//! upload was interrupted (upload it again) from one cut off mid-write (never upload a part).

use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use strata_tiering::chunkfile::Crc32c;
use strata_tiering::upload::PartUpload;

/// An upload that started while the file was being written.
#[derive(Debug)]
pub struct Stream {
    pub upload: PartUpload,
    /// Bytes from the start of the file handed to the upload.
    pub sent: u64,
    /// CRC32C of those bytes.
    pub crc: Crc32c,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Object path the content is for.
    pub target: String,
    /// The writer finished (flush, fsync or close): the data file is synced, or `crc32c`
    /// says what it must hold.
    pub complete: bool,
    /// Length and CRC32C of the complete content, when the data file was not synced (it went
    /// up while being written): a crash may have torn it, and only a file that matches is
    /// uploaded again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<(u64, u32)>,
    /// Its upload failed and fsync or close told the writer so: a restart must not upload it
    /// behind the writer's back (it may have written the object again since).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
}

#[derive(Debug)]
pub struct Staged {
    file: File,
    data: PathBuf,
    manifest: PathBuf,
    pub target: String,
    pub len: u64,
    /// Bytes written since the last publish.
    pub dirty: bool,
    /// The upload under way while the file is written, if any.
    pub stream: Option<Stream>,
    /// Whether the content may still go up while being written: not after a write or
    /// truncate behind what was sent, or a rename, until the next publish.
    pub streamable: bool,
    /// The last publish failed and its caller reported it; cleared by the next change.
    pub failed: bool,
    /// A write was refused (the staging disk was full, say), so the content has a hole the
    /// writer was told of: it is never uploaded. Cleared only by truncating to zero, which
    /// starts the content again.
    pub write_error: Option<i32>,
    /// The manifest says the content is complete: the next change must say it no longer is
    /// before it touches the data, or a crash would leave the changed bytes to be uploaded.
    sealed: bool,
    /// When the writer began this content.
    pub created: std::time::Instant,
}

fn write_manifest(path: &Path, m: &Manifest) -> io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(m).map_err(io::Error::other)?)?;
    std::fs::rename(&tmp, path)
}

impl Staged {
    pub fn create(dir: &Path, id: u64, target: &str) -> io::Result<Staged> {
        std::fs::create_dir_all(dir)?;
        let data = dir.join(format!("{id}.data"));
        let manifest = dir.join(format!("{id}.json"));
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&data)?;
        // An empty new file is content too: `touch` then close must create an empty object.
        let staged = Staged {
            file,
            data,
            manifest,
            target: target.to_string(),
            len: 0,
            dirty: true,
            stream: None,
            streamable: true,
            failed: false,
            write_error: None,
            sealed: false,
            created: std::time::Instant::now(),
        };
        staged.record(false, None)?;
        Ok(staged)
    }

    pub fn write_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        let written = self.changing_from(offset).and_then(|()| self.file.write_all_at(buf, offset));
        if let Err(e) = written {
            // Part of `buf` may be in the file: the content is no longer what was written.
            self.write_error = Some(e.raw_os_error().unwrap_or(nix::libc::EIO));
            self.dirty = true;
            self.stop_streaming();
            return Err(e);
        }
        self.len = self.len.max(offset + buf.len() as u64);
        self.dirty = true;
        self.failed = false;
        Ok(())
    }

    pub fn read_at(&self, offset: u64, size: usize) -> io::Result<Vec<u8>> {
        let end = (offset + size as u64).min(self.len);
        if offset >= end {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; (end - offset) as usize];
        self.file.read_exact_at(&mut buf, offset)?;
        Ok(buf)
    }

    pub fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.changing_from(len)?;
        self.file.set_len(len)?;
        if len == 0 {
            self.write_error = None;
        }
        self.len = len;
        self.dirty = true;
        self.failed = false;
        Ok(())
    }

    /// Syncs the data and marks it complete: from here a restart may publish it.
    pub fn seal(&mut self) -> io::Result<()> {
        self.file.sync_data()?;
        self.record(true, None)?;
        self.sealed = true;
        Ok(())
    }

    /// Marks the data complete without syncing it, recording what it must hold.
    pub fn seal_unsynced(&mut self, crc32c: u32) -> io::Result<()> {
        self.record(true, Some((self.len, crc32c)))?;
        self.sealed = true;
        Ok(())
    }

    fn record(&self, complete: bool, content: Option<(u64, u32)>) -> io::Result<()> {
        write_manifest(&self.manifest, &Manifest { target: self.target.clone(), complete, content, failed: false })
    }

    /// Marks the staged content as one whose failed upload the writer was told of, so a
    /// restart reports it and leaves it alone.
    pub fn mark_failed(&self) -> io::Result<()> {
        let mut m: Manifest = serde_json::from_slice(&std::fs::read(&self.manifest)?).map_err(io::Error::other)?;
        m.failed = true;
        write_manifest(&self.manifest, &m)
    }

    /// The content changes from `offset` on: an upload that already sent bytes past it is
    /// given up, and content a flush had completed is recorded as being written again.
    fn changing_from(&mut self, offset: u64) -> io::Result<()> {
        if self.stream.as_ref().is_some_and(|s| offset < s.sent) {
            self.stop_streaming();
        }
        if self.sealed {
            self.record(false, None)?;
            self.sealed = false;
        }
        Ok(())
    }

    pub fn retarget(&mut self, target: &str) -> io::Result<()> {
        self.stop_streaming();
        self.target = target.to_string();
        self.sealed = false;
        self.record(false, None)
    }

    /// Gives up the upload under way, if any (the store drops its parts); the content is
    /// published whole on the next flush.
    pub fn stop_streaming(&mut self) {
        self.streamable = false;
        // Dropping an unfinished upload aborts it.
        self.stream = None;
    }

    pub fn data_path(&self) -> &Path {
        &self.data
    }

    /// Drops the manifest of content already in the store; the data stays until discarded, and
    /// a restart removes it as an orphan.
    pub fn forget_manifest(&mut self) {
        let _ = std::fs::remove_file(&self.manifest);
        self.sealed = false;
    }

    pub fn discard(&mut self) {
        self.stop_streaming();
        let _ = std::fs::remove_file(&self.data);
        let _ = std::fs::remove_file(&self.manifest);
    }
}

/// Whether the data file holds exactly the content its manifest recorded (always true for a
/// synced one, which records nothing).
pub fn holds_recorded_content(m: &Manifest, data: &Path) -> io::Result<bool> {
    use std::io::Read;
    let Some((len, crc)) = m.content else { return Ok(true) };
    let mut f = File::open(data)?;
    if f.metadata()?.len() != len {
        return Ok(false);
    }
    let (mut digest, mut buf) = (Crc32c::default(), vec![0u8; 1 << 20]);
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        digest.update(&buf[..n]);
    }
    Ok(digest.finish() == crc)
}

/// A staged file found at start-up.
#[derive(Debug, Clone)]
pub struct Leftover {
    pub manifest: Manifest,
    pub data: PathBuf,
    pub manifest_path: PathBuf,
}

/// Staged files left by a previous run, oldest id first.
pub fn leftovers(dir: &Path) -> Vec<Leftover> {
    let Ok(rd) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out: Vec<(u64, Leftover)> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let p = e.path();
            let id: u64 = p.file_name()?.to_str()?.strip_suffix(".json")?.parse().ok()?;
            let manifest: Manifest = serde_json::from_slice(&std::fs::read(&p).ok()?).ok()?;
            Some((id, Leftover { manifest, data: dir.join(format!("{id}.data")), manifest_path: p }))
        })
        .collect();
    out.sort_by_key(|(id, _)| *id);
    out.into_iter().map(|(_, l)| l).collect()
}

/// Removes data files whose manifest is gone: content that reached the store before the
/// previous run ended.
pub fn remove_orphans(dir: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.filter_map(|e| e.ok()) {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "data") && !p.with_extension("json").exists() {
            let _ = std::fs::remove_file(&p);
        }
    }
}

/// The next free staging id in `dir`.
pub fn next_id(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else { return 1 };
    rd.filter_map(|e| e.ok()).filter_map(|e| e.path().file_stem()?.to_str()?.parse::<u64>().ok()).max().unwrap_or(0) + 1
}
