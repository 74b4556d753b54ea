//! What a publish asks for, read from the CSI request: the volume's source, whether it is
//! writable, its metadata and tiering settings (the volume attributes of a PersistentVolume or
//! an inline `csi:` volume), and the credentials of its `nodePublishSecretRef` Secret.

use crate::proto::NodePublishVolumeRequest;
use crate::proto::volume_capability::access_mode::Mode;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;
use strata_tiering::TierKind;
use strata_tiering::units::Dur;

/// Attribute keys that kubelet adds itself (pod name, namespace, whether the volume is inline).
const KUBELET_KEYS: &str = "csi.storage.k8s.io/";

/// The volume attributes a user may set, with what each holds.
pub const ATTRIBUTES: [(&str, &str); 7] = [
    ("source", "s3://bucket/prefix, or an absolute local directory (required)"),
    ("metadataTTL", "how long listings and attributes are trusted (default 60s)"),
    ("negativeTTL", "how long a missing name is answered as missing (default 5s)"),
    ("immutable", "\"true\": the data never changes while mounted; trust listings for the mount's life"),
    ("snapshot", "\"true\": start from one listing of the whole prefix, shared by the node's mounts"),
    ("pin", "\"hot\" or \"warm\": keep the volume's chunks in that tier"),
    ("noCache", "\"true\": read through, keeping nothing in the tiers"),
];

/// The keys a volume's Secret may hold.
pub const SECRET_KEYS: [&str; 5] = ["accessKeyId", "secretAccessKey", "sessionToken", "endpoint", "region"];

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Source {
    S3 { bucket: String, prefix: String },
    Local(PathBuf),
}

/// A volume's own credentials. Kept in memory only (this process's, and the descriptor
/// store's across a restart), and never printed.
#[derive(Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
    pub endpoint: Option<String>,
    pub region: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials").field("endpoint", &self.endpoint).finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Volume {
    pub id: String,
    pub target: PathBuf,
    pub source: Source,
    pub writable: bool,
    /// `None`: the data is immutable, listings are trusted for the mount's life.
    pub metadata_ttl: Option<Duration>,
    pub negative_ttl: Duration,
    pub snapshot: bool,
    pub pin: Option<TierKind>,
    pub no_cache: bool,
    pub credentials: Option<Credentials>,
    /// What a second publish at the same target must match to be the same publish: the
    /// volume, its attributes and its access, not its Secret (which may have been rotated).
    pub fingerprint: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VolumeError {
    #[error("{0} is required")]
    Missing(&'static str),
    #[error("volume attribute `{key}`: {message}")]
    Attribute { key: String, message: String },
    #[error(
        "unknown volume attribute `{0}`; known: source, metadataTTL, negativeTTL, immutable, snapshot, pin, noCache"
    )]
    UnknownAttribute(String),
    #[error(
        "unknown key `{0}` in the volume's Secret; known: accessKeyId, secretAccessKey, sessionToken, endpoint, region"
    )]
    UnknownSecret(String),
    #[error("the volume's Secret has {0} but not {1}")]
    HalfSecret(&'static str, &'static str),
    #[error("target_path {0} must be an absolute path")]
    Target(String),
    #[error("only filesystem volumes are served: a block volume cannot be a bucket prefix")]
    Block,
    #[error("a local directory source cannot take credentials")]
    LocalWithSecret,
}

