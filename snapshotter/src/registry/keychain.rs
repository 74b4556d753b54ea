//! Registry logins that kubelet passes with each CRI image pull (a pod's `imagePullSecrets`, or
//! a kubelet credential provider's answer), as the image service proxy captures them. They are
//! kept by registry host and repository, and used for the lazy reads of that repository's
//! layers, which containerd never hands to a snapshotter. They are kept on disk too (mode
//! 0600, beside the snapshots), since a layer mounted again after a restart reads with them
//! and kubelet will not pull an image it has again.

use super::auth::{Login, normalise_host};
use super::reference::ImageRef;
use crate::proto::cri::AuthConfig;
use base64::Engine;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// Repositories whose logins are kept; past this, the one remembered longest ago goes. A node
/// runs far fewer distinct private repositories than this.
const MAX_LOGINS: usize = 4096;

/// Logins from CRI pulls, by (registry host, repository).
#[derive(Debug, Default)]
pub struct Keychain {
    inner: Mutex<Inner>,
    /// Where they are kept, once [`Keychain::keep_in`] said.
    file: OnceLock<PathBuf>,
    /// Held while the file is written, with the generation last written: writes happen
    /// outside `inner`'s lock, and an older one never replaces a newer.
    writing: Mutex<u64>,
}

#[derive(Debug, Default)]
struct Inner {
    by_repo: HashMap<(String, String), Entry>,
    /// Counts remembers, so the oldest entry can be found when the map is full.
    clock: u64,
    /// Counts changes of the confirmed logins, which are what the file holds.
    generation: u64,
}

/// A repository's logins: the newest pull's, in use from the moment the pull starts, and
/// the newest one a pull succeeded with, which a failed pull's gives its place back to.
#[derive(Debug, Clone)]
struct Entry {
    current: Captured,
    confirmed: Option<Captured>,
}

/// A login as the file keeps it.
#[derive(Serialize, Deserialize)]
struct Kept {
    host: String,
    repository: String,
    username: String,
    password: String,
    server: Option<String>,
}

/// A login [`Keychain::remember`] took, for [`Keychain::confirm`] or [`Keychain::undo`] once
/// its pull has ended.
#[derive(Debug)]
pub struct Remembered {
    key: (String, String),
    captured: Captured,
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
    #[error("it carries only a registry token, which Strata does not use")]
    TokenOnly,
}

/// The username and password of a CRI `AuthConfig`: given as such, or as docker's base64
/// `auth`. `None` for a pull without a login.
pub fn login_of(auth: &AuthConfig) -> Result<Option<Login>, LoginError> {
    if !auth.username.is_empty() {
        return Ok(Some(Login { username: auth.username.clone(), password: auth.password.clone() }));
    }
    // containerd reads an identity token before `auth`.
    if !auth.identity_token.is_empty() {
        return Ok(Some(Login::identity_token(auth.identity_token.clone())));
    }
    if !auth.auth.is_empty() {
        let raw =
            base64::engine::general_purpose::STANDARD.decode(auth.auth.trim()).map_err(|_| LoginError::BadAuth)?;
        let raw = String::from_utf8(raw).map_err(|_| LoginError::BadAuth)?;
        let (u, p) = raw.split_once(':').ok_or(LoginError::BadAuth)?;
        return Ok(Some(Login { username: u.to_owned(), password: p.to_owned() }));
    }
    if !auth.registry_token.is_empty() {
        return Err(LoginError::TokenOnly);
    }
    Ok(None)
}

/// The key of `image`'s repository, with Docker Hub's names made one (kubelet may write
/// `index.docker.io/busybox` where containerd's label says `docker.io/library/busybox`).
fn key(image: &ImageRef) -> (String, String) {
    let host = normalise_host(&image.host);
    let repository = if host == "docker.io" && !image.repository.contains('/') {
        format!("library/{}", image.repository)
    } else {
        image.repository.clone()
    };
    (host, repository)
}

