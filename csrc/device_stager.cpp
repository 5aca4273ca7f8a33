#include "device_stager.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
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

struct DeviceStager::Reading {
  cuda::Stream stream = nullptr;
  std::mutex mu;
  std::vector<size_t> chunks;  // read, their copies not yet enqueued
  std::vector<cuda::DevicePtr> dsts, srcs;
  std::vector<size_t> sizes;
};

DeviceStager::DeviceStager(uintptr_t ring_ptr, int64_t ring_bytes, int64_t chunk_bytes, int64_t group_chunks)
    : chunk_bytes_(chunk_bytes) {
  if (ring_ptr == 0) throw Error(Error::kInvalid, "ring_ptr is null");
  if (chunk_bytes < kDirectAlign || chunk_bytes % kDirectAlign != 0)
    throw Error(Error::kInvalid, "chunk_bytes must be a positive multiple of " + std::to_string(kDirectAlign) +
                                     ", got " + std::to_string(chunk_bytes));
  if (ring_bytes < chunk_bytes)
    throw Error(Error::kInvalid, "the ring (" + std::to_string(ring_bytes) + " bytes) holds no chunk of " +
                                     std::to_string(chunk_bytes) + " bytes");
  if (group_chunks == 0) {
    const char* configured = std::getenv("TORCH_FASTLOAD_RING_GROUP");  // probes compare group sizes
    group_chunks = kDefaultGroup;
    if (configured != nullptr) {
      char* end = nullptr;
      group_chunks = std::strtol(configured, &end, 10);
      if (end == configured || *end != '\0' || group_chunks < 1)
        throw Error(Error::kInvalid,
                    std::string("TORCH_FASTLOAD_RING_GROUP must be an integer >= 1, got '") + configured + "'");
    }
  }
  if (group_chunks < 1) throw Error(Error::kInvalid, "group_chunks must be >= 1, got " + std::to_string(group_chunks));
  group_chunks_ = static_cast<size_t>(group_chunks);
  const char* poll = std::getenv("TORCH_FASTLOAD_RING_POLL");
  one_poller_ = poll == nullptr || std::string(poll) != "each";
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
    for (Group& g : groups_)
      if (g.done != nullptr) cu.event_destroy(g.done);
  } catch (...) {  // the driver may already be shut down at interpreter exit
  }
}

size_t DeviceStager::acquire(const std::atomic<bool>& stop, bool wait, Reading* reading) {
  size_t c = kNone;
  while (c == kNone) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!free_.empty()) {
        c = free_.front();
        free_.pop_front();
        break;
      }
      if (stop.load(std::memory_order_relaxed)) return kNone;
      bool own_unsubmitted = false;
      if (reading != nullptr) {
        std::lock_guard<std::mutex> held(reading->mu);
        own_unsubmitted = !reading->chunks.empty();
      }
      if (!own_unsubmitted) {
        cv_.wait_for(lock, std::chrono::milliseconds(1));
        continue;
      }
    }
    submit(*reading);  // the ring may be waiting for this read's own group
  }
  Chunk& chunk = chunks_[c];
  const size_t g = chunk.group;
  if (g == kNone) return c;
  bool complete;
  {
    std::lock_guard<std::mutex> lock(mu_);
    complete = groups_[g].complete;
  }
  if (!complete && wait) {
    try {
      complete = wait_group(g, stop);
    } catch (...) {
      release(c);
      throw;
    }
    if (!complete) {
      release(c);
      return kNone;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  groups_[g].complete = groups_[g].complete || complete;
  chunk.group = kNone;
  if (--groups_[g].chunks == 0) free_groups_.push_back(g);
  return c;
}

bool DeviceStager::wait_group(size_t g, const std::atomic<bool>& stop) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (groups_[g].complete) return true;
      if (!groups_[g].polling || !one_poller_) break;
      if (stop.load(std::memory_order_relaxed)) return false;
      group_cv_.wait_for(lock, std::chrono::milliseconds(1));
    }
    groups_[g].polling = true;
  }
  bool done = false;
  std::exception_ptr failed;
  try {
    done = wait_event(groups_[g].done, stop);
  } catch (...) {
    failed = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    groups_[g].polling = false;
    groups_[g].complete = groups_[g].complete || done;
  }
  group_cv_.notify_all();
  if (failed) std::rethrow_exception(failed);
  return done;
}

size_t DeviceStager::free_chunks() {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

void DeviceStager::release(size_t c) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(c);
  }
  cv_.notify_one();
}

size_t DeviceStager::start_group(const std::vector<size_t>& chunks) {
  // Every live group holds at least one chunk, so one group per chunk never runs out.
  const size_t g = free_groups_.back();
  free_groups_.pop_back();
  groups_[g].chunks = chunks.size();
  groups_[g].complete = false;
  for (size_t c : chunks) chunks_[c].group = g;
  return g;
}

