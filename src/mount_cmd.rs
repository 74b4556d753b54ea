//! `strata mount SOURCE MOUNTPOINT`: a standalone dataset mount in the foreground, with its own
//! tiers, until SIGTERM or Ctrl-C unmounts it.

use anyhow::{Context, bail};
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use strata_cachefs::fuse::KernelTtl;
use strata_cachefs::{FsCore, FsOptions, MountOptions, ObjectNamespace};
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
    /// How long listings and attributes are trusted, in the daemon and the kernel.
    #[arg(long, default_value = "60s", value_parser = Dur::parse)]
    metadata_ttl: Dur,
    /// The dataset never changes while mounted: cache metadata for as long as the mount lives.
    #[arg(long)]
    immutable: bool,
    #[arg(long, default_value = "1MiB", value_parser = ByteSize::parse)]
    chunk_size: ByteSize,
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
    /// Multipart parts uploaded at once.
    #[arg(long, default_value_t = 4)]
    upload_parallel: usize,
    /// At start, files a previous run staged completely but did not finish uploading are
    /// uploaded (`upload`) or only reported (`report`).
    #[arg(long, default_value = "upload", value_parser = ["upload", "report"])]
    leftovers: String,
}

fn cold_config(a: &MountArgs) -> anyhow::Result<ColdConfig> {
    let mut c = ColdConfig { chunk_size: a.chunk_size, ..ColdConfig::default() };
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
    let cold = cold_config(&a)?;
    let source = ObjectSource::new(&cold, &a.state_dir.join("cold"))?;
    // Fail now, with the store's own words, rather than at the first `ls` in a pod.
    source.list_dir("").await.with_context(|| format!("cannot mount {}", a.source))?;
    let cache_config = CacheConfig {
        hot: TierConfig::new(a.state_dir.join("hot"), a.hot_capacity.0),
        warm: (a.warm_capacity.0 > 0).then(|| TierConfig::new(a.state_dir.join("warm"), a.warm_capacity.0)),
        state_dir: a.state_dir.join("state"),
        policy: Policy::default(),
    };
    let cache = tokio::task::spawn_blocking(move || TieredCache::open(cache_config)).await??;
    let ttl = if a.immutable { None } else { Some(a.metadata_ttl.0) };
    let ns = ObjectNamespace::new(source, a.part_size.0 as usize, a.upload_parallel.max(1));
    let staging_dir = (!a.read_only).then(|| a.state_dir.join("staging"));
    let core = Arc::new(FsCore::new(Arc::new(ns), cache.clone(), FsOptions { metadata_ttl: ttl, staging_dir }));
    for line in core.recover_staged(a.leftovers == "upload").await {
        eprintln!("staged file from a previous run: {line}");
    }
    let kernel = ttl.unwrap_or(Duration::from_secs(365 * 86400));
    let opts = MountOptions {
        ttl: KernelTtl { entry: kernel, attr: kernel },
        threads: a.threads,
        allow_other: !a.private,
        read_ahead_kb: 4096,
    };
    let session = strata_cachefs::mount(core, &a.mountpoint, tokio::runtime::Handle::current(), &opts)?;
    eprintln!("mounted {} at {}", a.source, a.mountpoint.display());
    shutdown.await;
    let mnt = a.mountpoint.clone();
    tokio::task::spawn_blocking(move || strata_cachefs::unmount(session, &mnt)).await?.context("unmounting")?;
    cache.flush().await?;
    eprintln!("unmounted {}", a.mountpoint.display());
    Ok(())
}
