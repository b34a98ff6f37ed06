"""The `shardtune` command. Each command is a thin layer over a module.

Usage errors (unknown command or option, a missing argument, a value of the wrong type or out of range) are
typer's own: it prints the usage line and one error, exit 2. A `UserError` from a command (a bad recipe key, a
missing file) is one line on stderr, exit 2. Help texts are one string per paragraph so that rich wraps them to
the terminal; every option's help says its default.
"""
from __future__ import annotations

import sys
from pathlib import Path

import typer

from shardtune import __version__
from shardtune.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help=f"Config-driven LLM fine-tuning with its own FSDP engine (shardtune {__version__}).")

RECIPE = typer.Argument(..., help="A recipe YAML path or the name of a bundled recipe (see `shardtune recipes`).")
OVERRIDES = typer.Argument(None, help="Dotted KEY=VALUE overrides, e.g. train.lr=1e-4 engine.strategy=no_shard "
                           "(default: none; `shardtune keys` lists every key).")


def _print_version(value: bool) -> None:
    if value:
        from shardtune.launcher.versions import version_report  # imports torch: only when asked

        typer.echo(version_report())
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the versions of shardtune, Python, torch (CUDA, NCCL), "
                                       "transformers and the libraries a bug report needs, then exit (default: off).")
          ) -> None:
    pass


TRAIN_HELP = (
    "Train: starts launch.nproc_per_node workers via torchrun (or runs as one inside torchrun/srun).\n\n"
    "Before the workers start, the plan runs on the detected hardware (a second or two) and prints a one-line fit "
    "summary; a recipe that does not fit is refused with the plan's advice and exit code 3.")


@app.command(help=TRAIN_HELP)
def train(recipe: str = RECIPE, overrides: list[str] | None = OVERRIDES,
          fit: bool = typer.Option(False, "--fit", help="Apply the fastest configuration `plan --fit` finds on the "
                                   "detected hardware at the recipe's global batch (strategy, checkpointing, "
                                   "offload, micro-batch x grad_accum) and record it in the run's recipe.yaml "
                                   "(default: off)."),
          no_check: bool = typer.Option(False, "--no-check", help="Launch even if the pre-flight plan says the "
                                        "recipe does not fit the detected GPU or host RAM (default: refuse, exit 3)."),
          ) -> None:
    from shardtune.config.load import load_recipe_config
    from shardtune.launcher.launch import launch_train

    cfg = load_recipe_config(recipe, overrides or [])
    trust = any(o.split("=", 1)[0].strip() == "hardware.host_ram_gb" for o in overrides or [])
    code = launch_train(cfg, check=not no_check, fit=fit, trust_host_ram=trust)
    if code == 130:  # Ctrl-C, after the workers checkpointed: the launcher has said so, with the step
        raise _Reported(code)
    raise typer.Exit(code)


VALIDATE_HELP = (
    "Check a recipe without building anything heavy: schema, values, files, sharding vs world size; then the data "
    "(the first rows of every data file: format, field keys, values, tokenized with the real tokenizer), "
    "data.seq_len vs the model's max_position_embeddings and train.warmup_steps vs train.max_steps.\n\n"
    "Every problem is one line on stderr (file, line and column where it applies); any problem exits 2.")


@app.command(help=VALIDATE_HELP)
def validate(recipe: str = RECIPE, overrides: list[str] | None = OVERRIDES,
             print_recipe: bool = typer.Option(False, "--print", help="Print the resolved recipe as YAML on stdout "
                                               "(every default and override, as train writes recipe.yaml: a file "
                                               "`train` takes as it is); the other lines go to stderr "
                                               "(default: off)."),
             ) -> None:
    from shardtune.config.load import load_recipe_config, to_recipe, to_yaml
    from shardtune.launcher.launch import check_launch
    from shardtune.launcher.validate import recipe_problems

    cfg = load_recipe_config(recipe, overrides or [])
    r = to_recipe(cfg)
    nproc = check_launch(r)
    if print_recipe:  # before the data checks: the recipe itself is sound, whatever they find
        typer.echo(to_yaml(cfg), nl=False)
    notes: list[str] = []
    problems = recipe_problems(r, notes)
    for p in problems:
        typer.echo(f"error: {p}", err=True)
    if problems:
        raise typer.Exit(2)
    typer.echo(f"ok: {recipe} ({nproc} worker(s) per node x {r.launch.nnodes} node(s), "
               f"engine={r.engine.backend}/{r.engine.strategy}, output_dir={r.train.output_dir})", err=print_recipe)
    for note in notes:
        typer.echo(note, err=print_recipe)


