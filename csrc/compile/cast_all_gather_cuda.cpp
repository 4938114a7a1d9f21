// SPDX-License-Identifier: Apache-2.0
// CUDA kernel of dsc_native::cast_all_gather (schema in dsc_native.cpp). Compiled only where CUDA
// exists: the builder adds this file and -DDSC_WITH_CUDA only when torch sees a GPU and CUDA_HOME is set.
//
// Order of events, with `current` the caller's stream and `comm` this device's communication stream:
//   ready.record(current); comm waits on ready     (the shard's producers have finished)
//   on comm: cast the shard into the send buffer; all-gather (NCCL orders its stream after comm);
//            work.wait() (comm waits on NCCL's end event; the host does not block)
//   done.record(comm); current waits on done        (consumers of the gathered buffer see it complete)
// The output buffer is allocated on `current`, where it is consumed and later freed.
#ifdef DSC_WITH_CUDA

#include "dsc_native.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>

namespace dsc_native {
namespace {

// One communication stream per device, so that casts for successive gathers stay in issue order.
c10::cuda::CUDAStream comm_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::unordered_map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) {
    it = streams.emplace(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)).first;
  }
  return it->second;
}

// Issues the cast and the all-gather; with `wait`, also makes `current` wait for the result (the blocking op),
// else registers the work under the output for the caller's wait_tensor (the start op: NCCL's wait then makes
// the waiting stream depend on the collective's end).
at::Tensor cast_all_gather_cuda_impl(const at::Tensor& shard, std::optional<at::ScalarType> dtype,
                                     c10::string_view group_name, int64_t world_size, int64_t timeout_ms,
                                     bool wait) {
  check_cast_all_gather_args(shard, dtype, world_size, timeout_ms);
  // Autograd falls through to this kernel (dsc_native.cpp): keep the inner ops out of autograd too.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  TORCH_CHECK(shard.is_cuda(), "dsc_native::cast_all_gather (CUDA): shard is on ", shard.device());
  const c10::cuda::CUDAGuard device_guard(shard.device());
  auto group = resolve_group(group_name, world_size);
  const auto options = shard.options().dtype(dtype.value_or(shard.scalar_type()));
  const int64_t numel = shard.numel();

  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(shard.device().index());
  const c10::cuda::CUDAStream comm = comm_stream(shard.device().index());
  at::Tensor flat = at::empty({numel * world_size}, options);  // allocated on `current`

  c10::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(comm);
  {
    const c10::cuda::CUDAStreamGuard stream_guard(comm);
    // `send` lives on comm; it is freed on return, and later comm work is ordered after the collective.
    at::Tensor send = at::empty({numel}, options);
    send.copy_(shard.reshape({numel}));
    // The shard is read on comm; keep its block from being reused by its own stream until comm is past it.
    c10::cuda::CUDACachingAllocator::recordStream(shard.storage().data_ptr(), comm);
    auto work = group->all_gather_single(flat, send, allgather_options(timeout_ms));
    if (!wait) {
      // NCCL's work holds `send` and `flat` until the collective is done; flat is read on `current` after the
      // caller's wait_tensor, which orders `current` after the collective
      c10::cuda::CUDACachingAllocator::recordStream(flat.storage().data_ptr(), comm);
      return register_started(Started{flat, work});
    }
    wait_work(work, timeout_ms);
  }
  c10::cuda::CUDAEvent done;
  done.record(comm);
  done.block(current);
  return flat;
}

at::Tensor cast_all_gather_cuda(const at::Tensor& shard, std::optional<at::ScalarType> dtype,
                                c10::string_view group_name, int64_t world_size, int64_t timeout_ms) {
  return cast_all_gather_cuda_impl(shard, dtype, group_name, world_size, timeout_ms, /*wait=*/true);
}

at::Tensor cast_all_gather_start_cuda(const at::Tensor& shard, std::optional<at::ScalarType> dtype,
                                      c10::string_view group_name, int64_t world_size, int64_t timeout_ms) {
  return cast_all_gather_cuda_impl(shard, dtype, group_name, world_size, timeout_ms, /*wait=*/false);
}

}  // namespace
}  // namespace dsc_native

TORCH_LIBRARY_IMPL(dsc_native, CUDA, m) {
  m.impl("cast_all_gather", &dsc_native::cast_all_gather_cuda);
  m.impl("cast_all_gather_start", &dsc_native::cast_all_gather_start_cuda);
}

#endif  // DSC_WITH_CUDA
