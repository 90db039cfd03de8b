// What this board is: triple, CPU, memory, OS (remote/server/devinfo.py).
#pragma once

#include "wire.hpp"

namespace tether {

constexpr const char* kServerVersion = "0.1.0";

DeviceInfo collect_device_info(const StringPairs& attributes);

}  // namespace tether