void DeviceStager::submit(Reading& reading) {
  std::vector<size_t> chunks;
  std::vector<cuda::DevicePtr> dsts, srcs;
  std::vector<size_t> sizes;
  {
    std::lock_guard<std::mutex> lock(reading.mu);
    chunks.swap(reading.chunks), dsts.swap(reading.dsts), srcs.swap(reading.srcs), sizes.swap(reading.sizes);
  }
  if (chunks.empty()) return;
  size_t g;
  {
    std::lock_guard<std::mutex> lock(mu_);
    g = start_group(chunks);
  }
  std::exception_ptr failed;
  try {
    dma_copies(dsts, srcs, sizes, reinterpret_cast<uintptr_t>(reading.stream));
  } catch (...) {
    failed = std::current_exception();  // a copy enqueued before the failure may still read its chunk
  }
  const cuda::Result recorded = cuda::api().event_record(groups_[g].done, reading.stream);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t c : chunks) free_.push_back(c);
  }
  cv_.notify_all();
  if (failed) std::rethrow_exception(failed);
  cuda::check(recorded, "cuEventRecord (after a group's copies out of the pinned ring)");
}

int64_t DeviceStager::read(const ReadRequest& req, uintptr_t stream_handle, bool wait_for_chunks) {
  const auto& cu = cuda::api();
  ReadRequest r = req;
  r.task_size = std::min(r.task_size, chunk_bytes_);  // O_DIRECT rounds up to kDirectAlign: still fits
  r.order_by_destination = true;  // a task fills one stretch of the batch: one large H2D copy each
  const Plan plan = make_plan(r);
  if (plan.total > 0 && r.dst_ptr == 0) throw Error(Error::kInvalid, "dst_ptr (device memory) is null");
  const cuda::Context ctx = bind_context();
  Reading reading;
  reading.stream = reinterpret_cast<cuda::Stream>(stream_handle);
  const cuda::DevicePtr base = static_cast<cuda::DevicePtr>(r.dst_ptr);
  const bool direct = r.o_direct;
  auto task = [&](size_t t, const std::atomic<bool>& stop) {
    cuda::check(cu.ctx_set_current(ctx), "cuCtxSetCurrent");
    const size_t c = acquire(stop, wait_for_chunks, &reading);
    if (c == kNone) return;
    char* host = chunks_[c].host;
    try {
      int64_t pos = 0;
      for (size_t j = plan.bounds[t]; j < plan.bounds[t + 1]; ++j) {
        const ReadPiece& p = plan.pieces[j];
        read_piece(*plan.files[p.file], p, host + pos, direct, stop);
        pos += p.len;
      }
    } catch (...) {
      release(c);  // no copy reads it yet
      throw;
    }
    if (stop.load(std::memory_order_relaxed)) {
      release(c);
      return;
    }
    bool full;
    {
      std::lock_guard<std::mutex> lock(reading.mu);
      // One copy per run of pieces that is contiguous in the destination too.
      int64_t pos = 0;
      for (size_t j = plan.bounds[t]; j < plan.bounds[t + 1]; ++j) {
        const ReadPiece& p = plan.pieces[j];
        const auto dst = base + static_cast<cuda::DevicePtr>(p.dst);
        const bool extends = j > plan.bounds[t] && dst == reading.dsts.back() + reading.sizes.back() &&
                             !starts_allocation(r, p.dst);
        if (extends)
          reading.sizes.back() += static_cast<size_t>(p.len);
        else
          reading.dsts.push_back(dst), reading.srcs.push_back(reinterpret_cast<cuda::DevicePtr>(host + pos)),
              reading.sizes.push_back(static_cast<size_t>(p.len));
        pos += p.len;
      }
      reading.chunks.push_back(c);
      full = reading.chunks.size() >= group_chunks_;
    }
    if (full) submit(reading);
  };
  try {
    ThreadPool::instance().run(plan.bounds.size() - 1, static_cast<size_t>(r.num_threads), task);
  } catch (...) {
    // The read failed: chunks read but not submitted are freed without a copy (nothing partial
    // is sent on to the batch).
    std::vector<size_t> unsent;
    {
      std::lock_guard<std::mutex> lock(reading.mu);
      unsent.swap(reading.chunks);
    }
    for (size_t c : unsent) release(c);
    throw;
  }
  submit(reading);
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
    groups_.resize(chunks_.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      cuda::check(cu.event_create(&groups_[g].done, cuda::kEventDisableTiming), "cuEventCreate");
      free_groups_.push_back(g);
    }
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
    const size_t c = acquire(never, true, nullptr);
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
    if (launched == cuda::kSuccess) {
      size_t g;
      {
        std::lock_guard<std::mutex> lock(mu_);
        g = start_group({c});
      }
      cu.event_record(groups_[g].done, stream);
    }
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
  std::vector<size_t> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t g = 0; g < groups_.size(); ++g)
      if (groups_[g].chunks > 0 && !groups_[g].complete) live.push_back(g);
  }
  for (size_t g : live) {
    for (;;) {
      const cuda::Result r = cu.event_query(groups_[g].done);
      if (r == cuda::kSuccess) break;
      if (r != cuda::kNotReady) return false;
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    std::lock_guard<std::mutex> lock(mu_);
    groups_[g].complete = true;
  }
  return true;
}

}  // namespace tfl
