//! `strata convert --record -- CMD...`: the image is converted once without a prefetch list and
//! pushed under a trial tag, pulled lazily through the node's containerd and Strata snapshotter,
//! and run with CMD. The files each layer's mount saw opened, in order, become that layer's
//! prefetch list for the real conversion. This is `ctr-remote image optimize`'s job, done with
//! what Strata's mounts already see instead of fanotify.

use anyhow::{Context, bail};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;
use strata_snapshotter::convert::{self, IfConverted, Job, Pattern, Place};
use strata_snapshotter::record::{ACCESSED_PATH, ACCESSED_RESET_PATH, AccessReport};
use strata_snapshotter::registry::{ImageRef, Registry};
use strata_tiering::admin::client::AdminClient;

/// Where and how the trial runs.
#[derive(clap::Args, Debug)]
pub struct RecordArgs {
    /// Run the image with CMD (after `--`) through Strata's snapshotter, and use the files it
    /// opens, in order, as the prefetch list.
    #[arg(long)]
    pub record: bool,
    /// The registry tag the trial image is pushed to (default: DST's tag + `-strata-record`).
    #[arg(long)]
    record_image: Option<String>,
    /// How long CMD may run; it is then stopped, and what it opened so far is used.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    record_period: Duration,
    /// Also writes the recorded prefetch list here, a layer's list after a `# layer DIGEST` line.
    #[arg(long)]
    record_out: Option<PathBuf>,
    /// containerd's socket.
    #[arg(long, default_value = "/run/containerd/containerd.sock")]
    containerd_address: PathBuf,
    /// containerd namespace for the trial image and container.
    #[arg(long, default_value = "strata-record")]
    containerd_namespace: String,
    /// The name containerd knows Strata's snapshotter by.
    #[arg(long, default_value = "strata")]
    snapshotter: String,
    /// The Strata daemon's admin socket.
    #[arg(long, env = "STRATA_SOCKET", default_value = strata_tiering::config::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// The command to run in the image, after `--`.
    #[arg(last = true)]
    pub cmd: Vec<String>,
}

async fn run_tool(tool: &str, args: &[String]) -> anyhow::Result<String> {
    let out = tokio::process::Command::new(tool)
        .args(args)
        .output()
        .await
        .with_context(|| format!("running {tool} (from containerd, or stargz-snapshotter for ctr-remote)"))?;
    if !out.status.success() {
        bail!("{tool} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs the trial and returns each input layer's recorded prefetch list.
pub async fn record(
    args: &RecordArgs,
    job: &Job,
    hosts_dir: &std::path::Path,
    registry: &Registry,
    progress: &dyn convert::Progress,
) -> anyhow::Result<HashMap<String, Vec<Pattern>>> {
    if args.cmd.is_empty() {
        bail!(
            "--record needs the command to run, after `--`: strata convert --record SRC DST -- python3 -c 'import json'"
        );
    }
    let trial = match (&args.record_image, &job.dst) {
        (Some(r), _) => ImageRef::parse(r)?,
        (None, Place::Registry(dst)) => ImageRef::parse(&format!("{}-strata-record", dst))?,
        (None, Place::Layout(_)) => {
            bail!("--record into an OCI layout needs --record-image, a registry tag for the trial image")
        }
    };
    progress.note(&format!("record: converting a trial image to {trial}"));
    let trial_job = Job {
        dst: Place::Registry(trial.clone()),
        prefetch: Vec::new(),
        prefetch_by_layer: HashMap::new(),
        if_converted: IfConverted::Reconvert,
        ..job.clone()
    };
    let report = convert::image::run(&trial_job, registry, progress).await?;
    let reference = trial.to_string();
    let address = args.containerd_address.display().to_string();
    let ctr = |rest: &[&str]| -> Vec<String> {
        let mut v = vec!["--address".to_owned(), address.clone(), "-n".to_owned(), args.containerd_namespace.clone()];
        v.extend(rest.iter().map(|s| s.to_string()));
        v
    };
    let mut pull = vec!["image", "rpull", "--snapshotter", &args.snapshotter];
    let hosts = hosts_dir.display().to_string();
    if hosts_dir.is_dir() {
        pull.extend(["--hosts-dir", &hosts]);
    }
    if strata_snapshotter::registry::hosts::is_loopback(&trial.host) {
        pull.push("--plain-http");
    }
    pull.push(&reference);
    progress.note(&format!("record: pulling {reference} lazily through the `{}` snapshotter", args.snapshotter));
    run_tool("ctr-remote", &ctr(&pull)).await?;
    // The layers may have served containers before: start their recordings afresh.
    let admin = AdminClient::new(&args.socket);
    let outputs: Vec<String> = report.layers.iter().map(|(_, o)| o.clone()).collect();
    let mounted: usize = admin.post(ACCESSED_RESET_PATH, &outputs).await.context("the Strata daemon's admin socket")?;
    if mounted == 0 {
        bail!(
            "none of {reference}'s layers is mounted lazily by the Strata daemon at {}: is it containerd's `{}` snapshotter?",
            args.socket.display(),
            args.snapshotter
        );
    }
    let id = format!("strata-record-{}", std::process::id());
    let mut run = vec!["run", "--rm", "--snapshotter", &args.snapshotter, &reference, &id];
    run.extend(args.cmd.iter().map(String::as_str));
    progress.note(&format!("record: running {:?} for up to {:?}", args.cmd, args.record_period));
    match tokio::time::timeout(args.record_period, run_tool("ctr", &ctr(&run))).await {
        Ok(result) => {
            result?;
        }
        Err(_) => {
            // The period is over: stop the command; what it opened so far is the recording.
            let _ = run_tool("ctr", &ctr(&["task", "kill", "-s", "SIGKILL", &id])).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            let _ = run_tool("ctr", &ctr(&["task", "delete", "-f", &id])).await;
            let _ = run_tool("ctr", &ctr(&["container", "delete", &id])).await;
        }
    }
    let reports: Vec<AccessReport> = admin.get(ACCESSED_PATH).await.context("the Strata daemon's admin socket")?;
    let _ = run_tool("ctr", &ctr(&["image", "rm", &reference])).await;
    let mut lists = HashMap::new();
    let mut text = String::new();
    for (input, output) in &report.layers {
        let opened: Vec<String> =
            reports.iter().find(|r| &r.layer == output).map(|r| r.opened.clone()).unwrap_or_default();
        text.push_str(&format!("# layer {input}\n"));
        for p in &opened {
            text.push_str(&format!("/{p}\n"));
        }
        progress.note(&format!("record: layer {input}: {} files opened", opened.len()));
        lists.insert(input.clone(), opened.iter().map(|p| Pattern::literal(p)).collect());
    }
    if let Some(out) = &args.record_out {
        std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(lists)
}
