//! A fault-injecting proxy in front of the test registry or RGW, for tests of what Strata does
//! when a server misbehaves or has limits this one lacks: it can refuse requests for some paths
//! (a registry gone mid-pull), or refuse single-request copies (S3's 5 GiB copy limit), or
//! flip a byte in every ranged answer (a registry serving corrupt bytes), or cut blob answers
//! short (a truncated blob), or refuse uploads after the first few (a push that fails part-way),
//! or hold ranged answers back (a slow link), or hang after a few requests (a store that stops
//! answering mid-operation), or ignore suffix ranges (an older server). For the next few
//! matching requests it can also answer with an error status (500, 503 `SlowDown`), or send
//! half the answer and then reset the connection, close it, or stall; or delay every answer.
//! One request per connection, so each answer can be changed whole; request bodies with a
//! Content-Length are passed on. It notes the body size of each blob it answers, so a test can
//! count what its own node fetched while other tests use the same registry.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Pass everything through.
    None,
    /// Close the connection on requests whose request line contains any of these.
    Refuse(Vec<String>),
    /// Flip one byte in the body of every 206 answer.
    FlipRanges,
    /// Send only the first half of the body of answers whose request line contains any of
    /// these, then close the connection, as a registry whose blob ends early does.
    Truncate(Vec<String>),
    /// Pass the first `after` requests whose request line contains `pattern`, then close the
    /// connection on the rest.
    RefuseAfter { pattern: String, after: usize },
    /// Pass the first `after` requests whose request line contains `pattern`, then never
    /// answer the rest: a store that hangs part-way through, for a process killed meanwhile.
    HoldAfter { pattern: String, after: usize },
    /// Hold back the answer to every ranged request that names its first byte (`bytes=N-M`,
    /// not a suffix `bytes=-N`) this long: a prefetch or a chunk read on a slow link.
    DelayRanges(std::time::Duration),
    /// Send the first half of the body of every answer to a range that does not start at the
    /// blob's first byte (`bytes=N-M` with N > 0, or a suffix `bytes=-N`: the read of a blob's
    /// end, a TOC or a chunk), then the rest this much later: a large answer still on its way.
    StallMidway(std::time::Duration),
    /// Answer every single-request copy (a PUT with `x-amz-copy-source` that is not a part of
    /// a multipart upload) as S3 answers one of a source over 5 GiB: 400 `InvalidRequest`.
    RefuseSingleCopies,
    /// Drop suffix ranges (`bytes=-N`) from requests, so the whole blob comes back with 200, as
    /// from a server that does not know them.
    NoSuffixRanges,
    /// Answer the next `times` requests whose request line contains `pattern` with `status`
    /// and an S3 error of `code` (`SlowDown`, `InternalError`, `ServiceUnavailable`).
    Status { pattern: String, times: usize, status: u16, code: String },
    /// Send half of each of the next `times` matching answers, then reset the connection.
    Reset { pattern: String, times: usize },
    /// Send half of each of the next `times` matching answers, then nothing more, ever.
    Stall { pattern: String, times: usize },
    /// Send half of each of the next `times` matching answers, then close the connection.
    TruncateNext { pattern: String, times: usize },
    /// Hold every answer back this long.
    Latency(std::time::Duration),
}

impl Fault {
    /// For the faults that hit a number of requests: whether this one is hit (and counted).
    fn hits(&mut self, request_line: &str) -> bool {
        match self {
            Fault::Status { pattern, times, .. }
            | Fault::Reset { pattern, times }
            | Fault::Stall { pattern, times }
            | Fault::TruncateNext { pattern, times }
                if *times > 0 && request_line.contains(pattern.as_str()) =>
            {
                *times -= 1;
                true
            }
            _ => false,
        }
    }
}

pub struct FaultyRegistry {
    /// `127.0.0.1:PORT`, to use as the registry host of image references.
    pub addr: String,
    fault: Arc<Mutex<Fault>>,
    /// Request lines seen, in order.
    requests: Arc<Mutex<Vec<String>>>,
    /// For each answer to a blob GET, in the order they ended: the blob's digest and the body's
    /// size.
    blobs: Arc<Mutex<Vec<(String, u64)>>>,
}

impl FaultyRegistry {
    pub fn start(upstream: &str) -> FaultyRegistry {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let fault = Arc::new(Mutex::new(Fault::None));
        let blobs = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (f, up, b, r) = (fault.clone(), upstream.to_owned(), blobs.clone(), requests.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (f, up, b, r) = (f.clone(), up.clone(), b.clone(), r.clone());
                std::thread::spawn(move || {
                    let _ = relay(conn, &up, &f, &b, &r);
                });
            }
        });
        FaultyRegistry { addr, fault, blobs, requests }
    }

    /// How many requests whose request line contains `pattern` came in so far.
    pub fn requests_for(&self, pattern: &str) -> usize {
        self.requests.lock().unwrap().iter().filter(|l| l.contains(pattern)).count()
    }

    /// How many blob answers have been sent so far: a mark for [`FaultyRegistry::blob_answers`].
    pub fn mark(&self) -> usize {
        self.blobs.lock().unwrap().len()
    }

    /// The body sizes of the answers to GETs of blob `digest` since `mark`.
    pub fn blob_answers(&self, mark: usize, digest: &str) -> Vec<u64> {
        let blobs = self.blobs.lock().unwrap();
        blobs[mark..].iter().filter(|(d, _)| d == digest).map(|(_, n)| *n).collect()
    }

    pub fn set(&self, f: Fault) {
        *self.fault.lock().unwrap() = f;
    }
}

