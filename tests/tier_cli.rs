//! End-to-end tests of the daemon and CLI that need no outside service: the embedded default
//! (a local directory as the cold store), config and policy validation, and the message a user
//! gets when the daemon is not running.

mod common;

use common::*;
use std::process::Command;

fn local_daemon() -> (Daemon, std::path::PathBuf) {
    let cold = tempfile::tempdir().unwrap().keep();
    let body = format!("[cold]\nkind = \"local\"\npath = \"{}\"\n", cold.display());
    (Daemon::start(&body, "32MiB", "32MiB"), cold)
}

#[test]
fn local_cold_store_warmup_and_read_back() {
    let (d, cold) = local_daemon();
    std::fs::create_dir_all(cold.join("ds/sub")).unwrap();
    let a = data(1, 2_345_678);
    let b = data(2, 10);
    std::fs::write(cold.join("ds/a.bin"), &a).unwrap();
    std::fs::write(cold.join("ds/sub/b.bin"), &b).unwrap();
    let out = d.tier_ok(&["warmup", "ds/"]);
    assert!(out.contains("2 objects, 4/4 chunks"), "{out}");
    assert_eq!(sha(&d.cat("ds/a.bin")), sha(&a));
    assert_eq!(d.cat("/ds/sub/b.bin"), b);
    let s = d.status();
    assert_eq!(tier(&s, "hot")["chunks"], 4);
    assert_eq!(s["cold_fetches"], 4);
    let text = d.tier_ok(&["status"]);
    assert!(text.contains("local dir"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("hot ")), "{text}");
}

#[test]
fn cat_reads_the_object_named_even_with_uri_characters_in_its_key() {
    let (d, cold) = local_daemon();
    std::fs::create_dir_all(cold.join("odd dir")).unwrap();
    // Each key's look-alike also exists, so a key cut at `?` or `#`, or decoded once too often
    // (`%41` as `A`), would read the wrong object instead of failing.
    let keys =
        ["odd dir/My Photo.jpg", "odd dir/a?b", "odd dir/a", "odd dir/c#d", "odd dir/c", "odd dir/%41", "odd dir/A"];
    for (i, key) in keys.iter().enumerate() {
        std::fs::write(cold.join(key), data(40 + i as u64, 1000 + i)).unwrap();
    }
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(d.cat(key), data(40 + i as u64, 1000 + i), "{key}");
    }
}

#[test]
fn warm_tier_commands_without_a_warm_tier_say_so() {
    let cold = tempfile::tempdir().unwrap().keep();
    std::fs::create_dir_all(cold.join("ds")).unwrap();
    std::fs::write(cold.join("ds/a.bin"), data(5, 100_000)).unwrap();
    let body = format!("[cold]\nkind = \"local\"\npath = \"{}\"\n", cold.display());
    let d = Daemon::start(&body, "32MiB", "0");
    for args in [&["warmup", "ds/", "--tier", "warm"][..], &["demote", "--idle", "0s"][..]] {
        let out = d.tier(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("warm tier is not configured"), "{args:?}: {err}");
    }
    assert_eq!(tier(&d.status(), "hot")["chunks"], 0, "the refused warm-up cached nothing");
}

#[test]
fn changed_object_is_never_served_mixed() {
    let (d, cold) = local_daemon();
    std::fs::create_dir_all(cold.join("m")).unwrap();
    let v1 = data(10, 3_000_000);
    std::fs::write(cold.join("m/o.bin"), &v1).unwrap();
    assert_eq!(sha(&d.cat("m/o.bin")), sha(&v1));
    // A new version under the same key gets new chunk keys, so no chunk of v1 is reused.
    let v2 = data(11, 2_000_000);
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(cold.join("m/o.bin"), &v2).unwrap();
    assert_eq!(sha(&d.cat("m/o.bin")), sha(&v2));
}

#[test]
fn policy_set_validates_before_applying() {
    let (d, _cold) = local_daemon();
    let good = d.state().join("good.toml");
    std::fs::write(&good, "eviction = \"lfu\"\nhot_idle = \"2d\"\n[[rule]]\nprefix = \"ckpt/\"\npin = \"hot\"\n")
        .unwrap();
    let out = d.tier_ok(&["policy", "set", good.to_str().unwrap()]);
    assert!(out.contains("now in force"), "{out}");
    let shown = d.tier_ok(&["policy", "show"]);
    assert!(shown.contains("eviction = \"lfu\"") && shown.contains("ckpt/"), "{shown}");

    for (text, key) in [
        ("eviction = \"lfu\"\nhot_idel = \"1d\"\n", "hot_idel"),
        ("[[rule]]\nprefix = \"x/\"\nttl = \"soonish\"\n", "rule[0].ttl"),
        ("[[rule]]\nprefix = \"x/\"\npin = \"cold\"\n", "rule[0].pin"),
    ] {
        let bad = d.state().join("bad.toml");
        std::fs::write(&bad, text).unwrap();
        let out = d.tier(&["policy", "set", bad.to_str().unwrap()]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(key), "error must name `{key}`: {err}");
        assert!(d.tier_ok(&["policy", "show"]).contains("eviction = \"lfu\""), "a rejected policy changed the policy");
    }
}

