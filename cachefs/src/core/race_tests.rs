//! Tests of a lookup or listing whose answer from the store arrives after this mount changed
//! the tree: the answer describes the tree from before the change, and must neither undo the
//! change nor be cached.

use super::tests_support::setup_wrapped;
use super::*;
use crate::namespace::{Streaming, UploadNote};
use futures::future::BoxFuture;
use strata_tiering::ChunkKey;
use strata_tiering::upload::PartUpload;
use tokio::sync::oneshot;

/// A request held back: `asked` fires once the store has answered it, and the answer is
/// handed on when `go` fires.
struct Hold {
    path: String,
    /// The request held (`"stat"`, `"rename"`, ...), or any about `path`.
    op: Option<&'static str>,
    /// Held before the store sees the request, not after it has answered.
    before: bool,
    asked: oneshot::Sender<()>,
    go: oneshot::Receiver<()>,
}

/// The store's namespace, with requests held back: each hold takes the first request it names.
struct Holding {
    inner: Arc<dyn Namespace>,
    hold: Mutex<Vec<Hold>>,
    /// Every directory listed, in order.
    listed: Mutex<Vec<String>>,
}

impl Holding {
    /// Holds the next request about `path`; returns (asked, go).
    fn hold(&self, path: &str) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        self.add(None, path, false)
    }

    /// Holds the next request about `path` before the store sees it; returns (asked, go).
    fn hold_before(&self, path: &str) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        self.add(None, path, true)
    }

    /// Holds the next `op` request about `path` before the store sees it; returns (asked, go).
    fn hold_op_before(&self, op: &'static str, path: &str) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        self.add(Some(op), path, true)
    }

    fn add(&self, op: Option<&'static str>, path: &str, before: bool) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (asked_tx, asked) = oneshot::channel();
        let (go, go_rx) = oneshot::channel();
        self.hold.lock().unwrap().push(Hold { path: path.to_string(), op, before, asked: asked_tx, go: go_rx });
        (asked, go)
    }

    fn held<T: Send + 'static>(
        &self,
        op: &'static str,
        path: &str,
        answer: BoxFuture<'static, Result<T, NsError>>,
    ) -> BoxFuture<'static, Result<T, NsError>> {
        let mut holds = self.hold.lock().unwrap();
        let Some(at) = holds.iter().position(|h| h.path == path && h.op.is_none_or(|o| o == op)) else {
            return answer;
        };
        let hold = holds.remove(at);
        Box::pin(async move {
            if hold.before {
                let _ = hold.asked.send(());
                let _ = hold.go.await;
                return answer.await;
            }
            let answer = answer.await;
            let _ = hold.asked.send(());
            let _ = hold.go.await;
            answer
        })
    }
}

impl Namespace for Holding {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn read_dir(&self, dir: &str) -> BoxFuture<'static, Result<Vec<Node>, NsError>> {
        self.listed.lock().unwrap().push(dir.to_string());
        self.held("read_dir", dir, self.inner.read_dir(dir))
    }
    fn stat(&self, path: &str) -> BoxFuture<'static, Result<Option<Node>, NsError>> {
        self.held("stat", path, self.inner.stat(path))
    }
    fn chunk_size(&self) -> u64 {
        self.inner.chunk_size()
    }
    fn chunk_key(&self, path: &str, node: &Node, index: u64) -> ChunkKey {
        self.inner.chunk_key(path, node, index)
    }
    fn fetcher(&self, path: &str, node: &Node) -> Arc<dyn Fetcher> {
        self.inner.fetcher(path, node)
    }
    fn publish(
        &self,
        path: &str,
        staged: &std::path::Path,
        note: UploadNote,
    ) -> BoxFuture<'static, Result<Node, NsError>> {
        self.held("publish", path, self.inner.publish(path, staged, note))
    }
    fn streaming(&self) -> Option<Streaming> {
        self.inner.streaming()
    }
    fn begin_upload(&self, path: &str) -> BoxFuture<'static, Result<PartUpload, NsError>> {
        self.inner.begin_upload(path)
    }
    fn finish_upload(&self, upload: PartUpload) -> BoxFuture<'static, Result<Node, NsError>> {
        let path = upload.path().to_string();
        self.held("publish", &path, self.inner.finish_upload(upload))
    }
    fn remove(&self, path: &str) -> BoxFuture<'static, Result<(), NsError>> {
        self.inner.remove(path)
    }
    fn rename(&self, from: &str, known: &Node, to: &str) -> BoxFuture<'static, Result<Node, NsError>> {
        self.held("rename", from, self.inner.rename(from, known, to))
    }
    fn list_tree(&self, dir: &str) -> BoxFuture<'static, Result<Vec<(String, Node)>, NsError>> {
        self.held("list_tree", dir, self.inner.list_tree(dir))
    }
    fn copy(&self, from: &str, listed: &Node, to: &str) -> BoxFuture<'static, Result<Node, NsError>> {
        self.inner.copy(from, listed, to)
    }
}

