// kvq-calibrate --bits B chooses the codec, and kvq-eval --configs calibrated evaluates it:
// the built tools on the tiny synthetic Llama with a byte-level tokenizer (tiny_model.h),
// with a couple of short windows so that the whole search takes about a second.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvq/core/codec_json.h"
#include "kvq/core/store.h"
#include "kvq/frontend/codec_search.h"
#include "nlohmann/json.hpp"
#include "tiny_model.h"
#include "tool_run.h"

namespace kvq::frontend {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class CalibrateCodec : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/calibrate_codec_" + std::to_string(::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    TinyOptions o;
    o.byte_tokenizer = true;
    o.output_scale = 0.05f;  // logits of a few units: perplexities of tens, not 1e24
    model_ = WriteTinyModel(o);
    // Byte tokens: 4000 bytes of text are 4000 tokens (no merges).
    text_ = dir_ + "/valid.txt";
    std::ofstream t(text_);
    for (int i = 0; t.tellp() < 4000; ++i)
      t << "The " << i << "th line of validation text holds words, digits and punctuation. ";
  }
  void TearDown() override {
    fs::remove_all(dir_);
    fs::remove(model_);
  }

  ToolRun Run(const std::string& bin, const std::string& args) { return RunTool(bin, args, dir_); }
  // Calibration on 512 tokens, the search on 2 windows of 256 (a G = 128 group is encoded
  // in each), one thread.
  ToolRun Calibrate(const std::string& out, const std::string& extra) {
    return Run(KVQ_CALIBRATE_BIN,
               absl::StrCat("--model ", model_, " --text ", text_, " --out ", out,
                            " --tokens 512 --window-len 256 --rank 4 --threads 1"
                            " --search-windows 2 --search-window-len 256 ",
                            extra));
  }
  ToolRun Eval(const std::string& basis, const std::string& configs, const std::string& json) {
    return Run(
        KVQ_EVAL_BIN,
        absl::StrCat("--model ", model_, " --text ", text_, " --basis ", basis,
                     " --windows 2 --window-len 256 --first-token 512 --threads 1 --configs ",
                     configs, json.empty() ? "" : " --json " + json));
  }
  static nlohmann::json ReadJson(const std::string& path) {
    std::ifstream in(path);
    return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  }

  // Checks codec-search.json in `entry` against the budget and codec.json; returns the chosen row.
  nlohmann::json CheckSearch(const std::string& entry, double max_bits) {
    const nlohmann::json s = ReadJson(entry + "/codec-search.json");
    EXPECT_TRUE(s.is_object()) << "codec-search.json";
    if (!s.is_object()) return {};
    EXPECT_EQ(s["max_bits_per_element"], max_bits);
    EXPECT_EQ(s["text"], text_);
    EXPECT_EQ(s["windows"], 2);
    EXPECT_EQ(s["window_len"], 256);
    // The search's windows follow the 512 calibration tokens: none of them fitted the basis.
    EXPECT_EQ(s["first_token"], 512);
    // Stage 1: each key lever on the probe codec (the same bits); the lowest validation PPL
    // names the lever, or the earliest lever within kChoiceNoiseMargin of it (a near-tie).
    const nlohmann::json& levers = s["key_lever_search"];
    EXPECT_TRUE(levers.is_object());
    if (!levers.is_object()) return {};
    double lowest_lever = std::numeric_limits<double>::infinity();
    for (const nlohmann::json& r : levers["candidates"]) {
      EXPECT_EQ(r["name"].get<std::string>().rfind(kLeverProbe, 0), 0u) << r["name"];
      lowest_lever = std::min(lowest_lever, r["ppl"].get<double>());
    }
    double best_lever = 0;
    std::string lever_name;
    for (const nlohmann::json& r : levers["candidates"]) {
      if (lever_name.empty() && r["ppl"].get<double>() <= lowest_lever * (1 + kChoiceNoiseMargin)) {
        best_lever = r["ppl"].get<double>();
        lever_name = r["name"];
      }
    }
    EXPECT_EQ(levers["chosen"], lever_name);
    EXPECT_EQ(WithKeyLever(kLeverProbe, s["key_lever"].get<std::string>()), lever_name);
    // Stage 1b: the probe with that lever and fp16 sinks; the sinks lever taken when its
    // perplexity is lower.
    const nlohmann::json& sink_probe = s["sink_lever_search"]["candidates"];
    EXPECT_EQ(sink_probe.size(), 1u);
    EXPECT_EQ(sink_probe[0]["name"], lever_name + "-" + kSinkLever);
    const bool sinks = sink_probe[0]["ppl"].get<double>() < best_lever;
    EXPECT_EQ(s["sink_lever"], sinks ? kSinkLever : "");
    // Stage 1c: the probe so far with dense-and-sparse; taken when its perplexity is lower by
    // at least kSparseLeverMinGain.
    const std::string so_far = sinks ? sink_probe[0]["name"].get<std::string>() : lever_name;
    const double so_far_ppl = sinks ? sink_probe[0]["ppl"].get<double>() : best_lever;
    const nlohmann::json& sparse_probe = s["sparse_lever_search"]["candidates"];
    EXPECT_EQ(sparse_probe.size(), 1u);
    EXPECT_EQ(sparse_probe[0]["name"], WithSparseLever(so_far));
    const bool sparse =
        sparse_probe[0]["name"] != so_far &&
        sparse_probe[0]["ppl"].get<double>() < so_far_ppl * (1 - kSparseLeverMinGain);
    EXPECT_EQ(s["sparse_lever"], sparse);
    // Stage 2: every candidate of the list with that lever (and once more with the sinks
    // when they paid, and with dense-and-sparse when it paid), in its order, with its bits;
    // over the budget: skipped.
    std::vector<std::string> names;
    for (const std::string& n : CodecSearchCandidates()) {
      names.push_back(WithKeyLever(n, s["key_lever"].get<std::string>()));
      if (sinks) names.push_back(names.back() + "-" + kSinkLever);
      if (sparse && WithSparseLever(names.back()) != names.back())
        names.push_back(WithSparseLever(names.back()));
    }
    EXPECT_EQ(s["candidates"].size(), names.size());
    nlohmann::json chosen;
    int n_chosen = 0, evaluated = 0;
    double best = std::numeric_limits<double>::infinity();
    std::vector<std::pair<double, double>> evaluated_rows;  // (bits, ppl)
    for (size_t i = 0; i < s["candidates"].size() && i < names.size(); ++i) {
      const nlohmann::json& r = s["candidates"][i];
      EXPECT_EQ(r["name"], names[i]);
      const double bits = r["bits_per_element"].get<double>();
      EXPECT_NEAR(bits,
                  (r["k_bits"].get<double>() + r["v_bits"].get<double>()) / 2 +
                      r["sink_bits"].get<double>(),
                  1e-9);
      // The sinks' 16-bit rows at the search's window length.
      EXPECT_DOUBLE_EQ(r["sink_bits"].get<double>(),
                       names[i].find(kSinkLever) == std::string::npos
                           ? 0.0
                           : 16.0 * 4 / s["window_len"].get<double>());
      if (bits > max_bits) {
        EXPECT_TRUE(r["ppl"].is_null()) << names[i];
        EXPECT_TRUE(r.contains("skipped")) << names[i];
        EXPECT_FALSE(r["chosen"].get<bool>()) << names[i];
        continue;
      }
      ++evaluated;
      EXPECT_TRUE(r["ppl"].is_number()) << names[i];
      EXPECT_GT(r["ppl"].get<double>(), 1.0) << names[i];
      best = std::min(best, r["ppl"].get<double>());
      evaluated_rows.emplace_back(bits, r["ppl"].get<double>());
      if (r["chosen"].get<bool>()) {
        ++n_chosen;
        chosen = r;
      }
    }
    EXPECT_GT(evaluated, 0);
    EXPECT_EQ(n_chosen, 1);
    if (n_chosen != 1) return {};
    EXPECT_EQ(s["chosen"], chosen["name"]);
    // The lowest validation perplexity wins, or a near-tie (within kChoiceNoiseMargin of it)
    // with fewer bits: no other near-tie has fewer bits than the chosen row.
    EXPECT_LE(chosen["ppl"].get<double>(), best * (1 + kChoiceNoiseMargin));
    for (const auto& [bits, ppl] : evaluated_rows) {
      if (ppl <= best * (1 + kChoiceNoiseMargin)) {
        EXPECT_GE(bits, chosen["bits_per_element"].get<double>()) << "a near-tie with fewer bits";
      }
    }
    EXPECT_LE(chosen["bits_per_element"].get<double>(), max_bits);
    // codec.json is the chosen codec, in the registry's format.
    const nlohmann::json codec = ReadJson(entry + "/codec.json");
    EXPECT_EQ(codec, chosen["settings"]);
    return chosen;
  }

  std::string dir_, model_, text_;
};

