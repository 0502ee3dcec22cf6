# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: demo test install browser labelstudio figures clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first: the CPU build lies on this machine's disk; then the tested pins, then wsseg
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/wsseg demo

# the browser check of `wsseg ui` (tests/test_ui.py) drives Debian's chromium through playwright:
# installed here when missing (as root, or with password-less sudo); where it cannot be, that
# test fails and says so
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium (Debian package) for tests/test_ui.py"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi; \
	  if [ "$$SUDO" != none ] && command -v apt-get >/dev/null 2>&1 && \
	     $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; \
	  then echo "chromium installed"; \
	  else echo "could not install chromium (needs apt-get as root): tests/test_ui.py will fail" >&2; fi; }

# a real Label Studio for tests/test_labelstudio.py (the `export --format labelstudio` round trip),
# in a virtual environment of its own: its Django pins would clash with wsseg's
LS_VENV  ?= .venv-labelstudio
LS_STAMP  = $(LS_VENV)/.installed

$(LS_STAMP): requirements-labelstudio.lock
	$(PYTHON) -m venv $(LS_VENV)
	$(LS_VENV)/bin/pip install --quiet --upgrade pip
	# label-studio==1.23.2 and what it needs, pinned as tested (pip freeze of that venv)
	$(LS_VENV)/bin/pip install --quiet -r requirements-labelstudio.lock
	touch $(LS_STAMP)

labelstudio: $(LS_STAMP)

test: $(STAMP) browser $(LS_STAMP)
	$(BIN)/python -m pytest -q

# docs/figures.md, written from the benchmarks' result JSONs kept in docs/results (never by hand):
# to refresh a figure, run the command under its table with its --out in docs/results, then this
figures: $(STAMP)
	$(BIN)/wsseg bench report docs/results --out docs/figures.md

clean:
	rm -rf runs .pytest_cache
