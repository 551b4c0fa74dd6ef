"""One DeepSpeed rank of a model as a Ray actor (ppo_ray.py's roles): load, log-probs, values, scores, save, weight
sync to vLLM, and the cutting of a batch into micro-batches.

The reference model and the reward models are this class as it is; ppo_ray.py's ActorWorker and CriticWorker add
their `fit`, the PPO update. A scalar-head model (critic, reward model) loads as AutoModelForSequenceClassification
with one label, a vision-language one with common/vlm.py's scalar head, reading each row's images.
"""

import random

import torch
from transformers import AutoModelForSequenceClassification

from common import lora, prompt_sharing, rewards, routing_replay
from common.args import check_packing
from common.checkpoint import load_train_state, save_hf_model, save_train_state
from common.data import generation_stop_ids
from common.deepspeed_utils import (device, ds_config, init_distributed, init_eval_engine, init_train_engine,
                                    load_model, load_tokenizer, trained_zero_stage)
from common.modeling import (entropy_from_logits, next_token_logits, pack_rows, packed_token_values, response_start,
                             scalar_head_parts, sequence_rewards, token_logprobs, token_values, unpack,
                             unpack_next_token, within_sampling_support)
from common.ray_workers import RayWorker
from common.vlm import (forward_images, freeze_vision_tower, frozen_tower_names, is_image_input,
                        is_vision_language, load_processor, placeholder_token_ids)
from common.weight_sync import (broadcast_weights_to_vllm, in_checkpoint_layout, init_weight_sync_group,
                                iter_gathered_params)


def micro_rollout(args) -> int:
    """Rows per forward pass of the experience phase (--micro_rollout_batch_size, else --micro_train_batch_size)."""
    return args.micro_rollout_batch_size or args.micro_train_batch_size


def train_or_eval_config(args, world_size: int, trainable: bool) -> dict:
    """The DeepSpeed config of a trained role, or of a frozen one (always ZeRO-3, optionally offloaded)."""
    if trainable:
        stage = trained_zero_stage(args.zero_stage, world_size, args.offload_optimizer, args.load_in_4bit)
        return ds_config(stage, args.train_batch_size, args.micro_train_batch_size, world_size,
                         args.grad_clip, args.offload_optimizer)
    return ds_config(3, micro_rollout(args) * world_size, micro_rollout(args), world_size,
                     offload_params=args.ref_offload, train=False)


# ------------------------------------------------------------------------------------------- micro-batch cutting
def split(batch: dict, size: int, shuffle_seed: int | None = None, sort_rows: int | None = None,
          by_prompt: bool = False) -> list[dict]:
    """Micro-batches of `size` rows on this worker's device, trimmed of right padding no row in them needs.

    shuffle_seed shuffles the rows first (each PPO epoch anew); sort_rows sorts each run of that many rows (an
    optimizer step's) by length, so that short rows share micro-batches and pad less. by_prompt (--share_prompts)
    shuffles whole groups of rows sharing a prompt instead and keeps each group together.
    """
    order = list(range(len(batch["input_ids"])))
    if by_prompt:
        order = prompt_sharing.group_order(batch, shuffle_seed)
    elif shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    if sort_rows and not by_prompt:
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
        if value.dim() >= 2 and not is_image_input(key):  # (rows, seq or seq - 1, ...)
            value = value[:, : length if value.shape[1] == batch["input_ids"].shape[1] else length - 1]
        mb[key] = value.to(device())
    return mb


def in_length_order(batch: dict, size: int, forward, width: int | None = None, by_prompt: bool = False) -> torch.Tensor:
    """forward(micro-batch) over micro-batches of `size` rows taken shortest first (by_prompt: group after group of
    rows sharing a prompt, for --share_prompts); the results back in the batch's row order, on CPU, a (rows, seq)
    result zero-padded to `width` columns."""
    order = (torch.tensor(prompt_sharing.group_order(batch)) if by_prompt
             else torch.argsort(batch["attention_mask"].sum(1), stable=True))
    outputs = [forward(micro_batch(batch, order[i: i + size].tolist())) for i in range(0, len(order), size)]
    if width is not None:
        outputs = [torch.nn.functional.pad(o, (0, width - o.shape[1])) for o in outputs]
    return torch.cat(outputs).cpu()[torch.argsort(order)]


