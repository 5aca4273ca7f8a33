// torch_fastload I/O engine: a persistent thread pool, bounds-checked batched range reads
// (pread or O_DIRECT) and a parallel memcpy, all into caller-owned memory.
// No Python or torch headers here: bindings.cpp is the only Python-facing file.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace tfl {

// Block size and memory alignment used for O_DIRECT (a multiple of every common logical
// block size: 512 and 4096).
constexpr int64_t kDirectAlign = 4096;
// Largest single pread: Linux transfers at most 0x7ffff000 bytes per call anyway.
constexpr int64_t kMaxIo = int64_t(1) << 30;
constexpr int kMaxThreads = 256;

// Every failure the engine reports. `kind` picks the Python exception type in bindings.cpp.
struct Error : std::runtime_error {
  enum Kind { kOS, kRange, kShortRead, kInvalid, kIndex };
  Kind kind;
  int err;           // errno for kOS, else 0
  std::string path;  // file involved, empty when none
  Error(Kind k, std::string msg, std::string p = {}, int e = 0)
      : std::runtime_error(std::move(msg)), kind(k), err(e), path(std::move(p)) {}
};

// Fixed workers reused across calls. The calling thread works too, so a call never waits
// on a busy pool to make progress, and concurrent calls from several threads are fine.
class ThreadPool {
 public:
  // The process-wide pool (re-created lazily in a forked child: worker threads don't survive fork).
  static ThreadPool& instance();
  // A second pool whose workers run at nice +10: CPU work beside training (image decoding)
  // yields its cores to the training thread, which must keep launching the step's kernels.
  static ThreadPool& background();
  // Runs task(i, stop) for i in [0, n) on up to `width` threads (caller included) and
  // returns when every task has finished. The first exception stops the rest and is rethrown.
  void run(size_t n, size_t width, const std::function<void(size_t, const std::atomic<bool>&)>& task);
  size_t num_workers();

 private:
  struct Job;
  static void drain(Job& job);
  void ensure_workers(size_t n);
  void worker_loop();
  explicit ThreadPool(int nice = 0) : nice_(nice) {}
  int nice_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::thread> workers_;
};

struct ReadRequest {
  std::vector<std::string> paths;
  std::vector<int64_t> file_index, offsets, lengths, dst_offsets;
  uintptr_t dst_ptr = 0;
  int64_t dst_size = 0;
  int num_threads = 16;
  int64_t task_size = int64_t(4) << 20;
  // O_DIRECT: page cache bypassed; unaligned pieces go through a per-thread aligned bounce
  // buffer of up to task_size + 8 KiB, kept for reuse.
  bool o_direct = false;
  // Order (and so group into tasks) by destination rather than by file offset: a task then
  // fills one contiguous stretch of the destination (one H2D copy per task for DeviceStager).
  bool order_by_destination = false;
  // Sorted destination offsets where a separate allocation starts (a batch's output fields are
  // separate device tensors that may lie back to back): no coalesced piece or copy runs across
  // one, since a DMA copy spanning two allocations is refused (CUDA_ERROR_INVALID_VALUE).
  std::vector<int64_t> dst_breaks;
};

// One read of a plan: file bytes [offset, offset + length) to dst_offset.
struct PlannedRead {
  int64_t file_index, offset, length, dst_offset;
};

// What read_ranges would do, as tasks of reads (after coalescing and slicing), with the same
// validation and file checks; reads nothing. For tests and for reporting.
std::vector<std::vector<PlannedRead>> plan_ranges(const ReadRequest& req);

// Reads every (file, offset, length) range to dst_ptr + dst_offset. All ranges are checked
// against their file's size and against [0, dst_size) before the first byte is read.
// Returns the number of bytes read; throws Error (never returns a partial result).
int64_t read_ranges(const ReadRequest& req);

// memcpy(dst[i], src[i], size[i]) for all i, large copies split across threads;
// `streaming` uses non-temporal stores for pieces >= 64 KiB (destination not read by the CPU next).
int64_t copy_ranges(const std::vector<int64_t>& dst_ptrs, const std::vector<int64_t>& src_ptrs,
                    const std::vector<int64_t>& sizes, int num_threads, int64_t task_size, bool streaming = false);

}  // namespace tfl
