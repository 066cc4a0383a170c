# Two entry points, each doing all of its own set-up on a fresh machine:
#   make run    the main job: `tierstack train` on the embedded single-node default
#   make test   the whole test suite (what .ci/run calls)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test bench-io bench-ensure-layer bench-train bench-scheduler proto clean

$(STAMP): pyproject.toml setup.py services/tier_manager/native/blockio.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: this machine keeps the CPU build of 2.13.0 on disk, while
	# an unpinned requirement can pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
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

bench-scheduler: $(STAMP)
	$(PY) bench/scheduler.py

# Regenerate proto/*_pb2*.py from proto/*.proto (a test fails when they are out of date).
proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
