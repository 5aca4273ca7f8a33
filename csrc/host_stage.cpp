#include "host_stage.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <thread>

#include "engine.h"
#include "mapped_file.h"
#include "offsets.h"

namespace tfl {

CopyEvent::CopyEvent(uintptr_t stream) {
  const cuda::Api& cu = cuda::api();
  if (stream == 0) throw Error(Error::kInvalid, "CopyEvent needs a stream other than the legacy default");
  cuda::check(cu.stream_get_ctx(reinterpret_cast<cuda::Stream>(stream), &ctx_), "cuStreamGetCtx");
  bind();
  cuda::check(cu.event_create(&event_, 0), "cuEventCreate");
}

CopyEvent::~CopyEvent() {
  if (event_ == nullptr) return;
  try {
    bind();
    cuda::api().event_destroy(event_);  // released once its recorded work completes
  } catch (...) {
  }
}

void CopyEvent::bind() const {
  const cuda::Api& cu = cuda::api();
  cuda::Context current = nullptr;
  cuda::check(cu.ctx_get_current(&current), "cuCtxGetCurrent");
  if (current != ctx_) cuda::check(cu.ctx_set_current(ctx_), "cuCtxSetCurrent");
}

void CopyEvent::record(uintptr_t stream) {
  bind();
  cuda::check(cuda::api().event_record(event_, reinterpret_cast<cuda::Stream>(stream)), "cuEventRecord");
  recorded_ = true;
}

bool CopyEvent::query() const {
  const cuda::Result r = cuda::api().event_query(event_);
  if (r == cuda::kNotReady) return false;
  cuda::check(r, "cuEventQuery");
  return true;
}

void CopyEvent::synchronize() const {
  // Polling, as the loader's other waits do: a blocking-sync event would need its own flags.
  auto pause = std::chrono::microseconds(20);
  while (!query()) {
    std::this_thread::sleep_for(pause);
    if (pause < std::chrono::microseconds(500)) pause *= 2;
  }
}

float CopyEvent::elapsed_ms(const CopyEvent& end) const {
  float ms = 0;
  cuda::check(cuda::api().event_elapsed_time(&ms, event_, end.event_), "cuEventElapsedTime");
  return ms;
}

void CopyEvent::wait(uintptr_t stream) const {
  bind();
  cuda::check(cuda::api().stream_wait_event(reinterpret_cast<cuda::Stream>(stream), event_, 0), "cuStreamWaitEvent");
}

namespace {

// The slot's runs between the direct fields, and the direct fields, in one batch of DMA copies.
void enqueue_with_direct(const HostStage& s) {
  const size_t n = s.direct_sizes.size();
  if (s.direct_dst.size() != n || s.direct_src.size() != n)
    throw Error(Error::kInvalid, "direct_dst, direct_src and direct_sizes need the same length");
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t(0));
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return s.direct_dst[a] < s.direct_dst[b]; });
  std::vector<cuda::DevicePtr> dsts, srcs;
  std::vector<size_t> sizes;
  int64_t cursor = 0;
  auto slot_run = [&](int64_t from, int64_t to) {
    if (to <= from) return;
    dsts.push_back(static_cast<cuda::DevicePtr>(s.device_ptr + from));
    srcs.push_back(static_cast<cuda::DevicePtr>(s.slot + from));
    sizes.push_back(static_cast<size_t>(to - from));
  };
  for (size_t i : order) {
    const int64_t at = s.direct_dst[i], len = s.direct_sizes[i];
    if (at < cursor || len < 0 || at + len > s.nbytes)
      throw Error(Error::kInvalid, "direct field [" + std::to_string(at) + ", " + std::to_string(at + len) +
                                       ") overlaps another or lies outside the batch's " + std::to_string(s.nbytes) +
                                       " bytes");
    slot_run(cursor, at);
    if (len > 0) {
      dsts.push_back(static_cast<cuda::DevicePtr>(s.device_ptr + at));
      srcs.push_back(static_cast<cuda::DevicePtr>(s.direct_src[i]));
      sizes.push_back(static_cast<size_t>(len));
    }
    cursor = at + len;
  }
  slot_run(cursor, s.nbytes);
  dma_copies(dsts, srcs, sizes, s.stream);
}

}  // namespace

int64_t run_host_stage(const HostStage& s, CopyEvent* start, CopyEvent* end) {
  int64_t written = 0;
  if (!s.copy_sizes.empty()) written += copy_ranges(s.copy_dst, s.copy_src, s.copy_sizes, s.threads, s.task_size, s.streaming);
  if (!s.rebase_counts.empty())
    written += rebase_offsets(s.rebase_dst, s.rebase_src, s.rebase_counts, s.rebase_shifts, s.rebase_widths, s.threads);
  if (s.device_ptr != 0) {
    if (s.stream == 0) throw Error(Error::kInvalid, "the slot's copy needs a stream other than the legacy default");
    if (s.nbytes < 0 || s.slot == 0) throw Error(Error::kInvalid, "the slot's copy needs a slot and nbytes >= 0");
    const cuda::Stream stream = reinterpret_cast<cuda::Stream>(s.stream);
    const cuda::Api& cu = cuda::api();
    cuda::Context ctx = nullptr, current = nullptr;  // a stage thread may not have made a runtime call yet
    cuda::check(cu.stream_get_ctx(stream, &ctx), "cuStreamGetCtx");
    cuda::check(cu.ctx_get_current(&current), "cuCtxGetCurrent");
    if (current != ctx) cuda::check(cu.ctx_set_current(ctx), "cuCtxSetCurrent");
    if (start != nullptr) start->record(s.stream);
    if (!s.direct_sizes.empty()) {
      enqueue_with_direct(s);
    } else if (s.nbytes > 0) {
      cuda::check(cuda::api().memcpy_htod_async(static_cast<cuda::DevicePtr>(s.device_ptr),
                                                reinterpret_cast<const void*>(s.slot), static_cast<size_t>(s.nbytes),
                                                stream),
                  "cuMemcpyHtoDAsync");
    }
    if (end != nullptr) end->record(s.stream);
  }
  return written;
}

}  // namespace tfl
