//! Asking a peer for a chunk: one HTTP/2 connection per member, shared by every request to it,
//! and each stage bounded in time, so that a dead or stopped member costs a fraction of a
//! second rather than a TCP timeout. A member answers at once and fetches afterwards, so the
//! first-byte timeout can be short ([`super::timing`] stretches it for a member that is slow,
//! not dead); while it fetches from its origin, HTTP/2 pings tell that it is still alive. What comes back is checked (its length, and its CRC32C or its digest)
//! before a byte of it is handed on.

use super::auth::{AUTH_HEADER, PeerSecret, now_secs};
use super::meta::{MetaAnswer, MetaRequest};
use super::timing::Waits;
use super::wire::{CRC_TRAILER, ChunkRequest, ERROR_TRAILER, HOLDER_HEADER, STATUS_TRAILER};
use crate::chunkfile::crc32c;
use crate::progress::{Progress, Teller};
use crate::{ChunkKey, Identity};
use bytes::{Bytes, BytesMut};
use futures::FutureExt;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// How long each stage of a peer request may take.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// To connect, TCP and the HTTP/2 handshake.
    pub connect: Duration,
    /// From the request to the answer's headers, which a live member sends before it fetches.
    pub first_byte: Duration,
    /// Between two pieces of the body: a stream that stalls longer is given up on. It is also
    /// how long a ping may go unanswered, with pings every half of it while a request is open.
    pub stall: Duration,
    /// From the headers to the first piece: a member that answers pings may be fetching the
    /// chunk from its origin that long.
    pub fetch: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("{member}: connect failed: {reason}")]
    Connect { member: String, reason: String },
    #[error("{member}: no {waiting_for} within {after:?}")]
    Timeout { member: String, waiting_for: &'static str, after: Duration },
    #[error("{member}: {reason}")]
    Transport { member: String, reason: String },
    #[error("{member}: answered {status}: {message}")]
    Status { member: String, status: u16, message: String },
    #[error("{member}: sent bytes that fail the check ({reason})")]
    Corrupt { member: String, reason: String },
    #[error("{member}: the transfer stalled for {after:?} after {} bytes", got.len())]
    Stalled { member: String, after: Duration, got: Bytes },
    #[error("{member}: sending the chunk to enough members already; asks that {to} be asked")]
    Redirect { member: String, to: String },
}

impl PeerError {
    /// Whether the member itself is at fault (and so suspect): not when it refused the request
    /// (400, 404), nor when the origin failed it (502), which the next member would meet too.
    pub fn blames_member(&self) -> bool {
        !matches!(self, PeerError::Status { status: 400 | 404 | 502, .. } | PeerError::Redirect { .. })
    }

    /// Whether the owner reached the origin and the origin failed.
    pub fn is_origin_failure(&self) -> bool {
        matches!(self, PeerError::Status { status: 502, .. })
    }
}

/// Connections to the members, by member name.
#[derive(Debug)]
pub struct PeerClient {
    secret: PeerSecret,
    timeouts: Timeouts,
    conns: Mutex<HashMap<String, SendRequest<Empty<Bytes>>>>,
    waits: Waits,
}

impl PeerClient {
    pub fn new(secret: PeerSecret, timeouts: Timeouts) -> PeerClient {
        PeerClient { secret, timeouts, conns: Mutex::new(HashMap::new()), waits: Waits::default() }
    }

    /// The first-byte timeout now: the configured one, stretched while members answer slowly.
    pub fn first_byte_timeout(&self) -> Duration {
        self.waits.first_byte(self.timeouts.first_byte)
    }

    /// Whether anything came from `member` since `since`: an answer or a piece of one.
    pub fn heard_since(&self, member: &str, since: tokio::time::Instant) -> bool {
        self.waits.heard_since(member, since)
    }

    /// The stall timeout now, stretched as the first-byte timeout is: a member slow to answer
    /// is as slow to send the next piece or to answer a ping, and a fixed stall timeout would
    /// drop it mid-answer on saturated nodes.
    pub fn stall_timeout(&self) -> Duration {
        self.timeouts.stall.mul_f64(self.waits.stretch(self.timeouts.first_byte))
    }

