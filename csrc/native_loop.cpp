#include "native_loop.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <tuple>
#include <utility>

namespace tfl {

namespace {

using Clock = std::chrono::steady_clock;

// How long an idle worker sleeps before it looks at the queue again, notified or not.
constexpr auto kIdleRecheck = std::chrono::milliseconds(20);

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Polls an event until it completed or `stop` is set (a blocking synchronize may spin a core).
bool wait_event(cuda::Event event, const std::atomic<bool>& stop, Clock::time_point deadline = Clock::time_point::max()) {
  const auto& cu = cuda::api();
  auto pause = std::chrono::microseconds(5);
  for (;;) {
    const cuda::Result r = cu.event_query(event);
    if (r == cuda::kSuccess) return true;
    if (r != cuda::kNotReady) cuda::check(r, "cuEventQuery (a batch's copies)");
    if (stop.load(std::memory_order_relaxed) || Clock::now() > deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(200));
  }
}

}  // namespace

NativeLoop::NativeLoop(LoopConfig cfg) : cfg_(std::move(cfg)) {
  if (cfg_.workers < 1) throw Error(Error::kInvalid, "a native loop needs at least one worker");
  for (const LoopField& f : cfg_.fields) {
    const bool bad = f.rows < 0 || (f.kind != LoopField::kRecords && f.row_bytes < 0) ||
                     (f.kind == LoopField::kMemoryRows && f.memory == 0 && f.rows > 0) ||
                     (f.kind == LoopField::kFileRows && (f.file < 0 || f.file >= int32_t(cfg_.paths.size()))) ||
                     (f.kind == LoopField::kRecords && f.records == 0 && f.rows > 0) || f.kind < 0 || f.kind > 2;
    if (bad) throw Error(Error::kInvalid, "malformed native loop field '" + f.name + "'");
  }
  mapped_.assign(cfg_.paths.size(), nullptr);
  const char* slot_event = std::getenv("TORCH_FASTLOAD_SLOT_EVENT");
  slot_event_is_ready_ = slot_event == nullptr || std::string(slot_event) != "own";
  const char* mark = std::getenv("TORCH_FASTLOAD_ALLOCATION_MARK");
  group_mark_ = mark == nullptr || std::string(mark) != "batch";
  const char* merge = std::getenv("TORCH_FASTLOAD_MERGE_PARTS");
  merge_parts_ = merge == nullptr || std::string(merge) != "0";
  const char* mapped_table = std::getenv("TORCH_FASTLOAD_MAPPED_TABLE");
  mapped_table_ = mapped_table == nullptr || std::string(mapped_table) != "ring";
  if (cfg_.cuda) {
    const auto& cu = cuda::api();
    cuda::check(cu.ctx_get_current(&ctx_), "cuCtxGetCurrent");
    if (ctx_ == nullptr) throw Error(Error::kInvalid, "no CUDA context is current on the thread making the loop");
    slots_.resize(static_cast<size_t>(std::max(0, cfg_.num_slots)));
    for (size_t i = 0; i < slots_.size(); ++i) {
      slots_[i].host = reinterpret_cast<char*>(cfg_.slots) + static_cast<int64_t>(i) * cfg_.slot_bytes;
      cuda::check(cu.event_create(&slots_[i].done, cuda::kEventDisableTiming), "cuEventCreate");
      free_slots_.push_back(i);
    }
  }
  // A worker waiting for its turn holds a slot: with fewer slots than workers, the turn's holder
  // could wait for a slot that only a later turn gives back.
  ordered_ = cfg_.ordered_copies && cfg_.cuda && (slots_.empty() || slots_.size() >= size_t(cfg_.workers));
  for (int i = 0; i < cfg_.workers; ++i) workers_.emplace_back([this] { worker_loop(); });
}

NativeLoop::~NativeLoop() {
  if (!stop(10.0, false)) return;  // a forked child: nothing here is ours to free
  if (!cfg_.cuda || ctx_ == nullptr) return;
  try {
    const auto& cu = cuda::api();
    cu.ctx_set_current(ctx_);
    std::set<cuda::Event> events;  // once each: a slot's event may be a job's ready, a mark a group's
    for (Slot& s : slots_) events.insert(s.done);
    for (auto& [position, job] : jobs_)
      for (cuda::Event e : {job.ready, job.timing_start, job.timing_end, job.allocated}) events.insert(e);
    for (const Timing& t : timings_) events.insert(t.start), events.insert(t.end);
    events.insert(spare_events_.begin(), spare_events_.end());
    events.insert(spare_timing_events_.begin(), spare_timing_events_.end());
    events.erase(nullptr);
    for (cuda::Event e : events) cu.event_destroy(e);
  } catch (...) {  // the driver may already be shut down at interpreter exit
  }
}

// -- layout --------------------------------------------------------------------------------

std::vector<int64_t> NativeLoop::layout_of(const std::vector<int64_t>& indices) const {
  const int64_t n = static_cast<int64_t>(indices.size());
  std::vector<int64_t> layout{0};
  int64_t cursor = 0;
  auto add = [&](int64_t bytes) {
    cursor = align_up(cursor, kAlign);
    layout.push_back(cursor), layout.push_back(bytes);
    cursor += bytes;
  };
  for (const LoopField& f : cfg_.fields) {
    if (f.kind != LoopField::kRecords) {
      add(n * f.row_bytes);
      continue;
    }
    const auto* rec = reinterpret_cast<const int64_t*>(f.records);
    int64_t slab = 0;
    for (int64_t i : indices) slab += rec[3 * i + 2];
    add(slab);
    add((n + 1) * int64_t(sizeof(int64_t)));  // the records' offsets field
  }
  layout[0] = cursor;
  return layout;
}

std::vector<int64_t> NativeLoop::submit(int64_t position, std::vector<int64_t> indices, uintptr_t out,
                                        int64_t out_bytes, uintptr_t home) {
  Job job;
  job.position = position;
  try {
    for (int64_t& i : indices) {
      const int64_t raw = i;
      for (const LoopField& f : cfg_.fields) {
        const int64_t k = raw < 0 ? raw + f.rows : raw;
        if (k < 0 || k >= f.rows) {
          std::string message = f.name;  // "... {} ...": the index goes where {} is
          const size_t at = message.find("{}");
          if (at == std::string::npos)
            message = "index " + std::to_string(raw) + " is out of range (" + std::to_string(f.rows) + " rows)";
          else
            message.replace(at, 2, std::to_string(raw));
          throw Error(Error::kIndex, message);
        }
        i = k;
      }
    }
    job.layout = layout_of(indices);
    job.indices = std::move(indices);
  } catch (...) {
    job.error = std::current_exception();
    job.done = true;
  }
  std::vector<int64_t> layout = job.error ? std::vector<int64_t>{-1} : job.layout;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_[position] = std::move(job);
  }
  if (out_bytes >= 0 && layout[0] >= 0) start(position, out, out_bytes, home);
  return layout;
}

