//! Registry credentials and challenges: docker `config.json` logins, `WWW-Authenticate`
//! parsing, and the token exchange of the registry token protocol.

use super::RegistryError;
use base64::Engine;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// A username and password (or identity token) for one registry host.
#[derive(Clone, PartialEq, Eq)]
pub struct Login {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login").field("username", &self.username).field("password", &"<hidden>").finish()
    }
}

/// The user name docker gives a login whose secret is an identity token (an OAuth2 refresh
/// token, as `az acr login` and some credential helpers hand out) rather than a password.
pub const IDENTITY_TOKEN_USER: &str = "<token>";

impl Login {
    pub fn identity_token(token: String) -> Login {
        Login { username: IDENTITY_TOKEN_USER.to_owned(), password: token }
    }

    pub fn is_identity_token(&self) -> bool {
        self.username == IDENTITY_TOKEN_USER
    }

    /// The login as HTTP basic auth; an identity token goes with no user name, as containerd
    /// sends it.
    pub fn basic_header(&self) -> String {
        let user = if self.is_identity_token() { "" } else { self.username.as_str() };
        let raw = format!("{user}:{}", self.password);
        format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(raw))
    }
}

/// Logins by registry host, from a docker `config.json` (`auths`), and the credential helpers
/// it names (`credHelpers`, `credsStore`).
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    by_host: HashMap<String, Login>,
    helpers: HashMap<String, String>,
    store: Option<String>,
    /// The file they were read from, and its modification time then.
    source: Option<(PathBuf, Option<SystemTime>)>,
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: Option<HashMap<String, DockerAuth>>,
    #[serde(default, rename = "credHelpers")]
    cred_helpers: Option<HashMap<String, String>>,
    #[serde(default, rename = "credsStore")]
    creds_store: Option<String>,
}

#[derive(Deserialize)]
struct DockerAuth {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
    identitytoken: Option<String>,
}

impl Credentials {
    /// Reads `path`; a missing file means no logins, a damaged one is an error naming it.
    pub fn load(path: &Path) -> Result<Credentials, RegistryError> {
        let err = |reason: String| RegistryError::Config { path: path.display().to_string(), reason };
        let source = Some((path.to_owned(), modified(path)));
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Credentials { source, ..Credentials::default() });
            }
            Err(e) => return Err(err(e.to_string())),
        };
        Ok(Credentials { source, ..Credentials::from_json(&text, path)? })
    }

    /// The logins and helpers of a `config.json` of text `text`, read from `path` (named in
    /// errors and warnings).
    pub fn from_json(text: &str, path: &Path) -> Result<Credentials, RegistryError> {
        let err = |reason: String| RegistryError::Config { path: path.display().to_string(), reason };
        let config: DockerConfig = serde_json::from_str(text).map_err(|e| err(e.to_string()))?;
        let mut by_host = HashMap::new();
        for (key, a) in config.auths.unwrap_or_default() {
            let login = match (a.auth, a.username, a.password) {
                // docker uses an identity token before a user name and password.
                _ if a.identitytoken.as_ref().is_some_and(|t| !t.is_empty()) => {
                    Login::identity_token(a.identitytoken.unwrap_or_default())
                }
                (Some(enc), _, _) if !enc.is_empty() => {
                    let raw = base64::engine::general_purpose::STANDARD
                        .decode(enc.trim())
                        .map_err(|e| err(format!("auths.{key}.auth is not base64: {e}")))?;
                    let raw = String::from_utf8(raw).map_err(|_| err(format!("auths.{key}.auth is not UTF-8")))?;
                    let (u, p) =
                        raw.split_once(':').ok_or_else(|| err(format!("auths.{key}.auth is not user:password")))?;
                    Login { username: u.to_owned(), password: p.to_owned() }
                }
                (_, Some(u), Some(p)) => Login { username: u, password: p },
                _ => continue,
            };
            by_host.insert(normalise_host(&key), login);
        }
        // A helper is run by its name, `docker-credential-NAME`, found on PATH: a name that is
        // a path would run whatever the file points at. Such a name is left out, with the
        // rest of the file still used.
        let helper_name = |name: String, at: String| {
            let ok = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
            if !ok {
                tracing::warn!(path = %path.display(), "{at} {name:?} is not a credential helper's name; it is not used");
            }
            ok.then_some(name)
        };
        let mut helpers = HashMap::new();
        for (key, name) in config.cred_helpers.unwrap_or_default() {
            if let Some(name) = helper_name(name, format!("credHelpers.{key}")) {
                helpers.insert(normalise_host(&key), name);
            }
        }
        let store = config.creds_store.filter(|n| !n.is_empty()).and_then(|n| helper_name(n, "credsStore".into()));
        Ok(Credentials { by_host, helpers, store, source: None })
    }

    /// The logins as the file holds them now, if it changed since they were read: a token
    /// rotated by a job (ECR's last 12 hours, robot accounts are renewed) is taken up without
    /// a restart. A file that cannot be read now (caught mid-write) leaves the old logins, and
    /// is read again at the next check.
    pub fn reloaded(&self) -> Option<Credentials> {
        let (path, seen) = self.source.as_ref()?;
        if modified(path) == *seen {
            return None;
        }
        match Credentials::load(path) {
            Ok(fresh) => {
                tracing::info!(path = %path.display(), "registry logins changed; using the new ones");
                Some(fresh)
            }
            Err(e) => {
                tracing::warn!(error = %e, "registry logins changed but cannot be read; keeping the old ones");
                None
            }
        }
    }

    pub fn with_login(mut self, host: &str, login: Login) -> Credentials {
        self.by_host.insert(normalise_host(host), login);
        self
    }

    pub fn login(&self, host: &str) -> Option<&Login> {
        self.by_host.get(&normalise_host(host))
    }

    /// The credential helper for `host`, as docker picks it: the host's own in `credHelpers`,
    /// else `credsStore`.
    pub fn helper(&self, host: &str) -> Option<&str> {
        self.helpers.get(&normalise_host(host)).or(self.store.as_ref()).map(String::as_str)
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// `https://index.docker.io/v1/` and friends are keys for `docker.io`; other keys may carry a
/// scheme or a path that the host alone identifies.
pub(super) fn normalise_host(key: &str) -> String {
    let k = key.trim_start_matches("https://").trim_start_matches("http://");
    let k = k.split('/').next().unwrap_or(k);
    match k {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => "docker.io".to_owned(),
        other => other.to_owned(),
    }
}

/// A `WWW-Authenticate` challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    Basic,
    Bearer { realm: String, service: Option<String>, scope: Option<String> },
}

