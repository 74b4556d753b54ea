//! Lazy snapshots: a layer whose labels carry an eStargz TOC digest is mounted from the
//! registry through cachefs instead of being downloaded, then committed under the chain ID
//! containerd asked for, so containerd skips its download (containerd's remote-snapshotter
//! protocol). Anything that stops a layer from being lazy falls back to an ordinary snapshot,
//! which containerd fills the usual way, and says why.

use crate::blob_reads::BlobReads;
use crate::early::{Asking, EarlyPrefetch};
use crate::error::SnapshotError;
use crate::fill::{self, Progress};
use crate::gate::RegionGate;
use crate::layer::Blob;
use crate::model::Mount;
use crate::overlay::Snapshotter;
use crate::registry::{ImageRef, Registry};
use crate::remote::{RemoteError, RemoteOptions, TocMember, check_toc, fetch_toc_via, mount_layer, namespace};
use crate::report::LayerReport;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use strata_cachefs::Mounted;
use strata_tiering::TieredCache;
use strata_tiering::config::PrefetchWait;
use tokio::sync::Mutex;

/// Marks a snapshot Strata mounted from a registry (the value stargz-snapshotter uses too).
pub const REMOTE_LABEL: &str = "containerd.io/snapshot/remote";
pub const REMOTE_VALUE: &str = "remote snapshot";
/// The chain ID containerd wants the layer committed as.
pub const TARGET_LABEL: &str = "containerd.io/snapshot.ref";
pub const TOC_LABEL: &str = "containerd.io/snapshot/stargz/toc.digest";
/// The layer annotations `strata convert` writes (see `convert::image`), which containerd
/// passes on as labels.
const TOC_OFFSET_LABEL: &str = crate::convert::image::TOC_OFFSET;
const PREFETCH_END_LABEL: &str = crate::convert::image::PREFETCH_END;
const CRI_REF: &str = "containerd.io/snapshot/cri.image-ref";
const CRI_DIGEST: &str = "containerd.io/snapshot/cri.layer-digest";
/// The digest of the manifest containerd resolved, for the image's platform.
const CRI_MANIFEST: &str = "containerd.io/snapshot/cri.manifest-digest";
const STARGZ_REF: &str = "containerd.io/snapshot/remote/stargz.reference";
const STARGZ_DIGEST: &str = "containerd.io/snapshot/remote/stargz.digest";
/// This layer's digest and those of the layers after it, comma-separated.
const CRI_LAYERS: &str = "containerd.io/snapshot/cri.image-layers";
const STARGZ_LAYERS: &str = "containerd.io/snapshot/remote/stargz.layers";

/// TOC reads started ahead of their layer's Prepare; more than this and the oldest go.
const TOCS_AHEAD: usize = 64;
/// How long requests for the image's program made before its TOC was parsed wait for the
/// fetches of their chunks to take them: these start as soon as the layer is mounted, so one
/// still left after this was made on a guess the parse did not confirm.
const EARLY_KEPT: std::time::Duration = std::time::Duration::from_secs(10);

type TocRead = Shared<BoxFuture<'static, Result<Arc<TocMember>, Arc<RemoteError>>>>;
/// Where an image's program may be (`crate::command`), read from its config.
type ProgramRead = Shared<BoxFuture<'static, Arc<Vec<String>>>>;
/// Images whose programs are kept; past this many, the oldest reads are forgotten.
const PROGRAMS_KEPT: usize = 64;

/// Where a layer containerd is unpacking comes from, from its snapshot labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSource {
    pub image: ImageRef,
    pub digest: String,
    /// The eStargz TOC digest, for a layer that can be lazy.
    pub toc_digest: Option<String>,
    /// Where `strata convert` says the TOC and the prefetch landmark are: hints, which save
    /// round trips when they hold.
    pub toc_offset: Option<u64>,
    pub prefetch_end: Option<u64>,
    /// The manifest containerd is pulling (the CRI passes it): what the image's config is read
    /// from, rather than whatever the tag names by then.
    pub manifest_digest: Option<String>,
}

/// What to do with a Prepare: `None` leaves it to the ordinary path (no target to commit
/// under, or nothing that says where the layer comes from); an error when the labels ask for
/// a lazy layer but cannot be used.
pub fn source(labels: &BTreeMap<String, String>) -> Option<Result<LayerSource, String>> {
    labels.get(TARGET_LABEL)?;
    let toc_digest = labels.get(TOC_LABEL).cloned();
    // The CRI labels first, stargz's own as the fallback, as stargz-snapshotter reads them.
    let reference = labels.get(CRI_REF).or_else(|| labels.get(STARGZ_REF));
    let digest = labels.get(CRI_DIGEST).or_else(|| labels.get(STARGZ_DIGEST));
    match (reference, digest) {
        (Some(r), Some(d)) => Some(
            ImageRef::parse(r)
                .map(|image| {
                    let hint = |key: &str| labels.get(key).and_then(|v| v.parse::<u64>().ok());
                    LayerSource {
                        image,
                        digest: d.clone(),
                        toc_digest,
                        toc_offset: hint(TOC_OFFSET_LABEL),
                        prefetch_end: hint(PREFETCH_END_LABEL).filter(|end| *end > 0),
                        manifest_digest: labels
                            .get(CRI_MANIFEST)
                            .filter(|d| crate::estargz::is_sha256_digest(d))
                            .cloned(),
                    }
                })
                .map_err(|e| e.to_string()),
        ),
        _ if toc_digest.is_some() => Some(Err(format!(
            "the labels carry a TOC digest but not the image reference and layer digest ({CRI_REF} and {CRI_DIGEST}, or {STARGZ_REF} and {STARGZ_DIGEST}); \
             is disable_snapshot_annotations still true in containerd's CRI config?"
        ))),
        _ => None,
    }
}

