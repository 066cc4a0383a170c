# Source from the repository root on a machine where tierstack cannot be pip-installed
# (the GPU machine of the device tool: no network, no venv): carried wheels go to
# /tmp/site (the GPU machine lacks, as of 2026-12: crc32c, grpcio-health-checking and grpcio
# at the proto/ stubs' version 1.85.1; ray, fastapi, uvicorn; deepspeed and its small
# dependencies for the side-by-side benches), the package is assembled under /tmp/pkg with its native libraries compiled
# (the flags are setup.py's).
set -e
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
rm -rf /tmp/pkg && mkdir -p /tmp/pkg
# The folders come from pyproject's package-dir (one owner of the layout: a room added
# there, as cli/ was, is assembled here too).
python3 - <<'PY'
import shutil, tomllib
dirs = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
for package, folder in dirs.items():
    shutil.copytree(folder, "/tmp/pkg/" + package.replace(".", "/"), dirs_exist_ok=True)
PY
cc -O2 -std=c11 -D_GNU_SOURCE -shared -fPIC -pthread \
    -o /tmp/pkg/tierstack/services/tier_manager/native/libtierstack_blockio.so \
    services/tier_manager/native/blockio.c
cc -O3 -std=c11 -D_GNU_SOURCE -ffp-contract=off -fno-math-errno -shared -fPIC -pthread \
    -o /tmp/pkg/tierstack/services/tier_manager/native/libtierstack_adamw.so \
    services/tier_manager/native/adamw.c -lm
export PYTHONPATH=/tmp/pkg:$PYTHONPATH
# Carried Debian libaio (.whl/deb/*.deb) for DeepSpeed's async_io op (bench/vs_deepspeed.py):
# unpacked into a private prefix, never into /.
if ls .whl/deb/*.deb >/dev/null 2>&1; then
    mkdir -p /tmp/aio && for f in .whl/deb/*.deb; do dpkg -x "$f" /tmp/aio; done
    aio_lib=/tmp/aio/usr/lib/x86_64-linux-gnu
    export CFLAGS="-I/tmp/aio/usr/include ${CFLAGS:-}" LDFLAGS="-L$aio_lib ${LDFLAGS:-}"
    export LIBRARY_PATH=$aio_lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    export CPATH=/tmp/aio/usr/include${CPATH:+:$CPATH} LD_LIBRARY_PATH=$aio_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export TORCH_CUDA_ARCH_LIST=9.0
fi
# A carried fio (.whl/bin/fio, built from source against the carried libaio) for the
# benches that compare the disk with fio (bench/io.py, bench/vs_deepspeed.py --fio).
if [ -x .whl/bin/fio ]; then
    export PATH=$PWD/.whl/bin:$PATH
fi
set +e