PLAN_HELP = (
    "Predict the per-rank peak memory of a recipe on `hardware.gpu` x world size; exit 0 fits, 3 does not.\n\n"
    "The model is built on the meta device (no weights). Memory model: sharded fp32 master params, grads and AdamW "
    "state (frozen bf16 base under LoRA, replicated fp32 adapters), the gathered units held at each moment "
    "(+ prefetch), every activation autograd saves for HF Llama/Mistral/Qwen2 blocks, the fp32 logits copy, "
    "log-softmax and its gradient, and the optimizer's temporaries; the peak is the largest of the phases of a step. "
    "Fits when peak <= capacity - 5 % allocator slack - 1 GiB CUDA context (GPUs). On CPU (launch.device=cpu) the "
    "total predicts what train.profile_memory measures.\n\n"
    "--fit step time: FLOPs (6N/token, 4N with LoRA, +2N with checkpointing, + attention) at 40 % of the profile's "
    "bf16 TFLOP/s (fp32: a quarter), ring collectives at the intra-/inter-node bandwidth (overlapped with compute "
    "when prefetch is on), offload copies at PCIe bandwidth and host AdamW at 10 GB/s; or the host's time if "
    "longer: kernel launches estimated from the model's shape x 90 us each (`--simulate` counts them).")


@app.command(help=PLAN_HELP)
def plan(recipe: str = RECIPE, overrides: list[str] | None = OVERRIDES,
         json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON: model, world_size, per_rank "
                                       "bytes by category, host bytes, capacity_bytes, fits, advice (default: off)."),
         fit: bool = typer.Option(False, "--fit", help="Search strategy x checkpointing x offload x micro-batch at "
                                  "the recipe's global batch; list the fitting ones, fastest first (default: off)."),
         lora: bool = typer.Option(False, "--lora", help="With --fit: also try LoRA over a bf16 base, over an NF4 base "
                                   "(lora.quantize_base=nf4) and none (default: off)."),
         png: Path | None = typer.Option(None, "--png", help="Write a stacked-bar chart (per phase) to this PNG "
                                         "(default: no chart)."),
         top: int = typer.Option(10, "--top", min=1, help="With --fit: how many candidates to show."),
         max_seq: bool = typer.Option(False, "--max-seq", help="Print the longest data.seq_len at which the recipe, "
                                      "as configured, fits (a multiple of 128; exit 3 if none) (default: off)."),
         simulate: bool = typer.Option(False, "--simulate", help="Run one real training step at full size on the "
                                       "simulated GPU (meta device, fake process group; rank 0 of the world) and "
                                       "print its measured peak beside the plan's, its kernel launches per optimizer step by phase, host "
                                       "syncs, host CPU-s and the verdict (host- or GPU-bound on hardware.gpu, a "
                                       "roofline), with --json as JSON; exit 0 "
                                       "(default: off)."),
         ) -> None:
    import json

    from shardtune.plan import make_plan
    from shardtune.plan.report import print_plan, write_png

    if simulate:
        from shardtune.plan.simulate import simulate as run_simulation
        from shardtune.plan.simulate import summary

        sim = run_simulation(recipe, overrides or [])
        typer.echo(json.dumps(sim.to_json(), indent=2) if json_out else summary(sim))
        raise typer.Exit(0)
    p = make_plan(recipe, overrides or [])
    if max_seq:
        from shardtune.plan.long_context import max_seq as longest

        n, at = longest(p)
        if json_out:
            typer.echo(json.dumps({"max_seq_len": n, "peak_bytes": at.estimate.total if at else None,
                                   "host_bytes": at.estimate.host_per_rank if at else None,
                                   "capacity_bytes": p.capacity}))
        elif at is None:
            typer.echo(f"no data.seq_len fits {p.setup.world} x {p.hardware.key}, not even 128 tokens")
        else:
            typer.echo(f"longest data.seq_len that fits {p.setup.world} x {p.hardware.key}: {n:,} tokens "
                       f"(peak {at.estimate.total / 2**30:.2f} GiB of {p.capacity / 2**30:.2f}; host "
                       f"{at.estimate.host_per_rank / 2**30:.2f} GiB per rank)")
        raise typer.Exit(0 if n else 3)
    if png is not None:
        write_png(p, png)
    if fit:
        from shardtune.plan.search import fit_search

        found = fit_search(p, try_lora=lora)
        if json_out:
            typer.echo(json.dumps([{"overrides": c.overrides(), "peak_bytes": c.plan.estimate.total, **c.time}
                                   for c in found[:top]], indent=2))
        else:
            _print_fit(found[:top], p)
        raise typer.Exit(0 if found else 3)
    if json_out:
        typer.echo(json.dumps(p.to_json(), indent=2))
    else:
        print_plan(p)
    raise typer.Exit(0 if p.fits else 3)


