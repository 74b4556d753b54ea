//! Write staging: a file being written through the mount lives in a local staging file until
//! it is published (uploaded) as one object. A small manifest beside it names the target and
//! says whether the content is complete, so a restart can tell a finished checkpoint whose
//! upload was interrupted (upload it again) from one cut off mid-write (never upload a part).
//!
//! A file written front to back, as checkpoints are, goes to disk in whole parts with
//! `O_DIRECT`, from a buffer that then becomes the upload's part: the bytes are neither copied
//! into the page cache nor read back for the upload. A checkpoint of many GiB then neither
//! pushes a node's cached dataset out of memory nor costs the CPU of filling fresh pages. Any
//! other write, or a truncate, settles the buffer into the file, and the content goes on
//! through the page cache, as any file's would; reads see the buffer as it is.

use bytes::Bytes;
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
    /// The store's ID of the latest upload that started while the file was written: a restart
    /// after a crash aborts it, so its parts do not stay in the store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload: Option<String>,
}

#[derive(Debug)]
pub struct Staged {
    /// Unique among this mount's staged copies, past and present.
    pub id: u64,
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
    /// Dropped (the file was unlinked while open, or its content is done with): nothing of it
    /// is ever uploaded, whatever is written to it after.
    pub discarded: bool,
    /// Appends not yet in the file, and whole parts written with `O_DIRECT` kept for the upload.
    direct: Option<Direct>,
    /// The upload's part size, for direct mode to start again when the content does.
    part: Option<u64>,
    /// What the manifest says of the latest upload that started while the file was written.
    upload: Option<String>,
}

/// Direct I/O needs buffers, offsets and lengths aligned to the device's blocks; 4 KiB covers
/// every device this runs on.
const ALIGN: usize = 4096;
/// Whole parts written but not yet handed to the upload are held at most this many; past that
/// the writer waits for the upload (see [`Staged::parts_waiting`]).
pub const MAX_READY_PARTS: usize = 2;

/// The `O_DIRECT` side of a staged file written front to back.
#[derive(Debug)]
struct Direct {
    file: File,
    /// Part size: what goes to disk at once, and what the upload sends.
    block: usize,
    /// Where the buffer starts in the file; a multiple of `block`.
    base: u64,
    /// Bytes from `base` on, at `start` within `buf` so that they sit on an aligned address.
    buf: Vec<u8>,
    start: usize,
    /// Whole parts already in the file, by offset, still in memory for the upload.
    ready: std::collections::VecDeque<(u64, Bytes)>,
}

impl Direct {
    fn open(path: &Path, block: u64, base: u64) -> Option<Direct> {
        use std::os::unix::fs::OpenOptionsExt;
        if block == 0 || !block.is_multiple_of(ALIGN as u64) || !base.is_multiple_of(block) {
            return None;
        }
        // File systems without direct I/O (tmpfs, some FUSE ones) refuse the open: the staged
        // file is then written through the page cache only.
        let file = std::fs::OpenOptions::new().write(true).custom_flags(nix::libc::O_DIRECT).open(path).ok()?;
        let mut d = Direct { file, block: block as usize, base, buf: Vec::new(), start: 0, ready: Default::default() };
        d.fresh_buffer();
        Some(d)
    }

    /// Reserves the next part's buffer. Only the pages written to are ever touched, so a small
    /// file costs what it holds, not a part.
    fn fresh_buffer(&mut self) {
        let mut buf: Vec<u8> = Vec::with_capacity(self.block + ALIGN);
        self.start = buf.as_ptr().align_offset(ALIGN);
        buf.resize(self.start, 0);
        self.buf = buf;
    }

    fn held(&self) -> &[u8] {
        &self.buf[self.start..]
    }

