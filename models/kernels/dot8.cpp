// dualserve::dot8_linear: y = x @ W^T with W in GGUF-style groups of 32 and x quantized per row
// to int8 groups of 32 (llama.cpp's Q8 activations). Every group's dot product is an exact
// integer sum (AVX512-VNNI vpdpbusd, AVX2 vpmaddubsw, or plain C), so all code paths give the
// same integers; the float epilogue runs in one fixed order per output, so a row's result is the
// same bits for any row count, thread count or CPU.
//
// Weight layout (built by models/kernels/layout.py):
//   tiles of 16 output channels; per tile, per group g, ``bits`` chunks of 64 bytes,
//   lane c (4 bytes) of a chunk belongs to channel c of the tile. Each input k holds
//   u = q + offset (unsigned; offset 128 for int8, 8 for 4 bits and 16 for 5 bits without a
//   minimum, 32 for 6 bits, else 0):
//     bits 4, 5, 6: chunk j < 4 holds k = 8j..8j+3 in the low nibbles and 8j+4..8j+7 in the high
//                   nibbles (u's low 4 bits); 5 and 6 bits add planes (chunks 4 and 5) of the
//                   high bits: nibble vector i = 2j + n (n = 0 low, 1 high nibbles of chunk j)
//                   at bits hb * (i % p) of plane i / p, hb = bits - 4, p = 8 / hb;
//     bits 8:       chunk j holds k = 4j..4j+3.
//   w = d * q, or w = d * q + m with a minimum.
//   d and m: fp16, [tile][group][16], or [tile][group / 8][16] where a super-block of 8 groups
//   shares them (the K-quants); m is empty without a minimum.
//   Optional integer multipliers (GGUF's K-quants and IQ4_XS, whose scales D * sc are not fp16
//   numbers): s int8 [tile][group][2][16], one for inputs 0..15 and one for 16..31 of the group,
//   or [tile][group][16], one for the group; with a minimum mn int8 [tile][group][16]; then
//   w = d * s_half * q + m * mn.
// Per output channel n and row r:  y = sum_g sx[r,g] * v[n,g], with
//   v = d * dot + m * asum                                     (no multipliers; m only with a minimum)
//   v = d * float(s_lo dot_lo + s_hi dot_hi) + m * float(mn * asum)  (multipliers)
// where dot = sum_k q[n,k] a[r,k] (over the half, for dot_lo and dot_hi), asum = sum_k a[r,k],
// a = round(x / sx); vector paths compute dot as sum u a - offset * asum.

#include <torch/library.h>
#include "c_shim.h"  // the packages' direct calls, at the end
#include "dot8.h"
#include <ATen/ops/empty.h>

#include <optional>
#include <string>
#include <vector>