/// What Prepare did with a layer.
#[derive(Debug)]
pub enum Prepared {
    /// Mounted from the registry (or fetched whole and unpacked by Strata) and committed as
    /// the target: answer AlreadyExists.
    Remote { target: String, how: &'static str },
    /// An ordinary active snapshot, for containerd to fill.
    Local(Vec<Mount>),
}

/// A mounted lazy layer: its mount, and what the report shows of it.
#[derive(Debug)]
struct Live {
    mount: Mounted,
    /// The layer's prefetch and background fill: stopped with the mount, or it would go on
    /// downloading a layer nothing reads any more.
    filling: tokio::task::AbortHandle,
    snapshot: String,
    blob: Arc<Blob>,
    progress: Arc<Progress>,
    prefetch_bytes: Option<u64>,
}

/// A snapshot held against being mounted again (see [`Lazy::hold`]); its slot is forgotten
/// when no one holds or waits for it.
#[derive(Debug)]
pub struct Held<'a> {
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    slots: &'a std::sync::Mutex<HashMap<u64, Arc<Mutex<()>>>>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.guard.take();
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).retain(|_, s| Arc::strong_count(s) > 1);
    }
}

/// A layer's mount not yet handed to [`Lazy`]'s map, and its fill.
struct Unplaced(Option<Mounted>, tokio::task::AbortHandle);

impl Drop for Unplaced {
    fn drop(&mut self) {
        if let Some(m) = self.0.take() {
            self.1.abort();
            tracing::info!(mount = %m.path.display(), "unmounting a layer whose Prepare was given up");
            std::thread::spawn(move || m.unmount());
        }
    }
}

/// What mounting a layer started.
#[derive(Debug)]
struct Started {
    prefetch_bytes: Option<u64>,
    /// The TOC had been read ahead, while an earlier layer was prepared.
    toc_read_ahead: bool,
}

/// Layers that were not mounted lazily (fetched whole by Strata, or left to containerd), most
/// recent last, for the report.
const REFUSED_KEPT: usize = 256;

/// The lazy-layer half of the snapshotter: the registry, the shared cache, and the layers
/// mounted now, by snapshot id.
#[derive(Debug)]
pub struct Lazy {
    registry: Arc<Registry>,
    cache: TieredCache,
    opts: RemoteOptions,
    mounts: Mutex<HashMap<u64, Live>>,
    /// One mount, or unmount and remove, of a snapshot at a time: two Prepares (or a restart's
    /// restore and a Prepare) mounting one layer at once would stack two mounts on its
    /// directory.
    slots: std::sync::Mutex<HashMap<u64, Arc<Mutex<()>>>>,
    refused: std::sync::Mutex<VecDeque<LayerReport>>,
    /// TOC reads of the layers containerd will ask for next, started while it asks for this
    /// one, by layer digest (in start order, for trimming).
    ahead: std::sync::Mutex<VecDeque<(String, TocRead)>>,
    /// The programs of the images being pulled, by reference: read once for all their layers.
    programs: std::sync::Mutex<VecDeque<(String, ProgramRead)>>,
}

/// Whether a layer is being mounted for the first time (by a pull), or again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fresh {
    Yes,
    No,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("snapshot work does not panic")
}

impl Lazy {
    pub fn new(registry: Arc<Registry>, cache: TieredCache, opts: RemoteOptions) -> Lazy {
        Lazy {
            registry,
            cache,
            opts,
            mounts: Mutex::new(HashMap::new()),
            slots: Default::default(),
            refused: Default::default(),
            ahead: Default::default(),
            programs: Default::default(),
        }
    }

