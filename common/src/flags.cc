#include "kvq/common/flags.h"

#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace kvq::common {

void FlagSet::Add(std::string name, std::string value_name, std::string help, Setter set) {
  flags_.push_back({std::move(name), std::move(value_name), std::move(help), std::move(set)});
}

void FlagSet::AddBool(std::string name, std::string help, bool* value) {
  Flag f{std::move(name), "", std::move(help), [value](const std::string& v) {
           const std::string s = absl::AsciiStrToLower(v);
           if (s.empty() || s == "1" || s == "true" || s == "yes" || s == "on") {
             *value = true;
             return true;
           }
           if (s == "0" || s == "false" || s == "no" || s == "off") {
             *value = false;
             return true;
           }
           return false;
         }};
  f.is_bool = true;
  flags_.push_back(std::move(f));
}

std::string FlagSet::EnvName(const std::string& flag) {
  return "KVQ_" + absl::AsciiStrToUpper(absl::StrReplaceAll(flag, {{"-", "_"}}));
}

absl::Status FlagSet::Parse(int argc, char** argv, int first,
                            std::vector<std::string>* positional) {
  for (const Flag& f : flags_) {
    if (f.name == "help") continue;
    const char* v = std::getenv(EnvName(f.name).c_str());
    if (v == nullptr) continue;
    if (!f.set(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad value '", v, "' in ", EnvName(f.name), " (", f.value_name, ")"));
    }
  }
  bool flags_done = false;
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (flags_done || arg.rfind("--", 0) != 0 || arg == "-") {
      positional->push_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    absl::StrReplaceAll({{"_", "-"}}, &name);
    const Flag* flag = nullptr;
    for (const Flag& f : flags_) {
      if (f.name == name) flag = &f;
    }
    if (flag == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    if (!has_value && !flag->is_bool) {
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " needs a value (", flag->value_name, ")"));
      }
      value = argv[++i];
    }
    if (!flag->set(value)) {
      return absl::InvalidArgumentError(absl::StrCat("bad value '", value, "' for --", name,
                                                     flag->is_bool ? "" : " (", flag->value_name,
                                                     flag->is_bool ? "" : ")"));
    }
  }
  return absl::OkStatus();
}

std::string FlagSet::Help() const {
  std::string out;
  for (const Flag& f : flags_) {
    absl::StrAppend(&out, "  --", f.name, f.value_name.empty() ? "" : " ", f.value_name, "\n      ",
                    f.help);
    if (f.name != "help") absl::StrAppend(&out, "  [env ", EnvName(f.name), "]");
    absl::StrAppend(&out, "\n");
  }
  return out;
}

bool ParseDurationFlag(const std::string& s, absl::Duration* out) {
  if (absl::ParseDuration(s, out)) return *out >= absl::ZeroDuration();
  double secs = 0;  // a bare number: seconds
  if (absl::SimpleAtod(s, &secs) && secs >= 0) {
    *out = absl::Seconds(secs);
    return true;
  }
  return false;
}
bool ParseIntFlag(const std::string& s, int* out) { return absl::SimpleAtoi(s, out); }
bool ParseInt64Flag(const std::string& s, int64_t* out) { return absl::SimpleAtoi(s, out); }
bool ParseDoubleFlag(const std::string& s, double* out) { return absl::SimpleAtod(s, out); }

}  // namespace kvq::common
