// Runs a fuzz target over files and directories of inputs (its committed corpus and the inputs
// that once failed), so every build checks them without libFuzzer: replay TARGET INPUT...
#include "fuzz_input.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

int main(int argc, char** argv) {
  const auto& targets = ztrain::fuzz::targets();
  if (argc < 2 || !targets.contains(argv[1])) {
    std::cerr << "usage: replay TARGET INPUT... with TARGET one of:";
    for (const auto& [name, target] : targets) std::cerr << " " << name;
    std::cerr << std::endl;
    return 2;
  }
  const auto target = targets.at(argv[1]);
  std::vector<std::filesystem::path> inputs;
  for (int i = 2; i < argc; ++i) {
    if (std::filesystem::is_directory(argv[i])) {
      for (const auto& e : std::filesystem::recursive_directory_iterator(argv[i])) {
        if (e.is_regular_file()) inputs.push_back(e.path());
      }
    } else {
      inputs.emplace_back(argv[i]);
    }
  }
  std::sort(inputs.begin(), inputs.end());
  for (const auto& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      std::cerr << "replay: cannot read " << path << std::endl;
      return 1;
    }
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    target(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::filesystem::remove_all(ztrain::fuzz::scratch_dir());
  std::cout << "replay " << argv[1] << ": " << inputs.size() << " inputs, no finding" << std::endl;
  return inputs.empty() ? 1 : 0;
}