pub fn parse_challenge(header: &str) -> Option<Challenge> {
    let (scheme, params) = header.trim().split_once(' ').unwrap_or((header.trim(), ""));
    if scheme.eq_ignore_ascii_case("basic") {
        return Some(Challenge::Basic);
    }
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut map = HashMap::new();
    let mut rest = params.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let (value, after) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"')?;
            (&q[..end], &q[end + 1..])
        } else {
            after.split_once(',').unwrap_or((after, ""))
        };
        map.insert(key.trim().to_ascii_lowercase(), value.to_owned());
        rest = after.trim_start_matches([',', ' ']);
    }
    Some(Challenge::Bearer { realm: map.remove("realm")?, service: map.remove("service"), scope: map.remove("scope") })
}

#[derive(Deserialize)]
struct TokenAnswer {
    token: Option<String>,
    access_token: Option<String>,
}

/// Gets a bearer token for `scope` from the challenge's realm, with `login` if there is one.
pub async fn fetch_token(
    client: &reqwest::Client,
    realm: &str,
    service: Option<&str>,
    scope: &str,
    login: Option<&Login>,
    headers: &[(String, String)],
) -> Result<String, RegistryError> {
    let auth_err = |reason: String| RegistryError::Auth { url: realm.to_owned(), reason };
    let realm_url =
        reqwest::Url::parse(realm).map_err(|e| auth_err(format!("the challenge's realm is not a URL: {e}")))?;
    let mut url = realm_url.clone();
    // Several scopes, space-separated in a challenge, are one `scope` each in a GET.
    for s in scope.split(' ').filter(|s| !s.is_empty()) {
        url.query_pairs_mut().append_pair("scope", s);
    }
    if let Some(s) = service {
        url.query_pairs_mut().append_pair("service", s);
    }
    // The host's own headers go to its token service too, as containerd sends them: a gateway
    // may want them there.
    let with_headers = |mut req: reqwest::RequestBuilder| {
        for (name, value) in headers {
            req = req.header(name, value);
        }
        req
    };
    let send = |req: reqwest::RequestBuilder| async move {
        let resp = req.send().await.map_err(|source| RegistryError::Http { url: realm.to_owned(), source })?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|source| RegistryError::Http { url: realm.to_owned(), source })?;
        Ok::<_, RegistryError>((status, body))
    };
    let mut form_refused = String::new();
    if let Some(l) = login.filter(|l| l.is_identity_token()) {
        // An identity token is exchanged through the OAuth2 form of the token protocol, posted
        // to the realm as the challenge gave it, as containerd does; a service that does not
        // know the form (GCR answers 404, ACR 400, Artifactory 401) is asked as for any login,
        // the token as its password.
        let body = {
            let mut form = form_urlencoded::Serializer::new(String::new());
            form.append_pair("grant_type", "refresh_token")
                .append_pair("refresh_token", &l.password)
                .append_pair("client_id", "strata")
                .append_pair("scope", scope);
            if let Some(s) = service {
                form.append_pair("service", s);
            }
            form.finish()
        };
        let req = with_headers(client.post(realm_url))
            .header(reqwest::header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(body);
        let (status, body) = send(req).await?;
        if status.is_success() {
            return token_of(&body).map_err(auth_err);
        }
        if !matches!(status.as_u16(), 400 | 401 | 404) {
            return Err(auth_err(format!("the token service answered {status} to the identity token")));
        }
        form_refused = format!(" (and {status} to the identity token's form)");
    }
    let mut req = with_headers(client.get(url));
    if let Some(l) = login {
        req = req.header(reqwest::header::AUTHORIZATION, l.basic_header());
    }
    let (status, body) = send(req).await?;
    if !status.is_success() {
        return Err(auth_err(format!("the token service answered {status}{form_refused}")));
    }
    token_of(&body).map_err(auth_err)
}

