//! Simulated nodes on this machine: a Linux bridge at 198.18.0.1 and a network namespace per
//! node at 198.18.0.11 and up, each joined to the bridge by a veth pair; and a relay that
//! forwards a port on the bridge, delaying, rate-limiting, counting or corrupting what comes
//! back. Used by the peer-tier tests and `benches/cluster`.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip runs");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The bridge and `nodes` namespaces, removed when dropped.
pub struct Net {
    tag: String,
    nodes: usize,
    /// Held while the bridge lives: every Net puts its bridge at 198.18.0.1, so tests run in
    /// processes side by side (nextest) take turns.
    _turn: std::fs::File,
}

const TURN_LOCK: &str = "/run/strata-test-net.lock";

impl Net {
    pub fn bridge(&self) -> String {
        format!("{}b", self.tag)
    }

    pub fn ns(&self, i: usize) -> String {
        format!("{}n{i}", self.tag)
    }

    /// The host side of node `i`'s veth: its egress is what node `i` receives.
    pub fn host_veth(&self, i: usize) -> String {
        format!("{}h{i}", self.tag)
    }

    pub fn addr(i: usize) -> String {
        format!("198.18.0.{}", 11 + i)
    }

    pub fn new(nodes: usize) -> Net {
        assert!(nodes <= 200, "198.18.0.11 and up holds 200 nodes");
        let turn = std::fs::File::create(TURN_LOCK).unwrap_or_else(|e| panic!("{TURN_LOCK}: {e}"));
        turn.lock().unwrap_or_else(|e| panic!("locking {TURN_LOCK}: {e}"));
        // Short and unique: interface names are at most 15 bytes.
        let net = Net { tag: format!("sp{}", std::process::id() % 100_000), nodes, _turn: turn };
        let br = net.bridge();
        let _ = Command::new("ip").args(["link", "del", &br]).output();
        ip(&["link", "add", &br, "type", "bridge"]);
        ip(&["addr", "add", "198.18.0.1/24", "dev", &br]);
        ip(&["link", "set", &br, "up"]);
        for i in 0..nodes {
            let (ns, host, inner) = (net.ns(i), net.host_veth(i), format!("{}i{i}", net.tag));
            let _ = Command::new("ip").args(["netns", "del", &ns]).output();
            // A namespace a lingering process of an earlier test here still holds keeps its
            // veth pair; deleting one end deletes both.
            let _ = Command::new("ip").args(["link", "del", &host]).output();
            ip(&["netns", "add", &ns]);
            ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner]);
            ip(&["link", "set", &inner, "netns", &ns]);
            ip(&["link", "set", &host, "master", &br, "up"]);
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", Net::addr(i)), "dev", &inner]);
            ip(&["-n", &ns, "link", "set", &inner, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        net
    }

    /// Limits what node `i` receives to `mbit` Mbit/s, as its NIC would, with the queue of a
    /// switch port in front: 5 ms of the rate, at least 256 KiB (four GSO packets). HTB's own
    /// leaf queue is 1000 packets, which on a veth are GSO packets of up to 64 KiB: seconds of
    /// queue at 100 Mbit/s, in which a busy node's connects and first bytes would wait behind
    /// its own downloads as no switch would keep them.
    pub fn shape(&self, i: usize, mbit: f64) {
        let rate = format!("{mbit}mbit");
        let queue = ((mbit * 1e6 / 8.0 * 0.005) as u64).max(256 << 10);
        let dev = self.host_veth(i);
        let tc = |args: &str| {
            let out = Command::new("tc").args(args.split_whitespace()).output().expect("tc runs");
            assert!(out.status.success(), "tc {args}: {}", String::from_utf8_lossy(&out.stderr));
        };
        tc(&format!("qdisc add dev {dev} root handle 1: htb default 1"));
        tc(&format!("class add dev {dev} parent 1: classid 1:1 htb rate {rate} ceil {rate} burst 256k cburst 256k"));
        tc(&format!("qdisc add dev {dev} parent 1:1 handle 10: bfifo limit {queue}"));
    }

    /// Waits until namespace `i` reaches `addr` (a fresh veth can take a moment to forward).
    pub fn wait_reaches(&self, i: usize, addr: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ok = Command::new("nsenter")
                .arg(format!("--net=/var/run/netns/{}", self.ns(i)))
                .args(["curl", "-s", "-o", "/dev/null", "--max-time", "1", &format!("http://{addr}/")])
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "namespace {} never reached {addr}", self.ns(i));
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            let _ = Command::new("ip").args(["netns", "del", &self.ns(i)]).output();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge()]).output();
    }
}

