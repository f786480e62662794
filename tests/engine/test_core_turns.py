"""Turns on shared cores (engine/core_turns.py): real processes on one lock file never compute
at once, alternate when all are busy, and a killed holder frees the turn; an EngineLoop given
turns steps only on its turn."""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import time
from pathlib import Path

import pytest

from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.core_turns import CoreTurns
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import SamplingParams

TURNS = 60
HOLD_S = 0.002


def _take_turns(path: str, name: str, log: str, start: multiprocessing.synchronize.Barrier) -> None:
    """TURNS back-to-back turns (no pause between them), each logged with its start and end."""
    turns = CoreTurns(path)
    start.wait(60)
    with open(log, "a") as out:
        for _ in range(TURNS):
            with turns.turn():
                begin = time.monotonic()
                time.sleep(HOLD_S)
                out.write(f"{name} {begin:.6f} {time.monotonic():.6f}\n")
                out.flush()


def test_busy_processes_never_overlap_and_alternate(tmp_path: Path) -> None:
    path, log = str(tmp_path / "turn.lock"), str(tmp_path / "turns.log")
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)  # both processes up before either takes a turn
    procs = [ctx.Process(target=_take_turns, args=(path, n, log, start)) for n in "AB"]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    turns = sorted((float(b), float(e), n) for n, b, e in (line.split() for line in open(log)))
    assert len(turns) == 2 * TURNS
    for (_, end, _), (begin, _, _) in itertools.pairwise(turns):
        assert begin >= end  # never two turns at once
    # Both busy: the turnstile hands the next turn to the waiting process, so neither takes
    # more than two turns in a row until the other is done (a bare flock() lets the process
    # that just let go take it again at once, many times over).
    names = [n for _, _, n in turns]
    both_from = max(names.index("A"), names.index("B"))
    both_to = min(len(names) - 1 - names[::-1].index(n) for n in "AB")
    longest, run = 1, 1
    for before, name in itertools.pairwise(names[both_from : both_to + 1]):
        run = run + 1 if name == before else 1
        longest = max(longest, run)
    assert both_to - both_from > TURNS and longest <= 2


def _hold_forever(path: str, held: multiprocessing.synchronize.Event) -> None:
    turns = CoreTurns(path)
    with turns.turn():
        held.set()
        time.sleep(600)


def test_a_killed_holder_frees_the_turn(tmp_path: Path) -> None:
    path = str(tmp_path / "turn.lock")
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    holder = ctx.Process(target=_hold_forever, args=(path, held))
    holder.start()
    try:
        assert held.wait(30)
        probe = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        turns = CoreTurns(path)
        begin = time.monotonic()
        with turns.turn():
            assert time.monotonic() - begin < 5
        turns.close()
    finally:
        if holder.is_alive():
            holder.kill()


def test_a_lock_in_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "turn.lock"
    with pytest.raises(ValueError, match="shared cores lock .*nowhere.*: no directory"):
        CoreTurns(str(missing))


def test_the_engine_loop_steps_only_on_its_turn(tiny_llama, tmp_path: Path) -> None:
    path = str(tmp_path / "turn.lock")
    turns = CoreTurns(path)
    other = os.open(path, os.O_RDWR)  # another node's turn: a second open file, same lock
    fcntl.flock(other, fcntl.LOCK_EX)
    eng = LLMEngine(
        ModelConfig(tiny_llama, dtype="float32"), CacheConfig(num_blocks=32), SchedulerConfig()
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def main() -> tuple[tuple[int, int], list[int]]:
        loop = EngineLoop(eng, asyncio.get_running_loop(), turns)
        loop.start()
        try:
            stream = loop.open_stream("r")
            await loop.call(lambda e: e.add_request("r", list(range(300, 340)), params))
            with pytest.raises(asyncio.TimeoutError):
                await stream.get(timeout_s=0.5)  # the other node holds the cores
            load = eng.load()  # readable from any thread; the engine thread waits its turn
            held = (load.num_waiting, load.num_running)
            fcntl.flock(other, fcntl.LOCK_UN)
            tokens: list[int] = []
            while True:
                update = await stream.get(timeout_s=30)
                tokens += update.new_token_ids
                if update.finished:
                    return held, tokens
        finally:
            loop.stop()

    try:
        held, tokens = asyncio.run(main())
    finally:
        os.close(other)
        turns.close()
    assert len(tokens) == 3
    assert held == (1, 0)  # not one step ran while the other held the turn: never scheduled
