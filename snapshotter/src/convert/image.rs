//! A whole image's conversion: its index (each platform's manifest converted, attestations
//! dropped since they describe the old bytes), each manifest's layers converted in parallel,
//! its config's `rootfs.diff_ids` rewritten, OCI media types and the eStargz annotations set.
//! Blobs go to the destination first and manifests last, the tagged one at the very end, so a
//! failure part-way leaves nothing a client could pull.

use super::ConvertError;
use super::estargz_out::{Format, Options};
use super::layer::{self, Converted};
use super::layout::Layout;
use super::plan::Pattern;
use crate::registry::{ImageRef, Registry};
use futures::StreamExt;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const ZSTD_CHECKSUM: &str = "io.containers.zstd-chunked.manifest-checksum";
pub const ZSTD_POSITION: &str = "io.containers.zstd-chunked.manifest-position";
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const TOC_DIGEST: &str = "containerd.io/snapshot/stargz/toc.digest";
pub const UNCOMPRESSED_SIZE: &str = "io.containers.estargz.uncompressed-size";
/// Where the TOC starts: from there to the end of the blob are the TOC and the footer, so a
/// lazy pull reads both in one request, with no suffix read first. A hint, as the next one:
/// stargz-snapshotter ignores both, and Strata checks what they lead to.
pub const TOC_OFFSET: &str = "containerd.io/snapshot/strata/toc.offset";
/// Where `.prefetch.landmark` is, so a lazy pull asks for the start-up files before the TOC.
pub const PREFETCH_END: &str = "containerd.io/snapshot/strata/prefetch.end";
/// Layer media types the converter reads; the compression is told by the bytes themselves.
const LAYER_TYPES: [&str; 5] = [
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
];
const SMALL_LIMIT: u64 = 16 << 20;

/// Where an image is read from or written to.
#[derive(Debug, Clone)]
pub enum Place {
    Layout(Layout),
    Registry(ImageRef),
}

impl Place {
    pub fn parse(s: &str) -> Result<Place, ConvertError> {
        match Layout::parse(s) {
            Some(l) => Ok(Place::Layout(l)),
            None => Ok(Place::Registry(ImageRef::parse(s)?)),
        }
    }

    fn name(&self) -> String {
        match self {
            Place::Layout(l) => {
                format!("oci:{}{}", l.dir.display(), l.tag.as_ref().map(|t| format!(":{t}")).unwrap_or_default())
            }
            Place::Registry(r) => r.to_string(),
        }
    }
}

/// What to do with an image whose layers are all eStargz already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfConverted {
    /// Copy it to the destination as it is.
    Skip,
    /// Convert it again (its TOCs and landmarks are replaced).
    Reconvert,
    /// Stop with an error.
    Error,
}

/// Told as the conversion goes, for a progress display.
pub trait Progress: Send + Sync {
    fn layer_started(&self, digest: &str, size: u64);
    /// Uncompressed bytes of a layer written.
    fn advanced(&self, digest: &str, bytes: u64);
    fn layer_done(&self, digest: &str, converted: &Converted);
    fn note(&self, message: &str);
}

#[derive(Debug, Clone)]
pub struct Job {
    pub src: Place,
    pub dst: Place,
    pub options: Options,
    pub prefetch: Vec<Pattern>,
    /// Prefetch lists for particular layers, by input layer digest; they take the place of
    /// `prefetch` for those layers (what `--record` saw each layer serve).
    pub prefetch_by_layer: HashMap<String, Vec<Pattern>>,
    pub jobs: usize,
    pub if_converted: IfConverted,
    /// Scratch space: each layer's uncompressed tar and output pass through it.
    pub work: PathBuf,
}

#[derive(Debug, Clone)]
pub struct Report {
    pub digest: String,
    pub skipped: bool,
    /// Each converted layer: its input digest and its output digest.
    pub layers: Vec<(String, String)>,
}

