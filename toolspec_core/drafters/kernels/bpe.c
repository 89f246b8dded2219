/* A byte-level BPE encoder for ASCII text, the ids a Qwen2-family fast tokenizer gives, in C.
 *
 * Drafting tokenizes every schema candidate together with the last committed tokens (the
 * boundary tokenizer), several times per sequence per step, and the fast tokenizer's per-call
 * pipeline (normalizer, Unicode regex pre-tokenizer, an Encoding with offsets and token strings)
 * costs tens of microseconds for a few dozen characters. Candidates are tool names, keys, JSON
 * punctuation and values: mostly ASCII, where that pipeline reduces to (NFC is the identity on
 * ASCII) the pre-tokenizer's regex
 *     (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|
 *     \s*[\r\n]+|\s+(?!\S)|\s+
 * (leftmost-first alternation, each alternative's backtracking written out below) and BPE over
 * each piece's bytes: repeatedly merge the adjacent pair of lowest merge rank, the leftmost on a
 * tie (what the tokenizer's merge queue does). Text this does not cover -- a byte >= 0x80, an
 * ASCII control character other than tab / LF / CR, an added token's text -- is answered None and
 * the caller uses the tokenizer itself (tools/tests hold the two equal: tests/drafters/test_bpe.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint64_t *keys; /* (left id + 1) << 32 | right id; 0: empty */
    uint32_t *rank, *merged;
    uint64_t cap;
    long byte_id[256];
    PyObject *added; /* tuple of bytes: added tokens' texts (owned) */
} Bpe;

static inline uint64_t hmix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static void bpe_free(PyObject *capsule) {
    Bpe *b = PyCapsule_GetPointer(capsule, "toolspec_bpe");
    if (!b) return;
    free(b->keys);
    free(b->rank);
    free(b->merged);
    Py_XDECREF(b->added);
    free(b);
}

static inline int pair_get(const Bpe *b, long l, long r, uint32_t *rank, uint32_t *merged) {
    uint64_t k = ((uint64_t)(l + 1) << 32) | (uint32_t)r;
    uint64_t h = hmix(k) & (b->cap - 1);
    while (b->keys[h]) {
        if (b->keys[h] == k) {
            *rank = b->rank[h];
            *merged = b->merged[h];
            return 1;
        }
        h = (h + 1) & (b->cap - 1);
    }
    return 0;
}

/* make(byte_ids, merges, added): byte_ids: 256 ids (the token of each single byte); merges: a
 * list of (left id, right id, merged id) in rank order; added: a tuple of bytes. A capsule. */
static PyObject *make(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *byte_ids, *merges, *added;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &byte_ids, &PyList_Type, &merges, &PyTuple_Type, &added))
        return NULL;
    if (PyList_GET_SIZE(byte_ids) != 256) {
        PyErr_SetString(PyExc_ValueError, "256 byte ids");
        return NULL;
    }
    Bpe *b = calloc(1, sizeof(Bpe));
    if (!b) return PyErr_NoMemory();
    for (int i = 0; i < 256; i++) {
        b->byte_id[i] = PyLong_AsLong(PyList_GET_ITEM(byte_ids, i));
        if (b->byte_id[i] == -1 && PyErr_Occurred()) goto fail;
    }
    Py_ssize_t n = PyList_GET_SIZE(merges);
    uint64_t cap = 1024;
    while (cap < (uint64_t)n * 3) cap <<= 1;
    b->cap = cap;
    b->keys = calloc(cap, sizeof(uint64_t));
    b->rank = calloc(cap, sizeof(uint32_t));
    b->merged = calloc(cap, sizeof(uint32_t));
    if (!b->keys || !b->rank || !b->merged) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long l, r, m;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(merges, i), "lll", &l, &r, &m)) goto fail;
        uint64_t k = ((uint64_t)(l + 1) << 32) | (uint32_t)r;
        uint64_t h = hmix(k) & (cap - 1);
        while (b->keys[h] && b->keys[h] != k) h = (h + 1) & (cap - 1);
        if (b->keys[h]) continue; /* a pair listed twice: its first (lowest) rank holds */
        b->keys[h] = k;
        b->rank[h] = (uint32_t)i;
        b->merged[h] = (uint32_t)m;
    }
    Py_INCREF(added);
    b->added = added;
    PyObject *cap_obj = PyCapsule_New(b, "toolspec_bpe", bpe_free);
    if (!cap_obj) {
        Py_DECREF(added);
        goto fail;
    }
    return cap_obj;
