// Uniform neighbour sampling over a CSR graph (PyG NeighborLoader semantics), multi-threaded and
// deterministic: the result is a pure function of (graph, seeds, fanouts, key), whatever the
// number of threads. No Python headers here: bindings.cpp owns the graph's buffers.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace tfl {

// Arrays handed to Python as they are (no copy, no zero fill): at least one element allocated.
struct Int64Array {
  std::unique_ptr<int64_t[]> data;
  int64_t size = 0;
  explicit Int64Array(int64_t n = 0) : data(new int64_t[n > 0 ? n : 1]), size(n) {}
};

struct SampleResult {
  Int64Array n_id;        // the seeds, then each hop's new nodes
  Int64Array edge_index;  // 2 * num_edges: sources (local ids), then targets
  int64_t num_edges = 0;
};

class NeighborSampler {
 public:
  // indptr: num_nodes + 1 int64; indices: num_edges ids of index_bytes (4 or 8) each. Both must
  // stay valid and unchanged in size while the sampler lives (the caller holds them). Their
  // contents are re-checked as they are read, so a later mutation gives an error, never a bad read.
  NeighborSampler(const int64_t* indptr, int64_t num_nodes, const void* indices, int index_bytes,
                  int64_t num_edges);
  ~NeighborSampler();

  // Per hop each frontier node v of degree d > 0 draws fanouts[h] neighbours uniformly with
  // replacement (draw j of the node at frontier position i from a counter-based hash of
  // (key, h, i, j)); duplicate (source, target) pairs are merged. Edges and new nodes follow
  // frontier order, then each target's draw order (first draw of a repeated neighbour).
  // num_threads 0: the default.
  // Throws Error(kInvalid) for seeds outside [0, num_nodes), negative fanouts, a corrupt graph.
  SampleResult sample(const std::vector<int64_t>& seeds, const std::vector<int64_t>& fanouts, uint64_t key,
                      int num_threads) const;

  int64_t num_nodes() const { return num_nodes_; }
  int64_t num_edges() const { return num_edges_; }
  int index_bytes() const { return index_bytes_; }
  // The largest in-degree: a node keeps at most min(fanout, degree) distinct picks, so a hop's
  // slots are min(fanout, max_degree) per frontier node (memory grows with degree, not fanout).
  int64_t max_degree() const { return max_degree_; }
  // Bytes the idle scratch sets hold in per-slot arrays (what a huge fanout would have grown).
  int64_t scratch_slot_bytes() const;
  // min(8, CPUs this process may run on).
  static int default_threads();

 private:
  struct Scratch;
  // One claim word per node (generation-stamped), reused across calls; a small pool so
  // concurrent calls from several Python threads each get their own.
  std::unique_ptr<Scratch> acquire() const;
  void release(std::unique_ptr<Scratch> s) const;

  template <typename Index>
  SampleResult run(const Index* indices, const std::vector<int64_t>& seeds, const std::vector<int64_t>& fanouts,
                   uint64_t key, int num_threads) const;

  const int64_t* indptr_;
  int64_t num_nodes_;
  const void* indices_;
  int index_bytes_;
  int64_t num_edges_;
  int64_t max_degree_ = 0;
  mutable std::mutex mu_;
  mutable std::vector<std::unique_ptr<Scratch>> free_;
};

}  // namespace tfl