    /// Prepare for a layer containerd is unpacking, whose labels say where it comes from: mount
    /// it lazily if it is eStargz, else fetch it whole and unpack it here, so that containerd
    /// does not start fetching this and every following layer itself. Only if both fail does
    /// containerd get an ordinary snapshot to fill.
    pub async fn prepare(
        &self,
        inner: &Arc<Snapshotter>,
        key: &str,
        parent: Option<&str>,
        labels: BTreeMap<String, String>,
        src: Result<LayerSource, String>,
    ) -> Result<Prepared, SnapshotError> {
        // A pull or a container start is under way: background fill holds off.
        self.opts.activity.touch();
        let target = labels.get(TARGET_LABEL).cloned().unwrap_or_default();
        {
            let (i, t) = (inner.clone(), target.clone());
            if let Ok(existing) = blocking(move || i.stat(&t)).await {
                if existing.parent.as_deref() == parent {
                    return Ok(Prepared::Remote { target, how: "existing" });
                }
                // containerd finds the target by its label and by this parent; one committed
                // on another chain of snapshots (the layer below was unpacked by containerd in
                // one namespace and mounted here in another) would not be found, and the pull
                // would fail at every retry. containerd unpacks this layer itself instead.
                tracing::warn!(
                    key,
                    target = %target,
                    has = existing.parent.as_deref().unwrap_or(""),
                    asked = parent.unwrap_or(""),
                    "layer not lazy: its target exists on another parent snapshot"
                );
                let why = format!(
                    "its target exists on parent {:?}, and containerd asked for parent {:?}",
                    existing.parent.as_deref().unwrap_or(""),
                    parent.unwrap_or("")
                );
                self.refuse(&target, "", "", why);
                return Ok(Prepared::Local(self.prepare_plain(inner, key, parent, &labels).await?));
            }
        }
        // The layers under this one, where a program started from it has its libraries found.
        let mut lower = Vec::new();
        if let Some(p) = parent {
            lower = chain_digests(&self.mount_chain(inner, p).await?);
        }
        let mounts = self.prepare_plain(inner, key, parent, &labels).await?;
        let src = match src {
            Ok(s) => s,
            Err(why) => {
                tracing::warn!(key, "layer not lazy: {why}");
                self.refuse(&target, "", "", why);
                return Ok(Prepared::Local(mounts));
            }
        };
        let (id, dir) = {
            let (inner, key) = (inner.clone(), key.to_owned());
            blocking(move || inner.layer_dir(&key)).await?
        };
        let why_not_lazy = match &src.toc_digest {
            Some(toc) => {
                self.read_ahead(&src, &labels);
                match self.mount(id, &dir, &src, toc, &target, Fresh::Yes).await {
                    Ok(started) => {
                        // Before containerd has the layer, so before any program runs from it.
                        self.set_lower(id, lower).await;
                        let mut commit_labels = labels;
                        commit_labels.insert(REMOTE_LABEL.into(), REMOTE_VALUE.into());
                        let done = self.commit(inner, key, parent, &target, commit_labels, Some(id), "lazy").await?;
                        // The prefetch goes on meanwhile: the pull is not held up by it, and a
                        // container waits for it at its reads (`crate::gate`) or its own Prepare
                        // (`wait_prefetch`), so the prefetch overlaps the rest of the pull and
                        // the other layers' fetches.
                        tracing::info!(
                            layer = %src.digest,
                            image = %src.image,
                            snapshot = %target,
                            toc_read_ahead = started.toc_read_ahead,
                            prefetch_bytes = started.prefetch_bytes,
                            "layer mounted lazily"
                        );
                        return Ok(done);
                    }
                    Err(e) => e.to_string(),
                }
            }
            None => "not eStargz: the layer has no TOC digest annotation".to_owned(),
        };
        if !self.opts.fetch_whole {
            tracing::warn!(layer = %src.digest, image = %src.image, "layer not lazy ({why_not_lazy}); containerd will download it");
            self.refuse(&target, &src.image.to_string(), &src.digest, why_not_lazy);
            return Ok(Prepared::Local(mounts));
        }
        match self.fetch_whole(&src, &dir).await {
            Ok(size) => {
                tracing::info!(layer = %src.digest, image = %src.image, snapshot = %target, bytes = size, reason = %why_not_lazy, "layer fetched whole and unpacked");
                self.record_whole(&target, &src, size, why_not_lazy);
                self.commit(inner, key, parent, &target, labels, None, "whole").await
            }
            Err(e) => {
                tracing::warn!(layer = %src.digest, image = %src.image, error = %e, "layer not lazy ({why_not_lazy}), and fetching it whole failed; containerd will download it");
                self.refuse(
                    &target,
                    &src.image.to_string(),
                    &src.digest,
                    format!("{why_not_lazy}; fetching it whole: {e}"),
                );
                // Start containerd on a clean directory, not on what the failed unpack left.
                let (i, k) = (inner.clone(), key.to_owned());
                blocking(move || i.remove(&k)).await?;
                Ok(Prepared::Local(self.prepare_plain(inner, key, parent, &labels).await?))
            }
        }
    }

    async fn prepare_plain(
        &self,
        inner: &Arc<Snapshotter>,
        key: &str,
        parent: Option<&str>,
        labels: &BTreeMap<String, String>,
    ) -> Result<Vec<Mount>, SnapshotError> {
        let (inner, key, parent, labels) = (inner.clone(), key.to_owned(), parent.map(str::to_owned), labels.clone());
        blocking(move || inner.prepare(&key, parent.as_deref(), labels)).await
    }

    /// Commits the prepared layer under `target`. If another Prepare committed the same layer
    /// first, that one is used and this one goes.
    #[allow(clippy::too_many_arguments)]
    async fn commit(
        &self,
        inner: &Arc<Snapshotter>,
        key: &str,
        parent: Option<&str>,
        target: &str,
        labels: BTreeMap<String, String>,
        mounted: Option<u64>,
        how: &'static str,
    ) -> Result<Prepared, SnapshotError> {
        let mut plain_labels = labels.clone();
        plain_labels.remove(REMOTE_LABEL);
        let committed = {
            let (inner, key, target) = (inner.clone(), key.to_owned(), target.to_owned());
            blocking(move || inner.commit(&target, &key, labels)).await
        };
        match committed {
            Ok(()) => Ok(Prepared::Remote { target: target.to_owned(), how }),
            Err(e) => {
                if let Some(id) = mounted {
                    self.unmount(id).await;
                }
                let (i, k) = (inner.clone(), key.to_owned());
                let _ = blocking(move || i.remove(&k)).await;
                match e {
                    SnapshotError::AlreadyExists(_) => {
                        // As in Prepare's own look for the target: one committed on another
                        // parent would not be found by containerd, and its pull would fail.
                        let (i, t) = (inner.clone(), target.to_owned());
                        let existing = blocking(move || i.stat(&t)).await?;
                        if existing.parent.as_deref() == parent {
                            return Ok(Prepared::Remote { target: target.to_owned(), how: "existing" });
                        }
                        let why = format!(
                            "its target was committed meanwhile on parent {:?}, and containerd asked for parent {:?}",
                            existing.parent.as_deref().unwrap_or(""),
                            parent.unwrap_or("")
                        );
                        tracing::warn!(key, target, "layer not lazy: {why}");
                        self.refuse(target, "", "", why);
                        Ok(Prepared::Local(self.prepare_plain(inner, key, parent, &plain_labels).await?))
                    }
                    e => Err(e),
                }
            }
        }
    }

