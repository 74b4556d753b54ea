#!/usr/bin/env bash
# Builds the test images offline and pushes them to the test registry.
#   images.sh REGISTRY WORKDIR    # e.g. images.sh 127.0.0.1:5000 /tmp/x
# Pushes REGISTRY/strata/busybox:1, two layers:
#   1. busybox-static as /bin/busybox with its applet links;
#   2. /etc/motd ("strata layer two"), and /bin/vi deleted (a whiteout).
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
