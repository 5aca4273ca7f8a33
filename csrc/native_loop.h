// The loader's steady state for planned sources, with no Python and no GIL per batch.
//
// Python hands over each batch's indices and a device buffer allocated on the loader's copy
// stream (submit + start); worker threads here validate the indices, lay the batch out, gather
// in-memory rows into a pinned slot, read file rows or records (through the pinned ring, or
// straight out of registered page cache by copy engines or the gather kernel), enqueue the
// slot's H2D copies on the copy stream and record the batch's event. next() then takes the
// batch (wait), making the consumer's stream wait on that event. A slot is reused only once
// the event after its last copy has completed. With no device (`device < 0`) the same loop
// writes straight into a host output buffer, which also lets the CPU tests drive it.
#pragma once

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda_driver.h"
#include "device_stager.h"
#include "engine.h"
#include "mapped_file.h"

namespace tfl {

// One field of a batch: fixed-size rows from memory or a file, or ragged records from files
// (a uint8 slab, followed in the output by an int64 field of n + 1 offsets). The memory a
// field points to (rows, record tables) is owned by the caller and must outlive the loop.
struct LoopField {
  enum Kind { kMemoryRows = 0, kFileRows = 1, kRecords = 2 };
  int kind = kMemoryRows;
  int64_t rows = 0;         // samples the field holds (indices are checked against it)
  int64_t row_bytes = 0;    // kMemoryRows / kFileRows
  uintptr_t memory = 0;     // kMemoryRows: address of row 0 (contiguous rows)
  bool dma = false;         // kMemoryRows in pinned (registered) memory: copy engines read the rows
  int32_t file = -1;        // kFileRows: index into LoopConfig::paths
  int64_t file_offset = 0;  // kFileRows: byte offset of row 0
  uintptr_t records = 0;    // kRecords: rows x (file index, offset, length) int64, C order
  std::string name;         // an out-of-range index's message, the index where "{}" stands
};

struct LoopConfig {
  std::vector<LoopField> fields;
  std::vector<std::string> paths;
  bool cuda = false;
  uintptr_t stream = 0;  // the loader's copy stream (a CUstream)
  // Pinned slots for the in-memory parts (rows, record offsets): num_slots x slot_bytes at slots.
  uintptr_t slots = 0;
  int64_t slot_bytes = 0;
  int num_slots = 0;
  int workers = 2;       // batches staged at once
  int copy_threads = 8;  // threads gathering one batch's in-memory rows
  int io_threads = 16;
  int64_t task_size = int64_t(4) << 20;
  bool o_direct = false;
  bool nontemporal = true;
  DeviceStager* ring = nullptr;  // file ranges -> device through the pinned ring (CUDA)
  uintptr_t gather_function = 0;  // the mapped-file gather kernel (uva.py), 0: DMA copies
  bool memory_rows_kernel = false;  // the slot holds a gather table: registered rows may go by that kernel
  int piece_bytes = 64 << 10;
  int blocks = 32;
  bool unsafe_slot_reuse = false;  // tests only: skip the wait for a slot's last copy (a negative control)
  bool unsafe_skip_allocation_wait = false;  // tests only: copy before the output's stream is done with its memory
  int debug_jitter_us = 0;         // tests only: each batch first sleeps a random 0..jitter us
  bool debug_lose_wakeups = false;  // tests only: start() never notifies an idle worker
  int debug_idle_pause_us = 0;      // tests only: a worker finding no job pauses (holding mu_) before it waits
  // Benchmarks' and tests' control: a group's submit wakes every idle worker itself (before the
  // chained wake, where it wakes one and each worker taking a batch wakes the next).
  bool wake_all = false;
  bool debug_no_pass_on = false;  // tests only, the control: one worker woken a group, none passing on
  // A batch's copies enter the copy stream after those of every batch started before it (a CUDA
  // loop with at least a slot a worker, or none): its one stream runs them in that order, so the
  // batch next() waits for is never queued behind later ones. Tests' and benchmarks' control: false.
  bool ordered_copies = true;
  int debug_submit_pause_us = 0;  // tests only: each submit_group first sleeps this long (a slow submit)
  bool debug_old_idle_wait = false;  // tests only, the control: idle workers wake on a notify alone and
                                     // stop() raises its flag without mu_ (the loop before the fix)
  // One batch in this many has its H2D copies timed by a pair of CUDA events (0: none). Each
  // timed batch costs the loop's threads four driver calls more beside the training thread.
  int copy_timing_every = 16;
  // The copies of a batch whose ranges need no pinned ring (in-memory rows, record offsets,
  // mapped files) are enqueued by the consumer's thread in take(), not by the worker that
  // staged it: a launch or event record by another thread makes the training thread's own
  // launches wait in the driver (H200: a bare copy a batch from a thread of its own cost a
  // launch-bound thread 0.85x of its rate, the same copy made in next() 0.95x); the consumer
  // pays for the calls in take() instead (config copy_enqueue, 'next'; off by default).
  bool copies_on_consumer = false;
};

// Per-batch and cumulative measurements (seconds, bytes).
struct LoopStats {
  int64_t batches = 0, samples = 0;
  double stage_s = 0, read_s = 0;
  double copy_s = 0;         // the timed batches' copies (cfg.copy_timing_every)...
  int64_t timed_bytes = 0;   // ...and their bytes: copy_s * copied_bytes / timed_bytes estimates all
  int64_t staged_bytes = 0, copied_bytes = 0;
  int64_t memory_bytes = 0, mapped_bytes = 0, ring_bytes = 0, pread_bytes = 0, dma_bytes = 0;
  int64_t late_copies = 0;  // batches whose copies entered the copy stream after a later batch's
};

class NativeLoop {
 public:
  static constexpr int64_t kAlign = 256;  // every field starts on this boundary (as staging.ALIGN)

