/* One string field of every JSON line, validated and decoded in one pass: see corpusforge/jsonl_field.py.
 *
 * extract(block, key) -> (documents, lines, texts) | None
 *   block: whole JSON lines (any buffer); key: the field's name as UTF-8 bytes (no quote or backslash).
 *   texts: the decoded UTF-8 of the field of each line, each followed by 0xFF.
 *   None: some line is not a plain good record (see jsonl_field.py); the caller takes the exact path.
 *
 * extract_blocks(buffer, key, ranges, stop) -> [extract(buffer[a:b], key) for (a, b) in ranges], in one call
 *   without the GIL that ends early once stop[0] is set (see below).
 *
 * Strict JSON (RFC 8259) as orjson reads it; only what this file accepts for certain is accepted.
 * The scan runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define MAX_DEPTH 64
#define DECLINE (-1)

typedef Py_ssize_t idx;

static inline idx skip_ws(const uint8_t *b, idx i, idx n) {
    /* JSON whitespace within a line: space, tab, CR (a newline ends the line) */
    while (i < n && (b[i] == ' ' || b[i] == '\t' || b[i] == '\r')) i++;
    return i;
}

/* The first index from i on holding a quote, a backslash, a control byte or a non-ASCII byte; n if none. */
static inline idx plain_run(const uint8_t *b, idx i, idx n) {
#ifdef __SSE2__
    const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8('\\'), c1f = _mm_set1_epi8(0x1F);
    while (i + 16 <= n) {
        __m128i v = _mm_loadu_si128((const __m128i *)(b + i));
        __m128i control = _mm_cmpeq_epi8(_mm_max_epu8(v, c1f), c1f); /* v <= 0x1F */
        __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)), control);
        int mask = _mm_movemask_epi8(hit) | _mm_movemask_epi8(v); /* the sign bit: non-ASCII */
        if (mask) return i + __builtin_ctz((unsigned)mask);
        i += 16;
    }
#endif
    while (i < n) {
        uint8_t c = b[i];
        if (c < 0x20 || c == '"' || c == '\\' || c >= 0x80) return i;
        i++;
    }
    return n;
}

/* Length of the well-formed UTF-8 sequence whose lead byte (non-ASCII) is at i, or 0. */
static inline int utf8_length(const uint8_t *b, idx i, idx n) {
    uint8_t c = b[i];
    if (c >= 0xC2 && c <= 0xDF) return (i + 1 < n && (b[i + 1] & 0xC0) == 0x80) ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        if (i + 2 >= n) return 0;
        uint8_t lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF; /* no overlong forms, no surrogates */
        return (b[i + 1] >= lo && b[i + 1] <= hi && (b[i + 2] & 0xC0) == 0x80) ? 3 : 0;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (i + 3 >= n) return 0;
        uint8_t lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        return (b[i + 1] >= lo && b[i + 1] <= hi && (b[i + 2] & 0xC0) == 0x80 && (b[i + 3] & 0xC0) == 0x80) ? 4 : 0;
    }
    return 0;
}

static inline int hex4(const uint8_t *b, idx i, idx n) {
    if (i + 4 > n) return -1;
    int value = 0;
    for (int j = 0; j < 4; j++) {
        uint8_t c = b[i + j];
        int d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return -1;
        value = value * 16 + d;
    }
    return value;
}

static inline int simple_escape(uint8_t e) {
    switch (e) {
    case '"': case '\\': case '/': return e;
    case 'b': return 8;
    case 'f': return 12;
    case 'n': return 10;
    case 'r': return 13;
    case 't': return 9;
    default: return -1;
    }
}

/* The code point of the \uXXXX escape at i (a surrogate pair taken whole); *end is the index after it. -1 for a
 * bad escape or a lone surrogate (orjson rejects both). */
static inline long unicode_escape(const uint8_t *b, idx i, idx n, idx *end) {
    long point = hex4(b, i + 2, n);
    if (point < 0) return -1;
    i += 6;
    if (point >= 0xD800 && point <= 0xDBFF) {
        if (i + 1 >= n || b[i] != '\\' || b[i + 1] != 'u') return -1;
        long low = hex4(b, i + 2, n);
        if (low < 0xDC00 || low > 0xDFFF) return -1;
        point = 0x10000 + ((point - 0xD800) << 10) + (low - 0xDC00);
        i += 6;
    } else if (point >= 0xDC00 && point <= 0xDFFF) {
        return -1;
    }
    *end = i;
    return point;
}

