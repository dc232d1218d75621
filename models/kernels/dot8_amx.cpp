// dot8's block functions of the Intel AMX path (from a few rows, where the CPU has tiles), one per
// weight kind (dot8.h).
#include "dot8.h"

namespace dualserve_dot8 {
#ifdef DOT8_X86
const BlockFn* amx_blocks() { return path_table<Amx, BlockFn>(); }
#endif
}  // namespace dualserve_dot8
