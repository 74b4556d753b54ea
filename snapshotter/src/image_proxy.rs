//! The CRI image service that kubelet is pointed at (`--image-service-endpoint`), forwarding
//! every call to containerd's CRI plugin. containerd never hands a snapshotter the login of a
//! pull, so without this a pod's `imagePullSecrets` reach containerd alone: Strata could not
//! read a private image's layers lazily, and containerd downloaded them whole. The proxy keeps
//! the login of each PullImage for that image's repository ([`Keychain`]) before forwarding it.
//!
//! Calls are forwarded as raw HTTP/2 requests, bodies and trailers as they are, so fields and
//! methods this proxy does not know (of `runtime.v1` or `runtime.v1alpha2`) pass unchanged.

use crate::proto::cri::PullImageRequest;
use crate::registry::ImageRef;
use crate::registry::keychain::{Keychain, Remembered, login_of};
use http_body_util::{BodyExt, Full, Limited};
use prost::Message;
use std::convert::Infallible;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use strata_tiering::metrics::{CriPullLabel, Metrics};
use tokio::net::UnixListener;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::transport::Channel;
use tower::ServiceExt;

/// A PullImage request larger than this is refused: real ones are a few hundred bytes, plus
/// the pod's sandbox config.
const PULL_REQUEST_LIMIT: usize = 1 << 20;

/// What every forwarding service shares.
#[derive(Debug)]
struct Shared {
    containerd: Channel,
    containerd_socket: PathBuf,
    keychain: Arc<Keychain>,
    metrics: Metrics,
}

/// The image service of one CRI version, forwarded.
#[derive(Debug)]
pub struct Forward<V> {
    shared: Arc<Shared>,
    version: PhantomData<V>,
}

impl<V> Clone for Forward<V> {
    fn clone(&self) -> Self {
        Forward { shared: self.shared.clone(), version: PhantomData }
    }
}

#[derive(Debug)]
pub struct V1;
#[derive(Debug)]
pub struct V1Alpha2;

impl NamedService for Forward<V1> {
    const NAME: &'static str = "runtime.v1.ImageService";
}

impl NamedService for Forward<V1Alpha2> {
    const NAME: &'static str = "runtime.v1alpha2.ImageService";
}

type Answer = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

impl<V> tower::Service<http::Request<Body>> for Forward<V> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Answer;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Answer {
        let shared = self.shared.clone();
        Box::pin(async move { Ok(shared.forward(req).await) })
    }
}

impl Shared {
    async fn forward(&self, req: http::Request<Body>) -> http::Response<Body> {
        let (req, remembered) = if req.uri().path().ends_with("/PullImage") {
            match self.capture(req).await {
                Ok(captured) => captured,
                Err(status) => return status.into_http(),
            }
        } else {
            (req, None)
        };
        // Dropped without an answer (kubelet gave up on the pull, or the daemon is stopping):
        // the pull did not succeed, so its login gives its place back.
        let mut pending = Pending { keychain: self.keychain.clone(), remembered };
        let answer = match self.containerd.clone().oneshot(req).await {
            Ok(resp) => resp.map(Body::new),
            Err(e) if timed_out(&e) => {
                tonic::Status::deadline_exceeded("containerd did not answer within the call's deadline").into_http()
            }
            Err(e) => {
                let why = crate::registry::with_causes(&e);
                tracing::warn!(socket = %self.containerd_socket.display(), error = %why, "containerd's CRI image service cannot be reached");
                tonic::Status::unavailable(format!(
                    "strata's image service proxy cannot reach containerd at {}: {why}",
                    self.containerd_socket.display()
                ))
                .into_http()
            }
        };
        // The login is used during the pull (containerd prepares the layers before it answers),
        // so it is taken first; a pull that failed, most likely for a wrong or expired login,
        // gives its place back to the last that worked. containerd answers a failure without a
        // body, its status in the headers. A kept login is written to disk, off the runtime.
        if let Some(r) = pending.remembered.take() {
            if succeeded(&answer) {
                let keychain = self.keychain.clone();
                let _ = tokio::task::spawn_blocking(move || keychain.confirm(r)).await;
                self.count("kept");
            } else {
                tracing::debug!("a CRI pull failed; its login is not kept");
                self.keychain.undo(r);
                self.count("failed");
            }
        }
        answer
    }

