//! The first bytes of a program's first chunk, decompressed as they arrive. A program's
//! headers and the names of its libraries are in its first hundred KiB, while its first chunk
//! is 4 MiB of code that takes the link a hundred milliseconds: the loader's files are asked
//! for from these bytes instead of after the whole chunk. They are not verified yet (the
//! chunk's digest covers all of it), so they only ever name what to fetch; what is served and
//! cached is the checked chunk, as always.

use std::io::Write;

/// Decompressed bytes looked at: past the headers and the dynamic string table of the
/// programs and libraries a start loads (python's table ends 107 KB in, glibc's 141 KB).
pub const PEEK: usize = 256 << 10;
/// Compressed bytes fed at once, so that a run of zeros cannot inflate far past [`PEEK`].
const STEP: usize = 256;

/// A gzip member's first [`PEEK`] decompressed bytes, gathered as its compressed bytes arrive.
#[derive(Debug)]
pub struct Peek {
    gz: flate2::write::GzDecoder<Vec<u8>>,
    failed: bool,
}

impl Peek {
    /// A peek at a chunk whose compressed bytes start with `first`, if it is gzip (a zstd
    /// chunk is decoded whole, as it comes, soon enough).
    pub fn new(first: &[u8]) -> Option<Peek> {
        first.starts_with(&[0x1f, 0x8b]).then(|| Peek { gz: flate2::write::GzDecoder::new(Vec::new()), failed: false })
    }

    /// Feeds the next compressed bytes. The first [`PEEK`] decompressed bytes once they are
    /// in, once; `None` before that, after it, or if the bytes do not decompress.
    pub fn feed(&mut self, data: &[u8]) -> Option<Vec<u8>> {
        if self.failed {
            return None;
        }
        for step in data.chunks(STEP) {
            if self.gz.write_all(step).is_err() {
                self.failed = true;
                return None;
            }
            if self.gz.get_ref().len() >= PEEK {
                return self.take();
            }
        }
        None
    }

    /// What came out, when the member ended before [`PEEK`] bytes: a file smaller than that.
    pub fn finish(mut self) -> Option<Vec<u8>> {
        if self.failed || self.gz.try_finish().is_err() {
            return None;
        }
        self.take()
    }

    fn take(&mut self) -> Option<Vec<u8>> {
        self.failed = true;
        let mut out = std::mem::take(self.gz.get_mut());
        out.truncate(PEEK);
        (!out.is_empty()).then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn the_first_bytes_come_out_before_the_member_ends() {
        let data: Vec<u8> = (0..2_000_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect();
        let gz = gzip(&data);
        let mut p = Peek::new(&gz).unwrap();
        let mut got = None;
        let mut fed = 0;
        for piece in gz.chunks(1000) {
            fed += piece.len();
            if let Some(out) = p.feed(piece) {
                got = Some(out);
                break;
            }
        }
        assert_eq!(got.unwrap(), data[..PEEK], "the decompressed start, exactly");
        assert!(fed < gz.len() / 2, "well before the member's end: {fed} of {}", gz.len());
        assert_eq!(p.feed(&gz[fed..]), None, "once only");
    }

    #[test]
    fn a_small_file_is_had_whole_at_its_end_and_zeros_do_not_inflate_it() {
        let gz = gzip(b"\x7fELF small");
        let mut p = Peek::new(&gz).unwrap();
        assert_eq!(p.feed(&gz), None);
        assert_eq!(p.finish().unwrap(), b"\x7fELF small");
        let zeros = gzip(&vec![0u8; 64 << 20]);
        let mut p = Peek::new(&zeros).unwrap();
        let out = p.feed(&zeros).unwrap();
        assert_eq!(out.len(), PEEK);
    }

    #[test]
    fn what_is_not_gzip_is_not_peeked_at() {
        assert!(Peek::new(&[0x28, 0xb5, 0x2f, 0xfd]).is_none(), "zstd");
        let mut p = Peek::new(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff, 0xde, 0xad]).unwrap();
        assert_eq!(p.feed(&[0xbe, 0xef, 0, 1, 2, 3]), None);
        assert_eq!(p.finish(), None, "bytes that do not decompress give nothing");
    }
}
