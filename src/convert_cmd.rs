//! `strata convert SRC DST`: an image from a registry or an OCI layout directory, converted to
//! eStargz or zstd:chunked and written to a registry or a layout directory, with a progress bar
//! per layer.

use clap::{Args, ValueEnum};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use strata_snapshotter::convert::layer::Converted;
use strata_snapshotter::convert::{self, IfConverted, Job, Options, Pattern, Place};
use strata_snapshotter::registry::Registry;
use strata_snapshotter::registry::auth::Credentials;
use strata_snapshotter::registry::hosts::Hosts;
use strata_tiering::units::ByteSize;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    /// gzip eStargz, as stargz-snapshotter and Strata read it lazily.
    Estargz,
    /// zstd:chunked as stargz-snapshotter writes it (zstd frames, TOC in a skippable frame).
    ZstdChunked,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum OnConverted {
    /// Copy the image as it is.
    Skip,
    /// Convert it again, with new TOCs and landmarks.
    Reconvert,
    /// Stop with an error.
    Error,
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// The image to convert: a registry reference (`host/repo:tag`), or `oci:DIR[:TAG]`.
    src: String,
    /// Where to write it: a registry reference with a tag, or `oci:DIR:TAG`.
    dst: String,
    #[arg(long, value_enum, default_value = "estargz")]
    format: Format,
    /// Chunk size inside large files: each chunk is fetched on its own.
    #[arg(long, default_value = "4MiB", value_parser = ByteSize::parse)]
    chunk_size: ByteSize,
    /// gzip level, 0 (fastest) to 9 (smallest; the default, as ctr-remote's); zstd level, 1 to
    /// 22 (default 3, as ctr-remote's).
    #[arg(long)]
    compression_level: Option<u32>,
    /// Paths or globs (one per line, in access order) to place before `.prefetch.landmark`,
    /// so they are fetched before a container starts.
    #[arg(long)]
    prefetch_list: Option<PathBuf>,
    /// Layers converted at once (default: the number of CPUs). The output does not depend on it.
    #[arg(long)]
    jobs: Option<usize>,
    /// What to do with an image whose layers are all in the format asked for already.
    #[arg(long, value_enum, default_value = "skip")]
    if_converted: OnConverted,
    /// containerd's registry host directory (`hosts.toml` files).
    #[arg(long, default_value = "/etc/containerd/certs.d")]
    hosts_dir: PathBuf,
    /// Registry logins (docker's `config.json`). Default: $DOCKER_CONFIG/config.json, else ~/.docker/config.json.
    #[arg(long)]
    docker_config: Option<PathBuf>,
    /// Scratch directory for layers being converted (default: the system's temporary directory).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    #[command(flatten)]
    record: crate::convert_record::RecordArgs,
}

/// One bar per layer while it converts; a line per finished layer when stderr is not a terminal.
struct Bars {
    multi: MultiProgress,
    bars: Mutex<HashMap<String, ProgressBar>>,
}

fn short(d: &str) -> &str {
    let hex = d.strip_prefix("sha256:").unwrap_or(d);
    &hex[..hex.len().min(12)]
}

impl convert::Progress for Bars {
    fn layer_started(&self, digest: &str, size: u64) {
        let bar = self.multi.add(ProgressBar::new_spinner());
        bar.set_style(
            ProgressStyle::with_template("{spinner} {prefix} {msg} {bytes} written ({bytes_per_sec})")
                .expect("a valid template"),
        );
        bar.set_prefix(format!("layer {}", short(digest)));
        bar.set_message(format!("({})", ByteSize(size)));
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        self.bars.lock().unwrap_or_else(|p| p.into_inner()).insert(digest.to_owned(), bar);
    }

    fn advanced(&self, digest: &str, bytes: u64) {
        if let Some(b) = self.bars.lock().unwrap_or_else(|p| p.into_inner()).get(digest) {
            b.inc(bytes);
        }
    }

