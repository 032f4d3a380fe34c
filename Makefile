# scalestudy: `make demo` runs the quick-start study, `make test` the test suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-quick test-fast bench figures clean

venv: $(STAMP)

# torch first, pinned to the CPU build available locally: an unpinned resolve of the project's
# dependencies would pull a multi-GB CUDA wheel.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

# The report's predicted points come from this machine: a quick calibration (no Ray, under a minute)
# first, while nothing else runs, and the report predicts the measured trials with that profile.
DEMO_PROFILE := results/calibrated-cpu-local.yaml

demo: $(STAMP)
	$(BIN)/scalestudy validate experiments/quickstart.yaml
	$(BIN)/scalestudy calibrate --local --quick --out $(DEMO_PROFILE)
	$(BIN)/scalestudy sweep experiments/quickstart.yaml
	$(BIN)/scalestudy report quickstart --out reports/quickstart --profile $(DEMO_PROFILE)

test: $(STAMP)
	$(BIN)/python -m pytest tests -q

# Everything but the tests marked slow (cluster round trips, fault injection, the measured-CPU check):
# the same as `make test` with one flag.
test-quick: $(STAMP)
	$(BIN)/python -m pytest tests -q -m "not slow"

# Unit and validation tests without the slow ones (about a minute): the measured-CPU validation
# (a real quick-start sweep and calibration, minutes) is marked slow and left to `make test`.
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

clean:
	rm -rf results reports mlflow.db