namespace {

using namespace dualserve_dot8;

struct Path {
  const char* name;
  const TileFn* fn;  // by Kind
  int rows;
  Quantizer quantizer;  // how the path's activations are quantized
};

// DUALSERVE_DOT8_PATH=avx2 or scalar forces a narrower path than the CPU allows (tests run
// every path a CI host may take).
Path pick_path() {
  const char* want = std::getenv("DUALSERVE_DOT8_PATH");
  const std::string forced = want ? want : "";
  if (forced == "scalar") return {"scalar", scalar_tiles(), MAX_ROWS, Quantizer::SCALAR};
#ifdef DOT8_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool has_avx2 = avx2 && avx2_tiles();
  if (has_avx2 && forced == "avx2") return {"avx2", avx2_tiles(), AVX2_ROWS, Quantizer::AVX2};
  if (has_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni") && avx512_tiles())
    return {"avx512_vnni", avx512_tiles(), MAX_ROWS, Quantizer::AVX512};
  if (has_avx2) return {"avx2", avx2_tiles(), AVX2_ROWS, Quantizer::AVX2};
#endif
  return {"scalar", scalar_tiles(), MAX_ROWS, Quantizer::SCALAR};
}

// force_scalar: 0 the best path for the row count, 1 plain C, 2 the vector path without AMX, 3 AMX
// at every row count where the CPU has it (tests and benchmarks compare them).
Path& path(int64_t force_scalar) {
  static Path best = pick_path();
  static Path scalar = {"scalar", scalar_tiles(), MAX_ROWS, Quantizer::SCALAR};
  return force_scalar == 1 ? scalar : best;
}

// AMX_FROM: the fewest quantized rows (rows x digits) at which the AMX path ran faster than
// AVX-512 VNNI on a 2-core Intel Xeon (family 6 model 167; docs/kernels.md, Measurements).
// DUALSERVE_DOT8_AMX=0 turns it off, =N uses it from N rows.
constexpr int AMX_FROM = 9;

int pick_amx_from() {
#ifdef DOT8_X86
  if (std::string(path(0).name) != "avx512_vnni" || !amx_blocks() || !amx_permitted()) return 0;
  const char* want = std::getenv("DUALSERVE_DOT8_AMX");
  if (want && *want) return std::max(0, std::atoi(want));
  return AMX_FROM;
#else
  return 0;
#endif
}

// The fewest rows of a product that the AMX path takes (0: never).
int amx_from(int64_t force_scalar) {
  static const int from = pick_amx_from();
  if (force_scalar == 1 || force_scalar == 2) return 0;
  if (force_scalar == 3) {
#ifdef DOT8_X86
    static const bool ok = std::string(path(0).name) == "avx512_vnni" && amx_blocks() && amx_permitted();
    return ok ? 1 : 0;
#else
    return 0;
#endif
  }
  return from;
}

// ``halves``: the weight has multipliers per half group and an offset, so its dots need each half
// group's activation sum.
// Two digits that AMX will multiply also get their digits interleaved (Quantized::a64); for int4
// weights (``int4``) on AVX-512's vector path, blocked group-major for the folded kernel (Acts::blk).
Quantized quantize(const at::Tensor& x, int64_t force_scalar, int64_t digits, bool halves, bool int4 = false) {
  TORCH_CHECK(digits == 1 || digits == 2, "dot8: digits must be 1 or 2");
  const int64_t M = x.size(0), K = x.size(1);
  const Quantizer how = path(force_scalar).quantizer;
  const int from = amx_from(force_scalar);
  const bool interleave = digits == 2 && from && M * digits >= from;
  if (x.scalar_type() == at::kFloat)
    return Quantized(x.data_ptr<float>(), M, K, how, digits, halves, interleave, int4);
  return Quantized(x.data_ptr<c10::BFloat16>(), M, K, how, digits, halves, interleave, int4);
}

bool needs_halves(const Weights& w) { return w.s && w.s_per == 2 && offset_of(w.bits, w.minimum) != 0; }

// The layout's sizes decide d's grouping (per group or per 8) and the multipliers' (per half or per group).
Weights checked_weights(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t K, int64_t n,
                        int64_t bits, const char* what, const std::optional<at::Tensor>& s = std::nullopt,
                        const std::optional<at::Tensor>& mn = std::nullopt, bool minimum = false) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, what, ": bits must be 4, 5, 6 or 8");
  const int64_t G = K / GROUP, tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(q.numel() == tiles * G * bits * 64, what, ": the packed weight does not match the input width");
  const bool per_group = d.numel() == tiles * G * TILE;
  TORCH_CHECK(per_group || (G % 8 == 0 && d.numel() == tiles * (G / 8) * TILE), what,
              ": the scales must be fp16 [tile][group][16] or [tile][group / 8][16]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && (m.numel() == 0 || m.scalar_type() == at::kHalf), what,
              ": the scales and minimums must be fp16");
  minimum = minimum || (bits == 4 && m.numel() > 0);  // int4 with minimums given: Q4_1, Q4_K; without: Q4_0
  TORCH_CHECK(m.numel() == d.numel() || (!minimum && m.numel() == 0), what,
              ": the minimums must have the scales' layout (or be empty without a minimum)");
  TORCH_CHECK(!mn || (s && minimum), what, ": a minimum's multipliers need scale multipliers and a minimum");
  TORCH_CHECK(!s || !minimum || mn, what, ": a weight with a minimum and scale multipliers needs the minimum's");
  const int s_per = !s ? 0 : s->numel() == tiles * G * 2 * TILE ? 2 : 1;
  TORCH_CHECK(!s || (s->scalar_type() == at::kChar && s->numel() == tiles * G * s_per * TILE), what,
              ": the scale multipliers must be int8 [tile][group][2][16] or [tile][group][16]");
  TORCH_CHECK(!mn || (mn->scalar_type() == at::kChar && mn->numel() == tiles * G * TILE), what,
              ": the minimum's multipliers must be int8 [tile][group][16]");
  return Weights{q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
                 minimum ? reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()) : nullptr, G, int(bits), minimum,
                 s ? s->data_ptr<int8_t>() : nullptr, mn ? mn->data_ptr<int8_t>() : nullptr, s_per,
                 per_group ? 0 : 3};
}

