//! A second docker-registry over the same storage as the test registry, behind authentication:
//! htpasswd (HTTP basic), or bearer tokens from a token server of the test's own that signs
//! JWTs (RS256, the certificate in `x5c`) with a key made by `openssl` and checks the login;
//! or anonymous over HTTPS, with a certificate from a test CA that no system trusts.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const USER: &str = "strata";
pub const PASSWORD: &str = "s3cret-pull";
/// The identity token (OAuth2 refresh token) the token server takes in place of the login.
pub const IDENTITY_TOKEN: &str = "strata-refresh-token";

#[derive(Debug, Clone)]
pub struct TokenRequest {
    pub line: String,
    pub login_ok: bool,
    pub user_agent: String,
}

pub enum Auth {
    Basic,
    Token,
    Tls,
    /// TLS that also asks each client for a certificate signed by the test CA.
    MutualTls,
}

pub struct AuthRegistry {
    /// `127.0.0.1:PORT`
    pub addr: String,
    /// Requests the token server answered: the request line, whether the login was right, and
    /// the client's User-Agent.
    pub token_requests: Arc<Mutex<Vec<TokenRequest>>>,
    /// With `Auth::Tls`: the PEM of the CA that signed the registry's certificate.
    pub ca: Option<PathBuf>,
    /// With `Auth::MutualTls`: a client certificate the registry accepts, and its key.
    pub client: Option<(PathBuf, PathBuf)>,
    dir: tempfile::TempDir,
    child: Child,
}

