"""Vision-language models: images in dataset rows, the model's processor, and the vision tower in training.

A row's messages hold images as content parts, in the form processors take: {"type": "image", "image": ...} beside
{"type": "text", "text": ...} (transformers' "path", "url" and "base64" keys and OpenAI's "image_url" parts are read
too). The image is a path relative to the dataset file's folder, an absolute path, or base64 (a
`data:image/...;base64,` URI or the bare base64 text). Each image is read and decoded while the data loads, so a
bad one stops the run before anything trains, with the file and sample named.

The chat template writes one placeholder per image part (Idefics3's "<image>"); a sample's tokens are the rendered
text's tokens with each placeholder replaced by what the processor expands it into for that image (markers and one
token per image feature). Truncation never cuts into an image's tokens: a sample whose images end past --max_len is
refused, since a model cannot read part of an image. The images themselves stay in the sample, and the batch's
pixel values are computed when it is collated, in the order their placeholders appear, as the model's forward reads
them.
"""

import base64
import binascii
import functools
import hashlib
import inspect
import io
import json
import os
import re
import sys

import torch

from common.args import UserError, config_file
from common.data import (DataError, as_messages, check_margin_key, checked_samples, get_key, get_response, pad_collate,
                         render_chat, row_margin, sample_context, tokenize_with_spans, truncated_sample,
                         unfinished_flag, without_the_end)


def is_vision_language(path: str) -> bool:
    """Whether the model folder's config.json describes a vision-language model that only loads as one: it has a
    vision_config and transformers has no causal-LM class for its type. The families transformers also loads as causal
    LMs (Gemma 3, Llama 4, Qwen3.5, ...) keep training as text models, as they did before images were taken."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    file = config_file(path)
    if file is None:
        return False
    with open(file) as f:
        config = json.load(f)
    return "vision_config" in config and config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def load_processor(path: str, flag: str = "--pretrain"):
    """The model's processor (tokenizer, image processor, chat template), as AutoProcessor loads it."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"{flag} {path}: no processor could be loaded for this vision-language model ({e}); save "
                        f"the processor beside the model (processor.save_pretrained).") from None
    if getattr(processor, "image_processor", None) is None or not getattr(processor, "image_token", None):
        raise UserError(f"{flag} {path}: its processor has no image processor or image token, so it cannot read "
                        f"images; give a vision-language model's folder with its processor saved.")
    check_builds_forward_inputs(path, flag)
    tokenizer = processor.tokenizer
    if tokenizer.eos_token is None:
        raise UserError(f"{flag} {path}: its tokenizer has no end-of-sequence token, which ends every response these "
                        f"scripts train on or generate; set eos_token in its tokenizer_config.json.")
    if tokenizer.pad_token is None:  # padding is always masked out
        tokenizer.pad_token = tokenizer.eos_token
    return processor


def check_builds_forward_inputs(path: str, flag: str = "--pretrain") -> None:
    """Refuse a family whose forward needs an input that this library does not build (forward_inputs_not_built),
    before anything loads."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, AutoConfig

    if config_file(path) is None:  # a processor's folder alone
        return
    config = AutoConfig.from_pretrained(path)
    model_class = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)
    reason = model_class and forward_inputs_not_built(model_class)
    if reason:
        raise UserError(f"{flag} {path}: a {config.model_type} model {reason}; give a vision-language model of another "
                        f"family (Idefics3, SmolVLM, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, ...).")


# What some families' processors make from the text beside the token ids, which these scripts do not build (found by
# walking every vision-language family of transformers 5.19, tests/test_vlm_families.py): Ernie 4.5-VL's expert
# routing types, Idefics' (v1) and Kosmos-2's image masks, InstructBLIP's Q-Former prompt.
TEXT_SIDE_INPUTS = ("moe_mm_token_type_ids", "image_attention_mask", "image_embeds_position_mask", "qformer_input_ids")


def forward_inputs_not_built(model_class: type) -> str | None:
    """What a vision-language family's forward reads that neither the image processor nor complete_forward_inputs
    gives it, in words, or None. Without such an input the model trains and is scored on other attention, positions
    or routes than it was made for, silently.
    - `token_type_ids`: PaliGemma's processor marks the image and the prompt, which attend both ways.
    - TEXT_SIDE_INPUTS, which their processors make from the text.
    - rotary positions computed from image inputs other than `image_grid_thw` (MiniCPM-V 4.7's target sizes), which
      complete_forward_inputs does not hand to the family's get_rope_index."""
    from transformers import MODEL_MAPPING

    forward = inspect.signature(model_class.forward).parameters
    if "token_type_ids" in forward:
        return ("lets the tokens its processor marks in token_type_ids (the image and the prompt) attend both ways, "
                "and these scripts compute every token causally")
    text_side = [name for name in TEXT_SIDE_INPUTS if name in forward]
    if text_side:
        return f"reads {text_side[0]}, which its processor makes from the text and these scripts do not build"
    rope = getattr(MODEL_MAPPING.get(model_class.config_class, None), "get_rope_index", None)
    takes = {"mm_token_type_ids", "image_grid_thw", "attention_mask"}
    if rope and not takes <= set(inspect.signature(rope).parameters):
        return ("places image tokens at rotary positions computed from inputs other than image_grid_thw, which these "
                "scripts do not hand it")
    return None


def sequence_classification_class(config) -> type:
    """A scalar-head class for a vision-language model (rm.py's reward models, ppo_ray.py's critic), built as
    transformers builds LlamaForSequenceClassification: the family's backbone (AutoModel: vision tower, connector,
    language model) under `model` and a linear `score` head on its last hidden states, read at the last token.

    transformers 5.19 has no such class for a VLM family, and its forward reads the images (pixel_values go on to the
    backbone), so the reward depends on them. Its weights are the VLM checkpoint's names without the LM head
    (`model.vision_model...`, `model.text_model...`) plus `score.weight`, the layout of a text reward model:
    from_pretrained of a VLM folder starts a fresh head, of a folder rm.py saved reloads the trained one. `config`:
    the model's config, or its folder.
    """
    from transformers import AutoConfig

    return _scalar_head_class(type(AutoConfig.from_pretrained(config) if isinstance(config, str) else config))


@functools.cache  # one class per family, so that every load of it makes the same class
def _scalar_head_class(config_class: type) -> type:
    from transformers import MODEL_MAPPING, PreTrainedModel
    from transformers.modeling_layers import GenericForSequenceClassification

    backbone = MODEL_MAPPING[config_class]  # AutoModel's class, e.g. Idefics3Model: tower, connector, language model
    family = next(c for c in backbone.__mro__[1:] if issubclass(c, PreTrainedModel))  # Idefics3PreTrainedModel
    name = backbone.__name__.removesuffix("Model") + "ForSequenceClassification"
    return type(name, (GenericForSequenceClassification, family), {"__module__": __name__})


def vision_tower(model) -> torch.nn.Module:
    """The submodule that encodes images: the one built from the model's vision_config (Idefics3's vision_model,
    Qwen-VL's visual, LLaVA's vision_tower)."""
    model = getattr(model, "module", model)
    vision_config = model.config.vision_config
    for module in model.modules():
        if getattr(module, "config", None) is vision_config and module is not model:
            return module
    raise UserError(f"found no vision tower in the {type(model).__name__} (no module built from its vision_config); "
                    f"train it with --freeze_vision_tower false, or give a model whose tower transformers builds.")


def freeze_vision_tower(model) -> int:
    """Stop the vision tower's training (the connector and the language model still train); returns the number of
    parameters frozen. The optimizer then holds no state for them."""
    tower = vision_tower(model)
    tower.requires_grad_(False)
    return sum(getattr(p, "ds_numel", p.numel()) for p in tower.parameters())


def outside_language_model(model) -> list[str]:
    """The names of a vision-language model's modules outside its language model and output head (the vision tower,
    the connector and their parents), [] for a text model. LoRA here adapts the language model alone: an adapter in
    the tower would train what --freeze_vision_tower keeps, and all-linear would otherwise put one there."""
    if getattr(model.config, "vision_config", None) is None:
        return []
    found = language_model(model)
    if found is None:
        raise UserError(f"found no language model in the {type(model).__name__} (no module built from its "
                        f"text_config) to put LoRA adapters on; train it whole, without --lora_rank.")
    language = found[0]
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules() if name and module is not head
            and name != language and not name.startswith(language + ".")]


