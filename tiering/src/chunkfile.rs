//! The on-disk form of one cached chunk: a small header, the key, a CRC32C for each 256 KiB
//! piece of the data, then the plain bytes.
//!
//! Every piece read is checked against its CRC, so a flipped bit, a torn write or a file from
//! another key can never be served, and a read of part of a chunk loads and checks only the
//! pieces it touches rather than the whole chunk. The header's CRC covers the piece table. The
//! key is stored too, so an index can be rebuilt from the files alone. Files of the previous
//! version, with one CRC for the whole data, are still read, whole.

use crate::key::{ChunkKey, KeyId};
use bytes::Bytes;
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::Path;

const MAGIC: &[u8; 4] = b"STRC";
const VERSION: u8 = 3;
/// The previous version: no piece table, and the header's CRC covers the whole data.
const WHOLE_CRC_VERSION: u8 = 2;
/// magic(4) version(1) reserved(3) data_len(8) crc32c(4) key_len(4) key_id(32). The key id sits
/// in the fixed part so the read path can check it without parsing the key.
pub const FIXED_HEADER: usize = 56;
/// Where the CRC sits in the header.
const CRC_AT: u64 = 16;
/// Data is checksummed and moved in pieces this big: small enough to stay in the CPU's cache
/// between the checksum and the copy, and the most a small read of a chunk has to load.
const PIECE: usize = 256 << 10;

fn pieces(data_len: u64) -> u64 {
    data_len.div_ceil(PIECE as u64)
}

/// CRC32C (Castagnoli), computed with carry-less multiply where the CPU has it: about four times
/// faster than the plain SSE4.2 instruction, which matters because every read verifies.
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data) as u32
}

/// CRC32C of data that arrives piece by piece.
pub struct Crc32c(crc_fast::Digest);

