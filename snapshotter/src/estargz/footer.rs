//! The footer at the end of an eStargz blob: an empty gzip member whose extra field holds the
//! TOC's offset. The current form is 51 bytes (extra field `SG`, length 22, then
//! `%016x` + `STARGZ`); CRFS's legacy form is 47 bytes (the 22 bytes without the subfield
//! header). The external-TOC form is recognised only to be refused clearly.

use super::FormatError;

/// Bytes to fetch from the end of a blob to find any footer.
pub const MAX_FOOTER_SIZE: u64 = 51;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footer {
    /// Compressed offset of the TOC's gzip member.
    pub toc_offset: u64,
    /// The footer's own length, 51 or 47.
    pub len: u64,
}

/// Finds the footer at the end of `tail` (the last bytes of a blob of `blob_size` bytes).
pub fn parse_footer(tail: &[u8], blob_size: u64) -> Result<Footer, FormatError> {
    if blob_size < 47 || tail.len() < 47 {
        return Err(FormatError::TooShort(blob_size));
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
    if footer.toc_offset >= blob_size - footer.len {
        return Err(FormatError::TocOffset { offset: footer.toc_offset, size: blob_size });
    }
    Ok(footer)
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
    Some(Footer { toc_offset, len: len as u64 })
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
        assert_eq!(
            parse_footer(&blob[blob.len() - 51..], blob.len() as u64).unwrap(),
            Footer { toc_offset: 0x1234, len: 51 }
        );
        let l = legacy(0x99);
        assert_eq!(l.len(), 47);
        let mut blob = vec![0u8; 0x200];
        blob.extend_from_slice(&l);
        assert_eq!(
            parse_footer(&blob[blob.len() - 51..], blob.len() as u64).unwrap(),
            Footer { toc_offset: 0x99, len: 47 }
        );
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
    }
}