TEST_F(CalibrateCodec, BitsChoosesTheBestCandidateWithinTheBudgetAndEvalReadsItBack) {
  const std::string entry = dir_ + "/entry";
  ToolRun cal = Calibrate(entry, "--bits 3,2.6");
  ASSERT_EQ(cal.code, 0) << cal.err;
  const nlohmann::json chosen = CheckSearch(entry, 3.0);
  ASSERT_TRUE(chosen.is_object());
  // The second budget is chosen from the same rows: the lowest PPL at <= 2.6 bits.
  const nlohmann::json s = ReadJson(entry + "/codec-search.json");
  ASSERT_EQ(s["budgets"].size(), 2u);
  EXPECT_EQ(s["budgets"][0]["chosen"], chosen["name"]);
  double best_small = std::numeric_limits<double>::infinity();
  std::string small;
  for (const nlohmann::json& r : s["candidates"])
    if (r["ppl"].is_number() && r["bits_per_element"].get<double>() <= 2.6 &&
        r["ppl"].get<double>() < best_small) {
      best_small = r["ppl"].get<double>();
      small = r["name"];
    }
  EXPECT_EQ(s["budgets"][1]["chosen"], small);
  EXPECT_LE(s["budgets"][1]["bits_per_element"].get<double>(), 2.6);
  EXPECT_THAT(cal.out, HasSubstr(chosen["name"].get<std::string>() + " "));
  EXPECT_THAT(cal.out, HasSubstr("<- chosen"));
  EXPECT_THAT(cal.out, HasSubstr("skipped: "));

  // kvq-eval --configs calibrated evaluates exactly that codec: on the same windows
  // (--first-token 512) it gives
  // the search's perplexity, the same as the chosen config by name, and kvq-eval's measured
  // bits columns are the search's.
  const std::string js = dir_ + "/eval.json";
  const std::string name = chosen["name"];
  ToolRun ev = Eval(entry, "calibrated," + name, js);
  ASSERT_EQ(ev.code, 0) << ev.err;
  const nlohmann::json e = ReadJson(js);
  ASSERT_TRUE(e.is_object());
  ASSERT_EQ(e["rows"].size(), 2u);
  const nlohmann::json& cal_row = e["rows"][0];
  EXPECT_EQ(cal_row["config"], "calibrated");
  EXPECT_EQ(cal_row["codec"], chosen["codec"]);
  EXPECT_EQ(cal_row["codec_settings"], chosen["settings"]);
  EXPECT_EQ(cal_row["codec_file"], entry + "/codec.json");
  EXPECT_EQ(cal_row["ppl"], chosen["ppl"]);
  EXPECT_EQ(cal_row["ppl"], e["rows"][1]["ppl"]);
  EXPECT_DOUBLE_EQ(cal_row["k_bits"].get<double>(), chosen["k_bits"].get<double>());
  EXPECT_DOUBLE_EQ(cal_row["v_bits"].get<double>(), chosen["v_bits"].get<double>());
  EXPECT_LE((cal_row["k_bits"].get<double>() + cal_row["v_bits"].get<double>()) / 2, 3.0);
  EXPECT_THAT(ev.out, HasSubstr(chosen["codec"].get<std::string>()));

  // The registry loads the entry with that codec (what a server serves it with when it is
  // registered without an explicit codec).
  auto basis = core::ReadBasis(entry);
  ASSERT_TRUE(basis.ok()) << basis.status();
  const std::string reg = dir_ + "/registry";
  const std::string at =
      absl::StrCat(reg, "/", basis->manifest.model, "/v", basis->manifest.version);
  fs::create_directories(at);
  fs::copy(entry, at, fs::copy_options::recursive);
  core::Registry registry(reg);
  std::vector<std::string> loaded, skipped;
  ASSERT_TRUE(registry.LoadAll(&loaded, &skipped).ok());
  EXPECT_THAT(skipped, ::testing::IsEmpty());
  auto served = registry.Get(basis->manifest.model, 0);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(core::CodecToJson((*served)->codec), chosen["settings"]);

  // --search-only: another budget for the same basis, without calibrating again.
  const auto basis_time = fs::last_write_time(entry + "/basis.safetensors");
  ToolRun again = Calibrate(entry, "--bits 2.6 --search-only");
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(fs::last_write_time(entry + "/basis.safetensors"), basis_time);
  const nlohmann::json low = CheckSearch(entry, 2.6);
  ASSERT_TRUE(low.is_object());
  EXPECT_LE(low["bits_per_element"].get<double>(), 2.6);
}

