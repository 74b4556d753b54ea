#!/usr/bin/env bash
# Runs the criterion benchmarks with a Ceph RGW on loopback, so the miss-path bench has its
# object store. The packages come from tests/run-all.sh (run it once first on a fresh machine).
#   bash benches/run.sh [criterion filter...]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
RGW_DIR=$(mktemp -d /tmp/strata-rgw-bench.XXXXXX)
trap 'bash "$ROOT/tests/infra/rgw.sh" stop "$RGW_DIR" >/dev/null 2>&1 || true' EXIT
bash tests/infra/rgw.sh start "$RGW_DIR"
export STRATA_TEST_S3_ENDPOINT=http://127.0.0.1:${RGW_PORT:-7480} STRATA_TEST_S3_BUCKET=strata-test
export AWS_ACCESS_KEY_ID=strata-test AWS_SECRET_ACCESS_KEY=strata-test-secret AWS_REGION=us-east-1
cargo bench --locked --bench tiering -- "$@"