    async fn connection(&self, member: &str) -> Result<SendRequest<Empty<Bytes>>, PeerError> {
        if let Some(c) = self.conns.lock().unwrap_or_else(|p| p.into_inner()).get(member)
            && c.is_ready()
        {
            return Ok(c.clone());
        }
        let connect_err = |reason: String| PeerError::Connect { member: member.to_owned(), reason };
        let connect = async {
            let tcp = tokio::net::TcpStream::connect(member).await.map_err(|e| connect_err(e.to_string()))?;
            let _ = tcp.set_nodelay(true);
            // A connection keeps the ping timeout of when it was made: one made while members
            // answer slowly waits longer for its pings.
            let stall = self.stall_timeout();
            let (send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .keep_alive_interval(stall / 2)
                .keep_alive_timeout(stall)
                .handshake(TokioIo::new(tcp))
                .await
                .map_err(|e| connect_err(e.to_string()))?;
            let name = member.to_owned();
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(member = %name, error = %e, "peer connection ended");
                }
            });
            Ok::<_, PeerError>(send)
        };
        let send = tokio::time::timeout(self.timeouts.connect, connect).await.map_err(|_| PeerError::Timeout {
            member: member.to_owned(),
            waiting_for: "connection",
            after: self.timeouts.connect,
        })??;
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).insert(member.to_owned(), send.clone());
        Ok(send)
    }

    /// Forgets the connection to `member`, after it failed.
    fn drop_connection(&self, member: &str) {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(member);
    }

    /// `GET pq` of `member`, signed, once its answer's headers are in: within the first-byte
    /// timeout, whose smoothing the wait feeds.
    async fn ask(&self, member: &str, pq: &str) -> Result<hyper::Response<hyper::body::Incoming>, PeerError> {
        let transport =
            |e: &dyn std::fmt::Display| PeerError::Transport { member: member.to_owned(), reason: e.to_string() };
        let mut send = self.connection(member).await?;
        let request = hyper::Request::get(format!("http://{member}{pq}"))
            .header(AUTH_HEADER, self.secret.sign("GET", pq, now_secs()))
            .body(Empty::new())
            .map_err(|e| transport(&e))?;
        let asked = tokio::time::Instant::now();
        let answer = self
            .waits
            .wait(member, self.first_byte_timeout(), self.timeouts.fetch, send.send_request(request))
            .await
            .map_err(|after| PeerError::Timeout { member: member.to_owned(), waiting_for: "answer", after })?
            .map_err(|e| transport(&e))?;
        self.waits.answered(member, asked.elapsed());
        Ok(answer)
    }

    /// Chunk `req` from `member`, checked. `have` holds the bytes before `req.start`, from a
    /// transfer that stalled; the answer is the whole chunk. `progress`, if any, is told of
    /// each piece as it comes, before the check.
    pub async fn get_chunk(
        &self,
        member: &str,
        req: &ChunkRequest,
        have: &Bytes,
        progress: Option<&Progress>,
    ) -> Result<Bytes, PeerError> {
        debug_assert_eq!(have.len() as u64, req.start);
        let result = self.try_get(member, req, have, progress).await;
        if result.as_ref().is_err_and(|e| e.blames_member()) {
            self.drop_connection(member);
        }
        result
    }

    async fn try_get(
        &self,
        member: &str,
        req: &ChunkRequest,
        have: &Bytes,
        progress: Option<&Progress>,
    ) -> Result<Bytes, PeerError> {
        let transport =
            |e: &dyn std::fmt::Display| PeerError::Transport { member: member.to_owned(), reason: e.to_string() };
        let timeout = |after| PeerError::Timeout { member: member.to_owned(), waiting_for: "chunk", after };
        let answer = self.ask(member, &req.path_and_query()).await?;
        let (parts, mut body) = answer.into_parts();
        if parts.status == hyper::StatusCode::TEMPORARY_REDIRECT
            && let Some(to) = parts.headers.get(HOLDER_HEADER).and_then(|v| v.to_str().ok())
        {
            return Err(PeerError::Redirect { member: member.to_owned(), to: to.to_owned() });
        }
        let mut data = BytesMut::from(&have[..]);
        let mut trailers = None;
        // Each piece of the body must come within the stall timeout, or while the member is
        // heard from, the first within the fetch timeout: an owner may be waiting on its
        // origin's first byte, and a holder on such an owner. A whole chunk is at most a few
        // MiB, so the answer is held whole before it is checked.
        let mut teller = Teller::new(progress.filter(|_| parts.status.is_success()), have.len());
        loop {
            let first = data.len() == have.len();
            let window = if first { self.timeouts.fetch } else { self.stall_timeout() };
            // What is already in is taken at once; what has been taken is told before a wait.
            let next = match body.frame().now_or_never() {
                Some(frame) => Ok(frame),
                None => {
                    teller.tell(&data);
                    self.waits.wait(member, window, self.timeouts.fetch.max(window), body.frame()).await
                }
            };
            match next {
                Err(after) if parts.status.is_success() && !first => {
                    // The next member goes on from here: what it sends follows these bytes.
                    teller.tell(&data);
                    let got = data.freeze().slice(have.len()..);
                    return Err(PeerError::Stalled { member: member.to_owned(), after, got });
                }
                Err(after) => return Err(timeout(after)),
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(transport(&e)),
                Ok(Some(Ok(frame))) => {
                    self.waits.heard(member);
                    match frame.into_data() {
                        Ok(piece) => {
                            data.extend_from_slice(&piece);
                            teller.grew(&data);
                        }
                        Err(frame) => trailers = frame.into_trailers().ok(),
                    }
                }
            }
        }
        teller.tell(&data);
        let data = data.freeze();
        if !parts.status.is_success() {
            let answer = &data[have.len()..];
            let message = String::from_utf8_lossy(&answer[..answer.len().min(300)]).into_owned();
            return Err(PeerError::Status { member: member.to_owned(), status: parts.status.as_u16(), message });
        }
        let trailer = |name: &str| trailers.as_ref().and_then(|t| t.get(name)).and_then(|v| v.to_str().ok());
        if let Some(status) = trailer(STATUS_TRAILER).and_then(|s| s.parse().ok()) {
            let message = trailer(ERROR_TRAILER).unwrap_or_default().to_owned();
            return Err(PeerError::Status { member: member.to_owned(), status, message });
        }
        let crc = trailer(CRC_TRAILER).and_then(|v| u32::from_str_radix(v, 16).ok());
        check(member, req, &data, crc)?;
        Ok(data)
    }
}

