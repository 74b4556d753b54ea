//! The cold store: an S3-compatible bucket (Ceph RGW, AWS S3, MinIO) or a local directory,
//! read through `object_store`, and the fetcher that turns a chunk key into a ranged GET.
//!
//! Object chunks are keyed by ETag, and every ranged GET carries `If-Match` with that ETag, so
//! bytes of a newer version can never be mixed into chunks of an older one.

use crate::cache::Fetcher;
use crate::error::FetchError;
use crate::key::{ChunkKey, Identity};
use crate::partcopy::{CopySource, PartCopier};
use crate::progress::{Progress, Teller};
use crate::requests::{CountingConnector, RequestCounts};
use crate::units::{ByteSize, Dur};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, TryStreamExt};
use object_store::path::Path as ObjPath;
use object_store::{ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, RetryConfig};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ColdKind {
    /// A local directory; the embedded default.
    #[default]
    Local,
    /// An S3-compatible object store.
    S3,
}

/// `[cold]` in the config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ColdConfig {
    #[serde(default)]
    pub kind: ColdKind,
    /// Directory for `kind = "local"`; default `<state_dir>/cold`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket: Option<String>,
    /// Key prefix inside the bucket (or directory) that paths are relative to.
    #[serde(default)]
    pub prefix: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    #[serde(default = "yes")]
    pub path_style: bool,
    #[serde(default)]
    pub allow_http: bool,
    /// PEM file of the CA certificates (one or more) that sign the endpoint's TLS certificate,
    /// trusted besides the system's: an on-premises Ceph's own CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_key_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_access_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_token: Option<String>,
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout: Dur,
    /// Upper bound on one operation, retries included.
    #[serde(default = "default_timeout")]
    pub timeout: Dur,
    #[serde(default = "default_retries")]
    pub retries: usize,
    /// A request that receives nothing for this long (a stalled connection) is cancelled and
    /// retried, inside `timeout`.
    #[serde(default = "default_stall_timeout")]
    pub stall_timeout: Dur,
    /// Chunk size for objects.
    #[serde(default = "default_chunk")]
    pub chunk_size: ByteSize,
    /// The largest object the store copies in one request (S3's limit). A rename of a larger
    /// object that the store refuses to copy at once is copied in parts.
    #[serde(default = "default_single_copy_limit")]
    pub single_copy_limit: ByteSize,
    /// Sign each request's body (its SHA-256) over HTTPS too. Over plain HTTP it always is.
    #[serde(default)]
    pub sign_payload: bool,
}

fn yes() -> bool {
    true
}
fn default_connect_timeout() -> Dur {
    Dur::secs(5)
}
fn default_timeout() -> Dur {
    Dur::secs(30)
}
fn default_retries() -> usize {
    3
}
fn default_stall_timeout() -> Dur {
    Dur::secs(10)
}
fn default_chunk() -> ByteSize {
    ByteSize::mib(1)
}

fn default_single_copy_limit() -> ByteSize {
    ByteSize::gib(5)
}

impl ColdConfig {
    /// Whether requests to `endpoint` (none: AWS) leave their body out of the signature. Over
    /// TLS, a body's SHA-256 in the signature guards nothing that TLS does not already, and
    /// costs a fifth of the mount's CPU in a checkpoint's upload: it is left out there, as
    /// AWS's own SDKs do. Over plain HTTP it is the body's only check, and kept.
    pub fn unsigned_payload(&self, endpoint: Option<&str>) -> bool {
        let tls = endpoint.is_none_or(|e| e.starts_with("https://"));
        tls && !self.sign_payload
    }
}

