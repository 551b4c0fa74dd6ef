"""Distributed PPO (and REINFORCE++, GRPO, RLOO) with Ray, vLLM rollouts and DeepSpeed ZeRO-3: the OpenRLHF design.

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
    deepspeed ppo_ray.py ...        # the same: one driver process; Ray starts the workers

Implementation details, where they happen below:
  - the reward-model score is placed on the final (EOS) token; the per-token KL penalty -beta * KL(pi || pi_ref)
    is added to every token (Ziegler et al. 2019), with a fixed or adaptive beta;
  - advantages: `gae` (Schulman et al. 2016, with a critic initialised from the reward model), `reinforce++`
    (discounted KL-penalised returns, whitened over the batch), `grpo` (scores normalised within each prompt's group,
    KL as a k3 loss term; Shao et al. 2024), `rloo` (leave-one-out baseline; Ahmadian et al. 2024);
  - old log-probs are recomputed by the trainer, not taken from vLLM; the mean absolute difference between the two
    is logged as `vllm/logprob_diff` and shows at once when the weight sync is wrong;
  - policy ratio clipping and value clipping (PPO), optional entropy bonus and pretraining (ptx) loss;
  - reward normalisation with the mean/std rm.py stores, then clipping; a critic initialised from a reward model
    gives values on the same normalised scale; advantage whitening for gae and reinforce++ only (as OpenRLHF);
  - checkpoints hold every trained role, the data position and the KL controller; each role is saved first and
    the driver's state file, written last, commits the step, so a run killed at any moment resumes cleanly.
"""

import json
import os
import random
import time
from dataclasses import dataclass
from typing import Literal

import ray
import torch

from common import memory_plan, rewards
from common import ppo_tricks as tricks
from common.args import UserError, check_model_path, parse_args, run_main
from common.data import DataError, get_key, load_records, render_prompt, stream_indices
from common.logging_utils import MetricsLogger, progress
from common.ray_workers import (RayWorker, WorkerGroup, check_bundle_shares, check_resources, make_placement_group,
                                use_gpus, wait)
from common.vllm_engine import SleepSchedule, create_vllm_engines
from common.weight_sync import SYNC_TIMEOUT

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
    critic_pretrain: str | None = None
    """the critic's starting point (default: the first reward model, else --pretrain with a new value head)"""
    # --- data
    prompt_data: str = ""
    """prompts: a .jsonl/.json/.parquet file, a folder of them, or a `datasets` name"""
    prompt_split: str = "train"
    """split to read when --prompt_data is a `datasets` name"""
    eval_prompt_data: str | None = None
    """held-out prompts, answered greedily and scored every --eval_steps"""
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
    gpu_memory_gib: float = 80.0
    """memory of each GPU, for the memory plan checked before a start on GPUs (A100/H100 80 GB: 80)"""
    dry_run: bool = False
    """print this layout's memory plan per GPU from the models' config.json, refuse it if it cannot fit, and exit"""
    # --- training
    seed: int = 42
    """random seed"""
    zero_stage: int = 3
    """DeepSpeed ZeRO stage of the trained models"""
    offload_optimizer: bool = False
    """keep optimizer states in CPU memory"""
    ref_offload: bool = False
    """keep the reference and reward models' ZeRO-3 parameters in CPU memory"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
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
    advantage_estimator: Literal["gae", "reinforce++", "grpo", "rloo"] = "gae"
    """how advantages are computed; only gae uses a critic"""
    gamma: float = 1.0
    """discount factor"""
    lambd: float = 0.95
    """GAE lambda"""
    eps_clip: float = 0.2
    """PPO policy ratio clip range"""
    value_clip: float = 0.2
    """PPO value clip range"""
    init_kl_coef: float = 0.01
    """KL penalty coefficient (beta)"""
    kl_target: float | None = None
    """turns on the adaptive KL controller, which steers the KL towards this value"""
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
def policy_loss(logprobs, old_logprobs, advantages, mask, eps_clip):
    """PPO's clipped surrogate objective (Schulman et al. 2017, eq. 7), as a loss; all (batch, seq).

    Returns (loss, clip fraction, approximate KL between the old and new policy).
    """
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    surrogate = torch.min(ratio * advantages, ratio.clamp(1 - eps_clip, 1 + eps_clip) * advantages)
    clipped = ((ratio - 1).abs() > eps_clip).float()
    approx_kl = 0.5 * log_ratio.pow(2)
    return -tricks.masked_mean(surrogate, mask), tricks.masked_mean(clipped, mask), tricks.masked_mean(approx_kl, mask)


def value_loss(values, old_values, returns, mask, value_clip):
    """PPO's clipped value loss: the worse of the unclipped and the clipped squared error; all (batch, seq)."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return tricks.masked_mean(loss, mask)


