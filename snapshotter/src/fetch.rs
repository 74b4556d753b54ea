//! Fetching a lazy layer's chunks for the reads containers wait on: the compressed range, then
//! decompression and the digest check, so only verified bytes are returned or cached. Reads that
//! walk the blob forwards also bring the chunks after them (`readaround`).

use crate::estargz::{self, Chunk};
use crate::layer::{Blob, FileData, Tree};
use crate::peek::{PEEK, Peek};
use crate::readaround::{self, MAX_WINDOW};
use bytes::Bytes;
use futures::future::BoxFuture;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use strata_tiering::key::Identity;
use strata_tiering::{ChunkKey, FetchError, Fetcher};

type Pieces = Arc<Vec<(String, Chunk)>>;

/// A range being fetched, recorded until it is done (fetched and its extra chunks cached, or
/// failed), so that reads of chunks inside it wait rather than fetch them again.
pub(crate) struct InFlight {
    blob: Arc<Blob>,
    range: std::ops::Range<u64>,
    done: tokio::sync::watch::Sender<bool>,
}

impl InFlight {
    pub(crate) fn begin(blob: &Arc<Blob>, range: std::ops::Range<u64>, ahead: bool) -> Option<InFlight> {
        let mut walk = blob.walk.lock().unwrap_or_else(|p| p.into_inner());
        InFlight::begin_in(blob, &mut walk, range, ahead)
    }

    /// As [`InFlight::begin`], under the walk's lock already held: what was chosen under it
    /// is recorded before another read can choose the same chunks.
    fn begin_in(
        blob: &Arc<Blob>,
        walk: &mut readaround::Walk,
        range: std::ops::Range<u64>,
        ahead: bool,
    ) -> Option<InFlight> {
        let done = walk.begin(range.clone(), ahead)?;
        Some(InFlight { blob: blob.clone(), range, done })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.blob.walk.lock().unwrap_or_else(|p| p.into_inner()).end(&self.range);
        let _ = self.done.send(true);
    }
}

struct DemandGuard(Arc<Blob>);

impl Drop for DemandGuard {
    fn drop(&mut self) {
        self.0.demand.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Fetches the chunks of one file: the compressed range, then decompression and the digest
/// check. Only verified bytes are returned, so only verified bytes are ever cached.
pub(crate) struct LayerFetcher {
    pub(crate) blob: Arc<Blob>,
    pub(crate) file: Option<Arc<FileData>>,
    /// The layer's tree: its chunks in blob order, and its files for the loader's names.
    pub(crate) tree: Arc<Tree>,
    /// Fetching ahead of a starting program's loader, not for a reader: the chunk alone,
    /// leaving the readers' walk as it is.
    pub(crate) ahead: bool,
}

#[derive(Debug, thiserror::Error)]
enum ChunkFetchError {
    #[error("no chunk {0} in this file of the layer")]
    Unknown(String),
    #[error(transparent)]
    Registry(#[from] crate::registry::RegistryError),
    #[error(transparent)]
    Format(#[from] estargz::FormatError),
}

impl Fetcher for LayerFetcher {
    fn fetch(&self, key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let digest = match &key.identity {
            Identity::Digest { digest } => digest.clone(),
            other => format!("{other:?}"),
        };
        let blob = self.blob.clone();
        // A scan, not an index: files have few chunks (a 10 GiB one has 2,560 of 4 MiB), and an
        // index per file cost a map for each of a layer's thousands of files on its pull's path.
        let chunk = self
            .file
            .as_ref()
            .and_then(|f| f.chunks.iter().find(|c| c.digest == digest).map(|c| (f.path.clone(), c.clone())));
        let tree = self.tree.clone();
        let pieces = tree.pieces.clone();
        let ahead = self.ahead;
        let key = key.clone();
        Box::pin(async move {
            let (path, chunk) = chunk.ok_or_else(|| Arc::new(ChunkFetchError::Unknown(digest)) as FetchError)?;
            // Counted while it runs, so background fill stands aside.
            blob.demand.fetch_add(1, Ordering::Relaxed);
            let _demand = DemandGuard(blob.clone());
            let _busy = blob.activity.read();
            // Nothing is fetched on demand beside the layer's prefetch region: the read waits
            // for it, and then most likely finds its chunk cached.
            if let Some(gate) = blob.region.get()
                && gate.pass(&blob.digest).await
                && let Some(bytes) = local(&blob, &key).await
            {
                return Ok(bytes);
            }
            // Another read may start fetching this chunk between the wait and the choice of
            // a range; the choice then says so, and this read waits for that fetch instead. A
            // range may also have cached it and ended since the cache missed it: the choice says
            // that too, and it is read from the cache. A chunk that fetch cached but that cannot
            // be read back is fetched here after all.
            let mut waits = 0;
            let Around { extra, window, end, in_flight } = loop {
                if let Some(bytes) = from_in_flight(&blob, &pieces, &key, chunk.offset).await {
                    return Ok(bytes);
                }
                if waits > 0
                    && let Some(bytes) = local(&blob, &key).await
                {
                    return Ok(bytes);
                }
                waits += 1;
                let around = if ahead {
                    just_this(&blob, &path, &chunk, waits > 3)
                } else {
                    read_around(&blob, &pieces, &path, &chunk, waits > 3)
                };
                if let Some(around) = around {
                    if waits > 3 {
                        tracing::debug!(layer = %blob.digest, chunk = %key, "fetching a chunk again: the fetch it waited on did not leave it cached");
                    }
                    break around;
                }
            };
            let registry_err = |e| Arc::new(ChunkFetchError::from(e)) as FetchError;
            // A request made for this range before the TOC was parsed is taken, whoever
            // fetches the chunk first (the program's fetch ahead, or its loader's follower).
            let asked = match blob.take_early(&(chunk.offset..end)) {
                Some(early) => early.answer(&blob.digest).await,
                None => None,
            };
            let mut stream = match asked {
                Some(stream) => {
                    blob.rejects.early_chunks.inc();
                    stream
                }
                None => {
                    tracing::debug!(layer = %blob.digest, path, offset = chunk.offset, end, window, extra = extra.len(), "a read fetches a range");
                    blob.range_stream(chunk.offset..end).await.map_err(registry_err)?
                }
            };
            // The reader's own chunk comes first in the range: it returns as soon as that is
            // in, not when the whole window is.
            let own = (chunk.compressed_end - chunk.offset) as usize;
            // A program being started is read here and there, not walked through: an ELF file
            // met on a walk (`find | xargs cat`) is being read, not run.
            let first = chunk.file_offset == 0 && window == 0;
            let mut peek = None;
            let mut peeked = false;
            let mut buf = bytes::BytesMut::new();
            while buf.len() < own {
                let Some(data) = stream.next().await.map_err(registry_err)? else { break };
                blob.fetched.fetch_add(data.len() as u64, Ordering::Relaxed);
                let before = buf.len();
                buf.extend_from_slice(&data);
                // A chunk that comes in one go is looked at whole, checked, once it is in.
                if first && chunk.inner_offset == 0 && own > PEEK && !peeked {
                    if before == 0 {
                        peek = Peek::new(&buf);
                    }
                    let mine = &buf[before..own.min(buf.len())];
                    if let Some(head) = peek.as_mut().and_then(|p| p.feed(mine)) {
                        peeked = follow_early(&blob, &tree, &path, head, ahead);
                        peek = None;
                    }
                }
            }
            if let Some(head) = peek.and_then(Peek::finish) {
                peeked = follow_early(&blob, &tree, &path, head, ahead);
            }
            let compressed = buf.split_to(own.min(buf.len())).freeze();
            // The chunks read around are cached as they arrive, while this read returns; the
            // range stays in flight until they all are, so the reader's next files wait for
            // their own chunk there instead of fetching it again and breaking the walk.
            if extra.is_empty() {
                // The end of the body, read so that the connection goes back to the pool: a
                // new one costs a handshake on the links lazy pulls are for.
                let _ = stream.next().await;
            } else if let Some(cache) = blob.cache.get().cloned() {
                let (blob, from) = (blob.clone(), chunk.compressed_end);
                tokio::spawn(async move {
                    if let Err(e) = cache_stream(&blob, &cache, stream, from, buf, extra, || {}).await {
                        tracing::debug!(layer = %blob.digest, error = %e, "the chunks read around a read were not all cached");
                    }
                    drop(in_flight);
                });
            }
            if window >= MAX_WINDOW {
                read_ahead(&blob, &pieces, end);
            }
            let name = path.clone();
            let decode = |compressed: Bytes| {
                let (path, chunk) = (path.clone(), chunk.clone());
                async move {
                    tokio::task::spawn_blocking(move || estargz::decode_chunk(&path, &chunk, &compressed))
                        .await
                        .map_err(|e| Arc::new(std::io::Error::other(e.to_string())) as FetchError)
                }
            };
            let mut decoded = decode(compressed).await?;
            if let (Err(e), Some(peers)) = (&decoded, &blob.peers) {
                // The segments under it came from the peer tier (or this node's copy of them):
                // they are dropped, and the chunk is fetched from the registry itself.
                blob.rejects.layer_chunk_rejects.inc();
                tracing::warn!(layer = %blob.digest, error = %e, "a chunk from the peer tier failed verification; fetching it from the registry");
                let range = chunk.offset..chunk.compressed_end;
                peers.forget(&blob.image, &blob.digest, range.clone()).await;
                let direct = blob.registry.blob_range(&blob.image, &blob.digest, range).await.map_err(registry_err)?;
                decoded = decode(direct).await?;
            }
            let bytes = decoded.map_err(|e| {
                // Flipped or foreign bytes: the read fails, nothing is cached, and it shows.
                blob.rejects.layer_chunk_rejects.inc();
                tracing::error!(layer = %blob.digest, error = %e, "a chunk from the registry failed verification");
                Arc::new(ChunkFetchError::from(e)) as FetchError
            })?;
            let bytes = Bytes::from(bytes);
            if first && !peeked && crate::elf::is_elf(&bytes) {
                crate::loader::follow(&blob, &tree, &name, bytes.clone(), ahead);
            }
            Ok(bytes)
        })
    }
}

/// Follows an ELF file from the first bytes of its first chunk ([`Peek`]): `false` if they are
/// not an ELF file's, to be looked at again once the chunk is checked. `ahead`: the file is
/// being fetched ahead for a starting program, as its loader's.
fn follow_early(blob: &Arc<Blob>, tree: &Arc<Tree>, path: &str, head: Vec<u8>, ahead: bool) -> bool {
    let elf = crate::elf::is_elf(&head);
    if elf {
        crate::loader::follow(blob, tree, path, Bytes::from(head), ahead);
    }
    elf
}

/// What a demand read fetches: its chunk, and the chunks after it (`extra`) to `end`, recorded
/// in flight; `window` is the walk's window.
struct Around {
    extra: Vec<(String, Chunk)>,
    window: u64,
    end: u64,
    in_flight: Option<InFlight>,
}

/// The chunks to fetch along with `chunk` of `path` if demand reads are walking the blob, and
/// the walk's window, recorded in flight before the walk's lock is let go. Only other files'
/// chunks: cachefs reads ahead within a file itself, and its reads of the file's next chunks
/// may be on their way already. `None` if a fetch in flight covers `chunk` or it is cached by
/// now, unless `anyway`.
fn read_around(blob: &Arc<Blob>, pieces: &Pieces, path: &str, chunk: &Chunk, anyway: bool) -> Option<Around> {
    let mut walk = blob.walk.lock().unwrap_or_else(|p| p.into_inner());
    let Some(cache) = blob.cache.get() else { return Some(alone(blob, &mut walk, chunk)) };
    if !anyway && taken(&walk, blob, path, chunk) {
        return None;
    }
    let from = walk.frontier();
    if readaround::skipped_only(pieces, from, chunk.offset, |p| {
        cached(cache, p) || walk.overlaps(&(p.1.offset..p.1.compressed_end))
    }) {
        walk.reached(chunk.offset);
    }
    let window = walk.read(chunk.offset, chunk.compressed_end);
    if window == 0 {
        return Some(alone(blob, &mut walk, chunk));
    }
    let limit = chunk.compressed_end + window;
    let extra = readaround::following(pieces, chunk.compressed_end, limit, |p| {
        p.0 == path || cached(cache, p) || walk.overlaps(&(p.1.offset..p.1.compressed_end))
    })
    .to_vec();
    let end = extra.last().map_or(chunk.compressed_end, |(_, c)| c.compressed_end);
    walk.reached(end);
    let in_flight = InFlight::begin_in(blob, &mut walk, chunk.offset..end, false);
    Some(Around { extra, window, end, in_flight })
}

/// `chunk` alone, recorded in flight; `None` if a fetch in flight covers it or it is cached by
/// now, unless `anyway`. Checked and recorded under one hold of the walk's lock, so a range read
/// around a reader and this fetch never both take the chunk.
fn just_this(blob: &Arc<Blob>, path: &str, chunk: &Chunk, anyway: bool) -> Option<Around> {
    let mut walk = blob.walk.lock().unwrap_or_else(|p| p.into_inner());
    if !anyway && taken(&walk, blob, path, chunk) {
        return None;
    }
    Some(alone(blob, &mut walk, chunk))
}

/// Whether a fetch in flight covers `chunk` of `path`, or it is cached. Asked under the walk's
/// lock, the second is final for a chunk no fetch covers: a range caches its chunks before it
/// is let go.
fn taken(walk: &readaround::Walk, blob: &Blob, path: &str, chunk: &Chunk) -> bool {
    walk.in_flight_over(chunk.offset).is_some() || blob.cache.get().is_some_and(|cache| is_cached(cache, path, chunk))
}

/// `chunk` by itself, recorded in flight under the walk's lock.
fn alone(blob: &Arc<Blob>, walk: &mut readaround::Walk, chunk: &Chunk) -> Around {
    let in_flight = InFlight::begin_in(blob, walk, chunk.offset..chunk.compressed_end, false);
    Around { extra: Vec::new(), window: 0, end: chunk.compressed_end, in_flight }
}

/// Whether chunk `c` of `path` is in a local tier.
fn is_cached(cache: &strata_tiering::TieredCache, path: &str, c: &Chunk) -> bool {
    cache.location(&ChunkKey::digest(path, c.digest.clone())).is_some()
}

/// The chunk `key` from a local tier, if it is there.
async fn local(blob: &Arc<Blob>, key: &ChunkKey) -> Option<Bytes> {
    let cache = blob.cache.get()?.clone();
    cache.location(key)?;
    read_local(cache, key).await
}

/// Reads the chunk `key` from a local tier, off the runtime's threads.
async fn read_local(cache: strata_tiering::TieredCache, key: &ChunkKey) -> Option<Bytes> {
    let key = key.clone();
    tokio::task::spawn_blocking(move || cache.get_local_blocking(&key)).await.ok().flatten()
}

/// Whether chunk `c` of `path` needs no fetch of its own: it is in a local tier, or a read's
/// fetch through the cache has it, whose bytes go into a tier once the read has them. A read
/// ahead that took such a chunk between the two would fetch it a second time.
fn cached(cache: &strata_tiering::TieredCache, (path, c): &(String, Chunk)) -> bool {
    is_cached(cache, path, c) || cache.fetching(&ChunkKey::digest(path, c.digest.clone()))
}

/// Reads the next window after `from` in the background, unless enough are in flight. Each
/// window, once downloaded, starts the next: a walk that has gone on this long is a container
/// reading the layer through, and it goes on until the layer ends or the walk is overtaken.
fn read_ahead(blob: &Arc<Blob>, pieces: &Pieces, from: u64) {
    let Some(cache) = blob.cache.get() else { return };
    // Past what earlier windows cover, whoever asks; recorded in flight under the same lock, so
    // two reads ahead never choose the same chunks.
    let (extra, range, in_flight) = {
        let mut walk = blob.walk.lock().unwrap_or_else(|p| p.into_inner());
        let from = from.max(walk.frontier());
        let extra = readaround::following(pieces, from, from + MAX_WINDOW, |p| {
            cached(cache, p) || walk.overlaps(&(p.1.offset..p.1.compressed_end))
        })
        .to_vec();
        let (Some(first), Some(last)) = (extra.first(), extra.last()) else { return };
        let range = first.1.offset..last.1.compressed_end;
        let Some(in_flight) = InFlight::begin_in(blob, &mut walk, range.clone(), true) else { return };
        (extra, range, in_flight)
    };
    let blob = blob.clone();
    let pieces = pieces.clone();
    let cache = cache.clone();
    tracing::debug!(layer = %blob.digest, start = range.start, end = range.end, chunks = extra.len(), "reading ahead");
    tokio::spawn(async move {
        // The link goes on with the next window while the end of this one is decoded.
        let next = || read_ahead(&blob, &pieces, range.end);
        let ok = match stream_and_cache(&blob, &cache, range.clone(), extra, next).await {
            Ok(()) => true,
            // The reads that wanted these chunks fetch them themselves; no retry here, so a
            // registry that is gone is not asked again and again.
            Err(e) => {
                tracing::debug!(layer = %blob.digest, error = %e, "read ahead failed");
                false
            }
        };
        drop(in_flight);
        if ok {
            read_ahead(&blob, &pieces, range.end);
        }
    });
}

/// If a fetch in flight covers `offset`, waits until the chunk is cached or the fetch is over
/// (and after a read ahead, starts the next one), and returns the chunk from the cache if it
/// is there now.
async fn from_in_flight(blob: &Arc<Blob>, pieces: &Pieces, key: &ChunkKey, offset: u64) -> Option<Bytes> {
    let (range, ahead, mut done) = blob.walk.lock().unwrap_or_else(|p| p.into_inner()).in_flight_over(offset)?;
    let cache = blob.cache.get()?.clone();
    let mut cached = blob.cached.subscribe();
    while cache.location(key).is_none() && !*done.borrow_and_update() {
        tokio::select! {
            _ = done.changed() => {}
            _ = cached.changed() => {}
        }
    }
    if ahead {
        read_ahead(blob, pieces, range.end);
    }
    read_local(cache, key).await
}

/// Why a range's chunks were not all cached.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Registry(#[from] crate::registry::RegistryError),
    #[error(transparent)]
    Format(#[from] estargz::FormatError),
    #[error("decoding a range: {0}")]
    Task(String),
}

/// Fetches `range` of the blob and caches `pieces` (in blob order, each inside the range) as
/// their bytes arrive: each is decoded, checked and cached once its last byte is in, while the
/// rest of the range is still on the wire. `downloaded` runs once the last byte has come.
pub(crate) async fn stream_and_cache(
    blob: &Arc<Blob>,
    cache: &strata_tiering::TieredCache,
    range: std::ops::Range<u64>,
    pieces: Vec<(String, Chunk)>,
    downloaded: impl FnOnce(),
) -> Result<(), StreamError> {
    let stream = blob.range_stream(range.clone()).await?;
    cache_stream(blob, cache, stream, range.start, bytes::BytesMut::new(), pieces, downloaded).await
}

/// Hand-offs queued for the decoding thread at most: what bounds the memory of a range, however
/// large, when the link is faster than decoding.
const HANDOFFS_QUEUED: usize = 4;

/// Reads the rest of `stream`, whose bytes from blob offset `start` on begin with `buf`, and
/// hands each run of complete pieces to one blocking thread that decodes, checks and caches
/// them in order.
pub(crate) async fn cache_stream(
    blob: &Arc<Blob>,
    cache: &strata_tiering::TieredCache,
    mut stream: crate::registry::range_stream::RangeStream,
    mut start: u64,
    mut buf: bytes::BytesMut,
    pieces: Vec<(String, Chunk)>,
    downloaded: impl FnOnce(),
) -> Result<(), StreamError> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(u64, Bytes, Vec<(String, Chunk)>)>(HANDOFFS_QUEUED);
    let (b, c) = (blob.clone(), cache.clone());
    let decoder = tokio::task::spawn_blocking(move || {
        let mut first_error = None;
        while let Some((start, bytes, ready)) = rx.blocking_recv() {
            if let Err(e) = decode_and_cache(&b, &c, start, &bytes, &ready) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    });
    let mut pending = pieces.into_iter().peekable();
    let received: Result<(), StreamError> = async {
        let mut more = true;
        while more {
            match stream.next().await? {
                Some(data) => {
                    blob.fetched.fetch_add(data.len() as u64, Ordering::Relaxed);
                    buf.extend_from_slice(&data);
                }
                None => more = false,
            }
            let have = start + buf.len() as u64;
            // A piece whose bytes are behind us (overlapping an earlier one) is left to the
            // reads that want it.
            while pending.next_if(|(_, c)| c.offset < start).is_some() {}
            let mut ready = Vec::new();
            while let Some(piece) = pending.next_if(|(_, c)| c.compressed_end <= have) {
                ready.push(piece);
            }
            let Some(cut) = ready.last().map(|(_, c)| (c.compressed_end - start) as usize) else { continue };
            let bytes = buf.split_to(cut).freeze();
            if tx.send((start, bytes, ready)).await.is_err() {
                break; // the decoder stopped; its error says why
            }
            start += cut as u64;
        }
        Ok(())
    }
    .await;
    if received.is_ok() {
        downloaded();
    }
    drop(tx);
    let decoded = decoder.await.map_err(|e| StreamError::Task(e.to_string()))?;
    received?;
    Ok(decoded?)
}

/// Decodes each piece from `all` (compressed bytes from blob offset `start`), checks it against
/// its digest, and stores it in the hot tier, telling waiting readers after each one. A piece
/// that fails its check is counted, logged and left out; the first such failure is returned
/// once the others are in. Runs on a blocking thread: decoding and storing are CPU and disk
/// work, and one thread per range keeps a range's pieces in order for the reader walking it.
fn decode_and_cache(
    blob: &Blob,
    cache: &strata_tiering::TieredCache,
    start: u64,
    all: &[u8],
    pieces: &[(String, Chunk)],
) -> Result<(), estargz::FormatError> {
    let mut first_error = None;
    for (path, c) in pieces {
        let slice = &all[(c.offset - start) as usize..(c.compressed_end - start) as usize];
        match estargz::decode_chunk(path, c, slice) {
            Ok(data) => {
                let key = ChunkKey::digest(path.clone(), c.digest.clone());
                // A full tier is not the layer's problem: the chunk is fetched again when read.
                if let Err(e) = cache.put_blocking(&key, &data, strata_tiering::TierKind::Hot) {
                    tracing::debug!(error = %e, "a fetched chunk was not cached");
                }
                blob.cached.send_modify(|n| *n += 1);
            }
            Err(e) => {
                blob.rejects.layer_chunk_rejects.inc();
                tracing::error!(layer = %blob.digest, error = %e, "a chunk from the registry failed verification");
                // Left uncached, it is fetched again when read; the segments it came from, if
                // from the peer tier, are dropped so that the read does not meet them again.
                if let Some(peers) = blob.peers.clone() {
                    let (image, digest, range) = (blob.image.clone(), blob.digest.clone(), c.offset..c.compressed_end);
                    tokio::runtime::Handle::current().block_on(peers.forget(&image, &digest, range));
                }
                first_error.get_or_insert(e);
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}
