//! Any `hosts.toml`, as containerd's `config_path` holds it for a registry host: its endpoints,
//! mirrors then the upstream, or an error naming what is wrong; never a panic. Every endpoint
//! is an HTTP or HTTPS base URL under which the distribution API's paths go.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use strata_snapshotter::registry::hosts::parse_hosts;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let dir = Path::new("/etc/containerd/certs.d/registry.test");
    let Ok(endpoints) = parse_hosts(text, "registry.test", dir) else { return };
    assert!(!endpoints.is_empty(), "the upstream is always last");
    for e in &endpoints {
        assert!(e.base.starts_with("http://") || e.base.starts_with("https://"), "{e:?}");
    }
});
