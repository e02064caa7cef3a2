# The README's two commands. Both create .venv and install what they need:
#   make quickstart   run the main job on the embedded default (a local folder, a tiny model)
#   make test         run the test suite (starts its own SeaweedFS S3 server on 127.0.0.1)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: install test quickstart bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first, from the CPU wheel on disk: a bare `torch` requirement would pull a CUDA build.
# The constraint pins whatever torch is there so installing the project never replaces it.
$(VENV)/.installed: pyproject.toml examples/environments/pyproject.toml | $(PY)
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	@$(PY) -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e '.[dev,math,eval,tensorboard,envs]' -e examples/environments
	@touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

quickstart: install
	$(VENV)/bin/paths quickstart --scenario all

# MosaicML streaming (a peer in bench/shard.py) pins transformers<5 and numpy<2.2: installed
# without its dependencies, plus the ones its reader and writer import.
# TRL (bench/grpo.py) and mergekit (bench/compose.py) come with their dependencies. The packages the project runs on stay at the
# versions installed (botocore where s3fs's aiobotocore wants it; boto3 follows).
PINNED := botocore|fsspec|s3fs|aiobotocore|numpy|transformers|accelerate|zarr|pyarrow|tokenizers
$(VENV)/.bench: $(VENV)/.installed
	@$(PY) -m pip freeze | grep -iE '^($(PINNED))==' | cat - $(VENV)/constraints.txt > $(VENV)/constraints-bench.txt
	$(PY) -m pip install -q -c $(VENV)/constraints-bench.txt --no-deps mosaicml-streaming==0.13.0
	$(PY) -m pip install -q -c $(VENV)/constraints-bench.txt xxhash zstd python-snappy Brotli catalogue boto3 pillow trl mergekit
	# TOPLOC (bench/verify_rollouts.py): its wheel is built for another torch; built here against this one
	$(PY) -m pip install -q -c $(VENV)/constraints-bench.txt --no-build-isolation --no-binary toploc toploc==0.1.6
	@touch $@

bench: install $(VENV)/.bench
	$(PY) bench/storage.py
	$(PY) bench/materialize.py
	$(PY) bench/shard.py
	$(PY) bench/train.py
	$(PY) bench/grpo.py
	$(PY) bench/compose.py
	$(PY) bench/verify_rollouts.py

clean:
	rm -rf $(VENV) runs .pytest_cache
