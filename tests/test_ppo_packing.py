"""--packing_samples in ppo_ray.py: the actor's and reference's log-probs and entropy, the critic's values, and the
gradients of the policy and value losses are the padded ones, put back in the padded action_mask layout, on rows laid
out as build_batch lays them and with left-padded prompts, on the default tiny model and on a tied-embedding Qwen2; a
packed row whose sequences can see each other is not, which shows these comparisons can fail.

The padded log-probs skip the prompt columns before a micro-batch's first response token (the LM head does not run
there): they equal those of the model's full logits from that column on, also for a model that computes every
position's logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import ppo_ray
from common import lora, model_worker
from common.model_worker import ModelWorker
from common.modeling import (entropy_from_logits, pack_rows, response_start, token_logprobs, unpack,
                             unpack_next_token)
from common.tiny_model import write_tiny_model

PROMPT_LENS = [3, 7, 2, 5, 9, 4, 6, 2]
RESPONSE_LENS = [4, 1, 6, 2, 5, 7, 3, 5]
ENDS_WITH_EOS = [True, True, False, True, False, True, False, True]  # the others were cut at the length limit


@pytest.fixture(scope="module", params=["llama", "qwen2 tied"])
def model_dir(request, tiny_model, tmp_path_factory) -> str:
    if request.param == "llama":
        return tiny_model
    return write_tiny_model(str(tmp_path_factory.mktemp("tied_model")), seed=0, architecture="qwen2",
                            tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


class RecordingEngine(torch.nn.Module):
    """Stands in for a DeepSpeed engine around a plain model: forward, backward, and a step that records the
    gradients (then clears them) instead of updating."""

    def __init__(self, module):
        super().__init__()
        self.module, self.grads = module, []

    def forward(self, **kwargs):
        return self.module(**kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.grads.append(torch.cat([p.grad.flatten() for p in self.module.parameters() if p.grad is not None]))
        self.module.zero_grad()

    def get_lr(self):
        return [0.0]

    def gradient_accumulation_steps(self):
        return 1


def worker(cls, engine, **flags):
    """A worker object as its Ray actor holds it after setup(), without Ray or DeepSpeed."""
    w = object.__new__(cls)
    w.args, w.engine, w.ptx, w.world_size = ppo_ray.Args(**flags), engine, None, 1
    return w


def rollout_batch(tokenizer) -> dict:
    """build_batch's rows: prompts and responses of different lengths, some responses ending in EOS, some cut."""
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> list[int]:
        return torch.randint(10, len(tokenizer), (n,), generator=g).tolist()

    prompts = [[tokenizer.bos_token_id or 1] + words(n - 1) for n in PROMPT_LENS]
    samples = [[{"token_ids": words(n - 1) + ([tokenizer.eos_token_id] if eos else words(1)), "logprobs": None}]
               for n, eos in zip(RESPONSE_LENS, ENDS_WITH_EOS)]
    return ppo_ray.build_batch(prompts, samples, tokenizer.pad_token_id)


def left_padded(batch: dict, pad_id: int) -> dict:
    """The same sequences as OpenRLHF lays them out: each prompt left-padded to the longest, the responses after."""
    lengths, prompt_lens = batch["attention_mask"].sum(1), torch.tensor(PROMPT_LENS)
    shift = prompt_lens.max() - prompt_lens  # (batch,)
    width = int((shift + lengths).max())
    out = {"input_ids": torch.full((len(lengths), width), pad_id), "attention_mask": torch.zeros(len(lengths), width,
                                                                                               dtype=torch.long),
           "action_mask": torch.zeros(len(lengths), width - 1)}
    for i, (n, s) in enumerate(zip(lengths.tolist(), shift.tolist())):
        out["input_ids"][i, s: s + n] = batch["input_ids"][i, :n]
        out["attention_mask"][i, s: s + n] = 1
        out["action_mask"][i, s: s + n - 1] = batch["action_mask"][i, : n - 1]
    out["position_ids"] = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return out