fn relay(
    mut client: TcpStream,
    upstream: &str,
    fault: &Mutex<Fault>,
    blobs: &Mutex<Vec<(String, u64)>>,
    requests: &Mutex<Vec<String>>,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if client.read(&mut byte)? == 0 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let request_line = text.lines().next().unwrap_or("").to_owned();
    requests.lock().unwrap().push(request_line.clone());
    let (now, hit) = {
        let mut f = fault.lock().unwrap();
        let hit = f.hits(&request_line);
        if let Fault::RefuseAfter { pattern, after } = &mut *f
            && request_line.contains(pattern.as_str())
        {
            if *after == 0 {
                return Ok(());
            }
            *after -= 1;
        }
        if let Fault::HoldAfter { pattern, after } = &mut *f
            && request_line.contains(pattern.as_str())
        {
            if *after == 0 {
                drop(f);
                std::thread::sleep(std::time::Duration::from_secs(600));
                return Ok(());
            }
            *after -= 1;
        }
        (f.clone(), hit)
    };
    if let (Fault::Status { status, code, .. }, true) = (&now, hit) {
        let body = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>injected</Message></Error>"
        );
        let answer = format!(
            "HTTP/1.1 {status} Injected\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        return client.write_all(answer.as_bytes());
    }
    if let Fault::Latency(d) = &now {
        std::thread::sleep(*d);
    }
    if let Fault::Refuse(paths) = &now
        && (paths.is_empty() || paths.iter().any(|p| request_line.contains(p.as_str())))
    {
        return Ok(()); // dropped: the client sees the connection closed
    }
    if now == Fault::RefuseSingleCopies
        && text.to_ascii_lowercase().contains("\r\nx-amz-copy-source:")
        && !request_line.contains("partNumber=")
    {
        let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>InvalidRequest</Code><Message>The \
                    specified copy source is larger than the maximum allowable size for a copy source: \
                    5368709120</Message></Error>";
        let answer = format!(
            "HTTP/1.1 400 Bad Request\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        return client.write_all(answer.as_bytes());
    }
    let is_suffix_range = |l: &str| l.to_ascii_lowercase().replace(' ', "").starts_with("range:bytes=-");
    let mut rewritten: String = text
        .lines()
        .filter(|l| !l.is_empty() && !l.to_ascii_lowercase().starts_with("connection:"))
        .filter(|l| now != Fault::NoSuffixRanges || !is_suffix_range(l))
        .map(|l| format!("{l}\r\n"))
        .collect();
    rewritten.push_str("Connection: close\r\n\r\n");
    let length: usize = text
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    client.read_exact(&mut body)?;
    let mut up = TcpStream::connect(upstream)?;
    up.write_all(rewritten.as_bytes())?;
    up.write_all(&body)?;
    let mut answer = Vec::new();
    up.read_to_end(&mut answer)?;
    // Where the answer's body starts, and the first byte of a range that names it (`bytes=N-M`;
    // none for a suffix range).
    let body_at = answer.windows(4).position(|w| w == b"\r\n\r\n").map(|at| at + 4);
    let range_from = text.lines().find_map(|l| {
        let l = l.to_ascii_lowercase().replace(' ', "");
        l.strip_prefix("range:bytes=")?.split('-').next()?.parse::<u64>().ok()
    });
    if let Fault::DelayRanges(delay) = &now
        && range_from.is_some()
    {
        std::thread::sleep(*delay);
    }
    if now == Fault::FlipRanges
        && answer.starts_with(b"HTTP/1.1 206")
        && let Some(body) = body_at
        && answer.len() > body
    {
        let mid = body + (answer.len() - body) / 2;
        answer[mid] ^= 0x5a;
    }
    if let Fault::Truncate(paths) = &now
        && paths.iter().any(|p| request_line.contains(p.as_str()))
        && let Some(body) = body_at
    {
        answer.truncate(body + (answer.len() - body) / 2);
    }
    let blob = request_line
        .starts_with("GET ")
        .then(|| request_line.split("/blobs/").nth(1).and_then(|r| r.split(' ').next()))
        .flatten()
        .zip(body_at)
        .map(|(digest, body)| (digest.to_owned(), (answer.len() - body) as u64));
    let suffix = text.lines().any(|l| l.to_ascii_lowercase().replace(' ', "").starts_with("range:bytes=-"));
    if let (Fault::StallMidway(delay), Some(body)) = (&now, body_at)
        && (suffix || range_from.is_some_and(|n| n > 0))
    {
        let mid = body + (answer.len() - body) / 2;
        client.write_all(&answer[..mid])?;
        client.flush()?;
        std::thread::sleep(*delay);
        answer.drain(..mid);
    }
    if hit && let Some(body) = body_at {
        let mid = body + (answer.len() - body) / 2;
        client.write_all(&answer[..mid])?;
        client.flush()?;
        match now {
            Fault::Reset { .. } => {
                let linger = nix::libc::linger { l_onoff: 1, l_linger: 0 };
                let _ = nix::sys::socket::setsockopt(&client, nix::sys::socket::sockopt::Linger, &linger);
            }
            Fault::Stall { .. } => std::thread::sleep(std::time::Duration::from_secs(600)),
            _ => {}
        }
        return Ok(());
    }
    client.write_all(&answer)?;
    // Noted once the answer is out, so that the notes are in the order the answers ended.
    if let Some(b) = blob {
        blobs.lock().unwrap().push(b);
    }
    Ok(())
}