def compute_advantages(args, scores, kl, values, mask, kl_coef):
    """Advantages and returns for the chosen estimator; scores (batch,), everything else (batch, seq).

    `kl` is the per-token KL estimate of the reward penalty. As in OpenRLHF, only gae and reinforce++ whiten their
    advantages over the batch: grpo's and rloo's are already centred within each prompt's group, and whitening
    rloo's token returns (mean removed over all tokens) would bring back a baseline that depends on the response's
    length, which undoes the leave-one-out estimator's unbiasedness (Ahmadian et al. 2024).
    """
    if args.advantage_estimator == "grpo":  # KL goes into the loss instead (see PolicyWorker.fit)
        group = tricks.group_advantages(scores, args.n_samples_per_prompt, "grpo")
        advantages = group[:, None] * mask
        return advantages, advantages
    if args.advantage_estimator == "rloo":
        scores = tricks.group_advantages(scores, args.n_samples_per_prompt, "rloo")
    token_rewards = tricks.compute_token_rewards(scores, kl, mask, kl_coef)
    if args.advantage_estimator == "gae":
        advantages, returns = tricks.compute_gae(token_rewards, values, mask, args.gamma, args.lambd)
    else:
        returns = tricks.compute_returns(token_rewards, mask, args.gamma)
        advantages = returns
    if args.advantage_estimator == "rloo":
        return advantages, returns
    return tricks.masked_whiten(advantages, mask), returns
# --------------------------------------------------------------------------------------------- END ALGO LOGIC


# --------------------------------------------------------------------------------------------------- workers
class PolicyWorker(RayWorker):
    """One DeepSpeed rank of the actor (trained) or of the reference model (frozen)."""

    def setup(self, args: Args, path: str, trainable: bool, total_steps: int):
        from common.deepspeed_utils import (init_distributed, init_eval_engine, init_train_engine, load_model,
                                            load_tokenizer)

        self.args, self.trainable = args, trainable
        self.rank, self.world_size, self.local_rank = init_distributed()
        torch.manual_seed(args.seed)
        config = train_or_eval_config(args, self.world_size, trainable)
        model = load_model(path, config, gradient_checkpointing=args.gradient_checkpointing and trainable)
        self.tokenizer = load_tokenizer(path)
        if trainable:
            self.engine = init_train_engine(model, config, args.actor_learning_rate, args.weight_decay, total_steps,
                                            args.warmup_ratio, args.min_lr_ratio, args.offload_optimizer)
        else:
            self.engine = init_eval_engine(model, config)
        self.ptx = None

    def _logprobs(self, batch, with_entropy=False):
        from common.modeling import entropy_from_logits, token_logprobs

        logits = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"], use_cache=False).logits[:, :-1]
        logits = logits.float() / self.args.temperature  # the policy vLLM sampled from
        logprobs = token_logprobs(logits, batch["input_ids"][:, 1:])  # (batch, seq - 1)
        if not with_entropy:
            return logprobs
        # At --entropy_coef 0 the entropy is only logged: with grad, autograd would keep its two fp32
        # (batch, seq, vocab) intermediates until backward (GBs at a 128k vocabulary) and differentiate through them.
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.args.entropy_coef != 0):
            return logprobs, entropy_from_logits(logits)  # (batch, seq - 1) each

    @torch.no_grad()
    def logprobs(self, batch: dict) -> torch.Tensor:
        self.engine.eval()
        width = batch["action_mask"].shape[1]
        return torch.cat([pad_right(self._logprobs(mb), width)
                          for mb in split(batch, micro_rollout(self.args))]).cpu()

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
        from common.data import pad_collate
        from common.modeling import token_logprobs

        args, stats = self.args, []
        micro_batches_per_step = args.max_epochs * -(-len(experience["input_ids"]) // args.micro_train_batch_size)
        self.engine.train()
        for epoch in range(args.max_epochs):
            for mb in split(experience, args.micro_train_batch_size, shuffle_seed=args.seed + epoch):
                logprobs, entropy = self._logprobs(mb, with_entropy=True)
                mask = mb["action_mask"]
                loss, clipfrac, approx_kl = policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], mask,
                                                        args.eps_clip)
                if args.advantage_estimator == "grpo":  # GRPO's KL term: k3 against the reference, in the loss
                    kl = tricks.kl_penalty(logprobs, mb["ref_logprobs"], "k3")
                    loss = loss + kl_coef * tricks.masked_mean(kl, mask)
                mean_entropy = tricks.masked_mean(entropy, mask)
                loss = loss - args.entropy_coef * mean_entropy
                if self.ptx:  # InstructGPT's PPO-ptx: keep the pretraining distribution's likelihood up
                    picked = self._ptx_rows(step * micro_batches_per_step + len(stats))
                    ptx = pad_collate(picked, self.tokenizer.pad_token_id)
                    ptx = {k: v.to(mask.device) for k, v in ptx.items()}
                    ptx_logits = self.engine(input_ids=ptx["input_ids"], attention_mask=ptx["attention_mask"]).logits
                    ptx_logprobs = token_logprobs(ptx_logits[:, :-1], ptx["input_ids"][:, 1:])
                    loss = loss - args.ptx_coef * tricks.masked_mean(ptx_logprobs, ptx["loss_mask"][:, 1:])
                self.engine.backward(loss)
                self.engine.step()
                stats.append([loss.item(), clipfrac.item(), approx_kl.item(), mean_entropy.item()])
        mean = torch.tensor(stats).mean(0)
        return {"policy/loss": mean[0], "policy/clipfrac": mean[1], "policy/approxkl": mean[2],
                "objective/entropy": mean[3], "policy/lr": self.engine.get_lr()[0]}

    def init_weight_sync(self, engines: list) -> None:
        from common.weight_sync import init_weight_sync_group

        self.sync_group = init_weight_sync_group(engines) if self.rank == 0 else None

    def sync_weights(self, engines: list) -> dict:
        """Every rank gathers ZeRO-3 shards (collective); rank 0 broadcasts them to the engines in buckets."""
        from common.weight_sync import broadcast_weights_to_vllm, iter_gathered_params

        params = iter_gathered_params(self.engine)
        if self.rank == 0:
            return broadcast_weights_to_vllm(params, engines, self.sync_group)
        for _ in params:
            pass
        return {}

    def save_model(self, out_dir: str) -> None:
        from common.checkpoint import save_hf_model

        save_hf_model(self.engine, self.tokenizer, out_dir, self.rank)

    def save_state(self, ckpt_dir: str, step: int) -> None:
        from common.checkpoint import save_train_state

        save_train_state({"model": self.engine}, ckpt_dir, step, {"step": step}, self.rank,
                         self.args.keep_last_checkpoints)

    def load_state(self, ckpt_dir: str, step: int) -> None:
        from common.checkpoint import load_train_state

        load_train_state({"model": self.engine}, ckpt_dir, self.rank, step)


