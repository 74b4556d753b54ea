//! Docker credential helpers: config.json's `credHelpers` (per host) and `credsStore` (every
//! host) name a program, `docker-credential-NAME`, that answers `get` with a host's login. ECR,
//! GCR, ACR and desktop keychains hand out logins this way, so a node set up with `docker login`
//! through one of them has no login in `auths` at all.
//!
//! The helper is asked as docker asks it: `get` as its argument, the server on its standard
//! input, and `{"ServerURL", "Username", "Secret"}` as its answer. Answers, a refusal or a
//! failure alike, are kept for [`KEEP`], so a pull of many layers runs the helper once.

use super::auth::Login;
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// How long a helper's answer is used before it is asked again. Helpers that mint tokens (ECR's
/// last 12 hours) keep their own until shortly before they expire.
pub const KEEP: Duration = Duration::from_secs(60);

/// How long a helper may take: one that prompts or hangs must not hold a pull for ever.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// What the helpers' protocol says when it has no login for the server: not an error.
const NOT_FOUND: &str = "credentials not found in native keychain";

#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    #[error("docker credential helper {program}: cannot run it: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("docker credential helper {program} gave no answer within {}s", .after.as_secs())]
    Timeout { program: String, after: Duration },
    #[error("docker credential helper {program} failed ({status}): {output}")]
    Failed { program: String, status: std::process::ExitStatus, output: String },
    #[error("docker credential helper {program} answered something that is not a login: {reason}")]
    Answer { program: String, reason: String },
    #[error(
        "docker credential helper {program} answered with an identity token, which Strata does not exchange for a registry token"
    )]
    IdentityToken { program: String },
}

#[derive(Deserialize)]
struct Answer {
    #[serde(rename = "Username", default)]
    username: String,
    #[serde(rename = "Secret", default)]
    secret: String,
}

/// A helper's answer for one server, and when it was given.
type Answered = (Instant, Option<Login>);

/// The helpers' answers, by helper and server, for [`KEEP`].
#[derive(Debug, Default)]
pub struct Helpers {
    answers: Mutex<HashMap<(String, String), Answered>>,
}

impl Helpers {
    /// The login helper `name` has for registry `host`, if any. A failure is logged here, once
    /// per [`KEEP`], and counts as no login: the pull goes on with the next one to try.
    pub async fn login(&self, name: &str, host: &str) -> Option<Login> {
        // A helper knows a registry by its host name, as `docker login` gave it: no scheme.
        let host = super::auth::normalise_host(host);
        let host = host.as_str();
        let key = (name.to_owned(), host.to_owned());
        if let Some((at, login)) = self.answers.lock().unwrap_or_else(|p| p.into_inner()).get(&key)
            && at.elapsed() < KEEP
        {
            return login.clone();
        }
        let program = format!("docker-credential-{name}");
        let login = match ask(&program, &server_url(host), TIMEOUT).await {
            Ok(login) => login,
            Err(e) => {
                tracing::warn!(host, error = %e, "no login from the docker credential helper");
                None
            }
        };
        self.answers.lock().unwrap_or_else(|p| p.into_inner()).insert(key, (Instant::now(), login.clone()));
        login
    }
}

/// The server name docker gives a helper: Docker Hub's logins are kept under its v1 index URL.
fn server_url(host: &str) -> String {
    if host == "docker.io" { "https://index.docker.io/v1/".to_owned() } else { host.to_owned() }
}

/// Runs `program get` with `server` on its standard input, for at most `timeout`.
pub async fn ask(program: &str, server: &str, timeout: Duration) -> Result<Option<Login>, HelperError> {
    let mut child = tokio::process::Command::new(program)
        .arg("get")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| HelperError::Spawn { program: program.to_owned(), source })?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let run = async move {
        // A helper that exits without reading its input is answered by its exit, not by this
        // write's broken pipe.
        let _ = stdin.write_all(server.as_bytes()).await;
        drop(stdin);
        child.wait_with_output().await
    };
    let out = tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| HelperError::Timeout { program: program.to_owned(), after: timeout })?
        .map_err(|source| HelperError::Spawn { program: program.to_owned(), source })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        if stdout.contains(NOT_FOUND) {
            return Ok(None);
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        let output = format!("{} {}", stdout.trim(), stderr.trim()).trim().chars().take(300).collect();
        return Err(HelperError::Failed { program: program.to_owned(), status: out.status, output });
    }
    let answer: Answer = serde_json::from_slice(&out.stdout)
        .map_err(|e| HelperError::Answer { program: program.to_owned(), reason: e.to_string() })?;
    if answer.username == "<token>" {
        return Err(HelperError::IdentityToken { program: program.to_owned() });
    }
    if answer.username.is_empty() && answer.secret.is_empty() {
        return Ok(None);
    }
    Ok(Some(Login { username: answer.username, password: answer.secret }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A helper program that runs `body` (sh), with what it read from its input in `$server`.
    fn helper(dir: &std::path::Path, body: &str) -> String {
        let path = dir.join(format!("docker-credential-t{}", body.len()));
        std::fs::write(&path, format!("#!/bin/sh\n[ \"$1\" = get ] || exit 9\nread -r server\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.display().to_string()
    }

    #[tokio::test]
    async fn a_helper_is_asked_for_the_server_and_its_answer_is_the_login() {
        let dir = tempfile::tempdir().unwrap();
        let program = helper(
            dir.path(),
            r#"[ "$server" = "registry.example:5000" ] || exit 3
echo '{"ServerURL":"registry.example:5000","Username":"robot","Secret":"s3cret"}'"#,
        );
        let login = ask(&program, "registry.example:5000", TIMEOUT).await.unwrap().unwrap();
        assert_eq!((login.username.as_str(), login.password.as_str()), ("robot", "s3cret"));
        // Asked for another server, this helper fails, and says how.
        let e = ask(&program, "other.example", TIMEOUT).await.unwrap_err();
        assert!(matches!(e, HelperError::Failed { .. }), "{e}");
    }

    #[tokio::test]
    async fn no_login_is_not_an_error_and_bad_answers_are() {
        let dir = tempfile::tempdir().unwrap();
        let none = helper(dir.path(), &format!("echo '{NOT_FOUND}'; exit 1"));
        assert!(ask(&none, "r.example", TIMEOUT).await.unwrap().is_none());
        let token = helper(dir.path(), r#"echo '{"ServerURL":"r.example","Username":"<token>","Secret":"refresh"}'"#);
        let e = ask(&token, "r.example", TIMEOUT).await.unwrap_err();
        assert!(e.to_string().contains("identity token"), "{e}");
        let garbage = helper(dir.path(), "echo 'Password:'");
        let e = ask(&garbage, "r.example", TIMEOUT).await.unwrap_err();
        assert!(matches!(e, HelperError::Answer { .. }), "{e}");
        let e = ask("/nonexistent/docker-credential-x", "r.example", TIMEOUT).await.unwrap_err();
        assert!(e.to_string().contains("cannot run it"), "{e}");
    }

    #[tokio::test]
    async fn a_helper_that_hangs_is_given_up_on() {
        let dir = tempfile::tempdir().unwrap();
        let slow = helper(dir.path(), "sleep 30");
        let started = Instant::now();
        let e = ask(&slow, "r.example", Duration::from_millis(300)).await.unwrap_err();
        assert!(matches!(e, HelperError::Timeout { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn docker_hub_is_asked_for_by_its_index_url() {
        assert_eq!(server_url("docker.io"), "https://index.docker.io/v1/");
        assert_eq!(server_url("127.0.0.1:5000"), "127.0.0.1:5000");
    }
}
