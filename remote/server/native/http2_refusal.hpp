// Just enough HTTP/2 to refuse a gRPC call with a message a person can act
// on (remote/proto/http2.py does the same for the Python server): a
// protocol v1 client spoke gRPC to this board's port.
#pragma once

#include <string>

namespace tether {

// Answers each call on the connection with FAILED_PRECONDITION and `message`;
// `seen` holds the bytes already read from it.
void refuse_grpc(int fd, std::string seen, const std::string& message);

}  // namespace tether
