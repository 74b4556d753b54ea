//! The node agent's config file (`/etc/strata/config.toml`). Every key has a default, so an empty
//! file (or none) runs Strata on a local directory as the cold store with the tiers under
//! `state_dir`. `docs/CONFIG.md` lists every key.

use crate::cache::CacheConfig;
use crate::policy::Policy;
use crate::source::ColdConfig;
use crate::tier::TierConfig;
use crate::units::{ByteSize, Dur};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const DEFAULT_CONFIG: &str = "/etc/strata/config.toml";
pub const DEFAULT_SOCKET: &str = "/run/strata/admin.sock";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/strata";
pub const DEFAULT_SNAPSHOTTER_SOCKET: &str = "/run/strata/snapshotter.sock";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    #[serde(default)]
    pub admin: AdminConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default)]
    pub cold: ColdConfig,
    #[serde(default)]
    pub tiers: TiersConfig,
    #[serde(default)]
    pub policy: PolicyConfig,
    /// Dataset mounts the daemon serves from the cold store, through the same cache.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<MountConfig>,
    #[serde(default)]
    pub snapshotter: SnapshotterConfig,
    /// The peer tier (`[peers]`): none unless the section is there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers: Option<crate::peer::PeersConfig>,
    /// The registry mirror (`[mirror]`): none unless the section is there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<MirrorConfig>,
    /// The CSI node plugin (`[csi]`): none unless the section is there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi: Option<CsiConfig>,
}

/// `[csi]`: the CSI node plugin kubelet publishes pods' volumes through.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CsiConfig {
    /// Where kubelet's node-driver-registrar finds the plugin.
    #[serde(default = "default_csi_socket")]
    pub socket: PathBuf,
    /// The node's name for Kubernetes; when empty, `$NODE_NAME` (the DaemonSet sets it from
    /// `spec.nodeName`), else the host name.
    #[serde(default)]
    pub node_id: String,
}

fn default_csi_socket() -> PathBuf {
    PathBuf::from("/var/lib/kubelet/plugins/csi.strata.io/csi.sock")
}

/// `[mirror]`: the registry mirror the daemon serves to containerd, for blobs and manifests
/// by digest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MirrorConfig {
    /// Where containerd reaches it: its hosts.toml names `http://<listen>`.
    #[serde(default = "default_mirror_listen")]
    pub listen: String,
    /// How long the registry's word that a client may pull an object is trusted.
    #[serde(default = "default_access_ttl")]
    pub access_ttl: Dur,
}

fn default_mirror_listen() -> String {
    "127.0.0.1:5050".into()
}

fn default_access_ttl() -> Dur {
    Dur(std::time::Duration::from_secs(60))
}

