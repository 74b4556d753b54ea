//! `strata tier ...`: the operator's view of the tiered cache, spoken over the admin socket.

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Duration;
use strata_tiering::TierKind;
use strata_tiering::admin::api::*;
use strata_tiering::admin::client::AdminClient;
use strata_tiering::config;
use strata_tiering::units::{ByteSize, Dur};
use strata_tiering::warmup::{JobState, JobStatus};

#[derive(Args, Debug)]
pub struct TierArgs {
    /// The daemon's admin socket.
    #[arg(long, global = true, env = "STRATA_SOCKET", default_value = config::DEFAULT_SOCKET)]
    socket: PathBuf,
    #[command(subcommand)]
    command: TierCommand,
}

#[derive(Subcommand, Debug)]
enum TierCommand {
    /// Per tier: capacity, used, chunks, hit ratio, bytes in and out.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Show or replace the tiering policy.
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// Keep chunks under these paths (prefixes or globs) in a tier; they are never evicted.
    Pin {
        #[arg(required = true)]
        paths: Vec<String>,
        #[arg(long, default_value = "hot", value_parser = parse_tier)]
        tier: TierKind,
    },
    /// Remove pins set with `pin` (give the same paths).
    Unpin {
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// Preload every object under these paths into a tier.
    Warmup {
        #[arg(required = true)]
        paths: Vec<String>,
        #[arg(long, default_value = "hot", value_parser = parse_tier)]
        tier: TierKind,
        /// Chunk fetches in flight.
        #[arg(long, default_value_t = 16)]
        parallel: usize,
        /// Print only the summary.
        #[arg(long)]
        quiet: bool,
    },
    /// Drop cached chunks under these paths (pinned ones stay).
    Evict {
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// Write an object's bytes to stdout, read through the cache (hot, warm, then cold).
    Cat { path: String },
    /// Move hot chunks idle for at least DURATION to warm now (default: the policy's hot_idle).
    Demote {
        #[arg(long, value_parser = parse_dur)]
        idle: Option<Dur>,
    },
}

#[derive(Subcommand, Debug)]
enum PolicyCommand {
    /// Print the policy in force and the pins.
    Show,
    /// Validate FILE and, if valid, make it the policy (saved to the policy file).
    Set { file: PathBuf },
}

fn parse_tier(s: &str) -> Result<TierKind, String> {
    s.parse()
}

fn parse_dur(s: &str) -> Result<Dur, String> {
    Dur::parse(s)
}

pub async fn run(args: TierArgs) -> anyhow::Result<()> {
    let c = AdminClient::new(&args.socket);
    match args.command {
        TierCommand::Status { json } => {
            let s: StatusReport = c.get(STATUS).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print_status(&s);
            }
        }
        TierCommand::Policy { command: PolicyCommand::Show } => {
            let v: PolicyView = c.get(POLICY).await?;
            println!("# policy file: {}", v.file.display());
            print!("{}", v.policy);
            if !v.pins.is_empty() {
                println!("\n# pins (strata tier pin):");
                for p in v.pins {
                    match &p.newest_of {
                        Some(dir) => println!("#   {} -> {} (newest written into {dir}/)", p.pattern, p.tier),
                        None => println!("#   {} -> {}", p.pattern, p.tier),
                    }
                }
            }
        }
        TierCommand::Policy { command: PolicyCommand::Set { file } } => {
            let text = std::fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?;
            let v: PolicyView = c.put_text(POLICY, text).await?;
            println!("policy from {} is now in force (saved to {})", file.display(), v.file.display());
        }
        TierCommand::Pin { paths, tier } => {
            let m: strata_tiering::Moved = c.post(PIN, &PinRequest { paths: paths.clone(), tier }).await?;
            println!(
                "pinned {} to {tier}: {} cached chunks ({}) now held there",
                paths.join(", "),
                m.chunks,
                ByteSize(m.bytes)
            );
        }
        TierCommand::Unpin { paths } => {
            let r: UnpinResult = c.post(UNPIN, &PathsRequest { paths: paths.clone() }).await?;
            if r.removed == 0 {
                bail!("no pin matches {} (see `strata tier policy show`)", paths.join(", "));
            }
            println!("removed {} pin(s)", r.removed);
        }
        TierCommand::Warmup { paths, tier, parallel, quiet } => {
            let job: JobCreated = c.post(WARMUP, &WarmupRequest { paths, tier, parallel }).await?;
            let last = follow(&c, job.id, quiet).await?;
            print_summary(&last, tier);
            if last.state == JobState::Failed {
                bail!("warm-up incomplete: {} of {} chunks failed", last.chunks_failed, last.chunks_total);
            }
        }
        TierCommand::Evict { paths } => {
            let m: strata_tiering::Moved = c.post(EVICT, &PathsRequest { paths }).await?;
            println!("evicted {} chunks ({})", m.chunks, ByteSize(m.bytes));
            if m.skipped_pinned > 0 {
                println!("kept {} pinned chunks; unpin them first to evict", m.skipped_pinned);
            }
        }
        TierCommand::Cat { path } => {
            let mut out = tokio::io::stdout();
            c.read_to(&path, &mut out).await?;
        }
        TierCommand::Demote { idle } => {
            let m: strata_tiering::Moved = c.post(DEMOTE, &DemoteRequest { idle }).await?;
            println!("demoted {} chunks ({}) from hot to warm", m.chunks, ByteSize(m.bytes));
            if m.skipped_pinned > 0 {
                println!("kept {} chunks pinned to hot", m.skipped_pinned);
            }
        }
    }
    Ok(())
}

async fn follow(c: &AdminClient, id: u64, quiet: bool) -> anyhow::Result<JobStatus> {
    let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new(0) };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} {msg}",
        )
        .expect("static template is valid"),
    );
    loop {
        let s: JobStatus = c.get(&format!("{JOBS}/{id}")).await?;
        bar.set_length(s.bytes_total);
        bar.set_position(s.bytes_done);
        bar.set_message(format!("{}/{} chunks, {} failed", s.chunks_done, s.chunks_total, s.chunks_failed));
        if matches!(s.state, JobState::Done | JobState::Failed) {
            bar.finish_and_clear();
            return Ok(s);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn print_summary(s: &JobStatus, tier: TierKind) {
    let secs = s.elapsed_ms as f64 / 1000.0;
    let rate = if secs > 0.0 { s.bytes_done as f64 / secs } else { 0.0 };
    println!(
        "warm-up into {tier}: {} objects, {}/{} chunks ({} already cached), {} in {:.1}s ({}/s), {} failed",
        s.objects,
        s.chunks_done,
        s.chunks_total,
        s.chunks_cached_before,
        ByteSize(s.bytes_done),
        secs,
        ByteSize(rate as u64),
        s.chunks_failed
    );
    if s.chunks_elsewhere > 0 {
        println!(
            "  {} chunks went to the other tier: {tier} had no room (full of pinned data, or a failing disk)",
            s.chunks_elsewhere
        );
    }
    for e in &s.errors {
        println!("  error: {e}");
    }
}

fn print_status(s: &StatusReport) {
    println!("cold store: {} (chunk size {})", s.cold, ByteSize(s.chunk_size));
    println!(
        "{:<5} {:>10} {:>10} {:>6} {:>9} {:>10} {:>9} {:>10} {:>10}",
        "TIER", "CAPACITY", "USED", "USE%", "CHUNKS", "PINNED", "HIT%", "IN", "OUT"
    );
    for t in &s.cache.tiers {
        println!(
            "{:<5} {:>10} {:>10} {:>5.1}% {:>9} {:>10} {:>8.1}% {:>10} {:>10}",
            t.tier.to_string(),
            ByteSize(t.capacity).to_string(),
            ByteSize(t.used).to_string(),
            100.0 * t.used as f64 / t.capacity.max(1) as f64,
            t.chunks,
            ByteSize(t.pinned).to_string(),
            100.0 * t.hit_ratio,
            ByteSize(t.bytes_in).to_string(),
            ByteSize(t.bytes_out).to_string(),
        );
    }
    println!(
        "cold fetches {} ({}), errors {}; promotions {}, demotions {}, evictions {}, checksum failures {}",
        s.cache.cold_fetches,
        ByteSize(s.cache.cold_bytes),
        s.cache.cold_fetch_errors,
        s.cache.promotions,
        s.cache.demotions,
        s.cache.evictions,
        s.cache.checksum_failures
    );
    if let Some(p) = &s.peers {
        let states: Vec<String> = p.members.iter().map(|m| format!("{} ({})", m.name, m.state)).collect();
        println!("peers: {} members: {}", p.members.len(), states.join(", "));
        println!(
            "peer bytes received {}, served {} (as holder {}); origin bytes {}; errors {} (timeouts {}, corrupt {}); origin fallbacks {}; refused {}",
            ByteSize(p.received_bytes),
            ByteSize(p.served_bytes),
            ByteSize(p.holder_served_bytes),
            ByteSize(p.origin_bytes),
            p.errors,
            p.timeouts,
            p.corrupt,
            p.origin_fallbacks,
            p.refused
        );
        println!(
            "hot-chunk askers sent on {}, redirects followed {}; stalled transfers resumed {}; stood in for owners {}; listings from owners {}, served {}",
            p.redirects, p.redirected, p.resumed, p.stood_in, p.listings_received, p.listings_served
        );
    }
}
