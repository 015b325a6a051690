# Two commands a person needs: `make demo` and `make test`. Both build .venv when it is missing.
VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	# Pinned first and alone: a looser request would pull a CUDA build of several GB.
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PYTHON) examples/mirrored_digits.py

test: $(STAMP)
	$(PYTHON) -m pytest -q tests

bench: $(STAMP)
	$(PYTHON) bench/overhead.py
	$(PYTHON) bench/scaling.py

clean:
	rm -rf $(VENV) runs bench/results