/// `[snapshotter]`: the containerd snapshotter the daemon serves as a proxy plugin.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotterConfig {
    /// Off unless asked for: containerd must be configured to use it (`deploy/containerd/`).
    #[serde(default)]
    pub enabled: bool,
    /// The unix socket containerd's `[proxy_plugins.strata]` dials.
    #[serde(default = "default_snapshotter_socket")]
    pub socket: PathBuf,
    /// Snapshot directories and metadata; `<state_dir>/snapshotter` when unset. Must be on a
    /// file system that can be an overlay upper dir (ext4, xfs with ftype=1).
    #[serde(default)]
    pub root: Option<PathBuf>,
    /// Mount eStargz layers from the registry instead of letting containerd download them.
    #[serde(default = "yes")]
    pub lazy: bool,
    /// containerd's registry host directory (`<host>/hosts.toml`: mirrors, plain HTTP).
    #[serde(default = "default_hosts_dir")]
    pub hosts_dir: PathBuf,
    /// Registry logins, in docker's `config.json` format.
    #[serde(default = "default_docker_config")]
    pub docker_config: PathBuf,
    /// Serve the CRI image service here, for kubelet's `--image-service-endpoint`: each call
    /// goes on to containerd, and the registry login of each pull (a pod's `imagePullSecrets`)
    /// is kept for the lazy reads of its image. Off when unset.
    #[serde(default)]
    pub image_service_socket: Option<PathBuf>,
    /// containerd's socket, where the image service's calls are forwarded.
    #[serde(default = "default_containerd_socket")]
    pub containerd_socket: PathBuf,
    /// Largest eStargz TOC accepted (decompressed); a larger one makes the layer non-lazy.
    #[serde(default = "default_max_toc")]
    pub max_toc_size: ByteSize,
    /// Bytes of chunk reads in flight per mounted layer.
    #[serde(default = "default_layer_memory")]
    pub layer_memory_budget: ByteSize,
    /// How long a container waits for a layer's prefetch region (before `.prefetch.landmark`).
    #[serde(default = "default_prefetch_timeout")]
    pub prefetch_timeout: Dur,
    /// A prefetch region larger than this is fetched without holding the container back.
    #[serde(default = "default_prefetch_async")]
    pub prefetch_async_size: ByteSize,
    /// Where a container waits for its layers' prefetch regions: at its first read of a byte
    /// not yet here (`read`), or in its Prepare, before containerd sets it up (`prepare`).
    #[serde(default)]
    pub prefetch_wait: PrefetchWait,
    /// After the prefetch, fetch the rest of each lazy layer in the background.
    #[serde(default = "yes")]
    pub background_fetch: bool,
    /// Background fetch starts once no container has read from a lazy layer, and no snapshot
    /// has been prepared, for this long: a starting container has the link to itself.
    #[serde(default = "default_background_quiet")]
    pub background_quiet: Dur,
    /// Fetch a layer that cannot be lazy (not eStargz, or a TOC that does not verify) whole,
    /// checked against its digest, and unpack it here, instead of leaving it to containerd,
    /// which would then fetch every following layer too.
    #[serde(default = "yes")]
    pub fetch_whole: bool,
    /// For a layer without a prefetch region, fetch the program the image's config runs, with
    /// its loader's files, as soon as the layer is mounted.
    #[serde(default = "yes")]
    pub fetch_image_program: bool,
}

impl Default for SnapshotterConfig {
    fn default() -> Self {
        SnapshotterConfig {
            enabled: false,
            socket: default_snapshotter_socket(),
            root: None,
            lazy: true,
            hosts_dir: default_hosts_dir(),
            docker_config: default_docker_config(),
            image_service_socket: None,
            containerd_socket: default_containerd_socket(),
            max_toc_size: default_max_toc(),
            layer_memory_budget: default_layer_memory(),
            prefetch_timeout: default_prefetch_timeout(),
            prefetch_async_size: default_prefetch_async(),
            prefetch_wait: PrefetchWait::default(),
            background_fetch: true,
            background_quiet: default_background_quiet(),
            fetch_whole: true,
            fetch_image_program: true,
        }
    }
}

/// Where a container start waits for its lazy layers' prefetch regions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefetchWait {
    /// A read of a layer byte not yet here waits for the layer's region; containerd and runc
    /// set the container up meanwhile.
    #[default]
    Read,
    /// The container's Prepare waits for all its layers' regions, as stargz-snapshotter does.
    Prepare,
}

fn default_background_quiet() -> Dur {
    Dur(std::time::Duration::from_secs(1))
}

fn default_hosts_dir() -> PathBuf {
    "/etc/containerd/certs.d".into()
}

fn default_docker_config() -> PathBuf {
    "/root/.docker/config.json".into()
}

fn default_containerd_socket() -> PathBuf {
    "/run/containerd/containerd.sock".into()
}

fn default_max_toc() -> ByteSize {
    ByteSize::mib(64)
}

fn default_layer_memory() -> ByteSize {
    ByteSize::mib(64)
}

fn default_prefetch_timeout() -> Dur {
    Dur(std::time::Duration::from_secs(10))
}

fn default_prefetch_async() -> ByteSize {
    ByteSize::mib(512)
}

fn default_snapshotter_socket() -> PathBuf {
    DEFAULT_SNAPSHOTTER_SOCKET.into()
}