#[test]
fn pin_that_does_not_fit_is_refused_clearly() {
    let cold = tempfile::tempdir().unwrap().keep();
    std::fs::create_dir_all(cold.join("big")).unwrap();
    std::fs::write(cold.join("big/a.bin"), data(3, 6_000_000)).unwrap();
    let body = format!("[cold]\nkind = \"local\"\npath = \"{}\"\n", cold.display());
    let d = Daemon::start(&body, "4MiB", "32MiB");
    d.tier_ok(&["warmup", "big/", "--tier", "warm"]);
    let out = d.tier(&["pin", "big/"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("big/") && err.contains("high watermark"), "{err}");
    assert_eq!(tier(&d.status(), "warm")["chunks"], 6, "a refused pin must not evict anything");
}

/// A pin is on disk when `strata tier pin` returns: its state file is replaced whole and
/// synced, so a power cut right after cannot leave an empty file that the next start would
/// set aside, losing every pin.
#[test]
fn a_pin_is_on_disk_when_the_command_returns() {
    let (d, cold) = local_daemon();
    std::fs::create_dir_all(cold.join("ckpt")).unwrap();
    std::fs::write(cold.join("ckpt/a.bin"), data(4, 100_000)).unwrap();
    d.tier_ok(&["pin", "ckpt/"]);
    let state = d.state().join("state/state");
    let pins = state.join("pins.json");
    assert!(std::fs::read_to_string(&pins).unwrap().contains("ckpt/"));
    let (cached, unwritten) = page_cache_state(&pins);
    assert!(cached > 0, "the check must see the file's pages to mean anything");
    assert_eq!(unwritten, 0, "pins.json was not yet on disk");
    let leftovers: Vec<_> = std::fs::read_dir(&state)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn daemon_not_running_names_the_socket() {
    let out = Command::new(BIN).args(["tier", "--socket", "/nonexistent/strata.sock", "status"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/strata.sock"), "{err}");
    assert!(err.contains("strata daemon --config"), "{err}");
}

#[test]
fn invalid_config_names_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (text, key) in [
        ("[tiers.hot]\ncapacity = -5\n", "tiers.hot.capacity"),
        ("[cold]\ntimeout = \"a while\"\n", "cold.timeout"),
        ("[tiers.warm]\ncapacty = \"1GiB\"\n", "capacty"),
        ("[policy]\ninterval = \"0s\"\n", "policy.interval"),
        ("[cold]\nkind = \"s3\"\n", "cold.bucket"),
        ("[cold]\nkind = \"s3\"\nbucket = \"b\"\nendpoint = \"http://127.0.0.1:1\"\n", "cold.allow_http"),
    ] {
        let cfg = dir.path().join("c.toml");
        let full = format!("state_dir = \"{}\"\n{text}", dir.path().join("s").display());
        std::fs::write(&cfg, full).unwrap();
        let out = Command::new(BIN).args(["daemon", "--config"]).arg(&cfg).output().unwrap();
        assert!(!out.status.success(), "config {text:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(key), "error for {text:?} must name `{key}`: {err}");
    }
}

#[test]
fn invalid_policy_file_stops_the_daemon_with_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.toml");
    std::fs::write(&policy, "warm_idle = \"-3d\"\n").unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        format!("state_dir = \"{}\"\n[policy]\nfile = \"{}\"\n", dir.path().join("s").display(), policy.display()),
    )
    .unwrap();
    let out = Command::new(BIN).args(["daemon", "--config"]).arg(&cfg).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("warm_idle") && err.contains("negative"), "{err}");
}

#[test]
fn sigterm_stops_cleanly_and_removes_the_socket() {
    let (mut d, _cold) = local_daemon();
    assert!(d.socket.exists());
    d.stop();
    assert!(!d.socket.exists());
    assert!(d.log().contains("shutting down"));
}

/// Every metric the Grafana dashboard in deploy/ queries is one the daemon exports (or, for a
/// family with labels and no sample yet, registers), so no panel of it stays empty for want of
/// a renamed or misspelt metric.
#[test]
fn the_dashboard_queries_only_metrics_the_daemon_exports() {
    let (d, _) = local_daemon();
    let text = d.metrics_text();
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string("deploy/grafana/strata-tiering.json").unwrap()).unwrap();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    assert!(exprs.len() >= 20, "the dashboard's queries were not found: {exprs:?}");
    let mut names: Vec<String> = Vec::new();
    for e in &exprs {
        for word in e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("strata_") {
                let base = ["_total", "_bucket", "_sum", "_count"].iter().find_map(|s| word.strip_suffix(s));
                names.push(base.unwrap_or(word).to_string());
            }
        }
    }
    names.sort();
    names.dedup();
    // A family with labels shows in the output only once it has a sample; the names the daemon
    // registers are the constants of its metrics module.
    let registered = std::fs::read_to_string("tiering/src/metrics.rs").unwrap();
    let known = |n: &str| text.contains(&format!("# TYPE {n} ")) || registered.contains(&format!("\"{n}\""));
    let missing: Vec<&String> = names.iter().filter(|n| !known(n)).collect();
    assert!(missing.is_empty(), "the dashboard queries metrics the daemon does not export: {missing:?}\n{text}");
    assert!(names.len() >= 15 && names.iter().filter(|n| text.contains(&format!("# TYPE {n} "))).count() >= 8);
}
