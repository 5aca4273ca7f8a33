#!/usr/bin/env bash
# Builds arrow_pool.cpp against the installed pyarrow wheel's own headers and libraries (no
# Arrow source or system package needed), next to this script:
#   bash benchmarks/probes/arrow_pool/build.sh && python3 benchmarks/probes/arrow_pool/check.py
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
inc=$($PY -c "import pyarrow as pa; print(pa.get_include())")
lib=$($PY -c "import pyarrow as pa; print(pa.get_library_dirs()[0])")
pyinc=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
so=$($PY -c "import pyarrow as pa; print(pa.__version__.split('.')[0] + '00')")
g++ -O2 -std=c++20 -fPIC -shared "$here/arrow_pool.cpp" -I"$inc" -I"$pyinc" -L"$lib" \
  -l:libarrow.so.$so -l:libparquet.so.$so -l:libarrow_python.so.$so -Wl,-rpath,"$lib" -o "$here/arrow_pool$suffix"
echo "built $here/arrow_pool$suffix"
