//! The CSI node plugin, driven over its socket exactly as kubelet drives it (the same calls,
//! target paths under a kubelet-style pods directory), against the real Ceph RGW; then a runc
//! container started by the real containerd, with the published paths bind-mounted as CRI
//! does, reads the dataset and writes a checkpoint that lands whole in RGW.

mod common;

use common::containerd::{Containerd, registry};
use common::s3::{self, get, wait_until};
use common::*;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;
use strata_csi::proto::volume_capability::access_mode::Mode;
use strata_csi::proto::volume_capability::{AccessMode, AccessType, MountVolume};
use strata_csi::proto::*;
use strata_csi::{Code, DRIVER_NAME};

/// A pod's volume directory as kubelet lays it out; kubelet makes the parent, the plugin the
/// target itself.
fn target(kubelet: &Path, pod: &str, volume: &str) -> PathBuf {
    let dir = kubelet.join("pods").join(pod).join("volumes/kubernetes.io~csi").join(volume);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("mount")
}

fn publish(
    id: &str,
    target: &Path,
    mode: Mode,
    readonly: bool,
    attrs: &[(&str, &str)],
    secrets: &HashMap<String, String>,
) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: id.into(),
        target_path: target.display().to_string(),
        volume_capability: Some(VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }),
        readonly,
        secrets: secrets.clone(),
        volume_context: attrs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        ..Default::default()
    }
}

fn unpublish(id: &str, target: &Path) -> NodeUnpublishVolumeRequest {
    NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: target.display().to_string() }
}

fn mounted(path: &Path) -> bool {
    let want = path.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo").unwrap().lines().any(|l| l.split(' ').nth(4) == Some(&want))
}

