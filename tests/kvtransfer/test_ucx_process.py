"""A process that used the UCX transport exits on its own (ucxx's notifier thread is not a
daemon thread; the transport must stop it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdserve.kvtransfer.transport import available_transports

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif("ucx" not in available_transports(), reason="ucxx does not import"),
]

SCRIPT = textwrap.dedent(
    """
    import asyncio
    import numpy as np
    from pdserve.kvtransfer.transport import make_receiver, make_sender
    from pdserve.kvtransfer.wire import LayoutSignature, TransferHeader

    async def main():
        layout = LayoutSignature("m", "float32", 1, 1, 4, 4)
        receiver, sender = make_receiver("ucx"), make_sender("ucx")
        await receiver.start()
        token = receiver.expect("t", layout, 1, lambda header, payload: None)
        header = TransferHeader("t", layout, 0, 1, layout.block_bytes, token=token)
        await sender.send(receiver.address, header, np.zeros(layout.block_bytes, np.uint8))
        await receiver.wait("t", timeout_s=5)
        await sender.close()
        await receiver.close()

    asyncio.run(main())
    print("main returned", flush=True)
    """
)


def run_script(script: str) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter at the repository root (30 s at most)."""
    repo_root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=repo_root,
        env={**os.environ, "PYTHONPATH": str(repo_root), "UCX_WARN_UNUSED_ENV_VARS": "n"},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_process_exits_without_an_explicit_ucx_shutdown():
    result = run_script(SCRIPT)
    assert "main returned" in result.stdout, result.stderr
    assert result.returncode == 0, result.stderr


def test_a_ucxx_with_other_internals_keeps_its_progress_thread_and_works():
    """The progress thread's epoll timeout is set through ucxx internals (kvtransfer/ucx.py,
    _progress_thread_timeout); a ucxx release without them must still transfer, with a
    warning, never fail to initialise."""
    script = (
        "import logging\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from ucxx._lib_async import application_context, continuous_ucx_progress\n"
        "class Moved(continuous_ucx_progress.ThreadMode):  # as if a release moved it\n"
        "    pass\n"
        "application_context.ThreadMode = Moved\n" + SCRIPT
    )
    result = run_script(script)
    assert "main returned" in result.stdout, result.stderr
    assert result.returncode == 0, result.stderr
    assert "keeps its 1 ms epoll timeout" in result.stderr
