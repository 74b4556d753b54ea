#!/usr/bin/env bash
# The peer tier at cluster scale (benches/cluster/main.rs): N daemons in network namespaces on a
# bridge, against Ceph RGW and the test registry behind shaped origin links. Starts RGW and the
# registry with the test images, and stops them after. Run tests/run-all.sh once first on a
# fresh machine, for the packages. As root:
#   bash benches/cluster.sh
# STRATA_BENCH_NODES ("1 4 8 16"), STRATA_BENCH_WORKLOADS ("a b c m d j"), STRATA_BENCH_MIB
# (2048, per data workload), STRATA_BENCH_OBJECTS (100000, for the job start) and
# STRATA_BENCH_NAMED (2000, keys it looks up by name), STRATA_BENCH_ORIGIN_MBIT (1000),
# STRATA_BENCH_RTT_MS (10) and STRATA_BENCH_VETH_MBIT (2000) change the run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
source benches/rgw.sh
source benches/registry.sh
cargo bench --locked --bench cluster
