//! Where a TOC's prefetch landmark points, found without parsing the whole TOC. A layer whose
//! start-up files come first ends them with `.prefetch.landmark`; the bytes before it are what
//! a container waits for. Knowing that offset a few milliseconds after the TOC arrives, rather
//! than after the tens of milliseconds a large TOC takes to parse, lets the request for those
//! bytes go out while the parse runs. It is a hint: [`super::toc::parse_toc`] has the last word,
//! and a caller must drop what it fetched on a hint the parse does not confirm.

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
