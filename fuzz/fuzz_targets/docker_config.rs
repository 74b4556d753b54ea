//! Any docker `config.json`, and any answer a credential helper prints for `get`: logins, or
//! an error naming the file or the helper; never a panic. A helper name taken from the file is
//! only ever a bare program name, never a path to run.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use strata_snapshotter::registry::auth::Credentials;
use strata_snapshotter::registry::helper::parse_answer;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        match Credentials::from_json(text, Path::new("/root/.docker/config.json")) {
            Ok(c) => {
                for host in ["registry.test", "docker.io", "index.docker.io", "127.0.0.1:5000"] {
                    if let Some(name) = c.helper(host) {
                        assert!(!name.is_empty() && !name.contains('/'), "{name:?}");
                    }
                    let _ = c.login(host).map(|l| l.basic_header());
                }
            }
            Err(e) => assert!(e.to_string().starts_with("/root/.docker/config.json: "), "{e}"),
        }
    }
    match parse_answer("docker-credential-test", data) {
        Ok(Some(login)) => assert!(!login.password.is_empty()),
        Ok(None) => {}
        Err(e) => {
            // The error names where the JSON went wrong, never what it held.
            let text = e.to_string();
            assert!(text.starts_with("docker credential helper docker-credential-test answered"), "{text}");
        }
    }
});