fail:
    free(b->keys);
    free(b->rank);
    free(b->merged);
    free(b);
    return NULL;
}

static inline int is_letter(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
static inline int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static inline int is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static inline int is_nl(unsigned char c) { return c == '\n' || c == '\r'; }
static inline int is_punct(unsigned char c) { return !is_space(c) && !is_letter(c) && !is_digit(c); }
static inline unsigned char lower(unsigned char c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

/* The length of the pre-token starting at s[i] (n > i): the regex's first matching alternative. */
static Py_ssize_t piece(const unsigned char *s, Py_ssize_t n, Py_ssize_t i) {
    unsigned char c = s[i];
    /* (?i:'s|'t|'re|'ve|'m|'ll|'d) */
    if (c == '\'' && i + 1 < n) {
        unsigned char a = lower(s[i + 1]);
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
        if (i + 2 < n) {
            unsigned char b = lower(s[i + 2]);
            if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
        }
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    {
        Py_ssize_t j = i;
        if (!is_nl(c) && !is_letter(c) && !is_digit(c) && i + 1 < n && is_letter(s[i + 1])) j = i + 1;
        if (is_letter(s[j])) {
            while (j < n && is_letter(s[j])) j++;
            return j - i;
        }
    }
    /* \p{N} */
    if (is_digit(c)) return 1;
    /* ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
    {
        Py_ssize_t j = i;
        if (c == ' ' && i + 1 < n && is_punct(s[i + 1])) j = i + 1;
        if (is_punct(s[j])) {
            while (j < n && is_punct(s[j])) j++;
            while (j < n && is_nl(s[j])) j++;
            return j - i;
        }
    }
    /* the rest start with whitespace */
    Py_ssize_t end = i;
    while (end < n && is_space(s[end])) end++;
    /* \s*[\r\n]+: up to the run's last newline */
    for (Py_ssize_t k = end - 1; k >= i; k--)
        if (is_nl(s[k])) return k + 1 - i;
    /* \s+(?!\S): the run, less its last character where a non-space follows */
    if (end == n) return end - i;
    if (end - 1 > i) return end - 1 - i;
    /* \s+ */
    return end - i;
}

/* BPE over the bytes s[0..n): ids appended to out. */
static int merge_piece(const Bpe *b, const unsigned char *s, Py_ssize_t n, long *sym, PyObject *out) {
    Py_ssize_t m = n;
    for (Py_ssize_t i = 0; i < n; i++) sym[i] = b->byte_id[s[i]];
    while (m > 1) {
        uint32_t best = UINT32_MAX, best_id = 0, r, id;
        Py_ssize_t at = -1;
        for (Py_ssize_t i = 0; i + 1 < m; i++)
            if (pair_get(b, sym[i], sym[i + 1], &r, &id) && r < best) {
                best = r;
                best_id = id;
                at = i;
            }
        if (at < 0) break;
        sym[at] = best_id;
        memmove(sym + at + 1, sym + at + 2, (m - at - 2) * sizeof(long));
        m--;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *t = PyLong_FromLong(sym[i]);
        if (!t || PyList_Append(out, t)) {
            Py_XDECREF(t);
            return -1;
        }
        Py_DECREF(t);
    }
    return 0;
}

/* encode(bpe, text: str): the ids (a tuple), or None where the text is not covered. */
static PyObject *encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *capsule, *text;
    if (!PyArg_ParseTuple(args, "OU", &capsule, &text)) return NULL;
    Bpe *b = PyCapsule_GetPointer(capsule, "toolspec_bpe");
    if (!b) return NULL;
    if (!PyUnicode_IS_ASCII(text)) Py_RETURN_NONE;
    const unsigned char *s = (const unsigned char *)PyUnicode_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    for (Py_ssize_t i = 0; i < n; i++)
        if ((s[i] < 0x20 && s[i] != '\t' && s[i] != '\n' && s[i] != '\r') || s[i] == 0x7f) Py_RETURN_NONE;
    Py_ssize_t na = PyTuple_GET_SIZE(b->added);
    for (Py_ssize_t k = 0; k < na; k++) {
        PyObject *a = PyTuple_GET_ITEM(b->added, k);
        Py_ssize_t la = PyBytes_GET_SIZE(a);
        if (la && la <= n && memmem(s, n, PyBytes_AS_STRING(a), la)) Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(0);
    long *sym = malloc((n ? n : 1) * sizeof(long));
    if (!out || !sym) {
        Py_XDECREF(out);
        free(sym);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t len = piece(s, n, i);
        if (merge_piece(b, s + i, len, sym, out)) {
            Py_DECREF(out);
            free(sym);
            return NULL;
        }
        i += len;
    }
    free(sym);
    PyObject *tup = PyList_AsTuple(out);
    Py_DECREF(out);
    return tup;
}

/* label_tokens(toks, text_labels, chars, chars_of): BoundaryTokenizer._label_tokens -- each
 * token's label, that of the first segment ending after the token's first character (the last
 * segment's past the end), a token's characters from the dict ``chars`` or, on a miss,
 * ``chars_of(token)`` (which fills the dict). A list of labels. */
static PyObject *label_tokens(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *toks, *text_labels, *chars, *chars_of;
    if (!PyArg_ParseTuple(args, "O!O!O!O", &PyList_Type, &toks, &PyList_Type, &text_labels, &PyDict_Type, &chars,
                          &chars_of))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(toks), last = PyList_GET_SIZE(text_labels) - 1, j = 0;
    if (last < 0 && n) {
        PyErr_SetString(PyExc_ValueError, "tokens without segments");
        return NULL;
    }
    long long pos = 0;
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        while (j < last) {
            PyObject *end = PyTuple_GetItem(PyList_GET_ITEM(text_labels, j), 0);
            if (!end) goto fail;
            long long e = PyLong_AsLongLong(end);
            if (e == -1 && PyErr_Occurred()) goto fail;
            if (pos < e) break;
            j++;
        }
        PyObject *lab = PyTuple_GetItem(PyList_GET_ITEM(text_labels, j), 1);
        if (!lab) goto fail;
        Py_INCREF(lab);
        PyList_SET_ITEM(out, i, lab);
        PyObject *t = PyList_GET_ITEM(toks, i);
        PyObject *c = PyDict_GetItemWithError(chars, t);
        long long nc;
        if (c) {
            nc = PyLong_AsLongLong(c);
        } else {
            if (PyErr_Occurred()) goto fail;
            PyObject *r = PyObject_CallOneArg(chars_of, t);
            if (!r) goto fail;
            nc = PyLong_AsLongLong(r);
            Py_DECREF(r);
        }
        if (nc == -1 && PyErr_Occurred()) goto fail;
        pos += nc;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"label_tokens", label_tokens, METH_VARARGS, "Each token's segment label (BoundaryTokenizer._label_tokens)."},
    {"make", make, METH_VARARGS, "An encoder from its byte ids, merges and added tokens."},
    {"encode", encode, METH_VARARGS, "The ids of an ASCII text, or None where the tokenizer must answer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "toolspec_bpe", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_toolspec_bpe(void) { return PyModule_Create(&module); }
