#include "device_stager.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <string>
#include <thread>

#include "plan.h"

namespace tfl {

namespace {

// Polls an event: a blocking cuEventSynchronize may spin a core (the context's scheduling
// policy decides), and polling lets the wait notice a failed sibling task.
bool wait_event(cuda::Event event, const std::atomic<bool>& stop) {
  const auto& cu = cuda::api();
  auto pause = std::chrono::microseconds(5);
  for (;;) {
    const cuda::Result r = cu.event_query(event);
    if (r == cuda::kSuccess) return true;
    if (r != cuda::kNotReady) cuda::check(r, "cuEventQuery (a copy out of the pinned ring)");
    if (stop.load(std::memory_order_relaxed)) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(200));
  }
}

}  // namespace

DeviceStager::DeviceStager(uintptr_t ring_ptr, int64_t ring_bytes, int64_t chunk_bytes)
    : chunk_bytes_(chunk_bytes) {
  if (ring_ptr == 0) throw Error(Error::kInvalid, "ring_ptr is null");
  if (chunk_bytes < kDirectAlign || chunk_bytes % kDirectAlign != 0)
    throw Error(Error::kInvalid, "chunk_bytes must be a positive multiple of " + std::to_string(kDirectAlign) +
                                     ", got " + std::to_string(chunk_bytes));
  if (ring_bytes < chunk_bytes)
    throw Error(Error::kInvalid, "the ring (" + std::to_string(ring_bytes) + " bytes) holds no chunk of " +
                                     std::to_string(chunk_bytes) + " bytes");
  const int64_t n = ring_bytes / chunk_bytes;
  chunks_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    chunks_[i].host = reinterpret_cast<char*>(ring_ptr) + i * chunk_bytes;
    free_.push_back(static_cast<size_t>(i));
  }
}

DeviceStager::~DeviceStager() {
  if (ctx_ == nullptr) return;  // no event was ever created
  try {
    const auto& cu = cuda::api();
    cu.ctx_set_current(ctx_);
    idle(10.0);
    for (Chunk& c : chunks_)
      if (c.done != nullptr) cu.event_destroy(c.done);
  } catch (...) {  // the driver may already be shut down at interpreter exit
  }
}

size_t DeviceStager::acquire(const std::atomic<bool>& stop, bool wait) {
  size_t c;
  {
    std::unique_lock<std::mutex> lock(mu_);
    while (free_.empty()) {
      if (stop.load(std::memory_order_relaxed)) return kNone;
      cv_.wait_for(lock, std::chrono::milliseconds(1));
    }
    c = free_.front();
    free_.pop_front();
  }
  Chunk& chunk = chunks_[c];
  if (chunk.pending && wait) {
    bool done = false;
    try {
      done = wait_event(chunk.done, stop);
    } catch (...) {
      release(c);
      throw;
    }
    if (!done) {
      release(c);
      return kNone;
    }
  }
  chunk.pending = false;
  return c;
}

void DeviceStager::release(size_t c) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(c);
  }
  cv_.notify_one();
}

int64_t DeviceStager::read(const ReadRequest& req, uintptr_t stream_handle, bool wait_for_chunks) {
  const auto& cu = cuda::api();
  ReadRequest r = req;
  r.task_size = std::min(r.task_size, chunk_bytes_);  // O_DIRECT rounds up to kDirectAlign: still fits
  r.order_by_destination = true;  // a task fills one stretch of the batch: one large H2D copy each
  const Plan plan = make_plan(r);
  if (plan.total > 0 && r.dst_ptr == 0) throw Error(Error::kInvalid, "dst_ptr (device memory) is null");
  const cuda::Context ctx = bind_context();
  const auto stream = reinterpret_cast<cuda::Stream>(stream_handle);
  const cuda::DevicePtr base = static_cast<cuda::DevicePtr>(r.dst_ptr);
  const bool direct = r.o_direct;
  ThreadPool::instance().run(
      plan.bounds.size() - 1, static_cast<size_t>(r.num_threads), [&](size_t t, const std::atomic<bool>& stop) {
        cuda::check(cu.ctx_set_current(ctx), "cuCtxSetCurrent");
        const size_t c = acquire(stop, wait_for_chunks);
        if (c == kNone) return;
        Chunk& chunk = chunks_[c];
        try {
          int64_t pos = 0;
          for (size_t j = plan.bounds[t]; j < plan.bounds[t + 1]; ++j) {
            const ReadPiece& p = plan.pieces[j];
            read_piece(*plan.files[p.file], p, chunk.host + pos, direct, stop);
            pos += p.len;
          }
          if (stop.load(std::memory_order_relaxed)) {
            release(c);
            return;
          }
          // One copy per run of pieces that is contiguous in the destination too.
          int64_t run_pos = 0, run_dst = 0, run_len = 0;
          pos = 0;
          for (size_t j = plan.bounds[t]; j <= plan.bounds[t + 1]; ++j) {
            const bool last = j == plan.bounds[t + 1];
            if (!last && run_len > 0 && plan.pieces[j].dst == run_dst + run_len &&
                !starts_allocation(r, plan.pieces[j].dst)) {
              run_len += plan.pieces[j].len;
            } else {
              if (run_len > 0)
                cuda::check(cu.memcpy_htod_async(base + static_cast<cuda::DevicePtr>(run_dst), chunk.host + run_pos,
                                                 static_cast<size_t>(run_len), stream),
                            "cuMemcpyHtoDAsync (pinned ring -> device)");
              if (last) break;
              run_pos = pos, run_dst = plan.pieces[j].dst, run_len = plan.pieces[j].len;
            }
            pos += plan.pieces[j].len;
          }
          cuda::check(cu.event_record(chunk.done, stream), "cuEventRecord");
          chunk.pending = true;
        } catch (...) {
          // A copy enqueued before the failure may still read the chunk: treat it as pending.
          chunk.pending = true;
          cu.event_record(chunk.done, stream);
          release(c);
          throw;
        }
        release(c);
      });
  return plan.total;
}