impl Volume {
    pub fn from_request(req: &NodePublishVolumeRequest) -> Result<Volume, VolumeError> {
        if req.volume_id.is_empty() {
            return Err(VolumeError::Missing("volume_id"));
        }
        if req.target_path.is_empty() {
            return Err(VolumeError::Missing("target_path"));
        }
        let target = PathBuf::from(&req.target_path);
        if !target.is_absolute() || target.components().any(|c| c == std::path::Component::ParentDir) {
            return Err(VolumeError::Target(req.target_path.clone()));
        }
        let cap = req.volume_capability.as_ref().ok_or(VolumeError::Missing("volume_capability"))?;
        if matches!(cap.access_type, Some(crate::proto::volume_capability::AccessType::Block(_))) {
            return Err(VolumeError::Block);
        }
        let mode = cap.access_mode.as_ref().map(|m| m.mode()).unwrap_or(Mode::Unknown);
        let writer = matches!(
            mode,
            Mode::SingleNodeWriter
                | Mode::MultiNodeSingleWriter
                | Mode::MultiNodeMultiWriter
                | Mode::SingleNodeSingleWriter
                | Mode::SingleNodeMultiWriter
        );
        let writable = writer && !req.readonly;
        let attrs: BTreeMap<&str, &str> = req
            .volume_context
            .iter()
            .filter(|(k, _)| !k.starts_with(KUBELET_KEYS))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        if let Some(k) = attrs.keys().find(|k| !ATTRIBUTES.iter().any(|(a, _)| a == *k)) {
            return Err(VolumeError::UnknownAttribute(k.to_string()));
        }
        let bad = |key: &str, message: String| VolumeError::Attribute { key: key.to_owned(), message };
        let source =
            parse_source(attrs.get("source").copied().ok_or(VolumeError::Missing("volume attribute `source`"))?)
                .map_err(|m| bad("source", m))?;
        let flag = |key: &str| match attrs.get(key).copied() {
            None | Some("false") => Ok(false),
            Some("true") => Ok(true),
            Some(v) => Err(bad(key, format!("`{v}` is not \"true\" or \"false\""))),
        };
        let duration = |key: &str, default: u64| match attrs.get(key) {
            None => Ok(Duration::from_secs(default)),
            Some(v) => Dur::parse(v).map(|d| d.0).map_err(|m| bad(key, m)),
        };
        let immutable = flag("immutable")?;
        let metadata_ttl = duration("metadataTTL", 60)?;
        let pin = match attrs.get("pin").copied() {
            None => None,
            Some("hot") => Some(TierKind::Hot),
            Some("warm") => Some(TierKind::Warm),
            Some(v) => return Err(bad("pin", format!("`{v}` is not \"hot\" or \"warm\""))),
        };
        let no_cache = flag("noCache")?;
        if no_cache && pin.is_some() {
            return Err(bad("noCache", "a volume cannot both be pinned and not cached".into()));
        }
        let credentials = credentials(&req.secrets)?;
        if credentials.is_some() && matches!(source, Source::Local(_)) {
            return Err(VolumeError::LocalWithSecret);
        }
        let mut print = Sha256::new();
        for (k, v) in &attrs {
            print.update(format!("{}={}\n", k.len(), k));
            print.update(format!("{}={}\n", v.len(), v));
        }
        print.update(format!("id={}\nwritable={writable}\n", req.volume_id));
        Ok(Volume {
            id: req.volume_id.clone(),
            target,
            source,
            writable,
            metadata_ttl: (!immutable).then_some(metadata_ttl),
            negative_ttl: duration("negativeTTL", 5)?,
            snapshot: flag("snapshot")?,
            pin,
            no_cache,
            credentials,
            fingerprint: hex::encode(print.finalize()),
        })
    }
}

fn parse_source(s: &str) -> Result<Source, String> {
    if let Some(rest) = s.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(format!("`{s}` names no bucket; write s3://bucket/prefix"));
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|seg| seg == "..") {
            return Err(format!("`{s}`: a prefix may not climb with `..`"));
        }
        return Ok(Source::S3 { bucket: bucket.to_owned(), prefix: prefix.to_owned() });
    }
    if s.contains("://") {
        return Err(format!("`{s}`: only s3:// URLs and local directories are served"));
    }
    let dir = PathBuf::from(s);
    if !dir.is_absolute() {
        return Err(format!("`{s}` is neither s3://bucket/prefix nor an absolute directory"));
    }
    Ok(Source::Local(dir))
}