def both_real(batch: dict) -> torch.Tensor:
    """(batch, seq - 1): the next-token entries whose token and next token are both real; every other entry of the
    packed results must be 0."""
    mask = batch["attention_mask"].bool()
    return mask[:, :-1] & mask[:, 1:]


def from_response(batch: dict) -> torch.Tensor:
    """both_real from the batch's first response column on, where padded and packed log-probs must agree: the
    padded ones are 0 before it, where no logits were computed."""
    real = both_real(batch)
    real[:, : response_start(batch["action_mask"])] = False
    return real


def assert_packed_equals_padded(packed: torch.Tensor, padded: torch.Tensor, compared: torch.Tensor,
                                real: torch.Tensor) -> None:
    torch.testing.assert_close(packed[compared], padded[compared], rtol=0, atol=1e-5)
    assert (packed[~real] == 0).all(), "the packed results leave something at the padding"


def policy(model_dir) -> RecordingEngine:
    return RecordingEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))


def critic(model_dir, tokenizer) -> RecordingEngine:
    """A critic on the normalised reward scale (rm.py's mean and std in its config), its head fresh weights."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32,
                                                               pad_token_id=tokenizer.pad_token_id)
    model.config.reward_mean, model.config.reward_std = 0.3, 1.7
    return RecordingEngine(model)


# ------------------------------------------------------------------------------------------------------- helpers
def test_pack_rows_and_unpack_put_every_token_back_and_zero_the_crossing_entries():
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 0], [8, 9, 0, 0, 0, 0], [0, 3, 4, 2, 0, 0]])
    attention_mask = (input_ids != 0).long()
    ids, position_ids, index = pack_rows(input_ids, attention_mask)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 3, 4, 2]]
    assert position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert torch.equal(unpack(ids, index, input_ids.shape), input_ids)
    entries = torch.arange(1.0, 8.0)[None]  # (1, total - 1): entries 3 and 5 predict a row's first token
    assert unpack_next_token(entries, position_ids, index, input_ids.shape).tolist() == [
        [0, 0, 1, 2, 0], [4, 0, 0, 0, 0], [0, 6, 7, 0, 0]]


# -------------------------------------------------------------------------------------------- actor, reference
@pytest.mark.parametrize("layout", ["build_batch", "left-padded prompts"])
def test_packed_logprobs_and_entropy_equal_padded(model_dir, tokenizer, layout):
    batch = rollout_batch(tokenizer)
    if layout != "build_batch":
        batch = left_padded(batch, tokenizer.pad_token_id)
    engine = policy(model_dir)
    results = []
    for packing in (False, True):  # with gradients, as in the update, and an entropy bonus
        logprobs, entropy = worker(ppo_ray.ActorWorker, engine, packing_samples=packing, entropy_coef=0.01,
                                   temperature=0.7)._logprobs(batch, with_entropy=True)
        assert logprobs.requires_grad and entropy.requires_grad
        results.append((logprobs.detach(), entropy.detach()))
    compared = from_response(batch)
    assert not (batch["action_mask"].bool() & ~compared).any()  # every trained entry is compared
    for padded, packed in zip(*results):
        assert_packed_equals_padded(packed, padded, compared, both_real(batch))


def test_packed_logprobs_of_the_experience_pass_equal_padded(model_dir, tokenizer):
    """ModelWorker.logprobs as the actor and reference run it: micro-batches, each trimmed and packed."""
    batch = rollout_batch(tokenizer)
    engine = policy(model_dir)
    padded, packed = (worker(ModelWorker, engine, packing_samples=packing,
                             micro_train_batch_size=3).logprobs(batch) for packing in (False, True))
    assert packed.shape == batch["action_mask"].shape  # each micro-batch skips its own prompt columns
    assert_packed_equals_padded(packed, padded, batch["action_mask"].bool(), both_real(batch))


def test_packed_row_whose_sequences_see_each_other_gives_other_logprobs(model_dir, tokenizer, monkeypatch):
    """The negative control: the same packed row with position_ids that count on instead of restarting at each
    sequence, so that transformers puts one causal mask over the whole row."""
    batch = rollout_batch(tokenizer)
    engine = policy(model_dir)
    with torch.no_grad():
        padded = worker(ppo_ray.ActorWorker, engine)._logprobs(batch)

        def counting_on(input_ids, attention_mask):
            ids, position_ids, index = pack_rows(input_ids, attention_mask)
            return ids, torch.arange(ids.shape[1])[None], index

        monkeypatch.setattr(model_worker, "pack_rows", counting_on)
        leaked = worker(ppo_ray.ActorWorker, engine, packing_samples=True)._logprobs(batch)
    real = from_response(batch)
    torch.testing.assert_close(leaked[0][real[0]], padded[0][real[0]], rtol=0, atol=1e-5)  # sees nothing before it
    assert (leaked[1:][real[1:]] - padded[1:][real[1:]]).abs().median() > 1e-3


class AllLogits(torch.nn.Module):
    """A causal LM whose forward has no `logits_to_keep`, as a model from outside transformers may not."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache)