  // The CUDA context current on the calling thread is the one every worker uses.
  explicit NativeLoop(LoopConfig cfg);
  ~NativeLoop();
  NativeLoop(const NativeLoop&) = delete;
  NativeLoop& operator=(const NativeLoop&) = delete;

  // Registers batch `position` (its indices, in sampler order) and returns its layout: the
  // output's byte size, then (byte offset, bytes) of each output field (records give two: the
  // slab, then n + 1 int64 offsets). Bad indices are not raised here: the batch is recorded as
  // failed ([-1] is returned) and take() raises. With out_bytes >= 0 the batch also starts
  // into `out` at once (start()), for layouts the caller knew beforehand (row_layout).
  std::vector<int64_t> submit(int64_t position, std::vector<int64_t> indices, uintptr_t out = 0,
                              int64_t out_bytes = -1, uintptr_t home = 0);
  // The layout of any batch of n samples, where it does not depend on the indices (no records).
  std::vector<int64_t> row_layout(int64_t n) const;
  // Starts batch `position` into `out` of `out_bytes` (>= its layout size): device memory the
  // caller allocated on `home` (the consumer's stream, a CUstream; the copies first wait for
  // that stream's work up to now, so a block it freed is not written early), or host memory.
  void start(int64_t position, uintptr_t out, int64_t out_bytes, uintptr_t home);
  // As start(), with one buffer per output field (outs[k] holding capacities[k] bytes, each
  // allocated on `home`): the fields become independent tensors with no views to build.
  void start_fields(int64_t position, const std::vector<int64_t>& outs, const std::vector<int64_t>& capacities,
                    uintptr_t home);
  // submit_fields() for `count` batches at positions first_position.. (indices: count x n, in
  // order; outs: count x fields), with one wake-up of the workers for them all. Returns each
  // batch's output bytes, or -1 where its indices were bad (take() raises that batch's error).
  std::vector<int64_t> submit_group(int64_t first_position, const std::vector<int64_t>& indices, int64_t count,
                                    const std::vector<int64_t>& outs, const std::vector<int64_t>& capacities,
                                    uintptr_t home);
  // submit() then start_fields() where the indices were valid.
  std::vector<int64_t> submit_fields(int64_t position, std::vector<int64_t> indices, const std::vector<int64_t>& outs,
                                     const std::vector<int64_t>& capacities, uintptr_t home);
  // Waits up to timeout_s for batch `position`; false if it is not staged by then. Else hands
  // it over: `consumer` (a CUstream) waits on its copies, unless they already completed (then
  // no stream call is made: one blocks while the stream's queue is full), and forgets it;
  // rethrows the batch's error.
  bool take(int64_t position, uintptr_t consumer, double timeout_s);
  // Blocks until fewer than `n` batches are submitted and not yet taken (1; then sleeps
  // settle_us), timeout_s passes (0) or the loop stops (-1). The loader's turn thread waits here
  // for its next group (config turn_thread), so no Python thread polls.
  int wait_below(int64_t n, double timeout_s, int settle_us);
  // Whether batches started from now on move registered in-memory rows by the gather kernel
  // (needs cfg.memory_rows_kernel) or by the copy engines.
  void set_rows_kernel(bool on) { rows_kernel_.store(on && cfg_.memory_rows_kernel); }
  bool rows_kernel() const { return rows_kernel_.load(); }
  // Whether batches started from now on move ranges of mapped files by the gather kernel (needs
  // cfg.gather_function and the ring) or by the copy engines (one cuMemcpyBatchAsync a batch).
  void set_mapped_kernel(bool on) { mapped_kernel_.store(on && cfg_.gather_function != 0 && cfg_.ring != nullptr); }
  bool mapped_kernel() const { return mapped_kernel_.load(); }
  // A file's registered mapping (or null): its ranges are then copied out of the page cache.
  void set_mapped(int32_t file, const MappedFile* mapped);
  // Stops the workers (jobs not started are dropped) and joins them (each finishes the job in
  // hand). With wait_for_copies, also waits (up to timeout_s) for every copy enqueued so far:
  // true when they completed. Without, the caller guards reuse of the slots by an event.
  bool stop(double timeout_s, bool wait_for_copies);
  LoopStats stats();