// Tile t of y = the M quantized rows times w on the vector path, in blocks of the path's rows.
// AVX-512 folds int4's two digits into one accumulator a token (tile_avx512_folded): 16 rows a block;
// AVX2 unpacks an int4 group once for 16 rows (tile_avx2_int4).
inline void vector_tile(const Path& p, TileFn fn, const Weights& w, int64_t t, const Acts& acts, int64_t M,
                        int64_t n, float* y) {
  const int64_t block = w.bits != 4 ? p.rows
                       : p.quantizer == Quantizer::AVX512 ? (acts.fused ? 2 * p.rows : p.rows)
                       : p.quantizer == Quantizer::AVX2 ? AVX2_INT4_ROWS : p.rows;
  const int valid = int(std::min<int64_t>(TILE, n - t * TILE));
  for (int64_t r0 = 0; r0 < M; r0 += block) {
    const int rows = int(std::min<int64_t>(block, M - r0));
    fn(w, t, acts, r0, rows, y + (acts.fused ? r0 / 2 : r0) * n + t * TILE, n, valid);
  }
}

#ifdef DOT8_X86
// The calling thread's buffer for a tile's built B tiles (Amx in dot8_amx.h), at least ``bytes``, 64-byte
// aligned: kept from call to call and grown when a wider layer asks (a prompt's every GEMM, and the
// head at 16 streams, take one; allocating it each time cost a page fault where it took mmap).
int8_t* built_tiles(int64_t bytes) {
  struct Buffer {
    std::unique_ptr<int8_t[]> bytes;
    int64_t size = 0;
  };
  thread_local Buffer b;
  if (b.size < bytes + 64) {
    b.bytes.reset(new int8_t[bytes + 64]);
    b.size = bytes + 64;
  }
  return reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(b.bytes.get()) + 63) / 64 * 64);
}
#endif

// y = the M quantized rows times the packed weight: (M, n), or with two digits (fused) (M / 2, n),
// each output row from its pair of quantized rows.
void product(const Weights& w, const Acts& acts, int64_t M, int64_t n, float* y, int64_t force_scalar) {
  const Path& p = path(force_scalar);
  const TileFn fn = p.fn[kind_of(w)];
  const int64_t tiles = (n + TILE - 1) / TILE;
  // A small product (a LoRA factor, a draft head's layer) runs on the calling thread: waking the
  // other threads costs more than its work. Rows never depend on the thread that computes them.
  const int64_t grain = M * n * acts.K < (int64_t(1) << 18) ? tiles : 4;
#ifdef DOT8_X86
  const int from = amx_from(force_scalar);
  if (from && M >= from) {
    // Blocks of at most 16 rows, as even as they come; each thread configures its tiles for its
    // block's rows (the configuration is per thread) and releases them when done.
    // Folded (two digits, int4: dot8_amx.h), a block is up to 16 tokens of two quantized rows, and
    // its tiles are configured for the tokens.
    const BlockFn afn = amx_blocks()[kind_of(w)];
    const bool halves = w.s && w.s_per == 2, folded = acts.a64 && folds(w.bits, halves ? 2 : 0);
    const int64_t most = folded ? 2 * AMX_ROWS : AMX_ROWS, blocks = (M + most - 1) / most;
    const int64_t step = acts.fused ? ((M + blocks - 1) / blocks + 1) / 2 * 2 : (M + blocks - 1) / blocks;
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      int configured = 0;
      // With more than one block, a tile's B tiles are built once for all its blocks.
      int8_t* built = blocks > 1 ? built_tiles(w.G * AMX_BUILT_BYTES) : nullptr;
      for (int64_t t = begin; t < end; ++t) {
        const int valid = int(std::min<int64_t>(TILE, n - t * TILE));
        for (int64_t r0 = 0; r0 < M; r0 += step) {
          const int rows = int(std::min<int64_t>(step, M - r0));
          const int tile_rows = folded ? rows / 2 : rows;
          if (tile_rows != configured) amx_configure(configured = tile_rows, halves, folded);
          afn(w, t, acts, r0, rows, y + (acts.fused ? r0 / 2 : r0) * n + t * TILE, n, valid, built, built && r0 != 0);
        }
      }
      if (configured) amx_release();
    });
    return;
  }
