//! Applying a layer tar to an empty snapshot directory as containerd's overlay applier leaves
//! it: whiteouts become 0/0 character devices, opaque markers become
//! `trusted.overlay.opaque=y`, and owners, modes, times, xattrs, devices and hard links are
//! kept. Nothing lands outside the directory: names with `..` or a leading `/` are refused,
//! and no entry is created through a symlink or under a non-directory.

use nix::sys::stat::{Mode, SFlag, UtimensatFlags, makedev, mknod, utimensat};
use nix::sys::time::TimeSpec;
use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{PermissionsExt, lchown, symlink};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("the layer's tar is damaged: {0}")]
    Tar(std::io::Error),
    #[error("tar entry {name:?}: {reason}")]
    Entry { name: String, reason: String },
    #[error("tar entry {name:?}: {what}: {source}")]
    Io {
        name: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

const OPAQUE: &[u8] = b".wh..wh..opq";
const WHITEOUT: &[u8] = b".wh.";

/// A tar name's parts (its empty and `.` parts dropped), as bytes: names are bytes on Linux,
/// and a layer built on a system that wrote Latin-1 names must unpack under those names, as
/// containerd's applier leaves them, not under replacement characters.
fn name_parts(name: &[u8]) -> Result<Vec<&[u8]>, &'static str> {
    if name.contains(&0) {
        return Err("contains a NUL byte");
    }
    if name.starts_with(b"/") {
        return Err("is an absolute path");
    }
    let mut parts = Vec::new();
    for part in name.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return Err("climbs out of the layer with `..`"),
            p => parts.push(p),
        }
    }
    Ok(parts)
}

