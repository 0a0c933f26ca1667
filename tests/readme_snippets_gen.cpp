// Turns README.md's C++ into a doctest source, so the README's code is
// compiled (and run) with the tests and cannot rot:
//
//   readme_snippets_gen README.md out.cpp
//
// Every ```c++ block of one section (a "## " heading) is one program: the
// blocks run in order in one function, so a later block uses what an earlier
// one defined. #include and `using namespace` lines move to the top of the
// file; #line directives make a compiler error name README.md's own line. A
// block that uses the CPU backend (cpu:: or make_backend("cpu")) is compiled
// only where it is built (MOEFORGE_HAVE_CPU_BACKEND). Each section becomes one test case that runs
// its program with std::cout captured.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Block {
  int first_line = 0; // README line number of the block's first code line
  std::vector<std::string> lines;
  bool uses(const std::string &what) const {
    for (const std::string &l : lines)
      if (l.find(what) != std::string::npos)
        return true;
    return false;
  }
};

struct Section {
  std::string title;
  std::vector<Block> blocks;
};

bool starts_with(const std::string &s, const std::string &p) { return s.compare(0, p.size(), p) == 0; }

std::string quoted(const std::string &s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\')
      out += '\\';
    out += c;
  }
  return out + "\"";
}

} // namespace

int main(int argc, char **argv) {
  if (argc != 3) {
    std::cerr << "usage: readme_snippets_gen README.md out.cpp\n";
    return 2;
  }
  const std::string readme = argv[1];
  std::ifstream in(readme);
  if (!in) {
    std::cerr << "readme_snippets_gen: cannot read " << readme << "\n";
    return 2;
  }

  std::vector<Section> sections{{"(before any section)", {}}};
  std::vector<std::string> hoisted;
  std::set<std::string> seen;
  std::string line;
  int number = 0;
  bool in_cpp = false, in_other = false;
  while (std::getline(in, line)) {
    ++number;
    if (in_cpp || in_other) {
      if (starts_with(line, "```")) {
        in_cpp = in_other = false;
        continue;
      }
      if (!in_cpp)
        continue;
      Block &b = sections.back().blocks.back();
      if (b.first_line == 0)
        b.first_line = number;
      if (starts_with(line, "#include") || starts_with(line, "using namespace")) {
        if (seen.insert(line).second)
          hoisted.push_back(line);
        b.lines.push_back(""); // keeps the #line numbering
      } else {
        b.lines.push_back(line);
      }
      continue;
    }
    if (starts_with(line, "## ")) {
      sections.push_back({line.substr(3), {}});
    } else if (line == "```c++" || line == "```cpp") {
      in_cpp = true;
      sections.back().blocks.push_back({});
    } else if (starts_with(line, "```")) {
      in_other = true;
    }
  }
  if (in_cpp || in_other) {
    std::cerr << readme << ": a code block is not closed\n";
    return 2;
  }

  std::ostringstream out;
  out << "// Generated from " << readme << " by tests/readme_snippets_gen.cpp: do not edit.\n"
      << "#include <doctest/doctest.h>\n\n#include <exception>\n#include <iostream>\n#include <sstream>\n#include "
         "<string>\n\n";
  for (const std::string &h : hoisted)
    out << h << "\n";
  out << "\nnamespace {\n\n"
      << "// std::cout into a string while a snippet runs.\n"
      << "struct CaptureCout {\n"
      << "  std::ostringstream text;\n"
      << "  std::streambuf *old = std::cout.rdbuf(text.rdbuf());\n"
      << "  ~CaptureCout() { std::cout.rdbuf(old); }\n"
      << "};\n\n";
  int index = 0;
  std::ostringstream tests;
  for (const Section &s : sections) {
    if (s.blocks.empty())
      continue;
    ++index;
    out << "void readme_section_" << index << "() {\n";
    for (const Block &b : s.blocks) {
      bool cpu = b.uses("cpu::") || b.uses("make_backend(\"cpu\")");
      if (cpu)
        out << "#ifdef MOEFORGE_HAVE_CPU_BACKEND\n";
      out << "#line " << b.first_line << " " << quoted(readme) << "\n";
      for (const std::string &l : b.lines)
        out << l << "\n";
      if (cpu)
        out << "#endif\n";
    }
    out << "}\n";
    // Back to this file's own numbering for what follows.
    const std::string so_far = out.str();
    out << "#line " << std::count(so_far.begin(), so_far.end(), '\n') + 2 << " " << quoted(argv[2]) << "\n\n";
    tests << "TEST_CASE(" << quoted("readme: the C++ of section '" + s.title + "' compiles and runs") << ") {\n"
          << "  std::string output, error;\n"
          << "  {\n"
          << "    CaptureCout capture;\n"
          << "    try {\n"
          << "      readme_section_" << index << "();\n"
          << "    } catch (const std::exception &e) {\n"
          << "      error = e.what();\n"
          << "    }\n"
          << "    output = capture.text.str();\n"
          << "  }\n"
          << "  INFO(\"what it printed:\\n\" << output);\n"
          << "  CHECK_MESSAGE(error.empty(), \"it threw: \" << error);\n"
          << "}\n\n";
  }
  out << "} // namespace\n\nTEST_SUITE_BEGIN(\"readme\");\n\n" << tests.str() << "TEST_SUITE_END();\n";

  // Written only when it changes, so an edit of the README's prose does not
  // recompile the tests.
  const std::string text = out.str();
  std::ifstream old(argv[2]);
  std::stringstream previous;
  previous << old.rdbuf();
  if (old && previous.str() == text)
    return 0;
  std::ofstream file(argv[2]);
  file << text;
  return file ? 0 : 2;
}
