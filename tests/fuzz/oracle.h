// tests/fuzz/oracle.h - what the fuzz targets judge the readers of io/input_files.h by.
//
// Each target's oracle says, on its own, whether an input is valid ("" when it is, else why
// not), and the reader must agree: it must accept what the oracle calls valid and refuse, with
// a usage error (exit code 2) naming the file, what the oracle calls invalid. For JSON the
// oracle is a second reader of RFC 8259 (with the same limits: 64 levels, numbers of 100
// characters, no duplicate keys), written for plainness, not speed: a tree of values, strings
// compared code point by code point. A target fails (and libFuzzer keeps the input) when
//   * the reader accepts what the oracle calls invalid, or refuses what it calls valid,
//   * the reader calls JSON malformed that the oracle reads,
//   * a refusal is not a usage error, or does not name the file,
//   * an accepted input reads back other than the oracle reads it.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "infra/common.h"

[[noreturn]] inline void oracle_fail(const std::string& why) {
    fprintf(stderr, "ORACLE: %s\n", why.c_str());
    abort();  // libFuzzer reports a crash and keeps the input
}

// Whether a refusal was the JSON reader's (the text is not JSON) rather than a check of its
// content: io/json.cpp's messages begin with the file's name and one of these.
inline bool is_json_refusal(const Fatal& f, const std::string& file) {
    const std::string m = f.what();
    for (const char* start : {": malformed JSON at byte ", ": JSON nested deeper than ", ": the object at byte "})
        if (m.rfind(file + start, 0) == 0) return true;
    return false;
}

// The reader's refusal f against the oracle's verdict on the input (and on its JSON).
inline void judge_refusal(const Fatal& f, const std::string& file, const std::string& verdict, bool json) {
    if (f.code != EXIT_USAGE) oracle_fail("refused with exit code " + std::to_string(f.code) + ": " + f.what());
    if (std::string(f.what()).find(file) == std::string::npos)
        oracle_fail("the message does not name the file: " + std::string(f.what()));
    if (verdict.empty()) oracle_fail("refused a valid input: " + std::string(f.what()));
    if (json && is_json_refusal(f, file)) oracle_fail("valid JSON called malformed: " + std::string(f.what()));
}

inline void judge_acceptance(const std::string& verdict) {
    if (!verdict.empty()) oracle_fail("accepted an invalid input: " + verdict);
}

// ---------------------------------------------------------------------------------------------
struct OJson {
    enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
    bool b = false;
    std::string text;  // a number as written
    std::string s;     // a string, decoded to UTF-8
    std::vector<OJson> items;
    std::map<std::string, OJson> members;
    std::vector<std::string> order;  // member keys in file order

    bool is_integer() const {  // no fraction, no exponent, within int64
        if (kind != Number || text.find_first_of(".eE") != std::string::npos) return false;
        errno = 0;
        strtoll(text.c_str(), nullptr, 10);
        return errno == 0;
    }
    long long integer() const { return strtoll(text.c_str(), nullptr, 10); }
    double number() const { return strtod(text.c_str(), nullptr); }
    const OJson* get(const std::string& k) const {
        auto it = members.find(k);
        return it == members.end() ? nullptr : &it->second;
    }
};

class OracleJson {
public:
    // True when text is one JSON value (RFC 8259) within the limits; the value in *out.
    static bool read(std::string_view text, OJson* out) {
        OracleJson r(text);
        if (!r.value(out, 1)) return false;
        r.space();
        return r.p == text.size();
    }

private:
    explicit OracleJson(std::string_view t) : t(t) {}
    std::string_view t;
    size_t p = 0;

