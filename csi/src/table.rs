//! The volumes this node has published, by target path, and the two calls that change them.
//! Publish and unpublish are idempotent, as kubelet retries both: the same publish again is
//! answered at once, and an unpublish of what is not there is a success. A target that holds
//! another volume, or the same one with other settings, is refused, never remounted.

use crate::volume::{Source, Volume};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use strata_cachefs::mountinfo::is_mount_point;
use strata_cachefs::{DatasetMount, Mounted, mount_dataset};
use strata_tiering::TieredCache;
use strata_tiering::policy::Rule;
use strata_tiering::source::{ColdConfig, ColdKind, ObjectSource};
use tokio::sync::Mutex;
use tracing::{error, info, warn};

/// What the node gives its volumes: its one cache, and its own store, which volumes of the
/// node's bucket without credentials of their own read through (and through the peer tier).
#[derive(Debug, Clone)]
pub struct Host {
    pub cache: TieredCache,
    pub store: ObjectSource,
    pub store_config: ColdConfig,
    /// Volumes' staged writes go under `<state_dir>/csi/staging`.
    pub state_dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("{target} already holds volume {held}{}", if *.same_volume { " with other attributes or access; unpublish it first" } else { "" })]
    Conflict { target: PathBuf, held: String, same_volume: bool },
    #[error("{0} is already a mount point of something other than a Strata volume")]
    Busy(PathBuf),
    #[error("{target} holds volume {held}, not {asked}")]
    OtherVolume { target: PathBuf, held: String, asked: String },
    #[error("the volume's source refused access: {0}")]
    Denied(String),
    #[error("the volume's source cannot be mounted: {0}")]
    Source(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The store a volume reads, the prefix within it, and what its chunk keys' paths start with.
#[derive(Debug)]
struct VolumeStore {
    source: ObjectSource,
    prefix: String,
    key_space: String,
}

#[derive(Debug)]
struct Published {
    volume_id: String,
    fingerprint: String,
    mounted: Mounted,
    rule: Option<Rule>,
}

#[derive(Debug, Clone)]
pub struct Table {
    host: Host,
    published: Arc<Mutex<HashMap<PathBuf, Published>>>,
}

impl Table {
    pub fn new(host: Host) -> Table {
        Table { host, published: Arc::default() }
    }

    pub async fn publish(&self, v: Volume) -> Result<(), PublishError> {
        self.publish_as(v, false).await
    }

    /// Publishes again the volumes published before a restart, from what the descriptor store
    /// kept of them: their mounts (kept too) are taken over, and the pods reading them go on.
    /// kubelet does not publish a volume again by itself.
    pub async fn restore(&self) {
        let Some(resume) = strata_cachefs::resume::get() else { return };
        for (name, bytes) in resume.take_notes(NOTE_PREFIX) {
            let v: Volume = match serde_json::from_slice(&bytes) {
                Ok(v) => v,
                Err(e) => {
                    warn!(name, error = %e, "a kept CSI volume does not parse; dropping it");
                    resume.forget_note(&name);
                    continue;
                }
            };
            let (id, target) = (v.id.clone(), v.target.clone());
            match self.publish_as(v, true).await {
                Ok(()) => {
                    info!(volume = %id, target = %target.display(), "volume of before the restart published again")
                }
                Err(e) => {
                    error!(volume = %id, target = %target.display(), error = %e, "a volume of before the restart cannot be published again");
                    resume.forget_note(&name);
                }
            }
        }
    }

    /// `again`: a publish of before a restart, whose kept mount is at the target.
    async fn publish_as(&self, v: Volume, again: bool) -> Result<(), PublishError> {
        // One call at a time: kubelet's retries of one target must not mount it twice.
        let mut table = self.published.lock().await;
        if let Some(p) = table.get(&v.target) {
            if p.volume_id == v.id && p.fingerprint == v.fingerprint {
                return Ok(());
            }
            let same_volume = p.volume_id == v.id;
            return Err(PublishError::Conflict { target: v.target.clone(), held: p.volume_id.clone(), same_volume });
        }
        if !again && is_mount_point(&v.target) {
            return Err(PublishError::Busy(v.target.clone()));
        }
        let made = !v.target.exists();
        std::fs::create_dir_all(&v.target).map_err(|source| PublishError::Io {
            what: "cannot create the target path",
            path: v.target.clone(),
            source,
        })?;
        let mounted = async { self.mount(&v, self.source_for(&v)?).await }.await;
        let (mounted, chunks_under) = match mounted {
            Ok(m) => m,
            Err(e) => {
                if made {
                    let _ = std::fs::remove_dir(&v.target);
                }
                return Err(e);
            }
        };
        let rule = self.add_rule(&v, &chunks_under);
        if !again && let Some(resume) = strata_cachefs::resume::get() {
            // The request itself, credentials and all, in memory only: kept by the store.
            let kept = serde_json::to_vec(&v)
                .map_err(|e| e.to_string())
                .and_then(|b| resume.keep_note(&note_name(&v.target), &b));
            if let Err(e) = kept {
                warn!(volume = %v.id, error = %e, "cannot keep the volume for a restart; a restart will end it");
            }
        }
        info!(volume = %v.id, target = %v.target.display(), writable = v.writable, "volume published");
        table.insert(v.target.clone(), Published { volume_id: v.id, fingerprint: v.fingerprint, mounted, rule });
        Ok(())
    }

    pub async fn unpublish(&self, volume_id: &str, target: &Path) -> Result<(), PublishError> {
        let mut table = self.published.lock().await;
        if let Some(p) = table.get(target)
            && p.volume_id != volume_id
        {
            return Err(PublishError::OtherVolume {
                target: target.to_owned(),
                held: p.volume_id.clone(),
                asked: volume_id.to_owned(),
            });
        }
        if let Some(p) = table.remove(target) {
            if let Some(rule) = &p.rule {
                self.remove_rule(rule);
            }
            if let Some(resume) = strata_cachefs::resume::get() {
                resume.forget_note(&note_name(target));
            }
            // Detached at once; files still open keep the session (and their staged writes,
            // which upload as they close) until their pod lets go of them.
            let unmounted = tokio::task::spawn_blocking(move || p.mounted.unmount()).await;
            match unmounted {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(target = %target.display(), error = %e, "unmount failed"),
                Err(e) => warn!(target = %target.display(), error = %e, "unmount task failed"),
            }
        } else if is_mount_point(target) {
            // A mount this daemon does not know: one its previous run left. Detached lazily,
            // as the daemon's own unmount does.
            let status = std::process::Command::new("umount").arg("-l").arg(target).status();
            if !status.is_ok_and(|s| s.success()) {
                return Err(PublishError::Busy(target.to_owned()));
            }
        }
        match std::fs::remove_dir(target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(PublishError::Io {
                    what: "cannot remove the target path",
                    path: target.to_owned(),
                    source,
                });
            }
        }
        info!(volume = %volume_id, target = %target.display(), "volume unpublished");
        Ok(())
    }

    /// Mounts `v` over `store`; returns the mount and the path its chunk keys start with.
    async fn mount(&self, v: &Volume, store: VolumeStore) -> Result<(Mounted, String), PublishError> {
        let VolumeStore { source, prefix, key_space } = store;
        let chunks_under = if prefix.is_empty() { key_space.clone() } else { format!("{key_space}{prefix}/") };
        let staging = self.host.state_dir.join("csi").join("staging").join(staging_name(v));
        let spec = DatasetMount {
            path: v.target.clone(),
            prefix,
            key_space,
            read_only: !v.writable,
            metadata_ttl: v.metadata_ttl,
            negative_ttl: v.negative_ttl,
            threads: 4,
            // Pods run as users of their own.
            allow_other: true,
            part_size: 16 << 20,
            upload_parallel: 4,
            staging_dir: staging,
            upload_leftovers: true,
            memory_budget: 256 << 20,
            passthrough: true,
            keep_newest_hot: v.writable,
            checkpoint_window: Duration::from_secs(600),
            snapshot_dir: v.snapshot.then(|| self.host.state_dir.join("snapshots")),
            snapshot_max_age: Duration::from_secs(3600),
        };
        let mounted = mount_dataset(&spec, source, self.host.cache.clone()).await.map_err(|e| {
            let text = e.to_string();
            if denied(&text) { PublishError::Denied(text) } else { PublishError::Source(text) }
        })?;
        Ok((mounted, chunks_under))
    }

    /// The store a volume reads, the prefix within it, and the key space of its chunks. A
    /// volume of the node's own bucket with no credentials of its own shares the node's store
    /// and its chunk names, so it shares chunks with the node's other mounts and its peers.
    fn source_for(&self, v: &Volume) -> Result<VolumeStore, PublishError> {
        let node = &self.host.store_config;
        let mut c = ColdConfig { prefix: String::new(), ..node.clone() };
        match &v.source {
            Source::S3 { bucket, prefix } => {
                if v.credentials.is_none()
                    && node.kind == ColdKind::S3
                    && node.bucket.as_deref() == Some(bucket.as_str())
                    && let Some(within) = under(prefix, &node.prefix)
                {
                    return Ok(VolumeStore {
                        source: self.host.store.clone(),
                        prefix: within,
                        key_space: String::new(),
                    });
                }
                c.kind = ColdKind::S3;
                c.bucket = Some(bucket.clone());
                if let Some(cred) = &v.credentials {
                    c.access_key_id = Some(cred.access_key_id.clone());
                    c.secret_access_key = Some(cred.secret_access_key.clone());
                    c.session_token = cred.session_token.clone();
                    if let Some(e) = &cred.endpoint {
                        c.endpoint = Some(e.clone());
                        c.allow_http = e.starts_with("http://");
                    }
                    if let Some(r) = &cred.region {
                        c.region = Some(r.clone());
                    }
                }
            }
            Source::Local(dir) => {
                if !dir.is_dir() {
                    return Err(PublishError::Source(format!("{} is not a directory", dir.display())));
                }
                c.kind = ColdKind::Local;
                c.path = Some(dir.clone());
            }
        }
        let prefix = match &v.source {
            Source::S3 { prefix, .. } => prefix.clone(),
            Source::Local(_) => String::new(),
        };
        let source = ObjectSource::new(&c, &self.host.state_dir.join("cold"))
            .map_err(|e| PublishError::Source(e.to_string()))?;
        let key_space = format!("{}/", source.describe());
        Ok(VolumeStore { source, prefix, key_space })
    }

    /// The policy rule of `v`'s `pin` or `noCache`, over its chunks, which start with `under`.
    fn add_rule(&self, v: &Volume, under: &str) -> Option<Rule> {
        if v.pin.is_none() && !v.no_cache {
            return None;
        }
        let rule = Rule::for_prefix(under, v.pin, v.no_cache);
        let mut policy = self.host.cache.policy();
        policy.rules.push(rule.clone());
        if let Err(e) = policy.validate() {
            warn!(volume = %v.id, error = %e, "the volume's tiering settings were not applied");
            return None;
        }
        self.host.cache.set_policy(policy);
        Some(rule)
    }

    fn remove_rule(&self, rule: &Rule) {
        let mut policy = self.host.cache.policy();
        if let Some(i) = policy
            .rules
            .iter()
            .position(|r| r.prefix == rule.prefix && r.pin == rule.pin && r.no_cache == rule.no_cache)
        {
            policy.rules.remove(i);
            if policy.validate().is_ok() {
                self.host.cache.set_policy(policy);
            }
        }
    }
}

