# flashedu: `make lab` to learn, `make test` to check everything. Both build .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
# The address printed for the browser: the container listens on 0.0.0.0 and is reached at 127.0.0.1.
URL_HOST ?= $(HOST)
PORT ?= 8888
# Notebooks in course order, as the package reads them from book.toml (expanded in recipes, after
# `install` has built the venv).
NOTEBOOKS = $(shell $(PY) -m flashedu.course notebooks)
NBVAL = --nbval --nbval-current-env --nbval-sanitize-with .ci/nbval-sanitize.cfg -p no:cacheprovider
LINTED = flashedu tests .ci/resolve-pins

.PHONY: install python-check browser lab test lint test-unit test-notebooks test-browser test-container pins book bench clean

install: $(STAMP)

# Before anything is created: the Python that will build .venv must be one the pins install on.
python-check:
	@$(PYTHON) -c 'import sys' 2>/dev/null || { echo "==> make: no '$(PYTHON)' found; install Python 3.11 or 3.12, or point make at one: make PYTHON=/path/to/python3.12 ..."; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] <= (3, 12)))' || { \
	  echo "==> make: $(PYTHON) is Python $$($(PYTHON) -c 'import platform; print(platform.python_version())') ($$($(PYTHON) -c 'import sys; print(sys.executable)')); the course needs Python 3.11 or 3.12: make PYTHON=python3.12 ..."; exit 1; }

# pip shows its progress bars: the first install downloads about 3 GB on Linux (README, "Installing").
# PIP_ARGS passes options to pip, e.g. PyTorch's CPU-only wheels (README; not exercised by CI).
PIP_ARGS ?=
$(STAMP): requirements.txt constraints.txt pyproject.toml
	@$(MAKE) --no-print-directory python-check
	@echo "==> creating $(VENV) with $$($(PYTHON) -c 'import sys; print(sys.executable, sys.version.split()[0])')"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [1/3] pip and setuptools"
	$(PY) -m pip install --upgrade pip "setuptools>=77"
	@echo "==> [2/3] the pinned environment (requirements.txt, constraints.txt): the longest step"
	$(PY) -m pip install -r requirements.txt -c constraints.txt $(PIP_ARGS)
	@echo "==> [3/3] flashedu itself, editable"
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	@touch $@
	@echo "==> environment ready: $(VENV)"

# Debian's Chromium for the one real-browser test (Playwright drives it; it never downloads a browser).
browser:
	@if command -v chromium >/dev/null 2>&1; then echo "==> chromium present: $$(command -v chromium)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "==> installing Debian's chromium for the browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "==> no chromium and no root: the browser test will be skipped (apt-get install chromium)"; fi

# The server gets a fresh token; once it answers, the URL to open (token included) is the last line.
lab: install
	@token=$$($(PY) -c "import secrets; print(secrets.token_hex(24))"); \
	url="http://$(URL_HOST):$(PORT)/lab/tree/$(firstword $(NOTEBOOKS))?token=$$token"; \
	echo "==> starting JupyterLab on $(HOST):$(PORT) (Ctrl-C to stop)"; \
	$(VENV)/bin/jupyter lab --no-browser --ip=$(HOST) --port=$(PORT) --ServerApp.port_retries=0 \
	  $(if $(filter 0,$(shell id -u)),--allow-root) --ServerApp.root_dir=$(CURDIR) \
	  --IdentityProvider.token=$$token $(firstword $(NOTEBOOKS)) & pid=$$!; \
	trap 'kill -TERM $$pid 2>/dev/null; wait $$pid; exit 0' INT TERM; \
	until $(PY) -c "import sys, urllib.request as r; r.urlopen(sys.argv[1], timeout=2)" \
	  "http://$(HOST):$(PORT)/api/status?token=$$token" 2>/dev/null; do \
	  kill -0 $$pid 2>/dev/null || { echo "==> JupyterLab did not start (is port $(PORT) taken? PORT=...)"; exit 1; }; \
	  sleep 0.5; done; \
	echo "==> JupyterLab is ready. Open this URL (the token in it is the password):"; \
	echo "$$url"; \
	wait $$pid

test: install browser
	@echo "==> lint (ruff), unit tests, notebooks (nbval) and the browser test"
	$(MAKE) --no-print-directory lint test-unit test-notebooks test-browser

# ruff, pinned in requirements.txt and configured in pyproject.toml (100 columns).
lint: install
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

test-unit: install
	$(PY) -m pytest tests -m "not browser and not container" -q -p no:cacheprovider

test-notebooks: install
	$(PY) -m pytest $(NBVAL) $(NOTEBOOKS) -q

test-browser: install
	$(PY) -m pytest tests -m browser -q -p no:cacheprovider -rs

# The container for real (tests/test_container_build.py): podman builds the Dockerfile on a Debian 12
# base made by debootstrap, runs it and checks the lab answers: 3 min 34 s on a 2-core machine
# (2026-12-04) and about 3 GB; CI runs it.
test-container: install
	@if command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "==> installing podman, runc and debootstrap (Debian's packages)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null; \
	else echo "==> no podman/runc/debootstrap and no root: the container test will be skipped"; fi
	$(PY) -m pytest tests/test_container_build.py -m container -q -p no:cacheprovider -rs

# Every environment file resolves from the public package index alone, on every platform and Python the
# README promises (.ci/resolve-pins; needs the index). uv resolves the platforms this machine is not.
UV_PIN := uv==0.13.9
pins: install
	@$(PY) -m uv --version >/dev/null 2>&1 || $(PY) -m pip install "$(UV_PIN)"
	$(PY) .ci/resolve-pins

# The static course in _build/html (Jupyter Book 1, pinned in requirements-book.txt; MathJax and the widget
# bundle come from the npm registry and are served locally). BOOK_ARGS=--no-execute renders stored outputs.
BOOK_STAMP := $(VENV)/.book-installed
$(BOOK_STAMP): $(STAMP) requirements-book.txt constraints.txt
	@echo "==> installing the book renderer (requirements-book.txt)"
	$(PY) -m pip install -r requirements-book.txt -c constraints.txt
	@touch $@

book: $(BOOK_STAMP)
	$(PY) -m flashedu.course book $(BOOK_ARGS)

bench: install
	$(PY) -m flashedu.bench

clean:
	rm -rf $(VENV) _build .pytest_cache
