// A small JSON reader: enough for a module's metadata (docs/module-abi.md)
// without a third-party library, since the server links the C library alone.
//
//   tether::JsonValue doc;
//   std::string error;
//   if (!tether::parse_json("{\"name\": \"mlp\", \"shape\": [1, 10]}", &doc, &error)) ...
//   doc.get("name")->text;                 // "mlp"
//   doc.get("shape")->items[1].number;     // 10
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tether {

struct JsonValue {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = kNull;
  bool boolean = false;
  double number = 0;
  bool integral = false;  // the number was written without fraction or exponent
  int64_t integer = 0;    // its value when integral (and within int64_t)
  std::string text;
  std::vector<JsonValue> items;                            // kArray
  std::vector<std::pair<std::string, JsonValue>> members;  // kObject, in document order

  // The member named `key` of an object (the last one if repeated), or nullptr.
  const JsonValue* get(const std::string& key) const;
};

// Parses `text` (UTF-8) into *out. On failure returns false and sets *error to
// what is wrong and at which byte offset.
bool parse_json(const std::string& text, JsonValue* out, std::string* error);

}  // namespace tether
