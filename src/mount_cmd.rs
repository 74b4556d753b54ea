//! `strata mount SOURCE MOUNTPOINT`: a standalone dataset mount in the foreground, with its own
//! tiers, until SIGTERM or Ctrl-C unmounts it.

use anyhow::{Context, bail};
use clap::Args;
use std::path::PathBuf;
use strata_cachefs::{DatasetMount, mount_dataset};
use strata_tiering::services;
use strata_tiering::source::{ColdConfig, ColdKind, ObjectSource};
use strata_tiering::units::{ByteSize, Dur};
use strata_tiering::{CacheConfig, Policy, TierConfig, TieredCache};

#[derive(Args, Debug)]
pub struct MountArgs {
    /// `s3://bucket/prefix`, or a local directory.
    source: String,
    /// An existing empty directory.
    mountpoint: PathBuf,
    /// Tiers and cache state of this mount.
    #[arg(long, default_value = "/var/lib/strata/mount")]
    state_dir: PathBuf,
    /// Room the hot tier (under STATE_DIR/hot) may fill before it evicts.
    #[arg(long, default_value = "10GiB", value_parser = ByteSize::parse)]
    hot_capacity: ByteSize,
    /// 0 disables the warm tier.
    #[arg(long, default_value = "0", value_parser = ByteSize::parse)]
    warm_capacity: ByteSize,
    /// S3 endpoint, e.g. http://rgw:7480 (plain http is allowed when given here).
    #[arg(long, env = "AWS_ENDPOINT_URL")]
    endpoint: Option<String>,
    #[arg(long, env = "AWS_REGION")]
    region: Option<String>,
    /// PEM file of the CA certificates that sign the endpoint's TLS certificate, trusted
    /// besides the system's (an on-premises Ceph's own CA).
    #[arg(long)]
    ca_file: Option<PathBuf>,
    /// Upper bound on one request to the store, retries included.
    #[arg(long, default_value = "30s", value_parser = Dur::parse)]
    timeout: Dur,
    /// Retries of a failed request, within --timeout.
    #[arg(long, default_value_t = 3)]
    retries: usize,
    /// A request that receives nothing for this long is cancelled and retried (at most half of
    /// --timeout is used).
    #[arg(long, default_value = "10s", value_parser = Dur::parse)]
    stall_timeout: Dur,
    /// How long listings and attributes are trusted, in the daemon and the kernel.
    #[arg(long, default_value = "60s", value_parser = Dur::parse)]
    metadata_ttl: Dur,
    /// How long a name found missing is answered as missing without asking the store.
    #[arg(long, default_value = "5s", value_parser = Dur::parse)]
    negative_ttl: Dur,
    /// The dataset never changes while mounted: cache metadata for as long as the mount lives.
    #[arg(long)]
    immutable: bool,
    /// The unit in which objects are fetched and cached; large sequential reads go faster
    /// with larger chunks, small random ones with smaller.
    #[arg(long, default_value = "1MiB", value_parser = ByteSize::parse)]
    chunk_size: ByteSize,
    /// Bytes of chunk fetches in flight, reads and read-ahead together.
    #[arg(long, default_value = "256MiB", value_parser = ByteSize::parse)]
    memory_budget: ByteSize,
    /// FUSE worker threads.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Only the mounting user (and root) may use the mount; by default pods' users may too.
    #[arg(long)]
    private: bool,
    /// Refuse every write.
    #[arg(long)]
    read_only: bool,
    /// Files up to this size are uploaded in one PUT; larger ones as multipart uploads of parts
    /// this size.
    #[arg(long, default_value = "16MiB", value_parser = ByteSize::parse)]
    part_size: ByteSize,
    /// The largest object the store copies in one request (S3's limit). A rename of a larger
    /// file that the store refuses to copy at once is copied in parts.
    #[arg(long, default_value = "5GiB", value_parser = ByteSize::parse)]
    single_copy_limit: ByteSize,
    /// Multipart parts uploaded at once.
    #[arg(long, default_value_t = 4)]
    upload_parallel: usize,
    /// At start, files a previous run staged completely but did not finish uploading are
    /// uploaded (`upload`) or only reported (`report`).
    #[arg(long, default_value = "upload", value_parser = ["upload", "report"])]
    leftovers: String,
    /// Read every file through the daemon, even files whole in the hot tier (which otherwise
    /// the kernel reads straight from a local copy, FUSE passthrough).
    #[arg(long)]
    no_passthrough: bool,
    /// Do not pin the newest file written into each directory (the latest checkpoint) hot.
    #[arg(long)]
    no_keep_newest_hot: bool,
    /// Files written into one directory within this window of its first count as one
    /// checkpoint (a step directory of shards), kept hot whole while it is the newest.
    #[arg(long, default_value = "10m", value_parser = Dur::parse)]
    checkpoint_window: Dur,
    /// Start from a namespace snapshot: one listing of the whole prefix, kept in
    /// --snapshot-dir and reused by later mounts of the same source, instead of listing
    /// directories as they are opened. Best with --immutable.
    #[arg(long)]
    snapshot: bool,
    /// Where snapshots are kept; mounts given the same dir share them. Default: STATE_DIR/snapshots.
    #[arg(long)]
    snapshot_dir: Option<PathBuf>,
    /// A snapshot older than this is taken again.
    #[arg(long, default_value = "1h", value_parser = Dur::parse)]
    snapshot_max_age: Dur,
    /// Serve this mount's metrics (its tiers, its reads and writes, its requests to the store)
    /// for Prometheus at `http://HOST:PORT/metrics`. Off by default, so that a mount never
    /// takes the daemon's port.
    #[arg(long, value_name = "HOST:PORT")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// The tiers' policy (the daemon's policy file format: pins, TTLs, idle demotion,
    /// eviction order, watermarks). Default: the built-in policy.
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,
    /// How often the policy is applied in the background.
    #[arg(long, default_value = "30s", value_parser = Dur::parse)]
    policy_interval: Dur,
}

