"""The CPU kernels' own worker pool (pdserve_kernels/cpu/thread_pool.h): on when asked
(PDSERVE_KERNEL_POOL=1, what `pdserve serve` gives a node whose threads fit the cores), off
otherwise; the same results as OpenMP's loops to the bit; safe
across fork, with two dispatching threads, and on fewer CPUs than threads; and the engine's hot
scope. The pool is decided once per process, so each case runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from pdserve.kernels import cpu
from pdserve.make_model import make_model

# Every kernel with a parallel loop, at sizes that split across two threads, in float32 and
# bf16; prints the pool's state and one digest of every output's bytes.
_KERNELS = textwrap.dedent(
    """
    import hashlib, os, sys, torch
    from pdserve.kernels.cpu import cpu_ops
    torch.set_num_threads(2)
    ops = cpu_ops()
    assert ops is not None
    digest = hashlib.sha256()
    def keep(t):
        digest.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, n, k in ((1, 960, 576), (8, 3072, 576), (48, 576, 1536), (300, 200, 96)):
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(rows, k, generator=g).to(dtype)
            if ops.linear_small_m_available():
                keep(ops.linear_small_m(x, ops.pack_linear_weight(w), n, None))
        x = torch.randn(4096, 576, generator=g).to(dtype)
        keep(ops.rms_norm(x, torch.randn(576, generator=g).to(dtype), 1e-6))
        keep(ops.silu_and_mul(torch.randn(64, 3072, generator=g).to(dtype)))
        hq, hkv, d, bs, reqs = 9, 3, 64, 16, 8
        cache = torch.randn(200, 2, hkv, bs, d, generator=g).to(dtype)
        tables = torch.randperm(199, generator=g)[: reqs * 20].view(reqs, 20) + 1
        lens = torch.randint(1, 20 * bs, (reqs,), generator=g)
        q = torch.randn(reqs, hq, d, generator=g).to(dtype)
        keep(ops.paged_decode_attention(q, cache, tables, lens, d**-0.5, 0))
        q = torch.randn(3 * 100, hq, d, generator=g).to(dtype)
        out = torch.zeros_like(q)
        ops.paged_prefill_attention_out(
            q, cache, torch.tensor([0, 100, 200]), torch.tensor([100, 100, 100]),
            torch.tensor([100, 150, 300]), tables[:3], d**-0.5, out, 0)
        keep(out)
    keep(ops.argmax_rows(torch.randn(16, 49152, generator=g)))
    print(ops.kernel_pool_enabled(), ops.kernel_pool_jobs() > 0, digest.hexdigest())
    """
)


@pytest.fixture(scope="module")
def built() -> None:
    if cpu.cpu_ops() is None:
        pytest.fail("the CPU kernels must build on this machine (gcc + ninja)")


def run(code: str, **env: str) -> list[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PDSERVE_KERNEL_POOL", "OMP_NUM_THREADS")
    }
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_pool_only_when_asked_with_the_same_bits_as_openmp(built) -> None:
    openmp = run(_KERNELS)
    assert openmp[:2] == ["False", "False"]  # by default: OpenMP's loops
    passive = run(_KERNELS, OMP_WAIT_POLICY="PASSIVE")
    assert passive[:2] == ["False", "False"]
    asked = run(_KERNELS, OMP_WAIT_POLICY="PASSIVE", PDSERVE_KERNEL_POOL="1")
    assert asked[:2] == ["True", "True"]
    refused = run(_KERNELS, PDSERVE_KERNEL_POOL="0")
    assert refused[:2] == ["False", "False"]
    assert openmp[2] == passive[2] == asked[2] == refused[2]


def test_pool_on_fewer_cpus_than_threads(built) -> None:
    """Two threads on one CPU: nobody spins (the worker would take the core its dispatcher
    waits on); the results are the same."""
    pinned = "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
    pooled = run(pinned + _KERNELS, PDSERVE_KERNEL_POOL="1", OMP_WAIT_POLICY="PASSIVE")
    assert pooled[:2] == ["True", "True"] and pooled[2] == run(_KERNELS)[2]


def test_pool_survives_fork_and_two_dispatching_threads(built) -> None:
    code = textwrap.dedent(
        """
        import os, threading, torch
        from pdserve.kernels.cpu import cpu_ops
        torch.set_num_threads(2)
        ops = cpu_ops()
        assert ops.linear_small_m_available()
        g = torch.Generator().manual_seed(1)
        w = torch.randn(3072, 576, generator=g)
        packed = ops.pack_linear_weight(w)
        x = torch.randn(8, 576, generator=g)
        want = ops.linear_small_m(x, packed, 3072, None)
        assert ops.kernel_pool_jobs() > 0
        pid = os.fork()
        if pid == 0:  # the child has no workers: the pool starts its own
            ok = all(torch.equal(ops.linear_small_m(x, packed, 3072, None), want) for _ in range(50))
            os._exit(0 if ok and ops.kernel_pool_jobs() > 0 else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        bad = []
        def hammer():
            for _ in range(300):
                if not torch.equal(ops.linear_small_m(x, packed, 3072, None), want):
                    bad.append(1)
        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for t in threads: t.start()
        for t in threads: t.join(120)
        assert not any(t.is_alive() for t in threads) and not bad
        print("ok")
        """
    )
    assert run(code, PDSERVE_KERNEL_POOL="1", OMP_WAIT_POLICY="PASSIVE") == ["ok"]


def test_hot_scope_nests_and_always_ends() -> None:
    calls: list[bool] = []
    ops = SimpleNamespace(kernel_pool_enabled=lambda: True, set_threads_hot=calls.append)
    with cpu.threads_hot(ops):
        with cpu.threads_hot(ops):
            pass
        assert calls == [True]
    assert calls == [True, False]
    with pytest.raises(ValueError), cpu.threads_hot(ops):
        raise ValueError("a failed step")
    assert calls == [True, False, True, False]
    off = SimpleNamespace(kernel_pool_enabled=lambda: False, set_threads_hot=calls.append)
    with cpu.threads_hot(off), cpu.threads_hot(None):
        pass
    assert calls == [True, False, True, False]


def test_the_engine_runs_the_pool_hot_only_where_every_product_is_the_kernels() -> None:
    """A forward whose products oneDNN takes (more than SMALL_ROWS_MAX rows, on CPUs where the
    kernel does not take every row count) runs them on OpenMP's threads: the pool must not spin
    beside them (ModelRunner._hot_ops gives None there); decode-sized forwards, and every
    forward where the kernel takes all rows, run hot; without the pool nothing is hot."""
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.models.llama import SMALL_ROWS_MAX

    pool = SimpleNamespace(name="the kernels' ops")

    def chunks(*sizes: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(token_ids=[0] * n) for n in sizes]

    def hot(runner: SimpleNamespace, *sizes: int) -> object:
        return ModelRunner._hot_ops(runner, chunks(*sizes))

    mixed = SimpleNamespace(_pool_ops=pool, _pool_takes_all=False)
    assert hot(mixed, *[1] * 48) is pool
    assert hot(mixed, SMALL_ROWS_MAX - 8, 1, 1, 1, 1, 1, 1, 1, 1) is pool  # exactly the limit
    assert hot(mixed, SMALL_ROWS_MAX, 1) is None  # one row past it: oneDNN's
    assert hot(mixed, 512, *[1] * 7) is None
    kernel_only = SimpleNamespace(_pool_ops=pool, _pool_takes_all=True)
    assert hot(kernel_only, 2048) is pool
    off = SimpleNamespace(_pool_ops=None, _pool_takes_all=False)
    assert hot(off, 1) is None and hot(off, 2048) is None


_TAKE_ALL = textwrap.dedent(
    """
    import os, torch
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.models.llama import Linear, small_rows_take_all
    from pdserve.kernels.cpu import cpu_ops
    torch.set_num_threads(2)
    ops = cpu_ops()
    llm = LLM(model=os.environ["MODEL"], dtype="float32", max_num_batched_tokens=512)
    model = llm.engine.runner.model
    model.use_compiled_layers = False  # the spy below sees the products the Python layers call
    every_layout = all(m.weight.shape[1] % 32 == 0 for m in model.modules() if isinstance(m, Linear))
    rows = []
    real = ops.linear_small_m
    def spy(x, *rest):
        rows.append(x.shape[0])
        return real(x, *rest)
    ops.linear_small_m = spy
    prompts = [[(7 * i + 3) % 97 + 5 for i in range(300)], [11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    print(ops.linear_small_m_available(), ops.linear_small_m_all_rows(), small_rows_take_all(),
          every_layout, model.products_on_kernel(), llm.engine.runner._pool_takes_all,
          max(rows, default=0) > 128, ",".join(str(t) for o in outs for t in o.outputs[0].token_ids))
    """
)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_where_the_pool_runs_the_kernel_takes_every_product(
    built, preset, tiny_llama, tmp_path_factory
) -> None:
    """A node with the kernels' pool (PDSERVE_KERNEL_POOL=1, a served node whose threads fit
    the cores) keeps no oneDNN copy of a weight the kernel has a layout for: its prefill
    chunks' products (300 rows here) run on the kernel, on the pool, with the same greedy
    tokens as oneDNN gives them without the pool; without it, oneDNN takes the products of
    more than SMALL_ROWS_MAX rows except on AVX2-only CPUs. The pool stays hot in every
    forward only where every weight has the layout (the small preset; the tiny one's down
    projection, K = 688, has none)."""
    if preset == "tiny":
        model = tiny_llama
    else:
        model = str(tmp_path_factory.mktemp("small_llama"))
        make_model("llama", "small", model, seed=0)
    seen = {}
    for pool in ("0", "1"):
        *flags, tokens = run(_TAKE_ALL, PDSERVE_KERNEL_POOL=pool, MODEL=model)
        available, avx2_only, take_all, every_layout, on_kernel, runs_hot, many_rows = (
            f == "True" for f in flags
        )
        assert available, "the few-row kernel runs on every AVX2 + FMA CPU these tests use"
        assert every_layout == (preset == "small")
        assert take_all == (avx2_only or pool == "1")
        assert on_kernel == (take_all and every_layout)
        assert runs_hot == (on_kernel and pool == "1")
        assert many_rows == take_all
        seen[pool] = tokens
    assert len(seen["1"].split(",")) == 16
    assert seen["0"] == seen["1"]
