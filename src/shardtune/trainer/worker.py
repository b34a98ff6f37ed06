"""Worker entry point: `python -m shardtune.trainer.worker RESOLVED_RECIPE.yaml` (what torchrun starts)."""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path

from shardtune.config.load import load_recipe
from shardtune.config.schema import Recipe
from shardtune.disk import disk_full, no_space_line
from shardtune.errors import UserError
from shardtune.startup import imports_without_gc
from shardtune.trainer.signals import SETUP_INTERRUPTS, stop_message
from shardtune.voice import one_line_warnings


def run_worker(recipe: Recipe, error_file: Path | None = None) -> int:
    """Train; a user error is printed (one line), or written to `error_file` when the launcher will print it."""
    try:
        with imports_without_gc():
            from shardtune.trainer.train import (  # torch, transformers: seconds in which Ctrl-C may come
                TrainingStopped,
                train,
            )
    except BaseException as e:
        if _interrupted(e):
            return _interrupted_in_setup(error_file)
        raise
    one_line_warnings(rank=int(os.environ.get("RANK", "0")), others_to_log=error_file is not None)
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    # DCP's own planner warns about its internal ShardedTensor path on every load (4 lines per resume): nothing a
    # user can act on. Only that message, only from DCP.
    warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning,
                            module=r"torch\.distributed\.checkpoint")
    try:
        train(recipe)
    except KeyboardInterrupt:  # Ctrl-C while setting up, before train() handles SIGINT itself
        return _interrupted_in_setup(error_file)
    except TrainingStopped as e:  # preempted (checkpoint saved) or diverged: a message, a documented code
        import torch.distributed as dist

        if error_file is not None:  # the launcher prints it once and exits with this code (torchrun would say 1)
            _say(f"shardtune: {e}", error_file.with_name(".exit_code"), f"{e.code}\n{e}")
        elif not dist.is_initialized() or dist.get_rank() == 0:
            print(f"shardtune: {e}", file=sys.stderr, flush=True)
        return e.code
    except Exception as e:
        if _interrupted(e):  # a library turned the setup's KeyboardInterrupt into an error of its own
            return _interrupted_in_setup(error_file)
        if not isinstance(e, UserError) and not disk_full(e):
            raise
        if not isinstance(e, UserError):  # metrics, final/, the data cache: as the launcher says it
            e = UserError(no_space_line(getattr(e, "filename", None) or recipe.train.output_dir))
        _say(f"error: {e}", error_file, str(e))
        return 2
    finally:
        _release_process_groups()
    return 0


def _interrupt_setup(signum: int, frame: object) -> None:
    """SIGINT while setting up: remembered, then raised as KeyboardInterrupt. Remembered because a library can turn
    the KeyboardInterrupt into an error of its own as it unwinds (omegaconf, interrupted while building the recipe's
    schema, re-raises it as an AttributeError), and that must still read as Ctrl-C, not as an internal error; one
    swallowed altogether stops the run at its first step boundary (trainer/signals.py)."""
    SETUP_INTERRUPTS.append(signum)
    raise KeyboardInterrupt


def _interrupted(e: BaseException) -> bool:
    return isinstance(e, KeyboardInterrupt) or bool(SETUP_INTERRUPTS)


def _interrupted_in_setup(error_file: Path | None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's forwarded copy must not interrupt this
    message, code = stop_message(signal.SIGINT, 0, None)
    if error_file is not None or int(os.environ.get("RANK", "0")) == 0:
        _say(f"shardtune: {message}", error_file and error_file.with_name(".exit_code"), f"{code}\n{message}")
    return code


def _say(line: str, file: Path | None, text: str) -> None:
    """Hand `text` to the launcher in `file`; on the console when there is no launcher, or when the run directory
    cannot take even that (a full disk): the launcher then relays this console line."""
    if file is not None:
        try:
            file.write_text(text)
            return
        except OSError:
            pass
    print(line, file=sys.stderr, flush=True)


def _release_process_groups() -> None:
    """Destroy the process groups and free them now. `destroy_process_group` only drops torch's own references;
    the sharded model (a reference cycle) still holds its groups, and a gloo group left for interpreter teardown
    can have its worker threads destroyed unjoined: SIGABRT, "terminate called without an active exception",
    after a run that had succeeded (seen once in CI; 50 loaded runs here did not reproduce it)."""
    import gc

    import torch.distributed as dist

    from shardtune import accelerator

    if dist.is_initialized():
        dist.destroy_process_group()
    accelerator.forget_host_group()  # its reference would keep the gloo group (and its threads) alive
    gc.collect()


def _stderr_to_log(path: Path) -> None:
    """Send file descriptor 2 (torch's C++ warnings, native crash reports, faulthandler's stacks, an uncaught
    traceback) to this rank's log, and keep `sys.stderr` (our messages, Python warnings) on the console. A rank
    that fails only because a peer died (gloo: "Connection closed by peer") then prints nothing: the launcher's
    one line names the rank that died first and points to the logs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    console = os.fdopen(os.dup(2), "w", buffering=1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    log = os.fdopen(os.dup(2), "w", buffering=1)
    sys.stderr = console
    sys.excepthook = lambda kind, value, tb: traceback.print_exception(kind, value, tb, file=log)
    faulthandler.enable(file=log)  # Python stacks of a native crash (SIGSEGV, SIGABRT...) into the log


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m shardtune.trainer.worker")
    parser.add_argument("recipe", help="the resolved recipe.yaml the launcher wrote")
    parser.add_argument("--error-file", type=Path, default=None, help="write a user error here instead of stderr")
    args = parser.parse_args()
    # The agent ignores SIGINT (launcher/agent.py) and its workers inherit that: Ctrl-C must still stop a worker that is
    # setting up. From here to train() (which turns it into a stop at a step boundary) it is one line, exit 130.
    signal.signal(signal.SIGINT, _interrupt_setup)
    try:
        if args.error_file is not None:  # started by our launcher, which reports deaths from the ranks' logs
            from shardtune.trainer.worker_deaths import rank_log

            _stderr_to_log(rank_log(args.error_file.parent, int(os.environ.get("RANK", "0"))))
        with imports_without_gc():
            recipe = load_recipe(args.recipe)  # imports torch: seconds in which Ctrl-C may come
    except BaseException as e:
        if _interrupted(e):
            sys.exit(_interrupted_in_setup(args.error_file))
        if not isinstance(e, UserError):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_worker(recipe, args.error_file))


if __name__ == "__main__":
    main()
