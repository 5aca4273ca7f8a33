#include "engine.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "plan.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <system_error>
#include <unordered_map>
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace tfl {

// ---------------------------------------------------------------------------------------------
// Thread pool
// ---------------------------------------------------------------------------------------------

struct ThreadPool::Job {
  const std::function<void(size_t, const std::atomic<bool>&)>* fn = nullptr;
  size_t n = 0;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::atomic<bool> stop{false};  // set by the first failure; tasks poll it
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;
};

namespace {
std::mutex g_pool_mu;
ThreadPool* g_pool = nullptr;  // never destroyed: workers may still be parked at interpreter exit
ThreadPool* g_background_pool = nullptr;

void atfork_prepare() { g_pool_mu.lock(); }
void atfork_parent() { g_pool_mu.unlock(); }
// Worker threads do not survive fork(); the child builds a fresh pool on first use and leaks
// the old one (its mutex may even be held by a thread that no longer exists).
void atfork_child() {
  g_pool = nullptr;
  g_background_pool = nullptr;
  g_pool_mu.unlock();
}
}  // namespace

ThreadPool& ThreadPool::instance() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); });
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (g_pool == nullptr) g_pool = new ThreadPool();
  return *g_pool;
}

ThreadPool& ThreadPool::background() {
  instance();  // installs the fork handlers
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (g_background_pool == nullptr) g_background_pool = new ThreadPool(10);
  return *g_background_pool;
}

size_t ThreadPool::num_workers() {
  std::lock_guard<std::mutex> lock(mu_);
  return workers_.size();
}

void ThreadPool::ensure_workers(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  while (workers_.size() < n) {
    try {
      workers_.emplace_back([this] {
        // per thread on Linux: only this worker; failure (a policy forbidding it) is harmless
        if (nice_ != 0) (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice_);
        worker_loop();
      });
      workers_.back().detach();
    } catch (const std::system_error&) {
      break;  // out of threads: the caller and existing workers still finish the job
    }
  }
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return !queue_.empty(); });
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    drain(*job);
  }
}

void ThreadPool::drain(Job& job) {
  for (;;) {
    const size_t i = job.next.fetch_add(1);
    if (i >= job.n) return;
    if (!job.stop.load()) {
      try {
        (*job.fn)(i, job.stop);
      } catch (...) {
        std::lock_guard<std::mutex> lock(job.mu);
        if (!job.error) job.error = std::current_exception();
        job.stop.store(true);
      }
    }
    if (job.done.fetch_add(1) + 1 == job.n) {
      std::lock_guard<std::mutex> lock(job.mu);
      job.cv.notify_all();
    }
  }
}

void ThreadPool::run(size_t n, size_t width,
                     const std::function<void(size_t, const std::atomic<bool>&)>& task) {
  if (n == 0) return;
  width = std::max<size_t>(1, std::min(width, n));
  auto job = std::make_shared<Job>();
  job->fn = &task;
  job->n = n;
  if (width > 1) {
    ensure_workers(width - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t k = 0; k + 1 < width; ++k) queue_.push_back(job);
    }
    cv_.notify_all();
  }
  drain(*job);  // the caller works too
  {
    std::unique_lock<std::mutex> lock(job->mu);
    job->cv.wait(lock, [&] { return job->done.load() == n; });
  }
  // Helpers that pop this job later find no task left; they only touch the shared Job.
  if (job->error) std::rethrow_exception(job->error);
}

// ---------------------------------------------------------------------------------------------
// Range reads
// ---------------------------------------------------------------------------------------------

