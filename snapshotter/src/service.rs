//! The one place where snapshots meet gRPC: requests become calls on [`Snapshotter`], its
//! types become protobuf, and each [`SnapshotError`] becomes the status code containerd acts on
//! (and is logged, once, here).

use crate::error::SnapshotError;
use crate::lazy::{self, Lazy, Prepared};
use crate::model::{Info, Kind, Mount};
use crate::overlay::Snapshotter;
use crate::proto;
use futures::Stream;
use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::Arc;
use strata_tiering::metrics::{Metrics, SnapshotRequestLabel};
use tonic::{Code, Request, Response, Status};
use tracing::Instrument;

/// The Snapshots service over one [`Snapshotter`].
#[derive(Debug, Clone)]
pub struct SnapshotService {
    inner: Arc<Snapshotter>,
    metrics: Metrics,
    /// Lazy layers from registries; `None` serves ordinary snapshots only.
    lazy: Option<Arc<Lazy>>,
}

/// How many snapshots one List message carries; containerd reads them as a stream.
const LIST_BATCH: usize = 100;

impl SnapshotService {
    pub fn new(inner: Arc<Snapshotter>, metrics: Metrics) -> SnapshotService {
        SnapshotService { inner, metrics, lazy: None }
    }

    /// Serves layers whose labels name an eStargz TOC lazily, through `lazy`.
    pub fn with_lazy(mut self, lazy: Arc<Lazy>) -> SnapshotService {
        self.lazy = Some(lazy);
        self
    }

    /// Counts a call by how it ended, and turns its error into a status.
    fn finish<T>(&self, method: &'static str, result: Result<T, SnapshotError>) -> Result<T, Status> {
        let result = result.map_err(|e| status(method, e));
        let code = match &result {
            Ok(_) => "ok",
            Err(s) => code_name(s.code()),
        };
        self.metrics.snapshot_requests.get_or_create(&SnapshotRequestLabel { method, code }).inc();
        result
    }

    /// As [`SnapshotService::finish`] for a step before a call's last: counted only when it
    /// ends the call (with an error), so that each call counts once.
    fn finish_step<T>(&self, method: &'static str, result: Result<T, SnapshotError>) -> Result<T, Status> {
        match result {
            Ok(v) => Ok(v),
            Err(e) => self.finish(method, Err(e)),
        }
    }

    /// Before containerd mounts an overlay over `key`'s layers, each remote one must be
    /// mounted (again, after a restart). Returns the chain's snapshot ids, from `key` down.
    async fn ensure_chain(&self, method: &'static str, key: &str) -> Result<Vec<u64>, Status> {
        match &self.lazy {
            Some(lazy) => self.finish_step(method, lazy.ensure_chain(&self.inner, key).await),
            None => Ok(Vec::new()),
        }
    }

    pub fn into_server(self) -> proto::snapshots_server::SnapshotsServer<SnapshotService> {
        proto::snapshots_server::SnapshotsServer::new(self)
    }

    /// Runs `op` off the async threads (it does file system work), counts it, and turns its
    /// error into a status.
    async fn call<T: Send + 'static>(
        &self,
        method: &'static str,
        key: &str,
        op: impl FnOnce(&Snapshotter) -> Result<T, SnapshotError> + Send + 'static,
    ) -> Result<T, Status> {
        let result = self.run(method, key, op).await?;
        self.finish(method, result)
    }

    /// Runs `op` off the async threads, in a span of the call.
    async fn run<T: Send + 'static>(
        &self,
        method: &'static str,
        key: &str,
        op: impl FnOnce(&Snapshotter) -> Result<T, SnapshotError> + Send + 'static,
    ) -> Result<Result<T, SnapshotError>, Status> {
        let span = tracing::debug_span!("snapshots", method, key);
        let inner = self.inner.clone();
        async move {
            match tokio::task::spawn_blocking(move || op(&inner)).await {
                Ok(r) => Ok(r),
                Err(join) => {
                    tracing::error!(error = %join, "snapshot operation panicked");
                    Err(Status::internal(format!("{method} failed: {join}")))
                }
            }
        }
        .instrument(span)
        .await
    }
}

