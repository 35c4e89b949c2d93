# tandem: the two commands a new user runs are `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test bench lint install clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first: the CPU build of 2.13.0 avoids downloading a multi-GB CUDA build
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -c constraints.txt -e '.[test,ray,eval]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tandem serve --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	PY=$(PY) bash bench/run_all.sh $(BENCH)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
