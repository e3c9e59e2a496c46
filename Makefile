# Two commands a newcomer needs: `make demo` and `make test`. Each sets up
# what it needs (venv, packages, the local control plane) and is idempotent.
PYTHON_SYSTEM ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install only when the package's declared dependencies change.
VENV_STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-12)

.PHONY: venv testenv demo demo-k8s test lint test-unit test-gpu clean

venv: $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON_SYSTEM) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[operator,kubernetes,cuda,test]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: venv
	$(PY) examples/demo.py

# The Kubernetes demo: local control plane, helm install, gated engine rollout.
demo-k8s: testenv
	$(PY) -m tools.demo_k8s

# The local Kubernetes control plane (built from Go modules, cached outside the repo).
testenv: venv
	$(PY) -m tools.testenv build

lint: venv
	$(VENV)/bin/ruff check .

# Unit tests, then GPU tests (skipped without a CUDA device), then the real control plane.
test: lint testenv
	$(PY) -m pytest -rs tests/unit tests/gpu tests/k8s

test-unit: venv
	$(PY) -m pytest -rs tests/unit

# On a CUDA machine (see tests/gpu/README.md).
test-gpu: venv
	WEIGHTCACHE_RESULTS_DIR=benchmarks/results $(PY) -m pytest -rs -s tests/gpu

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
