#!/usr/bin/env bash
# The peer tier at cluster scale (benches/cluster.rs): N daemons in network namespaces on a
# bridge, against Ceph RGW behind a shaped origin link. Starts RGW and stops it after. Run
# tests/run-all.sh once first on a fresh machine, for the packages. As root:
#   bash benches/cluster.sh
# STRATA_BENCH_NODES ("1 4 8 16"), STRATA_BENCH_MIB (2048, per workload),
# STRATA_BENCH_ORIGIN_MBIT (1000), STRATA_BENCH_RTT_MS (10) and STRATA_BENCH_VETH_MBIT (2000)
# change the run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
RGW_DIR=$(mktemp -d /tmp/strata-rgw-cluster.XXXXXX)
trap 'bash "$ROOT/tests/infra/rgw.sh" stop "$RGW_DIR" >/dev/null 2>&1 || true' EXIT
bash tests/infra/rgw.sh start "$RGW_DIR"
export STRATA_TEST_S3_ENDPOINT=http://127.0.0.1:${RGW_PORT:-7480} STRATA_TEST_S3_BUCKET=strata-test
export STRATA_TEST_RGW_LOG=$RGW_DIR/log/client.rgw.a.log
export AWS_ACCESS_KEY_ID=strata-test AWS_SECRET_ACCESS_KEY=strata-test-secret AWS_REGION=us-east-1
cargo bench --locked --bench cluster
