//! Where a registry host is reached, in containerd's `hosts.toml` layout: under `config_path`,
//! `<host[:port]>/hosts.toml` (else `_default/hosts.toml`) lists mirrors (`[host."URL"]`, tried
//! in order, each with `capabilities`, `skip_verify`, `ca`, `client` and `header`) and the
//! upstream `server`.

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
    /// The client certificate this host asks for (mutual TLS), and its key when that is in a
    /// file of its own.
    pub client: Option<(PathBuf, Option<PathBuf>)>,
    /// Headers sent with every request to this host (`[host."URL".header]`).
    pub headers: Vec<(String, String)>,
    /// Can resolve tags to digests (manifests by tag).
    pub resolve: bool,
    /// Can serve content by digest.
    pub pull: bool,
    /// Takes uploads.
    pub push: bool,
}

/// A `hosts.toml`: the upstream's settings at the top level, mirrors under `[host."URL"]`.
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
    client: Option<ClientSetting>,
    header: Option<std::collections::BTreeMap<String, OneOrMany>>,
}

/// `client = "both.pem"` (certificate and key in one file), or a list whose items are such
/// files or `["cert.pem", "key.pem"]` pairs, as containerd takes it; the first is used.
#[derive(Deserialize, Clone)]
#[serde(untagged)]
enum ClientSetting {
    One(String),
    Many(Vec<ClientItem>),
}

#[derive(Deserialize, Clone)]
#[serde(untagged)]
enum ClientItem {
    Both(String),
    Pair(Vec<String>),
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
        // Relative `ca` paths are read from the hosts.toml's own directory, as containerd does.
        parse_hosts(&text, host, path.parent().unwrap_or(Path::new("."))).map_err(err)
    }
}

/// The endpoints a `hosts.toml` of text `text`, in directory `dir`, gives `host`: mirrors in
/// the order written, then the upstream. Each has a base that is an HTTP or HTTPS URL.
pub fn parse_hosts(text: &str, host: &str, dir: &Path) -> Result<Vec<Endpoint>, String> {
    let parsed: HostsFile = toml::from_str(text).map_err(|e| e.message().to_owned())?;
    let mut out = Vec::new();
    for (url, entry) in &parsed.host.0 {
        out.push(endpoint(url, entry, dir)?);
    }
    // Without `server`, the top-level settings (a `_default` file's `ca`, `client`, ...)
    // are the default endpoint's, as containerd applies them.
    let server = match &parsed.server {
        Some(url) => url.clone(),
        None => default_endpoint(host).base.trim_end_matches("/v2").to_owned(),
    };
    out.push(endpoint(&server, &parsed.upstream, dir)?);
    Ok(out)
}

