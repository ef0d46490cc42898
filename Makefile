# hvd_zoadam: the two set-up commands of the README.
#   make demo  - sets up everything, then trains the char LM with 0/1 Adam and with Adam (2 ranks)
#   make test  - sets up everything, then runs the linter (ruff) and the test suite
#   make test-kernel-paths - the tests marked bitwise (pytest -m bitwise) once per CPU kernel path of
#                KERNEL_PATHS: bit equalities that hold only on the kernels of the machine that wrote them
#                fail here, before a CI machine with other CPUs finds them (not part of make test)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
HOROVODRUN := $(VENV)/bin/horovodrun
NP ?= 2
STEPS ?= 400
DEMO_DIR ?= runs/demo
PYTEST_ARGS ?=
# One environment a run: torch's generic (non-vectorised) CPU kernels; its AVX2 ones (on a CPU with
# AVX-512, not the kernels torch would choose); MKL held to its AVX2 code.
KERNEL_PATHS ?= ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2

.PHONY: setup demo test test-kernel-paths clean

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

test-kernel-paths: setup
	@failed=; for path in $(KERNEL_PATHS); do \
	    echo "== pytest -m bitwise with $$path"; \
	    env $$path PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q -p no:cacheprovider -m bitwise $(PYTEST_ARGS) tests \
	        || failed="$$failed $$path"; \
	done; \
	if [ -n "$$failed" ]; then echo "== failed with:$$failed"; exit 1; fi; echo "== passed with: $(KERNEL_PATHS)"

clean:
	rm -rf runs .pytest_cache
