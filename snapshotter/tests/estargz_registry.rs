//! eStargz layers written by stargz-snapshotter's own `ctr-remote`, read by Strata from the
//! real registry with ranged requests: every entry of the TOC, and every chunk's bytes, equal
//! what the same blob gives when read whole as an ordinary tar.gz. Needs the registry that
//! `.ci/run` starts and fills (tests/infra/registry.sh, images.sh).

mod common;

use common::{Plain, SeeingProxy, client, plain_entries, registry_host};
use strata_snapshotter::estargz::{self, EntryKind, FormatError, MAX_FOOTER_SIZE, Toc};
use strata_snapshotter::registry::{ImageRef, ManifestLayer, Registry, RegistryError};

const TOC_DIGEST: &str = "containerd.io/snapshot/stargz/toc.digest";

async fn read_toc(reg: &Registry, image: &ImageRef, layer: &ManifestLayer, digest: &str) -> Result<Toc, FormatError> {
    let size = reg.blob_size(image, &layer.digest).await.unwrap();
    assert_eq!(size, layer.size);
    let tail = reg.blob_range(image, &layer.digest, size - MAX_FOOTER_SIZE..size).await.unwrap();
    let footer = estargz::parse_footer(&tail, size)?;
    let member = reg.blob_range(image, &layer.digest, footer.toc_offset..footer.toc_end).await.unwrap();
    estargz::decode_toc(&member, footer.compression, footer.data_end, digest, 64 << 20)
}

#[tokio::test]
#[ignore = "needs the test registry with ctr-remote's eStargz images: run by .ci/run"]
async fn ctr_remote_layers_read_lazily_equal_their_plain_tar() {
    let reg = client();
    let mut kinds_seen = std::collections::BTreeSet::new();
    for (tag, layers) in [("busybox:esgz", 2), ("busybox:esgz-64k", 2), ("specials:esgz", 3)] {
        let image = ImageRef::parse(&format!("{}/strata/{tag}", registry_host())).unwrap();
        let manifest = reg.manifest(&image).await.unwrap();
        assert_eq!(manifest.layers.len(), layers, "{manifest:?}");
        let mut chunks_read = 0;
        for layer in &manifest.layers {
            let toc = read_toc(&reg, &image, layer, &layer.annotations[TOC_DIGEST]).await.unwrap();
            assert_eq!(toc.landmark, estargz::Landmark::NoPrefetch, "ctr-remote convert without a profile");
            let whole = reg.blob_range(&image, &layer.digest, 0..layer.size).await.unwrap();
            assert_eq!(estargz::sha256_digest(&whole), layer.digest);
            let mut plain = plain_entries(&whole);
            for entry in &toc.entries {
                if entry.implicit {
                    // A parent the tar leaves out; the reader makes it up, and says so.
                    assert!(!plain.contains_key(&entry.path), "{tag}: {} is in the tar", entry.path);
                    assert_eq!(entry.kind, EntryKind::Dir);
                    continue;
                }
                let p = plain
                    .remove(&entry.path)
                    .unwrap_or_else(|| panic!("{tag}: {} is in the TOC, not in the tar", entry.path));
                let (kind, link) = match &entry.kind {
                    EntryKind::Dir => ("dir", String::new()),
                    EntryKind::Reg => ("reg", String::new()),
                    EntryKind::Symlink(t) => ("symlink", t.clone()),
                    EntryKind::Hardlink(t) => ("hardlink", t.clone()),
                    EntryKind::Char { .. } => ("char", String::new()),
                    EntryKind::Block { .. } => ("block", String::new()),
                    EntryKind::Fifo => ("fifo", String::new()),
                };
                let mut content = Vec::new();
                for c in &entry.chunks {
                    let range = reg.blob_range(&image, &layer.digest, c.offset..c.compressed_end).await.unwrap();
                    content.extend(estargz::decode_chunk(&entry.path, c, &range).unwrap());
                    chunks_read += 1;
                }
                let ours = Plain {
                    kind: kind.into(),
                    mode: entry.mode,
                    uid: entry.uid.into(),
                    gid: entry.gid.into(),
                    mtime: entry.mtime as u64,
                    link,
                    content,
                    xattrs: entry.xattrs.clone(),
                };
                assert_eq!(ours, p, "{tag}: {}", entry.path);
                kinds_seen.insert(kind);
                if !entry.xattrs.is_empty() {
                    kinds_seen.insert("xattr");
                }
                if entry.mode & 0o4000 != 0 {
                    kinds_seen.insert("setuid");
                }
                if let Some(d) = &entry.digest {
                    assert_eq!(&estargz::sha256_digest(&ours.content), d);
                }
            }
            assert!(plain.is_empty(), "{tag}: in the tar but not in the TOC: {:?}", plain.keys().collect::<Vec<_>>());
        }
        let busybox_len = std::fs::metadata("/bin/busybox").unwrap().len();
        if tag == "busybox:esgz-64k" {
            assert!(chunks_read as u64 > busybox_len / 65536, "busybox spans many 64 KiB chunks ({chunks_read} read)");
        }
    }
    let all: std::collections::BTreeSet<&str> =
        ["dir", "reg", "symlink", "hardlink", "char", "fifo", "xattr", "setuid"].into_iter().collect();
    assert_eq!(kinds_seen, all, "the images cover every kind of entry");
}

