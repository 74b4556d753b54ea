//! `[peers]`: the peer tier's settings. Without the section a node fetches only from its
//! origin, as it always has.

use super::client::Timeouts;
use super::fetcher::FailoverOptions;
use super::members::{MemberSource, parse_member};
use crate::PathPattern;
use crate::units::Dur;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeersConfig {
    /// Every member, this node included, as `host:port` with an optional weight after it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<String>,
    /// A file of members, one a line, re-read when it changes.
    #[serde(default)]
    pub members_file: Option<PathBuf>,
    /// A DNS name that resolves to every member (a headless Service of the DaemonSet); each is
    /// reached at the port of `listen`.
    #[serde(default)]
    pub members_dns: Option<String>,
    /// Where this node serves its peers.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// This node's own name in the member list. Unset: the member whose address is one of
    /// this node's and whose port is that of `listen`.
    #[serde(default)]
    pub advertise: Option<String>,
    /// The cluster's shared secret, 32 bytes or more, the same on every node.
    pub secret_file: PathBuf,
    /// How often `members_file` and `members_dns` are read again.
    #[serde(default = "default_refresh")]
    pub refresh: Dur,
    #[serde(default = "default_connect")]
    pub connect_timeout: Dur,
    /// Until the answer's headers, which a live member sends before it fetches anything.
    #[serde(default = "default_first_byte")]
    pub first_byte_timeout: Dur,
    /// Between two pieces of an answer, and for a ping to be answered.
    #[serde(default = "default_stall")]
    pub stall_timeout: Dur,
    /// From the headers to the first piece: how long a member that answers pings may spend
    /// fetching the chunk from its origin.
    #[serde(default = "default_fetch")]
    pub fetch_timeout: Dur,
    /// How long a member that failed is skipped.
    #[serde(default = "default_suspect")]
    pub suspect_for: Dur,
    /// Members tried for one chunk before the origin is.
    #[serde(default = "default_tries")]
    pub tries: usize,
    /// Members an owner sends one chunk to at once; further askers are sent on to them.
    #[serde(default = "default_fanout")]
    pub hot_fanout: usize,
    /// Paths (prefixes or globs, as in the policy) whose chunks never go to or come from peers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_shared: Vec<PathPattern>,
}

fn default_listen() -> String {
    "0.0.0.0:7470".into()
}
fn default_refresh() -> Dur {
    Dur(Duration::from_secs(5))
}
fn default_connect() -> Dur {
    Dur(Duration::from_millis(250))
}
fn default_first_byte() -> Dur {
    Dur(Duration::from_millis(250))
}
fn default_fetch() -> Dur {
    Dur(Duration::from_secs(30))
}
fn default_stall() -> Dur {
    Dur(Duration::from_secs(2))
}
fn default_suspect() -> Dur {
    Dur(Duration::from_secs(30))
}
fn default_tries() -> usize {
    2
}
fn default_fanout() -> usize {
    4
}

