//! The CSI manifests of `deploy/kubernetes/` against what the plugin does: the driver's name,
//! the socket that node-driver-registrar and the liveness probe dial, the kubelet dirs the
//! agent mounts in, and every volume's attributes and Secret, read as a publish reads them.

mod common;

use common::kube;
use serde_json::Value;
use std::path::Path;
use strata_csi::DRIVER_NAME;
use strata_csi::proto::volume_capability::access_mode::Mode;
use strata_csi::proto::volume_capability::{AccessMode, AccessType, MountVolume};
use strata_csi::proto::{NodePublishVolumeRequest, VolumeCapability};
use strata_csi::volume::{SECRET_KEYS, Volume};
use strata_tiering::config::Config;

fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// The host path mounted in `c` that holds `path`, with the mount's propagation.
fn host_dir_of<'a>(pod: &'a Value, c: &'a Value, path: &Path) -> Option<(&'a str, &'a str)> {
    c["volumeMounts"].as_array()?.iter().find_map(|m| {
        let host = kube::volume(pod, m["name"].as_str()?)["hostPath"]["path"].as_str()?;
        (path.starts_with(host) && m["mountPath"] == host)
            .then(|| (host, m["mountPropagation"].as_str().unwrap_or("None")))
    })
}

/// Reads `attrs` and `secret` as a publish of them would, in `mode`.
fn publish_of(attrs: &Value, secret: Option<&Value>, mode: Mode, readonly: bool) -> Result<Volume, String> {
    let map = |v: &Value| {
        v.as_object()
            .map(|o| o.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned())).collect())
            .unwrap_or_default()
    };
    let req = NodePublishVolumeRequest {
        volume_id: "v".into(),
        target_path: "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/v/mount".into(),
        volume_capability: Some(VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }),
        readonly,
        volume_context: map(attrs),
        secrets: secret.map(|s| map(&s["stringData"])).unwrap_or_default(),
        ..Default::default()
    };
    Volume::from_request(&req).map_err(|e| e.to_string())
}