    /// Reserves the disk space of the part the buffer is for, so that a full staging disk is
    /// the error of the write that needs the space, as through the page cache, not of a later
    /// one that finds the part cannot be written.
    fn reserve(&self) -> bool {
        use nix::fcntl::{FallocateFlags, fallocate};
        fallocate(&self.file, FallocateFlags::FALLOC_FL_KEEP_SIZE, self.base as i64, self.block as i64).is_ok()
    }

    /// Gives back the reserved space past what was written.
    fn unreserve(&self, from: u64) {
        use nix::fcntl::{FallocateFlags, fallocate};
        let end = self.base + self.block as u64;
        if from < end {
            let flags = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
            let _ = fallocate(&self.file, flags, from as i64, (end - from) as i64);
        }
    }
}

fn write_manifest(path: &Path, m: &Manifest) -> io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(m).map_err(io::Error::other)?)?;
    std::fs::rename(&tmp, path)
}

/// Whether `path` is an object path relative to the mount, as this crate writes them: not
/// empty, and no empty, `.` or `..` part. What a restart reads from disk must be one before
/// anything is uploaded, copied or deleted under it.
pub fn is_relative_object_path(path: &str) -> bool {
    !path.is_empty() && path.split('/').all(|part| !matches!(part, "" | "." | ".."))
}

/// The staged-file manifest in `bytes`, as a restart reads it from the staging dir.
pub fn read_manifest(bytes: &[u8]) -> Result<Manifest, String> {
    let m: Manifest = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    if !is_relative_object_path(&m.target) {
        return Err(format!("its target {:?} is not an object path of the mount", m.target));
    }
    Ok(m)
}

/// Changes one thing in the manifest at `path`, keeping the rest as written.
fn update_manifest(path: &Path, change: impl FnOnce(&mut Manifest)) -> io::Result<()> {
    let mut m = read_manifest(&std::fs::read(path)?).map_err(io::Error::other)?;
    change(&mut m);
    write_manifest(path, &m)
}

/// Records in the manifest at `path` the ID of an upload of its content that is starting.
pub fn note_upload_in(path: &Path, id: &str) -> io::Result<()> {
    update_manifest(path, |m| m.upload = Some(id.to_string()))
}

