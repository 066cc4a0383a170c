# Two entry points, each doing all of its own set-up on a fresh machine:
#   make run    the main job: `tierstack train` on the embedded single-node default
#   make test   the whole test suite (what .ci/run calls)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test bench-io bench-ensure-layer bench-train bench-partitioned proto clean

$(STAMP): pyproject.toml setup.py services/tier_manager/native/blockio.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: this machine keeps the CPU build of 2.13.0 on disk, while
	# an unpinned requirement can pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# openssh-server + rsync: the `ray up` end-to-end test reaches its two loopback nodes
	# through a local sshd, as Ray's cluster launcher reaches real ones (root only).
	if [ "$$(id -u)" = 0 ] && ! { command -v sshd >/dev/null || [ -x /usr/sbin/sshd ]; } || ! command -v rsync >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends openssh-server rsync >/dev/null; \
	  else echo "not root: skipping openssh-server/rsync (the ray up test will skip)"; fi; \
	fi
	touch $@

run: $(STAMP)
	$(VENV)/bin/tierstack train

test: $(STAMP)
	$(PY) -m pytest

bench-io: $(STAMP)
	$(PY) bench/io.py

bench-ensure-layer: $(STAMP)
	$(PY) bench/ensure_layer.py

bench-train: $(STAMP)
	$(PY) bench/train.py

bench-partitioned: $(STAMP)
	$(PY) bench/partitioned.py

# Regenerate proto/*_pb2*.py from proto/*.proto (a test fails when they are out of date).
proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
