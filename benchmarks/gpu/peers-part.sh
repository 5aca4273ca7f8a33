#!/usr/bin/env bash
# Append the carried part(s) of the peers' wheel tarball to /tmp/peerparts (kept while this
# machine stays warm), for .gpu/peers.sh. Usage: bash .gpu/peers-part.sh [more commands follow]
set -euo pipefail
mkdir -p /tmp/peerparts
for part in .gpu/wheels/parts/peers.tar.part-*; do
    [ -f "$part" ] || { echo "no part carried (carry .gpu/wheels/parts/peers.tar.part-XX)"; exit 1; }
    cp "$part" /tmp/peerparts/
done
ls -l /tmp/peerparts
