//! The prefetch landmark found in a blob's tail while the tail arrives, before the footer at
//! its very end says where the TOC starts. A first read of a blob's last bytes that holds the
//! TOC's start then names where the start-up files end as soon as the TOC's first entries are
//! in, a round trip earlier than a second read of the TOC on its own would.
//!
//! Gzip layers only: their TOC is a gzip member whose tar entry is `stargz.index.json`, and each
//! gzip member start in the tail is tried for that. Like [`super::hint`], the offset is a hint:
//! nothing here is verified, and a caller drops what it fetched on a hint the TOC's parse does
//! not confirm.

use super::Compression;
use super::hint::LandmarkScan;
use super::toc::TOC_NAME;
use std::io::Read;

const GZIP_MAGIC: &[u8] = &[0x1f, 0x8b, 0x08];
/// A tar header block: what a member start must inflate to before it is judged.
const BLOCK: usize = 512;
/// Compressed bytes after a member start past which a header block that has not come out means
/// the start is not a member's: a TOC's header block inflates from a few hundred.
const PROBE: usize = 4096;
/// Member starts tried at most. A real tail holds one per chunk in it; bytes crafted to be all
/// gzip magic cannot make a scan inflate without end.
const MAX_TRIES: usize = 4096;

/// Fed a blob's tail piece by piece, in order; see the module's documentation.
pub struct TailScan {
    /// The tail so far, until the TOC member is found in it.
    held: Vec<u8>,
    /// Where the next member start is looked for in `held`.
    next: usize,
    tries: usize,
    toc: Option<LandmarkScan>,
    done: bool,
}

impl std::fmt::Debug for TailScan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TailScan").field("held", &self.held.len()).field("in_toc", &self.toc.is_some()).finish()
    }
}

/// What the bytes after a member start say about it.
enum Probe {
    Toc,
    NotToc,
    NeedMore,
}

impl Default for TailScan {
    fn default() -> Self {
        TailScan::new()
    }
}

impl TailScan {
    pub fn new() -> TailScan {
        TailScan { held: Vec::new(), next: 0, tries: 0, toc: None, done: false }
    }

    /// Takes the tail's next bytes; the landmark's offset once it is found, and `None` ever
    /// after, as for a tail without a TOC start or a landmark in it.
    pub fn feed(&mut self, piece: &[u8]) -> Option<u64> {
        if self.done {
            return None;
        }
        if let Some(scan) = self.toc.as_mut() {
            let found = scan.feed(piece);
            return self.finish_if(found);
        }
        self.held.extend_from_slice(piece);
        while let Some(at) = memchr::memmem::find(&self.held[self.next..], GZIP_MAGIC).map(|i| self.next + i) {
            // A header's name and extra fields run until they end: at most PROBE bytes are
            // given, so a start is never tried against the whole tail.
            match probe(&self.held[at..(at + PROBE).min(self.held.len())]) {
                Probe::NeedMore => {
                    self.next = at;
                    return None;
                }
                Probe::NotToc => {
                    self.next = at + 1;
                    self.tries += 1;
                    if self.tries >= MAX_TRIES {
                        self.done = true;
                        self.held = Vec::new();
                        return None;
                    }
                }
                Probe::Toc => {
                    let mut scan = LandmarkScan::new(Compression::Gzip);
                    let found = scan.feed(&self.held[at..]);
                    self.toc = Some(scan);
                    self.held = Vec::new();
                    return self.finish_if(found);
                }
            }
        }
        // A magic cut off at the end is looked for again with the next piece.
        self.next = self.held.len().saturating_sub(GZIP_MAGIC.len() - 1).max(self.next);
        None
    }

    fn finish_if(&mut self, found: Option<u64>) -> Option<u64> {
        if found.is_some() {
            self.done = true;
            self.toc = None;
        }
        found
    }
}

