//! Serving the Snapshots service on a unix socket, where containerd's proxy plugin dials it,
//! and connecting to it (for tools and tests).

use crate::proto::snapshots_client::SnapshotsClient;
use crate::service::SnapshotService;
use std::path::Path;
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("the snapshotter socket: {0}")]
    Bind(#[from] strata_tiering::unix_socket::BindError),
    #[error("the snapshotter's gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Binds `socket` (replacing a stale socket file, never a live one) with mode 0600, since the
/// service hands out mounts of every container's rootfs.
pub async fn bind(socket: &Path) -> Result<UnixListener, ServeError> {
    Ok(strata_tiering::unix_socket::bind_private(socket).await?)
}

/// Serves until `shutdown` completes, then removes the socket.
pub async fn serve(
    service: SnapshotService,
    listener: UnixListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let path = listener.local_addr().ok().and_then(|a| a.as_pathname().map(Path::to_owned));
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let served = tonic::transport::Server::builder()
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    if let Some(p) = path {
        let _ = std::fs::remove_file(p);
    }
    Ok(served?)
}

/// A gRPC channel to the unix socket `socket`.
pub async fn channel(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    // The URI is required by the API but unused: every connection goes to the socket.
    Endpoint::from_static("http://[::1]:1").connect_with_connector(unix_connector(socket)).await
}

/// A gRPC channel to `socket` that connects at its first call, and again after a failure:
/// for a server that may start later or restart.
pub fn lazy_channel(socket: &Path) -> Channel {
    Endpoint::from_static("http://[::1]:1").connect_with_connector_lazy(unix_connector(socket))
}

fn unix_connector(
    socket: &Path,
) -> impl tower::Service<
    tonic::codegen::http::Uri,
    Response = hyper_util::rt::TokioIo<UnixStream>,
    Error = std::io::Error,
    Future = impl Future<Output = std::io::Result<hyper_util::rt::TokioIo<UnixStream>>> + Send,
> + Clone
+ Send
+ 'static {
    let socket = socket.to_owned();
    tower::service_fn(move |_| {
        let socket = socket.clone();
        async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(UnixStream::connect(socket).await?)) }
    })
}

/// A client of the Snapshots service at `socket`.
pub async fn connect(socket: &Path) -> Result<SnapshotsClient<Channel>, tonic::transport::Error> {
    Ok(SnapshotsClient::new(channel(socket).await?))
}
