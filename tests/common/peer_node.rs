//! A node of a test cluster that starts lazy images: a `strata daemon` in a network namespace of
//! its own, serving the snapshotter and the peer tier, with a containerd of its own (in the
//! host's namespaces, dialling the daemon's socket) and a `hosts.toml` that sends the test
//! registry's host to a relay on the bridge.

use super::containerd::{Containerd, registry};
use super::netns::Net;
use super::{BIN, Daemon};

pub const PEER_PORT: u16 = 7470;
pub const METRICS_PORT: u16 = 9464;
/// Where a node's `[mirror]` listens, on its address on the bridge.
pub const MIRROR_PORT: u16 = 5050;

/// A containerd hosts dir for node `i`, under `dir`: `upstream`, with the node's mirror
/// before it for pulls and tags.
pub fn mirror_hosts(dir: &std::path::Path, i: usize, upstream: &str) -> std::path::PathBuf {
    let d = dir.join(format!("hosts-{i}"));
    std::fs::create_dir_all(d.join(upstream)).unwrap();
    let toml = format!(
        "server = \"http://{upstream}\"\n[host.\"http://{}:{MIRROR_PORT}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
        Net::addr(i)
    );
    std::fs::write(d.join(upstream).join("hosts.toml"), toml).unwrap();
    d
}

pub struct ImageNode {
    pub daemon: Daemon,
    pub containerd: Containerd,
    _dir: tempfile::TempDir,
}

impl ImageNode {
    /// Node `i` of `n`, reaching the registry at `registry_via`, with the cluster's secret at
    /// `secret`.
    pub fn start(i: usize, n: usize, net: &Net, secret: &std::path::Path, registry_via: &str) -> ImageNode {
        ImageNode::start_with(i, n, net, secret, &[(registry(), registry_via.to_owned())], "")
    }

    /// As [`ImageNode::start`], reaching each registry `routes` names (its loopback address)
    /// at its relay, with `extra` at the end of the daemon's config. Its metrics are served at
    /// [`ImageNode::metrics_text`].
    pub fn start_with(
        i: usize,
        n: usize,
        net: &Net,
        secret: &std::path::Path,
        routes: &[(String, String)],
        extra: &str,
    ) -> ImageNode {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("admin.sock");
        let config = dir.path().join("config.toml");
        let snapshotter = dir.path().join("snapshotter.sock");
        // An image's host is its registry's loopback address; this node reaches it at a relay.
        for (host, via) in routes {
            let hosts = dir.path().join("hosts").join(host);
            std::fs::create_dir_all(&hosts).unwrap();
            std::fs::write(hosts.join("hosts.toml"), format!("server = \"http://{via}\"\n")).unwrap();
        }
        let members: Vec<String> = (0..n).map(|j| format!("\"{}:{PEER_PORT}\"", Net::addr(j))).collect();
        let text = format!(
            "state_dir = \"{state}\"\n[admin]\nsocket = \"{sock}\"\n[metrics]\nlisten = \"{addr}:{METRICS_PORT}\"\n\
             [tiers.hot]\ncapacity = \"4GiB\"\n[tiers.warm]\ncapacity = \"0\"\n\
             [snapshotter]\nenabled = true\nsocket = \"{snapshotter}\"\nhosts_dir = \"{hosts}\"\n\
             [peers]\nmembers = [{members}]\nlisten = \"{addr}:{PEER_PORT}\"\nadvertise = \"{addr}:{PEER_PORT}\"\n\
             secret_file = \"{secret}\"\n{extra}\n",
            state = dir.path().join("state").display(),
            sock = socket.display(),
            snapshotter = snapshotter.display(),
            hosts = dir.path().join("hosts").display(),
            members = members.join(", "),
            addr = Net::addr(i),
            secret = secret.display(),
        );
        std::fs::write(&config, text).unwrap();
        let own = tempfile::tempdir().unwrap();
        let daemon = Daemon::with_config_in(dir, config, socket, Some(net.ns(i)));
        let containerd = Containerd::start(own.path(), &snapshotter);
        ImageNode { daemon, containerd, _dir: own }
    }

    /// Pulls `image` lazily and runs `script` with sh in a container of it: what it printed.
    pub fn start_container(&self, image: &str, name: &str, script: &str) -> String {
        self.start_container_via(image, name, script, None)
    }

    /// As [`ImageNode::start_container`], with containerd's hosts.toml files in `hosts` (a
    /// mirror) when given.
    pub fn start_container_via(
        &self,
        image: &str,
        name: &str,
        script: &str,
        hosts: Option<&std::path::Path>,
    ) -> String {
        let mut args = vec!["image".to_owned(), "rpull".into(), "--plain-http".into(), "--snapshotter".into()];
        args.push("strata".into());
        if let Some(h) = hosts {
            args.extend(["--hosts-dir".into(), h.display().to_string()]);
        }
        args.push(image.to_owned());
        let out = self.containerd.ctr_remote(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let log = self.daemon.log();
        assert!(out.status.success(), "rpull {image}: {}\n{log}", String::from_utf8_lossy(&out.stderr));
        self.containerd.run_captured("strata", image, name, script, &log)
    }

    /// The daemon's Prometheus metrics, from its address on the bridge.
    pub fn metrics_text(&self, i: usize) -> String {
        let url = format!("http://{}:{METRICS_PORT}/metrics", Net::addr(i));
        let out = std::process::Command::new("curl").args(["-fsS", &url]).output().unwrap();
        assert!(out.status.success(), "{url}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// The value of counter `name` in the daemon's metrics (0 when absent).
    pub fn counter(&self, i: usize, name: &str) -> u64 {
        let text = self.metrics_text(i);
        let line =
            text.lines().find(|l| l.starts_with(&format!("{name}_total ")) || l.starts_with(&format!("{name} ")));
        line.and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).map_or(0, |v| v as u64)
    }

    /// `strata image layers --json`.
    pub fn layers(&self) -> Vec<serde_json::Value> {
        let out = std::process::Command::new(BIN)
            .args(["image", "layers", "--json", "--socket"])
            .arg(&self.daemon.socket)
            .output()
            .unwrap();
        assert!(out.status.success(), "strata image layers: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The layer reports once every layer is fetched whole (at most `limit`).
    pub fn layers_done(&self, limit: std::time::Duration) -> Vec<serde_json::Value> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let report = self.layers();
            if !report.is_empty() && report.iter().all(|l| l["background"] == "done") {
                return report;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the layers were never all fetched: {report:#?}\n{}",
                self.daemon.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(250));
        }
    }
}
