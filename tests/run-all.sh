#!/usr/bin/env bash
# Runs every check and test of Strata on a Debian 12 machine, as root:
#   1. installs the system packages the tests need (apt-get update first);
#   2. cargo fmt --check and cargo clippy --all-targets -D warnings;
#   3. starts a single-node Ceph RGW on loopback (tests/infra/rgw.sh) and a docker-registry with
#      the test images (tests/infra/registry.sh, images.sh), and stops them on exit;
#   4. installs kubernetes-validate from PyPI (a venv under target/), for the manifests' schema test;
#   5. runs the whole workspace's tests, the ones that need RGW or root included;
#   6. replays every fuzz seed, then fuzzes each parser (fuzz/run.sh) for FUZZ_SECONDS (30);
#   7. prints one closing line: "N passed, N failed".
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

log() { printf '\n== %s\n' "$*"; }

PACKAGES=(ceph-mon ceph-osd ceph-mgr radosgw ceph-common uuid-runtime fuse3 fio curl ca-certificates iproute2
  protobuf-compiler containerd runc docker-registry skopeo umoci busybox-static stargz-snapshotter
  debootstrap apache2-utils python3 python3-venv openssl)
log "installing system packages: ${PACKAGES[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null

command -v cargo >/dev/null || { echo "cargo not found: install the Rust toolchain (rustup) first" >&2; exit 1; }

passed=0 failed=0
check() {
  local name=$1; shift
  log "$name"
  if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAILED: $name" >&2; fi
}
check "cargo fmt --check" cargo fmt --all -- --check
check "cargo clippy" cargo clippy --workspace --all-targets --locked -- -D warnings

RGW_DIR=$(mktemp -d /tmp/strata-rgw.XXXXXX)
REGISTRY_DIR=$(mktemp -d /tmp/strata-registry.XXXXXX)
cleanup() {
  bash "$ROOT/tests/infra/rgw.sh" stop "$RGW_DIR" >/dev/null 2>&1 || true
  bash "$ROOT/tests/infra/registry.sh" stop "$REGISTRY_DIR" >/dev/null 2>&1 || true
}
trap cleanup EXIT
log "starting the registry on loopback, with the test images"
bash tests/infra/registry.sh start "$REGISTRY_DIR"
bash tests/infra/images.sh "127.0.0.1:${REGISTRY_PORT:-5000}" "$REGISTRY_DIR/build"
export STRATA_TEST_REGISTRY=127.0.0.1:${REGISTRY_PORT:-5000}
export STRATA_TEST_REGISTRY_LOG=$REGISTRY_DIR/registry.log

log "starting Ceph RGW on loopback"
bash tests/infra/rgw.sh start "$RGW_DIR"
export STRATA_TEST_S3_ENDPOINT=http://127.0.0.1:${RGW_PORT:-7480}
export STRATA_TEST_S3_BUCKET=strata-test
export STRATA_TEST_S3_TLS_ENDPOINT=https://127.0.0.1:${RGW_TLS_PORT:-7443} STRATA_TEST_S3_CA=$RGW_DIR/tls/ca.pem
export STRATA_TEST_RGW_LOG=$RGW_DIR/log/client.rgw.a.log
export AWS_ACCESS_KEY_ID=strata-test AWS_SECRET_ACCESS_KEY=strata-test-secret AWS_REGION=us-east-1

log "installing kubernetes-validate (the Kubernetes API schemas, for the manifests)"
KUBE_VALIDATE_DIR=$ROOT/target/kubernetes-validate
[ -x "$KUBE_VALIDATE_DIR/bin/kubernetes-validate" ] || {
  python3 -m venv "$KUBE_VALIDATE_DIR" && "$KUBE_VALIDATE_DIR/bin/pip" install -q kubernetes-validate==1.37.0
} || echo "kubernetes-validate did not install: the manifest schema test will fail" >&2
export STRATA_TEST_KUBE_VALIDATE=$KUBE_VALIDATE_DIR/bin/kubernetes-validate

