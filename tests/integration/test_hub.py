"""`model.path=OWNER/NAME`, `data.path=OWNER/NAME` and `export --push-to-hub` against a fake Hub on 127.0.0.1 (fake_hub.py; no network):
plan fetches the config.json only, validate the tokenizer too (it tokenizes data rows), train downloads the safetensors once for its two ranks with
HF_TOKEN sent, export pushes exactly the exported files; then, with the server gone, HF_HUB_OFFLINE=1 runs
validate and plan from the filled cache, and an id that is not cached is one line, exit 2. The dataset repo has a
train and a test split (datasets' file-name rules): validate fetches its files once, train reads the train split
only, a split it lacks is one line naming the ones it has."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import torch
from safetensors.torch import load_file

from shardtune import synthetic
from tests.integration.fake_hub import FakeHub
from tests.integration.runs import FAST, SHARDTUNE, losses
from tests.integration.test_model_folder import write_checkpoint

TOKEN = "hf_shardtune_test"


def shardtune(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([SHARDTUNE, *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, **env})


def snapshot_files(hf_home: Path, repo: str) -> set[str]:
    snapshots = hf_home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots"
    return {p.name for p in snapshots.rglob("*") if p.is_file() or p.is_symlink()}


def test_hub_id_downloads_once_trains_pushes_and_works_offline(tmp_path):
    model = tmp_path / "upstream"
    write_checkpoint(model)
    hf_home = tmp_path / "hf"
    run = tmp_path / "run"
    pretrained = ["model.path=acme/tiny-llama", "model.init=pretrained", "data.path=acme/reverse",
                  "data.format=instruction"]
    data = tmp_path / "dataset" / "data"
    data.mkdir(parents=True)
    datasets.Dataset.from_list(synthetic.generate("reverse", 300, 0)).to_parquet(data / "train-00000-of-00001.parquet")
    datasets.Dataset.from_list([{"prompt": "held out=", "response": "x"}] * 7).to_parquet(
        data / "test-00000-of-00001.parquet")
    with FakeHub() as hub:
        hub.add_folder("acme/tiny-llama", model)
        hub.add_folder("datasets/acme/reverse", data.parent)
        env = {"HF_HOME": str(hf_home), "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN,
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "0"}
        proc = shardtune("plan", "tiny-cpu", *pretrained, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert snapshot_files(hf_home, "acme/tiny-llama") == {"config.json"}  # plan reads the architecture only
        proc = shardtune("validate", "tiny-cpu", *pretrained, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        cached = snapshot_files(hf_home, "acme/tiny-llama")
        assert "config.json" in cached and "tokenizer.json" in cached and "model.safetensors" not in cached
        multi = tmp_path / "multi"  # a card with two subsets and no default: one line, then data.subset picks one
        for name in ("a", "b"):
            (multi / name).mkdir(parents=True)
            datasets.Dataset.from_list(synthetic.generate("reverse", 8, 0)).to_parquet(multi / name / "x.parquet")
        (multi / "README.md").write_text("---\nconfigs:\n- config_name: a\n  data_files: a/*.parquet\n"
                                         "- config_name: b\n  data_files: b/*.parquet\n---\n")
        hub.add_folder("datasets/acme/multi", multi)
        proc = shardtune("validate", "tiny-cpu", *pretrained, "data.path=acme/multi", cwd=tmp_path, env=env)
        errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("note: ")]
        assert proc.returncode == 2 and len(errors) == 1 and "data.subset" in errors[0], proc.stderr
        proc = shardtune("validate", "tiny-cpu", *pretrained, "data.path=acme/multi", "data.subset=b", cwd=tmp_path,
                         env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (hf_home / "datasets" / "shardtune" / "acme--multi" / hub.commit("datasets/acme/multi") / "b" /
                "train" / "dataset_info.json").is_file()
        saved = (hf_home / "datasets" / "shardtune" / "acme--reverse" / hub.commit("datasets/acme/reverse") /
                 "default" / "train")
        assert len(datasets.load_from_disk(saved)) == 300  # the train split, not the test rows
        proc = shardtune("validate", "tiny-cpu", *pretrained, "data.split=validation", cwd=tmp_path, env=env)
        errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("note: ")]  # notes: the folder's config
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr
        assert "data.split" in proc.stderr and "train, test" in proc.stderr, proc.stderr

        proc = shardtune("train", "tiny-cpu", *pretrained, f"train.output_dir={run}", *FAST, "train.max_steps=2",
                         "train.save_every=2", cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert hub.gets("/model.safetensors") == 1  # rank 0 downloaded, rank 1 waited and read the cache
        assert hub.gets("/train-00000-of-00001.parquet") == 1  # validate fetched it; train read the cache
        assert len(losses(run)) == 2
        assert {auth for _, path, auth in hub.log if "acme/" in path} == {f"Bearer {TOKEN}"}
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        assert json.loads((run / "final" / "config.json").read_text())["vocab_size"] == vocab

        commit = hub.commit("acme/tiny-llama")
        out = tmp_path / "export"
        proc = shardtune("export", str(run / "checkpoints"), str(out), "--push-to-hub", "acme/tuned", cwd=tmp_path,
                         env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "pushed to acme/tuned" in proc.stdout
        assert hub.repos["acme/tuned"] == {p.name: p.read_bytes() for p in out.iterdir()}
        assert json.loads((out / "shardtune_prompt.json").read_text()) == {"kind": "instruction", "template": "plain"}

        proc = shardtune("validate", "tiny-cpu", "model.path=acme/missing", "model.init=pretrained", cwd=tmp_path,
                         env=env)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "acme/missing" in proc.stderr and "Hub" in proc.stderr

    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there
    proc = shardtune("validate", "tiny-cpu", *pretrained, cwd=tmp_path, env=offline)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = shardtune("plan", "tiny-cpu", f"model.path=acme/tiny-llama@{commit}", "model.init=pretrained",
                     cwd=tmp_path, env=offline)  # a pinned revision, found by its commit in the cache
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = shardtune("validate", "tiny-cpu", "model.path=acme/never-fetched", "model.init=pretrained",
                     cwd=tmp_path, env=offline)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "HF_HUB_OFFLINE" in proc.stderr, proc.stderr
    proc = shardtune("export", str(run / "checkpoints"), str(tmp_path / "again"), "--push-to-hub", "acme/tuned",
                     cwd=tmp_path, env={**offline, "HF_HUB_OFFLINE": "0"})  # the Hub is down: the export stays
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "cannot be reached" in proc.stderr, proc.stderr
    assert (tmp_path / "again" / "model.safetensors").is_file()


def test_a_repo_without_safetensors_gets_its_bin_weights_only_then(tmp_path):
    """An older repo holds only pytorch_model.bin: train's fetch takes it (model/bin_weights.py reads it); a repo
    with both formats gives the safetensors alone. A second fetch is served from the cache."""
    folder = tmp_path / "old"
    write_checkpoint(folder)
    both = tmp_path / "both"
    write_checkpoint(both)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    shutil.copy(folder / "pytorch_model.bin", both / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    fetch = ("import json, sys; from shardtune.hub import model_dir, EVERYTHING; "
             "print(json.dumps(sorted(p.name for p in model_dir(sys.argv[1], EVERYTHING).iterdir())))")
    with FakeHub() as hub:
        hub.add_folder("acme/old", folder)
        hub.add_folder("acme/both", both)
        env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        for repo, weights in (("acme/old", "pytorch_model.bin"), ("acme/both", "model.safetensors")):
            for _ in range(2):
                proc = subprocess.run([sys.executable, "-c", fetch, repo], capture_output=True, text=True, env=env,
                                      timeout=120)
                assert proc.returncode == 0, proc.stderr[-2000:]
                files = json.loads(proc.stdout.strip().splitlines()[-1])
                assert weights in files and ("pytorch_model.bin" in files) == (repo == "acme/old"), files
            assert hub.gets(f"/{weights}") == 1  # the second fetch read the cache
