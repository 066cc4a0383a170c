# Two entry points, each doing all of its own set-up on a fresh machine:
#   make run    the main job: `tierstack train` on the embedded single-node default
#   make test   the whole test suite (what .ci/run calls)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test docs docs-reference docs-layout bench-io bench-ensure-layer bench-train bench-scheduler bench-partitioned bench-construct proto clean system-packages

$(STAMP): pyproject.toml setup.py services/tier_manager/native/blockio.c \
          services/tier_manager/native/adamw.c
	@echo "setting up $(VENV) (torch, then tierstack and its test extras; log: $(VENV)/install.log)"
	@$(PYTHON) -m venv $(VENV)
	@# torch first and pinned: this machine keeps the CPU build of 2.13.0 on disk, while
	@# an unpinned requirement can pull a multi-GB CUDA build. pip's and setuptools' chatter
	@# goes to the log, so the job's own first lines are the first on the screen.
	@{ $(PY) -m pip install --quiet --upgrade pip && \
	   $(PY) -m pip install --quiet torch==2.13.0 && \
	   $(PY) -m pip install --quiet -e '.[test]'; } > $(VENV)/install.log 2>&1 || \
	  { tail -40 $(VENV)/install.log; echo "set-up failed: see $(VENV)/install.log"; exit 1; }
	@touch $@

# Debian packages the tests drive: chromium (the dashboard test, through the playwright
# package with executable_path=/usr/bin/chromium), promtool (from `prometheus`), and
# openssh-server + rsync (the `ray up` test reaches its two loopback nodes through a local
# sshd, as Ray's cluster launcher reaches real ones).
# Installed only when the binary is missing; without root or apt-get, those tests skip
# and say why.
SYSTEM_PACKAGES := /usr/bin/chromium:chromium /usr/bin/promtool:prometheus \
                   /usr/sbin/sshd:openssh-server /usr/bin/rsync:rsync
system-packages:
	@missing=""; for pair in $(SYSTEM_PACKAGES); do \
	  [ -x "$${pair%%:*}" ] || missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "warning: cannot install$$missing (needs root and apt-get); the dashboard" \
	         "and promtool tests will skip"; \
	  fi; \
	fi

run: $(STAMP)
	$(VENV)/bin/tierstack train

# The suite on two workers, a test file each at a time (pytest-xdist), then the tests
# that time things or start Ray clusters alone (tests/conftest.py's SERIAL); both parts
# always run, and the target fails if either did. One torch thread per process (unless
# OMP_NUM_THREADS says otherwise): the suite's processes already fill the cores, and
# two-thread torch in each of them ran test_job and test_launch 9% slower on 2 cores.
test: $(STAMP) system-packages
	@export OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}; \
	  $(PY) -m pytest -n 2 --dist loadfile -m "not serial"; parallel=$$?; \
	  $(PY) -m pytest -m serial; serial=$$?; \
	  [ $$parallel -eq 0 ] && [ $$serial -eq 0 ]

bench-io: $(STAMP)
	$(PY) bench/io.py

bench-ensure-layer: $(STAMP)
	$(PY) bench/ensure_layer.py

bench-train: $(STAMP)
	$(PY) bench/train.py

bench-scheduler: $(STAMP)
	$(PY) bench/scheduler.py

bench-partitioned: $(STAMP)
	$(PY) bench/partitioned.py

bench-construct: $(STAMP)
	$(PY) bench/construct.py

# The documentation site (docs/, mkdocs.yml) into site/; a broken link fails the build.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

# Regenerate docs/reference/configuration.md from the config schema (a test checks it).
docs-reference: $(STAMP)
	$(PY) -m tierstack.config_reference > docs/reference/configuration.md

# Regenerate docs/architecture/layout.md from the modules' docstrings (a test checks it).
docs-layout: $(STAMP)
	$(PY) docs/architecture/generate_layout.py

# Regenerate proto/*_pb2*.py from proto/*.proto (a test fails when they are out of date).
proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
