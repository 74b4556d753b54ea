//! Every manifest of `deploy/kubernetes/` against the Kubernetes API's own schemas, offline, with
//! unknown fields refused: a misspelt key (`attachRequird`) or a field of the wrong type fails
//! here, not at `kubectl apply` on a cluster. The schemas are those `kubernetes-validate` ships,
//! which `tests/run-all.sh` installs from PyPI.

mod common;

use std::path::Path;
use std::process::Command;

/// The oldest Kubernetes the manifests are written for, and the newest the schemas know.
const VERSIONS: [&str; 2] = ["1.28.0", "1.37.0"];

#[test]
#[ignore = "needs kubernetes-validate, which tests/run-all.sh installs: run by .ci/run"]
fn every_manifest_is_valid_for_the_kubernetes_api() {
    let bin = std::env::var("STRATA_TEST_KUBE_VALIDATE").expect(
        "STRATA_TEST_KUBE_VALIDATE is not set: tests/run-all.sh installs kubernetes-validate and names it there",
    );
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let resources = common::kube::manifests().len();
    for version in VERSIONS {
        let out = Command::new(&bin).args(["--strict", "-k", version]).args(&files).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "the manifests are not valid for Kubernetes {version}:\n{text}");
        let passed = text.lines().filter(|l| l.contains(" passed for resource ")).count();
        assert_eq!(passed, resources, "not every resource was checked against {version}:\n{text}");
    }
}
