"""Check that weights broadcast from a trainer-side HF model make a live vLLM engine (Ray actor) generate like it.

Runs the real stack on CPU: Ray, one vLLM engine, the weight sync. One engine serves all tests of a model variant
(starting one costs ~20 s and its first generate ~12 s), and every test runs on variants that differ where real
models differ: the project's default tiny Llama (untied embeddings, no biases) and a Qwen2 with tied input/output
embeddings and q/k/v biases, as Qwen2.5-0.5B ships; both take their weights from the trainer's shared memory, as an
engine on the trainer's host does, and a third, the Llama again, over a gloo group, as an engine on another host.
A last test gathers a 2-rank ZeRO-3 model with iter_gathered_params, the trainer-side source of the weights.
"""

import os

# Set before Ray starts, so that the engine's actor process inherits them.
os.environ.update(HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled", VLLM_CPU_KVCACHE_SPACE="1",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")

import pytest
import ray
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.args import UserError, exit_if_distributed
from common.net import free_port
from common.tiny_model import write_tiny_model
from common.vllm_engine import SleepSchedule, create_vllm_engines, shutdown_engines
from common.weight_sync import StaleLayers, broadcast_weights_to_vllm, init_weight_sync_group, iter_gathered_params

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 12
TEXTS = ["What is 12+30?", "Add 7 and 45.", "Compute 3 plus 9.", "What is 40+41?", "Add 19 and 2."]
# vLLM's float32 log-probs of the tokens it sampled against the trainer's, mean |difference| (vllm/logprob_diff in
# ppo_ray.py): float rounding gives ~1e-6 on the tiny models; a stale tensor gives 1e-3 and more.
ROUNDING_LEVEL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2_tied", "llama over gloo"])
def stack(request, tiny_model, tmp_path_factory):
    """Ray with 2 CPUs, one vLLM engine in its default precision (the trainers': float32 on CPU) on a tiny model
    variant, and the weight-sync group: over shared
    memory, as an engine on the trainer's host gets its weights, or over gloo, as one on another host does."""
    path = write_tiny_model(str(tmp_path_factory.mktemp("qwen2_tied")), seed=0, architecture="qwen2",
                            tie_word_embeddings=True) if request.param == "qwen2_tied" else tiny_model
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engines = create_vllm_engines(num_engines=1, tensor_parallel_size=1, pretrain_path=path, seed=0,
                                      max_model_len=256, enforce_eager=True)
        transport = "gloo" if request.param.endswith("gloo") else "shm"
        group = init_weight_sync_group(engines, shared_memory=transport == "shm")
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
        yield {"path": path, "engines": engines, "group": group, "prompts": prompts, "transport": transport}
        shutdown_engines(engines)
    finally:
        ray.shutdown()


def trained_model(path: str, steps: int, seed: int):
    """The HF model after a few Adam steps on arithmetic text, so its weights differ from those on disk."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer([f"{a}+{b}={a + b}" for a in range(seed, seed + 8) for b in range(3)], return_tensors="pt",
                      padding=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def vllm_greedy(engine, prompts):
    """vLLM's greedy continuation of each prompt: (token ids, log-probs of those tokens)."""
    out = ray.get(engine.generate.remote(prompts, n=1, temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=True))
    return [sample[0]["token_ids"] for sample in out], [sample[0]["logprobs"] for sample in out]


