"""ppo_ray.py on model families the fixtures do not build: does vLLM sample from exactly the trainer's policy?

The fixtures are Llama and Qwen2 (tied and untied, with and without biases, GQA). Real models differ in more ways:
learned positions and Conv1D layers (GPT-2), fused q/k/v and gate/up projections in the checkpoint (Phi-3), scaled
embeddings and (1 + w) norms (Gemma), a parallel residual and partial rotary (GPT-NeoX), q/k norms (Qwen3, OLMo-2),
dropout in the config (GPT-2, OPT). For each family this builds a ~0.35M-parameter model with the project's
tokenizer and runs a few GRPO steps on 2 ZeRO-3 actor ranks, full and with LoRA, under a reward that varies between
a random model's samples, so that every step moves the weights. Each step logs `vllm/logprob_diff`, the mean
|vLLM's log-prob - the trainer's| of the sampled tokens after the previous step's weight sync: a wrong sync, a
dropout left on or a position mix-up shows as 1e-2 and more, an exact one as ~1e-7.

Not a test (CI does not run it: 9 minutes on 2 cores); run it after touching the weight sync, LoRA merging or
model loading.

    .venv/bin/python tests/try_model_families.py --out /tmp/families                 # every family, full and LoRA
    .venv/bin/python tests/try_model_families.py --out /tmp/families --families gpt2 opt --variants full
"""

import argparse
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.synthetic_task import write_task  # noqa: E402
from common.tiny_model import build_tokenizer  # noqa: E402

LAYERS = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "max_position_embeddings": 256}
FAMILIES = {
    "gpt2": {"n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 256},  # its config's dropouts are 0.1
    "opt": {**LAYERS, "ffn_dim": 256, "word_embed_proj_dim": 128},  # dropout 0.1
    "phi3": {**LAYERS, "num_key_value_heads": 2},
    "gemma": {**LAYERS, "num_key_value_heads": 1, "head_dim": 32},
    "gemma2": {**LAYERS, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 64},
    "gpt_neox": {**LAYERS, "rotary_pct": 0.25, "tie_word_embeddings": False},
    "mistral": {**LAYERS, "num_key_value_heads": 2, "sliding_window": None},
    "qwen3": {**LAYERS, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True},
    "olmo2": {**LAYERS, "num_key_value_heads": 2},
}
# LoRA's learning rate is 10x, so that the adapters, which start at 0, move the policy as much (later flags win).
VARIANTS = {"full": [], "lora": ["--lora_rank", "8", "--lora_alpha", "16", "--actor_learning_rate", "1e-2"]}
REWARD = '''def reward_fn(prompts, responses, labels):
    """The response's length mod 5: it varies between a random model's samples, so GRPO's advantages do too."""
    return [float(len(r) % 5) for r in responses]
'''


def write_model(family: str, out: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  **FAMILIES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run(model: str, prompts: str, reward: str, out: str, extra: list[str]) -> tuple[int, list[float], list[float]]:
    """(exit code, vllm/logprob_diff per step, objective/kl per step) of a 3-step GRPO run."""
    cmd = [sys.executable, os.path.join(ROOT, "ppo_ray.py"), "--pretrain", model, "--prompt_data", prompts,
           "--reward_fn", reward + ":reward_fn", "--apply_chat_template", "--prompt_max_len", "64",
           "--generate_max_len", "8", "--advantage_estimator", "grpo", "--n_samples_per_prompt", "4",
           "--rollout_batch_size", "8", "--train_batch_size", "32", "--micro_train_batch_size", "16",
           "--actor_learning_rate", "1e-3", "--max_steps", "3", "--zero_stage", "3", "--actor_num_workers", "2",
           "--output_dir", out, *extra]
    with open(out + ".log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    path = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    steps = [m for m in rows if "vllm/logprob_diff" in m]
    return code, [m["vllm/logprob_diff"] for m in steps], [m.get("objective/kl", 0.0) for m in steps]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the models, the task and the runs")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    prompts = write_task(os.path.join(args.out, "task"), seed=0)["prompts_train"]
    reward = os.path.join(args.out, "reward.py")
    with open(reward, "w") as f:
        f.write(REWARD)
    print(f"{'family':10} {'variant':8} exit  vllm/logprob_diff per step       objective/kl per step")
    worst = 0.0
    for family in args.families:
        model = write_model(family, os.path.join(args.out, family))
        for variant in args.variants:
            out = os.path.join(args.out, f"run_{family}_{variant}")
            code, diffs, kls = run(model, prompts, reward, out, VARIANTS[variant])
            worst = max([worst, *diffs]) if code == 0 else float("inf")
            print(f"{family:10} {variant:8} {code:4}  {' '.join(f'{d:.1e}' for d in diffs):32} "
                  f"{' '.join(f'{k:.4f}' for k in kls)}" + ("" if code == 0 else f"   (log: {out}.log)"), flush=True)
    print(f"largest vllm/logprob_diff: {worst:.1e}" + ("  (a run failed)" if worst == float("inf") else ""))


if __name__ == "__main__":
    main()
