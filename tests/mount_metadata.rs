//! Metadata through real FUSE mounts of the Ceph RGW that `.ci/run` starts: revalidation by
//! ETag after the TTL, the negative cache, and the namespace snapshot shared across mounts.

mod common;

use common::*;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, path::Path as ObjPath};
use std::io::{Read, Seek, SeekFrom};
use std::sync::Arc;
use std::time::Duration;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn put(store: &Arc<dyn ObjectStore>, key: &str, bytes: &[u8]) {
    let (store, key, bytes) = (store.clone(), key.to_string(), bytes.to_vec());
    rt().block_on(async move { store.put(&ObjPath::from(key), PutPayload::from(bytes)).await.unwrap() });
}

fn source(rgw: &Rgw, prefix: &str) -> String {
    format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'))
}

/// A mount of `prefix` that trusts metadata for `ttl` (and missing names for 1s), in 1 MiB
/// chunks, read through the daemon: what the revalidation tests watch.
fn revalidating(rgw: &Rgw, prefix: &str, ttl: &str) -> Mount {
    Mount::start(
        &source(rgw, prefix),
        &[
            "--endpoint",
            &rgw.endpoint,
            "--region",
            "us-east-1",
            "--chunk-size",
            "1MiB",
            "--metadata-ttl",
            ttl,
            "--negative-ttl",
            "1s",
            "--no-passthrough",
        ],
    )
}

#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_changed_objects_revalidate_by_etag_and_never_mix() {
    let rgw = Rgw::from_env();
    let store = rgw.store();
    let prefix = unique_prefix("revalidate");
    let (v1, v2) = (data(31, 3 << 20), data(32, 4 << 20));
    put(&store, &format!("{prefix}f.bin"), &v1);
    let m = revalidating(&rgw, &prefix, "2s");

    // A reader holds the file open at v1 while the object is replaced by v2.
    let mut f = std::fs::File::open(m.path("f.bin")).unwrap();
    let mut head = vec![0u8; 1 << 20];
    f.read_exact(&mut head).unwrap();
    assert_eq!(head, v1[..1 << 20]);
    put(&store, &format!("{prefix}f.bin"), &v2);
    // The rest through the same handle: v1's bytes (already cached) or EIO, never v2's.
    f.seek(SeekFrom::Start(2 << 20)).unwrap();
    let mut tail = vec![0u8; 1 << 20];
    match f.read_exact(&mut tail) {
        Ok(()) => assert_eq!(tail, v1[2 << 20..], "an open handle served bytes of another version"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(5), "expected EIO, got {e}"),
    }
    drop(f);

    // Once the TTL has passed, the name is revalidated by its ETag and a new open reads v2,
    // all of it, with its new size.
    std::thread::sleep(Duration::from_millis(2500));
    let got = std::fs::read(m.path("f.bin")).unwrap();
    assert_eq!(got.len(), v2.len());
    assert_eq!(sha(&got), sha(&v2));

    // A missing name is answered from the negative cache for its TTL, then asked for again.
    assert!(std::fs::metadata(m.path("late.bin")).is_err());
    put(&store, &format!("{prefix}late.bin"), b"arrived");
    assert!(
        std::fs::metadata(m.path("late.bin")).is_err(),
        "a missing name was asked for again within its negative TTL"
    );
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(std::fs::read(m.path("late.bin")).unwrap(), b"arrived");
    // Looked up by name alone, a directory is found without listing its parent.
    put(&store, &format!("{prefix}sub/deep/x.txt"), b"x");
    assert_eq!(std::fs::read(m.path("sub/deep/x.txt")).unwrap(), b"x");
    assert!(std::fs::metadata(m.path("sub")).unwrap().is_dir());
}

