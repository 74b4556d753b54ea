//! The "raw" baseline of `benches/cachefs.sh`: the object store client alone, no filesystem.
//!
//! ```text
//! cargo bench --bench raw_s3 -- get BUCKET KEY [--parallel 8] [--chunk 8MiB]
//! cargo bench --bench raw_s3 -- put BUCKET KEY LOCALFILE [--part 16MiB] [--parallel 4]
//! cargo bench --bench raw_s3 -- put-many BUCKET PREFIX COUNT [--size 1024] [--parallel 64]
//! cargo bench --bench raw_s3 -- get-many BUCKET PREFIX [--parallel 8]
//! ```
//!
//! - `get` reads the whole object as parallel ranged GETs of `--chunk` bytes and drops the bytes.
//! - `put` uploads a local file as a multipart upload of `--part` parts, `--parallel` in flight.
//! - `put-many` writes COUNT objects of `--size` bytes named `PREFIX/dXX/fYYYYY` (XX = i % 100,
//!   YYYYY = i), `--parallel` at once: the tree of the metadata benchmark.
//! - `get-many` lists PREFIX and reads every object under it with one whole GET each,
//!   `--parallel` at once, as a data loader's workers would: the small-file baseline.
//!
//! Each prints `AMOUNT SECONDS` on stdout: bytes for `get`, `put` and `get-many`, objects for
//! `put-many`; `get-many` adds the number of objects.
//! The store comes from `STRATA_TEST_S3_ENDPOINT`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`
//! and `AWS_REGION` (default `us-east-1`). Path-style requests; plain http is allowed.

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{ClientOptions, GetOptions, ObjectStore, ObjectStoreExt, WriteMultipart};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

const USAGE: &str = "usage: raw_s3 get BUCKET KEY [--parallel N] [--chunk SIZE]
       raw_s3 put BUCKET KEY LOCALFILE [--part SIZE] [--parallel N]
       raw_s3 put-many BUCKET PREFIX COUNT [--size SIZE] [--parallel N]
       raw_s3 get-many BUCKET PREFIX [--parallel N]";

/// Positional arguments and `--name value` options. `--bench`, which `cargo bench` appends, is
/// dropped.
struct Args {
    pos: Vec<String>,
    opts: Vec<(String, String)>,
}

impl Args {
    fn parse(raw: impl Iterator<Item = String>) -> anyhow::Result<Self> {
        let (mut pos, mut opts) = (Vec::new(), Vec::new());
        let mut it = raw.filter(|a| a != "--bench");
        while let Some(a) = it.next() {
            match a.strip_prefix("--") {
                Some(name) => {
                    let v = it.next().with_context(|| format!("--{name} needs a value"))?;
                    opts.push((name.to_string(), v));
                }
                None => pos.push(a),
            }
        }
        Ok(Args { pos, opts })
    }

    fn size(&mut self, name: &str, default: u64) -> anyhow::Result<u64> {
        match self.opts.iter().position(|(n, _)| n == name) {
            Some(i) => parse_size(&self.opts.remove(i).1).with_context(|| format!("--{name}")),
            None => Ok(default),
        }
    }

    fn done(&self) -> anyhow::Result<()> {
        if let Some((n, _)) = self.opts.first() {
            bail!("unknown option --{n}\n{USAGE}");
        }
        Ok(())
    }
}

/// `1024`, `4KiB`, `8MiB`, `1GiB` (also `K`/`M`/`G`, all binary).
fn parse_size(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let n: u64 = t[..split].parse().with_context(|| format!("bad size `{s}`"))?;
    let shift = match t[split..].trim_end_matches("iB").trim_end_matches('B') {
        "" => 0,
        "K" | "k" => 10,
        "M" => 20,
        "G" => 30,
        _ => bail!("bad size `{s}`"),
    };
    Ok(n << shift)
}

fn store(bucket: &str) -> anyhow::Result<Arc<AmazonS3>> {
    let var = |k: &str| std::env::var(k).with_context(|| format!("{k} is not set"));
    let s3 = AmazonS3Builder::new()
        .with_bucket_name(bucket)
        .with_endpoint(var("STRATA_TEST_S3_ENDPOINT")?)
        .with_access_key_id(var("AWS_ACCESS_KEY_ID")?)
        .with_secret_access_key(var("AWS_SECRET_ACCESS_KEY")?)
        .with_region(std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into()))
        .with_virtual_hosted_style_request(false)
        // Replaces every client option, allow_http included, so it comes first.
        .with_client_options(ClientOptions::new().with_timeout(Duration::from_secs(300)))
        .with_allow_http(true)
        .build()?;
    Ok(Arc::new(s3))
}

async fn get(s3: Arc<AmazonS3>, key: &str, parallel: usize, chunk: u64) -> anyhow::Result<u64> {
    let loc = Path::from(key);
    let len = s3.head(&loc).await?.size;
    let ranges = (0..len).step_by(chunk as usize).map(|o| o..len.min(o + chunk));
    let fetched: Vec<u64> = futures::stream::iter(ranges)
        .map(|r| {
            let (s3, loc) = (s3.clone(), loc.clone());
            async move {
                let want = r.end - r.start;
                let opts = GetOptions::default().with_range(Some(r));
                let mut body = s3.get_opts(&loc, opts).await?.into_stream();
                let mut got = 0u64;
                while let Some(b) = body.try_next().await? {
                    got += b.len() as u64;
                }
                anyhow::ensure!(got == want, "ranged GET returned {got} bytes, wanted {want}");
                Ok(got)
            }
        })
        .buffer_unordered(parallel)
        .try_collect()
        .await?;
    Ok(fetched.iter().sum())
}