impl PeersConfig {
    /// The first setting that is wrong, as (key under `peers.`, why).
    pub fn validate(&self) -> Result<(), (String, String)> {
        let bad = |key: &str, why: String| Err((format!("peers.{key}"), why));
        let sources = [!self.members.is_empty(), self.members_file.is_some(), self.members_dns.is_some()];
        if sources.iter().filter(|s| **s).count() != 1 {
            return bad("members", "set exactly one of `members`, `members_file` and `members_dns`".into());
        }
        for (i, m) in self.members.iter().enumerate() {
            if let Err(e) = parse_member(m) {
                return bad(&format!("members[{i}]"), e.to_string());
            }
        }
        if self.members_dns.as_deref().is_some_and(|n| n.is_empty() || n.contains([':', '/', ' '])) {
            return bad("members_dns", "must be a bare DNS name; members are reached at the port of `listen`".into());
        }
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return bad("listen", format!("`{}` is not ip:port", self.listen));
        }
        if let Some(a) = &self.advertise
            && let Err(e) = parse_member(a)
        {
            return bad("advertise", e.to_string());
        }
        if !self.secret_file.is_absolute() {
            return bad("secret_file", "must be an absolute path".into());
        }
        for (key, d) in [
            ("refresh", self.refresh),
            ("connect_timeout", self.connect_timeout),
            ("first_byte_timeout", self.first_byte_timeout),
            ("stall_timeout", self.stall_timeout),
            ("fetch_timeout", self.fetch_timeout),
        ] {
            if d.0.is_zero() {
                return bad(key, "must be above 0s".into());
            }
        }
        if !(1..=16).contains(&self.tries) {
            return bad("tries", "must be between 1 and 16".into());
        }
        if !(1..=64).contains(&self.hot_fanout) {
            return bad("hot_fanout", "must be between 1 and 64".into());
        }
        Ok(())
    }

    pub fn listen_port(&self) -> u16 {
        self.listen.parse::<std::net::SocketAddr>().map(|a| a.port()).unwrap_or(0)
    }

    /// Where the member list comes from (the config is valid).
    pub fn source(&self) -> MemberSource {
        match (&self.members_file, &self.members_dns) {
            (Some(f), _) => MemberSource::File(f.clone()),
            (_, Some(name)) => MemberSource::Dns { name: name.clone(), port: self.listen_port() },
            _ => MemberSource::Static(self.members.iter().filter_map(|m| parse_member(m).ok()).collect()),
        }
    }

    pub fn timeouts(&self) -> Timeouts {
        Timeouts {
            connect: self.connect_timeout.0,
            first_byte: self.first_byte_timeout.0,
            stall: self.stall_timeout.0,
            fetch: self.fetch_timeout.0,
        }
    }

    pub fn failover(&self) -> FailoverOptions {
        FailoverOptions { suspect_for: self.suspect_for.0, tries: self.tries }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(toml: &str) -> Result<PeersConfig, String> {
        let c: PeersConfig = toml::from_str(toml).map_err(|e| e.message().to_owned())?;
        c.validate().map_err(|(k, m)| format!("{k}: {m}"))?;
        Ok(c)
    }

    #[test]
    fn one_member_source_and_sound_values_are_required() {
        let c = parse(
            "members = [\"198.18.0.2:7470\", \"198.18.0.3:7470 2\"]\nsecret_file = \"/etc/strata/peer-secret\"\n",
        )
        .unwrap();
        assert_eq!((c.listen_port(), c.tries, c.connect_timeout.0), (7470, 2, Duration::from_millis(250)));
        assert_eq!((c.hot_fanout, c.not_shared.len()), (4, 0));
        let private =
            parse("members = [\"a:1\"]\nsecret_file = \"/s\"\nnot_shared = [\"private/\", \"**/*.key\"]\n").unwrap();
        assert!(private.not_shared[0].matches("private/x") && private.not_shared[1].matches("a/b.key"));
        assert!(matches!(c.source(), MemberSource::Static(m) if m.len() == 2 && m[1].weight == 2.0));
        let dns = parse("members_dns = \"strata-peers.strata.svc\"\nlisten = \"0.0.0.0:7999\"\nsecret_file = \"/s\"\n")
            .unwrap();
        assert_eq!(dns.source(), MemberSource::Dns { name: "strata-peers.strata.svc".into(), port: 7999 });
        for (toml, want) in [
            ("secret_file = \"/s\"\n", "peers.members: set exactly one"),
            ("members = [\"a:1\"]\nmembers_dns = \"x\"\nsecret_file = \"/s\"\n", "peers.members: set exactly one"),
            ("members = [\"a\"]\nsecret_file = \"/s\"\n", "peers.members[0]: member \"a\": is not host:port"),
            ("members_dns = \"x:7470\"\nsecret_file = \"/s\"\n", "peers.members_dns: must be a bare DNS name"),
            ("members = [\"a:1\"]\nlisten = \"any\"\nsecret_file = \"/s\"\n", "peers.listen: `any` is not ip:port"),
            ("members = [\"a:1\"]\nsecret_file = \"s\"\n", "peers.secret_file: must be an absolute path"),
            ("members = [\"a:1\"]\nsecret_file = \"/s\"\ntries = 0\n", "peers.tries: must be between 1 and 16"),
            ("members = [\"a:1\"]\nsecret_file = \"/s\"\nhot_fanout = 0\n", "peers.hot_fanout: must be between 1"),
            (
                "members = [\"a:1\"]\nsecret_file = \"/s\"\nconnect_timeout = \"0s\"\n",
                "peers.connect_timeout: must be above 0s",
            ),
            ("members = [\"a:1\"]\n", "missing field `secret_file`"),
        ] {
            let e = parse(toml).unwrap_err();
            assert!(e.starts_with(want), "{toml:?}: {e}");
        }
    }

    #[test]
    fn the_daemon_config_takes_the_section_and_refuses_a_port_clash() {
        let c = crate::config::Config::from_toml("[peers]\nmembers = [\"a:7470\"]\nsecret_file = \"/s\"\n").unwrap();
        assert_eq!(c.peers.unwrap().members, ["a:7470"]);
        assert!(crate::config::Config::from_toml("").unwrap().peers.is_none(), "no section, no peer tier");
        let e = crate::config::Config::from_toml(
            "[metrics]\nlisten = \"127.0.0.1:7470\"\n[peers]\nmembers = [\"a:7470\"]\nsecret_file = \"/s\"\n",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(e, "config: peers.listen: port 7470 is the metrics endpoint's");
    }
}
