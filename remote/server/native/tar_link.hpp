// Linking a module .tar (object files, docs/module-abi.md "Object tar") with
// the board's own C compiler.
#pragma once

#include <cstdint>
#include <string>

#include "workspace.hpp"

namespace tether {

// Unpacks the .o members of `tar_path` (uncompressed, at most `max_bytes` in
// all) inside the workspace and links them with `cc -shared`; returns the
// path of the linked .so, or "" with *error set.
std::string link_module_tar(const std::string& tar_path, const std::string& name,
                            const Workspace& workspace, const std::string& cc, int64_t max_bytes,
                            std::string* error);

}  // namespace tether