namespace {

std::string describe(int64_t i, int64_t off, int64_t len, int64_t dst) {
  return "range #" + std::to_string(i) + " (offset=" + std::to_string(off) + ", length=" + std::to_string(len) +
         ", dst_offset=" + std::to_string(dst) + ")";
}

std::string quoted(const std::string& path) { return "'" + path + "'"; }

// The (file, offset, length) pair being read, for error messages.
std::string where(const File& f, const Piece& p) {
  return "file " + quoted(f.path) + ", offset=" + std::to_string(p.off) + ", length=" + std::to_string(p.len);
}

[[noreturn]] void short_read(const File& f, const Piece& p, int64_t at) {
  throw Error(Error::kShortRead,
              "unexpected end of file at byte " + std::to_string(at) + " while reading " + where(f, p) +
                  " (the file had " + std::to_string(f.size) + " bytes when the call began: was it truncated?)",
              f.path);
}

[[noreturn]] void read_failed(const File& f, const Piece& p, int64_t at, int err) {
  throw Error(Error::kOS,
              "read failed at byte " + std::to_string(at) + " (" + std::strerror(err) + ") while reading offset=" +
                  std::to_string(p.off) + ", length=" + std::to_string(p.len),
              f.path, err);
}

// Reads file bytes [pos, pos + need) into buf, looping over short reads. Each pread asks for
// up to `span - got` bytes (span >= need, block-rounded under O_DIRECT). With O_DIRECT an
// unaligned short read means end of file. Returns false if the job was stopped meanwhile.
bool pread_full(const File& f, const Piece& p, char* buf, int64_t pos, int64_t need, int64_t span,
                bool direct, const std::atomic<bool>& stop) {
  int64_t got = 0;
  while (got < need) {
    if (stop.load(std::memory_order_relaxed)) return false;
    int64_t want = std::min(span - got, kMaxIo);
    ssize_t r = ::pread(f.fd, buf + got, static_cast<size_t>(want), pos + got);
    if (r < 0) {
      if (errno == EINTR) continue;
      read_failed(f, p, pos + got, errno);
    }
    if (r == 0) short_read(f, p, pos + got);
    got += r;
    if (direct && got < need && got % kDirectAlign != 0) short_read(f, p, pos + got);
  }
  return true;
}

// One aligned bounce buffer per thread, reused across calls (O_DIRECT only).
char* bounce_buffer(int64_t bytes) {
  struct Buffer {
    char* ptr = nullptr;
    int64_t size = 0;
    ~Buffer() { std::free(ptr); }
  };
  thread_local Buffer buffer;
  if (buffer.size < bytes) {
    std::free(buffer.ptr);
    buffer.ptr = nullptr;
    buffer.size = 0;
    void* p = nullptr;
    if (::posix_memalign(&p, kDirectAlign, static_cast<size_t>(bytes)) != 0) throw std::bad_alloc();
    buffer.ptr = static_cast<char*>(p);
    buffer.size = bytes;
  }
  return buffer.ptr;
}

}  // namespace

void read_piece(const File& f, const Piece& p, char* dst, bool direct, const std::atomic<bool>& stop) {
  if (!direct) {
    pread_full(f, p, dst, p.off, p.len, p.len, false, stop);
    return;
  }
  const int64_t a = kDirectAlign;
  if (reinterpret_cast<uintptr_t>(dst) % a == 0 && p.off % a == 0 && p.len % a == 0) {
    pread_full(f, p, dst, p.off, p.len, p.len, true, stop);  // already aligned: no bounce
    return;
  }
  const int64_t first = p.off / a * a;
  const int64_t end = p.off + p.len;
  const int64_t last = (end + a - 1) / a * a;  // end <= file size < INT64_MAX - a
  char* buf = bounce_buffer(last - first);
  if (pread_full(f, p, buf, first, end - first, last - first, true, stop))
    std::memcpy(dst, buf + (p.off - first), static_cast<size_t>(p.len));
}

