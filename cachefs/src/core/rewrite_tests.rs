//! Tests of a file written again, renamed or unlinked while another handle, flush or release of
//! it is still under way: the object holds one version whole, and the cache holds the bytes
//! of the version its keys name.

use super::tests_support::{block_uploads, cold, setup, unblock_uploads};
use super::*;

#[tokio::test]
async fn an_o_trunc_open_while_the_file_is_still_open_starts_its_content_again() {
    let dir = tempfile::tempdir().unwrap();
    let fs = setup(dir.path());
    let (a, first) = fs.create(ROOT, "f").await.unwrap();
    fs.write(first, 0, b"0123456789").await.unwrap();
    fs.flush(first).await.unwrap();
    // `first` stays open, so the staged copy is still this file's when the next writer opens
    // it with O_TRUNC (the kernel sends no truncate of its own for that).
    assert!(fs.staging(a.ino));
    fs.truncate_staged(a.ino).await.unwrap();
    assert_eq!(fs.getattr(a.ino).unwrap().size, 0);
    let second = fs.open(a.ino, true, true).unwrap();
    fs.write(second, 0, b"short").await.unwrap();
    fs.flush(second).await.unwrap();
    assert_eq!(cold(dir.path(), "f").unwrap(), b"short", "the old content's tail is still in the object");
    fs.release(second).await.unwrap();
    fs.release(first).await.unwrap();
    assert_eq!(cold(dir.path(), "f").unwrap(), b"short");
}

/// `echo 'step 100' > latest; echo 'step 200' > latest`: the first close's release comes
/// late, after the second content is in the store under the same size. Its staged bytes must
/// not become the cache of the second version.
#[tokio::test]
async fn a_late_release_never_caches_its_bytes_for_a_newer_version() {
    let dir = tempfile::tempdir().unwrap();
    let fs = Arc::new(setup(dir.path()));
    let (a, first) = fs.create(ROOT, "latest").await.unwrap();
    fs.write(first, 0, b"step 100").await.unwrap();
    fs.flush(first).await.unwrap();
    let late = tokio::spawn({
        let fs = fs.clone();
        async move { fs.release(first).await }
    });
    // The first release has let go of the file and waits for a rename that never comes.
    while fs.staging(a.ino) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let second = fs.open(a.ino, true, true).unwrap();
    fs.write(second, 0, b"step 200").await.unwrap();
    fs.flush(second).await.unwrap();
    late.await.unwrap().unwrap();
    fs.release(second).await.unwrap();
    assert_eq!(cold(dir.path(), "latest").unwrap(), b"step 200");

    let reader = fs.open(a.ino, false, false).unwrap();
    assert_eq!(fs.read(reader, 0, 100).await.unwrap(), &b"step 200"[..], "the cache serves the older bytes");
    if let Some(mut copy) = fs.whole_file(reader) {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut copy, &mut bytes).unwrap();
        assert_eq!(bytes, b"step 200", "the whole-file copy holds the older bytes");
    }
    fs.release(reader).await.unwrap();
}

/// A flush (an upload) and a rename of the same file from two threads at once: the object
/// ends whole under the new name, whichever goes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rename_racing_a_flush_of_the_file_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fs = Arc::new(setup(dir.path()));
    for i in 0..20 {
        let (tmp, name) = (format!("r{i}.tmp"), format!("r{i}"));
        let body = format!("checkpoint {i} ").repeat(1000).into_bytes();
        let (_, fh) = fs.create(ROOT, &tmp).await.unwrap();
        fs.write(fh, 0, &body).await.unwrap();
        let flush = tokio::spawn({
            let fs = fs.clone();
            async move { fs.flush(fh).await }
        });
        let rename = tokio::spawn({
            let (fs, tmp, name) = (fs.clone(), tmp.clone(), name.clone());
            async move { fs.rename(ROOT, &tmp, ROOT, &name).await }
        });
        flush.await.unwrap().unwrap();
        rename.await.unwrap().unwrap();
        fs.release(fh).await.unwrap();
        let stored = cold(dir.path(), &name);
        assert!(
            stored.as_deref() == Some(&body[..]),
            "round {i}: {name} is not whole in the store ({:?} bytes of {})",
            stored.map(|b| b.len()),
            body.len()
        );
        assert!(cold(dir.path(), &tmp).is_none(), "round {i}: {tmp} is still in the store");
    }
}