@torch.no_grad()
def hf_greedy(model, prompt):
    """HF's greedy continuation of one prompt, cut after end-of-sequence as vLLM cuts it."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt, tokens):
    """log p(token | prefix) of each continuation token under the HF model, in float32."""
    ids = torch.tensor([prompt + tokens])
    logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # (seq, vocab)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logprobs[positions, torch.tensor(tokens)]


def test_the_engine_is_reached_by_the_transport_asked_for(stack):
    """On the trainer's host the engine copies out of the trainer's memory and no process group is built; with
    shared_memory=False it joins a gloo group, which the other tests then exercise."""
    group = stack["group"]
    if stack["transport"] == "shm":
        assert (group.local, group.group) == ("shm", None) and group.shared is not None
    else:
        assert (group.local, group.shared) == (None, None) and group.group is not None


def test_synced_engine_generates_like_the_trainer(stack):
    engine, prompts = stack["engines"][0], stack["prompts"]
    model = trained_model(stack["path"], steps=10, seed=0)
    expected = [hf_greedy(model, p) for p in prompts]

    before, _ = vllm_greedy(engine, prompts)
    assert before != expected, "the engine already generates like the trained model, so the test proves nothing"

    stats = broadcast_weights_to_vllm(iter_gathered_params(model), [engine], stack["group"])
    assert stats["weight_sync/tensors"] == len(list(model.parameters()))
    tokens, logprobs = vllm_greedy(engine, prompts)
    assert tokens == expected
    for prompt, toks, lps in zip(prompts, tokens, logprobs):
        reference = hf_logprobs(model, prompt, toks)
        assert (torch.tensor(lps) - reference).abs().mean() < 1e-3


def logprob_diff(engine, prompts, model) -> float:
    """vllm/logprob_diff as ppo_ray.py logs it: mean |vLLM - trainer| log-prob over the tokens vLLM generated."""
    tokens, logprobs = vllm_greedy(engine, prompts)
    diffs = [(torch.tensor(lps) - hf_logprobs(model, prompt, toks)).abs()
             for prompt, toks, lps in zip(prompts, tokens, logprobs)]
    return torch.cat(diffs).mean().item()


def test_logprobs_stay_at_rounding_level_over_many_syncs(stack):
    """A training run syncs after every step: the engine must follow the trainer every time, not only the first
    (with tied embeddings the first sync looked right and the output layer then drifted from sync to sync)."""
    engine, group, prompts = stack["engines"][0], stack["group"], stack["prompts"]
    base = trained_model(stack["path"], steps=0, seed=0)
    tied = base.config.tie_word_embeddings
    assert tied == ("qwen2" in base.config.model_type), "the fixture lost the variant it exists to test"
    diffs = []
    for sync in range(1, 5):
        model = trained_model(stack["path"], steps=4 * sync, seed=sync)
        broadcast_weights_to_vllm(iter_gathered_params(model), [engine], group)
        diffs.append(logprob_diff(engine, prompts, model))
    assert max(diffs) < ROUNDING_LEVEL, f"vLLM drifts from the trainer, sync after sync: {diffs}"


def test_a_layer_the_sync_skipped_stops_it_and_the_metric_sees_it(stack):
    """A complete sync that leaves one matrix out stops in one sentence naming the layer that vLLM kept as it was;
    the engine keeps the old matrix, which the metric sees, and the next full sync puts it right."""
    engine, group, prompts = stack["engines"][0], stack["group"], stack["prompts"]
    model = trained_model(stack["path"], steps=20, seed=5)
    skipped = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(StaleLayers, match=r"^the weight sync left 1 layer\(s\) of this \w+ with their old weights "
                                          r"in vLLM \(model\.layers\.0\.mlp\.down_proj\)"):
        broadcast_weights_to_vllm(((n, t) for n, t in iter_gathered_params(model) if n != skipped), [engine], group)
    assert logprob_diff(engine, prompts, model) > 10 * ROUNDING_LEVEL
    broadcast_weights_to_vllm(iter_gathered_params(model), [engine], group)
    assert logprob_diff(engine, prompts, model) < ROUNDING_LEVEL


def test_small_buckets_give_the_same_weights_as_one_bucket(stack):
    engine, group, prompts = stack["engines"][0], stack["group"], stack["prompts"]
    model = trained_model(stack["path"], steps=10, seed=1)
    num_tensors = len(list(model.parameters()))

    one = broadcast_weights_to_vllm(iter_gathered_params(model), [engine], group, bucket_bytes=2**30)
    assert one["weight_sync/buckets"] == 1
    reference = vllm_greedy(engine, prompts)

    # Put the weights from disk back, so the small-bucket sync below has to change every weight again.
    other = trained_model(stack["path"], steps=0, seed=0)
    broadcast_weights_to_vllm(iter_gathered_params(other), [engine], group)
    assert vllm_greedy(engine, prompts)[0] != reference[0]

    # 64 KiB splits a layer's q/k/v (64 + 32 + 32 KiB) and gate/up projections across buckets.
    small = broadcast_weights_to_vllm(iter_gathered_params(model), [engine], group, bucket_bytes=64 * 2**10)
    assert 1 < small["weight_sync/buckets"] < num_tensors
    assert small["weight_sync/bytes"] == one["weight_sync/bytes"]
    assert vllm_greedy(engine, prompts) == reference


def test_engine_generates_in_the_trainers_precision(stack):
    """vLLM's own dtype "auto" turns a float32 checkpoint into bfloat16, on CPU too (and keeps a float16 one in
    float16 on GPUs, where the trainers compute in bfloat16): the engines default to the trainers' precision."""
    engine_dtype = lambda engine: str(engine.llm.llm_engine.model_config.dtype)
    assert ray.get(stack["engines"][0].__ray_call__.remote(engine_dtype)) == "torch.float32"


def test_sleep_and_wake_up_do_nothing_on_cpu(stack):
    """On CPU vLLM has no sleep mode: the engine keeps its weights and answers as before."""
    engine, prompts = stack["engines"][0], stack["prompts"]
    before = vllm_greedy(engine, prompts)
    ray.get(engine.sleep.remote())
    ray.get(engine.wake_up.remote())
    assert vllm_greedy(engine, prompts) == before


