//! `strata convert` against the real registry, umoci, skopeo, containerd and Debian's
//! `ctr-remote`: what Strata writes pulls lazily through Strata, pulls whole through
//! containerd (which checks every DiffID), has TOCs that stargz-snapshotter's reader accepts,
//! and unpacks to the same tree as the image it came from. Needs root: run by `.ci/run`.

mod common;

use common::containerd::{ranged_answers, registry, registry_log};
use common::node::Node;
use common::*;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Output};

fn convert(args: &[&str]) -> Output {
    let hosts = tempfile::tempdir().unwrap();
    Command::new(BIN).arg("convert").args(["--hosts-dir", hosts.path().to_str().unwrap()]).args(args).output().unwrap()
}

fn convert_ok(args: &[&str]) -> String {
    let out = convert(args);
    assert!(out.status.success(), "strata convert {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The manifest of `repo:tag` in the test registry.
fn manifest(repo_tag: &str) -> (serde_json::Value, Option<String>) {
    let (repo, tag) = repo_tag.split_once(':').unwrap();
    let out = Command::new("curl")
        .args(["-fsS", "-D-", "-H", "Accept: application/vnd.oci.image.manifest.v1+json"])
        .arg(format!("http://{}/v2/strata/{repo}/manifests/{tag}", registry()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{repo_tag}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let digest = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("docker-content-digest:").map(|d| d.trim().to_owned()));
    (serde_json::from_str(body).unwrap(), digest)
}

fn registry_has(repo_tag: &str) -> bool {
    let (repo, tag) = repo_tag.split_once(':').unwrap();
    let out = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-H",
            "Accept: application/vnd.oci.image.manifest.v1+json",
        ])
        .arg(format!("http://{}/v2/strata/{repo}/manifests/{tag}", registry()))
        .output()
        .unwrap();
    out.stdout == b"200"
}

fn blob(digest: &str, repo: &str) -> Vec<u8> {
    let out = Command::new("curl")
        .args(["-fsS"])
        .arg(format!("http://{}/v2/strata/{repo}/blobs/{digest}", registry()))
        .output()
        .unwrap();
    assert!(out.status.success());
    out.stdout
}

/// Where a gzip layer blob's TOC starts, as its footer says.
fn toc_offset_of(blob: &[u8]) -> u64 {
    let footer = &blob[blob.len() - 51..];
    u64::from_str_radix(std::str::from_utf8(&footer[16..32]).unwrap(), 16).unwrap()
}

/// Converts the test registry's `busybox:1` to `busybox:TAG` with the prefetch list `list`
/// (written into `work`).
fn convert_busybox_with_prefetch_list(work: &Path, list: &str, tag: &str) {
    let path = work.join("prefetch.txt");
    std::fs::write(&path, list).unwrap();
    let (src, dst) = (format!("{}/strata/busybox:1", registry()), format!("{}/strata/busybox:{tag}", registry()));
    convert_ok(&["--prefetch-list", path.to_str().unwrap(), &src, &dst]);
}

/// The offset the TOC of a gzip layer blob gives `.prefetch.landmark`.
fn landmark_of(blob: &[u8]) -> u64 {
    let toc = toc_of(blob);
    let entries = toc["entries"].as_array().unwrap();
    entries.iter().find(|e| e["name"] == ".prefetch.landmark").unwrap()["offset"].as_u64().unwrap()
}

/// A layer blob's TOC, found the way a reader finds it: by the footer.
fn toc_of(blob: &[u8]) -> serde_json::Value {
    let offset = toc_offset_of(blob) as usize;
    let mut tar = Vec::new();
    flate2::read::GzDecoder::new(&blob[offset..]).read_to_end(&mut tar).unwrap();
    let size =
        usize::from_str_radix(std::str::from_utf8(&tar[124..135]).unwrap().trim_matches(char::from(0)), 8).unwrap();
    serde_json::from_slice(&tar[512..512 + size]).unwrap()
}

/// Entry names of a layer blob's tar stream, in order, as GNU tar lists them.
fn tar_names(blob: &[u8], dir: &Path) -> Vec<String> {
    let path = dir.join("layer.tar.gz");
    std::fs::write(&path, blob).unwrap();
    run("tar", &["-tzf", path.to_str().unwrap()])
        .lines()
        .map(|l| l.trim_end_matches('/').trim_start_matches("./").to_owned())
        .collect()
}

#[test]
#[ignore = "needs root, containerd, ctr-remote and the test registry: run by .ci/run"]
fn converted_images_pull_lazily_pull_whole_and_ctr_remote_reads_their_tocs() {
    let src = format!("{}/strata/busybox:1", registry());
    let dst = format!("{}/strata/busybox:strata-esgz", registry());
    let said = convert_ok(&[&src, &dst]);
    assert!(said.contains("converted") && said.contains("2 layers"), "{said}");
    let (m, _) = manifest("busybox:strata-esgz");
    assert_eq!(m["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    let layers: Vec<(String, String)> = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            assert_eq!(l["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip");
            assert!(
                l["annotations"]["io.containers.estargz.uncompressed-size"].as_str().unwrap().parse::<u64>().is_ok()
            );
            (
                l["digest"].as_str().unwrap().to_owned(),
                l["annotations"]["containerd.io/snapshot/stargz/toc.digest"].as_str().unwrap().to_owned(),
            )
        })
        .collect();

    // Lazily, through Strata.
    let node = Node::start();
    let image = node.rpull("busybox:strata-esgz");
    for (digest, _) in &layers {
        let l = node.layer_when(digest, |l| l["image"] == image.as_str());
        assert_eq!(l["lazy"], true, "{l:#}");
    }
    assert_eq!(
        node.run_sh(&image, "converted-lazy", "cat /etc/motd; ls /bin | wc -l").lines().next(),
        Some("strata layer two")
    );

    // Whole, through containerd's own overlayfs snapshotter, which unpacks every layer and
    // checks its DiffID against the converted config.
    node.ctr(&["images", "pull", "--plain-http", &image]);
    let out = node.ctr(&["run", "--rm", &image, "converted-whole", "cat", "/etc/motd"]);
    assert_eq!(out, "strata layer two\n");

    // stargz-snapshotter's own reader (ctr-remote) finds each TOC by its footer and hashes it
    // to the digest the manifest carries.
    for (digest, toc_digest) in &layers {
        let out = node.containerd.ctr_remote(&["image", "get-toc-digest", digest]);
        assert!(out.status.success(), "get-toc-digest {digest}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), toc_digest, "layer {digest}");
    }
}

#[test]
#[ignore = "needs skopeo, umoci and the test registry: run by .ci/run"]
fn conversion_keeps_every_file_as_umoci_unpacks_it_and_gives_the_same_bytes_every_time() {
    let work = tempfile::tempdir().unwrap();
    let w = |p: &str| work.path().join(p).to_str().unwrap().to_owned();
    // specials: hard links, a device, a fifo, setuid, an xattr, another owner, a whiteout.
    let src = format!("docker://{}/strata/specials:1", registry());
    run("skopeo", &["copy", "-q", "--src-tls-verify=false", &src, &format!("oci:{}:1", w("src"))]);
    convert_ok(&[&format!("oci:{}:1", w("src")), &format!("oci:{}:esgz", w("dst"))]);
    run("umoci", &["unpack", "--image", &format!("{}:1", w("src")), &w("a")]);
    run("umoci", &["unpack", "--image", &format!("{}:esgz", w("dst")), &w("b")]);
    let (plain, plain_links) = common::tree::tree(&work.path().join("a/rootfs"));
    let (mut converted, converted_links) = common::tree::tree(&work.path().join("b/rootfs"));
    for meta in ["stargz.index.json", ".prefetch.landmark", ".no.prefetch.landmark"] {
        converted.remove(meta);
    }
    let diff = common::tree::differences(&plain, &converted, 20);
    assert!(
        diff.is_empty(),
        "umoci unpack of the original (first) and of the conversion (second) differ:\n{}",
        diff.join("\n")
    );
    assert_eq!(plain_links, converted_links);
    assert!(plain.len() > 100 && !plain_links.is_empty(), "{} entries", plain.len());
    assert!(plain.values().any(|e| e.kind == "char") && plain.values().any(|e| !e.xattrs.is_empty()));

    // The same input gives the same image on one CPU and with several layers at once.
    let one_cpu = Command::new("taskset")
        .args([
            "-c",
            "0",
            BIN,
            "convert",
            "--jobs",
            "1",
            &format!("oci:{}:1", w("src")),
            &format!("oci:{}:esgz", w("again")),
        ])
        .output()
        .unwrap();
    assert!(one_cpu.status.success(), "{}", String::from_utf8_lossy(&one_cpu.stderr));
    let index = |dir: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(work.path().join(dir).join("index.json")).unwrap()).unwrap()
    };
    assert_eq!(index("dst")["manifests"][0]["digest"], index("again")["manifests"][0]["digest"]);
}

