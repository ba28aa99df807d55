// io/json.cpp - the strict JSON reader of json.h: a recursive descent over the text, each value
// appended to one flat array of nodes in document order.
#include "json.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>

#include "infra/common.h"

class JsonParser {
public:
    JsonParser(std::string_view text, const std::string& what, JsonDoc& doc) : s(text), what(what), doc(doc) {}

    void parse() {
        if (s.size() > kJsonMaxBytes)
            usage_error(what + ": " + std::to_string(s.size()) + " bytes of JSON, over the limit of " +
                        std::to_string(kJsonMaxBytes));
        // Every value takes at least two bytes of text with its separator, so this is the most
        // nodes a text can need: reserved (not touched) up front, the array never moves.
        doc.nodes.reserve(s.size() / 2 + 1);
        doc.strings.reserve(s.size());
        value(1);
        skip_space();
        if (i != s.size()) fail("text after the JSON value");
    }

private:
    std::string_view s;
    size_t i = 0;
    const std::string& what;
    JsonDoc& doc;

    [[noreturn]] void fail(const std::string& why) {
        usage_error(what + ": malformed JSON at byte " + std::to_string(i) + ": " + why);
    }
    void skip_space() {
        while (i < s.size() && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) i++;
    }
    char next() {  // the next character that is not white space; fails at the end
        skip_space();
        if (i >= s.size()) fail("unexpected end of the text");
        return s[i];
    }
    void expect(char c) {
        if (next() != c) fail(std::string("'") + c + "' expected, found " + shown_char(s[i]));
        i++;
    }
    static std::string shown_char(char c) {
        char b[16];
        if ((unsigned char)c >= 0x20 && (unsigned char)c < 0x7f) snprintf(b, sizeof b, "'%c'", c);
        else snprintf(b, sizeof b, "byte 0x%02x", (unsigned char)c);
        return b;
    }
    uint32_t add(JsonKind kind) {
        doc.nodes.emplace_back();
        doc.nodes.back().kind = kind;
        doc.nodes.back().i = 0;
        return (uint32_t)(doc.nodes.size() - 1);
    }

    void value(int depth) {
        if (depth > kJsonMaxDepth)
            usage_error(what + ": JSON nested deeper than " + std::to_string(kJsonMaxDepth) + " levels at byte " +
                        std::to_string(i));
        const char c = next();
        const uint32_t at = add(JsonKind::Null);
        if (c == '{') object(at, depth);
        else if (c == '[') array(at, depth);
        else if (c == '"') string(at);
        else if (c == '-' || (c >= '0' && c <= '9')) number(at);
        else literal(at);
        doc.nodes[at].end = (uint32_t)doc.nodes.size();
    }

    // The comma-separated items of an array or an object, up to `close`, each read by
    // read_item; returns how many there were.
    template <class ReadItem>
    uint32_t items(char close, ReadItem read_item) {
        if (next() == close) return i++, 0;
        for (uint32_t count = 1;; count++) {
            read_item();
            const char c = next();
            if (c == close) return i++, count;
            if (c != ',') fail(std::string("',' or '") + close + "' expected, found " + shown_char(c));
            i++;
        }
    }

    void object(uint32_t at, int depth) {
        const size_t start = i++;
        doc.nodes[at].kind = JsonKind::Object;
        doc.nodes[at].count = items('}', [&] {
            if (next() != '"') fail("a key (a string) expected, found " + shown_char(s[i]));
            const uint32_t key = add(JsonKind::String);
            string(key);
            doc.nodes[key].end = key + 1;
            expect(':');
            value(depth + 1);
        });
        doc.nodes[at].end = (uint32_t)doc.nodes.size();  // the members are all read
        refuse_duplicate_keys(at, start);
    }

    // Sorting the keys finds a repeated one in O(n log n), however many members there are.
    void refuse_duplicate_keys(uint32_t at, size_t start) {
        if (doc.nodes[at].count < 2) return;
        std::vector<std::string_view> keys;
        keys.reserve(doc.nodes[at].count);
        for (const JsonMember& m : JsonValue(&doc, at).members()) keys.push_back(m.key);
        std::sort(keys.begin(), keys.end());
        auto dup = std::adjacent_find(keys.begin(), keys.end());
        if (dup != keys.end())
            usage_error(what + ": the object at byte " + std::to_string(start) + " has the key " + json_quoted(*dup) +
                        " twice (JSON readers disagree on which one counts)");
    }

    void array(uint32_t at, int depth) {
        i++;
        doc.nodes[at].kind = JsonKind::Array;
        doc.nodes[at].count = items(']', [&] { value(depth + 1); });
    }

    void literal(uint32_t at) {
        JsonDoc::Node& n = doc.nodes[at];
        if (s.compare(i, 4, "true") == 0) n.kind = JsonKind::Bool, n.b = true, i += 4;
        else if (s.compare(i, 5, "false") == 0) n.kind = JsonKind::Bool, n.b = false, i += 5;
        else if (s.compare(i, 4, "null") == 0) i += 4;
        else fail("a value expected, found " + shown_char(s[i]));
    }