/// An object replaced by another of the same size. The kernel keeps an inode's cached pages
/// through a revalidation that leaves the size alone, so a new open must start without the old
/// version's pages, and read around the page cache while a handle of the old version still
/// reads through it; that handle reads on at its own version.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_same_size_replacement_is_never_read_from_the_old_pages() {
    let rgw = Rgw::from_env();
    let store = rgw.store();
    let prefix = unique_prefix("samesize");
    let (v1, v2) = (data(41, 3 << 20), data(42, 3 << 20));
    put(&store, &format!("{prefix}f.bin"), &v1);
    let m = revalidating(&rgw, &prefix, "1s");
    let path = m.path("f.bin");
    let mut old = std::fs::File::open(&path).unwrap();
    let mut head = vec![0u8; 1 << 20];
    old.read_exact(&mut head).unwrap();
    assert!(head == v1[..1 << 20]);
    // All of v1 in the page cache, through a second open of the same version.
    assert!(std::fs::read(&path).unwrap() == v1);

    put(&store, &format!("{prefix}f.bin"), &v2);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), v2.len() as u64);
    let got = std::fs::read(&path).unwrap();
    assert!(got == v2, "a new open read {} bytes of the old version from the page cache", diff(&got, &v2));

    old.seek(SeekFrom::Start(1 << 20)).unwrap();
    let mut mid = vec![0u8; 1 << 20];
    match old.read_exact(&mut mid) {
        Ok(()) => assert!(mid == v1[1 << 20..2 << 20], "the open handle read bytes of the new version"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(5), "expected EIO, got {e}"),
    }
    drop(old);
    let again = std::fs::read(&path).unwrap();
    assert!(again == v2, "an open after the old handle closed read {} bytes of the old version", diff(&again, &v2));
}

/// How many bytes of `got` differ from `want`.
fn diff(got: &[u8], want: &[u8]) -> usize {
    got.iter().zip(want).filter(|(a, b)| a != b).count() + got.len().abs_diff(want.len())
}

/// A file of one chunk is fetched with a plain GET, without a `Range` (cheaper for the store).
/// Replaced by another version of the same size under an open handle, it must still give the
/// old bytes or EIO, never the new ones: the GET carries the opened version's ETag as `If-Match`
/// either way, and the length alone would not tell the versions apart.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_one_chunk_file_replaced_under_an_open_handle_never_gives_the_new_bytes() {
    let rgw = Rgw::from_env();
    let store = rgw.store();
    let prefix = unique_prefix("onechunk");
    let (v1, v2) = (data(41, 100_000), data(42, 100_000));
    put(&store, &format!("{prefix}img.jpg"), &v1);
    put(&store, &format!("{prefix}other.jpg"), &v2);
    let m = Mount::start(
        &source(&rgw, &prefix),
        &["--endpoint", &rgw.endpoint, "--region", "us-east-1", "--metadata-ttl", "60s"],
    );
    // A file of one chunk reads whole, as a data loader reads an image.
    assert_eq!(sha(&std::fs::read(m.path("other.jpg")).unwrap()), sha(&v2));

    let mut f = std::fs::File::open(m.path("img.jpg")).unwrap();
    put(&store, &format!("{prefix}img.jpg"), &v2);
    let mut got = Vec::new();
    match f.read_to_end(&mut got) {
        Ok(_) => assert_eq!(sha(&got), sha(&v1), "an open handle served bytes of another version"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(5), "expected EIO, got {e}"),
    }
}

fn tree_of(root: &std::path::Path) -> Vec<String> {
    let mut out: Vec<String> =
        files_under(root).into_iter().map(|p| p.strip_prefix(root).unwrap().to_string_lossy().into_owned()).collect();
    out.sort();
    out
}

