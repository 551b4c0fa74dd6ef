"""The rollout side of ppo_ray.py's loop, one object the loop calls: which prompts a step asks, vLLM's responses to
them (one turn, or multi-turn episodes), seeded per prompt; DAPO's dynamic sampling; --async_rollouts' generation one
step ahead, cut at the step boundary with --partial_rollouts (common/partial_rollouts.py); and the weight sync that
keeps the engines on the policy each generation needs.

train() asks `Rollouts.next(step)` for a step's samples and `Rollouts.sync(step)` for the new policy in the engines:
whether the samples were drawn now or during the last update, and when the engines take which weights, is decided
here, so the loop reads the same with and without --async_rollouts.
"""

import functools
import hashlib
import random

import torch

from common import multi_turn, rewards
from common import ppo_tricks as tricks
from common.agents import AgentEndpoint, agent_function
from common.logging_utils import timed
from common.partial_rollouts import PartialRollouts
from common.vllm_engine import collect, generate, start_generate, wait_for
from common.vlm import engine_prompts, image_token_id, policy_processor


def step_prompts(args, prompts: list[dict], step: int) -> list[dict]:
    """This step's --rollout_batch_size prompts: passes over the data, each in an order fixed by (--seed, pass), so
    a resumed run picks the prompts the killed one would have."""
    per_pass = max(1, len(prompts) // args.rollout_batch_size)
    order = list(range(len(prompts)))
    random.Random(args.seed * 100_003 + step // per_pass).shuffle(order)
    start = (step % per_pass) * args.rollout_batch_size
    return [prompts[order[(start + i) % len(prompts)]] for i in range(args.rollout_batch_size)]


@functools.cache
def env_factory(spec: str):
    """--env_fn's make_env, loaded once."""
    return rewards.load_from_file(spec, "--env_fn")


def sample_seeds(args, step: int, stream: str, count: int) -> list[int]:
    """One vLLM seed per prompt of a step's rollout, from (--seed, step, the prompt's place); sample j of prompt i
    draws from seeds[i] + j. A response then depends on the weights and these numbers alone, not on what the engine
    sampled before: a resumed run, or one with more engines, samples what an uninterrupted run samples. `stream`
    tells apart the rollout's other draws (a --dynamic_sampling round, an --env_fn turn)."""
    def seed(i: int) -> int:  # 56 bits: vLLM adds j, torch takes 64
        return int.from_bytes(hashlib.sha256(f"{args.seed}/{step}/{stream}/{i}".encode()).digest()[:7], "little")

    return [seed(i) for i in range(count)]


def generated_tokens(samples: list[list[dict]]) -> int:
    """The tokens vLLM sampled for these responses, cut ones included; of a multi-turn episode, the policy's."""
    return sum(sum(s["env_mask"]) if "env_mask" in s else len(s["token_ids"]) for group in samples for s in group)


def policy_lags(args) -> bool:
    """Whether a step may train on tokens an older policy sampled: with --async_rollouts, unless --partial_rollouts
    drops every token older than the policy it trains (--max_staleness 0)."""
    return args.async_rollouts and not (args.partial_rollouts and args.max_staleness == 0)


def sync_weights(cluster, everything_quantized: bool = False) -> dict:
    """The actor's weights to the vLLM engines (common/weight_sync.py); returns its bytes and vLLM's load time."""
    cluster.sleep.before_sync()
    sync = wait_for(cluster.actor.call("sync_weights", cluster.engines, everything_quantized), cluster.engines,
                    "the weight sync")[0]
    return {"weight_sync/bytes": sync.get("weight_sync/bytes", 0),
            "weight_sync/vllm_load": sync.get("weight_sync/load_seconds", 0)}


class Rollouts:
    """A run's rollouts from `start_step` on. `score(prompts, samples)` scores responses as the experience will
    (--dynamic_sampling keeps the prompts whose rewards differ); the engines hold the policy after `start_step`
    steps when it is made."""

    def __init__(self, args, cluster, prompts: list[dict], tokenizer, score, start_step: int):
        self.args, self.cluster, self.prompts, self.tokenizer, self.score = args, cluster, prompts, tokenizer, score
        self.engines_at = start_step  # the engines hold the policy after this many steps
        self.synced = {}  # the last sync's metrics, reported with the step that made it
        self.partial = PartialRollouts(args, cluster.engines) if args.partial_rollouts else None
        self.draws = start_step  # --partial_rollouts: the rollout steps whose prompts joined its pool so far
        self.ahead = self.start(start_step) if args.async_rollouts and not self.partial else None
        self.processor = policy_processor(args.pretrain)  # a vision-language policy's: its requests carry images
        self.agents = (AgentEndpoint(tokenizer, args.generate_max_len, args.prompt_max_len, args.agent_timeout,
                                     self.processor)
                       if args.agent_fn else None)  # --agent_fn's OpenAI-compatible endpoint (common/agents.py)

    def next(self, step: int, timings: dict) -> tuple[list[dict], list[list[dict]], tuple | None]:
        """This step's prompts, vLLM's responses to them, and with --dynamic_sampling their scores and metrics.
        With --async_rollouts they were sampled during the last update; the idle engines then take this step's
        policy (one step of lag) and start on the next step's prompts."""
        if self.partial:
            return self.take_partial(step, timings)
        with timed(timings, "time/generate"):
            if not self.args.async_rollouts:
                return self.sample(step)
            picked, samples = self.ahead[0], collect(self.cluster.engines, self.ahead[1])
        with timed(timings, "time/weight_sync"):
            self.synced = self.sync_to(step)
        self.ahead = self.start(step + 1) if step + 1 < self.args.max_steps else None
        return picked, samples, None

    def take_partial(self, step: int, timings: dict) -> tuple[list[dict], list[list[dict]], None]:
        """--partial_rollouts' next(): the generation ahead stops after its chunk, the engines take this step's
        policy, the step takes its samples from the pool (common/partial_rollouts.py), and the engines go on with
        the rest of the pool meanwhile. The first step samples its prompts here, as the synchronous loop does."""
        with timed(timings, "time/generate"):
            self.partial.pause()  # the wait for the chunk under way
        waited = timings["time/generate"]
        with timed(timings, "time/weight_sync"):
            self.synced = self.sync_to(step)
        self.fill_pool()
        with timed(timings, "time/generate"):
            picked, samples, metrics = self.partial.take(step, self.args.rollout_batch_size)
        timings["time/generate"] += waited
        self.synced.update(metrics)
        if step + 1 < self.args.max_steps:
            self.fill_pool()
            self.partial.run_ahead(self.engines_at)
        return picked, samples, None

    def fill_pool(self) -> None:
        """Rollout steps' prompts join --partial_rollouts' pool, a step's at a time with that step's seeds, while it
        has room for them (partial_rollouts.PartialRollouts.capacity)."""
        size = self.args.rollout_batch_size
        while len(self.partial.pool) + size <= self.partial.capacity:
            self.partial.add(step_prompts(self.args, self.prompts, self.draws),
                             sample_seeds(self.args, self.draws, "", size))
            self.draws += 1

    def sync(self, step: int, timings: dict) -> dict:
        """After step `step`'s update: the new policy to the engines (with --async_rollouts that waits for the next
        step), and the metrics of the sync this step made."""
        if not self.args.async_rollouts:
            with timed(timings, "time/weight_sync"):
                self.synced = self.sync_to(step + 1)
        synced, self.synced = self.synced, {}
        return synced

    def sync_to(self, to_step: int) -> dict:
        """sync_weights, once a generation under way has finished (--partial_rollouts: paused), unless the engines
        have `to_step`'s policy."""
        if self.partial:
            self.partial.pause()
        if self.engines_at == to_step:
            return {}
        if self.ahead:
            collect(self.cluster.engines, self.ahead[1])
        self.engines_at = to_step
        return sync_weights(self.cluster)

    def start(self, step: int) -> tuple[list[dict], list]:
        """--async_rollouts: this step's prompts, and the engines' responses to them under way (`collect` them)."""
        picked = step_prompts(self.args, self.prompts, step)
        ids, images = engine_prompts(picked)
        return picked, start_generate(self.cluster.engines, ids, self.args.n_samples_per_prompt,
                                      self.args.temperature, self.args.top_p, self.args.generate_max_len,
                                      sample_seeds(self.args, step, "", len(picked)), images)

    def respond(self, prompts: list[dict], n: int, temperature: float,
                seeded: tuple[int, str] | None = None) -> list[list[dict]]:
        """vLLM's n responses to each prompt, or with --env_fn n multi-turn episodes of each (common/multi_turn.py),
        or with --agent_fn n runs of the user's agent (common/agents.py); colocated engines are awake only meanwhile.
        `seeded`: the (step, stream) of sample_seeds (None: greedy)."""
        args, cluster = self.args, self.cluster
        cluster.sleep.before_generate()

        def one_request(requests: list[dict], limits: list[int], seeds: list[int] | None) -> list[dict]:
            ids, images = engine_prompts(requests)  # an image prompt's placeholders, with its images
            return [s[0] for s in generate(cluster.engines, ids, 1, temperature, args.top_p, limits, seeds, images)]

        if args.env_fn:
            turns = iter(range(args.max_turns))

            def one_turn(requests: list[dict], limits: list[int]) -> list[dict]:
                seeds = (sample_seeds(args, seeded[0], f"{seeded[1]}turn{next(turns)}", len(requests)) if seeded
                         else None)
                return one_request(requests, limits, seeds)

            samples = multi_turn.run_episodes(one_turn, env_factory(args.env_fn), self.tokenizer, prompts, n,
                                              args.max_turns, args.generate_max_len, args.apply_chat_template,
                                              args.input_template, args.prompt_max_len, args.reward_timeout,
                                              [image_token_id(self.processor)] if self.processor else [])
        elif args.agent_fn:
            def seed_of(episode: int, request: int) -> int:
                return sample_seeds(args, seeded[0], f"{seeded[1]}agent{episode}/{request}", 1)[0]

            samples = self.agents.run_episodes(agent_function(args.agent_fn), prompts, n, one_request,
                                               seed_of if seeded else None)
        else:
            ids, images = engine_prompts(prompts)  # a vision-language policy's prompts: with their images
            samples = generate(cluster.engines, ids, n, temperature, args.top_p, args.generate_max_len,
                               sample_seeds(args, *seeded, len(prompts)) if seeded else None, images)
        cluster.sleep.after_generate()
        return samples

    def sample(self, step: int) -> tuple[list[dict], list[list[dict]], tuple | None]:
        """This step's prompts and vLLM's responses to them, sampled now; with --dynamic_sampling also their scores.

        DAPO's dynamic sampling (Yu et al. 2025): a prompt whose responses all got the same reward has zero
        advantages under a group baseline, so it is dropped and further prompts (fixed by seed, step and round) are
        sampled until --rollout_batch_size prompts with a spread are found or the rounds run out; dropped prompts
        fill what is missing. rewards/* are the step's own prompts' metrics; objective/scores is the trained batch's.
        """
        args, n, size = self.args, self.args.n_samples_per_prompt, self.args.rollout_batch_size
        picked = step_prompts(args, self.prompts, step)
        samples = self.respond(picked, n, args.temperature, (step, ""))
        if not args.dynamic_sampling:
            return picked, samples, None
        kept, dropped, first, generated = [], [], None, 0
        for round_ in range(args.dynamic_sampling_max_rounds):
            if round_:
                picked = random.Random(f"{args.seed}-{step}-{round_}").choices(self.prompts, k=size)
                samples = self.respond(picked, n, args.temperature, (step, f"round{round_}"))
            generated += generated_tokens(samples)
            scores, metrics = self.score(picked, samples)
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
