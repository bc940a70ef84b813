#pragma once
// Which blocks of attention work exist: the one block rule of the attention op family
// (ops/context_parallel_attention.cpp). Plain C++ over positions; no tensors.
//
// The global row is a packed sequence of segments (one segment when nothing is packed): segment k
// covers positions [bounds[k], bounds[k + 1]) and no query attends to a key of another segment.
// A rank's tensor holds some of those positions as pieces (``Piece``): under context parallelism
// each segment is cut into 2·cp chunks and rank r holds chunks r and 2·cp−1−r of every segment, in
// segment order (Megatron's and TransformerEngine's load-balanced layout).
//
// ``plan`` turns a piece of queries and a piece of keys into blocks: rectangles of (query rows,
// key rows) with a mask kind, each tight (every query row sees a key of it, every key row is seen
// by a query row), so no block has a row without keys and a GPU kernel's bottom-right-aligned
// window can express its mask. Blocks outside the causal triangle or the window band are never
// made; a window is tiled in query tiles of about the window's size, so the work is O(s·w).
#include <cstdint>
#include <limits>
#include <vector>

namespace megatron_ext::attention {

// Rows [row, row + len) of a tensor hold positions [pos, pos + len) of segment ``segment``.
struct Piece {
  int64_t row, pos, len, segment;
};

// The packing of the global row over ``cp`` ranks.
struct Layout {
  std::vector<int64_t> bounds;  // segment k: positions [bounds[k], bounds[k + 1])
  int64_t cp = 1;
  // Each segment in 2·cp chunks (rank r: chunks r and 2·cp−1−r); else rank r holds positions
  // [r·s, (r + 1)·s) of the (one-segment) row, which only attention without a mask may use.
  bool chunked = false;

  int64_t total() const { return bounds.back(); }
  int64_t local() const { return total() / cp; }
  std::vector<Piece> rank_pieces(int64_t rank) const;
  // Each segment as one piece whose rows are its positions: the whole row in order.
  std::vector<Piece> whole() const;
  // For every row of the ranks' tensors laid one after another (rank-major), its position.
  std::vector<int64_t> positions_of_rank_rows() const;
};

// The mask of a block, in the block's own row i and key j: kNone every key; kCausal j <= i (the
// diagonal from the top left); kBand lo <= j − i <= hi.
enum class Mask { kNone, kCausal, kBand };

constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max() / 4;

struct Block {
  int64_t q_row, q_len, k_row, k_len;
  Mask mask;
  int64_t lo, hi;  // kBand's limits; -kUnbounded / kUnbounded where a side is open
};

// The blocks of the queries of ``q`` against the keys of ``k`` (none across segments). ``causal``:
// a key at position p is seen by queries at positions >= p; ``window`` > 0 (only with ``causal``):
// a query at position p sees keys at positions > p − window, itself included (0: no window).
void plan(const Piece& q, const Piece& k, bool causal, int64_t window, std::vector<Block>& out);

std::vector<Block> plan(const std::vector<Piece>& queries, const std::vector<Piece>& keys,
                        bool causal, int64_t window);

}  // namespace megatron_ext::attention