#endif
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) vector_tile(p, fn, w, t, acts, M, n, y);
  });
}

// product(w, ...) into y and product(wa, ...) into ya in one pass over both weights' tiles, on the
// vector path: a LoRA's A (a few tiles) then shares the threads with its projection instead of
// running after it on one. Each tile is computed as product computes it, so the bits are the same.
// Where AMX would take either product, the two run apart (their tile configurations differ).
void product_pair(const Weights& w, int64_t n, float* y, const Weights& wa, int64_t na, float* ya,
                  const Acts& acts, int64_t M, int64_t force_scalar) {
#ifdef DOT8_X86
  const int from = amx_from(force_scalar);
  if (from && M >= from) {
    product(w, acts, M, n, y, force_scalar);
    product(wa, acts, M, na, ya, force_scalar);
    return;
  }
#endif
  const Path& p = path(force_scalar);
  const TileFn fn = p.fn[kind_of(w)], fa = p.fn[kind_of(wa)];
  const int64_t tiles = (n + TILE - 1) / TILE, tiles_a = (na + TILE - 1) / TILE;
  const int64_t grain = M * (n + na) * acts.K < (int64_t(1) << 18) ? tiles + tiles_a : 4;
  at::parallel_for(0, tiles + tiles_a, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i < tiles) vector_tile(p, fn, w, i, acts, M, n, y);
      else vector_tile(p, fa, wa, i - tiles, acts, M, na, ya);
    }
  });
}

void check_input(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, ": x must be a contiguous matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": x must be fp32 or bf16");
  TORCH_CHECK(x.size(1) % GROUP == 0, what, ": the input width must be a multiple of 32");
}

// s, mn: the optional multipliers; minimum: int8 weights with a minimum (int4 always has one).
at::Tensor dot8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                       int64_t n, int64_t bits, int64_t force_scalar, int64_t digits,
                       const std::optional<at::Tensor>& s, const std::optional<at::Tensor>& mn, bool minimum) {
  check_input(x, "dot8_linear");
  const int64_t M = x.size(0), K = x.size(1);
  const Weights w = checked_weights(q, d, m, K, n, bits, "dot8_linear", s, mn, minimum);
  at::Tensor out = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return out;
  const Quantized qx = quantize(x, force_scalar, digits, needs_halves(w), w.bits == 4);
  product(w, qx.acts(), M * digits, n, out.data_ptr<float>(), force_scalar);
  return out;
}