impl std::fmt::Debug for Crc32c {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Crc32c({:#010x})", self.finish())
    }
}

impl Default for Crc32c {
    fn default() -> Self {
        Crc32c(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
    }
}

impl Crc32c {
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    pub fn finish(&self) -> u32 {
        self.0.finalize() as u32
    }
}

/// Why a chunk file could not be used. Each of these is treated as a cache miss.
#[derive(Debug, thiserror::Error)]
pub enum ChunkFileError {
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
    #[error("not a chunk file (bad magic or version)")]
    BadHeader,
    #[error("chunk file is torn: header says {expected} bytes, file holds {actual}")]
    Torn { expected: u64, actual: u64 },
    #[error("chunk file holds key {found:?}, expected {expected:?}")]
    WrongKey { expected: KeyId, found: KeyId },
    #[error("checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum { stored: u32, computed: u32 },
    #[error("key metadata unreadable: {0}")]
    Key(String),
}

/// Header fields read back from a file.
#[derive(Debug, Clone)]
pub struct Header {
    pub key: ChunkKey,
    pub data_len: u64,
    pub crc: u32,
    pub data_offset: u64,
}

impl Header {
    pub fn file_len(&self) -> u64 {
        self.data_offset + self.data_len
    }
}

/// Bytes a chunk of `data_len` occupies on disk, header included.
pub fn encoded_len(key: &ChunkKey, data_len: u64) -> u64 {
    FIXED_HEADER as u64 + key_bytes(key).len() as u64 + 4 * pieces(data_len) + data_len
}

fn key_bytes(key: &ChunkKey) -> Vec<u8> {
    serde_json::to_vec(key).expect("chunk keys always serialise")
}

/// Writes `data` for `key` to the temp file `tmp`; the caller renames it into place, so a reader
/// never sees a partial file under a chunk's name. `sync` adds an fsync before returning.
///
/// The data goes out in pieces, each checksummed just before it is written, so it crosses the
/// memory bus once for both; the piece table and its checksum then go in before the data.
pub fn write_tmp(tmp: &Path, key: &ChunkKey, data: &[u8], sync: bool) -> io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let kb = key_bytes(key);
    let table_len = 4 * pieces(data.len() as u64) as usize;
    let mut hdr = Vec::with_capacity(FIXED_HEADER + kb.len() + table_len);
    hdr.extend_from_slice(MAGIC);
    hdr.push(VERSION);
    hdr.extend_from_slice(&[0, 0, 0]);
    hdr.extend_from_slice(&(data.len() as u64).to_le_bytes());
    hdr.extend_from_slice(&[0; 4]);
    hdr.extend_from_slice(&(kb.len() as u32).to_le_bytes());
    hdr.extend_from_slice(&key.id().0);
    hdr.extend_from_slice(&kb);
    let table_at = hdr.len();
    hdr.resize(table_at + table_len, 0);
    let result = (|| {
        let mut f = File::create(tmp)?;
        f.write_all(&hdr)?;
        let mut table = Vec::with_capacity(table_len);
        for piece in data.chunks(PIECE) {
            table.extend_from_slice(&crc32c(piece).to_le_bytes());
            f.write_all(piece)?;
        }
        f.write_all_at(&table, table_at as u64)?;
        f.write_all_at(&crc32c(&table).to_le_bytes(), CRC_AT)?;
        if sync {
            f.sync_data()?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    result.map(|_| (hdr.len() + data.len()) as u64)
}

/// Reads only the header and key; used when rebuilding an index by scanning.
pub fn read_header(path: &Path) -> Result<Header, ChunkFileError> {
    let mut f = File::open(path)?;
    let file_len = f.metadata()?.len();
    let h = parse_header(&mut f)?;
    if h.file_len() != file_len {
        return Err(ChunkFileError::Torn { expected: h.file_len(), actual: file_len });
    }
    Ok(h)
}

fn parse_header(f: &mut File) -> Result<Header, ChunkFileError> {
    let mut fixed = [0u8; FIXED_HEADER];
    f.read_exact(&mut fixed).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => ChunkFileError::BadHeader,
        _ => e.into(),
    })?;
    let Fixed { data_len, crc, key_len, data_offset, .. } = Fixed::parse(&fixed)?;
    let key_len = key_len as usize;
    let mut kb = vec![0u8; key_len];
    f.read_exact(&mut kb).map_err(|_| ChunkFileError::BadHeader)?;
    let key: ChunkKey = serde_json::from_slice(&kb).map_err(|e| ChunkFileError::Key(e.to_string()))?;
    if key.id().0[..] != fixed[24..56] {
        return Err(ChunkFileError::Key("key does not match its id".into()));
    }
    Ok(Header { key, data_len, crc, data_offset })
}

/// The fixed part of a header, checked for what can be checked without the rest.
struct Fixed {
    version: u8,
    data_len: u64,
    crc: u32,
    key_len: u64,
    key_id: [u8; 32],
    /// Where the piece table starts (right after the key).
    table_at: u64,
    data_offset: u64,
}

impl Fixed {
    fn parse(b: &[u8]) -> Result<Fixed, ChunkFileError> {
        let version = b[4];
        if &b[0..4] != MAGIC || (version != VERSION && version != WHOLE_CRC_VERSION) {
            return Err(ChunkFileError::BadHeader);
        }
        let data_len = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let key_len = u32::from_le_bytes(b[20..24].try_into().expect("4 bytes")) as u64;
        if key_len > 64 * 1024 || data_len > 1 << 40 {
            return Err(ChunkFileError::BadHeader);
        }
        let table_at = FIXED_HEADER as u64 + key_len;
        let table_len = if version == VERSION { 4 * pieces(data_len) } else { 0 };
        Ok(Fixed {
            version,
            data_len,
            crc: u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")),
            key_len,
            key_id: b[24..56].try_into().expect("32 bytes"),
            table_at,
            data_offset: table_at + table_len,
        })
    }

    fn check_key(&self, expect: KeyId) -> Result<(), ChunkFileError> {
        if self.key_id != expect.0 {
            return Err(ChunkFileError::WrongKey { expected: expect, found: KeyId(self.key_id) });
        }
        Ok(())
    }

