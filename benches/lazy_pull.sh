#!/usr/bin/env bash
# Lazy pulls through Strata against full pulls with containerd's overlayfs snapshotter, on a
# shaped link to a local registry (benches/lazy_pull/). Starts the registry with the test images
# (tests/infra/registry.sh, images.sh) and stops it after. Run tests/run-all.sh once first on a
# fresh machine, for the packages. As root:
#   bash benches/lazy_pull.sh            # STRATA_BENCH_RUNS=N sets the runs per figure (5)
# With STRATA_TEST_REGISTRY (host:port) set, it uses that registry, already filled by images.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
source benches/registry.sh
cargo bench --locked --bench lazy_pull
