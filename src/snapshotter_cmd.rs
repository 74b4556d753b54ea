//! Wiring of the containerd snapshotter into `strata daemon`.

use anyhow::Context;
use std::sync::Arc;
use strata_snapshotter::image_proxy;
use strata_snapshotter::lazy::Lazy;
use strata_snapshotter::peer_blobs::PeerBlobs;
use strata_snapshotter::registry::Registry;
use strata_snapshotter::registry::auth::Credentials;
use strata_snapshotter::registry::hosts::Hosts;
use strata_snapshotter::remote::RemoteOptions;
use strata_snapshotter::server::{self, ServeError};
use strata_snapshotter::service::SnapshotService;
use strata_tiering::agent::Agent;
use strata_tiering::services::Stop;
use tokio::task::JoinHandle;

/// Where the logins of CRI pulls are kept across restarts, in the snapshotter's root.
const CRI_LOGINS_FILE: &str = "cri-logins.json";

/// How long a stop waits for kubelet's calls in flight (a pull may take minutes) before it
/// cuts them: kubelet retries, and the lazy layers must be unmounted in systemd's stop time.
const PROXY_STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// The running snapshotter: its server task, the image service proxy's if configured, and its
/// lazy layers to unmount at the end.
pub struct Running {
    task: JoinHandle<Result<(), ServeError>>,
    proxy: Option<JoinHandle<Result<(), ServeError>>>,
    lazy: Option<Arc<Lazy>>,
    /// The mounting again of the remote layers from before a restart.
    restoring: std::sync::Mutex<Option<JoinHandle<()>>>,
}

/// Opens the snapshot store, starts serving, and mounts the remote layers it holds again, if
/// the config asks for it. Failing to open the store or bind the socket stops the daemon from
/// starting: containerd would otherwise find a plugin that is configured but absent. A remote
/// layer that cannot be mounted again is reported and does not.
/// The registry client of the node's lazy layers, its mirror and its peer port, with the logins
/// and hosts.toml of `[snapshotter]`.
pub fn registry(cfg: &strata_tiering::config::SnapshotterConfig) -> anyhow::Result<Arc<Registry>> {
    let credentials = Credentials::load(&cfg.docker_config)?;
    Ok(Arc::new(Registry::new(Hosts::new(Some(&cfg.hosts_dir)), credentials)))
}

pub async fn start(
    agent: &Agent,
    stop: &Stop,
    registry: Arc<Registry>,
    peers: Option<Arc<PeerBlobs>>,
) -> anyhow::Result<Option<Running>> {
    let cfg = &agent.config.snapshotter;
    if !cfg.enabled {
        return Ok(None);
    }
    let root = agent.config.snapshotter_root();
    let opened = {
        let root = root.clone();
        tokio::task::spawn_blocking(move || strata_snapshotter::Snapshotter::open(&root)).await?
    };
    let snapshotter = Arc::new(opened.with_context(|| format!("cannot open the snapshotter at {}", root.display()))?);
    let mut service = SnapshotService::new(snapshotter.clone(), agent.cache.metrics().clone());
    let mut proxy = None;
    let mut restoring = None;
    let lazy = if cfg.lazy {
        if let Some(socket) = &cfg.image_service_socket {
            registry.keychain().keep_in(&root.join(CRI_LOGINS_FILE));
            let listener = server::bind(socket).await?;
            tracing::info!(socket = %socket.display(), containerd = %cfg.containerd_socket.display(), "CRI image service serving, for kubelet's --image-service-endpoint");
            proxy = Some(tokio::spawn(image_proxy::serve(
                listener,
                cfg.containerd_socket.clone(),
                registry.keychain(),
                agent.cache.metrics().clone(),
                stop.stopped(),
            )));
        }
        let opts = RemoteOptions {
            max_toc_size: cfg.max_toc_size.0,
            memory_budget: cfg.layer_memory_budget.0,
            prefetch_timeout: cfg.prefetch_timeout.0,
            prefetch_async_size: cfg.prefetch_async_size.0,
            prefetch_wait: cfg.prefetch_wait,
            background_fetch: cfg.background_fetch,
            background_quiet: cfg.background_quiet.0,
            fetch_whole: cfg.fetch_whole,
            fetch_program: cfg.fetch_image_program,
            metrics: agent.cache.metrics().clone(),
            peers,
            ..RemoteOptions::default()
        };
        let lazy = Arc::new(Lazy::new(registry, agent.cache.clone(), opts));
        // In the background: a registry that is gone must not hold the daemon's start-up, and
        // a container start mounts what it needs itself if it comes first.
        let (l, s) = (lazy.clone(), snapshotter.clone());
        restoring = Some(tokio::spawn(async move {
            let (ok, failed) = l.restore(&s).await;
            if ok + failed > 0 {
                tracing::info!(mounted = ok, failed, "remote layers from before the restart");
            }
        }));
        service = service.with_lazy(lazy.clone());
        Some(lazy)
    } else {
        None
    };
    let listener = server::bind(&cfg.socket).await?;
    tracing::info!(socket = %cfg.socket.display(), root = %root.display(), lazy = cfg.lazy, "containerd snapshotter serving");
    let restoring = std::sync::Mutex::new(restoring);
    Ok(Some(Running { task: tokio::spawn(server::serve(service, listener, stop.stopped())), proxy, lazy, restoring }))
}

impl Running {
    /// The mounting again of the layers from before a restart, once.
    pub fn restoring(&self) -> Option<JoinHandle<()>> {
        self.restoring.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// The admin routes the snapshotter adds: its layer reports (`strata image layers`).
    pub fn routes(&self) -> axum::Router {
        let lazy = self.lazy.clone();
        let recorded = self.lazy.clone();
        let reset = self.lazy.clone();
        axum::Router::new()
            .route(
                strata_snapshotter::record::ACCESSED_RESET_PATH,
                axum::routing::post(move |axum::Json(layers): axum::Json<Vec<String>>| {
                    let lazy = reset.clone();
                    async move {
                        let n = match &lazy {
                            Some(l) => l.reset_accessed(&layers).await,
                            None => 0,
                        };
                        axum::Json(n)
                    }
                }),
            )
            .route(
                strata_snapshotter::record::ACCESSED_PATH,
                axum::routing::get(move || {
                    let lazy = recorded.clone();
                    async move {
                        let reports = match &lazy {
                            Some(l) => l.accessed().await,
                            None => Vec::new(),
                        };
                        axum::Json(reports)
                    }
                }),
            )
            .route(
                strata_snapshotter::report::LAYERS_PATH,
                axum::routing::get(move || {
                    let lazy = lazy.clone();
                    async move {
                        let reports = match &lazy {
                            Some(l) => l.report().await,
                            None => Vec::new(),
                        };
                        axum::Json(reports)
                    }
                }),
            )
    }

    /// Waits for the servers to stop, then unmounts the lazy layers.
    pub async fn finish(self) -> anyhow::Result<()> {
        let served = self.task.await?;
        if let Some(mut proxy) = self.proxy {
            match tokio::time::timeout(PROXY_STOP_GRACE, &mut proxy).await {
                Ok(done) => done?.context("the CRI image service proxy failed")?,
                Err(_) => {
                    tracing::info!("kubelet's calls still in flight at stop are cut; kubelet retries them");
                    proxy.abort();
                }
            }
        }
        if let Some(lazy) = self.lazy {
            lazy.unmount_all().await;
        }
        served.context("the containerd snapshotter failed")
    }
}