/// `[[mounts]]`: one dataset mount of a prefix of the cold store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountConfig {
    /// Absolute path to mount at; the daemon creates it if missing.
    pub path: PathBuf,
    /// Prefix of the cold store to show ("" for all of it).
    #[serde(default)]
    pub prefix: String,
    #[serde(default)]
    pub read_only: bool,
    /// The data never changes while mounted: trust listings for the mount's lifetime.
    #[serde(default)]
    pub immutable: bool,
    #[serde(default = "default_metadata_ttl")]
    pub metadata_ttl: Dur,
    /// How long a name found missing is answered as missing without asking the store.
    #[serde(default = "default_negative_ttl")]
    pub negative_ttl: Dur,
    #[serde(default = "default_threads")]
    pub threads: usize,
    #[serde(default = "yes")]
    pub allow_other: bool,
    #[serde(default = "default_part")]
    pub part_size: ByteSize,
    #[serde(default = "default_threads")]
    pub upload_parallel: usize,
    /// What to do at start with files a previous run staged but did not finish uploading:
    /// `upload` or `report`.
    #[serde(default = "default_leftovers")]
    pub leftovers: String,
    /// Bytes of chunk fetches in flight for this mount, reads and read-ahead together.
    #[serde(default = "default_budget")]
    pub memory_budget: ByteSize,
    /// Files whole in the hot tier are opened with FUSE passthrough: the kernel reads a local
    /// copy directly. The copy takes hot-tier space beside the file's chunks.
    #[serde(default = "yes")]
    pub passthrough: bool,
    /// Keep the newest file written into each directory, and the newest directory the mount
    /// made in its parent (a sharded checkpoint), pinned in the hot tier.
    #[serde(default = "yes")]
    pub keep_newest_hot: bool,
    /// A directory whose files were all written within this window of the first one is one
    /// checkpoint (a step directory of shards), kept hot whole while it is the newest.
    #[serde(default = "default_checkpoint_window")]
    pub checkpoint_window: Dur,
    /// Start from a namespace snapshot (one listing of the prefix, kept in the state dir and
    /// shared by the node's mounts of the same prefix) instead of listing directories.
    #[serde(default)]
    pub snapshot: bool,
    /// A snapshot older than this is taken again at the next mount.
    #[serde(default = "default_snapshot_max_age")]
    pub snapshot_max_age: Dur,
}

fn default_checkpoint_window() -> Dur {
    Dur::secs(600)
}

fn default_snapshot_max_age() -> Dur {
    Dur::secs(3600)
}

fn default_budget() -> ByteSize {
    ByteSize::mib(256)
}

fn default_metadata_ttl() -> Dur {
    Dur::secs(60)
}
fn default_negative_ttl() -> Dur {
    Dur::secs(5)
}
fn default_threads() -> usize {
    4
}
fn yes() -> bool {
    true
}
fn default_part() -> ByteSize {
    ByteSize::mib(16)
}
fn default_leftovers() -> String {
    "upload".into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    #[serde(default = "default_socket")]
    pub socket: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// `host:port` for the Prometheus endpoint; empty disables it.
    #[serde(default = "default_metrics")]
    pub listen: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct TiersConfig {
    #[serde(default)]
    pub hot: TierSpec,
    #[serde(default = "default_warm")]
    pub warm: TierSpec,
}

/// One tier as written in the config; unset fields take defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct TierSpec {
    /// Default `<state_dir>/hot` or `<state_dir>/warm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Default 10GiB for hot, 50GiB for warm. A warm capacity of 0 disables the warm tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<ByteSize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high_watermark: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_watermark: Option<f64>,
    #[serde(default)]
    pub fsync: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// The policy TOML. `strata tier policy set` rewrites it. Default `<state_dir>/policy.toml`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// How often the background task applies the policy.
    #[serde(default = "default_interval")]
    pub interval: Dur,
}