/// fsync fails while the file stays open, and the process dies before its close: a restart
/// must not upload what the writer was told had failed.
#[tokio::test]
async fn a_failed_fsync_is_recorded_before_the_file_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let fs = setup(dir.path());
    let d = fs.lookup(ROOT, "d").await.unwrap();
    let (_, fh) = fs.create(d.ino, "ckpt").await.unwrap();
    fs.write(fh, 0, b"told it failed").await.unwrap();
    block_uploads(dir.path(), "d");
    assert!(matches!(fs.flush(fh).await, Err(FsError::Publish { .. })));
    unblock_uploads(dir.path(), "d");
    // The crash: the handle is never released. A restart finds the staging dir as it is now.
    let report = fs.recover_staged(true).await;
    assert!(cold(dir.path(), "d/ckpt").is_none(), "a restart uploaded it");
    assert_eq!(report.len(), 1, "{report:?}");
    assert!(report[0].contains("d/ckpt") && report[0].contains("writer was told"), "{report:?}");
}

/// A file unlinked while open for writing (a temporary file): writes and reads through the
/// open handle go on, and its close succeeds, uploads nothing and leaves nothing staged.
#[tokio::test]
async fn a_file_unlinked_while_open_for_writing_closes_cleanly_and_uploads_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fs = setup(dir.path());
    let (_, fh) = fs.create(ROOT, "scratch").await.unwrap();
    fs.write(fh, 0, b"scratch").await.unwrap();
    fs.unlink(ROOT, "scratch").await.unwrap();
    fs.write(fh, 7, b" and more").await.unwrap();
    assert_eq!(fs.read(fh, 0, 100).await.unwrap(), &b"scratch and more"[..]);
    fs.flush(fh).await.unwrap();
    fs.release(fh).await.unwrap();
    assert!(cold(dir.path(), "scratch").is_none());
    assert!(matches!(fs.lookup(ROOT, "scratch").await, Err(FsError::NotFound)));
    let left: Vec<_> = std::fs::read_dir(dir.path().join("staging")).unwrap().collect();
    assert!(left.is_empty(), "left in staging: {left:?}");
    assert!(fs.recover_staged(true).await.is_empty());
}

/// A file renamed over one that another handle is still writing: that writer's close must not
/// upload over the file now under the name.
#[tokio::test]
async fn a_rename_over_a_file_still_being_written_keeps_the_renamed_file() {
    let dir = tempfile::tempdir().unwrap();
    let fs = setup(dir.path());
    let (_, writing) = fs.create(ROOT, "model.pt").await.unwrap();
    fs.write(writing, 0, b"a half-written older save").await.unwrap();
    let (_, fh) = fs.create(ROOT, "model.pt.tmp").await.unwrap();
    fs.write(fh, 0, b"the finished save").await.unwrap();
    fs.flush(fh).await.unwrap();
    fs.release(fh).await.unwrap();
    fs.rename(ROOT, "model.pt.tmp", ROOT, "model.pt").await.unwrap();
    fs.write(writing, 25, b", and more").await.unwrap();
    fs.flush(writing).await.unwrap();
    fs.release(writing).await.unwrap();
    assert_eq!(cold(dir.path(), "model.pt").unwrap(), b"the finished save");
    let a = fs.lookup(ROOT, "model.pt").await.unwrap();
    let reader = fs.open(a.ino, false, false).unwrap();
    assert_eq!(fs.read(reader, 0, 100).await.unwrap(), &b"the finished save"[..]);
    fs.release(reader).await.unwrap();
    assert!(std::fs::read_dir(dir.path().join("staging")).unwrap().next().is_none(), "nothing left staged");
}

