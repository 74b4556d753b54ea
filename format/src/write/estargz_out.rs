//! Writes one layer as eStargz (gzip) or zstd:chunked, in the layout stargz-snapshotter reads:
//! each entry's headers go into the current member (gzip member or zstd frame), each regular
//! file's payload starts a new member, and so does each chunk of a large file; tar padding
//! stays with the payload's last member. Then, for gzip, the TOC member (a tar of
//! `stargz.index.json` and the end-of-archive blocks) and the 51-byte footer; for zstd, the
//! TOC JSON compressed inside a skippable frame and the footer in another. Chunks are cut at a
//! fixed size, one after another, so the same input always gives the same blob whatever the
//! machine.

use super::members::{Codec, Members};
use super::plan::Item;
use super::tar_index::{Kind, TarEntry};
use super::toc_out::TocBuilder;
use crate::estargz::footer::{footer_bytes, skippable_frame, zstd_footer_bytes};
use crate::estargz::sha256_digest;
use crate::estargz::toc::TOC_NAME;
use sha2::{Digest, Sha256};
use std::io::{self, Read, Seek, SeekFrom, Write};

pub const DEFAULT_CHUNK_SIZE: u64 = 4 << 20;
/// What a landmark file holds.
const LANDMARK_BYTE: u8 = 0x0f;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// gzip members: eStargz.
    Estargz,
    /// zstd frames, TOC and footer in skippable frames: stargz-snapshotter's zstd:chunked.
    ZstdChunked,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Estargz => "eStargz",
            Format::ZstdChunked => "zstd:chunked",
        }
    }

    /// The compression level stargz-snapshotter's converter uses by default.
    pub fn default_level(self) -> u32 {
        match self {
            Format::Estargz => 9,
            Format::ZstdChunked => 3,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub format: Format,
    pub chunk_size: u64,
    /// gzip level 0 to 9, or zstd level 1 to 22.
    pub level: u32,
    /// Threads compressing members; the blob does not depend on it.
    pub threads: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options { format: Format::Estargz, chunk_size: DEFAULT_CHUNK_SIZE, level: 9, threads: 1 }
    }
}

/// What the written layer is, for its descriptor and the image config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub size: u64,
    pub digest: String,
    pub diff_id: String,
    pub uncompressed_size: u64,
    pub toc_digest: String,
    /// Where the TOC's compressed bytes start, and how many there are.
    pub toc_offset: u64,
    pub toc_size: u64,
    /// The TOC JSON's own length.
    pub toc_raw_size: u64,
    /// `sha256:` of the compressed TOC (zstd:chunked's `manifest-checksum`).
    pub toc_compressed_digest: String,
    /// Where `.prefetch.landmark` is: the start-up files come before it.
    pub prefetch_end: Option<u64>,
}

/// A ustar header of a regular file with only a name and a size, as the reference writer
/// makes for the TOC and the landmarks.
fn plain_header(name: &str, size: u64, mode: u32) -> [u8; 512] {
    let mut h = tar::Header::new_ustar();
    h.set_path(name).expect("a short ASCII name fits a ustar header");
    h.set_size(size);
    h.set_mode(mode);
    h.set_mtime(0);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    *h.as_bytes()
}

fn copy_range<R: Read + Seek>(tar: &mut R, from: u64, len: u64, out: &mut impl Write) -> io::Result<()> {
    tar.seek(SeekFrom::Start(from))?;
    let copied = io::copy(&mut tar.take(len), out)?;
    if copied != len {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the layer tar ended inside an entry"));
    }
    Ok(())
}

