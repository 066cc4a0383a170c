# Source from the repository root on a machine where tierstack cannot be pip-installed
# (the GPU machine of the device tool: no network, no venv): carried wheels go to
# /tmp/site, the package is assembled under /tmp/pkg with its native IO loop compiled.
set -e
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
rm -rf /tmp/pkg && mkdir -p /tmp/pkg
cp -r tierstack /tmp/pkg/
cp -r services worker proto dashboards /tmp/pkg/tierstack/
cc -O2 -std=c11 -D_GNU_SOURCE -shared -fPIC -pthread \
    -o /tmp/pkg/tierstack/services/tier_manager/native/libtierstack_blockio.so \
    services/tier_manager/native/blockio.c
export PYTHONPATH=/tmp/pkg:$PYTHONPATH
set +e
