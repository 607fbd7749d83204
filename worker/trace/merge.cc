#include "worker/trace/merge.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace concord::trace {

absl::StatusOr<MergeResult> MergeTraceFiles(
    const std::vector<std::string>& inputs, const std::string& output) {
  std::ofstream out(output, std::ios::trunc);
  if (!out) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot write the trace file ", output, ": ", std::strerror(errno)));
  }
  MergeResult result;
  out << "[";
  for (const std::string& path : inputs) {
    std::ifstream in(path);
    if (!in) continue;
    ++result.files;
    std::string line;
    while (std::getline(in, line)) {
      absl::string_view event = absl::StripAsciiWhitespace(line);
      if (event == "[" || event == "]" || event.empty()) continue;
      if (absl::ConsumePrefix(&event, ",")) {
        event = absl::StripLeadingAsciiWhitespace(event);
      }
      // Whole events only: a writer killed mid-line leaves a partial one.
      auto parsed = nlohmann::json::parse(event.begin(), event.end(), nullptr,
                                          /*allow_exceptions=*/false);
      if (parsed.is_discarded() || !parsed.is_object()) {
        ++result.skipped_lines;
        continue;
      }
      out << (result.events == 0 ? "\n" : ",\n") << parsed.dump();
      ++result.events;
    }
  }
  out << "\n]\n";
  out.flush();
  if (!out) {
    return absl::InvalidArgumentError(
        absl::StrCat("writing the trace file ", output, " failed"));
  }
  return result;
}

}  // namespace concord::trace
