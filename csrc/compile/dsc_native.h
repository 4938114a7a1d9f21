// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the deepspeed-compile native ops (namespace dsc_native).
//
// The ops are registered with TORCH_LIBRARY (schema in dsc_native.cpp); each device's kernel lives in
// its own file (cast_all_gather_cpu.cpp, cast_all_gather_cuda.cpp). Collectives go through the c10d
// ProcessGroup that Python created, found by its registered name, so no state is shared with Python
// beyond that name.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <optional>
#include <string>

namespace dsc_native {

// The ProcessGroup registered under `group_name` (Python: `group.group_name`); checks that its size is
// `world_size`, so a caller that passed the wrong group fails here rather than in a mismatched collective.
c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(c10::string_view group_name, int64_t world_size);

// Argument checks shared by every device's cast_all_gather kernel.
void check_cast_all_gather_args(const at::Tensor& shard, std::optional<at::ScalarType> dtype,
                                int64_t world_size, int64_t timeout_ms);

// Options for an asynchronous all-gather; `timeout_ms` > 0 overrides the group's default timeout.
c10d::AllgatherOptions allgather_options(int64_t timeout_ms);

// A collective issued and not waited for: its output buffer and its work.
struct Started {
  at::Tensor flat;
  c10::intrusive_ptr<c10d::Work> work;
};

// Registers `started.work` with c10d under `started.flat` and returns the buffer: the caller waits with
// torch.ops._c10d_functional.wait_tensor(flat), torch's own wait for in-flight functional collectives.
at::Tensor register_started(const Started& started);

// Waits on `work`: forever (or the group's own timeout) when `timeout_ms` <= 0, else at most that long.
// For NCCL the wait is a stream dependency of the current stream, not a host block.
void wait_work(const c10::intrusive_ptr<c10d::Work>& work, int64_t timeout_ms);

}  // namespace dsc_native
