//! The body of a ranged blob read as it arrives, held to exactly the range asked for. A range
//! asked for before its reader is ready (a layer's prefetch region, requested while its TOC is
//! still being parsed) can be read off the wire meanwhile into a bounded buffer, so the link is
//! busy from the first byte instead of stalling once the socket's buffer is full. A body that
//! breaks off is asked for again from where it stopped, when its maker says how.

use super::RegistryError;
use bytes::Bytes;
use std::ops::Range;
use std::sync::Arc;
use tokio::sync::{Semaphore, mpsc};

/// The body of a ranged read, as it arrives.
#[derive(Debug)]
pub struct RangeStream {
    body: Body,
    url: String,
    range: Range<u64>,
    got: u64,
    resume: Option<Resume>,
}

/// Times a stream asks for the rest of its range after its body broke off.
const RESUMES: u32 = 2;

type Rest = std::pin::Pin<Box<dyn Future<Output = Result<RangeStream, RegistryError>> + Send>>;

/// Asks for bytes `from..end` of the same blob, as a stream of their own: how a body that
/// broke off (a connection reset mid-transfer, a proxy's idle timeout) goes on where it
/// stopped. The bytes are content-addressed, so the rest may come from another connection,
/// or another endpoint, and still fit.
pub(super) struct Resume {
    ask: Box<dyn FnMut(Range<u64>) -> Rest + Send>,
    left: u32,
}

impl std::fmt::Debug for Resume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resume").field("left", &self.left).finish()
    }
}

impl Resume {
    pub(super) fn new(ask: impl FnMut(Range<u64>) -> Rest + Send + 'static) -> Resume {
        Resume { ask: Box::new(ask), left: RESUMES }
    }
}

/// One item of a read-ahead: what the wire gave, and the buffer room it holds.
type Item = (Result<Option<Bytes>, RegistryError>, usize);

#[derive(Debug)]
enum Body {
    Wire(reqwest::Response),
    /// Read by a task of its own, at most `room`'s bytes ahead of this reader.
    Ahead {
        rx: mpsc::UnboundedReceiver<Item>,
        room: Arc<Semaphore>,
        _reader: Reader,
    },
}

