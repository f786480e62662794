"""offline_throughput.py with float32 weights kept off the few-row kernel, for an A/B of it in
the engine: with `--float32-onednn` every float32 product goes to oneDNN / F.linear, as on AMX
builds before the AVX-512 float32 loop (pdserve_kernels/cpu/linear.cpp); without it the run is
offline_throughput.py's own. Every other argument is offline_throughput.py's. Alternate the two
in one session (this host's speed drifts):

    for i in 1 2; do for off in "" --float32-onednn; do
      .venv/bin/python benchmarks/offline_small_rows_ab.py $off --model M --systems pdserve \\
          --dtypes float32 --num-requests 48 --rounds 2 --skip-overhead --result-file R$i$off.json
    done; done
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offline_throughput  # noqa: E402

from pdserve.engine.models import llama  # noqa: E402


def main() -> None:
    argv = sys.argv[1:]
    if "--float32-onednn" in argv:
        argv.remove("--float32-onednn")
        real = llama.pack_small_rows

        def bf16_only(weight: torch.Tensor) -> torch.Tensor | None:
            return None if weight.dtype == torch.float32 else real(weight)

        llama.pack_small_rows = bf16_only
    offline_throughput.main(argv)


if __name__ == "__main__":
    main()
