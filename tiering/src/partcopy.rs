//! Server-side copies in parts, for renames of objects larger than the store copies in one
//! request. S3 refuses `CopyObject` of a source over 5 GiB; a checkpoint file is often larger.
//! A refused copy is made again as a multipart upload whose parts are `UploadPartCopy`
//! requests, which `object_store` does not offer, so they are signed and sent here.
//!
//! Every part names the source's ETag (`x-amz-copy-source-if-match`): if another writer
//! replaces the source during the copy, the copy fails rather than mixing two versions. The
//! upload is aborted on any failure, so no part of it is ever visible.

use crate::source::{ColdConfig, ObjectSource, SourceError};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::ClientOptions;
use object_store::aws::{AmazonS3, AwsAuthorizer};
use object_store::client::{HttpClient, HttpConnector, HttpRequestBody};
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as ObjPath;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// S3's largest part, and its largest number of parts.
const MAX_PART: u64 = 5 << 30;
const MAX_PARTS: u64 = 10_000;
/// Parts are at most this large, so that even a copy just over the limit runs in parallel.
const PREFERRED_PART: u64 = 512 << 20;
const PARALLEL: usize = 8;

/// How to reach one bucket with hand-signed requests.
#[derive(Debug, Clone)]
pub(crate) struct PartCopier {
    s3: Arc<AmazonS3>,
    client: HttpClient,
    /// `http://host:port/bucket` (path style) or `https://bucket.host` (virtual-hosted).
    pub(crate) bucket_url: String,
    bucket: String,
    region: String,
    timeout: Duration,
    retries: usize,
    /// The largest object the store copies in one request.
    pub(crate) single_limit: u64,
    /// Whether whole copies may go through [`PartCopier::copy_object`]: not when the client
    /// sets server-side encryption, whose headers only its own copy sends.
    pub(crate) whole_copies: bool,
}

/// One part of a copy: bytes `first..=last` of the source as part `number` of upload `id`.
#[derive(Clone, Copy)]
struct Part<'a> {
    to: &'a ObjPath,
    id: &'a str,
    number: u64,
    first: u64,
    last: u64,
}

/// What a part copy needs to know of its source.
pub(crate) struct CopySource<'a> {
    pub(crate) loc: &'a ObjPath,
    pub(crate) size: u64,
    pub(crate) etag: &'a str,
}

impl PartCopier {
    /// `bucket_url`, `region` and `whole_copies` ([`may_copy_whole`]) as the client resolved
    /// them; the rest from the config.
    pub(crate) fn new(
        s3: Arc<AmazonS3>,
        connector: &impl HttpConnector,
        options: &ClientOptions,
        bucket_url: String,
        region: String,
        whole_copies: bool,
        c: &ColdConfig,
    ) -> Result<PartCopier, object_store::Error> {
        Ok(PartCopier {
            s3,
            client: connector.connect(options)?,
            bucket_url,
            bucket: c.bucket.clone().unwrap_or_default(),
            region,
            timeout: c.timeout.0,
            retries: c.retries,
            single_limit: c.single_copy_limit.0,
            whole_copies,
        })
    }