#[test]
#[ignore = "needs root, containerd and the test registry: run by .ci/run"]
fn a_prefetch_list_puts_exactly_those_files_first_and_a_lazy_pull_fetches_them_in_one_request() {
    let work = tempfile::tempdir().unwrap();
    let list = "# read at start-up\n/bin/busybox\n/etc/motd\n/not/in/the/image\n";
    convert_busybox_with_prefetch_list(work.path(), list, "strata-prefetch");
    let (m, _) = manifest("busybox:strata-prefetch");
    let digests: Vec<String> =
        m["layers"].as_array().unwrap().iter().map(|l| l["digest"].as_str().unwrap().to_owned()).collect();
    let mut regions = Vec::new();
    for (digest, listed) in digests.iter().zip([["bin/busybox"], ["etc/motd"]]) {
        let blob = blob(digest, "busybox");
        let names = tar_names(&blob, work.path());
        let at = names.iter().position(|n| n == ".prefetch.landmark").unwrap_or_else(|| panic!("{names:?}"));
        // Before the landmark: the listed file and the directories above it, nothing else.
        let before = &names[..at];
        let files: Vec<&String> = before.iter().filter(|n| !listed[0].starts_with(&format!("{n}/"))).collect();
        assert_eq!(files, [&listed[0].to_owned()], "{before:?}");
        assert!(!names.contains(&".no.prefetch.landmark".to_owned()));
        let landmark = landmark_of(&blob);
        // The region is asked for while the TOC is parsed, from the blob's first byte to the
        // landmark.
        regions.push(landmark);
    }

    let node = Node::start();
    let mark = registry_log().len();
    let image = node.rpull("busybox:strata-prefetch");
    for d in &digests {
        let l = node.layer_when(d, |l| l["prefetch"] == "done");
        assert_eq!(l["lazy"], true, "{l:#}");
    }
    // Each layer's prefetch region came in one ranged GET of exactly that size.
    let log = registry_log()[mark..].to_owned();
    for (d, size) in digests.iter().zip(&regions) {
        let whole = log.lines().filter(|l| l.contains(d.as_str()) && l.contains(&format!("\" 206 {size} "))).count();
        assert_eq!(whole, 1, "one GET of {size} bytes of {d}:\n{log}");
    }
    assert_eq!(node.run_sh(&image, "prefetched", "cat /etc/motd"), "strata layer two\n");
}

