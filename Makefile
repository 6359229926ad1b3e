# Two commands do all set-up on a fresh clone:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.ready
RANKS  ?= 2
STEPS  ?= 150
ARGS   ?=

.PHONY: demo test lint docs bench clean mutate

$(READY): requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

demo: $(READY)
	$(BIN)/torchrun --standalone --nproc-per-node $(RANKS) -m examples.train_gpt --steps $(STEPS) $(ARGS)

lint: $(READY)
	$(BIN)/ruff check fsdp_fn tests examples bench
	$(BIN)/ruff format --check fsdp_fn tests examples bench
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache  # the layers of docs/design.md (pyproject.toml [tool.importlinter])

docs: $(READY)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict  # (not --quiet: it hides the warnings strict turns into errors)

test: lint docs
	$(BIN)/python -m pytest -q

bench: $(READY)
	$(BIN)/python bench/compare.py $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis build/site

# Mutation testing of the core (cosmic-ray; slow: hours on 2 cores, not part of `make test`).
# MODULES: any of collectives shard plan gather unit runtime lean sink step optim (mutation/<name>.toml).
MODULES ?= collectives shard plan gather unit runtime lean sink step optim
SAMPLE  ?=
mutate: $(READY)
	$(BIN)/python -m pip install --quiet -r mutation/requirements.txt
	SAMPLE=$(SAMPLE) mutation/run.sh $(MODULES)
