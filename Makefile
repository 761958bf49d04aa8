# `make test` and `make parity` set up what they need on a fresh machine.
# PYTHON picks the stack: python3.12 (default: jax 0.12.0.1, flax 0.12.12) or
# python3.11 (jax 0.10.2, flax 0.12.8). Each stack has its own venv and pins.
PYTHON ?= python3.12
PYVER := $(patsubst python%,%,$(notdir $(PYTHON)))
ifeq ($(PYVER),3.12)
VENV ?= .venv
else
VENV ?= .venv-py$(subst .,,$(PYVER))
endif
CONSTRAINTS := constraints/py$(subst .,,$(PYVER)).txt
PY := $(VENV)/bin/python
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
PYTEST_ARGS ?=
# pytest-xdist workers: one per core, at most 4 (each holds its own compiled programs, ~4 GiB).
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
CONFIG ?= configs/llama2-tiny.yml
# The default stack runs the whole suite; the oldest one its declared compatibility layer (the
# tests marked `compat`: README, Stacks). LAYER= runs the whole suite there too.
ifeq ($(PYVER),3.12)
LAYER ?=
# libtpu (~640 MB) for the TPU compile tests (tests/test_tpu.py), which run on this stack only.
EXTRAS ?= test,plot,tpu
else
LAYER ?= -m compat
EXTRAS ?= test,plot
endif

.PHONY: install test test-fast parity lint clean maxtext-envs

# MaxText's own releases, each in its own environment, for the MaxText gate (tests/test_maxtext.py
# and `parity --maxtext`): 0.2.3 (Linen decoder) and 0.2.5 (NNX decoder). Python 3.12 only.
MAXTEXT_RELEASES := 0.2.3 0.2.5
# The releases build side by side (pip mostly waits on the disk), by the installed tool's own
# command (python -m parity.maxtext.build_envs, stdlib only); each one's log is printed if it
# fails.
maxtext-envs:
	@python="$$(.ci/find-python python3.12)"; logs=$$(mktemp -d); pids=""; \
	for v in $(MAXTEXT_RELEASES); do \
	  PYTHONPATH=$(CURDIR) "$$python" -m parity.maxtext.build_envs --dir $(CURDIR) $$v \
	    >$$logs/$$v.log 2>&1 & pids="$$pids $$!"; done; \
	status=0; for pid in $$pids; do wait $$pid || status=1; done; \
	if [ $$status -ne 0 ]; then cat $$logs/*.log >&2; fi; rm -rf $$logs; exit $$status

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || "$$(.ci/find-python $(PYTHON))" -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	@# Byte-compiled once, in parallel (~15 s): where PYTHONDONTWRITEBYTECODE is set no import
	@# ever writes a .pyc, and every Python process the suite starts (CLI runs, workers) would
	@# compile jax, flax and the rest again (~3 s each). Files a package ships that do not
	@# compile (templates, tests for other Pythons) are skipped.
	@$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" migrate parity >/dev/null 2>&1 || true
	@touch $@

install: $(VENV)/.installed

# On the default stack the MaxText gate's environments are built first (a failure to build them
# is reported by the MaxText tests, which then skip saying why).
# The slowest tests are listed at the end (where the suite's time goes: docs/performance.md).
test: install
	@if [ "$(PYVER)" = "3.12" ]; then $(MAKE) --no-print-directory maxtext-envs || echo "MaxText environments not built"; fi
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist=worksteal --durations=15 $(LAYER) $(PYTEST_ARGS)

# The tests not marked `slow`, which start no end-to-end run (no `parity` or `migrate` command,
# no worker process, no compile of the whole decoder): the loop while editing. tests/conftest.py
# fails a test not marked `slow` that starts one, in this run and in `make test` alike.
test-fast: install
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist=worksteal -m "not slow" $(PYTEST_ARGS)

PARITY_ARGS ?= --checks=all

parity: install
	$(VENV)/bin/parity $(CONFIG) $(PARITY_ARGS)

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf .venv .venv-py* .venv-maxtext-* .pytest_cache build *.egg-info
