# scalestudy: `make demo` runs the quick-start study, `make test` the test suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-slow test-all test-fast bench figures gpu-check clean

venv: $(STAMP)

# torch first, pinned to the CPU build available locally: an unpinned resolve of the project's
# dependencies would pull a multi-GB CUDA wheel. Last, DeepSpeed's CPU shared-memory all-reduce
# (deepspeed_shm_comm), which DeepSpeed JIT-compiles the first time a process group starts on CPU,
# once per install (its build is keyed to the venv's path): 26 s on a 2-core AMD EPYC. Built here, so it
# lands neither in the demo's quick calibration nor in a trial.
# The project with the exact versions a cluster node gets (cluster/constraints.txt, written by
# cluster/pin.py), so the tests run the code the nodes run.
$(STAMP): pyproject.toml cluster/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test]" -c cluster/constraints.txt
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
	  || echo "DeepSpeed's CPU comm op did not build now; DeepSpeed tries again in the first CPU process group"
	touch $(STAMP)

# The report's predicted points come from this machine: a quick calibration (no Ray, under a minute)
# first, while nothing else runs, and the report predicts the measured trials with that profile.
DEMO_PROFILE := results/calibrated-cpu-local.yaml

demo: $(STAMP)
	$(BIN)/scalestudy validate experiments/quickstart.yaml
	$(BIN)/scalestudy calibrate --local --quick --out $(DEMO_PROFILE)
	$(BIN)/scalestudy sweep experiments/quickstart.yaml
	$(BIN)/scalestudy report quickstart --out reports/quickstart --profile $(DEMO_PROFILE)

# The suite (README's test command, ~11 min on 2 cores): unit, validation and the integration tests
# that run real trials on one local Ray. The tests marked slow are `make test-slow` (~35 min): the
# multi-node stand-ins (job submit, autoscaling, placement, private disks, an object store), fault
# injection (killed workers, nodes and drivers, OOM, timeouts), the 4-worker tp x dp layout, the 355M
# ZeRO-3 build, and the model's accuracy measured on this CPU. CI (.ci/run) runs both.
test: $(STAMP)
	$(BIN)/python -m pytest tests -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest tests -q -m slow

# Both in one session: every test.
test-all: $(STAMP)
	$(BIN)/python -m pytest tests -q

# Unit and validation tests without the slow ones (about 3 minutes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit tests/validation -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python tests/bench/overhead.py
	$(BIN)/python tests/bench/trial_overhead.py --compare-cold
	$(BIN)/python tests/bench/predict_speed.py

# README headline figures: sweep every paper study with the performance model (simulate backend,
# seconds), report each, copy the headline PNGs and their computed sentences to docs/figures/.
figures: $(STAMP)
	for spec in experiments/paper/*.yaml; do $(BIN)/scalestudy sweep $$spec || exit 1; done
	$(BIN)/python -m scalestudy_analysis.headline experiments/paper docs/figures

# A freshly booted GPU machine (NVIDIA driver, CUDA torch, deepspeed and transformers present): calibrate
# the local GPUs, measure a short study through the torchrun adapter, predict it, print one table and
# write results/gpu-check/. No Ray, no MLflow: only the project itself (--no-deps) and its small
# pure-Python dependencies are installed, into the machine's own Python, at the versions of
# cluster/constraints.txt (what the tests ran). Exits 2 without a CUDA device, or with a driver older
# than torch's CUDA. A trial past its limit is killed with all of torchrun's ranks.
GPU_PYTHON ?= python3
gpu-check:
	@$(GPU_PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" 2>/dev/null \
		|| { echo "gpu-check: no CUDA device is visible to torch on this machine; nothing to check" >&2; exit 2; }
	$(GPU_PYTHON) -m pip install --quiet --no-deps -e .
	$(GPU_PYTHON) -m pip install --quiet -c cluster/constraints.txt pydantic pyyaml typer rich nvidia-ml-py
	$(GPU_PYTHON) -m scalestudy.calibrate.gpucheck

clean:
	rm -rf results reports mlflow.db
