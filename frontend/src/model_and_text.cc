#include "kvq/frontend/model_and_text.h"

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"
#include "kvq/frontend/model_files.h"

namespace kvq::frontend {

absl::StatusOr<ModelAndText> LoadModelAndText(const std::string& model_path,
                                              const std::string& text_path) {
  ModelAndText m;
  ASSIGN_OR_RETURN(m.file, GgufFile::Open(model_path));
  ASSIGN_OR_RETURN(m.tokenizer, Tokenizer::FromGguf(*m.file));
  ASSIGN_OR_RETURN(m.model, LlamaModel::Load(*m.file));
  ASSIGN_OR_RETURN(std::string text, ReadFile(text_path));
  m.ids = m.tokenizer->Encode(text);
  return m;
}

absl::StatusOr<core::ModelBasis> ReadBasisFor(const LlamaConfig& model, const std::string& dir) {
  ASSIGN_OR_RETURN(core::ModelBasis basis, core::ReadBasis(dir));
  const char* layout = RopeLayoutName(model.rope_layout);
  if (basis.manifest.rope_layout != layout) {
    return absl::InvalidArgumentError(absl::StrCat("basis ", dir, " has rope_layout ",
                                                   basis.manifest.rope_layout, ", the model (",
                                                   model.arch, ") needs ", layout));
  }
  return basis;
}

}  // namespace kvq::frontend
