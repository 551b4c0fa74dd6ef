"""Distributed PPO (and REINFORCE++, GRPO, Dr. GRPO, RLOO) with Ray, vLLM and DeepSpeed ZeRO-3: the OpenRLHF design.

RLHF's last stage (Ouyang et al. 2022): sample responses to prompts from the policy, score them with reward models
and/or a rule, and raise the score with PPO (Schulman et al. 2017) while a KL penalty keeps the policy near the
reference (the SFT model). Following OpenRLHF (Hu et al. 2024, arXiv 2405.11143), every model runs on Ray workers
of its own and vLLM generates:

    driver (this file's main())
      |- vLLM engines (Ray actors)           generate rollouts, take new weights after every step
      |- actor    workers (DeepSpeed ranks)  old log-probs, the clipped policy update, weight sync to vLLM
      |- critic   workers                    values, the clipped value update            (gae only)
      |- reference workers                   log-probs of the frozen SFT model           (KL penalty)
      |- reward   workers, one group per RM  scores; plus a rule function and/or a remote RM, summed with weights

    python ppo_ray.py --pretrain SFT --reward_pretrain RM --prompt_data prompts.jsonl --apply_chat_template
    deepspeed ppo_ray.py ...        # the same: the launcher's rank 0 drives, its others exit; Ray starts workers

The file reads top to bottom: the flags; the PPO math (losses, advantages); make_experience, which turns vLLM's
samples into what the update needs; the workers, one class per role (ActorWorker.fit is the PPO update); then the
driver: placement, and train(), whose loop names the four phases of a step (generate, make experience, train,
sync weights).

Implementation details, where they happen below:
  - the reward-model score is placed on the final (EOS) token; the per-token KL penalty -beta * KL(pi || pi_ref)
    is added to every token (Ziegler et al. 2019), with a fixed or adaptive beta;
  - advantages: `gae` (Schulman et al. 2016, with a critic initialised from the reward model), `reinforce++`
    (discounted KL-penalised returns, whitened over the batch; `reinforce++-baseline` first subtracts each prompt
    group's mean score), `grpo` (scores normalised within each prompt's group, KL as a k3 loss term; Shao et al.
    2024), `dr_grpo` (grpo without the std and length normalisations; Liu et al. 2025), `rloo` (leave-one-out
    baseline; Ahmadian et al. 2024);
  - old log-probs are recomputed by the trainer, not taken from vLLM; the mean absolute difference between the two
    is logged as `vllm/logprob_diff` and shows at once when the weight sync is wrong;
  - --async_rollouts: vLLM samples the next step during this step's update (in train()), from the policy one update
    old; decoupled PPO (Hilton et al. 2021) clips the ratio against the trainer's log-probs as usual and weighs
    each token by the truncated ratio of those to vLLM's, the policy that sampled;
  - policy ratio clipping (with DAPO's clip-higher and dual-clip as options) and value clipping (PPO), a choice of
    how token losses are averaged (--loss_agg), truncated importance sampling against vLLM's log-probs
    (--vllm_is_correction), optional entropy bonus and pretraining (ptx) loss;
  - multi-turn episodes (--env_fn, common/multi_turn.py): the policy and a user's environment take turns, as token
    ids from end to end, and only the policy's tokens are trained on;
  - DAPO's batch shaping: dynamic sampling (--dynamic_sampling, in rollout()) keeps only prompts whose rewards
    differ, and an overlong penalty or filter (--overlong_buffer_len, --overlong_filter);
  - reward normalisation with the mean/std rm.py stores, then clipping; a critic initialised from a reward model
    gives values on the same normalised scale; advantage whitening for gae and reinforce++ only (as OpenRLHF);
  - checkpoints hold every trained role, the data position and the KL controller; each role is saved first and
    the driver's state file, written last, commits the step, so a run killed at any moment resumes cleanly;
  - --lora_rank (common/lora.py): the actor and critic train adapters on frozen weights; no reference workers start
    (the actor with its adapters off is the reference), and each sync sends only the adapted layers, merged;
  - --packing_samples: the actor, reference and critic run each micro-batch as one row without padding, position_ids
    restarting at each sequence so that each attends only to itself; the log-probs and values are put back in the
    padded action_mask layout (common/modeling.py pack_rows, unpack), equal to the padded ones.
"""

import functools
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Literal

import ray
import torch
import torch.distributed as dist
from transformers import AutoModelForSequenceClassification

from common import lora, memory_plan, multi_turn, rewards
from common import ppo_tricks as tricks
from common.args import (Interrupted, UserError, check_causal_lm, check_decoder_only, check_lengths, check_model_path,
                         check_output_dir, check_packing, parse_args, run_main, stop_on_sigterm)
from common.checkpoint import (check_keep_last, check_settings, describe, load_train_state, prune, save_hf_model,
                               run_settings, save_train_state, write_atomically, zero_layout)
from common.data import (DataError, build_sft_samples, decode_response, generation_stop_ids, get_key, get_labels,
                         load_records, pad_collate, render_prompt, reward_model_input_ids, sample_context,
                         stream_indices)
from common.deepspeed_utils import (device, ds_config, init_distributed, init_eval_engine, init_train_engine,
                                    load_model, load_tokenizer, mpi_launch, trained_zero_stage)
from common.logging_utils import MetricsLogger, progress, timed
from common.ray_workers import (RayWorker, WorkerDied, WorkerGroup, check_bundle_shares, check_resources, gather,
                                make_placement_group, shard, share_cores, use_gpus, wait)
from common.modeling import (entropy_from_logits, next_token_logits, pack_rows, packed_token_values, response_start,
                             router_loss, scalar_head_parts, sequence_rewards, token_logprobs, token_values, unpack,
                             unpack_next_token)
from common.ppo_tricks import uses_reference  # the memory plan asks the same
from common.vllm_engine import (COLOCATED_GPU_SHARE, EngineDied, SleepSchedule, collect, create_vllm_engines, generate,
                                shutdown_engines, start_generate, wait_for, wait_for_engines)
from common.weight_sync import (SYNC_TIMEOUT, broadcast_weights_to_vllm, in_checkpoint_layout, init_weight_sync_group,
                                 iter_gathered_params)

# The script's folder: on sys.path already when it runs, and given to every Ray worker through its runtime_env.
ROOT = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Args:
    # --- models and reward sources
    pretrain: str = ""
    """the policy to start from (usually the SFT model); also the reference model"""
    reward_pretrain: list[str] | None = None
    """one or more reward models saved by rm.py"""
    reward_weights: list[float] | None = None
    """one weight per reward source, in the order --reward_pretrain..., --reward_fn, --remote_rm_url (default: 1s)"""
    reward_fn: str | None = None
    """a rule-based reward, 'path.py:function', called as function(prompts, responses, labels) -> list of floats"""
    remote_rm_url: str | None = None
    """a reward model served over HTTP: POST {prompts, responses, labels} -> {rewards}"""
    env_fn: str | None = None
    """a multi-turn environment instead of the reward sources, 'path.py:make_env' (common/multi_turn.py says what
    make_env returns): the policy and it take turns, and its rewards score the episode"""
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
    vllm_dtype: Literal["trainer", "bfloat16", "float16", "float32"] = "trainer"
    """precision the engines generate in: the trainers' (bfloat16 on GPUs of compute capability 8.0 and up, float32
    elsewhere), or another. bfloat16 on a CPU with AVX-512 BF16 or AMX samples about 1.5x faster than float32; the
    samples then come from a rounded policy, which vllm/logprob_diff measures and --vllm_is_correction corrects"""
    gpu_memory_gib: float = 80.0
    """memory of each GPU, for the memory plan checked before a start on GPUs (A100/H100 80 GB: 80)"""
    dry_run: bool = False
    """print this layout's memory plan per GPU from the models' config.json, refuse it if it cannot fit, and exit"""
    # --- training
    seed: int = 42
    """random seed"""
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage of the trained models (default: 3, or 0 for a role on one rank, which ZeRO has nothing to
    partition across)"""
    offload_optimizer: bool = False
    """keep optimizer states in CPU memory"""
    ref_offload: bool = False
    """keep the reference and reward models' ZeRO-3 parameters in CPU memory"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    packing_samples: bool = False
    """pack each micro-batch into one row without padding in the actor's, reference's and critic's forward passes
    (the reward models' scores stay padded)"""
    rollout_batch_size: int = 32
    """prompts per PPO step"""
    n_samples_per_prompt: int = 1
    """responses sampled per prompt (grpo and rloo need at least 2)"""
    train_batch_size: int = 32
    """responses per optimizer step, across the actor's ranks"""
    micro_train_batch_size: int = 8
    """responses per forward and backward pass on one rank in training"""
    micro_rollout_batch_size: int | None = None
    """responses per forward pass on one rank when making experience: log-probs, values, scores, which need no
    gradients and fit more (default: --micro_train_batch_size)"""
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
    advantage_estimator: Literal["gae", "reinforce++", "reinforce++-baseline", "grpo", "dr_grpo", "rloo"] = "gae"
    """how advantages are computed; only gae uses a critic (docs/ppo.md compares them)"""
    gamma: float = 1.0
    """discount factor"""
    lambd: float = 0.95
    """GAE lambda"""
    eps_clip: float = 0.2
    """PPO policy ratio clip range: the ratio is kept in [1 - eps_clip, 1 + eps_clip]"""
    eps_clip_low: float | None = None
    """the lower clip range alone, 1 - eps_clip_low (default: --eps_clip)"""
    eps_clip_high: float | None = None
    """the upper clip range alone, 1 + eps_clip_high (default: --eps_clip); DAPO's clip-higher raises it to 0.28"""
    dual_clip: float | None = None
    """dual-clip PPO: a token with a negative advantage loses at most dual_clip x its advantage (> 1, e.g. 3)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = None
    """how the per-token policy loss is averaged: over all tokens (DAPO), per sequence then over sequences (GRPO),
    or summed per sequence over --generate_max_len then averaged (Dr. GRPO) (default: the last for dr_grpo, else
    token-mean)"""
    vllm_is_correction: bool = False
    """weigh each token's policy loss by the truncated importance ratio min(pi_trainer / pi_vllm, --vllm_is_cap)
    of the trainer's log-prob to vLLM's: the sampler and trainer differ (kernels, precision)"""
    vllm_is_cap: float = 2.0
    """the cap of --vllm_is_correction's ratio"""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong penalty: a response within this many tokens of --generate_max_len loses up to
    --overlong_penalty_factor of its reward, linearly; one cut at the limit loses all of it (0: off)"""
    overlong_penalty_factor: float = 1.0
    """the most a response loses to --overlong_buffer_len"""
    overlong_filter: bool = False
    """leave responses cut at --generate_max_len out of the loss (DAPO's overlong filtering): their truncated
    ending says nothing about how good the answer was"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop the prompts whose --n_samples_per_prompt rewards are all equal (under a group
    baseline their advantages are all zero: no learning signal) and sample further prompts until
    --rollout_batch_size prompts with a spread remain"""
    dynamic_sampling_max_rounds: int = 3
    """--dynamic_sampling's sampling rounds per step at most; a batch still short after them is filled with dropped
    prompts (logged as dynamic_sampling/filled)"""
    async_rollouts: bool = False
    """generate the next step's responses while this step trains: one step of policy lag, corrected as decoupled PPO
    does (the ratio is clipped against the actor's log-probs, and each token weighed by --vllm_is_correction's
    truncated ratio to the policy that sampled it, one update old)"""
    value_clip: float = 0.2
    """PPO value clip range"""
    init_kl_coef: float = 0.01
    """KL penalty coefficient (beta)"""
    kl_target: float | None = None
    """turns on the adaptive KL controller, which steers objective/kl towards this value. objective/kl is a mean per
    response token: a per-response target such as Ziegler et al.'s 6 nats is that divided by the response length"""
    kl_horizon: int = 10000
    """horizon of the adaptive KL controller"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimator of the reward penalty (grpo's KL loss always uses k3)"""
    entropy_coef: float = 0.0
    """entropy bonus coefficient"""
    ptx_data: str | None = None
    """pretraining text mixed into the actor's loss (--ptx_key selects the text)"""
    ptx_key: str = "text"
    """key of the text in --ptx_data"""
    ptx_coef: float = 0.05
    """weight of the pretraining loss"""
    temperature: float = 1.0
    """sampling temperature (the trainer's log-probs use the same)"""
    top_p: float = 1.0
    """nucleus sampling"""
    normalize_reward: bool = True
    """normalise reward-model scores with the mean/std rm.py stored"""
    reward_clip: float = 10.0
    """clip the summed reward to [-clip, clip]"""
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