std::vector<int64_t> NativeLoop::submit_fields(int64_t position, std::vector<int64_t> indices,
                                               const std::vector<int64_t>& outs, const std::vector<int64_t>& capacities,
                                               uintptr_t home) {
  std::vector<int64_t> layout = submit(position, std::move(indices));
  if (layout[0] >= 0) start_fields(position, outs, capacities, home);
  return layout;
}

std::vector<int64_t> NativeLoop::submit_group(int64_t first_position, const std::vector<int64_t>& indices, int64_t count,
                                              const std::vector<int64_t>& outs, const std::vector<int64_t>& capacities,
                                              uintptr_t home) {
  const size_t fields = capacities.size();
  if (count < 1 || indices.size() % static_cast<size_t>(count) != 0 || outs.size() != fields * size_t(count))
    throw Error(Error::kInvalid, "a group of " + std::to_string(count) + " batches needs count x n indices and count x " +
                                     std::to_string(fields) + " output buffers, got " + std::to_string(indices.size()) +
                                     " and " + std::to_string(outs.size()));
  const size_t n = indices.size() / static_cast<size_t>(count);
  if (cfg_.debug_submit_pause_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(cfg_.debug_submit_pause_us));
  std::vector<int64_t> totals(static_cast<size_t>(count), -1);
  bool wake = false;
  // The outputs were all allocated before this call: one event on their stream covers the group.
  const cuda::Event mark = group_mark_ ? mark_allocation(home) : nullptr;
  const auto drop_mark = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    drop_allocation(mark);
  };
  try {
    for (int64_t j = 0; j < count; ++j) {
      const auto from = indices.begin() + static_cast<ptrdiff_t>(size_t(j) * n);
      std::vector<int64_t> layout =
          submit(first_position + j, std::vector<int64_t>(from, from + static_cast<ptrdiff_t>(n)));
      if (layout[0] < 0) continue;  // take() raises this batch's error; the others go on
      const auto at = outs.begin() + static_cast<ptrdiff_t>(size_t(j) * fields);
      wake = start_fields_quietly(first_position + j, std::vector<int64_t>(at, at + static_cast<ptrdiff_t>(fields)),
                                  capacities, home, group_mark_ ? &mark : nullptr) ||
             wake;
      totals[static_cast<size_t>(j)] = layout[0];
    }
  } catch (...) {  // the batches started before the failure still need their workers
    drop_mark();
    wake_for_group(wake);
    throw;
  }
  drop_mark();
  wake_for_group(wake);
  return totals;
}

void NativeLoop::wake_for_group(bool wake) {
  if (!wake || cfg_.debug_lose_wakeups) return;
  // One worker: it wakes the next as it takes its batch (worker_loop), so the thread submitting
  // (the training thread) pays one futex wake a group, not one per idle worker.
  if (cfg_.wake_all)
    work_cv_.notify_all();
  else
    work_cv_.notify_one();
}

std::vector<int64_t> NativeLoop::row_layout(int64_t n) const {
  for (const LoopField& f : cfg_.fields)
    if (f.kind == LoopField::kRecords) throw Error(Error::kInvalid, "records have no layout before their indices");
  return layout_of(std::vector<int64_t>(static_cast<size_t>(n), 0));
}

cuda::Event NativeLoop::mark_allocation(uintptr_t home) {
  if (!cfg_.cuda || home == cfg_.stream) return nullptr;
  // Handle 0 is the legacy default stream, where a plain training loop allocates: the caching
  // allocator may hand out memory its queued kernels still use, so it needs the wait as much as
  // any other stream (the copy stream is non-blocking: nothing orders it after stream 0 for us).
  const auto& cu = cuda::api();
  cuda::Event e = make_event(false);
  cuda::Result r = cu.ctx_set_current(ctx_);
  if (r == cuda::kSuccess) r = cu.event_record(e, reinterpret_cast<cuda::Stream>(home));
  if (r != cuda::kSuccess) {
    std::lock_guard<std::mutex> lock(mu_);
    recycle(e, false);
  }
  cuda::check(r, "cuEventRecord (the output's allocation on its stream)");
  std::lock_guard<std::mutex> lock(mu_);
  marks_[e] = AllocationMark{};
  return e;
}

void NativeLoop::drop_allocation(cuda::Event e) {  // under mu_
  if (e == nullptr) return;
  auto it = marks_.find(e);
  if (it != marks_.end() && --it->second.holders > 0) return;
  if (it != marks_.end()) marks_.erase(it);
  recycle(e, false);
}

void NativeLoop::start(int64_t position, uintptr_t out, int64_t out_bytes, uintptr_t home) {
  cuda::Event allocated = mark_allocation(home);
  {
    std::lock_guard<std::mutex> lock(mu_);
    AllocationLease lease{this, allocated};
    Job& job = startable(position);
    if (out_bytes < job.layout[0] || (out == 0 && job.layout[0] > 0))
      throw Error(Error::kInvalid, "the output buffer of batch " + std::to_string(position) + " holds " +
                                       std::to_string(out_bytes) + " bytes, the batch needs " +
                                       std::to_string(job.layout[0]));
    job.at.assign(job.layout.size() / 2, 0);
    for (size_t o = 0; o < job.at.size(); ++o) job.at[o] = job.layout[1 + 2 * o];
    job.out = out, job.out_bytes = out_bytes;
    job.allocated = lease.release();
    if (!enqueue(job, home) || cfg_.debug_lose_wakeups) return;
  }
  work_cv_.notify_one();
}

void NativeLoop::start_fields(int64_t position, const std::vector<int64_t>& outs,
                              const std::vector<int64_t>& capacities, uintptr_t home) {
  if (start_fields_quietly(position, outs, capacities, home) && !cfg_.debug_lose_wakeups) work_cv_.notify_one();
}

bool NativeLoop::start_fields_quietly(int64_t position, const std::vector<int64_t>& outs,
                                      const std::vector<int64_t>& capacities, uintptr_t home,
                                      const cuda::Event* group_mark) {
  cuda::Event allocated = group_mark != nullptr ? *group_mark : mark_allocation(home);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (group_mark != nullptr && allocated != nullptr) ++marks_.at(allocated).holders;
    AllocationLease lease{this, allocated};
    Job& job = startable(position);
    const size_t fields = job.layout.size() / 2;
    if (outs.size() != fields || capacities.size() != fields)
      throw Error(Error::kInvalid, "batch " + std::to_string(position) + " has " + std::to_string(fields) +
                                       " output fields, got " + std::to_string(outs.size()) + " buffers");
    // The read paths address one span: its base is the lowest buffer, each field an offset in it.
    int64_t low = -1, high = 0;
    for (size_t o = 0; o < fields; ++o) {
      const int64_t bytes = job.layout[2 + 2 * o];
      if (capacities[o] < bytes || (outs[o] == 0 && bytes > 0))
        throw Error(Error::kInvalid, "output field " + std::to_string(o) + " of batch " + std::to_string(position) +
                                         " holds " + std::to_string(capacities[o]) + " bytes, it needs " +
                                         std::to_string(bytes));
      if (bytes == 0) continue;
      low = low < 0 ? outs[o] : std::min(low, outs[o]);
      high = std::max(high, outs[o] + bytes);
    }
    if (low < 0) low = high = 0;
    job.at.assign(fields, 0);
    for (size_t o = 0; o < fields; ++o) job.at[o] = job.layout[2 + 2 * o] > 0 ? outs[o] - low : 0;
    job.out = static_cast<uintptr_t>(low), job.out_bytes = high - low;
    job.allocated = lease.release();
    return enqueue(job, home);
  }
}

NativeLoop::Job& NativeLoop::startable(int64_t position) {  // under mu_
  auto it = jobs_.find(position);
  if (it == jobs_.end() || it->second.started || it->second.done)
    throw Error(Error::kInvalid, "batch " + std::to_string(position) + " was not submitted or already started");
  return it->second;
}

bool NativeLoop::enqueue(Job& job, uintptr_t home) {  // under mu_; true if a worker needs a notify
  job.home = home, job.started = true, job.rows_kernel = rows_kernel_.load();
  job.mapped_kernel = mapped_kernel_.load();
  queue_.push_back(job.position);
  return idle_workers_ > 0;  // a busy worker takes it from the queue next
}

// -- workers -------------------------------------------------------------------------------

void NativeLoop::worker_loop() {
  if (cfg_.cuda) {
    try {
      cuda::check(cuda::api().ctx_set_current(ctx_), "cuCtxSetCurrent");
    } catch (...) {
    }
  }
  for (;;) {
    Job* job = nullptr;
    bool pass_on = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ++idle_workers_;
      // Re-checked every kIdleRecheck, notified or not: no wakeup that goes missing can leave
      // a started batch queued, or stop() joining, while every worker sleeps.
      bool first_look = true;
      while (!stopping_.load() && queue_.empty()) {
        if (first_look && cfg_.debug_idle_pause_us > 0)  // tests: between the look and the wait
          std::this_thread::sleep_for(std::chrono::microseconds(cfg_.debug_idle_pause_us));
        first_look = false;
        if (cfg_.debug_old_idle_wait)
          work_cv_.wait(lock);
        else
          work_cv_.wait_for(lock, kIdleRecheck);
      }
      --idle_workers_;
      if (stopping_.load()) return;
      job = &jobs_.at(queue_.front());  // std::map: the reference stays valid while other jobs come and go
      queue_.pop_front();
      job->turn = ordered_ ? next_turn_++ : -1;
      job->turn_over = false;
      pass_on = !queue_.empty() && idle_workers_ > 0 && !cfg_.wake_all && !cfg_.debug_no_pass_on;
    }
    if (pass_on && !cfg_.debug_lose_wakeups) work_cv_.notify_one();  // the next batch's worker
    std::exception_ptr error;
    try {
      run(*job);
    } catch (...) {
      error = std::current_exception();
    }
    end_turn(*job);  // failed or stopped before its copies too: the later batches' go on
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error) job->error = error;  // (a deferred batch's may already be the consumer's)
      job->done = true;
    }
    done_cv_.notify_all();
  }
}

bool NativeLoop::begin_copies(const Job& job) {
  std::unique_lock<std::mutex> lock(turn_mu_);
  while (job.turn >= 0 && serving_ != job.turn) {
    if (stopping_.load()) return false;
    turn_cv_.wait_for(lock, std::chrono::milliseconds(1));
  }
  note_enqueued(job.position);
  return true;
}

void NativeLoop::note_enqueued(int64_t position) {
  if (position < last_enqueued_) ++late_copies_;
  last_enqueued_ = std::max(last_enqueued_, position);
}

void NativeLoop::end_turn(Job& job) {
  if (job.turn < 0 || job.turn_over) return;
  job.turn_over = true;
  {
    std::lock_guard<std::mutex> lock(turn_mu_);
    turns_done_.insert(job.turn);
    while (!turns_done_.empty() && *turns_done_.begin() == serving_) turns_done_.erase(turns_done_.begin()), ++serving_;
  }
  turn_cv_.notify_all();
}

void NativeLoop::run(Job& job) {
  if (cfg_.debug_jitter_us > 0) {  // batches finish out of order: take() must still keep theirs
    thread_local std::minstd_rand rng(static_cast<unsigned>(std::hash<std::thread::id>()(std::this_thread::get_id())));
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % static_cast<unsigned>(cfg_.debug_jitter_us)));
  }
  if (cfg_.cuda)
    run_cuda(job);
  else
    run_host(job);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.batches += 1;
  stats_.samples += static_cast<int64_t>(job.indices.size());
  if (cfg_.cuda) harvest_timings(false);  // here, not in take(): the consumer's thread makes no extra calls
}