# ------------------------------------------------------------------------------------------------------ the rank
class ModelWorker(RayWorker):
    """One rank of a model: the reference or a reward model as it is, the actor and critic with their `fit`."""

    routes_from_vllm = True  # the policy's forwards take the experts vLLM chose (common/routing_replay.py)
    replay = None  # their routing_replay.Replay, made at the first batch that carries routes
    processor, placeholders = None, []  # a vision-language model's processor and image placeholder tokens
    shared_checked = False  # whether --share_prompts' first micro-batch was compared with the padded forward

    def setup(self, args, path: str, total_steps: int | None = None, learning_rate: float = 0.0,
              scalar_head_flag: str | None = None):
        """Load `path` as this rank's share of a ZeRO model: trained when `total_steps` is given, else frozen; with
        `scalar_head_flag` (the flag that named it) as a model with a scalar head."""
        trainable = total_steps is not None
        if args.packing_samples and scalar_head_flag != "--reward_pretrain":  # the reward models score padded rows
            # here, where the model loads: a driver on a CPU head node (--ray_address) sees neither CUDA nor flash-attn
            check_packing(path, scalar_head_flag or "--pretrain")
        self.args, self.ptx = args, None
        self.routes_from_vllm = trainable  # a frozen model (reference, teacher) routes by itself
        self.rank, self.world_size, self.local_rank = init_distributed()
        torch.manual_seed(args.seed)
        config = train_or_eval_config(args, self.world_size, trainable)
        head = ({"model_class": AutoModelForSequenceClassification, "num_labels": 1, "flag": scalar_head_flag}
                if scalar_head_flag else {})
        model = load_model(path, config, gradient_checkpointing=args.gradient_checkpointing and trainable,
                           **head, **(lora.load_kwargs(args) if trainable else {}))
        if getattr(args, "share_prompts", False) and not scalar_head_flag and model.config._attn_implementation not in (
                "sdpa", "eager"):  # its samples are kept apart by a mask, which flash-attention's kernels do not take
            model.set_attn_implementation("sdpa")
        if trainable:  # with --lora_rank: adapters on the frozen model (a critic's scalar head trains whole)
            model = lora.wrap(model, args, "SEQ_CLS" if scalar_head_flag else "CAUSAL_LM")
        # a vision-language model's processor is saved beside it; its tower (the critic's too) trains only where asked
        self.processor = load_processor(path) if is_vision_language(path) and not scalar_head_flag else None
        self.placeholders = placeholder_token_ids(model.config) if self.processor else []
        if is_vision_language(path) and trainable and args.freeze_vision_tower:
            freeze_vision_tower(model)
        self.tokenizer = load_tokenizer(path)
        if trainable:
            self.engine = init_train_engine(model, config, learning_rate, args.weight_decay, total_steps,
                                            args.warmup_ratio, args.min_lr_ratio, args.offload_optimizer)
        else:
            self.engine = init_eval_engine(model, config)
        if scalar_head_flag:
            config = scalar_head_parts(self.engine)[0].config
            if config.pad_token_id is None:  # transformers refuses a batch without one
                config.pad_token_id = self.tokenizer.pad_token_id

    def save_state(self, ckpt_dir: str, step: int) -> None:
        save_train_state({"model": self.engine}, ckpt_dir, step, {"step": step}, self.rank,
                         keep_last=None)  # pruned by the driver once it has committed the step

    def load_state(self, ckpt_dir: str, step: int) -> None:
        load_train_state({"model": self.engine}, ckpt_dir, self.rank, step)

    def save_model(self, out_dir: str) -> None:
        save_hf_model(self.engine, self.processor or self.tokenizer, out_dir, self.rank,
                      stop_ids=generation_stop_ids(self.tokenizer, self.args.apply_chat_template))

    # --- log-probs (policy, reference)
    def _logprobs(self, batch, with_entropy=False, share=True):
        """Log-probs of each next token at --temperature, (batch, seq - 1), and with_entropy each next-token
        distribution's entropy; 0 before the micro-batch's first response token, whose prompt needs no logits."""
        start = 0
        if share and self.args.share_prompts:  # each prompt computed once for its samples (prompt_sharing.py)
            return self._shared_logprobs(batch, with_entropy)
        if self.args.packing_samples:  # (1, total) each; no attention_mask: the restarting position_ids cut it
            input_ids, position_ids, index = pack_rows(batch["input_ids"], batch["attention_mask"])
            attention_mask = None
        else:
            input_ids, attention_mask, position_ids = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
            start = response_start(batch["action_mask"])
        routes = batch.get("routes") if self.routes_from_vllm else None  # (rows, seq, MoE layers, k)
        if routes is not None:  # in the order the routers take the tokens: the rows flattened, or packed
            routes = routes.flatten(0, 1)[index] if self.args.packing_samples else routes.flatten(0, 1)
        if routes is not None and self.replay is None:
            self.replay = routing_replay.Replay(self.engine)
        if self.replay:  # until the next forward: a checkpointed layer's recomputation routes as this forward did
            self.replay.set(routes, self.args.routing_replay)
        images = forward_images(self.engine, batch, packed=self.args.packing_samples)  # a VLM's, as the rows are
        logits = next_token_logits(self.engine, input_ids, attention_mask, position_ids, start, **images)
        logits = logits.float() / self.args.temperature  # the policy vLLM sampled from
        if self.placeholders:  # a vision-language model's image placeholders, which vLLM never samples (a softmax
            # of the float minimum is 0, where -inf would make the entropy NaN)
            logits = logits.index_fill(-1, torch.tensor(self.placeholders, device=logits.device),
                                       torch.finfo(logits.dtype).min)
        if self.args.keep_sampling_mask:  # and its top-p support, renormalised as vLLM did
            logits = within_sampling_support(logits, input_ids[:, start + 1:], self.args.top_p)
        outputs = [token_logprobs(logits, input_ids[:, start + 1:])]  # (rows, seq - 1 - start)
        if with_entropy:
            # Logged only at --entropy_coef 0: no graph, which would keep two fp32 (batch, seq, vocab) tensors
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.args.entropy_coef != 0):
                outputs.append(entropy_from_logits(logits))
        if self.args.packing_samples:
            outputs = [unpack_next_token(o, position_ids, index, batch["input_ids"].shape) for o in outputs]
        else:
            outputs = [torch.nn.functional.pad(o, (start, 0)) for o in outputs]  # (rows, seq - 1)
        return tuple(outputs) if with_entropy else outputs[0]

    def _shared_logprobs(self, batch, with_entropy=False):
        """_logprobs with each prompt computed once for the micro-batch's samples of it (common/prompt_sharing.py);
        the first call also runs the padded forward and stops the run if the two differ beyond rounding."""
        start = response_start(batch["action_mask"])
        if self.replay:  # the routes vLLM recorded are per row, not for the shared row: the routers route alone
            self.replay.set(None, False)
        logits = prompt_sharing.next_token_logits(self.engine, batch, start).float() / self.args.temperature
        if self.args.keep_sampling_mask:
            logits = within_sampling_support(logits, batch["input_ids"][:, start + 1:], self.args.top_p)
        outputs = [token_logprobs(logits, batch["input_ids"][:, start + 1:])]  # (rows, seq - 1 - start)
        if with_entropy:
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.args.entropy_coef != 0):
                outputs.append(entropy_from_logits(logits))
        outputs = [torch.nn.functional.pad(o, (start, 0)) for o in outputs]  # (rows, seq - 1)
        if not self.shared_checked:
            self.shared_checked = True
            with torch.no_grad():
                padded = self._logprobs(batch, share=False)
            float32 = next(self.engine.parameters()).dtype == torch.float32
            prompt_sharing.check_once(outputs[0].detach(), padded, batch["action_mask"], self.args.pretrain,
                                      1e-4 if float32 else 5e-2)
        return tuple(outputs) if with_entropy else outputs[0]

    @torch.no_grad()
    def logprobs(self, batch: dict) -> torch.Tensor:
        """Log-probs of each next token, (batch, seq - 1), in micro-batches of --micro_rollout_batch_size."""
        self.use_cpu_threads("experience")
        self.engine.eval()
        return in_length_order(batch, micro_rollout(self.args), self._logprobs, batch["action_mask"].shape[1],
                               self.args.share_prompts)

    @torch.no_grad()
    def reference_logprobs(self, batch: dict) -> torch.Tensor:
        """With --lora_rank the reference is the actor's own frozen model, adapters off: no reference workers."""
        with lora.reference(self.engine):  # the frozen model routes by itself
            return self.logprobs({key: value for key, value in batch.items() if key != "routes"})

    def take_route_mismatch(self) -> dict:
        """moe/route_mismatch of the policy's forwards since the last call: the share of (token, MoE layer)
        decisions whose top-k experts differ from vLLM's (nothing for a dense model)."""
        if self.replay is None:
            return {}
        (differ, compared), self.replay.counts = self.replay.counts, [0, 0]
        return {"moe/route_mismatch": differ / compared} if compared else {}

    # --- scalar heads (critic, reward models)
    def _normalizes(self) -> bool:
        """Scores and values on the normalised reward scale: a model rm.py saved carries its reward mean and std; a
        fresh head (a critic from --pretrain) has none and learns the scale itself."""
        return self.args.normalize_reward and rewards.reward_model_normalizes(self.engine.module)

    def _values(self, batch: dict) -> torch.Tensor:
        """The value at each position that predicts a next token, (batch, seq - 1), aligned with the log-probs."""
        images = forward_images(self.engine, batch, packed=self.args.packing_samples)  # a VLM critic reads them
        if not self.args.packing_samples:
            return token_values(self.engine, batch["input_ids"], batch["attention_mask"], self._normalizes(),
                                **images)[:, :-1]
        input_ids, position_ids, index = pack_rows(batch["input_ids"], batch["attention_mask"])  # (1, total) each
        values = packed_token_values(self.engine, input_ids, position_ids, self._normalizes(), **images)  # (1, total)
        return unpack(values, index, batch["input_ids"].shape)[:, :-1]

    @torch.no_grad()
    def values(self, batch: dict) -> torch.Tensor:
        self.use_cpu_threads("experience")
        self.engine.eval()
        return in_length_order(batch, micro_rollout(self.args), self._values, batch["action_mask"].shape[1])

    @torch.no_grad()
    def scores(self, batch: dict) -> torch.Tensor:
        """A reward model's score of each of rewards.reward_model_batch's rows, read at its last token, (batch,); a
        vision-language one's with the rows' images."""
        self.use_cpu_threads("experience")
        self.engine.eval()
        return in_length_order(batch, micro_rollout(self.args), lambda mb: sequence_rewards(
            self.engine, mb["input_ids"], mb["attention_mask"], self._normalizes(), **forward_images(self.engine, mb)))

    # --- weight sync (actor)
    def init_weight_sync(self, engines: list) -> None:
        self.sync_group = init_weight_sync_group(engines) if self.rank == 0 else None

    def sync_weights(self, engines: list, everything_quantized: bool = False) -> dict:
        """Every rank gathers ZeRO-3 shards (collective); rank 0 broadcasts them to the engines in buckets. With LoRA
        only the adapted layers change, sent merged, W + (alpha / r) B A; `everything_quantized` adds every 4-bit
        layer, dequantized (QLoRA's first sync). A frozen vision tower is not sent: the engines hold it as loaded."""
        frozen = frozen_tower_names(self.engine) if self.processor else set()
        params = (in_checkpoint_layout(lora.base_model(self.engine),
                                       lora.iter_merged_params(self.engine, everything_quantized))
                  if self.args.lora_rank else iter_gathered_params(self.engine, skip=frozen))
        if self.rank == 0:
            return broadcast_weights_to_vllm(params, engines, self.sync_group, complete=not self.args.lora_rank,
                                             tower_kept=bool(frozen))
        for _ in params:
            pass
        return {}
