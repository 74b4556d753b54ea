//! `strata image layers`: what the daemon's snapshotter serves, layer by layer, over the admin
//! socket.

use clap::{Args, Subcommand};
use std::path::PathBuf;
use strata_snapshotter::fill::Stage;
use strata_snapshotter::report::{LAYERS_PATH, LayerReport};
use strata_tiering::admin::client::AdminClient;
use strata_tiering::config;
use strata_tiering::units::ByteSize;

#[derive(Args, Debug)]
pub struct ImageArgs {
    /// The daemon's admin socket.
    #[arg(long, global = true, env = "STRATA_SOCKET", default_value = config::DEFAULT_SOCKET)]
    socket: PathBuf,
    #[command(subcommand)]
    command: ImageCommand,
}

#[derive(Subcommand, Debug)]
enum ImageCommand {
    /// Per layer: lazy, fetched whole by Strata, or left to containerd (and why); bytes fetched
    /// of the blob; prefetch and background fill.
    Layers {
        /// Print JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
}

fn stage(s: Stage) -> &'static str {
    match s {
        Stage::None => "-",
        Stage::Waiting => "waiting",
        Stage::Running => "running",
        Stage::Done => "done",
        Stage::Failed => "failed",
    }
}

fn short(digest: &str) -> &str {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    &hex[..hex.len().min(12)]
}

pub async fn run(args: ImageArgs) -> anyhow::Result<()> {
    let c = AdminClient::new(&args.socket);
    match args.command {
        ImageCommand::Layers { json } => {
            let layers: Vec<LayerReport> = c.get(LAYERS_PATH).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&layers)?);
                return Ok(());
            }
            if layers.is_empty() {
                println!("no image layers served lazily (is [snapshotter] enabled, with lazy = true?)");
                return Ok(());
            }
            println!(
                "{:<14} {:<10} {:>21} {:>9} {:>10} {:>11}  IMAGE",
                "LAYER", "MODE", "FETCHED", "PREFETCH", "BACKGROUND", "CHUNKS"
            );
            for l in &layers {
                if !l.lazy {
                    let why = l.reason.as_deref().unwrap_or("");
                    let mode = if l.how == "whole" { "whole" } else { "containerd" };
                    let fetched = format!("{} / {}", ByteSize(l.fetched_bytes), ByteSize(l.blob_size));
                    println!("{:<14} {:<10} {:>21}  {}  ({why})", short(&l.layer), mode, fetched, l.image);
                    continue;
                }
                let fetched = format!("{} / {}", ByteSize(l.fetched_bytes), ByteSize(l.blob_size));
                let chunks = format!("{}/{}", l.chunks_cached, l.chunks_total);
                println!(
                    "{:<14} {:<10} {:>21} {:>9} {:>10} {:>11}  {}",
                    short(&l.layer),
                    "lazy",
                    fetched,
                    stage(l.prefetch),
                    stage(l.background),
                    chunks,
                    l.image
                );
                if let Some(e) = &l.error {
                    println!("{:<14} error: {e}", "");
                }
            }
        }
    }
    Ok(())
}