    /// Downloads the whole blob next to the snapshot's directory, checking its digest, and
    /// unpacks it into the directory. Returns the blob's size.
    async fn fetch_whole(&self, src: &LayerSource, dir: &Path) -> Result<u64, String> {
        let blob_path = dir.with_file_name("layer.blob");
        let mut file = std::fs::File::create(&blob_path).map_err(|e| format!("{}: {e}", blob_path.display()))?;
        let peers = self.opts.peers.as_deref();
        let fetched = match BlobReads::for_blob(&self.registry, peers, &src.image, &src.digest).await {
            Ok(reads) => reads.to_file(&src.image, &src.digest, &mut file).await,
            Err(e) => Err(e),
        };
        drop(file);
        let unpacked = match fetched {
            Ok(size) => {
                let (path, dir) = (blob_path.clone(), dir.to_owned());
                blocking(move || {
                    crate::unpack::apply_blob(&path, &dir).map_err(|e| e.to_string())?;
                    // On disk before the snapshot is committed: after a power cut, a committed
                    // layer with empty or short files would be answered AlreadyExists forever,
                    // and its containers would run them.
                    std::fs::File::open(&dir)
                        .and_then(|d| nix::unistd::syncfs(&d).map_err(std::io::Error::from))
                        .map_err(|e| format!("syncing the unpacked layer at {}: {e}", dir.display()))
                })
                .await
                .map(|()| size)
            }
            Err(e) => Err(e.to_string()),
        };
        let _ = std::fs::remove_file(&blob_path);
        unpacked
    }

    fn record_whole(&self, snapshot: &str, src: &LayerSource, size: u64, why: String) {
        self.keep_report(not_lazy(snapshot, &src.image.to_string(), &src.digest, "whole", why, size));
    }

    /// Says which layers are under mounted layer `id` (their digests, nearest first).
    async fn set_lower(&self, id: u64, lower: Vec<String>) {
        if let Some(live) = self.mounts.lock().await.get(&id) {
            live.blob.set_lower(lower);
        }
    }

    /// Mounts the layer and starts its fill. Returns its progress and prefetch size.
    async fn mount(
        &self,
        id: u64,
        dir: &Path,
        src: &LayerSource,
        toc_digest: &str,
        snapshot: &str,
        fresh: Fresh,
    ) -> Result<Started, RemoteError> {
        let started = std::time::Instant::now();
        // With the descriptor's word for where the start-up files end, they are asked for now,
        // beside the TOC; the fill takes them if the TOC agrees.
        let ahead = (self.opts.memory_budget / 4) as usize;
        let ask =
            |end| EarlyPrefetch::start(self.registry.clone(), src.image.clone(), src.digest.clone(), 0..end, ahead);
        // Through the peer tier, the start-up bytes come with the fill, segment by segment from
        // their owners, not in a request of this node's own to the registry.
        let early_ok = fresh == Fresh::Yes && !self.opts.peers.as_ref().is_some_and(|p| p.shares(&src.image));
        let mut early = match (early_ok, src.prefetch_end) {
            (true, Some(end)) => Some(ask(end)),
            _ => None,
        };
        // Without a region, the image's program is fetched once the layer is mounted: its
        // config is read now, beside the TOC.
        let programs = (fresh == Fresh::Yes && src.prefetch_end.is_none() && self.opts.fetch_program)
            .then(|| self.programs(&src.image, src.manifest_digest.as_deref()));
        // A TOC read ahead that failed is read once more now, as if it had not been.
        let read_ahead = match self.take_ahead(&src.digest) {
            Some(read) => read.await.ok(),
            None => None,
        };
        let (member, toc_read_ahead) = match read_ahead {
            Some(m) => (m, true),
            None => {
                // Without the descriptor's word, the start-up files are asked for as soon as
                // the TOC, while it streams in, names where they end: on a second connection,
                // opened now so that the request does not wait for a handshake.
                let scan = early_ok && early.is_none();
                if scan {
                    // A layer without a region has its image's program, runc's user files
                    // and an interpreter's start-up files asked for side by side once it is
                    // mounted: nine requests for python's, which with three spares left the
                    // program's chunks, on the path to everything after, waiting 25 ms for
                    // handshakes behind the small files.
                    let spare = if programs.is_some() { 8 } else { 1 };
                    for _ in 0..spare {
                        let (registry, image) = (self.registry.clone(), src.image.clone());
                        tokio::spawn(async move { registry.preconnect(&image).await });
                    }
                }
                let mut tell = |end| early = Some(ask(end));
                let tell = scan.then_some(&mut tell as &mut (dyn FnMut(u64) + Send));
                let (registry, peers) = (&self.registry, self.opts.peers.as_deref());
                let member = fetch_toc_via(
                    registry,
                    peers,
                    &src.image,
                    &src.digest,
                    self.opts.max_toc_size,
                    src.toc_offset,
                    tell,
                );
                (Arc::new(member.await?), false)
            }
        };
        let toc_read = started.elapsed();
        let checked = check_toc(&src.image, &src.digest, &member, toc_digest, &self.opts).await?;
        let toc_verified = started.elapsed();
        // Else the start-up bytes are asked for now, while the TOC is parsed, if the TOC seems to
        // say where they end; the fill takes them if the parse agrees. The TOC's word beats the
        // descriptor's: a request for another range is replaced (and stopped as it is dropped).
        // A layer mounted again after a restart most likely has them cached already.
        if early_ok
            && let Some(end) = checked.landmark_hint
            && early.as_ref().is_none_or(|e| e.range.end != end)
        {
            early = Some(ask(end));
        }
        // Without a region, the image's program is asked for while the TOC is parsed, where
        // its entries seem to place its chunks; the parse takes the requests it agrees with.
        let early_program = match &programs {
            Some(programs) if early_ok && checked.landmark_hint.is_none() && early.is_none() => {
                let (programs, json, data_end) = (programs.clone(), checked.json.clone(), member.footer.data_end);
                let (registry, image, digest) = (self.registry.clone(), src.image.clone(), src.digest.clone());
                Some(Asking(tokio::spawn(async move {
                    let paths = programs.await;
                    let ranges = paths.iter().find_map(|p| {
                        crate::estargz::hint::file_chunks(&json, p, crate::loader::AHEAD_BYTES, data_end)
                    });
                    let ask = |r| EarlyPrefetch::start(registry.clone(), image.clone(), digest.clone(), r, ahead);
                    ranges.unwrap_or_default().into_iter().map(ask).collect::<Vec<_>>()
                })))
            }
            _ => None,
        };
        // An early request dropped on the way out (a TOC that does not parse) is stopped.
        let ns = namespace(self.registry.clone(), &src.image, &src.digest, &member, checked.json, &self.opts).await?;
        let toc_checked = started.elapsed();
        let blob = ns.blob().clone();
        let prefetch_bytes = fill::prefetch_size(&ns);
        let progress = Arc::new(Progress::new(ns.piece_count() as u64));
        match (prefetch_bytes, self.waited_region(prefetch_bytes)) {
            (Some(size), None) if size > 0 => tracing::info!(
                layer = %src.digest,
                bytes = size,
                limit = self.opts.prefetch_async_size,
                "prefetch region over prefetch_async_size; the container does not wait for it"
            ),
            (_, Some(_)) if self.opts.prefetch_wait == PrefetchWait::Read => {
                let waited = self.opts.metrics.prefetch_wait_seconds.clone();
                let _ = blob.region.set(RegionGate::new(progress.clone(), self.opts.prefetch_timeout, waited));
            }
            _ => {}
        }
        // The prefetch request goes out before the mount is made: it is what a container will
        // wait for, and the mount takes a few milliseconds of its own.
        let _ = blob.cache.set(self.cache.clone());
        let background = self.opts.background_fetch.then_some(self.opts.background_quiet);
        let filling = tokio::spawn(fill::fill(ns.clone(), self.cache.clone(), progress.clone(), background, early));
        if let Some(programs) = programs.filter(|_| prefetch_bytes.is_none_or(|n| n == 0)) {
            let ns = ns.clone();
            tokio::spawn(async move {
                if let Some(asked) = early_program {
                    ns.blob().offer_early(asked.requests().await, EARLY_KEPT);
                }
                for path in programs.await.iter() {
                    if crate::loader::start_program(&ns, path) {
                        break;
                    }
                }
            });
        }
        let mounted = match mount_layer(ns, self.cache.clone(), dir, &self.opts).await {
            Ok(m) => m,
            Err(e) => {
                filling.abort();
                return Err(e);
            }
        };
        tracing::debug!(layer = %src.digest, ?toc_read, ?toc_verified, ?toc_checked, mounted = ?started.elapsed(), "layer mount steps");
        // Until it is in the map, a mount whose call is given up (the client cancelled the
        // Prepare) is unmounted on the way out, not left serving a directory nothing tracks.
        let mut unplaced = Unplaced(Some(mounted), filling.abort_handle());
        let mut mounts = self.mounts.lock().await;
        let Some(mounted) = unplaced.0.take() else { unreachable!("taken only here") };
        let live = Live {
            mount: mounted,
            filling: filling.abort_handle(),
            snapshot: snapshot.to_owned(),
            blob,
            progress: progress.clone(),
            prefetch_bytes,
        };
        let replaced = mounts.insert(id, live);
        drop(mounts);
        if let Some(old) = replaced {
            // Mounts of one snapshot are made one at a time, after a look for a live one, so
            // this is a mount that had died.
            tracing::warn!(id, "a lazy layer was mounted over an earlier mount of it");
            old.filling.abort();
            let _ = blocking(move || old.mount.unmount()).await;
        }
        Ok(Started { prefetch_bytes, toc_read_ahead })
    }