    // RFC 8259: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
    void number(uint32_t at) {
        const size_t start = i;
        auto digits = [&] {
            size_t d = i;
            while (i < s.size() && s[i] >= '0' && s[i] <= '9') i++;
            if (i == d) fail("a digit expected in a number");
        };
        if (s[i] == '-') i++;
        if (i < s.size() && s[i] == '0') i++;
        else digits();
        bool integer = true;
        if (i < s.size() && s[i] == '.') i++, digits(), integer = false;
        if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
            i++, integer = false;
            if (i < s.size() && (s[i] == '+' || s[i] == '-')) i++;
            digits();
        }
        if (i - start > kJsonMaxNumberChars)
            fail("a number of more than " + std::to_string(kJsonMaxNumberChars) + " characters");
        set_number(doc.nodes[at], s.substr(start, i - start), integer);
    }

    void set_number(JsonDoc::Node& n, std::string_view text, bool integer) {
        n.kind = JsonKind::Number;
        if (integer && to_int64(text, &n.i)) {
            n.integer = true;
            return;
        }
        char t[kJsonMaxNumberChars + 1];  // strtod needs the terminating NUL
        memcpy(t, text.data(), text.size());
        t[text.size()] = '\0';
        n.num = std::strtod(t, nullptr);
        if (!std::isfinite(n.num)) fail("the number " + std::string(text) + " is out of range");
    }

    // An integer's digits (and sign) as an int64; false when it does not fit.
    static bool to_int64(std::string_view text, int64_t* out) {
        const bool negative = text[0] == '-';
        uint64_t v = 0;
        const uint64_t limit = negative ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
        for (size_t k = negative; k < text.size(); k++) {
            const uint64_t d = (uint64_t)(text[k] - '0');
            if (v > (limit - d) / 10) return false;
            v = v * 10 + d;
        }
        *out = negative ? (int64_t)(0 - v) : (int64_t)v;
        return true;
    }

    void string(uint32_t at);
    void escape(std::string& out);
    unsigned hex4();
    void utf8(std::string& out);
};

// A string: its decoded bytes appended to doc.strings.
void JsonParser::string(uint32_t at) {
    i++;  // the opening quote
    std::string& out = doc.strings;
    const size_t offset = out.size();
    while (true) {
        const size_t run = i;  // copy a run of plain characters at once
        while (i < s.size() && s[i] != '"' && s[i] != '\\' && (unsigned char)s[i] >= 0x20 && (unsigned char)s[i] < 0x80)
            i++;
        out.append(s.data() + run, i - run);
        if (i >= s.size()) fail("unterminated string");
        const unsigned char c = (unsigned char)s[i];
        if (c == '"') break;
        if (c == '\\') escape(out);
        else if (c < 0x20) fail("raw control character " + shown_char((char)c) + " in a string (it must be escaped)");
        else utf8(out);
    }
    i++;
    JsonDoc::Node& n = doc.nodes[at];
    n.kind = JsonKind::String;
    n.str.offset = (uint32_t)offset;
    n.str.length = (uint32_t)(out.size() - offset);
}