/// Applies the tar read from `tar` to `root`, which must exist (and should be empty). Returns
/// the number of entries applied.
pub fn apply(tar: impl Read, root: &Path) -> Result<u64, UnpackError> {
    let mut archive = tar::Archive::new(tar);
    let mut dirs: Vec<(PathBuf, i64)> = Vec::new();
    let mut count = 0;
    for entry in archive.entries().map_err(UnpackError::Tar)? {
        let mut entry = entry.map_err(UnpackError::Tar)?;
        let raw_bytes = entry.path_bytes().into_owned();
        // For messages only; the names themselves stay bytes.
        let raw = String::from_utf8_lossy(&raw_bytes).into_owned();
        let bad = |reason: &str| UnpackError::Entry { name: raw.clone(), reason: reason.to_owned() };
        let io = |what: &'static str| {
            let name = raw.clone();
            move |source| UnpackError::Io { name, what, source }
        };
        let parts = name_parts(&raw_bytes).map_err(|why| bad(&format!("its name {why}")))?;
        let (name, parent): (&[u8], &[&[u8]]) = match parts.split_last() {
            Some((name, parent)) => (name, parent),
            None => (b"", &[]),
        };
        let parent_dir = real_dir(root, parent).map_err(|why| bad(&why))?;
        if name == OPAQUE {
            xattr::set(&parent_dir, "trusted.overlay.opaque", b"y").map_err(io("marking its directory opaque"))?;
            continue;
        }
        let header = entry.header().clone();
        let kind = header.entry_type();
        let hidden = name.strip_prefix(WHITEOUT);
        let target = match hidden {
            // `.wh..` and `.wh...` would hide `.` and `..`: the directory itself, or the one
            // above it, outside the layer at the top.
            Some(h) if !matches!(h, b"" | b"." | b"..") => parent_dir.join(OsStr::from_bytes(h)),
            Some(_) => return Err(bad("a whiteout without a name")),
            None if parts.is_empty() => root.to_owned(),
            None => parent_dir.join(OsStr::from_bytes(name)),
        };
        // A later entry replaces an earlier one of the same name, as in any unpack; a
        // directory stays if the new entry is a directory too.
        if target != root
            && let Ok(old) = std::fs::symlink_metadata(&target)
            && !(old.is_dir() && kind.is_dir() && hidden.is_none())
        {
            let removed = if old.is_dir() { std::fs::remove_dir_all(&target) } else { std::fs::remove_file(&target) };
            removed.map_err(io("replacing what an earlier entry made"))?;
        }
        if hidden.is_some() {
            mknod(&target, SFlag::S_IFCHR, Mode::empty(), 0).map_err(|e| io("making the whiteout")(e.into()))?;
            count += 1;
            continue;
        }
        let mode = header.mode().map_err(UnpackError::Tar)? & 0o7777;
        let (uid, gid) = (header.uid().map_err(UnpackError::Tar)?, header.gid().map_err(UnpackError::Tar)?);
        let mtime = header.mtime().map_err(UnpackError::Tar)? as i64;
        let link = || -> Result<Vec<u8>, UnpackError> {
            Ok(header.link_name_bytes().ok_or_else(|| bad("a link without a target"))?.into_owned())
        };
        match kind {
            tar::EntryType::Directory => {
                if target != root && std::fs::symlink_metadata(&target).is_err() {
                    std::fs::create_dir(&target).map_err(io("creating the directory"))?;
                }
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&target)
                    .map_err(io("creating the file"))?;
                std::io::copy(&mut entry, &mut f).map_err(io("writing the file"))?;
            }
            tar::EntryType::Symlink => {
                symlink(OsStr::from_bytes(&link()?), &target).map_err(io("creating the symlink"))?
            }
            tar::EntryType::Link => {
                let to = link()?;
                let to = name_parts(&to).map_err(|why| bad(&format!("its link target {why}")))?;
                let Some((tn, tp)) = to.split_last() else { return Err(bad("a hard link to the layer's root")) };
                let source = real_dir(root, tp).map_err(|why| bad(&why))?.join(OsStr::from_bytes(tn));
                let meta = std::fs::symlink_metadata(&source).map_err(io("finding the hard link's target"))?;
                if meta.is_dir() {
                    return Err(bad("a hard link to a directory"));
                }
                std::fs::hard_link(&source, &target).map_err(io("creating the hard link"))?;
                count += 1;
                // One inode: the target's owner, mode and times stand.
                continue;
            }
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                let flag = match kind {
                    tar::EntryType::Char => SFlag::S_IFCHR,
                    tar::EntryType::Block => SFlag::S_IFBLK,
                    _ => SFlag::S_IFIFO,
                };
                // A fifo has no device number, and writers leave the fields blank.
                let (major, minor) = if kind == tar::EntryType::Fifo {
                    (0, 0)
                } else {
                    (
                        header.device_major().map_err(UnpackError::Tar)?.unwrap_or(0),
                        header.device_minor().map_err(UnpackError::Tar)?.unwrap_or(0),
                    )
                };
                mknod(&target, flag, Mode::from_bits_truncate(0o600), makedev(major.into(), minor.into()))
                    .map_err(|e| io("making the device node")(e.into()))?;
            }
            other => return Err(bad(&format!("unsupported tar entry type {other:?}"))),
        }
        lchown(&target, Some(uid as u32), Some(gid as u32)).map_err(io("setting its owner"))?;
        if kind != tar::EntryType::Symlink {
            // After chown, which clears setuid and setgid.
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode)).map_err(io("setting its mode"))?;
        }
        if let Some(exts) = entry.pax_extensions().map_err(UnpackError::Tar)? {
            for ext in exts {
                let ext = ext.map_err(UnpackError::Tar)?;
                if let Ok(key) = ext.key()
                    && let Some(name) = key.strip_prefix("SCHILY.xattr.")
                {
                    xattr::set(&target, name, ext.value_bytes()).map_err(io("setting an xattr"))?;
                }
            }
        }
        if kind.is_dir() {
            dirs.push((target, mtime));
        } else {
            set_mtime(&target, mtime).map_err(io("setting its times"))?;
        }
        count += 1;
    }
    // Directories last: creating their entries changed their times.
    for (dir, mtime) in dirs.iter().rev() {
        set_mtime(dir, *mtime).map_err(|source| UnpackError::Io {
            name: dir.display().to_string(),
            what: "setting its times",
            source,
        })?;
    }
    Ok(count)
}

