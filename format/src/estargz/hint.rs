//! Where a TOC's prefetch landmark points, found without parsing the whole TOC. A layer whose
//! start-up files come first ends them with `.prefetch.landmark`; the bytes before it are what
//! a container waits for. Knowing that offset a few milliseconds after the TOC arrives, rather
//! than after the tens of milliseconds a large TOC takes to parse, lets the request for those
//! bytes go out while the parse runs. The same holds for one file's chunks ([`file_chunks`]):
//! the image's program, in a layer without start-up files. These are hints:
//! [`super::toc::parse_toc`] has the last word, and a caller must drop what it fetched on a
//! hint the parse does not confirm.

use super::Compression;
use serde::Deserialize;
use std::io::Write;

/// The root-level landmark's name, as it ends inside its JSON string.
const NEEDLE: &[u8] = b".prefetch.landmark\"";

#[derive(Deserialize)]
struct LandmarkEntry {
    name: String,
    #[serde(default)]
    offset: i64,
}

/// The offset `.prefetch.landmark` gives in `json` (a TOC's JSON), if it is found where
/// stargz-snapshotter's and Strata's writers put it: an entry object whose first member is its
/// `"name"`. `None` when there is no such landmark, or it is at offset 0 (nothing to prefetch).
pub fn prefetch_landmark(json: &[u8]) -> Option<u64> {
    for at in memchr::memmem::find_iter(json, NEEDLE) {
        let Some(start) = entry_start(&json[..at]) else { continue };
        let mut objects = serde_json::Deserializer::from_slice(&json[start..]).into_iter::<LandmarkEntry>();
        let Some(Ok(entry)) = objects.next() else { continue };
        if super::toc::normalise_name(&entry.name).as_deref() == Ok(super::toc::PREFETCH_LANDMARK) {
            return u64::try_from(entry.offset).ok().filter(|o| *o > 0);
        }
    }
    None
}

/// An entry as [`file_chunks`] reads it.
#[derive(Deserialize)]
struct ChunkEntry {
    name: String,
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    offset: i64,
    #[serde(rename = "linkName", default)]
    link_name: String,
    #[serde(rename = "chunkOffset", default)]
    chunk_offset: i64,
    #[serde(rename = "innerOffset", default)]
    inner_offset: i64,
}

/// Symbolic links followed at most from a program's path to its file.
const MAX_HOPS: usize = 8;
/// Entries read at most past a file's last chunk for where that chunk ends.
const MAX_AFTER: usize = 64;

/// The compressed ranges of the chunks of the regular file at `path` (symbolic links
/// followed) whose data starts within its first `within` bytes, found in `json` (a TOC's JSON)
/// without parsing the rest of it, as [`super::toc::parse_toc`] will place them: each chunk
/// ends where the next entry's data starts, the last one in the blob at `data_end`. So the
/// image's program can be asked for while its layer's TOC is parsed. `None` for a file not
/// found so, or one whose chunks share gzip members (the parse's word is needed for those).
pub fn file_chunks(json: &[u8], path: &str, within: u64, data_end: u64) -> Option<Vec<std::ops::Range<u64>>> {
    let mut name = super::toc::normalise_name(path.trim_start_matches('/')).ok()?;
    for _ in 0..MAX_HOPS {
        let (entry, next) = find_entry(json, &name)?;
        match entry.kind.as_str() {
            "symlink" => name = link_target(&name, &entry.link_name)?,
            "reg" => return chunk_ranges(json, next, &name, entry, within, data_end),
            _ => return None,
        }
    }
    None
}

/// The entry named `name`, and where the entry after it starts, if it is written as
/// stargz-snapshotter's and Strata's writers write one (its `"name"` first).
fn find_entry(json: &[u8], name: &str) -> Option<(ChunkEntry, Option<usize>)> {
    let needle = [name.as_bytes(), b"\""].concat();
    for at in memchr::memmem::find_iter(json, &needle) {
        let Some((entry, next)) = entry_start(&json[..at]).and_then(|start| entry_at(json, start)) else { continue };
        if super::toc::normalise_name(&entry.name).as_deref() == Ok(name) && entry.kind != "chunk" {
            return Some((entry, next));
        }
    }
    None
}

