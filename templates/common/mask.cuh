// Which keys each query sees: the one place every family asks, per element ("is key n visible to
// query m?") and per tile ("which keys can these queries see, which queries these keys, and is this
// tile cut by the mask?"). The band is bottom-right aligned: query m's diagonal key is
// m + seqlen_k - seqlen_q, and it sees keys [diagonal - window_left, diagonal + window_right]
// (causal: window_right = 0, window_left unbounded), a negative bound meaning none. Keys past
// seqlen_k are never visible. Block masks and user modifiers: common/modifiers.cuh.
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
  // The sequence's extents and which edges the band has; the window's bounds themselves are read from
  // the kernel's parameters (`p`, in the constant bank) where they are used. Copies of the bounds in
  // the object stayed live in registers across the key loops (fa2_fwd d128 window spilled 128
  // bytes), and an object holding the parameters' address put them on the stack.
  int seqlen_q, seqlen_k;
  int diagonal;     // seqlen_k - seqlen_q
  bool right_bounded;  // window_right >= 0 (causal: 0)
  bool left_bounded;   // window_left >= 0

  __device__ __forceinline__ AttentionMask(const AttentionFwdParams& p, int seqlen_q_, int seqlen_k_)
      : seqlen_q(seqlen_q_), seqlen_k(seqlen_k_), diagonal(seqlen_k_ - seqlen_q_),
        right_bounded(p.window_right >= 0), left_bounded(p.window_left >= 0) {}

  // Whether the band has a right (causal or window) or left (window) edge: the mask kind decides at
  // compile time where it can.
  __device__ __forceinline__ bool has_right() const { return kMask != MaskKind::kNone && right_bounded; }
  __device__ __forceinline__ bool has_left() const { return kMask == MaskKind::kWindow && left_bounded; }

  __device__ __forceinline__ bool visible(const AttentionFwdParams& p, int query, int key) const {
    return visible(p, query, key, seqlen_k, diagonal);
  }
  // The same over plain values, as the backward families' element loops call it.
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
  __device__ __forceinline__ KeyRange keys_of(const AttentionFwdParams& p, int m0, int rows) const {
    KeyRange r{0, seqlen_k};
    if (has_right()) r.end = min(r.end, m0 + rows - 1 + diagonal + p.window_right + 1);
    if (has_left()) r.begin = max(0, m0 + diagonal - p.window_left);
    return r;
  }

  // The queries that see any of keys [n0, n0 + cols) (the backward's walk over a key tile).
  __device__ __forceinline__ KeyRange queries_of(const AttentionFwdParams& p, int n0, int cols) const {
    return {has_right() ? max(0, n0 - diagonal - p.window_right) : 0,
            has_left() ? min(seqlen_q, n0 + cols - 1 - diagonal + p.window_left + 1) : seqlen_q};
  }

  // Whether the tile of queries [m0, m0 + rows) and keys [n0, n0 + cols) has hidden elements where
  // it may have visible ones: past the last key, or cut by the band. Only such tiles need the
  // element mask (tiles wholly outside the band are skipped by the ranges above).
  // (The edges are tested on `p` here, not through the object's flags: with the flags ptxas
  // scheduled sm90_fwd's step differently, and its d256 causal rows ran 1-2% slower on the H200.)
  __device__ __forceinline__ bool cuts(const AttentionFwdParams& p, int m0, int rows, int n0, int cols) const {
    return n0 + cols > seqlen_k ||
           (kMask != MaskKind::kNone && p.window_right >= 0 && n0 + cols - 1 > m0 + diagonal + p.window_right) ||
           (kMask == MaskKind::kWindow && p.window_left >= 0 && n0 < m0 + rows - 1 + diagonal - p.window_left);
  }
  // The element mask of a forward family's score tile (mma.sync C layout: Shape::kMFrags m16 tiles of
  // rows from thread_row0, kSFrags n8 tiles of keys from n0): hidden scores become -inf. Only for
  // tiles the mask cuts. Written out rather than through visible(): as a call, ptxas branched around
  // each element (+512 BRA at sm90_fwd d128 causal, 4-13% slower causal rows on the H200; fa2_fwd
  // d128 window spilled 128 bytes).
  template <class Shape>
  __device__ __forceinline__ void mask_tile(float (&s)[Shape::kMFrags][Shape::kSFrags][4], const AttentionFwdParams& p,
                                            int thread_row0, int n0, int lane) const {
    if constexpr (Shape::kMFrags == 1 && kMask != MaskKind::kNone) {
      // Two rows a thread (sm90_fwd's warpgroups) under a band: each row first gets its visible keys
      // as one range, counted from the thread's first column, so that an element costs a compare with
      // a constant per edge and a select. (Compared one by one, the key bound and the right edge cost
      // two compares and a column add more: a third of sm90_fwd's instructions at S = 512 causal went
      // to masks.)
      const int col0 = n0 + (lane % 4) * 2;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = thread_row0 + half * 8;
        int end = seqlen_k - col0, begin = -col0;  // visible: columns [col0 + begin, col0 + end)
        if (p.window_right >= 0) end = min(end, row + diagonal + p.window_right + 1 - col0);
        if constexpr (kMask == MaskKind::kWindow)
          if (p.window_left >= 0) begin = row + diagonal - p.window_left - col0;
#pragma unroll
        for (int ni = 0; ni < Shape::kSFrags; ++ni)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int key = ni * 8 + c;  // the column's offset from col0
            bool visible = key < end;
            if constexpr (kMask == MaskKind::kWindow) visible = visible && key >= begin;
            if (!visible) s[0][ni][2 * half + c] = -positive_infinity();
          }
      }
    } else {
      // Element by element: without a band (only the last key tile is cut, and the range cost FP8's
      // d128 m192n96 tile, at 128 registers, a spill), and with more rows a thread (fa2_fwd's taller
      // warp tiles: a range per row spilled its d128 m128n64 tiles, at 255 registers).
      const int seqlen_k = this->seqlen_k, diagonal = this->diagonal;
#pragma unroll
      for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
        for (int ni = 0; ni < Shape::kSFrags; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = thread_row0 + mi * 16 + (e / 2) * 8;
            const int col = n0 + ni * 8 + (lane % 4) * 2 + e % 2;
            bool visible = col < seqlen_k;
            if constexpr (kMask != MaskKind::kNone) {
              if (p.window_right >= 0) visible = visible && col <= row + diagonal + p.window_right;
              if (kMask == MaskKind::kWindow && p.window_left >= 0)
                visible = visible && col >= row + diagonal - p.window_left;
            }
            if (!visible) s[mi][ni][e] = -positive_infinity();
          }
    }
  }

  __device__ __forceinline__ TileVisibility tile(const AttentionFwdParams& p, int m0, int rows, int n0, int cols) const {
    const KeyRange keys = keys_of(p, m0, rows);
    if (n0 >= keys.end || n0 + cols <= keys.begin) return TileVisibility::kEmpty;
    return cuts(p, m0, rows, n0, cols) ? TileVisibility::kPartial : TileVisibility::kFull;
  }
};

}  // namespace flashjit::kernels