    fn layer_done(&self, digest: &str, c: &Converted) {
        let line = format!(
            "layer {} -> {}: {}, {} entries before the landmark",
            short(digest),
            short(&c.written.digest),
            ByteSize(c.written.size),
            c.prefetched
        );
        match self.bars.lock().unwrap_or_else(|p| p.into_inner()).remove(digest) {
            Some(b) if !self.multi.is_hidden() => b.finish_with_message(line),
            Some(b) => {
                b.finish_and_clear();
                eprintln!("{line}");
            }
            None => eprintln!("{line}"),
        }
    }

    fn note(&self, message: &str) {
        let _ = self.multi.println(message);
        if self.multi.is_hidden() {
            eprintln!("{message}");
        }
    }
}

fn docker_config(arg: Option<PathBuf>) -> PathBuf {
    arg.or_else(|| std::env::var_os("DOCKER_CONFIG").map(|d| PathBuf::from(d).join("config.json")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker/config.json")))
        .unwrap_or_else(|| "/root/.docker/config.json".into())
}

pub async fn run(args: ConvertArgs) -> anyhow::Result<()> {
    let format = match args.format {
        Format::Estargz => convert::Format::Estargz,
        Format::ZstdChunked => convert::Format::ZstdChunked,
    };
    let level = args.compression_level.unwrap_or(format.default_level());
    let levels = if format == convert::Format::Estargz { 0..=9 } else { 1..=22 };
    if !levels.contains(&level) {
        anyhow::bail!("--compression-level {level} is outside {levels:?} for {:?}", args.format);
    }
    let prefetch = match &args.prefetch_list {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| anyhow::anyhow!("the prefetch list {}: {e}", p.display()))?
            .lines()
            .filter_map(Pattern::parse)
            .collect(),
        None => Vec::new(),
    };
    let max_chunk = strata_snapshotter::estargz::toc::MAX_CHUNK_SIZE;
    if args.chunk_size.0 == 0 || args.chunk_size.0 > max_chunk {
        anyhow::bail!(
            "--chunk-size must be more than 0 and at most {} (readers refuse larger chunks), not {}",
            ByteSize(max_chunk),
            args.chunk_size
        );
    }
    let work_parent = args.work_dir.unwrap_or_else(std::env::temp_dir);
    let work = tempfile::Builder::new()
        .prefix("strata-convert-")
        .tempdir_in(&work_parent)
        .map_err(|e| anyhow::anyhow!("a scratch directory under {}: {e}", work_parent.display()))?;
    if args.record.record && args.prefetch_list.is_some() {
        anyhow::bail!("--record and --prefetch-list both give the prefetch list: choose one");
    }
    if !args.record.record && !args.record.cmd.is_empty() {
        anyhow::bail!("a command after `--` is only run with --record");
    }
    let mut job = Job {
        src: Place::parse(&args.src)?,
        dst: Place::parse(&args.dst)?,
        options: Options { format, chunk_size: args.chunk_size.0, level, threads: 1 },
        prefetch,
        prefetch_by_layer: HashMap::new(),
        jobs: args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2)),
        if_converted: match args.if_converted {
            OnConverted::Skip => IfConverted::Skip,
            OnConverted::Reconvert => IfConverted::Reconvert,
            OnConverted::Error => IfConverted::Error,
        },
        work: work.path().to_owned(),
    };
    let registry =
        Registry::new(Hosts::new(Some(&args.hosts_dir)), Credentials::load(&docker_config(args.docker_config))?);
    let bars = Bars { multi: MultiProgress::new(), bars: Mutex::new(HashMap::new()) };
    if args.record.record {
        job.prefetch_by_layer =
            crate::convert_record::record(&args.record, &job, &args.hosts_dir, &registry, &bars).await?;
    }
    let report = convert::image::run(&job, &registry, &bars).await?;
    let what = if report.skipped { "copied (already in that format)" } else { "converted" };
    println!("{} {what}: {} ({} layers converted)", args.dst, report.digest, report.layers.len());
    Ok(())
}
