//! eStargz layers mounted through cachefs, lazily, from the real registry: what the kernel shows
//! of each mounted layer equals the layer's own tar, as containerd's overlay unpack would leave
//! it (whiteouts as 0/0 devices, hard links as one inode), and a chunk whose bytes do not match
//! its digest is an I/O error, never wrong bytes. Needs root, /dev/fuse and the registry that
//! `.ci/run` starts.

mod common;

use common::{client, plain_entries, registry_host};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::sync::Arc;
use strata_snapshotter::estargz::{self, MAX_FOOTER_SIZE, Toc};
use strata_snapshotter::layer::{Blob, LayerNamespace};
use strata_snapshotter::registry::{ImageRef, ManifestLayer, Registry};
use strata_snapshotter::remote::{RemoteOptions, mount_layer, open_layer};
use strata_tiering::{CacheConfig, Policy, TierConfig, TieredCache};

const TOC_DIGEST: &str = "containerd.io/snapshot/stargz/toc.digest";

fn cache(dir: &Path) -> TieredCache {
    TieredCache::open(CacheConfig {
        hot: TierConfig::new(dir.join("hot"), 1 << 30),
        warm: None,
        state_dir: dir.join("state"),
        policy: Policy::default(),
    })
    .unwrap()
}

fn xattrs(path: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    xattr::list(path)
        .unwrap()
        .map(|n| {
            let name = n.to_string_lossy().into_owned();
            let value = xattr::get(path, &n).unwrap().unwrap_or_default();
            (name, value)
        })
        .collect()
}

/// Checks the mounted layer at `mnt` against the plain tar of the same blob; returns the kinds
/// of entry it compared.
fn compare(tag: &str, mnt: &Path, blob: &[u8]) -> std::collections::BTreeSet<String> {
    let mut kinds = std::collections::BTreeSet::new();
    let plain = plain_entries(blob);
    let mut inode_of = std::collections::HashMap::new();
    for (path, p) in &plain {
        let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
        if name == ".wh..wh..opq" {
            assert_eq!(xattr::get(mnt.join(dir), "trusted.overlay.opaque").unwrap().as_deref(), Some(&b"y"[..]));
            continue;
        }
        if let Some(hidden) = name.strip_prefix(".wh.") {
            let m = std::fs::symlink_metadata(mnt.join(dir).join(hidden)).unwrap();
            assert!(m.file_type().is_char_device() && m.rdev() == 0, "{tag}: {path} is a 0/0 whiteout device");
            kinds.insert("whiteout".to_string());
            continue;
        }
        let at = mnt.join(path);
        let m = std::fs::symlink_metadata(&at).unwrap_or_else(|e| panic!("{tag}: {path}: {e}"));
        let kind = if m.file_type().is_dir() {
            "dir"
        } else if m.file_type().is_symlink() {
            "symlink"
        } else if m.file_type().is_char_device() {
            "char"
        } else if m.file_type().is_block_device() {
            "block"
        } else if m.file_type().is_fifo() {
            "fifo"
        } else if p.kind == "hardlink" {
            "hardlink"
        } else {
            "reg"
        };
        assert_eq!(kind, p.kind, "{tag}: {path}");
        kinds.insert(kind.to_string());
        if !p.xattrs.is_empty() {
            kinds.insert("xattr".to_string());
        }
        let src_meta = if p.kind == "hardlink" { &plain[&p.link] } else { p };
        assert_eq!(m.mode() & 0o7777, src_meta.mode, "{tag}: {path}: mode");
        assert_eq!((m.uid() as u64, m.gid() as u64), (src_meta.uid, src_meta.gid), "{tag}: {path}: owner");
        assert_eq!(m.mtime() as u64, src_meta.mtime, "{tag}: {path}: mtime");
        match p.kind.as_str() {
            "reg" => {
                assert_eq!(std::fs::read(&at).unwrap(), p.content, "{tag}: {path}: content");
                inode_of.insert(path.clone(), m.ino());
            }
            "hardlink" => {
                assert_eq!(std::fs::read(&at).unwrap(), src_meta.content, "{tag}: {path}: content");
                assert!(m.nlink() >= 2, "{tag}: {path}: nlink {}", m.nlink());
                let target = std::fs::symlink_metadata(mnt.join(&p.link)).unwrap();
                assert_eq!(m.ino(), target.ino(), "{tag}: {path} and {} are one inode", p.link);
            }
            "symlink" => assert_eq!(std::fs::read_link(&at).unwrap().to_string_lossy(), p.link, "{tag}: {path}"),
            "char" | "block" => {
                assert_eq!(m.rdev(), (libc::makedev(1, 3)) as u64, "{tag}: {path}: the test image's device is 1,3")
            }
            _ => {}
        }
        let mut shown = xattrs(&at);
        shown.remove("trusted.overlay.opaque");
        assert_eq!(shown, p.xattrs, "{tag}: {path}: xattrs");
    }
    kinds
}

