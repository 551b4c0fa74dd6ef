"""Routing replay for mixture-of-experts policies (R3, "rollout routing replay"): the experts vLLM routed each token
to travel with the experience, and the trainer's MoE layers use them.

The engine and the trainer route a token by the top-k of router logits that their kernels compute a little
differently; where two experts score within rounding of each other they pick different ones, and the token's
log-prob then differs by far more than rounding (Megatron-LM #4168: ~10% of Qwen3-30B-A3B's router decisions
between engines). Replay makes the trainer score the experts that the sampler used: it forces each token's top-k
indices to vLLM's, and recomputes their gate weights from its own router logits (the router's own normalisation
runs on them), so the router still learns through the weights. `moe/route_mismatch`, the share of (token, MoE
layer) decisions whose top-k set the trainer would have chosen differently, is measured with or without replay.

Engine side. vLLM 0.32 hands back routed experts (`enable_return_routed_experts`) only with its Model Runner V2,
which needs Triton and so does not run on CPU; the capture here hooks the routers of vLLM's MoE layers instead
(BaseRouter.set_capture_fn, vLLM's own capture point) and files each step's top-k ids under the request and
position of its tokens, read from the model runner's batch layout. `start_capture` and `take_routes` run on the
worker through `collective_rpc`. Under --routing_replay prefix caching is off (`engine_kwargs`): a token whose
KV came from the cache is not routed again, and its route would be missing; and on GPUs the engine runs eagerly
(placement.py), since a CUDA graph replays without calling the capture. Without --routing_replay an MoE engine keeps
both, and tokens without a route (NO_ROUTE) are left out of moe/route_mismatch.

Trainer side. transformers 5 routers (`...TopKRouter` modules, 29 families, and DeepSeek-V2/V3's and GLM-4-MoE's
`...TopkRouter`, whose group choice is a top-k of its own that passes through) compute `torch.topk(probs, top_k)`
once; a `Replay` on the model runs each router's forward with that call answered by the forced indices and the
router's own probabilities at them. Hooks on modules work under ZeRO-3 and peft alike (the router's parameters are
gathered as for any forward).
"""

import contextlib
import json

import numpy as np
import torch

from common.args import UserError

TOPK = torch.topk  # torch's own, which a router's forward gets back when it ends

# A route that is not known (the last token of a sequence, which vLLM never feeds back; padding): the trainer's own.
NO_ROUTE = -1


def mixture_of_experts(path: str) -> bool:
    """Whether the model at `path` routes tokens to experts, from its config.json (a wrapper's text_config too)."""
    from common.args import config_file

    file = config_file(path)
    if file is None:
        return False
    with open(file) as f:
        config = json.load(f)
    config = {**config, **(config.get("text_config") or {})}
    return (config.get("num_experts_per_tok") or 0) > 0 or (config.get("moe_topk") or 0) > 0


def check_flags(args) -> None:
    """ppo_ray.py's --routing_replay where it cannot apply, in one sentence."""
    if not args.routing_replay:
        return
    if not mixture_of_experts(args.pretrain):
        raise UserError(f"--routing_replay replays the experts vLLM routed each token to, and --pretrain "
                        f"{args.pretrain} is a dense model (no num_experts_per_tok in its config); leave it out.")
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # the model's modules without memory
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.pretrain))
    if not trainer_routers(model):
        raise UserError(f"--routing_replay forces the top-k of transformers' `TopKRouter` modules, and --pretrain "
                        f"{args.pretrain}'s {type(model).__name__} routes without one; leave the flag out.")
    if args.gradient_checkpointing and args.ptx_data:
        raise UserError("--routing_replay with --gradient_checkpointing and --ptx_data: one backward pass recomputes "
                        "the policy's layers and the pretraining text's, and a router cannot tell which it routes; "
                        "leave out one of the three.")


