// The CPU backend's AttentionStep: see cpu_attention.h.
#include "backends/cpu/cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "dsl/error.h"
#include "runtime/tensor.h"

namespace moeforge::cpu {

namespace {
// Element i of a bf16 or f32 tensor, as f32.
float load_f32(const uint8_t *at, DType t, int64_t i) {
  if (t == DType::f32) {
    float v;
    std::memcpy(&v, at + i * 4, 4);
    return v;
  }
  uint16_t bits;
  std::memcpy(&bits, at + i * 2, 2);
  return bf16_value(bits);
}

void store_f32(uint8_t *at, DType t, int64_t i, float v) {
  if (t == DType::f32) {
    std::memcpy(at + i * 4, &v, 4);
    return;
  }
  const uint16_t bits = bf16_bits(v);
  std::memcpy(at + i * 2, &bits, 2);
}

} // namespace

void run_attention(const KernelProgram &prog, const AttentionStep &step, const AttentionMemory &memory) {
  using Part = AttentionStep::Part;
  auto placed = [&](const std::string &n) { return memory.tensor(n); };
  const TensorDecl &key = prog.tensor(step.key), &value = prog.tensor(step.value);
  const int64_t fk = key.dims[1].extent(), fv = value.dims[1].extent();
  const int64_t tokens = memory.elements(key) / fk;
  const uint8_t *gk = placed(step.key), *gv = placed(step.value);
  // The step's rows: a route's padded slots (a padded tensor's row is the
  // slot, a pair-order one's sorted_pair[slot]; -1: padding), else q's.
  const int32_t *sorted_pair = step.route ? memory.sorted_pair : nullptr;
  int64_t rows = memory.elements(prog.tensor(step.q)) / fk, used = rows;
  if (step.route) {
    internal_check(sorted_pair != nullptr) << step.name << ": its route has not run";
    for (const std::string &n : attention_row_tensors(step))
      if (const TensorDecl &t = prog.tensor(n); t.layout == RowLayout::padded) {
        rows = memory.elements(t) / elements_past_first(t);
        break;
      }
    used = std::min<int64_t>(rows, memory.padded_rows);
  }
  auto live = [&](int64_t r) { return r < used && (!sorted_pair || sorted_pair[r] >= 0); };
  // A row tensor's element (slot r, column c): its own row for the slot.
  struct RowTensor {
    uint8_t *at;
    DType dtype;
    int64_t width;
    bool gather; // pair order under padded slots
  };
  auto row_tensor = [&](const std::string &n) {
    const TensorDecl &t = prog.tensor(n);
    return RowTensor{placed(n), t.dtype, elements_past_first(t), sorted_pair && t.layout == RowLayout::pair};
  };
  auto at = [&](const RowTensor &t, int64_t r, int64_t c) { return (t.gather ? sorted_pair[r] : r) * t.width + c; };
  auto load = [&](const RowTensor &t, int64_t r, int64_t c) { return load_f32(t.at, t.dtype, at(t, r, c)); };
  // Padding slots of a padded output get zeros; a pair-order output has no
  // row for them.
  auto store = [&](const RowTensor &t, int64_t r, int64_t c, float v) {
    if (live(r) || !t.gather)
      store_f32(t.at, t.dtype, at(t, r, c), live(r) ? v : 0.0f);
  };
  auto dot_key = [&](const std::vector<float> &qr, int64_t u) {
    float dot = 0.0f;
    for (int64_t j = 0; j < fk; ++j)
      dot += qr[static_cast<size_t>(j)] * load_f32(gk, key.dtype, u * fk + j);
    return static_cast<float>(step.scale) * dot;
  };
  auto dot_value = [&](const std::vector<float> &dz, int64_t u) {
    float dot = 0.0f;
    for (int64_t c = 0; c < fv; ++c)
      dot += dz[static_cast<size_t>(c)] * load_f32(gv, value.dtype, u * fv + c);
    return dot;
  };
  const RowTensor q = row_tensor(step.q);
  std::vector<float> qr(static_cast<size_t>(fk)), dz(static_cast<size_t>(fv));
  auto load_row = [&](std::vector<float> &to, const RowTensor &t, int64_t r) {
    for (size_t c = 0; c < to.size(); ++c)
      to[c] = load(t, r, static_cast<int64_t>(c));
  };

  if (step.part == Part::forward) {
    const RowTensor out = row_tensor(step.output);
    const RowTensor lse = step.lse.empty() ? RowTensor{nullptr, DType::f32, 1, false} : row_tensor(step.lse);
    std::vector<float> acc(static_cast<size_t>(fv));
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
      if (live(r)) {
        load_row(qr, q, r);
        // The running maximum m and sum l of exp(s - m): each new maximum
        // rescales what was summed before it, so one pass over u suffices.
        for (int64_t u = 0; u < tokens; ++u) {
          const float s = dot_key(qr, u), m_new = std::fmax(m, s);
          const float rescale = std::exp(m - m_new), w = std::exp(s - m_new);
          l = l * rescale + w;
          for (int64_t c = 0; c < fv; ++c)
            acc[static_cast<size_t>(c)] =
                acc[static_cast<size_t>(c)] * rescale + w * load_f32(gv, value.dtype, u * fv + c);
          m = m_new;
        }
        if (l > 0.0f)
          for (float &a : acc)
            a /= l;
      }
      for (int64_t c = 0; c < fv; ++c)
        store(out, r, c, acc[static_cast<size_t>(c)]);
      if (lse.at) // the log-sum-exp, where training keeps it
        store(lse, r, 0, l > 0.0f ? m + std::log(l) : 0.0f);
    }
    return;
  }