fn load_policy(path: Option<&std::path::Path>, warm: bool) -> anyhow::Result<Policy> {
    let Some(path) = path else { return Ok(Policy::default()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read policy file {}", path.display()))?;
    Policy::from_toml(&text)
        .and_then(|p| p.check_tiers(warm).map(|()| p))
        .map_err(|e| anyhow::anyhow!("policy file {}: {}: {}", path.display(), e.key, e.message))
}

fn cold_config(a: &MountArgs) -> anyhow::Result<ColdConfig> {
    let mut c = ColdConfig {
        chunk_size: a.chunk_size,
        timeout: a.timeout,
        retries: a.retries,
        stall_timeout: a.stall_timeout,
        single_copy_limit: a.single_copy_limit,
        ..ColdConfig::default()
    };
    if let Some(rest) = a.source.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            bail!("source `{}` names no bucket; write s3://bucket/prefix", a.source);
        }
        c.kind = ColdKind::S3;
        c.bucket = Some(bucket.to_string());
        c.prefix = prefix.to_string();
        c.endpoint = a.endpoint.clone();
        c.allow_http = a.endpoint.as_deref().is_some_and(|e| e.starts_with("http://"));
        c.region = a.region.clone();
        c.ca_file = a.ca_file.clone();
    } else if a.source.contains("://") {
        bail!("source `{}`: only s3:// URLs and local directories are supported", a.source);
    } else {
        let dir = PathBuf::from(&a.source);
        if !dir.is_dir() {
            bail!("source `{}` is not a directory", a.source);
        }
        c.kind = ColdKind::Local;
        c.path = Some(dir);
    }
    Ok(c)
}

pub async fn run(a: MountArgs, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    if a.policy_interval.0.is_zero() {
        bail!("--policy-interval must be above 0s");
    }
    let policy = load_policy(a.policy.as_deref(), a.warm_capacity.0 > 0)?;
    let cold = cold_config(&a)?;
    let source = ObjectSource::new(&cold, &a.state_dir.join("cold"))?;
    let cache_config = CacheConfig {
        hot: TierConfig::new(a.state_dir.join("hot"), a.hot_capacity.0),
        warm: (a.warm_capacity.0 > 0).then(|| TierConfig::new(a.state_dir.join("warm"), a.warm_capacity.0)),
        state_dir: a.state_dir.join("state"),
        policy,
    };
    let cache = tokio::task::spawn_blocking(move || TieredCache::open(cache_config)).await??;
    let spec = DatasetMount {
        path: a.mountpoint.clone(),
        prefix: String::new(),
        key_space: String::new(),
        read_only: a.read_only,
        metadata_ttl: (!a.immutable).then_some(a.metadata_ttl.0),
        negative_ttl: a.negative_ttl.0,
        threads: a.threads,
        allow_other: !a.private,
        part_size: a.part_size.0 as usize,
        upload_parallel: a.upload_parallel,
        staging_dir: a.state_dir.join("staging"),
        upload_leftovers: a.leftovers == "upload",
        memory_budget: a.memory_budget.0,
        passthrough: !a.no_passthrough,
        keep_newest_hot: !a.no_keep_newest_hot,
        checkpoint_window: a.checkpoint_window.0,
        snapshot_dir: a.snapshot.then(|| a.snapshot_dir.clone().unwrap_or_else(|| a.state_dir.join("snapshots"))),
        snapshot_max_age: a.snapshot_max_age.0,
    };
    let stop = services::Stop::default();
    let stopped = || stop.stopped();
    // Bound before mounting, so that a taken port fails the start with nothing mounted.
    let metrics = match a.metrics_listen {
        Some(listen) => {
            let registry = services::registry(&cache, &source);
            Some(services::serve_metrics(&listen.to_string(), registry, stopped()).await?)
        }
        None => None,
    };
    let mounted = match mount_dataset(&spec, source, cache.clone()).await {
        Ok(m) => m,
        Err(e) => {
            stop.stop();
            return Err(anyhow::Error::new(e).context(format!("cannot mount {}", a.source)));
        }
    };
    let policy_task = services::spawn_policy(cache.clone(), a.policy_interval.0, stopped());
    eprintln!("mounted {} at {}", a.source, a.mountpoint.display());
    shutdown.await;
    stop.stop();
    tokio::task::spawn_blocking(move || mounted.unmount()).await?.context("unmounting")?;
    let _ = policy_task.await;
    if let Some(task) = metrics {
        let _ = task.await;
    }
    cache.flush().await?;
    eprintln!("unmounted {}", a.mountpoint.display());
    Ok(())
}

