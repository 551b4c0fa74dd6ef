"""Vision-language families whose forward needs more than the token ids and the image tensors: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL and GLM-4V read each token's modality (`mm_token_type_ids`) and place an image's tokens at its grid's rows
and columns (3D rotary positions), which the library's padded, left-padded and packed forwards must give them as
their processor's own call would (common/vlm.py complete_forward_inputs).

Their processors need torchvision, which this CPU stack leaves out, so the models are built from configs and fed
what their processors make: the patches of each image (pixel_values (patches, 3 * 2 * 14 * 14)), its grid
(image_grid_thw: 1 frame, rows, columns of 14-pixel patches) and one image token per 2x2 patches between the vision
markers. Each family's reference is the model's own forward of one sample alone, given its mm_token_type_ids and no
position ids, as a processor's output is given.
"""

import copy
import inspect
from types import SimpleNamespace

import ppo_ray
import pytest
import torch
import transformers
from PIL import Image
from transformers import AutoModelForImageTextToText, PaliGemmaConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, MODEL_MAPPING_NAMES)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from common import vlm
from common.args import UserError
from common.modeling import (next_token_logits, pack_rows, packed_sequence_rewards, sequence_rewards,
                             token_logprobs)

VOCAB, IMAGE, VIDEO, START, END = 200, 190, 191, 192, 193
PATCH_VALUES = 3 * 2 * 14 * 14  # channels x frames a patch spans x pixels: one row of pixel_values
VISION = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
FAMILIES = {
    "qwen2_vl": dict(embed_dim=64, hidden_size=128),
    "qwen2_5_vl": dict(hidden_size=64, intermediate_size=128, out_hidden_size=128, window_size=56,
                       fullatt_block_indexes=[1]),
    "qwen3_vl": dict(hidden_size=64, intermediate_size=128, out_hidden_size=128, num_position_embeddings=64,
                     deepstack_visual_indexes=[0]),
    "glm4v": dict(hidden_size=64, intermediate_size=128, out_hidden_size=128, image_size=56),
}


def tiny_config(family: str):
    """A two-layer language model (head_dim 64, its 32 rotary frequencies split 8/12/12 over time, height and
    width) under a two-layer vision tower."""
    text = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=512, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
    return CONFIG_MAPPING[family](text_config=text, vision_config=dict(VISION, **FAMILIES[family]),
                                  image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                                  vision_end_token_id=END)


# Three samples: one image between words, two images of other shapes, and text alone. A grid is (frames, rows,
# columns) of patches; 2x2 of them make one image token.
GRIDS = [[(1, 4, 4)], [(1, 2, 6), (1, 4, 2)], []]


def sample(grids: list[tuple], words: int, seed: int) -> list[int]:
    text = torch.randint(3, 180, (words,), generator=torch.Generator().manual_seed(seed)).tolist()
    ids = text[:2]
    for k, (_, rows, columns) in enumerate(grids):  # a word after each image
        ids += [START] + [IMAGE] * (rows * columns // 4) + [END] + text[2 + k:3 + k]
    return ids + text[2 + len(grids):]


SAMPLES = [sample(grids, words, seed) for seed, (grids, words) in enumerate(zip(GRIDS, [9, 7, 12]))]


def pixel_values(grids: list[tuple], seed: int = 0) -> torch.Tensor:
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(patches, PATCH_VALUES, generator=torch.Generator().manual_seed(seed))  # (patches, values)


def image_inputs(samples: range) -> dict:
    """The image tensors of these samples in their order, as a processor makes them for a batch."""
    grids = [g for i in samples for g in GRIDS[i]]
    return {"pixel_values": torch.cat([pixel_values(GRIDS[i], seed=i) for i in samples if GRIDS[i]]),
            "image_grid_thw": torch.tensor(grids)}


def alone(model, i: int) -> torch.Tensor:
    """Sample i's logits from the model's own forward of it alone, with the modality of each token and no
    position ids, as its processor's output is given: (seq, vocab)."""
    ids = torch.tensor([SAMPLES[i]])
    images = image_inputs(range(i, i + 1)) if GRIDS[i] else {}
    return model(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), **images).logits[0]


def padded(left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(map(len, SAMPLES))
    ids, mask = (torch.zeros(len(SAMPLES), longest, dtype=torch.long) for _ in range(2))
    for row, s in enumerate(SAMPLES):
        where = slice(longest - len(s), longest) if left else slice(0, len(s))
        ids[row, where], mask[row, where] = torch.tensor(s), 1
    return ids, mask  # (rows, longest) each


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(the family's model as the library loads it, the same weights as transformers builds them)."""
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_config(request.param)).float().eval()
    reference = copy.deepcopy(model)
    vlm.complete_forward_inputs(model, {1: [IMAGE], 2: [VIDEO]})
    return model, reference


@torch.no_grad()
@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_a_padded_batch_scores_each_sample_as_its_processor_would_alone(family, left):
    """sft.py's batch (right padding, no position ids) and ppo_ray.py's and the reward models' (left padding, the
    1D positions of the attention mask): each row's logits are its sample's alone."""
    model, reference = family
    ids, mask = padded(left)
    positions = (mask.cumsum(-1) - 1).clamp(min=0) if left else None
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **image_inputs(range(3))).logits
    for row, s in enumerate(SAMPLES):
        real = mask[row].bool()
        torch.testing.assert_close(logits[row, real], alone(reference, row), atol=1e-5, rtol=1e-4)
    try:  # what the library's forward met before: the batch as it is, without the modality of its tokens
        before = reference(input_ids=ids, attention_mask=mask, position_ids=positions, **image_inputs(range(3)))
    except ValueError as e:  # most families refuse images then
        assert "mm_token_type_ids" in str(e)
    else:  # Qwen2.5-VL places every token as text, silently
        assert (before.logits[0, mask[0].bool()] - alone(reference, 0)).abs().max() > 1e-3


@torch.no_grad()
def test_a_packed_row_scores_each_sample_with_its_own_3d_positions(family):
    """The trainers' --packing_samples row: no attention mask, 1D positions restarting at each sample, the images in
    the samples' order: each sample's logits are its own alone. The model given those 1D positions itself takes
    them as every token's 3D position, so the image tokens are placed wrong (and some families, Qwen2-VL's, find no
    sample boundary in them: every later sample attends to the ones before it)."""
    model, reference = family
    ids, positions, index = pack_rows(*padded(left=False))  # (1, total) each
    logits = model(input_ids=ids, position_ids=positions, use_cache=False,  # as the library calls it: no cache
                   **image_inputs(range(3))).logits[0]  # (total, vocab)
    starts = [0] + torch.tensor(list(map(len, SAMPLES))).cumsum(0).tolist()
    for i in range(3):
        torch.testing.assert_close(logits[starts[i]:starts[i + 1]], alone(reference, i), atol=1e-5, rtol=1e-4)
    flat = reference(input_ids=ids, position_ids=positions, mm_token_type_ids=(ids == IMAGE).int(), use_cache=False,
                     **image_inputs(range(3))).logits[0]
    image = SAMPLES[0].index(IMAGE)
    torch.testing.assert_close(flat[:image], logits[:image], atol=1e-5, rtol=1e-4)  # before the first image
    for start, end in [(image, starts[1]), (starts[1], starts[2])]:  # 1e-3 at least: the tolerance above x 100
        assert (flat[start:end] - logits[start:end]).abs().max() > 1e-3


@torch.no_grad()
def test_the_library_forwards_and_a_scalar_head_read_the_samples_as_alone():
    """next_token_logits (every trainer's log-probs) padded and packed, and a reward model's scores read at each
    sample's last token by sequence_rewards (left padded) and packed_sequence_rewards, whose scalar head hands the
    token ids to the backbone positionally."""
    config = tiny_config("qwen2_5_vl")
    torch.manual_seed(0)
    policy = AutoModelForImageTextToText.from_config(config).float().eval()
    reference = copy.deepcopy(policy)
    vlm.complete_forward_inputs(policy, {1: [IMAGE]})
    ids, mask = padded(left=False)
    logits = next_token_logits(policy, ids, mask, **image_inputs(range(3)))  # (rows, longest - 1, vocab)
    for row in range(3):
        torch.testing.assert_close(logits[row, :len(SAMPLES[row]) - 1], alone(reference, row)[:-1], atol=1e-5,
                                   rtol=1e-4)

    config.num_labels = 1  # a reward model's one score
    head = vlm.sequence_classification_class(config)(config).float().eval()
    vlm.complete_forward_inputs(head, {1: [IMAGE]})
    scores = [head.score(head.model(input_ids=torch.tensor([s]), mm_token_type_ids=(torch.tensor([s]) == IMAGE).int(),
                                    **(image_inputs(range(i, i + 1)) if GRIDS[i] else {})).last_hidden_state[0, -1])
              for i, s in enumerate(SAMPLES)]
    expected = torch.cat(scores)
    torch.testing.assert_close(sequence_rewards(head, *padded(left=True), **image_inputs(range(3))), expected,
                               atol=1e-5, rtol=1e-4)
    ids, positions, _ = pack_rows(*padded(left=False))
    torch.testing.assert_close(packed_sequence_rewards(head, ids, positions, **image_inputs(range(3))), expected,
                               atol=1e-5, rtol=1e-4)


def test_freeze_vision_tower_freezes_the_visual_module_its_merger_with_it(family):
    """--freeze_vision_tower freezes the module built from vision_config, which in these families holds the merger
    (their connector) too; the language model and its head train (docs/vlm.md)."""
    model = copy.deepcopy(family[1])
    assert vlm.freeze_vision_tower(model) == sum(p.numel() for p in model.model.visual.parameters())
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in model.named_parameters() if name.startswith("model.visual.")}
    assert any(".merger." in name for name in frozen)