    /// Where the program `image`'s config runs may be (see [`crate::command`]): its config is
    /// read once, starting now, however many of its layers ask; from `manifest` (a digest)
    /// where containerd said which manifest it pulled.
    fn programs(&self, image: &ImageRef, manifest: Option<&str>) -> ProgramRead {
        let name = manifest.map_or_else(|| image.to_string(), |d| format!("{image}@{d}"));
        let mut kept = self.programs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, read)) = kept.iter().find(|(n, _)| *n == name) {
            return read.clone();
        }
        let (registry, image, manifest) = (self.registry.clone(), image.clone(), manifest.map(str::to_owned));
        // Through the peer tier, the manifest's bytes and the config's come from their owners,
        // and a tag is resolved once per period for the cluster.
        let peers = self.opts.peers.clone().filter(|p| p.shares(&image));
        let read = async move {
            let config = match &peers {
                Some(peers) => {
                    let digest = match (&manifest, &image.digest) {
                        (Some(d), _) | (None, Some(d)) => Ok(d.clone()),
                        (None, None) => {
                            let period = crate::peer_blobs::TAG_PERIOD;
                            peers.resolve(&registry, &image, image.object(), period).await
                        }
                    };
                    match digest {
                        Ok(d) => peers.config(&registry, &image, &d).await,
                        Err(e) => Err(e),
                    }
                }
                None => registry.config(&image, manifest.as_deref()).await,
            };
            match config {
                Ok(config) => Arc::new(crate::command::program_paths(&config)),
                Err(e) => {
                    tracing::debug!(%image, error = %e, "the image's config was not read: its program is not fetched ahead");
                    Arc::new(Vec::new())
                }
            }
        }
        .boxed()
        .shared();
        // A shared future runs only when polled: this starts it.
        tokio::spawn(read.clone());
        if kept.len() >= PROGRAMS_KEPT {
            kept.pop_front();
        }
        kept.push_back((name, read.clone()));
        read
    }

    /// Starts reading the TOCs of the layers after this one (from `cri.image-layers`, else
    /// `stargz.layers`), in parallel, so their Prepares find them read.
    fn read_ahead(&self, src: &LayerSource, labels: &BTreeMap<String, String>) {
        let Some(list) = labels.get(CRI_LAYERS).or_else(|| labels.get(STARGZ_LAYERS)) else { return };
        let mut ahead = self.ahead.lock().unwrap_or_else(|p| p.into_inner());
        for digest in list.split(',').map(str::trim).filter(|d| !d.is_empty() && *d != src.digest) {
            if ahead.iter().any(|(d, _)| d == digest) || !crate::estargz::is_sha256_digest(digest) {
                continue;
            }
            let (registry, peers, image, d, max) = (
                self.registry.clone(),
                self.opts.peers.clone(),
                src.image.clone(),
                digest.to_owned(),
                self.opts.max_toc_size,
            );
            let read: TocRead = async move {
                let member = fetch_toc_via(&registry, peers.as_deref(), &image, &d, max, None, None).await;
                member.map(Arc::new).map_err(Arc::new)
            }
            .boxed()
            .shared();
            tokio::spawn(read.clone());
            if ahead.len() == TOCS_AHEAD {
                ahead.pop_front();
            }
            ahead.push_back((digest.to_owned(), read));
            tracing::debug!(layer = digest, "reading a following layer's TOC ahead");
        }
    }

    fn take_ahead(&self, digest: &str) -> Option<TocRead> {
        let mut ahead = self.ahead.lock().unwrap_or_else(|p| p.into_inner());
        let i = ahead.iter().position(|(d, _)| d == digest)?;
        ahead.remove(i).map(|(_, r)| r)
    }

    fn refuse(&self, snapshot: &str, image: &str, layer: &str, reason: String) {
        self.keep_report(not_lazy(snapshot, image, layer, "containerd", reason, 0));
    }

    fn keep_report(&self, report: LayerReport) {
        let mut r = self.refused.lock().unwrap_or_else(|p| p.into_inner());
        if r.len() == REFUSED_KEPT {
            r.pop_front();
        }
        r.push_back(report);
    }

    /// Every lazy layer mounted now, then the layers that were downloaded instead.
    pub async fn report(&self) -> Vec<LayerReport> {
        let mut out: Vec<LayerReport> = self
            .mounts
            .lock()
            .await
            .values()
            .map(|l| LayerReport {
                snapshot: l.snapshot.clone(),
                image: l.blob.image.to_string(),
                layer: l.blob.digest.clone(),
                lazy: true,
                how: "lazy".into(),
                reason: None,
                blob_size: l.blob.size,
                fetched_bytes: l.blob.fetched.load(Ordering::Relaxed),
                prefetch: l.progress.prefetch(),
                prefetch_bytes: l.prefetch_bytes,
                background: l.progress.background(),
                chunks_total: l.progress.chunks_total.load(Ordering::Relaxed),
                chunks_cached: l.progress.chunks_cached.load(Ordering::Relaxed),
                error: l.progress.error(),
            })
            .collect();
        out.sort_by(|a, b| (&a.image, &a.snapshot).cmp(&(&b.image, &b.snapshot)));
        out.extend(self.refused.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned());
        out
    }

    /// What containers opened in each mounted layer, for `strata convert --record`.
    pub async fn accessed(&self) -> Vec<crate::record::AccessReport> {
        let mut out: Vec<_> = self
            .mounts
            .lock()
            .await
            .values()
            .map(|l| crate::record::AccessReport {
                image: l.blob.image.to_string(),
                layer: l.blob.digest.clone(),
                opened: l.blob.opened.list(),
            })
            .collect();
        out.sort_by(|a, b| (&a.image, &a.layer).cmp(&(&b.image, &b.layer)));
        out
    }

    /// Starts the recordings of the mounted layers in `layers` afresh; returns how many there were.
    pub async fn reset_accessed(&self, layers: &[String]) -> usize {
        let mounts = self.mounts.lock().await;
        let hits: Vec<_> = mounts.values().filter(|l| layers.contains(&l.blob.digest)).collect();
        hits.iter().for_each(|l| l.blob.opened.clear());
        hits.len()
    }

    /// Ends the mount of snapshot `id`, if it has one.
    pub async fn unmount(&self, id: u64) {
        // Taken out first: the map stays free for every other layer while this one's unmount
        // waits, up to its limit, for files still open on it.
        let taken = self.mounts.lock().await.remove(&id);
        if let Some(m) = taken {
            m.filling.abort();
            if let Err(e) = blocking(move || m.mount.unmount()).await {
                tracing::warn!(id, error = %e, "unmounting a lazy layer failed");
            }
        }
    }

    /// Holds snapshot `id` against being mounted again until the guard goes: for a Remove,
    /// across its unmount and the removal itself.
    pub async fn hold(&self, id: u64) -> Held<'_> {
        let slot = self.slots.lock().unwrap_or_else(|p| p.into_inner()).entry(id).or_default().clone();
        Held { guard: Some(slot.lock_owned().await), slots: &self.slots }
    }

    /// Makes sure every remote layer under `key` is mounted, mounting again any that is not
    /// (after a restart, or a mount that died), before containerd mounts an overlay over them.
    /// Returns the ids of the chain's snapshots, `key`'s first.
    pub async fn ensure_chain(&self, inner: &Arc<Snapshotter>, key: &str) -> Result<Vec<u64>, SnapshotError> {
        Ok(self.mount_chain(inner, key).await?.iter().map(|(_, id, _)| *id).collect())
    }

    /// As [`Lazy::ensure_chain`], returning the chain itself as `Snapshotter::chain` lists it.
    async fn mount_chain(&self, inner: &Arc<Snapshotter>, key: &str) -> Result<Chain, SnapshotError> {
        self.opts.activity.touch();
        let chain = {
            let (inner, key) = (inner.clone(), key.to_owned());
            blocking(move || inner.chain(&key)).await
        };
        for (at, (_, id, labels)) in chain.iter().enumerate() {
            let id = *id;
            if !labels.contains_key(REMOTE_LABEL) || self.alive(id).await {
                continue;
            }
            let _held = self.hold(id).await;
            // Another call may have mounted it, or a Remove removed it, while this one waited.
            if !self.alive(id).await {
                self.mount_again(inner, &chain, at).await?;
            }
        }
        Ok(chain)
    }

    /// Mounts the remote layer `chain[at]` again (see [`Lazy::mount_chain`]).
    async fn mount_again(&self, inner: &Arc<Snapshotter>, chain: &Chain, at: usize) -> Result<(), SnapshotError> {
        let (name, id, labels) = &chain[at];
        let (name, id) = (name.clone(), *id);
        let unavailable = |reason: String| SnapshotError::LayerUnavailable { name: name.clone(), reason };
        let src = source(labels).ok_or_else(|| unavailable("its labels no longer name its TOC".into()))?;
        let src = src.map_err(unavailable)?;
        let dir = {
            let (inner, name) = (inner.clone(), name.clone());
            blocking(move || inner.layer_dir(&name)).await?.1
        };
        let toc = src.toc_digest.clone().ok_or_else(|| unavailable("its labels no longer name its TOC".into()))?;
        self.mount(id, &dir, &src, &toc, &name, Fresh::No).await.map_err(|e| unavailable(e.to_string()))?;
        self.set_lower(id, chain_digests(&chain[at + 1..])).await;
        tracing::info!(snapshot = %name, "remote layer mounted again");
        Ok(())
    }

    /// With `prefetch_wait = "prepare"`, before a container starts on the snapshots `chain`
    /// (from `ensure_chain`), waits until what each lazy layer marked for start-up (its
    /// prefetch region) is here: all layers at once, for at most `prefetch_timeout`, and not for
    /// regions over `prefetch_async_size`. A region not in by then is logged, and the container
    /// starts anyway, its reads fetching on demand. By default the container's reads wait
    /// instead ([`crate::gate`]).
    pub async fn wait_prefetch(&self, chain: &[u64]) {
        if self.opts.prefetch_wait != PrefetchWait::Prepare {
            return;
        }
        let waits: Vec<(String, u64, Arc<Progress>)> = {
            let mounts = self.mounts.lock().await;
            chain
                .iter()
                .filter_map(|id| mounts.get(id))
                .filter_map(|l| {
                    let size = self.waited_region(l.prefetch_bytes)?;
                    Some((l.blob.digest.clone(), size, l.progress.clone()))
                })
                .collect()
        };
        if waits.is_empty() {
            return;
        }
        let started = std::time::Instant::now();
        let limit = self.opts.prefetch_timeout;
        let done = futures::future::join_all(waits.iter().map(|(_, _, p)| p.prefetched(limit))).await;
        let waited = started.elapsed();
        self.opts.metrics.prefetch_wait_seconds.0.observe(waited.as_secs_f64());
        for ((layer, size, _), done) in waits.iter().zip(done) {
            if !done {
                tracing::warn!(layer = %layer, bytes = size, ?limit, "prefetch not done in time; the container starts anyway");
            }
        }
        tracing::debug!(layers = waits.len(), ?waited, "waited for the prefetch of the container's layers");
    }

    /// The bytes of a layer's prefetch region (`size`, from [`fill::prefetch_size`]) that a
    /// container waits for: none for an empty region or one over `prefetch_async_size`.
    fn waited_region(&self, size: Option<u64>) -> Option<u64> {
        size.filter(|&n| n > 0 && n <= self.opts.prefetch_async_size)
    }

    async fn alive(&self, id: u64) -> bool {
        self.mounts.lock().await.contains_key(&id)
    }

    /// Mounts every remote snapshot again after a restart. A layer whose registry is gone is
    /// reported and left for later (the next container start tries again); it never stops the
    /// daemon.
    pub async fn restore(&self, inner: &Arc<Snapshotter>) -> (usize, usize) {
        let remote = {
            let inner = inner.clone();
            blocking(move || inner.list(&[format!("labels.\"{REMOTE_LABEL}\"")])).await.unwrap_or_default()
        };
        let (mut ok, mut failed) = (0, 0);
        for info in remote {
            match self.ensure_chain(inner, &info.name).await {
                Ok(_) => ok += 1,
                Err(e) => {
                    failed += 1;
                    tracing::error!(snapshot = %info.name, error = %e, "remote layer not mounted at start-up");
                }
            }
        }
        (ok, failed)
    }

    /// Unmounts every layer, at shutdown.
    pub async fn unmount_all(&self) {
        let all: Vec<Mounted> = self.mounts.lock().await.drain().map(|(_, l)| l.mount).collect();
        // All at once: a layer under a running container's overlay keeps its connection until
        // the wait for it runs out, and one after another those waits would outlast the time
        // systemd or kubelet gives the daemon to stop.
        let mut all: tokio::task::JoinSet<_> =
            all.into_iter().map(|m| tokio::task::spawn_blocking(move || m.unmount())).collect();
        while all.join_next().await.is_some() {}
    }
}

