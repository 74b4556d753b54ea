//! Wiring of the CSI node plugin (`[csi]`) into `strata daemon`.

use anyhow::Context;
use strata_csi::CsiNode;
use strata_csi::table::Host;
use strata_tiering::agent::Agent;
use strata_tiering::services::Stop;
use tokio::task::JoinHandle;

/// Binds the plugin's socket and serves it until the daemon stops, if `[csi]` asks for it:
/// binding first, so that a socket another daemon serves stops this one at start.
pub async fn start(
    agent: &Agent,
    stop: &Stop,
) -> anyhow::Result<Option<JoinHandle<Result<(), strata_csi::SocketError>>>> {
    let Some(cfg) = &agent.config.csi else { return Ok(None) };
    let node_id = node_id(&cfg.node_id);
    let listener = strata_csi::bind(&cfg.socket).await.context("csi.socket")?;
    let host = Host {
        cache: agent.cache.clone(),
        store: agent.source.clone(),
        store_config: agent.config.cold.clone(),
        state_dir: agent.config.state_dir.clone(),
    };
    let plugin = CsiNode::new(node_id.clone(), host);
    // Before serving: kubelet's next calls find the volumes of before a restart in place.
    plugin.restore().await;
    tracing::info!(socket = %cfg.socket.display(), node = %node_id, "CSI node plugin serving");
    Ok(Some(tokio::spawn(strata_csi::serve(plugin, listener, stop.stopped()))))
}

fn node_id(configured: &str) -> String {
    if !configured.is_empty() {
        return configured.to_owned();
    }
    if let Ok(n) = std::env::var("NODE_NAME")
        && !n.is_empty()
    {
        return n;
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "localhost".into())
}
