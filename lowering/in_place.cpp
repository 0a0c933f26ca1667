#include "lowering/in_place.h"

#include <algorithm>
#include <set>

#include "dsl/visitor.h"

namespace moeforge {

namespace {

// Whether every read of `input` in e is at exactly `vars`, and e has no
// reduction or softmax: then each element's value reads only that element
// of the input, and no other thread's store can come before this one's read.
bool reads_only_at(const Expr &e, const std::string &input, const std::vector<Var> &vars) {
  struct Check : IRVisitor {
    const std::string *input = nullptr;
    const std::vector<Var> *vars = nullptr;
    bool ok = true;
    void visit_node(const Access &a) override {
      if (a.target_name() == *input) {
        ok &= a.args.size() == vars->size();
        for (size_t i = 0; ok && i < a.args.size(); ++i)
          ok &= a.args[i].is_plain() && a.args[i].var.same_as((*vars)[i]);
      }
      IRVisitor::visit_node(a);
    }
    void visit_node(const Sum &) override { ok = false; }
    void visit_node(const Softmax &) override { ok = false; }
  } check;
  check.input = &input;
  check.vars = &vars;
  check.visit(e);
  return check.ok;
}

bool same_storage(const TensorDecl &a, const TensorDecl &b) {
  return a.dtype == b.dtype && a.dims == b.dims && a.layout == b.layout && a.route == b.route &&
         a.stride8 == b.stride8 && a.outer_stride == b.outer_stride;
}

} // namespace

bool may_write_in_place(const KernelProgram &p, size_t s, const std::string &output, const std::string &input,
                        size_t boundary) {
  const auto *pw = std::get_if<PointwiseStep>(&p.steps.at(s));
  if (!pw || output == input || is_output(p, output) || is_output(p, input))
    return false;
  const TensorDecl *in = p.find(input), *out = p.find(output);
  if (!in || !out || in->is_input || !same_storage(*in, *out))
    return false;
  // The output at the step's own indices (not a row sum).
  const Expr *value = output == pw->output ? &pw->body : nullptr;
  for (const ExtraOutput &e : pw->extra)
    if (e.output == output && !e.row_sum)
      value = &e.value;
  if (!value || !reads_only_at(pw->body, input, pw->vars))
    return false;
  for (const ExtraOutput &e : pw->extra)
    if (!reads_only_at(e.value, input, pw->vars))
      return false;
  // The input: written before s, read last at s, and not kept across the
  // boundary. The output: first touched at s, not written before the
  // boundary and read after it.
  size_t in_written = p.steps.size(), out_first = p.steps.size(), out_last = 0;
  bool in_read_later = false;
  for (size_t i = 0; i < p.steps.size(); ++i) {
    const std::vector<std::string> reads = step_reads(p.steps[i]), writes = step_outputs(p.steps[i]);
    const bool reads_in = std::count(reads.begin(), reads.end(), input) > 0;
    const bool writes_in = std::count(writes.begin(), writes.end(), input) > 0;
    if (writes_in && in_written == p.steps.size())
      in_written = i;
    if (i > s && (reads_in || writes_in))
      in_read_later = true;
    if (i == s && writes_in)
      return false;
    if (std::count(reads.begin(), reads.end(), output) || std::count(writes.begin(), writes.end(), output)) {
      out_first = std::min(out_first, i);
      out_last = i;
    }
  }
  if (in_written >= s || in_read_later || out_first != s)
    return false;
  const bool input_kept = in_written < boundary && s >= boundary;
  const bool output_kept = s < boundary && out_last >= boundary;
  return (!input_kept || p.gradients_over_saved) && !output_kept;
}

bool may_live_in_output(const KernelProgram &p, size_t s, const std::string &output, const std::string &input,
                        size_t boundary) {
  const auto *pw = std::get_if<PointwiseStep>(&p.steps.at(s));
  if (!pw || pw->output != output || output == input || !is_output(p, output) || is_output(p, input))
    return false;
  const TensorDecl *in = p.find(input), *out = p.find(output);
  if (!in || !out || in->is_input || out->is_input || !same_storage(*in, *out))
    return false;
  if (!reads_only_at(pw->body, input, pw->vars))
    return false;
  for (const ExtraOutput &e : pw->extra)
    if (!reads_only_at(e.value, input, pw->vars))
      return false;
  size_t writers = 0, in_written = p.steps.size();
  for (size_t i = 0; i < p.steps.size(); ++i) {
    const std::vector<std::string> reads = step_reads(p.steps[i]), writes = step_outputs(p.steps[i]);
    const bool reads_in = std::count(reads.begin(), reads.end(), input) > 0;
    const bool writes_in = std::count(writes.begin(), writes.end(), input) > 0;
    const bool touches_out =
        std::count(reads.begin(), reads.end(), output) + std::count(writes.begin(), writes.end(), output) > 0;
    if (writes_in) {
      ++writers;
      in_written = std::min(in_written, i);
    }
    if ((reads_in || touches_out) && i != s) // only s reads the input; only s touches the output
      return false;
  }
  // One writer before s, on the same side of the boundary as s.
  return writers == 1 && in_written < s && (in_written < boundary) == (s < boundary);
}

bool is_saved_input(const KernelProgram &p, size_t s, const std::string &input, size_t boundary) {
  if (s < boundary)
    return false;
  for (size_t i = 0; i < boundary && i < p.steps.size(); ++i) {
    const std::vector<std::string> writes = step_outputs(p.steps[i]);
    if (std::count(writes.begin(), writes.end(), input))
      return true;
  }
  return false;
}

std::map<std::string, std::string> written_over_saved(const KernelProgram &p, size_t boundary) {
  std::map<std::string, std::string> over;
  for (size_t s = boundary; s < p.steps.size(); ++s)
    if (const auto *pw = std::get_if<PointwiseStep>(&p.steps[s]))
      for (const auto &[out, in] : pw->in_place)
        if (is_saved_input(p, s, in, boundary) && may_write_in_place(p, s, out, in, boundary))
          over[out] = in;
  return over;
}

void mark_in_place_outputs(KernelProgram &p, size_t boundary) {
  std::set<std::string> taken;
  for (size_t s = 0; s < p.steps.size(); ++s) {
    auto *pw = std::get_if<PointwiseStep>(&p.steps[s]);
    if (!pw)
      continue;
    pw->in_place.clear();
    std::vector<std::string> outputs{pw->output};
    for (const ExtraOutput &e : pw->extra)
      if (!e.row_sum)
        outputs.push_back(e.output);
    // Saved inputs first (their bytes are held to the backward's end anyway).
    std::vector<std::string> reads = step_reads(p.steps[s]);
    std::stable_partition(reads.begin(), reads.end(),
                          [&](const std::string &in) { return is_saved_input(p, s, in, boundary); });
    for (const std::string &out : outputs)
      for (const std::string &in : reads) {
        if (taken.count(in) || !may_write_in_place(p, s, out, in, boundary))
          continue;
        pw->in_place.emplace_back(out, in);
        taken.insert(in);
        break;
      }
    for (const std::string &in : reads)
      if (!taken.count(in) && may_live_in_output(p, s, pw->output, in, boundary)) {
        pw->in_place.emplace_back(pw->output, in);
        taken.insert(in);
        break;
      }
  }
}

} // namespace moeforge