 private:
  // A staged batch's part in its pinned slot: bytes at slot_at go to the output at out_at.
  struct HostPart {
    int64_t slot_at, out_at, bytes;
  };
  // Every file range of a batch: (file index, offset, length, destination offset in the output).
  struct Ranges {
    std::vector<int64_t> file_index, offsets, lengths, dst_offsets;
  };
  // What a worker staged for a batch whose copies are still to be enqueued.
  struct Staged {
    size_t slot = static_cast<size_t>(-1);  // slots_.size(): none
    std::vector<HostPart> parts;
    int64_t host_bytes = 0, table_at = -1, memory = 0;
    // What the gather kernel's one launch moves (its table at table_at): the registered rows,
    // the ranges of mapped files (room for mapped_rows of them), the parts of one piece or less.
    bool rows_in_table = false, parts_in_table = false;
    int64_t mapped_rows = 0;
    double stage_s = 0;
    Ranges ranges;  // its file ranges
  };
  struct Job {
    int64_t position = 0;
    std::vector<int64_t> indices;
    std::vector<int64_t> layout;  // layout_of: [total, (offset, bytes) per output field]
    uintptr_t out = 0;       // the span the output fields lie in (one buffer, or the lowest of several)
    int64_t out_bytes = 0;
    std::vector<int64_t> at;  // each output field's offset from `out`
    uintptr_t home = 0;  // the stream `out` was allocated on
    bool started = false, done = false;
    bool rows_kernel = false;    // registered rows by the gather kernel (rows_kernel_ at its start)
    bool mapped_kernel = false;  // mapped file ranges by the gather kernel (mapped_kernel_ at its start)
    std::exception_ptr error;
    cuda::Event allocated = nullptr;  // recorded on `home` at start (null: home is the copy stream)
    cuda::Event ready = nullptr;                          // recorded after the batch's copies
    // Where `ready` is its slot's event (one record serves both): the slot, and its use count
    // then. A later count means the slot was taken again after these copies completed.
    size_t ready_slot = static_cast<size_t>(-1);
    uint64_t ready_use = 0;
    cuda::Event timing_start = nullptr, timing_end = nullptr;  // the H2D copies, for stats (timed batches)
    int64_t copied = 0;                                          // bytes those copies moved
    int64_t turn = -1;  // its place in the copy stream's order (ordered_), given as a worker takes it
    bool turn_over = false;  // the owning worker's: its turn was passed on (end_turn)
    bool deferred = false;  // under mu_: staged, its copies left to the consumer (copies_on_consumer)
    Staged staged;          // the deferred batch's slot and parts
  };
  struct Timing {
    cuda::Event start, end;
    int64_t bytes;
  };
  struct Slot {
    char* host = nullptr;
    cuda::Event done = nullptr;  // recorded after the last copy out of it
    bool pending = false;
    uint64_t uses = 0;  // under mu_: batches that copied out of it (counted after the last one's copies completed)
  };
  // An allocation event (see mark_allocation), shared by the batches of a group.
  struct AllocationMark {
    int holders = 1;      // jobs (or a start in progress) that still hold it
    bool waited = false;  // the copy stream waits on it already: later copies there come after
  };


