//! A dataset mount from start to end: the namespace over a source prefix, the core on a shared
//! cache, leftovers of a previous run, the FUSE session, and the unmount. Used by `strata mount`
//! and by the daemon for the mounts its config declares.

use crate::core::{FsCore, FsOptions};
use crate::fuse::KernelTtl;
use crate::mount::{MountError, MountOptions};
use crate::objects::ObjectNamespace;
use fuser::BackgroundSession;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use strata_tiering::TieredCache;
use strata_tiering::source::ObjectSource;
use tracing::warn;

#[derive(Debug, Clone)]
pub struct DatasetMount {
    /// Where to mount.
    pub path: PathBuf,
    /// Sub-prefix of the source to show ("" for all of it).
    pub prefix: String,
    /// Put before the paths of this mount's chunk keys ("" for a mount of the node's store).
    pub key_space: String,
    pub read_only: bool,
    /// `None`: listings are trusted for as long as the mount lives.
    pub metadata_ttl: Option<Duration>,
    /// How long a missing name is answered as missing without asking the store.
    pub negative_ttl: Duration,
    pub threads: usize,
    pub allow_other: bool,
    pub part_size: usize,
    pub upload_parallel: usize,
    /// Where writes are staged; one directory per mount.
    pub staging_dir: PathBuf,
    /// Upload files a previous run staged completely (else only report them).
    pub upload_leftovers: bool,
    /// Bytes of chunk fetches in flight (reads and read-ahead).
    pub memory_budget: u64,
    /// Files whole in the hot tier are read by the kernel straight from a local copy.
    pub passthrough: bool,
    /// Keep the newest file (or made directory) written into each directory pinned hot.
    pub keep_newest_hot: bool,
    /// Files written into one directory within this window count as one checkpoint.
    pub checkpoint_window: Duration,
    /// Start from a persisted namespace snapshot in this directory, shared by the node's
    /// mounts, instead of listing the source; `None` lists directories as they are opened.
    pub snapshot_dir: Option<PathBuf>,
    /// A snapshot older than this is taken again (one listing of the whole prefix).
    pub snapshot_max_age: Duration,
}

/// A live mount; [`Mounted::unmount`] ends it.
#[derive(Debug)]
pub struct Mounted {
    session: BackgroundSession,
    pub path: PathBuf,
    /// What happened to files staged by a previous run, one line each.
    pub leftovers: Vec<String>,
}

impl Mounted {
    pub fn unmount(self) -> Result<(), MountError> {
        crate::mount::unmount(self.session, &self.path, Duration::from_secs(10))
    }
}

/// Mounts `spec` over `source`, reading through `cache`. Checks first that the source answers,
/// so a wrong bucket or credentials fail here, not at a pod's first `ls`.
pub async fn mount_dataset(
    spec: &DatasetMount,
    source: ObjectSource,
    cache: TieredCache,
) -> Result<Mounted, MountError> {
    let ns = ObjectNamespace::new(source, spec.part_size, spec.upload_parallel.max(1))
        .with_root(&spec.prefix)
        .with_key_space(&spec.key_space);
    let probe = crate::namespace::Namespace::read_dir(&ns, "").await;
    if let Err(e) = probe {
        return Err(MountError::Source { path: spec.path.display().to_string(), message: e.to_string() });
    }
    let staging_dir = (!spec.read_only).then(|| spec.staging_dir.clone());
    if let Some(dir) = &staging_dir {
        // Here, not at the first write: a staging dir that cannot be made fails the mount with
        // its reason, and `df` on the mount has a disk to show from the start.
        std::fs::create_dir_all(dir).map_err(|e| MountError::Source {
            path: spec.path.display().to_string(),
            message: format!("cannot create the staging dir {}: {e}", dir.display()),
        })?;
    }
    let ns_for_snapshot = ns.clone();
    let core = Arc::new(FsCore::new(
        Arc::new(ns),
        cache,
        FsOptions {
            metadata_ttl: spec.metadata_ttl,
            negative_ttl: spec.negative_ttl,
            staging_dir,
            memory_budget: spec.memory_budget,
            max_read_ahead: (spec.memory_budget / 4).clamp(2 << 20, 64 << 20),
            passthrough: spec.passthrough,
            keep_newest_hot: spec.keep_newest_hot,
            checkpoint_window: spec.checkpoint_window,
        },
    ));
    if let Some(dir) = &spec.snapshot_dir {
        let ns = ns_for_snapshot;
        let what = crate::namespace::Namespace::describe(&ns);
        let listed = crate::snapshot::load_or_take(dir, &what, spec.snapshot_max_age, || async {
            ns.list_all(spec.snapshot_max_age).await.map_err(|e| e.to_string())
        })
        .await;
        match listed {
            Ok((entries, _)) => core.seed(crate::snapshot::tree(&entries)),
            Err(e) => return Err(MountError::Source { path: spec.path.display().to_string(), message: e.to_string() }),
        }
    }
    let mut leftovers = core.recover_staged(spec.upload_leftovers).await;
    // After the staged files: one that was still being written inside a directory when a
    // crash cut its rename short has gone up under the old name, and moves with the rest.
    leftovers.extend(core.recover_renames().await);
    // Before the mount goes live: whoever sees it mounted can already read what its start did.
    for l in &leftovers {
        warn!(mountpoint = %spec.path.display(), "left by a previous run: {l}");
    }
    let kernel = spec.metadata_ttl.unwrap_or(Duration::from_secs(365 * 86400));
    let opts = MountOptions {
        ttl: KernelTtl { entry: kernel, attr: kernel },
        threads: spec.threads,
        allow_other: spec.allow_other,
        read_ahead_kb: 4096,
        dev_suid: false,
        immutable: false,
    };
    let path = spec.path.clone();
    let rt = tokio::runtime::Handle::current();
    let session = tokio::task::spawn_blocking(move || crate::mount::mount(core, &path, rt, &opts))
        .await
        .map_err(|e| MountError::Source { path: spec.path.display().to_string(), message: e.to_string() })??;
    Ok(Mounted { session, path: spec.path.clone(), leftovers })
}

/// Mounts any namespace at `path` with the given core and mount settings, as the snapshotter
/// does for image layers.
pub async fn mount_namespace(
    ns: Arc<dyn crate::namespace::Namespace>,
    cache: TieredCache,
    path: &std::path::Path,
    fs: FsOptions,
    opts: MountOptions,
) -> Result<Mounted, MountError> {
    let core = Arc::new(FsCore::new(ns, cache, fs));
    let rt = tokio::runtime::Handle::current();
    let p = path.to_owned();
    let session = tokio::task::spawn_blocking(move || crate::mount::mount(core, &p, rt, &opts))
        .await
        .map_err(|e| MountError::Source { path: path.display().to_string(), message: e.to_string() })??;
    Ok(Mounted { session, path: path.to_owned(), leftovers: Vec::new() })
}
