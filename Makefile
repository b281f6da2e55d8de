# ampkit: the two commands of the contract are `make test` and `make bench`.
# Each sets up what it needs on a fresh machine (Python venv, R and its packages).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
RLIB := $(CURDIR)/.rlib
PY_STAMP := $(VENV)/.ampkit-setup
R_STAMP := $(RLIB)/.ampkit-setup
# The Debian R packages the R package and its tests need (CRAN is not reachable).
R_DEBS := r-base-core r-base-dev r-cran-reticulate r-cran-testthat r-cran-withr \
          r-cran-yaml r-cran-r6 r-cran-rlang r-cran-jsonlite
R_ENV := RETICULATE_PYTHON=$(CURDIR)/$(VPY) R_LIBS=$(RLIB) OMP_NUM_THREADS=1 \
         AMPKIT_REPO=$(CURDIR)

# Benchmark options: make bench PROFILE=full CASES=seed_mlp VARIANTS=fp32,torch_amp LANGS=python REPEATS=5
# BUDGET: seconds the runs may take (default for the cpu profile: benchmarks/run.py's; 0: none).
# GPUS=N: across N processes under torchrun (Python only; ENGINES=ddp,fsdp2), see docs/bench.md.
PROFILE ?= cpu
CASES ?=
VARIANTS ?=
LANGS ?= python,r
REPEATS ?=
BUDGET ?=
GPUS ?=
ENGINES ?=
BENCH_OUT ?= benchmarks/results
# Fidelity (make fidelity; docs/bench.md, "Fidelity"): every variant's loss curve against REFERENCE's,
# SEEDS seeds x STEPS steps at FIDELITY_PROFILE's sizes; CASES and VARIANTS as for bench.
# On a GPU: make fidelity FIDELITY_PROFILE=full STEPS=500 SEEDS=5 [REFERENCE=ampkit_bf16]
# DATA=stream (token cases): a fresh batch a step from a token map with a known entropy floor
FIDELITY_PROFILE ?= tiny
STEPS ?= 40
SEEDS ?= 3
REFERENCE ?= fp32
FIDELITY_OUT ?= benchmarks/results/fidelity

.PHONY: setup setup-python setup-r test test-python test-r check-r bench fidelity clean

setup: setup-python setup-r

setup-python: $(PY_STAMP)

# Idempotent: keeps a torch that is already importable (the venv's, or the system's
# through --system-site-packages) and otherwise installs the CPU build pinned here
# first, so that pip never resolves a multi-GB CUDA build on a CPU machine.
$(PY_STAMP): pyproject.toml
	@if [ ! -x $(VPY) ]; then \
	  if $(PYTHON) -c 'import torch' 2>/dev/null; then \
	    echo "setup: reusing the system torch"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; fi
	@$(VPY) -c 'import torch' 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,bench,r]'
	@touch $@

setup-r: $(R_STAMP)

$(R_STAMP): $(PY_STAMP) $(shell find r/ampkit -type f 2>/dev/null)
	@if ! Rscript -e 'for (p in c("reticulate","testthat","withr","yaml","R6","rlang","jsonlite")) if (!requireNamespace(p, quietly = TRUE)) quit(status = 1)' >/dev/null 2>&1; then \
	  echo "setup: installing R from Debian's packages"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(R_DEBS); fi
	@mkdir -p $(RLIB)
	R CMD INSTALL --no-multiarch -l $(RLIB) r/ampkit >/dev/null
	@touch $@

test: setup test-python test-r check-r

test-python: setup-python
	$(VPY) -m pytest -q

test-r: setup
	cd r/ampkit/tests && $(R_ENV) Rscript -e 'testthat::test_dir("testthat", package = "ampkit", load_package = "installed", stop_on_failure = TRUE)'

check-r: setup
	rm -rf $(RLIB)/check && mkdir -p $(RLIB)/check
	cd $(RLIB)/check && R CMD build --no-build-vignettes $(CURDIR)/r/ampkit >/dev/null && \
	  { $(R_ENV) _R_CHECK_FORCE_SUGGESTS_=false R CMD check --no-manual --no-build-vignettes ampkit_*.tar.gz \
	      > check.log 2>&1; rc=$$?; cat check.log; \
	    test $$rc -eq 0 && grep -Eq '^Status: (OK|[0-9]+ NOTEs?)$$' check.log; }

bench: setup
	$(VPY) benchmarks/run.py --profile $(PROFILE) --out $(BENCH_OUT) \
	  $(if $(GPUS),--gpus $(GPUS) $(if $(ENGINES),--engines $(ENGINES)),--langs $(LANGS)) \
	  $(if $(CASES),--cases $(CASES)) $(if $(VARIANTS),--variants $(VARIANTS)) $(if $(REPEATS),--repeats $(REPEATS)) \
	  $(if $(BUDGET),--budget $(BUDGET))

fidelity: setup-python
	$(VPY) benchmarks/fidelity.py --profile $(FIDELITY_PROFILE) --steps $(STEPS) --seeds $(SEEDS) \
	  --reference $(REFERENCE) --out $(FIDELITY_OUT) $(if $(CASES),--cases $(CASES)) $(if $(VARIANTS),--variants $(VARIANTS)) \
	  $(if $(DATA),--data $(DATA))

clean:
	rm -rf $(VENV) $(RLIB) build *.egg-info python/*.egg-info