async fn put(s3: Arc<AmazonS3>, key: &str, file: &str, part: usize, parallel: usize) -> anyhow::Result<u64> {
    let mut f = tokio::fs::File::open(file).await.with_context(|| format!("open {file}"))?;
    let mut w = WriteMultipart::new_with_chunk_size(s3.put_multipart(&Path::from(key)).await?, part);
    let (mut buf, mut total) = (vec![0u8; part], 0u64);
    loop {
        let mut n = 0;
        while n < part {
            match f.read(&mut buf[n..]).await? {
                0 => break,
                k => n += k,
            }
        }
        if n == 0 {
            break;
        }
        w.wait_for_capacity(parallel).await?;
        w.write(&buf[..n]);
        total += n as u64;
    }
    w.finish().await?;
    Ok(total)
}

async fn put_many(s3: Arc<AmazonS3>, prefix: &str, count: u64, size: usize, parallel: usize) -> anyhow::Result<u64> {
    let body = Bytes::from(vec![b'x'; size]);
    let prefix = prefix.trim_end_matches('/').to_string();
    futures::stream::iter(0..count)
        .map(|i| {
            let (s3, body) = (s3.clone(), body.clone());
            let loc = Path::from(format!("{prefix}/d{:02}/f{i:05}", i % 100));
            async move { s3.put(&loc, body.into()).await }
        })
        .buffer_unordered(parallel)
        .try_for_each(|_| async { Ok(()) })
        .await?;
    Ok(count)
}

/// Bytes and objects read. The listing is timed too: a mount lists the directory before its
/// readers open the files.
async fn get_many(s3: Arc<AmazonS3>, prefix: &str, parallel: usize) -> anyhow::Result<(u64, u64)> {
    let prefix = Path::from(prefix.trim_end_matches('/'));
    let objects: Vec<_> = s3.list(Some(&prefix)).try_collect().await?;
    anyhow::ensure!(!objects.is_empty(), "nothing under {prefix}");
    let sizes: Vec<u64> = futures::stream::iter(objects)
        .map(|meta| {
            let s3 = s3.clone();
            async move {
                let mut body = s3.get(&meta.location).await?.into_stream();
                let mut got = 0u64;
                while let Some(b) = body.try_next().await? {
                    got += b.len() as u64;
                }
                anyhow::ensure!(got == meta.size, "{}: GET returned {got} bytes of {}", meta.location, meta.size);
                Ok(got)
            }
        })
        .buffer_unordered(parallel)
        .try_collect()
        .await?;
    Ok((sizes.iter().sum(), sizes.len() as u64))
}

async fn run(mut a: Args) -> anyhow::Result<()> {
    let pos = std::mem::take(&mut a.pos);
    let pos: Vec<&str> = pos.iter().map(String::as_str).collect();
    let started = Instant::now();
    let amount = match pos.as_slice() {
        ["get", bucket, key] => {
            let (parallel, chunk) = (a.size("parallel", 8)? as usize, a.size("chunk", 8 << 20)?);
            a.done()?;
            anyhow::ensure!(parallel > 0 && chunk > 0, "--parallel and --chunk must be positive");
            get(store(bucket)?, key, parallel, chunk).await?
        }
        ["put", bucket, key, file] => {
            let (part, parallel) = (a.size("part", 16 << 20)? as usize, a.size("parallel", 4)? as usize);
            a.done()?;
            anyhow::ensure!(parallel > 0 && part >= 5 << 20, "--parallel must be positive, --part at least 5MiB");
            put(store(bucket)?, key, file, part, parallel).await?
        }
        ["put-many", bucket, prefix, count] => {
            let count: u64 = count.parse().with_context(|| format!("bad COUNT `{count}`"))?;
            let (size, parallel) = (a.size("size", 1024)? as usize, a.size("parallel", 64)? as usize);
            a.done()?;
            anyhow::ensure!(parallel > 0, "--parallel must be positive");
            put_many(store(bucket)?, prefix, count, size, parallel).await?
        }
        ["get-many", bucket, prefix] => {
            let parallel = a.size("parallel", 8)? as usize;
            a.done()?;
            anyhow::ensure!(parallel > 0, "--parallel must be positive");
            let (bytes, objects) = get_many(store(bucket)?, prefix, parallel).await?;
            println!("{bytes} {:.6} {objects}", started.elapsed().as_secs_f64());
            return Ok(());
        }
        _ => bail!("{USAGE}"),
    };
    println!("{amount} {:.6}", started.elapsed().as_secs_f64());
    Ok(())
}

fn main() -> std::process::ExitCode {
    let result = Args::parse(std::env::args().skip(1))
        .and_then(|a| tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(a)));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("raw_s3: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
