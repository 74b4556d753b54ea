//! Docker credential helpers: config.json's `credHelpers` (per host) and `credsStore` (every
//! host) name a program, `docker-credential-NAME`, that answers `get` with a host's login. ECR,
//! GCR, ACR and desktop keychains hand out logins this way, so a node set up with `docker login`
//! through one of them has no login in `auths` at all.
//!
//! The helper is asked as docker asks it: `get` as its argument, the server on its standard
//! input, and `{"ServerURL", "Username", "Secret"}` as its answer. An answer (a login, or none)
//! is kept for [`KEEP`], a failure for [`KEEP_FAILED`], and reads that need one while the
//! helper runs wait for that run: a pull of many layers runs the helper once.

use super::auth::Login;
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// How long a helper's answer is used before it is asked again. Helpers that mint tokens (ECR's
/// last 12 hours) keep their own until shortly before they expire.
pub const KEEP: Duration = Duration::from_secs(60);

/// How long a helper's failure (it could not run, timed out, or answered nonsense) stands
/// before it is run again: long enough not to run a broken helper for every read.
pub const KEEP_FAILED: Duration = Duration::from_secs(15);

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
}

#[derive(Deserialize)]
struct Answer {
    #[serde(rename = "Username", default)]
    username: String,
    #[serde(rename = "Secret", default)]
    secret: String,
}

/// A helper's answer for one server, and until when it stands; `None` before the first.
type Slot = Arc<tokio::sync::Mutex<Option<(Instant, Option<Login>)>>>;

/// The helpers' answers, by helper and server. Each has its own lock, held while the helper
/// runs, so that the reads waiting for it take its answer rather than run it again.
#[derive(Debug, Default)]
pub struct Helpers {
    answers: Mutex<HashMap<(String, String), Slot>>,
    /// Where the programs are, if not on PATH.
    dir: Option<std::path::PathBuf>,
}

impl Helpers {
    /// Helpers whose programs are in `dir`, not on PATH.
    pub fn in_dir(dir: &std::path::Path) -> Helpers {
        Helpers { dir: Some(dir.to_owned()), ..Helpers::default() }
    }

