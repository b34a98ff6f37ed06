"""`shardtune export --merge`: a LoRA checkpoint -> the base model with the adapters merged, as full HF safetensors.

Streamed: each base weight is read alone (from the base checkpoint's files, mmap), gets its adapter's update
W + (alpha/r) * B @ A in fp32, is cast back to the base's dtype and appended to the current output file, which is
written once it reaches `max_shard_bytes`. Peak memory: about one output file plus the adapters (small), never the
whole model. A random-init base (a run with model.init=random) exists on no disk: it is rebuilt from the run's
seed, whole (such bases are the small ones of demos and tests).

The adapters come from a sharded checkpoint (`checkpoints/step_N`) or from a run's `final/` (a PEFT adapter folder);
either way the run's recipe.yaml says which base they were trained over.
"""
from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from shardtune.checkpoint.generation import write_generation_config
from shardtune.checkpoint.paths import TRAINER_FILE
from shardtune.checkpoint.writer import write_safetensors
from shardtune.errors import UserError
from shardtune.hub import WEIGHTS, model_dir
from shardtune.model.loading import CheckpointFiles, checkpoint_key
from shardtune.model.lora import ADAPTER_WEIGHTS


def is_adapter_folder(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file() and (folder / ADAPTER_WEIGHTS).is_file()


def merge_checkpoint(ckpt: Path, out: Path, *, max_shard_bytes: int,
                     progress: Callable[[int, int, str], None] | None = None) -> list[Path]:
    """`ckpt`: a LoRA run's checkpoint, or its final/ adapter folder."""
    from peft import LoraConfig

    from shardtune.checkpoint.consolidate import adapter_tensors

    final = is_adapter_folder(ckpt)
    if not final and not json.loads((ckpt / TRAINER_FILE).read_text()).get("lora"):
        raise UserError(f"export --merge: '{ckpt}' is a full fine-tune, not a LoRA run: export it without --merge")
    hf = ckpt if final else ckpt / "hf"
    config = LoraConfig.from_pretrained(str(hf))
    if getattr(config, "use_rslora", False):
        raise UserError("export --merge: rsLoRA adapters are not supported: export the adapter without --merge")
    scale = config.lora_alpha / config.r
    adapters = _peft_tensors(ckpt) if final else adapter_tensors(ckpt)  # {parameter name: tensor}
    recipe = _run_recipe(ckpt.parent if final else ckpt.parent.parent)
    experts = {}
    if getattr(config, "target_parameters", None):  # per-expert adapters of fused expert weights (model/experts.py)
        adapters, experts = _expert_deltas(adapters, recipe, config, peft_layout=final)
    deltas = _deltas(adapters) | experts
    with ExitStack() as stack:
        written = write_safetensors(_merged(_base_tensors(recipe, stack), deltas, scale), out,
                                    max_shard_bytes=max_shard_bytes, progress=progress)
    for p in hf.iterdir():
        if p.is_file() and p.name not in ("params.json", "adapter_config.json", ADAPTER_WEIGHTS):
            shutil.copy(p, out / p.name)  # the tokenizer (and a checkpoint's config.json)
    if final:  # an adapter folder holds no config.json: the base's
        from shardtune.model.build import load_config

        load_config(recipe.model).save_pretrained(out)
    write_generation_config(out)
    return written


def _peft_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """A PEFT adapter file's tensors by module name (`base_model.model.` dropped: `...q_proj.lora_A.weight`)."""
    from safetensors.torch import load_file

    return {k.removeprefix("base_model.model."): t for k, t in load_file(str(folder / ADAPTER_WEIGHTS)).items()}


def _deltas(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Base weight key -> (A, B): `...q_proj.lora_A.default.weight` pairs with `...q_proj.weight`."""
    out = {}
    for name, a in adapters.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]
        b = adapters[name.replace(".lora_A.", ".lora_B.")]
        out[checkpoint_key(module + ".weight")] = (a.float(), b.float())
    return out


def _expert_deltas(adapters: dict[str, torch.Tensor], recipe, config, *, peft_layout: bool
                   ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(the Linears' adapters, the experts' factors by base key). The meta model says which modules hold experts
    and their storage order. `peft_layout`: final/'s tensors, in peft's target_parameters layout, read back to ours."""
    from transformers import AutoModelForCausalLM

    from shardtune.model.build import load_config
    from shardtune.model.experts import expert_modules, expert_tensors_from_peft, merge_factors
    from shardtune.model.loading import build_empty

    model = build_empty(lambda: AutoModelForCausalLM.from_config(load_config(recipe.model)))
    if peft_layout:
        adapters = expert_tensors_from_peft(adapters, list(config.target_parameters),
                                            {name for name, _ in expert_modules(model)}, r=config.r)
    factors = {checkpoint_key(k): v for k, v in merge_factors(adapters, model).items()}
    return {k: t for k, t in adapters.items() if not k.endswith((".lora_A", ".lora_B"))}, factors


def _run_recipe(run_dir: Path):  # -> Recipe
    from shardtune.config.load import load_recipe

    recipe_file = run_dir / "recipe.yaml"
    if not recipe_file.is_file():
        raise UserError(f"export --merge: no recipe.yaml in the run directory '{run_dir}': the base model "
                        "is unknown; merge from a checkpoint or final/ inside its run directory")
    return load_recipe(recipe_file)


def _base_tensors(recipe, stack: ExitStack) -> Iterator[tuple[str, int, Callable[[], torch.Tensor]]]:
    """(key, bytes, read) for every base weight, in file order; `read` loads that one tensor."""
    if recipe.model.init == "pretrained":
        files = stack.enter_context(CheckpointFiles(model_dir(recipe.model.path, WEIGHTS)))
        for key in files.files:
            sl = files.handle(key).get_slice(key)
            itemsize = {"F32": 4, "BF16": 2, "F16": 2}.get(sl.get_dtype(), 4)
            yield key, math.prod(sl.get_shape()) * itemsize, (lambda k=key: files.handle(k).get_tensor(k))
        return
    from shardtune.model.build import build_model

    model = build_model(recipe.model, seed=recipe.train.seed)
    tied = set(getattr(model, "_tied_weights_keys", None) or []) if model.config.tie_word_embeddings else set()
    for key, t in model.state_dict().items():
        if key not in tied:
            yield key, t.numel() * t.element_size(), (lambda t=t: t)


def _merged(items: Iterator, deltas: dict, scale: float) -> list[tuple[str, int, Callable[[], torch.Tensor]]]:
    """The base items, each `read` merging its adapter (if any) in fp32 and casting back to the base's dtype."""
    def reader(key: str, read: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        if key not in deltas:
            return read
        a, b = deltas[key]
        return lambda: (lambda t: (t.float() + scale * (b @ a)).to(t.dtype))(read())

    items = list(items)
    missing = sorted(set(deltas) - {key for key, _, _ in items})
    assert not missing, f"adapters without a base weight: {missing[:3]}"
    return [(key, nbytes, reader(key, read)) for key, nbytes, read in items]

