// The kernels' parallel loops: parallel_for, at::parallel_for's split and semantics, run either
// by OpenMP (at::parallel_for) or by this library's own pool of worker threads, which spin
// between loops while the engine is inside a step (set_threads_hot) and sleep outside it.
//
// Why a pool of our own: a decode step of a small model is ~180 short parallel loops. With
// libgomp's default policy its idle worker spins for a while (~7 ms here) and every loop starts
// at once; a serving node cannot afford that spin (it takes the core the gateway, the client
// and the node's asyncio thread need between steps: served throughput fell 10%), so `pdserve
// serve` sets OMP_WAIT_POLICY=PASSIVE, and then every loop wakes a sleeping thread (~60-80 us on
// this VM: a SmolLM2 fp32 decode step of 8 rows, medians 36.6 -> 49.5 ms). libgomp's policy is
// fixed at load, so it cannot spin inside a step and sleep between steps; this pool does.
//
// On with PDSERVE_KERNEL_POOL=1, which `pdserve serve` gives a node whose threads have the cores
// to themselves (its nodes' threads together no more than the machine's cores: e.g. one
// aggregated node): SmolLM2 fp32 served, 40 x 256 in / 64 out, 8 in flight, 1.03-1.16x the
// throughput (benchmarks/kernel_pool_ab.py; README, the AVX2 section). Where nodes share cores
// (serve's default 1 prefill + 1 decode node with every core each) a worker spinning inside one
// node's step takes the core the other node computes on: 0.74x there, so those keep OpenMP.
// Off by default: one process alone on the machine (the offline LLM) has libgomp's default
// policy, whose idle threads spin anyway (~7 ms), and a second spinning pool beside them made
// its decode steps ~1.5x slower.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/FunctionRef.h>

#include <algorithm>
#include <cstdint>

namespace pdserve_cpu {

// Whether the pool runs the loops (PDSERVE_KERNEL_POOL=1, read once per process).
bool pool_enabled();

// Runs f over [begin, end) split as at::parallel_for splits it into `tasks` chunks, on the
// pool's threads (the caller takes chunk 0). Returns false, having run nothing, when the pool
// is busy (another thread is dispatching) or off.
bool pool_run(int64_t begin, int64_t end, int64_t chunk, int64_t tasks,
              c10::function_ref<void(int64_t, int64_t)> f);

// Whether the calling thread is one of the pool's workers running a chunk (nested loops run
// inline there, as inside an OpenMP region).
bool in_pool_task();

// How many loops the pool has run in this process (0 when it is off).
int64_t pool_jobs();

// Workers spin between loops while hot (up to a bound, so a missed reset cannot burn a core),
// and sleep after a few microseconds otherwise.
void set_threads_hot(bool hot);

// at::parallel_for's contract: f(b, e) over consecutive ranges covering [begin, end), at most
// at::get_num_threads() of them, each at least `grain` long (but the last).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  if (!pool_enabled()) return at::parallel_for(begin, end, grain, f);
  const int64_t threads = at::get_num_threads();
  if (n <= grain || threads <= 1 || in_pool_task() || at::in_parallel_region())
    return f(begin, end);
  const int64_t tasks = std::min<int64_t>(threads, (n + grain - 1) / std::max<int64_t>(grain, 1));
  const int64_t chunk = (n + tasks - 1) / tasks;
  const int64_t used = (n + chunk - 1) / chunk;  // chunks that are not empty
  if (used <= 1) return f(begin, end);
  if (!pool_run(begin, end, chunk, used, f)) at::parallel_for(begin, end, grain, f);
}

}  // namespace pdserve_cpu