fn holding(dir: &std::path::Path, ttl: Option<Duration>) -> (Arc<FsCore>, Arc<Holding>) {
    let mut holding = None;
    let fs = setup_wrapped(dir, 8 << 20, strata_tiering::source::MAX_PARTS, ttl, |inner| {
        let h = Arc::new(Holding { inner, hold: Mutex::new(Vec::new()), listed: Mutex::new(Vec::new()) });
        holding = Some(h.clone());
        h
    });
    (Arc::new(fs), holding.unwrap())
}

/// Waits for the store to have answered the held request.
async fn answered(asked: oneshot::Receiver<()>) {
    let waited = tokio::time::timeout(Duration::from_secs(10), asked).await;
    assert!(waited.is_ok_and(|r| r.is_ok()), "the store was never asked");
}

/// A mount whose listing of `d/e` has been answered by the store and is held there: the
/// directory's inode, the readdir waiting on the answer, and what hands the answer on.
async fn listing_held(
    fs: &Arc<FsCore>,
    store: &Holding,
) -> (u64, tokio::task::JoinHandle<Result<Vec<(u64, NodeKind, String)>, FsError>>, oneshot::Sender<()>) {
    let d = fs.lookup(ROOT, "d").await.unwrap().ino;
    let e = fs.lookup(d, "e").await.unwrap().ino;
    let (asked, go) = store.hold("d/e");
    let listing = tokio::spawn({
        let fs = fs.clone();
        async move { fs.readdir(e).await }
    });
    answered(asked).await;
    (e, listing, go)
}

/// A file `name` in `parent` written with `content` and closed, with the store holding its
/// release's upload (`before` the store sees it, or once it has answered): the file's inode,
/// the release still under way, and what lets the upload go on.
async fn a_release_held(
    fs: &Arc<FsCore>,
    store: &Holding,
    (parent, name): (u64, &str),
    content: &[u8],
    before: bool,
) -> (u64, tokio::task::JoinHandle<Result<(), FsError>>, oneshot::Sender<()>) {
    let (a, fh) = fs.create(parent, name).await.unwrap();
    fs.write(fh, 0, content).await.unwrap();
    let path = join(&fs.inode(parent).unwrap().path, name);
    let (asked, go) = if before { store.hold_before(&path) } else { store.hold(&path) };
    let releasing = tokio::spawn({
        let fs = fs.clone();
        async move { fs.release(fh).await }
    });
    answered(asked).await;
    (a.ino, releasing, go)
}

async fn read_all(fs: &FsCore, ino: u64) -> Vec<u8> {
    let fh = fs.open(ino, false, false).unwrap();
    let got = fs.read(fh, 0, 1 << 20).await.unwrap().to_vec();
    fs.release(fh).await.unwrap();
    got
}