  std::vector<int64_t> layout_of(const std::vector<int64_t>& indices) const;
  Job& startable(int64_t position);
  // The wake-up after a group's batches were queued (`wake`: an idle worker needs one).
  void wake_for_group(bool wake);
  // start_fields() without the wake-up: true if an idle worker needs one.
  // `group_mark`: the group's allocation event (null pointer: one of its own).
  bool start_fields_quietly(int64_t position, const std::vector<int64_t>& outs, const std::vector<int64_t>& capacities,
                            uintptr_t home, const cuda::Event* group_mark = nullptr);
  bool enqueue(Job& job, uintptr_t home);
  // An event recorded on `home` now (null where the copies need no wait): the copy stream waits
  // on it, so memory the caching allocator recycled is written only after its last use there.
  // The caller holds it once (drop_allocation gives the hold back).
  cuda::Event mark_allocation(uintptr_t home);
  void drop_allocation(cuda::Event e);  // under mu_: the last holder recycles it
  // Gives the hold back (under mu_) unless a started job took it: start() may throw midway.
  struct AllocationLease {
    NativeLoop* loop;
    cuda::Event event;
    cuda::Event release() { return std::exchange(event, nullptr); }
    ~AllocationLease() { loop->drop_allocation(event); }
  };
  void worker_loop();
  // Waits until every batch taken before `job` has enqueued its copies (ordered_; false: the
  // loop is stopping), then counts a late enqueue. end_turn() passes the turn on, once a job.
  bool begin_copies(const Job& job);
  void end_turn(Job& job);
  // Counts a late enqueue (a later batch's copies went first) and notes `position` as enqueued.
  void note_enqueued(int64_t position);  // under turn_mu_
  void run(Job& job);
  void run_host(Job& job);
  void run_cuda(Job& job);
  // Enqueues a staged batch's copies on the copy stream and records its events; frees its slot.
  void enqueue_copies(Job& job, Staged& staged);
  // Whether any of these ranges lies in a file read through the pinned ring (not mapped).
  bool needs_ring(const Ranges& ranges);
  // take()'s: the copies of the deferred batches, in order, up to the first batch still staging
  // (`every`: all of them); a batch's failure becomes its error. False: there were none.
  bool enqueue_deferred(std::unique_lock<std::mutex>& lock, bool every);
  Ranges file_ranges(const Job& job) const;
  // File ranges into the device output: out of registered page cache (copy engines or the
  // gather kernel) or through the pinned ring; returns (bytes mapped, bytes through the ring).
  // (split_ranges': `direct` empty where the batch's gather launch took them)
  std::pair<int64_t, int64_t> read_to_device(Job& job, const ReadRequest& direct, const ReadRequest& ringed,
                                             const std::vector<const MappedFile*>& mapped);
  // In-memory rows of registered (pinned) tensors straight into the output by the copy engines,
  // and the slot's `parts` in the same call.
  // (`rows` false: only the parts)
  int64_t copy_registered_rows(const Job& job, const std::vector<HostPart>& parts, const char* slot, bool rows = true);
  // A range the gather kernel copies: bytes at a host address (registered or pinned) to an
  // offset of the batch's output.
  struct GatherRange {
    uintptr_t src;
    int64_t bytes, dst;
  };
  // The registered rows of every field (cfg_.memory_rows_kernel), as gather ranges.
  int64_t registered_ranges(const Job& job, std::vector<GatherRange>& ranges) const;
  // One launch of the gather kernel for all `ranges`, its table written at `table` (the slot).
  void launch_gather(const Job& job, char* table, const std::vector<GatherRange>& ranges);
  // The batch's file ranges split into those of mapped files and the rest (read through the ring).
  void split_ranges(const Job& job, const Ranges& r, ReadRequest& direct, ReadRequest& ringed,
                    std::vector<const MappedFile*>& mapped);
  int64_t gather_rows(const LoopField& f, const std::vector<int64_t>& indices, char* dst) const;
  size_t acquire_slot();
  // `after`: the stream whose copies read it (its event is recorded there); `recorded`: its
  // event was recorded after them already (as the batch's ready event).
  void release_slot(size_t slot, cuda::Stream after, bool recorded = false);
  cuda::Event make_event(bool timing);
  void recycle(cuda::Event e, bool timing);
  void drop_ready(Job& job);  // under mu_: recycles its ready event unless that is its slot's
  void harvest_timings(bool all);

