//! Who the members of the peer tier are, from one of three sources: a static list, a file
//! re-read when it changes, or a DNS name that resolves to every member (a Kubernetes headless
//! Service of the DaemonSet, so that Kubernetes stays the source of truth). A source that
//! fails after the start keeps the last list it gave, so that a DNS or disk hiccup does not
//! move every chunk's owner; each new failure is logged once.

use super::placement;
use crate::KeyId;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::watch;
use tracing::{info, warn};

/// One node of the peer tier, named by its peer address as every node names it.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    /// `host:port`: an IP address or a DNS name, and the peer port.
    pub name: String,
    /// Its share of chunks relative to the others': 1.0 unless the list says otherwise.
    pub weight: f64,
}

/// Where the member list comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum MemberSource {
    Static(Vec<Member>),
    /// One member a line, `host:port [weight]`; `#` starts a comment.
    File(PathBuf),
    /// Every address `name` resolves to, each at `port`.
    Dns {
        name: String,
        port: u16,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum MembersError {
    #[error("member {name:?}: {reason}")]
    Member { name: String, reason: String },
    #[error("{path}: line {line}: {reason}")]
    Line { path: String, line: usize, reason: String },
    #[error("{path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("resolving {name}: {reason}")]
    Dns { name: String, reason: String },
}

/// A member list: sorted by name, each name once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Members {
    list: Vec<Member>,
}

impl Members {
    /// The list of `members`; a name given twice is an error, as it would be two owners' worth
    /// of chunks on one node.
    pub fn new(mut members: Vec<Member>) -> Result<Members, MembersError> {
        members.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = members.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(MembersError::Member { name: w[0].name.clone(), reason: "is listed twice".into() });
        }
        Ok(Members { list: members })
    }

    pub fn list(&self) -> &[Member] {
        &self.list
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The members in the order they are tried for chunk `id`: its owner first.
    pub fn rank(&self, id: &KeyId) -> Vec<&Member> {
        placement::rank(id, &self.list)
    }
}

/// `host:port`, with an optional weight after it: `198.18.0.2:7470 2`.
pub fn parse_member(text: &str) -> Result<Member, MembersError> {
    let mut words = text.split_whitespace();
    let name = words.next().unwrap_or_default().to_owned();
    let bad = |reason: &str| MembersError::Member { name: name.clone(), reason: reason.to_owned() };
    let (host, port) = name.rsplit_once(':').ok_or_else(|| bad("is not host:port"))?;
    // An IPv6 address is bracketed, as in a URL, so that its port is not taken for a part of it.
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => !host.is_empty() && !host.contains([':', '/', '[', ']']),
    };
    if !host_ok {
        return Err(bad("has no valid host before its port"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err(bad("has no port from 1 to 65535")),
    }
    let weight = match words.next() {
        None => 1.0,
        Some(w) => match w.parse::<f64>() {
            Ok(w) if w.is_finite() && w > 0.0 => w,
            _ => return Err(bad("has a weight that is not a positive number")),
        },
    };
    if words.next().is_some() {
        return Err(bad("has more than a name and a weight"));
    }
    Ok(Member { name, weight })
}

/// The members a member file of text `text` lists; `path` names it in errors.
pub fn parse_file(path: &Path, text: &str) -> Result<Members, MembersError> {
    let mut members = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let m = parse_member(line).map_err(|e| MembersError::Line {
            path: path.display().to_string(),
            line: i + 1,
            reason: e.to_string(),
        })?;
        members.push(m);
    }
    Members::new(members)
}

