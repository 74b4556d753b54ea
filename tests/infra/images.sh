#!/usr/bin/env bash
# Builds the test images offline and pushes them to the test registry.
#   images.sh REGISTRY WORKDIR    # e.g. images.sh 127.0.0.1:5000 /tmp/x
# Pushes REGISTRY/strata/busybox:1, two layers:
#   1. busybox-static as /bin/busybox with its applet links;
#   2. /etc/motd ("strata layer two"), and /bin/vi deleted (a whiteout).
# and its eStargz conversions by stargz-snapshotter's own ctr-remote (run in a containerd of
# its own under WORKDIR): :esgz (default 4 MiB chunks), :esgz-64k (64 KiB chunks, so that files
# span many chunks), :zstdchunked (zstd:chunked) and :esgz-prefetch (with a prefetch landmark);
# and :esgz and :bad-toc of
# strata/specials:1 (below); and strata/python:1, a Debian bookworm minbase with python3 made by
# debootstrap from the machine's Debian mirror, with its eStargz :esgz and :esgz-opt, the latter
# made by `ctr-remote image optimize`, which runs `python3 -c 'print(1)'` in the image and puts
# the files it read before the .prefetch.landmark; and strata/python:app-1 with its :app-esgz,
# python:1 with a second layer holding a program linked against the first layer's libraries.
set -euo pipefail

REGISTRY=${1:?registry host:port}; WORK=${2:?work dir}
rm -rf -- "$WORK"; mkdir -p "$WORK"; cd "$WORK"
umask 022

umoci init --layout oci
umoci new --image oci:busybox
umoci config --image oci:busybox --config.cmd /bin/sh --config.env PATH=/bin:/usr/bin \
  --history.created_by "strata tests: empty base"

# umoci repack always builds on the image it unpacked, so unpack again for each layer.
umoci unpack --image oci:busybox bundle
mkdir -p bundle/rootfs/bin bundle/rootfs/etc bundle/rootfs/tmp
cp /bin/busybox bundle/rootfs/bin/busybox
for applet in $(bundle/rootfs/bin/busybox --list); do
  [[ $applet == busybox ]] || ln -sf busybox "bundle/rootfs/bin/$applet"
done
chmod 1777 bundle/rootfs/tmp
umoci repack --image oci:busybox --history.created_by "strata tests: busybox-static" bundle
rm -rf bundle

umoci unpack --image oci:busybox bundle
echo "strata layer two" >bundle/rootfs/etc/motd
rm bundle/rootfs/bin/vi
umoci repack --image oci:busybox --history.created_by "strata tests: motd, no vi" bundle
rm -rf bundle

umoci gc --layout oci
skopeo copy -q --dest-tls-verify=false oci:oci:busybox "docker://$REGISTRY/strata/busybox:1"
echo "images: pushed $REGISTRY/strata/busybox:1" >&2

# strata/specials:1 = busybox:1 plus a layer of what a tar can hold beyond plain files: a hard
# link, a character device, a fifo, a setuid file, an xattr, another owner, a non-ASCII name.
umoci unpack --image oci:busybox bundle
O=bundle/rootfs/opt
mkdir -p "$O"
printf 'linked content\n' >"$O/file"
ln "$O/file" "$O/hard"
mknod "$O/char" c 1 3
mkfifo "$O/fifo"
printf '#!/bin/sh\necho suid\n' >"$O/suid" && chmod 4755 "$O/suid"
python3 -c 'import os; os.setxattr("'"$O"'/file", "user.strata", b"layer three")'
printf 'owned\n' >"$O/owned" && chown 1000:1000 "$O/owned" && chmod 0640 "$O/owned"
printf 'caf\xc3\xa9\n' >"$O/caf$(printf '\xc3\xa9')"
umoci repack --image oci:specials --history.created_by "strata tests: special files" bundle
rm -rf bundle
umoci gc --layout oci
skopeo copy -q --dest-tls-verify=false oci:oci:specials "docker://$REGISTRY/strata/specials:1"
echo "images: pushed $REGISTRY/strata/specials:1" >&2

# strata/python:1: one layer, a Debian minbase root with python3.
MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
umoci new --image oci:python
umoci config --image oci:python --config.cmd /usr/bin/python3 --config.env PATH=/usr/local/bin:/usr/bin:/bin \
  --history.created_by "strata tests: empty base"