// y = W x + B (A x): a projection and its low-rank adapter (LoRA) in one call, the same bits as
// dot8_linear(x, W) + dot8_linear(dot8_linear(x, A), B): x is quantized once for W and A, the
// rank-wide A x (fp32) is quantized for B, and the two products are added in fp32 last. A and B
// hold plain 8-bit weights; W may be of any kind (s, mn, minimum as in dot8_linear). One call
// instead of two, and one quantization of x instead of two, per adapted projection: a twin forward
// makes 120 of them.
at::Tensor dot8_lora(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t n,
                     int64_t bits, const at::Tensor& qa, const at::Tensor& da, const at::Tensor& ma, int64_t rank,
                     const at::Tensor& qb, const at::Tensor& db, const at::Tensor& mb, int64_t force_scalar,
                     int64_t digits, const std::optional<at::Tensor>& s, const std::optional<at::Tensor>& mn,
                     bool minimum) {
  check_input(x, "dot8_lora");
  TORCH_CHECK(rank % GROUP == 0, "dot8_lora: the rank must be a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  const Weights w = checked_weights(q, d, m, K, n, bits, "dot8_lora", s, mn, minimum);
  const Weights wa = checked_weights(qa, da, ma, K, rank, 8, "dot8_lora (A)");
  const Weights wb = checked_weights(qb, db, mb, rank, n, 8, "dot8_lora (B)");
  at::Tensor out = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return out;
  const Quantized qx = quantize(x, force_scalar, digits, needs_halves(w), w.bits == 4);
  float* y = out.data_ptr<float>();
  std::unique_ptr<float[]> ax(new float[M * rank]), up(new float[M * n]);
  product_pair(w, n, y, wa, rank, ax.get(), qx.acts(), M * digits, force_scalar);
  const Quantized qa_x(ax.get(), M, rank, path(force_scalar).quantizer, digits);
  product(wb, qa_x.acts(), M * digits, n, up.get(), force_scalar);
  for (int64_t i = 0; i < M * n; ++i) y[i] += up[i];
  return out;
}

std::string dot8_path() { return path(0).name; }

int64_t dot8_amx_from() { return amx_from(0); }

}  // namespace

TORCH_LIBRARY(dualserve, lib) {
  lib.def("dot8_linear(Tensor x, Tensor q, Tensor d, Tensor m, int n, int bits, int force_scalar=0, int digits=1, "
          "Tensor? s=None, Tensor? mn=None, bool minimum=False) -> Tensor");
  lib.def("dot8_lora(Tensor x, Tensor q, Tensor d, Tensor m, int n, int bits, Tensor qa, Tensor da, Tensor ma, "
          "int rank, Tensor qb, Tensor db, Tensor mb, int force_scalar=0, int digits=1, Tensor? s=None, "
          "Tensor? mn=None, bool minimum=False) -> Tensor");
  lib.def("dot8_path() -> str", &dot8_path);
  lib.def("dot8_amx_from() -> int", &dot8_amx_from);
}

TORCH_LIBRARY_IMPL(dualserve, CPU, lib) {
  lib.impl("dot8_linear", dot8_linear);
  lib.impl("dot8_lora", dot8_lora);
}

// The packages' direct calls (c_shim.h).
using dualserve_shim::give;
using torch::aot_inductor::pointer_to_optional;  // Tensor? (null: None)
using dualserve_shim::tensor;

DUALSERVE_SHIM aoti_torch_cpu_dot8_linear(AtenTensorHandle x, AtenTensorHandle q, AtenTensorHandle d, AtenTensorHandle m,
                                          int64_t n, int64_t bits, int64_t force_scalar, int64_t digits,
                                          AtenTensorHandle* s, AtenTensorHandle* mn, int32_t minimum,
                                          AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    give(ret0, dot8_linear(tensor(x), tensor(q), tensor(d), tensor(m), n, bits, force_scalar, digits, pointer_to_optional<at::Tensor>(s),
                           pointer_to_optional<at::Tensor>(mn), minimum != 0));
  });
}

DUALSERVE_SHIM aoti_torch_cpu_dot8_lora(AtenTensorHandle x, AtenTensorHandle q, AtenTensorHandle d, AtenTensorHandle m,
                                        int64_t n, int64_t bits, AtenTensorHandle qa, AtenTensorHandle da,
                                        AtenTensorHandle ma, int64_t rank, AtenTensorHandle qb, AtenTensorHandle db,
                                        AtenTensorHandle mb, int64_t force_scalar, int64_t digits, AtenTensorHandle* s,
                                        AtenTensorHandle* mn, int32_t minimum, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    give(ret0, dot8_lora(tensor(x), tensor(q), tensor(d), tensor(m), n, bits, tensor(qa), tensor(da), tensor(ma), rank,
                         tensor(qb), tensor(db), tensor(mb), force_scalar, digits, pointer_to_optional<at::Tensor>(s), pointer_to_optional<at::Tensor>(mn),
                         minimum != 0));
  });
}
