//! One layer's conversion, start to end on local files: the input blob (gzip, zstd or plain
//! tar, told by its first bytes) is decompressed to a scratch tar whose hash must equal the
//! image config's DiffID, indexed, ordered for prefetch, and written as eStargz. A damaged or
//! unsupported input stops here with the layer's digest in the message.

use super::ConvertError;
use super::estargz_out::{self, Options, Written};
use super::plan::{Pattern, plan};
use super::tar_index::index;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use strata_format::write::Hashed;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compression {
    Gzip,
    Zstd,
    Plain,
}

fn sniff(head: &[u8]) -> Option<Compression> {
    match head {
        [0x1f, 0x8b, ..] => Some(Compression::Gzip),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Some(Compression::Zstd),
        h if h.len() >= 263 && &h[257..262] == b"ustar" => Some(Compression::Plain),
        // An empty layer: only the end-of-archive blocks.
        h if h.len() >= 512 && h[..512].iter().all(|b| *b == 0) => Some(Compression::Plain),
        _ => None,
    }
}

/// The converted layer: where its blob lies, and what it is.
#[derive(Debug, Clone)]
pub struct Converted {
    pub blob: PathBuf,
    pub written: Written,
    /// Files placed before `.prefetch.landmark`.
    pub prefetched: usize,
}

/// Converts the blob at `input` (layer `digest`, whose uncompressed tar must hash to
/// `diff_id`) into `work`. `progress` gets uncompressed bytes as they are written.
pub fn convert(
    digest: &str,
    diff_id: Option<&str>,
    input: &Path,
    work: &Path,
    prefetch: &[Pattern],
    opts: Options,
    progress: &dyn Fn(u64),
) -> Result<Converted, ConvertError> {
    let layer = |reason: String| ConvertError::Layer { layer: digest.to_owned(), reason };
    let io_err = |what: &str| {
        let what = format!("layer {digest}: {what}");
        move |source: io::Error| ConvertError::Io { what, source }
    };
    let hex = digest.rsplit(':').next().unwrap_or(digest);
    let tar_path = work.join(format!("{hex}.tar"));
    let out_path = work.join(format!("{hex}.esgz"));
    let result = (|| {
        let mut src = BufReader::with_capacity(1 << 20, File::open(input).map_err(io_err("opening the input blob"))?);
        let mut head = [0u8; 512];
        let mut got = 0;
        while got < head.len() {
            let n = src.get_mut().read(&mut head[got..]).map_err(io_err("reading the input blob"))?;
            if n == 0 {
                break;
            }
            got += n;
        }
        let kind = sniff(&head[..got]).ok_or_else(|| {
            layer("the blob is neither gzip, zstd nor a tar archive; its media type is not one Strata converts".into())
        })?;
        let src = io::Cursor::new(head[..got].to_vec()).chain(src);
        let tar_file = File::create(&tar_path).map_err(io_err("creating the scratch tar"))?;
        // Hashed as it is written: the DiffID the config must name.
        let mut sink = Hashed::new(BufWriter::with_capacity(1 << 20, tar_file));
        let copied = match kind {
            Compression::Gzip => io::copy(&mut flate2::read::MultiGzDecoder::new(src), &mut sink),
            Compression::Zstd => zstd::stream::read::Decoder::new(src).and_then(|mut d| io::copy(&mut d, &mut sink)),
            Compression::Plain => io::copy(&mut { src }, &mut sink),
        };
        copied.map_err(|e| layer(format!("the blob does not decompress: {e}")))?;
        sink.flush().map_err(io_err("writing the scratch tar"))?;
        let (actual, _) = sink.finish();
        if let Some(expected) = diff_id
            && actual != expected
        {
            return Err(layer(format!(
                "its uncompressed content hashes to {actual}, but the image config's diff_ids say {expected}"
            )));
        }
        let mut tar =
            BufReader::with_capacity(1 << 20, File::open(&tar_path).map_err(io_err("reopening the scratch tar"))?);
        let entries = index(&mut tar).map_err(|e| layer(e.to_string()))?;
        let (order, prefetched) = plan(&entries, prefetch);
        let out =
            BufWriter::with_capacity(1 << 20, File::create(&out_path).map_err(io_err("creating the output blob"))?);
        let (written, out) = estargz_out::write(&mut tar, &entries, &order, out, opts, progress).map_err(|e| {
            // InvalidData: the entries themselves, not the disk.
            if e.kind() == io::ErrorKind::InvalidData { layer(e.to_string()) } else { io_err("writing the blob")(e) }
        })?;
        out.into_inner().map_err(|e| io_err("writing the eStargz blob")(e.into_error()))?.sync_all().ok();
        Ok(Converted { blob: out_path.clone(), written, prefetched })
    })();
    let _ = std::fs::remove_file(&tar_path);
    if result.is_err() {
        let _ = std::fs::remove_file(&out_path);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_tar() -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data) in [("etc/motd", &b"hello\n"[..]), ("usr/lib/big.bin", &[7u8; 100_000][..])] {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1_700_000_000);
            b.append_data(&mut h, name, data).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn inputs_are_told_by_their_bytes_and_bad_ones_named() {
        let work = tempfile::tempdir().unwrap();
        let tar = small_tar();
        let diff_id = crate::estargz::sha256_digest(&tar);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&tar).unwrap();
        let inputs =
            [("plain", tar.clone()), ("gzip", gz.finish().unwrap()), ("zstd", zstd::encode_all(&tar[..], 1).unwrap())];
        let mut blobs = Vec::new();
        for (name, bytes) in inputs {
            let input = work.path().join(name);
            std::fs::write(&input, bytes).unwrap();
            let c = convert(
                &format!("sha256:{name}"),
                Some(&diff_id),
                &input,
                work.path(),
                &[],
                Options::default(),
                &|_| {},
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            blobs.push(std::fs::read(&c.blob).unwrap());
        }
        assert!(blobs.windows(2).all(|w| w[0] == w[1]), "the same tar gives the same blob, however it came");

        let input = work.path().join("plain");
        let e = convert("sha256:x", Some("sha256:0000"), &input, work.path(), &[], Options::default(), &|_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("sha256:x") && e.contains("diff_ids say sha256:0000"), "{e}");
        std::fs::write(&input, b"PK\x03\x04 a zip file, not a layer").unwrap();
        let e =
            convert("sha256:y", None, &input, work.path(), &[], Options::default(), &|_| {}).unwrap_err().to_string();
        assert!(e.contains("sha256:y") && e.contains("neither gzip"), "{e}");
        let mut truncated = std::fs::read(work.path().join("gzip")).unwrap();
        truncated.truncate(truncated.len() / 2);
        std::fs::write(&input, truncated).unwrap();
        let e =
            convert("sha256:z", None, &input, work.path(), &[], Options::default(), &|_| {}).unwrap_err().to_string();
        assert!(e.contains("sha256:z") && e.contains("does not decompress"), "{e}");
        // Nothing is left behind by a failed conversion.
        let left: Vec<_> = std::fs::read_dir(work.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(
            left.iter().all(|n| !n.to_string_lossy().starts_with('x') && !n.to_string_lossy().starts_with('y')),
            "{left:?}"
        );
    }
}