/// Unpacks the layer blob at `path` (gzip or plain tar, told by its first bytes) into `dir`.
pub fn apply_blob(path: &Path, dir: &Path) -> Result<u64, UnpackError> {
    use std::io::Seek;
    let io = |what: &'static str| {
        let name = path.display().to_string();
        move |source| UnpackError::Io { name, what, source }
    };
    let mut f = std::fs::File::open(path).map_err(io("opening the layer blob"))?;
    let mut magic = [0u8; 4];
    let n = f.read(&mut magic).map_err(io("reading the layer blob"))?;
    f.rewind().map_err(io("reading the layer blob"))?;
    let reader = std::io::BufReader::new(f);
    match &magic[..n] {
        [0x1f, 0x8b, ..] => apply(flate2::read::MultiGzDecoder::new(reader), dir),
        [0x28, 0xb5, 0x2f, 0xfd] => {
            apply(zstd::stream::read::Decoder::new(reader).map_err(io("starting zstd on the layer blob"))?, dir)
        }
        _ => apply(reader, dir),
    }
}

fn set_mtime(path: &Path, secs: i64) -> std::io::Result<()> {
    let t = TimeSpec::new(secs, 0);
    utimensat(nix::fcntl::AT_FDCWD, path, &t, &t, UtimensatFlags::NoFollowSymlink).map_err(std::io::Error::from)
}