const TOC_OFFSET: &str = "containerd.io/snapshot/strata/toc.offset";
const PREFETCH_END: &str = "containerd.io/snapshot/strata/prefetch.end";

#[test]
#[ignore = "needs root, containerd, ctr-remote and the test registry: run by .ci/run"]
fn strata_images_tell_a_lazy_pull_where_the_toc_and_the_start_up_files_are() {
    let work = tempfile::tempdir().unwrap();
    convert_busybox_with_prefetch_list(work.path(), "/bin/busybox\n/etc/motd\n", "strata-hints");
    let (m, _) = manifest("busybox:strata-hints");
    // Each layer's descriptor says where its TOC starts and where its landmark is.
    let mut layers = Vec::new();
    for l in m["layers"].as_array().unwrap() {
        let digest = l["digest"].as_str().unwrap().to_owned();
        let blob = blob(&digest, "busybox");
        let toc_offset = toc_offset_of(&blob);
        let landmark = landmark_of(&blob);
        assert_eq!(l["annotations"][TOC_OFFSET], toc_offset.to_string(), "{l:#}");
        assert_eq!(l["annotations"][PREFETCH_END], landmark.to_string(), "{l:#}");
        layers.push((digest, blob.len() as u64 - toc_offset, landmark));
    }

    // A lazy pull reads the first layer's TOC and footer in one request, without the suffix
    // read that finds the footer first (the TOCs of the layers after it are read ahead while
    // it is prepared, before their own labels are known), and each layer's start-up files in
    // one more.
    let node = Node::start();
    let mark = registry_log().len();
    let image = node.rpull("busybox:strata-hints");
    for (d, ..) in &layers {
        assert_eq!(node.layer_when(d, |l| l["prefetch"] == "done")["lazy"], true);
    }
    let (first, toc_and_footer, _) = &layers[0];
    let answers = ranged_answers(mark, first);
    assert!(answers.contains(toc_and_footer), "the TOC and footer in one answer of {toc_and_footer}: {answers:?}");
    assert!(!answers.contains(&65536), "no suffix read: {answers:?}");
    for (d, _, landmark) in &layers {
        let answers = ranged_answers(mark, d);
        assert!(answers.contains(landmark), "the prefetch region in one answer of {landmark}: {answers:?}");
    }
    assert_eq!(node.run_sh(&image, "hinted", "cat /etc/motd"), "strata layer two\n");

    // Hints that do not hold cost a request, never the pull: the same layers, with descriptors
    // whose TOC offset lands inside the footer and whose landmark is off by a kilobyte.
    let (mut m, _) = manifest("busybox:strata-hints");
    for (l, (_, toc_and_footer, landmark)) in m["layers"].as_array_mut().unwrap().iter_mut().zip(&layers) {
        let size = l["size"].as_u64().unwrap();
        assert!(*toc_and_footer > 100);
        l["annotations"][TOC_OFFSET] = (size - 20).to_string().into();
        l["annotations"][PREFETCH_END] = (landmark + 1024).to_string().into();
    }
    let path = work.path().join("bad-hints.json");
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    let url = format!("http://{}/v2/strata/busybox/manifests/strata-bad-hints", registry());
    let body = format!("@{}", path.display());
    let content_type = "Content-Type: application/vnd.oci.image.manifest.v1+json";
    run("curl", &["-fsS", "-X", "PUT", "-H", content_type, "--data-binary", &body, &url]);
    let node = Node::start();
    let mark = registry_log().len();
    let image = node.rpull("busybox:strata-bad-hints");
    for (d, _, landmark) in &layers {
        let l = node.layer_when(d, |l| l["prefetch"] == "done");
        assert_eq!(l["lazy"], true, "{l:#}");
        assert_eq!(l["prefetch_bytes"], *landmark, "the TOC's landmark, not the descriptor's: {l:#}");
        let answers = ranged_answers(mark, d);
        assert!(answers.contains(landmark), "the TOC's prefetch region in one answer of {landmark}: {answers:?}");
    }
    assert_eq!(node.run_sh(&image, "misled", "cat /etc/motd"), "strata layer two\n");
}

