// dot8's shared declarations: the layout, tile functions and activation quantizer (the four
// headers below), and the tables of tile functions by weight kind, one per code path. Each path's
// table is instantiated in its own source (dot8_scalar.cpp, dot8_avx512.cpp, dot8_avx2.cpp,
// dot8_amx.cpp) so that a first start's compilers build them side by side; dot8.cpp picks a path
// and runs the products. Everything here is in one named namespace, so every source sees the
// same types and the same inline functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define DOT8_X86 1
#endif
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace dualserve_dot8 {

#include "dot8_tiles.h"
#include "dot8_tiles56.h"
#include "dot8_acts.h"
#include "dot8_amx.h"

// Each path's tile function by kind (kind_of), built once on first use; null where the library was
// built without the path, for a CPU that cannot run it (compiled with DOT8_OMIT:
// kernels/__init__.py, _omitted). Each path's source defines its accessor by path_table.
template <template <int, bool, int> class P, typename Fn = TileFn>
const Fn* path_table() {
#ifdef DOT8_OMIT
  return nullptr;
#else
  static const Table<P, Fn> table;
  return table.fn;
#endif
}

const TileFn* scalar_tiles();
#ifdef DOT8_X86
const TileFn* avx512_tiles();
const TileFn* avx2_tiles();
const BlockFn* amx_blocks();
#endif

}  // namespace dualserve_dot8