/// The staging dir of a declared mount, named by its mount point and prefix, not by its place
/// in the config: files a crash left staged are then uploaded by the same mount after a restart,
/// even if the config's mounts were reordered, removed or added meanwhile, and never into
/// another mount's prefix. `%` and `/` are escaped, so that no two mounts share a name.
fn staging_name(path: &std::path::Path, prefix: &str) -> String {
    let escape = |s: &str| s.replace('%', "%25").replace('/', "%2F");
    format!("{}@{}", escape(&path.to_string_lossy()), escape(prefix))
}

/// Mounts the `[[mounts]]` of the daemon's config on its cold store and cache, so `strata tier`
/// sees and steers their data. A mount that fails is logged and skipped: the node's cache and
/// the other mounts stay up.
pub async fn mount_declared(agent: &strata_tiering::agent::Agent) -> Vec<strata_cachefs::Mounted> {
    let mut out = Vec::new();
    for m in &agent.config.mounts {
        let spec = DatasetMount {
            path: m.path.clone(),
            prefix: m.prefix.clone(),
            key_space: String::new(),
            read_only: m.read_only,
            metadata_ttl: (!m.immutable).then_some(m.metadata_ttl.0),
            negative_ttl: m.negative_ttl.0,
            threads: m.threads,
            allow_other: m.allow_other,
            part_size: m.part_size.0 as usize,
            upload_parallel: m.upload_parallel,
            staging_dir: agent.config.state_dir.join("staging").join(staging_name(&m.path, &m.prefix)),
            upload_leftovers: m.leftovers == "upload",
            memory_budget: m.memory_budget.0,
            passthrough: m.passthrough,
            keep_newest_hot: m.keep_newest_hot,
            checkpoint_window: m.checkpoint_window.0,
            snapshot_dir: m.snapshot.then(|| agent.config.state_dir.join("snapshots")),
            snapshot_max_age: m.snapshot_max_age.0,
        };
        // A fresh node (or a DaemonSet's new hostPath) has no mount point yet. Only a path that
        // is not there at all is made: a dead mount left at it answers ENOTCONN, and the mount
        // detaches that itself.
        if let Err(e) = make_mount_point(&m.path) {
            tracing::error!(path = %m.path.display(), error = %e, "cannot create the mount point; skipping this mount");
            continue;
        }
        match mount_dataset(&spec, agent.source.clone(), agent.cache.clone()).await {
            Ok(mounted) => {
                tracing::info!(path = %m.path.display(), prefix = %m.prefix, "dataset mounted");
                out.push(mounted);
            }
            Err(e) => tracing::error!(path = %m.path.display(), error = %e, "dataset mount failed; skipping it"),
        }
    }
    out
}

fn make_mount_point(path: &std::path::Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir_all(path),
        _ => Ok(()),
    }
}

/// Unmounts every mount at once: each may wait for files still open on it, and one after
/// another those waits would outlast the time systemd or kubelet gives the daemon to stop.
pub async fn unmount_all(mounts: Vec<strata_cachefs::Mounted>) {
    let mut all = tokio::task::JoinSet::new();
    for m in mounts {
        all.spawn_blocking(move || {
            let path = m.path.clone();
            (path, m.unmount())
        });
    }
    while let Some(done) = all.join_next().await {
        match done {
            Ok((path, Ok(()))) => tracing::info!(path = %path.display(), "dataset unmounted"),
            Ok((path, Err(e))) => tracing::warn!(path = %path.display(), error = %e, "unmount failed"),
            Err(e) => tracing::warn!(error = %e, "unmount task failed"),
        }
    }
}
