// How much host memory a new allocation may take, so that a layer too large
// for the machine is refused with the sizes and the fix before it is
// allocated, not ended by std::bad_alloc or the kernel's OOM killer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moeforge {

// Bytes a new allocation can take now: the machine's available memory
// (/proc/meminfo's MemAvailable), or less under an address-space limit
// (RLIMIT_AS, less what the process maps already). SIZE_MAX where neither is
// known (no /proc).
size_t host_bytes_available();

// UserError when `bytes` of host memory for `what` ("the CPU backend's
// tensors of moe_mlp", "a host tensor of 200000 x 8 x 8192 values") exceed
// what is available, less a sixteenth of it (at least 512 MiB) kept free
// for the rest of the run: the message gives both sizes and says to lower
// the token count or the layer's sizes. Allocations under 64 MiB are not
// checked (reading the limits costs more than they risk).
void check_host_allocation(size_t bytes, const std::string &what);

// The same for an array of `shape`, each value `value_bytes`, named
// "<what> of A x B values<after>" (made only for the allocations checked).
void check_host_array(const std::vector<int64_t> &shape, size_t value_bytes, const std::string &what,
                      const std::string &after = "");

} // namespace moeforge