    /// The login helper `name` has for registry `host`, if any. A failure is logged here, once
    /// per [`KEEP_FAILED`], and counts as no login: the pull goes on with the next one to try.
    pub async fn login(&self, name: &str, host: &str) -> Option<Login> {
        // A helper knows a registry by its host name, as `docker login` gave it: no scheme.
        let host = super::auth::normalise_host(host);
        let slot = self
            .answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((name.to_owned(), host.clone()))
            .or_default()
            .clone();
        let mut slot = slot.lock().await;
        if let Some((until, login)) = slot.as_ref()
            && Instant::now() < *until
        {
            return login.clone();
        }
        let mut program = format!("docker-credential-{name}");
        if let Some(dir) = &self.dir {
            program = dir.join(program).display().to_string();
        }
        let (login, keep) = match ask(&program, &server_url(&host), TIMEOUT).await {
            Ok(login) => (login, KEEP),
            Err(e) => {
                tracing::warn!(host, error = %e, "no login from the docker credential helper");
                (None, KEEP_FAILED)
            }
        };
        *slot = Some((Instant::now() + keep, login.clone()));
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
        // Its own process group, so that what it started goes with it when it is given up on.
        .process_group(0)
        .spawn()
        .map_err(|source| HelperError::Spawn { program: program.to_owned(), source })?;
    let group = child.id();
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let run = async move {
        // A helper that exits without reading its input is answered by its exit, not by this
        // write's broken pipe.
        let _ = stdin.write_all(server.as_bytes()).await;
        drop(stdin);
        child.wait_with_output().await
    };
    let out = match tokio::time::timeout(timeout, run).await {
        Ok(out) => out.map_err(|source| HelperError::Spawn { program: program.to_owned(), source })?,
        Err(_) => {
            if let Some(group) = group {
                let _ = std::process::Command::new("kill").args(["-s", "KILL", "--", &format!("-{group}")]).status();
            }
            return Err(HelperError::Timeout { program: program.to_owned(), after: timeout });
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        if stdout.contains(NOT_FOUND) {
            return Ok(None);
        }
        // What it says goes into the log: only the first line of its errors, and not even that
        // if it looks like an answer, since a helper that printed its login and then failed
        // would put the secret there. Its standard output is never shown.
        let stderr = String::from_utf8_lossy(&out.stderr);
        let first = stderr.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("");
        let output = if first.contains("Secret") || first.contains('{') {
            "(its message is left out: it may hold a secret)".to_owned()
        } else if first.is_empty() {
            "(no message)".to_owned()
        } else {
            first.chars().take(200).collect()
        };
        return Err(HelperError::Failed { program: program.to_owned(), status: out.status, output });
    }
    parse_answer(program, &out.stdout)
}

/// The login in what helper `program` printed for a `get`; `None` for an empty secret.
pub fn parse_answer(program: &str, stdout: &[u8]) -> Result<Option<Login>, HelperError> {
    // Where the JSON went wrong, not serde's text, which may quote a value of it.
    let answer: Answer = serde_json::from_slice(stdout).map_err(|e| HelperError::Answer {
        program: program.to_owned(),
        reason: format!(
            "not the JSON of a login ({:?} error at line {}, column {})",
            e.classify(),
            e.line(),
            e.column()
        ),
    })?;
    if answer.secret.is_empty() {
        return Ok(None);
    }
    // `<token>` as the user marks the secret as an identity token, which Login keeps so.
    Ok(Some(Login { username: answer.username, password: answer.secret }))
}

/// Helper programs for tests elsewhere in the crate.
#[cfg(test)]
pub(crate) mod testing {
    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};

    /// Writes `docker-credential-NAME` into `dir`, running `body` (sh) for `get` with what it
    /// read in `$server`, and returns once it can be run: a process another test forked while
    /// it was written may hold it open for writing until that process runs its own (ETXTBSY).
    pub(crate) async fn ready_helper(dir: &Path, name: &str, body: &str) -> PathBuf {
        let path = dir.join(format!("docker-credential-{name}"));
        std::fs::write(&path, format!("#!/bin/sh\n[ \"$1\" = get ] || exit 9\nread -r server\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        for _ in 0..100 {
            match tokio::process::Command::new(&path).status().await {
                Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await
                }
                _ => break,
            }
        }
        path
    }
}

#[cfg(test)]
mod tests {
    use super::testing::ready_helper;
    use super::*;

    /// A helper program that runs `body` (sh), with what it read from its input in `$server`.
    async fn helper(dir: &std::path::Path, body: &str) -> String {
        ready_helper(dir, &format!("t{}", body.len()), body).await.display().to_string()
    }

    #[tokio::test]
    async fn a_helper_is_asked_for_the_server_and_its_answer_is_the_login() {
        let dir = tempfile::tempdir().unwrap();
        let program = helper(
            dir.path(),
            r#"[ "$server" = "registry.example:5000" ] || exit 3
echo '{"ServerURL":"registry.example:5000","Username":"robot","Secret":"s3cret"}'"#,
        )
        .await;
        let login = ask(&program, "registry.example:5000", TIMEOUT).await.unwrap().unwrap();
        assert_eq!((login.username.as_str(), login.password.as_str()), ("robot", "s3cret"));
        // Asked for another server, this helper fails, and says how.
        let e = ask(&program, "other.example", TIMEOUT).await.unwrap_err();
        assert!(matches!(e, HelperError::Failed { .. }), "{e}");
    }

