//! Opening and mounting one remote layer: find its footer and TOC with two ranged reads, check
//! the TOC against the digest the image annotates it with, and mount the tree through cachefs.

use crate::blob_reads::BlobReads;
use crate::estargz::{self, FormatError, MAX_FOOTER_SIZE};
use crate::layer::{Blob, LayerError, LayerNamespace};
use crate::peer_blobs::PeerBlobs;
use crate::registry::{ImageRef, Registry, RegistryError};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use strata_cachefs::fuse::KernelTtl;
use strata_cachefs::{FsOptions, MountError, MountOptions, Mounted};
use strata_tiering::TieredCache;

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("layer {layer} of {image}: {source}")]
    Registry {
        image: String,
        layer: String,
        #[source]
        source: RegistryError,
    },
    #[error("layer {layer} of {image} is not usable eStargz: {source}")]
    Format {
        image: String,
        layer: String,
        #[source]
        source: FormatError,
    },
    #[error(transparent)]
    Layer(#[from] LayerError),
    #[error("mounting layer {layer}: {source}")]
    Mount {
        layer: String,
        #[source]
        source: MountError,
    },
}

/// Settings for opening and mounting layers.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// Largest TOC accepted, decompressed.
    pub max_toc_size: u64,
    /// Bytes of chunk reads in flight per mounted layer.
    pub memory_budget: u64,
    pub threads: usize,
    /// How long a container waits for a layer's prefetch region before reading on demand.
    pub prefetch_timeout: Duration,
    /// A prefetch region larger than this is fetched without a container waiting for it.
    pub prefetch_async_size: u64,
    /// Whether a container waits for the regions at its reads or in its Prepare.
    pub prefetch_wait: strata_tiering::config::PrefetchWait,
    /// Fetch the rest of each layer in the background, after the prefetch.
    pub background_fetch: bool,
    /// How long the node must have had no container reads before background fill starts.
    pub background_quiet: Duration,
    /// The node's clock of container reads and snapshot calls.
    pub activity: Arc<crate::activity::Activity>,
    /// Fetch a layer that cannot be lazy whole and unpack it, rather than leave it (and every
    /// layer after it) to containerd.
    pub fetch_whole: bool,
    /// For a layer without a prefetch region, fetch the program the image's config runs as
    /// soon as the layer is mounted (`crate::command`).
    pub fetch_program: bool,
    /// Where rejected chunks are counted.
    pub metrics: strata_tiering::metrics::Metrics,
    /// The layers open on the node, by image: where a program's libraries are looked for.
    pub layers: Arc<crate::loader::Layers>,
    /// The peer tier for layers' bytes, when the node has one.
    pub peers: Option<Arc<crate::peer_blobs::PeerBlobs>>,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            max_toc_size: 64 << 20,
            memory_budget: 64 << 20,
            threads: 2,
            prefetch_timeout: Duration::from_secs(10),
            prefetch_async_size: 512 << 20,
            prefetch_wait: Default::default(),
            background_fetch: true,
            background_quiet: Duration::from_secs(1),
            activity: Default::default(),
            fetch_whole: true,
            fetch_program: true,
            metrics: Default::default(),
            layers: Default::default(),
            peers: None,
        }
    }
}

/// A blob's compressed TOC member, as two ranged reads find it: not yet checked against any
/// digest, so nothing in it is used before [`build_layer`] verifies it.
#[derive(Debug)]
pub struct TocMember {
    pub size: u64,
    pub footer: estargz::Footer,
    pub bytes: bytes::Bytes,
}

/// Bytes read from the end of a blob at first: the footer and, for most layers, the whole TOC
/// (326 KB for an 80 MB layer of python), which saves the round trip of a second read. 512 KiB
/// takes 21 ms at 200 Mbit/s, about the round trip it saves on the links lazy pulls are for;
/// and where a layer has start-up files, the TOC's first entries, which name where they end,
/// are found in the tail as it arrives, a round trip before a second read would bring them.
const TAIL_READ: u64 = 512 << 10;