#[test]
#[ignore = "needs the test registry: run by .ci/run"]
fn an_image_already_in_estargz_is_copied_or_refused_as_asked() {
    let src = format!("{}/strata/busybox:esgz", registry());
    let out = convert(&["--if-converted", "error", &src, &format!("{}/strata/busybox:not-written", registry())]);
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("is already eStargz"), "{e}");
    assert!(!registry_has("busybox:not-written"));
    let said = convert_ok(&[&src, &format!("{}/strata/busybox:copied", registry())]);
    assert!(said.contains("copied"), "{said}");
    assert_eq!(manifest("busybox:esgz").1, manifest("busybox:copied").1, "the same manifest, byte for byte");
    // Converted again: ctr-remote's TOCs and landmarks replaced by Strata's, the files the same.
    let said =
        convert_ok(&["--if-converted", "reconvert", &src, &format!("{}/strata/busybox:reconverted", registry())]);
    assert!(said.contains("2 layers converted"), "{said}");
    let (again, _) = manifest("busybox:reconverted");
    let (theirs, _) = manifest("busybox:esgz");
    for (a, t) in again["layers"].as_array().unwrap().iter().zip(theirs["layers"].as_array().unwrap()) {
        assert_ne!(a["digest"], t["digest"]);
        let toc = toc_of(&blob(a["digest"].as_str().unwrap(), "busybox"));
        let names = |toc: &serde_json::Value| -> Vec<String> {
            let mut n: Vec<String> = toc["entries"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["type"] != "chunk" && !e["name"].as_str().unwrap().ends_with("landmark"))
                // The root is "./" or "" by writer; the same entry.
                .map(|e| match e["name"].as_str().unwrap().trim_start_matches("./").trim_end_matches('/') {
                    "." => String::new(),
                    n => n.to_owned(),
                })
                .collect();
            n.sort();
            n
        };
        assert_eq!(names(&toc), names(&toc_of(&blob(t["digest"].as_str().unwrap(), "busybox"))));
        assert_eq!(toc["entries"].as_array().unwrap().iter().filter(|e| e["name"] == "stargz.index.json").count(), 0);
    }
}

