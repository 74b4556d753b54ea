//! The plugin's unix socket: binding it where kubelet's node-driver-registrar looks, serving
//! the Identity and Node services on it, and connecting to it as kubelet does (for tests and
//! tools).

use crate::proto::identity_client::IdentityClient;
use crate::proto::node_client::NodeClient;
use crate::service::CsiNode;
use std::path::Path;
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("the CSI socket: {0}")]
    Bind(#[from] strata_tiering::unix_socket::BindError),
    #[error("the CSI gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Binds `socket` (replacing a stale socket file, never a live one) with mode 0600: whoever
/// can call it can mount any bucket the node's credentials reach.
pub async fn bind(socket: &Path) -> Result<UnixListener, SocketError> {
    Ok(strata_tiering::unix_socket::bind_private(socket).await?)
}

/// Serves both services until `shutdown` completes, then removes the socket. The volumes stay
/// mounted: their pods still run.
pub async fn serve(
    node: CsiNode,
    listener: UnixListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), SocketError> {
    let path = listener.local_addr().ok().and_then(|a| a.as_pathname().map(Path::to_owned));
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let (identity, node) = node.into_servers();
    let served = tonic::transport::Server::builder()
        .add_service(identity)
        .add_service(node)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    if let Some(p) = path {
        let _ = std::fs::remove_file(p);
    }
    Ok(served?)
}

async fn channel(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_owned();
    // The URI is required by the API but unused: every connection goes to the socket.
    Endpoint::from_static("http://[::1]:1")
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
}

/// A client of the Identity service at `socket`.
pub async fn connect_identity(socket: &Path) -> Result<IdentityClient<Channel>, tonic::transport::Error> {
    Ok(IdentityClient::new(channel(socket).await?))
}

/// A client of the Node service at `socket`.
pub async fn connect_node(socket: &Path) -> Result<NodeClient<Channel>, tonic::transport::Error> {
    Ok(NodeClient::new(channel(socket).await?))
}
