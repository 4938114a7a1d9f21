// SPDX-License-Identifier: Apache-2.0
// Preloaded into every rank by scripts/exit_abort/hunt.sh (LD_PRELOAD): replaces the C++ runtime's terminate handler
// with one that names the calling thread and prints its native backtrace to stderr before aborting. A std::thread
// destroyed while joinable calls std::terminate from its destructor, so the frames under the handler show whose
// object it was (gloo, torch, DeepSpeed's shm op, ours), where libstdc++'s own handler only prints
// "terminate called without an active exception".
#include <execinfo.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>

namespace {

constexpr int kMaxFrames = 64;

[[noreturn]] void print_backtrace_and_abort() {
  char name[32] = {0};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  std::fprintf(stderr, "\n=== std::terminate: pid %d, thread %ld '%s', active exception: %s ===\n", getpid(),
               static_cast<long>(syscall(SYS_gettid)), name, std::current_exception() ? "yes" : "no");
  void* frames[kMaxFrames];
  int count = backtrace(frames, kMaxFrames);
  backtrace_symbols_fd(frames, count, 2);  // no malloc: safe in a dying process
  std::fprintf(stderr, "=== end of backtrace ===\n");
  std::fflush(stderr);
  std::abort();  // the same signal as before (SIGABRT), and a core where core dumps are on
}

__attribute__((constructor)) void install() { std::set_terminate(print_backtrace_and_abort); }

}  // namespace
