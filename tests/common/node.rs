//! A node for end-to-end tests: a `strata daemon` serving the snapshotter, and a containerd
//! 1.6 of its own that uses it as the `strata` proxy plugin.

use super::containerd::{Containerd, registry};
use super::{BIN, Daemon};
use std::path::PathBuf;

pub struct Node {
    pub daemon: Daemon,
    pub containerd: Containerd,
    dir: tempfile::TempDir,
}

impl Node {
    pub fn start() -> Node {
        Node::start_with("")
    }

    /// A node whose `[snapshotter]` section also has `extra`.
    pub fn start_with(extra: &str) -> Node {
        Node::start_full(extra, false)
    }

    /// A node whose containerd also runs its CRI plugin, as on a Kubernetes node.
    pub fn start_cri() -> Node {
        Node::start_full("", true)
    }

    /// As [`Node::start_cri`], with Strata also serving the CRI image service that kubelet
    /// would be pointed at ([`Node::image_service`]), forwarding to this node's containerd.
    pub fn start_cri_with_image_service() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let extra = format!(
            "image_service_socket = \"{}\"\ncontainerd_socket = \"{}\"\n",
            dir.path().join("image.sock").display(),
            dir.path().join("containerd.sock").display()
        );
        Node::start_in(dir, &extra, true)
    }

    /// Strata's CRI image service socket, with [`Node::start_cri_with_image_service`].
    pub fn image_service(&self) -> PathBuf {
        self.dir.path().join("image.sock")
    }

    pub fn start_full(extra: &str, cri: bool) -> Node {
        Node::start_in(tempfile::tempdir().unwrap(), extra, cri)
    }

    /// A node whose daemon runs under `strata supervise`, keeping its mounts across restarts.
    pub fn start_supervised() -> Node {
        Node::start_as(tempfile::tempdir().unwrap(), "", false, true)
    }

    fn start_in(dir: tempfile::TempDir, extra: &str, cri: bool) -> Node {
        Node::start_as(dir, extra, cri, false)
    }

    fn start_as(dir: tempfile::TempDir, extra: &str, cri: bool, supervised: bool) -> Node {
        let socket = dir.path().join("strata-snapshotter.sock");
        let config = format!("[snapshotter]\nenabled = true\nsocket = \"{}\"\n{extra}\n", socket.display());
        let daemon = if supervised {
            Daemon::start_supervised(&config, "1GiB", "1GiB")
        } else {
            Daemon::start(&config, "1GiB", "1GiB")
        };
        let containerd = Containerd::start_with(dir.path(), &socket, cri);
        Node { daemon, containerd, dir }
    }

    pub fn ctr(&self, args: &[&str]) -> String {
        self.containerd.ctr_ok(args, &self.daemon.log())
    }

    /// `strata image layers --json`, from the daemon's admin socket.
    pub fn layers_report(&self) -> Vec<serde_json::Value> {
        let out = std::process::Command::new(BIN)
            .args(["image", "layers", "--json", "--socket"])
            .arg(&self.daemon.socket)
            .output()
            .unwrap();
        assert!(out.status.success(), "strata image layers: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The report of layer `digest`, once `done` holds for it (at most 30 s).
    pub fn layer_when(&self, digest: &str, done: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let report = self.layers_report();
            if let Some(l) = report.iter().find(|l| l["layer"] == digest && done(l)) {
                return l.clone();
            }
            assert!(std::time::Instant::now() < deadline, "layer {digest} never got there: {report:#?}");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    pub fn snapshots_root(&self) -> PathBuf {
        self.daemon.state().join("state/snapshotter")
    }

    /// Pulls `reference` (under the test registry's `strata/`) lazily, as stargz users do.
    pub fn rpull(&self, reference: &str) -> String {
        let image = format!("{}/strata/{reference}", registry());
        let out = self.containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", &image]);
        assert!(
            out.status.success(),
            "rpull {image}: {}\n--- strata log ---\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.daemon.log()
        );
        image
    }

    /// Runs `cmd` in a new container of `image` on Strata, and returns what it wrote to its
    /// standard output, through a file rather than `ctr` (see [`Containerd::run_captured`]:
    /// `ctr run` can lose the output of a container that exits at once).
    pub fn run_out(&self, image: &str, name: &str, cmd: &[&str]) -> String {
        let quoted: Vec<String> = cmd.iter().map(|a| format!("'{}'", a.replace('\'', "'\\''"))).collect();
        self.containerd.run_captured("strata", image, name, &quoted.join(" "), &self.daemon.log())
    }

    /// Runs `script` with sh in a new container of `image` on Strata, and returns its output.
    pub fn run_sh(&self, image: &str, name: &str, script: &str) -> String {
        self.ctr(&["run", "--rm", "--snapshotter", "strata", image, name, "sh", "-c", script])
    }

    /// The digests of `image`'s layers, from the registry's manifest.
    pub fn layer_digests(&self, reference: &str) -> Vec<String> {
        let url = format!(
            "http://{}/v2/strata/{}/manifests/{}",
            registry(),
            reference.split(':').next().unwrap(),
            reference.split(':').nth(1).unwrap()
        );
        let out = std::process::Command::new("curl")
            .args(["-fsS", "-H", "Accept: application/vnd.oci.image.manifest.v1+json", &url])
            .output()
            .unwrap();
        let m: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        m["layers"].as_array().unwrap().iter().map(|l| l["digest"].as_str().unwrap().to_string()).collect()
    }

    pub fn pull(&self) -> String {
        let image = format!("{}/strata/busybox:1", registry());
        self.ctr(&["images", "pull", "--plain-http", "--snapshotter", "strata", &image]);
        image
    }
}
