#!/usr/bin/env bash
# System benchmark of `strata mount` against its peers over one Ceph RGW on loopback:
#   cold   1 file sequential read, cold: s3fs, rclone, strata, raw parallel ranged GETs (raw_s3)
#   warm   the same file from strata's hot tier (passthrough, and --no-passthrough) vs a local copy
#   random fio 256 KiB random reads, warm, strata vs the local copy
#   small  SMALL_FILES objects of SMALL_KB KiB read by READERS parallel readers, as a data
#          loader's workers read an image dataset: s3fs, rclone, strata, cold (first epoch) and
#          warm (second epoch), against raw GETs and a local copy
#   smallfit the same two epochs with each tool's cache (strata's hot tier, rclone's VFS cache)
#          held to 1.5 x the dataset, as a node's cache disk sized for it would be: strata and
#          rclone against the local copy
#   meta   find + stat over FILES small objects: s3fs, rclone, strata, cold and cached
#   ckpt   a checkpoint written through strata (dd conv=fsync, mv) vs a raw multipart upload
#   dirmv  mv of a directory of DIR_FILES objects (a checkpoint renamed into place): s3fs, rclone,
#          strata
# and prints a markdown table of the figures and ratios, also written to target/bench-cachefs.md.
#
#   bash benches/cachefs.sh
#
# Env: SIZE_MB=1024 (read object), FILES=100000 (meta objects), CKPT_MB=4096 (checkpoint),
#      DIR_FILES=1000 (objects of 16 KiB in the renamed directory),
#      SMALL_FILES=5000 SMALL_KB=112 READERS=8 (the small-file dataset and its readers),
#      ONLY=cold,warm,random,small,smallfit,meta,ckpt,dirmv (subset), FIO_RUNTIME=20 (s per fio run),
#      ROUNDS=3 (each bench but meta runs this many times; the report gives medians),
#      BENCH_DIR (scratch dir, default a new /var/tmp/strata-bench.XXXXXX; strata's state dir and
#      the local copies live there, so they share a disk), TIMEOUT=1800 (s per timed operation),
#      STRATA_CHUNK=8MiB (strata's --chunk-size for the read benches),
#      SKIP_BUILD=1 (use the binaries already in target/release), KEEP=1 (keep the scratch dir),
#      SPLIT_CPUS=STORE:CLIENT (taskset CPU lists, e.g. 0:1): Ceph runs on STORE's CPUs and every
#      contender, with its reader or writer, on CLIENT's, as on a cluster, where the object store
#      has machines of its own; by default all share every CPU.
# Runs as root with /dev/fuse. The Ceph packages come from tests/run-all.sh (run it once first);
# s3fs, rclone, fuse3 and fio are installed here if missing. Progress goes to stderr; the table
# is the only thing on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

SIZE_MB=${SIZE_MB:-1024} FILES=${FILES:-100000} CKPT_MB=${CKPT_MB:-4096} DIR_FILES=${DIR_FILES:-1000}
SMALL_FILES=${SMALL_FILES:-5000} SMALL_KB=${SMALL_KB:-112} READERS=${READERS:-8}
ONLY=${ONLY:-cold,warm,random,small,smallfit,meta,ckpt,dirmv} FIO_RUNTIME=${FIO_RUNTIME:-20} TIMEOUT=${TIMEOUT:-1800}
ROUNDS=${ROUNDS:-3}
STRATA_CHUNK=${STRATA_CHUNK:-8MiB}
MOUNT_TIMEOUT=60
for v in SIZE_MB FILES CKPT_MB DIR_FILES SMALL_FILES SMALL_KB READERS FIO_RUNTIME TIMEOUT ROUNDS; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "$v must be a positive integer, got '${!v}'" >&2; exit 2; }
done
SPLIT_CPUS=${SPLIT_CPUS:-}
if [[ -n $SPLIT_CPUS ]]; then
  [[ $SPLIT_CPUS =~ ^[0-9,-]+:[0-9,-]+$ ]] || { echo "SPLIT_CPUS must be STORE:CLIENT CPU lists (e.g. 0:1), got '$SPLIT_CPUS'" >&2; exit 2; }
  command -v taskset >/dev/null || { echo "SPLIT_CPUS needs taskset (util-linux)" >&2; exit 2; }
