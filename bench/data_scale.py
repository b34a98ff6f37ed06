"""Data at scale (issue 12): cold cache build, warm start (cache hit), build tokens/s and per-rank peak RSS of a
short 2-rank training run, on generated instruction data (~400 bytes a row, like the issue's 200k-row file).

    python bench/data_scale.py --rows 50000 200000 1000000 --tokenizers char bpe --train-rows 200000 1000000
    python bench/data_scale.py --rows 50000 --tokenizers char --train-rows 50000 --old-src /tmp/old/src  # old path

Each build runs in a fresh process (its time excludes Python/torch imports, which `shardtune prepare` adds, ~5 s);
"warm" is a second fresh process that finds the entry. Training: `shardtune train tiny-cpu` with data.seq_len=512
and 2 steps; every 0.1 s the workers' RSS (anonymous = heap, file = memory-mapped pages) is sampled from /proc.
"data RSS" = a worker's peak RSS minus the same run's peak on the 4,000-row builtin task. The BPE tokenizer is
trained here with `tokenizers` on the generated rows (nothing downloaded); training runs use the char tokenizer
(the tiny model has a 128-token vocabulary).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "ru", "so", "ta", "vi", "ze", "pu") for b in
         ("", "n", "ral", "tos", "mir", "ven", "dal", "ski", "pon", "rex", "lia", "gor", "tum", "bes", "qua")]
SHARDTUNE = Path(sys.executable).with_name("shardtune")


def generate(path: Path, rows: int) -> Path:
    if path.exists():
        return path
    rng = random.Random(rows)
    tmp = path.with_suffix(".part")
    with open(tmp, "w") as f:
        for i in range(rows):
            prompt = "Summarize the notes: " + " ".join(rng.choices(WORDS, k=rng.randint(15, 30)))
            response = " ".join(rng.choices(WORDS, k=rng.randint(20, 40))) + f" ({i})"
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    tmp.rename(path)
    return path


def train_bpe(data: Path, out: Path, sample_rows: int = 50_000) -> Path:
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()

    def texts():
        with open(data) as f:
            for _, line in zip(range(sample_rows), f):
                row = json.loads(line)
                yield row["prompt"]
                yield row["response"]

    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=4096, special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(out)
    return out


BUILD = """
import json, resource, sys, time
from shardtune.config.schema import DataConfig, ModelConfig
from shardtune.data.pipeline import build_data
from shardtune.model.build import build_tokenizer
tok = build_tokenizer(ModelConfig(tokenizer=sys.argv[2]))
cfg = DataConfig(path=sys.argv[1], format="instruction", seq_len=512, cache_dir=sys.argv[3])
t0 = time.perf_counter()
data = build_data(cfg, tok, seed=0)
dt = time.perf_counter() - t0
s = data.manifest["stats"]
print(json.dumps({"seconds": dt, "built": data.built, "tokens": s["train"]["tokens"] + s["eval"]["tokens"],
                  "rows": s["train"]["rows"], "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "entry_mb": sum(f.stat().st_size for f in data.entry.iterdir()) / 2**20}))
"""


def build(data: Path, tokenizer: str, cache: Path, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", BUILD, str(data), tokenizer, str(cache)], capture_output=True,
                          text=True, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def train_rss(data: str, out: Path, cache: Path | None, env: dict) -> dict:
    """Peak RSS / anonymous RSS / file RSS (MB) per worker of a 2-step, 2-rank run, and its wall time."""
    cmd = [str(SHARDTUNE), "train", "tiny-cpu", f"data.path={data}", "data.seq_len=512", "train.max_steps=2",
           "train.eval_every=0", "train.demo_eval=false", "train.save_final=false", f"train.output_dir={out}",
           "train.micro_batch_size=2", *([f"data.cache_dir={cache}"] if cache else [])]  # None: the old path
    t0 = time.perf_counter()
    proc = psutil.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    peaks: dict[int, dict[str, float]] = {}
    while proc.poll() is None:
        for child in proc.children(recursive=True):
            try:
                cmd = " ".join(child.cmdline())
                if "shardtune.trainer.worker" not in cmd or "shardtune.launcher.agent" in cmd:  # torchrun's agent names it too
                    continue
                status = Path(f"/proc/{child.pid}/status").read_text()
            except (psutil.Error, OSError):
                continue
            kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in status.splitlines())
                  if k in ("VmRSS", "RssAnon", "RssFile")}
            p = peaks.setdefault(child.pid, {"rss": 0, "anon": 0, "file": 0})
            p["rss"] = max(p["rss"], kb["VmRSS"] / 1024)
            p["anon"] = max(p["anon"], kb["RssAnon"] / 1024)
            p["file"] = max(p["file"], kb["RssFile"] / 1024)
        time.sleep(0.1)
    err = proc.stderr.read().decode()
    if proc.returncode:
        raise RuntimeError(err[-3000:])
    ranks = list(peaks.values())
    return {"wall_s": time.perf_counter() - t0, "workers": len(ranks),
            "peak_rss_mb": max(r["rss"] for r in ranks), "peak_anon_mb": max(r["anon"] for r in ranks),
            "peak_file_mb": max(r["file"] for r in ranks)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[50_000, 200_000, 1_000_000])
    ap.add_argument("--tokenizers", nargs="+", default=["char", "bpe"])
    ap.add_argument("--train-rows", type=int, nargs="*", default=[200_000, 1_000_000])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shardtune-data-scale"))
    ap.add_argument("--old-src", type=Path, default=None, help="a checkout's src/ of the old data path: train only")
    ap.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if a.old_src:
        env["PYTHONPATH"] = str(a.old_src)
    results = []

    def report(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        results.append(rec)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")

    if a.old_src is None:
        for rows in a.rows:
            data = generate(a.workdir / f"instr-{rows}.jsonl", rows)
            for name in a.tokenizers:
                tok = "builtin:char" if name == "char" else str(train_bpe(data, a.workdir / "bpe-tokenizer"))
                cache = a.workdir / f"cache-{name}-{rows}"
                shutil.rmtree(cache, ignore_errors=True)  # cold: nothing there
                cold = build(data, tok, cache, env)
                warm = build(data, tok, cache, env)
                assert cold["built"] and not warm["built"]
                report({"rows": rows, "tokenizer": name, "cold_s": round(cold["seconds"], 2),
                        "warm_s": round(warm["seconds"], 3), "tokens": cold["tokens"],
                        "build_tokens_per_s": round(cold["tokens"] / cold["seconds"]),
                        "builder_peak_rss_mb": round(cold["peak_rss_mb"]), "cache_mb": round(cold["entry_mb"])})
    base = train_rss("builtin:reverse", a.workdir / "run-base", None if a.old_src else a.workdir / "cache-base", env)
    report({"train": "builtin:reverse (baseline)", **{k: round(v, 1) for k, v in base.items()}})
    for rows in a.train_rows:
        data = generate(a.workdir / f"instr-{rows}.jsonl", rows)
        cache = a.workdir / f"cache-char-{rows}"  # the entry the cold build above left (same key as the run's)
        if a.old_src is None:
            build(data, "builtin:char", cache, env)  # what `shardtune prepare` does before the job (a hit if built)
        r = train_rss(str(data), a.workdir / f"run-{rows}", None if a.old_src else cache, env)
        report({"train_rows": rows, "path": "old" if a.old_src else "cache", **{k: round(v, 1) for k, v in r.items()},
                "data_rss_mb": round(r["peak_rss_mb"] - base["peak_rss_mb"], 1),
                "data_anon_mb": round(r["peak_anon_mb"] - base["peak_anon_mb"], 1)})


if __name__ == "__main__":
    main()
