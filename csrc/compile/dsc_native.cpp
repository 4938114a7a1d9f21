// SPDX-License-Identifier: Apache-2.0
// Schema of the dsc_native ops (defined once, here) and the helpers every kernel shares.
//
//   cast_all_gather(shard, dtype, group_name, world_size, timeout_ms) -> flat
// casts this rank's flat shard to `dtype` (the shard's own dtype when None) *before* sending it, then
// all-gathers it over the ProcessGroup named `group_name`; `flat` holds world_size * shard.numel()
// elements, rank r's shard at [r * numel, (r + 1) * numel). The op is functional: a new buffer, no
// input mutated or aliased.
//
//   cast_all_gather_start(shard, dtype, group_name, world_size, timeout_ms) -> flat
// the same, returned as soon as the collective is issued: its work is registered with c10d under `flat`
// (c10d::register_work, torch's own registry of in-flight functional collectives), and the caller waits with
// torch.ops._c10d_functional.wait_tensor(flat) before reading it. `timeout_ms` > 0 bounds the collective.
//
// Kernels: CPU in cast_all_gather_cpu.cpp, CUDA in cast_all_gather_cuda.cpp; the fake (meta)
// implementations are registered from Python (deepspeed/compile/native/gather.py).
#include "dsc_native.h"

#include <torch/library.h>

#include <chrono>

TORCH_LIBRARY(dsc_native, m) {
  m.def("cast_all_gather(Tensor shard, ScalarType? dtype, str group_name, int world_size, "
        "int timeout_ms=0) -> Tensor");
  m.def("cast_all_gather_start(Tensor shard, ScalarType? dtype, str group_name, int world_size, "
        "int timeout_ms=0) -> Tensor");
}

// A collective over parameter shards is data movement, not math: the output never requires grad (the
// runtime's own ops carry the gradient path), so autograd falls through instead of warning at backward.
TORCH_LIBRARY_IMPL(dsc_native, Autograd, m) {
  m.impl("cast_all_gather", torch::CppFunction::makeFallthrough());
  m.impl("cast_all_gather_start", torch::CppFunction::makeFallthrough());
}

namespace dsc_native {

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(c10::string_view group_name, int64_t world_size) {
  auto group = c10d::resolve_process_group(std::string(group_name));
  TORCH_CHECK(group->getSize() == world_size, "dsc_native: process group '", std::string(group_name),
              "' has ", group->getSize(), " ranks, but world_size=", world_size, " was passed");
  return group;
}

void check_cast_all_gather_args(const at::Tensor& shard, std::optional<at::ScalarType> dtype,
                                int64_t world_size, int64_t timeout_ms) {
  TORCH_CHECK(world_size >= 1, "dsc_native::cast_all_gather: world_size must be >= 1, got ", world_size);
  TORCH_CHECK(timeout_ms >= 0, "dsc_native::cast_all_gather: timeout_ms must be >= 0, got ", timeout_ms);
  TORCH_CHECK(!dtype.has_value() || shard.is_complex() == at::isComplexType(*dtype),
              "dsc_native::cast_all_gather: cannot cast a ", shard.scalar_type(), " shard to ", *dtype);
}

c10d::AllgatherOptions allgather_options(int64_t timeout_ms) {
  c10d::AllgatherOptions opts;
  opts.asyncOp = true;
  if (timeout_ms > 0) {
    opts.timeout = std::chrono::milliseconds(timeout_ms);
  }
  return opts;
}

void wait_work(const c10::intrusive_ptr<c10d::Work>& work, int64_t timeout_ms) {
  if (timeout_ms <= 0) {
    work->wait();
    return;
  }
  // Backends either throw on timeout or return false; turn both into one error that names the op.
  const bool done = work->wait(std::chrono::milliseconds(timeout_ms));
  TORCH_CHECK(done, "dsc_native::cast_all_gather: all-gather did not complete within ", timeout_ms, " ms");
}

at::Tensor register_started(const Started& started) {
  c10d::register_work(started.flat, started.work);
  return started.flat;
}

}  // namespace dsc_native
