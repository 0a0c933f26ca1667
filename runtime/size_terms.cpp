#include "runtime/size_terms.h"

namespace moeforge {

int64_t SizeProduct::at(int64_t tokens) const {
  int64_t n = bytes;
  for (const SizeFactor &f : factors)
    n *= f.at(tokens);
  return n;
}

int64_t SizeTerm::at(int64_t tokens) const {
  int64_t n = 0;
  for (const SizeProduct &p : sum)
    n += p.at(tokens);
  return (n + align - 1) / align * align;
}

int64_t size_at(const SizeTerms &terms, int64_t tokens) {
  int64_t n = 0;
  for (const SizeTerm &t : terms)
    n += t.at(tokens);
  return n;
}

} // namespace moeforge
