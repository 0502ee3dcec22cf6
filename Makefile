# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: demo test install clean

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

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf runs .pytest_cache