void JsonParser::escape(std::string& out) {
    i++;  // the backslash
    if (i >= s.size()) fail("unterminated string");
    const char e = s[i++];
    switch (e) {
        case '"': out += '"'; return;
        case '\\': out += '\\'; return;
        case '/': out += '/'; return;
        case 'b': out += '\b'; return;
        case 'f': out += '\f'; return;
        case 'n': out += '\n'; return;
        case 'r': out += '\r'; return;
        case 't': out += '\t'; return;
        case 'u': break;
        default: i--, fail("unknown escape \\" + std::string(1, e));
    }
    unsigned cp = hex4();
    if (cp >= 0xDC00 && cp <= 0xDFFF) fail("a low surrogate (\\uDC00-\\uDFFF) without a high one before it");
    if (cp >= 0xD800 && cp <= 0xDBFF) {  // a high surrogate: a low one must follow
        if (s.compare(i, 2, "\\u") != 0) fail("a high surrogate without a low one after it");
        i += 2;
        const unsigned low = hex4();
        if (low < 0xDC00 || low > 0xDFFF) fail("a high surrogate without a low one after it");
        cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    }
    if (cp < 0x80) {
        out += (char)cp;
    } else if (cp < 0x800) {
        out += (char)(0xC0 | (cp >> 6)), out += (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += (char)(0xE0 | (cp >> 12)), out += (char)(0x80 | ((cp >> 6) & 0x3F)), out += (char)(0x80 | (cp & 0x3F));
    } else {
        out += (char)(0xF0 | (cp >> 18)), out += (char)(0x80 | ((cp >> 12) & 0x3F));
        out += (char)(0x80 | ((cp >> 6) & 0x3F)), out += (char)(0x80 | (cp & 0x3F));
    }
}

unsigned JsonParser::hex4() {  // the four hex digits of a \u escape
    unsigned v = 0;
    for (int k = 0; k < 4; k++, i++) {
        const char c = i < s.size() ? s[i] : '\0';
        const int d = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                             : -1;
        if (d < 0) fail("\\u must be followed by four hex digits");
        v = v * 16 + (unsigned)d;
    }
    return v;
}

// One UTF-8 sequence of two to four bytes, checked (RFC 3629: no overlong forms, no surrogates,
// nothing past U+10FFFF) and copied.
void JsonParser::utf8(std::string& out) {
    const unsigned char c = (unsigned char)s[i];
    int len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (len == 0 || i + len > s.size()) fail("invalid UTF-8");
    unsigned cp = c & (0x7F >> len);
    for (int k = 1; k < len; k++) {
        const unsigned char t = (unsigned char)s[i + k];
        if ((t & 0xC0) != 0x80) fail("invalid UTF-8");
        cp = (cp << 6) | (t & 0x3F);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
        fail("invalid UTF-8");
    out.append(s.data() + i, len);
    i += len;
}

JsonDoc::JsonDoc(std::string_view text, const std::string& what) {
    JsonParser(text, what, *this).parse();
}

// ---------------------------------------------------------------------------------------------
// Reading values
JsonKind JsonValue::kind() const { return doc_->nodes[at_].kind; }
bool JsonValue::is_integer() const { return kind() == JsonKind::Number && doc_->nodes[at_].integer; }
int64_t JsonValue::integer() const { return doc_->nodes[at_].i; }
double JsonValue::number() const {
    const JsonDoc::Node& n = doc_->nodes[at_];
    return n.integer ? (double)n.i : n.num;
}
bool JsonValue::boolean() const { return doc_->nodes[at_].b; }
std::string_view JsonValue::string() const {
    const JsonDoc::Node& n = doc_->nodes[at_];
    return std::string_view(doc_->strings).substr(n.str.offset, n.str.length);
}
size_t JsonValue::size() const { return is(JsonKind::Array) || is(JsonKind::Object) ? doc_->nodes[at_].count : 0; }

JsonRange<JsonValue> JsonValue::elements() const {
    const uint32_t end = is(JsonKind::Array) ? doc_->nodes[at_].end : at_ + 1;
    return JsonRange<JsonValue>(doc_, at_ + 1, end);
}
JsonRange<JsonMember> JsonValue::members() const {
    const uint32_t end = is(JsonKind::Object) ? doc_->nodes[at_].end : at_ + 1;
    return JsonRange<JsonMember>(doc_, at_ + 1, end);
}

template <class Item>
Item JsonRange<Item>::Iter::operator*() const {
    if constexpr (std::is_same_v<Item, JsonMember>) return {JsonValue(d_, at_).string(), JsonValue(d_, at_ + 1)};
    else return JsonValue(d_, at_);
}
template <class Item>
typename JsonRange<Item>::Iter& JsonRange<Item>::Iter::operator++() {
    const uint32_t value = std::is_same_v<Item, JsonMember> ? at_ + 1 : at_;  // a member: past its key
    at_ = d_->nodes[value].end;
    return *this;
}
template class JsonRange<JsonValue>;
template class JsonRange<JsonMember>;

std::optional<JsonValue> JsonValue::get(std::string_view key) const {
    for (const JsonMember& m : members())
        if (m.key == key) return m.value;
    return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Values in messages, and a JSON string's inside in the logs
// A JSON string's inside: quotes, backslashes and control characters (DEL too) escaped.
std::string json_escape(std::string_view s) {
    std::string out;
    for (const char ch : s) {
        const unsigned char c = (unsigned char)ch;
        if (c == '"' || c == '\\') out += '\\', out += ch;
        else if (c >= 0x20 && c != 0x7f) out += ch;
        else {
            char b[8];
            snprintf(b, sizeof b, "\\u%04x", c);
            out += b;
        }
    }
    return out;
}

std::string json_printable(std::string_view s) {
    return s.size() > 80 ? json_escape(s.substr(0, 80)) + "..." : json_escape(s);
}

std::string json_quoted(std::string_view s) { return "\"" + json_printable(s) + "\""; }

std::string json_shown(const JsonValue& v) {
    switch (v.kind()) {
        case JsonKind::Null: return "null";
        case JsonKind::Bool: return v.boolean() ? "true" : "false";
        case JsonKind::Number: {
            if (v.is_integer()) return std::to_string(v.integer());
            char b[32];
            snprintf(b, sizeof b, "%.10g", v.number());
            return b;
        }
        case JsonKind::String: return json_quoted(v.string());
        case JsonKind::Array: return "an array";
        case JsonKind::Object: return "an object";
    }
    return "?";
}

// ---------------------------------------------------------------------------------------------
// Writing numbers
// A JSON number, or null where the value is not finite (a diverged loss): JSON has no nan.
std::string json_number(double v, const char* fmt) {
    if (!std::isfinite(v)) return "null";
    char buf[64];
    snprintf(buf, sizeof buf, fmt, v);
    return buf;
}