#[tokio::test]
#[ignore = "needs the test registry with ctr-remote's eStargz images: run by .ci/run"]
async fn a_layer_whose_toc_does_not_match_its_annotation_is_refused() {
    let reg = client();
    let image = ImageRef::parse(&format!("{}/strata/busybox:esgz", registry_host())).unwrap();
    let manifest = reg.manifest(&image).await.unwrap();
    let (a, b) = (&manifest.layers[0], &manifest.layers[1]);
    // The other layer's TOC digest: a registry serving a different TOC looks like this.
    let e = read_toc(&reg, &image, a, &b.annotations[TOC_DIGEST]).await.unwrap_err();
    assert!(matches!(e, FormatError::TocDigest { .. }), "{e}");
    assert!(e.to_string().contains(&b.annotations[TOC_DIGEST]), "{e}");
}

#[tokio::test]
#[ignore = "needs the test registry: run by .ci/run"]
async fn registry_errors_name_what_failed() {
    let reg = client();
    let image = ImageRef::parse(&format!("{}/strata/busybox:no-such-tag", registry_host())).unwrap();
    let e = reg.manifest(&image).await.unwrap_err();
    assert!(matches!(e, RegistryError::Status { status: 404, .. }), "{e}");
    assert!(e.to_string().contains("/v2/strata/busybox/manifests/no-such-tag"), "{e}");
    let image = ImageRef::parse(&format!("{}/strata/busybox:esgz", registry_host())).unwrap();
    let layer = reg.manifest(&image).await.unwrap().layers[0].clone();
    let e = reg.blob_range(&image, &layer.digest, layer.size - 10..layer.size + 10).await.unwrap_err();
    assert!(e.to_string().contains("416") || e.to_string().contains("bytes"), "a range past the end: {e}");
    // Nobody listens on port 9 of loopback.
    let gone = ImageRef::parse("127.0.0.1:9/strata/busybox:esgz").unwrap();
    let e = reg.manifest(&gone).await.unwrap_err();
    assert!(e.to_string().contains("127.0.0.1:9"), "{e}");
}

#[tokio::test]
#[ignore = "needs the test registry with ctr-remote's eStargz images: run by .ci/run"]
async fn where_the_start_up_files_end_is_heard_from_the_first_read_of_a_layers_end() {
    use strata_snapshotter::remote::{RemoteOptions, check_toc, fetch_toc};
    let reg = client();
    // Through a proxy of this test's own, which counts what it asked for.
    let proxy = SeeingProxy::start();
    for (tag, expect_told) in [("python:esgz-opt", true), ("python:esgz", false)] {
        let image = ImageRef::parse(&format!("{}/strata/{tag}", proxy.addr)).unwrap();
        let layer = reg.manifest(&image).await.unwrap().layers[0].clone();
        let blob = format!("GET /v2/strata/python/blobs/{}", layer.digest);
        let before = proxy.count(&blob);
        let mut heard = Vec::new();
        let mut tell = |at| heard.push(at);
        let reads = strata_snapshotter::blob_reads::BlobReads::Registry(&reg);
        let member = fetch_toc(reads, &image, &layer.digest, 64 << 20, None, Some(&mut tell)).await.unwrap();
        assert_eq!(proxy.count(&blob) - before, 1, "{tag}: the footer and the TOC came in one read");
        let checked =
            check_toc(&image, &layer.digest, &member, &layer.annotations[TOC_DIGEST], &RemoteOptions::default())
                .await
                .unwrap();
        let toc = estargz::decode_toc(
            &member.bytes,
            member.footer.compression,
            member.footer.data_end,
            &layer.annotations[TOC_DIGEST],
            64 << 20,
        )
        .unwrap();
        match (expect_told, toc.landmark) {
            (true, estargz::Landmark::Prefetch { offset }) => {
                assert_eq!(heard, vec![offset], "{tag}: heard once, as the verified TOC says");
                assert_eq!(checked.landmark_hint, Some(offset));
            }
            (false, estargz::Landmark::NoPrefetch) => assert_eq!(heard, Vec::<u64>::new(), "{tag}"),
            (_, other) => panic!("{tag}: the test image's landmark is {other:?}"),
        }
    }
}
