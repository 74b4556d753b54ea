//! The Kubernetes deployment of `deploy/kubernetes/`: that its manifests agree with the agent's
//! config and containerd's snippets, and, through real containerd, runc and Ceph RGW, that a
//! training container set up as the Job asks reads and writes through the mounts of an agent
//! run as the DaemonSet asks, and keeps doing so when the agent's pod is replaced.

mod common;

use common::containerd::{Containerd, registry};
use common::kube::{self, SharedDir, Volumes};
use common::s3::{self, get, wait_until};
use common::*;
use object_store::ObjectStoreExt;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;
use strata_tiering::config::Config;

/// The volume mounts of `pod`'s containers whose volumes are host paths: (mount path, its
/// propagation, read-only), after checking that each is mounted at its own path on the host.
fn host_mounts(pod: &Value) -> Vec<(PathBuf, String, bool)> {
    let mut out = Vec::new();
    for c in pod["containers"].as_array().unwrap() {
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            let vol = kube::volume(pod, m["name"].as_str().unwrap());
            let Some(host) = vol["hostPath"]["path"].as_str() else { continue };
            assert_eq!(
                m["mountPath"], host,
                "host path {host} is mounted elsewhere: the host and the pod would name its files differently"
            );
            assert!(m.get("subPath").is_none(), "a subPath pins the mount the pod started with: {m}");
            let propagation = m["mountPropagation"].as_str().unwrap_or("None").to_string();
            out.push((PathBuf::from(host), propagation, m["readOnly"] == true));
        }
    }
    out
}

