"""benchmarks/gpu_kernels.py on the CPU (Triton's interpreter, --smoke), so the script that runs
once on a borrowed GPU cannot rot: every section runs, every correctness case passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_kernels.py"


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu_kernels") / "x.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(out)]
    # ~25 s on a 2-core machine; the budget only keeps a very slow machine from running on
    proc = subprocess.run(
        [*cmd, "--budget-s", "120"], cwd=REPO, env=env, capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.timeout(180)
def test_every_correctness_case_passes(smoke_results: dict) -> None:
    section = smoke_results["sections"]["correctness"]
    assert section["status"] == "ok"
    script = load_script("gpu_kernels")
    expected = len(script.correctness_specs(script.SMOKE_PLAN))
    assert len(section["rows"]) == expected == section["total"]
    failing = [r for r in section["rows"] if not r["ok"]]
    assert not failing, failing
    assert {r["kernel"] for r in section["rows"]} == {"decode", "prefill", "store"}
    assert {r["layout"] for r in section["rows"]} == {"token_major", "head_major"}
    assert {r["dtype"] for r in section["rows"]} == {"float32", "float32 fp8kv"}


@pytest.mark.timeout(180)
def test_every_section_runs_and_times_every_baseline(smoke_results: dict) -> None:
    sections = smoke_results["sections"]
    assert list(sections) == ["environment", "correctness", "decode", "prefill", "store", "summary"]
    assert all(s["status"] == "ok" for s in sections.values()), sections
    for name in ("decode", "prefill", "store"):
        rows = sections[name]["rows"]
        assert rows
        for row in rows:
            errors = {k: v for k, v in row.items() if "error" in k}
            assert not errors, (name, errors)
    decode = sections["decode"]["rows"][0]
    timed = ("triton_token_major", "triton_head_major", "triton_s1", "triton_s3", "triton_fp8")
    for key in (*timed, "reference", "sdpa_pregathered", "sdpa_flash", "sdpa_with_gather"):
        assert decode[f"{key}_us"] > 0, key
    assert decode["triton_token_major_x_flash"] > 0 and decode["triton_fp8_x_flash"] > 0
    assert decode["best_fixed_splits"] in (1, 3)
    assert decode["triton_vs_sdpa"] < 1e-4  # fp32
    prefill_keys = set(sections["prefill"]["rows"][0])
    assert {"triton_token_major_m16_us", "triton_fp8_m16_us"} <= prefill_keys
    store_caches = {r["cache_dtype"] for r in sections["store"]["rows"]}
    assert store_caches == {"float32", "float8_e4m3fn"}
    assert "| B | ctx |" in smoke_results["summary_markdown"]
