# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first, from the CPU build on this disk, so nothing pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-fast bench clean

$(BIN)/rlhf: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	# DeepSpeed JIT-builds its CPU communication op on first use (~80 s on 2 cores); build it now, with
	# the venv's ninja as the workers use, so the first training run (or test) does not pay for it.
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $(BIN)/rlhf

demo: $(BIN)/rlhf
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/rlhf demo --workdir ./demo

test: $(BIN)/rlhf
	$(BIN)/python -m pytest tests -v -rs --durations=15

test-fast: $(BIN)/rlhf
	$(BIN)/python -m pytest tests/unit -q

bench: $(BIN)/rlhf
	$(BIN)/python bench/chunk_overhead.py

clean:
	rm -rf demo ckpt out toy
