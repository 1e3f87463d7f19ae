/* A strict JSON tokenizer over a byte range that may end in the middle of a value.
 *
 * Each function takes the position to read from and returns the position after what it
 * read, or NULL with ctx->status saying why: NEED (the range ended first: read again with
 * more bytes), INVALID (not JSON: r->at is the first byte that cannot be), TRUNCATED (the
 * last range ended inside a value), TOO_DEEP (nested deeper than memory for one bit a level
 * allows) or UNSUPPORTED (JSON this reader leaves to msgspec). The grammar is RFC 8259's, as msgspec
 * reads it, both ways: what this accepts msgspec accepts, and what this calls INVALID or
 * TRUNCATED msgspec refuses too.
 *
 * Containers nest by recursion up to J_MAX_DEPTH levels; deeper ones are checked by j_deep,
 * without recursion (one bit a level, at most an eighth of the bytes it reads), and say so in
 * r->deep: the caller decides whether
 * a value nested that deep is read (it is not: msgspec, which recurses, could not) or dropped.
 */
#ifndef XSP_KINETO_JSON_H
#define XSP_KINETO_JSON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "columns.h" /* Growable, where a string's decoded text is written */

enum { J_OK = 0, J_NEED = 1, J_UNSUPPORTED = 2, J_INVALID = 3, J_TRUNCATED = 4, J_TOO_DEEP = 5 };
enum { J_MAX_DEPTH = 512 };

typedef struct {
    const char *end;
    int final;  /* no more bytes will come: running out is a truncated file */
    int status;
    const char *at; /* INVALID: the byte that made it so */
    int deep;       /* a container nested past J_MAX_DEPTH was read (by j_deep) */
    int lenient;    /* the grammar only: numbers too long to convert are fine */
} JsonRange;

typedef struct {
    const char *text; /* between the quotes, escapes as written */
    Py_ssize_t length;
    int escaped;
} JsonString;

enum { V_ABSENT = 0, V_INT, V_FLOAT, V_STRING, V_NULL, V_TRUE, V_FALSE, V_OBJECT, V_ARRAY };

typedef struct {
    int kind;
    const char *start, *stop; /* the value's text, exactly as written */
    int64_t integer;          /* V_INT */
    int overflow;             /* V_INT beyond int64 */
    double number;            /* V_INT and V_FLOAT */
    JsonString string;        /* V_STRING */
} JsonValue;

static inline const char *j_fail(JsonRange *r, int status) {
    r->status = status;
    return NULL;
}

static inline const char *j_invalid(JsonRange *r, const char *p) {
    r->at = p;
    return j_fail(r, J_INVALID);
}

static inline const char *j_need(JsonRange *r) {
    r->at = r->end;
    return j_fail(r, r->final ? J_TRUNCATED : J_NEED);
}

static inline const char *j_space(JsonRange *r, const char *p) {
    while (p < r->end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) p++;
    return p;
}