/// Finds blob `digest`'s footer (and the blob's size, in the same read) and reads its TOC
/// member, which may be at most `max_toc_size` bytes (compressed): a footer pointing far back
/// cannot make the daemon read a whole blob into memory. `toc_offset` is where the layer's
/// descriptor says the TOC starts (`strata convert` writes it): then the TOC and the footer
/// come in one read of everything from there on. A hint that does not hold costs the read it
/// made, and the TOC is found from the footer as without one.
///
/// The tail, and a TOC read on its own, are scanned as they arrive: `on_landmark` hears where
/// the prefetch landmark seems to be as soon as its entry is in, well before the rest of a
/// large TOC, and at most once.
pub async fn fetch_toc(
    reads: BlobReads<'_>,
    image: &ImageRef,
    digest: &str,
    max_toc_size: u64,
    toc_offset: Option<u64>,
    mut on_landmark: Option<&mut (dyn FnMut(u64) + Send)>,
) -> Result<TocMember, RemoteError> {
    let reg_err = |source| RemoteError::Registry { image: image.to_string(), layer: digest.to_owned(), source };
    let fmt_err = |source| RemoteError::Format { image: image.to_string(), layer: digest.to_owned(), source };
    let hinted = match toc_offset {
        Some(at) => tail_from(reads, image, digest, at, max_toc_size.saturating_add(MAX_FOOTER_SIZE)).await,
        None => None,
    };
    let (footer, tail, size) = match hinted {
        Some(read) => read,
        None => {
            let mut scan = on_landmark.is_some().then(estargz::tail_scan::TailScan::new);
            // Once told, `on_landmark` is taken: the TOC's own read, if one follows, is not
            // scanned again.
            let observe = |piece: &[u8]| {
                if let Some(scan) = scan.as_mut()
                    && let Some(at) = scan.feed(piece)
                    && let Some(tell) = on_landmark.take()
                {
                    tell(at);
                }
            };
            let (tail, size) =
                reads.tail(image, digest, TAIL_READ.max(MAX_FOOTER_SIZE), observe).await.map_err(reg_err)?;
            (estargz::parse_footer(&tail, size).map_err(fmt_err)?, tail, size)
        }
    };
    let tail_start = size - tail.len() as u64;
    if footer.toc_end - footer.toc_offset > max_toc_size {
        return Err(fmt_err(FormatError::TocTooLarge { limit: max_toc_size }));
    }
    let (start, end) = (footer.toc_offset, footer.toc_end);
    let in_tail = |from: u64| tail.slice((from - tail_start) as usize..(end - tail_start) as usize);
    let bytes = if start >= tail_start {
        // The TOC came with the footer: one round trip saved.
        in_tail(start)
    } else if start >= end {
        // A footer naming an empty TOC: nothing to ask for, and its check fails.
        bytes::Bytes::new()
    } else {
        // The TOC's start (all of it, if the footer leaves a gap before itself) is read on its
        // own, and the rest is in the tail.
        let mut head = reads.range_stream(image, digest, start..end.min(tail_start)).await.map_err(reg_err)?;
        let mut scan = on_landmark.is_some().then(|| estargz::hint::LandmarkScan::new(footer.compression));
        let mut whole = bytes::BytesMut::with_capacity((end - start) as usize);
        while let Some(piece) = head.next().await.map_err(reg_err)? {
            whole.extend_from_slice(&piece);
            if let (Some(scan), Some(tell)) = (scan.as_mut(), on_landmark.as_mut())
                && let Some(at) = scan.feed(&piece)
                && at < footer.data_end
            {
                tell(at);
            }
        }
        if end > tail_start {
            whole.extend_from_slice(&in_tail(tail_start));
        }
        whole.freeze()
    };
    Ok(TocMember { size, footer, bytes })
}

/// As [`fetch_toc`], through the peer tier when `peers` share the image ([`BlobReads`]).
pub async fn fetch_toc_via(
    registry: &Arc<Registry>,
    peers: Option<&PeerBlobs>,
    image: &ImageRef,
    digest: &str,
    max_toc_size: u64,
    toc_offset: Option<u64>,
    on_landmark: Option<&mut (dyn FnMut(u64) + Send)>,
) -> Result<TocMember, RemoteError> {
    let reads = BlobReads::for_blob(registry, peers, image, digest).await.map_err(|source| RemoteError::Registry {
        image: image.to_string(),
        layer: digest.to_owned(),
        source,
    })?;
    fetch_toc(reads, image, digest, max_toc_size, toc_offset, on_landmark).await
}

/// The blob from `at` (where its descriptor says the TOC starts) to its end, if that is at
/// most `limit` bytes and ends in a footer: the footer, those bytes, and the blob's size.
async fn tail_from(
    reads: BlobReads<'_>,
    image: &ImageRef,
    digest: &str,
    at: u64,
    limit: u64,
) -> Option<(estargz::Footer, bytes::Bytes, u64)> {
    let why = match reads.from(image, digest, at, limit).await {
        Ok((tail, size)) => match estargz::parse_footer(&tail, size) {
            Ok(footer) => return Some((footer, tail, size)),
            Err(e) => e.to_string(),
        },
        Err(e) => e.to_string(),
    };
    tracing::debug!(layer = digest, toc_offset = at, why, "the TOC is not where the descriptor says");
    None
}

/// Checks `member` against `toc_digest` and builds the layer's namespace.
pub async fn build_layer(
    registry: Arc<Registry>,
    image: &ImageRef,
    digest: &str,
    member: &TocMember,
    toc_digest: &str,
    opts: &RemoteOptions,
) -> Result<LayerNamespace, RemoteError> {
    let checked = check_toc(image, digest, member, toc_digest, opts).await?;
    namespace(registry, image, digest, member, checked.json, opts).await
}