def _print_fit(found: list, p) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"configurations that fit {p.setup.world} x {p.hardware.key} (fastest first)")
    for col in ("#", "overrides", "peak GiB", "step s", "tokens/s"):
        table.add_column(col, justify="right" if col != "overrides" else "left")
    for i, c in enumerate(found, 1):
        table.add_row(str(i), c.overrides(), f"{c.plan.estimate.total / 2**30:.2f}", f"{c.time['step_s']:.2f}",
                      f"{c.time['tokens_per_s']:,.0f}")
    # nothing found: the plan's own advice when it has one (e.g. FSDP2's whole-model load: our engine's shards)
    hint = "; ".join(a for a in p.advice if "--fit" not in a) or "more GPUs, LoRA (--lora) or a shorter data.seq_len"
    Console().print(table if found else f"no configuration fits: {hint}")


@app.command()
def slurm(recipe: str = RECIPE, overrides: list[str] | None = OVERRIDES,
          nodes: int = typer.Option(..., "--nodes", min=1, help="Nodes in the job (one task per node, each runs "
                                    "torchrun); required, no default."),
          gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", min=1, help="GPUs per node = workers per "
                                                   "node (default: none, a CPU job)."),
          partition: str | None = typer.Option(None, "--partition", help="SLURM partition (default: the "
                                               "cluster's default partition)."),
          time: str | None = typer.Option(None, "--time", help="Time limit: MINUTES, HH:MM:SS or D-HH:MM:SS "
                                          "(default: the partition's limit)."),
          account: str | None = typer.Option(None, "--account", help="SLURM account to charge (default: your "
                                             "default account)."),
          gpu_type: str | None = typer.Option(None, "--gpu-type", help="The GPUs' type as the cluster names it "
                                              "(`sinfo -o %G`), e.g. a100: --gpus-per-node=TYPE:G (default: any "
                                              "type)."),
          constraint: str | None = typer.Option(None, "--constraint", help="Node features the job needs, e.g. "
                                                "h100&ib (default: none)."),
          cpus_per_task: int | None = typer.Option(None, "--cpus-per-task", min=1, help="CPUs per node (default: "
                                                   "workers x launch.threads_per_worker, which defaults to 4 on a "
                                                   "GPU job, + 2 for the launcher; 1 on a CPU job)."),
          mem: str | None = typer.Option(None, "--mem", help="Memory per node, e.g. 256G, 0 = all (default: 1.1 x "
                                         "plan's host RAM per node + 6 GiB per GPU worker, 1 per CPU worker, + 2)."),
          out: Path | None = typer.Option(None, "-o", "--output", help="Write the script here (default: stdout)."),
          force: bool = typer.Option(False, "--force", help="Write the script even if `plan` says it does not fit "
                                     "(default: off)."),
          ) -> None:
    """Write an sbatch script: N nodes, torchrun per node, checkpoint + requeue on preemption (USR1)."""
    from shardtune.launcher.slurm import SlurmJob, write_sbatch

    job = SlurmJob(nodes=nodes, gpus_per_node=gpus_per_node, partition=partition, time=time, account=account,
                   gpu_type=gpu_type, constraint=constraint, cpus_per_task=cpus_per_task, mem=mem)
    summary = write_sbatch(recipe, overrides or [], job, out=out, force=force)
    if summary:
        typer.echo(summary, err=True)


