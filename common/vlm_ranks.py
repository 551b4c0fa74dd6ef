"""A vision-language model's vision tower runs in every forward of every rank under ZeRO-3, images or not.

ZeRO-3 gathers a module's partitioned weights from every rank when the module's forward starts, a collective: a rank
whose micro-batch holds no image would skip the vision tower and the connector while the other ranks wait in their
gathers (and, the tower trained, in the backward's gradient reduce-scatters): the run hangs, or stops on a collective
whose sizes differ. So where ZeRO-3 runs on several ranks, a forward that reaches the language model without having
run the tower runs it there on one small real image, and adds its features times zero to the language model's input
embeddings: every rank gathers the same modules in the same order as a rank with images does, the tower's and the
connector's parameters get gradients of exactly zero, and the loss and every metric stay as they were (x + 0 = x).
The image is a real one because Idefics3 drops all-zero padding images before its tower, which then fails on an empty
batch.
"""

import inspect

from common.args import UserError
from common.vlm import backbone, language_model, vision_tower

# Red: no channel normalises to 0, so no family takes it for a padding image; the image processor resizes it.
STAND_IN_IMAGE = ((28, 28), "red")


def run_tower_in_every_forward(model, processor) -> None:
    """Make every forward of the vision-language `model` run its vision tower and connector (its backbone's
    get_image_features), on a stand-in image where the micro-batch holds none, its features joining the graph with
    weight zero. `processor`: the model's, which turns the stand-in image into the tower's inputs.

    Only what ZeRO-3 on several ranks needs (deepspeed_utils.load_model installs it there alone): elsewhere a forward
    without images skips the tower, as the model does by itself."""
    core, language = backbone(model), language_model(model)
    if not hasattr(core, "get_image_features") or language is None:
        raise cannot_stand_in(model, "has no get_image_features or no language model of its text_config")
    from PIL import Image

    encoded = processor.image_processor(images=[[Image.new("RGB", *STAND_IN_IMAGE)]], return_tensors="pt")
    takes = inspect.signature(core.get_image_features).parameters  # pixel_values, pixel_attention_mask, image_grid_thw
    stand_in = {key: value for key, value in encoded.items() if key in takes}  # (1, ...) each
    ran = {"tower": False}  # whether the tower ran since the backbone's forward began
    core.register_forward_pre_hook(lambda *_: ran.update(tower=False))
    vision_tower(model).register_forward_pre_hook(lambda *_: ran.update(tower=True))

    def without_images(module, args: tuple, kwargs: dict):
        if ran["tower"]:
            return None
        embeds = kwargs.get("inputs_embeds")  # (rows, seq, hidden)
        if embeds is None:  # BLIP's backbone: its text model is fed no image features
            raise cannot_stand_in(model, "hands its language model no input embeddings")
        features = core.get_image_features(**{key: value.to(embeds.device) for key, value in stand_in.items()},
                                           return_dict=True)
        features = getattr(features, "pooler_output", features)  # the connector's output, what a forward merges
        total = sum(f.sum() for f in (features if isinstance(features, (tuple, list)) else [features]))
        return args, dict(kwargs, inputs_embeds=embeds + 0 * total.to(embeds.dtype))

    language[1].register_forward_pre_hook(without_images, with_kwargs=True)


def cannot_stand_in(model, why: str) -> UserError:
    """The refusal of a family whose vision tower cannot run on a stand-in image in a forward without images."""
    return UserError(f"a {model.config.model_type} model {why}, so it cannot run its vision tower on a micro-batch "
                     f"without images, which every rank must do under ZeRO-3 on several ranks: train it with "
                     f"--zero_stage 2, or on one rank.")