struct Ctx<'a> {
    job: &'a Job,
    registry: &'a Registry,
    progress: &'a dyn Progress,
    /// Converted layers by input digest: (descriptor, DiffID), shared by an index's platforms.
    done: Mutex<HashMap<String, (Value, String)>>,
}

fn is_index(v: &Value) -> bool {
    v["manifests"].is_array() || v["mediaType"] == OCI_INDEX || v["mediaType"] == DOCKER_LIST
}

fn digest_of(bytes: &[u8]) -> String {
    crate::estargz::sha256_digest(bytes)
}

fn parse_json(what: &str, bytes: &[u8]) -> Result<Value, ConvertError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ConvertError::Image { reference: what.to_owned(), reason: format!("not JSON: {e}") })
}

impl Ctx<'_> {
    fn converted(&self) -> Vec<(String, String)> {
        let done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> =
            done.iter().map(|(i, (d, _))| (i.clone(), d["digest"].as_str().unwrap_or_default().to_owned())).collect();
        v.sort();
        v
    }

    fn out_layer_type(&self) -> &'static str {
        match self.job.options.format {
            Format::Estargz => OCI_LAYER_GZIP,
            Format::ZstdChunked => OCI_LAYER_ZSTD,
        }
    }

    fn bad(&self, reason: String) -> ConvertError {
        ConvertError::Image { reference: self.job.src.name(), reason }
    }

    async fn top(&self) -> Result<Vec<u8>, ConvertError> {
        match &self.job.src {
            Place::Layout(l) => {
                let d = l.resolve()?;
                l.read_small(d["digest"].as_str().unwrap_or_default(), SMALL_LIMIT)
            }
            Place::Registry(r) => Ok(self.registry.manifest_raw(r, r.object()).await?.0.to_vec()),
        }
    }

    async fn manifest(&self, digest: &str) -> Result<Vec<u8>, ConvertError> {
        match &self.job.src {
            Place::Layout(l) => l.read_small(digest, SMALL_LIMIT),
            Place::Registry(r) => Ok(self.registry.manifest_raw(r, digest).await?.0.to_vec()),
        }
    }

    async fn blob_to(&self, digest: &str, path: &Path) -> Result<(), ConvertError> {
        match &self.job.src {
            Place::Layout(l) => l.copy_blob(digest, path).map(|_| ()),
            Place::Registry(r) => {
                let mut f = std::fs::File::create(path)
                    .map_err(|source| ConvertError::Io { what: format!("creating {}", path.display()), source })?;
                self.registry.blob_to_file(r, digest, &mut f).await?;
                Ok(())
            }
        }
    }

    async fn small_blob(&self, digest: &str) -> Result<Vec<u8>, ConvertError> {
        if let Place::Layout(l) = &self.job.src {
            return l.read_small(digest, SMALL_LIMIT);
        }
        let path = self.job.work.join(format!("small-{}", digest.replace(':', "-")));
        self.blob_to(digest, &path).await?;
        let bytes = std::fs::read(&path)
            .map_err(|source| ConvertError::Io { what: format!("reading {}", path.display()), source });
        let _ = std::fs::remove_file(&path);
        bytes
    }

    async fn put_blob_file(&self, digest: &str, path: &Path) -> Result<(), ConvertError> {
        match &self.job.dst {
            Place::Layout(l) => l.put_blob_file(digest, path),
            Place::Registry(r) => Ok(self.registry.push_blob(r, digest, path).await?),
        }
    }

    async fn put_blob_bytes(&self, digest: &str, bytes: &[u8]) -> Result<(), ConvertError> {
        match &self.job.dst {
            Place::Layout(l) => l.put_blob_bytes(digest, bytes),
            Place::Registry(_) => {
                let path = self.job.work.join(format!("put-{}", digest.replace(':', "-")));
                std::fs::write(&path, bytes)
                    .map_err(|source| ConvertError::Io { what: format!("writing {}", path.display()), source })?;
                let r = self.put_blob_file(digest, &path).await;
                let _ = std::fs::remove_file(&path);
                r
            }
        }
    }

    /// A manifest that an index names: stored by digest, untagged.
    async fn put_child(&self, bytes: &[u8], media_type: &str) -> Result<(), ConvertError> {
        let digest = digest_of(bytes);
        match &self.job.dst {
            Place::Layout(l) => l.put_blob_bytes(&digest, bytes),
            Place::Registry(r) => {
                Ok(self.registry.push_manifest(r, &digest, media_type, bytes.to_vec().into()).await?)
            }
        }
    }

    /// The image itself, under the destination's tag: the last write of a conversion.
    async fn put_top(&self, bytes: &[u8], media_type: &str) -> Result<(), ConvertError> {
        let digest = digest_of(bytes);
        match &self.job.dst {
            Place::Layout(l) => {
                l.put_blob_bytes(&digest, bytes)?;
                l.tag(json!({"mediaType": media_type, "digest": digest, "size": bytes.len()}))
            }
            Place::Registry(r) => {
                Ok(self.registry.push_manifest(r, r.object(), media_type, bytes.to_vec().into()).await?)
            }
        }
    }

    /// Converts one layer, or reuses its conversion from another platform.
    async fn layer(
        &self,
        desc: &Value,
        diff_id: Option<String>,
        threads: usize,
    ) -> Result<(Value, String), ConvertError> {
        let digest = desc["digest"].as_str().unwrap_or_default().to_owned();
        if let Some(hit) = self.done.lock().unwrap_or_else(|p| p.into_inner()).get(&digest) {
            return Ok(hit.clone());
        }
        let media_type = desc["mediaType"].as_str().unwrap_or_default();
        if !LAYER_TYPES.contains(&media_type) {
            return Err(ConvertError::Layer {
                layer: digest,
                reason: format!("its media type {media_type:?} is not a layer type Strata converts"),
            });
        }
        self.progress.layer_started(&digest, desc["size"].as_u64().unwrap_or(0));
        let input = self.job.work.join(format!("in-{}", digest.replace(':', "-")));
        self.blob_to(&digest, &input).await?;
        let prefetch = self.job.prefetch_by_layer.get(&digest).unwrap_or(&self.job.prefetch).clone();
        let (work, options) = (self.job.work.clone(), Options { threads, ..self.job.options });
        let (d, inp) = (digest.clone(), input.clone());
        let progress: &dyn Progress = self.progress;
        // The blocking conversion reports progress through a channel the async side drains.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
        let task = tokio::task::spawn_blocking(move || {
            layer::convert(&d, diff_id.as_deref(), &inp, &work, &prefetch, options, &|n| {
                let _ = tx.send(n);
            })
        });
        while let Some(n) = rx.recv().await {
            progress.advanced(&digest, n);
        }
        let converted = task.await.map_err(|e| ConvertError::Layer {
            layer: digest.clone(),
            reason: format!("the conversion task failed: {e}"),
        })?;
        let _ = std::fs::remove_file(&input);
        let converted = converted?;
        let w = &converted.written;
        let pushed = self.put_blob_file(&w.digest, &converted.blob).await;
        let _ = std::fs::remove_file(&converted.blob);
        pushed?;
        self.progress.layer_done(&digest, &converted);
        let mut annotations = desc["annotations"].as_object().cloned().unwrap_or_default();
        annotations.retain(|k, _| {
            !k.starts_with("containerd.io/snapshot/stargz/")
                && !k.starts_with("containerd.io/snapshot/strata/")
                && !k.starts_with("io.containers.")
        });
        annotations.insert(TOC_DIGEST.into(), w.toc_digest.clone().into());
        annotations.insert(UNCOMPRESSED_SIZE.into(), w.uncompressed_size.to_string().into());
        annotations.insert(TOC_OFFSET.into(), w.toc_offset.to_string().into());
        if let Some(end) = w.prefetch_end {
            annotations.insert(PREFETCH_END.into(), end.to_string().into());
        }
        if self.job.options.format == Format::ZstdChunked {
            annotations.insert(ZSTD_CHECKSUM.into(), w.toc_compressed_digest.clone().into());
            let position = format!("{}:{}:{}:1", w.toc_offset, w.toc_size, w.toc_raw_size);
            annotations.insert(ZSTD_POSITION.into(), position.into());
        }
        let media_type = self.out_layer_type();
        let out = json!({"mediaType": media_type, "digest": w.digest, "size": w.size, "annotations": annotations});
        let result = (out, w.diff_id.clone());
        self.done.lock().unwrap_or_else(|p| p.into_inner()).insert(digest, result.clone());
        Ok(result)
    }

    /// Converts one platform's manifest; returns the new manifest's bytes, or `None` when it
    /// was already in the format asked for and is kept as it is.
    async fn manifest_of(&self, bytes: &[u8]) -> Result<Option<Vec<u8>>, ConvertError> {
        let mut m = parse_json(&self.job.src.name(), bytes)?;
        if !matches!(m["mediaType"].as_str(), None | Some(OCI_MANIFEST) | Some(DOCKER_MANIFEST))
            || m["schemaVersion"] != 2
        {
            return Err(self.bad(format!(
                "manifest of media type {} (schema {}) is not one Strata converts",
                m["mediaType"], m["schemaVersion"]
            )));
        }
        let layers = m["layers"].as_array().cloned().unwrap_or_default();
        // Already in the format asked for: every layer has a TOC digest and the media type.
        let converted = !layers.is_empty()
            && layers.iter().all(|l| {
                l["annotations"][TOC_DIGEST].is_string()
                    && l["mediaType"].as_str().is_some_and(|t| t == self.out_layer_type())
            });
        if converted {
            match self.job.if_converted {
                IfConverted::Error => {
                    return Err(ConvertError::AlreadyConverted {
                        reference: self.job.src.name(),
                        format: self.job.options.format.name(),
                    });
                }
                IfConverted::Skip => return Ok(None),
                IfConverted::Reconvert => {}
            }
        }
        let config_digest = m["config"]["digest"].as_str().unwrap_or_default().to_owned();
        let mut config = parse_json(&config_digest, &self.small_blob(&config_digest).await?)?;
        let diff_ids: Vec<String> = config["rootfs"]["diff_ids"]
            .as_array()
            .map(|a| a.iter().filter_map(|d| d.as_str().map(str::to_owned)).collect())
            .unwrap_or_default();
        if diff_ids.len() != layers.len() {
            return Err(self.bad(format!("the config lists {} diff_ids for {} layers", diff_ids.len(), layers.len())));
        }
        // The CPUs are shared by the layers converted at once; a lone large layer gets them all.
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let threads = (cpus / self.job.jobs.max(1).min(layers.len().max(1))).max(1);
        let results: Vec<Result<(Value, String), ConvertError>> = futures::stream::iter(layers.iter().zip(diff_ids))
            .map(|(l, d)| self.layer(l, Some(d), threads))
            .buffered(self.job.jobs.max(1))
            .collect()
            .await;
        let mut new_layers = Vec::new();
        let mut new_diff_ids = Vec::new();
        for r in results {
            let (desc, diff_id) = r?;
            new_layers.push(desc);
            new_diff_ids.push(Value::from(diff_id));
        }
        config["rootfs"]["diff_ids"] = new_diff_ids.into();
        let config_bytes = serde_json::to_vec(&config).expect("JSON values serialise");
        let config_digest = digest_of(&config_bytes);
        self.put_blob_bytes(&config_digest, &config_bytes).await?;
        let config_type = match m["config"]["mediaType"].as_str() {
            Some(DOCKER_CONFIG) | None => OCI_CONFIG.to_owned(),
            Some(t) => t.to_owned(),
        };
        m["mediaType"] = OCI_MANIFEST.into();
        m["config"] = json!({"mediaType": config_type, "digest": config_digest, "size": config_bytes.len()});
        m["layers"] = new_layers.into();
        Ok(Some(serde_json::to_vec_pretty(&m).expect("JSON values serialise")))
    }

    /// Copies an already-converted manifest's blobs to the destination as they are.
    async fn copy_manifest(&self, bytes: &[u8]) -> Result<(), ConvertError> {
        let m = parse_json(&self.job.src.name(), bytes)?;
        let mut digests = vec![m["config"]["digest"].as_str().unwrap_or_default().to_owned()];
        digests.extend(
            m["layers"].as_array().into_iter().flatten().filter_map(|l| l["digest"].as_str().map(str::to_owned)),
        );
        for d in digests {
            let path = self.job.work.join(format!("copy-{}", d.replace(':', "-")));
            self.blob_to(&d, &path).await?;
            let r = self.put_blob_file(&d, &path).await;
            let _ = std::fs::remove_file(&path);
            r?;
        }
        Ok(())
    }
}