fn credentials(secrets: &std::collections::HashMap<String, String>) -> Result<Option<Credentials>, VolumeError> {
    if secrets.is_empty() {
        return Ok(None);
    }
    if let Some(k) = secrets.keys().find(|k| !SECRET_KEYS.contains(&k.as_str())) {
        return Err(VolumeError::UnknownSecret(k.clone()));
    }
    let get = |k: &str| secrets.get(k).filter(|v| !v.is_empty()).cloned();
    let (id, key) = match (get("accessKeyId"), get("secretAccessKey")) {
        (Some(id), Some(key)) => (id, key),
        (Some(_), None) => return Err(VolumeError::HalfSecret("accessKeyId", "secretAccessKey")),
        (None, Some(_)) => return Err(VolumeError::HalfSecret("secretAccessKey", "accessKeyId")),
        (None, None) => return Err(VolumeError::Missing("accessKeyId and secretAccessKey in the volume's Secret")),
    };
    Ok(Some(Credentials {
        access_key_id: id,
        secret_access_key: key,
        session_token: get("sessionToken"),
        endpoint: get("endpoint"),
        region: get("region"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::VolumeCapability;
    use crate::proto::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};

    fn request(mode: Mode, attrs: &[(&str, &str)], secrets: &[(&str, &str)]) -> NodePublishVolumeRequest {
        NodePublishVolumeRequest {
            volume_id: "vol-1".into(),
            target_path: "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/data/mount".into(),
            volume_capability: Some(VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume::default())),
                access_mode: Some(AccessMode { mode: mode as i32 }),
            }),
            volume_context: attrs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            secrets: secrets.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn attributes_become_the_mount_settings() {
        let req = request(
            Mode::MultiNodeReaderOnly,
            &[
                ("source", "s3://data/imagenet/"),
                ("immutable", "true"),
                ("pin", "hot"),
                ("csi.storage.k8s.io/pod.name", "p"),
            ],
            &[],
        );
        let v = Volume::from_request(&req).unwrap();
        assert_eq!(v.source, Source::S3 { bucket: "data".into(), prefix: "imagenet".into() });
        assert!(!v.writable, "a reader-only mode is read-only");
        assert_eq!((v.metadata_ttl, v.pin, v.credentials), (None, Some(TierKind::Hot), None));
        let writer = Volume::from_request(&request(Mode::SingleNodeWriter, &[("source", "/srv/ckpt")], &[])).unwrap();
        assert!(writer.writable);
        assert_eq!(writer.source, Source::Local("/srv/ckpt".into()));
        assert_eq!(writer.metadata_ttl, Some(Duration::from_secs(60)));
        let ro =
            NodePublishVolumeRequest { readonly: true, ..request(Mode::SingleNodeWriter, &[("source", "/srv")], &[]) };
        assert!(!Volume::from_request(&ro).unwrap().writable, "a pod's readOnly wins over the mode");
    }

    #[test]
    fn the_fingerprint_is_the_attributes_and_access_not_the_secret() {
        let a = request(
            Mode::SingleNodeWriter,
            &[("source", "s3://b/p")],
            &[("accessKeyId", "a"), ("secretAccessKey", "s")],
        );
        let rotated = request(
            Mode::SingleNodeWriter,
            &[("source", "s3://b/p")],
            &[("accessKeyId", "a2"), ("secretAccessKey", "s2")],
        );
        let other = request(
            Mode::SingleNodeWriter,
            &[("source", "s3://b/q")],
            &[("accessKeyId", "a"), ("secretAccessKey", "s")],
        );
        let ro = request(
            Mode::MultiNodeReaderOnly,
            &[("source", "s3://b/p")],
            &[("accessKeyId", "a"), ("secretAccessKey", "s")],
        );
        let f = |r: &NodePublishVolumeRequest| Volume::from_request(r).unwrap().fingerprint;
        assert_eq!(f(&a), f(&rotated));
        assert_ne!(f(&a), f(&other));
        assert_ne!(f(&a), f(&ro));
    }

    #[test]
    fn bad_requests_name_their_fault_and_secrets_never_print() {
        let err = |r: NodePublishVolumeRequest| Volume::from_request(&r).unwrap_err().to_string();
        assert!(err(request(Mode::SingleNodeWriter, &[], &[])).contains("`source` is required"));
        assert!(err(request(Mode::SingleNodeWriter, &[("source", "gs://b")], &[])).contains("only s3://"));
        assert!(err(request(Mode::SingleNodeWriter, &[("source", "s3://b/../x")], &[])).contains("`..`"));
        assert!(err(request(Mode::SingleNodeWriter, &[("source", "data")], &[])).contains("absolute"));
        assert!(
            err(request(Mode::SingleNodeWriter, &[("source", "/d"), ("metadataTtl", "1s")], &[]))
                .contains("`metadataTtl`")
        );
        assert!(
            err(request(Mode::SingleNodeWriter, &[("source", "/d"), ("immutable", "yes")], &[])).contains("immutable")
        );
        assert!(
            err(request(Mode::SingleNodeWriter, &[("source", "/d"), ("pin", "hot"), ("noCache", "true")], &[]))
                .contains("both")
        );
        let half = err(request(Mode::SingleNodeWriter, &[("source", "s3://b")], &[("accessKeyId", "AKIA-SECRET-ID")]));
        assert!(half.contains("not secretAccessKey") && !half.contains("AKIA"), "{half}");
        let unknown = err(request(Mode::SingleNodeWriter, &[("source", "s3://b")], &[("password", "hunter2")]));
        assert!(unknown.contains("`password`") && !unknown.contains("hunter2"), "{unknown}");
        let mut block = request(Mode::SingleNodeWriter, &[("source", "/d")], &[]);
        block.volume_capability.as_mut().unwrap().access_type = Some(AccessType::Block(BlockVolume {}));
        assert!(err(block).contains("block"));
        let relative = NodePublishVolumeRequest {
            target_path: "pods/x/mount".into(),
            ..request(Mode::SingleNodeWriter, &[("source", "/d")], &[])
        };
        assert!(err(relative).contains("absolute"));
        let v = Volume::from_request(&request(
            Mode::SingleNodeWriter,
            &[("source", "s3://b")],
            &[("accessKeyId", "AKIA-SECRET-ID"), ("secretAccessKey", "very-secret")],
        ))
        .unwrap();
        let shown = format!("{v:?}");
        assert!(!shown.contains("AKIA") && !shown.contains("very-secret"), "{shown}");
    }
}
