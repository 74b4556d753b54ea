//! A small client of the admin API over its unix socket, for the CLI and tests.

use super::api::ApiError;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "cannot reach the strata daemon at {socket}: {source}\n  is it running? start it with `strata daemon --config /etc/strata/config.toml` (or `systemctl start strata`), or point --socket at its admin socket"
    )]
    NotRunning { socket: PathBuf, source: std::io::Error },
    #[error("talking to the daemon at {socket} failed: {message}")]
    Transport { socket: PathBuf, message: String },
    #[error("{message}")]
    Api { status: u16, message: String },
    #[error("the daemon's answer was not understood: {0}")]
    Decode(String),
}

/// Bytes an object key may carry as they are in a URI path segment; the rest are escaped.
const KEY_SEGMENT: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// An object key as a URI path. Keys hold spaces, `?`, `#` and `%` often enough (a dataset's
/// `My Photo.jpg`), and unescaped these would break the request or name another object; each
/// `/`-separated segment is escaped alone so the key's own structure survives.
fn object_path_in_uri(key: &str) -> String {
    key.trim_start_matches('/')
        .split('/')
        .map(|seg| percent_encoding::utf8_percent_encode(seg, KEY_SEGMENT).to_string())
        .collect::<Vec<_>>()
        .join("/")
}

#[derive(Debug, Clone)]
pub struct AdminClient {
    socket: PathBuf,
}

impl AdminClient {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        AdminClient { socket: socket.into() }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn send(&self, req: Request<Full<Bytes>>) -> Result<hyper::Response<hyper::body::Incoming>, ClientError> {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|source| ClientError::NotRunning { socket: self.socket.clone(), source })?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| self.transport(e))?;
        tokio::spawn(conn);
        sender.send_request(req).await.map_err(|e| self.transport(e))
    }

    fn transport(&self, e: impl std::fmt::Display) -> ClientError {
        ClientError::Transport { socket: self.socket.clone(), message: e.to_string() }
    }

    fn request(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
        content_type: &str,
    ) -> Result<Request<Full<Bytes>>, ClientError> {
        Request::builder()
            .method(method)
            .uri(path)
            .header("host", "strata")
            .header("content-type", content_type)
            .body(Full::new(body))
            .map_err(|e| self.transport(format!("cannot form a request for {path}: {e}")))
    }

    async fn api_error(&self, status: hyper::StatusCode, body: hyper::body::Incoming) -> ClientError {
        let bytes = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return self.transport(e),
        };
        let message = serde_json::from_slice::<ApiError>(&bytes)
            .map(|e| e.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
        ClientError::Api { status: status.as_u16(), message }
    }

    async fn call(&self, method: Method, path: &str, body: Bytes, content_type: &str) -> Result<Bytes, ClientError> {
        let resp = self.send(self.request(method, path, body, content_type)?).await?;
        let status = resp.status();
        if !status.is_success() {
            return Err(self.api_error(status, resp.into_body()).await);
        }
        Ok(resp.into_body().collect().await.map_err(|e| self.transport(e))?.to_bytes())
    }

    fn decode<T: DeserializeOwned>(b: Bytes) -> Result<T, ClientError> {
        serde_json::from_slice(&b).map_err(|e| ClientError::Decode(e.to_string()))
    }

    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        Self::decode(self.call(Method::GET, path, Bytes::new(), "application/json").await?)
    }

    pub async fn post<B: Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> Result<T, ClientError> {
        let body = Bytes::from(serde_json::to_vec(body).expect("requests serialise"));
        Self::decode(self.call(Method::POST, path, body, "application/json").await?)
    }

    /// Reads an object through the daemon's cache into `out`; returns the bytes written.
    pub async fn read_to(
        &self,
        path: &str,
        out: &mut (impl tokio::io::AsyncWrite + Unpin),
    ) -> Result<u64, ClientError> {
        use tokio::io::AsyncWriteExt;
        let uri = format!("{}/{}", super::api::READ, object_path_in_uri(path));
        let resp = self.send(self.request(Method::GET, &uri, Bytes::new(), "application/json")?).await?;
        let status = resp.status();
        let expected: Option<u64> =
            resp.headers().get("content-length").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
        if !status.is_success() {
            return Err(self.api_error(status, resp.into_body()).await);
        }
        let mut body = resp.into_body();
        let mut n = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| self.transport(format!("read of {path} broke off after {n} bytes: {e}")))?;
            if let Ok(data) = frame.into_data() {
                out.write_all(&data).await.map_err(|e| self.transport(e))?;
                n += data.len() as u64;
            }
        }
        if let Some(total) = expected.filter(|t| *t != n) {
            return Err(self.transport(format!("read of {path} broke off after {n} of {total} bytes")));
        }
        out.flush().await.map_err(|e| self.transport(e))?;
        Ok(n)
    }

    pub async fn put_text<T: DeserializeOwned>(&self, path: &str, text: String) -> Result<T, ClientError> {
        Self::decode(self.call(Method::PUT, path, Bytes::from(text), "application/toml").await?)
    }
}