    fn check_len(&self, file_len: u64) -> Result<(), ChunkFileError> {
        let expected = self.data_offset.saturating_add(self.data_len);
        if expected != file_len {
            return Err(ChunkFileError::Torn { expected, actual: file_len });
        }
        Ok(())
    }

    /// The piece table, from the bytes at `table_at`, checked against the header's CRC.
    fn table(&self, raw: &[u8]) -> Result<Vec<u32>, ChunkFileError> {
        check_crc(self.crc, crc32c(raw))?;
        Ok(raw.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
    }
}

fn check_crc(stored: u32, computed: u32) -> Result<(), ChunkFileError> {
    if computed != stored {
        return Err(ChunkFileError::Checksum { stored, computed });
    }
    Ok(())
}

/// Reads and verifies the chunk for `expect`. Returns the plain bytes only when the length,
/// the key and the checksum all match.
pub fn read_verified(path: &Path, expect: KeyId) -> Result<Bytes, ChunkFileError> {
    let f = File::open(path)?;
    let len = f.metadata()?.len();
    read_verified_file(f, expect, len)
}

/// As [`read_verified`], from a file the caller opened (under the index lock, so eviction cannot
/// unlink it first) and whose length it knows from the index. The file is read into one
/// exact-size buffer, in pieces each checksummed as soon as it arrives (while it is still in the
/// CPU's cache), and the data is returned as a slice of the buffer, without a copy.
pub fn read_verified_file(mut f: File, expect: KeyId, file_len: u64) -> Result<Bytes, ChunkFileError> {
    let mut buf = vec![0u8; (file_len as usize).max(FIXED_HEADER)];
    if read_full(&mut f, &mut buf[..FIXED_HEADER])? < FIXED_HEADER {
        return Err(ChunkFileError::BadHeader);
    }
    let h = Fixed::parse(&buf[..FIXED_HEADER])?;
    h.check_key(expect)?;
    h.check_len(file_len)?;
    let data_offset = h.data_offset as usize;
    let got = read_full(&mut f, &mut buf[FIXED_HEADER..data_offset])?;
    if got < data_offset - FIXED_HEADER {
        return Err(ChunkFileError::Torn { expected: file_len, actual: (FIXED_HEADER + got) as u64 });
    }
    let table = if h.version == VERSION { Some(h.table(&buf[h.table_at as usize..data_offset])?) } else { None };
    let mut whole = Crc32c::default();
    let (mut at, mut i) = (data_offset, 0);
    while at < buf.len() {
        let end = (at + PIECE).min(buf.len());
        let n = read_full(&mut f, &mut buf[at..end])?;
        if n < end - at {
            return Err(ChunkFileError::Torn { expected: file_len, actual: (at + n) as u64 });
        }
        match &table {
            Some(t) => check_crc(t[i], crc32c(&buf[at..end]))?,
            None => whole.update(&buf[at..end]),
        }
        (at, i) = (end, i + 1);
    }
    // A file that grew since the index recorded its length is as suspect as one that shrank.
    if f.read(&mut [0u8; 1])? != 0 {
        return Err(ChunkFileError::Torn { expected: file_len, actual: file_len + 1 });
    }
    if table.is_none() {
        check_crc(h.crc, whole.finish())?;
    }
    Ok(Bytes::from(buf).slice(data_offset..))
}

/// The bytes `range` of a chunk's data, from a file opened as for [`read_verified_file`]:
/// only the pieces the range touches are read, each checked against its CRC. A file of the
/// previous version, without a piece table, is read and checked whole.
pub fn read_verified_range(
    f: File,
    expect: KeyId,
    file_len: u64,
    range: std::ops::Range<u64>,
) -> Result<Bytes, ChunkFileError> {
    use std::os::unix::fs::FileExt;
    let mut fixed = [0u8; FIXED_HEADER];
    f.read_exact_at(&mut fixed, 0).map_err(|_| ChunkFileError::BadHeader)?;
    let h = Fixed::parse(&fixed)?;
    h.check_key(expect)?;
    h.check_len(file_len)?;
    let end = range.end.min(h.data_len);
    let start = range.start.min(end);
    if h.version != VERSION {
        return read_verified_file(f, expect, file_len).map(|b| b.slice(start as usize..end as usize));
    }
    let mut raw = vec![0u8; (h.data_offset - h.table_at) as usize];
    f.read_exact_at(&mut raw, h.table_at)?;
    let table = h.table(&raw)?;
    if start == end {
        return Ok(Bytes::new());
    }
    let piece = PIECE as u64;
    let (first, last) = (start / piece, (end - 1) / piece);
    let from = first * piece;
    let to = ((last + 1) * piece).min(h.data_len);
    let mut buf = vec![0u8; (to - from) as usize];
    f.read_exact_at(&mut buf, h.data_offset + from)?;
    for (i, p) in buf.chunks(PIECE).enumerate() {
        check_crc(table[first as usize + i], crc32c(p))?;
    }
    Ok(Bytes::from(buf).slice((start - from) as usize..(end - from) as usize))
}

/// Reads until `buf` is full or the file ends; returns how much it read.
fn read_full(f: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(r) => n += r,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever happens to a chunk file on disk (bytes flipped, cut short, grown), reading it
        /// either fails or returns exactly the bytes that were written. Never a wrong byte.
        #[test]
        fn damaged_files_never_yield_wrong_bytes(
            data in proptest::collection::vec(any::<u8>(), 0..3000),
            flips in proptest::collection::vec((any::<usize>(), 1..=255u8), 0..4),
            cut in proptest::option::of(any::<usize>()),
            extra in proptest::collection::vec(any::<u8>(), 0..3),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("c");
            let k = key();
            write_tmp(&p, &k, &data, false).unwrap();
            let mut raw = std::fs::read(&p).unwrap();
            for (at, x) in &flips {
                let i = at % raw.len();
                raw[i] ^= x;
            }
            if let Some(c) = cut {
                raw.truncate(c % (raw.len() + 1));
            }
            raw.extend_from_slice(&extra);
            std::fs::write(&p, &raw).unwrap();
            if let Ok(got) = read_verified(&p, k.id()) {
                prop_assert_eq!(&got[..], &data[..]);
            }
            let _ = read_header(&p);
        }
    }