# ------------------------------------------------------------------------------------------------ engine side
def _moe_routers(model) -> list:
    """The routers of vLLM's MoE layers, in layer order."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return [m.router for m in model.modules() if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)]


def start_capture(worker) -> int:
    """Hook the worker's model runner so that every forward step files its MoE routers' top-k ids per request;
    returns the number of MoE layers (0: a dense model, nothing hooked). Called once, through collective_rpc."""
    runner = worker.model_runner
    if not _moe_routers(runner.get_model()):
        return 0
    worker.routes_by_request = {}  # request id -> [(positions (n,), top-k ids (n, layers, k))]
    forward = runner._model_forward

    def forward_and_file(*args, positions=None, **kwargs):
        # bound anew each step: a weight reload may rebuild the layers, and their routers with them
        routers = _moe_routers(runner.get_model())
        step_routes = [None] * len(routers)
        for layer, router in enumerate(routers):
            router.set_capture_fn(lambda ids, layer=layer: step_routes.__setitem__(layer, ids.to("cpu", copy=True)))
        output = forward(*args, positions=positions, **kwargs)
        if any(r is None for r in step_routes):  # a step that routed nothing (a dummy run)
            return output
        num_reqs = runner.input_batch.num_reqs
        starts = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        step = torch.stack([r[: starts[-1]] for r in step_routes], dim=1).to(torch.int16)  # (tokens, layers, k)
        where = positions[: starts[-1]].to("cpu", copy=True)  # the runner reuses its buffer
        for i, request in enumerate(runner.input_batch.req_ids[:num_reqs]):
            worker.routes_by_request.setdefault(request, []).append(
                (where[starts[i]: starts[i + 1]], step[starts[i]: starts[i + 1]]))
        return output

    runner._model_forward = forward_and_file
    return len(_moe_routers(runner.get_model()))


def take_routes(worker) -> dict:
    """The routes filed since the last call, {request id: (tokens, layers, k) int16 array by position}, forgotten
    here. A position filed twice (a preempted request recomputed) keeps its last route."""
    routes = {}
    for request, pieces in worker.routes_by_request.items():
        positions = torch.cat([p for p, _ in pieces])
        ids = torch.cat([r for _, r in pieces])
        by_position = torch.full((int(positions.max()) + 1, *ids.shape[1:]), NO_ROUTE, dtype=torch.int16)
        by_position[positions] = ids
        routes[request] = by_position.numpy()
    worker.routes_by_request = {}
    return routes


def engine_kwargs() -> dict:
    """vllm.LLM arguments of an engine whose routes are captured: every token routed where it is computed."""
    return {"enable_prefix_caching": False}


def attach_routes(outputs, routes: dict) -> list:
    """Each completion's routes, (fed tokens, layers, k) int16 with fed tokens = prompt + response - 1 (the last
    sampled token is never fed back), NO_ROUTE where the engine routed none (a prefix-cache hit). A completion of
    vLLM's request "r" was computed as "r" (n = 1) or "<index>_r" (n > 1), to which vLLM appends "-<suffix>"."""
    if not routes:  # nothing was computed (every token a prefix-cache hit)
        return []
    by_request = {request.rsplit("-", 1)[0]: array for request, array in routes.items()}
    shape = next(iter(routes.values())).shape[1:]
    result = []
    for output in outputs:
        per_sample = []
        for completion in sorted(output.outputs, key=lambda c: c.index):
            key = output.request_id if len(output.outputs) == 1 else f"{completion.index}_{output.request_id}"
            fed = len(output.prompt_token_ids) + len(completion.token_ids) - 1
            array = np.full((fed, *shape), NO_ROUTE, dtype=np.int16)
            known = by_request.get(key, array)[:fed]
            array[: len(known)] = known
            per_sample.append(array)
        result.append(per_sample)
    return result


def extend_routes(kept: np.ndarray | None, turn: np.ndarray) -> np.ndarray:
    """An episode's routes after one more turn (common/multi_turn.py), (fed tokens, layers, k): each token keeps the
    route of the turn that first computed it, under which that turn's response was sampled, and the turn adds the
    routes of the tokens it fed first (the previous turn's last token, the environment's reply, its own response).
    A later turn feeds the earlier tokens again (prefix caching is off under --routing_replay) and routes them alike
    up to rounding, where an engine with prefix caching would reuse the first turn's computation outright."""
    return turn if kept is None else np.concatenate([kept, turn[len(kept):]])


