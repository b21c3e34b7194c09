// Pipelined quantized all-reduce over a PeerGroup (between hosts): pieces quantized, sent,
// decoded and summed, re-quantized and sent back while the next ones travel.
#include "quantized_direct.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "transfers.h"

namespace braid {

void pipelined_quantized_all_reduce(const PeerGroup& g, const PipelinedQuantizeArgs& a) {
  const int n = g.size(), me = g.me;
  const QuantFormat fmt = a.fmt;
  const size_t es = dtype_size(a.dtype);
  const size_t pieces = std::max<size_t>(1, (a.chunk + a.piece - 1) / a.piece);
  auto piece_len = [&](size_t p) { return std::min(a.piece, a.chunk - std::min(a.chunk, p * a.piece)); };
  // Bytes of every piece in a part's layout: piece p at offset p * fmt.bytes(piece) (the last
  // one shorter).
  const size_t pb = fmt.bytes(a.piece);
  const size_t part_bytes = (pieces - 1) * pb + fmt.bytes(piece_len(pieces - 1));
  auto piece_off = [&](size_t p) { return p * pb; };
  // Scratch: my quantized input of every part (n parts), the members' pieces of my part (n),
  // the re-quantized parts of every owner (n), the sum of one piece.
  const size_t region = static_cast<size_t>(n) * part_bytes;
  const size_t acc_bytes = a.piece * sizeof(float);
  char* base = g.scratch->get(0, 3 * region + acc_bytes + 64);
  uint8_t* mine = reinterpret_cast<uint8_t*>(base);                // [part m] my input, quantized
  uint8_t* theirs = reinterpret_cast<uint8_t*>(base + region);     // [member m] m's piece of my part
  uint8_t* results = reinterpret_cast<uint8_t*>(base + 2 * region);  // [part m] owner m's result
  float* acc = reinterpret_cast<float*>(base + 3 * region);
  auto at = [&](uint8_t* r, int m, size_t p) { return r + static_cast<size_t>(m) * part_bytes + piece_off(p); };
  const char* in = static_cast<const char*>(a.in);
  char* out = static_cast<char*>(a.out);
  auto valid = [&](int m, size_t p) {  // elements of (part m, piece p) below count
    const size_t first = static_cast<size_t>(m) * a.chunk + p * a.piece;
    return a.count > first ? std::min(piece_len(p), a.count - first) : size_t{0};
  };
  auto quantize_input = [&](int m, size_t p) {
    const size_t first = static_cast<size_t>(m) * a.chunk + p * a.piece, v = valid(m, p);
    quantize(fmt, a.dtype, v > 0 ? in + first * es : nullptr, v > 0 && a.residual ? a.residual + first : nullptr, v,
             piece_len(p), 1, a.stochastic, a.seed, first, at(mine, m, p));
  };
  auto decode = [&](int m, size_t p) {  // owner m's result piece into out
    const size_t v = valid(m, p);
    if (v > 0)
      dequantize(fmt, at(results, m, p), v, piece_len(p), a.dtype,
                 out + (static_cast<size_t>(m) * a.chunk + p * a.piece) * es);
  };

  Transfers t(g);
  // Receives first: the owners' pieces of my part, then each owner's results (lanes keep issue
  // order). Then my input of the others' parts, piece by piece, each quantized just before it is
  // handed over while the earlier ones travel.
  std::vector<std::vector<P2POp*>> incoming(static_cast<size_t>(n));
  std::vector<std::vector<P2POp*>> returning(static_cast<size_t>(n));
  for (int m = 0; m < n; ++m) {
    if (m == me) continue;
    for (size_t p = 0; p < pieces; ++p)
      incoming[static_cast<size_t>(m)].push_back(&t.add(m, false, at(theirs, m, p), fmt.bytes(piece_len(p))));
    for (size_t p = 0; p < pieces; ++p)
      returning[static_cast<size_t>(m)].push_back(&t.add(m, false, at(results, m, p), fmt.bytes(piece_len(p))));
  }
  for (size_t p = 0; p < pieces; ++p) {
    for (int m = 0; m < n; ++m) {
      if (m == me) continue;
      quantize_input(m, p);
      t.add(m, true, at(mine, m, p), fmt.bytes(piece_len(p)));
    }
    t.step(false);
  }
  for (size_t p = 0; p < pieces; ++p) {  // my own part: quantized as everyone's
    quantize_input(me, p);
    t.step(false);
  }
  size_t reduced = 0;
  std::vector<size_t> decoded(static_cast<size_t>(n), 0);
  auto progress = [&] {
    // Reduce my part's pieces as every member's copy arrives, in member order; send each on.
    for (; reduced < pieces; ++reduced) {
      for (int m = 0; m < n; ++m)
        if (m != me && !incoming[static_cast<size_t>(m)][reduced]->done) goto decode_arrived;
      {
        const size_t len = piece_len(reduced);
        std::fill(acc, acc + len, 0.0f);
        for (int m = 0; m < n; ++m)
          dequantize_accumulate(fmt, m == me ? at(mine, me, reduced) : at(theirs, m, reduced), len, acc);
        if (a.average && a.divisor > 1) {
          const float d = static_cast<float>(a.divisor);
          for (size_t i = 0; i < len; ++i) acc[i] /= d;
        }
        const size_t first = static_cast<size_t>(me) * a.chunk + reduced * a.piece;
        quantize(fmt, DType::kFloat32, acc, nullptr, len, len, 1, a.stochastic, a.requant_seed, first,
                 at(results, me, reduced));
        for (int m = 0; m < n; ++m)
          if (m != me) t.add(m, true, at(results, me, reduced), fmt.bytes(len));
        decode(me, reduced);
      }
    }
  decode_arrived:
    for (int m = 0; m < n; ++m) {
      if (m == me) continue;
      size_t& d = decoded[static_cast<size_t>(m)];
      for (; d < pieces && returning[static_cast<size_t>(m)][d]->done; ++d) decode(m, d);
    }
  };
  for (;;) {
    progress();
    if (!t.step() && reduced == pieces) break;
  }
  progress();
}

}  // namespace braid
