// Bounded fuzzing of what users type: the schedule-text parser and the CLI's
// flag parser, with random and mutated inputs from a fixed seed (a failure
// replays). Every input must end in success or a UserError (exit code 2 for
// the CLI): never another exception, a crash, or (under the sanitizer build)
// undefined behaviour. Valid schedules must also survive text round trips.
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "dsl/error.h"
#include "examples/examples.h"
#include "schedules/presets.h"
#include "schedules/schedule.h"
#include "source_files.h"
#include "tools/cli.h"

using namespace moeforge;

namespace {

// Every .sched file under `folder` of the source tree, as text.
std::vector<std::pair<std::string, std::string>> schedule_files(const char *folder) {
  std::vector<std::pair<std::string, std::string>> files;
  const std::filesystem::path dir = testing::source_file(folder);
  for (const auto &entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file() || entry.path().extension() != ".sched")
      continue;
    std::ifstream in(entry.path(), std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    files.emplace_back(entry.path().filename().string(), text.str());
  }
  return files;
}

// The seeds: every preset, every schedule file the benchmarks keep, and the
// bad-input sweep's hostile texts (tests/fuzz_corpus/).
std::vector<std::string> schedule_corpus() {
  std::vector<std::string> corpus;
  for (const std::string &p : preset_names())
    corpus.push_back(preset(p).to_text());
  for (const char *folder : {"benchmarks/schedules", "tests/fuzz_corpus"})
    for (const auto &[name, text] : schedule_files(folder))
      corpus.push_back(text);
  return corpus;
}

// One random edit of `text`: bytes flipped, inserted or deleted, lines
// duplicated or dropped, numbers made huge, negative or non-numeric, quotes
// and parentheses broken.
std::string mutate(std::string text, std::mt19937_64 &rng) {
  auto pick = [&](size_t n) { return n == 0 ? size_t(0) : size_t(rng() % n); };
  static const std::vector<std::string> tokens = {"(",
                                                  ")",
                                                  "\"",
                                                  ",",
                                                  "#",
                                                  "\n",
                                                  "\r",
                                                  "\t",
                                                  " ",
                                                  "\\",
                                                  "*",
                                                  "-1",
                                                  "0",
                                                  "99999999999999999999",
                                                  "2147483648",
                                                  "1e9",
                                                  "0x10",
                                                  "nan",
                                                  "tile",
                                                  "stages",
                                                  "persistent",
                                                  "cluster",
                                                  "schedule",
                                                  "block",
                                                  "true",
                                                  "false",
                                                  std::string(1, '\0'),
                                                  "\xff\xfe",
                                                  "h",
                                                  "o",
                                                  "logits"};
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 7) {
    case 0: // flip a byte
      if (!text.empty())
        text[pick(text.size())] = static_cast<char>(rng() & 0xff);
      break;
    case 1: // insert a token
      text.insert(pick(text.size() + 1), tokens[pick(tokens.size())]);
      break;
    case 2: { // delete a range
      size_t at = pick(text.size() + 1);
      text.erase(at, pick(16));
      break;
    }
    case 3: { // duplicate a line
      size_t at = pick(text.size() + 1), end = text.find('\n', at);
      text.insert(at, text.substr(at, end == std::string::npos ? std::string::npos : end - at + 1));
      break;
    }
    case 4: { // replace a number by another
      size_t at = text.find_first_of("0123456789", pick(text.size() + 1));
      if (at != std::string::npos) {
        size_t end = text.find_first_not_of("0123456789", at);
        static const std::vector<std::string> numbers = {
            "0", "1", "3", "7", "64", "100", "256", "512", "-8", "4294967296", "9223372036854775808", "12abc", ""};
        text.replace(at, end == std::string::npos ? std::string::npos : end - at, numbers[pick(numbers.size())]);
      }
      break;
    }
    case 5: // truncate
      text.resize(pick(text.size() + 1));
      break;
    default: // splice in random bytes
      for (size_t n = pick(8); n > 0; --n)
        text.insert(pick(text.size() + 1), 1, static_cast<char>(rng() & 0xff));
    }
  }
  return text;
}

} // namespace

TEST_CASE("fuzz: the sweep's hostile schedule texts end in a UserError that names the file") {
  const auto files = schedule_files("tests/fuzz_corpus");
  REQUIRE(files.size() >= 10);
  const Example ex = make_example("swiglu_moe", ExampleShape{});
  for (const auto &[name, text] : files) {
    INFO(name);
    try {
      Schedule::from_text(text, name).validate(ex.pipeline);
      FAIL("a hostile schedule text was taken: " << name);
    } catch (const UserError &e) {
      CHECK(std::string(e.what()).find(name) != std::string::npos);
    }
  }
}