impl Default for ColdConfig {
    fn default() -> Self {
        toml::from_str("").expect("empty cold config takes every default")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{key}: {message}")]
    Config { key: String, message: String },
    #[error("{op} {path} on {store} failed: {}", with_causes(source.as_ref()))]
    Request { op: &'static str, path: String, store: String, source: Box<object_store::Error> },
    #[error("{op} {path} on {store} timed out after {after}")]
    Timeout { op: &'static str, path: String, store: String, after: Dur },
    #[error("{path} on {store} changed while being read (ETag is no longer {version}); reopen it")]
    Changed { path: String, store: String, version: String },
    #[error("{path} on {store}: expected {expected} bytes at offset {offset}, got {got}")]
    Short { path: String, store: String, offset: u64, expected: u64, got: u64 },
    #[error("chunk key {0} is not an object chunk")]
    NotObjectKey(String),
    #[error("copying to {to} in parts failed: {message}")]
    CopyParts { to: String, message: String },
    #[error("local file {path}: {source}")]
    Local { path: String, source: std::io::Error },
    /// A listing that failed for every node waiting on it: the first one's error, as text.
    #[error("listing {dir}: {message}")]
    Listing { dir: String, message: String },
}

/// An error with the causes its message leaves out: `object_store` says "error sending
/// request" where the cause is, say, an untrusted TLS certificate.
fn with_causes(e: &object_store::Error) -> String {
    let mut out = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// Why the store's HTTP client could not be built. The TLS set-up loads the system's CA
/// certificates even for a plain-HTTP endpoint, and a minimal container image has none.
fn client_error(e: &object_store::Error) -> String {
    let text = with_causes(e);
    if text.contains("certificate") {
        format!(
            "{text} (install the system's CA certificates, Debian's ca-certificates, or name them with cold.ca_file)"
        )
    } else {
        text
    }
}

impl SourceError {
    /// The store said the object does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, SourceError::Request { source, .. } if matches!(**source, object_store::Error::NotFound { .. }))
    }
}

/// One object as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectInfo {
    /// Key relative to the source prefix.
    pub path: String,
    pub size: u64,
    pub version: String,
    #[serde(default = "epoch")]
    pub modified: std::time::SystemTime,
}

fn epoch() -> std::time::SystemTime {
    std::time::SystemTime::UNIX_EPOCH
}

/// The most parts S3 takes in one multipart upload.
pub const MAX_PARTS: u64 = 10_000;

/// The cold store of one bucket prefix or directory.
#[derive(Debug, Clone)]
pub struct ObjectSource {
    pub(crate) store: Arc<dyn ObjectStore>,
    describe: String,
    prefix: String,
    chunk_size: u64,
    timeout: Dur,
    /// The directory of a local store: its directories exist even when empty.
    local_root: Option<std::path::PathBuf>,
    /// The most parts one multipart upload may have: S3's 10,000.
    max_parts: u64,
    /// The S3 client behind `store`, for what `object_store` offers only on it.
    pub(crate) s3: Option<Arc<object_store::aws::AmazonS3>>,
    /// Copies in parts, for an S3 store.
    pub(crate) parts: Option<Arc<PartCopier>>,
    /// Every HTTP request sent to the store, by method and outcome.
    requests: RequestCounts,
    /// The peer tier, asked before the store on a miss when the node has members.
    peers: Option<Arc<crate::peer::PeerTier>>,
    /// The listings this node made as their directories' owner in the peer tier.
    listings: Arc<crate::peer::meta::MetaCache>,
}

impl ObjectSource {
    /// Builds the client. `default_dir` is used for a local store without a `path`.
    pub fn new(c: &ColdConfig, default_dir: &std::path::Path) -> Result<ObjectSource, SourceError> {
        let cfg_err = |key: &str, message: String| SourceError::Config { key: format!("cold.{key}"), message };
        if c.chunk_size.0 < 4096 || c.chunk_size.0 > 256 << 20 {
            return Err(cfg_err("chunk_size", "must be between 4KiB and 256MiB".into()));
        }
        if c.single_copy_limit.0 < 5 << 20 {
            return Err(cfg_err("single_copy_limit", "must be at least 5MiB, S3's smallest part".into()));
        }
        let mut parts = None;
        let mut s3_client = None;
        let requests = RequestCounts::default();
        let prefix = c.prefix.trim_matches('/').to_string();
        let (store, describe): (Arc<dyn ObjectStore>, String) = match c.kind {
            ColdKind::Local => {
                let dir = c.path.clone().unwrap_or_else(|| default_dir.to_path_buf());
                std::fs::create_dir_all(&dir)
                    .map_err(|e| cfg_err("path", format!("cannot create {}: {e}", dir.display())))?;
                // Directories go with their last file, as prefixes do on S3: an emptied directory
                // would otherwise still be listed after its files were removed or renamed. An
                // object is synced to disk, with its directory, before its write returns: a
                // mount's fsync answers once the object is durable, and over this store that
                // means on disk, not in the page cache.
                let fs = object_store::local::LocalFileSystem::new_with_prefix(&dir)
                    .map_err(|e| cfg_err("path", e.to_string()))?
                    .with_automatic_cleanup(true)
                    .with_fsync(true);
                (Arc::new(fs), format!("local dir {}", dir.display()))
            }
            ColdKind::S3 => {
                let bucket = c
                    .bucket
                    .clone()
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| cfg_err("bucket", "is required when cold.kind = \"s3\"".into()))?;
                let mut b = object_store::aws::AmazonS3Builder::from_env().with_bucket_name(&bucket);
                if let Some(e) = &c.endpoint {
                    if !(e.starts_with("http://") || e.starts_with("https://")) {
                        return Err(cfg_err("endpoint", format!("`{e}` must start with http:// or https://")));
                    }
                    if e.starts_with("http://") && !c.allow_http {
                        return Err(cfg_err(
                            "allow_http",
                            format!("must be true to use the plain-http endpoint `{e}`"),
                        ));
                    }
                    b = b.with_endpoint(e);
                }
                if let Some(r) = &c.region {
                    b = b.with_region(r);
                }
                if let Some(k) = &c.access_key_id {
                    b = b.with_access_key_id(k);
                }
                if let Some(k) = &c.secret_access_key {
                    b = b.with_secret_access_key(k);
                }
                if let Some(t) = &c.session_token {
                    b = b.with_token(t);
                }
                // Without keys, the client would go on to ask the cloud's instance-metadata
                // address, which only makes sense on AWS itself; an RGW user gets a clear error.
                if let Some(e) = &c.endpoint
                    && b.get_config_value(&object_store::aws::AmazonS3ConfigKey::AccessKeyId).is_none()
                {
                    return Err(cfg_err(
                        "access_key_id",
                        format!(
                            "no credentials for the endpoint `{e}`: set cold.access_key_id and \
                             cold.secret_access_key, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
                        ),
                    ));
                }
                if c.stall_timeout.0.is_zero() {
                    return Err(cfg_err("stall_timeout", "must be above 0".into()));
                }
                // At most half the operation's bound, so that a stall shows in time for a retry
                // inside it.
                let stall = c.stall_timeout.0.min(c.timeout.0 / 2);
                let mut opts = ClientOptions::new()
                    .with_connect_timeout(c.connect_timeout.0)
                    .with_timeout(c.timeout.0)
                    .with_read_timeout(stall);
                if let Some(path) = &c.ca_file {
                    let pem = std::fs::read(path)
                        .map_err(|e| cfg_err("ca_file", format!("cannot read {}: {e}", path.display())))?;
                    let certs = object_store::Certificate::from_pem_bundle(&pem)
                        .ok()
                        .filter(|c| !c.is_empty())
                        .ok_or_else(|| cfg_err("ca_file", format!("{} holds no PEM certificate", path.display())))?;
                    for cert in certs {
                        opts = opts.with_root_certificate(cert);
                    }
                }
                // The endpoint as the client resolved it: `AWS_ENDPOINT` may have set it.
                let endpoint = b.get_config_value(&object_store::aws::AmazonS3ConfigKey::Endpoint);
                // with_client_options replaces the whole option set, allow_http included, so it
                // must come before with_allow_http.
                b = b
                    .with_http_connector(CountingConnector { counts: requests.clone() })
                    .with_unsigned_payload(c.unsigned_payload(endpoint.as_deref()))
                    .with_client_options(opts.clone())
                    .with_allow_http(c.allow_http)
                    .with_virtual_hosted_style_request(!c.path_style)
                    .with_retry(RetryConfig {
                        max_retries: c.retries,
                        retry_timeout: c.timeout.0,
                        backoff: Default::default(),
                    });
                use object_store::aws::AmazonS3ConfigKey as Key;
                let region = b.get_config_value(&Key::Region).unwrap_or_else(|| "us-east-1".into());
                let bucket_url = match (b.get_config_value(&Key::Endpoint), c.path_style) {
                    (Some(e), true) => format!("{}/{bucket}", e.trim_end_matches('/')),
                    (Some(e), false) => e.trim_end_matches('/').to_string(),
                    (None, true) => format!("https://s3.{region}.amazonaws.com/{bucket}"),
                    (None, false) => format!("https://{bucket}.s3.{region}.amazonaws.com"),
                };
                let whole_copies = crate::partcopy::may_copy_whole(&b);
                let s3 = Arc::new(b.build().map_err(|e| cfg_err("bucket", client_error(&e)))?);
                let opts = opts.with_allow_http(c.allow_http);
                let connector = CountingConnector { counts: requests.clone() };
                let copier = PartCopier::new(s3.clone(), &connector, &opts, bucket_url, region, whole_copies, c)
                    .map_err(|e| cfg_err("endpoint", client_error(&e)))?;
                parts = Some(Arc::new(copier));
                s3_client = Some(s3.clone());
                let at = c.endpoint.clone().unwrap_or_else(|| "AWS S3".into());
                // The prefix too: a mount's namespace snapshot is keyed by this, and two
                // prefixes of one bucket must not share one.
                let under = if prefix.is_empty() { String::new() } else { format!("/{prefix}") };
                (s3, format!("s3://{bucket}{under} at {at}"))
            }
        };
        let local_root = match c.kind {
            ColdKind::Local => Some(c.path.clone().unwrap_or_else(|| default_dir.to_path_buf())),
            ColdKind::S3 => None,
        };
        Ok(ObjectSource {
            store,
            describe,
            prefix,
            chunk_size: c.chunk_size.0,
            timeout: c.timeout,
            local_root,
            max_parts: MAX_PARTS,
            s3: s3_client,
            parts,
            requests,
            peers: None,
            listings: Arc::default(),
        })
    }

    /// This source with the peer tier `tier` before the store: a miss asks the chunk's owner
    /// first.
    pub fn with_peers(mut self, tier: Arc<crate::peer::PeerTier>) -> ObjectSource {
        self.peers = Some(tier);
        self
    }

    pub fn peers(&self) -> Option<&Arc<crate::peer::PeerTier>> {
        self.peers.as_ref()
    }

    /// The listings this node made as their directories' owner, shared with its peer port.
    pub fn listings(&self) -> Arc<crate::peer::meta::MetaCache> {
        self.listings.clone()
    }

    /// The HTTP requests sent to the store so far, by method and outcome (none for a local
    /// store), for the metrics.
    pub fn requests(&self) -> RequestCounts {
        self.requests.clone()
    }

    /// Where the bytes come from, for messages and as the key of a mount's namespace
    /// snapshot: `s3://bucket/prefix at http://host:port`.
    pub fn describe(&self) -> &str {
        &self.describe
    }

    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// The most parts one multipart upload may have.
    pub fn max_parts(&self) -> u64 {
        self.max_parts
    }

    /// Lowers the part count limit, so tests reach it with small files.
    pub fn with_max_parts(mut self, n: u64) -> Self {
        self.max_parts = n.max(1);
        self
    }

    pub fn store(&self) -> Arc<dyn ObjectStore> {
        self.store.clone()
    }

    pub(crate) fn location(&self, path: &str) -> ObjPath {
        let path = path.trim_start_matches('/');
        let key = if self.prefix.is_empty() { path.to_string() } else { format!("{}/{path}", self.prefix) };
        // The key as it is. `ObjPath::from` escapes `~`, `%`, `?`, `#`, `[`, `*` and more
        // (`~` as `%7E`), so an object named `img[1].jpg` could not be read, and a file written
        // as `ckpt~1` would land under another key than its name. Only a key `ObjPath` cannot
        // hold as it is (an empty segment, `.`, a control character) keeps the escaped form.
        ObjPath::parse(&key).unwrap_or_else(|_| ObjPath::from(key))
    }

    fn relative(&self, loc: &ObjPath) -> String {
        let s = loc.as_ref();
        if self.prefix.is_empty() {
            s.to_string()
        } else {
            s.strip_prefix(&self.prefix).unwrap_or(s).trim_start_matches('/').to_string()
        }
    }

    pub(crate) async fn bounded<T>(
        &self,
        op: &'static str,
        path: &str,
        f: impl Future<Output = object_store::Result<T>>,
    ) -> Result<T, SourceError> {
        match tokio::time::timeout(self.timeout.0 + Duration::from_secs(1), f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(source)) => Err(SourceError::Request {
                op,
                path: path.to_string(),
                store: self.describe.clone(),
                source: Box::new(source),
            }),
            Err(_) => Err(SourceError::Timeout {
                op,
                path: path.to_string(),
                store: self.describe.clone(),
                after: self.timeout,
            }),
        }
    }

