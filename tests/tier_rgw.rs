//! End-to-end tests of `strata daemon` and `strata tier` against the real Ceph RGW that
//! `.ci/run` starts. Each is ignored in a plain `cargo test` (it names the service it needs) and
//! run by `.ci/run` with `--run-ignored all`.

mod common;

use common::s3::delete_under;
use common::*;
use std::time::{Duration, Instant};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// A `[cold]` config for this RGW under `prefix`, for tests that drive the source directly.
fn rgw_cold(rgw: &Rgw, prefix: &str) -> strata_tiering::source::ColdConfig {
    strata_tiering::source::ColdConfig {
        kind: strata_tiering::source::ColdKind::S3,
        bucket: Some(rgw.bucket.clone()),
        prefix: prefix.to_string(),
        endpoint: Some(rgw.endpoint.clone()),
        region: Some("us-east-1".into()),
        allow_http: true,
        access_key_id: Some(rgw.access_key.clone()),
        secret_access_key: Some(rgw.secret_key.clone()),
        ..Default::default()
    }
}

fn chunks_of(len: usize) -> u64 {
    (len as u64).div_ceil(1 << 20)
}

/// The operator's sequence: warm-up fills hot, status shows it, demote moves the unpinned
/// chunks to warm, pins keep theirs hot, evict frees space, and every byte read is the source.
#[test]
#[ignore = "needs Ceph RGW: run by .ci/run"]
fn rgw_warmup_status_demote_pin_evict() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("seq");
    let objects = [("a.bin", 3_500_000), ("b.bin", 1 << 20), ("keep/c.bin", 2_200_000), ("small.txt", 1000)];
    let uploaded = rt().block_on(upload(rgw.store().as_ref(), &prefix, &objects));
    let total_chunks: u64 = objects.iter().map(|o| chunks_of(o.1)).sum();
    let d = Daemon::start(&rgw.cold_toml(""), "64MiB", "64MiB");
    assert!(d.log().contains(&format!("s3://{} at {}", rgw.bucket, rgw.endpoint)), "{}", d.log());

    let out = d.tier_ok(&["warmup", &prefix, "--parallel", "4"]);
    assert!(out.contains(&format!("4 objects, {total_chunks}/{total_chunks} chunks")), "{out}");
    assert!(out.contains("0 failed"), "{out}");

    let s = d.status();
    assert_eq!(tier(&s, "hot")["chunks"], total_chunks);
    assert_eq!(tier(&s, "warm")["chunks"], 0);
    assert_eq!(s["cold_fetches"], total_chunks);
    let data_bytes: u64 = objects.iter().map(|o| o.1 as u64).sum();
    assert!(tier(&s, "hot")["used"].as_u64().unwrap() >= data_bytes);

    for (path, sum) in &uploaded {
        let rel = path.as_str();
        assert_eq!(&sha(&d.cat(rel)), sum, "bytes of {rel} differ from the object");
    }
    let s = d.status();
    assert_eq!(s["cold_fetches"], total_chunks, "reads after warm-up must not go to RGW");
    assert_eq!(tier(&s, "hot")["hits"], total_chunks);

    let keep = format!("{prefix}keep/");
    d.tier_ok(&["pin", &keep, "--tier", "hot"]);
    let out = d.tier_ok(&["demote", "--idle", "0s"]);
    let pinned_chunks = chunks_of(2_200_000);
    assert!(out.contains(&format!("demoted {} chunks", total_chunks - pinned_chunks)), "{out}");
    let s = d.status();
    assert_eq!(tier(&s, "hot")["chunks"], pinned_chunks);
    assert_eq!(tier(&s, "warm")["chunks"], total_chunks - pinned_chunks);
    assert!(tier(&s, "hot")["pinned"].as_u64().unwrap() > 2_200_000);

    let out = d.tier_ok(&["evict", &prefix]);
    assert!(out.contains(&format!("evicted {} chunks", total_chunks - pinned_chunks)), "{out}");
    assert!(out.contains(&format!("kept {pinned_chunks} pinned")), "{out}");
    let s = d.status();
    assert_eq!(tier(&s, "warm")["used"], 0);
    assert_eq!(tier(&s, "hot")["chunks"], pinned_chunks);
    assert!(files_under(&d.state().join("state/warm/chunks")).is_empty());

    // Reads after eviction come from RGW again, and are still right.
    for (path, sum) in &uploaded {
        assert_eq!(&sha(&d.cat(path)), sum);
    }
    let metrics = d.metrics_text();
    assert!(metrics.contains("strata_demotions_total"), "{metrics}");
    assert!(metrics.contains(r#"strata_evictions_total{tier="warm",reason="manual"}"#), "{metrics}");
    assert!(metrics.contains("strata_cold_fetch_seconds_bucket"), "{metrics}");

    d.tier_ok(&["unpin", &keep]);
    let mode = std::fs::metadata(&d.socket).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(mode.permissions().mode() & 0o777, 0o600, "admin socket must be private");
}

/// SIGKILL in the middle of a fill; after a restart no corrupt chunk is served and the caps hold.
#[test]
#[ignore = "needs Ceph RGW: run by .ci/run"]
fn rgw_sigkill_mid_fill_then_restart() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("kill");
    let objects: Vec<(String, usize)> = (0..12).map(|i| (format!("f{i:02}.bin"), 3_000_000 + i * 7919)).collect();
    let refs: Vec<(&str, usize)> = objects.iter().map(|(n, l)| (n.as_str(), *l)).collect();
    let uploaded = rt().block_on(upload(rgw.store().as_ref(), &prefix, &refs));
    let total_chunks: u64 = objects.iter().map(|o| (o.1 as u64).div_ceil(256 << 10)).sum();
    // Hot holds a quarter of the data, so the fill also demotes while it runs.
    let mut d = Daemon::start(&rgw.cold_toml("chunk_size = \"256KiB\""), "9MiB", "24MiB");
    let mut warm = std::process::Command::new(BIN)
        .args(["tier", "--socket"])
        .arg(&d.socket)
        .args(["warmup", &prefix, "--parallel", "2", "--quiet"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let fetched = d.status()["cold_fetches"].as_u64().unwrap();
        if fetched >= 20 {
            assert!(fetched < total_chunks, "the fill finished before the kill; nothing was tested");
            break;
        }
        assert!(Instant::now() < deadline, "warm-up made no progress:\n{}", d.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    d.kill9();
    let _ = warm.wait();

    d.spawn();
    let s = d.status();
    for t in ["hot", "warm"] {
        let ts = tier(&s, t);
        let cap = ts["capacity"].as_u64().unwrap();
        assert!(ts["used"].as_u64().unwrap() <= cap, "{t} over capacity after restart: {ts}");
        let dir = d.state().join(format!("state/{t}/chunks"));
        assert!(bytes_on_disk(&dir) <= cap, "{t} dir holds more than its capacity");
        assert!(
            files_under(&dir).iter().all(|p| !p.file_name().unwrap().to_string_lossy().contains(".tmp")),
            "temp files survived the rescan"
        );
    }
    for (path, sum) in &uploaded {
        assert_eq!(&sha(&d.cat(path)), sum, "{path} read wrong after the crash");
    }
    let s = d.status();
    for t in ["hot", "warm"] {
        let ts = tier(&s, t);
        assert!(ts["used"].as_u64().unwrap() <= ts["capacity"].as_u64().unwrap());
    }
}

/// A flipped byte in a cached chunk is detected, counted, and fetched again.
#[test]
#[ignore = "needs Ceph RGW: run by .ci/run"]
fn rgw_flipped_byte_is_detected_and_refetched() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("flip");
    let uploaded = rt().block_on(upload(rgw.store().as_ref(), &prefix, &[("x.bin", 2_500_000)]));
    let d = Daemon::start(&rgw.cold_toml(""), "64MiB", "64MiB");
    d.tier_ok(&["warmup", &prefix]);
    let files = files_under(&d.state().join("state/hot/chunks"));
    assert_eq!(files.len(), 3);
    let victim = &files[1];
    let mut raw = std::fs::read(victim).unwrap();
    let at = raw.len() - 1000;
    raw[at] ^= 0x10;
    std::fs::write(victim, raw).unwrap();

    assert_eq!(sha(&d.cat(&uploaded[0].0)), uploaded[0].1);
    let s = d.status();
    assert_eq!(s["checksum_failures"], 1);
    assert_eq!(s["cold_fetches"], 4, "exactly the damaged chunk was fetched again");
    assert!(d.metrics_text().contains(r#"strata_checksum_failures_total{tier="hot"} 1"#));
    assert!(d.log().contains("failed verification"), "{}", d.log());
}

/// A hot tier whose disk is full (a 1 MiB tmpfs under a 64 MiB capacity): reads still succeed,
/// from warm or cold, and the write errors are counted.
#[test]
#[ignore = "needs root (tmpfs mount) and Ceph RGW: run by .ci/run"]
fn rgw_root_full_hot_disk_reads_go_on() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("enospc");
    let uploaded = rt().block_on(upload(rgw.store().as_ref(), &prefix, &[("big.bin", 6_000_000)]));
    let dir = tempfile::tempdir().unwrap();
    let hot = dir.path().join("hot");
    let _full = SmallTmpfs::at(&hot);
    let body = format!("{}\n[tiers.hot]\npath = \"{}\"\ncapacity = \"64MiB\"\n", rgw.cold_toml(""), hot.display());
    let socket = dir.path().join("admin.sock");
    let config = dir.path().join("config.toml");
    let port = free_port();
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{}\"\n[admin]\nsocket = \"{}\"\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n{body}",
            dir.path().join("state").display(),
            socket.display()
        ),
    )
    .unwrap();
    let mut d = Daemon::with_config(tempfile::tempdir().unwrap(), config, socket);
    d.metrics = format!("127.0.0.1:{port}");
    assert_eq!(sha(&d.cat(&uploaded[0].0)), uploaded[0].1);
    assert_eq!(sha(&d.cat(&uploaded[0].0)), uploaded[0].1);
    // Reads return before their chunks are written to a tier; give the writes a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut s = d.status();
    while tier(&s, "warm")["chunks"].as_u64().unwrap() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        s = d.status();
    }
    assert!(tier(&s, "warm")["chunks"].as_u64().unwrap() > 0, "chunks should land in warm: {s}");
    let m = d.metrics_text();
    let errors = m
        .lines()
        .find_map(|l| l.strip_prefix(r#"strata_tier_write_errors_total{tier="hot"} "#))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(errors > 0, "ENOSPC on hot should be counted: {m}");
}

/// A cold store that refuses connections, and one that accepts and never answers: the error
/// names the endpoint, and nothing waits past the configured timeout.
#[test]
#[ignore = "needs Ceph RGW credentials in the environment: run by .ci/run"]
fn rgw_unreachable_store_names_endpoint_within_timeout() {
    let rgw = Rgw::from_env();
    let closed = free_port();
    let stalled = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let stalled_port = stalled.local_addr().unwrap().port();
    // Accept and hold connections without ever answering.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in stalled.incoming().take(64) {
            held.push(c);
        }
    });
    for (port, what) in [(closed, "refused"), (stalled_port, "stalled")] {
        let endpoint = format!("http://127.0.0.1:{port}");
        let cold = format!(
            "[cold]\nkind = \"s3\"\nbucket = \"{}\"\nendpoint = \"{endpoint}\"\nallow_http = true\ntimeout = \"3s\"\nconnect_timeout = \"1s\"\nretries = 1\n",
            rgw.bucket
        );
        let d = Daemon::start(&cold, "8MiB", "8MiB");
        assert!(d.log().contains("cold store not reachable"), "{what}: {}", d.log());
        let started = Instant::now();
        let out = d.tier(&["cat", "any/object.bin"]);
        let took = started.elapsed();
        assert!(!out.status.success(), "{what}: a read from a dead store must fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&endpoint), "{what}: error must name {endpoint}: {err}");
        assert!(took < Duration::from_secs(3 + 5), "{what}: waited {took:?}, past the 3s timeout");
        let out = d.tier(&["warmup", "any/"]);
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(&endpoint)
                || String::from_utf8_lossy(&out.stderr).contains(&endpoint)
        );
    }
}