static inline idx put_utf8(uint8_t *out, idx o, long p) {
    if (p < 0x80) { out[o] = (uint8_t)p; return o + 1; }
    if (p < 0x800) { out[o] = 0xC0 | (p >> 6); out[o + 1] = 0x80 | (p & 0x3F); return o + 2; }
    if (p < 0x10000) {
        out[o] = 0xE0 | (p >> 12); out[o + 1] = 0x80 | ((p >> 6) & 0x3F); out[o + 2] = 0x80 | (p & 0x3F);
        return o + 3;
    }
    out[o] = 0xF0 | (p >> 18); out[o + 1] = 0x80 | ((p >> 12) & 0x3F);
    out[o + 2] = 0x80 | ((p >> 6) & 0x3F); out[o + 3] = 0x80 | (p & 0x3F);
    return o + 4;
}

/* Validate the string whose opening quote is at i; the index after its closing quote, or -1. With an `out`, also
 * append its decoded UTF-8 at out + *o. */
static idx scan_string(const uint8_t *b, idx i, idx n, uint8_t *out, idx *o) {
    i++;
    idx segment = i; /* bytes from here on are copied as they are */
    for (;;) {
        i = plain_run(b, i, n);
        if (i >= n) return -1;
        uint8_t c = b[i];
        if (c == '"' || c == '\\') {
            if (out) {
                memcpy(out + *o, b + segment, i - segment);
                *o += i - segment;
            }
            if (c == '"') return i + 1;
            if (i + 1 >= n) return -1;
            if (b[i + 1] == 'u') {
                long point = unicode_escape(b, i, n, &i);
                if (point < 0) return -1;
                if (out) *o = put_utf8(out, *o, point);
            } else {
                int byte = simple_escape(b[i + 1]);
                if (byte < 0) return -1;
                if (out) out[(*o)++] = (uint8_t)byte;
                i += 2;
            }
            segment = i;
        } else if (c < 0x20) {
            return -1;
        } else {
            int length = utf8_length(b, i, n);
            if (!length) return -1;
            i += length;
        }
    }
}

static inline idx skip_string(const uint8_t *b, idx i, idx n) { return scan_string(b, i, n, NULL, NULL); }

static inline int unicode_space(long p) {
    return p == 0x85 || p == 0xA0 || p == 0x1680 || (p >= 0x2000 && p <= 0x200A) || p == 0x2028 || p == 0x2029 ||
           p == 0x202F || p == 0x205F || p == 0x3000;
}

/* Whether out[start:end] (well-formed UTF-8) holds a character that is not whitespace by Python's str.isspace:
 * the exact path calls a document of whitespace alone empty. */
static int visible(const uint8_t *out, idx start, idx end) {
    idx i = start;
    while (i < end) {
        uint8_t c = out[i];
        if (c < 0x80) {
            if (!((c >= 9 && c <= 13) || (c >= 28 && c <= 32))) return 1;
            i++;
            continue;
        }
        long p;
        if (c < 0xE0) { p = ((c & 0x1F) << 6) | (out[i + 1] & 0x3F); i += 2; }
        else if (c < 0xF0) { p = ((c & 0x0F) << 12) | ((out[i + 1] & 0x3F) << 6) | (out[i + 2] & 0x3F); i += 3; }
        else return 1; /* no whitespace above U+FFFF */
        if (!unicode_space(p)) return 1;
    }
    return 0;
}

/* Validate a JSON number at i; the index after it, or -1 (also for one that orjson rejects as infinite). */
static idx skip_number(const uint8_t *b, idx i, idx n) {
    idx digits = 0;
    if (b[i] == '-') i++;
    if (i >= n) return -1;
    if (b[i] == '0') { i++; digits = 1; }
    else {
        while (i < n && b[i] >= '0' && b[i] <= '9') { i++; digits++; }
        if (!digits) return -1;
    }
    if (i < n && b[i] == '.') {
        idx fraction = 0;
        i++;
        while (i < n && b[i] >= '0' && b[i] <= '9') { i++; fraction++; }
        if (!fraction) return -1;
        digits += fraction;
    }
    if (i < n && (b[i] == 'e' || b[i] == 'E')) {
        idx exponent = 0;
        i++;
        if (i < n && (b[i] == '+' || b[i] == '-')) i++;
        while (i < n && b[i] >= '0' && b[i] <= '9') { i++; exponent++; }
        if (!exponent || exponent > 2) return -1; /* three exponent digits may overflow to infinity */
    }
    if (digits > 300) return -1; /* may overflow a double */
    return i;
}

static idx skip_scalar(const uint8_t *b, idx i, idx n) {
    uint8_t c = b[i];
    if (c == '"') return skip_string(b, i, n);
    if (c == '-' || (c >= '0' && c <= '9')) return skip_number(b, i, n);
    if (c == 't') return (i + 4 <= n && !memcmp(b + i, "true", 4)) ? i + 4 : -1;
    if (c == 'f') return (i + 5 <= n && !memcmp(b + i, "false", 5)) ? i + 5 : -1;
    if (c == 'n') return (i + 4 <= n && !memcmp(b + i, "null", 4)) ? i + 4 : -1;
    return -1;
}

