//! The TOC (`stargz.index.json`): read from its gzip member, checked against the digest the
//! image annotates it with before anything in it is believed, and then turned into a validated
//! tree. Names that climb out of the layer, files used as directories, and chunk lists that do
//! not add up are refused, so nothing downstream has to trust the registry's bytes.

use super::footer::Compression;
use super::time::parse_rfc3339;
use super::{FormatError, is_sha256_digest, sha256_digest};
use base64::Engine;
use foldhash::HashMap;
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Read;

pub const TOC_NAME: &str = "stargz.index.json";
pub const PREFETCH_LANDMARK: &str = ".prefetch.landmark";
pub const NO_PREFETCH_LANDMARK: &str = ".no.prefetch.landmark";
/// The largest chunk Strata holds in memory at once. Writers chunk at 4 MiB by default; a
/// TOC that claims more is refused rather than trusted with the memory.
pub const MAX_CHUNK_SIZE: u64 = 256 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    Dir,
    Reg,
    Symlink(String),
    /// A hard link to the regular file at this (normalised) path.
    Hardlink(String),
    Char {
        major: u32,
        minor: u32,
    },
    Block {
        major: u32,
        minor: u32,
    },
    Fifo,
}

/// One piece of a regular file: where its compressed bytes lie in the blob, and what its
/// uncompressed bytes must hash to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub file_offset: u64,
    pub size: u64,
    /// Start of the gzip member that holds the chunk.
    pub offset: u64,
    /// End of the compressed range to fetch: the next member that starts a different chunk.
    pub compressed_end: u64,
    /// Uncompressed bytes to skip inside the member before the chunk starts.
    pub inner_offset: u64,
    pub digest: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Normalised path inside the layer: no leading `/`, no `.` or `..`; "" is the root.
    pub path: String,
    pub kind: EntryKind,
    /// Permission bits plus setuid, setgid and sticky.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub user_name: Option<String>,
    pub group_name: Option<String>,
    /// Seconds since the epoch (0 when the TOC has none).
    pub mtime: i64,
    pub xattrs: BTreeMap<String, Vec<u8>>,
    pub size: u64,
    /// `sha256:` of the whole file, when the TOC gives it.
    pub digest: Option<String>,
    pub chunks: Vec<Chunk>,
    /// A parent directory the TOC does not list, made up (mode 0755, owned by root) so the
    /// tree is whole. Layer tars commonly leave out unchanged parents.
    pub implicit: bool,
}

/// What the layer asks to have fetched before a container starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landmark {
    /// No landmark: prefetch is up to configuration.
    None,
    /// `.no.prefetch.landmark`: nothing.
    NoPrefetch,
    /// `.prefetch.landmark`: the blob up to this compressed offset.
    Prefetch { offset: u64 },
}

#[derive(Debug, Clone)]
pub struct Toc {
    /// Every entry, parents before children, implicit directories included.
    pub entries: Vec<Entry>,
    pub landmark: Landmark,
    /// Where the TOC member starts; data chunks all end before it.
    pub toc_offset: u64,
}

/// The TOC as its JSON gives it. Its strings borrow from the JSON where they can (those without
/// escapes, which is nearly all): a TOC of thousands of entries is parsed on a pull's path, and
/// a string each for eight fields of every entry was most of the parse's time.
#[derive(Deserialize)]
struct RawToc<'a> {
    version: i64,
    #[serde(borrow)]
    entries: Vec<RawEntry<'a>>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct RawEntry<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    size: i64,
    #[serde(borrow)]
    modtime: Cow<'a, str>,
    #[serde(borrow)]
    link_name: Cow<'a, str>,
    mode: i64,
    uid: i64,
    gid: i64,
    #[serde(borrow)]
    user_name: Cow<'a, str>,
    #[serde(borrow)]
    group_name: Cow<'a, str>,
    offset: i64,
    inner_offset: i64,
    dev_major: i64,
    dev_minor: i64,
    xattrs: BTreeMap<String, String>,
    #[serde(borrow)]
    digest: Cow<'a, str>,
    chunk_offset: i64,
    chunk_size: i64,
    #[serde(borrow)]
    chunk_digest: Cow<'a, str>,
}

/// Decompresses the TOC (`compressed`: the gzip member of a tar holding `stargz.index.json`,
/// or zstd:chunked's zstd frame of the bare JSON), checks its JSON against `expected_digest`,
/// and parses it. Data members end at `data_end`. At most `limit` bytes are ever decompressed,
/// whatever the TOC claims.
pub fn decode_toc(
    compressed: &[u8],
    compression: Compression,
    data_end: u64,
    expected_digest: &str,
    limit: u64,
) -> Result<Toc, FormatError> {
    parse_toc(&verified_toc_json(compressed, compression, expected_digest, limit)?, data_end)
}