/// S3 takes at most 10,000 parts per upload, so a file too large for that many parts of the
/// configured size goes up in larger ones. The limit is lowered to 3 here, so that a 40 MiB
/// file with 5 MiB parts reaches it: RGW gets 3 parts (its multipart ETag says how many) and
/// holds the file's bytes.
#[test]
#[ignore = "needs Ceph RGW: run by .ci/run"]
fn rgw_a_file_too_large_for_the_part_limit_goes_up_in_larger_parts() {
    use object_store::ObjectStoreExt;
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("partlimit");
    let cold = rgw_cold(&rgw, &prefix);
    let dir = tempfile::tempdir().unwrap();
    let source = strata_tiering::source::ObjectSource::new(&cold, dir.path()).unwrap().with_max_parts(3);
    let file = dir.path().join("ckpt");
    let body = data(0x3A9, 40 << 20);
    std::fs::write(&file, &body).unwrap();
    let mut noted = None;
    let info = rt().block_on(source.upload_file("ckpt", &file, 5 << 20, 4, |id| noted = Some(id.to_string()))).unwrap();
    assert!(noted.is_some_and(|id| !id.is_empty()), "the caller gets the upload's ID, to abort it after a crash");
    assert_eq!(info.size, body.len() as u64);
    assert!(info.version.trim_matches('"').ends_with("-3"), "three parts, not eight: {}", info.version);
    // RGW's answers to the upload and to a HEAD agree, to the ETag's quotes and the second.
    assert_eq!(info, rt().block_on(source.head("ckpt")).unwrap(), "what the upload reported is the object");
    let loc = object_store::path::Path::from(format!("{prefix}ckpt"));
    let got = rt().block_on(async { rgw.store().get(&loc).await.unwrap().bytes().await.unwrap() });
    assert_eq!(sha(&got), sha(&body));
    // A single PUT too.
    std::fs::write(&file, &body[..1 << 20]).unwrap();
    let small = rt().block_on(source.upload_file("ckpt", &file, 5 << 20, 4, |_| {})).unwrap();
    assert_eq!(small, rt().block_on(source.head("ckpt")).unwrap(), "what the PUT reported is the object");
    let _ = rt().block_on(rgw.store().delete(&loc));
}

