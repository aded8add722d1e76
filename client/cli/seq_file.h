// Sequence files of the kvq CLI: the K/V of one sequence as a safetensors file.
//
// Tensors "layer.{l}.keys" and "layer.{l}.values", shape [kv_heads, tokens, head_dim], dtype
// F16, BF16 or F32 (little-endian), for layers 0..L-1 with no gaps; keys and values of a layer
// share shape and dtype. "__metadata__" holds strings: "format": "kvq-sequence", and
// optionally "model", "basis_version", "sequence_id". An optional tensor "token_ids", U32
// [tokens] (every layer's token count), holds the tokens' ids: `kvq seq put` then sends them,
// so that the server shares the prefix with other sequences of the tenant (docs/API.md).
// `kvq seq get` writes this, `kvq seq put` reads it, and any safetensors library (Python's
// `safetensors`, numpy) can make or read it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::client {

struct SeqLayer {
  v1::DType dtype = v1::DTYPE_F16;
  int64_t kv_heads = 0, tokens = 0, head_dim = 0;
  std::string keys, values;  // raw little-endian bytes, [kv_heads, tokens, head_dim]
};

struct SeqFile {
  std::vector<SeqLayer> layers;
  std::vector<uint32_t> token_ids;  // empty, or one per token
  std::map<std::string, std::string> metadata;
};

absl::Status WriteSeqFile(const std::string& path, const SeqFile& file);
absl::StatusOr<SeqFile> ReadSeqFile(const std::string& path);

}  // namespace kvq::client
