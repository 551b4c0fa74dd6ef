"""Rejection sampling: best-of-n SFT data, conditional SFT data and iterative DPO pairs, sampled with vLLM and scored
with reward models and rule-based rewards.

For every prompt, sample n responses from the policy with vLLM, score each one, and keep (`--mode`):
  best_of_n  the best response of each prompt, as SFT data {"prompt", "response", "reward"} for sft.py: rejection
             sampling fine-tuning (Touvron et al. 2023, "Llama 2", sec. 3.2.3; Dong et al. 2023, "RAFT");
  csft       every response, with its reward written into its prompt, as SFT data for sft.py: conditional SFT
             (Hu et al. 2023, "Aligning Language Models with Offline Learning from Human Feedback");
  dpo_pairs  the best response as chosen and the worst as rejected, as pairs {"prompt", "chosen", "rejected",
             "chosen_reward", "rejected_reward", "chosen_truncated", "rejected_truncated"} for dpo.py: iterative
             DPO (Xiong et al. 2024, "Iterative Preference Learning from Human Feedback").
With `--iterations K`, each of K rounds samples, scores, selects and trains (sft.py, or dpo.py for pairs) as a user
would run them, and the next round samples from the model just trained.

    python rejection_sampling.py --pretrain out/sft --dataset prompts.jsonl --apply_chat_template \
        --reward_pretrain out/rm --n_samples_per_prompt 8 --output_dir out/rs
    python rejection_sampling.py ... --reward_fn common/synthetic_task.py:reward_fn --iterations 3 \
        --train_args "--max_steps 200 --learning_rate 1e-5"

Asking a conditional-SFT model for a good answer: the prompt of every training sample is --csft_template filled with
the prompt and the sample's reward, "{prompt} <rm_score>: {reward}" by default (a chat prompt gets it in its last
user message). At inference, fill in a high reward: the highest one in the data, which the script prints and logs as
csft/high_reward ("What is 3+4? <rm_score>: 1.0" for the 0/1 rule reward of the synthetic task). Rewards from a
reward model are normalised with the reward_mean / reward_std that rm.py stores, so there 2.0 means two standard
deviations above the mean.

Implementation details, where they happen below:
  - prompts are rendered as the trainers render them (common/data.py), so the data trains on what was sampled;
    a prompt that leaves less than --generate_max_len tokens of the engines' context is refused before sampling;
  - prompts are sent to the engines in chunks of --generate_batch_size, round-robin, which spreads the work over
    several engines and gives a progress bar; engine i of iteration k is seeded with seed + k x engines + i;
  - the engines are shut down before scoring and training, so those get the whole machine (and GPUs);
  - reward sources (common/rewards.py) are reward models, which see prompt + response + EOS exactly as rm.py
    trained them and are normalised by their stored mean/std, a rule-based `--reward_fn`, and a remote reward model
    (`--remote_rm_url`); with several, the reward is their weighted sum (--reward_weights);
  - responses cut at --generate_max_len are not selected as answers (unless --keep_truncated): the trainers end each
    response with EOS and would teach the model to stop where the limit cut; a prompt with no whole response gives
    none. A pair may reject a cut response (a rambling answer is a wrong one), marked by "rejected_truncated": dpo.py
    then trains it without the end-of-turn token it never had;
  - ties go to the first sample with the top (or bottom) reward; a pair whose best and worst rewards are equal
    carries no preference and is skipped; `--min_reward` drops prompts whose best sample's reward (the weighted
    sum) is lower (RAFT's filter: with a 0/1 rule reward alone, 1.0 keeps only solved prompts); a later round
    left with less than one training batch (a model that answers nearly every question right) trains nothing, and
    the next samples the last trained model again;
  - with csft, rounds after the first sample with the prompt asking for the last round's highest reward;
  - every stage writes its file atomically (temp file + rename) and state.json records the finished iterations:
    rerunning the same command after a kill resumes in the iteration it was in, reusing the samples already
    generated and scored; sft.py / dpo.py resume their own training when --train_args has --save_steps.

Output, under --output_dir (with --iterations 0, the iteration files sit in --output_dir itself):
    state.json                   the run's settings and how many iterations are finished
    metrics.jsonl, tensorboard/  per iteration: rewards, samples per second, share of time in each stage
    iter_K/generations.jsonl     {"prompt", "label", "responses", "truncated"}  (truncated: cut at the length limit)
    iter_K/scored.jsonl          {"prompt", "label", "responses", "rewards", "truncated"}
    iter_K/<mode>.jsonl          the data: best_of_n.jsonl, csft.jsonl or dpo_pairs.jsonl
    iter_K/model/                the model trained on it
"""

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import ray
import torch