# ------------------------------------------------------------------------------------------------ trainer side
def trainer_routers(model) -> list:
    """The routers of a transformers model's MoE layers, in layer order: modules that choose `top_k` of
    `num_experts` experts by torch.topk (transformers 5's `<Family>TopKRouter`)."""
    return [m for m in model.modules()  # DeepSeek-V3 and GLM-4-MoE spell it TopkRouter
            if type(m).__name__.lower().endswith("topkrouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def batch_routes(samples: list[list[dict]], length: int) -> torch.Tensor | None:
    """The routes of build_batch's rows, (batch, seq, layers, k) int16, NO_ROUTE past each row's fed tokens; None
    when the engine captured none (a dense model)."""
    routes = [s.get("routes") for group in samples for s in group]
    if not routes or routes[0] is None:
        return None
    batch = torch.full((len(routes), length, *routes[0].shape[1:]), NO_ROUTE, dtype=torch.int16)
    for i, row in enumerate(routes):
        batch[i, : len(row)] = torch.from_numpy(row)
    return batch


class Replay:
    """Hooks on a model's routers that answer each forward's top-k with `routes`, (tokens, layers, k) for the tokens
    of the forward in the order the routers take them (the batch flattened, or packed), set before it with `set`.
    Every router counts into `counts` [decisions that differ from the routes, decisions compared] over tokens whose
    route is known, and with `force` picks the routes' experts, weighted by its own probabilities of them. The hooks
    stay on the model: a backward pass that recomputes a checkpointed layer (--gradient_checkpointing) routes it as
    its forward did. Without routes (None), or a forward of another number of tokens, the routers route by
    themselves."""

    def __init__(self, model):
        self.routes, self.force, self.counts = None, False, [0, 0]
        self.routers = trainer_routers(model)
        self.handles = []
        for layer, router in enumerate(self.routers):
            self.handles += [router.register_forward_pre_hook(lambda m, a, layer=layer: self._patch(m, layer)),
                             router.register_forward_hook(lambda m, a, out: self._restore())]

    def set(self, routes: torch.Tensor | None, force: bool) -> None:
        if routes is not None and self.routers and routes.shape[1] != len(self.routers):
            raise ValueError(f"the engine routed through {routes.shape[1]} MoE layers, the trainer's model has "
                             f"{len(self.routers)}: the engine and the trainer must run the same model")
        self.routes, self.force = routes, force

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _patch(self, router, layer: int) -> None:
        routes = self.routes

        def topk(input, k, dim=-1, largest=True, sorted=True):
            own = TOPK(input, k, dim=dim, largest=largest, sorted=sorted)
            if (routes is None or k != router.top_k or input.shape[-1] != router.num_experts
                    or input.shape[0] != routes.shape[0]):
                return own  # another top-k of the router (a group choice), or a forward that is not the batch's
            given = routes[:, layer].to(device=input.device, dtype=torch.long)  # (tokens, k)
            known = (given >= 0).all(-1)
            differs = (given.sort(-1).values != own.indices.sort(-1).values).any(-1) & known
            self.counts[0] += int(differs.sum())
            self.counts[1] += int(known.sum())
            if not self.force:
                return own
            indices = torch.where(known[:, None], given, own.indices)
            return torch.return_types.topk((input.gather(-1, indices), indices))

        torch.topk = topk

    def _restore(self) -> None:
        torch.topk = TOPK


@contextlib.contextmanager
def replaying(model, routes: torch.Tensor | None, force: bool):
    """A Replay of `routes` for the forwards within it; yields its counts."""
    replay = Replay(model)
    try:
        replay.set(routes, force)
        yield replay.counts
    finally:
        replay.remove()
