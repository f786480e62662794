"""The gateway's live status page in headless Chromium: it lists every node and, under load,
its plots fill with moving data; a screenshot is saved in the test's tmp folder."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
VIRTUAL_TIME_BUDGET_MS = 6000
"""The page polls every second; under virtual time this lets it render about six updates."""
TIMEOUT_S = 60.0

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")


def chromium(url: str, profile: Path, *args: str) -> str:
    cmd = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage"]
    cmd += [f"--user-data-dir={profile}", f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}"]
    result = subprocess.run(
        [*cmd, *args, url], capture_output=True, text=True, timeout=TIMEOUT_S, check=True
    )
    return result.stdout


class Load:
    """Chat requests back to back on two threads until stopped."""

    def __init__(self, stack) -> None:
        self._client = openai.OpenAI(
            base_url=f"{stack.base_url}/v1", api_key="none", timeout=TIMEOUT_S
        )
        self._model = stack.model
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(2)]
        self.completed = 0

    def _run(self, index: int) -> None:
        i = 0
        while not self._stop.is_set():
            text = f"status page load {index} {i} " * (3 if i % 2 else 30)
            self._client.chat.completions.create(
                model=self._model, messages=[{"role": "user", "content": text}], max_tokens=24
            )
            self.completed += 1
            i += 1

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(TIMEOUT_S)


def plot(dom: str, plot_id: str) -> dict[str, float]:
    match = re.search(rf'<svg id="{plot_id}"[^>]*>', dom)
    assert match, f"{plot_id} missing"
    attrs = dict(re.findall(r'data-(\w+)="([^"]*)"', match.group(0)))
    return {k: float(v) for k, v in attrs.items()}


def test_status_page_shows_every_node_and_plots_live_data(stack, tmp_path):
    url = f"{stack.base_url}/dashboard"
    node_ids = {stack.load(name).node_id for name in stack.nodes if name != "gateway"}
    with Load(stack) as load:
        # A few requests and two whole seconds of tokens for the throughput window.
        started = time.monotonic()
        while load.completed < 4 or time.monotonic() - started < 2:
            assert time.monotonic() - started < TIMEOUT_S, "the load did not get going"
            time.sleep(0.2)
        dom = chromium(url, tmp_path / "profile", "--dump-dom")
        screenshot = tmp_path / "dashboard.png"
        chromium(
            url,
            tmp_path / "profile",
            f"--screenshot={screenshot}",
            "--window-size=1400,1000",
            "--hide-scrollbars",
        )
    updates = int(re.search(r'<body data-updates="(\d+)"', dom).group(1))
    assert updates >= 3, "the page did not keep polling"
    shown = set(re.findall(r'<tr data-node-id="([^"]+)"', dom))
    assert shown == node_ids
    assert 'class="dot ok"' in dom and 'class="dot bad"' not in dom
    for plot_id in ("plot-tokens", "plot-ttft", "plot-itl", "plot-queue", "plot-kv"):
        assert plot(dom, plot_id)["points"] == updates
    assert plot(dom, "plot-tokens")["max"] > 0, "throughput stayed flat under load"
    assert plot(dom, "plot-ttft")["max"] > 0
    assert screenshot.stat().st_size > 10_000
    print(f"status page screenshot: {screenshot}")