from common import data, rewards, vlm
from common.args import (UserError, check_causal_lm, check_decoder_only, check_lengths, check_model_path,
                         check_output_dir, model_max_len, parse_args, run_main, stop_on_sigterm)
from common.checkpoint import SaveFailed, describe, write_atomically
from common.deepspeed_utils import load_tokenizer
from common.logging_utils import MetricsLogger, progress
from common.output_lock import hold_output_folders
from common.vllm_engine import EngineHung, create_vllm_engines, first_answer, shutdown_engines

ROOT = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Args:
    # --- model and data
    pretrain: str = ""
    """the policy to sample from, usually an SFT model: a Hugging Face model folder or hub name"""
    dataset: str = ""
    """prompts: a .jsonl/.json/.parquet file, a folder of them, or a `datasets` name"""
    dataset_split: str = "train"
    """split to read when --dataset is a `datasets` name, a saved DatasetDict or a folder of per-split files"""
    input_key: str = "prompt"
    """key of the prompt (text, or a list of chat messages)"""
    label_key: str = "label"
    """key of a reference answer handed to --reward_fn and --remote_rm_url (None for rows without it)"""
    apply_chat_template: bool = False
    """render prompts with the tokenizer's chat template"""
    input_template: str | None = None
    """a template such as 'Question: {} Answer: ' the prompt is formatted into (without a chat template)"""
    max_samples: int = 0
    """use only the first this many prompts (0: all)"""
    prompts_per_iteration: int = 0
    """with --iterations: round k samples prompts k*P .. (k+1)*P-1 of the dataset, wrapping around, so that each
    round sees prompts the previous ones did not (0: every prompt in every round)"""
    output_dir: str = "out/rejection_sampling"
    """where the data, the models of --iterations, the metrics and state.json go"""
    seed: int = 42
    """random seed of the samplers"""
    use_wandb: bool = False
    """also log to Weights & Biases (offline without WANDB_API_KEY)"""
    wandb_project: str = "rlhf-rejection-sampling"
    """wandb project name"""
    # --- generation
    vllm_num_engines: int = 1
    """vLLM engines the prompts are spread over, each a Ray actor"""
    vllm_tensor_parallel_size: int = 1
    """GPUs per vLLM engine"""
    vllm_gpu_memory_utilization: float = 0.85
    """share of each GPU's memory a vLLM engine may take"""
    vllm_dtype: Literal["trainer", "bfloat16", "float16", "float32"] = "trainer"
    """precision the engines sample in: the trainers' (bfloat16 on GPUs of compute capability 8.0 and up, float32
    elsewhere), or another (bfloat16 on a CPU with AVX-512 BF16 or AMX samples about 1.5x faster than float32)"""
    enforce_eager: bool = False
    """run vLLM without CUDA graphs (starts faster)"""
    max_model_len: int | None = None
    """context of the vLLM engines: every prompt plus --generate_max_len tokens must fit in it (default: what the
    model takes, at most 2048)"""
    n_samples_per_prompt: int = 8
    """responses sampled per prompt (the n of best-of-n)"""
    temperature: float = 1.0
    """sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p"""
    generate_max_len: int = 1024
    """most tokens per response"""
    generate_batch_size: int = 256
    """prompts per request to an engine; requests go round-robin to the engines"""
    # --- rewards
    reward_pretrain: list[str] = field(default_factory=list)
    """reward models saved by rm.py, one or more; each must use the policy's tokenizer"""
    reward_fn: str | None = None
    """a rule-based reward, path/to/file.py:function, called as function(prompts, responses, labels) -> floats"""
    reward_timeout: float = 600.0
    """seconds a --reward_fn call may take before the run stops (0: no limit)"""
    remote_rm_url: str | None = None
    """a reward model served over HTTP: POST {"prompts", "responses", "labels"}, answer {"rewards"}"""
    reward_weights: list[float] = field(default_factory=list)
    """one weight per reward source, in the order --reward_pretrain..., --reward_fn, --remote_rm_url (default: 1s)"""
    reward_batch_size: int = 64
    """responses scored per batch"""
    # --- selection
    mode: Literal["best_of_n", "csft", "dpo_pairs"] = "best_of_n"
    """the data to write: best response per prompt (SFT), every response with its reward in the prompt
    (conditional SFT), or best/worst pairs (DPO)"""
    min_reward: float | None = None
    """best_of_n and dpo_pairs: drop prompts whose best response scores below this"""
    keep_truncated: bool = False
    """also select responses cut at --generate_max_len. They are left out by default: the trainers end every response
    with EOS, so a cut one would teach the model to stop where the limit cut it"""
    csft_template: str = "{prompt} <rm_score>: {reward}"
    """csft: how a prompt and a reward are written into the training prompt"""
    csft_decimals: int = 1
    """csft: decimals the reward is written with"""
    # --- iterations
    iterations: int = 0
    """rounds of sample, score, select and train, each sampling from the last round's model (0: write data only)"""
    train_args: str = ""
    """extra flags for sft.py / dpo.py, e.g. "--max_steps 200 --learning_rate 1e-5" """
    train_num_gpus: int = 1
    """ranks sft.py / dpo.py train with (launched with `deepspeed --num_gpus N` when more than 1)"""


