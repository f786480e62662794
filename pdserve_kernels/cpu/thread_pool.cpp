// The kernels' own worker pool (thread_pool.h says why and when it runs).
#include "thread_pool.h"

#include "spin_wait.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

namespace pdserve_cpu {
namespace {

using Clock = std::chrono::steady_clock;

// How long an idle worker spins before it sleeps: while hot, long enough to cover the Python
// between two loops of a step (tens of microseconds), bounded so that a hot section that never
// ends, or a long pause inside one, does not keep a core busy; when not hot, a few microseconds
// (back-to-back calls outside a step).
constexpr Clock::duration kHotSpin = std::chrono::milliseconds(2);
constexpr Clock::duration kCoolSpin = std::chrono::microseconds(20);
// Idle spinning is plain pause instructions (~25 ns each on AMD Zen 3), as libgomp's: no
// sched_yield, which hands the core to any runnable thread, the KV cache's idle-priority
// prefault thread included (engine/host_memory.py), and a yielded spinner then waits up to a
// scheduler tick for the core back (a SmolLM2 decode step of 8 rows: 42-54 ms, median 49, with
// a yield every 64 pauses against 36-47 ms, median 40, without). Threads that wake (the node's
// asyncio thread, a gateway) still preempt a spinner, whose CPU time is far ahead of theirs.
constexpr int kPausesPerClockRead = 64;

struct Pool {
  // A seqlock over the job: odd while the dispatcher writes it, even once published. A worker
  // reads the job between two equal even values, so it never acts on a torn one.
  std::atomic<uint32_t> seq{0};
  std::atomic<int> sleepers{0};
  std::atomic<int64_t> pending{0};  // chunks not yet done by workers
  std::atomic<bool> hot{false};
  std::atomic<int64_t> begin{0}, end{0}, chunk{1}, tasks{0};
  std::atomic<const c10::function_ref<void(int64_t, int64_t)>*> fn{nullptr};
  std::mutex dispatch;  // one job at a time; a second dispatcher falls back to OpenMP
  int workers = 0;      // started (under `dispatch`)
  // More threads than the CPUs this process may run on (a narrow affinity): nobody spins, a
  // spinner would take the core of the thread it waits for.
  std::atomic<bool> oversubscribed{false};
  std::mutex error_mu;
  std::exception_ptr error;
  std::atomic<int64_t> jobs{0};  // loops run on the pool (tests read it)
};

Pool* pool = nullptr;  // leaked: workers may still be waiting on it at exit
thread_local bool worker_thread = false;

void run_chunk(Pool& p, const c10::function_ref<void(int64_t, int64_t)>& f, int64_t index) {
  const int64_t chunk = p.chunk.load(std::memory_order_relaxed);
  const int64_t b = p.begin.load(std::memory_order_relaxed) + index * chunk;
  const int64_t e = std::min(p.end.load(std::memory_order_relaxed), b + chunk);
  try {
    f(b, e);
  } catch (...) {
    std::lock_guard<std::mutex> lock(p.error_mu);
    if (!p.error) p.error = std::current_exception();
  }
}

// Waits until seq is even and differs from `seen`: spins (pause), then sleeps on the futex.
uint32_t wait_for_job(Pool& p, uint32_t seen) {
  // The bound follows the hot flag while spinning: a step that ends stops the spin ~20 us
  // into the wait (at once, if the wait is older), not 2 ms after.
  const auto start = Clock::now();
  for (;;) {
    for (int i = 0; i < kPausesPerClockRead; ++i) {
      const uint32_t s = p.seq.load(std::memory_order_acquire);
      if (s != seen && s % 2 == 0) return s;
      cpu_relax();
    }
    const auto spun = Clock::now() - start;
    if (!p.oversubscribed.load(std::memory_order_relaxed) &&
        spun < (p.hot.load(std::memory_order_relaxed) ? kHotSpin : kCoolSpin))
      continue;
    p.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t s = p.seq.load(std::memory_order_seq_cst);
    if (s == seen || s % 2 == 1) futex(&p.seq, FUTEX_WAIT_PRIVATE, s);
    p.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    const uint32_t now = p.seq.load(std::memory_order_acquire);
    if (now != seen && now % 2 == 0) return now;
  }
}

// `seen`: the seq when it was started (the job it is started for is published after it).
void worker_main(Pool* p, int64_t index, uint32_t seen) {
  worker_thread = true;
  pthread_setname_np(pthread_self(), "pdserve-kernel");
  for (;;) {
    const uint32_t s = wait_for_job(*p, seen);
    seen = s;
    const auto* f = p->fn.load(std::memory_order_relaxed);
    const int64_t tasks = p->tasks.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    // A newer job already: job s finished without this worker, so it was not one of its.
    if (p->seq.load(std::memory_order_relaxed) != s) continue;
    if (index >= tasks || f == nullptr) continue;
    run_chunk(*p, *f, index);
    p->pending.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void reset_after_fork() {
  // The child has only the forking thread: start over with no workers (the old pool's
  // memory is left as it is; its threads do not exist here).
  pool = new Pool();
}

Pool& the_pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    pool = new Pool();
    pthread_atfork(nullptr, nullptr, reset_after_fork);
  });
  return *pool;
}

bool decide_enabled() {
  const char* v = std::getenv("PDSERVE_KERNEL_POOL");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace

bool pool_enabled() {
  static const bool enabled = decide_enabled();
  return enabled;
}

bool in_pool_task() { return worker_thread; }

int64_t pool_jobs() { return pool_enabled() ? the_pool().jobs.load(std::memory_order_relaxed) : 0; }

void set_threads_hot(bool hot) {
  if (pool_enabled()) the_pool().hot.store(hot, std::memory_order_relaxed);
}

bool pool_run(int64_t begin, int64_t end, int64_t chunk, int64_t tasks,
              c10::function_ref<void(int64_t, int64_t)> f) {
  if (!pool_enabled()) return false;
  Pool& p = the_pool();
  std::unique_lock<std::mutex> lock(p.dispatch, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (p.workers < tasks - 1) {
    cpu_set_t cpus;
    const bool known = sched_getaffinity(0, sizeof(cpus), &cpus) == 0;
    p.oversubscribed.store(known && CPU_COUNT(&cpus) < tasks, std::memory_order_relaxed);
  }
  try {
    while (p.workers < tasks - 1) {
      std::thread(worker_main, &p, static_cast<int64_t>(p.workers + 1),
                  p.seq.load(std::memory_order_relaxed))
          .detach();
      ++p.workers;
    }
  } catch (const std::system_error&) {  // no thread to be had: OpenMP does it
    if (p.workers < tasks - 1) return false;
  }
  const uint32_t s = p.seq.load(std::memory_order_relaxed);
  p.seq.store(s + 1, std::memory_order_relaxed);  // odd: writing
  std::atomic_thread_fence(std::memory_order_release);
  p.begin.store(begin, std::memory_order_relaxed);
  p.end.store(end, std::memory_order_relaxed);
  p.chunk.store(chunk, std::memory_order_relaxed);
  p.tasks.store(tasks, std::memory_order_relaxed);
  p.fn.store(&f, std::memory_order_relaxed);
  p.pending.store(tasks - 1, std::memory_order_relaxed);
  p.seq.store(s + 2, std::memory_order_seq_cst);  // even: published
  if (p.sleepers.load(std::memory_order_seq_cst) > 0) futex(&p.seq, FUTEX_WAKE_PRIVATE, INT32_MAX);
  p.jobs.fetch_add(1, std::memory_order_relaxed);
  run_chunk(p, f, 0);
  // Oversubscribed, a worker may need this very core: yield it.
  const bool yield = p.oversubscribed.load(std::memory_order_relaxed);
  while (p.pending.load(std::memory_order_acquire) > 0) {
    if (yield) sched_yield();
    else cpu_relax();
  }
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> guard(p.error_mu);
    std::swap(error, p.error);
  }
  if (error) std::rethrow_exception(error);
  return true;
}

}  // namespace pdserve_cpu
