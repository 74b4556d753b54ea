//! Where a registry host is reached, in containerd's `hosts.toml` layout: under `config_path`,
//! `<host[:port]>/hosts.toml` (else `_default/hosts.toml`) lists mirrors (`[host."URL"]`, tried
//! in order, each with `capabilities`, `skip_verify` and `ca`) and the upstream `server`.

use super::RegistryError;
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Base URL the API paths go under, e.g. `http://127.0.0.1:5000/v2`.
    pub base: String,
    pub skip_verify: bool,
    /// PEM files of certificate authorities trusted for this host, beside the system's.
    pub ca: Vec<PathBuf>,
    /// Can resolve tags to digests (manifests by tag).
    pub resolve: bool,
    /// Can serve content by digest.
    pub pull: bool,
    /// Takes uploads.
    pub push: bool,
}

/// A `hosts.toml`: the upstream's settings at the top level, mirrors under `[host."URL"]`.
/// Keys Strata does not use (`client`, `header`) are accepted and ignored, so files written for
/// containerd load.
#[derive(Deserialize, Default)]
struct HostsFile {
    server: Option<String>,
    #[serde(flatten)]
    upstream: HostEntry,
    #[serde(default)]
    host: toml_ordered::Hosts,
}

#[derive(Deserialize, Default, Clone)]
struct HostEntry {
    capabilities: Option<Vec<String>>,
    skip_verify: Option<bool>,
    override_path: Option<bool>,
    ca: Option<OneOrMany>,
}

/// `ca = "a.pem"` or `ca = ["a.pem", "b.pem"]`, as containerd takes it.
#[derive(Deserialize, Clone)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// `[host."URL"]` tables keep their file order: mirrors are tried in the order written.
mod toml_ordered {
    use super::HostEntry;
    use serde::de::{Deserializer, MapAccess, Visitor};

    #[derive(Default)]
    pub struct Hosts(pub Vec<(String, HostEntry)>);

    impl<'de> serde::Deserialize<'de> for Hosts {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Hosts, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Hosts;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a table of host URLs")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Hosts, A::Error> {
                    let mut out = Vec::new();
                    while let Some((k, v)) = m.next_entry::<String, HostEntry>()? {
                        out.push((k, v));
                    }
                    Ok(Hosts(out))
                }
            }
            d.deserialize_map(V)
        }
    }
}

/// Registry host configuration under one `config_path` (none: defaults only).
#[derive(Debug, Clone, Default)]
pub struct Hosts {
    config_path: Option<PathBuf>,
}

impl Hosts {
    pub fn new(config_path: Option<&Path>) -> Hosts {
        Hosts { config_path: config_path.map(Path::to_owned) }
    }

    /// The endpoints for `host`, mirrors first, then the upstream.
    pub fn endpoints(&self, host: &str) -> Result<Vec<Endpoint>, RegistryError> {
        let file = self.config_path.as_ref().and_then(|dir| {
            [dir.join(host).join("hosts.toml"), dir.join("_default").join("hosts.toml")]
                .into_iter()
                .find(|p| p.is_file())
        });
        let Some(path) = file else { return Ok(vec![default_endpoint(host)]) };
        let err = |reason: String| RegistryError::Config { path: path.display().to_string(), reason };
        let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
        let parsed: HostsFile = toml::from_str(&text).map_err(|e| err(e.message().to_owned()))?;
        // Relative `ca` paths are read from the hosts.toml's own directory, as containerd does.
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut out = Vec::new();
        for (url, entry) in &parsed.host.0 {
            out.push(endpoint(url, entry, dir).map_err(&err)?);
        }
        match &parsed.server {
            Some(url) => out.push(endpoint(url, &parsed.upstream, dir).map_err(&err)?),
            None => out.push(default_endpoint(host)),
        }
        Ok(out)
    }
}

