"""--vllm_dtype: an engine asked for bfloat16 samples in it, and the float32 weights a trainer syncs land in it.

ppo_ray.py and rejection_sampling.py pass the flag to create_vllm_engines(dtype=...); the engines otherwise compute
in the trainers' precision (tests/test_weight_sync.py). On CPU the trainers compute in float32, so the synced
weights arrive in float32 and vLLM rounds them into its bfloat16 layers as it loads them.
"""

import os

os.environ.update(HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled", VLLM_CPU_KVCACHE_SPACE="1",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")

import pytest
import ray
from test_weight_sync import ROUNDING_LEVEL, TEXTS, logprob_diff, trained_model
from transformers import AutoTokenizer

from common.vllm_engine import create_vllm_engines, shutdown_engines
from common.weight_sync import broadcast_weights_to_vllm, init_weight_sync_group, iter_gathered_params

pytestmark = pytest.mark.slow


def test_a_bfloat16_engine_follows_a_float32_trainer(tiny_model):
    """The engine computes in bfloat16, and after a sync of a trained float32 model its log-probs differ from the
    trainer's by bfloat16's rounding: far above float32's, far below what a missed sync leaves."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        [engine] = create_vllm_engines(num_engines=1, tensor_parallel_size=1, pretrain_path=tiny_model, seed=0,
                                       max_model_len=256, enforce_eager=True, dtype="bfloat16")
        engine_dtype = lambda engine: str(engine.llm.llm_engine.model_config.dtype)
        assert ray.get(engine.__ray_call__.remote(engine_dtype)) == "torch.bfloat16"
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
        group = init_weight_sync_group([engine], shared_memory=True)
        model = trained_model(tiny_model, steps=20, seed=3)
        stale = logprob_diff(engine, prompts, model)  # the engine still holds the weights from disk

        broadcast_weights_to_vllm(iter_gathered_params(model), [engine], group)
        synced = logprob_diff(engine, prompts, model)
        assert ROUNDING_LEVEL < synced < stale / 5, (synced, stale)
        shutdown_engines([engine])
    finally:
        ray.shutdown()