fn endpoint(url: &str, entry: &HostEntry, dir: &Path) -> Result<Endpoint, String> {
    // `mirror.corp:5000`, without a scheme, is HTTPS, as containerd takes it.
    let url = if url.contains("://") { url.to_owned() } else { format!("https://{url}") };
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(format!("host {url:?} must start with http:// or https://"));
    }
    // Refused here, naming the file, rather than at the first pull with an error of the
    // HTTP client's about some request.
    match reqwest::Url::parse(&url) {
        Ok(u) if u.host_str().is_some_and(|h| !h.is_empty()) => {}
        _ => return Err(format!("host {url:?} is not a URL with a host name")),
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
    let pair = |files: &[String]| match files {
        [both] => Ok((dir.join(both), None)),
        [cert, key] if key.is_empty() => Ok((dir.join(cert), None)),
        [cert, key] => Ok((dir.join(cert), Some(dir.join(key)))),
        _ => Err(format!("client of {url:?} must be a file, or a [certificate, key] pair")),
    };
    let client = match &entry.client {
        None => None,
        Some(ClientSetting::One(p)) => Some((dir.join(p), None)),
        Some(ClientSetting::Many(items)) => match items.first() {
            None => None,
            Some(ClientItem::Both(p)) => Some((dir.join(p), None)),
            Some(ClientItem::Pair(files)) => Some(pair(files)?),
        },
    };
    let mut headers = Vec::new();
    for (name, values) in entry.header.iter().flatten() {
        let values = match values {
            OneOrMany::One(v) => std::slice::from_ref(v),
            OneOrMany::Many(vs) => vs.as_slice(),
        };
        for v in values {
            let valid = reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_ok()
                && reqwest::header::HeaderValue::from_str(v).is_ok();
            if !valid {
                return Err(format!("header {name:?} of {url:?} is not a valid HTTP header"));
            }
            headers.push((name.clone(), v.clone()));
        }
    }
    Ok(Endpoint {
        base,
        skip_verify: entry.skip_verify.unwrap_or(false),
        ca,
        client,
        headers,
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
    Endpoint {
        base,
        skip_verify: false,
        ca: vec![],
        client: None,
        headers: vec![],
        resolve: true,
        pull: true,
        push: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config dir holding `toml` as the hosts.toml of `host`; gives the dir and the host's dir.
    fn hosts_dir(host: &str, toml: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join(host);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("hosts.toml"), toml).unwrap();
        (dir, d)
    }

    #[test]
    fn hosts_toml_gives_mirrors_in_order_then_the_server() {
        let (dir, d) = hosts_dir(
            "registry.example:5000",
            "server = \"https://registry.example:5000\"\n\
             [host.\"http://mirror-b:5000\"]\n  capabilities = [\"pull\"]\n\
             [host.\"https://mirror-a\"]\n  capabilities = [\"pull\", \"resolve\"]\n  skip_verify = true\n\
             ca = \"mirror-a.pem\"\n",
        );
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
        let (dir, _) = hosts_dir(
            "reg.corp",
            "server = \"reg.corp\"\n[host.\"mirror.corp:5000\"]\n  capabilities = [\"Pull\", \"RESOLVE\"]\n",
        );
        let e = Hosts::new(Some(dir.path())).endpoints("reg.corp").unwrap();
        let bases: Vec<&str> = e.iter().map(|e| e.base.as_str()).collect();
        assert_eq!(bases, ["https://mirror.corp:5000/v2", "https://reg.corp/v2"]);
        assert!(e[0].pull && e[0].resolve && !e[0].push);
    }

    #[test]
    fn client_certificates_and_headers_are_read_as_containerd_writes_them() {
        let (dir, d) = hosts_dir(
            "reg.corp",
            "server = \"https://reg.corp\"\nclient = \"both.pem\"\n\
             [host.\"https://a.corp\"]\n  client = [[\"a.crt\", \"a.key\"]]\n\
               [host.\"https://a.corp\".header]\n    x-api-key = \"k1\"\n    x-multi = [\"v1\", \"v2\"]\n\
             [host.\"https://b.corp\"]\n  client = [[\"/etc/b.crt\", \"/etc/b.key\"], [\"other.crt\", \"\"]]\n\
             [host.\"https://c.corp\"]\n  client = [\"c-both.pem\", \"c-other.pem\"]\n",
        );
        let e = Hosts::new(Some(dir.path())).endpoints("reg.corp").unwrap();
        assert_eq!(e[0].client, Some((d.join("a.crt"), Some(d.join("a.key")))));
        let headers: Vec<(&str, &str)> = e[0].headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        assert_eq!(headers, [("x-api-key", "k1"), ("x-multi", "v1"), ("x-multi", "v2")]);
        assert_eq!(e[1].client, Some(("/etc/b.crt".into(), Some("/etc/b.key".into()))));
        // A list of strings is of files that each hold a certificate and its key.
        assert_eq!(e[2].client, Some((d.join("c-both.pem"), None)));
        assert_eq!(e[3].client, Some((d.join("both.pem"), None)));
        assert!(e[3].headers.is_empty());
        std::fs::write(d.join("hosts.toml"), "[host.\"https://a.corp\".header]\n  \"bad header\" = \"v\"\n").unwrap();
        let err = Hosts::new(Some(dir.path())).endpoints("reg.corp").unwrap_err().to_string();
        assert!(err.contains("not a valid HTTP header"), "{err}");
    }

    #[test]
    fn top_level_settings_without_a_server_are_the_default_endpoints() {
        let (dir, d) = hosts_dir("_default", "ca = \"corp-ca.pem\"\n[header]\n  x-team = \"ml\"\n");
        let e = Hosts::new(Some(dir.path())).endpoints("reg.corp").unwrap();
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].base, "https://reg.corp/v2");
        assert_eq!(e[0].ca, [d.join("corp-ca.pem")]);
        assert_eq!(e[0].headers, [("x-team".to_owned(), "ml".to_owned())]);
        let e = Hosts::new(Some(dir.path())).endpoints("docker.io").unwrap();
        assert_eq!(e[0].base, "https://registry-1.docker.io/v2");
        let e = Hosts::new(Some(dir.path())).endpoints("127.0.0.1:5000").unwrap();
        assert_eq!(e[0].base, "http://127.0.0.1:5000/v2", "loopback stays plain HTTP");
    }

    #[test]
    fn a_bad_hosts_toml_names_the_file_and_the_problem() {
        let (dir, _) = hosts_dir("_default", "server = \"ftp://x\"\n");
        let e = Hosts::new(Some(dir.path())).endpoints("any.io").unwrap_err().to_string();
        assert!(e.contains("_default/hosts.toml") && e.contains("http:// or https://"), "{e}");
    }

    #[test]
    fn a_host_that_is_no_url_is_refused_when_the_file_is_read() {
        for url in ["http://", "https://exa mple:5000", "http://host:99999"] {
            let toml = format!("[host.{url:?}]\ncapabilities = [\"pull\"]\n");
            let e = parse_hosts(&toml, "registry.test", Path::new("/d")).unwrap_err();
            assert_eq!(e, format!("host {url:?} is not a URL with a host name"));
        }
        assert_eq!(parse_hosts("", "registry.test", Path::new("/d")).unwrap()[0].base, "https://registry.test/v2");
    }
}
