#!/usr/bin/env bash
# Runs the criterion benchmarks with a Ceph RGW on loopback, so the miss-path bench has its
# object store. The packages come from tests/run-all.sh (run it once first on a fresh machine).
#   bash benches/run.sh [criterion filter...]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
source benches/rgw.sh
cargo bench --locked --bench tiering -- "$@"
