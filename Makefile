# The two commands a new machine needs: `make demo` (the main job on its embedded default) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo demo-reward demo-grpo demo-rloo bench bench-quick gpu-check docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: this build lies on local disk; an unpinned torch could pull a multi-GB CUDA build.
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# Two pytest-xdist workers: the CI machine has 2 cores, and most tests are single-threaded Python on tiny models.
test: $(STAMP)
	$(PY) -m pytest -n 2 tests

demo: $(STAMP)
	$(VENV)/bin/prefixdpo train

# A reward model (Bradley-Terry, as TRL's RewardTrainer) on the same embedded default.
demo-reward: $(STAMP)
	$(VENV)/bin/prefixdpo reward

# GRPO / RLOO (TRL's trainers, log-prob passes prefix-shared) on an embedded default: a tiny model, prompts sharing a
# long instruction, a reward it learns in 40 steps (~20 s on 2 cores); prints the reward and the tokens saved.
demo-grpo: $(STAMP)
	$(VENV)/bin/prefixdpo grpo

demo-rloo: $(STAMP)
	$(VENV)/bin/prefixdpo rloo

bench: $(STAMP)
	$(VENV)/bin/prefixdpo bench

bench-quick: $(STAMP)
	$(VENV)/bin/prefixdpo bench --quick

# The GPU machine's own python (torch and transformers already there; no venv, nothing installed).
# Writes gpu-check.json and gpu-check.md into $(OUT) (default gpu-check-results).
OUT ?= gpu-check-results
gpu-check:
	PYTHONPATH=src $(PYTHON) -m prefixdpo_tools.gpu_check --out "$(OUT)"

# The documentation site (docs/, mkdocs.yml) built into site/; `.venv/bin/mkdocs serve` to browse it while editing.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) build site src/*.egg-info