class CriticWorker(PolicyWorker):
    """One DeepSpeed rank of the critic (trained) or of a reward model (frozen): a scalar head on a backbone."""

    def setup(self, args: Args, path: str, trainable: bool, total_steps: int):
        from transformers import AutoModelForSequenceClassification

        from common.deepspeed_utils import (init_distributed, init_eval_engine, init_train_engine, load_model,
                                            load_tokenizer)

        self.args, self.trainable = args, trainable
        self.rank, self.world_size, self.local_rank = init_distributed()
        torch.manual_seed(args.seed)
        config = train_or_eval_config(args, self.world_size, trainable)
        model = load_model(path, config, model_class=AutoModelForSequenceClassification,
                           gradient_checkpointing=args.gradient_checkpointing and trainable, num_labels=1,
                           flag="--critic_pretrain" if trainable else "--reward_pretrain")
        self.tokenizer = load_tokenizer(path)
        if trainable:
            self.engine = init_train_engine(model, config, args.critic_learning_rate, args.weight_decay,
                                            total_steps, args.warmup_ratio, args.min_lr_ratio, args.offload_optimizer)
        else:
            self.engine = init_eval_engine(model, config)

    def _normalizes(self) -> bool:
        """Whether scores and values are put on the normalised reward scale: a model rm.py saved carries its
        reward mean and std; a critic given a fresh head (from --pretrain) has none and learns the scale itself."""
        return self.args.normalize_reward and rewards.reward_model_normalizes(self.engine.module)

    @torch.no_grad()
    def values(self, batch: dict) -> torch.Tensor:
        """Critic values for predicting each next token, (batch, seq - 1), aligned with the log-probs."""
        from common.modeling import token_values

        self.engine.eval()
        width = batch["action_mask"].shape[1]
        return torch.cat([pad_right(token_values(self.engine, mb["input_ids"], mb["attention_mask"],
                                                 self._normalizes())[:, :-1], width)
                          for mb in split(batch, micro_rollout(self.args))]).cpu()

    @torch.no_grad()
    def scores(self, batch: dict) -> torch.Tensor:
        """Reward-model scores read at each sequence's last token, (batch,)."""
        from common.modeling import sequence_rewards

        self.engine.eval()
        return torch.cat([sequence_rewards(self.engine, mb["rm_input_ids"], mb["rm_attention_mask"],
                                           self._normalizes())
                          for mb in split(batch, micro_rollout(self.args))]).cpu()

    def fit(self, experience: dict, kl_coef: float = 0.0) -> dict:
        from common.modeling import token_values

        args, stats = self.args, []
        self.engine.train()
        for epoch in range(args.max_epochs):
            for mb in split(experience, args.micro_train_batch_size, shuffle_seed=args.seed + epoch):
                values = token_values(self.engine, mb["input_ids"], mb["attention_mask"], self._normalizes())[:, :-1]
                loss = value_loss(values, mb["values"], mb["returns"], mb["action_mask"], args.value_clip)
                self.engine.backward(loss)
                self.engine.step()
                stats.append(loss.item())
        return {"critic/value_loss": sum(stats) / len(stats), "critic/lr": self.engine.get_lr()[0]}