/// `root/rel` as a real directory: every component is created if missing, and must be a
/// directory, never a symlink, so nothing is written outside `root`.
fn real_dir(root: &Path, parts: &[&[u8]]) -> Result<PathBuf, String> {
    let mut at = root.to_owned();
    for part in parts {
        at.push(OsStr::from_bytes(part));
        let shown = String::from_utf8_lossy(part);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(format!("its parent {shown:?} is not a directory (a symlink or a file)")),
            Err(_) => std::fs::create_dir(&at).map_err(|e| format!("creating its parent {shown:?}: {e}"))?,
        }
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    fn tar_of(entries: &[(&str, tar::EntryType, &[u8], &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, kind, data, link) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(if kind.is_dir() { 0o755 } else { 0o4755 });
            h.set_uid(1000);
            h.set_gid(1001);
            h.set_mtime(1_700_000_000);
            h.set_size(data.len() as u64);
            if !link.is_empty() {
                h.set_link_name(link).unwrap();
            }
            // Names are written raw, so the tests can feed the unpacker what an attacker would.
            let raw = name.as_bytes();
            h.as_old_mut().name[..raw.len()].copy_from_slice(raw);
            h.set_cksum();
            b.append(&h, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn a_layer_unpacks_as_containerds_overlay_applier_leaves_it() {
        let dir = tempfile::tempdir().unwrap();
        let t = tar_of(&[
            ("bin/", tar::EntryType::Directory, b"", ""),
            ("bin/tool", tar::EntryType::Regular, b"#!/bin/sh\n", ""),
            ("bin/alias", tar::EntryType::Link, b"", "bin/tool"),
            ("bin/sh", tar::EntryType::Symlink, b"", "tool"),
            ("etc/.wh.old", tar::EntryType::Regular, b"", ""),
            ("var/.wh..wh..opq", tar::EntryType::Regular, b"", ""),
            ("dev/fifo", tar::EntryType::Fifo, b"", ""),
        ]);
        assert_eq!(apply(&t[..], dir.path()).unwrap(), 6);
        let tool = std::fs::symlink_metadata(dir.path().join("bin/tool")).unwrap();
        assert_eq!((tool.mode() & 0o7777, tool.uid(), tool.gid()), (0o4755, 1000, 1001), "setuid survives chown");
        assert_eq!(tool.mtime(), 1_700_000_000);
        assert_eq!(std::fs::metadata(dir.path().join("bin/alias")).unwrap().ino(), tool.ino(), "one inode");
        assert_eq!(std::fs::read_link(dir.path().join("bin/sh")).unwrap(), Path::new("tool"));
        let wh = std::fs::symlink_metadata(dir.path().join("etc/old")).unwrap();
        assert!(wh.file_type().is_char_device() && wh.rdev() == 0, "whiteout");
        assert_eq!(xattr::get(dir.path().join("var"), "trusted.overlay.opaque").unwrap().as_deref(), Some(&b"y"[..]));
        assert!(std::fs::symlink_metadata(dir.path().join("dev/fifo")).unwrap().file_type().is_fifo());
        assert_eq!(
            std::fs::metadata(dir.path().join("bin")).unwrap().mtime(),
            1_700_000_000,
            "directory times set last"
        );
    }

    /// Names are bytes: a Latin-1 name, a symlink to one and a hard link to it unpack under
    /// exactly those bytes, and two names that differ only in such bytes stay two files.
    #[test]
    fn names_that_are_not_utf8_unpack_byte_for_byte() {
        let (cafe, cafe2) = (OsStr::from_bytes(b"caf\xe9.txt"), OsStr::from_bytes(b"caf\xe8.txt"));
        let mut b = tar::Builder::new(Vec::new());
        for (name, kind, data, link) in [
            (cafe, tar::EntryType::Regular, &b"one"[..], None),
            (cafe2, tar::EntryType::Regular, &b"two"[..], None),
            (OsStr::new("to-cafe"), tar::EntryType::Symlink, &b""[..], Some(cafe)),
            (OsStr::new("same-cafe"), tar::EntryType::Link, &b""[..], Some(cafe)),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1_700_000_000);
            h.set_size(data.len() as u64);
            h.set_path(name).unwrap();
            if let Some(l) = link {
                h.set_link_name(l).unwrap();
            }
            h.set_cksum();
            b.append(&h, data).unwrap();
        }
        let t = b.into_inner().unwrap();
        let dir = tempfile::tempdir().unwrap();
        apply(&t[..], dir.path()).unwrap();
        assert_eq!(std::fs::read(dir.path().join(cafe)).unwrap(), b"one");
        assert_eq!(std::fs::read(dir.path().join(cafe2)).unwrap(), b"two");
        assert_eq!(std::fs::read_link(dir.path().join("to-cafe")).unwrap().as_os_str(), cafe);
        let (a, l) = (dir.path().join(cafe).metadata().unwrap(), dir.path().join("same-cafe").metadata().unwrap());
        assert_eq!(a.ino(), l.ino(), "the hard link is the same file");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 4);
    }

    /// `.wh..` and `.wh...` name no file: they would hide the directory itself or the one
    /// above it, which at the top is the snapshot's own directory.
    #[test]
    fn a_whiteout_of_a_dot_name_is_refused() {
        for name in [".wh...", ".wh..", "etc/.wh...", "etc/.wh.."] {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("fs");
            std::fs::create_dir(&root).unwrap();
            std::fs::write(dir.path().join("beside"), b"kept").unwrap();
            let t = tar_of(&[
                ("etc/", tar::EntryType::Directory, b"", ""),
                ("etc/kept", tar::EntryType::Regular, b"x", ""),
                (name, tar::EntryType::Regular, b"", ""),
            ]);
            let e = apply(&t[..], &root).unwrap_err().to_string();
            assert!(e.contains("a whiteout without a name"), "{name}: {e}");
            assert!(root.join("etc/kept").exists(), "{name} removed what it hid");
            assert!(dir.path().join("beside").exists(), "{name} reached above the snapshot");
        }
    }

    #[test]
    fn nothing_lands_outside_the_snapshot() {
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().display().to_string();
        for (entries, why) in [
            (vec![("../escape", tar::EntryType::Regular, &b"x"[..], "")], "climbs out"),
            (vec![("/etc/escape", tar::EntryType::Regular, &b"x"[..], "")], "absolute"),
            (
                vec![
                    ("link", tar::EntryType::Symlink, &b""[..], target.as_str()),
                    ("link/escape", tar::EntryType::Regular, &b"x"[..], ""),
                ],
                "not a directory",
            ),
            (vec![("h", tar::EntryType::Link, &b""[..], "../../etc/passwd")], "climbs out"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let e = apply(&tar_of(&entries)[..], dir.path()).unwrap_err().to_string();
            assert!(e.contains(why), "{entries:?}: {e}");
            assert!(!outside.path().join("escape").exists());
        }
    }
}
