#include "mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

namespace tfl {

namespace {

constexpr int64_t kPage = 4096;

int open_regular(const std::string& path, int64_t& size, const char* why) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    throw Error(Error::kOS, std::string(std::strerror(err)) + " (" + why + ")", path, err);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(Error::kOS, std::string(std::strerror(err)) + " (fstat, " + why + ")", path, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    if (S_ISDIR(st.st_mode)) throw Error(Error::kOS, std::string("Is a directory (") + why + ")", path, EISDIR);
    throw Error(Error::kInvalid, "not a regular file: '" + path + "' (" + why + ")", path);
  }
  size = st.st_size;
  return fd;
}

}  // namespace

MappedFile::MappedFile(const std::string& path) : path_(path) {
  fd_ = open_regular(path, size_, "mapping it for DMA");
  mapped_ = (size_ + kPage - 1) / kPage * kPage;
  if (mapped_ == 0) return;  // an empty file: nothing to map or copy
  void* p = ::mmap(nullptr, static_cast<size_t>(mapped_), PROT_READ, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(fd_);
    throw Error(Error::kOS, std::string(std::strerror(err)) + " (mmap for DMA)", path, err);
  }
  data_ = static_cast<char*>(p);
  const auto& cu = cuda::api();
  const cuda::Result r = cu.mem_host_register(data_, static_cast<size_t>(mapped_), cuda::kHostRegisterReadOnly);
  if (r != cuda::kSuccess) {
    ::munmap(data_, static_cast<size_t>(mapped_));
    ::close(fd_);
    cuda::check(r, ("cuMemHostRegister(READ_ONLY) of '" + path + "'").c_str());
  }
  registered_ = true;
}

MappedFile::~MappedFile() {
  if (registered_) {
    try {
      cuda::api().mem_host_unregister(data_);
    } catch (...) {
    }
  }
  if (data_ != nullptr) ::munmap(data_, static_cast<size_t>(mapped_));
  if (fd_ >= 0) ::close(fd_);
}

Plan plan_mapped(const std::vector<const MappedFile*>& files, const ReadRequest& req, bool order_by_destination) {
  if (files.size() != req.paths.size())
    throw Error(Error::kInvalid, "one mapped file per path is needed, got " + std::to_string(files.size()) +
                                     " for " + std::to_string(req.paths.size()) + " paths");
  ReadRequest r = req;
  r.order_by_destination = order_by_destination;
  r.task_size = std::numeric_limits<int64_t>::max() / 4;  // no slicing: one copy or gather row per piece
  Plan plan = make_plan(r);  // every range against the file as it is now and the destination
  if (plan.total > 0 && r.dst_ptr == 0) throw Error(Error::kInvalid, "dst_ptr (device memory) is null");
  for (const ReadPiece& p : plan.pieces) {
    const MappedFile* f = files[p.file];
    if (p.off + p.len > f->size())
      throw Error(Error::kRange,
                  "file '" + f->path() + "', offset=" + std::to_string(p.off) + ", length=" + std::to_string(p.len) +
                      ": past the " + std::to_string(f->size()) + " bytes mapped (the file grew since it was mapped)",
                  f->path());
  }
  return plan;
}

int64_t copy_mapped(const std::vector<const MappedFile*>& files, const ReadRequest& req,
                    const std::vector<uintptr_t>& streams) {
  if (streams.empty()) throw Error(Error::kInvalid, "no stream to copy on");
  // By destination: neighbouring ranges in file and batch merge into one copy.
  const Plan plan = plan_mapped(files, req, true);
  const auto& cu = cuda::api();
  size_t k = 0;
  for (const ReadPiece& p : plan.pieces) {
    const auto stream = reinterpret_cast<cuda::Stream>(streams[k++ % streams.size()]);
    cuda::check(cu.memcpy_htod_async(static_cast<cuda::DevicePtr>(req.dst_ptr + p.dst), files[p.file]->data() + p.off,
                                     static_cast<size_t>(p.len), stream),
                "cuMemcpyHtoDAsync (mapped file -> device)");
  }
  return plan.total;
}

int64_t dma_copies(std::vector<cuda::DevicePtr>& dsts, std::vector<cuda::DevicePtr>& srcs,
                   std::vector<size_t>& sizes, uintptr_t stream) {
  const auto& cu = cuda::api();
  const auto s = reinterpret_cast<cuda::Stream>(stream);
  int64_t total = 0;
  for (size_t n : sizes) total += static_cast<int64_t>(n);
  if (sizes.empty()) return 0;
  if (cu.memcpy_batch_async == nullptr) {  // a driver before CUDA 13: one DMA copy per range
    for (size_t i = 0; i < sizes.size(); ++i)
      cuda::check(cu.memcpy_htod_async(dsts[i], reinterpret_cast<const void*>(srcs[i]), sizes[i], s),
                  "cuMemcpyHtoDAsync (registered host memory -> device)");
    return total;
  }
  cuda::MemcpyAttributes attrs{};
  attrs.src_access_order = cuda::dma_src_access_order();
  size_t first = 0;
  cuda::check(cu.memcpy_batch_async(dsts.data(), srcs.data(), sizes.data(), sizes.size(), &attrs, &first, 1, s),
              "cuMemcpyBatchAsync (registered host memory -> device)");
  return total;
}

int64_t copy_mapped_batch(const std::vector<const MappedFile*>& files, const ReadRequest& req, uintptr_t stream) {
  const Plan plan = plan_mapped(files, req, true);
  std::vector<cuda::DevicePtr> dsts, srcs;
  std::vector<size_t> sizes;
  for (const ReadPiece& p : plan.pieces) {
    dsts.push_back(static_cast<cuda::DevicePtr>(req.dst_ptr + p.dst));
    srcs.push_back(reinterpret_cast<cuda::DevicePtr>(files[p.file]->data() + p.off));
    sizes.push_back(static_cast<size_t>(p.len));
  }
  dma_copies(dsts, srcs, sizes, stream);
  return plan.total;
}

std::pair<int64_t, int64_t> page_cache_residency(const std::string& path) {
  int64_t size = 0;
  const int fd = open_regular(path, size, "checking its page-cache residency");
  const int64_t pages = (size + kPage - 1) / kPage;
  if (pages == 0) {
    ::close(fd);
    return {0, 0};
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(pages * kPage), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw Error(Error::kOS, std::string(std::strerror(err)) + " (mmap for mincore)", path, err);
  }
  std::vector<unsigned char> resident(static_cast<size_t>(pages));
  const int rc = ::mincore(p, static_cast<size_t>(pages * kPage), resident.data());
  const int err = errno;
  ::munmap(p, static_cast<size_t>(pages * kPage));
  if (rc != 0) throw Error(Error::kOS, std::string(std::strerror(err)) + " (mincore)", path, err);
  int64_t cached = 0;
  for (unsigned char v : resident) cached += v & 1;
  return {cached, pages};
}

}  // namespace tfl