/// A file rewritten here while a revalidation's `HEAD` of it was on its way (its metadata had
/// expired): the `HEAD`'s answer, the old object, must not become the file's node again, or
/// reads would serve the old bytes from the cache.
#[tokio::test]
async fn a_head_answered_before_a_rewrite_never_brings_the_old_version_back() {
    let dir = tempfile::tempdir().unwrap();
    let ttl = Duration::from_millis(100);
    let (fs, store) = holding(dir.path(), Some(ttl));
    let d = fs.lookup(ROOT, "d").await.unwrap().ino;
    let e = fs.lookup(d, "e").await.unwrap().ino;
    let small = fs.lookup(e, "small").await.unwrap().ino;
    assert_eq!(read_all(&fs, small).await, b"hi", "the old version, now in the cache");

    tokio::time::sleep(ttl * 2).await;
    let (asked, go) = store.hold("d/e/small");
    let revalidating = tokio::spawn({
        let fs = fs.clone();
        async move { fs.lookup(e, "small").await }
    });
    answered(asked).await;
    let fh = fs.open(small, true, true).unwrap();
    fs.write(fh, 0, b"rewritten").await.unwrap();
    fs.flush(fh).await.unwrap();
    fs.release(fh).await.unwrap();
    go.send(()).unwrap();
    let seen = revalidating.await.unwrap().unwrap();
    assert_eq!((seen.ino, seen.size), (small, 9), "the lookup answers with the file as it is now");
    assert_eq!(fs.getattr(small).unwrap().size, 9);
    assert_eq!(read_all(&fs, small).await, b"rewritten", "the old version's cached bytes were served");
}

/// A file created here while a lookup of its name was on its way: the store's answer, no such
/// file, is not cached over it.
#[tokio::test]
async fn a_miss_answered_before_a_create_is_not_cached() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, store) = holding(dir.path(), None);
    let (asked, go) = store.hold("new.pt");
    let looking = tokio::spawn({
        let fs = fs.clone();
        async move { fs.lookup(ROOT, "new.pt").await }
    });
    answered(asked).await;
    let (a, fh) = fs.create(ROOT, "new.pt").await.unwrap();
    fs.write(fh, 0, b"step 1").await.unwrap();
    fs.flush(fh).await.unwrap();
    fs.release(fh).await.unwrap();
    go.send(()).unwrap();
    assert_eq!(looking.await.unwrap().unwrap().ino, a.ino, "asked again once the tree changed");
    let found = fs.lookup(ROOT, "new.pt").await.expect("the file is there, not a cached miss");
    assert_eq!((found.ino, found.size), (a.ino, 6));
}

/// A file unlinked here while a listing of its directory was on its way: the listing that
/// still names it is not cached, so the name does not come back.
#[tokio::test]
async fn a_listing_answered_before_an_unlink_does_not_bring_the_name_back() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, store) = holding(dir.path(), Some(Duration::from_secs(60)));
    let (e, listing, go) = listing_held(&fs, &store).await;
    fs.unlink(e, "small").await.unwrap();
    go.send(()).unwrap();
    let names: Vec<String> = listing.await.unwrap().unwrap().into_iter().map(|(_, _, n)| n).collect();
    assert!(!names.contains(&"small".to_string()), "listed again once the tree changed: {names:?}");
    assert!(matches!(fs.lookup(e, "small").await, Err(FsError::NotFound)), "the unlinked name came back");
    let names: Vec<String> = fs.readdir(e).await.unwrap().into_iter().map(|(_, _, n)| n).collect();
    assert!(!names.contains(&"small".to_string()), "{names:?}");
}

