//! The node agent: opens the cache and the cold store, serves the admin API and the metrics
//! endpoint, and applies the policy in the background until told to stop.

use crate::admin::server::{AdminState, router};
use crate::cache::TieredCache;
use crate::config::{Config, ConfigError};
use crate::error::CacheError;
use crate::services;
use crate::source::{ObjectSource, SourceError};
use std::path::{Path, PathBuf};
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
    #[error("peers: {0}")]
    Members(#[from] crate::peer::MembersError),
    #[error("peers.secret_file: {0}")]
    PeerSecret(#[from] crate::peer::auth::AuthError),
    #[error("peers.listen {listen}: {source}")]
    PeerListen { listen: String, source: std::io::Error },
}

/// A started agent; [`Agent::run`] serves until the shutdown future completes.
pub struct Agent {
    pub config: Config,
    pub cache: TieredCache,
    pub source: ObjectSource,
    /// Origins besides the cold store that the peer port fetches from, by path prefix: the
    /// snapshotter's registry for image layers.
    peer_origins: Vec<(String, std::sync::Arc<dyn crate::peer::server::Origin>)>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Agent {
    /// Opens everything; blocking file work runs off the async threads.
    pub async fn start(config: Config) -> Result<Agent, AgentError> {
        let policy = config.load_policy()?;
        let cc = config.cache_config(policy);
        let cache = tokio::task::spawn_blocking(move || TieredCache::open(cc))
            .await
            .map_err(|e| AgentError::Task(e.to_string()))??;
        let mut source = ObjectSource::new(&config.cold, &config.cold_default_dir())?;
        if let Some(p) = &config.peers {
            source = source.with_peers(peer_tier(p).await?);
        }
        // An unreachable cold store is not fatal: cached chunks can still be served, and the
        // store may come back. Say so loudly, once.
        match source.probe().await {
            Ok(()) => info!(cold = source.describe(), "cold store reachable"),
            Err(e) => warn!(error = %e, "cold store not reachable at start-up; serving cached chunks only until it is"),
        }
        Ok(Agent { config, cache, source, peer_origins: Vec::new() })
    }

    /// Has the peer port fetch chunks whose paths start with `prefix` from `origin`.
    pub fn add_peer_origin(
        &mut self,
        prefix: impl Into<String>,
        origin: std::sync::Arc<dyn crate::peer::server::Origin>,
    ) {
        self.peer_origins.push((prefix.into(), origin));
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
        let stop = services::Stop::default();
        let stopped = || stop.stopped();
        let metrics_task = if self.config.metrics.listen.is_empty() {
            None
        } else {
            let registry = services::registry(&self.cache, &self.source);
            Some(services::serve_metrics(&self.config.metrics.listen, registry, stopped()).await?)
        };
        let policy_task = services::spawn_policy(self.cache.clone(), self.config.policy.interval.0, stopped());
        let peer_task = match (&self.config.peers, self.source.peers()) {
            (Some(p), Some(tier)) => Some(self.serve_peers(p, tier, stopped()).await?),
            _ => None,
        };

        let state = AdminState::new(self.cache.clone(), self.source.clone(), self.config.policy_file());
        info!(socket = %socket.display(), cold = self.source.describe(), "strata daemon ready");
        let admin = axum::serve(listener, router(state).merge(extra)).with_graceful_shutdown(stopped());
        let admin = tokio::spawn(async move { admin.await });
        shutdown.await;
        info!("shutting down");
        stop.stop();
        let _ = admin.await;
        let _ = policy_task.await;
        if let Some(t) = peer_task {
            let _ = t.await;
        }
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

/// The peer tier `p` configures: its members followed, its secret read.
async fn peer_tier(p: &crate::peer::PeersConfig) -> Result<std::sync::Arc<crate::peer::PeerTier>, AgentError> {
    use crate::peer::{Membership, PeerTier, SelfName, auth::PeerSecret, client::PeerClient};
    let secret = PeerSecret::from_file(&p.secret_file)?;
    let membership = Membership::start(p.source(), p.refresh.0).await?;
    let me = match &p.advertise {
        Some(name) => SelfName::Named(name.clone()),
        None => SelfName::Detect { port: p.listen_port() },
    };
    let client = PeerClient::new(secret, p.timeouts());
    Ok(PeerTier::new(me, membership, client, p.failover(), Default::default(), p.not_shared.clone()))
}

impl Agent {
    /// Binds the peer port and serves it until `stop`: binding first, so that a taken port is
    /// an error at start.
    async fn serve_peers(
        &self,
        p: &crate::peer::PeersConfig,
        tier: &std::sync::Arc<crate::peer::PeerTier>,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> Result<tokio::task::JoinHandle<std::io::Result<()>>, AgentError> {
        use crate::peer::server::{ServeState, serve};
        let listener = tokio::net::TcpListener::bind(&p.listen)
            .await
            .map_err(|source| AgentError::PeerListen { listen: p.listen.clone(), source })?;
        let state = ServeState {
            secret: crate::peer::auth::PeerSecret::from_file(&p.secret_file)?,
            cache: self.cache.clone(),
            origin: std::sync::Arc::new(crate::peer::server::Origins {
                by_prefix: self.peer_origins.clone(),
                default: std::sync::Arc::new(self.source.clone()),
            }),
            metrics: tier.metrics_handle(),
            hot: crate::peer::hot::HotChunks::new(p.hot_fanout),
            not_shared: std::sync::Arc::new(p.not_shared.clone()),
            listings: Some((self.source.clone(), self.source.listings())),
            tier: Some(tier.clone()),
        };
        info!(listen = %p.listen, members = tier.members().len(), "serving peers");
        Ok(tokio::spawn(serve(listener, state, stop)))
    }
}

/// Binds the admin socket: another daemon's live socket is an error, a dead one's is replaced.
async fn bind_socket(path: &Path) -> Result<tokio::net::UnixListener, AgentError> {
    crate::unix_socket::bind_private(path)
        .await
        .map_err(|e| AgentError::Socket { path: path.to_path_buf(), message: e.to_string() })
}