    /// Lists every object whose key starts with `prefix` (relative to the source prefix).
    pub async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, SourceError> {
        // object_store lists by whole path segments; filter the partial last segment ourselves.
        let dir = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        let loc = if dir.is_empty() && self.prefix.is_empty() { None } else { Some(self.location(dir)) };
        let listing = self.store.list(loc.as_ref()).map(|r| r.map(|m| self.info(m))).try_collect::<Vec<_>>();
        let mut out: Vec<ObjectInfo> = self
            .bounded("LIST", prefix, listing)
            .await?
            .into_iter()
            .filter(|o| o.path.starts_with(prefix.trim_start_matches('/')))
            .collect();
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    fn info(&self, m: object_store::ObjectMeta) -> ObjectInfo {
        let version = m
            .e_tag
            .clone()
            .or(m.version.clone())
            .unwrap_or_else(|| format!("{}-{}", m.last_modified.timestamp_nanos_opt().unwrap_or(0), m.size));
        ObjectInfo { path: self.relative(&m.location), size: m.size, version, modified: m.last_modified.into() }
    }

    /// One level of the `/`-delimited tree under `dir` (relative, no trailing slash; "" for the
    /// top): the names of sub-directories, and the objects directly inside.
    pub async fn list_dir(&self, dir: &str) -> Result<(Vec<String>, Vec<ObjectInfo>), SourceError> {
        let dir = dir.trim_matches('/');
        let loc = if dir.is_empty() && self.prefix.is_empty() { None } else { Some(self.location(dir)) };
        let r = self.bounded("LIST", dir, self.store.list_with_delimiter(loc.as_ref())).await?;
        let dirs = r.common_prefixes.iter().filter_map(|p| p.filename().map(str::to_string)).collect();
        let objects = r.objects.into_iter().map(|m| self.info(m)).collect();
        Ok((dirs, objects))
    }

    pub async fn head(&self, path: &str) -> Result<ObjectInfo, SourceError> {
        let loc = self.location(path);
        let meta = self.bounded("HEAD", path, self.store.head(&loc)).await?;
        Ok(self.info(meta))
    }

    /// Whether any object lies under `dir/`: one page of a listing, not all of it.
    pub async fn exists_under(&self, dir: &str) -> Result<bool, SourceError> {
        let loc = self.location(dir.trim_matches('/'));
        if let Some(root) = &self.local_root {
            return Ok(root.join(loc.as_ref()).is_dir());
        }
        let mut stream = self.store.list(Some(&loc));
        let first = self.bounded("LIST", dir, async move { stream.next().await.transpose() }).await?;
        Ok(first.is_some())
    }

    /// Checks the store answers, for a clear message at start-up.
    pub async fn probe(&self) -> Result<(), SourceError> {
        let loc = if self.prefix.is_empty() { None } else { Some(self.location("")) };
        let first = self.store.list(loc.as_ref()).take(1).try_collect::<Vec<_>>();
        self.bounded("LIST", "/", first).await.map(|_| ())
    }

    /// The chunk keys of an object, in order.
    pub fn chunk_keys(&self, o: &ObjectInfo) -> Vec<ChunkKey> {
        let n = o.size.div_ceil(self.chunk_size);
        (0..n).map(|i| ChunkKey::object(&o.path, &o.version, i, self.chunk_size)).collect()
    }

    /// Reads `len` bytes at `offset` of one version of an object, `size` bytes long. A read of
    /// all of it goes without a `Range`: Ceph RGW spends about a quarter more CPU on a ranged
    /// GET than on a plain one, which on a dataset of small files (one chunk each) is most of
    /// what it does. `If-Match` and the length check hold either way. `progress` is told of
    /// the body's pieces as they arrive; it gets no check, the answer does.
    pub async fn get_version(
        &self,
        path: &str,
        version: &str,
        (offset, len, size): (u64, u64, u64),
        progress: Option<&Progress>,
    ) -> Result<Bytes, SourceError> {
        let loc = self.location(path);
        let whole = offset == 0 && len == size;
        let opts = GetOptions {
            range: (!whole).then_some(GetRange::Bounded(offset..offset + len)),
            if_match: Some(version.to_string()),
            ..Default::default()
        };
        let get = async {
            let r = self.store.get_opts(&loc, opts).await?;
            let Some(progress) = progress else { return r.bytes().await };
            let mut body = r.into_stream();
            let mut whole = bytes::BytesMut::with_capacity(len as usize);
            let mut teller = Teller::new(Some(progress), 0);
            loop {
                // What is already in is taken at once; what has been taken is told before a wait.
                let next = match body.try_next().now_or_never() {
                    Some(next) => next,
                    None => {
                        teller.tell(&whole);
                        body.try_next().await
                    }
                };
                let Some(piece) = next? else { break };
                whole.extend_from_slice(&piece);
                teller.grew(&whole);
            }
            teller.tell(&whole);
            Ok(whole.freeze())
        };
        let bytes = match self.bounded("GET", path, get).await {
            Err(SourceError::Request { source, .. }) if matches!(*source, object_store::Error::Precondition { .. }) => {
                return Err(SourceError::Changed {
                    path: path.to_string(),
                    store: self.describe.clone(),
                    version: version.to_string(),
                });
            }
            r => r?,
        };
        if bytes.len() as u64 != len {
            return Err(SourceError::Short {
                path: path.to_string(),
                store: self.describe.clone(),
                offset,
                expected: len,
                got: bytes.len() as u64,
            });
        }
        Ok(bytes)
    }

    /// A fetcher for chunks of one object version: through the peer tier when the node has
    /// one, else from the store.
    pub fn fetcher(&self, o: &ObjectInfo) -> Arc<dyn Fetcher> {
        let origin = self.origin_fetcher(o);
        match &self.peers {
            Some(tier) => tier.wrap(origin, o.size),
            None => origin,
        }
    }

    /// A fetcher for chunks of one object version from the store itself: what a node serving
    /// its peers uses, so that a request never goes round the members.
    pub fn origin_fetcher(&self, o: &ObjectInfo) -> Arc<dyn Fetcher> {
        Arc::new(ObjectFetcher { source: self.clone(), path: o.path.clone(), size: o.size })
    }

    pub async fn put(&self, path: &str, data: Bytes) -> Result<(), SourceError> {
        let loc = self.location(path);
        self.bounded("PUT", path, self.store.put(&loc, data.into())).await.map(|_| ())
    }

    /// Uploads a local file as the object at `path`: one PUT up to `part_size`, a multipart
    /// upload above it with `parallel` parts in flight, in parts of `part_size` or, for a file
    /// too large for that many parts, of its size over the part limit. Either way the object
    /// appears only once it is complete, and a failed multipart upload is aborted. Returns the
    /// new object's info, as [`ObjectSource::written`] tells it. `on_start` gets the ID of a multipart upload before its first
    /// part goes, so that the caller can keep it and abort the upload after a crash.
    pub async fn upload_file(
        &self,
        path: &str,
        file: &std::path::Path,
        part_size: usize,
        parallel: usize,
        on_start: impl FnOnce(&str),
    ) -> Result<ObjectInfo, SourceError> {
        use tokio::io::AsyncReadExt;
        let loc = self.location(path);
        let io_err = |e: std::io::Error| SourceError::Local { path: file.display().to_string(), source: e };
        let mut f = tokio::fs::File::open(file).await.map_err(io_err)?;
        let len = f.metadata().await.map_err(io_err)?.len();
        let part_size = (part_size as u64).max(len.div_ceil(self.max_parts)) as usize;
        if len <= part_size as u64 {
            let mut buf = Vec::with_capacity(len as usize);
            f.read_to_end(&mut buf).await.map_err(io_err)?;
            let put = self.bounded("PUT", path, self.store.put(&loc, Bytes::from(buf).into())).await?;
            self.written(path, len, put.e_tag).await
        } else {
            let mut upload = self.begin_upload(path).await?;
            if let Some(id) = upload.id() {
                on_start(id);
            }
            let mut left = len;
            while left > 0 {
                // Each part is read into its own buffer and handed over whole, without a copy.
                let mut buf = vec![0u8; (part_size as u64).min(left) as usize];
                let n = read_full(&mut f, &mut buf).await.map_err(io_err)?;
                if n < buf.len() {
                    let short = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "file shrank while uploading");
                    upload.abort().await;
                    return Err(io_err(short));
                }
                upload.wait_for_room(parallel).await?;
                upload.put_part(Bytes::from(buf));
                left -= n as u64;
            }
            upload.complete().await
        }
    }

