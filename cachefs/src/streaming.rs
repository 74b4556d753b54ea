//! Uploading a file while it is being written. Once a writer has written a whole part beyond
//! what was sent, that part goes up in the background, from the buffer it was staged from (see
//! `staging`), or else read back from the staging file; fsync or close then sends only the tail
//! and completes the upload. So a
//! checkpoint is in the store soon after its last write, instead of one whole upload later.
//!
//! The object still appears only when the upload completes. A write or truncate behind what
//! was sent, or a rename, gives the upload up, and the file is published whole as before. So
//! does a file that grows past what the store's part limit holds in parts of this size: S3
//! takes 10,000 parts, 156 GiB in 16 MiB parts, and the whole upload at close picks parts
//! large enough. The staging file is not synced for a streamed upload: the manifest records
//! the content's CRC32C instead, so a restart uploads a staged file again only if a crash did
//! not tear it. It also records the upload's ID, so that a restart aborts an upload a crash
//! cut short.

use crate::namespace::{Namespace, Node, NsError, Streaming};
use crate::staging::{Staged, Stream};
use bytes::Bytes;
use strata_tiering::chunkfile::Crc32c;

/// Why a streamed publish failed.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Store(#[from] NsError),
    #[error("reading the staged copy: {0}")]
    Stage(#[from] std::io::Error),
}

/// Sends the parts the writer has finished, as many as the upload's parallelism allows right
/// now; the rest wait for later writes or the publish. A failure here only stops streaming:
/// the publish then uploads the file whole and reports what goes wrong. Returns how many parts
/// it sent.
pub async fn pump(ns: &dyn Namespace, s: &mut Staged) -> u64 {
    let Some(Streaming { part, parallel, max_parts }) = ns.streaming() else { return 0 };
    if !s.streamable || part == 0 {
        return 0;
    }
    let mut st = match s.stream.take() {
        Some(st) => st,
        None if s.len >= part => match ns.begin_upload(&s.target).await {
            Ok(upload) => {
                if let Some(id) = upload.id()
                    && let Err(e) = s.note_upload(id)
                {
                    // Without its ID on disk, a crash would leave the parts in the store.
                    tracing::debug!(path = %s.target, error = %e, "not uploading while writing");
                    s.streamable = false;
                    return 0;
                }
                Stream { upload, sent: 0, crc: Crc32c::default() }
            }
            Err(e) => {
                tracing::debug!(path = %s.target, error = %e, "not uploading while writing");
                s.streamable = false;
                return 0;
            }
        },
        None => return 0,
    };
    let mut parts = 0;
    while s.len >= st.sent + part {
        // The last part number is kept for the tail that fsync or close sends.
        if st.sent / part + 1 >= max_parts {
            too_many_parts(s, part, max_parts);
            return parts;
        }
        if st.upload.in_flight() >= parallel {
            // Parts held in memory wait for the upload; past a few, so does the writer, rather
            // than memory filling with a file the store takes in more slowly than it is written.
            if s.parts_waiting() <= crate::staging::MAX_READY_PARTS {
                break;
            }
            if let Err(e) = st.upload.wait_for_room(parallel).await {
                tracing::debug!(path = %s.target, error = %e, "a part failed while writing; the file goes up whole");
                s.stop_streaming();
                return parts;
            }
        }
        if send_next(s, &mut st, part).is_err() {
            // Dropping the upload aborts it.
            s.stop_streaming();
            return parts;
        }
        parts += 1;
    }
    s.stream = Some(st);
    parts
}

/// Gives the upload up for a file that needs more parts than the store takes; it goes up whole
/// at close, in larger parts.
fn too_many_parts(s: &mut Staged, part: u64, max_parts: u64) {
    tracing::info!(
        path = %s.target,
        parts = max_parts,
        part_size = part,
        "the file outgrows the store's part limit in parts of this size; it goes up whole at fsync or \
         close instead (a larger part_size keeps files this large uploading while written)"
    );
    s.stop_streaming();
}

/// Sends the `len` bytes after what was sent as the next part: the part itself if the staged
/// file still holds it in memory, else read back from the file.
fn send_next(s: &mut Staged, st: &mut Stream, len: u64) -> std::io::Result<()> {
    let data = match s.take_part(st.sent).filter(|p| p.len() as u64 == len) {
        Some(p) => p,
        None => Bytes::from(s.read_at(st.sent, len as usize)?),
    };
    st.crc.update(&data);
    st.sent += data.len() as u64;
    st.upload.put_part(data);
    Ok(())
}

/// Publishes a file whose upload started while it was written: sends the tail, records the
/// content in the manifest, and completes the upload. `None` when there is no such upload.
pub async fn finish(ns: &dyn Namespace, s: &mut Staged) -> Option<Result<Node, StreamError>> {
    let mut st = s.stream.take()?;
    let Streaming { part, parallel, max_parts } = ns.streaming()?;
    if st.sent / part + (s.len - st.sent).div_ceil(part) > max_parts {
        too_many_parts(s, part, max_parts);
        return None;
    }
    let sent: Result<(), StreamError> = async {
        while st.sent < s.len {
            st.upload.wait_for_room(parallel).await.map_err(NsError::from)?;
            let len = part.min(s.len - st.sent);
            send_next(s, &mut st, len)?;
        }
        s.seal_unsynced(st.crc.finish())?;
        Ok(())
    }
    .await;
    if let Err(e) = sent {
        st.upload.abort().await;
        return Some(Err(e));
    }
    Some(ns.finish_upload(st.upload).await.map_err(StreamError::from))
}