/// The first half of [`decode_toc`]: the TOC's JSON, decompressed and checked against
/// `expected_digest`, not yet parsed. Parsing a large TOC takes tens of milliseconds, which a
/// caller may want to spend while it already acts on the JSON (see [`super::hint`]).
pub fn verified_toc_json(
    compressed: &[u8],
    compression: Compression,
    expected_digest: &str,
    limit: u64,
) -> Result<Vec<u8>, FormatError> {
    let mut out = Vec::new();
    let json = match compression {
        Compression::Gzip => {
            flate2::read::GzDecoder::new(compressed)
                .take(limit.saturating_add(1024))
                .read_to_end(&mut out)
                .map_err(|e| FormatError::TocMember(format!("gzip: {e}")))?;
            let json = toc_json(&out, limit)?;
            512..512 + json.len()
        }
        Compression::Zstd => {
            zstd::stream::read::Decoder::new(compressed)
                .and_then(|d| d.take(limit.saturating_add(1)).read_to_end(&mut out))
                .map_err(|e| FormatError::TocMember(format!("zstd: {e}")))?;
            if out.len() as u64 > limit {
                return Err(FormatError::TocTooLarge { limit });
            }
            0..out.len()
        }
    };
    out.truncate(json.end);
    out.drain(..json.start);
    let actual = sha256_digest(&out);
    if actual != expected_digest {
        return Err(FormatError::TocDigest { expected: expected_digest.to_owned(), actual });
    }
    Ok(out)
}

/// The JSON of the single `stargz.index.json` entry of the TOC member's tar.
fn toc_json(tar: &[u8], limit: u64) -> Result<&[u8], FormatError> {
    let bad = |m: &str| FormatError::TocMember(m.to_owned());
    let header = tar.get(..512).ok_or_else(|| bad("shorter than one tar header"))?;
    let name_end = header[..100].iter().position(|&b| b == 0).unwrap_or(100);
    if &header[..name_end] != TOC_NAME.as_bytes() {
        return Err(bad(&format!(
            "its tar entry is {:?}, not {TOC_NAME}",
            String::from_utf8_lossy(&header[..name_end])
        )));
    }
    if !matches!(header[156], b'0' | 0) {
        return Err(bad("its tar entry is not a regular file"));
    }
    let size = tar_size(&header[124..136]).ok_or_else(|| bad("its tar header has no valid size"))?;
    if size > limit {
        return Err(FormatError::TocTooLarge { limit });
    }
    tar.get(512..512 + size as usize).ok_or_else(|| bad("the TOC JSON is cut short"))
}

/// A tar size field: octal digits, or GNU base-256 when the top bit is set.
fn tar_size(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        let mut v: u64 = (field[0] & 0x7f) as u64;
        for &b in &field[1..] {
            v = v.checked_mul(256)?.checked_add(b as u64)?;
        }
        return Some(v);
    }
    let text = std::str::from_utf8(field).ok()?.trim_matches(|c: char| c == '\0' || c == ' ');
    u64::from_str_radix(text, 8).ok()
}

/// `name` as a path inside the layer, or why it cannot be one.
pub fn normalise_name(name: &str) -> Result<String, String> {
    normalise(name)
}

fn normalise(name: &str) -> Result<String, String> {
    if name.contains('\0') {
        return Err("contains a NUL byte".into());
    }
    if name.starts_with('/') {
        return Err("is an absolute path".into());
    }
    // Nearly every name is already normal (a directory's with one `/` at its end): taken as it
    // is, without splitting and joining it again.
    let trimmed = name.strip_suffix('/').unwrap_or(name);
    if trimmed.split('/').all(|p| !matches!(p, "" | "." | "..")) {
        return Ok(trimmed.to_owned());
    }
    normalise_parts(name)
}

/// `name`, not starting with `/`, with its empty and `.` parts dropped.
fn normalise_parts(name: &str) -> Result<String, String> {
    let mut parts = Vec::new();
    for part in name.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err("climbs out of the layer with `..`".into()),
            p => parts.push(p),
        }
    }
    Ok(parts.join("/"))
}

fn entry_err(name: &str, reason: impl Into<String>) -> FormatError {
    FormatError::Entry { name: name.to_owned(), reason: reason.into() }
}

fn digest_field(name: &str, field: &str, d: &str) -> Result<(), FormatError> {
    if is_sha256_digest(d) { Ok(()) } else { Err(entry_err(name, format!("{field} {d:?} is not a sha256 digest"))) }
}

fn non_negative(name: &str, field: &str, v: i64) -> Result<u64, FormatError> {
    u64::try_from(v).map_err(|_| entry_err(name, format!("{field} is negative ({v})")))
}