fn endpoint(url: &str, entry: &HostEntry, dir: &Path) -> Result<Endpoint, String> {
    // `mirror.corp:5000`, without a scheme, is HTTPS, as containerd takes it.
    let url = if url.contains("://") { url.to_owned() } else { format!("https://{url}") };
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(format!("host {url:?} must start with http:// or https://"));
    }
    let trimmed = url.trim_end_matches('/');
    let base = if entry.override_path == Some(true) || trimmed.ends_with("/v2") {
        trimmed.to_owned()
    } else {
        format!("{trimmed}/v2")
    };
    // Any case, as containerd reads them.
    let caps: Vec<String> = entry
        .capabilities
        .as_deref()
        .map(|c| c.iter().map(|c| c.to_ascii_lowercase()).collect())
        .unwrap_or_else(|| ["pull", "resolve", "push"].map(String::from).to_vec());
    let caps: Vec<&str> = caps.iter().map(String::as_str).collect();
    for c in &caps {
        if !matches!(*c, "pull" | "resolve" | "push") {
            return Err(format!("capability {c:?} of {url:?} is not pull, resolve or push"));
        }
    }
    let ca = match &entry.ca {
        None => vec![],
        Some(OneOrMany::One(p)) => vec![dir.join(p)],
        Some(OneOrMany::Many(ps)) => ps.iter().map(|p| dir.join(p)).collect(),
    };
    Ok(Endpoint {
        base,
        skip_verify: entry.skip_verify.unwrap_or(false),
        ca,
        resolve: caps.contains(&"resolve"),
        pull: caps.contains(&"pull"),
        push: caps.contains(&"push"),
    })
}

/// Whether registry `host` (`name[:port]`) is on loopback, where containerd speaks plain HTTP
/// by default.
pub fn is_loopback(host: &str) -> bool {
    let name = host.rsplit_once(':').map(|(h, _)| h).unwrap_or(host);
    matches!(name, "localhost" | "127.0.0.1" | "[::1]") || name.starts_with("127.")
}

/// Without configuration: HTTPS, except loopback registries, which speak plain HTTP as
/// containerd lets them by default.
fn default_endpoint(host: &str) -> Endpoint {
    let base = match host {
        "docker.io" => "https://registry-1.docker.io/v2".to_owned(),
        h if is_loopback(h) => format!("http://{h}/v2"),
        h => format!("https://{h}/v2"),
    };
    Endpoint { base, skip_verify: false, ca: vec![], resolve: true, pull: true, push: true }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_toml_gives_mirrors_in_order_then_the_server() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("registry.example:5000");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("hosts.toml"),
            "server = \"https://registry.example:5000\"\n\
             [host.\"http://mirror-b:5000\"]\n  capabilities = [\"pull\"]\n\
             [host.\"https://mirror-a\"]\n  capabilities = [\"pull\", \"resolve\"]\n  skip_verify = true\n\
             ca = \"mirror-a.pem\"\n",
        )
        .unwrap();
        let e = Hosts::new(Some(dir.path())).endpoints("registry.example:5000").unwrap();
        let bases: Vec<&str> = e.iter().map(|e| e.base.as_str()).collect();
        assert_eq!(bases, ["http://mirror-b:5000/v2", "https://mirror-a/v2", "https://registry.example:5000/v2"]);
        assert!(!e[0].resolve && e[0].pull && !e[0].skip_verify);
        assert!(e[1].resolve && e[1].skip_verify);
        // A relative `ca` is read beside the hosts.toml.
        assert_eq!(e[1].ca, [d.join("mirror-a.pem")]);
        assert!(e[0].ca.is_empty());
        // No file for this host and no _default: the defaults.
        let e = Hosts::new(Some(dir.path())).endpoints("127.0.0.1:5000").unwrap();
        assert_eq!(e[0].base, "http://127.0.0.1:5000/v2");
        assert_eq!(Hosts::new(None).endpoints("docker.io").unwrap()[0].base, "https://registry-1.docker.io/v2");
        assert_eq!(Hosts::new(None).endpoints("ghcr.io").unwrap()[0].base, "https://ghcr.io/v2");
    }

    /// As containerd reads a hosts.toml: a host without a scheme is HTTPS, and capabilities
    /// are taken in any case.
    #[test]
    fn hosts_without_a_scheme_are_https_and_capabilities_any_case() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("reg.corp");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("hosts.toml"),
            "server = \"reg.corp\"\n[host.\"mirror.corp:5000\"]\n  capabilities = [\"Pull\", \"RESOLVE\"]\n",
        )
        .unwrap();
        let e = Hosts::new(Some(dir.path())).endpoints("reg.corp").unwrap();
        let bases: Vec<&str> = e.iter().map(|e| e.base.as_str()).collect();
        assert_eq!(bases, ["https://mirror.corp:5000/v2", "https://reg.corp/v2"]);
        assert!(e[0].pull && e[0].resolve && !e[0].push);
    }

    #[test]
    fn a_bad_hosts_toml_names_the_file_and_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("_default");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("hosts.toml"), "server = \"ftp://x\"\n").unwrap();
        let e = Hosts::new(Some(dir.path())).endpoints("any.io").unwrap_err().to_string();
        assert!(e.contains("_default/hosts.toml") && e.contains("http:// or https://"), "{e}");
    }
}