PREPARE_HELP = (
    "Tokenize data.path once into the Arrow cache that every rank memory-maps (data.cache_dir, default "
    "<output_dir>/data_cache); print rows, tokens, truncation, packing efficiency and a length histogram.\n\n"
    "A later `train` with the same data, tokenizer and data settings finds it and tokenizes nothing.")


@app.command(help=PREPARE_HELP)
def prepare(recipe: str = RECIPE, overrides: list[str] | None = OVERRIDES,
            show: int | None = typer.Option(None, "--show", min=0, metavar="N", help="Then print example N (row N "
                                            "of data.path counting from 0; preference data: the N-th pair) as "
                                            "training reads it: its text with the masked tokens (no loss) between "
                                            "« and », the trained ones bare, and the token counts of each span "
                                            "(default: none)."),
            ) -> None:
    from shardtune.launcher.prepare import prepare_recipe

    prepare_recipe(recipe, overrides or [], show=show)


@app.command()
def recipes() -> None:
    """List the bundled recipes with their one-line descriptions."""
    from shardtune.bundled import RECIPES_DIR
    from shardtune.config.load import bundled_description, list_bundled_recipes

    for name, path in list_bundled_recipes().items():
        typer.echo(f"{name:<36} {bundled_description(path)}  [{path.relative_to(RECIPES_DIR)}]")


@app.command()
def keys(prefix: str | None = typer.Argument(None, help="Only keys that start with this: a section (train), a "
                                              "key (model.path) or the start of a name (launch.threads) (default: "
                                              "every key).")) -> None:
    """List every recipe key with its type, default and meaning (from the schema); set one as KEY=VALUE."""
    from shardtune.config.keys import format_keys

    typer.echo(format_keys(prefix))


@app.command()
def export(checkpoint: str = typer.Argument(..., help="<output_dir>/checkpoints/step_N (or the checkpoints folder: "
                                            "its newest; with --merge also a LoRA run's final/)."),
           out_dir: str = typer.Argument(..., help="Folder to write: HF safetensors (+ index) or a PEFT adapter."),
           max_shard_size_mb: int = typer.Option(2048, min=1, help="Split the safetensors output into files of at "
                                                 "most this many MiB."),
           merge: bool = typer.Option(False, "--merge", help="LoRA runs: write the base with the adapters merged "
                                      "(full HF safetensors + generation_config.json) instead of the adapter "
                                      "(default: off)."),
           force: bool = typer.Option(False, "--force", help="Write into a non-empty folder, replacing the model "
                                      "files there (default: refuse, exit 2)."),
           push_to_hub: str | None = typer.Option(None, "--push-to-hub", help="Then upload the folder to this Hugging "
                                                  "Face repo (OWNER/NAME, created private if missing; HF_TOKEN or "
                                                  "`hf auth login`; default: no upload)."),
           ) -> None:
    """Consolidate a sharded checkpoint, streamed tensor by tensor (peak memory ~ one output file)."""
    from shardtune.launcher.export_command import run_export

    files = run_export(Path(checkpoint), Path(out_dir), merge=merge, max_shard_bytes=max_shard_size_mb * 1024**2,
                       force=force, push_to_hub=push_to_hub)
    typer.echo(f"wrote {len(files)} file(s) to {out_dir}" + (f", pushed to {push_to_hub}" if push_to_hub else ""))