    /// What the object this client just wrote at `path` (`len` bytes, answered with `e_tag`)
    /// is. A `HEAD` gives its time, and its ETag where the write's answer had none (some stores
    /// answer a completed multipart upload so). But another client may replace or delete the
    /// object between the write and the `HEAD`: the `HEAD` then describes bytes this client
    /// never had, and whoever caches the written bytes under its version would serve them as
    /// that other object. So where the answers disagree, the write's own ETag wins.
    pub(crate) async fn written(&self, path: &str, len: u64, e_tag: Option<String>) -> Result<ObjectInfo, SourceError> {
        let ours = e_tag.filter(|t| !t.is_empty());
        let now = |version: String| ObjectInfo {
            path: path.to_string(),
            size: len,
            version,
            modified: std::time::SystemTime::now(),
        };
        match (self.head(path).await, ours) {
            (Ok(head), Some(ours)) if head.version != ours => {
                tracing::debug!(path, %ours, now = %head.version, "the object was replaced right after this write");
                Ok(now(ours))
            }
            (Err(e), Some(ours)) if e.is_not_found() => {
                tracing::debug!(path, %ours, "the object was deleted right after this write");
                Ok(now(ours))
            }
            (head, _) => head,
        }
    }

    /// Deletes `path`. An object already gone counts as deleted, as S3 itself answers.
    pub async fn delete(&self, path: &str) -> Result<(), SourceError> {
        let loc = self.location(path);
        match self.bounded("DELETE", path, self.store.delete(&loc)).await {
            Err(e) if e.is_not_found() => Ok(()),
            done => done,
        }
    }