/// The live member list: read at the start, then again every `refresh` for a file (when it
/// changed) or a DNS name.
#[derive(Debug)]
pub struct Membership {
    rx: watch::Receiver<Arc<Members>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Membership {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

impl Membership {
    /// Starts following `source`. A static list or a file that is wrong at the start is an
    /// error, as any invalid config is. A DNS name that does not resolve yet starts an empty
    /// list: the DaemonSet's Service lists only ready pods, and this node is not ready yet.
    pub async fn start(source: MemberSource, refresh: Duration) -> Result<Membership, MembersError> {
        // The file's version goes with the list read from it: one taken later could be of a
        // newer file, whose change would then never be seen.
        let mut seen = None;
        let first = match &source {
            MemberSource::Static(list) => Members::new(list.clone())?,
            MemberSource::File(path) => {
                let (members, version) = read_file(path)?;
                seen = Some(version);
                members
            }
            MemberSource::Dns { name, port } => resolve(name, *port).await.unwrap_or_else(|e| {
                warn!(error = %e, "no peer members yet; trying again every {refresh:?}");
                Members::default()
            }),
        };
        info!(members = first.list.len(), "peer members");
        let (tx, rx) = watch::channel(Arc::new(first));
        let task = match source {
            MemberSource::Static(_) => None,
            follow => Some(tokio::spawn(follow_source(follow, refresh, seen, tx))),
        };
        Ok(Membership { rx, task })
    }

    /// The members now.
    pub fn current(&self) -> Arc<Members> {
        self.rx.borrow().clone()
    }

    /// A receiver told of each change.
    pub fn watch(&self) -> watch::Receiver<Arc<Members>> {
        self.rx.clone()
    }
}

/// The members `path` lists, and the version of the file they were read from.
fn read_file(path: &Path) -> Result<(Members, FileVersion), MembersError> {
    let read_err = |source| MembersError::Read { path: path.display().to_string(), source };
    let meta = std::fs::metadata(path).map_err(read_err)?;
    let text = std::fs::read_to_string(path).map_err(read_err)?;
    Ok((parse_file(path, &text)?, (meta.modified().ok(), meta.len())))
}

async fn resolve(name: &str, port: u16) -> Result<Members, MembersError> {
    let dns_err = |reason: String| MembersError::Dns { name: name.to_owned(), reason };
    let addrs = tokio::net::lookup_host((name, port)).await.map_err(|e| dns_err(e.to_string()))?;
    let mut list: Vec<Member> = addrs.map(|a| Member { name: a.to_string(), weight: 1.0 }).collect();
    list.sort_by(|a, b| a.name.cmp(&b.name));
    list.dedup_by(|a, b| a.name == b.name);
    if list.is_empty() {
        return Err(dns_err("no addresses".into()));
    }
    Members::new(list)
}

/// A member file's version: its modification time and length.
type FileVersion = (Option<SystemTime>, u64);

async fn follow_source(
    source: MemberSource,
    refresh: Duration,
    mut seen: Option<FileVersion>,
    tx: watch::Sender<Arc<Members>>,
) {
    // The last failure logged, so that a source failing every refresh is logged once.
    let mut failing: Option<String> = None;
    loop {
        tokio::time::sleep(refresh).await;
        let next = match &source {
            MemberSource::Static(_) => return,
            MemberSource::File(path) => {
                let version = std::fs::metadata(path).ok().map(|m| (m.modified().ok(), m.len()));
                if version.is_some() && version == seen {
                    failing = None;
                    continue;
                }
                read_file(path).map(|(members, v)| {
                    seen = Some(v);
                    members
                })
            }
            MemberSource::Dns { name, port } => resolve(name, *port).await,
        };
        match next {
            Ok(members) => {
                failing = None;
                if **tx.borrow() != members {
                    info!(members = members.list.len(), "peer members changed");
                    tx.send_replace(Arc::new(members));
                }
            }
            Err(e) => {
                let text = e.to_string();
                if failing.as_deref() != Some(&text) {
                    warn!(error = %text, "cannot read the peer members; keeping the last list");
                    failing = Some(text);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(m: &Members) -> Vec<&str> {
        m.list().iter().map(|m| m.name.as_str()).collect()
    }

    #[test]
    fn members_are_host_and_port_with_an_optional_weight() {
        assert_eq!(parse_member("198.18.0.2:7470").unwrap(), Member { name: "198.18.0.2:7470".into(), weight: 1.0 });
        assert_eq!(parse_member("node-a.strata.svc:7470 2.5").unwrap().weight, 2.5);
        assert_eq!(parse_member("[fd00::2]:7470").unwrap().name, "[fd00::2]:7470");
        for (bad, why) in [
            ("198.18.0.2", "is not host:port"),
            (":7470", "has no valid host"),
            ("fd00::2:7470", "has no valid host"),
            ("a:0", "has no port"),
            ("a:70000", "has no port"),
            ("a:1 0", "weight that is not a positive number"),
            ("a:1 -1", "weight that is not a positive number"),
            ("a:1 NaN", "weight that is not a positive number"),
            ("a:1 1 2", "more than a name and a weight"),
        ] {
            let e = parse_member(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_member_file_names_the_line_that_is_wrong() {
        let path = Path::new("/etc/strata/members");
        let m = parse_file(path, "# the rack\n198.18.0.3:7470\n\n198.18.0.2:7470 2  # a bigger one\n").unwrap();
        assert_eq!(names(&m), ["198.18.0.2:7470", "198.18.0.3:7470"]);
        let e = parse_file(path, "198.18.0.2:7470\nnot-a-member\n").unwrap_err().to_string();
        assert_eq!(e, "/etc/strata/members: line 2: member \"not-a-member\": is not host:port");
        let e = parse_file(path, "a:1\nb:1\na:1 3\n").unwrap_err().to_string();
        assert_eq!(e, "member \"a:1\": is listed twice");
    }

    #[tokio::test]
    async fn a_member_file_is_followed_live_and_a_bad_edit_keeps_the_last_list() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("members");
        std::fs::write(&path, "198.18.0.2:7470\n").unwrap();
        let refresh = Duration::from_millis(20);
        let m = Membership::start(MemberSource::File(path.clone()), refresh).await.unwrap();
        let mut changes = m.watch();
        assert_eq!(names(&m.current()), ["198.18.0.2:7470"]);
        std::fs::write(&path, "198.18.0.2:7470\n198.18.0.3:7470\n").unwrap();
        tokio::time::timeout(Duration::from_secs(10), changes.changed()).await.unwrap().unwrap();
        assert_eq!(names(&m.current()), ["198.18.0.2:7470", "198.18.0.3:7470"]);
        // A half-written or wrong file, and then none: the list stays as it was.
        std::fs::write(&path, "198.18.0.2:7470\n198.18.0.3\n").unwrap();
        tokio::time::sleep(refresh * 5).await;
        std::fs::remove_file(&path).unwrap();
        tokio::time::sleep(refresh * 5).await;
        assert_eq!(names(&m.current()), ["198.18.0.2:7470", "198.18.0.3:7470"]);
        std::fs::write(&path, "198.18.0.4:7470 3\n").unwrap();
        tokio::time::timeout(Duration::from_secs(10), changes.changed()).await.unwrap().unwrap();
        assert_eq!(m.current().list(), [Member { name: "198.18.0.4:7470".into(), weight: 3.0 }]);
        // A file missing at the start is a config error, naming it.
        let e = Membership::start(MemberSource::File(dir.path().join("none")), refresh).await.unwrap_err();
        assert!(e.to_string().starts_with(&format!("{}: ", dir.path().join("none").display())), "{e}");
    }

    #[tokio::test]
    async fn a_dns_name_gives_every_address_it_resolves_to() {
        let m = Membership::start(MemberSource::Dns { name: "localhost".into(), port: 7470 }, Duration::from_secs(5))
            .await
            .unwrap();
        let current = m.current();
        assert!(names(&current).contains(&"127.0.0.1:7470"), "{current:?}");
        assert!(current.list().iter().all(|m| m.name.ends_with(":7470") && m.weight == 1.0));
        // A name that does not resolve (yet) starts empty, as a node whose Service has no
        // ready pods behaves as one without peers. (A name the resolver refuses without asking
        // a DNS server: the tests send nothing off this machine.)
        let none =
            Membership::start(MemberSource::Dns { name: "no-such\0member".into(), port: 7470 }, Duration::from_secs(5))
                .await
                .unwrap();
        assert!(none.current().is_empty());
    }
}
