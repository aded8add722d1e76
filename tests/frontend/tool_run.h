// Runs a built tool (a frontend tool, the kvq CLI) as a user would, for the tests that check
// what it prints, writes and exits with.
#ifndef KVQ_TESTS_FRONTEND_TOOL_RUN_H_
#define KVQ_TESTS_FRONTEND_TOOL_RUN_H_

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

namespace kvq::frontend {

struct ToolRun {
  int code = -1;    // exit status (-1: killed)
  std::string out;  // stdout
  std::string err;  // stderr
};

// `bin args` through the shell, stdin empty; stdout and stderr pass through files in
// `scratch_dir` (an existing folder).
inline ToolRun RunTool(const std::string& bin, const std::string& args,
                       const std::string& scratch_dir) {
  const std::string out = scratch_dir + "/stdout", err = scratch_dir + "/stderr";
  const std::string cmd = bin + " " + args + " >" + out + " 2>" + err + " </dev/null";
  const int st = std::system(cmd.c_str());
  auto slurp = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, slurp(out), slurp(err)};
}

}  // namespace kvq::frontend

#endif  // KVQ_TESTS_FRONTEND_TOOL_RUN_H_