# Settings a resumed run may change: they decide neither which samples are drawn nor how they are selected. More
# --iterations continue a finished run with more rounds. (Not --generate_batch_size: its chunks decide which engine,
# each seeded apart, samples which prompts, in which batches.)
RESUMABLE_CHANGES = ("iterations", "train_num_gpus", "reward_batch_size", "use_wandb", "vllm_gpu_memory_utilization",
                     "enforce_eager")


# ------------------------------------------------------------------------------------------------- ALGO LOGIC
def best_and_worst(scores: list[float], indices=None) -> tuple[int, int]:
    """Indices of a highest- and of a lowest-reward sample among `indices` (default all); on ties, the first one."""
    indices = range(len(scores)) if indices is None else indices
    return max(indices, key=scores.__getitem__), min(indices, key=scores.__getitem__)


def conditioned_prompt(prompt, reward: float, template: str, decimals: int):
    """The prompt with `reward` written into it (a chat: into its last user message), as conditional SFT trains on."""
    value = round(reward, decimals) + 0.0  # + 0.0 turns -0.0 into 0.0, so the model sees one spelling of zero
    fill = lambda text: template.format(prompt=text, reward=f"{value:.{decimals}f}")
    if isinstance(prompt, str):
        return fill(prompt)
    messages = [dict(m) for m in data.as_messages(prompt)]
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise data.DataError(f"a chat prompt has no user message to write the reward into: {str(prompt)[:80]!r}.")
    messages[users[-1]]["content"] = fill(messages[users[-1]]["content"])
    return messages


def select(mode: str, prompts: list, responses: list[list[str]], scores: list[list[float]],
           min_reward: float | None = None, csft_template: str = "", csft_decimals: int = 1,
           truncated: list[list[bool]] | None = None, keep_truncated: bool = False) -> tuple[list[dict], int]:
    """The records `mode` writes for these scored samples, and the number of prompts that gave none.

    Samples marked in `truncated` (cut at the length limit) are not trained on as answers unless keep_truncated, and
    a prompt with no other gives none; a pair may still reject one (the pair marks which side was cut)."""
    records, skipped = [], 0
    for i, (prompt, texts, prompt_scores) in enumerate(zip(prompts, responses, scores)):
        cut = truncated[i] if truncated else [False] * len(texts)
        whole = [j for j in range(len(texts)) if keep_truncated or not cut[j]]
        if not whole:
            skipped += 1
            continue
        best, worst = best_and_worst(prompt_scores, whole)
        if mode == "csft":  # every sample teaches what a response of its reward looks like
            records += [{"prompt": conditioned_prompt(prompt, prompt_scores[j], csft_template, csft_decimals),
                         "response": texts[j], "reward": prompt_scores[j]} for j in whole]
        elif min_reward is not None and prompt_scores[best] < min_reward:
            skipped += 1
        elif mode == "best_of_n":
            records.append({"prompt": prompt, "response": texts[best], "reward": prompt_scores[best]})
        else:  # dpo_pairs: the worst of all samples; a rambling one the limit cut is as wrong as a finished one
            worst = best_and_worst(prompt_scores)[1]
            if prompt_scores[best] == prompt_scores[worst] or texts[best] == texts[worst]:
                skipped += 1  # all samples equally good, no preference to learn
            else:  # the marks let the trainer leave out the end a cut response never had (common/data.py)
                records.append({"prompt": prompt, "chosen": texts[best], "rejected": texts[worst],
                                "chosen_reward": prompt_scores[best], "rejected_reward": prompt_scores[worst],
                                "chosen_truncated": cut[best], "rejected_truncated": cut[worst]})
    return records, skipped
