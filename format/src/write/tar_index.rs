//! Indexes an uncompressed layer tar: where each entry's blocks lie (its PAX or GNU extension
//! headers, its header, its payload and padding) and what it is. The writer then copies exact
//! byte ranges in whatever order the prefetch plan wants, so the converted layer holds the
//! same headers the input did. Names are checked here: an entry that would land outside the
//! layer, or a kind the format cannot carry, is an error that names it.

use crate::estargz::toc::normalise_name;
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};

#[derive(Debug, thiserror::Error)]
pub enum TarError {
    #[error("the tar is damaged: {0}")]
    Damaged(String),
    #[error("tar entry {name:?}: {reason}")]
    Entry { name: String, reason: String },
}

/// An entry's kind: the same kinds a TOC describes.
pub use crate::estargz::EntryKind as Kind;

#[derive(Debug, Clone)]
pub struct TarEntry {
    /// Normalised: no leading `/`, no `.` or `..` parts; "" is the layer's root.
    pub name: String,
    pub kind: Kind,
    /// Offset of the entry's first block, extension headers included.
    pub start: u64,
    /// Offset of the payload, right after the header.
    pub data: u64,
    pub size: u64,
    /// Offset after the payload's padding: where the next entry starts.
    pub end: u64,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub user_name: String,
    pub group_name: String,
    pub mtime: i64,
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

/// Values an extension header set for the entry that follows it.
#[derive(Default)]
struct Pending {
    start: Option<u64>,
    path: Option<Vec<u8>>,
    link: Option<Vec<u8>>,
    pax: Vec<(String, Vec<u8>)>,
}

/// `len key=value\n` records of a PAX extended header.
fn pax_records(data: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        let space = rest.iter().position(|b| *b == b' ').ok_or("a PAX record without a length")?;
        let len: usize = std::str::from_utf8(&rest[..space])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or("a PAX record with a bad length")?;
        if len <= space + 1 || len > rest.len() || rest[len - 1] != b'\n' {
            return Err("a PAX record whose length does not fit".into());
        }
        let record = &rest[space + 1..len - 1];
        let eq = record.iter().position(|b| *b == b'=').ok_or("a PAX record without `=`")?;
        out.push((String::from_utf8_lossy(&record[..eq]).into_owned(), record[eq + 1..].to_vec()));
        rest = &rest[len..];
    }
    Ok(out)
}

