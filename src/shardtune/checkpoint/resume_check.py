"""Resume only what this recipe can continue: checked by the launcher before any worker starts (no torch here).

Each checkpoint's trainer.json holds a fingerprint of what defines the run (`fingerprint`, written by the worker).
On resume the launcher compares it with the recipe's:
- the model, tokenizer or LoRA shape differ: the checkpoint cannot be loaded into this model -> exit 2, naming keys;
- the data or the objective differ (sources, format, seq_len, packing, seed, global batch...): continuing would mix
  two trainings silently -> exit 2 unless `train.resume=force`;
- anything else (lr, schedule, max_steps, logging...): allowed, and applied from the resumed step as if the run had
  started with it (checkpoint/manager.py restores only the scheduler's step counter), with a one-line notice of
  what changed since the checkpoint (its trainer.json holds the recipe it trained with); the recipe the run had
  until now is kept as `recipes/step_N.yaml` beside the new `recipe.yaml`.
A different world size keeps the global batch: `train.grad_accum` is scaled when the recipe kept the checkpoint's
micro-batch and accumulation and the new world divides the global batch; otherwise exit 2 with values that work.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from shardtune.checkpoint.paths import TRAINER_FILE, explicit_resume_dir, newest_complete
from shardtune.config.schema import Recipe, data_parallel_size
from shardtune.disk import disk_full, no_space_line, write_text_atomic
from shardtune.errors import UserError
from shardtune.hub import model_dir

# Keys whose change makes the checkpoint unloadable (or loadable into a different model).
INCOMPATIBLE = ("model.architecture", "model.path", "model.init", "model.dtype", "model.tokenizer", "lora.enabled",
                "lora.r", "lora.target_modules", "lora.quantize_base")
# Keys whose change means other rows or another loss from here on.
DATA = ("data.path", "data.format", "data.fields", "data.seq_len", "data.packing", "data.long_docs", "data.num_samples",
        "data.eval_fraction", "model.chat_template", "train.seed", "lora.alpha", "global_batch", "train.objective",
        "dpo.beta", "dpo.loss", "dpo.label_smoothing", "dpo.sft_warmup_steps", "dpo.precompute_reference")
# Not compared with the previous recipe: where and how this launch runs, and the resume choice itself.
_NOT_RECIPE = ("launch.", "hardware.", "train.resume", "description", "train.grad_accum", "train.micro_batch_size",
               "train.output_dir")


def _architecture(recipe: Recipe) -> str:
    """A hash of the HF config.json (architecture only): where the file lives does not matter, what it says does."""
    m = recipe.model
    path = Path(m.config) if m.config else model_dir(m.path or "") / "config.json"  # a Hub id: its cached config
    try:
        text = json.dumps(json.loads(path.read_text()), sort_keys=True)
    except (OSError, ValueError):
        return str(path)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _data_fields(d: Any) -> list[Any]:
    """The columns the format reads and the settings that change its tokens (a data.path list: its entries,
    compared as data.path, carry their own)."""
    from shardtune.data.formats import FORMATS

    fmt = FORMATS[d.format]
    extra = {"instruction": ["template"], "chat": ["chat_style"]}.get(d.format, [])
    on_inputs = ["train_on_inputs"] if d.format in ("instruction", "chat") else []
    return [getattr(d, k) for k in (*fmt.required, *fmt.optional, *extra, *on_inputs)]


def _objective(recipe: Recipe) -> dict[str, Any]:
    """The DPO settings that change the loss or the reference (none for SFT)."""
    if recipe.train.objective != "dpo":
        return {}
    p = recipe.dpo
    return {"dpo.beta": p.beta, "dpo.loss": p.loss, "dpo.label_smoothing": p.label_smoothing,
            "dpo.sft_warmup_steps": p.sft_warmup_steps, "dpo.precompute_reference": p.precompute_reference}


def fingerprint(recipe: Recipe, world_size: int) -> dict[str, Any]:
    """What defines the run, as flat keys (the worker writes it into each checkpoint's trainer.json)."""
    m, lora, d, t = recipe.model, recipe.lora, recipe.data, recipe.train
    fields = _data_fields(d)
    return {"model.architecture": _architecture(recipe), "model.path": m.path, "model.init": m.init,
            "model.dtype": m.dtype, "model.tokenizer": m.tokenizer or m.path, "lora.enabled": lora.enabled,
            "lora.r": lora.r if lora.enabled else None,
            "lora.target_modules": list(lora.target_modules) if lora.enabled else None,
            "lora.quantize_base": lora.quantize_base, "lora.alpha": lora.alpha if lora.enabled else None,
            "data.path": d.path, "data.format": d.format, "data.fields": fields, "data.seq_len": d.seq_len,
            "data.packing": d.packing, "data.long_docs": d.long_docs, "data.num_samples": d.num_samples if "builtin:" in str(d.path)
            else None, "data.eval_fraction": d.eval_fraction,
            "model.chat_template": m.chat_template, "train.seed": t.seed, "train.objective": t.objective,
            **_objective(recipe),
            "global_batch": t.micro_batch_size * t.grad_accum * _data_parallel(recipe, world_size),
            "world_size": world_size, "micro_batch_size": t.micro_batch_size, "grad_accum": t.grad_accum}


def _data_parallel(recipe: Recipe, world_size: int) -> int:
    """The ranks reading different rows (engine.context_parallel: one per shard group; config/schema.py)."""
    return data_parallel_size(recipe, world_size, max(1, world_size // max(1, recipe.launch.nnodes)))


def resume_checkpoint(recipe: Recipe) -> Path | None:
    """The checkpoint the workers will load (train.resume: auto/force = the newest complete one), or None."""
    resume = recipe.train.resume
    if resume in ("auto", "force"):
        return newest_complete(Path(recipe.train.output_dir) / "checkpoints")
    return explicit_resume_dir(resume)


def _changes(keys: tuple[str, ...], old: dict, new: dict) -> list[str]:
    return [f"{k} {old[k]!r} -> {new[k]!r}" for k in keys if k in old and old[k] != new[k]]


def check_resume(cfg: DictConfig, recipe: Recipe, world_size: int) -> DictConfig:
    """Exit 2 (UserError) for a checkpoint this recipe must not continue; returns `cfg`, with train.grad_accum
    scaled for another world size; prints a notice for allowed changes and keeps the previous recipe."""
    ckpt = resume_checkpoint(recipe)
    if ckpt is None:
        return cfg
    old = json.loads((ckpt / TRAINER_FILE).read_text()).get("fingerprint")
    if old is None:  # written before fingerprints existed: nothing to compare
        return cfg
    new = fingerprint(recipe, world_size)
    where = f"train.resume: {ckpt}"
    bad = _changes(INCOMPATIBLE, old, new)
    if bad:
        raise UserError(f"{where} is of another model: {'; '.join(bad)}: it cannot continue in this recipe: use a "
                        f"new train.output_dir (or restore those keys)")
    cfg = _keep_global_batch(cfg, recipe, old, world_size, where)
    new = fingerprint(_to_recipe(cfg), world_size)
    other = _changes(DATA, old, new)
    if other and recipe.train.resume != "force":
        raise UserError(f"{where} was trained on other data or another objective: {'; '.join(other)}: set "
                        f"train.resume=force to continue it with these, or use a new train.output_dir")
    if recipe.launch.is_first_node():  # one writer of the shared run directory's history (multi-node jobs)
        _keep_recipe_history(cfg, ckpt, other)
    return cfg


def check_rerun(cfg: DictConfig) -> None:
    """Exit 2 when train.output_dir holds a run that trained (metrics.jsonl, final/) but left no checkpoint to
    resume, and this recipe is of another model or other data: starting over would truncate its metrics.jsonl and
    replace its final/ without a word. As for a checkpoint: train.resume=force goes ahead, and so does
    train.resume=none (start over on purpose)."""
    recipe = _to_recipe(cfg)
    run_dir = Path(recipe.train.output_dir)
    prev_file = run_dir / "recipe.yaml"
    metrics = run_dir / "metrics.jsonl"
    trained = (metrics.is_file() and metrics.stat().st_size > 0) or (run_dir / "final").is_dir()
    if recipe.train.resume != "auto" or resume_checkpoint(recipe) is not None or not trained or not prev_file.is_file():
        return
    try:
        prev = _to_recipe(OmegaConf.merge(OmegaConf.structured(Recipe), OmegaConf.load(prev_file)))
    except Exception:  # written by another version of the schema: not comparable, say so rather than guess
        prev = None
    world = 1  # the batch split is not compared: without a checkpoint nothing continues
    old, new = (fingerprint(prev, world), fingerprint(recipe, world)) if prev is not None else ({}, {})
    changed = _changes(tuple(k for k in INCOMPATIBLE + DATA if k != "global_batch"), old, new)
    if prev is not None and not changed:
        return
    what = "; ".join(changed) or f"its {prev_file} is not readable by this version"
    raise UserError(f"train.output_dir: '{run_dir}' holds a finished run of another model or other data ({what}) "
                    "and no checkpoint: use a new train.output_dir, or set train.resume=none to start over there "
                    "(its metrics.jsonl and final/ are replaced)")


def _to_recipe(cfg: DictConfig) -> Recipe:
    from shardtune.config.load import to_recipe

    return to_recipe(cfg)


def _keep_global_batch(cfg: DictConfig, recipe: Recipe, old: dict, world_size: int,
                       where: str) -> DictConfig:
    t = recipe.train
    same_split = (t.micro_batch_size, t.grad_accum) == (old["micro_batch_size"], old["grad_accum"])
    target = old["global_batch"]
    data_parallel = _data_parallel(recipe, world_size)  # another world size, or engine.context_parallel switched
    per_step = t.micro_batch_size * data_parallel
    if per_step * t.grad_accum == target or not same_split:
        return cfg  # an explicit new split: a different global batch is then a data change (checked after)
    if target % per_step == 0:
        accum = target // per_step
        if recipe.launch.is_first_node():  # every node's launcher scales it alike; the job log says it once
            print(f"resume: world size {old['world_size']} -> {world_size}: train.grad_accum {t.grad_accum} -> "
                  f"{accum} keeps the global batch of {target}", file=sys.stderr)
        cfg = cfg.copy()
        OmegaConf.update(cfg, "train.grad_accum", accum)
        return cfg
    splits = [f"train.micro_batch_size={m} train.grad_accum={target // (m * data_parallel)}"
              for m in range(1, target + 1) if target % (m * data_parallel) == 0]
    fix = (f"use {' or '.join(splits[-3:])}" if splits else
           f"use a number of workers that divides {target} (launch.nproc_per_node x launch.nnodes)")
    raise UserError(f"{where}: its global batch of {target} (micro-batch {old['micro_batch_size']} x world "
                    f"{old['world_size']} x grad_accum {old['grad_accum']}) cannot be kept with micro-batch "
                    f"{t.micro_batch_size} on {world_size} workers: {fix}")


def _flat(cfg: DictConfig | dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    items = cfg.items() if isinstance(cfg, dict) else OmegaConf.to_container(cfg).items()
    for k, v in items:
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def trained_recipe(recipe: Recipe) -> dict[str, Any]:
    """The recipe as each checkpoint's trainer.json holds it (written by the worker, read back by `_trained_with`):
    what the checkpoint trained with, compared on resume."""
    return json.loads(json.dumps(asdict(recipe)))


def _trained_with(cfg: DictConfig, ckpt: Path, prev_file: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(what the checkpoint trained with, what this launch trains with), as flat keys. The checkpoint's own record,
    not recipe.yaml: that is the last launch's, which may have changed a key and stopped before saving. A
    checkpoint written before trainer.json held its recipe: recipe.yaml (None without one)."""
    trained = json.loads((ckpt / TRAINER_FILE).read_text()).get("recipe")
    if trained is not None:
        return _flat(trained), _flat(trained_recipe(_to_recipe(cfg)))
    return (_flat(OmegaConf.load(prev_file)), _flat(cfg)) if prev_file.is_file() else None


def _keep_recipe_history(cfg: DictConfig, ckpt: Path, forced: list[str]) -> None:
    """When this launch changes what the checkpoint trained with, say what changed in one line and save the run's
    previous recipe.yaml as recipes/step_N.yaml (N: the step it trained up to)."""
    run_dir = Path(str(cfg.train.output_dir))
    prev_file = run_dir / "recipe.yaml"
    compared = _trained_with(cfg, ckpt, prev_file)
    if compared is None:
        return
    prev, now = compared
    changed = [f"{k} {prev[k]!r} -> {now[k]!r}" for k in now
               if k in prev and prev[k] != now[k] and not k.startswith(_NOT_RECIPE)]
    if not changed and not forced:
        return
    named = {c.split(" ")[0] for c in changed}
    what = "; ".join(changed + [f for f in forced if f.split(" ")[0] not in named])
    if not prev_file.is_file():  # resumed from another run's checkpoint into a new train.output_dir
        print(f"resume from {ckpt} with changes ({what})", file=sys.stderr)
        return
    history = run_dir / "recipes"
    try:
        history.mkdir(exist_ok=True)
    except OSError as e:
        raise UserError(no_space_line(history) if disk_full(e) else f"cannot create {history}: {e.strerror}") from None
    keep = history / f"{ckpt.name}.yaml"
    n = 2
    while keep.exists():  # resumed at this step before: keep every version
        keep, n = history / f"{ckpt.name}.{n}.yaml", n + 1
    write_text_atomic(keep, prev_file.read_text())  # a full disk: one line, and no empty step_N.yaml left
    print(f"resume from {ckpt.name} with changes ({what}); the previous recipe is kept as {keep}", file=sys.stderr)