/// The token in a token service's answer.
fn token_of(body: &[u8]) -> Result<String, String> {
    let answer: TokenAnswer = serde_json::from_slice(body).map_err(|e| format!("unreadable token answer: {e}"))?;
    answer
        .token
        .or(answer.access_token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| "the token answer holds no token".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_parse() {
        let c = parse_challenge(
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/busybox:pull""#,
        );
        assert_eq!(
            c,
            Some(Challenge::Bearer {
                realm: "https://auth.docker.io/token".into(),
                service: Some("registry.docker.io".into()),
                scope: Some("repository:library/busybox:pull".into()),
            })
        );
        assert_eq!(parse_challenge(r#"Basic realm="Registry""#), Some(Challenge::Basic));
        assert_eq!(parse_challenge("Negotiate"), None);
        assert_eq!(parse_challenge("Bearer service=x"), None, "a bearer challenge needs a realm");
    }

    #[test]
    fn docker_config_logins_load_by_host() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret");
        std::fs::write(
            &path,
            format!(r#"{{"auths": {{"https://index.docker.io/v1/": {{"auth": "{auth}"}}, "reg.local:5000": {{"username": "bob", "password": "pw"}}}}}}"#),
        )
        .unwrap();
        let c = Credentials::load(&path).unwrap();
        assert_eq!(c.login("docker.io").unwrap().username, "alice");
        assert_eq!(c.login("reg.local:5000").unwrap().password, "pw");
        assert!(c.login("other.io").is_none());
        assert!(!format!("{:?}", c.login("docker.io").unwrap()).contains("s3cret"), "passwords stay out of logs");
        assert!(Credentials::load(&dir.path().join("absent.json")).unwrap().login("docker.io").is_none());
        std::fs::write(&path, "{").unwrap();
        assert!(Credentials::load(&path).unwrap_err().to_string().contains("config.json"));
    }

    #[test]
    fn a_host_gets_its_own_credential_helper_else_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(
            &path,
            r#"{"credsStore": "desktop", "credHelpers": {"123.dkr.ecr.us-east-1.amazonaws.com": "ecr-login", "https://index.docker.io/v1/": "pass"}}"#,
        )
        .unwrap();
        let c = Credentials::load(&path).unwrap();
        assert_eq!(c.helper("123.dkr.ecr.us-east-1.amazonaws.com"), Some("ecr-login"));
        assert_eq!(c.helper("docker.io"), Some("pass"));
        assert_eq!(c.helper("reg.local:5000"), Some("desktop"));
        std::fs::write(&path, r#"{"credHelpers": {"gcr.io": "gcloud"}}"#).unwrap();
        let c = Credentials::load(&path).unwrap();
        assert_eq!((c.helper("gcr.io"), c.helper("reg.local:5000")), (Some("gcloud"), None));
        // A name that is a path would run whatever it points at: it is left out, and the rest
        // of the file still counts.
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret");
        for bad in
            [r#""credsStore": "../../bin/sh""#, r#""credHelpers": {"reg.local:5000": "x y"}"#, r#""credHelpers": null"#]
        {
            std::fs::write(&path, format!(r#"{{{bad}, "auths": {{"reg.local:5000": {{"auth": "{auth}"}}}}}}"#))
                .unwrap();
            let c = Credentials::load(&path).unwrap();
            assert_eq!(c.helper("reg.local:5000"), None, "{bad}");
            assert_eq!(c.login("reg.local:5000").unwrap().username, "alice", "{bad}");
        }
    }
}
