// One batch staged in one call without the GIL: pageable fields copied into a pinned slot,
// Arrow offsets rebased there, the slot copied to the device between two events.
//
// Each torch call a stage thread makes (view, empty, copy_, Event.record) releases the GIL and
// queues for it again; beside a training thread running Python, each such queueing waits up to
// the interpreter's switch interval (5 ms). The Python pipeline's stage made about ten of them a
// batch; this call replaces the copy, the rebase and the three CUDA calls with one.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda_driver.h"

namespace tfl {

// A CUDA event (timing enabled) of the driver API, made in a stream's context. Duck-types the
// parts of torch.cuda.Event the loader uses (query, synchronize, elapsed time, stream waits).
class CopyEvent {
 public:
  explicit CopyEvent(uintptr_t stream);
  ~CopyEvent();
  CopyEvent(const CopyEvent&) = delete;
  CopyEvent& operator=(const CopyEvent&) = delete;

  uintptr_t handle() const { return reinterpret_cast<uintptr_t>(event_); }
  bool recorded() const { return recorded_; }
  void record(uintptr_t stream);
  // True once every piece of work recorded before it has completed (or it was never recorded).
  bool query() const;
  // Blocks until query() is true (call without the GIL).
  void synchronize() const;
  // Milliseconds from this event to `end`, both completed.
  float elapsed_ms(const CopyEvent& end) const;
  // `stream` waits for this event (call without the GIL: a full command queue blocks here).
  void wait(uintptr_t stream) const;

 private:
  void bind() const;  // this event's context current on the calling thread
  cuda::Event event_ = nullptr;
  cuda::Context ctx_ = nullptr;
  bool recorded_ = false;
};

struct HostStage {
  // copy_ranges: memcpy(copy_dst[i], copy_src[i], copy_sizes[i])
  std::vector<int64_t> copy_dst, copy_src, copy_sizes;
  // rebase_offsets: int64 rebase_dst[i][k] = rebase_src[i][k] + shifts[i]
  std::vector<int64_t> rebase_dst, rebase_src, rebase_counts, rebase_shifts, rebase_widths;
  int threads = 8;
  int64_t task_size = int64_t(2) << 20;
  bool streaming = true;
  // then, if device_ptr: start recorded, slot[0, nbytes) -> device_ptr on stream, end recorded
  uintptr_t slot = 0, device_ptr = 0, stream = 0;
  int64_t nbytes = 0;
  // fields the copy engines read where they lie (registered host memory): direct_src[i] ->
  // device_ptr + direct_dst[i]; the slot's copy then skips those ranges (all in one batch call)
  std::vector<int64_t> direct_dst, direct_src, direct_sizes;
};

// Runs a HostStage; returns the host bytes written into the slot (copies + offsets).
int64_t run_host_stage(const HostStage& stage, CopyEvent* start, CopyEvent* end);

}  // namespace tfl