int64_t NativeLoop::gather_rows(const LoopField& f, const std::vector<int64_t>& indices, char* dst) const {
  std::vector<int64_t> dsts, srcs, sizes;
  const int64_t n = static_cast<int64_t>(indices.size());
  for (int64_t k = 0; k < n; ++k) {
    const int64_t src = static_cast<int64_t>(f.memory) + indices[k] * f.row_bytes;
    const int64_t at = reinterpret_cast<int64_t>(dst) + k * f.row_bytes;
    if (!sizes.empty() && srcs.back() + sizes.back() == src && dsts.back() + sizes.back() == at)
      sizes.back() += f.row_bytes;  // consecutive rows (a sequential sampler): one copy
    else
      dsts.push_back(at), srcs.push_back(src), sizes.push_back(f.row_bytes);
  }
  return copy_ranges(dsts, srcs, sizes, cfg_.copy_threads, cfg_.task_size, cfg_.nontemporal && cfg_.cuda);
}

NativeLoop::Ranges NativeLoop::file_ranges(const Job& job) const {
  Ranges r;
  size_t o = 0;  // output field
  for (const LoopField& f : cfg_.fields) {
    const int64_t at = job.at[o++];
    if (f.kind == LoopField::kFileRows) {
      for (size_t k = 0; k < job.indices.size(); ++k) {
        r.file_index.push_back(f.file);
        r.offsets.push_back(f.file_offset + job.indices[k] * f.row_bytes);
        r.lengths.push_back(f.row_bytes);
        r.dst_offsets.push_back(at + static_cast<int64_t>(k) * f.row_bytes);
      }
    } else if (f.kind == LoopField::kRecords) {
      const auto* rec = reinterpret_cast<const int64_t*>(f.records);
      int64_t pos = at;
      for (int64_t i : job.indices) {
        r.file_index.push_back(rec[3 * i]);
        r.offsets.push_back(rec[3 * i + 1]);
        r.lengths.push_back(rec[3 * i + 2]);
        r.dst_offsets.push_back(pos);
        pos += rec[3 * i + 2];
      }
      ++o;  // the offsets field is not read from a file
    }
  }
  return r;
}

static void record_offsets(const LoopField& f, const std::vector<int64_t>& indices, char* dst) {
  const auto* rec = reinterpret_cast<const int64_t*>(f.records);
  int64_t total = 0;
  std::memcpy(dst, &total, sizeof total);
  for (size_t k = 0; k < indices.size(); ++k) {
    total += rec[3 * indices[k] + 2];
    std::memcpy(dst + (k + 1) * sizeof(int64_t), &total, sizeof total);
  }
}

void NativeLoop::run_host(Job& job) {
  char* out = reinterpret_cast<char*>(job.out);
  const auto t0 = Clock::now();
  int64_t memory = 0;
  size_t o = 0;  // output field
  for (const LoopField& f : cfg_.fields) {
    const int64_t at = job.at[o++];
    if (f.kind == LoopField::kMemoryRows) memory += gather_rows(f, job.indices, out + at);
    if (f.kind == LoopField::kRecords) record_offsets(f, job.indices, out + job.at[o++]);
  }
  const double staged = since(t0);
  Ranges r = file_ranges(job);
  int64_t read = 0;
  const auto t1 = Clock::now();
  if (!r.offsets.empty()) {
    ReadRequest req;
    req.paths = cfg_.paths;
    req.file_index = std::move(r.file_index), req.offsets = std::move(r.offsets);
    req.lengths = std::move(r.lengths), req.dst_offsets = std::move(r.dst_offsets);
    req.dst_ptr = job.out, req.dst_size = job.out_bytes;
    req.num_threads = cfg_.io_threads, req.task_size = cfg_.task_size, req.o_direct = cfg_.o_direct;
    read = read_ranges(req);
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.stage_s += staged, stats_.staged_bytes += memory, stats_.memory_bytes += memory;
  stats_.read_s += since(t1), stats_.pread_bytes += read;
}

void NativeLoop::run_cuda(Job& job) {
  // The in-memory parts (rows, record offsets) are packed into one pinned slot.
  std::vector<HostPart> parts;
  int64_t host_bytes = 0;
  size_t o = 0;  // output field
  for (const LoopField& f : cfg_.fields) {
    const int64_t at = job.at[o], bytes = job.layout[2 + 2 * o];
    ++o;
    if (f.kind == LoopField::kRecords) {  // its slab comes from files, its offsets from here
      const int64_t offsets_at = job.at[o], offsets_bytes = job.layout[2 + 2 * o];
      ++o;
      host_bytes = align_up(host_bytes, kAlign);
      parts.push_back({host_bytes, offsets_at, offsets_bytes});
      host_bytes += offsets_bytes;
    } else if (f.kind == LoopField::kMemoryRows && !f.dma) {
      host_bytes = align_up(host_bytes, kAlign);
      parts.push_back({host_bytes, at, bytes});
      host_bytes += bytes;
    }
  }
  // The gather kernel's one launch a batch, its table of ranges in the slot too: the registered
  // rows (the table is needed), then where the slot has room the ranges of mapped files and the
  // small parts (else the ring's own launch, and a copy a part).
  Ranges ranges = file_ranges(job);
  int64_t table_at = -1, rows = 0, mapped_rows = 0;
  bool parts_in_table = false;
  if (cfg_.memory_rows_kernel && job.rows_kernel)
    for (const LoopField& f : cfg_.fields)
      if (f.kind == LoopField::kMemoryRows && f.dma) rows += static_cast<int64_t>(job.indices.size());
  if (mapped_table_ && job.mapped_kernel && cfg_.gather_function != 0) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t file : ranges.file_index) mapped_rows += mapped_[static_cast<size_t>(file)] != nullptr;
  }
  const auto table_end = [&](int64_t entries) { return align_up(host_bytes, kAlign) + 3 * entries * int64_t(sizeof(int64_t)); };
  if (mapped_rows > 0 && table_end(rows + mapped_rows) > cfg_.slot_bytes) mapped_rows = 0;
  if (rows + mapped_rows > 0) {
    const int64_t small = std::count_if(parts.begin(), parts.end(), [&](const HostPart& p) { return kernel_part(p); });
    parts_in_table = merge_parts_ && small > 0 && table_end(rows + mapped_rows + small) <= cfg_.slot_bytes;
    table_at = align_up(host_bytes, kAlign);
    host_bytes = table_end(rows + mapped_rows + (parts_in_table ? small : 0));
  }
  if (host_bytes > 0 && host_bytes > cfg_.slot_bytes)
    throw Error(Error::kInvalid, "batch " + std::to_string(job.position) + " needs " + std::to_string(host_bytes) +
                                     " bytes of pinned slot, slots hold " + std::to_string(cfg_.slot_bytes));
  size_t slot = slots_.size();
  if (host_bytes > 0) {
    slot = acquire_slot();
    if (slot == slots_.size()) return;  // stopping
  }
  const auto t0 = Clock::now();
  int64_t memory = 0;
  try {
    size_t part = 0;
    for (const LoopField& f : cfg_.fields) {
      if (f.kind == LoopField::kMemoryRows && !f.dma)
        memory += gather_rows(f, job.indices, slots_[slot].host + parts[part++].slot_at);
      if (f.kind == LoopField::kRecords) record_offsets(f, job.indices, slots_[slot].host + parts[part++].slot_at);
    }
  } catch (...) {
    release_slot(slot, nullptr);
    throw;
  }
  Staged staged{slot,           std::move(parts), host_bytes, table_at,         memory,
                rows > 0,       parts_in_table,   mapped_rows, since(t0), std::move(ranges)};
  if (cfg_.copies_on_consumer && !needs_ring(staged.ranges)) {  // take() enqueues them
    std::lock_guard<std::mutex> lock(mu_);
    job.staged = std::move(staged);
    job.deferred = true;
    ++deferred_;
    return;
  }
  if (!begin_copies(job)) {  // stopping
    release_slot(slot, nullptr);
    return;
  }
  enqueue_copies(job, staged);
}

