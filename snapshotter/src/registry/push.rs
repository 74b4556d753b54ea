//! Uploads for `strata convert`: blobs (one monolithic upload each, streamed from a file, so
//! memory stays flat whatever the layer's size), then manifests. A converted image becomes
//! visible only when its last manifest is put, after every blob it names is in place.

use super::client::{Need, Registry};
use super::{ImageRef, RegistryError};
use bytes::Bytes;
use reqwest::header::{CONTENT_LENGTH, CONTENT_TYPE, LOCATION};
use reqwest::{Method, StatusCode};
use std::path::Path;
use tokio::io::AsyncReadExt;

/// A body that reads `path` in 1 MiB pieces.
fn file_body(path: &Path) -> reqwest::Body {
    let path = path.to_owned();
    let stream = futures::stream::unfold(None::<tokio::fs::File>, move |file| {
        let path = path.clone();
        async move {
            let mut file = match file {
                Some(f) => f,
                None => match tokio::fs::File::open(&path).await {
                    Ok(f) => f,
                    Err(e) => return Some((Err(e), None)),
                },
            };
            let mut buf = bytes::BytesMut::zeroed(1 << 20);
            match file.read(&mut buf).await {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    Some((Ok(buf.freeze()), Some(file)))
                }
                Err(e) => Some((Err(e), None)),
            }
        }
    });
    reqwest::Body::wrap_stream(stream)
}

impl Registry {
    /// Whether blob `digest` is already in `image`'s repository.
    pub async fn blob_exists(&self, image: &ImageRef, digest: &str) -> Result<bool, RegistryError> {
        match self.send(image, &format!("/blobs/{digest}"), Method::HEAD, |r| r, Need::Push).await {
            Ok(_) => Ok(true),
            Err(RegistryError::Status { status: 404, .. }) => Ok(false),
            Err(RegistryError::AllHostsFailed { last, .. })
                if matches!(*last, RegistryError::Status { status: 404, .. }) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Uploads the file at `path`, whose bytes hash to `digest`, unless the repository has it.
    pub async fn push_blob(&self, image: &ImageRef, digest: &str, path: &Path) -> Result<(), RegistryError> {
        if self.blob_exists(image, digest).await? {
            return Ok(());
        }
        let size = std::fs::metadata(path)
            .map_err(|e| RegistryError::Blob { url: path.display().to_string(), reason: e.to_string() })?
            .len();
        let started =
            self.send(image, "/blobs/uploads/", Method::POST, |r| r.header(CONTENT_LENGTH, 0), Need::Push).await?;
        let location = upload_location(&started)?;
        let sep = if location.contains('?') { '&' } else { '?' };
        let target = format!("{location}{sep}digest={digest}");
        let put = |r: reqwest::RequestBuilder| {
            r.header(CONTENT_TYPE, "application/octet-stream").header(CONTENT_LENGTH, size).body(file_body(path))
        };
        let resp = self.send(image, &target, Method::PUT, put, Need::Push).await?;
        if resp.status() != StatusCode::CREATED {
            return Err(RegistryError::Status {
                url: resp.url().to_string(),
                status: resp.status().as_u16(),
                detail: " to the upload's last PUT, instead of 201 Created".into(),
            });
        }
        Ok(())
    }

    /// Puts a manifest or index under `reference` (a tag, or its digest).
    pub async fn push_manifest(
        &self,
        image: &ImageRef,
        reference: &str,
        media_type: &str,
        body: Bytes,
    ) -> Result<(), RegistryError> {
        let put = |r: reqwest::RequestBuilder| r.header(CONTENT_TYPE, media_type).body(body.clone());
        self.send(image, &format!("/manifests/{reference}"), Method::PUT, put, Need::Push).await?;
        Ok(())
    }
}

fn upload_location(resp: &reqwest::Response) -> Result<String, RegistryError> {
    resp.headers().get(LOCATION).and_then(|v| v.to_str().ok()).map(str::to_owned).ok_or_else(|| RegistryError::Status {
        url: resp.url().to_string(),
        status: resp.status().as_u16(),
        detail: " to an upload's start, without a Location".into(),
    })
}
