// SPDX-License-Identifier: Apache-2.0
// CPU kernels of dsc_native::cast_all_gather and cast_all_gather_start (schema in dsc_native.cpp): cast the
// shard into the send buffer, all-gather it through the c10d ProcessGroup (gloo on CPU); wait, or register the
// work for the caller's wait_tensor.
#include "dsc_native.h"

#include <torch/library.h>

namespace dsc_native {
namespace {

Started start_cpu(const at::Tensor& shard, std::optional<at::ScalarType> dtype, c10::string_view group_name,
                  int64_t world_size, int64_t timeout_ms) {
  check_cast_all_gather_args(shard, dtype, world_size, timeout_ms);
  // Autograd falls through to this kernel (dsc_native.cpp): keep the inner ops out of autograd too.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  TORCH_CHECK(shard.device().is_cpu(), "dsc_native::cast_all_gather (CPU): shard is on ", shard.device());
  auto group = resolve_group(group_name, world_size);
  const auto options = shard.options().dtype(dtype.value_or(shard.scalar_type()));
  const int64_t numel = shard.numel();

  // The cast happens here, before sending: a bf16 gather moves half the bytes of an fp32 one.
  at::Tensor send = at::empty({numel}, options);
  send.copy_(shard.reshape({numel}));
  at::Tensor flat = at::empty({numel * world_size}, options);
  // gloo's work keeps `send` alive until the collective is done
  return {flat, group->all_gather_single(flat, send, allgather_options(timeout_ms))};
}

at::Tensor cast_all_gather_cpu(const at::Tensor& shard, std::optional<at::ScalarType> dtype,
                               c10::string_view group_name, int64_t world_size, int64_t timeout_ms) {
  Started started = start_cpu(shard, dtype, group_name, world_size, timeout_ms);
  wait_work(started.work, timeout_ms);
  return started.flat;
}

at::Tensor cast_all_gather_start_cpu(const at::Tensor& shard, std::optional<at::ScalarType> dtype,
                                     c10::string_view group_name, int64_t world_size, int64_t timeout_ms) {
  return register_started(start_cpu(shard, dtype, group_name, world_size, timeout_ms));
}

}  // namespace
}  // namespace dsc_native

TORCH_LIBRARY_IMPL(dsc_native, CPU, m) {
  m.impl("cast_all_gather", &dsc_native::cast_all_gather_cpu);
  m.impl("cast_all_gather_start", &dsc_native::cast_all_gather_start_cpu);
}