bool NativeLoop::needs_ring(const Ranges& ranges) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t file : ranges.file_index)
    if (mapped_[static_cast<size_t>(file)] == nullptr) return true;
  return false;
}

void NativeLoop::enqueue_copies(Job& job, Staged& staged) {
  const auto& cu = cuda::api();
  const auto stream = reinterpret_cast<cuda::Stream>(cfg_.stream);
  const auto out = static_cast<cuda::DevicePtr>(job.out);
  const size_t slot = staged.slot;
  // The output was allocated on its own stream (the consumer's) at start; the copy stream waits
  // for that stream's work up to then (the event start() recorded). Recorded here instead, the
  // event would also cover steps enqueued meanwhile, and the copy would queue behind the very
  // step it should overlap.
  // A group's batches share the event: the first to get here makes the wait, the copies of
  // the others come after it on the same stream.
  if (job.allocated != nullptr) {
    bool waited = cfg_.unsafe_skip_allocation_wait;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = marks_.find(job.allocated);
      waited = waited || (it != marks_.end() && it->second.waited);
    }
    const cuda::Result w = waited ? cuda::kSuccess : cu.stream_wait_event(stream, job.allocated, 0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = marks_.find(job.allocated);
      if (w == cuda::kSuccess && it != marks_.end()) it->second.waited = true;
      drop_allocation(job.allocated);  // the wait captured it: it may be recorded again
      job.allocated = nullptr;
    }
    if (w != cuda::kSuccess) release_slot(slot, nullptr);  // nothing was enqueued to read it
    cuda::check(w, "cuStreamWaitEvent (the copy stream on the output's stream)");
  }
  // A slotted batch's ready event is its slot's: one record after the copies serves both.
  const bool slot_ready = slot < slots_.size() && slot_event_is_ready_;
  try {
    if (slot_ready) {
      std::lock_guard<std::mutex> lock(mu_);
      job.ready = slots_[slot].done, job.ready_slot = slot, job.ready_use = ++slots_[slot].uses;
    } else {
      job.ready = make_event(false);
    }
    const int every = cfg_.copy_timing_every;
    if (every > 0 && copy_batches_.fetch_add(1) % every == 0) {
      job.timing_start = make_event(true);
      job.timing_end = make_event(true);
    }
  } catch (...) {
    release_slot(slot, nullptr);  // nothing was enqueued to read it
    throw;
  }
  const auto t1 = Clock::now();
  int64_t mapped = 0, ring = 0, dma = 0;
  try {
    if (job.timing_start != nullptr) cuda::check(cu.event_record(job.timing_start, stream), "cuEventRecord");
    // One gather launch (its table in the slot) for the registered rows, the mapped files'
    // ranges and the small parts it has room for; else the rows' batched copy, which the
    // parts ride along (parts with no registered rows share one batched copy, unless a part
    // alone is all there is).
    const char* host = slot < slots_.size() ? slots_[slot].host : nullptr;
    std::vector<GatherRange> gather;
    if (staged.rows_in_table) dma = registered_ranges(job, gather);
    ReadRequest direct, ringed;  // the file ranges: of mapped files / read through the ring
    std::vector<const MappedFile*> files;
    if (!staged.ranges.offsets.empty()) split_ranges(job, staged.ranges, direct, ringed, files);
    if (staged.mapped_rows > 0 && !direct.offsets.empty()) {
      const Plan plan = plan_mapped(files, direct, false);  // a range past a file's end throws here
      if (static_cast<int64_t>(plan.pieces.size()) <= staged.mapped_rows) {  // (else a file was mapped since)
        for (const ReadPiece& p : plan.pieces)
          gather.push_back({reinterpret_cast<uintptr_t>(files[p.file]->data() + p.off), p.len, p.dst});
        mapped = plan.total;
        direct = ReadRequest{};
      }
    }
    const bool dma_rows = !staged.rows_in_table && !job.indices.empty() &&
                          std::any_of(cfg_.fields.begin(), cfg_.fields.end(), [](const LoopField& f) {
                            return f.kind == LoopField::kMemoryRows && f.dma;
                          });
    std::vector<HostPart> alone, along;  // parts copied on their own / in the batched copy
    for (const HostPart& p : staged.parts) {
      if (merge_parts_ && staged.parts_in_table && kernel_part(p))
        gather.push_back({reinterpret_cast<uintptr_t>(host + p.slot_at), p.bytes, p.out_at});
      else
        (merge_parts_ && (dma_rows || staged.parts.size() > 1) ? along : alone).push_back(p);
    }
    for (const HostPart& p : alone)
      cuda::check(cu.memcpy_htod_async(out + static_cast<cuda::DevicePtr>(p.out_at), slots_[slot].host + p.slot_at,
                                       static_cast<size_t>(p.bytes), stream),
                  "cuMemcpyHtoDAsync (pinned slot -> device)");
    if (!staged.rows_in_table || !along.empty()) dma += copy_registered_rows(job, along, host, !staged.rows_in_table);
    if (!gather.empty()) launch_gather(job, slots_[slot].host + staged.table_at, gather);
    if (!direct.offsets.empty() || !ringed.offsets.empty()) {
      const auto [from_mapped, from_ring] = read_to_device(job, direct, ringed, files);
      mapped += from_mapped, ring = from_ring;
    }
    cuda::check(cu.event_record(job.ready, stream), "cuEventRecord");
    if (job.timing_end != nullptr) cuda::check(cu.event_record(job.timing_end, stream), "cuEventRecord");
  } catch (...) {
    release_slot(slot, stream);  // a copy enqueued before the failure may still read the slot
    throw;
  }
  release_slot(slot, stream, slot_ready);
  job.copied = staged.host_bytes + mapped + ring + dma;
  std::lock_guard<std::mutex> lock(mu_);
  stats_.stage_s += staged.stage_s, stats_.staged_bytes += staged.memory, stats_.memory_bytes += staged.memory;
  stats_.read_s += since(t1), stats_.mapped_bytes += mapped, stats_.ring_bytes += ring;
  stats_.dma_bytes += dma, stats_.copied_bytes += staged.host_bytes + mapped + ring + dma;
}