fi
for b in ${ONLY//,/ }; do
  [[ $b =~ ^(cold|warm|random|small|smallfit|meta|ckpt|dirmv)$ ]] || { echo "ONLY: unknown bench '$b'" >&2; exit 2; }
done
want() { [[ ,$ONLY, == *,$1,* ]]; }

BUCKET=strata-test AK=strata-test SK=strata-test-secret
URL=http://127.0.0.1:${RGW_PORT:-7480}
export STRATA_TEST_S3_ENDPOINT=$URL STRATA_TEST_S3_BUCKET=$BUCKET
export AWS_ACCESS_KEY_ID=$AK AWS_SECRET_ACCESS_KEY=$SK AWS_REGION=us-east-1
BIG_BYTES=$((SIZE_MB << 20)) CKPT_BYTES=$((CKPT_MB << 20)) SMALL_BYTES=$((SMALL_FILES * SMALL_KB << 10))
FIT_MIB=$((SMALL_BYTES * 3 / 2 >> 20))

log() { printf '%(%H:%M:%S)T == %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $(id -u) == 0 ]] || die "run as root (mounts, drop_caches)"
[[ -c /dev/fuse ]] || die "/dev/fuse is missing"
if ! command -v radosgw >/dev/null || ! command -v ceph-mon >/dev/null; then
  die "Ceph is not installed: run tests/run-all.sh once first (it installs the packages)"
fi

need=()
command -v s3fs >/dev/null || need+=(s3fs)
command -v rclone >/dev/null || need+=(rclone)
command -v fusermount3 >/dev/null || need+=(fuse3)
command -v fio >/dev/null || need+=(fio)
command -v curl >/dev/null || need+=(curl)
if ((${#need[@]})); then
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# tests/infra/rgw.sh needs these ports; say so now rather than after the build.
for port in 3300 6789 "${RGW_PORT:-7480}"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    die "127.0.0.1:$port is in use (another Ceph test cluster running?); this bench starts its own"
  fi
done

WORK=${BENCH_DIR:-$(mktemp -d /var/tmp/strata-bench.XXXXXX)}
mkdir -p "$WORK"/{bin,logs,results,mnt}
WORK=$(realpath "$WORK")
[[ -z $(ls -A "$WORK/results") ]] || die "$WORK holds results of an earlier run; pick a new BENCH_DIR"
RGW_DIR=$(mktemp -d /tmp/strata-rgw-bench.XXXXXX)
BIN=$WORK/bin
: >"$WORK/mounts"

# --- mounts and cleanup ------------------------------------------------------------------------
# Every FUSE daemon is recorded as "PID MOUNTPOINT" in $WORK/mounts; all mountpoints lie under
# $WORK, which is also in each daemon's argv, so a recycled pid is never signalled.
is_mounted() { grep -qs " $1 fuse" /proc/self/mounts; }
# running PID: the process exists and has not exited (a zombie counts as exited).
running() {
  local st
  st=$(sed -E 's/.*\) (.).*/\1/' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ -n $st && $st != Z ]]
}
# alive PID: running, and one of ours. Only for a daemon seen mounted: until it has exec'd,
# its argv is still this script's.
alive() { running "$1" && grep -qzF -- "$WORK" "/proc/$1/cmdline" 2>/dev/null; }

# stop_mount PID MNT: SIGTERM (every tool here unmounts itself on it), up to 60 s for a clean
# exit (strata flushes its cache index), then SIGKILL and a lazy unmount.
stop_mount() {
  local pid=$1 mnt=$2 i
  alive "$pid" && kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < 600; i++)); do
    alive "$pid" || break
    sleep 0.1
  done
  if alive "$pid"; then
    log "WARNING: pid $pid ($mnt) ignored SIGTERM for 60 s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  if is_mounted "$mnt"; then
    fusermount3 -u -z "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
  fi
  ! is_mounted "$mnt"
}

stop_all_mounts() {
  local pid mnt
  while read -r pid mnt; do
    if [[ -n $pid ]] && { alive "$pid" || is_mounted "$mnt"; }; then
      stop_mount "$pid" "$mnt" || log "WARNING: could not unmount $mnt"
    fi
  done <"$WORK/mounts"
  return 0
}

descendants() {
  local c
  for c in $(ps -o pid= --ppid "$1"); do
    echo "$c"
    descendants "$c"
  done
}

cleanup() {
  local rc=$?
  set +e
  if [[ -n $STEP_PID ]]; then # interrupted mid-step: stop the step and all it runs (dd, fio, daemons)
    # shellcheck disable=SC2046
    kill -TERM "$STEP_PID" $(descendants "$STEP_PID") 2>/dev/null
  fi
  stop_all_mounts
  bash "$ROOT/tests/infra/rgw.sh" stop "$RGW_DIR" >/dev/null 2>&1
  if grep -qs " $WORK/" /proc/self/mounts; then
    log "WARNING: something is still mounted under $WORK; leaving it in place"
  elif [[ -n ${KEEP:-} ]]; then
    log "kept $WORK"
  else
    rm -rf --one-file-system "$WORK"
  fi
  exit "$rc"
}
STEP_PID=
trap cleanup EXIT
trap 'exit 130' INT TERM

# wait_mounted PID MNT LOG
wait_mounted() {
  local pid=$1 mnt=$2 logf=$3 i
  for ((i = 0; i < MOUNT_TIMEOUT * 10; i++)); do
    is_mounted "$mnt" && return 0
    if ! running "$pid"; then
      log "mounting $mnt failed; tail of $logf:"
      tail -n 20 "$logf" >&2
      return 1
    fi
    sleep 0.1
  done
  log "$mnt not mounted after ${MOUNT_TIMEOUT}s; tail of $logf:"
  tail -n 20 "$logf" >&2
  return 1
}

# Each start_* sets MPID and MNT. The cache or state directory of the tool is wiped unless the
# caller says to keep it (strata's warm runs).
S3FS_OPTS=url=$URL,use_path_request_style,endpoint=us-east-1,passwd_file=$WORK/s3fs.passwd
# Reads: 8 ranged GETs of 8 MB in flight (prefetch is parallel_count x multipart_size), as raw_s3
# get. Metadata: a stat cache big enough for the whole tree, kept 300 s like the others, negative
# entries cached, 32 HEADs in flight per listing, and the kernel trusting attributes 300 s.
S3FS_OPTS+=,parallel_count=8,multipart_size=8,max_stat_cache_size=400000,stat_cache_expire=300
S3FS_OPTS+=,enable_noobj_cache,multireq_max=32,attr_timeout=300,entry_timeout=300
start_s3fs() {
  MNT=$WORK/mnt/$1
  mkdir -p "$MNT"
  rm -rf "$WORK/s3fs-tmp" && mkdir -p "$WORK/s3fs-tmp"
  s3fs "$BUCKET" "$MNT" -f -o "$S3FS_OPTS,tmpdir=$WORK/s3fs-tmp" >>"$WORK/logs/s3fs-$1.log" 2>&1 &
  MPID=$!
  echo "$MPID $MNT" >>"$WORK/mounts"
  wait_mounted "$MPID" "$MNT" "$WORK/logs/s3fs-$1.log"
}

# VFS cache mode full (rclone's recommended mode for reading files as files), a larger read-ahead
# and buffer, listings and attributes kept 300 s, and the listing's modification time instead of
# one HEAD per file for its metadata mtime.
RCLONE_OPTS=(--vfs-cache-mode full --vfs-read-ahead 256M --buffer-size 32M
  --dir-cache-time 300s --attr-timeout 300s --use-server-modtime)
start_rclone() {
  MNT=$WORK/mnt/$1
  mkdir -p "$MNT"
  rm -rf "$WORK/rclone-cache"
  env -u AWS_CA_BUNDLE RCLONE_CONFIG="$WORK/rclone.conf" rclone mount "bench:$BUCKET" "$MNT" \
    --cache-dir "$WORK/rclone-cache" "${RCLONE_OPTS[@]}" "${@:2}" \
    --log-level NOTICE </dev/null >>"$WORK/logs/rclone-$1.log" 2>&1 &
  MPID=$!
  echo "$MPID $MNT" >>"$WORK/mounts"
  wait_mounted "$MPID" "$MNT" "$WORK/logs/rclone-$1.log"
}

# start_strata NAME STATE keep|fresh ARGS...
start_strata() {
  local name=$1 state=$WORK/$2 keep=$3
  shift 3
  MNT=$WORK/mnt/$name
  mkdir -p "$MNT"
  [[ $keep == keep ]] || rm -rf "$state"
  "$BIN/strata" mount "s3://$BUCKET" "$MNT" --state-dir "$state" --endpoint "$URL" \
    --hot-capacity "${HOT_CAPACITY:-8GiB}" "$@" </dev/null >>"$WORK/logs/strata-$name.log" 2>&1 &
  MPID=$!
  echo "$MPID $MNT" >>"$WORK/mounts"
  wait_mounted "$MPID" "$MNT" "$WORK/logs/strata-$name.log"
}
STRATA_READ=(--immutable --chunk-size "$STRATA_CHUNK")

# --- measuring ---------------------------------------------------------------------------------
drop_caches() { sync && echo 3 >/proc/sys/vm/drop_caches; }
result() { echo "$2" >"$WORK/results/$1.r${round:-1}"; log "result $1 = $2"; }
# mibs BYTES SECONDS
mibs() { awk -v b="$1" -v s="$2" 'BEGIN { printf "%.1f", b / 1048576 / s }'; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }

# read_mibs FILE: prints the MiB/s of one dd of FILE, which must be BIG_BYTES long.
read_mibs() {
  local t0 t1 out bytes
  t0=$EPOCHREALTIME
  out=$(timeout -k 10 "$TIMEOUT" dd if="$1" of=/dev/null bs=4M 2>&1) || { log "dd $1 failed: $out"; return 1; }
  t1=$EPOCHREALTIME
  bytes=$(awk '/bytes/ { print $1; exit }' <<<"$out")
  [[ $bytes == "$BIG_BYTES" ]] || { log "dd $1 read ${bytes:-?} bytes, expected $BIG_BYTES"; return 1; }
  mibs "$bytes" "$(elapsed "$t0" "$t1")"
}

# fio_mibs FILE: bandwidth of random 256 KiB reads of FILE, in MiB/s. --invalidate=0: by default
# fio drops the file's cached pages at the start of every pass over it (every SIZE_MB read in a
# time-based run), which reaches a local file's pages but not those of the local copy behind a
# FUSE passthrough file, so the two would not be read alike. The caller drops the page cache.
fio_mibs() {
  local out kib ms err
  out=$(timeout -k 10 $((FIO_RUNTIME + 120)) fio --name=rand --filename="$1" --readonly --rw=randread \
    --bs=256k --size="${SIZE_MB}M" --direct=0 --runtime="$FIO_RUNTIME" --time_based \
    --ioengine=psync --numjobs=1 --invalidate=0 --minimal) || { log "fio $1 failed: $out"; return 1; }
  # terse v3: field 6 = KiB read, field 9 = read runtime in ms; field 5 = error.
  IFS=';' read -r _ _ _ _ err kib _ _ ms _ < <(grep '^3;' <<<"$out" | tail -n1)
  [[ $err == 0 && $kib -gt 0 && $ms -gt 0 ]] || { log "fio $1: error=$err kib=$kib ms=$ms"; return 1; }
  awk -v k="$kib" -v m="$ms" 'BEGIN { printf "%.1f", k / 1024 / (m / 1000) }'
}

# small_mibs DIR: MiB/s of READERS parallel cats over every file under DIR, the listing
# included (a data loader lists its dataset first); checks the total of the bytes read.
small_mibs() {
  local t0 t1 got
  t0=$EPOCHREALTIME
  got=$(find "$1" -type f -print0 | timeout -k 10 "$TIMEOUT" xargs -0 -P "$READERS" -n 64 cat | wc -c) ||
    { log "reading the files under $1 failed"; return 1; }
  t1=$EPOCHREALTIME
  [[ $got == "$SMALL_BYTES" ]] || { log "read $got bytes under $1, expected $SMALL_BYTES"; return 1; }
  mibs "$got" "$(elapsed "$t0" "$t1")"
}

# find_secs DIR: seconds of a find that stats every file under DIR; checks count and sizes.
find_secs() {
  local t0 t1 got
  t0=$EPOCHREALTIME
  got=$(timeout -k 10 "$TIMEOUT" find "$1" -type f -printf '%s\n' | awk '{ n++; s += $1 } END { print n + 0, s + 0 }')
  t1=$EPOCHREALTIME
  if [[ $got != "$FILES $((FILES * 1024))" ]]; then
    log "WRONG LISTING under $1: $got (files bytes), expected $FILES $((FILES * 1024))"
    echo "WRONG LISTING: ${got% *} files, ${got#* } bytes" >"$WORK/listing"
    return 1
  fi
  elapsed "$t0" "$t1"
}

s3() {
  curl -sS -m 600 --fail-with-body --aws-sigv4 "aws:amz:us-east-1:s3" --user "$AK:$SK" \
    -H 'x-amz-content-sha256: UNSIGNED-PAYLOAD' "$@"
}
# s3_size KEY: Content-Length of the object, or nothing if it does not exist.
s3_size() {
  { s3 -I "$URL/$BUCKET/$1" 2>/dev/null || true; } | tr -d '\r' |
    awk 'NR == 1 && $2 != 200 { exit } tolower($1) == "content-length:" { print $2 }'
}

# step NAME FUNCTION: runs FUNCTION in a subshell with errexit, so a failing tool is reported
# and the others still run; whatever it left mounted is unmounted afterwards. The subshell runs
# in the background so that a signal to this script is handled at once (see cleanup).
step() {
  local name=$1 rc
  shift
  log "--- $name"
  set +e
  (
    set -eE
    trap 'log "$name: failed at line $LINENO: $BASH_COMMAND"' ERR
    "$@"
  ) &
  STEP_PID=$!
  wait "$STEP_PID"
  rc=$?
  STEP_PID=
  set -e
  if ((rc != 0)); then
    log "FAILED: $name (exit $rc); see $WORK/logs"
    echo "$name" >>"$WORK/failed"
  fi
  stop_all_mounts
}

# --- the benches -------------------------------------------------------------------------------
cold_fs() { # TOOL
  "start_$1" "cold-$1" "${@:2}"
  drop_caches
  local r
  r=$(read_mibs "$MNT/bench/big.bin")
  stop_mount "$MPID" "$MNT"
  result "cold.$1" "$r"
}
cold_s3fs() { cold_fs s3fs; }
cold_rclone() { cold_fs rclone; }
cold_strata() {
  rm -f "$WORK/strata-seq.primed"
  cold_fs strata strata-seq fresh "${STRATA_READ[@]}"
  touch "$WORK/strata-seq.primed"
}
cold_raw() {
  drop_caches
  local out
  out=$(timeout -k 10 "$TIMEOUT" "$BIN/raw_s3" get "$BUCKET" bench/big.bin --parallel 8 --chunk 8MiB)
  read -r bytes secs <<<"$out"
  [[ $bytes == "$BIG_BYTES" ]] || { log "raw get read $bytes bytes, expected $BIG_BYTES"; return 1; }
  result cold.raw "$(mibs "$bytes" "$secs")"
}

# The hot tier of strata-seq holds big.bin after a full read (the cold bench's, or this one).
prime_strata() {
  [[ -f $WORK/strata-seq.primed ]] && return 0
  log "priming strata's hot tier with bench/big.bin"
  start_strata prime strata-seq fresh "${STRATA_READ[@]}"
  read_mibs "$MNT/bench/big.bin" >/dev/null
  stop_mount "$MPID" "$MNT"
  touch "$WORK/strata-seq.primed"
}

# GETs of bench/big.bin that RGW has served so far, from its access log.
big_gets() { grep -c "\"GET /$BUCKET/bench/big.bin " "$RGW_DIR/log/client.rgw.a.log" 2>/dev/null || true; }

# warm_strata KEY MEASURE ARGS...: remount on the primed state dir, page cache dropped, measure;
# then, page cache dropped again, measure a second open on the same mount (KEY.again): a mount
# may set a file up for passthrough only once it has opened it.
# A warm read should not touch the store: GETs of big.bin during it are counted and reported.
warm_strata() {
  local key=$1 measure=$2 r r2 gets
  shift 2
  prime_strata
  drop_caches
  start_strata "$key" strata-seq keep "${STRATA_READ[@]}" "$@"
  gets=$(big_gets)
  r=$("$measure" "$MNT/bench/big.bin")
  drop_caches
  r2=$("$measure" "$MNT/bench/big.bin")
  gets=$(($(big_gets) - gets))
  log "state dir holds $(du -sm "$WORK/strata-seq" | cut -f1) MiB; $gets GETs of big.bin from the store"
  stop_mount "$MPID" "$MNT"
  ((gets == 0)) || r+=" ($gets store GETs)"
  result "$key" "$r"
  result "$key.again" "$r2"
}
warm_local() { drop_caches; result warm.local "$(read_mibs "$WORK/big.bin")"; }
warm_pt() { warm_strata warm.strata_pt read_mibs; }
warm_nopt() { warm_strata warm.strata_nopt read_mibs --no-passthrough; }
random_local() { drop_caches; result random.local "$(fio_mibs "$WORK/big.bin")"; }
random_pt() { warm_strata random.strata_pt fio_mibs; }
random_nopt() { warm_strata random.strata_nopt fio_mibs --no-passthrough; }

meta_fs() { # TOOL ARGS...
  local cold cached
  drop_caches
  "start_$1" "meta-$1" "${@:2}"
  cold=$(find_secs "$MNT/bench/many") || { result "meta.cold.$1" "$(cat "$WORK/listing")"; return 1; }
  cached=$(find_secs "$MNT/bench/many") || { result "meta.cached.$1" "$(cat "$WORK/listing")"; return 1; }
  stop_mount "$MPID" "$MNT"
  result "meta.cold.$1" "$cold"
  result "meta.cached.$1" "$cached"
}
meta_s3fs() { meta_fs s3fs; }
meta_rclone() { meta_fs rclone; }
meta_strata() { meta_fs strata strata-meta fresh --metadata-ttl 300s; }

# small_fs BENCH TOOL ARGS...: the first epoch over the small files through a fresh mount, page
# cache dropped, then the second on the same mount, page cache dropped again. Between the two,
# strata is given up to 120 s to finish its whole-file copies (made in the background after a
# file is read, for passthrough), as a training job's next epoch would find them.
small_fs() {
  local bench=$1 cold warm copies=0 t0
  shift
  drop_caches
  "start_$1" "$bench-$1" "${@:2}"
  cold=$(small_mibs "$MNT/bench/small")
  if [[ $1 == strata ]]; then
    t0=$EPOCHREALTIME
    while copies=$(find "$WORK/strata-$bench" -name '*.file' | wc -l) && ((copies < SMALL_FILES)); do
      (($(elapsed "$t0" "$EPOCHREALTIME" | cut -d. -f1) < 120)) || break
      sleep 0.2
    done
    log "$copies of $SMALL_FILES whole-file copies after $(elapsed "$t0" "$EPOCHREALTIME") s"
  fi
  drop_caches
  warm=$(small_mibs "$MNT/bench/small")
  stop_mount "$MPID" "$MNT"
  result "$bench.cold.$1" "$cold"
  result "$bench.warm.$1" "$warm"
}
small_s3fs() { small_fs small s3fs; }
small_rclone() { small_fs small rclone; }
small_strata() { small_fs small strata strata-small fresh --immutable; }
# A cache of 1.5 x the dataset holds each file once, not its chunks and its copy both. rclone
# trims its cache to the limit when it polls it (once a minute), so its epochs here run untrimmed.
smallfit_rclone() { small_fs smallfit rclone --vfs-cache-max-size "${FIT_MIB}M"; }
smallfit_strata() { HOT_CAPACITY=${FIT_MIB}MiB small_fs smallfit strata strata-smallfit fresh --immutable; }
small_raw() {
  local out bytes secs n
  drop_caches
  out=$(timeout -k 10 "$TIMEOUT" "$BIN/raw_s3" get-many "$BUCKET" bench/small --parallel "$READERS")
  read -r bytes secs n <<<"$out"
  [[ $bytes == "$SMALL_BYTES" && $n == "$SMALL_FILES" ]] ||
    { log "raw get-many read $bytes bytes of $n objects, expected $SMALL_BYTES of $SMALL_FILES"; return 1; }
  result small.raw "$(mibs "$bytes" "$secs")"
}
small_local() { drop_caches; result small.local "$(small_mibs "$WORK/small")"; }

# Bytes the mount has caused to be written to the local disk so far.
written_bytes() { awk '/^write_bytes/ { print $2 }' "/proc/$MPID/io"; }
ckpt_strata() {
  local t0 t1 t2 w0 w1 w out
  # Room for the checkpoint's chunks and its whole-file copy, both kept hot.
  HOT_CAPACITY=16GiB start_strata ckpt strata-ckpt fresh --part-size 16MiB --upload-parallel 4
  drop_caches
  w0=$(written_bytes)
  t0=$EPOCHREALTIME
  out=$(timeout -k 10 "$TIMEOUT" dd if="$WORK/ckpt.src" of="$MNT/bench/ckpt.tmp" bs=4M conv=fsync 2>&1) ||
    { log "dd into strata failed: $out"; return 1; }
  # The write and its fsync alone, as the raw PUT is; the object is whole in the store by now.
  result ckpt.strata.fsync "$(elapsed "$t0" "$EPOCHREALTIME")"
  timeout -k 10 "$TIMEOUT" mv "$MNT/bench/ckpt.tmp" "$MNT/bench/ckpt.bin"
  # End to end means in the store: wait until the object is there in full.
  until [[ $(s3_size bench/ckpt.bin) == "$CKPT_BYTES" ]]; do
    (($(elapsed "$t0" "$EPOCHREALTIME" | cut -d. -f1) < TIMEOUT)) || { log "bench/ckpt.bin never reached the store"; return 1; }
    sleep 0.05
  done
  t1=$EPOCHREALTIME
  # Not timed: the checkpoint's whole-file copy for passthrough, and what the mount wrote to
  # the local disk for it (staged, cached as chunks, the copy), checked against the source.
  local copy=
  until copy=$(find "$WORK/strata-ckpt" -name '*.file' 2>/dev/null | head -n1) && [[ -n $copy ]]; do
    (($(elapsed "$t1" "$EPOCHREALTIME" | cut -d. -f1) < 300)) || { log "no whole-file copy of the checkpoint after 300 s"; return 1; }
    sleep 0.1
  done
  t2=$EPOCHREALTIME
  # The chunks are written from the copy after it is in place: wait until the mount has
  # written nothing more for a second.
  w1=$(written_bytes)
  while sleep 1; do
    w=$(written_bytes)
    [[ $w != "$w1" ]] || break
    w1=$w
  done
  cmp "$copy" "$WORK/ckpt.src" || { log "the checkpoint's whole-file copy differs from the source"; return 1; }
  result ckpt.strata.local "$(((w1 - w0) >> 20)) MiB, copy ready $(elapsed "$t1" "$t2") s after"
  stop_mount "$MPID" "$MNT"
  [[ -z $(s3_size bench/ckpt.tmp) ]] || log "WARNING: bench/ckpt.tmp is still in the store after the mv"
  s3 "$URL/$BUCKET/bench/ckpt.bin" | cmp - "$WORK/ckpt.src" || { log "bench/ckpt.bin differs from the source"; return 1; }
  s3 -X DELETE "$URL/$BUCKET/bench/ckpt.bin" >/dev/null
  result ckpt.strata "$(elapsed "$t0" "$t1")"
}
ckpt_raw() {
  local out bytes secs
  drop_caches
  out=$(timeout -k 10 "$TIMEOUT" "$BIN/raw_s3" put "$BUCKET" bench/ckpt-raw.bin "$WORK/ckpt.src" --part 16MiB --parallel 4)
  read -r bytes secs <<<"$out"
  [[ $bytes == "$CKPT_BYTES" && $(s3_size bench/ckpt-raw.bin) == "$CKPT_BYTES" ]] ||
    { log "raw put wrote $bytes bytes, expected $CKPT_BYTES"; return 1; }
  s3 -X DELETE "$URL/$BUCKET/bench/ckpt-raw.bin" >/dev/null
  result ckpt.raw "$(printf '%.3f' "$secs")"
}

# keys_under PREFIX: how many objects RGW holds under PREFIX, markers aside. Page by page: RGW may end a page
# early (IsTruncated with fewer keys than asked for), as S3 allows.
keys_under() {
  local n=0 token= page q
  while :; do
    # SigV4 wants the query in order and encoded, which curl leaves to the caller.
    q="list-type=2&max-keys=1000&prefix=$(enc "$1")"
    [[ -z $token ]] || q="continuation-token=$(enc "$token")&$q"
    page=$(s3 "$URL/$BUCKET/?$q")
    # Directory markers (keys ending in /, which s3fs makes for each directory it moves) are
    # not the objects moved.
    n=$((n + $({ grep -o '<Key>[^<]*</Key>' <<<"$page" || true; } | { grep -vc '/</Key>$' || true; })))
    [[ $page == *'<IsTruncated>true</IsTruncated>'* ]] || break
    token=$(sed -n 's/.*<NextContinuationToken>\([^<]*\)<.*/\1/p' <<<"$page")
  done
  echo "$n"
}
enc() { python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$1"; }
# dirmv_fs TOOL ARGS...: DIR_FILES objects under a directory of their own, renamed through the
# tool's mount with mv; timed until mv returns, then checked in the store: all under the new
# name, none under the old.
dirmv_fs() {
  local from=bench/dirmv-$1-r$round.tmp to=bench/dirmv-$1-r$round t0 secs out
  out=$("$BIN/raw_s3" put-many "$BUCKET" "$from" "$DIR_FILES" --size 16384 --parallel 64)
  "start_$1" "dirmv-$1" "${@:2}"
  t0=$EPOCHREALTIME
  out=$(timeout -k 10 "$TIMEOUT" mv "$MNT/$from" "$MNT/$to" 2>&1) || { log "mv through $1 failed: $out"; return 1; }
  secs=$(elapsed "$t0" "$EPOCHREALTIME")
  stop_mount "$MPID" "$MNT"
  [[ $(keys_under "$to/") == "$DIR_FILES" && $(keys_under "$from/") == 0 ]] ||
    { log "after $1's mv: $(keys_under "$to/") objects under the new name, $(keys_under "$from/") under the old"; return 1; }
  result "dirmv.$1" "$secs"
}
dirmv_s3fs() { dirmv_fs s3fs; }
dirmv_rclone() { dirmv_fs rclone; }
dirmv_strata() { dirmv_fs strata strata-dirmv fresh; }

# --- build, start, upload ----------------------------------------------------------------------
if [[ -z ${SKIP_BUILD:-} ]]; then
  log "building strata and the raw_s3 bench (release)"
  # Built with the release profile so they share dependencies with target/release/strata.
  cargo build --release --locked --bins --bench raw_s3 --message-format=json-render-diagnostics \
    >"$WORK/logs/build.json" || die "build failed (SKIP_BUILD=1 runs the binaries already built)"
fi
RAW=
if [[ -f $WORK/logs/build.json ]]; then
  RAW=$(sed -n 's/.*"executable":"\([^"]*\/raw_s3-[^"]*\)".*/\1/p' "$WORK/logs/build.json" | tail -n1)
else # SKIP_BUILD: the newest raw_s3 bench executable
  for f in target/release/deps/raw_s3-*; do
    if [[ -x $f && ! -d $f && $f -nt ${RAW:-/nonexistent} ]]; then RAW=$f; fi
  done
fi
[[ -x ${RAW:-} && -x target/release/strata ]] || die "no built strata / raw_s3 binary"
# Copies, so a concurrent build cannot swap a binary under the benchmark.
cp "$RAW" "$BIN/raw_s3"
cp target/release/strata "$BIN/strata"
help=$("$BIN/strata" mount --help 2>&1 || true)
if [[ $help == *--no-passthrough* ]]; then HAVE_NOPT=1; else HAVE_NOPT=; fi

log "starting Ceph RGW"
bash tests/infra/rgw.sh start "$RGW_DIR" >&2

printf '%s:%s\n' "$AK" "$SK" >"$WORK/s3fs.passwd"
chmod 600 "$WORK/s3fs.passwd"
cat >"$WORK/rclone.conf" <<EOF
[bench]
type = s3
provider = Ceph
env_auth = false
access_key_id = $AK
secret_access_key = $SK
region = us-east-1
endpoint = $URL
EOF

# A directory marker-free tree: bench/ exists as the prefix of bench/.keep. A small multipart
# upload first, so RGW has created its multipart pools before anything is timed.
s3 -X PUT --data-binary keep "$URL/$BUCKET/bench/.keep" >/dev/null
head -c $((6 << 20)) /dev/zero >"$WORK/warmup.bin"
"$BIN/raw_s3" put "$BUCKET" bench/warmup.bin "$WORK/warmup.bin" >/dev/null
s3 -X DELETE "$URL/$BUCKET/bench/warmup.bin" >/dev/null
rm -f "$WORK/warmup.bin"

if want cold || want warm || want random; then
  log "writing and uploading bench/big.bin ($SIZE_MB MiB)"
  head -c "$BIG_BYTES" /dev/urandom >"$WORK/big.bin"
  out=$("$BIN/raw_s3" put "$BUCKET" bench/big.bin "$WORK/big.bin")
  log "uploaded in ${out#* } s"
fi
if want meta; then
  log "uploading $FILES objects under bench/many/"
  out=$("$BIN/raw_s3" put-many "$BUCKET" bench/many "$FILES" --size 1024 --parallel 64)
  log "uploaded in ${out#* } s"
fi
if want small || want smallfit; then
  log "uploading $SMALL_FILES objects of $SMALL_KB KiB under bench/small/, and a local copy"
  out=$("$BIN/raw_s3" put-many "$BUCKET" bench/small "$SMALL_FILES" --size $((SMALL_KB << 10)) --parallel 64)
  log "uploaded in ${out#* } s"
  # The same tree and bytes (put-many's objects are all 'x'), on the disk the hot tier uses.
  python3 - "$WORK/small" "$SMALL_FILES" $((SMALL_KB << 10)) <<'PY'
import os, sys
root, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
body = b"x" * size
for i in range(count):
    d = os.path.join(root, "d%02d" % (i % 100))
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "f%05d" % i), "wb") as f:
        f.write(body)
PY
fi
if want ckpt; then
  log "writing the $CKPT_MB MiB checkpoint source"
  head -c "$CKPT_BYTES" /dev/urandom >"$WORK/ckpt.src"
fi

if [[ -n $SPLIT_CPUS ]]; then
  # Threads a daemon starts later inherit its affinity, so pinning every thread now pins Ceph
  # for good; this script's children (mounts, dd, fio, raw_s3) inherit the client's CPUs.
  log "pinning Ceph to CPUs ${SPLIT_CPUS%%:*} and the contenders to CPUs ${SPLIT_CPUS#*:}"
  ceph_pids=$(grep -lzxF -- "$RGW_DIR/ceph.conf" /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3)
  [[ -n $ceph_pids ]] || die "found no Ceph process to pin"
  for p in $ceph_pids; do taskset -a -p -c "${SPLIT_CPUS%%:*}" "$p" >/dev/null || die "pinning pid $p failed"; done
  taskset -p -c "${SPLIT_CPUS#*:}" $$ >/dev/null || die "pinning this script failed"
fi

# Every contender runs once per round, side by side, and the report gives the median of the
# rounds: single runs on a shared 2-core machine vary by a third.
for round in $(seq "$ROUNDS"); do
  log "=== round $round of $ROUNDS"
  if want cold; then
    for t in s3fs rclone strata raw; do step "cold read: $t" "cold_$t"; done
  fi
  if want warm; then
    step "warm read: local" warm_local
    step "warm read: strata" warm_pt
    [[ -z $HAVE_NOPT ]] || step "warm read: strata --no-passthrough" warm_nopt
  fi
  if want random; then
    step "random read: local" random_local
    step "random read: strata" random_pt
    [[ -z $HAVE_NOPT ]] || step "random read: strata --no-passthrough" random_nopt
  fi
  if want small; then
    for t in s3fs rclone strata raw local; do step "small files: $t" "small_$t"; done
  fi
  if want smallfit; then
    for t in rclone strata; do step "small files, cache of 1.5 x the dataset: $t" "smallfit_$t"; done
    want small || step "small files: local" small_local
  fi
  if want dirmv; then
    for t in s3fs rclone strata; do step "directory rename: $t" "dirmv_$t"; done
  fi
  if want ckpt; then
    step "checkpoint: strata" ckpt_strata
    step "checkpoint: raw" ckpt_raw
    # Deleted checkpoints stay in RGW's garbage until its GC runs; without this a few rounds
    # fill the OSD, and a full OSD blocks every write.
    timeout 600 radosgw-admin -c "$RGW_DIR/ceph.conf" gc process --include-all >/dev/null 2>&1 ||
      log "WARNING: radosgw-admin gc process failed"
  fi
done
# find + stat is slow for the peers (minutes) and steady: one round.
if want meta; then
  for t in s3fs rclone strata; do step "find+stat: $t" "meta_$t"; done
fi

# --- report ------------------------------------------------------------------------------------
# get KEY: the figure, or "failed" / "n/a".
# median: the median of the numbers on stdin, or nothing.
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else if (NR) printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
# get KEY: the median over the rounds, or "failed" / "n/a".
get() {
  local m
  m=$(cat "$WORK/results/$1".r* 2>/dev/null | median)
  if [[ -n $m ]]; then echo "$m"
  elif [[ $1 == *nopt && -z $HAVE_NOPT ]]; then echo n/a
  else echo failed; fi
}
# rratio A B: the median over rounds of A / B, each taken in the same round, so both sides share
# that round's conditions. A side is a key, or "best:max:K1,K2" (the best of keys that round).
rratio() {
  local r a b out=()
  for r in $(seq "$ROUNDS"); do
    a=$(side "$1" "$r") b=$(side "$2" "$r")
    num "$a" && num "$b" && out+=("$(awk -v a="$a" -v b="$b" 'BEGIN { if (b > 0) print a / b }')")
  done
  ((${#out[@]})) || { echo n/a; return; }
  printf '%s\n' "${out[@]}" | median | awk '{ printf "%.2f", $1 }'
}
side() {
  if [[ $1 == best:* ]]; then
    local mode=${1#best:} keys k v=()
    keys=${mode#*:} mode=${mode%%:*}
    for k in ${keys//,/ }; do v+=("$(cat "$WORK/results/$k.r$2" 2>/dev/null)"); done
    best "$mode" "${v[@]}"
  else cat "$WORK/results/$1.r$2" 2>/dev/null; fi
}
# num X: X starts with a figure (a note may follow it, as in "812.3 (4 store GETs)").
num() { [[ $1 =~ ^[0-9]+(\.[0-9]+)?( |$) ]]; }
# ratio A B: A / B to 2 places, or n/a.
ratio() {
  if num "$1" && num "$2"; then
    awk -v a="${1%% *}" -v b="${2%% *}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'
  else echo n/a; fi
}
# meets RATIO GOAL: yes / no / n/a.
meets() { if num "$1"; then awk -v r="${1%% *}" -v g="$2" 'BEGIN { print (r >= g ? "yes" : "no") }'; else echo n/a; fi; }
# best of the peers: the higher MiB/s (or, with "min", the lower seconds), ignoring failures.
best() {
  local mode=$1 b="" v
  shift
  for v in "$@"; do
    num "$v" || continue
    if [[ -z $b ]] || awk -v v="$v" -v b="$b" -v m="$mode" 'BEGIN { exit !(m == "max" ? v > b : v < b) }'; then b=$v; fi
  done
  echo "${b:-failed}"
}

env_prefix=""
[[ $SIZE_MB == 1024 ]] || env_prefix+="SIZE_MB=$SIZE_MB "
[[ $FILES == 100000 ]] || env_prefix+="FILES=$FILES "
[[ $CKPT_MB == 4096 ]] || env_prefix+="CKPT_MB=$CKPT_MB "
[[ $DIR_FILES == 1000 ]] || env_prefix+="DIR_FILES=$DIR_FILES "
[[ $SMALL_FILES == 5000 ]] || env_prefix+="SMALL_FILES=$SMALL_FILES "
[[ $SMALL_KB == 112 ]] || env_prefix+="SMALL_KB=$SMALL_KB "
[[ $READERS == 8 ]] || env_prefix+="READERS=$READERS "
[[ $ONLY == cold,warm,random,small,smallfit,meta,ckpt,dirmv ]] || env_prefix+="ONLY=$ONLY "
[[ $ROUNDS == 3 ]] || env_prefix+="ROUNDS=$ROUNDS "
[[ $FIO_RUNTIME == 20 ]] || env_prefix+="FIO_RUNTIME=$FIO_RUNTIME "
[[ $STRATA_CHUNK == 8MiB ]] || env_prefix+="STRATA_CHUNK=$STRATA_CHUNK "
[[ -z $SPLIT_CPUS ]] || env_prefix+="SPLIT_CPUS=$SPLIT_CPUS "
cpus="$(nproc) cores shared by Ceph and the contenders"
[[ -z $SPLIT_CPUS ]] || cpus="Ceph on CPUs ${SPLIT_CPUS%%:*}, the contenders on CPUs ${SPLIT_CPUS#*:}"
rev=$(git rev-parse --short HEAD 2>/dev/null || echo '?')
[[ -z $(git status --porcelain --untracked-files=no 2>/dev/null) ]] || rev+=" (with uncommitted changes)"

report() {
  local s3fs rclone strata raw local_ pt nopt peer r1 r2 sc scc
  echo "## strata mount vs peers over Ceph RGW on loopback"
  echo
  echo "strata $rev, s3fs $(s3fs --version 2>/dev/null | grep -o 'V[0-9.]*' | head -n1), $(rclone version 2>/dev/null | head -n1), $cpus, $(date -u +%F); strata reads with --chunk-size $STRATA_CHUNK; each figure is the median of $ROUNDS rounds (find + stat: one)."
  echo "Reproduce: \`${env_prefix}bash benches/cachefs.sh\`"
  echo
  echo "| bench | baseline(s) | strata | ratio | goal | met |"
  echo "| --- | --- | --- | --- | --- | --- |"
  if want cold; then
    s3fs=$(get cold.s3fs) rclone=$(get cold.rclone) strata=$(get cold.strata) raw=$(get cold.raw)
    peer=$(best max "$s3fs" "$rclone")
    r1=$(rratio cold.strata best:max:cold.s3fs,cold.rclone) r2=$(rratio cold.strata cold.raw)
    local met=no
    [[ $(meets "$r1" 1.2) == yes && $(meets "$r2" 0.9) == yes ]] && met=yes
    num "$r1" && num "$r2" || met=n/a
    echo "| cold sequential read, $SIZE_MB MiB (MiB/s) | s3fs $s3fs, rclone $rclone, raw GET x8 $raw | $strata | $r1 x best peer, $r2 x raw | >= 1.2 x best peer and >= 0.9 x raw | $met |"
  fi
  if want warm; then
    local_=$(get warm.local) pt=$(get warm.strata_pt) nopt=$(get warm.strata_nopt)
    r1=$(rratio warm.strata_pt warm.local) r2=$(rratio warm.strata_nopt warm.local)
    echo "| warm sequential read, passthrough (MiB/s) | local file $local_ | $pt | $r1 | >= 0.95 | $(meets "$r1" 0.95) |"
    echo "| warm sequential read, --no-passthrough (MiB/s) | local file $local_ | $nopt | $r2 | - | - |"
    pt=$(get warm.strata_pt.again)
    echo "| (info) warm sequential read, passthrough, 2nd open on the same mount (MiB/s) | local file $local_ | $pt | $(rratio warm.strata_pt.again warm.local) | - | - |"
  fi
  if want random; then
    local_=$(get random.local) pt=$(get random.strata_pt) nopt=$(get random.strata_nopt)
    r1=$(rratio random.strata_pt random.local) r2=$(rratio random.strata_nopt random.local)
    echo "| random 256 KiB reads, warm, passthrough (MiB/s) | local file $local_ | $pt | $r1 | >= 0.8 | $(meets "$r1" 0.8) |"
    echo "| random 256 KiB reads, warm, --no-passthrough (MiB/s) | local file $local_ | $nopt | $r2 | >= 0.8 | $(meets "$r2" 0.8) |"
    pt=$(get random.strata_pt.again)
    echo "| (info) random 256 KiB reads, passthrough, 2nd open on the same mount (MiB/s) | local file $local_ | $pt | $(rratio random.strata_pt.again random.local) | - | - |"
  fi
  if want small; then
    s3fs=$(get small.cold.s3fs) rclone=$(get small.cold.rclone) strata=$(get small.cold.strata) raw=$(get small.raw)
    r1=$(rratio small.cold.strata best:max:small.cold.s3fs,small.cold.rclone) r2=$(rratio small.cold.strata small.raw)
    echo "| small files, first epoch: $SMALL_FILES x $SMALL_KB KiB, $READERS readers (MiB/s) | s3fs $s3fs, rclone $rclone, raw GET x$READERS $raw | $strata | $r1 x best peer, $r2 x raw | - | - |"
    s3fs=$(get small.warm.s3fs) rclone=$(get small.warm.rclone) strata=$(get small.warm.strata) local_=$(get small.local)
    r1=$(rratio small.warm.strata best:max:small.warm.s3fs,small.warm.rclone) r2=$(rratio small.warm.strata small.local)
    echo "| small files, second epoch, same mount (MiB/s) | s3fs $s3fs, rclone $rclone, local files $local_ | $strata | $r1 x best peer, $r2 x local | - | - |"
  fi
  if want smallfit; then
    local_=$(get small.local)
    for e in cold:first warm:second; do
      rclone=$(get "smallfit.${e%%:*}.rclone") strata=$(get "smallfit.${e%%:*}.strata")
      r1=$(rratio "smallfit.${e%%:*}.strata" "smallfit.${e%%:*}.rclone") r2=$(rratio "smallfit.${e%%:*}.strata" small.local)
      echo "| small files, ${e#*:} epoch, cache of $FIT_MIB MiB (1.5 x the dataset) (MiB/s) | rclone $rclone, local files $local_ | $strata | $r1 x rclone, $r2 x local | - | - |"
    done
  fi
  if want meta; then
    for m in cold cached; do
      s3fs=$(get "meta.$m.s3fs") rclone=$(get "meta.$m.rclone") strata=$(get "meta.$m.strata")
      peer=$(best min "$s3fs" "$rclone")
      echo "| find + stat, $FILES files, $m (s) | s3fs $s3fs, rclone $rclone | $strata | $(ratio "$peer" "$strata") (best peer time / strata time) | - | - |"
    done
  fi
  if want dirmv; then
    s3fs=$(get dirmv.s3fs) rclone=$(get dirmv.rclone) strata=$(get dirmv.strata)
    r1=$(rratio best:min:dirmv.s3fs,dirmv.rclone dirmv.strata)
    echo "| directory rename, $DIR_FILES objects of 16 KiB, mv (s) | s3fs $s3fs, rclone $rclone | $strata | $r1 (best peer time / strata time) | - | - |"
  fi
  if want ckpt; then
    raw=$(get ckpt.raw) strata=$(get ckpt.strata)
    sc=$(num "$raw" && mibs "$CKPT_BYTES" "$raw" || echo '-')
    scc=$(num "$strata" && mibs "$CKPT_BYTES" "$strata" || echo '-')
    r1=$(rratio ckpt.raw ckpt.strata)
    echo "| checkpoint write, $CKPT_MB MiB, dd fsync + mv (s) | raw multipart put $raw s ($sc MiB/s) | $strata s ($scc MiB/s) | $r1 (raw time / strata time) | >= 0.9 | $(meets "$r1" 0.9) |"
    strata=$(get ckpt.strata.fsync)
    r1=$(rratio ckpt.raw ckpt.strata.fsync)
    echo "| (info) the same checkpoint up to its fsync, without the mv (s) | raw multipart put $raw s | $strata s | $r1 (raw time / strata time) | - | - |"
    echo "| (info) checkpoint, bytes the mount wrote locally, and its whole-file copy ready after the upload | - | $(cat "$WORK"/results/ckpt.strata.local.r* 2>/dev/null | paste -sd ';' | sed 's/;/; /g') | - | - | - |"
  fi
  echo
  echo "Figures are medians over the rounds. Ratios are the median of each round's ratio, taken side by side in that round: strata / baseline for MiB/s and baseline / strata for seconds, so above 1 strata is faster."
  [[ ! -s $WORK/failed ]] || echo "Failed steps: $(paste -sd, "$WORK/failed" | sed 's/,/, /g')."
}
mkdir -p "$ROOT/target"
report | tee "$ROOT/target/bench-cachefs.md"
if [[ -s $WORK/failed ]]; then
  log "FAILED steps (logs in $WORK/logs, kept with KEEP=1): $(paste -sd, "$WORK/failed")"
  exit 1
fi