  LoopConfig cfg_;
  int owner_ = ::getpid();  // the process whose threads these are (see stop())
  cuda::Context ctx_ = nullptr;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> rows_kernel_{false};
  std::atomic<bool> mapped_kernel_{false};
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_, slot_cv_, low_cv_;
  int64_t low_below_ = -1;  // under mu_: the n a wait_below() waits for (take() notifies), -1: none
  std::map<int64_t, Job> jobs_;
  int64_t deferred_ = 0;       // under mu_: jobs staged whose copies the consumer has yet to enqueue
  std::deque<int64_t> queue_;  // started, not yet picked up by a worker
  int idle_workers_ = 0;       // workers waiting for a batch (only they need a notify)
  std::vector<Slot> slots_;
  std::deque<size_t> free_slots_;
  std::vector<cuda::Event> spare_events_, spare_timing_events_;
  std::unordered_map<cuda::Event, AllocationMark> marks_;  // under mu_: allocation events held
  // One record a batch fewer (TORCH_FASTLOAD_SLOT_EVENT=own, TORCH_FASTLOAD_ALLOCATION_MARK=batch:
  // the before of an A/B): a slotted batch's ready event is its slot's, a group's batches share
  // one allocation event and the copy stream waits on it once.
  bool slot_event_is_ready_ = true;
  bool group_mark_ = true;
  // A batch's slot parts (labels, record offsets) go in its rows' one copy call or gather
  // launch, not a cuMemcpyHtoDAsync each (TORCH_FASTLOAD_MERGE_PARTS=0: the before of an A/B).
  bool merge_parts_ = true;
  // A part the gather kernel moves with the rows: one piece at most (larger ones stay on the
  // copy engines, which move a long contiguous range without SMs).
  bool kernel_part(const HostPart& p) const { return p.bytes <= cfg_.piece_bytes; }
  // The ranges of mapped files go in the same launch, their table in the slot, when the batch's
  // mapped ranges take the gather kernel (TORCH_FASTLOAD_MAPPED_TABLE=ring: the ring's own
  // launch a file, its table in a ring chunk with an event of its own: the before of an A/B).
  bool mapped_table_ = true;
  std::vector<Timing> timings_;  // handed over, not yet measured
  std::atomic<int64_t> copy_batches_{0};  // batches whose copies were enqueued (picks the timed ones)
  std::vector<std::thread> workers_;
  std::vector<const MappedFile*> mapped_;
  LoopStats stats_;
  // The copy stream's order (cfg.ordered_copies where no wait for a slot can block it: a CUDA
  // loop with no slots or at least one a worker). Turns are given under mu_ in queue order.
  bool ordered_ = false;
  int64_t next_turn_ = 0;         // under mu_
  std::mutex turn_mu_;
  std::condition_variable turn_cv_;
  int64_t serving_ = 0;           // under turn_mu_: the turn whose copies go next
  std::set<int64_t> turns_done_;  // under turn_mu_: turns passed on ahead of serving_
  int64_t last_enqueued_ = -1;    // under turn_mu_: the latest position whose copies were enqueued
  int64_t late_copies_ = 0;       // under turn_mu_: LoopStats::late_copies
};

}  // namespace tfl
