//! The node agent: opens the cache and the cold store, serves the admin API and the metrics
//! endpoint, and applies the policy in the background until told to stop.

use crate::admin::server::{AdminState, router};
use crate::cache::TieredCache;
use crate::config::{Config, ConfigError};
use crate::error::CacheError;
use crate::source::{ObjectSource, SourceError};
use prometheus_client::registry::Registry;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("admin socket {path}: {message}")]
    Socket { path: PathBuf, message: String },
    #[error("metrics endpoint {listen}: {source}")]
    Metrics { listen: String, source: std::io::Error },
    #[error("internal task failed: {0}")]
    Task(String),
}

/// A started agent; [`Agent::run`] serves until the shutdown future completes.
#[derive(Debug)]
pub struct Agent {
    pub config: Config,
    pub cache: TieredCache,
    pub source: ObjectSource,
}

impl Agent {
    /// Opens everything; blocking file work runs off the async threads.
    pub async fn start(config: Config) -> Result<Agent, AgentError> {
        let policy = config.load_policy()?;
        let cc = config.cache_config(policy);
        let cache = tokio::task::spawn_blocking(move || TieredCache::open(cc))
            .await
            .map_err(|e| AgentError::Task(e.to_string()))??;
        let source = ObjectSource::new(&config.cold, &config.cold_default_dir())?;
        // An unreachable cold store is not fatal: cached chunks can still be served, and the
        // store may come back. Say so loudly, once.
        match source.probe().await {
            Ok(()) => info!(cold = source.describe(), "cold store reachable"),
            Err(e) => warn!(error = %e, "cold store not reachable at start-up; serving cached chunks only until it is"),
        }
        Ok(Agent { config, cache, source })
    }

    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), AgentError> {
        self.run_with(shutdown, axum::Router::new()).await
    }

    /// As [`Agent::run`], with `extra` routes on the admin socket (the snapshotter's reports).
    pub async fn run_with(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
        extra: axum::Router,
    ) -> Result<(), AgentError> {
        let socket = self.config.admin.socket.clone();
        let listener = bind_socket(&socket).await?;
        let mut registry = Registry::default();
        self.cache.metrics().register(&mut registry);
        registry.register(
            crate::metrics::OBJECT_REQUESTS,
            "HTTP requests sent to the object store, retries and listing pages included, by method and status class",
            self.source.requests(),
        );
        let registry = Arc::new(registry);
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);

        let metrics_task = if self.config.metrics.listen.is_empty() {
            None
        } else {
            let listen = self.config.metrics.listen.clone();
            let tcp = tokio::net::TcpListener::bind(&listen)
                .await
                .map_err(|source| AgentError::Metrics { listen: listen.clone(), source })?;
            info!(%listen, "metrics endpoint listening");
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
            let mut rx = stop_rx.clone();
            Some(tokio::spawn(async move {
                let _ = axum::serve(tcp, app)
                    .with_graceful_shutdown(async move {
                        let _ = rx.wait_for(|s| *s).await;
                    })
                    .await;
            }))
        };

        let policy_task = {
            let cache = self.cache.clone();
            let every = self.config.policy.interval.0;
            let mut rx = stop_rx.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = rx.wait_for(|s| *s) => break,
                    }
                    match cache.apply_policy().await {
                        Ok(pass) if pass != Default::default() => info!(?pass, "policy applied"),
                        Ok(_) => {}
                        Err(e) => warn!(error = %e, "policy pass failed"),
                    }
                }
            })
        };

        let state = AdminState::new(self.cache.clone(), self.source.clone(), self.config.policy_file());
        info!(socket = %socket.display(), cold = self.source.describe(), "strata daemon ready");
        let mut rx = stop_rx.clone();
        let admin = tokio::spawn(async move {
            axum::serve(listener, router(state).merge(extra))
                .with_graceful_shutdown(async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await
        });
        shutdown.await;
        info!("shutting down");
        let _ = stop_tx.send(true);
        let _ = admin.await;
        let _ = policy_task.await;
        if let Some(t) = metrics_task {
            let _ = t.await;
        }
        self.cache.wait_background(std::time::Duration::from_secs(10)).await;
        if let Err(e) = self.cache.flush().await {
            warn!(error = %e, "could not persist access history on shutdown");
        }
        let _ = std::fs::remove_file(&socket);
        Ok(())
    }
}

/// Binds the admin socket with mode 0600. A socket file left by a dead daemon is replaced; one
/// that still answers means another daemon runs, which is an error.
async fn bind_socket(path: &Path) -> Result<tokio::net::UnixListener, AgentError> {
    let err = |message: String| AgentError::Socket { path: path.to_path_buf(), message };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| err(format!("cannot create its directory: {e}")))?;
    }
    if path.exists() {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Err(err("another strata daemon is already listening on it".into()));
        }
        std::fs::remove_file(path).map_err(|e| err(format!("cannot remove the stale socket: {e}")))?;
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(|e| err(format!("cannot bind: {e}")))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| err(format!("cannot set mode 0600: {e}")))?;
    Ok(listener)
}