    proptest! {
        /// The same for reads of part of a chunk: a damaged file gives an error or exactly the
        /// bytes asked for.
        #[test]
        fn damaged_files_never_yield_wrong_bytes_for_a_range(
            len in 0usize..(3 * PIECE + 1000),
            flip in proptest::option::of((any::<usize>(), 1..=255u8)),
            cut in proptest::option::of(any::<usize>()),
            a in any::<usize>(),
            b in any::<usize>(),
        ) {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("c");
            let k = key();
            let written = write_tmp(&p, &k, &data, false).unwrap();
            let mut raw = std::fs::read(&p).unwrap();
            if let Some((at, x)) = flip {
                let i = at % raw.len();
                raw[i] ^= x;
            }
            if let Some(c) = cut {
                raw.truncate(c % (raw.len() + 1));
            }
            std::fs::write(&p, &raw).unwrap();
            let (a, b) = (a % (len + 1), b % (len + 1));
            let range = a.min(b) as u64..a.max(b) as u64;
            if let Ok(got) = read_verified_range(File::open(&p).unwrap(), k.id(), written, range.clone()) {
                prop_assert_eq!(&got[..], &data[range.start as usize..range.end as usize]);
            }
        }
    }

    fn key() -> ChunkKey {
        ChunkKey::object("a/b", "etag", 3, 1 << 20)
    }

    fn range(p: &Path, r: std::ops::Range<u64>) -> Result<Bytes, ChunkFileError> {
        let f = File::open(p).unwrap();
        let len = f.metadata().unwrap().len();
        read_verified_range(f, key().id(), len, r)
    }

