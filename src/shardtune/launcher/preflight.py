"""`shardtune train`'s pre-flight: the plan on the hardware actually present, before any worker starts.

GPUs: the card nvidia-smi reports (name, memory) selects the matching profile in configs/hardware/ and its memory
replaces the profile's; on CPU the capacity is the host RAM (/proc/meminfo), shared by the node's workers. A
recipe that does not fit is refused with the plan's advice (exit 3); `--no-check` launches anyway. `--fit` takes
`plan --fit`'s fastest fitting configuration at the recipe's global batch and applies it.

Cost, paid in the launcher before torchrun starts the workers: first a torch-free upper bound from config.json
(plan/bound.py), which settles recipes far under capacity (the demo) for a few ms; otherwise the full plan on meta
(plan/skeleton.py: torch only, no transformers), ~2.5 s of CPU, nearly all of it `import torch`.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from shardtune.config.load import to_recipe
from shardtune.config.schema import Recipe
from shardtune.errors import UserError
from shardtune.plan.hardware import host_ram_bytes  # torch-free; `plan` reads host RAM with the same function

GiB = 1 << 30


@dataclass(frozen=True)
class Detected:
    gpu_name: str | None  # None on CPU or when nvidia-smi is missing
    gpu_bytes: int | None
    host_bytes: int | None  # what this launch judges against (see judged_host_ram)
    note: str = ""  # how the recipe's hardware block compares with the machine, for the pre-flight line


def judged_host_ram(claimed_gb: float | None, present: int | None, *, trusted: bool) -> tuple[int | None, str]:
    """(host RAM bytes to check against, a note). The recipe's `hardware` block describes the node `plan` targets,
    not necessarily this one: a claim above what /proc/meminfo reports is not believed (the OOM killer would end
    the run instead), unless `hardware.host_ram_gb` was given on the command line (taken on trust). A claim below
    what is present is honoured: a share of a node."""
    if claimed_gb is None:
        return present, ""
    claimed = int(claimed_gb * GiB)
    if trusted:
        return claimed, f"host RAM {claimed_gb:g} GiB taken on trust (hardware.host_ram_gb on the command line)"
    if present is not None and claimed > present:
        return present, (f"the recipe's hardware.host_ram_gb={claimed_gb:g} is more than the {present / GiB:.1f} GiB "
                         f"present: judged on what is present")
    return claimed, ""


def detect_gpu() -> tuple[str, int] | None:
    """(name, memory bytes) of GPU 0 from nvidia-smi. Not torch.cuda: its device query would create a CUDA context
    (~0.3-0.5 GiB of GPU 0) in the launcher, which stays alive for the whole run."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        name, mib = out.splitlines()[0].rsplit(",", 1)
        return name.strip(), int(float(mib)) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def match_profile(name: str, memory_bytes: int) -> str | None:
    """The profile whose chip (the key before its memory, e.g. `h100` of h100-80gb) occurs in the card's name;
    of several (a100-40gb / a100-80gb) the one closest in memory."""
    from shardtune.plan.hardware import list_profiles, load_profile

    flat = name.lower().replace(" ", "").replace("-", "")
    hits = [k for k in list_profiles() if k != "cpu" and k.rsplit("-", 1)[0].replace("-", "") in flat]
    return min(hits, key=lambda k: abs(load_profile(k).memory_bytes - memory_bytes), default=None)


def detect(recipe: Recipe, *, trust_host_ram: bool = False) -> Detected:
    """What is present, and how the recipe's hardware block compares with it."""
    gpu = detect_gpu() if recipe.launch.device_type() == "cuda" else None
    host, note = judged_host_ram(recipe.hardware.host_ram_gb, host_ram_bytes(), trusted=trust_host_ram)
    if gpu and match_profile(*gpu) != recipe.hardware.gpu:
        note = "; ".join(filter(None, [f"the recipe's hardware.gpu={recipe.hardware.gpu}, judged on the {gpu[0]} "
                                       "present", note]))
    return Detected(gpu_name=gpu[0] if gpu else None, gpu_bytes=gpu[1] if gpu else None, host_bytes=host, note=note)


def plan_on_detected(cfg: DictConfig, recipe: Recipe, nproc: int, found: Detected):
    """The plan for this launch: nproc workers x launch.nnodes, on the detected device and host RAM."""
    from shardtune.plan import plan_recipe
    from shardtune.plan.hardware import load_profile

    cfg = cfg.copy()
    cfg.launch.nproc_per_node = nproc  # world = nproc x nnodes, what torchrun will start
    if found.host_bytes:
        cfg.hardware.host_ram_gb = found.host_bytes / GiB
    profile = None
    if recipe.launch.device_type() == "cpu":
        cfg.hardware.gpu = "cpu"
    elif found.gpu_name and found.gpu_bytes:
        key = match_profile(found.gpu_name, found.gpu_bytes)
        if key:
            cfg.hardware.gpu = key
        profile = dataclasses.replace(load_profile(cfg.hardware.gpu), name=found.gpu_name,
                                      memory_bytes=found.gpu_bytes)
    return plan_recipe(to_recipe(cfg), hardware=profile)


