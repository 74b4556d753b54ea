//! What a directory tree holds, as `stat`, `readlink` and `getxattr` see it through the kernel,
//! for comparing a mounted image with an unpack of it.

use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

/// One entry: what must be equal in two trees of the same image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub kind: &'static str,
    /// Permission bits with setuid, setgid and sticky (not for symlinks: always 0777).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Seconds: eStargz TOCs carry no finer time.
    pub mtime: i64,
    pub size: u64,
    /// sha256 of a regular file's content.
    pub content: Option<String>,
    pub link: Option<String>,
    pub rdev: u64,
    /// Every xattr but overlayfs's own.
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

/// Every entry under `root` (not `root` itself), by path relative to it, and the groups of
/// paths that are hard links of one file.
pub fn tree(root: &Path) -> (BTreeMap<String, Entry>, BTreeSet<Vec<String>>) {
    let mut entries = BTreeMap::new();
    let mut inodes: BTreeMap<(u64, u64), Vec<String>> = BTreeMap::new();
    walk(root, root, &mut entries, &mut inodes);
    let links = inodes.into_values().filter(|paths| paths.len() > 1).collect();
    (entries, links)
}

fn walk(
    root: &Path,
    dir: &Path,
    entries: &mut BTreeMap<String, Entry>,
    inodes: &mut BTreeMap<(u64, u64), Vec<String>>,
) {
    let mut names: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    names.sort();
    for path in names {
        let rel = path.strip_prefix(root).unwrap().to_string_lossy().into_owned();
        let m = std::fs::symlink_metadata(&path).unwrap();
        let t = m.file_type();
        let kind = if t.is_dir() {
            "dir"
        } else if t.is_symlink() {
            "symlink"
        } else if t.is_char_device() {
            "char"
        } else if t.is_block_device() {
            "block"
        } else if t.is_fifo() {
            "fifo"
        } else if t.is_socket() {
            "socket"
        } else {
            "file"
        };
        if kind == "file" && m.nlink() > 1 {
            inodes.entry((m.dev(), m.ino())).or_default().push(rel.clone());
        }
        let xattrs = if kind == "symlink" {
            BTreeMap::new()
        } else {
            xattr::list(&path)
                .unwrap()
                .map(|n| n.to_string_lossy().into_owned())
                .filter(|n| !n.starts_with("trusted.overlay."))
                .map(|n| {
                    let v = xattr::get(&path, &n).unwrap().unwrap_or_default();
                    (n, v)
                })
                .collect()
        };
        let entry = Entry {
            kind,
            mode: if kind == "symlink" { 0o777 } else { m.mode() & 0o7777 },
            uid: m.uid(),
            gid: m.gid(),
            mtime: m.mtime(),
            size: if kind == "file" { m.len() } else { 0 },
            content: (kind == "file").then(|| hex::encode(Sha256::digest(std::fs::read(&path).unwrap()))),
            link: (kind == "symlink").then(|| std::fs::read_link(&path).unwrap().to_string_lossy().into_owned()),
            rdev: if matches!(kind, "char" | "block") { m.rdev() } else { 0 },
            xattrs,
        };
        entries.insert(rel, entry);
        if kind == "dir" {
            walk(root, &path, entries, inodes);
        }
    }
}

/// The differences between two trees, one line each (at most `limit`).
pub fn differences(a: &BTreeMap<String, Entry>, b: &BTreeMap<String, Entry>, limit: usize) -> Vec<String> {
    let mut out = Vec::new();
    for (path, ea) in a {
        match b.get(path) {
            None => out.push(format!("{path}: only in the first")),
            Some(eb) if eb != ea => out.push(format!("{path}: {ea:?} != {eb:?}")),
            _ => {}
        }
    }
    out.extend(b.keys().filter(|p| !a.contains_key(*p)).map(|p| format!("{p}: only in the second")));
    out.truncate(limit);
    out
}