def language_model(model) -> tuple[str, torch.nn.Module] | None:
    """The name and module of a vision-language model's language model (the module built from its text_config), or
    None."""
    text_config = getattr(model.config, "text_config", None)
    return next(((name, module) for name, module in model.named_modules()
                 if name and getattr(module, "config", None) is text_config), None)


def backbone(model) -> torch.nn.Module:
    """A vision-language model's backbone, its AutoModel class (e.g. Idefics3Model: tower, connector, language model),
    inside the generation or scalar-head model."""
    from transformers import MODEL_MAPPING

    return next(m for m in model.modules() if isinstance(m, MODEL_MAPPING[type(model.config)]))


# ------------------------------------------------------------------------------- inputs the tokens decide
def modality_token_ids(processor) -> dict[int, list[int]]:
    """The tokens of each modality as the processor types them in `mm_token_type_ids` (1 image, 2 video, 3 audio):
    its placeholder tokens, and for some families their begin and end markers too."""
    kinds = {1: processor.image_token_ids, 2: processor.video_token_ids, 3: processor.audio_token_ids}
    return {kind: [i for i in ids if i is not None] for kind, ids in kinds.items() if any(i is not None for i in ids)}


def complete_forward_inputs(model, modality_ids: dict[int, list[int]]) -> None:
    """Make the backbone of a vision-language model (its AutoModel class, e.g. Qwen2_5_VLModel, inside the
    generation or scalar-head model) complete what its processor would have given it from the tokens, whichever of
    this library's forwards calls it: the padded and packed batches of every trainer, the reward models, the critic.

    - `mm_token_type_ids` (Qwen-VL, GLM-4V, ...): each token's modality, a function of its id alone
      (modality_token_ids); without it the forward refuses images.
    - The position ids of a family whose rotary positions depend on its images (a `get_rope_index`: Qwen-VL's and
      GLM-4V's 3D rope, where an image's tokens take its grid's rows and columns). The 1D positions this library
      passes would be taken as every token's, silently, so a padded batch's are dropped and the model computes its
      own from the attention mask; a packed row (no mask, positions restarting at each sample) gets each sample's 3D
      positions as its own row would, after the 1D ones, where the model reads the sample boundaries."""
    module = backbone(model)
    typed = "mm_token_type_ids" in inspect.signature(type(module).forward).parameters
    hook = functools.partial(_complete_inputs, modality_ids=modality_ids if typed else None,
                             rope_from_images=hasattr(module, "get_rope_index"))
    module.register_forward_pre_hook(hook, with_kwargs=True)


def _complete_inputs(backbone, args: tuple, kwargs: dict, modality_ids, rope_from_images: bool):
    if args:  # GenericForSequenceClassification hands input_ids on positionally
        kwargs, args = dict(kwargs, input_ids=args[0]), args[1:]
    ids = kwargs.get("input_ids")  # (rows, seq)
    if ids is None:
        return None
    if modality_ids and kwargs.get("mm_token_type_ids") is None:
        types = torch.zeros_like(ids, dtype=torch.int32)  # (rows, seq)
        for kind, token_ids in modality_ids.items():
            types[torch.isin(ids, torch.tensor(token_ids, device=ids.device))] = kind
        kwargs["mm_token_type_ids"] = types
    positions, images = kwargs.get("position_ids"), kwargs.get("image_grid_thw")
    if rope_from_images and images is not None and positions is not None and positions.dim() == 2:
        packed = kwargs.get("attention_mask") is None
        kwargs["position_ids"] = packed_rope_positions(backbone, ids, positions, kwargs) if packed else None
    return args, kwargs