/// Parses and validates TOC JSON whose digest has already been checked.
pub fn parse_toc(json: &[u8], toc_offset: u64) -> Result<Toc, FormatError> {
    let raw: RawToc = serde_json::from_slice(json).map_err(|e| FormatError::TocJson(e.to_string()))?;
    if raw.version != 1 {
        return Err(FormatError::TocJson(format!("version {} is not 1", raw.version)));
    }
    let mut b = Builder::default();
    let mut landmark = Landmark::None;
    // Members that start where no file's chunk does (the landmarks' own) still end the chunk
    // before them.
    let mut other_starts = Vec::new();
    // Names a TOC gives only when they change for a uid or gid.
    let mut user_names: HashMap<i64, String> = HashMap::default();
    let mut group_names: HashMap<i64, String> = HashMap::default();
    // The regular file whose chunks follow, by index into `b.entries`.
    let mut open_file: Option<usize> = None;
    for r in raw.entries {
        if r.kind == "chunk" {
            let Some(i) = open_file else {
                return Err(entry_err(&r.name, "a chunk entry follows no regular file"));
            };
            let chunk = raw_chunk(&r.name, &r)?;
            b.add_chunk(i, chunk)?;
            continue;
        }
        if let Some(i) = open_file.take() {
            b.finish_file(i)?;
        }
        let path = normalise(&r.name).map_err(|why| entry_err(&r.name, format!("its name {why}")))?;
        if path == TOC_NAME {
            continue;
        }
        if path == PREFETCH_LANDMARK || path == NO_PREFETCH_LANDMARK {
            let offset = non_negative(&r.name, "offset", r.offset)?;
            // A landmark's member holds its one byte, so it starts before the TOC. One past it
            // would end the chunk before it beyond the blob's data, where a reader would fetch
            // and hold bytes that are not a chunk.
            if offset > 0 {
                if offset >= toc_offset {
                    return Err(entry_err(&path, format!("its offset {offset} is not before the TOC at {toc_offset}")));
                }
                other_starts.push(offset);
            }
            landmark = if path == PREFETCH_LANDMARK { Landmark::Prefetch { offset } } else { Landmark::NoPrefetch };
            continue;
        }
        if path.is_empty() && r.kind != "dir" {
            return Err(entry_err(&r.name, "the layer's root must be a directory"));
        }
        // Most entries repeat the name already known for their id: no new string for those.
        if !r.user_name.is_empty() && user_names.get(&r.uid).map(String::as_str) != Some(&r.user_name) {
            user_names.insert(r.uid, r.user_name.to_string());
        }
        if !r.group_name.is_empty() && group_names.get(&r.gid).map(String::as_str) != Some(&r.group_name) {
            group_names.insert(r.gid, r.group_name.to_string());
        }
        let mut xattrs = BTreeMap::new();
        for (k, v) in &r.xattrs {
            let value = base64::engine::general_purpose::STANDARD
                .decode(v)
                .map_err(|e| entry_err(&r.name, format!("xattr {k}: not base64: {e}")))?;
            xattrs.insert(k.clone(), value);
        }
        let link = || normalise(&r.link_name).map_err(|why| entry_err(&r.name, format!("its link target {why}")));
        let dev = |v: i64, what: &str| {
            u32::try_from(v).map_err(|_| entry_err(&r.name, format!("{what} {v} is out of range")))
        };
        let kind = match r.kind.as_ref() {
            "dir" => EntryKind::Dir,
            "reg" => EntryKind::Reg,
            "symlink" => {
                if r.link_name.is_empty() {
                    return Err(entry_err(&r.name, "a symlink without a target"));
                }
                // A symlink's target is resolved by the kernel inside the container's root, so
                // any text is safe as a target; it is kept as written.
                EntryKind::Symlink(r.link_name.to_string())
            }
            "hardlink" => EntryKind::Hardlink(link()?),
            "char" => EntryKind::Char { major: dev(r.dev_major, "devMajor")?, minor: dev(r.dev_minor, "devMinor")? },
            "block" => EntryKind::Block { major: dev(r.dev_major, "devMajor")?, minor: dev(r.dev_minor, "devMinor")? },
            "fifo" => EntryKind::Fifo,
            other => return Err(entry_err(&r.name, format!("unknown type {other:?}"))),
        };
        let mtime = match r.modtime.as_ref() {
            "" => 0,
            t => parse_rfc3339(t).ok_or_else(|| entry_err(&r.name, format!("modtime {t:?} is not RFC 3339")))?.0,
        };
        let size = if kind == EntryKind::Reg { non_negative(&r.name, "size", r.size)? } else { 0 };
        if !r.digest.is_empty() {
            digest_field(&r.name, "digest", &r.digest)?;
        }
        let id = |v: i64, what: &str| {
            u32::try_from(v).map_err(|_| entry_err(&r.name, format!("{what} {v} is out of range")))
        };
        let entry = Entry {
            path,
            kind: kind.clone(),
            mode: (r.mode & 0o7777) as u32,
            uid: id(r.uid, "uid")?,
            gid: id(r.gid, "gid")?,
            user_name: user_names.get(&r.uid).cloned(),
            group_name: group_names.get(&r.gid).cloned(),
            mtime,
            xattrs,
            size,
            digest: (!r.digest.is_empty()).then(|| r.digest.to_string()),
            chunks: Vec::new(),
            implicit: false,
        };
        let i = b.add(entry)?;
        if kind == EntryKind::Reg && size > 0 {
            let first = raw_chunk(&r.name, &r)?;
            b.add_chunk(i, first)?;
            open_file = Some(i);
        }
    }
    if let Some(i) = open_file {
        b.finish_file(i)?;
    }
    let mut entries = b.entries;
    set_compressed_ends(&mut entries, toc_offset, &other_starts)?;
    Ok(Toc { entries, landmark, toc_offset })
}

