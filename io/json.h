// io/json.h - a strict JSON reader (RFC 8259) for the files a run is given: safetensors headers,
// config.json and model.safetensors.index.json; and the two pieces the run's logs are written with. Host code only (no CUDA), so the fuzz targets of
// tests/fuzz/ build it with clang.
//
// These files come from anywhere, so reading one costs time and memory linear in its size,
// whatever it holds:
//   * values nest at most kJsonMaxDepth deep (the reader recurses once per level);
//   * a document is one flat array of 16-byte nodes, at most one node per two bytes of text,
//     and one buffer of decoded strings: about ten times the text at the very worst;
//   * a number is at most kJsonMaxNumberChars characters (the slow path of strtod stays short).
// Anything RFC 8259 does not allow is refused: a leading '+' or '.', a trailing comma, raw
// control characters in strings, unknown or malformed escapes, unpaired UTF-16 surrogates,
// invalid UTF-8, text after the value. So are duplicate keys, which the RFC leaves to the reader
// (Python keeps the last, others the first: the file would mean different things to different
// readers). Every refusal is a usage error (exit code 2) naming the file and the byte.
//
//   JsonDoc doc(text, "config.json");
//   if (auto v = doc.root().get("hidden_size"); v && v->is_integer()) use(v->integer());
//   for (const JsonMember& m : doc.root().members()) ...
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

constexpr int kJsonMaxDepth = 64;
constexpr size_t kJsonMaxNumberChars = 100;
constexpr size_t kJsonMaxBytes = 100'000'000;  // the cap of a safetensors header, in the format's reference

enum class JsonKind : uint8_t { Null, Bool, Number, String, Array, Object };

class JsonDoc;
struct JsonMember;
template <class Item>
class JsonRange;

// One value of a JsonDoc (which must outlive it).
class JsonValue {
public:
    JsonKind kind() const;
    bool is(JsonKind k) const { return kind() == k; }
    bool is_integer() const;  // a number written without fraction or exponent, within int64
    int64_t integer() const;  // its value (is_integer() only)
    double number() const;    // any number, as a double
    bool boolean() const;
    std::string_view string() const;  // decoded (UTF-8; may hold NUL written as \u0000)
    size_t size() const;              // elements of an array, members of an object

    std::optional<JsonValue> get(std::string_view key) const;  // an object's member
    JsonRange<JsonValue> elements() const;  // an array's (none for other kinds)
    JsonRange<JsonMember> members() const;  // an object's, in file order (none for other kinds)

private:
    friend class JsonDoc;
    friend class JsonParser;
    template <class>
    friend class JsonRange;
    JsonValue(const JsonDoc* doc, uint32_t at) : doc_(doc), at_(at) {}
    const JsonDoc* doc_;
    uint32_t at_;  // node index
};

struct JsonMember {
    std::string_view key;
    JsonValue value;
};

class JsonDoc {
public:
    // Parses text (at most kJsonMaxBytes); `what` names the file in messages.
    JsonDoc(std::string_view text, const std::string& what);
    JsonDoc(const JsonDoc&) = delete;  // its values point to it
    JsonDoc& operator=(const JsonDoc&) = delete;
    JsonValue root() const { return JsonValue(this, 0); }

private:
    friend class JsonValue;
    template <class>
    friend class JsonRange;
    struct Node {
        JsonKind kind;
        bool integer = false;  // Number: lexically an integer, and within int64 (then `i` holds it)
        uint32_t end = 0;      // one past this value's last node: the next sibling
        union {
            double num;
            int64_t i;
            struct {
                uint32_t offset, length;  // String: its bytes in `strings`
            } str;
            uint32_t count;  // Array, Object: elements or members
            bool b;
        };
    };
    std::vector<Node> nodes;  // the values in document order, each followed by its children
    std::string strings;      // every decoded string, end to end
    friend class JsonParser;
};

// For range-for: an array's elements (Item JsonValue) or an object's members (Item JsonMember:
// a key node followed by the value's nodes; the next member starts where the value ends).
template <class Item>
class JsonRange {
public:
    class Iter {
    public:
        Iter(const JsonDoc* d, uint32_t at) : d_(d), at_(at) {}
        Item operator*() const;
        Iter& operator++();
        bool operator!=(const Iter& o) const { return at_ != o.at_; }

    private:
        const JsonDoc* d_;
        uint32_t at_;
    };
    JsonRange(const JsonDoc* d, uint32_t first, uint32_t end) : first_(d, first), end_(d, end) {}
    Iter begin() const { return first_; }
    Iter end() const { return end_; }

private:
    Iter first_, end_;
};
extern template class JsonRange<JsonValue>;  // both defined in json.cpp
extern template class JsonRange<JsonMember>;

// How a value appears in a message: null, true, 128, 1e-05, "text" (escaped, shortened),
// "an array", "an object".
std::string json_shown(const JsonValue& v);
// A string as a message shows it: control characters escaped, at most about 80 bytes; and the
// same in double quotes.
std::string json_printable(std::string_view s);
std::string json_quoted(std::string_view s);

// Writing: a JSON string's inside (quotes, backslashes and control characters, DEL too, escaped), and a
// number in printf's `fmt`, or null where it is not finite (a diverged loss: JSON has no nan).
std::string json_escape(std::string_view s);
std::string json_number(double v, const char* fmt);
