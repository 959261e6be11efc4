# dckpt: every target installs what it needs into .venv by itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
NPROC ?= 2

.PHONY: install demo test lint typecheck unit faults mutants probes bench bench-quick bench-s3 bench-memory bench-scale bench-incremental compat clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/pip install --quiet -e ".[dev,accelerate,hf,lightning]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python launch/demo.py

lint: $(STAMP)
	$(BIN)/ruff check dckpt launch bench tests
	$(BIN)/ruff format --check dckpt launch bench tests

typecheck: $(STAMP)
	$(BIN)/mypy

# Test files run in parallel, a file's tests on one worker (they share its module fixtures):
# most of a test's time is its ranks waiting on each other, on a deadline or on a store (the
# suite kept 1.6 of 2 cores busy with three workers), so four workers on 2 cores took 832 s
# where three took 902 s, the same 912 tests (2026-12-07); five took 936 s, and mypy run
# beside the four (903-916 s) cost more than run first (38 s). Files are handed out in
# collection order, the longest first (tests/conftest.py: SLOWEST_FIRST), not re-sorted by
# their number of tests (xdist's default put the few long ones last, alone at the end).
# PYTEST_WORKERS=0 runs one file after another in this process.
PYTEST_WORKERS ?= 4
unit: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40

test: lint typecheck unit

# The fault-injection suite alone (it also runs in `make test`), with its table; the trials
# are kept in build/faults.json for the notes.
faults: $(STAMP)
	DCKPT_FAULTS_JSON=build/faults.json $(BIN)/python -m pytest -q -m faults tests

# Mutation testing (not part of `make test`: it takes its budget). `make mutants` draws every
# comparison, guard, and/or and range bound in the modules a verified save and resume rest on
# (tests/mutant_draw.py), runs each against its module's tests until MUTANTS_BUDGET_MIN is
# spent, and writes a score per module with every survivor (build/mutants.md, .json). All
# ~800 take 4 to 5 hours on 2 cores (MUTANTS_BUDGET_MIN=300); 40 minutes run about 90, the
# same ones each time (a hash of each mutant's key orders them). `make probes` runs the
# hand-picked probes.
MUTANTS_BUDGET_MIN ?= 40
mutants: $(STAMP)
	$(BIN)/python tests/mutation_probe.py --drawn --budget-min $(MUTANTS_BUDGET_MIN) --json build/mutants.json

probes: $(STAMP)
	$(BIN)/python tests/mutation_probe.py --json build/mutation.json

bench: $(STAMP)
	$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python bench/compare.py --sizes 0.25 1 2 --world-sizes 1 2 --repeats 4 --name compare

bench-quick: $(STAMP)
	$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python bench/compare.py --sizes 0.25 --world-sizes 2 --repeats 4 --name compare_quick

# dckpt on an s3:// root against boto3's own put/get of the same bytes, on a moto S3 server
# started here (about 1 min); `--endpoint URL --bucket B` points it at a real store.
bench-s3: $(STAMP)
	$(BIN)/python bench/s3.py --size 0.25 --world-size 2 --repeats 3 --name s3

bench-memory: $(STAMP)
	$(BIN)/python bench/memory.py --size 0.25 --world-size 2 --repeats 5 --name memory

# Incremental saves: bytes and time per save with a frozen backbone and with everything
# trainable, against full saves and dcp.save of the same state (about 3 min)
bench-incremental: $(STAMP)
	$(BIN)/python bench/incremental.py --gb 0.25 --saves 4 --repeats 3 --name incremental

# dckpt's control plane counted per rank and operation at 2..32 ranks (a counting shim,
# bench/scale_shim, on PYTHONPATH of the ranks), the 1k-16k synthetic parts and the latency
# model (about 2 min on 2 cores) -> bench/results/scale.md. --big adds 32 ranks to 2..16. Then
# the bytes each FSDP rank hashes at a resume, on a model whose shards are MBs, not KBs
# (about 1.5 min) -> bench/results/scale_hashing.md.
SCALE_ARGS ?= --big
bench-scale: $(STAMP)
	$(BIN)/python bench/scale.py $(SCALE_ARGS)
	$(BIN)/python bench/scale.py --parallel fsdp --worlds 2 4 8 16 32 --width 1024 \
		--no-synthetic --no-model --md bench/results/scale_hashing.md

# Cross-version safety (not part of `make test`: a second venv of 5.5 GB and about 3 min):
# checkpoints written with torch $(TORCH_VERSION) are resumed with torch $(COMPAT_TORCH) and
# the other way round, bit for bit (bench/compat.py), and the compat tests run under
# $(COMPAT_TORCH) too. The second venv holds torch and dckpt's runtime dependencies; dckpt
# itself comes from this checkout (PYTHONPATH). Table in build/compat.json.
COMPAT_TORCH := 2.14.1
COMPAT_VENV := .venv-compat
COMPAT_STAMP := $(COMPAT_VENV)/.installed-$(COMPAT_TORCH)

$(COMPAT_STAMP):
	$(PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install --quiet "torch==$(COMPAT_TORCH)" numpy psutil xxhash rich \
		safetensors pytest pytest-timeout
	touch $(COMPAT_STAMP)

compat: $(STAMP) $(COMPAT_STAMP)
	$(BIN)/python bench/compat.py --python $(BIN)/python --python $(COMPAT_VENV)/bin/python \
		--pytest --json build/compat.json

clean:
	rm -rf $(VENV) .venv-compat .mypy_cache .pytest_cache .ruff_cache build