fn status(method: &'static str, e: SnapshotError) -> Status {
    let code = match &e {
        SnapshotError::NotFound(_) | SnapshotError::ParentNotFound(_) => Code::NotFound,
        SnapshotError::AlreadyExists(_) => Code::AlreadyExists,
        SnapshotError::NotActive { .. } | SnapshotError::NoMounts(_) | SnapshotError::HasChildren(_) => {
            Code::FailedPrecondition
        }
        SnapshotError::ParentNotCommitted(_) | SnapshotError::InvalidArgument(_) => Code::InvalidArgument,
        SnapshotError::LayerUnavailable { .. } => Code::Unavailable,
        SnapshotError::Store { .. } | SnapshotError::StoreDamaged { .. } | SnapshotError::Io { .. } => Code::Internal,
    };
    if matches!(code, Code::Internal | Code::Unavailable) {
        tracing::error!(method, error = %e, "snapshot operation failed");
    } else {
        // containerd probes with Stat and retries Prepare: these answers are expected traffic.
        tracing::debug!(method, error = %e, "snapshot request refused");
    }
    Status::new(code, e.to_string())
}

fn code_name(c: Code) -> &'static str {
    match c {
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::FailedPrecondition => "failed_precondition",
        Code::InvalidArgument => "invalid_argument",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        _ => "other",
    }
}

fn parent(p: String) -> Option<String> {
    (!p.is_empty()).then_some(p)
}

fn labels(m: HashMap<String, String>) -> BTreeMap<String, String> {
    m.into_iter().collect()
}

