// Uniform neighbour sampling, hop by hop, in four parallel passes that never depend on the
// thread count (all order comes from "claim indices", not from timing):
//   A  picks: frontier node i draws fanout neighbours (counter-based hash of key, hop, i, j),
//      merges repeats (first draws kept, in draw order) into its slots i * stride + c (stride:
//      min(fanout, the graph's largest degree), so memory follows degrees, not the fanout; above
//      32 draws a node's draws are merged as they are made, in memory of its degree, stopping
//      once every neighbour position has been drawn, as no later draw can add one); every
//      slot then claims its node with an atomic max of (generation, -claim index) in a per-node
//      scratch word: the smallest claim index (seeds < earlier hops < frontier order < draw
//      order) wins the node.
//   B  each slot reads its node's winning claim; winners are counted per chunk.
//   C  winners get local ids (chunk prefix sums, in slot order): the next frontier.
//   D  after the last hop, every slot's edge (local id of its winner's node, frontier node's).
// The random reads (indptr, indices, the scratch words) are prefetched ahead of use: the work
// is memory-latency bound, so threads and prefetches keep many misses in flight.
#include "sampler.h"

#include "engine.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <thread>

namespace tfl {

namespace {

// A scratch word: generation (24 bits) above kLowMask - claim index (40 bits). Words of older
// calls (smaller generation) lose to any claim of this call; within it the smaller index wins.
constexpr int kLowBits = 40;
constexpr uint64_t kLowMask = (uint64_t(1) << kLowBits) - 1;
constexpr uint64_t kMaxGeneration = (uint64_t(1) << (64 - kLowBits)) - 1;
constexpr size_t kKeepScratch = 4;  // idle scratch sets kept for reuse
constexpr int kDefaultMaxThreads = 8;
constexpr int64_t kAhead = 16;  // nodes between a draw and the read of its picks (a power of 2)

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;  // splitmix64's increment
constexpr uint64_t kStep = 0xd1b54a32d192ed03ULL;    // another odd constant for the draw stream

inline uint64_t mix64(uint64_t z) {  // splitmix64's finaliser (a bijection with full avalanche)
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

inline uint64_t encode(uint64_t generation, uint64_t claim) { return (generation << kLowBits) | (kLowMask - claim); }

inline void claim(uint64_t* word, uint64_t want) {
  uint64_t cur = __atomic_load_n(word, __ATOMIC_RELAXED);
  while (cur < want &&
         !__atomic_compare_exchange_n(word, &cur, want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

// The distinct neighbours at positions at[0..f), f <= kSmallDraws, in the order of their first
// draw, written to out; returns how many. Each draw is compared with the earlier ones,
// branch-free (a sort's data-dependent branches would mispredict on every node).
constexpr int64_t kSmallDraws = 32;

template <typename Index>
inline int64_t merge_picks(const Index* indices, const int64_t* at, int64_t f, int64_t* out) {
  int64_t v[kSmallDraws], picked[kSmallDraws];  // picked: out has room for the distinct picks only
  for (int64_t j = 0; j < f; ++j) v[j] = static_cast<int64_t>(indices[at[j]]);
  int64_t c = 0;
  for (int64_t j = 0; j < f; ++j) {
    bool seen = false;
    for (int64_t t = 0; t < j; ++t) seen |= v[t] == v[j];
    picked[c] = v[j];
    c += !seen;
  }
  std::memcpy(out, picked, static_cast<size_t>(c) * sizeof(int64_t));
  return c;
}

// Draws above kSmallDraws per node are made and merged in one streaming pass (stream_picks),
// never stored: the ring then holds (first edge, degree) per node.

// Lemire's multiply-shift: draw j's position in [0, d), bias at most d / 2**64.
inline uint64_t draw_offset(uint64_t stream, int64_t j, uint64_t d) {
  const uint64_t r = mix64(stream + kStep * static_cast<uint64_t>(j + 1));
  return static_cast<uint64_t>((static_cast<unsigned __int128>(r) * d) >> 64);
}

// The same draws and the same result as merge_picks over all f draws (distinct neighbours in the
// order of their first draw), in memory that follows the degree d, not f: a bitmap of the d
// positions drawn and a hash set of the distinct neighbours. Once every position has been drawn
// no later draw can add a neighbour, so it stops there (about d ln d draws for a huge fanout).
template <typename Index>
int64_t stream_picks(const Index* indices, int64_t lo, uint64_t d, int64_t f, uint64_t stream, int64_t* out) {
  thread_local std::vector<uint64_t> drawn;  // bit per position of the node's neighbour list
  thread_local std::vector<int64_t> values;  // open addressing over the distinct neighbours
  thread_local std::vector<char> used;
  drawn.assign(static_cast<size_t>((d + 63) / 64), 0);
  size_t cap = 16;
  while (cap < 2 * static_cast<size_t>(std::min<uint64_t>(static_cast<uint64_t>(f), d))) cap *= 2;
  values.assign(cap, 0);
  used.assign(cap, 0);
  int64_t c = 0;
  uint64_t covered = 0;
  for (int64_t j = 0; j < f && covered < d; ++j) {
    const uint64_t off = draw_offset(stream, j, d);
    uint64_t& bits = drawn[static_cast<size_t>(off >> 6)];
    const uint64_t bit = uint64_t(1) << (off & 63);
    if (bits & bit) continue;  // a position drawn before: its neighbour is already in
    bits |= bit;
    ++covered;
    const int64_t v = static_cast<int64_t>(indices[lo + static_cast<int64_t>(off)]);
    size_t slot = static_cast<size_t>(mix64(static_cast<uint64_t>(v))) & (cap - 1);
    while (used[slot] && values[slot] != v) slot = (slot + 1) & (cap - 1);
    if (used[slot]) continue;  // the same neighbour at another position (a repeated edge)
    used[slot] = 1;
    values[slot] = v;
    out[c++] = v;
  }
  return c;
}

template <typename T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

[[noreturn]] void invalid(const std::string& message) { throw Error(Error::kInvalid, message); }

}  // namespace

// Everything a call writes besides its result, kept across calls (no allocation or page
// faults in the steady state).
struct NeighborSampler::Scratch {
  struct Hop {
    std::vector<int64_t> node;    // slot -> sampled global id (the first count[i] slots of node i)
    std::vector<int64_t> winner;  // slot -> claim index that won its node
    std::vector<int64_t> local;   // slot -> local id of its node (winning slots only)
    std::vector<int32_t> count;   // frontier node -> distinct picks
    std::vector<int64_t> chunk_edges, chunk_new;  // per chunk: distinct picks, new nodes (then offsets)
    std::vector<int64_t> next;    // the hop's new nodes: the next frontier
  };
  uint64_t* word = nullptr;  // one per graph node; calloc'd, so untouched pages cost nothing
  int64_t num_nodes = 0;
  uint64_t generation = 0;
  std::vector<Hop> hops;
  std::vector<int64_t> seed_local;  // 0, 1, 2, ...: the seeds' local ids, as a claim table

  explicit Scratch(int64_t n) : num_nodes(n) {
    word = static_cast<uint64_t*>(std::calloc(static_cast<size_t>(std::max<int64_t>(n, 1)), sizeof(uint64_t)));
    if (word == nullptr) throw std::bad_alloc();
  }
  ~Scratch() { std::free(word); }
  uint64_t next_generation() {
    if (++generation > kMaxGeneration) {
      std::memset(word, 0, static_cast<size_t>(num_nodes) * sizeof(uint64_t));
      generation = 1;
    }
    return generation;
  }
};

NeighborSampler::NeighborSampler(const int64_t* indptr, int64_t num_nodes, const void* indices, int index_bytes,
                                 int64_t num_edges)
    : indptr_(indptr), num_nodes_(num_nodes), indices_(indices), index_bytes_(index_bytes), num_edges_(num_edges) {
  if (num_nodes < 0 || num_edges < 0) invalid("a graph needs num_nodes >= 0 and num_edges >= 0");
  if (index_bytes != 4 && index_bytes != 8)
    invalid("indices must be int32 or int64, got " + std::to_string(index_bytes) + "-byte items");
  for (int64_t v = 0; v < num_nodes; ++v) max_degree_ = std::max(max_degree_, indptr[v + 1] - indptr[v]);
}

int64_t NeighborSampler::scratch_slot_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t bytes = 0;
  for (const auto& s : free_)
    for (const auto& hop : s->hops)
      bytes += static_cast<int64_t>((hop.node.capacity() + hop.winner.capacity() + hop.local.capacity()) *
                                    sizeof(int64_t));
  return bytes;
}

NeighborSampler::~NeighborSampler() = default;

int NeighborSampler::default_threads() {
  int cpus = 0;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = CPU_COUNT(&set);
  if (cpus <= 0) cpus = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min(kDefaultMaxThreads, cpus));
}

std::unique_ptr<NeighborSampler::Scratch> NeighborSampler::acquire() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      std::unique_ptr<Scratch> s = std::move(free_.back());
      free_.pop_back();
      return s;
    }
  }
  return std::unique_ptr<Scratch>(new Scratch(num_nodes_));
}