fn text(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// A numeric header field; an empty one is 0, as Go's tar reader takes it.
fn numeric(value: std::io::Result<u64>, raw: &[u8]) -> Result<u64, TarError> {
    if raw.iter().all(|b| *b == 0 || *b == b' ') {
        return Ok(0);
    }
    value.map_err(|e| TarError::Damaged(e.to_string()))
}

/// The header block at `pos`, or `None` at the end of the archive (a zero block, or the end
/// of the file).
fn header_at<R: Read + Seek>(file: &mut R, pos: u64) -> Result<Option<tar::Header>, TarError> {
    let damaged = |e: std::io::Error| TarError::Damaged(format!("at offset {pos}: {e}"));
    file.seek(SeekFrom::Start(pos)).map_err(damaged)?;
    let mut block = [0u8; 512];
    let mut got = 0;
    while got < block.len() {
        match file.read(&mut block[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(TarError::Damaged(format!("a header cut short at offset {pos}"))),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(damaged(e)),
        }
    }
    if block.iter().all(|b| *b == 0) {
        return Ok(None);
    }
    let header = tar::Header::from_byte_slice(&block).clone();
    // The checksum field counts as eight spaces.
    let sum: u32 = block[..148].iter().chain(&block[156..]).map(|b| u32::from(*b)).sum::<u32>() + 8 * 32;
    if header.cksum().map_err(damaged)? != sum {
        return Err(TarError::Damaged(format!("the header at offset {pos} fails its checksum")));
    }
    Ok(Some(header))
}

/// Every entry of the tar in `file`, in order. Stops at the end-of-archive blocks. The headers
/// are walked here rather than by the `tar` crate, whose raw mode (which keeps each extension
/// header's place) does not apply a PAX `size`: Go's writer puts the size of a file of 8 GiB
/// or more only there, with 0 in the header.
pub fn index<R: Read + Seek>(mut file: R) -> Result<Vec<TarEntry>, TarError> {
    let damaged = |e: std::io::Error| TarError::Damaged(e.to_string());
    let mut out = Vec::new();
    let mut pending = Pending::default();
    let mut pos = 0u64;
    while let Some(header) = header_at(&mut file, pos)? {
        let start = pos;
        let data = start + 512;
        let flag = header.entry_type().as_byte();
        let raw_name = text(&header.path_bytes());
        let extension = matches!(flag, b'x' | b'g' | b'L' | b'K');
        let pax_size = pending.pax.iter().rev().find(|(k, _)| k == "size").map(|(_, v)| v.clone());
        let size = match pax_size.filter(|_| !extension) {
            Some(v) => std::str::from_utf8(&v).ok().and_then(|v| v.parse::<u64>().ok()).ok_or_else(|| {
                TarError::Entry { name: raw_name.clone(), reason: "a PAX size record that is not a number".into() }
            })?,
            None => header.entry_size().map_err(damaged)?,
        };
        let end = size
            .checked_add(511)
            .map(|s| s & !511)
            .and_then(|s| data.checked_add(s))
            .ok_or_else(|| TarError::Entry { name: raw_name.clone(), reason: format!("a size of {size} bytes") })?;
        pos = end;
        let mut payload = || -> Result<Vec<u8>, TarError> {
            if size > 1 << 20 {
                return Err(TarError::Entry {
                    name: raw_name.clone(),
                    reason: "an extension header over 1 MiB".into(),
                });
            }
            let mut v = Vec::with_capacity(size as usize);
            file.seek(SeekFrom::Start(data)).map_err(damaged)?;
            (&mut file).take(size).read_to_end(&mut v).map_err(damaged)?;
            if v.len() as u64 != size {
                return Err(TarError::Damaged(format!("the archive ends inside the entry at offset {start}")));
            }
            Ok(v)
        };
        match flag {
            b'x' => {
                let records = payload()?;
                pending.start.get_or_insert(start);
                let parsed =
                    pax_records(&records).map_err(|r| TarError::Entry { name: raw_name.clone(), reason: r })?;
                pending.pax.extend(parsed);
                continue;
            }
            // Global headers apply to the whole archive; their bytes are kept with the entry
            // that follows so they stay in the stream.
            b'g' => {
                pending.start.get_or_insert(start);
                continue;
            }
            b'L' => {
                pending.path = Some(payload()?);
                pending.start.get_or_insert(start);
                continue;
            }
            b'K' => {
                pending.link = Some(payload()?);
                pending.start.get_or_insert(start);
                continue;
            }
            _ => {}
        }
        let p = std::mem::take(&mut pending);
        let pax = |key: &str| p.pax.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        let name_bytes = pax("path").or(p.path.clone()).unwrap_or_else(|| header.path_bytes().into_owned());
        let raw = text(&name_bytes);
        let bad = |reason: String| TarError::Entry { name: raw.clone(), reason };
        let name = normalise_name(&raw).map_err(|why| bad(format!("its name {why}")))?;
        let link = || -> Option<String> {
            let bytes =
                pax("linkpath").or(p.link.clone()).or_else(|| header.link_name_bytes().map(|b| b.into_owned()))?;
            Some(text(&bytes))
        };
        let device = || -> Result<(u32, u32), TarError> {
            let major = header.device_major().map_err(damaged)?.unwrap_or(0);
            let minor = header.device_minor().map_err(damaged)?.unwrap_or(0);
            Ok((major, minor))
        };
        let kind = match flag {
            b'0' | b'\0' | b'7' => Kind::Reg,
            b'5' => Kind::Dir,
            b'2' => Kind::Symlink(link().unwrap_or_default()),
            b'1' => {
                let target = link().unwrap_or_default();
                Kind::Hardlink(normalise_name(&target).map_err(|why| bad(format!("its link target {target:?} {why}")))?)
            }
            b'3' => {
                let (major, minor) = device()?;
                Kind::Char { major, minor }
            }
            b'4' => {
                let (major, minor) = device()?;
                Kind::Block { major, minor }
            }
            b'6' => Kind::Fifo,
            other => return Err(bad(format!("type {:?} is not one a container layer can hold", other as char))),
        };
        let number = |key: &str, fallback: u64| -> u64 {
            pax(key).and_then(|v| String::from_utf8(v).ok()?.split('.').next()?.parse().ok()).unwrap_or(fallback)
        };
        let mtime = pax("mtime")
            .and_then(|v| String::from_utf8(v).ok()?.parse::<f64>().ok())
            .map(|t| t.round() as i64)
            .unwrap_or_else(|| header.mtime().unwrap_or(0) as i64);
        let names =
            |key: &str, field: Option<&[u8]>| pax(key).map(|v| text(&v)).or(field.map(text)).unwrap_or_default();
        let xattrs =
            p.pax.iter().filter_map(|(k, v)| Some((k.strip_prefix("SCHILY.xattr.")?.to_owned(), v.clone()))).collect();
        out.push(TarEntry {
            name,
            kind,
            start: p.start.unwrap_or(start),
            data,
            size,
            end,
            mode: numeric(header.mode().map(u64::from), &header.as_old().mode)? as u32 & 0o7777,
            uid: number("uid", numeric(header.uid(), &header.as_old().uid)?),
            gid: number("gid", numeric(header.gid(), &header.as_old().gid)?),
            user_name: names("uname", header.username_bytes()),
            group_name: names("gname", header.groupname_bytes()),
            mtime,
            xattrs,
        });
    }
    if pending.start.is_some() {
        return Err(TarError::Damaged("the archive ends after an extension header, before its entry".into()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_of(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        build(&mut b);
        b.into_inner().unwrap()
    }

    fn header(kind: tar::EntryType, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(0o644);
        h.set_mtime(1_700_000_000);
        h
    }

    #[test]
    fn long_names_pax_xattrs_and_links_are_read() {
        let long = format!("usr/{}/file", "d".repeat(150));
        let data = tar_of(|b| {
            let mut h = header(tar::EntryType::Regular, 5);
            b.append_data(&mut h, &long, &b"hello"[..]).unwrap();
            b.append_pax_extensions([("SCHILY.xattr.user.k", &b"v\x00w"[..]), ("uname", b"alice")]).unwrap();
            let mut h = header(tar::EntryType::Link, 0);
            b.append_link(&mut h, "./link", &long).unwrap();
        });
        let entries = index(std::io::Cursor::new(&data)).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].name, long);
        assert_eq!(entries[0].size, 5);
        assert_eq!(&data[entries[0].data as usize..][..5], b"hello");
        assert_eq!(entries[1].name, "link");
        assert_eq!(entries[1].kind, Kind::Hardlink(long.clone()));
        assert_eq!(entries[1].xattrs["user.k"], b"v\x00w");
        assert_eq!(entries[1].user_name, "alice");
        // The second entry's bytes start at its PAX header, right where the first one ended.
        assert_eq!(entries[1].start, entries[0].end);
        assert_eq!(entries[0].start, 0);
    }

    /// Go's writer, for a file of 8 GiB or more, puts the size only in a PAX `size` record and
    /// 0 in the header. Here a small file is written so, its data starting with a zero block
    /// (as a disk image's would): the entry has the record's size, and the entry after it is
    /// found where it is, not taken for the end of the archive.
    #[test]
    fn a_size_given_only_by_a_pax_record_is_followed() {
        let body: Vec<u8> = [vec![0u8; 512], (0..1500u32).map(|i| (i % 251) as u8).collect()].concat();
        let mut data = tar_of(|b| b.append_pax_extensions([("size", format!("{}", body.len()).as_bytes())]).unwrap());
        data.truncate(data.len() - 1024);
        let mut h = header(tar::EntryType::Regular, 0);
        h.set_path("weights.bin").unwrap();
        h.set_cksum();
        data.extend_from_slice(h.as_bytes());
        data.extend_from_slice(&body);
        data.resize(data.len().div_ceil(512) * 512, 0);
        let after = tar_of(|b| {
            let mut h = header(tar::EntryType::Regular, 5);
            b.append_data(&mut h, "after.txt", &b"after"[..]).unwrap();
        });
        data.extend_from_slice(&after);
        let entries = index(std::io::Cursor::new(&data)).unwrap();
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["weights.bin", "after.txt"]);
        assert_eq!(entries[0].size, body.len() as u64);
        assert_eq!(&data[entries[0].data as usize..][..body.len()], &body[..]);
        assert_eq!(entries[1].start, entries[0].end);
        assert_eq!(&data[entries[1].data as usize..][..5], b"after");
        // A record that is no number is an error naming the entry.
        let mut bad = tar_of(|b| b.append_pax_extensions([("size", &b"lots"[..])]).unwrap());
        bad.truncate(bad.len() - 1024);
        bad.extend_from_slice(h.as_bytes());
        bad.extend_from_slice(&[0; 1024]);
        let e = index(std::io::Cursor::new(&bad)).unwrap_err().to_string();
        assert!(e.contains("weights.bin") && e.contains("PAX size"), "{e}");
    }

    #[test]
    fn names_outside_the_layer_are_refused() {
        for bad in ["../etc/passwd", "/etc/passwd", "a/../../b"] {
            let mut data = tar_of(|b| {
                let mut h = header(tar::EntryType::Regular, 1);
                b.append_data(&mut h, "placeholder", &b"x"[..]).unwrap();
            });
            // The tar crate refuses to write such names, so they are put in by hand.
            data[..100].fill(0);
            data[..bad.len()].copy_from_slice(bad.as_bytes());
            let mut h = tar::Header::from_byte_slice(&data[..512]).clone();
            h.set_cksum();
            data[..512].copy_from_slice(h.as_bytes());
            let e = index(std::io::Cursor::new(&data)).unwrap_err().to_string();
            assert!(e.contains(bad) && (e.contains("absolute") || e.contains("..")), "{e}");
        }
    }
}
