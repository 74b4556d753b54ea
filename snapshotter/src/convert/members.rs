//! The output side of a seekable blob: a run of gzip members (eStargz) or zstd frames
//! (zstd:chunked) over one file. It tracks the compressed offset where each member starts (the
//! TOC's `offset`), and hashes both streams as they pass: the compressed one is the blob's
//! digest, the uncompressed one its DiffID.

use flate2::Compression;
use flate2::write::GzEncoder;
use sha2::{Digest, Sha256};
use std::io::{self, Write};

/// A writer that counts and hashes what goes through it.
pub struct Hashed<W> {
    inner: W,
    pub count: u64,
    hash: Sha256,
}

impl<W: Write> Hashed<W> {
    pub fn new(inner: W) -> Self {
        Hashed { inner, count: 0, hash: Sha256::new() }
    }

    /// `sha256:` of everything written, and the writer.
    pub fn finish(self) -> (String, W) {
        (format!("sha256:{}", hex::encode(self.hash.finalize())), self.inner)
    }
}

impl<W: Write> Write for Hashed<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// How members are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Gzip,
    Zstd,
}

enum Encoder<W: Write> {
    Gz(GzEncoder<Hashed<W>>),
    Zstd(zstd::stream::write::Encoder<'static, Hashed<W>>),
}

impl<W: Write> Encoder<W> {
    fn inner(&self) -> &Hashed<W> {
        match self {
            Encoder::Gz(e) => e.get_ref(),
            Encoder::Zstd(e) => e.get_ref(),
        }
    }

    fn finish(self) -> io::Result<Hashed<W>> {
        match self {
            Encoder::Gz(e) => e.finish(),
            Encoder::Zstd(e) => e.finish(),
        }
    }

    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Encoder::Gz(e) => e.write(buf),
            Encoder::Zstd(e) => e.write(buf),
        }
    }
}

/// Members written one after another. A member opens on the first write after `cut`, so no
/// empty member is ever written.
pub struct Members<W: Write> {
    open: Option<Encoder<W>>,
    closed: Option<Hashed<W>>,
    codec: Codec,
    level: u32,
    /// The uncompressed stream: its size and hash (the DiffID).
    pub raw: Hashed<io::Sink>,
}

impl<W: Write> Members<W> {
    pub fn new(out: W, codec: Codec, level: u32) -> Self {
        Members { open: None, closed: Some(Hashed::new(out)), codec, level, raw: Hashed::new(io::sink()) }
    }

    /// Ends the current member, if one is open. The next write starts a new one at `offset()`.
    pub fn cut(&mut self) -> io::Result<()> {
        if let Some(enc) = self.open.take() {
            self.closed = Some(enc.finish()?);
        }
        Ok(())
    }

    /// Where the next member would start: only meaningful right after `cut`.
    pub fn offset(&self) -> u64 {
        match (&self.closed, &self.open) {
            (Some(c), _) => c.count,
            (None, Some(e)) => e.inner().count,
            (None, None) => unreachable!("a Members is always open or closed"),
        }
    }

    /// Writes raw bytes after the last member, outside any: the footer.
    pub fn write_outside(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.cut()?;
        self.closed.as_mut().expect("cut leaves it closed").write_all(bytes)
    }

    /// Ends the last member; returns the blob's size and digest, and the writer.
    pub fn finish(mut self) -> io::Result<(u64, String, W)> {
        self.cut()?;
        let closed = self.closed.take().expect("cut leaves it closed");
        let size = closed.count;
        let (digest, mut out) = closed.finish();
        out.flush()?;
        Ok((size, digest, out))
    }
}

impl<W: Write> Write for Members<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.open.is_none() {
            let out = self.closed.take().expect("closed when not open");
            self.open = Some(match self.codec {
                Codec::Gzip => Encoder::Gz(GzEncoder::new(out, Compression::new(self.level))),
                Codec::Zstd => Encoder::Zstd(zstd::stream::write::Encoder::new(out, self.level as i32)?),
            });
        }
        let n = self.open.as_mut().expect("just opened").write(buf)?;
        self.raw.write_all(&buf[..n])?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn members_start_where_offset_says_and_decompress_as_one_stream() {
        let mut m = Members::new(Vec::new(), Codec::Gzip, 6);
        m.write_all(b"header ").unwrap();
        m.cut().unwrap();
        let second = m.offset();
        m.write_all(b"payload").unwrap();
        m.cut().unwrap();
        m.cut().unwrap(); // no empty member
        let (raw_size, diff_id) = (m.raw.count, m.raw.hash.clone().finalize());
        let (size, digest, blob) = m.finish().unwrap();
        assert_eq!(size, blob.len() as u64);
        assert_eq!(digest, crate::estargz::sha256_digest(&blob));
        let mut all = Vec::new();
        flate2::read::MultiGzDecoder::new(&blob[..]).read_to_end(&mut all).unwrap();
        assert_eq!(all, b"header payload");
        assert_eq!(raw_size, 14);
        assert_eq!(hex::encode(diff_id), hex::encode(Sha256::digest(b"header payload")));
        let mut tail = Vec::new();
        flate2::read::GzDecoder::new(&blob[second as usize..]).read_to_end(&mut tail).unwrap();
        assert_eq!(tail, b"payload");
    }

    #[test]
    fn zstd_frames_decompress_as_one_stream_and_each_on_its_own() {
        let mut m = Members::new(Vec::new(), Codec::Zstd, 3);
        m.write_all(b"header ").unwrap();
        m.cut().unwrap();
        let second = m.offset();
        m.write_all(b"payload").unwrap();
        let (_, _, blob) = m.finish().unwrap();
        assert_eq!(zstd::decode_all(&blob[..]).unwrap(), b"header payload");
        assert_eq!(zstd::decode_all(&blob[second as usize..]).unwrap(), b"payload");
    }
}