fn run(cmd: &str, args: &[&str]) -> Vec<u8> {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

fn base64(bytes: &[u8], url: bool) -> String {
    let table: &[u8; 64] = if url {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    } else {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    };
    let mut out = String::new();
    for group in bytes.chunks(3) {
        let n = group.iter().enumerate().fold(0u32, |n, (i, b)| n | (*b as u32) << (16 - 8 * i));
        for i in 0..=group.len() {
            out.push(table[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
        if !url {
            out.push_str(&"=".repeat(3 - group.len()));
        }
    }
    out
}

/// `user:password` as docker's `config.json` keeps it.
pub fn docker_auth(user: &str, password: &str) -> String {
    base64(format!("{user}:{password}").as_bytes(), false)
}

impl AuthRegistry {
    pub fn start(auth: Auth) -> AuthRegistry {
        let log = std::env::var("STRATA_TEST_REGISTRY_LOG").expect("STRATA_TEST_REGISTRY_LOG: the test registry");
        // registry.sh keeps its blobs in data/ beside its log.
        let storage = Path::new(&log).parent().unwrap().join("data");
        let dir = tempfile::tempdir().unwrap();
        let port = super::free_port();
        let token_requests = Arc::new(Mutex::new(Vec::new()));
        let mut ca = None;
        let mut client = None;
        let section = match auth {
            Auth::Basic => {
                let file = dir.path().join("htpasswd");
                run("htpasswd", &["-Bbc", file.to_str().unwrap(), USER, PASSWORD]);
                format!("auth: {{htpasswd: {{realm: strata-test, path: {}}}}}", file.display())
            }
            Auth::Token => {
                let (key, cert) = (dir.path().join("key.pem"), dir.path().join("cert.pem"));
                run(
                    "openssl",
                    &[
                        "req",
                        "-x509",
                        "-newkey",
                        "rsa:2048",
                        "-nodes",
                        "-days",
                        "1",
                        "-subj",
                        "/CN=strata-test-token",
                        "-keyout",
                        key.to_str().unwrap(),
                        "-out",
                        cert.to_str().unwrap(),
                    ],
                );
                let der = run("openssl", &["x509", "-in", cert.to_str().unwrap(), "-outform", "DER"]);
                let realm = token_server(key, der, token_requests.clone());
                format!(
                    "auth: {{token: {{realm: \"http://{realm}/token\", service: strata-test, issuer: strata-test-issuer, \
                     rootcertbundle: {}}}}}",
                    cert.display()
                )
            }
            Auth::Tls => {
                let (cert, key) = tls_certificate(dir.path());
                ca = Some(dir.path().join("ca.pem"));
                format!("  tls: {{certificate: {}, key: {}}}", cert.display(), key.display())
            }
            Auth::MutualTls => {
                let (cert, key) = tls_certificate(dir.path());
                ca = Some(dir.path().join("ca.pem"));
                client = Some(client_certificate(dir.path()));
                format!(
                    "  tls: {{certificate: {}, key: {}, clientcas: [{}]}}",
                    cert.display(),
                    key.display(),
                    dir.path().join("ca.pem").display()
                )
            }
        };
        // The TLS settings go inside `http:`, an auth section beside it.
        let (http_extra, section) = match section.strip_prefix("  tls: ") {
            Some(tls) => (format!(", tls: {tls}"), String::new()),
            None => (String::new(), section),
        };
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog: {{level: info, accesslog: {{disabled: false}}}}\n\
                 storage: {{filesystem: {{rootdirectory: {}}}}}\nhttp: {{addr: 127.0.0.1:{port}{http_extra}}}\n{section}\n",
                storage.display()
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("registry.log")).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("docker-registry starts");
        let r = AuthRegistry { addr: format!("127.0.0.1:{port}"), token_requests, ca, client, dir, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        // Up once /v2/ asks for credentials, or over TLS, answers a client that trusts the CA.
        let (url, ready) = match &r.ca {
            Some(_) => (format!("https://{}/v2/", r.addr), &b"200"[..]),
            None => (format!("http://{}/v2/", r.addr), &b"401"[..]),
        };
        loop {
            let mut curl = Command::new("curl");
            if let Some(ca) = &r.ca {
                curl.arg("--cacert").arg(ca);
            }
            if let Some((cert, key)) = &r.client {
                curl.arg("--cert").arg(cert).arg("--key").arg(key);
            }
            let out = curl.args(["-s", "-o", "/dev/null", "-w", "%{http_code}", &url]).output().unwrap();
            if out.stdout == ready {
                return r;
            }
            assert!(Instant::now() < deadline, "auth registry did not start:\n{}", r.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// A docker `config.json` with an identity token for this registry, as `az acr login`
    /// writes one: a placeholder user without a password in `auth`, the token beside it.
    pub fn docker_config_identity_token(&self) -> PathBuf {
        let path = self.dir.path().join("config-identity.json");
        let placeholder = docker_auth("00000000-0000-0000-0000-000000000000", "");
        let body = format!(
            "{{\"auths\":{{\"{}\":{{\"auth\":\"{placeholder}\",\"identitytoken\":\"{IDENTITY_TOKEN}\"}}}}}}",
            self.addr
        );
        std::fs::write(&path, body).unwrap();
        path
    }

    /// A docker `config.json` with `password` for this registry.
    pub fn docker_config(&self, password: &str) -> PathBuf {
        let path = self.dir.path().join(format!("config-{}.json", password.len()));
        let body = format!("{{\"auths\":{{\"{}\":{{\"auth\":\"{}\"}}}}}}", self.addr, docker_auth(USER, password));
        std::fs::write(&path, body).unwrap();
        path
    }
}

/// A CA, and a certificate for 127.0.0.1 that it signed: (certificate, key) under `dir`, the
/// CA as `dir/ca.pem`. A separate CA, because a self-signed CA certificate used directly as a
/// server's is refused by webpki (a CA used as an end entity).
fn tls_certificate(dir: &Path) -> (PathBuf, PathBuf) {
    let p = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let (ca, ca_key) = (p("ca.pem"), p("ca.key"));
    run(
        "openssl",
        &["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
            .into_iter()
            .chain(["-subj", "/CN=strata-test-ca", "-keyout", &ca_key, "-out", &ca])
            .collect::<Vec<_>>(),
    );
    signed(dir, "server", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
}

/// A client certificate signed by the CA of [`tls_certificate`] in `dir`: (certificate, key).
fn client_certificate(dir: &Path) -> (PathBuf, PathBuf) {
    signed(dir, "client", "/CN=strata-node", "extendedKeyUsage=clientAuth\n")
}

/// A key and a certificate for `subject` with extensions `ext`, signed by the CA in `dir`:
/// `dir/NAME.pem` and `dir/NAME.key`.
fn signed(dir: &Path, name: &str, subject: &str, ext: &str) -> (PathBuf, PathBuf) {
    let p = |file: String| dir.join(file).to_str().unwrap().to_owned();
    let (ca, ca_key) = (p("ca.pem".into()), p("ca.key".into()));
    let (csr, cert, key, extfile) =
        (p(format!("{name}.csr")), p(format!("{name}.pem")), p(format!("{name}.key")), p(format!("{name}.ext")));
    run("openssl", &["req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", &key, "-out", &csr]);
    std::fs::write(&extfile, format!("basicConstraints=CA:FALSE\n{ext}")).unwrap();
    run(
        "openssl",
        &["x509", "-req", "-in", &csr, "-CA", &ca, "-CAkey", &ca_key, "-CAcreateserial", "-days", "1"]
            .into_iter()
            .chain(["-extfile", &extfile, "-out", &cert])
            .collect::<Vec<_>>(),
    );
    (cert.into(), key.into())
}

impl Drop for AuthRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Serves `GET /token?service=..&scope=repository:NAME:pull` to clients that log in with
/// USER/PASSWORD, and the OAuth2 form (`POST /token`, `grant_type=refresh_token`) to those with
/// IDENTITY_TOKEN, with a JWT the registry trusts. Returns `127.0.0.1:PORT`.
fn token_server(key: PathBuf, cert_der: Vec<u8>, requests: Arc<Mutex<Vec<TokenRequest>>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            let (mut authorization, mut user_agent, mut length) = (String::new(), String::new(), 0usize);
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                    break;
                }
                let (name, value) = h.split_once(':').unwrap_or(("", ""));
                match name.to_ascii_lowercase().as_str() {
                    "authorization" => authorization = value.trim().to_string(),
                    "user-agent" => user_agent = value.trim().to_string(),
                    "content-length" => length = value.trim().parse().unwrap_or(0),
                    _ => {}
                }
            }
            // A POST's form is its query: taken into the request line, as a GET's is.
            let mut form = vec![0u8; length.min(64 << 10)];
            let _ = reader.read_exact(&mut form);
            let form = String::from_utf8_lossy(&form).into_owned();
            let line = if line.starts_with("POST ") { format!("{} {form}", line.trim()) } else { line };
            let ok = if line.starts_with("POST ") {
                form.split('&').any(|p| p == "grant_type=refresh_token")
                    && form.split('&').any(|p| p == format!("refresh_token={IDENTITY_TOKEN}"))
            } else {
                authorization == format!("Basic {}", docker_auth(USER, PASSWORD))
            };
            requests.lock().unwrap().push(TokenRequest { line: line.trim().to_string(), login_ok: ok, user_agent });
            let mut conn = conn;
            if !ok {
                let _ = conn.write_all(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                continue;
            }
            let scope = line.split(['?', '&', ' ']).find_map(|p| p.strip_prefix("scope=")).unwrap_or("");
            let scope = scope.replace('+', " ");
            let scope = scope.replace("%3A", ":").replace("%2F", "/");
            let name = scope.strip_prefix("repository:").and_then(|s| s.rsplit_once(':')).map(|(n, _)| n).unwrap_or("");
            let jwt = sign(&key, &cert_der, name);
            let body = format!("{{\"token\":\"{jwt}\",\"access_token\":\"{jwt}\",\"expires_in\":600}}");
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.read(&mut [0u8; 1]);
        }
    });
    addr
}

fn sign(key: &Path, cert_der: &[u8], repository: &str) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let header = format!("{{\"typ\":\"JWT\",\"alg\":\"RS256\",\"x5c\":[\"{}\"]}}", base64(cert_der, false));
    let claims = format!(
        "{{\"iss\":\"strata-test-issuer\",\"sub\":\"{USER}\",\"aud\":\"strata-test\",\"exp\":{},\"nbf\":{},\"iat\":{now},\
         \"jti\":\"{now}-{repository}\",\"access\":[{{\"type\":\"repository\",\"name\":\"{repository}\",\"actions\":[\"pull\"]}}]}}",
        now + 600,
        now - 10
    );
    let input = format!("{}.{}", base64(header.as_bytes(), true), base64(claims.as_bytes(), true));
    let mut child = Command::new("openssl")
        .args(["dgst", "-sha256", "-sign"])
        .arg(key)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "openssl dgst -sign failed");
    format!("{input}.{}", base64(&out.stdout, true))
}