/// A TOC's JSON that matched its digest, and where its prefetch landmark seems to be.
#[derive(Debug)]
pub struct CheckedToc {
    pub json: Vec<u8>,
    /// From [`estargz::hint::prefetch_landmark`]: to be confirmed by the parse.
    pub landmark_hint: Option<u64>,
}

/// Decompresses `member` and checks it against `toc_digest`: the few milliseconds before the
/// layer's bytes can be asked for.
pub async fn check_toc(
    image: &ImageRef,
    digest: &str,
    member: &TocMember,
    toc_digest: &str,
    opts: &RemoteOptions,
) -> Result<CheckedToc, RemoteError> {
    let fmt_err = |source| RemoteError::Format { image: image.to_string(), layer: digest.to_owned(), source };
    let (bytes, limit, want, compression, data_end) = (
        member.bytes.clone(),
        opts.max_toc_size,
        toc_digest.to_owned(),
        member.footer.compression,
        member.footer.data_end,
    );
    tokio::task::spawn_blocking(move || {
        let json = estargz::verified_toc_json(&bytes, compression, &want, limit)?;
        // A landmark outside the data is refused by the parse: its region is not asked for.
        let landmark_hint = estargz::hint::prefetch_landmark(&json).filter(|&end| end < data_end);
        Ok(CheckedToc { json, landmark_hint })
    })
    .await
    .map_err(|e| fmt_err(FormatError::TocMember(e.to_string())))?
    .map_err(fmt_err)
}

/// Parses a checked TOC's `json` into the layer's namespace.
pub async fn namespace(
    registry: Arc<Registry>,
    image: &ImageRef,
    digest: &str,
    member: &TocMember,
    json: Vec<u8>,
    opts: &RemoteOptions,
) -> Result<LayerNamespace, RemoteError> {
    let fmt_err = |source| RemoteError::Format { image: image.to_string(), layer: digest.to_owned(), source };
    let blob = Arc::new(
        Blob::new(registry, image.clone(), digest.to_owned(), member.size)
            .with_metrics(opts.metrics.clone())
            .with_activity(opts.activity.clone())
            .with_layers(opts.layers.clone())
            .with_peers(opts.peers.clone().filter(|p| p.shares(image))),
    );
    let data_end = member.footer.data_end;
    let built = tokio::task::spawn_blocking(move || {
        estargz::toc::parse_toc(&json, data_end).map(|toc| (LayerNamespace::new(&toc, blob), toc, json))
    })
    .await
    .map_err(|e| fmt_err(FormatError::TocMember(e.to_string())))?;
    let (ns, toc, json) = built.map_err(fmt_err)?;
    // The parsed TOC is thousands of small allocations, whose freeing took a sixth of the
    // parse's time: it is done off the pull's path.
    tokio::task::spawn_blocking(move || drop((toc, json)));
    let ns = ns?;
    opts.layers.add(&ns);
    Ok(ns)
}

/// Reads and verifies the TOC of blob `digest` of `image`, and builds its namespace.
pub async fn open_layer(
    registry: Arc<Registry>,
    image: &ImageRef,
    digest: &str,
    toc_digest: &str,
    opts: &RemoteOptions,
) -> Result<LayerNamespace, RemoteError> {
    let member = fetch_toc_via(&registry, opts.peers.as_deref(), image, digest, opts.max_toc_size, None, None).await?;
    build_layer(registry, image, digest, &member, toc_digest, opts).await
}

/// Mounts `ns` read-only at `path`, with device nodes and setuid bits honoured (the layer is
/// an overlay lower dir) and its tree trusted for the life of the mount (it is immutable).
pub async fn mount_layer(
    ns: LayerNamespace,
    cache: TieredCache,
    path: &Path,
    opts: &RemoteOptions,
) -> Result<Mounted, RemoteError> {
    let layer = ns.blob().digest.clone();
    let _ = ns.blob().cache.set(cache.clone());
    let forever = Duration::from_secs(365 * 86400);
    let fs = FsOptions {
        metadata_ttl: None,
        negative_ttl: forever,
        staging_dir: None,
        memory_budget: opts.memory_budget,
        max_read_ahead: (opts.memory_budget / 4).clamp(2 << 20, 32 << 20),
        passthrough: false,
        keep_newest_hot: false,
        checkpoint_window: Duration::ZERO,
    };
    let mount = MountOptions {
        ttl: KernelTtl { entry: forever, attr: forever },
        threads: opts.threads,
        allow_other: true,
        read_ahead_kb: 4096,
        dev_suid: true,
        immutable: true,
    };
    strata_cachefs::mount_namespace(Arc::new(ns), cache, path, fs, mount)
        .await
        .map_err(|source| RemoteError::Mount { layer, source })
}