/// Whether `from` (starting with the gzip magic, at most [`PROBE`] bytes) starts the TOC's
/// member: its first tar header block names `stargz.index.json`.
fn probe(from: &[u8]) -> Probe {
    let mut block = [0u8; BLOCK];
    // Read straight from the slice: a buffered reader would copy up to 32 KiB per start tried.
    let mut dec = flate2::bufread::GzDecoder::new(from);
    let mut got = 0;
    while got < BLOCK {
        match dec.read(&mut block[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    if got == BLOCK {
        let name = &block[..100];
        let end = name.iter().position(|b| *b == 0).unwrap_or(name.len());
        return if &name[..end] == TOC_NAME.as_bytes() { Probe::Toc } else { Probe::NotToc };
    }
    // A member that ended, or bytes that do not inflate, leave input unread; bytes that ran out
    // leave none, and more may make the block whole.
    if dec.get_ref().is_empty() && from.len() < PROBE { Probe::NeedMore } else { Probe::NotToc }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estargz::testblob;

    fn scan(tail: &[u8], piece: usize) -> Option<(u64, usize)> {
        let mut scan = TailScan::new();
        testblob::feed_in_pieces(tail, piece, |p| scan.feed(p))
    }

    fn landmark_at(offset: u64) -> serde_json::Value {
        serde_json::json!({"name": ".prefetch.landmark", "type": "reg", "size": 1, "offset": offset})
    }

    /// A blob with many small files, so its tail holds many member starts before the TOC's.
    fn blob(extra: &[serde_json::Value]) -> testblob::Built {
        let contents: Vec<(String, Vec<u8>)> =
            (0..300).map(|i| (format!("usr/lib/f{i}"), format!("file {i} ").repeat(40).into_bytes())).collect();
        let files: Vec<(&str, &[u8], usize)> = contents.iter().map(|(n, c)| (n.as_str(), &c[..], 64)).collect();
        testblob::build(&files, extra)
    }

    #[test]
    fn the_landmark_is_found_once_the_tocs_start_is_in_before_the_footer() {
        let built = blob(&[landmark_at(4242)]);
        let from = built.toc_offset as usize - 20_000;
        let tail = &built.blob[from..];
        assert_eq!(scan(tail, tail.len()).map(|f| f.0), Some(4242));
        for piece in [1, 7, 1000] {
            let (at, fed) = scan(tail, piece).expect("found");
            assert_eq!(at, 4242);
            // Well before the footer, and before the TOC member has all come in.
            assert!(fed < tail.len() - 51, "piece {piece}: found after {fed} of {}", tail.len());
        }
        // The TOC's start alone is enough, in pieces as small as the network's.
        let toc_start = built.toc_offset as usize - from;
        let fed = scan(tail, 100).unwrap().1;
        assert!(fed < toc_start + 2000, "found after {fed}, the TOC starting at {toc_start} of {}", tail.len());
    }

    #[test]
    fn nothing_is_found_without_the_tocs_start_or_a_landmark() {
        let built = blob(&[landmark_at(4242)]);
        // A tail that starts inside the TOC member.
        assert_eq!(scan(&built.blob[built.toc_offset as usize + 10..], 100), None);
        // A TOC whose landmark is `.no.prefetch.landmark`, or none at all.
        let plain =
            blob(&[serde_json::json!({"name": ".no.prefetch.landmark", "type": "reg", "size": 1, "offset": 0})]);
        assert_eq!(scan(&plain.blob, 512), None);
        assert_eq!(scan(&blob(&[]).blob, 512), None);
        // Bytes that are all gzip magic: tried a bounded number of times, then given up on.
        let junk = GZIP_MAGIC.repeat(200_000);
        assert_eq!(scan(&junk, 65536), None);
    }

    #[test]
    fn a_member_of_another_file_is_not_taken_for_the_toc() {
        // A file member whose content looks like a TOC with a landmark, but whose tar name is
        // another, comes before the real TOC: the real TOC's landmark is the one found.
        let mut tar = testblob::tar_header("etc/fake.json", 60);
        tar.extend_from_slice(br#"{"entries":[{"name":".prefetch.landmark","offset":7}]}"#);
        let mut fake = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut fake, &tar).unwrap();
        let built = blob(&[landmark_at(9999)]);
        let mut tail = fake.finish().unwrap();
        tail.extend_from_slice(&built.blob[built.toc_offset as usize - 5000..]);
        assert_eq!(scan(&tail, 333).map(|f| f.0), Some(9999));
    }
}
