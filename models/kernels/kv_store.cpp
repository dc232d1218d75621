// dualserve::store_kv(pool, slots, k, v): a step's new keys and values into the KV pool, in one pass.
//
//   pool (2 L, S, H, D): every layer's keys, then every layer's values (KVCache.stacked, a strided
//   view of the pool's buffer whose slot rows of H x D values are contiguous); slots (T,) long;
//   k and v (L, T, H, D) in the pool's dtype.
//
//   pool[l][slots[t]] = k[l][t],  pool[L + l][slots[t]] = v[l][t]
//
// A copy, no arithmetic: the values index_copy_ writes, without its concatenated temporary or
// its per-element iterator (a decode step's 60 x 16 rows of 384 bytes: 12 us against 63, ad-hoc
// probe, docs/kernels.md). A slot that appears twice in one call (the scratch block's, whose values are
// never read) ends with its last token's row, layer by layer alike.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace {

// The bytes below which the copy stays on the calling thread (a decode step's few hundred
// kilobytes cost less than waking the team); above, each pool layer is a task.
constexpr int64_t SERIAL_BYTES = int64_t(1) << 20;

void store_kv(const at::Tensor& pool, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(pool.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "store_kv: pool (2L, S, H, D), k and v (L, T, H, D)");
  TORCH_CHECK(pool.size(0) == 2 * k.size(0) && pool.size(2) == k.size(2) && pool.size(3) == k.size(3),
              "store_kv: the pool must hold 2 L layers of k's heads and head size");
  TORCH_CHECK(pool.scalar_type() == k.scalar_type() && v.scalar_type() == k.scalar_type(),
              "store_kv: k and v must be in the pool's dtype");
  TORCH_CHECK(pool.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && slots.device().is_cpu(),
              "store_kv: CPU tensors only");
  TORCH_CHECK(pool.stride(3) == 1 && pool.stride(2) == pool.size(3), "store_kv: a slot's H x D values must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(1),
              "store_kv: slots must be (T,) long");
  const int64_t L = k.size(0), T = k.size(1), S = pool.size(1);
  const at::Tensor kc = k.contiguous(), vc = v.contiguous(), sc = slots.contiguous();
  const int64_t* slot = sc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < S, "store_kv: slot ", slot[t], " out of range");
  const int64_t item = pool.element_size(), row = pool.size(2) * pool.size(3) * item;
  char* base = static_cast<char*>(pool.data_ptr());
  const int64_t layer_stride = pool.stride(0) * item, slot_stride = pool.stride(1) * item;
  const char* src[2] = {static_cast<const char*>(kc.data_ptr()), static_cast<const char*>(vc.data_ptr())};
  const auto copy = [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {  // p: a pool layer (keys of layer p, or values of p - L)
      const char* from = src[p / L] + (p % L) * T * row;
      char* to = base + p * layer_stride;
      for (int64_t t = 0; t < T; ++t) std::memcpy(to + slot[t] * slot_stride, from + t * row, size_t(row));
    }
  };
  if (2 * L * T * row < SERIAL_BYTES)
    copy(0, 2 * L);
  else
    at::parallel_for(0, 2 * L, 1, copy);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dualserve, lib) {
  lib.def("store_kv(Tensor(a!) pool, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(dualserve, CPU, lib) { lib.impl("store_kv", store_kv); }
