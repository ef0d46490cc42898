# hvd_zoadam: the two set-up commands of the README.
#   make demo  - sets up everything, then trains the char LM with 0/1 Adam and with Adam (2 ranks)
#   make test  - sets up everything, then runs the linter (ruff) and the test suite
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
HOROVODRUN := $(VENV)/bin/horovodrun
NP ?= 2
STEPS ?= 400
DEMO_DIR ?= runs/demo
PYTEST_ARGS ?=

.PHONY: setup demo test clean

setup:
	@bash scripts/setup.sh

demo: setup
	@mkdir -p $(DEMO_DIR)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(HOROVODRUN) -np $(NP) -H localhost:$(NP) --gloo \
	    $(PY) examples/train_lm.py --optimizer zoadam --steps $(STEPS) --summary $(DEMO_DIR)/zoadam.json
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(HOROVODRUN) -np $(NP) -H localhost:$(NP) --gloo \
	    $(PY) examples/train_lm.py --optimizer adam --steps $(STEPS) --summary $(DEMO_DIR)/adam.json
	$(PY) examples/compare.py $(DEMO_DIR)/zoadam.json $(DEMO_DIR)/adam.json \
	    --png $(DEMO_DIR)/loss.png --json $(DEMO_DIR)/compare.json

test: setup
	$(VENV)/bin/ruff check hvd_zoadam native tests examples
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests

clean:
	rm -rf runs .pytest_cache