namespace {

// Opens one file for reading and records its size. Every failure names the first range using it.
void open_file(File& f, bool direct, const std::string& range) {
  int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK;  // O_NONBLOCK: never hang opening a FIFO
  if (direct) flags |= O_DIRECT;
  f.fd = ::open(f.path.c_str(), flags);
  if (f.fd < 0) {
    int err = errno;
    struct stat st;
    if (err == EINVAL && direct && ::stat(f.path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) err = EISDIR;
    if (err == EINVAL && direct)
      throw Error(Error::kOS,
                  "the filesystem refuses O_DIRECT (open returned EINVAL) for " + range +
                      "; pass o_direct=False",
                  f.path, err);
    throw Error(Error::kOS, std::string(std::strerror(err)) + " (opening for " + range + ")", f.path, err);
  }
  struct stat st;
  if (::fstat(f.fd, &st) != 0) {
    int err = errno;
    throw Error(Error::kOS, std::string(std::strerror(err)) + " (fstat for " + range + ")", f.path, err);
  }
  if (S_ISDIR(st.st_mode))
    throw Error(Error::kOS, "Is a directory (opening for " + range + ")", f.path, EISDIR);
  if (S_ISREG(st.st_mode)) {
    f.size = st.st_size;
  } else if (S_ISBLK(st.st_mode)) {
    off_t end = ::lseek(f.fd, 0, SEEK_END);
    if (end < 0) {
      int err = errno;
      throw Error(Error::kOS, std::string(std::strerror(err)) + " (sizing block device for " + range + ")",
                  f.path, err);
    }
    f.size = end;
  } else {
    throw Error(Error::kInvalid,
                "not a regular file or block device: " + quoted(f.path) + " (opening for " + range + ")", f.path);
  }
  ::fcntl(f.fd, F_SETFL, ::fcntl(f.fd, F_GETFL) & ~O_NONBLOCK);
}

// Packs pieces into tasks of about task_size bytes; a longer piece is sliced across tasks.
// Returns task boundaries: task t is pieces[bounds[t], bounds[t + 1]).
template <class P>
std::vector<size_t> pack_tasks(std::vector<P>& pieces, int64_t task_size) {
  std::vector<P> out;
  std::vector<size_t> bounds{0};
  int64_t filled = 0;
  for (const P& whole : pieces) {
    // A piece that does not fit the current task starts a new one, so big pieces are cut at
    // whole multiples of task_size from their start (keeps O_DIRECT slices aligned).
    if (filled > 0 && whole.len > task_size - filled) {
      bounds.push_back(out.size());
      filled = 0;
    }
    for (int64_t done = 0; done < whole.len;) {
      int64_t take = std::min(whole.len - done, task_size - filled);
      out.push_back(whole.slice(done, take));
      done += take;
      filled += take;
      if (filled >= task_size) {
        bounds.push_back(out.size());
        filled = 0;
      }
    }
  }
  if (filled > 0) bounds.push_back(out.size());
  pieces.swap(out);
  return bounds;
}

[[noreturn]] void bad_range(const ReadRequest& r, int64_t i, const std::string& why) {
  const int64_t fi = r.file_index[i];
  std::string path = (fi >= 0 && fi < static_cast<int64_t>(r.paths.size())) ? r.paths[fi] : std::string();
  std::string msg = describe(i, r.offsets[i], r.lengths[i], r.dst_offsets[i]);
  if (!path.empty()) msg += " of " + quoted(path);
  throw Error(Error::kRange, msg + ": " + why, path);
}

}  // namespace

Plan make_plan(const ReadRequest& r) {
  Plan plan;
  const size_t n = r.file_index.size();
  if (r.offsets.size() != n || r.lengths.size() != n || r.dst_offsets.size() != n) {
    throw Error(Error::kInvalid, "file_index, offsets, lengths and dst_offsets must have the same length, got " +
                                     std::to_string(n) + ", " + std::to_string(r.offsets.size()) + ", " +
                                     std::to_string(r.lengths.size()) + ", " + std::to_string(r.dst_offsets.size()));
  }
  if (r.num_threads < 1 || r.num_threads > kMaxThreads)
    throw Error(Error::kInvalid, "num_threads must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                                     std::to_string(r.num_threads));
  if (r.task_size < 1)
    throw Error(Error::kInvalid, "task_size must be >= 1, got " + std::to_string(r.task_size));
  if (r.dst_size < 0)
    throw Error(Error::kInvalid, "dst_size must be >= 0, got " + std::to_string(r.dst_size));
  if (r.paths.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    throw Error(Error::kInvalid, "too many paths");

  // 1. Every range against the index arithmetic and the destination, before any syscall.
  const int64_t nfiles = static_cast<int64_t>(r.paths.size());
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t total = 0;
  for (size_t k = 0; k < n; ++k) {
    const int64_t i = static_cast<int64_t>(k);
    const int64_t fi = r.file_index[k], off = r.offsets[k], len = r.lengths[k], dst = r.dst_offsets[k];
    if (fi < 0 || fi >= nfiles)
      bad_range(r, i, "file_index " + std::to_string(fi) + " is not in [0, " + std::to_string(nfiles) + ")");
    if (off < 0 || len < 0 || dst < 0) bad_range(r, i, "offset, length and dst_offset must be >= 0");
    if (off > kMax - len) bad_range(r, i, "offset + length overflows int64");
    if (len > r.dst_size || dst > r.dst_size - len)
      bad_range(r, i, "destination bytes [dst_offset, dst_offset + length) exceed the buffer of " +
                          std::to_string(r.dst_size) + " bytes");
    if (__builtin_add_overflow(total, len, &total)) bad_range(r, i, "total length overflows int64");
  }

  // 2. Open each referenced file once; check every range against the file's size.
  std::vector<std::unique_ptr<File>>& files = plan.files;
  files.resize(r.paths.size());
  for (size_t k = 0; k < n; ++k) {
    const int64_t fi = r.file_index[k];
    auto& f = files[fi];
    if (!f) {
      f.reset(new File);
      f->path = r.paths[fi];
      open_file(*f, r.o_direct,
                describe(static_cast<int64_t>(k), r.offsets[k], r.lengths[k], r.dst_offsets[k]));
    }
    if (r.offsets[k] + r.lengths[k] > f->size)
      bad_range(r, static_cast<int64_t>(k),
                "reads past the end of the file (" + std::to_string(f->size) + " bytes)");
  }

  // 3. Coalesce ranges adjacent both in the file and in the destination.
  std::vector<size_t> order;
  order.reserve(n);
  for (size_t k = 0; k < n; ++k)
    if (r.lengths[k] > 0) order.push_back(k);
  auto before = [&](size_t a, size_t b) {
    if (r.order_by_destination && r.dst_offsets[a] != r.dst_offsets[b]) return r.dst_offsets[a] < r.dst_offsets[b];
    if (r.file_index[a] != r.file_index[b]) return r.file_index[a] < r.file_index[b];
    if (r.offsets[a] != r.offsets[b]) return r.offsets[a] < r.offsets[b];
    return r.dst_offsets[a] < r.dst_offsets[b];
  };
  if (!std::is_sorted(order.begin(), order.end(), before)) std::sort(order.begin(), order.end(), before);
  std::vector<ReadPiece>& pieces = plan.pieces;
  for (size_t k : order) {
    ReadPiece p{{static_cast<int32_t>(r.file_index[k]), r.offsets[k], r.lengths[k], r.dst_offsets[k]}};
    if (!pieces.empty()) {
      ReadPiece& last = pieces.back();
      if (last.file == p.file && last.off + last.len == p.off && last.dst + last.len == p.dst &&
          !starts_allocation(r, p.dst)) {
        last.len += p.len;  // both sums are bounded by the checked file and buffer sizes
        continue;
      }
    }
    pieces.push_back(p);
  }

  // 4. Slice into tasks of about task_size bytes.
  int64_t task_size = r.task_size;
  if (r.o_direct) task_size = (std::min(task_size, kMax / 4) + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  plan.bounds = pack_tasks(pieces, task_size);
  plan.total = total;
  return plan;
}

std::vector<std::vector<PlannedRead>> plan_ranges(const ReadRequest& r) {
  Plan plan = make_plan(r);
  std::vector<std::vector<PlannedRead>> tasks(plan.bounds.size() - 1);
  for (size_t t = 0; t + 1 < plan.bounds.size(); ++t)
    for (size_t j = plan.bounds[t]; j < plan.bounds[t + 1]; ++j) {
      const ReadPiece& p = plan.pieces[j];
      tasks[t].push_back({p.file, p.off, p.len, p.dst});
    }
  return tasks;
}

int64_t read_ranges(const ReadRequest& r) {
  if (r.dst_size >= 0 && r.dst_ptr > std::numeric_limits<uintptr_t>::max() - static_cast<uint64_t>(r.dst_size))
    throw Error(Error::kInvalid, "dst_ptr + dst_size overflows the address space");
  const Plan plan = make_plan(r);
  if (plan.total > 0 && r.dst_ptr == 0) throw Error(Error::kInvalid, "dst_ptr is null");
  char* base = reinterpret_cast<char*>(r.dst_ptr);
  const bool direct = r.o_direct;
  ThreadPool::instance().run(plan.bounds.size() - 1, static_cast<size_t>(r.num_threads),
                             [&](size_t t, const std::atomic<bool>& stop) {
                               for (size_t j = plan.bounds[t]; j < plan.bounds[t + 1]; ++j) {
                                 if (stop.load(std::memory_order_relaxed)) return;
                                 const ReadPiece& p = plan.pieces[j];
                                 read_piece(*plan.files[p.file], p, base + p.dst, direct, stop);
                               }
                             });
  return plan.total;
}

// ---------------------------------------------------------------------------------------------
// Parallel memcpy
// ---------------------------------------------------------------------------------------------

namespace {
// memcpy with non-temporal stores: the destination (a pinned slot) is next read by the DMA
// engine, not the CPU, so bypassing the cache saves the read-for-ownership of every line.
void stream_copy(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
  if (n >= (size_t(1) << 16)) {
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, src += 64, dst += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
  }
#endif
  std::memcpy(dst, src, n);
}

struct CopyPiece {
  uintptr_t dst, src;
  int64_t len;
  CopyPiece slice(int64_t from, int64_t n) const {
    return {dst + static_cast<uintptr_t>(from), src + static_cast<uintptr_t>(from), n};
  }
};
}  // namespace

int64_t copy_ranges(const std::vector<int64_t>& dst_ptrs, const std::vector<int64_t>& src_ptrs,
                    const std::vector<int64_t>& sizes, int num_threads, int64_t task_size, bool streaming) {
  const size_t n = sizes.size();
  if (dst_ptrs.size() != n || src_ptrs.size() != n) {
    throw Error(Error::kInvalid, "dst_ptrs, src_ptrs and sizes must have the same length, got " +
                                     std::to_string(dst_ptrs.size()) + ", " + std::to_string(src_ptrs.size()) +
                                     ", " + std::to_string(n));
  }
  if (num_threads < 1 || num_threads > kMaxThreads)
    throw Error(Error::kInvalid, "num_threads must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                                     std::to_string(num_threads));
  if (task_size < 1) throw Error(Error::kInvalid, "task_size must be >= 1, got " + std::to_string(task_size));
  std::vector<CopyPiece> pieces;
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t d = dst_ptrs[i], s = src_ptrs[i], len = sizes[i];
    // Built only on failure: this loop runs for every sample row of every batch.
    auto bad = [&](const char* why) {
      return Error(Error::kRange, "copy #" + std::to_string(i) + " (dst=" + std::to_string(d) + ", src=" +
                                      std::to_string(s) + ", size=" + std::to_string(len) + "): " + why);
    };
    if (len < 0) throw bad("size must be >= 0");
    if (len == 0) continue;
    if (d <= 0 || s <= 0) throw bad("pointers must be non-null");
    if (d > std::numeric_limits<int64_t>::max() - len || s > std::numeric_limits<int64_t>::max() - len)
      throw bad("pointer + size overflows");
    if (__builtin_add_overflow(total, len, &total)) throw bad("total overflows");
    pieces.push_back({static_cast<uintptr_t>(d), static_cast<uintptr_t>(s), len});
  }
  const std::vector<size_t> bounds = pack_tasks(pieces, task_size);
  ThreadPool::instance().run(bounds.size() - 1, static_cast<size_t>(num_threads),
                             [&](size_t t, const std::atomic<bool>&) {
                               for (size_t j = bounds[t]; j < bounds[t + 1]; ++j) {
                                 const CopyPiece& p = pieces[j];
                                 if (streaming) {
                                   stream_copy(reinterpret_cast<char*>(p.dst), reinterpret_cast<const char*>(p.src),
                                               static_cast<size_t>(p.len));
                                 } else {
                                   std::memcpy(reinterpret_cast<void*>(p.dst), reinterpret_cast<const void*>(p.src),
                                               static_cast<size_t>(p.len));
                                 }
                               }
#if defined(__SSE2__)
                               if (streaming) _mm_sfence();  // streamed stores visible before return
#endif
                             });
  return total;
}

}  // namespace tfl
