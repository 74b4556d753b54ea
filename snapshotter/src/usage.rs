//! Disk usage of a snapshot's layer, counted as containerd does: allocated blocks, with each
//! hard-linked inode counted once, and the inode count.

use crate::error::SnapshotError;
use crate::model::Usage;
use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

pub fn disk_usage(root: &Path) -> Result<Usage, SnapshotError> {
    let mut seen = HashSet::new();
    let mut usage = Usage::default();
    let mut stack: Vec<PathBuf> = vec![root.to_owned()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path).map_err(SnapshotError::io("cannot stat", &path))?;
        if seen.insert((meta.dev(), meta.ino())) {
            usage.inodes += 1;
            usage.size += (meta.blocks() * 512) as i64;
        }
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path).map_err(SnapshotError::io("cannot list", &path))? {
                stack.push(entry.map_err(SnapshotError::io("cannot list", &path))?.path());
            }
        }
    }
    Ok(usage)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hard_links_count_once() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), vec![7u8; 64 * 1024]).unwrap();
        let one = disk_usage(dir.path()).unwrap();
        std::fs::hard_link(dir.path().join("a"), dir.path().join("b")).unwrap();
        let linked = disk_usage(dir.path()).unwrap();
        assert_eq!(one, linked);
        assert_eq!(one.inodes, 2, "the directory and the file");
        assert!(one.size >= 64 * 1024, "{one:?}");
    }
}