/// Another client replaces an object (same size) while this mount still has the old version
/// cached, and this mount then renames it: the new name holds the new bytes, not the cached old
/// ones moved over to it.
#[tokio::test]
async fn a_rename_never_moves_cached_bytes_onto_a_version_it_did_not_cache() {
    let dir = tempfile::tempdir().unwrap();
    let fs = setup(dir.path());
    std::fs::write(dir.path().join("cold/shard"), b"old content, v1").unwrap();
    let a = fs.lookup(ROOT, "shard").await.unwrap();
    let fh = fs.open(a.ino, false, false).unwrap();
    assert_eq!(fs.read(fh, 0, 100).await.unwrap(), &b"old content, v1"[..]);
    fs.release(fh).await.unwrap();
    // Another writer, the same size; this mount's listing still says v1.
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(dir.path().join("cold/shard"), b"new content, v2").unwrap();
    fs.rename(ROOT, "shard", ROOT, "moved").await.unwrap();
    // The chunks are moved in the background; give that its time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = fs.lookup(ROOT, "moved").await.unwrap();
    let fh = fs.open(b.ino, false, false).unwrap();
    assert_eq!(fs.read(fh, 0, 100).await.unwrap(), &b"new content, v2"[..], "the cached old bytes were moved over");
    fs.release(fh).await.unwrap();
}

/// `open(O_TRUNC)` of a file that is an object in the store, then `unlink` before any flush:
/// the object goes. The rewrite looks like a new file until its close, but the name had an
/// object behind it.
#[tokio::test]
async fn an_unlink_of_a_file_being_rewritten_deletes_its_object() {
    let dir = tempfile::tempdir().unwrap();
    let fs = setup(dir.path());
    std::fs::write(dir.path().join("cold/old.pt"), b"the old object").unwrap();
    let a = fs.lookup(ROOT, "old.pt").await.unwrap();
    let fh = fs.open(a.ino, true, true).unwrap();
    fs.unlink(ROOT, "old.pt").await.unwrap();
    assert!(cold(dir.path(), "old.pt").is_none(), "the old object is still in the store");
    fs.release(fh).await.unwrap();
    assert!(matches!(fs.lookup(ROOT, "old.pt").await, Err(FsError::NotFound)));
}

/// Two `open(O_TRUNC)`s of one file at once, on two threads as the kernel sends them: they
/// share one staged copy, so when both are closed nothing is left staged for a restart to
/// upload over the file. A hundred files, to meet the moment both opens look at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncating_opens_at_once_share_one_staged_copy() {
    let dir = tempfile::tempdir().unwrap();
    let fs = Arc::new(setup(dir.path()));
    let mut opened = Vec::new();
    for round in 0..100 {
        let name = format!("f{round}");
        std::fs::write(dir.path().join("cold").join(&name), b"old").unwrap();
        let ino = fs.lookup(ROOT, &name).await.unwrap().ino;
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let opens: Vec<_> = (0..2)
            .map(|_| {
                let (fs, barrier) = (fs.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    fs.open(ino, true, true).unwrap()
                })
            })
            .collect();
        let fhs: Vec<u64> = opens.into_iter().map(|t| t.join().unwrap()).collect();
        fs.write(fhs[0], 0, b"new").await.unwrap();
        for fh in &fhs {
            fs.flush(*fh).await.unwrap();
        }
        opened.push((name, fhs));
    }
    // Released together: each release waits a moment for a rename before caching the file.
    let releases = opened.iter().flat_map(|(_, fhs)| fhs.iter().map(|fh| fs.release(*fh)));
    for r in futures::future::join_all(releases).await {
        r.unwrap();
    }
    for (name, _) in &opened {
        assert_eq!(cold(dir.path(), name).unwrap(), b"new", "{name}");
    }
    let left: Vec<_> = std::fs::read_dir(dir.path().join("staging")).unwrap().collect();
    assert!(left.is_empty(), "left in staging: {left:?}");
}

