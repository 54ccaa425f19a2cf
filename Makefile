# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first, from the CPU build on this disk, so nothing pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-fast bench soak clean

$(BIN)/rlhf: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	# DeepSpeed JIT-builds its CPU communication op on first use (~80 s on 2 cores); build it now, with
	# the venv's ninja as the workers use, so the first training run (or test) does not pay for it.
	# A lock left in its build folder by a killed process would make this wait forever: jit_build removes it.
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m rlhf_core.rank.jit_build
	touch $(BIN)/rlhf

demo: $(BIN)/rlhf
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/rlhf demo --workdir ./demo

# The suite runs on TEST_WORKERS pytest-xdist workers; each test module is one unit of work, heaviest first
# (tests/conftest.py), and tests/README.md says where the time goes. The last line is the suite's wall time.
# Before the suite, the docs site is built into site/ (mkdocs.yml): a broken link or page fails `make test` too.
# Beside the suite, mypy checks rlhf_core at the strictness of pyproject.toml's [tool.mypy]; its errors fail it too.
TEST_WORKERS ?= 2

test: $(BIN)/rlhf
	@started=$$(date +%s); \
	docs_log=$$(NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site 2>&1) && docs=0 || docs=$$?; \
	[ $$docs -eq 0 ] || printf '%s\nmake test: mkdocs build --strict failed (exit %s)\n' "$$docs_log" $$docs; \
	types_log=$$(mktemp); $(BIN)/mypy rlhf_core > $$types_log 2>&1 & types_pid=$$!; \
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -v -rfEsR --durations=40; status=$$?; \
	wait $$types_pid && types=0 || types=$$?; \
	[ $$types -eq 0 ] || cat $$types_log; echo "make test: mypy rlhf_core: $$(tail -n 1 $$types_log) (exit $$types)"; \
	rm -f $$types_log; \
	seconds=$$(( $$(date +%s) - started )); \
	echo "make test: pytest took $$((seconds / 60)) min $$((seconds % 60)) s on $(TEST_WORKERS) workers (exit $$status)"; \
	[ $$docs -eq 0 ] || [ $$status -ne 0 ] || status=$$docs; \
	[ $$types -eq 0 ] || [ $$status -ne 0 ] || status=$$types; \
	exit $$status

# The chaos soak (tests/soak, issue 32): toy SFT then PPO as a deployment's run on a Ray cluster of 2 nodes, first
# uninterrupted, then with a fault about every 2 minutes (12 of 8 kinds on the power-cut filesystem, then a store
# outage on S3), and nothing else touching it. About an hour on 2 cores; the report's folder is the last line.
# SOAK_ARGS="--short" runs the suite's 3-fault version; "--seed N" another schedule.
SOAK_ARGS ?=

soak: $(BIN)/rlhf
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/python -m tests.soak $(SOAK_ARGS)

test-fast: $(BIN)/rlhf
	$(BIN)/python -m pytest tests/unit -q

# The benchmark runs TRL in a venv of its own (torch first, CPU build, as above), so TRL never enters ours.
TRL_VENV := bench/.cache/trl-venv
TRL_SPEC ?= trl==1.16.0
BENCH_ARGS ?=

$(TRL_VENV)/.installed:
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install --quiet --upgrade pip
	$(TRL_VENV)/bin/python -c "import torch" 2>/dev/null || $(TRL_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(TRL_VENV)/bin/pip install --quiet "$(TRL_SPEC)"
	touch $@

# Every ratio of issue 10 in one run (~15-20 min on 2 cores); BENCH_ARGS="--only ckpt" runs a subset.
# Then issue 33's scale table (bench/data_scale.py): SCALE_ARGS="--rows 1000,100000" for fewer rows.
# Then issue 32's recovery bench (bench/recovery.py, ~5-8 min): RECOVERY_ARGS="--repeat 1" for one kill each.
SCALE_ARGS ?=
RECOVERY_ARGS ?=

bench: $(BIN)/rlhf $(TRL_VENV)/.installed
	$(BIN)/python bench/suite.py $(BENCH_ARGS)
	$(BIN)/python bench/data_scale.py $(SCALE_ARGS)
	$(BIN)/python bench/recovery.py $(RECOVERY_ARGS)

clean:
	rm -rf demo ckpt out toy
