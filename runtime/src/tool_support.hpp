// The one internal header of the tools (flashjit-warm, flashjit-tune, flashjit-bench): what they need
// beyond the public API, which stays free of it.
//   dispatch.hpp     problems (make_forward_problem, PassProblem), what dispatch runs for one
//                    (select_kernel) and what the tuner times for it (tuning_plan)
//   host_tensors.hpp their own test tensors: DeviceMemory, 16-bit floats and e4m3 as bits, random inputs;
//                    the driver door (driver(), FLASHJIT_CU) for events and copies
//   files.hpp        bounded reads of input files (a FIFO or /dev/zero is refused unread)
//   json_text.hpp    JSON input whose errors name the line and column
//   module_cache.hpp make_context_current
#pragma once

#include "dispatch.hpp"
#include "files.hpp"
#include "host_tensors.hpp"
#include "json_text.hpp"
#include "module_cache.hpp"
