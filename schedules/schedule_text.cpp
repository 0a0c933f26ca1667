// The text form of a Schedule: its trace, one primitive call per line. The
// parser only reads a line into a primitive name and typed arguments; the
// values are then checked by replaying the primitive itself, so the text and
// the C++ API can never disagree on what is allowed.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dsl/error.h"
#include "schedules/presets.h"
#include "schedules/schedule.h"

namespace moeforge {

namespace {

enum class ArgType { text, integer, number, permutation, gate, boolean, mma };

struct ArgSpec {
  const char *name;
  ArgType type;
};

struct Signature {
  const char *primitive;
  std::vector<ArgSpec> params;
};

const std::vector<Signature> &signatures() {
  static const std::vector<Signature> all = {
      {"schedule", {{"name", ArgType::text}}},
      {"permutation", {{"strategy", ArgType::permutation}}},
      {"block", {{"rows", ArgType::integer}}},
      {"capacity", {{"factor", ArgType::number}}},
      {"expert_parallel", {{"ranks", ArgType::integer}}},
      {"exchange_chunks", {{"chunks", ArgType::integer}}},
      {"gate", {{"fusion", ArgType::gate}}},
      {"recompute", {{"on", ArgType::boolean}}},
      {"tile", {{"func", ArgType::text}, {"m", ArgType::integer}, {"n", ArgType::integer}, {"k", ArgType::integer}}},
      {"stages", {{"func", ArgType::text}, {"stages", ArgType::integer}}},
      {"warps", {{"func", ArgType::text}, {"warps_m", ArgType::integer}, {"warps_n", ArgType::integer}}},
      {"fuse_epilogue", {{"func", ArgType::text}, {"fuse", ArgType::boolean}}},
      {"mma", {{"func", ArgType::text}, {"kind", ArgType::mma}}},
      {"raster", {{"func", ArgType::text}, {"row_tiles", ArgType::integer}}},
      {"persistent", {{"func", ArgType::text}, {"on", ArgType::boolean}}},
      {"tma", {{"func", ArgType::text}, {"on", ArgType::boolean}}},
      {"tma_store", {{"func", ArgType::text}, {"on", ArgType::boolean}}},
      {"cluster", {{"func", ArgType::text}, {"row_tiles", ArgType::integer}}},
      {"narrow_tail", {{"func", ArgType::text}, {"on", ArgType::boolean}}},
      {"fp8", {{"func", ArgType::text}, {"format", ArgType::text}}},
      {"bf16_activations", {{"on", ArgType::boolean}}},
      {"reuse_memory", {{"on", ArgType::boolean}}},
      {"bf16_weight_gradients", {{"on", ArgType::boolean}}},
      {"padded_elementwise", {{"on", ArgType::boolean}}},
      {"recompute_elementwise", {{"on", ArgType::boolean}}},
      {"gate_gradient_from_dh", {{"on", ArgType::boolean}}},
      {"chain_summed_gemms", {{"on", ArgType::boolean}}},
      {"atomic_combine", {{"on", ArgType::boolean}}},
      {"atomic_input_gradient", {{"on", ArgType::boolean}}},
      {"gather_in_gemms", {{"on", ArgType::boolean}}},
      {"split_pointwise_for_memory", {{"on", ArgType::boolean}}},
      {"gradients_over_saved", {{"on", ArgType::boolean}}},
      {"sorted_saved", {{"on", ArgType::boolean}}},
      {"sorted_gathers", {{"on", ArgType::boolean}}},
      {"merge_weight_gradients", {{"on", ArgType::boolean}}},
      {"gather_upstream_in_gemms", {{"on", ArgType::boolean}}},
      {"bf16_boundary", {{"on", ArgType::boolean}}},
      {"fused_attention", {{"on", ArgType::boolean}}},
  };
  return all;
}

// The schedule-wide on/off primitives (recompute(true), ...) and their
// setters, so that replaying one is a lookup; null for any other primitive.
using FlagSetter = Schedule &(Schedule::*)(bool);
FlagSetter flag_setter(const std::string &primitive) {
  static const std::pair<const char *, FlagSetter> flags[] = {
      {"recompute", &Schedule::recompute},
      {"bf16_activations", &Schedule::bf16_activations},
      {"reuse_memory", &Schedule::reuse_memory},
      {"bf16_weight_gradients", &Schedule::bf16_weight_gradients},
      {"padded_elementwise", &Schedule::padded_elementwise},
      {"recompute_elementwise", &Schedule::recompute_elementwise},
      {"gate_gradient_from_dh", &Schedule::gate_gradient_from_dh},
      {"chain_summed_gemms", &Schedule::chain_summed_gemms},
      {"atomic_combine", &Schedule::atomic_combine},
      {"atomic_input_gradient", &Schedule::atomic_input_gradient},
      {"gather_in_gemms", &Schedule::gather_in_gemms},
      {"split_pointwise_for_memory", &Schedule::split_pointwise_for_memory},
      {"gradients_over_saved", &Schedule::gradients_over_saved},
      {"sorted_saved", &Schedule::sorted_saved},
      {"sorted_gathers", &Schedule::sorted_gathers},
      {"merge_weight_gradients", &Schedule::merge_weight_gradients},
      {"gather_upstream_in_gemms", &Schedule::gather_upstream_in_gemms},
      {"bf16_boundary", &Schedule::bf16_boundary},
      {"fused_attention", &Schedule::fused_attention},
  };
  for (const auto &[name, set] : flags)
    if (primitive == name)
      return set;
  return nullptr;
}

const char *expected_for(ArgType t) {
  switch (t) {
  case ArgType::text:
    return "a quoted name";
  case ArgType::integer:
    return "an integer";
  case ArgType::number:
    return "a number";
  case ArgType::permutation:
    return "blocked or scattered";
  case ArgType::gate:
    return "combine or epilogue";
  case ArgType::boolean:
    return "true or false";
  case ArgType::mma:
    return "mma_sync, wgmma or wgmma_ws";
  }
  return "?";
}

// One argument as written: a quoted string, or a bare word or number.
struct Token {
  bool quoted = false;
  std::string text;
};

struct Statement {
  std::string primitive;
  std::vector<Token> args;
};

// Reads `primitive(arg, ...)` from one line; throws with `where` as prefix.
class LineParser {
public:
  LineParser(const std::string &line, std::string where) : s_(line), where_(std::move(where)) {}