fn raw_chunk(name: &str, r: &RawEntry<'_>) -> Result<Chunk, FormatError> {
    digest_field(name, "chunkDigest", &r.chunk_digest)?;
    let (offset, inner_offset) =
        (non_negative(name, "offset", r.offset)?, non_negative(name, "innerOffset", r.inner_offset)?);
    // Writers leave out an offset of 0 (omitempty), so a missing one reads as 0. Data never
    // starts there: the blob's first bytes are the first entry's tar header. A chunk said to
    // start there is a TOC that lost its offsets, and its range would be a guess.
    if offset == 0 && inner_offset == 0 {
        return Err(entry_err(
            name,
            format!(
                "its chunk at {} has no offset in the blob (byte 0 is the first tar header, never data)",
                r.chunk_offset.max(0)
            ),
        ));
    }
    Ok(Chunk {
        file_offset: non_negative(name, "chunkOffset", r.chunk_offset)?,
        // 0 means "to the end of the file"; finish_file fills it in.
        size: non_negative(name, "chunkSize", r.chunk_size)?,
        offset,
        compressed_end: 0,
        inner_offset,
        digest: r.chunk_digest.to_string(),
    })
}

/// The tree as it is built: entries in order, with an index by path.
#[derive(Default)]
struct Builder {
    entries: Vec<Entry>,
    by_path: HashMap<String, usize>,
}

impl Builder {
    fn add(&mut self, entry: Entry) -> Result<usize, FormatError> {
        if !entry.path.is_empty() {
            self.ensure_parent_dirs(&entry.path)?;
        }
        if let EntryKind::Hardlink(target) = &entry.kind {
            match self.by_path.get(target).map(|&i| &self.entries[i].kind) {
                Some(EntryKind::Reg) => {}
                Some(_) => {
                    return Err(entry_err(
                        &entry.path,
                        format!("hard link to {target:?}, which is not a regular file"),
                    ));
                }
                None => {
                    return Err(entry_err(
                        &entry.path,
                        format!("hard link to {target:?}, which comes later or not at all"),
                    ));
                }
            }
        }
        match self.by_path.get(&entry.path) {
            // A later entry for the same path replaces the earlier one, as in a tar unpack;
            // a directory only takes the new metadata and keeps its children.
            Some(&i) => {
                if self.entries[i].kind == EntryKind::Dir
                    && entry.kind != EntryKind::Dir
                    && self.has_children(&entry.path)
                {
                    return Err(entry_err(&entry.path, "replaces a directory that has entries"));
                }
                self.entries[i] = entry;
                Ok(i)
            }
            None => {
                self.by_path.insert(entry.path.clone(), self.entries.len());
                self.entries.push(entry);
                Ok(self.entries.len() - 1)
            }
        }
    }

    fn has_children(&self, dir: &str) -> bool {
        let prefix = format!("{dir}/");
        self.by_path.keys().any(|p| p.starts_with(&prefix))
    }

    /// Creates missing parents as plain directories, and refuses a parent that is not one:
    /// `link/file` under a symlink `link` would, when unpacked, land wherever `link` points.
    /// Every path here had its own parents made or checked when it came, so the walk up stops
    /// at the first that is here: a TOC of thousands of entries is read on a pull's path.
    fn ensure_parent_dirs(&mut self, path: &str) -> Result<(), FormatError> {
        let mut missing = Vec::new();
        let mut at = path;
        loop {
            let parent = at.rsplit_once('/').map_or("", |(p, _)| p);
            match self.by_path.get(parent) {
                Some(&i) if self.entries[i].kind == EntryKind::Dir => break,
                Some(_) => return Err(entry_err(path, format!("its parent {parent:?} is not a directory"))),
                None => missing.push(parent),
            }
            if parent.is_empty() {
                break;
            }
            at = parent;
        }
        for dir in missing.into_iter().rev() {
            self.ensure_dir(dir, path)?;
        }
        Ok(())
    }

    fn ensure_dir(&mut self, dir: &str, child: &str) -> Result<(), FormatError> {
        match self.by_path.get(dir) {
            Some(&i) if self.entries[i].kind == EntryKind::Dir => Ok(()),
            Some(_) => Err(entry_err(child, format!("its parent {dir:?} is not a directory"))),
            None => {
                self.by_path.insert(dir.to_owned(), self.entries.len());
                self.entries.push(Entry {
                    path: dir.to_owned(),
                    kind: EntryKind::Dir,
                    mode: 0o755,
                    uid: 0,
                    gid: 0,
                    user_name: None,
                    group_name: None,
                    mtime: 0,
                    xattrs: BTreeMap::new(),
                    size: 0,
                    digest: None,
                    chunks: Vec::new(),
                    implicit: true,
                });
                Ok(())
            }
        }
    }

    fn add_chunk(&mut self, i: usize, chunk: Chunk) -> Result<(), FormatError> {
        let e = &mut self.entries[i];
        let expected = e.chunks.last().map(|c| c.file_offset + c.size).unwrap_or(0);
        if chunk.file_offset != expected {
            return Err(entry_err(&e.path, format!("a chunk starts at {}, not at {expected}", chunk.file_offset)));
        }
        if let Some(last) = e.chunks.last()
            && last.size == 0
        {
            return Err(entry_err(&e.path, "a chunk follows the one that runs to the end of the file"));
        }
        e.chunks.push(chunk);
        Ok(())
    }