    bool at(char c) const { return p < t.size() && t[p] == c; }
    void space() {
        while (p < t.size() && strchr(" \t\n\r", t[p]) && t[p] != '\0') p++;
    }
    bool value(OJson* v, int depth) {
        if (depth > 64) return false;
        space();
        if (p >= t.size()) return false;
        if (t.substr(p, 4) == "null") return p += 4, v->kind = OJson::Null, true;
        if (t.substr(p, 4) == "true") return p += 4, v->kind = OJson::Bool, v->b = true, true;
        if (t.substr(p, 5) == "false") return p += 5, v->kind = OJson::Bool, v->b = false, true;
        if (at('"')) return v->kind = OJson::String, str(&v->s);
        if (at('[')) return array(v, depth);
        if (at('{')) return object(v, depth);
        return number(v);
    }
    bool array(OJson* v, int depth) {
        v->kind = OJson::Array;
        p++;
        space();
        if (at(']')) return p++, true;
        while (true) {
            v->items.emplace_back();
            if (!value(&v->items.back(), depth + 1)) return false;
            space();
            if (at(']')) return p++, true;
            if (!at(',')) return false;
            p++;
        }
    }
    bool object(OJson* v, int depth) {
        v->kind = OJson::Object;
        p++;
        space();
        if (at('}')) return p++, true;
        while (true) {
            space();
            std::string key;
            if (!at('"') || !str(&key)) return false;
            space();
            if (!at(':')) return false;
            p++;
            OJson item;
            if (!value(&item, depth + 1)) return false;
            if (v->members.count(key)) return false;  // a duplicate key
            v->members[key] = item;
            v->order.push_back(key);
            space();
            if (at('}')) return p++, true;
            if (!at(',')) return false;
            p++;
        }
    }
    bool number(OJson* v) {
        const size_t start = p;
        if (at('-')) p++;
        if (at('0')) p++;
        else if (!digits()) return false;
        if (at('.') && (p++, !digits())) return false;
        if (at('e') || at('E')) {
            p++;
            if (at('+') || at('-')) p++;
            if (!digits()) return false;
        }
        v->kind = OJson::Number;
        v->text = std::string(t.substr(start, p - start));
        return v->text.size() <= 100 && std::isfinite(v->number());
    }
    bool digits() {
        const size_t start = p;
        while (p < t.size() && t[p] >= '0' && t[p] <= '9') p++;
        return p > start;
    }
    bool hex4(unsigned* cp) {
        if (p + 4 > t.size()) return false;
        *cp = 0;
        for (int k = 0; k < 4; k++) {
            const char c = t[p + k];
            static const char digits[] = "0123456789" "abcdef";
            const char* h = strchr(digits, c >= 'A' && c <= 'F' ? c + 32 : c);
            if (!h || c == '\0') return false;
            *cp = *cp * 16 + (unsigned)(h - digits);
        }
        p += 4;
        return true;
    }
    static void put(std::string* out, unsigned cp) {  // cp as UTF-8
        if (cp < 0x80) *out += (char)cp;
        else if (cp < 0x800) *out += (char)(0xC0 | cp >> 6), *out += (char)(0x80 | (cp & 63));
        else if (cp < 0x10000)
            *out += (char)(0xE0 | cp >> 12), *out += (char)(0x80 | (cp >> 6 & 63)), *out += (char)(0x80 | (cp & 63));
        else
            *out += (char)(0xF0 | cp >> 18), *out += (char)(0x80 | (cp >> 12 & 63)),
                *out += (char)(0x80 | (cp >> 6 & 63)), *out += (char)(0x80 | (cp & 63));
    }
    bool escape(std::string* out) {
        const std::string from = "\"\\/bfnrt", to = "\"\\/\b\f\n\r\t";
        if (p >= t.size()) return false;
        const char e = t[p++];
        if (e != 'u') {
            const size_t k = from.find(e);
            if (k == std::string::npos || e == '\0') return false;
            return *out += to[k], true;
        }
        unsigned cp, low;
        if (!hex4(&cp)) return false;
        if (cp >= 0xDC00 && cp <= 0xDFFF) return false;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (t.substr(p, 2) != "\\u") return false;
            p += 2;
            if (!hex4(&low) || low < 0xDC00 || low > 0xDFFF) return false;
            cp = 0x10000 + (cp - 0xD800) * 0x400 + (low - 0xDC00);
        }
        put(out, cp);
        return true;
    }
    // One code point of raw UTF-8: decoded, then encoded again; valid when that gives the same bytes.
    bool utf8(std::string* out) {
        const unsigned char c = (unsigned char)t[p];
        const int n = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
        if (c < 0xC0 || c > 0xF7 || p + n > t.size()) return false;
        unsigned cp = c & (0xFF >> (n + 1));
        for (int k = 1; k < n; k++) {
            const unsigned char d = (unsigned char)t[p + k];
            if (d < 0x80 || d > 0xBF) return false;
            cp = cp * 64 + (d & 63);
        }
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        std::string again;
        put(&again, cp);
        if (again != t.substr(p, n)) return false;  // an overlong form
        *out += again;
        p += n;
        return true;
    }
    bool str(std::string* out) {
        p++;
        while (p < t.size()) {
            const unsigned char c = (unsigned char)t[p];
            if (c == '"') return p++, true;
            if (c < 0x20) return false;
            if (c == '\\') {
                p++;
                if (!escape(out)) return false;
            } else if (c < 0x80) {
                *out += (char)c, p++;
            } else if (!utf8(out)) {
                return false;
            }
        }
        return false;
    }
};