/// Writes `entries` of `tar` in `order` to `out` as eStargz. `progress` is told the input
/// bytes consumed.
pub fn write<R: Read + Seek, W: Write>(
    tar: &mut R,
    entries: &[TarEntry],
    order: &[Item],
    out: W,
    opts: Options,
    progress: &dyn Fn(u64),
) -> io::Result<(Written, W)> {
    let codec = match opts.format {
        Format::Estargz => Codec::Gzip,
        Format::ZstdChunked => Codec::Zstd,
    };
    let mut m = Members::new(out, codec, opts.level, opts.threads);
    let mut toc = TocBuilder::default();
    let mut buf = vec![0u8; opts.chunk_size.min(16 << 20) as usize];
    for item in order {
        match *item {
            Item::Landmark(name) => {
                m.write_all(&plain_header(name, 1, 0o644))?;
                m.cut()?;
                let offset = m.member();
                let mut block = [0u8; 512];
                block[0] = LANDMARK_BYTE;
                m.write_all(&block)?;
                let digest = sha256_digest(&[LANDMARK_BYTE]);
                toc.entries.push(super::toc_out::OutEntry {
                    name: name.to_owned(),
                    kind: "reg",
                    size: 1,
                    mode: 0o644,
                    offset: offset as i64,
                    digest: digest.clone(),
                    chunk_digest: digest,
                    ..Default::default()
                });
            }
            Item::Entry(i) => {
                let e = &entries[i];
                copy_range(tar, e.start, e.data - e.start, &mut m)?;
                let mut first = toc.entry(e);
                if e.kind != Kind::Reg || e.size == 0 {
                    copy_range(tar, e.data, e.end - e.data, &mut m)?;
                    toc.entries.push(first);
                    progress(e.end - e.start);
                    continue;
                }
                let mut whole = Sha256::new();
                let mut chunks = Vec::new();
                let mut done = 0u64;
                tar.seek(SeekFrom::Start(e.data))?;
                while done < e.size {
                    let len = (e.size - done).min(opts.chunk_size);
                    m.cut()?;
                    let offset = m.member();
                    // In pieces of the buffer: a chunk may be larger than it.
                    let mut digest = Sha256::new();
                    let mut left = len;
                    while left > 0 {
                        let n = left.min(buf.len() as u64) as usize;
                        let piece = &mut buf[..n];
                        tar.read_exact(piece)?;
                        m.write_all(piece)?;
                        whole.update(&*piece);
                        digest.update(&*piece);
                        left -= piece.len() as u64;
                    }
                    chunks.push((offset, done, len, format!("sha256:{}", hex::encode(digest.finalize()))));
                    done += len;
                    progress(len);
                }
                // The padding stays in the last chunk's member; the next header follows it.
                copy_range(tar, e.data + e.size, e.end - e.data - e.size, &mut m)?;
                for (n, (offset, chunk_offset, len, digest)) in chunks.into_iter().enumerate() {
                    // As the reference writer sets it: the chunk's size while a whole chunk
                    // remains, 0 ("to the end") on a shorter last one.
                    let chunk_size = if len == opts.chunk_size { len as i64 } else { 0 };
                    if n == 0 {
                        first.offset = offset as i64;
                        first.digest = format!("sha256:{}", hex::encode(whole.clone().finalize()));
                        first.chunk_size = chunk_size;
                        first.chunk_digest = digest;
                        toc.entries.push(first.clone());
                    } else {
                        toc.entries.push(super::toc_out::OutEntry {
                            name: e.name.clone(),
                            kind: "chunk",
                            offset: offset as i64,
                            chunk_offset: chunk_offset as i64,
                            chunk_size,
                            chunk_digest: digest,
                            ..Default::default()
                        });
                    }
                }
                progress(e.end - e.data - e.size + (e.data - e.start));
            }
        }
    }
    // Entries so far hold member numbers where offsets go: every member is now written, so
    // each has its offset.
    let starts = m.settle()?;
    for e in toc.entries.iter_mut().filter(|e| !e.chunk_digest.is_empty()) {
        e.offset = starts[e.offset as usize] as i64;
    }
    let prefetch_end = toc
        .entries
        .iter()
        .find(|e| e.name == crate::estargz::toc::PREFETCH_LANDMARK)
        .map(|e| e.offset as u64)
        .filter(|o| *o > 0);
    let json = toc.json();
    // What Strata writes, Strata must read: a tar whose entries do not form a tree (a file
    // used as a directory, say) is refused here, with the reader's reason, not published.
    crate::estargz::toc::parse_toc(&json, m.position()).map_err(|e| {
        io::Error::new(io::ErrorKind::InvalidData, format!("the layer's entries do not form a readable tree: {e}"))
    })?;
    let (toc_offset, toc_size, toc_compressed_digest) = match opts.format {
        Format::Estargz => {
            let toc_offset = m.position();
            m.write_all(&plain_header(TOC_NAME, json.len() as u64, 0))?;
            m.write_all(&json)?;
            let padding = (512 - json.len() % 512) % 512;
            m.write_all(&vec![0u8; padding + 1024])?;
            m.settle()?;
            let toc_size = m.position() - toc_offset;
            m.write_outside(&footer_bytes(toc_offset))?;
            (toc_offset, toc_size, String::new())
        }
        // The uncompressed stream ends with the last entry: no TOC entry, no end-of-archive
        // blocks, as stargz-snapshotter's zstd:chunked writer leaves it.
        Format::ZstdChunked => {
            let compressed = zstd::encode_all(&json[..], opts.level as i32)?;
            let toc_offset = m.position() + 8;
            m.write_outside(&skippable_frame(&compressed))?;
            m.write_outside(&zstd_footer_bytes(toc_offset, compressed.len() as u64, json.len() as u64))?;
            (toc_offset, compressed.len() as u64, sha256_digest(&compressed))
        }
    };
    let uncompressed_size = m.raw.count;
    let diff_id = std::mem::replace(&mut m.raw, super::members::Hashed::new(io::sink())).finish().0;
    let (size, digest, out) = m.finish()?;
    let written = Written {
        size,
        digest,
        diff_id,
        uncompressed_size,
        toc_digest: sha256_digest(&json),
        toc_offset,
        toc_size,
        toc_raw_size: json.len() as u64,
        toc_compressed_digest,
        prefetch_end,
    };
    Ok((written, out))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::estargz::{Compression, EntryKind, decode_chunk, decode_toc, parse_footer};
    use crate::write::plan::{Pattern, plan};
    use crate::write::tar_index::index;
    use std::io::Cursor;

    /// A layer with what real ones hold: directories, files smaller and larger than a chunk,
    /// an empty file, a symlink, a hard link, a device, a whiteout and xattrs.
    pub(crate) fn sample_tar() -> Vec<u8> {
        let b = std::cell::RefCell::new(tar::Builder::new(Vec::new()));
        let add = |kind: tar::EntryType, name: &str, data: &[u8], f: &dyn Fn(&mut tar::Header)| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_mtime(1_700_000_000);
            h.set_uid(1000);
            h.set_username("alice").unwrap();
            f(&mut h);
            b.borrow_mut().append_data(&mut h, name, data).unwrap();
        };
        add(tar::EntryType::Directory, "etc/", b"", &|h| h.set_mode(0o755));
        add(tar::EntryType::Regular, "etc/motd", b"hello\n", &|_| {});
        add(tar::EntryType::Regular, "etc/empty", b"", &|_| {});
        let big: Vec<u8> = (0..10_000u32).flat_map(|i| i.to_le_bytes()).collect();
        add(tar::EntryType::Regular, "usr/lib/big.bin", &big, &|h| h.set_mode(0o755));
        add(tar::EntryType::Symlink, "etc/link", b"", &|h| h.set_link_name("motd").unwrap());
        add(tar::EntryType::Link, "etc/hard", b"", &|h| h.set_link_name("etc/motd").unwrap());
        add(tar::EntryType::Char, "dev/null", b"", &|h| {
            h.set_device_major(1).unwrap();
            h.set_device_minor(3).unwrap();
        });
        add(tar::EntryType::Regular, "etc/.wh.gone", b"", &|_| {});
        add(tar::EntryType::Regular, ".prefetch.landmark", &[LANDMARK_BYTE], &|_| {});
        b.borrow_mut().append_pax_extensions([("SCHILY.xattr.user.tag", &b"\x01\x02"[..])]).unwrap();
        add(tar::EntryType::Regular, "etc/tagged", b"x", &|_| {});
        b.into_inner().into_inner().unwrap()
    }

    fn convert(tar: &[u8], prefetch: &[Pattern], chunk: u64) -> (Written, Vec<u8>) {
        convert_as(Format::Estargz, tar, prefetch, chunk)
    }

    fn convert_as(format: Format, tar: &[u8], prefetch: &[Pattern], chunk: u64) -> (Written, Vec<u8>) {
        let entries = index(Cursor::new(tar)).unwrap();
        let (order, _) = plan(&entries, prefetch);
        let opts = Options { format, chunk_size: chunk, level: 6, threads: 1 };
        write(&mut Cursor::new(tar), &entries, &order, Vec::new(), opts, &|_| {}).unwrap()
    }

    /// A chunk larger than the writer's 16 MiB buffer (`--chunk-size 32MiB`) is read through
    /// it in pieces, and is one chunk with the file's bytes and its own digest.
    #[test]
    fn a_chunk_larger_than_the_buffer_is_written_whole() {
        let body: Vec<u8> = (0..(18u32 << 20) / 4).flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()).collect();
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, "model.bin", &body[..]).unwrap();
        let tar = b.into_inner().unwrap();
        let (w, blob) = convert(&tar, &[], 32 << 20);
        let toc = decode_toc(&blob[w.toc_offset as usize..], Compression::Gzip, w.toc_offset, &w.toc_digest, 1 << 20)
            .unwrap();
        let e = toc.entries.iter().find(|e| e.path == "model.bin").unwrap();
        assert_eq!(e.chunks.len(), 1);
        let c = &e.chunks[0];
        let bytes = decode_chunk("model.bin", c, &blob[c.offset as usize..c.compressed_end as usize]).unwrap();
        assert!(bytes == body, "the chunk holds the file's bytes");
    }

    #[test]
    fn the_reader_finds_every_file_and_chunk_with_its_bytes() {
        let tar = sample_tar();
        let (w, blob) = convert(&tar, &[], 4096);
        assert_eq!(w.size, blob.len() as u64);
        assert_eq!(w.digest, sha256_digest(&blob));
        let footer = parse_footer(&blob[blob.len() - 51..], blob.len() as u64).unwrap();
        assert_eq!(footer.toc_offset, w.toc_offset);
        let toc = decode_toc(&blob[w.toc_offset as usize..], Compression::Gzip, w.toc_offset, &w.toc_digest, 1 << 20)
            .unwrap();
        let by_name = |n: &str| toc.entries.iter().find(|e| e.path == n).unwrap_or_else(|| panic!("{n}"));
        let source = |n: &str| {
            let mut a = tar::Archive::new(&tar[..]);
            let mut v = Vec::new();
            for e in a.entries().unwrap() {
                let mut e = e.unwrap();
                if e.path().unwrap().to_str() == Some(n) {
                    e.read_to_end(&mut v).unwrap();
                }
            }
            v
        };
        for name in ["etc/motd", "usr/lib/big.bin", "etc/tagged"] {
            let e = by_name(name);
            let mut bytes = Vec::new();
            for c in &e.chunks {
                let range = &blob[c.offset as usize..c.compressed_end as usize];
                bytes.extend(decode_chunk(name, c, range).unwrap());
            }
            assert_eq!(bytes, source(name), "{name}");
        }
        assert_eq!(by_name("usr/lib/big.bin").chunks.len(), 10);
        assert_eq!(by_name("etc/link").kind, EntryKind::Symlink("motd".into()));
        assert_eq!(by_name("etc/hard").kind, EntryKind::Hardlink("etc/motd".into()));
        assert_eq!(by_name("dev/null").kind, EntryKind::Char { major: 1, minor: 3 });
        assert_eq!(by_name("etc/tagged").xattrs["user.tag"], b"\x01\x02");
        assert_eq!(by_name("etc/tagged").user_name.as_deref(), Some("alice"));
        assert_eq!(by_name("etc/motd").uid, 1000);
        assert_eq!(by_name("etc/motd").mtime, 1_700_000_000);
        assert_eq!(toc.landmark, crate::estargz::Landmark::NoPrefetch);
        assert_eq!(w.prefetch_end, None);
        // The stream is the input's entries, then the TOC entry and the end of the archive.
        let mut raw = Vec::new();
        flate2::read::MultiGzDecoder::new(&blob[..]).read_to_end(&mut raw).unwrap();
        assert_eq!(w.diff_id, sha256_digest(&raw));
        assert_eq!(w.uncompressed_size, raw.len() as u64);
        let names: Vec<String> = tar::Archive::new(&raw[..])
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.first().map(String::as_str), Some(".no.prefetch.landmark"));
        assert_eq!(names.last().map(String::as_str), Some("stargz.index.json"));
        assert_eq!(names.iter().filter(|n| n.ends_with("landmark")).count(), 1);
    }

    #[test]
    fn the_same_input_gives_the_same_blob_and_a_prefetch_list_moves_files_before_the_landmark() {
        let tar = sample_tar();
        let list = [Pattern::parse("/etc/tagged").unwrap(), Pattern::parse("/etc/hard").unwrap()];
        let (a, blob_a) = convert(&tar, &list, 4096);
        let (b, blob_b) = convert(&tar, &list, 4096);
        assert_eq!((a, &blob_a), (b, &blob_b));
        // Compressed on several threads: the same bytes.
        let entries = index(Cursor::new(&tar)).unwrap();
        let (order, _) = plan(&entries, &list);
        let opts = Options { format: Format::Estargz, chunk_size: 4096, level: 6, threads: 3 };
        let (_, blob_c) = write(&mut Cursor::new(&tar), &entries, &order, Vec::new(), opts, &|_| {}).unwrap();
        assert_eq!(blob_a, blob_c);
        let w = convert(&tar, &list, 4096).0;
        let toc = decode_toc(&blob_a[w.toc_offset as usize..], Compression::Gzip, w.toc_offset, &w.toc_digest, 1 << 20)
            .unwrap();
        let crate::estargz::Landmark::Prefetch { offset } = toc.landmark else { panic!("{:?}", toc.landmark) };
        let json = crate::estargz::toc::verified_toc_json(
            &blob_a[w.toc_offset as usize..],
            Compression::Gzip,
            &w.toc_digest,
            1 << 20,
        )
        .unwrap();
        assert_eq!(crate::estargz::hint::prefetch_landmark(&json), Some(offset), "the hint agrees with the parse");
        assert_eq!(w.prefetch_end, Some(offset), "the descriptor's hint agrees too");
        // Everything the listed files need lies before the landmark: etc, tagged, motd, hard.
        let before: Vec<&str> = toc
            .entries
            .iter()
            .filter(|e| !e.implicit && e.chunks.first().is_none_or(|c| c.offset < offset) && !e.path.is_empty())
            .filter(|e| e.chunks.first().is_some_and(|c| c.offset < offset))
            .map(|e| e.path.as_str())
            .collect();
        assert_eq!(before, ["etc/tagged", "etc/motd"]);
    }

    #[test]
    fn zstd_chunked_blobs_are_read_by_their_footer_and_decompress_to_the_entries() {
        let tar = sample_tar();
        let (w, blob) = convert_as(Format::ZstdChunked, &tar, &[], 4096);
        let footer = parse_footer(&blob[blob.len() - 51..], blob.len() as u64).unwrap();
        assert_eq!((footer.compression, footer.toc_offset), (Compression::Zstd, w.toc_offset));
        assert_eq!(footer.toc_end - footer.toc_offset, w.toc_size);
        assert_eq!(w.toc_compressed_digest, sha256_digest(&blob[footer.toc_offset as usize..footer.toc_end as usize]));
        let member = &blob[footer.toc_offset as usize..footer.toc_end as usize];
        let toc = decode_toc(member, footer.compression, footer.data_end, &w.toc_digest, 1 << 20).unwrap();
        let big = toc.entries.iter().find(|e| e.path == "usr/lib/big.bin").unwrap();
        let mut bytes = Vec::new();
        for c in &big.chunks {
            bytes.extend(decode_chunk(&big.path, c, &blob[c.offset as usize..c.compressed_end as usize]).unwrap());
        }
        let want: Vec<u8> = (0..10_000u32).flat_map(|i| i.to_le_bytes()).collect();
        assert_eq!(bytes, want);
        // A plain zstd reader sees the entries and nothing else: skippable frames are passed.
        let raw = zstd::decode_all(&blob[..]).unwrap();
        assert_eq!((w.diff_id.clone(), w.uncompressed_size), (sha256_digest(&raw), raw.len() as u64));
        let names: Vec<String> = tar::Archive::new(&raw[..])
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(!names.iter().any(|n| n == "stargz.index.json"), "{names:?}");
        assert!(names.iter().any(|n| n == "usr/lib/big.bin"));
    }

    #[test]
    fn entries_that_do_not_form_a_tree_are_refused_not_written() {
        let mut b = tar::Builder::new(Vec::new());
        for name in ["etc", "etc/motd"] {
            let mut h = tar::Header::new_gnu();
            h.set_size(1);
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            b.append_data(&mut h, name, &b"x"[..]).unwrap();
        }
        let tar = b.into_inner().unwrap();
        let entries = index(Cursor::new(&tar)).unwrap();
        let (order, _) = plan(&entries, &[]);
        let e = write(&mut Cursor::new(&tar), &entries, &order, Vec::new(), Options::default(), &|_| {}).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("\"etc\" is not a directory"), "{e}");
    }
}
