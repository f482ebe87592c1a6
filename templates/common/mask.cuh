// Which keys each query sees: the one place every family asks, per element ("is key n visible to
// query m?") and per tile ("which keys can these queries see, which queries these keys, and is this
// tile cut by the mask?"). The band is bottom-right aligned: query m's diagonal key is
// m + seqlen_k - seqlen_q, and it sees keys [diagonal - window_left, diagonal + window_right]
// (causal: window_right = 0, window_left unbounded), a negative bound meaning none. Keys past
// seqlen_k are never visible. Block-sparse masks and user modifiers plug in here.
#pragma once

#include "common/types.cuh"

namespace flashjit::kernels {

// Half-open ranges of keys or queries.
struct KeyRange {
  int begin, end;
};

enum class TileVisibility { kEmpty, kPartial, kFull };

template <MaskKind kMask>
struct AttentionMask {
  const AttentionFwdParams& p;  // window_left and window_right, read where they are used
  int seqlen_q, seqlen_k;       // this sequence's
  int diagonal;                 // seqlen_k - seqlen_q

  __device__ __forceinline__ AttentionMask(const AttentionFwdParams& params, int seqlen_q_, int seqlen_k_)
      : p(params), seqlen_q(seqlen_q_), seqlen_k(seqlen_k_), diagonal(seqlen_k_ - seqlen_q_) {}

  // Whether the band has a right (causal or window) or left (window) edge.
  __device__ __forceinline__ bool has_right() const { return kMask != MaskKind::kNone && p.window_right >= 0; }
  __device__ __forceinline__ bool has_left() const { return kMask == MaskKind::kWindow && p.window_left >= 0; }

  __device__ __forceinline__ bool visible(int query, int key) const {
    return visible(p, query, key, seqlen_k, diagonal);
  }
  // The same from plain values, for the element loops of the hot kernels: there, reading the bounds
  // through the object made ptxas branch around each element (+512 BRA at sm90_fwd d128 causal, 4-13%
  // slower causal rows on the H200) where these values keep it to predicated selects.
  static __device__ __forceinline__ bool visible(const AttentionFwdParams& p, int query, int key, int seqlen_k,
                                                 int diagonal) {
    bool visible = key < seqlen_k;
    if constexpr (kMask != MaskKind::kNone) {
      if (p.window_right >= 0) visible = visible && key <= query + diagonal + p.window_right;
      if (kMask == MaskKind::kWindow && p.window_left >= 0) visible = visible && key >= query + diagonal - p.window_left;
    }
    return visible;
  }

  // The keys any of queries [m0, m0 + rows) sees (empty: end <= begin).
  __device__ __forceinline__ KeyRange keys_of(int m0, int rows) const {
    KeyRange r{0, seqlen_k};
    if (has_right()) r.end = min(r.end, m0 + rows - 1 + diagonal + p.window_right + 1);
    if (has_left()) r.begin = max(0, m0 + diagonal - p.window_left);
    return r;
  }

  // The queries that see any of keys [n0, n0 + cols) (the backward's walk over a key tile).
  __device__ __forceinline__ KeyRange queries_of(int n0, int cols) const {
    return {has_right() ? max(0, n0 - diagonal - p.window_right) : 0,
            has_left() ? min(seqlen_q, n0 + cols - 1 - diagonal + p.window_left + 1) : seqlen_q};
  }

  // Whether the tile of queries [m0, m0 + rows) and keys [n0, n0 + cols) has hidden elements where
  // it may have visible ones: past the last key, or cut by the band. Only such tiles need the
  // element mask (tiles wholly outside the band are skipped by the ranges above).
  __device__ __forceinline__ bool cuts(int m0, int rows, int n0, int cols) const {
    return n0 + cols > seqlen_k || (has_right() && n0 + cols - 1 > m0 + diagonal + p.window_right) ||
           (has_left() && n0 < m0 + rows - 1 + diagonal - p.window_left);
  }

  __device__ __forceinline__ TileVisibility tile(int m0, int rows, int n0, int cols) const {
    const KeyRange keys = keys_of(m0, rows);
    if (n0 >= min(keys.end, seqlen_k) || n0 + cols <= keys.begin) return TileVisibility::kEmpty;
    return cuts(m0, rows, n0, cols) ? TileVisibility::kPartial : TileVisibility::kFull;
  }
};

}  // namespace flashjit::kernels
