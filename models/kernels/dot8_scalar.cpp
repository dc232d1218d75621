// dot8's tile functions of the plain C reference path (every CPU), one per weight kind (dot8.h).
#include "dot8.h"

namespace dualserve_dot8 {
const TileFn* scalar_tiles() {
  static const Table<Scalar> table;
  return table.fn;
}
}  // namespace dualserve_dot8