    /// Copies `from` to `to` as a multipart upload of part copies, on the store of `source`.
    /// `to` appears only whole.
    pub(crate) async fn copy(
        &self,
        source: &ObjectSource,
        from: CopySource<'_>,
        to: &ObjPath,
    ) -> Result<(), SourceError> {
        let key = to.as_ref();
        let id = source.bounded("CreateMultipartUpload", key, self.s3.create_multipart(to)).await?;
        let part = part_size(self.single_limit, from.size);
        let count = from.size.div_ceil(part).max(1);
        let parts = futures::stream::iter(0..count)
            .map(|i| {
                let first = i * part;
                let last = (first + part).min(from.size).max(1) - 1;
                self.copy_part(&from, Part { to, id: &id, number: i + 1, first, last })
            })
            .buffered(PARALLEL)
            .try_collect::<Vec<PartId>>()
            .await;
        let done = match parts {
            Ok(parts) => {
                source.bounded("CompleteMultipartUpload", key, self.s3.complete_multipart(to, &id, parts)).await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = done {
            if let Err(abort) = self.s3.abort_multipart(to, &id).await {
                tracing::warn!(to = %to, error = %abort, "aborting the part copy failed; the store drops it by its own rules");
            }
            return Err(e);
        }
        Ok(())
    }

    /// One `UploadPartCopy`, retried on a failure that may pass (a transport error, a 5xx).
    async fn copy_part(&self, from: &CopySource<'_>, part: Part<'_>) -> Result<PartId, SourceError> {
        let Part { to, number, first, last, .. } = part;
        let mut attempt = 0;
        loop {
            match self.copy_part_once(from, &part).await {
                Ok(etag) => return Ok(PartId { content_id: etag }),
                Err((message, again)) if again && attempt < self.retries => {
                    attempt += 1;
                    tracing::debug!(to = %to, part = number, %message, attempt, "part copy failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100 << attempt.min(5))).await;
                }
                Err((message, _)) => {
                    return Err(SourceError::CopyParts {
                        to: to.to_string(),
                        message: format!("part {number} (bytes {first}-{last}): {message}"),
                    });
                }
            }
        }
    }

    /// The part's ETag, or what went wrong and whether a retry may help.
    async fn copy_part_once(&self, from: &CopySource<'_>, part: &Part<'_>) -> Result<String, (String, bool)> {
        let Part { to, id, number, first, last } = *part;
        let url = format!("{}/{}?partNumber={number}&uploadId={}", self.bucket_url, encode(to.as_ref()), encode(id));
        let text = self.send_copy(&url, from, Some((first, last))).await?;
        etag_of(&text).ok_or_else(|| (format!("no ETag in the answer: {text}"), false))
    }

    /// One `CopyObject` of the whole of `from` to `to` (on the condition that `from` still has
    /// the ETag given, if one is: S3 honours it, RGW 16.2 does not). Returns the new object's
    /// ETag and modification time from the copy's own answer, which `object_store`'s copy
    /// drops, so that no `HEAD` has to follow it; `None` when the copy was made but its answer
    /// does not say both. Not retried: the caller falls back to the plain copy, which is.
    pub(crate) async fn copy_object(
        &self,
        from: &CopySource<'_>,
        to: &ObjPath,
    ) -> Result<Option<(String, SystemTime)>, (String, bool)> {
        let url = format!("{}/{}", self.bucket_url, encode(to.as_ref()));
        let text = self.send_copy(&url, from, None).await?;
        let modified = element(&text, "LastModified").and_then(|t| humantime::parse_rfc3339(&t).ok());
        Ok(etag_of(&text).zip(modified))
    }

    /// Sends a copy request (of `range`, inclusive, or of the whole object) to `url`, signed,
    /// within the timeout. Returns the answer's body, or what went wrong and whether a retry
    /// may help.
    async fn send_copy(
        &self,
        url: &str,
        from: &CopySource<'_>,
        range: Option<(u64, u64)>,
    ) -> Result<String, (String, bool)> {
        let mut req = hyper::Request::builder()
            .method("PUT")
            .uri(url)
            .header("x-amz-copy-source", format!("/{}/{}", encode(&self.bucket), encode(from.loc.as_ref())))
            .header("content-length", "0");
        if let Some((first, last)) = range {
            req = req.header("x-amz-copy-source-range", format!("bytes={first}-{last}"));
        }
        if !from.etag.is_empty() {
            req = req.header("x-amz-copy-source-if-match", from.etag);
        }
        let mut req = req.body(HttpRequestBody::from(Bytes::new())).map_err(|e| (e.to_string(), false))?;
        let credential = self.s3.credentials().get_credential().await.map_err(|e| (e.to_string(), true))?;
        AwsAuthorizer::new(&credential, "s3", &self.region)
            .try_authorize(&mut req, None)
            .map_err(|e| (e.to_string(), false))?;
        let answer = tokio::time::timeout(self.timeout, async {
            let resp = self.client.execute(req).await.map_err(|e| (e.to_string(), true))?;
            let status = resp.status();
            let body = resp.into_body().bytes().await.map_err(|e| (e.to_string(), true))?;
            Ok::<_, (String, bool)>((status, body))
        })
        .await
        .map_err(|_| (format!("no answer within {:?}", self.timeout), true))??;
        let (status, body) = answer;
        let text = String::from_utf8_lossy(&body).into_owned();
        // A copy may fail after its 200 has been sent: the error is then in the body.
        if !status.is_success() || text.contains("<Error>") {
            let code = element(&text, "Code").unwrap_or_default();
            let message = element(&text, "Message").unwrap_or_default();
            return Err((format!("HTTP {status} {code} {message}").trim().to_string(), status.is_server_error()));
        }
        Ok(text)
    }
}

/// The `ETag` of a copy's answer, quoted as in a header: S3 quotes it in the XML (as `&quot;`),
/// RGW does not.
fn etag_of(xml: &str) -> Option<String> {
    let e = element(xml, "ETag")?.replace("&quot;", "\"");
    let bare = e.trim_matches('"');
    (!bare.is_empty()).then(|| format!("\"{bare}\""))
}

/// Whether whole copies may be hand-signed for the client `b` builds: not when it sets
/// server-side encryption (from `AWS_SERVER_SIDE_ENCRYPTION`, say), whose headers only its own
/// copy sends, or the copy would be stored under the bucket's default encryption instead.
pub(crate) fn may_copy_whole(b: &object_store::aws::AmazonS3Builder) -> bool {
    // The key's own type is private to object_store; its name is not.
    let sse = "aws_server_side_encryption".parse::<object_store::aws::AmazonS3ConfigKey>();
    sse.is_ok_and(|k| b.get_config_value(&k).is_none_or(|v| v.is_empty()))
}

/// The part size for a copy of `size` bytes from a store that copies up to `limit` at once:
/// within S3's bounds and its part count.
fn part_size(limit: u64, size: u64) -> u64 {
    limit.clamp(5 << 20, PREFERRED_PART).max(size.div_ceil(MAX_PARTS)).min(MAX_PART)
}

/// The text of the first `<name>` element.
fn element(xml: &str, name: &str) -> Option<String> {
    let open = format!("<{name}>");
    let start = xml.find(&open)? + open.len();
    let len = xml[start..].find(&format!("</{name}>"))?;
    Some(xml[start..start + len].to_string())
}

/// Percent-encodes everything but S3's unreserved characters and `/`, as a SigV4 canonical URI
/// and `x-amz-copy-source` want it.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_encoded_as_s3_signs_them() {
        assert_eq!(encode("ckpt/step 10/model.pt"), "ckpt/step%2010/model.pt");
        assert_eq!(encode("a+b=c&d~e"), "a%2Bb%3Dc%26d~e");
        assert_eq!(encode("é"), "%C3%A9");
    }

    fn source(extra: &str) -> Result<crate::source::ObjectSource, SourceError> {
        let c: ColdConfig = toml::from_str(&format!(
            "kind = \"s3\"\nbucket = \"b\"\naccess_key_id = \"k\"\nsecret_access_key = \"s\"\nregion = \"eu-west-3\"\n{extra}"
        ))
        .unwrap();
        crate::source::ObjectSource::new(&c, std::path::Path::new("/nonexistent"))
    }

    #[test]
    fn a_limit_under_s3s_smallest_part_is_a_config_error() {
        let e = source("single_copy_limit = \"1MiB\"").unwrap_err();
        assert!(e.to_string().starts_with("cold.single_copy_limit: must be at least 5MiB"), "{e}");
    }

    #[test]
    fn a_client_with_server_side_encryption_copies_through_object_store_alone() {
        use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
        assert!(source("").unwrap().parts.as_ref().unwrap().whole_copies);
        let sse: AmazonS3ConfigKey = "aws_server_side_encryption".parse().unwrap();
        assert!(may_copy_whole(&AmazonS3Builder::new()));
        assert!(!may_copy_whole(&AmazonS3Builder::new().with_config(sse, "aws:kms")));
    }

    #[test]
    fn bodies_are_signed_over_plain_http_only_unless_asked() {
        let cold = |extra: &str| -> ColdConfig { toml::from_str(&format!("kind = \"s3\"\n{extra}")).unwrap() };
        assert!(cold("").unsigned_payload(None), "AWS, over HTTPS");
        assert!(cold("").unsigned_payload(Some("https://rgw:7443")));
        assert!(!cold("").unsigned_payload(Some("http://rgw:7480")));
        assert!(!cold("sign_payload = true").unsigned_payload(Some("https://rgw:7443")));
        assert!(!cold("sign_payload = true").unsigned_payload(None));
        // The endpoint the client resolved, `AWS_ENDPOINT` included, is what counts.
        let b = object_store::aws::AmazonS3Builder::new().with_endpoint("http://rgw:7480");
        let resolved = b.get_config_value(&object_store::aws::AmazonS3ConfigKey::Endpoint);
        assert!(!cold("").unsigned_payload(resolved.as_deref()));
    }

    #[test]
    fn part_copies_address_the_bucket_as_the_client_does() {
        let url = |extra: &str| source(extra).unwrap().parts.as_ref().unwrap().bucket_url.clone();
        let rgw = "endpoint = \"http://rgw:7480/\"\nallow_http = true";
        assert_eq!(url(rgw), "http://rgw:7480/b");
        assert_eq!(url(&format!("{rgw}\npath_style = false")), "http://rgw:7480");
        assert_eq!(url(""), "https://s3.eu-west-3.amazonaws.com/b");
        assert_eq!(url("path_style = false"), "https://b.s3.eu-west-3.amazonaws.com");
    }

    #[test]
    fn parts_stay_within_s3s_bounds() {
        assert_eq!(part_size(5 << 30, 6 << 30), 512 << 20, "a copy just over S3's limit still runs in parallel");
        assert_eq!(part_size(64 << 20, 200 << 20), 64 << 20, "a store with a lower limit gets parts it copies");
        assert_eq!(part_size(1 << 20, 200 << 20), 5 << 20, "never under S3's smallest part");
        let huge = 40u64 << 40;
        let p = part_size(5 << 30, huge);
        assert!(huge.div_ceil(p) <= MAX_PARTS && p <= MAX_PART, "40 TiB in at most 10,000 parts");
    }

    #[test]
    fn answers_are_read_for_their_etag_or_their_error() {
        let ok = "<CopyPartResult><LastModified>x</LastModified><ETag>&quot;abc&quot;</ETag></CopyPartResult>";
        assert_eq!(etag_of(ok).as_deref(), Some("\"abc\""));
        let rgw = "<CopyObjectResult><LastModified>2026-12-04T11:40:00.123Z</LastModified><ETag>9af3-3</ETag></CopyObjectResult>";
        assert_eq!(etag_of(rgw).as_deref(), Some("\"9af3-3\""), "quoted as a HEAD's header is");
        assert_eq!(etag_of("<ETag></ETag>"), None);
        let err = "<Error><Code>PreconditionFailed</Code><Message>At least one</Message></Error>";
        assert_eq!(element(err, "Code").as_deref(), Some("PreconditionFailed"));
        assert_eq!(element(err, "ETag"), None);
    }
}