/// Puts `bytes` in the layout at `dir`; returns the digest.
fn put_blob(dir: &Path, bytes: &[u8]) -> String {
    let d = format!("sha256:{}", sha(bytes));
    let p = dir.join("blobs/sha256").join(d.strip_prefix("sha256:").unwrap());
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, bytes).unwrap();
    d
}

/// A manifest in the layout at `dir` of one image for `arch` with one layer: `tar`, gzipped,
/// with a config that names its DiffID. Returns its descriptor.
fn manifest_with_layer(dir: &Path, tar: &[u8], arch: &str) -> serde_json::Value {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, tar).unwrap();
    let layer = gz.finish().unwrap();
    let config = serde_json::json!({"architecture": arch, "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", sha(tar))]}});
    let config = serde_json::to_vec(&config).unwrap();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put_blob(dir, &config), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": put_blob(dir, &layer), "size": layer.len()}],
    });
    let manifest = serde_json::to_vec(&manifest).unwrap();
    serde_json::json!({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put_blob(dir, &manifest),
        "size": manifest.len(), "platform": {"architecture": arch, "os": "linux"}})
}

/// Tags `descriptor` as `1` in the layout at `dir`; returns the layout reference.
fn tag_layout(dir: &Path, mut descriptor: serde_json::Value) -> String {
    descriptor["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": "1"});
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [descriptor]});
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    format!("oci:{}:1", dir.display())
}

/// An OCI layout of one image with one layer, `tar`. Returns the layout reference.
fn layout_with_layer(dir: &Path, tar: &[u8]) -> String {
    let d = manifest_with_layer(dir, tar, "amd64");
    tag_layout(dir, d)
}

