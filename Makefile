# Set-up and the two jobs of the README. Everything goes into .venv; nothing global is touched.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Without an NVIDIA GPU, take the CPU build of torch first, so that pip does not pull a CUDA build;
# and Triton, whose interpreter runs the decode kernels' logic on the CPU in the tests (a CUDA
# build of torch brings its own).
TORCH_CPU := torch==2.13.0
TRITON_CPU := triton==3.6.0

.PHONY: demo test lint clean

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: torch comes from the project's requirements"; \
	else \
		$(PIP) install -q $(TORCH_CPU) $(TRITON_CPU); \
	fi
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PIP) install -q -e '.[compile]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.torch
	$(PIP) install -q -e '.[compile,dev]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/ftc compile model_specs/qwen3-moe-tiny.yaml --target auto --random-weights --force
	$(VENV)/bin/ftc inspect build/qwen3-moe-tiny
	$(VENV)/bin/ftc run build/qwen3-moe-tiny --prompt "Hello!" --max-new-tokens 32

test: $(VENV)/.installed-dev
	$(VENV)/bin/python -m pytest -q

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check ftc runtime tests bench

clean:
	rm -rf build $(VENV)