/// A volume Secret holding RGW's credentials and endpoint, as `nodePublishSecretRef` passes it.
fn rgw_secret(rgw: &Rgw) -> HashMap<String, String> {
    [
        ("accessKeyId", rgw.access_key.as_str()),
        ("secretAccessKey", rgw.secret_key.as_str()),
        ("endpoint", rgw.endpoint.as_str()),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn gets_of(rgw: &Rgw, key: &str) -> usize {
    rgw.requests_under(key, 1).iter().filter(|r| r.starts_with("GET ") && !r.contains("list-type")).count()
}

#[test]
#[ignore = "needs root, /dev/fuse, containerd, the registry and Ceph RGW: run by .ci/run"]
fn kubelet_publishes_volumes_that_a_container_reads_and_writes_through() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("csi");
    let objects = [("data/train/shard-0.bin", 5_000_000), ("data/train/shard-1.bin", 1_234_567), ("data/README", 40)];
    let uploaded = s3::rt().block_on(upload(rgw.store().as_ref(), &prefix, &objects));
    let kubelet = tempfile::tempdir().unwrap();
    let socket = kubelet.path().join("plugins").join(DRIVER_NAME).join("csi.sock");
    let body = rgw.cold_toml("") + &format!("[csi]\nsocket = \"{}\"\nnode_id = \"node-a\"\n", socket.display());
    let daemon = Daemon::start(&body, "1GiB", "0");
    wait_until(Duration::from_secs(30), || socket.exists());
    let rt = s3::rt();
    let mut identity = rt.block_on(strata_csi::connect_identity(&socket)).unwrap();
    let mut node = rt.block_on(strata_csi::connect_node(&socket)).unwrap();

    // What node-driver-registrar and kubelet ask first.
    let info = rt.block_on(identity.get_plugin_info(GetPluginInfoRequest {})).unwrap().into_inner();
    assert_eq!(info.name, DRIVER_NAME);
    let probe = rt.block_on(identity.probe(ProbeRequest {})).unwrap().into_inner();
    assert_eq!(probe.ready.map(|r| r.value), Some(true));
    let node_info = rt.block_on(node.node_get_info(NodeGetInfoRequest {})).unwrap().into_inner();
    assert_eq!(node_info.node_id, "node-a");
    let caps = rt.block_on(node.node_get_capabilities(NodeGetCapabilitiesRequest {})).unwrap().into_inner();
    assert!(caps.capabilities.is_empty(), "no stage step to call: {caps:?}");

    // A dataset, read-only, with credentials from its Secret; a checkpoint dir, writable, on
    // the node's own store.
    let secret = rgw_secret(&rgw);
    let source = format!("s3://{}/{prefix}data", rgw.bucket);
    let ckpt_source = format!("s3://{}/{prefix}ckpt", rgw.bucket);
    let data = target(kubelet.path(), "pod-1", "dataset");
    let ckpt = target(kubelet.path(), "pod-1", "checkpoints");
    let data_req =
        publish("ds-1", &data, Mode::MultiNodeReaderOnly, true, &[("source", &source), ("immutable", "true")], &secret);
    let ckpt_req = publish("ck-1", &ckpt, Mode::SingleNodeWriter, false, &[("source", &ckpt_source)], &HashMap::new());
    rt.block_on(node.node_publish_volume(data_req.clone())).unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    rt.block_on(node.node_publish_volume(ckpt_req.clone())).unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    assert!(mounted(&data) && mounted(&ckpt));

    // kubelet retries: the same publish again is a success and changes nothing.
    rt.block_on(node.node_publish_volume(data_req.clone())).expect("a repeated publish succeeds");
    let mut other = data_req.clone();
    other.volume_context.insert("metadataTTL".into(), "1s".into());
    other.volume_context.remove("immutable");
    let refused = rt.block_on(node.node_publish_volume(other)).unwrap_err();
    assert_eq!(refused.code(), Code::AlreadyExists, "{refused}");
    assert!(refused.message().contains("other attributes"), "{refused}");

    // A wrong Secret: a clear error naming the cause, no mount, nothing left behind, and the
    // secret itself in no message or log.
    let bad = target(kubelet.path(), "pod-2", "dataset");
    let mut wrong = secret.clone();
    wrong.insert("secretAccessKey".into(), "not-the-secret-at-all".into());
    let denied = rt
        .block_on(node.node_publish_volume(publish(
            "ds-2",
            &bad,
            Mode::MultiNodeReaderOnly,
            true,
            &[("source", &source)],
            &wrong,
        )))
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied}");
    assert!(denied.message().contains("403") || denied.message().contains("SignatureDoesNotMatch"), "{denied}");
    assert!(!mounted(&bad) && !bad.exists(), "a refused publish leaves no mount and no target");
    for text in [denied.message().to_owned(), daemon.log()] {
        assert!(!text.contains("not-the-secret-at-all") && !text.contains(&rgw.secret_key), "a secret was printed");
    }
    let unknown = rt
        .block_on(node.node_publish_volume(publish(
            "ds-3",
            &bad,
            Mode::MultiNodeReaderOnly,
            true,
            &[("source", &source), ("ttl", "1s")],
            &secret,
        )))
        .unwrap_err();
    assert_eq!(unknown.code(), Code::InvalidArgument, "{unknown}");
    assert!(unknown.message().contains("`ttl`"), "{unknown}");

    // The pod's container, with the targets bind-mounted as CRI does.
    let cdir = tempfile::tempdir().unwrap();
    let containerd = Containerd::start(cdir.path(), &cdir.path().join("no-snapshotter.sock"));
    let image = format!("{}/strata/busybox:1", registry());
    containerd.ctr_ok(&["images", "pull", "--plain-http", &image], &daemon.log());
    let binds = [
        format!("type=bind,src={},dst=/data,options=rbind:ro", data.display()),
        format!("type=bind,src={},dst=/ckpt,options=rbind:rw", ckpt.display()),
    ];
    let script = "sha256sum /data/train/shard-0.bin /data/train/shard-1.bin /data/README | cut -d' ' -f1; \
                  mkdir -p /ckpt/step-100 && cat /data/train/shard-1.bin /data/README > /ckpt/step-100/model.pt && \
                  sync /ckpt/step-100/model.pt && echo written";
    let out = containerd.ctr_ok(
        &["run", "--rm", "--mount", &binds[0], "--mount", &binds[1], &image, "trainer", "sh", "-c", script],
        &daemon.log(),
    );
    let want: Vec<String> = uploaded.iter().map(|(_, sha)| sha.clone()).chain(["written".to_string()]).collect();
    assert_eq!(out.lines().collect::<Vec<_>>(), want, "the container read other bytes\n{}", daemon.log());
    let ckpt_key = format!("{prefix}ckpt/step-100/model.pt");
    let mut expect = common::data(2 + prefix.len() as u64, 1_234_567);
    expect.extend(common::data(3 + prefix.len() as u64, 40));
    wait_until(Duration::from_secs(30), || s3::head(&rgw, &ckpt_key) == Some(expect.len() as u64));
    assert_eq!(sha(&get(&rgw, &ckpt_key)), sha(&expect), "the checkpoint did not land whole");

    // A second pod's volume of the same dataset reads through the same cache: no new GET.
    let shard = format!("{prefix}data/train/shard-0.bin");
    let before = gets_of(&rgw, &shard);
    let data2 = target(kubelet.path(), "pod-3", "dataset");
    rt.block_on(node.node_publish_volume(publish(
        "ds-1",
        &data2,
        Mode::MultiNodeReaderOnly,
        true,
        &[("source", &source), ("immutable", "true")],
        &secret,
    )))
    .unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    assert_eq!(sha(&std::fs::read(data2.join("train/shard-0.bin")).unwrap()), uploaded[0].1);
    // RGW writes its log a moment after it answers: a GET made now would show within this.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(gets_of(&rgw, &shard), before, "the second volume fetched the shard again");

    // A volume's tiering settings are the node policy's while it is published, and only then.
    let pinned = target(kubelet.path(), "pod-5", "dataset");
    let pinned_req = publish(
        "ds-5",
        &pinned,
        Mode::MultiNodeReaderOnly,
        true,
        &[("source", &ckpt_source), ("pin", "hot")],
        &HashMap::new(),
    );
    rt.block_on(node.node_publish_volume(pinned_req)).unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    let rule = format!("prefix = \"{prefix}ckpt/\"");
    let policy = daemon.tier_ok(&["policy", "show"]);
    assert!(policy.contains(&rule) && policy.contains("pin = \"hot\""), "{policy}");
    rt.block_on(node.node_unpublish_volume(unpublish("ds-5", &pinned))).unwrap();
    let policy = daemon.tier_ok(&["policy", "show"]);
    assert!(!policy.contains(&rule), "the rule outlived its volume: {policy}");

    // A target some other mount holds is refused, not mounted over.
    let taken = target(kubelet.path(), "pod-4", "dataset");
    std::fs::create_dir_all(&taken).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let bound = std::process::Command::new("mount").arg("--bind").arg(elsewhere.path()).arg(&taken).status().unwrap();
    assert!(bound.success());
    let busy = rt
        .block_on(node.node_publish_volume(publish(
            "ds-4",
            &taken,
            Mode::MultiNodeReaderOnly,
            true,
            &[("source", &source)],
            &secret,
        )))
        .unwrap_err();
    assert_eq!(busy.code(), Code::FailedPrecondition, "{busy}");
    assert!(std::process::Command::new("umount").arg(&taken).status().unwrap().success());

    // An unpublish while a checkpoint is being written detaches the volume, and the file, once
    // its writer closes it, still lands whole.
    let late_key = format!("{prefix}ckpt/step-200/model.pt");
    let late = common::data(99, 5 << 20);
    std::fs::create_dir_all(ckpt.join("step-200")).unwrap();
    let mut writer = std::fs::File::create(ckpt.join("step-200/model.pt")).unwrap();
    writer.write_all(&late[..3 << 20]).unwrap();
    rt.block_on(node.node_unpublish_volume(unpublish("ck-1", &ckpt)))
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    assert!(!mounted(&ckpt) && !ckpt.exists(), "the target is left while a file is open");
    writer.write_all(&late[3 << 20..]).unwrap();
    writer.sync_all().unwrap();
    drop(writer);
    wait_until(Duration::from_secs(30), || s3::head(&rgw, &late_key) == Some(late.len() as u64));
    assert_eq!(sha(&get(&rgw, &late_key)), sha(&late), "the checkpoint written across the unpublish is not whole");

    // Unpublish: idempotent, and nothing left at the targets.
    for (id, t) in [("ds-1", &data), ("ck-1", &ckpt), ("ds-1", &data2), ("ds-4", &taken)] {
        rt.block_on(node.node_unpublish_volume(unpublish(id, t))).unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        assert!(!mounted(t) && !t.exists(), "{} is left", t.display());
        rt.block_on(node.node_unpublish_volume(unpublish(id, t))).expect("a repeated unpublish succeeds");
    }
    drop(daemon);
    s3::delete_under(&rgw, &prefix);
}

