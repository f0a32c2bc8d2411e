#include "model/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpu/error.h"
#include "gpu/file_check.h"
#include "gpu/json_fields.h"

namespace disagg::gpu::safetensors {

using json = nlohmann::json;

size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "F16" || dtype == "BF16") return 2;
  return 0;
}

std::map<std::string, Tensor> parse(const uint8_t* data, size_t size, const std::string& path) {
  if (size < 8) throw Error(path + ": truncated: no safetensors header length");
  uint64_t header = 0;
  std::memcpy(&header, data, 8);
  if (header > kMaxHeaderBytes || header > size - 8)
    throw Error(path + ": safetensors header of " + std::to_string(header) + " bytes (the file has " +
                std::to_string(size) + ", the limit is " + std::to_string(kMaxHeaderBytes) + ")");
  json j;
  try {
    j = parse_file_json(reinterpret_cast<const char*>(data + 8), reinterpret_cast<const char*>(data + 8 + header));
  } catch (const JsonNestedTooDeep&) {
    throw Error(path + ": the safetensors header nests deeper than " + std::to_string(kMaxFileJsonDepth) + " levels");
  } catch (const json::exception& e) {
    throw Error(path + ": the safetensors header is not JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(path + ": the safetensors header is not a JSON object");
  const size_t data_start = 8 + size_t(header), data_size = size - data_start;
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : j.items()) {
    if (name == "__metadata__") continue;
    const std::string where = path + ": tensor " + name;
    if (!t.is_object() || !t.contains("dtype") || !t["dtype"].is_string() || !t.contains("shape") ||
        !t["shape"].is_array() || !t.contains("data_offsets") || !t["data_offsets"].is_array() ||
        t["data_offsets"].size() != 2)
      throw Error(where + ": needs dtype, shape and data_offsets [begin, end]");
    Tensor x;
    x.dtype = t["dtype"].get<std::string>();
    uint64_t count = 1;
    for (const json& d : t["shape"]) {
      if (!d.is_number_unsigned()) throw Error(where + ": shape " + t["shape"].dump() + " is not of non-negative integers");
      const uint64_t v = d.get<uint64_t>();
      if (v > (uint64_t(1) << 40) || (v && count > (uint64_t(1) << 58) / v))  // count * 8 bytes fits
        throw Error(where + ": shape " + t["shape"].dump() + " is too large");
      count *= v;
      x.shape.push_back(int64_t(v));
    }
    const json& offsets = t["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
      throw Error(where + ": data_offsets " + offsets.dump() + " are not non-negative integers");
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_size)
      throw Error(where + ": data_offsets " + offsets.dump() + " outside the " + std::to_string(data_size) +
                  " bytes of data");
    x.offset = data_start + size_t(begin);
    x.bytes = size_t(end - begin);
    if (const size_t each = dtype_bytes(x.dtype); each && count * each != x.bytes)
      throw Error(where + ": " + std::to_string(x.bytes) + " bytes for " + std::to_string(count) + " " + x.dtype +
                  " values");
    out.emplace(name, std::move(x));
  }
  // No two tensors share bytes (lm_head's offsets equal to embed_tokens'
  // would make one tensor read as both): sorted by offset, each tensor ends
  // where or before the next begins. Empty tensors hold no bytes to share.
  std::vector<std::pair<const std::string*, const Tensor*>> by_offset;
  for (const auto& [name, t] : out)
    if (t.bytes > 0) by_offset.emplace_back(&name, &t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto& a, const auto& b) { return a.second->offset < b.second->offset; });
  for (size_t k = 1; k < by_offset.size(); ++k) {
    const auto& [a_name, a] = by_offset[k - 1];
    const auto& [b_name, b] = by_offset[k];
    if (b->offset - a->offset < a->bytes)
      throw Error(path + ": tensors " + *a_name + " and " + *b_name + " overlap: " + *a_name + "'s data_offsets [" +
                  std::to_string(a->offset - data_start) + ", " + std::to_string(a->offset - data_start + a->bytes) +
                  "] run into " + *b_name + "'s [" + std::to_string(b->offset - data_start) + ", " +
                  std::to_string(b->offset - data_start + b->bytes) + "]");
  }
  return out;
}

void write(const std::string& path, const std::map<std::string, Input>& tensors) {
  json header = json::object();
  uint64_t at = 0;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.data.size()}}};
    at += t.data.size();
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text += ' ';  // the data 8-byte aligned, as the reference writer pads
  OutputFile file = OutputFile::create(path);  // (whole or not at all)
  std::FILE* f = file.stream();
  const uint64_t n = text.size();
  bool ok = std::fwrite(&n, 8, 1, f) == 1 && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  for (const auto& [name, t] : tensors) ok = ok && std::fwrite(t.data.data(), 1, t.data.size(), f) == t.data.size();
  if (!ok) throw Error(path + ": write failed: " + errno_text());
  file.commit();
}

}  // namespace disagg::gpu::safetensors
