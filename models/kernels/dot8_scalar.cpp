// dot8's tile functions of the plain C reference path (every CPU), one per weight kind (dot8.h).
#include "dot8.h"

namespace dualserve_dot8 {
const TileFn* scalar_tiles() { return path_table<Scalar>(); }
}  // namespace dualserve_dot8