impl PeerClient {
    /// Metadata `req` from `member`, its owner. The owner answers at once and asks the store
    /// afterwards, as it fetches chunks; the answer must come within the fetch timeout.
    pub async fn get_meta(&self, member: &str, req: &MetaRequest) -> Result<MetaAnswer, PeerError> {
        let result = self.try_get_meta(member, req).await;
        if result.as_ref().is_err_and(|e| e.blames_member()) {
            self.drop_connection(member);
        }
        result
    }

    async fn try_get_meta(&self, member: &str, req: &MetaRequest) -> Result<MetaAnswer, PeerError> {
        let transport =
            |e: &dyn std::fmt::Display| PeerError::Transport { member: member.to_owned(), reason: e.to_string() };
        let timeout = |after| PeerError::Timeout { member: member.to_owned(), waiting_for: "listing", after };
        let answer = self.ask(member, &req.path_and_query()).await?;
        let (parts, body) = answer.into_parts();
        let collected = tokio::time::timeout(self.timeouts.fetch, body.collect())
            .await
            .map_err(|_| timeout(self.timeouts.fetch))?
            .map_err(|e| transport(&e))?;
        let trailers = collected.trailers().cloned();
        let bytes = collected.to_bytes();
        let status = trailers
            .as_ref()
            .and_then(|t| t.get(STATUS_TRAILER)?.to_str().ok()?.parse::<u16>().ok())
            .or((!parts.status.is_success()).then_some(parts.status.as_u16()));
        if let Some(status) = status {
            let from_trailer = trailers.as_ref().and_then(|t| t.get(ERROR_TRAILER)?.to_str().ok().map(str::to_owned));
            let message =
                from_trailer.unwrap_or_else(|| String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned());
            return Err(PeerError::Status { member: member.to_owned(), status, message });
        }
        serde_json::from_slice(&bytes).map_err(|e| PeerError::Corrupt {
            member: member.to_owned(),
            reason: format!("not a metadata answer: {e}"),
        })
    }
}

/// What the requester checks, as it does for the origin: a chunk of an object has the length
/// the object's size gives and the CRC32C the owner computed from the origin's bytes, which
/// catches what the wire or a member's disk changed; a chunk named by its digest must hash to
/// it, which no member can fake.
fn check(member: &str, req: &ChunkRequest, data: &[u8], crc: Option<u32>) -> Result<(), PeerError> {
    let corrupt = |reason: String| Err(PeerError::Corrupt { member: member.to_owned(), reason });
    if let Some(len) = req.expected_len()
        && data.len() as u64 != len
    {
        return corrupt(format!("{} bytes where the chunk has {len}", data.len()));
    }
    match crc {
        None => return corrupt(format!("no {CRC_TRAILER} trailer: the answer was cut short")),
        Some(c) if c != crc32c(data) => {
            return corrupt(format!("CRC32C {:08x}, but the header says {c:08x}", crc32c(data)));
        }
        Some(_) => {}
    }
    if let ChunkKey { identity: Identity::Digest { digest }, .. } = &req.key {
        use sha2::{Digest, Sha256};
        let actual = format!("sha256:{}", hex::encode(Sha256::digest(data)));
        if &actual != digest {
            return corrupt(format!("their digest is {actual}, not {digest}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::timing::MAX_STRETCH;
    use super::*;

    #[test]
    fn the_stall_timeout_stretches_as_the_first_byte_timeout_does() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("s"), "ab".repeat(16)).unwrap();
        let secret = PeerSecret::from_file(&dir.path().join("s")).unwrap();
        let ms = Duration::from_millis;
        let timeouts = Timeouts { connect: ms(200), first_byte: ms(250), stall: ms(2000), fetch: ms(30_000) };
        let client = PeerClient::new(secret, timeouts);
        assert_eq!(client.stall_timeout(), ms(2000), "members answering at once");
        for _ in 0..20 {
            client.waits.answered("m", ms(500));
        }
        let (first, stall) = (client.first_byte_timeout(), client.stall_timeout());
        assert!(first > ms(250), "{first:?}");
        let ratio = stall.as_secs_f64() / 2.0;
        assert!((ratio - first.as_secs_f64() / 0.25).abs() < 1e-6, "{stall:?} against {first:?}");
        for _ in 0..20 {
            client.waits.answered("m", Duration::from_secs(60));
        }
        assert_eq!(client.stall_timeout(), ms(2000) * MAX_STRETCH, "and never past the cap");
    }
}
