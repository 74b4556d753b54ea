//! The peer tier across nodes in one process, on loopback: real tier directories, real HTTP/2
//! peer ports, and an origin that counts what it is asked for.

use super::auth::test_secret;
use super::client::{PeerClient, PeerError, Timeouts};
use super::server::{Origin, ServeState, serve};
use super::wire::{CHUNK_PATH, CRC_TRAILER, ChunkRequest};
use super::*;
use crate::chunkfile::crc32c;
use crate::progress::Progress;
use crate::{
    CacheConfig, ChunkKey, FetchError, Fetcher, GetOptions, Identity, KeyId, PathPattern, Policy, TierConfig,
    TieredCache,
};
use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const CHUNK: u64 = 64 << 10;
// A first-byte timeout far shorter than the slow origins below: a member answers before it
// fetches, so an origin slower than the timeout costs no failover.
const TIMEOUTS: Timeouts = Timeouts {
    connect: Duration::from_millis(200),
    first_byte: Duration::from_millis(100),
    stall: Duration::from_secs(5),
    fetch: Duration::from_secs(10),
};
const FANOUT: usize = 4;
const FAILOVER: FailoverOptions = FailoverOptions { suspect_for: Duration::from_secs(30), tries: 3 };

/// The object store every node shares: one object, and a count of each chunk asked of it.
#[derive(Debug)]
struct TestOrigin {
    path: String,
    version: String,
    data: Bytes,
    asked: Mutex<HashMap<KeyId, usize>>,
    /// How long each fetch takes: long enough that readers of one chunk overlap, as they do
    /// on a real store.
    delay: Duration,
    /// For an origin that streams: the first half of a chunk arrives at once, the rest only
    /// once the gate has a permit. A lying one streams a wrong first half.
    gate: Option<(Arc<tokio::sync::Semaphore>, bool)>,
}

impl TestOrigin {
    fn new(size: usize) -> Arc<TestOrigin> {
        TestOrigin::slow(size, Duration::from_millis(30))
    }

    fn slow(size: usize, delay: Duration) -> Arc<TestOrigin> {
        let data = Bytes::from((0..size).map(|i| (i * 31 + i / 7919) as u8).collect::<Vec<u8>>());
        Arc::new(TestOrigin {
            path: "datasets/set/shard-0".into(),
            version: "\"e1\"".into(),
            data,
            asked: Mutex::default(),
            delay,
            gate: None,
        })
    }

    fn gated(size: usize, lie: bool) -> (Arc<TestOrigin>, Arc<tokio::sync::Semaphore>) {
        let mut o = Arc::into_inner(TestOrigin::slow(size, Duration::ZERO)).unwrap();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        o.gate = Some((gate.clone(), lie));
        (Arc::new(o), gate)
    }

    fn key(&self, index: u64) -> ChunkKey {
        ChunkKey::object(self.path.clone(), self.version.clone(), index, CHUNK)
    }

    fn chunks(&self) -> u64 {
        (self.data.len() as u64).div_ceil(CHUNK)
    }

    fn expected(&self, index: u64) -> Bytes {
        let start = (index * CHUNK) as usize;
        self.data.slice(start..(start + CHUNK as usize).min(self.data.len()))
    }

    fn asked(&self) -> HashMap<KeyId, usize> {
        self.asked.lock().unwrap().clone()
    }
}

struct OriginFetcher(Arc<TestOrigin>);

impl Fetcher for OriginFetcher {
    fn fetch(&self, key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let (origin, key) = (self.0.clone(), key.clone());
        async move {
            *origin.asked.lock().unwrap().entry(key.id()).or_default() += 1;
            tokio::time::sleep(origin.delay).await;
            let Identity::Object { index, .. } = key.identity else { unreachable!("object keys only") };
            Ok(origin.expected(index))
        }
        .boxed()
    }