/// The entry object at `at` in `json`, and where the next one starts: past the comma after it,
/// `None` at the end of the array.
fn entry_at(json: &[u8], at: usize) -> Option<(ChunkEntry, Option<usize>)> {
    let mut objects = serde_json::Deserializer::from_slice(&json[at..]).into_iter::<ChunkEntry>();
    let entry = objects.next()?.ok()?;
    let mut next = at + objects.byte_offset();
    next += json[next..].iter().position(|b| !b.is_ascii_whitespace())?;
    if json[next] != b',' {
        return Some((entry, None));
    }
    next += 1 + json[next + 1..].iter().position(|b| !b.is_ascii_whitespace())?;
    Some((entry, Some(next)))
}

/// Where a link at `name` to `target` leads, from the layer's root; `None` past the root.
fn link_target(name: &str, target: &str) -> Option<String> {
    let joined = match (target.strip_prefix('/'), name.rsplit_once('/')) {
        (Some(abs), _) => abs.to_owned(),
        (None, Some((dir, _))) => format!("{dir}/{target}"),
        (None, None) => target.to_owned(),
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in joined.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            p => parts.push(p),
        }
    }
    Some(parts.join("/"))
}

/// The ranges of the chunks of `name`, whose entry `first` is followed by the one at `next` in
/// `json`.
fn chunk_ranges(
    json: &[u8],
    mut next: Option<usize>,
    name: &str,
    first: ChunkEntry,
    within: u64,
    data_end: u64,
) -> Option<Vec<std::ops::Range<u64>>> {
    if first.inner_offset != 0 {
        return None;
    }
    let mut starts = vec![u64::try_from(first.offset).ok().filter(|&o| o > 0)?];
    let mut end = None;
    let mut entries = 0;
    while let Some(at) = next {
        let (entry, after) = entry_at(json, at)?;
        next = after;
        let offset = u64::try_from(entry.offset).unwrap_or(0);
        let last = *starts.last()?;
        if entry.kind == "chunk" && super::toc::normalise_name(&entry.name).as_deref() == Ok(name) {
            if entry.inner_offset != 0 || offset <= last {
                return None;
            }
            if u64::try_from(entry.chunk_offset).unwrap_or(u64::MAX) >= within {
                end = Some(offset);
                break;
            }
            starts.push(offset);
            continue;
        }
        if offset > last {
            end = Some(offset);
            break;
        }
        entries += 1;
        if entries > MAX_AFTER {
            return None;
        }
    }
    let ends = starts.iter().skip(1).copied().chain([end.unwrap_or(data_end)]);
    let ranges: Vec<_> = starts.iter().zip(ends).map(|(&s, e)| s..e).collect();
    // A range out of the blob's data is no chunk the parse could confirm: not asked for.
    ranges.iter().all(|r| r.start < r.end && r.end <= data_end).then_some(ranges)
}

/// JSON scanned at most while a TOC member arrives. Start-up entries come first in a TOC, so
/// a landmark is near its start; a layer without one is not decompressed twice in full.
const SCAN_LIMIT: usize = 1 << 20;

/// Finds the landmark in a TOC member while its compressed bytes arrive, so the request for
/// the start-up files can go out before the rest of the TOC is in. Nothing here is verified:
/// the offset is a hint like [`prefetch_landmark`]'s.
pub struct LandmarkScan {
    out: Option<Decoder>,
    /// How much of the output the last feed searched.
    searched: usize,
}

/// What a feed searches again of the output before its new bytes: an entry cut off at the end of
/// the last feed's output is whole now. An entry longer than this (large xattrs) is left to the
/// whole TOC's [`prefetch_landmark`], so no feed searches all of the output again.
const RESEARCH: usize = 64 << 10;

