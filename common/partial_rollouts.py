"""--partial_rollouts: the generation --async_rollouts runs during an update is cut at the step boundary and goes on
under the new policy, instead of the step waiting for its slowest sample (the partial rollouts of Kimi k1.5, slime,
AReaL and OpenRLHF). Each token keeps the policy version that sampled it and vLLM's log-prob of it, and no token more
than --max_staleness versions older than the policy a step trains reaches that step's loss.

The engines generate ahead in chunks of at most --partial_chunk_tokens new tokens, one engine call a chunk from a
thread of the driver, so that "cut at the step boundary" is "stop after the current chunk". A sample under way goes
on as a new request whose prompt is the prompt and the tokens sampled so far (token ids, never text), under whatever
weights the engines hold then; an image prompt's request carries its images, its placeholders followed by the tokens
(common/vlm.py `continued`), so that vLLM goes on reading the image the sample started from. The old log-probs and
the decoupled-PPO weights of ppo_ray.py's experience already work token by token against vLLM's log-probs, so a
sample whose tokens come from two policies is corrected for each.

The pool holds the prompts of up to max(1, --max_staleness) rollout steps (pool_capacity; Rollouts.fill_pool in
common/rollout.py draws them, each step's with its own seeds), all generated at once. A step, after the weight sync
that gives the engines its policy:
  1. empties every sample that holds a token sampled more than --max_staleness versions ago (partial/dropped), to be
     sampled again from its start;
  2. if fewer than --rollout_batch_size prompts have all their samples finished, finishes the oldest unfinished
     ones, each sample to its end in one call, under the policy the step trains;
  3. trains on the --rollout_batch_size oldest finished prompts; the others stay in the pool (partial/in_flight),
     which the next steps' prompts fill up again, and the engines go on with them during the update.
With --max_staleness 0 the pool holds one step's prompts, every token sampled ahead is dropped, and step 2 samples
them with the synchronous loop's seeds in the synchronous loop's one call: the run is the synchronous run
(docs/equivalence.md). With a bound of 1 or more, which samples a boundary cuts depends on how fast the engines went:
such a run is not repeatable bit for bit.
"""

import hashlib
import threading

from common.vllm_engine import collect, start_generate
from common.vlm import continued, engine_prompts


def staleness_bound(args) -> int:
    """--max_staleness, 1 when not given."""
    return 1 if args.max_staleness is None else args.max_staleness


def pool_capacity(args) -> int:
    """The prompts under way at once: max(1, bound) rollout steps' worth, as many as a token sampled now may still
    be trained in (AReaL bounds the samples in flight likewise). The engines then generate ahead for later steps, so
    that a step finds enough prompts finished without waiting for the longest samples, while the prompts drawn last,
    behind bound - 1 steps' worth, are still trained on within the bound if they finish at once. (A pool of
    1 + bound steps' worth dropped a step's worth of finished prompts every other step at a bound of 1.)"""
    return max(1, staleness_bound(args)) * args.rollout_batch_size


def empty_sample() -> dict:
    """A sample with nothing generated yet; `versions[t]` is the policy version (PPO steps taken) that sampled
    token_ids[t], whose log-prob under that policy is logprobs[t]; finish_reason stays None until it ends."""
    return {"token_ids": [], "logprobs": [], "versions": [], "finish_reason": None}


def continuation_seed(seed: int, sample: int, offset: int) -> int:
    """The vLLM seed of the request that goes on with sample `sample` of a prompt seeded `seed` after `offset`
    tokens. At offset 0 it is vLLM's own rule for sample j of an n-sample request, seed + j, so that a sample drawn
    again from its start draws what it would have drawn with its siblings."""
    if not offset:
        return seed + sample
    return int.from_bytes(hashlib.sha256(f"{seed}/{sample}/{offset}".encode()).digest()[:7], "little")


class Group:
    """One prompt's n samples, finished or under way, and the seed its rollout step gave it."""

    def __init__(self, prompt: dict, seed: int, n: int):
        self.prompt, self.seed = prompt, seed
        self.samples = [empty_sample() for _ in range(n)]

    def finished(self) -> bool:
        return all(s["finish_reason"] for s in self.samples)

    def requests(self, limit) -> list[tuple]:
        """(request, samples, max tokens, seed, the sample indices it answers) for each request that goes on with
        this group, the request the prompt and a sample's tokens so far (vlm.continued): one n-sample request while
        nothing is generated, as the synchronous loop asks it, else one for each unfinished sample. `limit(tokens so
        far)` is a request's max tokens."""
        if not any(s["token_ids"] for s in self.samples):
            return [(continued(self.prompt, []), len(self.samples), limit(0), self.seed, range(len(self.samples)))]
        return [(continued(self.prompt, s["token_ids"]), 1, limit(len(s["token_ids"])),
                 continuation_seed(self.seed, j, len(s["token_ids"])), [j])
                for j, s in enumerate(self.samples) if not s["finish_reason"]]


