//! Registry logins that kubelet passes with each CRI image pull (a pod's `imagePullSecrets`, or
//! a kubelet credential provider's answer), as the image service proxy captures them. They are
//! kept in memory by registry host and repository, and used for the lazy reads of that
//! repository's layers, which containerd never hands to a snapshotter.

use super::auth::{Login, normalise_host};
use super::reference::ImageRef;
use crate::proto::cri::AuthConfig;
use base64::Engine;
use std::collections::HashMap;
use std::sync::Mutex;

/// Repositories whose logins are kept; past this, the one remembered longest ago goes. A node
/// runs far fewer distinct private repositories than this.
const MAX_LOGINS: usize = 4096;

/// Logins from CRI pulls, by (registry host, repository).
#[derive(Debug, Default)]
pub struct Keychain {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_repo: HashMap<(String, String), Captured>,
    /// Counts remembers, so the oldest entry can be found when the map is full.
    clock: u64,
}

#[derive(Debug, Clone)]
struct Captured {
    login: Login,
    /// The host the login is for, when the pull named one (`server_address`): only that host
    /// is sent it. Without one it goes to every endpoint of the image, as containerd's CRI
    /// plugin sends it.
    server: Option<String>,
    at: u64,
}

/// Why a pull's login could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoginError {
    #[error("its auth field is not base64 of user:password")]
    BadAuth,
    #[error("it carries only an identity or registry token, which Strata does not use")]
    TokenOnly,
}

/// The username and password of a CRI `AuthConfig`: given as such, or as docker's base64
/// `auth`. `None` for a pull without a login.
pub fn login_of(auth: &AuthConfig) -> Result<Option<Login>, LoginError> {
    if !auth.username.is_empty() {
        return Ok(Some(Login { username: auth.username.clone(), password: auth.password.clone() }));
    }
    if !auth.auth.is_empty() {
        let raw =
            base64::engine::general_purpose::STANDARD.decode(auth.auth.trim()).map_err(|_| LoginError::BadAuth)?;
        let raw = String::from_utf8(raw).map_err(|_| LoginError::BadAuth)?;
        let (u, p) = raw.split_once(':').ok_or(LoginError::BadAuth)?;
        return Ok(Some(Login { username: u.to_owned(), password: p.to_owned() }));
    }
    if !auth.identity_token.is_empty() || !auth.registry_token.is_empty() {
        return Err(LoginError::TokenOnly);
    }
    Ok(None)
}

impl Keychain {
    /// Keeps `login` for `image`'s repository, for `server_address` alone if it is not empty.
    /// A later pull's login replaces it.
    pub fn remember(&self, image: &ImageRef, login: Login, server_address: &str) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.clock += 1;
        let at = inner.clock;
        let key = (normalise_host(&image.host), image.repository.clone());
        let server = Some(server_address.trim()).filter(|s| !s.is_empty()).map(normalise_host);
        if inner.by_repo.len() >= MAX_LOGINS && !inner.by_repo.contains_key(&key) {
            let oldest = inner.by_repo.iter().min_by_key(|(_, c)| c.at).map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                inner.by_repo.remove(&k);
            }
        }
        inner.by_repo.insert(key, Captured { login, server, at });
    }

    /// The login a CRI pull gave for `image`'s repository, if it may be sent to `host` (one of
    /// the image's endpoints: a mirror, or the registry itself).
    pub fn login(&self, image: &ImageRef, host: &str) -> Option<Login> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let c = inner.by_repo.get(&(normalise_host(&image.host), image.repository.clone()))?;
        match &c.server {
            Some(server) if *server != normalise_host(host) => None,
            _ => Some(c.login.clone()),
        }
    }

    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).by_repo.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn login(u: &str) -> Login {
        Login { username: u.into(), password: format!("{u}-pw") }
    }

    fn image(s: &str) -> ImageRef {
        ImageRef::parse(s).unwrap()
    }

    #[test]
    fn a_login_is_used_for_its_repository_only() {
        let k = Keychain::default();
        k.remember(&image("reg.io/team/app:1"), login("alice"), "");
        // Any tag or digest of the repository, at the registry or at a mirror of it.
        assert_eq!(k.login(&image("reg.io/team/app@sha256:ab"), "reg.io").unwrap().username, "alice");
        assert_eq!(k.login(&image("reg.io/team/app:2"), "https://mirror.local:5000").unwrap().username, "alice");
        assert!(k.login(&image("reg.io/team/other:1"), "reg.io").is_none());
        assert!(k.login(&image("other.io/team/app:1"), "other.io").is_none());
        // Docker Hub's many names are one registry.
        k.remember(&image("busybox"), login("bob"), "");
        assert_eq!(k.login(&image("docker.io/library/busybox:1"), "registry-1.docker.io").unwrap().username, "bob");
        // The newest pull's login wins.
        k.remember(&image("reg.io/team/app:3"), login("carol"), "");
        assert_eq!(k.login(&image("reg.io/team/app"), "reg.io").unwrap().username, "carol");
    }

    #[test]
    fn a_login_for_a_named_server_goes_to_that_host_alone() {
        let k = Keychain::default();
        k.remember(&image("reg.io/app:1"), login("alice"), "https://reg.io/v1/");
        assert!(k.login(&image("reg.io/app:1"), "reg.io").is_some());
        assert!(k.login(&image("reg.io/app:1"), "http://mirror.local:5000").is_none(), "a mirror is not sent it");
    }

    #[test]
    fn the_kept_logins_are_bounded() {
        let k = Keychain::default();
        for i in 0..MAX_LOGINS + 10 {
            k.remember(&image(&format!("reg.io/app{i}:1")), login("u"), "");
        }
        assert_eq!(k.len(), MAX_LOGINS);
        assert!(k.login(&image("reg.io/app0:1"), "reg.io").is_none(), "the oldest went");
        assert!(k.login(&image(&format!("reg.io/app{}:1", MAX_LOGINS + 9)), "reg.io").is_some());
    }

    #[test]
    fn cri_auth_configs_give_their_login() {
        let user = AuthConfig { username: "u".into(), password: "p".into(), ..Default::default() };
        assert_eq!(login_of(&user).unwrap().unwrap().password, "p");
        let encoded = base64::engine::general_purpose::STANDARD.encode("v:pw:with:colons");
        let docker = AuthConfig { auth: encoded, ..Default::default() };
        let l = login_of(&docker).unwrap().unwrap();
        assert_eq!((l.username.as_str(), l.password.as_str()), ("v", "pw:with:colons"));
        assert_eq!(login_of(&AuthConfig::default()), Ok(None));
        let bad = AuthConfig { auth: "%%%".into(), ..Default::default() };
        assert_eq!(login_of(&bad), Err(LoginError::BadAuth));
        let token = AuthConfig { identity_token: "t".into(), ..Default::default() };
        assert_eq!(login_of(&token), Err(LoginError::TokenOnly));
    }
}
