# Sourced by the benches that need Ceph RGW: starts it on loopback in a temp dir (tests/infra/
# rgw.sh), stops it when the bench's shell exits, and exports what tests/common reads.
[[ -n ${STOPS+x} ]] || source "$ROOT/benches/stops.sh"
RGW_DIR=$(mktemp -d /tmp/strata-rgw-bench.XXXXXX)
at_exit 'bash "$ROOT/tests/infra/rgw.sh" stop "$RGW_DIR" >/dev/null 2>&1 || true'
bash "$ROOT/tests/infra/rgw.sh" start "$RGW_DIR"
export STRATA_TEST_S3_ENDPOINT=http://127.0.0.1:${RGW_PORT:-7480} STRATA_TEST_S3_BUCKET=strata-test
export STRATA_TEST_RGW_LOG=$RGW_DIR/log/client.rgw.a.log
export AWS_ACCESS_KEY_ID=strata-test AWS_SECRET_ACCESS_KEY=strata-test-secret AWS_REGION=us-east-1
