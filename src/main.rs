//! The `strata` binary: command-line parsing and wiring. The work lives in the crates.

mod convert_cmd;
mod convert_record;
mod csi_cmd;
mod image_cmd;
mod mirror_cmd;
mod mount_cmd;
mod snapshotter_cmd;
mod supervise_cmd;
mod tier_cmd;

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::sync::Arc;
use strata_snapshotter::peer_blobs::{self, PeerBlobs, RegistryOrigin};
use strata_tiering::agent::Agent;
use strata_tiering::config::{self, Config};

#[derive(Parser, Debug)]
#[command(name = "strata", version, about = "Storage acceleration for AI training clusters")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the node agent: the tiered cache, its admin socket and the metrics endpoint.
    Daemon(DaemonArgs),
    /// Inspect and steer the tiered cache of a running daemon.
    Tier(tier_cmd::TierArgs),
    /// Mount a bucket prefix (or a local directory) through the tiered cache: reads, and checkpoint writes.
    Mount(Box<mount_cmd::MountArgs>),
    /// Inspect the image layers the daemon's snapshotter serves.
    Image(image_cmd::ImageArgs),
    /// Convert an image to eStargz or zstd:chunked, for lazy pulls by Strata or stargz-snapshotter.
    Convert(Box<convert_cmd::ConvertArgs>),
    /// Run a daemon and keep its FUSE connections across its restarts, where systemd does not.
    Supervise(supervise_cmd::SuperviseArgs),
    /// Internal: detaches the mounts of the process that started it if that process dies.
    #[command(name = strata_cachefs::guard::SUBCOMMAND, hide = true)]
    MountGuard,
}

#[derive(clap::Args, Debug)]
struct DaemonArgs {
    /// Config file. Without it, /etc/strata/config.toml is used if present, else built-in defaults.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Overrides `state_dir`.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Overrides `admin.socket`.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Overrides `metrics.listen` (empty disables the endpoint).
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Serves the containerd snapshotter on this socket (sets `snapshotter.enabled` and
    /// `snapshotter.socket`).
    #[arg(long)]
    snapshotter_socket: Option<PathBuf>,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    match &cli.command {
        Command::MountGuard => return strata_cachefs::guard::run(),
        // Before any thread or file exists: the descriptors a service manager passed are
        // claimed first. Under a descriptor store, mounts outlive the process and no guard
        // may detach them.
        Command::Daemon(_) if strata_cachefs::resume::claim() => {}
        // Before any thread or mount exists, so the guard inherits no /dev/fuse descriptor.
        Command::Daemon(_) | Command::Mount(_) => strata_cachefs::guard::start(),
        _ => {}
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Daemon(args) => daemon(args).await,
            Command::Tier(args) => tier_cmd::run(args).await,
            Command::Mount(args) => mount_cmd::run(*args, shutdown_signal()).await,
            Command::Image(args) => image_cmd::run(args).await,
            Command::Convert(args) => convert_cmd::run(*args).await,
            Command::Supervise(args) => return supervise_cmd::run(args).await,
            Command::MountGuard => Ok(()),
        }
        .map(|()| std::process::ExitCode::SUCCESS)
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", render_error(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

fn load_config(path: Option<&PathBuf>) -> anyhow::Result<Config> {
    let default = PathBuf::from(config::DEFAULT_CONFIG);
    match path {
        Some(p) => Ok(Config::load(p)?),
        None if default.exists() => Ok(Config::load(&default)?),
        None => Ok(Config::default()),
    }
}

async fn daemon(args: DaemonArgs) -> anyhow::Result<()> {
    let mut config = load_config(args.config.as_ref())?;
    if let Some(d) = args.state_dir {
        config.state_dir = d;
    }
    if let Some(s) = args.socket {
        config.admin.socket = s;
    }
    if let Some(m) = args.metrics_listen {
        config.metrics.listen = m;
    }
    if let Some(s) = args.snapshotter_socket {
        config.snapshotter.enabled = true;
        config.snapshotter.socket = s;
    }
    strata_cachefs::resume::enable(&config.state_dir).context("cannot keep mounts under the state dir")?;
    let mut agent = Agent::start(config).await.context("cannot start the strata daemon")?;
    let stop = strata_tiering::services::Stop::default();
    let stopped = || stop.stopped();
    let registry = snapshotter_cmd::registry(&agent.config.snapshotter)?;
    let peer_blobs = agent.source.peers().map(|tier| Arc::new(PeerBlobs::new(agent.cache.clone(), tier.clone())));
    if peer_blobs.is_some() {
        // Members ask this node for the blob segments it owns: it fetches them with its logins.
        agent.add_peer_origin(peer_blobs::PATH_PREFIX, Arc::new(RegistryOrigin { registry: registry.clone() }));
    }
    let mirror = mirror_cmd::start(&agent, &registry, peer_blobs.clone(), &stop).await?;
    let snapshots = snapshotter_cmd::start(&agent, &stop, registry, peer_blobs).await?;
    let mounts = mount_cmd::mount_declared(&agent).await;
    let csi = csi_cmd::start(&agent, &stop).await?;
    if let Some(resume) = strata_cachefs::resume::get() {
        resume.notify("READY=1");
        let restoring = snapshots.as_ref().and_then(|s| s.restoring());
        tokio::spawn(async move {
            if let Some(r) = restoring {
                let _ = r.await;
            }
            // Every mount of before the restart that is still configured has been made again by
            // now, and taken its connection over.
            resume.drop_untaken();
        });
        tokio::spawn(hand_over_on_sigusr2());
    }
    tokio::spawn({
        let stop = stop.clone();
        async move {
            shutdown_signal().await;
            stop.stop();
        }
    });
    let extra = snapshots.as_ref().map(|s| s.routes()).unwrap_or_default();
    let served = agent.run_with(stopped(), extra).await;
    // Datasets and image layers together, for the same reason as the mounts within each.
    let layers = async {
        match snapshots {
            Some(running) => running.finish().await,
            None => Ok(()),
        }
    };
    let ((), finished) = tokio::join!(mount_cmd::unmount_all(mounts), layers);
    finished?;
    if let Some(m) = mirror {
        m.await?.context("the registry mirror failed")?;
    }
    if let Some(c) = csi {
        c.await?.context("the CSI node plugin failed")?;
    }
    Ok(served?)
}

/// SIGUSR2 asks for a handover to the next start (an upgrade): the kept mounts stay as they
/// are, and the process ends at once with the status that has its supervisor (or systemd)
/// start it again. What was read and not answered is sent again to the successor.
async fn hand_over_on_sigusr2() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut usr2) = signal(SignalKind::user_defined2()) else { return };
    usr2.recv().await;
    tracing::info!("handing the mounts over to the next start");
    std::process::exit(supervise_cmd::HANDOVER_STATUS);
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler installs");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// The error and its causes, skipping causes that the message above already quotes (our error
/// types put their source in their own message).
fn render_error(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}