    /// Deletes `paths`, in batches of 1,000, which S3 stores delete in one request each
    /// (DeleteObjects); each batch is bounded by the timeout. An object already gone counts as
    /// deleted. Returns the first failure, with its path.
    pub async fn delete_many(&self, paths: &[String]) -> Result<(), (String, SourceError)> {
        for batch in paths.chunks(1000) {
            let locs: Vec<object_store::Result<ObjPath>> = batch.iter().map(|p| Ok(self.location(p))).collect();
            let deleting = self.store.delete_stream(futures::stream::iter(locs).boxed()).collect::<Vec<_>>();
            let results =
                self.bounded("DELETE", &batch[0], deleting.map(Ok)).await.map_err(|e| (batch[0].clone(), e))?;
            for (path, r) in batch.iter().zip(results) {
                match r {
                    Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(source) => {
                        let store = self.describe.clone();
                        let e =
                            SourceError::Request { op: "DELETE", path: path.clone(), store, source: Box::new(source) };
                        return Err((path.clone(), e));
                    }
                }
            }
        }
        Ok(())
    }

    /// Server-side copy, then delete of the source: what S3 offers for a rename. `known` is
    /// what the caller last saw of `from`, as for [`ObjectSource::copy_known`].
    pub async fn rename(&self, from: &str, to: &str, known: &ObjectInfo) -> Result<ObjectInfo, SourceError> {
        let info = self.copy_known(from, to, known).await?;
        self.delete(from).await?;
        Ok(info)
    }