MODEL_ARG = typer.Argument(..., help="A run directory (its final/, else its newest checkpoint), a final/ or exported "
                           "folder (full model or LoRA adapter), or a checkpoint step_N.")
TEMPERATURE = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy; above 0 samples.")
TOP_P = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (with --temperature > 0).")
SEED = typer.Option(0, "--seed", help="Sampling seed.")
DEVICE = typer.Option("auto", "--device", help="auto | cpu | cuda (one GPU).")
SYSTEM = typer.Option(None, "--system", help="A system message opening the chat (chat-trained models; default: "
                      "none).")
BASE = typer.Option(None, "--base", help="The model folder a LoRA adapter was trained over (default: the run's "
                    "recipe.yaml says it, else the local folder the adapter_config.json names).")


GENERATE_HELP = (
    "Complete prompts with a trained model, in one process on CPU or one GPU. The prompt is rendered as in "
    "training: the run's recipe.yaml (beside or above the model) gives data.format, data.template and "
    "model.chat_template, and for a LoRA adapter its base model; an exported folder keeps that in "
    "shardtune_prompt.json, and any other folder is asked through its own chat template when it has one. An "
    "adapter away from its run loads on the base its adapter_config.json names (a local folder), or on --base.")


@app.command(help=GENERATE_HELP)
def generate(model: str = MODEL_ARG,
             prompt: list[str] = typer.Option(..., "--prompt", help="The user's text; required, no default. "
                                              "Repeat it for several prompts: one completion per prompt, each on "
                                              "its own line (newlines in a completion are printed as \\n)."),
             max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Most tokens to generate."),
             temperature: float = TEMPERATURE, top_p: float = TOP_P, seed: int = SEED, device: str = DEVICE,
             system: str | None = SYSTEM, base: str | None = BASE) -> None:
    from shardtune.launcher.generate import Sampling, complete, load, render

    loaded = load(Path(model), device, Path(base) if base else None)
    sampling = Sampling(max_new_tokens, temperature, top_p, seed)
    for p in prompt:
        text = complete(loaded, render(loaded, p, system=system), sampling)
        typer.echo(text.replace("\n", "\\n") if len(prompt) > 1 else text)


@app.command(help="Talk to a trained model: one reply per line read from stdin, until EOF or /exit (/reset starts "
             "over). Runs trained on chat data keep the conversation; others answer each line alone.")
def chat(model: str = MODEL_ARG,
         max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, help="Most tokens per reply."),
         temperature: float = TEMPERATURE, top_p: float = TOP_P, seed: int = SEED, device: str = DEVICE,
         system: str | None = SYSTEM, base: str | None = BASE) -> None:
    from shardtune.launcher.generate import Sampling, chat_loop, load

    chat_loop(load(Path(model), device, Path(base) if base else None), Sampling(max_new_tokens, temperature, top_p, seed), system=system)


def main() -> None:
    """Entry point. typer runs in its standalone mode, its public contract for a CLI: usage errors print the
    usage hint and one error line and exit 2, `typer.Exit(code)` exits with `code`, and Ctrl-C exits 130.
    Only what a command itself raises reaches the handlers below."""
    from shardtune.voice import one_line_warnings

    one_line_warnings()  # `warning: MESSAGE`, no source path
    try:
        app()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # the file system refused a path the command was given or derived (checked ones: above)
        if e.filename is None:
            raise
        print(f"error: {e.strerror}: '{e.filename}': check the path and its folder's permissions", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # only outside typer's own handling (e.g. while a command's imports ran)
        sys.exit(_interrupted())
    except SystemExit as e:
        if e.code == 130 and not isinstance(e, _Reported):  # typer turns Ctrl-C into a silent exit 130: say why the command stopped
            _interrupted()
        raise


class _Reported(SystemExit):
    """An exit whose reason the command has already printed."""


def _interrupted() -> int:
    print("shardtune: interrupted (Ctrl-C)", file=sys.stderr)
    return 130