/* Validate `"key" :` at i; the index of the member's value, or -1. *key_end (when given) is set to the index of
 * the key's closing quote: the key's raw bytes are b[i + 1 .. *key_end). */
static idx member_key(const uint8_t *b, idx i, idx n, idx *key_end) {
    if (i >= n || b[i] != '"') return -1;
    i = skip_string(b, i, n);
    if (i < 0) return -1;
    if (key_end) *key_end = i - 1;
    i = skip_ws(b, i, n);
    if (i >= n || b[i] != ':') return -1;
    i = skip_ws(b, i + 1, n);
    return i < n ? i : -1;
}

/* Validate the JSON value at i (nesting up to MAX_DEPTH); the index after it, or -1. */
static idx skip_value(const uint8_t *b, idx i, idx n) {
    uint8_t stack[MAX_DEPTH];
    int depth = 0;
    for (;;) {
        uint8_t c = b[i]; /* the start of a value */
        if (c == '{' || c == '[') {
            if (depth == MAX_DEPTH) return -1;
            stack[depth++] = c;
            i = skip_ws(b, i + 1, n);
            if (i >= n) return -1;
            if ((c == '{' && b[i] == '}') || (c == '[' && b[i] == ']')) {
                i++;
                depth--;
            } else if (c == '{') {
                if ((i = member_key(b, i, n, NULL)) < 0) return -1;
                continue;
            } else {
                continue;
            }
        } else if ((i = skip_scalar(b, i, n)) < 0) {
            return -1;
        }
        for (;;) { /* after a value: close containers, or go on to the next element */
            if (depth == 0) return i;
            i = skip_ws(b, i, n);
            if (i >= n) return -1;
            c = b[i];
            uint8_t top = stack[depth - 1];
            if (c == ',') {
                i = skip_ws(b, i + 1, n);
                if (i >= n) return -1;
                if (top == '{' && (i = member_key(b, i, n, NULL)) < 0) return -1;
                break;
            }
            if ((top == '{' && c == '}') || (top == '[' && c == ']')) {
                i++;
                depth--;
                continue;
            }
            return -1;
        }
    }
}

/* The scan: documents, or DECLINE; *used and *lines are set on success. */
static idx scan(const uint8_t *b, idx n, const uint8_t *key, idx key_len, uint8_t *out, idx *used, idx *lines) {
    idx i = 0, o = 0, docs = 0, newlines = 0;
    while (i < n) {
        i = skip_ws(b, i, n);
        if (i >= n) break;
        if (b[i] == '\n') { /* a blank line */
            i++;
            newlines++;
            continue;
        }
        if (b[i] != '{') return DECLINE; /* only an object holds a field */
        i = skip_ws(b, i + 1, n);
        if (i >= n || b[i] != '"') return DECLINE; /* also "{}": no field */
        int found = 0;
        for (;;) {
            idx key_start = i + 1, key_end;
            if ((i = member_key(b, i, n, &key_end)) < 0) return DECLINE;
            if (memchr(b + key_start, '\\', key_end - key_start)) return DECLINE; /* may decode to the field's name */
            if (key_end - key_start == key_len && !memcmp(b + key_start, key, key_len)) {
                if (found || b[i] != '"') return DECLINE; /* a second value (orjson keeps the last), or no string */
                idx start = o;
                if ((i = scan_string(b, i, n, out, &o)) < 0 || !visible(out, start, o)) return DECLINE;
                out[o++] = 0xFF;
                found = 1;
            } else if ((i = skip_value(b, i, n)) < 0) {
                return DECLINE;
            }
            i = skip_ws(b, i, n);
            if (i >= n) return DECLINE;
            if (b[i] == ',') {
                i = skip_ws(b, i + 1, n);
                continue;
            }
            if (b[i] == '}') {
                i++;
                break;
            }
            return DECLINE;
        }
        if (!found) return DECLINE;
        i = skip_ws(b, i, n);
        if (i < n) {
            if (b[i] != '\n') return DECLINE; /* more after the object on its line */
            i++;
            newlines++;
        }
        docs++;
    }
    *used = o;
    *lines = newlines + (n > 0 && b[n - 1] != '\n'); /* a final newline ends the last line, adds none */
    return docs;
}

static PyObject *extract(PyObject *self, PyObject *args) {
    Py_buffer block, key;
    if (!PyArg_ParseTuple(args, "y*y*", &block, &key)) return NULL;
    PyObject *texts = PyBytes_FromStringAndSize(NULL, block.len + 1); /* a document is never longer than its line */
    if (!texts) {
        PyBuffer_Release(&block);
        PyBuffer_Release(&key);
        return NULL;
    }
    idx docs, used = 0, lines = 0;
    Py_BEGIN_ALLOW_THREADS
    docs = scan((const uint8_t *)block.buf, block.len, (const uint8_t *)key.buf, key.len,
                (uint8_t *)PyBytes_AS_STRING(texts), &used, &lines);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&block);
    PyBuffer_Release(&key);
    if (docs < 0) {
        Py_DECREF(texts);
        Py_RETURN_NONE;
    }
    if (_PyBytes_Resize(&texts, used) < 0) return NULL;
    return Py_BuildValue("nnN", docs, lines, texts);
}