umoci unpack --image oci:python bundle
debootstrap --variant=minbase --include=python3 bookworm bundle/rootfs "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
  { echo "images: debootstrap from $MIRROR failed; its log:" >&2; tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
rm -rf bundle/rootfs/var/cache/apt/archives/*.deb
umoci repack --image oci:python --history.created_by "strata tests: debootstrap minbase + python3" bundle
rm -rf bundle
umoci gc --layout oci
skopeo copy -q --dest-tls-verify=false oci:oci:python "docker://$REGISTRY/strata/python:1"
echo "images: pushed $REGISTRY/strata/python:1" >&2

# strata/python:app-1: python:1 and a layer over it with a program of its own,
# /usr/local/bin/app (python3.11 under another name), whose libraries are in the layer under it.
umoci unpack --image oci:python bundle
mkdir -p bundle/rootfs/usr/local/bin
cp -a bundle/rootfs/usr/bin/python3.11 bundle/rootfs/usr/local/bin/app
umoci repack --image oci:pyapp --history.created_by "strata tests: a program over the base" bundle
rm -rf bundle
umoci gc --layout oci
skopeo copy -q --dest-tls-verify=false oci:oci:pyapp "docker://$REGISTRY/strata/python:app-1"
echo "images: pushed $REGISTRY/strata/python:app-1" >&2

CTD=$WORK/containerd
mkdir -p "$CTD"
cat >"$CTD/config.toml" <<TOML
version = 2
root = "$CTD/root"
state = "$CTD/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$CTD/containerd.sock"
TOML
containerd --config "$CTD/config.toml" >"$CTD/log" 2>&1 &
CTD_PID=$!
trap 'kill $CTD_PID 2>/dev/null; wait $CTD_PID 2>/dev/null || true' EXIT
remote() { ctr-remote --address "$CTD/containerd.sock" -n convert "$@"; }
for _ in $(seq 100); do remote version >/dev/null 2>&1 && break; sleep 0.1; done
remote version >/dev/null 2>&1 || { echo "images: containerd for conversion did not start" >&2; cat "$CTD/log" >&2; exit 1; }
SRC=$REGISTRY/strata/busybox:1
remote image pull --plain-http "$SRC" >/dev/null
remote image convert --oci --estargz "$SRC" "$REGISTRY/strata/busybox:esgz" >/dev/null
remote image convert --oci --estargz --estargz-chunk-size 65536 "$SRC" "$REGISTRY/strata/busybox:esgz-64k" >/dev/null
remote image convert --oci --zstdchunked "$SRC" "$REGISTRY/strata/busybox:zstdchunked" >/dev/null
# :esgz-prefetch: /bin/busybox recorded as read at start-up, so it goes before .prefetch.landmark
# (what `ctr-remote image optimize` records by running the image, given here by hand).
MANIFEST=$(remote image ls 2>/dev/null | awk -v ref="$SRC" '$1 == ref {print $3}')
printf '{"path":"bin/busybox","manifestDigest":"%s","layerIndex":0}\n' "$MANIFEST" >"$WORK/record.json"
remote image convert --oci --estargz --estargz-record-in "$WORK/record.json" "$SRC" "$REGISTRY/strata/busybox:esgz-prefetch" >/dev/null
remote image pull --plain-http "$REGISTRY/strata/specials:1" >/dev/null
remote image pull --plain-http "$REGISTRY/strata/python:1" >/dev/null
remote image convert --oci --estargz "$REGISTRY/strata/python:1" "$REGISTRY/strata/python:esgz" >/dev/null
remote image pull --plain-http "$REGISTRY/strata/python:app-1" >/dev/null
remote image convert --oci --estargz "$REGISTRY/strata/python:app-1" "$REGISTRY/strata/python:app-esgz" >/dev/null
remote image convert --oci --estargz "$REGISTRY/strata/specials:1" "$REGISTRY/strata/specials:esgz" >/dev/null
remote image optimize --oci --period 3 --entrypoint '["/usr/bin/python3"]' --args '["-c","print(1)"]' \
  "$REGISTRY/strata/python:1" "$REGISTRY/strata/python:esgz-opt" >"$WORK/optimize.log" 2>&1 ||
  { echo "images: ctr-remote image optimize failed; its log:" >&2; tail -20 "$WORK/optimize.log" >&2; exit 1; }
for ref in busybox:esgz busybox:esgz-64k busybox:zstdchunked busybox:esgz-prefetch specials:esgz python:esgz python:esgz-opt python:app-esgz; do
  remote image push --plain-http "$REGISTRY/strata/$ref" >/dev/null
  echo "images: pushed $REGISTRY/strata/$ref (eStargz or zstd:chunked by ctr-remote)" >&2
done

# specials:bad-toc: specials:esgz whose third layer annotates a TOC digest its TOC does not have
# (blobs no other test downloads whole, so the registry log tells who fetched what).
OCI_MANIFEST=application/vnd.oci.image.manifest.v1+json
curl -fsS -H "Accept: $OCI_MANIFEST" "http://$REGISTRY/v2/strata/specials/manifests/esgz" |
  python3 -c 'import json, sys
m = json.load(sys.stdin)
m["layers"][2]["annotations"]["containerd.io/snapshot/stargz/toc.digest"] = "sha256:" + "0" * 64
sys.stdout.write(json.dumps(m))' >"$WORK/bad-toc.json"
curl -fsS -X PUT -H "Content-Type: $OCI_MANIFEST" --data-binary "@$WORK/bad-toc.json" \
  "http://$REGISTRY/v2/strata/specials/manifests/bad-toc" >/dev/null
echo "images: pushed $REGISTRY/strata/specials:bad-toc (a wrong toc.digest on layer 3)" >&2