#[test]
fn the_kubernetes_manifests_agree_with_the_agent_and_containerd() {
    let docs = kube::manifests();
    for d in &docs {
        assert!(d["apiVersion"].is_string() && d["kind"].is_string(), "{d}");
        assert!(d["metadata"]["name"].as_str().is_some_and(|n| !n.is_empty()), "{d}");
    }
    let cm = kube::find(&docs, "ConfigMap", "strata-config");
    let config = Config::from_toml(cm["data"]["config.toml"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("the ConfigMap's config.toml does not load: {e}"));
    let ds = kube::find(&docs, "DaemonSet", "strata");
    let secret = kube::find(&docs, "Secret", "strata-s3");
    for o in [cm, secret] {
        assert_eq!(o["metadata"]["namespace"], ds["metadata"]["namespace"], "{}", o["kind"]);
    }
    let pod = kube::pod_spec(ds);
    let c = &pod["containers"][0];

    // The agent reads the ConfigMap's file where the pod has it.
    let config_mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| kube::volume(pod, m["name"].as_str().unwrap())["configMap"]["name"] == "strata-config")
        .expect("the ConfigMap is mounted");
    let config_path = format!("{}/config.toml", config_mount["mountPath"].as_str().unwrap());
    assert_eq!(
        kube::strings(&c["args"]),
        ["supervise", "--", "/usr/local/bin/strata", "daemon", "--config", config_path.as_str()],
        "the daemon runs under the supervisor that keeps its mounts across its restarts"
    );
    assert_eq!(c["securityContext"]["privileged"], true, "FUSE mounts and Bidirectional propagation need it");
    assert!(
        c["volumeMounts"].as_array().unwrap().iter().any(|m| m["mountPath"] == "/dev/fuse"),
        "/dev/fuse is mounted"
    );
    assert_eq!(ds["spec"]["updateStrategy"]["type"], "OnDelete", "a rolling update would cut running pods' mounts");
    assert_eq!(c["envFrom"][0]["secretRef"]["name"], "strata-s3");
    for key in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"] {
        assert!(secret["stringData"][key].is_string(), "the Secret has {key}");
    }

    // Every path the agent uses is a host path; those that hold mounts the host must see
    // (datasets, and the snapshotter's lazy layers under overlays) propagate out.
    let mounts = host_mounts(pod);
    let under = |p: &Path, bidirectional: bool| {
        mounts.iter().any(|(m, prop, _)| p.starts_with(m) && (!bidirectional || prop == "Bidirectional"))
    };
    let snap_root = config.snapshotter.root.clone().unwrap_or_else(|| config.state_dir.join("snapshotter"));
    assert!(config.snapshotter.enabled);
    assert!(under(&config.state_dir, true) && under(&snap_root, true), "{mounts:?}");
    for m in &config.mounts {
        assert!(under(&m.path, true), "{} is not under a Bidirectional host path: {mounts:?}", m.path.display());
        assert!(
            mounts.iter().all(|(p, ..)| p != &m.path),
            "the mount point itself is a host path: {}",
            m.path.display()
        );
    }
    for p in [&config.admin.socket, &config.snapshotter.socket] {
        assert!(under(p.parent().unwrap(), false), "{} is not on the host", p.display());
    }
    for t in [&config.tiers.hot, &config.tiers.warm] {
        assert!(under(t.path.as_ref().expect("tiers on the node's disks"), false), "{t:?}");
    }
    assert!(
        mounts.iter().any(|(p, _, ro)| *ro && config.snapshotter.hosts_dir.starts_with(p)),
        "containerd's hosts dir {} is mounted read-only",
        config.snapshotter.hosts_dir.display()
    );
    let docker_dir = config.snapshotter.docker_config.parent().unwrap();
    assert!(c["volumeMounts"].as_array().unwrap().iter().any(|m| m["mountPath"] == docker_dir.to_str().unwrap()));

    // containerd on the host dials the socket the pod serves, and reports its root.
    for snippet in ["config-1.6-1.7.toml", "config-2.x.toml"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/containerd").join(snippet);
        let t: toml::Table = std::fs::read_to_string(&path).unwrap().parse().unwrap();
        let plugin = &t["proxy_plugins"]["strata"];
        assert_eq!(plugin["address"].as_str().unwrap(), config.snapshotter.socket.to_str().unwrap(), "{snippet}");
        assert_eq!(plugin["exports"]["root"].as_str().unwrap(), snap_root.to_str().unwrap(), "{snippet}");
    }

    // Prometheus finds the metrics where the agent serves them; the probe asks the agent's
    // admin socket (its default, as it names none).
    let port = config.metrics.listen.rsplit(':').next().unwrap();
    assert_eq!(c["ports"][0]["containerPort"].to_string(), port);
    assert_eq!(ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"], port);
    assert_eq!(kube::strings(&c["readinessProbe"]["exec"]["command"]), ["strata", "tier", "status"]);
    assert_eq!(config.admin.socket, Path::new("/run/strata/admin.sock"));

    // The peer tier's members are the ready agents: a headless Service over the DaemonSet's
    // pods at the peer port, whose DNS name the config follows; the secret is a mounted Secret.
    let peers = config.peers.as_ref().expect("the DaemonSet's agents form a peer tier");
    let svc = kube::find(&docs, "Service", "strata-peers");
    assert_eq!(svc["spec"]["clusterIP"], "None", "headless: its name resolves to every member");
    assert_eq!(svc["spec"]["selector"], ds["spec"]["selector"]["matchLabels"]);
    assert_eq!(ds["spec"]["template"]["spec"]["hostNetwork"], true, "members are reached at the node's address");
    let dns = format!("strata-peers.{}.svc.cluster.local", ds["metadata"]["namespace"].as_str().unwrap());
    assert_eq!(peers.members_dns.as_deref(), Some(dns.as_str()));
    assert_eq!(svc["spec"]["ports"][0]["port"].as_u64(), Some(u64::from(peers.listen_port())));
    assert!(c["ports"].as_array().unwrap().iter().any(|p| p["containerPort"].as_u64() == Some(7470)));
    let secret_mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| peers.secret_file.parent() == Some(Path::new(m["mountPath"].as_str().unwrap())))
        .expect("the peer secret's directory is a mounted volume");
    let secret_name = kube::volume(pod, secret_mount["name"].as_str().unwrap())["secret"]["secretName"].clone();
    let peer_secret = kube::find(&docs, "Secret", secret_name.as_str().unwrap());
    let file = peers.secret_file.file_name().unwrap().to_str().unwrap();
    assert!(peer_secret["stringData"][file].as_str().is_some_and(|s| s.len() >= 32), "the Secret has `{file}`");

    // The training job mounts the directory that holds the mounts, so that a mount made again
    // reaches it, and its arguments name paths inside the mounts.
    let job = kube::find(&docs, "Job", "train-resnet");
    let jpod = kube::pod_spec(job);
    let jmounts = host_mounts(jpod);
    assert!(!jmounts.is_empty());
    for (p, prop, _) in &jmounts {
        assert_eq!(prop, "HostToContainer", "{}", p.display());
        assert!(config.mounts.iter().any(|m| m.path.parent() == Some(p.as_path())), "{} holds no mount", p.display());
    }
    for arg in kube::strings(&jpod["containers"][0]["args"]) {
        let path = arg.split_once('=').map(|(_, v)| v).unwrap_or(&arg);
        assert!(config.mounts.iter().any(|m| Path::new(path).starts_with(&m.path)), "{arg} is in no mount");
    }
}

