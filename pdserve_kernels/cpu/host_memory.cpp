// Faulting in a lazily mapped KV cache on spare CPU time, without a starved lock holder.
//
// The obvious way, a thread at idle priority (SCHED_IDLE) calling madvise(MADV_POPULATE_WRITE),
// stalls the whole process: madvise holds the process's mmap lock while it faults pages in, and
// an idle-priority thread preempted inside it gets its core back only when nothing else wants
// one. While both cores ran another node's prefill, a decode node's every mmap and munmap (a
// received KV message, a step's large tensor) waited seconds behind it: its asyncio thread
// missed the gateway's 1 s health poll and long prompts failed with 503 in the first minute
// after start-up (a busy-loop repro: 5.5 s for one mmap + munmap).
//
// So the idle-priority thread here, the sentinel, holds nothing and does nothing but notice a
// free core: a worker posts a request and sleeps; the sentinel, woken at idle priority, runs
// only on a core that has nothing else to run, and once it has run there free_s on end it wakes
// the worker, which faults its range in at its own (normal) priority: preempted holding the
// mmap lock, it is back within a scheduler slice (the repro: 58 ms at worst while the core
// stays contended; none at all when it never comes free for 2 ms). free_s keeps the worker's
// ~3 ms per 2 MiB (a VM's first touch) out of the short gaps of a computing node: gated on any
// free moment instead, a 4096-token prompt through `pdserve serve` took 14 s instead of 5.
// The sentinel is native (no GIL) for the same reason as the rest: a Python thread at idle
// priority waiting for the GIL makes the holder wait for it in turn (CPython hands the GIL over
// to the thread that asked for it).
#include "host_memory.h"

#include "spin_wait.h"

#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <atomic>
#include <chrono>
#include <climits>
#include <mutex>
#include <system_error>
#include <thread>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14+
#endif

namespace pdserve_cpu {
namespace {

struct Sentinel {
  std::atomic<uint32_t> asked{0};     // requests posted by workers
  std::atomic<uint32_t> answered{0};  // the latest request seen while a core was free
  std::atomic<int64_t> free_ns{0};    // how long a core must stay free (the latest request's)
  pid_t pid = 0;                      // the process that started its thread (fork: start again)
};

std::mutex sentinel_mu;
Sentinel* sentinel = nullptr;  // leaked: its thread lives as long as the process
std::atomic<bool> cancelled{false};

int64_t clock_ns(clockid_t clock) {
  timespec t{};
  clock_gettime(clock, &t);
  return static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

// Spins at idle priority until it has run free_ns on end: a thread at idle priority runs only
// on a core nothing else wants, and loses it as soon as something wakes there, so its CPU time
// keeps up with the clock only while the core stays free.
void wait_for_free_core(int64_t free_ns) {
  for (;;) {
    const int64_t wall0 = clock_ns(CLOCK_MONOTONIC), cpu0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    int64_t wall = wall0;
    while (wall - wall0 < free_ns) {
      for (int i = 0; i < 64; ++i) cpu_relax();
      wall = clock_ns(CLOCK_MONOTONIC);
    }
    const int64_t ran = clock_ns(CLOCK_THREAD_CPUTIME_ID) - cpu0;
    if (ran * 10 >= (wall - wall0) * 9) return;  // not preempted (beyond clock noise)
  }
}

void sentinel_main(Sentinel* s) {
  pthread_setname_np(pthread_self(), "pdserve-idle");
  sched_param param{};
  param.sched_priority = 0;
  sched_setscheduler(0, SCHED_IDLE, &param);  // this thread only; lowering is always allowed
  uint32_t seen = s->answered.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t asked = s->asked.load(std::memory_order_acquire);
    if (asked == seen) {
      futex(&s->asked, FUTEX_WAIT_PRIVATE, asked, nullptr);
      continue;
    }
    wait_for_free_core(s->free_ns.load(std::memory_order_acquire));
    seen = s->asked.load(std::memory_order_acquire);  // every request posted so far
    s->answered.store(seen, std::memory_order_release);
    futex(&s->answered, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr);
  }
}

// The sentinel of this process (started on first use, and again in a forked child).
Sentinel* the_sentinel() {
  std::lock_guard<std::mutex> lock(sentinel_mu);
  const pid_t pid = getpid();
  if (sentinel == nullptr || sentinel->pid != pid) {
    auto* s = new Sentinel();
    s->pid = pid;
    try {
      std::thread(sentinel_main, s).detach();
    } catch (const std::system_error&) {
      delete s;
      return nullptr;
    }
    sentinel = s;
  }
  return sentinel;
}

}  // namespace

int64_t populate_when_idle(int64_t address, int64_t length, double timeout_s, double free_s) {
  if (cancelled.load(std::memory_order_acquire)) return ECANCELED;
  Sentinel* s = the_sentinel();
  if (s == nullptr) return EAGAIN;
  s->free_ns.store(static_cast<int64_t>(free_s * 1e9), std::memory_order_release);
  const uint32_t ticket = s->asked.fetch_add(1, std::memory_order_acq_rel) + 1;
  futex(&s->asked, FUTEX_WAKE_PRIVATE, 1, nullptr);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  for (;;) {
    const uint32_t answered = s->answered.load(std::memory_order_acquire);
    if (cancelled.load(std::memory_order_acquire)) return ECANCELED;
    if (static_cast<int32_t>(answered - ticket) >= 0) break;
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::steady_clock::duration::zero()) return EAGAIN;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    const timespec wait{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    futex(&s->answered, FUTEX_WAIT_PRIVATE, answered, &wait);
  }
  if (madvise(reinterpret_cast<void*>(address), static_cast<size_t>(length),
              MADV_POPULATE_WRITE) != 0)
    return errno;
  return 0;
}

void populate_cancel() {
  cancelled.store(true, std::memory_order_release);
  std::lock_guard<std::mutex> lock(sentinel_mu);
  if (sentinel != nullptr) futex(&sentinel->answered, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr);
}

}  // namespace pdserve_cpu
