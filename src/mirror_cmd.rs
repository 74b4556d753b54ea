//! Wiring of the registry mirror (`[mirror]`) into `strata daemon`.

use anyhow::Context;
use std::sync::Arc;
use strata_snapshotter::mirror::{self, MirrorState};
use strata_snapshotter::peer_blobs::PeerBlobs;
use strata_snapshotter::registry::Registry;
use strata_tiering::agent::Agent;
use strata_tiering::services::Stop;
use tokio::task::JoinHandle;

/// Binds the mirror's port and serves it until the daemon stops, if `[mirror]` asks for it:
/// binding first, so that a taken port stops the daemon at start. `registry` never asks the
/// mirror itself, which a hosts.toml shared with containerd names.
pub async fn start(
    agent: &Agent,
    registry: &Arc<Registry>,
    peers: Option<Arc<PeerBlobs>>,
    stop: &Stop,
) -> anyhow::Result<Option<JoinHandle<std::io::Result<()>>>> {
    let Some(cfg) = &agent.config.mirror else { return Ok(None) };
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .with_context(|| format!("mirror.listen {}: cannot bind", cfg.listen))?;
    let addr = listener.local_addr()?;
    registry.skip_origin(format!("http://{addr}"));
    if addr.ip().is_loopback() || addr.ip().is_unspecified() {
        registry.skip_origin(format!("http://127.0.0.1:{}", addr.port()));
        registry.skip_origin(format!("http://localhost:{}", addr.port()));
    }
    let shared = peers.is_some();
    let state = MirrorState::new(registry.clone(), peers, cfg.access_ttl.0, agent.cache.metrics().clone());
    tracing::info!(listen = %addr, peers = shared, "registry mirror serving");
    Ok(Some(tokio::spawn(mirror::serve(listener, state, stop.stopped()))))
}