/// Names of the kept publishes in the descriptor store.
const NOTE_PREFIX: &str = "csi-";

fn note_name(target: &Path) -> String {
    let h = Sha256::digest(target.as_os_str().as_encoded_bytes());
    format!("{NOTE_PREFIX}{}", hex::encode(&h[..12]))
}

/// `prefix` relative to the node store's `root`, if it lies within it.
fn under(prefix: &str, root: &str) -> Option<String> {
    let root = root.trim_matches('/');
    if root.is_empty() {
        return Some(prefix.to_owned());
    }
    match prefix.strip_prefix(root) {
        Some("") => Some(String::new()),
        Some(rest) if rest.starts_with('/') => Some(rest.trim_start_matches('/').to_owned()),
        _ => None,
    }
}

/// A volume's staging dir, by its id and source: a pod that comes back to the same volume
/// after a crash uploads what the last one staged, and no other volume ever does.
fn staging_name(v: &Volume) -> String {
    let mut h = Sha256::new();
    h.update(format!("{}\n{:?}\n", v.id, v.source));
    hex::encode(&h.finalize()[..12])
}

/// Whether a store's error says the credentials were wrong or lack access.
fn denied(text: &str) -> bool {
    ["403", "Forbidden", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "401"]
        .iter()
        .any(|w| text.contains(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_within_the_node_store_only_at_a_segment() {
        assert_eq!(under("a/b", "").as_deref(), Some("a/b"));
        assert_eq!(under("data/x", "data").as_deref(), Some("x"));
        assert_eq!(under("data", "data/").as_deref(), Some(""));
        assert_eq!(under("database/x", "data"), None);
    }

    #[test]
    fn a_store_that_refuses_credentials_is_told_apart() {
        assert!(denied("LIST / on s3://b failed: Client error with status 403 Forbidden: InvalidAccessKeyId"));
        assert!(!denied("LIST / on s3://b failed: connection refused"));
    }
}