void NeighborSampler::release(std::unique_ptr<Scratch> s) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.size() < kKeepScratch) free_.push_back(std::move(s));
}

SampleResult NeighborSampler::sample(const std::vector<int64_t>& seeds, const std::vector<int64_t>& fanouts,
                                     uint64_t key, int num_threads) const {
  std::string bad;
  int bad_count = 0;
  for (const int64_t s : seeds)
    if (s < 0 || s >= num_nodes_) {
      if (++bad_count <= 8) bad += (bad.empty() ? "" : ", ") + std::to_string(s);
    }
  if (bad_count)
    invalid(std::to_string(bad_count) + " seed(s) outside [0, " + std::to_string(num_nodes_) + "): " + bad +
            (bad_count > 8 ? ", ..." : ""));
  for (size_t h = 0; h < fanouts.size(); ++h)
    if (fanouts[h] < 0 || fanouts[h] > INT32_MAX)
      invalid("fanouts must lie in [0, 2**31), got " + std::to_string(fanouts[h]) + " for hop " +
              std::to_string(h));
  if (num_threads < 0) invalid("num_threads must be >= 0 (0: the default), got " + std::to_string(num_threads));
  if (num_threads == 0) num_threads = default_threads();
  num_threads = std::min(num_threads, kMaxThreads);
  if (index_bytes_ == 4)
    return run(static_cast<const int32_t*>(indices_), seeds, fanouts, key, num_threads);
  return run(static_cast<const int64_t*>(indices_), seeds, fanouts, key, num_threads);
}