impl Keychain {
    /// Keeps the confirmed logins in `file` from now on, after taking those it holds. A file
    /// that cannot be read is reported and left: the logins come back with the next pulls.
    pub fn keep_in(&self, file: &Path) {
        if self.file.set(file.to_owned()).is_err() {
            return;
        }
        let read = match std::fs::read(file) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            other => other.map_err(|e| e.to_string()),
        };
        let kept: Vec<Kept> = match read.and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string())) {
            Ok(k) => k,
            Err(e) => {
                tracing::warn!(path = %file.display(), error = %e, "the kept CRI pull logins cannot be read; starting without them");
                return;
            }
        };
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        for k in kept.into_iter().take(MAX_LOGINS) {
            inner.clock += 1;
            let at = inner.clock;
            let login = Login { username: k.username, password: k.password };
            let c = Captured { login, server: k.server, at };
            inner.by_repo.insert((k.host, k.repository), Entry { current: c.clone(), confirmed: Some(c) });
        }
    }

    /// Uses `login` for `image`'s repository from now on, for `server_address` alone if it is
    /// not empty: containerd prepares the layers before the pull ends. Once the pull ends,
    /// [`Keychain::confirm`] keeps it, or [`Keychain::undo`] gives the place back.
    pub fn remember(&self, image: &ImageRef, login: Login, server_address: &str) -> Remembered {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.clock += 1;
        let at = inner.clock;
        let key = key(image);
        let server = Some(server_address.trim()).filter(|s| !s.is_empty()).map(normalise_host);
        let current = Captured { login, server, at };
        let captured = current.clone();
        match inner.by_repo.get_mut(&key) {
            Some(e) => e.current = current,
            None => {
                if inner.by_repo.len() >= MAX_LOGINS {
                    let oldest = inner.by_repo.iter().min_by_key(|(_, e)| e.current.at).map(|(k, _)| k.clone());
                    if let Some(k) = oldest {
                        inner.by_repo.remove(&k);
                    }
                }
                inner.by_repo.insert(key.clone(), Entry { current, confirmed: None });
            }
        }
        Remembered { key, captured }
    }

    /// The pull succeeded: its login is the one to fall back to, and is kept on disk, unless
    /// a pull that started later succeeded first.
    pub fn confirm(&self, done: Remembered) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(e) = inner.by_repo.get_mut(&done.key) else { return };
        if e.confirmed.as_ref().is_some_and(|c| c.at > done.captured.at) {
            return;
        }
        let c = done.captured;
        let changed = e.confirmed.as_ref().is_none_or(|k| k.login != c.login || k.server != c.server);
        e.confirmed = Some(c);
        if changed {
            self.save(inner);
        }
    }

    /// The pull failed, most likely for a wrong or expired login, which must not take the
    /// place of one that works: the repository goes back to its last confirmed login, unless
    /// a later pull's is in use already.
    pub fn undo(&self, done: Remembered) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(e) = inner.by_repo.get_mut(&done.key) else { return };
        if e.current.at != done.captured.at {
            return;
        }
        match e.confirmed.clone() {
            Some(c) => e.current = c,
            None => {
                inner.by_repo.remove(&done.key);
            }
        }
    }

    /// The login a CRI pull gave for `image`'s repository, if it may be sent to `host` (one of
    /// the image's endpoints: a mirror, or the registry itself).
    pub fn login(&self, image: &ImageRef, host: &str) -> Option<Login> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let c = &inner.by_repo.get(&key(image))?.current;
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

    /// Writes the confirmed logins to their file whole (mode 0600: they are secrets),
    /// replacing it durably, after letting go of `inner`, so the fsyncs never hold up the
    /// lazy reads that look a login up. A failure is reported; the logins in memory serve.
    fn save(&self, mut inner: std::sync::MutexGuard<'_, Inner>) {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let Some(path) = self.file.get() else { return };
        inner.generation += 1;
        let generation = inner.generation;
        let kept: Vec<Kept> = inner
            .by_repo
            .iter()
            .filter_map(|((host, repository), e)| {
                let c = e.confirmed.as_ref()?;
                Some(Kept {
                    host: host.clone(),
                    repository: repository.clone(),
                    username: c.login.username.clone(),
                    password: c.login.password.clone(),
                    server: c.server.clone(),
                })
            })
            .collect();
        drop(inner);
        let Ok(bytes) = serde_json::to_vec(&kept) else { return };
        let mut written_gen = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        if *written_gen > generation {
            return;
        }
        let tmp = path.with_extension("tmp");
        // A temp file a crash left may have any mode: it is replaced, never reused.
        let _ = std::fs::remove_file(&tmp);
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(&bytes).and_then(|_| f.sync_all()))
            .and_then(|_| std::fs::rename(&tmp, path))
            .and_then(|_| match path.parent() {
                Some(dir) => std::fs::File::open(dir).and_then(|d| d.sync_all()),
                None => Ok(()),
            });
        match written {
            Ok(()) => *written_gen = generation,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                tracing::warn!(path = %path.display(), error = %e, "cannot keep the CRI pull logins on disk; they last until a restart");
            }
        }
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
    fn a_failed_pulls_login_gives_back_the_place_of_the_last_that_worked() {
        let k = Keychain::default();
        k.confirm(k.remember(&image("reg.io/app:1"), login("good"), ""));
        let wrong = k.remember(&image("reg.io/app:1"), login("wrong"), "");
        assert_eq!(k.login(&image("reg.io/app"), "reg.io").unwrap().username, "wrong", "in use during its pull");
        k.undo(wrong);
        assert_eq!(k.login(&image("reg.io/app"), "reg.io").unwrap().username, "good");
        // Two failing pulls at once, ending in either order, leave the login that worked.
        let a = k.remember(&image("reg.io/app:1"), login("wrong-a"), "");
        let b = k.remember(&image("reg.io/app:1"), login("wrong-b"), "");
        k.undo(a);
        k.undo(b);
        assert_eq!(k.login(&image("reg.io/app"), "reg.io").unwrap().username, "good");
        // A pull that came after the failed one keeps its login.
        let failed = k.remember(&image("reg.io/app:1"), login("expired"), "");
        let fresh = k.remember(&image("reg.io/app:2"), login("fresh"), "");
        k.undo(failed);
        assert_eq!(k.login(&image("reg.io/app"), "reg.io").unwrap().username, "fresh");
        k.confirm(fresh);
        // The first pull of a repository failing leaves no login for it.
        let first = k.remember(&image("reg.io/other:1"), login("wrong"), "");
        k.undo(first);
        assert!(k.login(&image("reg.io/other:1"), "reg.io").is_none());
    }

    #[test]
    fn docker_hubs_names_for_an_image_are_one_repository() {
        let k = Keychain::default();
        k.remember(&image("index.docker.io/busybox:1"), login("hub"), "");
        assert_eq!(
            k.login(&image("docker.io/library/busybox:latest"), "registry-1.docker.io").unwrap().username,
            "hub"
        );
    }

    #[test]
    fn logins_are_kept_on_disk_for_the_owner_alone_and_come_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cri-logins.json");
        let k = Keychain::default();
        k.keep_in(&file);
        // A temp file a crash left, readable by all, is not reused.
        std::fs::write(file.with_extension("tmp"), b"[]").unwrap();
        std::fs::set_permissions(file.with_extension("tmp"), std::fs::Permissions::from_mode(0o644)).unwrap();
        k.confirm(k.remember(&image("reg.io/app:1"), login("alice"), ""));
        k.confirm(k.remember(&image("reg.io/named:1"), login("bob"), "reg.io"));
        // A pull still going on is not written down.
        let _going = k.remember(&image("reg.io/going:1"), login("carol"), "");
        assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
        let again = Keychain::default();
        again.keep_in(&file);
        assert_eq!(again.login(&image("reg.io/app"), "mirror.local").unwrap().password, "alice-pw");
        assert!(again.login(&image("reg.io/named"), "mirror.local").is_none(), "its server is kept too");
        assert_eq!(again.login(&image("reg.io/named"), "reg.io").unwrap().username, "bob");
        assert!(again.login(&image("reg.io/going"), "reg.io").is_none(), "only logins a pull succeeded with");
        // A damaged file is set aside with a warning, not fatal.
        std::fs::write(&file, "{").unwrap();
        let damaged = Keychain::default();
        damaged.keep_in(&file);
        assert!(damaged.is_empty());
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
        assert_eq!(login_of(&token), Ok(Some(Login::identity_token("t".into()))));
        let both = AuthConfig { identity_token: "t".into(), auth: docker.auth.clone(), ..Default::default() };
        assert_eq!(
            login_of(&both),
            Ok(Some(Login::identity_token("t".into()))),
            "as containerd, the identity token comes first"
        );
        let registry_token = AuthConfig { registry_token: "r".into(), ..Default::default() };
        assert_eq!(login_of(&registry_token), Err(LoginError::TokenOnly));
    }
}