cuda::Context DeviceStager::bind_context() {
  const auto& cu = cuda::api();
  cuda::Context ctx = nullptr;
  cuda::check(cu.ctx_get_current(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr)
    throw Error(Error::kInvalid, "no CUDA context is current on the calling thread (use the loader's device first)");
  std::lock_guard<std::mutex> lock(mu_);
  if (ctx_ == nullptr) {
    for (Chunk& c : chunks_) cuda::check(cu.event_create(&c.done, cuda::kEventDisableTiming), "cuEventCreate");
    ctx_ = ctx;
  } else if (ctx != ctx_) {
    throw Error(Error::kInvalid, "DeviceStager is bound to another CUDA context (one stager per device)");
  }
  return ctx;
}

int64_t DeviceStager::gather_mapped(const std::vector<const MappedFile*>& files, const ReadRequest& req,
                                    uintptr_t stream_handle, uintptr_t function, int piece_bytes, int blocks) {
  const auto& cu = cuda::api();
  if (function == 0 || piece_bytes < 16 || blocks < 1)
    throw Error(Error::kInvalid, "no gather kernel, a piece under 16 bytes or no block to run it");
  const Plan plan = plan_mapped(files, req, false);  // grouped by file: one launch per file
  bind_context();
  const auto stream = reinterpret_cast<cuda::Stream>(stream_handle);
  const std::atomic<bool> never{false};
  // One table row = 3 int64 in one ring chunk; the kernel indexes ranges with an int.
  const size_t per_launch = static_cast<size_t>(std::min<int64_t>(1 << 30, chunk_bytes_ / 24));
  unsigned long long dst = static_cast<unsigned long long>(req.dst_ptr);
  int piece = piece_bytes;
  for (size_t i = 0; i < plan.pieces.size();) {
    size_t end = i;
    while (end < plan.pieces.size() && end - i < per_launch && plan.pieces[end].file == plan.pieces[i].file) ++end;
    const size_t n = end - i;
    const size_t c = acquire(never, true);
    Chunk& chunk = chunks_[c];
    auto* table = reinterpret_cast<long long*>(chunk.host);
    long long *offsets = table, *lengths = table + n, *dst_offsets = table + 2 * n;
    int64_t longest = 0;
    for (size_t k = 0; k < n; ++k) {
      const ReadPiece& p = plan.pieces[i + k];
      offsets[k] = p.off, lengths[k] = p.len, dst_offsets[k] = p.dst;
      longest = std::max(longest, p.len);
    }
    const void* src = files[plan.pieces[i].file]->data();
    int ranges = static_cast<int>(n);
    int pieces_per_range = static_cast<int>((longest + piece - 1) / piece);
    void* params[] = {&src, &dst, &offsets, &lengths, &dst_offsets, &piece, &ranges, &pieces_per_range};
    const int64_t items = static_cast<int64_t>(n) * pieces_per_range;
    const auto grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(items, blocks)));
    const cuda::Result launched = cu.launch_kernel(reinterpret_cast<cuda::Function>(function), grid, 1, 1, 256, 1,
                                                   1, 0, stream, params, nullptr);
    if (launched == cuda::kSuccess) cu.event_record(chunk.done, stream);
    chunk.pending = launched == cuda::kSuccess;
    release(c);
    cuda::check(launched, "cuLaunchKernel (gather from the mapped page cache)");
    i = end;
  }
  return plan.total;
}

bool DeviceStager::idle(double timeout_s) {
  if (ctx_ == nullptr) return true;
  const auto& cu = cuda::api();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (Chunk& c : chunks_) {
    if (!c.pending) continue;
    for (;;) {
      const cuda::Result r = cu.event_query(c.done);
      if (r == cuda::kSuccess) break;
      if (r != cuda::kNotReady) return false;
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    c.pending = false;
  }
  return true;
}

}  // namespace tfl