# The images of the three samples, (width, height): under qwen_images() their grids are GRIDS'.
IMAGE_SIZES = [[(56, 56)], [(84, 28), (28, 56)], []]


def qwen_images():
    """Qwen2-VL's own image processor (its PIL one: the processor around it needs torchvision), keeping images of
    28 x 28 to 112 x 112 pixels at their size."""
    return SimpleNamespace(image_processor=Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28,
                                                                           "longest_edge": 112 * 112}))


def noise_images(i: int) -> list:
    generator = torch.Generator().manual_seed(100 + i)
    return [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=generator, dtype=torch.uint8).numpy())
            for w, h in IMAGE_SIZES[i]]


@torch.no_grad()
@pytest.mark.parametrize("packing, rows", [(False, 3), (True, 3), (False, 2)],
                         ids=["padded", "packed", "micro-batches-of-2"])
def test_ppo_rays_experience_gives_each_micro_batch_its_rows_images_as_the_processor_lays_them(family, packing, rows):
    """ppo_ray.py's experience cuts a batch's image tensors by rows, and Qwen-VL's processor lays a batch's images
    along one axis (pixel_values (patches, ...), image_grid_thw (images, 3)): each row holds its own units
    (vlm.per_row_image_inputs), and each micro-batch, padded or packed, gives the forward its rows' units in order
    (micro-batches of 3 rows: both rows with images at once; of 2: the text row with the one-image row).
    The actor's log-probs of each response then equal the model's own forward of its sample alone, with the
    processor's tensors for that sample's images."""
    from test_ppo_packing import RecordingEngine, worker

    from common.model_worker import ModelWorker

    model, reference = family
    processor, images = qwen_images(), [noise_images(i) for i in range(3)]
    assert not vlm.lays_images_by_row(processor)
    prompts, responses = [s[:-3] for s in SAMPLES], [[{"token_ids": s[-3:], "logprobs": None}] for s in SAMPLES]
    batch = ppo_ray.build_batch(prompts, responses, 0) | vlm.per_row_image_inputs(
        processor, [{"images": row} for row in images])  # (rows, ...) each
    assert batch["pixel_values_units"].tolist() == [16, 20, 0] and batch["image_grid_thw_units"].tolist() == [1, 2, 0]
    actor = worker(ModelWorker, RecordingEngine(model), packing_samples=packing, micro_train_batch_size=rows)
    logprobs = actor.logprobs(batch)  # (rows, seq - 1)
    for i, s in enumerate(SAMPLES):
        ids = torch.tensor([s])
        inputs = vlm.image_inputs(processor, [{"images": images[i]}], packing=False)  # the sample's alone
        logits = reference(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), **inputs).logits[0, -4:-1]
        torch.testing.assert_close(logprobs[i, len(s) - 4:len(s) - 1], token_logprobs(logits, ids[0, -3:]),
                                   atol=1e-5, rtol=1e-4)


def test_every_family_is_taken_with_the_inputs_it_needs_or_refused_in_one_sentence(tmp_path):
    """complete_forward_inputs relies on what transformers' families with image-dependent rotary positions have in
    common: the backbone's get_rope_index(input_ids, mm_token_type_ids=, image_grid_thw=, attention_mask=) and a
    forward that takes mm_token_type_ids. Every vision-language family transformers 5.19 knows either has that or is
    refused (forward_inputs_not_built), with the families whose processors make other inputs from the text
    (PaliGemma's token_type_ids, Ernie 4.5-VL's expert routing types, ...), so that a family breaking the pattern is
    refused rather than trained on wrong positions, attention or routes."""
    taken, refused = [], []
    for model_type, name in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items():
        model_class = getattr(transformers, name, None)
        if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_class is None:
            continue  # loaded as a text model, or not a class of transformers' own
        if vlm.forward_inputs_not_built(model_class):
            refused.append(model_type)
            continue
        taken.append(model_type)
        backbone = getattr(transformers, MODEL_MAPPING_NAMES.get(model_type) or "", None)
        if hasattr(backbone, "get_rope_index"):
            assert "mm_token_type_ids" in inspect.signature(backbone.forward).parameters, model_type
    assert {"idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v"} <= set(taken)
    assert {"paligemma", "minicpmv4_7", "ernie4_5_vl_moe", "idefics", "kosmos-2", "instructblip"} <= set(refused)

    PaliGemmaConfig().save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"^--pretrain .*: a paligemma model lets the tokens its processor marks in "
                                        r"token_type_ids .* attend both ways, .* \(Idefics3, .*\)\.$"):
        vlm.check_builds_forward_inputs(str(tmp_path))