    /// Reads a PullImage request whole, keeps its login, and gives back the same bytes to
    /// forward.
    async fn capture(
        &self,
        req: http::Request<Body>,
    ) -> Result<(http::Request<Body>, Option<Remembered>), tonic::Status> {
        let (parts, body) = req.into_parts();
        let bytes = Limited::new(body, PULL_REQUEST_LIMIT)
            .collect()
            .await
            .map_err(|e| tonic::Status::invalid_argument(format!("reading the PullImage request: {e}")))?
            .to_bytes();
        let remembered = match decode_unary(&bytes) {
            Some(pull) => self.remember(&pull),
            // Compressed, or not a PullImageRequest: containerd answers it as it sees fit.
            None => {
                tracing::debug!("a PullImage request Strata cannot read; forwarded without keeping its login");
                None
            }
        };
        Ok((http::Request::from_parts(parts, Body::new(Full::new(bytes))), remembered))
    }

    /// Counts a pull in `strata_snapshotter_cri_pulls_total` by what became of its login.
    fn count(&self, login: &'static str) {
        self.metrics.cri_pulls.get_or_create(&CriPullLabel { login }).inc();
    }

    fn remember(&self, pull: &PullImageRequest) -> Option<Remembered> {
        let spec = pull.image.as_ref()?;
        let Some(auth) = &pull.auth else {
            self.count("none");
            return None;
        };
        let image = match ImageRef::parse(&spec.image) {
            Ok(i) => i,
            Err(e) => {
                tracing::debug!(error = %e, "a CRI pull of an image reference Strata does not read");
                self.count("unusable");
                return None;
            }
        };
        match login_of(auth) {
            Ok(Some(login)) => {
                tracing::debug!(image = %image, user = %login.username, "kept the login of a CRI pull for its lazy reads");
                Some(self.keychain.remember(&image, login, &auth.server_address))
            }
            Ok(None) => {
                self.count("none");
                None
            }
            Err(e) => {
                tracing::warn!(image = %image, "the login of a CRI pull cannot be used for lazy reads: {e}");
                self.count("unusable");
                None
            }
        }
    }
}

/// A pull's login until its answer says whether to keep it.
struct Pending {
    keychain: Arc<Keychain>,
    remembered: Option<Remembered>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(r) = self.remembered.take() {
            self.keychain.undo(r);
        }
    }
}

/// Whether a gRPC answer is not a failure: HTTP 200 without a non-zero `grpc-status` in its
/// headers (a failure without a message is all headers).
fn succeeded(answer: &http::Response<Body>) -> bool {
    answer.status() == http::StatusCode::OK && answer.headers().get("grpc-status").is_none_or(|s| s.as_bytes() == b"0")
}

/// Whether the call's own deadline (its `grpc-timeout`) ran out, rather than containerd being
/// out of reach.
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.is::<tonic::TimeoutExpired>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// The message of a unary gRPC request body: one uncompressed length-prefixed frame.
fn decode_unary(body: &[u8]) -> Option<PullImageRequest> {
    let (&[compressed, a, b, c, d], message) = body.split_first_chunk::<5>()?;
    let len = u32::from_be_bytes([a, b, c, d]) as usize;
    if compressed != 0 || message.len() != len {
        return None;
    }
    PullImageRequest::decode(message).ok()
}