@pytest.mark.parametrize("layout", ["build_batch", "left-padded prompts"])
def test_padded_logprobs_skip_the_prompt_columns_and_equal_the_full_logits(model_dir, tokenizer, layout):
    batch = rollout_batch(tokenizer)
    if layout != "build_batch":
        batch = left_padded(batch, tokenizer.pad_token_id)
    start, seq = response_start(batch["action_mask"]), batch["input_ids"].shape[1]
    assert start > 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, :-1] / 0.7
        full = (token_logprobs(logits, batch["input_ids"][:, 1:]), entropy_from_logits(logits))
        head_positions = []
        model.lm_head.register_forward_hook(lambda _, inputs, __: head_positions.append(inputs[0].shape[1]))
        lora_model = lora.wrap(model, ppo_ray.Args(lora_rank=4, lora_alpha=8), "CAUSAL_LM")  # B = 0: same logits
        for module, positions in ((model, seq - start), (lora_model, seq - start), (AllLogits(model), seq)):
            head_positions.clear()
            skipped = worker(ppo_ray.ActorWorker, RecordingEngine(module), temperature=0.7)._logprobs(
                batch, with_entropy=True)
            assert head_positions == [positions], type(module).__name__
            for ours, theirs in zip(skipped, full):
                assert ours.shape == theirs.shape
                torch.testing.assert_close(ours[:, start:], theirs[:, start:], rtol=0, atol=1e-5)
                assert (ours[:, :start] == 0).all()


def experience(batch: dict, logprobs: torch.Tensor) -> dict:
    """What fit() reads: old log-probs off the current ones (ratios away from 1, some clipped), random advantages,
    old values and returns."""
    g = torch.Generator().manual_seed(1)
    mask = batch["action_mask"]

    def noise() -> torch.Tensor:
        return torch.randn(mask.shape, generator=g)

    return {**batch, "old_logprobs": logprobs + 0.3 * noise() * mask, "ref_logprobs": logprobs + 0.1 * noise() * mask,
            "advantages": noise() * mask, "values": 0.5 * noise() * mask, "returns": noise() * mask}