fn mounts(ms: Vec<Mount>) -> Vec<proto::Mount> {
    ms.into_iter()
        .map(|m| proto::Mount { r#type: m.kind, source: m.source, target: String::new(), options: m.options })
        .collect()
}

fn to_proto(i: Info) -> proto::Info {
    let kind = match i.kind {
        Kind::View => proto::Kind::View,
        Kind::Active => proto::Kind::Active,
        Kind::Committed => proto::Kind::Committed,
    };
    proto::Info {
        name: i.name,
        parent: i.parent.unwrap_or_default(),
        kind: kind as i32,
        created_at: Some(timestamp(i.created)),
        updated_at: Some(timestamp(i.updated)),
        labels: i.labels.into_iter().collect(),
    }
}

fn timestamp(t: std::time::SystemTime) -> proto::Timestamp {
    let d = t.duration_since(std::time::SystemTime::UNIX_EPOCH).unwrap_or_default();
    proto::Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 }
}

fn from_proto(i: proto::Info) -> Info {
    let kind = match i.kind() {
        proto::Kind::View => Kind::View,
        proto::Kind::Committed => Kind::Committed,
        _ => Kind::Active,
    };
    Info {
        name: i.name,
        parent: parent(i.parent),
        kind,
        labels: labels(i.labels),
        created: std::time::SystemTime::UNIX_EPOCH,
        updated: std::time::SystemTime::UNIX_EPOCH,
    }
}

type ListStream = Pin<Box<dyn Stream<Item = Result<proto::ListSnapshotsResponse, Status>> + Send>>;

#[tonic::async_trait]
impl proto::snapshots_server::Snapshots for SnapshotService {
    async fn prepare(
        &self,
        req: Request<proto::PrepareSnapshotRequest>,
    ) -> Result<Response<proto::PrepareSnapshotResponse>, Status> {
        let r = req.into_inner();
        let key = r.key.clone();
        let labels = labels(r.labels);
        let parent_key = parent(r.parent);
        if let Some(lazy) = &self.lazy
            && let Some(src) = lazy::source(&labels)
        {
            let span = tracing::info_span!("snapshots", method = "prepare", key = %key);
            let outcome = lazy.prepare(&self.inner, &key, parent_key.as_deref(), labels, src).instrument(span).await;
            let how = match &outcome {
                Ok(Prepared::Remote { how, .. }) => *how,
                _ => "downloaded",
            };
            self.metrics.snapshot_layers.get_or_create(&strata_tiering::metrics::LayerLabel { how }).inc();
            return match self.finish("prepare", outcome)? {
                // containerd's remote-snapshot protocol: AlreadyExists means "the layer is
                // there, skip its download"; it then finds the target with Stat.
                Prepared::Remote { target, .. } => {
                    Err(Status::already_exists(format!("target snapshot {target:?} is a remote snapshot")))
                }
                Prepared::Local(ms) => Ok(Response::new(proto::PrepareSnapshotResponse { mounts: mounts(ms) })),
            };
        }
        if let Some(p) = &parent_key {
            let chain = self.ensure_chain("prepare", p).await?;
            // A container's snapshot (not a layer containerd unpacks, which names its target):
            // with `prefetch_wait = "prepare"`, it starts once its layers' start-up bytes are
            // here; by default its reads wait for them instead.
            if let Some(lazy) = &self.lazy
                && !labels.contains_key(lazy::TARGET_LABEL)
            {
                lazy.wait_prefetch(&chain).await;
            }
        }
        let ms = self.call("prepare", &key, move |s| s.prepare(&r.key, parent_key.as_deref(), labels)).await?;
        Ok(Response::new(proto::PrepareSnapshotResponse { mounts: mounts(ms) }))
    }

    async fn view(
        &self,
        req: Request<proto::ViewSnapshotRequest>,
    ) -> Result<Response<proto::ViewSnapshotResponse>, Status> {
        let r = req.into_inner();
        let key = r.key.clone();
        let parent_key = parent(r.parent);
        if let Some(p) = &parent_key {
            // As for Prepare: a view over a remote layer not mounted (again, after a restart)
            // would show its empty directory, where the layer's files should be.
            self.ensure_chain("view", p).await?;
        }
        let ms = self.call("view", &key, move |s| s.view(&r.key, parent_key.as_deref(), labels(r.labels))).await?;
        Ok(Response::new(proto::ViewSnapshotResponse { mounts: mounts(ms) }))
    }

    async fn mounts(&self, req: Request<proto::MountsRequest>) -> Result<Response<proto::MountsResponse>, Status> {
        let key = req.into_inner().key;
        self.ensure_chain("mounts", &key).await?;
        let ms = self.call("mounts", &key.clone(), move |s| s.mounts(&key)).await?;
        Ok(Response::new(proto::MountsResponse { mounts: mounts(ms) }))
    }

    async fn commit(&self, req: Request<proto::CommitSnapshotRequest>) -> Result<Response<proto::Empty>, Status> {
        let r = req.into_inner();
        let key = r.key.clone();
        self.call("commit", &key, move |s| s.commit(&r.name, &r.key, labels(r.labels))).await?;
        Ok(Response::new(proto::Empty {}))
    }

    async fn remove(&self, req: Request<proto::RemoveSnapshotRequest>) -> Result<Response<proto::Empty>, Status> {
        let key = req.into_inner().key;
        let mut held = None;
        if let Some(lazy) = &self.lazy {
            // A mounted layer's directory cannot go until its mount has; and no call may
            // mount it again between the unmount and the removal.
            let k = key.clone();
            let id = self.finish_step("remove", self.run("remove", &key, move |s| s.removable(&k)).await?)?;
            held = Some(lazy.hold(id).await);
            lazy.unmount(id).await;
        }
        self.call("remove", &key.clone(), move |s| s.remove(&key)).await?;
        drop(held);
        Ok(Response::new(proto::Empty {}))
    }

    async fn stat(
        &self,
        req: Request<proto::StatSnapshotRequest>,
    ) -> Result<Response<proto::StatSnapshotResponse>, Status> {
        let key = req.into_inner().key;
        let info = self.call("stat", &key.clone(), move |s| s.stat(&key)).await?;
        Ok(Response::new(proto::StatSnapshotResponse { info: Some(to_proto(info)) }))
    }

    async fn update(
        &self,
        req: Request<proto::UpdateSnapshotRequest>,
    ) -> Result<Response<proto::UpdateSnapshotResponse>, Status> {
        let r = req.into_inner();
        let Some(info) = r.info else {
            return Err(Status::invalid_argument("an update needs the snapshot's info"));
        };
        let paths = r.update_mask.map(|m| m.paths).unwrap_or_default();
        let info = from_proto(info);
        let updated = self.call("update", &info.name.clone(), move |s| s.update(&info, &paths)).await?;
        Ok(Response::new(proto::UpdateSnapshotResponse { info: Some(to_proto(updated)) }))
    }

    type ListStream = ListStream;

    async fn list(&self, req: Request<proto::ListSnapshotsRequest>) -> Result<Response<ListStream>, Status> {
        let filters = req.into_inner().filters;
        let infos = self.call("list", "", move |s| s.list(&filters)).await?;
        let mut batches = Vec::new();
        let mut it = infos.into_iter().map(to_proto).peekable();
        while it.peek().is_some() {
            batches.push(Ok(proto::ListSnapshotsResponse { info: it.by_ref().take(LIST_BATCH).collect() }));
        }
        Ok(Response::new(Box::pin(futures::stream::iter(batches))))
    }

    async fn usage(&self, req: Request<proto::UsageRequest>) -> Result<Response<proto::UsageResponse>, Status> {
        let key = req.into_inner().key;
        let u = self.call("usage", &key.clone(), move |s| s.usage(&key)).await?;
        Ok(Response::new(proto::UsageResponse { size: u.size, inodes: u.inodes }))
    }

    async fn cleanup(&self, _req: Request<proto::CleanupRequest>) -> Result<Response<proto::Empty>, Status> {
        let removed = self.call("cleanup", "", |s| s.cleanup()).await?;
        if removed > 0 {
            tracing::info!(removed, "cleanup removed directories no snapshot owned");
        }
        Ok(Response::new(proto::Empty {}))
    }
}