/// A pod reading a published volume through daemon restarts: under `strata supervise`, a file
/// held open and files opened for the first time read right, with no error, through a SIGKILL
/// and a handover. The successor knows the volume without kubelet publishing it again (its
/// unpublish unmounts it), and the Secret's key was written to no file.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn a_volume_a_pod_reads_survives_daemon_restarts_and_stays_known() {
    use std::os::unix::fs::FileExt;
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("csi-restart");
    let objects: Vec<(String, usize)> = std::iter::once(("big.bin".to_string(), 24 << 20))
        .chain((0..60).map(|i| (format!("s/{i}.bin"), 50_000)))
        .collect();
    let refs: Vec<(&str, usize)> = objects.iter().map(|(n, l)| (n.as_str(), *l)).collect();
    s3::rt().block_on(upload(rgw.store().as_ref(), &prefix, &refs));
    let want: Vec<Vec<u8>> = refs.iter().map(|(n, _)| get(&rgw, &format!("{prefix}{n}"))).collect();
    let kubelet = tempfile::tempdir().unwrap();
    let socket = kubelet.path().join("plugins").join(DRIVER_NAME).join("csi.sock");
    let body = rgw.cold_toml("") + &format!("[csi]\nsocket = \"{}\"\nnode_id = \"node-a\"\n", socket.display());
    let mut daemon = Daemon::start_supervised(&body, "1GiB", "0");
    wait_until(Duration::from_secs(30), || socket.exists());
    let rt = s3::rt();
    let secret = rgw_secret(&rgw);
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let data = target(kubelet.path(), "pod-r", "dataset");
    let req =
        publish("ds-r", &data, Mode::MultiNodeReaderOnly, true, &[("source", &source), ("immutable", "true")], &secret);
    let mut node = rt.block_on(strata_csi::connect_node(&socket)).unwrap();
    rt.block_on(node.node_publish_volume(req)).unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let errors = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let reads = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let reader = {
        let (stop, errors, reads, data, want) =
            (stop.clone(), errors.clone(), reads.clone(), data.clone(), want.clone());
        std::thread::spawn(move || {
            let big = std::fs::File::open(data.join("big.bin")).unwrap();
            let mut buf = vec![0u8; 128 << 10];
            let mut round = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let off = (round * (3 << 20) + 4096) % (want[0].len() - buf.len());
                match big.read_exact_at(&mut buf, off as u64) {
                    Ok(()) if buf[..] == want[0][off..off + buf.len()] => {}
                    Ok(()) => errors.lock().unwrap().push(format!("wrong bytes in big.bin at {off}")),
                    Err(e) => errors.lock().unwrap().push(format!("big.bin: {e}")),
                }
                let i = 1 + round % 60;
                match std::fs::read(data.join(format!("s/{}.bin", i - 1))) {
                    Ok(b) if b == want[i] => {}
                    Ok(_) => errors.lock().unwrap().push(format!("wrong bytes in s/{}.bin", i - 1)),
                    Err(e) => errors.lock().unwrap().push(format!("s/{}.bin: {e}", i - 1)),
                }
                reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                round += 1;
                std::thread::sleep(Duration::from_millis(30));
            }
        })
    };
    let went_on = |since: usize| {
        wait_until(Duration::from_secs(30), || reads.load(std::sync::atomic::Ordering::Relaxed) > since + 5);
        assert!(reads.load(std::sync::atomic::Ordering::Relaxed) > since + 5, "the reader stopped");
    };
    went_on(0);
    let n = reads.load(std::sync::atomic::Ordering::Relaxed);
    daemon.restart_with("KILL");
    went_on(n);
    let n = reads.load(std::sync::atomic::Ordering::Relaxed);
    daemon.restart_with("USR2");
    went_on(n);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().unwrap();
    let errors = errors.lock().unwrap();
    assert!(errors.is_empty(), "the pod saw errors: {:?}\n{}", &errors[..errors.len().min(10)], daemon.log());
    assert_eq!(daemon.log().matches("volume of before the restart published again").count(), 2, "{}", daemon.log());

    // The Secret's key is in no file the daemon wrote.
    for f in files_under(daemon.state()) {
        let bytes = std::fs::read(&f).unwrap_or_default();
        let hit = bytes.windows(rgw.secret_key.len()).any(|w| w == rgw.secret_key.as_bytes());
        assert!(!hit, "{} holds the volume's secret key", f.display());
    }
    // kubelet's unpublish after the restarts finds the volume known, and unmounts it.
    let mut node = rt.block_on(strata_csi::connect_node(&socket)).unwrap();
    rt.block_on(node.node_unpublish_volume(unpublish("ds-r", &data)))
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    assert!(!mounted(&data) && !data.exists(), "the volume outlived its unpublish");
    s3::delete_under(&rgw, &prefix);
}