impl Staged {
    /// Starts a staged file. `part` is the upload's part size when files go up in parts while
    /// being written; appends then go to disk a part at a time with direct I/O.
    pub fn create(dir: &Path, id: u64, target: &str, part: Option<u64>) -> io::Result<Staged> {
        std::fs::create_dir_all(dir)?;
        let data = dir.join(format!("{id}.data"));
        let manifest = dir.join(format!("{id}.json"));
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&data)?;
        // An empty new file is content too: `touch` then close must create an empty object.
        let mut staged = Staged {
            id,
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
            upload: None,
            created: std::time::Instant::now(),
            discarded: false,
            direct: None,
            part,
        };
        staged.record(false, None)?;
        staged.resume_direct();
        Ok(staged)
    }

    pub fn write_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        let written = self.changing_from(offset).and_then(|()| {
            if offset == self.len && self.direct.is_some() {
                self.append(buf)
            } else {
                self.settle()?;
                self.file.write_all_at(buf, offset)
            }
        });
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
        // Bytes past the buffer's start are not in the file yet.
        let in_file = self.direct.as_ref().map_or(end, |d| d.base.clamp(offset, end));
        let split = (in_file - offset) as usize;
        self.file.read_exact_at(&mut buf[..split], offset)?;
        if let Some(d) = &self.direct
            && split < buf.len()
        {
            let from = (in_file - d.base) as usize;
            let n = buf.len() - split;
            buf[split..].copy_from_slice(&d.held()[from..from + n]);
        }
        Ok(buf)
    }

    /// Appends at the end of the content. Each part that fills goes to disk with direct I/O and
    /// is kept for the upload while one may be streaming.
    fn append(&mut self, mut data: &[u8]) -> io::Result<()> {
        let keep = self.streamable;
        let Some(d) = self.direct.as_mut() else { unreachable!("append is only called in direct mode") };
        while !data.is_empty() {
            if d.held().is_empty() && !d.reserve() {
                // No room for a whole part (or no fallocate here): the rest goes through the page
                // cache, which takes what fits and says ENOSPC at the write that does not.
                self.direct = None;
                self.file.write_all_at(data, self.len)?;
                self.len += data.len() as u64;
                return Ok(());
            }
            let room = d.block - d.held().len();
            let n = room.min(data.len());
            d.buf.extend_from_slice(&data[..n]);
            data = &data[n..];
            self.len += n as u64;
            if d.held().len() == d.block {
                d.file.write_all_at(d.held(), d.base)?;
                let full = std::mem::take(&mut d.buf);
                let part = Bytes::from(full).slice(d.start..);
                if keep {
                    d.ready.push_back((d.base, part));
                }
                d.base += d.block as u64;
                d.fresh_buffer();
            }
        }
        Ok(())
    }

    /// Writes what the direct buffer holds into the file through the page cache, and leaves
    /// direct mode: the content no longer grows front to back, or is being finished.
    fn settle(&mut self) -> io::Result<()> {
        if let Some(d) = self.direct.take() {
            if let Err(e) = self.file.write_all_at(d.held(), d.base) {
                // The buffer is gone with the error: the content now has a hole, which every
                // later flush, fsync and close must report rather than upload.
                self.write_error = Some(e.raw_os_error().unwrap_or(nix::libc::EIO));
                return Err(e);
            }
            if !d.held().is_empty() {
                d.unreserve(d.base + d.held().len() as u64);
            }
        }
        Ok(())
    }

    /// Goes back to direct mode for appends from here on, if the content ends on a part's
    /// boundary: after a publish (a writer may flush, then go on writing, as `dd` does by
    /// closing its first descriptor) or when the content starts again.
    fn resume_direct(&mut self) {
        if self.direct.is_none() {
            self.direct = self.part.and_then(|p| Direct::open(&self.data, p, self.len));
        }
    }

    /// The next whole part from `offset` if it is still in memory; parts before it are gone
    /// to the upload already or are no longer wanted.
    pub fn take_part(&mut self, offset: u64) -> Option<Bytes> {
        let d = self.direct.as_mut()?;
        while let Some((at, _)) = d.ready.front()
            && *at < offset
        {
            d.ready.pop_front();
        }
        match d.ready.front() {
            Some((at, _)) if *at == offset => d.ready.pop_front().map(|(_, b)| b),
            _ => None,
        }
    }

    /// Whole parts held in memory for the upload.
    pub fn parts_waiting(&self) -> usize {
        self.direct.as_ref().map_or(0, |d| d.ready.len())
    }

    pub fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.changing_from(len)?;
        if len == 0 {
            // Nothing buffered is kept, so nothing of it needs writing: a part whose write failed
            // must not make the truncate that starts the content again fail too.
            self.direct = None;
        }
        self.settle()?;
        self.file.set_len(len)?;
        if len == 0 {
            self.write_error = None;
            // New content, written front to back again.
            self.resume_direct();
        }
        self.len = len;
        self.dirty = true;
        self.failed = false;
        Ok(())
    }

    /// Syncs the data and marks it complete: from here a restart may publish it.
    pub fn seal(&mut self) -> io::Result<()> {
        self.settle()?;
        self.file.sync_data()?;
        self.record(true, None)?;
        self.sealed = true;
        self.resume_direct();
        Ok(())
    }

    /// Marks the data complete without syncing it, recording what it must hold.
    pub fn seal_unsynced(&mut self, crc32c: u32) -> io::Result<()> {
        self.settle()?;
        self.record(true, Some((self.len, crc32c)))?;
        self.sealed = true;
        self.resume_direct();
        Ok(())
    }

    fn record(&self, complete: bool, content: Option<(u64, u32)>) -> io::Result<()> {
        if self.discarded {
            // No manifest may come back for a copy that will never be uploaded.
            return Ok(());
        }
        let upload = self.upload.clone();
        write_manifest(
            &self.manifest,
            &Manifest { target: self.target.clone(), complete, content, failed: false, upload },
        )
    }

    /// Records the ID of an upload that starts while the file is written, before its first
    /// part goes, so a restart after a crash can abort it.
    pub fn note_upload(&mut self, id: &str) -> io::Result<()> {
        self.upload = Some(id.to_string());
        note_upload_in(&self.manifest, id)
    }

    pub fn manifest_path(&self) -> &Path {
        &self.manifest
    }

    /// Marks the staged content as one whose failed upload the writer was told of, so a
    /// restart reports it and leaves it alone.
    pub fn mark_failed(&self) -> io::Result<()> {
        update_manifest(&self.manifest, |m| m.failed = true)
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
        if self.sealed && !self.dirty {
            // Published and unchanged since (see `mark_published`): there is nothing for a
            // restart to upload or report, and the next change records the manifest again.
            return Ok(());
        }
        self.sealed = false;
        self.record(false, None)
    }

    /// Gives up the upload under way, if any (the store drops its parts); the content is
    /// published whole on the next flush.
    pub fn stop_streaming(&mut self) {
        self.streamable = false;
        if let Some(d) = self.direct.as_mut() {
            d.ready.clear();
        }
        // Dropping an unfinished upload aborts it.
        self.stream = None;
    }

    pub fn data_path(&self) -> &Path {
        &self.data
    }

    /// Drops the manifest of content already in the store; the data stays until discarded, and
    /// a restart removes it as an orphan.
    /// The content is in the store: a restart must not upload it again, perhaps over what
    /// another client wrote since, while a handle keeps the copy open. The manifest goes; the
    /// next change records one again (as after a seal), so new content is still reported.
    pub fn mark_published(&mut self) {
        let _ = std::fs::remove_file(&self.manifest);
        self.sealed = true;
    }

    pub fn forget_manifest(&mut self) {
        let _ = std::fs::remove_file(&self.manifest);
        self.sealed = false;
    }

    pub fn discard(&mut self) {
        self.discarded = true;
        self.streamable = false;
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
            let manifest = match std::fs::read(&p).map_err(|e| e.to_string()).and_then(|b| read_manifest(&b)) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "unreadable staged-file manifest; kept, not uploaded");
                    return None;
                }
            };
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