/// A file being written, looked up again once its entry expired: the lookup answers with the
/// size written so far, not the size the file had when it was created.
#[tokio::test]
async fn a_lookup_of_a_file_being_written_keeps_what_was_written() {
    let dir = tempfile::tempdir().unwrap();
    let ttl = Duration::from_millis(100);
    let (fs, _) = holding(dir.path(), Some(ttl));
    let (a, fh) = fs.create(ROOT, "w.pt").await.unwrap();
    fs.write(fh, 0, b"12345").await.unwrap();
    tokio::time::sleep(ttl * 2).await;
    assert_eq!(fs.lookup(ROOT, "w.pt").await.unwrap().size, 5);
    assert_eq!(fs.readdir(ROOT).await.unwrap().iter().filter(|(i, _, _)| *i == a.ino).count(), 1);
    assert_eq!(fs.getattr(a.ino).unwrap().size, 5, "a listing took the size back");
    fs.release(fh).await.unwrap();
    assert_eq!(fs.lookup(ROOT, "w.pt").await.unwrap().size, 5);
}

/// A file written in one directory while another is being listed: the listing is not asked
/// for again, and is cached. A checkpoint written beside a dataset does not make a long listing
/// of the dataset start over.
#[tokio::test]
async fn a_change_in_another_directory_does_not_make_a_listing_start_over() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, store) = holding(dir.path(), Some(Duration::from_secs(60)));
    let (e, listing, go) = listing_held(&fs, &store).await;
    let (_, fh) = fs.create(ROOT, "ckpt.pt").await.unwrap();
    fs.write(fh, 0, b"weights").await.unwrap();
    fs.flush(fh).await.unwrap();
    fs.release(fh).await.unwrap();
    go.send(()).unwrap();
    assert_eq!(listing.await.unwrap().unwrap().len(), 3, ". .. small");
    fs.readdir(e).await.unwrap();
    let listed = store.listed.lock().unwrap().clone();
    assert_eq!(listed.iter().filter(|d| *d == "d/e").count(), 1, "{listed:?}");
}

