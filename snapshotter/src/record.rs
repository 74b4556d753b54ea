//! Which files of each lazy layer containers opened, in the order they first did: what
//! `strata convert --record` turns into a prefetch list, as `ctr-remote image optimize` does
//! with fanotify. Opens already pass through Strata's mount, so recording costs a set lookup;
//! it is always on, and bounded per layer.

use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::Mutex;

/// The admin API path that serves the recordings.
pub const ACCESSED_PATH: &str = "/v1/images/accessed";
/// POST a JSON list of layer digests here to start their recordings afresh.
pub const ACCESSED_RESET_PATH: &str = "/v1/images/accessed/reset";
/// The most paths kept per layer; a start-up that opens more has no useful prefetch order.
pub const MAX_RECORDED: usize = 65536;

#[derive(Debug, Default)]
pub struct Opened {
    inner: Mutex<(HashSet<String>, Vec<String>)>,
}

impl Opened {
    /// Notes that `path` was opened, if it is the first time.
    pub fn note(&self, path: &str) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if g.1.len() >= MAX_RECORDED || g.0.contains(path) {
            return;
        }
        g.0.insert(path.to_owned());
        g.1.push(path.to_owned());
    }

    /// Forgets what was opened so far.
    pub fn clear(&self) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.0.clear();
        g.1.clear();
    }

    /// The paths opened, first opens first.
    pub fn list(&self) -> Vec<String> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).1.clone()
    }
}

/// One lazy layer's recording.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccessReport {
    pub image: String,
    pub layer: String,
    /// Regular files opened through the layer's mount, in first-open order, relative to the
    /// layer's root.
    pub opened: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_opens_are_kept_in_order_once() {
        let o = Opened::default();
        for p in ["usr/bin/python3", "etc/ld.so.cache", "usr/bin/python3", "usr/lib/x.so"] {
            o.note(p);
        }
        assert_eq!(o.list(), ["usr/bin/python3", "etc/ld.so.cache", "usr/lib/x.so"]);
        o.clear();
        o.note("usr/lib/x.so");
        assert_eq!(o.list(), ["usr/lib/x.so"]);
    }
}
