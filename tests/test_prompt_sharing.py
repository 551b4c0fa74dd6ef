"""--share_prompts in ppo_ray.py: each prompt computed once for its samples gives the padded batch's log-probs,
entropy, PPO loss and gradients, on an untied grouped-query Llama, a tied Qwen2 with attention biases and ChatML, and a
mixture-of-experts Mixtral; a shared row whose samples can see each other does not, and the run's first micro-batch
catches it."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ppo_ray
from common import prompt_sharing
from common.args import UserError, parse_args
from common.model_worker import split
from common.tiny_model import write_tiny_model

# Three prompts of different lengths with 3, 1 and 4 samples, their responses of different lengths; the second
# prompt's single sample and two others were cut at the length limit (no EOS).
GROUPS = [(5, [4, 1, 6]), (9, [3]), (3, [2, 7, 5, 3])]
CUT = {(0, 1), (1, 0), (2, 3)}


@pytest.fixture(scope="module", params=["llama", "qwen2 tied, chatml", "mixtral"])
def model_dir(request, tiny_model, tmp_path_factory) -> str:
    if request.param == "llama":  # untied, 4 query heads on 2 key-value heads
        return tiny_model
    if request.param == "mixtral":
        return write_tiny_model(str(tmp_path_factory.mktemp("moe")), seed=0, architecture="mixtral")
    return write_tiny_model(str(tmp_path_factory.mktemp("tied")), seed=0, architecture="qwen2",
                            tie_word_embeddings=True, chat_format="chatml")


def rollout(tokenizer) -> dict:
    """build_batch's rows for GROUPS: each prompt's samples one after another, as the engines return them."""
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> list[int]:
        return torch.randint(10, len(tokenizer), (n,), generator=g).tolist()

    prompts = [[tokenizer.bos_token_id or 1] + words(n - 1) for n, _ in GROUPS]
    samples = [[{"token_ids": words(n - 1) + (words(1) if (p, s) in CUT else [tokenizer.eos_token_id]),
                 "logprobs": None} for s, n in enumerate(lengths)] for p, (_, lengths) in enumerate(GROUPS)]
    return ppo_ray.build_batch(prompts, samples, tokenizer.pad_token_id)


class SummingEngine(torch.nn.Module):
    """Stands in for a DeepSpeed engine that accumulates every micro-batch's gradient into one optimizer step: the
    gradient of the whole batch, whichever rows the micro-batches hold."""

    def __init__(self, module, accumulation: int):
        super().__init__()
        self.module, self.accumulation = module, accumulation

    def forward(self, **kwargs):
        return self.module(**kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass

    def get_lr(self):
        return [0.0]

    def gradient_accumulation_steps(self):
        return self.accumulation

    def gradient(self) -> torch.Tensor:
        grads = torch.cat([p.grad.flatten() for p in self.module.parameters() if p.grad is not None])
        self.module.zero_grad()
        return grads


def actor(engine, **flags) -> ppo_ray.ActorWorker:
    """An actor as its Ray actor holds it after setup(), without Ray or DeepSpeed."""
    w = object.__new__(ppo_ray.ActorWorker)
    w.args, w.engine, w.ptx, w.world_size, w.rank = ppo_ray.Args(**flags), engine, None, 1, 0
    return w


def experience(batch: dict, logprobs: torch.Tensor) -> dict:
    """The batch with made-up old and reference log-probs and advantages near the policy's: the clip and the KL
    term both take part."""
    g = torch.Generator().manual_seed(1)
    mask = batch["action_mask"]
    noise = torch.randn(mask.shape, generator=g)
    return {**batch, "old_logprobs": logprobs + 0.3 * noise * mask, "ref_logprobs": logprobs + 0.1 * noise * mask,
            "advantages": torch.randn(mask.shape, generator=g) * mask}


def test_groups_and_micro_batches_keep_each_prompts_samples_together(tiny_model):
    batch = rollout(AutoTokenizer.from_pretrained(tiny_model))
    assert prompt_sharing.groups(batch) == [[0, 1, 2], [3], [4, 5, 6, 7]]
    order = prompt_sharing.group_order(batch, 3)
    micro = split(batch, 4, shuffle_seed=3, by_prompt=True)  # the rows in that order, 4 at a time
    for i, mb in enumerate(micro):
        rows = batch["input_ids"][order[4 * i: 4 * i + 4]]
        assert torch.equal(mb["input_ids"], rows[:, : mb["input_ids"].shape[1]])
    orders = {tuple(prompt_sharing.group_order(batch, seed)) for seed in range(8)}
    assert len(orders) > 1 and all(sorted(o) == list(range(8)) for o in orders)  # shuffled, every row once
    for order in orders:  # each group's rows stay next to each other
        groups = [next(i for i, g in enumerate(prompt_sharing.groups(batch)) if row in g) for row in order]
        assert groups == sorted(groups, key=groups.index)


def test_the_shared_row_holds_each_prompt_once(tiny_model):
    batch = rollout(AutoTokenizer.from_pretrained(tiny_model))
    ids, positions, mask, keep, where = prompt_sharing.pack(batch["input_ids"], batch["attention_mask"],
                                                            batch["action_mask"], 0, torch.float32)
    responses = sum(sum(lengths) for _, lengths in GROUPS)
    assert ids.shape[1] == sum(n for n, _ in GROUPS) + responses < int(batch["attention_mask"].sum())
    sees = mask[0, 0] == 0
    assert sees.sum(1).min() >= 1 and not sees.triu(1).any()  # causal, every token sees itself
    last = positions[0].tolist()
    assert last[:5] == list(range(5)) and last[5:9] == list(range(5, 9))  # the first prompt, its first response


def test_shared_logprobs_entropy_and_update_equal_the_padded_ones(model_dir):
    """ActorWorker's log-probs and entropy, then fit's GRPO update (the clipped surrogate, the k3 KL term, an
    entropy bonus) over micro-batches of 4 rows in one optimizer step: loss and gradient as the padded run's."""
    batch = rollout(AutoTokenizer.from_pretrained(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    flags = dict(micro_train_batch_size=4, advantage_estimator="grpo", entropy_coef=0.01, max_epochs=1,
                 temperature=0.7)
    results = {}
    for shared in (False, True):
        engine = SummingEngine(model, accumulation=2)
        worker = actor(engine, share_prompts=shared, **flags)
        with torch.no_grad():
            logprobs, entropy = worker._logprobs(batch, with_entropy=True)
        exp = experience(batch, logprobs if not shared else results[False][0])
        metrics = worker.fit(exp, kl_coef=0.1, step=0)
        results[shared] = (logprobs, entropy, metrics, engine.gradient())
    (lp, ent, m, grad), (lp_s, ent_s, m_s, grad_s) = results[False], results[True]
    mask = batch["action_mask"].bool()
    torch.testing.assert_close(lp_s[mask], lp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_s[mask], ent[mask], rtol=0, atol=1e-5)
    assert m["policy/clipfrac_avg"] > 0
    for key in ("loss/policy_avg", "policy/clipfrac_avg", "policy/approxkl_avg", "objective/entropy"):
        assert float(m_s[key]) == pytest.approx(float(m[key]), abs=1e-5), key
    assert grad.abs().max() > 1e-4
    torch.testing.assert_close(grad_s, grad, rtol=1e-4, atol=1e-6)


def test_a_shared_row_whose_samples_see_each_other_differs_and_stops_the_run(tiny_model, monkeypatch):
    """The break: a causal mask over the whole shared row lets each response read the ones packed before it. The
    log-probs move far beyond rounding, and the first shared micro-batch's check against the padded forward stops
    the run in one sentence."""
    batch = rollout(AutoTokenizer.from_pretrained(tiny_model))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    pack = prompt_sharing.pack

    def leaky(*args):
        ids, positions, mask, keep, where = pack(*args)
        causal = torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
        return ids, positions, torch.zeros_like(mask).masked_fill(~causal, torch.finfo(mask.dtype).min), keep, where

    worker = actor(SummingEngine(model, 1), share_prompts=True)
    worker.shared_checked = True  # the check off: the two forwards' own gap
    with torch.no_grad():
        right = worker._logprobs(batch)
        monkeypatch.setattr(prompt_sharing, "pack", leaky)
        wrong = worker._logprobs(batch)
        mask = batch["action_mask"].bool()
        assert (wrong - right)[mask].abs().max() > 1e-2
        worker.shared_checked = False
        with pytest.raises(UserError, match=r"--share_prompts: .* computes a shared prompt's samples otherwise than "
                                            r"separate rows .* Leave out --share_prompts\.$"):
            worker._logprobs(batch)


def test_share_prompts_is_refused_where_it_cannot_apply(tiny_model, tmp_path):
    base = ["--prompt_data", "unused.jsonl", "--reward_fn", "unused.py:f", "--share_prompts", "--output_dir",
            str(tmp_path / "out")]
    opt = tmp_path / "opt"
    opt.mkdir()
    (opt / "config.json").write_text(json.dumps({"model_type": "opt", "architectures": ["OPTForCausalLM"]}))
    with pytest.raises(UserError, match=r"is a 'opt' model, whose attention does not restart .* Leave out "
                                        r"--share_prompts\.$"):
        ppo_ray.check_args(parse_args(ppo_ray.Args, ["--pretrain", str(opt), *base]))
    moe = write_tiny_model(str(tmp_path / "moe"), seed=0, architecture="mixtral")
    with pytest.raises(UserError, match=r"--share_prompts .* --routing_replay .* leave out one of the two\.$"):
        ppo_ray.check_args(parse_args(ppo_ray.Args, ["--pretrain", moe, "--routing_replay", *base]))
    assert not (tmp_path / "out").exists()


def test_a_model_computing_with_flash_attention_is_refused_by_the_shared_forward(tiny_model):
    """flash-attention's kernels take no (tokens x tokens) mask: the samples would read each other unseen."""
    batch = rollout(AutoTokenizer.from_pretrained(tiny_model))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UserError, match=r"--share_prompts .* which flash_attention_2 does not take"):
        prompt_sharing.next_token_logits(model, batch, 0)


def sliding(tiny_model: str, folder, window: int | None) -> str:
    """The tiny Llama's weights as a Mistral (the same weight names) whose layers attend within `window` tokens."""
    shutil.copytree(tiny_model, folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=window)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_sliding_window_shorter_than_the_rows_is_refused_and_one_that_holds_them_changes_nothing(tiny_model,
                                                                                                   tmp_path):
    """transformers hands the shared forward's 4D mask to sliding layers as it is, so a response reads its prompt
    beyond the window where its own row would not: with a window of 4 tokens the shared log-probs move; with one that
    holds the rows (up to 14 tokens here) they are the padded ones. --share_prompts is refused where
    --prompt_max_len + --generate_max_len outgrow the window."""
    batch = rollout(AutoTokenizer.from_pretrained(tiny_model))
    mask = batch["action_mask"].bool()
    for window, moved in ((4, True), (16, False)):
        model = AutoModelForCausalLM.from_pretrained(sliding(tiny_model, tmp_path / f"w{window}", window),
                                                     dtype=torch.float32)
        shared = actor(SummingEngine(model, 1), share_prompts=True)
        shared.shared_checked = True  # the check off: the two forwards' own gap
        with torch.no_grad():
            gap = (shared._logprobs(batch) - actor(SummingEngine(model, 1))._logprobs(batch))[mask].abs().max()
        assert (gap > 1e-3) == moved, (window, float(gap))
    args = ppo_ray.Args(pretrain=str(tmp_path / "w4"), share_prompts=True, prompt_max_len=8, generate_max_len=8)
    with pytest.raises(UserError, match=r"^--share_prompts: .*w4 attends within a sliding window of 4 tokens, .* "
                                        r"its rows reach 16 tokens .* or leave out --share_prompts\.$"):
        prompt_sharing.check_window(args)
    prompt_sharing.check_window(ppo_ray.Args(pretrain=str(tmp_path / "w16"), prompt_max_len=8, generate_max_len=8))
    prompt_sharing.check_window(ppo_ray.Args(pretrain=sliding(tiny_model, tmp_path / "none", None),
                                             prompt_max_len=8, generate_max_len=8))


@pytest.mark.parametrize("config, window", [
    ({"model_type": "qwen2"}, None),  # a window in its config, off unless layer_types name sliding layers
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1,
      "num_hidden_layers": 2}, 64),
    ({"model_type": "gemma3_text", "sliding_window": 32}, 32),  # local layers among global ones
    ({"model_type": "llama"}, None),
])
def test_sliding_window_reads_each_familys_way_of_saying_it(tmp_path, config, window):
    from transformers import AutoConfig

    AutoConfig.for_model(**config).save_pretrained(tmp_path)
    assert prompt_sharing.sliding_window(str(tmp_path)) == window