def train_or_eval_config(args: Args, world_size: int, trainable: bool) -> dict:
    """The DeepSpeed config of a trained role, or of a frozen one (always ZeRO-3, optionally offloaded)."""
    from common.deepspeed_utils import ds_config

    if trainable:
        return ds_config(args.zero_stage, args.train_batch_size, args.micro_train_batch_size, world_size,
                         args.grad_clip, args.offload_optimizer)
    return ds_config(3, micro_rollout(args) * world_size, micro_rollout(args), world_size,
                     offload_params=args.ref_offload, train=False)


def micro_rollout(args: Args) -> int:
    """Rows per forward pass of the experience phase (--micro_rollout_batch_size, else --micro_train_batch_size)."""
    return args.micro_rollout_batch_size or args.micro_train_batch_size


def pad_right(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad (batch, seq) to (batch, width): micro-batches are trimmed, the batch they came from is not."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def split(batch: dict, size: int, shuffle_seed: int | None = None) -> list[dict]:
    """Micro-batches of `size` rows on this worker's device, trimmed of right padding no row in them needs."""
    from common.deepspeed_utils import device

    n = len(batch["input_ids"])
    order = list(range(n))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    out = []
    for i in range(0, n, size):
        idx = torch.tensor(order[i: i + size])
        length = int(batch["attention_mask"][idx].sum(1).max())
        mb = {}
        for key, value in batch.items():
            value = value[idx]
            if value.dim() == 2 and key.startswith("rm_"):
                value = value[:, : int(batch["rm_attention_mask"][idx].sum(1).max())]
            elif value.dim() == 2:
                value = value[:, : length if value.shape[1] == batch["input_ids"].shape[1] else length - 1]
            mb[key] = value.to(device())
        out.append(mb)
    return out


# ---------------------------------------------------------------------------------------------- experience
def build_batch(prompt_ids: list[list[int]], samples: list[list[dict]], eos_id: int, pad_id: int) -> dict:
    """Right-padded tensors for prompt + response sequences; the masks say which tokens were generated.

    action_mask (batch, seq - 1) is 1 where the next token is a response token, the layout every per-token tensor
    (log-probs, values, rewards, advantages) shares. rm_input_ids ends every sequence with EOS, as rm.py trained on.
    """
    rows, prompt_lens, vllm_logprobs = [], [], []
    for ids, outs in zip(prompt_ids, samples):
        for out in outs:
            rows.append(ids + out["token_ids"])
            prompt_lens.append(len(ids))
            vllm_logprobs.append(out["logprobs"] or [])
    length = max(map(len, rows))
    batch_size = len(rows)
    input_ids = torch.full((batch_size, length), pad_id)  # (batch, seq)
    attention_mask = torch.zeros(batch_size, length, dtype=torch.long)
    action_mask = torch.zeros(batch_size, length - 1)
    rm_input_ids = torch.full((batch_size, length + 1), pad_id)
    rm_attention_mask = torch.zeros(batch_size, length + 1, dtype=torch.long)
    vllm_lp = torch.zeros(batch_size, length - 1)
    for i, (row, p) in enumerate(zip(rows, prompt_lens)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        action_mask[i, p - 1: len(row) - 1] = 1
        vllm_lp[i, p - 1: p - 1 + len(vllm_logprobs[i])] = torch.tensor(vllm_logprobs[i])
        rm_row = row if row[-1] == eos_id else row + [eos_id]
        rm_input_ids[i, : len(rm_row)] = torch.tensor(rm_row)
        rm_attention_mask[i, : len(rm_row)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "action_mask": action_mask, "rm_input_ids": rm_input_ids, "rm_attention_mask": rm_attention_mask,
            "vllm_logprobs": vllm_lp}


def shard(batch: dict, n: int, micro: int) -> list[dict]:
    """Split a batch's rows into n equal consecutive parts, one per worker, each a whole number of micro-batches.

    Under ZeRO-3 every forward pass is collective, so every rank must run the same number of micro-batches: the
    batch is padded with copies of its last row, and callers keep the first len(batch) results.
    """
    rows = len(batch["input_ids"])
    size = -(-rows // (n * micro)) * micro
    pad = [rows - 1] * (size * n - rows)
    index = torch.tensor(list(range(rows)) + pad)
    return [{k: v[index[i * size: (i + 1) * size]] for k, v in batch.items()} for i in range(n)]


def gather(refs: list, rows: int) -> torch.Tensor:
    """Concatenate the workers' results in rank order and drop the padding rows shard() added."""
    return torch.cat(ray.get(refs))[:rows]


def generate(engines, prompt_ids, n, temperature, top_p, max_tokens) -> list[list[dict]]:
    """Samples from every engine, prompts split evenly; a dead engine ends the run with a clear message."""
    chunks = [prompt_ids[i:: len(engines)] for i in range(len(engines))]
    refs = [e.generate.remote(c, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens)
            for e, c in zip(engines, chunks)]
    try:
        results = ray.get(refs)
    except ray.exceptions.RayActorError as e:
        raise EngineDied(f"a vLLM engine died while generating ({type(e).__name__})") from None
    merged = [None] * len(prompt_ids)
    for i, result in enumerate(results):
        merged[i:: len(engines)] = result
    return merged


class EngineDied(RuntimeError):
    """A vLLM engine actor is gone; the run stops and can be resumed from its last checkpoint."""


def wait_for(refs: list, engines: list, what: str) -> list:
    """ray.get(refs), checking every few seconds that the engines still live: a broadcast to a dead engine would
    otherwise wait for the process group's timeout."""
    def check_engines():
        try:
            ray.get([e.ready.remote() for e in engines], timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise EngineDied(f"a vLLM engine died during {what} ({type(e).__name__})") from None

    while True:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=5)
        if len(done) == len(refs):
            try:
                return ray.get(refs)
            except ray.exceptions.RayTaskError:  # e.g. the broadcast's connection to a killed engine was reset
                check_engines()
                raise
        check_engines()


def score(args, groups, reward_fn, batch, prompts, responses, labels) -> tuple[torch.Tensor, dict]:
    """The summed reward of every sequence (batch,), from reward models, the rule function and the remote RM."""
    total, metrics = torch.zeros(len(responses)), {}
    micro = micro_rollout(args)
    refs = [g.call_sharded("scores", shard(batch, len(g), micro)) for g in groups]
    weights = iter(args.reward_weights or [1.0] * (len(groups) + bool(reward_fn) + bool(args.remote_rm_url)))
    for i, parts in enumerate(refs):
        rm_scores = gather(parts, len(responses))
        metrics[f"rewards/rm{i}"] = rm_scores.mean()
        total += next(weights) * rm_scores
    if reward_fn:
        rule = torch.tensor(rewards.call_reward_fn(reward_fn, prompts, responses, labels), dtype=torch.float)
        metrics["rewards/rule"] = rule.mean()
        total += next(weights) * rule
    if args.remote_rm_url:
        remote = torch.tensor(rewards.remote_reward(args.remote_rm_url, prompts, responses, labels))
        metrics["rewards/remote"] = remote.mean()
        total += next(weights) * remote
    return total.clamp(-args.reward_clip, args.reward_clip), metrics


# ------------------------------------------------------------------------------------------------------ setup
def load_prompts(args, tokenizer, source, split_name) -> list[dict]:
    """Tokenized prompts with their labels; prompts over --prompt_max_len are skipped and counted."""
    rows = load_records(source, split_name)
    if not rows:
        raise DataError(f"prompt dataset {source} is empty.")
    prompts, skipped = [], 0
    for i, row in enumerate(rows):
        prompt = get_key(row, args.input_key, i, source)
        text = render_prompt(tokenizer, prompt, args.apply_chat_template, args.input_template)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > args.prompt_max_len:
            skipped += 1
            continue
        prompts.append({"prompt": prompt, "ids": ids, "label": row.get(args.label_key)})
    if not prompts:
        raise DataError(f"every prompt in {source} is longer than --prompt_max_len {args.prompt_max_len}; raise it.")
    if skipped:
        print(f"{source}: skipped {skipped} of {len(rows)} prompts longer than --prompt_max_len {args.prompt_max_len}")
    return prompts


def check_args(args: Args) -> None:
    """Catch flag mistakes before any worker starts."""
    if not (args.reward_pretrain or args.reward_fn or args.remote_rm_url):
        raise UserError("no reward source: give --reward_pretrain, --reward_fn and/or --remote_rm_url.")
    num_sources = len(args.reward_pretrain or []) + bool(args.reward_fn) + bool(args.remote_rm_url)
    if args.reward_weights and len(args.reward_weights) != num_sources:
        raise UserError(f"--reward_weights has {len(args.reward_weights)} weights for {num_sources} reward sources; "
                        f"give one per source, in the order --reward_pretrain..., --reward_fn, --remote_rm_url.")
    if args.advantage_estimator in ("grpo", "rloo") and args.n_samples_per_prompt < 2:
        raise UserError(f"--advantage_estimator {args.advantage_estimator} compares samples of the same prompt; "
                        f"set --n_samples_per_prompt to 2 or more.")
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
    for path in args.reward_pretrain or []:
        check_model_path(path, "--reward_pretrain")


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


def place_roles(args: Args, total_actor_steps: int) -> dict:
    """Start every role's workers and the vLLM engines on placement groups, colocated as asked."""
    critic_path = args.critic_pretrain or (args.reward_pretrain[0] if args.reward_pretrain else args.pretrain)
    use_critic = args.advantage_estimator == "gae"
    reward_paths = args.reward_pretrain or []
    cpus = args.cpus_per_worker
    gpu_layout = {"actor": args.actor_num_workers,
                  "reference": 0 if args.colocate_actor_ref or args.colocate_all else args.ref_num_workers,
                  "critic": args.critic_num_workers if use_critic and not args.colocate_all else 0,
                  "reward models": 0 if args.colocate_critic_reward or args.colocate_all
                  else args.reward_num_workers * len(reward_paths),
                  "vLLM": 0 if args.colocate_all else args.vllm_num_engines * args.vllm_tensor_parallel_size}
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
        dtype="auto" if use_gpus() else "float32", enforce_eager=not use_gpus(),
        logprobs_mode="processed_logprobs")
    engine_sleep = SleepSchedule(engines, enabled=args.colocate_all)  # a recorded no-op where vLLM cannot sleep
    engine_sleep.start()  # before the models load into the memory the engines give back
    actor_pg = shared or make_placement_group(args.actor_num_workers, cpus, "actor")
    roles = {"actor": WorkerGroup(PolicyWorker, actor_pg, shares["actor"], cpus,
                                  (args, args.pretrain, True, total_actor_steps), role="actor"), "engines": engines}
    ref_pg = actor_pg if (args.colocate_actor_ref or args.colocate_all) else make_placement_group(
        args.ref_num_workers, cpus, "reference")
    if args.init_kl_coef > 0 or args.advantage_estimator == "grpo":
        roles["ref"] = WorkerGroup(PolicyWorker, ref_pg, shares["reference"], cpus, (args, args.pretrain, False, 0),
                                   role="reference")
    critic_pg = shared or make_placement_group(args.critic_num_workers, cpus, "critic") if use_critic else None
    if use_critic:
        roles["critic"] = WorkerGroup(CriticWorker, critic_pg, shares["critic"], cpus,
                                      (args, critic_path, True, total_actor_steps), role="critic")
    roles["rewards"] = []
    for i, path in enumerate(reward_paths):
        pg = critic_pg if (args.colocate_critic_reward and critic_pg) else (
            shared or make_placement_group(args.reward_num_workers, cpus, "reward"))
        roles["rewards"].append(WorkerGroup(CriticWorker, pg, shares["reward model"], cpus, (args, path, False, 0),
                                            role=f"reward model {i + 1}"))
    engine_sleep.trainers = [roles[name] for name in ("actor", "ref", "critic") if name in roles] + roles["rewards"]
    roles["engine_sleep"] = engine_sleep
    return roles


def role_shares(args: Args) -> dict[str, float]:
    """The share of its bundle (a GPU, or --cpus_per_worker CPUs) that each worker of a role asks Ray for."""
    from common.vllm_engine import COLOCATED_GPU_SHARE

    share = 0.2 if args.colocate_all else (0.5 if args.colocate_actor_ref else 1.0)
    beside_critic = 0.5 if args.colocate_critic_reward else share
    return {"actor": share, "reference": share, "critic": beside_critic, "reward model": beside_critic,
            "vLLM": COLOCATED_GPU_SHARE if args.colocate_all else 1.0}


def check_colocation(args: Args, shares: dict[str, float]) -> None:
    """Refuse, before anything is placed, roles colocated on one bundle that ask for more than all of it: Ray would
    start the first ones and leave the last pending forever (e.g. --colocate_critic_reward with 2 reward models)."""
    uses = {"reference": args.init_kl_coef > 0 or args.advantage_estimator == "grpo",
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
    """Every model reads the actor's token ids, so every tokenizer must be the actor's."""
    from common.deepspeed_utils import load_tokenizer

    for flag, path in [("--reward_pretrain", p) for p in args.reward_pretrain or []] + [
            ("--critic_pretrain", args.critic_pretrain)]:
        if path:
            rewards.check_same_tokenizer(tokenizer, load_tokenizer(path, flag), f"--pretrain {args.pretrain}",
                                         f"{flag} {path}")


# ------------------------------------------------------------------------------------------------------- main
def main(args: Args):
    from common.deepspeed_utils import load_tokenizer

    for name in ("pretrain", "output_dir", "critic_pretrain", "ckpt_dir"):  # workers may not share our cwd
        if getattr(args, name) and os.path.exists(getattr(args, name)):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    args.reward_pretrain = [os.path.abspath(p) if os.path.exists(p) else p for p in args.reward_pretrain or []]
    check_args(args)
    if args.dry_run:
        groups = memory_plan.plan(args)
        print(memory_plan.describe(args, groups))
        memory_plan.check(args, groups)
        print("the plan fits.")
        return
    reward_fn = rewards.load_reward_fn(args.reward_fn) if args.reward_fn else None
    tokenizer = load_tokenizer(args.pretrain)
    check_tokenizers(args, tokenizer)
    prompts = load_prompts(args, tokenizer, args.prompt_data, args.prompt_split)
    eval_prompts = load_prompts(args, tokenizer, args.eval_prompt_data, "test") if args.eval_prompt_data else []
    ptx_samples = None
    if args.ptx_data:
        from common.data import build_sft_samples

        ptx_samples = build_sft_samples(load_records(args.ptx_data), tokenizer, args.ptx_data, args.ptx_key, "",
                                        args.prompt_max_len + args.generate_max_len, pretrain_mode=True)
    rollout = args.rollout_batch_size * args.n_samples_per_prompt
    total_actor_steps = args.max_steps * args.max_epochs * rollout // args.train_batch_size

    start_ray(args)
    if use_gpus():
        memory_plan.preflight(args)
    roles = place_roles(args, total_actor_steps)
    actor, critic, ref, engines = roles["actor"], roles.get("critic"), roles.get("ref"), roles["engines"]
    engine_sleep = roles["engine_sleep"]
    wait(actor.call("init_weight_sync", engines), SYNC_TIMEOUT.total_seconds(),
         "actor rank 0 and the vLLM engines did not form their weight-sync group")
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "placement.json"), "w") as f:  # which Ray node each worker is on
        placement = {name: group.nodes for name, group in roles.items() if isinstance(group, WorkerGroup)}
        placement["rewards"] = [group.nodes for group in roles["rewards"]]
        placement["vllm"] = ray.get([engine.node_id.remote() for engine in engines])
        placement["vllm_pids"] = ray.get([engine.pid.remote() for engine in engines])
        json.dump(placement, f, indent=1)
    if ptx_samples:
        ray.get(actor.call("set_ptx_data", ptx_samples))

    ckpt_dir = args.ckpt_dir or os.path.join(args.output_dir, "checkpoints")
    kl_ctl = (tricks.AdaptiveKLController(args.init_kl_coef, args.kl_target, args.kl_horizon) if args.kl_target
              else tricks.FixedKLController(args.init_kl_coef))
    start_step = 0
    state_file = os.path.join(ckpt_dir, "driver_state.json")
    if os.path.exists(state_file):
        with open(state_file) as f:
            state = json.load(f)
        start_step = state["step"]
        kl_ctl.load_state_dict(state["kl_ctl"])
        trained = [actor] + ([critic] if critic else [])
        ray.get([r for g, name in zip(trained, ("actor", "critic")) for r in
                 g.call("load_state", os.path.join(ckpt_dir, name), start_step)])
        engine_sleep.before_sync()
        ray.get(actor.call("sync_weights", engines))
        print(f"resumed from {ckpt_dir} at step {start_step}")
    logger = MetricsLogger(args.output_dir, 0, vars(args), args.use_wandb, args.wandb_project,
                           resume_step=start_step)

    def save_checkpoint(step):
        trained = {"actor": actor, **({"critic": critic} if critic else {})}
        ray.get([r for name, g in trained.items() for r in
                 g.call("save_state", os.path.join(ckpt_dir, name), step)])
        with open(state_file + ".tmp", "w") as f:  # written last: this is what commits the step
            json.dump({"step": step, "kl_ctl": kl_ctl.state_dict()}, f)
        os.replace(state_file + ".tmp", state_file)

    def evaluate():
        engine_sleep.before_generate()
        outs = generate(engines, [p["ids"] for p in eval_prompts], 1, 0.0, 1.0, args.generate_max_len)
        engine_sleep.after_generate()
        batch = build_batch([p["ids"] for p in eval_prompts], outs, tokenizer.eos_token_id, tokenizer.pad_token_id)
        texts = [tokenizer.decode(o[0]["token_ids"], skip_special_tokens=True) for o in outs]
        total, parts = score(args, roles["rewards"], reward_fn, batch, [p["prompt"] for p in eval_prompts], texts,
                             [p["label"] for p in eval_prompts])
        with open(os.path.join(args.output_dir, "eval_samples.jsonl"), "w") as f:  # the latest eval, to read
            for p, text, reward in zip(eval_prompts, texts, total.tolist()):
                f.write(json.dumps({"prompt": p["prompt"], "response": text, "reward": reward}) + "\n")
        return {"eval/reward": total.mean(), **{"eval/" + k.split("/")[1]: v for k, v in parts.items()}}

    def engine_died(error, step):
        done = json.load(open(state_file))["step"] if os.path.exists(state_file) else None
        where = f"the checkpoint of step {done} in {ckpt_dir} is intact" if done else "no checkpoint was saved"
        raise UserError(f"{error} at step {step + 1}; {where}. Rerun the same command to resume.")

    bar = progress(args.max_steps, 0, "ppo", initial=start_step)
    for step in range(start_step, args.max_steps):
        timings, t0 = {}, time.time()
        # 1. rollouts from vLLM; the prompt order is a function of (seed, pass over the data), so resuming is exact
        per_pass = max(1, len(prompts) // args.rollout_batch_size)
        order = list(range(len(prompts)))
        random.Random(args.seed * 100_003 + step // per_pass).shuffle(order)
        start = (step % per_pass) * args.rollout_batch_size
        picked = [prompts[order[(start + i) % len(prompts)]] for i in range(args.rollout_batch_size)]
        try:
            engine_sleep.before_generate()
            outs = generate(engines, [p["ids"] for p in picked], args.n_samples_per_prompt, args.temperature,
                            args.top_p, args.generate_max_len)
            engine_sleep.after_generate()
        except EngineDied as e:
            engine_died(e, step)
        timings["time/generate"] = time.time() - t0

        # 2. experience: old log-probs, reference log-probs, values, rewards, all roles at once
        t0 = time.time()
        batch = build_batch([p["ids"] for p in picked], outs, tokenizer.eos_token_id, tokenizer.pad_token_id)
        prompt_texts = [p["prompt"] for p in picked for _ in range(args.n_samples_per_prompt)]
        labels = [p["label"] for p in picked for _ in range(args.n_samples_per_prompt)]
        responses = [tokenizer.decode(o["token_ids"], skip_special_tokens=True) for outs_i in outs for o in outs_i]
        micro = micro_rollout(args)  # shard() pads a batch that does not split evenly; gather() drops the padding
        old_ref = actor.call_sharded("logprobs", shard(batch, len(actor), micro))
        ref_ref = ref.call_sharded("logprobs", shard(batch, len(ref), micro)) if ref else None
        val_ref = critic.call_sharded("values", shard(batch, len(critic), micro)) if critic else None
        scores, reward_metrics = score(args, roles["rewards"], reward_fn, batch, prompt_texts, responses, labels)
        mask = batch["action_mask"]
        old_logprobs = gather(old_ref, rollout)
        ref_logprobs = gather(ref_ref, rollout) if ref else old_logprobs
        values = gather(val_ref, rollout) if critic else torch.zeros_like(old_logprobs)
        token_kl = tricks.kl_penalty(old_logprobs, ref_logprobs, args.kl_estimator)  # (batch, seq)
        advantages, returns = compute_advantages(args, scores, token_kl, values, mask, kl_ctl.value)
        kl = tricks.masked_mean(token_kl, mask, dim=-1)
        experience = {**batch, "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs, "values": values,
                      "advantages": advantages, "returns": returns}
        timings["time/make_experience"] = time.time() - t0

        # 3. train the actor and the critic at the same time, on their own workers
        t0 = time.time()
        micro = args.micro_train_batch_size
        fit_refs = actor.call_sharded("fit", shard(experience, len(actor), micro), kl_ctl.value, step)
        critic_refs = critic.call_sharded("fit", shard(experience, len(critic), micro)) if critic else []
        metrics = ray.get(fit_refs)[0]
        if critic_refs:
            metrics.update(ray.get(critic_refs)[0])
        timings["time/train"] = time.time() - t0

        # 4. send the new weights to vLLM
        t0 = time.time()
        engine_sleep.before_sync()
        try:
            sync = wait_for(actor.call("sync_weights", engines), engines, "the weight sync")[0]
        except EngineDied as e:
            engine_died(e, step)
        timings["time/weight_sync"] = time.time() - t0

        kl_ctl.update(kl.mean().item(), rollout)
        response_lengths = mask.sum(-1)
        metrics.update({
            "objective/scores": scores.mean(), "objective/kl": kl.mean(), "objective/kl_coef": kl_ctl.value,
            "objective/advantages": tricks.masked_mean(advantages, mask), "objective/returns": returns.sum(-1).mean(),
            "response/length": response_lengths.float().mean(),
            "response/truncated": sum(o["finish_reason"] == "length" for oi in outs for o in oi) / rollout,
            "vllm/logprob_diff": tricks.masked_mean((batch["vllm_logprobs"] - old_logprobs).abs(), mask),
            "weight_sync/bytes": sync.get("weight_sync/bytes", 0),
            "weight_sync/vllm_load": sync.get("weight_sync/load_seconds", 0),
            "perf/rollout_tokens_per_sec": response_lengths.sum() / timings["time/generate"],
            **reward_metrics, **timings})
        if eval_prompts and args.eval_steps and (step + 1) % args.eval_steps == 0:
            metrics.update(evaluate())
        logger.log(step + 1, metrics)
        bar.update(1)
        bar.set_postfix(score=f"{float(scores.mean()):.3f}", kl=f"{float(kl.mean()):.4f}")
        if args.save_steps and (step + 1) % args.save_steps == 0:
            save_checkpoint(step + 1)
    bar.close()

    final = evaluate() if eval_prompts else {}
    if final:
        logger.log(args.max_steps, final)
    ray.get(actor.call("save_model", args.output_dir))
    logger.close()
    print(f"saved the actor to {args.output_dir} after {args.max_steps} PPO steps"
          + "".join(f", {k} {float(v):.4f}" for k, v in final.items()))
    ray.shutdown()


# What the deepspeed launcher sets for a torch.distributed world of its own (deepspeed/launcher/launch.py).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")


def drives_the_run() -> bool:
    """`deepspeed ppo_ray.py` starts one process per GPU; Ray places every worker itself, so only the process of
    RANK 0 (or a plain `python ppo_ray.py`, which has no RANK) drives, and the others leave at once with exit code 0:
    the launcher stops every process as soon as one exits with another. The driver forgets the launcher's world, so
    that the Ray workers it starts, which inherit its environment, do not take it for theirs."""
    rank = os.environ.get("RANK", "0")
    if rank != "0":
        print(f"ppo_ray.py: launcher rank {rank} exits; the process of rank 0 drives the run, Ray starts the workers.")
        return False
    for key in LAUNCHER_VARIABLES:
        os.environ.pop(key, None)
    return True


if __name__ == "__main__":
    if drives_the_run():
        run_main(main, parse_args(Args))