TEST_F(CalibrateCodec, ImpossibleBudgetIsAnErrorNamingTheSmallestCandidate) {
  const std::string entry = dir_ + "/entry";
  ToolRun cal = Calibrate(entry, "--bits 2");
  EXPECT_EQ(cal.code, 1) << cal.err;
  EXPECT_THAT(cal.err, HasSubstr("--bits 2.000: no codec candidate fits"));
  EXPECT_THAT(cal.err, HasSubstr("the smallest, kivi-kv2-g128-vg64, costs 2.391 bits per element"));
  // Refused before calibrating: nothing written.
  EXPECT_FALSE(fs::exists(entry + "/manifest.json"));
  EXPECT_FALSE(fs::exists(entry + "/codec.json"));

  EXPECT_EQ(Calibrate(entry, "--bits x").code, 1);
  ToolRun only = Calibrate(entry, "--search-only");
  EXPECT_EQ(only.code, 1);
  EXPECT_THAT(only.err, HasSubstr("--search-only needs --bits B"));
}

TEST_F(CalibrateCodec, WithoutBitsNoCodecIsChosenAndCalibratedNeedsCodecJson) {
  const std::string entry = dir_ + "/entry";
  ToolRun cal = Calibrate(entry, "");
  ASSERT_EQ(cal.code, 0) << cal.err;
  EXPECT_TRUE(fs::exists(entry + "/manifest.json"));
  EXPECT_FALSE(fs::exists(entry + "/codec.json"));
  EXPECT_FALSE(fs::exists(entry + "/codec-search.json"));
  ToolRun ev = Eval(entry, "dense,calibrated", "");
  EXPECT_EQ(ev.code, 1);
  EXPECT_THAT(ev.err, HasSubstr(entry + "/codec.json does not exist"));
  ToolRun no_basis = Run(KVQ_EVAL_BIN, absl::StrCat("--model ", model_, " --configs calibrated"));
  EXPECT_EQ(no_basis.code, 1);
  EXPECT_THAT(no_basis.err, HasSubstr("give --basis DIR"));
  // The search's windows must fit after the calibration tokens: 512 + 14 x 256 > 4000.
  ToolRun short_text = Calibrate(entry, "--bits 3 --search-only --search-windows 14");
  EXPECT_EQ(short_text.code, 1);
  EXPECT_THAT(short_text.err, HasSubstr("the search needs the basis's 512 calibration tokens + "
                                        "--search-windows 14 x --search-window-len 256"));
  EXPECT_FALSE(fs::exists(entry + "/codec.json"));
}

}  // namespace
}  // namespace kvq::frontend
