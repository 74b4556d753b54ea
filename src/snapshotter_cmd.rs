//! Wiring of the containerd snapshotter into `strata daemon`.

use anyhow::Context;
use std::sync::Arc;
use strata_snapshotter::server::{self, ServeError};
use strata_snapshotter::service::SnapshotService;
use strata_tiering::agent::Agent;
use tokio::task::JoinHandle;

/// Opens the snapshot store and starts serving it, if the config asks for it. Failing to open
/// the store or bind the socket stops the daemon from starting: containerd would otherwise
/// find a plugin that is configured but absent.
pub async fn start(
    agent: &Agent,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Option<JoinHandle<Result<(), ServeError>>>> {
    let cfg = &agent.config.snapshotter;
    if !cfg.enabled {
        return Ok(None);
    }
    let root = agent.config.snapshotter_root();
    let opened = {
        let root = root.clone();
        tokio::task::spawn_blocking(move || strata_snapshotter::Snapshotter::open(&root)).await?
    };
    let snapshotter = opened.with_context(|| format!("cannot open the snapshotter at {}", root.display()))?;
    let listener = server::bind(&cfg.socket).await?;
    tracing::info!(socket = %cfg.socket.display(), root = %root.display(), "containerd snapshotter serving");
    let service = SnapshotService::new(Arc::new(snapshotter), agent.cache.metrics().clone());
    Ok(Some(tokio::spawn(server::serve(service, listener, shutdown))))
}
