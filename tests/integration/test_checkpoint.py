"""Checkpoints, exact resume and failure safety (2 CPU workers, fp32): the launcher's behaviour (signals, restarts,
exit codes, refusals) through the real CLI; the numbers after a resume through forked ranks (forked.py), which run
the same launcher checks and worker without the CLI's start-up."""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from shardtune.checkpoint.paths import newest_complete
from shardtune.trainer.worker_deaths import EXIT_WORKER_DIED
from tests.integration import forked
from tests.integration.runs import FAST, cli, descendants, losses, metrics, start, summary, wait_for


def overrides(run_dir: Path, *extra: str) -> list[str]:
    return [f"train.output_dir={run_dir}", "train.save_every=3", *FAST, *extra]


def train_args(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "tiny-cpu", *overrides(run_dir, *extra)]


def default_save_args(run_dir: Path, *extra: str) -> list[str]:
    """`train_args` at the recipe's own train.save_every (tiny-cpu: the default, 0: no periodic checkpoint)."""
    return ["train", "tiny-cpu", f"train.output_dir={run_dir}", *FAST, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run: checkpoints at steps 3 and 6, final/ (forked ranks: the numbers to compare against;
    the CLI's runs are the tests' own)."""
    run_dir = tmp_path_factory.mktemp("ckpt") / "reference"
    run = forked.train("tiny-cpu", *overrides(run_dir))
    assert run.code == 0, run.err[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_3", "step_6"]
    return run_dir


def test_a_worker_killed_by_sigkill_is_one_line_and_its_checkpoint_resumes(tmp_path):
    """As the OOM killer does: one worker SIGKILLed after step_3. One line naming the rank, the signal and a fix,
    exit 5, no traceback; the other worker is stopped (not left hanging); a relaunch resumes from a checkpoint written
    before the kill. (Exact resumption: the tests above.)"""
    run_dir = tmp_path / "run"
    proc = start(*train_args(run_dir, "train.max_steps=1000"), cwd=tmp_path)
    wait_for(lambda: (run_dir / "checkpoints" / "step_3" / "trainer.json").exists(), what="checkpoint step_3")
    workers = _workers(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_WORKER_DIED, err[-3000:]
    assert err.splitlines() == [err.strip()] and "rank 1 on " in err and "SIGKILL" in err, err[-3000:]
    assert "out-of-memory killer" in err and "the other ranks were stopped" in err
    newest = newest_complete(run_dir / "checkpoints")  # step_3 or later: what the relaunch below continues from
    assert err.strip().endswith(f"; the other ranks were stopped; checkpoint: {newest}: resume with "
                                f"`{shlex.join(['shardtune', *train_args(run_dir, 'train.max_steps=1000')])}`"), err
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
    assert "Traceback" not in err and "ChildFailedError" not in err
    assert not (run_dir / "final").exists()
    again = forked.train("tiny-cpu", *overrides(run_dir, "train.max_steps=12"))  # the relaunch: the worker's part
    assert again.code == 0, again.err[-3000:]
    assert "resumed from" in again.out and max(losses(run_dir)) == 12


def _workers(launcher: int) -> list[int]:
    return [p for p in descendants(launcher) if "shardtune.trainer.worker" in _cmdline(p) and "shardtune.launcher.agent" not in _cmdline(p)]


def test_interrupted_write_leaves_previous_checkpoint_loadable(reference, tmp_path):
    """A save killed mid-write leaves only a .tmp- dir (renamed only when complete); resume ignores it."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step_3", run_dir / "checkpoints" / "step_3")
    (run_dir / "checkpoints" / "latest").write_text("step_3")
    partial = run_dir / "checkpoints" / ".tmp-step_6"
    shutil.copytree(reference / "checkpoints" / "step_6", partial)
    (partial / "trainer.json").unlink()  # written last: a killed save never has it
    data_file = next(partial.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated mid-write
    run = forked.train("tiny-cpu", *overrides(run_dir))
    assert run.code == 0, run.err[-3000:]
    assert "incomplete checkpoint" in run.err
    assert not partial.exists()
    assert {s: v for s, v in losses(run_dir).items() if s > 3} == {s: v for s, v in losses(reference).items() if s > 3}


def test_sigterm_checkpoints_and_exits_75(tmp_path):
    """At the default train.save_every=0 too (a signal's stop saves whatever save_every says): exit 75, one line
    naming the signal, the checkpoint's path and how to resume; that checkpoint loads and the run goes on from it."""
    run_dir = tmp_path / "run"
    proc = start(*default_save_args(run_dir, "train.max_steps=500"), cwd=tmp_path)
    wait_for(lambda: len(metrics(run_dir)) >= 2, what="two steps")
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler or a user would
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    last = metrics(run_dir)[-1]["step"]
    # 500 steps of 16 rows over 300 samples: the first lines say how many passes over the data that is
    rows = json.loads(next((run_dir / "data_cache").glob("*/manifest.json")).read_text())["stats"]["train"]["rows"]
    assert f"data: {rows:,} training rows -> 500 steps x 16 rows = {round(500 * 16 / rows, 2):g} epochs" in out, out
    assert (run_dir / "checkpoints" / f"step_{last}" / "trainer.json").exists()
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{last}"
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert lines[-1] == (f"shardtune: stopped by signal SIGTERM after step {last}; checkpoint: "
                         f"{run_dir / 'checkpoints' / f'step_{last}'}: run the same command to resume"), err[-3000:]
    again = forked.train("tiny-cpu", f"train.output_dir={run_dir}", *FAST, f"train.max_steps={last + 2}")
    assert again.code == 0, again.err[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{last}'} at step {last}" in again.out
    assert [r["step"] for r in metrics(run_dir)][-3:] == [last, last + 1, last + 2]
    assert (run_dir / "final").is_dir()


@pytest.mark.parametrize("nproc,micro", [(1, 8), (4, 4)], ids=["2to1", "2to4"])
def test_resume_at_another_world_size(reference, tmp_path, nproc, micro):
    """The reference runs 2 workers x micro-batch 8; resuming with 1 x 8 (the launcher doubles train.grad_accum to
    keep the global batch) or 4 x 4 sees the same global batch."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step_3", run_dir / "checkpoints" / "step_3")
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    run = forked.train("tiny-cpu", *overrides(run_dir, f"train.micro_batch_size={micro}"), world=nproc)
    assert run.code == 0, run.err[-3000:]
    assert ("train.grad_accum 1 -> 2 keeps the global batch of 16" in run.launcher_err) == (nproc == 1), run
    assert "resumed from" in run.out, run.out[-3000:]
    got, ref = losses(run_dir), losses(reference)
    assert sorted(got) == sorted(ref)
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step


def test_resume_on_other_data_needs_force_and_keeps_the_previous_recipe(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir, ignore=shutil.ignore_patterns("final", "data_cache"))
    shutil.copy(reference / "recipe.yaml", run_dir / "recipe.yaml")
    previous = (run_dir / "recipe.yaml").read_text().replace(str(reference), str(run_dir))
    (run_dir / "recipe.yaml").write_text(previous)
    other = ["data.seq_len=20", "train.max_steps=7", "train.lr=1e-3"]  # seq_len 20 truncates documents
    refused = cli(*train_args(run_dir, *other), cwd=tmp_path)
    assert refused.returncode == 2 and "data.seq_len 64 -> 20" in refused.stderr, refused.stderr[-3000:]
    assert (run_dir / "recipe.yaml").read_text() == previous  # nothing started, nothing overwritten
    forced = cli(*train_args(run_dir, *other, "train.resume=force"), cwd=tmp_path)
    assert forced.returncode == 0 and "resumed from" in forced.stdout, forced.stderr[-3000:]
    assert "train.lr 0.003 -> 0.001" in forced.stderr and "recipes/step_6.yaml" in forced.stderr
    assert "DTensor" not in forced.stderr, forced.stderr  # torch's 4 FutureWarnings per resume: filtered
    # one voice: the truncation warning once (rank 0), one line, no source path
    truncated = [ln for ln in forced.stderr.splitlines() if "were truncated" in ln]
    assert len(truncated) == 1 and truncated[0].startswith("warning: ") and ".py" not in truncated[0], forced.stderr
    assert (run_dir / "recipes" / "step_6.yaml").read_text() == previous
    assert "seq_len: 20" in (run_dir / "recipe.yaml").read_text() and max(losses(run_dir)) == 7
    # the new lr applies from the resumed step: step 7 of a cosine over 7 steps peaking at 1e-3, as a fresh run's
    assert metrics(run_dir)[-1]["lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 6 / 7)), rel=1e-12)


def test_a_new_lr_and_max_steps_on_resume_apply_from_the_resumed_step(reference, tmp_path):
    """Resuming the reference's step_3 (lr 3e-3, cosine over 6 steps) with train.lr=1e-3 train.max_steps=9 trains
    steps 4-9 at the rates a run started with those settings uses at those steps (the checkpoint's scheduler state
    held the old peak lr, which a resume restored: the new lr was announced and ignored). The notice names what
    the checkpoint trained with."""
    from shardtune.trainer.schedule import build_scheduler

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step_3", run_dir / "checkpoints" / "step_3")
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    (run_dir / "recipe.yaml").write_text((reference / "recipe.yaml").read_text().replace(str(reference), str(run_dir)))
    run = forked.train("tiny-cpu", *overrides(run_dir, "train.lr=1e-3", "train.max_steps=9"))
    assert run.code == 0 and "resumed from" in run.out, run.err[-3000:]
    assert "train.lr 0.003 -> 0.001" in run.launcher_err and "train.max_steps 6 -> 9" in run.launcher_err, run
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    fresh = build_scheduler("cosine", opt, warmup_steps=0, total_steps=9)  # the schedule of a fresh run
    expected = {}
    for step in range(1, 10):
        expected[step] = fresh.get_last_lr()[0]
        opt.step()
        fresh.step()
    rows = {r["step"]: r for r in metrics(run_dir)}
    assert sorted(rows) == list(range(1, 10))
    for step in range(4, 10):
        assert rows[step]["lr"] == pytest.approx(expected[step], rel=1e-12), step
    ref = losses(reference)
    assert rows[4]["loss"] == pytest.approx(ref[4], rel=1e-5)  # the checkpoint's weights
    assert all(rows[s]["loss"] != pytest.approx(ref[s], rel=1e-4) for s in (5, 6))  # trained at the new rates


def test_the_demo_accuracy_line_after_a_resume_says_what_before_was(reference, tmp_path):
    """The demo's held-out accuracy line is printed after a resume too. Its "before" is the step-0 figure the first
    launch recorded in its checkpoint (the whole run's before -> after, as without the resume); from a checkpoint
    without one (the reference ran without the demo) it is measured at the resumed step, and the line says so."""
    demo = ["train.demo_eval=true", "train.demo_eval_samples=4"]
    run_dir = tmp_path / "run"
    first = forked.train("tiny-cpu", *overrides(run_dir, *demo, "train.max_steps=3"))
    assert first.code == 0, first.err[-3000:]
    before = summary(run_dir)["accuracy_before"]
    again = forked.train("tiny-cpu", *overrides(run_dir, *demo, "train.max_steps=5"))
    assert again.code == 0 and "resumed from" in again.out, again.err[-3000:]
    after = summary(run_dir)
    assert after["accuracy_before"] == before
    assert (f"held-out exact-match accuracy: before {before:.1%} (at step 0, recorded before the resume at step 3) "
            f"-> after {after['accuracy_after']:.1%}") in again.out.splitlines(), again.out[-3000:]
    other = tmp_path / "other"
    shutil.copytree(reference / "checkpoints" / "step_3", other / "checkpoints" / "step_3")
    run = forked.train("tiny-cpu", *overrides(other, *demo))
    assert run.code == 0 and "resumed from" in run.out, run.err[-3000:]
    got = summary(other)
    assert (f"held-out exact-match accuracy: before {got['accuracy_before']:.1%} (at step 3, where this run resumed) "
            f"-> after {got['accuracy_after']:.1%}") in run.out.splitlines(), run.out[-3000:]


def test_resume_1_to_2_workers(reference, tmp_path):
    run_dir = tmp_path / "run"
    # One worker writes step_3 (same max_steps, so the same lr schedule); keep only that checkpoint.
    first = forked.train("tiny-cpu", *overrides(run_dir, "train.micro_batch_size=16"), world=1)
    assert first.code == 0, first.err[-3000:]
    shutil.rmtree(run_dir / "checkpoints" / "step_6")
    (run_dir / "checkpoints" / "latest").write_text("step_3")
    # Same command with 2 workers and max_steps=6: picks up step_3 written by one worker.
    run = forked.train("tiny-cpu", *overrides(run_dir))
    assert run.code == 0 and "resumed from" in run.out, run.err[-3000:]
    got, ref = losses(run_dir), losses(reference)
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step


def test_torchrun_restart_resumes_from_latest(reference, tmp_path):
    """One worker dies (SIGKILL) mid-run; torchrun (launch.max_restarts=1) restarts both; they resume from step_3.

    Both workers are frozen (SIGSTOP) the moment step_3 is complete, so the kill lands before step 6 whatever the
    machine's load; the frozen state is checked, and the restart is asserted from the resume notice."""
    run_dir = tmp_path / "run"
    proc = start(*train_args(run_dir, "launch.max_restarts=1"), cwd=tmp_path)
    wait_for(lambda: (run_dir / "checkpoints" / "step_3" / "trainer.json").exists(), what="checkpoint step_3")
    workers = _workers(proc.pid)
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    assert not (run_dir / "checkpoints" / "step_6").exists() and not (run_dir / "final").exists()
    os.kill(workers[1], signal.SIGKILL)
    os.kill(workers[0], signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "at step 3" in out and "resumed from" in out, out[-3000:]  # the restarted workers resumed
    assert losses(run_dir) == losses(reference)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_export_loads_and_reproduces_final_logits(reference, tmp_path):
    from shardtune.checkpoint.consolidate import export_checkpoint

    out = tmp_path / "export"
    files = export_checkpoint(reference / "checkpoints", out, max_shard_bytes=512 * 1024)  # folder -> latest
    assert len(files) > 1 and (out / "model.safetensors.index.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    final = AutoModelForCausalLM.from_pretrained(reference / "final").eval()
    ids = torch.randint(4, 100, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, final(ids).logits, rtol=0, atol=0)
    # generation_config.json (issue 59): from_pretrained + generate stop at the run's eos and pad with its pad, also
    # for a checkpoint written before the trainer saved one beside it
    tok = AutoTokenizer.from_pretrained(out)
    old = tmp_path / "step_6"
    shutil.copytree(reference / "checkpoints" / "step_6", old)
    (old / "hf" / "generation_config.json").unlink()
    export_checkpoint(old, tmp_path / "old-export")
    for folder in (out, tmp_path / "old-export", reference / "final"):
        gen = GenerationConfig.from_pretrained(folder)
        assert (gen.eos_token_id, gen.pad_token_id) == (tok.eos_token_id, tok.pad_token_id), folder
    with torch.no_grad():
        assert exported.generate(ids[:1], max_new_tokens=3, do_sample=False).shape[1] <= 12 + 3


def test_export_streams_one_file_at_a_time(reference, tmp_path):
    """Peak live tensor bytes while exporting stay near one output file, far below the model."""
    from shardtune.checkpoint.consolidate import export_checkpoint
    from shardtune.memory import CpuMemoryTracker

    shard = 256 * 1024
    model_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(reference / "final").parameters())
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    try:
        export_checkpoint(reference / "checkpoints" / "step_6", tmp_path / "out", max_shard_bytes=shard)
        peak = tracker.peak_bytes() - base
    finally:
        tracker.stop()
    largest_tensor = 344 * 128 * 4
    assert peak <= shard + 2 * largest_tensor, (peak, shard)  # the file being built + the tensor being read
    assert peak < model_bytes / 3, (peak, model_bytes)


def test_nonfinite_loss_stops_with_exit_4_or_skips(tmp_path):
    blowup = ["train.lr=1e30", "train.max_grad_norm=0", "train.max_steps=8"]
    proc = cli(*train_args(tmp_path / "a", *blowup), cwd=tmp_path)
    assert proc.returncode == 4, proc.stderr[-3000:]
    rows = metrics(tmp_path / "a")
    first_bad = next(r["step"] for r in rows if not all(map(math.isfinite, (r["loss"], r["grad_norm"]))))
    assert rows[-1]["step"] == first_bad and rows[-1]["skipped"]
    assert f"non-finite loss/grad norm at step {first_bad}" in proc.stderr
    assert "ChildFailedError" not in proc.stderr  # a documented stop, not torchrun's failure report
    # The exit code and its line are the launcher's (above); how many steps are skipped is the trainer's.
    skip = forked.train("tiny-cpu", *overrides(tmp_path / "b", *blowup, "train.skip_nonfinite=2"))
    assert skip.code == 4, skip.err[-3000:]
    assert f"at step {first_bad + 2}" in skip.err  # two skipped, the third stops the run


def test_resume_of_a_bad_path_is_a_user_error(tmp_path):
    proc = cli(*train_args(tmp_path / "r", f"train.resume={tmp_path}"), cwd=tmp_path)
    assert proc.returncode == 2 and "train.resume" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("when", ["training", "setup", "launcher"])
def test_ctrl_c_checkpoints_and_exits_130(tmp_path, when):
    """Ctrl-C on a terminal: SIGINT to every process of the group (launcher, agent, workers) at once, after a step
    or while the workers are still importing torch and building the model; or (`launcher`) SIGINT to the launcher
    alone, as `kill -INT` does, which it passes on to the workers itself."""
    run_dir = tmp_path / "run"
    proc = start(*default_save_args(run_dir, "train.max_steps=500"), cwd=tmp_path)
    if when == "setup":
        wait_for(lambda: (run_dir / "logs").is_dir(), what="the workers' start")
    else:
        wait_for(lambda: len(metrics(run_dir)) >= 1, what="a step")
    if when == "launcher":
        os.kill(proc.pid, signal.SIGINT)
    else:
        os.killpg(proc.pid, signal.SIGINT)  # start() made the launcher its group's leader
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    last = metrics(run_dir)[-1]["step"] if metrics(run_dir) else 0  # the stop comes at a step boundary
    if last == 0:  # still setting up (a loaded machine may take longer: then it is the case above)
        assert lines == ["shardtune: interrupted (Ctrl-C, SIGINT) before the first step; checkpoint: none"], err
        return
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{last}"
    assert (run_dir / "checkpoints" / f"step_{last}" / "trainer.json").exists()
    assert lines == [f"shardtune: interrupted (Ctrl-C, SIGINT) after step {last}; checkpoint: "
                     f"{run_dir / 'checkpoints' / f'step_{last}'}: run the same command to resume"], err


def test_a_run_directory_in_use_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").write_text(f"{socket.gethostname()} {os.getpid()}\n")  # this test's process: alive
    proc = cli(*train_args(run_dir), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: train.output_dir: '{run_dir}' is in use by a "
                                                            f"run on {socket.gethostname()} (pid {os.getpid()})")
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "recipe.yaml").exists()


def test_a_finished_run_of_other_data_without_a_checkpoint_is_kept(reference, tmp_path):
    """A run with train.save_every=0 leaves recipe.yaml, metrics.jsonl and final/: a launch with other data into
    it is refused as resuming its checkpoint would be, instead of truncating metrics.jsonl and replacing final/."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference / "final", run_dir / "final")
    for name in ("recipe.yaml", "metrics.jsonl"):
        shutil.copy(reference / name, run_dir / name)
    proc = cli(*train_args(run_dir, "data.num_samples=200"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "holds a finished run" in last and "data.num_samples 300 -> 200" in last, last
    assert (run_dir / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()


def test_a_finished_run_without_a_checkpoint_is_not_trained_again(reference, tmp_path):
    """The same command again into a run that finished with train.save_every=0 (final/, summary.json, metrics.jsonl,
    no checkpoint) would repeat the run and replace its records without a word: exit 2, one line saying how to go
    on, and nothing there is touched."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference / "final", run_dir / "final")
    for name in ("recipe.yaml", "metrics.jsonl", "summary.json"):
        shutil.copy(reference / name, run_dir / name)
    proc = cli(*train_args(run_dir), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: train.output_dir: '{run_dir}' holds a finished run (final/, summary.json, metrics.jsonl) and no "
        "checkpoint to resume: training again would replace it: use a new train.output_dir, or set "
        "train.resume=none to start over there")
    assert (run_dir / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()
    assert sorted(p.name for p in run_dir.iterdir()) == ["final", "metrics.jsonl", "recipe.yaml", "summary.json"]


def test_a_full_disk_while_keeping_the_recipe_history_is_one_line(reference, tmp_path):
    """Resuming with another train.lr keeps the previous recipe as recipes/step_6.yaml: on a full disk that is one
    line naming the file and "no space left", exit 2, and no empty step_6.yaml is left."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)]).returncode:
        pytest.skip("needs root, to mount a small tmpfs")
    try:
        run_dir = disk / "run"
        shutil.copytree(reference / "checkpoints" / "step_6", run_dir / "checkpoints" / "step_6")
        (run_dir / "checkpoints" / "latest").write_text("step_6")
        shutil.copy(reference / "recipe.yaml", run_dir / "recipe.yaml")
        page = os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - page))  # the run lock's page is left
        proc = cli(*train_args(run_dir, "train.lr=1e-3", "train.max_steps=8"), cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: no space left on device writing {run_dir / 'recipes' / 'step_6.yaml'}: free some space there, "
            "or use another train.output_dir")
        assert not any((run_dir / "recipes").iterdir())
    finally:
        subprocess.run(["umount", str(disk)], check=True)