def packed_rope_positions(backbone, ids: torch.Tensor, positions: torch.Tensor, inputs: dict) -> torch.Tensor:
    """The (4, 1, total) position ids of a packed (1, total) row for a model whose rotary positions depend on its
    images: the row's 1D positions, restarting at each sample, then each sample's 3D positions (temporal, height,
    width) as get_rope_index gives them to the sample alone, its images being the next ones in the row's order."""
    starts = (positions[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    lengths = [end - start for start, end in zip(starts, starts[1:])]
    rows = torch.nn.utils.rnn.pad_sequence(ids[0].split(lengths), batch_first=True)  # (samples, longest)
    types = torch.nn.utils.rnn.pad_sequence(inputs["mm_token_type_ids"][0].split(lengths), batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(ids[0, :n]) for n in lengths], batch_first=True)
    rope, _ = backbone.get_rope_index(rows, mm_token_type_ids=types, image_grid_thw=inputs["image_grid_thw"],
                                      video_grid_thw=inputs.get("video_grid_thw"), attention_mask=mask)
    return torch.cat([positions[None], rope[:, mask.bool()][:, None]])  # (1 + 3, 1, total)


# ------------------------------------------------------------------------------------------------ reading images
_DATA_URI = re.compile(r"data:image/[\w.+-]+;base64,", re.ASCII)
_BASE64 = re.compile(r"[A-Za-z0-9+/]{16,}={0,2}", re.ASCII)  # bare base64 text: no dot, unlike a file name


def read_image(value, base_dir: str):
    """A PIL image (RGB) from a path (relative to base_dir, or absolute) or base64 text; a DataError otherwise."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(value, str) or not value:
        raise DataError(f"an image part's 'image' must be a path or base64 text, got {str(value)[:40]!r}.")
    if re.match(r"https?://", value):
        raise DataError(f"image {value[:60]!r} is a web address, which these scripts do not fetch (a run reads its "
                        f"data from disk); download it and give its path.")
    path = os.path.join(base_dir, os.path.expanduser(value))
    base64_text = _DATA_URI.sub("", value, count=1)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            raw, what = f.read(), f"image {path}"
    elif base64_text != value or _BASE64.fullmatch(value):
        try:
            raw = base64.b64decode(base64_text, validate=True)
        except (binascii.Error, ValueError):
            raise DataError(f"image {value[:40]!r}... is not valid base64; fix its encoding.") from None
        what = f"image {value[:40]!r}... (read as base64, there being no such file)"
    else:
        raise DataError(f"image {value!r} does not exist (a relative path is read from the dataset's folder "
                        f"{base_dir or '.'}); fix the path.")
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{what} could not be decoded ({type(e).__name__}: {e}); replace it with a PNG or JPEG "
                        f"file.") from None
    return image.convert("RGB")


# The image parts of chat messages as datasets write them: transformers' ({"type": "image", "image" | "path" | "url" |
# "base64": ...}) and OpenAI's ({"type": "image_url", "image_url": {"url": ...}}, also the Responses API's
# "input_image").
IMAGE_PART_TYPES = ("image", "image_url", "input_image")
IMAGE_SOURCE_KEYS = ("image", "path", "url", "base64", "image_url")


def _is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def image_source(part: dict):
    """Where an image part's image is (a path, a data URI or base64 text), under whichever key its format uses."""
    for key in IMAGE_SOURCE_KEYS:
        value = part.get(key)
        value = value.get("url") if isinstance(value, dict) else value
        if value is not None:
            return value.removeprefix("file://") if isinstance(value, str) else value
    return None


def split_images(messages: list[dict], base_dir: str) -> tuple[list[dict], list]:
    """The messages with each image part reduced to {"type": "image"} (what templates render), and the images read,
    in the order of their parts. A part that is neither text nor an image (a video, audio) is refused: a template
    would drop it, or write a placeholder no input fills, and the sample would train without it."""
    rendered, images = [], []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if _is_image_part(part):
                    images.append(read_image(image_source(part), base_dir))
                    part = {"type": "image"}
                elif not (isinstance(part, dict) and part.get("type") == "text"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise DataError(f"a message part of type {kind!r}: these scripts read text parts "
                                    f"({{\"type\": \"text\", \"text\": ...}}) and image parts "
                                    f"({{\"type\": \"image\", \"image\": path or base64}}) only; convert or "
                                    f"remove it.")
                parts.append(part)
            message = dict(message, content=parts)
        rendered.append(message)
    return rendered, images


def prompts_with_images(prompts: list, source: str) -> tuple[list, list[list]]:
    """Prompts for sampling (rejection_sampling.py): each with its image paths made absolute, so that the rows
    written elsewhere still find them, and the images read, one list per prompt (empty for a text prompt)."""
    folder, absolute, images = dataset_folder(source), [], []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, list):  # a text prompt holds no image
            absolute.append(prompt)
            images.append([])
            continue
        with sample_context(source, i):
            messages = as_messages(prompt)
            images.append(split_images(messages, folder)[1])
        absolute.append([dict(m, content=[_absolute(part, folder) for part in m["content"]])
                         if isinstance(m["content"], list) else m for m in messages])
    return absolute, images


def _absolute(part, folder: str):
    """An image part as {"type": "image", "image": ...}, its path made absolute if it was relative; any other part as
    it is."""
    if not _is_image_part(part):
        return part
    source = image_source(part)
    path = os.path.join(folder, os.path.expanduser(source))
    return {"type": "image", "image": os.path.abspath(path) if os.path.isfile(path) else source}


def rows_with_images(rows: list[dict], key: str) -> int:
    """How many rows hold an image part under `key` (a text model is refused such rows)."""
    def has_image(value) -> bool:
        return isinstance(value, list) and any(
            isinstance(m, dict) and isinstance(m.get("content"), list)
            and any(_is_image_part(p) for p in m["content"]) for m in value)

    return sum(has_image(row.get(key)) for row in rows)


def check_takes_images(rows: list[dict], key: str, source: str, model_path: str) -> None:
    """Refuse image rows for a model that takes no images, before the chat template would fail on them."""
    count = rows_with_images(rows, key)
    if count and not is_vision_language(model_path):
        raise DataError(f"{source}: {count} rows hold images under {key!r}, and the model {model_path} takes none "
                        f"(its config has no vision_config); give a vision-language model, or remove the images.")


# ------------------------------------------------------------------------------------------------------ samples
def image_token_ids(processor, image) -> list[int]:
    """The tokens the processor writes in place of one image's placeholder: its markers and feature tokens."""
    encoded = processor(text=[processor.image_token], images=[[image]], add_special_tokens=False)
    return list(encoded["input_ids"][0])


def tokenize_with_images(processor, text: str, spans: list[tuple[int, int]], images: list):
    """Tokenize a rendered text whose image placeholders are expanded: (input_ids, loss_mask, end of the last image's
    tokens). The placeholder is a special token, so the text around it tokenizes alike alone or whole."""
    pieces = text.split(processor.image_token)
    if len(pieces) - 1 != len(images):
        raise DataError(f"the rendered text holds {len(pieces) - 1} image placeholders {processor.image_token!r} "
                        f"for {len(images)} image parts; remove that token from the text parts (an image goes "
                        f"into the messages as a part, {{\"type\": \"image\", \"image\": path}}, and the chat "
                        f"template writes its placeholder).")
    ids, mask, offset, images_end = [], [], 0, 0
    for k, piece in enumerate(pieces):
        piece_spans = [(s - offset, e - offset) for s, e in spans]
        piece_ids, piece_mask = tokenize_with_spans(processor.tokenizer, piece, piece_spans)
        ids, mask = ids + piece_ids, mask + piece_mask
        if k < len(images):
            expansion = image_token_ids(processor, images[k])
            ids, mask = ids + expansion, mask + [0] * len(expansion)
            images_end = len(ids)
        offset += len(piece) + len(processor.image_token)
    return ids, mask, images_end


def vlm_sample(processor, messages: list[dict], base_dir: str, max_len: int,
               end_with_eos: bool = False, unfinished: bool = False) -> tuple[dict, bool]:
    """One conversation with images as {"input_ids", "loss_mask", "images"}, its assistant turns trained on, and
    whether it was truncated to max_len. Truncation never cuts into an image: a DataError instead. An `unfinished`
    last turn (cut at a sampler's length limit) is trained without the end the template gives it."""
    return sample_of_read_images(processor, *split_images(messages, base_dir), max_len, end_with_eos, unfinished)


def sample_of_read_images(processor, messages: list[dict], images: list, max_len: int,
                          end_with_eos: bool = False, unfinished: bool = False) -> tuple[dict, bool]:
    """vlm_sample of messages whose images are read already (split_images' two results). `end_with_eos` ends the
    response at its EOS, where a reward model reads it, as common.data does for text reward models."""
    text, spans = render_chat(processor.tokenizer, messages)
    if unfinished:
        spans[-1] = without_the_end(text, spans[-1], messages[-1]["content"])
    ids, mask, images_end = tokenize_with_images(processor, text, spans, images)
    if images_end + end_with_eos > max_len:  # a reward model's EOS must fit after the images too
        raise DataError(f"its images end at token {images_end}, past --max_len {max_len - end_with_eos}, and an "
                        f"image cut short cannot be read; raise --max_len, or give this row fewer or smaller images.")
    mask[0] = 0  # the first token has nothing before it to be predicted from
    sample, truncated = truncated_sample(ids, mask, max_len, processor.tokenizer.eos_token_id if end_with_eos else None)
    return {**sample, "images": images}, truncated


def dataset_folder(source: str) -> str:
    """Where a dataset's relative image paths start: the folder of its file, or the folder itself."""
    return os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else source


def build_vlm_sft_samples(rows, processor, source, input_key, output_key, max_len, log=print) -> list[dict]:
    """Tokenize rows with images for SFT into {"input_ids", "loss_mask", "images"}, rendered with the chat template.

    Truncated as common.data.build_sft_samples truncates, never into an image's tokens (a DataError that names the
    sample); a sample left with no trained token is dropped and counted.
    """
    if not rows:
        raise DataError(f"dataset {source} is empty.")
    samples, truncated, dropped = [], 0, 0
    for i, row in enumerate(rows):
        with sample_context(source, i):
            if isinstance(row.get(input_key), list) and output_key not in row:
                messages = as_messages(row[input_key])
            else:
                response = get_response(row, output_key, i, source, input_key)
                messages = as_messages(get_key(row, input_key, i, source))
                messages = messages + [{"role": "assistant", "content": response}]
            sample, cut = vlm_sample(processor, messages, dataset_folder(source), max_len)
        truncated += cut
        if sum(sample["loss_mask"]) == 0:
            dropped += 1
            continue
        samples.append(sample)
    return checked_samples(samples, source, max_len, log, truncated, dropped, f"of {len(rows)} samples")


def build_vlm_preference_samples(rows, processor, source, input_key, chosen_key, rejected_key, max_len,
                                 log=print, margin_key=None, end_with_eos=False) -> list[dict]:
    """Tokenize preference pairs whose prompts hold images into {"chosen", "rejected", "margin"} (dpo.py, rm.py), each
    side a vlm_sample of the prompt's messages and its response (rm.py's `end_with_eos`: ended at its EOS). Pairs
    left without a response token, or with two identical ones, are skipped and counted, and `margin` read, as
    common.data.build_preference_samples does."""
    if not rows:
        raise DataError(f"dataset {source} is empty.")
    check_margin_key(rows, margin_key, source, log)
    samples, truncated, dropped, identical = [], 0, 0, 0
    for i, row in enumerate(rows):
        with sample_context(source, i):
            prompt = as_messages(get_key(row, input_key, i, source))
            pair = {"margin": row_margin(row, margin_key, source, i)}
            for side, key in (("chosen", chosen_key), ("rejected", rejected_key)):
                response = get_response(row, key, i, source, input_key)
                pair[side], cut = vlm_sample(processor, prompt + [{"role": "assistant", "content": response}],
                                             dataset_folder(source), max_len, end_with_eos,
                                             unfinished_flag(row, key, i, source))
                truncated += cut
        if not sum(pair["chosen"]["loss_mask"]) or not sum(pair["rejected"]["loss_mask"]):
            dropped += 1
        elif pair["chosen"]["input_ids"] == pair["rejected"]["input_ids"]:
            identical += 1
        else:
            samples.append(pair)
    if identical:
        log(f"warning: {source}: skipped {identical} of {len(rows)} pairs whose {chosen_key!r} and {rejected_key!r} "
            f"are identical (or differ only past --max_len {max_len}).")
    return checked_samples(samples, source, max_len, log, truncated, dropped, "responses", "pairs")


def build_vlm_kto_samples(rows, processor, source, input_key, output_key, label_key, max_len,
                          log=print) -> list[dict]:
    """Tokenize unpaired feedback whose prompts hold images (kto.py) into vlm_sample's {"input_ids", "loss_mask",
    "images"} with "label" (a JSON boolean), and what mismatched_pair puts another response after: the prompt's
    messages and the response. "prompt_text", which tells prompts apart (kto.py's mismatched_partners), is the
    rendered prompt followed by its images' digests: the image task's prompts share their text."""
    if not rows:
        raise DataError(f"dataset {source} is empty.")
    samples, truncated, dropped = [], 0, 0
    for i, row in enumerate(rows):
        with sample_context(source, i):
            prompt, response = as_messages(get_key(row, input_key, i, source)), get_response(row, output_key, i,
                                                                                                source, input_key)
            label = get_key(row, label_key, i, source)
            if not isinstance(label, bool):
                raise DataError(f"{label_key!r} must be true or false (a JSON boolean), got {label!r}.")
            messages, images = split_images(prompt, dataset_folder(source))
            sample, cut = sample_of_read_images(processor, messages + [{"role": "assistant", "content": response}],
                                                images, max_len)
        truncated += cut
        if sum(sample["loss_mask"]) == 0:
            dropped += 1
            continue
        digests = [hashlib.sha256(image.tobytes()).hexdigest()[:16] for image in images]
        samples.append({**sample, "label": label, "prompt_messages": messages, "response": response,
                        "prompt_text": render_chat(processor.tokenizer, messages)[0] + " ".join(digests)})
    return checked_samples(samples, source, max_len, log, truncated, dropped, f"of {len(rows)} samples")


def mismatched_pair(processor, sample: dict, other: dict, max_len: int) -> dict:
    """`sample`'s prompt, its images included, followed by `other`'s response (build_vlm_kto_samples' samples): KTO's
    mismatched pair, rendered and expanded as a sample is."""
    messages = sample["prompt_messages"] + [{"role": "assistant", "content": other["response"]}]
    return sample_of_read_images(processor, messages, sample["images"], max_len)[0]


def image_inputs(processor, samples: list[dict], packing: bool) -> dict[str, torch.Tensor]:
    """The forward's image tensors for a collated batch (Idefics3: pixel_values (batch, images, 3, H, W) and their
    pixel_attention_mask): one row of images per padded sample, or one for the packed row; {} without images."""
    rows = [sum((s["images"] for s in samples), [])] if packing else [s["images"] for s in samples]
    if not any(rows):
        return {}
    encoded = processor.image_processor(images=rows, return_tensors="pt")
    return {key: value for key, value in encoded.items() if isinstance(value, torch.Tensor)}


def check_trainer_args(args) -> bool:
    """Refuse the trainer flags that cannot apply to a vision-language --pretrain, from its config.json; returns
    whether it is one. Its rows are chat messages with image parts, which only its chat template renders."""
    if not is_vision_language(args.pretrain):
        return False
    refused = [(not args.apply_chat_template, "needs --apply_chat_template (image parts are chat-message content)"),
               (getattr(args, "pretrain_mode", False), "takes no --pretrain_mode (its rows are chat messages)"),
               (getattr(args, "lora_rank", 0) and not getattr(args, "freeze_vision_tower", True),
                "trains LoRA adapters on its language model alone, its vision tower frozen: leave out "
                "--freeze_vision_tower false, or --lora_rank to train the tower")]
    for wrong, what in refused:
        if wrong:
            raise UserError(f"--pretrain {args.pretrain} is a vision-language model, which {what}.")
    return True


def text_reward_models(reward_pretrain: list[str] | None) -> tuple[list[str], str]:
    """The --reward_pretrain models that read text alone, and what a vision-language policy's refusal says of them
    (check_sampler_args, check_ppo_args): they could not read its prompts' images."""
    text_models = [path for path in reward_pretrain or [] if not is_vision_language(path)]
    return text_models, (f"is scored by reward models that read its prompts' images, and --reward_pretrain "
                         f"{text_models[0]} is a text model: give one rm.py trained from a vision-language model, or "
                         f"score with --reward_fn or --remote_rm_url" if text_models else "")


def check_sampler_args(args) -> bool:
    """Refuse rejection_sampling.py's flags that cannot apply to a vision-language --pretrain; returns whether it is
    one. Its prompts are chat messages with image parts, which reward models read only when they are vision-language
    models too (rm.py's), and --mode csft writes the reward into a prompt's text."""
    if not is_vision_language(args.pretrain):
        return False
    refused = [(not args.apply_chat_template, "needs --apply_chat_template (image parts are chat-message content)"),
               text_reward_models(args.reward_pretrain),
               unreadable_layouts(args.reward_pretrain or []),
               (args.mode == "csft", "takes --mode best_of_n or dpo_pairs (csft writes rewards into text prompts)")]
    for wrong, what in refused:
        if wrong:
            raise UserError(f"--pretrain {args.pretrain} is a vision-language model, which {what}.")
    return True


# ------------------------------------------------------------------------------------------------------ ppo_ray.py
@functools.cache
def cached_processor(path: str):
    """load_processor, once per process: ppo_ray.py's driver reads every batch's images with it."""
    return load_processor(path)


def policy_processor(pretrain: str):
    """The processor of a vision-language --pretrain (cached_processor), None for a text model."""
    return cached_processor(pretrain) if is_vision_language(pretrain) else None


def prompt_processor(args, rows: list[dict], source: str):
    """The processor that reads ppo_ray.py's prompt images: the --pretrain's for a vision-language model, None for a
    text model, which is refused rows with images."""
    processor = policy_processor(args.pretrain)
    if processor is None:
        check_takes_images(rows, args.input_key, source, args.pretrain)
    return processor


def with_images(entry: dict, processor, source: str) -> dict:
    """A ppo_ray.py prompt ({"prompt", "ids", "label"}, ids of its rendered text) with its images read: `images`,
    `engine_ids` (the rendered text's ids, one placeholder per image, which vLLM expands itself beside the images)
    and `ids` expanded as the processor expands each placeholder, the tokens vLLM returns and the trainer scores."""
    images = split_images(as_messages(entry["prompt"]), dataset_folder(source))[1] if isinstance(
        entry["prompt"], list) else []
    return dict(entry, **image_request(processor, entry["ids"], images, "the rendered prompt"))


def image_request(processor, engine_ids: list[int], images: list, what: str) -> dict:
    """{"ids", "engine_ids", "images"} of a rendered text whose ids (`engine_ids`) hold one placeholder per image:
    `ids` with each placeholder expanded as the processor expands it for its image. A DataError where the
    placeholders and the images differ in number (`what` names the text)."""
    placeholder = image_token_id(processor)
    if engine_ids.count(placeholder) != len(images):
        raise DataError(f"{what} holds {engine_ids.count(placeholder)} image placeholders {processor.image_token!r} "
                        f"for {len(images)} image parts; remove that token from the text (an image goes into the "
                        f"messages as a part, {{\"type\": \"image\", \"image\": path}}, and the chat template "
                        f"writes its placeholder).")
    expanded, pending = [], iter(images)
    for token in engine_ids:
        expanded += image_token_ids(processor, next(pending)) if token == placeholder else [token]
    return {"ids": expanded, "engine_ids": list(engine_ids), "images": images}


def image_token_id(processor) -> int:
    """The id of the processor's image placeholder (Idefics3's <image>), the model config's image_token_id."""
    return processor.tokenizer.convert_tokens_to_ids(processor.image_token)


def continued(prompt: dict, tokens: list[int]) -> dict:
    """The request that goes on from `prompt` with `tokens` after it (a partial sample's tokens so far, an episode's
    turns and replies): its ids and, for an image prompt, its engine ids each followed by the same tokens, and its
    images. Every request of an episode or of a continued sample thus gives vLLM the placeholders with the images,
    which it expands as the trainer's ids are expanded, so that both score the same tokens."""
    request = {"ids": prompt["ids"] + list(tokens)}
    if "engine_ids" in prompt:
        request.update(engine_ids=prompt["engine_ids"] + list(tokens), images=prompt["images"])
    return request


def prompt_images_named(prompt: dict, names: list[str]) -> list:
    """The images of a ppo_ray.py prompt (read already, with_images) that an --agent_fn request names, in the
    request's order; each name is an image part's value as the prompt's row wrote it (a path, base64). A name that is
    none of the prompt's images is refused: a request's images are its prompt's, read when the prompts loaded."""
    known = {}
    if isinstance(prompt["prompt"], list):
        parts = [part for m in as_messages(prompt["prompt"]) if isinstance(m["content"], list)
                 for part in m["content"] if _is_image_part(part)]
        known = {str(image_source(part)): image for part, image in zip(parts, prompt["images"])}
    for name in names:
        if name not in known:
            raise UserError(f"the agent's request holds the image {name[:60]!r}, which is none of its prompt's "
                            f"images; send the prompt's image parts as they were given (a request's images are its "
                            f"prompt's).")
    return [known[name] for name in names]


def check_text_tokens(tokens: list[int], placeholders: list[int], what: str) -> None:
    """Refuse text that would put an image placeholder into an episode after its prompt (an environment's reply, an
    agent's later messages): the model would read an image there that no request carries. `what` names the text."""
    found = sorted(set(tokens) & set(placeholders))
    if found:
        raise UserError(f"{what} holds the image placeholder token {found[0]} (e.g. the text '<image>'), which a "
                        f"vision-language model reads as an image no request carries; keep replies and later "
                        f"messages text without it (an episode's images are its prompt's).")


def placeholder_token_ids(config) -> list[int]:
    """The tokens a vision-language model's forward replaces with image (or video) features (its config's
    image_token_id, video_token_id), which its policy never samples: in a response such a token would be given a
    feature no image provides, and the trainer could not score it. vLLM bans them with a logit bias, the trainer's
    log-probs leave them out (ModelWorker._logprobs); [] for a text model."""
    ids = [getattr(config, key, None) for key in ("image_token_id", "video_token_id")]
    return [i for i in ids if isinstance(i, int)] if getattr(config, "vision_config", None) is not None else []


def engine_prompts(prompts: list[dict]) -> tuple[list[list[int]], list[list] | None]:
    """What vLLM is given for these prompts (or requests, `continued`): each one's ids with a placeholder per image,
    and its images (None for text prompts)."""
    ids = [p.get("engine_ids", p["ids"]) for p in prompts]
    return ids, ([p["images"] for p in prompts] if any(p.get("images") for p in prompts) else None)


def experience_images(pretrain: str, prompts: list[dict], samples: list[list[dict]]) -> dict[str, torch.Tensor]:
    """The forward's image tensors for ppo_ray.py's experience, one row per response in build_batch's order (each
    response sees its prompt's images, or an --agent_fn episode the images its requests carried), every tensor (rows,
    ...) so that the batch is cut by rows like the others (per_row_image_inputs); {} without images."""
    rows = [s.get("images", p.get("images", [])) for p, group in zip(prompts, samples) for s in group]
    if not any(rows):
        return {}
    return per_row_image_inputs(cached_processor(pretrain), [{"images": images} for images in rows])


def per_row_image_inputs(processor, rows: list[dict]) -> dict[str, torch.Tensor]:
    """image_inputs of padded rows with every tensor (rows, ...), so that ppo_ray.py's workers and the reward models
    cut them into micro-batches by rows like the token tensors (forward_images gives the forward its own layout back).

    A processor that gives the images by row (Idefics3's pixel_values (rows, images, 3, H, W)) keeps its tensors. One
    that lays the batch's images along one axis of units (Qwen-VL's pixel_values (patches, ...) and image_grid_thw
    (images, 3), LLaVA's (images, 3, H, W)) has each row's units put in a row of their own, zeros after them, and
    `<key>_units` (rows,) says how many are the row's (check_image_layout probes that a processor is one of the two)."""
    if lays_images_by_row(processor):
        return image_inputs(processor, rows, packing=False)
    alone = [image_inputs(processor, [row], packing=False) for row in rows]  # {key: (the row's units, ...)} each
    inputs = {}
    for key in dict.fromkeys(key for row in alone for key in row):
        units = [row[key] if key in row else None for row in alone]
        shape = next(u for u in units if u is not None).shape[1:]
        counts = [0 if u is None else len(u) for u in units]
        inputs[key] = torch.zeros(len(rows), max(counts), *shape, dtype=next(u for u in units if u is not None).dtype)
        for row, value in enumerate(units):
            if value is not None:
                inputs[key][row, :len(value)] = value
        inputs[f"{key}_units"] = torch.tensor(counts)
    return inputs


def lays_images_by_row(processor) -> bool:
    """Whether the processor's image tensors have one entry per row along their first axis, for rows holding different
    numbers of images (Idefics3's, SmolVLM's); else they are the batch's images laid along one axis of units."""
    return all(value.shape[0] == 2 for value in image_inputs(processor, _probe_rows(), packing=False).values())


def _probe_rows() -> list[dict]:
    """Two rows of one and two images of other sizes, which tell the layouts apart."""
    from PIL import Image

    return [{"images": [Image.new("RGB", (28, 28), "red")]},
            {"images": [Image.new("RGB", (56, 28), "blue"), Image.new("RGB", (28, 56), "green")]}]


def units_in_order(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """per_row_image_inputs' rows of units as the forward takes them: each key's units of every row, one row after
    another (the order the rows' image tokens come in, padded or packed alike)."""
    return {key: torch.cat([value[row, :n] for row, n in enumerate(inputs[f"{key}_units"].tolist())])
            for key, value in inputs.items() if not key.endswith("_units")}


def check_image_layout(path: str) -> bool:
    """Whether the processor of the vision-language model at `path` gives images that per_row_image_inputs can put
    in rows and forward_images give back as the processor lays them for a batch; True for a text model."""
    if not is_vision_language(path):
        return True
    processor = cached_processor(path)
    if lays_images_by_row(processor):
        return True
    expected = image_inputs(processor, _probe_rows(), packing=False)
    try:
        given = units_in_order(per_row_image_inputs(processor, _probe_rows()))
    except RuntimeError:  # rows whose units differ in shape: a batch's images padded to the largest
        return False
    return given.keys() == expected.keys() and all(torch.equal(given[k], expected[k]) for k in given)


def reward_model_batch(processor, prompts: list, responses: list[str], images: list[list], path: str) -> dict:
    """What a vision-language reward model `path` scores, right-padded, one row per response: its prompt's messages
    with the prompt's images (read already, with_images) and the response, ended at its EOS as rm.py's pairs are,
    and the rows' image inputs (Idefics3: pixel_values (rows, images, 3, H, W))."""
    rows = []
    for prompt, response, row_images in zip(prompts, responses, images):
        messages = [dict(m, content=[{"type": "image"} if _is_image_part(part) else part for part in m["content"]])
                    if isinstance(m["content"], list) else m for m in as_messages(prompt)]
        messages.append({"role": "assistant", "content": response})
        rows.append(sample_of_read_images(processor, messages, row_images, sys.maxsize, end_with_eos=True)[0])
    batch = pad_collate(rows, processor.tokenizer.pad_token_id, keys=("input_ids",))
    return {**batch, **(per_row_image_inputs(processor, rows) if any(images) else {})}


def is_image_input(key: str) -> bool:
    """Whether a batch's tensor is an image input of the forward (pixel_values, pixel_attention_mask, image_grid_thw)
    or per_row_image_inputs' count of a row's units, cut by rows only: it has no token axis."""
    return key.startswith(("pixel_", "image_"))


def forward_images(model, batch: dict, packed: bool = False) -> dict[str, torch.Tensor]:
    """The micro-batch's image inputs for the model's forward, or none where its rows hold no image token: a batch of
    padding images alone would run the vision tower on nothing. `packed`: for the forward of its rows packed into one
    (common/modeling.py pack_rows), laid out as packed_image_inputs lays them."""
    inputs = {key: value for key, value in batch.items() if is_image_input(key)}
    if not inputs:  # a text model's batch
        return {}
    image_token = getattr(getattr(model, "module", model).config, "image_token_id", None)
    if not (batch["input_ids"] == image_token).any():
        return {}
    if any(key.endswith("_units") for key in inputs):  # a batch's images along one axis: packed or not alike
        return units_in_order(inputs)
    return packed_image_inputs(inputs) if packed else inputs


def packed_image_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-row image inputs, (rows, images, ...) each (Idefics3: pixel_values (rows, images, 3, H, W) and
    pixel_attention_mask (rows, images, H, W)), as the inputs of those rows packed into one: (1, images, ...), every
    row's images in the order of the rows, which is the order pack_rows packs their tokens in. The forward fills the
    packed row's image tokens with image features in that order, so each packed sample reads its own images.

    The padding images of the rows holding fewer than the batch's most (all zero: the processor pads with zeros, and
    Idefics3's forward drops such images itself) are left out, so the result is what the processor makes of the
    samples' images as one packed row (image_inputs with packing; packs_images_by_row checks a processor does so)."""
    real = torch.stack([value.flatten(2).ne(0).any(-1) for value in inputs.values()]).any(0)  # (rows, images)
    return {key: value[real][None] for key, value in inputs.items()}


def reads_images_alike(policy: str, other: str) -> bool:
    """Whether `other` is a vision-language model whose processor turns an image prompt into the same token ids and
    image tensors as the policy's: ppo_ray.py's teacher then reads the experience's pixel values, which the policy's
    processor made, as it would its own (an image size, a tiling or an image token of its own would not)."""
    from PIL import Image

    if not is_vision_language(other):
        return False
    mine, theirs = cached_processor(policy), cached_processor(other)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?"}]}]
    text = mine.apply_chat_template(messages, add_generation_prompt=True)
    image = [[Image.new("RGB", (40, 24), "red")]]  # not square, so that a resize or a tiling shows
    try:
        a, b = (processor(text=[text], images=image, return_tensors="pt") for processor in (mine, theirs))
    except (ValueError, TypeError):  # a processor that cannot take the other's image layout
        return False
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def packs_images_by_row(processor) -> bool:
    """Whether the processor lays out a packed row's images as packed_image_inputs turns its padded rows into one, so
    that ppo_ray.py can pack the experience's per-row images on its workers (--packing_samples). Idefics3's and
    SmolVLM's do. (A processor that lays a batch's images along one axis of units packs them as it lays them:
    units_in_order serves both.)"""
    from PIL import Image

    rows = [{"images": [Image.new("RGB", (8, 8), colour)]} for colour in ("red", "blue")]
    padded, packed = image_inputs(processor, rows, packing=False), image_inputs(processor, rows, packing=True)
    try:
        from_rows = packed_image_inputs(padded)
    except (IndexError, RuntimeError):  # a tensor with fewer than two axes before its values
        return False
    return packed.keys() == from_rows.keys() and all(
        packed[key].shape == from_rows[key].shape and torch.equal(packed[key], from_rows[key]) for key in packed)


def unreadable_layouts(paths: list[str]) -> tuple[list[str], str]:
    """The vision-language models among `paths` whose processor lays out images in a way per_row_image_inputs cannot
    cut by rows (check_image_layout), and what a refusal (check_sampler_args, check_ppo_args) says of the first."""
    wrong = [path for path in dict.fromkeys(paths) if not check_image_layout(path)]
    return wrong, (f"is trained and scored here in batches cut by rows, and the processor of {wrong[0]} lays out "
                   f"a batch's images neither by row nor as one axis of every image's units that these scripts can "
                   f"cut by rows: give a model whose processor does (Idefics3, SmolVLM, Qwen-VL); the others train "
                   f"with sft.py, rm.py, dpo.py and kto.py" if wrong else "")


def frozen_tower_names(model) -> set[str]:
    """The in-memory names of a vision tower's parameters that do not train (--freeze_vision_tower): the weight sync
    leaves them out, since the engines hold them as loaded. Empty for a text model or a trained tower."""
    model = getattr(model, "module", model)
    if getattr(model.config, "vision_config", None) is None:
        return set()
    tower = {id(p) for p in vision_tower(model).parameters() if not p.requires_grad}
    return {name for name, p in model.named_parameters() if id(p) in tower}


def check_ppo_args(args) -> bool:
    """Refuse ppo_ray.py's flags that cannot apply to a vision-language --pretrain; returns whether it is one. Its
    prompts are chat messages with image parts; reward models and the critic read them only when they are
    vision-language models too (rm.py's, with sequence_classification_class's head), the teacher only when its
    processor reads them as the policy's does. Environments, agents and partial rollouts carry the prompts' images in
    every request (`continued`)."""
    if not is_vision_language(args.pretrain):
        return False
    critic = args.critic_pretrain or (args.reward_pretrain or [args.pretrain])[0]  # common/placement.py critic_path
    refused = [(not args.apply_chat_template, "needs --apply_chat_template (image parts are chat-message content)"),
               text_reward_models(args.reward_pretrain),
               unreadable_layouts([args.pretrain, *(args.reward_pretrain or []), critic]),
               (args.advantage_estimator == "gae" and not is_vision_language(critic),
                f"trains with a critic that reads its prompts' images, and {critic} (where the critic starts) is a "
                f"text model: give --critic_pretrain a vision-language model (the policy, or a reward model rm.py "
                f"trained from one), or a critic-free --advantage_estimator such as grpo"),
               (args.teacher_pretrain and not reads_images_alike(args.pretrain, args.teacher_pretrain),
                f"takes a --teacher_pretrain that is a vision-language model whose processor renders an image prompt "
                f"into the very tokens and pixel values its own does (the teacher reads the experience's images as "
                f"the policy's processor made them), and {args.teacher_pretrain} is not one: give such a teacher, "
                f"or leave out --teacher_pretrain"),
               (args.ptx_data, "takes no --ptx_data here (its pretraining rows hold no images)"),
               (args.lora_rank and not getattr(args, "freeze_vision_tower", True),
                "trains LoRA adapters on its language model alone, its vision tower frozen: leave out "
                "--freeze_vision_tower false, or --lora_rank to train the tower"),
               (args.packing_samples and lays_images_by_row(cached_processor(args.pretrain))
                and not packs_images_by_row(cached_processor(args.pretrain)),
                "is packed here only when its processor lays a packed row's images as it lays each row's "
                "(Idefics3's and SmolVLM's do), and its processor does not: leave out --packing_samples"),
               (getattr(args, "share_prompts", False), "computes each row with its images here: leave out "
                                                       "--share_prompts")]
    for wrong, what in refused:
        if wrong:
            raise UserError(f"--pretrain {args.pretrain} is a vision-language model, which {what}.")
    return True
