//! The output side of a seekable blob: a run of gzip members (eStargz) or zstd frames
//! (zstd:chunked). Each member is compressed on its own, so members are compressed on a pool
//! of threads and written in order; a member's compressed offset is known only once all before
//! it are compressed, so writers get a member number now and its offset at the end. The output
//! is the same whatever the number of threads. Both streams are hashed as they pass: the
//! compressed one is the blob's digest, the uncompressed one its DiffID.

use flate2::Compression;
use flate2::write::GzEncoder;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::{self, Write};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// A writer that counts and hashes what goes through it.
#[derive(Debug)]
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

fn compress(codec: Codec, level: u32, data: &[u8]) -> io::Result<Vec<u8>> {
    match codec {
        Codec::Gzip => {
            let mut e = GzEncoder::new(Vec::with_capacity(data.len() / 2 + 64), Compression::new(level));
            e.write_all(data)?;
            e.finish()
        }
        Codec::Zstd => zstd::encode_all(data, level as i32),
    }
}

type Job = (usize, Vec<u8>);
type Done = (usize, io::Result<Vec<u8>>);

struct Pool {
    jobs: Option<SyncSender<Job>>,
    done: Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    fn start(threads: usize, codec: Codec, level: u32) -> Pool {
        // Two members queued per thread: enough to keep them busy, few enough to bound memory.
        let (jobs, queue) = sync_channel::<Job>(threads * 2);
        let (finished, done) = std::sync::mpsc::channel::<Done>();
        let queue = std::sync::Arc::new(std::sync::Mutex::new(queue));
        let workers = (0..threads)
            .map(|_| {
                let (queue, finished) = (queue.clone(), finished.clone());
                std::thread::spawn(move || {
                    loop {
                        let next = queue.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok((id, data)) = next else { return };
                        if finished.send((id, compress(codec, level, &data))).is_err() {
                            return;
                        }
                    }
                })
            })
            .collect();
        Pool { jobs: Some(jobs), done, workers }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.jobs.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Members written one after another. A member opens on the first write after `cut`, so no
/// empty member is ever written.
pub struct Members<W: Write> {
    out: Hashed<W>,
    current: Vec<u8>,
    /// Number of the member being filled (members cut so far).
    next: usize,
    pool: Option<Pool>,
    in_flight: usize,
    /// Compressed members waiting for those before them.
    ready: BTreeMap<usize, Vec<u8>>,
    /// Where each member written so far starts.
    offsets: Vec<u64>,
    codec: Codec,
    level: u32,
    /// The uncompressed stream: its size and hash (the DiffID).
    pub raw: Hashed<io::Sink>,
}

impl<W: Write> Members<W> {
    /// Compresses on `threads` threads (1: on the caller's).
    pub fn new(out: W, codec: Codec, level: u32, threads: usize) -> Self {
        Members {
            out: Hashed::new(out),
            current: Vec::new(),
            next: 0,
            pool: (threads > 1).then(|| Pool::start(threads, codec, level)),
            in_flight: 0,
            ready: BTreeMap::new(),
            offsets: Vec::new(),
            codec,
            level,
            raw: Hashed::new(io::sink()),
        }
    }

    /// Ends the current member, if anything was written to it.
    pub fn cut(&mut self) -> io::Result<()> {
        if self.current.is_empty() {
            return Ok(());
        }
        let id = self.next;
        self.next += 1;
        let data = std::mem::take(&mut self.current);
        match self.pool.as_ref().and_then(|p| p.jobs.as_ref()) {
            Some(jobs) => {
                jobs.send((id, data)).map_err(|_| io::Error::other("the compression threads stopped"))?;
                self.in_flight += 1;
                self.collect(false)?;
            }
            None => {
                let c = compress(self.codec, self.level, &data)?;
                self.ready.insert(id, c);
                self.write_ready()?;
            }
        }
        Ok(())
    }

    /// The number of the member the next write goes into, once the current one is cut.
    pub fn member(&self) -> usize {
        self.next
    }

    /// Takes compressed members from the pool (all of them, if `all`) and writes those next
    /// in line.
    fn collect(&mut self, all: bool) -> io::Result<()> {
        while self.in_flight > 0 {
            let pool = self.pool.as_ref().expect("members in flight come from the pool");
            let got = if all {
                pool.done.recv().map_err(|_| io::Error::other("the compression threads stopped"))?
            } else {
                match pool.done.try_recv() {
                    Ok(d) => d,
                    Err(_) => break,
                }
            };
            self.in_flight -= 1;
            self.ready.insert(got.0, got.1?);
        }
        self.write_ready()
    }

    fn write_ready(&mut self) -> io::Result<()> {
        while let Some(bytes) = self.ready.remove(&self.offsets.len()) {
            self.offsets.push(self.out.count);
            self.out.write_all(&bytes)?;
        }
        Ok(())
    }

    /// Cuts the current member and waits until every member is written; returns where each
    /// starts, by member number. Later members are compressed on the caller's thread.
    pub fn settle(&mut self) -> io::Result<Vec<u64>> {
        self.cut()?;
        self.collect(true)?;
        self.pool = None;
        debug_assert_eq!(self.offsets.len(), self.next);
        Ok(self.offsets.clone())
    }

    /// Where the next byte of output goes: meaningful after `settle`.
    pub fn position(&self) -> u64 {
        self.out.count
    }

    /// Writes raw bytes after the last member, outside any: the footer.
    pub fn write_outside(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.settle()?;
        self.out.write_all(bytes)
    }

    /// Ends the last member; returns the blob's size and digest, and the writer.
    pub fn finish(mut self) -> io::Result<(u64, String, W)> {
        self.settle()?;
        let Members { out, .. } = self;
        let size = out.count;
        let (digest, mut out) = out.finish();
        out.flush()?;
        Ok((size, digest, out))
    }
}

impl<W: Write> Write for Members<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.current.extend_from_slice(buf);
        self.raw.write_all(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn sample(codec: Codec, threads: usize) -> (Vec<u64>, u64, String, Vec<u8>) {
        let mut m = Members::new(Vec::new(), codec, 6, threads);
        m.write_all(b"header ").unwrap();
        m.cut().unwrap();
        assert_eq!(m.member(), 1);
        for i in 0..20u8 {
            m.write_all(&vec![i; 10_000 + i as usize]).unwrap();
            m.cut().unwrap();
            m.cut().unwrap(); // no empty member
        }
        let offsets = m.settle().unwrap();
        let raw = m.raw.count;
        let (size, digest, blob) = m.finish().unwrap();
        assert_eq!((size, digest.clone()), (blob.len() as u64, crate::estargz::sha256_digest(&blob)));
        (offsets, raw, digest, blob)
    }

    #[test]
    fn members_start_where_settle_says_and_decompress_as_one_stream() {
        let (offsets, raw, _, blob) = sample(Codec::Gzip, 1);
        assert_eq!(offsets.len(), 21);
        let mut all = Vec::new();
        flate2::read::MultiGzDecoder::new(&blob[..]).read_to_end(&mut all).unwrap();
        assert_eq!((all.len() as u64, &all[..7]), (raw, &b"header "[..]));
        let mut third = Vec::new();
        flate2::read::GzDecoder::new(&blob[offsets[2] as usize..]).read_to_end(&mut third).unwrap();
        assert_eq!(third, vec![1u8; 10_001]);
        let zstd = sample(Codec::Zstd, 1);
        assert_eq!(zstd::decode_all(&zstd.3[zstd.0[5] as usize..]).unwrap()[..3], [4u8; 3]);
    }

    #[test]
    fn the_blob_is_the_same_on_any_number_of_threads() {
        for codec in [Codec::Gzip, Codec::Zstd] {
            let one = sample(codec, 1);
            for threads in [2, 3, 8] {
                assert_eq!(sample(codec, threads), one, "{codec:?} on {threads} threads");
            }
        }
    }
}