/// The agent's config for the test: the ConfigMap's, with the test RGW as its store (under
/// `prefix`), its metrics on a free port, and every path under a host path rebased under
/// `vols.root`, as the pod's mounts are.
fn test_config(docs: &[Value], rgw: &Rgw, prefix: &str, vols: &Volumes) -> String {
    let cm = kube::find(docs, "ConfigMap", "strata-config");
    let mut t: toml::Table = cm["data"]["config.toml"].as_str().unwrap().parse().unwrap();
    let hosts: Vec<String> = kube::pod_spec(kube::find(docs, "DaemonSet", "strata"))["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str().map(str::to_string))
        .collect();
    fn rebase(v: &mut toml::Value, hosts: &[String], vols: &Volumes) {
        match v {
            toml::Value::String(s) if hosts.iter().any(|h| Path::new(s.as_str()).starts_with(h)) => {
                *s = vols.host(s).display().to_string();
            }
            toml::Value::Table(t) => t.iter_mut().for_each(|(_, v)| rebase(v, hosts, vols)),
            toml::Value::Array(a) => a.iter_mut().for_each(|v| rebase(v, hosts, vols)),
            _ => {}
        }
    }
    t.iter_mut().for_each(|(_, v)| rebase(v, &hosts, vols));
    let cold: toml::Table = rgw.cold_toml(&format!("prefix = \"{}\"", prefix.trim_end_matches('/'))).parse().unwrap();
    t.insert("cold".into(), cold["cold"].clone());
    t["metrics"]["listen"] = toml::Value::String(format!("127.0.0.1:{}", free_port()));
    // One node, no cluster DNS: the peer tier with this node as its only member, on loopback,
    // its secret read from the Secret's volume as in the pod.
    let port = free_port();
    let peers = t["peers"].as_table_mut().expect("the ConfigMap has [peers]");
    peers.remove("members_dns");
    peers.insert("members".into(), toml::Value::Array(vec![format!("127.0.0.1:{port}").into()]));
    peers.insert("listen".into(), format!("127.0.0.1:{port}").into());
    // A test-sized cache: the manifest's tiers are a node's terabytes.
    t["tiers"]["hot"]["capacity"] = "1GiB".into();
    t["tiers"]["warm"]["capacity"] = "1GiB".into();
    toml::to_string(&t).unwrap()
}

/// The agent's pod, run as the DaemonSet asks: `ctr run` with the pod's flags, its image's
/// program standing in for the image of deploy/kubernetes/Dockerfile (this build of strata,
/// and the node's fusermount3 and CA certificates, from the packages the Dockerfile installs).
fn start_agent(node: &Containerd, ds: &Value, vols: &Volumes, base: &str, rgw: &Rgw, log: &Path) {
    let pod = kube::pod_spec(ds);
    let mut flags = kube::ctr_flags(pod, "strata", vols);
    for (k, v) in [("AWS_ACCESS_KEY_ID", &rgw.access_key), ("AWS_SECRET_ACCESS_KEY", &rgw.secret_key)] {
        flags.extend(["--env".to_string(), format!("{k}={v}")]);
    }
    for (src, dst) in [
        (BIN, "/usr/local/bin/strata"),
        ("/usr/bin/fusermount3", "/usr/bin/fusermount3"),
        ("/etc/ssl/certs", "/etc/ssl/certs"),
    ] {
        flags.extend(["--mount".to_string(), format!("type=bind,src={src},dst={dst},options=rbind:ro")]);
    }
    flags.extend(["--log-uri".to_string(), format!("file://{}", log.display())]);
    let mut args: Vec<&str> = vec!["run", "-d"];
    args.extend(flags.iter().map(String::as_str));
    args.extend([base, "strata-agent", "/usr/local/bin/strata"]);
    let program = kube::strings(&pod["containers"][0]["args"]);
    args.extend(program.iter().map(String::as_str));
    node.ctr_ok(&args, &std::fs::read_to_string(log).unwrap_or_default());
    // containerd was up first, as on a node, and redials the plugin's socket once it is there.
    node.wait_for_strata(Duration::from_secs(30));
}

fn stop_agent(node: &Containerd, log: &Path) {
    let agent_log = || std::fs::read_to_string(log).unwrap_or_default();
    node.ctr_ok(&["tasks", "kill", "-s", "SIGTERM", "strata-agent"], &agent_log());
    wait_until(Duration::from_secs(60), || {
        String::from_utf8_lossy(&node.ctr(&["tasks", "ls"]).stdout)
            .lines()
            .any(|l| l.starts_with("strata-agent ") && l.contains("STOPPED"))
    });
    node.ctr_ok(&["tasks", "delete", "strata-agent"], &agent_log());
    node.ctr_ok(&["containers", "delete", "strata-agent"], &agent_log());
}

/// `sh -c script` in the running container `id`.
fn exec(node: &Containerd, id: &str, script: &str) -> std::process::Output {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let exec_id = format!("probe-{}", N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    node.ctr(&["tasks", "exec", "--exec-id", &exec_id, id, "sh", "-c", script])
}

fn out(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
#[ignore = "needs root, containerd, runc, the test registry and RGW: run by .ci/run"]
fn fuse_root_rgw_a_training_pod_keeps_its_dataset_when_the_agent_pod_is_replaced() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("kube");
    let (ds1, ds2, ds3) = (data(41, 3_000_000), data(42, 2_000_000), data(43, 1_500_000));
    let store = rgw.store();
    for (name, bytes) in [("ds1.bin", &ds1), ("ds2.bin", &ds2), ("ds3.bin", &ds3)] {
        let key = object_store::path::Path::from(format!("{prefix}datasets/{name}"));
        s3::rt().block_on(store.put(&key, bytes.clone().into())).expect("upload to RGW");
    }

    let docs = kube::manifests();
    let ds = kube::find(&docs, "DaemonSet", "strata");
    let job = kube::find(&docs, "Job", "train-resnet");
    let node_dir = tempfile::tempdir().unwrap();
    let root = node_dir.path().join("node");
    std::fs::create_dir_all(&root).unwrap();
    let _shared = SharedDir::new(&root);
    let config_dir = node_dir.path().join("configmap");
    std::fs::create_dir_all(&config_dir).unwrap();
    let secret_dir = node_dir.path().join("peer-secret");
    std::fs::create_dir_all(&secret_dir).unwrap();
    std::fs::write(secret_dir.join("secret"), "0123456789abcdef0123456789abcdef\n").unwrap();
    let vols = Volumes {
        root: root.clone(),
        dirs: vec![("config".into(), config_dir.clone()), ("peer-secret".into(), secret_dir)],
        propagation: None,
    };
    std::fs::write(config_dir.join("config.toml"), test_config(&docs, &rgw, &prefix, &vols)).unwrap();
    let log = node_dir.path().join("agent.log");

    let containerd_dir = tempfile::tempdir().unwrap();
    let node = Containerd::start(containerd_dir.path(), &vols.host("/run/strata/snapshotter.sock"));
    let agent_log = || std::fs::read_to_string(&log).unwrap_or_default();
    // The agent's image: Debian 12, as the Dockerfile's; the training image: busybox. Both on
    // containerd's own overlayfs, so that they outlive the agent.
    let base = format!("{}/strata/python:1", registry());
    let busybox = format!("{}/strata/busybox:1", registry());
    for image in [&base, &busybox] {
        node.ctr_ok(&["images", "pull", "--plain-http", image], "");
    }

    start_agent(&node, ds, &vols, &base, &rgw, &log);
    let (datasets, checkpoints) = (vols.host("/mnt/strata/datasets"), vols.host("/mnt/strata/checkpoints"));
    wait_until(Duration::from_secs(60), || mounted(&datasets) && mounted(&checkpoints));
    assert!(mounted(&datasets) && mounted(&checkpoints), "the agent's mounts are not on the host:\n{}", agent_log());

    // Two training pods: one as the Job is written (HostToContainer), one without propagation.
    let job_pod = kube::pod_spec(job);
    for (id, propagation) in [("train", None), ("train-unpropagated", Some("None"))] {
        let job_vols = Volumes { root: root.clone(), dirs: vec![], propagation };
        let mut args: Vec<String> = ["run", "-d"].map(String::from).to_vec();
        args.extend(kube::ctr_flags(job_pod, "train", &job_vols));
        args.extend([busybox.clone(), id.to_string(), "sleep".into(), "600".into()]);
        node.ctr_ok(&args.iter().map(String::as_str).collect::<Vec<_>>(), &agent_log());
    }
    let (d, c) = (datasets.display(), checkpoints.display());
    for id in ["train", "train-unpropagated"] {
        let o = exec(&node, id, &format!("sha256sum {d}/ds1.bin"));
        assert!(out(&o).starts_with(&sha(&ds1)), "{id}: {}\n{}", out(&o), agent_log());
    }
    // A checkpoint written as PyTorch writes one: to a temp name, then renamed.
    let o = exec(
        &node,
        "train",
        &format!(
            "mkdir -p {c}/run1 && head -c 1000000 {d}/ds1.bin > {c}/run1/ck.tmp && mv {c}/run1/ck.tmp {c}/run1/ck.pt"
        ),
    );
    assert!(o.status.success(), "{}\n{}", out(&o), agent_log());
    assert_eq!(get(&rgw, &format!("{prefix}checkpoints/run1/ck.pt")), ds1[..1_000_000]);

    // The agent's lazy image layers reach containerd on the host through the state dir's
    // propagation: a container runs on them.
    let lazy = format!("{}/strata/busybox:esgz", registry());
    let o = node.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", &lazy]);
    assert!(o.status.success(), "rpull: {}\n{}\n--- containerd ---\n{}", out(&o), agent_log(), node.log());
    let motd = node.run_captured("strata", &lazy, "lazy-1", "cat /etc/motd", &agent_log());
    assert_eq!(motd, "strata layer two\n");
    let host_mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let state = vols.host("/var/lib/strata").display().to_string();
    assert!(
        host_mounts
            .lines()
            .any(|l| l.contains(&format!(" {state}/")) && l.contains(" fuse.strata ") && l.contains(" strata:")),
        "no lazy layer of the agent under {state} on the host:\n{host_mounts}"
    );

    // The daemon in the agent's pod dies (an OOM kill): the pod's supervisor starts it again on
    // the kept connections, and both training pods read on, the one without propagation too,
    // since the mount never went away.
    let tasks = String::from_utf8_lossy(&node.ctr(&["tasks", "ls"]).stdout).into_owned();
    let init: u32 = tasks
        .lines()
        .find_map(|l| l.strip_prefix("strata-agent ").and_then(|r| r.split_whitespace().next()?.parse().ok()))
        .unwrap_or_else(|| panic!("no agent task: {tasks}"));
    let children = std::fs::read_to_string(format!("/proc/{init}/task/{init}/children")).unwrap();
    let daemon = children.split_whitespace().next().expect("the supervisor runs the daemon").to_owned();
    let took_over = || agent_log().matches("took over the mount an earlier run left").count();
    let before = took_over();
    assert!(std::process::Command::new("kill").args(["-KILL", &daemon]).status().unwrap().success());
    wait_until(Duration::from_secs(60), || took_over() >= before + 2);
    assert!(took_over() >= before + 2, "the daemon did not take its mounts over:\n{}", agent_log());
    for id in ["train", "train-unpropagated"] {
        let o = exec(&node, id, &format!("sha256sum {d}/ds3.bin"));
        assert!(out(&o).starts_with(&sha(&ds3)), "{id} after the daemon's kill: {}\n{}", out(&o), agent_log());
    }

    // The agent's pod is replaced, as `kubectl delete pod` does: SIGTERM, then a new pod.
    stop_agent(&node, &log);
    wait_until(Duration::from_secs(30), || !mounted(&datasets) && !mounted(&checkpoints));
    assert!(!mounted(&datasets) && !mounted(&checkpoints), "the stopped agent left its mounts:\n{}", agent_log());
    start_agent(&node, ds, &vols, &base, &rgw, &log);
    wait_until(Duration::from_secs(60), || mounted(&datasets) && mounted(&checkpoints));
    assert!(mounted(&datasets) && mounted(&checkpoints), "the agent's mounts are not on the host:\n{}", agent_log());

    // The Job's pod reads on, through the new mount, a file it never opened before.
    let o = exec(
        &node,
        "train",
        &format!("sha256sum {d}/ds2.bin && cmp {c}/run1/ck.pt {d}/ds1.bin -n 1000000 && echo same"),
    );
    assert!(out(&o).starts_with(&sha(&ds2)) && out(&o).ends_with("same\n"), "{}\n{}", out(&o), agent_log());
    // Without propagation, the pod still holds the old agent's mount, whose daemon is gone.
    let o = exec(&node, "train-unpropagated", &format!("sha256sum {d}/ds2.bin"));
    assert!(!o.status.success() && out(&o).contains("not connected"), "{}", out(&o));
    // New containers start from the lazy image on the new agent.
    let motd = node.run_captured("strata", &lazy, "lazy-2", "cat /etc/motd", &agent_log());
    assert_eq!(motd, "strata layer two\n");

    for id in ["train", "train-unpropagated"] {
        let _ = node.ctr(&["tasks", "kill", "-s", "SIGKILL", id]);
    }
    stop_agent(&node, &log);
}
