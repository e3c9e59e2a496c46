# Two commands a newcomer needs: `make demo` and `make test`. Each sets up
# what it needs (venv, packages, the local control plane) and is idempotent.
PYTHON_SYSTEM ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install only when the package's declared dependencies change.
VENV_STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-12)

.PHONY: venv csi-stubs testenv demo demo-k8s test test-k8s test-local lint test-unit test-gpu test-engines engine-venvs soak manifests clean

venv: $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON_SYSTEM) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[operator,kubernetes,cuda,csi,csi-stubs,test]'
	rm -f $(VENV)/.installed-*
	touch $@
	# The post-commit hook warns when a commit leaves the GPU suite's record behind.
	-git config core.hooksPath .githooks 2>/dev/null

# The CSI plugin's gRPC stubs, from the pinned spec's csi.proto (tools/csi_stubs.py; not
# committed); cheap when they are current.
csi-stubs: venv
	$(PY) -m tools.csi_stubs

demo: venv
	$(PY) examples/demo.py

# The Kubernetes demo on a real node: helm install, real daemon and engine pods, gated rollouts.
demo-k8s: testenv
	$(PY) -m tools.demo_k8s

# The local Kubernetes control plane and its real node (kubelet from the same Go modules,
# containerd and runc from Debian, images built from the repo's Dockerfiles): installs the
# Debian packages it needs (root), builds what is missing, caches it outside the repo.
testenv: csi-stubs
	$(PY) -m tools.testenv build --real-node

lint: venv
	$(VENV)/bin/ruff check .

# The chart's CRD and RBAC rules, generated from crds/ and weightcache_operator/rbac.py;
# tests/unit/tools/test_manifests.py fails while they are stale.
manifests: venv
	$(PY) -m tools.manifests write

# Engine adapters against vLLM and SGLang releases, each in its own venv
# (built once, cached in ~/.cache/weightcache/engines; see tools/engine_venvs).
engine-venvs: venv
	$(PY) -m tools.engine_venvs build

test-engines: venv
	$(PY) -m tools.engine_venvs test

# Two lanes side by side, one per core: the control plane and its real node (build, then
# tests/k8s, mostly waiting on pods) and everything else (the engine venvs, mostly
# downloads, and their tests; then the unit tests and the GPU tests, skipped without a
# CUDA device). Each step's output is printed whole when it ends; -k: a lane that fails
# does not stop the other, so one run reports every failure.
test: lint
	$(MAKE) -k -j2 --output-sync=target test-k8s test-local

# --durations: the slowest tests in CI's log, where the lane's minutes go.
test-k8s: testenv
	$(PY) -m pytest -rs --durations=25 tests/k8s

# The venvs first, all four, while the other lane compiles Go: downloads beside CPU work.
test-local: csi-stubs engine-venvs
	$(PY) -m tools.engine_venvs test
	$(PY) -m pytest -rs tests/unit tests/gpu

# Faults on the real node, the long way: 20 minutes of engine Deployments rolling while a
# client sends requests to every engine pod, the daemon pod deleted twice; writes
# benchmarks/results/polyglot-soak.json (`make test` runs a minute of it).
soak: testenv
	WEIGHTCACHE_SOAK_SECONDS=1200 WEIGHTCACHE_RESULTS_DIR=benchmarks/results \
		$(PY) -m pytest -rs -s tests/k8s/test_real_faults.py -k soak

test-unit: csi-stubs
	$(PY) -m pytest -rs tests/unit

# On a CUDA machine (see tests/gpu/README.md): the GPU suite, then its record
# benchmarks/results/gpu-suite.json (which sidecar/ tree passed which tier on which GPU);
# refused unless sidecar/ is exactly the committed tree. A change to sidecar/ lands with a
# fresh record, the smoke tier at least (GPU_TIER=smoke: about 4 minutes).
GPU_TIER ?= full
test-gpu: venv
	$(PY) -m tools.gpu_suite run --tier $(GPU_TIER)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
