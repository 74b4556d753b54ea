#!/usr/bin/env bash
# Single-node Ceph (mon + mgr + memstore OSD + radosgw) on loopback, for
# integration tests. Runs as root, needs no systemd and no /etc/ceph.
#   rgw.sh start DIR   # wipe DIR, bring the cluster up, create user + bucket
#   rgw.sh stop DIR    # kill the daemons, remove DIR
# Env: RGW_PORT (default 7480), RGW_TLS_PORT (default 7443), START_TIMEOUT seconds (default 120).
# RGW also serves HTTPS on RGW_TLS_PORT, with a certificate for 127.0.0.1 signed by a CA made
# for this cluster: DIR/tls/ca.pem, which no system trust store holds.
set -euo pipefail

CMD=${1:-}; DIR=${2:-}
[[ $CMD == start || $CMD == stop ]] && [[ -n $DIR ]] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
DIR=$(realpath -m -- "$DIR")
CONF=$DIR/ceph.conf
RGW_PORT=${RGW_PORT:-7480}
[[ $RGW_PORT =~ ^[0-9]+$ ]] || { echo "RGW_PORT must be a number" >&2; exit 2; }
RGW_TLS_PORT=${RGW_TLS_PORT:-7443}
[[ $RGW_TLS_PORT =~ ^[0-9]+$ ]] || { echo "RGW_TLS_PORT must be a number" >&2; exit 2; }
START_TIMEOUT=${START_TIMEOUT:-120}
AK=strata-test SK=strata-test-secret BUCKET=strata-test
URL=http://127.0.0.1:$RGW_PORT
export CEPH_CONF=$CONF

say() { echo "rgw: $*" >&2; }

