// The two waiting primitives of the kernels' own threads (thread_pool.cpp, host_memory.cpp):
// a spin-loop pause and a raw futex call.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cstdint>
#include <thread>

namespace pdserve_cpu {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// futex(2) on a 32-bit atomic word; timeout nullptr waits without one.
inline long futex(std::atomic<uint32_t>* word, int op, uint32_t value,
                  const timespec* timeout = nullptr) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace pdserve_cpu