log "tests (RGW at $STRATA_TEST_S3_ENDPOINT)"
OUT=$(mktemp)
set +e
if command -v cargo-nextest >/dev/null; then
  cargo nextest run --workspace --locked --run-ignored all --no-fail-fast 2>&1 | tee "$OUT"
  status=${PIPESTATUS[0]}
  # nextest: "Summary [ 12.3s] 45 tests run: 44 passed, 1 failed, 0 skipped"
  summary=$(grep -E '^ *Summary \[' "$OUT" | tail -1)
  tp=$(grep -oE '[0-9]+ passed' <<<"$summary" | grep -oE '[0-9]+' || echo 0)
  tf=$(grep -oE '[0-9]+ failed' <<<"$summary" | grep -oE '[0-9]+' || echo 0)
  tt=$(grep -oE '[0-9]+ timed out' <<<"$summary" | grep -oE '[0-9]+' || echo 0)
  tf=$((tf + tt))
else
  # One test at a time: the mount tests write through FUSE, and a process another test spawns
  # meanwhile would inherit the open file and flush it at its exec. (nextest runs each test in
  # its own process.)
  cargo test --workspace --locked --no-fail-fast -- --include-ignored --test-threads 1 2>&1 | tee "$OUT"
  status=${PIPESTATUS[0]}
  tp=$(grep -E '^test result:' "$OUT" | grep -oE '[0-9]+ passed' | awk '{s += $1} END {print s + 0}')
  tf=$(grep -E '^test result:' "$OUT" | grep -oE '[0-9]+ failed' | awk '{s += $1} END {print s + 0}')
fi
set -e
rm -f "$OUT"

# Evidence that the tests really talked to the RGW started above: its own access log.
RGW_LOG="$RGW_DIR/log/client.rgw.a.log"
if [[ -f $RGW_LOG ]]; then
  requests=$(grep -c ' beast: .*"[A-Z]* /' "$RGW_LOG" || true)
  ranged=$(grep -cE ' beast: .*"GET /[^"]*" 206 ' "$RGW_LOG" || true)
  log "rgw served $requests requests during this run, $ranged of them ranged GETs (206); a sample:"
  grep -E ' beast: .*"GET /[^"]*" 206 ' "$RGW_LOG" | sed -E 's/^.* beast: [^ ]+ //' | head -3 || true
fi
REGISTRY_LOG="$REGISTRY_DIR/registry.log"
if [[ -f $REGISTRY_LOG ]]; then
  blob_gets=$(grep -cE '"GET /v2/[^ ]*/blobs/' "$REGISTRY_LOG" || true)
  log "the registry served $blob_gets blob GETs during this run"
fi
# Fuzzing of every parser of bytes from the network or the disk (fuzz/run.sh). The committed
# seeds, earlier findings among them, are replayed first, each once: that step is deterministic
# and fails only on a real crash. Random fuzzing then runs for FUZZ_SECONDS per target, both
# cores at once. A failure prints the input in base64 with the command that replays it.
FUZZ_SECONDS=${FUZZ_SECONDS:-30}
if ! command -v cargo-fuzz >/dev/null; then
  cargo install cargo-fuzz --locked --version 0.13.2 2>&1 | tail -1
fi
check "fuzz: build every target (--locked)" bash fuzz/run.sh build
check "fuzz: replay every seed" bash fuzz/run.sh replay
check "fuzz: explore each target for ${FUZZ_SECONDS}s" bash fuzz/run.sh explore "$FUZZ_SECONDS"

passed=$((passed + ${tp:-0}))
failed=$((failed + ${tf:-0}))
if [[ $status -ne 0 && ${tf:-0} -eq 0 ]]; then
  # The runner failed without counting a failed test (a build error, say): count it.
  failed=$((failed + 1))
fi
if [[ ${tp:-0} -eq 0 ]]; then
  echo "no test ran" >&2
  failed=$((failed + 1))
fi
echo
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