template <typename Index>
SampleResult NeighborSampler::run(const Index* indices, const std::vector<int64_t>& seeds,
                                  const std::vector<int64_t>& fanouts, uint64_t key, int num_threads) const {
  struct Lease {  // the scratch goes back to the pool however the call ends
    const NeighborSampler* owner;
    std::unique_ptr<Scratch> scratch;
    ~Lease() {
      if (scratch) owner->release(std::move(scratch));
    }
  } lease{this, acquire()};
  Scratch& scratch = *lease.scratch;
  uint64_t* const word = scratch.word;
  const uint64_t generation = scratch.next_generation();
  const int64_t* const indptr = indptr_;
  const int64_t n = num_nodes_, e = num_edges_;
  const size_t width = static_cast<size_t>(num_threads);
  ThreadPool& pool = ThreadPool::instance();
  const bool shared = width > 1;  // claims race between threads: atomic max

  const int64_t num_seeds = static_cast<int64_t>(seeds.size());
  for (int64_t t = 0; t < num_seeds; ++t) claim(word + seeds[t], encode(generation, static_cast<uint64_t>(t)));

  // Per hop: the frontier (its first node's local id), its claim base and chunking.
  struct HopInfo {
    const int64_t* frontier;
    int64_t size, first_local, stride, chunk, chunks;  // stride: slots per frontier node
    uint64_t base;
    int64_t first_new, fresh;  // local id of the hop's first new node, how many
  };
  std::vector<HopInfo> info;
  if (scratch.hops.size() < fanouts.size()) scratch.hops.resize(fanouts.size());
  const int64_t* frontier = seeds.data();
  int64_t m = num_seeds, first_local = 0, count = num_seeds;
  uint64_t base = static_cast<uint64_t>(num_seeds);
  for (size_t h = 0; h < fanouts.size() && m > 0 && fanouts[h] > 0; ++h) {
    const int64_t f = fanouts[h];
    // slots per frontier node: its distinct picks, at most min(fanout, degree)
    const int64_t stride = std::max<int64_t>(1, std::min(f, max_degree_));
    const int64_t max_degree = max_degree_;
    if (static_cast<uint64_t>(m) > (kLowMask - base) / static_cast<uint64_t>(stride))
      invalid("too many draws in one call (" + std::to_string(m) + " frontier nodes x fanout " + std::to_string(f) +
              " at hop " + std::to_string(h) + ")");
    Scratch::Hop& hop = scratch.hops[h];
    const int64_t chunk = std::max<int64_t>(8, std::min<int64_t>(512, m / static_cast<int64_t>(width * 8) + 1));
    const int64_t chunks = (m + chunk - 1) / chunk;
    grow(hop.node, static_cast<size_t>(m * stride));
    grow(hop.winner, static_cast<size_t>(m * stride));
    grow(hop.local, static_cast<size_t>(m * stride));
    grow(hop.count, static_cast<size_t>(m));
    grow(hop.chunk_edges, static_cast<size_t>(chunks) + 1);
    grow(hop.chunk_new, static_cast<size_t>(chunks) + 1);
    int64_t* const node = hop.node.data();
    int64_t* const winner = hop.winner.data();
    int64_t* const local = hop.local.data();
    int32_t* const cnt = hop.count.data();
    int64_t* const chunk_edges = hop.chunk_edges.data();
    int64_t* const chunk_new = hop.chunk_new.data();
    const uint64_t hop_key = mix64(key ^ mix64(kGolden * (h + 1)));

    // A: draws, merged per target, then claims, software-pipelined over the chunk's nodes:
    // node i + 2D's indptr entry is prefetched, node i + D's draws are made and their indices
    // entries prefetched, node i's picks are read and merged (its claim words prefetched),
    // node i - D claims its picks: many independent misses in flight per thread.
    pool.run(static_cast<size_t>(chunks), width, [&](size_t k, const std::atomic<bool>&) {
      const int64_t i0 = static_cast<int64_t>(k) * chunk, i1 = std::min(m, i0 + chunk);
      // kAhead nodes' pick positions (-1: degree 0); streamed draws: (first edge, degree)
      thread_local std::vector<int64_t> ring;
      const bool streamed = f > kSmallDraws;
      const int64_t per_node = streamed ? 2 : f;
      grow(ring, static_cast<size_t>(kAhead * per_node));
      int64_t* const positions = ring.data();
      int64_t edges = 0;
      auto draw = [&](int64_t i) {
        int64_t* const at = positions + (i & (kAhead - 1)) * per_node;
        const int64_t v = frontier[i];
        const int64_t lo = indptr[v], hi = indptr[v + 1];
        if (lo < 0 || hi < lo || hi > e || hi - lo > max_degree)  // max_degree: the slots' room
          invalid("graph.indptr is corrupt at node " + std::to_string(v) + ": [" + std::to_string(lo) + ", " +
                  std::to_string(hi) + ") with " + std::to_string(e) + " edges (or changed since the sampler was made)");
        const uint64_t d = static_cast<uint64_t>(hi - lo);
        if (d == 0) {
          at[0] = -1;
          return;
        }
        if (streamed) {
          at[0] = lo;
          at[1] = static_cast<int64_t>(d);
          __builtin_prefetch(indices + lo);
          return;
        }
        const uint64_t stream = mix64(hop_key + kGolden * static_cast<uint64_t>(i + 1));
        for (int64_t j = 0; j < f; ++j) {
          const int64_t pos = lo + static_cast<int64_t>(draw_offset(stream, j, d));
          at[j] = pos;
          __builtin_prefetch(indices + pos);
        }
      };
      auto merge = [&](int64_t i) {
        const int64_t* const at = positions + (i & (kAhead - 1)) * per_node;
        if (at[0] < 0) {
          cnt[i] = 0;
          return;
        }
        int64_t* const out = node + i * stride;
        const int64_t c =
            streamed ? stream_picks(indices, at[0], static_cast<uint64_t>(at[1]), f,
                                    mix64(hop_key + kGolden * static_cast<uint64_t>(i + 1)), out)
                     : merge_picks(indices, at, f, out);
        uint64_t worst = 0;
        for (int64_t j = 0; j < c; ++j) worst = std::max(worst, static_cast<uint64_t>(out[j]));  // negatives: huge
        if (worst >= static_cast<uint64_t>(n))
          invalid("graph.indices holds a neighbour id outside [0, " + std::to_string(n) + ") for node " +
                  std::to_string(frontier[i]));
        cnt[i] = static_cast<int32_t>(c);
        edges += c;
        for (int64_t j = 0; j < c; ++j) __builtin_prefetch(word + out[j], 1);
      };
      auto claims = [&](int64_t i) {
        const int64_t* const slots = node + i * stride;
        const uint64_t first = base + static_cast<uint64_t>(i * stride);
        if (shared) {
          for (int64_t c = 0; c < cnt[i]; ++c) claim(word + slots[c], encode(generation, first + c));
        } else {  // one thread: no other writer, so no locked instruction (a full barrier on x86)
          for (int64_t c = 0; c < cnt[i]; ++c) {
            uint64_t* const w = word + slots[c];
            const uint64_t want = encode(generation, first + c);
            if (*w < want) *w = want;
          }
        }
      };
      for (int64_t i = i0; i < std::min(i1, i0 + 2 * kAhead); ++i) __builtin_prefetch(indptr + frontier[i]);
      for (int64_t i = i0; i < std::min(i1, i0 + kAhead); ++i) draw(i);
      for (int64_t i = i0; i < i1; ++i) {
        if (i + 2 * kAhead < i1) __builtin_prefetch(indptr + frontier[i + 2 * kAhead]);
        merge(i);  // before draw(i + kAhead): they share a ring entry
        if (i + kAhead < i1) draw(i + kAhead);
        if (i - kAhead >= i0) claims(i - kAhead);
      }
      for (int64_t i = std::max(i0, i1 - kAhead); i < i1; ++i) claims(i);
      chunk_edges[k] = edges;
    });

    // B: which slot won each node.
    pool.run(static_cast<size_t>(chunks), width, [&](size_t k, const std::atomic<bool>&) {
      const int64_t i0 = static_cast<int64_t>(k) * chunk, i1 = std::min(m, i0 + chunk);
      int64_t wins = 0;
      for (int64_t i = i0; i < std::min(i1, i0 + kAhead); ++i)
        for (int64_t c = 0; c < cnt[i]; ++c) __builtin_prefetch(word + node[i * stride + c]);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t s0 = i * stride;
        const uint64_t first = base + static_cast<uint64_t>(s0);
        if (i + kAhead < i1)
          for (int64_t c = 0, ahead = (i + kAhead) * stride; c < cnt[i + kAhead]; ++c)
            __builtin_prefetch(word + node[ahead + c]);
        for (int64_t c = 0; c < cnt[i]; ++c) {
          const uint64_t w = __atomic_load_n(word + node[s0 + c], __ATOMIC_RELAXED);
          const int64_t won = static_cast<int64_t>(kLowMask - (w & kLowMask));
          winner[s0 + c] = won;
          wins += won == static_cast<int64_t>(first + c);
        }
      }
      chunk_new[k] = wins;
    });
    int64_t fresh = 0;
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t w = chunk_new[k];
      chunk_new[k] = fresh;
      fresh += w;
    }
    grow(hop.next, static_cast<size_t>(fresh));
    int64_t* const next = hop.next.data();

    // C: local ids of the new nodes, in slot order.
    pool.run(static_cast<size_t>(chunks), width, [&](size_t k, const std::atomic<bool>&) {
      const int64_t i0 = static_cast<int64_t>(k) * chunk, i1 = std::min(m, i0 + chunk);
      int64_t at = chunk_new[k], sink;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t s0 = i * stride;
        for (int64_t c = 0; c < cnt[i]; ++c) {  // branch-free: a winner or not is a coin toss
          const bool won = winner[s0 + c] == static_cast<int64_t>(base + static_cast<uint64_t>(s0 + c));
          local[s0 + c] = count + at;  // read for winners only
          *(won ? next + at : &sink) = node[s0 + c];
          at += won;
        }
      }
    });

    info.push_back(HopInfo{frontier, m, first_local, stride, chunk, chunks, base, count, fresh});
    base += static_cast<uint64_t>(m * stride);
    first_local = count;
    count += fresh;
    frontier = next;
    m = fresh;
  }

  // D: edges of every hop, written straight into the result.
  SampleResult result;
  int64_t total_edges = 0;
  std::vector<std::pair<size_t, int64_t>> tasks;  // (hop, chunk)
  for (size_t h = 0; h < info.size(); ++h) {
    int64_t* const chunk_edges = scratch.hops[h].chunk_edges.data();
    for (int64_t k = 0; k < info[h].chunks; ++k) {
      const int64_t c = chunk_edges[k];
      chunk_edges[k] = total_edges;
      total_edges += c;
      tasks.emplace_back(h, k);
    }
  }
  result.num_edges = total_edges;
  result.edge_index = Int64Array(2 * total_edges);
  result.n_id = Int64Array(count);
  int64_t* const src_out = result.edge_index.data.get();
  int64_t* const dst_out = src_out + total_edges;
  // claim index -> local id: claim table g holds claims [bases[g], bases[g + 1]); table 0: the seeds
  std::vector<uint64_t> bases{0};
  std::vector<const int64_t*> tables;
  grow(scratch.seed_local, static_cast<size_t>(num_seeds));
  for (int64_t t = 0; t < num_seeds; ++t) scratch.seed_local[static_cast<size_t>(t)] = t;
  tables.push_back(scratch.seed_local.data());
  for (size_t h = 0; h < info.size(); ++h) {
    bases.push_back(info[h].base);
    tables.push_back(scratch.hops[h].local.data());
  }
  pool.run(tasks.size(), width, [&](size_t t, const std::atomic<bool>&) {
    const size_t h = tasks[t].first;
    const int64_t k = tasks[t].second;
    const HopInfo& hi = info[h];
    const Scratch::Hop& hop = scratch.hops[h];
    const int64_t i0 = k * hi.chunk, i1 = std::min(hi.size, i0 + hi.chunk);
    int64_t at = hop.chunk_edges[static_cast<size_t>(k)];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s0 = i * hi.stride;
      const int64_t target = hi.first_local + i;
      for (int32_t c = 0; c < hop.count[static_cast<size_t>(i)]; ++c) {
        const uint64_t won = static_cast<uint64_t>(hop.winner[static_cast<size_t>(s0 + c)]);
        size_t g = 0;  // the table of the winning claim: the seeds', this hop's or an earlier one's
        for (size_t x = 1; x <= h + 1; ++x) g += won >= bases[x];
        src_out[at] = tables[g][won - bases[g]];
        dst_out[at] = target;
        ++at;
      }
    }
  });

  int64_t* const ids = result.n_id.data.get();
  if (num_seeds) std::memcpy(ids, seeds.data(), static_cast<size_t>(num_seeds) * sizeof(int64_t));
  for (size_t h = 0; h < info.size(); ++h)
    if (info[h].fresh)
      std::memcpy(ids + info[h].first_new, scratch.hops[h].next.data(),
                  static_cast<size_t>(info[h].fresh) * sizeof(int64_t));
  return result;
}

}  // namespace tfl