def fits_by_bound(recipe: Recipe, nproc: int, found: Detected) -> str | None:
    """The summary line when plan/bound.py's torch-free upper bound is under half of what is usable (the plan
    cannot refuse such a recipe: skipping it saves the launcher ~2.5 s of CPU before the workers start); else None."""
    from shardtune.plan.bound import peak_upper_bound
    from shardtune.plan.hardware import load_profile, usable_gpu_bytes

    bound = peak_upper_bound(recipe, ranks_per_node=nproc)
    ram = found.host_bytes
    if bound is None:
        return None
    if recipe.launch.device_type() == "cpu":
        if not ram:
            return None
        usable, where = int(ram) // nproc, "CPU (host memory)"
    else:
        profile = load_profile(recipe.hardware.gpu)
        usable = usable_gpu_bytes(found.gpu_bytes or profile.memory_bytes)
        where = found.gpu_name or profile.name
        if recipe.engine.cpu_offload and (not ram or bound.host_bytes > ram / 2):
            return None
    if bound.device_bytes > usable / 2:
        return None
    world = nproc * recipe.launch.nnodes
    return (f"pre-flight ({world} x {where}): fits: peak at most {bound.device_bytes / GiB:.2f} GiB/rank (a bound "
            f"from the model config; `shardtune plan` for the estimate) vs {usable / GiB:.2f} GiB usable"
            f"{_note(found)}")


def _note(found: Detected) -> str:
    return f" ({found.note})" if found.note else ""


def preflight(cfg: DictConfig, recipe: Recipe, nproc: int, *, refuse: bool, fit: bool,
              trust_host_ram: bool = False) -> tuple[DictConfig, int]:
    """(the config to launch, 0) or (cfg, 3) when it does not fit and `refuse`. With `fit`, the returned config
    carries the chosen overrides. `trust_host_ram`: hardware.host_ram_gb came from the command line."""
    found = detect(recipe, trust_host_ram=trust_host_ram)
    if not fit and (line := fits_by_bound(recipe, nproc, found)):
        if recipe.launch.is_first_node():  # every node's launcher checks; the job log gets the line once
            print(line, flush=True)
        return cfg, 0
    try:
        plan = plan_on_detected(cfg, recipe, nproc, found)
    except UserError:
        raise
    except Exception as e:  # a bug in the planner must not stop a run it cannot judge
        print(f"warning: pre-flight skipped, the plan failed ({type(e).__name__}: {e}); please report it",
              file=sys.stderr)
        return cfg, 0
    from shardtune.plan.report import summary_line  # imports torch (the plan's types)

    _refuse_model_problems(recipe, plan)
    where = f"{plan.setup.world} x {plan.hardware.name}"
    if fit:
        from shardtune.plan.search import fit_search

        best = fit_search(plan)
        if not best:
            print(f"train --fit: no configuration fits {where}: {'; '.join(plan.advice) or 'more memory'}",
                  file=sys.stderr)
            if refuse:
                return cfg, 3
            print("train --fit: --no-check: launching the recipe unchanged", file=sys.stderr)
            return cfg, 0
        cfg = apply_fit(cfg, best[0].overrides().split())
        plan = best[0].plan
        print(f"train --fit: predicted {best[0].time['step_s']:.3g} s/step, {best[0].time['tokens_per_s']:,.0f} "
              "tokens/s", flush=True)
    if plan.fits and not recipe.launch.is_first_node():
        return cfg, 0  # the first node's launcher prints the job's one pre-flight line
    print(f"pre-flight ({where}): {summary_line(plan)}{_note(found)}", flush=True)
    if plan.fits:
        from shardtune.plan.headroom import headroom_advice  # --fit's choice has no advice of its own

        for a in plan.advice or headroom_advice(plan):  # under 3 % of headroom: launched, with the knob to turn
            print(f"  advice: {a}", file=sys.stderr)
        return cfg, 0
    for a in plan.advice:
        print(f"  advice: {a}", file=sys.stderr)
    if not refuse:
        print("pre-flight: --no-check: launching anyway", file=sys.stderr)
        return cfg, 0
    print("pre-flight: refusing to launch (exit 3): apply the advice, try `shardtune train RECIPE --fit`, "
          "or pass --no-check to launch anyway", file=sys.stderr)
    return cfg, 3


def _refuse_model_problems(recipe: Recipe, plan) -> None:  # plan: plan.result.Plan
    """A mixture of experts' LoRA targets and balance loss (a router target, DPO with expert adapters, NF4 experts
    on FSDP2), checked on the plan's own meta model: one line before any worker starts, not after every rank has
    built the model (20 s on the tiny MoE). The workers check again (trainer/parallelize.py). Dense models are
    planned on plan/skeleton.py's stand-in, which validate's transformers build checks instead."""
    if plan.stats.dims.moe is None:
        return
    from shardtune.model.moe_checks import moe_problems

    problems = moe_problems(recipe, plan.stats.model)
    if problems:
        raise UserError(problems[0])


def apply_fit(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Apply KEY=VALUE overrides; print each one that changes the recipe."""
    new = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    keys = [o.split("=", 1)[0] for o in overrides]
    changed = [f"{k}: {_show(OmegaConf.select(cfg, k))} -> {_show(OmegaConf.select(new, k))}" for k in keys
               if OmegaConf.select(cfg, k) != OmegaConf.select(new, k)]
    print("train --fit: " + ("; ".join(changed) if changed else "the recipe is already the fastest fitting "
                             "configuration: no change"), flush=True)
    return new


def _show(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)  # as it is written in a recipe
