// Internal to the engine's .cpp files: a validated read plan and the piece reader, shared by
// read_ranges (into host memory) and DeviceStager (through a pinned ring into GPU memory).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"

namespace tfl {

struct File {
  std::string path;
  int fd = -1;
  int64_t size = 0;
  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (fd >= 0) ::close(fd);
  }
};

// A contiguous piece of one file going to one contiguous piece of the destination.
struct Piece {
  int32_t file;
  int64_t off, len, dst;
};

struct ReadPiece : Piece {
  ReadPiece slice(int64_t from, int64_t n) const { return {{file, off + from, n, dst + from}}; }
};

struct Plan {
  std::vector<std::unique_ptr<File>> files;  // by file_index; null where unreferenced
  std::vector<ReadPiece> pieces;
  std::vector<size_t> bounds;  // task t reads pieces[bounds[t], bounds[t + 1])
  int64_t total = 0;
};

// Validates every range against its file and [0, dst_size), opens and sizes the files,
// coalesces and slices into tasks of about task_size bytes. Reads nothing, so a hostile
// request fails here before any byte is written.
Plan make_plan(const ReadRequest& r);

// Whether dst starts a separate allocation of the destination (ReadRequest::dst_breaks).
inline bool starts_allocation(const ReadRequest& r, int64_t dst) {
  return !r.dst_breaks.empty() && std::binary_search(r.dst_breaks.begin(), r.dst_breaks.end(), dst);
}

// Reads one piece to dst (which must hold p.len bytes), looping over short reads; O_DIRECT
// goes through an aligned per-thread bounce buffer unless everything is aligned.
void read_piece(const File& f, const Piece& p, char* dst, bool direct, const std::atomic<bool>& stop);

}  // namespace tfl