#[test]
fn a_multi_platform_index_keeps_every_platform_converted_and_drops_attestations() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    let amd64 = manifest_with_layer(&src, &tar_named("amd64-file"), "amd64");
    let arm64 = manifest_with_layer(&src, &tar_named("arm64-file"), "arm64");
    let mut attestation = manifest_with_layer(&src, &tar_named("sbom"), "unknown");
    attestation["platform"]["os"] = "unknown".into();
    attestation["annotations"] = serde_json::json!({"vnd.docker.reference.type": "attestation-manifest",
        "vnd.docker.reference.digest": amd64["digest"].clone()});
    let index = serde_json::to_vec(&serde_json::json!({"schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [amd64, arm64, attestation]}))
    .unwrap();
    let top = serde_json::json!({"mediaType": "application/vnd.oci.image.index.v1+json",
        "digest": put_blob(&src, &index), "size": index.len()});
    let src_ref = tag_layout(&src, top);
    let dst = work.path().join("dst");
    let said = convert_ok(&[&src_ref, &format!("oci:{}:esgz", dst.display())]);
    assert!(said.contains("2 layers converted"), "{said}");
    let read = |d: &serde_json::Value| -> serde_json::Value {
        let hex = d["digest"].as_str().unwrap().strip_prefix("sha256:").unwrap().to_owned();
        serde_json::from_slice(&std::fs::read(dst.join("blobs/sha256").join(hex)).unwrap()).unwrap()
    };
    let tags: serde_json::Value = serde_json::from_slice(&std::fs::read(dst.join("index.json")).unwrap()).unwrap();
    let top = &tags["manifests"][0];
    assert_eq!(top["mediaType"], "application/vnd.oci.image.index.v1+json");
    let index = read(top);
    let platforms: Vec<&str> = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["platform"]["architecture"].as_str().unwrap())
        .collect();
    assert_eq!(platforms, ["amd64", "arm64"], "both platforms, in order, and no attestation");
    for m in index["manifests"].as_array().unwrap() {
        let manifest = read(m);
        let layer = &manifest["layers"][0];
        assert!(layer["annotations"]["containerd.io/snapshot/stargz/toc.digest"].is_string(), "{manifest:#}");
        let config = read(&manifest["config"]);
        assert_eq!(config["architecture"], m["platform"]["architecture"]);
        // The config's DiffID is the converted layer's.
        let blob = std::fs::read(
            dst.join("blobs/sha256").join(layer["digest"].as_str().unwrap().strip_prefix("sha256:").unwrap()),
        )
        .unwrap();
        let mut raw = Vec::new();
        flate2::read::MultiGzDecoder::new(&blob[..]).read_to_end(&mut raw).unwrap();
        assert_eq!(config["rootfs"]["diff_ids"][0], format!("sha256:{}", sha(&raw)));
    }
}

/// A tar of one regular file named `name`, which may be anything, as a hostile tool writes it.
fn tar_named(name: &str) -> Vec<u8> {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name.as_bytes());
    h[100..107].copy_from_slice(b"0000644");
    h[108..115].copy_from_slice(b"0000000");
    h[116..123].copy_from_slice(b"0000000");
    h[124..135].copy_from_slice(b"00000000004");
    h[136..147].copy_from_slice(b"00000000000");
    h[156] = b'0';
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|b| u32::from(*b)).sum();
    h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
    let mut t = h.to_vec();
    let mut data = [0u8; 512];
    data[..4].copy_from_slice(b"evil");
    t.extend_from_slice(&data);
    t.extend_from_slice(&[0u8; 1024]);
    t
}

