"""PPO for RLHF (and REINFORCE++, GRPO, Dr. GRPO, RLOO) on Ray, vLLM and DeepSpeed ZeRO-3: the OpenRLHF design.

RLHF's last stage (Ouyang et al. 2022): sample responses to prompts from the policy, score them with reward models, a
rule or a multi-turn environment, and raise the score with PPO (Schulman et al. 2017) while a KL penalty keeps the
policy near the reference, the SFT model (Ziegler et al. 2019). As in OpenRLHF (Hu et al. 2024, arXiv 2405.11143),
vLLM engines generate and every model runs on DeepSpeed ranks of its own, Ray actors (common/placement.py).

The tricks, each named where it happens: the reward on the EOS token plus a per-token KL penalty (fixed or adaptive);
advantages by GAE (Schulman et al. 2016), REINFORCE++, GRPO (Shao et al. 2024), Dr. GRPO (Liu et al. 2025) or RLOO
(Ahmadian et al. 2024); old log-probs recomputed by the trainer (vllm/logprob_diff shows a wrong weight sync); ratio
clipping with DAPO's clip-higher and dual-clip, value clipping; DAPO's dynamic sampling and overlong shaping (Yu et
al. 2025); truncated importance sampling against vLLM (Yao et al. 2025), and decoupled PPO for --async_rollouts
(Hilton et al. 2021); an entropy bonus and InstructGPT's ptx loss. --policy_loss swaps the clipped surrogate for
GSPO, CISPO, GMPO or SAPO, --vllm_is_kind for IcePop or sequence-masked TIS, and --teacher_pretrain adds on-policy
distillation's per-token reward. --routing_replay (R3) and --keep_sampling_mask (DeepSeek-V3.2) make the trainer score
the experts and the top-p support vLLM sampled with. A vision-language policy trains on image prompts (docs/vlm.md).
docs/ppo.md lists every implementation detail.

    python ppo_ray.py --pretrain SFT --reward_pretrain RM --prompt_data prompts.jsonl --apply_chat_template
    deepspeed ppo_ray.py ...        # the same: the launcher's rank 0 drives, its others exit; Ray starts workers

Top to bottom: the flags; the PPO math; the experience; the update (ActorWorker.fit, CriticWorker.fit); train(), whose
loop names the phases of a step; main(). The rollouts (prompts, sampling, dynamic sampling, async generation, partial
rollouts and the weight sync they need) are common/rollout.py's Rollouts, which the loop calls.
"""

import functools
import json
import os
import time
from dataclasses import dataclass
from typing import Literal

import ray
import torch
import torch.distributed as dist

from common import lora, memory_plan, output_lock, rewards, routing_replay, vlm
from common import ppo_tricks as tricks
from common.args import Interrupted, UserError, parse_args, run_main
from common.checkpoint import (SaveFailed, check_driver_resume, checkpoint_dir, load_driver_checkpoint,
                               run_settings, save_driver_checkpoint, stopped, zero_layout)
from common.data import (DataError, build_sft_samples, decode_response, load_prompts, load_records, pad_collate,
                         stream_indices)
from common.deepspeed_utils import load_tokenizer, trained_zero_stage
from common.logging_utils import MetricsLogger, batch_means, mean_over_ranks, progress, timed
from common.model_worker import ModelWorker, micro_rollout, split
from common.partial_rollouts import logprob_diff_by_staleness
from common.modeling import router_loss, token_logprobs
from common.placement import connect, drives_the_run, place_roles, start_ray
from common.ppo_checks import check_args, check_tokenizers
from common.ppo_tricks import clip_range, uses_reference  # one predicate for this script and the memory plan
from common.ray_workers import WorkerDied, gather, shard, use_gpus
from common.rollout import Rollouts, agent_function, env_factory, generated_tokens, policy_lags, sync_weights
from common.vllm_engine import EngineDied, engine_dtype, engine_gap_line, shutdown_engines

