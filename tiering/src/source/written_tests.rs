//! What an upload reports when another client replaces or deletes the object right after it:
//! the version this client wrote, never the other client's.

use crate::source::ColdConfig;
use crate::source::ObjectSource;
use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, ObjectStoreExt,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};
use std::sync::{Arc, Mutex};

/// What another client does to the object just before this client's first `HEAD` of it.
#[derive(Debug, Clone)]
enum Meddle {
    Replace(Bytes),
    Delete,
}

/// A store whose first `HEAD` comes after another client's write or delete.
#[derive(Debug)]
struct Meddling {
    inner: Arc<dyn ObjectStore>,
    before_head: Mutex<Option<Meddle>>,
}

impl std::fmt::Display for Meddling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "meddling {}", self.inner)
    }
}

#[async_trait]
impl ObjectStore for Meddling {
    async fn put_opts(&self, location: &Path, payload: PutPayload, opts: PutOptions) -> Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }
    async fn put_multipart_opts(&self, location: &Path, opts: PutMultipartOptions) -> Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }
    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        if options.head {
            let meddle = self.before_head.lock().unwrap().take();
            match meddle {
                Some(Meddle::Replace(other)) => drop(self.inner.put(location, other.into()).await?),
                Some(Meddle::Delete) => self.inner.delete(location).await?,
                None => {}
            }
        }
        self.inner.get_opts(location, options).await
    }
    fn delete_stream(&self, locations: BoxStream<'static, Result<Path>>) -> BoxStream<'static, Result<Path>> {
        self.inner.delete_stream(locations)
    }
    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list(prefix)
    }
    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

fn source(dir: &std::path::Path, meddle: Option<Meddle>) -> ObjectSource {
    let c: ColdConfig = toml::from_str(&format!("kind = \"local\"\npath = \"{}\"", dir.display())).unwrap();
    let mut s = ObjectSource::new(&c, dir).unwrap();
    s.store = Arc::new(Meddling { inner: s.store.clone(), before_head: Mutex::new(meddle) });
    s
}

/// Uploads `len` bytes as `ckpt`, one PUT up to 1 MiB and parts above, and returns what the
/// upload reported, with the version a plain upload of the same bytes is reported as.
async fn upload(len: usize, meddle: Option<Meddle>) -> (crate::source::ObjectInfo, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("staged");
    std::fs::write(&file, vec![7u8; len]).unwrap();
    let store = dir.path().join("store");
    let s = source(&store, meddle);
    let info = s.upload_file("ckpt", &file, 1 << 20, 2, |_| {}).await.unwrap();
    (info, dir)
}

#[tokio::test]
async fn an_upload_reports_its_own_version_when_another_client_replaces_the_object_at_once() {
    for len in [4096, 3 << 20] {
        let (plain, _d) = upload(len, None).await;
        assert_eq!(plain.size, len as u64);
        let other = Bytes::from(vec![9u8; len]);
        let (info, dir) = upload(len, Some(Meddle::Replace(other.clone()))).await;
        let s = source(&dir.path().join("store"), None);
        let now = s.head("ckpt").await.unwrap();
        assert_eq!(std::fs::read(dir.path().join("store/ckpt")).unwrap(), other, "the other client's write won");
        assert_ne!(
            info.version, now.version,
            "{len} bytes: the upload must not report the other client's object as its own"
        );
        assert_eq!(info.size, len as u64);
    }
}

#[tokio::test]
async fn an_upload_deleted_at_once_by_another_client_still_reports_what_it_wrote() {
    for len in [4096, 3 << 20] {
        let (info, dir) = upload(len, Some(Meddle::Delete)).await;
        assert!(!dir.path().join("store/ckpt").exists());
        assert_eq!(info.size, len as u64, "{len} bytes");
        assert!(!info.version.is_empty());
    }
}