/// Runs `job`: reads the source, converts, writes the destination.
pub async fn run(job: &Job, registry: &Registry, progress: &dyn Progress) -> Result<Report, ConvertError> {
    if let Place::Registry(r) = &job.dst
        && r.object().contains(':')
    {
        return Err(ConvertError::Usage(format!("the destination {r} names a digest; give it a tag")));
    }
    let ctx = Ctx { job, registry, progress, done: Mutex::new(HashMap::new()) };
    let top = ctx.top().await?;
    let v = parse_json(&job.src.name(), &top)?;
    if !is_index(&v) {
        return match ctx.manifest_of(&top).await? {
            Some(new) => {
                ctx.put_top(&new, OCI_MANIFEST).await?;
                Ok(Report { digest: digest_of(&new), skipped: false, layers: ctx.converted() })
            }
            None => {
                progress.note(&format!("{} is already {}: copied as it is", job.src.name(), job.options.format.name()));
                ctx.copy_manifest(&top).await?;
                let media_type = v["mediaType"].as_str().unwrap_or(OCI_MANIFEST).to_owned();
                ctx.put_top(&top, &media_type).await?;
                Ok(Report { digest: digest_of(&top), skipped: true, layers: Vec::new() })
            }
        };
    }
    let mut out = v.clone();
    let mut manifests = Vec::new();
    let mut skipped = true;
    for entry in v["manifests"].as_array().into_iter().flatten() {
        let digest = entry["digest"].as_str().unwrap_or_default();
        if entry["annotations"]["vnd.docker.reference.type"].is_string() {
            progress.note(&format!("dropped {digest}: an attestation of the unconverted image"));
            continue;
        }
        let child = ctx.manifest(digest).await?;
        if is_index(&parse_json(digest, &child)?) {
            return Err(ctx.bad(format!("{digest} is an index inside an index, which Strata does not convert")));
        }
        let mut d = entry.clone();
        match ctx.manifest_of(&child).await? {
            Some(new) => {
                ctx.put_child(&new, OCI_MANIFEST).await?;
                d["mediaType"] = OCI_MANIFEST.into();
                d["digest"] = digest_of(&new).into();
                d["size"] = new.len().into();
                skipped = false;
            }
            None => {
                ctx.copy_manifest(&child).await?;
                let media_type = entry["mediaType"].as_str().unwrap_or(OCI_MANIFEST).to_owned();
                ctx.put_child(&child, &media_type).await?;
            }
        }
        manifests.push(d);
    }
    if manifests.is_empty() {
        return Err(ctx.bad("the index names no image manifest to convert".into()));
    }
    out["mediaType"] = OCI_INDEX.into();
    out["manifests"] = manifests.into();
    let bytes = serde_json::to_vec_pretty(&out).expect("JSON values serialise");
    ctx.put_top(&bytes, OCI_INDEX).await?;
    Ok(Report { digest: digest_of(&bytes), skipped, layers: ctx.converted() })
}