  // The gradients: p(r, u) = exp(s - lse[r]) made again from the scores,
  // ds = p (d_z[r] . value[u] - delta[r]) scale.
  const RowTensor lse = row_tensor(step.lse), delta = row_tensor(step.delta), d_z = row_tensor(step.d_z);
  if (step.part == Part::query_gradient) {
    const RowTensor d_q = row_tensor(step.output), z = row_tensor(step.z);
    std::vector<float> acc(static_cast<size_t>(fk));
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      float dl = 0.0f;
      if (live(r)) {
        load_row(qr, q, r);
        load_row(dz, d_z, r);
        for (int64_t c = 0; c < fv; ++c)
          dl += dz[static_cast<size_t>(c)] * load(z, r, c);
        const float lr = load(lse, r, 0);
        for (int64_t u = 0; u < tokens; ++u) {
          const float p = std::exp(dot_key(qr, u) - lr);
          const float ds = p * (dot_value(dz, u) - dl) * static_cast<float>(step.scale);
          for (int64_t j = 0; j < fk; ++j)
            acc[static_cast<size_t>(j)] += ds * load_f32(gk, key.dtype, u * fk + j);
        }
      }
      for (int64_t j = 0; j < fk; ++j)
        store(d_q, r, j, acc[static_cast<size_t>(j)]);
      store(delta, r, 0, dl);
    }
    return;
  }

  // key_gradient: every row's share of each token's d_key and d_value.
  std::vector<float> dk(static_cast<size_t>(tokens * fk), 0.0f), dv(static_cast<size_t>(tokens * fv), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    if (!live(r))
      continue;
    load_row(qr, q, r);
    load_row(dz, d_z, r);
    const float lr = load(lse, r, 0), dl = load(delta, r, 0);
    for (int64_t u = 0; u < tokens; ++u) {
      const float p = std::exp(dot_key(qr, u) - lr);
      const float ds = p * (dot_value(dz, u) - dl) * static_cast<float>(step.scale);
      for (int64_t j = 0; j < fk; ++j)
        dk[static_cast<size_t>(u * fk + j)] += ds * qr[static_cast<size_t>(j)];
      for (int64_t c = 0; c < fv; ++c)
        dv[static_cast<size_t>(u * fv + c)] += p * dz[static_cast<size_t>(c)];
    }
  }
  const TensorDecl &d_key = prog.tensor(step.output), &d_value = prog.tensor(step.d_value);
  uint8_t *gdk = placed(step.output), *gdv = placed(step.d_value);
  for (size_t i = 0; i < dk.size(); ++i)
    store_f32(gdk, d_key.dtype, static_cast<int64_t>(i), dk[i]);
  for (size_t i = 0; i < dv.size(); ++i)
    store_f32(gdv, d_value.dtype, static_cast<int64_t>(i), dv[i]);
}

} // namespace moeforge::cpu