/* extract_blocks(buffer, key, ranges, stop) -> [extract(buffer[start:end], key) for (start, end) in ranges]
 *   All in one call without the GIL, so that it runs beside a thread that holds the GIL for long (gigatoken
 *   loading a tokenizer: 0.1 s). It stops before the next block once stop[0] (a bytearray another thread sets)
 *   is nonzero, and returns the results it has: a list as long as the blocks it did. */
static PyObject *extract_blocks(PyObject *self, PyObject *args) {
    Py_buffer buf, key, stop;
    PyObject *ranges, *fast = NULL, *result = NULL;
    if (!PyArg_ParseTuple(args, "y*y*Ow*", &buf, &key, &ranges, &stop)) return NULL;
    idx n = 0, done = 0, i;
    idx *spans = NULL, *counts = NULL; /* spans: start, end per block; counts: docs, used, lines per block */
    PyObject **texts = NULL;
    uint8_t **outs = NULL;
    if (stop.len < 1) {
        PyErr_SetString(PyExc_ValueError, "stop must be a bytearray of at least one byte");
        goto out;
    }
    if (!(fast = PySequence_Fast(ranges, "ranges must be a sequence of (start, end) pairs"))) goto out;
    n = PySequence_Fast_GET_SIZE(fast);
    spans = PyMem_Calloc(2 * n + 1, sizeof(idx));
    counts = PyMem_Calloc(3 * n + 1, sizeof(idx));
    texts = PyMem_Calloc(n + 1, sizeof(PyObject *));
    outs = PyMem_Calloc(n + 1, sizeof(uint8_t *));
    if (!spans || !counts || !texts || !outs) {
        PyErr_NoMemory();
        goto out;
    }
    for (i = 0; i < n; i++) {
        idx start, end;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "nn", &start, &end)) goto out;
        if (start < 0 || end < start || end > buf.len) {
            PyErr_Format(PyExc_ValueError, "block (%zd, %zd) is not within the buffer of %zd bytes", start, end,
                         buf.len);
            goto out;
        }
        spans[2 * i] = start;
        spans[2 * i + 1] = end;
        /* untouched until written: a block's pages are only committed as its texts fill them */
        if (!(texts[i] = PyBytes_FromStringAndSize(NULL, end - start + 1))) goto out;
        outs[i] = (uint8_t *)PyBytes_AS_STRING(texts[i]);
    }
    Py_BEGIN_ALLOW_THREADS
    for (done = 0; done < n; done++) {
        if (((volatile uint8_t *)stop.buf)[0]) break;
        idx start = spans[2 * done], end = spans[2 * done + 1];
        counts[3 * done] = scan((const uint8_t *)buf.buf + start, end - start, (const uint8_t *)key.buf, key.len,
                                outs[done], &counts[3 * done + 1], &counts[3 * done + 2]);
    }
    Py_END_ALLOW_THREADS
    if (!(result = PyList_New(done))) goto out;
    for (i = 0; i < done; i++) {
        PyObject *item;
        if (counts[3 * i] < 0) {
            Py_INCREF(Py_None);
            item = Py_None;
        } else {
            if (_PyBytes_Resize(&texts[i], counts[3 * i + 1]) < 0) {
                Py_CLEAR(result);
                goto out;
            }
            item = Py_BuildValue("nnO", counts[3 * i], counts[3 * i + 2], texts[i]);
            if (!item) {
                Py_CLEAR(result);
                goto out;
            }
        }
        PyList_SET_ITEM(result, i, item);
    }
out:
    if (texts)
        for (i = 0; i < n; i++) Py_XDECREF(texts[i]);
    PyMem_Free(spans);
    PyMem_Free(counts);
    PyMem_Free(texts);
    PyMem_Free(outs);
    Py_XDECREF(fast);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&key);
    PyBuffer_Release(&stop);
    return result;
}

static PyMethodDef methods[] = {
    {"extract", extract, METH_VARARGS,
     "extract(block, key) -> (documents, lines, texts) or None: see corpusforge/jsonl_field.py"},
    {"extract_blocks", extract_blocks, METH_VARARGS,
     "extract_blocks(buffer, key, ranges, stop) -> [extract(buffer[a:b], key) for (a, b) in ranges], without the "
     "GIL, ending early once stop[0] is set"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jsonl_field", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jsonl_field(void) { return PyModule_Create(&module); }
