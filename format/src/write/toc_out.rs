//! TOC entries as the converter writes them: the fields of stargz-snapshotter's `TOCEntry` in
//! its declaration order, each left out when empty as Go's `omitempty` does, serialised with a
//! tab indent like its `MarshalIndent`. User and group names are written only where they change
//! for an id, which readers carry forward.

use super::tar_index::{Kind, TarEntry};
use crate::estargz::time::format_rfc3339;
use base64::Engine;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

fn zero(n: &i64) -> bool {
    *n == 0
}

#[derive(Serialize, Default, Debug, Clone)]
#[serde(rename_all = "camelCase")]
pub struct OutEntry {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    #[serde(skip_serializing_if = "zero")]
    pub size: i64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub modtime: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub link_name: String,
    #[serde(skip_serializing_if = "zero")]
    pub mode: i64,
    #[serde(skip_serializing_if = "zero")]
    pub uid: i64,
    #[serde(skip_serializing_if = "zero")]
    pub gid: i64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub user_name: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub group_name: String,
    #[serde(skip_serializing_if = "zero")]
    pub offset: i64,
    #[serde(skip_serializing_if = "zero")]
    pub inner_offset: i64,
    #[serde(skip_serializing_if = "zero")]
    pub dev_major: i64,
    #[serde(skip_serializing_if = "zero")]
    pub dev_minor: i64,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub digest: String,
    #[serde(skip_serializing_if = "zero")]
    pub chunk_offset: i64,
    #[serde(skip_serializing_if = "zero")]
    pub chunk_size: i64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub chunk_digest: String,
}

#[derive(Serialize)]
struct OutToc<'a> {
    version: i64,
    entries: &'a [OutEntry],
}

/// Builds TOC entries in blob order, carrying the name maps across the layer.
#[derive(Default)]
pub struct TocBuilder {
    pub entries: Vec<OutEntry>,
    users: HashMap<u64, String>,
    groups: HashMap<u64, String>,
}

fn if_changed(map: &mut HashMap<u64, String>, id: u64, name: &str) -> String {
    if name.is_empty() || map.get(&id).is_some_and(|n| n == name) {
        return String::new();
    }
    map.insert(id, name.to_owned());
    name.to_owned()
}

impl TocBuilder {
    /// The entry for `e` without chunk fields; a regular file's caller adds its chunks.
    pub fn entry(&mut self, e: &TarEntry) -> OutEntry {
        let (kind, link_name, dev) = match &e.kind {
            Kind::Reg => ("reg", String::new(), (0, 0)),
            Kind::Dir => ("dir", String::new(), (0, 0)),
            Kind::Symlink(t) => ("symlink", t.clone(), (0, 0)),
            Kind::Hardlink(t) => ("hardlink", t.clone(), (0, 0)),
            Kind::Char { major, minor } => ("char", String::new(), (*major, *minor)),
            Kind::Block { major, minor } => ("block", String::new(), (*major, *minor)),
            Kind::Fifo => ("fifo", String::new(), (0, 0)),
        };
        let b64 = base64::engine::general_purpose::STANDARD;
        OutEntry {
            // The layer's root as tars name it: an empty name would trip readers that do not
            // clean names.
            name: if e.name.is_empty() { "./".to_owned() } else { e.name.clone() },
            kind,
            size: if kind == "reg" { e.size as i64 } else { 0 },
            modtime: if e.mtime == 0 { String::new() } else { format_rfc3339(e.mtime) },
            link_name,
            mode: i64::from(e.mode),
            uid: e.uid as i64,
            gid: e.gid as i64,
            user_name: if_changed(&mut self.users, e.uid, &e.user_name),
            group_name: if_changed(&mut self.groups, e.gid, &e.group_name),
            dev_major: i64::from(dev.0),
            dev_minor: i64::from(dev.1),
            xattrs: e.xattrs.iter().map(|(k, v)| (k.clone(), b64.encode(v))).collect(),
            ..OutEntry::default()
        }
    }

    /// The TOC JSON, as the reference writer lays it out.
    pub fn json(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut ser =
            serde_json::Serializer::with_formatter(&mut out, serde_json::ser::PrettyFormatter::with_indent(b"\t"));
        OutToc { version: 1, entries: &self.entries }.serialize(&mut ser).expect("TOC entries serialise");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, uid: u64, user: &str) -> TarEntry {
        TarEntry {
            name: name.into(),
            kind: Kind::Reg,
            start: 0,
            data: 512,
            size: 3,
            end: 1024,
            mode: 0o644,
            uid,
            gid: 0,
            user_name: user.into(),
            group_name: String::new(),
            mtime: 1_700_000_000,
            xattrs: [("user.a".to_string(), b"\x00\xff".to_vec())].into(),
        }
    }

    #[test]
    fn names_are_written_when_they_change_and_fields_in_go_order() {
        let mut b = TocBuilder::default();
        let e1 = b.entry(&file("a", 1000, "alice"));
        let e2 = b.entry(&file("b", 1000, "alice"));
        let e3 = b.entry(&file("c", 1000, "bob"));
        assert_eq!((e1.user_name.as_str(), e2.user_name.as_str(), e3.user_name.as_str()), ("alice", "", "bob"));
        b.entries = vec![e1];
        let json = String::from_utf8(b.json()).unwrap();
        assert_eq!(
            json,
            "{\n\t\"version\": 1,\n\t\"entries\": [\n\t\t{\n\t\t\t\"name\": \"a\",\n\t\t\t\"type\": \"reg\",\n\t\t\t\
             \"size\": 3,\n\t\t\t\"modtime\": \"2023-11-14T22:13:20Z\",\n\t\t\t\"mode\": 420,\n\t\t\t\"uid\": 1000,\n\t\t\t\
             \"userName\": \"alice\",\n\t\t\t\"xattrs\": {\n\t\t\t\t\"user.a\": \"AP8=\"\n\t\t\t}\n\t\t}\n\t]\n}"
        );
    }
}
