#include "json.hpp"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tether {

const JsonValue* JsonValue::get(const std::string& key) const {
  if (kind != kObject) return nullptr;
  for (size_t i = members.size(); i-- > 0;) {
    if (members[i].first == key) return &members[i].second;
  }
  return nullptr;
}

namespace {

// Metadata nests four levels deep; the limit only keeps a hostile file from
// exhausting the stack.
constexpr int kMaxDepth = 64;

class Reader {
 public:
  explicit Reader(const std::string& text) : s_(text) {}

  bool document(JsonValue* out) {
    if (!value(out, 0)) return false;
    skip_space();
    if (pos_ != s_.size()) return fail("unexpected text after the JSON value");
    return true;
  }

  const std::string& error() const { return error_; }

 private:
  bool fail(const char* what) {
    char where[48];
    snprintf(where, sizeof where, " at byte %zu", pos_);
    error_ = std::string(what) + where;
    return false;
  }

  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool literal(const char* word) {
    size_t n = strlen(word);
    if (s_.compare(pos_, n, word) != 0) return fail("invalid literal");
    pos_ += n;
    return true;
  }

  bool value(JsonValue* out, int depth) {
    if (depth > kMaxDepth) return fail("JSON nested too deeply");
    skip_space();
    if (pos_ >= s_.size()) return fail("unexpected end of JSON");
    char c = s_[pos_];
    if (c == '{') return object(out, depth);
    if (c == '[') return array(out, depth);
    if (c == '"') {
      out->kind = JsonValue::kString;
      return string(&out->text);
    }
    if (c == 't') {
      out->kind = JsonValue::kBool;
      out->boolean = true;
      return literal("true");
    }
    if (c == 'f') {
      out->kind = JsonValue::kBool;
      out->boolean = false;
      return literal("false");
    }
    if (c == 'n') {
      out->kind = JsonValue::kNull;
      return literal("null");
    }
    if (c == '-' || (c >= '0' && c <= '9')) return number(out);
    return fail("unexpected character");
  }

  // Consumes the opening bracket; true when `close` follows at once.
  bool empty_container(char close) {
    ++pos_;
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == close) {
      ++pos_;
      return true;
    }
    return false;
  }

  // After an element: a ',' (*more) or the closing bracket must follow.
  bool next_element(char close, bool* more) {
    skip_space();
    *more = pos_ < s_.size() && s_[pos_] == ',';
    if (*more || (pos_ < s_.size() && s_[pos_] == close)) {
      ++pos_;
      return true;
    }
    return fail(close == '}' ? "expected ',' or '}'" : "expected ',' or ']'");
  }

  bool object(JsonValue* out, int depth) {
    out->kind = JsonValue::kObject;
    if (empty_container('}')) return true;
    for (bool more = true; more;) {
      skip_space();
      if (pos_ >= s_.size() || s_[pos_] != '"') return fail("expected a string key");
      out->members.emplace_back();
      if (!string(&out->members.back().first)) return false;
      skip_space();
      if (pos_ >= s_.size() || s_[pos_] != ':') return fail("expected ':'");
      ++pos_;
      if (!value(&out->members.back().second, depth + 1) || !next_element('}', &more)) return false;
    }
    return true;
  }

  bool array(JsonValue* out, int depth) {
    out->kind = JsonValue::kArray;
    if (empty_container(']')) return true;
    for (bool more = true; more;) {
      out->items.emplace_back();
      if (!value(&out->items.back(), depth + 1) || !next_element(']', &more)) return false;
    }
    return true;
  }

  bool hex4(uint32_t* out) {
    if (pos_ + 4 > s_.size()) return fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= c - '0';
      else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
      else return fail("invalid \\u escape");
    }
    *out = v;
    return true;
  }

  static void append_utf8(std::string* out, uint32_t cp) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  // One multi-byte UTF-8 character, checked (JSON text is UTF-8, and the
  // strings end up in protobuf messages, which must be).
  bool utf8_sequence(std::string* out) {
    unsigned char lead = static_cast<unsigned char>(s_[pos_]);
    size_t length = 0;
    if (lead >= 0xC2 && lead <= 0xDF) length = 2;
    else if (lead >= 0xE0 && lead <= 0xEF) length = 3;
    else if (lead >= 0xF0 && lead <= 0xF4) length = 4;
    if (length == 0 || pos_ + length > s_.size()) return fail("invalid UTF-8 in string");
    uint32_t cp = lead & (0x7F >> length);
    for (size_t i = 1; i < length; ++i) {
      unsigned char next = static_cast<unsigned char>(s_[pos_ + i]);
      if ((next & 0xC0) != 0x80) return fail("invalid UTF-8 in string");
      cp = (cp << 6) | (next & 0x3F);
    }
    static const uint32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kLeast[length] || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) {
      return fail("invalid UTF-8 in string");
    }
    out->append(s_, pos_, length);
    pos_ += length;
    return true;
  }

  bool string(std::string* out) {
    ++pos_;  // opening quote
    while (true) {
      if (pos_ >= s_.size()) return fail("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return true;
      unsigned char byte = static_cast<unsigned char>(c);
      if (byte < 0x20) return fail("control character in string");
      if (byte >= 0x80) {
        --pos_;
        if (!utf8_sequence(out)) return false;
        continue;
      }
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) return fail("unterminated string");
      char e = s_[pos_++];
      switch (e) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t cp;
          if (!hex4(&cp)) return false;
          if (cp >= 0xD800 && cp < 0xDC00) {  // high surrogate: a low one must follow
            uint32_t low;
            if (s_.compare(pos_, 2, "\\u") != 0) return fail("unpaired surrogate in \\u escape");
            pos_ += 2;
            if (!hex4(&low)) return false;
            if (low < 0xDC00 || low >= 0xE000) return fail("unpaired surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            return fail("unpaired surrogate in \\u escape");
          }
          append_utf8(out, cp);
          break;
        }
        default:
          return fail("invalid escape in string");
      }
    }
  }

  bool number(JsonValue* out) {
    size_t start = pos_;
    bool integral = true;
    if (s_[pos_] == '-') ++pos_;
    if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9') return fail("invalid number");
    if (s_[pos_] == '0') {
      ++pos_;
    } else {
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      integral = false;
      ++pos_;
      if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9') return fail("invalid number");
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9') return fail("invalid number");
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    }
    std::string digits = s_.substr(start, pos_ - start);
    out->kind = JsonValue::kNumber;
    out->number = strtod(digits.c_str(), nullptr);
    if (integral) {
      errno = 0;
      long long v = strtoll(digits.c_str(), nullptr, 10);
      out->integral = errno != ERANGE;
      out->integer = v;
    }
    return true;
  }

  const std::string& s_;
  size_t pos_ = 0;
  std::string error_;
};

}  // namespace

bool parse_json(const std::string& text, JsonValue* out, std::string* error) {
  Reader reader(text);
  *out = JsonValue();
  if (reader.document(out)) return true;
  *error = reader.error();
  return false;
}

}  // namespace tether