#[test]
#[ignore = "needs the test registry: run by .ci/run"]
fn names_that_leave_the_layer_and_damaged_layers_are_refused_and_nothing_is_written() {
    for (case, name) in [("dotdot", "../../etc/evil"), ("absolute", "/etc/evil")] {
        let work = tempfile::tempdir().unwrap();
        let src = layout_with_layer(&work.path().join("src"), &tar_named(name));
        let dst_layout = work.path().join("dst");
        let repo_tag = format!("bad:{case}");
        for dst in [format!("oci:{}:esgz", dst_layout.display()), format!("{}/strata/{repo_tag}", registry())] {
            let out = convert(&[&src, &dst]);
            assert!(!out.status.success(), "{case}: converted");
            let e = String::from_utf8_lossy(&out.stderr);
            assert!(e.contains(name) && (e.contains("absolute") || e.contains("climbs out")), "{case}: {e}");
        }
        assert!(!dst_layout.join("index.json").exists(), "{case}: no image in the layout");
        assert!(!registry_has(&repo_tag), "{case}: no image in the registry");
    }

    // A layer cut short, so that its bytes no longer hash to its digest.
    let work = tempfile::tempdir().unwrap();
    let src = layout_with_layer(&work.path().join("src"), &tar_named("fine"));
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(work.path().join("src/index.json")).unwrap()).unwrap();
    let blobs = work.path().join("src/blobs/sha256");
    let read_blob = |d: &str| std::fs::read(blobs.join(d.strip_prefix("sha256:").unwrap())).unwrap();
    let manifest: serde_json::Value =
        serde_json::from_slice(&read_blob(index["manifests"][0]["digest"].as_str().unwrap())).unwrap();
    let layer = manifest["layers"][0]["digest"].as_str().unwrap();
    let bytes = read_blob(layer);
    std::fs::write(blobs.join(layer.strip_prefix("sha256:").unwrap()), &bytes[..bytes.len() - 12]).unwrap();
    let out = convert(&[&src, &format!("oci:{}:esgz", work.path().join("dst").display())]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains(layer) && e.contains("damaged"), "{e}");
    assert!(!work.path().join("dst/index.json").exists());
}