# The script's folder: on sys.path already when it runs, and given to every Ray worker through its runtime_env.
ROOT = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Args:
    # --- the algorithm
    advantage_estimator: Literal["gae", "reinforce++", "reinforce++-baseline", "grpo", "dr_grpo", "rloo"] = "gae"
    """how advantages are computed; only gae uses a critic (docs/ppo.md compares them)"""
    gamma: float = 1.0
    """discount factor"""
    lambd: float = 0.95
    """GAE lambda"""
    eps_clip: float | None = None
    """the policy ratio's clip range [1 - eps_clip, 1 + eps_clip] (default 0.2; gspo 3e-4/4e-4, gmpo 0.4, cispo 4)"""
    eps_clip_low: float | None = None
    """the lower clip range alone, 1 - eps_clip_low (default: --eps_clip, or the --policy_loss's paper's)"""
    eps_clip_high: float | None = None
    """the upper clip range alone, 1 + eps_clip_high (default: as --eps_clip_low); DAPO's clip-higher: 0.28"""
    dual_clip: float | None = None
    """dual-clip PPO: a token with a negative advantage loses at most dual_clip x its advantage (> 1, e.g. 3)"""
    value_clip: float = 0.2
    """PPO value clip range"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = None
    """DAPO's token-mean (default), GRPO's seq-mean (default: gspo, gmpo, sapo), Dr. GRPO's sum-norm (dr_grpo)"""
    policy_loss: Literal["ppo", "gspo", "cispo", "gmpo", "sapo"] = "ppo"
    """the policy-gradient loss: PPO's clip, or GSPO, CISPO, GMPO or SAPO (docs/ppo.md has each formula)"""
    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature for tokens with a positive advantage"""
    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature for tokens with a negative advantage"""
    init_kl_coef: float = 0.01
    """KL penalty coefficient (beta)"""
    kl_target: float | None = None
    """turns on the adaptive KL controller, which steers objective/kl (a mean per response token) to this value"""
    kl_horizon: int = 10000
    """horizon of the adaptive KL controller"""
    kl_estimator: Literal["k1", "k2", "k3", "k3-unbiased"] = "k1"
    """per-token KL estimator of the reward penalty; grpo's KL loss uses k3, or DeepSeek-V3.2's k3 x pi / pi_old"""
    entropy_coef: float = 0.0
    """entropy bonus coefficient"""
    ptx_data: str | None = None
    """pretraining text mixed into the actor's loss (InstructGPT's PPO-ptx; --ptx_key selects the text)"""
    ptx_key: str = "text"
    """key of the text in --ptx_data"""
    ptx_coef: float = 0.05
    """weight of the pretraining loss"""
    temperature: float = 1.0
    """sampling temperature (the trainer's log-probs use the same)"""
    top_p: float = 1.0
    """nucleus sampling"""
    keep_sampling_mask: bool = False
    """with --top_p < 1, every log-prob (old, new, reference) over the top-p support vLLM sampled from, renormalised"""
    normalize_reward: bool = True
    """normalise reward-model scores with the mean/std rm.py stored"""
    reward_clip: float = 10.0
    """clip the summed reward to [-clip, clip]"""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong penalty: within this many tokens of --generate_max_len a response loses reward (0: off)"""
    overlong_penalty_factor: float = 1.0
    """the most a response loses to --overlong_buffer_len, all of it at the limit"""
    overlong_filter: bool = False
    """leave responses cut at --generate_max_len out of the loss (DAPO's overlong filtering)"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop prompts whose rewards are all equal and sample more until the batch is full"""
    dynamic_sampling_max_rounds: int = 3
    """--dynamic_sampling's sampling rounds per step at most; a batch still short is filled with dropped prompts"""
    async_rollouts: bool = False
    """generate the next step's responses while this step trains (one step of policy lag, decoupled PPO)"""
    partial_rollouts: bool = False
    """with --async_rollouts: a generation the step boundary cuts goes on under the new policy (partial rollouts)"""
    max_staleness: int | None = None
    """--partial_rollouts: no token sampled more than this many policy versions ago enters a loss (default 1)"""
    partial_chunk_tokens: int | None = None
    """--partial_rollouts: new tokens per engine call, the most a cut waits for (default: --generate_max_len / 4)"""
    vllm_is_correction: bool = False
    """correct each token's loss for the sampler/trainer mismatch pi_trainer / pi_vllm, as --vllm_is_kind says"""
    vllm_is_kind: Literal["tis", "icepop", "seq-mask-tis"] = "tis"
    """tis: weigh by the ratio capped at --vllm_is_cap; icepop: the ratio inside [--vllm_is_floor, cap], 0 outside;
    seq-mask-tis: tis, and drop responses whose geometric-mean ratio leaves [--vllm_rs_threshold_lower, threshold]"""
    vllm_is_cap: float | None = None
    """the upper bound of the ratio (default: 2, icepop 5 as in its paper)"""
    vllm_is_floor: float = 0.5
    """the lower bound of the ratio for icepop"""
    vllm_rs_threshold: float = 1.001
    """seq-mask-tis's upper bound on a response's geometric-mean ratio (verl's rollout_rs_threshold)"""
    vllm_rs_threshold_lower: float = 0.999
    """seq-mask-tis's lower bound on it (verl's rollout_rs_threshold_lower)"""
    off_policy_seq_mask: float | None = None
    """DeepSeek-V3.2: a negative-advantage response whose mean log(pi_vllm / pi) exceeds this leaves the loss"""
    teacher_pretrain: str | None = None
    """on-policy distillation: a frozen teacher sharing the tokenizer; each sampled token's advantage gains
    --teacher_coef x (log pi_teacher - log pi), a reverse-KL reward, alone or beside the reward sources"""
    teacher_coef: float = 1.0
    """the weight of --teacher_pretrain's per-token reward"""
    # --- models and reward sources
    pretrain: str = ""
    """the policy to start from (usually the SFT model); also the reference model"""
    freeze_vision_tower: bool = True
    """a vision-language policy's vision tower stays as loaded: not trained, not synced (docs/vlm.md)"""
    reward_pretrain: list[str] | None = None
    """one or more reward models saved by rm.py"""
    reward_weights: list[float] | None = None
    """one weight per reward source, in the order --reward_pretrain..., --reward_fn, --remote_rm_url (default: 1s)"""
    reward_fn: str | None = None
    """a rule-based reward, 'path.py:function', called as function(prompts, responses, labels) -> list of floats"""
    remote_rm_url: str | None = None
    """a reward model served over HTTP: POST {prompts, responses, labels} -> {rewards}"""
    env_fn: str | None = None
    """a multi-turn environment instead of the reward sources, 'path.py:make_env' (see common/multi_turn.py)"""
    agent_fn: str | None = None
    """an OpenAI-client agent instead of the reward sources, 'path.py:run_agent' (see common/agents.py)"""
    agent_timeout: float = 600.0
    """seconds an --agent_fn episode may take before it fails (the run goes on without it)"""
    reward_timeout: float = 600.0
    """seconds a --reward_fn call, or an --env_fn environment's reset or step, may take before the run stops"""
    max_turns: int = 4
    """the policy's turns per --env_fn episode at most"""
    critic_pretrain: str | None = None
    """the critic's starting point (default: the first reward model, else --pretrain with a new value head)"""
    # --- data
    prompt_data: str = ""
    """prompts: a .jsonl/.json/.parquet file, a folder of them, or a `datasets` name"""
    prompt_split: str = "train"
    """split to read when --prompt_data is a `datasets` name, a saved dataset or a folder of per-split files"""
    eval_prompt_data: str | None = None
    """held-out prompts, answered greedily and scored every --eval_steps"""
    eval_prompt_split: str = "test"
    """split to read when --eval_prompt_data is a `datasets` name, a saved dataset or a folder of per-split files"""
    input_key: str = "prompt"
    """key of the prompt (text, or a list of chat messages)"""
    label_key: str = "label"
    """key of the reference answer passed to --reward_fn and the remote RM (optional in the data)"""
    apply_chat_template: bool = False
    """render prompts with the tokenizer's chat template"""
    input_template: str | None = None
    """a template such as 'Question: {} Answer: ' the prompt is formatted into (without a chat template)"""
    prompt_max_len: int = 256
    """prompts longer than this many tokens are skipped (and counted)"""
    generate_max_len: int = 64
    """tokens generated per response at most"""
    output_dir: str = "out/ppo"
    """where the final actor, metrics and checkpoints go"""
    # --- training
    seed: int = 42
    """random seed"""
    rollout_batch_size: int = 32
    """prompts per PPO step"""
    n_samples_per_prompt: int = 1
    """responses sampled per prompt (grpo and rloo need at least 2)"""
    train_batch_size: int = 32
    """responses per optimizer step, across the actor's ranks"""
    micro_train_batch_size: int = 8
    """responses per forward and backward pass on one rank in training"""
    micro_rollout_batch_size: int | None = None
    """responses per forward pass on one rank when making experience (default: --micro_train_batch_size)"""
    max_epochs: int = 1
    """passes over each rollout's experience"""
    max_steps: int = 100
    """PPO steps (rollouts) to run; the prompts are cycled through"""
    actor_learning_rate: float = 1e-6
    """the actor's peak learning rate"""
    critic_learning_rate: float = 9e-6
    """the critic's peak learning rate"""
    min_lr_ratio: float = 0.1
    """the cosine schedules end at this fraction of the peak learning rate"""
    warmup_ratio: float = 0.03
    """fraction of the optimizer steps spent warming up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """clip the gradient norm to this value"""
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage of the trained models (default: 3, or for a role on one rank 1 in bf16 and 0 in fp32)"""
    offload_optimizer: bool = False
    """keep optimizer states in CPU memory"""
    ref_offload: bool = False
    """keep the reference and reward models' ZeRO-3 parameters in CPU memory"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    packing_samples: bool = False
    """run the actor's, reference's and critic's micro-batches as one row without padding"""
    share_prompts: bool = False
    """compute each prompt once for all its samples in the update and the policy's and reference's log-probs"""
    # --- LoRA (peft)
    lora_rank: int = 0
    """train LoRA adapters of this rank on the frozen actor and critic instead of every weight (0: every weight)"""
    lora_alpha: int = 16
    """LoRA's scale: the adapters' update is multiplied by lora_alpha / lora_rank"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input"""
    target_modules: str = "all-linear"
    """layers that get adapters: all-linear (every linear layer but the output head) or names, e.g. q_proj,v_proj"""
    load_in_4bit: bool = False
    """QLoRA: keep the frozen model in 4 bits (NF4 with bitsandbytes; CUDA only, with --lora_rank)"""
    # --- placement
    ray_address: str | None = None
    """Ray cluster to join (default: RAY_ADDRESS, else a local cluster started here)"""
    actor_num_workers: int = 1
    """DeepSpeed ranks of the actor (one GPU each)"""
    critic_num_workers: int = 1
    """DeepSpeed ranks of the critic (with --colocate_all: the actor's count)"""
    ref_num_workers: int = 1
    """DeepSpeed ranks of the reference model (colocated with the actor: the actor's count)"""
    reward_num_workers: int = 1
    """DeepSpeed ranks of each reward model (colocated with the critic: the critic's count)"""
    vllm_num_engines: int = 1
    """vLLM engines generating rollouts"""
    vllm_tensor_parallel_size: int = 1
    """GPUs per vLLM engine (1 on CPU)"""
    colocate_actor_ref: bool = False
    """put the reference workers on the actor's GPUs"""
    colocate_critic_reward: bool = False
    """put the reward workers on the critic's GPUs"""
    colocate_all: bool = False
    """put every model and the vLLM engines on the same GPUs; vLLM sleeps while the models train"""
    cpus_per_worker: int = 1
    """CPUs for each worker and engine on a machine without GPUs"""
    vllm_gpu_memory_utilization: float = 0.85
    """share of each GPU vLLM may take for weights and KV cache (lower it when models share the GPUs)"""
    routing_replay: bool = False
    """mixture of experts: the trainer's MoE layers use the experts vLLM routed each token to (R3; docs/ppo.md)"""
    vllm_dtype: Literal["trainer", "bfloat16", "float16", "float32"] = "trainer"
    """precision the engines generate in: the trainers' (bfloat16 on GPUs that have it, else float32), or another"""
    gpu_memory_gib: float = 80.0
    """memory of each GPU, for the memory plan checked before a start on GPUs (A100/H100 80 GB: 80)"""
    dry_run: bool = False
    """print this layout's memory plan per GPU from the models' config.json, refuse it if it cannot fit, and exit"""
    # --- logging and checkpoints
    eval_steps: int = 0
    """evaluate on --eval_prompt_data every this many steps (0: only at the end)"""
    save_steps: int = 0
    """save a resumable checkpoint every this many steps (0: never)"""
    ckpt_dir: str | None = None
    """where resumable checkpoints go (default: <output_dir>/checkpoints); a run resumes from the latest one"""
    keep_last_checkpoints: int = 2
    """how many checkpoints to keep"""
    use_wandb: bool = False
    """also log to Weights & Biases (offline without WANDB_API_KEY)"""
    wandb_project: str = "rlhf-ppo"
    """wandb project name"""


# What a resumed run must share with its checkpoint: what fixes the prompt order, the batches and the ZeRO
# partitioning, and what makes it this run (its models, prompts and schedule). The critic adds its own.
RESUME_FLAGS = ["seed", "rollout_batch_size", "n_samples_per_prompt", "train_batch_size", "actor_num_workers"]
RUN_FLAGS = ["pretrain", "reward_pretrain", "prompt_data", "actor_learning_rate", "warmup_ratio", "min_lr_ratio"]


def resume_settings(args: Args) -> dict:
    roles = ["actor", "critic"] if args.advantage_estimator == "gae" else ["actor"]
    critic = "critic" in roles
    names = RESUME_FLAGS + (["critic_num_workers"] if critic else [])
    run = RUN_FLAGS + (["critic_pretrain", "critic_learning_rate"] if critic else [])
    stages = {f"the {role}'s --zero_stage": zero_layout(trained_zero_stage(
        args.zero_stage, getattr(args, f"{role}_num_workers"), args.offload_optimizer, args.load_in_4bit))
        for role in roles}
    return {**{f"--{name}": getattr(args, name) for name in names}, **stages, **lora.settings(args),
            **run_settings(__file__, args, *run)}


# ------------------------------------------------------------------------------------------------- ALGO LOGIC
KL_IN_LOSS = tricks.KL_IN_LOSS  # estimators whose KL to the reference is a loss term, not a reward penalty


def update_is_on_policy(args: Args) -> bool:
    """One optimizer step per rollout on the weights that sampled it, and no KL penalty in the reward: the old
    log-probs are the update's own, detached (the ratio is exactly 1), and the experience skips the actor's forward
    pass, as TRL does at num_iterations 1."""
    one_step = args.max_epochs == 1 and args.rollout_batch_size * args.n_samples_per_prompt == args.train_batch_size
    kl_in_reward = uses_reference(args) and args.advantage_estimator not in KL_IN_LOSS
    return one_step and not policy_lags(args) and not kl_in_reward


POLICY_LOSSES = ("ppo", "gspo", "cispo", "gmpo", "sapo")


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip=None, weights=None,
                agg="token-mean", max_len=1, count=None, kind="ppo", sapo_tau=(1.0, 1.05)):
    """The policy-gradient loss of `kind`, per token J_t aggregated by `agg`; all tensors (batch, seq), r_t =
    pi(a_t) / pi_old(a_t). Returns (loss, clip fraction, approximate KL between the old and new policy).

      ppo:   min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t) (Schulman et al. 2017, eq. 7); a larger clip_high
             is DAPO's clip-higher (Yu et al. 2025); dual_clip = c > 1 bounds J_t below by c A_t where A_t < 0
             (Ye et al. 2020)
      gspo:  PPO's clip on the response's ratio s = exp(mean_t log r_t) with each token's advantage, GSPO-token:
             sg(s) r_t / sg(r_t); with one advantage a response, the sequence objective (Zheng et al. 2025, eqs. 5-10)
      cispo: sg(min(r_t, 1 + clip_high)) A_t log pi(a_t): the weight is clipped, never the token's gradient
             (MiniMax-M1, 2025, eq. 4)
      gmpo:  the geometric mean of the tokens' clipped objectives, A exp(mean_t sgn(A) min(sgn(A) log r_t,
             sgn(A) clip(log r_t, -clip_low, clip_high))), clipped in log space (Zhao et al. 2025, eq. 5)
      sapo:  a soft gate for the hard clip: (4 / tau) sigmoid(tau (r_t - 1)) A_t, tau = sapo_tau[0] where A_t > 0
             else sapo_tau[1] (Gao et al. 2025, eq. 6); its gradient at r_t = 1 is PPO's
    `weights` multiply each token's J_t (rollout corrections); `agg`, `count`: tricks.aggregate.
    """
    valid = mask.bool()
    # padding may hold anything (another micro-batch's layout): an exp that overflows there makes the gradient NaN
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0).clamp(-tricks.MAX_LOG_RATIO, tricks.MAX_LOG_RATIO)
    approx_kl = tricks.masked_mean(0.5 * log_ratio.pow(2), mask)
    if kind == "gmpo":  # one advantage per response (ppo_checks refuses per-token ones)
        advantages = tricks.masked_mean(advantages, mask, dim=-1).unsqueeze(-1)  # (batch, 1)
    if kind == "gspo":
        seq_log_ratio = tricks.masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)  # (batch, 1)
        token_log_ratio = torch.where(valid, logprobs - logprobs.detach(), 0.0) + seq_log_ratio.detach()
        ratio = token_log_ratio.clamp(max=10.0).exp()  # the value is s; the gradient flows through each token
        surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)
        clipped = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    elif kind == "gmpo":
        sign = advantages.sign()
        bounded = sign * torch.min(sign * log_ratio, sign * log_ratio.clamp(-clip_low, clip_high))
        surrogate = advantages * tricks.masked_mean(bounded, mask, dim=-1).unsqueeze(-1).exp()
        clipped = (log_ratio < -clip_low) | (log_ratio > clip_high)
    else:
        ratio = log_ratio.exp()
        clipped = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
        if kind == "cispo":
            surrogate = ratio.clamp(max=1 + clip_high).detach() * advantages * logprobs
            clipped = ratio > 1 + clip_high
        elif kind == "sapo":
            tau = torch.where(advantages > 0, sapo_tau[0], sapo_tau[1])
            surrogate = 4 / tau * torch.sigmoid(tau * (ratio - 1)) * advantages
        else:
            surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)
            if dual_clip is not None:
                surrogate = torch.where(advantages < 0, torch.max(surrogate, dual_clip * advantages), surrogate)
    if weights is not None:
        surrogate = surrogate * weights
    return (-tricks.aggregate(surrogate, mask, agg, max_len, count), tricks.masked_mean(clipped.float(), mask),
            approx_kl)