/// The read-ahead task, stopped with the stream that owns it.
#[derive(Debug)]
struct Reader(tokio::task::JoinHandle<()>);

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl RangeStream {
    pub(super) fn new(resp: reqwest::Response, url: String, range: Range<u64>) -> RangeStream {
        RangeStream { body: Body::Wire(resp), url, range, got: 0, resume: None }
    }

    /// This stream, asking `resume` for the rest of its range if its body breaks off.
    pub(super) fn resuming(mut self, resume: Resume) -> RangeStream {
        self.resume = Some(resume);
        self
    }

    /// The blob bytes this stream holds.
    pub fn range(&self) -> Range<u64> {
        self.range.clone()
    }

    /// The next bytes of the range, or `None` once all of it has come. A body that ends short
    /// or runs long is an error: never more than was asked for is held, whatever the server
    /// sends.
    pub async fn next(&mut self) -> Result<Option<Bytes>, RegistryError> {
        let want = self.range.end - self.range.start;
        loop {
            let bad = |got: String| RegistryError::Range {
                url: self.url.clone(),
                start: self.range.start,
                end: self.range.end,
                got,
            };
            let failure = match &mut self.body {
                Body::Wire(resp) => match resp.chunk().await {
                    Ok(Some(piece)) if self.got + piece.len() as u64 > want => {
                        return Err(bad(format!("more than {want} bytes")));
                    }
                    Ok(Some(piece)) => {
                        self.got += piece.len() as u64;
                        return Ok(Some(piece));
                    }
                    Ok(None) if self.got == want => return Ok(None),
                    Ok(None) => bad(format!("{} bytes", self.got)),
                    // Every byte came, and only the body's end was lost: nothing to ask for.
                    Err(_) if self.got == want => return Ok(None),
                    Err(e) => ended_early(&self.url, self.got, Some(want), &e),
                },
                // The reader applies the checks above; it only ever ends early by being stopped.
                Body::Ahead { rx, room, .. } => {
                    return match rx.recv().await {
                        Some((item, held)) => {
                            room.add_permits(held);
                            if let Ok(Some(piece)) = &item {
                                self.got += piece.len() as u64;
                            }
                            item
                        }
                        None => Err(bad(format!("{} bytes before its read-ahead stopped", self.got))),
                    };
                }
            };
            if !self.resume_after(&failure).await {
                return Err(failure);
            }
        }
    }

    /// Asks for the rest of the range after `failure` broke the body off, if this stream may;
    /// whether the rest is now on its way.
    async fn resume_after(&mut self, failure: &RegistryError) -> bool {
        let Some(resume) = self.resume.as_mut().filter(|r| r.left > 0) else { return false };
        resume.left -= 1;
        let rest = self.range.start + self.got..self.range.end;
        tracing::debug!(url = %self.url, from = rest.start, error = %failure, "a ranged read broke off; asking for the rest");
        match (resume.ask)(rest).await {
            Ok(RangeStream { body: Body::Wire(resp), .. }) => {
                self.body = Body::Wire(resp);
                true
            }
            Ok(_) => false,
            Err(e) => {
                tracing::debug!(url = %self.url, error = %e, "asking for the rest of a ranged read failed");
                false
            }
        }
    }

    /// Keeps reading this range off the wire in a task of its own, at most `ahead` bytes
    /// beyond what [`RangeStream::next`] has taken.
    pub fn read_ahead(self, ahead: usize) -> RangeStream {
        if !matches!(self.body, Body::Wire(_)) || ahead == 0 {
            return self;
        }
        let (url, range) = (self.url.clone(), self.range.clone());
        let items = futures::stream::unfold(self, |mut stream| async move {
            let item = stream.next().await;
            Some((item, stream))
        });
        RangeStream::ahead(url, range, ahead, items)
    }

    /// Bytes `range` of a blob as `pieces` gives them, in order (from the peer tier rather than
    /// the registry: `source` says where, for errors), read at most `ahead` bytes ahead of
    /// [`RangeStream::next`]. Pieces that add up to more or less than the range are an error.
    pub fn from_pieces(
        source: String,
        range: Range<u64>,
        pieces: impl futures::Stream<Item = Result<Bytes, RegistryError>> + Send + 'static,
        ahead: usize,
    ) -> RangeStream {
        use futures::StreamExt;
        let (url, want) = (source.clone(), range.end - range.start);
        let bad = {
            let range = range.clone();
            move |got: String| RegistryError::Range { url: url.clone(), start: range.start, end: range.end, got }
        };
        let items = futures::stream::unfold((Box::pin(pieces), 0u64), move |(mut pieces, got)| {
            let bad = bad.clone();
            async move {
                let (item, got) = match pieces.next().await {
                    Some(Ok(piece)) if got + piece.len() as u64 > want => {
                        (Err(bad(format!("more than {want} bytes"))), got)
                    }
                    Some(Ok(piece)) => {
                        let got = got + piece.len() as u64;
                        (Ok(Some(piece)), got)
                    }
                    Some(Err(e)) => (Err(e), got),
                    None if got == want => (Ok(None), got),
                    None => (Err(bad(format!("{got} bytes"))), got),
                };
                Some((item, (pieces, got)))
            }
        });
        RangeStream::ahead(source, range, ahead, items)
    }

    /// A stream of `range` whose `items` a task of its own reads, at most `ahead` bytes beyond
    /// what [`RangeStream::next`] has taken, until the first that ends it (`Ok(None)` or an
    /// error).
    fn ahead(
        url: String,
        range: Range<u64>,
        ahead: usize,
        items: impl futures::Stream<Item = Result<Option<Bytes>, RegistryError>> + Send + 'static,
    ) -> RangeStream {
        use futures::StreamExt;
        let ahead = ahead.clamp(1, u32::MAX as usize);
        let room = Arc::new(Semaphore::new(ahead));
        let (tx, rx) = mpsc::unbounded_channel();
        let space = room.clone();
        let task = tokio::spawn(async move {
            let mut items = std::pin::pin!(items);
            while let Some(item) = items.next().await {
                let (last, held) = match &item {
                    Ok(Some(piece)) => (false, piece.len().min(ahead)),
                    _ => (true, 0),
                };
                match space.acquire_many(held as u32).await {
                    Ok(permit) => permit.forget(),
                    Err(_) => return,
                }
                if tx.send((item, held)).is_err() || last {
                    return;
                }
            }
        });
        RangeStream { body: Body::Ahead { rx, room, _reader: Reader(task) }, url, range, got: 0, resume: None }
    }
}

/// All of a range, held in memory: it is only ever as long as was asked for.
pub(crate) async fn collect(stream: RangeStream) -> Result<Bytes, RegistryError> {
    collect_seen(stream, |_| {}).await
}