#[test]
fn the_csi_manifests_agree_with_the_plugin() {
    let docs = kube::manifests();
    let driver = kube::find(&docs, "CSIDriver", DRIVER_NAME);
    assert_eq!(driver["spec"]["attachRequired"], false, "there is nothing to attach");
    let modes = kube::strings(&driver["spec"]["volumeLifecycleModes"]);
    assert!(modes.contains(&"Persistent".into()) && modes.contains(&"Ephemeral".into()), "{modes:?}");

    let cm = kube::find(&docs, "ConfigMap", "strata-config");
    let config = Config::from_toml(cm["data"]["config.toml"].as_str().unwrap()).unwrap();
    let csi = config.csi.as_ref().expect("the agent serves the CSI plugin");
    let ds = kube::find(&docs, "DaemonSet", "strata");
    let pod = kube::pod_spec(ds);
    let account = kube::find(&docs, "ServiceAccount", pod["serviceAccountName"].as_str().unwrap());
    assert_eq!(account["metadata"]["namespace"], ds["metadata"]["namespace"]);
    let agent = container(pod, "strata");
    let registrar = container(pod, "node-driver-registrar");
    let probe = container(pod, "liveness-probe");

    // The socket the agent serves is on the host, where the registrar (and through it
    // kubelet) and the liveness probe dial it.
    let socket = csi.socket.to_str().unwrap();
    for c in [agent, registrar, probe] {
        assert!(host_dir_of(pod, c, &csi.socket).is_some(), "{} does not see {socket}", c["name"]);
    }
    let args = kube::strings(&registrar["args"]);
    assert!(args.contains(&format!("--csi-address={socket}")), "{args:?}");
    assert!(args.contains(&format!("--kubelet-registration-path={socket}")), "{args:?}");
    assert!(host_dir_of(pod, registrar, Path::new("/var/lib/kubelet/plugins_registry/x")).is_some());
    let probe_args = kube::strings(&probe["args"]);
    assert!(probe_args.contains(&format!("--csi-address={socket}")), "{probe_args:?}");
    let port = agent["livenessProbe"]["httpGet"]["port"].to_string();
    assert!(probe_args.contains(&format!("--health-port={port}")), "{probe_args:?} vs {port}");

    // Targets are under kubelet's pods dir: mounted there, they must reach the host.
    let (_, propagation) = host_dir_of(pod, agent, Path::new("/var/lib/kubelet/pods/u/volumes"))
        .expect("the agent mounts kubelet's pods dir");
    assert_eq!(propagation, "Bidirectional");
    let node_name =
        agent["env"].as_array().unwrap().iter().find(|e| e["name"] == "NODE_NAME").expect("NODE_NAME is set");
    assert_eq!(node_name["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName");

    // Every volume of the driver publishes as written: a PersistentVolume with its claim and
    // Secret, and every inline volume of a pod.
    let secret_of = |r: &Value| {
        (!r.is_null()).then(|| {
            let s = docs
                .iter()
                .find(|d| {
                    d["kind"] == "Secret"
                        && d["metadata"]["name"] == r["name"]
                        && d["metadata"]["namespace"] == r["namespace"]
                })
                .unwrap_or_else(|| panic!("no Secret {r}"));
            for k in s["stringData"].as_object().unwrap().keys() {
                assert!(SECRET_KEYS.contains(&k.as_str()), "the plugin does not read key `{k}` of {r}");
            }
            s
        })
    };
    let mut published = 0;
    for pv in docs.iter().filter(|d| d["kind"] == "PersistentVolume" && d["spec"]["csi"]["driver"] == DRIVER_NAME) {
        let spec = &pv["spec"];
        let readonly = spec["csi"]["readOnly"] == true;
        let mode = if kube::strings(&spec["accessModes"]) == ["ReadOnlyMany"] {
            Mode::MultiNodeReaderOnly
        } else {
            Mode::MultiNodeMultiWriter
        };
        let v = publish_of(
            &spec["csi"]["volumeAttributes"],
            secret_of(&spec["csi"]["nodePublishSecretRef"]),
            mode,
            readonly,
        )
        .unwrap_or_else(|e| panic!("PersistentVolume {}: {e}", pv["metadata"]["name"]));
        assert!(!v.writable || !readonly);
        let claim = &spec["claimRef"];
        let pvc = docs
            .iter()
            .find(|d| {
                d["kind"] == "PersistentVolumeClaim"
                    && d["metadata"]["name"] == claim["name"]
                    && d["metadata"]["namespace"] == claim["namespace"]
            })
            .expect("the PersistentVolume's claim is there");
        assert_eq!(pvc["spec"]["volumeName"], pv["metadata"]["name"]);
        assert_eq!(pvc["spec"]["storageClassName"], "", "a static volume binds by name, not through a class");
        published += 1;
    }
    for job in docs.iter().filter(|d| d["kind"] == "Job") {
        for vol in kube::pod_spec(job)["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|v| v["csi"]["driver"] == DRIVER_NAME)
        {
            let readonly = vol["csi"]["readOnly"] == true;
            publish_of(&vol["csi"]["volumeAttributes"], None, Mode::SingleNodeWriter, readonly)
                .unwrap_or_else(|e| panic!("inline volume {} of {}: {e}", vol["name"], job["metadata"]["name"]));
            published += 1;
        }
        for claim in kube::pod_spec(job)["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v["persistentVolumeClaim"]["claimName"].as_str())
        {
            assert!(
                docs.iter().any(|d| d["kind"] == "PersistentVolumeClaim"
                    && d["metadata"]["name"] == claim
                    && d["metadata"]["namespace"] == job["metadata"]["namespace"]),
                "Job {} claims {claim}, which is not there",
                job["metadata"]["name"]
            );
        }
    }
    assert!(published >= 2, "the examples have a PersistentVolume and an inline volume");
}
