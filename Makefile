# Two commands for everyone:  make lab  (JupyterLab on notebooks/)  and  make test  (the whole suite).
# Both create .venv on first use with the exact versions of constraints.txt.

PYTHON ?= python3
VENV   ?= .venv
HOST   ?= 127.0.0.1
PORT   ?= 8888
PYTEST_ARGS ?= -n auto --dist loadfile
# CPU=1: PyTorch's CPU-only build (a few hundred MB instead of several GB of CUDA libraries),
# for machines without an NVIDIA GPU, e.g.  make lab CPU=1
CPU    ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

BIN    := $(VENV)/bin
# Jupyter refuses to run as root (containers, cloud shells) unless told to.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
STAMP  := $(VENV)/.installed

.PHONY: lab test venv notebooks clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --progress-bar on --upgrade "pip>=23"
	$(if $(CPU),$(BIN)/python -m pip install --progress-bar on -c constraints.txt --index-url $(TORCH_CPU_INDEX) torch)
	$(BIN)/python -m pip install --progress-bar on -c constraints.txt -e ".[notebooks,test]"
	touch $@

## JupyterLab on notebooks/, loopback only unless HOST is given; the URL with its token is printed.
lab: $(STAMP)
	@$(BIN)/python -c "import ttx_tutorial; print(ttx_tutorial.describe())"
	$(BIN)/jupyter lab --notebook-dir=notebooks --ip=$(HOST) --port=$(PORT) --no-browser $(ALLOW_ROOT)

## Unit tests, then every notebook under nbval (CPU mode without a GPU).
test: $(STAMP)
	@$(BIN)/python -c "import ttx_tutorial; print(ttx_tutorial.describe())"
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## Re-execute every notebook in place and keep its outputs (run after editing a notebook).
notebooks: $(STAMP)
	cd notebooks && for nb in [0-9]*.ipynb; do \
		../$(BIN)/jupyter nbconvert --to notebook --execute --inplace "$$nb" || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
