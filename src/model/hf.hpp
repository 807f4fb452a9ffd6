// hf.hpp — a Hugging Face model directory, all of it: config.json
// (model/hf_config.hpp), the safetensors weights (model/safetensors.hpp) and the
// tokenizer files served beside them (model/tokenizer_files.hpp).
//
// Owns nothing itself. Include the narrow header a file needs; this one serves
// the files that use all three (src/train, src/main.cpp) until they narrow.
#pragma once

#include "model/hf_config.hpp"
#include "model/safetensors.hpp"
#include "model/tokenizer_files.hpp"