/// A server-side copy of a listed object reports the new object as a `HEAD` of it would, from
/// the copy's own answer: the same ETag (so cached chunks keyed by it stay valid after a rename)
/// and size, with no `HEAD` sent. An object replaced since it was listed is copied as it is
/// now, and reported so, never as the listing's size with the new bytes (RGW ignores S3's
/// conditional copy header, so only the answer's ETag can tell).
#[test]
#[ignore = "needs Ceph RGW: run by .ci/run"]
fn rgw_a_copy_reports_the_new_object_without_a_head() {
    use object_store::ObjectStoreExt;
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("copyetag");
    let cold = rgw_cold(&rgw, &prefix);
    let dir = tempfile::tempdir().unwrap();
    let source = strata_tiering::source::ObjectSource::new(&cold, dir.path()).unwrap();
    let put = |key: &str, body: &[u8]| {
        let loc = object_store::path::Path::from(format!("{prefix}{key}"));
        rt().block_on(rgw.store().put(&loc, body.to_vec().into())).unwrap();
    };
    let small = data(0xC0, 16 << 10);
    put("src/small", &small);
    // A multipart object: its ETag is not an MD5 of its bytes.
    let multipart = data(0xC1, 12 << 20);
    std::fs::write(dir.path().join("mp"), &multipart).unwrap();
    rt().block_on(source.upload_file("src/multipart", &dir.path().join("mp"), 5 << 20, 2, |_| {})).unwrap();
    let listed = rt().block_on(source.list("src/")).unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");

    for known in &listed {
        let to = known.path.replace("src/", "dst/");
        let got = rt().block_on(source.copy_known(&known.path, &to, known)).unwrap();
        let head = rt().block_on(source.head(&to)).unwrap();
        assert_eq!(
            (got.path.as_str(), got.size, got.version.as_str()),
            (to.as_str(), head.size, head.version.as_str())
        );
        let skew = got.modified.duration_since(head.modified).unwrap_or_else(|e| e.duration());
        assert!(skew < Duration::from_secs(2), "{:?} against the HEAD's {:?}", got.modified, head.modified);
    }
    let dst = rgw.requests_under(&format!("{prefix}dst/"), 4);
    let copies = dst.iter().filter(|r| r.starts_with("PUT ")).count();
    let heads = dst.iter().filter(|r| r.starts_with("HEAD ")).count();
    assert_eq!((copies, heads), (2, 2), "one copy each, and only the test's own HEADs: {dst:#?}");

    // Replaced after the listing: the copy is of the new bytes, and says so.
    let newer = data(0xC2, 20 << 10);
    put("src/small", &newer);
    let got = rt().block_on(source.copy_known("src/small", "dst/replaced", &listed[1])).unwrap();
    assert_eq!(listed[1].path, "src/small");
    let head = rt().block_on(source.head("dst/replaced")).unwrap();
    assert_eq!((got.size, got.version), (newer.len() as u64, head.version));
    let loc = object_store::path::Path::from(format!("{prefix}dst/replaced"));
    assert_eq!(rt().block_on(async { rgw.store().get(&loc).await.unwrap().bytes().await.unwrap() }), newer);
    delete_under(&rgw, &prefix);
}

