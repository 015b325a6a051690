# Two commands a person needs: `make demo` and `make test`. Both build .venv when it is missing.
VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test docs gpu-check bench bench-tf bench-peers clean

$(STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	# Pinned first and alone: a looser request would pull a CUDA build of several GB.
	$(PYTHON) -m pip install -q torch==2.13.0
	# The xla extra (torchax, JAX on CPU) pins torch too, so it can never replace it; ft (torchft) and export (ONNX) install beside it.
	$(PYTHON) -m pip install -q -e ".[dev,xla,ft,export]" torch==2.13.0
	touch $(STAMP)

demo: $(STAMP)
	$(PYTHON) examples/mirrored_digits.py

# Three test processes on two cores: most tests wait on launched jobs; tests sharing one job share a process (xdist_group).
# Compiled first: the suite starts hundreds of interpreters, and where PYTHONDONTWRITEBYTECODE is set each would compile loom again.
# A test process that dies ends the run, naming its test: xdist 3.8 replacing it under loadgroup hangs (pytest-xdist#1323, #1327).
test: $(STAMP)
	$(PYTHON) -m compileall -q loom tests examples > /dev/null
	$(PYTHON) -m pytest -q -n 3 --dist loadgroup --max-worker-restart 0 tests

# The guide (docs/, mkdocs.yml) as a site in site/; --strict fails on a broken link or reference.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The contract's equivalence and bench/gpt.py on CUDA with NCCL; one line and exit 0 where there is no GPU.
gpu-check: $(STAMP)
	$(PYTHON) -m tests.gpu_check

bench: $(STAMP)
	-$(MAKE) bench-tf
	$(PYTHON) bench/overhead.py
	$(PYTHON) bench/scaling.py
	$(PYTHON) bench/input_pipeline.py
	$(PYTHON) bench/checkpoint.py
	$(PYTHON) bench/ps_transport.py
	$(PYTHON) bench/sharded.py
	$(PYTHON) bench/pipeline.py
	$(PYTHON) bench/gpt.py
	$(PYTHON) bench/fast_path.py
	$(PYTHON) bench/pool_nhwc.py
	$(PYTHON) bench/xla.py
	$(PYTHON) bench/collective_record.py
	$(PYTHON) bench/breakdown_overhead.py
	$(PYTHON) bench/live_recovery.py
	$(PYTHON) bench/worker_start.py
	-$(PYTHON) bench/parameter_server.py  # needs root for its network namespaces; says so otherwise
	-$(PYTHON) bench/slow_link.py         # the same

# TensorFlow in an environment of its own, for the tf.data comparison (the benchmark says when it is missing).
bench-tf:
	test -x .venv-tf/bin/python || python3 -m venv .venv-tf
	.venv-tf/bin/python -c "import tensorflow" 2>/dev/null || .venv-tf/bin/pip install -q tensorflow-cpu

# loom against hand-written DDP, Accelerate and Lightning Fabric (.venv-peers, torch pinned) and TensorFlow (.venv-tf) on W1/W2
bench-peers: $(STAMP) bench-tf
	test -x .venv-peers/bin/python || python3 -m venv .venv-peers
	.venv-peers/bin/python -c "import accelerate, lightning" 2>/dev/null || .venv-peers/bin/pip install -q torch==2.13.0 accelerate lightning
	.venv-peers/bin/pip show torch | grep -q "^Version: 2.13.0" || { echo "torch in .venv-peers is not 2.13.0: recreate it"; exit 1; }
	$(PYTHON) bench/peers/run.py

clean:
	rm -rf $(VENV) .venv-tf .venv-peers runs bench/results
