// dot8's tile functions of the AVX2 path, one per weight kind (dot8.h).
#include "dot8.h"

namespace dualserve_dot8 {
#ifdef DOT8_X86
const TileFn* avx2_tiles() { return path_table<Avx2>(); }
#endif
}  // namespace dualserve_dot8
