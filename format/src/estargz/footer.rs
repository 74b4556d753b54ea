//! The footer at the end of an eStargz blob: an empty gzip member whose extra field holds the
//! TOC's offset. The current form is 51 bytes (extra field `SG`, length 22, then
//! `%016x` + `STARGZ`); CRFS's legacy form is 47 bytes (the 22 bytes without the subfield
//! header). zstd:chunked ends with a skippable frame whose 40-byte payload holds the offset and
//! lengths of the compressed TOC (in a skippable frame of its own) and the magic `GnUlInUx`.
//! The external-TOC form is recognised only to be refused clearly.

use super::FormatError;

/// Bytes to fetch from the end of a blob to find any footer.
pub const MAX_FOOTER_SIZE: u64 = 51;
const SKIPPABLE_MAGIC: [u8; 4] = [0x50, 0x2a, 0x4d, 0x18];
const ZSTD_CHUNKED_MAGIC: &[u8; 8] = b"GnUlInUx";
const ZSTD_FOOTER_PAYLOAD: usize = 40;
const ZSTD_MANIFEST_TYPE: u64 = 1;

/// How a blob's members are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    Gzip,
    Zstd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footer {
    pub compression: Compression,
    /// Compressed offset of the TOC: its gzip member, or its zstd frame.
    pub toc_offset: u64,
    /// End of the TOC's compressed bytes.
    pub toc_end: u64,
    /// Where the data members end: the TOC member (gzip) or the skippable frame around the TOC
    /// (zstd) starts there.
    pub data_end: u64,
    /// The footer's own length: 51 or 47 (gzip), 48 (zstd, with its frame header).
    pub len: u64,
}