/// Serves the image service on `listener`, forwarding to containerd's socket, until
/// `shutdown` completes; then removes the socket. containerd is dialled at each call that
/// finds no connection, so it may start after Strata, as the systemd units order them.
pub async fn serve(
    listener: UnixListener,
    containerd_socket: PathBuf,
    keychain: Arc<Keychain>,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), crate::server::ServeError> {
    let path = listener.local_addr().ok().and_then(|a| a.as_pathname().map(Path::to_owned));
    let shared = Arc::new(Shared {
        containerd: crate::server::lazy_channel(&containerd_socket),
        containerd_socket,
        keychain,
        metrics,
    });
    let v1 = Forward::<V1> { shared: shared.clone(), version: PhantomData };
    let v1alpha2 = Forward::<V1Alpha2> { shared, version: PhantomData };
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let served = tonic::transport::Server::builder()
        .add_service(v1)
        .add_service(v1alpha2)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    if let Some(p) = path {
        let _ = std::fs::remove_file(p);
    }
    Ok(served?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::cri::{AuthConfig, ImageSpec};

    fn framed(message: &[u8]) -> Vec<u8> {
        let mut body = vec![0];
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(message);
        body
    }

    /// With containerd down, kubelet gets Unavailable naming containerd's socket (and retries),
    /// not a hang or a bare transport error.
    #[tokio::test]
    async fn a_call_while_containerd_is_down_is_unavailable_and_names_its_socket() {
        use crate::proto::cri::image_service_client::ImageServiceClient;
        let dir = tempfile::tempdir().unwrap();
        let (socket, containerd) = (dir.path().join("image.sock"), dir.path().join("containerd.sock"));
        let listener = crate::server::bind(&socket).await.unwrap();
        let keychain = Arc::new(Keychain::default());
        let metrics = Metrics::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(serve(listener, containerd.clone(), keychain.clone(), metrics.clone(), async {
            let _ = stopped.await;
        }));
        let mut client = ImageServiceClient::new(crate::server::channel(&socket).await.unwrap());
        let pull = PullImageRequest {
            image: Some(ImageSpec { image: "reg.io/app:1".into(), ..Default::default() }),
            auth: Some(AuthConfig { username: "u".into(), password: "p".into(), ..Default::default() }),
        };
        let e = client.pull_image(pull).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        assert!(e.message().contains(&containerd.display().to_string()), "{e}");
        // The pull failed, so its login does not take the place of one that may work.
        let image = ImageRef::parse("reg.io/app:1").unwrap();
        assert!(keychain.login(&image, "reg.io").is_none());
        assert_eq!(metrics.cri_pulls.get_or_create(&CriPullLabel { login: "failed" }).get(), 1);
        stop.send(()).unwrap();
        served.await.unwrap().unwrap();
        assert!(!socket.exists(), "the socket is removed at shutdown");
    }

    /// A pull kubelet gives up on never ends with an answer: its login is in use while it runs
    /// and gives its place back once the call is gone.
    #[tokio::test]
    async fn a_pull_given_up_on_leaves_no_login() {
        use crate::proto::cri::image_service_client::ImageServiceClient;
        let dir = tempfile::tempdir().unwrap();
        let (socket, containerd) = (dir.path().join("image.sock"), dir.path().join("containerd.sock"));
        // A containerd that takes connections and never answers.
        let silent = UnixListener::bind(&containerd).unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = silent.accept().await {
                held.push(conn);
            }
        });
        let listener = crate::server::bind(&socket).await.unwrap();
        let keychain = Arc::new(Keychain::default());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(serve(listener, containerd, keychain.clone(), Metrics::default(), async {
            let _ = stopped.await;
        }));
        let mut client = ImageServiceClient::new(crate::server::channel(&socket).await.unwrap());
        let pull = PullImageRequest {
            image: Some(ImageSpec { image: "reg.io/app:1".into(), ..Default::default() }),
            auth: Some(AuthConfig { username: "u".into(), password: "p".into(), ..Default::default() }),
        };
        let image = ImageRef::parse("reg.io/app:1").unwrap();
        let call = tokio::spawn(async move { client.pull_image(pull).await });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while keychain.login(&image, "reg.io").is_none() {
            assert!(std::time::Instant::now() < deadline, "the pull's login was never taken");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        call.abort();
        while keychain.login(&image, "reg.io").is_some() {
            assert!(std::time::Instant::now() < deadline, "a pull given up on left its login");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        stop.send(()).unwrap();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(10), served).await;
    }

    #[test]
    fn a_pull_request_is_read_from_its_grpc_frame() {
        let pull = PullImageRequest {
            image: Some(ImageSpec { image: "reg.io/app:1".into(), ..Default::default() }),
            auth: Some(AuthConfig { username: "u".into(), password: "p".into(), ..Default::default() }),
        };
        let body = framed(&pull.encode_to_vec());
        assert_eq!(decode_unary(&body), Some(pull));
        let mut compressed = body.clone();
        compressed[0] = 1;
        assert_eq!(decode_unary(&compressed), None, "a compressed frame is not read as plain");
        assert_eq!(decode_unary(&body[..body.len() - 1]), None, "a short frame is not read");
        assert_eq!(decode_unary(&[0, 0]), None);
    }
}