  // False for a blank or comment-only line.
  bool parse(Statement &out) {
    skip_space();
    if (at_end())
      return false;
    out.primitive = word();
    if (out.primitive.empty())
      fail() << "expected a primitive name (" << names() << "), found " << found();
    skip_space();
    if (!eat('('))
      fail() << "expected '(' after '" << out.primitive << "', found " << found();
    skip_space();
    if (!eat(')')) {
      for (;;) {
        skip_space();
        out.args.push_back(argument(out.primitive));
        skip_space();
        if (eat(')'))
          break;
        if (!eat(','))
          fail() << "expected ',' or ')' in the arguments of '" << out.primitive << "', found " << found();
      }
    }
    skip_space();
    eat(';'); // tolerated, so a line copied from C++ still reads
    skip_space();
    if (!at_end())
      fail() << "expected the end of the line after '" << out.primitive << "(...)', found " << found();
    return true;
  }

  static std::string names() {
    std::string out;
    for (const Signature &sig : signatures())
      out += (out.empty() ? "" : ", ") + std::string(sig.primitive);
    return out;
  }

private:
  detail::ErrorBuilder<UserError> fail() const { return detail::ErrorBuilder<UserError>(where_.c_str()); }

  bool at_end() const { return pos_ >= s_.size() || s_[pos_] == '#'; }
  void skip_space() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_])))
      ++pos_;
  }
  bool eat(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  std::string word() {
    size_t start = pos_;
    while (pos_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '_' ||
                                s_[pos_] == '-' || s_[pos_] == '.' || s_[pos_] == '+')) // numbers: 1.25, 1e+2
      ++pos_;
    return s_.substr(start, pos_ - start);
  }
  std::string found() const {
    if (at_end())
      return "the end of the line";
    size_t end = pos_;
    while (end < s_.size() && end - pos_ < 20 && !std::isspace(static_cast<unsigned char>(s_[end])))
      ++end;
    // Appended piecewise: GCC 12 warns falsely (-Wrestrict) on "'" + substr + "'".
    std::string out = "'";
    out.append(s_, pos_, end - pos_);
    out += '\'';
    return out;
  }
  Token argument(const std::string &primitive) {
    Token t;
    if (eat('"')) {
      size_t close = s_.find('"', pos_);
      if (close == std::string::npos)
        fail() << "unterminated string in the arguments of '" << primitive << "': expected a closing '\"'";
      t.quoted = true;
      t.text = s_.substr(pos_, close - pos_);
      pos_ = close + 1;
      return t;
    }
    t.text = word();
    if (t.text.empty())
      fail() << "expected an argument of '" << primitive << "', found " << found();
    return t;
  }

  const std::string &s_;
  std::string where_;
  size_t pos_ = 0;
};

} // namespace