/// `mv ckpt.tmp ckpt` right after the close, while its release waits to cache it under the
/// final name: the published file leaves no manifest for a crash then to report as cut short.
#[tokio::test]
async fn a_rename_during_the_release_of_a_published_file_leaves_nothing_to_report() {
    let dir = tempfile::tempdir().unwrap();
    let fs = Arc::new(setup(dir.path()));
    let (_, fh) = fs.create(ROOT, "ckpt.tmp").await.unwrap();
    fs.write(fh, 0, b"weights").await.unwrap();
    fs.flush(fh).await.unwrap();
    let releasing = tokio::spawn({
        let fs = fs.clone();
        async move { fs.release(fh).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    fs.rename(ROOT, "ckpt.tmp", ROOT, "ckpt").await.unwrap();
    let left = staging::leftovers(&dir.path().join("staging"));
    assert!(left.is_empty(), "a crash now would report: {left:?}");
    releasing.await.unwrap().unwrap();
    assert_eq!(cold(dir.path(), "ckpt").unwrap(), b"weights");
}

/// A file whose upload failed, renamed over while still open, has nothing left to keep or
/// report at its release: the name is the renamed file's, and keeps showing it.
#[tokio::test]
async fn a_failed_copy_renamed_over_while_open_leaves_the_name_to_the_file_renamed_in() {
    let dir = tempfile::tempdir().unwrap();
    let fs = setup(dir.path());
    let d = fs.lookup(ROOT, "d").await.unwrap();
    let e = fs.lookup(d.ino, "e").await.unwrap();
    let (_, failed) = fs.create(e.ino, "ckpt").await.unwrap();
    fs.write(failed, 0, b"lost").await.unwrap();
    block_uploads(dir.path(), "d/e");
    assert!(matches!(fs.flush(failed).await, Err(FsError::Publish { .. })));
    unblock_uploads(dir.path(), "d/e");

    let (_, tmp) = fs.create(e.ino, "ckpt.tmp").await.unwrap();
    fs.write(tmp, 0, b"the new one").await.unwrap();
    fs.release(tmp).await.unwrap();
    fs.rename(e.ino, "ckpt.tmp", e.ino, "ckpt").await.unwrap();
    let renamed = fs.lookup(e.ino, "ckpt").await.unwrap().ino;
    fs.release(failed).await.unwrap();
    assert_eq!(fs.lookup(e.ino, "ckpt").await.unwrap().ino, renamed, "the failed file took its old name back");
    let reader = fs.open(renamed, false, false).unwrap();
    assert_eq!(fs.read(reader, 0, 100).await.unwrap(), &b"the new one"[..]);
    fs.release(reader).await.unwrap();
    assert_eq!(cold(dir.path(), "d/e/ckpt").as_deref(), Some(&b"the new one"[..]));
    let report = fs.recover_staged(true).await;
    assert!(report.is_empty(), "a copy renamed over is reported: {report:?}");
}

/// A rename of a file being written again, whose old object cannot be deleted, fails whole:
/// the name keeps its file and its object, and the rewrite still goes up under it.
#[tokio::test]
async fn a_rename_of_a_rewrite_whose_old_object_cannot_go_fails_whole() {
    let dir = tempfile::tempdir().unwrap();
    let fs = setup(dir.path());
    let d = fs.lookup(ROOT, "d").await.unwrap();
    let e = fs.lookup(d.ino, "e").await.unwrap();
    let object = dir.path().join("cold/d/e/kept");
    std::fs::write(&object, b"the object as it was").unwrap();
    let kept = fs.lookup(e.ino, "kept").await.unwrap();
    let fh = fs.open(kept.ino, true, true).unwrap();
    fs.write(fh, 0, b"rewritten").await.unwrap();
    // A directory with something in it where the object was cannot be deleted as an object.
    std::fs::remove_file(&object).unwrap();
    std::fs::create_dir_all(object.join("x")).unwrap();
    let renamed = fs.rename(e.ino, "kept", e.ino, "moved").await;
    assert!(renamed.is_err(), "the rename went ahead without the old object's delete");
    std::fs::remove_dir_all(&object).unwrap();
    std::fs::write(&object, b"the object as it was").unwrap();
    assert!(matches!(fs.lookup(e.ino, "moved").await, Err(FsError::NotFound)));
    assert_eq!(fs.lookup(e.ino, "kept").await.unwrap().ino, kept.ino);
    fs.flush(fh).await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(cold(dir.path(), "d/e/kept").as_deref(), Some(&b"rewritten"[..]));
    assert_eq!(cold(dir.path(), "d/e/moved"), None);
}
