"""torchrun as the launcher runs it: `python -m shardtune.launcher.agent REPORT.json TORCHRUN_ARGS...`.

The same elastic agent as `python -m torch.distributed.run`, with two differences. How each failed worker ended
(rank, exit code or signal, host) goes to REPORT.json for the launcher to put in one line (trainer/worker_deaths.py),
instead of torchrun's ChildFailedError traceback. And the agent's own process-management log lines ("failed
(exitcode: -9)", "Sending process ... closing signal SIGTERM") are silenced: that line says it all.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

# Loggers of the agent's process management; rendezvous messages (multi-node trouble) stay.
_QUIET = ("torch.distributed.elastic.multiprocessing", "torch.distributed.elastic.agent",
          "torch.distributed.launcher", "torch.distributed.run")


def _silence_process_logs() -> None:
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_QUIET):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: list[str]) -> int:
    report, args = Path(argv[0]), argv[1:]
    # The agent's C++ store client warns with a full C++ stack when the store host (the agent of rank 0's node)
    # is gone: expected once a job is ending (its workers' messages are in their logs). Read once, when torch
    # loads; the workers get the user's own setting back.
    user_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    import torch  # noqa: F401

    if user_level is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    else:
        os.environ["TORCH_CPP_LOG_LEVEL"] = user_level
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.run import parse_args, run

    _silence_process_logs()
    # Ctrl-C reaches every process of the terminal's group: the workers stop at a step boundary and checkpoint
    # (trainer/signals.py); the agent waits for them instead of shutting them down (torch's default handles SIGINT so).
    # The launcher sends SIGINT to the workers itself when only it was interrupted (launcher/launch.py).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run(parse_args(["--signals-to-handle=SIGTERM,SIGHUP,SIGQUIT", *args]))  # torch's default adds SIGINT
    except ChildFailedError as e:
        host = socket.gethostname()
        codes = {f.exitcode for f in e.failures.values()}
        # No signal reached the agent (that is SignalException, below): after the first failure it stopped the
        # other workers with SIGTERM itself. Those are consequences, marked so the launcher blames the first.
        by_agent = codes != {-signal.SIGTERM}
        failures = [{"rank": rank, "local_rank": f.local_rank, "exitcode": f.exitcode, "pid": f.pid,
                     "timestamp": f.timestamp, "host": host,
                     "stopped_by_agent": by_agent and f.exitcode == -signal.SIGTERM}
                    for rank, f in sorted(e.failures.items())]
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps({"failures": failures}, indent=1))
        return 1
    except SignalException as e:  # stopped from outside (the launcher forwards SIGTERM): the workers report
        return 128 + int(e.sigval)
    except RendezvousConnectionError:
        # Multi-node: the agent hosting the rendezvous store (the first node's) has ended, typically right after a
        # worker died there and its launcher printed the job's one line. torch's agent stopped this node's workers
        # on the way out; without this, its traceback lands in the job log (seen once in the SLURM kill test).
        print("shardtune: this node's workers were stopped: the job's rendezvous host (the first node's launcher) "
              "ended first; its line in the job log says why", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