std::string Schedule::to_text() const {
  std::string out = "schedule(\"" + name_ + "\")\n";
  for (const std::string &c : calls_)
    out += c + "\n";
  return out;
}

std::ostream &operator<<(std::ostream &os, const Schedule &s) { return os << s.to_text(); }

Schedule Schedule::from_text(const std::string &text, const std::string &source_name) {
  Schedule s;
  std::istringstream in(text);
  std::string line;
  int line_no = 0;
  bool any_call = false;
  while (std::getline(in, line)) {
    ++line_no;
    std::string where = source_name + ":" + std::to_string(line_no) + ": ";
    // A control byte (a NUL, say) is no text: printed in a message it would
    // cut the message short or garble the terminal, so name it by its code.
    for (size_t c = 0; c < line.size(); ++c) {
      const unsigned char b = static_cast<unsigned char>(line[c]);
      if ((b < 0x20 && b != '\t' && b != '\r') || b == 0x7f) {
        static const char *hex = "0123456789abcdef";
        user_error << where << "column " << c + 1 << ": byte 0x" << hex[b >> 4] << hex[b & 15]
                   << " is not text; a schedule file holds one call per line, as a schedule's save() writes it";
      }
    }
    Statement st;
    if (!LineParser(line, where).parse(st))
      continue;
    const Signature *sig = nullptr;
    for (const Signature &candidate : signatures())
      if (st.primitive == candidate.primitive)
        sig = &candidate;
    user_check(sig) << where << "unknown primitive '" << st.primitive << "': expected one of " << LineParser::names();
    std::string usage = st.primitive + "(";
    for (size_t i = 0; i < sig->params.size(); ++i)
      usage += (i ? ", " : "") + std::string(sig->params[i].name);
    usage += ")";
    user_check(st.args.size() == sig->params.size())
        << where << "'" << st.primitive << "' takes " << sig->params.size() << " argument"
        << (sig->params.size() == 1 ? "" : "s") << " " << usage << ", found " << st.args.size();

    // Typed values; the primitive checks their ranges when replayed below.
    std::vector<long long> ints(st.args.size());
    std::vector<double> numbers(st.args.size());
    std::vector<Permutation> perms(st.args.size());
    std::vector<GateFusion> gates(st.args.size());
    std::vector<bool> bools(st.args.size());
    std::vector<MmaKind> mmas(st.args.size());
    for (size_t i = 0; i < st.args.size(); ++i) {
      const Token &a = st.args[i];
      const ArgSpec &p = sig->params[i];
      bool ok = true;
      switch (p.type) {
      case ArgType::text:
        ok = a.quoted;
        break;
      case ArgType::integer: {
        const char *b = a.text.data(), *e = b + a.text.size();
        auto [end, ec] = std::from_chars(b, e, ints[i]);
        ok = !a.quoted && ec == std::errc() && end == e && ints[i] >= INT_MIN && ints[i] <= INT_MAX;
        break;
      }
      case ArgType::number: {
        const char *b = a.text.data(), *e = b + a.text.size();
        auto [end, ec] = std::from_chars(b, e, numbers[i]);
        ok = !a.quoted && ec == std::errc() && end == e;
        break;
      }
      case ArgType::permutation:
        ok = !a.quoted && (a.text == "blocked" || a.text == "scattered");
        perms[i] = a.text == "scattered" ? Permutation::scattered : Permutation::blocked;
        break;
      case ArgType::gate:
        ok = !a.quoted && (a.text == "combine" || a.text == "epilogue");
        gates[i] = a.text == "epilogue" ? GateFusion::epilogue : GateFusion::combine;
        break;
      case ArgType::mma:
        ok = !a.quoted && (a.text == "mma_sync" || a.text == "wgmma" || a.text == "wgmma_ws");
        mmas[i] = a.text == "wgmma" ? MmaKind::wgmma : a.text == "wgmma_ws" ? MmaKind::wgmma_ws : MmaKind::mma_sync;
        break;
      case ArgType::boolean:
        ok = !a.quoted && (a.text == "true" || a.text == "false");
        bools[i] = a.text == "true";
        break;
      }
      user_check(ok) << where << "argument '" << p.name << "' of " << usage << ": expected " << expected_for(p.type)
                     << ", found " << (a.quoted ? "\"" + a.text + "\"" : "'" + a.text + "'");
    }

    const std::string &func = st.args.empty() ? st.primitive : st.args[0].text;
    auto i = [&](size_t k) { return static_cast<int>(ints[k]); };
    try {
      if (st.primitive == "schedule") {
        user_check(!any_call) << "schedule(\"" << st.args[0].text
                              << "\") names the schedule, so it must come before every primitive: move it "
                                 "to the first line";
        s = Schedule(st.args[0].text);
      } else if (st.primitive == "permutation") {
        s.permutation(perms[0]);
      } else if (st.primitive == "block") {
        s.block(i(0));
      } else if (st.primitive == "capacity") {
        s.capacity(numbers[0]);
      } else if (st.primitive == "expert_parallel") {
        s.expert_parallel(i(0));
      } else if (st.primitive == "exchange_chunks") {
        s.exchange_chunks(i(0));
      } else if (st.primitive == "gate") {
        s.gate(gates[0]);
      } else if (FlagSetter set = flag_setter(st.primitive)) {
        (s.*set)(bools[0]);
      } else if (st.primitive == "tile") {
        s.tile(func, i(1), i(2), i(3));
      } else if (st.primitive == "stages") {
        s.stages(func, i(1));
      } else if (st.primitive == "warps") {
        s.warps(func, i(1), i(2));
      } else if (st.primitive == "fuse_epilogue") {
        s.fuse_epilogue(func, bools[1]);
      } else if (st.primitive == "mma") {
        s.mma(func, mmas[1]);
      } else if (st.primitive == "raster") {
        s.raster(func, i(1));
      } else if (st.primitive == "persistent") {
        s.persistent(func, bools[1]);
      } else if (st.primitive == "tma") {
        s.tma(func, bools[1]);
      } else if (st.primitive == "tma_store") {
        s.tma_store(func, bools[1]);
      } else if (st.primitive == "cluster") {
        s.cluster(func, i(1));
      } else if (st.primitive == "narrow_tail") {
        s.narrow_tail(func, bools[1]);
      } else if (st.primitive == "fp8") {
        const std::string &format = st.args[1].text;
        s.fp8(func, format == "off" ? std::nullopt : std::optional<Fp8Format>(parse_fp8_format(format)));
      } else {
        internal_check(false) << "no replay for primitive " << st.primitive;
      }
    } catch (const UserError &e) {
      throw UserError(where + e.what());
    }
    any_call = true;
  }
  return s;
}

