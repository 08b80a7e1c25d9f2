# make demo: set up .venv, then train the shapes demo end to end
# make test: set up .venv, then run the tests (make test-full: with the tests marked full too) on three pytest-xdist
# workers of one torch thread each (tests/conftest.py): waits on servers and subprocesses overlap the work, 6.5 min
# where two workers of two threads took 8.8 (2 cores)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-full demo lint clean

# uv installs the pinned requirements in about a minute where pip takes four; pip brings uv from the package index
# into the venv and installs everything itself where uv cannot be had. With every requirement satisfied, neither
# asks a package index (offline works). LLAVAX_SETUP=pip forces pip.
REQUIREMENTS := -r requirements.txt -r requirements-dev.txt
$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if [ "$${LLAVAX_SETUP:-uv}" = uv ] && $(PY) -m pip install --quiet --disable-pip-version-check uv 2>/dev/null; \
	then $(VENV)/bin/uv pip install --quiet --python $(PY) $(REQUIREMENTS); \
	else $(PY) -m pip install --quiet --disable-pip-version-check $(REQUIREMENTS); fi
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q -m "not full" -n 3 --dist loadfile --no-loadscope-reorder

test-full: setup
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder

lint: setup
	$(VENV)/bin/ruff check .

SHAPES := data/shapes

# the embedded default: draw the shapes data, then train a small VLM from scratch on the CPU. A draw that was stopped
# (no .info.json) is drawn again: --overwrite removes only what data.py shapes wrote, and refuses a folder of other files
demo: setup
	@test -f $(SHAPES)/shards/.nv-meta/.info.json || $(PY) data.py shapes --out $(SHAPES) --n 20000 --overwrite
	$(PY) train.py configs/shapes.py

clean:
	rm -rf $(VENV) .pytest_cache