def loss_agg(args: Args) -> str:
    """--loss_agg, or its default for this --policy_loss and --advantage_estimator (tricks.default_loss_agg)."""
    return args.loss_agg or tricks.default_loss_agg(args)


def train_batch_count(micro_batches: list[dict], agg: str) -> torch.Tensor:
    """What `agg` divides by over one optimizer step's micro-batches on every rank: each micro-batch's loss is then
    its share of the train batch's aggregate, whatever its number of tokens."""
    count = sum(tricks.aggregate_count(mb["action_mask"], agg) for mb in micro_batches)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count)
    return count


def rollout_correction(kind, old_logprobs, vllm_logprobs, mask, low, high, seq_band):
    """Weights for each token's policy loss where vLLM sampled from pi_vllm and the loss assumes pi_old; all
    (batch, seq), 0 outside the mask. Returns (weights, share of the tokens the correction capped or masked).

      tis:          min(pi_old / pi_vllm, high) (truncated IS, Yao et al. 2025)
      icepop:       pi_old / pi_vllm where it is in [low, high], else 0: such tokens leave the loss (IcePop, Ling
                    team 2025, "Every Step Evolves")
      seq-mask-tis: tis, and a response whose ratio exp(mean_t log(pi_old / pi_vllm)) leaves `seq_band` is left
                    out whole (verl's geometric rejection sampling, a band of its own)
    """
    valid = mask.bool()
    log_ratio = torch.where(valid, old_logprobs - vllm_logprobs, 0.0).clamp(-tricks.MAX_LOG_RATIO, tricks.MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    if kind == "icepop":
        keep = (ratio >= low) & (ratio <= high) & valid
        return torch.where(keep, ratio, 0.0), tricks.masked_mean((~keep).float(), mask)
    weights = torch.where(valid, ratio.clamp(max=high), 0.0)
    if kind == "tis":
        return weights, tricks.masked_mean((ratio > high).float(), mask)
    seq_ratio = tricks.masked_mean(log_ratio, mask, dim=-1).exp().unsqueeze(-1)  # (batch, 1)
    keep = ((seq_ratio >= seq_band[0]) & (seq_ratio <= seq_band[1])).expand_as(mask) & valid
    return torch.where(keep, weights, 0.0), tricks.masked_mean((~keep).float(), mask)


def vllm_correction(args: Args, old_logprobs, vllm_logprobs, mask) -> tuple[torch.Tensor, dict]:
    """--vllm_is_kind's weights, and its metric: vllm/is_capped (tis) or vllm/is_masked, the share of tokens."""
    weights, share = rollout_correction(args.vllm_is_kind, old_logprobs, vllm_logprobs, mask,
                                        *tricks.vllm_is_band(args))
    return weights, {"vllm/is_capped" if args.vllm_is_kind == "tis" else "vllm/is_masked": share}


def value_loss(values, old_values, returns, mask, value_clip, count=None):
    """PPO's clipped value loss, the worse of the unclipped and clipped squared errors; all (batch, seq)."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return tricks.aggregate(loss, mask, "token-mean", count=count)


def compute_advantages(args, scores, kl, values, mask, kl_coef):
    """Advantages and returns for the chosen estimator; scores (batch,), everything else (batch, seq).

    `kl` is the per-token KL estimate of the reward penalty. As in OpenRLHF only gae and reinforce++ whiten their
    advantages: grpo's, dr_grpo's and rloo's are centred within each prompt's group already, and whitening rloo's
    token returns would bring back a length-dependent baseline (Ahmadian et al. 2024).
    """
    estimator, n = args.advantage_estimator, args.n_samples_per_prompt
    keep = mask.bool().any(-1)  # a group's baseline is over the responses --overlong_filter left in
    if estimator in KL_IN_LOSS:  # KL goes into the loss instead (ActorWorker.fit)
        group = tricks.group_advantages(scores, n, "grpo" if estimator == "grpo" else "mean", keep=keep)
        advantages = group[:, None] * mask
        return advantages, advantages
    if estimator in ("rloo", "reinforce++-baseline"):  # a baseline from the other samples of the same prompt
        scores = tricks.group_advantages(scores, n, "rloo" if estimator == "rloo" else "mean", keep=keep)
    token_rewards = tricks.compute_token_rewards(scores, kl, mask, kl_coef)
    if estimator == "gae":
        advantages, returns = tricks.compute_gae(token_rewards, values, mask, args.gamma, args.lambd)
    else:
        returns = tricks.compute_returns(token_rewards, mask, args.gamma)
        advantages = returns
    if estimator == "rloo":
        return advantages, returns
    return tricks.masked_whiten(advantages, mask), returns
# --------------------------------------------------------------------------------------------- END ALGO LOGIC


# ------------------------------------------------------------------------------------------------- experience
def build_batch(prompt_ids: list[list[int]], samples: list[list[dict]], pad_id: int) -> dict:
    """Right-padded tensors for prompt + response sequences. action_mask (batch, seq - 1) is 1 where the next token
    is the policy's, the layout of every per-token tensor (an --env_fn episode's own tokens are 0)."""
    rows, prompt_lens, vllm_logprobs, policy_masks = [], [], [], []
    for ids, outs in zip(prompt_ids, samples):
        for out in outs:
            start = out.get("prompt_ids", ids)
            rows.append(start + out["token_ids"])
            prompt_lens.append(len(start))
            vllm_logprobs.append(out["logprobs"] or [])
            policy_masks.append(out.get("env_mask", [1] * len(out["token_ids"])))
    length = max(map(len, rows))
    batch_size = len(rows)
    input_ids = torch.full((batch_size, length), pad_id)  # (batch, seq)
    attention_mask = torch.zeros(batch_size, length, dtype=torch.long)
    action_mask = torch.zeros(batch_size, length - 1)
    vllm_lp = torch.zeros(batch_size, length - 1)
    for i, (row, p) in enumerate(zip(rows, prompt_lens)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        action_mask[i, p - 1: len(row) - 1] = torch.tensor(policy_masks[i], dtype=action_mask.dtype)
        vllm_lp[i, p - 1: p - 1 + len(vllm_logprobs[i])] = torch.tensor(vllm_logprobs[i])
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    routes = routing_replay.batch_routes(samples, length)  # (batch, seq, MoE layers, k), the experts vLLM chose
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "action_mask": action_mask, "vllm_logprobs": vllm_lp, **({"routes": routes} if routes is not None else {})}


@functools.cache
def reward_tokenizer(path: str):
    """A reward model's tokenizer (a vision-language one's processor): it renders the pairs the reward model reads, as
    rm.py trained it."""
    return vlm.load_processor(path, "--reward_pretrain") if vlm.is_vision_language(path) else load_tokenizer(
        path, "--reward_pretrain")


def score(args: Args, cluster, prompts: list[dict], samples: list[list[dict]], tokenizer, reward_fn,
          overlong: bool = True) -> tuple[torch.Tensor, dict]:
    """Each response's reward (batch,), prompt-major as build_batch lays them out, and each source's mean: the
    weighted reward sources (or with --env_fn each episode's summed reward) clipped to --reward_clip, plus
    --overlong_buffer_len's penalty where `overlong`."""
    episodes = [s for group in samples for s in group]
    if args.env_fn or args.agent_fn:
        scores = torch.tensor([e["reward"] for e in episodes], dtype=torch.float)
        metrics = {"rewards/env": scores.mean(), "env/turns": sum(e["turns"] for e in episodes) / len(episodes),
                   "env/failed_episodes": sum(e.get("failed", False) for e in episodes)}
    elif not (args.reward_pretrain or args.reward_fn or args.remote_rm_url):  # --teacher_pretrain's reward alone
        scores, metrics = torch.zeros(len(episodes)), {}
    else:
        texts = [p["prompt"] for p, group in zip(prompts, samples) for _ in group]
        labels = [p["label"] for p, group in zip(prompts, samples) for _ in group]
        responses = [decode_response(tokenizer, p["ids"], s["token_ids"]) for p, group in zip(prompts, samples)
                     for s in group]
        images = [p.get("images", []) for p, group in zip(prompts, samples) for _ in group]  # read as prompts loaded
        pending = [group.call_sharded("scores", shard(rewards.reward_model_batch(
            reward_tokenizer(path), texts, responses, args.apply_chat_template, args.input_template, images, path),
            len(group), micro_rollout(args))) for group, path in zip(cluster.rewards, args.reward_pretrain or [])]
        model_scores = [gather(group, refs, len(responses)) for group, refs in zip(cluster.rewards, pending)]
        weights = rewards.reward_weights(args.reward_weights, args.reward_pretrain, args.reward_fn, args.remote_rm_url)
        scores, sources = rewards.score_responses(model_scores, reward_fn, args.remote_rm_url, weights, texts,
                                                  responses, labels)
        metrics = {f"rewards/{name}": torch.as_tensor(s, dtype=torch.float).mean() for name, s in sources.items()}
    metrics["objective/reward_clipped"] = (scores.abs() > args.reward_clip).float().mean()  # a clipped group may tie
    scores = scores.clamp(-args.reward_clip, args.reward_clip)
    if overlong and args.overlong_buffer_len:  # by the tokens --generate_max_len bounds (an episode's, the env's too)
        lengths = torch.tensor([len(s["token_ids"]) for s in episodes])
        penalty = tricks.overlong_penalty(lengths, args.generate_max_len, args.overlong_buffer_len,
                                          args.overlong_penalty_factor)
        scores, metrics["rewards/overlong_penalty"] = scores + penalty, penalty.mean()
    return scores, metrics


def make_experience(args: Args, cluster, prompts: list[dict], samples: list[list[dict]], tokenizer, reward_fn,
                    kl_coef: float, scored: tuple[torch.Tensor, dict] | None = None) -> tuple[dict, dict]:
    """What the update needs about this step's responses (`samples[i]` answer `prompts[i]`), and metrics about them.

    The experience holds build_batch's sequences and masks and, (batch, seq - 1) each: the actor's log-probs before
    the update (`old_logprobs`), the reference's, the critic's values, and the advantages and returns. The roles
    compute at the same time, each on its own workers. `scored`: the scores a --dynamic_sampling rollout made.
    """
    batch = build_batch([p["ids"] for p in prompts], samples, tokenizer.pad_token_id)
    batch.update(vlm.experience_images(args.pretrain, prompts, samples))  # (rows, ...) each: the prompts' images
    rows = len(batch["input_ids"])
    actor, ref, critic = cluster.actor, cluster.ref, cluster.critic
    if args.lora_rank and uses_reference(args):  # the reference is the actor's frozen model, adapters off
        ref = actor
    micro = micro_rollout(args)  # shard() pads a batch that does not split evenly; gather() drops the padding
    on_policy = update_is_on_policy(args)  # then the update computes the old log-probs (and their metrics) itself
    actor_logprobs = None if on_policy else actor.call_sharded("logprobs", shard(batch, len(actor), micro))
    ref_method = "reference_logprobs" if ref is actor else "logprobs"
    ref_logprobs = ref.call_sharded(ref_method, shard(batch, len(ref), micro)) if ref else None
    critic_values = critic.call_sharded("values", shard(batch, len(critic), micro)) if critic else None
    teacher = cluster.teacher
    teacher_logprobs = teacher.call_sharded("logprobs", shard(batch, len(teacher), micro)) if teacher else None
    scores, metrics = scored or score(args, cluster, prompts, samples, tokenizer, reward_fn)
    metrics = dict(metrics)

    lengths = batch["action_mask"].sum(-1)
    if args.overlong_filter:  # out of every loss and statistic: as if they had not been sampled
        truncated = torch.tensor([s["finish_reason"] == "length" for group in samples for s in group])
        batch["action_mask"] = batch["action_mask"] * ~truncated[:, None]
    mask = batch["action_mask"]
    experience = dict(batch)
    if ref:
        experience["ref_logprobs"] = gather(ref, ref_logprobs, rows)
    values = gather(critic, critic_values, rows) if critic else torch.zeros(mask.shape)
    token_kl = torch.zeros(mask.shape)  # (batch, seq - 1); the reward's KL penalty, where there is one
    if not on_policy:
        old_logprobs = experience["old_logprobs"] = gather(actor, actor_logprobs, rows)
        token_kl = tricks.kl_penalty(old_logprobs, experience.get("ref_logprobs", old_logprobs), args.kl_estimator)
        metrics.update(old_logprob_metrics(args, old_logprobs, experience, mask))
        metrics.update(mean_over_ranks(actor.get(actor.call("take_route_mismatch"))))
        if args.partial_rollouts:  # the gap of each policy version's tokens apart
            metrics.update(logprob_diff_by_staleness([p["ids"] for p in prompts], samples, batch["vllm_logprobs"],
                                                     old_logprobs, mask))
        if args.vllm_is_correction or policy_lags(args):
            experience["is_weights"], correction = vllm_correction(args, old_logprobs, batch["vllm_logprobs"], mask)
            metrics.update(correction)
    advantages, returns = compute_advantages(args, scores, token_kl, values, mask, kl_coef)
    if teacher:  # on-policy distillation: each sampled token's reverse-KL reward is its own advantage, undiscounted
        distill = torch.where(mask.bool(), gather(teacher, teacher_logprobs, rows) - batch["vllm_logprobs"], 0.0)
        advantages = advantages + args.teacher_coef * distill
        metrics["distill/reverse_kl"] = -tricks.masked_mean(distill, mask)
    experience.update(values=values, advantages=advantages, returns=returns)
    metrics.update({
        "objective/scores": scores.mean(), "objective/advantages": tricks.masked_mean(advantages, mask),
        "objective/returns": tricks.response_mean(returns.gather(1, mask.float().argmax(-1, keepdim=True))[:, 0],
                                                  mask),
        "response/length": lengths.float().mean(),
        "response/truncated": sum(s["finish_reason"] == "length" for group in samples for s in group) / rows})
    return experience, metrics


def old_logprob_metrics(args: Args, old_logprobs: torch.Tensor, batch: dict, mask: torch.Tensor) -> dict:
    """The KL to the reference (its per-sequence mean, averaged) and vLLM's log-prob error, from the log-probs of
    the policy that sampled the batch."""
    ref_logprobs = batch.get("ref_logprobs", old_logprobs)
    kl = tricks.kl_penalty(old_logprobs, ref_logprobs, args.kl_estimator)
    kl = tricks.response_mean(tricks.masked_mean(kl, mask, dim=-1), mask)  # filtered responses would dilute it
    return {"objective/kl": kl,
            "vllm/logprob_diff": tricks.masked_mean((batch["vllm_logprobs"] - old_logprobs).abs(), mask)}


# ------------------------------------------------------------------------------------------------- the update
class ActorWorker(ModelWorker):
    """A rank of the actor: common/model_worker.py's log-probs, weight sync and save, and the PPO policy update."""

    def setup(self, args: Args, path: str, total_steps: int):
        super().setup(args, path, total_steps, args.actor_learning_rate)

    def set_ptx_data(self, samples: list[dict]):
        self.ptx = samples

    def _ptx_rows(self, draw: int) -> list[dict]:
        """The pretraining rows of this rank's `draw`-th micro-batch: every rank reads one stream over the ptx set,
        shuffled anew each pass by --seed, taking turns (a resumed run goes on where the killed one was)."""
        size = self.args.micro_train_batch_size
        start = (draw * self.world_size + self.rank) * size
        return [self.ptx[i] for i in stream_indices(len(self.ptx), min(size, len(self.ptx)), self.args.seed, start)]

    def fit(self, experience: dict, kl_coef: float, step: int) -> dict:
        """The PPO policy update on this rank's share of the experience, for --max_epochs passes, at PPO `step`."""
        args, losses, aux_losses, means, on_policy = self.args, [], [], [], []  # means, on_policy: (metrics, mask)
        micro_batches_per_step = args.max_epochs * -(-len(experience["input_ids"]) // args.micro_train_batch_size)
        self.use_cpu_threads("train")
        self.engine.train()
        lr = self.engine.get_lr()[0]  # the rate of this fit's first update; the scheduler moves on after each
        agg, accumulation = loss_agg(args), self.engine.gradient_accumulation_steps()
        # DeepSpeed averages the losses over an optimizer step's micro-batches and ranks; each loss is its
        # micro-batch's share of the train batch's aggregate, times what that average divides by.
        scale = accumulation * self.world_size
        for epoch in range(args.max_epochs):
            micro_batches = split(experience, args.micro_train_batch_size, args.seed + epoch,
                                  accumulation * args.micro_train_batch_size, args.share_prompts)
            for index, mb in enumerate(micro_batches):
                if index % accumulation == 0:  # an optimizer step's first micro-batch: the count of its train batch
                    count = train_batch_count(micro_batches[index:index + accumulation], agg)
                logprobs, entropy = self._logprobs(mb, with_entropy=True)
                mask = mb["action_mask"]
                if "old_logprobs" not in mb:  # update_is_on_policy: these weights sampled the batch
                    mb["old_logprobs"] = logprobs.detach()
                    on_policy.append((old_logprob_metrics(args, mb["old_logprobs"], mb, mask), mask))
                    if args.vllm_is_correction:
                        mb["is_weights"], correction = vllm_correction(args, mb["old_logprobs"], mb["vllm_logprobs"],
                                                                       mask)
                        on_policy[-1][0].update(correction)
                weights = tricks.off_policy_sequence_mask(logprobs, mb["vllm_logprobs"], mb["advantages"], mask,
                                                          args.off_policy_seq_mask, mb.get("is_weights"))
                loss, clipfrac, approx_kl = policy_loss(
                    logprobs, mb["old_logprobs"], mb["advantages"], mask, *clip_range(args), args.dual_clip, weights,
                    agg, args.generate_max_len, count, args.policy_loss, (args.sapo_tau_pos, args.sapo_tau_neg))
                if args.advantage_estimator in KL_IN_LOSS and "ref_logprobs" in mb:  # GRPO's KL, in the loss
                    kl = tricks.kl_penalty(logprobs, mb["ref_logprobs"], tricks.kl_loss_estimator(args), mask,
                                           mb["old_logprobs"])
                    loss = loss + kl_coef * tricks.aggregate(kl, mask, agg, args.generate_max_len, count)
                means.append(({"policy/clipfrac_avg": clipfrac, "policy/approxkl_avg": approx_kl,
                               "objective/entropy": tricks.masked_mean(entropy, mask)}, mask))
                if args.entropy_coef:
                    loss = loss - args.entropy_coef * tricks.aggregate(entropy, mask, agg, args.generate_max_len, count)
                loss = loss * scale
                if self.ptx:  # InstructGPT's PPO-ptx: keep the pretraining distribution's likelihood up
                    picked = self._ptx_rows(step * micro_batches_per_step + len(losses))
                    ptx = pad_collate(picked, self.tokenizer.pad_token_id)
                    ptx = {k: v.to(mask.device) for k, v in ptx.items()}
                    ptx_logits = self.engine(input_ids=ptx["input_ids"], attention_mask=ptx["attention_mask"]).logits
                    ptx_logprobs = token_logprobs(ptx_logits[:, :-1], ptx["input_ids"][:, 1:])
                    loss = loss - args.ptx_coef * tricks.masked_mean(ptx_logprobs, ptx["loss_mask"][:, 1:])
                aux = router_loss(self.engine)  # mixture of experts: load balancing, where the config asks for it
                self.engine.backward(loss + aux)
                self.engine.step()
                losses.append(loss.item())
                aux_losses.append(float(aux))
        (update, update_weights), (sampled, sampled_weights) = batch_means(means), batch_means(on_policy)
        mismatch = self.take_route_mismatch()  # of the sampling weights where this fit scored them first
        sampled.update(mismatch if on_policy else {})  # else the experience's pass measured it
        aux_loss = {"policy/aux_loss": sum(aux_losses) / len(aux_losses)} if any(aux_losses) else {}
        return {"loss/policy_avg": sum(losses) / len(losses), "policy/lr": lr, **update, **sampled, **aux_loss,
                "weights": {**update_weights, **sampled_weights}}


class CriticWorker(ModelWorker):
    """A rank of the critic: common/model_worker.py's values, and the clipped value update."""

    def setup(self, args: Args, path: str, total_steps: int):
        super().setup(args, path, total_steps, args.critic_learning_rate, "--critic_pretrain")

    def fit(self, experience: dict, kl_coef: float = 0.0) -> dict:
        args, stats = self.args, []
        self.use_cpu_threads("train")
        self.engine.train()
        lr = self.engine.get_lr()[0]  # the rate of this fit's first update
        accumulation = self.engine.gradient_accumulation_steps()
        scale = accumulation * self.world_size  # as in the actor's fit: each micro-batch's share of its train batch
        for epoch in range(args.max_epochs):
            micro_batches = split(experience, args.micro_train_batch_size, args.seed + epoch,
                                  accumulation * args.micro_train_batch_size, args.share_prompts)
            for index, mb in enumerate(micro_batches):
                if index % accumulation == 0:
                    count = train_batch_count(micro_batches[index:index + accumulation], "token-mean")
                values = self._values(mb)
                loss = value_loss(values, mb["values"], mb["returns"], mb["action_mask"], args.value_clip,
                                  count) * scale
                self.engine.backward(loss)
                self.engine.step()
                stats.append(loss.item())
        return {"loss/value_avg": sum(stats) / len(stats), "critic/lr": lr}


def ppo_update(cluster, experience: dict, kl_coef: float, step: int, micro: int) -> dict:
    """The actor's and the critic's fit, each on its own workers, at the same time; their metrics over the ranks."""
    actor, critic = cluster.actor, cluster.critic
    actor_fit = actor.call_sharded("fit", shard(experience, len(actor), micro), kl_coef, step)
    critic_fit = critic.call_sharded("fit", shard(experience, len(critic), micro)) if critic else []
    metrics = mean_over_ranks(actor.get(actor_fit))  # each rank's means over its share of the experience
    if critic_fit:
        metrics.update(mean_over_ranks(critic.get(critic_fit)))
    return metrics


# ------------------------------------------------------------------------------------------------- the loop
def evaluate(args: Args, cluster, rollouts: Rollouts, tokenizer, reward_fn, eval_prompts: list[dict]) -> dict:
    """Greedy responses to the held-out prompts, scored like the rollouts; the latest are kept in eval_samples.jsonl."""
    samples = rollouts.respond(eval_prompts, 1, 0.0)
    # an episode's text shows the turns' markers, which tell the policy's turns from the environment's
    texts = [decode_response(tokenizer, s[0].get("prompt_ids", p["ids"]), s[0]["token_ids"],
                             skip_special_tokens=not args.env_fn) for p, s in zip(eval_prompts, samples)]
    total, parts = score(args, cluster, eval_prompts, samples, tokenizer, reward_fn, overlong=False)
    with open(os.path.join(args.output_dir, "eval_samples.jsonl"), "w") as f:
        for p, text, reward in zip(eval_prompts, texts, total.tolist()):
            f.write(json.dumps({"prompt": p["prompt"], "response": text, "reward": reward}) + "\n")
    return {"eval/reward": total.mean(), **{"eval/" + k.split("/", 1)[1]: v for k, v in parts.items()}}


def train(args: Args, cluster, tokenizer, reward_fn, prompts: list[dict], eval_prompts: list[dict]) -> dict:
    """The PPO loop, from the latest checkpoint to --max_steps; returns the final evaluation's metrics."""
    ckpt_dir = checkpoint_dir(args)
    kl_ctl = (tricks.AdaptiveKLController(args.init_kl_coef, args.kl_target, args.kl_horizon) if args.kl_target
              else tricks.FixedKLController(args.init_kl_coef))
    state = load_driver_checkpoint(ckpt_dir, cluster.trained())
    start_step = step = state["step"] if state else 0
    if state:
        kl_ctl.load_state_dict(state["kl_ctl"])
        sync_weights(cluster)
        print(f"resumed from {ckpt_dir} at step {start_step}")
    if args.load_in_4bit:  # QLoRA computes with the 4-bit rounding of weights the engines loaded in full precision
        sync_weights(cluster, everything_quantized=True)  # (a resumed sync sent only what the adapters change)
    logger = MetricsLogger(args.output_dir, 0, vars(args), args.use_wandb, args.wandb_project,
                           resume_step=start_step)
    bar = progress(args.max_steps, 0, "ppo", initial=start_step)
    rollouts = Rollouts(args, cluster, prompts, tokenizer,
                        functools.partial(score, args, cluster, tokenizer=tokenizer, reward_fn=reward_fn), start_step)
    try:
        for step in range(start_step, args.max_steps):
            timings, step_start = {}, time.perf_counter()
            # 1. rollout: vLLM's responses to this step's prompts (--async_rollouts: sampled during the last update,
            #    after which the idle engines take this step's policy and sample the next step's meanwhile)
            picked, samples, scored = rollouts.next(step, timings)
            # 2. experience: log-probs, values and rewards -> advantages
            with timed(timings, "time/make_experience"):
                experience, metrics = make_experience(args, cluster, picked, samples, tokenizer, reward_fn,
                                                      kl_ctl.value, scored)
            # 3. update: the actor's and the critic's fit
            with timed(timings, "time/train"):
                metrics.update(ppo_update(cluster, experience, kl_ctl.value, step, args.micro_train_batch_size))
            # 4. weight sync: the new policy to vLLM (--async_rollouts: at the next step's start)
            metrics.update(rollouts.sync(step, timings))
            # 5. the KL controller, evaluation, logging and checkpoint
            kl_ctl.update(metrics["objective/kl"].item(), len(experience["input_ids"]))
            metrics.update({"objective/kl_coef": kl_ctl.value, **timings})
            if not args.async_rollouts:  # (asynchronous generation is timed by no one: it overlaps the update)
                generated = metrics.get("dynamic_sampling/generated_tokens", generated_tokens(samples))
                metrics["perf/rollout_tokens_per_sec"] = generated / timings["time/generate"]
            if eval_prompts and args.eval_steps and (step + 1) % args.eval_steps == 0:
                metrics.update(rollouts.sync_to(step + 1))  # --async_rollouts: then step + 2 has nothing to sync
                metrics.update(evaluate(args, cluster, rollouts, tokenizer, reward_fn, eval_prompts))
            metrics["time/step"] = time.perf_counter() - step_start  # all of it: the phases and the driver's share
            logger.log(step + 1, metrics)
            if not state and step == 0 and "vllm/logprob_diff" in metrics:  # the engines hold the loaded weights
                print(engine_gap_line(float(metrics["vllm/logprob_diff"]), engine_dtype(args)), flush=True)
            bar.update(1)
            bar.set_postfix(score=f"{float(metrics['objective/scores']):.3f}",
                            kl=f"{float(metrics['objective/kl']):.4f}")
            if args.save_steps and (step + 1) % args.save_steps == 0:
                save_driver_checkpoint(ckpt_dir, cluster.trained(), step + 1,
                                       {"kl_ctl": kl_ctl.state_dict(), "settings": resume_settings(args)},
                                       args.keep_last_checkpoints)
        bar.close()
        rollouts.sync_to(args.max_steps)
        final = evaluate(args, cluster, rollouts, tokenizer, reward_fn, eval_prompts) if eval_prompts else {}
    except (EngineDied, WorkerDied) as e:
        raise stopped(str(e), step, ckpt_dir) from None
    except SaveFailed:  # its sentence names the checkpoint that survives already
        raise
    except UserError as e:  # a reward function, remote RM or environment that fails mid-run: say what survives too
        raise stopped(f"{e} The run stopped", step, ckpt_dir) from None
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (run_main turns it into one)
        raise stopped("interrupted", step, ckpt_dir, Interrupted) from None
    if final:
        logger.log(args.max_steps, final)
    logger.close()
    return final


def main(args: Args):
    for name in ("pretrain", "critic_pretrain"):  # workers may not share our cwd (a hub name stays as it is)
        if getattr(args, name) and os.path.exists(getattr(args, name)):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    for name in ("output_dir", "ckpt_dir"):  # made by the run: relative, each node would write beside its own cwd
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    args.reward_pretrain = [os.path.abspath(p) if os.path.exists(p) else p for p in args.reward_pretrain or []]
    check_args(args)
    check_driver_resume(checkpoint_dir(args), resume_settings(args), args.max_steps)
    if args.dry_run:
        memory_plan.dry_run(args)
        return
    reward_fn = rewards.load_reward_fn(args.reward_fn, args.reward_timeout, args.label_key) if args.reward_fn \
        else None
    if args.env_fn:
        env_factory(args.env_fn)  # a wrong path or name stops the run here, before Ray starts
    if args.agent_fn:
        agent_function(args.agent_fn)
    tokenizer = load_tokenizer(args.pretrain)
    check_tokenizers(args, tokenizer)
    prompts = load_prompts(args, tokenizer, args.prompt_data, args.prompt_split)
    if len(prompts) < args.rollout_batch_size:  # a step would ask some prompts twice
        raise DataError(f"{args.prompt_data} has {len(prompts)} usable prompts, fewer than one rollout batch; lower "
                        f"--rollout_batch_size to {len(prompts)} or less, or give more prompts.")
    eval_prompts = (load_prompts(args, tokenizer, args.eval_prompt_data, args.eval_prompt_split)
                    if args.eval_prompt_data else [])
    ptx_samples = build_sft_samples(load_records(args.ptx_data), tokenizer, args.ptx_data, args.ptx_key, "",
                                    args.prompt_max_len + args.generate_max_len,
                                    pretrain_mode=True) if args.ptx_data else None

    output_lock.hold_output_folders(args.output_dir, checkpoint_dir(args))
    start_ray(args, ROOT)
    if use_gpus():
        memory_plan.preflight(args)
    rollout_size = args.rollout_batch_size * args.n_samples_per_prompt
    total_actor_steps = args.max_steps * args.max_epochs * rollout_size // args.train_batch_size
    cluster = place_roles(args, total_actor_steps, ActorWorker, CriticWorker)
    connect(args, cluster, actor_in_experience=not update_is_on_policy(args) or bool(
        args.lora_rank and uses_reference(args)))
    if ptx_samples:
        ray.get(cluster.actor.call("set_ptx_data", ptx_samples))
    final = train(args, cluster, tokenizer, reward_fn, prompts, eval_prompts)
    cluster.actor.get(cluster.actor.call("save_model", args.output_dir))
    print(f"saved the actor to {args.output_dir} after {args.max_steps} PPO steps"
          + "".join(f", {k} {float(v):.4f}" for k, v in final.items()))
    shutdown_engines(cluster.engines)
    ray.shutdown()


if __name__ == "__main__":
    if drives_the_run():
        run_main(main, parse_args(Args))
