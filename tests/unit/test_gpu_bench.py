"""bench/gpu_session.sh's table (bench/gpu_summary.py) and data (bench/gpu_data.py) on fake runs: the MFU formula
per method, the measured-step median, peak against the plan, the roofline columns and missing cells. No GPU."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summary = _load("gpu_summary")
gpu_data = _load("gpu_data")

GiB = 2**30
P8, L8 = 8_030_261_248, 41_943_040  # llama-3.1-8b: params, LoRA r16 on all 7 Linears (`plan --json`'s model)
E8 = 128_256 * 4096  # its untied input embedding
TPS = [100.0, 200.0, 9000.0, 10000.0, 11000.0, 12000.0]  # two warm-up steps, then a median of 10,500


def _write_run(out: Path, name: str, method: str, *, config: str, params: int, lora: int, sim: bool) -> None:
    overrides = f"launch.device=cuda hardware.gpu=h200-141gb model.config=configs/models/{config}.json"
    with open(out / "runs.tsv", "a") as f:
        f.write(f"{name}\t{method}\trc 0, 60 s\tllama-3.1-8b-lora-1x24gb\t{overrides}\n")
    rows = [{"step": i + 1, "loss": 12.0 - i, "tokens_per_s": t, "peak_mem_bytes": (20 + i) * GiB}
            for i, t in enumerate(TPS)]
    (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = {"model": {"params": params, "trainable_params": lora or params, "lora_params": lora},
            "per_rank": {"total_bytes": 20 * GiB}}
    (out / f"{name}.plan.json").write_text(json.dumps(plan))
    if sim:
        (out / f"{name}.sim.json").write_text(json.dumps({"roofline": {"tokens_per_s": 6311.3, "verdict": "host-bound"}}))


def _table(out: Path) -> list[dict[str, str]]:
    lines = summary.table(out).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == summary.COLUMNS
    assert set(lines[1]) == {"|", "-"}
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def test_flops_per_token_formula():
    # full: 6 N; LoRA/QLoRA: 4 N of frozen base (forward + input gradient) + 6 N_lora; N leaves out the embedding
    assert summary.flops_per_token("full", params=1000, lora_params=0, embedding_params=100) == 6 * 900
    assert summary.flops_per_token("lora", params=1010, lora_params=10, embedding_params=100) == 4 * 900 + 6 * 10
    assert summary.flops_per_token("qlora", params=1010, lora_params=10, embedding_params=0) == 4 * 1000 + 6 * 10
    assert summary.embedding_params(ROOT / "configs/models/llama-3.1-8b.json") == E8
    assert summary.embedding_params(ROOT / "configs/models/llama-3.2-1b.json") == 0  # tied: also the output head


def test_table_from_fake_runs(tmp_path):
    _write_run(tmp_path, "lora_8b", "lora", config="llama-3.1-8b", params=P8, lora=L8, sim=True)
    _write_run(tmp_path, "full_1b", "full", config="llama-3.2-1b", params=1_235_814_400, lora=0, sim=False)
    with open(tmp_path / "runs.tsv", "a") as f:
        f.write("lora_8b_compile\tlora\tskipped: no engine.compile\tllama-3.1-8b-lora-1x24gb\thardware.gpu=h200-141gb\n")
    lora, full, skipped = _table(tmp_path)

    assert lora["tokens/s"] == "10,500" and lora["measured steps"] == "4"
    mfu = (4 * (P8 - L8 - E8) + 6 * L8) * 10_500 / 989e12  # configs/hardware/h200-141gb.yaml: 989 bf16 TFLOP/s
    assert lora["MFU %"] == f"{100 * mfu:.1f}" == "32.0"
    assert full["MFU %"] == f"{100 * 6 * 1_235_814_400 * 10_500 / 989e12:.1f}" == "7.9"
    assert lora["peak GiB"] == "25.00" and lora["plan GiB"] == "20.00" and lora["peak / plan"] == "1.250"
    assert (lora["roofline tokens/s"], lora["roofline verdict"]) == ("6,311", "host-bound")
    assert (full["roofline tokens/s"], full["roofline verdict"]) == ("-", "-")  # no --simulate result
    assert lora["loss first -> last"] == "12.000 -> 7.000"
    assert skipped["status"] == "skipped: no engine.compile"
    assert {skipped[c] for c in summary.COLUMNS[3:]} == {"-"}


def test_generated_documents_are_hundreds_of_tokens(tmp_path):
    path = gpu_data.write(tmp_path / "docs.jsonl", 400)
    lengths = sorted(len(json.loads(x)["text"]) for x in path.read_text().splitlines())
    assert len(lengths) == 400
    assert gpu_data.MIN_CHARS <= lengths[0] and lengths[-1] <= gpu_data.MAX_CHARS + 40  # one word past the target
    assert 400 <= lengths[200] <= 900  # median: hundreds of (character) tokens


@pytest.mark.parametrize("method", ["dpo", "prefix"])
def test_unknown_method_is_an_invariant(method):
    with pytest.raises(AssertionError):
        summary.flops_per_token(method, params=10, lora_params=0, embedding_params=0)