    /// Server-side copy, replacing `to`. One request; an object over `single_copy_limit` that
    /// the store refuses to copy at once is copied in parts. Stores that copy any size at once,
    /// as Ceph RGW does without moving the data, keep the single request.
    pub async fn copy(&self, from: &str, to: &str) -> Result<(), SourceError> {
        let (a, b) = (self.location(from), self.location(to));
        if let Err(refused) = self.bounded("COPY", from, self.store.copy(&a, &b)).await {
            self.copy_in_parts(from, &a, &b, refused).await?;
        }
        Ok(())
    }

    /// Server-side copy of `from`, as a listing described it (`known`), to `to`, replacing it.
    /// Returns what the new object is. On S3, the `CopyObject` answer carries the new ETag:
    /// when it is the listed one, the copy is of the listed version, whose size is known, and
    /// no `HEAD` follows, which makes a directory rename of many small objects a third fewer
    /// requests. A single copy is atomic, so the new object is one version of the source
    /// either way; if its ETag differs (the source was replaced since the listing), or the
    /// copy does not go through that way, the plain copy and a `HEAD` decide.
    pub async fn copy_known(&self, from: &str, to: &str, known: &ObjectInfo) -> Result<ObjectInfo, SourceError> {
        let (a, b) = (self.location(from), self.location(to));
        if let Some(parts) = &self.parts
            && parts.whole_copies
            && known.size <= parts.single_limit
        {
            // No condition on the source's ETag: RGW (16.2) reads it from a header of its own
            // name and ignores S3's, so the answer's ETag is what is checked instead.
            let src = CopySource { loc: &a, size: known.size, etag: "" };
            match parts.copy_object(&src, &b).await {
                Ok(Some((version, modified))) if version == known.version => {
                    return Ok(ObjectInfo { path: to.to_string(), size: known.size, version, modified });
                }
                Ok(answer) => {
                    let copied = answer.map(|(v, _)| v).unwrap_or_default();
                    tracing::debug!(from, to, listed = %known.version, %copied, "the copy is not of the listed version, or did not say; reading it back");
                    return self.head(to).await;
                }
                Err((message, _)) => {
                    tracing::debug!(from, to, %message, "the copy with its answer read did not go through; copying again");
                }
            }
        }
        self.copy(from, to).await?;
        self.head(to).await
    }

