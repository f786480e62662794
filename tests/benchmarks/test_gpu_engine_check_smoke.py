"""benchmarks/gpu_engine_check.py on the CPU (--device cpu --smoke, tiny random models), so the
sections scripts/gpu_check.sh runs once on a borrowed GPU cannot rot: each runs the code paths
it runs there, and its results come out equal where they must."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.benchmarks.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_engine_check.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """Every section run once, in this process (~30 s on 2 cores)."""
    script = load_script("gpu_engine_check")
    out = tmp_path_factory.mktemp("gpu_engine_check")
    models = tmp_path_factory.mktemp("models")
    found = {}
    for section in script.SECTIONS:
        path = out / f"engine_{section}.json"
        argv = [section, "--out", str(path), "--device", "cpu", "--smoke"]
        script.main([*argv, "--models-dir", str(models), "--log-level", "WARNING"])
        found[section] = json.loads(path.read_text())
    return out, found


@pytest.mark.timeout(300)
def test_every_section_runs_ok_on_the_cpu(results) -> None:
    _, found = results
    failed = {
        name: r.get("error") or r["status"] for name, r in found.items() if r["status"] != "ok"
    }
    assert not failed, failed
    assert all(r["seconds"] > 0 and r["plan"]["big_preset"] == "tiny" for r in found.values())


@pytest.mark.timeout(300)
def test_the_engine_equals_transformers_and_kv_survives_every_path(results) -> None:
    _, found = results
    rows = found["vs-hf"]["rows"]
    assert [r["arch"] for r in rows] == ["llama", "qwen2", "qwen3", "mistral"]
    assert all(r["equal"] == r["prompts"] == 2 for r in rows)
    kv = found["kv-io"]["rows"]
    assert [r["dtype"] for r in kv] == ["bfloat16", "float8_e4m3fn"]
    assert all(r["equal"] and r["pieces"] >= 1 and r["gather_gb_s"] > 0 for r in kv)
    disagg = found["disagg"]
    assert disagg["equal"] == disagg["requests"] == 2
    # 2 prompts of 40 tokens: 3 blocks each of tiny's 4 layers x (K, V) x 2 heads x 16 x 64 bf16
    assert disagg["kv_bytes"] == 2 * 3 * 4 * 2 * 2 * 16 * 64 * 2


@pytest.mark.timeout(300)
def test_rooflines_and_graph_ratios_are_reported(results) -> None:
    _, found = results
    tp = found["throughput"]
    for key in ("output_tokens_per_s", "decode_step_ms", "copy_gb_s", "matmul_tflops"):
        assert tp[key] > 0, key
    assert 0 < tp["decode_vs_roofline"] and 0 < tp["prefill_vs_matmul"]
    graphs = found["graphs"]
    assert {(r["batch"], r["cuda_graphs"]) for r in graphs["rows"]} == {
        (1, True),
        (1, False),
        (2, True),
        (2, False),
    }
    assert set(graphs["graphs_vs_eager"]) == {"1", "2"}


@pytest.mark.timeout(300)
def test_summary_table_names_every_section(results) -> None:
    out, _ = results
    (out / "gpu_kernels.json").write_text(
        json.dumps({"sections": {"correctness": {"status": "ok", "rows": [{"ok": True}]}}})
    )
    (out / "engine_dead.json").write_text(json.dumps({"section": "dead", "status": "running"}))
    table = load_script("gpu_engine_check").summary(out)
    for line in ("| vs-hf | ok |", "| disagg | ok |", "| dead | killed (timeout?) |"):
        assert line in table
    assert "kernels: 1/1 correctness cases" in table


def test_gpu_check_script_parses() -> None:
    proc = subprocess.run(
        ["bash", "-n", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True
    )
    assert proc.returncode == 0, proc.stderr
