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
if [[ -z ${STRATA_TEST_REGISTRY:-} ]]; then
  REGISTRY_DIR=$(mktemp -d /tmp/strata-bench-registry.XXXXXX)
  export REGISTRY_PORT=${REGISTRY_PORT:-5070}
  trap 'bash "$ROOT/tests/infra/registry.sh" stop "$REGISTRY_DIR" >/dev/null 2>&1 || true' EXIT
  bash tests/infra/registry.sh start "$REGISTRY_DIR"
  bash tests/infra/images.sh "127.0.0.1:$REGISTRY_PORT" "$REGISTRY_DIR/build"
  export STRATA_TEST_REGISTRY=127.0.0.1:$REGISTRY_PORT STRATA_TEST_REGISTRY_LOG=$REGISTRY_DIR/registry.log
fi
cargo bench --locked --bench lazy_pull
