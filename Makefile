# Two commands on a fresh machine: `make serve` and `make test`. Both install first when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned first: this machine carries a local CPU wheel of 2.13.0, and a bare range would
# pull the newest CUDA build (several GB). The package's own range is satisfied by it.
TORCH_VERSION ?= 2.13.0

.PHONY: install serve test test-slow bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[test,eval]"
	touch $@

serve: install
	$(PY) -m gapless serve $(ARGS)

# the suite but its slow tier (tests marked `slow`: multi-process tensor parallelism, the GPU kit's script
# checks, the real model's download, mypy, the sm_90 compile of every kernel, ...), which CI runs after it
# (.ci/run); in TEST_WORKERS processes (pytest-xdist), each file's tests in one (its servers start once):
# the tests run torch on one thread, so a 2-core machine runs two at once
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile

# the slow tier the same way: one process took 513 s on a 2-core machine, two 333 s
test-slow: install
	$(PY) -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile

bench: install
	$(PY) -m gapless.bench.offline

lint: install
	$(VENV)/bin/ruff check gapless tests
	$(VENV)/bin/ruff format --check gapless tests
	$(PY) -m mypy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache
