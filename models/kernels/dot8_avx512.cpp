// dot8's tile functions of the AVX-512 VNNI path, one per weight kind (dot8.h).
#include "dot8.h"

namespace dualserve_dot8 {
#ifdef DOT8_X86
const TileFn* avx512_tiles() {
#ifdef DOT8_OMIT  // a CPU that cannot run this path: not built (kernels/__init__.py, _omitted)
  return nullptr;
#else
  static const Table<Avx512> table;
  return table.fn;
#endif
}
#endif
}  // namespace dualserve_dot8