class CacheFreeingTrainers:
    """What SleepSchedule asks of a trainer worker group: call("empty_cache"). Notes how many sleep/wake calls the
    engine had received by then."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    def call(self, method: str) -> list:
        assert method == "empty_cache", method
        self.seen.append(len(ray.get(self.engine.memory_events.remote())))
        return []


def test_colocated_engines_sleep_and_wake_in_the_order_the_gpu_needs(stack):
    """--colocate_all's memory choreography (common/vllm_engine.SleepSchedule), as the engine receives it; on CPU
    the engine records the calls and keeps its memory, so the order is checked here and the memory on GPUs."""
    engine = stack["engines"][0]
    off = SleepSchedule([engine], enabled=False)
    before = len(ray.get(engine.memory_events.remote()))
    for phase in (off.start, off.before_generate, off.after_generate, off.before_sync, off.before_generate):
        phase()
    assert len(ray.get(engine.memory_events.remote())) == before  # separate GPUs: the engines never sleep

    schedule = SleepSchedule([engine], enabled=True)
    schedule.trainers = [CacheFreeingTrainers(engine)]
    schedule.start()  # created -> asleep, before the models load
    for _ in range(2):  # two PPO steps: generate, (experience, train), sync
        schedule.before_generate()
        assert len(vllm_greedy(engine, stack["prompts"])[0]) == len(stack["prompts"])
        schedule.after_generate()
        schedule.before_sync()
    events = ray.get(engine.memory_events.remote())[before:]
    assert events == [("sleep", 1), ("wake_up", ["weights", "kv_cache"]), ("sleep", 1), ("wake_up", ["weights"]),
                      ("wake_up", ["kv_cache"]), ("sleep", 1), ("wake_up", ["weights"])]
    # the trainers free their cached blocks before each wake of the KV cache, which needs that memory
    assert schedule.trainers[0].seen == [before + 1, before + 4]


def test_clear_errors_before_any_engine_starts(stack, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        create_vllm_engines(1, 1, str(tmp_path / "no_such_model"), seed=0, max_model_len=256)
    with pytest.raises(UserError, match="no config.json"):
        create_vllm_engines(1, 1, str(tmp_path), seed=0, max_model_len=256)
    with pytest.raises(UserError, match="tensor_parallel_size=1"):
        create_vllm_engines(1, 2, stack["path"], seed=0, max_model_len=256)
    with pytest.raises(UserError, match=r"need 4 CPUs but Ray has 1 of 2 free"):
        create_vllm_engines(4, 1, stack["path"], seed=0, max_model_len=256)


def _gather_on_rank(rank: int, world_size: int, port: int, path: str, out: str):
    """One ZeRO-3 rank: load the model partitioned, then run through iter_gathered_params as every rank must."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    from common.deepspeed_utils import ds_config, init_distributed, init_eval_engine, load_model

    init_distributed()
    config = ds_config(stage=3, train_batch_size=world_size, micro_batch_size=1, world_size=world_size, train=False)
    engine = init_eval_engine(load_model(path, config), config)
    partitioned = sum(p.ds_tensor.numel() < p.ds_numel for p in engine.module.parameters() if hasattr(p, "ds_id"))
    gathered = {name: t.clone() for name, t in iter_gathered_params(engine)}  # the engine itself, as a trainer has it
    if rank == 0:
        torch.save({"partitioned": partitioned, "params": gathered}, out)
    exit_if_distributed(0)  # as the scripts end a rank: the interpreter's own exit aborts now and then


def test_gathered_zero3_params_are_the_full_hf_weights(tiny_model, tmp_path):
    out = str(tmp_path / "gathered.pt")
    mp.spawn(_gather_on_rank, args=(2, free_port(), tiny_model, out), nprocs=2, join=True)
    result = torch.load(out)
    expected = dict(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).named_parameters())
    assert result["partitioned"] > 0, "ZeRO-3 left every parameter whole, so no gather was exercised"
    assert list(result["params"]) == list(expected)
    for name, tensor in result["params"].items():
        torch.testing.assert_close(tensor, expected[name].detach(), rtol=0, atol=0)


def test_cpu_bucket_buffers_are_kept_between_syncs_and_others_are_fresh():
    """reused_cpu_buffer: the same CPU storage for the same bucket from one sync to the next (a smaller bucket gets a
    view of it), a new one when the bucket outgrows it or changes dtype, and never a kept one off the CPU."""
    from common.weight_sync import reused_cpu_buffer

    cpu, kept = torch.device("cpu"), {}
    first = reused_cpu_buffer(kept, 0, 1000, torch.float32, cpu)
    assert reused_cpu_buffer(kept, 0, 1000, torch.float32, cpu).data_ptr() == first.data_ptr()
    smaller = reused_cpu_buffer(kept, 0, 10, torch.float32, cpu)
    assert smaller.shape == (10,) and smaller.data_ptr() == first.data_ptr()
    assert reused_cpu_buffer(kept, 1, 1000, torch.float32, cpu).data_ptr() != first.data_ptr()  # another bucket
    assert reused_cpu_buffer(kept, 0, 2000, torch.float32, cpu).numel() == 2000
    assert reused_cpu_buffer(kept, 0, 100, torch.bfloat16, cpu).dtype == torch.bfloat16
    other = {}
    assert reused_cpu_buffer(other, 0, 100, torch.float32, torch.device("meta")).device.type == "meta"
    assert other == {}, "a buffer off the CPU was kept"
