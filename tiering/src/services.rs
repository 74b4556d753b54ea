//! The background services a node's cache runs beside its mounts: the Prometheus endpoint and
//! the periodic policy pass. Shared by `strata daemon` and a standalone `strata mount`, so a
//! mount with its own tiers is watched and kept within its policy as the daemon's cache is.

use crate::agent::AgentError;
use crate::cache::TieredCache;
use crate::source::ObjectSource;
use prometheus_client::registry::Registry;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tracing::{info, warn};

/// One signal that stops every server of a process; each waits on a future of its own.
#[derive(Debug, Clone)]
pub struct Stop {
    tx: Arc<tokio::sync::watch::Sender<bool>>,
    // Kept so that a send always has a receiver, whoever has started waiting yet.
    rx: tokio::sync::watch::Receiver<bool>,
}

impl Default for Stop {
    fn default() -> Self {
        let (tx, rx) = tokio::sync::watch::channel(false);
        Stop { tx: Arc::new(tx), rx }
    }
}

impl Stop {
    pub fn stop(&self) {
        let _ = self.tx.send(true);
    }

    /// Completes once [`Stop::stop`] has been called, before or after this.
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }
}

/// Every metric of a cache and the store behind it.
pub fn registry(cache: &TieredCache, source: &ObjectSource) -> Registry {
    let mut registry = Registry::default();
    cache.metrics().register(&mut registry);
    registry.register(
        crate::metrics::OBJECT_REQUESTS,
        "HTTP requests sent to the object store, retries and listing pages included, by method and status class",
        source.requests(),
    );
    if let Some(tier) = source.peers() {
        tier.metrics().register(&mut registry);
    }
    registry
}

/// Serves `GET /metrics` on `listen` (`host:port`) until `stop` completes. Binding happens
/// before this returns, so a taken port is an error at start, not a silent gap later.
pub async fn serve_metrics(
    listen: &str,
    registry: Registry,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<JoinHandle<()>, AgentError> {
    let tcp = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| AgentError::Metrics { listen: listen.to_string(), source })?;
    info!(%listen, "metrics endpoint listening");
    let registry = Arc::new(registry);
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let mut out = String::new();
                let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
                ([("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], out)
            }
        }),
    );
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(tcp, app).with_graceful_shutdown(stop).await {
            warn!(error = %e, "metrics endpoint stopped");
        }
    }))
}

/// Applies `cache`'s policy every `every` until `stop` completes: TTL expiry, idle demotion,
/// pins, watermarks, and the access history saved.
pub fn spawn_policy(
    cache: TieredCache,
    every: Duration,
    stop: impl Future<Output = ()> + Send + 'static,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = &mut stop => break,
            }
            match cache.apply_policy().await {
                Ok(pass) if pass != Default::default() => info!(?pass, "policy applied"),
                Ok(_) => {}
                Err(e) => warn!(error = %e, "policy pass failed"),
            }
        }
    })
}
