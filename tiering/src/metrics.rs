//! Prometheus metrics of the cache. Names are constants here so dashboards and tests agree.

use crate::tier::TierKind;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

pub const TIER_HITS: &str = "strata_tier_hits";
pub const TIER_MISSES: &str = "strata_tier_misses";
pub const TIER_BYTES_READ: &str = "strata_tier_read_bytes";
pub const TIER_BYTES_WRITTEN: &str = "strata_tier_written_bytes";
pub const TIER_USED: &str = "strata_tier_used_bytes";
pub const TIER_CAPACITY: &str = "strata_tier_capacity_bytes";
pub const TIER_CHUNKS: &str = "strata_tier_chunks";
pub const TIER_WRITE_ERRORS: &str = "strata_tier_write_errors";
pub const CHECKSUM_FAILURES: &str = "strata_checksum_failures";
pub const PROMOTIONS: &str = "strata_promotions";
pub const DEMOTIONS: &str = "strata_demotions";
pub const EVICTIONS: &str = "strata_evictions";
pub const OBJECT_REQUESTS: &str = "strata_object_requests";
pub const COLD_FETCHES: &str = "strata_cold_fetches";
pub const COLD_FETCH_ERRORS: &str = "strata_cold_fetch_errors";
pub const COLD_FETCH_BYTES: &str = "strata_cold_fetch_bytes";
pub const COLD_FETCH_SECONDS: &str = "strata_cold_fetch_seconds";
pub const COALESCED_MISSES: &str = "strata_coalesced_misses";
pub const FS_OPENS: &str = "strata_fs_opens";
pub const FS_PARTS_WHILE_WRITING: &str = "strata_fs_parts_sent_while_writing";
pub const FS_FOREIGN_FLUSHES: &str = "strata_fs_flushes_by_other_processes";
pub const FS_UPLOADS_ABORTED_AT_START: &str = "strata_fs_uploads_aborted_at_start";
pub const FS_DIR_RENAME_OBJECTS: &str = "strata_fs_directory_rename_objects";
pub const FS_RENAMES_FINISHED_AT_START: &str = "strata_fs_directory_renames_finished_at_start";
pub const SNAPSHOT_REQUESTS: &str = "strata_snapshotter_requests";
pub const SNAPSHOT_LAYERS: &str = "strata_snapshotter_layers";
pub const LAYER_CHUNK_REJECTS: &str = "strata_snapshotter_chunks_rejected";
pub const PREFETCH_WAIT_SECONDS: &str = "strata_snapshotter_prefetch_wait_seconds";
pub const LOADER_FILES: &str = "strata_snapshotter_loader_files_fetched_ahead";
pub const EARLY_CHUNKS: &str = "strata_snapshotter_chunks_asked_before_toc_parsed";
pub const CRI_PULLS: &str = "strata_snapshotter_cri_pulls";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabel {
    pub tier: &'static str,
}

/// How a file opened through a mount does its reads.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpenLabel {
    /// `passthrough` (the kernel reads a local copy), `cached` or `direct`.
    pub mode: &'static str,
}

/// One call of containerd's Snapshots service and how it ended.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SnapshotRequestLabel {
    /// The gRPC method: `prepare`, `commit`, `stat`, ...
    pub method: &'static str,
    /// The gRPC code it answered with: `ok`, `not_found`, `already_exists`, ...
    pub code: &'static str,
}

/// How a layer that could have been lazy was prepared.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LayerLabel {
    /// `lazy` (mounted from the registry) or `downloaded` (containerd fetched it whole).
    pub how: &'static str,
}

/// A CRI image pull that kubelet sent through the image service proxy.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CriPullLabel {
    /// `kept` (it succeeded, and its login is used for the image's lazy reads), `failed` (it
    /// failed, and its login was not kept), `none` (it came without one) or `unusable` (a
    /// login Strata cannot use: token-only, or not decodable).
    pub login: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EvictLabel {
    pub tier: &'static str,
    pub reason: &'static str,
}

