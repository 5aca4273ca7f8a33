// The few CUDA driver calls the engine makes, resolved from libcuda.so.1 at first use.
// The module therefore builds without the CUDA toolkit and imports on machines without a
// GPU; only DeviceStager needs a driver, and it says so with a clear error where none loads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tfl::cuda {

using Result = int;  // CUresult
using Context = void*;
using Stream = void*;
using Event = void*;
using DevicePtr = unsigned long long;
using Function = void*;

constexpr Result kSuccess = 0;
constexpr Result kNotReady = 600;  // CUDA_ERROR_NOT_READY
constexpr unsigned kEventDisableTiming = 0x2;
constexpr unsigned kHostRegisterReadOnly = 0x08;  // CU_MEMHOSTREGISTER_READ_ONLY

// CUmemcpyAttributes of cuMemcpyBatchAsync (CUDA 12.8+).
struct MemcpyAttributes {
  int src_access_order;  // kSrcAccessOrderStream or kSrcAccessOrderAny (dma_src_access_order)
  int src_loc_type, src_loc_id;
  int dst_loc_type, dst_loc_id;
  unsigned flags;
};
constexpr int kSrcAccessOrderStream = 1;
constexpr int kSrcAccessOrderAny = 3;

// The source access order cuMemcpyBatchAsync is given: any order (CU_MEMCPY_SRC_ACCESS_ORDER_ANY),
// or stream order where TORCH_FASTLOAD_DMA_ORDER=stream (probes compare them). The destination
// is written in stream order either way. Its sources (a pinned slot, the decode arena,
// registered page cache or dataset rows) are written by the host before the call and by no
// stream work, and each is kept unchanged until the copy's event completes, which is what
// reading them out of stream order asks of the caller. In stream order, a call on
// an idle stream returned only once its copy had run (H100, CUDA 13 driver: 0.78 ms a 16 MB
// Parquet batch against 0.26 ms in any order, benchmarks/gpu/stage_call_probe.py), holding a
// stage thread for the whole DMA.
int dma_src_access_order();

struct Api {
  Result (*ctx_get_current)(Context*);
  Result (*ctx_set_current)(Context);
  Result (*device_get)(int*, int);
  Result (*primary_ctx_retain)(Context*, int);
  Result (*event_create)(Event*, unsigned);
  Result (*event_destroy)(Event);
  Result (*event_record)(Event, Stream);
  Result (*event_query)(Event);
  Result (*memcpy_htod_async)(DevicePtr, const void*, size_t, Stream);
  Result (*mem_host_register)(void*, size_t, unsigned);
  Result (*mem_host_unregister)(void*);
  Result (*launch_kernel)(Function, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, Stream,
                          void**, void**);
  Result (*get_error_string)(Result, const char**);
  Result (*stream_wait_event)(Stream, Event, unsigned);
  Result (*stream_get_ctx)(Stream, Context*);
  Result (*event_elapsed_time)(float*, Event, Event);
  // Optional (null where the driver predates CUDA 13's cuMemcpyBatchAsync_v2): many copies,
  // one call, executed by the copy engines.
  Result (*memcpy_batch_async)(DevicePtr*, DevicePtr*, size_t*, size_t, MemcpyAttributes*, size_t*, size_t, Stream);
};

// The driver's entry points; throws tfl::Error (kInvalid) naming what is missing.
const Api& api();

// With TORCH_FASTLOAD_COUNT_DRIVER_CALLS=1 set before the first call, every call through api()
// is counted per calling thread (probes: the loader's driver calls beside a launching thread);
// {(thread id, entry point) -> calls} so far, empty when counting is off.
struct CallCount {
  long thread;
  const char* name;
  uint64_t calls;
};
std::vector<CallCount> call_counts();

// The primary context of device `ordinal` (the one torch's runtime uses), retained once.
Result primary_context(int ordinal, Context* out);

// Throws tfl::Error with the driver's message when `r` is not kSuccess.
void check(Result r, const char* what);

// `waiter` (a CUstream) waits for the work enqueued on `producer` so far. Called without the
// GIL: recording on a stream blocks while its command queue is full, and a thread blocked
// there holding the GIL would stall every Python thread (the training loop's included).
void stream_wait_stream(uintptr_t waiter, uintptr_t producer);

// Runs `op` (returning a CUresult) with the primary context of device `ordinal` current on the
// calling thread, then makes the thread's earlier context current again (torch reads its current
// device from it); the first failing CUresult.
template <class Op>
Result in_primary_context(int ordinal, Op op) {
  const Api& cu = api();
  Context ctx = nullptr, before = nullptr;
  Result r = primary_context(ordinal, &ctx);
  if (r == kSuccess) r = cu.ctx_get_current(&before);
  if (r != kSuccess) return r;
  if (before != ctx && (r = cu.ctx_set_current(ctx)) != kSuccess) return r;
  r = op();
  if (before != ctx) {
    const Result back = cu.ctx_set_current(before);
    if (r == kSuccess) r = back;
  }
  return r;
}

}  // namespace tfl::cuda