    /// Gives the last chunk its size, and checks that the chunks cover the file exactly.
    fn finish_file(&mut self, i: usize) -> Result<(), FormatError> {
        let e = &mut self.entries[i];
        let size = e.size;
        let Some(last) = e.chunks.last_mut() else { return Ok(()) };
        if last.size == 0 {
            last.size = size.checked_sub(last.file_offset).filter(|&s| s > 0).ok_or_else(|| {
                entry_err(&e.path, format!("its last chunk starts at {}, at or past its size {size}", last.file_offset))
            })?;
        }
        let covered = last.file_offset + last.size;
        if let Some(big) = e.chunks.iter().find(|c| c.size > MAX_CHUNK_SIZE) {
            return Err(entry_err(
                &e.path,
                format!("a chunk of {} bytes is over the {MAX_CHUNK_SIZE}-byte limit", big.size),
            ));
        }
        if covered != size {
            return Err(entry_err(&e.path, format!("its chunks cover {covered} bytes of {size}")));
        }
        Ok(())
    }
}

/// Each chunk's compressed range ends where the next chunk in blob order starts a new member
/// (chunks sharing a member differ only by inner offset), and the last ends at the TOC.
fn set_compressed_ends(entries: &mut [Entry], toc_offset: u64, other_starts: &[u64]) -> Result<(), FormatError> {
    let mut starts: Vec<u64> = entries
        .iter()
        .flat_map(|e| e.chunks.iter())
        .filter(|c| c.inner_offset == 0)
        .map(|c| c.offset)
        .chain(other_starts.iter().copied())
        .collect();
    starts.sort_unstable();
    starts.dedup();
    // What each member must yield: the furthest chunk end of the chunks inside it.
    let mut need: HashMap<u64, u64> = HashMap::default();
    // Where each chunk's data starts. Two chunks that start at one place would be the same
    // bytes: a writer never puts them there, and one of them is not where the TOC says.
    let mut start_of: HashMap<(u64, u64), &str> = HashMap::default();
    for e in entries.iter() {
        for c in &e.chunks {
            let n = need.entry(c.offset).or_default();
            *n = (*n).max(c.inner_offset.saturating_add(c.size));
            if let Some(other) = start_of.insert((c.offset, c.inner_offset), &e.path) {
                return Err(entry_err(
                    &e.path,
                    format!(
                        "its chunk at {} starts at {} (inner offset {}), where a chunk of {other:?} starts too",
                        c.file_offset, c.offset, c.inner_offset
                    ),
                ));
            }
        }
    }
    for e in entries.iter_mut() {
        for c in &mut e.chunks {
            if c.offset >= toc_offset {
                return Err(entry_err(&e.path, format!("a chunk at {} lies past the TOC at {toc_offset}", c.offset)));
            }
            let next = starts.partition_point(|&s| s <= c.offset);
            c.compressed_end = starts.get(next).copied().unwrap_or(toc_offset);
            // The invariant every reader relies on: what it fetches for a chunk is data, in
            // the blob, before the TOC. The checks above keep it; this keeps it for certain.
            if c.compressed_end > toc_offset || c.offset >= c.compressed_end {
                return Err(entry_err(
                    &e.path,
                    format!(
                        "its chunk at {} spans {}..{}, not inside the data before the TOC at {toc_offset}",
                        c.file_offset, c.offset, c.compressed_end
                    ),
                ));
            }
            // A chunk's range is fetched and held whole. Compressed, a member is never much
            // larger than what it holds: its chunks, then the headers of the entries that
            // follow (a run of directories and links). A range far larger is not a chunk but
            // a way to make a reader hold gigabytes.
            let extent = c.compressed_end - c.offset;
            let most = need[&c.offset].saturating_mul(2).max(need[&c.offset].saturating_add(MEMBER_SLACK));
            if extent > most {
                return Err(entry_err(
                    &e.path,
                    format!(
                        "the compressed range of its chunk at {} is {extent} bytes, more than the {most} \
                         that its {} bytes can take",
                        c.offset, need[&c.offset]
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// What a member may hold beyond its chunks, compressed: the headers of the entries after them.
const MEMBER_SLACK: u64 = 64 << 20;

#[cfg(test)]
mod tests {
    use super::super::testblob::build;
    use super::super::{decode_chunk, parse_footer};
    use super::*;
    use serde_json::json;

    fn read(b: &super::super::testblob::Built, limit: u64) -> Result<Toc, FormatError> {
        let size = b.blob.len() as u64;
        let footer = parse_footer(&b.blob[b.blob.len() - 51..], size).unwrap();
        let member = &b.blob[footer.toc_offset as usize..(size - footer.len) as usize];
        decode_toc(member, Compression::Gzip, footer.toc_offset, &b.toc_digest, limit)
    }

    fn entry<'a>(toc: &'a Toc, path: &str) -> &'a Entry {
        toc.entries.iter().find(|e| e.path == path).unwrap_or_else(|| panic!("no {path}"))
    }

    #[test]
    fn a_layer_reads_back_file_by_file_and_chunk_by_chunk() {
        let big: Vec<u8> = (0..10_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let b = build(
            &[("bin/tool", &big, 16 * 1024), ("etc/motd", b"hello\n", 4096)],
            &[
                json!({"name": "./", "type": "dir", "mode": 0o755, "uid": 0, "gid": 0, "userName": "root", "groupName": "root"}),
                json!({"name": "bin/", "type": "dir", "mode": 0o755, "modtime": "2024-01-02T03:04:05Z"}),
                json!({"name": "bin/sh", "type": "symlink", "linkName": "tool"}),
                json!({"name": "home/u", "type": "dir", "uid": 1000, "gid": 1000, "userName": "u", "groupName": "g",
                       "xattrs": {"user.tag": "dmFsdWU="}}),
                json!({"name": "home/u/.wh..wh..opq", "type": "reg", "uid": 1000, "gid": 1000}),
                json!({"name": "dev/null", "type": "char", "devMajor": 1, "devMinor": 3, "mode": 0o666}),
                json!({"name": ".prefetch.landmark", "type": "reg", "size": 1, "offset": 0,
                       "chunkDigest": super::super::sha256_digest(&[0x0f])}),
            ],
        );
        let toc = read(&b, 1 << 20).unwrap();
        assert_eq!(toc.landmark, Landmark::Prefetch { offset: 0 });
        assert!(toc.entries.iter().all(|e| e.path != ".prefetch.landmark"), "landmarks are not files");
        assert_eq!(entry(&toc, "").kind, EntryKind::Dir);
        assert_eq!(entry(&toc, "bin").mtime, 1704164645);
        assert_eq!(entry(&toc, "bin/sh").kind, EntryKind::Symlink("tool".into()));
        assert_eq!(entry(&toc, "dev").mode, 0o755, "implicit parents are plain directories");
        assert!(entry(&toc, "dev").implicit && !entry(&toc, "bin").implicit);
        assert_eq!(entry(&toc, "dev/null").kind, EntryKind::Char { major: 1, minor: 3 });
        let home = entry(&toc, "home/u");
        assert_eq!(home.xattrs["user.tag"], b"value");
        assert_eq!((home.user_name.as_deref(), home.group_name.as_deref()), (Some("u"), Some("g")));
        let opq = entry(&toc, "home/u/.wh..wh..opq");
        assert_eq!(opq.user_name.as_deref(), Some("u"), "names carry forward for the same uid");
        let tool = entry(&toc, "bin/tool");
        assert_eq!(tool.chunks.len(), 3);
        let mut bytes = Vec::new();
        for c in &tool.chunks {
            bytes.extend(decode_chunk(&tool.path, c, &b.blob[c.offset as usize..c.compressed_end as usize]).unwrap());
        }
        assert_eq!(bytes, big, "the chunks reassemble the file");
        let motd = entry(&toc, "etc/motd");
        let c = &motd.chunks[0];
        assert_eq!(c.compressed_end, b.toc_offset, "the last chunk ends at the TOC");
        assert_eq!(
            decode_chunk("etc/motd", c, &b.blob[c.offset as usize..c.compressed_end as usize]).unwrap(),
            b"hello\n"
        );
    }

    #[test]
    fn a_landmark_member_ends_the_chunk_before_it() {
        let d = super::super::sha256_digest(b"abcd");
        let json = serde_json::to_vec(&json!({"version": 1, "entries": [
            {"name": "a", "type": "reg", "size": 4, "offset": 10, "chunkDigest": d},
            {"name": ".prefetch.landmark", "type": "reg", "size": 1, "offset": 100, "chunkDigest": d},
            {"name": "b", "type": "reg", "size": 4, "offset": 150, "chunkDigest": d},
        ]}))
        .unwrap();
        let toc = parse_toc(&json, 200).unwrap();
        assert_eq!(toc.landmark, Landmark::Prefetch { offset: 100 });
        assert_eq!(entry(&toc, "a").chunks[0].compressed_end, 100, "the prefetch region holds all of a");
        assert_eq!(entry(&toc, "b").chunks[0].compressed_end, 200);
    }

    /// The fuzzer's find, kept as its seed: a file with no offset (so 0), and a landmark past
    /// the TOC, made a chunk of 0..3030 in a 217-byte input, which a reader would fetch.
    #[test]
    fn the_fuzz_find_of_a_chunk_past_the_toc_is_refused() {
        let json = include_bytes!("../../../fuzz/seeds/toc/no-offset-landmark-past-toc.json");
        let e = parse_toc(json, json.len() as u64).unwrap_err().to_string();
        assert!(e.starts_with("TOC entry \"a\"") && e.contains("no offset"), "{e}");
    }

    fn toc_json(entries: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&json!({"version": 1, "entries": entries})).unwrap()
    }

    #[test]
    fn a_landmark_at_or_past_the_toc_is_refused() {
        let d = super::super::sha256_digest(b"abcd");
        for name in [PREFETCH_LANDMARK, NO_PREFETCH_LANDMARK] {
            for at in [200, 3030] {
                let json = toc_json(json!([
                    {"name": "a", "type": "reg", "size": 4, "offset": 10, "chunkDigest": d},
                    {"name": name, "type": "reg", "size": 1, "offset": at, "chunkDigest": d},
                ]));
                let e = parse_toc(&json, 200).unwrap_err().to_string();
                assert_eq!(e, format!("TOC entry {name:?}: its offset {at} is not before the TOC at 200"));
            }
        }
    }

    #[test]
    fn a_chunk_with_no_offset_is_refused_unless_it_is_inside_the_first_member() {
        let d = super::super::sha256_digest(b"abcd");
        for offset in [json!(0), serde_json::Value::Null] {
            let mut file = json!({"name": "a", "type": "reg", "size": 4, "chunkDigest": d});
            if !offset.is_null() {
                file["offset"] = offset;
            }
            let e = parse_toc(&toc_json(json!([file])), 200).unwrap_err().to_string();
            assert!(e.starts_with("TOC entry \"a\": its chunk at 0 has no offset"), "{e}");
        }
        let chunked = toc_json(json!([
            {"name": "a", "type": "reg", "size": 8, "offset": 10, "chunkSize": 4, "chunkDigest": d},
            {"name": "a", "type": "chunk", "chunkOffset": 4, "chunkDigest": d},
        ]));
        let e = parse_toc(&chunked, 200).unwrap_err().to_string();
        assert!(e.starts_with("TOC entry \"a\": its chunk at 4 has no offset"), "{e}");
        // Packed small files (min chunk size): the first one's data is in the blob's first
        // member, after the headers, at an inner offset.
        let packed = toc_json(json!([{"name": "a", "type": "reg", "size": 4, "innerOffset": 512, "chunkDigest": d}]));
        let toc = parse_toc(&packed, 200).unwrap();
        assert_eq!((toc.entries[1].chunks[0].offset, toc.entries[1].chunks[0].compressed_end), (0, 200));
    }

    #[test]
    fn two_chunks_that_start_at_one_place_are_refused() {
        let d = super::super::sha256_digest(b"abcd");
        let json = toc_json(json!([
            {"name": "a", "type": "reg", "size": 4, "offset": 10, "chunkDigest": d},
            {"name": "b", "type": "reg", "size": 4, "offset": 10, "chunkDigest": d},
        ]));
        let e = parse_toc(&json, 200).unwrap_err().to_string();
        assert_eq!(
            e,
            "TOC entry \"b\": its chunk at 0 starts at 10 (inner offset 0), where a chunk of \"a\" starts too"
        );
        // Files packed into one member differ by inner offset, and share its range.
        let packed = toc_json(json!([
            {"name": "a", "type": "reg", "size": 4, "offset": 10, "innerOffset": 512, "chunkDigest": d},
            {"name": "b", "type": "reg", "size": 4, "offset": 10, "innerOffset": 1024, "chunkDigest": d},
        ]));
        let toc = parse_toc(&packed, 200).unwrap();
        assert!(toc.entries[1..].iter().all(|e| (e.chunks[0].offset, e.chunks[0].compressed_end) == (10, 200)));
    }

    /// A chunk of 4 bytes whose member runs on for 20 GB (the TOC, matching its digest, says
    /// so): refused at parse, naming the file, rather than fetched and held whole at a read.
    #[test]
    fn a_chunk_whose_range_is_far_larger_than_it_is_refused() {
        let d = super::super::sha256_digest(b"abcd");
        let toc_of = |gap: u64| {
            serde_json::to_vec(&json!({"version": 1, "entries": [
                {"name": "a", "type": "reg", "size": 4, "offset": 10, "chunkDigest": d},
                {"name": "b", "type": "reg", "size": 4, "offset": 10 + gap, "chunkDigest": d},
            ]}))
            .unwrap()
        };
        let e = parse_toc(&toc_of(20 << 30), (20 << 30) + 100).unwrap_err().to_string();
        assert!(e.contains("\"a\"") && e.contains("compressed range"), "{e}");
        // A member that also holds the headers of what follows (a run of directories) is fine.
        assert!(parse_toc(&toc_of(1 << 20), (1 << 20) + 100).is_ok());
    }

    #[test]
    fn a_toc_that_does_not_match_its_digest_is_never_parsed() {
        let mut b = build(&[("a", b"x", 4096)], &[]);
        b.toc_digest = super::super::sha256_digest(b"something else");
        assert!(matches!(read(&b, 1 << 20), Err(FormatError::TocDigest { .. })));
    }

    #[test]
    fn a_toc_over_the_limit_is_refused_without_decompressing_it_all() {
        let b = build(&[("a", b"x", 4096)], &[]);
        assert!(matches!(read(&b, 64), Err(FormatError::TocTooLarge { limit: 64 })));
    }

    #[test]
    fn escaping_names_and_files_used_as_directories_are_refused() {
        for (bad, why) in [
            (json!({"name": "../etc/passwd", "type": "reg"}), "climbs out"),
            (json!({"name": "a/../../x", "type": "dir"}), "climbs out"),
            (json!({"name": "/etc/passwd", "type": "reg"}), "absolute"),
            (json!({"name": "x", "type": "whatever"}), "unknown type"),
            (json!({"name": "x", "type": "hardlink", "linkName": "missing"}), "comes later or not at all"),
            (json!({"name": "x", "type": "hardlink", "linkName": "../../etc/shadow"}), "climbs out"),
        ] {
            let b = build(&[], std::slice::from_ref(&bad));
            let e = read(&b, 1 << 20).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        let b = build(
            &[],
            &[
                json!({"name": "link", "type": "symlink", "linkName": "/etc"}),
                json!({"name": "link/passwd", "type": "reg"}),
            ],
        );
        let e = read(&b, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("parent \"link\" is not a directory"), "{e}");
    }

    #[test]
    fn chunk_lists_must_cover_the_file() {
        let d = super::super::sha256_digest(b"abcd");
        let gap = [
            json!({"name": "f", "type": "reg", "size": 8, "offset": 1, "chunkSize": 4, "chunkDigest": d}),
            json!({"name": "f", "type": "chunk", "offset": 2, "chunkOffset": 5, "chunkDigest": d}),
        ];
        let e = read(&build(&[], &gap), 1 << 20).unwrap_err().to_string();
        assert!(e.contains("starts at 5, not at 4"), "{e}");
        let short = [json!({"name": "f", "type": "reg", "size": 8, "offset": 1, "chunkSize": 4, "chunkDigest": d})];
        let e = read(&build(&[], &short), 1 << 20).unwrap_err().to_string();
        assert!(e.contains("cover 4 bytes of 8"), "{e}");
        let huge = [json!({"name": "f", "type": "reg", "size": 1u64 << 40, "offset": 1, "chunkDigest": d})];
        let e = read(&build(&[], &huge), 1 << 20).unwrap_err().to_string();
        assert!(e.contains("over the"), "a TOC cannot claim a chunk too big to hold: {e}");
        let bad_digest = [json!({"name": "f", "type": "reg", "size": 8, "offset": 0, "chunkDigest": "md5:x"})];
        let e = read(&build(&[], &bad_digest), 1 << 20).unwrap_err().to_string();
        assert!(e.contains("not a sha256 digest"), "{e}");
    }

    #[test]
    fn flipped_or_missing_chunk_bytes_never_pass() {
        let b = build(&[("f", &[7u8; 5000], 4096)], &[]);
        let toc = read(&b, 1 << 20).unwrap();
        let f = entry(&toc, "f");
        let c = &f.chunks[0];
        let range = &b.blob[c.offset as usize..c.compressed_end as usize];
        let mut lying = c.clone();
        lying.digest = super::super::sha256_digest(b"other");
        assert!(matches!(decode_chunk("f", &lying, range), Err(FormatError::ChunkDigest { .. })));
        let e = decode_chunk("f", c, &range[..range.len() / 2]).unwrap_err();
        assert!(matches!(e, FormatError::Chunk { .. }), "{e}");
        let mut flipped = range.to_vec();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0x55;
        assert!(decode_chunk("f", c, &flipped).is_err());
    }
}

#[cfg(test)]
mod robustness {
    use super::super::testblob::build;
    use super::super::{decode_chunk, parse_footer};
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Any bytes at the end of a blob give a footer or an error, never a panic.
        #[test]
        fn any_tail_is_a_footer_or_an_error(tail in proptest::collection::vec(any::<u8>(), 0..80), size in 0u64..1 << 40) {
            let _ = parse_footer(&tail, size);
        }

        /// A TOC with any byte changed parses or is refused; a mutated TOC whose digest still
        /// matched would be refused by the digest check first, so this drives the parser
        /// directly.
        #[test]
        fn a_damaged_toc_is_parsed_or_refused(pos in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let b = build(&[("a/b", b"0123456789", 4), ("c", b"x", 4096)],
                &[serde_json::json!({"name": "l", "type": "symlink", "linkName": "a/b"})]);
            let size = b.blob.len() as u64;
            let footer = parse_footer(&b.blob[b.blob.len() - 51..], size).unwrap();
            let member = &b.blob[footer.toc_offset as usize..(size - footer.len) as usize];
            let mut tar = Vec::new();
            flate2::read::GzDecoder::new(member).read_to_end(&mut tar).unwrap();
            let json_len = tar_size(&tar[124..136]).unwrap() as usize;
            let mut json = tar[512..512 + json_len].to_vec();
            let i = pos.index(json.len());
            json[i] = byte;
            if let Ok(toc) = parse_toc(&json, footer.toc_offset) {
                for e in &toc.entries {
                    for c in &e.chunks {
                        let end = (c.compressed_end as usize).min(b.blob.len());
                        let start = (c.offset as usize).min(end);
                        let _ = decode_chunk(&e.path, c, &b.blob[start..end]);
                    }
                }
            }
        }

        /// A name already normal is taken as it is; that must be what normalising it gives.
        #[test]
        fn a_name_taken_as_it_is_is_what_normalising_it_gives(name in "[ab./]{0,12}") {
            if !name.starts_with('/') {
                prop_assert_eq!(normalise(&name), normalise_parts(&name), "{:?}", name);
            }
        }

        /// Random bytes as a TOC member give an error, never a panic or a huge allocation.
        #[test]
        fn any_toc_member_is_refused_cleanly(member in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode_toc(&member, Compression::Gzip, 0, "sha256:00", 1 << 20);
        }
    }
}