/// Every HTTP request the daemon sends to the store is counted, by method and status class, in
/// `strata_object_requests_total`: for one object, the counts move exactly as RGW's own access
/// log does. A cold read of three chunks is three GETs; a read of an object that is not there
/// is a 404.
#[test]
#[ignore = "needs Ceph RGW: run by .ci/run"]
fn rgw_every_request_to_the_store_is_counted() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("requests");
    let uploaded = rt().block_on(upload(rgw.store().as_ref(), &prefix, &[("three.bin", 2_500_000)]));
    let d = Daemon::start(&rgw.cold_toml(""), "64MiB", "64MiB");
    let sample = |method: &str, status: &str| {
        d.metric(&format!("strata_object_requests_total{{method=\"{method}\",status=\"{status}\"}}"))
    };
    let counted = |status: &str| ["GET", "HEAD"].map(|m| sample(m, status));
    let (ok0, missing0) = (counted("2xx"), counted("4xx"));

    let (path, sum) = &uploaded[0];
    assert_eq!(&sha(&d.cat(path)), sum);
    let ok = counted("2xx");
    // RGW's log also holds the test's own PUT of the object.
    let seen = rgw.requests_under(path, 1 + (ok[0] - ok0[0] + ok[1] - ok0[1]) as usize);
    let by_method = |m: &str| seen.iter().filter(|r| r.starts_with(&format!("{m} "))).count() as u64;
    assert_eq!(by_method("GET"), 3, "one GET per chunk: {seen:#?}");
    assert_eq!([ok[0] - ok0[0], ok[1] - ok0[1]], [by_method("GET"), by_method("HEAD")], "{seen:#?}");

    let gone = format!("{prefix}not-there.bin");
    assert!(!d.tier(&["cat", &gone]).status.success());
    let missing = counted("4xx");
    let sent = missing[0] - missing0[0] + missing[1] - missing0[1];
    let seen = rgw.requests_under(&gone, sent as usize);
    assert!(sent >= 1 && sent == seen.len() as u64, "{sent} counted, RGW saw {seen:#?}");
    assert!(d.metrics_text().contains("# HELP strata_object_requests"), "{}", d.metrics_text());
    delete_under(&rgw, &prefix);
}