void NativeLoop::split_ranges(const Job& job, const Ranges& r, ReadRequest& direct, ReadRequest& ringed,
                              std::vector<const MappedFile*>& mapped) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    mapped = mapped_;
  }
  std::vector<int64_t> fields_at;  // each output field is its own tensor: no copy spans two
  for (size_t o = 0; o < job.at.size(); ++o)
    if (job.layout[2 + 2 * o] > 0) fields_at.push_back(job.at[o]);
  std::sort(fields_at.begin(), fields_at.end());
  for (ReadRequest* q : {&direct, &ringed}) {
    q->paths = cfg_.paths;
    q->dst_ptr = job.out, q->dst_size = job.out_bytes, q->dst_breaks = fields_at;
    q->num_threads = cfg_.io_threads, q->task_size = cfg_.task_size, q->o_direct = cfg_.o_direct;
  }
  for (size_t k = 0; k < r.offsets.size(); ++k) {
    ReadRequest& q = mapped[static_cast<size_t>(r.file_index[k])] != nullptr ? direct : ringed;
    q.file_index.push_back(r.file_index[k]), q.offsets.push_back(r.offsets[k]);
    q.lengths.push_back(r.lengths[k]), q.dst_offsets.push_back(r.dst_offsets[k]);
  }
}

std::pair<int64_t, int64_t> NativeLoop::read_to_device(Job& job, const ReadRequest& direct, const ReadRequest& ringed,
                                                        const std::vector<const MappedFile*>& mapped) {
  int64_t from_mapped = 0, from_ring = 0;
  if (!direct.offsets.empty()) {
    if (job.mapped_kernel)
      from_mapped = cfg_.ring->gather_mapped(mapped, direct, cfg_.stream, cfg_.gather_function, cfg_.piece_bytes,
                                             cfg_.blocks);
    else
      from_mapped = copy_mapped_batch(mapped, direct, cfg_.stream);
  }
  if (!ringed.offsets.empty()) {
    if (cfg_.ring == nullptr)
      throw Error(Error::kInvalid, "a file of batch " + std::to_string(job.position) + " is neither mapped nor readable "
                                                                                     "through a ring");
    end_turn(job);  // the ring's reads wait for the disk: the later batches' copies need not wait for them
    from_ring = cfg_.ring->read(ringed, cfg_.stream);
  }
  return {from_mapped, from_ring};
}

int64_t NativeLoop::copy_registered_rows(const Job& job, const std::vector<HostPart>& parts, const char* slot,
                                         bool rows) {
  std::vector<cuda::DevicePtr> dsts, srcs;
  std::vector<size_t> sizes;
  size_t o = 0;
  for (const LoopField& f : cfg_.fields) {
    const int64_t at = job.at[o];
    o += f.kind == LoopField::kRecords ? 2 : 1;
    if (!rows || f.kind != LoopField::kMemoryRows || !f.dma) continue;
    const size_t field_first = sizes.size();  // fields are separate tensors: no copy spans two
    for (size_t k = 0; k < job.indices.size(); ++k) {
      const auto src = static_cast<cuda::DevicePtr>(f.memory + job.indices[k] * f.row_bytes);
      const auto dst = static_cast<cuda::DevicePtr>(job.out + at + static_cast<int64_t>(k) * f.row_bytes);
      if (sizes.size() > field_first && srcs.back() + sizes.back() == src && dsts.back() + sizes.back() == dst)
        sizes.back() += static_cast<size_t>(f.row_bytes);  // consecutive rows: one copy
      else
        dsts.push_back(dst), srcs.push_back(src), sizes.push_back(static_cast<size_t>(f.row_bytes));
    }
  }
  int64_t part_bytes = 0;
  for (const HostPart& p : parts) {
    dsts.push_back(static_cast<cuda::DevicePtr>(job.out + p.out_at));
    srcs.push_back(reinterpret_cast<cuda::DevicePtr>(slot + p.slot_at));
    sizes.push_back(static_cast<size_t>(p.bytes));
    part_bytes += p.bytes;
  }
  return dma_copies(dsts, srcs, sizes, cfg_.stream) - part_bytes;  // the rows' bytes (parts count as staged)
}