    /// After the store refused a single copy: the copy in parts, if the object is over the
    /// limit; the refusal otherwise.
    async fn copy_in_parts(
        &self,
        from: &str,
        a: &ObjPath,
        b: &ObjPath,
        refused: SourceError,
    ) -> Result<(), SourceError> {
        let Some(parts) = &self.parts else { return Err(refused) };
        if matches!(refused, SourceError::Timeout { .. }) || refused.is_not_found() {
            return Err(refused);
        }
        let src = self.head(from).await?;
        if src.size <= parts.single_limit {
            return Err(refused);
        }
        tracing::info!(from, to = %b, size = src.size, refused = %refused, "the store refused to copy the object in one request; copying it in parts");
        parts.copy(self, CopySource { loc: a, size: src.size, etag: &src.version }, b).await
    }
}

#[derive(Debug)]
struct ObjectFetcher {
    source: ObjectSource,
    /// The object's key in the store: a chunk's key may name it in a key space of its own.
    path: String,
    size: u64,
}

impl Fetcher for ObjectFetcher {
    fn fetch(&self, key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        self.get(key, None)
    }

    fn fetch_streaming(&self, key: &ChunkKey, progress: Progress) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        self.get(key, Some(progress))
    }
}

impl ObjectFetcher {
    fn get(&self, key: &ChunkKey, progress: Option<Progress>) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let (source, path, size) = (self.source.clone(), self.path.clone(), self.size);
        let key = key.clone();
        async move {
            let Identity::Object { version, index, chunk_size } = &key.identity else {
                return Err(Arc::new(SourceError::NotObjectKey(key.to_string())) as FetchError);
            };
            let offset = index * chunk_size;
            let len = (*chunk_size).min(size.saturating_sub(offset));
            let got = source.get_version(&path, version, (offset, len, size), progress.as_ref()).await;
            got.map_err(|e| Arc::new(e) as FetchError)
        }
        .boxed()
    }
}

/// Reads until `buf` is full or the file ends.
async fn read_full(f: &mut tokio::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use tokio::io::AsyncReadExt;
    let mut n = 0;
    while n < buf.len() {
        let r = f.read(&mut buf[n..]).await?;
        if r == 0 {
            break;
        }
        n += r;
    }
    Ok(n)
}

mod cluster_meta;
pub use cluster_meta::Stat;
#[cfg(test)]
mod written_tests;
