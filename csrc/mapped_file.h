// A file mapped read-only and registered with CUDA, so the GPU's copy engines read its
// page-cache pages directly: file -> GPU with no CPU copy at all (the page cache plays the
// part of a pinned buffer). Registering pins the file's pages in RAM for the object's life,
// so the Python side only maps files that are already resident and fit a memory budget.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "engine.h"
#include "plan.h"

namespace tfl {

class MappedFile {
 public:
  // Opens, maps and registers `path` with the CUDA context current on the calling thread.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }  // bytes mapped (the file's size when mapped)
  const char* data() const { return data_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
  int64_t mapped_ = 0;  // size rounded up to whole pages
  char* data_ = nullptr;
  bool registered_ = false;
};

// The plan of req's ranges of mapped files (files[req.file_index[i]]): every range checked
// against its file now (make_plan) and as mapped, and against the destination; coalesced, not
// sliced. Shared by copy_mapped and DeviceStager::gather_mapped.
Plan plan_mapped(const std::vector<const MappedFile*>& files, const ReadRequest& req, bool order_by_destination);

// Enqueues DMA copies of req's ranges from the mapped files (files[req.file_index[i]]) into
// device memory [req.dst_ptr, +dst_size), round-robin over `streams`. Ranges are checked
// against each file's size now and when mapped, and against the destination, before any copy.
int64_t copy_mapped(const std::vector<const MappedFile*>& files, const ReadRequest& req,
                    const std::vector<uintptr_t>& streams);

// Host (registered or pinned) -> device copies srcs[i] -> dsts[i], all in one cuMemcpyBatchAsync
// on `stream`: the copy engines move them (one cuMemcpyHtoDAsync each where the driver lacks
// the call). Returns the bytes.
int64_t dma_copies(std::vector<cuda::DevicePtr>& dsts, std::vector<cuda::DevicePtr>& srcs, std::vector<size_t>& sizes,
                   uintptr_t stream);

// The same ranges as copy_mapped, all in one cuMemcpyBatchAsync on `stream`: the copy engines
// move them, no SM does (one cuMemcpyHtoDAsync per range where the driver lacks the call).
int64_t copy_mapped_batch(const std::vector<const MappedFile*>& files, const ReadRequest& req, uintptr_t stream);

// (resident pages, total pages) of `path` in the page cache, through mincore on a mapping.
std::pair<int64_t, int64_t> page_cache_residency(const std::string& path);

}  // namespace tfl