    #[tokio::test]
    async fn no_login_is_not_an_error_and_bad_answers_are() {
        let dir = tempfile::tempdir().unwrap();
        let none = helper(dir.path(), &format!("echo '{NOT_FOUND}'; exit 1")).await;
        assert!(ask(&none, "r.example", TIMEOUT).await.unwrap().is_none());
        let token =
            helper(dir.path(), r#"echo '{"ServerURL":"r.example","Username":"<token>","Secret":"refresh"}'"#).await;
        let login = ask(&token, "r.example", TIMEOUT).await.unwrap().unwrap();
        assert!(login.is_identity_token() && login.password == "refresh");
        let garbage = helper(dir.path(), "echo 'Password:'").await;
        let e = ask(&garbage, "r.example", TIMEOUT).await.unwrap_err();
        assert!(matches!(e, HelperError::Answer { .. }), "{e}");
        let e = ask("/nonexistent/docker-credential-x", "r.example", TIMEOUT).await.unwrap_err();
        assert!(e.to_string().contains("cannot run it"), "{e}");
    }

    #[tokio::test]
    async fn a_helper_that_hangs_is_given_up_on_with_what_it_started() {
        let dir = tempfile::tempdir().unwrap();
        let pid = dir.path().join("pid");
        let slow = helper(dir.path(), &format!("sleep 30 &\necho $! > {}\nwait", pid.display())).await;
        let started = Instant::now();
        let e = ask(&slow, "r.example", Duration::from_millis(500)).await.unwrap_err();
        assert!(matches!(e, HelperError::Timeout { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(10));
        // The helper's own child went with it (killed, then reaped by init once orphaned).
        let pid = std::fs::read_to_string(&pid).unwrap();
        let proc = std::path::PathBuf::from(format!("/proc/{}", pid.trim()));
        let deadline = Instant::now() + Duration::from_secs(10);
        let gone = |p: &std::path::Path| {
            std::fs::read_to_string(p.join("stat"))
                .map_or(true, |s| s.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z')))
        };
        while !gone(&proc) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(gone(&proc), "the helper's child {} still runs", pid.trim());
    }

    #[tokio::test]
    async fn reads_that_need_a_login_at_once_run_the_helper_once() {
        let dir = tempfile::tempdir().unwrap();
        let runs = dir.path().join("runs");
        let body = format!(
            "echo \"$server\" >> {}\nsleep 0.3\necho '{{\"Username\":\"robot\",\"Secret\":\"s3cret\"}}'",
            runs.display()
        );
        ready_helper(dir.path(), "once", &body).await;
        let helpers = Arc::new(Helpers::in_dir(dir.path()));
        let asks = (0..8).map(|_| {
            let helpers = helpers.clone();
            tokio::spawn(async move { helpers.login("once", "http://reg.example:5000").await })
        });
        for login in futures::future::join_all(asks).await {
            assert_eq!(login.unwrap().unwrap().password, "s3cret");
        }
        // Asked by the host's name, without the scheme, once for all eight.
        assert_eq!(std::fs::read_to_string(&runs).unwrap(), "reg.example:5000\n");
    }

    #[tokio::test]
    async fn a_secret_in_what_a_helper_printed_stays_out_of_its_error() {
        let dir = tempfile::tempdir().unwrap();
        let failed = helper(dir.path(), r#"echo '{"Username":"robot","Secret":"s3cret"}'; exit 1"#).await;
        let e = ask(&failed, "r.example", TIMEOUT).await.unwrap_err().to_string();
        assert!(e.contains("failed") && !e.contains("s3cret"), "{e}");
        let quoted = helper(dir.path(), r#"echo '"s3cret"'"#).await;
        let e = ask(&quoted, "r.example", TIMEOUT).await.unwrap_err().to_string();
        assert!(e.contains("not the JSON of a login") && !e.contains("s3cret"), "{e}");
    }

    #[test]
    fn docker_hub_is_asked_for_by_its_index_url() {
        assert_eq!(server_url("docker.io"), "https://index.docker.io/v1/");
        assert_eq!(server_url("127.0.0.1:5000"), "127.0.0.1:5000");
    }
}
