//! A multipart upload sent part by part as its data becomes ready, so a file can go up while it
//! is still being written. Parts travel in their own tasks; the object appears only when
//! [`PartUpload::complete`] succeeds, and an upload that fails or is dropped unfinished is
//! aborted, so no part of it is ever visible.

use crate::source::{ObjectInfo, ObjectSource, SourceError};
use bytes::Bytes;
use object_store::{MultipartUpload, ObjectStoreExt};
use tokio::task::JoinHandle;

pub struct PartUpload {
    source: ObjectSource,
    path: String,
    /// Behind a mutex only to be `Sync`; every use has `&mut self`.
    upload: Option<std::sync::Mutex<Box<dyn MultipartUpload>>>,
    parts: Vec<JoinHandle<Result<(), SourceError>>>,
}

impl std::fmt::Debug for PartUpload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartUpload").field("path", &self.path).field("parts", &self.parts.len()).finish()
    }
}

impl ObjectSource {
    /// Starts a multipart upload of the object at `path`.
    pub async fn begin_upload(&self, path: &str) -> Result<PartUpload, SourceError> {
        let loc = self.location(path);
        let upload = self.bounded("CreateMultipartUpload", path, self.store.put_multipart(&loc)).await?;
        Ok(PartUpload {
            source: self.clone(),
            path: path.to_string(),
            upload: Some(std::sync::Mutex::new(upload)),
            parts: Vec::new(),
        })
    }
}

impl PartUpload {
    /// Sends the next part (parts are numbered in the order of these calls). Returns at once.
    pub fn put_part(&mut self, data: Bytes) {
        let upload = self.upload.as_mut().expect("parts are only sent before complete or abort");
        let part = upload.get_mut().unwrap_or_else(|p| p.into_inner()).put_part(data.into());
        let (source, path) = (self.source.clone(), self.path.clone());
        self.parts.push(tokio::spawn(async move { source.bounded("UploadPart", &path, part).await }));
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
            join(self.parts.remove(i)).await?;
        }
        Ok(())
    }

    /// Waits for every part, then makes the object visible. Returns its info, read back with
    /// HEAD, because some stores answer a completed multipart upload with an empty ETag. On any
    /// failure the upload is aborted.
    pub async fn complete(mut self) -> Result<ObjectInfo, SourceError> {
        let mut failed = None;
        for p in std::mem::take(&mut self.parts) {
            if let Err(e) = join(p).await {
                failed.get_or_insert(e);
            }
        }
        if let Some(e) = failed {
            self.abort().await;
            return Err(e);
        }
        let mut upload = self.upload.take().expect("completed once").into_inner().unwrap_or_else(|p| p.into_inner());
        let done = self.source.bounded("CompleteMultipartUpload", &self.path, upload.complete()).await;
        if let Err(e) = done {
            let _ = upload.abort().await;
            return Err(e);
        }
        self.source.head(&self.path).await
    }

    /// Gives the upload up: the store drops the parts sent so far.
    pub async fn abort(mut self) {
        for p in std::mem::take(&mut self.parts) {
            p.abort();
        }
        if let Some(u) = self.upload.take() {
            let mut u = u.into_inner().unwrap_or_else(|p| p.into_inner());
            let _ = self.source.bounded("AbortMultipartUpload", &self.path, u.abort()).await;
        }
    }
}

impl Drop for PartUpload {
    /// An upload dropped without complete or abort is aborted in the background, so it never
    /// lingers in the store.
    fn drop(&mut self) {
        if let Some(u) = self.upload.take() {
            let mut u = u.into_inner().unwrap_or_else(|p| p.into_inner());
            for p in self.parts.drain(..) {
                p.abort();
            }
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = u.abort().await;
                });
            }
        }
    }
}

async fn join(p: JoinHandle<Result<(), SourceError>>) -> Result<(), SourceError> {
    p.await.unwrap_or_else(|e| {
        Err(SourceError::Local { path: "upload part task".into(), source: std::io::Error::other(e.to_string()) })
    })
}
