# Quick start: `make tune` then `make test`. Both create .venv and install on first use.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The CPU build of torch; pyproject.toml stays permissive (torch>=2.5) for other machines.
TORCH   ?= torch==2.13.0
MODEL   ?= examples/qwen2_tiny.py
OUT     ?= out/qwen2_tiny.policy.json
TUNE_ARGS ?=

.PHONY: install tune train test test-slow docs clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip uv
	$(BIN)/python -m pip install -q "$(TORCH)"
	# The rest through uv, which resolves and installs in parallel (16 s against pip's 45 s on two
	# cores); the pinned torch above already satisfies pyproject's torch>=2.5 and stays.
	$(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode -e ".[examples,dev]"
	touch $@

tune: install
	mkdir -p $(dir $(OUT))
	$(BIN)/autoprec tune $(MODEL) --out $(OUT) $(TUNE_ARGS)

train: install
	$(BIN)/autoprec train $(MODEL) --policy $(OUT) --steps 50

# Two pytest workers with one OpenMP thread each (tests/conftest.py), then the tests that read the
# machine's load or time steps alone, so that no other test process runs beside them. The second
# run collects only the files that mark a test serial: collecting all of them imports transformers,
# lightning and every test module (15 s) for three tests. The 25 slowest tests are listed at the
# end, so a suite creeping past its ~15 minutes on 2 cores shows where the time went.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow and not serial" --durations=25
	$(BIN)/python -m pytest -q -m "serial and not slow" $$(grep -rl --include='test_*.py' 'mark\.serial' tests)

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# The documentation site (mkdocs.yml), built in strict mode into site/.
docs: install
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf out .pytest_cache
