#!/usr/bin/env bash
# What a reader sees of a daemon restart: a dataset mount of Ceph RGW on loopback, served by
# `strata daemon` under `strata supervise`, read by a loop that holds one file open and reads
# 64 KiB at random offsets (its pages dropped first, so every read reaches the daemon), and
# opens a small file each round. The daemon hands over (SIGUSR2) EVENTS times, then is
# SIGKILLed EVENTS times. For each event the bench reports the pause: the longest read that
# overlapped it. Beside it, the longest read of a same-length window without a restart, and
# the ratio of the two. Prints a markdown table, also written to target/bench-restart.md.
#
#   bash benches/restart.sh
#
# Env: EVENTS=5, GAP=3 (s between handovers), KILL_GAP=11 (s between kills: the supervisor
#      backs off a daemon that dies within 10 s of its start), SIZE_MB=256 (the file held open),
#      SKIP_BUILD=1 (use target/release/strata), RGW_RUNNING=1 (an RGW is already on 7480).
# Runs as root with /dev/fuse; the Ceph packages come from tests/run-all.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
EVENTS=${EVENTS:-5} GAP=${GAP:-3} KILL_GAP=${KILL_GAP:-11} SIZE_MB=${SIZE_MB:-256}
source benches/stops.sh
if [[ -z ${RGW_RUNNING:-} ]]; then source benches/rgw.sh; fi
: "${STRATA_TEST_S3_ENDPOINT:=http://127.0.0.1:7480}" "${STRATA_TEST_S3_BUCKET:=strata-test}"
: "${AWS_ACCESS_KEY_ID:=strata-test}" "${AWS_SECRET_ACCESS_KEY:=strata-test-secret}"
export AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_REGION=us-east-1
[[ -n ${SKIP_BUILD:-} ]] || cargo build --release --locked --bin strata >&2
BIN=$ROOT/target/release/strata
WORK=$(mktemp -d /var/tmp/strata-restart.XXXXXX)
at_exit "rm -rf '$WORK'"
PREFIX=bench-restart-$$

echo "restart: uploading a ${SIZE_MB} MiB file and 200 small ones, through strata mount" >&2
mkdir -p "$WORK/up"
"$BIN" mount "s3://$STRATA_TEST_S3_BUCKET/$PREFIX" "$WORK/up" --endpoint "$STRATA_TEST_S3_ENDPOINT" \
  --state-dir "$WORK/up-state" 2>"$WORK/up.log" &
UP=$!
for _ in $(seq 100); do grep -q " $WORK/up fuse.strata " /proc/mounts && break; sleep 0.1; done
head -c $((SIZE_MB << 20)) /dev/urandom >"$WORK/up/big.bin"
mkdir -p "$WORK/up/s"
for i in $(seq 0 199); do head -c 65536 /dev/urandom >"$WORK/up/s/$i.bin"; done
kill -TERM $UP; wait $UP

mkdir -p "$WORK/mnt"
cat >"$WORK/config.toml" <<EOF
state_dir = "$WORK/state"
[admin]
socket = "$WORK/admin.sock"
[metrics]
listen = ""
[tiers.hot]
capacity = "2GiB"
[tiers.warm]
capacity = "0"
[cold]
kind = "s3"
bucket = "$STRATA_TEST_S3_BUCKET"
endpoint = "$STRATA_TEST_S3_ENDPOINT"
region = "us-east-1"
allow_http = true
[[mounts]]
path = "$WORK/mnt"
prefix = "$PREFIX"
read_only = true
# Every read reaches the daemon: none is served from a whole-file copy by the kernel.
passthrough = false
EOF
STRATA_LOG=info "$BIN" supervise -- "$BIN" daemon --config "$WORK/config.toml" 2>"$WORK/daemon.log" &
SUP=$!
at_exit "kill -TERM $SUP 2>/dev/null; wait $SUP 2>/dev/null || true; umount -l '$WORK/mnt' 2>/dev/null || true"
for _ in $(seq 100); do grep -q 'strata daemon ready' "$WORK/daemon.log" && break; sleep 0.1; done
# Warm: the whole file in the hot tier, so the figures are the daemon's, not RGW's.
cat "$WORK/mnt/big.bin" >/dev/null

cat >"$WORK/reader.py" <<'EOF'
import os, random, sys, time
mnt, out, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
fd = os.open(os.path.join(mnt, "big.bin"), os.O_RDONLY)
size = os.fstat(fd).st_size
log = open(out, "w")
end, i = time.time() + seconds, 0
while time.time() < end:
    off = random.randrange(0, size - 65536) & ~4095
    os.posix_fadvise(fd, off, 65536, os.POSIX_FADV_DONTNEED)
    t0 = time.time()
    b = os.pread(fd, 65536, off)
    with open(os.path.join(mnt, "s", f"{i % 200}.bin"), "rb") as f:
        f.read()
    t1 = time.time()
    assert len(b) == 65536
    log.write(f"{t0:.6f} {t1:.6f}\n")
    i += 1
EOF
SPAN=$(( (EVENTS + 2) * GAP + EVENTS * KILL_GAP ))
python3 "$WORK/reader.py" "$WORK/mnt" "$WORK/reads" "$SPAN" &
READER=$!
: >"$WORK/events"
sleep "$GAP"
daemon_pid() { cat "/proc/$SUP/task/$SUP/children" | awk '{print $1}'; }
for kind in USR2 KILL; do
  for _ in $(seq "$EVENTS"); do
    echo "$kind $(date +%s.%N)" >>"$WORK/events"
    kill -"$kind" "$(daemon_pid)"
    if [[ $kind == KILL ]]; then sleep "$KILL_GAP"; else sleep "$GAP"; fi
  done
done
wait "$READER"
echo "quiet $(date +%s.%N)" >>"$WORK/events"

python3 - "$WORK/reads" "$WORK/events" "$GAP" <<'EOF' | tee "$ROOT/target/bench-restart.md"
import statistics, sys
reads = [tuple(map(float, l.split())) for l in open(sys.argv[1])]
events = [(l.split()[0], float(l.split()[1])) for l in open(sys.argv[2])]
gap = float(sys.argv[3])
def longest(a, b):
    # The longest read that was under way at some point in [a, b).
    return max((t1 - t0 for t0, t1 in reads if t1 > a and t0 < b), default=0.0)
pauses = {"USR2": [], "KILL": []}
for kind, t in events:
    if kind in pauses:
        pauses[kind].append(longest(t, t + gap))
# Without a restart: the windows before the first event.
first = events[0][1]
quiet = [longest(first - gap + k * gap / 4, first - gap + (k + 1) * gap / 4) for k in range(4)]
base = max(quiet)
print("| Event | Pauses (ms) | Median (ms) | Longest read without a restart (ms) | Median ÷ that |")
print("|---|---|---|---|---|")
for kind, name in (("USR2", "handover (SIGUSR2)"), ("KILL", "SIGKILL, then a restart")):
    p = [x * 1000 for x in pauses[kind]]
    med = statistics.median(p)
    print(f"| {name} | {', '.join(f'{x:.0f}' for x in p)} | {med:.0f} | {base*1000:.1f} | {med/(base*1000):.0f}× |")
print(f"\n{len(reads)} reads, none failed.")
EOF
