//! Where a TOC's prefetch landmark points, found without parsing the whole TOC. A layer whose
//! start-up files come first ends them with `.prefetch.landmark`; the bytes before it are what
//! a container waits for. Knowing that offset a few milliseconds after the TOC arrives, rather
//! than after the tens of milliseconds a large TOC takes to parse, lets the request for those
//! bytes go out while the parse runs. It is a hint: [`super::toc::parse_toc`] has the last word,
//! and a caller must drop what it fetched on a hint the parse does not confirm.

use serde::Deserialize;

/// The root-level landmark's name, as it ends inside its JSON string.
const NEEDLE: &[u8] = b".prefetch.landmark\"";

#[derive(Deserialize)]
struct LandmarkEntry {
    name: String,
    #[serde(default)]
    offset: i64,
}

/// The offset `.prefetch.landmark` gives in `json` (a TOC's JSON), if it is found where
/// stargz-snapshotter's and Strata's writers put it: an entry object whose first member is its
/// `"name"`. `None` when there is no such landmark, or it is at offset 0 (nothing to prefetch).
pub fn prefetch_landmark(json: &[u8]) -> Option<u64> {
    for at in memchr::memmem::find_iter(json, NEEDLE) {
        let Some(start) = entry_start(&json[..at]) else { continue };
        let mut objects = serde_json::Deserializer::from_slice(&json[start..]).into_iter::<LandmarkEntry>();
        let Some(Ok(entry)) = objects.next() else { continue };
        if super::toc::normalise_name(&entry.name).as_deref() == Ok(super::toc::PREFETCH_LANDMARK) {
            return u64::try_from(entry.offset).ok().filter(|o| *o > 0);
        }
    }
    None
}

/// Given the JSON before the landmark's name ends (`… {"name":"` or `… {"name":"./`), where the
/// entry object opens.
fn entry_start(before: &[u8]) -> Option<usize> {
    let quote = before.strip_suffix(b"\"").or_else(|| before.strip_suffix(b"\"./"))?;
    let rest = trim_end(quote).strip_suffix(b":")?;
    let rest = trim_end(trim_end(rest).strip_suffix(b"\"name\"")?);
    rest.strip_suffix(b"{").map(|r| r.len())
}

fn trim_end(s: &[u8]) -> &[u8] {
    let n = s.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
    &s[..n]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_root_landmark_in_either_layout() {
        let compact = br#"{"version":1,"entries":[{"name":"bin/","type":"dir"},{"name":"bin/sh","type":"reg","offset":114,"size":3},{"name":".prefetch.landmark","type":"reg","size":1,"offset":4265106},{"name":"etc/","type":"dir"}]}"#;
        assert_eq!(prefetch_landmark(compact), Some(4265106));
        let indented = b"{\n  \"entries\": [\n    {\n      \"name\": \"./.prefetch.landmark\",\n      \"type\": \"reg\",\n      \"offset\": 77\n    }\n  ]\n}";
        assert_eq!(prefetch_landmark(indented), Some(77));
    }

    #[test]
    fn ignores_what_is_not_the_root_landmark() {
        // A file of that name deeper in the tree, a link whose target has the name, the other
        // landmark, and a landmark at offset 0 (nothing before it).
        let json = br#"{"entries":[{"name":"a/.prefetch.landmark","type":"reg","offset":5},{"name":"l","type":"symlink","linkName":".prefetch.landmark"},{"name":".no.prefetch.landmark","type":"reg","offset":9}]}"#;
        assert_eq!(prefetch_landmark(json), None);
        assert_eq!(prefetch_landmark(br#"{"entries":[{"name":".prefetch.landmark","offset":0}]}"#), None);
        assert_eq!(prefetch_landmark(b""), None);
    }
}
