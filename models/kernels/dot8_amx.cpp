// dot8's block functions of the Intel AMX path (from a few rows, where the CPU has tiles), one per
// weight kind (dot8.h).
#include "dot8.h"

namespace dualserve_dot8 {
#ifdef DOT8_X86
const BlockFn* amx_blocks() {
#ifdef DOT8_OMIT  // a CPU that cannot run this path: not built (kernels/__init__.py, _omitted)
  return nullptr;
#else
  static const Table<Amx, BlockFn> table;
  return table.fn;
#endif
}
#endif
}  // namespace dualserve_dot8