/// The zstd:chunked footer at the end of `tail`, if that is what it is.
fn zstd_form(tail: &[u8], blob_size: u64) -> Option<Result<Footer, FormatError>> {
    let f = tail.get(tail.len().checked_sub(ZSTD_FOOTER_PAYLOAD + 8)?..)?;
    if f[..4] != SKIPPABLE_MAGIC
        || f[4..8] != (ZSTD_FOOTER_PAYLOAD as u32).to_le_bytes()
        || &f[40..48] != ZSTD_CHUNKED_MAGIC
    {
        return None;
    }
    let word = |i: usize| u64::from_le_bytes(f[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes"));
    let (toc_offset, compressed_len) = (word(0), word(1));
    let len = (ZSTD_FOOTER_PAYLOAD + 8) as u64;
    let end = toc_offset.checked_add(compressed_len);
    let limit = blob_size.checked_sub(len);
    if toc_offset < 8 || word(3) != ZSTD_MANIFEST_TYPE || end.zip(limit).is_none_or(|(e, l)| e > l) {
        return Some(Err(FormatError::TocOffset { offset: toc_offset, size: blob_size }));
    }
    Some(Ok(Footer {
        compression: Compression::Zstd,
        toc_offset,
        toc_end: toc_offset + compressed_len,
        data_end: toc_offset - 8,
        len,
    }))
}

/// Finds the footer at the end of `tail` (the last bytes of a blob of `blob_size` bytes).
pub fn parse_footer(tail: &[u8], blob_size: u64) -> Result<Footer, FormatError> {
    if blob_size < 47 || tail.len() < 47 {
        return Err(FormatError::TooShort(blob_size));
    }
    if let Some(zstd) = zstd_form(tail, blob_size) {
        return zstd;
    }
    let footer = if let Some(f) =
        try_form(tail, 51, 26, |extra| (extra.starts_with(b"SG") && extra[2..4] == [22, 0]).then(|| &extra[4..]))
    {
        f
    } else if let Some(f) = try_form(tail, 47, 22, |extra| Some(extra)) {
        f
    } else if tail.len() >= 46 && tail[tail.len() - 46..].windows(17).any(|w| w == b"STARGZEXTERNALTOC") {
        return Err(FormatError::ExternalToc);
    } else {
        return Err(FormatError::NoFooter);
    };
    // A tail longer than the blob it claims to end is no footer of it either.
    match blob_size.checked_sub(footer.len) {
        Some(end) if footer.toc_offset < end => Ok(Footer { toc_end: end, ..footer }),
        _ => Err(FormatError::TocOffset { offset: footer.toc_offset, size: blob_size }),
    }
}

/// The footer of `len` bytes at the end of `tail`, if it is one: a gzip header with only
/// FEXTRA set and XLEN `xlen`, whose extra field `payload` maps to `%016xSTARGZ`, then an empty
/// final stored block and a zero CRC and size.
fn try_form(tail: &[u8], len: usize, xlen: u16, payload: impl Fn(&[u8]) -> Option<&[u8]>) -> Option<Footer> {
    let f = tail.get(tail.len().checked_sub(len)?..)?;
    let header_ok = f[0] == 0x1f && f[1] == 0x8b && f[2] == 8 && f[3] == 4;
    if !header_ok || u16::from_le_bytes([f[10], f[11]]) != xlen {
        return None;
    }
    let extra = &f[12..12 + xlen as usize];
    let rest = &f[12 + xlen as usize..];
    if rest != [1, 0, 0, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0] {
        return None;
    }
    let p = payload(extra)?;
    if p.len() != 22 || &p[16..] != b"STARGZ" {
        return None;
    }
    let hex = std::str::from_utf8(&p[..16]).ok()?;
    let toc_offset = u64::from_str_radix(hex, 16).ok()?;
    Some(Footer { compression: Compression::Gzip, toc_offset, toc_end: 0, data_end: toc_offset, len: len as u64 })
}

/// A zstd skippable frame (magic 0x184D2A50) around `payload`; decompressors pass over it.
pub fn skippable_frame(payload: &[u8]) -> Vec<u8> {
    let mut f = SKIPPABLE_MAGIC.to_vec();
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

/// The zstd:chunked footer: a skippable frame whose 40-byte payload is the compressed TOC's
/// offset and length, the raw TOC's length, the manifest type 1, and the magic `GnUlInUx`.
pub fn zstd_footer_bytes(toc_offset: u64, compressed_len: u64, raw_len: u64) -> Vec<u8> {
    let mut p = Vec::with_capacity(ZSTD_FOOTER_PAYLOAD);
    for v in [toc_offset, compressed_len, raw_len, ZSTD_MANIFEST_TYPE] {
        p.extend_from_slice(&v.to_le_bytes());
    }
    p.extend_from_slice(ZSTD_CHUNKED_MAGIC);
    skippable_frame(&p)
}

/// The 51-byte footer of a blob whose TOC member starts at `toc_offset`.
pub fn footer_bytes(toc_offset: u64) -> Vec<u8> {
    let mut f = vec![0x1f, 0x8b, 8, 4, 0, 0, 0, 0, 0, 0xff, 26, 0, b'S', b'G', 22, 0];
    f.extend_from_slice(format!("{toc_offset:016x}STARGZ").as_bytes());
    f.extend_from_slice(&[1, 0, 0, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0]);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy(toc_offset: u64) -> Vec<u8> {
        let mut f = vec![0x1f, 0x8b, 8, 4, 0, 0, 0, 0, 0, 0xff, 22, 0];
        f.extend_from_slice(format!("{toc_offset:016x}STARGZ").as_bytes());
        f.extend_from_slice(&[1, 0, 0, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0]);
        f
    }

    #[test]
    fn both_footer_forms_give_the_toc_offset() {
        let f = footer_bytes(0x1234);
        assert_eq!(f.len(), 51);
        let mut blob = vec![0u8; 0x2000];
        blob.extend_from_slice(&f);
        let gz = |toc_offset, len, size: usize| Footer {
            compression: Compression::Gzip,
            toc_offset,
            toc_end: size as u64 - len,
            data_end: toc_offset,
            len,
        };
        assert_eq!(parse_footer(&blob[blob.len() - 51..], blob.len() as u64).unwrap(), gz(0x1234, 51, blob.len()));
        let l = legacy(0x99);
        assert_eq!(l.len(), 47);
        let mut blob = vec![0u8; 0x200];
        blob.extend_from_slice(&l);
        assert_eq!(parse_footer(&blob[blob.len() - 51..], blob.len() as u64).unwrap(), gz(0x99, 47, blob.len()));
    }

    #[test]
    fn the_zstd_chunked_footer_gives_the_toc_range() {
        let mut blob = vec![0u8; 0x300];
        blob.extend_from_slice(&skippable_frame(&[7u8; 0x20]));
        blob.extend_from_slice(&zstd_footer_bytes(0x308, 0x20, 0x99));
        let f = parse_footer(&blob[blob.len() - 51..], blob.len() as u64).unwrap();
        let want =
            Footer { compression: Compression::Zstd, toc_offset: 0x308, toc_end: 0x328, data_end: 0x300, len: 48 };
        assert_eq!(f, want);
        // A TOC that would run into the footer is refused.
        let mut bad = vec![0u8; 0x300];
        bad.extend_from_slice(&zstd_footer_bytes(0x308, 0x20, 0x99));
        let e = parse_footer(&bad[bad.len() - 51..], bad.len() as u64).unwrap_err();
        assert!(matches!(e, FormatError::TocOffset { .. }), "{e}");
    }

    #[test]
    fn damaged_footers_are_refused_by_name() {
        let mut f = footer_bytes(10);
        f[20] = b'g';
        assert!(matches!(parse_footer(&f, 4096), Err(FormatError::NoFooter)), "non-hex offset");
        let f = footer_bytes(5000);
        assert!(matches!(parse_footer(&f, 4096), Err(FormatError::TocOffset { .. })));
        assert!(matches!(parse_footer(&[0u8; 20], 20), Err(FormatError::TooShort(20))));
        assert!(matches!(parse_footer(&[0u8; 51], 1 << 20), Err(FormatError::NoFooter)));
        // A tail longer than the blob it is said to end (found by fuzzing).
        assert!(matches!(parse_footer(&footer_bytes(0), 48), Err(FormatError::TocOffset { .. })));
        assert!(matches!(parse_footer(&zstd_footer_bytes(8, 0, 0), 47), Err(FormatError::TocOffset { .. })));
    }
}
