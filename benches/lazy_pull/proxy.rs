//! A TCP proxy that stands for the distance between a node and its registry: every byte is held
//! for half the round trip in each direction, and a new connection waits one round trip before
//! anything flows, as a TCP handshake would. The kernel (tc, see `shaper.rs`) limits the rate;
//! this adds what netem would, on a kernel without it. It counts the bytes sent to clients.
//! With `STRATA_BENCH_TRACE=1` it prints each connection, request line, range and response
//! status as it passes, with the milliseconds since the proxy started: a pull's timeline.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Bytes in flight per direction: well above 1 Gbit/s × 20 ms, so the delay never caps the rate.
const IN_FLIGHT: usize = 512;
const READ_SIZE: usize = 64 << 10;

#[derive(Debug)]
pub struct DelayProxy {
    pub addr: SocketAddr,
    sent: Arc<AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl DelayProxy {
    /// Listens on a free loopback port and forwards to `upstream` with `rtt` of delay.
    pub async fn start(upstream: SocketAddr, rtt: Duration) -> std::io::Result<DelayProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let sent = Arc::new(AtomicU64::new(0));
        let counter = sent.clone();
        let epoch = trace_epoch();
        let accept = tokio::spawn(async move {
            while let Ok((client, peer)) = listener.accept().await {
                let counter = counter.clone();
                trace(format_args!("connection from {peer}"));
                tokio::spawn(async move {
                    if let Err(e) = connection(client, upstream, rtt, counter, epoch).await {
                        eprintln!("delay proxy: connection ended: {e}");
                    }
                });
            }
        });
        Ok(DelayProxy { addr, sent, accept })
    }

    /// Bytes sent to clients so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn connection(
    client: TcpStream,
    upstream: SocketAddr,
    rtt: Duration,
    sent: Arc<AtomicU64>,
    trace: Option<Instant>,
) -> std::io::Result<()> {
    client.set_nodelay(true)?;
    let server = TcpStream::connect(upstream).await?;
    server.set_nodelay(true)?;
    // The handshake's round trip: the client's first bytes reach the server one RTT late.
    tokio::time::sleep(rtt).await;
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let half = rtt / 2;
    let up = tokio::spawn(pipe(cr, sw, half, None, trace));
    let down = pipe(sr, cw, half, Some(sent), trace).await;
    up.abort();
    down
}

/// Copies `from` to `to`, each read released `delay` after it arrived.
async fn pipe(
    mut from: impl AsyncReadExt + Unpin + Send + 'static,
    mut to: impl AsyncWriteExt + Unpin,
    delay: Duration,
    sent: Option<Arc<AtomicU64>>,
    trace: Option<Instant>,
) -> std::io::Result<()> {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(IN_FLIGHT);
    let reader = tokio::spawn(async move {
        loop {
            let mut buf = vec![0u8; READ_SIZE];
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.send((Instant::now() + delay, buf)).await.is_err() {
                        break;
                    }
                }
            }
        }
    });
    while let Some((due, buf)) = rx.recv().await {
        tokio::time::sleep_until(due).await;
        if let Some(t0) = trace {
            print_heads(t0, &buf);
        }
        to.write_all(&buf).await?;
        if let Some(s) = &sent {
            s.fetch_add(buf.len() as u64, Ordering::Relaxed);
        }
    }
    reader.abort();
    to.shutdown().await
}

/// Prints the request lines, ranges and status lines that start in `buf`: enough for a
/// timeline, since the bench's requests and response heads each fit in one read.
fn print_heads(t0: Instant, buf: &[u8]) {
    let text = String::from_utf8_lossy(&buf[..buf.len().min(2048)]);
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    for line in text.lines() {
        let head = ["GET ", "HEAD ", "POST ", "PUT ", "HTTP/1."].iter().any(|p| line.starts_with(p));
        if head || line.to_ascii_lowercase().starts_with("range:") {
            eprintln!("{ms:8.1} ms {line}");
        }
    }
}

/// When tracing is on, the instant its times count from.
fn trace_epoch() -> Option<Instant> {
    static EPOCH: std::sync::OnceLock<Option<Instant>> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(|| {
        std::env::var_os("STRATA_BENCH_TRACE").map(|_| {
            let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            eprintln!("trace: 0 ms is {:.3} s after the Unix epoch", wall.as_secs_f64());
            Instant::now()
        })
    })
}

/// Prints `what` on the timeline, when tracing is on.
pub fn trace(what: std::fmt::Arguments) {
    if let Some(t0) = trace_epoch() {
        eprintln!("{:8.1} ms {what}", t0.elapsed().as_secs_f64() * 1e3);
    }
}