    fn fetch_streaming(&self, key: &ChunkKey, progress: Progress) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let Some((gate, lie)) = self.0.gate.clone() else { return self.fetch(key) };
        let (origin, key) = (self.0.clone(), key.clone());
        async move {
            *origin.asked.lock().unwrap().entry(key.id()).or_default() += 1;
            let Identity::Object { index, .. } = key.identity else { unreachable!("object keys only") };
            let whole = origin.expected(index);
            let half = whole.slice(..whole.len() / 2);
            let told = if lie { Bytes::from(half.iter().map(|b| !b).collect::<Vec<u8>>()) } else { half };
            progress.arrived(0, &told);
            let _permit = gate.acquire().await.unwrap();
            Ok(whole)
        }
        .boxed()
    }
}

struct SharedOrigin(Arc<TestOrigin>);

impl Origin for SharedOrigin {
    fn fetcher(&self, req: &ChunkRequest) -> Result<Arc<dyn Fetcher>, String> {
        (req.key.path == self.0.path)
            .then(|| Arc::new(OriginFetcher(self.0.clone())) as Arc<dyn Fetcher>)
            .ok_or("no such object".into())
    }
}

struct Node {
    name: String,
    cache: TieredCache,
    tier: Arc<PeerTier>,
    metrics: Arc<PeerMetrics>,
    _server: tokio::task::JoinHandle<std::io::Result<()>>,
    _dir: tempfile::TempDir,
}

impl Node {
    async fn read(&self, origin: &Arc<TestOrigin>, index: u64) -> Bytes {
        let fetcher = self.tier.wrap(Arc::new(OriginFetcher(origin.clone())), origin.data.len() as u64);
        self.cache.get(&origin.key(index), fetcher, GetOptions::default()).await.unwrap()
    }
}

fn open_cache(dir: &std::path::Path) -> TieredCache {
    TieredCache::open(CacheConfig {
        hot: TierConfig::new(dir.join("hot"), 64 << 20),
        warm: None,
        state_dir: dir.join("state"),
        policy: Policy::default(),
    })
    .unwrap()
}

/// `n` nodes serving the peer port, members of one cluster with `extra` members besides.
async fn cluster(n: usize, origin: &Arc<TestOrigin>, extra: &[String]) -> Vec<Node> {
    cluster_with(n, origin, extra, FANOUT, TIMEOUTS, &[]).await
}

