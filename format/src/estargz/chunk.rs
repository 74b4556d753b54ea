//! One chunk's bytes from its compressed range: gunzip or unzstd, as the range's first bytes
//! say (the range may span several members or frames),
//! skip the inner offset, take exactly the chunk's size, and check its digest. Only bytes that
//! hash to the TOC's `chunkDigest` ever leave this function.

use super::toc::Chunk;
use super::{FormatError, sha256_digest};
use std::io::Read;

/// `compressed` is the blob's bytes `[chunk.offset, chunk.compressed_end)`; `name` is the file,
/// for messages.
pub fn decode_chunk(name: &str, chunk: &Chunk, compressed: &[u8]) -> Result<Vec<u8>, FormatError> {
    let err = |reason: String| FormatError::Chunk { name: name.to_owned(), file_offset: chunk.file_offset, reason };
    // The range starts at a member boundary, so its magic tells the compression.
    let mut gz: Box<dyn Read + '_> = if compressed.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Box::new(zstd::stream::read::Decoder::new(compressed).map_err(|e| err(format!("zstd: {e}")))?)
    } else {
        Box::new(flate2::read::MultiGzDecoder::new(compressed))
    };
    if chunk.inner_offset > 0 {
        let skipped = std::io::copy(&mut (&mut gz).take(chunk.inner_offset), &mut std::io::sink())
            .map_err(|e| err(format!("decompressing: {e}")))?;
        if skipped != chunk.inner_offset {
            return Err(err(format!(
                "the member ends {skipped} bytes in, before the inner offset {}",
                chunk.inner_offset
            )));
        }
    }
    // Sized by what arrives, not by what the TOC claims.
    let mut out = Vec::with_capacity(chunk.size.min(8 << 20) as usize);
    gz.take(chunk.size).read_to_end(&mut out).map_err(|e| err(format!("decompressing: {e}")))?;
    if out.len() as u64 != chunk.size {
        return Err(err(format!("only {} of its {} bytes are in the blob", out.len(), chunk.size)));
    }
    let actual = sha256_digest(&out);
    if actual != chunk.digest {
        return Err(FormatError::ChunkDigest {
            name: name.to_owned(),
            file_offset: chunk.file_offset,
            expected: chunk.digest.clone(),
            actual,
        });
    }
    Ok(out)
}
