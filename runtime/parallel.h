// Host loops over large tensors (random inputs, conversions to and from the
// device's storage types) split into contiguous chunks over every core: a
// real-size layer's weights are billions of elements, and one thread takes
// a minute over them. Each chunk's work must depend on its indices only, so
// the result does not depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace moeforge {

// Calls f(begin, end) over [0, n) in chunks, one thread per chunk; below
// `serial_below` elements (where starting threads costs more than it saves)
// on the calling thread alone.
template <typename F> void parallel_chunks(int64_t n, F &&f, int64_t serial_below = int64_t(1) << 20) {
  // A chunk is at least a quarter of serial_below items (one at least: the
  // decode of a matrix of rows over 2^20 elements asks for a serial_below
  // of 1, and a quotient of 0 divided by zero).
  const int64_t threads = n < serial_below ? 1
                                           : std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()),
                                                               n / std::max<int64_t>(1, serial_below / 4));
  if (threads <= 1) {
    f(int64_t(0), n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + threads - 1) / threads;
  for (int64_t t = 1; t < threads; ++t)
    pool.emplace_back([&, t] { f(std::min(n, t * chunk), std::min(n, (t + 1) * chunk)); });
  f(int64_t(0), std::min(n, chunk));
  for (std::thread &t : pool)
    t.join();
}

} // namespace moeforge