#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_namespace_snapshot_is_shared_across_mounts() {
    let rgw = Rgw::from_env();
    let store = rgw.store();
    let prefix = unique_prefix("snapshot");
    for (k, v) in [("a/x.bin", &b"ex"[..]), ("a/b/y.bin", b"why"), ("z.bin", b"zed")] {
        put(&store, &format!("{prefix}{k}"), v);
    }
    let shared = tempfile::tempdir().unwrap();
    let snapdir = shared.path().to_str().unwrap();
    let args = |max_age: &'static str| {
        vec![
            "--endpoint".to_string(),
            rgw.endpoint.clone(),
            "--region".into(),
            "us-east-1".into(),
            "--immutable".into(),
            "--snapshot".into(),
            "--snapshot-dir".into(),
            snapdir.to_string(),
            "--snapshot-max-age".into(),
            max_age.into(),
        ]
    };
    let start = |max_age| {
        let a = args(max_age);
        Mount::start(&source(&rgw, &prefix), &a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let want = ["a/b/y.bin", "a/x.bin", "z.bin"];

    let first = start("1h");
    assert_eq!(tree_of(&first.mnt), want);
    assert!(first.log().contains("namespace snapshot taken"), "{}", first.log());
    drop(first);

    // An object added after the snapshot: a second mount (another process, its own tiers)
    // starts from the stored snapshot, so it does not list the bucket and does not see it.
    put(&store, &format!("{prefix}a/late.bin"), b"late");
    let second = start("1h");
    assert_eq!(tree_of(&second.mnt), want, "the second mount listed the store instead of using the snapshot");
    assert!(!second.log().contains("namespace snapshot taken"));
    assert_eq!(std::fs::read(second.path("a/b/y.bin")).unwrap(), b"why");
    drop(second);

    // Past its max age the snapshot is taken again; a damaged one is replaced, not trusted.
    let third = start("0s");
    assert_eq!(tree_of(&third.mnt), ["a/b/y.bin", "a/late.bin", "a/x.bin", "z.bin"]);
    drop(third);
    for f in files_under(shared.path()).iter().filter(|p| p.extension().is_some_and(|e| e == "json")) {
        std::fs::write(f, b"{ damaged").unwrap();
    }
    let fourth = start("1h");
    assert_eq!(tree_of(&fourth.mnt), ["a/b/y.bin", "a/late.bin", "a/x.bin", "z.bin"]);
    assert!(fourth.log().contains("namespace snapshot unreadable"), "{}", fourth.log());
    drop(fourth);

    // Another prefix of the same bucket, with the same snapshot dir: a snapshot of its own,
    // never the first prefix's tree.
    let other = format!("{}other/", prefix);
    put(&store, &format!("{other}val.bin"), b"val");
    let a = args("1h");
    let fifth = Mount::start(&source(&rgw, &other), &a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(tree_of(&fifth.mnt), ["val.bin"], "a mount of another prefix was given this one's snapshot");
    assert!(fifth.log().contains("namespace snapshot taken"), "{}", fifth.log());
    assert_eq!(std::fs::read(fifth.path("val.bin")).unwrap(), b"val");
}

/// The blocks, available blocks and block size of the file system holding `path`, as `stat -f`
/// gives them.
fn statfs(path: &std::path::Path) -> (u64, u64, u64) {
    let out = std::process::Command::new("stat").args(["-f", "-c", "%b %a %S"]).arg(path).output().unwrap();
    assert!(out.status.success(), "stat -f {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    let v: Vec<u64> = String::from_utf8_lossy(&out.stdout).split_whitespace().map(|n| n.parse().unwrap()).collect();
    (v[0], v[1], v[2])
}

/// `df` on a writable mount shows the disk its writes are staged on, which is what a writer can
/// count on before its upload; a read-only mount shows no room. Tools that check the free space
/// before they write (Hugging Face `datasets` does, with `shutil.disk_usage`) decide by it.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_df_shows_the_staging_disks_room_for_writes() {
    let src = tempfile::tempdir().unwrap();
    let m = Mount::start(src.path().to_str().unwrap(), &[]);
    let staging = m._dir.path().join("state/staging");
    let (blocks, avail, bsize) = statfs(&m.mnt);
    let (s_blocks, s_avail, s_bsize) = statfs(&staging);
    assert_eq!((blocks, bsize), (s_blocks, s_bsize), "the staging disk's size");
    // Other tests write to the same disk meanwhile.
    assert!(avail > 0 && avail.abs_diff(s_avail) < s_blocks / 20, "room: {avail} against {s_avail}");
    let py = std::process::Command::new("python3")
        .args(["-c", "import shutil, sys; print(shutil.disk_usage(sys.argv[1]).free)"])
        .arg(&m.mnt)
        .output()
        .unwrap();
    let free: u64 = String::from_utf8_lossy(&py.stdout).trim().parse().unwrap();
    assert!(free > 0 && free.abs_diff(avail * bsize) < s_blocks * bsize / 20, "shutil.disk_usage: {free}");

    let ro = Mount::start(src.path().to_str().unwrap(), &["--read-only"]);
    assert_eq!(statfs(&ro.mnt).1, 0, "a read-only mount has no room for writes");
}