/// What a relay does to the bytes coming back from upstream.
#[derive(Clone)]
pub enum Back {
    /// Holds each answer that follows a quiet spell for `delay` before forwarding it: a round
    /// trip to a distant store, so that nodes asking for one chunk overlap as on real links.
    /// With `bytes_per_sec`, all the relay's connections together send no faster: the origin's
    /// link. `sent` counts the bytes sent back.
    Link { delay: Duration, bytes_per_sec: Option<f64>, sent: Arc<AtomicU64> },
    /// Reads HTTP/2 frames and, while the flag is set, flips the first byte of each DATA frame's
    /// payload: a member whose disk or NIC changes bytes, which only the requester's check sees.
    CorruptWhen(Arc<AtomicBool>),
}

impl Back {
    pub fn delay(delay: Duration) -> Back {
        Back::Link { delay, bytes_per_sec: None, sent: Arc::default() }
    }
}

/// The time before which the shared link is busy: each write books its length's worth.
#[derive(Default)]
struct Pacer(std::sync::Mutex<Option<Instant>>);

impl Pacer {
    fn book(&self, n: usize, bytes_per_sec: f64) -> Instant {
        let mut next = self.0.lock().unwrap();
        let start = next.map_or(Instant::now(), |t| t.max(Instant::now()));
        let end = start + Duration::from_secs_f64(n as f64 / bytes_per_sec);
        *next = Some(end);
        end
    }
}

/// Forwards every connection to `listen` on to `upstream`, on a thread of its own.
pub fn relay(listen: &str, upstream: String, back: Back) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = std::net::TcpListener::bind(listen).unwrap_or_else(|e| panic!("relay on {listen}: {e}"));
    let pacer = Arc::new(Pacer::default());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            listener.set_nonblocking(true).unwrap();
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let (inbound, _) = listener.accept().await.unwrap();
                let (upstream, back, pacer) = (upstream.clone(), back.clone(), pacer.clone());
                tokio::spawn(async move {
                    let Ok(out) = tokio::net::TcpStream::connect(&upstream).await else { return };
                    let (mut in_r, mut in_w) = inbound.into_split();
                    let (mut out_r, mut out_w) = out.into_split();
                    tokio::spawn(async move { tokio::io::copy(&mut in_r, &mut out_w).await });
                    let mut buf = vec![0u8; 64 << 10];
                    match back {
                        Back::Link { delay, bytes_per_sec, sent } => {
                            let mut last = Instant::now();
                            while let Ok(n @ 1..) = out_r.read(&mut buf).await {
                                if last.elapsed() > Duration::from_millis(20) {
                                    tokio::time::sleep(delay).await;
                                }
                                if let Some(rate) = bytes_per_sec {
                                    tokio::time::sleep_until(pacer.book(n, rate).into()).await;
                                }
                                if in_w.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                                sent.fetch_add(n as u64, Ordering::Relaxed);
                                last = Instant::now();
                            }
                        }
                        Back::CorruptWhen(flag) => loop {
                            let mut head = [0u8; 9];
                            if out_r.read_exact(&mut head).await.is_err() {
                                break;
                            }
                            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                            let mut payload = vec![0u8; len];
                            if out_r.read_exact(&mut payload).await.is_err() {
                                break;
                            }
                            // DATA is type 0; with PADDED (0x8) the first byte is the pad length.
                            let first = usize::from(head[4] & 0x8 != 0);
                            if head[3] == 0 && len > first && flag.load(Ordering::Relaxed) {
                                payload[first] ^= 0x01;
                            }
                            if in_w.write_all(&head).await.is_err() || in_w.write_all(&payload).await.is_err() {
                                break;
                            }
                        },
                    }
                });
            }
        });
    });
}