/// All cache metrics. Cheap to clone: every field is a shared handle.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    pub hits: Family<TierLabel, Counter>,
    pub misses: Family<TierLabel, Counter>,
    pub bytes_read: Family<TierLabel, Counter>,
    pub bytes_written: Family<TierLabel, Counter>,
    pub used: Family<TierLabel, Gauge>,
    pub capacity: Family<TierLabel, Gauge>,
    pub chunks: Family<TierLabel, Gauge>,
    pub write_errors: Family<TierLabel, Counter>,
    pub checksum_failures: Family<TierLabel, Counter>,
    pub promotions: Counter,
    pub demotions: Counter,
    pub evictions: Family<EvictLabel, Counter>,
    pub cold_fetches: Counter,
    pub cold_fetch_errors: Counter,
    pub cold_fetch_bytes: Counter<u64, AtomicU64>,
    pub cold_fetch_seconds: FetchHistogram,
    pub coalesced: Counter,
    pub fs_opens: Family<OpenLabel, Counter>,
    pub fs_parts_while_writing: Counter,
    /// Flushes of files being written by another process than the writer (a forked child's
    /// close), which publish nothing.
    pub fs_foreign_flushes: Counter,
    /// Unfinished uploads of a crashed run that a start aborted.
    pub fs_uploads_aborted_at_start: Counter,
    /// Objects copied to a new name by directory renames.
    pub fs_dir_rename_objects: Counter,
    /// Directory renames a crashed run left half done, finished at the next start.
    pub fs_renames_finished_at_start: Counter,
    pub snapshot_requests: Family<SnapshotRequestLabel, Counter>,
    pub snapshot_layers: Family<LayerLabel, Counter>,
    /// Chunks of lazy layers whose bytes did not decode to their TOC digest.
    pub layer_chunk_rejects: Counter,
    /// How long container reads, or Prepares, waited for their lazy layers' prefetch regions.
    pub prefetch_wait_seconds: FetchHistogram,
    /// Files of lazy layers fetched because a program starting from the layer links them.
    pub loader_files: Counter,
    /// Chunks of lazy layers whose fetch took a request made before the layer's TOC was parsed.
    pub early_chunks: Counter,
    /// CRI pulls seen by the image service proxy, by what became of their login.
    pub cri_pulls: Family<CriPullLabel, Counter>,
    /// All evictions, whatever the tier and reason; for status output.
    pub evicted_chunks: Counter,
    /// Blob bytes the registry mirror served from the peer tier (and this node's cache).
    pub mirror_peer_bytes: Counter,
    /// Bytes the registry mirror passed on from the registry as it sent them.
    pub mirror_upstream_bytes: Counter,
    /// Mirror requests the registry refused the client, answered with its refusal.
    pub mirror_refused: Counter,
}

/// Latency histogram from 1 ms to about 65 s.
#[derive(Debug, Clone)]
pub struct FetchHistogram(pub Histogram);

impl Default for FetchHistogram {
    fn default() -> Self {
        FetchHistogram(Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 17)))
    }
}

pub fn tier(t: TierKind) -> TierLabel {
    TierLabel { tier: t.as_str() }
}

impl Metrics {
    pub fn evictions_total(&self) -> u64 {
        self.evicted_chunks.get()
    }

