# Sourced by the benches that need the test registry: unless STRATA_TEST_REGISTRY names one
# already filled by tests/infra/images.sh, starts one on loopback with the test images
# (tests/infra/registry.sh, images.sh), stops it when the bench's shell exits, and exports
# what tests/common reads.
if [[ -z ${STRATA_TEST_REGISTRY:-} ]]; then
  [[ -n ${STOPS+x} ]] || source "$ROOT/benches/stops.sh"
  REGISTRY_DIR=$(mktemp -d /tmp/strata-bench-registry.XXXXXX)
  export REGISTRY_PORT=${REGISTRY_PORT:-5070}
  at_exit 'bash "$ROOT/tests/infra/registry.sh" stop "$REGISTRY_DIR" >/dev/null 2>&1 || true'
  bash "$ROOT/tests/infra/registry.sh" start "$REGISTRY_DIR"
  bash "$ROOT/tests/infra/images.sh" "127.0.0.1:$REGISTRY_PORT" "$REGISTRY_DIR/build"
  export STRATA_TEST_REGISTRY=127.0.0.1:$REGISTRY_PORT STRATA_TEST_REGISTRY_LOG=$REGISTRY_DIR/registry.log
fi