int64_t NativeLoop::registered_ranges(const Job& job, std::vector<GatherRange>& ranges) const {
  int64_t total = 0;
  size_t o = 0;
  for (const LoopField& f : cfg_.fields) {
    const int64_t at = job.at[o];
    o += f.kind == LoopField::kRecords ? 2 : 1;
    if (f.kind != LoopField::kMemoryRows || !f.dma) continue;
    for (size_t k = 0; k < job.indices.size(); ++k)
      ranges.push_back({static_cast<uintptr_t>(f.memory + job.indices[k] * f.row_bytes), f.row_bytes,
                        at + static_cast<int64_t>(k) * f.row_bytes});
    total += static_cast<int64_t>(job.indices.size()) * f.row_bytes;
  }
  return total;
}

void NativeLoop::launch_gather(const Job& job, char* table, const std::vector<GatherRange>& ranges) {
  // The table holds (offsets, lengths, destination offsets), n int64 each, the offsets relative
  // to the lowest source, so rows of several tensors, ranges of several mapped files and the
  // slot's parts share one launch; it lies in the slot, which the kernel reads through UVA and
  // which is reused only after the batch's event.
  uintptr_t low = ranges[0].src;
  int64_t longest = 0;
  for (const GatherRange& r : ranges) low = std::min(low, r.src), longest = std::max(longest, r.bytes);
  const int64_t n = static_cast<int64_t>(ranges.size());
  auto* offsets = reinterpret_cast<long long*>(table);
  long long *lengths = offsets + n, *dst_offsets = offsets + 2 * n;
  for (int64_t k = 0; k < n; ++k) {
    const GatherRange& r = ranges[static_cast<size_t>(k)];
    offsets[k] = static_cast<long long>(r.src - low), lengths[k] = r.bytes, dst_offsets[k] = r.dst;
  }
  const void* src = reinterpret_cast<const void*>(low);
  unsigned long long dst = static_cast<unsigned long long>(job.out);
  int piece = cfg_.piece_bytes;
  int count = static_cast<int>(n);
  int pieces_per_range = static_cast<int>(std::max<int64_t>(1, (longest + piece - 1) / piece));
  void* params[] = {&src, &dst, &offsets, &lengths, &dst_offsets, &piece, &count, &pieces_per_range};
  const int64_t items = n * pieces_per_range;
  const auto grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(items, cfg_.blocks)));
  cuda::check(cuda::api().launch_kernel(reinterpret_cast<cuda::Function>(cfg_.gather_function), grid, 1, 1, 256, 1, 1,
                                        0, reinterpret_cast<cuda::Stream>(cfg_.stream), params, nullptr),
              "cuLaunchKernel (the batch's gather: registered rows, mapped file ranges, slot parts)");
}

// -- slots and events ---------------------------------------------------------------------

size_t NativeLoop::acquire_slot() {
  size_t s;
  {
    std::unique_lock<std::mutex> lock(mu_);
    bool told = false;
    while (free_slots_.empty()) {
      if (stopping_.load()) return slots_.size();
      if (!told && deferred_ > 0) done_cv_.notify_all(), told = true;  // take() enqueues the holders' copies
      slot_cv_.wait_for(lock, std::chrono::milliseconds(5));
    }
    s = free_slots_.front();
    free_slots_.pop_front();
  }
  if (slots_[s].pending && !cfg_.unsafe_slot_reuse) {
    bool done = false;
    try {
      done = wait_event(slots_[s].done, stopping_);
    } catch (...) {
      release_slot(s, nullptr);
      throw;
    }
    if (!done) {
      release_slot(s, nullptr);
      return slots_.size();
    }
    slots_[s].pending = false;
  }
  return s;
}

void NativeLoop::release_slot(size_t s, cuda::Stream after, bool recorded) {
  if (s >= slots_.size()) return;
  if (recorded)
    slots_[s].pending = true;
  else if (after != nullptr)
    slots_[s].pending = cuda::api().event_record(slots_[s].done, after) == cuda::kSuccess;
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_slots_.push_back(s);
  }
  slot_cv_.notify_one();
}

cuda::Event NativeLoop::make_event(bool timing) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& spare = timing ? spare_timing_events_ : spare_events_;
    if (!spare.empty()) {
      cuda::Event e = spare.back();
      spare.pop_back();
      return e;
    }
  }
  cuda::Event e = nullptr;
  cuda::check(cuda::api().event_create(&e, timing ? 0u : cuda::kEventDisableTiming), "cuEventCreate");
  return e;
}

void NativeLoop::recycle(cuda::Event e, bool timing) {  // under mu_
  if (e != nullptr) (timing ? spare_timing_events_ : spare_events_).push_back(e);
}

void NativeLoop::drop_ready(Job& job) {  // under mu_
  if (job.ready_slot >= slots_.size()) recycle(job.ready, false);
  job.ready = nullptr;
}

void NativeLoop::harvest_timings(bool all) {  // under mu_
  const auto& cu = cuda::api();
  std::vector<Timing> waiting;
  for (const Timing& t : timings_) {
    const cuda::Result r = cu.event_query(t.end);
    if (r == cuda::kSuccess) {
      float ms = 0;
      // a failed batch's events (no bytes) are only waited out: their time would skew the estimate
      if (t.bytes > 0 && cu.event_elapsed_time(&ms, t.start, t.end) == cuda::kSuccess)
        stats_.copy_s += ms / 1e3, stats_.timed_bytes += t.bytes;
      recycle(t.start, true), recycle(t.end, true);
    } else if (!all && r == cuda::kNotReady) {
      waiting.push_back(t);
    }
  }
  timings_.swap(waiting);
}

// -- consumer side -------------------------------------------------------------------------