void Schedule::save(const std::string &path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  user_check(out.good()) << "cannot write schedule '" << name_ << "' to '" << path << "': " << std::strerror(errno);
  out << to_text();
  out.close();
  user_check(!out.fail()) << "writing schedule '" << name_ << "' to '" << path << "' failed: " << std::strerror(errno);
}

Schedule Schedule::load(const std::string &path) {
  std::error_code ec;
  user_check(!std::filesystem::is_directory(path, ec))
      << "cannot read schedule file '" << path << "': it is a directory; pass a file written by save()";
  std::ifstream in(path, std::ios::binary);
  user_check(in.good()) << "cannot read schedule file '" << path << "': " << std::strerror(errno);
  // Read in chunks up to a bound, so that a device or a huge file (/dev/zero,
  // a pipe of random bytes) is refused at once instead of filling memory: a
  // NUL byte is never text, and no schedule comes near the bound (one call
  // per line, tens of bytes each).
  std::string text;
  std::vector<char> chunk(64 * 1024);
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    const size_t got = static_cast<size_t>(in.gcount());
    const auto nul = std::find(chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(got), '\0');
    user_check(nul == chunk.begin() + static_cast<std::ptrdiff_t>(got))
        << "schedule file '" << path << "': byte " << text.size() + static_cast<size_t>(nul - chunk.begin())
        << " is a NUL (0x00), so this is not a text file; a schedule file holds one call per line, as "
        << "Schedule.save writes it";
    user_check(text.size() + got <= kMaxScheduleFileBytes)
        << "schedule file '" << path << "' is larger than " << kMaxScheduleFileBytes / (1024 * 1024)
        << " MiB, far more than any schedule (one call per line): pass the file Schedule.save wrote";
    text.append(chunk.data(), got);
  }
  user_check(!in.bad()) << "reading schedule file '" << path << "' failed: " << std::strerror(errno);
  Schedule s = from_text(text, path);
  // An empty file would run as an unnamed default schedule, which is never
  // what a file passed on purpose means.
  std::string presets;
  for (const std::string &n : preset_names())
    presets += (presets.empty() ? "" : ", ") + n;
  user_check(!s.calls().empty() || s.name() != "custom")
      << "schedule file '" << path << "' has no primitives (only blank lines or comments): write at least "
      << "schedule(\"<name>\") and the primitives to apply, or pass a preset (" << presets << ")";
  return s;
}

} // namespace moeforge
