#include "ops/attention_plan.h"

#include <algorithm>

namespace megatron_ext::attention {
namespace {

// Query tiles of a window: about half the window, so that most of a tile's keys form one unmasked
// block between two masked edges of a tile's size; at least kMinTile rows (tiny windows would
// cost a kernel call per few rows), at most kMaxTile (the edges' masks stay small).
constexpr int64_t kMinTile = 16;
constexpr int64_t kMaxTile = 256;

// Appends the block of rows [r0, r1) against keys [c0, c1) (both relative to the pieces), where a
// row i sees keys j with lo <= j − i <= hi, after tightening it to the rows that see a key of it
// and the keys some row sees; nothing if none do.
void add_tight(const Piece& q, const Piece& k, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
               int64_t lo, int64_t hi, std::vector<Block>& out) {
  if (c0 >= c1) return;
  r0 = std::max(r0, c0 - hi);
  r1 = std::min(r1, c1 - lo);
  if (r0 >= r1) return;
  c0 = std::max(c0, r0 + lo);
  c1 = std::min(c1, r1 + hi);
  const int64_t lq = r1 - r0, lk = c1 - c0;
  // The limits in the block's own rows and keys.
  const int64_t blo = lo - (c0 - r0), bhi = hi - (c0 - r0);
  Mask mask = Mask::kBand;
  if (blo <= -(lq - 1) && bhi >= lk - 1) {
    mask = Mask::kNone;
  } else if (blo <= -(lq - 1) && bhi == 0) {
    mask = Mask::kCausal;
  }
  out.push_back({q.row + r0, lq, k.row + c0, lk, mask, std::max(blo, -kUnbounded),
                 std::min(bhi, kUnbounded)});
}

}  // namespace

std::vector<Piece> Layout::rank_pieces(int64_t rank) const {
  std::vector<Piece> pieces;
  if (!chunked) {
    const int64_t s = local();
    pieces.push_back({0, rank * s, s, 0});
    return pieces;
  }
  int64_t row = 0;
  for (size_t seg = 0; seg + 1 < bounds.size(); ++seg) {
    const int64_t start = bounds[seg], c = (bounds[seg + 1] - start) / (2 * cp);
    for (const int64_t chunk : {rank, 2 * cp - 1 - rank}) {
      pieces.push_back({row, start + chunk * c, c, static_cast<int64_t>(seg)});
      row += c;
    }
  }
  return pieces;
}

std::vector<Piece> Layout::whole() const {
  std::vector<Piece> pieces;
  for (size_t seg = 0; seg + 1 < bounds.size(); ++seg) {
    pieces.push_back(
        {bounds[seg], bounds[seg], bounds[seg + 1] - bounds[seg], static_cast<int64_t>(seg)});
  }
  return pieces;
}

std::vector<int64_t> Layout::positions_of_rank_rows() const {
  std::vector<int64_t> positions(static_cast<size_t>(total()));
  const int64_t s = local();
  for (int64_t r = 0; r < cp; ++r) {
    for (const Piece& p : rank_pieces(r)) {
      for (int64_t t = 0; t < p.len; ++t)
        positions[static_cast<size_t>(r * s + p.row + t)] = p.pos + t;
    }
  }
  return positions;
}

void plan(const Piece& q, const Piece& k, bool causal, int64_t window, std::vector<Block>& out) {
  if (q.segment != k.segment || q.len == 0 || k.len == 0) return;
  if (!causal) {
    out.push_back({q.row, q.len, k.row, k.len, Mask::kNone, -kUnbounded, kUnbounded});
    return;
  }
  // Row i (position q.pos + i) sees key j (position k.pos + j) iff lo <= j − i <= hi.
  const int64_t hi = q.pos - k.pos;
  int64_t lo = -kUnbounded;
  // The window binds only if some query is at least ``window`` positions after some key.
  if (window > 0 && q.pos + q.len - 1 - k.pos >= window) lo = hi - (window - 1);
  const int64_t tile =
      lo == -kUnbounded ? q.len : std::clamp<int64_t>(window / 2, kMinTile, kMaxTile);
  for (int64_t i0 = 0; i0 < q.len; i0 += tile) {
    const int64_t i1 = std::min(q.len, i0 + tile);
    // The keys some row of the tile sees, and those every row sees.
    const int64_t u0 = std::max<int64_t>(0, i0 + lo), u1 = std::min(k.len, i1 + hi);
    if (u0 >= u1) continue;
    const int64_t f0 = std::max(u0, i1 - 1 + lo), f1 = std::min(u1, i0 + hi + 1);
    if (f1 - f0 >= i1 - i0) {
      // Masked edges around an unmasked middle of at least a tile's width.
      add_tight(q, k, i0, i1, u0, f0, lo, hi, out);
      out.push_back(
          {q.row + i0, i1 - i0, k.row + f0, f1 - f0, Mask::kNone, -kUnbounded, kUnbounded});
      add_tight(q, k, i0, i1, f1, u1, lo, hi, out);
    } else {
      add_tight(q, k, i0, i1, u0, u1, lo, hi, out);
    }
  }
}

std::vector<Block> plan(const std::vector<Piece>& queries, const std::vector<Piece>& keys,
                        bool causal, int64_t window) {
  std::vector<Block> blocks;
  // Queries against their own rows without a window (a rank's own chunks): where a segment's
  // pieces are adjacent rows of increasing positions, a key row is before a query row exactly when
  // its position is, so the segment is one causal block over its rows (not one block per pair of
  // pieces: fewer kernel calls and merges, the same work).
  const bool own_rows =
      causal && window == 0 && queries.size() == keys.size() &&
      std::equal(queries.begin(), queries.end(), keys.begin(), [](const Piece& a, const Piece& b) {
        return a.row == b.row && a.pos == b.pos && a.len == b.len && a.segment == b.segment;
      });
  for (size_t i = 0; i < queries.size();) {
    size_t end = i + 1;
    while (own_rows && end < queries.size() && queries[end].segment == queries[i].segment &&
           queries[end].row == queries[end - 1].row + queries[end - 1].len &&
           queries[end].pos >= queries[end - 1].pos + queries[end - 1].len) {
      ++end;
    }
    if (end > i + 1) {
      const int64_t rows = queries[end - 1].row + queries[end - 1].len - queries[i].row;
      blocks.push_back({queries[i].row, rows, queries[i].row, rows, Mask::kCausal, -kUnbounded, 0});
    } else {
      for (const Piece& k : keys) plan(queries[i], k, causal, window, blocks);
    }
    i = end;
  }
  return blocks;
}

}  // namespace megatron_ext::attention
