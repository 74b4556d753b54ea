//! What the origins' own logs say a run asked of them: the requests RGW and the registry
//! answered, read from their logs from a mark on, as `METHOD target`.

/// A log, from its end now on.
pub struct Mark {
    path: String,
    at: usize,
}

impl Mark {
    /// The log whose path is in environment variable `var`, marked at its end.
    pub fn now(var: &str) -> Mark {
        let path = std::env::var(var).unwrap_or_else(|_| panic!("{var} is not set: run the bench from its script"));
        let at = std::fs::metadata(&path).map(|m| m.len() as usize).unwrap_or(0);
        Mark { path, at }
    }

    /// The requests logged since the mark: `GET /bucket?prefix=...`, `HEAD /v2/...`.
    pub fn requests(&self) -> Vec<String> {
        // The servers write a request's line a moment after they answer it.
        std::thread::sleep(std::time::Duration::from_millis(500));
        let log = std::fs::read(&self.path).unwrap_or_default();
        let text = String::from_utf8_lossy(&log[self.at.min(log.len())..]).into_owned();
        text.lines()
            .filter_map(|l| {
                let start = ["\"GET ", "\"HEAD "].iter().filter_map(|m| l.find(m)).min()? + 1;
                let rest = &l[start..];
                let end = rest.find('"').unwrap_or(rest.len());
                Some(rest[..end].split(' ').take(2).collect::<Vec<_>>().join(" "))
            })
            .collect()
    }
}

/// The `prefix=` of a LIST request, decoded.
pub fn list_prefix(request: &str) -> Option<String> {
    let query = request.split_once('?')?.1;
    let p = query.split('&').find_map(|kv| kv.strip_prefix("prefix="))?;
    Some(percent_decoded(p))
}

fn percent_decoded(s: &str) -> String {
    let (b, mut out, mut i) = (s.as_bytes(), Vec::new(), 0);
    while i < b.len() {
        let hex = (b[i] == b'%' && i + 2 < b.len() + 1).then(|| s.get(i + 1..i + 3)).flatten();
        match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
            Some(v) => {
                out.push(v);
                i += 3;
            }
            None => {
                out.push(if b[i] == b'+' { b' ' } else { b[i] });
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
