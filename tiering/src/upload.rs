//! A multipart upload sent part by part as its data becomes ready, so a file can go up while it
//! is still being written. Parts travel in their own tasks; the object appears only when
//! [`PartUpload::complete`] succeeds, and an upload that fails or is dropped unfinished is
//! aborted, so no part of it is ever visible.

use crate::source::{ObjectInfo, ObjectSource, SourceError};
use bytes::Bytes;
use object_store::aws::AmazonS3;
use object_store::multipart::{MultipartStore, PartId};
use object_store::{MultipartUpload, ObjectStoreExt};
use std::sync::Arc;
use tokio::task::JoinHandle;

/// The store's side of an upload.
enum Upload {
    /// S3's multipart API, whose upload ID the caller can keep, to abort the upload after a
    /// crash.
    S3 { s3: Arc<AmazonS3>, id: String },
    /// Any other store. Behind a mutex only to be `Sync`; every use has `&mut self`.
    Other(std::sync::Mutex<Box<dyn MultipartUpload>>),
}

/// A part the store took: its index, and what S3 answered for it.
type Sent = (usize, Option<PartId>);

pub struct PartUpload {
    source: ObjectSource,
    path: String,
    upload: Option<Upload>,
    /// Parts in flight or not yet collected.
    parts: Vec<JoinHandle<Result<Sent, SourceError>>>,
    /// What the store answered for each part sent, for S3's completion.
    done: Vec<Option<PartId>>,
    /// Bytes sent in parts so far: the object's size once complete.
    sent: u64,
}

impl std::fmt::Debug for PartUpload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartUpload").field("path", &self.path).field("parts", &self.done.len()).finish()
    }
}

impl ObjectSource {
    /// Starts a multipart upload of the object at `path`.
    pub async fn begin_upload(&self, path: &str) -> Result<PartUpload, SourceError> {
        let loc = self.location(path);
        let upload = match &self.s3 {
            Some(s3) => {
                let id = self.bounded("CreateMultipartUpload", path, s3.create_multipart(&loc)).await?;
                Upload::S3 { s3: s3.clone(), id }
            }
            None => {
                let u = self.bounded("CreateMultipartUpload", path, self.store.put_multipart(&loc)).await?;
                Upload::Other(std::sync::Mutex::new(u))
            }
        };
        Ok(PartUpload {
            source: self.clone(),
            path: path.to_string(),
            upload: Some(upload),
            parts: Vec::new(),
            done: Vec::new(),
            sent: 0,
        })
    }

    /// Aborts the multipart upload `id` of the object at `path`, begun by an earlier run: the
    /// store drops its parts. An upload the store no longer knows is already gone.
    pub async fn abort_upload(&self, path: &str, id: &str) -> Result<(), SourceError> {
        let Some(s3) = &self.s3 else { return Ok(()) };
        let loc = self.location(path);
        match self.bounded("AbortMultipartUpload", path, s3.abort_multipart(&loc, &id.to_string())).await {
            Err(e) if e.is_not_found() => Ok(()),
            other => other,
        }
    }
}

impl PartUpload {
    /// The object this upload makes.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The store's ID of this upload, where the store has one that outlives the process.
    pub fn id(&self) -> Option<&str> {
        match &self.upload {
            Some(Upload::S3 { id, .. }) => Some(id),
            _ => None,
        }
    }

    /// Sends the next part (parts are numbered in the order of these calls). Returns at once.
    pub fn put_part(&mut self, data: Bytes) {
        let index = self.done.len();
        self.done.push(None);
        self.sent += data.len() as u64;
        let (source, path) = (self.source.clone(), self.path.clone());
        let task = match self.upload.as_mut().expect("parts are only sent before complete or abort") {
            Upload::S3 { s3, id } => {
                let (s3, id, loc) = (s3.clone(), id.clone(), source.location(&path));
                tokio::spawn(async move {
                    let part = s3.put_part(&loc, &id, index, data.into());
                    source.bounded("UploadPart", &path, part).await.map(|p| (index, Some(p)))
                })
            }
            Upload::Other(u) => {
                let part = u.get_mut().unwrap_or_else(|p| p.into_inner()).put_part(data.into());
                tokio::spawn(async move { source.bounded("UploadPart", &path, part).await.map(|()| (index, None)) })
            }
        };
        self.parts.push(task);
    }

    /// Parts sent and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.parts.iter().filter(|p| !p.is_finished()).count()
    }

    /// Waits until fewer than `limit` parts are in flight, so one more may be sent; reports a
    /// part that failed.
    pub async fn wait_for_room(&mut self, limit: usize) -> Result<(), SourceError> {
        while self.in_flight() >= limit.max(1) {
            let i = self.parts.iter().position(|p| !p.is_finished()).expect("one is in flight");
            let (index, id) = join(self.parts.remove(i)).await?;
            self.done[index] = id;
        }
        Ok(())
    }

    /// Waits for every part, then makes the object visible. Returns its info, as
    /// [`ObjectSource::written`] tells it. On any failure the upload is aborted.
    pub async fn complete(mut self) -> Result<ObjectInfo, SourceError> {
        let mut failed = None;
        for p in std::mem::take(&mut self.parts) {
            match join(p).await {
                Ok((index, id)) => self.done[index] = id,
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            self.abort().await;
            return Err(e);
        }
        let done = match self.upload.as_mut().expect("completed once") {
            Upload::S3 { s3, id } => {
                let parts =
                    std::mem::take(&mut self.done).into_iter().map(|p| p.expect("every part answered")).collect();
                let loc = self.source.location(&self.path);
                self.source.bounded("CompleteMultipartUpload", &self.path, s3.complete_multipart(&loc, id, parts)).await
            }
            Upload::Other(u) => {
                let u = u.get_mut().unwrap_or_else(|p| p.into_inner());
                self.source.bounded("CompleteMultipartUpload", &self.path, u.complete()).await
            }
        };
        let done = match done {
            Ok(done) => done,
            Err(e) => {
                self.abort().await;
                return Err(e);
            }
        };
        self.upload = None;
        self.source.written(&self.path, self.sent, done.e_tag).await
    }

    /// Gives the upload up: the store drops the parts sent so far.
    pub async fn abort(mut self) {
        for p in std::mem::take(&mut self.parts) {
            p.abort();
        }
        if let Some(u) = self.upload.take() {
            abort(&self.source, &self.path, u).await;
        }
    }
}

async fn abort(source: &ObjectSource, path: &str, upload: Upload) {
    let _ = match upload {
        Upload::S3 { id, .. } => source.abort_upload(path, &id).await,
        Upload::Other(u) => {
            let mut u = u.into_inner().unwrap_or_else(|p| p.into_inner());
            source.bounded("AbortMultipartUpload", path, u.abort()).await
        }
    };
}

impl Drop for PartUpload {
    /// An upload dropped without complete or abort is aborted in the background, so it never
    /// lingers in the store.
    fn drop(&mut self) {
        if let Some(u) = self.upload.take() {
            for p in self.parts.drain(..) {
                p.abort();
            }
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let (source, path) = (self.source.clone(), self.path.clone());
                rt.spawn(async move { abort(&source, &path, u).await });
            }
        }
    }
}

async fn join<T>(p: JoinHandle<Result<T, SourceError>>) -> Result<T, SourceError> {
    p.await.unwrap_or_else(|e| {
        Err(SourceError::Local { path: "upload part task".into(), source: std::io::Error::other(e.to_string()) })
    })
}
