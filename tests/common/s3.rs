//! Reading the test RGW directly, beside the mounts under test: what a test asserts a mount
//! left in the store, and the mount of a bucket prefix those tests start.

use super::{Mount, Rgw};
use object_store::ObjectStoreExt;
use object_store::path::Path as ObjPath;
use std::time::{Duration, Instant};

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// `strata mount` of `prefix` on the test RGW, with `extra` arguments.
pub fn rgw_mount_with(rgw: &Rgw, prefix: &str, extra: &[&str]) -> Mount {
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let mut args = vec!["--endpoint", rgw.endpoint.as_str(), "--region", "us-east-1"];
    args.extend_from_slice(extra);
    Mount::start(&source, &args)
}

pub fn rgw_mount(rgw: &Rgw, prefix: &str) -> Mount {
    rgw_mount_with(rgw, prefix, &[])
}

/// `key` as it is, as Strata names objects: `ObjPath::from` would escape `~`, `[`, `%` and more.
pub fn at(key: &str) -> ObjPath {
    ObjPath::parse(key).unwrap_or_else(|_| ObjPath::from(key))
}

/// The size of the object at `key`, if there is one.
pub fn head(rgw: &Rgw, key: &str) -> Option<u64> {
    rt().block_on(rgw.store().head(&at(key))).ok().map(|m| m.size)
}

pub fn delete(rgw: &Rgw, key: &str) {
    let _ = rt().block_on(rgw.store().delete(&at(key)));
}

pub fn get(rgw: &Rgw, key: &str) -> Vec<u8> {
    rt().block_on(async { rgw.store().get(&at(key)).await.unwrap().bytes().await.unwrap() }).to_vec()
}

/// Deletes every object under `prefix`: a test's own keys, at its end.
pub fn delete_under(rgw: &Rgw, prefix: &str) {
    for k in keys_under(rgw, prefix) {
        delete(rgw, &k);
    }
}

/// Every key under `prefix`, sorted.
pub fn keys_under(rgw: &Rgw, prefix: &str) -> Vec<String> {
    use futures::TryStreamExt;
    let p = ObjPath::from(prefix.trim_end_matches('/'));
    let mut keys: Vec<String> = rt()
        .block_on(rgw.store().list(Some(&p)).try_collect::<Vec<_>>())
        .unwrap()
        .into_iter()
        .map(|m| m.location.to_string())
        .collect();
    keys.sort();
    keys
}

/// Polls `done` every 50 ms until it holds or `limit` has passed; the caller asserts what it
/// needs after.
pub fn wait_until(limit: Duration, done: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
}
