#!/usr/bin/env bash
# Builds the peers' wheel tarball for the offline GPU machine (run here, with the package index
# reachable): downloads the Python 3.12 manylinux wheels of DALI 2.4 (cuda130) and its needs,
# SPDL 0.8 with PyAV 19.0.2 (its FFmpeg), torchdata 0.11 and a few pure packages the machine may
# lack; tars them in name order and splits the tar into 50 MiB parts (a call carries 64 MiB with the tree) under .gpu/wheels/parts/
# (one part a device call: peers-part.sh). Prints the tar's sha256: peers-setup.sh pins it (EXPECT).
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
dl=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dl" \
  nvidia-dali-cuda130==2.4.0 nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-libnvcomp-cu13==5.3.0.16 \
  nvidia-nvjpeg==13.3.2.43 astunparse==1.6.3 gast==0.7.0 makefun==1.16.0 optree==0.20.0 nvtx==0.2.17 \
  libcst==1.9.0 spdl-io==0.8.0 spdl-core==0.8.0 av==19.0.2 torchdata==0.11.0 \
  six==1.17.0 wheel==0.48.0 pyyaml==6.0.4 typing-extensions==4.16.0 urllib3==2.8.0 requests==2.34.2 \
  packaging==26.3 charset-normalizer==3.5.3 idna==3.20 certifi==2026.10.19.post1
tar -cf "$dl/peers.tar" -C "$dl" --sort=name --owner=0 --group=0 --mtime=2026-11-27 $(cd "$dl" && ls *.whl)
mkdir -p .gpu/wheels/parts && rm -f .gpu/wheels/parts/peers.tar.part-*
split -b 50M -a 2 "$dl/peers.tar" .gpu/wheels/parts/peers.tar.part-
ls -l .gpu/wheels/parts
sha256sum "$dl/peers.tar"
rm -rf "$dl"