fn default_state_dir() -> PathBuf {
    PathBuf::from(DEFAULT_STATE_DIR)
}
fn default_socket() -> PathBuf {
    PathBuf::from(DEFAULT_SOCKET)
}
fn default_metrics() -> String {
    "127.0.0.1:9464".into()
}
fn default_warm() -> TierSpec {
    TierSpec::default()
}
fn default_interval() -> Dur {
    Dur::secs(30)
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig { socket: default_socket() }
    }
}
impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig { listen: default_metrics() }
    }
}
impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig { file: None, interval: default_interval() }
    }
}
impl Default for Config {
    fn default() -> Self {
        Config::from_toml("").expect("the empty config is valid")
    }
}

/// A config that cannot be used; `key` names the setting, e.g. `tiers.hot.capacity`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{origin}: {key}: {message}")]
pub struct ConfigError {
    pub origin: String,
    pub key: String,
    pub message: String,
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            origin: path.display().to_string(),
            key: "(file)".into(),
            message: format!("cannot read config file: {e}"),
        })?;
        Config::from_toml(&text).map_err(|mut e| {
            e.origin = path.display().to_string();
            e
        })
    }

    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let err = |key: String, message: String| ConfigError { origin: "config".into(), key, message };
        let de = toml::Deserializer::parse(text).map_err(|e| err("(syntax)".into(), e.to_string()))?;
        let config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            err(if key == "." { "(top level)".into() } else { key }, e.inner().message().to_string())
        })?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let err = |key: String, message: String| Err(ConfigError { origin: "config".into(), key, message });
        if self.tiers.hot.capacity == Some(ByteSize(0)) {
            return err("tiers.hot.capacity".into(), "must be above 0".into());
        }
        for (name, spec, default_cap) in self.tier_specs() {
            if let Some(tc) = self.tier_config(spec, name, default_cap)
                && let Err((key, message)) = tc.validate(&format!("tiers.{name}"))
            {
                return err(key, message);
            }
        }
        let [(_, hot, hot_cap), (_, warm, warm_cap)] = self.tier_specs();
        // Compared as the tiers will use them, defaults filled in and links followed: a warm
        // path naming the hot tier's default directory shares its chunk files just the same,
        // and each tier would delete the other's at every restart.
        if let (Some(h), Some(w)) = (self.tier_config(hot, "hot", hot_cap), self.tier_config(warm, "warm", warm_cap))
            && same_dir(&h.path, &w.path)
        {
            return err(
                "tiers.warm.path".into(),
                format!(
                    "{} is also the hot tier's directory; the tiers need directories of their own",
                    w.path.display()
                ),
            );
        }
        if !self.metrics.listen.is_empty() && self.metrics.listen.parse::<std::net::SocketAddr>().is_err() {
            return err("metrics.listen".into(), format!("`{}` is not host:port", self.metrics.listen));
        }
        if self.policy.interval.0.is_zero() {
            return err("policy.interval".into(), "must be above 0s".into());
        }
        if !self.snapshotter.socket.is_absolute() {
            return err("snapshotter.socket".into(), "must be an absolute path".into());
        }
        if let Some(csi) = &self.csi
            && !csi.socket.is_absolute()
        {
            return err("csi.socket".into(), "must be an absolute path".into());
        }
        if let Some(root) = &self.snapshotter.root
            && !root.is_absolute()
        {
            return err("snapshotter.root".into(), "must be an absolute path".into());
        }
        if let Some(image) = &self.snapshotter.image_service_socket {
            // kubelet pointed at a socket nobody serves could neither pull nor check images.
            if !self.snapshotter.enabled || !self.snapshotter.lazy {
                return err(
                    "snapshotter.image_service_socket".into(),
                    "needs snapshotter.enabled = true and snapshotter.lazy = true: the logins it keeps are for lazy reads".into(),
                );
            }
            if !image.is_absolute() {
                return err("snapshotter.image_service_socket".into(), "must be an absolute path".into());
            }
            if *image == self.snapshotter.socket || *image == self.snapshotter.containerd_socket {
                return err(
                    "snapshotter.image_service_socket".into(),
                    "must differ from snapshotter.socket and snapshotter.containerd_socket".into(),
                );
            }
            if !self.snapshotter.containerd_socket.is_absolute() {
                return err("snapshotter.containerd_socket".into(), "must be an absolute path".into());
            }
        }
        if self.snapshotter.max_toc_size.0 < 1 << 20 {
            return err("snapshotter.max_toc_size".into(), "must be at least 1MiB".into());
        }
        if self.snapshotter.layer_memory_budget.0 < 8 << 20 {
            return err("snapshotter.layer_memory_budget".into(), "must be at least 8MiB".into());
        }
        if let Some(Err((key, message))) = self.peers.as_ref().map(|p| p.validate()) {
            return err(key, message);
        }
        if let Some(m) = &self.mirror {
            let Ok(addr) = m.listen.parse::<std::net::SocketAddr>() else {
                return err("mirror.listen".into(), format!("`{}` is not ip:port", m.listen));
            };
            if m.access_ttl.0.is_zero() {
                return err("mirror.access_ttl".into(), "must be above 0s".into());
            }
            let taken = [("the metrics endpoint's", self.metrics.listen.as_str())]
                .into_iter()
                .chain(self.peers.as_ref().map(|p| ("the peer port's", p.listen.as_str())));
            for (whose, other) in taken {
                if other.parse::<std::net::SocketAddr>().is_ok_and(|o| o.port() == addr.port()) {
                    return err("mirror.listen".into(), format!("port {} is {whose}", addr.port()));
                }
            }
        }
        if let Some(p) = &self.peers
            && !self.metrics.listen.is_empty()
            && p.listen_port() == self.metrics.listen.parse::<std::net::SocketAddr>().map_or(0, |a| a.port())
        {
            return err("peers.listen".into(), format!("port {} is the metrics endpoint's", p.listen_port()));
        }
        for (i, m) in self.mounts.iter().enumerate() {
            let key = |f: &str| format!("mounts[{i}].{f}");
            if !m.path.is_absolute() {
                return err(key("path"), format!("`{}` must be an absolute path", m.path.display()));
            }
            if self.mounts[..i].iter().any(|o| o.path == m.path) {
                return err(key("path"), format!("`{}` is mounted twice", m.path.display()));
            }
            if m.prefix.split('/').any(|s| s == "..") {
                return err(key("prefix"), "must not contain `..`".into());
            }
            if !(1..=64).contains(&m.threads) {
                return err(key("threads"), "must be between 1 and 64".into());
            }
            if !(1..=64).contains(&m.upload_parallel) {
                return err(key("upload_parallel"), "must be between 1 and 64".into());
            }
            // S3 refuses multipart parts under 5 MiB (but the last) and over 5 GiB.
            if m.part_size.0 < 5 << 20 || m.part_size.0 > 5 << 30 {
                return err(key("part_size"), "must be between 5MiB and 5GiB".into());
            }
            if m.memory_budget.0 < 8 << 20 {
                return err(key("memory_budget"), "must be at least 8MiB".into());
            }
            if m.leftovers != "upload" && m.leftovers != "report" {
                return err(key("leftovers"), format!("`{}` is not `upload` or `report`", m.leftovers));
            }
        }
        Ok(())
    }

    fn tier_specs(&self) -> [(&'static str, &TierSpec, ByteSize); 2] {
        [("hot", &self.tiers.hot, ByteSize::gib(10)), ("warm", &self.tiers.warm, ByteSize::gib(50))]
    }

    fn tier_config(&self, spec: &TierSpec, name: &str, default_cap: ByteSize) -> Option<TierConfig> {
        let capacity = spec.capacity.unwrap_or(default_cap);
        if capacity.0 == 0 {
            return None;
        }
        let mut tc = TierConfig::new(spec.path.clone().unwrap_or_else(|| self.state_dir.join(name)), capacity.0);
        if let Some(h) = spec.high_watermark {
            tc.high_watermark = h;
        }
        if let Some(l) = spec.low_watermark {
            tc.low_watermark = l;
        }
        tc.fsync = spec.fsync;
        Some(tc)
    }

    pub fn snapshotter_root(&self) -> PathBuf {
        self.snapshotter.root.clone().unwrap_or_else(|| self.state_dir.join("snapshotter"))
    }

    pub fn policy_file(&self) -> PathBuf {
        self.policy.file.clone().unwrap_or_else(|| self.state_dir.join("policy.toml"))
    }

    /// Reads the policy file; a missing file means the default policy.
    pub fn load_policy(&self) -> Result<Policy, ConfigError> {
        let path = self.policy_file();
        let [_, (wn, ws, wc)] = self.tier_specs();
        let warm = self.tier_config(ws, wn, wc).is_some();
        match std::fs::read_to_string(&path) {
            Ok(text) => Policy::from_toml(&text)
                .and_then(|p| p.check_tiers(warm).map(|()| p))
                .map_err(|e| ConfigError { origin: path.display().to_string(), key: e.key, message: e.message }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.policy.file.is_none() => Ok(Policy::default()),
            Err(e) => Err(ConfigError {
                origin: path.display().to_string(),
                key: "policy.file".into(),
                message: format!("cannot read policy file: {e}"),
            }),
        }
    }

    pub fn cache_config(&self, policy: Policy) -> CacheConfig {
        let [(hn, hs, hc), (wn, ws, wc)] = self.tier_specs();
        CacheConfig {
            hot: self.tier_config(hs, hn, hc).expect("validated: hot capacity above 0"),
            warm: self.tier_config(ws, wn, wc),
            state_dir: self.state_dir.join("state"),
            policy,
        }
    }

    pub fn cold_default_dir(&self) -> PathBuf {
        self.state_dir.join("cold")
    }
}

/// Whether two tier paths name one directory: the same path once `.` and trailing slashes are
/// gone, or, where both exist, the same directory through links.
fn same_dir(a: &std::path::Path, b: &std::path::Path) -> bool {
    a.components().eq(b.components()) || resolved(a) == resolved(b)
}

/// `path` with links followed as far as it exists, and the rest, not yet made, as written:
/// a link to a tier directory a first start has yet to create still names that directory.
fn resolved(path: &std::path::Path) -> PathBuf {
    resolved_within(path, 40)
}

fn resolved_within(path: &std::path::Path, links: u32) -> PathBuf {
    let mut rest = Vec::new();
    let mut at = path.to_owned();
    loop {
        let real = match at.canonicalize() {
            Ok(real) => Some(real),
            // A link to what does not exist yet: followed by hand.
            Err(_) if links > 0 => std::fs::read_link(&at).ok().map(|to| {
                let to = at.parent().map_or(to.clone(), |p| p.join(&to));
                resolved_within(&to, links - 1)
            }),
            Err(_) => None,
        };
        if let Some(real) = real {
            return rest.iter().rev().fold(real, |p: PathBuf, part| p.join(part));
        }
        match (at.parent().map(std::path::Path::to_owned), at.file_name().map(|n| n.to_owned())) {
            (Some(parent), Some(name)) => {
                rest.push(name);
                at = parent;
            }
            _ => return path.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_runs_on_embedded_defaults() {
        let c = Config::from_toml("").unwrap();
        let cc = c.cache_config(Policy::default());
        assert_eq!(cc.hot.path, PathBuf::from("/var/lib/strata/hot"));
        assert_eq!(cc.hot.capacity, ByteSize::gib(10));
        assert_eq!(cc.warm.unwrap().capacity, ByteSize::gib(50));
        assert_eq!(c.cold.kind, crate::source::ColdKind::Local);
        assert_eq!(c.cold_default_dir(), PathBuf::from("/var/lib/strata/cold"));
        assert_eq!(c.admin.socket, PathBuf::from(DEFAULT_SOCKET));
    }

    #[test]
    fn the_mirror_section_turns_the_mirror_on_and_its_mistakes_are_named() {
        assert!(Config::from_toml("").unwrap().mirror.is_none(), "no section, no mirror");
        let m = Config::from_toml("[mirror]\n").unwrap().mirror.unwrap();
        assert_eq!((m.listen.as_str(), m.access_ttl.0), ("127.0.0.1:5050", std::time::Duration::from_secs(60)));
        for (toml, key, why) in [
            ("[mirror]\nlisten = \"5050\"\n", "mirror.listen", "`5050` is not ip:port"),
            ("[mirror]\naccess_ttl = \"0s\"\n", "mirror.access_ttl", "must be above 0s"),
            (
                "[metrics]\nlisten = \"127.0.0.1:5050\"\n[mirror]\n",
                "mirror.listen",
                "port 5050 is the metrics endpoint's",
            ),
            ("[mirror]\nport = 1\n", "mirror.port", "unknown field `port`"),
        ] {
            let e = Config::from_toml(toml).unwrap_err();
            assert!(e.key == key && e.message.starts_with(why), "{toml:?}: {e}");
        }
    }

    #[test]
    fn errors_name_the_key() {
        let e = Config::from_toml("[tiers.hot]\ncapacity = -5").unwrap_err();
        assert_eq!(e.key, "tiers.hot.capacity", "{e}");
        assert!(e.message.contains("negative"), "{e}");
        let e = Config::from_toml("[tiers.hot]\ncapacty = \"1GiB\"").unwrap_err();
        assert!(e.message.contains("capacty"), "{e}");
        let e = Config::from_toml("[cold]\ntimeout = \"forever\"").unwrap_err();
        assert_eq!(e.key, "cold.timeout", "{e}");
        let e = Config::from_toml("[tiers.warm]\nlow_watermark = 0.95").unwrap_err();
        assert_eq!(e.key, "tiers.warm.low_watermark", "{e}");
        let e = Config::from_toml("[metrics]\nlisten = \"nowhere\"").unwrap_err();
        assert_eq!(e.key, "metrics.listen", "{e}");
        let e = Config::from_toml("bogus = 1").unwrap_err();
        assert!(e.message.contains("bogus"), "{e}");
    }

    #[test]
    fn snapshotter_is_off_by_default_and_its_paths_are_checked() {
        let c = Config::from_toml("").unwrap();
        assert!(!c.snapshotter.enabled);
        assert_eq!(c.snapshotter_root(), PathBuf::from(DEFAULT_STATE_DIR).join("snapshotter"));
        let e = Config::from_toml("[snapshotter]\nsocket = \"s.sock\"\n").unwrap_err();
        assert_eq!(e.key, "snapshotter.socket");
        let e = Config::from_toml("[snapshotter]\nroot = \"r\"\n").unwrap_err();
        assert_eq!(e.key, "snapshotter.root");
        assert_eq!(c.snapshotter.image_service_socket, None, "the image service proxy is off by default");
        let on = "[snapshotter]\nenabled = true\n";
        let e =
            Config::from_toml(&format!("{on}image_service_socket = \"/run/strata/snapshotter.sock\"\n")).unwrap_err();
        assert_eq!(e.key, "snapshotter.image_service_socket");
        let e = Config::from_toml(&format!("{on}image_service_socket = \"/run/i.sock\"\ncontainerd_socket = \"c\"\n"))
            .unwrap_err();
        assert_eq!(e.key, "snapshotter.containerd_socket");
        let e = Config::from_toml("[snapshotter]\nimage_service_socket = \"/run/i.sock\"\n").unwrap_err();
        assert!(e.message.contains("snapshotter.enabled"), "{e}");
        let e = Config::from_toml(&format!("{on}lazy = false\nimage_service_socket = \"/run/i.sock\"\n")).unwrap_err();
        assert!(e.message.contains("lazy"), "{e}");
        assert!(Config::from_toml(&format!("{on}image_service_socket = \"/run/i.sock\"\n")).is_ok());
        let e = Config::from_toml("[snapshotter]\nenable = true\n").unwrap_err();
        assert_eq!(e.key, "snapshotter.enable");
        assert_eq!(c.snapshotter.prefetch_wait, PrefetchWait::Read);
        let c = Config::from_toml("[snapshotter]\nprefetch_wait = \"prepare\"\n").unwrap();
        assert_eq!(c.snapshotter.prefetch_wait, PrefetchWait::Prepare);
        let e = Config::from_toml("[snapshotter]\nprefetch_wait = \"start\"\n").unwrap_err();
        assert_eq!(e.key, "snapshotter.prefetch_wait");
        assert!(e.message.contains("`read`") && e.message.contains("`prepare`"), "{e}");
    }

    #[test]
    fn the_shipped_examples_parse() {
        let c = Config::from_toml(include_str!("../../deploy/config.example.toml")).unwrap();
        assert!(c.snapshotter.enabled);
        let c = Config::from_toml(include_str!("../../deploy/containerd/strata.toml")).unwrap();
        assert_eq!(c.snapshotter.socket, PathBuf::from(DEFAULT_SNAPSHOTTER_SOCKET));
    }

    #[test]
    fn mounts_are_checked() {
        let c = Config::from_toml("[[mounts]]\npath = \"/mnt/ds\"\nprefix = \"datasets/x\"\n").unwrap();
        assert_eq!(c.mounts[0].threads, 4);
        assert_eq!(c.mounts[0].part_size, ByteSize::mib(16));
        let e = Config::from_toml("[[mounts]]\npath = \"rel\"\n").unwrap_err();
        assert_eq!(e.key, "mounts[0].path");
        let e = Config::from_toml("[[mounts]]\npath = \"/m\"\npart_size = \"1MiB\"\n").unwrap_err();
        assert_eq!(e.key, "mounts[0].part_size");
        let e = Config::from_toml("[[mounts]]\npath = \"/m\"\nleftovers = \"maybe\"\n").unwrap_err();
        assert_eq!(e.key, "mounts[0].leftovers");
    }

    #[test]
    fn a_warm_tier_in_the_hot_tiers_directory_is_refused_however_it_is_named() {
        for text in [
            "[tiers.hot]\npath = \"/data/t\"\n[tiers.warm]\npath = \"/data/t\"\n",
            "state_dir = \"/data\"\n[tiers.warm]\npath = \"/data/hot\"\n",
            "state_dir = \"/data\"\n[tiers.warm]\npath = \"/data/./hot/\"\n",
            "[tiers.hot]\npath = \"/var/lib/strata/warm\"\n",
        ] {
            let e = Config::from_toml(text).unwrap_err();
            assert_eq!(e.key, "tiers.warm.path", "{text}: {e}");
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("hot")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("hot"), dir.path().join("alias")).unwrap();
        let text = format!(
            "state_dir = \"{}\"\n[tiers.warm]\npath = \"{}\"\n",
            dir.path().display(),
            dir.path().join("alias").display()
        );
        assert_eq!(Config::from_toml(&text).unwrap_err().key, "tiers.warm.path");
        // A link to the hot tier's directory that a first start has yet to create.
        std::os::unix::fs::symlink(dir.path().join("later"), dir.path().join("alias2")).unwrap();
        let text = format!(
            "state_dir = \"{}\"\n[tiers.hot]\npath = \"{}\"\n[tiers.warm]\npath = \"{}\"\n",
            dir.path().display(),
            dir.path().join("later/hot").display(),
            dir.path().join("alias2/hot").display()
        );
        assert_eq!(Config::from_toml(&text).unwrap_err().key, "tiers.warm.path");
        assert!(Config::from_toml("state_dir = \"/data\"\n[tiers.warm]\npath = \"/sas/warm\"\n").is_ok());
        assert!(Config::from_toml("state_dir = \"/data\"\n[tiers.warm]\ncapacity = 0\npath = \"/data/hot\"\n").is_ok());
    }

    #[test]
    fn warm_capacity_zero_disables_warm() {
        let c = Config::from_toml("[tiers.warm]\ncapacity = 0").unwrap();
        assert!(c.cache_config(Policy::default()).warm.is_none());
    }
}