#[cfg(test)]
mod tests {
    use super::*;

    const PART: u64 = 64 << 10;

    /// A manifest read back at a restart names the object the content goes to: one that could
    /// land outside the mount's prefix, or on no name at all, is refused.
    #[test]
    fn a_manifest_whose_target_is_no_object_path_is_refused() {
        for bad in ["", "/abs", "a//b", "../x", "a/./b", "a/", "a/.."] {
            let json = format!(r#"{{"target":{bad:?},"complete":true}}"#);
            let e = read_manifest(json.as_bytes()).unwrap_err();
            assert_eq!(e, format!("its target {bad:?} is not an object path of the mount"));
        }
        let m = read_manifest(br#"{"target":"ckpt/step-1/model.pt","complete":false}"#).unwrap();
        assert_eq!((m.target.as_str(), m.complete), ("ckpt/step-1/model.pt", false));
    }

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    /// Appends `src` in uneven pieces, as a writer's requests come.
    fn append_all(s: &mut Staged, src: &[u8]) {
        let mut at = 0;
        for step in [1, 4095, 70_000, 12_345, 100_000].iter().cycle() {
            if at == src.len() {
                break;
            }
            let n = (*step).min(src.len() - at);
            s.write_at(at as u64, &src[at..at + n]).unwrap();
            at += n;
        }
    }

    fn direct_supported(dir: &Path) -> bool {
        use std::os::unix::fs::OpenOptionsExt;
        let p = dir.join("probe");
        std::fs::write(&p, b"").unwrap();
        let ok = std::fs::OpenOptions::new().write(true).custom_flags(nix::libc::O_DIRECT).open(&p).is_ok();
        std::fs::remove_file(&p).unwrap();
        ok
    }

    #[test]
    fn appended_parts_go_to_the_upload_from_memory_and_every_read_sees_the_bytes_written() {
        let dir = tempfile::tempdir().unwrap();
        let src = data(3 * PART as usize + 1000);
        let mut s = Staged::create(dir.path(), 1, "ckpt.bin", Some(PART)).unwrap();
        append_all(&mut s, &src);
        assert_eq!(s.len, src.len() as u64);
        if !direct_supported(dir.path()) {
            // A file system without direct I/O: the page cache alone, and the same bytes.
            assert_eq!(s.parts_waiting(), 0);
            s.seal().unwrap();
            assert_eq!(std::fs::read(s.data_path()).unwrap(), src);
            return;
        }
        assert_eq!(s.parts_waiting(), 3, "every whole part is held for the upload");
        // Reads that span the file and the buffer not yet written.
        for (at, n) in [(0, 10), (PART - 5, 10), (3 * PART - 3, 900), (3 * PART + 990, 50), (0, src.len() + 9)] {
            let end = (at as usize + n).min(src.len());
            assert_eq!(s.read_at(at, n).unwrap(), &src[at as usize..end], "read of {n} at {at}");
        }
        assert_eq!(s.take_part(0).unwrap(), &src[..PART as usize]);
        assert!(s.take_part(0).is_none(), "a part goes to the upload once");
        assert_eq!(
            s.take_part(2 * PART).unwrap(),
            &src[2 * PART as usize..3 * PART as usize],
            "skipped parts are dropped"
        );
        assert_eq!(s.parts_waiting(), 0);
        s.seal().unwrap();
        assert_eq!(std::fs::read(s.data_path()).unwrap(), src, "the file holds every byte once sealed");
    }

    #[test]
    fn a_write_behind_the_end_or_a_truncate_leaves_direct_mode_and_keeps_the_content_right() {
        let dir = tempfile::tempdir().unwrap();
        let mut src = data(2 * PART as usize + 77);
        let mut s = Staged::create(dir.path(), 1, "f", Some(PART)).unwrap();
        append_all(&mut s, &src);
        // Overwrite across the file/buffer boundary, then write past the end.
        let patch = vec![0xAB; 150];
        let at = 2 * PART as usize - 100;
        s.write_at(at as u64, &patch).unwrap();
        src[at..at + patch.len()].copy_from_slice(&patch);
        s.write_at(src.len() as u64 + 10, b"tail").unwrap();
        src.extend_from_slice(&[0; 10]);
        src.extend_from_slice(b"tail");
        assert_eq!(s.read_at(0, src.len()).unwrap(), src);
        assert_eq!(s.parts_waiting(), 0, "nothing is held once the file is written out of order");
        s.seal().unwrap();
        assert_eq!(std::fs::read(s.data_path()).unwrap(), src);
        // Truncated to zero, the content starts again front to back.
        s.truncate(0).unwrap();
        let again = data(PART as usize + 5);
        append_all(&mut s, &again);
        s.seal().unwrap();
        assert_eq!(std::fs::read(s.data_path()).unwrap(), again);
    }

    #[test]
    fn a_flush_before_the_writes_does_not_end_direct_mode() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Staged::create(dir.path(), 1, "f", Some(PART)).unwrap();
        // `dd` closes its first descriptor of the file (a flush) before writing through the
        // second: the empty content is sealed, then grows.
        s.seal().unwrap();
        let src = data(2 * PART as usize);
        append_all(&mut s, &src);
        let held = if direct_supported(dir.path()) { 2 } else { 0 };
        assert_eq!(s.parts_waiting(), held);
        s.seal().unwrap();
        assert_eq!(std::fs::read(s.data_path()).unwrap(), src);
    }
}