async fn layers(reg: &Registry, reference: &str) -> (ImageRef, Vec<ManifestLayer>) {
    let image = ImageRef::parse(&format!("{}/strata/{reference}", registry_host())).unwrap();
    let m = reg.manifest(&image).await.unwrap();
    (image, m.layers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root, /dev/fuse and the test registry: run by .ci/run"]
async fn mounted_layers_show_what_their_tar_holds() {
    // What the fetches did is shown if the test fails: a fetch past the blob's size says which.
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("strata_snapshotter=debug").try_init();
    let dir = tempfile::tempdir().unwrap();
    let cache = cache(dir.path());
    let reg = Arc::new(client());
    let mut kinds = std::collections::BTreeSet::new();
    for reference in ["specials:esgz", "busybox:esgz-64k"] {
        let (image, layers) = layers(&reg, reference).await;
        for (n, layer) in layers.iter().enumerate() {
            let ns = open_layer(
                reg.clone(),
                &image,
                &layer.digest,
                &layer.annotations[TOC_DIGEST],
                &RemoteOptions::default(),
            )
            .await
            .unwrap();
            let blob = ns.blob().clone();
            let mnt = dir.path().join(format!("{}-{n}", reference.replace(':', "-")));
            std::fs::create_dir(&mnt).unwrap();
            let mounted = mount_layer(ns, cache.clone(), &mnt, &RemoteOptions::default()).await.unwrap();
            assert!(
                std::fs::read_to_string("/proc/mounts").unwrap().contains(&format!("strata:{image}@{}", layer.digest))
            );
            let whole = reg.blob_range(&image, &layer.digest, 0..layer.size).await.unwrap();
            let m = mnt.clone();
            kinds.extend(tokio::task::spawn_blocking(move || compare(reference, &m, &whole)).await.unwrap());
            let fetched = blob.fetched.load(std::sync::atomic::Ordering::Relaxed);
            assert!(fetched <= layer.size, "{reference}: fetched {fetched} of {}", layer.size);
            tokio::task::spawn_blocking(move || mounted.unmount()).await.unwrap().unwrap();
        }
    }
    let expected = ["char", "dir", "fifo", "hardlink", "reg", "symlink", "whiteout", "xattr"];
    assert_eq!(kinds, expected.iter().map(|k| k.to_string()).collect(), "every kind of entry was compared");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root, /dev/fuse and the test registry: run by .ci/run"]
async fn a_chunk_that_does_not_match_its_digest_is_an_io_error_not_wrong_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let reg = Arc::new(client());
    let (image, layers) = layers(&reg, "busybox:esgz-64k").await;
    let layer = &layers[0];
    // The TOC as the registry has it, then one chunk's digest changed: the registry now
    // serves bytes that differ from what the (trusted) TOC says.
    let size = layer.size;
    let tail = reg.blob_range(&image, &layer.digest, size - MAX_FOOTER_SIZE..size).await.unwrap();
    let footer = estargz::parse_footer(&tail, size).unwrap();
    let member = reg.blob_range(&image, &layer.digest, footer.toc_offset..footer.toc_end).await.unwrap();
    let mut toc: Toc =
        estargz::decode_toc(&member, footer.compression, footer.data_end, &layer.annotations[TOC_DIGEST], 64 << 20)
            .unwrap();
    let busybox = toc.entries.iter_mut().find(|e| e.path == "bin/busybox").unwrap();
    let good: Vec<u8> = std::fs::read("/bin/busybox").unwrap();
    busybox.chunks[3].digest = estargz::sha256_digest(b"not these bytes");
    let blob = Arc::new(Blob::new(reg.clone(), image, layer.digest.clone(), layer.size));
    let ns = LayerNamespace::new(&toc, blob).unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = mount_layer(ns, cache(dir.path()), &mnt, &RemoteOptions::default()).await.unwrap();
    let path = mnt.join("bin/busybox");
    let result = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(&path).unwrap();
        let mut first = vec![0u8; 65536];
        f.read_exact(&mut first).unwrap();
        f.seek(SeekFrom::Start(3 * 65536)).unwrap();
        let mut bad = vec![0u8; 4096];
        (first, f.read(&mut bad).map_err(|e| e.raw_os_error()))
    })
    .await
    .unwrap();
    assert_eq!(result.0, good[..65536], "the chunks that match are served");
    assert_eq!(result.1, Err(Some(libc::EIO)), "the chunk that does not match is EIO");
    tokio::task::spawn_blocking(move || mounted.unmount()).await.unwrap().unwrap();
}