bool NativeLoop::take(int64_t position, uintptr_t consumer, double timeout_s) {
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  Job job;
  bool copied = false;  // known complete: no query, no wait
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = jobs_.find(position);
    if (it == jobs_.end()) throw Error(Error::kInvalid, "batch " + std::to_string(position) + " was not submitted");
    // Staged batches' copies are enqueued here (copies_on_consumer): once this batch is staged,
    // its own and every later staged batch's, in order. Before, only where the slots ran out:
    // this batch's worker may be waiting for a slot that only a later batch's copies give back.
    const auto starving = [&] { return deferred_ > 0 && !slots_.empty() && free_slots_.empty(); };
    for (;;) {
      const bool staged = it->second.done;
      if ((staged || starving()) && deferred_ > 0) {
        if (enqueue_deferred(lock, starving())) continue;
      }
      if (staged) break;
      if (!done_cv_.wait_until(lock, deadline, [&] { return it->second.done || starving(); })) return false;
    }
    job = std::move(it->second);
    jobs_.erase(it);
    if (low_below_ >= 0 && int64_t(jobs_.size()) < low_below_) low_cv_.notify_one();  // the turn thread
    drop_allocation(job.allocated);  // a job stopped before it ran still holds it
    job.allocated = nullptr;
    if (job.error) {
      drop_ready(job);
      if (job.timing_start != nullptr) timings_.push_back({job.timing_start, job.timing_end, 0});
      std::rethrow_exception(job.error);
    }
    // Its slot taken again means its copies completed (acquire_slot waited for them), and its
    // event may already stand for a later batch's.
    copied = job.ready_slot < slots_.size() && !cfg_.unsafe_slot_reuse && slots_[job.ready_slot].uses != job.ready_use;
  }
  if (!cfg_.cuda) return true;
  if (job.ready == nullptr) throw Error(Error::kInvalid, "batch " + std::to_string(position) + " was stopped");
  const auto& cu = cuda::api();
  cuda::check(cu.ctx_set_current(ctx_), "cuCtxSetCurrent");
  const cuda::Result done = copied ? cuda::kSuccess : cu.event_query(job.ready);
  if (done != cuda::kSuccess) {  // outside the lock: this may block while the stream's queue is full
    if (done != cuda::kNotReady) cuda::check(done, "cuEventQuery (a batch's copies)");
    // The wait captures the event as recorded now, so the event can be recorded again later.
    cuda::check(cu.stream_wait_event(reinterpret_cast<cuda::Stream>(consumer), job.ready, 0),
                "cuStreamWaitEvent (the consumer's stream on the batch's copies)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  drop_ready(job);
  if (job.timing_start != nullptr) timings_.push_back({job.timing_start, job.timing_end, job.copied});
  return true;
}

bool NativeLoop::enqueue_deferred(std::unique_lock<std::mutex>& lock, bool every) {
  std::vector<Job*> staged;  // std::map: the pointers stay valid, only take() erases
  for (auto& [position, job] : jobs_) {
    if (!job.done && !every) break;  // a batch still staging: later ones wait, so copies stay in order
    if (job.deferred) staged.push_back(&job), job.deferred = false;
  }
  deferred_ -= static_cast<int64_t>(staged.size());
  if (staged.empty()) return false;
  lock.unlock();
  cuda::check(cuda::api().ctx_set_current(ctx_), "cuCtxSetCurrent");
  for (Job* job : staged) {
    {
      std::lock_guard<std::mutex> turn(turn_mu_);
      note_enqueued(job->position);
    }
    try {
      enqueue_copies(*job, job->staged);
    } catch (...) {
      std::lock_guard<std::mutex> held(mu_);
      job->error = std::current_exception();  // its take() raises it
    }
  }
  lock.lock();
  return true;
}

int NativeLoop::wait_below(int64_t n, double timeout_s, int settle_us) {
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  {
    std::unique_lock<std::mutex> lock(mu_);
    low_below_ = n;
    const bool low =
        low_cv_.wait_until(lock, deadline, [&] { return stopping_.load() || int64_t(jobs_.size()) < n; });
    low_below_ = -1;
    if (stopping_.load()) return -1;
    if (!low) return 0;
  }
  if (settle_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(settle_us));
  return 1;
}

void NativeLoop::set_mapped(int32_t file, const MappedFile* mapped) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file < 0 || file >= int32_t(mapped_.size())) throw Error(Error::kInvalid, "no such file in the loop");
  mapped_[static_cast<size_t>(file)] = mapped;
}

bool NativeLoop::stop(double timeout_s, bool wait_for_copies) {
  if (::getpid() != owner_) {
    // A forked child (a DataLoader worker) collecting the parent's loop: its workers do not
    // exist here, and joining or destroying their handles would crash. Leave them be.
    new std::vector<std::thread>(std::move(workers_));
    workers_.clear();
    return false;
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  {
    // Under mu_: a worker that has just found nothing to do and not yet begun its wait would
    // otherwise miss both the flag and the notify, and sleep through the join below (it did:
    // back-to-back short epochs hung here within minutes, and a CI run once).
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    if (!cfg_.debug_old_idle_wait) lock.lock();
    stopping_.store(true);
  }
  work_cv_.notify_all();
  slot_cv_.notify_all();
  low_cv_.notify_all();
  turn_cv_.notify_all();
  for (std::thread& t : workers_) {
    if (!t.joinable()) continue;
    // Workers finish the job in hand (bounded by its reads) and then see the flag.
    t.join();
  }
  workers_.clear();
  std::vector<size_t> unsent;  // staged batches whose copies no take() enqueued: no copy reads their slots
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [position, job] : jobs_)
      if (job.deferred) unsent.push_back(job.staged.slot), job.deferred = false;
    deferred_ = 0;
  }
  for (size_t slot : unsent) release_slot(slot, nullptr);
  if (!cfg_.cuda || !wait_for_copies) return true;
  const auto& cu = cuda::api();
  cu.ctx_set_current(ctx_);
  const std::atomic<bool> never{false};
  bool idle = true;
  for (Slot& s : slots_)
    if (s.pending) idle = wait_event(s.done, never, deadline) && idle, s.pending = !idle;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [position, job] : jobs_)
    if (job.ready != nullptr && job.started) idle = wait_event(job.ready, never, deadline) && idle;
  harvest_timings(true);
  return idle;
}

LoopStats NativeLoop::stats() {
  LoopStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cfg_.cuda) harvest_timings(false);
    s = stats_;
  }
  std::lock_guard<std::mutex> lock(turn_mu_);
  s.late_copies = late_copies_;
  return s;
}

}  // namespace tfl