# ------------------------------------------------------------------------------------------------- ALGO LOGIC
KL_IN_LOSS = ("grpo", "dr_grpo")  # estimators whose KL to the reference is a loss term, not a reward penalty
GROUPED = ("grpo", "dr_grpo", "rloo", "reinforce++-baseline")  # estimators that compare samples of one prompt


def update_is_on_policy(args: Args) -> bool:
    """Whether the actor's log-probs before the update are the update's own, detached: one optimizer step per rollout
    on the weights that sampled it (one epoch, the whole rollout in one train batch, no --async_rollouts lag), and no
    KL penalty in the reward, the one use of them before the update. The experience phase then skips the actor's
    forward pass, as TRL does at num_iterations 1; the ratio in the loss is exactly 1, as it would have been."""
    one_step = args.max_epochs == 1 and args.rollout_batch_size * args.n_samples_per_prompt == args.train_batch_size
    kl_in_reward = uses_reference(args) and args.advantage_estimator not in KL_IN_LOSS
    return one_step and not args.async_rollouts and not kl_in_reward


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip=None, weights=None,
                agg="token-mean", max_len=1, count=None):
    """PPO's clipped surrogate objective (Schulman et al. 2017, eq. 7), as a loss; all tensors (batch, seq).

        J_t = min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t),   r_t = pi(a_t) / pi_old(a_t)

    Separate clip ranges give DAPO's clip-higher (Yu et al. 2025): a larger 1 + clip_high lets unlikely tokens with
    a positive advantage grow, against entropy collapse. `dual_clip` = c > 1 bounds J_t below by c A_t where A_t < 0
    (Ye et al. 2020): a ratio far above 1 on a bad token no longer makes the loss unbounded. `weights` multiply each
    token's J_t (the truncated importance ratio of --vllm_is_correction). `agg`, `count`: tricks.aggregate.
    Returns (loss, clip fraction, approximate KL between the old and new policy).
    """
    # padding may hold anything (another micro-batch's layout): an exp that overflows there makes the gradient NaN
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, 0.0)
    ratio = log_ratio.exp()
    surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)
    if dual_clip is not None:
        surrogate = torch.where(advantages < 0, torch.max(surrogate, dual_clip * advantages), surrogate)
    if weights is not None:
        surrogate = surrogate * weights
    clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float()
    approx_kl = 0.5 * log_ratio.pow(2)
    return (-tricks.aggregate(surrogate, mask, agg, max_len, count), tricks.masked_mean(clipped, mask),
            tricks.masked_mean(approx_kl, mask))


def clip_range(args: Args) -> tuple[float, float]:
    """(low, high): the policy ratio is clipped to [1 - low, 1 + high]."""
    low, high = args.eps_clip_low, args.eps_clip_high
    return (args.eps_clip if low is None else low), (args.eps_clip if high is None else high)


def loss_agg(args: Args) -> str:
    """--loss_agg, or its default: Dr. GRPO's unnormalised sequence sums for dr_grpo, else the mean over tokens."""
    return args.loss_agg or ("seq-mean-token-sum-norm" if args.advantage_estimator == "dr_grpo" else "token-mean")


def train_batch_count(micro_batches: list[dict], agg: str) -> torch.Tensor:
    """What --loss_agg `agg` divides by over a train batch (tricks.aggregate_count): over these micro-batches of one
    optimizer step, and those of the other ranks. Each micro-batch's loss divided by it is its share of the batch's
    aggregate: a per-micro-batch mean would weigh a token of a micro-batch with few tokens more (with one response
    a micro-batch, token-mean would be GRPO's mean over responses), and count a micro-batch whose responses
    --overlong_filter all took out as a loss of 0."""
    count = sum(tricks.aggregate_count(mb["action_mask"], agg) for mb in micro_batches)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count)
    return count


def truncated_is_weights(old_logprobs, vllm_logprobs, mask, cap):
    """Truncated importance sampling (Yao et al. 2025): vLLM sampled from pi_vllm, the loss assumes pi_old (the
    trainer's log-probs; of the same weights, or with --async_rollouts of the weights one update newer); weigh each
    token by min(pi_old / pi_vllm, cap). Returns the weights (batch, seq), 0 outside the mask, and the fraction of
    tokens where the cap binds."""
    ratio = torch.where(mask.bool(), old_logprobs - vllm_logprobs, 0.0).exp()
    return torch.where(mask.bool(), ratio.clamp(max=cap), 0.0), tricks.masked_mean((ratio > cap).float(), mask)


def value_loss(values, old_values, returns, mask, value_clip, count=None):
    """PPO's clipped value loss: the worse of the unclipped and the clipped squared error; all (batch, seq). Its mean
    over the tokens, or with `count` a micro-batch's share of its train batch's mean (tricks.aggregate)."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return tricks.aggregate(loss, mask, "token-mean", count=count)


def compute_advantages(args, scores, kl, values, mask, kl_coef):
    """Advantages and returns for the chosen estimator; scores (batch,), everything else (batch, seq).

    `kl` is the per-token KL estimate of the reward penalty. As in OpenRLHF, only gae and reinforce++ (with or
    without its group-mean baseline) whiten their advantages over the batch: grpo's, dr_grpo's and rloo's are
    already centred within each prompt's group, and whitening
    rloo's token returns (mean removed over all tokens) would bring back a baseline that depends on the response's
    length, which undoes the leave-one-out estimator's unbiasedness (Ahmadian et al. 2024).
    """
    estimator, n = args.advantage_estimator, args.n_samples_per_prompt
    keep = mask.bool().any(-1)  # a group's baseline is over the responses --overlong_filter left in
    if estimator in KL_IN_LOSS:  # KL goes into the loss instead (see ActorWorker.fit)
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
    """Right-padded tensors for prompt + response sequences; the masks say which tokens were generated.

    action_mask (batch, seq - 1) is 1 where the next token is a response token, the layout every per-token tensor
    (log-probs, values, rewards, advantages) shares; in a multi-turn episode (--env_fn) the environment's tokens are
    not, and the episode may start from a prompt of its own. (The reward models read reward_model_batch's rows.)
    """
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
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "action_mask": action_mask, "vllm_logprobs": vllm_lp}


def reward_model_batch(args: Args, tokenizer, prompts: list, responses: list[str]) -> dict:
    """What the reward models score: each prompt + response rendered and tokenized as rm.py renders its pairs
    (data.reward_model_input_ids: ended by EOS, with --apply_chat_template or --input_template), right-padded.

    Not the policy's own tokens: where an --input_template ends in a space ("Answer: "), the prompt's tokens end
    with that space alone while rm.py's pairs merge it into the response's first word, and a chat template that
    writes a newline after its end-of-turn token has it before rm.py's EOS, not in what vLLM stopped at. The
    reward would be read from token sequences the reward model never saw; rejection_sampling.py scores the same way.
    """
    rows = [{"input_ids": reward_model_input_ids(tokenizer, prompt, response, sys.maxsize, args.apply_chat_template,
                                                 args.input_template)} for prompt, response in zip(prompts, responses)]
    return pad_collate(rows, tokenizer.pad_token_id, keys=("input_ids",))


@functools.lru_cache(maxsize=None)
def reward_tokenizer(path: str):
    """A reward model's tokenizer, loaded once on the driver: the pairs the model scores are rendered with it."""
    return load_tokenizer(path, "--reward_pretrain")


def score(args: Args, roles: dict, reward_fn, prompts: list, responses: list[str],
          labels: list) -> tuple[torch.Tensor, dict]:
    """The reward of every response (batch,): the weighted sum (rewards.combine_rewards) of each reward model's
    score, the rule function's and the remote RM's, clipped to --reward_clip; and each source's mean. Each reward
    model reads the pairs rendered with its own tokenizer's chat template, as rm.py trained it."""
    micro, reward_models = micro_rollout(args), roles["rewards"]
    pending = [group.call_sharded("scores", shard(reward_model_batch(args, reward_tokenizer(path), prompts, responses),
                                                  len(group), micro))  # all at once
               for group, path in zip(reward_models, args.reward_pretrain or [])]
    sources, metrics = [], {}
    for i, parts in enumerate(pending):
        sources.append(gather(reward_models[i], parts, len(responses)))
        metrics[f"rewards/rm{i}"] = sources[-1].mean()
    if reward_fn:
        sources.append(torch.tensor(rewards.call_reward_fn(reward_fn, prompts, responses, labels), dtype=torch.float))
        metrics["rewards/rule"] = sources[-1].mean()
    if args.remote_rm_url:
        sources.append(torch.tensor(rewards.remote_reward(args.remote_rm_url, prompts, responses, labels)))
        metrics["rewards/remote"] = sources[-1].mean()
    weights = rewards.reward_weights(args.reward_weights, args.reward_pretrain, args.reward_fn, args.remote_rm_url)
    return rewards.combine_rewards(sources, weights).clamp(-args.reward_clip, args.reward_clip), metrics


def episode_scores(args: Args, samples: list[list[dict]]) -> tuple[torch.Tensor, dict]:
    """--env_fn: each episode's summed reward, clipped to --reward_clip, and the mean reward and number of turns."""
    episodes = [s for group in samples for s in group]
    scores = torch.tensor([e["reward"] for e in episodes], dtype=torch.float)
    return scores.clamp(-args.reward_clip, args.reward_clip), {
        "rewards/env": scores.mean(), "env/turns": sum(e["turns"] for e in episodes) / len(episodes)}


def score_rollouts(args: Args, roles: dict, prompts: list[dict], samples: list[list[dict]], tokenizer,
                   reward_fn) -> tuple[torch.Tensor, dict]:
    """The reward of each response (prompt-major, as build_batch lays them out), --overlong_buffer_len's penalty
    included, and each reward source's mean."""
    n = args.n_samples_per_prompt
    if args.env_fn:  # the episodes' summed rewards
        scores, metrics = episode_scores(args, samples)
    else:
        responses = [decode_response(tokenizer, p["ids"], s["token_ids"]) for p, group in zip(prompts, samples)
                     for s in group]
        scores, metrics = score(args, roles, reward_fn, [p["prompt"] for p in prompts for _ in range(n)], responses,
                                [p["label"] for p in prompts for _ in range(n)])
    if args.overlong_buffer_len:  # by the tokens --generate_max_len bounds: a multi-turn episode's, the env's too
        lengths = torch.tensor([len(s["token_ids"]) for group in samples for s in group])
        penalty = tricks.overlong_penalty(lengths, args.generate_max_len, args.overlong_buffer_len,
                                          args.overlong_penalty_factor)
        scores, metrics["rewards/overlong_penalty"] = scores + penalty, penalty.mean()
    return scores, metrics


def make_experience(args: Args, roles: dict, prompts: list[dict], samples: list[list[dict]], tokenizer, reward_fn,
                    kl_coef: float, scored: tuple[torch.Tensor, dict] | None = None) -> tuple[dict, dict]:
    """What the PPO update needs to know about this step's responses, and metrics about them.

    `samples[i]` are vLLM's responses to `prompts[i]`. The experience holds build_batch's sequences and masks, and,
    all (batch, seq - 1) in the action_mask layout: the actor's log-probs as it was when sampling (`old_logprobs`),
    the reference model's, the critic's values, and from them and the rewards the advantages and returns. The
    actor, reference, critic and reward-model forwards run at the same time, each role on its own workers.
    `scored`: the responses' score_rollouts, when the rollout already scored them (--dynamic_sampling); the reward
    models then ran before the other roles instead of with them.
    """
    batch = build_batch([p["ids"] for p in prompts], samples, tokenizer.pad_token_id)
    rows = len(batch["input_ids"])
    actor, ref, critic = roles["actor"], roles.get("ref"), roles.get("critic")
    if args.lora_rank and uses_reference(args):  # the reference is the actor's frozen model, adapters off
        ref = actor
    micro = micro_rollout(args)  # shard() pads a batch that does not split evenly; gather() drops the padding
    on_policy = update_is_on_policy(args)  # then the update computes the old log-probs (and their metrics) itself
    actor_logprobs = None if on_policy else actor.call_sharded("logprobs", shard(batch, len(actor), micro))
    ref_method = "reference_logprobs" if ref is actor else "logprobs"
    ref_logprobs = ref.call_sharded(ref_method, shard(batch, len(ref), micro)) if ref else None
    critic_values = critic.call_sharded("values", shard(batch, len(critic), micro)) if critic else None
    scores, metrics = scored or score_rollouts(args, roles, prompts, samples, tokenizer, reward_fn)
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
        if args.vllm_is_correction or args.async_rollouts:
            experience["is_weights"], metrics["vllm/is_capped"] = truncated_is_weights(
                old_logprobs, batch["vllm_logprobs"], mask, args.vllm_is_cap)
    advantages, returns = compute_advantages(args, scores, token_kl, values, mask, kl_coef)
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
    the policy that sampled the batch: made with the experience, or by an on-policy update (update_is_on_policy)."""
    ref_logprobs = batch.get("ref_logprobs", old_logprobs)
    kl = tricks.kl_penalty(old_logprobs, ref_logprobs, args.kl_estimator)
    kl = tricks.response_mean(tricks.masked_mean(kl, mask, dim=-1), mask)  # filtered responses would dilute it
    return {"objective/kl": kl,
            "vllm/logprob_diff": tricks.masked_mean((batch["vllm_logprobs"] - old_logprobs).abs(), mask)}


def batch_means(per_micro_batch: list[tuple[dict, torch.Tensor]]) -> tuple[dict, dict]:
    """Means over the whole batch of metrics each micro-batch gave as means of its own, with its action mask: a mean
    over responses (objective/kl) weighed by the micro-batch's responses, a mean over tokens by its tokens. A plain
    mean of the means would weigh a token of a micro-batch of short responses more, and split cuts them shortest
    first. Returns the means and, for mean_over_ranks, the weight of each: its tokens or responses."""
    means, weights = {}, {}
    for key in per_micro_batch[0][0] if per_micro_batch else []:
        counts = torch.tensor([float((mask.sum(-1) > 0).sum() if key == "objective/kl" else mask.sum())
                               for _, mask in per_micro_batch])
        values = torch.stack([metrics[key].detach().float().cpu() for metrics, _ in per_micro_batch])
        means[key], weights[key] = (values * counts).sum() / counts.sum().clamp(min=1), counts.sum().item()
    return means, weights


def mean_over_ranks(ranks: list[dict]) -> dict:
    """The workers' metrics averaged over their ranks; where a rank gives a metric's weight (its "weights" entry:
    the tokens or responses it averaged over), weighed by it, so that each token counts alike on any rank."""
    weights = [rank.pop("weights", {}) for rank in ranks]
    out = {}
    for key in ranks[0]:
        values = torch.stack([torch.as_tensor(rank[key], dtype=torch.float) for rank in ranks])
        counts = torch.tensor([float(w.get(key, 1.0)) for w in weights])
        out[key] = (values * counts).sum() / counts.sum() if counts.sum() > 0 else values.mean()
    return out


# ------------------------------------------------------------------------------------------------- workers
def split(batch: dict, size: int, shuffle_seed: int | None = None, sort_rows: int | None = None) -> list[dict]:
    """Micro-batches of `size` rows on this worker's device, trimmed of right padding no row in them needs.

    shuffle_seed shuffles the rows first (each PPO epoch anew). sort_rows sorts each run of that many rows (an
    optimizer step's) by length before cutting it, so that short rows share micro-batches and pad less. Each
    micro-batch's loss is its share of the whole train batch's aggregate (train_batch_count), so which rows of a step
    share a micro-batch changes the padding and nothing else.
    """
    order = list(range(len(batch["input_ids"])))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    if sort_rows:
        lengths = batch["attention_mask"].sum(1).tolist()
        order = [i for start in range(0, len(order), sort_rows)
                 for i in sorted(order[start: start + sort_rows], key=lengths.__getitem__)]
    return [micro_batch(batch, order[i: i + size]) for i in range(0, len(order), size)]


def micro_batch(batch: dict, rows: list[int]) -> dict:
    """These rows of the batch on this worker's device, cut to the longest of them (the batch is right-padded)."""
    idx = torch.tensor(rows)
    length = int(batch["attention_mask"][idx].sum(1).max())
    mb = {}
    for key, value in batch.items():
        value = value[idx]
        if value.dim() == 2:
            value = value[:, : length if value.shape[1] == batch["input_ids"].shape[1] else length - 1]
        mb[key] = value.to(device())
    return mb


def in_length_order(batch: dict, size: int, forward, width: int | None = None) -> torch.Tensor:
    """forward(micro-batch) over micro-batches of `size` rows taken shortest first, so that rows of alike length
    pad together; the results back in the batch's row order, on CPU. A (rows, seq) result is zero-padded to `width`
    columns first."""
    order = torch.argsort(batch["attention_mask"].sum(1), stable=True)
    outputs = [forward(micro_batch(batch, order[i: i + size].tolist())) for i in range(0, len(order), size)]
    if width is not None:
        outputs = [pad_right(o, width) for o in outputs]
    return torch.cat(outputs).cpu()[torch.argsort(order)]


def pad_right(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad (batch, seq) to (batch, width): micro-batches are trimmed, the batch they came from is not."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def micro_rollout(args: Args) -> int:
    """Rows per forward pass of the experience phase (--micro_rollout_batch_size, else --micro_train_batch_size)."""
    return args.micro_rollout_batch_size or args.micro_train_batch_size


def train_or_eval_config(args: Args, world_size: int, trainable: bool) -> dict:
    """The DeepSpeed config of a trained role, or of a frozen one (always ZeRO-3, optionally offloaded)."""
    if trainable:
        stage = trained_zero_stage(args.zero_stage, world_size, args.offload_optimizer, args.load_in_4bit)
        return ds_config(stage, args.train_batch_size, args.micro_train_batch_size, world_size,
                         args.grad_clip, args.offload_optimizer)
    return ds_config(3, micro_rollout(args) * world_size, micro_rollout(args), world_size,
                     offload_params=args.ref_offload, train=False)


class ModelWorker(RayWorker):
    """One DeepSpeed rank of a model; the roles below say which model and what it computes."""

    def load(self, args: Args, path: str, total_steps: int | None, learning_rate: float = 0.0, **model_kwargs):
        """Load `path` as this rank's share of a ZeRO model: trained when `total_steps` is given, else frozen."""
        trainable = total_steps is not None
        self.args = args
        self.rank, self.world_size, self.local_rank = init_distributed()
        torch.manual_seed(args.seed)
        config = train_or_eval_config(args, self.world_size, trainable)
        model = load_model(path, config, gradient_checkpointing=args.gradient_checkpointing and trainable,
                           **model_kwargs, **(lora.load_kwargs(args) if trainable else {}))
        if trainable:  # with --lora_rank: adapters on the frozen model (a critic's scalar head trains whole)
            model = lora.wrap(model, args, "SEQ_CLS" if "num_labels" in model_kwargs else "CAUSAL_LM")
        self.tokenizer = load_tokenizer(path)
        if trainable:
            self.engine = init_train_engine(model, config, learning_rate, args.weight_decay, total_steps,
                                            args.warmup_ratio, args.min_lr_ratio, args.offload_optimizer)
        else:
            self.engine = init_eval_engine(model, config)

    def save_state(self, ckpt_dir: str, step: int) -> None:
        save_train_state({"model": self.engine}, ckpt_dir, step, {"step": step}, self.rank,
                         keep_last=None)  # pruned by save_checkpoint once the driver has committed the step

    def load_state(self, ckpt_dir: str, step: int) -> None:
        load_train_state({"model": self.engine}, ckpt_dir, self.rank, step)


class ReferenceWorker(ModelWorker):
    """A rank of the frozen reference model (the SFT policy): the log-probs the KL penalty compares against."""

    def setup(self, args: Args, path: str):
        self.load(args, path, None)

    def _logprobs(self, batch, with_entropy=False):
        """Log-probs of each next token at --temperature, (batch, seq - 1), and with_entropy the entropy of each
        next-token distribution too; 0 before the first response token of the micro-batch, whose prompt columns
        need no logits. --packing_samples runs the micro-batch as one row without padding and puts both back in the
        padded layout."""
        start = 0
        if self.args.packing_samples:  # (1, total) each; no attention_mask: the restarting position_ids cut it
            input_ids, position_ids, index = pack_rows(batch["input_ids"], batch["attention_mask"])
            attention_mask = None
        else:
            input_ids, attention_mask, position_ids = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
            start = response_start(batch["action_mask"])
        logits = next_token_logits(self.engine, input_ids, attention_mask, position_ids, start)
        logits = logits.float() / self.args.temperature  # the policy vLLM sampled from
        outputs = [token_logprobs(logits, input_ids[:, start + 1:])]  # (rows, seq - 1 - start)
        if with_entropy:
            # At --entropy_coef 0 the entropy is only logged: with grad, autograd would keep its two fp32 (batch,
            # seq, vocab) intermediates until backward (GBs at a 128k vocabulary) and differentiate through them.
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.args.entropy_coef != 0):
                outputs.append(entropy_from_logits(logits))
        if self.args.packing_samples:
            outputs = [unpack_next_token(o, position_ids, index, batch["input_ids"].shape) for o in outputs]
        else:
            outputs = [torch.nn.functional.pad(o, (start, 0)) for o in outputs]  # (rows, seq - 1)
        return tuple(outputs) if with_entropy else outputs[0]

    @torch.no_grad()
    def logprobs(self, batch: dict) -> torch.Tensor:
        """Log-probs of each next token, (batch, seq - 1), in micro-batches of --micro_rollout_batch_size."""
        self.use_cpu_threads("experience")
        self.engine.eval()
        return in_length_order(batch, micro_rollout(self.args), self._logprobs, batch["action_mask"].shape[1])


class ActorWorker(ReferenceWorker):
    """A rank of the actor: the policy's log-probs as the reference computes them, the PPO update, the weight sync
    to vLLM, and the final model."""

    def setup(self, args: Args, path: str, total_steps: int):
        self.load(args, path, total_steps, args.actor_learning_rate)
        self.ptx = None

    def set_ptx_data(self, samples: list[dict]):
        self.ptx = samples

    def _ptx_rows(self, draw: int) -> list[dict]:
        """The pretraining rows of this rank's `draw`-th micro-batch of the run.

        All ranks read one stream over the whole ptx set, shuffled anew each pass by --seed, taking turns: every
        step and every rank trains on rows no other has had in this pass, and a resumed run, which passes the same
        step numbers, goes on with the rows it would have had.
        """
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
        # DeepSpeed averages the micro-batches' losses over an optimizer step's micro-batches and ranks; each loss
        # is its micro-batch's share of the whole train batch's aggregate, times what that average divides by.
        scale = accumulation * self.world_size
        for epoch in range(args.max_epochs):
            micro_batches = split(experience, args.micro_train_batch_size, args.seed + epoch,
                                  accumulation * args.micro_train_batch_size)
            for index, mb in enumerate(micro_batches):
                if index % accumulation == 0:  # an optimizer step's first micro-batch: the count of its train batch
                    count = train_batch_count(micro_batches[index:index + accumulation], agg)
                logprobs, entropy = self._logprobs(mb, with_entropy=True)
                mask = mb["action_mask"]
                if "old_logprobs" not in mb:  # update_is_on_policy: these weights sampled the batch
                    mb["old_logprobs"] = logprobs.detach()
                    on_policy.append((old_logprob_metrics(args, mb["old_logprobs"], mb, mask), mask))
                    if args.vllm_is_correction:
                        mb["is_weights"], on_policy[-1][0]["vllm/is_capped"] = truncated_is_weights(
                            mb["old_logprobs"], mb["vllm_logprobs"], mask, args.vllm_is_cap)
                loss, clipfrac, approx_kl = policy_loss(
                    logprobs, mb["old_logprobs"], mb["advantages"], mask, *clip_range(args), args.dual_clip,
                    mb.get("is_weights"), agg, args.generate_max_len, count)
                if args.advantage_estimator in KL_IN_LOSS and "ref_logprobs" in mb:  # GRPO's KL: k3, in the loss
                    kl = tricks.kl_penalty(logprobs, mb["ref_logprobs"], "k3", mask)
                    loss = loss + kl_coef * tricks.aggregate(kl, mask, agg, args.generate_max_len, count)
                means.append(({"policy/clipfrac": clipfrac, "policy/approxkl": approx_kl,
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
        aux_loss = {"policy/aux_loss": sum(aux_losses) / len(aux_losses)} if any(aux_losses) else {}
        return {"policy/loss": sum(losses) / len(losses), "policy/lr": lr, **update, **sampled, **aux_loss,
                "weights": {**update_weights, **sampled_weights}}

    @torch.no_grad()
    def reference_logprobs(self, batch: dict) -> torch.Tensor:
        """With --lora_rank the reference is the actor's own frozen model, adapters off: no reference workers."""
        with lora.reference(self.engine):
            return self.logprobs(batch)

    def init_weight_sync(self, engines: list) -> None:
        self.sync_group = init_weight_sync_group(engines) if self.rank == 0 else None

    def sync_weights(self, engines: list, everything_quantized: bool = False) -> dict:
        """Every rank gathers ZeRO-3 shards (collective); rank 0 broadcasts them to the engines in buckets. With LoRA
        only the adapted layers change, and they are sent merged, W + (alpha / r) B A, as vLLM's model has them;
        `everything_quantized` adds every 4-bit layer, dequantized (QLoRA's first sync)."""
        params = (in_checkpoint_layout(lora.base_model(self.engine),
                                       lora.iter_merged_params(self.engine, everything_quantized))
                  if self.args.lora_rank else iter_gathered_params(self.engine))
        if self.rank == 0:
            return broadcast_weights_to_vllm(params, engines, self.sync_group, complete=not self.args.lora_rank)
        for _ in params:
            pass
        return {}

    def save_model(self, out_dir: str) -> None:
        save_hf_model(self.engine, self.tokenizer, out_dir, self.rank,
                      stop_ids=generation_stop_ids(self.tokenizer, self.args.apply_chat_template))


class ScalarHeadWorker(ModelWorker):
    """A rank of a model with a scalar head on its backbone (AutoModelForSequenceClassification, one label)."""

    def load_scalar(self, args: Args, path: str, total_steps: int | None, learning_rate: float, flag: str):
        self.load(args, path, total_steps, learning_rate, model_class=AutoModelForSequenceClassification,
                  num_labels=1, flag=flag)
        config = scalar_head_parts(self.engine)[0].config
        if config.pad_token_id is None:  # transformers refuses a batch without one (sequence_rewards reads no padding)
            config.pad_token_id = self.tokenizer.pad_token_id

    def _normalizes(self) -> bool:
        """Whether scores and values are put on the normalised reward scale: a model rm.py saved carries its
        reward mean and std; a critic given a fresh head (from --pretrain) has none and learns the scale itself."""
        return self.args.normalize_reward and rewards.reward_model_normalizes(self.engine.module)


class RewardModelWorker(ScalarHeadWorker):
    """A rank of a frozen reward model: one score per sequence."""

    def setup(self, args: Args, path: str):
        self.load_scalar(args, path, None, 0.0, "--reward_pretrain")

    @torch.no_grad()
    def scores(self, batch: dict) -> torch.Tensor:
        """Reward-model scores of reward_model_batch's rows, read at each one's last token, (batch,); padded also with
        --packing_samples."""
        self.use_cpu_threads("experience")
        self.engine.eval()
        return in_length_order(batch, micro_rollout(self.args), lambda mb: sequence_rewards(
            self.engine, mb["input_ids"], mb["attention_mask"], self._normalizes()))


class CriticWorker(ScalarHeadWorker):
    """A rank of the critic: a value for every token, and the clipped value update."""

    def setup(self, args: Args, path: str, total_steps: int):
        self.load_scalar(args, path, total_steps, args.critic_learning_rate, "--critic_pretrain")

    def _values(self, batch: dict) -> torch.Tensor:
        """The value at each position that predicts a next token, (batch, seq - 1), aligned with the log-probs.
        --packing_samples runs the micro-batch as one row without padding and puts the values back in this layout."""
        if not self.args.packing_samples:
            return token_values(self.engine, batch["input_ids"], batch["attention_mask"], self._normalizes())[:, :-1]
        input_ids, position_ids, index = pack_rows(batch["input_ids"], batch["attention_mask"])  # (1, total) each
        values = packed_token_values(self.engine, input_ids, position_ids, self._normalizes())  # (1, total)
        return unpack(values, index, batch["input_ids"].shape)[:, :-1]

    @torch.no_grad()
    def values(self, batch: dict) -> torch.Tensor:
        """Critic values for predicting each next token, (batch, seq - 1), aligned with the log-probs."""
        self.use_cpu_threads("experience")
        self.engine.eval()
        return in_length_order(batch, micro_rollout(self.args), self._values, batch["action_mask"].shape[1])

    def fit(self, experience: dict, kl_coef: float = 0.0) -> dict:
        args, stats = self.args, []
        self.use_cpu_threads("train")
        self.engine.train()
        lr = self.engine.get_lr()[0]  # the rate of this fit's first update
        accumulation = self.engine.gradient_accumulation_steps()
        scale = accumulation * self.world_size  # as in the actor's fit: each micro-batch's share of its train batch
        for epoch in range(args.max_epochs):
            micro_batches = split(experience, args.micro_train_batch_size, args.seed + epoch,
                                  accumulation * args.micro_train_batch_size)
            for index, mb in enumerate(micro_batches):
                if index % accumulation == 0:
                    count = train_batch_count(micro_batches[index:index + accumulation], "token-mean")
                values = self._values(mb)
                loss = value_loss(values, mb["values"], mb["returns"], mb["action_mask"], args.value_clip,
                                  count) * scale
                self.engine.backward(loss)
                self.engine.step()
                stats.append(loss.item())
        return {"critic/value_loss": sum(stats) / len(stats), "critic/lr": lr}


# ------------------------------------------------------------------------------------------- driver: setup
def load_prompts(args, tokenizer, source, split_name) -> list[dict]:
    """Tokenized prompts with their labels; prompts over --prompt_max_len are skipped and counted."""
    rows = load_records(source, split_name)
    if not rows:
        raise DataError(f"prompt dataset {source} is empty.")
    prompts, skipped = [], 0
    read = args.reward_fn or args.remote_rm_url or args.env_fn  # what gets the labels: said when they are missing
    labels = get_labels(rows, args.label_key, source, print if read else lambda message: None)
    for i, row in enumerate(rows):
        prompt = get_key(row, args.input_key, i, source)
        with sample_context(source, i):
            text = render_prompt(tokenizer, prompt, args.apply_chat_template, args.input_template)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > args.prompt_max_len:
            skipped += 1
            continue
        prompts.append({"prompt": prompt, "ids": ids, "label": labels[i]})
    if not prompts:
        raise DataError(f"every prompt in {source} is longer than --prompt_max_len {args.prompt_max_len}; raise it.")
    if skipped:
        print(f"{source}: skipped {skipped} of {len(rows)} prompts longer than --prompt_max_len {args.prompt_max_len}")
    return prompts


# Options --async_rollouts cannot overlap generation with training under, and why.
ASYNC_CLASHES = {
    "colocate_all": "the engines sleep while the models train on the same GPUs, so nothing could generate meanwhile",
    "dynamic_sampling": "its later rounds need the first round's rewards before the step can train",
    "env_fn": "its episodes alternate with the environment a turn at a time, on the driver",
}


def check_args(args: Args) -> None:
    """Catch flag mistakes before any worker starts."""
    check_keep_last(args.keep_last_checkpoints)
    if args.max_steps < 1:
        raise UserError(f"--max_steps {args.max_steps} runs no PPO step; give 1 or more.")
    if args.env_fn:
        others = [flag for flag in ("reward_pretrain", "reward_fn", "remote_rm_url", "reward_weights")
                  if getattr(args, flag)]
        if others:
            raise UserError(f"--env_fn's rewards score the episodes; leave out --{others[0]}, or --env_fn.")
        if args.max_turns < 1:
            raise UserError(f"--max_turns {args.max_turns} gives the policy no turn; give 1 or more.")
    else:
        rewards.reward_weights(args.reward_weights, args.reward_pretrain, args.reward_fn, args.remote_rm_url)
    if args.reward_clip <= 0:
        raise UserError(f"--reward_clip {args.reward_clip} must be above 0: rewards are clipped to [-clip, clip] "
                        f"(10 is the default; a large bound such as 1e9 clips nothing).")
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        raise UserError(f"--temperature {args.temperature} --top_p {args.top_p}: the trainer's log-probs divide "
                        f"by the temperature and the policy must keep some tokens; give a temperature above 0 "
                        f"(1.0 samples the policy as it is) and a top_p in (0, 1] (evaluation is greedy anyway).")
    if args.kl_target is not None and not (args.kl_target > 0 and args.init_kl_coef > 0):
        raise UserError(f"--kl_target {args.kl_target} with --init_kl_coef {args.init_kl_coef}: the adaptive "
                        f"controller scales the coefficient up and down from --init_kl_coef, so both must be above "
                        f"0 (e.g. --init_kl_coef 0.01 --kl_target 0.05).")
    if args.advantage_estimator in GROUPED and args.n_samples_per_prompt < 2:
        raise UserError(f"--advantage_estimator {args.advantage_estimator} compares samples of the same prompt; "
                        f"set --n_samples_per_prompt to 2 or more.")
    low, high = clip_range(args)
    if not (0 < low < 1 and high > 0):
        raise UserError(f"the policy ratio's clip range [1 - {low}, 1 + {high}] is empty or unbounded; give "
                        f"--eps_clip (or --eps_clip_low and --eps_clip_high) between 0 and 1, e.g. 0.2.")
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise UserError(f"--dual_clip {args.dual_clip} must be above 1 (3 is usual): it bounds the loss of a "
                        f"negative-advantage token at dual_clip x its advantage.")
    if not 0 <= args.overlong_buffer_len < args.generate_max_len:
        raise UserError(f"--overlong_buffer_len {args.overlong_buffer_len} must be below --generate_max_len "
                        f"{args.generate_max_len} (a quarter of it is usual).")
    if args.dynamic_sampling and args.advantage_estimator not in GROUPED:
        raise UserError(f"--dynamic_sampling drops prompts whose responses all got the same reward, which teach "
                        f"nothing only under a group baseline; use it with --advantage_estimator "
                        f"{', '.join(GROUPED)}, not {args.advantage_estimator}.")
    if args.dynamic_sampling_max_rounds < 1:
        raise UserError(f"--dynamic_sampling_max_rounds {args.dynamic_sampling_max_rounds} leaves nothing to train "
                        f"on; give 1 or more (3 is usual).")
    for flag, why in ASYNC_CLASHES.items():
        if args.async_rollouts and getattr(args, flag):
            raise UserError(f"--async_rollouts cannot be used with --{flag}: {why}; leave out one of the two.")
    if args.vllm_is_cap < 1:
        raise UserError(f"--vllm_is_cap {args.vllm_is_cap} would down-weight tokens both policies agree on; give a "
                        f"cap of 1 or more (2 is usual).")
    rollout = args.rollout_batch_size * args.n_samples_per_prompt
    if rollout % args.train_batch_size:
        raise UserError(f"--rollout_batch_size x --n_samples_per_prompt = {rollout} responses must be a multiple "
                        f"of --train_batch_size {args.train_batch_size}.")
    for role in ("actor", "critic"):
        workers = getattr(args, f"{role}_num_workers")
        if rollout % (workers * args.micro_train_batch_size):
            raise UserError(f"{rollout} responses per step do not split into {workers} {role} worker(s) x "
                            f"--micro_train_batch_size {args.micro_train_batch_size}; change one of them.")
    check_model_path(args.pretrain)
    check_causal_lm(args.pretrain)
    if args.packing_samples:  # the reward models score padded rows
        check_packing(args.pretrain)
        if args.advantage_estimator == "gae" and critic_path(args) != args.pretrain:  # the critic trains packed
            check_packing(critic_path(args), "--critic_pretrain" if args.critic_pretrain else
                          "--reward_pretrain (where the critic starts)")
    check_output_dir(args.output_dir)
    check_resumable(args)
    sequence = ("--prompt_max_len + --generate_max_len", args.prompt_max_len + args.generate_max_len,
                "--prompt_max_len or --generate_max_len")
    check_lengths(args.pretrain, *sequence)
    for flag, path in [("--reward_pretrain", p) for p in args.reward_pretrain or []] + [
            ("--critic_pretrain", args.critic_pretrain)]:
        if path:
            check_model_path(path, flag)
            check_decoder_only(path, flag)
            check_lengths(path, *sequence, flag)


def start_ray(args: Args) -> None:
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "TOKENIZERS_PARALLELISM": "false"}
    for key in ("HF_HUB_OFFLINE", "TORCH_EXTENSIONS_DIR", "VLLM_CPU_KVCACHE_SPACE", "WANDB_MODE"):
        if key in os.environ:
            env[key] = os.environ[key]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster needs no token
    if address:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
    else:
        # On a machine without GPUs the roles share the cores: Ray's CPU count is a budget, not a pinning.
        num_cpus = None if torch.cuda.is_available() else max(os.cpu_count() or 1, 16)
        # "local": a Ray of this run's own, even when another Ray instance runs on this machine.
        ray.init(address="local", num_cpus=num_cpus, runtime_env={"env_vars": env}, include_dashboard=False,
                 log_to_driver=False)
    stop_on_sigterm()  # Ray's driver took SIGTERM over (it aborts); a stop should say what survives


def critic_path(args: Args) -> str:
    """Where the critic starts: --critic_pretrain, else the first reward model, else the policy."""
    return args.critic_pretrain or (args.reward_pretrain[0] if args.reward_pretrain else args.pretrain)


def place_roles(args: Args, total_actor_steps: int) -> dict:
    """Start every role's workers and the vLLM engines on placement groups, colocated as asked."""
    use_critic = args.advantage_estimator == "gae"
    reward_paths = args.reward_pretrain or []
    cpus = args.cpus_per_worker
    gpu_layout = {"actor": args.actor_num_workers,
                  "reference": 0 if args.colocate_actor_ref or args.colocate_all or args.lora_rank
                  or not uses_reference(args) else args.ref_num_workers,
                  "critic": args.critic_num_workers if use_critic and not args.colocate_all else 0,
                  "reward models": 0 if (args.colocate_critic_reward and use_critic) or args.colocate_all
                  else args.reward_num_workers * len(reward_paths),
                  "vLLM": 0 if args.colocate_all else args.vllm_num_engines * args.vllm_tensor_parallel_size}
    lora.check_args(args, gpu=use_gpus())
    check_resources({k: v * (1 if use_gpus() else cpus) for k, v in gpu_layout.items() if v})
    if args.colocate_all and args.vllm_num_engines * args.vllm_tensor_parallel_size != args.actor_num_workers:
        raise UserError("--colocate_all needs vllm_num_engines x vllm_tensor_parallel_size == actor_num_workers.")
    shares = role_shares(args)
    check_colocation(args, shares)

    shared = make_placement_group(args.actor_num_workers, cpus, "actor") if args.colocate_all else None
    # The engines first: PACK then keeps each tensor-parallel engine on one node, while whole nodes are free (placed
    # last, a TP-4 engine of the 70B layout got 2 GPUs on each node, its every layer's all-reduce crossing nodes).
    engines = create_vllm_engines(
        args.vllm_num_engines, args.vllm_tensor_parallel_size, args.pretrain, args.seed,
        max_model_len=args.prompt_max_len + args.generate_max_len, placement_group=shared,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        enable_sleep_mode=args.colocate_all and use_gpus(), num_cpus_per_engine=cpus,
        enforce_eager=not use_gpus(), dtype=None if args.vllm_dtype == "trainer" else args.vllm_dtype,
        logprobs_mode="processed_logprobs", wait_until_ready=False, stop_at_end_of_turn=args.apply_chat_template)
    warm_up = [engine.warm_up.remote() for engine in engines]  # each runs once its engine has started
    engine_sleep = SleepSchedule(engines, enabled=args.colocate_all)  # a recorded no-op where vLLM cannot sleep
    if args.colocate_all:  # asleep before the models load into the memory the engines give back
        wait_for_engines(engines, warm_up)
        engine_sleep.start()
    # Every role then loads its model while the engines start: each start is mostly imports and reading weights.
    start = functools.partial(WorkerGroup, cpus_per_bundle=cpus, wait_until_ready=False)
    actor_pg = shared or make_placement_group(args.actor_num_workers, cpus, "actor")
    roles = {"actor": start(ActorWorker, actor_pg, shares["actor"], args=(args, args.pretrain, total_actor_steps),
                            role="actor"), "engines": engines}
    if uses_reference(args) and not args.lora_rank:  # with LoRA the actor's frozen base model is the reference
        ref_pg = actor_pg if (args.colocate_actor_ref or args.colocate_all) else make_placement_group(
            args.ref_num_workers, cpus, "reference")
        roles["ref"] = start(ReferenceWorker, ref_pg, shares["reference"], args=(args, args.pretrain),
                             role="reference")
    critic_pg = shared or make_placement_group(args.critic_num_workers, cpus, "critic") if use_critic else None
    if use_critic:
        roles["critic"] = start(CriticWorker, critic_pg, shares["critic"],
                                args=(args, critic_path(args), total_actor_steps), role="critic")
    roles["rewards"] = []
    for i, path in enumerate(reward_paths):
        pg = critic_pg if (args.colocate_critic_reward and critic_pg) else (
            shared or make_placement_group(args.reward_num_workers, cpus, f"reward model {i + 1}"))  # one name each
        roles["rewards"].append(start(RewardModelWorker, pg, shares["reward model"], args=(args, path),
                                      role=f"reward model {i + 1}"))
    wait_for_engines(engines, warm_up)
    groups = [roles[name] for name in ("actor", "ref", "critic") if name in roles] + roles["rewards"]
    for group in groups:
        group.ready()
    engine_sleep.trainers = groups
    roles["engine_sleep"] = engine_sleep
    return roles


def role_shares(args: Args) -> dict[str, float]:
    """The share of its bundle (a GPU, or --cpus_per_worker CPUs) that each worker of a role asks Ray for."""
    share = 0.2 if args.colocate_all else (0.5 if args.colocate_actor_ref else 1.0)
    beside_critic = 0.5 if args.colocate_critic_reward else share
    return {"actor": share, "reference": share, "critic": beside_critic, "reward model": beside_critic,
            "vLLM": COLOCATED_GPU_SHARE if args.colocate_all else 1.0}


def check_colocation(args: Args, shares: dict[str, float]) -> None:
    """Refuse, before anything is placed, roles colocated on one bundle that ask for more than all of it: Ray would
    start the first ones and leave the last pending forever (e.g. --colocate_critic_reward with 2 reward models)."""
    uses = {"reference": uses_reference(args) and not args.lora_rank,
            "critic": args.advantage_estimator == "gae"}
    ref = {"reference": shares["reference"]} if uses["reference"] else {}
    critic = {"critic": shares["critic"]} if uses["critic"] else {}
    rms = {f"reward model {i + 1}": shares["reward model"] for i in range(len(args.reward_pretrain or []))}
    if args.colocate_all:
        check_bundle_shares("actor", {"actor": shares["actor"], **ref, **critic, **rms, "vLLM": shares["vLLM"]})
        return
    if args.colocate_actor_ref:
        check_bundle_shares("actor", {"actor": shares["actor"], **ref})
    if args.colocate_critic_reward and critic:
        check_bundle_shares("critic", {**critic, **rms})


def check_tokenizers(args: Args, tokenizer) -> None:
    """Every model reads the actor's vocabulary, so every tokenizer must be the actor's; a reward model, which reads
    pairs rendered with its own chat template, needs one with --apply_chat_template."""
    for flag, path in [("--reward_pretrain", p) for p in args.reward_pretrain or []] + [
            ("--critic_pretrain", args.critic_pretrain)]:
        if path:
            rewards.check_same_tokenizer(tokenizer, load_tokenizer(path, flag), f"--pretrain {args.pretrain}",
                                         f"{flag} {path}", args.apply_chat_template and flag == "--reward_pretrain")


# ---------------------------------------------------------------------------------------------- driver: the run
def step_prompts(args: Args, prompts: list[dict], step: int) -> list[dict]:
    """This step's --rollout_batch_size prompts: passes over the data, each in an order fixed by (--seed, pass), so
    a resumed run picks the prompts the killed one would have."""
    per_pass = max(1, len(prompts) // args.rollout_batch_size)
    order = list(range(len(prompts)))
    random.Random(args.seed * 100_003 + step // per_pass).shuffle(order)
    start = (step % per_pass) * args.rollout_batch_size
    return [prompts[order[(start + i) % len(prompts)]] for i in range(args.rollout_batch_size)]


def further_prompts(args: Args, prompts: list[dict], step: int, round_: int) -> list[dict]:
    """--dynamic_sampling's extra draw of --rollout_batch_size prompts for a step's later rounds: fixed by
    (--seed, step, round), so a resumed run draws what the killed one would have."""
    return random.Random(f"{args.seed}-{step}-{round_}").choices(prompts, k=args.rollout_batch_size)


def rollout(args: Args, roles: dict, prompts: list[dict], step: int, tokenizer,
            reward_fn) -> tuple[list[dict], list[list[dict]], tuple[torch.Tensor, dict] | None]:
    """This step's prompts and vLLM's responses to them; with --dynamic_sampling also their scores and metrics.

    DAPO's dynamic sampling (Yu et al. 2025): a prompt whose responses all got the same reward has zero advantages
    under a group baseline and only dilutes the batch, so it is dropped and further prompts are sampled, a batch at a
    time, until --rollout_batch_size prompts with a spread are found or --dynamic_sampling_max_rounds is reached;
    the dropped prompts then fill what is missing. The rewards/* metrics are those of the step's own prompts, as
    without it; objective/scores is the trained batch's.
    """
    n, size = args.n_samples_per_prompt, args.rollout_batch_size
    picked = step_prompts(args, prompts, step)
    samples = respond(args, roles, picked, n, args.temperature, tokenizer)
    if not args.dynamic_sampling:
        return picked, samples, None
    kept, dropped, first, generated = [], [], None, 0
    for round_ in range(args.dynamic_sampling_max_rounds):
        if round_:
            picked = further_prompts(args, prompts, step, round_)
            samples = respond(args, roles, picked, n, args.temperature, tokenizer)
        generated += generated_tokens(samples)
        scores, metrics = score_rollouts(args, roles, picked, samples, tokenizer, reward_fn)
        first = metrics if first is None else first
        spread = tricks.groups_with_a_spread(scores, n)
        for i, group in enumerate(zip(picked, samples, scores.view(-1, n))):
            (kept if spread[i] else dropped).append(group)
        if len(kept) >= size:
            break
    drawn = (round_ + 1) * size
    groups = (kept + dropped)[:size]  # those with a spread first
    picked, samples, scores = [g[0] for g in groups], [g[1] for g in groups], torch.cat([g[2] for g in groups])
    metrics = {**first, "dynamic_sampling/dropped": len(dropped) / drawn, "dynamic_sampling/rounds": round_ + 1,
               "dynamic_sampling/filled": max(0, size - len(kept)) / size,
               "dynamic_sampling/generated_tokens": generated}
    return picked, samples, (scores, metrics)


def generated_tokens(samples: list[list[dict]]) -> int:
    """The tokens vLLM sampled for these responses, cut ones included; of a multi-turn episode, the policy's."""
    return sum(sum(s["env_mask"]) if "env_mask" in s else len(s["token_ids"]) for group in samples for s in group)


def start_rollout(args: Args, roles: dict, prompts: list[dict], step: int) -> tuple[list[dict], list]:
    """--async_rollouts: this step's prompts, and the engines' responses to them under way (`collect` them)."""
    picked = step_prompts(args, prompts, step)
    return picked, start_generate(roles["engines"], [p["ids"] for p in picked], args.n_samples_per_prompt,
                                  args.temperature, args.top_p, args.generate_max_len)


@functools.cache
def env_factory(spec: str):
    """--env_fn's make_env, loaded once."""
    return rewards.load_reward_fn(spec, "--env_fn")


def respond(args: Args, roles: dict, prompts: list[dict], n: int, temperature: float, tokenizer) -> list[list[dict]]:
    """vLLM's n responses to each prompt; with --env_fn, n multi-turn episodes of each (common/multi_turn.py)."""
    if not args.env_fn:
        return sample(roles, [p["ids"] for p in prompts], n, temperature, args.top_p, args.generate_max_len)

    def one_turn(ids: list[list[int]], limits: list[int]) -> list[dict]:
        return [s[0] for s in generate(roles["engines"], ids, 1, temperature, args.top_p, limits)]

    roles["engine_sleep"].before_generate()
    samples = multi_turn.run_episodes(one_turn, env_factory(args.env_fn), tokenizer, prompts, n, args.max_turns,
                                      args.generate_max_len, args.apply_chat_template, args.input_template,
                                      args.prompt_max_len)
    roles["engine_sleep"].after_generate()
    return samples


def sample(roles: dict, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
           max_tokens: int) -> list[list[dict]]:
    """vLLM's n responses to each prompt; colocated engines are awake only meanwhile (SleepSchedule)."""
    roles["engine_sleep"].before_generate()
    samples = generate(roles["engines"], prompt_ids, n, temperature, top_p, max_tokens)
    roles["engine_sleep"].after_generate()
    return samples


def train_step(roles: dict, experience: dict, kl_coef: float, step: int, micro: int) -> dict:
    """The PPO update of the actor and of the critic, each on its own workers, at the same time."""
    actor, critic = roles["actor"], roles.get("critic")
    actor_fit = actor.call_sharded("fit", shard(experience, len(actor), micro), kl_coef, step)
    critic_fit = critic.call_sharded("fit", shard(experience, len(critic), micro)) if critic else []
    metrics = mean_over_ranks(actor.get(actor_fit))  # each rank's means over its share of the experience
    if critic_fit:
        metrics.update(mean_over_ranks(critic.get(critic_fit)))
    return metrics


def sync_weights(roles: dict, everything_quantized: bool = False) -> dict:
    """Send the actor's new weights to the vLLM engines (common/weight_sync.py); returns its counts and times."""
    roles["engine_sleep"].before_sync()
    engines = roles["engines"]
    sync = wait_for(roles["actor"].call("sync_weights", engines, everything_quantized), engines, "the weight sync")[0]
    return {"weight_sync/bytes": sync.get("weight_sync/bytes", 0),
            "weight_sync/vllm_load": sync.get("weight_sync/load_seconds", 0)}


def evaluate(args: Args, roles: dict, tokenizer, reward_fn, eval_prompts: list[dict]) -> dict:
    """Greedy responses to the held-out prompts, scored like the rollouts; the latest are kept in
    eval_samples.jsonl, to read."""
    samples = respond(args, roles, eval_prompts, 1, 0.0, tokenizer)
    # an episode's text shows the turns' markers, which tell the policy's turns from the environment's
    texts = [decode_response(tokenizer, s[0].get("prompt_ids", p["ids"]), s[0]["token_ids"],
                             skip_special_tokens=not args.env_fn) for p, s in zip(eval_prompts, samples)]
    if args.env_fn:
        total, parts = episode_scores(args, samples)
    else:
        total, parts = score(args, roles, reward_fn, [p["prompt"] for p in eval_prompts], texts,
                             [p["label"] for p in eval_prompts])
    with open(os.path.join(args.output_dir, "eval_samples.jsonl"), "w") as f:
        for p, text, reward in zip(eval_prompts, texts, total.tolist()):
            f.write(json.dumps({"prompt": p["prompt"], "response": text, "reward": reward}) + "\n")
    return {"eval/reward": total.mean(), **{"eval/" + k.split("/")[1]: v for k, v in parts.items()}}


def trained_roles(roles: dict) -> dict:
    return {"actor": roles["actor"], **({"critic": roles["critic"]} if "critic" in roles else {})}


def resume_settings(args: Args) -> dict:
    """What fixes the prompt order, the update's batches and the ZeRO partitioning, and what makes it this run (its
    models, prompts and schedule): a resumed run must match it."""
    names = ["seed", "rollout_batch_size", "n_samples_per_prompt", "train_batch_size", "actor_num_workers"]
    run = ["pretrain", "reward_pretrain", "prompt_data", "actor_learning_rate", "warmup_ratio", "min_lr_ratio"]
    roles = ["actor", "critic"] if args.advantage_estimator == "gae" else ["actor"]
    if "critic" in roles:  # the critic's ZeRO partitioning
        names.append("critic_num_workers")
        run += ["critic_pretrain", "critic_learning_rate"]
    stages = {f"the {role}'s --zero_stage": zero_layout(trained_zero_stage(
        args.zero_stage, getattr(args, f"{role}_num_workers"), args.offload_optimizer, args.load_in_4bit))
        for role in roles}
    return {**{f"--{name}": getattr(args, name) for name in names}, **stages, **lora.settings(args),
            **run_settings(__file__, args, *run)}


def checkpoint_dir(args: Args) -> str:
    return args.ckpt_dir or os.path.join(args.output_dir, "checkpoints")


def check_resumable(args: Args) -> None:
    """Refuse, before anything starts, to resume a checkpoint saved with other settings (checkpoint.check_settings)."""
    state_file = os.path.join(checkpoint_dir(args), "driver_state.json")
    if os.path.exists(state_file):
        with open(state_file) as f:
            state = json.load(f)
        check_settings(state.get("settings"), resume_settings(args), checkpoint_dir(args))
        if state["step"] > args.max_steps:  # no step would run, and the model saved would be the checkpoint's
            raise UserError(f"{checkpoint_dir(args)} holds a run at step {state['step']}, past this run's end at "
                            f"--max_steps {args.max_steps}; raise --max_steps to {state['step']} or more to resume it, "
                            f"or give another --output_dir (or --ckpt_dir) to start anew.")


def save_checkpoint(args: Args, roles: dict, step: int, kl_ctl) -> None:
    """Every trained role's state, then the driver's state file, written last: it is what commits the step."""
    ckpt_dir = checkpoint_dir(args)
    for name, group in trained_roles(roles).items():
        group.get(group.call("save_state", os.path.join(ckpt_dir, name), step))
    state = {"step": step, "kl_ctl": kl_ctl.state_dict(), "settings": resume_settings(args)}
    try:
        write_atomically(os.path.join(ckpt_dir, "driver_state.json"), json.dumps(state))
    except OSError as e:
        raise stopped(f"could not write the checkpoint ({describe(e, ckpt_dir)})", step - 1, ckpt_dir) from None
    for name in trained_roles(roles):  # only now: a role's older step is what a stop before this line resumes from
        prune(os.path.join(ckpt_dir, name), step, args.keep_last_checkpoints)


def resume(roles: dict, ckpt_dir: str, kl_ctl) -> int:
    """Load the latest committed checkpoint, if any, and send its actor to vLLM; returns the step to start at."""
    state_file = os.path.join(ckpt_dir, "driver_state.json")
    if not os.path.exists(state_file):
        return 0
    with open(state_file) as f:
        state = json.load(f)
    kl_ctl.load_state_dict(state["kl_ctl"])
    ray.get([ref for name, group in trained_roles(roles).items() for ref in
             group.call("load_state", os.path.join(ckpt_dir, name), state["step"])])
    roles["engine_sleep"].before_sync()
    ray.get(roles["actor"].call("sync_weights", roles["engines"]))
    print(f"resumed from {ckpt_dir} at step {state['step']}")
    return state["step"]


def stopped(why: str, step: int, ckpt_dir: str, error=UserError) -> UserError:
    """The sentence a run ends with when an engine died or the user stopped it: where it was, and what is safe on
    disk (the last committed step; a checkpoint being written when it stopped is not committed)."""
    state_file = os.path.join(ckpt_dir, "driver_state.json")
    done = json.load(open(state_file))["step"] if os.path.exists(state_file) else None
    where = f"the checkpoint of step {done} in {ckpt_dir} is intact" if done else "no checkpoint was saved"
    return error(f"{why} at step {step + 1}; {where}. Rerun the same command to resume.")


def busy_in_phases(args: Args, roles: dict) -> dict[str, list]:
    """The worker groups that compute at the same time in the experience phase and in the update (with
    --async_rollouts the engines generate meanwhile)."""
    experience = [g for g in (roles.get("ref"), roles.get("critic"), *roles["rewards"]) if g]
    if not update_is_on_policy(args) or (args.lora_rank and uses_reference(args)):  # the actor's own forward
        experience.append(roles["actor"])
    return {"experience": experience, "train": [g for g in (roles["actor"], roles.get("critic")) if g]}


def connect(args: Args, roles: dict, ptx_samples: list[dict] | None) -> None:
    """After placement: the weight-sync group between actor rank 0 and the engines; without GPUs, each phase's
    share of the cores for every worker; placement.json (which Ray node each worker is on, the engines' and
    workers' pids, the workers' threads per phase); and the actor's pretraining rows."""
    engines = roles["engines"]
    wait(roles["actor"].call("init_weight_sync", engines), SYNC_TIMEOUT.total_seconds(),
         "actor rank 0 and the vLLM engines did not form their weight-sync group")
    groups = {name: roles[name] for name in ("actor", "ref", "critic") if name in roles}
    placement = {name: group.nodes for name, group in groups.items()}
    placement["rewards"] = [group.nodes for group in roles["rewards"]]
    placement["pids"] = {name: group.get(group.call("pid")) for name, group in groups.items()}
    placement["vllm"] = ray.get([engine.node_id.remote() for engine in engines])
    placement["vllm_pids"] = ray.get([engine.pid.remote() for engine in engines])
    if not use_gpus():  # the workers computing at the same time share their node's cores
        phases = busy_in_phases(args, roles)
        share_cores(phases, {phase: placement["vllm"] if args.async_rollouts else [] for phase in phases})
        placement["cpu_threads"] = {name: group.get(group.call("threads")) for name, group in groups.items()}
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "placement.json"), "w") as f:
        json.dump(placement, f, indent=1)
    if ptx_samples:
        ray.get(roles["actor"].call("set_ptx_data", ptx_samples))


def load_data(args: Args, tokenizer) -> tuple[list[dict], list[dict], list[dict] | None]:
    """(training prompts, held-out prompts, pretraining rows for --ptx_data), tokenized."""
    prompts = load_prompts(args, tokenizer, args.prompt_data, args.prompt_split)
    if len(prompts) < args.rollout_batch_size:  # a step would ask some prompts twice
        raise DataError(f"{args.prompt_data} has {len(prompts)} usable prompts, fewer than one rollout batch; lower "
                        f"--rollout_batch_size to {len(prompts)} or less, or give more prompts.")
    eval_prompts = (load_prompts(args, tokenizer, args.eval_prompt_data, args.eval_prompt_split)
                    if args.eval_prompt_data else [])
    ptx_samples = None
    if args.ptx_data:
        ptx_samples = build_sft_samples(load_records(args.ptx_data), tokenizer, args.ptx_data, args.ptx_key, "",
                                        args.prompt_max_len + args.generate_max_len, pretrain_mode=True)
    return prompts, eval_prompts, ptx_samples


def train(args: Args, roles: dict, tokenizer, reward_fn, prompts: list[dict], eval_prompts: list[dict]) -> dict:
    """The PPO loop, from the latest checkpoint to --max_steps; returns the final evaluation's metrics."""
    ckpt_dir = checkpoint_dir(args)
    kl_ctl = (tricks.AdaptiveKLController(args.init_kl_coef, args.kl_target, args.kl_horizon) if args.kl_target
              else tricks.FixedKLController(args.init_kl_coef))
    start_step = step = resume(roles, ckpt_dir, kl_ctl)
    if args.load_in_4bit:  # QLoRA computes with the 4-bit rounding of weights the engines loaded in full precision
        sync_weights(roles, everything_quantized=True)  # (resume() sent only what the adapters change)
    logger = MetricsLogger(args.output_dir, 0, vars(args), args.use_wandb, args.wandb_project,
                           resume_step=start_step)
    bar = progress(args.max_steps, 0, "ppo", initial=start_step)
    engines_at = start_step  # the engines hold the policy after this many steps
    ahead = start_rollout(args, roles, prompts, start_step) if args.async_rollouts else None

    def sync_engines(to_step: int) -> dict:
        """The actor's weights after `to_step` steps to vLLM, once a generation under way has finished."""
        nonlocal engines_at
        if engines_at == to_step:
            return {}
        if ahead:
            collect(roles["engines"], ahead[1])
        engines_at = to_step
        return sync_weights(roles)

    try:
        for step in range(start_step, args.max_steps):
            timings, step_start = {}, time.perf_counter()
            with timed(timings, "time/generate"):  # 1. rollouts: vLLM samples responses to this step's prompts
                if args.async_rollouts:  # sampled while the last step trained, by the policy before that update
                    picked, samples, scored = ahead[0], collect(roles["engines"], ahead[1]), None
                else:
                    picked, samples, scored = rollout(args, roles, prompts, step, tokenizer, reward_fn)
            if args.async_rollouts:  # the engines are idle: they take this step's policy and sample the next step
                with timed(timings, "time/weight_sync"):  # while this one trains
                    synced = sync_engines(step)
                ahead = start_rollout(args, roles, prompts, step + 1) if step + 1 < args.max_steps else None
            with timed(timings, "time/make_experience"):  # 2. log-probs, values, rewards -> advantages
                experience, metrics = make_experience(args, roles, picked, samples, tokenizer, reward_fn,
                                                      kl_ctl.value, scored)
            with timed(timings, "time/train"):  # 3. the PPO update of the actor and the critic
                metrics.update(train_step(roles, experience, kl_ctl.value, step, args.micro_train_batch_size))
            if not args.async_rollouts:
                with timed(timings, "time/weight_sync"):  # 4. the new weights to vLLM
                    synced = sync_engines(step + 1)
            metrics.update(synced)

            kl_ctl.update(metrics["objective/kl"].item(), len(experience["input_ids"]))
            metrics.update({"objective/kl_coef": kl_ctl.value, **timings})
            if not args.async_rollouts:  # (asynchronous generation is timed by no one: it overlaps the update)
                generated = metrics.get("dynamic_sampling/generated_tokens", generated_tokens(samples))
                metrics["perf/rollout_tokens_per_sec"] = generated / timings["time/generate"]
            if eval_prompts and args.eval_steps and (step + 1) % args.eval_steps == 0:
                metrics.update(sync_engines(step + 1))  # --async_rollouts: then step + 2 has nothing to sync
                metrics.update(evaluate(args, roles, tokenizer, reward_fn, eval_prompts))
            metrics["time/step"] = time.perf_counter() - step_start  # all of it: the phases and the driver's share
            logger.log(step + 1, metrics)
            bar.update(1)
            bar.set_postfix(score=f"{float(metrics['objective/scores']):.3f}",
                            kl=f"{float(metrics['objective/kl']):.4f}")
            if args.save_steps and (step + 1) % args.save_steps == 0:
                save_checkpoint(args, roles, step + 1, kl_ctl)
        bar.close()
        sync_engines(args.max_steps)
        final = evaluate(args, roles, tokenizer, reward_fn, eval_prompts) if eval_prompts else {}
    except (EngineDied, WorkerDied) as e:
        raise stopped(str(e), step, ckpt_dir) from None
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
    if args.dry_run:
        memory_plan.dry_run(args)
        return
    reward_fn = rewards.load_reward_fn(args.reward_fn) if args.reward_fn else None
    if args.env_fn:
        env_factory(args.env_fn)  # a wrong path or name stops the run here, before Ray starts
    tokenizer = load_tokenizer(args.pretrain)
    check_tokenizers(args, tokenizer)
    prompts, eval_prompts, ptx_samples = load_data(args, tokenizer)

    start_ray(args)
    if use_gpus():
        memory_plan.preflight(args)
    rollout = args.rollout_batch_size * args.n_samples_per_prompt
    roles = place_roles(args, total_actor_steps=args.max_steps * args.max_epochs * rollout // args.train_batch_size)
    connect(args, roles, ptx_samples)
    final = train(args, roles, tokenizer, reward_fn, prompts, eval_prompts)
    roles["actor"].get(roles["actor"].call("save_model", args.output_dir))
    print(f"saved the actor to {args.output_dir} after {args.max_steps} PPO steps"
          + "".join(f", {k} {float(v):.4f}" for k, v in final.items()))
    shutdown_engines(roles["engines"])
    ray.shutdown()


# What the deepspeed launcher sets for a torch.distributed world of its own (deepspeed/launcher/launch.py).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")


def drives_the_run() -> bool:
    """`deepspeed ppo_ray.py` starts one process per GPU; Ray places every worker itself, so only the process of
    RANK 0 (or a plain `python ppo_ray.py`, which has no RANK) drives, and the others leave at once with exit code 0:
    the launcher stops every process as soon as one exits with another (an MPI or SLURM launch sets no RANK: its own
    variables say the rank). The driver forgets the launcher's world, so that the Ray workers it starts, which
    inherit its environment, do not take it for theirs."""
    rank = os.environ.get("RANK", str(mpi_launch()[1]))
    if rank != "0":
        print(f"ppo_ray.py: launcher rank {rank} exits; the process of rank 0 drives the run, Ray starts the workers.")
        return False
    for key in LAUNCHER_VARIABLES:
        os.environ.pop(key, None)
    return True


if __name__ == "__main__":
    if drives_the_run():
        run_main(main, parse_args(Args))