    pub fn register(&self, r: &mut Registry) {
        r.register(TIER_HITS, "Chunk reads served by a tier", self.hits.clone());
        r.register(TIER_MISSES, "Chunk lookups a tier could not serve", self.misses.clone());
        r.register(TIER_BYTES_READ, "Bytes served from a tier", self.bytes_read.clone());
        r.register(TIER_BYTES_WRITTEN, "Bytes written into a tier", self.bytes_written.clone());
        r.register(TIER_USED, "Bytes a tier holds, chunk headers included", self.used.clone());
        r.register(TIER_CAPACITY, "Configured capacity of a tier", self.capacity.clone());
        r.register(TIER_CHUNKS, "Chunks a tier holds", self.chunks.clone());
        r.register(TIER_WRITE_ERRORS, "Chunk writes that failed, e.g. ENOSPC", self.write_errors.clone());
        r.register(
            CHECKSUM_FAILURES,
            "Cached chunks that failed verification and were refetched",
            self.checksum_failures.clone(),
        );
        r.register(PROMOTIONS, "Chunks moved warm to hot", self.promotions.clone());
        r.register(DEMOTIONS, "Chunks moved hot to warm", self.demotions.clone());
        r.register(EVICTIONS, "Chunks dropped from a tier", self.evictions.clone());
        r.register(COLD_FETCHES, "Chunk fetches from the cold store", self.cold_fetches.clone());
        r.register(COLD_FETCH_ERRORS, "Failed chunk fetches from the cold store", self.cold_fetch_errors.clone());
        r.register(COLD_FETCH_BYTES, "Bytes fetched from the cold store", self.cold_fetch_bytes.clone());
        r.register(
            COLD_FETCH_SECONDS,
            "Latency of one chunk fetch from the cold store",
            self.cold_fetch_seconds.0.clone(),
        );
        r.register(COALESCED_MISSES, "Misses that waited on a fetch already in flight", self.coalesced.clone());
        r.register(
            FS_OPENS,
            "Files opened through dataset mounts, by how their reads are served",
            self.fs_opens.clone(),
        );
        r.register(
            FS_PARTS_WHILE_WRITING,
            "Upload parts of files written through mounts that went up before the writer's fsync or close",
            self.fs_parts_while_writing.clone(),
        );
        r.register(
            FS_FOREIGN_FLUSHES,
            "Closes of files being written, by another process than the writer (a forked child), that published nothing",
            self.fs_foreign_flushes.clone(),
        );
        r.register(
            FS_UPLOADS_ABORTED_AT_START,
            "Multipart uploads a crashed run left unfinished, aborted at the next start so their parts leave the store",
            self.fs_uploads_aborted_at_start.clone(),
        );
        r.register(
            FS_DIR_RENAME_OBJECTS,
            "Objects copied to a new name by directory renames (each a server-side copy and a delete)",
            self.fs_dir_rename_objects.clone(),
        );
        r.register(
            FS_RENAMES_FINISHED_AT_START,
            "Directory renames a crashed run left half done, finished at the next start",
            self.fs_renames_finished_at_start.clone(),
        );
        r.register(
            SNAPSHOT_REQUESTS,
            "Calls of the containerd Snapshots service, by method and answer",
            self.snapshot_requests.clone(),
        );
        r.register(
            SNAPSHOT_LAYERS,
            "eStargz layers containerd asked for, by whether they were mounted lazily or downloaded whole",
            self.snapshot_layers.clone(),
        );
        r.register(
            LAYER_CHUNK_REJECTS,
            "Chunks of lazy layers refused because the registry's bytes did not match their digest (served as EIO)",
            self.layer_chunk_rejects.clone(),
        );
        r.register(
            LOADER_FILES,
            "Files of lazy layers fetched before they were read, because a program being started from the layer names them as its ELF interpreter or libraries",
            self.loader_files.clone(),
        );
        r.register(
            EARLY_CHUNKS,
            "Chunks of lazy layers (the image's program's) fetched by a request made while the layer's TOC was still being parsed",
            self.early_chunks.clone(),
        );
        r.register(
            "strata_mirror_peer_bytes",
            "Blob bytes the registry mirror served from the peer tier",
            self.mirror_peer_bytes.clone(),
        );
        r.register(
            "strata_mirror_upstream_bytes",
            "Bytes the registry mirror passed on from the registry",
            self.mirror_upstream_bytes.clone(),
        );
        r.register(
            "strata_mirror_refused",
            "Registry mirror requests the registry refused the client, answered with its refusal",
            self.mirror_refused.clone(),
        );
        r.register(
            CRI_PULLS,
            "CRI image pulls kubelet sent through Strata's image service proxy, by whether their registry login was kept for the image's lazy reads",
            self.cri_pulls.clone(),
        );
        r.register(
            PREFETCH_WAIT_SECONDS,
            "How long container reads (or, with prefetch_wait = \"prepare\", container Prepares) waited for lazy layers' prefetch regions",
            self.prefetch_wait_seconds.0.clone(),
        );
    }
}
