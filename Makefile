# evenpipe: `make demo` and `make test` set up .venv from scratch when it is missing.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU wheel of torch on this machine's disk; never let pip resolve an unpinned torch.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup bytecode demo test typecheck bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q "$(TORCH_PIN)" -e ".[runtime,plot,dev,hf]"
	touch $(STAMP)

setup: $(STAMP) bytecode

# Compiled bytecode for the package, as an installed wheel has: where PYTHONDONTWRITEBYTECODE is set, every process
# would otherwise compile each module it imports again (about 0.1 s per planner run). Stale files are ignored.
bytecode: $(STAMP)
	$(VPY) -m compileall -q src

demo: $(STAMP) bytecode
	$(VPY) -m evenpipe.demo --out demo_out

typecheck: $(STAMP)
	$(VPY) -m ruff check --select F src tests benchmarks
	$(VPY) -m mypy src/evenpipe

test: $(STAMP) bytecode typecheck
	# two workers: one runs the multi-process worlds in order (tests/conftest.py), the other every
	# single-process file meanwhile
	$(VPY) -m pytest -q --durations=20 -n 2 --dist loadgroup tests/distributed tests/unit tests/architecture

# The pure benchmarks (seconds each); the runtime ones are listed in BENCHMARKS.md with their commands.
bench: $(STAMP) bytecode
	$(VPY) benchmarks/bench_sim.py
	$(VPY) benchmarks/bench_plan.py

clean:
	rm -rf $(VENV) demo_out build *.egg-info src/*.egg-info