#[test]
#[ignore = "needs root, containerd, ctr-remote and the test registry: run by .ci/run"]
fn zstd_chunked_images_from_strata_and_from_ctr_remote_pull_lazily() {
    let src = format!("{}/strata/busybox:1", registry());
    convert_ok(&["--format", "zstd-chunked", &src, &format!("{}/strata/busybox:strata-zstd", registry())]);
    let (m, _) = manifest("busybox:strata-zstd");
    let mut layers = Vec::new();
    for l in m["layers"].as_array().unwrap() {
        assert_eq!(l["mediaType"], "application/vnd.oci.image.layer.v1.tar+zstd");
        let a = &l["annotations"];
        let position: Vec<u64> = a["io.containers.zstd-chunked.manifest-position"]
            .as_str()
            .unwrap()
            .split(':')
            .map(|p| p.parse().unwrap())
            .collect();
        assert_eq!((position.len(), position[3]), (4, 1), "offset:length:raw length:1");
        let digest = l["digest"].as_str().unwrap().to_owned();
        // The position and checksum name the compressed TOC in the blob.
        let blob = blob(&digest, "busybox");
        let toc = &blob[position[0] as usize..(position[0] + position[1]) as usize];
        assert_eq!(a["io.containers.zstd-chunked.manifest-checksum"].as_str().unwrap(), format!("sha256:{}", sha(toc)));
        layers.push((digest, a["containerd.io/snapshot/stargz/toc.digest"].as_str().unwrap().to_owned()));
    }

    let node = Node::start();
    for reference in ["busybox:strata-zstd", "busybox:zstdchunked"] {
        let image = node.rpull(reference);
        for d in node.layer_digests(reference) {
            let l = node.layer_when(&d, |l| l["image"] == image.as_str());
            assert_eq!(l["lazy"], true, "{reference}: {l:#}");
        }
        let name = format!("zstd-{}", reference.replace(':', "-"));
        assert_eq!(node.run_sh(&image, &name, "cat /etc/motd"), "strata layer two\n", "{reference}");
    }
    // Whole through containerd (DiffIDs checked), and each TOC read by ctr-remote.
    let image = format!("{}/strata/busybox:strata-zstd", registry());
    node.ctr(&["images", "pull", "--plain-http", &image]);
    assert_eq!(node.ctr(&["run", "--rm", &image, "zstd-whole", "cat", "/etc/motd"]), "strata layer two\n");
    for (digest, toc_digest) in &layers {
        let out = node.containerd.ctr_remote(&["image", "get-toc-digest", "--zstdchunked", digest]);
        assert!(out.status.success(), "get-toc-digest {digest}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), toc_digest, "layer {digest}");
    }
}

#[test]
#[ignore = "needs root, containerd, ctr-remote and the test registry: run by .ci/run"]
fn a_recorded_start_lists_the_interpreter_and_the_json_module_and_nothing_unrelated() {
    let node = Node::start();
    let work = tempfile::tempdir().unwrap();
    let recorded = work.path().join("recorded.txt");
    let src = format!("{}/strata/python:1", registry());
    let dst = format!("{}/strata/python:strata-record", registry());
    let (address, socket) = (node.containerd.address.display().to_string(), node.daemon.socket.display().to_string());
    convert_ok(&[
        "--compression-level",
        "1",
        "--record",
        "--record-out",
        recorded.to_str().unwrap(),
        "--record-period",
        "60s",
        "--containerd-address",
        &address,
        "--containerd-namespace",
        common::containerd::NAMESPACE,
        "--socket",
        &socket,
        &src,
        &dst,
        "--",
        "python3",
        "-c",
        "import json",
    ]);
    let text = std::fs::read_to_string(&recorded).unwrap();
    let paths: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert!(paths.contains(&"/usr/bin/python3.11"), "the interpreter: {paths:?}");
    assert!(paths.iter().any(|p| p.starts_with("/usr/lib/python3.11/json/")), "the json module: {paths:?}");
    for unrelated in ["/usr/lib/python3.11/http/", "/usr/share/doc/", "/usr/bin/perl", "/usr/lib/python3.11/email/"] {
        assert!(!paths.iter().any(|p| p.starts_with(unrelated)), "{unrelated} was not opened: {paths:?}");
    }
    assert!(paths.len() < 400, "{} files", paths.len());

    // In the result, the recorded files come before the landmark, in the recorded order.
    let (m, _) = manifest("python:strata-record");
    let layer = m["layers"][0]["digest"].as_str().unwrap();
    let names = tar_names(&blob(layer, "python"), work.path());
    let at = names.iter().position(|n| n == ".prefetch.landmark").expect("a prefetch landmark");
    let files_first: Vec<String> = paths.iter().map(|p| p.trim_start_matches('/').to_owned()).collect();
    let moved: Vec<&String> = names[..at].iter().filter(|n| files_first.contains(n)).collect();
    assert_eq!(moved, files_first.iter().collect::<Vec<_>>(), "the recorded files in order before the landmark");
    let image = node.rpull("python:strata-record");
    assert_eq!(node.run_sh(&image, "recorded", "python3 -c 'import json; print(json.dumps([1]))'"), "[1]\n");
}

#[test]
#[ignore = "needs the test registry: run by .ci/run"]
fn a_push_that_fails_part_way_is_a_clear_error_tags_nothing_and_a_retry_works() {
    use common::faulty::{Fault, FaultyRegistry};
    let faulty = FaultyRegistry::start(&registry());
    // The first blob upload goes through; the rest are cut off.
    // A repository of its own, so no blob is there already from an earlier run.
    let repo =
        format!("pushfail-{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    faulty.set(Fault::RefuseAfter { pattern: format!("PUT /v2/strata/{repo}/blobs/uploads/"), after: 1 });
    let src = format!("{}/strata/busybox:1", registry());
    let dst = format!("{}/strata/{repo}:esgz", faulty.addr);
    let out = convert(&["--jobs", "1", &src, &dst]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "converted through a failing registry");
    assert!(e.contains(&format!("/v2/strata/{repo}/blobs/uploads/")), "the failed upload is named: {e}");
    assert!(!registry_has(&format!("{repo}:esgz")), "no tag after a failed push");
    faulty.set(Fault::None);
    convert_ok(&["--jobs", "1", &src, &dst]);
    assert!(registry_has(&format!("{repo}:esgz")));
    let (m, _) = manifest(&format!("{repo}:esgz"));
    assert_eq!(m["layers"].as_array().unwrap().len(), 2);
}
