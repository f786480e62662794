// Faulting in a lazily mapped KV cache on spare CPU time (host_memory.cpp says how).
#pragma once

#include <cstdint>

namespace pdserve_cpu {

// Waits (up to timeout_s) until a CPU core this process may run on has had nothing else to run
// for free_s, then faults in [address, address + length) writable at the caller's own
// priority, its contents unchanged (MADV_POPULATE_WRITE). Returns 0, EAGAIN when no core came
// free within the timeout (nothing faulted in), or the errno of the failed call. Call it
// without the GIL.
int64_t populate_when_idle(int64_t address, int64_t length, double timeout_s, double free_s);

// From now on populate_when_idle returns ECANCELED at once, waiting calls included (at exit: a
// thread still inside it when the interpreter ends would be unwound through C++ frames).
void populate_cancel();

}  // namespace pdserve_cpu