def test_policy_loss_gradients_equal_packed_and_padded(model_dir, tokenizer):
    """ActorWorker.fit's PPO update (grpo: the clipped surrogate, the k3 KL term, an entropy bonus) gives the same
    loss and gradients, micro-batch by micro-batch."""
    batch = rollout_batch(tokenizer)
    engine = policy(model_dir)
    with torch.no_grad():
        exp = experience(batch, worker(ppo_ray.ActorWorker, engine)._logprobs(batch))
    metrics, grads = [], []
    for packing in (False, True):
        actor = worker(ppo_ray.ActorWorker, engine, packing_samples=packing, micro_train_batch_size=4,
                       advantage_estimator="grpo", entropy_coef=0.01, max_epochs=1)
        metrics.append(actor.fit(exp, kl_coef=0.1, step=0))
        grads.append(engine.grads)
        engine.grads = []
    assert metrics[0]["policy/clipfrac_avg"] > 0  # the clip takes part
    for key in ("loss/policy_avg", "policy/clipfrac_avg", "policy/approxkl_avg", "objective/entropy"):
        assert float(metrics[1][key]) == pytest.approx(float(metrics[0][key]), abs=1e-5), key
    assert len(grads[0]) == len(grads[1]) == 2
    for padded, packed in zip(*grads):
        assert padded.abs().max() > 1e-4
        torch.testing.assert_close(packed, padded, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------------ critic
@pytest.mark.parametrize("layout", ["build_batch", "left-padded prompts"])
def test_packed_values_equal_padded(model_dir, tokenizer, layout):
    batch = rollout_batch(tokenizer)
    if layout != "build_batch":
        batch = left_padded(batch, tokenizer.pad_token_id)
    engine = critic(model_dir, tokenizer)
    with torch.no_grad():
        padded, packed = (worker(ppo_ray.CriticWorker, engine, packing_samples=packing)._values(batch)
                          for packing in (False, True))
    real = batch["attention_mask"][:, :-1].bool()
    assert_packed_equals_padded(packed, padded, real, real)


def test_packed_values_of_the_experience_pass_equal_padded(model_dir, tokenizer):
    batch = rollout_batch(tokenizer)
    engine = critic(model_dir, tokenizer)
    padded, packed = (worker(ppo_ray.CriticWorker, engine, packing_samples=packing,
                             micro_train_batch_size=3).values(batch) for packing in (False, True))
    assert packed.shape == batch["action_mask"].shape
    real = batch["attention_mask"][:, :-1].bool()
    assert_packed_equals_padded(packed, padded, real, real)


def test_value_loss_gradients_equal_packed_and_padded(model_dir, tokenizer):
    batch = rollout_batch(tokenizer)
    engine = critic(model_dir, tokenizer)
    exp = experience(batch, torch.zeros_like(batch["action_mask"]))
    metrics, grads = [], []
    for packing in (False, True):
        metrics.append(worker(ppo_ray.CriticWorker, engine, packing_samples=packing, micro_train_batch_size=4,
                              max_epochs=1, value_clip=0.2).fit(exp))
        grads.append(engine.grads)
        engine.grads = []
    assert metrics[1]["loss/value_avg"] == pytest.approx(metrics[0]["loss/value_avg"], abs=1e-5)
    assert len(grads[0]) == len(grads[1]) == 2
    for padded, packed in zip(*grads):
        torch.testing.assert_close(packed, padded, rtol=1e-4, atol=1e-5)


def test_packed_values_of_a_lora_critic_equal_padded(tiny_model):
    """--lora_rank wraps the critic in peft (its head a trained copy behind ModulesToSaveWrapper): the packed path
    reaches backbone and head through it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    engine = critic(tiny_model, tokenizer)
    engine.module = lora.wrap(engine.module, ppo_ray.Args(lora_rank=4, lora_alpha=8), "SEQ_CLS")
    with torch.no_grad():  # adapters and a head as after training (fresh B matrices are 0)
        for name, p in engine.module.named_parameters():
            if ".lora_B." in name or ".modules_to_save." in name:
                p.add_(0.05 * torch.randn_like(p))
    batch = rollout_batch(tokenizer)
    with torch.no_grad():
        padded, packed = (worker(ppo_ray.CriticWorker, engine, packing_samples=packing)._values(batch)
                          for packing in (False, True))
        with engine.module.disable_adapter():
            unadapted = worker(ppo_ray.CriticWorker, engine, packing_samples=True)._values(batch)
    real = batch["attention_mask"][:, :-1].bool()
    assert_packed_equals_padded(packed, padded, real, real)
    assert (packed[real] - unadapted[real]).abs().max() > 1e-3  # the adapters and the trained head took part