class PartialRollouts:
    """The pool of prompts whose samples are under way, oldest first, and the thread that generates ahead."""

    def __init__(self, args, engines: list):
        self.args, self.engines = args, engines
        self.bound, self.capacity = staleness_bound(args), pool_capacity(args)
        self.chunk = args.partial_chunk_tokens or max(1, args.generate_max_len // 4)
        self.pool: list[Group] = []
        self.thread, self.stop, self.error = None, threading.Event(), None

    def add(self, prompts: list[dict], seeds: list[int]) -> None:
        """A rollout step's prompts join the pool, with that step's seeds (rollout.sample_seeds)."""
        self.pool += [Group(p, seed, self.args.n_samples_per_prompt) for p, seed in zip(prompts, seeds)]

    def extend(self, groups: list[Group], chunk: int | None, version: int) -> bool:
        """One engine call: every unfinished sample of `groups` gets at most `chunk` more tokens (None: up to its
        end), tagged with `version`, the policy the engines hold. False when nothing was left to generate."""
        max_len = self.args.generate_max_len
        requests = [(g, r) for g in groups for r in g.requests(lambda done: min(chunk or max_len, max_len - done))]
        if not requests:
            return False
        asked, n, limits, seeds, _ = zip(*(r for _, r in requests))
        ids, images = engine_prompts(asked)
        answers = collect(self.engines, start_generate(self.engines, ids, list(n), self.args.temperature,
                                                       self.args.top_p, list(limits), list(seeds), images))
        for (group, (*_, indices)), outs in zip(requests, answers):
            for j, out in zip(indices, outs):
                sample = group.samples[j]
                sample["token_ids"] += out["token_ids"]
                sample["logprobs"] += out["logprobs"]
                sample["versions"] += [version] * len(out["token_ids"])
                if out["finish_reason"] != "length" or len(sample["token_ids"]) >= max_len:  # not just a chunk's end
                    sample["finish_reason"] = out["finish_reason"]
        return True

    def run_ahead(self, version: int) -> None:
        """Generate chunk after chunk under `version` in a thread, until pause() or every sample in the pool ends."""
        def chunks():
            try:
                while not self.stop.is_set() and self.extend(self.pool, self.chunk, version):
                    pass
            except BaseException as e:  # an engine that died: raised by pause(), in the loop's thread
                self.error = e

        self.stop.clear()
        self.thread = threading.Thread(target=chunks, name="partial-rollouts", daemon=True)
        self.thread.start()

    def pause(self) -> None:
        """Stop the generation ahead after its current chunk (the engines may then take new weights)."""
        if self.thread:
            self.stop.set()
            self.thread.join()
            self.thread = None
        if self.error:
            error, self.error = self.error, None
            raise error

    def take(self, step: int, size: int) -> tuple[list[dict], list[list[dict]], dict]:
        """Step `step`'s `size` prompts and samples, each sample with the `staleness` of each token (step - the
        version that sampled it), and the step's partial/* metrics; the engines must hold step `step`'s policy."""
        self.pause()
        dropped = 0
        for group in self.pool:
            for j, sample in enumerate(group.samples):
                if sample["versions"] and sample["versions"][0] < step - self.bound:  # its oldest token: the first
                    group.samples[j], dropped = empty_sample(), dropped + 1
        finished = sum(g.finished() for g in self.pool)
        if finished < size:
            self.extend([g for g in self.pool if not g.finished()][: size - finished], None, step)
        batch = [g for g in self.pool if g.finished()][:size]
        self.pool = [g for g in self.pool if g not in batch]
        samples = [[{"token_ids": s["token_ids"], "logprobs": s["logprobs"], "finish_reason": s["finish_reason"],
                     "staleness": [step - v for v in s["versions"]]} for s in g.samples] for g in batch]
        return [g.prompt for g in batch], samples, {**staleness_metrics(samples, self.bound),
                                                    "partial/dropped": dropped, "partial/in_flight": len(self.pool)}


def staleness_metrics(samples: list[list[dict]], bound: int) -> dict:
    """partial/staleness_k, the share of a batch's tokens sampled k versions before the policy it trains (k up to
    the bound), their mean, and partial/continued, the share of samples cut by a step boundary and continued under
    a newer policy."""
    ages = [s["staleness"] for group in samples for s in group]
    tokens = sum(map(len, ages))
    histogram = {f"partial/staleness_{k}": sum(a.count(k) for a in ages) / tokens for k in range(bound + 1)}
    return {**histogram, "partial/staleness_mean": sum(map(sum, ages)) / tokens,
            "partial/continued": sum(len(set(a)) > 1 for a in ages) / len(ages)}


def logprob_diff_by_staleness(prompt_ids: list[list[int]], samples: list[list[dict]], vllm_logprobs, old_logprobs,
                              mask) -> dict:
    """partial/logprob_diff_k: vllm/logprob_diff over the tokens of staleness k alone, all three tensors laid out as
    ppo_ray.build_batch lays them (batch, seq - 1). At k = 0 the policy that sampled the tokens scores them: float
    rounding, unless a token's log-prob or version went astray; above, k updates' change of the policy."""
    import torch

    ages = torch.full(mask.shape, -1)  # (batch, seq - 1); -1 where no response token is
    rows = [(len(ids), s["staleness"]) for ids, group in zip(prompt_ids, samples) for s in group]
    for i, (prompt_len, staleness) in enumerate(rows):
        ages[i, prompt_len - 1: prompt_len - 1 + len(staleness)] = torch.tensor(staleness)
    ages = torch.where(mask.bool(), ages, -1)
    gap = (vllm_logprobs - old_logprobs).abs()
    return {f"partial/logprob_diff_{k}": gap[ages == k].mean() for k in ages.unique().tolist() if k >= 0}