impl std::fmt::Debug for LandmarkScan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LandmarkScan").field("scanning", &self.out.is_some()).field("searched", &self.searched).finish()
    }
}

enum Decoder {
    Gzip(Box<flate2::write::GzDecoder<Capped>>),
    Zstd(zstd::stream::write::Decoder<'static, Capped>),
}

/// Decompressed JSON, refused past [`SCAN_LIMIT`] as it is written: a member that inflates a
/// thousandfold cannot make one piece of it take more memory than that.
struct Capped(Vec<u8>);

impl Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > SCAN_LIMIT {
            return Err(std::io::Error::other("past the scan's limit"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LandmarkScan {
    pub fn new(compression: Compression) -> LandmarkScan {
        let out = match compression {
            Compression::Gzip => Some(Decoder::Gzip(Box::new(flate2::write::GzDecoder::new(Capped(Vec::new()))))),
            Compression::Zstd => zstd::stream::write::Decoder::new(Capped(Vec::new())).ok().map(Decoder::Zstd),
        };
        LandmarkScan { out, searched: 0 }
    }

    /// Takes the member's next bytes; the landmark's offset once it is found. After that, or
    /// after bytes that do not decompress or past [`SCAN_LIMIT`], it only ever answers `None`.
    pub fn feed(&mut self, bytes: &[u8]) -> Option<u64> {
        let dec = self.out.as_mut()?;
        // What came out before a write failed is searched too: a member followed by other bytes
        // (the footer, in a blob's tail) fails on them after its JSON is out.
        let wrote = match dec {
            Decoder::Gzip(d) => d.write_all(bytes).and_then(|_| d.flush()).is_ok(),
            Decoder::Zstd(d) => d.write_all(bytes).and_then(|_| d.flush()).is_ok(),
        };
        let json = match dec {
            Decoder::Gzip(d) => &d.get_ref().0,
            Decoder::Zstd(d) => &d.get_ref().0,
        };
        let from = self.searched.saturating_sub(RESEARCH);
        self.searched = json.len();
        let found = prefetch_landmark(&json[from..]);
        if found.is_some() || !wrote {
            self.out = None;
        }
        found
    }
}

/// Given the JSON before the landmark's name ends (`… {"name":"` or `… {"name":"./`), where the
/// entry object opens.
fn entry_start(before: &[u8]) -> Option<usize> {
    let quote = before.strip_suffix(b"\"").or_else(|| before.strip_suffix(b"\"./"))?;
    let rest = trim_end(quote).strip_suffix(b":")?;
    let rest = trim_end(trim_end(rest).strip_suffix(b"\"name\"")?);
    rest.strip_suffix(b"{").map(|r| r.len())
}

fn trim_end(s: &[u8]) -> &[u8] {
    let n = s.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
    &s[..n]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries written as the writers write them, `"name"` first.
    fn program_toc() -> Vec<u8> {
        let d = super::super::sha256_digest(b"abcd");
        let entries = [
            r#"{"name":"usr/","type":"dir"}"#.to_owned(),
            r#"{"name":"usr/bin/","type":"dir"}"#.to_owned(),
            r#"{"name":"usr/bin/python3","type":"symlink","linkName":"python3.11"}"#.to_owned(),
            format!(
                r#"{{"name":"usr/bin/python3.11","type":"reg","size":12,"offset":100,"chunkSize":4,"chunkDigest":"{d}"}}"#
            ),
            format!(
                r#"{{"name":"usr/bin/python3.11","type":"chunk","offset":200,"chunkOffset":4,"chunkSize":4,"chunkDigest":"{d}"}}"#
            ),
            format!(
                r#"{{"name":"usr/bin/python3.11","type":"chunk","offset":300,"chunkOffset":8,"chunkSize":4,"chunkDigest":"{d}"}}"#
            ),
            r#"{"name":"usr/lib/","type":"dir"}"#.to_owned(),
            format!(r#"{{"name":"usr/lib/x","type":"reg","size":4,"offset":400,"chunkDigest":"{d}"}}"#),
            r#"{"name":"etc/","type":"dir"}"#.to_owned(),
            r#"{"name":"etc/alt","type":"symlink","linkName":"/usr/bin/../bin/python3"}"#.to_owned(),
            r#"{"name":"etc/out","type":"symlink","linkName":"../../x"}"#.to_owned(),
            r#"{"name":"etc/loop","type":"symlink","linkName":"loop"}"#.to_owned(),
            format!(r#"{{"name":"etc/shared","type":"reg","size":4,"offset":450,"chunkDigest":"{d}"}}"#),
            format!(
                r#"{{"name":"etc/shared2","type":"reg","size":4,"offset":450,"innerOffset":512,"chunkDigest":"{d}"}}"#
            ),
        ];
        format!("{{\"version\":1,\"entries\":[\n  {}\n]}}", entries.join(",\n  ")).into_bytes()
    }

    #[test]
    fn a_programs_chunks_are_placed_as_the_parse_places_them() {
        let json = program_toc();
        let toc = super::super::toc::parse_toc(&json, 500).unwrap();
        let parsed = |path: &str, n: usize| -> Vec<std::ops::Range<u64>> {
            let e = toc.entries.iter().find(|e| e.path == path).unwrap();
            e.chunks.iter().take(n).map(|c| c.offset..c.compressed_end).collect()
        };
        let all = file_chunks(&json, "/usr/bin/python3", 1 << 20, 500).unwrap();
        assert_eq!(all, [100..200, 200..300, 300..400]);
        assert_eq!(all, parsed("usr/bin/python3.11", 3));
        assert_eq!(
            file_chunks(&json, "usr/bin/python3.11", 8, 500).unwrap(),
            parsed("usr/bin/python3.11", 2),
            "only the chunks within the first 8 bytes"
        );
        assert_eq!(
            file_chunks(&json, "etc/alt", 1 << 20, 500).unwrap(),
            all,
            "an absolute link, `..` in it, then a relative one"
        );
        assert_eq!(file_chunks(&json, "usr/lib/x", 1 << 20, 500).unwrap(), parsed("usr/lib/x", 1));
        assert_eq!(
            file_chunks(&json, "etc/shared", 1 << 20, 500).unwrap(),
            parsed("etc/shared", 1),
            "its member, which holds the next file too"
        );
    }

    #[test]
    fn no_chunks_for_what_the_parse_must_place() {
        let json = program_toc();
        for (path, why) in [
            ("usr/bin/python2", "not in the layer"),
            ("usr/bin", "a directory"),
            ("etc/out", "a link out of the layer"),
            ("etc/loop", "a link to itself"),
            ("etc/shared2", "a file inside another's gzip member"),
            ("../usr/bin/python3", "a name out of the layer"),
        ] {
            assert_eq!(file_chunks(&json, path, 1 << 20, 500), None, "{why}");
        }
        // The parse refuses a TOC whose data would run past where the data ends; its hint
        // asks for none of it.
        assert!(super::super::toc::parse_toc(&json, 350).is_err());
        assert_eq!(file_chunks(&json, "usr/bin/python3.11", 1 << 20, 350), None, "a chunk past the data");
        assert_eq!(file_chunks(&json, "usr/lib/x", 1 << 20, 400), None, "a chunk at the data's end");
    }

    #[test]
    fn finds_the_root_landmark_in_either_layout() {
        let compact = br#"{"version":1,"entries":[{"name":"bin/","type":"dir"},{"name":"bin/sh","type":"reg","offset":114,"size":3},{"name":".prefetch.landmark","type":"reg","size":1,"offset":4265106},{"name":"etc/","type":"dir"}]}"#;
        assert_eq!(prefetch_landmark(compact), Some(4265106));
        let indented = b"{\n  \"entries\": [\n    {\n      \"name\": \"./.prefetch.landmark\",\n      \"type\": \"reg\",\n      \"offset\": 77\n    }\n  ]\n}";
        assert_eq!(prefetch_landmark(indented), Some(77));
    }

    #[test]
    fn ignores_what_is_not_the_root_landmark() {
        // A file of that name deeper in the tree, a link whose target has the name, the other
        // landmark, and a landmark at offset 0 (nothing before it).
        let json = br#"{"entries":[{"name":"a/.prefetch.landmark","type":"reg","offset":5},{"name":"l","type":"symlink","linkName":".prefetch.landmark"},{"name":".no.prefetch.landmark","type":"reg","offset":9}]}"#;
        assert_eq!(prefetch_landmark(json), None);
        assert_eq!(prefetch_landmark(br#"{"entries":[{"name":".prefetch.landmark","offset":0}]}"#), None);
        assert_eq!(prefetch_landmark(b""), None);
    }

    /// A TOC's JSON with the landmark after `before` entries, and `after` entries behind it.
    fn toc(before: usize, after: usize) -> Vec<u8> {
        let entry =
            |i: usize| format!(r#"{{"name":"usr/lib/file-{i}","type":"reg","offset":{},"size":100}},"#, i * 300);
        let mut json = String::from(r#"{"version":1,"entries":["#);
        (0..before).for_each(|i| json.push_str(&entry(i)));
        json.push_str(r#"{"name":".prefetch.landmark","type":"reg","size":1,"offset":999999},"#);
        (before..before + after).for_each(|i| json.push_str(&entry(i)));
        json.push_str(r#"{"name":"z","type":"dir"}]}"#);
        json.into_bytes()
    }

    fn gzip(b: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(b).unwrap();
        e.finish().unwrap()
    }

    fn scan(compression: Compression, member: &[u8], piece: usize) -> Option<(u64, usize)> {
        let mut scan = LandmarkScan::new(compression);
        crate::estargz::testblob::feed_in_pieces(member, piece, |p| scan.feed(p))
    }

    #[test]
    fn a_scan_finds_the_landmark_long_before_the_member_ends() {
        let json = toc(20, 20_000);
        for (compression, member) in
            [(Compression::Gzip, gzip(&json)), (Compression::Zstd, zstd::encode_all(&json[..], 19).unwrap())]
        {
            let (at, fed) = scan(compression, &member, 1000).expect("found");
            assert_eq!(at, 999_999);
            assert!(fed * 4 < member.len(), "{compression:?}: found after {fed} of {} bytes", member.len());
        }
        // A byte at a time: the landmark's entry is whole only some feeds after it began.
        assert_eq!(scan(Compression::Gzip, &gzip(&toc(20, 10)), 1).map(|f| f.0), Some(999_999));
    }

    #[test]
    fn a_scan_gives_up_on_no_landmark_garbage_and_a_landmark_past_its_limit() {
        let plain = br#"{"entries":[{"name":".no.prefetch.landmark","type":"reg","offset":9}]}"#;
        assert_eq!(scan(Compression::Gzip, &gzip(plain), 7), None);
        assert_eq!(scan(Compression::Gzip, b"not a gzip member at all", 4), None);
        assert_eq!(scan(Compression::Zstd, b"not a zstd frame at all", 4), None);
        // Past the limit it stops decompressing, even where the landmark would come later: the
        // output refuses what goes past it, however much one piece inflates to.
        assert_eq!(scan(Compression::Gzip, &gzip(&toc(20_000, 0)), 4096), None);
        assert_eq!(scan(Compression::Gzip, &gzip(&toc(20_000, 0)), 1 << 20), None);
        assert!(toc(20_000, 0).len() > SCAN_LIMIT);
        assert_eq!(scan(Compression::Gzip, &gzip(&toc(2_000, 0)), 4096).map(|f| f.0), Some(999_999));
    }
}