/// As [`collect`], with `observe` seeing each piece as it arrives.
pub(crate) async fn collect_seen(
    mut stream: RangeStream,
    mut observe: impl FnMut(&[u8]) + Send,
) -> Result<Bytes, RegistryError> {
    let mut body = bytes::BytesMut::with_capacity((stream.range.end - stream.range.start) as usize);
    while let Some(piece) = stream.next().await? {
        observe(&piece);
        body.extend_from_slice(&piece);
    }
    Ok(body.freeze())
}

/// A body that broke off: how far it got, and the transport's own reason with its causes, which
/// reqwest's top-level message ("error decoding response body") leaves out.
pub(super) fn ended_early(url: &str, got: u64, expected: Option<u64>, e: &reqwest::Error) -> RegistryError {
    let why = super::with_causes(e);
    let of = expected.map(|n| format!(" of {n}")).unwrap_or_default();
    RegistryError::Blob { url: url.to_owned(), reason: format!("the body ended early, after {got}{of} bytes ({why})") }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn body(n: usize) -> Vec<u8> {
        (0..n as u32).map(|i| (i.wrapping_mul(31) >> 3) as u8).collect()
    }

    /// Serves one ranged answer of `data` (cut off after `send` bytes), and says when the
    /// last byte has been handed to the socket.
    async fn serve(data: Vec<u8>, send: usize) -> (String, Arc<AtomicBool>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/blob", listener.local_addr().unwrap());
        let written = Arc::new(AtomicBool::new(false));
        let done = written.clone();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                let mut b = [0u8; 1];
                conn.read_exact(&mut b).await.unwrap();
                head.push(b[0]);
            }
            let n = data.len();
            let answer = format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Length: {n}\r\nContent-Range: bytes 0-{}/{n}\r\n\r\n",
                n - 1
            );
            conn.write_all(answer.as_bytes()).await.unwrap();
            for piece in data[..send].chunks(64 << 10) {
                if conn.write_all(piece).await.is_err() {
                    return;
                }
            }
            done.store(true, Ordering::SeqCst);
            // Held open until the reader has what it wants (or closed, for a cut-off answer).
            if send == n {
                let _ = conn.read(&mut [0u8; 1]).await;
            }
        });
        (url, written)
    }

    async fn stream(url: &str, len: u64) -> RangeStream {
        let resp = reqwest::Client::new().get(url).send().await.unwrap();
        RangeStream::new(resp, url.to_owned(), 0..len)
    }

    async fn read_all(s: &mut RangeStream) -> Result<Vec<u8>, RegistryError> {
        let mut out = Vec::new();
        while let Some(piece) = s.next().await? {
            out.extend_from_slice(&piece);
        }
        Ok(out)
    }

    async fn written_within(flag: &AtomicBool, limit: Duration) -> bool {
        let start = std::time::Instant::now();
        while !flag.load(Ordering::SeqCst) && start.elapsed() < limit {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        flag.load(Ordering::SeqCst)
    }

    // 32 MiB is well past what the two sockets' buffers hold, so the server finishes only if
    // the body is being read off the wire.
    const LEN: usize = 32 << 20;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_range_read_ahead_is_taken_off_the_wire_before_anyone_reads_it() {
        let data = body(LEN);
        let (url, written) = serve(data.clone(), LEN).await;
        let mut s = stream(&url, LEN as u64).await.read_ahead(64 << 20);
        assert!(written_within(&written, Duration::from_secs(20)).await, "the whole body came off the wire unread");
        assert!(read_all(&mut s).await.unwrap() == data, "the bytes read are the bytes sent");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_ahead_holds_no_more_than_its_bound() {
        let data = body(LEN);
        let (url, written) = serve(data.clone(), LEN).await;
        let mut s = stream(&url, LEN as u64).await.read_ahead(1 << 20);
        assert!(!written_within(&written, Duration::from_secs(1)).await, "the read-ahead stops at 1 MiB held");
        assert!(read_all(&mut s).await.unwrap() == data);
        assert!(written.load(Ordering::SeqCst));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_cut_short_is_an_error_through_a_read_ahead() {
        let data = body(1 << 20);
        let (url, _) = serve(data, 300_000).await;
        let mut s = stream(&url, 1 << 20).await.read_ahead(8 << 20);
        let e = read_all(&mut s).await.unwrap_err().to_string();
        assert!(e.contains("ended early") || e.contains("300000 bytes"), "{e}");
    }
}
