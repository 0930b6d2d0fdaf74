// golden_model.h — the dp model a golden file (tests/golden) was made from: its metadata's "model"
// (mlp, convnet, resnet8) and, for the MLP, "hidden" sizes ("32,17"); values are the golden's
// init.* to load.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dp/io/safetensors.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/models/resnet.h"

namespace dp::test {

inline std::vector<int> parse_hidden(const std::string& text) {
  std::vector<int> out;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t comma = text.find(',', pos);
    out.push_back(std::stoi(text.substr(pos, comma - pos)));
    pos = comma == std::string::npos ? text.size() : comma + 1;
  }
  return out;
}

inline std::unique_ptr<Model> golden_model(const safetensors::File& golden, Device& device) {
  const std::string kind = golden.metadata.at("model");
  if (kind == "convnet") return models::make_convnet(device, 1);
  if (kind == "resnet8") return models::make_resnet8(device, 1);
  return models::make_mlp(device, parse_hidden(golden.metadata.at("hidden")), 1);
}

}  // namespace dp::test