static inline int j_hex(char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* p at the opening quote. */
static inline const char *j_string(JsonRange *r, const char *p, JsonString *out) {
    const char *q = p + 1;
    int escaped = 0;
    for (;;) {
        if (q >= r->end) return j_need(r);
        unsigned char c = (unsigned char)*q;
        if (c == '"') break;
        if (c < 0x20) return j_invalid(r, q);
        if (c == '\\') {
            escaped = 1;
            if (q + 1 >= r->end) return j_need(r);
            char e = q[1];
            if (e == 'u') {
                if (q + 6 > r->end) return j_need(r);
                if (!j_hex(q[2]) || !j_hex(q[3]) || !j_hex(q[4]) || !j_hex(q[5])) return j_invalid(r, q);
                q += 6;
                continue;
            }
            if (!strchr("\"\\/bfnrt", e) || e == 0) return j_invalid(r, q);
            q += 2;
            continue;
        }
        q++;
    }
    out->text = p + 1;
    out->length = q - (p + 1);
    out->escaped = escaped;
    return q + 1;
}

/* p at the number's first character ('-' or a digit). */
static inline const char *j_number(JsonRange *r, const char *p, JsonValue *v) {
    const char *q = p;
    int is_float = 0;
    if (q < r->end && *q == '-') q++;
    if (q >= r->end) return j_need(r);
    if (*q == '0') {
        q++;
    } else if (*q >= '1' && *q <= '9') {
        while (q < r->end && *q >= '0' && *q <= '9') q++;
    } else {
        return j_invalid(r, q);
    }
    if (q < r->end && *q == '.') {
        is_float = 1;
        q++;
        if (q >= r->end) return j_need(r);
        if (!(*q >= '0' && *q <= '9')) return j_invalid(r, q);
        while (q < r->end && *q >= '0' && *q <= '9') q++;
    }
    if (q < r->end && (*q == 'e' || *q == 'E')) {
        is_float = 1;
        q++;
        if (q < r->end && (*q == '+' || *q == '-')) q++;
        if (q >= r->end) return j_need(r);
        if (!(*q >= '0' && *q <= '9')) return j_invalid(r, q);
        while (q < r->end && *q >= '0' && *q <= '9') q++;
    }
    if (q >= r->end && !r->final) return j_fail(r, J_NEED); /* more digits may follow */
    Py_ssize_t length = q - p;
    char text[64];
    if (length >= (Py_ssize_t)sizeof(text)) {
        if (!r->lenient) return j_fail(r, J_UNSUPPORTED); /* valid, but left to msgspec */
        v->kind = V_FLOAT;                                   /* only its grammar is checked */
        v->start = p;
        v->stop = q;
        v->overflow = 0;
        v->integer = 0;
        v->number = 0;
        return q;
    }
    memcpy(text, p, (size_t)length);
    text[length] = 0;
    v->start = p;
    v->stop = q;
    v->overflow = 0;
    if (is_float) {
        v->kind = V_FLOAT;
        v->number = strtod(text, NULL);
        v->integer = 0;
    } else {
        v->kind = V_INT;
        const char *d = text + (text[0] == '-');
        uint64_t magnitude = 0;
        for (; *d; d++) {
            unsigned digit = (unsigned)(*d - '0');
            if (magnitude > (UINT64_MAX - digit) / 10) {
                v->overflow = 1;
                break;
            }
            magnitude = magnitude * 10 + digit;
        }
        if (text[0] == '-') {
            if (magnitude > (uint64_t)INT64_MAX + 1) v->overflow = 1;
            v->integer = (int64_t)(0 - magnitude);
        } else {
            if (magnitude > (uint64_t)INT64_MAX) v->overflow = 1;
            v->integer = (int64_t)magnitude;
        }
        /* as Python's float(int): rounded to the nearest double */
        v->number = v->overflow ? strtod(text, NULL) : (double)v->integer;
    }
    return q;
}

static inline const char *j_literal(JsonRange *r, const char *p, const char *word, int kind, JsonValue *v) {
    size_t n = strlen(word);
    size_t have = (size_t)(r->end - p);
    for (size_t i = 0; i < n && i < have; i++)
        if (p[i] != word[i]) return j_invalid(r, p + i);
    if (have < n) return j_need(r);
    v->kind = kind;
    v->start = p;
    v->stop = p + n;
    return p + n;
}

static const char *j_value(JsonRange *r, const char *p, JsonValue *v, int depth);

/* p at an object member's key: reads `"key":`, returns the position of its value. */
static inline const char *j_member_key(JsonRange *r, const char *p, JsonString *key) {
    if (*p != '"') return j_invalid(r, p);
    if (!(p = j_string(r, p, key))) return NULL;
    p = j_space(r, p);
    if (p >= r->end) return j_need(r);
    if (*p != ':') return j_invalid(r, p);
    p = j_space(r, p + 1);
    if (p >= r->end) return j_need(r);
    return p;
}

/* p at an object member's key: reads `"key": value`, returns the position after the value. */
static inline const char *j_member(JsonRange *r, const char *p, JsonString *key, JsonValue *value, int depth) {
    if (!(p = j_member_key(r, p, key))) return NULL;
    return j_value(r, p, value, depth);
}

/* p at '{' or '[' nested past J_MAX_DEPTH: skips the whole container, checking its grammar as
 * j_container does, but in a loop, with one bit a level (object or array) on a stack of its own. */
static const char *j_deep_levels(JsonRange *r, const char *p, unsigned char **objects, size_t *capacity) {
    size_t depth = 0;
    for (;;) {
        /* p at a value */
        if (*p == '{' || *p == '[') {
            if (depth / 8 >= *capacity) {
                size_t more = *capacity * 2;
                unsigned char *grown = realloc(*objects, more);
                if (!grown) {
                    r->at = p;
                    return j_fail(r, J_TOO_DEEP);
                }
                *objects = grown;
                *capacity = more;
            }
            int object = *p == '{';
            if (object) (*objects)[depth >> 3] |= (unsigned char)(1u << (depth & 7));
            else (*objects)[depth >> 3] &= (unsigned char)~(1u << (depth & 7));
            depth++;
            p = j_space(r, p + 1);
            if (p >= r->end) return j_need(r);
            if (*p == (object ? '}' : ']')) {
                p++;
                depth--;
            } else {
                JsonString key;
                if (object && !(p = j_member_key(r, p, &key))) return NULL;
                continue;
            }
        } else {
            JsonValue scalar;
            if (!(p = j_value(r, p, &scalar, 0))) return NULL;
        }
        /* after a value: close containers, or go on to the next item */
        for (;;) {
            if (depth == 0) return p;
            int object = ((*objects)[(depth - 1) >> 3] >> ((depth - 1) & 7)) & 1;
            p = j_space(r, p);
            if (p >= r->end) return j_need(r);
            if (*p == (object ? '}' : ']')) {
                p++;
                depth--;
                continue;
            }
            if (*p != ',') return j_invalid(r, p);
            p = j_space(r, p + 1);
            if (p >= r->end) return j_need(r);
            JsonString key;
            if (object && !(p = j_member_key(r, p, &key))) return NULL;
            break;
        }
    }
}

static const char *j_deep(JsonRange *r, const char *p) {
    size_t capacity = 1024; /* 8192 levels to begin with */
    unsigned char *objects = malloc(capacity);
    r->deep = 1;
    if (!objects) {
        r->at = p;
        return j_fail(r, J_TOO_DEEP);
    }
    const char *after = j_deep_levels(r, p, &objects, &capacity);
    free(objects);
    return after;
}

/* p at '{' or '['; skips the whole container, checking its grammar. */
static inline const char *j_container(JsonRange *r, const char *p, int depth) {
    if (depth > J_MAX_DEPTH) return j_deep(r, p);
    char close = *p == '{' ? '}' : ']';
    int object = *p == '{';
    p = j_space(r, p + 1);
    if (p >= r->end) return j_need(r);
    if (*p == close) return p + 1;
    for (;;) {
        JsonValue item;
        JsonString key;
        if (!(p = object ? j_member(r, p, &key, &item, depth + 1) : j_value(r, p, &item, depth + 1))) return NULL;
        p = j_space(r, p);
        if (p >= r->end) return j_need(r);
        if (*p == close) return p + 1;
        if (*p != ',') return j_invalid(r, p);
        p = j_space(r, p + 1);
        if (p >= r->end) return j_need(r);
    }
}

/* p at the value's first character (no space before it). */
static const char *j_value(JsonRange *r, const char *p, JsonValue *v, int depth) {
    const char *q;
    v->start = p;
    switch (*p) {
    case '"':
        v->kind = V_STRING;
        q = j_string(r, p, &v->string);
        break;
    case '{':
    case '[':
        v->kind = *p == '{' ? V_OBJECT : V_ARRAY;
        q = j_container(r, p, depth);
        break;
    case 't':
        return j_literal(r, p, "true", V_TRUE, v);
    case 'f':
        return j_literal(r, p, "false", V_FALSE, v);
    case 'n':
        return j_literal(r, p, "null", V_NULL, v);
    default:
        if (*p == '-' || (*p >= '0' && *p <= '9')) return j_number(r, p, v);
        return j_invalid(r, p);
    }
    if (q) v->stop = q;
    return q;
}

/* A key without escapes equal to `name`. */
static inline int j_key_is(const JsonString *key, const char *name, size_t n) {
    return !key->escaped && (size_t)key->length == n && memcmp(key->text, name, n) == 0;
}
#define J_KEY_IS(key, literal) j_key_is((key), (literal), sizeof(literal) - 1)

/* ---- a string's text ------------------------------------------------------------------------ */

/* The UTF-8 bytes of a JSON string's text, escapes decoded; -1 where it is not plain UTF-16. */
static int unescape(const JsonString *s, Growable *out) {
    if (growable_grow(out, s->length)) return -1; /* the decoded text is never longer */
    char *w = out->data + out->length;
    const char *p = s->text, *end = s->text + s->length;
    if (!s->escaped) {
        memcpy(w, p, (size_t)s->length);
        out->length += s->length;
        return 0;
    }
    while (p < end) {
        if (*p != '\\') {
            *w++ = *p++;
            continue;
        }
        char e = p[1];
        p += 2;
        switch (e) {
        case 'b': *w++ = '\b'; continue;
        case 'f': *w++ = '\f'; continue;
        case 'n': *w++ = '\n'; continue;
        case 'r': *w++ = '\r'; continue;
        case 't': *w++ = '\t'; continue;
        case 'u': break;
        default: *w++ = e; continue;
        }
        unsigned code = (unsigned)strtoul((char[]){p[0], p[1], p[2], p[3], 0}, NULL, 16);
        p += 4;
        if (code >= 0xD800 && code <= 0xDBFF) {
            if (end - p < 6 || p[0] != '\\' || p[1] != 'u') return -1;
            unsigned low = (unsigned)strtoul((char[]){p[2], p[3], p[4], p[5], 0}, NULL, 16);
            if (low < 0xDC00 || low > 0xDFFF) return -1;
            p += 6;
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
        } else if (code >= 0xDC00 && code <= 0xDFFF) {
            return -1;
        }
        if (code < 0x80) {
            *w++ = (char)code;
        } else if (code < 0x800) {
            *w++ = (char)(0xC0 | (code >> 6));
            *w++ = (char)(0x80 | (code & 0x3F));
        } else if (code < 0x10000) {
            *w++ = (char)(0xE0 | (code >> 12));
            *w++ = (char)(0x80 | ((code >> 6) & 0x3F));
            *w++ = (char)(0x80 | (code & 0x3F));
        } else {
            *w++ = (char)(0xF0 | (code >> 18));
            *w++ = (char)(0x80 | ((code >> 12) & 0x3F));
            *w++ = (char)(0x80 | ((code >> 6) & 0x3F));
            *w++ = (char)(0x80 | (code & 0x3F));
        }
    }
    out->length = w - out->data;
    return 0;
}

#endif