# --------------------------------------------------------------------------------------------- END ALGO LOGIC


# --max_model_len when it is not given and the model takes more: what the engines reserve KV cache for.
DEFAULT_MAX_MODEL_LEN = 2048


def check_args(args: Args) -> None:
    """Mistakes in the flags, caught before anything loads; fills in --max_model_len from the model."""
    rewards.reward_weights(args.reward_weights, args.reward_pretrain, args.reward_fn, args.remote_rm_url)
    check_model_path(args.pretrain)
    if not vlm.check_sampler_args(args):
        check_causal_lm(args.pretrain)
    check_output_dir(args.output_dir)
    limit = model_max_len(args.pretrain)
    if args.max_model_len is None:
        args.max_model_len = min(limit or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
    check_lengths(args.pretrain, "--max_model_len", args.max_model_len, "--max_model_len")
    for path in args.reward_pretrain:
        check_model_path(path, "--reward_pretrain")
        if not vlm.is_vision_language(path):  # a vision-language one's scalar head is common/vlm.py's
            check_decoder_only(path, "--reward_pretrain")
        check_lengths(path, "--max_model_len", args.max_model_len, "--max_model_len", "--reward_pretrain")
    if args.generate_max_len >= args.max_model_len:
        raise UserError(f"--generate_max_len {args.generate_max_len} leaves no room for a prompt in --max_model_len "
                        f"{args.max_model_len}; lower --generate_max_len.")
    if args.mode == "dpo_pairs" and args.n_samples_per_prompt < 2:
        raise UserError(f"--mode dpo_pairs needs --n_samples_per_prompt of at least 2 to pair a best and a worst "
                        f"response, got {args.n_samples_per_prompt}.")
    if args.n_samples_per_prompt < 1 or args.generate_max_len < 1 or args.vllm_num_engines < 1:
        raise UserError("--n_samples_per_prompt, --generate_max_len and --vllm_num_engines must be at least 1.")
    if args.mode == "csft" and args.min_reward is not None:
        raise UserError("--min_reward drops prompts in best_of_n and dpo_pairs; conditional SFT keeps every sample, "
                        "so leave it unset with --mode csft.")
    if "{prompt}" not in args.csft_template or "{reward}" not in args.csft_template:
        raise UserError(f"--csft_template must contain {{prompt}} and {{reward}}, got {args.csft_template!r}.")
    if args.iterations < 0 or args.train_num_gpus < 1:
        raise UserError("--iterations must be 0 or more and --train_num_gpus at least 1.")
    if args.prompts_per_iteration < 0 or args.max_samples < 0:
        raise UserError("--prompts_per_iteration and --max_samples must be 0 (all prompts) or more.")
    if args.prompts_per_iteration and not args.iterations:
        raise UserError("--prompts_per_iteration splits the prompts among the rounds of --iterations; without "
                        "rounds, use --max_samples to sample fewer prompts.")


def tokenize_prompts(tokenizer, prompts: list, args: Args, source: str) -> list[list[int]]:
    """Token ids of every rendered prompt; a UserError when one leaves no room for a response in the context."""
    texts = []
    for i, prompt in enumerate(prompts):
        with data.sample_context(source, i):
            texts.append(data.render_prompt(tokenizer, prompt, args.apply_chat_template, args.input_template))
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    too_long = [i for i, prompt_ids in enumerate(ids) if len(prompt_ids) + args.generate_max_len > args.max_model_len]
    if too_long:
        i = too_long[0]
        raise UserError(f"{len(too_long)} prompts of {source} do not fit the engine's context: prompt {i} has "
                        f"{len(ids[i])} tokens, and with --generate_max_len {args.generate_max_len} that exceeds "
                        f"--max_model_len {args.max_model_len}; raise --max_model_len or shorten those prompts.")
    return ids


def generate(args: Args, policy: str, prompt_ids: list[list[int]], seed: int, desc: str, images=None):
    """n sampled responses (token ids) per prompt from fresh vLLM engines, which are shut down afterwards.

    Returns (responses, which of them were cut at --generate_max_len, seconds spent sampling once the engines were
    up). `images`: a vision-language policy's, one list per prompt (common/vlm.py prompts_with_images).
    """
    ray.init(address="local", include_dashboard=False, log_to_driver=False)  # this run's own, even if another runs
    stop_on_sigterm()  # Ray's driver took SIGTERM over (it aborts); a stop should say what survives
    try:
        engines = create_vllm_engines(args.vllm_num_engines, args.vllm_tensor_parallel_size, policy, seed,
                                      args.max_model_len, args.vllm_gpu_memory_utilization, args.enforce_eager,
                                      dtype=None if args.vllm_dtype == "trainer" else args.vllm_dtype,
                                      stop_at_end_of_turn=args.apply_chat_template)
        start = time.time()
        starts = range(0, len(prompt_ids), args.generate_batch_size)
        chunks = [prompt_ids[i: i + args.generate_batch_size] for i in starts]
        pending = {engines[c % len(engines)].generate.remote(chunk, n=args.n_samples_per_prompt,
                                                             temperature=args.temperature, top_p=args.top_p,
                                                             max_tokens=args.generate_max_len, logprobs=False,
                                                             images=images and images[i: i + len(chunk)]): c
                   for c, (i, chunk) in enumerate(zip(starts, chunks))}
        results = [None] * len(chunks)
        bar = progress(len(prompt_ids) * args.n_samples_per_prompt, 0, desc)
        while pending:
            done = first_answer(list(pending), {ref: c % len(engines) for ref, c in pending.items()}, len(engines))
            c = pending.pop(done)
            results[c] = ray.get(done)
            bar.update(len(results[c]) * args.n_samples_per_prompt)
        bar.close()
        sampling_seconds = time.time() - start
        shutdown_engines(engines)
    except EngineHung as e:
        raise UserError(f"{e}; {finished_note(args)}. Rerun the same command to resume.") from None
    finally:
        ray.shutdown()
        stop_on_sigterm()  # Ray's core worker leaves SIGTERM at its default (death, no word) when it shuts down
    per_prompt = [samples for chunk in results for samples in chunk]
    return ([[sample["token_ids"] for sample in samples] for samples in per_prompt],
            [[sample["finish_reason"] == "length" for sample in samples] for samples in per_prompt], sampling_seconds)


def score(args: Args, prompts: list, labels: list, responses: list[list[str]], reward_fn, desc: str, images=None):
    """The reward of every response, (prompts, n), from the weighted sum of all reward sources, scored in batches.

    Each reward model reads prompt + response rendered by its own tokenizer (its chat template; the same
    --input_template), as rm.py trained it and as ppo_ray.py's reward models read them: main has checked that the
    vocabularies and EOS are the policy's. A vision-language reward model reads each prompt's `images` too."""
    n = args.n_samples_per_prompt
    flat_prompts = [p for p in prompts for _ in range(n)]
    flat_images = [row_images for row_images in images or [[]] * len(prompts) for _ in range(n)]
    flat_labels = [label for label in labels for _ in range(n)]
    flat_responses = [r for texts in responses for r in texts]
    models = [rewards.load_reward_model(path) for path in args.reward_pretrain]
    weights = rewards.reward_weights(args.reward_weights, args.reward_pretrain, args.reward_fn, args.remote_rm_url)
    total = []
    bar = progress(len(flat_responses), 0, desc)
    for start in range(0, len(flat_responses), args.reward_batch_size):
        batch = slice(start, start + args.reward_batch_size)
        p, r, labels_ = flat_prompts[batch], flat_responses[batch], flat_labels[batch]
        # A prompt + response fills at most the engine's context; its EOS may add one token.
        # each reward model reads the pair rendered with its own tokenizer's chat template, as rm.py trained it
        model_scores = [rewards.reward_model_scores(model, rm_tokenizer, p, r, args.apply_chat_template,
                                                    args.input_template, args.reward_batch_size,
                                                    args.max_model_len + 1, flat_images[batch])
                        for model, rm_tokenizer in models]
        summed, _ = rewards.score_responses(model_scores, reward_fn, args.remote_rm_url, weights, p, r, labels_,
                                            torch.float64)
        total += summed.tolist()
        bar.update(len(r))
    bar.close()
    del models
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the trainer, started next, needs the memory
    return [total[i * n: (i + 1) * n] for i in range(len(prompts))]


def train_command(args: Args, policy: str, dataset: str, out: str) -> list[str]:
    """The sft.py / dpo.py command line a user would type to train `policy` on `dataset`."""
    script = os.path.join(ROOT, "dpo.py" if args.mode == "dpo_pairs" else "sft.py")
    launcher = [sys.executable]
    if args.train_num_gpus > 1:  # `deepspeed --num_gpus N`, from this Python environment
        launcher += ["-m", "deepspeed.launcher.runner", "--num_gpus", str(args.train_num_gpus)]
    flags = ["--pretrain", policy, "--dataset", dataset, "--output_dir", out]
    flags += ["--apply_chat_template"] if args.apply_chat_template else []
    flags += ["--input_template", args.input_template] if args.input_template else []
    extra = shlex.split(args.train_args)
    if not any(flag == "--max_len" or flag.startswith("--max_len=") for flag in extra):
        # the trainers' default (512) would cut the selected responses that --max_model_len let the engines write,
        # and their EOS with them
        flags += ["--max_len", str(args.max_model_len)]
    return launcher + [script] + flags + extra


def write_atomic(path: str, text: str) -> None:
    """Write a file under a temporary name, then rename it: a run killed meanwhile leaves the old file or none; a
    full disk, one sentence."""
    try:
        write_atomically(path, text)
    except OSError as e:
        raise SaveFailed(f"could not write {path} ({describe(e, os.path.dirname(path))}); make room there and rerun "
                         f"the same command to resume.") from None


def write_jsonl(path: str, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def finished_note(args: Args) -> str:
    """What a stopped run keeps, as a clause: the iterations it finished (a resumed run starts after them)."""
    path = os.path.join(args.output_dir, "state.json")
    done = json.load(open(path))["finished_iterations"] if os.path.exists(path) else 0
    return f"{done} finished iteration(s) in {args.output_dir} are kept" if done else "no iteration was finished"


def load_state(args: Args) -> dict:
    """The state of a run in output_dir (started now if there is none); refuses one started with other settings."""
    path = os.path.join(args.output_dir, "state.json")
    if os.path.exists(path):
        with open(path) as f:
            state = json.load(f)
        saved = state["args"]
        changed = [k for k in vars(args) if k not in RESUMABLE_CHANGES and saved.get(k) != getattr(args, k)]
        if changed:
            k = changed[0]
            raise UserError(f"{args.output_dir} holds a run started with --{k} {saved.get(k)!r}, not "
                            f"{getattr(args, k)!r}; rerun with its settings to resume it, or use another --output_dir.")
        if (saved["iterations"] == 0) != (args.iterations == 0):  # data only vs rounds that train: other layouts
            raise UserError(f"{args.output_dir} holds a run started with --iterations {saved['iterations']}; one with "
                            f"--iterations {args.iterations} cannot continue it, so use another --output_dir.")
        return state
    state = {"args": vars(args), "finished_iterations": 0}
    os.makedirs(args.output_dir, exist_ok=True)
    save_state(args, state)
    return state


def save_state(args: Args, state: dict) -> None:
    write_atomic(os.path.join(args.output_dir, "state.json"), json.dumps(state, indent=1))


def iteration_prompts(k: int, total: int, per_iteration: int) -> list[int]:
    """Indices of the prompts round k samples: its own slice of `per_iteration`, wrapping around; all if 0."""
    if not per_iteration:
        return list(range(total))
    return [(k * per_iteration + i) % total for i in range(min(per_iteration, total))]


def iteration_dir(args: Args, k: int) -> str:
    return os.path.join(args.output_dir, f"iter_{k}") if args.iterations else args.output_dir


# sft.py's and dpo.py's --train_batch_size when --train_args gives none (a test checks they agree)
TRAINER_BATCH_SIZE = 32


def trainer_batch_size(args: Args) -> int:
    """The --train_batch_size the round's trainer gets: the one in --train_args, or the trainers' default."""
    extra = shlex.split(args.train_args)
    for i, flag in enumerate(extra):
        value = flag.split("=", 1)[1] if flag.startswith("--train_batch_size=") else (
            extra[i + 1] if flag == "--train_batch_size" and i + 1 < len(extra) else None)
        if value is not None and not value.isdigit():
            raise UserError(f"--train_args gives --train_batch_size {value!r}; give a whole number.")
        if value is not None:
            return int(value)
    return TRAINER_BATCH_SIZE


def round_policy(args: Args, k: int) -> str:
    """The model round k samples from: the one the latest earlier round trained, or --pretrain. A later round left
    with less than a batch (every answer right, or every one wrong: a model that has learned what pairs can teach)
    trains none."""
    trained = [os.path.join(iteration_dir(args, j), "model") for j in range(k)]
    return next((path for path in reversed(trained) if os.path.exists(path)), args.pretrain)


def main(args: Args):
    check_args(args)
    tokenizer = load_tokenizer(args.pretrain)
    for path in args.reward_pretrain:
        rewards.check_same_tokenizer(tokenizer, load_tokenizer(path, "--reward_pretrain"),
                                     f"--pretrain {args.pretrain}", f"--reward_pretrain {path}",
                                     args.apply_chat_template)
    reward_fn = rewards.load_reward_fn(args.reward_fn, args.reward_timeout, args.label_key) if args.reward_fn \
        else None
    rows = data.load_records(args.dataset, args.dataset_split)[: args.max_samples or None]
    if not rows:
        raise data.DataError(f"dataset {args.dataset} is empty.")
    data.check_prompt_parts(rows, args.input_key, (args.label_key,), args.dataset)
    all_prompts = [data.get_key(row, args.input_key, i, args.dataset) for i, row in enumerate(rows)]
    all_images = None  # a vision-language policy's: one list per prompt
    if vlm.is_vision_language(args.pretrain):
        all_prompts, all_images = vlm.prompts_with_images(all_prompts, args.dataset)
    else:
        vlm.check_takes_images(rows, args.input_key, args.dataset, args.pretrain)
    read = args.reward_fn or args.remote_rm_url  # what gets the labels: said when they are missing
    all_labels = data.get_labels(rows, args.label_key, args.dataset, print if read else lambda message: None)
    all_ids = tokenize_prompts(tokenizer, all_prompts, args, args.dataset)

    hold_output_folders(args.output_dir)
    state = load_state(args)
    rounds, n = max(args.iterations, 1), args.n_samples_per_prompt
    if state["finished_iterations"] >= rounds:
        print(f"{args.output_dir}: all {rounds} iteration(s) are finished already.")
        return
    logger = MetricsLogger(args.output_dir, 0, vars(args), args.use_wandb, args.wandb_project,
                           resume_step=state["finished_iterations"])
    for k in range(state["finished_iterations"], rounds):
        out = iteration_dir(args, k)
        os.makedirs(out, exist_ok=True)
        picked = iteration_prompts(k, len(all_prompts), args.prompts_per_iteration)
        prompts, labels, prompt_ids = ([xs[i] for i in picked] for xs in (all_prompts, all_labels, all_ids))
        policy = round_policy(args, k)
        files = {name: os.path.join(out, f"{name}.jsonl") for name in ("generations", "scored", args.mode)}
        seconds = dict.fromkeys(("generate", "sampling", "score", "train"), 0.0)  # stages a resumed run skips: 0

        # ---- sample n responses per prompt
        if os.path.exists(files["generations"]):
            print(f"iteration {k}: resuming with the samples in {files['generations']}")
        else:
            start, sample_ids = time.time(), prompt_ids
            if args.mode == "csft" and k > 0:  # from the second round on, sample what the model is trained to give
                previous = data.load_records(os.path.join(os.path.dirname(policy), "csft.jsonl"))
                high = max(row["reward"] for row in previous)
                sample_ids = tokenize_prompts(tokenizer, [conditioned_prompt(p, high, args.csft_template,
                                                                             args.csft_decimals) for p in prompts],
                                              args, args.dataset)
            token_ids, cut, seconds["sampling"] = generate(args, policy, sample_ids,
                                                           args.seed + k * args.vllm_num_engines,
                                                           f"iteration {k}: generate",
                                                           all_images and [all_images[i] for i in picked])
            responses = [[data.decode_response(tokenizer, ids, response) for response in samples]
                         for ids, samples in zip(sample_ids, token_ids)]
            write_jsonl(files["generations"], [{"prompt": p, "label": label, "responses": texts, "truncated": c}
                                               for p, label, texts, c in zip(prompts, labels, responses, cut)])
            seconds["generate"] = time.time() - start
        generations = data.load_records(files["generations"])
        responses = [row["responses"] for row in generations]
        truncated = [row.get("truncated") or [False] * n for row in generations]  # files written before it was kept
        if len(responses) != len(prompts) or any(len(texts) != n for texts in responses + truncated):
            raise UserError(f"{files['generations']} does not hold {n} responses for each of the {len(prompts)} "
                            f"prompts; it belongs to another run: use another --output_dir.")
        if [row.get("prompt") for row in generations] != prompts or [row.get("label") for row in generations] != labels:
            raise UserError(f"{files['generations']} holds responses to other prompts or labels than this "
                            f"iteration's from {args.dataset} (was the dataset changed?); it belongs to another run: "
                            f"use another --output_dir.")

        # ---- score them
        if os.path.exists(files["scored"]):
            scores = [row["rewards"] for row in data.load_records(files["scored"])]
        else:
            start = time.time()
            scores = score(args, prompts, labels, responses, reward_fn, f"iteration {k}: score",
                           all_images and [all_images[i] for i in picked])
            scored = zip(prompts, labels, responses, scores, truncated)
            write_jsonl(files["scored"], [{"prompt": p, "label": label, "responses": texts, "rewards": s,
                                           "truncated": c} for p, label, texts, s, c in scored])
            seconds["score"] = time.time() - start

        # ---- select the data
        records, skipped = select(args.mode, prompts, responses, scores, args.min_reward, args.csft_template,
                                  args.csft_decimals, truncated, args.keep_truncated)
        cut = sum(map(sum, truncated))
        left_out = "" if args.keep_truncated or not cut else (
            f"; {cut} of {len(prompts) * n} responses were cut at --generate_max_len and not selected as answers "
            f"(raise it, or pass --keep_truncated)")
        if not records and (not args.iterations or policy == args.pretrain):  # else a model learned all it could
            raise UserError(f"iteration {k} kept no sample: for every prompt, the best reward is below --min_reward, "
                            f"all samples tie or all were cut at the length limit{left_out}; the scored samples are "
                            f"in {files['scored']}.")
        write_jsonl(files[args.mode], records)
        # best and worst among the responses selection may pick: whole ones (unless --keep_truncated) as the answer,
        # and any as a pair's rejected one, over the prompts that have a whole one
        pickable = [([r for r, c in zip(row, cuts) if args.keep_truncated or not c], row)
                    for row, cuts in zip(scores, truncated)]
        pickable = [(whole, row if args.mode == "dpo_pairs" else whole) for whole, row in pickable if whole]
        mean = lambda values: sum(values) / max(len(values), 1)
        metrics = {"rewards/mean": sum(map(sum, scores)) / (len(scores) * n),
                   "rewards/best_mean": mean([max(best) for best, _ in pickable]),
                   "rewards/worst_mean": mean([min(worst) for _, worst in pickable]),
                   "data/records": len(records), "data/prompts_skipped": skipped,
                   "data/truncated_share": cut / (len(prompts) * n)}
        summary = f"wrote {len(records)} records to {files[args.mode]} ({skipped} prompts skipped{left_out})"
        if args.mode == "csft" and records:
            metrics["csft/high_reward"] = max(round(row["reward"], args.csft_decimals) for row in records)
            example = conditioned_prompt(prompts[0], metrics["csft/high_reward"], args.csft_template,
                                         args.csft_decimals)
            summary += f"; ask a model trained on it for a high-reward answer with prompts like {example!r}"

        # ---- train on them, as a user would
        if args.iterations and len(records) < trainer_batch_size(args) and policy != args.pretrain:
            summary += (f"; fewer than one batch of {trainer_batch_size(args)} to train on, so the next round samples "
                        f"{policy} again")
        elif args.iterations:
            command = train_command(args, policy, files[args.mode], os.path.join(out, "model"))
            print(f"iteration {k}: training with\n  {shlex.join(command)}", flush=True)
            start = time.time()
            result = subprocess.run(command)
            if result.returncode:
                raise UserError(f"training failed in iteration {k} (exit code {result.returncode}, its output is "
                                f"above); fix the cause and rerun the same command to resume there.")
            seconds["train"] = time.time() - start

        # ---- log throughput and where the time went
        samples, busy = len(scores) * n, sum(seconds[stage] for stage in ("generate", "score", "train"))
        for stage in ("generate", "score", "train"):
            metrics[f"time/{stage}_seconds"] = seconds[stage]
            metrics[f"time/{stage}_share"] = seconds[stage] / busy if busy else 0.0
        metrics["time/sampling_seconds"] = seconds["sampling"]  # the rest of generate_seconds starts Ray and vLLM
        if seconds["generate"] and seconds["score"]:
            metrics["perf/samples_per_sec"] = samples / (seconds["generate"] + seconds["score"])
            metrics["perf/generate_samples_per_sec"] = samples / seconds["sampling"]
            metrics["perf/score_samples_per_sec"] = samples / seconds["score"]
        logger.log(k + 1, metrics)
        state["finished_iterations"] = k + 1
        save_state(args, state)
        print(f"iteration {k}: mean reward {metrics['rewards/mean']:.4f}, best of {n} "
              f"{metrics['rewards/best_mean']:.4f}; {summary}; seconds: generate {seconds['generate']:.1f} "
              f"(sampling {seconds['sampling']:.1f}), score {seconds['score']:.1f}, train {seconds['train']:.1f}",
              flush=True)
    logger.close()


if __name__ == "__main__":
    run_main(main, parse_args(Args), saved=finished_note)