/// As [`cluster`], with a hot-chunk fanout and timeouts of the test's own.
async fn cluster_with(
    n: usize,
    origin: &Arc<TestOrigin>,
    extra: &[String],
    fanout: usize,
    timeouts: Timeouts,
    not_shared: &[PathPattern],
) -> Vec<Node> {
    let mut listeners = Vec::new();
    for _ in 0..n {
        listeners.push(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let mut names: Vec<String> = listeners.iter().map(|l| l.local_addr().unwrap().to_string()).collect();
    names.extend_from_slice(extra);
    let members: Vec<Member> = names.iter().map(|n| Member { name: n.clone(), weight: 1.0 }).collect();
    let mut nodes = Vec::new();
    for (i, listener) in listeners.into_iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let cache = open_cache(dir.path());
        let metrics = Arc::new(PeerMetrics::default());
        let membership =
            Membership::start(MemberSource::Static(members.clone()), Duration::from_secs(1)).await.unwrap();
        let client = PeerClient::new(test_secret(1), timeouts);
        let tier = PeerTier::new(
            SelfName::Named(names[i].clone()),
            membership,
            client,
            FAILOVER,
            metrics.clone(),
            not_shared.to_vec(),
        );
        let state = ServeState {
            secret: test_secret(1),
            cache: cache.clone(),
            origin: Arc::new(SharedOrigin(origin.clone())),
            metrics: metrics.clone(),
            hot: super::hot::HotChunks::new(fanout),
            not_shared: Arc::new(not_shared.to_vec()),
            listings: None,
            tier: Some(tier.clone()),
        };
        let server = tokio::spawn(serve(listener, state, std::future::pending()));
        nodes.push(Node { name: names[i].clone(), cache, tier, metrics, _server: server, _dir: dir });
    }
    nodes
}

/// Chunk indexes of `origin` whose first rendezvous choice among `names` is `owner`.
fn owned_by(origin: &TestOrigin, names: &[String], owner: &str, count: usize) -> Vec<u64> {
    ranked(origin, names, &[owner], count)
}

/// Chunk indexes of `origin` whose first rendezvous choices among `names` are `first`, in order.
fn ranked(origin: &TestOrigin, names: &[String], first: &[&str], count: usize) -> Vec<u64> {
    let members: Vec<Member> = names.iter().map(|n| Member { name: n.clone(), weight: 1.0 }).collect();
    (0..)
        .filter(|&i| rank(&origin.key(i).id(), &members).iter().zip(first).all(|(m, f)| m.name == *f))
        .take(count)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_chunk_crosses_the_origin_once_whichever_nodes_read_it() {
    let origin = TestOrigin::new((10 * CHUNK - 100) as usize);
    let nodes = Arc::new(cluster(3, &origin, &[]).await);
    // Every node reads every chunk, all at once.
    let mut reads = Vec::new();
    for n in 0..nodes.len() {
        for i in 0..origin.chunks() {
            let (nodes, origin) = (nodes.clone(), origin.clone());
            reads.push(tokio::spawn(async move { (i, nodes[n].read(&origin, i).await) }));
        }
    }
    for r in reads {
        let (i, bytes) = r.await.unwrap();
        assert_eq!(bytes, origin.expected(i), "chunk {i}");
    }
    let asked = origin.asked();
    assert_eq!(asked.len() as u64, origin.chunks(), "every chunk asked of the origin");
    assert!(asked.values().all(|&n| n == 1), "each chunk asked once: {asked:?}");
    let total = origin.data.len() as u64;
    let from_peers: u64 = nodes.iter().map(|n| n.metrics.peer_bytes.get()).sum();
    let served: u64 = nodes.iter().map(|n| n.metrics.served_bytes.get()).sum();
    assert_eq!(from_peers, 2 * total, "two of three nodes got each chunk from its owner");
    assert_eq!(served, from_peers);
    assert!(nodes.iter().all(|n| n.metrics.origin_fallbacks.get() == 0));
}

#[tokio::test]
async fn a_request_without_the_clusters_secret_is_refused() {
    let origin = TestOrigin::new(CHUNK as usize);
    let nodes = cluster(1, &origin, &[]).await;
    let req = ChunkRequest::new(origin.key(0), CHUNK);
    let stranger = PeerClient::new(test_secret(2), TIMEOUTS);
    match stranger.get_chunk(&nodes[0].name, &req, &Bytes::new(), None).await {
        Err(PeerError::Status { status: 401, message, .. }) => {
            assert_eq!(message, "the request is not signed with this cluster's peer secret")
        }
        other => panic!("{other:?}"),
    }
    // And a plain request with no signature at all.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(&nodes[0].name).await.unwrap();
    let head = format!("GET {} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", req.path_and_query());
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(origin.asked().is_empty(), "nothing was fetched for them");
    assert_eq!(nodes[0].metrics.refused.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_or_stalled_member_is_tried_once_and_the_bytes_stay_right() {
    let origin = TestOrigin::new((64 * CHUNK) as usize);
    // A member whose port refuses (killed), and one that takes the connection and never
    // answers (stopped).
    let refused = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let stalled = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let extra = [refused.clone(), stalled.local_addr().unwrap().to_string()];
    let nodes = cluster(2, &origin, &extra).await;
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).chain(extra.iter().cloned()).collect();
    for dead in &extra {
        for i in owned_by(&origin, &names, dead, 3) {
            assert_eq!(nodes[0].read(&origin, i).await, origin.expected(i), "chunk {i}");
        }
    }
    let m = &nodes[0].metrics;
    assert_eq!(m.peer_errors.get(), 2, "each dead member was tried once, then skipped");
    assert_eq!(m.peer_timeouts.get(), 1, "the stalled one cost one connect timeout");
    assert_eq!(m.suspects.get(), 2);
    let states = nodes[0].tier.members();
    assert!(extra.iter().all(|d| states.contains(&(d.clone(), true))), "{states:?}");
    assert!(origin.asked().values().all(|&n| n == 1));
    drop(stalled);
}

/// An answer as a member sends it: `pieces`, then the CRC32C trailer `crc`.
fn answer(pieces: impl futures::Stream<Item = Bytes> + Send + 'static, crc: u32) -> axum::body::Body {
    use futures::StreamExt;
    use hyper::body::Frame;
    let mut t = axum::http::HeaderMap::new();
    t.insert(CRC_TRAILER, format!("{crc:08x}").parse().unwrap());
    let frames = pieces.map(Frame::data).chain(futures::stream::iter([Frame::trailers(t)]));
    axum::body::Body::new(http_body_util::StreamBody::new(frames.map(Ok::<_, std::convert::Infallible>)))
}

/// A member that answers with one byte changed, and the CRC32C of the true bytes.
async fn lying_member(origin: Arc<TestOrigin>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let name = listener.local_addr().unwrap().to_string();
    let lie = move |uri: axum::http::Uri| {
        let origin = origin.clone();
        async move {
            let req = ChunkRequest::from_query(uri.query().unwrap()).unwrap();
            let Identity::Object { index, .. } = req.key.identity else { unreachable!() };
            let truth = origin.expected(index);
            let mut bytes = truth.to_vec();
            bytes[7] ^= 0x40;
            answer(futures::stream::iter([Bytes::from(bytes)]), crc32c(&truth))
        }
    };
    let app = axum::Router::new().route(CHUNK_PATH, axum::routing::get(lie));
    tokio::spawn(async move { axum::serve(listener, app).await });
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_sends_wrong_bytes_is_caught_and_skipped() {
    let origin = TestOrigin::new((64 * CHUNK) as usize);
    let liar = lying_member(origin.clone()).await;
    let nodes = cluster(2, &origin, std::slice::from_ref(&liar)).await;
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).chain([liar.clone()]).collect();
    for i in owned_by(&origin, &names, &liar, 4) {
        assert_eq!(nodes[0].read(&origin, i).await, origin.expected(i), "chunk {i}");
    }
    let m = &nodes[0].metrics;
    assert_eq!((m.peer_corrupt.get(), m.suspects.get()), (1, 1), "caught once, then skipped");
    assert_eq!(m.peer_bytes.get() + m.origin_bytes.get(), 4 * CHUNK, "every byte from a sound source");
}

#[tokio::test]
async fn with_no_members_a_node_reads_from_the_origin_as_before() {
    let origin = TestOrigin::new((3 * CHUNK) as usize);
    let dir = tempfile::tempdir().unwrap();
    let cache = open_cache(dir.path());
    let membership = Membership::start(MemberSource::Static(vec![]), Duration::from_secs(1)).await.unwrap();
    let metrics = Arc::new(PeerMetrics::default());
    let tier = PeerTier::new(
        SelfName::NotMember,
        membership,
        PeerClient::new(test_secret(1), TIMEOUTS),
        FAILOVER,
        metrics.clone(),
        vec![],
    );
    let fetcher = tier.wrap(Arc::new(OriginFetcher(origin.clone())), origin.data.len() as u64);
    for i in 0..3 {
        assert_eq!(
            cache.get(&origin.key(i), fetcher.clone(), GetOptions::default()).await.unwrap(),
            origin.expected(i)
        );
    }
    assert_eq!((metrics.origin_bytes.get(), metrics.origin_fallbacks.get()), (3 * CHUNK, 0));
}

#[tokio::test]
async fn a_node_finds_itself_among_the_members_by_its_address_and_port() {
    let membership = Membership::start(MemberSource::Static(vec![]), Duration::from_secs(1)).await.unwrap();
    let client = PeerClient::new(test_secret(1), TIMEOUTS);
    let tier = PeerTier::new(SelfName::Detect { port: 7470 }, membership, client, FAILOVER, Default::default(), vec![]);
    assert!(tier.is_self("127.0.0.1:7470"));
    assert!(!tier.is_self("127.0.0.1:7471"), "another daemon on this host");
    // An address of the test range that no interface here has: binding to it fails.
    assert!(!tier.is_self("198.18.200.200:7470"));
    assert!(!tier.is_self("node-a.strata.svc:7470"), "a name is not guessed at");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_chunk_is_sent_on_by_its_first_receivers_not_all_by_its_owner() {
    // Slow enough that every node asks while the owner is still fetching.
    let origin = TestOrigin::slow(CHUNK as usize, Duration::from_millis(300));
    let nodes = Arc::new(cluster_with(6, &origin, &[], 1, TIMEOUTS, &[]).await);
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    let owner =
        rank(&origin.key(0).id(), &names.iter().map(|n| Member { name: n.clone(), weight: 1.0 }).collect::<Vec<_>>())
            [0]
        .name
        .clone();
    let reads: Vec<_> = (0..nodes.len())
        .map(|n| {
            let (nodes, origin) = (nodes.clone(), origin.clone());
            tokio::spawn(async move { nodes[n].read(&origin, 0).await })
        })
        .collect();
    for r in reads {
        assert_eq!(r.await.unwrap(), origin.expected(0));
    }
    assert_eq!(origin.asked().values().sum::<usize>(), 1, "one origin fetch");
    let owner = nodes.iter().find(|n| n.name == owner).unwrap();
    assert_eq!(owner.metrics.served_bytes.get(), CHUNK, "the owner sent one copy, its fanout");
    assert_eq!(owner.metrics.redirects.get(), 4, "and sent the other four askers on");
    let by_holders: u64 = nodes.iter().map(|n| n.metrics.holder_served_bytes.get()).sum();
    assert_eq!(by_holders, 4 * CHUNK, "the first receivers served the next ones");
    let received: u64 = nodes.iter().map(|n| n.metrics.peer_bytes.get()).sum();
    assert_eq!(received, 5 * CHUNK);
    assert!(nodes.iter().all(|n| n.metrics.peer_errors.get() == 0 && n.metrics.origin_fallbacks.get() == 0));
}

/// A member that sends the first half of each chunk it is asked for, then stalls for good.
async fn stalling_member(origin: Arc<TestOrigin>) -> String {
    use futures::StreamExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let name = listener.local_addr().unwrap().to_string();
    let stall = move |uri: axum::http::Uri| {
        let origin = origin.clone();
        async move {
            let req = ChunkRequest::from_query(uri.query().unwrap()).unwrap();
            let Identity::Object { index, .. } = req.key.identity else { unreachable!() };
            let truth = origin.expected(index);
            let half = truth.slice(..truth.len() / 2);
            answer(futures::stream::iter([half]).chain(futures::stream::pending()), crc32c(&truth))
        }
    };
    let app = axum::Router::new().route(CHUNK_PATH, axum::routing::get(stall));
    tokio::spawn(async move { axum::serve(listener, app).await });
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_that_stalls_is_resumed_at_its_offset_from_the_next_member() {
    let origin = TestOrigin::new((64 * CHUNK) as usize);
    let staller = stalling_member(origin.clone()).await;
    let timeouts = Timeouts { stall: Duration::from_millis(300), ..TIMEOUTS };
    let nodes = cluster_with(2, &origin, std::slice::from_ref(&staller), FANOUT, timeouts, &[]).await;
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).chain([staller.clone()]).collect();
    let chunks = ranked(&origin, &names, &[&staller, &nodes[1].name], 2);
    for &i in &chunks {
        assert_eq!(nodes[0].read(&origin, i).await, origin.expected(i), "chunk {i}");
    }
    let m = &nodes[0].metrics;
    assert_eq!((m.resumed.get(), m.peer_timeouts.get()), (1, 1), "one stall, then the staller is suspect");
    assert_eq!(nodes[1].metrics.served_bytes.get(), CHUNK / 2 + CHUNK, "the rest of the first, all the second");
    assert_eq!(m.peer_bytes.get(), 2 * CHUNK);
    assert!(nodes[0].tier.members().contains(&(staller, true)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_marked_not_shared_never_crosses_the_peer_port() {
    let origin = TestOrigin::new((6 * CHUNK) as usize);
    let private = [PathPattern::prefix("datasets/set/")];
    let nodes = Arc::new(cluster_with(2, &origin, &[], FANOUT, TIMEOUTS, &private).await);
    for n in nodes.iter() {
        for i in 0..origin.chunks() {
            assert_eq!(n.read(&origin, i).await, origin.expected(i));
        }
    }
    assert!(origin.asked().values().all(|&n| n == 2), "each node fetched its own: {:?}", origin.asked());
    for n in nodes.iter() {
        let m = &n.metrics;
        assert_eq!((m.peer_bytes.get(), m.served_bytes.get(), m.peer_errors.get()), (0, 0, 0));
    }
    // And a member that asks anyway is refused.
    let client = PeerClient::new(test_secret(1), TIMEOUTS);
    match client
        .get_chunk(&nodes[0].name, &ChunkRequest::new(origin.key(0), origin.data.len() as u64), &Bytes::new(), None)
        .await
    {
        Err(PeerError::Status { status: 404, message, .. }) => {
            assert_eq!(message, "this path is not shared with peers")
        }
        other => panic!("{other:?}"),
    }
}

/// A relay to `upstream` that, once `frozen` is set, neither reads nor writes a byte again but
/// holds its connections open: a member whose process was stopped, or whose link went down.
async fn freezable(upstream: String, frozen: Arc<std::sync::atomic::AtomicBool>) -> String {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let name = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let outbound = tokio::net::TcpStream::connect(&upstream).await.unwrap();
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            for (mut r, mut w) in [
                (
                    Box::new(ri) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                    Box::new(wo) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                ),
                (Box::new(ro), Box::new(wi)),
            ] {
                let frozen = frozen.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n) = r.read(&mut buf).await {
                        while frozen.load(Ordering::Relaxed) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        if n == 0 || w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        }
    });
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_stops_costs_a_short_timeout_before_or_during_its_answer() {
    use std::sync::atomic::{AtomicBool, Ordering};
    // Slow enough that a member stopped once its answer began is caught while fetching.
    let origin = TestOrigin::slow((64 * CHUNK) as usize, Duration::from_millis(800));
    // Pings every second, each given two: long beside the first-byte timeout, short beside
    // the fetch timeout.
    let timeouts = Timeouts { stall: Duration::from_secs(2), ..TIMEOUTS };
    // Two names for node 1's peer port, each through a relay that can be frozen.
    let (before, during) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let mut nodes = cluster_with(2, &origin, &[], FANOUT, timeouts, &[]).await;
    let via_before = freezable(nodes[1].name.clone(), before.clone()).await;
    let via_during = freezable(nodes[1].name.clone(), during.clone()).await;
    let names = vec![nodes[0].name.clone(), nodes[1].name.clone(), via_before.clone(), via_during.clone()];
    let members: Vec<Member> = names.iter().map(|n| Member { name: n.clone(), weight: 1.0 }).collect();
    let node = nodes.remove(0);
    let tier = PeerTier::new(
        SelfName::Named(node.name.clone()),
        Membership::start(MemberSource::Static(members), Duration::from_secs(1)).await.unwrap(),
        PeerClient::new(test_secret(1), timeouts),
        FAILOVER,
        node.metrics.clone(),
        vec![],
    );
    let node = Node { tier, ..node };

    // Stopped with its connection open: the request's headers never come.
    let [warm, cold] = owned_by(&origin, &names, &via_before, 2)[..] else { unreachable!() };
    assert_eq!(node.read(&origin, warm).await, origin.expected(warm));
    assert_eq!(node.metrics.peer_errors.get(), 0, "the relay passes a live member's answer");
    before.store(true, Ordering::Relaxed);
    let start = std::time::Instant::now();
    assert_eq!(node.read(&origin, cold).await, origin.expected(cold));
    let waited = start.elapsed();
    assert_eq!((node.metrics.peer_timeouts.get(), node.metrics.suspects.get()), (1, 1));
    assert!(waited < timeouts.stall, "the first-byte timeout, not a ping, caught it: {waited:?}");

    // Stopped while it fetches from the origin, its answer begun: unanswered pings catch it.
    let chunk = owned_by(&origin, &names, &via_during, 1)[0];
    let node = Arc::new(node);
    let start = std::time::Instant::now();
    let reader = {
        let (node, origin) = (node.clone(), origin.clone());
        tokio::spawn(async move { node.read(&origin, chunk).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    during.store(true, Ordering::Relaxed);
    assert_eq!(reader.await.unwrap(), origin.expected(chunk));
    let waited = start.elapsed();
    assert_eq!((node.metrics.peer_errors.get(), node.metrics.suspects.get()), (2, 2));
    assert!(waited < timeouts.fetch, "caught before the fetch timeout: {waited:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_standing_in_for_an_owner_asks_the_owner_before_the_origin() {
    let origin = TestOrigin::new((256 * CHUNK) as usize);
    let nodes = cluster(3, &origin, &[]).await;
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    let chunks = ranked(&origin, &names, &[&names[2], &names[1]], 3);
    // Node 0 could not reach the owner in time (a slow answer on a saturated node), so it
    // asks the next choice; the owner is alive, and already holds the first chunk.
    assert_eq!(nodes[2].read(&origin, chunks[0]).await, origin.expected(chunks[0]));
    nodes[0].tier.mark_suspect(&names[2]);
    for &i in &chunks {
        assert_eq!(nodes[0].read(&origin, i).await, origin.expected(i), "chunk {i}");
    }
    assert_eq!(nodes[1].metrics.stood_in.get(), 3, "the stand-in got each chunk from the owner");
    assert!(origin.asked().values().all(|&n| n == 1), "each chunk fetched once, by its owner: {:?}", origin.asked());
    assert_eq!(nodes[0].metrics.origin_fallbacks.get(), 0);
    // A stand-in that cannot reach the owner either fetches from the origin itself.
    nodes[1].tier.mark_suspect(&names[2]);
    let more = ranked(&origin, &names, &[&names[2], &names[1]], 4)[3];
    assert_eq!(nodes[0].read(&origin, more).await, origin.expected(more));
    assert_eq!(nodes[1].metrics.stood_in.get(), 3);
    assert_eq!(origin.asked()[&origin.key(more).id()], 1, "from the stand-in's origin");
    assert_eq!(nodes[2].metrics.served_bytes.get(), 3 * CHUNK, "the owner sent the three chunks once each");
}

/// A member whose answer to the chunk `late` names comes after `delay` (its node saturated),
/// and whose other answers start at once and end after `delay`, as a member busy fetching
/// does. It notes each chunk it is asked for.
async fn slow_member(origin: Arc<TestOrigin>, delay: Duration) -> (String, Arc<AtomicU64>, Arc<Mutex<Vec<u64>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let name = listener.local_addr().unwrap().to_string();
    let (late, asked) = (Arc::new(AtomicU64::new(u64::MAX)), Arc::new(Mutex::new(Vec::new())));
    let (late_here, seen) = (late.clone(), asked.clone());
    let serve = move |uri: axum::http::Uri| {
        let (origin, late, seen) = (origin.clone(), late_here.clone(), seen.clone());
        async move {
            let req = ChunkRequest::from_query(uri.query().unwrap()).unwrap();
            let Identity::Object { index, .. } = req.key.identity else { unreachable!() };
            seen.lock().unwrap().push(index);
            if index == late.load(Ordering::Relaxed) {
                tokio::time::sleep(delay).await;
            }
            let truth = origin.expected(index);
            let crc = crc32c(&truth);
            answer(futures::stream::once(async move { tokio::time::sleep(delay).await }.map(|_| truth)), crc)
        }
    };
    let app = axum::Router::new().route(CHUNK_PATH, axum::routing::get(serve));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (name, late, asked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_only_answered_late_is_trusted_again_once_heard_from() {
    let origin = TestOrigin::new((256 * CHUNK) as usize);
    let (slow, late, asked) = slow_member(origin.clone(), Duration::from_millis(400)).await;
    let nodes = cluster(1, &origin, std::slice::from_ref(&slow)).await;
    let names = [nodes[0].name.clone(), slow.clone()];
    let owned = owned_by(&origin, &names, &slow, 3);
    late.store(owned[1], Ordering::Relaxed);
    // Two chunks at once: the first's answer starts at once, the second's not within the
    // first-byte timeout, nor while the first's bytes are still to come.
    let (first, second) = tokio::join!(nodes[0].read(&origin, owned[0]), nodes[0].read(&origin, owned[1]));
    assert_eq!((first, second), (origin.expected(owned[0]), origin.expected(owned[1])));
    let m = &nodes[0].metrics;
    assert_eq!((m.peer_timeouts.get(), m.peer_bytes.get()), (1, CHUNK), "the late one came from the origin");
    // The first chunk's bytes came after the suspicion: the member is alive, and asked again.
    assert!(nodes[0].tier.members().contains(&(slow.clone(), false)), "{:?}", nodes[0].tier.members());
    assert_eq!(nodes[0].read(&origin, owned[2]).await, origin.expected(owned[2]));
    let (mut asked, mut owned) = (asked.lock().unwrap().clone(), owned);
    asked.sort_unstable();
    owned.sort_unstable();
    assert_eq!(asked, owned, "each chunk asked of it once");
    assert_eq!(m.peer_bytes.get(), 2 * CHUNK);
}

/// Reads `tail` until it has given `n` bytes.
async fn first_bytes(tail: &mut crate::progress::Tail, n: usize) -> Vec<u8> {
    let mut got = Vec::new();
    while got.len() < n {
        let piece = tokio::time::timeout(Duration::from_secs(5), tail.next()).await.expect("a piece in time");
        got.extend_from_slice(&piece.expect("the fetch is still going"));
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_and_a_holder_pass_each_piece_on_as_it_arrives() {
    let (origin, gate) = TestOrigin::gated((64 * CHUNK) as usize, false);
    // 64 chunks, so that node 0 owns one of them but for a chance of (2/3)^64.
    let nodes = Arc::new(cluster_with(3, &origin, &[], 1, TIMEOUTS, &[]).await);
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    let i = owned_by(&origin, &names, &names[0], 1)[0];
    let (key, want) = (origin.key(i), origin.expected(i));
    let half = want.len() / 2;

    // Node 1 reads a chunk node 0 owns: the first half is here while node 0's origin has
    // yet to give the rest.
    let fetcher = nodes[1].tier.wrap(Arc::new(OriginFetcher(origin.clone())), origin.data.len() as u64);
    let crate::Streamed::Arriving { mut tail, answer } = nodes[1].cache.stream(&key, fetcher).await.unwrap() else {
        panic!("a miss arrives");
    };
    assert_eq!(first_bytes(&mut tail, half).await, want[..half]);

    // Node 2 asks node 1, as a holder: node 1 passes on what it has of the chunk so far.
    let told = Progress::default();
    let holder =
        ChunkRequest { ask: super::wire::Ask::Holder, ..ChunkRequest::new(key.clone(), origin.data.len() as u64) };
    let client = PeerClient::new(test_secret(1), TIMEOUTS);
    let second = {
        let (told, name) = (told.clone(), names[1].clone());
        tokio::spawn(async move { client.get_chunk(&name, &holder, &Bytes::new(), Some(&told)).await })
    };
    assert_eq!(first_bytes(&mut told.tail(), half).await, want[..half]);
    assert!(!second.is_finished(), "nothing is whole yet");

    gate.add_permits(8);
    assert_eq!(answer.await.unwrap(), want);
    assert_eq!(second.await.unwrap().unwrap(), want, "checked whole by its CRC at the end");
    assert_eq!(origin.asked().values().sum::<usize>(), 1, "{:?}", origin.asked());
}

#[tokio::test]
async fn pieces_that_are_not_the_fetched_chunk_are_never_vouched_for() {
    let (origin, gate) = TestOrigin::gated(CHUNK as usize, true);
    let nodes = cluster(1, &origin, &[]).await;
    gate.add_permits(1);
    let client = PeerClient::new(test_secret(1), TIMEOUTS);
    let got = client.get_chunk(&nodes[0].name, &ChunkRequest::new(origin.key(0), CHUNK), &Bytes::new(), None).await;
    match got {
        Err(e @ PeerError::Status { status: 502, .. }) => {
            assert!(e.to_string().contains("not the chunk the fetch answered with"), "{e}");
            assert!(e.is_origin_failure(), "the asker goes to its origin: {e}");
        }
        other => panic!("{other:?}"),
    }
    // Once whole in the owner's tier, the chunk goes right.
    nodes[0].cache.settled(&[origin.key(0)], Duration::from_secs(5)).await;
    let again = client.get_chunk(&nodes[0].name, &ChunkRequest::new(origin.key(0), CHUNK), &Bytes::new(), None).await;
    assert_eq!(again.unwrap(), origin.expected(0));
}
