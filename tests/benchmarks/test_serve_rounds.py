"""benchmarks/serve_rounds.py: its arguments and how it sums rounds up (the served runs
themselves need vLLM's CPU build and minutes; they are not run here)."""

from __future__ import annotations

import pytest

from tests.benchmarks.scripts import load_script

serve_rounds = load_script("serve_rounds")


def run(throughput: float, ttft: float = 100.0) -> dict[str, float]:
    return {
        "output_throughput": throughput,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft,
        "median_itl_ms": 10.0,
        "p99_itl_ms": 40.0,
    }


def test_medians_over_rounds_and_ratios_per_client():
    runs = {
        "vllm": {"pdserve": [run(100), run(140), run(120)], "vllm": [run(110), run(90), run(100)]},
        "agg": {"pdserve": [run(150), run(100), run(180)], "vllm": [run(120), run(130), run(125)]},
    }
    summary = serve_rounds.summarise(runs)
    assert summary["medians"]["vllm"]["pdserve"]["output_throughput"] == 120
    assert summary["medians"]["agg"]["vllm"]["output_throughput"] == 125
    assert summary["medians"]["agg"]["pdserve"]["rounds_output_throughput"] == [150, 100, 180]
    # each client's pdserve median over the same client's vLLM median
    assert summary["vs_vllm"]["agg"]["pdserve"] == pytest.approx(150 / 120)
    assert summary["vs_vllm"]["agg"]["vllm"] == pytest.approx(125 / 100)
    assert "vllm" not in summary["vs_vllm"]
    table = serve_rounds.report(summary)
    assert "| agg | pdserve | 150.0 | 150.0 / 100.0 / 180.0 |" in table
    assert "**1.25x**" in table


def test_without_vllm_there_are_no_ratios():
    summary = serve_rounds.summarise({"1+1": {"pdserve": [run(90), run(110)]}})
    assert summary["vs_vllm"] == {}
    assert summary["medians"]["1+1"]["pdserve"]["output_throughput"] == 100


@pytest.mark.parametrize(
    "flags",
    [
        ["--servers", "vllm,sglang"],
        ["--servers", "agg,agg"],
        ["--clients", "pdserve,curl"],
        ["--rounds", "0"],
    ],
)
def test_bad_arguments_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        serve_rounds.parse_args(["--model", "m", *flags])
    assert "error" in capsys.readouterr().err


def test_servers_rotate_and_layouts_map_to_serve_flags():
    args = serve_rounds.parse_args(["--model", "m", "--servers", "1+1,vllm", "--rounds", "3"])
    assert args.server_list == ["1+1", "vllm"] and args.client_list == ["pdserve", "vllm"]
    assert serve_rounds.PDSERVE_LAYOUT_ARGS["agg"] == ["--num-prefill", "0"]
    assert serve_rounds.round_orders(["vllm", "agg", "1+1"], 4) == [
        ["vllm", "agg", "1+1"],
        ["agg", "1+1", "vllm"],
        ["1+1", "vllm", "agg"],
        ["vllm", "agg", "1+1"],
    ]
