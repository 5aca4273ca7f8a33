#!/usr/bin/env bash
# Sourced by peers.sh and peers-resnet18.sh (from the repo root): the shared variables, stamp and
# budget, the peers' wheels installed from the carried peers.tar parts, the libraries SPDL needs,
# the peers' status in $OUT/peers_status.log, and the extension built. PEERS_BUDGET_S: the call's
# seconds for budget() (default 460: 8 minutes less 20 s to write up).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/peers-out}; mkdir -p "$OUT"
W=/tmp/peers-work; mkdir -p "$W"
SITE=${PEERS_SITE:-/tmp/site}                                  # where the wheels are installed
CLASSES=${PEERS_CLASSES:-100} PER_CLASS=${PEERS_PER_CLASS:-100} # the image folder
ARRAY_GIB=${PEERS_ARRAY_GIB:-1} RECORD_GIB=${PEERS_RECORD_GIB:-0.25}
T0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
# a step's time limit: its own, or what is left of PEERS_BUDGET_S, if less
budget() { local left=$(( ${PEERS_BUDGET_S:-460} - ($(date +%s) - T0) )); (( left < 10 )) && left=10; echo $(( left < $1 ? left : $1 )); }

stamp "wheels"
mkdir -p /tmp/peerparts
cp .gpu/wheels/parts/peers.tar.part-* /tmp/peerparts/ 2>/dev/null || true
ls -l /tmp/peerparts
EXPECT=89314faa99438bafb3dbdcbc8cb07b912cc1d9344e1a58549f1754504f304eb3
if [ ! -d $SITE/nvidia/dali ]; then
    cat /tmp/peerparts/peers.tar.part-* > /tmp/peers.tar
    GOT=$(sha256sum /tmp/peers.tar | cut -d' ' -f1)
    if [ "$GOT" != "$EXPECT" ]; then
        echo "peers.tar sha256 $GOT, expected $EXPECT: a part is missing or damaged (parts aa..af)"
        echo "the peer rows will say 'not installed'"
    else
        rm -rf /tmp/peerwheels && mkdir -p /tmp/peerwheels && tar -xf /tmp/peers.tar -C /tmp/peerwheels
        # only what this Python lacks: two versions of one package stop the install
        WHEELS=$(python3 - <<'PY'
import glob, importlib.metadata as md, os, re
for path in sorted(glob.glob("/tmp/peerwheels/*.whl")):
    name = re.sub(r"[-_.]+", "-", os.path.basename(path).split("-")[0]).lower()
    try:
        md.version(name)
        print(f"# {name} already installed: {md.version(name)}", file=__import__("sys").stderr)
    except md.PackageNotFoundError:
        print(path)
PY
)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $WHEELS
    fi
fi
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
# SPDL links FFmpeg's libraries by their plain names (libavutil.so.61, ...): where the system has
# none, PyAV's bundled FFmpeg 9 (av 19, the same majors as SPDL's _spdl_ffmpeg9) under those names
mkdir -p /tmp/fflinks
AVLIBS=$(python3 -c "import importlib.util as u, os; s = u.find_spec('av'); print(os.path.join(os.path.dirname(s.origin), os.pardir, 'av.libs') if s else '')")
if ! ldconfig -p 2>/dev/null | grep -q "libavutil.so"; then
    for lib in avutil avcodec avformat avdevice avfilter swscale swresample; do
        f=$(ls "$AVLIBS"/lib$lib-*.so.* 2>/dev/null | head -1)
        [ -n "$f" ] && ln -sf "$f" "/tmp/fflinks/lib$lib.so.$(basename "$f" | sed -E 's/.*\.so\.([0-9]+).*/\1/')"
    done
    echo "FFmpeg for SPDL: PyAV's ($(ls /tmp/fflinks | tr '\n' ' '))"
fi
# SPDL's CUDA extension (its nvJPEG decode) needs libnvcuvid.so, the driver's NVDEC library
if ! ldconfig -p 2>/dev/null | grep -q "libnvcuvid.so "; then
    cuvid=$(ls /usr/local/nvidia/lib64/libnvcuvid.so.1 /usr/lib/x86_64-linux-gnu/libnvcuvid.so.1 2>/dev/null | head -1)
    [ -n "$cuvid" ] && ln -sf "$cuvid" /tmp/fflinks/libnvcuvid.so
    echo "libnvcuvid for SPDL's nvJPEG: ${cuvid:-not found (the spdl-nvjpeg row will fail)}"
fi
TORCH_LIBS=$(python3 -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), '..', 'nvidia', 'cu13', 'lib'))")
export LD_LIBRARY_PATH=/tmp/fflinks:${AVLIBS:-$SITE/av.libs}:$TORCH_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
python3 -c "from torch_fastload._benchutil import peers; [print(peers.status(n).line()) for n in peers.PEERS]" 2>&1 | tee "$OUT/peers_status.log"
{ echo "FFCV probe: pkg-config opencv4: $(pkg-config --exists opencv4 2>/dev/null && echo yes || echo no)," \
       "libturbojpeg: $(pkg-config --exists libturbojpeg 2>/dev/null && echo yes || echo no)," \
       "ldconfig turbojpeg: $(ldconfig -p 2>/dev/null | grep -c turbojpeg), gcc: $(command -v g++ || echo none)"; } | tee -a "$OUT/peers_status.log"
python3 -c "import nvidia.dali as d, nvidia.dali.backend as b; print('DALI', d.__version__, 'CUDA', b.GetCudaVersion())" 2>&1 | tail -3 | tee -a "$OUT/peers_status.log"
python3 -c "import spdl.io, spdl.io.lib as l; l._libspdl.make_demuxer; print('SPDL libspdl ok')" 2>&1 | tail -2 | tee -a "$OUT/peers_status.log"
python3 -c "import spdl.io.lib as l; l._libspdl_cuda.cuda_config; print('SPDL libspdl_cuda ok')" 2>&1 | tail -2 | tee -a "$OUT/peers_status.log"

stamp "build"
timeout $(budget 240) python3 setup.py build_ext --inplace -q > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