    #[test]
    fn a_range_reads_and_checks_only_the_pieces_it_touches() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c");
        let data: Vec<u8> = (0..(3 * PIECE + 100) as u32).map(|i| (i % 239) as u8).collect();
        write_tmp(&p, &key(), &data, false).unwrap();
        let mid = PIECE as u64 + 10..2 * PIECE as u64 + 20;
        assert_eq!(range(&p, mid.clone()).unwrap(), &data[mid.start as usize..mid.end as usize]);
        // A flipped byte in the first piece: the whole chunk no longer verifies, and a range
        // that does not touch that piece still reads right, because that piece is never read.
        let mut raw = std::fs::read(&p).unwrap();
        let data_at = raw.len() - data.len();
        raw[data_at + 5] ^= 1;
        std::fs::write(&p, &raw).unwrap();
        assert!(matches!(read_verified(&p, key().id()), Err(ChunkFileError::Checksum { .. })));
        assert_eq!(range(&p, mid.clone()).unwrap(), &data[mid.start as usize..mid.end as usize]);
        assert!(matches!(range(&p, 0..10), Err(ChunkFileError::Checksum { .. })));
        // A damaged piece table is caught before any piece is trusted.
        raw[data_at + 5] ^= 1;
        raw[data_at - 1] ^= 1;
        std::fs::write(&p, &raw).unwrap();
        assert!(matches!(range(&p, mid), Err(ChunkFileError::Checksum { .. })));
    }

    #[test]
    fn files_of_the_previous_version_are_still_read() {
        // Version 2: the header's CRC covers the whole data, and there is no piece table.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c");
        let data: Vec<u8> = (0..(PIECE + 700) as u32).map(|i| (i % 241) as u8).collect();
        let kb = key_bytes(&key());
        let mut raw = Vec::new();
        raw.extend_from_slice(MAGIC);
        raw.extend_from_slice(&[WHOLE_CRC_VERSION, 0, 0, 0]);
        raw.extend_from_slice(&(data.len() as u64).to_le_bytes());
        raw.extend_from_slice(&crc32c(&data).to_le_bytes());
        raw.extend_from_slice(&(kb.len() as u32).to_le_bytes());
        raw.extend_from_slice(&key().id().0);
        raw.extend_from_slice(&kb);
        raw.extend_from_slice(&data);
        std::fs::write(&p, &raw).unwrap();
        assert_eq!(read_verified(&p, key().id()).unwrap(), data);
        assert_eq!(range(&p, 100..PIECE as u64 + 5).unwrap(), &data[100..PIECE + 5]);
        assert_eq!(read_header(&p).unwrap().data_len, data.len() as u64);
        let last = raw.len() - 1;
        raw[last] ^= 1;
        std::fs::write(&p, &raw).unwrap();
        assert!(matches!(range(&p, 0..10), Err(ChunkFileError::Checksum { .. })));
    }

    #[test]
    fn round_trip_and_detects_flips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c");
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        let n = write_tmp(&p, &key(), &data, false).unwrap();
        assert_eq!(n, encoded_len(&key(), data.len() as u64));
        assert_eq!(read_verified(&p, key().id()).unwrap(), data);

        let mut raw = std::fs::read(&p).unwrap();
        let last = raw.len() - 1;
        raw[last] ^= 0x01;
        std::fs::write(&p, &raw).unwrap();
        assert!(matches!(read_verified(&p, key().id()), Err(ChunkFileError::Checksum { .. })));
    }

    #[test]
    fn detects_torn_and_foreign_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c");
        write_tmp(&p, &key(), &[9u8; 100], false).unwrap();
        let other = ChunkKey::digest("x", "sha256:1").id();
        assert!(matches!(read_verified(&p, other), Err(ChunkFileError::WrongKey { .. })));
        let raw = std::fs::read(&p).unwrap();
        std::fs::write(&p, &raw[..raw.len() - 10]).unwrap();
        assert!(matches!(read_header(&p), Err(ChunkFileError::Torn { .. })));
        std::fs::write(&p, b"garbage").unwrap();
        assert!(matches!(read_verified(&p, key().id()), Err(ChunkFileError::BadHeader)));
    }
}
