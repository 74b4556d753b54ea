//! The Kubernetes manifests of `deploy/kubernetes/`, read as kubelet would read them, and a pod
//! of theirs run as a runc container through `ctr`, with the mounts CRI would give it: every
//! hostPath a bind mount, Bidirectional propagation `rshared` and HostToContainer `rslave` (on
//! the mount and on the container's root, as containerd's CRI plugin sets them). There is no
//! kubelet on this machine; this is what a node does with the pod spec underneath it.

use serde_json::Value;
use std::path::{Path, PathBuf};

/// Every document of every manifest in `deploy/kubernetes/`.
pub fn manifests() -> Vec<Value> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes");
    let mut docs = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {}", dir.display());
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for doc in serde_norway::Deserializer::from_str(&text) {
            let v: Value = serde::Deserialize::deserialize(doc)
                .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", f.display()));
            docs.push(v);
        }
    }
    docs
}

/// The object of `kind` named `name`.
pub fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/kubernetes/"))
}

/// The pod spec of a workload (DaemonSet, Job, Deployment).
pub fn pod_spec(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]
}

pub fn volume<'a>(pod: &'a Value, name: &str) -> &'a Value {
    pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no volume {name} in {pod}"))
}

pub fn strings(v: &Value) -> Vec<String> {
    v.as_array().map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect()).unwrap_or_default()
}

/// The node's name, as the downward API gives `spec.nodeName` to the pods of this test.
pub const NODE_NAME: &str = "test-node";

/// What the node gives a pod's volumes that are not host paths.
#[derive(Debug, Default)]
pub struct Volumes {
    /// Host paths are rebased under this dir, on the host and in the container alike (the
    /// manifests mount every host path at its own path), so a test leaves the node's real
    /// `/var/lib/strata` and `/mnt/strata` alone.
    pub root: PathBuf,
    /// ConfigMap and Secret volumes: the dir holding each one's files, by volume name. An
    /// optional Secret missing here is an empty dir, as kubelet gives it.
    pub dirs: Vec<(String, PathBuf)>,
    /// Overrides the propagation of every mount (None keeps the manifest's): the test's way to
    /// show what a pod without it gets.
    pub propagation: Option<&'static str>,
}

impl Volumes {
    pub fn host(&self, path: &str) -> PathBuf {
        PathBuf::from(format!("{}{path}", self.root.display()))
    }
}

/// `ctr run` flags for container `name` of `pod`, as CRI would set the container up.
pub fn ctr_flags(pod: &Value, name: &str, vols: &Volumes) -> Vec<String> {
    let c = pod["containers"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap();
    let mut flags = Vec::new();
    if c["securityContext"]["privileged"] == true {
        flags.push("--privileged".to_string());
    }
    if pod["hostNetwork"] == true {
        flags.push("--net-host".to_string());
    }
    let mut root_propagation = None;
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let vol = volume(pod, m["name"].as_str().unwrap());
        let dst = m["mountPath"].as_str().unwrap();
        let propagation = match vols.propagation.or(m["mountPropagation"].as_str()) {
            Some("Bidirectional") => "rshared",
            Some("HostToContainer") => "rslave",
            _ => "rprivate",
        };
        let (src, dst) = if let Some(path) = vol["hostPath"]["path"].as_str() {
            match vol["hostPath"]["type"].as_str() {
                // A privileged container has the host's devices already.
                Some("CharDevice") => {
                    assert!(Path::new(path).exists(), "{path} is missing on this node");
                    continue;
                }
                Some("DirectoryOrCreate") => std::fs::create_dir_all(vols.host(path)).unwrap(),
                Some("Directory") => assert!(vols.host(path).is_dir(), "kubelet refuses the pod: {path} is not there"),
                other => panic!("hostPath type {other:?} of {vol}"),
            }
            (vols.host(path), vols.host(dst))
        } else {
            let dir = vols.dirs.iter().find(|(n, _)| n == m["name"].as_str().unwrap()).map(|(_, d)| d.clone());
            let dir = dir.unwrap_or_else(|| {
                assert!(vol["secret"]["optional"] == true, "the test gives no files for volume {vol}");
                let d = vols.root.join(format!("empty-{}", m["name"].as_str().unwrap()));
                std::fs::create_dir_all(&d).unwrap();
                d
            });
            (dir, PathBuf::from(dst))
        };
        if propagation == "rshared" || (propagation == "rslave" && root_propagation.is_none()) {
            root_propagation = Some(propagation);
        }
        let ro = if m["readOnly"] == true { ":ro" } else { "" };
        flags.push("--mount".into());
        flags.push(format!("type=bind,src={},dst={},options=rbind:{propagation}{ro}", src.display(), dst.display()));
    }
    if let Some(p) = root_propagation {
        flags.push("--rootfs-propagation".into());
        flags.push(p.into());
    }
    for e in c["env"].as_array().into_iter().flatten() {
        // The downward API's node name is the one field the manifests take from the pod.
        let value = match (e["value"].as_str(), e["valueFrom"]["fieldRef"]["fieldPath"].as_str()) {
            (Some(v), _) => v.to_string(),
            (None, Some("spec.nodeName")) => NODE_NAME.to_string(),
            _ => panic!("env {e} is neither a value nor the node's name"),
        };
        flags.push("--env".into());
        flags.push(format!("{}={value}", e["name"].as_str().unwrap()));
    }
    flags
}

/// Makes `dir` a shared mount, as `/` is on a systemd host: kubelet needs that of every host
/// path mounted with Bidirectional or HostToContainer propagation.
pub struct SharedDir(pub PathBuf);

impl SharedDir {
    pub fn new(dir: &Path) -> SharedDir {
        for args in [
            vec!["--bind", dir.to_str().unwrap(), dir.to_str().unwrap()],
            vec!["--make-rshared", dir.to_str().unwrap()],
        ] {
            let ok = std::process::Command::new("mount").args(&args).status().unwrap().success();
            assert!(ok, "mount {args:?}");
        }
        SharedDir(dir.to_owned())
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-R").arg("-l").arg(&self.0).status();
    }
}