/// A snapshot chain as `Snapshotter::chain` lists it: name, id and labels, the top first.
type Chain = Vec<(String, u64, BTreeMap<String, String>)>;

/// The digests of the lazy layers in (part of) a snapshot chain, in its order.
fn chain_digests(chain: &[(String, u64, BTreeMap<String, String>)]) -> Vec<String> {
    chain.iter().filter_map(|(_, _, labels)| source(labels)?.ok().map(|s| s.digest)).collect()
}

/// The report of a layer that is not lazy: `how` it was served instead, and why.
fn not_lazy(snapshot: &str, image: &str, layer: &str, how: &str, reason: String, fetched: u64) -> LayerReport {
    LayerReport {
        snapshot: snapshot.to_owned(),
        image: image.to_owned(),
        layer: layer.to_owned(),
        lazy: false,
        how: how.to_owned(),
        reason: Some(reason),
        blob_size: fetched,
        fetched_bytes: fetched,
        prefetch: fill::Stage::None,
        prefetch_bytes: None,
        background: fill::Stage::None,
        chunks_total: 0,
        chunks_cached: 0,
        error: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_cri_labels_come_first_and_stargz_labels_are_the_fallback() {
        assert!(source(&labels(&[(CRI_REF, "r.io/a:1"), (CRI_DIGEST, "sha256:c")])).is_none(), "no target: not ours");
        let plain = source(&labels(&[(TARGET_LABEL, "sha256:t"), (CRI_REF, "r.io/a:1"), (CRI_DIGEST, "sha256:c")]));
        assert_eq!(plain.unwrap().unwrap().toc_digest, None, "no TOC digest: fetched whole");
        assert!(source(&labels(&[(TARGET_LABEL, "sha256:t")])).is_none(), "nothing to go on: containerd's path");
        let both = labels(&[
            (TARGET_LABEL, "sha256:t"),
            (TOC_LABEL, "sha256:t"),
            (CRI_REF, "r.io/cri:1"),
            (CRI_DIGEST, "sha256:c"),
            (STARGZ_REF, "r.io/stargz:1"),
            (STARGZ_DIGEST, "sha256:s"),
        ]);
        let s = source(&both).unwrap().unwrap();
        assert_eq!((s.image.repository.as_str(), s.digest.as_str()), ("cri", "sha256:c"));
        let legacy = labels(&[
            (TARGET_LABEL, "sha256:t"),
            (TOC_LABEL, "sha256:t"),
            (STARGZ_REF, "r.io/stargz:1"),
            (STARGZ_DIGEST, "sha256:s"),
        ]);
        assert_eq!(source(&legacy).unwrap().unwrap().digest, "sha256:s");
        let e = source(&labels(&[(TARGET_LABEL, "sha256:t"), (TOC_LABEL, "sha256:t")])).unwrap().unwrap_err();
        assert!(e.contains("disable_snapshot_annotations"), "{e}");
    }

    #[test]
    fn strata_convert_hints_are_read_and_nonsense_in_them_is_ignored() {
        let base =
            [(TARGET_LABEL, "sha256:t"), (TOC_LABEL, "sha256:t"), (CRI_REF, "r.io/a:1"), (CRI_DIGEST, "sha256:c")];
        let with = |extra: &[(&str, &str)]| source(&labels(&[&base[..], extra].concat())).unwrap().unwrap();
        let s = with(&[(TOC_OFFSET_LABEL, "80329369"), (PREFETCH_END_LABEL, "4265106")]);
        assert_eq!((s.toc_offset, s.prefetch_end), (Some(80329369), Some(4265106)));
        let s = with(&[(TOC_OFFSET_LABEL, "-1"), (PREFETCH_END_LABEL, "0")]);
        assert_eq!((s.toc_offset, s.prefetch_end), (None, None), "a hint that cannot be one is none");
        assert_eq!(with(&[]).toc_offset, None);
    }

    /// containerd takes AlreadyExists only if it then finds the target on the parent it asked
    /// for. A target committed on another chain (the layer below unpacked by containerd in
    /// one namespace, mounted lazily in another) gets an ordinary snapshot to fill instead.
    #[tokio::test]
    async fn an_existing_target_on_another_parent_is_left_to_containerd() {
        use crate::model::Kind;
        use crate::registry::hosts::Hosts;
        let dir = tempfile::tempdir().unwrap();
        let inner = Arc::new(Snapshotter::open(&dir.path().join("snapshots")).unwrap());
        let none = BTreeMap::new;
        for (key, name) in [("unpacked", "default/7/sha256:below"), ("lazy", "sha256:below")] {
            inner.prepare(key, None, none()).unwrap();
            inner.commit(name, key, none()).unwrap();
        }
        inner.prepare("upper", Some("default/7/sha256:below"), none()).unwrap();
        inner.commit("sha256:above", "upper", none()).unwrap();
        let cache = strata_tiering::TieredCache::open(strata_tiering::CacheConfig {
            hot: strata_tiering::TierConfig::new(dir.path().join("hot"), 64 << 20),
            warm: None,
            state_dir: dir.path().join("state"),
            policy: strata_tiering::Policy::default(),
        })
        .unwrap();
        let registry = Arc::new(Registry::new(Hosts::new(None), Default::default()));
        let lazy = Lazy::new(registry, cache, RemoteOptions::default());
        let target = labels(&[(TARGET_LABEL, "sha256:above")]);
        let not_lazy = || Err("not eStargz".to_string());

        let same = lazy.prepare(&inner, "k1", Some("default/7/sha256:below"), target.clone(), not_lazy()).await;
        assert!(matches!(same, Ok(Prepared::Remote { how: "existing", .. })), "{same:?}");
        assert!(inner.stat("k1").is_err(), "no snapshot is made for an existing target");

        let other = lazy.prepare(&inner, "k2", Some("sha256:below"), target, not_lazy()).await;
        assert!(matches!(other, Ok(Prepared::Local(_))), "{other:?}");
        let made = inner.stat("k2").unwrap();
        assert_eq!((made.kind, made.parent.as_deref()), (Kind::Active, Some("sha256:below")));
        let report = lazy.refused.lock().unwrap().back().cloned().unwrap();
        assert!(format!("{report:?}").contains("sha256:below"), "{report:?}");
    }

    #[test]
    fn the_manifest_containerd_pulled_is_kept_if_it_is_a_digest() {
        let base =
            [(TARGET_LABEL, "sha256:t"), (TOC_LABEL, "sha256:t"), (CRI_REF, "r.io/a:1"), (CRI_DIGEST, "sha256:c")];
        let with = |extra: &[(&str, &str)]| source(&labels(&[&base[..], extra].concat())).unwrap().unwrap();
        let digest = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(with(&[(CRI_MANIFEST, &digest)]).manifest_digest, Some(digest));
        assert_eq!(with(&[(CRI_MANIFEST, "latest")]).manifest_digest, None);
        assert_eq!(with(&[]).manifest_digest, None);
    }
}