/// The release of a file's last handle is uploading what it wrote when a truncating open starts
/// the file again: the open gets a copy of its own, not the one going up and then dropped, and
/// its content lands after the release's, never under it.
#[tokio::test]
async fn a_truncating_open_during_a_release_writes_a_copy_of_its_own_that_lands_last() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, store) = holding(dir.path(), None);
    // Written by a process that is not the opener, so the close's flush left it to the release.
    let (a, releasing, go) = a_release_held(&fs, &store, (ROOT, "latest"), b"step 100, from the release", false).await;

    // What the FUSE layer does for `open(O_TRUNC)`.
    if fs.staging(a) {
        tokio::time::timeout(Duration::from_secs(2), fs.truncate_staged(a))
            .await
            .expect("an O_TRUNC open waited on the copy being released")
            .unwrap();
    }
    let second = fs.open(a, true, true).unwrap();
    fs.write(second, 0, b"step 200").await.unwrap();
    let flushing = tokio::spawn({
        let fs = fs.clone();
        async move { fs.flush(second).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    go.send(()).unwrap();
    flushing.await.unwrap().unwrap();
    fs.release(second).await.unwrap();
    releasing.await.unwrap().unwrap();

    assert_eq!(super::tests_support::cold(dir.path(), "latest").unwrap(), b"step 200");
    assert_eq!(read_all(&fs, a).await, b"step 200");
    assert!(std::fs::read_dir(dir.path().join("staging")).unwrap().next().is_none(), "nothing left staged");
}

/// Two closes whose releases both upload (neither writer's own close published it): the copy
/// made last lands last, whichever upload is quicker.
#[tokio::test]
async fn releases_uploading_at_once_land_in_the_order_their_copies_were_made() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, store) = holding(dir.path(), None);
    let (a, first_release, go) = a_release_held(&fs, &store, (ROOT, "latest"), b"step 100", false).await;
    let second = fs.open(a, true, true).unwrap();
    fs.write(second, 0, b"step 200").await.unwrap();
    let second_release = tokio::spawn({
        let fs = fs.clone();
        async move { fs.release(second).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    go.send(()).unwrap();
    second_release.await.unwrap().unwrap();
    first_release.await.unwrap().unwrap();
    assert_eq!(super::tests_support::cold(dir.path(), "latest").unwrap(), b"step 200");
    assert_eq!(read_all(&fs, a).await, b"step 200");
}

/// An open for reading while a close's upload of the file is under way waits for it, and
/// reads what it uploaded: before, the file has no version any read could fetch.
#[tokio::test]
async fn a_read_open_during_a_releases_upload_reads_what_it_uploaded() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, store) = holding(dir.path(), None);
    let (a, first) = fs.create(ROOT, "ckpt").await.unwrap();
    fs.write(first, 0, b"the checkpoint").await.unwrap();
    let (asked, go) = store.hold("ckpt");
    let releasing = tokio::spawn({
        let fs = fs.clone();
        async move { fs.release(first).await }
    });
    answered(asked).await;
    assert!(fs.closing(a.ino));
    let reading = tokio::spawn({
        let fs = fs.clone();
        async move {
            fs.settle_closing(a.ino).await;
            read_all(&fs, a.ino).await
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!reading.is_finished(), "the open did not wait for the upload");
    go.send(()).unwrap();
    assert_eq!(reading.await.unwrap(), b"the checkpoint");
    releasing.await.unwrap().unwrap();
}

/// A rename of a file while a close's upload of an older copy of it is under way waits for
/// that upload: landing after the rename, it would bring the old name back.
#[tokio::test]
async fn a_rename_waits_for_an_older_copys_upload() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, store) = holding(dir.path(), None);
    let (a, releasing, go) = a_release_held(&fs, &store, (ROOT, "p"), b"old", true).await;
    let second = fs.open(a, true, true).unwrap();
    fs.write(second, 0, b"new").await.unwrap();
    let renaming = tokio::spawn({
        let fs = fs.clone();
        async move { fs.rename(ROOT, "p", ROOT, "q").await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    go.send(()).unwrap();
    renaming.await.unwrap().unwrap();
    fs.flush(second).await.unwrap();
    fs.release(second).await.unwrap();
    releasing.await.unwrap().unwrap();
    let cold = |k| super::tests_support::cold(dir.path(), k);
    assert_eq!(cold("p"), None, "the old upload brought the renamed-away name back");
    assert_eq!(cold("q").as_deref(), Some(&b"new"[..]));
    assert!(matches!(fs.lookup(ROOT, "p").await, Err(FsError::NotFound)), "the mount shows the old name again");
    assert_eq!(read_all(&fs, fs.lookup(ROOT, "q").await.unwrap().ino).await, b"new");
}

/// An open of a file a writer has open again joins that writer's copy at once, however long
/// the release of the file's previous copy takes to cache what it published.
#[tokio::test]
async fn an_open_beside_a_writer_does_not_wait_for_an_earlier_release() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, _store) = holding(dir.path(), None);
    let (a, first) = fs.create(ROOT, "f").await.unwrap();
    fs.write(first, 0, b"a").await.unwrap();
    fs.flush(first).await.unwrap();
    let releasing = tokio::spawn({
        let fs = fs.clone();
        async move { fs.release(first).await }
    });
    // The release now waits half a second for a rename before caching the file.
    while !fs.closing(a.ino) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let second = fs.open(a.ino, true, true).unwrap();
    let settled = tokio::time::timeout(Duration::from_millis(200), fs.settle_closing(a.ino)).await;
    assert!(settled.is_ok(), "the open waited for the earlier release");
    fs.release(second).await.unwrap();
    releasing.await.unwrap().unwrap();
}

/// A flush of a file that a rename replaces, asked for while the rename is in the store, waits
/// for it and then has no name to go up under: landing after the rename's copy, it would put
/// the replaced file's bytes under the new name. Either file may have the lower inode number,
/// which decides which of them the rename holds first.
#[tokio::test]
async fn a_flush_of_the_file_a_rename_replaces_does_not_land_over_it() {
    for replaced_first in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (fs, store) = holding(dir.path(), None);
        let (a, b) = if replaced_first {
            let b = fs.create(ROOT, "b").await.unwrap().1;
            (fs.create(ROOT, "a").await.unwrap().1, b)
        } else {
            let a = fs.create(ROOT, "a").await.unwrap().1;
            (a, fs.create(ROOT, "b").await.unwrap().1)
        };
        fs.write(b, 0, b"b first").await.unwrap();
        fs.flush(b).await.unwrap();
        fs.write(b, 7, b", then more").await.unwrap();
        fs.write(a, 0, b"from a").await.unwrap();
        fs.release(a).await.unwrap();
        let (renamed, go_rename) = store.hold_op_before("rename", "a");
        let renaming = tokio::spawn({
            let fs = fs.clone();
            async move { fs.rename(ROOT, "a", ROOT, "b").await }
        });
        answered(renamed).await;
        let (_published, go_publish) = store.hold_op_before("publish", "b");
        let flushing = tokio::spawn({
            let fs = fs.clone();
            async move { fs.flush(b).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        go_rename.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Only a flush that reached the store while the rename was under way is held here.
        let _ = go_publish.send(());
        renaming.await.unwrap().unwrap();
        flushing.await.unwrap().unwrap();
        let cold = |k| super::tests_support::cold(dir.path(), k);
        let order = if replaced_first { "replaced file first" } else { "renamed file first" };
        assert_eq!(cold("b").as_deref(), Some(&b"from a"[..]), "{order}: the replaced file's flush landed over it");
        // Nor can the replaced file, now nameless, start a copy of its own to land there.
        let nameless = fs.open(fs.handle(b).unwrap().ino, true, true);
        assert!(matches!(nameless, Err(FsError::NotFound)), "{order}: {nameless:?}");
        fs.release(b).await.unwrap();
        assert_eq!(cold("b").as_deref(), Some(&b"from a"[..]), "{order}");
        assert_eq!(cold("a"), None, "{order}");
        assert_eq!(read_all(&fs, fs.lookup(ROOT, "b").await.unwrap().ino).await, b"from a", "{order}");
    }
}

/// A directory rename waits for an older copy of a file inside still going up from its
/// release, and moves it with the rest, rather than have it land under the old name after.
#[tokio::test]
async fn a_directory_rename_waits_for_an_older_copys_upload_inside() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, store) = holding(dir.path(), None);
    let d = fs.mkdir(ROOT, "run").await.unwrap();
    let (a, releasing, go) = a_release_held(&fs, &store, (d.ino, "p"), b"old", true).await;
    let second = fs.open(a, true, true).unwrap();
    fs.write(second, 0, b"new").await.unwrap();
    let (listed, go_list) = store.hold_op_before("list_tree", "run");
    let renaming = tokio::spawn({
        let fs = fs.clone();
        async move { fs.rename(ROOT, "run", ROOT, "saved").await }
    });
    // A rename that did not wait lists the tree before the old upload lands: let it copy and
    // finish first. One that waits lists nothing until the upload is let go.
    if tokio::time::timeout(Duration::from_secs(2), listed).await.is_ok() {
        go_list.send(()).unwrap();
        renaming.await.unwrap().unwrap();
        go.send(()).unwrap();
    } else {
        go.send(()).unwrap();
        go_list.send(()).unwrap();
        renaming.await.unwrap().unwrap();
    }
    fs.release(second).await.unwrap();
    releasing.await.unwrap().unwrap();
    let cold = |k| super::tests_support::cold(dir.path(), k);
    assert_eq!(cold("run/p"), None, "the old upload brought the renamed-away name back");
    assert_eq!(cold("saved/p").as_deref(), Some(&b"new"[..]));
    let e = fs.lookup(ROOT, "saved").await.unwrap();
    assert_eq!(read_all(&fs, fs.lookup(e.ino, "p").await.unwrap().ino).await, b"new");
}