TEST_CASE("fuzz: mutated schedule texts parse or end in a UserError, and what parses round-trips") {
  const std::vector<std::string> corpus = schedule_corpus();
  REQUIRE(corpus.size() >= 10);
  std::mt19937_64 rng(20261125);
  const Example ex = make_example("swiglu_moe", ExampleShape{});
  int parsed = 0, refused = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (int n = 0; n < 100000 && std::chrono::steady_clock::now() < deadline; ++n) {
    const std::string text = mutate(corpus[rng() % corpus.size()], rng);
    Schedule s;
    try {
      s = Schedule::from_text(text, "fuzz.sched");
    } catch (const UserError &e) {
      ++refused;
      CHECK(std::string(e.what()).find("fuzz.sched") != std::string::npos); // the message names the source
      continue;
    }
    ++parsed;
    INFO("input: " << text);
    // What parses prints back to text that parses to the same schedule.
    const std::string again = s.to_text();
    CHECK(Schedule::from_text(again).to_text() == again);
    try {
      s.validate(ex.pipeline);
    } catch (const UserError &) {
      // a schedule that does not fit this layer: said, not crashed
    }
  }
  MESSAGE("schedule texts: " << parsed << " parsed, " << refused << " refused");
  CHECK(parsed > 0);
  CHECK(refused > 0);
}

TEST_CASE("fuzz: random command lines end in exit 0 or 2 with a message, never another exception") {
  std::mt19937_64 rng(7);
  static const std::vector<std::string> commands = {"list", "print",  "emit", "run", "train",    "tune",
                                                    "help", "nosuch", "",     "-h",  "--version"};
  static const std::vector<std::string> words = {"moe_mlp",
                                                 "swiglu_moe",
                                                 "dense_mlp",
                                                 "attention",
                                                 "nosuch",
                                                 "--tokens",
                                                 "--experts",
                                                 "--topk",
                                                 "--k",
                                                 "--d",
                                                 "--f",
                                                 "--seed",
                                                 "--precision",
                                                 "--schedule",
                                                 "--backend",
                                                 "--check",
                                                 "--recompute",
                                                 "--aux",
                                                 "--ir",
                                                 "--cuda",
                                                 "--llvm",
                                                 "--plan",
                                                 "--train",
                                                 "--budget-seconds",
                                                 "--help",
                                                 "-h",
                                                 "megablocks",
                                                 "scattermoe",
                                                 "f32",
                                                 "f64",
                                                 "cpu",
                                                 "cuda",
                                                 "reference",
                                                 "0",
                                                 "1",
                                                 "-1",
                                                 "8",
                                                 "64",
                                                 "100",
                                                 "2147483648",
                                                 "99999999999999999999",
                                                 "1e3",
                                                 "",
                                                 "x",
                                                 "--",
                                                 "-",
                                                 std::string("\0", 1),
                                                 "\xff",
                                                 "/nonexistent.sched"};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int lines = 0;
  for (int n = 0; n < 20000 && std::chrono::steady_clock::now() < deadline; ++n, ++lines) {
    std::vector<std::string> args = {commands[rng() % commands.size()]};
    for (size_t k = rng() % 7; k > 0; --k)
      args.push_back(words[rng() % words.size()]);
    // Commands that would compute end on a shape no layer has, after the
    // parser has read every flag before it: the parser is what is fuzzed
    // here, not the backends (the hostile table covers their refusals).
    if (args[0] == "run" || args[0] == "train" || args[0] == "tune")
      args.insert(args.end(), {"--tokens", "0"});
    if (args[0] == "emit") // --cuda, --llvm and --plan compile; --ir only lowers
      for (std::string &a : args)
        if (a == "--cuda" || a == "--llvm" || a == "--plan")
          a = "--ir";
    std::ostringstream out, err;
    std::string line;
    for (const std::string &a : args)
      line += "'" + a + "' ";
    INFO("moeforge " << line);
    const int code = run_cli(args, out, err);
    CHECK((code == 0 || code == 2));
    if (code == 2)
      CHECK(err.str().rfind("moeforge: ", 0) == 0);
  }
  MESSAGE("command lines: " << lines);
  CHECK(lines > 100);
}