# Every daemon gets "-c $CONF", so that argv element identifies *our* processes
# (optionally also requiring argv element $1). The pattern goes in via stdin so
# that grep's own argv never matches.
our_pids() {
  local f
  for f in $(grep -lzxF -f - /proc/[0-9]*/cmdline 2>/dev/null <<<"$CONF"); do
    [[ -z ${1:-} ]] || grep -qzxF -f - "$f" 2>/dev/null <<<"$1" || continue
    f=${f#/proc/}; echo "${f%/cmdline}"
  done
}

# Refuse to rm -rf anything that does not look like one of our directories.
safe_wipe() {
  [[ $DIR != / && -n $DIR ]] || { say "refusing to wipe '$DIR'"; exit 1; }
  if [[ -d $DIR && ! -f $CONF && -n $(ls -A "$DIR") ]]; then
    say "refusing to wipe $DIR: non-empty and has no ceph.conf (not ours?)"; exit 1
  fi
  rm -rf -- "$DIR"
}

stop() {
  local pids=() p i
  # A stale pid file may name a reused pid: only trust it if it runs our conf.
  for p in client.rgw.a osd.0 mgr.a mon.a; do
    p=$(cat "$DIR/run/$p.pid" 2>/dev/null) || continue
    grep -qzxF -f - "/proc/$p/cmdline" 2>/dev/null <<<"$CONF" && pids+=("$p")
  done
  # Fallback for daemons whose pid file is missing (e.g. killed mid-startup).
  mapfile -t -O ${#pids[@]} pids < <(our_pids)
  # SIGKILL straight away: all state is thrown away with DIR, and on SIGTERM
  # memstore dumps the whole store to disk and ceph-mgr can take >10 s to exit.
  ((${#pids[@]})) && kill -KILL "${pids[@]}" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    [[ -z $(our_pids) ]] && break
    sleep 0.1
  done
  [[ -z $(our_pids) ]] || { say "ERROR: processes still alive after SIGKILL: $(our_pids | xargs)"; exit 1; }
  safe_wipe
}

logs() {
  local f
  for f in "$DIR"/log/{mkfs,mon.a,mgr.a,osd.0,client.rgw.a}.log "$DIR"/log/*.out; do
    [[ -f $f ]] && { echo "----- tail $f" >&2; tail -n 25 "$f" >&2; }
  done
  return 0
}
die() { say "ERROR: $*"; logs; say "daemons left as-is for inspection; clean up with: $0 stop $DIR"; exit 1; }

# Another cluster (e.g. a leftover from a different DIR) on our ports would make
# our daemons fail with confusing bind errors; name the culprit instead.
# (/dev/tcp needs nothing installed; ss, if present, only adds the owner.)
check_ports() {
  local port pid cmd
  for port in 3300 6789 "$RGW_PORT" "$RGW_TLS_PORT"; do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || continue
    pid=$(ss -Hltnp "sport = :$port" 2>/dev/null | grep -o 'pid=[0-9]*' | head -n1 | cut -d= -f2) || true
    cmd=$(tr '\0' ' ' 2>/dev/null </proc/"${pid:-0}"/cmdline) || cmd='?'
    say "ERROR: 127.0.0.1:$port is already in use by pid ${pid:-?}: $cmd"
    [[ $cmd =~ -c\ ([^ ]+)/ceph\.conf ]] &&
      say "it looks like a leftover test cluster; remove it with: $0 stop ${BASH_REMATCH[1]}"
    exit 1
  done
}

# Seconds left of the start budget (at least 1, so timeout/curl -m stay valid).
left() { local l=$((START_TIMEOUT - SECONDS)); echo $((l > 0 ? l : 1)); }

start() {
  SECONDS=0; local t0=${EPOCHREALTIME/./}
  stop
  check_ports
  mkdir -p "$DIR"/{run,log,mon,mgr/a,osd,rgw/rgw.a,tls}
  local fsid; fsid=$(uuidgen)
  # A CA of this cluster's own and a server certificate for 127.0.0.1, as an on-premises Ceph
  # has: clients must be given the CA to reach RGW over HTTPS.
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=strata test CA $fsid" \
    -keyout "$DIR/tls/ca.key" -out "$DIR/tls/ca.pem" >"$DIR/log/tls.log" 2>&1 || die "making the test CA failed"
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout "$DIR/tls/server.key" \
    -out "$DIR/tls/server.csr" >>"$DIR/log/tls.log" 2>&1 || die "making the server key failed"
  printf 'subjectAltName = IP:127.0.0.1\nbasicConstraints = CA:FALSE\n' >"$DIR/tls/ext.cnf"
  openssl x509 -req -in "$DIR/tls/server.csr" -CA "$DIR/tls/ca.pem" -CAkey "$DIR/tls/ca.key" \
    -CAcreateserial -days 2 -extfile "$DIR/tls/ext.cnf" -out "$DIR/tls/server.pem" >>"$DIR/log/tls.log" 2>&1 \
    || die "signing the server certificate failed"
  # Why the non-obvious settings:
  #  - auth none + ms *mode = crc: with cephx off, radosgw otherwise fails with
  #    "get_initial_auth_request returned -13" and hangs for rgw_init_timeout.
  #  - size 1 / chooseleaf 0: one OSD must be enough for PGs to go active.
  #  - small pg num, no autoscaler: rgw + mgr create ~8 pools; default 32 PGs
  #    each would exceed mon_max_pg_per_osd on a single OSD and pool creation fails.
  #  - bluestore on a sparse file (outside the OSD data dir: ELOOP otherwise): data goes to
  #    disk, not RAM, so multi-GiB tests do not swell the OSD, and RGW's deferred garbage
  #    collection of deleted objects costs disk, not memory. ~4 s slower than memstore.
  #  - paxos propose interval: the mon batches map changes for 1 s by default,
  #    and bring-up is a chain of ~15 osdmap epochs (OSD boot, one per pool).
  #  - [client] admin socket with $pid: concurrent CLI calls must not collide.
  cat >"$CONF" <<EOF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:3300,v1:127.0.0.1:6789]
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
ms client mode = crc
ms mon service mode = crc
ms service mode = crc
ms cluster mode = crc
ms mon cluster mode = crc
keyring = $DIR/keyring
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
mon data = $DIR/mon/\$id
mgr data = $DIR/mgr/\$id
osd data = $DIR/osd/\$id
rgw data = $DIR/rgw/\$id
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim allowed = false
mon allow pool delete = true
osd crush chooseleaf type = 0
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon max pg per osd = 1000
osd objectstore = bluestore
bluestore block path = $DIR/bluestore.img
bluestore block size = $((40 << 30))
bluestore block create = true
bluestore fsck on mkfs = false
bluestore cache autotune = false
bluestore cache size = $((256 << 20))
osd memory target = $((1 << 30))
mon data avail warn = 1
mon data avail crit = 0
paxos propose interval = 0.05
paxos min wait = 0.01
[client]
admin socket = $DIR/run/\$name.\$pid.asok
[client.rgw.a]
admin socket = $DIR/run/\$name.asok
rgw frontends = beast endpoint=127.0.0.1:$RGW_PORT ssl_endpoint=127.0.0.1:$RGW_TLS_PORT ssl_certificate=$DIR/tls/server.pem ssl_private_key=$DIR/tls/server.key tcp_nodelay=1
rgw init timeout = $START_TIMEOUT
EOF
  local asroot=(-c "$CONF" --setuser root --setgroup root)
  # Daemons keep the inherited stdout/stderr open after forking; if the caller
  # pipes our output (tee, $(...)) it would never see EOF, so send them to files.
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:3300,v1:127.0.0.1:6789]" \
    "$DIR/monmap" >/dev/null
  ceph-mon "${asroot[@]}" -i a --mkfs --monmap "$DIR/monmap" >"$DIR/log/mkfs.log" 2>&1 \
    || die "ceph-mon --mkfs failed: $(cat "$DIR/log/mkfs.log")"
  ceph-mon "${asroot[@]}" -i a </dev/null >"$DIR/log/mon.out" 2>&1 || die "ceph-mon failed to start"
  ceph-mgr "${asroot[@]}" -i a </dev/null >"$DIR/log/mgr.out" 2>&1 || die "ceph-mgr failed to start"

  local uuid id; uuid=$(uuidgen)
  id=$(timeout 30 ceph -c "$CONF" --connect-timeout 20 osd new "$uuid" 2>>"$DIR/log/mkfs.log") \
    || die "ceph osd new failed (mon not up?)"
  mkdir -p "$DIR/osd/$id"
  ceph-osd "${asroot[@]}" -i "$id" --mkfs --osd-uuid "$uuid" >>"$DIR/log/mkfs.log" 2>&1 \
    || die "ceph-osd --mkfs failed: $(tail -n 20 "$DIR/log/mkfs.log")"
  ceph-osd "${asroot[@]}" -i "$id" </dev/null >"$DIR/log/osd.out" 2>&1 || die "ceph-osd failed to start"

  radosgw "${asroot[@]}" -n client.rgw.a </dev/null >"$DIR/log/rgw.out" 2>&1 || die "radosgw failed to start"

  # rgw only listens once its pools exist (OSD up, PGs active); any HTTP status
  # means it serves. Its pid file appears late, so spot an early crash by argv.
  local code
  until code=$(curl -s -o /dev/null -m 2 -w '%{http_code}' "$URL/") && [[ $code != 000 ]]; do
    ((SECONDS < START_TIMEOUT)) || die "radosgw did not answer on $URL within ${START_TIMEOUT}s"
    [[ -n $(our_pids radosgw) ]] || die "radosgw exited during startup"
    sleep 0.5
  done

  timeout "$(left)" radosgw-admin -c "$CONF" user create --uid "$AK" --display-name "strata tests" \
    --access-key "$AK" --secret-key "$SK" >"$DIR/log/user.json" 2>>"$DIR/log/mkfs.log" \
    || die "radosgw-admin user create failed: $(tail -n 5 "$DIR/log/mkfs.log")"

  # rgw checks x-amz-content-sha256, which curl's --aws-sigv4 does not send itself.
  s3() { curl -sS -m "$(left)" --fail-with-body --aws-sigv4 "aws:amz:us-east-1:s3" \
    --user "$AK:$SK" -H 'x-amz-content-sha256: UNSIGNED-PAYLOAD' "$@"; }
  s3 -X PUT "$URL/$BUCKET" >/dev/null || die "creating bucket $BUCKET failed"
  local probe got; probe="strata probe $fsid"
  s3 -X PUT --data-binary "$probe" "$URL/$BUCKET/.rgw-sh-probe" >/dev/null || die "probe PUT failed"
  got=$(s3 "$URL/$BUCKET/.rgw-sh-probe") || die "probe GET failed"
  [[ $got == "$probe" ]] || die "probe round-trip mismatch: got '$got'"
  s3 -X DELETE "$URL/$BUCKET/.rgw-sh-probe" >/dev/null || die "probe DELETE failed"

  got=$(curl -sS -m "$(left)" --cacert "$DIR/tls/ca.pem" -o /dev/null -w '%{http_code}' \
    "https://127.0.0.1:$RGW_TLS_PORT/") || die "RGW does not answer over HTTPS on port $RGW_TLS_PORT"
  local ds=$(((${EPOCHREALTIME/./} - t0) / 100000))
  echo "rgw: ready at $URL and https://127.0.0.1:$RGW_TLS_PORT (bucket $BUCKET) in $((ds / 10)).$((ds % 10)) s"
}

"$CMD"