/// The kernel's first read of a program it starts: its ELF header, 4 KiB.
async fn start_reading(program: std::path::PathBuf) -> Vec<u8> {
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut head = vec![0u8; 4096];
        std::fs::File::open(program).unwrap().read_exact(&mut head).unwrap();
        head
    })
    .await
    .unwrap()
}

/// The layer's fetched bytes once they have not changed for half a second.
async fn quiet(blob: &strata_snapshotter::layer::Blob) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut seen = blob.fetched.load(std::sync::atomic::Ordering::Relaxed);
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let now = blob.fetched.load(std::sync::atomic::Ordering::Relaxed);
        if now == seen {
            return now;
        }
        assert!(std::time::Instant::now() < deadline, "the layer kept fetching: {now} bytes");
        seen = now;
    }
}

/// Waits (at most 20 s) until every chunk of `keys` is cached; `what` names them if not.
async fn wait_cached(cache: &TieredCache, keys: &[strata_tiering::ChunkKey], what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while keys.iter().any(|k| cache.location(k).is_none()) {
        assert!(std::time::Instant::now() < deadline, "{what} were not fetched ahead");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root, /dev/fuse and the test registry: run by .ci/run"]
async fn a_program_read_from_a_layer_has_its_loader_and_libraries_fetched_before_they_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache(dir.path());
    let reg = Arc::new(client());
    // The plain conversion: no prefetch region, so nothing is fetched until it is read.
    let (image, layers) = layers(&reg, "python:esgz").await;
    let layer = &layers[0];
    let opts = RemoteOptions::default();
    let ns = open_layer(reg.clone(), &image, &layer.digest, &layer.annotations[TOC_DIGEST], &opts).await.unwrap();
    let blob = ns.blob().clone();
    let key = |path: &str| {
        let chunks = ns.file_chunks(path).unwrap_or_else(|| panic!("{path} is a regular file of the layer"));
        strata_tiering::ChunkKey::digest(path, chunks[0].digest.clone())
    };
    // python3.11 links libm and libc (among others), and its interpreter reads its cache.
    let lib = "usr/lib/x86_64-linux-gnu";
    let linked = [
        format!("{lib}/ld-linux-x86-64.so.2"),
        "etc/ld.so.cache".to_owned(),
        format!("{lib}/libm.so.6"),
        format!("{lib}/libc.so.6"),
    ];
    // What its start reads next: files glibc names in its own bytes, and python's own.
    let named = [format!("{lib}/gconv/gconv-modules.cache"), "etc/nsswitch.conf".to_owned()];
    let own = [
        "usr/lib/python3.11/encodings/__pycache__/__init__.cpython-311.pyc".to_owned(),
        "usr/lib/python3.11/encodings/__pycache__/utf_8.cpython-311.pyc".to_owned(),
        "usr/lib/locale/C.utf8/LC_CTYPE".to_owned(),
    ];
    // On Debian, but not linked by python3.11.
    let unrelated = key(&format!("{lib}/libselinux.so.1"));
    let keys: Vec<_> = linked.iter().map(|p| key(p)).collect();
    let start_up: Vec<_> = named.iter().chain(&own).map(|p| key(p)).collect();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = mount_layer(ns.clone(), cache.clone(), &mnt, &opts).await.unwrap();
    assert!(keys.iter().all(|k| cache.location(k).is_none()), "nothing is fetched before a read");

    let head = start_reading(mnt.join("usr/bin/python3.11")).await;
    assert_eq!(&head[..4], b"\x7fELF");
    wait_cached(&cache, &keys, &format!("all of {linked:?}")).await;
    wait_cached(&cache, &start_up, &format!("all of {named:?} and {own:?}")).await;
    assert!(blob.rejects.loader_files.get() >= (linked.len() + start_up.len()) as u64, "each is counted");
    assert!(cache.location(&unrelated).is_none(), "a library the program does not link is left alone");

    // The loader's reads then fetch nothing: the bytes are local, and they are the right ones.
    // (Once the fetching ahead is over: a few more small files libc names are still arriving.)
    let fetched = quiet(&blob).await;
    let libc = mnt.join(format!("{lib}/libc.so.6"));
    let read = tokio::task::spawn_blocking(move || std::fs::read(libc).unwrap()).await.unwrap();
    let whole = reg.blob_range(&image, &layer.digest, 0..layer.size).await.unwrap();
    let plain = plain_entries(&whole);
    assert_eq!(read, plain[&format!("{lib}/libc.so.6")].content, "libc as the layer's tar holds it");
    assert_eq!(blob.fetched.load(std::sync::atomic::Ordering::Relaxed), fetched, "libc was read from the cache");
    tokio::task::spawn_blocking(move || mounted.unmount()).await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root, /dev/fuse and the test registry: run by .ci/run"]
async fn a_program_in_an_upper_layer_has_its_libraries_fetched_from_the_layer_under_it() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache(dir.path());
    let reg = Arc::new(client());
    // python:1 with /usr/local/bin/app (python3.11 by another name) in a second layer.
    let (image, layers) = layers(&reg, "python:app-esgz").await;
    assert_eq!(layers.len(), 2);
    // One node: both layers opened with the same options, as the daemon opens an image's.
    let opts = RemoteOptions::default();
    let mut opened = Vec::new();
    for layer in &layers {
        let toc = &layer.annotations[TOC_DIGEST];
        opened.push(open_layer(reg.clone(), &image, &layer.digest, toc, &opts).await.unwrap());
    }
    let (base, app) = (&opened[0], &opened[1]);
    // What the daemon says of a layer it mounts: the layers under it in its snapshot chain.
    app.blob().set_lower(vec![layers[0].digest.clone()]);
    assert!(
        app.file_chunks("usr/local/bin/app").is_some()
            && app.file_chunks("usr/lib/x86_64-linux-gnu/libc.so.6").is_none()
    );
    let libc = "usr/lib/x86_64-linux-gnu/libc.so.6";
    let key = strata_tiering::ChunkKey::digest(libc, base.file_chunks(libc).unwrap()[0].digest.clone());
    let mnt = dir.path().join("app");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = mount_layer(app.clone(), cache.clone(), &mnt, &opts).await.unwrap();
    start_reading(mnt.join("usr/local/bin/app")).await;
    wait_cached(&cache, &[key], "libc, from the layer under the program,").await;
    assert!(base.blob().fetched.load(std::sync::atomic::Ordering::Relaxed) > 0, "from the base layer's blob");
    tokio::task::spawn_blocking(move || mounted.unmount()).await.unwrap().unwrap();
}
