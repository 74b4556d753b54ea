//! Shared by the snapshotter's tests against the registry that `.ci/run` starts: the client, a
//! proxy that sees what one test asks of it, and a layer read whole as a plain tar, which lazy
//! reads are compared with.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Read;
use strata_snapshotter::registry::Registry;
use strata_snapshotter::registry::auth::Credentials;
use strata_snapshotter::registry::hosts::Hosts;

pub fn registry_host() -> String {
    std::env::var("STRATA_TEST_REGISTRY").unwrap_or_else(|_| {
        panic!("STRATA_TEST_REGISTRY is not set: this test needs the registry that `bash .ci/run` starts")
    })
}

pub fn client() -> Registry {
    Registry::new(Hosts::new(None), Credentials::default())
}

/// A TCP proxy to the test registry that keeps the requests passing through it, so that a test
/// counts its own requests, not those of the tests running beside it.
pub struct SeeingProxy {
    /// `127.0.0.1:PORT`, to use as the registry host of image references.
    pub addr: String,
    requests: std::sync::Arc<std::sync::Mutex<String>>,
}

impl SeeingProxy {
    pub fn start() -> SeeingProxy {
        use std::io::Write;
        use std::net::{Shutdown, TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let requests = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (seen, upstream) = (requests.clone(), registry_host());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(&upstream) else { continue };
                let (mut from_client, mut to_server) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let seen = seen.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16384];
                    while let Ok(n @ 1..) = from_client.read(&mut buf) {
                        seen.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
                        if to_server.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to_server.shutdown(Shutdown::Write);
                });
                let (mut from_server, mut to_client) = (server, client);
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from_server, &mut to_client);
                    let _ = to_client.shutdown(Shutdown::Write);
                });
            }
        });
        SeeingProxy { addr, requests }
    }

    /// How many requests so far start with `line` (`GET /v2/...`).
    pub fn count(&self, line: &str) -> usize {
        self.requests.lock().unwrap().matches(&format!("{line} HTTP/1.1")).count()
    }
}

/// One entry of a layer read as a plain tar.
#[derive(Debug, PartialEq)]
pub struct Plain {
    pub kind: String,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub mtime: u64,
    pub link: String,
    pub content: Vec<u8>,
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

pub fn plain_entries(blob: &[u8]) -> BTreeMap<String, Plain> {
    let mut out = BTreeMap::new();
    let mut archive = tar::Archive::new(flate2::read::MultiGzDecoder::new(blob));
    for e in archive.entries().unwrap() {
        let mut e = e.unwrap();
        let raw = e.path().unwrap().to_string_lossy().into_owned();
        let path = if raw == "." || raw == "./" {
            String::new()
        } else {
            raw.trim_start_matches("./").trim_end_matches('/').to_string()
        };
        if path == "stargz.index.json" || path.ends_with("prefetch.landmark") {
            continue;
        }
        let mut xattrs = BTreeMap::new();
        if let Some(exts) = e.pax_extensions().unwrap() {
            for ext in exts {
                let ext = ext.unwrap();
                if let Some(name) = ext.key().unwrap().strip_prefix("SCHILY.xattr.") {
                    xattrs.insert(name.to_string(), ext.value_bytes().to_vec());
                }
            }
        }
        let h = e.header();
        let kind = match h.entry_type() {
            tar::EntryType::Directory => "dir",
            tar::EntryType::Regular => "reg",
            tar::EntryType::Symlink => "symlink",
            tar::EntryType::Link => "hardlink",
            tar::EntryType::Char => "char",
            tar::EntryType::Block => "block",
            tar::EntryType::Fifo => "fifo",
            other => panic!("unexpected tar entry type {other:?} for {path}"),
        }
        .to_string();
        let link = h.link_name().unwrap().map(|l| l.to_string_lossy().into_owned()).unwrap_or_default();
        let (mode, uid, gid, mtime) =
            (h.mode().unwrap() & 0o7777, h.uid().unwrap(), h.gid().unwrap(), h.mtime().unwrap());
        let mut content = Vec::new();
        e.read_to_end(&mut content).unwrap();
        out.insert(path, Plain { kind, mode, uid, gid, mtime, link, content, xattrs });
    }
    out
}
